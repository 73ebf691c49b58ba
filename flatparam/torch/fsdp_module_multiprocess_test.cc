// FsdpModule across processes equals single-process LibTorch training, bit
// for bit: the MPI and c10d backends fold reductions on the host in rank
// order, as the simulator does, so fsdp_module_test's property holds across
// processes.
//
// A multi-process test, one binary per backend from this file (main() is
// the backend's MultirankGtestMain): fsdp_module_mpi_test_2 and _4 run it
// under mpirun, fsdp_module_c10d_test_2 and _4 as torchrun's workers. Every
// rank trains under FsdpModule and compares the full state dict with
// TrainReference computed on that rank. Rank 0 prints gtest's output, the
// others only their failures.
#include <gtest/gtest.h>
#include <torch/autograd.h>
#include <torch/types.h>
#include <torch/utils.h>

#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "comm/communicator.h"
#include "flatparam/device/device.h"
#include "testing/multirank_test_main.h"
#include "testing/torch_loops_testutil.h"
#include "testing/torch_testutil.h"

namespace flatparam {
namespace libtorch {
namespace {

using namespace ::flatparam::libtorch::testing;  // NOLINT

Communicator* g_world = nullptr;  // Set up by main().

std::vector<Case> Cases(int world) {
  std::vector<Case> cases = {
      {world, ShardingStrategy::kFullShard, 0, Optim::kAdamW},
      {world, ShardingStrategy::kShardGradOp, 0, Optim::kSgd},
      {world, ShardingStrategy::kNoShard, 0, Optim::kAdamW},
      {world, ShardingStrategy::kFullShard, 0, Optim::kSgd, 2, 2 * world,
       "h.1.", 2, true},
      {world, ShardingStrategy::kFullShard, 0, Optim::kAdamW, 2, 2 * world, "",
       1, false, Recomputation::kInsideUnit},
      {world, ShardingStrategy::kShardGradOp, 0, Optim::kSgd, 2, 2 * world, "",
       1, false, Recomputation::kAroundUnit},
  };
  if (world % 2 == 0 && world > 2) {
    cases.push_back({world, ShardingStrategy::kHybridShard, 2, Optim::kAdamW});
  }
  for (Case& c : cases) c.global_batch = 2 * world;
  return cases;
}

TEST(FsdpModuleMultiprocessTest, BitwiseEqualToSingleProcessTraining) {
  ASSERT_NE(g_world, nullptr);
  for (const Case& c : Cases(g_world->size())) {
    SCOPED_TRACE(Name(c));
    HostDeviceOps device;
    absl::StatusOr<FsdpResult> got = TrainFsdpOnRank(*g_world, device, c);
    ASSERT_TRUE(got.ok()) << got.status();
    std::map<std::string, torch::Tensor> expected = TrainReference(c);
    EXPECT_EQ(got->state.size() + 1, expected.size());
    for (const auto& [name, tensor] : got->state) {
      ASSERT_TRUE(expected.count(name)) << name;
      EXPECT_TRUE(torch::equal(tensor, expected.at(name))) << name;
    }
  }
}

// The loops users write (torch_loops_testutil.h), across processes.
std::vector<LoopOptions> LoopCases(int world) {
  std::vector<LoopOptions> cases = {
      {ShardingStrategy::kFullShard},
      {ShardingStrategy::kFullShard, 0, Recomputation::kNone, true},
  };
  if (world % 2 == 0 && world > 2) {
    cases.push_back(
        {ShardingStrategy::kHybridShard, 2, Recomputation::kNone, true});
  }
  return cases;
}

TEST(FsdpModuleMultiprocessTest, UserLoopsBitwiseEqualToSingleProcess) {
  ASSERT_NE(g_world, nullptr);
  for (const LoopOptions& o : LoopCases(g_world->size())) {
    SCOPED_TRACE(LoopName(o));
    HostDeviceOps host_ops;
    HostTorchDevice device(&host_ops);
    auto expect_ok = [](const char* loop, const absl::Status& status) {
      EXPECT_TRUE(status.ok()) << loop << ": " << status;
    };
    int64_t peak = 0, bound = 0;
    expect_ok("LoRA", LoraLoop(*g_world, device, o, 5, &peak, &bound));
    expect_ok("autograd::grad", AutogradGradLoop(*g_world, device, o));
    expect_ok("requires_grad", RequiresGradChangeLoop(*g_world, device, o));
    expect_ok("set to None", SetToNoneLoop(*g_world, device, o));
    expect_ok("several outputs", SeveralOutputsLoop(*g_world, device, o));
    expect_ok("inside a step", InsideAStepLoop(*g_world, device, o));
    const char* tmp = std::getenv("TEST_TMPDIR");
    // Every rank names the same directory (the launcher gives them one
    // TEST_TMPDIR).
    absl::Status eval = EvaluateThenSaveLoop(
        *g_world, device, o,
        absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/mpi_eval_", LoopName(o)));
    EXPECT_TRUE(eval.ok()) << eval;
    absl::Status groups =
        ParamGroupsLoop(*g_world, device, o,
                        absl::StrCat(tmp != nullptr ? tmp : "/tmp",
                                     "/mpi_groups_", LoopName(o)));
    EXPECT_TRUE(groups.ok()) << groups;
    absl::Status bn = BatchNormCheckpointLoop(
        *g_world, device,
        absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/mpi_bn_", LoopName(o)));
    EXPECT_TRUE(bn.ok()) << bn;
    for (Recomputation r : {Recomputation::kNone, Recomputation::kInsideUnit,
                            Recomputation::kAroundUnit}) {
      LoopOptions shared = o;
      shared.recompute = r;
      absl::Status status = SharedWeightLoop(*g_world, device, shared, 2);
      EXPECT_TRUE(status.ok()) << RecomputationName(r) << ": " << status;
    }
  }
}

}  // namespace
}  // namespace libtorch
}  // namespace flatparam

int main(int argc, char** argv) {
  // One intra-op thread: LibTorch's kernels then reduce in one order.
  torch::set_num_threads(1);
  return flatparam::MultirankGtestMain(&argc, argv,
                                       &flatparam::libtorch::g_world);
}
