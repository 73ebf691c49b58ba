#include "flatparam/base/dtype.h"

#include <cassert>
#include <cctype>
#include <cmath>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_format.h"

namespace flatparam {
namespace {

uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

float BitsToFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

}  // namespace

size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
    case DType::kInt32:
      return 4;
    case DType::kFloat64:
    case DType::kInt64:
      return 8;
    case DType::kFloat16:
    case DType::kBFloat16:
    case DType::kInt16:
      return 2;
    case DType::kInt8:
    case DType::kUInt8:
    case DType::kBool:
      return 1;
  }
  assert(false && "unknown dtype");
  return 0;
}

bool IsFloatingPoint(DType dtype) {
  return dtype == DType::kFloat32 || dtype == DType::kFloat64 ||
         dtype == DType::kFloat16 || dtype == DType::kBFloat16;
}

absl::string_view DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "float32";
    case DType::kFloat64:
      return "float64";
    case DType::kFloat16:
      return "float16";
    case DType::kBFloat16:
      return "bfloat16";
    case DType::kInt8:
      return "int8";
    case DType::kUInt8:
      return "uint8";
    case DType::kInt16:
      return "int16";
    case DType::kInt32:
      return "int32";
    case DType::kInt64:
      return "int64";
    case DType::kBool:
      return "bool";
  }
  return "unknown";
}

absl::StatusOr<DType> ParseDType(absl::string_view name) {
  std::string n = absl::AsciiStrToLower(name);
  if (absl::StartsWith(n, "torch.")) n = n.substr(6);
  struct Alias {
    const char* name;
    DType dtype;
  };
  static constexpr Alias kAliases[] = {
      {"float32", DType::kFloat32},   {"float", DType::kFloat32},
      {"fp32", DType::kFloat32},      {"f32", DType::kFloat32},
      {"float64", DType::kFloat64},   {"double", DType::kFloat64},
      {"fp64", DType::kFloat64},      {"f64", DType::kFloat64},
      {"float16", DType::kFloat16},   {"half", DType::kFloat16},
      {"fp16", DType::kFloat16},      {"f16", DType::kFloat16},
      {"bfloat16", DType::kBFloat16}, {"bf16", DType::kBFloat16},
      {"int8", DType::kInt8},         {"uint8", DType::kUInt8},
      {"int16", DType::kInt16},       {"short", DType::kInt16},
      {"int32", DType::kInt32},       {"int", DType::kInt32},
      {"int64", DType::kInt64},       {"long", DType::kInt64},
      {"bool", DType::kBool},
  };
  for (const Alias& a : kAliases) {
    if (n == a.name) return a.dtype;
  }
  return absl::InvalidArgumentError(absl::StrFormat(
      "unknown dtype \"%s\"; expected one of float32, float64, float16, "
      "bfloat16 (or int8, uint8, int16, int32, int64, bool)",
      name));
}

// float32 -> binary16, round to nearest even (the c10::Half algorithm).
uint16_t FloatToHalfBits(float value) {
  const uint32_t f = FloatBits(value);
  const uint32_t sign = (f >> 16) & 0x8000u;
  const uint32_t abs = f & 0x7fffffffu;
  if (abs >= 0x7f800000u) {  // Inf or NaN.
    if (abs == 0x7f800000u) return static_cast<uint16_t>(sign | 0x7c00u);
    // c10::Half maps every NaN to the canonical quiet NaN.
    return static_cast<uint16_t>(sign | 0x7e00u);
  }
  if (abs >= 0x477ff000u) {  // Rounds to >= 65520: overflow to infinity.
    return static_cast<uint16_t>(sign | 0x7c00u);
  }
  if (abs < 0x38800000u) {  // Below the smallest normal half: subnormal/zero.
    // Scale so that the half subnormal grid has spacing 1, then round the
    // float value to an integer with the FPU's round-to-nearest-even.
    const float magnitude = BitsToFloat(abs) * 16777216.0f;  // 2^24
    const uint32_t m = static_cast<uint32_t>(std::nearbyint(magnitude));
    return static_cast<uint16_t>(sign | m);  // m <= 0x400 lands on normal.
  }
  // Normal: rebias exponent (127 -> 15) and round the 13 dropped bits.
  uint32_t rebased = abs - 0x38000000u;
  const uint32_t lsb = (rebased >> 13) & 1u;
  rebased += 0x0fffu + lsb;
  return static_cast<uint16_t>(sign | (rebased >> 13));
}

float HalfBitsToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    // Zero or subnormal: mant * 2^-24, exact in float.
    const float mag = static_cast<float>(mant) * (1.0f / 16777216.0f);
    return sign ? -mag : mag;
  }
  if (exp == 0x1f) return BitsToFloat(sign | 0x7f800000u | (mant << 13));
  return BitsToFloat(sign | ((exp + 112u) << 23) | (mant << 13));
}

// float32 -> bfloat16, round to nearest even (the c10::BFloat16 algorithm).
uint16_t FloatToBFloat16Bits(float value) {
  if (std::isnan(value)) return 0x7fc0u;  // c10's canonical quiet NaN.
  const uint32_t f = FloatBits(value);
  const uint32_t rounding_bias = 0x7fffu + ((f >> 16) & 1u);
  return static_cast<uint16_t>((f + rounding_bias) >> 16);
}

float BFloat16BitsToFloat(uint16_t bits) {
  return BitsToFloat(static_cast<uint32_t>(bits) << 16);
}

double LoadAsDouble(const void* data, DType dtype, size_t i) {
  const auto* bytes = static_cast<const unsigned char*>(data);
  switch (dtype) {
    case DType::kFloat32: {
      float v;
      std::memcpy(&v, bytes + i * 4, 4);
      return v;
    }
    case DType::kFloat64: {
      double v;
      std::memcpy(&v, bytes + i * 8, 8);
      return v;
    }
    case DType::kFloat16: {
      uint16_t v;
      std::memcpy(&v, bytes + i * 2, 2);
      return HalfBitsToFloat(v);
    }
    case DType::kBFloat16: {
      uint16_t v;
      std::memcpy(&v, bytes + i * 2, 2);
      return BFloat16BitsToFloat(v);
    }
    default:
      assert(false && "LoadAsDouble on a non-floating dtype");
      return 0;
  }
}

void StoreFromDouble(void* data, DType dtype, size_t i, double value) {
  auto* bytes = static_cast<unsigned char*>(data);
  switch (dtype) {
    case DType::kFloat32: {
      const float v = static_cast<float>(value);
      std::memcpy(bytes + i * 4, &v, 4);
      return;
    }
    case DType::kFloat64:
      std::memcpy(bytes + i * 8, &value, 8);
      return;
    case DType::kFloat16: {
      const uint16_t v = FloatToHalfBits(static_cast<float>(value));
      std::memcpy(bytes + i * 2, &v, 2);
      return;
    }
    case DType::kBFloat16: {
      const uint16_t v = FloatToBFloat16Bits(static_cast<float>(value));
      std::memcpy(bytes + i * 2, &v, 2);
      return;
    }
    default:
      assert(false && "StoreFromDouble on a non-floating dtype");
  }
}

void ConvertElements(const void* src, DType src_dtype, void* dst,
                     DType dst_dtype, size_t count) {
  if (count == 0) return;
  if (src_dtype == dst_dtype) {
    std::memmove(dst, src, count * DTypeSize(src_dtype));
    return;
  }
  for (size_t i = 0; i < count; ++i) {
    StoreFromDouble(dst, dst_dtype, i, LoadAsDouble(src, src_dtype, i));
  }
}

}  // namespace flatparam
