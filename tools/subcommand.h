// The `fsdp` tool's subcommands.
//
// `fsdp SUBCOMMAND [--flags...] [args...]`: fsdp_main.cc picks the
// subcommand by argv[1], parses the absl flags (accepting `--world-size` for
// `--world_size`), and calls its `run` with the positional arguments left
// after the subcommand name. To add a subcommand "foo": write foo.{h,cc}
// with a testable core (like RunInspect), foo_command.cc defining
// `kFooSubcommand`, declare it below and list it in fsdp_main.cc.
//
// Thread-safety: `run` functions are called once, from main.
#ifndef TOOLS_SUBCOMMAND_H_
#define TOOLS_SUBCOMMAND_H_

#include <ostream>
#include <vector>

#include "absl/strings/string_view.h"

namespace flatparam {
namespace tools {

// Process exit codes of every subcommand.
inline constexpr int kExitOk = 0;
inline constexpr int kExitError = 1;  // The command failed (message on stderr).
inline constexpr int kExitUsage = 2;  // The command line was wrong.

struct Subcommand {
  absl::string_view name;
  // One line for `fsdp` usage.
  absl::string_view summary;
  // Writes the full help for `fsdp NAME --help`: synopsis and flags.
  void (*print_help)(std::ostream& out);
  // Runs the subcommand after flag parsing; `args` are the positional
  // arguments after the subcommand name. Returns the exit code.
  int (*run)(const std::vector<char*>& args);
};

extern const Subcommand kInspectSubcommand;
extern const Subcommand kCollectivesSubcommand;
extern const Subcommand kTrainSubcommand;
extern const Subcommand kCheckpointSubcommand;
extern const Subcommand kPlanSubcommand;
extern const Subcommand kDemoSubcommand;
extern const Subcommand kModelSubcommand;
extern const Subcommand kDiagnoseSubcommand;

}  // namespace tools
}  // namespace flatparam

#endif  // TOOLS_SUBCOMMAND_H_
