// FsdpModule in the training loops users write (torch_loops_testutil.h),
// on simulated ranks, bit for bit against the same loops in plain
// single-process LibTorch; and the misuses those loops meet, refused with
// errors that say what to do.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/base/status_matchers.h"
#include "flatparam/device/device.h"
#include "flatparam/model.h"
#include "flatparam/model_json.h"
#include "flatparam/torch/fsdp_module.h"
#include "flatparam/torch/recompute.h"
#include "flatparam/torch/torch_loops_testutil.h"
#include "flatparam/torch/torch_testutil.h"
#include "sim/sim.h"

namespace flatparam {
namespace libtorch {
namespace {

using ::flatparam::IsOk;
using namespace ::flatparam::libtorch::testing;  // NOLINT

// `loop` on every rank of a `world`-rank simulated world.
absl::Status OnSim(
    int world,
    const std::function<absl::Status(Communicator&, DeviceOps&)>& loop) {
  SimOptions sim;
  sim.world_size = world;
  FLATPARAM_ASSIGN_OR_RETURN(std::unique_ptr<SimWorld> w,
                             SimWorld::Create(sim));
  return w->Run([&](SimCommunicator& comm) -> absl::Status {
    HostDeviceOps device;
    return loop(comm, device);
  });
}

std::string TmpDir(const std::string& name) {
  return absl::StrCat(std::getenv("TEST_TMPDIR"), "/", name);
}

struct LoopCase {
  int world = 2;
  LoopOptions options;
};
std::string CaseName(const ::testing::TestParamInfo<LoopCase>& info) {
  return absl::StrCat(LoopName(info.param.options), "_w", info.param.world);
}

std::vector<LoopCase> Cases() {
  return {
      {2, {ShardingStrategy::kFullShard}},
      {2, {ShardingStrategy::kFullShard, 0, Recomputation::kNone, true}},
      {4, {ShardingStrategy::kShardGradOp}},
      {4, {ShardingStrategy::kHybridShard, 2, Recomputation::kNone, true}},
      {2, {ShardingStrategy::kNoShard}},
  };
}

class LoopsTest : public ::testing::TestWithParam<LoopCase> {};

TEST_P(LoopsTest, LoraFrozenBaseTrainableAdapters) {
  int64_t peak = 0, bound = 0;
  EXPECT_THAT(OnSim(GetParam().world,
                    [&](Communicator& comm, DeviceOps& device) {
                      int64_t p = 0, b = 0;
                      absl::Status s = LoraLoop(comm, device,
                                                GetParam().options, 20, &p, &b);
                      if (comm.rank() == 0) peak = p, bound = b;
                      return s;
                    }),
              IsOk());
  RecordProperty("peak_unsharded_param_bytes", peak);
  RecordProperty("bound_bytes", bound);
}

TEST_P(LoopsTest, AutogradGradAndGradientsOfGradients) {
  EXPECT_THAT(OnSim(GetParam().world,
                    [&](Communicator& comm, DeviceOps& device) {
                      return AutogradGradLoop(comm, device, GetParam().options);
                    }),
              IsOk());
}

TEST_P(LoopsTest, RequiresGradChangedBetweenSteps) {
  EXPECT_THAT(OnSim(GetParam().world,
                    [&](Communicator& comm, DeviceOps& device) {
                      return RequiresGradChangeLoop(comm, device,
                                                    GetParam().options);
                    }),
              IsOk());
}

TEST_P(LoopsTest, OptimizerSetsGradientsToNone) {
  EXPECT_THAT(OnSim(GetParam().world,
                    [&](Communicator& comm, DeviceOps& device) {
                      return SetToNoneLoop(comm, device, GetParam().options);
                    }),
              IsOk());
}

TEST_P(LoopsTest, EvaluateThenSaveThenResume) {
  const std::string dir = TmpDir(absl::StrCat(
      "eval_", LoopName(GetParam().options), "_w", GetParam().world));
  EXPECT_THAT(OnSim(GetParam().world,
                    [&](Communicator& comm, DeviceOps& device) {
                      return EvaluateThenSaveLoop(comm, device,
                                                  GetParam().options, dir);
                    }),
              IsOk());
}

TEST_P(LoopsTest, SeveralOutputsPerUnit) {
  EXPECT_THAT(OnSim(GetParam().world,
                    [&](Communicator& comm, DeviceOps& device) {
                      return SeveralOutputsLoop(comm, device,
                                                GetParam().options);
                    }),
              IsOk());
}

TEST_P(LoopsTest, ParameterGroupsByNameWithNoSync) {
  const std::string dir = TmpDir(absl::StrCat(
      "groups_", LoopName(GetParam().options), "_w", GetParam().world));
  EXPECT_THAT(OnSim(GetParam().world,
                    [&](Communicator& comm, DeviceOps& device) {
                      return ParamGroupsLoop(comm, device, GetParam().options,
                                             dir);
                    }),
              IsOk());
}

INSTANTIATE_TEST_SUITE_P(Strategies, LoopsTest, ::testing::ValuesIn(Cases()),
                         CaseName);

// A weight reached twice in one backward (the tied embedding inside every
// block, block h.0 applied twice), with and without recomputation.
class SharedWeightTest : public ::testing::TestWithParam<LoopCase> {};

TEST_P(SharedWeightTest, EveryGradientReachesTheReduction) {
  EXPECT_THAT(OnSim(GetParam().world,
                    [&](Communicator& comm, DeviceOps& device) {
                      return SharedWeightLoop(comm, device, GetParam().options,
                                              3);
                    }),
              IsOk());
}

INSTANTIATE_TEST_SUITE_P(
    Recomputation, SharedWeightTest,
    ::testing::Values(
        LoopCase{2, {ShardingStrategy::kFullShard, 0, Recomputation::kNone}},
        LoopCase{2,
                 {ShardingStrategy::kFullShard, 0, Recomputation::kInsideUnit}},
        LoopCase{2,
                 {ShardingStrategy::kFullShard, 0, Recomputation::kAroundUnit}},
        LoopCase{4,
                 {ShardingStrategy::kShardGradOp, 0, Recomputation::kInsideUnit,
                  true}},
        LoopCase{
            4,
            {ShardingStrategy::kHybridShard, 2, Recomputation::kAroundUnit}}),
    CaseName);

// The LoRA loop's peak memory is a FULL_SHARD one: root + 2 blocks, where
// keeping the mixed units gathered to the backward's end would be root + 4.
TEST(FsdpModuleLoraTest, PeakMemoryIsFullShards) {
  int64_t peak = 0, bound = 0;
  ASSERT_THAT(OnSim(2,
                    [&](Communicator& comm, DeviceOps& device) {
                      int64_t p = 0, b = 0;
                      absl::Status s = LoraLoop(comm, device, {}, 2, &p, &b);
                      if (comm.rank() == 0) peak = p, bound = b;
                      return s;
                    }),
              IsOk());
  EXPECT_GT(peak, 0);
  EXPECT_LE(peak, bound);
}

void OnOneRank(const std::function<void(Communicator&, DeviceOps&)>& body) {
  ASSERT_THAT(OnSim(1,
                    [&](Communicator& comm, DeviceOps& device) {
                      body(comm, device);
                      return absl::OkStatus();
                    }),
              IsOk());
}

// Without use_orig_params the optimizer steps whole flat shards: a unit
// that mixes frozen and trainable parameters is refused, saying what to
// do; so is a requires_grad change that would mix them.
TEST(FsdpModuleFrozenTest, FlatPathRefusesMixedUnits) {
  OnOneRank([](Communicator& comm, DeviceOps& device) {
    LoraNet lora(kVocab, 8, 2, 2);
    for (auto& p : lora->named_parameters()) {
      p.value().set_requires_grad(absl::StrContains(p.key(), "lora_"));
    }
    FsdpOptions options;
    options.wrap = {"h.*"};
    options.align_addresses = true;
    absl::Status status =
        FsdpModule::Wrap(lora.ptr(), &comm, &device, options).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    EXPECT_TRUE(absl::StrContains(status.message(), "use_orig_params"))
        << status;

    Net net = MakeNet();
    options.align_addresses = false;
    absl::StatusOr<std::unique_ptr<FsdpModule>> fsdp =
        FsdpModule::Wrap(net.ptr(), &comm, &device, options);
    ASSERT_THAT(fsdp.status(), IsOk());
    net->h[0]->as<BlockImpl>()->fc1->weight.set_requires_grad(false);
    absl::StatusOr<torch::Tensor> out =
        ForwardNet(net, **fsdp, Tokens(0, 0, 2));
    EXPECT_EQ(out.status().code(), absl::StatusCode::kFailedPrecondition)
        << out.status();
    EXPECT_TRUE(absl::StrContains(out.status().message(), "use_orig_params"))
        << out.status();
    EXPECT_FALSE((*fsdp)->NamedShardedParameters().ok());
  });
}

// use_orig_params: one optimizer tensor per original parameter, by name, so
// that parameter groups can be built per parameter.
TEST(FsdpModuleFrozenTest, OrigParamsAreNamedPiecesOfTheShard) {
  EXPECT_THAT(
      OnSim(2,
            [](Communicator& comm, DeviceOps& device) -> absl::Status {
              Net net = MakeNet();
              FsdpOptions options;
              options.wrap = {"h.*"};
              options.use_orig_params = true;
              FLATPARAM_ASSIGN_OR_RETURN(
                  std::unique_ptr<FsdpModule> fsdp,
                  FsdpModule::Wrap(net.ptr(), &comm, &device, options));
              FLATPARAM_ASSIGN_OR_RETURN(auto named,
                                         fsdp->NamedShardedParameters());
              // Every parameter once (the tied head under the embedding's
              // name), in named_parameters() order, each a 1-D piece.
              std::vector<std::string> want;
              for (const auto& p : net->named_parameters()) {
                if (p.key() != "lm_head.weight") want.push_back(p.key());
              }
              std::vector<std::string> names;
              for (const auto& [name, t] : named) {
                names.push_back(name);
                if (t.dim() != 1) return absl::InternalError(name + " not 1-D");
              }
              if (names != want) return absl::InternalError("names differ");
              if (fsdp->ShardedParameters().size() != named.size()) {
                return absl::InternalError("ShardedParameters() differs");
              }
              return absl::OkStatus();
            }),
      IsOk());
}

// Recompute refuses backwards that compute only some gradients, as
// PyTorch's reentrant checkpoint does.
TEST(FsdpModuleRecomputeTest, RecomputeRefusesPartialBackwards) {
  torch::Tensor w = torch::randn({3, 3}, torch::requires_grad());
  torch::Tensor x = torch::randn({2, 3}, torch::requires_grad());
  auto f = [w](const torch::Tensor& in) { return torch::matmul(in, w); };
  for (bool use_inputs : {false, true}) {
    torch::Tensor y = Recompute(f, x).sum();
    bool refused = false;
    try {
      if (use_inputs) {
        torch::autograd::backward({y}, {}, c10::nullopt, false, {x});
      } else {
        torch::autograd::grad({y}, {x});
      }
    } catch (const c10::Error& e) {
      refused =
          absl::StrContains(e.what_without_backtrace(), "autograd::grad()");
    }
    EXPECT_TRUE(refused) << use_inputs;
  }
}

// Evaluation follows module->eval(): with use_full_prec_in_eval a
// bfloat16-trained model evaluates on its float32 parameters.
TEST(FsdpModuleEvalTest, FollowsTheModulesTrainingFlag) {
  OnOneRank([](Communicator& comm, DeviceOps& device) {
    Net net = MakeNet();
    FsdpOptions options;
    options.wrap = {"h.*"};
    options.handle.param_dtype = DType::kBFloat16;
    options.handle.use_full_prec_in_eval = true;
    absl::StatusOr<std::unique_ptr<FsdpModule>> fsdp =
        FsdpModule::Wrap(net.ptr(), &comm, &device, options);
    ASSERT_THAT(fsdp.status(), IsOk());
    torch::Tensor tokens = Tokens(0, 0, 2);
    for (bool training : {true, false, true}) {
      net->train(training);
      c10::ScalarType seen = c10::ScalarType::Undefined;
      torch::NoGradGuard no_grad;
      absl::StatusOr<torch::Tensor> out = ForwardNet(
          net, **fsdp, tokens,
          [&](BlockImpl& block) { seen = block.fc1->weight.scalar_type(); });
      ASSERT_THAT(out.status(), IsOk());
      EXPECT_EQ(seen, training ? torch::kBFloat16 : torch::kFloat) << training;
    }
  });
}

// Units by module type, as PyTorch's ModuleWrapPolicy({Block}); the model
// file the import tools take, from the module.
TEST(FsdpModuleWrapTest, UnitsByModuleTypeAndTheModelFile) {
  OnOneRank([](Communicator& comm, DeviceOps& device) {
    FsdpOptions options;
    options.wrap_module_types = {"BlockImpl"};
    Net net = MakeNet();
    absl::StatusOr<std::unique_ptr<FsdpModule>> fsdp =
        FsdpModule::Wrap(net.ptr(), &comm, &device, options);
    ASSERT_THAT(fsdp.status(), IsOk());
    EXPECT_EQ((*fsdp)->unit_names(),
              (std::vector<std::string>{"", "h.0", "h.1", "h.2"}));
    const nlohmann::json file = (*fsdp)->ModelFile();
    absl::StatusOr<ModelSpec> spec =
        ParseModelSpecJson(file.dump(), "ModelFile()");
    ASSERT_THAT(spec.status(), IsOk());
    EXPECT_EQ(spec->params.size(), (*fsdp)->layout().spec().params.size());
    EXPECT_EQ(file.dump(), ModelSpecToJson(*spec).dump());

    options.wrap_module_types = {"Blok"};
    absl::Status status =
        FsdpModule::Wrap(MakeNet().ptr(), &comm, &device, options).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(absl::StrContains(status.message(), "BlockImpl")) << status;
  });
}

// Mixed precision casts the floating inputs passed to Forward and Unit, as
// PyTorch's cast_root_forward_inputs / cast_forward_inputs do: an fp32
// activation into a bfloat16 unit works, and its gradient comes back in
// fp32; without the cast LibTorch refuses the dtypes.
TEST(FsdpModuleMixedPrecisionTest, ForwardInputsAreCast) {
  OnOneRank([](Communicator& comm, DeviceOps& device) {
    Net net = MakeNet();
    FsdpOptions options;
    options.wrap = {"h.*"};
    options.handle.param_dtype = DType::kBFloat16;
    options.cast_forward_inputs = true;
    absl::StatusOr<std::unique_ptr<FsdpModule>> fsdp =
        FsdpModule::Wrap(net.ptr(), &comm, &device, options);
    ASSERT_THAT(fsdp.status(), IsOk());
    torch::Tensor x = torch::randn({2, kSeq, kDim}, torch::requires_grad());
    auto* block = net->h[0]->as<BlockImpl>();
    absl::StatusOr<torch::autograd::variable_list> out = (*fsdp)->Forward(
        {x},
        [&](const torch::autograd::variable_list& in)
            -> absl::StatusOr<torch::autograd::variable_list> {
          if (in[0].scalar_type() != torch::kBFloat16) {
            return absl::InternalError("the root's input was not cast");
          }
          return (*fsdp)->Unit(
              "h.0", {x}, [&](const torch::autograd::variable_list& i) {
                return torch::autograd::variable_list{block->forward(i[0])};
              });
        });
    ASSERT_THAT(out.status(), IsOk());
    EXPECT_EQ((*out)[0].scalar_type(), torch::kBFloat16);
    ASSERT_THAT((*fsdp)->Backward((*out)[0].to(torch::kFloat).sum()), IsOk());
    ASSERT_TRUE(x.grad().defined());
    EXPECT_EQ(x.grad().scalar_type(), torch::kFloat);

    // Captured by the function instead: not cast, and LibTorch refuses.
    absl::StatusOr<torch::Tensor> plain =
        (*fsdp)->Forward([&]() -> absl::StatusOr<torch::Tensor> {
          return (*fsdp)->Unit("h.0", [&] { return block->forward(x); });
        });
    EXPECT_EQ(plain.status().code(), absl::StatusCode::kInvalidArgument)
        << plain.status();
  });
}

// A std::exception from the caller's forward is a Status, and the module
// works on; a tensor that leaves a unit without being returned fails the
// backward with a message that names the unit and what to do.
TEST(FsdpModuleMisuseTest, ExceptionsAndUnreturnedTensors) {
  OnOneRank([](Communicator& comm, DeviceOps& device) {
    Net net = MakeNet();
    FsdpOptions options;
    options.wrap = {"h.*"};
    absl::StatusOr<std::unique_ptr<FsdpModule>> fsdp =
        FsdpModule::Wrap(net.ptr(), &comm, &device, options);
    ASSERT_THAT(fsdp.status(), IsOk());
    torch::Tensor tokens = Tokens(0, 0, 2);
    absl::StatusOr<torch::Tensor> out =
        (*fsdp)->Forward([&]() -> absl::StatusOr<torch::Tensor> {
          return (*fsdp)->Unit("h.0", [&]() -> torch::Tensor {
            throw std::runtime_error("the user's own error");
          });
        });
    EXPECT_EQ(out.status().code(), absl::StatusCode::kUnknown);
    EXPECT_TRUE(
        absl::StrContains(out.status().message(), "the user's own error"))
        << out.status();
    EXPECT_TRUE(absl::StrContains(out.status().message(), "\"h.0\""))
        << out.status();
    out = ForwardNet(net, **fsdp, tokens);
    ASSERT_THAT(out.status(), IsOk());
    EXPECT_THAT((*fsdp)->Backward(Loss(*out, tokens)), IsOk());

    // An auxiliary tensor kept aside instead of returned.
    torch::Tensor aux;
    out = (*fsdp)->Forward([&]() -> absl::StatusOr<torch::Tensor> {
      torch::Tensor x = net->wte(tokens.narrow(1, 0, kSeq));
      for (size_t i = 0; i < net->h->size(); ++i) {
        auto* block = net->h[i]->as<BlockImpl>();
        FLATPARAM_ASSIGN_OR_RETURN(x, (*fsdp)->Unit(absl::StrCat("h.", i), [&] {
          if (i == 0) aux = block->fc1(block->ln(x)).pow(2).mean();
          return block->forward(x);
        }));
      }
      return net->Head(x);
    });
    ASSERT_THAT(out.status(), IsOk());
    absl::Status status = (*fsdp)->Backward(aux);
    EXPECT_FALSE(status.ok());
    EXPECT_TRUE(absl::StrContains(status.message(), "several outputs"))
        << status;
  });
}

// Hooks outlive the module that made them: they do nothing once it is
// gone (a retained graph back-propagated after the FsdpModule died).
TEST(FsdpModuleMisuseTest, HooksAreInertAfterTheModuleIsDestroyed) {
  OnOneRank([](Communicator& comm, DeviceOps& device) {
    Net net = MakeNet();
    FsdpOptions options;
    options.wrap = {"h.*"};
    absl::StatusOr<std::unique_ptr<FsdpModule>> fsdp =
        FsdpModule::Wrap(net.ptr(), &comm, &device, options);
    ASSERT_THAT(fsdp.status(), IsOk());
    torch::Tensor tokens = Tokens(0, 0, 2);
    absl::StatusOr<torch::Tensor> out = ForwardNet(net, **fsdp, tokens);
    ASSERT_THAT(out.status(), IsOk());
    torch::Tensor loss = Loss(*out, tokens);
    fsdp->reset();
    // The graph's saved parameter views are empty now: LibTorch's own
    // error, not a crash inside a destroyed module's hooks.
    EXPECT_THROW(loss.backward(), c10::Error);
  });
}

}  // namespace
}  // namespace libtorch
}  // namespace flatparam
