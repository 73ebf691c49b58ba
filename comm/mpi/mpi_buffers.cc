// The MPI backend's buffers: the process-wide pool of the buffers that
// collectives own, and the staging copies of MpiOptions::stage_buffers
// (see "Memory" in DESIGN.md).
#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>

#include "comm/mpi/internal/mpi_internal.h"
#include "comm/mpi/mpi_communicator.h"

namespace flatparam {
namespace {

// A process-wide cache of the buffers collectives own: reduce_scatter's and
// all_reduce's receive buffers and, with MpiOptions::stage_buffers, the
// staging copies. A large buffer allocated afresh for every collective
// page-faults on every call (measured: a 256 MiB all-gather ran at 0.12x of
// raw MPI), so buffers return here when their collective is done and are
// reused by the next one of a similar size. At most kMaxCachedBytes stay
// cached; the rest go back to the allocator. Thread-safe (its own mutex):
// the progress thread releases buffers too.
class BufferPool {
 public:
  static constexpr int64_t kMaxCachedBytes = int64_t{1} << 30;
  static constexpr size_t kMaxCachedBuffers = 16;

  static BufferPool& Get() {
    static BufferPool* pool = new BufferPool;  // Never destroyed: buffers
    return *pool;  // of abandoned collectives may be released at exit.
  }

  // A buffer of at least `bytes` (at least 1, so MPI always gets a valid
  // pointer); `*capacity` receives its real size.
  char* Acquire(int64_t bytes, int64_t* capacity) {
    bytes = std::max<int64_t>(bytes, 1);
    {
      std::lock_guard<std::mutex> lock(mu_);
      // The smallest cached buffer that fits, unless it is much larger.
      auto it = free_.lower_bound(bytes);
      if (it != free_.end() && it->first <= 2 * bytes + 4096) {
        *capacity = it->first;
        char* p = it->second;
        cached_bytes_ -= it->first;
        free_.erase(it);
        return p;
      }
    }
    *capacity = bytes;
    return new char[bytes];
  }

  void Release(char* p, int64_t capacity) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (cached_bytes_ + capacity <= kMaxCachedBytes &&
          free_.size() < kMaxCachedBuffers) {
        free_.emplace(capacity, p);
        cached_bytes_ += capacity;
        return;
      }
    }
    delete[] p;
  }

 private:
  std::mutex mu_;
  std::multimap<int64_t, char*> free_;
  int64_t cached_bytes_ = 0;
};

// Bytes copied between callers' buffers and staging buffers (MpiStagedBytes).
std::atomic<int64_t> g_staged_bytes{0};

// MPI gets this for the caller's null pointers of empty buffers, which some
// MPI argument checks reject even with a count of 0.
char g_empty_buffer[1];

}  // namespace

namespace internal_mpi {

void PooledDeleter::operator()(char* p) const {
  BufferPool::Get().Release(p, capacity);
}

PooledBuffer Alloc(int64_t bytes) {
  int64_t capacity = 0;
  char* p = BufferPool::Get().Acquire(bytes, &capacity);
  return PooledBuffer(p, PooledDeleter{capacity});
}

void CopyBytes(void* dst, const void* src, int64_t bytes) {
  if (bytes > 0) std::memcpy(dst, src, bytes);
}

PooledBuffer StageIn(const void* src, int64_t bytes) {
  PooledBuffer buffer = Alloc(bytes);
  CopyBytes(buffer.get(), src, bytes);
  g_staged_bytes.fetch_add(bytes, std::memory_order_relaxed);
  return buffer;
}

void StageOut(void* dst, const void* src, int64_t bytes) {
  CopyBytes(dst, src, bytes);
  g_staged_bytes.fetch_add(bytes, std::memory_order_relaxed);
}

void* NonNull(void* p) { return p != nullptr ? p : g_empty_buffer; }
const void* NonNull(const void* p) { return p != nullptr ? p : g_empty_buffer; }

}  // namespace internal_mpi

int64_t MpiStagedBytes() {
  return g_staged_bytes.load(std::memory_order_relaxed);
}

}  // namespace flatparam
