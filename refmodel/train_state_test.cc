// The converters, and the end-to-end claim they exist for: an FSDP
// trainer's sharded optimizer state (refmodel::Optimizer stepping each rank's
// shard of each flat parameter) consolidates to exactly the state that
// stepping each original parameter whole produces.
#include "refmodel/train_state.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "flatparam/base/dtype.h"
#include "flatparam/base/status_matchers.h"
#include "flatparam/flatten.h"
#include "flatparam/layout.h"
#include "flatparam/model_layout.h"
#include "flatparam/optim/fsdp_optim.h"
#include "flatparam/optim/optim_state.h"
#include "refmodel/optimizer.h"
#include "sim/sim.h"

namespace flatparam {
namespace refmodel {
namespace {

using optim::ConsolidateOptimState;
using optim::FirstDifference;
using optim::OptimStateDict;
using optim::ParamKey;
using optim::ScalarTensor;

using ::testing::HasSubstr;

TEST(TrainStateTest, ConversionsRoundTrip) {
  refmodel::OptimizerState s;
  s.tensors["step"] = ScalarTensor(DType::kFloat32, 2);
  s.tensors["exp_avg"] = HostTensor::Flat(DType::kFloat32, 4);
  const std::vector<refmodel::OptimizerState> states = {s, {}, s};
  const OptimStateDict sharded = ShardedFromTrainStates(states);
  EXPECT_EQ(sharded.state.size(), 2u);
  ModelSpec spec;
  spec.params = {{"a.w", {4}}, {"b.w", {4}}, {"c", {4}}};
  spec.wrap = {"a", "b"};
  FLATPARAM_ASSERT_OK_AND_ASSIGN(ModelLayout layout,
                                 ModelLayout::Create(spec, {.world_size = 1}));
  FLATPARAM_ASSERT_OK_AND_ASSIGN(std::vector<refmodel::OptimizerState> back,
                                 TrainStatesFromSharded(layout, sharded));
  EXPECT_EQ(back, states);

  const std::map<std::string, refmodel::OptimizerState> by_fqn = {{"a.w", s}};
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      auto again, TrainStatesFromFull(FullFromTrainStates(by_fqn)));
  EXPECT_EQ(again, by_fqn);

  OptimStateDict bad = sharded;
  bad.state[ParamKey(int64_t{0})]["lr"] = 0.5;
  EXPECT_THAT(TrainStatesFromSharded(layout, bad),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("state lr of 0 is 0.5")));
  bad = sharded;
  bad.state[ParamKey(int64_t{3})] = {};
  EXPECT_THAT(TrainStatesFromSharded(layout, bad),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("state key 3 is not a flat-parameter index")));
  OptimStateDict none;
  none.state["a.w"]["momentum_buffer"] = std::monostate();
  FLATPARAM_ASSERT_OK_AND_ASSIGN(auto dropped, TrainStatesFromFull(none));
  EXPECT_TRUE(dropped.at("a.w").tensors.empty());
}

