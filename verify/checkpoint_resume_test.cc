// Train, save, reshard, load, train: the same as single-process training.
//
// For each case of a table (strategies and world sizes on both sides,
// alignment, SGD with momentum and AdamW, micro-batches): train K steps on W
// simulated ranks; every rank saves its own ungathered state into a sharded
// checkpoint written collectively (collective_checkpoint.h, training_state.h);
// ReshardCheckpoint (convert.h) turns it into the checkpoint of another
// world size W2 and strategy; every rank of W2 loads its own shard-group
// rank's files and trains K more steps (first_step = K). The same again
// with the reshard at load time (LoadRankState straight from the saved
// checkpoint): the loaded states are equal, bit for bit, and so is the
// training. The result
// (per-step losses of the second segment, gathered parameters and optimizer
// state, on every rank) is bitwise equal to single-process float32 training
// of 2K steps: TrainReference for K steps with the first run's gradient
// fold, then K steps with the second run's, chained (each segment folds the
// ranks' gradients as its own world size and strategy do, so the fold is
// per segment).
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <tuple>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/base/status_matchers.h"
#include "flatparam/checkpoint/checkpoint_dir.h"
#include "flatparam/checkpoint/collective_checkpoint.h"
#include "flatparam/checkpoint/convert.h"
#include "flatparam/checkpoint/file_system.h"
#include "flatparam/checkpoint/training_state.h"
#include "refmodel/fsdp_trainer.h"
#include "refmodel/reference_trainer.h"
#include "refmodel/train_state.h"
#include "sim/sim.h"
#include "verify/training_testutil.h"

