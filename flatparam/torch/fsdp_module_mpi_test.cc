// FsdpModule over MPI equals single-process LibTorch training, bit for bit:
// the MPI backend folds reductions on the host in rank order, as the
// simulator does, so fsdp_module_test's property holds across processes.
//
// A multi-process test: run under mpirun (fsdp_module_mpi_test_2 and _4
// launch it through comm/mpi/mpirun_test.sh with 2 and 4 ranks). Every rank
// trains under FsdpModule and compares the full state dict with
// TrainReference computed on that rank. main() combines every rank's
// verdict; rank 0 prints gtest's output, the others only their failures.
#include <gtest/gtest.h>
#include <mpi.h>
#include <torch/torch.h>

#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "comm/mpi/mpi_communicator.h"
#include "comm/mpi/mpi_gtest.h"
#include "flatparam/device/device.h"
#include "flatparam/torch/torch_testutil.h"

namespace flatparam {
namespace libtorch {
namespace {

using namespace ::flatparam::libtorch::testing;  // NOLINT

MpiCommunicator* g_world = nullptr;  // Set up by main().

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

TEST(FsdpModuleMpiTest, BitwiseEqualToSingleProcessTraining) {
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

}  // namespace
}  // namespace libtorch
}  // namespace flatparam

int main(int argc, char** argv) {
  // One intra-op thread: LibTorch's kernels then reduce in one order.
  torch::set_num_threads(1);
  return flatparam::MpiGtestMain(&argc, argv, &flatparam::libtorch::g_world);
}
