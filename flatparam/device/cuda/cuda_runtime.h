// CudaRuntime: every CUDA runtime call flatparam makes (CudaDeviceOps and
// the NCCL backend, comm/nccl), and CudaDeviceOps' kernel launchers, behind
// one interface, so that their logic (stream and event discipline,
// stream-ordered frees, error handling, host waits) runs in CI on machines
// without a GPU against a model of the runtime (fake_cuda_runtime.h), as
// comm/nccl/nccl_api.h does for NCCL. The two CUDA helpers every caller
// needs are here too: CudaStatus (the one place a cudaError_t becomes a
// Status) and CudaDeviceGuard.
//
//   CudaRuntime& rt = RealCudaRuntime();
//   CudaDeviceGuard guard(rt);
//   RETURN_IF_ERROR(guard.Set(device, "rank 0: create stream"));
//   cudaStream_t stream = nullptr;
//   RETURN_IF_ERROR(CudaStatus(
//       rt, rt.StreamCreateWithFlags(&stream, cudaStreamNonBlocking),
//       "rank 0: cudaStreamCreateWithFlags"));
//
// Each method forwards to the libcudart function of the same name
// (`EventQuery` -> cudaEventQuery) with the same arguments and result; the
// real implementation (RealCudaRuntime) adds nothing. The launchers enqueue
// one kernel of cuda_kernels.h on `stream` and return what
// cudaGetLastError() returns after the launch: like any launch, they also
// report an error an earlier call left in the thread's last-error state
// (a cudaErrorNotReady from a query, a failed allocation), so callers
// clear that state before launching (CudaDeviceOps does).
//
// Only code built where CUDA was found may include this header: it
// includes <cuda_runtime_api.h>. The interface sits below both comm/ and
// the rest of flatparam/ (it depends on nothing of theirs).
//
// Thread-safety: RealCudaRuntime() is as thread-safe as the CUDA runtime;
// the last-error state and the current device are per thread, as in CUDA.
#ifndef FLATPARAM_DEVICE_CUDA_CUDA_RUNTIME_H_
#define FLATPARAM_DEVICE_CUDA_CUDA_RUNTIME_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "flatparam/device/cuda/cuda_kernels.h"

namespace flatparam {

class CudaRuntime {
 public:
  virtual ~CudaRuntime() = default;

  // Errors.
  virtual cudaError_t GetLastError() = 0;
  virtual cudaError_t PeekAtLastError() = 0;
  virtual const char* GetErrorName(cudaError_t error) = 0;
  virtual const char* GetErrorString(cudaError_t error) = 0;

  // Devices.
  virtual cudaError_t GetDeviceCount(int* count) = 0;
  virtual cudaError_t GetDevice(int* device) = 0;
  virtual cudaError_t SetDevice(int device) = 0;
  virtual cudaError_t DeviceGetAttribute(int* value, cudaDeviceAttr attr,
                                         int device) = 0;
  virtual cudaError_t DeviceGetDefaultMemPool(cudaMemPool_t* pool,
                                              int device) = 0;
  virtual cudaError_t MemPoolSetAttribute(cudaMemPool_t pool,
                                          cudaMemPoolAttr attr,
                                          void* value) = 0;
  virtual cudaError_t MemPoolGetAttribute(cudaMemPool_t pool,
                                          cudaMemPoolAttr attr,
                                          void* value) = 0;

  // Streams and events.
  virtual cudaError_t StreamCreateWithFlags(cudaStream_t* stream,
                                            unsigned int flags) = 0;
  virtual cudaError_t StreamDestroy(cudaStream_t stream) = 0;
  virtual cudaError_t StreamSynchronize(cudaStream_t stream) = 0;
  virtual cudaError_t StreamQuery(cudaStream_t stream) = 0;
  virtual cudaError_t StreamWaitEvent(cudaStream_t stream, cudaEvent_t event,
                                      unsigned int flags) = 0;
  virtual cudaError_t EventCreateWithFlags(cudaEvent_t* event,
                                           unsigned int flags) = 0;
  virtual cudaError_t EventDestroy(cudaEvent_t event) = 0;
  virtual cudaError_t EventRecord(cudaEvent_t event, cudaStream_t stream) = 0;
  virtual cudaError_t EventQuery(cudaEvent_t event) = 0;
  virtual cudaError_t EventSynchronize(cudaEvent_t event) = 0;

