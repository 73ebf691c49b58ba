#include "tools/inspect.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "flatparam/base/status_matchers.h"
#include "flatparam/presets.h"

namespace flatparam {
namespace tools {
namespace {

using json = nlohmann::json;
using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;
using ::testing::StartsWith;

constexpr absl::StatusCode kInvalid = absl::StatusCode::kInvalidArgument;
constexpr char kTinyModel[] = "tools/testdata/tiny_model.json";
constexpr char kMalformedModel[] = "tools/testdata/malformed_model.json";

InspectOptions Options(const std::string& model, int64_t world_size,
                       const std::string& format) {
  InspectOptions o;
  o.layout.model = model;
  o.layout.world_size = world_size;
  o.format = format;
  return o;
}

absl::StatusOr<json> InspectToJson(const InspectOptions& options) {
  std::ostringstream out;
  FLATPARAM_RETURN_IF_ERROR(RunInspect(options, out));
  return json::parse(out.str());
}

absl::StatusOr<std::string> InspectToTable(const InspectOptions& options) {
  std::ostringstream out;
  FLATPARAM_RETURN_IF_ERROR(RunInspect(options, out));
  return out.str();
}

// Like HasSubstr, but a failure shows only the start of a long text.
::testing::AssertionResult Contains(const std::string& text,
                                    const std::string& part) {
  if (text.find(part) != std::string::npos) {
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure()
         << "\"" << part << "\" not found in (first 2000 chars):\n"
         << text.substr(0, 2000);
}

bool HasKeys(const json& j, const std::vector<std::string>& keys) {
  for (const std::string& k : keys) {
    if (!j.contains(k)) {
      ADD_FAILURE() << "missing key \"" << k << "\" in "
                    << j.dump().substr(0, 200);
      return false;
    }
  }
  return true;
}

// Checks the document's shape and that the ranks' shards tile every
// parameter exactly once.
void CheckDocument(const json& doc, int64_t world_size, int64_t shards) {
  ASSERT_TRUE(HasKeys(doc, {"world_size", "shard_group_size", "strategy",
                            "align_addresses", "flat_params"}));
  EXPECT_EQ(doc["world_size"], world_size);
  EXPECT_EQ(doc["shard_group_size"], shards);
  for (const json& f : doc["flat_params"]) {
    ASSERT_TRUE(HasKeys(
        f, {"unit", "dtype", "unpadded_unsharded_numel",
            "padded_unsharded_numel", "sharded_numel", "numels_with_padding",
            "is_padding_mask", "params", "shared_params", "ranks"}));
    ASSERT_EQ(f["ranks"].size(), shards);
    EXPECT_EQ(f["numels_with_padding"].size(), f["is_padding_mask"].size());
    const json& params = f["params"];
    std::vector<int64_t> held(params.size(), 0);
    for (const json& p : params) {
      ASSERT_TRUE(
          HasKeys(p, {"fqn", "shape", "numel", "start", "end_inclusive"}));
    }
    for (size_t r = 0; r < f["ranks"].size(); ++r) {
      const json& rank = f["ranks"][r];
      ASSERT_TRUE(
          HasKeys(rank, {"rank", "numel_padded", "unsharded_start",
                         "unsharded_end_inclusive", "shard_param_infos"}));
      EXPECT_EQ(rank["rank"], r);
      ASSERT_EQ(rank["shard_param_infos"].size(), params.size());
      for (size_t i = 0; i < params.size(); ++i) {
        const json& s = rank["shard_param_infos"][i];
        ASSERT_TRUE(
            HasKeys(s, {"fqn", "in_shard", "offset_in_shard", "numel_in_shard",
                        "intra_param_start_idx", "intra_param_end_idx"}));
        EXPECT_EQ(s["fqn"], params[i]["fqn"]);
        if (s["in_shard"].get<bool>()) {
          held[i] += s["numel_in_shard"].get<int64_t>();
        } else {
          EXPECT_TRUE(s["numel_in_shard"].is_null());
        }
      }
    }
    const int64_t copies = doc["strategy"] == "NO_SHARD" ? shards : 1;
    for (size_t i = 0; i < params.size(); ++i) {
      EXPECT_EQ(held[i], copies * params[i]["numel"].get<int64_t>())
          << params[i]["fqn"];
    }
  }
}

TEST(InspectTest, JsonForEveryPreset) {
  for (const std::string& name : PresetNames()) {
    SCOPED_TRACE(name);
    FLATPARAM_ASSERT_OK_AND_ASSIGN(ModelSpec spec, PresetModel(name));
    FLATPARAM_ASSERT_OK_AND_ASSIGN(json doc,
                                   InspectToJson(Options(name, 8, "json")));
    CheckDocument(doc, 8, 8);
    EXPECT_EQ(doc["model"], name);
    EXPECT_EQ(doc["strategy"], "FULL_SHARD");
    EXPECT_EQ(doc["align_addresses"], false);
    ASSERT_EQ(doc["flat_params"].size(), spec.wrap.size() + 1);
    EXPECT_EQ(doc["flat_params"][0]["unit"], "");
    EXPECT_EQ(doc["flat_params"][1]["unit"], spec.wrap[0]);
  }
}

TEST(InspectTest, Gpt2JsonValues) {
  InspectOptions o = Options("gpt2", 4, "json");
  FLATPARAM_ASSERT_OK_AND_ASSIGN(json doc, InspectToJson(o));
  const json& root = doc["flat_params"][0];
  EXPECT_EQ(root["dtype"], "float32");
  EXPECT_EQ(root["shared_params"], json::parse(R"([{"fqn": "lm_head.weight",
                             "prim_fqn": "transformer.wte.weight"}])"));
  // wte + wpe + ln_f: 38,597,376 + 786,432 + 1,536 = 39,385,344 = 4 *
  // 9,846,336.
  EXPECT_EQ(root["unpadded_unsharded_numel"], 39385344);
  EXPECT_EQ(root["sharded_numel"], 9846336);
  EXPECT_EQ(root["ranks"][0]["shard_param_infos"][0],
            json::parse(R"({"fqn": "transformer.wte.weight", "in_shard": true,
                "offset_in_shard": 0, "numel_in_shard": 9846336,
                "intra_param_start_idx": 0,
                "intra_param_end_idx": 9846335})"));
  const json& h0 = doc["flat_params"][1];
  EXPECT_EQ(h0["unit"], "transformer.h.0");
  EXPECT_EQ(h0["params"][2]["fqn"], "transformer.h.0.attn.c_attn.weight");
  EXPECT_EQ(h0["params"][2]["shape"], json({768, 2304}));
  EXPECT_EQ(h0["unpadded_unsharded_numel"], 7087872);
}

TEST(InspectTest, Llama70bTableIsCompleteAndFast) {
  InspectOptions o = Options("llama2-70b", 8, "table");
  FLATPARAM_ASSERT_OK_AND_ASSIGN(std::string table, InspectToTable(o));
  EXPECT_TRUE(Contains(table,
                       "model llama2-70b: 723 parameters (0 shared), "
                       "68,976,648,192 elements, 81 flat parameters"));
  EXPECT_TRUE(Contains(table, "unit layers.79: bfloat16, 9 params"));
  EXPECT_TRUE(Contains(table,
                       "total: 81 flat parameters, 68,976,648,192 "
                       "elements + 0 padding; unsharded 128.48 GiB; "
                       "sharded 16.06 GiB per rank"));
  // 1 summary + 81 * (1 header + 1 column header + 8 ranks) lines, roughly.
  EXPECT_LT(std::count(table.begin(), table.end(), '\n'), 1000);
}

TEST(InspectTest, TableForEveryPreset) {
  for (const std::string& name : PresetNames()) {
    SCOPED_TRACE(name);
    FLATPARAM_ASSERT_OK_AND_ASSIGN(std::string table,
                                   InspectToTable(Options(name, 8, "table")));
    EXPECT_THAT(
        table,
        AllOf(StartsWith("model " + name + ": "), HasSubstr("\nunit <root>: "),
              HasSubstr("\n  rank  interval"), HasSubstr("\ntotal: ")));
  }
}

// The tiny model aligned over 4 ranks, worked by hand: the root holds
// emb.weight [0, 32], pad 3, seq.0.weight [36, 50], pad 1, seq.0.bias
// [52, 56], pad 3 -> 60 elements, 15 per rank.
TEST(InspectTest, TinyModelJson) {
  InspectOptions o = Options(kTinyModel, 4, "json");
  o.layout.align_addresses = true;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(json doc, InspectToJson(o));
  CheckDocument(doc, 4, 4);
  EXPECT_EQ(doc["model"], "tiny");
  EXPECT_EQ(doc["align_addresses"], true);
  ASSERT_EQ(doc["flat_params"].size(), 3);
  const json& root = doc["flat_params"][0];
  EXPECT_EQ(root["numels_with_padding"], json({33, 3, 15, 1, 5, 3}));
  EXPECT_EQ(root["sharded_numel"], 15);
  EXPECT_EQ(root["ranks"][3]["shard_param_infos"][2],
            json::parse(R"({"fqn": "seq.0.bias", "in_shard": true,
                "offset_in_shard": 7, "numel_in_shard": 5,
                "intra_param_start_idx": 0, "intra_param_end_idx": 4})"));
  EXPECT_EQ(doc["flat_params"][1]["unit"], "seq.2");
  EXPECT_EQ(doc["flat_params"][2]["unit"], "seq.4");
  // seq.4: weight 21 + pad 3 + bias 3 = 27, padded to 28 for 4 ranks.
  EXPECT_EQ(doc["flat_params"][2]["unpadded_unsharded_numel"], 28);
  EXPECT_EQ(doc["flat_params"][2]["params"][1]["fqn"], "seq.4.bias");
}

TEST(InspectTest, TinyModelTable) {
  InspectOptions o = Options(kTinyModel, 4, "table");
  FLATPARAM_ASSERT_OK_AND_ASSIGN(std::string table, InspectToTable(o));
  EXPECT_EQ(
      table,
      R"(model tiny: 8 parameters (1 shared), 119 elements, 3 flat parameters
strategy FULL_SHARD, world size 4, align_addresses off, compute dtype = parameter dtype
intervals are inclusive element ranges of the padded flat parameter; params held: fqn = whole, fqn[a:b] = flattened elements a..b-1

unit <root>: float32, 3 params + 1 shared, numel 53, padding 3, unsharded 224 B, sharded 56 B per rank
  shared: head.weight -> emb.weight
  rank  interval  padded  elements  bytes  params held
     0  [0, 13]        0        14   56 B  emb.weight[0:14]
     1  [14, 27]       0        14   56 B  emb.weight[14:28]
     2  [28, 41]       0        14   56 B  emb.weight[28:33], seq.0.weight[0:9]
     3  [42, 55]       3        11   44 B  seq.0.weight[9:15], seq.0.bias

unit seq.2: float32, 2 params, numel 42, padding 2, unsharded 176 B, sharded 44 B per rank
  rank  interval  padded  elements  bytes  params held
     0  [0, 10]        0        11   44 B  seq.2.weight[0:11]
     1  [11, 21]       0        11   44 B  seq.2.weight[11:22]
     2  [22, 32]       0        11   44 B  seq.2.weight[22:33]
     3  [33, 43]       2         9   36 B  seq.2.weight[33:35], seq.2.bias

unit seq.4: float32, 2 params, numel 24, padding 0, unsharded 96 B, sharded 24 B per rank
  rank  interval  padded  elements  bytes  params held
     0  [0, 5]         0         6   24 B  seq.4.weight[0:6]
     1  [6, 11]        0         6   24 B  seq.4.weight[6:12]
     2  [12, 17]       0         6   24 B  seq.4.weight[12:18]
     3  [18, 23]       0         6   24 B  seq.4.weight[18:21], seq.4.bias

total: 3 flat parameters, 119 elements + 5 padding; unsharded 496 B; sharded 124 B per rank
)");
}

TEST(InspectTest, TableAbbreviatesLongLists) {
  InspectOptions o = Options("gpt2", 64, "table");
  FLATPARAM_ASSERT_OK_AND_ASSIGN(std::string table, InspectToTable(o));
  EXPECT_TRUE(Contains(table, "(44 ranks not shown)"));
  EXPECT_TRUE(Contains(table, "\n    63  ["));
  EXPECT_FALSE(Contains(table, "\n    16  ["));

  o = Options("gpt2", 1, "table");
  FLATPARAM_ASSERT_OK_AND_ASSIGN(table, InspectToTable(o));
  EXPECT_THAT(
      table,
      HasSubstr("transformer.h.0.ln_1.weight, transformer.h.0.ln_1.bias, "
                "transformer.h.0.attn.c_attn.weight, ... (+7 more) ..., "
                "transformer.h.0.mlp.c_proj.weight, "
                "transformer.h.0.mlp.c_proj.bias\n"));
}

TEST(InspectTest, NoShardKeepsTheWhole) {
  InspectOptions o = Options(kTinyModel, 3, "json");
  o.layout.strategy = "no_shard";
  FLATPARAM_ASSERT_OK_AND_ASSIGN(json doc, InspectToJson(o));
  CheckDocument(doc, 3, 3);
  EXPECT_EQ(doc["strategy"], "NO_SHARD");
  o.format = "table";
  FLATPARAM_ASSERT_OK_AND_ASSIGN(std::string table, InspectToTable(o));
  EXPECT_TRUE(Contains(table, "every rank holds every flat parameter whole"));
  EXPECT_TRUE(Contains(table,
                       "\n     2  [0, 52]        0        53  212 B  "
                       "emb.weight, seq.0.weight, seq.0.bias\n"));
  for (const json& f : doc["flat_params"]) {
    EXPECT_EQ(f["sharded_numel"], f["unpadded_unsharded_numel"]);
    for (const json& r : f["ranks"]) {
      EXPECT_EQ(r["unsharded_start"], 0);
      EXPECT_EQ(r["unsharded_end_inclusive"],
                f["unpadded_unsharded_numel"].get<int64_t>() - 1);
    }
  }
}

TEST(InspectTest, HybridShardsOverTheShardGroup) {
  InspectOptions o = Options("gpt2", 16, "json");
  o.layout.strategy = "HYBRID_SHARD";
  FLATPARAM_ASSERT_OK_AND_ASSIGN(json doc, InspectToJson(o));
  CheckDocument(doc, 16, 8);  // Default G = 8.

  o.layout.world_size = 12;  // Not divisible by 8: G = W.
  FLATPARAM_ASSERT_OK_AND_ASSIGN(doc, InspectToJson(o));
  CheckDocument(doc, 12, 12);

  o.layout.strategy = "HYBRID_SHARD_ZERO2";
  o.layout.shard_group_size = 4;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(doc, InspectToJson(o));
  CheckDocument(doc, 12, 4);
  EXPECT_EQ(doc["flat_params"][0]["sharded_numel"], 39385344 / 4);

  o.format = "table";
  FLATPARAM_ASSERT_OK_AND_ASSIGN(std::string table, InspectToTable(o));
  EXPECT_TRUE(Contains(table, "world size 12 = 3 replicas x shard group of 4"));
  EXPECT_TRUE(
      Contains(table, "rows are the shard ranks 0..3 of every replica"));
}

TEST(InspectTest, ShardGroupSizeRules) {
  EXPECT_EQ(ShardGroupSize(ShardingStrategy::kHybridShard, 16, 0).value_or(-1),
            8);
  EXPECT_EQ(ShardGroupSize(ShardingStrategy::kHybridShard, 6, 0).value_or(-1),
            6);
  EXPECT_EQ(ShardGroupSize(ShardingStrategy::kFullShard, 6, 0).value_or(-1), 6);
  EXPECT_THAT(ShardGroupSize(ShardingStrategy::kHybridShard, 16, 3),
              StatusIs(kInvalid, HasSubstr("--shard-group-size=3 does not "
                                           "divide --world-size=16")));
  EXPECT_THAT(ShardGroupSize(ShardingStrategy::kFullShard, 16, 8),
              StatusIs(kInvalid, HasSubstr("applies only to HYBRID_SHARD")));
  EXPECT_THAT(ShardGroupSize(ShardingStrategy::kHybridShard, 16, -1),
              StatusIs(kInvalid, HasSubstr("got -1")));
}

TEST(InspectTest, OverridesDtypeAndComputeDtype) {
  InspectOptions o = Options("gpt2", 2, "json");
  o.layout.dtype = "bf16";
  o.layout.compute_dtype = "float16";
  o.layout.align_addresses = true;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(json doc, InspectToJson(o));
  EXPECT_EQ(doc["compute_dtype"], "float16");
  EXPECT_EQ(doc["flat_params"][0]["dtype"], "bfloat16");
  EXPECT_EQ(doc["flat_params"][0]["aligned_numel"], 8);
}

TEST(InspectTest, Errors) {
  struct Case {
    InspectOptions options;
    absl::StatusCode code;
    std::vector<std::string> substrings;
  };
  std::vector<Case> cases;
  cases.push_back({Options("gpt3", 8, "table"),
                   absl::StatusCode::kNotFound,
                   {"\"gpt3\"", "gpt2, ", "llama2-70b"}});
  cases.push_back(
      {Options(kMalformedModel, 8, "json"),
       kInvalid,
       {"tools/testdata/malformed_model.json:4:35: malformed JSON"}});
  cases.push_back({Options("", 8, "json"), kInvalid, {"--model is required"}});
  cases.push_back({Options("gpt2", 0, "json"),
                   kInvalid,
                   {"--world-size must be between 1 and", "got 0"}});
  cases.push_back({Options("gpt2", 8, "xml"),
                   kInvalid,
                   {"--format must be table or json, got \"xml\""}});
  InspectOptions bad_strategy = Options("gpt2", 8, "json");
  bad_strategy.layout.strategy = "ZERO3";
  cases.push_back({bad_strategy, kInvalid, {"--strategy: ", "\"ZERO3\""}});
  InspectOptions bad_compute = Options("gpt2", 8, "json");
  bad_compute.layout.compute_dtype = "int8";
  cases.push_back({bad_compute,
                   kInvalid,
                   {"--compute-dtype must be a floating-point dtype"}});
  InspectOptions bad_dtype = Options("gpt2", 8, "json");
  bad_dtype.layout.dtype = "float8";
  cases.push_back({bad_dtype, kInvalid, {"--dtype: ", "float8"}});
  InspectOptions int_dtype = Options(kTinyModel, 8, "json");
  int_dtype.layout.dtype = "int64";
  cases.push_back({int_dtype, kInvalid, {"cannot flatten integer dtype"}});
  InspectOptions bad_group = Options("gpt2", 8, "json");
  bad_group.layout.strategy = "HYBRID_SHARD";
  bad_group.layout.shard_group_size = 3;
  cases.push_back({bad_group, kInvalid, {"does not divide"}});

  for (const Case& c : cases) {
    std::ostringstream out;
    const absl::Status status = RunInspect(c.options, out);
    EXPECT_EQ(status.code(), c.code) << status;
    for (const std::string& s : c.substrings) {
      EXPECT_THAT(std::string(status.message()), HasSubstr(s));
    }
    EXPECT_EQ(out.str(), "") << "nothing is written on error";
  }
}

TEST(InspectTest, HumanBytes) {
  EXPECT_EQ(HumanBytes(0), "0 B");
  EXPECT_EQ(HumanBytes(1023), "1023 B");
  EXPECT_EQ(HumanBytes(1536), "1.50 KiB");
  EXPECT_EQ(HumanBytes(int64_t{3} << 30), "3.00 GiB");
}

}  // namespace
}  // namespace tools
}  // namespace flatparam
