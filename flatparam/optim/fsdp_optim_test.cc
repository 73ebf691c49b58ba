// Examples and error cases of fsdp_optim.h, on the simulator: exact shard
// contents on both paths (alignment padding 42, right padding 0), every
// error PyTorch reports (with the state and parameters named, and the same
// error on every rank), rank0_only, warnings, hybrid sharding, and the
// memory bound of streaming consolidation against gathering everything.
#include "flatparam/optim/fsdp_optim.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "comm/communicator.h"
#include "flatparam/base/dtype.h"
#include "flatparam/base/status_matchers.h"
#include "flatparam/flatten.h"
#include "flatparam/layout.h"
#include "flatparam/model_layout.h"
#include "flatparam/optim/optim_state.h"
#include "sim/sim.h"
#include "testing/handle_testutil.h"

namespace flatparam {
namespace optim {
namespace {

using ::testing::AllOf;
using ::testing::AnyOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::SizeIs;

HostTensor F32(std::vector<int64_t> shape, std::vector<float> values) {
  HostTensor t(DType::kFloat32, std::move(shape));
  EXPECT_EQ(t.numel(), static_cast<int64_t>(values.size()));
  for (size_t i = 0; i < values.size(); ++i) t.data_as<float>()[i] = values[i];
  return t;
}

HostTensor Iota(DType dtype, std::vector<int64_t> shape, double start) {
  HostTensor t(dtype, std::move(shape));
  for (int64_t i = 0; i < t.numel(); ++i) t.SetDouble(i, start + i);
  return t;
}

std::vector<float> Values(const OptimStateValue& v) {
  const HostTensor& t = std::get<HostTensor>(v);
  EXPECT_EQ(t.dtype(), DType::kFloat32);
  return std::vector<float>(t.data_as<float>(), t.data_as<float>() + t.numel());
}

absl::StatusOr<ModelLayout> Layout(std::vector<ParamSpec> params,
                                   std::vector<std::string> wrap,
                                   LayoutOptions options) {
  ModelSpec spec;
  spec.name = "m";
  spec.params = std::move(params);
  spec.wrap = std::move(wrap);
  return ModelLayout::Create(spec, options);
}

// Runs `fn` on every rank of a simulated world; returns each rank's status.
std::vector<absl::Status> RunRanks(
    int world_size, const std::function<absl::Status(SimCommunicator&)>& fn) {
  SimOptions options;
  options.world_size = world_size;
  auto world = SimWorld::Create(options);
  EXPECT_TRUE(world.ok()) << world.status();
  (void)(*world)->Run(fn);
  return (*world)->rank_statuses();
}

OptimStateOptions Quiet(bool orig = false) {
  OptimStateOptions o;
  o.use_orig_params = orig;
  o.on_warning = [](absl::string_view) {};
  return o;
}

// Consolidates `shards[r]` on every rank r; returns each rank's result.
std::vector<absl::StatusOr<OptimStateDict>> Consolidate(
    const ModelLayout& layout, const std::vector<OptimStateDict>& shards,
    const OptimStateOptions& options) {
  std::vector<absl::StatusOr<OptimStateDict>> out(shards.size(),
                                                  OptimStateDict());
  RunRanks(static_cast<int>(shards.size()), [&](SimCommunicator& comm) {
    out[comm.rank()] =
        ConsolidateOptimState(layout, shards[comm.rank()], comm, options);
    return out[comm.rank()].status();
  });
  return out;
}

std::vector<OptimStateDict> ShardAll(const ModelLayout& layout,
                                     const OptimStateDict& full,
                                     const OptimStateOptions& options) {
  std::vector<OptimStateDict> shards;
  for (int64_t r = 0; r < layout.options().world_size; ++r) {
    auto s = ShardFullOptimState(layout, full, r, options);
    EXPECT_TRUE(s.ok()) << s.status();
    shards.push_back(s.ok() ? *s : OptimStateDict());
  }
  return shards;
}

// Every rank failed with the same status.
void ExpectSameErrorOnAllRanks(
    const std::vector<absl::StatusOr<OptimStateDict>>& results) {
  for (size_t r = 1; r < results.size(); ++r) {
    EXPECT_EQ(results[r].status(), results[0].status()) << "rank " << r;
  }
}

// Two parameters, w1 [3] and w2 [2], AdamW-like state.
OptimStateDict TwoParamAdam() {
  OptimStateDict full;
  full.state["w1"]["exp_avg"] = F32({3}, {1, 2, 3});
  full.state["w1"]["step"] = ScalarTensor(DType::kFloat32, 3);
  full.state["w2"]["exp_avg"] = F32({2}, {4, 5});
  full.state["w2"]["step"] = ScalarTensor(DType::kFloat32, 3);
  full.param_groups.push_back(
      {{{"lr", 0.5}}, {ParamKey("w1"), ParamKey("w2")}});
  return full;
}

std::vector<ParamSpec> TwoParams(DType dtype) {
  return {{"w1", {3}, dtype}, {"w2", {2}, dtype}};
}

TEST(ShardFullOptimStateTest, FlatPathShardsLikeTheFlatParameter) {
  // Unaligned over 3 ranks: chunk 2 of 5 elements, right padding 0.
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      ModelLayout layout,
      Layout(TwoParams(DType::kFloat32), {}, {.world_size = 3}));
  const OptimStateDict full = TwoParamAdam();
  const std::vector<OptimStateDict> shards = ShardAll(layout, full, Quiet());
  const std::vector<std::vector<float>> want = {{1, 2}, {3, 4}, {5, 0}};
  for (int r = 0; r < 3; ++r) {
    ASSERT_THAT(shards[r].state, SizeIs(1));
    const ParamState& st = shards[r].state.at(ParamKey(int64_t{0}));
    EXPECT_EQ(Values(st.at("exp_avg")), want[r]) << "rank " << r;
    EXPECT_TRUE(BitwiseEqual(st.at("step"), ScalarTensor(DType::kFloat32, 3)));
    // Groups list flat-parameter indices.
    ASSERT_THAT(shards[r].param_groups, SizeIs(1));
    EXPECT_THAT(shards[r].param_groups[0].params,
                ElementsAre(ParamKey(int64_t{0})));
  }
  std::vector<absl::StatusOr<OptimStateDict>> got =
      Consolidate(layout, shards, Quiet());
  for (int r = 0; r < 3; ++r) {
    ASSERT_THAT(got[r], IsOk());
    EXPECT_EQ(FirstDifference(*got[r], full), std::nullopt);
  }
}

TEST(ShardFullOptimStateTest, FlatPathAlignmentPaddingHolds42) {
  // bfloat16 parameters align to 8 elements: w1 at 0..2, padding 3..7, w2
  // at 8..9, world-size padding 10..11; chunk 4. The float32 state keeps
  // the parameters' layout.
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      ModelLayout layout, Layout(TwoParams(DType::kBFloat16), {},
                                 {.world_size = 3, .align_addresses = true}));
  const std::vector<OptimStateDict> shards =
      ShardAll(layout, TwoParamAdam(), Quiet());
  const std::vector<std::vector<float>> want = {
      {1, 2, 3, 42}, {42, 42, 42, 42}, {4, 5, 42, 42}};
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(Values(shards[r].state.at(ParamKey(int64_t{0})).at("exp_avg")),
              want[r])
        << "rank " << r;
  }
  auto got = Consolidate(layout, shards, Quiet());
  ASSERT_THAT(got[1], IsOk());
  EXPECT_EQ(FirstDifference(*got[1], TwoParamAdam()), std::nullopt);
}

