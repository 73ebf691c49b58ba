// Runs README.md's C++ snippets (compiled from the README by
// //readme:readme_snippets) on a small model: the training loop of
// "fsdp train" (Train) on 2 simulated ranks with the stubs it leaves to the
// reader filled in here, and the checkpoint load of "Hugging Face
// checkpoints in and out" (LoadMyShards) from a checkpoint saved at
// another world size.
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/base/status_matchers.h"
#include "flatparam/checkpoint/convert.h"
#include "flatparam/checkpoint/file_system.h"
#include "flatparam/checkpoint/training_state.h"
#include "flatparam/device/device.h"
#include "flatparam/model_layout.h"
#include "flatparam/runtime.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "sim/sim.h"

using namespace flatparam;  // as the snippets have it

// The README's functions (readme/snippet_*.cc).
absl::Status Train(const ModelLayout& layout,
                   const std::map<std::string, ConstBufferRef>& params_by_fqn,
                   Communicator& world, DeviceOps& device, int steps);
absl::StatusOr<checkpoint::RankState> LoadMyShards(checkpoint::FileSystem& fs,
                                                   const std::string& dir,
                                                   const ModelLayout& layout,
                                                   int64_t world_size,
                                                   int64_t rank);

namespace {

constexpr float kLr = 0.25f;

// What the stubs saw, per rank (each rank is a thread of the simulator).
struct RankLog {
  int forwards = 0;
  int backwards = 0;
  int optimizer_steps = 0;
  int64_t grad_elements = 0;  // equal to the expected clipped gradient
  int64_t other_grads = 0;    // neither that nor padding's 0
};
std::vector<RankLog> rank_logs;
thread_local int current_rank = 0;
// Every element's gradient, averaged over the ranks and clipped to a total
// norm of 1: 1 / sqrt(number of elements).
float expected_grad = 0;

ModelSpec SmallModel() {
  ModelSpec spec;
  spec.name = "readme";
  spec.params = {{"emb.weight", {11, 3}},
                 {"layers.0.fc.weight", {3, 3}},
                 {"layers.0.fc.bias", {3}},
                 {"layers.1.fc.weight", {3, 3}},
                 {"head.weight", {3, 11}}};
  spec.wrap = {"layers.0", "layers.1"};
  return spec;
}

const FlatParamLayout& UnitLayout(FsdpRuntime& rt, int u) {
  return rt.layout().flat_params()[u];
}

}  // namespace

// The stubs the README leaves to the reader: the forward reads every
// parameter of the unit, the backward adds a gradient of ones to each, the
// optimizer is SGD on the shard.
absl::Status MyForward(FsdpRuntime& rt, int u) {
  for (const ParamInfo& p : UnitLayout(rt, u).params()) {
    FLATPARAM_ASSIGN_OR_RETURN(OrigParamView view, rt.Param(p.fqn));
    if (view.sharded || view.data.count != p.numel) {
      return absl::InternalError(absl::StrCat(p.fqn, " is not unsharded"));
    }
  }
  ++rank_logs[current_rank].forwards;
  return absl::OkStatus();
}

absl::Status MyBackward(FsdpRuntime& rt, int u) {
  for (const ParamInfo& p : UnitLayout(rt, u).params()) {
    std::vector<float> ones(p.numel, 1.0f);
    FLATPARAM_RETURN_IF_ERROR(rt.AccumulateGrad(
        p.fqn, ConstBufferRef{ones.data(), p.numel, DType::kFloat32}));
  }
  ++rank_logs[current_rank].backwards;
  return absl::OkStatus();
}

absl::Status MyOptimizerStep(int u, BufferRef param, BufferRef grad) {
  if (param.dtype != DType::kFloat32 || param.count != grad.count) {
    return absl::InternalError(absl::StrCat("unit ", u, ": bad shard"));
  }
  float* p = static_cast<float*>(param.data);
  const float* g = static_cast<const float*>(grad.data);
  RankLog& log = rank_logs[current_rank];
  for (int64_t i = 0; i < param.count; ++i) {
    if (std::abs(g[i] - expected_grad) < 1e-6f) {
      ++log.grad_elements;
    } else if (g[i] != 0) {
      ++log.other_grads;
    }
    p[i] -= kLr * g[i];
  }
  ++log.optimizer_steps;
  return absl::OkStatus();
}

