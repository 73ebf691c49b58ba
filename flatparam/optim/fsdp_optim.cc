#include "flatparam/optim/fsdp_optim.h"

#include <algorithm>
#include <cassert>
#include <cstdio>
#include <cstring>
#include <memory>
#include <optional>
#include <set>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/layout.h"
#include "flatparam/optim/internal/flat_range.h"
#include "flatparam/optim/internal/state_meta.h"

namespace flatparam {
namespace optim {

void AllocationTracker::Allocated(int64_t bytes) {
  current_ += bytes;
  ++allocations_;
  peak_ = std::max(peak_, current_);
}

void AllocationTracker::Freed(int64_t bytes) {
  current_ -= bytes;
  assert(current_ >= 0);
}

namespace {

using internal_optim::ConstWindow;
using internal_optim::Decoder;
using internal_optim::Encoder;
using internal_optim::FlattenRange;
using internal_optim::MetaOf;
using internal_optim::ParamStateMeta;
using internal_optim::StateMeta;
using internal_optim::UnflattenRange;
using internal_optim::ValueMeta;
using internal_optim::Window;

// ---------------------------------------------------------------------------
// Small helpers.
// ---------------------------------------------------------------------------

std::string UnitLabel(const FlatParamLayout& layout) {
  return layout.unit().empty() ? "<root>"
                               : absl::StrCat("'", layout.unit(), "'");
}

std::string Quote(const std::string& s) { return absl::StrCat("'", s, "'"); }

// Python's repr of a list of names.
std::string PyList(const std::vector<std::string>& names) {
  std::vector<std::string> quoted;
  for (const std::string& n : names) quoted.push_back(Quote(n));
  return absl::StrCat("[", absl::StrJoin(quoted, ", "), "]");
}

// Python's repr of a tuple of names.
std::string PyTuple(const std::vector<std::string>& names) {
  std::vector<std::string> quoted;
  for (const std::string& n : names) quoted.push_back(Quote(n));
  if (quoted.size() == 1) return absl::StrCat("(", quoted[0], ",)");
  return absl::StrCat("(", absl::StrJoin(quoted, ", "), ")");
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

template <typename Set>
std::string NameSet(const Set& names) {
  std::vector<std::string> v(names.begin(), names.end());
  std::sort(v.begin(), v.end());
  return PyList(v);
}

// Nothing to shard: every rank holds everything (PyTorch switches a world
// of one rank to NO_SHARD).
bool Unsharded(const FlatParamLayout& layout) {
  return !UsesShardedStrategy(layout.options().strategy) ||
         layout.world_size() == 1;
}

void Warn(const OptimStateOptions& options, const std::string& message) {
  if (options.on_warning) {
    options.on_warning(message);
  } else {
    std::fprintf(stderr, "flatparam warning: %s\n", message.c_str());
  }
}

std::string UserStateWarning(const ParamKey& key) {
  return absl::StrFormat(
      "Found an optimizer state, %s, that FSDP cannot process. FSDP will "
      "directly copy everything to the returned state_dict. In most cases, "
      "this is a user-defined state that is not associated with any "
      "particular parameter (or a parameter this model does not manage and "
      "that is not listed in unmanaged_params).",
      DescribeKey(key));
}

// A temporary host buffer, counted in the options' tracker while alive.
class TempBuffer {
 public:
  TempBuffer(AllocationTracker* tracker, int64_t bytes)
      : tracker_(tracker),
        bytes_(bytes),
        data_(new unsigned char[std::max<int64_t>(bytes, 1)]) {
    if (tracker_ != nullptr) tracker_->Allocated(bytes_);
  }
  ~TempBuffer() {
    if (tracker_ != nullptr) tracker_->Freed(bytes_);
  }
  TempBuffer(const TempBuffer&) = delete;
  TempBuffer& operator=(const TempBuffer&) = delete;

  unsigned char* data() { return data_.get(); }

 private:
  AllocationTracker* tracker_;
  int64_t bytes_;
  std::unique_ptr<unsigned char[]> data_;
};

// Elements per rank of one all-gather chunk of a flat parameter's state.
int64_t GatherChunk(const FlatParamLayout& layout, size_t elem_size,
                    const OptimStateOptions& options) {
  const int64_t s = layout.sharded_numel();
  if (options.max_temp_bytes <= 0 || s == 0) return s;
  const int64_t per_rank =
      options.max_temp_bytes /
      (layout.world_size() * static_cast<int64_t>(elem_size));
  return std::clamp<int64_t>(per_rank, 1, s);
}

// Elements of one broadcast chunk of a flat parameter's flattened state.
int64_t BroadcastChunk(const FlatParamLayout& layout, size_t elem_size,
                       const OptimStateOptions& options) {
  const int64_t u = layout.unpadded_unsharded_numel();
  if (options.max_temp_bytes <= 0 || u == 0) return u;
  return std::clamp<int64_t>(
      options.max_temp_bytes / static_cast<int64_t>(elem_size), 1, u);
}

// Which model parameters a key names.
class ModelIndex {
 public:
  struct Pos {
    int unit = 0;
    int index = 0;
  };

  ModelIndex(const ModelLayout& layout, const OptimStateOptions& options)
      : layout_(layout) {
    const auto& units = layout.flat_params();
    unit_fqns_.resize(units.size());
    for (int u = 0; u < static_cast<int>(units.size()); ++u) {
      for (int i = 0; i < static_cast<int>(units[u].params().size()); ++i) {
        const std::string& fqn = units[u].params()[i].fqn;
        managed_.emplace(fqn, Pos{u, i});
        unit_fqns_[u].push_back(fqn);
      }
      for (const SharedParamInfo& s : units[u].shared_params()) {
        alias_of_.emplace(s.fqn, s.prim_fqn);
      }
    }
    for (const std::string& f : options.unmanaged_params) {
      if (!managed_.contains(f)) unmanaged_.insert(f);
    }
  }

  int num_units() const { return static_cast<int>(unit_fqns_.size()); }
  const FlatParamLayout& unit(int u) const { return layout_.flat_params()[u]; }
  const std::vector<std::string>& unit_fqns(int u) const {
    return unit_fqns_[u];
  }

  const Pos* Managed(const ParamKey& key) const {
    const auto* name = std::get_if<std::string>(&key);
    if (name == nullptr) return nullptr;
    auto it = managed_.find(*name);
    return it == managed_.end() ? nullptr : &it->second;
  }
  bool Unmanaged(const ParamKey& key) const {
    const auto* name = std::get_if<std::string>(&key);
    return name != nullptr && unmanaged_.contains(*name);
  }
  // The flat parameter an int key of the flat path names, or -1.
  int FlatIndex(const ParamKey& key) const {
    const auto* id = std::get_if<int64_t>(&key);
    if (id == nullptr || *id < 0 || *id >= num_units()) return -1;
    return static_cast<int>(*id);
  }
  // The primary's name when `key` names a shared parameter's alias.
  const std::string* AliasOf(const ParamKey& key) const {
    const auto* name = std::get_if<std::string>(&key);
    if (name == nullptr) return nullptr;
    auto it = alias_of_.find(*name);
    return it == alias_of_.end() ? nullptr : &it->second;
  }

 private:
  const ModelLayout& layout_;
  absl::flat_hash_map<std::string, Pos> managed_;
  absl::flat_hash_set<std::string> unmanaged_;
  absl::flat_hash_map<std::string, std::string> alias_of_;
  std::vector<std::vector<std::string>> unit_fqns_;
};

std::string UserStateWarning(const ModelIndex& index, const ParamKey& key) {
  std::string message = UserStateWarning(key);
  if (const std::string* prim = index.AliasOf(key)) {
    absl::StrAppend(&message,
                    absl::StrFormat(" It names a shared parameter, whose "
                                    "state is keyed once, by its first name "
                                    "'%s'.",
                                    *prim));
  }
  return message;
}

absl::Status CheckComm(const ModelLayout& layout, const Communicator& comm) {
  const int64_t w = layout.options().world_size;
  if (comm.size() != w) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "the communicator has %d ranks but the layout is sharded over %d "
        "(for hybrid sharding, pass the shard group)",
        comm.size(), w));
  }
  return absl::OkStatus();
}

// Python value equality of two values of one type (0-d tensors of one
// dtype compare by value).
bool PyEqual(const OptimStateValue& a, const OptimStateValue& b) {
  if (a.index() != b.index()) return false;
  const auto* ta = std::get_if<HostTensor>(&a);
  if (ta == nullptr) return a == b;
  const HostTensor& tb = std::get<HostTensor>(b);
  if (ta->dtype() != tb.dtype() || ta->numel() != 1 || tb.numel() != 1) {
    return false;
  }
  if (IsFloatingPoint(ta->dtype())) {
    return LoadAsDouble(ta->data(), ta->dtype(), 0) ==
           LoadAsDouble(tb.data(), tb.dtype(), 0);
  }
  if (ta->dtype() == DType::kBool) {
    return (*ta->data_as<uint8_t>() != 0) == (*tb.data_as<uint8_t>() != 0);
  }
  return std::memcmp(ta->data(), tb.data(), ta->nbytes()) == 0;
}

// If `full` has parameter IDs, the same keyed by name.
absl::StatusOr<OptimStateDict> RekeyedByName(const ModelLayout& layout,
                                             const OptimStateDict& full,
                                             const OptimStateOptions& options,
                                             bool* rekeyed) {
  bool has_ids = false;
  for (const auto& [key, state] : full.state) {
    has_ids |= std::holds_alternative<int64_t>(key);
  }
  for (const ParamGroup& g : full.param_groups) {
    for (const ParamKey& k : g.params) {
      has_ids |= std::holds_alternative<int64_t>(k);
    }
  }
  *rekeyed = has_ids;
  if (!has_ids) return OptimStateDict();
  std::vector<std::string> order = ModelParamOrder(layout);
  order.insert(order.end(), options.unmanaged_params.begin(),
               options.unmanaged_params.end());
  return RekeyOptimStateDict(full, OptimStateKeyType::kParamName, order);
}

// ---------------------------------------------------------------------------
// Planning a full dict's sharding (ShardFullOptimState and
// ScatterFullOptimState). Works on metadata only, so that every rank of a
// scatter validates and plans alike.
// ---------------------------------------------------------------------------

// One flat parameter's flattened state (flat path): PyTorch's
// `_flatten_optim_state`.
struct FlatUnitPlan {
  int unit = 0;
  // Per parameter of the unit: its state, or null.
  std::vector<const ParamStateMeta*> params;
  // Positive-dimension states and their dtype.
  std::map<std::string, DType> tensors;
  // Replicated states.
  ParamState scalars;
};

// One flat parameter's parameters' states (original-parameter path).
struct OrigUnitPlan {
  int unit = 0;
  // Per parameter: its (non-empty) state, or null.
  std::vector<const ParamStateMeta*> params;
  // Positive-dimension state names over the unit's parameters, with their
  // dtype.
  std::map<std::string, DType> tensors;
};

struct ShardPlan {
  std::vector<FlatUnitPlan> flat;
  std::vector<OrigUnitPlan> orig;
  // Unmanaged and user-defined states, copied as they are.
  std::vector<std::pair<ParamKey, const ParamStateMeta*>> passthrough;
  std::vector<ParamGroup> groups;
};

std::string DescribeValues(const std::vector<const ValueMeta*>& values) {
  std::vector<std::string> parts;
  for (const ValueMeta* v : values) parts.push_back(v->Describe());
  return absl::StrCat("[", absl::StrJoin(parts, ", "), "]");
}

// Distinct descriptions, in order of appearance, as a Python set prints.
std::string DescribeSet(const std::vector<std::string>& items) {
  std::vector<std::string> distinct;
  for (const std::string& s : items) {
    if (std::find(distinct.begin(), distinct.end(), s) == distinct.end()) {
      distinct.push_back(s);
    }
  }
  return absl::StrCat("{", absl::StrJoin(distinct, ", "), "}");
}

absl::StatusOr<std::optional<FlatUnitPlan>> PlanFlatUnit(
    const ModelIndex& index, int u,
    const std::vector<const ParamStateMeta*>& states) {
  const FlatParamLayout& layout = index.unit(u);
  const std::vector<std::string>& names = index.unit_fqns(u);
  if (std::none_of(states.begin(), states.end(),
                   [](const ParamStateMeta* s) { return s != nullptr; })) {
    return std::optional<FlatUnitPlan>();
  }
  FlatUnitPlan plan;
  plan.unit = u;
  plan.params = states;

  // Every parameter with state must have the same state names.
  const ParamStateMeta* first = nullptr;
  int first_index = -1;
  for (size_t i = 0; i < states.size(); ++i) {
    if (states[i] == nullptr) continue;
    if (first == nullptr) {
      first = states[i];
      first_index = static_cast<int>(i);
      continue;
    }
    std::set<std::string> a, b;
    for (const auto& [n, v] : *first) a.insert(n);
    for (const auto& [n, v] : *states[i]) b.insert(n);
    if (a != b) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "Differing optimizer state names for the unflattened parameters: "
          "%s ('%s' has %s, '%s' has %s)",
          PyList(names), names[first_index], NameSet(a), names[i], NameSet(b)));
    }
  }
  if (first->empty()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "The state of %s is empty: the parameters of the flat parameter of "
        "unit %s have optimizer state entries without any state",
        PyTuple(names), UnitLabel(layout)));
  }

  for (const auto& [state_name, unused] : *first) {
    // One value per parameter; null where the parameter has no state or
    // the state is None.
    std::vector<const ValueMeta*> values(states.size(), nullptr);
    std::vector<const ValueMeta*> non_none;
    for (size_t i = 0; i < states.size(); ++i) {
      if (states[i] == nullptr) continue;
      const ValueMeta& v = states[i]->at(state_name);
      if (!v.pos_dim && std::holds_alternative<std::monostate>(v.value)) {
        continue;
      }
      values[i] = &v;
      non_none.push_back(&v);
    }
    if (non_none.empty()) {
      plan.scalars[state_name] = std::monostate();
      continue;
    }
    bool pos_dim = true, zero_dim = true, non_tensor = true, one_type = true;
    for (const ValueMeta* v : non_none) {
      const bool tensor = v->pos_dim || IsTensor(v->value);
      pos_dim &= v->pos_dim;
      zero_dim &= tensor && !v->pos_dim;
      non_tensor &= !tensor;
      const size_t type_a = v->pos_dim ? 1 : v->value.index();
      const size_t type_b =
          non_none[0]->pos_dim ? 1 : non_none[0]->value.index();
      one_type &= type_a == type_b;
    }
    if (!one_type || !(pos_dim || zero_dim || non_tensor)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "Differing optimizer state types for state %s, values %s, and "
          "unflattened parameter names %s",
          state_name, DescribeValues(non_none), PyList(names)));
    }
    if (pos_dim) {
      std::vector<std::string> dtypes;
      for (const ValueMeta* v : non_none) {
        dtypes.push_back(std::string(DTypeName(v->dtype)));
      }
      const DType dtype = non_none[0]->dtype;
      for (const ValueMeta* v : non_none) {
        if (v->dtype != dtype) {
          return absl::InvalidArgumentError(absl::StrFormat(
              "All unflattened parameters comprising a single flat "
              "parameter must have positive-dimension tensor state with the "
              "same dtype but got dtypes %s for state %s and unflattened "
              "parameter names %s",
              DescribeSet(dtypes), state_name, PyList(names)));
        }
      }
      if (!IsFloatingPoint(dtype)) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "Cannot flatten integer dtype tensors: state %s has dtype %s "
            "(unflattened parameter names %s)",
            state_name, DTypeName(dtype), PyList(names)));
      }
      for (size_t i = 0; i < states.size(); ++i) {
        const ParamInfo& p = layout.params()[i];
        if (values[i] == nullptr && p.shape.empty()) {
          return absl::InvalidArgumentError(absl::StrFormat(
              "Flattening a zero-dimension parameter is not supported: "
              "parameter '%s' has no state %s to flatten with the other "
              "parameters' (unflattened parameter names %s)",
              p.fqn, state_name, PyList(names)));
        }
        if (values[i] != nullptr && values[i]->shape != p.shape) {
          return absl::InvalidArgumentError(absl::StrFormat(
              "Tensor optimizer state does not have same shape as its "
              "parameter: %s %s (state %s of parameter '%s')",
              ShapeString(values[i]->shape), ShapeString(p.shape), state_name,
              p.fqn));
        }
      }
      plan.tensors[state_name] = dtype;
      continue;
    }
    // Zero-dimension tensors and non-tensors: one value, on every
    // parameter.
    std::vector<std::string> described, dtypes;
    bool same = non_none.size() == states.size();
    for (size_t i = 0; i < states.size(); ++i) {
      if (values[i] == nullptr) {
        described.push_back("None");
        dtypes.push_back("None");
        continue;
      }
      described.push_back(values[i]->Describe());
      if (zero_dim) {
        const HostTensor& t = std::get<HostTensor>(values[i]->value);
        dtypes.push_back(std::string(DTypeName(t.dtype())));
      }
      same &= PyEqual(values[i]->value, non_none[0]->value);
    }
    if (!same) {
      if (zero_dim) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "All unflattened parameters comprising a single flat parameter "
            "must have scalar state with the same value and dtype but got "
            "values %s and dtypes %s for state %s and unflattened parameter "
            "names %s",
            DescribeSet(described), DescribeSet(dtypes), state_name,
            PyList(names)));
      }
      return absl::InvalidArgumentError(absl::StrFormat(
          "All unflattened parameters comprising a single flat parameter "
          "must have scalar state with the same value and dtype but got "
          "values %s for state %s and unflattened parameter names %s",
          DescribeSet(described), state_name, PyList(names)));
    }
    plan.scalars[state_name] = non_none[0]->value;
  }
  return std::optional<FlatUnitPlan>(std::move(plan));
}

