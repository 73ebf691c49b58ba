// FsdpModule in the training loops users write (torch_loops_testutil.h),
// on simulated ranks, bit for bit against the same loops in plain
// single-process LibTorch; and the misuses those loops meet, refused with
// errors that say what to do.
#include <gtest/gtest.h>
#include <torch/autograd.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>
#include <torch/types.h>
#include <torch/utils.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/base/status_matchers.h"
#include "flatparam/checkpoint/checkpoint_dir.h"
#include "flatparam/checkpoint/file_system.h"
#include "flatparam/checkpoint/training_checkpoints.h"
#include "flatparam/device/device.h"
#include "flatparam/interop/dcp/dcp.h"
#include "flatparam/model_json.h"
#include "flatparam/model_layout.h"
#include "flatparam/optim/optim_state.h"
#include "flatparam/torch/fsdp_module.h"
#include "flatparam/torch/recompute.h"
#include "refmodel/torch_gpt.h"
#include "sim/sim.h"
#include "sim/sim_device.h"
#include "testing/sim_torch_device.h"
#include "testing/torch_loops_testutil.h"
#include "testing/torch_testutil.h"

namespace flatparam {
namespace libtorch {
namespace {

using ::flatparam::IsOk;
using namespace ::flatparam::libtorch::testing;  // NOLINT

// The simulated device's streams (OnSimDevice).
constexpr Stream kSimUnshard{1};
constexpr Stream kSimPostBackward{2};

// `rank` on every rank of a `world`-rank simulated world.
absl::Status OnRanks(
    int world, const std::function<absl::Status(SimCommunicator&)>& rank) {
  SimOptions sim;
  sim.world_size = world;
  FLATPARAM_ASSIGN_OR_RETURN(std::unique_ptr<SimWorld> w,
                             SimWorld::Create(sim));
  return w->Run(rank);
}

// `loop` on every rank of a `world`-rank simulated world.
absl::Status OnSim(
    int world,
    const std::function<absl::Status(Communicator&, TorchDevice&)>& loop) {
  return OnRanks(world, [&](SimCommunicator& comm) {
    HostDeviceOps ops;
    HostTorchDevice device(&ops);
    return loop(comm, device);
  });
}

// The same with the flat parameters in simulated device memory under CPU
// tensors (testing/sim_torch_device.h): each rank's SimDeviceOps runs its
// streams late and reordered (seeded by the rank), the handles use
// streams 1 (unshard) and 2 (post-backward) and collectives are
// stream-ordered; an error if the race detector reported anything.
absl::Status OnSimDevice(
    int world,
    const std::function<absl::Status(Communicator&, TorchDevice&)>& loop) {
  return OnRanks(world, [&](SimCommunicator& comm) -> absl::Status {
    SimDeviceOptions options;
    options.seed = 7 + comm.rank();
    SimDeviceOps ops(options);
    StreamCheckedCommunicator checked(&comm, &ops, /*stream_ordered=*/true);
    FLATPARAM_ASSIGN_OR_RETURN(Stream unshard, ops.NewStream());
    FLATPARAM_ASSIGN_OR_RETURN(Stream post_backward, ops.NewStream());
    if (unshard != kSimUnshard || post_backward != kSimPostBackward) {
      return absl::InternalError("unexpected stream ids");
    }
    SimTorchDevice device(&ops);
    absl::Status ran = loop(checked, device);
    FLATPARAM_RETURN_IF_ERROR(ops.Synchronize());
    FLATPARAM_RETURN_IF_ERROR(ops.CheckNoRaces());
    return ran;
  });
}

std::string TmpDir(const std::string& name) {
  return absl::StrCat(std::getenv("TEST_TMPDIR"), "/", name);
}

struct LoopCase {
  int world = 2;
  LoopOptions options;
  // On OnSimDevice instead of OnSim.
  bool sim_device = false;
};
std::string CaseName(const LoopCase& c) {
  return absl::StrCat(LoopName(c.options), "_w", c.world,
                      c.sim_device ? "_simdevice" : "");
}
std::string ParamName(const ::testing::TestParamInfo<LoopCase>& info) {
  return CaseName(info.param);
}

std::vector<LoopCase> Cases() {
  return {
      {2, {ShardingStrategy::kFullShard}},
      {2, {ShardingStrategy::kFullShard, 0, Recomputation::kNone, true}},
      {4, {ShardingStrategy::kShardGradOp}},
      {4, {ShardingStrategy::kHybridShard, 2, Recomputation::kNone, true}},
      {2, {ShardingStrategy::kNoShard}},
      // FsdpModule's device path: the same loops with the flat parameters
      // in simulated device memory.
      {2, {ShardingStrategy::kFullShard}, true},
      {2, {ShardingStrategy::kFullShard, 0, Recomputation::kNone, true}, true},
      {4,
       {ShardingStrategy::kHybridShard, 2, Recomputation::kNone, true},
       true},
  };
}

class LoopsTest : public ::testing::TestWithParam<LoopCase> {
 protected:
  // `f` on every rank of the case's world, on its device.
  absl::Status OnCase(
      const std::function<absl::Status(Communicator&, TorchDevice&)>& f) {
    return GetParam().sim_device ? OnSimDevice(GetParam().world, f)
                                 : OnSim(GetParam().world, f);
  }
  // The case's loop options, with the simulated device's streams.
  LoopOptions Opts() const {
    LoopOptions o = GetParam().options;
    if (GetParam().sim_device) {
      o.streams.unshard = kSimUnshard;
      o.streams.post_backward = kSimPostBackward;
    }
    return o;
  }
  // `loop` on every rank of the case's simulated world.
  using Loop = absl::Status (*)(Communicator&, TorchDevice&,
                                const LoopOptions&);
  absl::Status Run(Loop loop) {
    return OnCase([&](Communicator& comm, TorchDevice& device) {
      return loop(comm, device, Opts());
    });
  }
};

TEST_P(LoopsTest, LoraFrozenBaseTrainableAdapters) {
  int64_t peak = 0, bound = 0;
  EXPECT_THAT(OnCase([&](Communicator& comm, TorchDevice& device) {
                int64_t p = 0, b = 0;
                absl::Status s = LoraLoop(comm, device, Opts(), 20, &p, &b);
                if (comm.rank() == 0) peak = p, bound = b;
                return s;
              }),
              IsOk());
  RecordProperty("peak_unsharded_param_bytes", peak);
  RecordProperty("bound_bytes", bound);
}

TEST_P(LoopsTest, AutogradGradAndGradientsOfGradients) {
  EXPECT_THAT(Run(AutogradGradLoop), IsOk());
}

TEST_P(LoopsTest, RequiresGradChangedBetweenSteps) {
  EXPECT_THAT(Run(RequiresGradChangeLoop), IsOk());
}

TEST_P(LoopsTest, OptimizerSetsGradientsToNone) {
  EXPECT_THAT(Run(SetToNoneLoop), IsOk());
}

// Saved as a DCP directory and resumed from it, bitwise.
TEST_P(LoopsTest, ResumesThroughDistributedCheckpoint) {
  const std::string dir = TmpDir(absl::StrCat("dcp_", CaseName(GetParam())));
  EXPECT_THAT(OnCase([&](Communicator& comm, TorchDevice& device) {
                return DcpResumeLoop(comm, device, Opts(), dir);
              }),
              IsOk());
}

// A DCP saved at 2 ranks, loaded at 3 (each rank reading its own rows)
// and saved again: every tensor, model and optimizer state, and the param
// groups are the same, chunked for 3; saving into a directory that holds
// files is refused.
TEST(FsdpModuleDcpTest, LoadsAtAnotherWorldSizeAndSavesTheSame) {
  for (const bool orig : {false, true}) {
    SCOPED_TRACE(orig ? "use_orig_params" : "flat");
    LoopOptions options;
    options.use_orig_params = orig;
    const std::string dir = TmpDir(absl::StrCat("dcp_w2_", orig));
    const std::string again = TmpDir(absl::StrCat("dcp_w3_", orig));
    ASSERT_THAT(OnSim(2,
                      [&](Communicator& comm, TorchDevice& device) {
                        return DcpSaveOrReshardLoop(comm, device, options, dir,
                                                    "");
                      }),
                IsOk());
    ASSERT_THAT(OnSim(3,
                      [&](Communicator& comm, TorchDevice& device) {
                        return DcpSaveOrReshardLoop(comm, device, options, dir,
                                                    again);
                      }),
                IsOk());
    absl::StatusOr<DcpReader> a =
        DcpReader::Open(checkpoint::PosixFileSystem(), dir);
    absl::StatusOr<DcpReader> b =
        DcpReader::Open(checkpoint::PosixFileSystem(), again);
    ASSERT_THAT(a, IsOk());
    ASSERT_THAT(b, IsOk());
    ASSERT_EQ(a->metadata().entries.size(), b->metadata().entries.size());
    int resharded = 0;
    for (const auto& [key, e] : a->metadata().entries) {
      SCOPED_TRACE(key);
      auto it = b->metadata().entries.find(key);
      ASSERT_NE(it, b->metadata().entries.end());
      if (e.kind == DcpEntry::Kind::kBytes) {
        absl::StatusOr<nlohmann::json> x = a->ReadBytes(key);
        absl::StatusOr<nlohmann::json> y = b->ReadBytes(key);
        ASSERT_THAT(x, IsOk());
        ASSERT_THAT(y, IsOk());
        EXPECT_EQ(*x, *y);
        continue;
      }
      absl::StatusOr<HostTensor> x = a->ReadTensor(key);
      absl::StatusOr<HostTensor> y = b->ReadTensor(key);
      ASSERT_THAT(x, IsOk());
      ASSERT_THAT(y, IsOk());
      EXPECT_TRUE(*x == *y);
      resharded += e.chunks.size() != it->second.chunks.size();
    }
    EXPECT_GT(resharded, 0);
    EXPECT_TRUE(a->metadata().entries.count("optim.param_groups"));
    // Not into a directory that holds files.
    EXPECT_THAT(OnSim(2,
                      [&](Communicator& comm, TorchDevice& device) {
                        return DcpSaveOrReshardLoop(comm, device, options,
                                                    again, "");
                      }),
                StatusIs(absl::StatusCode::kFailedPrecondition,
                         ::testing::HasSubstr("a DCP checkpoint is saved into "
                                              "a new or empty directory")));
  }
}

// Rank 1 cannot create its file: every rank returns rank 1's error, rank
// 0 removes the file it wrote, and no .metadata is written (the directory
// is no checkpoint).
class FailRankFile : public checkpoint::ForwardingFileSystem {
 public:
  using ForwardingFileSystem::ForwardingFileSystem;
  absl::StatusOr<std::unique_ptr<checkpoint::WritableFile>> NewWritableFile(
      const std::string& path) override {
    if (absl::EndsWith(path, "/__1_0.distcp")) {
      return absl::UnavailableError("injected: disk full");
    }
    return ForwardingFileSystem::NewWritableFile(path);
  }
};

TEST(FsdpModuleDcpTest, ARankThatCannotWriteFailsEveryRankAndLeavesNoFiles) {
  const std::string dir = TmpDir("dcp_fail");
  FailRankFile fs(checkpoint::PosixFileSystem());
  EXPECT_THAT(
      OnSim(2,
            [&](Communicator& comm, TorchDevice& device) -> absl::Status {
              torch::manual_seed(5);
              torch::nn::Linear linear(4, 3);
              FLATPARAM_ASSIGN_OR_RETURN(
                  std::unique_ptr<FsdpModule> fsdp,
                  FsdpModule::Wrap(linear.ptr(), &comm, &device, {}));
              absl::Status saved = fsdp->SaveDcpCheckpoint(fs, dir, nullptr);
              if (!absl::StrContains(saved.message(), "rank 1") ||
                  !absl::StrContains(saved.message(), "injected: disk full")) {
                return absl::InternalError(absl::StrCat(
                    "rank ", comm.rank(), " returned ", saved.ToString()));
              }
              return absl::OkStatus();
            }),
      IsOk());
  EXPECT_THAT(checkpoint::PosixFileSystem().GetChildren(dir),
              IsOkAndHolds(::testing::IsEmpty()));
  EXPECT_THAT(IsDcpCheckpoint(checkpoint::PosixFileSystem(), dir),
              IsOkAndHolds(false));
}

TEST_P(LoopsTest, EvaluateThenSaveThenResume) {
  const std::string dir = TmpDir(absl::StrCat("eval_", CaseName(GetParam())));
  EXPECT_THAT(OnCase([&](Communicator& comm, TorchDevice& device) {
                return EvaluateThenSaveLoop(comm, device, Opts(), dir);
              }),
              IsOk());
}

TEST_P(LoopsTest, ZeroGradAndEvaluationInsideAStep) {
  EXPECT_THAT(Run(InsideAStepLoop), IsOk());
}

TEST_P(LoopsTest, SeveralOutputsPerUnit) {
  EXPECT_THAT(Run(SeveralOutputsLoop), IsOk());
}

TEST_P(LoopsTest, ParameterGroupsByNameWithNoSync) {
  const std::string dir = TmpDir(absl::StrCat("groups_", CaseName(GetParam())));
  EXPECT_THAT(OnCase([&](Communicator& comm, TorchDevice& device) {
                return ParamGroupsLoop(comm, device, Opts(), dir);
              }),
              IsOk());
}

INSTANTIATE_TEST_SUITE_P(Strategies, LoopsTest, ::testing::ValuesIn(Cases()),
                         ParamName);

// A weight reached twice in one backward (the tied embedding inside every
// block, block h.0 applied twice), with and without recomputation.
class SharedWeightTest : public LoopsTest {};

TEST_P(SharedWeightTest, EveryGradientReachesTheReduction) {
  EXPECT_THAT(OnCase([&](Communicator& comm, TorchDevice& device) {
                return SharedWeightLoop(comm, device, Opts(), 3);
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
            4, {ShardingStrategy::kHybridShard, 2, Recomputation::kAroundUnit}},
        // On the simulated device.
        LoopCase{2,
                 {ShardingStrategy::kFullShard, 0, Recomputation::kInsideUnit},
                 true},
        LoopCase{2,
                 {ShardingStrategy::kFullShard, 0, Recomputation::kAroundUnit},
                 true}),
    ParamName);

// The LoRA loop's peak memory is a FULL_SHARD one: root + 2 blocks, where
// keeping the mixed units gathered to the backward's end would be root + 4.
TEST(FsdpModuleLoraTest, PeakMemoryIsFullShards) {
  int64_t peak = 0, bound = 0;
  ASSERT_THAT(OnSim(2,
                    [&](Communicator& comm, TorchDevice& device) {
                      int64_t p = 0, b = 0;
                      absl::Status s = LoraLoop(comm, device, {}, 2, &p, &b);
                      if (comm.rank() == 0) peak = p, bound = b;
                      return s;
                    }),
              IsOk());
  EXPECT_GT(peak, 0);
  EXPECT_LE(peak, bound);
}

// `net` wrapped with one unit per block.
absl::StatusOr<std::unique_ptr<FsdpModule>> WrapBlocks(Net& net,
                                                       Communicator& comm,
                                                       TorchDevice& device) {
  FsdpOptions options;
  options.wrap = {"h.*"};
  return FsdpModule::Wrap(net.ptr(), &comm, &device, options);
}

void OnOneRank(const std::function<void(Communicator&, TorchDevice&)>& body) {
  ASSERT_THAT(OnSim(1,
                    [&](Communicator& comm, TorchDevice& device) {
                      body(comm, device);
                      return absl::OkStatus();
                    }),
              IsOk());
}

// Without use_orig_params the optimizer steps whole flat shards: a unit
// that mixes frozen and trainable parameters is refused, saying what to
// do; so is a requires_grad change that would mix them.
TEST(FsdpModuleFrozenTest, FlatPathRefusesMixedUnits) {
  OnOneRank([](Communicator& comm, TorchDevice& device) {
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
            [](Communicator& comm, TorchDevice& device) -> absl::Status {
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
  OnOneRank([](Communicator& comm, TorchDevice& device) {
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
  OnOneRank([](Communicator& comm, TorchDevice& device) {
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
  OnOneRank([](Communicator& comm, TorchDevice& device) {
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

// A BatchNorm network resumes bitwise through StateDict (parameters and
// each rank's running statistics) and the sharded optimizer state:
// 2 + 2 steps equal 4.
TEST(FsdpModuleStateDictTest, BatchNormResumesBitwise) {
  EXPECT_THAT(
      OnSim(2,
            [](Communicator& comm, TorchDevice& device) -> absl::Status {
              FsdpOptions options;
              options.wrap = {"h.*"};
              auto train =
                  [&](int first, int last,
                      const torch::OrderedDict<std::string, torch::Tensor>* sd,
                      const optim::OptimStateDict* optim_sd,
                      torch::OrderedDict<std::string, torch::Tensor>* out_sd,
                      optim::OptimStateDict* out_optim) -> absl::Status {
                BnNet net = MakeBnNet();
                FLATPARAM_ASSIGN_OR_RETURN(
                    std::unique_ptr<FsdpModule> fsdp,
                    FsdpModule::Wrap(net.ptr(), &comm, &device, options));
                torch::optim::AdamW adamw(fsdp->ShardedParameters(),
                                          torch::optim::AdamWOptions(0.01));
                if (sd != nullptr) {
                  FLATPARAM_RETURN_IF_ERROR(fsdp->LoadStateDict(*sd));
                  FLATPARAM_RETURN_IF_ERROR(
                      fsdp->LoadShardedOptimState(*optim_sd, adamw));
                }
                for (int step = first; step < last; ++step) {
                  FLATPARAM_RETURN_IF_ERROR(
                      BnStep(net, *fsdp, adamw, step, comm.rank()));
                }
                FLATPARAM_ASSIGN_OR_RETURN(*out_sd, fsdp->StateDict());
                FLATPARAM_ASSIGN_OR_RETURN(*out_optim,
                                           fsdp->ShardedOptimState(adamw));
                return absl::OkStatus();
              };
              torch::OrderedDict<std::string, torch::Tensor> straight, half,
                  resumed;
              optim::OptimStateDict o1, o2, o3;
              FLATPARAM_RETURN_IF_ERROR(
                  train(0, 4, nullptr, nullptr, &straight, &o1));
              FLATPARAM_RETURN_IF_ERROR(
                  train(0, 2, nullptr, nullptr, &half, &o2));
              FLATPARAM_RETURN_IF_ERROR(train(2, 4, &half, &o2, &resumed, &o3));
              if (!straight.contains("h.0.bn.running_mean") ||
                  !straight.contains("h.1.bn.num_batches_tracked")) {
                return absl::InternalError("buffers missing from StateDict");
              }
              if (straight["h.0.bn.num_batches_tracked"].item<int64_t>() != 4) {
                return absl::InternalError("the batch count is not 4");
              }
              return ExpectSameDict(straight, resumed);
            }),
      IsOk());
}

// The same through SaveCheckpoint and LoadCheckpoint, as a user resumes:
// each rank's running statistics are in its rank file, so 2 steps, a save,
// a load into a fresh module and 2 more equal 4 straight on every rank. A
// load at another world size gives every rank rank 0's saved statistics;
// buffer_dtype does not change what is saved.
TEST(FsdpModuleCheckpointTest, BatchNormResumesBitwiseThroughCheckpoints) {
  const std::string dir = TmpDir("bn_checkpoint");
  using Dict = torch::OrderedDict<std::string, torch::Tensor>;
  // Trains steps [first, last) on `world` ranks, loading `dir` first and
  // saving it after when asked; each rank's StateDict into `out`.
  auto run = [&](int world, int first, int last, bool load, bool save,
                 std::optional<DType> buffer_dtype, std::vector<Dict>* out) {
    out->assign(world, Dict());
    return OnSim(
        world, [&](Communicator& comm, TorchDevice& device) -> absl::Status {
          BnNet net = MakeBnNet();
          FsdpOptions options;
          options.wrap = {"h.*"};
          options.buffer_dtype = buffer_dtype;
          FLATPARAM_ASSIGN_OR_RETURN(
              std::unique_ptr<FsdpModule> fsdp,
              FsdpModule::Wrap(net.ptr(), &comm, &device, options));
          torch::optim::AdamW adamw(fsdp->ShardedParameters(),
                                    torch::optim::AdamWOptions(0.01));
          if (load) {
            // A checkpoint saved before any step has no optimizer state.
            FLATPARAM_RETURN_IF_ERROR(
                fsdp->LoadCheckpoint(checkpoint::PosixFileSystem(), dir,
                                     first > 0 ? &adamw : nullptr));
          }
          for (int step = first; step < last; ++step) {
            FLATPARAM_RETURN_IF_ERROR(
                BnStep(net, *fsdp, adamw, step, comm.rank()));
          }
          if (save) {
            FLATPARAM_RETURN_IF_ERROR(fsdp->SaveCheckpoint(
                checkpoint::PosixFileSystem(), dir, &adamw));
          }
          FLATPARAM_ASSIGN_OR_RETURN((*out)[comm.rank()], fsdp->StateDict());
          return absl::OkStatus();
        });
  };
  std::vector<Dict> straight, half, resumed;
  ASSERT_THAT(run(2, 0, 4, false, false, std::nullopt, &straight), IsOk());
  ASSERT_THAT(run(2, 0, 2, false, true, std::nullopt, &half), IsOk());
  ASSERT_THAT(run(2, 2, 4, true, false, std::nullopt, &resumed), IsOk());
  // The ranks saw different batches: their statistics differ, so a load
  // that gave both the same would fail below.
  ASSERT_FALSE(torch::equal(half[0]["h.0.bn.running_mean"],
                            half[1]["h.0.bn.running_mean"]));
  for (int r = 0; r < 2; ++r) {
    SCOPED_TRACE(r);
    EXPECT_THAT(ExpectSameDict(straight[r], resumed[r]), IsOk());
  }
  // The same as the MPI tests run it.
  EXPECT_THAT(OnSim(2,
                    [&](Communicator& comm, TorchDevice& device) {
                      return BatchNormCheckpointLoop(comm, device,
                                                     TmpDir("bn_loop"));
                    }),
              IsOk());

  // The files hold them as the model does: float32, int64 counts.
  {
    FLATPARAM_ASSERT_OK_AND_ASSIGN(checkpoint::ShardedCheckpointReader reader,
                                   checkpoint::ShardedCheckpointReader::Open(
                                       checkpoint::PosixFileSystem(), dir));
    ASSERT_EQ(reader.spec().buffers.size(), 6u);
    EXPECT_EQ(reader.spec().buffers[2],
              (BufferSpec{"h.0.bn.num_batches_tracked", {}, DType::kInt64}));
  }

  // Three ranks: each starts from rank 0's saved statistics.
  std::vector<Dict> three;
  ASSERT_THAT(run(3, 2, 2, true, false, std::nullopt, &three), IsOk());
  for (int r = 0; r < 3; ++r) {
    for (const char* name : {"h.0.bn.running_mean", "h.1.bn.running_var",
                             "h.1.bn.num_batches_tracked"}) {
      EXPECT_TRUE(torch::equal(three[r][name], half[0][name]))
          << "rank " << r << " " << name;
    }
  }

  // Under buffer_dtype the module holds bf16 buffers; the checkpoint keeps
  // the model's float32 (cast back at save), so it loads into a float32
  // job as the bf16 values widened. (No steps: LibTorch's batch_norm wants
  // the parameters' dtype, which a bf16 run would set with param_dtype.)
  std::vector<Dict> bf16;
  ASSERT_THAT(run(2, 0, 0, false, true, DType::kBFloat16, &bf16), IsOk());
  std::vector<Dict> widened;
  ASSERT_THAT(run(2, 0, 0, true, false, std::nullopt, &widened), IsOk());
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(torch::equal(widened[r]["h.0.bn.running_var"],
                             bf16[r]["h.0.bn.running_var"]));
    EXPECT_EQ(widened[r]["h.0.bn.running_var"].scalar_type(), torch::kFloat);
  }
}

// A trainer's periodic saves (checkpoint/training_checkpoints.h) of
// CheckpointState: every 2 steps in the background into step{step}, a
// crash after step 5 with step 4's save still unpublished, then a restart
// that resumes from the newest complete checkpoint (step 2, from "extra")
// and trains to step 5: bitwise the 5 steps straight, on every rank.
TEST(FsdpModuleCheckpointTest, PeriodicAsyncSavesResumeFromTheLatest) {
  const std::string root = TmpDir("periodic");
  const std::string pattern = root + "/step{step}";
  std::filesystem::create_directories(root);
  using Dict = torch::OrderedDict<std::string, torch::Tensor>;
  auto run = [&](bool save, bool resume, std::vector<Dict>* out,
                 std::vector<int64_t>* resumed_at) {
    out->assign(2, Dict());
    resumed_at->assign(2, -1);
    return OnSim(
        2, [&](Communicator& comm, TorchDevice& device) -> absl::Status {
          checkpoint::FileSystem& fs = checkpoint::PosixFileSystem();
          BnNet net = MakeBnNet();
          FsdpOptions options;
          options.wrap = {"h.*"};
          FLATPARAM_ASSIGN_OR_RETURN(
              std::unique_ptr<FsdpModule> fsdp,
              FsdpModule::Wrap(net.ptr(), &comm, &device, options));
          torch::optim::AdamW adamw(fsdp->ShardedParameters(),
                                    torch::optim::AdamWOptions(0.01));
          int64_t first = 0;
          if (resume) {
            FLATPARAM_ASSIGN_OR_RETURN(
                checkpoint::LatestCheckpoint latest,
                checkpoint::FindLatestCheckpoint(fs, pattern));
            nlohmann::json extra;
            FLATPARAM_RETURN_IF_ERROR(
                fsdp->LoadCheckpoint(fs, latest.dir, &adamw, &extra));
            first = extra.at("step").get<int64_t>();
            (*resumed_at)[comm.rank()] = first;
          }
          {
            checkpoint::StepSaveOptions every2;
            every2.dir = pattern;
            every2.every = 2;
            every2.async = true;
            checkpoint::StepCheckpointSaver saver(fs, comm, every2);
            for (int64_t step = first; step < 5; ++step) {
              FLATPARAM_RETURN_IF_ERROR(BnStep(
                  net, *fsdp, adamw, static_cast<int>(step), comm.rank()));
              if (!save) continue;
              FLATPARAM_RETURN_IF_ERROR(saver.AfterStep(
                  fsdp->layout(), step + 1, /*last=*/false, [&] {
                    return fsdp->CheckpointState(&adamw, {{"step", step + 1}});
                  }));
            }
            // The crash: no Finish, so step 4's save is never published.
          }
          FLATPARAM_ASSIGN_OR_RETURN((*out)[comm.rank()], fsdp->StateDict());
          return absl::OkStatus();
        });
  };
  std::vector<Dict> straight, crashed, resumed;
  std::vector<int64_t> at;
  ASSERT_THAT(run(false, false, &straight, &at), IsOk());
  ASSERT_THAT(run(true, false, &crashed, &at), IsOk());
  EXPECT_TRUE(std::filesystem::exists(root + "/step2/manifest.json"));
  EXPECT_FALSE(std::filesystem::exists(root + "/step4"));
  ASSERT_THAT(run(false, true, &resumed, &at), IsOk());
  EXPECT_THAT(at, ::testing::ElementsAre(2, 2));
  for (int r = 0; r < 2; ++r) {
    SCOPED_TRACE(r);
    EXPECT_THAT(ExpectSameDict(straight[r], resumed[r]), IsOk());
  }
}

// sync_module_states broadcasts buffers too; buffer_dtype casts them and
// StateDict gives them back in their dtype.
TEST(FsdpModuleStateDictTest, BuffersAreSyncedAndCast) {
  EXPECT_THAT(
      OnSim(
          2,
          [](Communicator& comm, TorchDevice& device) -> absl::Status {
            BnNet net = MakeBnNet();
            net->h[0]->as<BnBlockImpl>()->bn->running_mean.fill_(1.0 +
                                                                 comm.rank());
            FsdpOptions options;
            options.wrap = {"h.*"};
            options.sync_module_states = true;
            options.buffer_dtype = DType::kBFloat16;
            FLATPARAM_ASSIGN_OR_RETURN(
                std::unique_ptr<FsdpModule> fsdp,
                FsdpModule::Wrap(net.ptr(), &comm, &device, options));
            if (net->h[0]->as<BnBlockImpl>()->bn->running_mean.scalar_type() !=
                torch::kBFloat16) {
              return absl::InternalError("buffer_dtype not applied");
            }
            FLATPARAM_ASSIGN_OR_RETURN(auto sd, fsdp->StateDict());
            const torch::Tensor& mean = sd["h.0.bn.running_mean"];
            if (mean.scalar_type() != torch::kFloat ||
                !torch::equal(mean, torch::ones({6}))) {
              return absl::InternalError(
                  "rank 0's running mean did not reach every rank");
            }
            return absl::OkStatus();
          }),
      IsOk());
}

// StateDict is Python's state_dict(): its order, tied names both present,
// buffers; rank0_only leaves the other ranks empty; LoadStateDict is
// strict and names what does not fit; the sharded form round-trips.
TEST(FsdpModuleStateDictTest, KeysOrderStrictnessAndShardedForm) {
  EXPECT_THAT(
      OnSim(
          2,
          [](Communicator& comm, TorchDevice& device) -> absl::Status {
            Net net = MakeNet();
            std::vector<std::string> python_order;
            // Python's state_dict() order for this module.
            for (const auto& m : net->named_modules()) {
              const std::string prefix = m.key().empty() ? "" : m.key() + ".";
              for (const auto& p : m.value()->named_parameters(false)) {
                python_order.push_back(prefix + p.key());
              }
            }
            FsdpOptions options;
            options.wrap = {"h.*"};
            FLATPARAM_ASSIGN_OR_RETURN(
                std::unique_ptr<FsdpModule> fsdp,
                FsdpModule::Wrap(net.ptr(), &comm, &device, options));
            FLATPARAM_ASSIGN_OR_RETURN(auto sd, fsdp->StateDict());
            if (sd.keys() != python_order) {
              return absl::InternalError("not state_dict()'s order");
            }
            for (const auto& item : sd) {
              if (!torch::equal(item.value(), InitialParams().at(item.key()))) {
                return absl::InternalError(item.key() + " differs");
              }
            }
            StateDictOptions rank0;
            rank0.rank0_only = true;
            FLATPARAM_ASSIGN_OR_RETURN(auto only, fsdp->StateDict(rank0));
            if ((comm.rank() == 0) != (only.size() == sd.size())) {
              return absl::InternalError("rank0_only");
            }

            // Strict loading names what is missing and unexpected.
            auto broken = sd;
            broken.erase("h.1.fc1.bias");
            broken.insert("h.9.fc1.bias", torch::zeros({3}));
            absl::Status status = fsdp->LoadStateDict(broken);
            if (status.code() != absl::StatusCode::kInvalidArgument ||
                !absl::StrContains(status.message(), "h.1.fc1.bias") ||
                !absl::StrContains(status.message(), "h.9.fc1.bias")) {
              return absl::InternalError(
                  absl::StrCat("strict load: ", status.ToString()));
            }
            auto resized = sd;
            resized["h.0.fc2.bias"] = torch::zeros({7});
            status = fsdp->LoadStateDict(resized);
            if (!absl::StrContains(status.message(), "size mismatch")) {
              return absl::InternalError(
                  absl::StrCat("size: ", status.ToString()));
            }

            // A loaded dict comes back; the sharded form round-trips.
            auto shifted = sd;
            for (auto& item : shifted) item.value() = item.value() + 0.25;
            shifted["lm_head.weight"] = shifted["wte.weight"];
            FLATPARAM_RETURN_IF_ERROR(fsdp->LoadStateDict(shifted));
            FLATPARAM_ASSIGN_OR_RETURN(auto back, fsdp->StateDict());
            FLATPARAM_RETURN_IF_ERROR(ExpectSameDict(back, shifted));
            FLATPARAM_ASSIGN_OR_RETURN(auto sharded, fsdp->ShardedStateDict());
            const int64_t rows = sharded["h.0.fc1.weight"].size(0);
            if (rows != kDim) {  // 12 rows over 2 ranks
              return absl::InternalError("chunk rows");
            }
            FLATPARAM_RETURN_IF_ERROR(fsdp->LoadStateDict(sd));
            FLATPARAM_RETURN_IF_ERROR(fsdp->LoadShardedStateDict(sharded));
            FLATPARAM_ASSIGN_OR_RETURN(back, fsdp->StateDict());
            return ExpectSameDict(back, shifted);
          }),
      IsOk());
}

// SummonFullParams: the module's parameters hold their full values in the
// scope (weight surgery with writeback), and the module refuses a forward
// meanwhile.
TEST(FsdpModuleStateDictTest, SummonFullParamsScope) {
  EXPECT_THAT(
      OnSim(2,
            [](Communicator& comm, TorchDevice& device) -> absl::Status {
              Net net = MakeNet();
              FsdpOptions options;
              options.wrap = {"h.*"};
              FLATPARAM_ASSIGN_OR_RETURN(
                  std::unique_ptr<FsdpModule> fsdp,
                  FsdpModule::Wrap(net.ptr(), &comm, &device, options));
              SummonOptions summon;
              summon.writeback = true;
              {
                FLATPARAM_ASSIGN_OR_RETURN(auto scope,
                                           fsdp->SummonFullParams(summon));
                auto* block = net->h[1]->as<BlockImpl>();
                if (!torch::equal(block->fc1->weight,
                                  InitialParams().at("h.1.fc1.weight"))) {
                  return absl::InternalError("not the full parameter");
                }
                torch::NoGradGuard no_grad;
                block->fc1->weight.mul_(2);
                if (ForwardNet(net, *fsdp, Tokens(0, 0, 2)).ok()) {
                  return absl::InternalError("a forward while summoned");
                }
                const absl::Status state =
                    fsdp->CheckpointState(nullptr).status();
                if (state.code() != absl::StatusCode::kFailedPrecondition ||
                    !absl::StrContains(state.message(),
                                       "FsdpModule::CheckpointState while "
                                       "SummonFullParams' scope lives")) {
                  return absl::InternalError(absl::StrCat(
                      "CheckpointState while summoned: ", state.ToString()));
                }
                FLATPARAM_RETURN_IF_ERROR(scope->End());
              }
              if (net->h[1]->as<BlockImpl>()->fc1->weight.numel() != 0) {
                return absl::InternalError("parameters full after the scope");
              }
              FLATPARAM_ASSIGN_OR_RETURN(auto sd, fsdp->StateDict());
              if (!torch::equal(sd["h.1.fc1.weight"],
                                InitialParams().at("h.1.fc1.weight") * 2)) {
                return absl::InternalError("writeback lost");
              }
              return ForwardNet(net, *fsdp, Tokens(0, 0, 2)).status();
            }),
      IsOk());
}

// A learning-rate schedule resumes where it stopped: LoadCheckpoint with
// restore_hyperparameters gives each group its saved options back, so 2
// steps, a save, a load into a fresh optimizer (at the initial learning
// rate) and 2 more equal 4 straight; without it they differ.
TEST(FsdpModuleOptimizerTest, RestoresSavedHyperparameters) {
  for (bool orig : {false, true}) {
    SCOPED_TRACE(orig);
    const std::string dir = TmpDir(absl::StrCat("hyper_", orig));
    auto run = [&](int first, int last, bool save, bool load, bool restore,
                   std::map<std::string, torch::Tensor>* out) {
      return OnSim(
          2, [&](Communicator& comm, TorchDevice& device) -> absl::Status {
            Net net = MakeNet();
            FsdpOptions options;
            options.wrap = {"h.*"};
            options.use_orig_params = orig;
            FLATPARAM_ASSIGN_OR_RETURN(
                std::unique_ptr<FsdpModule> fsdp,
                FsdpModule::Wrap(net.ptr(), &comm, &device, options));
            torch::optim::AdamW adamw(fsdp->ShardedParameters(),
                                      torch::optim::AdamWOptions(0.02));
            if (load) {
              FLATPARAM_RETURN_IF_ERROR(
                  fsdp->LoadCheckpoint(checkpoint::PosixFileSystem(), dir,
                                       &adamw, nullptr, restore));
            }
            for (int step = first; step < last; ++step) {
              torch::Tensor tokens = Tokens(step, comm.rank() * 2, 2);
              FLATPARAM_ASSIGN_OR_RETURN(torch::Tensor logits,
                                         ForwardNet(net, *fsdp, tokens));
              FLATPARAM_RETURN_IF_ERROR(fsdp->Backward(Loss(logits, tokens)));
              adamw.step();
              FLATPARAM_RETURN_IF_ERROR(fsdp->ZeroGrad());
              // The schedule: the learning rate halves after every step.
              for (auto& group : adamw.param_groups()) {
                auto& o =
                    static_cast<torch::optim::AdamWOptions&>(group.options());
                o.lr(o.lr() / 2);
              }
            }
            if (save) {
              FLATPARAM_RETURN_IF_ERROR(fsdp->SaveCheckpoint(
                  checkpoint::PosixFileSystem(), dir, &adamw));
            }
            FLATPARAM_ASSIGN_OR_RETURN(auto params, fsdp->FullStateDict());
            if (comm.rank() == 0) *out = std::move(params);
            return absl::OkStatus();
          });
    };
    std::map<std::string, torch::Tensor> straight, unused, restored, reset;
    ASSERT_THAT(run(0, 4, false, false, false, &straight), IsOk());
    ASSERT_THAT(run(0, 2, true, false, false, &unused), IsOk());
    ASSERT_THAT(run(2, 4, false, true, true, &restored), IsOk());
    ASSERT_THAT(run(2, 4, false, true, false, &reset), IsOk());
    bool reset_differs = false;
    for (const auto& [name, t] : straight) {
      EXPECT_TRUE(torch::equal(t, restored.at(name))) << name;
      reset_differs = reset_differs || !torch::equal(t, reset.at(name));
    }
    EXPECT_TRUE(reset_differs);
  }
}

// Deferred initialisation: a module built with uninitialised storage (here
// NaNs, so that a value not initialised shows), param_init_fn giving each
// submodule its values as Wrap makes its unit, never more than one unit's
// initialised full parameters held at a time; training from it is bitwise
// training from the eagerly initialised module. Or rank 0 alone
// initialises, and the others receive its values with sync_module_states.
TEST(FsdpModuleDeferredInitTest, UnitByUnitInitialisation) {
  for (bool rank0_init : {false, true}) {
    SCOPED_TRACE(rank0_init);
    EXPECT_THAT(
        OnSim(
            2,
            [&](Communicator& comm, TorchDevice& device) -> absl::Status {
              Net net = MakeNet();
              if (!rank0_init || comm.rank() != 0) {
                torch::NoGradGuard no_grad;
                for (auto& p : net->parameters()) p.fill_(NAN);
              }
              std::set<const c10::TensorImpl*> initialised;
              int64_t most = 0;
              FsdpOptions options;
              options.wrap = {"h.*"};
              options.sync_module_states = rank0_init;
              if (!rank0_init) {
                options.param_init_fn = [&](torch::nn::Module& m) {
                  std::string prefix;
                  for (const auto& item : net->named_modules()) {
                    if (item.value().get() == &m) prefix = item.key();
                  }
                  torch::NoGradGuard no_grad;
                  for (auto& p : m.named_parameters(/*recurse=*/false)) {
                    p.value().copy_(InitialParams().at(
                        prefix.empty() ? p.key() : prefix + "." + p.key()));
                    initialised.insert(p.value().unsafeGetTensorImpl());
                  }
                  // Initialised full values held now (this unit's).
                  int64_t held = 0;
                  for (const auto& p : net->parameters()) {
                    if (initialised.count(p.unsafeGetTensorImpl()) > 0) {
                      held += p.nbytes();
                    }
                  }
                  most = std::max(most, held);
                };
              }
              FLATPARAM_ASSIGN_OR_RETURN(
                  std::unique_ptr<FsdpModule> fsdp,
                  FsdpModule::Wrap(net.ptr(), &comm, &device, options));
              int64_t unit_bytes = 0;
              for (const FlatParamLayout& fp : fsdp->layout().flat_params()) {
                unit_bytes = std::max(unit_bytes, fp.param_numel() * 4);
              }
              if (most > unit_bytes) {
                return absl::InternalError(
                    absl::StrCat("held ", most,
                                 " bytes of initialised full parameters; "
                                 "the largest unit has ",
                                 unit_bytes));
              }
              Net reference = MakeNet();
              auto ref_opt = MakeOptimizer(
                  Optim::kAdamW, refmodel::TrainableTensors(*reference));
              refmodel::FoldOptions fold;
              fold.world = 2;
              fold.steps = 2;
              refmodel::TrainFolded(
                  *reference, *ref_opt, fold, [&](int step, int, int r) {
                    torch::Tensor tokens = Tokens(step, r * 2, 2);
                    torch::Tensor x = reference->wte(tokens.narrow(1, 0, kSeq));
                    for (size_t i = 0; i < reference->h->size(); ++i) {
                      x = reference->h[i]->as<BlockImpl>()->forward(x);
                    }
                    return Loss(reference->Head(x), tokens);
                  });
              auto adamw =
                  MakeOptimizer(Optim::kAdamW, fsdp->ShardedParameters());
              for (int step = 0; step < 2; ++step) {
                torch::Tensor tokens = Tokens(step, comm.rank() * 2, 2);
                FLATPARAM_ASSIGN_OR_RETURN(torch::Tensor logits,
                                           ForwardNet(net, *fsdp, tokens));
                FLATPARAM_RETURN_IF_ERROR(fsdp->Backward(Loss(logits, tokens)));
                adamw->step();
                FLATPARAM_RETURN_IF_ERROR(fsdp->ZeroGrad());
              }
              FLATPARAM_ASSIGN_OR_RETURN(auto got, fsdp->FullStateDict());
              for (const auto& p : reference->named_parameters()) {
                auto it = got.find(p.key());
                if (it != got.end() && !torch::equal(it->second, p.value())) {
                  return absl::InternalError(p.key() + " differs");
                }
              }
              return absl::OkStatus();
            }),
        IsOk());
  }
}

// Meta parameters are refused (LibTorch cannot move them to the CPU in
// place), saying what to do; so is an initialisation that changes a
// parameter's dtype.
TEST(FsdpModuleDeferredInitTest, WhatCannotBeInitialisedIsRefused) {
  OnOneRank([](Communicator& comm, TorchDevice& device) {
    auto meta = std::make_shared<torch::nn::Module>();
    meta->register_parameter("w", torch::empty({3}, torch::kMeta));
    absl::Status status = FsdpModule::Wrap(meta, &comm, &device).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(absl::StrContains(status.message(), "param_init_fn")) << status;

    Net net = MakeNet();
    FsdpOptions options;
    options.wrap = {"h.*"};
    options.param_init_fn = [](torch::nn::Module& m) {
      torch::NoGradGuard no_grad;
      for (auto& p : m.named_parameters(/*recurse=*/false)) {
        p.value().set_data(p.value().to(torch::kDouble));
      }
    };
    status = FsdpModule::Wrap(net.ptr(), &comm, &device, options).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(absl::StrContains(status.message(), "in param_init_fn"))
        << status;
  });
}

// A std::exception from the caller's forward is a Status, and the module
// works on; a tensor that leaves a unit without being returned fails the
// backward with a message that names the unit and what to do.
TEST(FsdpModuleMisuseTest, ExceptionsAndUnreturnedTensors) {
  OnOneRank([](Communicator& comm, TorchDevice& device) {
    Net net = MakeNet();
    absl::StatusOr<std::unique_ptr<FsdpModule>> fsdp =
        WrapBlocks(net, comm, device);
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
  OnOneRank([](Communicator& comm, TorchDevice& device) {
    Net net = MakeNet();
    absl::StatusOr<std::unique_ptr<FsdpModule>> fsdp =
        WrapBlocks(net, comm, device);
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
