// MakeGpuContext() in a build with NCCL: CUDA events recorded on the NCCL
// communicator's stream immediately around the NCCL call (TimedNcclApi), as
// nccl-tests does, so that the time is the collective's on the GPU: neither
// the host's polling nor the communicator's host-side work before the call
// (argument checks, pointer-attribute queries, event creation).
#include "benchmarks/collectives_bench_gpu.h"

#include <memory>
#include <utility>

#include "benchmarks/timed_nccl_api.h"
#include "comm/conformance/cuda_memory.h"
#include "comm/nccl/nccl_api.h"
#include "comm/nccl/nccl_communicator.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/device/cuda/cuda_runtime.h"

namespace flatparam {
namespace bench {
namespace {

// The process's timed API: never destroyed, so that it outlives every
// communicator (and Work) that uses it, as RealNcclApi() does.
TimedNcclApi& BenchNcclApi() {
  static TimedNcclApi* const api =
      new TimedNcclApi(RealNcclApi(), RealCudaRuntime());
  return *api;
}

}  // namespace

absl::StatusOr<GpuContext> MakeGpuContext(Communicator& bootstrap, int device) {
  TimedNcclApi& api = BenchNcclApi();
  FLATPARAM_ASSIGN_OR_RETURN(
      std::unique_ptr<NcclCommunicator> nccl,
      NcclCommunicator::Create(api, RealCudaRuntime(), bootstrap, device));
  GpuContext context;
  FLATPARAM_ASSIGN_OR_RETURN(context.memory, conformance::CudaMemory(device));
  context.time = [&api,
                  device](const IssueFn& issue) -> absl::StatusOr<double> {
    FLATPARAM_RETURN_IF_ERROR(api.Arm(device));
    std::unique_ptr<Work> work = issue();
    FLATPARAM_RETURN_IF_ERROR(work->Wait());
    return api.ElapsedSeconds();
  };
  context.comm = std::move(nccl);
  return context;
}

}  // namespace bench
}  // namespace flatparam
