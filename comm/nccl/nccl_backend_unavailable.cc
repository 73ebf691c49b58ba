// The NCCL backend of a build that found no CUDA/NCCL installation: the API
// exists so that callers build everywhere, and says why it cannot work.
#include "absl/strings/str_format.h"
#include "comm/nccl/nccl_backend.h"

namespace flatparam {

bool NcclBackendAvailable() { return false; }

absl::StatusOr<std::unique_ptr<Communicator>> CreateNcclCommunicator(
    Communicator& bootstrap, int cuda_device, const NcclOptions& options) {
  return absl::UnimplementedError(absl::StrFormat(
      "rank %d: cannot create an NCCL communicator on cuda:%d: this build has "
      "no NCCL backend (no CUDA installation with nccl.h was found at "
      "$CUDA_PATH, default /usr/local/cuda, when the build was configured)",
      bootstrap.rank(), cuda_device));
}

}  // namespace flatparam