TEST(ShardFullOptimStateTest, OrigParamsPathKeepsEachRanksPieces) {
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      ModelLayout layout,
      Layout(TwoParams(DType::kFloat32), {}, {.world_size = 3}));
  const std::vector<OptimStateDict> shards =
      ShardAll(layout, TwoParamAdam(), Quiet(/*orig=*/true));
  // Rank 0 holds w1[0:2], rank 1 w1[2:3] and w2[0:1], rank 2 w2[1:2].
  ASSERT_THAT(shards[0].state, SizeIs(1));
  EXPECT_THAT(Values(shards[0].state.at("w1").at("exp_avg")),
              ElementsAre(1, 2));
  ASSERT_THAT(shards[1].state, SizeIs(2));
  EXPECT_THAT(Values(shards[1].state.at("w1").at("exp_avg")), ElementsAre(3));
  EXPECT_THAT(Values(shards[1].state.at("w2").at("exp_avg")), ElementsAre(4));
  EXPECT_TRUE(BitwiseEqual(shards[1].state.at("w2").at("step"),
                           ScalarTensor(DType::kFloat32, 3)));
  ASSERT_THAT(shards[2].state, SizeIs(1));
  EXPECT_THAT(Values(shards[2].state.at("w2").at("exp_avg")), ElementsAre(5));
  // Groups keep names.
  EXPECT_THAT(shards[2].param_groups[0].params,
              ElementsAre(ParamKey("w1"), ParamKey("w2")));
  auto got = Consolidate(layout, shards, Quiet(true));
  for (int r = 0; r < 3; ++r) {
    ASSERT_THAT(got[r], IsOk());
    EXPECT_EQ(FirstDifference(*got[r], TwoParamAdam()), std::nullopt);
  }
}

TEST(ShardFullOptimStateTest, OrigParamsZeroNumelParameterAtABoundary) {
  // z (0 elements) sits at offset 2, where rank 1's shard starts: no shard
  // holds it (PyTorch would drop its state); rank 0 keeps it.
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      ModelLayout layout,
      Layout({{"w1", {2}}, {"z", {3, 0}}, {"w2", {2}}}, {}, {.world_size = 2}));
  OptimStateDict full;
  full.state["w1"]["exp_avg"] = F32({2}, {1, 2});
  full.state["z"]["exp_avg"] = HostTensor(DType::kFloat32, {3, 0});
  full.state["z"]["step"] = ScalarTensor(DType::kFloat32, 9);
  full.state["w2"]["exp_avg"] = F32({2}, {3, 4});
  const std::vector<OptimStateDict> shards =
      ShardAll(layout, full, Quiet(true));
  ASSERT_TRUE(shards[0].state.count("z"));
  EXPECT_FALSE(shards[1].state.count("z"));
  auto got = Consolidate(layout, shards, Quiet(true));
  ASSERT_THAT(got[1], IsOk());
  EXPECT_EQ(FirstDifference(*got[1], full), std::nullopt);
}

TEST(ShardFullOptimStateTest, FlatPathGivesZerosToParametersWithoutState) {
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      ModelLayout layout,
      Layout(TwoParams(DType::kFloat32), {}, {.world_size = 2}));
  OptimStateDict full;
  full.state["w2"]["momentum_buffer"] = F32({2}, {4, 5});
  auto got = Consolidate(layout, ShardAll(layout, full, Quiet()), Quiet());
  ASSERT_THAT(got[0], IsOk());
  EXPECT_EQ(Values(got[0]->state.at("w1").at("momentum_buffer")),
            std::vector<float>({0, 0, 0}));
  EXPECT_EQ(Values(got[0]->state.at("w2").at("momentum_buffer")),
            std::vector<float>({4, 5}));
}

TEST(ShardFullOptimStateTest, NoShardAndOneRankHoldEverything) {
  for (const LayoutOptions& options :
       {LayoutOptions{.world_size = 3, .strategy = ShardingStrategy::kNoShard},
        LayoutOptions{.world_size = 1}}) {
    FLATPARAM_ASSERT_OK_AND_ASSIGN(
        ModelLayout layout, Layout(TwoParams(DType::kFloat32), {}, options));
    for (bool orig : {false, true}) {
      const std::vector<OptimStateDict> shards =
          ShardAll(layout, TwoParamAdam(), Quiet(orig));
      for (const OptimStateDict& s : shards) {
        if (orig) {
          // Whole, in the parameter's shape.
          EXPECT_EQ(FirstDifference(s, TwoParamAdam()), std::nullopt);
        } else {
          EXPECT_EQ(Values(s.state.at(ParamKey(int64_t{0})).at("exp_avg")),
                    std::vector<float>({1, 2, 3, 4, 5}));
        }
      }
      auto got = Consolidate(layout, shards, Quiet(orig));
      ASSERT_THAT(got.back(), IsOk());
      EXPECT_EQ(FirstDifference(*got.back(), TwoParamAdam()), std::nullopt);
    }
  }
}

TEST(ShardFullOptimStateTest, AcceptsParameterIds) {
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      ModelLayout layout,
      Layout(TwoParams(DType::kFloat32), {}, {.world_size = 2}));
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      OptimStateDict by_id,
      RekeyOptimStateDict(TwoParamAdam(), OptimStateKeyType::kParamId, layout));
  ASSERT_TRUE(by_id.state.count(ParamKey(int64_t{1})));
  FLATPARAM_ASSERT_OK_AND_ASSIGN(OptimStateDict a,
                                 ShardFullOptimState(layout, by_id, 1));
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      OptimStateDict b, ShardFullOptimState(layout, TwoParamAdam(), 1));
  EXPECT_EQ(a, b);
}

// ---------------------------------------------------------------------------
// Flattening errors (PyTorch's `_flatten_optim_state` and friends).
// ---------------------------------------------------------------------------

class FlattenErrorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto layout = Layout({{"m.a", {2, 2}}, {"m.b", {3}}, {"s", {}}}, {"m"},
                         {.world_size = 2});
    ASSERT_THAT(layout, IsOk());
    layout_ = std::make_unique<ModelLayout>(*std::move(layout));
  }

  // Shards on rank 0, and scatters from rank 0 over two ranks, which must
  // fail the same way on both ranks.
  absl::Status Shard(const OptimStateDict& full, bool orig = false) {
    absl::Status local =
        ShardFullOptimState(*layout_, full, 0, Quiet(orig)).status();
    std::vector<absl::StatusOr<OptimStateDict>> scattered(2, OptimStateDict());
    RunRanks(2, [&](SimCommunicator& comm) {
      OptimStateOptions o = Quiet(orig);
      o.rank0_only = true;
      scattered[comm.rank()] = OptimStateDictToLoad(
          *layout_, comm.rank() == 0 ? full : OptimStateDict(), comm, o);
      return scattered[comm.rank()].status();
    });
    EXPECT_EQ(scattered[0].status().code(), local.code());
    EXPECT_EQ(scattered[1].status().code(), local.code());
    EXPECT_THAT(std::string(scattered[1].status().message()),
                HasSubstr(std::string(local.message())));
    return local;
  }

  std::unique_ptr<ModelLayout> layout_;
};

TEST_F(FlattenErrorTest, DifferingStateNames) {
  OptimStateDict full;
  full.state["m.a"]["exp_avg"] = HostTensor(DType::kFloat32, {2, 2});
  full.state["m.b"]["exp_avg_sq"] = HostTensor(DType::kFloat32, {3});
  EXPECT_THAT(Shard(full),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("Differing optimizer state names for "
                                       "the unflattened parameters: "
                                       "['m.a', 'm.b']"),
                             HasSubstr("'m.b' has ['exp_avg_sq']"))));
}

TEST_F(FlattenErrorTest, DifferingTypes) {
  OptimStateDict full;
  full.state["m.a"]["exp_avg"] = HostTensor(DType::kFloat32, {2, 2});
  full.state["m.b"]["exp_avg"] = 1.5;
  EXPECT_THAT(
      Shard(full),
      StatusIs(absl::StatusCode::kInvalidArgument,
               AllOf(HasSubstr("Differing optimizer state types for state "
                               "exp_avg"),
                     HasSubstr("tensor(float32, [2, 2]), 1.5"),
                     HasSubstr("['m.a', 'm.b']"))));
}

