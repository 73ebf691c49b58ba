#include "flatparam/checkpoint/checkpoint_dir.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "flatparam/base/dtype.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/base/status_matchers.h"
#include "flatparam/checkpoint/file_system.h"
#include "flatparam/checkpoint/internal/checkpoint_testutil.h"
#include "flatparam/checkpoint/internal/counting_file_system.h"
#include "flatparam/checkpoint/manifest.h"
#include "flatparam/checkpoint/safetensors.h"
#include "flatparam/flatten.h"
#include "flatparam/layout.h"
#include "flatparam/layout_json.h"
#include "flatparam/model_layout.h"

namespace flatparam {
namespace checkpoint {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using json = nlohmann::json;
using internal_checkpoint::CountingFileSystem;

constexpr absl::StatusCode kDataLoss = absl::StatusCode::kDataLoss;
constexpr absl::StatusCode kInvalid = absl::StatusCode::kInvalidArgument;
constexpr absl::StatusCode kMismatch = absl::StatusCode::kFailedPrecondition;

// Compares every tensor `reader` has for `sources` with their bytes.
absl::Status CompareTensors(const SafetensorsReader& reader,
                            const std::vector<TensorSource>& sources) {
  if (reader.tensors().size() != sources.size()) {
    return absl::InternalError(
        absl::StrCat(reader.name(), ": ", reader.tensors().size(),
                     " tensors, expected ", sources.size()));
  }
  for (const TensorSource& s : sources) {
    FLATPARAM_ASSIGN_OR_RETURN(HostTensor t, reader.ReadHostTensor(s.name));
    std::string expected(t.nbytes(), '\0');
    if (!expected.empty()) {
      FLATPARAM_RETURN_IF_ERROR(
          s.fill(0, absl::MakeSpan(expected.data(), expected.size())));
    }
    if (t.dtype() != s.dtype || t.shape() != s.shape ||
        std::string(static_cast<const char*>(t.data()), t.nbytes()) !=
            expected) {
      return absl::InternalError(
          absl::StrCat(reader.name(), ": tensor ", s.name, " differs"));
    }
  }
  return absl::OkStatus();
}

// The version of the full checkpoint at `dir`, after checking that all of
// it is exactly that version's content.
absl::StatusOr<int> FullVersion(FileSystem& fs, const std::string& dir,
                                const ModelSpec& spec) {
  FLATPARAM_ASSIGN_OR_RETURN(FullCheckpointReader r,
                             FullCheckpointReader::Open(fs, dir));
  FLATPARAM_RETURN_IF_ERROR(r.CheckFitsModel(spec));
  const int version = r.optim_json().at("version").get<int>();
  const FullFixture expected = MakeFullFixture(spec, version);
  FLATPARAM_RETURN_IF_ERROR(CompareTensors(r.model(), expected.content.model));
  FLATPARAM_RETURN_IF_ERROR(CompareTensors(r.optim(), expected.content.optim));
  if (r.optim_json() != expected.content.optim_json) {
    return absl::InternalError("optim.json differs");
  }
  return version;
}

absl::StatusOr<int> ShardedVersion(FileSystem& fs, const std::string& dir,
                                   const ModelLayout& layout,
                                   int64_t world_size) {
  FLATPARAM_ASSIGN_OR_RETURN(ShardedCheckpointReader r,
                             ShardedCheckpointReader::Open(fs, dir));
  FLATPARAM_RETURN_IF_ERROR(r.CheckFits(layout, world_size));
  FLATPARAM_ASSIGN_OR_RETURN(json rank0, r.ReadRankJson(0));
  const int version = rank0.at("version").get<int>();
  const ShardedFixture expected =
      MakeShardedFixture(layout, world_size, version);
  for (int64_t rank = 0; rank < r.num_ranks(); ++rank) {
    FLATPARAM_ASSIGN_OR_RETURN(SafetensorsReader tensors, r.OpenRank(rank));
    FLATPARAM_RETURN_IF_ERROR(
        CompareTensors(tensors, expected.content.ranks[rank].tensors));
    FLATPARAM_ASSIGN_OR_RETURN(json sidecar, r.ReadRankJson(rank));
    if (sidecar != expected.content.ranks[rank].sidecar) {
      return absl::InternalError(absl::StrCat("rank ", rank, " json differs"));
    }
  }
  return version;
}

// Rewrites `dir`'s manifest to match its files, as a tamperer who knows the
// format would: the checks after the manifest must catch what follows.
void Remanifest(FileSystem& fs, const std::string& dir, CheckpointKind kind) {
  FLATPARAM_ASSERT_OK_AND_ASSIGN(std::vector<std::string> children,
                                 fs.GetChildren(dir));
  Manifest m;
  m.kind = kind;
  for (const std::string& child : children) {
    if (child == kManifestFileName) continue;
    FLATPARAM_ASSERT_OK_AND_ASSIGN(ManifestEntry e,
                                   DescribeFile(fs, dir, child));
    m.files.push_back(e);
  }
  ASSERT_THAT(WriteManifest(fs, dir, m), IsOk());
}

// --- Full checkpoints --------------------------------------------------------

class PosixCheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* tmp = std::getenv("TEST_TMPDIR");
    root_ = JoinPath(
        tmp != nullptr ? tmp : "/tmp",
        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    ASSERT_THAT(RemoveRecursively(fs_, root_), IsOk());
    ASSERT_THAT(fs_.CreateDir(root_), IsOk());
    dir_ = JoinPath(root_, "ckpt");
  }

