// The conformance suite's inputs and expectations: slices agree with whole
// buffers, the periodic shortcut agrees with a full HostReduce, kExact
// values are exact in any reduction order and kInexact ones are not, and
// the reference digests are pinned.
#include "comm/conformance/case_values.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "comm/communicator.h"
#include "comm/conformance/collective_cases.h"
#include "comm/host_reduce.h"
#include "flatparam/base/dtype.h"

namespace flatparam {
namespace conformance {
namespace {

CollectiveCase Case(CollectiveKind kind, DType dtype, int64_t count,
                    Values values, ReduceOp op = ReduceOp::kSum, double pre = 1,
                    double post = 1) {
  CollectiveCase c;
  c.kind = kind;
  c.dtype = dtype;
  c.count = count;
  c.values = values;
  c.op = op;
  c.pre_divide_factor = pre;
  c.post_divide_factor = post;
  return c;
}

bool SameBytes(const HostBuffer& a, const HostBuffer& b) {
  return a.bytes() == b.bytes() &&
         std::memcmp(a.data(), b.data(), a.bytes()) == 0;
}

TEST(CaseValuesTest, SlicesMatchWholeBuffers) {
  for (DType dtype : CollectiveDTypes()) {
    for (Values values : {Values::kExact, Values::kInexact}) {
      const CollectiveCase c =
          Case(CollectiveKind::kReduceScatter, dtype, 100, values);
      HostBuffer whole(dtype, 100);
      FillInput(c, 3, 0, whole.ref());
      for (int64_t first : {0, 1, 8, 9, 10, 37}) {
        for (int64_t count : {0, 1, 5, 9, 20, 63}) {
          HostBuffer slice(dtype, count);
          FillInput(c, 3, first, slice.ref());
          // memcmp's pointers must not be null, even for 0 bytes.
          EXPECT_EQ(count == 0
                        ? 0
                        : std::memcmp(slice.data(),
                                      whole.ref().Slice(first, count).data,
                                      slice.bytes()),
                    0)
              << c.Name() << " first " << first << " count " << count;
        }
      }
    }
  }
}

TEST(CaseValuesTest, ExactValuesAreSmallIntegersThatDifferByRank) {
  const CollectiveCase c =
      Case(CollectiveKind::kAllReduce, DType::kFloat32, 90, Values::kExact);
  std::vector<std::vector<double>> by_rank;
  for (int r = 0; r < kExactPeriod; ++r) {
    HostBuffer b(DType::kFloat32, 90);
    FillInput(c, r, 0, b.ref());
    std::vector<double> v;
    for (int64_t i = 0; i < 90; ++i) {
      v.push_back(LoadAsDouble(b.data(), DType::kFloat32, i));
      EXPECT_EQ(v.back(), std::round(v.back()));
      EXPECT_LE(std::abs(v.back()), 4);
    }
    by_rank.push_back(v);
  }
  for (int a = 0; a < kExactPeriod; ++a) {
    for (int b = a + 1; b < kExactPeriod; ++b) {
      EXPECT_NE(by_rank[a], by_rank[b]) << a << " " << b;
    }
  }
}

// The reduction of every rank's full input slice, without the periodic
// shortcut.
HostBuffer BruteForce(const CollectiveCase& c, int n, int64_t first,
                      int64_t count) {
  std::vector<HostBuffer> inputs;
  std::vector<const void*> pointers;
  for (int r = 0; r < n; ++r) {
    inputs.emplace_back(c.dtype, first + count);
    FillInput(c, r, 0, inputs.back().ref());
  }
  for (int r = 0; r < n; ++r) {
    pointers.push_back(inputs[r].ref().Slice(first, count).data);
  }
  HostBuffer out(c.dtype, count);
  HostReduce(pointers, out.data(), count, c.dtype, c.reduce_options(), n);
  return out;
}

TEST(CaseValuesTest, PeriodicExpectationsMatchAFullReduction) {
  for (DType dtype : CollectiveDTypes()) {
    for (ReduceOp op :
         {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax, ReduceOp::kMin}) {
      for (int n : {1, 3, 4, 7}) {
        CollectiveCase rs =
            Case(CollectiveKind::kReduceScatter, dtype, 50, Values::kExact, op);
        if (op == ReduceOp::kSum) rs.pre_divide_factor = 3;
        for (int rank = 0; rank < n; ++rank) {
          EXPECT_TRUE(SameBytes(ExpectedOutput(rs, n, rank),
                                BruteForce(rs, n, rank * 50, 50)))
              << rs.Name() << " n " << n << " rank " << rank;
        }
        CollectiveCase ar = rs;
        ar.kind = CollectiveKind::kAllReduce;
        ar.count = 101;
        EXPECT_TRUE(
            SameBytes(ExpectedOutput(ar, n, 0), BruteForce(ar, n, 0, 101)))
            << ar.Name() << " n " << n;
      }
    }
  }
}

TEST(CaseValuesTest, AllGatherAndBroadcastExpectations) {
  const CollectiveCase ag =
      Case(CollectiveKind::kAllGather, DType::kBFloat16, 5, Values::kInexact);
  const HostBuffer out = ExpectedOutput(ag, 3, 1);
  ASSERT_EQ(out.count(), 15);
  for (int r = 0; r < 3; ++r) {
    HostBuffer in(DType::kBFloat16, 5);
    FillInput(ag, r, 0, in.ref());
    EXPECT_EQ(std::memcmp(in.data(),
                          static_cast<const char*>(out.data()) + r * 10, 10),
              0);
  }
  CollectiveCase bc = ag;
  bc.kind = CollectiveKind::kBroadcast;
  bc.root = 2;
  HostBuffer root(DType::kBFloat16, 5);
  FillInput(bc, 2, 0, root.ref());
  EXPECT_TRUE(SameBytes(ExpectedOutput(bc, 3, 0), root));
}

// HostReduce of the same inputs in another order.
HostBuffer ReduceInOrder(const CollectiveCase& c, int n,
                         const std::vector<int>& order) {
  std::vector<HostBuffer> inputs;
  std::vector<const void*> pointers;
  for (int r = 0; r < n; ++r) {
    inputs.emplace_back(c.dtype, c.count);
    FillInput(c, r, 0, inputs.back().ref());
  }
  for (int r : order) pointers.push_back(inputs[r].data());
  HostBuffer out(c.dtype, c.count);
  HostReduce(pointers, out.data(), c.count, c.dtype, c.reduce_options(), n);
  return out;
}

TEST(CaseValuesTest, OrderIndependentCasesGiveTheSameBitsInAnyOrder) {
  std::mt19937 rng(7);
  int checked = 0;
  for (DType dtype : CollectiveDTypes()) {
    for (int n : {2, 3, 4, 8, 16, 64}) {
      for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
        for (double pre : {1.0, 2.0, 8.0}) {
          CollectiveCase c = Case(CollectiveKind::kAllReduce, dtype, 200,
                                  Values::kExact, op, pre, 4);
          if (!IsOrderIndependent(c, n)) continue;
          std::vector<int> order(n);
          std::iota(order.begin(), order.end(), 0);
          const HostBuffer in_rank_order = ReduceInOrder(c, n, order);
          for (int trial = 0; trial < 3; ++trial) {
            std::shuffle(order.begin(), order.end(), rng);
            EXPECT_TRUE(SameBytes(ReduceInOrder(c, n, order), in_rank_order))
                << c.Name() << " n " << n;
          }
          ++checked;
        }
      }
    }
  }
  EXPECT_GT(checked, 100);
}

TEST(CaseValuesTest, InexactValuesShowTheReductionOrder) {
  for (DType dtype : CollectiveDTypes()) {
    const CollectiveCase c =
        Case(CollectiveKind::kAllReduce, dtype, 200, Values::kInexact);
    std::vector<int> order(8);
    std::iota(order.begin(), order.end(), 0);
    const HostBuffer forward = ReduceInOrder(c, 8, order);
    std::reverse(order.begin(), order.end());
    EXPECT_FALSE(SameBytes(ReduceInOrder(c, 8, order), forward))
        << DTypeName(dtype);
    EXPECT_FALSE(IsOrderIndependent(c, 8));
    // Max picks an input whatever the order.
    CollectiveCase max = c;
    max.op = ReduceOp::kMax;
    std::shuffle(order.begin(), order.end(), std::mt19937(1));
    EXPECT_TRUE(SameBytes(ReduceInOrder(max, 8, order),
                          ReduceInOrder(max, 8, {0, 1, 2, 3, 4, 5, 6, 7})));
    EXPECT_TRUE(IsOrderIndependent(max, 8));
  }
}

TEST(CaseValuesTest, OrderIndependence) {
  CollectiveCase c = Case(CollectiveKind::kAllReduce, DType::kBFloat16, 3,
                          Values::kExact, ReduceOp::kAvg);
  EXPECT_TRUE(IsOrderIndependent(c, 4));
  EXPECT_FALSE(IsOrderIndependent(c, 3));  // NCCL premultiplies by 1/3.
  c.op = ReduceOp::kSum;
  EXPECT_TRUE(IsOrderIndependent(c, 3));
  EXPECT_FALSE(IsOrderIndependent(c, kMaxExactGroup + 1));
  c.pre_divide_factor = 3;
  EXPECT_FALSE(IsOrderIndependent(c, 4));
  c.pre_divide_factor = 0.5;
  EXPECT_TRUE(IsOrderIndependent(c, 4));
  c.pre_divide_factor = 1;
  c.values = Values::kInexact;
  EXPECT_FALSE(IsOrderIndependent(c, 4));
  c.op = ReduceOp::kMax;
  EXPECT_TRUE(IsOrderIndependent(c, 3));
  c.op = ReduceOp::kSum;
  c.kind = CollectiveKind::kAllGather;
  EXPECT_TRUE(IsOrderIndependent(c, 3));
}

TEST(CaseValuesTest, Names) {
  CollectiveCase c = Case(CollectiveKind::kAllReduce, DType::kFloat16, 13,
                          Values::kInexact, ReduceOp::kAvg, 3, 7);
  c.in_place = true;
  EXPECT_EQ(c.Name(),
            "all_reduce float16 count 13 avg pre 3 post 7 inexact "
            "in place");
  CollectiveCase b =
      Case(CollectiveKind::kBroadcast, DType::kBFloat16, 7, Values::kExact);
  b.root = 3;
  EXPECT_EQ(b.Name(), "broadcast bfloat16 count 7 root 3 exact");
}

TEST(CaseValuesTest, MismatchesAreCountedAndDescribed) {
  std::vector<float> got = {1, 2, 3, 4}, want = {1, 2.5f, 3, 5};
  int64_t first = 0;
  EXPECT_EQ(
      CountMismatches(got.data(), want.data(), 4, DType::kFloat32, &first), 2);
  EXPECT_EQ(first, 1);
  EXPECT_EQ(DescribeMismatch(got.data(), want.data(), DType::kFloat32, 1),
            "element 1 is 2 (bits 0x40000000), expected 2.5 (bits "
            "0x40200000)");
  EXPECT_EQ(CountMismatches(got.data(), got.data(), 4, DType::kFloat32, &first),
            0);
  EXPECT_EQ(first, -1);
}

TEST(CaseValuesTest, ReferenceDigestsArePinned) {
  // Changes only with the inputs, the digest cases or HostReduce's
  // arithmetic; the simulator and MPI tests compare against the same table.
  EXPECT_EQ(CombineDigests(ReferenceDigests(4)), kReferenceDigestWorld4)
      << std::hex << CombineDigests(ReferenceDigests(4));
  EXPECT_NE(CombineDigests(ReferenceDigests(3)),
            CombineDigests(ReferenceDigests(4)));
}

}  // namespace
}  // namespace conformance
}  // namespace flatparam