namespace flatparam {
namespace verify {
namespace {

using refmodel::FsdpRankResult;
using refmodel::FsdpTrainOptions;
using refmodel::TrainOptions;
using refmodel::TrainResult;

struct Side {
  ShardingStrategy strategy;
  int world_size;
  int shard_group_size;  // hybrid only
  bool align_addresses;
};

struct Case {
  std::string name;
  Side before;
  Side after;
  bool adamw;
  int64_t micro_batches;
};

FsdpTrainOptions OptionsFor(const Case& c, const Side& side) {
  FsdpTrainOptions o;
  o.model.seed = 3;
  o.data_seed = 5;
  o.strategy = side.strategy;
  o.shard_group_size = side.shard_group_size;
  o.align_addresses = side.align_addresses;
  o.steps = 2;
  o.global_batch = 24;  // divisible by every world size below
  o.micro_batches = c.micro_batches;
  if (c.adamw) {
    refmodel::AdamWOptions adamw;
    adamw.lr = 1e-2;
    o.optimizer = adamw;
  } else {
    o.optimizer = refmodel::SgdOptions{0.05, 0.9};
  }
  return o;
}

// Trains on a simulated world, rank r with options_of(r); then every rank
// saves its state to `dir` collectively.
absl::StatusOr<std::vector<FsdpRankResult>> TrainAndSave(
    const std::function<FsdpTrainOptions(int)>& options_of, int world_size,
    checkpoint::FileSystem& fs, const std::string& dir) {
  return TrainFsdpPerRankOnSim(
      options_of, world_size,
      [&](SimCommunicator& comm, const FsdpTrainOptions& options,
          const FsdpRankResult& mine) -> absl::Status {
        FLATPARAM_ASSIGN_OR_RETURN(
            ModelLayout layout, refmodel::FsdpModelLayout(options, world_size));
        checkpoint::RankState state;
        state.flat_params = mine.state.flat_params;
        state.optim = refmodel::ShardedFromTrainStates(mine.state.optimizer);
        state.extra = {{"step", options.first_step + options.steps}};
        FLATPARAM_ASSIGN_OR_RETURN(
            checkpoint::RankContent content,
            checkpoint::MakeRankContent(
                layout, comm.rank() % layout.options().world_size, state));
        return checkpoint::WriteShardedCheckpointCollective(
            fs, dir, layout, world_size, content, comm);
      });
}

// Every rank's state for `options` on `world_size` ranks, from `dir`: its
// own files, which must fit (`reshard_at_load` false), or resharded at
// load time by LoadRankState from a checkpoint of any layout, each rank
// opening it for the metadata only as a job does.
absl::StatusOr<std::vector<refmodel::FsdpRankState>> Load(
    checkpoint::FileSystem& fs, const std::string& dir,
    const FsdpTrainOptions& options, int world_size, int64_t* step,
    bool reshard_at_load = false) {
  FLATPARAM_ASSIGN_OR_RETURN(ModelLayout layout,
                             refmodel::FsdpModelLayout(options, world_size));
  checkpoint::CheckpointOpenOptions open;
  if (reshard_at_load) open.ranks.emplace();
  FLATPARAM_ASSIGN_OR_RETURN(
      checkpoint::ShardedCheckpointReader reader,
      checkpoint::ShardedCheckpointReader::Open(fs, dir, open));
  if (!reshard_at_load) {
    FLATPARAM_RETURN_IF_ERROR(reader.CheckFits(layout, world_size));
  }
  std::vector<refmodel::FsdpRankState> states;
  for (int r = 0; r < world_size; ++r) {
    const int64_t shard_rank = r % layout.options().world_size;
    FLATPARAM_ASSIGN_OR_RETURN(
        checkpoint::RankState saved,
        reshard_at_load
            ? checkpoint::LoadRankState(reader, layout, world_size, shard_rank)
            : checkpoint::ReadRankState(reader, shard_rank));
    *step = saved.extra.value("step", -1);
    refmodel::FsdpRankState state;
    state.flat_params = std::move(saved.flat_params);
    FLATPARAM_ASSIGN_OR_RETURN(
        state.optimizer, refmodel::TrainStatesFromSharded(layout, saved.optim));
    states.push_back(std::move(state));
  }
  return states;
}

class CheckpointResumeTest : public ::testing::TestWithParam<Case> {};

TEST_P(CheckpointResumeTest, SaveReshardLoadEqualsSingleProcessTraining) {
  const Case& c = GetParam();
  const FsdpTrainOptions first = OptionsFor(c, c.before);
  FsdpTrainOptions second = OptionsFor(c, c.after);
  const int64_t k = first.steps;
  checkpoint::FaultInjectionFileSystem fs;

  // Segment 1 and the save.
  FsdpTrainOptions first_run = first;
  first_run.gather_results = false;
  FLATPARAM_ASSERT_OK(TrainAndSave([&](int) { return first_run; },
                                   c.before.world_size, fs, "/saved")
                          .status());
  // Offline reshard to the second job's layout.
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      ModelLayout after_layout,
      refmodel::FsdpModelLayout(second, c.after.world_size));
  FLATPARAM_ASSERT_OK(checkpoint::ReshardCheckpoint(
      fs, "/saved", after_layout.options(), c.after.world_size, "/resharded"));
  // Segment 2 from the resharded checkpoint.
  int64_t step = -1;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      std::vector<refmodel::FsdpRankState> loaded,
      Load(fs, "/resharded", second, c.after.world_size, &step));
  EXPECT_EQ(step, k) << "\"extra\" is carried through reshard";
  second.first_step = k;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(std::vector<FsdpRankResult> resumed,
                                 TrainFsdpPerRankOnSim(
                                     [&](int r) {
                                       FsdpTrainOptions o = second;
                                       o.initial_state = loaded[r];
                                       return o;
                                     },
                                     c.after.world_size));
  // And straight from the saved checkpoint, resharded at load time: the
  // same states, so the same training.
  int64_t direct_step = -1;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      std::vector<refmodel::FsdpRankState> direct,
      Load(fs, "/saved", second, c.after.world_size, &direct_step,
           /*reshard_at_load=*/true));
  EXPECT_EQ(direct_step, k);
  ASSERT_EQ(direct.size(), loaded.size());
  for (size_t r = 0; r < direct.size(); ++r) {
    EXPECT_EQ(direct[r].flat_params, loaded[r].flat_params) << "rank " << r;
    EXPECT_TRUE(direct[r].optimizer == loaded[r].optimizer) << "rank " << r;
  }
  FLATPARAM_ASSERT_OK_AND_ASSIGN(std::vector<FsdpRankResult> resumed_direct,
                                 TrainFsdpPerRankOnSim(
                                     [&](int r) {
                                       FsdpTrainOptions o = second;
                                       o.initial_state = direct[r];
                                       return o;
                                     },
                                     c.after.world_size));
  resumed.insert(resumed.end(), resumed_direct.begin(), resumed_direct.end());

