// Private to //flatparam/optim:fsdp_optim: planning a full dict's sharding,
// shared by ShardFullOptimState (fsdp_optim_shard.cc) and
// ScatterFullOptimState (fsdp_optim_scatter.cc). Planning works on
// metadata only (StateMeta), so that every rank of a scatter validates and
// plans alike; each rank then allocates its part of the result and fills
// it, from its own tensors or from rank 0's broadcasts.
//
// Ownership: a ShardPlan points into the StateMeta it was planned from
// (and so into the dict that views), which must outlive it; an
// OrigUnitOutput's windows point into its own states. Thread-safety: pure
// functions on caller-owned data.
#ifndef FLATPARAM_OPTIM_INTERNAL_SHARD_PLAN_H_
#define FLATPARAM_OPTIM_INTERNAL_SHARD_PLAN_H_

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "flatparam/base/dtype.h"
#include "flatparam/layout.h"
#include "flatparam/model_layout.h"
#include "flatparam/optim/fsdp_optim.h"
#include "flatparam/optim/internal/flat_plan.h"
#include "flatparam/optim/internal/flat_range.h"
#include "flatparam/optim/internal/state_meta.h"
#include "flatparam/optim/optim_state.h"

namespace flatparam {
namespace optim {
namespace internal_optim {

// If `full` has parameter IDs, the same keyed by name (ModelParamOrder,
// then unmanaged_params), and `*rekeyed` true; otherwise an empty dict and
// `*rekeyed` false.
absl::StatusOr<OptimStateDict> RekeyedByName(const ModelLayout& layout,
                                             const OptimStateDict& full,
                                             const OptimStateOptions& options,
                                             bool* rekeyed);

// One flat parameter's parameters' states (original-parameter path).
struct OrigUnitPlan {
  int unit = 0;
  // Per parameter: its (non-empty) state, or null.
  std::vector<const ParamStateMeta*> params;
  // Positive-dimension state names over the unit's parameters, with their
  // dtype.
  std::map<std::string, DType> tensors;
};

// A full dict's sharding: per flat parameter with state, its plan for
// the path in use; the rest; and the re-keyed groups.
struct ShardPlan {
  std::vector<FlatUnitPlan> flat;
  std::vector<OrigUnitPlan> orig;
  // Unmanaged and user-defined states, copied as they are.
  std::vector<std::pair<ParamKey, const ParamStateMeta*>> passthrough;
  std::vector<ParamGroup> groups;
};

// `full` must be keyed by name. Warns (Warn) for each key that is neither
// a model parameter nor an unmanaged one. InvalidArgument for the errors
// in fsdp_optim.h's file comment (flattening, or the original-parameter
// path's shapes and dtypes), and for a group listing a key that is no
// parameter's (PlanGroups).
absl::StatusOr<ShardPlan> PlanShard(const ModelIndex& index,
                                    const StateMeta& full,
                                    const std::vector<ParamGroup>& groups,
                                    const OptimStateOptions& options);

// The per-parameter data of state `name` (rank 0 / local view).
std::vector<ConstWindow> FullWindows(
    const FlatParamLayout& layout,
    const std::vector<const ParamStateMeta*>& states, const std::string& name);

// The rank's result of the original-parameter path for one unit, with the
// positive-dimension tensors allocated (zeros) and windows onto them per
// state name.
struct OrigUnitOutput {
  std::map<int, ParamState> states;  // parameter index -> state
  std::map<std::string, std::vector<Window>> windows;
};

// With `fill_empty` (keyed optimizers), a parameter with state that the
// rank holds no piece of gets zero-element tensors and its replicated values.
OrigUnitOutput AllocateOrigUnit(const FlatParamLayout& layout,
                                const OrigUnitPlan& plan, int64_t rank,
                                bool fill_empty);

// Copies the plan's passthrough states into `out` and sets its groups.
void EmitPassthrough(const ShardPlan& plan, OptimStateDict& out);

}  // namespace internal_optim
}  // namespace optim
}  // namespace flatparam

#endif  // FLATPARAM_OPTIM_INTERNAL_SHARD_PLAN_H_
