#include "tools/train.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <array>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "comm/communicator.h"
#include "flatparam/base/status_matchers.h"
#include "flatparam/device/device.h"
#include "flatparam/memory_stats.h"
#include "flatparam/runtime.h"
#include "refmodel/fsdp_trainer.h"
#include "refmodel/reference_trainer.h"
#include "sim/fault.h"
#include "sim/sim.h"
#include "tools/testing/recording_communicator.h"

namespace flatparam {
namespace tools {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::IsSupersetOf;
using ::testing::Not;

TrainCommandOptions Options(const std::string& strategy, int world = 8) {
  TrainCommandOptions o;
  o.strategy = strategy;
  o.world_size = world;
  o.steps = 2;
  o.check_reference = true;
  return o;
}

// The command core on the simulator: bitwise equal in float32 for every
// strategy, with the memory formula.
TEST(RunTrainSimTest, EveryStrategyIsBitwiseEqual) {
  for (const char* strategy : {"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD",
                               "HYBRID_SHARD", "HYBRID_SHARD_ZERO2"}) {
    SCOPED_TRACE(strategy);
    TrainCommandOptions o = Options(strategy);
    o.micro_batches = 2;
    o.align_addresses = true;
    std::ostringstream out;
    EXPECT_THAT(RunTrainSim(o, out), IsOk());
    const std::string text = out.str();
    EXPECT_THAT(text,
                HasSubstr(absl::StrCat("backend sim, 8 ranks, ", strategy)));
    EXPECT_THAT(text, HasSubstr("against single-process training: 0 "));
    EXPECT_THAT(text, HasSubstr("; bitwise equal\n"));
    EXPECT_THAT(text, HasSubstr("every rank matches it"));
    EXPECT_THAT(text, HasSubstr("# check: passed\n"));
    EXPECT_THAT(text, HasSubstr("\n   1  "));  // The second step's loss.
  }
}

TEST(RunTrainSimTest, MixedPrecisionIsBitwiseToItsEmulationAndWithinBound) {
  TrainCommandOptions o = Options("HYBRID_SHARD", 6);
  o.shard_group_size = 3;
  o.mixed_precision = "bf16";
  o.cpu_offload = true;
  o.micro_batches = 2;
  o.no_sync = true;
  std::ostringstream out;
  EXPECT_THAT(RunTrainSim(o, out), IsOk());
  EXPECT_THAT(out.str(), HasSubstr("(bfloat16 emulated): 0 "));
  EXPECT_THAT(out.str(), HasSubstr("bitwise equal"));
  EXPECT_THAT(out.str(), HasSubstr("float32 single-process training: "));
  EXPECT_THAT(out.str(), HasSubstr(", within the bound "));
  EXPECT_THAT(out.str(), HasSubstr("shard groups of 3 ranks, 2 replicas"));
}

TEST(RunTrainSimTest, WithoutCheckPrintsNoVerdict) {
  TrainCommandOptions o = Options("SHARD_GRAD_OP", 2);
  o.check_reference = false;
  std::ostringstream out;
  EXPECT_THAT(RunTrainSim(o, out), IsOk());
  EXPECT_THAT(out.str(), Not(HasSubstr("# check")));
  EXPECT_THAT(out.str(), HasSubstr("formula "));
}

// --log-every: rank 0 alone prints every N-th step's loss to stderr, the
// same loss as the report's table; the report itself is unchanged.
TEST(RunTrainSimTest, LogEveryPrintsEveryNthStepsLossOnce) {
  TrainCommandOptions o = Options("FULL_SHARD", 4);
  o.check_reference = false;
  o.steps = 5;
  std::ostringstream quiet;
  ASSERT_THAT(RunTrainSim(o, quiet), IsOk());
  o.log_every = 2;
  std::ostringstream out;
  ::testing::internal::CaptureStderr();
  const absl::Status status = RunTrainSim(o, out);
  const std::string log = ::testing::internal::GetCapturedStderr();
  ASSERT_THAT(status, IsOk());
  EXPECT_EQ(out.str(), quiet.str());
  std::vector<std::string> lines = absl::StrSplit(log, '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 2) << log;
  for (int i = 0; i < 2; ++i) {
    const int step = 1 + 2 * i;  // After the 2nd and the 4th step.
    const std::string prefix =
        absl::StrFormat("fsdp train: step %d loss ", step);
    ASSERT_TRUE(absl::StartsWith(lines[i], prefix)) << lines[i];
    const size_t paren = lines[i].rfind(" (");
    ASSERT_NE(paren, std::string::npos) << lines[i];
    const std::string value =
        lines[i].substr(prefix.size(), paren - prefix.size());
    EXPECT_THAT(out.str(),
                HasSubstr(absl::StrFormat("\n%4d  %s\n", step, value)));
    EXPECT_THAT(lines[i], HasSubstr(" elapsed)"));
  }
  o.log_every = -1;
  EXPECT_THAT(RunTrainSim(o, out),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("--log-every=-1: must be >= 0")));
}

// A result that is off by one bit fails the check, and the verdict says so.
TEST(CheckAgainstReferenceTest, FailsOnAnyDifference) {
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      refmodel::FsdpTrainOptions options,
      MakeFsdpTrainOptions(Options("FULL_SHARD"), 8));
  FLATPARAM_ASSERT_OK_AND_ASSIGN(refmodel::TrainOptions ref,
                                 refmodel::ReferenceOptionsFor(options, 8));
  FLATPARAM_ASSERT_OK_AND_ASSIGN(refmodel::TrainResult want,
                                 refmodel::TrainReference(options.model, ref));
  refmodel::FsdpRankResult result;
  result.losses = want.losses;
  result.params = want.params;
  result.optimizer_state = want.optimizer_state;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      ReferenceCheck same, CheckAgainstReference(options, 8, /*exact=*/true,
                                                 result, std::nullopt, {}));
  EXPECT_TRUE(same.passed);
  EXPECT_TRUE(same.bitwise_equal);
  EXPECT_EQ(same.max_abs_diff, 0);

