// Private to //flatparam/interop/hf: what the pieces of hf_checkpoint.h
// share. hf_checkpoint.cc (the reader) defines the small helpers the
// import (hf_import.cc) and the export (hf_export.cc) use too;
// hf_optim_import.cc defines the optimizer half of the import, which
// ImportHfCheckpoint calls.
//
// Ownership: PlanOptimizerImport's plan borrows the layout and the file it
// opens into `file`, which must outlive it. Thread-safety: pure functions
// apart from the file system and readers they are given; a Problems is used
// by one thread.
#ifndef FLATPARAM_INTEROP_HF_INTERNAL_HF_INTERNAL_H_
#define FLATPARAM_INTEROP_HF_INTERNAL_HF_INTERNAL_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "flatparam/base/dtype.h"
#include "flatparam/checkpoint/file_system.h"
#include "flatparam/checkpoint/internal/full_optim_shards.h"
#include "flatparam/checkpoint/safetensors.h"
#include "flatparam/interop/hf/hf_checkpoint.h"
#include "flatparam/layout.h"

namespace flatparam {
namespace checkpoint {
namespace internal_checkpoint {

// A Hugging Face checkpoint's single weights file (no index).
inline constexpr char kSingleFileName[] = "model.safetensors";

// A chunk size for the writers: a multiple of 8, at least 8.
uint64_t ChunkBytes(uint64_t requested);

// Problems found while checking, reported together.
class Problems {
 public:
  void Add(std::string problem) { list_.push_back(std::move(problem)); }
  bool empty() const { return list_.empty(); }

  absl::Status ToStatus(absl::StatusCode code, absl::string_view what) const {
    if (list_.empty()) return absl::OkStatus();
    if (list_.size() == 1) {
      return absl::Status(code, absl::StrCat(what, ": ", list_[0]));
    }
    std::string message =
        absl::StrFormat("%s: %d problems:", what, list_.size());
    for (size_t i = 0; i < list_.size(); ++i) {
      if (i == static_cast<size_t>(kMaxReportedProblems)) {
        absl::StrAppendFormat(&message, "\n  ... and %d more",
                              list_.size() - i);
        break;
      }
      absl::StrAppend(&message, "\n  ", list_[i]);
    }
    return absl::Status(code, message);
  }

 private:
  std::vector<std::string> list_;
};

// The output replaces whatever is at `out`: it must be neither the input
// nor a directory holding it.
absl::Status CheckDistinct(const std::string& in_arg,
                           const std::string& out_arg);

// Reads `n` elements of `src_dtype` with `read` (which takes byte offsets
// and spans in the source) starting at element `first`, converted to
// `dst_dtype`, into `out`; through a scratch buffer of at most
// kCastScratchBytes.
absl::Status ReadConverted(
    const std::function<absl::Status(uint64_t, absl::Span<char>)>& read,
    DType src_dtype, DType dst_dtype, uint64_t first, uint64_t n, char* out);

// Whether `path` is a directory; false when it does not exist.
absl::StatusOr<bool> IsDir(FileSystem& fs, const std::string& path);

// Whether a file of the input directory holds optimizer state: this
// project's pair (optim.safetensors, optim.json) or another tool's
// (optimizer.pt, optimizer.bin, optim.pt, optim_states.pt, ...).
bool IsOptimizerFileName(absl::string_view name);

// The optimizer state of `dir` (optim.safetensors and optim.json, both
// present), planned for sharding as ShardCheckpoint plans a full
// checkpoint's. `file` receives the opened optim.safetensors, which the
// plan borrows. Sets `report`'s optimizer fields.
absl::StatusOr<std::unique_ptr<FullOptimShards>> PlanOptimizerImport(
    FileSystem& fs, const std::string& dir, const ModelLayout& layout,
    std::optional<SafetensorsReader>& file, HfImportReport& report);

}  // namespace internal_checkpoint
}  // namespace checkpoint
}  // namespace flatparam

#endif  // FLATPARAM_INTEROP_HF_INTERNAL_HF_INTERNAL_H_
