#include "flatparam/optim/internal/flat_range.h"

#include <algorithm>
#include <cassert>
#include <cstring>

namespace flatparam {
namespace optim {
namespace internal_optim {
namespace {

unsigned char* At(void* base, int64_t index, size_t size) {
  return static_cast<unsigned char*>(base) + index * static_cast<int64_t>(size);
}
const unsigned char* At(const void* base, int64_t index, size_t size) {
  return static_cast<const unsigned char*>(base) +
         index * static_cast<int64_t>(size);
}

void Fill(void* dst, int64_t count, const unsigned char* pattern, size_t size) {
  unsigned char* out = static_cast<unsigned char*>(dst);
  for (int64_t i = 0; i < count; ++i)
    std::memcpy(out + i * size, pattern, size);
}

// Index of the first parameter that ends after `position`. Parameters are
// laid out in index order, so their ends do not decrease.
size_t FirstParamEndingAfter(const FlatParamLayout& layout, int64_t position) {
  const auto& params = layout.params();
  return std::partition_point(params.begin(), params.end(),
                              [&](const ParamInfo& p) {
                                return p.offset + p.numel <= position;
                              }) -
         params.begin();
}

}  // namespace

void FlattenRange(const FlatParamLayout& layout, DType dtype,
                  absl::Span<const ConstWindow> windows, int64_t begin,
                  int64_t count, double padding_value, void* out) {
  assert(windows.size() == layout.params().size());
  assert(begin >= 0 && count >= 0);
  const size_t size = DTypeSize(dtype);
  unsigned char pad[8];
  unsigned char zero[8] = {};
  StoreFromDouble(pad, dtype, 0, padding_value);
  const int64_t end = begin + count;
  const int64_t unpadded = layout.unpadded_unsharded_numel();
  // Fills [from, to) with padding: `pad` below the unpadded numel, zeros
  // from there on.
  auto fill_padding = [&](int64_t from, int64_t to) {
    const int64_t mid = std::clamp(unpadded, from, to);
    Fill(At(out, from - begin, size), mid - from, pad, size);
    Fill(At(out, mid - begin, size), to - mid, zero, size);
  };

  const auto& params = layout.params();
  int64_t cursor = begin;
  for (size_t i = FirstParamEndingAfter(layout, begin);
       i < params.size() && params[i].offset < end; ++i) {
    const ParamInfo& p = params[i];
    const int64_t lo = std::max(begin, p.offset);
    const int64_t hi = std::min(end, p.offset + p.numel);
    if (hi <= lo) continue;
    if (lo > cursor) fill_padding(cursor, lo);
    // Parameter elements [lo - offset, hi - offset): the window's part,
    // zeros around it.
    const ConstWindow& w = windows[i];
    int64_t e = lo - p.offset;
    const int64_t e_end = hi - p.offset;
    const int64_t w_lo = w.data != nullptr ? std::clamp(w.lo, e, e_end) : e_end;
    const int64_t w_hi =
        w.data != nullptr ? std::clamp(w.hi, w_lo, e_end) : e_end;
    Fill(At(out, p.offset + e - begin, size), w_lo - e, zero, size);
    if (w_hi > w_lo) {
      std::memcpy(At(out, p.offset + w_lo - begin, size),
                  At(w.data, w_lo - w.lo, size), (w_hi - w_lo) * size);
    }
    Fill(At(out, p.offset + w_hi - begin, size), e_end - w_hi, zero, size);
    cursor = hi;
  }
  if (cursor < end) fill_padding(cursor, end);
}

void UnflattenRange(const FlatParamLayout& layout, size_t elem_size,
                    const void* in, int64_t begin, int64_t count,
                    absl::Span<const Window> windows) {
  assert(windows.size() == layout.params().size());
  const int64_t end = begin + count;
  const auto& params = layout.params();
  for (size_t i = FirstParamEndingAfter(layout, begin);
       i < params.size() && params[i].offset < end; ++i) {
    const Window& w = windows[i];
    if (w.data == nullptr) continue;
    const ParamInfo& p = params[i];
    const int64_t lo = std::max({begin - p.offset, int64_t{0}, w.lo});
    const int64_t hi = std::min({end - p.offset, p.numel, w.hi});
    if (hi <= lo) continue;
    std::memcpy(At(w.data, lo - w.lo, elem_size),
                At(in, p.offset + lo - begin, elem_size),
                (hi - lo) * elem_size);
  }
}

}  // namespace internal_optim
}  // namespace optim
}  // namespace flatparam
