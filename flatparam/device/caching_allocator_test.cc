#include "flatparam/device/caching_allocator.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <random>
#include <thread>
#include <vector>

#include "absl/base/config.h"
#include "absl/status/status.h"
#include "flatparam/base/dtype.h"
#include "flatparam/base/status_matchers.h"
#include "flatparam/device/device.h"

namespace flatparam {
namespace {

constexpr int64_t kMiB = int64_t{1} << 20;

// Heap blocks, with a record of every live one (to check that frees match
// their allocations) and an optional budget beyond which allocation fails.
class CountingSource final : public BlockSource {
 public:
  struct Block {
    Device device;
    int64_t bytes;
    bool pinned;
  };

  absl::StatusOr<void*> Allocate(Device device, int64_t bytes,
                                 bool pinned) override {
    if (live_bytes + bytes > budget) {
      return absl::ResourceExhaustedError("over budget");
    }
    FLATPARAM_ASSIGN_OR_RETURN(void* p,
                               heap_.Allocate(Device::Host(), bytes, pinned));
    live[p] = {device, bytes, pinned};
    live_bytes += bytes;
    ++allocations;
    return p;
  }
  void Free(void* data, Device device, int64_t bytes, bool pinned) override {
    auto it = live.find(data);
    EXPECT_NE(it, live.end()) << "freeing an unknown block";
    if (it == live.end()) return;
    EXPECT_EQ(it->second.device, device);
    EXPECT_EQ(it->second.bytes, bytes);
    EXPECT_EQ(it->second.pinned, pinned);
    live_bytes -= bytes;
    live.erase(it);
    ++frees;
    heap_.Free(data, Device::Host(), bytes, pinned);
  }

  std::map<void*, Block> live;
  int64_t live_bytes = 0;
  int64_t budget = INT64_MAX;
  int allocations = 0;
  int frees = 0;

 private:
  HeapBlockSource heap_;
};

CachingAllocatorOptions Cap(int64_t bytes) {
  CachingAllocatorOptions options;
  options.max_cached_bytes = bytes;
  return options;
}

TEST(CachingAllocatorTest, RoundsToSizeClasses) {
  EXPECT_EQ(CachingAllocator::RoundSize(1), 512);
  EXPECT_EQ(CachingAllocator::RoundSize(512), 512);
  EXPECT_EQ(CachingAllocator::RoundSize(513), 1024);
  EXPECT_EQ(CachingAllocator::RoundSize(kMiB - 1), kMiB);
  EXPECT_EQ(CachingAllocator::RoundSize(kMiB), kMiB);
  EXPECT_EQ(CachingAllocator::RoundSize(kMiB + 1), kMiB + kMiB / 4);
  EXPECT_EQ(CachingAllocator::RoundSize(2 * kMiB - 1), 2 * kMiB);
  EXPECT_EQ(CachingAllocator::RoundSize(3 * kMiB), 3 * kMiB);
  EXPECT_EQ(CachingAllocator::RoundSize(3 * kMiB + 1), 3 * kMiB + kMiB / 2);
  EXPECT_EQ(CachingAllocator::RoundSize(255 * kMiB), 256 * kMiB);
  EXPECT_EQ(CachingAllocator::RoundSize(256 * kMiB), 256 * kMiB);
  // Never below the request, never more than 25% (large) or 511 B above.
  for (int64_t b = 1; b < 64 * kMiB; b = b * 3 / 2 + 1) {
    const int64_t r = CachingAllocator::RoundSize(b);
    EXPECT_GE(r, b);
    EXPECT_LE(r, b < kMiB ? b + 511 : b + b / 4) << b;
  }
}

TEST(CachingAllocatorTest, ReusesAFreedBlockOfTheSameClass) {
  CountingSource source;
  CachingAllocator cache(&source, Cap(kMiB));
  FLATPARAM_ASSERT_OK_AND_ASSIGN(void* a,
                                 cache.Allocate(Device::Host(), 1000, false));
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a) % 64, 0u);
  EXPECT_EQ(source.live.at(a).bytes, 1024);
  cache.Free(a, Device::Host(), false);
  CachingAllocatorStats s = cache.stats();
  EXPECT_EQ(s.misses, 1);
  EXPECT_EQ(s.hits, 0);
  EXPECT_EQ(s.cached_bytes, 1024);
  EXPECT_EQ(s.cached_blocks, 1);
  EXPECT_EQ(s.live_bytes, 0);
  EXPECT_EQ(source.frees, 0);

