// Unit tests of the sharded trainer's options, reference mapping and memory
// formula, and the formula against the measured peaks for every prefetch
// setting. Its equivalence with TrainReference is proven by the property
// suite in verify/training_equivalence_test.cc (on the simulator) and
// verify/training_multiprocess_test.cc (MPI and c10d).
#include "refmodel/fsdp_trainer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <array>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "comm/flight_recorder.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/base/status_matchers.h"
#include "flatparam/device/device.h"
#include "flatparam/memory_stats.h"
#include "flatparam/runtime.h"
#include "sim/sim.h"

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
// parameters 12, 10 and 8. Without prefetching.
FsdpTrainOptions Tiny(ShardingStrategy strategy) {
  FsdpTrainOptions o;
  o.model.vocab = 4;
  o.model.dims = {2, 3};
  o.strategy = strategy;
  o.global_batch = 2;
  o.backward_prefetch = BackwardPrefetch::kNone;
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
  // The root's gradient, layers.0's and layers.1's, whose reduction is in
  // flight during layers.0's backward.
  EXPECT_EQ(Peak(full, MemoryCategory::kUnshardedGrads), (12 + 10 + 8) * 4);
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
  // While layers.0's finishes (the root's has started).
  EXPECT_EQ(Peak(two, MemoryCategory::kShardedGrads),
            (4 + 5 + 6) * 4 + (5 + 6) * 4);

  // bf16 parameters (reduced in bf16): halved unsharded buffers, the cast
  // shard, and each reduction's bf16 shard next to its float32 cast.
  FsdpTrainOptions bf16 = Tiny(ShardingStrategy::kFullShard);
  bf16.param_dtype = DType::kBFloat16;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(auto mp, ExpectedPeakMemory(bf16, 2));
  EXPECT_EQ(Peak(mp, MemoryCategory::kUnshardedParams), (12 + 10) * 2);
  EXPECT_EQ(Peak(mp, MemoryCategory::kLowPrecisionParams), 6 * 2);
  EXPECT_EQ(Peak(mp, MemoryCategory::kUnshardedGrads), (12 + 10 + 8) * 2);
  // The root's reduction finishing (its bf16 shard and their float32
  // cast) after the layers'.
  EXPECT_EQ(Peak(mp, MemoryCategory::kShardedGrads), (4 + 5) * 4 + 6 * 6);

  // NO_SHARD: whole flat parameters, nothing unsharded.
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      auto none, ExpectedPeakMemory(Tiny(ShardingStrategy::kNoShard), 2));
  EXPECT_EQ(Peak(none, MemoryCategory::kShardedParams), (12 + 9 + 8) * 4);
  EXPECT_EQ(Peak(none, MemoryCategory::kUnshardedParams), 0);

  // BACKWARD_PRE (PyTorch's default) gathers the next layer while one
  // runs: the root and both layers; its limit does not bind at depth 1.
  FsdpTrainOptions backward_pre = Tiny(ShardingStrategy::kFullShard);
  backward_pre.backward_prefetch = BackwardPrefetch::kBackwardPre;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(auto pre, ExpectedPeakMemory(backward_pre, 2));
  EXPECT_EQ(Peak(pre, MemoryCategory::kUnshardedParams), (12 + 10 + 8) * 4);
  EXPECT_EQ(FsdpTrainOptions{}.backward_prefetch,
            BackwardPrefetch::kBackwardPre);
  // BACKWARD_POST frees a layer before gathering the next: one at a time
  // here (layers.1 is gathered on demand, layers.0 alone after it).
  FsdpTrainOptions backward_post = backward_pre;
  backward_post.backward_prefetch = BackwardPrefetch::kBackwardPost;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(auto post,
                                 ExpectedPeakMemory(backward_post, 2));
  EXPECT_EQ(Peak(post, MemoryCategory::kUnshardedParams), (12 + 10) * 4);
  // Forward prefetch acts from the second iteration on.
  FsdpTrainOptions forward = Tiny(ShardingStrategy::kFullShard);
  forward.forward_prefetch = true;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(auto one, ExpectedPeakMemory(forward, 2));
  EXPECT_EQ(Peak(one, MemoryCategory::kUnshardedParams), (12 + 10) * 4);
  forward.steps = 2;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(auto two_steps,
                                 ExpectedPeakMemory(forward, 2));
  EXPECT_EQ(Peak(two_steps, MemoryCategory::kUnshardedParams),
            (12 + 10 + 8) * 4);
  // With bf16, each pending prefetch holds its cast shard: the limit
  // bounds how many (depth 2, limit 1: one ahead).
  forward.param_dtype = DType::kBFloat16;
  forward.prefetch_depth = 2;
  forward.limit_all_gathers = 1;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(auto limited, ExpectedPeakMemory(forward, 2));
  EXPECT_EQ(Peak(limited, MemoryCategory::kLowPrecisionParams), 6 * 2);
  forward.limit_all_gathers = 0;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(auto unlimited,
                                 ExpectedPeakMemory(forward, 2));
  EXPECT_EQ(Peak(unlimited, MemoryCategory::kLowPrecisionParams), (5 + 4) * 2);
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