  result.params.at("head.bias").data_as<uint32_t>()[3] ^= 1;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      ReferenceCheck off, CheckAgainstReference(options, 8, /*exact=*/true,
                                                result, std::nullopt, {}));
  EXPECT_FALSE(off.passed);
  EXPECT_FALSE(off.bitwise_equal);
  EXPECT_GT(off.max_abs_diff, 0);
  TrainReport report;
  report.check = off;
  EXPECT_THAT(TrainVerdict(report),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("not bitwise equal to single-process "
                                 "training")));
  std::ostringstream out;
  report.options = options;
  report.world_size = 8;
  PrintTrainReport(report, out);
  EXPECT_THAT(out.str(), HasSubstr("NOT bitwise equal"));
  EXPECT_THAT(out.str(), HasSubstr("# check: FAILED"));

  // A backend that reduces in its own order (NCCL) passes within the AdamW
  // bound, and fails outside it.
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      ReferenceCheck inexact, CheckAgainstReference(options, 8, /*exact=*/false,
                                                    result, std::nullopt, {}));
  EXPECT_TRUE(inexact.passed);
  EXPECT_FALSE(inexact.bitwise_equal);
  ASSERT_TRUE(inexact.inexact_bound.has_value());
  result.params.at("head.bias").data_as<float>()[3] += 1.0f;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      inexact, CheckAgainstReference(options, 8, /*exact=*/false, result,
                                     std::nullopt, {}));
  EXPECT_FALSE(inexact.passed);
  report.check = inexact;
  EXPECT_THAT(TrainVerdict(report),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("more than the bound")));

  // A peak that differs from the formula fails too.
  result.params = want.params;
  std::array<int64_t, kNumMemoryCategories> formula{};
  RankSummary rank;
  rank.memory.peak[0] = 1;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      ReferenceCheck memory, CheckAgainstReference(options, 8, /*exact=*/true,
                                                   result, formula, {rank}));
  EXPECT_FALSE(memory.passed);
  EXPECT_EQ(memory.memory_formula_holds, false);
}

