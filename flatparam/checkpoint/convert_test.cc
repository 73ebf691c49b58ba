// Error paths and reports of the offline conversions (the round trips are
// convert_property_test's, memory convert_memory_test's).
#include "flatparam/checkpoint/convert.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "flatparam/base/dtype.h"
#include "flatparam/base/status_matchers.h"
#include "flatparam/checkpoint/checkpoint_dir.h"
#include "flatparam/checkpoint/file_system.h"
#include "flatparam/checkpoint/internal/checkpoint_testutil.h"
#include "flatparam/checkpoint/internal/counting_file_system.h"
#include "flatparam/checkpoint/manifest.h"
#include "flatparam/checkpoint/training_state.h"
#include "flatparam/flatten.h"
#include "flatparam/layout.h"
#include "flatparam/model_layout.h"
#include "flatparam/optim/fsdp_optim.h"
#include "flatparam/optim/optim_state.h"

namespace flatparam {
namespace checkpoint {
namespace {

using optim::ParamKey;
using ::testing::HasSubstr;

constexpr auto kInvalid = absl::StatusCode::kInvalidArgument;
constexpr auto kMismatch = absl::StatusCode::kFailedPrecondition;
constexpr auto kDataLoss = absl::StatusCode::kDataLoss;

ModelSpec Spec() {
  ModelSpec m;
  m.name = "tiny";
  m.params = {{"a.w", {4, 3}}, {"a.b", {4}}, {"c.w", {5}}};
  m.wrap = {"a"};
  return m;
}

ModelLayout Layout(int64_t world) {
  LayoutOptions o;
  o.world_size = world;
  return *ModelLayout::Create(Spec(), o);
}

// Rank states for `layout` with AdamW-like state on flat parameter 1 (unit
// "a").
std::vector<RankState> Ranks(const ModelLayout& layout) {
  std::vector<RankState> ranks(layout.options().world_size);
  for (RankState& r : ranks) {
    for (const FlatParamLayout& f : layout.flat_params()) {
      r.flat_params.push_back(HostTensor::Flat(f.dtype(), f.sharded_numel()));
    }
    const int64_t n = layout.flat_params()[1].sharded_numel();
    r.optim.state[ParamKey(int64_t{1})]["exp_avg"] =
        HostTensor::Flat(DType::kFloat32, n);
    r.optim.state[ParamKey(int64_t{1})]["step"] =
        optim::ScalarTensor(DType::kFloat32, 3);
    r.optim.state[ParamKey(int64_t{1})]["beta"] = 0.5;
  }
  return ranks;
}

TEST(ConvertTest, ConsolidateChecksTheRanksAgainstRankZero) {
  const ModelLayout layout = Layout(2);
  FaultInjectionFileSystem fs;
  std::vector<RankState> ranks = Ranks(layout);
  FLATPARAM_ASSERT_OK(WriteRankStates(fs, "/ok", layout, ranks));
  FLATPARAM_ASSERT_OK(ConsolidateCheckpoint(fs, "/ok", "/full"));

  std::vector<RankState> missing = ranks;
  missing[1].optim.state.erase(ParamKey(int64_t{1}));
  FLATPARAM_ASSERT_OK(WriteRankStates(fs, "/missing", layout, missing));
  EXPECT_THAT(ConsolidateCheckpoint(fs, "/missing", "/x"),
              StatusIs(kMismatch,
                       HasSubstr("Rank 1 is missing states for the parameters: "
                                 "[('a.w', 'a.b')]")));

  std::vector<RankState> scalar = ranks;
  scalar[1].optim.state[ParamKey(int64_t{1})]["beta"] = 0.25;
  FLATPARAM_ASSERT_OK(WriteRankStates(fs, "/scalar", layout, scalar));
  EXPECT_THAT(ConsolidateCheckpoint(fs, "/scalar", "/x"),
              StatusIs(kInvalid, HasSubstr("Differing replicated optimizer "
                                           "state values across ranks for "
                                           "state beta")));
  LayoutOptions four;
  four.world_size = 4;
  EXPECT_THAT(ReshardCheckpoint(fs, "/scalar", four, 0, "/x"),
              StatusIs(kInvalid, HasSubstr("state beta")));

  std::vector<RankState> names = ranks;
  names[1].optim.state[ParamKey(int64_t{1})]["extra"] = int64_t{1};
  FLATPARAM_ASSERT_OK(WriteRankStates(fs, "/names", layout, names));
  EXPECT_THAT(ConsolidateCheckpoint(fs, "/names", "/x"),
              StatusIs(kInvalid, HasSubstr("Differing optimizer state names "
                                           "across ranks")));
  EXPECT_FALSE(*fs.Exists("/x"));
}

TEST(ConvertTest, ShardAppliesTheFlatteningRules) {
  FaultInjectionFileSystem fs;
  const auto write_full = [&](optim::OptimStateDict optim) {
    FullState state;
    for (const ParamSpec& p : Spec().params) {
      state.params[p.fqn] = HostTensor(p.dtype, p.shape);
    }
    state.optim = std::move(optim);
    absl::StatusOr<FullCheckpointContent> c = MakeFullContent(state);
    EXPECT_TRUE(c.ok()) << c.status();
    return WriteFullCheckpoint(fs, "/full", *c);
  };
  LayoutOptions two;
  two.world_size = 2;
  optim::OptimStateDict d;
  d.state[ParamKey(std::string("a.w"))]["exp_avg"] =
      HostTensor(DType::kFloat32, {4, 3});
  d.state[ParamKey(std::string("a.b"))]["exp_avg_sq"] =
      HostTensor(DType::kFloat32, {4});
  FLATPARAM_ASSERT_OK(write_full(d));
  EXPECT_THAT(ShardCheckpoint(fs, "/full", Spec(), two, 0, "/s"),
              StatusIs(kInvalid, HasSubstr("Differing optimizer state names "
                                           "for the unflattened parameters: "
                                           "['a.w', 'a.b']")));
  d.state.clear();
  d.state[ParamKey(std::string("a.w"))]["lr"] = 0.1;
  d.state[ParamKey(std::string("a.b"))]["lr"] = 0.2;
  FLATPARAM_ASSERT_OK(write_full(d));
  EXPECT_THAT(ShardCheckpoint(fs, "/full", Spec(), two, 0, "/s"),
              StatusIs(kInvalid, HasSubstr("must have scalar state with the "
                                           "same value")));
  d.state.clear();
  d.state[ParamKey(std::string("a.w"))]["exp_avg"] =
      HostTensor(DType::kFloat32, {3, 4});
  FLATPARAM_ASSERT_OK(write_full(d));
  // The checkpoint itself does not fit the model.
  EXPECT_THAT(ShardCheckpoint(fs, "/full", Spec(), two, 0, "/s"),
              StatusIs(kMismatch, HasSubstr("expected [] or [4, 3]")));
  d.state.clear();
  d.state[ParamKey(std::string("a.w"))]["m"] =
      HostTensor(DType::kInt32, {4, 3});
  FLATPARAM_ASSERT_OK(write_full(d));
  EXPECT_THAT(ShardCheckpoint(fs, "/full", Spec(), two, 0, "/s"),
              StatusIs(kInvalid, HasSubstr("Cannot flatten integer dtype")));
  // Non-tensor state of other keys passes through.
  d.state.clear();
  d.state[ParamKey(std::string("__user__"))]["count"] = int64_t{3};
  FLATPARAM_ASSERT_OK(write_full(d));
  FLATPARAM_ASSERT_OK(ShardCheckpoint(fs, "/full", Spec(), two, 0, "/s"));
  EXPECT_THAT(ShardCheckpoint(fs, "/full", Spec(), two, 0, "/full/"),
              StatusIs(kInvalid, HasSubstr("is the input directory")));
  FLATPARAM_ASSERT_OK_AND_ASSIGN(auto reader,
                                 ShardedCheckpointReader::Open(fs, "/s"));
  FLATPARAM_ASSERT_OK_AND_ASSIGN(RankState r1, ReadRankState(reader, 1));
  EXPECT_EQ(
      std::get<int64_t>(
          r1.optim.state.at(ParamKey(std::string("__user__"))).at("count")),
      3);
}

// Param-group keys that are not model parameters are kept as unmanaged
// parameters, listed after the flat parameters in the optimizer's order
// (their first appearance), not sorted: as ShardFullOptimState lists them
// for unmanaged_params in that order.
TEST(ConvertTest, ShardListsGroupsLikeShardFullOptimState) {
  FaultInjectionFileSystem fs;
  FullState state;
  for (const ParamSpec& p : Spec().params) {
    state.params[p.fqn] = HostTensor(p.dtype, p.shape);
  }
  optim::OptimStateDict& d = state.optim;
  d.state[ParamKey(std::string("a.w"))]["exp_avg"] =
      HostTensor(DType::kFloat32, {4, 3});
  d.state[ParamKey(std::string("a.b"))]["exp_avg"] =
      HostTensor(DType::kFloat32, {4});
  d.state[ParamKey(std::string("z.ignored"))]["count"] = int64_t{2};
  d.param_groups.resize(2);
  d.param_groups[0].params = {std::string("z.ignored"), std::string("a.w"),
                              std::string("b.ignored"), std::string("c.w"),
                              std::string("a.b")};
  d.param_groups[0].hyperparams = {{"lr", 0.1}};
  d.param_groups[1].params = {std::string("y.ignored"),
                              std::string("b.ignored")};
  d.param_groups[1].hyperparams = {{"lr", 0.2}};
  FLATPARAM_ASSERT_OK_AND_ASSIGN(FullCheckpointContent content,
                                 MakeFullContent(state));
  FLATPARAM_ASSERT_OK(WriteFullCheckpoint(fs, "/full", content));
  LayoutOptions two;
  two.world_size = 2;
  FLATPARAM_ASSERT_OK(ShardCheckpoint(fs, "/full", Spec(), two, 0, "/s"));

  optim::OptimStateOptions in_memory;
  in_memory.unmanaged_params = {"z.ignored", "b.ignored", "y.ignored"};
  const ModelLayout layout = Layout(2);
  FLATPARAM_ASSERT_OK_AND_ASSIGN(auto reader,
                                 ShardedCheckpointReader::Open(fs, "/s"));
  for (int64_t r = 0; r < 2; ++r) {
    FLATPARAM_ASSERT_OK_AND_ASSIGN(RankState got, ReadRankState(reader, r));
    FLATPARAM_ASSERT_OK_AND_ASSIGN(
        optim::OptimStateDict want,
        optim::ShardFullOptimState(layout, d, r, in_memory));
    EXPECT_EQ(optim::FirstDifference(got.optim, want), std::nullopt)
        << "rank " << r;
    ASSERT_EQ(got.optim.param_groups.size(), 2u);
    EXPECT_EQ(
        got.optim.param_groups[0].params,
        (std::vector<ParamKey>{int64_t{0}, int64_t{1}, std::string("z.ignored"),
                               std::string("b.ignored")}));
    EXPECT_EQ(got.optim.param_groups[1].params,
              (std::vector<ParamKey>{std::string("b.ignored"),
                                     std::string("y.ignored")}));
  }

  // A full checkpoint's groups list names, like its state.
  d.param_groups[1].params.push_back(int64_t{0});
  FLATPARAM_ASSERT_OK_AND_ASSIGN(content, MakeFullContent(state));
  FLATPARAM_ASSERT_OK(WriteFullCheckpoint(fs, "/ids", content));
  EXPECT_THAT(ShardCheckpoint(fs, "/ids", Spec(), two, 0, "/x"),
              StatusIs(kDataLoss, HasSubstr("param_groups[1] lists 0, an ID")));
}

TEST(ConvertTest, VerifyReportsAndCatchesDamage) {
  const ModelLayout layout = Layout(2);
  FaultInjectionFileSystem fs;
  FLATPARAM_ASSERT_OK(WriteRankStates(fs, "/s", layout, Ranks(layout)));
  FLATPARAM_ASSERT_OK_AND_ASSIGN(CheckpointReport sharded,
                                 VerifyCheckpoint(fs, "/s"));
  EXPECT_EQ(sharded.kind, CheckpointKind::kSharded);
  EXPECT_EQ(sharded.files, 5);
  EXPECT_EQ(sharded.world_size, 2);
  EXPECT_EQ(sharded.shard_group_size, 2);
  EXPECT_EQ(sharded.flat_params, 2);
  EXPECT_EQ(sharded.model, "tiny");
  EXPECT_GT(sharded.bytes, 0u);
  FLATPARAM_ASSERT_OK(ConsolidateCheckpoint(fs, "/s", "/f"));
  FLATPARAM_ASSERT_OK_AND_ASSIGN(CheckpointReport full,
                                 VerifyCheckpoint(fs, "/f"));
  EXPECT_EQ(full.kind, CheckpointKind::kFull);
  EXPECT_EQ(full.files, 3);

  // Flip one byte of a rank file.
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      std::string bytes,
      ReadFileToString(fs, "/s/rank00001.safetensors", 1 << 20));
  bytes[bytes.size() - 1] ^= 1;
  FLATPARAM_ASSERT_OK(WriteFileDurably(fs, "/s/rank00001.safetensors", bytes));
  EXPECT_THAT(VerifyCheckpoint(fs, "/s"),
              StatusIs(kDataLoss, HasSubstr("rank00001.safetensors")));
  EXPECT_THAT(VerifyCheckpoint(fs, "/nothing"),
              StatusIs(absl::StatusCode::kNotFound));
}

// Rewrites `dir`'s manifest to match its files, as a tamperer who knows the
// format would, so that the checks after the manifest's are what is tested.
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
  FLATPARAM_ASSERT_OK(WriteManifest(fs, dir, m));
}

// A full checkpoint of Spec() with state "s" on "a.w" whose optim.json gets
// `edit`ed before it is written.
absl::Status WriteFullWithSidecar(FileSystem& fs, const std::string& dir,
                                  void (*edit)(nlohmann::json&)) {
  FullState state;
  for (const ParamSpec& p : Spec().params) {
    state.params[p.fqn] = HostTensor(DType::kFloat32, p.shape);
  }
  state.optim.state[ParamKey("a.w")]["s"] = HostTensor(DType::kFloat32, {4, 3});
  optim::ParamGroup group;
  group.params = {ParamKey("a.w")};
  group.hyperparams["lr"] = 0.1;
  state.optim.param_groups = {group};
  FLATPARAM_ASSIGN_OR_RETURN(FullCheckpointContent content,
                             MakeFullContent(state));
  edit(content.optim_json);
  return WriteFullCheckpoint(fs, dir, content);
}

// The converter's sidecar checks are ReadFullState's (CheckFullSidecar):
// what ReadFullState refuses, verify and shard refuse too. They used to
// accept both of these.
TEST(ConvertTest, FullSidecarChecksMatchReadFullState) {
  FaultInjectionFileSystem fs;
  LayoutOptions two;
  two.world_size = 2;
  FLATPARAM_ASSERT_OK(WriteFullWithSidecar(fs, "/ok", [](nlohmann::json&) {}));
  FLATPARAM_ASSERT_OK(VerifyCheckpoint(fs, "/ok").status());
  FLATPARAM_ASSERT_OK(ShardCheckpoint(fs, "/ok", Spec(), two, 2, "/ok_s"));

  // An int key, even without tensors: MakeFullContent refuses to write it.
  FLATPARAM_ASSERT_OK(WriteFullWithSidecar(fs, "/int", [](nlohmann::json& j) {
    j["state"].push_back({{"key", 7}, {"values", {{"lr", {{"float", 0.5}}}}}});
  }));
  // Two states naming one tensor: "a.w" + "s" and "a" + "w.s" are both
  // "state.a.w.s".
  FLATPARAM_ASSERT_OK(WriteFullWithSidecar(fs, "/dup", [](nlohmann::json& j) {
    j["state"].push_back(
        {{"key", "a"}, {"values", {{"w.s", {{"tensor", "state.a.w.s"}}}}}});
  }));
  for (const auto& [dir, message] :
       std::vector<std::pair<std::string, std::string>>{
           {"/int", "/int/optim.json: optimizer state key 7 is a parameter ID"},
           {"/dup",
            "/dup/optim.json: state 'a.w' 's': tensor 'state.a.w.s' "
            "is listed more than once"}}) {
    SCOPED_TRACE(dir);
    FLATPARAM_ASSERT_OK_AND_ASSIGN(FullCheckpointReader reader,
                                   FullCheckpointReader::Open(fs, dir));
    EXPECT_THAT(ReadFullState(reader), StatusIs(kDataLoss, HasSubstr(message)));
    EXPECT_THAT(VerifyCheckpoint(fs, dir),
                StatusIs(kDataLoss, HasSubstr(message)));
    EXPECT_THAT(ShardCheckpoint(fs, dir, Spec(), two, 2, dir + "_s"),
                StatusIs(kDataLoss, HasSubstr(message)));
  }
}

// Likewise ReadRankState's (CheckRankSidecar) for the sharded tools.
TEST(ConvertTest, RankSidecarChecksMatchReadRankState) {
  const ModelLayout layout = Layout(2);
  FaultInjectionFileSystem fs;
  FLATPARAM_ASSERT_OK(WriteRankStates(fs, "/s", layout, Ranks(layout)));
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      std::string text, ReadFileToString(fs, "/s/rank00001.json", 1 << 20));
  nlohmann::json doc = nlohmann::json::parse(text);
  doc["state"].push_back({{"key", 2}, {"values", nlohmann::json::object()}});
  FLATPARAM_ASSERT_OK(WriteFileDurably(fs, "/s/rank00001.json", doc.dump()));
  Remanifest(fs, "/s", CheckpointKind::kSharded);
  const std::string message =
      "/s/rank00001.json: optimizer state key 2 is not a flat-parameter index "
      "in [0, 2)";
  FLATPARAM_ASSERT_OK_AND_ASSIGN(ShardedCheckpointReader reader,
                                 ShardedCheckpointReader::Open(fs, "/s"));
  EXPECT_THAT(ReadRankState(reader, 1),
              StatusIs(kDataLoss, HasSubstr(message)));
  EXPECT_THAT(VerifyCheckpoint(fs, "/s"),
              StatusIs(kDataLoss, HasSubstr(message)));
  EXPECT_THAT(ConsolidateCheckpoint(fs, "/s", "/f"),
              StatusIs(kDataLoss, HasSubstr(message)));
  LayoutOptions one;
  one.world_size = 1;
  EXPECT_THAT(ReshardCheckpoint(fs, "/s", one, 1, "/r"),
              StatusIs(kDataLoss, HasSubstr(message)));
}