  // 600 bytes round to the same 1024-byte class.
  FLATPARAM_ASSERT_OK_AND_ASSIGN(void* b,
                                 cache.Allocate(Device::Host(), 600, false));
  EXPECT_EQ(b, a);
  s = cache.stats();
  EXPECT_EQ(s.hits, 1);
  EXPECT_EQ(s.misses, 1);
  EXPECT_EQ(s.cached_bytes, 0);
  EXPECT_EQ(s.live_bytes, 1024);
  EXPECT_EQ(s.live_blocks, 1);

  // The block is live again: a second request of the class is a miss.
  FLATPARAM_ASSERT_OK_AND_ASSIGN(void* c,
                                 cache.Allocate(Device::Host(), 1024, false));
  EXPECT_NE(c, b);
  EXPECT_EQ(cache.stats().misses, 2);
  EXPECT_EQ(source.allocations, 2);
  cache.Free(b, Device::Host(), false);
  cache.Free(c, Device::Host(), false);

  // The most recently freed block of a class is handed out first.
  FLATPARAM_ASSERT_OK_AND_ASSIGN(void* d,
                                 cache.Allocate(Device::Host(), 1024, false));
  EXPECT_EQ(d, c);
  cache.Free(d, Device::Host(), false);
  EXPECT_EQ(source.allocations, 2);
}

TEST(CachingAllocatorTest, NeverServesFromAnotherClass) {
  CountingSource source;
  CachingAllocator cache(&source, Cap(64 * kMiB));
  FLATPARAM_ASSERT_OK_AND_ASSIGN(void* a,
                                 cache.Allocate(Device::Host(), kMiB, false));
  cache.Free(a, Device::Host(), false);
  // One byte more: the cached 1 MiB block is too small.
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      void* b, cache.Allocate(Device::Host(), kMiB + 1, false));
  EXPECT_NE(b, a);
  EXPECT_EQ(source.live.at(b).bytes, kMiB + kMiB / 4);
  // 512 B less is the class below: the 1 MiB block is not used either.
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      void* c, cache.Allocate(Device::Host(), kMiB - 512, false));
  EXPECT_NE(c, a);
  CachingAllocatorStats s = cache.stats();
  EXPECT_EQ(s.hits, 0);
  EXPECT_EQ(s.misses, 3);
  EXPECT_EQ(s.cached_blocks, 1);
  cache.Free(b, Device::Host(), false);
  cache.Free(c, Device::Host(), false);
}

TEST(CachingAllocatorTest, KeepsPinnedPageableAndDevicesApart) {
  CountingSource source;
  CachingAllocator cache(&source, Cap(kMiB));
  FLATPARAM_ASSERT_OK_AND_ASSIGN(void* pinned,
                                 cache.Allocate(Device::Host(), 4096, true));
  FLATPARAM_ASSERT_OK_AND_ASSIGN(void* on_gpu,
                                 cache.Allocate(Device::Cuda(0), 4096, false));
  cache.Free(pinned, Device::Host(), true);
  cache.Free(on_gpu, Device::Cuda(0), false);
  // A pageable host request of the class gets neither cached block.
  FLATPARAM_ASSERT_OK_AND_ASSIGN(void* pageable,
                                 cache.Allocate(Device::Host(), 4096, false));
  EXPECT_NE(pageable, pinned);
  EXPECT_NE(pageable, on_gpu);
  EXPECT_FALSE(source.live.at(pageable).pinned);
  EXPECT_EQ(cache.stats().misses, 3);
  // Nor does a pinned request on another device.
  FLATPARAM_ASSERT_OK_AND_ASSIGN(void* other,
                                 cache.Allocate(Device::Cuda(1), 4096, true));
  EXPECT_NE(other, pinned);
  EXPECT_NE(other, on_gpu);
  EXPECT_EQ(cache.stats().misses, 4);
  // Each pool serves its own.
  FLATPARAM_ASSERT_OK_AND_ASSIGN(void* pinned2,
                                 cache.Allocate(Device::Host(), 4096, true));
  FLATPARAM_ASSERT_OK_AND_ASSIGN(void* on_gpu2,
                                 cache.Allocate(Device::Cuda(0), 4096, false));
  EXPECT_EQ(pinned2, pinned);
  EXPECT_EQ(on_gpu2, on_gpu);
  EXPECT_EQ(cache.stats().hits, 2);
  for (void* p : {pageable, pinned2}) {
    cache.Free(p, Device::Host(), source.live.at(p).pinned);
  }
  cache.Free(other, Device::Cuda(1), true);
  cache.Free(on_gpu2, Device::Cuda(0), false);
  // Released blocks go back with the device and pinned they came with
  // (CountingSource checks).
  cache.EmptyCache();
  EXPECT_TRUE(source.live.empty());
}

