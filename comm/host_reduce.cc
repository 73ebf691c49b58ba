#include "comm/host_reduce.h"

#include <algorithm>
#include <cassert>
#include <cmath>
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

// How a divide runs: not at all, as a division, or -- for a power of two,
// whose reciprocal is exact -- as a multiplication by the reciprocal. x / 2^k
// and x * 2^-k are the same real number, and both operations round it
// correctly, so the bits are the same; a multiplication is several times
// cheaper than a division on x86 (FSDP's pre-divide factor is always a
// power of two).
enum class Divide { kNone, kDivide, kMultiply };

// The factor's reciprocal when it is a power of two 2^k with a normal
// reciprocal (|k| <= 126, so exact in float32 and float64).
bool ExactReciprocal(double factor, double* reciprocal) {
  int exponent = 0;
  if (!(factor > 0) || std::frexp(factor, &exponent) != 0.5) return false;
  const int k = exponent - 1;
  if (k < -126 || k > 126) return false;
  *reciprocal = std::ldexp(1.0, -k);
  return true;
}

// The element loop, specialised on the op, the divide and whether it is
// the first contribution, so that each is a plain loop the compiler can
// vectorise.
template <DType D, typename Op, Divide kPre, bool kFirst>
void StepLoop(typename Elem<D>::Storage* acc,
              const typename Elem<D>::Storage* x, int64_t count,
              typename Elem<D>::Compute factor) {
  using E = Elem<D>;
  for (int64_t i = 0; i < count; ++i) {
    typename E::Compute v = E::Load(x[i]);
    if (kPre == Divide::kDivide) v = E::Load(E::Store(v / factor));
    if (kPre == Divide::kMultiply) v = E::Load(E::Store(v * factor));
    acc[i] = kFirst ? E::Store(v) : E::Store(Op::Apply(E::Load(acc[i]), v));
  }
}

template <DType D, typename Op, Divide kPre>
void StepFirstOrNot(typename Elem<D>::Storage* acc,
                    const typename Elem<D>::Storage* x, int64_t count,
                    typename Elem<D>::Compute factor, bool first) {
  first ? StepLoop<D, Op, kPre, true>(acc, x, count, factor)
        : StepLoop<D, Op, kPre, false>(acc, x, count, factor);
}

template <DType D, typename Op>
void StepWithOp(void* acc_ptr, const void* x_ptr, int64_t count,
                const ReduceOptions& options, bool first) {
  using E = Elem<D>;
  using C = typename E::Compute;
  auto* acc = static_cast<typename E::Storage*>(acc_ptr);
  const auto* x = static_cast<const typename E::Storage*>(x_ptr);
  double reciprocal = 0;
  if (options.pre_divide_factor == 1.0) {
    StepFirstOrNot<D, Op, Divide::kNone>(acc, x, count, C(1), first);
  } else if (ExactReciprocal(options.pre_divide_factor, &reciprocal)) {
    StepFirstOrNot<D, Op, Divide::kMultiply>(acc, x, count,
                                             static_cast<C>(reciprocal), first);
  } else {
    StepFirstOrNot<D, Op, Divide::kDivide>(
        acc, x, count, static_cast<C>(options.pre_divide_factor), first);
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

// How `factor` divides: kNone for 1, kMultiply (by the returned
// reciprocal) for a power of two, else kDivide (by the factor).
Divide DivideMode(double factor, double* operand) {
  if (factor == 1.0) return Divide::kNone;
  if (ExactReciprocal(factor, operand)) return Divide::kMultiply;
  *operand = factor;
  return Divide::kDivide;
}

template <DType D, Divide kMode>
typename Elem<D>::Compute Apply(typename Elem<D>::Compute v,
                                typename Elem<D>::Compute operand) {
  using E = Elem<D>;
  if (kMode == Divide::kDivide) return E::Load(E::Store(v / operand));
  if (kMode == Divide::kMultiply) return E::Load(E::Store(v * operand));
  return v;
}

// acc[i] = post(avg(acc[i])), each divide rounded to the storage type on
// its own, as PyTorch's separate div_ calls round; one pass.
template <DType D, Divide kAvg, Divide kPost>
void FinishLoop(typename Elem<D>::Storage* acc, int64_t count,
                typename Elem<D>::Compute avg, typename Elem<D>::Compute post) {
  using E = Elem<D>;
  for (int64_t i = 0; i < count; ++i) {
    acc[i] =
        E::Store(Apply<D, kPost>(Apply<D, kAvg>(E::Load(acc[i]), avg), post));
  }
}

template <DType D, Divide kAvg>
void FinishWithAvg(typename Elem<D>::Storage* acc, int64_t count,
                   typename Elem<D>::Compute avg, Divide post_mode,
                   typename Elem<D>::Compute post) {
  switch (post_mode) {
    case Divide::kNone:
      return FinishLoop<D, kAvg, Divide::kNone>(acc, count, avg, post);
    case Divide::kDivide:
      return FinishLoop<D, kAvg, Divide::kDivide>(acc, count, avg, post);
    case Divide::kMultiply:
      return FinishLoop<D, kAvg, Divide::kMultiply>(acc, count, avg, post);
  }
}

template <DType D>
void Finish(void* acc_ptr, int64_t count, const ReduceOptions& options,
            int group_size) {
  using C = typename Elem<D>::Compute;
  auto* acc = static_cast<typename Elem<D>::Storage*>(acc_ptr);
  double avg = 1, post = 1;
  const Divide avg_mode = options.op == ReduceOp::kAvg
                              ? DivideMode(group_size, &avg)
                              : Divide::kNone;
  const Divide post_mode = DivideMode(options.post_divide_factor, &post);
  if (avg_mode == Divide::kNone && post_mode == Divide::kNone) return;
  const C a = static_cast<C>(avg), p = static_cast<C>(post);
  switch (avg_mode) {
    case Divide::kNone:
      return FinishWithAvg<D, Divide::kNone>(acc, count, a, post_mode, p);
    case Divide::kDivide:
      return FinishWithAvg<D, Divide::kDivide>(acc, count, a, post_mode, p);
    case Divide::kMultiply:
      return FinishWithAvg<D, Divide::kMultiply>(acc, count, a, post_mode, p);
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
