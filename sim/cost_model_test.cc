#include "sim/cost_model.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "flatparam/base/dtype.h"
#include "flatparam/base/status_matchers.h"
#include "flatparam/layout.h"
#include "flatparam/memory_stats.h"
#include "flatparam/model_layout.h"
#include "flatparam/runtime.h"
#include "refmodel/fsdp_trainer.h"

namespace flatparam {
namespace cost {
namespace {

using ::testing::HasSubstr;

static_assert(static_cast<int>(MemoryKind::kLowPrecisionParams) ==
                  static_cast<int>(MemoryCategory::kLowPrecisionParams),
              "MemoryKind extends MemoryCategory");

int64_t Kind(const MemoryBytes& m, MemoryKind k) {
  return m[static_cast<int>(k)];
}

LinkSpec OneNode(int gpus, double bw, double latency) {
  LinkSpec link;
  link.nodes = 1;
  link.gpus_per_node = gpus;
  link.intra_bytes_per_second = bw;
  link.intra_latency_s = latency;
  return link;
}

TEST(CollectiveTimeTest, RingInsideOneNode) {
  const LinkSpec link = OneNode(8, 100e9, 1e-6);
  const CommGroup group{1, 8};
  const CollectiveCost ag =
      CollectiveTime(Collective::kAllGather, 8'000'000'000, group, link);
  // 7 steps of 1 us + 8 GB * 7/8 at 100 GB/s.
  EXPECT_DOUBLE_EQ(ag.seconds, 7e-6 + 0.07);
  EXPECT_EQ(ag.sent_bytes, 7'000'000'000);
  EXPECT_NEAR(ag.bus_bytes_per_second, 7e9 / (7e-6 + 0.07), 1);

  const CollectiveCost rs =
      CollectiveTime(Collective::kReduceScatter, 8'000'000'000, group, link);
  EXPECT_DOUBLE_EQ(rs.seconds, ag.seconds);

  const CollectiveCost ar =
      CollectiveTime(Collective::kAllReduce, 8'000'000'000, group, link);
  EXPECT_DOUBLE_EQ(ar.seconds, 14e-6 + 0.14);
  EXPECT_EQ(ar.sent_bytes, 14'000'000'000);

  // One rank: nothing moves.
  const CollectiveCost one =
      CollectiveTime(Collective::kAllReduce, 1000, CommGroup{1, 1}, link);
  EXPECT_EQ(one.seconds, 0);
  EXPECT_EQ(one.sent_bytes, 0);
}

TEST(CollectiveTimeTest, HierarchicalAcrossNodes) {
  LinkSpec link = OneNode(8, 400e9, 1e-6);
  link.nodes = 2;
  link.inter_bytes_per_second = 50e9;
  link.inter_latency_s = 5e-6;
  const int64_t s = 16'000'000'000;
  const CollectiveCost ag =
      CollectiveTime(Collective::kAllGather, s, CommGroup{2, 8}, link);
  // Inter: 1 step, 16 GB / 8 rails * 1/2 at 50 GB/s; intra: 7 steps,
  // 16 GB * 7/8 at 400 GB/s.
  EXPECT_DOUBLE_EQ(ag.seconds, (5e-6 + 2e9 * 0.5 / 50e9) +
                                   (7e-6 + 16e9 * 7.0 / 8.0 / 400e9));
  // What a flat ring of 16 sends.
  EXPECT_EQ(ag.sent_bytes, s * 15 / 16);

  const CollectiveCost ar =
      CollectiveTime(Collective::kAllReduce, s, CommGroup{2, 8}, link);
  EXPECT_DOUBLE_EQ(ar.seconds, 2 * (5e-6 + 2e9 * 0.5 / 50e9) +
                                   2 * (7e-6 + 16e9 * 7.0 / 8.0 / 400e9));

  // One rank per node: the network only.
  const CollectiveCost rail =
      CollectiveTime(Collective::kAllReduce, 1'000'000, CommGroup{4, 1}, link);
  EXPECT_DOUBLE_EQ(rail.seconds, 6 * 5e-6 + 2 * 1e6 * 0.75 / 50e9);
  EXPECT_EQ(rail.sent_bytes, 1'500'000);
}

TEST(CollectiveTimeTest, MoreBandwidthIsNeverSlower) {
  for (Collective c : {Collective::kAllGather, Collective::kReduceScatter,
                       Collective::kAllReduce}) {
    for (CommGroup group : {CommGroup{1, 8}, CommGroup{4, 8}, CommGroup{16, 1},
                            CommGroup{512, 8}}) {
      for (int64_t bytes : {int64_t{0}, int64_t{1} << 10, int64_t{1} << 30}) {
        double previous = INFINITY;
        for (double scale : {0.5, 1.0, 2.0, 8.0}) {
          LinkSpec link = OneNode(group.ranks_per_node, 100e9 * scale, 1e-6);
          link.nodes = group.nodes;
          link.inter_bytes_per_second = 25e9 * scale;
          const double t = CollectiveTime(c, bytes, group, link).seconds;
          EXPECT_LE(t, previous) << CollectiveName(c) << " " << bytes;
          previous = t;
        }
      }
    }
  }
}

// Root (100 elements) and one layer (200) on 2 ranks of one node; numbers
// chosen so that every time is a round fraction of a second.
std::vector<UnitSpec> TinyUnits() {
  return {{"", 100, 100, 50}, {"layers.0", 200, 200, 100}};
}

StepOptions TinyOptions() {
  StepOptions o;
  o.strategy = ShardingStrategy::kFullShard;
  o.link = OneNode(2, 1e3, 0);
  o.optimizer_state_bytes_per_element = 8;  // AdamW in float32
  o.tokens_per_rank = 1;
  o.peak_flops = 1e3;
  o.efficiency = 1;
  return o;
}

TEST(PredictStepTest, HandCheckedFullShard) {
  FLATPARAM_ASSERT_OK_AND_ASSIGN(StepPrediction p,
                                 PredictStep(TinyUnits(), TinyOptions()));
  // comm:    AG(root) [0, .2], AG(layer) [.2, .6], AG(layer, backward)
  //          [.6, 1.0] (prefetched; it does not wait for the layer's
  //          forward, and one free is under the limit of 2), RS(layer)
  //          [2.1, 2.5], RS(root) [2.5, 2.7].
  // compute: F(root) [.2, .3], F(layer) [.6, 1.0], F(root) [1.0, 1.1],
  //          B(root) [1.1, 1.3], B(layer) [1.3, 2.1], B(root) [2.1, 2.3].
  ASSERT_EQ(p.ops.size(), 11u);
  EXPECT_EQ(p.ops[0].name, "all_gather root");
  EXPECT_NEAR(p.ops[0].end, 0.2, 1e-12);
  EXPECT_EQ(p.ops[3].name, "forward layers.0");
  EXPECT_NEAR(p.ops[3].start, 0.6, 1e-12);
  EXPECT_NEAR(p.step_seconds, 2.7, 1e-12);
  EXPECT_NEAR(p.compute_seconds, 1.8, 1e-12);
  EXPECT_NEAR(p.exposed_comm_seconds, 0.9, 1e-12);

  const CommVolume& ag = p.comm[static_cast<int>(Collective::kAllGather)];
  EXPECT_EQ(ag.calls, 3);
  EXPECT_EQ(ag.bytes, 400 + 800 + 800);
  EXPECT_EQ(ag.sent_bytes, 1000);
  const CommVolume& rs = p.comm[static_cast<int>(Collective::kReduceScatter)];
  EXPECT_EQ(rs.calls, 2);
  EXPECT_EQ(rs.bytes, 1200);
  EXPECT_EQ(p.comm_sent_bytes(), 1600);

  // At B(layer)'s start (1.3): shards 600, AdamW 1200, the root and the
  // layer unsharded (1200) and their gradients (1200). From .6 to 1.0 the
  // layer is unsharded twice (its forward's and its backward's all-gather):
  // 2000 unsharded, 3800 in all.
  EXPECT_EQ(p.peak_bytes, 4200);
  EXPECT_NEAR(p.peak_time, 1.3, 1e-12);
  EXPECT_EQ(Kind(p.peak_by_kind, MemoryKind::kShardedParams), 600);
  EXPECT_EQ(Kind(p.peak_by_kind, MemoryKind::kUnshardedParams), 2000);
  EXPECT_EQ(Kind(p.peak_by_kind, MemoryKind::kUnshardedGrads), 1200);
  EXPECT_EQ(Kind(p.peak_by_kind, MemoryKind::kShardedGrads), 600);
  EXPECT_EQ(Kind(p.peak_by_kind, MemoryKind::kOptimizerState), 1200);
  EXPECT_EQ(Kind(p.peak_by_kind, MemoryKind::kLowPrecisionParams), 0);
  // The step ends with the shards, their gradients and the state.
  EXPECT_EQ(p.memory.back().total(), 600 + 600 + 1200);
}

TEST(PredictStepTest, NoOverlapSerialisesEverything) {
  StepOptions o = TinyOptions();
  o.overlap = false;
  o.backward_prefetch = false;
  o.max_inflight_all_gathers = 1;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(StepPrediction p, PredictStep(TinyUnits(), o));
  double comm = 0;
  for (const TimelineOp& op : p.ops) {
    if (op.stream == Stream::kComm) comm += op.end - op.start;
  }
  EXPECT_NEAR(p.step_seconds, p.compute_seconds + comm, 1e-12);
  EXPECT_NEAR(p.exposed_comm_seconds, comm, 1e-12);
}

TEST(PredictStepTest, NoShardAllReducesAndHybridAddsTheReplicaAllReduce) {
  StepOptions o = TinyOptions();
  o.strategy = ShardingStrategy::kNoShard;
  std::vector<UnitSpec> whole = {{"", 100, 100, 100},
                                 {"layers.0", 200, 200, 200}};
  FLATPARAM_ASSERT_OK_AND_ASSIGN(StepPrediction none, PredictStep(whole, o));
  EXPECT_EQ(none.comm[static_cast<int>(Collective::kAllGather)].calls, 0);
  EXPECT_EQ(none.comm[static_cast<int>(Collective::kAllReduce)].calls, 2);
  EXPECT_EQ(none.comm[static_cast<int>(Collective::kAllReduce)].sent_bytes,
            2 * 1200 / 2);

  o.strategy = ShardingStrategy::kHybridShard;
  o.link.nodes = 3;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(StepPrediction hybrid,
                                 PredictStep(TinyUnits(), o));
  const CommVolume& ar = hybrid.comm[static_cast<int>(Collective::kAllReduce)];
  EXPECT_EQ(ar.calls, 2);
  EXPECT_EQ(ar.bytes, (50 + 100) * 4);  // the shards
  EXPECT_EQ(ar.sent_bytes, 2 * 200 * 2 / 3 + 2 * 400 * 2 / 3);
}

TEST(PredictStepTest, MoreBandwidthIsNeverSlower) {
  std::vector<UnitSpec> units = {{"", 1000, 1024, 128}};
  for (int i = 0; i < 12; ++i) units.push_back({"l", 5000, 5120, 640});
  for (ShardingStrategy st :
       {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp,
        ShardingStrategy::kHybridShard, ShardingStrategy::kHybridShardZero2}) {
    double previous = INFINITY;
    for (double scale : {0.25, 1.0, 4.0, 64.0}) {
      StepOptions o = TinyOptions();
      o.strategy = st;
      o.link = OneNode(8, 1e4 * scale, 1e-4);
      o.link.inter_bytes_per_second = 1e3 * scale;
      o.link.nodes = 4;
      if (!IsHybridStrategy(st)) {
        for (UnitSpec& u : units) u.sharded_numel = u.unsharded_numel / 32;
      } else {
        for (UnitSpec& u : units) u.sharded_numel = u.unsharded_numel / 8;
      }
      FLATPARAM_ASSERT_OK_AND_ASSIGN(StepPrediction p, PredictStep(units, o));
      EXPECT_LE(p.step_seconds, previous) << ShardingStrategyName(st);
      EXPECT_GE(p.exposed_comm_seconds, 0);
      previous = p.step_seconds;
    }
  }
}

TEST(PredictStepTest, MoreRanksNeverMoreMemoryForShardedStrategies) {
  // 2^k-divisible numels, so padding does not interfere.
  const std::vector<int64_t> numels = {1 << 20, 3 << 20, 3 << 20, 3 << 20};
  for (ShardingStrategy st :
       {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp}) {
    int64_t previous = INT64_MAX;
    for (int nodes : {1, 2, 4, 8, 64, 512}) {
      std::vector<UnitSpec> units;
      for (int64_t n : numels) units.push_back({"u", n, n, n / (nodes * 8)});
      StepOptions o = TinyOptions();
      o.strategy = st;
      o.link = OneNode(8, 100e9, 1e-6);
      o.link.nodes = nodes;
      FLATPARAM_ASSERT_OK_AND_ASSIGN(StepPrediction p, PredictStep(units, o));
      EXPECT_LT(p.peak_bytes, previous) << ShardingStrategyName(st);
      previous = p.peak_bytes;
    }
  }
}

TEST(PredictStepTest, RejectsBadInput) {
  EXPECT_THAT(
      PredictStep({}, TinyOptions()),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no units")));
  StepOptions o = TinyOptions();
  o.efficiency = 1.5;
  EXPECT_THAT(PredictStep(TinyUnits(), o),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("1.5")));
  o = TinyOptions();
  o.link.inter_bytes_per_second = 0;
  EXPECT_THAT(PredictStep(TinyUnits(), o),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("inter-node bandwidth")));
  o = TinyOptions();
  std::vector<UnitSpec> wrong = {{"x", 10, 10, 4}};
  EXPECT_THAT(
      PredictStep(wrong, o),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("unit \"x\"")));
  EXPECT_THAT(
      FindTopologyPreset("dgx-z"),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("dgx-h100")));
}

TEST(TopologyTest, PresetsAreValid) {
  for (const std::string& name : TopologyPresetNames()) {
    FLATPARAM_ASSERT_OK_AND_ASSIGN(Topology t, FindTopologyPreset(name));
    EXPECT_EQ(t.name, name);
    EXPECT_THAT(ValidateLinkSpec(t.link), IsOk());
    EXPECT_GT(t.gpu.peak_flops_low_precision, t.gpu.peak_flops_fp32);
    EXPECT_GT(t.gpu.memory_bytes, 0);
    EXPECT_LT(t.link.inter_bytes_per_second, t.link.intra_bytes_per_second);
  }
}

TEST(PredictionTraceJsonTest, IsValidChromeTrace) {
  FLATPARAM_ASSERT_OK_AND_ASSIGN(StepPrediction p,
                                 PredictStep(TinyUnits(), TinyOptions()));
  const std::string text = PredictionTraceJson({{"FULL_SHARD", &p}});
  const nlohmann::json doc = nlohmann::json::parse(text);
  ASSERT_TRUE(doc["traceEvents"].is_array());
  int complete = 0, counters = 0;
  std::set<int> tids;
  for (const nlohmann::json& e : doc["traceEvents"]) {
    if (e["ph"] == "X") {
      ++complete;
      tids.insert(e["tid"].get<int>());
      EXPECT_GE(e["dur"].get<double>(), 0);
    } else if (e["ph"] == "C") {
      ++counters;
      EXPECT_TRUE(e["args"].contains("optimizer_state"));
    }
  }
  EXPECT_EQ(complete, static_cast<int>(p.ops.size()));
  EXPECT_EQ(counters, static_cast<int>(p.memory.size()));
  EXPECT_EQ(tids, (std::set<int>{0, 1}));
  EXPECT_EQ(text, PredictionTraceJson({{"FULL_SHARD", &p}}));
}

// With the host runtime's sequential schedule the timeline's peaks equal
// the runtime's measured-memory closed form, category by category, without
// backward prefetch and with BACKWARD_PRE one unit ahead.
TEST(PredictStepTest, AgreesWithTheRuntimesExpectedPeakMemory) {
  struct Case {
    ShardingStrategy strategy;
    int world;
    int group;  // shard group (hybrid)
    std::optional<DType> param_dtype;
    std::optional<DType> reduce_dtype;
  };
  const std::vector<Case> cases = {
      {ShardingStrategy::kFullShard, 2, 0, std::nullopt, std::nullopt},
      {ShardingStrategy::kFullShard, 4, 0, DType::kBFloat16, std::nullopt},
      {ShardingStrategy::kFullShard, 3, 0, DType::kFloat16, DType::kFloat32},
      {ShardingStrategy::kShardGradOp, 4, 0, std::nullopt, std::nullopt},
      {ShardingStrategy::kShardGradOp, 2, 0, DType::kBFloat16, std::nullopt},
      {ShardingStrategy::kNoShard, 2, 0, std::nullopt, std::nullopt},
      {ShardingStrategy::kNoShard, 4, 0, DType::kBFloat16, DType::kFloat32},
      {ShardingStrategy::kHybridShard, 4, 2, std::nullopt, std::nullopt},
      {ShardingStrategy::kHybridShardZero2, 8, 4, DType::kBFloat16,
       std::nullopt},
  };
  for (const Case& c : cases) {
    for (const bool prefetch : {false, true}) {
      refmodel::FsdpTrainOptions t;
      t.backward_prefetch =
          prefetch ? BackwardPrefetch::kBackwardPre : BackwardPrefetch::kNone;
      t.prefetch_depth = 1;
      t.model.vocab = 7;
      t.model.dims = {3, 5, 4};
      t.strategy = c.strategy;
      t.shard_group_size = c.group;
      t.param_dtype = c.param_dtype;
      t.reduce_dtype = c.reduce_dtype;
      t.global_batch = c.world;
      FLATPARAM_ASSERT_OK_AND_ASSIGN(ModelLayout layout,
                                     refmodel::FsdpModelLayout(t, c.world));
      FLATPARAM_ASSERT_OK_AND_ASSIGN(auto want,
                                     refmodel::ExpectedPeakMemory(t, c.world));
      std::vector<UnitSpec> units;
      for (const FlatParamLayout& l : layout.flat_params()) {
        units.push_back({l.unit(), l.param_numel(), l.padded_unsharded_numel(),
                         l.sharded_numel()});
      }
      StepOptions o;
      o.strategy = c.strategy;
      const int group = IsHybridStrategy(c.strategy) ? c.group : c.world;
      o.link = OneNode(group, 1e9, 1e-6);
      o.link.nodes = c.world / group;
      o.orig_dtype = DType::kFloat32;
      o.param_dtype = c.param_dtype.value_or(DType::kFloat32);
      o.reduce_dtype = c.reduce_dtype.value_or(o.param_dtype);
      o.overlap = false;
      o.backward_prefetch = prefetch;
      o.max_inflight_all_gathers = 1;
      FLATPARAM_ASSERT_OK_AND_ASSIGN(StepPrediction p, PredictStep(units, o));
      for (int k = 0; k < kNumMemoryCategories; ++k) {
        EXPECT_EQ(p.peak_by_kind[k], want[k])
            << ShardingStrategyName(c.strategy) << " W=" << c.world
            << (prefetch ? " BACKWARD_PRE " : " NONE ")
            << MemoryCategoryName(static_cast<MemoryCategory>(k));
      }
    }
  }
}

}  // namespace
}  // namespace cost
}  // namespace flatparam