TEST(MakeFsdpTrainOptionsTest, ResolvesDefaults) {
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      refmodel::FsdpTrainOptions o,
      MakeFsdpTrainOptions(Options("HYBRID_SHARD"), 8));
  // The same default as every subcommand's (DefaultShardGroupSize).
  EXPECT_EQ(o.shard_group_size, 8);
  EXPECT_EQ(o.global_batch, 16);
  EXPECT_EQ(o.steps, 2);
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      o, MakeFsdpTrainOptions(Options("HYBRID_SHARD_ZERO2", 3), 3));
  EXPECT_EQ(o.shard_group_size, 3);
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      o, MakeFsdpTrainOptions(Options("HYBRID_SHARD"), 16));
  EXPECT_EQ(o.shard_group_size, 8);
  TrainCommandOptions c = Options("FULL_SHARD");
  c.mixed_precision = "fp16";
  c.optimizer = "sgd";
  c.lr = 0.5;
  c.no_sync = true;
  c.seed = 9;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(o, MakeFsdpTrainOptions(c, 8));
  EXPECT_EQ(o.param_dtype, DType::kFloat16);
  EXPECT_EQ(std::get<refmodel::SgdOptions>(o.optimizer).lr, 0.5);
  EXPECT_EQ(o.accumulation, refmodel::AccumulationMode::kNoSync);
  EXPECT_EQ(o.model.seed, 9u);
  EXPECT_EQ(o.data_seed, 9u);
}

TEST(MakeFsdpTrainOptionsTest, NamesTheInconsistentFlag) {
  TrainCommandOptions c = Options("HYBRID_SHARD");
  c.shard_group_size = 3;
  EXPECT_THAT(MakeFsdpTrainOptions(c, 8),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("--shard-group-size=3 must divide the world "
                                 "size 8")));
  c.strategy = "NO_SHARD";
  EXPECT_THAT(MakeFsdpTrainOptions(c, 8),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("only for HYBRID_SHARD")));
  c = Options("FULL_SHARD");
  c.global_batch = 12;
  EXPECT_THAT(MakeFsdpTrainOptions(c, 8),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("--global-batch=12 must be a multiple")));
  for (auto [field, value] :
       {std::pair<std::string, std::string>{"strategy", "ZERO3"},
        {"mixed_precision", "fp8"},
        {"optimizer", "adam"},
        {"backend", "gloo"}}) {
    c = Options("FULL_SHARD");
    if (field == "strategy") c.strategy = value;
    if (field == "mixed_precision") c.mixed_precision = value;
    if (field == "optimizer") c.optimizer = value;
    if (field == "backend") c.backend = value;
    EXPECT_THAT(ValidateTrainCommandOptions(c),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(value)))
        << field;
  }
  c = Options("FULL_SHARD");
  c.steps = 0;
  EXPECT_THAT(
      ValidateTrainCommandOptions(c),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--steps=0")));
}

TEST(MakeFsdpTrainOptionsTest, PrefetchFlags) {
  TrainCommandOptions c = Options("FULL_SHARD");
  FLATPARAM_ASSERT_OK_AND_ASSIGN(refmodel::FsdpTrainOptions o,
                                 MakeFsdpTrainOptions(c, 8));
  // PyTorch's defaults.
  EXPECT_EQ(o.backward_prefetch, BackwardPrefetch::kBackwardPre);
  EXPECT_FALSE(o.forward_prefetch);
  EXPECT_EQ(o.prefetch_depth, 1);
  EXPECT_EQ(o.limit_all_gathers, 2);
  c.backward_prefetch = "post";
  c.forward_prefetch = true;
  c.prefetch_depth = 3;
  c.limit_all_gathers = 0;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(o, MakeFsdpTrainOptions(c, 8));
  EXPECT_EQ(o.backward_prefetch, BackwardPrefetch::kBackwardPost);
  EXPECT_TRUE(o.forward_prefetch);
  EXPECT_EQ(o.prefetch_depth, 3);
  EXPECT_EQ(o.limit_all_gathers, 0);
  c.backward_prefetch = "none";
  FLATPARAM_ASSERT_OK_AND_ASSIGN(o, MakeFsdpTrainOptions(c, 8));
  EXPECT_EQ(o.backward_prefetch, BackwardPrefetch::kNone);

  c = Options("FULL_SHARD");
  c.backward_prefetch = "BACKWARD_PRE";
  EXPECT_THAT(ValidateTrainCommandOptions(c),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("--backward-prefetch=BACKWARD_PRE: expected "
                                 "none, pre")));
  c = Options("FULL_SHARD");
  c.prefetch_depth = 0;
  EXPECT_THAT(ValidateTrainCommandOptions(c),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("--prefetch-depth=0: must be in [1, ")));
  c = Options("FULL_SHARD");
  c.limit_all_gathers = -1;
  EXPECT_THAT(ValidateTrainCommandOptions(c),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("--limit-all-gathers=-1: must be in [0, ")));
  c.limit_all_gathers = int64_t{1} << 40;
  EXPECT_THAT(ValidateTrainCommandOptions(c),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("--limit-all-gathers=1099511627776")));
}