TEST_F(FlattenErrorTest, DifferingDtypes) {
  OptimStateDict full;
  full.state["m.a"]["exp_avg"] = HostTensor(DType::kFloat32, {2, 2});
  full.state["m.b"]["exp_avg"] = HostTensor(DType::kBFloat16, {3});
  EXPECT_THAT(Shard(full),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("same dtype but got dtypes {float32, "
                                       "bfloat16} for state exp_avg"),
                             HasSubstr("['m.a', 'm.b']"))));
}

TEST_F(FlattenErrorTest, ShapeDiffersFromParameter) {
  OptimStateDict full;
  full.state["m.a"]["exp_avg"] = HostTensor(DType::kFloat32, {4});
  full.state["m.b"]["exp_avg"] = HostTensor(DType::kFloat32, {3});
  EXPECT_THAT(Shard(full),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("Tensor optimizer state does not have same "
                                 "shape as its parameter: [4] [2, 2] (state "
                                 "exp_avg of parameter 'm.a')")));
  // The original-parameter path checks shapes too.
  EXPECT_THAT(Shard(full, /*orig=*/true),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("(state exp_avg of parameter 'm.a')")));
}

TEST_F(FlattenErrorTest, DifferingScalarValues) {
  OptimStateDict full;
  full.state["m.a"]["step"] = ScalarTensor(DType::kFloat32, 3);
  full.state["m.b"]["step"] = ScalarTensor(DType::kFloat32, 4);
  EXPECT_THAT(Shard(full),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("must have scalar state with the same value "
                                 "and dtype but got values {tensor(3.0, "
                                 "dtype=float32), tensor(4.0, dtype=float32)} "
                                 "and dtypes {float32} for state step and "
                                 "unflattened parameter names ['m.a', "
                                 "'m.b']")));
  full.state["m.b"]["step"] = ScalarTensor(DType::kFloat64, 3);
  EXPECT_THAT(Shard(full), StatusIs(absl::StatusCode::kInvalidArgument,
                                    HasSubstr("dtypes {float32, float64}")));
  OptimStateDict nt;
  nt.state["m.a"]["lr_scale"] = 1.0;
  nt.state["m.b"]["lr_scale"] = 2.0;
  EXPECT_THAT(Shard(nt),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("got values {1.0, 2.0} for state lr_scale")));
}

TEST_F(FlattenErrorTest, ScalarStateMissingForAParameter) {
  // Imposing a step on a parameter without one would change its update.
  OptimStateDict full;
  full.state["m.a"]["step"] = ScalarTensor(DType::kFloat32, 3);
  EXPECT_THAT(Shard(full),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("values {tensor(3.0, dtype=float32), None}")));
}

TEST_F(FlattenErrorTest, ZeroDimensionParameterWithoutTensorState) {
  OptimStateDict full;
  full.state["m.a"]["exp_avg"] = HostTensor(DType::kFloat32, {2, 2});
  full.state["m.b"]["exp_avg"] = HostTensor(DType::kFloat32, {3});
  // "s" is the root unit's only parameter, 0-d, and its state is 0-d: fine.
  full.state["s"]["exp_avg"] = ScalarTensor(DType::kFloat32, 1);
  EXPECT_THAT(Shard(full), IsOk());
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      ModelLayout one_unit,
      Layout({{"a", {2}}, {"s", {}}}, {}, {.world_size = 2}));
  OptimStateDict bad;
  bad.state["a"]["exp_avg"] = HostTensor(DType::kFloat32, {2});
  EXPECT_THAT(ShardFullOptimState(one_unit, bad, 0),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("Flattening a zero-dimension parameter is "
                                 "not supported: parameter 's' has no state "
                                 "exp_avg")));
}

TEST_F(FlattenErrorTest, IntegerTensorState) {
  OptimStateDict full;
  full.state["m.a"]["count"] = HostTensor(DType::kInt64, {2, 2});
  EXPECT_THAT(Shard(full),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("Cannot flatten integer dtype tensors: state "
                                 "count has dtype int64")));
}

TEST_F(FlattenErrorTest, EmptyState) {
  OptimStateDict full;
  full.state["m.a"];
  EXPECT_THAT(Shard(full), StatusIs(absl::StatusCode::kInvalidArgument,
                                    HasSubstr("The state of ('m.a', 'm.b') "
                                              "is empty")));
  // The original-parameter path shards nothing for it.
  EXPECT_THAT(Shard(full, /*orig=*/true), IsOk());
}

TEST_F(FlattenErrorTest, OrigParamsOneDtypePerStateWithinAFlatParameter) {
  OptimStateDict full;
  full.state["m.a"]["exp_avg"] = HostTensor(DType::kFloat32, {2, 2});
  full.state["m.b"]["exp_avg"] = HostTensor(DType::kFloat64, {3});
  EXPECT_THAT(Shard(full, /*orig=*/true),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("state exp_avg is float32 for 'm.a' and "
                                 "float64 for 'm.b'")));
}

TEST_F(FlattenErrorTest, UnknownGroupParameterAndBadIds) {
  OptimStateDict full;
  full.param_groups.push_back({{}, {ParamKey("m.a"), ParamKey("nope")}});
  EXPECT_THAT(Shard(full), StatusIs(absl::StatusCode::kInvalidArgument,
                                    HasSubstr("param_groups[0] lists 'nope'")));
  OptimStateDict ids;
  ids.state[ParamKey(int64_t{7})]["step"] = 1.0;
  EXPECT_THAT(Shard(ids), StatusIs(absl::StatusCode::kInvalidArgument,
                                   HasSubstr("parameter ID 7")));
  EXPECT_THAT(ShardFullOptimState(*layout_, OptimStateDict(), 2),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("rank 2 is outside")));
}

// ---------------------------------------------------------------------------
// Pass-through: unmanaged parameters, user-defined keys, shared parameters.
// ---------------------------------------------------------------------------

TEST(PassThroughTest, UserKeysWarnAndUnmanagedParamsDoNot) {
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      ModelLayout layout,
      Layout({{"w", {4}}, {"v", {}, DType::kFloat32, true, "w"}}, {},
             {.world_size = 2}));
  for (bool orig : {false, true}) {
    OptimStateDict full;
    full.state["w"]["exp_avg"] = F32({4}, {1, 2, 3, 4});
    full.state["ignored.bias"]["momentum_buffer"] = F32({2}, {7, 8});
    full.state["__user__"]["counter"] = int64_t{5};
    // A shared parameter's alias: keyed once, under the first name.
    full.state["v"]["exp_avg"] = F32({4}, {9, 9, 9, 9});
    full.param_groups.push_back(
        {{}, {ParamKey("w"), ParamKey("ignored.bias")}});
    std::vector<std::string> warnings;
    OptimStateOptions options;
    options.use_orig_params = orig;
    options.unmanaged_params = {"ignored.bias"};
    options.on_warning = [&](absl::string_view w) { warnings.emplace_back(w); };
    const std::vector<OptimStateDict> shards = ShardAll(layout, full, options);
    ASSERT_THAT(warnings, SizeIs(4));  // two keys, two ranks
    EXPECT_THAT(warnings[0], HasSubstr("'__user__'"));
    EXPECT_THAT(warnings[1],
                AllOf(HasSubstr("'v'"), HasSubstr("by its first name 'w'")));
    for (const OptimStateDict& s : shards) {
      EXPECT_TRUE(
          BitwiseEqual(s.state.at("ignored.bias").at("momentum_buffer"),
                       full.state.at("ignored.bias").at("momentum_buffer")));
      EXPECT_TRUE(s.state.count("__user__"));
    }
    if (!orig) {
      EXPECT_THAT(shards[0].param_groups[0].params,
                  ElementsAre(ParamKey(int64_t{0}), ParamKey("ignored.bias")));
    }
    warnings.clear();
    auto got = Consolidate(layout, shards, options);
    ASSERT_THAT(got[0], IsOk());
    EXPECT_EQ(FirstDifference(*got[0], full), std::nullopt);
    EXPECT_THAT(warnings, SizeIs(4));
  }
}