absl::StatusOr<std::optional<OrigUnitPlan>> PlanOrigUnit(
    const ModelIndex& index, int u,
    const std::vector<const ParamStateMeta*>& states) {
  const FlatParamLayout& layout = index.unit(u);
  OrigUnitPlan plan;
  plan.unit = u;
  plan.params = states;
  bool any = false;
  std::map<std::string, std::string> dtype_source;  // state -> parameter
  for (size_t i = 0; i < states.size(); ++i) {
    // PyTorch shards nothing for an empty state.
    if (states[i] != nullptr && states[i]->empty()) plan.params[i] = nullptr;
    if (plan.params[i] == nullptr) continue;
    any = true;
    const ParamInfo& p = layout.params()[i];
    for (const auto& [name, v] : *states[i]) {
      if (!v.pos_dim) continue;
      if (v.shape != p.shape) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "Tensor optimizer state does not have same shape as its "
            "parameter: %s %s (state %s of parameter '%s')",
            ShapeString(v.shape), ShapeString(p.shape), name, p.fqn));
      }
      if (!IsFloatingPoint(v.dtype)) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "Cannot flatten integer dtype tensors: state %s of parameter '%s' "
            "has dtype %s",
            name, p.fqn, DTypeName(v.dtype)));
      }
      auto [it, inserted] = plan.tensors.emplace(name, v.dtype);
      if (inserted) {
        dtype_source[name] = p.fqn;
      } else if (it->second != v.dtype) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "All original parameters of one flat parameter must have "
            "positive-dimension tensor state with the same dtype, since it "
            "is all-gathered as one tensor, but state %s is %s for '%s' and "
            "%s for '%s'",
            name, DTypeName(it->second), dtype_source[name], DTypeName(v.dtype),
            p.fqn));
      }
    }
  }
  if (!any) return std::optional<OrigUnitPlan>();
  return std::optional<OrigUnitPlan>(std::move(plan));
}