TEST(CachingAllocatorTest, HonoursTheCapLeastRecentlyFreedFirst) {
  CountingSource source;
  CachingAllocator cache(&source, Cap(3 * 1024));
  std::vector<void*> blocks;
  for (int i = 0; i < 4; ++i) {
    FLATPARAM_ASSERT_OK_AND_ASSIGN(void* p,
                                   cache.Allocate(Device::Host(), 1024, false));
    blocks.push_back(p);
  }
  for (void* p : blocks) {
    cache.Free(p, Device::Host(), false);
    EXPECT_LE(cache.stats().cached_bytes, 3 * 1024);
  }
  CachingAllocatorStats s = cache.stats();
  EXPECT_EQ(s.cached_bytes, 3 * 1024);
  EXPECT_EQ(s.cached_blocks, 3);
  EXPECT_EQ(s.released_blocks, 1);
  // The first block freed was the one released.
  EXPECT_EQ(source.live.count(blocks[0]), 0u);
  EXPECT_EQ(source.live.size(), 3u);

  // A 2 KiB block pushes out the two oldest 1 KiB ones.
  FLATPARAM_ASSERT_OK_AND_ASSIGN(void* big,
                                 cache.Allocate(Device::Host(), 2048, false));
  cache.Free(big, Device::Host(), false);
  EXPECT_EQ(cache.stats().cached_bytes, 3 * 1024);
  EXPECT_EQ(source.live.count(blocks[1]), 0u);
  EXPECT_EQ(source.live.count(blocks[2]), 0u);
  EXPECT_EQ(source.live.count(blocks[3]), 1u);
  EXPECT_EQ(source.live.count(big), 1u);

  // A block larger than the cap is released at once; the cache is kept.
  FLATPARAM_ASSERT_OK_AND_ASSIGN(void* huge,
                                 cache.Allocate(Device::Host(), 4096, false));
  cache.Free(huge, Device::Host(), false);
  EXPECT_EQ(source.live.count(huge), 0u);
  EXPECT_EQ(cache.stats().cached_blocks, 2);
}

TEST(CachingAllocatorTest, CapZeroCachesNothing) {
  CountingSource source;
  CachingAllocator cache(&source, Cap(0));
  for (int i = 0; i < 3; ++i) {
    FLATPARAM_ASSERT_OK_AND_ASSIGN(void* p,
                                   cache.Allocate(Device::Host(), 100, false));
    cache.Free(p, Device::Host(), false);
    EXPECT_TRUE(source.live.empty());
  }
  CachingAllocatorStats s = cache.stats();
  EXPECT_EQ(s.hits, 0);
  EXPECT_EQ(s.misses, 3);
  EXPECT_EQ(s.released_blocks, 3);
  EXPECT_EQ(s.cached_bytes, 0);
}

TEST(CachingAllocatorTest, EmptyCacheReleasesCachedBlocksOnly) {
  CountingSource source;
  CachingAllocator cache(&source, Cap(kMiB));
  FLATPARAM_ASSERT_OK_AND_ASSIGN(void* kept,
                                 cache.Allocate(Device::Host(), 2048, false));
  std::memset(kept, 7, 2048);
  for (int64_t bytes : {512, 1024, 4096}) {
    FLATPARAM_ASSERT_OK_AND_ASSIGN(
        void* p, cache.Allocate(Device::Host(), bytes, false));
    cache.Free(p, Device::Host(), false);
  }
  EXPECT_EQ(cache.stats().cached_blocks, 3);
  EXPECT_EQ(source.live.size(), 4u);
  cache.EmptyCache();
  CachingAllocatorStats s = cache.stats();
  EXPECT_EQ(s.cached_bytes, 0);
  EXPECT_EQ(s.cached_blocks, 0);
  EXPECT_EQ(s.released_blocks, 3);
  EXPECT_EQ(s.live_bytes, 2048);
  ASSERT_EQ(source.live.size(), 1u);
  EXPECT_EQ(source.live.begin()->first, kept);
  EXPECT_EQ(static_cast<unsigned char*>(kept)[2047], 7);
  // Nothing is left to reuse.
  FLATPARAM_ASSERT_OK_AND_ASSIGN(void* again,
                                 cache.Allocate(Device::Host(), 512, false));
  EXPECT_EQ(cache.stats().hits, 0);
  cache.Free(again, Device::Host(), false);
  cache.Free(kept, Device::Host(), false);
}