// ---------------------------------------------------------------------------
// Consolidation errors: the same on every rank, before any tensor moves.
// ---------------------------------------------------------------------------

class ConsolidateErrorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto layout = Layout({{"a.w", {3}}, {"a.b", {2}}, {"c", {4}}}, {"a"},
                         {.world_size = 3});
    ASSERT_THAT(layout, IsOk());
    layout_ = std::make_unique<ModelLayout>(*std::move(layout));
    full_.state["a.w"]["exp_avg"] = Iota(DType::kFloat32, {3}, 1);
    full_.state["a.b"]["exp_avg"] = Iota(DType::kFloat32, {2}, 4);
    full_.state["c"]["exp_avg"] = Iota(DType::kFloat32, {4}, 6);
    for (auto& [k, st] : full_.state)
      st["step"] = ScalarTensor(DType::kFloat32, 2);
  }

  std::unique_ptr<ModelLayout> layout_;
  OptimStateDict full_;
};

TEST_F(ConsolidateErrorTest, RankMissingStatesRankZeroHas) {
  std::vector<OptimStateDict> shards = ShardAll(*layout_, full_, Quiet());
  shards[2].state.erase(ParamKey(int64_t{1}));
  shards[1].state.erase(ParamKey(int64_t{0}));
  auto got = Consolidate(*layout_, shards, Quiet());
  EXPECT_THAT(got[0],
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr("FSDP currently requires each rank to "
                                       "have at least the optimizer states "
                                       "needed by rank 0's optimizer"),
                             HasSubstr("\nRank 1 is missing states for the "
                                       "parameters: [('c',)]"),
                             HasSubstr("\nRank 2 is missing states for the "
                                       "parameters: [('a.w', 'a.b')]"))));
  ExpectSameErrorOnAllRanks(got);
}

TEST_F(ConsolidateErrorTest, RanksDisagreeOnNamesOrShapes) {
  std::vector<OptimStateDict> shards = ShardAll(*layout_, full_, Quiet());
  shards[1].state.at(ParamKey(int64_t{0})).erase("step");
  auto got = Consolidate(*layout_, shards, Quiet());
  EXPECT_THAT(got[0], StatusIs(absl::StatusCode::kInvalidArgument,
                               AllOf(HasSubstr("rank 1 has ['exp_avg']"),
                                     HasSubstr("flat parameter 0 (unit "
                                               "<root>, parameters ['c'])"))));
  ExpectSameErrorOnAllRanks(got);

  shards = ShardAll(*layout_, full_, Quiet());
  shards[2].state.at(ParamKey(int64_t{1}))["exp_avg"] =
      HostTensor(DType::kFloat32, {5});
  got = Consolidate(*layout_, shards, Quiet());
  EXPECT_THAT(got[0],
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("Tensor optimizer state exp_avg of flat "
                                 "parameter 1 (unit 'a', parameters ['a.w', "
                                 "'a.b']) on rank 2 is tensor(float32, [5]), "
                                 "but a flat parameter's sharded state has "
                                 "shape [2]")));
  ExpectSameErrorOnAllRanks(got);
}

TEST_F(ConsolidateErrorTest, FlatRanksDisagreeOnAReplicatedValue) {
  std::vector<OptimStateDict> shards = ShardAll(*layout_, full_, Quiet());
  shards[2].state.at(ParamKey(int64_t{1}))["step"] =
      ScalarTensor(DType::kFloat32, 7);
  shards[1].state.at(ParamKey(int64_t{1}))["step"] =
      ScalarTensor(DType::kFloat32, 5);
  // PyTorch's default: each rank keeps its own value, with a warning that
  // names the state, the flat parameter and every differing rank.
  std::vector<std::vector<std::string>> warnings(3);
  std::vector<absl::StatusOr<OptimStateDict>> got(3, OptimStateDict());
  RunRanks(3, [&](SimCommunicator& comm) {
    OptimStateOptions options = Quiet();
    options.on_warning = [&, r = comm.rank()](absl::string_view m) {
      warnings[r].emplace_back(m);
    };
    got[comm.rank()] =
        ConsolidateOptimState(*layout_, shards[comm.rank()], comm, options);
    return got[comm.rank()].status();
  });
  const double step[3] = {2, 5, 7};
  for (int r = 0; r < 3; ++r) {
    ASSERT_THAT(got[r], IsOk()) << "rank " << r;
    for (const char* fqn : {"a.w", "a.b"}) {
      EXPECT_THAT(Values(got[r]->state.at(fqn).at("step")),
                  ElementsAre(step[r]))
          << "rank " << r << " " << fqn;
    }
    EXPECT_THAT(Values(got[r]->state.at("c").at("step")), ElementsAre(2));
    EXPECT_THAT(
        warnings[r],
        ElementsAre(AllOf(
            HasSubstr("state step of flat parameter 1"),
            HasSubstr("rank 0 has tensor(2.0, dtype=float32), rank 1 has "
                      "tensor(5.0, dtype=float32), rank 2 has tensor(7.0, "
                      "dtype=float32)"),
            HasSubstr("each rank keeps its own value"))))
        << "rank " << r;
  }
  // rank0_only: rank 0's values, as PyTorch saves them.
  OptimStateOptions rank0 = Quiet();
  rank0.rank0_only = true;
  got = Consolidate(*layout_, shards, rank0);
  ASSERT_THAT(got[0], IsOk());
  EXPECT_EQ(FirstDifference(*got[0], full_), std::nullopt);

  // The strict check, on request: the same error on every rank.
  OptimStateOptions strict = Quiet();
  strict.strict_replicated_values = true;
  got = Consolidate(*layout_, shards, strict);
  EXPECT_THAT(got[0],
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("state step of flat parameter 1"),
                             HasSubstr("rank 0 has tensor(2.0, "
                                       "dtype=float32), rank 1 has "
                                       "tensor(5.0, dtype=float32)"))));
  ExpectSameErrorOnAllRanks(got);
}

TEST_F(ConsolidateErrorTest, OrigParamsRankMissingItsPiece) {
  std::vector<OptimStateDict> shards = ShardAll(*layout_, full_, Quiet(true));
  // Rank 1 holds a.w[2:3] and a.b[0:1]; drop a.b's exp_avg.
  shards[1].state.at("a.b").erase("exp_avg");
  auto got = Consolidate(*layout_, shards, Quiet(true));
  EXPECT_THAT(got[0], StatusIs(absl::StatusCode::kFailedPrecondition,
                               HasSubstr("\nRank 1 is missing states for the "
                                         "parameters: ['a.b' (exp_avg)]")));
  ExpectSameErrorOnAllRanks(got);
}

TEST_F(ConsolidateErrorTest, OrigParamsTrainableParameterWithoutState) {
  OptimStateDict full = full_;
  full.state.erase("a.b");
  auto got =
      Consolidate(*layout_, ShardAll(*layout_, full, Quiet(true)), Quiet(true));
  EXPECT_THAT(got[0],
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("a.b is not in the optimizer state. The "
                                 "FSDPParamInfo has the param keys ['a.b', "
                                 "'a.w'] while the optimizer has the param "
                                 "keys ['a.w'].")));
  ExpectSameErrorOnAllRanks(got);
}

TEST_F(ConsolidateErrorTest, OrigParamsRanksDisagreeOnAScalar) {
  std::vector<OptimStateDict> shards = ShardAll(*layout_, full_, Quiet(true));
  shards[1].state.at("a.w")["step"] = ScalarTensor(DType::kFloat32, 5);
  auto got = Consolidate(*layout_, shards, Quiet(true));
  EXPECT_THAT(got[0],
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("Different ranks have different values for "
                                 "step of parameter 'a.w': rank 0 has "
                                 "tensor(2.0, dtype=float32), rank 1 has "
                                 "tensor(5.0, dtype=float32)")));
  ExpectSameErrorOnAllRanks(got);
}