// The position of unmanaged parameter `key` in options.unmanaged_params
// (the caller checked that it is one).
size_t UnmanagedPosition(const OptimStateOptions& options,
                         const ParamKey& key) {
  const std::string* name = std::get_if<std::string>(&key);
  assert(name != nullptr);
  const auto it = std::find(options.unmanaged_params.begin(),
                            options.unmanaged_params.end(), *name);
  assert(it != options.unmanaged_params.end());
  return static_cast<size_t>(it - options.unmanaged_params.begin());
}

absl::StatusOr<std::vector<ParamGroup>> PlanGroups(
    const ModelIndex& index, const std::vector<ParamGroup>& groups,
    const OptimStateOptions& options) {
  std::vector<ParamGroup> out;
  for (size_t g = 0; g < groups.size(); ++g) {
    ParamGroup group;
    group.hyperparams = groups[g].hyperparams;
    // The flat path lists a group's flat parameters (sorted) and then its
    // unmanaged parameters in unmanaged_params order: PyTorch sorts
    // optimizer IDs, and unmanaged_params is in the optimizer's order.
    std::set<int64_t> flat_keys;
    std::set<size_t> unmanaged_positions;
    for (const ParamKey& key : groups[g].params) {
      const ModelIndex::Pos* pos = index.Managed(key);
      if (pos == nullptr && !index.Unmanaged(key)) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "param_groups[%d] lists %s, which is neither a parameter of the "
            "model (shared parameters count under their first name) nor one "
            "of unmanaged_params",
            g, DescribeKey(key)));
      }
      if (options.use_orig_params) {
        group.params.push_back(key);
      } else if (pos != nullptr) {
        flat_keys.insert(int64_t{pos->unit});
      } else {
        unmanaged_positions.insert(UnmanagedPosition(options, key));
      }
    }
    if (!options.use_orig_params) {
      for (int64_t unit : flat_keys) group.params.push_back(ParamKey(unit));
      for (size_t i : unmanaged_positions) {
        group.params.push_back(ParamKey(options.unmanaged_params[i]));
      }
    }
    out.push_back(std::move(group));
  }
  return out;
}

// `full` must be keyed by name.
absl::StatusOr<ShardPlan> PlanShard(const ModelIndex& index,
                                    const StateMeta& full,
                                    const std::vector<ParamGroup>& groups,
                                    const OptimStateOptions& options) {
  ShardPlan plan;
  std::vector<std::vector<const ParamStateMeta*>> unit_states(
      index.num_units());
  for (int u = 0; u < index.num_units(); ++u) {
    unit_states[u].assign(index.unit(u).params().size(), nullptr);
  }
  for (const auto& [key, state] : full) {
    if (const ModelIndex::Pos* pos = index.Managed(key)) {
      unit_states[pos->unit][pos->index] = &state;
      continue;
    }
    if (!index.Unmanaged(key)) Warn(options, UserStateWarning(index, key));
    plan.passthrough.emplace_back(key, &state);
  }
  for (int u = 0; u < index.num_units(); ++u) {
    if (options.use_orig_params) {
      FLATPARAM_ASSIGN_OR_RETURN(std::optional<OrigUnitPlan> p,
                                 PlanOrigUnit(index, u, unit_states[u]));
      if (p.has_value()) plan.orig.push_back(std::move(*p));
    } else {
      FLATPARAM_ASSIGN_OR_RETURN(std::optional<FlatUnitPlan> p,
                                 PlanFlatUnit(index, u, unit_states[u]));
      if (p.has_value()) plan.flat.push_back(std::move(*p));
    }
  }
  FLATPARAM_ASSIGN_OR_RETURN(plan.groups, PlanGroups(index, groups, options));
  return plan;
}