  FileSystem& fs_ = PosixFileSystem();
  std::string root_;
  std::string dir_;
};

TEST_F(PosixCheckpointTest, FullRoundTripAndReplace) {
  const ModelSpec spec = TinyModelSpec();
  const FullFixture v1 = MakeFullFixture(spec, 1);
  ASSERT_THAT(WriteFullCheckpoint(fs_, dir_, v1.content), IsOk());
  EXPECT_THAT(ListDir(fs_, dir_),
              ElementsAre("manifest.json", "model.safetensors", "optim.json",
                          "optim.safetensors"));
  EXPECT_THAT(FullVersion(fs_, dir_, spec), IsOkAndHolds(1));
  FLATPARAM_ASSERT_OK_AND_ASSIGN(FullCheckpointReader r,
                                 FullCheckpointReader::Open(fs_, dir_));
  EXPECT_EQ(r.path(), dir_);
  EXPECT_EQ(r.manifest().kind, CheckpointKind::kFull);
  EXPECT_EQ(r.manifest().files.size(), 3u);
  FLATPARAM_ASSERT_OK_AND_ASSIGN(const SafetensorsEntry* step,
                                 r.optim().Find("state.emb.weight.step"));
  EXPECT_TRUE(step->shape.empty());

  // Replacing: the old directory goes through ckpt.previous and is removed.
  const FullFixture v2 = MakeFullFixture(spec, 2);
  ASSERT_THAT(WriteFullCheckpoint(fs_, dir_ + "/", v2.content), IsOk());
  FLATPARAM_ASSERT_OK_AND_ASSIGN(int version, FullVersion(fs_, dir_, spec));
  EXPECT_EQ(version, 2);
  EXPECT_THAT(ListDir(fs_, root_), ElementsAre("ckpt"));
}

TEST_F(PosixCheckpointTest, ShardedRoundTrip) {
  const ModelSpec spec = TinyModelSpec();
  const ModelLayout layout =
      MakeTestLayout(spec, TestLayoutOptions(3, ShardingStrategy::kFullShard,
                                             /*align=*/true));
  const ShardedFixture v1 = MakeShardedFixture(layout, 3, 1);
  ASSERT_THAT(WriteShardedCheckpoint(fs_, dir_, v1.content), IsOk());
  EXPECT_THAT(ListDir(fs_, dir_),
              ElementsAre("layout.json", "manifest.json", "rank00000.json",
                          "rank00000.safetensors", "rank00001.json",
                          "rank00001.safetensors", "rank00002.json",
                          "rank00002.safetensors"));
  FLATPARAM_ASSERT_OK_AND_ASSIGN(int version,
                                 ShardedVersion(fs_, dir_, layout, 3));
  EXPECT_EQ(version, 1);
}

TEST(FullCheckpointTest, ProgressReachesTheTotalOfTheFiles) {
  FaultInjectionFileSystem fs;
  const FullFixture f = MakeFullFixture(TinyModelSpec(), 1);
  std::vector<std::pair<uint64_t, uint64_t>> calls;
  CheckpointWriteOptions options;
  options.chunk_bytes = 7;  // many chunks, each under a float's multiple
  options.progress = [&](uint64_t done, uint64_t total) {
    calls.emplace_back(done, total);
  };
  ASSERT_THAT(WriteFullCheckpoint(fs, "ckpt", f.content, options), IsOk());
  ASSERT_GT(calls.size(), 10u);
  uint64_t files = 0;
  for (const char* name :
       {kModelFileName, kOptimFileName, kOptimJsonFileName}) {
    FLATPARAM_ASSERT_OK_AND_ASSIGN(uint64_t size,
                                   fs.GetFileSize(JoinPath("ckpt", name)));
    files += size;
  }
  for (size_t i = 1; i < calls.size(); ++i) {
    EXPECT_GE(calls[i].first, calls[i - 1].first);
    EXPECT_EQ(calls[i].second, files);
  }
  EXPECT_EQ(calls.back().first, files);

  // Reading reports checksum progress over the same bytes.
  CheckpointOpenOptions open;
  uint64_t last = 0;
  uint64_t total = 0;
  open.progress = [&](uint64_t done, uint64_t t) {
    last = done;
    total = t;
  };
  FLATPARAM_ASSERT_OK_AND_ASSIGN(FullCheckpointReader r,
                                 FullCheckpointReader::Open(fs, "ckpt", open));
  EXPECT_EQ(total, files);
  EXPECT_EQ(last, files);
}

TEST(FullCheckpointTest, WriteRejectsBadContentAndPaths) {
  FaultInjectionFileSystem fs;
  FullFixture f = MakeFullFixture(TinyModelSpec(), 1);
  FullCheckpointContent bad = f.content;
  bad.optim[0].name = "emb.weight.exp_avg";
  EXPECT_THAT(WriteFullCheckpoint(fs, "ckpt", bad),
              StatusIs(kInvalid, HasSubstr("optim.safetensors: tensor "
                                           "'emb.weight.exp_avg' is not named "
                                           "state.{fqn}.{state_name}")));
  bad = f.content;
  bad.optim_json = json::array();
  EXPECT_THAT(
      WriteFullCheckpoint(fs, "ckpt", bad),
      StatusIs(kInvalid, HasSubstr("optim.json: must be a JSON object")));
  bad = f.content;
  bad.model.push_back(bad.model[0]);
  EXPECT_THAT(WriteFullCheckpoint(fs, "ckpt", bad),
              StatusIs(kInvalid, HasSubstr("model.safetensors: tensor "
                                           "'emb.weight' is declared twice")));
  EXPECT_THAT(WriteFullCheckpoint(fs, "no/such/parent/ckpt", f.content),
              StatusIs(absl::StatusCode::kNotFound,
                       HasSubstr("the parent directory no/such/parent does not "
                                 "exist")));
  EXPECT_THAT(WriteFullCheckpoint(fs, "", f.content), StatusIs(kInvalid));
  EXPECT_THAT(WriteFullCheckpoint(fs, ".", f.content), StatusIs(kInvalid));
  // None of it left anything behind.
  EXPECT_THAT(ListDir(fs, "/"), ::testing::IsEmpty());
}

TEST(FullCheckpointTest, SourceErrorsLeaveTheOldCheckpoint) {
  FaultInjectionFileSystem fs;
  const ModelSpec spec = TinyModelSpec();
  const FullFixture v1 = MakeFullFixture(spec, 1);
  ASSERT_THAT(WriteFullCheckpoint(fs, "ckpt", v1.content), IsOk());
  FullFixture v2 = MakeFullFixture(spec, 2);
  v2.content.model[2].fill = [](uint64_t, absl::Span<char>) {
    return absl::AbortedError("gpu copy failed");
  };
  EXPECT_THAT(WriteFullCheckpoint(fs, "ckpt", v2.content),
              StatusIs(absl::StatusCode::kAborted,
                       HasSubstr("model.safetensors: tensor 'seq.0.bias' bytes "
                                 "[0, 20): gpu copy failed")));
  EXPECT_THAT(FullVersion(fs, "ckpt", spec), IsOkAndHolds(1));
  EXPECT_THAT(ListDir(fs, "/"), ElementsAre("ckpt"));  // temporary removed
}

// A write replaces its directory whole, so it refuses a directory holding
// anything it did not write, before writing anything: the files survive.
TEST(FullCheckpointTest, NeverReplacesADirectoryWithFilesItDidNotWrite) {
  FaultInjectionFileSystem fs;
  const ModelSpec spec = TinyModelSpec();
  const FullFixture v1 = MakeFullFixture(spec, 1);
  const auto put = [&](const std::string& path, const std::string& text) {
    FLATPARAM_ASSERT_OK(WriteFileDurably(fs, path, text));
  };
  // An unrelated directory.
  FLATPARAM_ASSERT_OK(fs.CreateDir("mine"));
  put("mine/config.json", "{}");
  put("mine/tokenizer.json", "{}");
  EXPECT_THAT(WriteFullCheckpoint(fs, "mine", v1.content),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr("mine holds 2 files that no full "
                                       "checkpoint written here has: "
                                       "config.json, tokenizer.json"),
                             HasSubstr("refusing"))));
  EXPECT_THAT(ListDir(fs, "mine"),
              ElementsAre("config.json", "tokenizer.json"));
  EXPECT_THAT(ListDir(fs, "/"), ElementsAre("mine"));  // nothing written
  // A file where the directory would go.
  put("plain", "data");
  EXPECT_THAT(WriteFullCheckpoint(fs, "plain", v1.content),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("plain exists and is not a directory")));
  // An empty directory is fine, and so is replacing a checkpoint of the
  // same kind.
  FLATPARAM_ASSERT_OK(fs.CreateDir("empty"));
  EXPECT_THAT(WriteFullCheckpoint(fs, "empty", v1.content), IsOk());
  const FullFixture v2 = MakeFullFixture(spec, 2);
  EXPECT_THAT(WriteFullCheckpoint(fs, "empty", v2.content), IsOk());
  EXPECT_THAT(FullVersion(fs, "empty", spec), IsOkAndHolds(2));
  // ... but not one with a file added next to it.
  put("empty/notes.txt", "keep me");
  EXPECT_THAT(WriteFullCheckpoint(fs, "empty", v1.content),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("empty holds a file that no full checkpoint "
                                 "written here has: notes.txt")));
  EXPECT_THAT(ReadFileToString(fs, "empty/notes.txt", 100),
              IsOkAndHolds("keep me"));
  // Nor a checkpoint of the other kind.
  FLATPARAM_ASSERT_OK(fs.RemoveFile("empty/notes.txt"));
  const ModelLayout layout = MakeTestLayout(spec, TestLayoutOptions(2));
  const ShardedFixture sharded = MakeShardedFixture(layout, 2, 1);
  EXPECT_THAT(WriteShardedCheckpoint(fs, "empty", sharded.content),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("empty holds a full checkpoint: refusing to "
                                 "write a sharded checkpoint there")));
  EXPECT_THAT(FullVersion(fs, "empty", spec), IsOkAndHolds(2));
  // overwrite cannot help: the readers reject files the manifest does not
  // list, so the refusal stays, saying why.
  CheckpointWriteOptions overwrite;
  overwrite.overwrite = true;
  EXPECT_THAT(WriteFullCheckpoint(fs, "mine", v1.content, overwrite),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("overwrite cannot keep them")));
  EXPECT_THAT(ListDir(fs, "mine"),
              ElementsAre("config.json", "tokenizer.json"));
  // What a write replaced is reported.
  DirWriteOutcome outcome;
  CheckpointWriteOptions report;
  report.outcome = &outcome;
  EXPECT_THAT(WriteFullCheckpoint(fs, "empty/", v2.content, report), IsOk());
  EXPECT_EQ(outcome.dir, "empty");
  EXPECT_EQ(outcome.replaced, ListDir(fs, "empty"));
  EXPECT_THAT(outcome.kept, ElementsAre());
}