// Every prefetch setting trains bitwise equal to single-process training,
// the memory formula follows it, and the header names it.
TEST(RunTrainSimTest, EveryPrefetchSettingIsBitwiseEqual) {
  struct Case {
    const char* backward;
    bool forward;
    int64_t depth, limit;
    const char* header;
  };
  for (const Case& k :
       {Case{"pre", false, 1, 2,
             "; prefetch BACKWARD_PRE (depth 1, limit_all_gathers 2)\n"},
        Case{"none", false, 1, 2, "; prefetch none\n"},
        Case{"post", true, 2, 0,
             "; prefetch forward + BACKWARD_POST (depth 2, "
             "limit_all_gathers 0: unlimited)\n"},
        Case{"none", true, 3, 1,
             "; prefetch forward (depth 3, limit_all_gathers 1)\n"}}) {
    SCOPED_TRACE(k.header);
    TrainCommandOptions o = Options("HYBRID_SHARD", 4);
    o.backward_prefetch = k.backward;
    o.forward_prefetch = k.forward;
    o.prefetch_depth = k.depth;
    o.limit_all_gathers = k.limit;
    o.mixed_precision = "bf16";
    std::ostringstream out;
    EXPECT_THAT(RunTrainSim(o, out), IsOk());
    const std::string text = out.str();
    EXPECT_THAT(text, HasSubstr(k.header));
    EXPECT_THAT(text, HasSubstr("; bitwise equal\n"));
    EXPECT_THAT(text, HasSubstr("every rank matches it"));
    EXPECT_THAT(text, HasSubstr("# check: passed\n"));
  }
}

TEST(MakeFsdpTrainOptionsTest, TheTimeoutIsEveryCollectivesTimeout) {
  TrainCommandOptions c = Options("FULL_SHARD");
  EXPECT_EQ(c.timeout, kDefaultCollectiveTimeout);
  FLATPARAM_ASSERT_OK_AND_ASSIGN(refmodel::FsdpTrainOptions o,
                                 MakeFsdpTrainOptions(c, 8));
  EXPECT_EQ(o.collective_options.timeout, kDefaultCollectiveTimeout);
  c.timeout = absl::Milliseconds(1500);
  FLATPARAM_ASSERT_OK_AND_ASSIGN(o, MakeFsdpTrainOptions(c, 8));
  EXPECT_EQ(o.collective_options.timeout, absl::Milliseconds(1500));
}

TEST(MakeFsdpTrainOptionsTest, ATimeoutThatIsNotPositiveIsRejected) {
  const struct {
    absl::Duration timeout;
    const char* named;
  } cases[] = {
      {absl::ZeroDuration(), "--timeout=0: "},
      {absl::Seconds(-5), "--timeout=-5s: "},
      {absl::InfiniteDuration(), "--timeout=inf: "},
  };
  for (const auto& c : cases) {
    TrainCommandOptions o = Options("FULL_SHARD");
    o.timeout = c.timeout;
    EXPECT_THAT(ValidateTrainCommandOptions(o),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         AllOf(HasSubstr(c.named),
                               HasSubstr("positive, finite duration"))));
    EXPECT_THAT(
        MakeFsdpTrainOptions(o, 8),
        StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(c.named)));
    std::ostringstream out;
    EXPECT_THAT(
        RunTrainSim(o, out),
        StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(c.named)));
  }
}

