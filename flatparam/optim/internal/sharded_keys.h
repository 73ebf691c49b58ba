// Private to //flatparam/optim:fsdp_optim: a rank's sharded dict converted
// between the keys its optimizer uses (OptimStateOptions::sharded_keys:
// NamedOptimizer names, with or without module-wrapper prefixes, or
// optimizer IDs) and the layout's keys (flat-parameter indices on the flat
// path, clean FQNs on the original-parameter path), in which consolidating
// (ToLayoutKeys) and sharding (FromLayoutKeys) work. The rules are the
// ShardedKeys comment's in fsdp_optim.h.
//
// Ownership: the functions take caller-owned arguments and return new
// dicts. Thread-safety: pure functions.
#ifndef FLATPARAM_OPTIM_INTERNAL_SHARDED_KEYS_H_
#define FLATPARAM_OPTIM_INTERNAL_SHARDED_KEYS_H_

#include "absl/status/statusor.h"
#include "flatparam/model_layout.h"
#include "flatparam/optim/fsdp_optim.h"
#include "flatparam/optim/optim_state.h"

namespace flatparam {
namespace optim {
namespace internal_optim {

// Keyed optimizers need an entry for every parameter with state.
bool FillsEmpty(const OptimStateOptions& options);

// The sharded dict `dict`, keyed as the rank's optimizer keys it, keyed by
// layout (flat-parameter indices or FQNs). `dict` itself with kLayout.
// InvalidArgument for two optimizer_params or two keys naming one
// parameter (naming both), an ID key with kNames, and an ID outside
// optimizer_params.
absl::StatusOr<OptimStateDict> ToLayoutKeys(const ModelLayout& layout,
                                            const OptimStateDict& dict,
                                            const OptimStateOptions& options);

// The inverse: a layout-keyed sharded dict as the rank's optimizer keys
// it (kOptimizerIds: groups sorted). InvalidArgument for two
// optimizer_params or two keys naming one parameter (naming both), and for
// a parameter with state that a non-empty optimizer_params does not list.
absl::StatusOr<OptimStateDict> FromLayoutKeys(const ModelLayout& layout,
                                              const OptimStateDict& dict,
                                              const OptimStateOptions& options);

}  // namespace internal_optim
}  // namespace optim
}  // namespace flatparam

#endif  // FLATPARAM_OPTIM_INTERNAL_SHARDED_KEYS_H_
