// Bulk host memory copies for flattening and sharding.
//
// Copies of a few MiB go to memcpy. Copies of operations that move more than
// kStreamingCopyThreshold bytes in total bypass the cache with non-temporal
// stores, four pages at a time (the technique glibc uses only for single
// copies above its own, much larger, threshold). Flattening a large model is
// a sequence of per-parameter copies that each stay below glibc's threshold,
// so without this they ran at about 0.6x of one big memcpy; see
// BENCHMARKS.md for the measurements that set the threshold.
//
// Thread-safety: pure functions on caller-owned memory.
#ifndef FLATPARAM_BASE_COPY_H_
#define FLATPARAM_BASE_COPY_H_

#include <cstddef>
#include <cstdint>

namespace flatparam {

// Total bytes of one operation from which streaming copies pay off: well
// above a last-level cache, so the data would not have stayed cached anyway.
inline constexpr int64_t kStreamingCopyThreshold = int64_t{32} << 20;

// Copies `n` bytes; `src` and `dst` must not overlap. With `streaming`, uses
// non-temporal stores (on x86-64; memcpy elsewhere) and leaves the
// destination out of the cache.
void CopyBytes(void* dst, const void* src, size_t n, bool streaming);

}  // namespace flatparam

#endif  // FLATPARAM_BASE_COPY_H_