// RunTrainOnRank on `o.world_size` simulated ranks with `faults`, each
// rank's communicator wrapped in a RecordingCommunicator logging into
// (*logs)[rank]; (*statuses)[rank] is what the rank returned.
absl::Status RunOnRecordedSim(const TrainCommandOptions& o,
                              const std::string& faults,
                              std::vector<std::vector<RecordedCall>>* logs,
                              std::vector<absl::Status>* statuses) {
  SimOptions sim;
  sim.world_size = static_cast<int>(o.world_size);
  sim.seed = o.seed;
  absl::StatusOr<std::vector<FaultSpec>> parsed = ParseFaultSpecs(faults);
  if (!parsed.ok()) return parsed.status();
  sim.faults = *parsed;
  absl::StatusOr<std::unique_ptr<SimWorld>> world = SimWorld::Create(sim);
  if (!world.ok()) return world.status();
  logs->assign(sim.world_size, {});
  const absl::Status status = (*world)->Run([&](SimCommunicator& comm)
                                                -> absl::Status {
    RecordingCommunicator recording(&comm, &(*logs)[comm.world_rank()]);
    HostDeviceOps device;
    return RunTrainOnRank(recording, device, o, /*host_device=*/true).status();
  });
  *statuses = (*world)->rank_statuses();
  return status;
}

std::string TestDir(const std::string& name) {
  const char* dir = std::getenv("TEST_TMPDIR");
  return absl::StrCat(dir != nullptr ? dir : "/tmp", "/", name);
}

// A hybrid run with --save issues every kind of collective the command has
// (the handles' all-gathers, reduce-scatters and replicate all-reduces, the
// group splits, the losses' and results' gathers, the checkpoint's status
// exchanges and the summaries' gather): each gets --timeout.
TEST(RunTrainOnRankTest, TheTimeoutReachesEveryCollective) {
  TrainCommandOptions o = Options("HYBRID_SHARD", 4);
  o.shard_group_size = 2;  // two groups: a replicate all-reduce too
  o.save_dir = TestDir("timeout_ckpt");
  o.timeout = absl::Seconds(7);
  std::vector<std::vector<RecordedCall>> logs;
  std::vector<absl::Status> statuses;
  ASSERT_THAT(RunOnRecordedSim(o, "", &logs, &statuses), IsOk());
  for (size_t r = 0; r < logs.size(); ++r) {
    SCOPED_TRACE(absl::StrCat("rank ", r));
    std::set<std::string> ops;
    for (const RecordedCall& call : logs[r]) ops.insert(call.op);
    EXPECT_THAT(ops, IsSupersetOf({"all_gather", "reduce_scatter", "all_reduce",
                                   "all_gather_bytes", "split"}));
    EXPECT_THAT(CallsWithOtherTimeouts(logs[r], absl::Seconds(7)), IsEmpty());
  }
}

// Rank 1 arrives 2 s late (virtual time) at one of its collectives: with a
// timeout of 1 s a peer fails with DeadlineExceeded naming the op and the
// late rank, and the run fails; with 10 s it passes. Tried at the first
// collective of each kind rank 1 issues, and at its last (the summaries'
// gather), with --save.
TEST(RunTrainOnRankTest, ARankLateByMoreThanTheTimeoutFailsTheRun) {
  TrainCommandOptions o = Options("HYBRID_SHARD", 4);
  o.shard_group_size = 2;  // two groups: a replicate all-reduce too
  o.steps = 1;
  o.check_reference = false;
  o.save_dir = TestDir("late_ckpt");
  std::vector<std::vector<RecordedCall>> logs;
  std::vector<absl::Status> statuses;
  ASSERT_THAT(RunOnRecordedSim(o, "", &logs, &statuses), IsOk());
  const std::vector<RecordedCall>& calls = logs[1];
  ASSERT_FALSE(calls.empty());
  std::map<std::string, size_t> first;
  for (size_t k = 0; k < calls.size(); ++k) first.emplace(calls[k].op, k);
  std::vector<size_t> ops;
  for (const auto& [op, k] : first) ops.push_back(k);
  ops.push_back(calls.size() - 1);
  EXPECT_GE(ops.size(), 6u);
  for (size_t k : ops) {
    SCOPED_TRACE(absl::StrCat("op ", k, ": ", calls[k].op));
    const std::string fault = absl::StrCat("delay:rank=1:seconds=2:op=", k);
    o.timeout = absl::Seconds(1);
    const absl::Time start = absl::Now();
    EXPECT_THAT(RunOnRecordedSim(o, fault, &logs, &statuses), Not(IsOk()));
    EXPECT_LT(absl::Now() - start, absl::Seconds(10));
    bool reported = false;
    for (const absl::Status& s : statuses) {
      reported =
          reported ||
          (s.code() == absl::StatusCode::kDeadlineExceeded &&
           absl::StrContains(s.message(), absl::StrCat(calls[k].op, " #")) &&
           absl::StrContains(s.message(), "with a timeout of 1s") &&
           absl::StrContains(s.message(), "when rank 1 was ready"));
    }
    EXPECT_TRUE(reported) << statuses[0] << "\n" << statuses[1];
    o.timeout = absl::Seconds(10);
    EXPECT_THAT(RunOnRecordedSim(o, fault, &logs, &statuses), IsOk());
  }
}