TEST(FullCheckpointTest, CheckFitsModelNamesTheDifference) {
  FaultInjectionFileSystem fs;
  const ModelSpec spec = TinyModelSpec();
  const FullFixture f = MakeFullFixture(spec, 1);
  ASSERT_THAT(WriteFullCheckpoint(fs, "ckpt", f.content), IsOk());
  FLATPARAM_ASSERT_OK_AND_ASSIGN(FullCheckpointReader r,
                                 FullCheckpointReader::Open(fs, "ckpt"));
  EXPECT_THAT(r.CheckFitsModel(spec), IsOk());

  ModelSpec other = spec;
  other.params[1].shape = {3, 5};
  EXPECT_THAT(r.CheckFitsModel(other),
              StatusIs(kMismatch,
                       HasSubstr("ckpt/model.safetensors: tensor "
                                 "'seq.0.weight' is float32 [5, 3], "
                                 "the model's parameter is float32 [3, 5]")));
  other = spec;
  other.params[2].dtype = DType::kBFloat16;
  EXPECT_THAT(
      r.CheckFitsModel(other),
      StatusIs(kMismatch, HasSubstr("'seq.0.bias' is float32 [5], the "
                                    "model's parameter is bfloat16 [5]")));
  other = spec;
  other.params.push_back({"extra.weight", {2}});
  EXPECT_THAT(r.CheckFitsModel(other),
              StatusIs(kMismatch, HasSubstr("parameter 'extra.weight' of model "
                                            "'tiny' is missing")));
  other = spec;
  other.params.erase(other.params.begin() + 5);  // norm.scale
  EXPECT_THAT(r.CheckFitsModel(other),
              StatusIs(kMismatch, HasSubstr("tensor 'norm.scale' is not a "
                                            "parameter or buffer of model "
                                            "'tiny'")));
}

TEST(FullCheckpointTest, OptimStateMustBelongToAParameter) {
  FaultInjectionFileSystem fs;
  const ModelSpec spec = TinyModelSpec();
  FullFixture f = MakeFullFixture(spec, 1);
  HostTensor stray = HostTensor::Flat(DType::kFloat32, 4);
  f.content.optim.push_back(
      TensorSourceFromHostTensor("state.seq.9.weight.exp_avg", stray));
  ASSERT_THAT(WriteFullCheckpoint(fs, "ckpt", f.content), IsOk());
  FLATPARAM_ASSERT_OK_AND_ASSIGN(FullCheckpointReader r,
                                 FullCheckpointReader::Open(fs, "ckpt"));
  EXPECT_THAT(
      r.CheckFitsModel(spec),
      StatusIs(kMismatch, HasSubstr("optim.safetensors: tensor "
                                    "'state.seq.9.weight.exp_avg' is not "
                                    "state.{fqn}.{state_name}")));

  FullFixture g = MakeFullFixture(spec, 1);
  HostTensor wrong = HostTensor::Flat(DType::kFloat32, 4);
  g.content.optim.push_back(
      TensorSourceFromHostTensor("state.seq.0.bias.exp_avg_sq", wrong));
  ASSERT_THAT(WriteFullCheckpoint(fs, "ckpt", g.content), IsOk());
  FLATPARAM_ASSERT_OK_AND_ASSIGN(FullCheckpointReader r2,
                                 FullCheckpointReader::Open(fs, "ckpt"));
  EXPECT_THAT(r2.CheckFitsModel(spec),
              StatusIs(kMismatch, HasSubstr("'state.seq.0.bias.exp_avg_sq' has "
                                            "shape [4], expected [] or [5] of "
                                            "parameter 'seq.0.bias'")));
}

