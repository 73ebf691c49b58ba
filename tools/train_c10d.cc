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
#include "comm/c10d/c10d_communicator.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/device/device.h"
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
  C10dOptions c10d;
  // The first contact waits for every worker to start, which takes longer
  // than a collective (as MPI's start does; MpiStartTimeout).
  c10d.start_timeout = std::max(options.timeout, absl::Minutes(1));
  absl::StatusOr<std::unique_ptr<C10dCommunicator>> world =
      C10dCommunicator::FromEnvironment(c10d);
  if (!world.ok()) return world.status();
  const int rank = (*world)->rank();
  absl::Status status = RunOnWorld(**world, options, out);
  if (!status.ok()) {
    // Every worker prints its own error as it ends (torchrun shows each
    // worker's stderr), as ranks under mpirun do.
    std::fprintf(stderr, "fsdp train: rank %d: %s\n", rank,
                 std::string(status.message()).c_str());
    std::fflush(stderr);
    return MarkReported(std::move(status));
  }
  return absl::OkStatus();
}

}  // namespace tools
}  // namespace flatparam