// Every regular file in `dir` by name, with its bytes.
std::map<std::string, std::string> ReadFiles(const std::string& dir) {
  std::map<std::string, std::string> files;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    if (!entry.is_regular_file()) continue;
    std::ifstream in(entry.path(), std::ios::binary);
    files[entry.path().filename().string()] =
        std::string(std::istreambuf_iterator<char>(in), {});
  }
  return files;
}

// Only the rank tensor files.
std::map<std::string, std::string> RankTensorFiles(const std::string& dir) {
  std::map<std::string, std::string> files = ReadFiles(dir);
  for (auto it = files.begin(); it != files.end();) {
    it = absl::EndsWith(it->first, ".safetensors") ? std::next(it)
                                                   : files.erase(it);
  }
  return files;
}

TrainCommandOptions SaveOptions(const std::string& strategy, int world) {
  TrainCommandOptions o = Options(strategy, world);
  o.steps = 3;
  o.optimizer = "adamw";
  o.seed = 5;
  return o;
}

// Asynchronous saves after every step (each replacing the same directory)
// change nothing: the losses are the same bits as a run with only a final
// synchronous save, the check against single-process training still passes
// bitwise, and the final checkpoint is the same, file for file, byte for
// byte.
TEST(SaveEveryTest, AsyncSavesEveryStepChangeNothing) {
  for (const char* strategy : {"FULL_SHARD", "HYBRID_SHARD"}) {
    SCOPED_TRACE(strategy);
    TrainCommandOptions sync = SaveOptions(strategy, 4);
    sync.save_dir = TestDir(absl::StrCat("final_sync_", strategy));
    FLATPARAM_ASSERT_OK_AND_ASSIGN(TrainReport once, TrainOnSim(sync));
    TrainCommandOptions async = SaveOptions(strategy, 4);
    async.save_dir = TestDir(absl::StrCat("every_async_", strategy));
    async.save_every = 1;
    async.async_save = true;
    FLATPARAM_ASSERT_OK_AND_ASSIGN(TrainReport every, TrainOnSim(async));

    EXPECT_EQ(every.losses, once.losses);
    ASSERT_TRUE(every.check.has_value());
    EXPECT_TRUE(every.check->bitwise_equal);
    EXPECT_TRUE(every.check->passed);
    EXPECT_THAT(once.saved_steps, ElementsAre(3));
    EXPECT_FALSE(once.async_save);
    EXPECT_THAT(every.saved_steps, ElementsAre(1, 2, 3));
    EXPECT_TRUE(every.async_save);
    EXPECT_EQ(every.saved_to, async.save_dir);
    EXPECT_GT(every.save_blocked_total, absl::ZeroDuration());
    EXPECT_GE(every.save_blocked_total, every.save_blocked_max);
    const std::map<std::string, std::string> want = ReadFiles(sync.save_dir);
    EXPECT_TRUE(want.count("manifest.json") == 1 &&
                want.count("rank00001.safetensors") == 1);
    EXPECT_TRUE(ReadFiles(async.save_dir) == want)
        << "the final checkpoints differ";
  }
}

