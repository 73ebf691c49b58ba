#include "flatparam/checkpoint/training_checkpoints.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "flatparam/base/status_matchers.h"
#include "flatparam/checkpoint/checkpoint_dir.h"
#include "flatparam/checkpoint/file_system.h"
#include "flatparam/checkpoint/internal/checkpoint_testutil.h"
#include "flatparam/checkpoint/training_state.h"
#include "flatparam/layout.h"
#include "flatparam/model_layout.h"
#include "sim/sim.h"

namespace flatparam {
namespace checkpoint {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::SizeIs;
using ::testing::UnorderedElementsAre;

TEST(StepCheckpointDirTest, ReplacesEveryPlaceholder) {
  EXPECT_EQ(StepCheckpointDir("/c/step{step}", 12), "/c/step12");
  EXPECT_EQ(StepCheckpointDir("/c/{step}/s{step}", 0), "/c/0/s0");
  EXPECT_EQ(StepCheckpointDir("/c/latest", 7), "/c/latest");
}

// A published checkpoint of the buffer model at `dir` (2 ranks).
void WriteComplete(FileSystem& fs, const std::string& dir) {
  const ModelLayout layout =
      MakeTestLayout(BufferModelSpec(), TestLayoutOptions(2));
  ASSERT_THAT(WriteRankStates(fs, dir, layout, RankStatesWithBuffers(layout)),
              IsOk());
}

TEST(FindLatestCheckpointTest, ThePatternWithoutAStepIsItself) {
  FaultInjectionFileSystem fs;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(LatestCheckpoint latest,
                                 FindLatestCheckpoint(fs, "/nowhere/ckpt"));
  EXPECT_EQ(latest.dir, "/nowhere/ckpt");
  EXPECT_EQ(latest.candidates, 0);
}

TEST(FindLatestCheckpointTest, TakesTheHighestCompleteStep) {
  FaultInjectionFileSystem fs;
  ASSERT_THAT(fs.CreateDir("/c"), IsOk());
  for (const char* step : {"2", "10", "9"}) {
    WriteComplete(fs, absl::StrCat("/c/step", step, ".ckpt"));
  }
  // Not steps: a sign, a space, a letter, nothing; another suffix.
  for (const char* name : {"step+30.ckpt", "step 30.ckpt", "step3x.ckpt",
                           "step.ckpt", "step40.old"}) {
    WriteComplete(fs, absl::StrCat("/c/", name));
  }
  // Newer but incomplete: a save that never published, one damaged since.
  ASSERT_THAT(fs.CreateDir("/c/step20.ckpt"), IsOk());
  WriteComplete(fs, "/c/step11.ckpt");
  ASSERT_THAT(fs.RemoveFile("/c/step11.ckpt/rank00001.safetensors"), IsOk());

  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      LatestCheckpoint latest, FindLatestCheckpoint(fs, "/c/step{step}.ckpt"));
  EXPECT_EQ(latest.dir, "/c/step10.ckpt");
  EXPECT_EQ(latest.candidates, 5);
  EXPECT_THAT(latest.skipped,
              ElementsAre(AllOf(HasSubstr("/c/step20.ckpt ("),
                                HasSubstr("manifest.json")),
                          AllOf(HasSubstr("/c/step11.ckpt ("),
                                HasSubstr("rank00001.safetensors"))));
}

TEST(FindLatestCheckpointTest, NamesWhatItSkippedWhenNoneIsComplete) {
  FaultInjectionFileSystem fs;
  ASSERT_THAT(fs.CreateDir("/c"), IsOk());
  ASSERT_THAT(fs.CreateDir("/c/s3"), IsOk());
  EXPECT_THAT(FindLatestCheckpoint(fs, "/c/s{step}"),
              StatusIs(absl::StatusCode::kNotFound,
                       AllOf(HasSubstr("no complete checkpoint matches "
                                       "/c/s{step} (1 directories of /c "
                                       "matched the name; skipped: /c/s3 ("),
                             HasSubstr("manifest.json"))));
  EXPECT_THAT(FindLatestCheckpoint(fs, "/c/t{step}"),
              StatusIs(absl::StatusCode::kNotFound,
                       HasSubstr("(0 directories of /c matched the name)")));
  EXPECT_FALSE(FindLatestCheckpoint(fs, "/missing/s{step}").ok());
}

TEST(FindLatestCheckpointTest, TheStepStandsOnceInTheLastComponent) {
  FaultInjectionFileSystem fs;
  for (const char* bad : {"/c/{step}/ckpt", "/c/s{step}-{step}"}) {
    EXPECT_THAT(FindLatestCheckpoint(fs, bad),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr(absl::StrCat(
                             "\"{step}\" must stand once, in the last path "
                             "component, in ",
                             bad))));
  }
}

