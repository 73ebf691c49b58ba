#include "flatparam/layout_json.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>

#include "flatparam/base/status_matchers.h"
#include "flatparam/model_layout.h"

namespace flatparam {
namespace {

using json = nlohmann::json;

// emb (33) + seq.0 (15 + 5) + tied head in the root; seq.2 (35 + 7).
ModelSpec Tiny() {
  ModelSpec spec;
  spec.name = "tiny";
  spec.params = {
      {"emb.weight", {11, 3}},
      {"seq.0.weight", {5, 3}},
      {"seq.0.bias", {5}},
      {"seq.2.weight", {7, 5}},
      {"seq.2.bias", {7}},
      {"head.weight", {}, DType::kFloat32, true, "emb.weight"},
  };
  spec.wrap = {"seq.2"};
  return spec;
}

LayoutOptions Options(
    int64_t world_size, bool align,
    ShardingStrategy strategy = ShardingStrategy::kFullShard) {
  LayoutOptions o;
  o.world_size = world_size;
  o.align_addresses = align;
  o.strategy = strategy;
  return o;
}

json InShard(const std::string& fqn, int64_t offset, int64_t numel,
             int64_t start, int64_t end) {
  return {{"fqn", fqn},
          {"in_shard", true},
          {"offset_in_shard", offset},
          {"numel_in_shard", numel},
          {"intra_param_start_idx", start},
          {"intra_param_end_idx", end}};
}

json NotInShard(const std::string& fqn) {
  return {{"fqn", fqn},
          {"in_shard", false},
          {"offset_in_shard", nullptr},
          {"numel_in_shard", nullptr},
          {"intra_param_start_idx", nullptr},
          {"intra_param_end_idx", nullptr}};
}

// Worked by hand: aligned_numel 4 (float32); emb at [0, 32], pad 3,
// seq.0.weight at [36, 50], pad 1, seq.0.bias at [52, 56], world-size pad 3 ->
// 60; chunk 15.
TEST(LayoutJsonTest, AlignedRootMatchesHandComputation) {
  FLATPARAM_ASSERT_OK_AND_ASSIGN(ModelLayout layout,
                                 ModelLayout::Create(Tiny(), Options(4, true)));
  const json doc = ModelLayoutToJson(layout);
  EXPECT_EQ(doc["version"], 1);
  EXPECT_EQ(doc["model"], "tiny");
  EXPECT_EQ(doc["world_size"], 4);
  EXPECT_EQ(doc["shard_group_size"], 4);
  EXPECT_EQ(doc["strategy"], "FULL_SHARD");
  EXPECT_EQ(doc["align_addresses"], true);
  EXPECT_TRUE(doc["compute_dtype"].is_null());
  ASSERT_EQ(doc["flat_params"].size(), 2);

  const json& root = doc["flat_params"][0];
  EXPECT_EQ(root["unit"], "");
  EXPECT_EQ(root["dtype"], "float32");
  EXPECT_EQ(root["aligned_numel"], 4);
  EXPECT_EQ(root["param_numel"], 53);
  EXPECT_EQ(root["unpadded_unsharded_numel"], 60);
  EXPECT_EQ(root["padded_unsharded_numel"], 60);
  EXPECT_EQ(root["sharded_numel"], 15);
  EXPECT_EQ(root["numels_with_padding"], json({33, 3, 15, 1, 5, 3}));
  EXPECT_EQ(root["is_padding_mask"],
            json({false, true, false, true, false, true}));
  EXPECT_EQ(root["params"], json::parse(R"([
    {"fqn": "emb.weight", "shape": [11, 3], "numel": 33, "start": 0,
     "end_inclusive": 32},
    {"fqn": "seq.0.weight", "shape": [5, 3], "numel": 15, "start": 36,
     "end_inclusive": 50},
    {"fqn": "seq.0.bias", "shape": [5], "numel": 5, "start": 52,
     "end_inclusive": 56}])"));
  EXPECT_EQ(
      root["shared_params"],
      json::parse(R"([{"fqn": "head.weight", "prim_fqn": "emb.weight"}])"));

  ASSERT_EQ(root["ranks"].size(), 4);
  const json& r2 = root["ranks"][2];
  EXPECT_EQ(r2["rank"], 2);
  EXPECT_EQ(r2["unsharded_start"], 30);
  EXPECT_EQ(r2["unsharded_end_inclusive"], 44);
  EXPECT_EQ(r2["numel_padded"], 0);
  EXPECT_EQ(r2["shard_param_infos"], json({InShard("emb.weight", 0, 3, 30, 32),
                                           InShard("seq.0.weight", 6, 9, 0, 8),
                                           NotInShard("seq.0.bias")}));
  EXPECT_EQ(
      root["ranks"][3]["shard_param_infos"],
      json({NotInShard("emb.weight"), InShard("seq.0.weight", 0, 6, 9, 14),
            InShard("seq.0.bias", 7, 5, 0, 4)}));

  const json& seq2 = doc["flat_params"][1];
  EXPECT_EQ(seq2["unit"], "seq.2");
  EXPECT_EQ(seq2["params"][0]["fqn"], "seq.2.weight");  // The full name.
  EXPECT_EQ(seq2["shared_params"], json::array());
}

// Unaligned: the root is 53 elements, chunk 14, and the last rank holds
// [42, 55] with 3 elements of right padding.
TEST(LayoutJsonTest, UnalignedLastRankIsPadded) {
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      ModelLayout layout, ModelLayout::Create(Tiny(), Options(4, false)));
  const json root = ModelLayoutToJson(layout)["flat_params"][0];
  EXPECT_EQ(root["aligned_numel"], 0);
  EXPECT_EQ(root["unpadded_unsharded_numel"], 53);
  EXPECT_EQ(root["padded_unsharded_numel"], 56);
  EXPECT_EQ(root["sharded_numel"], 14);
  const json& r3 = root["ranks"][3];
  EXPECT_EQ(r3["unsharded_start"], 42);
  EXPECT_EQ(r3["unsharded_end_inclusive"], 55);
  EXPECT_EQ(r3["numel_padded"], 3);
  EXPECT_EQ(r3["shard_param_infos"], json({NotInShard("emb.weight"),
                                           InShard("seq.0.weight", 0, 6, 9, 14),
                                           InShard("seq.0.bias", 6, 5, 0, 4)}));
}

TEST(LayoutJsonTest, NoShardRanksHoldTheWhole) {
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      ModelLayout layout,
      ModelLayout::Create(Tiny(),
                          Options(3, false, ShardingStrategy::kNoShard)));
  const json doc = ModelLayoutToJson(layout);
  EXPECT_EQ(doc["strategy"], "NO_SHARD");
  const json& seq2 = doc["flat_params"][1];
  EXPECT_EQ(seq2["sharded_numel"], 42);
  EXPECT_EQ(seq2["padded_unsharded_numel"], 42);
  ASSERT_EQ(seq2["ranks"].size(), 3);
  for (const json& r : seq2["ranks"]) {
    EXPECT_EQ(r["unsharded_start"], 0);
    EXPECT_EQ(r["unsharded_end_inclusive"], 41);
    EXPECT_EQ(r["numel_padded"], 0);
    EXPECT_EQ(r["shard_param_infos"][1], InShard("seq.2.bias", 35, 7, 0, 6));
  }
}

TEST(LayoutJsonTest, HybridReportsWorldAndShardGroup) {
  LayoutOptions o = Options(2, false, ShardingStrategy::kHybridShard);
  o.compute_dtype = DType::kBFloat16;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(ModelLayout layout,
                                 ModelLayout::Create(Tiny(), o));
  LayoutJsonOptions jo;
  jo.world_size = 8;
  const json doc = ModelLayoutToJson(layout, jo);
  EXPECT_EQ(doc["world_size"], 8);
  EXPECT_EQ(doc["shard_group_size"], 2);
  EXPECT_EQ(doc["strategy"], "HYBRID_SHARD");
  EXPECT_EQ(doc["compute_dtype"], "bfloat16");
  EXPECT_EQ(doc["flat_params"][0]["ranks"].size(), 2);
}

}  // namespace
}  // namespace flatparam