  // Memory.
  virtual cudaError_t Malloc(void** ptr, size_t bytes) = 0;
  virtual cudaError_t Free(void* ptr) = 0;
  virtual cudaError_t MallocAsync(void** ptr, size_t bytes,
                                  cudaStream_t stream) = 0;
  virtual cudaError_t FreeAsync(void* ptr, cudaStream_t stream) = 0;
  virtual cudaError_t MallocHost(void** ptr, size_t bytes) = 0;
  virtual cudaError_t FreeHost(void* ptr) = 0;
  virtual cudaError_t MemcpyAsync(void* dst, const void* src, size_t bytes,
                                  cudaMemcpyKind kind, cudaStream_t stream) = 0;
  virtual cudaError_t MemsetAsync(void* dst, int value, size_t bytes,
                                  cudaStream_t stream) = 0;
  virtual cudaError_t PointerGetAttributes(cudaPointerAttributes* attributes,
                                           const void* ptr) = 0;

  // Kernels (cuda_kernels.h); see the file comment for the result.
  virtual cudaError_t LaunchFill(void* dst, int element_bytes, uint64_t pattern,
                                 int64_t count, cudaStream_t stream) = 0;
  virtual cudaError_t LaunchCast(void* dst,
                                 internal_cuda::KernelDType dst_dtype,
                                 const void* src,
                                 internal_cuda::KernelDType src_dtype,
                                 int64_t count, cudaStream_t stream) = 0;
  virtual cudaError_t LaunchMultiply(void* buf,
                                     internal_cuda::KernelDType dtype,
                                     double scalar, int64_t count,
                                     cudaStream_t stream) = 0;
  virtual cudaError_t LaunchAdd(void* acc, const void* x,
                                internal_cuda::KernelDType dtype, int64_t count,
                                cudaStream_t stream) = 0;
  // A stream held until the host sets `*flag` (pinned memory); tests'.
  virtual cudaError_t LaunchWaitFlag(const volatile uint32_t* flag,
                                     cudaStream_t stream) = 0;
};

// The process-wide implementation over libcudart and the nvcc-compiled
// kernels. Never destroyed.
CudaRuntime& RealCudaRuntime();

// The one place a cudaError_t becomes a Status. OK for cudaSuccess;
// otherwise "<context>: CUDA <cudaGetErrorName> (<code>):
// <cudaGetErrorString>", with FailedPrecondition when there is no usable
// GPU or driver, InvalidArgument for invalid values, devices and pointers,
// ResourceExhausted when out of memory, and Internal otherwise (sticky
// errors such as an illegal address leave the CUDA context unusable).
// A reported error is cleared from the thread's last-error state
// (cudaGetLastError), so that the next kernel launch on the thread, which
// reports cudaGetLastError(), does not report it again as its own.
absl::Status CudaStatus(CudaRuntime& rt, cudaError_t error,
                        absl::string_view context);

// Makes a device current for a scope and restores the caller's device when
// destroyed (only if Set changed it): streams, events and allocations
// belong to the device current when they are made. Not copyable.
class CudaDeviceGuard {
 public:
  explicit CudaDeviceGuard(CudaRuntime& rt) : rt_(rt) {}
  CudaDeviceGuard(const CudaDeviceGuard&) = delete;
  CudaDeviceGuard& operator=(const CudaDeviceGuard&) = delete;
  ~CudaDeviceGuard();

  // Makes `device` current; the error names `context` and the call
  // ("<context>: cudaSetDevice(1): CUDA ...").
  absl::Status Set(int device, absl::string_view context);

 private:
  CudaRuntime& rt_;
  int previous_ = 0;
  bool restore_ = false;
};

}  // namespace flatparam

#endif  // FLATPARAM_DEVICE_CUDA_CUDA_RUNTIME_H_
