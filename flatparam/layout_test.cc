#include "flatparam/layout.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <vector>

#include "flatparam/base/status_matchers.h"

namespace flatparam {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

LayoutOptions Options(
    int64_t world_size, bool align = false,
    ShardingStrategy strategy = ShardingStrategy::kFullShard) {
  LayoutOptions o;
  o.world_size = world_size;
  o.align_addresses = align;
  o.strategy = strategy;
  return o;
}

ShardParamInfo In(int64_t offset, int64_t numel, int64_t start, int64_t end) {
  return {true, offset, numel, start, end};
}
const ShardParamInfo kOut{};

TEST(LayoutTest, UnalignedChunkSharding) {
  std::vector<ParamSpec> params = {{"fc.weight", {3, 5}}, {"fc.bias", {3}}};
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      FlatParamLayout l, FlatParamLayout::Create("", params, Options(4)));
  EXPECT_EQ(l.unpadded_unsharded_numel(), 18);
  EXPECT_EQ(l.sharded_numel(), 5);  // ceil(18 / 4)
  EXPECT_EQ(l.padded_unsharded_numel(), 20);
  EXPECT_THAT(l.numels_with_padding(), ElementsAre(15, 3));
  EXPECT_EQ(l.aligned_numel(), 0);
  const ShardInterval last = l.shard_interval(3);
  EXPECT_EQ(last.start, 15);
  EXPECT_EQ(last.end_inclusive, 19);
  EXPECT_EQ(last.numel_padded, 2);
  EXPECT_THAT(l.shard_param_infos(2), ElementsAre(In(0, 5, 10, 14), kOut));
  EXPECT_THAT(l.shard_param_infos(3), ElementsAre(kOut, In(0, 3, 0, 2)));
}

// Worked by hand from `_init_flat_param_and_metadata`: aligned_numel = 4 for
// float32; pads of 1 and 3 before b and c; world-size pad of 2 (13 -> 15).
TEST(LayoutTest, AlignedLayoutMatchesHandComputation) {
  std::vector<ParamSpec> params = {{"a", {3}}, {"b", {5}}, {"c", {}}};
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      FlatParamLayout l, FlatParamLayout::Create("", params, Options(3, true)));
  EXPECT_EQ(l.aligned_numel(), 4);
  EXPECT_THAT(l.numels_with_padding(), ElementsAre(3, 1, 5, 3, 1, 2));
  EXPECT_THAT(l.is_padding_mask(),
              ElementsAre(false, true, false, true, false, true));
  EXPECT_EQ(l.params()[1].offset, 4);
  EXPECT_EQ(l.params()[2].offset, 12);
  EXPECT_EQ(l.unpadded_unsharded_numel(), 15);
  EXPECT_EQ(l.sharded_numel(), 5);
  EXPECT_THAT(l.shard_param_infos(0),
              ElementsAre(In(0, 3, 0, 2), In(4, 1, 0, 0), kOut));
  EXPECT_THAT(l.shard_param_infos(1), ElementsAre(kOut, In(0, 4, 1, 4), kOut));
  EXPECT_THAT(l.shard_param_infos(2), ElementsAre(kOut, kOut, In(2, 1, 0, 0)));
  for (int r = 0; r < 3; ++r) EXPECT_EQ(l.shard_interval(r).numel_padded, 0);
}

TEST(LayoutTest, AlignmentUsesComputeDtype) {
  std::vector<ParamSpec> params = {{"a", {3}}, {"b", {5}}};
  LayoutOptions o = Options(1, true);
  o.compute_dtype = DType::kBFloat16;  // 16 bytes = 8 bf16 elements.
  FLATPARAM_ASSERT_OK_AND_ASSIGN(FlatParamLayout l,
                                 FlatParamLayout::Create("", params, o));
  EXPECT_EQ(l.aligned_numel(), 8);
  EXPECT_THAT(l.numels_with_padding(), ElementsAre(3, 5, 5));
  EXPECT_EQ(l.params()[1].offset, 8);
}

TEST(LayoutTest, ZeroNumelParameterFollowsPyTorch) {
  std::vector<ParamSpec> params = {{"a", {4}}, {"z", {0, 3}}, {"b", {2}}};
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      FlatParamLayout l, FlatParamLayout::Create("", params, Options(2)));
  // z occupies [4, 3]: in rank 1's shard [3, 5] only, with end index -1.
  EXPECT_THAT(l.shard_param_infos(0), ElementsAre(In(0, 3, 0, 2), kOut, kOut));
  EXPECT_THAT(l.shard_param_infos(1),
              ElementsAre(In(0, 1, 3, 3), In(1, 0, 0, -1), In(1, 2, 0, 1)));
  const FlatParamShardMetadata md = l.shard_metadata(1);
  EXPECT_THAT(md.param_names, ElementsAre("a", "z", "b"));
  EXPECT_EQ(md.param_offsets[1], std::make_pair(int64_t{0}, int64_t{-1}));
}

