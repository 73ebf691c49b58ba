// RunTorchDemo for builds without LibTorch (see demo_torch.h).
#include <cstdint>
#include <ostream>

#include "tools/demo_torch.h"

namespace flatparam {
namespace tools {

absl::StatusOr<TorchDemoResult> RunTorchDemo(int steps, uint64_t seed,
                                             std::ostream& out) {
  TorchDemoResult result;
  result.skipped =
      "this build has no LibTorch (tools/setup.sh installs Debian's "
      "libtorch-dev; or set LIBTORCH_HOME and rebuild)";
  return result;
}

}  // namespace tools
}  // namespace flatparam
