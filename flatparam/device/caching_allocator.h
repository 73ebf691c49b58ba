// CachingAllocator: keeps freed blocks in per-size free lists and hands them
// out again, so that a program that frees and reallocates buffers of the
// same sizes over and over (FlatParamHandle's Unshard()/Reshard() and
// ReduceGrad(), every iteration) stops paying for the underlying allocator.
// It plays the role of PyTorch's CUDA caching allocator
// (c10/cuda/CUDACachingAllocator.cpp), without its block splitting.
//
// Why on the host: glibc serves large blocks with mmap (its mmap threshold
// is 128 KiB, adjusted up to 32 MiB) and unmaps them on free, so each fresh
// allocation of a large buffer first-touches, i.e. page-faults, every page.
// For a 256 MiB unsharded parameter that is slower than the all-gather that
// fills it (BENCHMARKS.md, handle_bench).
//
//   HeapBlockSource heap;
//   CachingAllocatorOptions options;
//   options.max_cached_bytes = int64_t{1} << 30;
//   CachingAllocator cache(&heap, options);
//   FLATPARAM_ASSIGN_OR_RETURN(void* p, cache.Allocate(Device::Host(), n,
//                                                       /*pinned=*/false));
//   ...
//   cache.Free(p, Device::Host(), /*pinned=*/false);  // kept for reuse
//
// Size classes. A request is rounded up to a class: multiples of 512 bytes
// below 1 MiB (PyTorch's kMinBlockSize), and from 1 MiB four classes per
// power of two (1, 1.25, 1.5, 1.75, 2, 2.5, ... MiB: PyTorch's
// `roundup_power2_divisions:4`), so at most 25% of a large block is slack.
// The underlying block has the class size, and a request is served only
// from a block of its own class: never from a smaller block (it would not
// fit), never from a larger class (which would waste more than the class
// spacing). The slack of a large host block costs address space, not
// resident memory, as long as nobody touches it.
//
// Pools. Blocks are cached per (device, pinned): a pinned request is only
// served by a block the source allocated pinned, and likewise pageable, so
// page-locked and pageable memory are never mixed.
//
// Cap. At most `max_cached_bytes` (class sizes, all pools together) sit in
// the free lists; freeing a block beyond the cap releases the least recently
// freed blocks to the source (a block larger than the cap is released
// itself). 0 turns caching off. When the source fails an allocation, the
// whole cache is released and the allocation retried once, as PyTorch does
// on a CUDA out-of-memory error.
//
// Memory. Blocks come from and go back to a BlockSource, which must outlive
// the allocator. A block handed out by Allocate() belongs to the caller until
// Free(); the destructor releases the cache and requires every block to have
// been freed. Under AddressSanitizer cached blocks and the slack past each
// request are poisoned, so a use after free (or an overrun into the slack)
// is still reported although the memory stays allocated; builds with
// assertions fill each block handed out with 0xFF bytes (NaN in every float
// dtype), so that code that reads memory before writing it shows up as
// NaNs instead of silently reading the previous user's values.
//
// Thread-safety: thread-safe (a mutex guards the free lists and counters);
// the BlockSource is only called with the mutex held.
#ifndef FLATPARAM_DEVICE_CACHING_ALLOCATOR_H_
#define FLATPARAM_DEVICE_CACHING_ALLOCATOR_H_

#include <cstdint>
#include <list>
#include <map>
#include <tuple>
#include <unordered_map>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "flatparam/base/buffer.h"

namespace flatparam {

// Where blocks really come from.
class BlockSource {
 public:
  virtual ~BlockSource() = default;
  // A block of `bytes` (> 0) bytes, 64-byte aligned; ResourceExhausted when
  // it cannot be had.
  virtual absl::StatusOr<void*> Allocate(Device device, int64_t bytes,
                                         bool pinned) = 0;
  // Frees a block Allocate() returned with the same arguments.
  virtual void Free(void* data, Device device, int64_t bytes, bool pinned) = 0;
};

// Host heap memory (aligned operator new), for the host only; `pinned` is
// ignored, as HostDeviceOps has no device to pin for. Stateless.
class HeapBlockSource final : public BlockSource {
 public:
  absl::StatusOr<void*> Allocate(Device device, int64_t bytes,
                                 bool pinned) override;
  void Free(void* data, Device device, int64_t bytes, bool pinned) override;
};

struct CachingAllocatorOptions {
  // The most bytes (class sizes) the free lists may hold, all pools
  // together; 0 disables caching. The default holds a few large units.
  int64_t max_cached_bytes = int64_t{1} << 30;
};

struct CachingAllocatorStats {
  int64_t cached_bytes = 0;   // in the free lists, class sizes
  int64_t cached_blocks = 0;  // in the free lists
  int64_t live_bytes = 0;     // handed out and not yet freed, class sizes
  int64_t live_blocks = 0;
  int64_t hits = 0;    // allocations served from a free list
  int64_t misses = 0;  // allocations that went to the source
  // Blocks given back to the source: over the cap, by EmptyCache(), or to
  // retry a failed allocation.
  int64_t released_blocks = 0;
};

class CachingAllocator {
 public:
  // `source` is not owned and must outlive the allocator.
  CachingAllocator(BlockSource* source, CachingAllocatorOptions options);
  // Releases the cache. REQUIRES: every block was freed.
  ~CachingAllocator();
  CachingAllocator(const CachingAllocator&) = delete;
  CachingAllocator& operator=(const CachingAllocator&) = delete;

  // The size class of a `bytes` (> 0) request: the block size handed out.
  static int64_t RoundSize(int64_t bytes);

  // A block of at least `bytes` (> 0) bytes, 64-byte aligned, uninitialized.
  // The source's error when it fails even after releasing the cache.
  absl::StatusOr<void*> Allocate(Device device, int64_t bytes, bool pinned);
  // Returns a block from Allocate() (with the same device and pinned) to the
  // cache, or to the source when caching it would exceed the cap.
  void Free(void* data, Device device, bool pinned);
  // Releases every cached block to the source.
  void EmptyCache();

  CachingAllocatorStats stats() const;
  const CachingAllocatorOptions& options() const { return options_; }

 private:
  // (device type, device index, pinned, class size).
  using Key = std::tuple<int, int, bool, int64_t>;
  struct Cached {
    void* data;
    Key key;
  };
  using Lru = std::list<Cached>;  // front: most recently freed
  struct Live {
    Key key;
    int64_t requested;
  };

  static Key MakeKey(Device device, bool pinned, int64_t size);
  void Release(const Cached& block) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Releases least recently freed blocks until at most `limit` bytes stay.
  void TrimTo(int64_t limit) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  BlockSource* const source_;
  const CachingAllocatorOptions options_;
  mutable absl::Mutex mu_;
  Lru lru_ ABSL_GUARDED_BY(mu_);
  // Cached blocks by key; among equal keys, later entries were freed later.
  std::multimap<Key, Lru::iterator> free_ ABSL_GUARDED_BY(mu_);
  std::unordered_map<void*, Live> live_ ABSL_GUARDED_BY(mu_);
  CachingAllocatorStats stats_ ABSL_GUARDED_BY(mu_);
};

}  // namespace flatparam

#endif  // FLATPARAM_DEVICE_CACHING_ALLOCATOR_H_