TEST_F(ConsolidateErrorTest, CommunicatorOfTheWrongSize) {
  auto got = Consolidate(*layout_, std::vector<OptimStateDict>(2), Quiet());
  EXPECT_THAT(got[0], StatusIs(absl::StatusCode::kInvalidArgument,
                               HasSubstr("the communicator has 2 ranks but "
                                         "the layout is sharded over 3")));
}

TEST_F(ConsolidateErrorTest, Rank0OnlyReturnsEmptyElsewhere) {
  OptimStateOptions options = Quiet();
  options.rank0_only = true;
  auto got = Consolidate(*layout_, ShardAll(*layout_, full_, options), options);
  ASSERT_THAT(got[0], IsOk());
  EXPECT_EQ(FirstDifference(*got[0], full_), std::nullopt);
  for (int r = 1; r < 3; ++r) {
    ASSERT_THAT(got[r], IsOk());
    EXPECT_TRUE(got[r]->empty());
  }
}

// ---------------------------------------------------------------------------
// Sharded dicts keyed as the rank's optimizer keys them.
// ---------------------------------------------------------------------------

class ShardedKeysTest : public ConsolidateErrorTest {
 protected:
  void SetUp() override {
    ConsolidateErrorTest::SetUp();
    full_.param_groups.push_back(
        // In flat-parameter order, which the flat path's groups keep.
        {{{"lr", 0.5}}, {ParamKey("c"), ParamKey("a.w"), ParamKey("a.b")}});
  }
  OptimStateOptions Keys(bool orig, ShardedKeys keys,
                         std::vector<std::string> order = {}) {
    OptimStateOptions o = Quiet(orig);
    o.sharded_keys = keys;
    o.optimizer_params = std::move(order);
    return o;
  }
};

TEST_F(ShardedKeysTest, FlatPathNamesAndIds) {
  EXPECT_EQ(FlatParamFqn(layout_->flat_params()[0]), "_flat_param");
  EXPECT_EQ(FlatParamFqn(layout_->flat_params()[1]), "a._flat_param");
  // The rank's optimizer holds the flat parameters in its own order.
  const OptimStateOptions names = Keys(false, ShardedKeys::kNames);
  const OptimStateOptions ids =
      Keys(false, ShardedKeys::kOptimizerIds, {"a._flat_param", "_flat_param"});
  std::vector<OptimStateDict> by_name, by_id;
  for (int64_t r = 0; r < 3; ++r) {
    FLATPARAM_ASSERT_OK_AND_ASSIGN(
        OptimStateDict plain, ShardFullOptimState(*layout_, full_, r, Quiet()));
    FLATPARAM_ASSERT_OK_AND_ASSIGN(
        OptimStateDict n, ShardFullOptimState(*layout_, full_, r, names));
    FLATPARAM_ASSERT_OK_AND_ASSIGN(
        OptimStateDict i, ShardFullOptimState(*layout_, full_, r, ids));
    EXPECT_EQ(n.state.at("_flat_param"), plain.state.at(int64_t{0}));
    EXPECT_EQ(n.state.at("a._flat_param"), plain.state.at(int64_t{1}));
    EXPECT_EQ(i.state.at(int64_t{0}), plain.state.at(int64_t{1}));
    EXPECT_EQ(i.state.at(int64_t{1}), plain.state.at(int64_t{0}));
    EXPECT_THAT(i.param_groups[0].params,
                ElementsAre(ParamKey(int64_t{0}), ParamKey(int64_t{1})));
    EXPECT_THAT(
        n.param_groups[0].params,
        ElementsAre(ParamKey("_flat_param"), ParamKey("a._flat_param")));
    by_name.push_back(std::move(n));
    by_id.push_back(std::move(i));
  }
  for (const auto* o : {&names, &ids}) {
    auto got = Consolidate(*layout_, o == &names ? by_name : by_id, *o);
    // Groups come back in the rank's optimizer's order (as PyTorch unflattens
    // them): with IDs, unit "a" first.
    OptimStateDict want = full_;
    if (o == &ids) {
      want.param_groups[0].params = {ParamKey("a.w"), ParamKey("a.b"),
                                     ParamKey("c")};
    }
    for (int r = 0; r < 3; ++r) {
      ASSERT_THAT(got[r], IsOk());
      EXPECT_EQ(FirstDifference(*got[r], want), std::nullopt) << "rank " << r;
    }
  }
  // A flat parameter the optimizer does not hold, and a bad ID on one rank:
  // errors naming them, on every rank (no hang).
  EXPECT_THAT(ShardFullOptimState(
                  *layout_, full_, 0,
                  Keys(false, ShardedKeys::kOptimizerIds, {"_flat_param"})),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("flat parameter 'a._flat_param' has "
                                 "optimizer state but is not in "
                                 "optimizer_params")));
  by_id[1].state[int64_t{7}] = by_id[1].state.at(int64_t{0});
  auto got = Consolidate(*layout_, by_id, ids);
  EXPECT_THAT(got[0], StatusIs(absl::StatusCode::kInvalidArgument,
                               HasSubstr("rank 1's sharded optimizer state: "
                                         "optimizer ID 7 is outside")));
  ExpectSameErrorOnAllRanks(got);
}

TEST_F(ShardedKeysTest, OrigParamsNamedOptimizerHasEveryParameter) {
  const OptimStateOptions names = Keys(true, ShardedKeys::kNames);
  std::vector<OptimStateDict> shards;
  for (int64_t r = 0; r < 3; ++r) {
    FLATPARAM_ASSERT_OK_AND_ASSIGN(
        OptimStateDict plain,
        ShardFullOptimState(*layout_, full_, r, Quiet(true)));
    FLATPARAM_ASSERT_OK_AND_ASSIGN(
        OptimStateDict n, ShardFullOptimState(*layout_, full_, r, names));
    // Every parameter on every rank; the ones without a piece here get
    // zero-element tensors and the replicated step.
    for (const char* fqn : {"a.w", "a.b", "c"}) {
      ASSERT_EQ(n.state.count(fqn), 1u) << "rank " << r << " " << fqn;
      if (plain.state.count(fqn) > 0) {
        EXPECT_EQ(n.state.at(fqn), plain.state.at(fqn));
      } else {
        const ParamState& st = n.state.at(fqn);
        EXPECT_EQ(std::get<HostTensor>(st.at("exp_avg")).shape(),
                  std::vector<int64_t>{0});
        EXPECT_EQ(st.at("step"), full_.state.at(fqn).at("step"));
      }
    }
    shards.push_back(std::move(n));
  }
  // Rank 0 holds no piece of a.b, rank 2 none of a.w or c.
  EXPECT_EQ(
      std::get<HostTensor>(shards[0].state.at("a.b").at("exp_avg")).numel(), 0);
  EXPECT_EQ(std::get<HostTensor>(shards[2].state.at("c").at("exp_avg")).numel(),
            0);
  auto got = Consolidate(*layout_, shards, names);
  for (int r = 0; r < 3; ++r) {
    ASSERT_THAT(got[r], IsOk());
    EXPECT_EQ(FirstDifference(*got[r], full_), std::nullopt) << "rank " << r;
  }
  // IDs in the optimizer's own order.
  const OptimStateOptions ids =
      Keys(true, ShardedKeys::kOptimizerIds, {"c", "a.w", "a.b"});
  FLATPARAM_ASSERT_OK_AND_ASSIGN(OptimStateDict i,
                                 ShardFullOptimState(*layout_, full_, 1, ids));
  EXPECT_EQ(i.state.at(int64_t{1}), shards[1].state.at("a.w"));
  EXPECT_EQ(i.state.at(int64_t{0}), shards[1].state.at("c"));
  EXPECT_THAT(i.param_groups[0].params,
              ElementsAre(ParamKey(int64_t{0}), ParamKey(int64_t{1}),
                          ParamKey(int64_t{2})));
}