TEST(FullCheckpointTest, OpenCatchesDamage) {
  FaultInjectionFileSystem fs;
  const FullFixture f = MakeFullFixture(TinyModelSpec(), 1);
  ASSERT_THAT(WriteFullCheckpoint(fs, "ckpt", f.content), IsOk());
  // A flipped byte in a tensor: the checksum.
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      std::string model,
      ReadFileToString(fs, "ckpt/model.safetensors", 1 << 20));
  model[model.size() - 3] ^= 0x10;
  ASSERT_THAT(WriteFileDurably(fs, "ckpt/model.safetensors", model), IsOk());
  EXPECT_THAT(FullCheckpointReader::Open(fs, "ckpt"),
              StatusIs(kDataLoss, HasSubstr("ckpt/model.safetensors: xxh3_64 "
                                            "checksum is")));
  // The same damage in the header, re-manifested: the safetensors reader.
  model[9] = '[';
  ASSERT_THAT(WriteFileDurably(fs, "ckpt/model.safetensors", model), IsOk());
  Remanifest(fs, "ckpt", CheckpointKind::kFull);
  EXPECT_THAT(
      FullCheckpointReader::Open(fs, "ckpt"),
      StatusIs(kDataLoss, HasSubstr("ckpt/model.safetensors: header:1:2: "
                                    "malformed JSON")));
  // A missing file, re-manifested: the file set.
  ASSERT_THAT(fs.RemoveFile("ckpt/model.safetensors"), IsOk());
  Remanifest(fs, "ckpt", CheckpointKind::kFull);
  EXPECT_THAT(
      FullCheckpointReader::Open(fs, "ckpt"),
      StatusIs(kDataLoss, HasSubstr("ckpt: a full checkpoint needs "
                                    "model.safetensors, which is missing")));
  EXPECT_THAT(FullCheckpointReader::Open(fs, "elsewhere"),
              StatusIs(absl::StatusCode::kNotFound,
                       HasSubstr("no checkpoint at elsewhere")));
}

TEST(FullCheckpointTest, DeeplyNestedJsonIsRefusedNamingTheFile) {
  FaultInjectionFileSystem fs;
  const FullFixture f = MakeFullFixture(TinyModelSpec(), 1);
  ASSERT_THAT(WriteFullCheckpoint(fs, "ckpt", f.content), IsOk());
  ASSERT_THAT(
      WriteFileDurably(fs, "ckpt/optim.json",
                       absl::StrCat(R"({"format": [)", std::string(100000, '['),
                                    std::string(100000, ']'), "]}")),
      IsOk());
  Remanifest(fs, "ckpt", CheckpointKind::kFull);
  EXPECT_THAT(FullCheckpointReader::Open(fs, "ckpt"),
              StatusIs(kDataLoss, HasSubstr("ckpt/optim.json: nested deeper "
                                            "than 512 levels")));
  // The same in model.safetensors' header: a shape element.
  const std::string header = absl::StrCat(
      R"({"t": {"dtype": "F32", "shape": [)", std::string(100000, '['),
      std::string(100000, ']'), R"(], "data_offsets": [0, 4]}})");
  std::string file(8, '\0');
  for (int i = 0; i < 8; ++i)
    file[i] = static_cast<char>(header.size() >> (8 * i));
  file += header + std::string(4, '\0');
  ASSERT_THAT(WriteFileDurably(fs, "ckpt/model.safetensors", file), IsOk());
  Remanifest(fs, "ckpt", CheckpointKind::kFull);
  EXPECT_THAT(FullCheckpointReader::Open(fs, "ckpt"),
              StatusIs(kDataLoss, HasSubstr("ckpt/model.safetensors: header: "
                                            "nested deeper than 512 levels")));
  // And the manifest itself.
  ASSERT_THAT(
      WriteFileDurably(fs, "ckpt/manifest.json",
                       absl::StrCat(R"({"format": "flatparam.checkpoint.v1", )"
                                    R"("kind": )",
                                    std::string(100000, '['),
                                    std::string(100000, ']'), "}")),
      IsOk());
  EXPECT_THAT(FullCheckpointReader::Open(fs, "ckpt"),
              StatusIs(kDataLoss, HasSubstr("ckpt/manifest.json: nested deeper "
                                            "than 512 levels")));
}

// --- Sharded checkpoints -----------------------------------------------------

struct ShardedCase {
  const char* name;
  int64_t world_size;
  int64_t group;
  ShardingStrategy strategy;
  bool align;
};

class ShardedRoundTripTest : public ::testing::TestWithParam<ShardedCase> {};

TEST_P(ShardedRoundTripTest, RoundTrips) {
  const ShardedCase& c = GetParam();
  FaultInjectionFileSystem fs;
  const ModelSpec spec = TinyModelSpec();
  const ModelLayout layout =
      MakeTestLayout(spec, TestLayoutOptions(c.group, c.strategy, c.align));
  const ShardedFixture f = MakeShardedFixture(layout, c.world_size, 7);
  ASSERT_THAT(WriteShardedCheckpoint(fs, "ckpt", f.content), IsOk());
  EXPECT_THAT(ShardedVersion(fs, "ckpt", layout, c.world_size),
              IsOkAndHolds(7));

  FLATPARAM_ASSERT_OK_AND_ASSIGN(ShardedCheckpointReader r,
                                 ShardedCheckpointReader::Open(fs, "ckpt"));
  EXPECT_EQ(r.world_size(), c.world_size);
  EXPECT_EQ(r.num_ranks(), c.group);
  EXPECT_EQ(r.spec().name, "tiny");
  EXPECT_EQ(r.layout().flat_params().size(), layout.flat_params().size());
  LayoutJsonOptions o;
  o.world_size = c.world_size;
  json expected = ModelLayoutToJson(layout, o);
  json stored = r.layout_json();
  EXPECT_TRUE(stored.contains("model_spec"));
  stored.erase("model_spec");
  EXPECT_EQ(stored, expected);
  EXPECT_THAT(r.OpenRank(c.group), StatusIs(kInvalid, HasSubstr("rank")));
  EXPECT_THAT(r.ReadRankJson(-1), StatusIs(kInvalid));
}

INSTANTIATE_TEST_SUITE_P(
    Strategies, ShardedRoundTripTest,
    ::testing::Values(
        ShardedCase{"FullShard1", 1, 1, ShardingStrategy::kFullShard, false},
        ShardedCase{"FullShard2", 2, 2, ShardingStrategy::kFullShard, false},
        ShardedCase{"FullShard5Aligned", 5, 5, ShardingStrategy::kFullShard,
                    true},
        ShardedCase{"ShardGradOp3", 3, 3, ShardingStrategy::kShardGradOp,
                    false},
        ShardedCase{"NoShard2", 2, 2, ShardingStrategy::kNoShard, false},
        ShardedCase{"Hybrid4Of2", 4, 2, ShardingStrategy::kHybridShard, true}),
    [](const ::testing::TestParamInfo<ShardedCase>& info) {
      return info.param.name;
    });

