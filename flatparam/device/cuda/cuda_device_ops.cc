#include "flatparam/device/cuda/cuda_device_ops.h"

#include <algorithm>
#include <cassert>
#include <cstdint>
#include <cstring>
#include <new>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/device/cuda/cuda_device.h"
#include "flatparam/device/cuda/cuda_kernels.h"

namespace flatparam {
namespace {

using internal_cuda::KernelDType;

absl::Status CudaError(cudaError_t error, absl::string_view context) {
  if (error == cudaSuccess) return absl::OkStatus();
  absl::StatusCode code = absl::StatusCode::kInternal;
  if (error == cudaErrorMemoryAllocation) {
    code = absl::StatusCode::kResourceExhausted;
  } else if (error == cudaErrorInsufficientDriver ||
             error == cudaErrorNoDevice) {
    code = absl::StatusCode::kFailedPrecondition;
  }
  return absl::Status(
      code,
      absl::StrFormat("%s: CUDA %s (%d): %s", context, cudaGetErrorName(error),
                      static_cast<int>(error), cudaGetErrorString(error)));
}

// Makes `ordinal` the current device for a scope.
class DeviceGuard {
 public:
  explicit DeviceGuard(int ordinal) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    if (previous_ != ordinal) {
      status_ = CudaError(cudaSetDevice(ordinal), "cudaSetDevice");
    }
  }
  ~DeviceGuard() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }
  const absl::Status& status() const { return status_; }

 private:
  int previous_ = -1;
  absl::Status status_;
};

KernelDType ToKernel(DType dtype) {
  switch (dtype) {
    case DType::kFloat64:
      return KernelDType::kFloat64;
    case DType::kFloat16:
      return KernelDType::kFloat16;
    case DType::kBFloat16:
      return KernelDType::kBFloat16;
    default:
      return KernelDType::kFloat32;
  }
}

bool OnHost(ConstBufferRef b) { return b.device == Device::Host(); }

}  // namespace

bool CudaDeviceOpsAvailable() { return true; }

int64_t CudaDeviceMallocs(const DeviceOps& ops) {
  const auto* cuda = dynamic_cast<const CudaDeviceOps*>(&ops);
  return cuda == nullptr ? -1 : cuda->stats().device_mallocs;
}

absl::StatusOr<std::unique_ptr<DeviceOps>> CreateCudaDeviceOps(int ordinal) {
  FLATPARAM_ASSIGN_OR_RETURN(std::unique_ptr<CudaDeviceOps> ops,
                             CudaDeviceOps::Create(ordinal));
  return std::unique_ptr<DeviceOps>(std::move(ops));
}

absl::StatusOr<std::unique_ptr<CudaDeviceOps>> CudaDeviceOps::Create(
    int ordinal, cudaStream_t stream, CudaAllocator* allocator) {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    const absl::Status st = CudaError(e, "cudaGetDeviceCount");
    return absl::FailedPreconditionError(absl::StrFormat(
        "CudaDeviceOps on cuda:%d: no usable GPU: %s", ordinal, st.message()));
  }
  if (count == 0) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "CudaDeviceOps on cuda:%d: no usable GPU: cudaGetDeviceCount found no "
        "device",
        ordinal));
  }
  if (ordinal < 0 || ordinal >= count) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "CudaDeviceOps: CUDA device %d is not in [0, %d)", ordinal, count));
  }
  DeviceGuard guard(ordinal);
  FLATPARAM_RETURN_IF_ERROR(guard.status());
  int pools = 0;
  if (cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported,
                             ordinal) != cudaSuccess) {
    pools = 0;
  }
  if (pools != 0 && allocator == nullptr) {
    // Keep freed memory reserved (PyTorch's caching allocator does the
    // same): the pool otherwise returns it to the driver at every stream
    // synchronization, and the next iteration's allocations reach the
    // driver again.
    cudaMemPool_t pool = nullptr;
    if (cudaDeviceGetDefaultMemPool(&pool, ordinal) == cudaSuccess) {
      uint64_t keep = UINT64_MAX;
      FLATPARAM_RETURN_IF_ERROR(CudaError(
          cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep),
          "cudaMemPoolSetAttribute(cudaMemPoolAttrReleaseThreshold)"));
    }
  }
  bool owns = false;
  if (stream == nullptr) {
    FLATPARAM_RETURN_IF_ERROR(
        CudaError(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
                  "cudaStreamCreateWithFlags"));
    owns = true;
  }
  return std::unique_ptr<CudaDeviceOps>(
      new CudaDeviceOps(ordinal, stream, owns, pools != 0, allocator));
}