// --save=DIR/step{step} --save-every=2 over 4 steps leaves step2 and step4;
// step2's "extra" describes step 2, so a run loading it for 2 more steps
// passes the check over all 4 steps bitwise and ends in step4's state.
TEST(SaveEveryTest, MidRunCheckpointsResumeExactly) {
  for (bool async : {false, true}) {
    SCOPED_TRACE(async ? "async" : "sync");
    const std::string root =
        TestDir(absl::StrCat("mid_run_", async ? "async" : "sync"));
    std::filesystem::create_directories(root);
    TrainCommandOptions o = SaveOptions("FULL_SHARD", 4);
    o.steps = 4;
    o.check_reference = false;
    o.save_dir = root + "/step{step}";
    o.save_every = 2;
    o.async_save = async;
    FLATPARAM_ASSERT_OK_AND_ASSIGN(TrainReport full, TrainOnSim(o));
    EXPECT_THAT(full.saved_steps, ElementsAre(2, 4));
    EXPECT_EQ(full.saved_to, root + "/step4");
    EXPECT_TRUE(std::filesystem::exists(root + "/step2/manifest.json"));
    EXPECT_TRUE(std::filesystem::exists(root + "/step4/manifest.json"));
    EXPECT_FALSE(std::filesystem::exists(root + "/step1"));
    EXPECT_FALSE(std::filesystem::exists(root + "/step3"));

    TrainCommandOptions resumed = Options("FULL_SHARD", 4);
    resumed.steps = 2;
    resumed.load_dir = root + "/step2";
    resumed.save_dir = root + "/resumed";
    FLATPARAM_ASSERT_OK_AND_ASSIGN(TrainReport rest, TrainOnSim(resumed));
    EXPECT_EQ(rest.options.first_step, 2);
    ASSERT_EQ(rest.history.size(), 1u);
    EXPECT_EQ(rest.history[0].first_step, 0);
    EXPECT_EQ(rest.history[0].steps, 2);
    ASSERT_TRUE(rest.check.has_value());
    EXPECT_TRUE(rest.check->bitwise_equal);
    EXPECT_TRUE(rest.check->passed);
    EXPECT_EQ(rest.losses,
              std::vector<float>(full.losses.begin() + 2, full.losses.end()));
    const std::map<std::string, std::string> want =
        RankTensorFiles(root + "/step4");
    EXPECT_EQ(want.size(), 4u);
    EXPECT_TRUE(RankTensorFiles(root + "/resumed") == want)
        << "resumed training did not end in step4's state";
  }
}

// A save that fails stops training on every rank, naming the directory;
// the save before it is published (with --async-save: finished by the
// failing save's Start).
TEST(SaveEveryTest, AFailedSaveStopsTraining) {
  for (bool async : {false, true}) {
    SCOPED_TRACE(async ? "async" : "sync");
    // The checkpoint of step 2 has no parent directory.
    const std::string root =
        TestDir(absl::StrCat("failed_save_", async ? "async" : "sync"));
    for (const char* parent : {"/p1", "/p3", "/p4"}) {
      std::filesystem::create_directories(root + parent);
    }
    TrainCommandOptions o = SaveOptions("FULL_SHARD", 2);
    o.steps = 4;
    o.save_every = 1;
    o.async_save = async;
    o.save_dir = root + "/p{step}/ckpt";
    std::ostringstream out;
    EXPECT_THAT(
        RunTrainSim(o, out),
        StatusIs(absl::StatusCode::kNotFound,
                 AllOf(HasSubstr(absl::StrCat("rank 0: after step 1: save to ",
                                              root, "/p2/ckpt: ")),
                       HasSubstr("does not exist"))));
    EXPECT_TRUE(std::filesystem::exists(root + "/p1/ckpt/manifest.json"));
    EXPECT_FALSE(std::filesystem::exists(root + "/p3/ckpt"));
  }
}

TEST(SaveEveryTest, FlagErrorsNameTheValues) {
  TrainCommandOptions o = Options("FULL_SHARD");
  o.save_dir = TestDir("flag_errors");
  o.save_every = 0;
  EXPECT_THAT(ValidateTrainCommandOptions(o),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("--save-every=0: must be >= 1")));
  o.save_every = -3;
  EXPECT_THAT(ValidateTrainCommandOptions(o),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("--save-every=-3: must be >= 1")));
  o.save_every = 2;
  o.async_save = true;
  EXPECT_THAT(ValidateTrainCommandOptions(o), IsOk());
  o.save_dir.clear();
  EXPECT_THAT(ValidateTrainCommandOptions(o),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("--save-every=2 needs --save=DIR")));
  o.save_every.reset();
  EXPECT_THAT(ValidateTrainCommandOptions(o),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("--async-save needs --save=DIR")));
  std::ostringstream out;
  EXPECT_THAT(RunTrainSim(o, out),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("--async-save needs --save=DIR")));
}

}  // namespace
}  // namespace tools
}  // namespace flatparam
