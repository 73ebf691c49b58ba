// Built-in model descriptions ("presets") of well-known models, built from
// their published configurations, for inspecting and planning FSDP layouts
// without a model file.
//
// Each preset lists every parameter with the exact fully-qualified name,
// shape and order of the reference implementation's `model.parameters()`
// (module registration order), ties parameters where the model ties them,
// and wraps one FSDP unit per transformer block (the root owns the rest):
//
//   gpt2, gpt2-medium, gpt2-large, gpt2-xl
//       Hugging Face `GPT2LMHeadModel`, float32. Conv1D weights are
//       [in, out]; `lm_head.weight` is tied to `transformer.wte.weight`.
//       Units: `transformer.h.{i}`.
//   llama2-7b, llama2-13b, llama2-70b, llama3-8b, llama3-70b
//       Meta's reference `model.py` (`Transformer`), bfloat16. Linear
//       weights are [out, in]; `output.weight` is not tied. Units:
//       `layers.{i}`.
//   llama2-7b-hf, llama2-13b-hf, llama2-70b-hf, llama3-8b-hf, llama3-70b-hf
//       The same models as Hugging Face `transformers` names them
//       (`LlamaForCausalLM`, the names in the published
//       model.safetensors.index.json files), in the dtype of the published
//       `config.json` (`torch_dtype`: float16 for Llama 2, bfloat16 for
//       Llama 3), so that the published safetensors import as they are
//       (`fsdp checkpoint shard`, interop/hf/hf_checkpoint.h). Units:
//       `model.layers.{i}`. The names map one to one (Meta -> Hugging
//       Face; L = layers.{i}, M = model.layers.{i}):
//         tok_embeddings.weight       -> model.embed_tokens.weight
//         L.attention.wq.weight       -> M.self_attn.q_proj.weight
//         L.attention.wk.weight       -> M.self_attn.k_proj.weight
//         L.attention.wv.weight       -> M.self_attn.v_proj.weight
//         L.attention.wo.weight       -> M.self_attn.o_proj.weight
//         L.feed_forward.w1.weight    -> M.mlp.gate_proj.weight
//         L.feed_forward.w3.weight    -> M.mlp.up_proj.weight
//         L.feed_forward.w2.weight    -> M.mlp.down_proj.weight
//         L.attention_norm.weight     -> M.input_layernorm.weight
//         L.ffn_norm.weight           -> M.post_attention_layernorm.weight
//         norm.weight                 -> model.norm.weight
//         output.weight               -> lm_head.weight
//       with equal shapes, but the module order differs (gate, up, down vs
//       w1, w2, w3), and the values are not interchangeable: Hugging Face's
//       conversion script permutes the rows of wq and wk for its rotary
//       embedding, so a Meta checkpoint renamed by this table is not a
//       Hugging Face checkpoint of the same model.
//
// Example:
//
//   FLATPARAM_ASSIGN_OR_RETURN(ModelSpec spec, PresetModel("llama2-7b"));
//   // spec.params.size() == 291, total 6,738,415,616 elements.
//
// Thread-safety: pure functions; each call returns a fresh value.
#ifndef FLATPARAM_PRESETS_H_
#define FLATPARAM_PRESETS_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "flatparam/model_layout.h"

namespace flatparam {

// The preset named `name` (exact, lower case, as listed by PresetNames()).
// Returns InvalidArgument naming `name` and listing the presets otherwise.
absl::StatusOr<ModelSpec> PresetModel(absl::string_view name);

// The names PresetModel accepts, in a stable order.
std::vector<std::string> PresetNames();

// True when `name` is one of PresetNames().
bool IsPresetName(absl::string_view name);

// The hidden size of a Llama feed-forward block, computed as Meta's
// reference `FeedForward.__init__` does from `dim`, `multiple_of` and the
// optional `ffn_dim_multiplier` (0 when unset): 11008 for Llama 2 7B.
int64_t LlamaFeedForwardDim(int64_t dim, int64_t multiple_of,
                            double ffn_dim_multiplier);

}  // namespace flatparam

#endif  // FLATPARAM_PRESETS_H_