int64_t CudaDeviceOps::PoolReserved(bool peak) const {
  if (!async_alloc_ || allocator_ != nullptr) return 0;
  cudaMemPool_t pool = nullptr;
  if (cudaDeviceGetDefaultMemPool(&pool, ordinal_) != cudaSuccess) return 0;
  uint64_t value = 0;
  if (cudaMemPoolGetAttribute(pool,
                              peak ? cudaMemPoolAttrReservedMemHigh
                                   : cudaMemPoolAttrReservedMemCurrent,
                              &value) != cudaSuccess) {
    return 0;
  }
  return static_cast<int64_t>(value);
}

CudaAllocatorStats CudaDeviceOps::stats() const {
  CudaAllocatorStats s = stats_;
  s.reserved_bytes = PoolReserved(/*peak=*/false);
  s.peak_reserved_bytes = PoolReserved(/*peak=*/true);
  return s;
}

CudaDeviceOps::~CudaDeviceOps() {
  DeviceGuard guard(ordinal_);
  for (cudaStream_t s : streams_) cudaStreamSynchronize(s);
  for (auto& [id, e] : events_) cudaEventDestroy(e);
  for (size_t i = 0; i < streams_.size(); ++i) {
    if (i > 0 || owns_stream_) cudaStreamDestroy(streams_[i]);
  }
}

absl::Status CudaDeviceOps::Synchronize() {
  DeviceGuard guard(ordinal_);
  FLATPARAM_RETURN_IF_ERROR(guard.status());
  for (cudaStream_t s : streams_) {
    FLATPARAM_RETURN_IF_ERROR(
        CudaError(cudaStreamSynchronize(s), "cudaStreamSynchronize"));
  }
  return absl::OkStatus();
}

absl::Status CudaDeviceOps::DoNewStream(Stream stream) {
  DeviceGuard guard(ordinal_);
  FLATPARAM_RETURN_IF_ERROR(guard.status());
  cudaStream_t s = nullptr;
  FLATPARAM_RETURN_IF_ERROR(
      CudaError(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking),
                "cudaStreamCreateWithFlags"));
  assert(static_cast<size_t>(stream.id) == streams_.size());
  streams_.push_back(s);
  return absl::OkStatus();
}

absl::Status CudaDeviceOps::DoSetStream(Stream stream) {
  stream_ = streams_[stream.id];
  return absl::OkStatus();
}

absl::Status CudaDeviceOps::DoRecordEvent(Event event) {
  DeviceGuard guard(ordinal_);
  FLATPARAM_RETURN_IF_ERROR(guard.status());
  cudaEvent_t e = nullptr;
  FLATPARAM_RETURN_IF_ERROR(CudaError(
      cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate"));
  const absl::Status recorded = CudaError(
      cudaEventRecord(e, streams_[event.stream.id]), "cudaEventRecord");
  if (!recorded.ok()) {
    cudaEventDestroy(e);
    return recorded;
  }
  events_[event.id] = e;
  return absl::OkStatus();
}

absl::Status CudaDeviceOps::DoWaitEvent(Stream stream, Event event) {
  DeviceGuard guard(ordinal_);
  FLATPARAM_RETURN_IF_ERROR(guard.status());
  return CudaError(
      cudaStreamWaitEvent(streams_[stream.id], events_.at(event.id), 0),
      "cudaStreamWaitEvent");
}

absl::Status CudaDeviceOps::DoSynchronizeEvent(Event event) {
  DeviceGuard guard(ordinal_);
  FLATPARAM_RETURN_IF_ERROR(guard.status());
  return CudaError(cudaEventSynchronize(events_.at(event.id)),
                   "cudaEventSynchronize");
}

std::optional<DeviceStream> CudaDeviceOps::DoNativeStream(Stream stream) const {
  DeviceStream out;
  out.device = device();
  out.handle = reinterpret_cast<uintptr_t>(streams_[stream.id]);
  return out;
}

absl::Status CudaDeviceOps::DoRecordStream(ConstBufferRef buffer,
                                           Stream stream) {
  if (OnHost(buffer)) return absl::OkStatus();  // host memory: no pool
  char* p = static_cast<char*>(const_cast<void*>(buffer.data));
  auto it = allocations_.upper_bound(p);
  if (it == allocations_.begin() ||
      p >= std::prev(it)->first + std::prev(it)->second.bytes) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "RecordStream (cuda ops): %p is not in an allocation of these ops", p));
  }
  Allocation& a = std::prev(it)->second;
  if (stream.id != a.stream && std::find(a.used_by.begin(), a.used_by.end(),
                                         stream.id) == a.used_by.end()) {
    a.used_by.push_back(stream.id);
  }
  return absl::OkStatus();
}

