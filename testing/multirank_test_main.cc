#include "testing/multirank_test_main.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace flatparam {
namespace {

// On ranks other than 0: only failures, prefixed with the rank.
class RankFailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}

  void OnTestPartResult(const ::testing::TestPartResult& result) override {
    if (!result.failed()) return;
    std::fprintf(stderr, "[rank %d] %s:%d: Failure\n%s\n", rank_,
                 result.file_name() ? result.file_name() : "?",
                 result.line_number(), result.message());
  }
  void OnTestEnd(const ::testing::TestInfo& info) override {
    if (info.result()->Failed()) {
      std::fprintf(stderr, "[rank %d] FAILED %s.%s\n", rank_,
                   info.test_suite_name(), info.name());
    }
  }

 private:
  int rank_;
};

}  // namespace

void InitGoogleTestOnRank(int rank, int* argc, char** argv) {
  if (rank != 0) {
    // Bazel's per-test files belong to rank 0 alone.
    unsetenv("XML_OUTPUT_FILE");
    unsetenv("TEST_PREMATURE_EXIT_FILE");
    unsetenv("GTEST_OUTPUT");
  }
  ::testing::InitGoogleTest(argc, argv);
  if (rank != 0) {
    ::testing::TestEventListeners& listeners =
        ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new RankFailurePrinter(rank));
  }
}

bool RunAllTestsOnAllRanks(Communicator& world) {
  const bool failed = RUN_ALL_TESTS() != 0;
  // Every rank's verdict, so that the exit codes and rank 0's summary agree
  // with the failures the other ranks printed.
  float mine = failed ? 1.0f : 0.0f;
  float any = 1.0f;
  ReduceOptions max;
  max.op = ReduceOp::kMax;
  max.timeout = absl::Seconds(60);
  const absl::Status verdict = world
                                   .AllReduce({&mine, 1, DType::kFloat32},
                                              {&any, 1, DType::kFloat32}, max)
                                   ->Wait();
  if (!verdict.ok()) {
    std::fprintf(stderr, "[rank %d] combining results: %s\n", world.rank(),
                 verdict.ToString().c_str());
  }
  if (world.rank() == 0 && verdict.ok() && any != 0 && !failed) {
    std::fprintf(stderr, "FAILED on another rank (see [rank N] lines)\n");
  }
  return !verdict.ok() || any != 0;
}

}  // namespace flatparam
