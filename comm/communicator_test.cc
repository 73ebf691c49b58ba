#include "comm/communicator.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "flatparam/base/dtype.h"
#include "flatparam/base/status_matchers.h"

namespace flatparam {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Pair;

TEST(DeviceTest, NamesAndEquality) {
  EXPECT_EQ(DeviceName(Device::Host()), "host");
  EXPECT_EQ(DeviceName(Device::Cuda(3)), "cuda:3");
  EXPECT_EQ(Device::Host(), Device());
  EXPECT_EQ(Device::Cuda(1), Device::Cuda(1));
  EXPECT_NE(Device::Cuda(0), Device::Cuda(1));
  EXPECT_NE(Device::Cuda(0), Device::Host());
}

TEST(BufferRefTest, BytesFollowTheDtype) {
  EXPECT_EQ((ConstBufferRef{nullptr, 10, DType::kFloat32}).bytes(), 40);
  EXPECT_EQ((ConstBufferRef{nullptr, 10, DType::kFloat64}).bytes(), 80);
  EXPECT_EQ((BufferRef{nullptr, 10, DType::kBFloat16}).bytes(), 20);
  EXPECT_EQ((BufferRef{nullptr, 0, DType::kFloat16}).bytes(), 0);
}

TEST(BufferRefTest, SliceOffsetsInElementsOfTheDtype) {
  std::vector<uint16_t> data(10);
  BufferRef all{data.data(), 10, DType::kBFloat16, Device::Cuda(2)};
  BufferRef mid = all.Slice(3, 4);
  EXPECT_EQ(mid.data, data.data() + 3);
  EXPECT_EQ(mid.count, 4);
  EXPECT_EQ(mid.dtype, DType::kBFloat16);
  EXPECT_EQ(mid.device, Device::Cuda(2));
  EXPECT_EQ(all.Slice(10, 0).data, data.data() + 10);

  std::vector<double> d(4);
  BufferRef dd{d.data(), 4, DType::kFloat64};
  EXPECT_EQ(dd.Slice(1, 3).data, d.data() + 1);
  EXPECT_EQ(dd.Slice(1, 3).bytes(), 24);
}

TEST(BufferRefTest, ConvertsToConstBufferRef) {
  float x[2];
  BufferRef b{x, 2, DType::kFloat32, Device::Cuda(1)};
  ConstBufferRef c = b;
  EXPECT_EQ(c.data, x);
  EXPECT_EQ(c.count, 2);
  EXPECT_EQ(c.dtype, DType::kFloat32);
  EXPECT_EQ(c.device, Device::Cuda(1));
}

TEST(ReduceOpTest, Names) {
  EXPECT_EQ(ReduceOpName(ReduceOp::kSum), "sum");
  EXPECT_EQ(ReduceOpName(ReduceOp::kAvg), "avg");
  EXPECT_EQ(ReduceOpName(ReduceOp::kMax), "max");
  EXPECT_EQ(ReduceOpName(ReduceOp::kMin), "min");
}

TEST(OptionsTest, Defaults) {
  ReduceOptions r;
  EXPECT_EQ(r.op, ReduceOp::kSum);
  EXPECT_EQ(r.pre_divide_factor, 1.0);
  EXPECT_EQ(r.post_divide_factor, 1.0);
  EXPECT_EQ(r.timeout, kDefaultCollectiveTimeout);
  EXPECT_EQ(BroadcastOptions().root, 0);
}

TEST(CompletedWorkTest, WaitReturnsTheSameStatusEveryTime) {
  std::unique_ptr<Work> ok = CompletedWork(absl::OkStatus());
  ASSERT_NE(ok, nullptr);
  EXPECT_THAT(ok->Wait(), IsOk());
  EXPECT_THAT(ok->Wait(), IsOk());
  std::unique_ptr<Work> bad = CompletedWork(absl::AbortedError("peer died"));
  EXPECT_THAT(bad->Wait(),
              StatusIs(absl::StatusCode::kAborted, HasSubstr("peer died")));
  EXPECT_THAT(bad->Wait(),
              StatusIs(absl::StatusCode::kAborted, HasSubstr("peer died")));
}

// ---------------------------------------------------------------------------
// Validators.

class ValidateTest : public ::testing::Test {
 protected:
  float in_[64] = {};
  float out_[64] = {};
  BufferRef In(int64_t n, DType d = DType::kFloat32) { return {in_, n, d}; }
  BufferRef Out(int64_t n, DType d = DType::kFloat32) { return {out_, n, d}; }
};

TEST_F(ValidateTest, AllGatherNeedsSizeTimesCountOutput) {
  EXPECT_THAT(ValidateAllGather(2, 4, 7, In(3), Out(12)), IsOk());
  EXPECT_THAT(ValidateAllGather(2, 4, 7, In(3), Out(11)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("rank 2: all_gather #7: expected input of 3 "
                                 "and output of 12 elements, got 3 and 11")));
  // In place is allowed: the output contains the input.
  BufferRef out = Out(12);
  EXPECT_THAT(ValidateAllGather(1, 4, 0, out.Slice(3, 3), out), IsOk());
}

TEST_F(ValidateTest, ReduceScatterNeedsSizeTimesCountInput) {
  EXPECT_THAT(ValidateReduceScatter(0, 4, 1, In(8), Out(2), {}), IsOk());
  EXPECT_THAT(
      ValidateReduceScatter(3, 4, 1, In(9), Out(2), {}),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("rank 3: reduce_scatter #1: expected input "
                         "of 8 and output of 2 elements, got 9 and 2")));
}

