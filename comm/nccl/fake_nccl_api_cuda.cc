// FakeNcclApi's model of the CUDA runtime calls the NCCL backend makes
// (devices, streams, events, memory, copies, last errors); its NCCL calls are
// in fake_nccl_api.cc.
#include <cstdint>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "comm/nccl/fake_nccl_api.h"
#include "comm/nccl/internal/fake_nccl_api_internal.h"

namespace flatparam {
namespace internal_fake_nccl {

int& CurrentDevice() {
  // CUDA's current device is per host thread.
  thread_local int device = 0;
  return device;
}

}  // namespace internal_fake_nccl

namespace {

using internal_fake_nccl::CurrentDevice;
using internal_fake_nccl::Find;

// The CUDA runtime's per-thread last error: every failing call sets it
// (cudaErrorNotReady from a query included).
thread_local cudaError_t last_cuda_error = cudaSuccess;

cudaError_t LastCudaError(cudaError_t e) {
  if (e != cudaSuccess) last_cuda_error = e;
  return e;
}

}  // namespace

cudaError_t FakeNcclApi::GetDeviceCount(int* count) {
  absl::MutexLock lock(&mu_);
  int code = 0;
  if (Begin("cudaGetDeviceCount", &code))
    return LastCudaError(static_cast<cudaError_t>(code));
  *count = 0;
  if (device_count_error_ != cudaSuccess) return device_count_error_;
  *count = device_count_;
  return cudaSuccess;
}

cudaError_t FakeNcclApi::GetDevice(int* device) {
  absl::MutexLock lock(&mu_);
  int code = 0;
  if (Begin("cudaGetDevice", &code))
    return LastCudaError(static_cast<cudaError_t>(code));
  *device = CurrentDevice();
  return cudaSuccess;
}

cudaError_t FakeNcclApi::SetDevice(int device) {
  absl::MutexLock lock(&mu_);
  int code = 0;
  if (Begin("cudaSetDevice", &code))
    return LastCudaError(static_cast<cudaError_t>(code));
  if (device < 0 || device >= device_count_)
    return LastCudaError(cudaErrorInvalidDevice);
  CurrentDevice() = device;
  return cudaSuccess;
}

cudaError_t FakeNcclApi::StreamCreateWithFlags(cudaStream_t* stream,
                                               unsigned int flags) {
  absl::MutexLock lock(&mu_);
  int code = 0;
  if (Begin("cudaStreamCreateWithFlags", &code)) {
    return LastCudaError(static_cast<cudaError_t>(code));
  }
  auto s = std::make_unique<Stream>();
  s->device = CurrentDevice();
  s->flags = flags;
  *stream = reinterpret_cast<cudaStream_t>(s.get());
  streams_.push_back(std::move(s));
  return cudaSuccess;
}

cudaError_t FakeNcclApi::StreamDestroy(cudaStream_t stream) {
  absl::MutexLock lock(&mu_);
  int code = 0;
  if (Begin("cudaStreamDestroy", &code))
    return LastCudaError(static_cast<cudaError_t>(code));
  Stream* s = Find(streams_, stream);
  if (s == nullptr || s->destroyed) {
    Misuse("cudaStreamDestroy: unknown or destroyed stream");
    return LastCudaError(cudaErrorInvalidResourceHandle);
  }
  s->destroyed = true;
  return cudaSuccess;
}

cudaError_t FakeNcclApi::EventCreateWithFlags(cudaEvent_t* event,
                                              unsigned int flags) {
  absl::MutexLock lock(&mu_);
  int code = 0;
  if (Begin("cudaEventCreateWithFlags", &code)) {
    return LastCudaError(static_cast<cudaError_t>(code));
  }
  auto e = std::make_unique<Event>();
  e->device = CurrentDevice();
  *event = reinterpret_cast<cudaEvent_t>(e.get());
  events_.push_back(std::move(e));
  return cudaSuccess;
}

cudaError_t FakeNcclApi::EventRecord(cudaEvent_t event, cudaStream_t stream) {
  absl::MutexLock lock(&mu_);
  int code = 0;
  if (Begin("cudaEventRecord", &code))
    return LastCudaError(static_cast<cudaError_t>(code));
  Event* e = Find(events_, event);
  const Stream* s = Find(streams_, stream);
  if (e == nullptr || e->destroyed || s == nullptr || s->destroyed) {
    Misuse("cudaEventRecord: unknown or destroyed event or stream");
    return LastCudaError(cudaErrorInvalidResourceHandle);
  }
  if (e->device != s->device) {
    Misuse(absl::StrFormat(
        "cudaEventRecord: event of cuda:%d on a stream of cuda:%d", e->device,
        s->device));
    return LastCudaError(cudaErrorInvalidResourceHandle);
  }
  e->recorded = true;
  e->pending_queries = event_pending_queries_;
  e->recorded_on = stream;
  e->recorded_at = static_cast<int>(calls_.size()) - 1;
  return cudaSuccess;
}

cudaError_t FakeNcclApi::StreamWaitEvent(cudaStream_t stream, cudaEvent_t event,
                                         unsigned int flags) {
  absl::MutexLock lock(&mu_);
  int code = 0;
  if (Begin("cudaStreamWaitEvent", &code)) {
    return LastCudaError(static_cast<cudaError_t>(code));
  }
  const Event* e = Find(events_, event);
  const Stream* s = Find(streams_, stream);
  if (e == nullptr || e->destroyed || s == nullptr || s->destroyed) {
    Misuse("cudaStreamWaitEvent: unknown or destroyed event or stream");
    return LastCudaError(cudaErrorInvalidResourceHandle);
  }
  if (flags != 0) {
    Misuse(absl::StrFormat("cudaStreamWaitEvent: flags %u", flags));
    return LastCudaError(cudaErrorInvalidValue);
  }
  // Waiting for an event never recorded is a no-op in CUDA; record it as
  // such (recorded_at -1).
  stream_waits_.push_back(StreamWait{
      stream, e->recorded ? e->recorded_on : nullptr,
      e->recorded ? e->recorded_at : -1, static_cast<int>(calls_.size()) - 1});
  return cudaSuccess;
}

cudaError_t FakeNcclApi::EventQuery(cudaEvent_t event) {
  absl::MutexLock lock(&mu_);
  int code = 0;
  if (Begin("cudaEventQuery", &code))
    return LastCudaError(static_cast<cudaError_t>(code));
  Event* e = Find(events_, event);
  if (e == nullptr || e->destroyed) {
    Misuse("cudaEventQuery: unknown or destroyed event");
    return LastCudaError(cudaErrorInvalidResourceHandle);
  }
  if (!e->recorded || e->pending_queries == 0) return cudaSuccess;
  if (e->pending_queries > 0) --e->pending_queries;
  return LastCudaError(cudaErrorNotReady);
}

cudaError_t FakeNcclApi::EventDestroy(cudaEvent_t event) {
  absl::MutexLock lock(&mu_);
  int code = 0;
  if (Begin("cudaEventDestroy", &code))
    return LastCudaError(static_cast<cudaError_t>(code));
  Event* e = Find(events_, event);
  if (e == nullptr || e->destroyed) {
    Misuse("cudaEventDestroy: unknown or destroyed event");
    return LastCudaError(cudaErrorInvalidResourceHandle);
  }
  e->destroyed = true;
  return cudaSuccess;
}

cudaError_t FakeNcclApi::PointerGetAttributes(cudaPointerAttributes* attributes,
                                              const void* ptr) {
  absl::MutexLock lock(&mu_);
  int code = 0;
  if (Begin("cudaPointerGetAttributes", &code)) {
    return LastCudaError(static_cast<cudaError_t>(code));
  }
  std::memset(attributes, 0, sizeof(*attributes));
  const char* p = static_cast<const char*>(ptr);
  auto it = allocations_.upper_bound(p);
  if (it != allocations_.begin()) {
    --it;
    if (p >= it->first && p < it->first + it->second.bytes.size()) {
      attributes->type = cudaMemoryTypeDevice;
      attributes->device = it->second.device;
      attributes->devicePointer = const_cast<void*>(ptr);
      return cudaSuccess;
    }
  }
  attributes->type = cudaMemoryTypeUnregistered;
  attributes->device = -2;
  attributes->hostPointer = const_cast<void*>(ptr);
  return cudaSuccess;
}

char* FakeNcclApi::NewAllocation(size_t bytes) {
  Allocation allocation;
  allocation.bytes.assign(std::max<size_t>(bytes, 1), '\0');
  allocation.device = CurrentDevice();
  char* data = allocation.bytes.data();
  allocations_.emplace(data, std::move(allocation));
  return data;
}

cudaError_t FakeNcclApi::Malloc(void** ptr, size_t bytes) {
  absl::MutexLock lock(&mu_);
  int code = 0;
  if (Begin("cudaMalloc", &code))
    return LastCudaError(static_cast<cudaError_t>(code));
  *ptr = NewAllocation(bytes);
  return cudaSuccess;
}

cudaError_t FakeNcclApi::Free(void* ptr) {
  absl::MutexLock lock(&mu_);
  int code = 0;
  if (Begin("cudaFree", &code))
    return LastCudaError(static_cast<cudaError_t>(code));
  if (allocations_.erase(static_cast<const char*>(ptr)) == 0) {
    Misuse(absl::StrFormat("cudaFree(%p): not a live allocation", ptr));
    return LastCudaError(cudaErrorInvalidValue);
  }
  return cudaSuccess;
}

cudaError_t FakeNcclApi::MemcpyAsync(void* dst, const void* src, size_t bytes,
                                     cudaMemcpyKind kind, cudaStream_t stream) {
  absl::MutexLock lock(&mu_);
  int code = 0;
  if (Begin("cudaMemcpyAsync", &code))
    return LastCudaError(static_cast<cudaError_t>(code));
  const Stream* s = Find(streams_, stream);
  if (s == nullptr || s->destroyed) {
    Misuse("cudaMemcpyAsync: unknown or destroyed stream");
    return LastCudaError(cudaErrorInvalidResourceHandle);
  }
  const bool src_device =
      kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice;
  const bool dst_device =
      kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice;
  if ((src_device && !CheckDeviceRange(src, bytes, "cudaMemcpyAsync src")) ||
      (dst_device && !CheckDeviceRange(dst, bytes, "cudaMemcpyAsync dst"))) {
    return LastCudaError(cudaErrorInvalidValue);
  }
  if ((kind == cudaMemcpyHostToDevice && !IsPinned(src, bytes)) ||
      (kind == cudaMemcpyDeviceToHost && !IsPinned(dst, bytes))) {
    ++pageable_copies_;
  }
  std::memmove(dst, src, bytes);
  return cudaSuccess;
}

cudaError_t FakeNcclApi::MallocAsync(void** ptr, size_t bytes,
                                     cudaStream_t stream) {
  absl::MutexLock lock(&mu_);
  int code = 0;
  if (Begin("cudaMallocAsync", &code)) {
    return LastCudaError(static_cast<cudaError_t>(code));
  }
  const Stream* s = Find(streams_, stream);
  if (s == nullptr || s->destroyed) {
    Misuse("cudaMallocAsync: unknown or destroyed stream");
    return LastCudaError(cudaErrorInvalidResourceHandle);
  }
  *ptr = NewAllocation(bytes);
  return cudaSuccess;
}

cudaError_t FakeNcclApi::FreeAsync(void* ptr, cudaStream_t stream) {
  absl::MutexLock lock(&mu_);
  int code = 0;
  if (Begin("cudaFreeAsync", &code)) {
    return LastCudaError(static_cast<cudaError_t>(code));
  }
  if (allocations_.erase(static_cast<const char*>(ptr)) == 0) {
    Misuse(absl::StrFormat("cudaFreeAsync(%p): not a live allocation", ptr));
    return LastCudaError(cudaErrorInvalidValue);
  }
  return cudaSuccess;
}

cudaError_t FakeNcclApi::MallocHost(void** ptr, size_t bytes) {
  absl::MutexLock lock(&mu_);
  int code = 0;
  if (Begin("cudaMallocHost", &code)) {
    return LastCudaError(static_cast<cudaError_t>(code));
  }
  std::vector<char> block(std::max<size_t>(bytes, 1), '\0');
  char* data = block.data();
  pinned_.emplace(data, std::move(block));
  *ptr = data;
  return cudaSuccess;
}

cudaError_t FakeNcclApi::FreeHost(void* ptr) {
  absl::MutexLock lock(&mu_);
  int code = 0;
  if (Begin("cudaFreeHost", &code)) {
    return LastCudaError(static_cast<cudaError_t>(code));
  }
  if (pinned_.erase(static_cast<const char*>(ptr)) == 0) {
    Misuse(absl::StrFormat("cudaFreeHost(%p): not pinned memory", ptr));
    return LastCudaError(cudaErrorInvalidValue);
  }
  return cudaSuccess;
}

cudaError_t FakeNcclApi::MemsetAsync(void* dst, int value, size_t bytes,
                                     cudaStream_t stream) {
  absl::MutexLock lock(&mu_);
  int code = 0;
  if (Begin("cudaMemsetAsync", &code)) {
    return LastCudaError(static_cast<cudaError_t>(code));
  }
  if (!CheckDeviceRange(dst, bytes, "cudaMemsetAsync dst")) {
    return LastCudaError(cudaErrorInvalidValue);
  }
  std::memset(dst, value, bytes);
  return cudaSuccess;
}

cudaError_t FakeNcclApi::GetLastError() {
  const cudaError_t e = last_cuda_error;
  last_cuda_error = cudaSuccess;
  return e;
}

cudaError_t FakeNcclApi::PeekAtLastError() { return last_cuda_error; }

const char* FakeNcclApi::GetErrorName(cudaError_t error) {
  switch (error) {
    case cudaSuccess:
      return "cudaSuccess";
    case cudaErrorInvalidValue:
      return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation:
      return "cudaErrorMemoryAllocation";
    case cudaErrorInsufficientDriver:
      return "cudaErrorInsufficientDriver";
    case cudaErrorNoDevice:
      return "cudaErrorNoDevice";
    case cudaErrorInvalidDevice:
      return "cudaErrorInvalidDevice";
    case cudaErrorNotReady:
      return "cudaErrorNotReady";
    case cudaErrorIllegalAddress:
      return "cudaErrorIllegalAddress";
    case cudaErrorLaunchFailure:
      return "cudaErrorLaunchFailure";
    case cudaErrorInvalidResourceHandle:
      return "cudaErrorInvalidResourceHandle";
    default:
      return "cudaErrorUnknownToTheFake";
  }
}

const char* FakeNcclApi::GetErrorString(cudaError_t error) {
  return error == cudaSuccess ? "fake: no error" : "fake: CUDA failure";
}

// The CUDA runtime calls the NCCL backend does not make: refused, so that a
// backend change that starts making one shows up in misuse().
cudaError_t FakeNcclApi::NotModelled(absl::string_view call) {
  absl::MutexLock lock(&mu_);
  calls_.push_back(std::string(call));
  Misuse(absl::StrCat(call, ": not modelled by FakeNcclApi"));
  return LastCudaError(cudaErrorNotSupported);
}
cudaError_t FakeNcclApi::DeviceGetAttribute(int*, cudaDeviceAttr, int) {
  return NotModelled("cudaDeviceGetAttribute");
}
cudaError_t FakeNcclApi::DeviceGetDefaultMemPool(cudaMemPool_t*, int) {
  return NotModelled("cudaDeviceGetDefaultMemPool");
}
cudaError_t FakeNcclApi::MemPoolSetAttribute(cudaMemPool_t, cudaMemPoolAttr,
                                             void*) {
  return NotModelled("cudaMemPoolSetAttribute");
}
cudaError_t FakeNcclApi::MemPoolGetAttribute(cudaMemPool_t, cudaMemPoolAttr,
                                             void*) {
  return NotModelled("cudaMemPoolGetAttribute");
}
cudaError_t FakeNcclApi::StreamSynchronize(cudaStream_t) {
  return NotModelled("cudaStreamSynchronize");
}
cudaError_t FakeNcclApi::StreamQuery(cudaStream_t) {
  return NotModelled("cudaStreamQuery");
}
cudaError_t FakeNcclApi::EventSynchronize(cudaEvent_t) {
  return NotModelled("cudaEventSynchronize");
}
cudaError_t FakeNcclApi::LaunchFill(void*, int, uint64_t, int64_t,
                                    cudaStream_t) {
  return NotModelled("LaunchFill");
}
cudaError_t FakeNcclApi::LaunchCast(void*, internal_cuda::KernelDType,
                                    const void*, internal_cuda::KernelDType,
                                    int64_t, cudaStream_t) {
  return NotModelled("LaunchCast");
}
cudaError_t FakeNcclApi::LaunchMultiply(void*, internal_cuda::KernelDType,
                                        double, int64_t, cudaStream_t) {
  return NotModelled("LaunchMultiply");
}
cudaError_t FakeNcclApi::LaunchAdd(void*, const void*,
                                   internal_cuda::KernelDType, int64_t,
                                   cudaStream_t) {
  return NotModelled("LaunchAdd");
}
cudaError_t FakeNcclApi::LaunchWaitFlag(const volatile uint32_t*,
                                        cudaStream_t) {
  return NotModelled("LaunchWaitFlag");
}

}  // namespace flatparam