TEST(ShardedCheckpointTest, CheckFitsNamesTheDifference) {
  FaultInjectionFileSystem fs;
  const ModelSpec spec = TinyModelSpec();
  const ModelLayout layout = MakeTestLayout(spec, TestLayoutOptions(2));
  const ShardedFixture f = MakeShardedFixture(layout, 2, 1);
  ASSERT_THAT(WriteShardedCheckpoint(fs, "ckpt", f.content), IsOk());
  FLATPARAM_ASSERT_OK_AND_ASSIGN(ShardedCheckpointReader r,
                                 ShardedCheckpointReader::Open(fs, "ckpt"));
  EXPECT_THAT(r.CheckFits(layout, 2), IsOk());
  EXPECT_THAT(
      r.CheckFits(MakeTestLayout(spec, TestLayoutOptions(4)), 4),
      StatusIs(kMismatch, HasSubstr("world size: checkpoint 2, job 4 "
                                    "(reshard the checkpoint offline)")));
  EXPECT_THAT(
      r.CheckFits(MakeTestLayout(spec, TestLayoutOptions(
                                           2, ShardingStrategy::kShardGradOp)),
                  2),
      StatusIs(kMismatch, HasSubstr("strategy: checkpoint FULL_SHARD, "
                                    "job SHARD_GRAD_OP")));
  EXPECT_THAT(
      r.CheckFits(
          MakeTestLayout(
              spec, TestLayoutOptions(2, ShardingStrategy::kFullShard, true)),
          2),
      StatusIs(kMismatch,
               HasSubstr("align_addresses: checkpoint false, job true")));
  ModelSpec other = spec;
  other.params[3].shape = {7, 6};  // seq.2.weight, flat parameter 1
  EXPECT_THAT(r.CheckFits(MakeTestLayout(other, TestLayoutOptions(2)), 2),
              StatusIs(kMismatch, HasSubstr("flat_params[1]")));
  other = spec;
  other.wrap = {};
  EXPECT_THAT(
      r.CheckFits(MakeTestLayout(other, TestLayoutOptions(2)), 2),
      StatusIs(kMismatch, HasSubstr("flat parameters: checkpoint has 2, "
                                    "job has 1")));
}

TEST(ShardedCheckpointTest, WriteRejectsContentThatDoesNotFitTheLayout) {
  FaultInjectionFileSystem fs;
  const ModelLayout layout =
      MakeTestLayout(TinyModelSpec(), TestLayoutOptions(2));
  const int64_t numel0 = layout.flat_params()[0].sharded_numel();
  auto attempt = [&](auto edit) {
    ShardedFixture f = MakeShardedFixture(layout, 2, 1);
    edit(f);
    return WriteShardedCheckpoint(fs, "ckpt", f.content);
  };
  EXPECT_THAT(
      attempt([](ShardedFixture& f) { f.content.ranks.pop_back(); }),
      StatusIs(kInvalid, HasSubstr("1 ranks of content for a layout over 2")));
  EXPECT_THAT(
      attempt([](ShardedFixture& f) { f.content.world_size = 4; }),
      StatusIs(kInvalid, HasSubstr("world size 4 does not fit a FULL_SHARD "
                                   "layout over 2 ranks")));
  EXPECT_THAT(attempt([](ShardedFixture& f) { f.content.layout = nullptr; }),
              StatusIs(kInvalid));
  EXPECT_THAT(
      attempt([](ShardedFixture& f) {
        auto& t = f.content.ranks[1].tensors;
        t.erase(t.begin());  // flat_params.0
      }),
      StatusIs(kInvalid,
               HasSubstr("rank00001.safetensors: no tensor "
                         "'flat_params.0' (flat parameter of unit '')")));
  EXPECT_THAT(
      attempt(
          [](ShardedFixture& f) { f.content.ranks[0].tensors[0].shape = {1}; }),
      StatusIs(kInvalid, HasSubstr(absl::StrCat(
                             "rank00000.safetensors: tensor 'flat_params.0': "
                             "shape is [1], the layout's shard is [",
                             numel0, "]"))));
  EXPECT_THAT(
      attempt([](ShardedFixture& f) {
        f.content.ranks[0].tensors[0].dtype = DType::kBFloat16;
      }),
      StatusIs(kInvalid, HasSubstr("dtype is bfloat16, the layout's flat "
                                   "parameter is float32")));
  EXPECT_THAT(
      attempt([](ShardedFixture& f) {
        f.content.ranks[0].tensors[1].shape = {2, 2};
      }),
      StatusIs(kInvalid, HasSubstr("tensor 'optim.0.exp_avg': shape is "
                                   "[2, 2], expected [] or the shard's")));
  EXPECT_THAT(
      attempt([](ShardedFixture& f) {
        f.content.ranks[0].tensors[0].name = "flat_params.00";
      }),
      StatusIs(kInvalid, HasSubstr("'flat_params.00': not flat_params.{i}")));
  EXPECT_THAT(attempt([](ShardedFixture& f) {
                f.content.ranks[0].tensors[1].name = "optim.2.exp_avg";
              }),
              StatusIs(kInvalid,
                       HasSubstr("'optim.2.exp_avg': not optim.{i}.{state}")));
  EXPECT_THAT(
      attempt([](ShardedFixture& f) {
        f.content.ranks[0].tensors[1].name = "optim.0";
      }),
      StatusIs(kInvalid, HasSubstr("'optim.0': not optim.{i}.{state}")));
  EXPECT_THAT(attempt([](ShardedFixture& f) {
                f.content.ranks[0].tensors[1].name = "buffers.0";
              }),
              StatusIs(kInvalid, HasSubstr("'buffers.0': not buffers.{fqn} "
                                           "for a buffer of the model")));
  EXPECT_THAT(attempt([](ShardedFixture& f) {
                f.content.ranks[0].tensors[1].name = "moments.0";
              }),
              StatusIs(kInvalid, HasSubstr("'moments.0': unexpected")));
  EXPECT_THAT(
      attempt([](ShardedFixture& f) { f.content.ranks[1].sidecar = 3; }),
      StatusIs(kInvalid, HasSubstr("rank00001.json: must be a JSON object")));
  EXPECT_THAT(ListDir(fs, "/"), ::testing::IsEmpty());
}

class ShardedTamperTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_THAT(WriteShardedCheckpoint(fs_, "ckpt", fixture_.content), IsOk());
  }
  void Replace(const std::string& name, const std::string& contents) {
    ASSERT_THAT(WriteFileDurably(fs_, JoinPath("ckpt", name), contents),
                IsOk());
    Remanifest(fs_, "ckpt", CheckpointKind::kSharded);
  }
  std::string Read(const std::string& name) {
    return ReadWholeFile(fs_, JoinPath("ckpt", name));
  }

  FaultInjectionFileSystem fs_;
  ModelLayout layout_ = MakeTestLayout(TinyModelSpec(), TestLayoutOptions(2));
  ShardedFixture fixture_ = MakeShardedFixture(layout_, 2, 1);
};

TEST_F(ShardedTamperTest, LayoutThatItsModelSpecDoesNotGive) {
  json doc = json::parse(Read("layout.json"));
  const int64_t numel = doc["flat_params"][1]["sharded_numel"].get<int64_t>();
  doc["flat_params"][1]["sharded_numel"] = numel + 2;
  Replace("layout.json", doc.dump());
  EXPECT_THAT(
      ShardedCheckpointReader::Open(fs_, "ckpt"),
      StatusIs(kDataLoss, HasSubstr(absl::StrCat(
                              "ckpt/layout.json: flat_params[1].sharded_numel "
                              "is ",
                              numel + 2,
                              ", but the layout recomputed "
                              "from model_spec has ",
                              numel))));
}

