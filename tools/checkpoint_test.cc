#include "tools/checkpoint.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <sstream>
#include <string>

#include "flatparam/base/status_matchers.h"

namespace flatparam {
namespace tools {
namespace {

using ::testing::HasSubstr;
using ::testing::MatchesRegex;

std::string Tmp(const std::string& name) {
  const char* t = std::getenv("TEST_TMPDIR");
  return std::string(t != nullptr ? t : "/tmp") + "/" + name;
}

CheckpointCommand Command(const std::string& action) {
  CheckpointCommand c;
  c.action = action;
  return c;
}

TEST(CheckpointCommandTest, ValidatesTheCommandLineShape) {
  const auto invalid = absl::StatusCode::kInvalidArgument;
  EXPECT_THAT(ValidateCheckpointCommand(Command("frob")),
              StatusIs(invalid, HasSubstr("unknown action 'frob'")));
  CheckpointCommand c = Command("consolidate");
  c.out = "/o";
  EXPECT_THAT(ValidateCheckpointCommand(c),
              StatusIs(invalid, HasSubstr("needs --in")));
  c.in = "/i";
  EXPECT_THAT(ValidateCheckpointCommand(c), IsOk());
  c.layout.model = "gpt2";
  EXPECT_THAT(ValidateCheckpointCommand(c),
              StatusIs(invalid, HasSubstr("does not take --model")));
  c = Command("reshard");
  c.in = "/i";
  c.out = "/o";
  c.layout.strategy = "bogus";
  EXPECT_THAT(ValidateCheckpointCommand(c),
              StatusIs(invalid, HasSubstr("--strategy")));
  c.layout.strategy = "HYBRID_SHARD";
  c.layout.world_size = 4;
  c.layout.shard_group_size = 3;
  EXPECT_THAT(ValidateCheckpointCommand(c),
              StatusIs(invalid, HasSubstr("does not divide")));
  c = Command("verify");
  c.in = "/i";
  c.layout.align_addresses = true;
  EXPECT_THAT(ValidateCheckpointCommand(c),
              StatusIs(invalid, HasSubstr("does not take layout flags")));
  c = Command("init");
  c.out = "/o";
  c.layout.model = "gpt2";
  c.optimizer = "lion";
  EXPECT_THAT(ValidateCheckpointCommand(c),
              StatusIs(invalid, HasSubstr("adamw, sgd or none")));
}

TEST(CheckpointCommandTest, RunsEveryActionAndSummarises) {
  const std::string model = "tools/testdata/tiny_model.json";
  std::ostringstream out, progress;
  CheckpointCommand init = Command("init");
  init.layout.model = model;
  init.out = Tmp("full");
  FLATPARAM_ASSERT_OK(ValidateCheckpointCommand(init));
  FLATPARAM_ASSERT_OK(RunCheckpoint(init, out, progress, false));
  EXPECT_THAT(out.str(),
              MatchesRegex("checkpoint init: wrote [0-9]+ bytes in .* s "
                           "\\(.* MB/s\\), peak RSS .* MiB\n"));
  EXPECT_EQ(progress.str(), "");

  CheckpointCommand shard = Command("shard");
  shard.in = Tmp("full");
  shard.out = Tmp("sharded");
  shard.layout.model = model;
  shard.layout.world_size = 3;
  FLATPARAM_ASSERT_OK(ValidateCheckpointCommand(shard));
  FLATPARAM_ASSERT_OK(RunCheckpoint(shard, out, progress, true));
  // A terminal gets a bar, redrawn with carriage returns.
  EXPECT_THAT(progress.str(), HasSubstr("\rshard ["));
  EXPECT_THAT(progress.str(), HasSubstr("100.0%"));

  CheckpointCommand verify = Command("verify");
  verify.in = Tmp("sharded");
  out.str("");
  FLATPARAM_ASSERT_OK(RunCheckpoint(verify, out, progress, false));
  EXPECT_THAT(out.str(), HasSubstr("ok: sharded checkpoint, 7 files"));
  EXPECT_THAT(out.str(), HasSubstr("model tiny, world size 3, FULL_SHARD"));

  CheckpointCommand consolidate = Command("consolidate");
  consolidate.in = Tmp("sharded");
  consolidate.out = Tmp("full2");
  FLATPARAM_ASSERT_OK(RunCheckpoint(consolidate, out, progress, false));
  // Bad input: a full checkpoint is not a sharded one.
  consolidate.in = Tmp("full");
  consolidate.out = Tmp("full3");
  EXPECT_THAT(RunCheckpoint(consolidate, out, progress, false),
              StatusIs(absl::StatusCode::kDataLoss));
}

}  // namespace
}  // namespace tools
}  // namespace flatparam
