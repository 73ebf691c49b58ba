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

bool FakeCudaRuntime::IsLiveDevice(const void* ptr, size_t bytes) const {
  char* p = static_cast<char*>(const_cast<void*>(ptr));
  auto it = blocks_.upper_bound(p);
  if (it == blocks_.begin()) return false;
  --it;
  return it->second.live && p + bytes <= it->first + it->second.bytes;
}

int FakeCudaRuntime::BlockDevice(const void* ptr) const {
  char* p = static_cast<char*>(const_cast<void*>(ptr));
  auto it = blocks_.upper_bound(p);
  if (it == blocks_.begin()) return -1;
  --it;
  if (!it->second.live || p >= it->first + it->second.bytes) return -1;
  return it->second.device;
}

bool FakeCudaRuntime::IsDevicePointer(const void* ptr) const {
  char* p = static_cast<char*>(const_cast<void*>(ptr));
  auto it = blocks_.upper_bound(p);
  if (it == blocks_.begin()) return false;
  --it;
  return p < it->first + std::max<size_t>(it->second.bytes, 1);
}

bool FakeCudaRuntime::IsPinned(const void* ptr) const {
  char* p = static_cast<char*>(const_cast<void*>(ptr));
  auto it = pinned_.upper_bound(p);
  if (it == pinned_.begin()) return false;
  --it;
  return p < it->first + std::max<size_t>(it->second, 1);
}

namespace {

// The bytes the two views of a block of `bytes` span: whole pages.
size_t MappedBytes(size_t bytes) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return (std::max<size_t>(bytes, 1) + page - 1) / page * page;
}

}  // namespace

char* FakeCudaRuntime::MapBlock(size_t bytes, char** host) {
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

void FakeCudaRuntime::UnmapBlock(char* device, const Block& block) {
  const size_t length = MappedBytes(block.bytes);
  munmap(block.host, length);
  munmap(device, length);
}

void* FakeCudaRuntime::HostAlias(const void* ptr) const {
  absl::MutexLock lock(&mu_);
  char* p = static_cast<char*>(const_cast<void*>(ptr));
  auto it = blocks_.upper_bound(p);
  if (it == blocks_.begin()) return p;
  --it;
  if (p >= it->first + std::max<size_t>(it->second.bytes, 1)) return p;
  return it->second.host + (p - it->first);
}

void FakeCudaRuntime::ReleaseIdleBlocks() {
  for (auto it = blocks_.begin(); it != blocks_.end();) {
    PoolState& pool = *pools_[it->second.device];
    if (it->second.pooled && !it->second.live && pool.release_threshold == 0) {
      pool.reserved -= it->second.bytes;
      UnmapBlock(it->first, it->second);
      it = blocks_.erase(it);
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
  char* p = MapBlock(bytes, &host);
  if (p == nullptr) return Result(cudaErrorMemoryAllocation);
  blocks_[p] = Block{bytes, CurrentDevice(), true, false, host};
  ++device_mallocs_;
  *ptr = p;
  return cudaSuccess;
}

cudaError_t FakeCudaRuntime::Free(void* ptr) {
  absl::MutexLock lock(&mu_);
  cudaError_t e = Precheck("cudaFree");
  if (ptr == nullptr) return Result(e);
  auto it = blocks_.find(static_cast<char*>(ptr));
  if (e == cudaSuccess && (it == blocks_.end() || !it->second.live)) {
    misuse_.push_back(absl::StrFormat("cudaFree(%p): not an allocation", ptr));
    e = cudaErrorInvalidValue;
  }
  if (e != cudaSuccess) return Result(e);
  DrainDevice(-1);  // cudaFree synchronizes the device
  if (it->second.pooled) {
    pools_[it->second.device]->reserved -= it->second.bytes;
  }
  UnmapBlock(it->first, it->second);
  blocks_.erase(it);
  return cudaSuccess;
}

cudaError_t FakeCudaRuntime::MallocAsync(void** ptr, size_t bytes,
                                         cudaStream_t stream) {
  absl::MutexLock lock(&mu_);
  cudaError_t e = Precheck("cudaMallocAsync");
  StreamState* s = e == cudaSuccess ? FindStream(stream) : nullptr;
  if (e == cudaSuccess && s == nullptr) e = cudaErrorInvalidResourceHandle;
  if (e != cudaSuccess) return Result(e);
  // Reuse a block whose free has completed (a stream-ordered free makes it
  // free only when its stream gets there).
  for (auto& [p, b] : blocks_) {
    if (b.pooled && !b.live && b.device == s->device && b.bytes == bytes) {
      b.live = true;
      *ptr = p;
      return cudaSuccess;
    }
  }
  char* host = nullptr;
  char* p = MapBlock(bytes, &host);
  if (p == nullptr) return Result(cudaErrorMemoryAllocation);
  blocks_[p] = Block{bytes, s->device, true, true, host};
  PoolState& pool = *pools_[s->device];
  pool.reserved += bytes;
  pool.reserved_high = std::max(pool.reserved_high, pool.reserved);
  ++device_mallocs_;
  *ptr = p;
  return cudaSuccess;
}

cudaError_t FakeCudaRuntime::FreeAsync(void* ptr, cudaStream_t stream) {
  absl::MutexLock lock(&mu_);
  cudaError_t e = Precheck("cudaFreeAsync");
  StreamState* s = e == cudaSuccess ? FindStream(stream) : nullptr;
  auto it = blocks_.find(static_cast<char*>(ptr));
  if (e == cudaSuccess &&
      (s == nullptr || it == blocks_.end() || !it->second.live)) {
    misuse_.push_back(
        absl::StrFormat("cudaFreeAsync(%p): not a live allocation", ptr));
    e = cudaErrorInvalidValue;
  }
  if (e != cudaSuccess) return Result(e);
  char* p = it->first;
  Op op;
  op.what = "cudaFreeAsync";
  op.touches = {{p, it->second.bytes}};
  op.run = [this, p] {
    absl::MutexLock lock(&mu_);
    auto b = blocks_.find(p);
    std::memset(b->second.host, 0xFF, b->second.bytes);
    b->second.live = false;
  };
  Enqueue(s, std::move(op));
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