// Hostile nesting reaches the tools as DataLoss naming the file.
TEST(ConvertTest, DeeplyNestedSidecarsAreRefused) {
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  const ModelLayout layout = Layout(2);
  FaultInjectionFileSystem fs;
  FLATPARAM_ASSERT_OK(WriteRankStates(fs, "/s", layout, Ranks(layout)));
  FLATPARAM_ASSERT_OK(WriteFileDurably(
      fs, "/s/rank00000.json", absl::StrCat(R"({"format": )", deep, "}")));
  Remanifest(fs, "/s", CheckpointKind::kSharded);
  EXPECT_THAT(VerifyCheckpoint(fs, "/s"),
              StatusIs(kDataLoss, HasSubstr("/s/rank00000.json: nested deeper "
                                            "than 512 levels")));
  FLATPARAM_ASSERT_OK(WriteFullWithSidecar(fs, "/f", [](nlohmann::json&) {}));
  FLATPARAM_ASSERT_OK(WriteFileDurably(
      fs, "/f/optim.json", absl::StrCat(R"({"state": )", deep, "}")));
  Remanifest(fs, "/f", CheckpointKind::kFull);
  LayoutOptions two;
  two.world_size = 2;
  EXPECT_THAT(ShardCheckpoint(fs, "/f", Spec(), two, 2, "/f_s"),
              StatusIs(kDataLoss, HasSubstr("/f/optim.json: nested deeper "
                                            "than 512 levels")));
}

