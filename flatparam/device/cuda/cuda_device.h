// The entry point to the CUDA DeviceOps for code built anywhere: callers
// need no CUDA headers, and a build without CUDA still links (and reports
// Unimplemented at run time). Code that has CUDA headers and wants the
// stream can use CudaDeviceOps (cuda_device_ops.h) directly.
//
// Thread-safety: the functions are thread-safe; the returned DeviceOps is
// used by one thread at a time.
#ifndef FLATPARAM_DEVICE_CUDA_CUDA_DEVICE_H_
#define FLATPARAM_DEVICE_CUDA_CUDA_DEVICE_H_

#include <functional>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "flatparam/device/device.h"

namespace flatparam {

// Whether this build has the CUDA implementation (a CUDA installation was
// found when the build was configured).
bool CudaDeviceOpsAvailable();

// DeviceOps on CUDA device `ordinal`, with its own non-blocking stream.
// Unimplemented without CUDA in the build; FailedPrecondition saying "no
// usable GPU: ..." when there is no driver or no device; InvalidArgument
// for an ordinal out of range.
absl::StatusOr<std::unique_ptr<DeviceOps>> CreateCudaDeviceOps(int ordinal);

// How many of `ops`' device allocations reached the CUDA driver (the
// memory pool grew) since it was created: CudaAllocatorStats::
// device_mallocs of a CudaDeviceOps; -1 for other DeviceOps or without
// CUDA in the build. For checking that a warm training loop allocates from
// the cache only.
int64_t CudaDeviceMallocs(const DeviceOps& ops);

// Bounds every host wait of `ops` (Synchronize, SynchronizeEvent, copies
// with host memory) by `limit`: CudaDeviceOps::SetHostWaitLimit for code
// without CUDA headers. A trainer passes its collective timeout and a
// handler that aborts its communicator and returns an error naming the
// rank and what was waited for, so that a dead peer ends the run instead
// of blocking the host in the driver. InvalidArgument for DeviceOps that
// are not CUDA's; Unimplemented without CUDA in the build.
absl::Status SetCudaHostWaitLimit(
    DeviceOps& ops, absl::Duration limit,
    std::function<absl::Status(absl::string_view what)> on_expiry);

}  // namespace flatparam

#endif  // FLATPARAM_DEVICE_CUDA_CUDA_DEVICE_H_
