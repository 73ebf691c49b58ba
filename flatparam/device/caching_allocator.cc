#include "flatparam/device/caching_allocator.h"

#include <cassert>
#include <cstring>
#include <iterator>
#include <new>

#include "absl/base/config.h"
#include "absl/status/status.h"
#include "absl/strings/str_format.h"

#ifdef ABSL_HAVE_ADDRESS_SANITIZER
#include <sanitizer/asan_interface.h>
#define FLATPARAM_POISON(p, n) ASAN_POISON_MEMORY_REGION(p, n)
#define FLATPARAM_UNPOISON(p, n) ASAN_UNPOISON_MEMORY_REGION(p, n)
#else
#define FLATPARAM_POISON(p, n) ((void)(p), (void)(n))
#define FLATPARAM_UNPOISON(p, n) ((void)(p), (void)(n))
#endif

namespace flatparam {
namespace {

constexpr int64_t kSmallRound = 512;
constexpr int64_t kLargeFrom = int64_t{1} << 20;
constexpr int kDivisionsPerPowerOfTwo = 4;

constexpr std::align_val_t kAlignment{64};

int64_t ClassSize(const std::tuple<int, int, bool, int64_t>& key) {
  return std::get<3>(key);
}

// Makes a block's first `requested` bytes usable and the slack past them
// poisoned; in builds with assertions, fills the usable part with 0xFF.
void HandOut(void* data, int64_t requested, int64_t size) {
  FLATPARAM_UNPOISON(data, requested);
  FLATPARAM_POISON(static_cast<char*>(data) + requested, size - requested);
#ifndef NDEBUG
  std::memset(data, 0xFF, static_cast<size_t>(requested));
#endif
}

}  // namespace

absl::StatusOr<void*> HeapBlockSource::Allocate(Device device, int64_t bytes,
                                                bool pinned) {
  assert(device == Device::Host());
  void* p =
      ::operator new(static_cast<size_t>(bytes), kAlignment, std::nothrow);
  if (p == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrFormat("host allocation of %d bytes failed", bytes));
  }
  return p;
}

void HeapBlockSource::Free(void* data, Device device, int64_t bytes,
                           bool pinned) {
  ::operator delete(data, kAlignment);
}

CachingAllocator::CachingAllocator(BlockSource* source,
                                   CachingAllocatorOptions options)
    : source_(source), options_(options) {
  assert(source_ != nullptr);
  assert(options_.max_cached_bytes >= 0);
}

CachingAllocator::~CachingAllocator() {
  absl::MutexLock lock(&mu_);
  // A live block here is a DeviceBuffer that outlived its DeviceOps.
  assert(live_.empty() && "a block outlived its CachingAllocator");
  TrimTo(0);
}

int64_t CachingAllocator::RoundSize(int64_t bytes) {
  assert(bytes > 0);
  if (bytes < kLargeFrom) {
    return (bytes + kSmallRound - 1) / kSmallRound * kSmallRound;
  }
  // The largest power of two <= bytes, split into equal steps.
  int64_t power = kLargeFrom;
  while (power <= bytes / 2) power *= 2;
  const int64_t step = power / kDivisionsPerPowerOfTwo;
  return (bytes + step - 1) / step * step;
}

CachingAllocator::Key CachingAllocator::MakeKey(Device device, bool pinned,
                                                int64_t size) {
  return Key(static_cast<int>(device.type), device.index, pinned, size);
}

absl::StatusOr<void*> CachingAllocator::Allocate(Device device, int64_t bytes,
                                                 bool pinned) {
  assert(bytes > 0);
  const int64_t size = RoundSize(bytes);
  const Key key = MakeKey(device, pinned, size);
  absl::MutexLock lock(&mu_);
  void* data = nullptr;
  const auto range = free_.equal_range(key);
  if (range.first != range.second) {
    // The most recently freed block of the class: the likeliest in cache.
    const auto entry = std::prev(range.second);
    data = entry->second->data;
    lru_.erase(entry->second);
    free_.erase(entry);
    stats_.cached_bytes -= size;
    --stats_.cached_blocks;
    ++stats_.hits;
  } else {
    absl::StatusOr<void*> fresh = source_->Allocate(device, size, pinned);
    if (!fresh.ok() && !lru_.empty()) {
      TrimTo(0);
      fresh = source_->Allocate(device, size, pinned);
    }
    if (!fresh.ok()) return fresh.status();
    data = *fresh;
    assert(reinterpret_cast<uintptr_t>(data) %
               static_cast<uintptr_t>(kAlignment) ==
           0);
    ++stats_.misses;
  }
  HandOut(data, bytes, size);
  const bool inserted = live_.emplace(data, Live{key, bytes}).second;
  assert(inserted);
  (void)inserted;
  stats_.live_bytes += size;
  ++stats_.live_blocks;
  return data;
}

void CachingAllocator::Free(void* data, Device device, bool pinned) {
  absl::MutexLock lock(&mu_);
  const auto it = live_.find(data);
  assert(it != live_.end() && "freeing a block this allocator does not own");
  const Key key = it->second.key;
  assert(key == MakeKey(device, pinned, ClassSize(key)));
  live_.erase(it);
  const int64_t size = ClassSize(key);
  stats_.live_bytes -= size;
  --stats_.live_blocks;
  const Cached block{data, key};
  if (size > options_.max_cached_bytes) {
    Release(block);
    return;
  }
  FLATPARAM_POISON(data, size);
  lru_.push_front(block);
  free_.emplace(key, lru_.begin());
  stats_.cached_bytes += size;
  ++stats_.cached_blocks;
  TrimTo(options_.max_cached_bytes);
}

void CachingAllocator::EmptyCache() {
  absl::MutexLock lock(&mu_);
  TrimTo(0);
}

CachingAllocatorStats CachingAllocator::stats() const {
  absl::MutexLock lock(&mu_);
  return stats_;
}

void CachingAllocator::Release(const Cached& block) {
  const int64_t size = ClassSize(block.key);
  FLATPARAM_UNPOISON(block.data, size);
  const Device device{static_cast<DeviceType>(std::get<0>(block.key)),
                      std::get<1>(block.key)};
  source_->Free(block.data, device, size, std::get<2>(block.key));
  ++stats_.released_blocks;
}

void CachingAllocator::TrimTo(int64_t limit) {
  while (stats_.cached_bytes > limit) {
    assert(!lru_.empty());
    const auto oldest = std::prev(lru_.end());
    auto range = free_.equal_range(oldest->key);
    while (range.first->second != oldest) {
      ++range.first;
      assert(range.first != range.second);
    }
    free_.erase(range.first);
    stats_.cached_bytes -= ClassSize(oldest->key);
    --stats_.cached_blocks;
    Release(*oldest);
    lru_.erase(oldest);
  }
}

}  // namespace flatparam
