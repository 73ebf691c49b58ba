// Unit tests of the sharded trainer's options, reference mapping and memory
// formula. Its equivalence with TrainReference is proven by the property
// suite in verify/training_equivalence_test.cc (on the simulator) and
// verify/training_mpi_test.cc (MPI).
#include "refmodel/fsdp_trainer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <array>

#include "flatparam/base/status_matchers.h"
#include "flatparam/memory_stats.h"

namespace flatparam {
namespace refmodel {
namespace {

using ::testing::HasSubstr;

int64_t Peak(const std::array<int64_t, kNumMemoryCategories>& m,
             MemoryCategory c) {
  return m[static_cast<int>(c)];
}

// vocab 4, dims {2, 3}: the root holds embed.weight [4, 2] and head.bias
// [4] (12 elements), layers.0 9 and layers.1 8. On 2 ranks without
// alignment the shards are 6, 5 and 4 elements, the padded unsharded
// parameters 12, 10 and 8.
FsdpTrainOptions Tiny(ShardingStrategy strategy) {
  FsdpTrainOptions o;
  o.model.vocab = 4;
  o.model.dims = {2, 3};
  o.strategy = strategy;
  o.global_batch = 2;
  return o;
}

TEST(ExpectedPeakMemoryTest, WorkedExample) {
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      ModelLayout layout,
      FsdpModelLayout(Tiny(ShardingStrategy::kFullShard), 2));
  ASSERT_EQ(layout.flat_params().size(), 3u);
  EXPECT_EQ(layout.flat_params()[0].sharded_numel(), 6);
  EXPECT_EQ(layout.flat_params()[1].sharded_numel(), 5);
  EXPECT_EQ(layout.flat_params()[2].sharded_numel(), 4);

  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      auto full, ExpectedPeakMemory(Tiny(ShardingStrategy::kFullShard), 2));
  EXPECT_EQ(Peak(full, MemoryCategory::kShardedParams), (6 + 5 + 4) * 4);
  // The root and the larger layer.
  EXPECT_EQ(Peak(full, MemoryCategory::kUnshardedParams), (12 + 10) * 4);
  EXPECT_EQ(Peak(full, MemoryCategory::kUnshardedGrads), (12 + 10) * 4);
  // Reduced in the order layers.1, layers.0, root; each keeps its shard.
  EXPECT_EQ(Peak(full, MemoryCategory::kShardedGrads), (4 + 5 + 6) * 4);
  EXPECT_EQ(Peak(full, MemoryCategory::kLowPrecisionParams), 0);

  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      auto zero2, ExpectedPeakMemory(Tiny(ShardingStrategy::kShardGradOp), 2));
  EXPECT_EQ(Peak(zero2, MemoryCategory::kUnshardedParams), (12 + 10 + 8) * 4);

  // Two micro-batches reduced separately: all shards plus the largest new
  // one.
  FsdpTrainOptions micro = Tiny(ShardingStrategy::kFullShard);
  micro.micro_batches = 2;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(auto two, ExpectedPeakMemory(micro, 2));
  EXPECT_EQ(Peak(two, MemoryCategory::kShardedGrads), (4 + 5 + 6) * 4 + 6 * 4);

  // bf16 parameters (reduced in bf16): halved unsharded buffers, the cast
  // shard, and each reduction's bf16 shard next to its float32 cast.
  FsdpTrainOptions bf16 = Tiny(ShardingStrategy::kFullShard);
  bf16.param_dtype = DType::kBFloat16;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(auto mp, ExpectedPeakMemory(bf16, 2));
  EXPECT_EQ(Peak(mp, MemoryCategory::kUnshardedParams), (12 + 10) * 2);
  EXPECT_EQ(Peak(mp, MemoryCategory::kLowPrecisionParams), 6 * 2);
  EXPECT_EQ(Peak(mp, MemoryCategory::kUnshardedGrads), (12 + 10) * 2);
  EXPECT_EQ(Peak(mp, MemoryCategory::kShardedGrads), (4 + 5) * 4 + 6 * 6);

  // NO_SHARD: whole flat parameters, nothing unsharded.
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      auto none, ExpectedPeakMemory(Tiny(ShardingStrategy::kNoShard), 2));
  EXPECT_EQ(Peak(none, MemoryCategory::kShardedParams), (12 + 9 + 8) * 4);
  EXPECT_EQ(Peak(none, MemoryCategory::kUnshardedParams), 0);
}

TEST(ReferenceOptionsForTest, MapsTheRun) {
  FsdpTrainOptions o = Tiny(ShardingStrategy::kHybridShard);
  o.shard_group_size = 2;
  o.global_batch = 8;
  o.steps = 4;
  o.micro_batches = 3;
  o.accumulation = AccumulationMode::kNoSync;
  o.param_dtype = DType::kFloat16;
  o.data_seed = 11;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(TrainOptions r, ReferenceOptionsFor(o, 8));
  EXPECT_EQ(r.reduction.world_size, 8);
  EXPECT_EQ(r.reduction.shard_group_size, 2);
  EXPECT_EQ(r.reduction.pre_divide_factor, 4);
  EXPECT_EQ(r.reduction.post_divide_factor, 2);
  EXPECT_EQ(r.steps, 4);
  EXPECT_EQ(r.global_batch, 8);
  EXPECT_EQ(r.micro_batches, 3);
  EXPECT_EQ(r.accumulation, AccumulationMode::kNoSync);
  EXPECT_EQ(r.param_dtype, DType::kFloat16);
  EXPECT_FALSE(r.reduce_dtype.has_value());
  EXPECT_EQ(r.data_seed, 11u);
  o.strategy = ShardingStrategy::kNoShard;
  o.shard_group_size = 0;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(r, ReferenceOptionsFor(o, 8));
  EXPECT_EQ(r.reduction.shard_group_size, 0);
}

TEST(ValidateFsdpTrainOptionsTest, NamesTheOffendingValues) {
  FsdpTrainOptions o = Tiny(ShardingStrategy::kHybridShard);
  o.global_batch = 8;
  o.shard_group_size = 3;
  EXPECT_THAT(ValidateFsdpTrainOptions(o, 8),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("shard group size 3 must be >= 1 and divide "
                                 "the world size 8")));
  o.strategy = ShardingStrategy::kFullShard;
  EXPECT_THAT(ValidateFsdpTrainOptions(o, 8),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("only meaningful for HYBRID_SHARD")));
  o.shard_group_size = 0;
  o.global_batch = 6;
  EXPECT_THAT(ValidateFsdpTrainOptions(o, 4),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("global batch 6 must be >= 1 and a multiple "
                                 "of the world size 4")));
  o.global_batch = 4;
  o.micro_batches = 0;
  EXPECT_THAT(ValidateFsdpTrainOptions(o, 4),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("micro-batches must be >= 1, got 0")));
  o.micro_batches = 1;
  o.param_dtype = DType::kInt8;
  EXPECT_THAT(ValidateFsdpTrainOptions(o, 4),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("param dtype int8")));
  o.param_dtype.reset();
  o.model.dims = {};
  EXPECT_THAT(ValidateFsdpTrainOptions(o, 4),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ValidateFsdpTrainOptions(Tiny(ShardingStrategy::kNoShard), 0),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("world size must be >= 1, got 0")));
}

}  // namespace
}  // namespace refmodel
}  // namespace flatparam
