#include "flatparam/torch/fsdp_module.h"

#include <gtest/gtest.h>
#include <torch/autograd.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <torch/types.h>
#include <torch/utils.h>

#include <cstdlib>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/base/status_matchers.h"
#include "flatparam/checkpoint/file_system.h"
#include "flatparam/device/device.h"
#include "flatparam/handle.h"
#include "flatparam/optim/fsdp_optim.h"
#include "flatparam/optim/optim_state.h"
#include "sim/sim.h"
#include "sim/sim_device.h"
#include "testing/sim_torch_device.h"
#include "testing/torch_testutil.h"

namespace flatparam {
namespace libtorch {
namespace {

using ::flatparam::IsOk;
using namespace ::flatparam::libtorch::testing;  // NOLINT

// `train` on every rank of a `world`-rank simulated world; rank 0's result.
absl::StatusOr<FsdpResult> OnSimRanks(
    int world,
    const std::function<absl::StatusOr<FsdpResult>(SimCommunicator&)>& train) {
  SimOptions sim;
  sim.world_size = world;
  FLATPARAM_ASSIGN_OR_RETURN(std::unique_ptr<SimWorld> w,
                             SimWorld::Create(sim));
  FsdpResult result;
  FLATPARAM_RETURN_IF_ERROR(w->Run([&](SimCommunicator& comm) -> absl::Status {
    FLATPARAM_ASSIGN_OR_RETURN(FsdpResult mine, train(comm));
    if (comm.rank() == 0) result = std::move(mine);
    return absl::OkStatus();
  }));
  return result;
}

// TrainFsdpOnRank on c.world simulated ranks; rank 0's result.
absl::StatusOr<FsdpResult> TrainFsdp(const Case& c) {
  return OnSimRanks(c.world, [&](SimCommunicator& comm) {
    HostDeviceOps device;
    return TrainFsdpOnRank(comm, device, c);
  });
}

// TrainFsdpOnRank with the flat parameters in simulated device memory
// under CPU tensors (testing/sim_torch_device.h): every rank's SimDeviceOps
// (seeded by `seed` and the rank) runs its streams late and reordered,
// with separate unshard and post-backward streams and stream-ordered
// collectives, as on a GPU with NCCL. Rank 0's result; an error if the
// race detector reported anything on any rank. `hand_offs`: rank 0's
// HandToTorch calls.
absl::StatusOr<FsdpResult> TrainFsdpOnSimDevice(const Case& c, uint64_t seed,
                                                int64_t* hand_offs) {
  return OnSimRanks(
      c.world, [&](SimCommunicator& comm) -> absl::StatusOr<FsdpResult> {
        SimDeviceOptions options;
        options.seed = seed * 16 + comm.rank();
        SimDeviceOps ops(options);
        StreamCheckedCommunicator checked(&comm, &ops,
                                          /*stream_ordered=*/true);
        SimTorchDevice device(&ops);
        HandleStreams streams;
        FLATPARAM_ASSIGN_OR_RETURN(streams.unshard, ops.NewStream());
        FLATPARAM_ASSIGN_OR_RETURN(streams.post_backward, ops.NewStream());
        absl::StatusOr<FsdpResult> mine =
            TrainFsdpOnRank(checked, device, c, streams);
        FLATPARAM_RETURN_IF_ERROR(ops.Synchronize());
        FLATPARAM_RETURN_IF_ERROR(ops.CheckNoRaces());
        if (comm.rank() == 0) *hand_offs = device.hand_offs();
        return mine;
      });
}

// `state` holds each of `expected`'s tensors bitwise, but the tied head,
// which FsdpModule stores once, under the embedding's name.
void ExpectBitwiseEqual(const std::map<std::string, torch::Tensor>& state,
                        const std::map<std::string, torch::Tensor>& expected) {
  EXPECT_EQ(state.size(), expected.size() - 1);
  for (const auto& [name, tensor] : state) {
    ASSERT_TRUE(expected.count(name)) << name;
    EXPECT_TRUE(torch::equal(tensor, expected.at(name)))
        << name << ": max difference "
        << (tensor - expected.at(name)).abs().max().item<float>();
  }
}

class FsdpModuleTrainingTest : public ::testing::TestWithParam<Case> {};

// Every parameter after training is bitwise the single-process result.
TEST_P(FsdpModuleTrainingTest, BitwiseEqualToSingleProcessTraining) {
  const Case& c = GetParam();
  std::map<std::string, torch::Tensor> expected = TrainReference(c);
  absl::StatusOr<FsdpResult> got = TrainFsdp(c);
  ASSERT_THAT(got.status(), IsOk());
  ExpectBitwiseEqual(got->state, expected);
  for (const auto& [name, tensor] : got->state) {
    // Training moved it, unless it is frozen.
    const bool frozen = !c.frozen.empty() && name.rfind(c.frozen, 0) == 0;
    EXPECT_EQ(torch::equal(tensor, InitialParams().at(name)), frozen) << name;
  }
  // Every unit's post-backward ran once per backward, during the backward
  // (once its backward was complete), a frozen unit's too (it reshards
  // there, reducing nothing); none was left to the backward's end.
  const int backwards = c.steps * c.micro_batches;
  EXPECT_EQ(got->stats.backwards, backwards);
  EXPECT_EQ(got->stats.reductions_in_backward, backwards * (kLayers + 1));
  EXPECT_EQ(got->stats.reductions_at_end, 0);
  EXPECT_EQ(got->stats.units_without_gradient, 0);
}

INSTANTIATE_TEST_SUITE_P(
    Strategies, FsdpModuleTrainingTest,
    ::testing::Values(
        Case{1, ShardingStrategy::kFullShard, 0, Optim::kSgd, 1},
        Case{2, ShardingStrategy::kFullShard, 0, Optim::kSgd, 1},
        Case{2, ShardingStrategy::kFullShard, 0, Optim::kAdamW},
        Case{4, ShardingStrategy::kFullShard, 0, Optim::kSgd},
        Case{2, ShardingStrategy::kShardGradOp, 0, Optim::kAdamW},
        Case{2, ShardingStrategy::kNoShard, 0, Optim::kAdamW},
        Case{4, ShardingStrategy::kHybridShard, 2, Optim::kAdamW},
        Case{4, ShardingStrategy::kHybridShardZero2, 2, Optim::kSgd},
        Case{2, ShardingStrategy::kFullShard, 0, Optim::kAdamW, 3, 4, "h.0."},
        Case{4, ShardingStrategy::kShardGradOp, 0, Optim::kSgd, 3, 4, "h.1."},
        Case{2, ShardingStrategy::kFullShard, 0, Optim::kAdamW, 2, 4, "", 3},
        Case{4, ShardingStrategy::kHybridShard, 2, Optim::kSgd, 2, 4, "", 2},
        Case{2, ShardingStrategy::kFullShard, 0, Optim::kAdamW, 3, 4, "", 1,
             true},
        Case{2, ShardingStrategy::kNoShard, 0, Optim::kSgd, 2, 4, "", 2, true},
        // Activation recomputation inside and around the units.
        Case{2, ShardingStrategy::kFullShard, 0, Optim::kAdamW, 3, 4, "", 1,
             false, Recomputation::kInsideUnit},
        Case{2, ShardingStrategy::kFullShard, 0, Optim::kAdamW, 3, 4, "", 1,
             false, Recomputation::kAroundUnit},
        Case{4, ShardingStrategy::kShardGradOp, 0, Optim::kSgd, 2, 4, "", 2,
             false, Recomputation::kAroundUnit},
        Case{4, ShardingStrategy::kHybridShard, 2, Optim::kAdamW, 2, 4, "", 1,
             false, Recomputation::kInsideUnit},
        Case{4, ShardingStrategy::kHybridShardZero2, 2, Optim::kSgd, 2, 4, "",
             1, false, Recomputation::kAroundUnit},
        Case{2, ShardingStrategy::kNoShard, 0, Optim::kAdamW, 2, 4, "", 1,
             false, Recomputation::kInsideUnit},
        Case{2, ShardingStrategy::kFullShard, 0, Optim::kSgd, 2, 4, "h.1.", 1,
             false, Recomputation::kAroundUnit},
        Case{2, ShardingStrategy::kFullShard, 0, Optim::kAdamW, 2, 4, "", 2,
             true, Recomputation::kInsideUnit}),
    [](const ::testing::TestParamInfo<Case>& info) {
      return Name(info.param);
    });
class FsdpModuleSimDeviceTest : public ::testing::TestWithParam<Case> {};

// FsdpModule's device path, with LibTorch on the CPU: the module's
// parameters are views of simulated device memory whose streams run late,
// so LibTorch reads the right bytes only where FsdpModule hands over
// (HandToTorch) and the runtime's events order the streams. Bitwise the
// single-process result for every seed, with no race reported.
TEST_P(FsdpModuleSimDeviceTest, BitwiseEqualToSingleProcessTraining) {
  const Case& c = GetParam();
  std::map<std::string, torch::Tensor> expected = TrainReference(c);
  for (uint64_t seed : {1, 2}) {
    SCOPED_TRACE(absl::StrCat("device seed ", seed));
    int64_t hand_offs = 0;
    absl::StatusOr<FsdpResult> got = TrainFsdpOnSimDevice(c, seed, &hand_offs);
    ASSERT_THAT(got.status(), IsOk());
    ExpectBitwiseEqual(got->state, expected);
    EXPECT_GT(hand_offs, 0);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Strategies, FsdpModuleSimDeviceTest,
    ::testing::Values(
        Case{2, ShardingStrategy::kFullShard, 0, Optim::kAdamW},
        Case{4, ShardingStrategy::kShardGradOp, 0, Optim::kSgd},
        Case{2, ShardingStrategy::kNoShard, 0, Optim::kAdamW},
        Case{4, ShardingStrategy::kHybridShard, 2, Optim::kAdamW},
        Case{2, ShardingStrategy::kFullShard, 0, Optim::kAdamW, 3, 4, "h.0."},
        Case{2, ShardingStrategy::kFullShard, 0, Optim::kAdamW, 2, 4, "", 3},
        Case{2, ShardingStrategy::kFullShard, 0, Optim::kAdamW, 3, 4, "", 1,
             true},
        Case{2, ShardingStrategy::kFullShard, 0, Optim::kAdamW, 3, 4, "", 1,
             false, Recomputation::kInsideUnit},
        Case{4, ShardingStrategy::kHybridShardZero2, 2, Optim::kSgd, 2, 4, "",
             1, false, Recomputation::kAroundUnit}),
    [](const ::testing::TestParamInfo<Case>& info) {
      return Name(info.param);
    });

// Several backwards per forward (retain_graph): the sharded gradients sum
// both, bitwise as two iterations without ZeroGrad between them do.
TEST(FsdpModuleTest, SeveralBackwardsPerForward) {
  for (ShardingStrategy strategy :
       {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp,
        ShardingStrategy::kNoShard}) {
    SCOPED_TRACE(ShardingStrategyName(strategy));
    // Rank 0's sharded gradients after either schedule.
    auto run = [&](bool retain) -> absl::StatusOr<std::vector<torch::Tensor>> {
      SimOptions sim;
      sim.world_size = 2;
      FLATPARAM_ASSIGN_OR_RETURN(std::unique_ptr<SimWorld> world,
                                 SimWorld::Create(sim));
      std::vector<torch::Tensor> grads;
      FLATPARAM_RETURN_IF_ERROR(
          world->Run([&](SimCommunicator& comm) -> absl::Status {
            HostDeviceOps device;
            Net net = MakeNet();
            FsdpOptions options;
            options.wrap = {"h.*"};
            options.strategy = strategy;
            FLATPARAM_ASSIGN_OR_RETURN(
                std::unique_ptr<FsdpModule> fsdp,
                FsdpModule::Wrap(net.ptr(), &comm, &device, options));
            torch::Tensor tokens = Tokens(0, comm.rank() * 2, 2);
            FLATPARAM_ASSIGN_OR_RETURN(torch::Tensor logits,
                                       ForwardNet(net, *fsdp, tokens));
            torch::Tensor loss = Loss(logits, tokens);
            if (retain) {
              FLATPARAM_RETURN_IF_ERROR(fsdp->Backward(loss, true));
              FLATPARAM_RETURN_IF_ERROR(fsdp->Backward(loss));
            } else {
              FLATPARAM_RETURN_IF_ERROR(fsdp->Backward(loss));
              FLATPARAM_ASSIGN_OR_RETURN(logits,
                                         ForwardNet(net, *fsdp, tokens));
              FLATPARAM_RETURN_IF_ERROR(fsdp->Backward(Loss(logits, tokens)));
            }
            if (fsdp->stats().backwards != 2) {
              return absl::InternalError("not two backwards");
            }
            if (comm.rank() == 0) {
              for (const torch::Tensor& p : fsdp->ShardedParameters()) {
                grads.push_back(p.grad().clone());
              }
            }
            return absl::OkStatus();
          }));
      return grads;
    };
    absl::StatusOr<std::vector<torch::Tensor>> retained = run(true);
    absl::StatusOr<std::vector<torch::Tensor>> separate = run(false);
    ASSERT_THAT(retained.status(), IsOk());
    ASSERT_THAT(separate.status(), IsOk());
    ASSERT_EQ(retained->size(), separate->size());
    for (size_t u = 0; u < retained->size(); ++u) {
      EXPECT_TRUE(torch::equal((*retained)[u], (*separate)[u])) << "unit " << u;
      EXPECT_GT((*retained)[u].abs().sum().item<float>(), 0) << "unit " << u;
    }
  }
}

// Recomputation runs each block again in its backward, at the place asked
// for: inside the unit, on the parameters its pre-backward hook gathered
// (the handle in BACKWARD_PRE); around it, through the unit's forward hooks
// (the handle in FORWARD). The forward itself runs without gradients.
TEST(FsdpModuleTest, RecomputationRunsEachBlockAgainInItsBackward) {
  for (Recomputation where :
       {Recomputation::kInsideUnit, Recomputation::kAroundUnit}) {
    SCOPED_TRACE(RecomputationName(where));
    SimOptions sim;
    sim.world_size = 2;
    absl::StatusOr<std::unique_ptr<SimWorld>> world = SimWorld::Create(sim);
    ASSERT_THAT(world.status(), IsOk());
    // Rank 0's block calls.
    struct Call {
      int block;
      bool grad_mode;
      HandleTrainingState state;
      bool operator==(const Call& o) const {
        return block == o.block && grad_mode == o.grad_mode && state == o.state;
      }
    };
    std::vector<Call> calls;
    ASSERT_THAT((*world)->Run([&](SimCommunicator& comm) -> absl::Status {
      HostDeviceOps device;
      Net net = MakeNet();
      FsdpOptions options;
      options.wrap = {"h.*"};
      FLATPARAM_ASSIGN_OR_RETURN(
          std::unique_ptr<FsdpModule> fsdp,
          FsdpModule::Wrap(net.ptr(), &comm, &device, options));
      FsdpModule* f = fsdp.get();
      auto record = [&calls, f, net, rank = comm.rank()](BlockImpl& block) {
        if (rank != 0) return;
        for (size_t i = 0; i < net->h->size(); ++i) {
          if (net->h->ptr<BlockImpl>(i).get() != &block) continue;
          absl::StatusOr<int> unit =
              f->runtime().FindUnit(absl::StrCat("h.", i));
          calls.push_back({static_cast<int>(i), torch::GradMode::is_enabled(),
                           unit.ok()
                               ? f->runtime().handle(*unit).training_state()
                               : HandleTrainingState::kSummonFullParams});
        }
      };
      torch::Tensor tokens = Tokens(0, comm.rank() * 2, 2);
      FLATPARAM_ASSIGN_OR_RETURN(torch::Tensor logits,
                                 ForwardNet(net, *fsdp, tokens, record, where));
      return fsdp->Backward(Loss(logits, tokens));
    }),
                IsOk());
    const HandleTrainingState recomputed =
        where == Recomputation::kInsideUnit ? HandleTrainingState::kBackwardPre
                                            : HandleTrainingState::kForward;
    std::vector<Call> want;
    for (int i = 0; i < kLayers; ++i) {
      want.push_back({i, false, HandleTrainingState::kForward});
    }
    for (int i = kLayers - 1; i >= 0; --i)
      want.push_back({i, true, recomputed});
    ASSERT_EQ(calls.size(), want.size());
    for (size_t k = 0; k < want.size(); ++k) {
      EXPECT_TRUE(calls[k] == want[k])
          << "call " << k << ": block " << calls[k].block << ", gradients "
          << calls[k].grad_mode << ", "
          << HandleTrainingStateName(calls[k].state);
    }
  }
}

// bfloat16 mixed precision: the blocks compute in bfloat16, the shards and
// the optimizer stay float32, and the network learns its batch.
TEST(FsdpModuleTest, MixedPrecisionTrains) {
  SimOptions sim;
  sim.world_size = 2;
  absl::StatusOr<std::unique_ptr<SimWorld>> world = SimWorld::Create(sim);
  ASSERT_THAT(world.status(), IsOk());
  std::vector<float> losses;
  ASSERT_THAT((*world)->Run([&](SimCommunicator& comm) -> absl::Status {
    HostDeviceOps device;
    Net net = MakeNet();
    FsdpOptions options;
    options.wrap = {"h.*"};
    options.handle.param_dtype = DType::kBFloat16;
    FLATPARAM_ASSIGN_OR_RETURN(
        std::unique_ptr<FsdpModule> fsdp,
        FsdpModule::Wrap(net.ptr(), &comm, &device, options));
    for (const torch::Tensor& p : fsdp->ShardedParameters()) {
      if (p.scalar_type() != torch::kFloat) {
        return absl::InternalError("a shard is not float32");
      }
    }
    torch::optim::AdamW adamw(fsdp->ShardedParameters(),
                              torch::optim::AdamWOptions(0.02));
    torch::Tensor tokens = Tokens(0, comm.rank() * 4, 4);
    for (int step = 0; step < 30; ++step) {
      bool low_precision = true;
      FLATPARAM_ASSIGN_OR_RETURN(
          torch::Tensor logits,
          ForwardNet(net, *fsdp, tokens, [&](BlockImpl& block) {
            low_precision = low_precision &&
                            block.fc1->weight.scalar_type() == torch::kBFloat16;
          }));
      if (!low_precision) return absl::InternalError("not bfloat16");
      torch::Tensor loss = Loss(logits, tokens);
      if (comm.rank() == 0) losses.push_back(loss.item<float>());
      FLATPARAM_RETURN_IF_ERROR(fsdp->Backward(loss));
      adamw.step();
      FLATPARAM_RETURN_IF_ERROR(fsdp->ZeroGrad());
    }
    return absl::OkStatus();
  }),
              IsOk());
  ASSERT_EQ(losses.size(), 30u);
  EXPECT_LT(losses.back(), 0.5f * losses.front())
      << losses.front() << " -> " << losses.back();
}

// Runs `body` on one simulated rank with host DeviceOps.
void OnOneRank(const std::function<void(SimCommunicator&, DeviceOps&)>& body) {
  SimOptions sim;
  sim.world_size = 1;
  absl::StatusOr<std::unique_ptr<SimWorld>> world = SimWorld::Create(sim);
  ASSERT_THAT(world.status(), IsOk());
  ASSERT_THAT((*world)->Run([&](SimCommunicator& comm) -> absl::Status {
    HostDeviceOps device;
    body(comm, device);
    return absl::OkStatus();
  }),
              IsOk());
}

// A one-unit-per-block wrap of a fresh network.
absl::StatusOr<std::unique_ptr<FsdpModule>> WrapNet(const Net& net,
                                                    Communicator& comm,
                                                    DeviceOps& device) {
  FsdpOptions options;
  options.wrap = {"h.*"};
  return FsdpModule::Wrap(net.ptr(), &comm, &device, options);
}

// What a rank keeps between the two halves of OptimizerStateTest.
struct Saved {
  std::map<std::string, torch::Tensor> params;
  optim::OptimStateDict full_optim;
};

// `steps` AdamW steps from data step `first` on `world` simulated ranks,
// starting from `from` (or the initial parameters); what rank 0 saves:
// the full parameters and the consolidated optimizer state. Loading
// checks on every rank that the state read back is the state loaded.
// With `disk`: instead, the run loads from `disk->load` (if set) and saves
// to `disk->save` (if set) with FsdpModule's checkpoints, under
// `disk->strategy`.
struct Disk {
  std::string load, save;
  ShardingStrategy strategy = ShardingStrategy::kFullShard;
  int shard_group_size = 0;
};
absl::StatusOr<Saved> TrainAndSave(int world_size, int first, int steps,
                                   const Saved* from,
                                   const Disk* disk = nullptr) {
  SimOptions sim;
  sim.world_size = world_size;
  FLATPARAM_ASSIGN_OR_RETURN(std::unique_ptr<SimWorld> world,
                             SimWorld::Create(sim));
  Saved saved;
  FLATPARAM_RETURN_IF_ERROR(
      world->Run([&](SimCommunicator& comm) -> absl::Status {
        HostDeviceOps device;
        Net net = MakeNet();
        if (from != nullptr) {
          torch::NoGradGuard no_grad;
          for (auto& p : net->named_parameters()) {
            auto it = from->params.find(p.key());
            if (it != from->params.end()) p.value().copy_(it->second);
          }
        }
        FsdpOptions options;
        options.wrap = {"h.*"};
        if (disk != nullptr) {
          options.strategy = disk->strategy;
          options.shard_group_size = disk->shard_group_size;
        }
        FLATPARAM_ASSIGN_OR_RETURN(
            std::unique_ptr<FsdpModule> fsdp,
            FsdpModule::Wrap(net.ptr(), &comm, &device, options));
        auto adamw = MakeOptimizer(Optim::kAdamW, fsdp->ShardedParameters());
        if (disk != nullptr && !disk->load.empty()) {
          nlohmann::json extra;
          FLATPARAM_RETURN_IF_ERROR(fsdp->LoadCheckpoint(
              checkpoint::PosixFileSystem(), disk->load, adamw.get(), &extra));
          if (extra != nlohmann::json{{"step", first}}) {
            return absl::InternalError(absl::StrCat("extra ", extra.dump()));
          }
        }
        if (from != nullptr) {
          FLATPARAM_ASSIGN_OR_RETURN(
              optim::OptimStateDict mine,
              optim::ShardFullOptimState(fsdp->layout(), from->full_optim,
                                         comm.rank()));
          FLATPARAM_RETURN_IF_ERROR(fsdp->LoadShardedOptimState(mine, *adamw));
          FLATPARAM_ASSIGN_OR_RETURN(optim::OptimStateDict back,
                                     fsdp->ShardedOptimState(*adamw));
          // The state loaded is the state read back (groups aside: the
          // optimizer's own options stand).
          back.param_groups = mine.param_groups;
          if (std::optional<std::string> d =
                  optim::FirstDifference(back, mine)) {
            return absl::InternalError(absl::StrCat("load round trip: ", *d));
          }
        }
        const int64_t local = 2;
        for (int step = first; step < first + steps; ++step) {
          torch::Tensor tokens = Tokens(step, comm.rank() * local, local);
          FLATPARAM_ASSIGN_OR_RETURN(torch::Tensor logits,
                                     ForwardNet(net, *fsdp, tokens));
          FLATPARAM_RETURN_IF_ERROR(fsdp->Backward(Loss(logits, tokens)));
          adamw->step();
          FLATPARAM_RETURN_IF_ERROR(fsdp->ZeroGrad());
        }
        if (disk != nullptr && !disk->save.empty()) {
          FLATPARAM_RETURN_IF_ERROR(
              fsdp->SaveCheckpoint(checkpoint::PosixFileSystem(), disk->save,
                                   adamw.get(), {{"step", first + steps}}));
        }
        FLATPARAM_ASSIGN_OR_RETURN(optim::OptimStateDict sharded,
                                   fsdp->ShardedOptimState(*adamw));
        FLATPARAM_ASSIGN_OR_RETURN(
            optim::OptimStateDict full,
            optim::ConsolidateOptimState(fsdp->layout(), sharded,
                                         fsdp->runtime().shard_group()));
        FLATPARAM_ASSIGN_OR_RETURN(auto params, fsdp->FullStateDict());
        if (comm.rank() == 0) {
          saved.params = std::move(params);
          saved.full_optim = std::move(full);
        }
        return absl::OkStatus();
      }));
  return saved;
}

// The optimizer's state leaves as flatparam's optimizer-state dicts and
// comes back: 3 steps straight equal 2 steps, a save (parameters and the
// consolidated AdamW state, keyed by name as PyTorch's full dict is), a
// fresh wrap, a load and 1 step, bit for bit; and the consolidated state
// loaded at another world size consolidates to the same dict.
TEST(FsdpModuleTest, OptimizerStateSavesAndLoadsAtAnyWorldSize) {
  absl::StatusOr<Saved> straight = TrainAndSave(2, 0, 3, nullptr);
  ASSERT_THAT(straight.status(), IsOk());
  absl::StatusOr<Saved> half = TrainAndSave(2, 0, 2, nullptr);
  ASSERT_THAT(half.status(), IsOk());
  // PyTorch's full form: by name, shaped like the parameters.
  const optim::ParamState& fc1 =
      half->full_optim.state.at(optim::ParamKey(std::string("h.1.fc1.weight")));
  EXPECT_EQ(std::get<HostTensor>(fc1.at("exp_avg")).shape(),
            (std::vector<int64_t>{2 * kDim, kDim}));
  EXPECT_TRUE(optim::BitwiseEqual(fc1.at("step"),
                                  optim::ScalarTensor(DType::kFloat32, 2)));

  absl::StatusOr<Saved> resumed = TrainAndSave(2, 2, 1, &*half);
  ASSERT_THAT(resumed.status(), IsOk());
  for (const auto& [name, tensor] : straight->params) {
    EXPECT_TRUE(torch::equal(tensor, resumed->params.at(name))) << name;
  }
  EXPECT_EQ(optim::FirstDifference(straight->full_optim, resumed->full_optim),
            std::nullopt);

  // At 4 ranks (another shard size): loaded, not stepped, consolidated.
  absl::StatusOr<Saved> moved = TrainAndSave(4, 2, 0, &*half);
  ASSERT_THAT(moved.status(), IsOk());
  EXPECT_EQ(optim::FirstDifference(half->full_optim, moved->full_optim),
            std::nullopt);
}

// The same through FsdpModule's checkpoints on disk: saved at 2 ranks,
// resumed at 2 (bitwise the straight run), and loaded at 4 ranks, hybrid
// (resharded at load time) and at 1, each holding what was saved.
TEST(FsdpModuleTest, CheckpointsResumeAndReshard) {
  const std::string dir =
      absl::StrCat(std::getenv("TEST_TMPDIR"), "/torch_checkpoint");
  absl::StatusOr<Saved> straight = TrainAndSave(2, 0, 3, nullptr);
  ASSERT_THAT(straight.status(), IsOk());
  Disk save;
  save.save = dir;
  absl::StatusOr<Saved> half = TrainAndSave(2, 0, 2, nullptr, &save);
  ASSERT_THAT(half.status(), IsOk());

  Disk load;
  load.load = dir;
  absl::StatusOr<Saved> resumed = TrainAndSave(2, 2, 1, nullptr, &load);
  ASSERT_THAT(resumed.status(), IsOk());
  for (const auto& [name, tensor] : straight->params) {
    EXPECT_TRUE(torch::equal(tensor, resumed->params.at(name))) << name;
  }
  EXPECT_EQ(optim::FirstDifference(straight->full_optim, resumed->full_optim),
            std::nullopt);

  for (auto [world, strategy, group] :
       {std::tuple{4, ShardingStrategy::kHybridShard, 2},
        std::tuple{1, ShardingStrategy::kShardGradOp, 0}}) {
    SCOPED_TRACE(world);
    Disk moved;
    moved.load = dir;
    moved.strategy = strategy;
    moved.shard_group_size = group;
    absl::StatusOr<Saved> got = TrainAndSave(world, 2, 0, nullptr, &moved);
    ASSERT_THAT(got.status(), IsOk());
    for (const auto& [name, tensor] : half->params) {
      EXPECT_TRUE(torch::equal(tensor, got->params.at(name))) << name;
    }
    EXPECT_EQ(optim::FirstDifference(half->full_optim, got->full_optim),
              std::nullopt);
  }
}

TEST(FsdpModuleErrorsTest, CheckpointsOfAnotherModelAreRefused) {
  const std::string dir =
      absl::StrCat(std::getenv("TEST_TMPDIR"), "/torch_checkpoint_other");
  Disk save;
  save.save = dir;
  ASSERT_THAT(TrainAndSave(1, 0, 1, nullptr, &save).status(), IsOk());
  OnOneRank([&](SimCommunicator& comm, DeviceOps& device) {
    // Two blocks wrapped as one unit: another layout of the same names.
    Net net = MakeNet();
    FsdpOptions options;
    options.wrap = {"h"};
    absl::StatusOr<std::unique_ptr<FsdpModule>> fsdp =
        FsdpModule::Wrap(net.ptr(), &comm, &device, options);
    ASSERT_THAT(fsdp.status(), IsOk());
    absl::Status status =
        (*fsdp)->LoadCheckpoint(checkpoint::PosixFileSystem(), dir, nullptr);
    EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
    status = (*fsdp)->LoadCheckpoint(checkpoint::PosixFileSystem(),
                                     dir + "-missing", nullptr);
    EXPECT_FALSE(status.ok());
  });
}

TEST(FsdpModuleErrorsTest, OptimizerStateThatDoesNotFitIsRefused) {
  OnOneRank([](SimCommunicator& comm, DeviceOps& device) {
    Net net = MakeNet();
    FsdpOptions options;
    options.wrap = {"h.*"};
    absl::StatusOr<std::unique_ptr<FsdpModule>> fsdp =
        FsdpModule::Wrap(net.ptr(), &comm, &device, options);
    ASSERT_THAT(fsdp.status(), IsOk());
    auto adamw = MakeOptimizer(Optim::kAdamW, (*fsdp)->ShardedParameters());
    optim::OptimStateDict dict;
    dict.state[int64_t{9}]["step"] = optim::ScalarTensor(DType::kFloat32, 1);
    EXPECT_EQ((*fsdp)->LoadShardedOptimState(dict, *adamw).code(),
              absl::StatusCode::kInvalidArgument);
    dict.state.clear();
    dict.state[int64_t{1}]["step"] = optim::ScalarTensor(DType::kFloat32, 1);
    absl::Status status = (*fsdp)->LoadShardedOptimState(dict, *adamw);
    EXPECT_NE(status.message().find("exp_avg"), std::string::npos) << status;
    dict.state[int64_t{1}]["exp_avg"] = HostTensor(DType::kFloat32, {3});
    dict.state[int64_t{1}]["exp_avg_sq"] = HostTensor(DType::kFloat32, {3});
    status = (*fsdp)->LoadShardedOptimState(dict, *adamw);
    EXPECT_NE(status.message().find("elements"), std::string::npos) << status;
    dict.state[int64_t{1}]["momentum_buffer"] =
        HostTensor(DType::kFloat32, {3});
    status = (*fsdp)->LoadShardedOptimState(dict, *adamw);
    EXPECT_NE(status.message().find("momentum_buffer"), std::string::npos)
        << status;
    // An optimizer over other tensors.
    torch::optim::SGD other({torch::zeros({3}, torch::requires_grad())},
                            torch::optim::SGDOptions(0.1));
    EXPECT_EQ((*fsdp)->ShardedOptimState(other).status().code(),
              absl::StatusCode::kInvalidArgument);
  });
}

TEST(FsdpModuleErrorsTest, WrapRefusesWhatItCannotShard) {
  OnOneRank([](SimCommunicator& comm, DeviceOps& device) {
    Net net = MakeNet();
    EXPECT_EQ(FsdpModule::Wrap(net.ptr(), nullptr, &device).status().code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(FsdpModule::Wrap(nullptr, &comm, &device).status().code(),
              absl::StatusCode::kInvalidArgument);

    // Two tensors over one storage.
    auto views = std::make_shared<torch::nn::Module>();
    torch::Tensor base = torch::zeros({10});
    views->register_parameter("a", base.narrow(0, 0, 5));
    views->register_parameter("b", base.narrow(0, 5, 5));
    absl::Status status = FsdpModule::Wrap(views, &comm, &device).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(status.message().find("\"a\" and \"b\""), std::string::npos)
        << status;

    // An integer parameter.
    auto ints = std::make_shared<torch::nn::Module>();
    ints->register_parameter("w", torch::zeros({3}));
    ints->register_parameter("count", torch::zeros({2}, torch::kLong),
                             /*requires_grad=*/false);
    status = FsdpModule::Wrap(ints, &comm, &device).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(status.message().find("\"count\""), std::string::npos) << status;

    // A parameter on a device other than the CPU (the meta device: this
    // LibTorch has no CUDA).
    auto meta = std::make_shared<torch::nn::Module>();
    meta->register_parameter("w", torch::empty({3}, torch::kMeta));
    status = FsdpModule::Wrap(meta, &comm, &device).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(status.message().find("\"w\" is on the meta device"),
              std::string::npos)
        << status;

    // A wrap name that is no module.
    FsdpOptions options;
    options.wrap = {"blocks.*"};
    status =
        FsdpModule::Wrap(MakeNet().ptr(), &comm, &device, options).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  });
}

// A TorchDevice over host memory whose LibTorch device and stream check
// the test chooses.
class ScriptedTorchDevice final : public TorchDevice {
 public:
  DeviceOps& ops() override { return ops_; }
  c10::Device torch_device() const override { return torch_device_; }
  absl::Status CheckCurrentStream() const override {
    ++checks_;
    if (checks_ <= stream_ok_for_) return absl::OkStatus();
    return absl::FailedPreconditionError("the stream changed (scripted)");
  }
  absl::Status HandToTorch() override { return absl::OkStatus(); }

  c10::Device torch_device_ = c10::Device(c10::kCPU);
  // Checks that pass before every later one fails.
  int64_t stream_ok_for_ = std::numeric_limits<int64_t>::max();
  mutable int64_t checks_ = 0;

 private:
  HostDeviceOps ops_;
};

// What the device contract refuses (torch_device.h): a device DeviceOps
// without its TorchDevice, a compute stream other than stream 0,
// parameters on another LibTorch device; and LibTorch's current stream
// changing, found at the forward, at a unit and in the backward's hooks.
TEST(FsdpModuleErrorsTest, TheDeviceContractIsChecked) {
  OnOneRank([](SimCommunicator& comm, DeviceOps&) {
    SimDeviceOps sim_ops;
    absl::Status status =
        FsdpModule::Wrap(MakeNet().ptr(), &comm, &sim_ops).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(status.message().find("TorchCudaDeviceOps"), std::string::npos)
        << status;

    SimTorchDevice sim_device(&sim_ops);
    FsdpOptions options;
    options.handle.streams.compute = *sim_ops.NewStream();
    status =
        FsdpModule::Wrap(MakeNet().ptr(), &comm, &sim_device, options).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(status.message().find("compute stream must be stream 0"),
              std::string::npos)
        << status;

    ScriptedTorchDevice meta;
    meta.torch_device_ = c10::Device(c10::kMeta);
    status = FsdpModule::Wrap(MakeNet().ptr(), &comm, &meta).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(status.message().find("\"wte.weight\" is on cpu; FsdpModule's "
                                    "device is meta"),
              std::string::npos)
        << status;

    // The stream check: every Forward, Unit, Backward and hook asks; the
    // first refusal ends the call with it.
    FsdpOptions blocks;
    blocks.wrap = {"h.*"};
    auto checks_per_step = [&]() -> int64_t {
      ScriptedTorchDevice counting;
      Net net = MakeNet();
      auto fsdp = FsdpModule::Wrap(net.ptr(), &comm, &counting, blocks);
      EXPECT_THAT(fsdp.status(), IsOk());
      torch::Tensor tokens = Tokens(0, 0, 2);
      absl::StatusOr<torch::Tensor> logits = ForwardNet(net, **fsdp, tokens);
      EXPECT_THAT(logits.status(), IsOk());
      const int64_t forward = counting.checks_;
      EXPECT_THAT((*fsdp)->Backward(Loss(*logits, tokens)), IsOk());
      // The root and three blocks in the forward; the backward and its
      // hooks.
      EXPECT_EQ(forward, 1 + kLayers + 1);
      EXPECT_GT(counting.checks_, forward + 1);
      return counting.checks_;
    };
    const int64_t checks = checks_per_step();
    for (int64_t ok_for : {int64_t{0}, int64_t{2}, checks - 1}) {
      SCOPED_TRACE(absl::StrCat("stream right for ", ok_for, " checks"));
      ScriptedTorchDevice scripted;
      Net net = MakeNet();
      auto fsdp = FsdpModule::Wrap(net.ptr(), &comm, &scripted, blocks);
      ASSERT_THAT(fsdp.status(), IsOk());
      scripted.stream_ok_for_ = ok_for;
      torch::Tensor tokens = Tokens(0, 0, 2);
      absl::StatusOr<torch::Tensor> logits = ForwardNet(net, **fsdp, tokens);
      absl::Status step = logits.status();
      if (step.ok()) step = (*fsdp)->Backward(Loss(*logits, tokens));
      EXPECT_EQ(step.code(), absl::StatusCode::kFailedPrecondition) << step;
      EXPECT_NE(step.message().find("the stream changed (scripted)"),
                std::string::npos)
          << step;
    }
  });
}

// A recomputed unit's failures are Statuses: in the forward from
// RecomputedUnit (naming the unit), in the recompute during the backward
// from Backward(), after which the module refuses further steps.
TEST(FsdpModuleErrorsTest, RecomputationFailuresAreStatuses) {
  for (Recomputation where :
       {Recomputation::kInsideUnit, Recomputation::kAroundUnit}) {
    SCOPED_TRACE(RecomputationName(where));
    OnOneRank([where](SimCommunicator& comm, DeviceOps& device) {
      Net net = MakeNet();
      absl::StatusOr<std::unique_ptr<FsdpModule>> fsdp =
          WrapNet(net, comm, device);
      ASSERT_THAT(fsdp.status(), IsOk());
      torch::Tensor tokens = Tokens(0, 0, 2);
      auto forward = [&](const std::string& unit, const TensorFunction& block) {
        return (*fsdp)->Forward([&]() -> absl::StatusOr<torch::Tensor> {
          torch::Tensor x = net->wte(tokens.narrow(1, 0, kSeq));
          for (size_t i = 0; i < net->h->size(); ++i) {
            const std::string name = absl::StrCat("h.", i);
            std::shared_ptr<BlockImpl> b = net->h->ptr<BlockImpl>(i);
            FLATPARAM_ASSIGN_OR_RETURN(
                x,
                (*fsdp)->RecomputedUnit(
                    name == unit ? unit : name, x,
                    name == unit ? block
                                 : TensorFunction([b](const torch::Tensor& in) {
                                     return b->forward(in);
                                   }),
                    where));
          }
          return net->Head(x);
        });
      };
      std::shared_ptr<BlockImpl> block0 = net->h->ptr<BlockImpl>(0);

      absl::StatusOr<torch::Tensor> out =
          (*fsdp)->Forward([&]() -> absl::StatusOr<torch::Tensor> {
            return (*fsdp)->RecomputedUnit(
                "h.9", net->wte(tokens.narrow(1, 0, kSeq)),
                [](const torch::Tensor& x) { return x; }, where);
          });
      EXPECT_EQ(out.status().code(), absl::StatusCode::kNotFound)
          << out.status();

      out = forward("h.1", [](const torch::Tensor& x) -> torch::Tensor {
        TORCH_CHECK(false, "a broken block");
      });
      EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument);
      EXPECT_NE(out.status().message().find("a broken block"),
                std::string::npos)
          << out.status();
      EXPECT_NE(out.status().message().find("\"h.1\""), std::string::npos)
          << out.status();

      // A backward that fails before any hook runs (a loss without a
      // gradient) leaves the module usable.
      EXPECT_EQ((*fsdp)->Backward(torch::zeros({1})).code(),
                absl::StatusCode::kInvalidArgument);

      // The same module, failing only when recomputed.
      auto calls = std::make_shared<int>(0);
      out = forward("h.0", [calls, block0](const torch::Tensor& x) {
        TORCH_CHECK(++*calls == 1, "the recompute failed");
        return block0->forward(x);
      });
      ASSERT_THAT(out.status(), IsOk());
      absl::Status backward = (*fsdp)->Backward(Loss(*out, tokens));
      EXPECT_FALSE(backward.ok());
      EXPECT_NE(backward.message().find("the recompute failed"),
                std::string::npos)
          << backward;
      out = forward("", nullptr);
      EXPECT_EQ(out.status().code(), absl::StatusCode::kFailedPrecondition)
          << out.status();
    });
  }
}

TEST(FsdpModuleErrorsTest, MisuseInTheForwardIsAStatus) {
  OnOneRank([](SimCommunicator& comm, DeviceOps& device) {
    Net net = MakeNet();
    absl::StatusOr<std::unique_ptr<FsdpModule>> fsdp =
        WrapNet(net, comm, device);
    ASSERT_THAT(fsdp.status(), IsOk());
    torch::Tensor tokens = Tokens(0, 0, 2).narrow(1, 0, kSeq);

    // Unit outside Forward, and a name that is not a unit.
    EXPECT_EQ(
        (*fsdp)->Unit("h.0", [] { return torch::Tensor(); }).status().code(),
        absl::StatusCode::kFailedPrecondition);
    absl::StatusOr<torch::Tensor> out =
        (*fsdp)->Forward([&]() -> absl::StatusOr<torch::Tensor> {
          return (*fsdp)->Unit("h.9", [] { return torch::Tensor(); });
        });
    EXPECT_EQ(out.status().code(), absl::StatusCode::kNotFound);
    EXPECT_NE(out.status().message().find("\"h.2\""), std::string::npos)
        << out.status();

    // A block's parameters used outside its Unit: they are empty there.
    out = (*fsdp)->Forward([&]() -> absl::StatusOr<torch::Tensor> {
      return net->h[1]->as<BlockImpl>()->forward(net->wte(tokens));
    });
    EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(out.status().message().find("Unit("), std::string::npos)
        << out.status();

    // The wrapper still works after those errors.
    out = (*fsdp)->Forward([&]() -> absl::StatusOr<torch::Tensor> {
      torch::Tensor x = net->wte(tokens);
      for (size_t i = 0; i < net->h->size(); ++i) {
        FLATPARAM_ASSIGN_OR_RETURN(x, (*fsdp)->Unit(absl::StrCat("h.", i), [&] {
          return net->h[i]->as<BlockImpl>()->forward(x);
        }));
      }
      return net->Head(x);
    });
    ASSERT_THAT(out.status(), IsOk());
    EXPECT_THAT((*fsdp)->Backward(out->sum()), IsOk());
    EXPECT_EQ((*fsdp)->stats().backwards, 1);

    // A module changed after wrapping.
    net->register_parameter("extra", torch::zeros({2}));
    out = (*fsdp)->Forward([&]() -> absl::StatusOr<torch::Tensor> {
      return net->Head(net->wte(tokens));
    });
    EXPECT_EQ(out.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_NE(out.status().message().find("\"extra\""), std::string::npos)
        << out.status();
  });
  OnOneRank([](SimCommunicator& comm, DeviceOps& device) {
    Net net = MakeNet();
    absl::StatusOr<std::unique_ptr<FsdpModule>> fsdp =
        WrapNet(net, comm, device);
    ASSERT_THAT(fsdp.status(), IsOk());
    torch::Tensor tokens = Tokens(0, 0, 2).narrow(1, 0, kSeq);
    // A submodule replaced after wrapping: same names, other tensors.
    net->h[1]->as<BlockImpl>()->replace_module(
        "fc1", torch::nn::Linear(kDim, 2 * kDim));
    absl::StatusOr<torch::Tensor> out =
        (*fsdp)->Forward([&]() -> absl::StatusOr<torch::Tensor> {
          return net->Head(net->wte(tokens));
        });
    EXPECT_EQ(out.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_NE(out.status().message().find("\"h.1.fc1.weight\""),
              std::string::npos)
        << out.status();
    EXPECT_NE(out.status().message().find("reassigned"), std::string::npos)
        << out.status();
  });
}

// The bitwise comparisons rely on torch_test_main's single intra-op
// thread.
TEST(TorchTestMainTest, OneIntraOpThread) {
  EXPECT_EQ(torch::get_num_threads(), 1);
}

}  // namespace
}  // namespace libtorch
}  // namespace flatparam
