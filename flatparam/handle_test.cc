#include "flatparam/handle.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/base/status_matchers.h"
#include "flatparam/flatten.h"
#include "flatparam/internal/handle_test_hooks.h"
#include "sim/fault.h"
#include "sim/sim.h"
#include "testing/handle_testutil.h"

namespace flatparam {
namespace {

using ::flatparam::testing_handle::AddGradients;
using ::flatparam::testing_handle::AddIn;
using ::flatparam::testing_handle::InitialParams;
using ::flatparam::testing_handle::InitialValue;
using ::flatparam::testing_handle::LocalGradient;
using ::flatparam::testing_handle::MakeLayout;
using ::flatparam::testing_handle::RankContext;
using ::flatparam::testing_handle::ReadValues;
using ::flatparam::testing_handle::ReducedShard;
using ::flatparam::testing_handle::RoundTo;
using ::flatparam::testing_handle::RunIteration;
using ::flatparam::testing_handle::RunWithHandles;
using ::flatparam::testing_handle::Scenario;
using ::flatparam::testing_handle::WriteValues;
using ::testing::AllOf;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;

constexpr ShardingStrategy kAllStrategies[] = {
    ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp,
    ShardingStrategy::kNoShard, ShardingStrategy::kHybridShard,
    ShardingStrategy::kHybridShardZero2};

// PyTorch's RESHARD_AFTER_FORWARD_HANDLE_STRATEGIES, spelled out so that the
// tests do not use the function under test as their oracle.
bool FreesAfterForward(ShardingStrategy strategy) {
  return strategy == ShardingStrategy::kFullShard ||
         strategy == ShardingStrategy::kHybridShard;
}

std::vector<ParamSpec> DefaultSpecs() {
  return {{"a.w", {3, 5}}, {"a.b", {3}}, {"c", {}}, {"d.w", {7}}};
}

std::vector<ParamSpec> FrozenSpecs() {
  std::vector<ParamSpec> specs = DefaultSpecs();
  ParamSpec frozen{"frozen.w", {2, 3}};
  frozen.requires_grad = false;
  specs.insert(specs.begin() + 2, frozen);
  return specs;
}

Scenario Make(ShardingStrategy strategy, int shard_size, bool align = false) {
  Scenario s;
  s.specs = DefaultSpecs();
  s.strategy = strategy;
  s.shard_size = shard_size;
  s.replicate_size = IsHybridStrategy(strategy) ? 2 : 1;
  s.align = align;
  return s;
}

int64_t CountOps(const SimWorld& world, int rank, absl::string_view name) {
  int64_t n = 0;
  for (const TraceEvent& e : world.trace()) {
    if (e.rank == rank && e.name == name) ++n;
  }
  return n;
}

ConstBufferRef HostRef(const HostTensor& t) {
  return {t.data(), t.numel(), t.dtype(), Device::Host()};
}

std::vector<unsigned char> Bytes(ConstBufferRef b) {
  const auto* p = static_cast<const unsigned char*>(b.data);
  return std::vector<unsigned char>(p, p + b.bytes());
}

// The accumulation dtype ReduceGrad documents.
DType AccumDType(const Scenario& s, const FlatParamHandle& h) {
  if (s.strategy == ShardingStrategy::kNoShard &&
      s.options.keep_low_precision_grads && !s.options.cpu_offload) {
    return h.reduce_dtype();
  }
  return h.orig_dtype();
}

TEST(GradientPredivideFactorTest, MatchesPyTorch) {
  // (world size, predivide): PyTorch's doubling loop.
  const std::vector<std::pair<int, double>> cases = {
      {1, 1},  {2, 2},  {3, 2},  {4, 2},  {5, 2},    {6, 4},   {8, 4},
      {12, 4}, {16, 4}, {32, 8}, {64, 8}, {128, 16}, {256, 16}};
  for (const auto& [w, pre] : cases) {
    EXPECT_EQ(GradientPredivideFactor(w), pre) << "world size " << w;
  }
}

TEST(HandleTrainingStateTest, Names) {
  EXPECT_EQ(HandleTrainingStateName(HandleTrainingState::kIdle), "IDLE");
  EXPECT_EQ(HandleTrainingStateName(HandleTrainingState::kBackwardPre),
            "BACKWARD_PRE");
  EXPECT_EQ(HandleTrainingStateName(HandleTrainingState::kSummonFullParams),
            "SUMMON_FULL_PARAMS");
  EXPECT_TRUE(ReshardsAfterForward(ShardingStrategy::kFullShard));
  EXPECT_TRUE(ReshardsAfterForward(ShardingStrategy::kHybridShard));
  EXPECT_FALSE(ReshardsAfterForward(ShardingStrategy::kShardGradOp));
  EXPECT_FALSE(ReshardsAfterForward(ShardingStrategy::kHybridShardZero2));
  EXPECT_FALSE(ReshardsAfterForward(ShardingStrategy::kNoShard));
}

// ---------------------------------------------------------------------------
// Unshard / reshard and views, for every strategy.

struct CycleCase {
  ShardingStrategy strategy;
  int shard_size;
  bool align;
  uint64_t seed;
};

class UnshardCycleTest : public ::testing::TestWithParam<CycleCase> {};

TEST_P(UnshardCycleTest, ViewsAndFlatParamMatchTheLayout) {
  const CycleCase c = GetParam();
  Scenario s = Make(c.strategy, c.shard_size, c.align);
  s.sim_seed = c.seed;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(FlatParamLayout layout, MakeLayout(s));
  const std::vector<HostTensor> params = InitialParams(s, layout);
  std::vector<ConstBufferRef> refs;
  for (const HostTensor& t : params) refs.push_back(t.cref());
  HostTensor flat =
      HostTensor::Flat(layout.dtype(), layout.unpadded_unsharded_numel());
  FLATPARAM_ASSERT_OK(Flatten(layout, refs, flat.ref()));
  const bool sharded = UsesShardedStrategy(c.strategy);

  std::unique_ptr<SimWorld> world;
  const absl::Status status = RunWithHandles(
      s,
      [&](RankContext& ctx) -> absl::Status {
        FlatParamHandle& h = ctx.handle;
        const int rank = h.rank();
        EXPECT_EQ(h.training_state(), HandleTrainingState::kIdle);
        EXPECT_FALSE(h.is_unsharded());
        EXPECT_EQ(h.NeedsUnshard(), sharded);
        // The local shard is FlattenShard's.
        HostTensor want =
            HostTensor::Flat(layout.dtype(), layout.sharded_numel());
        FLATPARAM_RETURN_IF_ERROR(FlattenShard(layout, refs, rank, want.ref()));
        EXPECT_EQ(Bytes(h.sharded_param()), Bytes(HostRef(want)));
        EXPECT_EQ(h.ShardMetadata().param_names,
                  layout.shard_metadata(rank).param_names);

        for (int iter = 0; iter < 2; ++iter) {
          FLATPARAM_RETURN_IF_ERROR(h.PreForward());
          EXPECT_TRUE(h.is_unsharded());
          EXPECT_FALSE(h.NeedsUnshard());
          const std::optional<BufferRef> unsharded = h.unsharded_flat_param();
          EXPECT_TRUE(unsharded.has_value());
          EXPECT_EQ(Bytes(*unsharded), Bytes(HostRef(flat)))
              << "rank " << rank << " iter " << iter;
          for (int i = 0; i < static_cast<int>(layout.params().size()); ++i) {
            FLATPARAM_ASSIGN_OR_RETURN(OrigParamView v, h.Param(i));
            const ParamInfo& p = layout.params()[i];
            EXPECT_FALSE(v.sharded);
            EXPECT_EQ(v.shape, p.shape);
            EXPECT_EQ(v.data.dtype, layout.dtype());
            EXPECT_EQ(v.data.count, p.numel);
            EXPECT_EQ(static_cast<const char*>(v.data.data),
                      static_cast<const char*>(unsharded->data) +
                          p.offset * DTypeSize(layout.dtype()));
            EXPECT_EQ(ReadValues(v.data), ReadValues(HostRef(params[i])));
            FLATPARAM_RETURN_IF_ERROR(h.CheckView(v));
          }
          FLATPARAM_RETURN_IF_ERROR(h.PostForward());
          EXPECT_FALSE(h.is_unsharded());
          // PyTorch frees after forward only for FULL_SHARD and HYBRID_SHARD.
          EXPECT_EQ(h.NeedsUnshard(), sharded && FreesAfterForward(c.strategy));
          for (int i = 0; i < static_cast<int>(layout.params().size()); ++i) {
            FLATPARAM_ASSIGN_OR_RETURN(OrigParamView v, h.Param(i));
            const ParamInfo& p = layout.params()[i];
            EXPECT_TRUE(v.sharded);
            if (!sharded) {
              EXPECT_EQ(v.shape, p.shape);
              EXPECT_EQ(v.data.data,
                        static_cast<char*>(h.sharded_param().data) +
                            p.offset * DTypeSize(layout.dtype()));
              continue;
            }
            const ShardParamInfo info = layout.shard_param_info(rank, i);
            const int64_t numel =
                info.in_shard ? std::max<int64_t>(0, info.numel_in_shard) : 0;
            EXPECT_EQ(v.shape, std::vector<int64_t>{numel});
            EXPECT_EQ(v.data.count, numel);
            if (numel == 0) continue;
            EXPECT_EQ(v.data.data,
                      static_cast<char*>(h.sharded_param().data) +
                          info.offset_in_shard * DTypeSize(layout.dtype()));
            std::vector<double> expect;
            for (int64_t k = info.intra_param_start_idx;
                 k <= info.intra_param_end_idx; ++k) {
              expect.push_back(params[i].GetDouble(k));
            }
            EXPECT_EQ(ReadValues(v.data), expect) << p.fqn;
          }
          // The whole iteration: a backward needs the parameter again.
          FLATPARAM_RETURN_IF_ERROR(h.PreBackward());
          EXPECT_TRUE(h.is_unsharded());
          FLATPARAM_RETURN_IF_ERROR(h.PostBackward());
          FLATPARAM_RETURN_IF_ERROR(h.FinalizeBackward());
          EXPECT_EQ(h.NeedsUnshard(), sharded);
        }
        return absl::OkStatus();
      },
      &world);
  ASSERT_THAT(status, IsOk());
  // All-gathers: FULL_SHARD-like strategies gather before forward and
  // backward; the others keep the parameter from forward to backward.
  for (int r = 0; r < s.world_size(); ++r) {
    const int64_t gathers = CountOps(*world, r, "all_gather");
    if (!sharded) {
      EXPECT_EQ(gathers, 0);
    } else if (FreesAfterForward(c.strategy)) {
      EXPECT_EQ(gathers, 4) << "rank " << r;
    } else {
      EXPECT_EQ(gathers, 2) << "rank " << r;
    }
  }
}

std::vector<CycleCase> CycleCases() {
  std::vector<CycleCase> cases;
  uint64_t seed = 1;
  for (ShardingStrategy strategy : kAllStrategies) {
    for (int shard : {1, 2, 3, 4}) {
      for (bool align : {false, true}) {
        cases.push_back({strategy, shard, align, seed++});
      }
    }
  }
  return cases;
}

std::string CycleName(const ::testing::TestParamInfo<CycleCase>& info) {
  return absl::StrCat(ShardingStrategyName(info.param.strategy), "_W",
                      info.param.shard_size,
                      info.param.align ? "_aligned" : "");
}

INSTANTIATE_TEST_SUITE_P(AllStrategies, UnshardCycleTest,
                         ::testing::ValuesIn(CycleCases()), CycleName);

// ---------------------------------------------------------------------------
// Gradient reduction against the reference fold.

struct GradCase {
  ShardingStrategy strategy;
  int shard_size;
  DType dtype;
  bool rounding;
  bool in_collectives;
  bool align;
};

class ReduceGradTest : public ::testing::TestWithParam<GradCase> {
 protected:
  Scenario MakeScenario() const {
    const GradCase c = GetParam();
    Scenario s = Make(c.strategy, c.shard_size, c.align);
    // A frozen parameter among trainable ones is PyTorch's use_orig_params
    // case (the aligned layouts); unaligned ones need uniform requires_grad.
    s.specs = c.align ? FrozenSpecs() : DefaultSpecs();
    s.dtype = c.dtype;
    s.rounding_values = c.rounding;
    s.options.divide_in_collectives = c.in_collectives;
    s.sim_seed = c.shard_size * 7 + c.rounding;
    return s;
  }

