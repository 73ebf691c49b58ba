#include "flatparam/device/cuda/cuda_runtime.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace flatparam {
namespace {

class Real final : public CudaRuntime {
 public:
  cudaError_t GetLastError() override { return cudaGetLastError(); }
  cudaError_t PeekAtLastError() override { return cudaPeekAtLastError(); }
  const char* GetErrorName(cudaError_t error) override {
    return cudaGetErrorName(error);
  }
  const char* GetErrorString(cudaError_t error) override {
    return cudaGetErrorString(error);
  }
  cudaError_t GetDeviceCount(int* count) override {
    return cudaGetDeviceCount(count);
  }
  cudaError_t GetDevice(int* device) override { return cudaGetDevice(device); }
  cudaError_t SetDevice(int device) override { return cudaSetDevice(device); }
  cudaError_t DeviceGetAttribute(int* value, cudaDeviceAttr attr,
                                 int device) override {
    return cudaDeviceGetAttribute(value, attr, device);
  }
  cudaError_t DeviceGetDefaultMemPool(cudaMemPool_t* pool,
                                      int device) override {
    return cudaDeviceGetDefaultMemPool(pool, device);
  }
  cudaError_t MemPoolSetAttribute(cudaMemPool_t pool, cudaMemPoolAttr attr,
                                  void* value) override {
    return cudaMemPoolSetAttribute(pool, attr, value);
  }
  cudaError_t MemPoolGetAttribute(cudaMemPool_t pool, cudaMemPoolAttr attr,
                                  void* value) override {
    return cudaMemPoolGetAttribute(pool, attr, value);
  }
  cudaError_t StreamCreateWithFlags(cudaStream_t* stream,
                                    unsigned int flags) override {
    return cudaStreamCreateWithFlags(stream, flags);
  }
  cudaError_t StreamDestroy(cudaStream_t stream) override {
    return cudaStreamDestroy(stream);
  }
  cudaError_t StreamSynchronize(cudaStream_t stream) override {
    return cudaStreamSynchronize(stream);
  }
  cudaError_t StreamQuery(cudaStream_t stream) override {
    return cudaStreamQuery(stream);
  }
  cudaError_t StreamWaitEvent(cudaStream_t stream, cudaEvent_t event,
                              unsigned int flags) override {
    return cudaStreamWaitEvent(stream, event, flags);
  }
  cudaError_t EventCreateWithFlags(cudaEvent_t* event,
                                   unsigned int flags) override {
    return cudaEventCreateWithFlags(event, flags);
  }
  cudaError_t EventDestroy(cudaEvent_t event) override {
    return cudaEventDestroy(event);
  }
  cudaError_t EventRecord(cudaEvent_t event, cudaStream_t stream) override {
    return cudaEventRecord(event, stream);
  }
  cudaError_t EventQuery(cudaEvent_t event) override {
    return cudaEventQuery(event);
  }
  cudaError_t EventSynchronize(cudaEvent_t event) override {
    return cudaEventSynchronize(event);
  }
  cudaError_t Malloc(void** ptr, size_t bytes) override {
    return cudaMalloc(ptr, bytes);
  }
  cudaError_t Free(void* ptr) override { return cudaFree(ptr); }
  cudaError_t MallocAsync(void** ptr, size_t bytes,
                          cudaStream_t stream) override {
    return cudaMallocAsync(ptr, bytes, stream);
  }
  cudaError_t FreeAsync(void* ptr, cudaStream_t stream) override {
    return cudaFreeAsync(ptr, stream);
  }
  cudaError_t MallocHost(void** ptr, size_t bytes) override {
    return cudaMallocHost(ptr, bytes);
  }
  cudaError_t FreeHost(void* ptr) override { return cudaFreeHost(ptr); }
  cudaError_t MemcpyAsync(void* dst, const void* src, size_t bytes,
                          cudaMemcpyKind kind, cudaStream_t stream) override {
    return cudaMemcpyAsync(dst, src, bytes, kind, stream);
  }
  cudaError_t MemsetAsync(void* dst, int value, size_t bytes,
                          cudaStream_t stream) override {
    return cudaMemsetAsync(dst, value, bytes, stream);
  }
  cudaError_t PointerGetAttributes(cudaPointerAttributes* attributes,
                                   const void* ptr) override {
    return cudaPointerGetAttributes(attributes, ptr);
  }
  cudaError_t LaunchFill(void* dst, int element_bytes, uint64_t pattern,
                         int64_t count, cudaStream_t stream) override {
    return internal_cuda::LaunchFill(dst, element_bytes, pattern, count,
                                     stream);
  }
  cudaError_t LaunchCast(void* dst, internal_cuda::KernelDType dst_dtype,
                         const void* src, internal_cuda::KernelDType src_dtype,
                         int64_t count, cudaStream_t stream) override {
    return internal_cuda::LaunchCast(dst, dst_dtype, src, src_dtype, count,
                                     stream);
  }
  cudaError_t LaunchMultiply(void* buf, internal_cuda::KernelDType dtype,
                             double scalar, int64_t count,
                             cudaStream_t stream) override {
    return internal_cuda::LaunchMultiply(buf, dtype, scalar, count, stream);
  }
  cudaError_t LaunchAdd(void* acc, const void* x,
                        internal_cuda::KernelDType dtype, int64_t count,
                        cudaStream_t stream) override {
    return internal_cuda::LaunchAdd(acc, x, dtype, count, stream);
  }
  cudaError_t LaunchWaitFlag(const volatile uint32_t* flag,
                             cudaStream_t stream) override {
    return internal_cuda::LaunchWaitFlag(flag, stream);
  }
};

absl::StatusCode CudaCode(cudaError_t error) {
  switch (error) {
    case cudaSuccess:
      return absl::StatusCode::kOk;
    case cudaErrorNoDevice:
    case cudaErrorInitializationError:
    case cudaErrorInsufficientDriver:
    case cudaErrorDevicesUnavailable:
    case cudaErrorStubLibrary:
    case cudaErrorCallRequiresNewerDriver:
    case cudaErrorSystemDriverMismatch:
    case cudaErrorSystemNotReady:
      return absl::StatusCode::kFailedPrecondition;
    case cudaErrorInvalidValue:
    case cudaErrorInvalidDevice:
    case cudaErrorInvalidDevicePointer:
      return absl::StatusCode::kInvalidArgument;
    case cudaErrorMemoryAllocation:
      return absl::StatusCode::kResourceExhausted;
    default:
      return absl::StatusCode::kInternal;
  }
}

const char* OrEmpty(const char* s) { return s == nullptr ? "" : s; }

}  // namespace