// Whether `rank` keeps parameter i's state on the original-parameter path
// (sharded layouts): its shard holds the parameter, or no shard does (a
// zero-numel parameter at a shard boundary) and it is rank 0.
bool HoldsParam(const FlatParamLayout& layout, int64_t rank, int i) {
  if (layout.shard_param_info(rank, i).in_shard) return true;
  if (rank != 0 || layout.params()[i].numel > 0) return false;
  for (int64_t r = 1; r < layout.world_size(); ++r) {
    if (layout.shard_param_info(r, i).in_shard) return false;
  }
  return !layout.shard_param_info(0, i).in_shard;
}

// The rank's piece of parameter i: elements [lo, hi).
std::pair<int64_t, int64_t> PieceOf(const FlatParamLayout& layout, int64_t rank,
                                    int i) {
  if (Unsharded(layout)) return {0, layout.params()[i].numel};
  const ShardParamInfo info = layout.shard_param_info(rank, i);
  if (!info.in_shard) return {0, 0};
  return {info.intra_param_start_idx,
          info.intra_param_start_idx + info.numel_in_shard};
}

// The per-parameter data of state `name` (rank 0 / local view).
std::vector<ConstWindow> FullWindows(
    const FlatParamLayout& layout,
    const std::vector<const ParamStateMeta*>& states, const std::string& name) {
  std::vector<ConstWindow> windows(states.size());
  for (size_t i = 0; i < states.size(); ++i) {
    if (states[i] == nullptr) continue;
    auto it = states[i]->find(name);
    if (it == states[i]->end() || !it->second.pos_dim) continue;
    const HostTensor* t = it->second.data();
    assert(t != nullptr);
    windows[i] = {t->data(), 0, layout.params()[i].numel};
  }
  return windows;
}

// The rank's result of the original-parameter path for one unit, with the
// positive-dimension tensors allocated (zeros) and windows onto them per
// state name.
struct OrigUnitOutput {
  std::map<int, ParamState> states;  // parameter index -> state
  std::map<std::string, std::vector<Window>> windows;
};

OrigUnitOutput AllocateOrigUnit(const FlatParamLayout& layout,
                                const OrigUnitPlan& plan, int64_t rank) {
  OrigUnitOutput out;
  const bool unsharded = Unsharded(layout);
  for (const auto& [name, dtype] : plan.tensors) {
    out.windows[name].assign(plan.params.size(), Window());
  }
  for (size_t i = 0; i < plan.params.size(); ++i) {
    const ParamStateMeta* meta = plan.params[i];
    if (meta == nullptr) continue;
    if (!unsharded && !HoldsParam(layout, rank, static_cast<int>(i))) continue;
    ParamState& st = out.states[static_cast<int>(i)];
    const auto [lo, hi] = PieceOf(layout, rank, static_cast<int>(i));
    for (const auto& [name, v] : *meta) {
      if (!v.pos_dim) {
        st[name] = v.value;
        continue;
      }
      HostTensor t = unsharded ? HostTensor(v.dtype, v.shape)
                               : HostTensor::Flat(v.dtype, hi - lo);
      st[name] = std::move(t);
    }
  }
  // Windows after all insertions: map nodes do not move.
  for (auto& [i, st] : out.states) {
    const auto [lo, hi] = PieceOf(layout, rank, i);
    for (auto& [name, value] : st) {
      auto* t = std::get_if<HostTensor>(&value);
      if (t == nullptr || !plan.params[i]->at(name).pos_dim) continue;
      out.windows[name][i] = {t->data(), lo, hi};
    }
  }
  return out;
}

void EmitPassthrough(const ShardPlan& plan, OptimStateDict& out) {
  for (const auto& [key, meta] : plan.passthrough) {
    ParamState& st = out.state[key];
    for (const auto& [name, v] : *meta) st[name] = v.Materialize();
  }
  out.param_groups = plan.groups;
}

// ShardFullOptimState's work on a plan whose tensors are local.
OptimStateDict ShardLocally(const ModelIndex& index, const ShardPlan& plan,
                            int64_t rank) {
  OptimStateDict out;
  for (const FlatUnitPlan& u : plan.flat) {
    const FlatParamLayout& layout = index.unit(u.unit);
    const int64_t start = layout.shard_interval(rank).start;
    ParamState st = u.scalars;
    for (const auto& [name, dtype] : u.tensors) {
      HostTensor t = HostTensor::Flat(dtype, layout.sharded_numel());
      FlattenRange(layout, dtype, FullWindows(layout, u.params, name), start,
                   layout.sharded_numel(), kFlatParamPaddingValue, t.data());
      st[name] = std::move(t);
    }
    out.state[ParamKey(int64_t{u.unit})] = std::move(st);
  }
  for (const OrigUnitPlan& u : plan.orig) {
    const FlatParamLayout& layout = index.unit(u.unit);
    OrigUnitOutput o = AllocateOrigUnit(layout, u, rank);
    for (auto& [name, windows] : o.windows) {
      const size_t size = DTypeSize(u.tensors.at(name));
      for (size_t i = 0; i < windows.size(); ++i) {
        const Window& w = windows[i];
        if (w.data == nullptr || w.hi <= w.lo) continue;
        const HostTensor* src = u.params[i]->at(name).data();
        std::memcpy(w.data,
                    static_cast<const unsigned char*>(src->data()) +
                        w.lo * static_cast<int64_t>(size),
                    (w.hi - w.lo) * size);
      }
    }
    for (auto& [i, st] : o.states) {
      out.state[ParamKey(layout.params()[i].fqn)] = std::move(st);
    }
  }
  EmitPassthrough(plan, out);
  return out;
}

// ---------------------------------------------------------------------------
// Scatter.
// ---------------------------------------------------------------------------

enum : uint8_t { kSkeletonOk = 0, kSkeletonError = 1 };

// Rank 0's message: every state with the managed parameters'
// positive-dimension tensors as metadata, and the groups; or the error
// that stopped rank 0.
std::string EncodeSkeleton(const ModelIndex& index, const absl::Status& error,
                           const OptimStateDict* full) {
  Encoder e;
  if (!error.ok()) {
    e.U8(kSkeletonError);
    e.I64(static_cast<int64_t>(error.code()));
    e.Str(error.message());
    return e.Take();
  }
  e.U8(kSkeletonOk);
  e.I64(static_cast<int64_t>(full->state.size()));
  for (const auto& [key, state] : full->state) {
    const bool with_data = index.Managed(key) == nullptr;
    e.Key(key);
    e.I64(static_cast<int64_t>(state.size()));
    for (const auto& [name, value] : state) {
      e.Str(name);
      e.Value(value, with_data);
    }
  }
  e.I64(static_cast<int64_t>(full->param_groups.size()));
  for (const ParamGroup& g : full->param_groups) e.Group(g);
  return e.Take();
}

absl::Status DecodeSkeleton(absl::string_view bytes, StateMeta* state,
                            std::vector<ParamGroup>* groups) {
  const absl::Status corrupt = absl::InternalError(
      "scatter_full_optim_state_dict: rank 0's metadata arrived corrupted");
  Decoder d(bytes);
  uint8_t tag;
  if (!d.U8(&tag)) return corrupt;
  if (tag == kSkeletonError) {
    int64_t code;
    std::string message;
    if (!d.I64(&code) || !d.Str(&message)) return corrupt;
    return absl::Status(static_cast<absl::StatusCode>(code),
                        absl::StrCat("rank 0: ", message));
  }
  if (tag != kSkeletonOk) return corrupt;
  int64_t n;
  if (!d.I64(&n) || n < 0) return corrupt;
  for (int64_t k = 0; k < n; ++k) {
    ParamKey key;
    int64_t names;
    if (!d.Key(&key) || !d.I64(&names) || names < 0) return corrupt;
    ParamStateMeta& st = (*state)[key];
    for (int64_t j = 0; j < names; ++j) {
      std::string name;
      ValueMeta v;
      if (!d.Str(&name) || !d.Value(&v)) return corrupt;
      st[name] = std::move(v);
    }
  }
  if (!d.I64(&n) || n < 0) return corrupt;
  groups->resize(n);
  for (ParamGroup& g : *groups) {
    if (!d.Group(&g)) return corrupt;
  }
  if (!d.done()) return corrupt;
  return absl::OkStatus();
}

