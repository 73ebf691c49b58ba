// RunTrainMpi() in a build with OpenMPI.
#include <cstdlib>
#include <memory>
#include <optional>
#include <ostream>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "comm/desync_check.h"
#include "comm/mpi/mpi_communicator.h"
#include "comm/nccl/nccl_backend.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/device/cuda/cuda_device.h"
#include "flatparam/device/device.h"
#include "tools/collective_timeout.h"
#include "tools/train.h"

namespace flatparam {
namespace tools {
namespace {

absl::Status RunOnWorld(MpiCommunicator& world,
                        const TrainCommandOptions& options, std::ostream& out) {
  if (options.world_size_given && options.world_size != world.size()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "rank %d: --world-size=%d, but the MPI job has %d ranks (mpirun -np "
        "decides the world size of --backend=%s)",
        world.rank(), options.world_size, world.size(), options.backend));
  }
  // Inconsistent options fail on every rank alike, before communicating.
  FLATPARAM_RETURN_IF_ERROR(
      MakeFsdpTrainOptions(options, world.size()).status());
  TrainReport report;
  if (options.backend == "nccl") {
    const int gpu = NodeLocalRank();
    // Every rank learns of a failure on any rank here, so none hangs.
    NcclOptions nccl_options;
    nccl_options.setup_timeout = options.timeout;
    if (!options.trace_dir.empty()) {
      nccl_options.flight_recorder.trace_dir = options.trace_dir;
    }
    FLATPARAM_ASSIGN_OR_RETURN(
        std::unique_ptr<Communicator> nccl,
        CreateNcclCommunicator(world, gpu, nccl_options));
    FLATPARAM_ASSIGN_OR_RETURN(std::unique_ptr<DeviceOps> device,
                               CreateCudaDeviceOps(gpu));
    // A host wait for device work that waits on a collective (a copy to
    // the host, a synchronization) ends within the collective timeout too,
    // aborting the communicator, instead of blocking in the driver when a
    // peer has died.
    Communicator* comm = nccl.get();
    const int rank = world.rank();
    FLATPARAM_RETURN_IF_ERROR(SetCudaHostWaitLimit(
        *device, options.timeout,
        [comm, rank, &options](absl::string_view what) {
          absl::Status error = absl::DeadlineExceededError(absl::StrFormat(
              "rank %d: %s did not complete within %s: the device work waits "
              "for a collective that never finished (a peer stopped, died or "
              "was cut off?); aborted the NCCL communicator",
              rank, what, absl::FormatDuration(options.timeout)));
          comm->Abort(error);
          return error;
        }));
    // NCCL checks nothing across ranks: --desync-check compares each
    // collective's fingerprint over the world first.
    std::optional<DesyncCheckingCommunicator> checked;
    if (options.desync_check) checked.emplace(nccl.get());
    absl::StatusOr<TrainReport> trained = RunTrainOnRank(
        checked.has_value() ? static_cast<Communicator&>(*checked) : *nccl,
        *device, options, /*host_device=*/false);
    if (!trained.ok()) {
      // Its destruction must not wait for peers that may have failed too.
      nccl->Abort(trained.status());
      return trained.status();
    }
    report = *std::move(trained);
  } else {
    HostDeviceOps device;
    FLATPARAM_ASSIGN_OR_RETURN(
        report, RunTrainOnRank(world, device, options, /*host_device=*/true));
  }
  if (world.rank() == 0) PrintTrainReport(report, out);
  return TrainVerdict(report);
}

}  // namespace

absl::Status RunTrainMpi(const TrainCommandOptions& options,
                         std::ostream& out) {
  FLATPARAM_RETURN_IF_ERROR(ValidateTrainCommandOptions(options));
  MpiWorldOptions mpi;
  mpi.comm.create_timeout = options.timeout;
  mpi.comm.check_collectives = options.desync_check;
  if (!options.trace_dir.empty()) {
    mpi.comm.flight_recorder.trace_dir = options.trace_dir;
  }
  mpi.timeout = options.timeout;
  mpi.start_timeout = MpiStartTimeout(options.timeout);
  mpi.program = "fsdp train";
  return RunOnMpiWorld(
      [&](MpiCommunicator& world) { return RunOnWorld(world, options, out); },
      mpi);
}

}  // namespace tools
}  // namespace flatparam
