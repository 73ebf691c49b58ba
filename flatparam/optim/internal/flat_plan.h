// The flat-parameter path's rules, on metadata: which model parameter a key
// names, whether a full dict's states can be flattened (PyTorch's
// `_flatten_optim_state` checks, with its InvalidArgument messages), the
// sharded param groups, and whether the ranks' sharded states agree before
// consolidating. One implementation for the in-memory operations
// (fsdp_optim*.cc, on StateMeta views of dicts and on metadata exchanged
// between ranks) and the offline checkpoint converter
// (flatparam/checkpoint/convert.cc, on StateMeta read from checkpoint
// sidecars, whose positive-dimension tensors stay in their files), so both
// accept the same dicts, fail with the same messages and list groups in the
// same order.
//
//   const ModelIndex index(layout, unmanaged_params);
//   FLATPARAM_ASSIGN_OR_RETURN(std::optional<FlatUnitPlan> p,
//                              PlanFlatUnit(index, u, unit_states));
//   FLATPARAM_ASSIGN_OR_RETURN(std::vector<ParamGroup> groups,
//                              PlanGroups(index, full.param_groups, false));
//
// Ownership: ModelIndex borrows its ModelLayout; plans point at the
// caller's ParamStateMeta. Thread-safety: pure functions and immutable
// objects.
#ifndef FLATPARAM_OPTIM_INTERNAL_FLAT_PLAN_H_
#define FLATPARAM_OPTIM_INTERNAL_FLAT_PLAN_H_

#include <algorithm>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "flatparam/base/dtype.h"
#include "flatparam/layout.h"
#include "flatparam/model_layout.h"
#include "flatparam/optim/internal/state_meta.h"
#include "flatparam/optim/optim_state.h"

namespace flatparam {
namespace optim {
namespace internal_optim {

// ---------------------------------------------------------------------------
// Pieces of messages, as PyTorch prints them.

// 'name'.
std::string Quote(const std::string& s);
// Python's repr of a list / tuple of names: ['a', 'b'], ('a',).
std::string PyList(const std::vector<std::string>& names);
std::string PyTuple(const std::vector<std::string>& names);
// Distinct items, in order of appearance, as a Python set prints: {a, b}.
std::string DescribeSet(const std::vector<std::string>& items);
// A flat parameter's unit: 'encoder.0', or <root>.
std::string UnitLabel(const FlatParamLayout& layout);

// The names sorted, as a list.
template <typename Set>
std::string NameSet(const Set& names) {
  std::vector<std::string> v(names.begin(), names.end());
  std::sort(v.begin(), v.end());
  return PyList(v);
}

// Python value equality of two values of one type (0-d tensors of one
// dtype compare by value).
bool PyEqual(const OptimStateValue& a, const OptimStateValue& b);

// A value's kind for comparing ranks: "tensor(float32)" for a
// positive-dimension tensor, "0-d tensor(float32)", or the Python type.
std::string KindOf(const ValueMeta& v);

// ---------------------------------------------------------------------------
// Which model parameters a key names.

class ModelIndex {
 public:
  // Where a managed parameter is: flat parameter `unit`, its parameter
  // `index`.
  struct Pos {
    int unit = 0;
    int index = 0;
  };

  // `unmanaged_params`: FQNs of parameters the optimizer holds that no flat
  // parameter manages, in the optimizer's order (managed names and repeats
  // after the first are ignored). `layout` must outlive the index.
  ModelIndex(const ModelLayout& layout,
             const std::vector<std::string>& unmanaged_params);

  int num_units() const { return static_cast<int>(unit_fqns_.size()); }
  const FlatParamLayout& unit(int u) const { return layout_.flat_params()[u]; }
  const std::vector<std::string>& unit_fqns(int u) const {
    return unit_fqns_[u];
  }

  // The position of the model parameter a name key names (shared
  // parameters under their first name only), or null.
  const Pos* Managed(const ParamKey& key) const;
  // Whether a name key is one of the unmanaged parameters.
  bool Unmanaged(const ParamKey& key) const;
  // The flat parameter an int key of the flat path names, or -1.
  int FlatIndex(const ParamKey& key) const;
  // The primary's name when `key` names a shared parameter's alias.
  const std::string* AliasOf(const ParamKey& key) const;