// ---------------------------------------------------------------------------
// The formula against the measurement, for every prefetch setting.

struct PrefetchSetting {
  bool forward;
  BackwardPrefetch backward;
  int depth;
  int limit;
};

struct MemoryCase {
  ShardingStrategy strategy;
  PrefetchSetting prefetch;
};

std::string Name(const MemoryCase& c) {
  return absl::StrFormat("%s_%s%s_depth%d_limit%d",
                         ShardingStrategyName(c.strategy),
                         c.prefetch.forward ? "fwd_" : "",
                         BackwardPrefetchName(c.prefetch.backward),
                         c.prefetch.depth, c.prefetch.limit);
}

// TrainFsdpOnRank on `world` simulated ranks; the results by rank.
absl::StatusOr<std::vector<FsdpRankResult>> TrainOnSim(
    const FsdpTrainOptions& options, int world) {
  SimOptions sim;
  sim.world_size = world;
  FLATPARAM_ASSIGN_OR_RETURN(std::unique_ptr<SimWorld> sim_world,
                             SimWorld::Create(sim));
  std::vector<FsdpRankResult> results(world);
  FLATPARAM_RETURN_IF_ERROR(
      sim_world->Run([&](SimCommunicator& comm) -> absl::Status {
        HostDeviceOps device;
        FLATPARAM_ASSIGN_OR_RETURN(results[comm.rank()],
                                   TrainFsdpOnRank(comm, device, options));
        return absl::OkStatus();
      }));
  return results;
}

// The runtime names the unit and phase of every collective it issues in
// the rank's flight recorder: unshards in the forward (prefetched from the
// second step on), in the backward (prefetched under BACKWARD_PRE), and
// the reductions after each unit's backward.
TEST(FlightRecordsTest, NameEachCollectivesUnitAndPhase) {
  FsdpTrainOptions options;
  options.model.vocab = 5;
  options.model.dims = {3, 5, 2, 4};
  options.global_batch = 2;
  options.steps = 2;
  options.forward_prefetch = true;
  options.gather_results = false;
  SimOptions sim;
  sim.world_size = 2;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(std::unique_ptr<SimWorld> world,
                                 SimWorld::Create(sim));
  FLATPARAM_ASSERT_OK(world->Run([&](SimCommunicator& comm) -> absl::Status {
    HostDeviceOps device;
    return TrainFsdpOnRank(comm, device, options).status();
  }));
  std::map<std::string, int> seen;  // "op unit phase" -> count
  for (const FlightEntry& e : world->flight_recorder(1)->Snapshot()) {
    EXPECT_EQ(e.state, FlightState::kCompleted);
    if (e.op == CollectiveOp::kReduceScatter ||
        (e.op == CollectiveOp::kAllGather && e.dtype == DType::kFloat32 &&
         !e.context.unit.empty())) {
      ++seen[absl::StrCat(CollectiveOpName(e.op), " ", e.context.unit, " ",
                          CollectivePhaseName(e.context.phase))];
    }
  }
  std::vector<std::string> keys;
  for (const auto& [key, n] : seen) keys.push_back(key);
  EXPECT_THAT(keys, ::testing::IsSupersetOf(
                        {"all_gather <root> forward unshard",
                         "all_gather layers.0 forward unshard",
                         "all_gather layers.1 forward prefetch",
                         "all_gather layers.2 backward prefetch",
                         "reduce_scatter <root> post-backward reduce",
                         "reduce_scatter layers.2 post-backward reduce"}))
      << absl::StrJoin(keys, "; ");
  for (const std::string& key : keys) {
    EXPECT_FALSE(absl::StartsWith(key, "reduce_scatter") &&
                 !absl::EndsWith(key, "post-backward reduce"))
        << key;
  }
}

class PeakMemoryTest : public ::testing::TestWithParam<MemoryCase> {};