// Broadcasts positions [0, unpadded) of the flattened state `name` of a
// unit, chunk by chunk: rank 0 flattens each chunk from `source`, and every
// rank passes it to `take(begin, count, data)`.
absl::Status BroadcastFlat(
    const FlatParamLayout& layout, Communicator& comm, DType dtype,
    const std::vector<ConstWindow>& source, const OptimStateOptions& options,
    const std::function<void(int64_t, int64_t, const void*)>& take) {
  const int64_t total = layout.unpadded_unsharded_numel();
  if (total == 0) return absl::OkStatus();
  const size_t size = DTypeSize(dtype);
  const int64_t chunk = BroadcastChunk(layout, size, options);
  TempBuffer buf(options.tracker, chunk * static_cast<int64_t>(size));
  BroadcastOptions bopts;
  static_cast<CollectiveOptions&>(bopts) = options.collective;
  bopts.root = 0;
  for (int64_t begin = 0; begin < total; begin += chunk) {
    const int64_t count = std::min(chunk, total - begin);
    if (comm.rank() == 0) {
      FlattenRange(layout, dtype, source, begin, count, kFlatParamPaddingValue,
                   buf.data());
    }
    FLATPARAM_RETURN_IF_ERROR(
        comm.Broadcast(BufferRef{buf.data(), count, dtype, Device::Host()},
                       bopts)
            ->Wait());
    take(begin, count, buf.data());
  }
  return absl::OkStatus();
}

absl::StatusOr<OptimStateDict> ScatterPlan(const ModelIndex& index,
                                           const ShardPlan& plan,
                                           Communicator& comm,
                                           const OptimStateOptions& options) {
  const int64_t rank = comm.rank();
  OptimStateDict out;
  for (const FlatUnitPlan& u : plan.flat) {
    const FlatParamLayout& layout = index.unit(u.unit);
    const int64_t start = layout.shard_interval(rank).start;
    const int64_t s = layout.sharded_numel();
    ParamState st = u.scalars;
    for (const auto& [name, dtype] : u.tensors) {
      HostTensor t = HostTensor::Flat(dtype, s);
      const size_t size = DTypeSize(dtype);
      std::vector<ConstWindow> source;
      if (rank == 0)
        source = FullWindows(layout, u.params, name);
      else
        source.assign(u.params.size(), ConstWindow());
      FLATPARAM_RETURN_IF_ERROR(BroadcastFlat(
          layout, comm, dtype, source, options,
          [&](int64_t begin, int64_t count, const void* data) {
            const int64_t lo = std::max(begin, start);
            const int64_t hi = std::min(begin + count, start + s);
            if (hi <= lo) return;
            std::memcpy(static_cast<unsigned char*>(t.data()) +
                            (lo - start) * static_cast<int64_t>(size),
                        static_cast<const unsigned char*>(data) +
                            (lo - begin) * static_cast<int64_t>(size),
                        (hi - lo) * size);
          }));
      st[name] = std::move(t);
    }
    out.state[ParamKey(int64_t{u.unit})] = std::move(st);
  }
  for (const OrigUnitPlan& u : plan.orig) {
    const FlatParamLayout& layout = index.unit(u.unit);
    OrigUnitOutput o = AllocateOrigUnit(layout, u, rank);
    for (const auto& [name, dtype] : u.tensors) {
      std::vector<ConstWindow> source;
      if (rank == 0)
        source = FullWindows(layout, u.params, name);
      else
        source.assign(u.params.size(), ConstWindow());
      const std::vector<Window>& windows = o.windows[name];
      const size_t size = DTypeSize(dtype);
      FLATPARAM_RETURN_IF_ERROR(BroadcastFlat(
          layout, comm, dtype, source, options,
          [&](int64_t begin, int64_t count, const void* data) {
            UnflattenRange(layout, size, data, begin, count, windows);
          }));
    }
    for (auto& [i, st] : o.states) {
      out.state[ParamKey(layout.params()[i].fqn)] = std::move(st);
    }
  }
  EmitPassthrough(plan, out);
  return out;
}

// ---------------------------------------------------------------------------
// Consolidation.
// ---------------------------------------------------------------------------

// What a rank tells the others: its managed and unmanaged keys, with the
// managed ones' states as metadata (user-defined keys stay local).
std::string EncodeShardedMeta(const ModelIndex& index,
                              const OptimStateDict& sharded,
                              const OptimStateOptions& options) {
  Encoder e;
  std::vector<const std::pair<const ParamKey, ParamState>*> entries;
  for (const auto& entry : sharded.state) {
    const bool managed = options.use_orig_params
                             ? index.Managed(entry.first) != nullptr
                             : index.FlatIndex(entry.first) >= 0;
    if (managed || index.Unmanaged(entry.first)) entries.push_back(&entry);
  }
  e.I64(static_cast<int64_t>(entries.size()));
  for (const auto* entry : entries) {
    e.Key(entry->first);
    if (index.Unmanaged(entry->first)) {
      e.I64(0);
      continue;
    }
    e.I64(static_cast<int64_t>(entry->second.size()));
    for (const auto& [name, value] : entry->second) {
      e.Str(name);
      e.Value(value, /*with_data=*/false);
    }
  }
  return e.Take();
}

absl::StatusOr<std::vector<StateMeta>> ExchangeMeta(
    const ModelIndex& index, const OptimStateDict& sharded, Communicator& comm,
    const OptimStateOptions& options) {
  FLATPARAM_ASSIGN_OR_RETURN(
      std::vector<std::string> all,
      comm.AllGatherBytes(EncodeShardedMeta(index, sharded, options),
                          options.collective));
  std::vector<StateMeta> metas(all.size());
  for (size_t r = 0; r < all.size(); ++r) {
    const absl::Status corrupt = absl::InternalError(absl::StrFormat(
        "consolidating optimizer state: rank %d's metadata arrived corrupted",
        r));
    Decoder d(all[r]);
    int64_t n;
    if (!d.I64(&n) || n < 0) return corrupt;
    for (int64_t k = 0; k < n; ++k) {
      ParamKey key;
      int64_t names;
      if (!d.Key(&key) || !d.I64(&names) || names < 0) return corrupt;
      ParamStateMeta& st = metas[r][key];
      for (int64_t j = 0; j < names; ++j) {
        std::string name;
        ValueMeta v;
        if (!d.Str(&name) || !d.Value(&v)) return corrupt;
        st[name] = std::move(v);
      }
    }
    if (!d.done()) return corrupt;
  }
  return metas;
}

