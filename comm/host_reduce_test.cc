#include "comm/host_reduce.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "comm/communicator.h"
#include "flatparam/base/dtype.h"

namespace flatparam {
namespace {

using ::testing::ElementsAre;

std::vector<float> Reduce(const std::vector<std::vector<float>>& in,
                          const ReduceOptions& options, int group_size) {
  std::vector<const void*> ptrs;
  for (const auto& v : in) ptrs.push_back(v.data());
  std::vector<float> out(in[0].size());
  HostReduce(ptrs, out.data(), static_cast<int64_t>(out.size()),
             DType::kFloat32, options, group_size);
  return out;
}

ReduceOptions Op(ReduceOp op, double pre = 1, double post = 1) {
  ReduceOptions o;
  o.op = op;
  o.pre_divide_factor = pre;
  o.post_divide_factor = post;
  return o;
}

TEST(HostReduceTest, SumMaxMinAvg) {
  const std::vector<std::vector<float>> in = {
      {1, -2, 8}, {3, 5, -8}, {2, 0, 4}};
  EXPECT_THAT(Reduce(in, Op(ReduceOp::kSum), 3), ElementsAre(6, 3, 4));
  EXPECT_THAT(Reduce(in, Op(ReduceOp::kMax), 3), ElementsAre(3, 5, 8));
  EXPECT_THAT(Reduce(in, Op(ReduceOp::kMin), 3), ElementsAre(1, -2, -8));
  EXPECT_THAT(Reduce(in, Op(ReduceOp::kAvg), 3), ElementsAre(2, 1, 4.0f / 3));
}

TEST(HostReduceTest, AvgDividesByTheGroupSizeNotTheInputCount) {
  // A caller may fold fewer buffers than the group has ranks.
  EXPECT_THAT(Reduce({{8}, {8}}, Op(ReduceOp::kAvg), 4), ElementsAre(4));
}

TEST(HostReduceTest, FoldsLeftInRankOrder) {
  // float32: 1e8 + 1 rounds to 1e8, so ((1e8 + 1) + -1e8) + 1 == 1; any
  // other association gives 0 or 2.
  EXPECT_THAT(Reduce({{1e8f}, {1}, {-1e8f}, {1}}, Op(ReduceOp::kSum), 4),
              ElementsAre(1.0f));
  EXPECT_THAT(Reduce({{1}, {1}, {1e8f}, {-1e8f}}, Op(ReduceOp::kSum), 4),
              ElementsAre(0.0f));
}

TEST(HostReduceTest, PreDivideBeforeAndPostDivideAfterAvg) {
  // pre: 8/2 + 4/2 = 6; avg over 2: 3; post: 3/0.5 = 6.
  EXPECT_THAT(Reduce({{8}, {4}}, Op(ReduceOp::kAvg, 2, 0.5), 2),
              ElementsAre(6));
  // Sum with both factors: (9/3 + 3/3) / 2 = 2.
  EXPECT_THAT(Reduce({{9}, {3}}, Op(ReduceOp::kSum, 3, 2), 2), ElementsAre(2));
}

TEST(HostReduceTest, HalfPrecisionRoundsAfterEveryStep) {
  // bfloat16 has 8 significand bits: 256 + 1 = 257 rounds (to even) back to
  // 256 at every step, so the fold stays at 256, whereas rounding once at the
  // end would give 258.
  std::vector<uint16_t> a = {FloatToBFloat16Bits(256)};
  std::vector<uint16_t> one = {FloatToBFloat16Bits(1)};
  std::vector<const void*> ptrs = {a.data(), one.data(), one.data()};
  uint16_t out = 0;
  HostReduce(ptrs, &out, 1, DType::kBFloat16, Op(ReduceOp::kSum), 3);
  EXPECT_EQ(BFloat16BitsToFloat(out), 256.0f);

  // float16: 2048 + 1 likewise stays 2048.
  std::vector<uint16_t> h = {FloatToHalfBits(2048)};
  std::vector<uint16_t> h1 = {FloatToHalfBits(1)};
  ptrs = {h.data(), h1.data(), h1.data()};
  HostReduce(ptrs, &out, 1, DType::kFloat16, Op(ReduceOp::kSum), 3);
  EXPECT_EQ(HalfBitsToFloat(out), 2048.0f);
}

TEST(HostReduceTest, PreDivideIsRoundedToTheDtype) {
  // float16(1/3) = 0.333251953125; the sum of two is rounded to float16.
  std::vector<uint16_t> x = {FloatToHalfBits(1)};
  std::vector<const void*> ptrs = {x.data(), x.data()};
  uint16_t out = 0;
  HostReduce(ptrs, &out, 1, DType::kFloat16, Op(ReduceOp::kSum, 3), 2);
  const float third = HalfBitsToFloat(FloatToHalfBits(1.0f / 3));
  EXPECT_EQ(third, 0.333251953125f);
  EXPECT_EQ(HalfBitsToFloat(out),
            HalfBitsToFloat(FloatToHalfBits(third + third)));
}

TEST(HostReduceTest, Float64IsExact) {
  std::vector<double> a = {0.1, 1e300}, b = {0.2, 1e300};
  std::vector<const void*> ptrs = {a.data(), b.data()};
  std::vector<double> out(2);
  HostReduce(ptrs, out.data(), 2, DType::kFloat64, Op(ReduceOp::kSum), 2);
  EXPECT_EQ(out[0], 0.1 + 0.2);
  EXPECT_EQ(out[1], 2e300);
}

TEST(HostReduceTest, OutputMayAliasTheFirstInput) {
  std::vector<float> a = {1, 2}, b = {10, 20};
  std::vector<const void*> ptrs = {a.data(), b.data()};
  HostReduce(ptrs, a.data(), 2, DType::kFloat32, Op(ReduceOp::kSum, 2), 2);
  EXPECT_THAT(a, ElementsAre(5.5f, 11));
}

TEST(HostReduceTest, StepAndFinishComposeToHostReduce) {
  std::vector<float> x0 = {4, -6}, x1 = {2, 9}, acc(2, 123);
  const ReduceOptions o = Op(ReduceOp::kAvg, 2, 3);
  HostReduceStep(acc.data(), x0.data(), 2, DType::kFloat32, o, /*first=*/true);
  EXPECT_THAT(acc, ElementsAre(2, -3));  // pre-divided copy
  HostReduceStep(acc.data(), x1.data(), 2, DType::kFloat32, o, false);
  EXPECT_THAT(acc, ElementsAre(3, 1.5f));
  HostReduceFinish(acc.data(), 2, DType::kFloat32, o, 2);
  EXPECT_THAT(acc, ElementsAre(0.5f, 0.25f));
  EXPECT_EQ(acc, Reduce({x0, x1}, o, 2));
}

TEST(HostReduceTest, FinishWithoutAvgOrPostLeavesTheSum) {
  std::vector<float> acc = {7, 8};
  HostReduceFinish(acc.data(), 2, DType::kFloat32, Op(ReduceOp::kSum), 5);
  EXPECT_THAT(acc, ElementsAre(7, 8));
  HostReduceFinish(acc.data(), 2, DType::kFloat32, Op(ReduceOp::kMax), 5);
  EXPECT_THAT(acc, ElementsAre(7, 8));
}

TEST(HostReduceTest, NanPropagatesThroughSum) {
  const float nan = std::nanf("");
  const auto out = Reduce({{nan, 1}, {1, 1}}, Op(ReduceOp::kSum), 2);
  EXPECT_TRUE(std::isnan(out[0]));
  EXPECT_EQ(out[1], 2);
}

TEST(HostReduceTest, ZeroCountTouchesNothing) {
  float a = 5, b = 6, out = 7;
  std::vector<const void*> ptrs = {&a, &b};
  HostReduce(ptrs, &out, 0, DType::kFloat32, Op(ReduceOp::kAvg, 2, 2), 2);
  EXPECT_EQ(out, 7);
}

// Powers of two divide by multiplying with the exact reciprocal; the bits
// must be those of a true division, for every dtype, for values across the
// range (subnormal results, overflow to infinity, NaN, signed zeros) and
// for factors that are not powers of two too.
TEST(HostReduceTest, DividingByPowersOfTwoIsBitwiseADivision) {
  std::vector<float> values;
  for (float v : {0.0f, -0.0f, 1.0f, -1.5f, 3.14159f, 1e-38f, 1.17549e-38f,
                  1e-44f, 3.4e38f, -2.5e38f, 65504.0f, 70000.0f, 6e-8f,
                  std::nanf(""), INFINITY, -INFINITY}) {
    values.push_back(v);
  }
  uint32_t bits = 12345;
  for (int i = 0; i < 2000; ++i) {
    bits = bits * 1664525u + 1013904223u;
    float v;
    std::memcpy(&v, &bits, 4);
    values.push_back(v);
  }
  const int64_t n = static_cast<int64_t>(values.size());
  for (DType dtype :
       {DType::kFloat32, DType::kFloat64, DType::kFloat16, DType::kBFloat16}) {
    std::vector<unsigned char> x(n * DTypeSize(dtype));
    for (int64_t i = 0; i < n; ++i)
      StoreFromDouble(x.data(), dtype, i, values[i]);
    for (double factor : {2.0, 4.0, 1024.0, 0.125, 0x1p100, 0x1p-100, 3.0, 6.0,
                          0x1p126, 0x1p127}) {
      // Reference: each element divided in the compute type (float32 for the
      // 16-bit dtypes), through volatile so that no division is rewritten.
      std::vector<unsigned char> want(x.size());
      for (int64_t i = 0; i < n; ++i) {
        const double v = LoadAsDouble(x.data(), dtype, i);
        if (dtype == DType::kFloat64) {
          volatile double f = factor;
          StoreFromDouble(want.data(), dtype, i, v / f);
        } else {
          volatile float f = static_cast<float>(factor);
          StoreFromDouble(want.data(), dtype, i, static_cast<float>(v) / f);
        }
      }
      ReduceOptions pre;
      pre.pre_divide_factor = factor;
      std::vector<unsigned char> got(x.size());
      HostReduceStep(got.data(), x.data(), n, dtype, pre, /*first=*/true);
      ReduceOptions post;
      post.post_divide_factor = factor;
      std::vector<unsigned char> finished = x;
      HostReduceFinish(finished.data(), n, dtype, post, 1);
      for (int64_t i = 0; i < n; ++i) {
        const double w = LoadAsDouble(want.data(), dtype, i);
        for (const auto* out : {&got, &finished}) {
          const double g = LoadAsDouble(out->data(), dtype, i);
          const bool same =
              std::isnan(w) ? std::isnan(g)
                            : (g == w && std::signbit(g) == std::signbit(w));
          ASSERT_TRUE(same) << DTypeName(dtype) << " " << values[i] << " / "
                            << factor << ": " << g << " != " << w;
        }
      }
    }
  }
}

}  // namespace
}  // namespace flatparam
