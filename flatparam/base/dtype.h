// Element types of parameters and buffers, and conversions between them.
//
// flatparam flattens floating-point tensors only (float32, float64, float16,
// bfloat16), as PyTorch FSDP does; integer and bool dtypes exist here so that
// a model description can name them and get PyTorch's rejection
// ("Cannot flatten integer dtype tensors") instead of a parse error.
//
// Conversions to float16/bfloat16 round to nearest, ties to even, and handle
// infinities, NaN and subnormals exactly as PyTorch's c10::Half and
// c10::BFloat16 do; a float64 value converts through float32 first, as
// PyTorch's casts do.
//
// Thread-safety: pure functions.
#ifndef FLATPARAM_BASE_DTYPE_H_
#define FLATPARAM_BASE_DTYPE_H_

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace flatparam {

enum class DType : uint8_t {
  kFloat32,
  kFloat64,
  kFloat16,
  kBFloat16,
  // Not flattenable; kept so that model descriptions can name them.
  kInt8,
  kUInt8,
  kInt16,
  kInt32,
  kInt64,
  kBool,
};

// Size of one element in bytes.
size_t DTypeSize(DType dtype);

// True for float32, float64, float16 and bfloat16.
bool IsFloatingPoint(DType dtype);

// PyTorch's short name without the "torch." prefix: "float32", "bfloat16".
absl::string_view DTypeName(DType dtype);

// Parses a dtype name. Accepts the canonical names, an optional "torch."
// prefix and PyTorch's aliases ("float", "double", "half", "bf16", "fp16",
// "fp32", "fp64", "long", "int"). Returns InvalidArgument naming the input
// and the accepted names otherwise.
absl::StatusOr<DType> ParseDType(absl::string_view name);

// IEEE binary16 and bfloat16 bit patterns.
uint16_t FloatToHalfBits(float value);
float HalfBitsToFloat(uint16_t bits);
uint16_t FloatToBFloat16Bits(float value);
float BFloat16BitsToFloat(uint16_t bits);

// Reads element `i` of a floating-point buffer as double (exact for every
// flattenable dtype). REQUIRES: IsFloatingPoint(dtype).
double LoadAsDouble(const void* data, DType dtype, size_t i);

// Writes `value` into element `i`, rounding as a PyTorch cast would (float64
// -> float32 -> float16/bfloat16). REQUIRES: IsFloatingPoint(dtype).
void StoreFromDouble(void* data, DType dtype, size_t i, double value);

// Converts `count` elements between floating-point dtypes with PyTorch's
// rounding. `src` and `dst` must not overlap unless the dtypes are equal.
void ConvertElements(const void* src, DType src_dtype, void* dst,
                     DType dst_dtype, size_t count);

}  // namespace flatparam

#endif  // FLATPARAM_BASE_DTYPE_H_
