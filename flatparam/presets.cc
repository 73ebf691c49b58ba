#include "flatparam/presets.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "flatparam/base/dtype.h"

namespace flatparam {
namespace {

// Hugging Face GPT2Config fields that determine parameter shapes.
struct Gpt2Config {
  const char* name;
  int64_t n_embd;
  int64_t n_layer;
  int64_t vocab_size = 50257;
  int64_t n_positions = 1024;
};

// Meta's `ModelArgs` fields that determine parameter shapes.
struct LlamaConfig {
  const char* name;
  int64_t dim;
  int64_t n_layers;
  int64_t n_heads;
  int64_t n_kv_heads;  // == n_heads without grouped-query attention.
  int64_t vocab_size;
  int64_t multiple_of;
  double ffn_dim_multiplier;  // 0: None.
  // `torch_dtype` of the Hugging Face `config.json` of the same model (the
  // dtype its published safetensors hold).
  DType hf_dtype;
};

constexpr Gpt2Config kGpt2Configs[] = {
    {"gpt2", 768, 12},
    {"gpt2-medium", 1024, 24},
    {"gpt2-large", 1280, 36},
    {"gpt2-xl", 1600, 48},
};

// From the `params.json` Meta publishes with each checkpoint.
constexpr LlamaConfig kLlamaConfigs[] = {
    {"llama2-7b", 4096, 32, 32, 32, 32000, 256, 0, DType::kFloat16},
    {"llama2-13b", 5120, 40, 40, 40, 32000, 256, 0, DType::kFloat16},
    {"llama2-70b", 8192, 80, 64, 8, 32000, 4096, 1.3, DType::kFloat16},
    {"llama3-8b", 4096, 32, 32, 8, 128256, 1024, 1.3, DType::kBFloat16},
    {"llama3-70b", 8192, 80, 64, 8, 128256, 4096, 1.3, DType::kBFloat16},
};

// The suffix of the Hugging Face-named variant of each Llama preset.
constexpr char kHfSuffix[] = "-hf";

void Add(ModelSpec& spec, std::string fqn, std::vector<int64_t> shape,
         DType dtype) {
  ParamSpec p;
  p.fqn = std::move(fqn);
  p.shape = std::move(shape);
  p.dtype = dtype;
  spec.params.push_back(std::move(p));
}

// GPT2LMHeadModel: transformer.{wte, wpe, h.*, ln_f}, then the tied lm_head.
// Conv1D(nf, nx) stores its weight as [nx, nf], i.e. [in, out].
ModelSpec Gpt2(const Gpt2Config& c) {
  constexpr DType kDType = DType::kFloat32;
  const int64_t d = c.n_embd;
  const int64_t inner = 4 * d;  // n_inner is None in every published config.
  ModelSpec spec;
  spec.name = c.name;
  Add(spec, "transformer.wte.weight", {c.vocab_size, d}, kDType);
  Add(spec, "transformer.wpe.weight", {c.n_positions, d}, kDType);
  for (int64_t i = 0; i < c.n_layer; ++i) {
    const std::string b = absl::StrCat("transformer.h.", i);
    Add(spec, b + ".ln_1.weight", {d}, kDType);
    Add(spec, b + ".ln_1.bias", {d}, kDType);
    Add(spec, b + ".attn.c_attn.weight", {d, 3 * d}, kDType);
    Add(spec, b + ".attn.c_attn.bias", {3 * d}, kDType);
    Add(spec, b + ".attn.c_proj.weight", {d, d}, kDType);
    Add(spec, b + ".attn.c_proj.bias", {d}, kDType);
    Add(spec, b + ".ln_2.weight", {d}, kDType);
    Add(spec, b + ".ln_2.bias", {d}, kDType);
    Add(spec, b + ".mlp.c_fc.weight", {d, inner}, kDType);
    Add(spec, b + ".mlp.c_fc.bias", {inner}, kDType);
    Add(spec, b + ".mlp.c_proj.weight", {inner, d}, kDType);
    Add(spec, b + ".mlp.c_proj.bias", {d}, kDType);
    spec.wrap.push_back(b);
  }
  Add(spec, "transformer.ln_f.weight", {d}, kDType);
  Add(spec, "transformer.ln_f.bias", {d}, kDType);
  ParamSpec head;
  head.fqn = "lm_head.weight";
  head.tied_to = "transformer.wte.weight";
  spec.params.push_back(std::move(head));
  return spec;
}

// Meta's Transformer registers tok_embeddings, layers, norm, output;
// TransformerBlock registers attention (wq, wk, wv, wo), feed_forward
// (w1, w2, w3), attention_norm, ffn_norm. nn.Linear weights are [out, in].
ModelSpec Llama(const LlamaConfig& c) {
  constexpr DType kDType = DType::kBFloat16;
  const int64_t head_dim = c.dim / c.n_heads;
  const int64_t kv_dim = c.n_kv_heads * head_dim;
  const int64_t hidden =
      LlamaFeedForwardDim(c.dim, c.multiple_of, c.ffn_dim_multiplier);
  ModelSpec spec;
  spec.name = c.name;
  Add(spec, "tok_embeddings.weight", {c.vocab_size, c.dim}, kDType);
  for (int64_t i = 0; i < c.n_layers; ++i) {
    const std::string b = absl::StrCat("layers.", i);
    Add(spec, b + ".attention.wq.weight", {c.n_heads * head_dim, c.dim},
        kDType);
    Add(spec, b + ".attention.wk.weight", {kv_dim, c.dim}, kDType);
    Add(spec, b + ".attention.wv.weight", {kv_dim, c.dim}, kDType);
    Add(spec, b + ".attention.wo.weight", {c.dim, c.n_heads * head_dim},
        kDType);
    Add(spec, b + ".feed_forward.w1.weight", {hidden, c.dim}, kDType);
    Add(spec, b + ".feed_forward.w2.weight", {c.dim, hidden}, kDType);
    Add(spec, b + ".feed_forward.w3.weight", {hidden, c.dim}, kDType);
    Add(spec, b + ".attention_norm.weight", {c.dim}, kDType);
    Add(spec, b + ".ffn_norm.weight", {c.dim}, kDType);
    spec.wrap.push_back(b);
  }
  Add(spec, "norm.weight", {c.dim}, kDType);
  Add(spec, "output.weight", {c.vocab_size, c.dim}, kDType);
  return spec;
}

// Hugging Face's LlamaForCausalLM (transformers' modeling_llama.py) for the
// same config: `model` (embed_tokens, layers, norm) then `lm_head`;
// LlamaDecoderLayer registers self_attn (q_proj, k_proj, v_proj, o_proj),
// mlp (gate_proj, up_proj, down_proj), input_layernorm,
// post_attention_layernorm. Shapes are Meta's (intermediate_size is the
// same figure), names and order are not: gate_proj = w1, up_proj = w3,
// down_proj = w2. q_proj/k_proj hold wq/wk with their rows permuted for
// Hugging Face's rotary embedding (its convert_llama_weights_to_hf.py), so
// the two namings agree in shapes, not in values.
ModelSpec LlamaHf(const LlamaConfig& c) {
  const DType dtype = c.hf_dtype;
  const int64_t head_dim = c.dim / c.n_heads;
  const int64_t kv_dim = c.n_kv_heads * head_dim;
  const int64_t hidden =
      LlamaFeedForwardDim(c.dim, c.multiple_of, c.ffn_dim_multiplier);
  ModelSpec spec;
  spec.name = absl::StrCat(c.name, kHfSuffix);
  Add(spec, "model.embed_tokens.weight", {c.vocab_size, c.dim}, dtype);
  for (int64_t i = 0; i < c.n_layers; ++i) {
    const std::string b = absl::StrCat("model.layers.", i);
    Add(spec, b + ".self_attn.q_proj.weight", {c.n_heads * head_dim, c.dim},
        dtype);
    Add(spec, b + ".self_attn.k_proj.weight", {kv_dim, c.dim}, dtype);
    Add(spec, b + ".self_attn.v_proj.weight", {kv_dim, c.dim}, dtype);
    Add(spec, b + ".self_attn.o_proj.weight", {c.dim, c.n_heads * head_dim},
        dtype);
    Add(spec, b + ".mlp.gate_proj.weight", {hidden, c.dim}, dtype);
    Add(spec, b + ".mlp.up_proj.weight", {hidden, c.dim}, dtype);
    Add(spec, b + ".mlp.down_proj.weight", {c.dim, hidden}, dtype);
    Add(spec, b + ".input_layernorm.weight", {c.dim}, dtype);
    Add(spec, b + ".post_attention_layernorm.weight", {c.dim}, dtype);
    spec.wrap.push_back(b);
  }
  Add(spec, "model.norm.weight", {c.dim}, dtype);
  Add(spec, "lm_head.weight", {c.vocab_size, c.dim}, dtype);
  return spec;
}

}  // namespace

int64_t LlamaFeedForwardDim(int64_t dim, int64_t multiple_of,
                            double ffn_dim_multiplier) {
  // hidden_dim = int(2 * (4 * dim) / 3); Python's int() truncates.
  int64_t hidden = 2 * (4 * dim) / 3;
  if (ffn_dim_multiplier > 0) {
    hidden = static_cast<int64_t>(ffn_dim_multiplier * hidden);
  }
  return multiple_of * ((hidden + multiple_of - 1) / multiple_of);
}

std::vector<std::string> PresetNames() {
  std::vector<std::string> names;
  for (const Gpt2Config& c : kGpt2Configs) names.push_back(c.name);
  for (const LlamaConfig& c : kLlamaConfigs) names.push_back(c.name);
  for (const LlamaConfig& c : kLlamaConfigs) {
    names.push_back(absl::StrCat(c.name, kHfSuffix));
  }
  return names;
}

bool IsPresetName(absl::string_view name) {
  const std::vector<std::string> names = PresetNames();
  return std::find(names.begin(), names.end(), name) != names.end();
}

absl::StatusOr<ModelSpec> PresetModel(absl::string_view name) {
  for (const Gpt2Config& c : kGpt2Configs) {
    if (name == c.name) return Gpt2(c);
  }
  for (const LlamaConfig& c : kLlamaConfigs) {
    if (name == c.name) return Llama(c);
    if (name == absl::StrCat(c.name, kHfSuffix)) return LlamaHf(c);
  }
  return absl::InvalidArgumentError(
      absl::StrFormat("unknown model preset \"%s\"; the presets are: %s", name,
                      absl::StrJoin(PresetNames(), ", ")));
}

}  // namespace flatparam