// Steps every original parameter whole (the reference) and every rank's
// shard of every flat parameter (FSDP), then consolidates the latter.
void CheckShardedTrainingConsolidates(const refmodel::OptimizerOptions& opt,
                                      const LayoutOptions& layout_options) {
  ModelSpec spec;
  spec.params = {{"emb", {6, 5}},     {"layers.0.w", {5, 5}},
                 {"layers.0.b", {5}}, {"layers.1.w", {5, 3}},
                 {"layers.1.b", {3}}, {"head", {3, 7}}};
  spec.wrap = {"layers.0", "layers.1"};
  FLATPARAM_ASSERT_OK_AND_ASSIGN(ModelLayout layout,
                                 ModelLayout::Create(spec, layout_options));
  FLATPARAM_ASSERT_OK_AND_ASSIGN(std::unique_ptr<refmodel::Optimizer> optimizer,
                                 refmodel::MakeOptimizer(opt));
  constexpr int kSteps = 3;
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> dist(-1, 1);
  // params[fqn] and grads[step][fqn].
  std::map<std::string, HostTensor> params;
  std::vector<std::map<std::string, HostTensor>> grads(kSteps);
  for (const ParamSpec& p : spec.params) {
    HostTensor t(DType::kFloat32, p.shape);
    for (int64_t i = 0; i < t.numel(); ++i) t.data_as<float>()[i] = dist(rng);
    params[p.fqn] = t;
    for (auto& g : grads) {
      for (int64_t i = 0; i < t.numel(); ++i) t.data_as<float>()[i] = dist(rng);
      g[p.fqn] = t;
    }
  }

  // Reference: each parameter whole.
  std::map<std::string, refmodel::OptimizerState> want_states;
  {
    std::map<std::string, HostTensor> p = params;
    for (int k = 0; k < kSteps; ++k) {
      for (auto& [fqn, t] : p) {
        ASSERT_THAT(
            optimizer->Step(t.ref(), grads[k].at(fqn).cref(), want_states[fqn]),
            IsOk());
      }
    }
  }
  // Buffers shaped like their parameter, as in a PyTorch state dict.
  OptimStateDict want = FullFromTrainStates(want_states);
  for (auto& [key, st] : want.state) {
    const std::vector<int64_t>& shape =
        params.at(std::get<std::string>(key)).shape();
    for (auto& [name, v] : st) {
      HostTensor& t = std::get<HostTensor>(v);
      if (t.shape().empty()) continue;
      HostTensor shaped(t.dtype(), shape);
      std::memcpy(shaped.data(), t.data(), t.nbytes());
      t = std::move(shaped);
    }
  }

  // FSDP: each rank steps its shards; then consolidate.
  const int w = static_cast<int>(layout_options.world_size);
  std::vector<absl::StatusOr<OptimStateDict>> got(w, OptimStateDict());
  SimOptions sim;
  sim.world_size = w;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(std::unique_ptr<SimWorld> world,
                                 SimWorld::Create(sim));
  auto shard_of = [&](const FlatParamLayout& unit,
                      const std::map<std::string, HostTensor>& tensors,
                      int64_t rank) {
    std::vector<ConstBufferRef> refs;
    for (const ParamInfo& p : unit.params())
      refs.push_back(tensors.at(p.fqn).cref());
    HostTensor out = HostTensor::Flat(DType::kFloat32, unit.sharded_numel());
    EXPECT_THAT(FlattenShard(unit, refs, rank, out.ref()), IsOk());
    return out;
  };
  ASSERT_THAT(world->Run([&](SimCommunicator& comm) -> absl::Status {
    const auto& units = layout.flat_params();
    std::vector<refmodel::OptimizerState> states(units.size());
    for (size_t u = 0; u < units.size(); ++u) {
      HostTensor p = shard_of(units[u], params, comm.rank());
      for (int k = 0; k < kSteps; ++k) {
        HostTensor g = shard_of(units[u], grads[k], comm.rank());
        FLATPARAM_RETURN_IF_ERROR(
            optimizer->Step(p.ref(), g.cref(), states[u]));
      }
    }
    got[comm.rank()] =
        ConsolidateOptimState(layout, ShardedFromTrainStates(states), comm);
    return got[comm.rank()].status();
  }),
              IsOk());
  for (int r = 0; r < w; ++r) {
    EXPECT_EQ(FirstDifference(*got[r], want), std::nullopt) << "rank " << r;
  }
}

TEST(TrainStateTest, ShardedAdamWConsolidatesToUnshardedAdamW) {
  for (int64_t w : {1, 2, 3, 4}) {
    for (bool align : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "world " << w << " align " << align);
      CheckShardedTrainingConsolidates(
          refmodel::AdamWOptions{.lr = 0.01},
          {.world_size = w, .align_addresses = align});
    }
  }
}

TEST(TrainStateTest, ShardedSgdConsolidatesToUnshardedSgd) {
  CheckShardedTrainingConsolidates(
      refmodel::SgdOptions{.lr = 0.1, .momentum = 0.9},
      {.world_size = 3, .strategy = ShardingStrategy::kShardGradOp});
}

}  // namespace
}  // namespace refmodel
}  // namespace flatparam