TEST(LayoutTest, RanksBeyondTheDataHoldOnlyPadding) {
  std::vector<ParamSpec> params = {{"w", {3}}};
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      FlatParamLayout l, FlatParamLayout::Create("", params, Options(8)));
  EXPECT_EQ(l.sharded_numel(), 1);
  for (int r = 3; r < 8; ++r) {
    const ShardInterval iv = l.shard_interval(r);
    EXPECT_EQ(iv.start, r);
    EXPECT_EQ(iv.end_inclusive, r);
    EXPECT_EQ(iv.numel_padded, 1);
    EXPECT_THAT(l.shard_param_infos(r), ElementsAre(kOut));
  }
}

TEST(LayoutTest, NoShardKeepsTheWholeFlatParameter) {
  std::vector<ParamSpec> params = {{"w", {7}}};
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      FlatParamLayout l,
      FlatParamLayout::Create("", params,
                              Options(4, true, ShardingStrategy::kNoShard)));
  EXPECT_EQ(l.unpadded_unsharded_numel(), 8);  // World-size padding still.
  EXPECT_EQ(l.sharded_numel(), 8);
  EXPECT_EQ(l.padded_unsharded_numel(), 8);
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(l.shard_interval(r).start, 0);
    EXPECT_EQ(l.shard_interval(r).end_inclusive, 7);
    EXPECT_THAT(l.shard_param_infos(r), ElementsAre(In(0, 7, 0, 6)));
  }
}

TEST(LayoutTest, SharedParametersAreRecordedNotFlattened) {
  std::vector<ParamSpec> params = {
      {"emb.weight", {10, 4}}, {"fc.weight", {4, 4}}, {"head.weight", {}}};
  params[2].tied_to = "emb.weight";
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      FlatParamLayout l, FlatParamLayout::Create("", params, Options(2)));
  ASSERT_EQ(l.params().size(), 2u);
  ASSERT_EQ(l.shared_params().size(), 1u);
  const SharedParamInfo& s = l.shared_params()[0];
  EXPECT_EQ(s.fqn, "head.weight");
  EXPECT_EQ(s.module_name, "head");
  EXPECT_EQ(s.param_name, "weight");
  EXPECT_EQ(s.prim_fqn, "emb.weight");
  EXPECT_EQ(s.prim_module_name, "emb");
  EXPECT_EQ(s.prim_index, 0);
  EXPECT_EQ(l.unpadded_unsharded_numel(), 56);
}

TEST(LayoutTest, TieChainsResolveToThePrimary) {
  std::vector<ParamSpec> params = {{"a", {2}}, {"b", {}}, {"c", {}}};
  params[1].tied_to = "a";
  params[2].tied_to = "b";
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      FlatParamLayout l, FlatParamLayout::Create("", params, Options(1)));
  ASSERT_EQ(l.shared_params().size(), 2u);
  EXPECT_EQ(l.shared_params()[1].prim_fqn, "a");
}

TEST(LayoutTest, RequiresGradIsTheOrOfParameters) {
  // Mixed flags are PyTorch's use_orig_params=True case: aligned layouts.
  std::vector<ParamSpec> params = {{"a", {2}}, {"b", {2}}};
  params[0].requires_grad = false;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      FlatParamLayout l,
      FlatParamLayout::Create("", params, Options(1, /*align=*/true)));
  EXPECT_TRUE(l.requires_grad());
  EXPECT_FALSE(l.params()[0].requires_grad);
}