TEST_F(ShardedTamperTest, MalformedLayoutJson) {
  json doc = json::parse(Read("layout.json"));
  json bad = doc;
  bad["version"] = 2;
  Replace("layout.json", bad.dump());
  EXPECT_THAT(ShardedCheckpointReader::Open(fs_, "ckpt"),
              StatusIs(kDataLoss, HasSubstr("\"version\" is 2, expected 1")));
  bad = doc;
  bad["model_spec"]["params"][0]["shape"] = {-1};
  Replace("layout.json", bad.dump());
  EXPECT_THAT(ShardedCheckpointReader::Open(fs_, "ckpt"),
              StatusIs(kDataLoss, HasSubstr("model_spec")));
  bad = doc;
  bad["world_size"] = 3;
  Replace("layout.json", bad.dump());
  EXPECT_THAT(
      ShardedCheckpointReader::Open(fs_, "ckpt"),
      StatusIs(kDataLoss, HasSubstr("world_size 3 is not a positive multiple "
                                    "of shard_group_size 2")));
  bad = doc;
  bad["strategy"] = "SIDEWAYS";
  Replace("layout.json", bad.dump());
  EXPECT_THAT(ShardedCheckpointReader::Open(fs_, "ckpt"),
              StatusIs(kDataLoss, HasSubstr("\"strategy\"")));
  Replace("layout.json", "{\"version\": 1,");
  EXPECT_THAT(
      ShardedCheckpointReader::Open(fs_, "ckpt"),
      StatusIs(kDataLoss, HasSubstr("ckpt/layout.json:1:15: malformed JSON")));
}

// 100,000 levels of nesting used to overflow the stack in the first copy,
// comparison or dump of the parsed document (here: quoting "version").
TEST_F(ShardedTamperTest, DeeplyNestedJsonIsRefusedNamingTheFile) {
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  const std::string layout = Read("layout.json");
  Replace("layout.json", absl::StrCat(R"({"version": )", deep, "}"));
  EXPECT_THAT(ShardedCheckpointReader::Open(fs_, "ckpt"),
              StatusIs(kDataLoss, HasSubstr("ckpt/layout.json: nested deeper "
                                            "than 512 levels")));
  Replace("layout.json", layout);
  FLATPARAM_ASSERT_OK(ShardedCheckpointReader::Open(fs_, "ckpt").status());
  Replace("rank00001.json", absl::StrCat(R"({"extra": {"a": )", deep, "}}"));
  EXPECT_THAT(ShardedCheckpointReader::Open(fs_, "ckpt"),
              StatusIs(kDataLoss, HasSubstr("ckpt/rank00001.json: nested "
                                            "deeper than 512 levels")));
}

TEST_F(ShardedTamperTest, RankFileWithTheWrongTensors) {
  const float one = 1;
  std::vector<TensorSource> tensors = {
      TensorSourceFromBytes("flat_params.0", DType::kFloat32, {}, &one)};
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      auto file, fs_.NewWritableFile("ckpt/rank00001.safetensors"));
  ASSERT_THAT(WriteSafetensors(*file, "x", tensors,
                               {{"rank", "1"}, {"shard_group_size", "2"}}),
              IsOk());
  ASSERT_THAT(file->Close(), IsOk());
  Remanifest(fs_, "ckpt", CheckpointKind::kSharded);
  EXPECT_THAT(
      ShardedCheckpointReader::Open(fs_, "ckpt"),
      StatusIs(kDataLoss, HasSubstr("ckpt/rank00001.safetensors: tensor "
                                    "'flat_params.0': shape is []")));
}

TEST_F(ShardedTamperTest, SwappedRankFiles) {
  const std::string r0 = Read("rank00000.safetensors");
  const std::string r1 = Read("rank00001.safetensors");
  Replace("rank00000.safetensors", r1);
  Replace("rank00001.safetensors", r0);
  EXPECT_THAT(ShardedCheckpointReader::Open(fs_, "ckpt"),
              StatusIs(kDataLoss, HasSubstr("ckpt/rank00000.safetensors: "
                                            "__metadata__ says rank 1 of 2, "
                                            "expected rank 0 of 2")));
}

TEST_F(ShardedTamperTest, MissingRankFileAndWrongKind) {
  ASSERT_THAT(fs_.RemoveFile("ckpt/rank00001.safetensors"), IsOk());
  Remanifest(fs_, "ckpt", CheckpointKind::kSharded);
  EXPECT_THAT(ShardedCheckpointReader::Open(fs_, "ckpt"),
              StatusIs(kDataLoss,
                       HasSubstr("ckpt: a sharded checkpoint needs "
                                 "rank00001.safetensors, which is missing")));
  EXPECT_THAT(FullCheckpointReader::Open(fs_, "ckpt"),
              StatusIs(kDataLoss,
                       HasSubstr("a sharded checkpoint, expected a full one")));
}

TEST_F(ShardedTamperTest, TruncatedRankFileCaughtBySizeEvenWithoutChecksums) {
  std::string r1 = Read("rank00001.safetensors");
  r1.resize(r1.size() - 1);
  ASSERT_THAT(WriteFileDurably(fs_, "ckpt/rank00001.safetensors", r1), IsOk());
  CheckpointOpenOptions fast;
  fast.verify_checksums = false;
  EXPECT_THAT(
      ShardedCheckpointReader::Open(fs_, "ckpt", fast),
      StatusIs(kDataLoss, HasSubstr("ckpt/rank00001.safetensors: size is")));
}

// --- Per-rank reads
// -----------------------------------------------------------

// Reads every tensor of rank `rank`'s file, in data order, as a loading
// rank does.
absl::Status ReadAllTensors(const ShardedCheckpointReader& reader,
                            int64_t rank) {
  FLATPARAM_ASSIGN_OR_RETURN(SafetensorsReader file, reader.OpenRank(rank));
  for (const SafetensorsEntry& e : file.tensors()) {
    FLATPARAM_RETURN_IF_ERROR(file.ReadHostTensor(e.name).status());
  }
  return absl::OkStatus();
}

