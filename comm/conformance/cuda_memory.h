// CUDA device memory for the conformance cases and sweeps that run on the
// NCCL backend (device_memory.h). This header needs no CUDA headers and its
// target is built everywhere; where the build found no CUDA installation,
// CudaMemory() returns Unimplemented.
//
// Copies are synchronous and followed by cudaDeviceSynchronize(): the NCCL
// backend enqueues on a non-blocking stream of its own, which does not wait
// for the legacy default stream that cudaMemcpy uses, so a copy must be
// finished before a collective that reads its data is issued.
//
// Thread-safety: each call first makes the memory's device current on the
// calling thread; safe to use from several threads.
#ifndef FLATPARAM_COMM_CONFORMANCE_CUDA_MEMORY_H_
#define FLATPARAM_COMM_CONFORMANCE_CUDA_MEMORY_H_

#include <memory>

#include "absl/status/statusor.h"
#include "comm/conformance/device_memory.h"

namespace flatparam {
namespace conformance {

// Memory on CUDA device `device`. FailedPrecondition when there is no usable
// GPU or driver, InvalidArgument for a device that does not exist,
// Unimplemented in a build without CUDA.
absl::StatusOr<std::unique_ptr<DeviceMemory>> CudaMemory(int device);

}  // namespace conformance
}  // namespace flatparam

#endif  // FLATPARAM_COMM_CONFORMANCE_CUDA_MEMORY_H_