absl::StatusOr<void*> CudaDeviceOps::DoAllocate(Device device, int64_t bytes,
                                                bool pinned) {
  DeviceGuard guard(ordinal_);
  FLATPARAM_RETURN_IF_ERROR(guard.status());
  void* p = nullptr;
  const std::string what =
      absl::StrFormat("allocating %d bytes on %s%s", bytes, DeviceName(device),
                      pinned ? " (pinned)" : "");
  if (device == Device::Host()) {
    if (pinned) {
      FLATPARAM_RETURN_IF_ERROR(
          CudaError(cudaMallocHost(&p, static_cast<size_t>(bytes)), what));
      return p;
    }
    p = ::operator new (static_cast<size_t>(bytes), std::align_val_t{64},
                        std::nothrow);
    if (p == nullptr) {
      return absl::ResourceExhaustedError(absl::StrCat(what, ": failed"));
    }
    return p;
  }
  if (allocator_ != nullptr) {
    FLATPARAM_ASSIGN_OR_RETURN(p, allocator_->Allocate(bytes, stream_));
  } else if (async_alloc_) {
    const int64_t reserved = PoolReserved(/*peak=*/false);
    FLATPARAM_RETURN_IF_ERROR(CudaError(
        cudaMallocAsync(&p, static_cast<size_t>(bytes), stream_), what));
    if (PoolReserved(/*peak=*/false) > reserved) ++stats_.device_mallocs;
  } else {
    FLATPARAM_RETURN_IF_ERROR(
        CudaError(cudaMalloc(&p, static_cast<size_t>(bytes)), what));
    ++stats_.device_mallocs;
  }
  allocations_[static_cast<char*>(p)] =
      Allocation{bytes, current_stream().id, {}};
  ++stats_.allocations;
  stats_.allocated_bytes += bytes;
  stats_.peak_allocated_bytes =
      std::max(stats_.peak_allocated_bytes, stats_.allocated_bytes);
  return p;
}

void CudaDeviceOps::DoFree(void* data, Device device, bool pinned) {
  DeviceGuard guard(ordinal_);
  if (device == Device::Host()) {
    if (pinned) {
      // Asynchronous copies on any stream may still read or write it.
      for (cudaStream_t s : streams_) cudaStreamSynchronize(s);
      cudaFreeHost(data);
    } else {
      ::operator delete (data, std::align_val_t{64});
    }
    return;
  }
  auto it = allocations_.find(static_cast<char*>(data));
  assert(it != allocations_.end());
  const Allocation a = it->second;
  allocations_.erase(it);
  stats_.allocated_bytes -= a.bytes;
  if (!async_alloc_ && allocator_ == nullptr) {
    cudaFree(data);  // synchronizes the device: every stream's use is done
    return;
  }
  // Stream-ordered free on the allocating stream, after the work the other
  // streams that used it had issued by now (PyTorch's record_stream).
  cudaStream_t owner = streams_[a.stream];
  for (int32_t user : a.used_by) {
    cudaEvent_t e = nullptr;
    if (cudaEventCreateWithFlags(&e, cudaEventDisableTiming) != cudaSuccess) {
      cudaStreamSynchronize(streams_[user]);  // no event: wait here instead
      continue;
    }
    cudaEventRecord(e, streams_[user]);
    cudaStreamWaitEvent(owner, e, 0);
    cudaEventDestroy(e);  // released once the wait no longer needs it
  }
  if (allocator_ != nullptr) {
    allocator_->Free(data, owner);
  } else {
    cudaFreeAsync(data, owner);
  }
}