namespace {

TEST(ReadmeSnippetsTest, TrainRunsOnTwoSimulatedRanks) {
  constexpr int kWorld = 2;
  constexpr int kSteps = 3;
  LayoutOptions options;
  options.world_size = kWorld;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(ModelLayout layout,
                                 ModelLayout::Create(SmallModel(), options));
  ASSERT_EQ(layout.flat_params().size(), 3u);
  std::map<std::string, std::vector<float>> values;
  std::map<std::string, ConstBufferRef> params_by_fqn;
  int64_t numel = 0;
  for (const ParamSpec& p : layout.spec().params) {
    std::vector<float>& v = values[p.fqn];
    v.assign(NumElements(p.shape), 0.5f);
    params_by_fqn[p.fqn] = ConstBufferRef{
        v.data(), static_cast<int64_t>(v.size()), DType::kFloat32};
    numel += NumElements(p.shape);
  }
  expected_grad = static_cast<float>(1 / std::sqrt(static_cast<double>(numel)));
  rank_logs.assign(kWorld, RankLog{});
  SimOptions sim_options;
  sim_options.world_size = kWorld;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(std::unique_ptr<SimWorld> world,
                                 SimWorld::Create(sim_options));
  FLATPARAM_ASSERT_OK(world->Run([&](SimCommunicator& comm) -> absl::Status {
    HostDeviceOps device;
    current_rank = comm.rank();  // this rank's thread
    return Train(layout, params_by_fqn, comm, device, kSteps);
  }));
  int64_t grad_elements = 0;
  for (int r = 0; r < kWorld; ++r) {
    SCOPED_TRACE(absl::StrCat("rank ", r));
    // Every unit's forward and backward each step; the optimizer on every
    // unit whose shard holds elements (all of them here), with each
    // element's gradient reduced and clipped.
    EXPECT_EQ(rank_logs[r].forwards, 3 * kSteps);
    EXPECT_EQ(rank_logs[r].backwards, 3 * kSteps);
    EXPECT_EQ(rank_logs[r].optimizer_steps, 3 * kSteps);
    EXPECT_EQ(rank_logs[r].other_grads, 0);
    grad_elements += rank_logs[r].grad_elements;
  }
  EXPECT_EQ(grad_elements, numel * kSteps);  // each element in one shard
}

TEST(ReadmeSnippetsTest, LoadMyShardsReshardsAtLoadTime) {
  checkpoint::FileSystem& fs = checkpoint::PosixFileSystem();
  const char* tmp = std::getenv("TEST_TMPDIR");
  ASSERT_NE(tmp, nullptr);
  const std::string full = absl::StrCat(tmp, "/readme-full");
  const std::string sharded = absl::StrCat(tmp, "/readme-w4");
  FLATPARAM_ASSERT_OK(checkpoint::InitCheckpoint(fs, SmallModel(), full));
  LayoutOptions saved;
  saved.world_size = 4;
  FLATPARAM_ASSERT_OK(checkpoint::ShardCheckpoint(fs, full, SmallModel(), saved,
                                                  /*world_size=*/0, sharded));
  // A job of 4 ranks in HYBRID_SHARD shard groups of 2 loads it.
  LayoutOptions job;
  job.world_size = 2;
  job.strategy = ShardingStrategy::kHybridShard;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(ModelLayout layout,
                                 ModelLayout::Create(SmallModel(), job));
  for (int64_t rank = 0; rank < 4; ++rank) {
    SCOPED_TRACE(absl::StrCat("rank ", rank));
    FLATPARAM_ASSERT_OK_AND_ASSIGN(
        checkpoint::RankState state,
        LoadMyShards(fs, sharded, layout, /*world_size=*/4, rank));
    ASSERT_EQ(state.flat_params.size(), layout.flat_params().size());
    for (size_t i = 0; i < state.flat_params.size(); ++i) {
      EXPECT_EQ(state.flat_params[i].numel(),
                layout.flat_params()[i].sharded_numel());
    }
  }
}

}  // namespace
