// RunCollectivesMpi() in a build with OpenMPI.
#include <cstdlib>
#include <memory>
#include <ostream>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "comm/conformance/cuda_memory.h"
#include "comm/mpi/mpi_communicator.h"
#include "comm/nccl/nccl_backend.h"
#include "flatparam/base/status_macros.h"
#include "tools/collective_timeout.h"
#include "tools/collectives.h"

namespace flatparam {
namespace tools {
namespace {

absl::Status RunOnWorld(MpiCommunicator& world,
                        const CollectivesOptions& options, std::ostream& out) {
  if (options.world_size_given && options.world_size != world.size()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "rank %d: --world-size=%d, but the MPI job has %d ranks (mpirun -np "
        "decides the world size of --backend=%s)",
        world.rank(), options.world_size, world.size(), options.backend));
  }
  Communicator* comm = &world;
  conformance::DeviceMemory* memory = &conformance::HostMemory();
  std::unique_ptr<Communicator> nccl;
  std::unique_ptr<conformance::DeviceMemory> cuda;
  if (options.backend == "nccl") {
    const int device = NodeLocalRank();
    // Every rank learns of a failure on any rank here, so none hangs.
    NcclOptions nccl_options;
    nccl_options.setup_timeout = options.timeout;
    FLATPARAM_ASSIGN_OR_RETURN(
        nccl, CreateNcclCommunicator(world, device, nccl_options));
    FLATPARAM_ASSIGN_OR_RETURN(cuda, conformance::CudaMemory(device));
    comm = nccl.get();
    memory = cuda.get();
  }
  const absl::Time origin = absl::Now();
  const Clock clock = [origin] { return absl::Now() - origin; };
  absl::StatusOr<CollectivesReport> ran =
      RunCollectivesOnRank(*comm, *memory, options, clock);
  if (!ran.ok()) {
    // An NCCL communicator's destruction must not wait for peers that may
    // have failed too.
    comm->Abort(ran.status());
    return ran.status();
  }
  const CollectivesReport& report = *ran;
  if (world.rank() == 0) PrintCollectivesReport(report, options, out);
  return CollectivesVerdict(report);
}

}  // namespace

absl::Status RunCollectivesMpi(const CollectivesOptions& options,
                               std::ostream& out) {
  MpiWorldOptions mpi;
  mpi.comm.create_timeout = options.timeout;
  if (!options.trace_dir.empty()) {
    mpi.comm.flight_recorder.trace_dir = options.trace_dir;
  }
  mpi.timeout = options.timeout;
  mpi.start_timeout = MpiStartTimeout(options.timeout);
  mpi.program = "fsdp collectives";
  return RunOnMpiWorld(
      [&](MpiCommunicator& world) { return RunOnWorld(world, options, out); },
      mpi);
}

}  // namespace tools
}  // namespace flatparam
