#include "tools/c10d_world.h"

#include <algorithm>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "absl/status/statusor.h"
#include "comm/c10d/c10d_communicator.h"
#include "comm/desync_check.h"
#include "flatparam/base/status_macros.h"

namespace flatparam {
namespace tools {

absl::Status RunOnC10dWorld(
    absl::string_view program, absl::Duration timeout,
    const std::function<absl::Status(Communicator&)>& run,
    const std::string& trace_dir, bool desync_check) {
  C10dOptions c10d;
  c10d.start_timeout = std::max(timeout, absl::Minutes(1));
  if (!trace_dir.empty()) c10d.flight_recorder.trace_dir = trace_dir;
  absl::StatusOr<std::unique_ptr<C10dCommunicator>> world =
      C10dCommunicator::FromEnvironment(c10d);
  if (!world.ok()) return world.status();
  std::optional<DesyncCheckingCommunicator> checked;
  if (desync_check) checked.emplace(world->get());
  absl::Status status = checked.has_value() ? run(*checked) : run(**world);
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
