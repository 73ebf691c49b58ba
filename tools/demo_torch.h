// `fsdp demo`'s LibTorch stage: a GPT-2-style transformer written with
// LibTorch modules (refmodel/torch_gpt.h) trained byte-level on real text
// (/usr/share/common-licenses/GPL-3, on every Debian machine) under
// flatparam's FsdpModule (flatparam/torch) with AdamW and FULL_SHARD on
// simulated ranks, and the same training single-process
// (refmodel::TrainFolded); the losses and the parameters must be bitwise
// equal.
//
// The stage runs in its own process, the `fsdp_torch_demo` binary
// (demo_torch_main.cc, built only where the build found LibTorch), so that
// `fsdp` itself does not load LibTorch: loading it costs every command
// about 160 MiB of resident memory and most of a second. `fsdp demo` runs
// it with RunTorchDemoProcess, which finds it beside the running binary
// (or in its runfiles) and reads its result back as JSON; without it the
// stage reports itself skipped.
//
// Under torchrun (`torchrun --nproc_per_node=N --no_python fsdp_torch_demo`)
// it trains over c10d, each worker one rank (--backend=c10d, the default
// there).
//
// Thread-safety: call from one thread.
#ifndef TOOLS_DEMO_TORCH_H_
#define TOOLS_DEMO_TORCH_H_

#include <cstdint>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "comm/communicator.h"

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

// In fsdp_torch_demo: trains `steps` steps (see the file comment),
// printing progress to `out`. Errors that stop it (a failed collective)
// are returned. With `world` (fsdp_torch_demo --backend=c10d under
// torchrun), this process trains as its rank of `world` instead of
// simulating 4 ranks, and checks its own result against the
// single-process run; rank 0 prints.
absl::StatusOr<TorchDemoResult> RunTorchDemo(int steps, uint64_t seed,
                                             std::ostream& out,
                                             Communicator* world = nullptr);

// The world of fsdp_torch_demo --backend=c10d: torchrun's environment
// (C10dCommunicator::FromEnvironment); Unimplemented in a build without
// c10d's gloo group (demo_torch_c10d_unavailable.cc).
absl::StatusOr<std::unique_ptr<Communicator>> TorchDemoC10dWorld();

// The result as JSON and back (the child's report to `fsdp demo`).
// DataLoss naming the field for JSON that is not such a result.
std::string TorchDemoResultToJson(const TorchDemoResult& result);
absl::StatusOr<TorchDemoResult> TorchDemoResultFromJson(
    const std::string& json);

// In `fsdp demo`: runs fsdp_torch_demo (found as $FLATPARAM_TORCH_DEMO,
// else in the runfiles of the running binary, else beside it) with these
// arguments, its output going to this process's stdout and stderr, and
// returns the result it wrote to `result_file` (created and replaced
// there). Without the binary, a result that says the stage was skipped
// and why. Errors: the child's failure (its exit status) or a result file
// that does not parse.
absl::StatusOr<TorchDemoResult> RunTorchDemoProcess(
    int steps, uint64_t seed, const std::string& result_file);

}  // namespace tools
}  // namespace flatparam

#endif  // TOOLS_DEMO_TORCH_H_