// Runs `body` on every rank of a simulated world of `world_size`; returns
// each rank's status.
std::vector<absl::Status> OnSim(
    int world_size, const std::function<absl::Status(Communicator&)>& body) {
  SimOptions sim;
  sim.world_size = world_size;
  absl::StatusOr<std::unique_ptr<SimWorld>> world = SimWorld::Create(sim);
  EXPECT_THAT(world, IsOk());
  std::vector<absl::Status> statuses(world_size);
  (*world)
      ->Run([&](Communicator& comm) -> absl::Status {
        statuses[comm.rank()] = body(comm);
        return absl::OkStatus();
      })
      .IgnoreError();
  return statuses;
}

// Each rank's state after `step` steps: the buffer model's rank state with
// the step in its flat parameters and "extra".
RankState StateAt(const ModelLayout& layout, int rank, int64_t step) {
  RankState s = RankStatesWithBuffers(layout)[rank];
  for (HostTensor& p : s.flat_params) FillSequence(p, step * 100 + rank);
  s.extra = {{"step", step}};
  return s;
}

// Trains 5 steps on 2 simulated ranks, saving every 2 (and the last).
std::vector<absl::Status> SaveEvery2(FileSystem& fs, const std::string& dir,
                                     bool async, std::vector<int64_t>* saved,
                                     int failing_rank = -1) {
  const ModelLayout layout =
      MakeTestLayout(BufferModelSpec(), TestLayoutOptions(2));
  return OnSim(2, [&](Communicator& comm) -> absl::Status {
    StepSaveOptions options;
    options.dir = dir;
    options.every = 2;
    options.async = async;
    StepCheckpointSaver saver(fs, comm, options);
    absl::Status trained = absl::OkStatus();
    for (int64_t step = 1; step <= 5 && trained.ok(); ++step) {
      trained = saver.AfterStep(
          layout, step, step == 5, [&]() -> absl::StatusOr<RankState> {
            if (comm.rank() == failing_rank && step == 4) {
              return absl::InternalError("no state on this rank");
            }
            return StateAt(layout, comm.rank(), step);
          });
    }
    const absl::Status finished = saver.Finish();
    if (comm.rank() == 0 && saved != nullptr) *saved = saver.saved_steps();
    return trained.ok() ? finished : trained;
  });
}

int64_t StepAt(FileSystem& fs, const std::string& dir) {
  absl::StatusOr<ShardedCheckpointReader> reader =
      ShardedCheckpointReader::Open(fs, dir);
  EXPECT_THAT(reader, IsOk());
  if (!reader.ok()) return -1;
  absl::StatusOr<RankState> s = ReadRankState(*reader, 1);
  EXPECT_THAT(s, IsOk());
  return s.ok() ? s->extra.value("step", int64_t{-1}) : -1;
}

TEST(StepCheckpointSaverTest, SavesEveryNStepsAndTheLast) {
  for (bool async : {false, true}) {
    SCOPED_TRACE(async ? "async" : "sync");
    FaultInjectionFileSystem fs;
    ASSERT_THAT(fs.CreateDir("/c"), IsOk());
    std::vector<int64_t> saved;
    for (const absl::Status& s :
         SaveEvery2(fs, "/c/step{step}", async, &saved)) {
      EXPECT_THAT(s, IsOk());
    }
    EXPECT_THAT(saved, ElementsAre(2, 4, 5));
    EXPECT_THAT(ListDir(fs, "/c"),
                UnorderedElementsAre("step2", "step4", "step5"));
    for (int64_t step : {2, 4, 5}) {
      EXPECT_EQ(StepAt(fs, absl::StrCat("/c/step", step)), step);
    }
    FLATPARAM_ASSERT_OK_AND_ASSIGN(LatestCheckpoint latest,
                                   FindLatestCheckpoint(fs, "/c/step{step}"));
    EXPECT_EQ(latest.dir, "/c/step5");
  }
}

