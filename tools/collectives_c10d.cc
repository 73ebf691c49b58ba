// RunCollectivesC10d() in fsdp_c10d, the build of `fsdp` that links
// LibTorch's c10d: `fsdp collectives --backend=c10d` as one of torchrun's
// workers.
#include <algorithm>
#include <cstdio>
#include <memory>
#include <ostream>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "comm/conformance/device_memory.h"
#include "flatparam/base/status_macros.h"
#include "tools/c10d_world.h"
#include "tools/collectives.h"

namespace flatparam {
namespace tools {
namespace {

absl::Status RunOnWorld(Communicator& world, const CollectivesOptions& options,
                        std::ostream& out) {
  if (options.world_size_given && options.world_size != world.size()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "rank %d: --world-size=%d, but the job has %d workers (torchrun "
        "decides the world size of --backend=c10d)",
        world.rank(), options.world_size, world.size()));
  }
  const absl::Time origin = absl::Now();
  const Clock clock = [origin] { return absl::Now() - origin; };
  FLATPARAM_ASSIGN_OR_RETURN(
      CollectivesReport report,
      RunCollectivesOnRank(world, conformance::HostMemory(), options, clock));
  if (world.rank() == 0) PrintCollectivesReport(report, options, out);
  return CollectivesVerdict(report);
}

}  // namespace

absl::Status RunCollectivesC10d(const CollectivesOptions& options,
                                std::ostream& out) {
  return RunOnC10dWorld(
      "fsdp collectives", options.timeout,
      [&](Communicator& world) { return RunOnWorld(world, options, out); },
      options.trace_dir);
}

}  // namespace tools
}  // namespace flatparam
