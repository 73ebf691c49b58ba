// TorchDemoC10dWorld() in a build without c10d's gloo group.
#include "tools/demo_torch.h"

namespace flatparam {
namespace tools {

absl::StatusOr<std::unique_ptr<Communicator>> TorchDemoC10dWorld() {
  return absl::UnimplementedError(
      "--backend=c10d: this build has no c10d backend (gloo's headers were "
      "not found when it was configured; tools/setup.sh installs "
      "libgloo-dev)");
}

}  // namespace tools
}  // namespace flatparam