TEST(CachingAllocatorTest, ReleasesTheCacheAndRetriesWhenTheSourceFails) {
  CountingSource source;
  source.budget = 8 * 1024;
  CachingAllocator cache(&source, Cap(kMiB));
  for (int64_t bytes : {2048, 4096}) {
    FLATPARAM_ASSERT_OK_AND_ASSIGN(
        void* p, cache.Allocate(Device::Host(), bytes, false));
    cache.Free(p, Device::Host(), false);
  }
  // 6 KiB cached; 4 KiB more only fits once the cache is released.
  FLATPARAM_ASSERT_OK_AND_ASSIGN(void* p,
                                 cache.Allocate(Device::Host(), 3000, false));
  EXPECT_EQ(cache.stats().cached_blocks, 0);
  EXPECT_EQ(cache.stats().released_blocks, 2);
  // Still over budget with an empty cache: the source's error.
  EXPECT_THAT(cache.Allocate(Device::Host(), 8192, false),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       ::testing::HasSubstr("over budget")));
  cache.Free(p, Device::Host(), false);
}

// Random allocations and frees against the invariants: the source holds
// exactly the live and cached blocks, the cache stays under the cap, live
// blocks never overlap and keep their contents.
TEST(CachingAllocatorTest, RandomSequencesKeepTheInvariants) {
  std::mt19937 rng(7);
  for (int64_t cap : {int64_t{0}, int64_t{5000}, 3 * kMiB}) {
    CountingSource source;
    CachingAllocator cache(&source, Cap(cap));
    struct Held {
      unsigned char* data;
      int64_t bytes;
      bool pinned;
      unsigned char tag;
    };
    std::vector<Held> held;
    int64_t allocations = 0;
    for (int step = 0; step < 2000; ++step) {
      if (held.empty() || rng() % 2 == 0) {
        const int64_t sizes[] = {1, 500, 512, 513, 3000, kMiB, kMiB + 1};
        const int64_t bytes = sizes[rng() % 7];
        const bool pinned = rng() % 4 == 0;
        FLATPARAM_ASSERT_OK_AND_ASSIGN(
            void* p, cache.Allocate(Device::Host(), bytes, pinned));
        ++allocations;
        ASSERT_EQ(source.live.at(p).bytes, CachingAllocator::RoundSize(bytes));
        ASSERT_EQ(source.live.at(p).pinned, pinned);
        const auto tag = static_cast<unsigned char>(step);
        std::memset(p, tag, static_cast<size_t>(bytes));
        for (const Held& h : held) {
          ASSERT_TRUE(static_cast<unsigned char*>(p) + bytes <= h.data ||
                      h.data + h.bytes <= static_cast<unsigned char*>(p));
        }
        held.push_back({static_cast<unsigned char*>(p), bytes, pinned, tag});
      } else {
        const size_t i = rng() % held.size();
        const Held h = held[i];
        ASSERT_EQ(h.data[0], h.tag);
        ASSERT_EQ(h.data[h.bytes - 1], h.tag);
        ASSERT_EQ(source.live.at(h.data).pinned, h.pinned);
        cache.Free(h.data, Device::Host(), h.pinned);
        held.erase(held.begin() + static_cast<std::ptrdiff_t>(i));
      }
      const CachingAllocatorStats s = cache.stats();
      ASSERT_LE(s.cached_bytes, cap);
      ASSERT_EQ(s.live_blocks, static_cast<int64_t>(held.size()));
      ASSERT_EQ(s.live_blocks + s.cached_blocks,
                static_cast<int64_t>(source.live.size()));
      ASSERT_EQ(s.live_bytes + s.cached_bytes, source.live_bytes);
      ASSERT_EQ(s.hits + s.misses, allocations);
      ASSERT_EQ(s.misses, source.allocations);
    }
    if (cap > 0) {
      EXPECT_GT(cache.stats().hits, 0);
    }
    for (const Held& h : held) cache.Free(h.data, Device::Host(), h.pinned);
  }
}

