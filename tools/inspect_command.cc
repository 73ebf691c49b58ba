// `fsdp inspect`: flags in, RunInspect, exit code out.
#include <iostream>
#include <ostream>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "tools/common_flags.h"
#include "tools/inspect.h"
#include "tools/subcommand.h"

namespace flatparam {
namespace tools {
namespace {

int InspectMain(const std::vector<char*>& args) {
  if (!args.empty()) {
    std::cerr << "fsdp inspect: unexpected argument \"" << args[0]
              << "\"; see fsdp inspect --help\n";
    return kExitUsage;
  }
  InspectOptions options;
  options.layout = LayoutRequestFromFlags();
  options.format = absl::GetFlag(FLAGS_format);
  const absl::Status status = RunInspect(options, std::cout);
  std::cout.flush();
  if (!status.ok()) {
    std::cerr << "fsdp inspect: " << status.message() << "\n";
    return kExitError;
  }
  return std::cout.good() ? kExitOk : kExitError;
}

constexpr char kHelp[] =
    "usage: fsdp inspect --model=NAME|PATH [--world-size=W] [--strategy=S]\n"
    "                    [--shard-group-size=G] [--align-addresses]\n"
    "                    [--compute-dtype=DTYPE] [--dtype=DTYPE]\n"
    "                    [--format=table|json]\n"
    "\n"
    "Prints each FSDP unit's flat parameter (numel, padding, bytes) and what\n"
    "each rank's shard holds, as PyTorch FSDP lays it out.\n"
    "\n"
    "flags:\n";

void PrintHelp(std::ostream& out) {
  out << kHelp << kLayoutFlagsHelp
      << "  --format=table|json      output format (default table)\n\n"
      << PresetsHelp();
}

}  // namespace

const Subcommand kInspectSubcommand = {
    "inspect",
    "print the flat-parameter layout of a model, per unit and per rank",
    PrintHelp,
    InspectMain,
};

}  // namespace tools
}  // namespace flatparam
