// Private to //flatparam/checkpoint: an optimizer sidecar (training_state.h) as
// the offline conversions see it -- resolved to metadata against its
// safetensors file -- and the sidecar entries of a flat parameter's
// replicated states. convert.cc (consolidate, reshard, verify) and
// full_optim_shards.cc (shard, Hugging Face import) share them.
//
// Ownership: a TensorSource that AddUnitState appends points into the
// caller's Keep, which must outlive it. Thread-safety: pure functions,
// apart from the reads of the file they are given.
#ifndef FLATPARAM_CHECKPOINT_INTERNAL_SIDECAR_META_H_
#define FLATPARAM_CHECKPOINT_INTERNAL_SIDECAR_META_H_

#include <cstdint>
#include <list>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "flatparam/checkpoint/safetensors.h"
#include "flatparam/checkpoint/training_state.h"
#include "flatparam/flatten.h"
#include "flatparam/optim/internal/state_meta.h"
#include "flatparam/optim/optim_state.h"

namespace flatparam {
namespace checkpoint {
namespace internal_checkpoint {

// Resolves a sidecar that CheckRankSidecar or CheckFullSidecar
// (training_state.h) accepted against its safetensors file: positive-dim
// tensors by their entries, 0-d tensors read. Checking there, not here, keeps
// the tools accepting exactly what ReadRankState and ReadFullState accept.
absl::StatusOr<optim::internal_optim::StateMeta> ResolveSidecar(
    const OptimSidecar& sidecar, const SafetensorsReader& file);

// A place for the 0-d tensors the written sources point into.
using Keep = std::list<HostTensor>;

// The sidecar and 0-d tensor sources of a flat parameter's replicated
// states, plus references to its positive-dimension tensors.
void AddUnitState(int64_t u, const std::vector<std::string>& tensor_states,
                  const optim::ParamState& scalars, OptimSidecar& sidecar,
                  Keep& keep, std::vector<TensorSource>& zero_dim);

}  // namespace internal_checkpoint
}  // namespace checkpoint
}  // namespace flatparam

#endif  // FLATPARAM_CHECKPOINT_INTERNAL_SIDECAR_META_H_