// Every rank's measured peak equals ExpectedPeakMemory, category by
// category, with layers of different sizes (so that which layers a
// prefetch window covers matters), in float32, mixed precision (param and
// reduce dtypes alone and together), CPU offload, and micro-batches in
// both accumulation modes.
TEST_P(PeakMemoryTest, MeasurementEqualsTheFormula) {
  const MemoryCase& c = GetParam();
  constexpr int kWorld = 4;
  FsdpTrainOptions base;
  base.model.vocab = 5;
  // Layers of 20, 12, 12 and 15 elements; the root 20.
  base.model.dims = {3, 5, 2, 4};
  base.strategy = c.strategy;
  base.shard_group_size = IsHybridStrategy(c.strategy) ? 2 : 0;
  base.global_batch = kWorld;
  base.steps = 2;
  base.forward_prefetch = c.prefetch.forward;
  base.backward_prefetch = c.prefetch.backward;
  base.prefetch_depth = c.prefetch.depth;
  base.limit_all_gathers = c.prefetch.limit;
  base.gather_results = false;
  struct Variant {
    const char* name;
    std::optional<DType> param, reduce;
    bool offload;
    int64_t micro_batches;
    AccumulationMode accumulation;
    int64_t steps;
  };
  const AccumulationMode kSharded = AccumulationMode::kShardedAccumulation;
  const AccumulationMode kNoSync = AccumulationMode::kNoSync;
  const Variant variants[] = {
      {"fp32", std::nullopt, std::nullopt, false, 1, kSharded, 2},
      {"fp32 one step", std::nullopt, std::nullopt, false, 1, kSharded, 1},
      {"bf16", DType::kBFloat16, std::nullopt, false, 1, kSharded, 2},
      {"fp16 reduced in fp32", DType::kFloat16, DType::kFloat32, false, 1,
       kSharded, 2},
      {"reduced in bf16", std::nullopt, DType::kBFloat16, false, 1, kSharded,
       2},
      {"offload", std::nullopt, std::nullopt, true, 1, kSharded, 2},
      {"offload bf16", DType::kBFloat16, std::nullopt, true, 1, kSharded, 2},
      {"2 micro-batches", std::nullopt, std::nullopt, false, 2, kSharded, 1},
      {"2 micro-batches no_sync", std::nullopt, std::nullopt, false, 2, kNoSync,
       1},
      {"3 micro-batches no_sync bf16 offload", DType::kBFloat16, std::nullopt,
       true, 3, kNoSync, 2},
  };
  for (const Variant& v : variants) {
    SCOPED_TRACE(v.name);
    FsdpTrainOptions o = base;
    o.param_dtype = v.param;
    o.reduce_dtype = v.reduce;
    o.cpu_offload = v.offload;
    o.micro_batches = v.micro_batches;
    o.accumulation = v.accumulation;
    o.steps = v.steps;
    FLATPARAM_ASSERT_OK_AND_ASSIGN(auto want, ExpectedPeakMemory(o, kWorld));
    FLATPARAM_ASSERT_OK_AND_ASSIGN(std::vector<FsdpRankResult> got,
                                   TrainOnSim(o, kWorld));
    for (const FsdpRankResult& r : got) {
      for (int k = 0; k < kNumMemoryCategories; ++k) {
        EXPECT_EQ(r.memory.peak[k], want[k])
            << "rank " << r.rank << " "
            << MemoryCategoryName(static_cast<MemoryCategory>(k));
      }
    }
  }
}

std::vector<MemoryCase> MemoryCases() {
  const PrefetchSetting settings[] = {
      {false, BackwardPrefetch::kNone, 1, 0},
      {false, BackwardPrefetch::kBackwardPre, 1, 2},  // PyTorch's default
      {false, BackwardPrefetch::kBackwardPre, 3, 0},
      {false, BackwardPrefetch::kBackwardPre, 3, 2},
      {false, BackwardPrefetch::kBackwardPost, 1, 2},
      {false, BackwardPrefetch::kBackwardPost, 2, 0},
      {false, BackwardPrefetch::kBackwardPost, 3, 1},
      {true, BackwardPrefetch::kNone, 2, 1},
      {true, BackwardPrefetch::kBackwardPre, 2, 0},
      {true, BackwardPrefetch::kBackwardPost, 4, 3},
  };
  std::vector<MemoryCase> out;
  for (ShardingStrategy s :
       {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp,
        ShardingStrategy::kNoShard, ShardingStrategy::kHybridShard,
        ShardingStrategy::kHybridShardZero2}) {
    for (const PrefetchSetting& p : settings) out.push_back({s, p});
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Prefetch, PeakMemoryTest,
                         ::testing::ValuesIn(MemoryCases()),
                         [](const auto& info) { return Name(info.param); });

TEST(ValidateFsdpTrainOptionsTest, NamesBadPrefetchSettings) {
  FsdpTrainOptions o = Tiny(ShardingStrategy::kFullShard);
  o.prefetch_depth = 0;
  EXPECT_THAT(ValidateFsdpTrainOptions(o, 2),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("prefetch depth must be >= 1, got 0")));
  o.prefetch_depth = 1;
  o.limit_all_gathers = -1;
  EXPECT_THAT(ValidateFsdpTrainOptions(o, 2),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("limit_all_gathers must be >= 0 (0 = "
                                 "unlimited), got -1")));
}

}  // namespace
}  // namespace refmodel
}  // namespace flatparam
