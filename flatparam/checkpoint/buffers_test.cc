// Buffers (model_layout.h's BufferSpec) through every checkpoint path: rank
// files, load-time reshard, offline reshard, consolidate, shard and init (the
// Hugging Face import and export: interop/hf/hf_checkpoint_test.cc). Each rank
// holds its own values, so that a test can tell which rank's buffers arrived
// where.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "flatparam/base/dtype.h"
#include "flatparam/base/status_matchers.h"
#include "flatparam/checkpoint/checkpoint_dir.h"
#include "flatparam/checkpoint/convert.h"
#include "flatparam/checkpoint/file_system.h"
#include "flatparam/checkpoint/internal/checkpoint_testutil.h"
#include "flatparam/checkpoint/internal/counting_file_system.h"
#include "flatparam/checkpoint/safetensors.h"
#include "flatparam/checkpoint/training_state.h"
#include "flatparam/flatten.h"
#include "flatparam/layout.h"
#include "flatparam/model_layout.h"

namespace flatparam {
namespace checkpoint {
namespace {

using ::testing::HasSubstr;

constexpr auto kInvalid = absl::StatusCode::kInvalidArgument;
constexpr auto kMismatch = absl::StatusCode::kFailedPrecondition;

ModelLayout Layout(int64_t world) {
  LayoutOptions o;
  o.world_size = world;
  return *ModelLayout::Create(BufferModelSpec(), o);
}

TEST(BuffersTest, EachRankFileHoldsItsRanksBuffers) {
  FaultInjectionFileSystem fs;
  const ModelLayout layout = Layout(2);
  FLATPARAM_ASSERT_OK(
      WriteRankStates(fs, "/s", layout, RankStatesWithBuffers(layout)));
  FLATPARAM_ASSERT_OK_AND_ASSIGN(ShardedCheckpointReader reader,
                                 ShardedCheckpointReader::Open(fs, "/s"));
  EXPECT_EQ(reader.spec().buffers, BufferModelSpec().buffers);
  for (int r = 0; r < 2; ++r) {
    FLATPARAM_ASSERT_OK_AND_ASSIGN(RankState state, ReadRankState(reader, r));
    ExpectRanksBuffers(BufferModelSpec(), state.buffers, r);
    // At the saved world size a job gets its own rank's back.
    LoadPath path;
    FLATPARAM_ASSERT_OK_AND_ASSIGN(RankState loaded,
                                   LoadRankState(reader, layout, 2, r, &path));
    EXPECT_EQ(path, LoadPath::kOwnRank);
    ExpectRanksBuffers(BufferModelSpec(), loaded.buffers, r);
  }
}

TEST(BuffersTest, ReshardingGivesEveryRankRankZerosBuffers) {
  FaultInjectionFileSystem fs;
  const ModelLayout two = Layout(2);
  FLATPARAM_ASSERT_OK(
      WriteRankStates(fs, "/s", two, RankStatesWithBuffers(two)));
  FLATPARAM_ASSERT_OK_AND_ASSIGN(ShardedCheckpointReader reader,
                                 ShardedCheckpointReader::Open(fs, "/s"));
  const ModelLayout three = Layout(3);
  for (int r = 0; r < 3; ++r) {
    LoadPath path;
    FLATPARAM_ASSERT_OK_AND_ASSIGN(RankState loaded,
                                   LoadRankState(reader, three, 3, r, &path));
    EXPECT_EQ(path, LoadPath::kResharded);
    ExpectRanksBuffers(BufferModelSpec(), loaded.buffers, 0);
  }
  LayoutOptions four;
  four.world_size = 4;
  FLATPARAM_ASSERT_OK(ReshardCheckpoint(fs, "/s", four, 0, "/s4"));
  FLATPARAM_ASSERT_OK_AND_ASSIGN(ShardedCheckpointReader resharded,
                                 ShardedCheckpointReader::Open(fs, "/s4"));
  for (int r = 0; r < 4; ++r) {
    FLATPARAM_ASSERT_OK_AND_ASSIGN(RankState state,
                                   ReadRankState(resharded, r));
    ExpectRanksBuffers(BufferModelSpec(), state.buffers, 0);
  }
}

TEST(BuffersTest, ConsolidateTakesRankZerosAndShardGivesThemToEveryRank) {
  FaultInjectionFileSystem fs;
  const ModelLayout two = Layout(2);
  FLATPARAM_ASSERT_OK(
      WriteRankStates(fs, "/s", two, RankStatesWithBuffers(two)));
  FLATPARAM_ASSERT_OK(ConsolidateCheckpoint(fs, "/s", "/full"));
  FLATPARAM_ASSERT_OK_AND_ASSIGN(FullCheckpointReader full,
                                 FullCheckpointReader::Open(fs, "/full"));
  FLATPARAM_ASSERT_OK(full.CheckFitsModel(BufferModelSpec()));
  FLATPARAM_ASSERT_OK_AND_ASSIGN(FullState state, ReadFullState(full));
  for (const auto& [fqn, t] : RankBuffers(BufferModelSpec(), 0)) {
    ASSERT_EQ(state.params.count(fqn), 1u) << fqn;
    EXPECT_TRUE(SameTensorBytes(state.params.at(fqn), t)) << fqn;
  }

  // The full checkpoint is a model with these buffers and no other.
  ModelSpec without = BufferModelSpec();
  without.buffers.pop_back();
  EXPECT_THAT(full.CheckFitsModel(without),
              StatusIs(kMismatch, HasSubstr("tensor 'c.scale' is not a "
                                            "parameter or buffer of model")));
  ModelSpec more = BufferModelSpec();
  more.buffers.push_back({"c.extra", {1}, DType::kFloat32});
  EXPECT_THAT(full.CheckFitsModel(more),
              StatusIs(kMismatch, HasSubstr("buffer 'c.extra' of model 'bn' "
                                            "is missing")));
  ModelSpec other = BufferModelSpec();
  other.buffers[0].shape = {4};
  EXPECT_THAT(full.CheckFitsModel(other),
              StatusIs(kMismatch,
                       HasSubstr("tensor 'a.bn.running_mean' is float32 [3], "
                                 "the model's buffer is float32 [4]")));

  LayoutOptions three;
  three.world_size = 3;
  FLATPARAM_ASSERT_OK(
      ShardCheckpoint(fs, "/full", BufferModelSpec(), three, 0, "/s3"));
  FLATPARAM_ASSERT_OK_AND_ASSIGN(ShardedCheckpointReader sharded,
                                 ShardedCheckpointReader::Open(fs, "/s3"));
  for (int r = 0; r < 3; ++r) {
    FLATPARAM_ASSERT_OK_AND_ASSIGN(RankState s, ReadRankState(sharded, r));
    ExpectRanksBuffers(BufferModelSpec(), s.buffers, 0);
  }
}

TEST(BuffersTest, InitShardConsolidateIsByteIdentical) {
  FaultInjectionFileSystem fs;
  FLATPARAM_ASSERT_OK(InitCheckpoint(fs, BufferModelSpec(), "/init"));
  LayoutOptions two;
  two.world_size = 2;
  FLATPARAM_ASSERT_OK(
      ShardCheckpoint(fs, "/init", BufferModelSpec(), two, 0, "/s"));
  FLATPARAM_ASSERT_OK(ConsolidateCheckpoint(fs, "/s", "/back"));
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      std::string a, ReadFileToString(fs, "/init/model.safetensors", 1 << 20));
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      std::string b, ReadFileToString(fs, "/back/model.safetensors", 1 << 20));
  EXPECT_EQ(a, b);
  FLATPARAM_ASSERT_OK_AND_ASSIGN(FullCheckpointReader init,
                                 FullCheckpointReader::Open(fs, "/init"));
  EXPECT_TRUE(init.model().Contains("a.bn.num_batches_tracked"));
}

TEST(BuffersTest, RankContentMustHoldExactlyTheModelsBuffers) {
  const ModelLayout layout = Layout(2);
  std::vector<RankState> ranks = RankStatesWithBuffers(layout);
  RankState missing = ranks[0];
  missing.buffers.erase("c.scale");
  EXPECT_THAT(MakeRankContent(layout, 0, missing),
              StatusIs(kInvalid, HasSubstr("rank 0: no value for buffer "
                                           "'c.scale' of the model")));
  RankState wrong = ranks[0];
  wrong.buffers["c.scale"] = HostTensor(DType::kFloat32, {2});
  EXPECT_THAT(MakeRankContent(layout, 0, wrong),
              StatusIs(kInvalid, HasSubstr("rank 0: buffer 'c.scale' is "
                                           "float32 [2], the model's is "
                                           "float64 [2]")));
  RankState extra = ranks[0];
  extra.buffers["c.other"] = HostTensor(DType::kFloat32, {2});
  EXPECT_THAT(MakeRankContent(layout, 0, extra),
              StatusIs(kInvalid, HasSubstr("rank 0: 'c.other' is not a "
                                           "buffer of the model")));

  // The writer checks the files' tensors against the layout whoever made
  // them: a rank file without a buffer is refused.
  FaultInjectionFileSystem fs;
  ShardedCheckpointContent content;
  content.layout = &layout;
  for (int r = 0; r < 2; ++r) {
    FLATPARAM_ASSERT_OK_AND_ASSIGN(RankContent c,
                                   MakeRankContent(layout, r, ranks[r]));
    content.ranks.push_back(std::move(c));
  }
  content.ranks[1].tensors.pop_back();
  EXPECT_THAT(
      WriteShardedCheckpoint(fs, "/x", content),
      StatusIs(kInvalid, HasSubstr("rank00001.safetensors: no tensor "
                                   "'buffers.c.scale' (buffer of the model)")));
}

TEST(BuffersTest, AJobWithOtherBuffersIsAnotherModel) {
  FaultInjectionFileSystem fs;
  const ModelLayout two = Layout(2);
  FLATPARAM_ASSERT_OK(
      WriteRankStates(fs, "/s", two, RankStatesWithBuffers(two)));
  FLATPARAM_ASSERT_OK_AND_ASSIGN(ShardedCheckpointReader reader,
                                 ShardedCheckpointReader::Open(fs, "/s"));
  ModelSpec job = BufferModelSpec();
  job.buffers.push_back({"c.new", {1}, DType::kFloat32});
  LayoutOptions o;
  o.world_size = 2;
  const ModelLayout more = *ModelLayout::Create(job, o);
  EXPECT_THAT(reader.CheckFits(more, 2),
              StatusIs(kMismatch, HasSubstr("buffer 'c.new' ([1] float32) of "
                                            "the job's model is not in the "
                                            "checkpoint's")));
  EXPECT_THAT(LoadRankState(reader, more, 2, 0),
              StatusIs(kMismatch, HasSubstr("buffer 'c.new'")));
  // So is one saved before buffers were: the checkpoint has none.
  ModelSpec none = BufferModelSpec();
  none.buffers.clear();
  const ModelLayout old = *ModelLayout::Create(none, o);
  FLATPARAM_ASSERT_OK(WriteRankStates(fs, "/old", old, [&] {
    std::vector<RankState> ranks = RankStatesWithBuffers(old);
    for (RankState& r : ranks) r.buffers.clear();
    return ranks;
  }()));
  FLATPARAM_ASSERT_OK_AND_ASSIGN(ShardedCheckpointReader old_reader,
                                 ShardedCheckpointReader::Open(fs, "/old"));
  EXPECT_THAT(
      LoadRankState(old_reader, two, 2, 0),
      StatusIs(kMismatch, HasSubstr("buffer 'a.bn.running_mean' ([3] float32) "
                                    "of the job's model is not in the "
                                    "checkpoint's")));
  // The layout.json of a model without buffers has no "buffers" key, as
  // before buffers were saved.
  EXPECT_FALSE(old_reader.layout_json()["model_spec"].contains("buffers"));
  EXPECT_TRUE(reader.layout_json()["model_spec"].contains("buffers"));
}

TEST(BuffersTest, ModelLayoutChecksTheirNames) {
  ModelSpec clash = BufferModelSpec();
  clash.buffers.push_back({"a.w", {1}, DType::kFloat32});
  EXPECT_THAT(ModelLayout::Create(clash, LayoutOptions()).status(),
              StatusIs(kInvalid, HasSubstr("buffer \"a.w\" has the name of a "
                                           "parameter")));
  ModelSpec twice = BufferModelSpec();
  twice.buffers.push_back(twice.buffers[0]);
  EXPECT_THAT(ModelLayout::Create(twice, LayoutOptions()).status(),
              StatusIs(kInvalid, HasSubstr("duplicate buffer name "
                                           "\"a.bn.running_mean\"")));
  ModelSpec empty = BufferModelSpec();
  empty.buffers.push_back({"", {1}, DType::kFloat32});
  EXPECT_THAT(ModelLayout::Create(empty, LayoutOptions()).status(),
              StatusIs(kInvalid, HasSubstr("buffer 3 has an empty fqn")));
}

}  // namespace
}  // namespace checkpoint
}  // namespace flatparam
