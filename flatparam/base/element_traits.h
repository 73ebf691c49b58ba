// Compile-time element traits of the floating-point dtypes, for kernels that
// loop over host buffers: the storage type, the type PyTorch computes in
// (its "opmath" type: float for float16/bfloat16), and exact conversions
// between them with PyTorch's rounding (see dtype.h).
//
//   using E = ElementTraits<DType::kBFloat16>;
//   E::Storage* p = ...;
//   p[i] = E::Store(E::Load(p[i]) * 2);
//
// Thread-safety: stateless.
#ifndef FLATPARAM_BASE_ELEMENT_TRAITS_H_
#define FLATPARAM_BASE_ELEMENT_TRAITS_H_

#include <cstdint>

#include "flatparam/base/dtype.h"

namespace flatparam {

template <DType D>
struct ElementTraits;

template <>
struct ElementTraits<DType::kFloat32> {
  using Storage = float;
  using Compute = float;
  static Compute Load(Storage v) { return v; }
  static Storage Store(Compute v) { return v; }
};

template <>
struct ElementTraits<DType::kFloat64> {
  using Storage = double;
  using Compute = double;
  static Compute Load(Storage v) { return v; }
  static Storage Store(Compute v) { return v; }
};

template <>
struct ElementTraits<DType::kFloat16> {
  using Storage = uint16_t;
  using Compute = float;
  static Compute Load(Storage v) { return HalfBitsToFloat(v); }
  static Storage Store(Compute v) { return FloatToHalfBits(v); }
};

template <>
struct ElementTraits<DType::kBFloat16> {
  using Storage = uint16_t;
  using Compute = float;
  static Compute Load(Storage v) { return BFloat16BitsToFloat(v); }
  static Storage Store(Compute v) { return FloatToBFloat16Bits(v); }
};

}  // namespace flatparam

#endif  // FLATPARAM_BASE_ELEMENT_TRAITS_H_
