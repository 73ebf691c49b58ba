#include "tools/diagnose.h"

#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "comm/communicator.h"
#include "comm/flight_recorder.h"
#include "flatparam/base/dtype.h"
#include "flatparam/base/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "sim/sim.h"

namespace flatparam {
namespace tools {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;

std::string Dir(const std::string& name) {
  const char* base = std::getenv("TEST_TMPDIR");
  return absl::StrCat(base != nullptr ? base : "/tmp", "/", name);
}

std::string Text(const Diagnosis& d) {
  std::ostringstream out;
  PrintDiagnosis(d, out);
  return out.str();
}

// Runs `fn` on a simulated world of 4 whose recorders dump into `dir`
// (on failure, and once more at the end so that every rank has a file).
void RunSim(const std::string& dir, const SimWorld::RankFn& fn) {
  SimOptions options;
  options.world_size = 4;
  options.flight_recorder.trace_dir = dir;
  options.stall_timeout = absl::Seconds(60);
  auto world = SimWorld::Create(options);
  ASSERT_TRUE(world.ok());
  (*world)->Run(fn).IgnoreError();
  for (int r = 0; r < 4; ++r) {
    ASSERT_TRUE((*world)->flight_recorder(r)->Dump("end of test").ok());
  }
}

std::vector<float> buffer(64, 1.0f);

absl::Status Gather(Communicator& comm, int64_t count, const char* unit,
                    CollectivePhase phase) {
  ScopedCollectiveContext context(comm.flight_recorder(), {unit, 1, phase});
  std::vector<float> out(count * comm.size());
  return comm
      .AllGather(ConstBufferRef{buffer.data(), count, DType::kFloat32},
                 BufferRef{out.data(), count * comm.size(), DType::kFloat32},
                 CollectiveOptions{absl::Seconds(5), std::nullopt})
      ->Wait();
}

TEST(DiagnoseTest, AllCompletedIsOk) {
  const std::string dir = Dir("ok");
  RunSim(dir, [](SimCommunicator& comm) {
    for (int i = 0; i < 3; ++i) {
      FLATPARAM_RETURN_IF_ERROR(
          Gather(comm, 4, "h.0", CollectivePhase::kForwardUnshard));
    }
    return absl::OkStatus();
  });
  FLATPARAM_ASSERT_OK_AND_ASSIGN(std::vector<FlightDump> dumps,
                                 ReadFlightDumps(dir));
  ASSERT_EQ(dumps.size(), 4u);
  EXPECT_EQ(dumps[2].entries.size(), 3u);
  EXPECT_EQ(dumps[2].entries[1].unit, "h.0");
  EXPECT_EQ(dumps[2].entries[1].phase, "forward unshard");
  EXPECT_EQ(dumps[2].groups.at("world"), (std::vector<int>{0, 1, 2, 3}));
  const Diagnosis d = Diagnose(dumps);
  EXPECT_EQ(d.ExitCode(), 0) << Text(d);
  EXPECT_THAT(Text(d), HasSubstr("ok: every rank dumped"));
}

TEST(DiagnoseTest, ARankThatStoppedIssuingIsBehind) {
  const std::string dir = Dir("behind");
  RunSim(dir, [](SimCommunicator& comm) {
    FLATPARAM_RETURN_IF_ERROR(
        Gather(comm, 4, "h.0", CollectivePhase::kForwardUnshard));
    if (comm.rank() == 3) return absl::OkStatus();  // leaves early
    return Gather(comm, 8, "h.1", CollectivePhase::kForwardUnshard);
  });
  FLATPARAM_ASSERT_OK_AND_ASSIGN(std::vector<FlightDump> dumps,
                                 ReadFlightDumps(dir));
  const Diagnosis d = Diagnose(dumps);
  EXPECT_EQ(d.ExitCode(), kDiagnoseStuck) << Text(d);
  EXPECT_THAT(Text(d),
              HasSubstr("behind: rank 3 never issued all_gather #1 of 8 "
                        "float32 (unit h.1, forward unshard) of group world, "
                        "where ranks 0, 1 and 2 wait"));
  EXPECT_THAT(Text(d), HasSubstr("rank 3's last is all_gather #0 of 4 "
                                 "float32 (unit h.0, forward unshard), "
                                 "completed"));
}

TEST(DiagnoseTest, KilledRankWithoutADumpIsNamed) {
  const std::string dir = Dir("killed");
  RunSim(dir, [](SimCommunicator& comm) {
    FLATPARAM_RETURN_IF_ERROR(
        Gather(comm, 4, "h.0", CollectivePhase::kForwardUnshard));
    if (comm.rank() == 2) return absl::OkStatus();
    return Gather(comm, 4, "h.1", CollectivePhase::kPreBackwardUnshard);
  });
  // A killed process writes nothing.
  ASSERT_EQ(unlink((dir + "/rank_2.json").c_str()), 0);
  FLATPARAM_ASSERT_OK_AND_ASSIGN(std::vector<FlightDump> dumps,
                                 ReadFlightDumps(dir));
  const Diagnosis d = Diagnose(dumps);
  EXPECT_EQ(d.ExitCode(), kDiagnoseStuck | kDiagnoseMissing) << Text(d);
  EXPECT_THAT(d.missing_ranks, ElementsAre(2));
  EXPECT_THAT(Text(d),
              HasSubstr("no dump: rank 2 wrote none (killed, stopped, or its "
                        "host is gone): ranks 0, 1 and 3 wait for it from "
                        "all_gather #1 of 4 float32 (unit h.1, pre-backward "
                        "unshard) of group world"));
}

TEST(DiagnoseTest, DifferentSizesAreADesyncAtTheirSequenceNumber) {
  const std::string dir = Dir("sizes");
  RunSim(dir, [](SimCommunicator& comm) {
    FLATPARAM_RETURN_IF_ERROR(
        Gather(comm, 4, "h.0", CollectivePhase::kForwardUnshard));
    // Rank 1 skipped h.1: its next gather is h.2's, of another size.
    if (comm.rank() == 1) {
      return Gather(comm, 6, "h.2", CollectivePhase::kForwardUnshard);
    }
    return Gather(comm, 5, "h.1", CollectivePhase::kForwardUnshard);
  });
  FLATPARAM_ASSERT_OK_AND_ASSIGN(std::vector<FlightDump> dumps,
                                 ReadFlightDumps(dir));
  const Diagnosis d = Diagnose(dumps);
  EXPECT_TRUE(d.desync) << Text(d);
  EXPECT_THAT(Text(d),
              HasSubstr("desync: in group world at #1 the ranks disagree on "
                        "the collective: rank 1 issued all_gather #1 of 6 "
                        "float32 (unit h.2, forward unshard); ranks 0, 2 and "
                        "3 issued all_gather #1 of 5 float32 (unit h.1, "
                        "forward unshard)"));
}

TEST(DiagnoseTest, EqualSizesFromDifferentUnitsAreADesyncToo) {
  const std::string dir = Dir("context");
  RunSim(dir, [](SimCommunicator& comm) {
    const char* unit = comm.rank() == 1 ? "h.2" : "h.1";
    FLATPARAM_RETURN_IF_ERROR(
        Gather(comm, 4, unit, CollectivePhase::kForwardUnshard));
    return absl::OkStatus();
  });
  FLATPARAM_ASSERT_OK_AND_ASSIGN(std::vector<FlightDump> dumps,
                                 ReadFlightDumps(dir));
  const Diagnosis d = Diagnose(dumps);
  EXPECT_EQ(d.ExitCode(), kDiagnoseDesync) << Text(d);
  EXPECT_THAT(Text(d), HasSubstr("disagree on the FSDP unit or phase that "
                                 "issued it: rank 1 issued all_gather #0 of "
                                 "4 float32 (unit h.2, forward unshard)"));
}

TEST(DiagnoseTest, SplitGroupsAreComparedWithinThemselves) {
  const std::string dir = Dir("split");
  RunSim(dir, [](SimCommunicator& comm) -> absl::Status {
    FLATPARAM_ASSIGN_OR_RETURN(
        std::unique_ptr<Communicator> half,
        comm.Split(comm.rank() % 2, comm.rank(),
                   CollectiveOptions{absl::Seconds(5), std::nullopt}));
    // The two halves gather different sizes: no desync.
    FLATPARAM_RETURN_IF_ERROR(Gather(*half, 2 + comm.rank() % 2, "h.0",
                                     CollectivePhase::kForwardUnshard));
    if (comm.rank() == 3) return absl::OkStatus();
    return Gather(*half, 4, "h.1", CollectivePhase::kForwardUnshard);
  });
  FLATPARAM_ASSERT_OK_AND_ASSIGN(std::vector<FlightDump> dumps,
                                 ReadFlightDumps(dir));
  EXPECT_EQ(dumps[3].groups.at("world/split0:1"), (std::vector<int>{1, 3}));
  const Diagnosis d = Diagnose(dumps);
  EXPECT_FALSE(d.desync) << Text(d);
  EXPECT_THAT(Text(d), HasSubstr("behind: rank 3 never issued all_gather #1 "
                                 "of 4 float32 (unit h.1, forward unshard) "
                                 "of group world/split0:1, where rank 1 "
                                 "waits"));
}

TEST(DiagnoseTest, EveryRankStuckInTheSameCollectiveIsATransportFailure) {
  // What a cut link leaves: every rank in the same collective, failed.
  const std::string dir = Dir("cut");
  for (int r = 0; r < 2; ++r) {
    FlightRecorderOptions options;
    options.trace_dir = dir;
    auto rec = FlightRecorder::Create(r, 2, "mpi", options);
    auto world = std::make_shared<FlightGroup>(FlightGroup{"world", {0, 1}});
    rec->Finished(rec->Enqueue(world, 0, CollectiveOp::kAllReduce,
                               DType::kFloat32, 3, 12),
                  absl::OkStatus());
    rec->Finished(rec->Enqueue(world, 1, CollectiveOp::kAllReduce,
                               DType::kFloat32, 3, 12),
                  absl::DeadlineExceededError(
                      absl::StrCat("no data arrived from rank ", 1 - r)));
  }
  FLATPARAM_ASSERT_OK_AND_ASSIGN(std::vector<FlightDump> dumps,
                                 ReadFlightDumps(dir));
  const Diagnosis d = Diagnose(dumps);
  EXPECT_EQ(d.ExitCode(), kDiagnoseStuck) << Text(d);
  EXPECT_THAT(Text(d), HasSubstr("stuck: ranks 0 and 1 never finished "
                                 "all_reduce #1 of 3 float32 of group world "
                                 "(the oldest collective not finished): no "
                                 "rank is behind"));
  EXPECT_THAT(Text(d), HasSubstr("first failure: DEADLINE_EXCEEDED: no data "
                                 "arrived from rank 0"));
}

TEST(DiagnoseTest, ARankThatNeverSawTheTimeoutStalled) {
  // A stopped rank resumed by the launcher only to be ended: in the same
  // collective as the others, but it never failed there.
  const std::string dir = Dir("stalled");
  for (int r = 0; r < 3; ++r) {
    FlightRecorderOptions options;
    options.trace_dir = dir;
    auto rec = FlightRecorder::Create(r, 3, "mpi", options);
    auto world = std::make_shared<FlightGroup>(FlightGroup{"world", {0, 1, 2}});
    ScopedCollectiveContext context(
        rec.get(), {"h.3", 4, CollectivePhase::kPostBackwardReduce});
    const uint64_t id = rec->Enqueue(world, 5, CollectiveOp::kReduceScatter,
                                     DType::kFloat32, 7, 84);
    if (r != 2) {
      rec->Finished(id, absl::DeadlineExceededError("rank 2 did not take"));
    } else {
      rec->Started(id);
      ASSERT_TRUE(rec->Dump("SIGTERM").ok());
    }
  }
  FLATPARAM_ASSERT_OK_AND_ASSIGN(std::vector<FlightDump> dumps,
                                 ReadFlightDumps(dir));
  const Diagnosis d = Diagnose(dumps);
  EXPECT_EQ(d.ExitCode(), kDiagnoseStuck) << Text(d);
  EXPECT_THAT(Text(d),
              HasSubstr("stalled: rank 2 never saw reduce_scatter #5 of 7 "
                        "float32 (unit h.3, post-backward reduce) of group "
                        "world fail, which ranks 0 and 1 timed out in"));
  EXPECT_THAT(Text(d), ::testing::Not(HasSubstr("stuck:")));
}

TEST(DiagnoseTest, TheRankTheOthersErrorsNameIsTheSuspect) {
  // Rank 2 stopped with two reductions in flight: ranks 0 and 1 finished
  // both and wait in the next collective, rank 3 waits in the older one;
  // their errors name rank 2.
  const std::string dir = Dir("suspect");
  auto world =
      std::make_shared<FlightGroup>(FlightGroup{"world", {0, 1, 2, 3}});
  for (int r = 0; r < 4; ++r) {
    FlightRecorderOptions options;
    options.trace_dir = dir;
    auto rec = FlightRecorder::Create(r, 4, "mpi", options);
    const uint64_t a = rec->Enqueue(world, 7, CollectiveOp::kReduceScatter,
                                    DType::kFloat32, 5, 80);
    const uint64_t b = rec->Enqueue(world, 8, CollectiveOp::kReduceScatter,
                                    DType::kFloat32, 3, 48);
    rec->Finished(b, absl::OkStatus());
    if (r == 0 || r == 1) {
      rec->Finished(a, absl::OkStatus());
      rec->Finished(rec->Enqueue(world, 9, CollectiveOp::kAllGather,
                                 DType::kFloat32, 1, 4),
                    absl::DeadlineExceededError(
                        "rank 0: all_gather #9 timed out: no data arrived "
                        "from ranks 2 and 3: they have not reached it"));
    } else if (r == 3) {
      rec->Finished(a, absl::DeadlineExceededError(
                           "rank 3: reduce_scatter #7 timed out: every "
                           "peer's data arrived, but rank 2 has not taken "
                           "this rank's"));
    } else {
      rec->Finished(a, absl::DeadlineExceededError("a peer did not call it"));
    }
  }
  FLATPARAM_ASSERT_OK_AND_ASSIGN(std::vector<FlightDump> dumps,
                                 ReadFlightDumps(dir));
  const Diagnosis d = Diagnose(dumps);
  EXPECT_EQ(d.ExitCode(), kDiagnoseStuck) << Text(d);
  EXPECT_THAT(Text(d), HasSubstr("stuck: ranks 2 and 3 never finished "
                                 "reduce_scatter #7 of 5 float32 of group "
                                 "world (the oldest collective not "
                                 "finished); ranks 0 and 1 finished it and "
                                 "wait in all_gather #9 of 1 float32"));
  // Rank 3, still in the oldest, names rank 2; ranks 0 and 1, past it,
  // name ranks 2 and 3 alike.
  EXPECT_THAT(Text(d), HasSubstr("suspect: rank 2: the errors of rank 3 "
                                 "name it"));
}

// A cut link to rank 2's host, as train_hosts_test records it: whichever
// way the in-flight data was lost, rank 2 is alone on its side of the
// oldest unfinished collective, and the others' or its own errors (which
// blame senders whose data provably went out) do not mislead.
TEST(DiagnoseTest, ACutLinkSuspectsTheRankAloneOnItsSide) {
  for (bool alone_finished : {false, true}) {
    const std::string dir =
        Dir(alone_finished ? "cut_finished" : "cut_never_finished");
    auto world =
        std::make_shared<FlightGroup>(FlightGroup{"world", {0, 1, 2, 3}});
    for (int r = 0; r < 4; ++r) {
      FlightRecorderOptions options;
      options.trace_dir = dir;
      auto rec = FlightRecorder::Create(r, 4, "mpi", options);
      rec->SetContext({"layers.2", 3, CollectivePhase::kBackwardPrefetch});
      const uint64_t a = rec->Enqueue(world, 5, CollectiveOp::kAllGather,
                                      DType::kFloat32, 98, 392);
      const bool finishes = (r == 2) == alone_finished;
      if (!finishes) {
        rec->Finished(a, absl::DeadlineExceededError(
                             r == 2 ? "rank 2: all_gather #5 timed out: no "
                                      "data arrived from rank 0"
                                    : absl::StrCat("rank ", r,
                                                   ": all_gather #5 timed "
                                                   "out: no data arrived "
                                                   "from rank 2")));
        continue;
      }
      rec->Finished(a, absl::OkStatus());
      rec->SetContext({"layers.1", 2, CollectivePhase::kBackwardPrefetch});
      rec->Finished(
          rec->Enqueue(world, 6, CollectiveOp::kAllGather, DType::kFloat32, 276,
                       1104),
          absl::DeadlineExceededError(
              r == 2 ? "rank 2: all_gather #6 timed out: no data arrived "
                       "from ranks 0, 1 and 3"
                     : absl::StrCat("rank ", r,
                                    ": all_gather #6 timed out: no data "
                                    "arrived from rank 2")));
    }
    FLATPARAM_ASSERT_OK_AND_ASSIGN(std::vector<FlightDump> dumps,
                                   ReadFlightDumps(dir));
    const Diagnosis d = Diagnose(dumps);
    EXPECT_EQ(d.ExitCode(), kDiagnoseStuck) << Text(d);
    EXPECT_THAT(Text(d),
                HasSubstr(absl::StrCat(
                    "suspect: rank 2: the only rank that ",
                    alone_finished ? "finished" : "never finished",
                    " all_gather #5 of 98 float32 (unit layers.2, backward "
                    "prefetch) of group world while ranks 0, 1 and 3 ",
                    alone_finished ? "did not" : "did")))
        << Text(d);
    EXPECT_THAT(Text(d), Not(HasSubstr("suspect: rank 0")));
    EXPECT_THAT(Text(d), Not(HasSubstr("suspect: ranks 0, 1 and 3")));
  }
}

TEST(DiagnoseTest, TheNewestDumpOfARankWins) {
  const std::string dir = Dir("newest");
  FlightRecorderOptions options;
  options.trace_dir = dir;
  auto old_rec = FlightRecorder::Create(0, 1, "sim", options);
  ASSERT_TRUE(old_rec->Dump("old").ok());
  auto new_rec = FlightRecorder::Create(0, 1, "sim", options);
  FLATPARAM_ASSERT_OK_AND_ASSIGN(std::string path, new_rec->Dump("new"));
  std::vector<std::string> ignored;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(std::vector<FlightDump> dumps,
                                 ReadFlightDumps(dir, &ignored));
  ASSERT_EQ(dumps.size(), 1u);
  EXPECT_EQ(dumps[0].reason, "new");
  EXPECT_THAT(ignored, ElementsAre(dir + "/rank_0.json"));
}

TEST(DiagnoseTest, BadFilesAreErrorsNamingThem) {
  EXPECT_THAT(ReadFlightDumps(Dir("no such dir")),
              StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(ParseFlightDump("{", "x.json"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("x.json:1:2: malformed JSON")));
  EXPECT_THAT(ParseFlightDump(R"({"format": "other", "version": 1})", "y"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("expected a flatparam.flight version 1")));
  // A real dump with one field broken.
  FlightRecorderOptions options;
  auto rec = FlightRecorder::Create(0, 2, "sim", options);
  auto world = std::make_shared<FlightGroup>(FlightGroup{"world", {0, 1}});
  rec->Enqueue(world, 0, CollectiveOp::kBarrier, DType::kFloat32, 0, 0);
  std::string text = rec->ToJson("t");
  FLATPARAM_ASSERT_OK(ParseFlightDump(text, "z").status());
  const size_t at = text.find("\"state\": \"enqueued\"");
  ASSERT_NE(at, std::string::npos);
  text.replace(at, 19, "\"state\": \"lost\"");
  EXPECT_THAT(ParseFlightDump(text, "z"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("z: entries[0]: state \"lost\"")));
  std::string wrong_rank = rec->ToJson("t");
  const size_t r = wrong_rank.find("\"rank\": 0");
  ASSERT_NE(r, std::string::npos);
  wrong_rank.replace(r, 9, "\"rank\": 7");
  EXPECT_THAT(ParseFlightDump(wrong_rank, "w"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("rank 7 of a world of 2")));
}

}  // namespace
}  // namespace tools
}  // namespace flatparam
