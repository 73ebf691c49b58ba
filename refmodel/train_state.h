// Converters between optimizer state dicts (optim_state.h) and the
// training library's per-parameter state (refmodel/optimizer.h's
// OptimizerState: named HostTensors, "step" 0-d, buffers 1-D), so
// that a trainer's sharded state can be consolidated, resharded and
// loaded with fsdp_optim.h.
//
//   // On every rank: the trainer's state per flat parameter.
//   std::vector<OptimizerState> mine = ...;
//   optim::OptimStateDict sharded = ShardedFromTrainStates(mine);
//   FLATPARAM_ASSIGN_OR_RETURN(optim::OptimStateDict full,
//       ConsolidateOptimState(layout, sharded, comm));
//   FLATPARAM_ASSIGN_OR_RETURN(auto by_fqn, TrainStatesFromFull(full));
//
// The flat-parameter path's sharded form is exactly what the FSDP trainer
// steps: one state per flat parameter with 1-D buffers of the shard's size.
// OptimizerState has no parameter groups and no non-tensor values:
// groups are empty after conversion, None values (PyTorch's SGD without
// momentum) are dropped, and any other non-tensor value is an error.
//
// Thread-safety: pure functions; the results own copies of the tensors.
#ifndef FLATPARAM_REFMODEL_TRAIN_STATE_H_
#define FLATPARAM_REFMODEL_TRAIN_STATE_H_

#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "flatparam/model_layout.h"
#include "flatparam/optim/optim_state.h"
#include "refmodel/optimizer.h"

namespace flatparam {
namespace refmodel {

// The flat path's sharded dict of one rank: states[i] is flat parameter
// i's state (an empty state gives no entry).
optim::OptimStateDict ShardedFromTrainStates(
    absl::Span<const OptimizerState> states);

// The inverse: one state per flat parameter of `layout` (empty where the
// dict has none). InvalidArgument for a key that is not a flat-parameter
// index of `layout`, or a non-tensor value other than None.
absl::StatusOr<std::vector<OptimizerState>> TrainStatesFromSharded(
    const ModelLayout& layout, const optim::OptimStateDict& sharded);

// A full dict keyed by FQN (or the original-parameter path's sharded
// dict) from states by FQN.
optim::OptimStateDict FullFromTrainStates(
    const std::map<std::string, OptimizerState>& states);

// The inverse. InvalidArgument for a parameter-ID key or a non-tensor value
// other than None.
absl::StatusOr<std::map<std::string, OptimizerState>> TrainStatesFromFull(
    const optim::OptimStateDict& full);

}  // namespace refmodel
}  // namespace flatparam

#endif  // FLATPARAM_REFMODEL_TRAIN_STATE_H_
