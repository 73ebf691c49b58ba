// `fsdp inspect`: prints how a model's parameters are flattened and sharded,
// per FSDP unit and per rank, as a readable table or as the layout JSON
// document (flatparam/layout_json.h).
//
//   fsdp inspect --model=llama2-70b --world-size=8 --format=table
//
// RunInspect is the whole command minus flag parsing, so tests call it
// directly. Thread-safety: reentrant; it writes only to `out`.
#ifndef TOOLS_INSPECT_H_
#define TOOLS_INSPECT_H_

#include <nlohmann/json_fwd.hpp>
#include <ostream>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "tools/layout_request.h"

namespace flatparam {
namespace tools {

enum class OutputFormat { kTable, kJson };

// "table" or "json"; InvalidArgument naming the value otherwise.
absl::StatusOr<OutputFormat> ParseOutputFormat(absl::string_view name);

struct InspectOptions {
  LayoutRequest layout;
  // "table" or "json".
  std::string format = "table";
};

// Resolves `options.layout` and writes the layout to `out` in the requested
// format. On error nothing is written and the status names the offending
// flag or model value.
absl::Status RunInspect(const InspectOptions& options, std::ostream& out);

// The layout JSON document of `resolved`, reporting W and G.
nlohmann::json InspectJson(const ResolvedLayout& resolved);

// The table: a summary, per unit a header line and one row per shard rank,
// and a total line. Shard groups larger than 32 ranks show the first 16 and
// last 4 ranks; a rank holding more than 6 parameters lists the first 3 and
// last 2.
void PrintLayoutTable(const ResolvedLayout& resolved, std::ostream& out);

// "1.50 GiB": `bytes` in binary units with two decimals ("512 B" below 1 KiB).
std::string HumanBytes(int64_t bytes);

}  // namespace tools
}  // namespace flatparam

#endif  // TOOLS_INSPECT_H_
