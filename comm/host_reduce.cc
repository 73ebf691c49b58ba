#include "comm/host_reduce.h"

#include <algorithm>
#include <cassert>
#include <cstring>

#include "flatparam/base/element_traits.h"

namespace flatparam {
namespace {

template <DType D>
using Elem = ElementTraits<D>;

struct SumOp {
  template <typename C>
  static C Apply(C a, C v) {
    return a + v;
  }
};
struct MaxOp {
  template <typename C>
  static C Apply(C a, C v) {
    return std::max(a, v);
  }
};
struct MinOp {
  template <typename C>
  static C Apply(C a, C v) {
    return std::min(a, v);
  }
};

// The element loop, specialised on the op and on whether there is a
// pre-divide, so that the common case (sum, no divide) is a plain loop the
// compiler can vectorise.
template <DType D, typename Op, bool kPre, bool kFirst>
void StepLoop(typename Elem<D>::Storage* acc,
              const typename Elem<D>::Storage* x, int64_t count,
              typename Elem<D>::Compute pre_factor) {
  using E = Elem<D>;
  for (int64_t i = 0; i < count; ++i) {
    typename E::Compute v = E::Load(x[i]);
    if (kPre) v = E::Load(E::Store(v / pre_factor));
    acc[i] = kFirst ? E::Store(v) : E::Store(Op::Apply(E::Load(acc[i]), v));
  }
}

template <DType D, typename Op>
void StepWithOp(void* acc_ptr, const void* x_ptr, int64_t count,
                const ReduceOptions& options, bool first) {
  using E = Elem<D>;
  auto* acc = static_cast<typename E::Storage*>(acc_ptr);
  const auto* x = static_cast<const typename E::Storage*>(x_ptr);
  const auto pre_factor =
      static_cast<typename E::Compute>(options.pre_divide_factor);
  const bool pre = options.pre_divide_factor != 1.0;
  if (pre) {
    first ? StepLoop<D, Op, true, true>(acc, x, count, pre_factor)
          : StepLoop<D, Op, true, false>(acc, x, count, pre_factor);
  } else {
    first ? StepLoop<D, Op, false, true>(acc, x, count, pre_factor)
          : StepLoop<D, Op, false, false>(acc, x, count, pre_factor);
  }
}

template <DType D>
void Step(void* acc, const void* x, int64_t count, const ReduceOptions& options,
          bool first) {
  switch (options.op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      return StepWithOp<D, SumOp>(acc, x, count, options, first);
    case ReduceOp::kMax:
      return StepWithOp<D, MaxOp>(acc, x, count, options, first);
    case ReduceOp::kMin:
      return StepWithOp<D, MinOp>(acc, x, count, options, first);
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
