#include "flatparam/presets.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "flatparam/base/status_matchers.h"
#include "flatparam/layout.h"
#include "flatparam/model_layout.h"

namespace flatparam {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsSupersetOf;

// Elements of the distinct (untied) parameters: the figure model cards cite.
int64_t TotalNumel(const ModelSpec& spec) {
  int64_t total = 0;
  for (const ParamSpec& p : spec.params) {
    if (p.tied_to.empty()) total += NumElements(p.shape);
  }
  return total;
}

const ParamSpec* Find(const ModelSpec& spec, const std::string& fqn) {
  for (const ParamSpec& p : spec.params) {
    if (p.fqn == fqn) return &p;
  }
  return nullptr;
}

TEST(PresetsTest, NamesIncludeRequiredPresets) {
  EXPECT_THAT(PresetNames(),
              IsSupersetOf({"gpt2", "llama2-7b", "llama3-8b", "llama2-70b"}));
  EXPECT_TRUE(IsPresetName("gpt2"));
  EXPECT_FALSE(IsPresetName("GPT2"));
}

// Published totals (Hugging Face model cards and Meta's papers), each also
// recomputed by hand from the config in the comments.
TEST(PresetsTest, TotalsMatchPublishedCounts) {
  const std::vector<std::pair<std::string, int64_t>> expected = {
      // 50257*768 + 1024*768 + 12*7,087,872 + 2*768
      {"gpt2", 124439808},
      {"gpt2-medium", 354823168},
      {"gpt2-large", 774030080},
      {"gpt2-xl", 1557611200},
      // 2*32000*4096 + 4096 + 32*(4*4096^2 + 3*4096*11008 + 2*4096)
      {"llama2-7b", 6738415616},
      {"llama2-13b", 13015864320},
      // 2*32000*8192 + 8192 + 80*(2*8192^2 + 2*1024*8192 + 3*8192*28672
      //                           + 2*8192)
      {"llama2-70b", 68976648192},
      // 2*128256*4096 + 4096 + 32*(2*4096^2 + 2*1024*4096 + 3*4096*14336
      //                            + 2*4096)
      {"llama3-8b", 8030261248},
      {"llama3-70b", 70553706496},
      // Hugging Face's names for the same parameters.
      {"llama2-7b-hf", 6738415616},
      {"llama2-13b-hf", 13015864320},
      {"llama2-70b-hf", 68976648192},
      {"llama3-8b-hf", 8030261248},
      {"llama3-70b-hf", 70553706496},
  };
  ASSERT_EQ(expected.size(), PresetNames().size());
  for (const auto& [name, total] : expected) {
    FLATPARAM_ASSERT_OK_AND_ASSIGN(ModelSpec spec, PresetModel(name));
    EXPECT_EQ(spec.name, name);
    EXPECT_EQ(TotalNumel(spec), total) << name;
  }
}

TEST(PresetsTest, Gpt2NamesShapesAndTie) {
  FLATPARAM_ASSERT_OK_AND_ASSIGN(ModelSpec spec, PresetModel("gpt2"));
  ASSERT_EQ(spec.params.size(), 2 + 12 * 12 + 2 + 1);
  EXPECT_EQ(spec.params[0].fqn, "transformer.wte.weight");
  EXPECT_THAT(spec.params[0].shape, ElementsAre(50257, 768));
  EXPECT_EQ(spec.params[1].fqn, "transformer.wpe.weight");
  EXPECT_THAT(spec.params[1].shape, ElementsAre(1024, 768));
  // Block 0 in module order.
  std::vector<std::string> block0;
  for (int i = 2; i < 14; ++i) block0.push_back(spec.params[i].fqn);
  EXPECT_THAT(
      block0,
      ElementsAre(
          "transformer.h.0.ln_1.weight", "transformer.h.0.ln_1.bias",
          "transformer.h.0.attn.c_attn.weight",
          "transformer.h.0.attn.c_attn.bias",
          "transformer.h.0.attn.c_proj.weight",
          "transformer.h.0.attn.c_proj.bias", "transformer.h.0.ln_2.weight",
          "transformer.h.0.ln_2.bias", "transformer.h.0.mlp.c_fc.weight",
          "transformer.h.0.mlp.c_fc.bias", "transformer.h.0.mlp.c_proj.weight",
          "transformer.h.0.mlp.c_proj.bias"));
  // Conv1D weights are [in, out].
  EXPECT_THAT(Find(spec, "transformer.h.11.attn.c_attn.weight")->shape,
              ElementsAre(768, 2304));
  EXPECT_THAT(Find(spec, "transformer.h.5.mlp.c_fc.weight")->shape,
              ElementsAre(768, 3072));
  EXPECT_THAT(Find(spec, "transformer.h.5.mlp.c_proj.weight")->shape,
              ElementsAre(3072, 768));
  EXPECT_EQ(spec.params.back().fqn, "lm_head.weight");
  EXPECT_EQ(spec.params.back().tied_to, "transformer.wte.weight");
  EXPECT_EQ(spec.params[spec.params.size() - 2].fqn, "transformer.ln_f.bias");
  for (const ParamSpec& p : spec.params) {
    EXPECT_EQ(p.dtype, DType::kFloat32) << p.fqn;
  }
  ASSERT_EQ(spec.wrap.size(), 12);
  EXPECT_EQ(spec.wrap[0], "transformer.h.0");
  EXPECT_EQ(spec.wrap[11], "transformer.h.11");
}

TEST(PresetsTest, LlamaNamesShapesAndOrder) {
  FLATPARAM_ASSERT_OK_AND_ASSIGN(ModelSpec spec, PresetModel("llama2-7b"));
  ASSERT_EQ(spec.params.size(), 1 + 32 * 9 + 2);
  EXPECT_EQ(spec.params[0].fqn, "tok_embeddings.weight");
  EXPECT_THAT(spec.params[0].shape, ElementsAre(32000, 4096));
  std::vector<std::string> layer0;
  for (int i = 1; i < 10; ++i) layer0.push_back(spec.params[i].fqn);
  EXPECT_THAT(
      layer0,
      ElementsAre(
          "layers.0.attention.wq.weight", "layers.0.attention.wk.weight",
          "layers.0.attention.wv.weight", "layers.0.attention.wo.weight",
          "layers.0.feed_forward.w1.weight", "layers.0.feed_forward.w2.weight",
          "layers.0.feed_forward.w3.weight", "layers.0.attention_norm.weight",
          "layers.0.ffn_norm.weight"));
  EXPECT_THAT(Find(spec, "layers.31.feed_forward.w2.weight")->shape,
              ElementsAre(4096, 11008));
  EXPECT_THAT(Find(spec, "layers.31.attention.wk.weight")->shape,
              ElementsAre(4096, 4096));
  EXPECT_EQ(spec.params[spec.params.size() - 2].fqn, "norm.weight");
  EXPECT_EQ(spec.params.back().fqn, "output.weight");
  EXPECT_TRUE(spec.params.back().tied_to.empty());
  EXPECT_THAT(spec.params.back().shape, ElementsAre(32000, 4096));
  for (const ParamSpec& p : spec.params) {
    EXPECT_EQ(p.dtype, DType::kBFloat16) << p.fqn;
  }
  ASSERT_EQ(spec.wrap.size(), 32);
  EXPECT_EQ(spec.wrap[31], "layers.31");
}

TEST(PresetsTest, GroupedQueryAttentionShapes) {
  FLATPARAM_ASSERT_OK_AND_ASSIGN(ModelSpec l3, PresetModel("llama3-8b"));
  EXPECT_THAT(Find(l3, "layers.0.attention.wk.weight")->shape,
              ElementsAre(1024, 4096));
  EXPECT_THAT(Find(l3, "layers.0.attention.wv.weight")->shape,
              ElementsAre(1024, 4096));
  EXPECT_THAT(Find(l3, "layers.0.feed_forward.w1.weight")->shape,
              ElementsAre(14336, 4096));
  EXPECT_THAT(Find(l3, "tok_embeddings.weight")->shape,
              ElementsAre(128256, 4096));

  FLATPARAM_ASSERT_OK_AND_ASSIGN(ModelSpec l70, PresetModel("llama2-70b"));
  EXPECT_EQ(l70.wrap.size(), 80);
  EXPECT_THAT(Find(l70, "layers.79.attention.wq.weight")->shape,
              ElementsAre(8192, 8192));
  EXPECT_THAT(Find(l70, "layers.79.attention.wk.weight")->shape,
              ElementsAre(1024, 8192));
  EXPECT_THAT(Find(l70, "layers.79.feed_forward.w3.weight")->shape,
              ElementsAre(28672, 8192));
}

// The published Hugging Face config.json of each model (hidden_size,
// intermediate_size, num_hidden_layers, num_attention_heads,
// num_key_value_heads, vocab_size, torch_dtype), checked against every
// parameter of the -hf preset in LlamaForCausalLM's order.
struct HfLlamaConfig {
  const char* preset;
  int64_t hidden, intermediate, layers, heads, kv_heads, vocab;
  DType dtype;
};

void ExpectHfLlama(const HfLlamaConfig& c) {
  SCOPED_TRACE(c.preset);
  FLATPARAM_ASSERT_OK_AND_ASSIGN(ModelSpec spec, PresetModel(c.preset));
  EXPECT_EQ(spec.name, c.preset);
  const int64_t h = c.hidden;
  const int64_t kv = c.kv_heads * (h / c.heads);
  std::vector<std::pair<std::string, std::vector<int64_t>>> want;
  want.push_back({"model.embed_tokens.weight", {c.vocab, h}});
  std::vector<std::string> wrap;
  for (int64_t i = 0; i < c.layers; ++i) {
    const std::string l = "model.layers." + std::to_string(i) + ".";
    want.push_back({l + "self_attn.q_proj.weight", {h, h}});
    want.push_back({l + "self_attn.k_proj.weight", {kv, h}});
    want.push_back({l + "self_attn.v_proj.weight", {kv, h}});
    want.push_back({l + "self_attn.o_proj.weight", {h, h}});
    want.push_back({l + "mlp.gate_proj.weight", {c.intermediate, h}});
    want.push_back({l + "mlp.up_proj.weight", {c.intermediate, h}});
    want.push_back({l + "mlp.down_proj.weight", {h, c.intermediate}});
    want.push_back({l + "input_layernorm.weight", {h}});
    want.push_back({l + "post_attention_layernorm.weight", {h}});
    wrap.push_back("model.layers." + std::to_string(i));
  }
  want.push_back({"model.norm.weight", {h}});
  want.push_back({"lm_head.weight", {c.vocab, h}});
  ASSERT_EQ(spec.params.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(spec.params[i].fqn, want[i].first) << i;
    EXPECT_EQ(spec.params[i].shape, want[i].second) << want[i].first;
    EXPECT_EQ(spec.params[i].dtype, c.dtype) << want[i].first;
    EXPECT_TRUE(spec.params[i].tied_to.empty()) << want[i].first;
  }
  EXPECT_EQ(spec.wrap, wrap);
}

TEST(PresetsTest, HuggingFaceLlamaMatchesPublishedConfigs) {
  // meta-llama/Llama-2-7b-hf, Llama-2-13b-hf, Llama-2-70b-hf (float16),
  // Meta-Llama-3-8B, Meta-Llama-3-70B (bfloat16).
  ExpectHfLlama(
      {"llama2-7b-hf", 4096, 11008, 32, 32, 32, 32000, DType::kFloat16});
  ExpectHfLlama(
      {"llama2-13b-hf", 5120, 13824, 40, 40, 40, 32000, DType::kFloat16});
  ExpectHfLlama(
      {"llama2-70b-hf", 8192, 28672, 80, 64, 8, 32000, DType::kFloat16});
  ExpectHfLlama(
      {"llama3-8b-hf", 4096, 14336, 32, 32, 8, 128256, DType::kBFloat16});
  ExpectHfLlama(
      {"llama3-70b-hf", 8192, 28672, 80, 64, 8, 128256, DType::kBFloat16});
}

// The documented name mapping (presets.h) takes every Meta parameter to a
// Hugging Face one of the same shape, one to one.
std::string MetaToHf(const std::string& meta) {
  static const std::vector<std::pair<std::string, std::string>> kSuffixes = {
      {".attention.wq.weight", ".self_attn.q_proj.weight"},
      {".attention.wk.weight", ".self_attn.k_proj.weight"},
      {".attention.wv.weight", ".self_attn.v_proj.weight"},
      {".attention.wo.weight", ".self_attn.o_proj.weight"},
      {".feed_forward.w1.weight", ".mlp.gate_proj.weight"},
      {".feed_forward.w3.weight", ".mlp.up_proj.weight"},
      {".feed_forward.w2.weight", ".mlp.down_proj.weight"},
      {".attention_norm.weight", ".input_layernorm.weight"},
      {".ffn_norm.weight", ".post_attention_layernorm.weight"},
  };
  if (meta == "tok_embeddings.weight") return "model.embed_tokens.weight";
  if (meta == "norm.weight") return "model.norm.weight";
  if (meta == "output.weight") return "lm_head.weight";
  for (const auto& [from, to] : kSuffixes) {
    if (meta.size() > from.size() &&
        meta.compare(meta.size() - from.size(), from.size(), from) == 0) {
      return "model." + meta.substr(0, meta.size() - from.size()) + to;
    }
  }
  return "";
}

TEST(PresetsTest, HuggingFaceLlamaIsMetaLlamaRenamed) {
  for (const char* name :
       {"llama2-7b", "llama2-13b", "llama2-70b", "llama3-8b", "llama3-70b"}) {
    SCOPED_TRACE(name);
    FLATPARAM_ASSERT_OK_AND_ASSIGN(ModelSpec meta, PresetModel(name));
    FLATPARAM_ASSERT_OK_AND_ASSIGN(ModelSpec hf,
                                   PresetModel(std::string(name) + "-hf"));
    ASSERT_EQ(meta.params.size(), hf.params.size());
    std::map<std::string, const ParamSpec*> by_name;
    for (const ParamSpec& p : hf.params) by_name[p.fqn] = &p;
    for (const ParamSpec& p : meta.params) {
      auto it = by_name.find(MetaToHf(p.fqn));
      ASSERT_NE(it, by_name.end()) << p.fqn << " -> " << MetaToHf(p.fqn);
      EXPECT_EQ(it->second->shape, p.shape) << p.fqn;
      by_name.erase(it);
    }
    EXPECT_TRUE(by_name.empty());
    for (size_t i = 0; i < meta.wrap.size(); ++i) {
      EXPECT_EQ(hf.wrap[i], "model." + meta.wrap[i]);
    }
  }
}

TEST(PresetsTest, FeedForwardDimFollowsMetaFormula) {
  EXPECT_EQ(LlamaFeedForwardDim(4096, 256, 0), 11008);
  EXPECT_EQ(LlamaFeedForwardDim(5120, 256, 0), 13824);
  EXPECT_EQ(LlamaFeedForwardDim(4096, 1024, 1.3), 14336);
  EXPECT_EQ(LlamaFeedForwardDim(8192, 4096, 1.3), 28672);
}

// One flat parameter per block plus the root, and the tie stays in the root.
TEST(PresetsTest, EveryPresetLaysOut) {
  for (const std::string& name : PresetNames()) {
    FLATPARAM_ASSERT_OK_AND_ASSIGN(ModelSpec spec, PresetModel(name));
    LayoutOptions options;
    options.world_size = 8;
    FLATPARAM_ASSERT_OK_AND_ASSIGN(ModelLayout layout,
                                   ModelLayout::Create(spec, options));
    EXPECT_EQ(layout.flat_params().size(), spec.wrap.size() + 1) << name;
    EXPECT_EQ(layout.flat_params()[0].unit(), "") << name;
    EXPECT_EQ(layout.param_numel(), TotalNumel(spec)) << name;
  }
}

TEST(PresetsTest, UnknownNameListsPresets) {
  EXPECT_THAT(PresetModel("gpt3"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("\"gpt3\""), HasSubstr("gpt2"),
                             HasSubstr("llama2-70b"))));
}

}  // namespace
}  // namespace flatparam
