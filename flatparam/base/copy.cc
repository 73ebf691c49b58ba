#include "flatparam/base/copy.h"

#include <cstring>

#if defined(__SSE2__)
#include <emmintrin.h>
#include <xmmintrin.h>
#endif

namespace flatparam {
namespace {

#if defined(__SSE2__)
constexpr size_t kPage = 4096;
constexpr size_t kBlock = 4 * kPage;

inline void Stream64(char* d, const char* s) {
  const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 16));
  const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 32));
  const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 48));
  _mm_stream_si128(reinterpret_cast<__m128i*>(d), a);
  _mm_stream_si128(reinterpret_cast<__m128i*>(d + 16), b);
  _mm_stream_si128(reinterpret_cast<__m128i*>(d + 32), c);
  _mm_stream_si128(reinterpret_cast<__m128i*>(d + 48), e);
}

// Copies four pages side by side so that four hardware prefetch streams run
// at once, with non-temporal stores to 64-byte-aligned destinations.
void StreamingCopy(char* dst, const char* src, size_t n) {
  size_t head = (64 - (reinterpret_cast<uintptr_t>(dst) & 63)) & 63;
  if (head > n) head = n;
  std::memcpy(dst, src, head);
  dst += head;
  src += head;
  n -= head;
  const size_t blocks = n / kBlock;
  for (size_t b = 0; b < blocks; ++b) {
    for (size_t off = 0; off < kPage; off += 64) {
      for (size_t p = 0; p < 4; ++p) {
        _mm_prefetch(src + p * kPage + off + 256, _MM_HINT_T0);
      }
      for (size_t p = 0; p < 4; ++p) {
        Stream64(dst + p * kPage + off, src + p * kPage + off);
      }
    }
    src += kBlock;
    dst += kBlock;
  }
  _mm_sfence();
  std::memcpy(dst, src, n - blocks * kBlock);
}
#endif

}  // namespace

void CopyBytes(void* dst, const void* src, size_t n, bool streaming) {
  if (n == 0) return;
#if defined(__SSE2__)
  if (streaming && n >= kBlock) {
    StreamingCopy(static_cast<char*>(dst), static_cast<const char*>(src), n);
    return;
  }
#endif
  (void)streaming;
  std::memcpy(dst, src, n);
}

}  // namespace flatparam
