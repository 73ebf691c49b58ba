// MakeGpuContext() in a build with NCCL: CUDA events on the NCCL
// communicator's own stream, so that the time is the GPU's, not the host's
// polling.
#include "benchmarks/collectives_bench_gpu.h"

#include <cuda_runtime_api.h>

#include <memory>
#include <utility>

#include "absl/strings/str_format.h"
#include "comm/conformance/cuda_memory.h"
#include "comm/nccl/nccl_api.h"
#include "comm/nccl/nccl_communicator.h"
#include "flatparam/base/status_macros.h"

namespace flatparam {
namespace bench {
namespace {

absl::Status Cuda(cudaError_t e, absl::string_view what) {
  return CudaStatus(RealNcclApi(), e, what);
}

// Two events, destroyed with the timer.
struct Events {
  cudaEvent_t start = nullptr;
  cudaEvent_t stop = nullptr;
  ~Events() {
    if (start != nullptr) cudaEventDestroy(start);
    if (stop != nullptr) cudaEventDestroy(stop);
  }
};

}  // namespace

absl::StatusOr<GpuContext> MakeGpuContext(Communicator& bootstrap, int device) {
  FLATPARAM_ASSIGN_OR_RETURN(
      std::unique_ptr<NcclCommunicator> nccl,
      NcclCommunicator::Create(RealNcclApi(), bootstrap, device));
  GpuContext context;
  FLATPARAM_ASSIGN_OR_RETURN(context.memory, conformance::CudaMemory(device));
  FLATPARAM_RETURN_IF_ERROR(Cuda(cudaSetDevice(device), "cudaSetDevice"));
  auto events = std::make_shared<Events>();
  FLATPARAM_RETURN_IF_ERROR(
      Cuda(cudaEventCreate(&events->start), "cudaEventCreate"));
  FLATPARAM_RETURN_IF_ERROR(
      Cuda(cudaEventCreate(&events->stop), "cudaEventCreate"));
  const cudaStream_t stream = nccl->stream();
  context.time = [events, stream,
                  device](const IssueFn& issue) -> absl::StatusOr<double> {
    FLATPARAM_RETURN_IF_ERROR(Cuda(cudaSetDevice(device), "cudaSetDevice"));
    FLATPARAM_RETURN_IF_ERROR(
        Cuda(cudaEventRecord(events->start, stream), "cudaEventRecord"));
    std::unique_ptr<Work> work = issue();
    FLATPARAM_RETURN_IF_ERROR(
        Cuda(cudaEventRecord(events->stop, stream), "cudaEventRecord"));
    FLATPARAM_RETURN_IF_ERROR(work->Wait());
    FLATPARAM_RETURN_IF_ERROR(
        Cuda(cudaEventSynchronize(events->stop), "cudaEventSynchronize"));
    float ms = 0;
    FLATPARAM_RETURN_IF_ERROR(
        Cuda(cudaEventElapsedTime(&ms, events->start, events->stop),
             "cudaEventElapsedTime"));
    return ms * 1e-3;
  };
  context.comm = std::move(nccl);
  return context;
}

}  // namespace bench
}  // namespace flatparam
