// fsdp_torch_demo: `fsdp demo`'s LibTorch stage in its own process (see
// demo_torch.h). Run by `fsdp demo`; by hand:
//   bazel run //tools:fsdp_torch_demo -- --steps=150 --result=/tmp/r.json
#include <cstdint>
#include <fstream>
#include <iostream>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/statusor.h"
#include "tools/demo_torch.h"

ABSL_FLAG(int, steps, 150, "training steps");
ABSL_FLAG(uint64_t, seed, 0, "seeds the model and the simulator");
ABSL_FLAG(std::string, result, "", "where to write the result (JSON)");

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  if (absl::GetFlag(FLAGS_steps) < 1) {
    std::cerr << "fsdp_torch_demo: --steps must be >= 1\n";
    return 2;
  }
  absl::StatusOr<flatparam::tools::TorchDemoResult> result =
      flatparam::tools::RunTorchDemo(absl::GetFlag(FLAGS_steps),
                                     absl::GetFlag(FLAGS_seed), std::cout);
  std::cout.flush();
  if (!result.ok()) {
    std::cerr << "fsdp_torch_demo: " << result.status() << "\n";
    return 1;
  }
  const std::string path = absl::GetFlag(FLAGS_result);
  if (!path.empty()) {
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
