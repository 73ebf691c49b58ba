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
#include "flatparam/model.h"

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
