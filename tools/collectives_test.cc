#include "tools/collectives.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "comm/conformance/bandwidth.h"
#include "comm/conformance/device_memory.h"
#include "flatparam/base/status_matchers.h"
#include "nlohmann/json.hpp"
#include "sim/sim.h"
#include "tools/testing/recording_communicator.h"

namespace flatparam {
namespace tools {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Not;

std::string TempPath(const std::string& name) {
  const char* dir = std::getenv("TEST_TMPDIR");
  return absl::StrCat(dir != nullptr ? dir : "/tmp", "/", name);
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// A quick run: no large cases, sizes 1 KiB to 64 KiB.
CollectivesOptions Quick(int world_size, uint64_t seed) {
  CollectivesOptions options;
  options.world_size = world_size;
  options.seed = seed;
  options.large_elements = 0;
  options.max_bytes = 64 << 10;
  auto valid = ValidateCollectivesOptions(options);
  EXPECT_THAT(valid, IsOk());
  return *valid;
}

TEST(CollectivesTest, SimTable) {
  std::ostringstream out;
  ASSERT_THAT(RunCollectivesSim(Quick(4, 1), out), IsOk());
  const std::string table = out.str();
  EXPECT_THAT(table,
              AllOf(HasSubstr("# fsdp collectives: backend sim, 4 ranks, "
                              "seed 1, faults none\n"),
                    HasSubstr(" cases on each of 4 ranks: all correct\n"),
                    HasSubstr("time: virtual"), HasSubstr("vtime(us)"),
                    HasSubstr("algbw(GB/s)"), HasSubstr("busbw(GB/s)"),
                    HasSubstr("#wrong"), HasSubstr("\n# all correct\n")));
  // Sizes 1, 4, 16 and 64 KiB of each op. The virtual time of one
  // all_reduce of 1 KiB on 4 ranks: 10 us + 1024 B x 2(n-1)/n / 100 GB/s.
  int rows = 0;
  for (const char* op : {"all_gather", "reduce_scatter", "all_reduce"}) {
    for (int bytes : {1024, 4096, 16384, 65536}) {
      EXPECT_THAT(table, HasSubstr(absl::StrFormat("  %-14s %12d ", op, bytes)))
          << op << " " << bytes;
      ++rows;
    }
  }
  EXPECT_EQ(rows, 12);
  const double us = 10 + 1024 * 1.5 / 100e9 * 1e6;
  const double algbw = 1024 / (us * 1e-6) / 1e9;
  EXPECT_THAT(table, HasSubstr(absl::StrFormat(
                         "  all_reduce             1024        256 %12.2f "
                         "%12.2f %12.2f       0  correct\n",
                         us, algbw, algbw * 1.5)));
  EXPECT_THAT(table, Not(HasSubstr("WRONG")));
}

// --progress: rank 0 alone names each sweep row on stderr as it starts;
// without it, nothing is printed there.
TEST(CollectivesTest, ProgressNamesEachSweepRowOnce) {
  CollectivesOptions options = Quick(3, 2);
  options.conformance = false;
  options.max_bytes = 4096;
  std::ostringstream out;
  ::testing::internal::CaptureStderr();
  ASSERT_THAT(RunCollectivesSim(options, out), IsOk());
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");
  options.progress = true;
  ::testing::internal::CaptureStderr();
  ASSERT_THAT(RunCollectivesSim(options, out), IsOk());
  EXPECT_EQ(::testing::internal::GetCapturedStderr(),
            "fsdp collectives: sweep row 1 of 6: all_gather, 1024 bytes\n"
            "fsdp collectives: sweep row 2 of 6: all_gather, 4096 bytes\n"
            "fsdp collectives: sweep row 3 of 6: reduce_scatter, 1024 bytes\n"
            "fsdp collectives: sweep row 4 of 6: reduce_scatter, 4096 bytes\n"
            "fsdp collectives: sweep row 5 of 6: all_reduce, 1024 bytes\n"
            "fsdp collectives: sweep row 6 of 6: all_reduce, 4096 bytes\n");
}

TEST(CollectivesTest, SizesRoundDownToWholeElementsPerRank) {
  std::ostringstream out;
  CollectivesOptions options = Quick(3, 2);
  options.conformance = false;
  options.max_bytes = 4096;
  ASSERT_THAT(RunCollectivesSim(options, out), IsOk());
  EXPECT_THAT(out.str(), HasSubstr("conformance: not run"));
  // 3 ranks: all_gather of 1 KiB has 85 floats per rank, 1020 bytes.
  EXPECT_THAT(out.str(), HasSubstr("  all_gather             1020         85"));
  EXPECT_EQ(conformance::CountForBytes(conformance::CollectiveKind::kAllGather,
                                       1024, 3, DType::kFloat32),
            85);
}

TEST(CollectivesTest, EqualSeedsGiveIdenticalTracesAndTables) {
  std::string tables[3];
  std::string traces[3];
  const uint64_t seeds[3] = {5, 5, 6};
  for (int i = 0; i < 3; ++i) {
    CollectivesOptions options = Quick(4, seeds[i]);
    options.trace_path = TempPath(absl::StrCat("trace", i, ".json"));
    std::ostringstream out;
    ASSERT_THAT(RunCollectivesSim(options, out), IsOk());
    tables[i] = out.str();
    traces[i] = ReadFile(options.trace_path);
  }
  EXPECT_FALSE(traces[0].empty());
  EXPECT_EQ(traces[0], traces[1]);
  EXPECT_EQ(tables[0], tables[1]);
  // Another seed: another schedule, still a valid trace of the same calls.
  EXPECT_NE(traces[0], traces[2]);
  for (const std::string& trace : {traces[0], traces[2]}) {
    const nlohmann::json doc = nlohmann::json::parse(trace, nullptr, false);
    ASSERT_FALSE(doc.is_discarded());
    ASSERT_TRUE(doc.contains("traceEvents"));
    int slices = 0;
    for (const auto& e : doc["traceEvents"]) {
      if (e["ph"] == "X") {
        ++slices;
        EXPECT_GE(e["dur"].get<double>(), 0);
      }
    }
    EXPECT_GT(slices, 4 * 1000);
  }
  EXPECT_EQ(nlohmann::json::parse(traces[2])["otherData"]["seed"], 6);
}

TEST(CollectivesTest, AKilledRankFailsFastNamingTheRankAndTheOp) {
  CollectivesOptions options = Quick(8, 3);
  options.faults = "kill:rank=3:op=5";
  options.trace_path = TempPath("killed.json");
  std::ostringstream out;
  const absl::Time start = absl::Now();
  const absl::Status status = RunCollectivesSim(options, out);
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  EXPECT_THAT(status, StatusIs(absl::StatusCode::kAborted,
                               AllOf(HasSubstr("rank 3 died"),
                                     HasSubstr("kill:rank=3:op=5"),
                                     HasSubstr("reduce_scatter #5"))));
  EXPECT_EQ(out.str(), "");
  // The trace is written anyway, with the failed collectives in it.
  EXPECT_THAT(ReadFile(options.trace_path), HasSubstr("killed by fault"));
}

TEST(CollectivesTest, AFlippedBitIsCaught) {
  CollectivesOptions options = Quick(4, 3);
  options.conformance = false;
  // Op 0 is the first sweep size's barrier; op 1 its all_gather.
  options.faults = "flip:rank=2:op=1:bit=3";
  std::ostringstream out;
  EXPECT_THAT(RunCollectivesSim(options, out),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("rank 2")));
}

TEST(CollectivesTest, WithoutChecksumsAFlippedBitIsAWrongElement) {
  CollectivesOptions options = Quick(4, 3);
  options.conformance = false;
  options.checksum = false;
  options.faults = "flip:rank=2:op=1:bit=3";
  std::ostringstream out;
  // Rank 2's block reaches the three other ranks with one bit flipped.
  EXPECT_THAT(RunCollectivesSim(options, out),
              StatusIs(absl::StatusCode::kInternal,
                       HasSubstr("1 sweep row(s) had 3 wrong element(s)")));
  EXPECT_THAT(
      out.str(),
      AllOf(HasSubstr(
                absl::StrFormat("  %-14s %12d %10d ", "all_gather", 1024, 64)),
            HasSubstr("      3  WRONG\n"), Not(HasSubstr("# all correct"))));
  // And the conformance suite catches it too, naming the case: op 60 is
  // the first with data, an all_gather of one float32 (the 60 before it
  // have count 0).
  options.conformance = true;
  options.sweep = false;
  options.faults = "flip:rank=2:op=60:bit=3";
  out.str("");
  EXPECT_THAT(RunCollectivesSim(options, out),
              StatusIs(absl::StatusCode::kInternal,
                       HasSubstr("conformance case(s) failed")));
  EXPECT_THAT(out.str(),
              AllOf(HasSubstr("3 FAILED"), HasSubstr("elements differ")));
}

TEST(CollectivesTest, WrongElementsFailTheVerdict) {
  CollectivesReport report;
  report.backend = "sim";
  report.world_size = 2;
  EXPECT_THAT(CollectivesVerdict(report), IsOk());
  SweepRow row;
  row.bytes = 1024;
  row.count = 128;
  row.wrong = 3;
  report.rows.push_back(row);
  EXPECT_THAT(CollectivesVerdict(report),
              StatusIs(absl::StatusCode::kInternal,
                       HasSubstr("1 sweep row(s) had 3 wrong element(s)")));
  std::ostringstream out;
  PrintCollectivesReport(report, Quick(2, 0), out);
  EXPECT_THAT(out.str(),
              AllOf(HasSubstr("3  WRONG\n"), Not(HasSubstr("# all correct"))));
  report.rows.clear();
  report.failed = 2;
  EXPECT_THAT(CollectivesVerdict(report),
              StatusIs(absl::StatusCode::kInternal,
                       HasSubstr("2 conformance case(s) failed")));
}

TEST(CollectivesTest, InvalidOptionsNameTheFlag) {
  CollectivesOptions options;
  options.backend = "gloo";
  EXPECT_THAT(ValidateCollectivesOptions(options),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("--backend=gloo")));
  options.backend = "mpi";
  options.faults = "kill:rank=1:op=1";
  EXPECT_THAT(ValidateCollectivesOptions(options),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("--fault=kill:rank=1:op=1 needs "
                                 "--backend=sim")));
  options.faults.clear();
  options.trace_path = "t.json";
  EXPECT_THAT(ValidateCollectivesOptions(options),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("--trace=t.json needs --backend=sim")));
  options = CollectivesOptions();
  options.min_bytes = 4096;
  options.max_bytes = 1024;
  EXPECT_THAT(ValidateCollectivesOptions(options),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("--max-bytes=1024")));
  options = CollectivesOptions();
  options.world_size = 0;
  EXPECT_THAT(ValidateCollectivesOptions(options),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("--world-size=0")));
  options = CollectivesOptions();
  options.dtype = DType::kInt32;
  EXPECT_THAT(
      ValidateCollectivesOptions(options),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--dtype=int32")));
  options = CollectivesOptions();
  options.step_factor = 1;
  EXPECT_THAT(ValidateCollectivesOptions(options),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("--step-factor=1")));
  // Defaults per backend.
  options = CollectivesOptions();
  auto sim = ValidateCollectivesOptions(options);
  ASSERT_THAT(sim, IsOk());
  EXPECT_EQ(sim->iterations, 1);
  EXPECT_EQ(sim->warmup, 0);
  options.backend = "mpi";
  auto mpi = ValidateCollectivesOptions(options);
  ASSERT_THAT(mpi, IsOk());
  EXPECT_EQ(mpi->iterations, 10);
  EXPECT_EQ(mpi->warmup, 2);
}