TEST(ShardedCheckpointTest, EachRankReadsItsShareAndTheMetadata) {
  FaultInjectionFileSystem disk;
  const ModelLayout layout =
      MakeTestLayout(TinyModelSpec(), TestLayoutOptions(4));
  ShardedFixture fixture = MakeShardedFixture(layout, 4, 1);
  ASSERT_THAT(WriteShardedCheckpoint(disk, "ckpt", fixture.content), IsOk());
  CountingFileSystem fs(disk);
  int64_t tensors = 0, metadata = 0;
  for (const std::string& name : ListDir(disk, "ckpt")) {
    FLATPARAM_ASSERT_OK_AND_ASSIGN(uint64_t size,
                                   disk.GetFileSize(JoinPath("ckpt", name)));
    (absl::EndsWith(name, ".safetensors") ? tensors : metadata) += size;
  }
  // Everything, as before: every rank file checksummed.
  FLATPARAM_ASSERT_OK(ShardedCheckpointReader::Open(fs, "ckpt").status());
  EXPECT_GE(fs.total(), tensors);
  // The metadata only; then this process's rank.
  fs.Reset();
  CheckpointOpenOptions mine;
  mine.ranks.emplace();
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      ShardedCheckpointReader reader,
      ShardedCheckpointReader::Open(fs, "ckpt", mine));
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(fs.read(absl::StrFormat("rank%05d.safetensors", r)), 0) << r;
  }
  // Reading its rank verifies what it reads, block by block: each byte of
  // its file once, nothing of the others.
  FLATPARAM_ASSERT_OK(ReadAllTensors(reader, 2));
  const int64_t own = *disk.GetFileSize("ckpt/rank00002.safetensors");
  for (int r : {0, 1, 3}) {
    EXPECT_EQ(fs.read(absl::StrFormat("rank%05d.safetensors", r)), 0) << r;
  }
  EXPECT_EQ(fs.read("rank00002.safetensors"), own);
  EXPECT_LE(fs.total(), own + 2 * metadata);

  // Damage another rank's tensors (same size): this rank's load does not
  // read them and still verifies its own; that rank's check catches it.
  std::string r3 = ReadWholeFile(disk, "ckpt/rank00003.safetensors");
  r3.back() ^= 0x40;
  ASSERT_THAT(WriteFileDurably(disk, "ckpt/rank00003.safetensors", r3), IsOk());
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      reader, ShardedCheckpointReader::Open(fs, "ckpt", mine));
  FLATPARAM_ASSERT_OK(ReadAllTensors(reader, 2));
  EXPECT_THAT(ReadAllTensors(reader, 3),
              StatusIs(kDataLoss, HasSubstr("(checksum block 0 of 1)")));
  FLATPARAM_ASSERT_OK(reader.VerifyRank(2));
  EXPECT_THAT(reader.VerifyRank(3),
              StatusIs(kDataLoss, HasSubstr("rank00003.safetensors: xxh3_64")));
  EXPECT_THAT(reader.VerifyRank(4),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ShardedCheckpointReader::Open(fs, "ckpt").status(),
              StatusIs(kDataLoss, HasSubstr("rank00003.safetensors")));
  mine.ranks.emplace(1, int64_t{3});
  EXPECT_THAT(ShardedCheckpointReader::Open(fs, "ckpt", mine).status(),
              StatusIs(kDataLoss, HasSubstr("rank00003.safetensors")));
}

// --- Recovery and crash safety -----------------------------------------------

TEST(RecoverCheckpointDirTest, SettlesEveryLeftoverState) {
  FaultInjectionFileSystem fs;
  const ModelSpec spec = TinyModelSpec();
  const FullFixture v1 = MakeFullFixture(spec, 1);
  const FullFixture v2 = MakeFullFixture(spec, 2);
  ASSERT_THAT(fs.CreateDir("p"), IsOk());
  ASSERT_THAT(WriteFullCheckpoint(fs, "p/ckpt", v1.content), IsOk());
  // Crashed between steps 3 and 4: only the backup.
  ASSERT_THAT(fs.Rename("p/ckpt", "p/ckpt.previous"), IsOk());
  ASSERT_THAT(fs.CreateDir("p/ckpt.tmp-0123"), IsOk());
  ASSERT_THAT(fs.CreateDir("p/ckpt.tmpx"), IsOk());  // not ours
  ASSERT_THAT(fs.CreateDir("p/ckpt2"), IsOk());      // not ours
  FLATPARAM_ASSERT_OK_AND_ASSIGN(std::string resolved,
                                 ResolveCheckpointDir(fs, "p/ckpt"));
  EXPECT_EQ(resolved, "p/ckpt.previous");
  EXPECT_THAT(FullVersion(fs, "p/ckpt", spec), IsOkAndHolds(1));
  ASSERT_THAT(RecoverCheckpointDir(fs, "p/ckpt"), IsOk());
  EXPECT_THAT(ListDir(fs, "p"), ElementsAre("ckpt", "ckpt.tmpx", "ckpt2"));
  EXPECT_THAT(FullVersion(fs, "p/ckpt", spec), IsOkAndHolds(1));

  // After step 4: both; the backup is stale.
  ASSERT_THAT(WriteFullCheckpoint(fs, "p/ckpt.previous", v2.content), IsOk());
  ASSERT_THAT(RecoverCheckpointDir(fs, "p/ckpt"), IsOk());
  EXPECT_THAT(ListDir(fs, "p"), ElementsAre("ckpt", "ckpt.tmpx", "ckpt2"));
  EXPECT_THAT(FullVersion(fs, "p/ckpt", spec), IsOkAndHolds(1));

  EXPECT_THAT(ResolveCheckpointDir(fs, "p/none"),
              StatusIs(absl::StatusCode::kNotFound));
}

// How the file system is left when the write stops.
enum class Stop {
  kProcessDies,  // the process dies; the OS keeps everything
  kPowerCut,     // everything not fsynced is lost
  kPartialLoss,  // a seeded random part of what was not fsynced is lost
};

std::string StopName(Stop stop) {
  switch (stop) {
    case Stop::kProcessDies:
      return "process dies";
    case Stop::kPowerCut:
      return "power cut";
    case Stop::kPartialLoss:
      return "partial loss";
  }
  return "";
}

void Apply(Stop stop, uint64_t seed, FaultInjectionFileSystem& fs) {
  switch (stop) {
    case Stop::kProcessDies:
      fs.FailOperationsFrom(-1);
      break;
    case Stop::kPowerCut:
      fs.Crash();
      break;
    case Stop::kPartialLoss:
      fs.CrashKeepingSome(seed);
      break;
  }
}