// ---------------------------------------------------------------------------
// A NamedOptimizer over a wrapped model: keys with wrapper prefixes.
// ---------------------------------------------------------------------------

// Three nested units (root, layers.0, layers.0.mlp) and, in the optimizer,
// an ignored module's parameter and two user-defined states, one of whose
// keys happens to start with a wrapper prefix.
class WrappedNamesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto layout = Layout({{"layers.0.mlp.w", {4}},
                          {"layers.0.mlp.b", {2}},
                          {"layers.0.norm", {3}},
                          {"head", {5}}},
                         {"layers.0", "layers.0.mlp"}, {.world_size = 2});
    ASSERT_THAT(layout, IsOk());
    layout_ = std::make_unique<ModelLayout>(*std::move(layout));
    double start = 1;
    for (const char* fqn :
         {"head", "layers.0.norm", "layers.0.mlp.w", "layers.0.mlp.b"}) {
      const std::vector<int64_t> shape =
          layout_->spec().params[ParamIndex(fqn)].shape;
      full_.state[fqn]["exp_avg"] = Iota(DType::kFloat32, shape, start);
      full_.state[fqn]["step"] = ScalarTensor(DType::kFloat32, 4);
      start += 10;
    }
    full_.state["ignored.bias"]["exp_avg"] = F32({2}, {7, 8});
    full_.state["ignored.bias"]["step"] = ScalarTensor(DType::kFloat32, 4);
    full_.state["__user__"]["counter"] = int64_t{5};
    full_.state["_fsdp_wrapped_module.scheduler"]["last_epoch"] = int64_t{3};
    // In flat-parameter order (root, layers.0, layers.0.mlp), which the
    // flat path's groups keep.
    full_.param_groups.push_back(
        {{{"lr", 0.5}},
         {ParamKey("head"), ParamKey("layers.0.norm"),
          ParamKey("layers.0.mlp.w"), ParamKey("layers.0.mlp.b"),
          ParamKey("ignored.bias")}});
  }

  size_t ParamIndex(const std::string& fqn) const {
    const auto& params = layout_->spec().params;
    for (size_t i = 0; i < params.size(); ++i) {
      if (params[i].fqn == fqn) return i;
    }
    ADD_FAILURE() << fqn;
    return 0;
  }

  // Clean name -> the name a NamedOptimizer over the wrapped model keys it
  // by (its `named_parameters()` name), as different wrappings spell them:
  // FSDP's prefix at depths one to three, the activation-checkpoint
  // wrapper's, torch.compile's.
  static std::map<std::string, std::string> Wrapped(bool orig) {
    if (orig) {
      return {
          {"head", "_fsdp_wrapped_module.head"},
          {"layers.0.norm",
           "_fsdp_wrapped_module.layers.0._fsdp_wrapped_module.norm"},
          {"layers.0.mlp.w",
           "_fsdp_wrapped_module.layers.0._fsdp_wrapped_module.mlp."
           "_checkpoint_wrapped_module._fsdp_wrapped_module.w"},
          {"layers.0.mlp.b", "_orig_mod.layers.0.mlp.b"},
          {"ignored.bias", "_fsdp_wrapped_module.ignored.bias"},
      };
    }
    return {
        {"_flat_param", "_fsdp_wrapped_module._flat_param"},
        {"layers.0._flat_param",
         "_orig_mod._fsdp_wrapped_module.layers.0._fsdp_wrapped_module."
         "_flat_param"},
        {"layers.0.mlp._flat_param",
         "_fsdp_wrapped_module.layers.0._fsdp_wrapped_module.mlp."
         "_checkpoint_wrapped_module._fsdp_wrapped_module._flat_param"},
        {"ignored.bias", "_fsdp_wrapped_module.ignored.bias"},
    };
  }

  // The optimizer's parameters, in its order, by wrapped name.
  static std::vector<std::string> WrappedOrder(bool orig) {
    std::vector<std::string> order;
    const std::map<std::string, std::string> wrapped = Wrapped(orig);
    for (const char* name :
         orig ? std::vector<const char*>{"head", "layers.0.norm",
                                         "layers.0.mlp.w", "layers.0.mlp.b",
                                         "ignored.bias"}
              : std::vector<const char*>{"_flat_param", "layers.0._flat_param",
                                         "layers.0.mlp._flat_param",
                                         "ignored.bias"}) {
      order.push_back(wrapped.at(name));
    }
    return order;
  }

  // `dict` with the name keys and group entries in `names` renamed.
  static OptimStateDict Renamed(
      const OptimStateDict& dict,
      const std::map<std::string, std::string>& names) {
    auto rename = [&](const ParamKey& key) {
      const auto* name = std::get_if<std::string>(&key);
      if (name == nullptr || names.count(*name) == 0) return key;
      return ParamKey(names.at(*name));
    };
    OptimStateDict out;
    for (const auto& [key, st] : dict.state) {
      EXPECT_TRUE(out.state.emplace(rename(key), st).second);
    }
    for (const ParamGroup& g : dict.param_groups) {
      ParamGroup mapped = g;
      for (ParamKey& k : mapped.params) k = rename(k);
      out.param_groups.push_back(std::move(mapped));
    }
    return out;
  }

  OptimStateOptions Options(bool orig, ShardedKeys keys) {
    OptimStateOptions o = Quiet(orig);
    o.sharded_keys = keys;
    o.unmanaged_params = {"ignored.bias"};
    return o;
  }

  std::unique_ptr<ModelLayout> layout_;
  OptimStateDict full_;
};

TEST_F(WrappedNamesTest, ConsolidationRecognisesWrappedNames) {
  for (bool orig : {false, true}) {
    SCOPED_TRACE(orig ? "use_orig_params" : "flat path");
    OptimStateOptions options = Options(orig, ShardedKeys::kNames);
    const std::vector<OptimStateDict> clean =
        ShardAll(*layout_, full_, options);
    std::vector<OptimStateDict> wrapped;
    for (const OptimStateDict& s : clean) {
      wrapped.push_back(Renamed(s, Wrapped(orig)));
    }
    ASSERT_EQ(wrapped[0].state.count(orig ? "_orig_mod.layers.0.mlp.b"
                                          : "_fsdp_wrapped_module._flat_param"),
              1u);
    std::vector<std::string> warnings;
    options.on_warning = [&](absl::string_view w) { warnings.emplace_back(w); };
    auto want = Consolidate(*layout_, clean, options);
    warnings.clear();
    auto got = Consolidate(*layout_, wrapped, options);
    for (int r = 0; r < 2; ++r) {
      ASSERT_THAT(want[r], IsOk());
      ASSERT_THAT(got[r], IsOk());
      // Keyed by clean FQN, equal to the state keyed by clean names; the
      // user-defined "_fsdp_wrapped_module.scheduler" is kept as it is.
      EXPECT_EQ(FirstDifference(*got[r], *want[r]), std::nullopt)
          << "rank " << r;
      EXPECT_EQ(FirstDifference(*got[r], full_), std::nullopt) << "rank " << r;
    }
    // Only the user-defined states warn (two per rank), no parameter.
    EXPECT_THAT(warnings, SizeIs(4));
    for (const std::string& w : warnings) {
      EXPECT_THAT(w, AnyOf(HasSubstr("'__user__'"),
                           HasSubstr("'_fsdp_wrapped_module.scheduler'")));
    }
  }
}

