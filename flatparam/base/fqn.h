// Fully qualified names (FQNs) of parameters, as PyTorch's FSDP spells them
// once the module wrappers are gone.
//
// A wrapped model's `named_parameters()` names carry the wrappers' module
// attributes: FSDP's "_fsdp_wrapped_module.", the activation-checkpoint
// wrapper's "_checkpoint_wrapped_module." and torch.compile's "_orig_mod."
// (OptimizedModule). FSDP's state dicts and optimizer state dicts are keyed
// by the names without them, which CleanTensorName computes:
//
//   CleanTensorName("_fsdp_wrapped_module.layers.0._fsdp_wrapped_module."
//                   "_checkpoint_wrapped_module.mlp.weight")
//       == "layers.0.mlp.weight"
//
// flatparam/interop/hf/hf_checkpoint.h's checkpoint::CleanTensorName, used
// when importing published files, calls this one.
//
// Thread-safety: pure functions.
#ifndef FLATPARAM_BASE_FQN_H_
#define FLATPARAM_BASE_FQN_H_

#include <string>

#include "absl/strings/string_view.h"

namespace flatparam {

// The wrapper prefixes PyTorch's clean_tensor_name removes, with the dot.
inline constexpr char kFsdpWrappedPrefix[] = "_fsdp_wrapped_module.";
inline constexpr char kCheckpointWrappedPrefix[] =
    "_checkpoint_wrapped_module.";
// torch.compile's OptimizedModule attribute, a whole name component.
inline constexpr char kCompiledModuleComponent[] = "_orig_mod";

// The name PyTorch's FSDP gives a parameter or buffer once its wrappers are
// gone (torch.distributed.fsdp._common_utils.clean_tensor_name): every
// "_fsdp_wrapped_module." and then every "_checkpoint_wrapped_module."
// removed wherever it occurs, as Python's str.replace does (so
// "x_fsdp_wrapped_module.y" becomes "xy", as in PyTorch). In addition,
// every "_orig_mod" component (torch.compile's OptimizedModule, which
// torch.distributed.checkpoint strips) is removed; "my_orig_mod.w" is kept.
// A name without any of them is returned unchanged.
//   "_fsdp_wrapped_module.layers.0._checkpoint_wrapped_module.w.weight"
//       -> "layers.0.w.weight"
//   "_orig_mod.model.norm.weight" -> "model.norm.weight"
std::string CleanTensorName(absl::string_view name);

}  // namespace flatparam

#endif  // FLATPARAM_BASE_FQN_H_