// Runs `write(fs, version)` of version 2 over version 1 (or over nothing),
// stopping it at every operation in turn, and checks that the checkpoint
// is then version 1 (or absent) or version 2, whole; and that the next
// write, version 3, succeeds and cleans up. `read` returns the version.
template <typename Write, typename Read>
void CrashAtEveryStep(const Write& write, const Read& read, bool with_old,
                      Stop stop) {
  // Count the operations of an undisturbed write.
  int64_t steps = 0;
  {
    FaultInjectionFileSystem fs;
    ASSERT_THAT(fs.CreateDir("p"), IsOk());
    if (with_old) {
      ASSERT_THAT(write(fs, 1), IsOk());
    }
    fs.FailOperationsFrom(-1);
    ASSERT_THAT(write(fs, 2), IsOk());
    steps = fs.operation_count();
  }
  ASSERT_GT(steps, 20);
  std::set<int> seen;
  for (int64_t n = 0; n <= steps; ++n) {
    for (uint64_t seed = 0; seed < (stop == Stop::kPartialLoss ? 2u : 1u);
         ++seed) {
      SCOPED_TRACE(absl::StrCat(StopName(stop), " at operation ", n, " of ",
                                steps, " (seed ", seed, ")"));
      FaultInjectionFileSystem fs;
      ASSERT_THAT(fs.CreateDir("p"), IsOk());
      ASSERT_THAT(fs.SyncDir("/"), IsOk());
      if (with_old) {
        ASSERT_THAT(write(fs, 1), IsOk());
      }
      fs.FailOperationsFrom(n);
      const absl::Status status = write(fs, 2);
      if (n < steps) {
        ASSERT_FALSE(status.ok());
        ASSERT_TRUE(fs.failed());
      } else {
        ASSERT_THAT(status, IsOk());
      }
      const std::vector<std::string> log = fs.operation_log();
      Apply(stop, seed * 1000003 + n, fs);

      absl::StatusOr<int> version = read(fs);
      if (status.ok()) {
        // A write that returned OK is durable.
        ASSERT_THAT(version, IsOkAndHolds(2)) << fs.DebugString();
      }
      if (!with_old && absl::IsNotFound(version.status())) {
        seen.insert(0);
      } else {
        ASSERT_THAT(version, IsOk())
            << "last operations:\n"
            << absl::StrJoin(log.end() - std::min<size_t>(log.size(), 6),
                             log.end(), "\n")
            << "\nfile system:\n"
            << fs.DebugString();
        ASSERT_TRUE(*version == 2 || (with_old && *version == 1)) << *version;
        seen.insert(*version);
      }
      // The next write recovers and leaves nothing else behind.
      ASSERT_THAT(write(fs, 3), IsOk());
      ASSERT_THAT(read(fs), IsOkAndHolds(3));
      ASSERT_THAT(ListDir(fs, "p"), ElementsAre("ckpt"));
    }
  }
  // Both outcomes happen: the protocol is exercised on both sides of the
  // switch-over.
  EXPECT_TRUE(seen.count(2));
  EXPECT_TRUE(seen.count(with_old ? 1 : 0));
}

class CrashTest : public ::testing::TestWithParam<std::tuple<Stop, bool>> {};

TEST_P(CrashTest, FullCheckpointIsOldOrNew) {
  const ModelSpec spec = TinyModelSpec();
  auto write = [&](FaultInjectionFileSystem& fs, int version) {
    const FullFixture f = MakeFullFixture(spec, version);
    return WriteFullCheckpoint(fs, "p/ckpt", f.content);
  };
  auto read = [&](FaultInjectionFileSystem& fs) {
    return FullVersion(fs, "p/ckpt", spec);
  };
  CrashAtEveryStep(write, read, std::get<1>(GetParam()),
                   std::get<0>(GetParam()));
}

TEST_P(CrashTest, ShardedCheckpointIsOldOrNew) {
  const ModelLayout layout =
      MakeTestLayout(TinyModelSpec(), TestLayoutOptions(2));
  auto write = [&](FaultInjectionFileSystem& fs, int version) {
    const ShardedFixture f = MakeShardedFixture(layout, 2, version);
    return WriteShardedCheckpoint(fs, "p/ckpt", f.content);
  };
  auto read = [&](FaultInjectionFileSystem& fs) {
    return ShardedVersion(fs, "p/ckpt", layout, 2);
  };
  CrashAtEveryStep(write, read, std::get<1>(GetParam()),
                   std::get<0>(GetParam()));
}

INSTANTIATE_TEST_SUITE_P(
    Stops, CrashTest,
    ::testing::Combine(::testing::Values(Stop::kProcessDies, Stop::kPowerCut,
                                         Stop::kPartialLoss),
                       ::testing::Bool()),
    [](const ::testing::TestParamInfo<std::tuple<Stop, bool>>& info) {
      std::string name = StopName(std::get<0>(info.param));
      std::replace(name.begin(), name.end(), ' ', '_');
      return absl::StrCat(name,
                          std::get<1>(info.param) ? "_OverOld" : "_First");
    });

// A crash during the write that follows a crash: the recovery steps are
// crash-safe too. After the first crash the checkpoint is some version v;
// after the second it must be v or the third write's version.
TEST(CrashTest, CrashDuringRecoveryIsOldOrNew) {
  const ModelSpec spec = TinyModelSpec();
  auto write = [&](FaultInjectionFileSystem& fs, int version) {
    const FullFixture f = MakeFullFixture(spec, version);
    return WriteFullCheckpoint(fs, "p/ckpt", f.content);
  };
  auto setup = [&](FaultInjectionFileSystem& fs, int64_t first) {
    ASSERT_THAT(fs.CreateDir("p"), IsOk());
    ASSERT_THAT(fs.SyncDir("/"), IsOk());
    ASSERT_THAT(write(fs, 1), IsOk());
    fs.FailOperationsFrom(first);
    write(fs, 2).IgnoreError();
    fs.CrashKeepingSome(static_cast<uint64_t>(first));
  };
  int64_t steps = 0;
  {
    FaultInjectionFileSystem fs;
    ASSERT_THAT(fs.CreateDir("p"), IsOk());
    ASSERT_THAT(write(fs, 1), IsOk());
    fs.FailOperationsFrom(-1);
    ASSERT_THAT(write(fs, 2), IsOk());
    steps = fs.operation_count();
  }
  // Crash states that leave something for recovery to do, once per
  // distinct shape (which names are left, and which version they hold).
  std::set<std::string> shapes;
  for (int64_t first = 0; first < steps; ++first) {
    FaultInjectionFileSystem probe;
    setup(probe, first);
    std::vector<std::string> names = ListDir(probe, "p");
    if (names.size() == 1) continue;
    FLATPARAM_ASSERT_OK_AND_ASSIGN(int before,
                                   FullVersion(probe, "p/ckpt", spec));
    for (std::string& name : names) {
      if (absl::StartsWith(name, "ckpt.tmp-")) name = "ckpt.tmp-*";
    }
    if (!shapes.insert(absl::StrCat(absl::StrJoin(names, ","), " v", before))
             .second) {
      continue;
    }
    probe.FailOperationsFrom(-1);
    ASSERT_THAT(write(probe, 3), IsOk());
    const int64_t second_steps = probe.operation_count();
    for (int64_t second = 0; second < second_steps; ++second) {
      SCOPED_TRACE(
          absl::StrCat("first crash at ", first, ", second at ", second));
      FaultInjectionFileSystem fs;
      setup(fs, first);
      fs.FailOperationsFrom(second);
      ASSERT_FALSE(write(fs, 3).ok());
      fs.Crash();
      FLATPARAM_ASSERT_OK_AND_ASSIGN(int after,
                                     FullVersion(fs, "p/ckpt", spec));
      EXPECT_TRUE(after == before || after == 3) << before << " then " << after;
    }
  }
  // At least: a stale temporary directory next to the old checkpoint, the
  // backup alone, and the backup next to the new checkpoint.
  EXPECT_GE(shapes.size(), 3u) << absl::StrJoin(shapes, "; ");
}

}  // namespace
}  // namespace checkpoint
}  // namespace flatparam
