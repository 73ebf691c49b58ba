// `fsdp demo`: flags in, RunDemo, report and exit code out.
#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <ostream>
#include <string>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "absl/status/statusor.h"
#include "flatparam/checkpoint/file_system.h"
#include "tools/common_flags.h"
#include "tools/demo.h"
#include "tools/subcommand.h"

// Defined by the checkpoint and train subcommands.
ABSL_DECLARE_FLAG(std::string, out);
ABSL_DECLARE_FLAG(int64_t, steps);

namespace flatparam {
namespace tools {
namespace {

// $TMPDIR/fsdp-demo, or /tmp/fsdp-demo.
std::string DefaultOutDir() {
  const char* tmp = std::getenv("TMPDIR");
  return checkpoint::JoinPath(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp",
                              "fsdp-demo");
}

int DemoMain(const std::vector<char*>& args) {
  if (!args.empty()) {
    std::cerr << "fsdp demo: unexpected argument \"" << args[0]
              << "\"; see fsdp demo --help\n";
    return kExitUsage;
  }
  DemoOptions options;
  options.out_dir = absl::GetFlag(FLAGS_out);
  if (options.out_dir.empty()) options.out_dir = DefaultOutDir();
  options.steps = absl::GetFlag(FLAGS_steps);
  options.seed = absl::GetFlag(FLAGS_seed);
  if (options.steps < 1) {
    std::cerr << "fsdp demo: --steps must be >= 1, got " << options.steps
              << "\n";
    return kExitUsage;
  }
  absl::StatusOr<DemoResult> result = RunDemo(options, std::cout);
  if (!result.ok()) {
    std::cout.flush();
    std::cerr << "fsdp demo: " << result.status().message() << "\n";
    return kExitError;
  }
  PrintDemoReport(*result, std::cout);
  std::cout.flush();
  return result->passed() && std::cout.good() ? kExitOk : kExitError;
}

constexpr char kHelp[] =
    "usage: fsdp demo [--out=DIR] [--steps=K] [--seed=N]\n"
    "\n"
    "The whole system in one command, on the deterministic simulator:\n"
    "trains the reference model with AdamW on 8 ranks with FULL_SHARD and\n"
    "checks it bitwise against single-process training, saves a sharded\n"
    "checkpoint, reshards it offline to HYBRID_SHARD on 2x2 ranks, resumes\n"
    "from it for K more steps and checks again (against single-process\n"
    "training of all 2K steps), verifies every checkpoint and consolidates\n"
    "the last one. Then trains a GPT-2-style transformer written with\n"
    "LibTorch under FsdpModule on 4 ranks, byte-level on GPL-3's text, and\n"
    "checks it bitwise against single-process LibTorch training (skipped\n"
    "without LibTorch). Prints the loss per step, per-rank memory, bytes\n"
    "communicated, the checks and where the Chrome traces and checkpoints\n"
    "were written. Exits 1 if a check fails.\n"
    "\n"
    "flags:\n"
    "  --out=DIR     where checkpoints and traces go (default\n"
    "                $TMPDIR/fsdp-demo or /tmp/fsdp-demo; replaced when\n"
    "                there)\n"
    "  --steps=K     steps before and after the checkpoint (default 3)\n"
    "  --seed=N      seeds the model, the data and the simulator (default 0)\n";

void PrintHelp(std::ostream& out) { out << kHelp; }

}  // namespace

const Subcommand kDemoSubcommand = {
    "demo",
    "train, checkpoint, reshard and resume on simulated ranks, with checks",
    PrintHelp,
    DemoMain,
};

}  // namespace tools
}  // namespace flatparam
