// The CUDA DeviceOps of a build without a CUDA installation.
#include "absl/strings/str_format.h"
#include "flatparam/device/cuda/cuda_device.h"

namespace flatparam {

bool CudaDeviceOpsAvailable() { return false; }

int64_t CudaDeviceMallocs(const DeviceOps& ops) { return -1; }

absl::StatusOr<std::unique_ptr<DeviceOps>> CreateCudaDeviceOps(int ordinal) {
  return absl::UnimplementedError(absl::StrFormat(
      "cannot create CUDA DeviceOps on cuda:%d: this build has no CUDA "
      "support (no CUDA installation was found at $CUDA_PATH, default "
      "/usr/local/cuda, when the build was configured)",
      ordinal));
}

absl::Status SetCudaHostWaitLimit(
    DeviceOps& ops, absl::Duration limit,
    std::function<absl::Status(absl::string_view what)> on_expiry) {
  return absl::UnimplementedError(
      "cannot bound CUDA host waits: this build has no CUDA support");
}

}  // namespace flatparam