// All-gathers a unit's state of `dtype` chunk by chunk. `fill_local(begin,
// count, dst)` writes this rank's shard elements [begin, begin + count);
// each gathered chunk is unflattened into `out` (skipped when empty).
absl::Status GatherUnflatten(
    const FlatParamLayout& layout, Communicator& comm, DType dtype,
    const std::function<void(int64_t, int64_t, void*)>& fill_local,
    absl::Span<const Window> out, const OptimStateOptions& options) {
  const int64_t w = comm.size();
  const int64_t rank = comm.rank();
  const int64_t s = layout.sharded_numel();
  const size_t size = DTypeSize(dtype);
  const int64_t chunk = GatherChunk(layout, size, options);
  if (s == 0) return absl::OkStatus();
  TempBuffer buf(options.tracker, w * chunk * static_cast<int64_t>(size));
  for (int64_t off = 0; off < s; off += chunk) {
    const int64_t count = std::min(chunk, s - off);
    unsigned char* mine =
        buf.data() + rank * count * static_cast<int64_t>(size);
    fill_local(off, count, mine);
    // In place: this rank's input is its slot of the output.
    FLATPARAM_RETURN_IF_ERROR(
        comm.AllGather(ConstBufferRef{mine, count, dtype, Device::Host()},
                       BufferRef{buf.data(), w * count, dtype, Device::Host()},
                       options.collective)
            ->Wait());
    if (out.empty()) continue;
    for (int64_t q = 0; q < w; ++q) {
      UnflattenRange(layout, size,
                     buf.data() + q * count * static_cast<int64_t>(size),
                     q * s + off, count, out);
    }
  }
  return absl::OkStatus();
}

std::string KindOf(const ValueMeta& v) {
  if (v.pos_dim) return absl::StrCat("tensor(", DTypeName(v.dtype), ")");
  if (const auto* t = std::get_if<HostTensor>(&v.value)) {
    return absl::StrCat("0-d tensor(", DTypeName(t->dtype()), ")");
  }
  return ValueTypeName(v.value);
}

// Flat path: validation of what every rank holds, before any collective.
absl::Status ValidateFlat(const ModelIndex& index,
                          const std::vector<StateMeta>& metas,
                          std::vector<int>* units) {
  const StateMeta& r0 = metas[0];
  // Rank 0's keys decide, as in PyTorch; every rank must have them.
  std::vector<std::string> missing_lines;
  for (size_t r = 1; r < metas.size(); ++r) {
    std::vector<std::string> missing;
    for (const auto& [key, unused] : r0) {
      if (metas[r].count(key) > 0) continue;
      const int u = index.FlatIndex(key);
      missing.push_back(u >= 0 ? PyTuple(index.unit_fqns(u))
                               : PyTuple({std::get<std::string>(key)}));
    }
    if (!missing.empty()) {
      missing_lines.push_back(absl::StrFormat(
          "\nRank %d is missing states for the parameters: [%s]", r,
          absl::StrJoin(missing, ", ")));
    }
  }
  if (!missing_lines.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "FSDP currently requires each rank to have at least the optimizer "
        "states needed by rank 0's optimizer but some ranks are missing some "
        "of those states",
        absl::StrJoin(missing_lines, "")));
  }
  for (const auto& [key, state0] : r0) {
    const int u = index.FlatIndex(key);
    if (u < 0) continue;
    units->push_back(u);
    const FlatParamLayout& layout = index.unit(u);
    const std::string where =
        absl::StrFormat("flat parameter %d (unit %s, parameters %s)", u,
                        UnitLabel(layout), PyList(index.unit_fqns(u)));
    for (size_t r = 0; r < metas.size(); ++r) {
      const ParamStateMeta& st = metas[r].at(key);
      std::set<std::string> a, b;
      for (const auto& [n, v] : state0) a.insert(n);
      for (const auto& [n, v] : st) b.insert(n);
      if (a != b) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "Differing optimizer state names across ranks for %s: rank 0 has "
            "%s, rank %d has %s",
            where, NameSet(a), r, NameSet(b)));
      }
      for (const auto& [name, v] : st) {
        const ValueMeta& v0 = state0.at(name);
        if (KindOf(v) != KindOf(v0)) {
          return absl::InvalidArgumentError(absl::StrFormat(
              "Differing optimizer state types across ranks for state %s of "
              "%s: rank 0 has %s, rank %d has %s",
              name, where, v0.Describe(), r, v.Describe()));
        }
        if (!v.pos_dim) continue;
        if (!IsFloatingPoint(v.dtype)) {
          return absl::InvalidArgumentError(absl::StrFormat(
              "Cannot gather integer dtype tensors: state %s of %s on rank %d "
              "is %s",
              name, where, r, v.Describe()));
        }
        if (v.shape != std::vector<int64_t>{layout.sharded_numel()}) {
          return absl::InvalidArgumentError(absl::StrFormat(
              "Tensor optimizer state %s of %s on rank %d is %s, but a "
              "flat parameter's sharded state has shape [%d] (its shard "
              "size)",
              name, where, r, v.Describe(), layout.sharded_numel()));
        }
      }
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<OptimStateDict> ConsolidateFlat(
    const ModelIndex& index, const OptimStateDict& sharded,
    const std::vector<StateMeta>& metas, Communicator& comm,
    const OptimStateOptions& options, bool to_save) {
  std::vector<int> units;
  FLATPARAM_RETURN_IF_ERROR(ValidateFlat(index, metas, &units));
  OptimStateDict out;
  for (int u : units) {
    const FlatParamLayout& layout = index.unit(u);
    const ParamState& local = sharded.state.at(ParamKey(int64_t{u}));
    const size_t n = layout.params().size();
    std::vector<ParamState*> outs(n, nullptr);
    if (to_save) {
      for (size_t i = 0; i < n; ++i) {
        outs[i] = &out.state[ParamKey(layout.params()[i].fqn)];
      }
    }
    for (const auto& [name, value] : local) {
      const auto* t = std::get_if<HostTensor>(&value);
      if (t == nullptr || t->shape().empty()) {
        for (ParamState* o : outs) {
          if (o != nullptr) (*o)[name] = value;
        }
        continue;
      }
      std::vector<Window> windows;
      std::vector<HostTensor*> tensors(n, nullptr);
      if (to_save) {
        windows.resize(n);
        for (size_t i = 0; i < n; ++i) {
          const ParamInfo& p = layout.params()[i];
          HostTensor& dst = std::get<HostTensor>(
              (*outs[i])[name] = HostTensor(t->dtype(), p.shape));
          windows[i] = {dst.data(), 0, p.numel};
        }
      }
      const size_t size = DTypeSize(t->dtype());
      if (Unsharded(layout)) {
        if (to_save) {
          UnflattenRange(layout, size, t->data(), 0, t->numel(), windows);
        }
        continue;
      }
      FLATPARAM_RETURN_IF_ERROR(GatherUnflatten(
          layout, comm, t->dtype(),
          [&](int64_t begin, int64_t count, void* dst) {
            std::memcpy(dst,
                        static_cast<const unsigned char*>(t->data()) +
                            begin * static_cast<int64_t>(size),
                        count * size);
          },
          windows, options));
    }
  }
  return out;
}

// Original-parameter path: per unit, what the ranks hold of it.
struct OrigUnitGather {
  int unit = 0;
  // Parameters with a key on some rank.
  std::vector<bool> has_key;
  // State name -> dtype, and the parameters that have it as a
  // positive-dimension tensor on some rank.
  std::map<std::string, DType> tensors;
  std::map<std::string, std::vector<bool>> participants;
  // Per parameter: the replicated states the holding ranks agree on.
  std::vector<ParamState> scalars;
};