CudaRuntime& RealCudaRuntime() {
  static Real* const runtime = new Real();
  return *runtime;
}

absl::Status CudaStatus(CudaRuntime& rt, cudaError_t error,
                        absl::string_view context) {
  if (error == cudaSuccess) return absl::OkStatus();
  rt.GetLastError();  // reported here: not the next launch's error
  return absl::Status(
      CudaCode(error),
      absl::StrFormat("%s: CUDA %s (%d): %s", context,
                      OrEmpty(rt.GetErrorName(error)), static_cast<int>(error),
                      OrEmpty(rt.GetErrorString(error))));
}

CudaDeviceGuard::~CudaDeviceGuard() {
  if (restore_ && rt_.SetDevice(previous_) != cudaSuccess) {
    rt_.GetLastError();  // nothing to report it to; keep launches clean
  }
}

absl::Status CudaDeviceGuard::Set(int device, absl::string_view context) {
  int current = -1;
  absl::Status status = CudaStatus(rt_, rt_.GetDevice(&current),
                                   absl::StrCat(context, ": cudaGetDevice"));
  if (!status.ok()) return status;
  if (current == device) return absl::OkStatus();
  status =
      CudaStatus(rt_, rt_.SetDevice(device),
                 absl::StrFormat("%s: cudaSetDevice(%d)", context, device));
  if (!status.ok()) return status;
  if (!restore_) {
    previous_ = current;
    restore_ = true;
  }
  return absl::OkStatus();
}

}  // namespace flatparam