 private:
  friend absl::StatusOr<std::vector<ParamGroup>> PlanGroups(
      const ModelIndex&, const std::vector<ParamGroup>&, bool);

  const ModelLayout& layout_;
  absl::flat_hash_map<std::string, Pos> managed_;
  // Unmanaged parameter -> its position in the optimizer's order.
  absl::flat_hash_map<std::string, size_t> unmanaged_;
  std::vector<std::string> unmanaged_order_;
  absl::flat_hash_map<std::string, std::string> alias_of_;
  std::vector<std::vector<std::string>> unit_fqns_;
};

// ---------------------------------------------------------------------------
// Flattening a full dict (flat path).

// One flat parameter's flattened state: PyTorch's `_flatten_optim_state`.
struct FlatUnitPlan {
  int unit = 0;
  // Per parameter of the unit: its state, or null.
  std::vector<const ParamStateMeta*> params;
  // Positive-dimension states and their dtype. Parameter i contributes
  // params[i]->at(name) where that is a positive-dimension tensor, zeros
  // otherwise (no state, or None).
  std::map<std::string, DType> tensors;
  // Replicated states (0-d tensors, non-tensors, None).
  ParamState scalars;
};

// Validates flat parameter `u`'s states (`states[i]`: parameter i's, or
// null) and plans their flattening; nullopt when no parameter has state.
// InvalidArgument, naming the state and the parameters, for differing state
// names, an entry without any state, differing kinds, dtypes or replicated
// values, integer tensor state, a tensor shaped unlike its parameter, or a
// 0-d parameter without a positive-dimension state the others have.
absl::StatusOr<std::optional<FlatUnitPlan>> PlanFlatUnit(
    const ModelIndex& index, int u,
    const std::vector<const ParamStateMeta*>& states);

// A full dict's param groups re-keyed for sharding. Flat path: each group
// lists its flat parameters' indices (each once, sorted), then its
// unmanaged parameters (each once) in unmanaged_params order -- PyTorch
// sorts optimizer IDs, and unmanaged_params is in the optimizer's order.
// Original-parameter path (`use_orig_params`): the keys as they are.
// InvalidArgument for a key that is neither a model parameter nor an
// unmanaged one.
absl::StatusOr<std::vector<ParamGroup>> PlanGroups(
    const ModelIndex& index, const std::vector<ParamGroup>& groups,
    bool use_orig_params);

// ---------------------------------------------------------------------------
// Consolidating (flat path).

// The inverse of PlanGroups: a sharded dict's param groups with each
// flat-parameter index replaced by its parameters' FQNs (original-parameter
// path, `use_orig_params`: the keys as they are). Name keys are kept.
// InvalidArgument for an index that is not a flat parameter's.
absl::StatusOr<std::vector<ParamGroup>> UnflattenGroups(
    const ModelIndex& index, const std::vector<ParamGroup>& groups,
    bool use_orig_params);

// Checks what the ranks hold (`metas[r]`: rank r's sharded state, int keys
// for flat parameters) before consolidating, and appends the flat
// parameters with state (rank 0's int keys, in order) to `units`. Rank 0's
// keys decide, as in PyTorch: FailedPrecondition naming the ranks and
// parameters when a rank lacks one; InvalidArgument when a rank's state
// names or kinds differ from rank 0's, a tensor state has an integer dtype
// or is not shaped like the flat parameter's shard, or -- with
// `compare_replicated` -- a replicated (0-d or non-tensor) value differs
// from rank 0's. Without `compare_replicated` (PyTorch, which keeps each
// rank's own replicated values without checking), each differing value is
// described in `*mismatches` when it is not null: the state, the flat
// parameter, and every rank that differs from rank 0 with both values.
// REQUIRES: !metas.empty().
absl::Status ValidateFlatRanks(const ModelIndex& index,
                               const std::vector<StateMeta>& metas,
                               bool compare_replicated, std::vector<int>* units,
                               std::vector<std::string>* mismatches = nullptr);

}  // namespace internal_optim
}  // namespace optim
}  // namespace flatparam

#endif  // FLATPARAM_OPTIM_INTERNAL_FLAT_PLAN_H_
