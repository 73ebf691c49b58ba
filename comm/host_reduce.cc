#include "comm/host_reduce.h"

#include <algorithm>
#include <cassert>
#include <cstring>

namespace flatparam {
namespace {

// Loads and stores an element in its compute type.
template <DType D>
struct Elem;
template <>
struct Elem<DType::kFloat32> {
  using Storage = float;
  using Compute = float;
  static Compute Load(Storage v) { return v; }
  static Storage Store(Compute v) { return v; }
};
template <>
struct Elem<DType::kFloat64> {
  using Storage = double;
  using Compute = double;
  static Compute Load(Storage v) { return v; }
  static Storage Store(Compute v) { return v; }
};
template <>
struct Elem<DType::kFloat16> {
  using Storage = uint16_t;
  using Compute = float;
  static Compute Load(Storage v) { return HalfBitsToFloat(v); }
  static Storage Store(Compute v) { return FloatToHalfBits(v); }
};
template <>
struct Elem<DType::kBFloat16> {
  using Storage = uint16_t;
  using Compute = float;
  static Compute Load(Storage v) { return BFloat16BitsToFloat(v); }
  static Storage Store(Compute v) { return FloatToBFloat16Bits(v); }
};

template <DType D>
void Step(void* acc_ptr, const void* x_ptr, int64_t count,
          const ReduceOptions& options, bool first) {
  using E = Elem<D>;
  using C = typename E::Compute;
  auto* acc = static_cast<typename E::Storage*>(acc_ptr);
  const auto* x = static_cast<const typename E::Storage*>(x_ptr);
  const bool pre = options.pre_divide_factor != 1.0;
  const C pre_factor = static_cast<C>(options.pre_divide_factor);
  for (int64_t i = 0; i < count; ++i) {
    C v = E::Load(x[i]);
    if (pre) v = E::Load(E::Store(v / pre_factor));
    if (first) {
      acc[i] = E::Store(v);
      continue;
    }
    const C a = E::Load(acc[i]);
    // Every op is assigned below; the initialiser only quiets GCC's
    // -Wmaybe-uninitialized at -O1 (the asan config).
    C r = a;
    switch (options.op) {
      case ReduceOp::kSum:
      case ReduceOp::kAvg:
        r = a + v;
        break;
      case ReduceOp::kMax:
        r = std::max(a, v);
        break;
      case ReduceOp::kMin:
        r = std::min(a, v);
        break;
    }
    acc[i] = E::Store(r);
  }
}

template <DType D>
void Finish(void* acc_ptr, int64_t count, const ReduceOptions& options,
            int group_size) {
  using E = Elem<D>;
  using C = typename E::Compute;
  auto* acc = static_cast<typename E::Storage*>(acc_ptr);
  const bool avg = options.op == ReduceOp::kAvg;
  const bool post = options.post_divide_factor != 1.0;
  if (!avg && !post) return;
  const C n = static_cast<C>(group_size);
  const C post_factor = static_cast<C>(options.post_divide_factor);
  for (int64_t i = 0; i < count; ++i) {
    if (avg) acc[i] = E::Store(E::Load(acc[i]) / n);
    if (post) acc[i] = E::Store(E::Load(acc[i]) / post_factor);
  }
}

}  // namespace

void HostReduceStep(void* acc, const void* x, int64_t count, DType dtype,
                    const ReduceOptions& options, bool first) {
  switch (dtype) {
    case DType::kFloat32:
      return Step<DType::kFloat32>(acc, x, count, options, first);
    case DType::kFloat64:
      return Step<DType::kFloat64>(acc, x, count, options, first);
    case DType::kFloat16:
      return Step<DType::kFloat16>(acc, x, count, options, first);
    case DType::kBFloat16:
      return Step<DType::kBFloat16>(acc, x, count, options, first);
    default:
      assert(false && "HostReduceStep on a non-floating dtype");
  }
}

void HostReduceFinish(void* acc, int64_t count, DType dtype,
                      const ReduceOptions& options, int group_size) {
  switch (dtype) {
    case DType::kFloat32:
      return Finish<DType::kFloat32>(acc, count, options, group_size);
    case DType::kFloat64:
      return Finish<DType::kFloat64>(acc, count, options, group_size);
    case DType::kFloat16:
      return Finish<DType::kFloat16>(acc, count, options, group_size);
    case DType::kBFloat16:
      return Finish<DType::kBFloat16>(acc, count, options, group_size);
    default:
      assert(false && "HostReduceFinish on a non-floating dtype");
  }
}

void HostReduce(absl::Span<const void* const> inputs, void* out, int64_t count,
                DType dtype, const ReduceOptions& options, int group_size) {
  assert(!inputs.empty());
  for (size_t r = 0; r < inputs.size(); ++r) {
    HostReduceStep(out, inputs[r], count, dtype, options, r == 0);
  }
  HostReduceFinish(out, count, dtype, options, group_size);
}

}  // namespace flatparam
