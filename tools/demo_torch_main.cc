// fsdp_torch_demo: `fsdp demo`'s LibTorch stage in its own process (see
// demo_torch.h). Run by `fsdp demo`; by hand:
//   bazel run //tools:fsdp_torch_demo -- --steps=150 --result=/tmp/r.json
// Under torchrun, each worker one rank over c10d (the default there):
//   torchrun --nproc_per_node=4 --no_python bazel-bin/tools/fsdp_torch_demo
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <memory>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/statusor.h"
#include "comm/communicator.h"
#include "tools/demo_torch.h"

ABSL_FLAG(int, steps, 150, "training steps");
ABSL_FLAG(uint64_t, seed, 0, "seeds the model and the simulator");
ABSL_FLAG(std::string, result, "", "where to write the result (JSON)");
ABSL_FLAG(std::string, backend, "",
          "sim (4 simulated ranks in this process) or c10d (this process is "
          "one of torchrun's workers); default: c10d under torchrun, else "
          "sim");

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  if (absl::GetFlag(FLAGS_steps) < 1) {
    std::cerr << "fsdp_torch_demo: --steps must be >= 1\n";
    return 2;
  }
  std::string backend = absl::GetFlag(FLAGS_backend);
  if (backend.empty()) {
    backend = std::getenv("TORCHELASTIC_RUN_ID") != nullptr ? "c10d" : "sim";
  }
  if (backend != "sim" && backend != "c10d") {
    std::cerr << "fsdp_torch_demo: --backend=" << backend
              << ": expected sim or c10d\n";
    return 2;
  }
  std::unique_ptr<flatparam::Communicator> world;
  if (backend == "c10d") {
    absl::StatusOr<std::unique_ptr<flatparam::Communicator>> made =
        flatparam::tools::TorchDemoC10dWorld();
    if (!made.ok()) {
      std::cerr << "fsdp_torch_demo: " << made.status() << "\n";
      return 1;
    }
    world = *std::move(made);
  }
  const int rank = world != nullptr ? world->rank() : 0;
  absl::StatusOr<flatparam::tools::TorchDemoResult> result =
      flatparam::tools::RunTorchDemo(absl::GetFlag(FLAGS_steps),
                                     absl::GetFlag(FLAGS_seed), std::cout,
                                     world.get());
  std::cout.flush();
  if (!result.ok()) {
    std::cerr << "fsdp_torch_demo: rank " << rank << ": " << result.status()
              << "\n";
    return 1;
  }
  if (world != nullptr) {
    // Every worker checked its own result; each says so if it differs.
    if (!result->params_equal) {
      std::cerr << "fsdp_torch_demo: rank " << rank
                << ": the parameters differ from single-process training\n";
      return 1;
    }
    if (rank == 0) {
      std::cout << "      " << result->world_size
                << " workers over c10d: every loss and parameter bitwise "
                   "equal to single-process training: "
                << (result->losses == result->reference_losses ? "yes" : "no")
                << "\n";
      if (result->losses != result->reference_losses) return 1;
    }
  }
  const std::string path = absl::GetFlag(FLAGS_result);
  if (!path.empty() && rank == 0) {
    std::ofstream out(path, std::ios::trunc);
    out << flatparam::tools::TorchDemoResultToJson(*result);
    out.close();
    if (!out) {
      std::cerr << "fsdp_torch_demo: cannot write " << path << "\n";
      return 1;
    }
  }
  return 0;
}
