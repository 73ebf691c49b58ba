// TorchDemoC10dWorld() in a build with c10d's gloo group.
#include <memory>
#include <utility>

#include "comm/c10d/c10d_communicator.h"
#include "tools/demo_torch.h"

namespace flatparam {
namespace tools {

absl::StatusOr<std::unique_ptr<Communicator>> TorchDemoC10dWorld() {
  absl::StatusOr<std::unique_ptr<C10dCommunicator>> world =
      C10dCommunicator::FromEnvironment();
  if (!world.ok()) return world.status();
  return std::unique_ptr<Communicator>(*std::move(world));
}

}  // namespace tools
}  // namespace flatparam
