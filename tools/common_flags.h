// Command-line flags shared by the `fsdp` subcommands, defined once so that
// every subcommand spells and defaults them the same way. Names use
// underscores (absl's rule); fsdp_main.cc also accepts dashes
// (`--world-size=8`).
//
// Thread-safety: read the flags only after absl::ParseCommandLine.
#ifndef TOOLS_COMMON_FLAGS_H_
#define TOOLS_COMMON_FLAGS_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "tools/layout_request.h"

ABSL_DECLARE_FLAG(std::string, model);
ABSL_DECLARE_FLAG(int64_t, world_size);
ABSL_DECLARE_FLAG(std::string, strategy);
ABSL_DECLARE_FLAG(bool, align_addresses);
ABSL_DECLARE_FLAG(std::string, compute_dtype);
ABSL_DECLARE_FLAG(std::string, dtype);
ABSL_DECLARE_FLAG(int64_t, shard_group_size);
ABSL_DECLARE_FLAG(std::string, format);
// The backend of the subcommands that communicate (collectives, train).
ABSL_DECLARE_FLAG(std::string, backend);
ABSL_DECLARE_FLAG(uint64_t, seed);
// The longest any one collective of the subcommands that communicate
// (collectives, train) may wait; unset: the subcommand's own default
// (collectives 30 s, train 5 min). They reject a non-positive value.
ABSL_DECLARE_FLAG(std::optional<absl::Duration>, timeout);
// The subcommands that write a directory or file (checkpoint, train --save,
// model): write into an output that holds files they did not write, keeping
// those files and replacing only same-named ones (the summary lists both).
ABSL_DECLARE_FLAG(bool, overwrite);
// The subcommands that communicate: the flight recorder's dump directory
// (empty: $FLATPARAM_TRACE_DIR), and the fingerprint check before every
// collective.
ABSL_DECLARE_FLAG(std::string, trace_dir);
ABSL_DECLARE_FLAG(bool, desync_check);

namespace flatparam {
namespace tools {

// Records the flags given on the command line (underscored names, as
// fsdp_main.cc passes them to absl; "--noX" records X too), for
// FlagChanged. fsdp_main.cc calls it once, before the subcommand runs.
void SetGivenFlags(const std::vector<std::string>& args);

// True when flag `name` (underscored) was given on the command line,
// whatever its value (so `--world-size=8` counts although 8 is the
// default). Without SetGivenFlags (a test that sets flags itself): when
// its value differs from the default.
bool FlagChanged(absl::string_view name);

// The layout flags as a request (not yet validated).
LayoutRequest LayoutRequestFromFlags();

// Help text for the layout flags, one per line, for subcommand help.
extern const char kLayoutFlagsHelp[];

// "presets: gpt2, gpt2-medium, ..." wrapped at 76 columns, every preset
// --model accepts (PresetNames()), for subcommand help.
std::string PresetsHelp();

}  // namespace tools
}  // namespace flatparam

#endif  // TOOLS_COMMON_FLAGS_H_
