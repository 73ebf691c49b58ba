// The NCCL backend of a build that found CUDA and NCCL.
#include "comm/nccl/nccl_backend.h"

#include <memory>
#include <utility>

#include "comm/nccl/nccl_api.h"
#include "comm/nccl/nccl_communicator.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/device/cuda/cuda_runtime.h"

namespace flatparam {

bool NcclBackendAvailable() { return true; }

absl::StatusOr<std::unique_ptr<Communicator>> CreateNcclCommunicator(
    Communicator& bootstrap, int cuda_device, const NcclOptions& options) {
  FLATPARAM_ASSIGN_OR_RETURN(
      std::unique_ptr<NcclCommunicator> nccl,
      NcclCommunicator::Create(RealNcclApi(), RealCudaRuntime(), bootstrap,
                               cuda_device, options));
  return std::unique_ptr<Communicator>(std::move(nccl));
}

}  // namespace flatparam
