// Sharded training across processes equals single-process training, bit
// for bit: the MPI and c10d backends fold reductions on the host in rank
// order, as the simulator does (comm/host_reduce.h), so the property proven
// on the simulator (training_equivalence_test.cc) holds across processes
// too.
//
// A multi-process test, one binary per backend from this file (the main()
// comes from the backend's MultirankGtestMain, testing/multirank_test_main.h):
// training_mpi_test runs it under mpirun with 4 ranks, training_c10d_test_2
// and _4 as torchrun's workers (comm/c10d/envrun_test.sh); any size >= 1
// works. Every rank trains its shard with TrainFsdpOnRank on the world and
// compares the gathered results with TrainReference computed on that rank.
// The cases are a fixed table (every strategy, alignment, offload,
// micro-batches in both modes, bf16 and fp16 mixed precision), so every
// rank runs the same collectives. Rank 0 prints gtest's output, the others
// only their failures, prefixed with "[rank N]".
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "comm/communicator.h"
#include "flatparam/device/device.h"
#include "flatparam/layout.h"
#include "flatparam/memory_stats.h"
#include "refmodel/fsdp_trainer.h"
#include "refmodel/reference_trainer.h"
#include "testing/multirank_test_main.h"
#include "verify/training_testutil.h"

namespace flatparam {
namespace verify {
namespace {

Communicator* g_world = nullptr;  // Set up by main().

struct Case {
  std::string name;
  refmodel::FsdpTrainOptions options;
};

std::vector<Case> Cases(int world) {
  std::vector<Case> cases;
  auto add = [&](std::string name, ShardingStrategy strategy, auto tweak) {
    Case c;
    c.name = std::move(name);
    c.options.strategy = strategy;
    c.options.steps = 3;
    c.options.global_batch = 2 * world;
    c.options.micro_batches = 2;
    c.options.optimizer = refmodel::AdamWOptions{1e-2};
    c.options.data_seed = 3;
    c.options.model.seed = 17;
    tweak(c.options);
    cases.push_back(std::move(c));
  };
  const int half = world % 2 == 0 ? world / 2 : world;
  auto none = [](refmodel::FsdpTrainOptions&) {};
  add("full_shard", ShardingStrategy::kFullShard, none);
  add("full_shard_aligned_nan_padding", ShardingStrategy::kFullShard,
      [](refmodel::FsdpTrainOptions& o) {
        o.align_addresses = true;
        o.padding_fill = std::numeric_limits<float>::quiet_NaN();
      });
  add("shard_grad_op_no_sync", ShardingStrategy::kShardGradOp,
      [](refmodel::FsdpTrainOptions& o) {
        o.accumulation = refmodel::AccumulationMode::kNoSync;
        o.micro_batches = 3;
      });
  add("no_shard_offload_sgd", ShardingStrategy::kNoShard,
      [](refmodel::FsdpTrainOptions& o) {
        o.cpu_offload = true;
        o.optimizer = refmodel::SgdOptions{0.1, 0.9};
      });
  add("hybrid_shard", ShardingStrategy::kHybridShard,
      [half](refmodel::FsdpTrainOptions& o) { o.shard_group_size = half; });
  add("hybrid_shard_zero2_aligned_offload", ShardingStrategy::kHybridShardZero2,
      [half](refmodel::FsdpTrainOptions& o) {
        o.shard_group_size = half;
        o.align_addresses = true;
        o.cpu_offload = true;
      });
  add("full_shard_bf16", ShardingStrategy::kFullShard,
      [](refmodel::FsdpTrainOptions& o) {
        o.param_dtype = DType::kBFloat16;
        o.align_addresses = true;
      });
  add("shard_grad_op_fp16_reduce_fp32", ShardingStrategy::kShardGradOp,
      [](refmodel::FsdpTrainOptions& o) {
        o.param_dtype = DType::kFloat16;
        o.reduce_dtype = DType::kFloat32;
      });
  return cases;
}

class TrainingMultiprocessTest : public ::testing::TestWithParam<int> {};

TEST_P(TrainingMultiprocessTest, EqualsTheReferenceBitwise) {
  const Case c = Cases(g_world->size())[GetParam()];
  SCOPED_TRACE(c.name);
  HostDeviceOps device;
  absl::StatusOr<refmodel::FsdpRankResult> got =
      refmodel::TrainFsdpOnRank(*g_world, device, c.options);
  ASSERT_TRUE(got.ok()) << got.status();
  absl::StatusOr<refmodel::TrainOptions> ref_options =
      refmodel::ReferenceOptionsFor(c.options, g_world->size());
  ASSERT_TRUE(ref_options.ok()) << ref_options.status();
  absl::StatusOr<refmodel::TrainResult> want =
      refmodel::TrainReference(c.options.model, *ref_options);
  ASSERT_TRUE(want.ok()) << want.status();

  std::string why;
  EXPECT_EQ(got->losses, want->losses);
  EXPECT_TRUE(SameTensors(got->params, want->params, &why)) << why;
  EXPECT_TRUE(SameStates(got->optimizer_state, want->optimizer_state, &why))
      << why;
  EXPECT_EQ(got->nonzero_padding_grads, 0);
  absl::StatusOr<std::array<int64_t, kNumMemoryCategories>> memory =
      refmodel::ExpectedPeakMemory(c.options, g_world->size());
  ASSERT_TRUE(memory.ok()) << memory.status();
  for (int k = 0; k < kNumMemoryCategories; ++k) {
    EXPECT_EQ(got->memory.peak[k], (*memory)[k])
        << MemoryCategoryName(MemoryCategory(k));
  }
  EXPECT_GT(got->comm.total_bytes(), 0);
}

INSTANTIATE_TEST_SUITE_P(Cases, TrainingMultiprocessTest,
                         ::testing::Range(0, 8),
                         [](const ::testing::TestParamInfo<int>& info) {
                           // The names do not depend on the world size.
                           return Cases(2)[info.param].name;
                         });

}  // namespace
}  // namespace verify
}  // namespace flatparam

int main(int argc, char** argv) {
  return flatparam::MultirankGtestMain(&argc, argv,
                                       &flatparam::verify::g_world);
}