TEST(HostDeviceOpsCacheTest, DeviceBuffersAreCachedAndReused) {
  HostDeviceOps ops;
  EXPECT_EQ(ops.cache_stats().cached_bytes, 0);
  void* first = nullptr;
  {
    FLATPARAM_ASSERT_OK_AND_ASSIGN(DeviceBuffer buf,
                                   ops.Allocate(Device::Host(), 16 * kMiB));
    first = buf.data();
    EXPECT_EQ(ops.cache_stats().live_bytes, 16 * kMiB);
  }
  EXPECT_EQ(ops.cache_stats().cached_bytes, 16 * kMiB);
  FLATPARAM_ASSERT_OK_AND_ASSIGN(DeviceBuffer again,
                                 ops.Allocate(Device::Host(), 16 * kMiB - 64));
  EXPECT_EQ(again.data(), first);
  EXPECT_EQ(again.bytes(), 16 * kMiB - 64);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(again.data()) % 64, 0u);
  CachingAllocatorStats s = ops.cache_stats();
  EXPECT_EQ(s.hits, 1);
  EXPECT_EQ(s.misses, 1);
  EXPECT_EQ(s.cached_bytes, 0);

  // Pinned requests have their own pool; pinned() is what was asked for.
  again.Reset();
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      DeviceBuffer pinned,
      ops.Allocate(Device::Host(), 16 * kMiB, /*pinned=*/true));
  EXPECT_TRUE(pinned.pinned());
  EXPECT_NE(pinned.data(), first);
  EXPECT_EQ(ops.cache_stats().misses, 2);
  pinned.Reset();
  FLATPARAM_ASSERT_OK_AND_ASSIGN(DeviceBuffer pageable,
                                 ops.Allocate(Device::Host(), 16 * kMiB));
  EXPECT_FALSE(pageable.pinned());
  EXPECT_EQ(pageable.data(), first);
  pageable.Reset();

  ops.EmptyCache();
  EXPECT_EQ(ops.cache_stats().cached_bytes, 0);
  EXPECT_EQ(ops.cache_stats().released_blocks, 2);
}

TEST(HostDeviceOpsCacheTest, UncachedWhenTheCapIsZero) {
  HostDeviceOps ops(Cap(0));
  for (int i = 0; i < 2; ++i) {
    FLATPARAM_ASSERT_OK_AND_ASSIGN(DeviceBuffer buf,
                                   ops.Allocate(Device::Host(), 4096));
  }
  EXPECT_EQ(ops.cache_stats().hits, 0);
  EXPECT_EQ(ops.cache_stats().misses, 2);
  EXPECT_EQ(ops.cache_stats().cached_bytes, 0);
}

TEST(HostDeviceOpsCacheTest, SharedBetweenThreads) {
  HostDeviceOps ops(Cap(64 * 1024));
  constexpr int kThreads = 4;
  constexpr int kRounds = 500;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&ops, t] {
      for (int i = 0; i < kRounds; ++i) {
        absl::StatusOr<DeviceBuffer> buf =
            ops.Allocate(Device::Host(), 512 * (1 + (i + t) % 8), t % 2 == 0);
        ASSERT_TRUE(buf.ok());
        std::memset(buf->data(), t, static_cast<size_t>(buf->bytes()));
      }
    });
  }
  for (std::thread& t : threads) t.join();
  const CachingAllocatorStats s = ops.cache_stats();
  EXPECT_EQ(s.hits + s.misses, kThreads * kRounds);
  EXPECT_GT(s.hits, 0);
  EXPECT_EQ(s.live_blocks, 0);
  EXPECT_LE(s.cached_bytes, 64 * 1024);
}

#ifndef NDEBUG
TEST(HostDeviceOpsCacheTest, ReusedBuffersDoNotKeepOldValues) {
  HostDeviceOps ops;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(DeviceBuffer buf,
                                 ops.Allocate(Device::Host(), 64));
  FLATPARAM_ASSERT_OK(ops.Fill(buf.As(DType::kFloat32), 1.0));
  void* data = buf.data();
  buf.Reset();
  FLATPARAM_ASSERT_OK_AND_ASSIGN(buf, ops.Allocate(Device::Host(), 64));
  ASSERT_EQ(buf.data(), data);
  float x;
  std::memcpy(&x, buf.data(), sizeof(x));
  EXPECT_TRUE(std::isnan(x));
}
#endif

#ifdef ABSL_HAVE_ADDRESS_SANITIZER
TEST(HostDeviceOpsCacheDeathTest, AsanReportsUseOfACachedBlock) {
  HostDeviceOps ops;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(DeviceBuffer buf,
                                 ops.Allocate(Device::Host(), 100));
  volatile char* p = static_cast<char*>(buf.data());
  // The slack between the request and the 512-byte class.
  EXPECT_DEATH(p[100] = 1, "use-after-poison");
  buf.Reset();
  // Freed: the block stays allocated in the cache, poisoned.
  EXPECT_DEATH(p[0] = 1, "use-after-poison");
}
#endif

}  // namespace
}  // namespace flatparam