absl::Status ValidateOrigUnit(const ModelIndex& index, int u,
                              const std::vector<StateMeta>& metas,
                              std::vector<std::string>* missing_by_rank,
                              std::optional<OrigUnitGather>* result) {
  const FlatParamLayout& layout = index.unit(u);
  const size_t n = layout.params().size();
  const int64_t w = static_cast<int64_t>(metas.size());
  const bool unsharded = Unsharded(layout);
  OrigUnitGather g;
  g.unit = u;
  g.has_key.assign(n, false);
  g.scalars.resize(n);
  // Per parameter and rank: the state, or null.
  std::vector<std::vector<const ParamStateMeta*>> held(
      n, std::vector<const ParamStateMeta*>(w, nullptr));
  bool any = false;
  for (size_t i = 0; i < n; ++i) {
    const ParamKey key(layout.params()[i].fqn);
    for (int64_t r = 0; r < w; ++r) {
      auto it = metas[r].find(key);
      if (it == metas[r].end()) continue;
      held[i][r] = &it->second;
      g.has_key[i] = true;
      any = true;
    }
  }
  if (!any) return absl::OkStatus();
  // Every trainable parameter of a flat parameter with state needs state.
  std::vector<std::string> with_state;
  for (size_t i = 0; i < n; ++i) {
    if (g.has_key[i]) with_state.push_back(layout.params()[i].fqn);
  }
  for (size_t i = 0; i < n; ++i) {
    const ParamInfo& p = layout.params()[i];
    if (g.has_key[i] || !p.requires_grad) continue;
    return absl::FailedPreconditionError(absl::StrFormat(
        "%s is not in the optimizer state. The FSDPParamInfo has the param "
        "keys %s while the optimizer has the param keys %s.",
        p.fqn, NameSet(index.unit_fqns(u)), NameSet(with_state)));
  }

  std::map<std::string, std::string> dtype_source;
  for (size_t i = 0; i < n; ++i) {
    const ParamInfo& p = layout.params()[i];
    std::map<std::string, std::pair<int64_t, const ValueMeta*>> kinds;
    for (int64_t r = 0; r < w; ++r) {
      if (held[i][r] == nullptr) continue;
      const auto [lo, hi] = PieceOf(layout, r, static_cast<int>(i));
      for (const auto& [name, v] : *held[i][r]) {
        auto [it, inserted] = kinds.emplace(name, std::make_pair(r, &v));
        if (!inserted && (it->second.second->pos_dim != v.pos_dim ||
                          (!v.pos_dim && it->second.second->value.index() !=
                                             v.value.index()))) {
          return absl::InvalidArgumentError(absl::StrFormat(
              "Differing optimizer state types across ranks for state %s of "
              "parameter '%s': rank %d has %s, rank %d has %s",
              name, p.fqn, it->second.first, it->second.second->Describe(), r,
              v.Describe()));
        }
        if (!v.pos_dim) continue;
        if (!IsFloatingPoint(v.dtype)) {
          return absl::InvalidArgumentError(absl::StrFormat(
              "Cannot gather integer dtype tensors: state %s of parameter "
              "'%s' on rank %d is %s",
              name, p.fqn, r, v.Describe()));
        }
        const std::vector<int64_t> want =
            unsharded ? p.shape : std::vector<int64_t>{hi - lo};
        if (v.shape != want) {
          return absl::InvalidArgumentError(absl::StrFormat(
              "Tensor optimizer state %s of parameter '%s' on rank %d is %s, "
              "but the rank holds %s of the parameter (shape %s)",
              name, p.fqn, r, v.Describe(),
              unsharded ? "all" : absl::StrFormat("%d elements", hi - lo),
              ShapeString(want)));
        }
        auto [dt, first] = g.tensors.emplace(name, v.dtype);
        if (first) {
          dtype_source[name] = p.fqn;
        } else if (dt->second != v.dtype) {
          return absl::InvalidArgumentError(absl::StrFormat(
              "All original parameters of one flat parameter must have "
              "positive-dimension tensor state with the same dtype, since it "
              "is all-gathered as one tensor, but state %s is %s for '%s' "
              "and %s for '%s' (rank %d)",
              name, DTypeName(dt->second), dtype_source[name],
              DTypeName(v.dtype), p.fqn, r));
        }
        auto& part = g.participants[name];
        part.resize(n, false);
        part[i] = true;
      }
    }
  }
  for (auto& [name, part] : g.participants) part.resize(n, false);

  // Ranks holding part of a participant must have its state.
  if (!unsharded) {
    for (int64_t r = 0; r < w; ++r) {
      std::vector<std::string> missing;
      for (size_t i = 0; i < n; ++i) {
        const auto [lo, hi] = PieceOf(layout, r, static_cast<int>(i));
        if (hi <= lo) continue;
        std::vector<std::string> names;
        for (const auto& [name, part] : g.participants) {
          if (!part[i]) continue;
          const ParamStateMeta* st = held[i][r];
          if (st == nullptr || st->count(name) == 0) names.push_back(name);
        }
        if (!names.empty()) {
          missing.push_back(absl::StrFormat("'%s' (%s)", layout.params()[i].fqn,
                                            absl::StrJoin(names, ", ")));
        }
      }
      if (!missing.empty()) {
        (*missing_by_rank)[r] = absl::StrCat(
            (*missing_by_rank)[r], (*missing_by_rank)[r].empty() ? "" : ", ",
            absl::StrJoin(missing, ", "));
      }
    }
  }

  // Replicated states: from the ranks whose piece is non-empty (PyTorch's
  // non-empty ranks), or every rank with the key when none is.
  for (size_t i = 0; i < n; ++i) {
    if (!g.has_key[i]) continue;
    const ParamInfo& p = layout.params()[i];
    std::vector<int64_t> ranks;
    for (int64_t r = 0; r < w; ++r) {
      if (held[i][r] == nullptr) continue;
      bool nonempty = false;
      for (const auto& [name, v] : *held[i][r]) {
        nonempty |= v.pos_dim && v.numel() > 0;
      }
      if (nonempty) ranks.push_back(r);
    }
    if (ranks.empty()) {
      for (int64_t r = 0; r < w; ++r) {
        if (held[i][r] != nullptr) ranks.push_back(r);
      }
    }
    std::map<std::string, int64_t> source;
    for (int64_t r : ranks) {
      for (const auto& [name, v] : *held[i][r]) {
        if (v.pos_dim) continue;
        auto [it, inserted] = g.scalars[i].emplace(name, v.value);
        if (inserted) {
          source[name] = r;
        } else if (!BitwiseEqual(it->second, v.value)) {
          return absl::InvalidArgumentError(absl::StrFormat(
              "Different ranks have different values for %s of parameter "
              "'%s': rank %d has %s, rank %d has %s",
              name, p.fqn, source[name], DescribeValue(it->second), r,
              v.Describe()));
        }
      }
    }
  }
  *result = std::move(g);
  return absl::OkStatus();
}

absl::StatusOr<OptimStateDict> ConsolidateOrig(
    const ModelIndex& index, const OptimStateDict& sharded,
    const std::vector<StateMeta>& metas, Communicator& comm,
    const OptimStateOptions& options, bool to_save) {
  const int64_t w = comm.size();
  const int64_t rank = comm.rank();
  std::vector<OrigUnitGather> units;
  std::vector<std::string> missing_by_rank(w);
  for (int u = 0; u < index.num_units(); ++u) {
    std::optional<OrigUnitGather> g;
    FLATPARAM_RETURN_IF_ERROR(
        ValidateOrigUnit(index, u, metas, &missing_by_rank, &g));
    if (g.has_value()) units.push_back(std::move(*g));
  }
  std::string missing;
  for (int64_t r = 0; r < w; ++r) {
    if (missing_by_rank[r].empty()) continue;
    absl::StrAppend(&missing, "\nRank ", r,
                    " is missing states for the parameters: [",
                    missing_by_rank[r], "]");
  }
  if (!missing.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "Some ranks are missing optimizer states that other ranks hold for "
        "the parameters their shards hold (with use_orig_params, a rank "
        "must have the states of every parameter in its shard)",
        missing));
  }

  OptimStateDict out;
  for (const OrigUnitGather& g : units) {
    const FlatParamLayout& layout = index.unit(g.unit);
    const size_t n = layout.params().size();
    if (Unsharded(layout)) {
      if (!to_save) continue;
      for (size_t i = 0; i < n; ++i) {
        auto it = sharded.state.find(ParamKey(layout.params()[i].fqn));
        if (it != sharded.state.end()) out.state[it->first] = it->second;
      }
      continue;
    }
    std::vector<ParamState*> outs(n, nullptr);
    if (to_save) {
      for (size_t i = 0; i < n; ++i) {
        if (!g.has_key[i]) continue;
        outs[i] = &out.state[ParamKey(layout.params()[i].fqn)];
        *outs[i] = g.scalars[i];
      }
    }
    for (const auto& [name, dtype] : g.tensors) {
      const std::vector<bool>& part = g.participants.at(name);
      // This rank's pieces.
      std::vector<ConstWindow> local(n);
      for (size_t i = 0; i < n; ++i) {
        if (!part[i]) continue;
        auto it = sharded.state.find(ParamKey(layout.params()[i].fqn));
        if (it == sharded.state.end()) continue;
        auto v = it->second.find(name);
        if (v == it->second.end()) continue;
        const HostTensor& t = std::get<HostTensor>(v->second);
        const auto [lo, hi] = PieceOf(layout, rank, static_cast<int>(i));
        local[i] = {t.data(), lo, hi};
      }
      std::vector<Window> windows;
      if (to_save) {
        windows.resize(n);
        for (size_t i = 0; i < n; ++i) {
          if (!part[i]) continue;
          const ParamInfo& p = layout.params()[i];
          HostTensor& dst = std::get<HostTensor>(
              (*outs[i])[name] = HostTensor(dtype, p.shape));
          windows[i] = {dst.data(), 0, p.numel};
        }
      }
      const int64_t start = layout.shard_interval(rank).start;
      FLATPARAM_RETURN_IF_ERROR(GatherUnflatten(
          layout, comm, dtype,
          [&](int64_t begin, int64_t count, void* dst) {
            FlattenRange(layout, dtype, local, start + begin, count,
                         /*padding_value=*/0.0, dst);
          },
          windows, options));
    }
  }
  return out;
}

}  // namespace

