// `fsdp demo`: the whole system on one command, with no arguments. On the
// deterministic simulator it
//   1. trains the reference model (refmodel/mlp_model.h) with AdamW on
//      8 ranks with FULL_SHARD and checks that losses, parameters and
//      optimizer state are bitwise equal to single-process training, and
//      that every rank's peak memory equals the closed-form formula;
//   2. saves a sharded checkpoint, written collectively by the 8 ranks;
//   3. reshards it offline, in this process, to HYBRID_SHARD on 4 ranks
//      (2 shard groups of 2), streaming (flatparam/checkpoint/convert.h);
//   4. resumes from it on 4 ranks for as many steps again and checks the
//      result against single-process training of all the steps (chained
//      at the checkpoint, each segment with its own run's gradient fold),
//      again bitwise, and saves the final state;
//   5. verifies every checkpoint (manifest, XXH3 checksums, layout) and
//      consolidates the last one into a full (PyTorch-style) checkpoint;
//   6. trains a GPT-2-style transformer written with LibTorch under
//      flatparam's FsdpModule on real text, 4 ranks, FULL_SHARD, and checks
//      it bitwise against single-process LibTorch training and that it
//      learnt (tools/demo_torch.h; skipped, saying so, in a build without
//      LibTorch);
// then prints a short report: the loss per step, every rank's peak memory,
// the bytes communicated, the checks, and where the Chrome traces and the
// checkpoints were written. It exits non-zero when a check fails.
//
// Thread-safety: RunDemo is called once, from main.
#ifndef TOOLS_DEMO_H_
#define TOOLS_DEMO_H_

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "tools/demo_torch.h"
#include "tools/train.h"

namespace flatparam {
namespace tools {

struct DemoOptions {
  // Where checkpoints and traces go; created if missing. Checkpoints there
  // from an earlier demo are replaced (crash-safely).
  std::string out_dir;
  // Steps before and after the checkpoint.
  int64_t steps = 3;
  uint64_t seed = 0;
};

// One check of the report.
struct DemoCheck {
  std::string what;
  bool passed = false;
};

struct DemoResult {
  TrainReport first;      // 8 ranks, FULL_SHARD
  TrainReport second;     // 4 ranks, HYBRID_SHARD, resumed
  TorchDemoResult torch;  // the LibTorch transformer
  std::vector<DemoCheck> checks;
  // Files and directories written.
  std::string first_trace, second_trace;
  std::string first_checkpoint, resharded_checkpoint, final_checkpoint,
      consolidated_checkpoint;
  double seconds = 0;

  bool passed() const;
};

// Runs the demo, printing each stage to `out` as it starts. Errors that
// stop it (a directory that cannot be created, a failed collective) are
// returned; failed checks are in the result.
absl::StatusOr<DemoResult> RunDemo(const DemoOptions& options,
                                   std::ostream& out);

// The report: losses, memory, communication, checks, files.
void PrintDemoReport(const DemoResult& result, std::ostream& out);

}  // namespace tools
}  // namespace flatparam

#endif  // TOOLS_DEMO_H_
