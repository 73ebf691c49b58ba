// `fsdp demo`'s LibTorch stage: a GPT-2-style transformer written with
// LibTorch modules (refmodel/torch_gpt.h) trained byte-level on real text
// (/usr/share/common-licenses/GPL-3, on every Debian machine) under
// flatparam's FsdpModule (flatparam/torch) with AdamW and FULL_SHARD on
// simulated ranks, and the same training single-process
// (refmodel::TrainFolded); the losses and the parameters must be bitwise
// equal. Built with LibTorch where the build found it (demo_torch.cc);
// elsewhere the stage reports itself skipped (demo_torch_unavailable.cc).
//
// Thread-safety: call from one thread (it runs the simulated ranks).
#ifndef TOOLS_DEMO_TORCH_H_
#define TOOLS_DEMO_TORCH_H_

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace flatparam {
namespace tools {

struct TorchDemoResult {
  // False when this build has no LibTorch (or the text is missing):
  // `skipped` says why and nothing else is set.
  bool ran = false;
  std::string skipped;
  std::string text_path;
  int world_size = 0;
  int64_t parameters = 0;
  // Rank 0's loss per step under FSDP, and the single-process run's.
  std::vector<float> losses;
  std::vector<float> reference_losses;
  // Every parameter after training bitwise the single-process run's.
  bool params_equal = false;
  double seconds = 0;
};

// Trains `steps` steps (see the file comment), printing progress to `out`.
// Errors that stop it (a failed collective) are returned.
absl::StatusOr<TorchDemoResult> RunTorchDemo(int steps, uint64_t seed,
                                             std::ostream& out);

}  // namespace tools
}  // namespace flatparam

#endif  // TOOLS_DEMO_TORCH_H_
