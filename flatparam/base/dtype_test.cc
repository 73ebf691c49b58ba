#include "flatparam/base/dtype.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>

#include "flatparam/base/status_matchers.h"

namespace flatparam {
namespace {

using ::testing::HasSubstr;

float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

TEST(DTypeTest, SizesAndNames) {
  EXPECT_EQ(DTypeSize(DType::kFloat32), 4u);
  EXPECT_EQ(DTypeSize(DType::kFloat64), 8u);
  EXPECT_EQ(DTypeSize(DType::kFloat16), 2u);
  EXPECT_EQ(DTypeSize(DType::kBFloat16), 2u);
  EXPECT_EQ(DTypeSize(DType::kInt64), 8u);
  EXPECT_TRUE(IsFloatingPoint(DType::kBFloat16));
  EXPECT_FALSE(IsFloatingPoint(DType::kInt32));
  EXPECT_EQ(DTypeName(DType::kBFloat16), "bfloat16");
}

TEST(DTypeTest, ParseAcceptsAliases) {
  EXPECT_EQ(*ParseDType("torch.float32"), DType::kFloat32);
  EXPECT_EQ(*ParseDType("bf16"), DType::kBFloat16);
  EXPECT_EQ(*ParseDType("Half"), DType::kFloat16);
  EXPECT_EQ(*ParseDType("double"), DType::kFloat64);
  EXPECT_EQ(*ParseDType("long"), DType::kInt64);
  EXPECT_THAT(ParseDType("float8"), StatusIs(absl::StatusCode::kInvalidArgument,
                                             HasSubstr("\"float8\"")));
}

TEST(DTypeTest, HalfKnownValues) {
  EXPECT_EQ(FloatToHalfBits(1.0f), 0x3c00);
  EXPECT_EQ(FloatToHalfBits(-2.0f), 0xc000);
  EXPECT_EQ(FloatToHalfBits(65504.0f), 0x7bff);
  EXPECT_EQ(FloatToHalfBits(65519.0f), 0x7bff);
  EXPECT_EQ(FloatToHalfBits(65520.0f), 0x7c00);  // Rounds up to infinity.
  EXPECT_EQ(FloatToHalfBits(std::ldexp(1.0f, -24)), 0x0001);
  EXPECT_EQ(FloatToHalfBits(std::ldexp(1.0f, -25)), 0x0000);  // Tie to even.
  EXPECT_EQ(FloatToHalfBits(std::ldexp(3.0f, -25)), 0x0002);  // Tie to even.
  EXPECT_EQ(FloatToHalfBits(std::ldexp(1.0f, -14)), 0x0400);
  EXPECT_EQ(FloatToHalfBits(-0.0f), 0x8000);
  EXPECT_EQ(FloatToHalfBits(std::numeric_limits<float>::infinity()), 0x7c00);
  EXPECT_EQ(FloatToHalfBits(std::nanf("")), 0x7e00);
  // 1 + 2^-11 is halfway between 1 and 1 + 2^-10: ties to even (1).
  EXPECT_EQ(FloatToHalfBits(1.0f + std::ldexp(1.0f, -11)), 0x3c00);
  EXPECT_EQ(FloatToHalfBits(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);
}

TEST(DTypeTest, BFloat16KnownValues) {
  EXPECT_EQ(FloatToBFloat16Bits(1.0f), 0x3f80);
  EXPECT_EQ(FloatToBFloat16Bits(FromBits(0x3f808000u)), 0x3f80);  // Tie even.
  EXPECT_EQ(FloatToBFloat16Bits(FromBits(0x3f818000u)), 0x3f82);  // Tie even.
  EXPECT_EQ(FloatToBFloat16Bits(FromBits(0x3f808001u)), 0x3f81);
  EXPECT_EQ(FloatToBFloat16Bits(FromBits(0x7f7fffffu)), 0x7f80);  // To inf.
  EXPECT_EQ(FloatToBFloat16Bits(std::nanf("")), 0x7fc0);
}

// Every non-NaN 16-bit pattern survives a round trip through float.
TEST(DTypeTest, SixteenBitRoundTripIsExhaustivelyExact) {
  for (uint32_t b = 0; b <= 0xffff; ++b) {
    const uint16_t bits = static_cast<uint16_t>(b);
    const float h = HalfBitsToFloat(bits);
    if (!std::isnan(h)) {
      ASSERT_EQ(FloatToHalfBits(h), bits) << b;
    }
    const float bf = BFloat16BitsToFloat(bits);
    if (!std::isnan(bf)) {
      ASSERT_EQ(FloatToBFloat16Bits(bf), bits) << b;
    }
  }
}

// Independent check of rounding: the result is the nearest representable
// value, ties going to the even pattern.
template <typename ToBits, typename FromBits16>
void CheckNearestEven(ToBits to_bits, FromBits16 from_bits, float x) {
  const uint16_t r = to_bits(x);
  const double got = from_bits(r);
  if (std::isinf(got)) return;  // Overflow is checked by known values.
  const double err = std::fabs(static_cast<double>(x) - got);
  for (int delta : {-1, 1}) {
    const uint16_t nb = static_cast<uint16_t>(r + delta);
    const double other = from_bits(nb);
    if (std::isnan(other) || std::isinf(other)) continue;
    if ((nb & 0x7fff) == 0x7fff || ((r ^ nb) & 0x8000)) continue;
    const double other_err = std::fabs(static_cast<double>(x) - other);
    ASSERT_LE(err, other_err) << "x=" << x << " r=" << r;
    if (err == other_err) {
      ASSERT_EQ(r & 1, 0) << "tie not to even, x=" << x;
    }
  }
}

TEST(DTypeTest, RoundsToNearestEvenOnRandomInputs) {
  std::mt19937 rng(1234);
  std::uniform_int_distribution<uint32_t> bits;
  for (int i = 0; i < 200000; ++i) {
    float x = FromBits(bits(rng));
    if (std::isnan(x) || std::isinf(x)) continue;
    // Bias towards the half range to exercise subnormals and normals.
    int unused_exp;
    float xh = std::ldexp(std::frexp(x, &unused_exp) * 2, (i % 44) - 26);
    CheckNearestEven(FloatToHalfBits, HalfBitsToFloat, xh);
    CheckNearestEven(FloatToBFloat16Bits, BFloat16BitsToFloat, x);
  }
}

TEST(DTypeTest, ConvertElementsGoesThroughFloat) {
  const double v[] = {1.0 + std::ldexp(1.0, -30), -3.25, 1e30};
  uint16_t out[3];
  ConvertElements(v, DType::kFloat64, out, DType::kBFloat16, 3);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(out[i], FloatToBFloat16Bits(static_cast<float>(v[i])));
  }
  float f[3];
  ConvertElements(out, DType::kBFloat16, f, DType::kFloat32, 3);
  EXPECT_EQ(f[1], -3.25f);
}

}  // namespace
}  // namespace flatparam
