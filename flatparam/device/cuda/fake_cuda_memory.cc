#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <vector>

#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "flatparam/device/cuda/fake_cuda_runtime.h"
#include "flatparam/device/cuda/fake_cuda_runtime_internal.h"

// FakeCudaRuntime's memory: device blocks (cudaMalloc, and the
// stream-ordered cudaMallocAsync/cudaFreeAsync from the memory pools),
// pinned host memory, the pools' attributes, and copies and memsets.
// fake_cuda_runtime_internal.h lists the other files.

namespace flatparam {

using internal_fake_cuda::At;
using internal_fake_cuda::Join;

namespace {

// Stream-ordered allocations are carved from pool segments in multiples of
// this (CUDA aligns them at least as much).
constexpr size_t kGranule = 256;

size_t RoundUp(size_t bytes, size_t to) {
  return (std::max<size_t>(bytes, 1) + to - 1) / to * to;
}

// The bytes the two views of a segment of `bytes` span: whole pages.
size_t MappedBytes(size_t bytes) {
  return RoundUp(bytes, static_cast<size_t>(sysconf(_SC_PAGESIZE)));
}

// The entry of `m` whose range [key, key + size(value)) holds `p`.
template <typename Map, typename Size>
auto Containing(Map& m, const char* p, Size size) -> decltype(m.begin()) {
  auto it = m.upper_bound(const_cast<char*>(p));
  if (it == m.begin()) return m.end();
  --it;
  return p < it->first + std::max<size_t>(size(it->second), 1) ? it : m.end();
}

}  // namespace

const FakeCudaRuntime::Segment* FakeCudaRuntime::SegmentAt(const void* ptr,
                                                           char** base) const {
  auto it = Containing(segments_, static_cast<const char*>(ptr),
                       [](const Segment& s) { return s.bytes; });
  if (it == segments_.end()) return nullptr;
  *base = it->first;
  return &it->second;
}

FakeCudaRuntime::Allocation* FakeCudaRuntime::AllocationAt(const void* ptr,
                                                           size_t bytes) {
  const char* p = static_cast<const char*>(ptr);
  auto it =
      Containing(allocations_, p, [](const Allocation& a) { return a.bytes; });
  if (it == allocations_.end() || p + bytes > it->first + it->second.bytes) {
    return nullptr;
  }
  return &it->second;
}

bool FakeCudaRuntime::IsLiveDevice(const void* ptr, size_t bytes) const {
  return const_cast<FakeCudaRuntime*>(this)->AllocationAt(ptr, bytes) !=
         nullptr;
}

int FakeCudaRuntime::BlockDevice(const void* ptr) const {
  const Allocation* a =
      const_cast<FakeCudaRuntime*>(this)->AllocationAt(ptr, 0);
  return a == nullptr ? -1 : a->device;
}

bool FakeCudaRuntime::IsDevicePointer(const void* ptr) const {
  char* base = nullptr;
  return SegmentAt(ptr, &base) != nullptr;
}

bool FakeCudaRuntime::IsPinned(const void* ptr) const {
  auto it = Containing(pinned_, static_cast<const char*>(ptr),
                       [](size_t bytes) { return bytes; });
  return it != pinned_.end();
}

char* FakeCudaRuntime::MapSegment(size_t bytes, char** host) {
  const size_t length = MappedBytes(bytes);
  const int fd = memfd_create("flatparam-fake-cuda", MFD_CLOEXEC);
  if (fd < 0) return nullptr;
  void* rw = MAP_FAILED;
  void* none = MAP_FAILED;
  if (ftruncate(fd, static_cast<off_t>(length)) == 0) {
    rw = mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    none = mmap(nullptr, length, PROT_NONE, MAP_SHARED, fd, 0);
  }
  close(fd);  // the mappings keep the pages
  if (rw == MAP_FAILED || none == MAP_FAILED) {
    if (rw != MAP_FAILED) munmap(rw, length);
    if (none != MAP_FAILED) munmap(none, length);
    return nullptr;
  }
  *host = static_cast<char*>(rw);
  std::memset(*host, 0xA5, bytes);  // uninitialised, recognisably
  return static_cast<char*>(none);
}

void FakeCudaRuntime::UnmapSegment(char* device, const Segment& segment) {
  const size_t length = MappedBytes(segment.bytes);
  munmap(segment.host, length);
  munmap(device, length);
}

void* FakeCudaRuntime::HostAlias(const void* ptr) const {
  absl::MutexLock lock(&mu_);
  char* base = nullptr;
  const Segment* segment = SegmentAt(ptr, &base);
  if (segment == nullptr) return const_cast<void*>(ptr);
  return segment->host + (static_cast<const char*>(ptr) - base);
}

void FakeCudaRuntime::AddFreeRange(char* ptr, size_t span, int device,
                                   FreePoint free) {
  FreeRange range;
  range.bytes = span;
  range.device = device;
  if (free.stream != nullptr) range.frees.push_back(std::move(free));
  range.order = ++frees_;
  char* base = nullptr;
  const Segment* segment = SegmentAt(ptr, &base);
  // Merge with the free ranges on either side in the same segment: an
  // allocation carved from the merged range is ordered after all of their
  // frees.
  auto merge = [&range](FreeRange& other) {
    for (FreePoint& f : other.frees) {
      // Of one stream's frees the last is after the others.
      auto same = std::find_if(
          range.frees.begin(), range.frees.end(),
          [&f](const FreePoint& g) { return g.stream == f.stream; });
      if (same == range.frees.end()) {
        range.frees.push_back(std::move(f));
      } else if (same->seq < f.seq) {
        *same = std::move(f);
      }
    }
  };
  auto next = free_ranges_.find(ptr + span);
  if (next != free_ranges_.end() && ptr + span < base + segment->bytes) {
    merge(next->second);
    range.bytes += next->second.bytes;
    free_ranges_.erase(next);
  }
  auto prev = free_ranges_.lower_bound(ptr);
  if (prev != free_ranges_.begin() && ptr > base) {
    --prev;
    if (prev->first + prev->second.bytes == ptr && prev->first >= base) {
      merge(prev->second);
      prev->second.bytes += range.bytes;
      prev->second.frees = std::move(range.frees);
      prev->second.order = range.order;
      return;
    }
  }
  free_ranges_[ptr] = std::move(range);
}

void FakeCudaRuntime::ReleaseIdleBlocks() {
  for (auto it = free_ranges_.begin(); it != free_ranges_.end();) {
    auto seg = segments_.find(it->first);
    bool release = seg != segments_.end() &&
                   it->second.bytes == seg->second.bytes &&
                   pools_[it->second.device]->release_threshold == 0;
    for (const FreePoint& f : it->second.frees) {
      release = release && f.stream->completed >= f.seq;
    }
    if (release) {
      pools_[seg->second.device]->reserved -= seg->second.bytes;
      UnmapSegment(seg->first, seg->second);
      segments_.erase(seg);
      it = free_ranges_.erase(it);
    } else {
      ++it;
    }
  }
}

int FakeCudaRuntime::DeviceOf(const void* ptr, bool* pinned) const {
  absl::MutexLock lock(&mu_);
  if (pinned != nullptr) *pinned = IsPinned(ptr);
  return BlockDevice(ptr);
}

cudaError_t FakeCudaRuntime::PointerGetAttributes(
    cudaPointerAttributes* attributes, const void* ptr) {
  {
    absl::MutexLock lock(&mu_);
    const cudaError_t e = Precheck("cudaPointerGetAttributes");
    if (e != cudaSuccess) return Result(e);
  }
  std::memset(attributes, 0, sizeof(*attributes));
  bool pinned = false;
  const int device = DeviceOf(ptr, &pinned);
  if (device >= 0) {
    attributes->type = cudaMemoryTypeDevice;
    attributes->device = device;
    attributes->devicePointer = const_cast<void*>(ptr);
  } else if (pinned) {
    attributes->type = cudaMemoryTypeHost;
    attributes->device = 0;
    attributes->hostPointer = const_cast<void*>(ptr);
  } else {
    // What CUDA 11+ reports for memory it does not know.
    attributes->type = cudaMemoryTypeUnregistered;
    attributes->device = -2;
    attributes->hostPointer = const_cast<void*>(ptr);
  }
  return cudaSuccess;
}

// ---- Memory pools ----

cudaError_t FakeCudaRuntime::DeviceGetDefaultMemPool(cudaMemPool_t* pool,
                                                     int device) {
  absl::MutexLock lock(&mu_);
  cudaError_t e = Precheck("cudaDeviceGetDefaultMemPool");
  if (e == cudaSuccess && (device < 0 || device >= options_.device_count)) {
    e = cudaErrorInvalidDevice;
  }
  if (e == cudaSuccess && !options_.memory_pools) e = cudaErrorNotSupported;
  if (e == cudaSuccess) {
    *pool = reinterpret_cast<cudaMemPool_t>(pools_[device].get());
  }
  return Result(e);
}

cudaError_t FakeCudaRuntime::MemPoolSetAttribute(cudaMemPool_t pool,
                                                 cudaMemPoolAttr attr,
                                                 void* value) {
  absl::MutexLock lock(&mu_);
  cudaError_t e = Precheck("cudaMemPoolSetAttribute");
  if (e == cudaSuccess) {
    auto* p = reinterpret_cast<PoolState*>(pool);
    if (attr == cudaMemPoolAttrReleaseThreshold) {
      p->release_threshold = *static_cast<uint64_t*>(value);
    } else if (attr == cudaMemPoolAttrReservedMemHigh) {
      p->reserved_high = p->reserved;
    } else {
      e = cudaErrorInvalidValue;
    }
  }
  return Result(e);
}

cudaError_t FakeCudaRuntime::MemPoolGetAttribute(cudaMemPool_t pool,
                                                 cudaMemPoolAttr attr,
                                                 void* value) {
  absl::MutexLock lock(&mu_);
  cudaError_t e = Precheck("cudaMemPoolGetAttribute");
  if (e == cudaSuccess) {
    auto* p = reinterpret_cast<PoolState*>(pool);
    uint64_t* out = static_cast<uint64_t*>(value);
    if (attr == cudaMemPoolAttrReleaseThreshold) {
      *out = p->release_threshold;
    } else if (attr == cudaMemPoolAttrReservedMemCurrent) {
      *out = p->reserved;
    } else if (attr == cudaMemPoolAttrReservedMemHigh) {
      *out = p->reserved_high;
    } else {
      e = cudaErrorInvalidValue;
    }
  }
  return Result(e);
}

// ---- Memory ----

cudaError_t FakeCudaRuntime::Malloc(void** ptr, size_t bytes) {
  absl::MutexLock lock(&mu_);
  const cudaError_t e = Precheck("cudaMalloc");
  if (e != cudaSuccess) return Result(e);
  char* host = nullptr;
  char* p = MapSegment(bytes, &host);
  if (p == nullptr) return Result(cudaErrorMemoryAllocation);
  segments_[p] = Segment{bytes, CurrentDevice(), false, host};
  Allocation a;
  a.bytes = bytes;
  a.span = bytes;
  a.device = CurrentDevice();
  allocations_[p] = std::move(a);
  ++device_mallocs_;
  *ptr = p;
  return cudaSuccess;
}

cudaError_t FakeCudaRuntime::Free(void* ptr) {
  absl::MutexLock lock(&mu_);
  cudaError_t e = Precheck("cudaFree");
  if (ptr == nullptr) return Result(e);
  auto it = allocations_.find(static_cast<char*>(ptr));
  if (e == cudaSuccess && it == allocations_.end()) {
    misuse_.push_back(absl::StrFormat("cudaFree(%p): not an allocation", ptr));
    e = cudaErrorInvalidValue;
  }
  if (e != cudaSuccess) return Result(e);
  DrainDevice(-1);  // cudaFree synchronizes the device
  // The drain let go of the lock: look the allocation up again.
  it = allocations_.find(static_cast<char*>(ptr));
  if (it == allocations_.end()) return Result(cudaErrorInvalidValue);
  char* p = it->first;
  const Allocation a = std::move(it->second);
  allocations_.erase(it);
  if (a.pooled) {
    // Back to its pool, free at once (nothing is pending after the drain).
    AddFreeRange(p, a.span, a.device, FreePoint{});
    ReleaseIdleBlocks();
    return cudaSuccess;
  }
  auto seg = segments_.find(p);
  UnmapSegment(seg->first, seg->second);
  segments_.erase(seg);
  return cudaSuccess;
}

cudaError_t FakeCudaRuntime::MallocAsync(void** ptr, size_t bytes,
                                         cudaStream_t stream) {
  absl::MutexLock lock(&mu_);
  cudaError_t e = Precheck("cudaMallocAsync");
  StreamState* s = e == cudaSuccess ? FindStream(stream) : nullptr;
  if (e == cudaSuccess && s == nullptr) e = cudaErrorInvalidResourceHandle;
  if (e != cudaSuccess) return Result(e);
  const size_t span = RoundUp(bytes, kGranule);
  // Reuse freed pool memory as CUDA's default pool may: memory freed on
  // this stream at once, even before the free has run (stream order puts
  // the free first); memory whose frees this stream is ordered after, or
  // that have run; and otherwise any free memory, behind a wait for its
  // frees that the pool inserts into this stream (internal dependencies).
  // Among those, the smallest range that fits (the most recently freed of
  // equals), carving a smaller allocation out of a bigger range.
  auto ordered = [this,
                  s](const FreeRange& r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (const FreePoint& f : r.frees) {
      if (f.stream != s && At(s->clock, f.stream->index) < f.seq &&
          f.stream->completed < f.seq) {
        return false;
      }
    }
    return true;
  };
  auto best = free_ranges_.end();
  for (auto it = free_ranges_.begin(); it != free_ranges_.end(); ++it) {
    const FreeRange& r = it->second;
    if (r.device != s->device || r.bytes < span) continue;
    if (best == free_ranges_.end()) {
      best = it;
      continue;
    }
    const bool a = ordered(r);
    const bool b = ordered(best->second);
    const FreeRange& c = best->second;
    if (a != b ? a
               : (r.bytes != c.bytes ? r.bytes < c.bytes : r.order > c.order)) {
      best = it;
    }
  }
  char* p = nullptr;
  if (best != free_ranges_.end()) {
    p = best->first;
    FreeRange range = std::move(best->second);
    free_ranges_.erase(best);
    for (const FreePoint& f : range.frees) {
      if (f.stream == s || At(s->clock, f.stream->index) >= f.seq ||
          f.stream->completed >= f.seq) {
        continue;
      }
      Op wait;
      wait.what = "cudaMallocAsync's wait for an earlier cudaFreeAsync";
      wait.wait_for = f.stream;
      wait.wait_seq = f.seq;
      Enqueue(s, std::move(wait));
      Join(s->clock, f.clock);
    }
    if (range.bytes > span) {
      range.bytes -= span;
      free_ranges_[p + span] = std::move(range);
    }
  } else {
    char* host = nullptr;
    p = MapSegment(span, &host);
    if (p == nullptr) return Result(cudaErrorMemoryAllocation);
    segments_[p] = Segment{span, s->device, true, host};
    PoolState& pool = *pools_[s->device];
    pool.reserved += span;
    pool.reserved_high = std::max(pool.reserved_high, pool.reserved);
    ++device_mallocs_;
  }
  // The allocation has a place in the stream: work is ordered after it
  // through the stream, or an event recorded after it.
  Op op;
  op.what = "cudaMallocAsync";
  const uint64_t seq = Enqueue(s, std::move(op));
  Allocation a;
  a.bytes = bytes;
  a.span = span;
  a.device = s->device;
  a.pooled = true;
  a.stream = s;
  a.seq = seq;
  allocations_[p] = std::move(a);
  *ptr = p;
  return cudaSuccess;
}

cudaError_t FakeCudaRuntime::FreeAsync(void* ptr, cudaStream_t stream) {
  absl::MutexLock lock(&mu_);
  cudaError_t e = Precheck("cudaFreeAsync");
  StreamState* s = e == cudaSuccess ? FindStream(stream) : nullptr;
  auto it = allocations_.find(static_cast<char*>(ptr));
  if (e == cudaSuccess &&
      (s == nullptr || it == allocations_.end() || !it->second.pooled)) {
    misuse_.push_back(
        absl::StrFormat("cudaFreeAsync(%p): not a live cudaMallocAsync "
                        "allocation",
                        ptr));
    e = cudaErrorInvalidValue;
  }
  if (e != cudaSuccess) return Result(e);
  char* p = it->first;
  const Allocation a = std::move(it->second);
  allocations_.erase(it);
  char* base = nullptr;
  char* host = SegmentAt(p, &base)->host + (p - base);
  Op op;
  op.what = "cudaFreeAsync";
  op.run = [host, bytes = a.span] { std::memset(host, 0xFF, bytes); };
  const uint64_t seq = Enqueue(s, std::move(op));
  // Every use must be ordered before the free: the pool may hand the
  // memory out again as soon as the free is ordered before the new owner,
  // whatever still runs on other streams.
  for (const auto& [index, use] : a.uses) {
    if (index != s->index && At(s->clock, index) < use.first) {
      misuse_.push_back(absl::StrFormat(
          "cudaFreeAsync(%p) on stream %d is not ordered after %s on "
          "stream %d, which uses the memory (record an event after the use "
          "and wait for it first, as RecordStream does)",
          ptr, s->index, use.second, index));
      s->queue.back().poisoned = true;
    }
  }
  AddFreeRange(p, a.span, a.device, FreePoint{s, seq, s->clock});
  return cudaSuccess;
}

cudaError_t FakeCudaRuntime::MallocHost(void** ptr, size_t bytes) {
  absl::MutexLock lock(&mu_);
  const cudaError_t e = Precheck("cudaMallocHost");
  if (e != cudaSuccess) return Result(e);
  char* p = static_cast<char*>(
      ::operator new (std::max<size_t>(bytes, 1), std::align_val_t{256}));
  pinned_[p] = bytes;
  *ptr = p;
  return cudaSuccess;
}

cudaError_t FakeCudaRuntime::FreeHost(void* ptr) {
  absl::MutexLock lock(&mu_);
  cudaError_t e = Precheck("cudaFreeHost");
  auto it = pinned_.find(static_cast<char*>(ptr));
  if (e == cudaSuccess && it == pinned_.end()) {
    misuse_.push_back(absl::StrFormat("cudaFreeHost(%p): not pinned", ptr));
    e = cudaErrorInvalidValue;
  }
  if (e != cudaSuccess) return Result(e);
  DrainDevice(-1);  // cudaFreeHost synchronizes the device
  ::operator delete (it->first, std::align_val_t{256});
  pinned_.erase(it);
  return cudaSuccess;
}

cudaError_t FakeCudaRuntime::MemcpyAsync(void* dst, const void* src,
                                         size_t bytes, cudaMemcpyKind kind,
                                         cudaStream_t stream) {
  absl::MutexLock lock(&mu_);
  cudaError_t e = Precheck("cudaMemcpyAsync");
  StreamState* s = e == cudaSuccess ? FindStream(stream) : nullptr;
  if (e == cudaSuccess && s == nullptr) e = cudaErrorInvalidResourceHandle;
  if (e != cudaSuccess) return Result(e);
  if (bytes == 0) return cudaSuccess;
  const bool dst_dev = IsDevicePointer(dst);
  const bool src_dev = IsDevicePointer(src);
  if ((dst_dev && !IsLiveDevice(dst, bytes)) ||
      (src_dev && !IsLiveDevice(src, bytes))) {
    return Result(cudaErrorInvalidValue);
  }
  Op op;
  op.what = absl::StrFormat("cudaMemcpyAsync(%d bytes)", bytes);
  if (dst_dev) op.touches.push_back({dst, bytes});
  if (src_dev) op.touches.push_back({src, bytes});
  const bool pageable_src = !src_dev && !IsPinned(src);
  const bool pageable_dst = !dst_dev && !IsPinned(dst);
  if (pageable_src && dst_dev) {
    // From pageable memory: the stream drains, the source is staged, and
    // the call returns; the caller may reuse the source at once.
    DrainStream(s);
    auto staged = std::make_shared<std::vector<char>>(
        static_cast<const char*>(src), static_cast<const char*>(src) + bytes);
    op.run = [this, dst, staged] {
      std::memcpy(HostAlias(dst), staged->data(), staged->size());
    };
    Enqueue(s, std::move(op));
    return cudaSuccess;
  }
  op.run = [this, dst, src, bytes] {
    std::memcpy(HostAlias(dst), HostAlias(src), bytes);
  };
  Enqueue(s, std::move(op));
  if (pageable_dst && src_dev) {
    DrainStream(s);  // to pageable memory: returns once copied
    if (sticky_ != cudaSuccess) return Result(sticky_);
  }
  return cudaSuccess;
}

cudaError_t FakeCudaRuntime::MemsetAsync(void* dst, int value, size_t bytes,
                                         cudaStream_t stream) {
  absl::MutexLock lock(&mu_);
  cudaError_t e = Precheck("cudaMemsetAsync");
  StreamState* s = e == cudaSuccess ? FindStream(stream) : nullptr;
  if (e == cudaSuccess && s == nullptr) e = cudaErrorInvalidResourceHandle;
  if (e == cudaSuccess && bytes > 0 && !IsLiveDevice(dst, bytes)) {
    e = cudaErrorInvalidValue;
  }
  if (e != cudaSuccess) return Result(e);
  Op op;
  op.what = absl::StrFormat("cudaMemsetAsync(%d bytes)", bytes);
  op.touches = {{dst, bytes}};
  op.run = [this, dst, value, bytes] {
    std::memset(HostAlias(dst), value, bytes);
  };
  Enqueue(s, std::move(op));
  return cudaSuccess;
}

}  // namespace flatparam