  // The reference: K steps with the first fold, K with the second.
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      TrainOptions ref1,
      refmodel::ReferenceOptionsFor(first, c.before.world_size));
  FLATPARAM_ASSERT_OK_AND_ASSIGN(TrainResult want1,
                                 refmodel::TrainReference(first.model, ref1));
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      TrainOptions ref2,
      refmodel::ReferenceOptionsFor(second, c.after.world_size));
  ref2.initial_params = want1.params;
  ref2.initial_optimizer_state = want1.optimizer_state;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(TrainResult want,
                                 refmodel::TrainReference(second.model, ref2));
  for (const FsdpRankResult& r : resumed) {
    SCOPED_TRACE(absl::StrFormat("rank %d", r.rank));
    std::string why;
    EXPECT_TRUE(SameFloats(r.losses, want.losses));
    EXPECT_TRUE(SameTensors(r.params, want.params, &why)) << why;
    EXPECT_TRUE(SameStates(r.optimizer_state, want.optimizer_state, &why))
        << why;
  }
  // Where the two folds agree (the same world size and a one-level fold),
  // this is also the unbroken 2K-step run.
  if (c.before.world_size == c.after.world_size &&
      !IsHybridStrategy(c.before.strategy) &&
      !IsHybridStrategy(c.after.strategy)) {
    TrainOptions whole = ref1;
    whole.steps = 2 * k;
    FLATPARAM_ASSERT_OK_AND_ASSIGN(
        TrainResult unbroken, refmodel::TrainReference(first.model, whole));
    std::string why;
    EXPECT_TRUE(SameTensors(unbroken.params, want.params, &why)) << why;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, CheckpointResumeTest,
    ::testing::Values(Case{"FullShard8ToHybrid2x2On4",
                           {ShardingStrategy::kFullShard, 8, 0, false},
                           {ShardingStrategy::kHybridShard, 4, 2, false},
                           true,
                           1},
                      Case{"FullShard4ToFullShard2Sgd",
                           {ShardingStrategy::kFullShard, 4, 0, false},
                           {ShardingStrategy::kFullShard, 2, 0, false},
                           false,
                           2},
                      Case{"Hybrid2x2On4ToFullShard8Aligned",
                           {ShardingStrategy::kHybridShard, 4, 2, false},
                           {ShardingStrategy::kFullShard, 8, 0, true},
                           true,
                           1},
                      Case{"ShardGradOp3ToNoShard2",
                           {ShardingStrategy::kShardGradOp, 3, 0, true},
                           {ShardingStrategy::kNoShard, 2, 0, false},
                           false,
                           1},
                      Case{"NoShard2ToHybridZero2_3x2On6",
                           {ShardingStrategy::kNoShard, 2, 0, false},
                           {ShardingStrategy::kHybridShardZero2, 6, 3, true},
                           true,
                           2},
                      Case{"FullShard4ToFullShard4SameLayout",
                           {ShardingStrategy::kFullShard, 4, 0, false},
                           {ShardingStrategy::kFullShard, 4, 0, false},
                           true,
                           1}),
    [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

}  // namespace
}  // namespace verify
}  // namespace flatparam
