#include "tools/demo.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <sstream>
#include <string>

#include "flatparam/base/status_matchers.h"

namespace flatparam {
namespace tools {
namespace {

using ::testing::HasSubstr;

std::string TempDir(const char* name) {
  const char* base = std::getenv("TEST_TMPDIR");
  return std::string(base != nullptr ? base : "/tmp") + "/" + name;
}

TEST(DemoTest, EveryCheckPassesAndEveryFileIsWritten) {
  DemoOptions options;
  options.out_dir = TempDir("demo");
  options.steps = 2;
  std::ostringstream progress;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(DemoResult result, RunDemo(options, progress));
  for (const DemoCheck& c : result.checks) {
    EXPECT_TRUE(c.passed) << c.what;
  }
  EXPECT_TRUE(result.passed());
  // 3 per training phase, the resume step, 4 verified checkpoints, and
  // with LibTorch the transformer's 2 (bitwise, learnt).
  EXPECT_EQ(result.checks.size(), result.torch.ran ? 13u : 11u);
  if (result.torch.ran) {
    EXPECT_EQ(result.torch.losses.size(), 150u);
    EXPECT_EQ(result.torch.losses, result.torch.reference_losses);
  } else {
    EXPECT_THAT(result.torch.skipped, HasSubstr("LibTorch"));
  }
  EXPECT_EQ(result.first.world_size, 8);
  EXPECT_EQ(result.second.world_size, 4);
  EXPECT_EQ(result.second.options.first_step, 2);
  EXPECT_EQ(result.first.losses.size(), 2u);
  EXPECT_EQ(result.second.losses.size(), 2u);
  for (const std::string& path :
       {result.first_trace, result.second_trace, result.first_checkpoint,
        result.resharded_checkpoint, result.final_checkpoint,
        result.consolidated_checkpoint}) {
    EXPECT_TRUE(std::filesystem::exists(path)) << path;
  }

  std::ostringstream report;
  PrintDemoReport(result, report);
  EXPECT_THAT(report.str(), HasSubstr("demo PASSED"));
  EXPECT_THAT(report.str(), HasSubstr("HYBRID_SHARD 2x2"));
  EXPECT_THAT(report.str(), HasSubstr("FULL_SHARD x8"));
  EXPECT_THAT(
      report.str(),
      HasSubstr("prefetch BACKWARD_PRE (depth 1, limit_all_gathers 2)"));
  EXPECT_THAT(report.str(), Not(HasSubstr("[FAIL]")));
  EXPECT_THAT(report.str(),
              HasSubstr(result.torch.ran ? "a GPT-2-style transformer in "
                                           "LibTorch"
                                         : "LibTorch stage skipped"));
  EXPECT_THAT(progress.str(), HasSubstr("[6/6]"));
}

TEST(DemoTest, RunsAgainOverItsOwnOutput) {
  DemoOptions options;
  options.out_dir = TempDir("demo-twice");
  options.steps = 1;
  std::ostringstream sink;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(DemoResult first, RunDemo(options, sink));
  FLATPARAM_ASSERT_OK_AND_ASSIGN(DemoResult second, RunDemo(options, sink));
  EXPECT_TRUE(second.passed());
  EXPECT_EQ(first.second.losses, second.second.losses);
}

TEST(DemoTest, ReportsAFailedCheck) {
  DemoResult result;
  result.checks.push_back({"a check that held", true});
  result.checks.push_back({"a check that did not", false});
  EXPECT_FALSE(result.passed());
  std::ostringstream report;
  PrintDemoReport(result, report);
  EXPECT_THAT(report.str(), HasSubstr("[FAIL] a check that did not"));
  EXPECT_THAT(report.str(), HasSubstr("demo FAILED"));
  EXPECT_FALSE(DemoResult{}.passed());
}

TEST(DemoTest, RejectsBadOptions) {
  std::ostringstream sink;
  DemoOptions options;
  EXPECT_THAT(RunDemo(options, sink),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--out")));
  options.out_dir = TempDir("demo-bad");
  options.steps = 0;
  EXPECT_THAT(
      RunDemo(options, sink),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--steps")));
}

}  // namespace
}  // namespace tools
}  // namespace flatparam