  // Runs iterations with the given sync flags and compares every rank's
  // sharded gradient against `expected(shard_rank)`; checks the number of
  // gradient collectives.
  void RunAndCheck(
      const Scenario& s, const std::vector<bool>& syncs,
      const std::function<std::vector<double>(const FlatParamHandle&, int)>&
          expected) {
    std::vector<std::vector<double>> got(s.world_size());
    std::vector<std::vector<double>> want(s.world_size());
    std::unique_ptr<SimWorld> world;
    ASSERT_THAT(
        RunWithHandles(
            s,
            [&](RankContext& ctx) -> absl::Status {
              for (size_t i = 0; i < syncs.size(); ++i) {
                FLATPARAM_RETURN_IF_ERROR(
                    RunIteration(s, ctx, static_cast<int>(i), syncs[i]));
              }
              const std::optional<BufferRef> g = ctx.handle.sharded_grad();
              if (!g.has_value()) {
                return absl::InternalError("no sharded gradient");
              }
              EXPECT_EQ(g->dtype, AccumDType(s, ctx.handle));
              got[ctx.world_rank] = ReadValues(*g);
              want[ctx.world_rank] = expected(ctx.handle, ctx.handle.rank());
              return absl::OkStatus();
            },
            &world),
        IsOk());
    int64_t syncs_done = 0;
    for (bool b : syncs) syncs_done += b;
    for (int r = 0; r < s.world_size(); ++r) {
      EXPECT_EQ(got[r], want[r]) << "world rank " << r << " " << s.Options();
      if (UsesShardedStrategy(s.strategy)) {
        EXPECT_EQ(CountOps(*world, r, "reduce_scatter"), syncs_done);
        EXPECT_EQ(CountOps(*world, r, "all_reduce"),
                  s.hybrid() ? syncs_done : 0);
      } else {
        EXPECT_EQ(CountOps(*world, r, "all_reduce"), syncs_done);
      }
    }
  }
};

TEST_P(ReduceGradTest, OneIterationMatchesTheFold) {
  const Scenario s = MakeScenario();
  FLATPARAM_ASSERT_OK_AND_ASSIGN(FlatParamLayout layout, MakeLayout(s));
  RunAndCheck(s, {true}, [&](const FlatParamHandle& h, int shard_rank) {
    std::vector<std::vector<double>> local;
    for (int w = 0; w < s.world_size(); ++w) {
      local.push_back(LocalGradient(s, layout, h.param_dtype(), w, {0}));
    }
    return ReducedShard(s, layout, local, shard_rank, h.reduce_dtype(),
                        AccumDType(s, h), h.gradient_predivide_factor(),
                        h.gradient_postdivide_factor());
  });
}

// Without no_sync every backward reduces, and the sharded gradient
// accumulates in the accumulation dtype.
TEST_P(ReduceGradTest, AccumulatesAcrossSynchronizedIterations) {
  const Scenario s = MakeScenario();
  FLATPARAM_ASSERT_OK_AND_ASSIGN(FlatParamLayout layout, MakeLayout(s));
  RunAndCheck(s, {true, true, true}, [&](const FlatParamHandle& h, int sr) {
    std::vector<double> acc;
    for (int iter = 0; iter < 3; ++iter) {
      std::vector<std::vector<double>> local;
      for (int w = 0; w < s.world_size(); ++w) {
        local.push_back(LocalGradient(s, layout, h.param_dtype(), w, {iter}));
      }
      const std::vector<double> r = ReducedShard(
          s, layout, local, sr, h.reduce_dtype(), AccumDType(s, h),
          h.gradient_predivide_factor(), h.gradient_postdivide_factor());
      if (acc.empty()) {
        acc = r;
      } else {
        for (size_t j = 0; j < acc.size(); ++j) {
          acc[j] = AddIn(AccumDType(s, h), acc[j], r[j]);
        }
      }
    }
    return acc;
  });
}

// Under no_sync the unsharded gradient accumulates locally and one
// reduction happens at the end.
TEST_P(ReduceGradTest, NoSyncAccumulatesUnsharded) {
  const Scenario s = MakeScenario();
  FLATPARAM_ASSERT_OK_AND_ASSIGN(FlatParamLayout layout, MakeLayout(s));
  RunAndCheck(s, {false, false, true}, [&](const FlatParamHandle& h, int sr) {
    std::vector<std::vector<double>> local;
    for (int w = 0; w < s.world_size(); ++w) {
      local.push_back(LocalGradient(s, layout, h.param_dtype(), w, {0, 1, 2}));
    }
    return ReducedShard(s, layout, local, sr, h.reduce_dtype(),
                        AccumDType(s, h), h.gradient_predivide_factor(),
                        h.gradient_postdivide_factor());
  });
}

// A synchronized iteration, then no_sync, then a synchronizing one: the
// second reduction adds to the first.
TEST_P(ReduceGradTest, SyncThenNoSyncThenSync) {
  const Scenario s = MakeScenario();
  FLATPARAM_ASSERT_OK_AND_ASSIGN(FlatParamLayout layout, MakeLayout(s));
  RunAndCheck(s, {true, false, true}, [&](const FlatParamHandle& h, int sr) {
    std::vector<std::vector<double>> first, rest;
    for (int w = 0; w < s.world_size(); ++w) {
      first.push_back(LocalGradient(s, layout, h.param_dtype(), w, {0}));
      rest.push_back(LocalGradient(s, layout, h.param_dtype(), w, {1, 2}));
    }
    const auto args = std::make_tuple(h.reduce_dtype(), AccumDType(s, h),
                                      h.gradient_predivide_factor(),
                                      h.gradient_postdivide_factor());
    std::vector<double> a =
        ReducedShard(s, layout, first, sr, std::get<0>(args), std::get<1>(args),
                     std::get<2>(args), std::get<3>(args));
    const std::vector<double> b =
        ReducedShard(s, layout, rest, sr, std::get<0>(args), std::get<1>(args),
                     std::get<2>(args), std::get<3>(args));
    for (size_t j = 0; j < a.size(); ++j) {
      a[j] = AddIn(AccumDType(s, h), a[j], b[j]);
    }
    return a;
  });
}

std::vector<GradCase> GradCases() {
  std::vector<GradCase> cases;
  for (ShardingStrategy strategy : kAllStrategies) {
    for (int shard : {1, 3, 4}) {
      cases.push_back(
          {strategy, shard, DType::kFloat32, true, false, shard == 3});
    }
    cases.push_back({strategy, 2, DType::kFloat64, true, false, false});
    cases.push_back({strategy, 3, DType::kBFloat16, true, false, true});
    cases.push_back({strategy, 4, DType::kFloat16, true, false, false});
    cases.push_back({strategy, 3, DType::kFloat32, true, true, false});
    cases.push_back({strategy, 4, DType::kBFloat16, true, true, false});
  }
  // World size 6: predivide 4, postdivide 1.5 (not a power of two).
  cases.push_back(
      {ShardingStrategy::kFullShard, 6, DType::kFloat32, true, false, false});
  cases.push_back(
      {ShardingStrategy::kNoShard, 6, DType::kBFloat16, true, false, false});
  return cases;
}

std::string GradName(const ::testing::TestParamInfo<GradCase>& info) {
  const GradCase& c = info.param;
  return absl::StrCat(ShardingStrategyName(c.strategy), "_W", c.shard_size, "_",
                      DTypeName(c.dtype),
                      c.in_collectives ? "_in_collectives" : "",
                      c.align ? "_aligned" : "");
}

INSTANTIATE_TEST_SUITE_P(AllStrategies, ReduceGradTest,
                         ::testing::ValuesIn(GradCases()), GradName);

// Hybrid sharding on 2 nodes x 4 ranks gives the same gradient as
// FULL_SHARD over 8 ranks when every sum is exact: both divide by the
// factors of the 8-rank data-parallel world.
TEST(HybridShardTest, MatchesFullShardOverTheWholeWorldWhenExact) {
  auto full_gradient = [](const Scenario& s,
                          std::vector<double>* full) -> absl::Status {
    FLATPARAM_ASSIGN_OR_RETURN(FlatParamLayout layout, MakeLayout(s));
    std::vector<std::vector<double>> shards(s.world_size());
    FLATPARAM_RETURN_IF_ERROR(
        RunWithHandles(s, [&](RankContext& ctx) -> absl::Status {
          EXPECT_EQ(ctx.handle.data_parallel_world_size(), 8);
          EXPECT_EQ(ctx.handle.gradient_predivide_factor(), 4);
          EXPECT_EQ(ctx.handle.gradient_postdivide_factor(), 2);
          FLATPARAM_RETURN_IF_ERROR(RunIteration(s, ctx, 0, true));
          shards[ctx.world_rank] = ReadValues(*ctx.handle.sharded_grad());
          return absl::OkStatus();
        }));
    // Replicas hold equal shards; concatenate the first node's.
    for (int r = 0; r < s.world_size(); ++r) {
      const int shard_rank = r % s.shard_size;
      const int replica = r / s.shard_size;
      EXPECT_EQ(shards[r], shards[shard_rank]) << "replica " << replica;
    }
    full->clear();
    for (int r = 0; r < s.shard_size; ++r) {
      full->insert(full->end(), shards[r].begin(), shards[r].end());
    }
    full->resize(layout.unpadded_unsharded_numel());
    return absl::OkStatus();
  };
  Scenario hybrid = Make(ShardingStrategy::kHybridShard, 4, /*align=*/true);
  hybrid.specs = FrozenSpecs();
  hybrid.replicate_size = 2;
  Scenario full = hybrid;
  full.strategy = ShardingStrategy::kFullShard;
  full.shard_size = 8;
  full.replicate_size = 1;
  std::vector<double> a, b;
  ASSERT_THAT(full_gradient(hybrid, &a), IsOk());
  ASSERT_THAT(full_gradient(full, &b), IsOk());
  EXPECT_EQ(a, b);
  Scenario zero2 = hybrid;
  zero2.strategy = ShardingStrategy::kHybridShardZero2;
  std::vector<double> c;
  ASSERT_THAT(full_gradient(zero2, &c), IsOk());
  EXPECT_EQ(c, b);
}

// ---------------------------------------------------------------------------
// Frozen parameters and None gradients.

TEST(FrozenParamsTest, GetNoGradientContribution) {
  Scenario s = Make(ShardingStrategy::kFullShard, 3, /*align=*/true);
  s.specs = FrozenSpecs();
  FLATPARAM_ASSERT_OK_AND_ASSIGN(FlatParamLayout layout, MakeLayout(s));
  const int frozen = 2;
  ASSERT_FALSE(layout.params()[frozen].requires_grad);
  std::vector<std::vector<double>> got(3);
  ASSERT_THAT(
      RunWithHandles(
          s,
          [&](RankContext& ctx) -> absl::Status {
            FlatParamHandle& h = ctx.handle;
            FLATPARAM_RETURN_IF_ERROR(h.PreForward());
            FLATPARAM_RETURN_IF_ERROR(h.PostForward());
            FLATPARAM_RETURN_IF_ERROR(h.PreBackward());
            EXPECT_THAT(h.GradView(frozen),
                        StatusIs(absl::StatusCode::kFailedPrecondition,
                                 HasSubstr("frozen.w")));
            // A backward that writes everywhere, padding and frozen
            // segments included.
            BufferRef g = *h.unsharded_grad();
            WriteValues(g, std::vector<double>(g.count, 1.0));
            FLATPARAM_RETURN_IF_ERROR(h.PostBackward());
            FLATPARAM_RETURN_IF_ERROR(h.FinalizeBackward());
            got[ctx.world_rank] = ReadValues(*h.sharded_grad());
            FLATPARAM_ASSIGN_OR_RETURN(std::optional<BufferRef> view,
                                       h.ShardedGradView(frozen));
            EXPECT_FALSE(view.has_value());
            for (int i = 0; i < static_cast<int>(layout.params().size()); ++i) {
              FLATPARAM_ASSIGN_OR_RETURN(std::optional<BufferRef> v,
                                         h.ShardedGradView(i));
              const ShardParamInfo info = layout.shard_param_info(h.rank(), i);
              EXPECT_EQ(v.has_value(),
                        info.in_shard && layout.params()[i].requires_grad)
                  << i;
              // Each rank contributed 1, divided by 3 overall.
              if (v.has_value() && v->count > 0) {
                EXPECT_EQ(
                    ReadValues(*v),
                    std::vector<double>(v->count, RoundTo(DType::kFloat32,
                                                          3.0f / 2.0f / 1.5f)));
              }
            }
            return absl::OkStatus();
          }),
      IsOk());
  // Assemble and check: 1 for parameters that require grad, 0 elsewhere.
  std::vector<double> full;
  for (const auto& g : got) full.insert(full.end(), g.begin(), g.end());
  std::vector<double> want(full.size(), 0.0);
  for (const ParamInfo& p : layout.params()) {
    if (!p.requires_grad) continue;
    for (int64_t k = 0; k < p.numel; ++k) {
      want[p.offset + k] = RoundTo(DType::kFloat32, 3.0f / 2.0f / 1.5f);
    }
  }
  EXPECT_EQ(full, want);
}

TEST(FrozenParamsTest, AllFrozenUnitHasNoGradient) {
  Scenario s = Make(ShardingStrategy::kFullShard, 2);
  for (ParamSpec& p : s.specs) p.requires_grad = false;
  std::unique_ptr<SimWorld> world;
  ASSERT_THAT(RunWithHandles(
                  s,
                  [&](RankContext& ctx) -> absl::Status {
                    FlatParamHandle& h = ctx.handle;
                    FLATPARAM_RETURN_IF_ERROR(h.PreForward());
                    FLATPARAM_RETURN_IF_ERROR(h.PostForward());
                    FLATPARAM_RETURN_IF_ERROR(h.PreBackward());
                    EXPECT_FALSE(h.unsharded_grad().has_value());
                    EXPECT_THAT(h.ReduceGrad(),
                                StatusIs(absl::StatusCode::kFailedPrecondition,
                                         HasSubstr("no unsharded gradient")));
                    FLATPARAM_RETURN_IF_ERROR(h.PostBackward());
                    FLATPARAM_RETURN_IF_ERROR(h.FinalizeBackward());
                    EXPECT_FALSE(h.sharded_grad().has_value());
                    EXPECT_EQ(
                        h.memory().current_bytes(MemoryCategory::kShardedGrads),
                        0);
                    return absl::OkStatus();
                  },
                  &world),
              IsOk());
  EXPECT_EQ(CountOps(*world, 0, "reduce_scatter"), 0);
}

TEST(NoneGradTest, ZeroGradSetsToNoneOrZeroes) {
  for (ShardingStrategy strategy : kAllStrategies) {
    for (bool offload : {false, true}) {
      Scenario s = Make(strategy, 2);
      s.options.cpu_offload = offload;
      FLATPARAM_ASSERT_OK_AND_ASSIGN(FlatParamLayout layout, MakeLayout(s));
      std::vector<std::vector<double>> got(s.world_size());
      ASSERT_THAT(
          RunWithHandles(
              s,
              [&](RankContext& ctx) -> absl::Status {
                FlatParamHandle& h = ctx.handle;
                EXPECT_FALSE(h.sharded_grad().has_value());
                FLATPARAM_ASSIGN_OR_RETURN(std::optional<BufferRef> v,
                                           h.ShardedGradView(0));
                EXPECT_FALSE(v.has_value());
                FLATPARAM_RETURN_IF_ERROR(RunIteration(s, ctx, 0, true));
                EXPECT_TRUE(h.sharded_grad().has_value());
                FLATPARAM_RETURN_IF_ERROR(h.ZeroGrad(/*set_to_none=*/false));
                EXPECT_TRUE(h.sharded_grad().has_value());
                const std::vector<double> zeros = ReadValues(*h.sharded_grad());
                EXPECT_EQ(zeros, std::vector<double>(zeros.size(), 0.0));
                FLATPARAM_RETURN_IF_ERROR(h.ZeroGrad(/*set_to_none=*/true));
                EXPECT_FALSE(h.sharded_grad().has_value());
                // A None gradient is assigned, not added to.
                FLATPARAM_RETURN_IF_ERROR(RunIteration(s, ctx, 1, true));
                got[ctx.world_rank] = ReadValues(*h.sharded_grad());
                // No-sync gradients are dropped by set_to_none too.
                FLATPARAM_RETURN_IF_ERROR(RunIteration(s, ctx, 2, false));
                EXPECT_TRUE(h.unsharded_grad().has_value());
                FLATPARAM_RETURN_IF_ERROR(h.ZeroGrad());
                EXPECT_FALSE(h.unsharded_grad().has_value());
                EXPECT_EQ(
                    h.memory().current_bytes(MemoryCategory::kUnshardedGrads),
                    0);
                return absl::OkStatus();
              }),
          IsOk());
      for (int r = 0; r < s.world_size(); ++r) {
        std::vector<std::vector<double>> local;
        for (int w = 0; w < s.world_size(); ++w) {
          local.push_back(LocalGradient(s, layout, DType::kFloat32, w, {1}));
        }
        const double pre = GradientPredivideFactor(s.world_size());
        EXPECT_EQ(got[r], ReducedShard(s, layout, local, r % s.shard_size,
                                       DType::kFloat32, DType::kFloat32, pre,
                                       s.world_size() / pre))
            << ShardingStrategyName(strategy) << " offload " << offload;
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Mixed precision.

struct MixedCase {
  ShardingStrategy strategy;
  DType param_dtype;
  std::optional<DType> reduce_dtype;
  bool keep_low;
  bool offload;
};

class MixedPrecisionTest : public ::testing::TestWithParam<MixedCase> {};

TEST_P(MixedPrecisionTest, RoundsLikePyTorch) {
  const MixedCase c = GetParam();
  Scenario s = Make(c.strategy, 3, /*align=*/true);
  s.specs = FrozenSpecs();
  s.rounding_values = true;
  s.options.param_dtype = c.param_dtype;
  s.options.reduce_dtype = c.reduce_dtype;
  s.options.keep_low_precision_grads = c.keep_low;
  s.options.cpu_offload = c.offload;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(FlatParamLayout layout, MakeLayout(s));
  const DType reduce = c.reduce_dtype.value_or(c.param_dtype);
  std::vector<std::vector<double>> after1(s.world_size()),
      after2(s.world_size());
  std::vector<DType> dtype1(s.world_size()), dtype2(s.world_size());
  ASSERT_THAT(
      RunWithHandles(
          s,
          [&](RankContext& ctx) -> absl::Status {
            FlatParamHandle& h = ctx.handle;
            EXPECT_EQ(h.param_dtype(), c.param_dtype);
            EXPECT_EQ(h.reduce_dtype(), reduce);
            EXPECT_TRUE(h.uses_param_mixed_precision());
            FLATPARAM_RETURN_IF_ERROR(h.PreForward());
            for (int i = 0; i < static_cast<int>(layout.params().size()); ++i) {
              FLATPARAM_ASSIGN_OR_RETURN(OrigParamView v, h.Param(i));
              EXPECT_EQ(v.data.dtype, c.param_dtype);
              std::vector<double> want;
              for (int64_t k = 0; k < v.data.count; ++k) {
                want.push_back(RoundTo(c.param_dtype, InitialValue(s, i, k)));
              }
              EXPECT_EQ(ReadValues(v.data), want) << i;
            }
            // The low-precision shard is freed once gathered (kept as the
            // unsharded parameter for NO_SHARD).
            EXPECT_EQ(
                h.memory().current_bytes(MemoryCategory::kLowPrecisionParams),
                UsesShardedStrategy(c.strategy)
                    ? 0
                    : layout.sharded_numel() * DTypeSize(c.param_dtype));
            EXPECT_EQ(
                h.memory().peak_bytes(MemoryCategory::kLowPrecisionParams),
                layout.sharded_numel() * DTypeSize(c.param_dtype));
            FLATPARAM_RETURN_IF_ERROR(h.PostForward());
            EXPECT_EQ(
                h.memory().current_bytes(MemoryCategory::kLowPrecisionParams),
                0);
            FLATPARAM_RETURN_IF_ERROR(h.PreBackward());
            FLATPARAM_RETURN_IF_ERROR(AddGradients(s, ctx, 0));
            EXPECT_EQ(h.unsharded_grad()->dtype, c.param_dtype);
            FLATPARAM_RETURN_IF_ERROR(h.PostBackward());
            FLATPARAM_RETURN_IF_ERROR(h.FinalizeBackward());
            dtype1[ctx.world_rank] = h.sharded_grad()->dtype;
            after1[ctx.world_rank] = ReadValues(*h.sharded_grad());
            FLATPARAM_RETURN_IF_ERROR(RunIteration(s, ctx, 1, true));
            dtype2[ctx.world_rank] = h.sharded_grad()->dtype;
            after2[ctx.world_rank] = ReadValues(*h.sharded_grad());
            return absl::OkStatus();
          }),
      IsOk());
  const int world = s.world_size();
  const double pre = GradientPredivideFactor(world);
  const bool no_shard = c.strategy == ShardingStrategy::kNoShard;
  // NO_SHARD with keep_low_precision_grads keeps the reduced dtype.
  const DType accum =
      no_shard && c.keep_low && !c.offload ? reduce : DType::kFloat32;
  // keep_low casts to param_dtype for the optimizer, except NO_SHARD without
  // offload, which PyTorch leaves in the reduce dtype
  // (`prepare_gradient_for_optim` has no gradient to cast there).
  const DType exposed =
      c.keep_low && !(no_shard && !c.offload) ? c.param_dtype : accum;
  for (int r = 0; r < world; ++r) {
    auto reduced = [&](int iter) {
      std::vector<std::vector<double>> local;
      for (int w = 0; w < world; ++w) {
        local.push_back(LocalGradient(s, layout, c.param_dtype, w, {iter}));
      }
      return ReducedShard(s, layout, local, r % s.shard_size, reduce, accum,
                          pre, world / pre);
    };
    std::vector<double> e1 = reduced(0);
    const std::vector<double> r2 = reduced(1);
    std::vector<double> e2(e1.size());
    for (size_t j = 0; j < e1.size(); ++j) {
      // keep_low: the gradient went to param_dtype after the first
      // backward and comes back from there to accumulate.
      const double kept = RoundTo(exposed, e1[j]);
      e2[j] = RoundTo(exposed, AddIn(accum, kept, r2[j]));
      e1[j] = kept;
    }
    EXPECT_EQ(dtype1[r], exposed);
    EXPECT_EQ(dtype2[r], exposed);
    EXPECT_EQ(after1[r], e1) << "rank " << r;
    EXPECT_EQ(after2[r], e2) << "rank " << r;
  }
}

std::vector<MixedCase> MixedCases() {
  std::vector<MixedCase> cases;
  for (ShardingStrategy strategy : kAllStrategies) {
    for (bool keep_low : {false, true}) {
      cases.push_back(
          {strategy, DType::kBFloat16, std::nullopt, keep_low, false});
      cases.push_back(
          {strategy, DType::kFloat16, DType::kFloat32, keep_low, false});
      cases.push_back(
          {strategy, DType::kBFloat16, std::nullopt, keep_low, true});
    }
  }
  return cases;
}

std::string MixedName(const ::testing::TestParamInfo<MixedCase>& info) {
  const MixedCase& c = info.param;
  return absl::StrCat(
      ShardingStrategyName(c.strategy), "_", DTypeName(c.param_dtype), "_",
      c.reduce_dtype ? DTypeName(*c.reduce_dtype) : "inferred",
      c.keep_low ? "_keep_low" : "", c.offload ? "_offload" : "");
}

INSTANTIATE_TEST_SUITE_P(AllStrategies, MixedPrecisionTest,
                         ::testing::ValuesIn(MixedCases()), MixedName);

// The pre-divide keeps float16 partial sums finite: four ranks' 20000 sum
// to 80000 > 65504, but pre-divided by 2 they sum to 40000.
TEST(Float16ReduceTest, PredivideAvoidsFloat16Overflow) {
  Scenario s = Make(ShardingStrategy::kFullShard, 4);
  s.specs = {{"w", {8}}};
  s.options.param_dtype = DType::kFloat16;
  std::vector<std::vector<double>> got(4);
  ASSERT_THAT(
      RunWithHandles(s,
                     [&](RankContext& ctx) -> absl::Status {
                       FlatParamHandle& h = ctx.handle;
                       EXPECT_EQ(h.gradient_predivide_factor(), 2);
                       EXPECT_EQ(h.gradient_postdivide_factor(), 2);
                       FLATPARAM_RETURN_IF_ERROR(h.PreForward());
                       FLATPARAM_RETURN_IF_ERROR(h.PostForward());
                       FLATPARAM_RETURN_IF_ERROR(h.PreBackward());
                       std::vector<float> g(8, 20000.0f);
                       FLATPARAM_RETURN_IF_ERROR(h.AccumulateGrad(
                           0, ConstBufferRef{g.data(), 8, DType::kFloat32,
                                             Device::Host()}));
                       FLATPARAM_RETURN_IF_ERROR(h.PostBackward());
                       FLATPARAM_RETURN_IF_ERROR(h.FinalizeBackward());
                       got[ctx.world_rank] = ReadValues(*h.sharded_grad());
                       return absl::OkStatus();
                     }),
      IsOk());
  for (const auto& g : got) {
    EXPECT_EQ(g, std::vector<double>(2, 20000.0));
  }
}

// ---------------------------------------------------------------------------
// CPU offload: the same numbers as without it, with the shard and the
// sharded gradient in offloaded memory. (On this machine the compute device
// is the host, so this exercises the code path and the accounting, not real
// transfers.)

TEST(CpuOffloadTest, MatchesNoOffloadAndAccountsOffloadedMemory) {
  for (ShardingStrategy strategy : kAllStrategies) {
    for (bool mixed : {false, true}) {
      Scenario base = Make(strategy, 3, /*align=*/true);
      base.specs = FrozenSpecs();
      base.rounding_values = true;
      if (mixed) base.options.param_dtype = DType::kBFloat16;
      Scenario offload = base;
      offload.options.cpu_offload = true;
      FLATPARAM_ASSERT_OK_AND_ASSIGN(FlatParamLayout layout, MakeLayout(base));
      const int64_t shard_bytes = layout.sharded_numel() * 4;
      auto run = [&](const Scenario& s,
                     std::vector<std::vector<double>>* grads) {
        grads->assign(s.world_size(), {});
        return RunWithHandles(s, [&](RankContext& ctx) -> absl::Status {
          FlatParamHandle& h = ctx.handle;
          if (s.options.cpu_offload) {
            // The local shard and `_cpu_grad` (allocated up front).
            EXPECT_EQ(h.memory().offload_current, 2 * shard_bytes);
            EXPECT_EQ(h.memory().compute_current, 0);
          }
          FLATPARAM_RETURN_IF_ERROR(RunIteration(s, ctx, 0, true));
          FLATPARAM_RETURN_IF_ERROR(RunIteration(s, ctx, 1, false));
          FLATPARAM_RETURN_IF_ERROR(RunIteration(s, ctx, 2, true));
          FLATPARAM_RETURN_IF_ERROR(RunIteration(s, ctx, 3, true));
          (*grads)[ctx.world_rank] = ReadValues(*h.sharded_grad());
          if (s.options.cpu_offload) {
            EXPECT_EQ(h.memory().offload_current, 2 * shard_bytes);
            EXPECT_EQ(h.memory().compute_current, 0);
            EXPECT_GT(h.memory().compute_peak, 0);
          }
          return absl::OkStatus();
        });
      };
      std::vector<std::vector<double>> want, got;
      ASSERT_THAT(run(base, &want), IsOk());
      ASSERT_THAT(run(offload, &got), IsOk());
      EXPECT_EQ(got, want) << ShardingStrategyName(strategy) << " mixed "
                           << mixed;
    }
  }
}

// A compute device that is not the host (host memory labelled cuda:0):
// buffers are where the documentation says, host <-> device copies happen
// where offload needs them, and the numbers equal the host run's.
TEST(FakeDeviceTest, PlacementAndCopiesMatchAHostRun) {
  for (ShardingStrategy strategy : kAllStrategies) {
    for (bool offload : {false, true}) {
      for (bool mixed : {false, true}) {
        Scenario base = Make(strategy, 3, /*align=*/true);
        base.specs = FrozenSpecs();
        base.rounding_values = true;
        base.options.cpu_offload = offload;
        if (mixed) base.options.param_dtype = DType::kBFloat16;
        Scenario fake = base;
        fake.fake_device = true;
        const Device shard_device = offload ? Device::Host() : Device::Cuda(0);
        auto run = [&](const Scenario& s,
                       std::vector<std::vector<double>>* grads,
                       std::vector<std::vector<unsigned char>>* shards) {
          grads->assign(s.world_size(), {});
          shards->assign(s.world_size(), {});
          return RunWithHandles(s, [&](RankContext& ctx) -> absl::Status {
            FlatParamHandle& h = ctx.handle;
            const Device compute = ctx.ops.device();
            const Device shard = s.fake_device ? shard_device : compute;
            EXPECT_EQ(h.sharded_param().device, shard);
            FLATPARAM_RETURN_IF_ERROR(RunIteration(s, ctx, 0, true));
            FLATPARAM_RETURN_IF_ERROR(RunIteration(s, ctx, 1, false));
            // Unsharding copies the shard to the device only with offload,
            // and only when it gathers (after no_sync, SHARD_GRAD_OP and
            // HYBRID_SHARD_ZERO2 still hold the unsharded parameter).
            const auto* fake_ops =
                s.fake_device
                    ? static_cast<testing_handle::FakeCudaDeviceOps*>(&ctx.ops)
                    : nullptr;
            const int64_t h2d = fake_ops ? fake_ops->host_to_device : 0;
            FLATPARAM_RETURN_IF_ERROR(h.PreForward());
            if (fake_ops != nullptr) {
              EXPECT_EQ(fake_ops->host_to_device > h2d,
                        offload && (strategy == ShardingStrategy::kNoShard ||
                                    FreesAfterForward(strategy)));
            }
            FLATPARAM_ASSIGN_OR_RETURN(OrigParamView v, h.Param(0));
            EXPECT_EQ(v.data.device, compute);
            FLATPARAM_RETURN_IF_ERROR(h.PostForward());
            FLATPARAM_ASSIGN_OR_RETURN(v, h.Param(0));
            EXPECT_EQ(v.data.device, shard);
            FLATPARAM_RETURN_IF_ERROR(h.PreBackward());
            EXPECT_EQ(h.unsharded_grad()->device, compute);
            FLATPARAM_RETURN_IF_ERROR(AddGradients(s, ctx, 2));
            FLATPARAM_RETURN_IF_ERROR(h.PostBackward());
            FLATPARAM_RETURN_IF_ERROR(h.FinalizeBackward());
            EXPECT_EQ(h.sharded_grad()->device, shard);
            (*grads)[ctx.world_rank] = ReadValues(*h.sharded_grad());
            // Summon and write back: negate everything.
            FLATPARAM_RETURN_IF_ERROR(h.BeginSummonFullParams(true));
            for (int i = 0; i < static_cast<int>(ctx.layout.params().size());
                 ++i) {
              FLATPARAM_ASSIGN_OR_RETURN(OrigParamView p, h.Param(i));
              EXPECT_EQ(p.data.device, compute);
              std::vector<double> x = ReadValues(p.data);
              for (double& e : x) e = -e;
              WriteValues(p.data, x);
            }
            FLATPARAM_RETURN_IF_ERROR(h.EndSummonFullParams());
            (*shards)[ctx.world_rank] = Bytes(h.sharded_param());
            if (fake_ops != nullptr) {
              // Gradients and written-back parameters come back to the host
              // only with offload.
              EXPECT_EQ(fake_ops->device_to_host > 0, offload);
              EXPECT_EQ(h.memory().offload_current > 0, offload);
            }
            return absl::OkStatus();
          });
        };
        std::vector<std::vector<double>> want_grads, got_grads;
        std::vector<std::vector<unsigned char>> want_shards, got_shards;
        ASSERT_THAT(run(base, &want_grads, &want_shards), IsOk());
        ASSERT_THAT(run(fake, &got_grads, &got_shards), IsOk())
            << fake.Options();
        EXPECT_EQ(got_grads, want_grads) << fake.Options();
        EXPECT_EQ(got_shards, want_shards) << fake.Options();
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Summon full parameters.

struct SummonCase {
  ShardingStrategy strategy;
  bool mixed;
  bool offload;
  bool writeback;
};

class SummonTest : public ::testing::TestWithParam<SummonCase> {};

TEST_P(SummonTest, WritesBackToEveryRanksShard) {
  const SummonCase c = GetParam();
  Scenario s = Make(c.strategy, 3, /*align=*/true);
  s.rounding_values = true;
  if (c.mixed) s.options.param_dtype = DType::kBFloat16;
  s.options.cpu_offload = c.offload;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(FlatParamLayout layout, MakeLayout(s));
  const std::vector<HostTensor> original = InitialParams(s, layout);
  std::vector<HostTensor> modified = original;
  for (HostTensor& t : modified) {
    for (int64_t k = 0; k < t.numel(); ++k) {
      t.SetDouble(k, t.GetDouble(k) * 2 + 0.1);
    }
  }
  // NO_SHARD without offload summons the local shard itself.
  const bool persists =
      c.writeback || (c.strategy == ShardingStrategy::kNoShard && !c.offload);
  const std::vector<HostTensor>& expected = persists ? modified : original;
  std::vector<ConstBufferRef> refs;
  for (const HostTensor& t : expected) refs.push_back(t.cref());

  ASSERT_THAT(
      RunWithHandles(
          s,
          [&](RankContext& ctx) -> absl::Status {
            FlatParamHandle& h = ctx.handle;
            // A training iteration first, so that the low-precision state
            // exists.
            FLATPARAM_RETURN_IF_ERROR(RunIteration(s, ctx, 0, true));
            FLATPARAM_RETURN_IF_ERROR(h.BeginSummonFullParams(c.writeback));
            EXPECT_EQ(h.training_state(),
                      HandleTrainingState::kSummonFullParams);
            for (int i = 0; i < static_cast<int>(layout.params().size()); ++i) {
              FLATPARAM_ASSIGN_OR_RETURN(OrigParamView v, h.Param(i));
              // Full precision, whatever the mixed precision.
              EXPECT_EQ(v.data.dtype, DType::kFloat32);
              EXPECT_FALSE(v.sharded);
              EXPECT_EQ(ReadValues(v.data),
                        ReadValues(ConstBufferRef{
                            original[i].data(), original[i].numel(),
                            DType::kFloat32, Device::Host()}));
              WriteValues(v.data, ReadValues(ConstBufferRef{
                                      modified[i].data(), modified[i].numel(),
                                      DType::kFloat32, Device::Host()}));
            }
            FLATPARAM_RETURN_IF_ERROR(h.EndSummonFullParams());
            EXPECT_EQ(h.training_state(), HandleTrainingState::kIdle);
            EXPECT_FALSE(h.is_unsharded());
            EXPECT_EQ(
                h.memory().current_bytes(MemoryCategory::kUnshardedParams), 0);
            HostTensor want =
                HostTensor::Flat(layout.dtype(), layout.sharded_numel());
            FLATPARAM_RETURN_IF_ERROR(
                FlattenShard(layout, refs, h.rank(), want.ref()));
            EXPECT_EQ(Bytes(h.sharded_param()),
                      Bytes(ConstBufferRef{want.data(), want.numel(),
                                           want.dtype(), Device::Host()}))
                << "rank " << h.rank();
            // Every rank sees the result in the next forward.
            FLATPARAM_RETURN_IF_ERROR(h.PreForward());
            for (int i = 0; i < static_cast<int>(layout.params().size()); ++i) {
              FLATPARAM_ASSIGN_OR_RETURN(OrigParamView v, h.Param(i));
              std::vector<double> w;
              for (int64_t k = 0; k < expected[i].numel(); ++k) {
                w.push_back(RoundTo(v.data.dtype, expected[i].GetDouble(k)));
              }
              EXPECT_EQ(ReadValues(v.data), w);
            }
            return h.PostForward();
          }),
      IsOk());
}

std::vector<SummonCase> SummonCases() {
  std::vector<SummonCase> cases;
  for (ShardingStrategy strategy : kAllStrategies) {
    for (bool mixed : {false, true}) {
      for (bool offload : {false, true}) {
        for (bool writeback : {false, true}) {
          cases.push_back({strategy, mixed, offload, writeback});
        }
      }
    }
  }
  return cases;
}

std::string SummonName(const ::testing::TestParamInfo<SummonCase>& info) {
  const SummonCase& c = info.param;
  return absl::StrCat(ShardingStrategyName(c.strategy), c.mixed ? "_bf16" : "",
                      c.offload ? "_offload" : "",
                      c.writeback ? "_writeback" : "_discard");
}

INSTANTIATE_TEST_SUITE_P(AllStrategies, SummonTest,
                         ::testing::ValuesIn(SummonCases()), SummonName);

// SHARD_GRAD_OP keeps the unsharded parameter after forward; summoning in
// between must not free it, and must reuse it without an all-gather.
TEST(SummonReuseTest, ReusesAKeptUnshardedParameter) {
  Scenario s = Make(ShardingStrategy::kShardGradOp, 2);
  std::unique_ptr<SimWorld> world;
  ASSERT_THAT(RunWithHandles(
                  s,
                  [&](RankContext& ctx) -> absl::Status {
                    FlatParamHandle& h = ctx.handle;
                    FLATPARAM_RETURN_IF_ERROR(h.PreForward());
                    FLATPARAM_RETURN_IF_ERROR(h.PostForward());
                    EXPECT_FALSE(h.NeedsUnshard());
                    FLATPARAM_RETURN_IF_ERROR(h.BeginSummonFullParams(false));
                    FLATPARAM_RETURN_IF_ERROR(h.EndSummonFullParams());
                    EXPECT_FALSE(h.NeedsUnshard());
                    FLATPARAM_RETURN_IF_ERROR(h.PreBackward());
                    FLATPARAM_RETURN_IF_ERROR(h.PostBackward());
                    return h.FinalizeBackward();
                  },
                  &world),
              IsOk());
  EXPECT_EQ(CountOps(*world, 0, "all_gather"), 1);
}

// ---------------------------------------------------------------------------
// Memory accounting against the per-strategy formula (float32, no mixed
// precision): S = shard numel, P = padded unsharded numel, U = unpadded.

class MemoryTest : public ::testing::TestWithParam<ShardingStrategy> {};

TEST_P(MemoryTest, CurrentAndPeakFollowTheFormula) {
  const ShardingStrategy strategy = GetParam();
  Scenario s = Make(strategy, 3, /*align=*/true);
  s.specs = FrozenSpecs();
  FLATPARAM_ASSERT_OK_AND_ASSIGN(FlatParamLayout layout, MakeLayout(s));
  const bool sharded = UsesShardedStrategy(strategy);
  const int64_t S = layout.sharded_numel() * 4;
  const int64_t P = layout.padded_unsharded_numel() * 4;
  const int64_t U = layout.unpadded_unsharded_numel() * 4;
  const int64_t unsharded_params = sharded ? P : 0;
  const int64_t unsharded_grads = sharded ? P : U;
  using C = MemoryCategory;
  ASSERT_THAT(
      RunWithHandles(
          s,
          [&](RankContext& ctx) -> absl::Status {
            FlatParamHandle& h = ctx.handle;
            auto cur = [&](C c) { return h.memory().current_bytes(c); };
            auto peak = [&](C c) { return h.memory().peak_bytes(c); };
            EXPECT_EQ(cur(C::kShardedParams), S);
            EXPECT_EQ(h.memory().compute_current, S);
            FLATPARAM_RETURN_IF_ERROR(h.PreForward());
            EXPECT_EQ(cur(C::kUnshardedParams), unsharded_params);
            FLATPARAM_RETURN_IF_ERROR(h.PostForward());
            EXPECT_EQ(cur(C::kUnshardedParams),
                      FreesAfterForward(strategy) ? 0 : unsharded_params);
            FLATPARAM_RETURN_IF_ERROR(h.PreBackward());
            EXPECT_EQ(cur(C::kUnshardedParams), unsharded_params);
            EXPECT_EQ(cur(C::kUnshardedGrads), unsharded_grads);
            FLATPARAM_RETURN_IF_ERROR(AddGradients(s, ctx, 0));
            FLATPARAM_RETURN_IF_ERROR(h.PostBackward());
            FLATPARAM_RETURN_IF_ERROR(h.FinalizeBackward());
            EXPECT_EQ(cur(C::kUnshardedParams), 0);
            EXPECT_EQ(cur(C::kUnshardedGrads), 0);
            EXPECT_EQ(cur(C::kShardedGrads), S);
            EXPECT_EQ(peak(C::kShardedGrads), S);
            EXPECT_EQ(peak(C::kUnshardedParams), unsharded_params);
            EXPECT_EQ(peak(C::kUnshardedGrads), unsharded_grads);
            EXPECT_EQ(peak(C::kLowPrecisionParams), 0);
            // The peak is in the backward: shard + unsharded param + grad
            // (NO_SHARD: the gradient becomes the sharded gradient in place).
            EXPECT_EQ(h.memory().compute_peak,
                      S + unsharded_params + unsharded_grads);
            EXPECT_EQ(h.memory().compute_current, 2 * S);

            // A second iteration accumulates: the new sharded gradient
            // exists next to the old one for a moment.
            h.ResetPeakMemory();
            EXPECT_EQ(h.memory().compute_peak, 2 * S);
            FLATPARAM_RETURN_IF_ERROR(RunIteration(s, ctx, 1, true));
            EXPECT_EQ(peak(C::kShardedGrads), 2 * S);
            EXPECT_EQ(cur(C::kShardedGrads), S);
            EXPECT_EQ(h.memory().compute_peak,
                      2 * S + unsharded_params + unsharded_grads);

            // no_sync keeps the unsharded gradient (and, without resharding
            // after forward, the unsharded parameter) between iterations.
            FLATPARAM_RETURN_IF_ERROR(RunIteration(s, ctx, 2, false));
            EXPECT_EQ(cur(C::kUnshardedGrads), unsharded_grads);
            EXPECT_EQ(cur(C::kUnshardedParams),
                      FreesAfterForward(strategy) ? 0 : unsharded_params);
            FLATPARAM_RETURN_IF_ERROR(h.ZeroGrad());
            EXPECT_EQ(cur(C::kUnshardedGrads), 0);
            EXPECT_EQ(cur(C::kShardedGrads), 0);
            EXPECT_EQ(h.memory().offload_peak, 0);
            return absl::OkStatus();
          }),
      IsOk());
}

INSTANTIATE_TEST_SUITE_P(
    AllStrategies, MemoryTest, ::testing::ValuesIn(kAllStrategies),
    [](const ::testing::TestParamInfo<ShardingStrategy>& info) {
      return std::string(ShardingStrategyName(info.param));
    });

// Mixed precision (bfloat16 parameters, float32 reduction) adds the
// low-precision shard while gathering and casts in the reduction.
TEST(MixedPrecisionMemoryTest, FullShard) {
  Scenario s = Make(ShardingStrategy::kFullShard, 4);
  s.options.param_dtype = DType::kBFloat16;
  s.options.reduce_dtype = DType::kFloat32;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(FlatParamLayout layout, MakeLayout(s));
  const int64_t S = layout.sharded_numel();
  const int64_t P = layout.padded_unsharded_numel();
  using C = MemoryCategory;
  ASSERT_THAT(RunWithHandles(
                  s,
                  [&](RankContext& ctx) -> absl::Status {
                    FlatParamHandle& h = ctx.handle;
                    FLATPARAM_RETURN_IF_ERROR(RunIteration(s, ctx, 0, true));
                    const MemoryStats& m = h.memory();
                    EXPECT_EQ(m.peak_bytes(C::kLowPrecisionParams), S * 2);
                    EXPECT_EQ(m.peak_bytes(C::kUnshardedParams), P * 2);
                    // bf16 gradient, then its float32 copy.
                    EXPECT_EQ(m.peak_bytes(C::kUnshardedGrads), P * 2 + P * 4);
                    EXPECT_EQ(m.peak_bytes(C::kShardedGrads), S * 4);
                    EXPECT_EQ(m.current_bytes(C::kShardedGrads), S * 4);
                    // Peak: backward's cast of the gradient, after the
                    // parameter was freed: S*4 + P*2 + P*4; before it:
                    // S*4 + P*2 (param) + P*2 (grad).
                    EXPECT_EQ(m.compute_peak, S * 4 + P * 2 + P * 4);
                    return absl::OkStatus();
                  }),
              IsOk());
}

// ---------------------------------------------------------------------------
// Misuse: FailedPrecondition naming the state; the handle stays usable.

TEST(MisuseTest, EveryMisuseIsAFailedPreconditionAndHarmless) {
  for (ShardingStrategy strategy :
       {ShardingStrategy::kFullShard, ShardingStrategy::kNoShard,
        ShardingStrategy::kShardGradOp}) {
    Scenario s = Make(strategy, 2);
    std::vector<std::vector<double>> clean(2), misused(2);
    auto fp = [](absl::string_view state, absl::string_view text) {
      return StatusIs(
          absl::StatusCode::kFailedPrecondition,
          AllOf(HasSubstr(std::string(state)), HasSubstr(std::string(text))));
    };
    auto run = [&](bool misuse, std::vector<std::vector<double>>* out) {
      return RunWithHandles(s, [&](RankContext& ctx) -> absl::Status {
        FlatParamHandle& h = ctx.handle;
        if (misuse) {
          EXPECT_THAT(h.PostForward(), fp("IDLE", "PostForward requires"));
          EXPECT_THAT(h.PostBackward(), fp("IDLE", "PostBackward"));
          EXPECT_THAT(h.ReduceGrad(), fp("IDLE", "ReduceGrad"));
          EXPECT_THAT(h.GradView(0), fp("IDLE", "GradView"));
          EXPECT_THAT(h.Reshard(true), fp("IDLE", "not unsharded"));
          EXPECT_THAT(h.UnshardedParam(0), fp("IDLE", "a.w"));
          EXPECT_THAT(h.EndSummonFullParams(), fp("IDLE", "EndSummon"));
          // Unshard twice.
          FLATPARAM_RETURN_IF_ERROR(h.Unshard());
          EXPECT_THAT(h.Unshard(), fp("IDLE", "already unsharded"));
          EXPECT_THAT(h.SetTraining(false), fp("IDLE", "Reshard first"));
          EXPECT_THAT(h.BeginSummonFullParams(true),
                      fp("IDLE", "Reshard first"));
          FLATPARAM_RETURN_IF_ERROR(h.Reshard(true));
        }
        FLATPARAM_ASSIGN_OR_RETURN(OrigParamView sharded_view, h.Param(0));
        FLATPARAM_RETURN_IF_ERROR(h.CheckView(sharded_view));
        FLATPARAM_RETURN_IF_ERROR(h.PreForward());
        FLATPARAM_ASSIGN_OR_RETURN(OrigParamView view, h.UnshardedParam(0));
        // A sharded view taken before the unshard is stale too.
        EXPECT_THAT(h.CheckView(sharded_view),
                    fp("FORWARD", "sharded view from epoch"));
        if (misuse) {
          EXPECT_THAT(h.PreForward(), fp("FORWARD", "PreForward"));
          EXPECT_THAT(h.PreBackward(), fp("FORWARD", "PreBackward"));
          EXPECT_THAT(h.ZeroGrad(), fp("FORWARD", "ZeroGrad"));
          EXPECT_THAT(h.SetTraining(false), fp("FORWARD", "SetTraining"));
          EXPECT_THAT(h.BeginSummonFullParams(false),
                      fp("FORWARD", "BeginSummon"));
          EXPECT_THAT(h.Unshard(), fp("FORWARD", "already unsharded"));
          EXPECT_THAT(h.AccumulateGrad(0, ConstBufferRef{}),
                      fp("FORWARD", "GradView"));
        }
        FLATPARAM_RETURN_IF_ERROR(h.PostForward());
        if (misuse) {
          // Use of a view after reshard.
          EXPECT_THAT(h.CheckView(view), fp("IDLE", "stale"));
          EXPECT_THAT(h.UnshardedParam(0), fp("IDLE", "not unsharded"));
        }
        FLATPARAM_RETURN_IF_ERROR(h.PreBackward());
        if (misuse) {
          EXPECT_THAT(h.PreBackward(), fp("BACKWARD_PRE", "PreBackward"));
          EXPECT_THAT(h.Param(99), StatusIs(absl::StatusCode::kInvalidArgument,
                                            HasSubstr("99")));
          EXPECT_THAT(h.GradView(-1),
                      StatusIs(absl::StatusCode::kInvalidArgument));
          std::vector<float> wrong(2);
          EXPECT_THAT(h.AccumulateGrad(
                          0, ConstBufferRef{wrong.data(), 2, DType::kFloat32,
                                            Device::Host()}),
                      StatusIs(absl::StatusCode::kInvalidArgument,
                               HasSubstr("15 elements")));
        }
        FLATPARAM_RETURN_IF_ERROR(AddGradients(s, ctx, 0));
        FLATPARAM_RETURN_IF_ERROR(h.PostBackward());
        if (misuse) {
          EXPECT_THAT(h.PostBackward(), fp("BACKWARD_POST", "PostBackward"));
          // Reduce without a gradient: it was reduced already.
          EXPECT_THAT(h.ReduceGrad(),
                      fp("BACKWARD_POST", "no unsharded gradient"));
          EXPECT_THAT(h.GradView(0), fp("BACKWARD_POST", "GradView"));
          EXPECT_THAT(h.Reshard(false), fp("BACKWARD_POST", "not unsharded"));
        }
        FLATPARAM_RETURN_IF_ERROR(h.FinalizeBackward());
        FLATPARAM_RETURN_IF_ERROR(h.BeginSummonFullParams(false));
        if (misuse) {
          EXPECT_THAT(h.Reshard(true),
                      fp("SUMMON_FULL_PARAMS", "EndSummonFullParams"));
          EXPECT_THAT(h.Unshard(), fp("SUMMON_FULL_PARAMS", "Unshard"));
          EXPECT_THAT(h.BeginSummonFullParams(false),
                      fp("SUMMON_FULL_PARAMS", "BeginSummon"));
          EXPECT_THAT(h.PreForward(), fp("SUMMON_FULL_PARAMS", "PreForward"));
          EXPECT_THAT(h.FinalizeBackward(),
                      fp("SUMMON_FULL_PARAMS", "FinalizeBackward"));
        }
        FLATPARAM_RETURN_IF_ERROR(h.EndSummonFullParams());
        // A full second iteration after all that.
        FLATPARAM_RETURN_IF_ERROR(RunIteration(s, ctx, 1, true));
        (*out)[ctx.world_rank] = ReadValues(*h.sharded_grad());
        EXPECT_EQ(h.training_state(), HandleTrainingState::kIdle);
        return absl::OkStatus();
      });
    };
    ASSERT_THAT(run(false, &clean), IsOk());
    ASSERT_THAT(run(true, &misused), IsOk());
    EXPECT_EQ(misused, clean) << ShardingStrategyName(strategy);
  }
}

// ---------------------------------------------------------------------------
// Options PyTorch reads from the environment.

// FSDP_USE_FULL_PREC_IN_EVAL: eval mode unshards the full-precision
// parameter (PyTorch's `_force_full_precision`), training mode the
// param_dtype one; without the option eval keeps mixed precision.
TEST(EvalTest, FullPrecisionInEvalWhenAsked) {
  for (ShardingStrategy strategy :
       {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp,
        ShardingStrategy::kNoShard, ShardingStrategy::kHybridShard}) {
    for (bool full_in_eval : {false, true}) {
      Scenario s = Make(strategy, 2, /*align=*/true);
      s.rounding_values = true;
      s.options.param_dtype = DType::kBFloat16;
      s.options.use_full_prec_in_eval = full_in_eval;
      FLATPARAM_ASSERT_OK_AND_ASSIGN(FlatParamLayout layout, MakeLayout(s));
      const std::string label = absl::StrCat(ShardingStrategyName(strategy),
                                             full_in_eval ? " full" : " mixed");
      auto expect_params = [&](FlatParamHandle& h, DType dtype) {
        for (int i = 0; i < static_cast<int>(layout.params().size()); ++i) {
          absl::StatusOr<OrigParamView> v = h.Param(i);
          ASSERT_THAT(v, IsOk());
          EXPECT_EQ(v->data.dtype, dtype) << label << " param " << i;
          std::vector<double> want;
          for (int64_t k = 0; k < v->data.count; ++k) {
            want.push_back(RoundTo(dtype, InitialValue(s, i, k)));
          }
          EXPECT_EQ(ReadValues(v->data), want) << label << " param " << i;
        }
      };
      ASSERT_THAT(RunWithHandles(
                      s,
                      [&](RankContext& ctx) -> absl::Status {
                        FlatParamHandle& h = ctx.handle;
                        FLATPARAM_RETURN_IF_ERROR(h.SetTraining(false));
                        EXPECT_FALSE(h.training());
                        FLATPARAM_RETURN_IF_ERROR(h.PreForward());
                        expect_params(h, full_in_eval ? DType::kFloat32
                                                      : DType::kBFloat16);
                        FLATPARAM_RETURN_IF_ERROR(h.PostForward());
                        // Full precision in eval never makes the low-precision
                        // shard.
                        EXPECT_EQ(h.memory().peak_bytes(
                                      MemoryCategory::kLowPrecisionParams) == 0,
                                  full_in_eval)
                            << label;
                        FLATPARAM_RETURN_IF_ERROR(h.SetTraining(true));
                        FLATPARAM_RETURN_IF_ERROR(h.PreForward());
                        expect_params(h, DType::kBFloat16);
                        FLATPARAM_RETURN_IF_ERROR(h.PostForward());
                        // Back in eval after training: full precision again (a
                        // kept low-precision parameter is not reused).
                        FLATPARAM_RETURN_IF_ERROR(h.SetTraining(false));
                        FLATPARAM_RETURN_IF_ERROR(h.PreForward());
                        expect_params(h, full_in_eval ? DType::kFloat32
                                                      : DType::kBFloat16);
                        return h.PostForward();
                      }),
                  IsOk())
          << label;
    }
  }
}

// A backward in eval with forced full precision (use_full_prec_in_eval) is
// full precision throughout, as PyTorch skips its casts then: the gradient
// is computed, reduced and handed to the optimizer in float32, even with
// keep_low_precision_grads, bitwise what training without mixed precision
// gives.
TEST(EvalTest, GradientsInFullPrecisionEvalAreFullPrecision) {
  for (ShardingStrategy strategy :
       {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp,
        ShardingStrategy::kNoShard, ShardingStrategy::kHybridShard}) {
    for (bool keep_low : {false, true}) {
      const std::string label = absl::StrCat(ShardingStrategyName(strategy),
                                             keep_low ? " keep_low" : "");
      const auto run = [&](bool mixed, std::vector<std::vector<double>>* out,
                           std::vector<DType>* dtypes) {
        // Unaligned: the layout is then the same with and without mixed
        // precision (alignment pads for the compute dtype).
        Scenario s = Make(strategy, 2, /*align=*/false);
        if (s.hybrid()) s.replicate_size = 2;
        s.rounding_values = true;
        if (mixed) {
          s.options.param_dtype = DType::kBFloat16;
          s.options.use_full_prec_in_eval = true;
          s.options.keep_low_precision_grads = keep_low;
        }
        out->assign(s.world_size(), {});
        dtypes->assign(s.world_size(), DType::kFloat64);
        return RunWithHandles(s, [&](RankContext& ctx) -> absl::Status {
          FlatParamHandle& h = ctx.handle;
          if (mixed) FLATPARAM_RETURN_IF_ERROR(h.SetTraining(false));
          FLATPARAM_RETURN_IF_ERROR(RunIteration(s, ctx, 0, true));
          const BufferRef g = *h.sharded_grad();
          (*dtypes)[ctx.world_rank] = g.dtype;
          (*out)[ctx.world_rank] = ReadValues(g);
          return absl::OkStatus();
        });
      };
      std::vector<std::vector<double>> eval, full;
      std::vector<DType> eval_dtypes, full_dtypes;
      ASSERT_THAT(run(true, &eval, &eval_dtypes), IsOk()) << label;
      ASSERT_THAT(run(false, &full, &full_dtypes), IsOk()) << label;
      EXPECT_EQ(eval, full) << label;
      for (DType d : eval_dtypes) EXPECT_EQ(d, DType::kFloat32) << label;
    }
  }
}

// FSDP_USE_FAKE_ALL_GATHER / FSDP_USE_FAKE_REDUCE skip exactly the
// all-gather of the parameter and the reduce-scatter of the gradient.
TEST(FakeCollectivesTest, SkipOnlyTheAllGatherAndTheReduceScatter) {
  for (ShardingStrategy strategy :
       {ShardingStrategy::kFullShard, ShardingStrategy::kHybridShard,
        ShardingStrategy::kNoShard}) {
    for (int fakes = 0; fakes < 4; ++fakes) {
      Scenario s = Make(strategy, 2);
      s.options.fake_all_gather = (fakes & 1) != 0;
      s.options.fake_reduce = (fakes & 2) != 0;
      std::unique_ptr<SimWorld> world;
      ASSERT_THAT(RunWithHandles(
                      s,
                      [&](RankContext& ctx) {
                        return RunIteration(s, ctx, 0, /*sync=*/true);
                      },
                      &world),
                  IsOk());
      const bool sharded = strategy != ShardingStrategy::kNoShard;
      const std::string label =
          absl::StrCat(ShardingStrategyName(strategy), " fakes=", fakes);
      for (int r = 0; r < s.world_size(); ++r) {
        // Forward, and backward again where the forward freed it.
        const int gathers = FreesAfterForward(strategy) ? 2 : 1;
        EXPECT_EQ(CountOps(*world, r, "all_gather"),
                  sharded && !s.options.fake_all_gather ? gathers : 0)
            << label;
        EXPECT_EQ(CountOps(*world, r, "reduce_scatter"),
                  sharded && !s.options.fake_reduce ? 1 : 0)
            << label;
        // The replicate all-reduce and NO_SHARD's all-reduce still run.
        EXPECT_EQ(CountOps(*world, r, "all_reduce"), sharded ? s.hybrid() : 1)
            << label;
      }
    }
  }
}

// ---------------------------------------------------------------------------
// A handle that took no part in the backward (conditional computation).

TEST(FinalizeTest, AcceptsAHandleThatTookNoPartInTheBackward) {
  for (ShardingStrategy strategy :
       {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp,
        ShardingStrategy::kNoShard}) {
    Scenario s = Make(strategy, 2);
    const bool sharded = strategy != ShardingStrategy::kNoShard;
    std::vector<std::vector<double>> clean(2), tolerant(2);
    auto run = [&](bool skip_parts, std::vector<std::vector<double>>* out) {
      std::unique_ptr<SimWorld> world;
      absl::Status status = RunWithHandles(
          s,
          [&](RankContext& ctx) -> absl::Status {
            FlatParamHandle& h = ctx.handle;
            if (skip_parts) {
              // Forward only, as the root (kept unsharded): the catch-all
              // reshard frees the parameter.
              FLATPARAM_RETURN_IF_ERROR(h.PreForward());
              FLATPARAM_RETURN_IF_ERROR(h.PostForward(/*is_root=*/true));
              FLATPARAM_RETURN_IF_ERROR(h.FinalizeBackward());
              EXPECT_EQ(h.training_state(), HandleTrainingState::kIdle);
              EXPECT_EQ(h.unsharded_flat_param(), std::nullopt);
              if (sharded) {
                EXPECT_EQ(
                    h.memory().current_bytes(MemoryCategory::kUnshardedParams),
                    0);
              }
              // Forward without its post-forward.
              FLATPARAM_RETURN_IF_ERROR(h.PreForward());
              FLATPARAM_RETURN_IF_ERROR(h.FinalizeBackward());
              EXPECT_EQ(h.unsharded_flat_param(), std::nullopt);
              // Pre-backward whose post-backward never ran: its gradient
              // is neither reduced nor kept.
              FLATPARAM_RETURN_IF_ERROR(h.PreBackward());
              FLATPARAM_RETURN_IF_ERROR(AddGradients(s, ctx, 7));
              FLATPARAM_RETURN_IF_ERROR(h.FinalizeBackward());
              EXPECT_EQ(h.unsharded_grad(), std::nullopt);
              EXPECT_EQ(h.sharded_grad(), std::nullopt);
              EXPECT_EQ(
                  h.memory().current_bytes(MemoryCategory::kUnshardedGrads), 0);
              // Nothing at all.
              FLATPARAM_RETURN_IF_ERROR(h.FinalizeBackward());
            }
            // Under no_sync a gradient kept from a skipped post-backward
            // accumulates into the next backward.
            FLATPARAM_RETURN_IF_ERROR(h.PreForward());
            FLATPARAM_RETURN_IF_ERROR(h.PostForward());
            FLATPARAM_RETURN_IF_ERROR(h.PreBackward());
            FLATPARAM_RETURN_IF_ERROR(AddGradients(s, ctx, 0));
            if (skip_parts) {
              FLATPARAM_RETURN_IF_ERROR(h.FinalizeBackward(/*sync=*/false));
              EXPECT_NE(h.unsharded_grad(), std::nullopt);
            } else {
              FLATPARAM_RETURN_IF_ERROR(h.PostBackward(/*sync=*/false));
              FLATPARAM_RETURN_IF_ERROR(h.FinalizeBackward(/*sync=*/false));
            }
            FLATPARAM_RETURN_IF_ERROR(RunIteration(s, ctx, 1, /*sync=*/true));
            (*out)[ctx.world_rank] = ReadValues(*h.sharded_grad());
            return absl::OkStatus();
          },
          &world);
      // The skipped parts communicated nothing: one gather per forward and
      // backward that unsharded, one reduction.
      for (int r = 0; r < 2 && status.ok(); ++r) {
        EXPECT_EQ(
            CountOps(*world, r, sharded ? "reduce_scatter" : "all_reduce"), 1);
      }
      return status;
    };
    ASSERT_THAT(run(false, &clean), IsOk());
    ASSERT_THAT(run(true, &tolerant), IsOk());
    EXPECT_EQ(tolerant, clean) << ShardingStrategyName(strategy);
  }
}

// ---------------------------------------------------------------------------
// Per-parameter gradient state (use_orig_params).

using GradViews = std::vector<std::optional<std::vector<double>>>;

GradViews ReadGradViews(const FlatParamHandle& h, int n) {
  GradViews out;
  for (int i = 0; i < n; ++i) {
    absl::StatusOr<std::optional<BufferRef>> v = h.ShardedGradView(i);
    EXPECT_THAT(v, IsOk());
    out.push_back(v.ok() && v->has_value()
                      ? std::optional<std::vector<double>>(ReadValues(**v))
                      : std::nullopt);
  }
  return out;
}

// Each rank's views after one synchronized iteration `iter` on a new
// handle; `frozen` parameters are frozen from the start.
std::vector<GradViews> OneIteration(Scenario s, int iter,
                                    const std::vector<int>& frozen) {
  for (int i : frozen) s.specs[i].requires_grad = false;
  std::vector<GradViews> out(s.world_size());
  EXPECT_THAT(RunWithHandles(
                  s,
                  [&](RankContext& ctx) -> absl::Status {
                    FLATPARAM_RETURN_IF_ERROR(RunIteration(s, ctx, iter, true));
                    out[ctx.world_rank] =
                        ReadGradViews(ctx.handle, ctx.layout.params().size());
                    return absl::OkStatus();
                  }),
              IsOk());
  return out;
}

std::optional<std::vector<double>> Sum(
    const std::optional<std::vector<double>>& a,
    const std::optional<std::vector<double>>& b) {
  if (!a.has_value() || !b.has_value()) return std::nullopt;
  std::vector<double> out(a->size());
  for (size_t k = 0; k < out.size(); ++k) {
    out[k] = AddIn(DType::kFloat32, (*a)[k], (*b)[k]);
  }
  return out;
}

// `param.grad = None` on one original parameter: the optimizer sees None
// (not zeros) until a backward gives it a gradient, which then starts from
// zero while the others keep accumulating (PyTorch's `_is_grad_none_mask`).
TEST(GradNoneTest, OneParameterNoneUntilItsNextGradient) {
  for (ShardingStrategy strategy :
       {ShardingStrategy::kFullShard, ShardingStrategy::kNoShard}) {
    for (bool offload : {false, true}) {
      Scenario s = Make(strategy, 2, /*align=*/true);
      s.options.cpu_offload = offload;
      const int n = static_cast<int>(s.specs.size());
      const std::vector<GradViews> g0 = OneIteration(s, 0, {});
      const std::vector<GradViews> g1 = OneIteration(s, 1, {});
      const std::string label = absl::StrCat(ShardingStrategyName(strategy),
                                             offload ? " offload" : "");
      ASSERT_THAT(
          RunWithHandles(
              s,
              [&](RankContext& ctx) -> absl::Status {
                FlatParamHandle& h = ctx.handle;
                const int r = ctx.world_rank;
                FLATPARAM_RETURN_IF_ERROR(RunIteration(s, ctx, 0, true));
                FLATPARAM_RETURN_IF_ERROR(h.SetGradNone(1));
                EXPECT_TRUE(h.grad_is_none(1));
                GradViews got = ReadGradViews(h, n);
                for (int i = 0; i < n; ++i) {
                  EXPECT_EQ(got[i], i == 1 ? std::nullopt : g0[r][i])
                      << label << " rank " << r << " param " << i;
                }
                FLATPARAM_RETURN_IF_ERROR(RunIteration(s, ctx, 1, true));
                EXPECT_FALSE(h.grad_is_none(1));
                got = ReadGradViews(h, n);
                for (int i = 0; i < n; ++i) {
                  EXPECT_EQ(got[i], i == 1 ? g1[r][i] : Sum(g0[r][i], g1[r][i]))
                      << label << " rank " << r << " param " << i;
                }
                // Every gradient None: the flat gradient is freed.
                for (int i = 0; i < n; ++i) {
                  FLATPARAM_RETURN_IF_ERROR(h.SetGradNone(i));
                }
                EXPECT_EQ(h.sharded_grad(), std::nullopt) << label;
                EXPECT_THAT(h.SetGradNone(n),
                            StatusIs(absl::StatusCode::kInvalidArgument));
                return absl::OkStatus();
              }),
          IsOk())
          << label;
    }
  }
}

// Under no_sync a None gradient stays None (the optimizer does not see the
// micro-batch's gradient, which only accumulates); the synchronizing
// backward gives it the sum of both micro-batches. On a rank whose shard
// holds only some parameters, the flat gradient is freed once those are
// None.
TEST(GradNoneTest, NoneThroughNoSyncAndFreedByThisShardsParameters) {
  for (ShardingStrategy strategy :
       {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp}) {
    Scenario s = Make(strategy, 2, /*align=*/true);
    const int n = static_cast<int>(s.specs.size());
    const std::string label(ShardingStrategyName(strategy));
    FLATPARAM_ASSERT_OK_AND_ASSIGN(FlatParamLayout layout, MakeLayout(s));
    ASSERT_THAT(RunWithHandles(
                    s,
                    [&](RankContext& ctx) -> absl::Status {
                      FlatParamHandle& h = ctx.handle;
                      const int r = ctx.world_rank;
                      FLATPARAM_RETURN_IF_ERROR(RunIteration(s, ctx, 0, true));
                      FLATPARAM_RETURN_IF_ERROR(h.SetGradNone(1));
                      FLATPARAM_RETURN_IF_ERROR(RunIteration(s, ctx, 1, false));
                      EXPECT_TRUE(h.grad_is_none(1)) << label;
                      EXPECT_EQ(ReadGradViews(h, n)[1], std::nullopt) << label;
                      FLATPARAM_RETURN_IF_ERROR(RunIteration(s, ctx, 2, true));
                      EXPECT_FALSE(h.grad_is_none(1)) << label;
                      // None only the parameters in this rank's shard: the flat
                      // gradient goes, although the others' are not None.
                      int others = 0;
                      for (int i = 0; i < n; ++i) {
                        const ShardParamInfo in = layout.shard_param_info(r, i);
                        if (in.in_shard && in.numel_in_shard > 0) {
                          FLATPARAM_RETURN_IF_ERROR(h.SetGradNone(i));
                        } else {
                          ++others;
                        }
                      }
                      EXPECT_EQ(h.sharded_grad(), std::nullopt)
                          << label << " rank " << r;
                      EXPECT_GT(others, 0) << label << " rank " << r;
                      return absl::OkStatus();
                    }),
                IsOk())
        << label;
  }
}

// Changing `requires_grad` between iterations without a new handle: the
// frozen parameter contributes nothing and is hidden; the others go on.
TEST(RequiresGradChangeTest, FreezeAndUnfreezeBetweenIterations) {
  for (ShardingStrategy strategy :
       {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp,
        ShardingStrategy::kNoShard}) {
    Scenario s = Make(strategy, 2, /*align=*/true);
    const int n = static_cast<int>(s.specs.size());
    const std::vector<GradViews> g0 = OneIteration(s, 0, {});
    const std::vector<GradViews> g1 = OneIteration(s, 1, {0});
    const std::string label(ShardingStrategyName(strategy));
    std::unique_ptr<SimWorld> world;
    ASSERT_THAT(RunWithHandles(
                    s,
                    [&](RankContext& ctx) -> absl::Status {
                      FlatParamHandle& h = ctx.handle;
                      const int r = ctx.world_rank;
                      FLATPARAM_RETURN_IF_ERROR(RunIteration(s, ctx, 0, true));
                      FLATPARAM_RETURN_IF_ERROR(h.SetRequiresGrad(0, false));
                      EXPECT_FALSE(h.requires_grad(0));
                      FLATPARAM_RETURN_IF_ERROR(RunIteration(s, ctx, 1, true));
                      GradViews got = ReadGradViews(h, n);
                      EXPECT_EQ(got[0], std::nullopt) << label;
                      for (int i = 1; i < n; ++i) {
                        EXPECT_EQ(got[i], Sum(g0[r][i], g1[r][i]))
                            << label << " rank " << r << " param " << i;
                      }
                      // Unfrozen: None (not its iteration-0 gradient, nor
                      // zeros) until its next backward, as in PyTorch.
                      FLATPARAM_RETURN_IF_ERROR(h.SetRequiresGrad(0, true));
                      got = ReadGradViews(h, n);
                      EXPECT_EQ(got[0], std::nullopt) << label << " rank " << r;
                      EXPECT_TRUE(h.grad_is_none(0)) << label;
                      // Nothing trains: the backward neither allocates nor
                      // reduces.
                      FLATPARAM_RETURN_IF_ERROR(h.SetAllRequiresGrad(false));
                      FLATPARAM_RETURN_IF_ERROR(h.PreForward());
                      FLATPARAM_RETURN_IF_ERROR(h.PostForward());
                      FLATPARAM_RETURN_IF_ERROR(h.PreBackward());
                      EXPECT_EQ(h.unsharded_grad(), std::nullopt);
                      FLATPARAM_RETURN_IF_ERROR(h.PostBackward());
                      return h.FinalizeBackward();
                    },
                    &world),
                IsOk())
        << label;
    for (int r = 0; r < 2; ++r) {
      EXPECT_EQ(
          CountOps(*world, r,
                   strategy == ShardingStrategy::kNoShard ? "all_reduce"
                                                          : "reduce_scatter"),
          2)
          << label;
    }
  }
  // use_orig_params=False: one flag for the flat parameter.
  Scenario s = Make(ShardingStrategy::kFullShard, 2);
  ASSERT_THAT(RunWithHandles(
                  s,
                  [&](RankContext& ctx) -> absl::Status {
                    EXPECT_THAT(ctx.handle.SetRequiresGrad(0, false),
                                StatusIs(absl::StatusCode::kInvalidArgument,
                                         HasSubstr("uniform `requires_grad`")));
                    EXPECT_TRUE(ctx.handle.requires_grad(0));
                    return ctx.handle.SetAllRequiresGrad(false);
                  }),
              IsOk());
}

// ---------------------------------------------------------------------------
// Summoning with gradients, rank0_only and offload_to_cpu.

// The full gradient of each parameter assembled from every shard rank's
// ShardedGradView (an independent path: no collective involved).
std::vector<std::vector<double>> AssembleFromShards(
    const FlatParamLayout& layout, const std::vector<GradViews>& shards,
    bool sharded) {
  std::vector<std::vector<double>> full;
  for (size_t i = 0; i < layout.params().size(); ++i) {
    std::vector<double> g(layout.params()[i].numel, 0.0);
    for (size_t r = 0; r < shards.size(); ++r) {
      const auto& piece = shards[r][i];
      if (!piece.has_value()) continue;
      const int64_t start =
          sharded ? layout.shard_param_info(r, static_cast<int>(i))
                        .intra_param_start_idx
                  : 0;
      std::copy(piece->begin(), piece->end(), g.begin() + start);
    }
    full.push_back(std::move(g));
  }
  return full;
}

TEST(SummonGradTest, GathersEveryRanksShardAndWritesBack) {
  for (ShardingStrategy strategy :
       {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp,
        ShardingStrategy::kNoShard, ShardingStrategy::kHybridShard}) {
    for (bool offload : {false, true}) {
      Scenario s = Make(strategy, 3, /*align=*/true);
      s.options.cpu_offload = offload;
      FLATPARAM_ASSERT_OK_AND_ASSIGN(FlatParamLayout layout, MakeLayout(s));
      const int n = static_cast<int>(layout.params().size());
      const bool sharded = strategy != ShardingStrategy::kNoShard;
      const std::string label = absl::StrCat(ShardingStrategyName(strategy),
                                             offload ? " offload" : "");
      std::vector<GradViews> shards(s.world_size()), summoned(s.world_size()),
          after(s.world_size());
      ASSERT_THAT(
          RunWithHandles(
              s,
              [&](RankContext& ctx) -> absl::Status {
                FlatParamHandle& h = ctx.handle;
                FLATPARAM_RETURN_IF_ERROR(RunIteration(s, ctx, 0, true));
                shards[ctx.world_rank] = ReadGradViews(h, n);
                SummonOptions o;
                o.with_grads = true;
                o.writeback = true;
                FLATPARAM_RETURN_IF_ERROR(h.BeginSummonFullParams(o));
                for (int i = 0; i < n; ++i) {
                  FLATPARAM_ASSIGN_OR_RETURN(std::optional<BufferRef> g,
                                             h.UnshardedGradView(i));
                  if (!g.has_value()) return absl::InternalError("no grad");
                  summoned[ctx.world_rank].push_back(ReadValues(*g));
                  // Doubled, and written back into each rank's shard.
                  std::vector<double> twice = ReadValues(*g);
                  for (double& v : twice) v *= 2;
                  WriteValues(*g, twice);
                }
                FLATPARAM_RETURN_IF_ERROR(h.EndSummonFullParams());
                after[ctx.world_rank] = ReadGradViews(h, n);
                EXPECT_THAT(h.UnshardedGradView(0),
                            StatusIs(absl::StatusCode::kFailedPrecondition));
                return absl::OkStatus();
              }),
          IsOk())
          << label;
      const std::vector<GradViews> group(
          shards.begin(), shards.begin() + (sharded ? s.shard_size : 1));
      const std::vector<std::vector<double>> full =
          AssembleFromShards(layout, group, sharded);
      for (int r = 0; r < s.world_size(); ++r) {
        for (int i = 0; i < n; ++i) {
          EXPECT_EQ(*summoned[r][i], full[i])
              << label << " rank " << r << " param " << i;
          if (!shards[r][i].has_value()) continue;
          std::vector<double> twice = *shards[r][i];
          for (double& v : twice) v *= 2;
          EXPECT_EQ(after[r][i], twice)
              << label << " rank " << r << " param " << i;
        }
      }
    }
  }
}

TEST(SummonGradTest, NoneGradients) {
  Scenario s = Make(ShardingStrategy::kFullShard, 2, /*align=*/true);
  for (int none_ranks : {1, 2}) {
    std::unique_ptr<SimWorld> world;
    std::vector<std::vector<double>> rank0_piece(2);
    ASSERT_THAT(
        RunWithHandles(
            s,
            [&](RankContext& ctx) -> absl::Status {
              FlatParamHandle& h = ctx.handle;
              FLATPARAM_RETURN_IF_ERROR(RunIteration(s, ctx, 0, true));
              if (ctx.world_rank < none_ranks) {
                FLATPARAM_RETURN_IF_ERROR(h.ZeroGrad(/*set_to_none=*/true));
              }
              SummonOptions o;
              o.with_grads = true;
              FLATPARAM_RETURN_IF_ERROR(h.BeginSummonFullParams(o));
              FLATPARAM_ASSIGN_OR_RETURN(std::optional<BufferRef> g,
                                         h.UnshardedGradView(0));
              if (none_ranks == 2) {
                EXPECT_EQ(g, std::nullopt);
              } else if (g.has_value()) {
                // Rank 0's None gradient counts as zeros: parameter 0
                // ("a.w", 15 elements) starts in rank 0's shard.
                const ShardParamInfo info = ctx.layout.shard_param_info(0, 0);
                std::vector<double> v = ReadValues(*g);
                rank0_piece[ctx.world_rank].assign(
                    v.begin(), v.begin() + info.numel_in_shard);
              } else {
                ADD_FAILURE() << "no gradient with one None rank";
              }
              return h.EndSummonFullParams();
            },
            &world),
        IsOk());
    for (int r = 0; r < 2; ++r) {
      // One all-gather of the parameter per forward and backward, one more
      // of the gradient unless every rank's is None.
      EXPECT_EQ(CountOps(*world, r, "all_gather"), none_ranks == 2 ? 3 : 4);
      if (none_ranks == 1) {
        EXPECT_EQ(rank0_piece[r],
                  std::vector<double>(rank0_piece[r].size(), 0.0));
        EXPECT_FALSE(rank0_piece[r].empty());
      }
    }
  }
}

TEST(SummonTest, Rank0OnlyAndOffloadToCpu) {
  for (bool rank0_only : {false, true}) {
    Scenario s = Make(ShardingStrategy::kFullShard, 2, /*align=*/true);
    s.fake_device = true;  // Compute memory is labelled cuda:0.
    FLATPARAM_ASSERT_OK_AND_ASSIGN(FlatParamLayout layout, MakeLayout(s));
    ASSERT_THAT(
        RunWithHandles(
            s,
            [&](RankContext& ctx) -> absl::Status {
              FlatParamHandle& h = ctx.handle;
              SummonOptions o;
              o.rank0_only = rank0_only;
              o.offload_to_cpu = true;
              FLATPARAM_RETURN_IF_ERROR(h.BeginSummonFullParams(o));
              FLATPARAM_ASSIGN_OR_RETURN(OrigParamView v, h.Param(0));
              const bool full = !rank0_only || ctx.world_rank == 0;
              EXPECT_EQ(v.sharded, !full);
              if (full) {
                EXPECT_EQ(v.data.device, Device::Host());
                EXPECT_EQ(v.shape, layout.params()[0].shape);
                std::vector<double> want;
                for (int64_t k = 0; k < v.data.count; ++k) {
                  want.push_back(InitialValue(s, 0, k));
                }
                EXPECT_EQ(ReadValues(v.data), want);
              }
              // The device holds only the shard during the summon; the host
              // the full parameter where it is kept.
              EXPECT_EQ(
                  h.memory().compute_current,
                  h.memory().current_bytes(MemoryCategory::kShardedParams));
              EXPECT_EQ(h.memory().offload_current,
                        full ? layout.unpadded_unsharded_numel() * 4 : 0);
              return h.EndSummonFullParams();
            }),
        IsOk());
  }
  // Offload with writeback: a change made in host memory reaches the shards.
  Scenario s = Make(ShardingStrategy::kFullShard, 2, /*align=*/true);
  s.fake_device = true;
  ASSERT_THAT(RunWithHandles(
                  s,
                  [&](RankContext& ctx) -> absl::Status {
                    FlatParamHandle& h = ctx.handle;
                    SummonOptions o;
                    o.offload_to_cpu = true;
                    o.writeback = true;
                    FLATPARAM_RETURN_IF_ERROR(h.BeginSummonFullParams(o));
                    FLATPARAM_ASSIGN_OR_RETURN(OrigParamView v, h.Param(3));
                    WriteValues(v.data, std::vector<double>(v.data.count, 5.0));
                    FLATPARAM_RETURN_IF_ERROR(h.EndSummonFullParams());
                    FLATPARAM_RETURN_IF_ERROR(h.BeginSummonFullParams(false));
                    FLATPARAM_ASSIGN_OR_RETURN(OrigParamView again, h.Param(3));
                    EXPECT_EQ(ReadValues(again.data),
                              std::vector<double>(again.data.count, 5.0));
                    return h.EndSummonFullParams();
                  }),
              IsOk());
}

TEST(SummonTest, UnsupportedCombinationsAreErrors) {
  for (ShardingStrategy strategy :
       {ShardingStrategy::kFullShard, ShardingStrategy::kNoShard}) {
    Scenario s = Make(strategy, 2);
    ASSERT_THAT(
        RunWithHandles(
            s,
            [&](RankContext& ctx) -> absl::Status {
              FlatParamHandle& h = ctx.handle;
              const auto kInvalid = absl::StatusCode::kInvalidArgument;
              SummonOptions o;
              o.writeback = o.rank0_only = true;
              EXPECT_THAT(h.BeginSummonFullParams(o),
                          StatusIs(kInvalid, HasSubstr("rank0_only=true")));
              o = SummonOptions();
              o.offload_to_cpu = o.with_grads = true;
              EXPECT_THAT(h.BeginSummonFullParams(o),
                          StatusIs(kInvalid, HasSubstr("with_grads=true")));
              o = SummonOptions();
              o.offload_to_cpu = true;
              if (strategy == ShardingStrategy::kNoShard) {
                EXPECT_THAT(h.BeginSummonFullParams(o),
                            StatusIs(kInvalid, HasSubstr("NO_SHARD")));
              }
              EXPECT_EQ(h.training_state(), HandleTrainingState::kIdle);
              return absl::OkStatus();
            }),
        IsOk());
  }
}

TEST(CreateTest, RejectsInconsistentArguments) {
  SimOptions options;
  options.world_size = 2;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(std::unique_ptr<SimWorld> world,
                                 SimWorld::Create(options));
  ASSERT_THAT(world->Run([&](SimCommunicator& comm) -> absl::Status {
    HostDeviceOps ops;
    Scenario s = Make(ShardingStrategy::kFullShard, 2);
    FLATPARAM_ASSIGN_OR_RETURN(FlatParamLayout layout, MakeLayout(s));
    const std::vector<HostTensor> params = InitialParams(s, layout);
    std::vector<ConstBufferRef> refs;
    for (const HostTensor& t : params) refs.push_back(t.cref());
    const auto invalid = [](absl::string_view text) {
      return StatusIs(absl::StatusCode::kInvalidArgument,
                      HasSubstr(std::string(text)));
    };
    Scenario wrong_world = Make(ShardingStrategy::kFullShard, 3);
    FLATPARAM_ASSIGN_OR_RETURN(FlatParamLayout layout3,
                               MakeLayout(wrong_world));
    EXPECT_THAT(FlatParamHandle::Create(layout3, refs, &comm, nullptr, &ops),
                invalid("world size 3 but the shard group has 2"));
    EXPECT_THAT(FlatParamHandle::Create(layout, refs, &comm, &comm, &ops),
                invalid("FULL_SHARD does not take a replicate group"));
    Scenario hybrid = Make(ShardingStrategy::kHybridShard, 2);
    FLATPARAM_ASSIGN_OR_RETURN(FlatParamLayout hybrid_layout,
                               MakeLayout(hybrid));
    EXPECT_THAT(
        FlatParamHandle::Create(hybrid_layout, refs, &comm, nullptr, &ops),
        invalid("HYBRID_SHARD requires a replicate group"));
    Scenario aligned = Make(ShardingStrategy::kFullShard, 2, true);
    FLATPARAM_ASSIGN_OR_RETURN(FlatParamLayout aligned_layout,
                               MakeLayout(aligned));
    HandleOptions bf16;
    bf16.param_dtype = DType::kBFloat16;
    EXPECT_THAT(FlatParamHandle::Create(aligned_layout, refs, &comm, nullptr,
                                        &ops, bf16),
                invalid("aligns addresses for float32"));
    HandleOptions ints;
    ints.reduce_dtype = DType::kInt32;
    EXPECT_THAT(
        FlatParamHandle::Create(layout, refs, &comm, nullptr, &ops, ints),
        invalid("reduce_dtype int32"));
    EXPECT_THAT(FlatParamHandle::Create(layout, absl::MakeSpan(refs).subspan(1),
                                        &comm, nullptr, &ops),
                StatusIs(absl::StatusCode::kInvalidArgument));
    std::vector<float> short_shard(3);
    EXPECT_THAT(
        FlatParamHandle::CreateWithLocalShard(
            layout,
            BufferRef{short_shard.data(), 3, DType::kFloat32, Device::Host()},
            &comm, nullptr, &ops),
        invalid("the local shard must be 13 x float32 on host"));
    return absl::OkStatus();
  }),
              IsOk());
}

// A caller-owned local shard is used in place and not counted.
TEST(CreateTest, WithLocalShardUsesTheCallersBuffer) {
  Scenario s = Make(ShardingStrategy::kFullShard, 2);
  FLATPARAM_ASSERT_OK_AND_ASSIGN(FlatParamLayout layout, MakeLayout(s));
  const std::vector<HostTensor> params = InitialParams(s, layout);
  std::vector<ConstBufferRef> refs;
  for (const HostTensor& t : params) refs.push_back(t.cref());
  SimOptions options;
  options.world_size = 2;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(std::unique_ptr<SimWorld> world,
                                 SimWorld::Create(options));
  ASSERT_THAT(world->Run([&](SimCommunicator& comm) -> absl::Status {
    HostDeviceOps ops;
    HostTensor shard = HostTensor::Flat(layout.dtype(), layout.sharded_numel());
    FLATPARAM_RETURN_IF_ERROR(
        FlattenShard(layout, refs, comm.rank(), shard.ref()));
    FLATPARAM_ASSIGN_OR_RETURN(std::unique_ptr<FlatParamHandle> h,
                               FlatParamHandle::CreateWithLocalShard(
                                   layout,
                                   BufferRef{shard.data(), shard.numel(),
                                             shard.dtype(), Device::Host()},
                                   &comm, nullptr, &ops));
    EXPECT_EQ(h->sharded_param().data, shard.data());
    EXPECT_EQ(h->memory().compute_current, 0);
    FLATPARAM_RETURN_IF_ERROR(h->PreForward());
    FLATPARAM_ASSIGN_OR_RETURN(OrigParamView v, h->Param(0));
    EXPECT_EQ(ReadValues(v.data)[14], params[0].GetDouble(14));
    return h->PostForward();
  }),
              IsOk());
}

// Meta parameters (shapes only): nothing is read from them, the shard is
// zeros, and a count that does not match the layout is refused.
TEST(CreateTest, MetaInitZeroFillsTheShardAndReadsNothing) {
  Scenario s = Make(ShardingStrategy::kFullShard, 2);
  FLATPARAM_ASSERT_OK_AND_ASSIGN(FlatParamLayout layout, MakeLayout(s));
  std::vector<ConstBufferRef> meta;
  for (const ParamInfo& p : layout.params()) {
    meta.push_back({nullptr, p.numel, layout.dtype(), Device::Host()});
  }
  SimOptions options;
  options.world_size = 2;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(std::unique_ptr<SimWorld> world,
                                 SimWorld::Create(options));
  ASSERT_THAT(world->Run([&](SimCommunicator& comm) -> absl::Status {
    HostDeviceOps ops;
    HandleOptions meta_init;
    meta_init.meta_init = true;
    FLATPARAM_ASSIGN_OR_RETURN(
        std::unique_ptr<FlatParamHandle> h,
        FlatParamHandle::Create(layout, meta, &comm, nullptr, &ops, meta_init));
    const BufferRef shard = h->sharded_param();
    EXPECT_EQ(shard.count, layout.sharded_numel());
    for (int64_t i = 0; i < shard.count; ++i) {
      EXPECT_EQ(static_cast<const float*>(shard.data)[i], 0.0f) << i;
    }
    std::vector<ConstBufferRef> wrong = meta;
    wrong[1].count += 1;
    EXPECT_THAT(
        FlatParamHandle::Create(layout, wrong, &comm, nullptr, &ops, meta_init),
        StatusIs(absl::StatusCode::kInvalidArgument,
                 HasSubstr("meta parameter " + layout.params()[1].fqn)));
    EXPECT_THAT(FlatParamHandle::Create(layout, absl::MakeSpan(meta).subspan(1),
                                        &comm, nullptr, &ops, meta_init),
                StatusIs(absl::StatusCode::kInvalidArgument));
    // Without meta_init the null data is a bad argument, not a crash.
    EXPECT_THAT(FlatParamHandle::Create(layout, meta, &comm, nullptr, &ops),
                StatusIs(absl::StatusCode::kInvalidArgument));
    return absl::OkStatus();
  }),
              IsOk());
}

// --- Asynchronous unshard and reduction
// ----------------------------------------

struct AsyncCase {
  ShardingStrategy strategy;
  std::optional<DType> param_dtype;
  bool cpu_offload;
};

class AsyncTest : public ::testing::TestWithParam<AsyncCase> {};

// Two iterations driven with StartUnshard (before each pre-hook, as a
// prefetch does) and PostBackwardAsync give, bit for bit, the unsharded
// parameters and sharded gradients of the blocking calls, with the
// collectives pending in between and their buffers counted from the start.
TEST_P(AsyncTest, StartAndFinishEqualTheBlockingCalls) {
  const AsyncCase c = GetParam();
  Scenario s = Make(c.strategy, 2);
  s.options.param_dtype = c.param_dtype;
  s.options.cpu_offload = c.cpu_offload;
  s.rounding_values = true;
  struct Seen {
    std::vector<std::vector<double>> params;  // per pre-hook
    std::vector<double> grad;
  };
  auto run = [&](bool async, std::vector<Seen>* seen) {
    seen->assign(s.world_size(), Seen{});
    return RunWithHandles(s, [&](RankContext& ctx) -> absl::Status {
      FlatParamHandle& h = ctx.handle;
      Seen& mine = (*seen)[ctx.world_rank];
      auto prefetch = [&]() -> absl::Status {
        if (!async || h.is_unsharded()) return absl::OkStatus();
        // Only an all-gather is pending: not NO_SHARD's unshard, nor the
        // reuse of a parameter SHARD_GRAD_OP kept from forward.
        const bool gathers = h.NeedsUnshard();
        FLATPARAM_RETURN_IF_ERROR(h.StartUnshard());
        if (h.unshard_pending() != gathers) {
          return absl::InternalError("pending iff it all-gathers");
        }
        if (h.is_unsharded() == gathers) {
          return absl::InternalError("unsharded at once iff no all-gather");
        }
        if (gathers &&
            h.memory().current_bytes(MemoryCategory::kUnshardedParams) == 0) {
          return absl::InternalError("pending all-gather output not counted");
        }
        // The all-gather's low-precision input is the pending unshard's
        // until it completes.
        if (gathers && h.uses_param_mixed_precision() &&
            h.memory().current_bytes(MemoryCategory::kLowPrecisionParams) ==
                0) {
          return absl::InternalError("pending all-gather input was freed");
        }
        // The caller computes meanwhile: memory it allocates and writes
        // must not be the collective's (with the caching allocator, a block
        // freed too early comes straight back here).
        for (DType dtype :
             {DType::kBFloat16, DType::kFloat16, DType::kFloat32}) {
          const int64_t n = h.layout().sharded_numel();
          FLATPARAM_ASSIGN_OR_RETURN(
              DeviceBuffer scratch,
              ctx.ops.Allocate(ctx.ops.device(), n * DTypeSize(dtype)));
          FLATPARAM_RETURN_IF_ERROR(ctx.ops.Fill(scratch.As(dtype), -7.0));
        }
        return absl::OkStatus();
      };
      for (int iter = 0; iter < 2; ++iter) {
        FLATPARAM_RETURN_IF_ERROR(prefetch());
        FLATPARAM_RETURN_IF_ERROR(h.PreForward());
        if (h.unshard_pending()) return absl::InternalError("still pending");
        mine.params.push_back(ReadValues(*h.unsharded_flat_param()));
        FLATPARAM_RETURN_IF_ERROR(h.PostForward());
        FLATPARAM_RETURN_IF_ERROR(prefetch());
        FLATPARAM_RETURN_IF_ERROR(h.PreBackward());
        mine.params.push_back(ReadValues(*h.unsharded_flat_param()));
        FLATPARAM_RETURN_IF_ERROR(AddGradients(s, ctx, iter));
        if (async) {
          FLATPARAM_RETURN_IF_ERROR(h.PostBackwardAsync(true));
          if (!h.reduce_pending()) return absl::InternalError("not pending");
          // The reduce-scatter's input is the pending reduction's.
          if (UsesShardedStrategy(s.strategy) &&
              h.memory().current_bytes(MemoryCategory::kUnshardedGrads) == 0) {
            return absl::InternalError("pending reduce-scatter input freed");
          }
        } else {
          FLATPARAM_RETURN_IF_ERROR(h.PostBackward(true));
        }
        FLATPARAM_RETURN_IF_ERROR(h.FinalizeBackward(true));
        if (h.reduce_pending()) return absl::InternalError("still reducing");
      }
      mine.grad = ReadValues(*h.sharded_grad());
      return absl::OkStatus();
    });
  };
  std::vector<Seen> blocking, async;
  ASSERT_THAT(run(false, &blocking), IsOk());
  ASSERT_THAT(run(true, &async), IsOk());
  for (int r = 0; r < s.world_size(); ++r) {
    EXPECT_EQ(async[r].params, blocking[r].params) << "rank " << r;
    EXPECT_EQ(async[r].grad, blocking[r].grad) << "rank " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Strategies, AsyncTest,
    ::testing::Values(
        AsyncCase{ShardingStrategy::kFullShard, std::nullopt, false},
        AsyncCase{ShardingStrategy::kFullShard, DType::kBFloat16, false},
        AsyncCase{ShardingStrategy::kFullShard, DType::kFloat16, true},
        AsyncCase{ShardingStrategy::kShardGradOp, std::nullopt, true},
        AsyncCase{ShardingStrategy::kNoShard, DType::kBFloat16, false},
        AsyncCase{ShardingStrategy::kHybridShard, std::nullopt, false},
        AsyncCase{ShardingStrategy::kHybridShardZero2, DType::kBFloat16,
                  true}));

// The same on simulated device streams (sim/sim_device.h), for several
// execution orders, on one stream and on three (compute, unshard,
// post-backward), with the caller's own kernels on the compute stream (a
// forward kernel reading the unsharded parameter, the backward's gradients,
// an optimizer touching the sharded gradient): the stream race detector
// finds nothing in the shipped handle (RunWithHandles fails on any report)
// and the results are the host run's, bit for bit. Then the mutation
// checks: each ordering of the discipline, switched off, is reported.
TEST_P(AsyncTest, NoStreamRacesOnSimulatedDevices) {
  const AsyncCase c = GetParam();
  Scenario s = Make(c.strategy, 2);
  s.options.param_dtype = c.param_dtype;
  s.options.cpu_offload = c.cpu_offload;
  s.rounding_values = true;
  auto run = [&](std::vector<std::vector<double>>* grads) {
    grads->assign(s.world_size(), {});
    return RunWithHandles(s, [&](RankContext& ctx) -> absl::Status {
      FlatParamHandle& h = ctx.handle;
      DeviceOps& ops = ctx.ops;  // its current stream is the compute stream
      EXPECT_EQ(h.stream_ordered(), s.sim_device && s.stream_ordered_comm &&
                                        s.options.stream_ordered);
      for (int iter = 0; iter < 2; ++iter) {
        FLATPARAM_RETURN_IF_ERROR(h.StartUnshard());
        FLATPARAM_RETURN_IF_ERROR(h.PreForward());
        {
          // A forward kernel reads the unsharded parameter.
          const BufferRef param = *h.unsharded_flat_param();
          FLATPARAM_ASSIGN_OR_RETURN(DeviceBuffer activations,
                                     ops.Allocate(param.device, param.bytes()));
          FLATPARAM_RETURN_IF_ERROR(
              ops.Copy(activations.As(param.dtype), param));
        }
        FLATPARAM_RETURN_IF_ERROR(h.PostForward());
        if (!h.is_unsharded()) {
          FLATPARAM_RETURN_IF_ERROR(h.StartUnshard());
        }
        FLATPARAM_RETURN_IF_ERROR(h.PreBackward());
        FLATPARAM_RETURN_IF_ERROR(AddGradients(s, ctx, iter));
        FLATPARAM_RETURN_IF_ERROR(h.PostBackwardAsync(true));
        FLATPARAM_RETURN_IF_ERROR(h.FinalizeBackward(true));
        // The optimizer reads and writes the sharded gradient and the
        // local shard (both unchanged).
        FLATPARAM_RETURN_IF_ERROR(
            ops.Scale(*h.sharded_grad(), ScaleOp::kMultiply, 1.0));
        FLATPARAM_RETURN_IF_ERROR(
            ops.Scale(h.sharded_param(), ScaleOp::kMultiply, 1.0));
      }
      // The host reads device memory: it synchronizes first, as on a GPU
      // (the handle's work is queued on its streams).
      FLATPARAM_RETURN_IF_ERROR(ops.Synchronize());
      (*grads)[ctx.world_rank] = ReadValues(*h.sharded_grad());
      return absl::OkStatus();
    });
  };
  std::vector<std::vector<double>> host, simulated;
  ASSERT_THAT(run(&host), IsOk());
  s.sim_device = true;
  // Host-completed collectives, then stream-ordered ones (a simulated
  // NCCL: the handle never waits for a collective on the host).
  for (bool ordered : {false, true}) {
    s.stream_ordered_comm = ordered;
    for (bool streams : {false, true}) {
      s.separate_streams = streams;
      for (uint64_t seed : {0, 1, 2}) {
        s.device_seed = seed;
        ASSERT_THAT(run(&simulated), IsOk()) << s.Options();
        EXPECT_EQ(simulated, host) << s.Options();
      }
    }
  }
  // HandleOptions::stream_ordered off: a stream-ordered communicator is
  // used the host-completed way.
  s.stream_ordered_comm = true;
  s.options.stream_ordered = false;
  ASSERT_THAT(run(&simulated), IsOk()) << s.Options();
  EXPECT_EQ(simulated, host) << s.Options();
  s.options.stream_ordered = true;

  using internal_handle::SkippedOrdering;
  struct Mutation {
    SkippedOrdering skip;
    bool ordered;  // stream-ordered collectives
    bool applies;
    std::vector<std::string> report;
  };
  const bool sharded = UsesShardedStrategy(c.strategy);
  const bool mp = c.param_dtype.has_value();
  const std::vector<Mutation> mutations = {
      // Only an all-gather of device-produced input can race: the cast to
      // param_dtype (an offload copy from the host completes before it
      // returns, as DeviceOps says).
      {SkippedOrdering::kSyncBeforeAllGather,
       false,
       sharded && mp,
       {"race: all_gather", "is not ordered after cast (stream 1"}},
      // Stream-ordered, the all-gather is then ordered after nothing the
      // device did: not the cast, not the optimizer's update of the local
      // shard (unless that is on the host).
      {SkippedOrdering::kSyncBeforeAllGather,
       true,
       sharded && (mp || !c.cpu_offload),
       {"race: all_gather"}},
      {SkippedOrdering::kPostBackwardWaitsForCompute,
       false,
       true,
       {"race: ", "is not ordered after add (stream 0"}},
      {SkippedOrdering::kPostBackwardWaitsForCompute,
       true,
       true,
       {"race: ", "is not ordered after add (stream 0"}},
      // The optimizer's touch of an offloaded gradient is on host memory,
      // which completes before returning.
      {SkippedOrdering::kComputeWaitsForPostBackward,
       false,
       !c.cpu_offload,
       {"race: scale (multiply) (stream 0", "(stream 2, writes"}},
      {SkippedOrdering::kComputeWaitsForPostBackward,
       true,
       !c.cpu_offload,
       {"race: scale (multiply) (stream 0", "(stream 2, writes"}},
      // Freed after forward; a parameter kept for the backward is freed
      // after the gradients' host-to-device copies, which order the host
      // after the compute stream here.
      {SkippedOrdering::kRecordUnshardedParamOnCompute,
       false,
       sharded && ReshardsAfterForward(c.strategy),
       {"freed while in use: copy (stream 0, reads"}},
      {SkippedOrdering::kRecordUnshardedParamOnCompute,
       true,
       sharded && ReshardsAfterForward(c.strategy),
       {"freed while in use: copy (stream 0, reads"}},
      // The optimizer's update of the local shard on the compute stream
      // against the next iteration's cast or all-gather of it (a device
      // local shard only).
      {SkippedOrdering::kUnshardWaitsForCompute,
       false,
       !c.cpu_offload && (sharded || mp),
       {"race: ", "is not ordered after scale (multiply) (stream 0"}},
      {SkippedOrdering::kUnshardWaitsForCompute,
       true,
       !c.cpu_offload && (sharded || mp),
       {"race: ", "is not ordered after scale (multiply) (stream 0"}},
      // Stream-ordered only: the forward's kernel reads the all-gather's
      // output without waiting for it.
      {SkippedOrdering::kComputeWaitsForUnshard,
       true,
       sharded,
       {"race: copy (stream 0, reads", "all_gather"}},
  };
  s.separate_streams = true;
  s.device_seed = 0;
  for (const Mutation& m : mutations) {
    if (!m.applies) continue;
    s.stream_ordered_comm = m.ordered;
    internal_handle::SetSkippedOrderingForTesting(m.skip);
    const absl::Status broken = run(&simulated);
    internal_handle::SetSkippedOrderingForTesting(SkippedOrdering::kNone);
    EXPECT_THAT(broken, StatusIs(absl::StatusCode::kInternal))
        << static_cast<int>(m.skip) << " " << s.Options();
    for (const std::string& part : m.report) {
      EXPECT_THAT(std::string(broken.message()), HasSubstr(part))
          << static_cast<int>(m.skip) << " " << s.Options();
    }
  }
}

// FULL_SHARD on 2 simulated ranks with device streams, whose first
// all-gather times out: rank 1 arrives 10 s late on the virtual clock with
// a 1 s timeout.
Scenario LateRankScenario(bool stream_ordered) {
  Scenario s = Make(ShardingStrategy::kFullShard, 2);
  s.sim_device = true;
  s.separate_streams = true;
  s.stream_ordered_comm = stream_ordered;
  s.options.collective_options.timeout = absl::Seconds(1);
  s.faults = *ParseFaultSpecs("delay:rank=1:seconds=10");
  return s;
}

// Stream-ordered, the host never waits for a collective during the
// iteration, so a collective that times out (rank 1 arrives 10 s late for
// its first all-gather, on the virtual clock, with a 1 s timeout) is not
// seen by the hooks; FinalizeBackward waits for every collective of the
// iteration on the host and reports it, before the optimizer would use
// the gradients. Host-completed, PreForward itself fails.
TEST(AsyncFailureTest, StreamOrderedFailuresAreReportedByFinalizeBackward) {
  for (bool ordered : {true, false}) {
    const Scenario s = LateRankScenario(ordered);
    std::vector<absl::Status> forward(2), finalized(2);
    const absl::Status run =
        RunWithHandles(s, [&](RankContext& ctx) -> absl::Status {
          FlatParamHandle& h = ctx.handle;
          forward[ctx.world_rank] = h.PreForward();
          if (!forward[ctx.world_rank].ok()) return absl::OkStatus();
          FLATPARAM_RETURN_IF_ERROR(h.PostForward());
          FLATPARAM_RETURN_IF_ERROR(h.PreBackward());
          FLATPARAM_RETURN_IF_ERROR(AddGradients(s, ctx, 0));
          FLATPARAM_RETURN_IF_ERROR(h.PostBackward(true));
          finalized[ctx.world_rank] = h.FinalizeBackward(true);
          return absl::OkStatus();
        });
    ASSERT_THAT(run, IsOk()) << ordered;
    for (int r = 0; r < 2; ++r) {
      const absl::Status& failed = ordered ? finalized[r] : forward[r];
      EXPECT_THAT(failed,
                  StatusIs(absl::StatusCode::kDeadlineExceeded,
                           HasSubstr("all-gather of the flat parameter")))
          << "rank " << r << " stream_ordered " << ordered;
      if (ordered) {
        EXPECT_THAT(forward[r], IsOk());
      }
    }
  }
}

// A forward-only loop never calls FinalizeBackward: the handle keeps at
// most four unchecked collectives and checks the oldest beyond that, so the
// failure still surfaces, a few forwards later.
TEST(AsyncFailureTest, ForwardOnlyLoopsStillReportAFailure) {
  const Scenario s = LateRankScenario(/*stream_ordered=*/true);
  std::vector<int> failed_at(2, -1);
  ASSERT_THAT(
      RunWithHandles(s,
                     [&](RankContext& ctx) -> absl::Status {
                       FlatParamHandle& h = ctx.handle;
                       for (int i = 0; i < 8; ++i) {
                         absl::Status st = h.PreForward();
                         if (st.ok()) st = h.PostForward();
                         if (!st.ok()) {
                           EXPECT_THAT(
                               st, StatusIs(absl::StatusCode::kDeadlineExceeded,
                                            HasSubstr("all-gather")));
                           failed_at[ctx.world_rank] = i;
                           break;
                         }
                       }
                       return absl::OkStatus();
                     }),
      IsOk());
  // The first all-gather is checked when the fifth is kept.
  EXPECT_EQ(failed_at, std::vector<int>({4, 4}));
}

TEST(AsyncMisuseTest, PendingUnshardBlocksWhatWouldRaceIt) {
  const Scenario s = Make(ShardingStrategy::kFullShard, 2);
  ASSERT_THAT(
      RunWithHandles(
          s,
          [&](RankContext& ctx) -> absl::Status {
            FlatParamHandle& h = ctx.handle;
            auto fp = [](absl::string_view text) {
              return StatusIs(absl::StatusCode::kFailedPrecondition,
                              HasSubstr(std::string(text)));
            };
            // Nothing pending: the finishes are no-ops.
            FLATPARAM_RETURN_IF_ERROR(h.FinishUnshard());
            FLATPARAM_RETURN_IF_ERROR(h.FinishReduceGrad());
            EXPECT_TRUE(h.NeedsUnshard());
            FLATPARAM_RETURN_IF_ERROR(h.StartUnshard());
            EXPECT_FALSE(h.NeedsUnshard());
            EXPECT_FALSE(h.is_unsharded());
            EXPECT_THAT(h.StartUnshard(), fp("already being unsharded"));
            EXPECT_THAT(h.Reshard(true), fp("an unshard is in flight"));
            EXPECT_THAT(h.SetTraining(false), fp("an unshard is in flight"));
            EXPECT_THAT(h.BeginSummonFullParams(false),
                        fp("an unshard is in flight"));
            EXPECT_THAT(h.UnshardedParam(0), fp("a.w"));
            // Unshard completes it.
            FLATPARAM_RETURN_IF_ERROR(h.Unshard());
            EXPECT_TRUE(h.is_unsharded());
            EXPECT_THAT(h.StartUnshard(), fp("already unsharded"));
            FLATPARAM_RETURN_IF_ERROR(h.Reshard(true));
            // A prefetch that no forward consumed: the catch-all reshard
            // completes and frees it.
            FLATPARAM_RETURN_IF_ERROR(h.StartUnshard());
            FLATPARAM_RETURN_IF_ERROR(h.FinalizeBackward(true));
            EXPECT_FALSE(h.unshard_pending());
            EXPECT_FALSE(h.is_unsharded());
            EXPECT_EQ(
                h.memory().current_bytes(MemoryCategory::kUnshardedParams), 0);
            // Destroyed with an unshard in flight: the destructor waits
            // for the all-gather before freeing its buffers (ASan would
            // catch a use after free).
            return h.StartUnshard();
          }),
      IsOk());
}

}  // namespace
}  // namespace flatparam
