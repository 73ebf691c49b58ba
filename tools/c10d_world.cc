#include "tools/c10d_world.h"

#include <algorithm>
#include <cstdio>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/statusor.h"
#include "comm/c10d/c10d_communicator.h"
#include "flatparam/base/status_macros.h"

namespace flatparam {
namespace tools {

absl::Status RunOnC10dWorld(
    absl::string_view program, absl::Duration timeout,
    const std::function<absl::Status(Communicator&)>& run) {
  C10dOptions c10d;
  c10d.start_timeout = std::max(timeout, absl::Minutes(1));
  absl::StatusOr<std::unique_ptr<C10dCommunicator>> world =
      C10dCommunicator::FromEnvironment(c10d);
  if (!world.ok()) return world.status();
  absl::Status status = run(**world);
  if (!status.ok()) {
    std::fprintf(stderr, "%s: rank %d: %s\n", std::string(program).c_str(),
                 (*world)->rank(), std::string(status.message()).c_str());
    std::fflush(stderr);
    return MarkReported(std::move(status));
  }
  return absl::OkStatus();
}

}  // namespace tools
}  // namespace flatparam
