// RunTrainC10d() in fsdp_c10d, the build of `fsdp` that links LibTorch's
// c10d: `fsdp train --backend=c10d` as one of torchrun's workers.
#include <algorithm>
#include <cstdio>
#include <memory>
#include <ostream>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/device/device.h"
#include "tools/c10d_world.h"
#include "tools/train.h"

namespace flatparam {
namespace tools {
namespace {

absl::Status RunOnWorld(Communicator& world, const TrainCommandOptions& options,
                        std::ostream& out) {
  if (options.world_size_given && options.world_size != world.size()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "rank %d: --world-size=%d, but the job has %d workers (torchrun's "
        "--nnodes x --nproc_per_node decides the world size of "
        "--backend=c10d)",
        world.rank(), options.world_size, world.size()));
  }
  // Inconsistent options fail on every rank alike, before communicating.
  FLATPARAM_RETURN_IF_ERROR(
      MakeFsdpTrainOptions(options, world.size()).status());
  HostDeviceOps device;
  FLATPARAM_ASSIGN_OR_RETURN(
      TrainReport report,
      RunTrainOnRank(world, device, options, /*host_device=*/true));
  if (world.rank() == 0) PrintTrainReport(report, out);
  return TrainVerdict(report);
}

}  // namespace

absl::Status RunTrainC10d(const TrainCommandOptions& options,
                          std::ostream& out) {
  FLATPARAM_RETURN_IF_ERROR(ValidateTrainCommandOptions(options));
  return RunOnC10dWorld(
      "fsdp train", options.timeout,
      [&](Communicator& world) { return RunOnWorld(world, options, out); },
      options.trace_dir, options.desync_check);
}

}  // namespace tools
}  // namespace flatparam