TEST_F(WrappedNamesTest, LoadKeysByTheOptimizersOwnNames) {
  for (bool orig : {false, true}) {
    SCOPED_TRACE(orig ? "use_orig_params" : "flat path");
    const std::vector<OptimStateDict> clean =
        ShardAll(*layout_, full_, Options(orig, ShardedKeys::kNames));
    OptimStateOptions names = Options(orig, ShardedKeys::kNames);
    names.optimizer_params = WrappedOrder(orig);
    // Sharding and scattering give the optimizer's own (wrapped) names.
    const std::vector<OptimStateDict> local = ShardAll(*layout_, full_, names);
    std::vector<absl::StatusOr<OptimStateDict>> scattered(2, OptimStateDict());
    RunRanks(2, [&](SimCommunicator& comm) {
      OptimStateOptions o = names;
      o.rank0_only = true;
      scattered[comm.rank()] = OptimStateDictToLoad(
          *layout_, comm.rank() == 0 ? full_ : OptimStateDict(), comm, o);
      return scattered[comm.rank()].status();
    });
    for (int r = 0; r < 2; ++r) {
      const OptimStateDict want = Renamed(clean[r], Wrapped(orig));
      EXPECT_EQ(FirstDifference(local[r], want), std::nullopt) << "rank " << r;
      ASSERT_THAT(scattered[r], IsOk());
      EXPECT_EQ(FirstDifference(*scattered[r], want), std::nullopt)
          << "rank " << r;
    }
    // And back: wrapped names -> clean FQNs.
    auto got = Consolidate(*layout_, local, names);
    ASSERT_THAT(got[0], IsOk());
    EXPECT_EQ(FirstDifference(*got[0], full_), std::nullopt);

    // IDs of an optimizer whose parameters are listed by wrapped name.
    OptimStateOptions ids = Options(orig, ShardedKeys::kOptimizerIds);
    ids.optimizer_params = WrappedOrder(orig);
    const std::vector<OptimStateDict> by_id = ShardAll(*layout_, full_, ids);
    ASSERT_EQ(by_id[0].state.count(int64_t{0}), 1u);
    EXPECT_EQ(by_id[0].state.at(int64_t{0}),
              clean[0].state.at(orig ? "head" : "_flat_param"));
    got = Consolidate(*layout_, by_id, ids);
    ASSERT_THAT(got[0], IsOk());
    EXPECT_EQ(FirstDifference(*got[0], full_), std::nullopt);
  }
}

TEST_F(WrappedNamesTest, TwoKeysNamingOneParameterAreAnError) {
  // Original-parameter path: rank 1 holds "head" under both spellings.
  const OptimStateOptions orig = Options(true, ShardedKeys::kNames);
  std::vector<OptimStateDict> shards = ShardAll(*layout_, full_, orig);
  shards[1].state["_fsdp_wrapped_module.head"] = shards[1].state.at("head");
  auto got = Consolidate(*layout_, shards, orig);
  EXPECT_THAT(
      got[0],
      StatusIs(absl::StatusCode::kInvalidArgument,
               AllOf(HasSubstr("rank 1's sharded optimizer state: optimizer "
                               "state keys '_fsdp_wrapped_module.head' and "
                               "'head' both name 'head'"),
                     HasSubstr("clean_tensor_name"))));
  ExpectSameErrorOnAllRanks(got);

  // Flat path: two spellings of one flat parameter, both wrapped.
  const OptimStateOptions flat = Options(false, ShardedKeys::kNames);
  shards = ShardAll(*layout_, full_, flat);
  const ParamState st = shards[0].state.at("layers.0._flat_param");
  shards[0].state.erase("layers.0._flat_param");
  shards[0].state["_orig_mod.layers.0._flat_param"] = st;
  shards[0].state
      ["_fsdp_wrapped_module.layers.0._fsdp_wrapped_module."
       "_flat_param"] = st;
  got = Consolidate(*layout_, shards, flat);
  EXPECT_THAT(got[1], StatusIs(absl::StatusCode::kInvalidArgument,
                               HasSubstr("rank 0's sharded optimizer state: "
                                         "optimizer state keys "
                                         "'_fsdp_wrapped_module.layers.0._fsdp_"
                                         "wrapped_module._flat_param' and "
                                         "'_orig_mod.layers.0._flat_param' "
                                         "both name flat parameter 1 "
                                         "('layers.0._flat_param')")));
  ExpectSameErrorOnAllRanks(got);

  // optimizer_params listing one parameter twice, differently wrapped.
  OptimStateOptions ids = Options(true, ShardedKeys::kOptimizerIds);
  ids.optimizer_params = {"_fsdp_wrapped_module.head",
                          "_checkpoint_wrapped_module.head", "layers.0.norm",
                          "layers.0.mlp.w", "layers.0.mlp.b"};
  EXPECT_THAT(ShardFullOptimState(*layout_, full_, 0, ids),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("optimizer_params lists "
                                 "'_fsdp_wrapped_module.head' (ID 0) and "
                                 "'_checkpoint_wrapped_module.head' (ID 1), "
                                 "which both name 'head'")));
}

// ---------------------------------------------------------------------------
// A communicator that takes device buffers only (NCCL): staged collectives.
// ---------------------------------------------------------------------------