TEST(LayoutTest, UnalignedLayoutsNeedUniformRequiresGrad) {
  // PyTorch's `_validate_tensors_to_flatten` with use_orig_params=False.
  std::vector<ParamSpec> params = {{"a", {2}}, {"b", {}}, {"c", {3}}};
  params[1].tied_to = "a";  // Ties are the primary's tensor: not checked.
  params[1].requires_grad = false;
  FLATPARAM_ASSERT_OK(FlatParamLayout::Create("u", params, Options(2)));
  params[2].requires_grad = false;
  EXPECT_THAT(
      FlatParamLayout::Create("u", params, Options(2)),
      StatusIs(absl::StatusCode::kInvalidArgument,
               AllOf(HasSubstr("must flatten tensors with uniform "
                               "`requires_grad` when `use_orig_params=False`"),
                     HasSubstr("\"a\" has requires_grad=true but \"c\" has "
                               "requires_grad=false"))));
  // All frozen is uniform.
  params[0].requires_grad = false;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      FlatParamLayout frozen, FlatParamLayout::Create("u", params, Options(2)));
  EXPECT_FALSE(frozen.requires_grad());
}

TEST(LayoutTest, CallerMistakesAreErrorsNamingTheValues) {
  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  EXPECT_THAT(FlatParamLayout::Create("blk", {}, Options(2)),
              StatusIs(kInvalid, HasSubstr("non-empty")));
  std::vector<ParamSpec> ok = {{"w", {2}}};
  EXPECT_THAT(FlatParamLayout::Create("", ok, Options(0)),
              StatusIs(kInvalid, HasSubstr("got 0")));
  std::vector<ParamSpec> ints = {{"idx", {2}, DType::kInt64}};
  EXPECT_THAT(FlatParamLayout::Create("", ints, Options(1)),
              StatusIs(kInvalid, HasSubstr("\"idx\" has dtype int64")));
  std::vector<ParamSpec> mixed = {{"a", {2}}, {"b", {2}, DType::kBFloat16}};
  EXPECT_THAT(FlatParamLayout::Create("", mixed, Options(1)),
              StatusIs(kInvalid, HasSubstr("float32 (\"a\") and bfloat16")));
  std::vector<ParamSpec> dup = {{"a", {2}}, {"a", {2}}};
  EXPECT_THAT(FlatParamLayout::Create("", dup, Options(1)),
              StatusIs(kInvalid, HasSubstr("duplicate parameter name \"a\"")));
  std::vector<ParamSpec> tie = {{"a", {2}}, {"b", {}}};
  tie[1].tied_to = "nope";
  EXPECT_THAT(FlatParamLayout::Create("", tie, Options(1)),
              StatusIs(kInvalid, HasSubstr("tied to \"nope\"")));
  std::vector<ParamSpec> neg = {{"a", {2, -1}}};
  EXPECT_THAT(FlatParamLayout::Create("", neg, Options(1)),
              StatusIs(kInvalid, HasSubstr("[2, -1]")));
  std::vector<ParamSpec> empty = {{"a", {0}}, {"b", {3, 0}}};
  EXPECT_THAT(FlatParamLayout::Create("u", empty, Options(2)),
              StatusIs(kInvalid, HasSubstr("no elements")));
  FLATPARAM_ASSERT_OK_AND_ASSIGN(FlatParamLayout l,
                                 FlatParamLayout::Create("", ok, Options(2)));
  EXPECT_THAT(l.ShardIntervalFor(2),
              StatusIs(kInvalid, HasSubstr("rank 2 is out of range")));
}

TEST(LayoutTest, StrategyNamesRoundTrip) {
  for (ShardingStrategy s :
       {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp,
        ShardingStrategy::kNoShard, ShardingStrategy::kHybridShard,
        ShardingStrategy::kHybridShardZero2}) {
    EXPECT_EQ(*ParseShardingStrategy(ShardingStrategyName(s)), s);
  }
  EXPECT_EQ(*ParseShardingStrategy("full_shard"), ShardingStrategy::kFullShard);
  EXPECT_THAT(ParseShardingStrategy("ZERO3"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("ZERO3")));
}

TEST(LayoutTest, UnpaddedShardIsTorchChunk) {
  // torch.arange(10).chunk(4) -> sizes 3, 3, 3, 1.
  EXPECT_EQ(GetUnpaddedShard(10, 3, 4).end - GetUnpaddedShard(10, 3, 4).begin,
            1);
  EXPECT_EQ(GetUnpaddedShard(10, 3, 4).numel_to_pad, 2);
  // torch.arange(5).chunk(4) -> sizes 2, 2, 1 (only three chunks).
  EXPECT_EQ(GetUnpaddedShard(5, 3, 4).end - GetUnpaddedShard(5, 3, 4).begin, 0);
  EXPECT_EQ(GetUnpaddedShard(5, 3, 4).numel_to_pad, 2);
  EXPECT_EQ(GetUnpaddedShard(0, 1, 4).numel_to_pad, 0);
}

}  // namespace
}  // namespace flatparam
