// The entry point to the CUDA DeviceOps for code built anywhere: callers
// need no CUDA headers, and a build without CUDA still links (and reports
// Unimplemented at run time). Code that has CUDA headers and wants the
// stream can use CudaDeviceOps (cuda_device_ops.h) directly.
//
// Thread-safety: the functions are thread-safe; the returned DeviceOps is
// used by one thread at a time.
#ifndef FLATPARAM_DEVICE_CUDA_CUDA_DEVICE_H_
#define FLATPARAM_DEVICE_CUDA_CUDA_DEVICE_H_

#include <memory>

#include "absl/status/statusor.h"
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

}  // namespace flatparam

#endif  // FLATPARAM_DEVICE_CUDA_CUDA_DEVICE_H_