// --- Resharding at load time
// ---------------------------------------------------

// A model whose rank files span many checksum blocks: two units of 1 Mi
// float32 parameters, with AdamW state (InitCheckpoint), sharded for
// `world` ranks into `dir` (via `dir`.full).
void WriteBigSharded(FileSystem& fs, const std::string& dir, int64_t world) {
  ModelSpec m;
  m.name = "big";
  m.params = {{"u0.w", {1024, 1024}}, {"u1.w", {1024, 1024}}};
  m.wrap = {"u0", "u1"};
  InitOptions init;
  init.seed = 5;
  ASSERT_THAT(InitCheckpoint(fs, m, dir + ".full", init), IsOk());
  LayoutOptions o;
  o.world_size = world;
  ASSERT_THAT(ShardCheckpoint(fs, dir + ".full", m, o, world, dir), IsOk());
}

TEST(LoadRankStateTest, ReadsItsByteRangesOfTheOldRanksAndNothingElse) {
  FaultInjectionFileSystem disk;
  WriteBigSharded(disk, "old", 4);
  internal_checkpoint::CountingFileSystem fs(disk);
  CheckpointOpenOptions metadata_only;
  metadata_only.ranks.emplace();
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      ShardedCheckpointReader reader,
      ShardedCheckpointReader::Open(fs, "old", metadata_only));
  LayoutOptions o;
  o.world_size = 2;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(ModelLayout layout,
                                 ModelLayout::Create(reader.spec(), o));
  const int64_t file = *disk.GetFileSize("old/rank00000.safetensors");
  const int64_t block = static_cast<int64_t>(ChecksumBlockBytes(file));
  ASSERT_GT(file, 16 * block);
  for (int64_t r : {0, 1}) {
    fs.Reset();
    LoadPath path = LoadPath::kOwnRank;
    FLATPARAM_ASSERT_OK_AND_ASSIGN(RankState state,
                                   LoadRankState(reader, layout, 2, r, &path));
    EXPECT_EQ(path, LoadPath::kResharded);
    // New rank r holds old ranks 2r and 2r+1 exactly: their files are read
    // once, plus a few partial blocks read again (six tensors are read in
    // pieces, in another order than the file's). The other two are read
    // only for their headers and 0-d `step` tensors (a block each, at most
    // one per flat parameter and the header's).
    for (int64_t old = 0; old < 4; ++old) {
      const int64_t read = fs.read(RankTensorFileName(old));
      if (old / 2 == r) {
        EXPECT_GE(read, file) << old;
        EXPECT_LE(read, file + 4 * block) << old;
      } else {
        EXPECT_LE(read, 3 * block) << old;
      }
    }
    EXPECT_EQ(state.flat_params[0].numel(), 1 << 19);
  }
}