absl::StatusOr<OptimStateDict> ConsolidateOptimState(
    const ModelLayout& layout, const OptimStateDict& sharded,
    Communicator& comm, const OptimStateOptions& options) {
  FLATPARAM_RETURN_IF_ERROR(CheckComm(layout, comm));
  const ModelIndex index(layout, options);
  const bool to_save = !options.rank0_only || comm.rank() == 0;
  FLATPARAM_ASSIGN_OR_RETURN(std::vector<StateMeta> metas,
                             ExchangeMeta(index, sharded, comm, options));
  OptimStateDict out;
  if (options.use_orig_params) {
    FLATPARAM_ASSIGN_OR_RETURN(
        out, ConsolidateOrig(index, sharded, metas, comm, options, to_save));
  } else {
    FLATPARAM_ASSIGN_OR_RETURN(
        out, ConsolidateFlat(index, sharded, metas, comm, options, to_save));
  }
  if (!to_save) return OptimStateDict();

  // Unmanaged parameters' states as this rank holds them; anything else is
  // user-defined.
  for (const auto& [key, state] : sharded.state) {
    const bool managed = options.use_orig_params ? index.Managed(key) != nullptr
                                                 : index.FlatIndex(key) >= 0;
    if (managed) continue;
    if (!index.Unmanaged(key)) Warn(options, UserStateWarning(index, key));
    if (!out.state.emplace(key, state).second) {
      Warn(options,
           absl::StrFormat("Dropped the optimizer state %s: a consolidated "
                           "parameter has the same key",
                           DescribeKey(key)));
    }
  }
  for (size_t g = 0; g < sharded.param_groups.size(); ++g) {
    ParamGroup group;
    group.hyperparams = sharded.param_groups[g].hyperparams;
    for (const ParamKey& key : sharded.param_groups[g].params) {
      if (options.use_orig_params || std::holds_alternative<std::string>(key)) {
        group.params.push_back(key);
        continue;
      }
      const int u = index.FlatIndex(key);
      if (u < 0) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "param_groups[%d] lists flat parameter %s, but the model has %d "
            "flat parameters",
            g, DescribeKey(key), index.num_units()));
      }
      for (const std::string& fqn : index.unit_fqns(u)) {
        group.params.push_back(fqn);
      }
    }
    out.param_groups.push_back(std::move(group));
  }
  return out;
}

absl::StatusOr<OptimStateDict> ShardFullOptimState(
    const ModelLayout& layout, const OptimStateDict& full, int64_t rank,
    const OptimStateOptions& options) {
  const int64_t w = layout.options().world_size;
  if (rank < 0 || rank >= w) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "rank %d is outside the layout's world of %d ranks", rank, w));
  }
  bool rekeyed = false;
  FLATPARAM_ASSIGN_OR_RETURN(OptimStateDict by_name,
                             RekeyedByName(layout, full, options, &rekeyed));
  const OptimStateDict& dict = rekeyed ? by_name : full;
  const ModelIndex index(layout, options);
  const StateMeta meta = MetaOf(dict.state);
  FLATPARAM_ASSIGN_OR_RETURN(
      ShardPlan plan, PlanShard(index, meta, dict.param_groups, options));
  return ShardLocally(index, plan, rank);
}

absl::StatusOr<OptimStateDict> ScatterFullOptimState(
    const ModelLayout& layout, const OptimStateDict& full, Communicator& comm,
    const OptimStateOptions& options) {
  FLATPARAM_RETURN_IF_ERROR(CheckComm(layout, comm));
  const ModelIndex index(layout, options);
  const bool root = comm.rank() == 0;
  // Rank 0's dict keyed by name (a re-keyed copy only when it has IDs).
  OptimStateDict by_name;
  const OptimStateDict* dict = &full;
  std::string skeleton;
  if (root) {
    bool rekeyed = false;
    absl::StatusOr<OptimStateDict> r =
        RekeyedByName(layout, full, options, &rekeyed);
    if (r.ok() && rekeyed) {
      by_name = *std::move(r);
      dict = &by_name;
    }
    skeleton = EncodeSkeleton(index, r.status(), dict);
  }
  FLATPARAM_ASSIGN_OR_RETURN(std::vector<std::string> all,
                             comm.AllGatherBytes(skeleton, options.collective));
  StateMeta meta;
  std::vector<ParamGroup> groups;
  FLATPARAM_RETURN_IF_ERROR(DecodeSkeleton(all[0], &meta, &groups));
  if (root) {
    // Rank 0 flattens from its own tensors.
    for (auto& [key, st] : meta) {
      if (index.Managed(key) == nullptr) continue;
      const ParamState& local = dict->state.at(key);
      for (auto& [name, v] : st) {
        if (v.pos_dim) v.tensor = &std::get<HostTensor>(local.at(name));
      }
    }
  }
  FLATPARAM_ASSIGN_OR_RETURN(ShardPlan plan,
                             PlanShard(index, meta, groups, options));
  return ScatterPlan(index, plan, comm, options);
}

absl::StatusOr<OptimStateDict> OptimStateDictToLoad(
    const ModelLayout& layout, const OptimStateDict& full, Communicator& comm,
    const OptimStateOptions& options) {
  if (options.rank0_only) {
    return ScatterFullOptimState(layout, full, comm, options);
  }
  FLATPARAM_RETURN_IF_ERROR(CheckComm(layout, comm));
  return ShardFullOptimState(layout, full, comm.rank(), options);
}

int64_t MaxTempBytes(const ModelLayout& layout, DType state_dtype,
                     const OptimStateOptions& options) {
  const size_t size = DTypeSize(state_dtype);
  int64_t most = 0;
  for (const FlatParamLayout& unit : layout.flat_params()) {
    int64_t gather = 0;
    if (!Unsharded(unit) && unit.sharded_numel() > 0) {
      gather = unit.world_size() * GatherChunk(unit, size, options);
    }
    const int64_t broadcast = BroadcastChunk(unit, size, options);
    most = std::max(most,
                    std::max(gather, broadcast) * static_cast<int64_t>(size));
  }
  return most;
}

}  // namespace optim
}  // namespace flatparam
