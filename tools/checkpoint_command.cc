// `fsdp checkpoint ACTION`: flags in, RunCheckpoint, exit code out.
#include <unistd.h>

#include <iostream>
#include <ostream>
#include <string>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "tools/checkpoint.h"
#include "tools/common_flags.h"
#include "tools/subcommand.h"

ABSL_FLAG(std::string, in, "", "checkpoint: the input checkpoint directory.");
ABSL_FLAG(std::string, out, "",
          "checkpoint: the output checkpoint directory (written atomically).");
// Defined by `fsdp train`; `checkpoint init` also accepts "none".
ABSL_DECLARE_FLAG(std::string, optimizer);

namespace flatparam {
namespace tools {
namespace {

int CheckpointMain(const std::vector<char*>& args) {
  if (args.size() != 1) {
    std::cerr << "fsdp checkpoint: expected one action (init, shard, "
                 "reshard, consolidate or verify)"
              << (args.size() > 1
                      ? std::string(", got also \"") + args[1] + "\""
                      : std::string())
              << "; see fsdp checkpoint --help\n";
    return kExitUsage;
  }
  CheckpointCommand command;
  command.action = args[0];
  command.in = absl::GetFlag(FLAGS_in);
  command.out = absl::GetFlag(FLAGS_out);
  command.layout = LayoutRequestFromFlags();
  command.world_size_set = FlagChanged("world_size");
  command.seed = absl::GetFlag(FLAGS_seed);
  command.optimizer = absl::GetFlag(FLAGS_optimizer);
  if (absl::Status s = ValidateCheckpointCommand(command); !s.ok()) {
    std::cerr << "fsdp checkpoint: " << s.message()
              << "; see fsdp checkpoint --help\n";
    return kExitUsage;
  }
  const absl::Status status =
      RunCheckpoint(command, std::cout, std::cerr, isatty(STDERR_FILENO) == 1);
  std::cout.flush();
  if (!status.ok()) {
    std::cerr << "fsdp checkpoint " << command.action << ": "
              << status.message() << "\n";
    return kExitError;
  }
  return std::cout.good() ? kExitOk : kExitError;
}

constexpr char kHelp[] =
    "usage: fsdp checkpoint init        --model=NAME|PATH --out=FULL\n"
    "                                   [--seed=N] "
    "[--optimizer=adamw|sgd|none]\n"
    "       fsdp checkpoint shard       --in=FULL --model=NAME|PATH "
    "[--world-size=W]\n"
    "                                   [layout flags] --out=SHARDED\n"
    "       fsdp checkpoint reshard     --in=SHARDED [--world-size=W] "
    "[layout flags]\n"
    "                                   --out=SHARDED2\n"
    "       fsdp checkpoint consolidate --in=SHARDED --out=FULL\n"
    "       fsdp checkpoint verify      --in=DIR\n"
    "\n"
    "Offline checkpoint tools, in one process without communication. They\n"
    "stream: memory is bounded by one chunk (4 MiB) plus metadata, never the\n"
    "model. Outputs are written atomically (a crash leaves the previous\n"
    "output or the new one). init writes a full checkpoint of deterministic\n"
    "pseudo-random weights and optimizer state; verify checks the manifest,\n"
    "every checksum, every rank file against the layout and every sidecar.\n"
    "A summary line (bytes, seconds, MB/s, peak RSS) goes to stdout; a\n"
    "progress bar to stderr when it is a terminal.\n"
    "\n"
    "Exit codes: 0 ok, 1 the checkpoint could not be read or written, 2 bad\n"
    "command line.\n"
    "\n"
    "flags:\n"
    "  --in=DIR                 input checkpoint directory\n"
    "  --out=DIR                output checkpoint directory\n"
    "  --seed=N                 init: the weights' seed (default 0)\n"
    "  --optimizer=O            init: adamw (default), sgd or none\n"
    "layout flags (shard, reshard; --model also for init):\n";

void PrintHelp(std::ostream& out) { out << kHelp << kLayoutFlagsHelp; }

}  // namespace

const Subcommand kCheckpointSubcommand = {
    "checkpoint",
    "init, shard, reshard, consolidate and verify checkpoints offline",
    PrintHelp,
    CheckpointMain,
};

}  // namespace tools
}  // namespace flatparam