TEST(LoadRankStateTest, FitsReadsTheRankAndRefusesAnotherModel) {
  FaultInjectionFileSystem fs;
  const ModelLayout layout = Layout(2);
  ASSERT_THAT(WriteRankStates(fs, "ckpt", layout, Ranks(layout)), IsOk());
  CheckpointOpenOptions metadata_only;
  metadata_only.ranks.emplace();
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      ShardedCheckpointReader reader,
      ShardedCheckpointReader::Open(fs, "ckpt", metadata_only));
  LoadPath path = LoadPath::kResharded;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(RankState mine,
                                 LoadRankState(reader, layout, 2, 1, &path));
  EXPECT_EQ(path, LoadPath::kOwnRank);
  FLATPARAM_ASSERT_OK_AND_ASSIGN(RankState want, ReadRankState(reader, 1));
  EXPECT_EQ(mine.flat_params, want.flat_params);

  EXPECT_THAT(LoadRankState(reader, layout, 2, 2).status(),
              StatusIs(kInvalid, HasSubstr("rank 2 is not a shard-group rank "
                                           "in [0, 2)")));
  EXPECT_THAT(LoadRankState(reader, layout, 4, 0).status(),
              StatusIs(kInvalid, HasSubstr("world size 4 does not fit")));
  ModelSpec other = Spec();
  other.params[2].shape = {6};
  LayoutOptions o;
  o.world_size = 3;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(ModelLayout theirs,
                                 ModelLayout::Create(other, o));
  // Said in a user's words: which parameter differs, and how.
  EXPECT_THAT(
      LoadRankState(reader, theirs, 3, 0).status(),
      StatusIs(kMismatch, HasSubstr("the job's model is not the checkpoint's "
                                    "(model 'tiny'): parameter 'c.w' is [5] "
                                    "float32 in the checkpoint's model and [6] "
                                    "float32 in the job's")));
  other = Spec();
  other.params.pop_back();
  FLATPARAM_ASSERT_OK_AND_ASSIGN(theirs, ModelLayout::Create(other, o));
  EXPECT_THAT(LoadRankState(reader, theirs, 3, 0).status(),
              StatusIs(kMismatch, HasSubstr("parameter 'c.w' ([5] float32) of "
                                            "the checkpoint's model is not in "
                                            "the job's")));
  other = Spec();
  other.wrap = {};
  FLATPARAM_ASSERT_OK_AND_ASSIGN(theirs, ModelLayout::Create(other, o));
  EXPECT_THAT(
      LoadRankState(reader, theirs, 3, 0).status(),
      StatusIs(kMismatch, HasSubstr("the units differ: the checkpoint's model "
                                    "wraps [a], the job's []")));
}

}  // namespace
}  // namespace checkpoint
}  // namespace flatparam
