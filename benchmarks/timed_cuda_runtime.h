// TimedCudaRuntime: a CudaRuntime (flatparam/device/cuda/cuda_runtime.h)
// that forwards every call to another one (normally RealCudaRuntime()) and,
// once armed, brackets the next cudaMemcpyAsync with two CUDA events
// recorded on that copy's stream immediately before and after it. The
// benchmarks run CudaDeviceOps over it to time the device part of a
// synchronous host<->device DeviceOps::Copy: the host's wait for the stream
// before the copy and its polling wait after it (whose backoff finds the
// copy done up to about 6% late) fall outside the two events, so the
// elapsed time is the copy's on the GPU, as the cudaMemcpyAsync baseline's
// is. It is TimedNcclApi's counterpart for copies.
//
//   TimedCudaRuntime cuda(RealCudaRuntime());
//   ASSIGN_OR_RETURN(auto ops, CudaDeviceOps::Create(0, nullptr, nullptr,
//                                                    &cuda));
//   RETURN_IF_ERROR(cuda.Arm(0));
//   RETURN_IF_ERROR(ops->Copy(device_buffer, pinned_host_buffer));
//   ASSIGN_OR_RETURN(double seconds, cuda.ElapsedSeconds());
//
// ForwardingCudaRuntime is the forwarding part alone: a base for runtimes
// that watch or change a few calls (TimedCudaRuntime, tests' recorders).
//
// Memory: TimedCudaRuntime owns its two events (made through `inner` by Arm
// on the copy's device, destroyed with the object); `inner` must outlive
// it, and it must outlive every CudaDeviceOps that uses it. ElapsedSeconds
// reads the events with libcudart's cudaEventElapsedTime (CudaRuntime has
// no timing call): `inner` must be the real runtime there.
//
// Thread-safety: as `inner` for the forwarded calls; Arm, ElapsedSeconds
// and the armed copy on one thread.
#ifndef FLATPARAM_BENCHMARKS_TIMED_CUDA_RUNTIME_H_
#define FLATPARAM_BENCHMARKS_TIMED_CUDA_RUNTIME_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "benchmarks/internal/event_bracket.h"
#include "flatparam/device/cuda/cuda_runtime.h"

namespace flatparam {
namespace bench {

class ForwardingCudaRuntime : public CudaRuntime {
 public:
  explicit ForwardingCudaRuntime(CudaRuntime& inner) : inner_(inner) {}
  ForwardingCudaRuntime(const ForwardingCudaRuntime&) = delete;
  ForwardingCudaRuntime& operator=(const ForwardingCudaRuntime&) = delete;

  CudaRuntime& inner() const { return inner_; }