TEST(CollectivesTest, ATimeoutThatIsNotPositiveIsRejected) {
  const struct {
    absl::Duration timeout;
    const char* named;
  } cases[] = {
      {absl::ZeroDuration(), "--timeout=0: "},
      {absl::Seconds(-5), "--timeout=-5s: "},
      {absl::InfiniteDuration(), "--timeout=inf: "},
  };
  for (const auto& c : cases) {
    CollectivesOptions options;
    options.timeout = c.timeout;
    EXPECT_THAT(ValidateCollectivesOptions(options),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         AllOf(HasSubstr(c.named),
                               HasSubstr("positive, finite duration"))));
  }
  CollectivesOptions options;
  EXPECT_EQ(options.timeout, conformance::kCaseTimeout);
  options.timeout = absl::Milliseconds(1);
  EXPECT_THAT(ValidateCollectivesOptions(options), IsOk());
}

// Every collective of the command (the conformance cases, including those on
// the groups its splits make, the sweep and the summaries' gathers) gets
// the options' timeout.
TEST(CollectivesTest, TheTimeoutReachesEveryCollective) {
  CollectivesOptions options = Quick(4, 2);
  options.max_bytes = 4096;
  options.timeout = absl::Seconds(7);
  SimOptions sim;
  sim.world_size = 4;
  std::unique_ptr<SimWorld> world = *SimWorld::Create(sim);
  std::vector<std::vector<RecordedCall>> logs(sim.world_size);
  ASSERT_THAT(world->Run([&](SimCommunicator& comm) -> absl::Status {
    RecordingCommunicator recording(&comm, &logs[comm.world_rank()]);
    const Clock clock = [&comm] { return comm.Now(); };
    return RunCollectivesOnRank(recording, conformance::HostMemory(), options,
                                clock)
        .status();
  }),
              IsOk());
  for (int r = 0; r < sim.world_size; ++r) {
    SCOPED_TRACE(absl::StrCat("rank ", r));
    std::set<std::string> ops;
    for (const RecordedCall& call : logs[r]) ops.insert(call.op);
    EXPECT_THAT(ops,
                ElementsAre("all_gather", "all_gather_bytes", "all_reduce",
                            "barrier", "broadcast", "reduce_scatter", "split"));
    EXPECT_THAT(CallsWithOtherTimeouts(logs[r], absl::Seconds(7)), IsEmpty());
  }
}

