#include "comm/conformance/bandwidth.h"

#include <gtest/gtest.h>

#include "absl/time/time.h"
#include "flatparam/base/dtype.h"

namespace flatparam {
namespace conformance {
namespace {

TEST(BandwidthTest, NcclTestsBusFactors) {
  EXPECT_DOUBLE_EQ(BusBandwidthFactor(CollectiveKind::kAllGather, 8), 7.0 / 8);
  EXPECT_DOUBLE_EQ(BusBandwidthFactor(CollectiveKind::kReduceScatter, 4),
                   3.0 / 4);
  EXPECT_DOUBLE_EQ(BusBandwidthFactor(CollectiveKind::kAllReduce, 4), 1.5);
  EXPECT_DOUBLE_EQ(BusBandwidthFactor(CollectiveKind::kBroadcast, 4), 1.0);
  EXPECT_DOUBLE_EQ(BusBandwidthFactor(CollectiveKind::kAllReduce, 1), 0.0);
}

TEST(BandwidthTest, SizesAreNcclTestsSizes) {
  // all_gather: the output; reduce_scatter: the input; all_reduce: the buffer.
  EXPECT_EQ(CollectiveBytes(CollectiveKind::kAllGather, 10, 4, DType::kFloat32),
            160);
  EXPECT_EQ(
      CollectiveBytes(CollectiveKind::kReduceScatter, 10, 4, DType::kFloat16),
      80);
  EXPECT_EQ(CollectiveBytes(CollectiveKind::kAllReduce, 10, 4, DType::kFloat64),
            80);
  EXPECT_EQ(CountForBytes(CollectiveKind::kAllGather, 1024, 8, DType::kFloat32),
            32);
  EXPECT_EQ(CountForBytes(CollectiveKind::kAllReduce, 1024, 8, DType::kFloat32),
            256);
  // Rounds down, but never to zero.
  EXPECT_EQ(
      CountForBytes(CollectiveKind::kReduceScatter, 100, 8, DType::kFloat32),
      3);
  EXPECT_EQ(CountForBytes(CollectiveKind::kAllGather, 4, 8, DType::kFloat64),
            1);
}

TEST(BandwidthTest, AlgbwAndBusbw) {
  const Bandwidth b = ComputeBandwidth(CollectiveKind::kAllReduce, 1000000, 4,
                                       absl::Milliseconds(1));
  EXPECT_DOUBLE_EQ(b.algbw, 1e9);
  EXPECT_DOUBLE_EQ(b.busbw, 1.5e9);
  const Bandwidth g = ComputeBandwidth(CollectiveKind::kAllGather, 8000, 8,
                                       absl::Microseconds(2));
  EXPECT_DOUBLE_EQ(g.algbw, 4e9);
  EXPECT_DOUBLE_EQ(g.busbw, 3.5e9);
  const Bandwidth zero = ComputeBandwidth(CollectiveKind::kAllGather, 8000, 8,
                                          absl::ZeroDuration());
  EXPECT_EQ(zero.algbw, 0);
  EXPECT_EQ(zero.busbw, 0);
}

}  // namespace
}  // namespace conformance
}  // namespace flatparam
