#include "tools/checkpoint.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <sstream>
#include <string>

#include "flatparam/base/status_matchers.h"
#include "flatparam/model_layout.h"
#include "tools/layout_request.h"

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

TEST(CheckpointCommandTest, ValidatesTheHuggingFaceFlags) {
  const auto invalid = absl::StatusCode::kInvalidArgument;
  CheckpointCommand c = Command("export");
  c.in = "/i";
  EXPECT_THAT(ValidateCheckpointCommand(c),
              StatusIs(invalid, HasSubstr("needs --out")));
  c.out = "/o";
  EXPECT_THAT(ValidateCheckpointCommand(c), IsOk());
  c.max_shard_size = "500MB";
  c.layout.dtype = "bf16";
  EXPECT_THAT(ValidateCheckpointCommand(c), IsOk());
  c.max_shard_size = "5Gb";
  EXPECT_THAT(ValidateCheckpointCommand(c),
              StatusIs(invalid, HasSubstr("--max-shard-size: '5Gb'")));
  c.max_shard_size = "";
  c.layout.dtype = "int64";
  EXPECT_THAT(ValidateCheckpointCommand(c),
              StatusIs(invalid, HasSubstr("--dtype must be bfloat16")));
  c.layout.dtype = "";
  c.cast = true;
  EXPECT_THAT(ValidateCheckpointCommand(c),
              StatusIs(invalid, HasSubstr("does not take --cast")));
  c.cast = false;
  c.layout.model = "gpt2";
  EXPECT_THAT(ValidateCheckpointCommand(c),
              StatusIs(invalid, HasSubstr("does not take --model")));
  c = Command("reshard");
  c.in = "/i";
  c.out = "/o";
  c.max_shard_size = "1GB";
  EXPECT_THAT(ValidateCheckpointCommand(c),
              StatusIs(invalid, HasSubstr("does not take --max-shard-size")));
  c.max_shard_size = "";
  c.weights_only = true;
  EXPECT_THAT(ValidateCheckpointCommand(c),
              StatusIs(invalid, HasSubstr("does not take --weights-only")));
  c = Command("shard");
  c.in = "/i";
  c.out = "/o";
  c.layout.model = "llama2-7b-hf";
  c.layout.dtype = "bfloat16";
  c.cast = true;
  c.weights_only = true;
  EXPECT_THAT(ValidateCheckpointCommand(c), IsOk());
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
              MatchesRegex("checkpoint init: wrote /.*/full: [0-9]+ bytes in "
                           ".* s "
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

  // --model may name the sharded checkpoint: the model it was saved with.
  FLATPARAM_ASSERT_OK_AND_ASSIGN(ModelSpec from_dir, LoadModel(Tmp("sharded")));
  FLATPARAM_ASSERT_OK_AND_ASSIGN(ModelSpec from_file, LoadModel(model));
  EXPECT_EQ(from_dir.name, from_file.name);
  ASSERT_EQ(from_dir.params.size(), from_file.params.size());
  for (size_t i = 0; i < from_dir.params.size(); ++i) {
    EXPECT_EQ(from_dir.params[i].fqn, from_file.params[i].fqn);
  }
  // A directory that holds no sharded checkpoint says so.
  EXPECT_THAT(LoadModel(Tmp("full")),
              StatusIs(absl::StatusCode::kDataLoss,
                       HasSubstr("is a directory, so it must hold a sharded "
                                 "checkpoint")));
}

TEST(CheckpointCommandTest, ExportsImportsAndVerifiesHuggingFace) {
  const std::string model = "tools/testdata/tiny_model.json";
  std::ostringstream out, progress;
  CheckpointCommand init = Command("init");
  init.layout.model = model;
  init.out = Tmp("hf_full");
  FLATPARAM_ASSERT_OK(RunCheckpoint(init, out, progress, false));

  CheckpointCommand exp = Command("export");
  exp.in = Tmp("hf_full");
  exp.out = Tmp("hf_out");
  exp.max_shard_size = "100";
  FLATPARAM_ASSERT_OK(ValidateCheckpointCommand(exp));
  out.str("");
  FLATPARAM_ASSERT_OK(RunCheckpoint(exp, out, progress, true));
  EXPECT_THAT(out.str(),
              MatchesRegex(".*/hf_out: 7 tensors, total_size 476 bytes, in "
                           "model-00001-of-00005.safetensors, .*, "
                           "model.safetensors.index.json\n"
                           "checkpoint export: wrote /.*/hf_out: [0-9]+ "
                           "bytes in .*\n"));
  EXPECT_THAT(progress.str(), HasSubstr("\rexport ["));
  EXPECT_THAT(progress.str(), HasSubstr("100.0%"));

  CheckpointCommand verify = Command("verify");
  verify.in = Tmp("hf_out");
  out.str("");
  FLATPARAM_ASSERT_OK(RunCheckpoint(verify, out, progress, false));
  EXPECT_THAT(out.str(), HasSubstr("ok: Hugging Face checkpoint, 5 files, 7 "
                                   "tensors, 476 bytes of tensors (headers "
                                   "and index checked"));

  CheckpointCommand shard = Command("shard");
  shard.in = Tmp("hf_out");
  shard.out = Tmp("hf_sharded");
  shard.layout.model = model;
  shard.layout.world_size = 2;
  out.str("");
  FLATPARAM_ASSERT_OK(RunCheckpoint(shard, out, progress, false));
  EXPECT_THAT(out.str(), HasSubstr("imported 7 tensors of 5 Hugging Face "
                                   "files into model tiny (0 tied copies "
                                   "checked, 0 buffers skipped, 0 cast)"));
  // --cast and --weights-only are for Hugging Face input only.
  shard.in = Tmp("hf_full");
  shard.out = Tmp("hf_sharded2");
  shard.cast = true;
  EXPECT_THAT(RunCheckpoint(shard, out, progress, false),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("--cast applies to Hugging Face checkpoints "
                                 "only")));
}

}  // namespace
}  // namespace tools
}  // namespace flatparam