// A rank that arrives 2 s late (virtual time) at its collective K fails the
// run when the timeout is 1 s, naming the op and the late rank, and does
// not when it is 10 s: the timeout reaches the conformance cases (K = 3)
// and the sweep's barrier, collective and gather (K = 3, 4, 5: the second
// size's).
TEST(CollectivesTest, ARankLateByMoreThanTheTimeoutFailsTheRun) {
  const struct {
    bool conformance;
    int op;
    const char* named;
  } cases[] = {
      {true, 3, " #3 in group 0: timed out"},
      {false, 3, "barrier #3 in group 0: timed out"},
      {false, 4, "all_gather #4 in group 0: timed out"},
      {false, 5, "all_gather_bytes #5 in group 0: timed out"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(absl::StrCat("conformance ", c.conformance, ", op ", c.op));
    CollectivesOptions options = Quick(4, 3);
    options.conformance = c.conformance;
    options.sweep = !c.conformance;
    options.max_bytes = 4096;
    options.faults = absl::StrCat("delay:rank=1:seconds=2:op=", c.op);
    options.timeout = absl::Seconds(1);
    std::ostringstream out;
    const absl::Time start = absl::Now();
    EXPECT_THAT(RunCollectivesSim(options, out),
                StatusIs(absl::StatusCode::kDeadlineExceeded,
                         AllOf(HasSubstr("rank 0: "), HasSubstr(c.named),
                               HasSubstr("with a timeout of 1s"),
                               HasSubstr("when rank 1 was ready"))));
    EXPECT_LT(absl::Now() - start, absl::Seconds(10));
    EXPECT_EQ(out.str(), "");
    options.timeout = absl::Seconds(10);
    EXPECT_THAT(RunCollectivesSim(options, out), IsOk());
  }
}

TEST(CollectivesTest, BadFaultSpecsAreReported) {
  CollectivesOptions options = Quick(4, 0);
  options.faults = "kill:rank=9:op=1";
  std::ostringstream out;
  EXPECT_THAT(RunCollectivesSim(options, out),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("9")));
  options.faults = "explode:rank=1";
  EXPECT_THAT(
      RunCollectivesSim(options, out),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("explode")));
}

}  // namespace
}  // namespace tools
}  // namespace flatparam
