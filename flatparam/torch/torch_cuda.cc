#include "flatparam/torch/torch_cuda.h"

#include <c10/core/Device.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/device/cuda/cuda_device_ops.h"

namespace flatparam {
namespace {

// LibTorch's message without its C++ backtrace (what_without_backtrace).
std::string Message(const c10::Error& e) { return e.what_without_backtrace(); }

// LibTorch names CUDA's legacy default stream, every thread's current
// stream until a guard changes it, by the null handle; to CudaDeviceOps a
// null stream means "create one". flatparam names it cudaStreamLegacy,
// which is the same stream to CUDA, and gives LibTorch back its own name.
cudaStream_t ForCuda(cudaStream_t torch_stream) {
  return torch_stream == nullptr ? cudaStreamLegacy : torch_stream;
}
cudaStream_t ForTorch(cudaStream_t cuda_stream) {
  return cuda_stream == cudaStreamLegacy ? nullptr : cuda_stream;
}

// LibTorch's current stream on CUDA device `device_index`, as CUDA names
// it (ForCuda).
absl::StatusOr<cudaStream_t> CurrentStream(int device_index) {
  try {
    return ForCuda(c10::cuda::getCurrentCUDAStream(
                       static_cast<c10::DeviceIndex>(device_index))
                       .stream());
  } catch (const c10::Error& e) {
    return absl::UnavailableError(
        absl::StrCat("TorchCudaDeviceOps: LibTorch's CUDA: ", Message(e)));
  }
}

}  // namespace

absl::StatusOr<void*> TorchCachingAllocator::Allocate(int64_t bytes,
                                                      cudaStream_t stream) {
  if (bytes == 0) return nullptr;
  try {
    // The stream LibTorch's own allocations on it are pooled under.
    return c10::cuda::CUDACachingAllocator::raw_alloc_with_stream(
        static_cast<size_t>(bytes), ForTorch(stream));
  } catch (const c10::Error& e) {
    // LibTorch 1.13's CUDAOutOfMemoryError and 2.x's OutOfMemoryError both
    // derive from c10::Error and say "out of memory".
    const std::string message = Message(e);
    const std::string what = absl::StrFormat(
        "LibTorch's caching allocator, %d bytes on stream %p: %s", bytes,
        static_cast<void*>(stream), message);
    if (absl::StrContains(message, "out of memory")) {
      return absl::ResourceExhaustedError(what);
    }
    return absl::InternalError(what);
  }
}

void TorchCachingAllocator::Free(void* p, cudaStream_t /*stream*/) {
  // The block returns to the pool of the stream it was allocated on, which
  // is where CudaDeviceOps frees it (after that stream waited for every
  // other stream that used it).
  if (p != nullptr) c10::cuda::CUDACachingAllocator::raw_delete(p);
}

absl::StatusOr<std::unique_ptr<TorchCudaDeviceOps>> TorchCudaDeviceOps::Create(
    int device_index) {
  // device_count() is noexcept: 0 where CUDA cannot be initialized.
  const int count = static_cast<int>(c10::cuda::device_count());
  if (count == 0) {
    return absl::UnavailableError(
        "TorchCudaDeviceOps: LibTorch sees no CUDA device");
  }
  if (device_index < 0 || device_index >= count) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "TorchCudaDeviceOps: device %d, but LibTorch has %d CUDA device%s (0 "
        "to %d)",
        device_index, count, count == 1 ? "" : "s", count - 1));
  }
  FLATPARAM_ASSIGN_OR_RETURN(cudaStream_t stream, CurrentStream(device_index));
  std::unique_ptr<TorchCudaDeviceOps> cuda(
      new TorchCudaDeviceOps(device_index, stream));
  FLATPARAM_ASSIGN_OR_RETURN(
      cuda->ops_,
      CudaDeviceOps::Create(device_index, stream, &cuda->allocator_));
  return cuda;
}

absl::Status TorchCudaDeviceOps::CheckCurrentStream() const {
  FLATPARAM_ASSIGN_OR_RETURN(cudaStream_t current,
                             CurrentStream(device_index_));
  if (current == stream_) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrFormat(
      "LibTorch's current stream on cuda:%d is %p, but flatparam's work is "
      "ordered with stream %p (current when its DeviceOps were made): "
      "LibTorch's kernels there would race flatparam's copies and "
      "collectives; leave the CUDAStreamGuard, or make the DeviceOps under it",
      device_index_, static_cast<void*>(current), static_cast<void*>(stream_)));
}

}  // namespace flatparam
