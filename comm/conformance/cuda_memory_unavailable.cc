// CudaMemory() in a build that found no CUDA installation.
#include "absl/strings/str_format.h"
#include "comm/conformance/cuda_memory.h"

namespace flatparam {
namespace conformance {

absl::StatusOr<std::unique_ptr<DeviceMemory>> CudaMemory(int device) {
  return absl::UnimplementedError(absl::StrFormat(
      "cannot use cuda:%d: this build has no CUDA (no installation was found "
      "at $CUDA_PATH, default /usr/local/cuda, when the build was configured)",
      device));
}

}  // namespace conformance
}  // namespace flatparam