absl::Status CudaDeviceOps::DoCopy(BufferRef dst, ConstBufferRef src) {
  if (OnHost(dst) && OnHost(src)) {
    std::memcpy(dst.data, src.data, static_cast<size_t>(dst.bytes()));
    return absl::OkStatus();
  }
  DeviceGuard guard(ordinal_);
  FLATPARAM_RETURN_IF_ERROR(guard.status());
  const std::string what =
      absl::StrFormat("cudaMemcpyAsync of %d bytes from %s to %s", dst.bytes(),
                      DeviceName(src.device), DeviceName(dst.device));
  FLATPARAM_RETURN_IF_ERROR(CudaError(
      cudaMemcpyAsync(dst.data, src.data, static_cast<size_t>(dst.bytes()),
                      cudaMemcpyDefault, stream_),
      what));
  if (OnHost(dst) || OnHost(src)) {
    return CudaError(cudaStreamSynchronize(stream_), what);
  }
  return absl::OkStatus();
}

absl::Status CudaDeviceOps::DoFill(BufferRef dst, double value) {
  if (OnHost(dst)) {
    HostFill(dst.data, dst.dtype, dst.count, value);
    return absl::OkStatus();
  }
  DeviceGuard guard(ordinal_);
  FLATPARAM_RETURN_IF_ERROR(guard.status());
  uint64_t pattern = 0;
  StoreFromDouble(&pattern, dst.dtype, 0, value);
  if (pattern == 0) {
    return CudaError(
        cudaMemsetAsync(dst.data, 0, static_cast<size_t>(dst.bytes()), stream_),
        "cudaMemsetAsync");
  }
  return CudaError(internal_cuda::LaunchFill(
                       dst.data, static_cast<int>(DTypeSize(dst.dtype)),
                       pattern, dst.count, stream_),
                   "fill kernel");
}

absl::Status CudaDeviceOps::DoCast(BufferRef dst, ConstBufferRef src) {
  if (OnHost(dst)) {
    HostCast(dst.data, dst.dtype, src.data, src.dtype, dst.count);
    return absl::OkStatus();
  }
  DeviceGuard guard(ordinal_);
  FLATPARAM_RETURN_IF_ERROR(guard.status());
  return CudaError(
      internal_cuda::LaunchCast(dst.data, ToKernel(dst.dtype), src.data,
                                ToKernel(src.dtype), dst.count, stream_),
      absl::StrFormat("cast kernel %s -> %s", DTypeName(src.dtype),
                      DTypeName(dst.dtype)));
}

absl::Status CudaDeviceOps::DoScale(BufferRef buf, ScaleOp op, double factor) {
  if (OnHost(buf)) {
    HostScale(buf.data, buf.dtype, buf.count, op, factor);
    return absl::OkStatus();
  }
  DeviceGuard guard(ordinal_);
  FLATPARAM_RETURN_IF_ERROR(guard.status());
  // The scalar in the compute type; PyTorch's CUDA division by a scalar
  // multiplies by `opmath_t(1) / opmath_t(factor)`.
  double scalar;
  if (buf.dtype == DType::kFloat64) {
    scalar = op == ScaleOp::kDivide ? 1.0 / factor : factor;
  } else {
    const float f = static_cast<float>(factor);
    scalar = op == ScaleOp::kDivide ? static_cast<double>(1.0f / f)
                                    : static_cast<double>(f);
  }
  return CudaError(internal_cuda::LaunchMultiply(buf.data, ToKernel(buf.dtype),
                                                 scalar, buf.count, stream_),
                   absl::StrFormat("%s kernel", ScaleOpName(op)));
}

absl::Status CudaDeviceOps::DoAdd(BufferRef acc, ConstBufferRef x) {
  if (OnHost(acc)) {
    HostAdd(acc.data, x.data, acc.dtype, acc.count);
    return absl::OkStatus();
  }
  DeviceGuard guard(ordinal_);
  FLATPARAM_RETURN_IF_ERROR(guard.status());
  return CudaError(
      internal_cuda::LaunchAdd(acc.data, x.data, ToKernel(acc.dtype), acc.count,
                               stream_),
      "add kernel");
}

}  // namespace flatparam
