#include "flatparam/device/cuda/cuda_device_ops.h"

#include <algorithm>
#include <cassert>
#include <cstdint>
#include <cstring>
#include <new>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "flatparam/base/backoff.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/device/cuda/cuda_device.h"
#include "flatparam/device/cuda/cuda_kernels.h"

namespace flatparam {
namespace {

using internal_cuda::KernelDType;

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

absl::Status SetCudaHostWaitLimit(
    DeviceOps& ops, absl::Duration limit,
    std::function<absl::Status(absl::string_view what)> on_expiry) {
  auto* cuda = dynamic_cast<CudaDeviceOps*>(&ops);
  if (cuda == nullptr) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "SetCudaHostWaitLimit: the DeviceOps are %s, not CUDA's", ops.name()));
  }
  cuda->SetHostWaitLimit(limit, std::move(on_expiry));
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<DeviceOps>> CreateCudaDeviceOps(int ordinal) {
  FLATPARAM_ASSIGN_OR_RETURN(std::unique_ptr<CudaDeviceOps> ops,
                             CudaDeviceOps::Create(ordinal));
  return std::unique_ptr<DeviceOps>(std::move(ops));
}

absl::StatusOr<std::unique_ptr<CudaDeviceOps>> CudaDeviceOps::Create(
    int ordinal, cudaStream_t stream, CudaAllocator* allocator,
    CudaRuntime* runtime) {
  CudaRuntime& rt = runtime != nullptr ? *runtime : RealCudaRuntime();
  int count = 0;
  const cudaError_t e = rt.GetDeviceCount(&count);
  if (e != cudaSuccess) {
    const absl::Status st = CudaStatus(rt, e, "cudaGetDeviceCount");
    rt.GetLastError();
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
  CudaDeviceGuard guard(rt);
  FLATPARAM_RETURN_IF_ERROR(guard.Set(ordinal, "CudaDeviceOps"));
  int pools = 0;
  if (rt.DeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, ordinal) !=
      cudaSuccess) {
    pools = 0;
    rt.GetLastError();
  }
  if (pools != 0 && allocator == nullptr) {
    // Keep freed memory reserved (PyTorch's caching allocator does the
    // same): the pool otherwise returns it to the driver at every stream
    // synchronization, and the next iteration's allocations reach the
    // driver again.
    cudaMemPool_t pool = nullptr;
    if (rt.DeviceGetDefaultMemPool(&pool, ordinal) == cudaSuccess) {
      uint64_t keep = UINT64_MAX;
      const cudaError_t set =
          rt.MemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep);
      if (set != cudaSuccess) rt.GetLastError();
      FLATPARAM_RETURN_IF_ERROR(CudaStatus(
          rt, set, "cudaMemPoolSetAttribute(cudaMemPoolAttrReleaseThreshold)"));
    } else {
      rt.GetLastError();
    }
  }
  bool owns = false;
  if (stream == nullptr) {
    const cudaError_t created =
        rt.StreamCreateWithFlags(&stream, cudaStreamNonBlocking);
    if (created != cudaSuccess) rt.GetLastError();
    FLATPARAM_RETURN_IF_ERROR(
        CudaStatus(rt, created, "cudaStreamCreateWithFlags"));
    owns = true;
  }
  return std::unique_ptr<CudaDeviceOps>(
      new CudaDeviceOps(rt, ordinal, stream, owns, pools != 0, allocator));
}

absl::Status CudaDeviceOps::Check(cudaError_t error,
                                  absl::string_view context) const {
  // CudaStatus clears the error: it must not resurface as the next
  // launch's error.
  return CudaStatus(rt_, error, context);
}

void CudaDeviceOps::ClearLastError() const { rt_.GetLastError(); }

