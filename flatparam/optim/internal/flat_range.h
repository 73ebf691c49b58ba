// Moving one optimizer state between per-parameter buffers and a range of
// positions of its flat (FlatParamLayout-shaped) form, for any floating
// dtype: the state's dtype need not be the parameters' (fp32 Adam moments
// of bf16 parameters), which flatparam/flatten.h does not allow.
//
// A parameter buffer is a window: `data` holds elements [lo, hi) of the
// (flattened) parameter, so a whole tensor is the window [0, numel) and a
// rank's use_orig_params piece is [intra_param_start_idx,
// intra_param_end_idx + 1).
//
// Thread-safety: pure functions on caller-owned memory.
#ifndef FLATPARAM_OPTIM_INTERNAL_FLAT_RANGE_H_
#define FLATPARAM_OPTIM_INTERNAL_FLAT_RANGE_H_

#include <cstddef>
#include <cstdint>

#include "absl/types/span.h"
#include "flatparam/base/dtype.h"
#include "flatparam/layout.h"

namespace flatparam {
namespace optim {
namespace internal_optim {

struct ConstWindow {
  const void* data = nullptr;  // nullptr: the parameter has no such state
  int64_t lo = 0;
  int64_t hi = 0;
};

struct Window {
  void* data = nullptr;  // nullptr: not wanted
  int64_t lo = 0;
  int64_t hi = 0;
};

// Writes positions [begin, begin + count) of the flat state into `out`
// (`count` elements of `dtype`): parameter i's elements from windows[i],
// zero where the window is null or does not cover them (PyTorch fills
// parameters without state with zeros); `padding_value` in alignment and
// world-size padding (positions before unpadded_unsharded_numel() that no
// parameter covers); zero from unpadded_unsharded_numel() on (the right
// padding of sharding). REQUIRES: windows.size() == layout.params().size(),
// begin >= 0, count >= 0, IsFloatingPoint(dtype).
void FlattenRange(const FlatParamLayout& layout, DType dtype,
                  absl::Span<const ConstWindow> windows, int64_t begin,
                  int64_t count, double padding_value, void* out);

// Copies the parameter elements among positions [begin, begin + count),
// held in `in` (`count` elements of `elem_size` bytes), into the parts of
// windows[i] they cover; padding is skipped.
void UnflattenRange(const FlatParamLayout& layout, size_t elem_size,
                    const void* in, int64_t begin, int64_t count,
                    absl::Span<const Window> windows);

}  // namespace internal_optim
}  // namespace optim
}  // namespace flatparam

#endif  // FLATPARAM_OPTIM_INTERNAL_FLAT_RANGE_H_
