#include "flatparam/base/buffer_checks.h"

#include "absl/strings/str_format.h"

namespace flatparam {

std::string DescribeBuffer(ConstBufferRef b) {
  return absl::StrFormat("%d x %s on %s", b.count, DTypeName(b.dtype),
                         DeviceName(b.device));
}

bool BytesOverlap(const void* a, int64_t a_bytes, const void* b,
                  int64_t b_bytes) {
  const auto x = reinterpret_cast<uintptr_t>(a);
  const auto y = reinterpret_cast<uintptr_t>(b);
  return a_bytes > 0 && b_bytes > 0 && x < y + b_bytes && y < x + a_bytes;
}

bool BuffersOverlap(ConstBufferRef a, ConstBufferRef b) {
  return a.device == b.device &&
         BytesOverlap(a.data, a.bytes(), b.data, b.bytes());
}

}  // namespace flatparam