int64_t CudaDeviceOps::PoolReserved(bool peak) const {
  if (!async_alloc_ || allocator_ != nullptr) return 0;
  cudaMemPool_t pool = nullptr;
  if (rt_.DeviceGetDefaultMemPool(&pool, ordinal_) != cudaSuccess) {
    ClearLastError();
    return 0;
  }
  uint64_t value = 0;
  if (rt_.MemPoolGetAttribute(pool,
                              peak ? cudaMemPoolAttrReservedMemHigh
                                   : cudaMemPoolAttrReservedMemCurrent,
                              &value) != cudaSuccess) {
    ClearLastError();
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

void CudaDeviceOps::SetHostWaitLimit(absl::Duration limit,
                                     HostWaitExpiry on_expiry) {
  host_wait_limit_ = limit;
  on_expiry_ = std::move(on_expiry);
}

int64_t CudaDeviceOps::cuda_events_held() const {
  int64_t n = static_cast<int64_t>(events_.size() + free_events_.size());
  for (const auto& [bytes, block] : pinned_cache_) n += block.events.size();
  return n;
}

CudaDeviceOps::~CudaDeviceOps() {
  CudaDeviceGuard guard(rt_);
  // Best effort: the work below reports its own errors.
  guard.Set(ordinal_, "CudaDeviceOps").IgnoreError();
  bool drained = true;
  for (size_t i = 0; i < streams_.size(); ++i) {
    // Bounded like every host wait: after a failure the streams may never
    // drain, and CUDA finishes (or abandons) their work after the destroy.
    drained =
        HostWaitStream(static_cast<int32_t>(i), "destroying the ops").ok() &&
        drained;
  }
  for (auto& [bytes, block] : pinned_cache_) {
    for (cudaEvent_t e : block.events) rt_.EventDestroy(e);
    // After a failure (streams that did not drain) a leak is better than a
    // hang in cudaFreeHost's device synchronization.
    if (drained && rt_.FreeHost(block.data) != cudaSuccess) ClearLastError();
  }
  for (auto& [id, r] : events_) rt_.EventDestroy(r.event);
  for (cudaEvent_t e : free_events_) rt_.EventDestroy(e);
  for (size_t i = 0; i < streams_.size(); ++i) {
    if (i > 0 || owns_stream_) rt_.StreamDestroy(streams_[i]);
  }
  ClearLastError();
}

absl::StatusOr<cudaEvent_t> CudaDeviceOps::TakeEvent() {
  if (!free_events_.empty()) {
    cudaEvent_t e = free_events_.back();
    free_events_.pop_back();
    return e;
  }
  cudaEvent_t e = nullptr;
  FLATPARAM_RETURN_IF_ERROR(
      Check(rt_.EventCreateWithFlags(&e, cudaEventDisableTiming),
            "cudaEventCreateWithFlags"));
  return e;
}

void CudaDeviceOps::Retire(int32_t index) {
  Timeline& t = timelines_[index];
  while (!t.pending.empty()) {
    const Pending& p = t.pending.front();
    const cudaError_t q = rt_.EventQuery(p.event);
    if (q != cudaSuccess) {
      // cudaErrorNotReady (or a failure the next operation reports): not
      // an error of any later call.
      ClearLastError();
      return;
    }
    events_.erase(p.id);
    ReturnEvent(p.event);
    t.pending.pop_front();
  }
}

bool CudaDeviceOps::PinnedReady(PinnedBlock& block) {
  for (cudaEvent_t e : block.events) {
    if (rt_.EventQuery(e) != cudaSuccess) {
      ClearLastError();  // not ready (or failed: not reused either way)
      return false;
    }
  }
  for (cudaEvent_t e : block.events) ReturnEvent(e);
  block.events.clear();
  return true;
}

absl::Status CudaDeviceOps::HostWait(cudaEvent_t event,
                                     absl::string_view what) {
  const absl::Time start = absl::Now();
  const absl::Time deadline = host_wait_limit_ == absl::InfiniteDuration()
                                  ? absl::InfiniteFuture()
                                  : start + host_wait_limit_;
  Backoff backoff;
  while (true) {
    const cudaError_t q = rt_.EventQuery(event);
    if (q == cudaSuccess) return absl::OkStatus();
    if (q != cudaErrorNotReady) return Check(q, what);
    ClearLastError();  // "not ready" is an answer, not an error
    if (absl::Now() >= deadline) break;
    backoff.Pause(deadline);
  }
  if (on_expiry_) return on_expiry_(what);
  return absl::DeadlineExceededError(absl::StrFormat(
      "cuda:%d: %s did not complete within %s (the work waits for something "
      "that has not happened: a collective a peer never joined?)",
      ordinal_, what, absl::FormatDuration(host_wait_limit_)));
}

absl::Status CudaDeviceOps::HostWaitStream(int32_t index,
                                           absl::string_view what) {
  FLATPARAM_ASSIGN_OR_RETURN(cudaEvent_t e, TakeEvent());
  absl::Status st = Check(rt_.EventRecord(e, streams_[index]),
                          absl::StrCat(what, ": cudaEventRecord"));
  if (st.ok()) st = HostWait(e, what);
  if (st.ok()) {
    ReturnEvent(e);
    // Everything recorded on the stream before has passed too.
    Retire(index);
  } else {
    rt_.EventDestroy(e);  // it may still be pending
  }
  return st;
}

absl::Status CudaDeviceOps::Synchronize() {
  CudaDeviceGuard guard(rt_);
  FLATPARAM_RETURN_IF_ERROR(guard.Set(ordinal_, "CudaDeviceOps"));
  for (size_t i = 0; i < streams_.size(); ++i) {
    FLATPARAM_RETURN_IF_ERROR(
        HostWaitStream(static_cast<int32_t>(i),
                       absl::StrFormat("Synchronize on stream %d", i)));
  }
  return absl::OkStatus();
}

absl::Status CudaDeviceOps::DoNewStream(Stream stream) {
  CudaDeviceGuard guard(rt_);
  FLATPARAM_RETURN_IF_ERROR(guard.Set(ordinal_, "CudaDeviceOps"));
  cudaStream_t s = nullptr;
  FLATPARAM_RETURN_IF_ERROR(
      Check(rt_.StreamCreateWithFlags(&s, cudaStreamNonBlocking),
            "cudaStreamCreateWithFlags"));
  assert(static_cast<size_t>(stream.id) == streams_.size());
  streams_.push_back(s);
  timelines_.emplace_back();
  return absl::OkStatus();
}

absl::Status CudaDeviceOps::DoSetStream(Stream stream) {
  stream_ = streams_[stream.id];
  return absl::OkStatus();
}

absl::Status CudaDeviceOps::DoRecordEvent(Event event) {
  CudaDeviceGuard guard(rt_);
  FLATPARAM_RETURN_IF_ERROR(guard.Set(ordinal_, "CudaDeviceOps"));
  const int32_t index = event.stream.id;
  Retire(index);  // recycle what has passed before taking another
  FLATPARAM_ASSIGN_OR_RETURN(cudaEvent_t e, TakeEvent());
  const absl::Status recorded =
      Check(rt_.EventRecord(e, streams_[index]), "cudaEventRecord");
  if (!recorded.ok()) {
    ReturnEvent(e);
    return recorded;
  }
  Timeline& t = timelines_[index];
  t.pending.push_back(Pending{t.next_seq++, e, event.id});
  events_[event.id] = Recorded{index, e};
  return absl::OkStatus();
}

absl::Status CudaDeviceOps::DoWaitEvent(Stream stream, Event event) {
  auto it = events_.find(event.id);
  if (it == events_.end()) return absl::OkStatus();  // it has passed
  CudaDeviceGuard guard(rt_);
  FLATPARAM_RETURN_IF_ERROR(guard.Set(ordinal_, "CudaDeviceOps"));
  return Check(rt_.StreamWaitEvent(streams_[stream.id], it->second.event, 0),
               "cudaStreamWaitEvent");
}

absl::Status CudaDeviceOps::DoSynchronizeEvent(Event event) {
  auto it = events_.find(event.id);
  if (it == events_.end()) return absl::OkStatus();  // it has passed
  CudaDeviceGuard guard(rt_);
  FLATPARAM_RETURN_IF_ERROR(guard.Set(ordinal_, "CudaDeviceOps"));
  const int32_t index = it->second.stream;
  FLATPARAM_RETURN_IF_ERROR(
      HostWait(it->second.event,
               absl::StrFormat("SynchronizeEvent on stream %d", index)));
  Retire(index);
  return absl::OkStatus();
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
  CudaDeviceGuard guard(rt_);
  FLATPARAM_RETURN_IF_ERROR(guard.Set(ordinal_, "CudaDeviceOps"));
  void* p = nullptr;
  const std::string what =
      absl::StrFormat("allocating %d bytes on %s%s", bytes, DeviceName(device),
                      pinned ? " (pinned)" : "");
  if (device == Device::Host()) {
    if (pinned) {
      auto [first, last] = pinned_cache_.equal_range(bytes);
      for (auto it = first; it != last; ++it) {
        if (PinnedReady(it->second)) {
          p = it->second.data;
          pinned_cache_.erase(it);
          stats_.pinned_cached_bytes -= bytes;
          pinned_bytes_[p] = bytes;
          return p;
        }
      }
      FLATPARAM_RETURN_IF_ERROR(
          Check(rt_.MallocHost(&p, static_cast<size_t>(bytes)), what));
      ++stats_.pinned_mallocs;
      pinned_bytes_[p] = bytes;
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
    FLATPARAM_RETURN_IF_ERROR(
        Check(rt_.MallocAsync(&p, static_cast<size_t>(bytes), stream_), what));
    if (PoolReserved(/*peak=*/false) > reserved) ++stats_.device_mallocs;
  } else {
    FLATPARAM_RETURN_IF_ERROR(
        Check(rt_.Malloc(&p, static_cast<size_t>(bytes)), what));
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
  CudaDeviceGuard guard(rt_);
  // Best effort: the work below reports its own errors.
  guard.Set(ordinal_, "CudaDeviceOps").IgnoreError();
  if (device == Device::Host()) {
    if (pinned) {
      // Work on any stream may still read or write it: cache it behind an
      // event on each (cudaFreeHost would synchronize the device, and
      // without a bound).
      PinnedBlock block{data, {}};
      for (cudaStream_t st : streams_) {
        absl::StatusOr<cudaEvent_t> e = TakeEvent();
        if (!e.ok() || rt_.EventRecord(*e, st) != cudaSuccess) {
          ClearLastError();
          if (e.ok()) ReturnEvent(*e);
          // No event: wait for the stream here instead.
          for (size_t i = 0; i < streams_.size(); ++i) {
            HostWaitStream(static_cast<int32_t>(i), "freeing pinned memory")
                .IgnoreError();
          }
          continue;
        }
        block.events.push_back(*e);
      }
      auto size = pinned_bytes_.find(data);
      assert(size != pinned_bytes_.end());
      const int64_t bytes = size->second;
      pinned_bytes_.erase(size);
      pinned_cache_.emplace(bytes, std::move(block));
      stats_.pinned_cached_bytes += bytes;
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
    // Synchronizes the device: every stream's use is done.
    if (rt_.Free(data) != cudaSuccess) ClearLastError();
    return;
  }
  // Stream-ordered free on the allocating stream, after the work the other
  // streams that used it had issued by now (PyTorch's record_stream). An
  // event can go back to the pool as soon as the wait is enqueued: the wait
  // keeps the recording it saw.
  cudaStream_t owner = streams_[a.stream];
  for (int32_t user : a.used_by) {
    absl::StatusOr<cudaEvent_t> e = TakeEvent();
    if (!e.ok() || rt_.EventRecord(*e, streams_[user]) != cudaSuccess ||
        rt_.StreamWaitEvent(owner, *e, 0) != cudaSuccess) {
      ClearLastError();
      // No ordering by event: wait for the user stream here instead.
      HostWaitStream(user, "freeing device memory").IgnoreError();
    }
    if (e.ok()) ReturnEvent(*e);
  }
  if (allocator_ != nullptr) {
    allocator_->Free(data, owner);
  } else if (rt_.FreeAsync(data, owner) != cudaSuccess) {
    ClearLastError();
  }
}

absl::Status CudaDeviceOps::DoCopy(BufferRef dst, ConstBufferRef src) {
  if (OnHost(dst) && OnHost(src)) {
    std::memcpy(dst.data, src.data, static_cast<size_t>(dst.bytes()));
    return absl::OkStatus();
  }
  CudaDeviceGuard guard(rt_);
  FLATPARAM_RETURN_IF_ERROR(guard.Set(ordinal_, "CudaDeviceOps"));
  const std::string what =
      absl::StrFormat("cudaMemcpyAsync of %d bytes from %s to %s", dst.bytes(),
                      DeviceName(src.device), DeviceName(dst.device));
  const bool host_side = OnHost(dst) || OnHost(src);
  const int32_t index = current_stream().id;
  if (host_side) {
    // A copy with pageable host memory blocks in the driver until the
    // stream reaches it; wait here first, where the wait is bounded.
    FLATPARAM_RETURN_IF_ERROR(
        HostWaitStream(index, absl::StrCat(what, " (waiting for the stream)")));
  }
  FLATPARAM_RETURN_IF_ERROR(Check(
      rt_.MemcpyAsync(dst.data, src.data, static_cast<size_t>(dst.bytes()),
                      cudaMemcpyDefault, stream_),
      what));
  if (host_side) return HostWaitStream(index, what);
  return absl::OkStatus();
}

absl::Status CudaDeviceOps::DoFill(BufferRef dst, double value) {
  if (OnHost(dst)) {
    HostFill(dst.data, dst.dtype, dst.count, value);
    return absl::OkStatus();
  }
  CudaDeviceGuard guard(rt_);
  FLATPARAM_RETURN_IF_ERROR(guard.Set(ordinal_, "CudaDeviceOps"));
  uint64_t pattern = 0;
  StoreFromDouble(&pattern, dst.dtype, 0, value);
  if (pattern == 0) {
    return Check(
        rt_.MemsetAsync(dst.data, 0, static_cast<size_t>(dst.bytes()), stream_),
        "cudaMemsetAsync");
  }
  ClearLastError();
  return Check(rt_.LaunchFill(dst.data, static_cast<int>(DTypeSize(dst.dtype)),
                              pattern, dst.count, stream_),
               "fill kernel");
}

absl::Status CudaDeviceOps::DoCast(BufferRef dst, ConstBufferRef src) {
  if (OnHost(dst)) {
    HostCast(dst.data, dst.dtype, src.data, src.dtype, dst.count);
    return absl::OkStatus();
  }
  CudaDeviceGuard guard(rt_);
  FLATPARAM_RETURN_IF_ERROR(guard.Set(ordinal_, "CudaDeviceOps"));
  ClearLastError();
  return Check(rt_.LaunchCast(dst.data, ToKernel(dst.dtype), src.data,
                              ToKernel(src.dtype), dst.count, stream_),
               absl::StrFormat("cast kernel %s -> %s", DTypeName(src.dtype),
                               DTypeName(dst.dtype)));
}

absl::Status CudaDeviceOps::DoScale(BufferRef buf, ScaleOp op, double factor) {
  if (OnHost(buf)) {
    HostScale(buf.data, buf.dtype, buf.count, op, factor);
    return absl::OkStatus();
  }
  CudaDeviceGuard guard(rt_);
  FLATPARAM_RETURN_IF_ERROR(guard.Set(ordinal_, "CudaDeviceOps"));
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
  ClearLastError();
  return Check(rt_.LaunchMultiply(buf.data, ToKernel(buf.dtype), scalar,
                                  buf.count, stream_),
               absl::StrFormat("%s kernel", ScaleOpName(op)));
}

absl::Status CudaDeviceOps::DoAdd(BufferRef acc, ConstBufferRef x) {
  if (OnHost(acc)) {
    HostAdd(acc.data, x.data, acc.dtype, acc.count);
    return absl::OkStatus();
  }
  CudaDeviceGuard guard(rt_);
  FLATPARAM_RETURN_IF_ERROR(guard.Set(ordinal_, "CudaDeviceOps"));
  ClearLastError();
  return Check(
      rt_.LaunchAdd(acc.data, x.data, ToKernel(acc.dtype), acc.count, stream_),
      "add kernel");
}

}  // namespace flatparam
