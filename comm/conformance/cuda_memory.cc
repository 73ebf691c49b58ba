// CudaMemory() in a build with CUDA.
#include "comm/conformance/cuda_memory.h"

#include <cuda_runtime_api.h>

#include "absl/strings/str_format.h"
#include "flatparam/device/cuda/cuda_runtime.h"

namespace flatparam {
namespace conformance {
namespace {

// The one mapping of CUDA errors (CudaStatus), with the device named.
absl::Status Check(cudaError_t e, int device, absl::string_view what) {
  return CudaStatus(RealCudaRuntime(), e,
                    absl::StrFormat("cuda:%d: %s", device, what));
}

class CudaMemoryImpl final : public DeviceMemory {
 public:
  explicit CudaMemoryImpl(int device) : device_(device) {}

  Device device() const override { return Device::Cuda(device_); }

  absl::StatusOr<void*> Allocate(size_t bytes) override {
    void* ptr = nullptr;
    absl::Status s = Check(cudaSetDevice(device_), device_, "cudaSetDevice");
    if (s.ok()) {
      s = Check(cudaMalloc(&ptr, bytes), device_,
                absl::StrFormat("cudaMalloc of %d bytes", bytes));
    }
    if (!s.ok()) return s;
    return ptr;
  }

  void Free(void* ptr) override {
    cudaSetDevice(device_);
    cudaFree(ptr);
  }

  absl::Status CopyToDevice(void* dst, const void* src, size_t bytes) override {
    return Copy(dst, src, bytes, cudaMemcpyHostToDevice);
  }

  absl::Status CopyToHost(void* dst, const void* src, size_t bytes) override {
    return Copy(dst, src, bytes, cudaMemcpyDeviceToHost);
  }

  absl::Status Memset(void* dst, int byte, size_t bytes) override {
    absl::Status s = Check(cudaSetDevice(device_), device_, "cudaSetDevice");
    if (s.ok()) s = Check(cudaMemset(dst, byte, bytes), device_, "cudaMemset");
    if (s.ok()) {
      s = Check(cudaDeviceSynchronize(), device_, "cudaDeviceSynchronize");
    }
    return s;
  }

  const void* HostView(const void*) const override { return nullptr; }

 private:
  absl::Status Copy(void* dst, const void* src, size_t bytes,
                    cudaMemcpyKind kind) {
    absl::Status s = Check(cudaSetDevice(device_), device_, "cudaSetDevice");
    if (s.ok()) {
      s = Check(cudaMemcpy(dst, src, bytes, kind), device_,
                absl::StrFormat("cudaMemcpy of %d bytes", bytes));
    }
    if (s.ok()) {
      s = Check(cudaDeviceSynchronize(), device_, "cudaDeviceSynchronize");
    }
    return s;
  }

  int device_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<DeviceMemory>> CudaMemory(int device) {
  int count = 0;
  absl::Status s =
      Check(cudaGetDeviceCount(&count), device, "cudaGetDeviceCount");
  if (!s.ok()) return s;
  if (count == 0) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "cuda:%d: no usable GPU: cudaGetDeviceCount found no device", device));
  }
  if (device < 0 || device >= count) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "cuda:%d does not exist: %d CUDA device(s) visible", device, count));
  }
  return std::unique_ptr<DeviceMemory>(new CudaMemoryImpl(device));
}

}  // namespace conformance
}  // namespace flatparam