TEST(StepCheckpointSaverTest, AsyncSavesAreTheSyncBytes) {
  FaultInjectionFileSystem fs;
  ASSERT_THAT(fs.CreateDir("/sync"), IsOk());
  ASSERT_THAT(fs.CreateDir("/async"), IsOk());
  SaveEvery2(fs, "/sync/step{step}", /*async=*/false, nullptr);
  SaveEvery2(fs, "/async/step{step}", /*async=*/true, nullptr);
  for (const char* step : {"step2", "step4", "step5"}) {
    SCOPED_TRACE(step);
    ExpectSameDirectory(fs, absl::StrCat("/sync/", step),
                        absl::StrCat("/async/", step));
  }
}

TEST(StepCheckpointSaverTest, WithoutAStepEverySaveReplacesTheLast) {
  FaultInjectionFileSystem fs;
  std::vector<int64_t> saved;
  for (const absl::Status& s : SaveEvery2(fs, "/latest", true, &saved)) {
    EXPECT_THAT(s, IsOk());
  }
  EXPECT_THAT(saved, ElementsAre(2, 4, 5));
  EXPECT_EQ(StepAt(fs, "/latest"), 5);
}

TEST(StepCheckpointSaverTest, ARankWithoutStateFailsEveryRanksSave) {
  for (bool async : {false, true}) {
    SCOPED_TRACE(async ? "async" : "sync");
    FaultInjectionFileSystem fs;
    ASSERT_THAT(fs.CreateDir("/c"), IsOk());
    const std::vector<absl::Status> statuses =
        SaveEvery2(fs, "/c/step{step}", async, nullptr, /*failing_rank=*/1);
    ASSERT_THAT(statuses, SizeIs(2));
    for (const absl::Status& s : statuses) {
      EXPECT_THAT(s, StatusIs(absl::StatusCode::kInternal,
                              AllOf(HasSubstr("save to /c/step4: "),
                                    HasSubstr("rank 1: "),
                                    HasSubstr("no state on this rank"))));
    }
    // Step 2's save stands; step 4's left nothing behind.
    EXPECT_THAT(ListDir(fs, "/c"), ElementsAre("step2"));
    EXPECT_EQ(StepAt(fs, "/c/step2"), 2);
  }
}

TEST(StepCheckpointSaverTest, DueAndANegativeInterval) {
  FaultInjectionFileSystem fs;
  const ModelLayout layout =
      MakeTestLayout(BufferModelSpec(), TestLayoutOptions(1));
  for (const absl::Status& s :
       OnSim(1, [&](Communicator& comm) -> absl::Status {
         StepSaveOptions every3;
         every3.dir = "/x";
         every3.every = 3;
         StepCheckpointSaver saver(fs, comm, every3);
         EXPECT_FALSE(saver.Due(2, false));
         EXPECT_TRUE(saver.Due(3, false));
         EXPECT_TRUE(saver.Due(4, true));
         StepSaveOptions never;
         never.dir = "/x";
         EXPECT_FALSE(StepCheckpointSaver(fs, comm, never).Due(3, false));
         StepSaveOptions negative;
         negative.dir = "/x";
         negative.every = -1;
         StepCheckpointSaver bad(fs, comm, negative);
         EXPECT_THAT(
             bad.AfterStep(layout, 1, true,
                           [&]() -> absl::StatusOr<RankState> {
                             return StateAt(layout, 0, 1);
                           }),
             StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("-1")));
         EXPECT_THAT(bad.saved_steps(), IsEmpty());
         return absl::OkStatus();
       })) {
    EXPECT_THAT(s, IsOk());
  }
  EXPECT_FALSE(*fs.Exists("/x"));
}

}  // namespace
}  // namespace checkpoint
}  // namespace flatparam
