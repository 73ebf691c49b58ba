#include "comm/flight_recorder.h"

#include <dirent.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "comm/communicator.h"
#include "flatparam/base/dtype.h"
#include "flatparam/base/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace flatparam {
namespace {

using ::testing::HasSubstr;

std::string TempDir(const std::string& name) {
  const char* base = std::getenv("TEST_TMPDIR");
  return absl::StrCat(base != nullptr ? base : "/tmp", "/", name);
}

nlohmann::json ReadJson(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return nlohmann::json::parse(text.str());
}

std::shared_ptr<const FlightGroup> World(int size) {
  auto g = std::make_shared<FlightGroup>();
  g->id = "world";
  for (int r = 0; r < size; ++r) g->ranks.push_back(r);
  return g;
}

TEST(FlightRecorderTest, RecordsStatesAndContext) {
  FlightRecorderOptions options;
  options.capacity = 8;
  auto rec = FlightRecorder::Create(1, 4, "test", options);
  const auto world = World(4);
  uint64_t a = 0;
  {
    ScopedCollectiveContext ctx(rec.get(),
                                {"h.2", 3, CollectivePhase::kForwardUnshard});
    a = rec->Enqueue(world, 0, CollectiveOp::kAllGather, DType::kBFloat16, 10,
                     20);
  }
  const uint64_t b =
      rec->Enqueue(world, 1, CollectiveOp::kBarrier, DType::kFloat32, 0, 0);
  rec->Started(a);
  rec->Finished(a, absl::OkStatus());
  rec->Finished(b, absl::DeadlineExceededError("rank 2 did not reach"));
  const std::vector<FlightEntry> entries = rec->Snapshot();
  ASSERT_EQ(entries.size(), 2u);
  EXPECT_EQ(entries[0].context.unit, "h.2");
  EXPECT_EQ(entries[0].context.handle, 3);
  EXPECT_EQ(entries[0].context.phase, CollectivePhase::kForwardUnshard);
  EXPECT_EQ(entries[0].state, FlightState::kCompleted);
  EXPECT_TRUE(entries[0].has_dtype);
  EXPECT_GT(entries[0].started_ns, 0);
  EXPECT_GE(entries[0].finished_ns, entries[0].started_ns);
  // The scope ended: the barrier has no context.
  EXPECT_EQ(entries[1].context.unit, "");
  EXPECT_EQ(entries[1].state, FlightState::kFailed);
  EXPECT_FALSE(entries[1].has_dtype);
  EXPECT_EQ(entries[1].error, "rank 2 did not reach");
  EXPECT_EQ(entries[1].started_ns, 0);
}

TEST(FlightRecorderTest, RingKeepsTheNewest) {
  FlightRecorderOptions options;
  options.capacity = 3;
  auto rec = FlightRecorder::Create(0, 1, "test", options);
  const auto world = World(1);
  std::vector<uint64_t> ids;
  for (int i = 0; i < 5; ++i) {
    ids.push_back(rec->Enqueue(world, i, CollectiveOp::kAllReduce,
                               DType::kFloat32, i, 4 * i));
  }
  // The first two were dropped: marking them is ignored.
  rec->Finished(ids[0], absl::OkStatus());
  rec->Finished(ids[4], absl::OkStatus());
  const std::vector<FlightEntry> entries = rec->Snapshot();
  ASSERT_EQ(entries.size(), 3u);
  EXPECT_EQ(entries[0].seq, 2);
  EXPECT_EQ(entries[2].seq, 4);
  EXPECT_EQ(entries[0].state, FlightState::kEnqueued);
  EXPECT_EQ(entries[2].state, FlightState::kCompleted);
  EXPECT_EQ(rec->recorded(), 5u);
}

TEST(FlightRecorderTest, ZeroCapacityRecordsNothing) {
  FlightRecorderOptions options;
  options.capacity = 0;
  auto rec = FlightRecorder::Create(0, 1, "test", options);
  EXPECT_EQ(
      rec->Enqueue(World(1), 0, CollectiveOp::kBarrier, DType::kFloat32, 0, 0),
      0u);
  rec->Finished(0, absl::OkStatus());
  EXPECT_TRUE(rec->Snapshot().empty());
}

TEST(FlightRecorderTest, FailureDumpsOnceInTheDocumentedFormat) {
  FlightRecorderOptions options;
  options.trace_dir = TempDir("failure/nested");
  auto rec = FlightRecorder::Create(2, 4, "test", options);
  const auto world = World(4);
  {
    ScopedCollectiveContext ctx(
        rec.get(), {"h.0", 1, CollectivePhase::kPostBackwardReduce});
    const uint64_t id = rec->Enqueue(world, 7, CollectiveOp::kReduceScatter,
                                     DType::kFloat32, 5, 80);
    rec->Finished(id, absl::DeadlineExceededError("timed out; rank 3"));
  }
  const std::string path = options.trace_dir + "/rank_2.json";
  const nlohmann::json j = ReadJson(path);
  EXPECT_EQ(j["format"], "flatparam.flight");
  EXPECT_EQ(j["version"], 1);
  EXPECT_EQ(j["rank"], 2);
  EXPECT_EQ(j["world_size"], 4);
  EXPECT_EQ(j["backend"], "test");
  EXPECT_THAT(j["reason"].get<std::string>(), HasSubstr("timed out; rank 3"));
  ASSERT_EQ(j["groups"].size(), 1u);
  EXPECT_EQ(j["groups"][0]["id"], "world");
  EXPECT_EQ(j["groups"][0]["ranks"], nlohmann::json({0, 1, 2, 3}));
  ASSERT_EQ(j["entries"].size(), 1u);
  const nlohmann::json& e = j["entries"][0];
  EXPECT_EQ(e["op"], "reduce_scatter");
  EXPECT_EQ(e["seq"], 7);
  EXPECT_EQ(e["dtype"], "float32");
  EXPECT_EQ(e["count"], 5);
  EXPECT_EQ(e["bytes"], 80);
  EXPECT_EQ(e["unit"], "h.0");
  EXPECT_EQ(e["handle"], 1);
  EXPECT_EQ(e["phase"], "post-backward reduce");
  EXPECT_EQ(e["state"], "failed");
  EXPECT_EQ(e["error"], "timed out; rank 3");
  // Only the first failure dumps: a second one leaves the file as it was.
  const uint64_t id =
      rec->Enqueue(world, 8, CollectiveOp::kBarrier, DType::kFloat32, 0, 0);
  rec->Finished(id, absl::AbortedError("later"));
  EXPECT_EQ(ReadJson(path)["entries"].size(), 1u);
}

TEST(FlightRecorderTest, NeverReplacesAFileItDidNotWrite) {
  FlightRecorderOptions options;
  options.trace_dir = TempDir("existing");
  ASSERT_EQ(mkdir(options.trace_dir.c_str(), 0777), 0);
  const std::string theirs = options.trace_dir + "/rank_0.json";
  std::ofstream(theirs) << "not ours";
  auto rec = FlightRecorder::Create(0, 1, "test", options);
  FLATPARAM_ASSERT_OK_AND_ASSIGN(std::string path, rec->Dump("asked"));
  EXPECT_EQ(path,
            absl::StrCat(options.trace_dir, "/rank_0.", getpid(), ".json"));
  std::ifstream in(theirs);
  std::string text;
  std::getline(in, text);
  EXPECT_EQ(text, "not ours");
  // Its own file it does replace.
  FLATPARAM_ASSERT_OK_AND_ASSIGN(std::string again, rec->Dump("again"));
  EXPECT_EQ(again, path);
  EXPECT_EQ(ReadJson(path)["reason"], "again");
  // A leftover with this process's pid too (pids are reused): a third name,
  // and both files stay as they were.
  auto other = FlightRecorder::Create(0, 1, "test", options);
  FLATPARAM_ASSERT_OK_AND_ASSIGN(std::string third, other->Dump("third"));
  EXPECT_EQ(third,
            absl::StrCat(options.trace_dir, "/rank_0.", getpid(), ".1.json"));
  EXPECT_EQ(ReadJson(path)["reason"], "again");
  EXPECT_EQ(ReadJson(third)["reason"], "third");
  std::ifstream in2(theirs);
  std::getline(in2, text);
  EXPECT_EQ(text, "not ours");
  // No temporary file is left behind.
  int files = 0;
  DIR* dir = opendir(options.trace_dir.c_str());
  while (const dirent* e = readdir(dir)) files += e->d_name[0] != '.';
  closedir(dir);
  EXPECT_EQ(files, 3);
}

TEST(FlightRecorderTest, AnUnwritableTraceDirIsAnErrorNotACrash) {
  FlightRecorderOptions options;
  options.trace_dir = TempDir("file") + "/not-a-dir";
  std::ofstream(TempDir("file")) << "a file";
  auto rec = FlightRecorder::Create(0, 1, "test", options);
  EXPECT_FALSE(rec->Dump("asked").ok());
}

TEST(FlightRecorderTest, DumpWithoutTraceDirIsAnError) {
  auto rec = FlightRecorder::Create(0, 1, "test", FlightRecorderOptions{});
  EXPECT_THAT(rec->Dump("x"), StatusIs(absl::StatusCode::kFailedPrecondition,
                                       HasSubstr("FLATPARAM_TRACE_DIR")));
}

TEST(FlightRecorderTest, SigusrOneDumpsEveryRecorderAndTheProcessGoesOn) {
  FlightRecorderOptions options;
  options.trace_dir = TempDir("sigusr1");
  auto a = FlightRecorder::Create(0, 2, "test", options);
  auto b = FlightRecorder::Create(1, 2, "test", options);
  // Recorders without a trace dir are left out.
  auto c = FlightRecorder::Create(5, 6, "test", FlightRecorderOptions{});
  a->Enqueue(World(2), 0, CollectiveOp::kAllGather, DType::kFloat32, 1, 8);
  FLATPARAM_ASSERT_OK(InstallFlightRecorderSignal());
  ASSERT_EQ(kill(getpid(), SIGUSR1), 0);
  const std::string pa = options.trace_dir + "/rank_0.json";
  const std::string pb = options.trace_dir + "/rank_1.json";
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  struct stat st;
  while ((stat(pa.c_str(), &st) != 0 || stat(pb.c_str(), &st) != 0) &&
         absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  const nlohmann::json ja = ReadJson(pa);
  EXPECT_EQ(ja["reason"], "SIGUSR1");
  EXPECT_EQ(ja["entries"].size(), 1u);
  EXPECT_EQ(ReadJson(pb)["rank"], 1);
  EXPECT_EQ(stat((options.trace_dir + "/rank_5.json").c_str(), &st), -1);
}

TEST(FlightRecorderTest, AProgramsOwnSigusrOneHandlerIsKept) {
  // "threadsafe" death tests re-run this test in a fresh process, where no
  // earlier test has installed the recorder's handler.
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        struct sigaction action {};
        action.sa_handler = [](int) {};
        sigemptyset(&action.sa_mask);
        sigaction(SIGUSR1, &action, nullptr);
        const absl::Status s = InstallFlightRecorderSignal();
        struct sigaction now {};
        sigaction(SIGUSR1, nullptr, &now);
        std::exit(absl::IsFailedPrecondition(s) &&
                          now.sa_handler == action.sa_handler
                      ? 0
                      : 1);
      },
      ::testing::ExitedWithCode(0), "");
}

