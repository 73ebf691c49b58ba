#include "flatparam/checkpoint/async_checkpoint.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/base/status_matchers.h"
#include "flatparam/checkpoint/checkpoint_dir.h"
#include "flatparam/checkpoint/collective_checkpoint.h"
#include "flatparam/checkpoint/file_system.h"
#include "flatparam/checkpoint/internal/checkpoint_testutil.h"
#include "flatparam/checkpoint/training_state.h"
#include "flatparam/layout.h"
#include "flatparam/optim/optim_state.h"
#include "sim/sim.h"

namespace flatparam {
namespace checkpoint {
namespace {

using ::testing::HasSubstr;

// Every shard-group rank's state of version `version`: each flat
// parameter's shard, an "exp_avg" and a "step", and the version in "extra".
std::vector<RankState> States(const ModelLayout& layout, int64_t world_size,
                              int version) {
  (void)world_size;
  std::vector<RankState> out;
  for (int64_t r = 0; r < layout.options().world_size; ++r) {
    RankState s;
    for (size_t i = 0; i < layout.flat_params().size(); ++i) {
      const FlatParamLayout& f = layout.flat_params()[i];
      HostTensor p = HostTensor::Flat(f.dtype(), f.sharded_numel());
      FillSequence(p, version * 1000 + r * 100 + i * 10);
      HostTensor m = HostTensor::Flat(DType::kFloat32, f.sharded_numel());
      FillSequence(m, -version * 1000 - r * 100 - i * 10);
      s.optim.state[optim::ParamKey(static_cast<int64_t>(i))]["exp_avg"] =
          std::move(m);
      s.optim.state[optim::ParamKey(static_cast<int64_t>(i))]["step"] =
          optim::ScalarTensor(DType::kFloat32, version);
      s.flat_params.push_back(std::move(p));
    }
    s.extra = {{"version", version}};
    out.push_back(std::move(s));
  }
  return out;
}

// The synchronous single-process write of `states`.
absl::Status WriteSync(FileSystem& fs, const std::string& dir,
                       const ModelLayout& layout, int64_t world_size,
                       const std::vector<RankState>& states) {
  ShardedCheckpointContent content;
  content.layout = &layout;
  content.world_size = world_size;
  for (size_t r = 0; r < states.size(); ++r) {
    FLATPARAM_ASSIGN_OR_RETURN(RankContent c,
                               MakeRankContent(layout, r, states[r]));
    content.ranks.push_back(std::move(c));
  }
  return WriteShardedCheckpoint(fs, dir, content);
}

int VersionAt(FileSystem& fs, const std::string& dir) {
  absl::StatusOr<ShardedCheckpointReader> reader =
      ShardedCheckpointReader::Open(fs, dir);
  EXPECT_THAT(reader, IsOk());
  if (!reader.ok()) return -1;
  absl::StatusOr<RankState> s = ReadRankState(*reader, 0);
  EXPECT_THAT(s, IsOk());
  return s.ok() ? s->extra.value("version", -1) : -1;
}

// On every rank of a simulated world: Start(dir, states[r % G]), then
// `between` (training on: it may issue collectives), then Finish.
std::vector<absl::Status> SaveAsyncOnSim(
    FileSystem& fs, const std::string& dir, const ModelLayout& layout,
    int world_size, const std::vector<RankState>& states,
    const std::function<absl::Status(Communicator&)>& between,
    const AsyncSaveOptions& options = {}) {
  SimOptions sim;
  sim.world_size = world_size;
  absl::StatusOr<std::unique_ptr<SimWorld>> world = SimWorld::Create(sim);
  EXPECT_THAT(world, IsOk());
  const int64_t g = layout.options().world_size;
  std::vector<absl::Status> statuses(world_size);
  (*world)
      ->Run([&](Communicator& comm) -> absl::Status {
        AsyncCheckpointSaver saver(fs, comm, options);
        absl::Status s =
            saver.Start(dir, layout, world_size, states[comm.rank() % g]);
        if (s.ok()) {
          EXPECT_TRUE(saver.pending());
        }
        if (s.ok()) s = between(comm);
        if (s.ok()) s = saver.Finish();
        EXPECT_FALSE(saver.pending());
        statuses[comm.rank()] = s;
        return absl::OkStatus();
      })
      .IgnoreError();
  return statuses;
}

absl::Status TrainOn(Communicator& comm) {
  // Collectives while the writer thread writes.
  std::vector<float> x(1000, 1.0f);
  for (int step = 0; step < 5; ++step) {
    ReduceOptions o;
    FLATPARAM_RETURN_IF_ERROR(
        comm.AllReduce(
                ConstBufferRef{x.data(), 1000, DType::kFloat32, Device::Host()},
                BufferRef{x.data(), 1000, DType::kFloat32, Device::Host()}, o)
            ->Wait());
  }
  return absl::OkStatus();
}

class AsyncCheckpointTest
    : public ::testing::TestWithParam<std::tuple<ShardingStrategy, int, int>> {
};

// The same bytes as the synchronous collective write, with collectives
// issued while the ranks' files are written; also when the snapshot is over
// the staging limit and written inside Start.
TEST_P(AsyncCheckpointTest, EqualsTheSynchronousWriteByteForByte) {
  const auto [strategy, group, world_size] = GetParam();
  const ModelLayout layout =
      MakeTestLayout(TinyModelSpec(), TestLayoutOptions(group, strategy));
  const std::vector<RankState> states = States(layout, world_size, 2);
  FaultInjectionFileSystem fs;
  FLATPARAM_ASSERT_OK(fs.CreateDir("/d"));
  FLATPARAM_ASSERT_OK(WriteSync(fs, "/d/sync", layout, world_size, states));
  for (const int64_t limit : {int64_t{64} << 30, int64_t{0}}) {
    AsyncSaveOptions options;
    options.max_staging_bytes = limit;
    const std::string dir = absl::StrCat("/d/async", limit);
    for (const absl::Status& s : SaveAsyncOnSim(fs, dir, layout, world_size,
                                                states, TrainOn, options)) {
      EXPECT_THAT(s, IsOk());
    }
    SCOPED_TRACE(absl::StrCat("limit ", limit));
    ExpectSameDirectory(fs, "/d/sync", dir);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Strategies, AsyncCheckpointTest,
    ::testing::Values(std::make_tuple(ShardingStrategy::kFullShard, 4, 4),
                      std::make_tuple(ShardingStrategy::kHybridShard, 2, 4)));

// Not finished: nothing is published and the previous checkpoint stays; a
// later save to the same directory succeeds.
TEST(AsyncCheckpointSaverTest, UnfinishedSaveLeavesThePreviousCheckpoint) {
  const ModelLayout layout =
      MakeTestLayout(TinyModelSpec(), TestLayoutOptions(2));
  FaultInjectionFileSystem fs;
  FLATPARAM_ASSERT_OK(fs.CreateDir("/d"));
  FLATPARAM_ASSERT_OK(fs.SyncDir("/"));
  FLATPARAM_ASSERT_OK(WriteSync(fs, "/d/c", layout, 2, States(layout, 2, 1)));
  const std::vector<RankState> v2 = States(layout, 2, 2);
  SimOptions sim;
  sim.world_size = 2;
  auto world = SimWorld::Create(sim);
  ASSERT_THAT(world, IsOk());
  ASSERT_THAT((*world)->Run([&](Communicator& comm) -> absl::Status {
    AsyncCheckpointSaver saver(fs, comm);
    return saver.Start("/d/c", layout, 2, v2[comm.rank()]);
    // Destroyed without Finish.
  }),
              IsOk());
  fs.Crash();
  EXPECT_EQ(VersionAt(fs, "/d/c"), 1);
  for (const absl::Status& s :
       SaveAsyncOnSim(fs, "/d/c", layout, 2, v2, TrainOn)) {
    EXPECT_THAT(s, IsOk());
  }
  EXPECT_EQ(VersionAt(fs, "/d/c"), 2);
}

// Content that does not fit the layout on one rank: every rank gets the
// error from Start, and nothing is left behind.
TEST(AsyncCheckpointSaverTest, BadContentOnOneRankFailsEveryRank) {
  const ModelLayout layout =
      MakeTestLayout(TinyModelSpec(), TestLayoutOptions(2));
  FaultInjectionFileSystem fs;
  FLATPARAM_ASSERT_OK(fs.CreateDir("/d"));
  std::vector<RankState> states = States(layout, 2, 2);
  states[1].flat_params.pop_back();
  const std::vector<absl::Status> statuses =
      SaveAsyncOnSim(fs, "/d/c", layout, 2, states, TrainOn);
  for (const absl::Status& s : statuses) {
    EXPECT_THAT(
        s, StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("rank 1")));
  }
  EXPECT_TRUE(ListDir(fs, "/d").empty());
}

// A crash at any file-system operation of an asynchronous save (the
// background writes included) leaves the previous or the new checkpoint,
// whole; every rank reports the same.
TEST(AsyncCheckpointSaverTest, CrashAtEveryOperation) {
  const ModelLayout layout = MakeTestLayout(
      TinyModelSpec(), TestLayoutOptions(2, ShardingStrategy::kHybridShard));
  const std::vector<RankState> v1 = States(layout, 4, 1);
  const std::vector<RankState> v2 = States(layout, 4, 2);
  bool finished = false;
  int64_t n = 0;
  for (; !finished && n < 500; ++n) {
    SCOPED_TRACE(n);
    FaultInjectionFileSystem fs;
    FLATPARAM_ASSERT_OK(fs.CreateDir("/d"));
    FLATPARAM_ASSERT_OK(fs.SyncDir("/"));
    FLATPARAM_ASSERT_OK(WriteSync(fs, "/d/c", layout, 4, v1));
    fs.FailOperationsFrom(n);
    const std::vector<absl::Status> statuses =
        SaveAsyncOnSim(fs, "/d/c", layout, 4, v2, TrainOn);
    for (size_t r = 1; r < statuses.size(); ++r) {
      EXPECT_EQ(statuses[r], statuses[0]) << "rank " << r;
    }
    finished = !fs.failed();
    if (finished) FLATPARAM_ASSERT_OK(statuses[0]);
    fs.Crash();
    const int version = VersionAt(fs, "/d/c");
    if (statuses[0].ok()) {
      EXPECT_EQ(version, 2);
    } else {
      EXPECT_TRUE(version == 1 || version == 2) << version;
    }
  }
  EXPECT_TRUE(finished);
  EXPECT_GT(n, 20);
}

}  // namespace
}  // namespace checkpoint
}  // namespace flatparam