TEST_F(ValidateTest, AllReduceNeedsEqualCounts) {
  EXPECT_THAT(ValidateAllReduce(0, 2, 5, In(4), Out(4), {}), IsOk());
  EXPECT_THAT(ValidateAllReduce(0, 2, 5, In(4), Out(5), {}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("all_reduce #5: expected input of 4 and "
                                 "output of 4 elements, got 4 and 5")));
}

TEST_F(ValidateTest, BufferChecks) {
  EXPECT_THAT(ValidateAllReduce(1, 2, 0, In(-1), Out(-1), {}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("rank 1: all_reduce #0: input has a negative "
                                 "count -1")));
  BufferRef null{nullptr, 3, DType::kFloat32};
  EXPECT_THAT(ValidateAllReduce(1, 2, 0, In(3), null, {}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("output (3 x float32 on host) has a null "
                                 "pointer")));
  // Empty buffers may be null.
  BufferRef empty{nullptr, 0, DType::kFloat32};
  EXPECT_THAT(ValidateAllReduce(1, 2, 0, empty, empty, {}), IsOk());
  EXPECT_THAT(
      ValidateAllGather(0, 2, 0, In(2, DType::kInt64), Out(4, DType::kInt64)),
      StatusIs(absl::StatusCode::kUnimplemented,
               HasSubstr("input has dtype int64")));
  EXPECT_THAT(
      ValidateAllGather(0, 2, 0, In(2), Out(4, DType::kFloat16)),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("input (2 x float32 on host) and output (4 x float16 "
                         "on host) differ in dtype or device")));
  BufferRef cuda = Out(4);
  cuda.device = Device::Cuda(0);
  EXPECT_THAT(ValidateAllGather(0, 2, 0, In(2), cuda),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("(4 x float32 on cuda:0)")));
}

TEST_F(ValidateTest, DivideFactors) {
  ReduceOptions o;
  o.op = ReduceOp::kAvg;
  o.pre_divide_factor = 2;
  o.post_divide_factor = 4;
  EXPECT_THAT(ValidateAllReduce(0, 2, 0, In(4), Out(4), o), IsOk());
  o.op = ReduceOp::kMax;
  EXPECT_THAT(ValidateAllReduce(0, 2, 3, In(4), Out(4), o),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("rank 0: all_reduce #3: divide factors (2, 4) "
                                 "need op sum or avg, got max")));
  for (double bad : {0.0, -1.0, std::numeric_limits<double>::quiet_NaN()}) {
    ReduceOptions p;
    p.post_divide_factor = bad;
    EXPECT_THAT(ValidateReduceScatter(0, 2, 0, In(4), Out(2), p),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("divide factors must be positive")))
        << bad;
  }
}