TEST(FlightRecorderTest, SigtermDumpsThenEndsTheProcessAsSigtermDoes) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const std::string dir = TempDir("sigterm");
  EXPECT_EXIT(
      {
        FlightRecorderOptions options;
        options.trace_dir = dir;
        auto rec = FlightRecorder::Create(3, 4, "test", options);
        rec->Enqueue(World(4), 9, CollectiveOp::kAllGather, DType::kFloat32, 1,
                     4);
        kill(getpid(), SIGTERM);
        for (;;) pause();
      },
      ::testing::KilledBySignal(SIGTERM), "rank_3.json");
  const nlohmann::json j = ReadJson(dir + "/rank_3.json");
  EXPECT_THAT(j["reason"].get<std::string>(), HasSubstr("SIGTERM"));
  EXPECT_EQ(j["entries"][0]["state"], "enqueued");
}

TEST(FlightRecorderTest, ConcurrentMarksAndDumpsAreSafe) {
  FlightRecorderOptions options;
  options.capacity = 64;
  options.trace_dir = TempDir("concurrent");
  auto rec = FlightRecorder::Create(0, 1, "test", options);
  const auto world = World(1);
  std::thread dumper([&] {
    for (int i = 0; i < 50; ++i)
      FLATPARAM_ASSERT_OK(rec->Dump("loop").status());
  });
  for (int i = 0; i < 1000; ++i) {
    const uint64_t id =
        rec->Enqueue(world, i, CollectiveOp::kAllReduce, DType::kFloat32, 1, 4);
    std::thread marker([&] {
      rec->Started(id);
      rec->Finished(id, absl::OkStatus());
    });
    marker.join();
  }
  dumper.join();
  EXPECT_EQ(rec->Snapshot().back().state, FlightState::kCompleted);
}

TEST(FlightRecorderTest, SplitGroupIdsAgreeAcrossRanks) {
  EXPECT_EQ(SplitGroupId("world", 3, 1), "world/split3:1");
  EXPECT_EQ(SplitGroupId(SplitGroupId("world", 3, 1), 0, 0),
            "world/split3:1/split0:0");
}

}  // namespace
}  // namespace flatparam