TEST(DeviceCommunicatorTest, CollectivesStageThroughTheDevice) {
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      ModelLayout layout, Layout({{"a.w", {3}}, {"a.b", {2}}, {"c", {4}}},
                                 {"a"}, {.world_size = 3}));
  OptimStateDict full;
  full.state["a.w"]["exp_avg"] = Iota(DType::kFloat32, {3}, 1);
  full.state["a.b"]["exp_avg"] = Iota(DType::kFloat32, {2}, 4);
  full.state["c"]["exp_avg"] = Iota(DType::kFloat32, {4}, 6);
  for (auto& [k, st] : full.state)
    st["step"] = ScalarTensor(DType::kFloat32, 2);
  for (bool orig : {false, true}) {
    for (bool staged : {false, true}) {
      std::vector<testing_handle::FakeCudaDeviceOps> devices(3);
      std::vector<absl::StatusOr<OptimStateDict>> consolidated(
          3, OptimStateDict());
      std::vector<absl::StatusOr<OptimStateDict>> scattered(3,
                                                            OptimStateDict());
      RunRanks(3, [&](SimCommunicator& world) {
        // Host buffers reaching this communicator fail, as with NCCL.
        std::unique_ptr<Communicator> comm =
            testing_handle::RelabelCudaAsHost(&world);
        const int r = world.rank();
        OptimStateOptions o = Quiet(orig);
        o.rank0_only = true;
        if (staged) o.device = &devices[r];
        absl::StatusOr<OptimStateDict> mine =
            ShardFullOptimState(layout, full, r, o);
        if (!mine.ok()) return mine.status();
        consolidated[r] = ConsolidateOptimState(layout, *mine, *comm, o);
        if (!consolidated[r].ok()) return consolidated[r].status();
        scattered[r] = ScatterFullOptimState(
            layout, r == 0 ? full : OptimStateDict(), *comm, o);
        if (!scattered[r].ok()) return scattered[r].status();
        EXPECT_EQ(FirstDifference(*scattered[r], *mine), std::nullopt)
            << "rank " << r;
        return absl::OkStatus();
      });
      const std::string label =
          absl::StrCat(orig ? "orig" : "flat", staged ? " staged" : " host");
      if (!staged) {
        EXPECT_FALSE(consolidated[0].ok()) << label;
        continue;
      }
      ASSERT_THAT(consolidated[0], IsOk()) << label;
      EXPECT_EQ(FirstDifference(*consolidated[0], full), std::nullopt) << label;
      for (int r = 0; r < 3; ++r) {
        ASSERT_THAT(scattered[r], IsOk()) << label << " rank " << r;
        EXPECT_GT(devices[r].device_to_host, 0) << label << " rank " << r;
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Hybrid sharding: each shard group consolidates the whole state.
// ---------------------------------------------------------------------------

TEST(HybridTest, EveryShardGroupConsolidatesTheSameState) {
  // 4 ranks as 2 nodes of 2: the layout is the shard group's.
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      ModelLayout layout,
      Layout(TwoParams(DType::kFloat32), {},
             {.world_size = 2, .strategy = ShardingStrategy::kHybridShard}));
  const OptimStateDict full = TwoParamAdam();
  std::vector<absl::StatusOr<OptimStateDict>> got(4, OptimStateDict());
  std::vector<absl::Status> statuses = RunRanks(4, [&](SimCommunicator& world) {
    auto groups = MakeHybridGroups(world, 2);
    if (!groups.ok()) return groups.status();
    Communicator& shard = *groups->shard;
    auto mine = ShardFullOptimState(layout, full, shard.rank());
    if (!mine.ok()) return mine.status();
    got[world.rank()] = ConsolidateOptimState(layout, *mine, shard);
    return got[world.rank()].status();
  });
  for (int r = 0; r < 4; ++r) {
    ASSERT_THAT(statuses[r], IsOk());
    EXPECT_EQ(FirstDifference(*got[r], full), std::nullopt) << "rank " << r;
  }
}

// PyTorch's rank0_only means global rank 0 (`dist.get_rank()`), not rank 0
// of each shard group: one full dict in the job, and the others hold
// nothing.
TEST(HybridTest, Rank0OnlyIsGlobalRankZero) {
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      ModelLayout layout,
      Layout(TwoParams(DType::kFloat32), {},
             {.world_size = 2, .strategy = ShardingStrategy::kHybridShard}));
  const OptimStateDict full = TwoParamAdam();
  std::vector<absl::StatusOr<OptimStateDict>> got(4, OptimStateDict());
  std::vector<AllocationTracker> trackers(4);
  std::vector<absl::Status> statuses = RunRanks(4, [&](SimCommunicator& world) {
    auto groups = MakeHybridGroups(world, 2);
    if (!groups.ok()) return groups.status();
    Communicator& shard = *groups->shard;
    auto mine = ShardFullOptimState(layout, full, shard.rank());
    if (!mine.ok()) return mine.status();
    OptimStateOptions options = Quiet();
    options.rank0_only = true;
    options.global_rank = world.rank();
    options.tracker = &trackers[world.rank()];
    got[world.rank()] = ConsolidateOptimState(layout, *mine, shard, options);
    return got[world.rank()].status();
  });
  for (int r = 0; r < 4; ++r) {
    ASSERT_THAT(statuses[r], IsOk());
    if (r == 0) {
      EXPECT_EQ(FirstDifference(*got[r], full), std::nullopt);
    } else {
      EXPECT_TRUE(got[r]->empty()) << "rank " << r;
    }
    // Every rank's temporaries are the collectives' buffers and gone.
    EXPECT_EQ(trackers[r].current_bytes(), 0) << "rank " << r;
  }

  // Without the global rank, the shard group cannot tell: an error rather
  // than a full dict on rank 0 of every shard group.
  statuses = RunRanks(4, [&](SimCommunicator& world) {
    auto groups = MakeHybridGroups(world, 2);
    if (!groups.ok()) return groups.status();
    auto mine = ShardFullOptimState(layout, full, groups->shard->rank());
    if (!mine.ok()) return mine.status();
    OptimStateOptions options = Quiet();
    options.rank0_only = true;
    return ConsolidateOptimState(layout, *mine, *groups->shard, options)
        .status();
  });
  for (int r = 0; r < 4; ++r) {
    EXPECT_THAT(statuses[r],
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("rank0_only with HYBRID_SHARD needs "
                                   "OptimStateOptions::global_rank")))
        << "rank " << r;
  }
}

// ---------------------------------------------------------------------------
// Memory: consolidation streams one flat parameter and state at a time.
// ---------------------------------------------------------------------------

TEST(MemoryTest, ConsolidationHoldsOneFlatParameterStateAtATime) {
  // Four units of different sizes; AdamW state in float32.
  std::vector<ParamSpec> params;
  std::vector<std::string> wrap;
  const std::vector<int64_t> sizes = {300, 1000, 200, 700};
  for (size_t u = 0; u < sizes.size(); ++u) {
    const std::string unit = "layers." + std::to_string(u);
    wrap.push_back(unit);
    params.push_back({unit + ".w", {sizes[u] / 10, 10}, DType::kBFloat16});
    params.push_back({unit + ".b", {7}, DType::kBFloat16});
  }
  for (bool orig : {false, true}) {
    FLATPARAM_ASSERT_OK_AND_ASSIGN(
        ModelLayout layout,
        Layout(params, wrap, {.world_size = 4, .align_addresses = orig}));
    OptimStateDict full;
    for (const ParamSpec& p : params) {
      full.state[p.fqn]["exp_avg"] = Iota(DType::kFloat32, p.shape, 1);
      full.state[p.fqn]["exp_avg_sq"] = Iota(DType::kFloat32, p.shape, 2);
      full.state[p.fqn]["step"] = ScalarTensor(DType::kFloat32, 10);
    }
    int64_t largest = 0, everything = 0;
    for (const FlatParamLayout& unit : layout.flat_params()) {
      const int64_t bytes = unit.padded_unsharded_numel() * 4;
      largest = std::max(largest, bytes);
      everything += 2 * bytes;  // exp_avg and exp_avg_sq
    }
    const std::vector<OptimStateDict> shards =
        ShardAll(layout, full, Quiet(orig));
    for (int64_t budget : {int64_t{0}, int64_t{256}}) {
      std::vector<AllocationTracker> trackers(4);
      std::vector<absl::StatusOr<OptimStateDict>> got(4, OptimStateDict());
      RunRanks(4, [&](SimCommunicator& comm) {
        OptimStateOptions o = Quiet(orig);
        o.max_temp_bytes = budget;
        o.tracker = &trackers[comm.rank()];
        got[comm.rank()] =
            ConsolidateOptimState(layout, shards[comm.rank()], comm, o);
        return got[comm.rank()].status();
      });
      OptimStateOptions o = Quiet(orig);
      o.max_temp_bytes = budget;
      for (int r = 0; r < 4; ++r) {
        ASSERT_THAT(got[r], IsOk());
        EXPECT_EQ(FirstDifference(*got[r], full), std::nullopt);
        EXPECT_EQ(trackers[r].current_bytes(), 0);
        if (budget == 0) {
          // Exactly the largest unit's padded state, once.
          EXPECT_EQ(trackers[r].peak_bytes(), largest);
          EXPECT_EQ(MaxTempBytes(layout, DType::kFloat32, o), largest);
          // Gathering everything would need all of it at once.
          EXPECT_LT(trackers[r].peak_bytes(), everything / 2);
          // One buffer per unit and tensor state.
          EXPECT_EQ(trackers[r].allocations(), 2 * 4);
        } else {
          EXPECT_LE(trackers[r].peak_bytes(), budget);
          EXPECT_LT(trackers[r].peak_bytes(), largest);
        }
      }
    }
  }
}

TEST(MemoryTest, ScatterStreamsToo) {
  std::vector<ParamSpec> params = {{"a.w", {40, 10}}, {"b.w", {30, 10}}};
  FLATPARAM_ASSERT_OK_AND_ASSIGN(ModelLayout layout,
                                 Layout(params, {"a", "b"}, {.world_size = 2}));
  OptimStateDict full;
  for (const ParamSpec& p : params) {
    full.state[p.fqn]["exp_avg"] = Iota(DType::kFloat32, p.shape, 0);
  }
  std::vector<AllocationTracker> trackers(2);
  RunRanks(2, [&](SimCommunicator& comm) {
    OptimStateOptions o;
    o.tracker = &trackers[comm.rank()];
    o.rank0_only = true;
    return OptimStateDictToLoad(
               layout, comm.rank() == 0 ? full : OptimStateDict(), comm, o)
        .status();
  });
  for (const AllocationTracker& t : trackers) {
    EXPECT_EQ(t.peak_bytes(), 400 * 4);  // the larger unit, unpadded
  }
}

}  // namespace
}  // namespace optim
}  // namespace flatparam