  cudaError_t GetLastError() override { return inner_.GetLastError(); }
  cudaError_t PeekAtLastError() override { return inner_.PeekAtLastError(); }
  const char* GetErrorName(cudaError_t error) override {
    return inner_.GetErrorName(error);
  }
  const char* GetErrorString(cudaError_t error) override {
    return inner_.GetErrorString(error);
  }
  cudaError_t GetDeviceCount(int* count) override {
    return inner_.GetDeviceCount(count);
  }
  cudaError_t GetDevice(int* device) override {
    return inner_.GetDevice(device);
  }
  cudaError_t SetDevice(int device) override {
    return inner_.SetDevice(device);
  }
  cudaError_t DeviceGetAttribute(int* value, cudaDeviceAttr attr,
                                 int device) override {
    return inner_.DeviceGetAttribute(value, attr, device);
  }
  cudaError_t DeviceGetDefaultMemPool(cudaMemPool_t* pool,
                                      int device) override {
    return inner_.DeviceGetDefaultMemPool(pool, device);
  }
  cudaError_t MemPoolSetAttribute(cudaMemPool_t pool, cudaMemPoolAttr attr,
                                  void* value) override {
    return inner_.MemPoolSetAttribute(pool, attr, value);
  }
  cudaError_t MemPoolGetAttribute(cudaMemPool_t pool, cudaMemPoolAttr attr,
                                  void* value) override {
    return inner_.MemPoolGetAttribute(pool, attr, value);
  }
  cudaError_t StreamCreateWithFlags(cudaStream_t* stream,
                                    unsigned int flags) override {
    return inner_.StreamCreateWithFlags(stream, flags);
  }
  cudaError_t StreamDestroy(cudaStream_t stream) override {
    return inner_.StreamDestroy(stream);
  }
  cudaError_t StreamSynchronize(cudaStream_t stream) override {
    return inner_.StreamSynchronize(stream);
  }
  cudaError_t StreamQuery(cudaStream_t stream) override {
    return inner_.StreamQuery(stream);
  }
  cudaError_t StreamWaitEvent(cudaStream_t stream, cudaEvent_t event,
                              unsigned int flags) override {
    return inner_.StreamWaitEvent(stream, event, flags);
  }
  cudaError_t EventCreateWithFlags(cudaEvent_t* event,
                                   unsigned int flags) override {
    return inner_.EventCreateWithFlags(event, flags);
  }
  cudaError_t EventDestroy(cudaEvent_t event) override {
    return inner_.EventDestroy(event);
  }
  cudaError_t EventRecord(cudaEvent_t event, cudaStream_t stream) override {
    return inner_.EventRecord(event, stream);
  }
  cudaError_t EventQuery(cudaEvent_t event) override {
    return inner_.EventQuery(event);
  }
  cudaError_t EventSynchronize(cudaEvent_t event) override {
    return inner_.EventSynchronize(event);
  }
  cudaError_t Malloc(void** ptr, size_t bytes) override {
    return inner_.Malloc(ptr, bytes);
  }
  cudaError_t Free(void* ptr) override { return inner_.Free(ptr); }
  cudaError_t MallocAsync(void** ptr, size_t bytes,
                          cudaStream_t stream) override {
    return inner_.MallocAsync(ptr, bytes, stream);
  }
  cudaError_t FreeAsync(void* ptr, cudaStream_t stream) override {
    return inner_.FreeAsync(ptr, stream);
  }
  cudaError_t MallocHost(void** ptr, size_t bytes) override {
    return inner_.MallocHost(ptr, bytes);
  }
  cudaError_t FreeHost(void* ptr) override { return inner_.FreeHost(ptr); }
  cudaError_t MemcpyAsync(void* dst, const void* src, size_t bytes,
                          cudaMemcpyKind kind, cudaStream_t stream) override {
    return inner_.MemcpyAsync(dst, src, bytes, kind, stream);
  }
  cudaError_t MemsetAsync(void* dst, int value, size_t bytes,
                          cudaStream_t stream) override {
    return inner_.MemsetAsync(dst, value, bytes, stream);
  }
  cudaError_t PointerGetAttributes(cudaPointerAttributes* attributes,
                                   const void* ptr) override {
    return inner_.PointerGetAttributes(attributes, ptr);
  }
  cudaError_t LaunchFill(void* dst, int element_bytes, uint64_t pattern,
                         int64_t count, cudaStream_t stream) override {
    return inner_.LaunchFill(dst, element_bytes, pattern, count, stream);
  }
  cudaError_t LaunchCast(void* dst, internal_cuda::KernelDType dst_dtype,
                         const void* src, internal_cuda::KernelDType src_dtype,
                         int64_t count, cudaStream_t stream) override {
    return inner_.LaunchCast(dst, dst_dtype, src, src_dtype, count, stream);
  }
  cudaError_t LaunchMultiply(void* buf, internal_cuda::KernelDType dtype,
                             double scalar, int64_t count,
                             cudaStream_t stream) override {
    return inner_.LaunchMultiply(buf, dtype, scalar, count, stream);
  }
  cudaError_t LaunchAdd(void* acc, const void* x,
                        internal_cuda::KernelDType dtype, int64_t count,
                        cudaStream_t stream) override {
    return inner_.LaunchAdd(acc, x, dtype, count, stream);
  }
  cudaError_t LaunchWaitFlag(const volatile uint32_t* flag,
                             cudaStream_t stream) override {
    return inner_.LaunchWaitFlag(flag, stream);
  }

 private:
  CudaRuntime& inner_;
};

class TimedCudaRuntime final : public ForwardingCudaRuntime {
 public:
  explicit TimedCudaRuntime(CudaRuntime& inner)
      : ForwardingCudaRuntime(inner),
        bracket_(inner, "TimedCudaRuntime", "cudaMemcpyAsync") {}

  // Brackets the next MemcpyAsync with the events. `device`: the CUDA
  // device current when that copy is issued (the events are created there
  // once). FailedPrecondition if a copy is still armed, or if the events
  // were made on another device.
  absl::Status Arm(int device) { return bracket_.Arm(device); }

  // Seconds between the two events of the last armed copy, waiting for the
  // second one (cudaEventSynchronize). FailedPrecondition if no armed copy
  // was issued since Arm(); the CUDA error if recording failed.
  absl::StatusOr<double> ElapsedSeconds() { return bracket_.ElapsedSeconds(); }

  cudaError_t MemcpyAsync(void* dst, const void* src, size_t bytes,
                          cudaMemcpyKind kind, cudaStream_t stream) override;

 private:
  EventBracket bracket_;
};

}  // namespace bench
}  // namespace flatparam

#endif  // FLATPARAM_BENCHMARKS_TIMED_CUDA_RUNTIME_H_