TEST_F(ValidateTest, BroadcastRoot) {
  BroadcastOptions o;
  o.root = 3;
  EXPECT_THAT(ValidateBroadcast(0, 4, 2, Out(4), o), IsOk());
  for (int root : {-1, 4}) {
    o.root = root;
    EXPECT_THAT(ValidateBroadcast(1, 4, 2, Out(4), o),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr(absl::StrCat("rank 1: broadcast #2: root ",
                                                root, " is not in [0, 4)"))));
  }
  EXPECT_THAT(ValidateBroadcast(0, 4, 0, Out(4, DType::kBool), {}),
              StatusIs(absl::StatusCode::kUnimplemented,
                       HasSubstr("buffer has dtype bool")));
}

// ---------------------------------------------------------------------------
// MakeHybridGroups against a communicator that records its splits.

class SplitRecorder final : public Communicator {
 public:
  SplitRecorder(int rank, int size, absl::Status split_status = {})
      : rank_(rank), size_(size), split_status_(std::move(split_status)) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  absl::string_view backend() const override { return "recorder"; }
  std::unique_ptr<Work> AllGather(ConstBufferRef, BufferRef,
                                  const CollectiveOptions&) override {
    return CompletedWork(absl::UnimplementedError("AllGather"));
  }
  std::unique_ptr<Work> ReduceScatter(ConstBufferRef, BufferRef,
                                      const ReduceOptions&) override {
    return CompletedWork(absl::UnimplementedError("ReduceScatter"));
  }
  std::unique_ptr<Work> AllReduce(ConstBufferRef, BufferRef,
                                  const ReduceOptions&) override {
    return CompletedWork(absl::UnimplementedError("AllReduce"));
  }
  std::unique_ptr<Work> Broadcast(BufferRef, const BroadcastOptions&) override {
    return CompletedWork(absl::UnimplementedError("Broadcast"));
  }
  absl::StatusOr<std::vector<std::string>> AllGatherBytes(
      absl::string_view, const CollectiveOptions&) override {
    return absl::UnimplementedError("AllGatherBytes");
  }
  absl::Status Barrier(const CollectiveOptions&) override {
    return absl::UnimplementedError("Barrier");
  }
  absl::StatusOr<std::unique_ptr<Communicator>> Split(
      int color, int key, const CollectiveOptions& options) override {
    splits.emplace_back(color, key);
    timeouts.push_back(options.timeout);
    if (!split_status_.ok()) return split_status_;
    return std::unique_ptr<Communicator>(
        std::make_unique<SplitRecorder>(key, 0));
  }

  std::vector<std::pair<int, int>> splits;
  std::vector<absl::Duration> timeouts;

 private:
  int rank_;
  int size_;
  absl::Status split_status_;
};

TEST(MakeHybridGroupsTest, SplitsByNodeThenByLocalRank) {
  // Rank 6 of 8 with nodes of 4: node 1, local rank 2.
  SplitRecorder world(6, 8);
  CollectiveOptions options;
  options.timeout = absl::Seconds(7);
  FLATPARAM_ASSERT_OK_AND_ASSIGN(HybridGroups groups,
                                 MakeHybridGroups(world, 4, options));
  EXPECT_THAT(world.splits, ElementsAre(Pair(1, 2), Pair(2, 1)));
  EXPECT_THAT(world.timeouts, ElementsAre(absl::Seconds(7), absl::Seconds(7)));
  ASSERT_NE(groups.shard, nullptr);
  ASSERT_NE(groups.replicate, nullptr);
  EXPECT_EQ(groups.shard->rank(), 2);
  EXPECT_EQ(groups.replicate->rank(), 1);
}

TEST(MakeHybridGroupsTest, ShardGroupSizeMustDivideTheWorld) {
  for (int bad : {0, -2, 3, 16}) {
    SplitRecorder world(0, 8);
    EXPECT_THAT(
        MakeHybridGroups(world, bad),
        StatusIs(absl::StatusCode::kInvalidArgument,
                 HasSubstr(absl::StrCat("shard group size ", bad,
                                        " must be >= 1 and divide the world "
                                        "size 8"))));
    EXPECT_TRUE(world.splits.empty());
  }
}

TEST(MakeHybridGroupsTest, SplitErrorsPropagate) {
  SplitRecorder world(0, 4, absl::AbortedError("peer died"));
  EXPECT_THAT(MakeHybridGroups(world, 2),
              StatusIs(absl::StatusCode::kAborted, HasSubstr("peer died")));
  EXPECT_EQ(world.splits.size(), 1);
}

}  // namespace
}  // namespace flatparam
