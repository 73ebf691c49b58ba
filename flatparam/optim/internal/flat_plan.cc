#include "flatparam/optim/internal/flat_plan.h"

#include <cassert>
#include <cstring>
#include <map>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "flatparam/base/shape.h"

namespace flatparam {
namespace optim {
namespace internal_optim {

std::string Quote(const std::string& s) { return absl::StrCat("'", s, "'"); }

std::string PyList(const std::vector<std::string>& names) {
  std::vector<std::string> quoted;
  for (const std::string& n : names) quoted.push_back(Quote(n));
  return absl::StrCat("[", absl::StrJoin(quoted, ", "), "]");
}

std::string PyTuple(const std::vector<std::string>& names) {
  std::vector<std::string> quoted;
  for (const std::string& n : names) quoted.push_back(Quote(n));
  if (quoted.size() == 1) return absl::StrCat("(", quoted[0], ",)");
  return absl::StrCat("(", absl::StrJoin(quoted, ", "), ")");
}

std::string DescribeSet(const std::vector<std::string>& items) {
  std::vector<std::string> distinct;
  for (const std::string& s : items) {
    if (std::find(distinct.begin(), distinct.end(), s) == distinct.end()) {
      distinct.push_back(s);
    }
  }
  return absl::StrCat("{", absl::StrJoin(distinct, ", "), "}");
}

std::string UnitLabel(const FlatParamLayout& layout) {
  return layout.unit().empty() ? "<root>" : Quote(layout.unit());
}

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

std::string KindOf(const ValueMeta& v) {
  if (v.pos_dim) return absl::StrCat("tensor(", DTypeName(v.dtype), ")");
  if (const auto* t = std::get_if<HostTensor>(&v.value)) {
    return absl::StrCat("0-d tensor(", DTypeName(t->dtype()), ")");
  }
  return ValueTypeName(v.value);
}

namespace {

std::set<std::string> StateNames(const ParamStateMeta& state) {
  std::set<std::string> names;
  for (const auto& [n, v] : state) names.insert(n);
  return names;
}

std::string DescribeValues(const std::vector<const ValueMeta*>& values) {
  std::vector<std::string> parts;
  for (const ValueMeta* v : values) parts.push_back(v->Describe());
  return absl::StrCat("[", absl::StrJoin(parts, ", "), "]");
}

}  // namespace

// ---------------------------------------------------------------------------
// ModelIndex.

ModelIndex::ModelIndex(const ModelLayout& layout,
                       const std::vector<std::string>& unmanaged_params)
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
  for (const std::string& f : unmanaged_params) {
    if (managed_.contains(f)) continue;
    if (unmanaged_.emplace(f, unmanaged_order_.size()).second) {
      unmanaged_order_.push_back(f);
    }
  }
}

const ModelIndex::Pos* ModelIndex::Managed(const ParamKey& key) const {
  const auto* name = std::get_if<std::string>(&key);
  if (name == nullptr) return nullptr;
  auto it = managed_.find(*name);
  return it == managed_.end() ? nullptr : &it->second;
}

bool ModelIndex::Unmanaged(const ParamKey& key) const {
  const auto* name = std::get_if<std::string>(&key);
  return name != nullptr && unmanaged_.contains(*name);
}

int ModelIndex::FlatIndex(const ParamKey& key) const {
  const auto* id = std::get_if<int64_t>(&key);
  if (id == nullptr || *id < 0 || *id >= num_units()) return -1;
  return static_cast<int>(*id);
}

const std::string* ModelIndex::AliasOf(const ParamKey& key) const {
  const auto* name = std::get_if<std::string>(&key);
  if (name == nullptr) return nullptr;
  auto it = alias_of_.find(*name);
  return it == alias_of_.end() ? nullptr : &it->second;
}

// ---------------------------------------------------------------------------
// Flattening.

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
    const std::set<std::string> a = StateNames(*first),
                                b = StateNames(*states[i]);
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

absl::StatusOr<std::vector<ParamGroup>> PlanGroups(
    const ModelIndex& index, const std::vector<ParamGroup>& groups,
    bool use_orig_params) {
  std::vector<ParamGroup> out;
  // Without use_orig_params a flat parameter is one tensor of the
  // optimizer, in exactly one group: the group, and the parameter that
  // put it there, per unit.
  std::map<int, std::pair<size_t, ParamKey>> unit_group;
  for (size_t g = 0; g < groups.size(); ++g) {
    ParamGroup group;
    group.hyperparams = groups[g].hyperparams;
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
      if (use_orig_params) {
        group.params.push_back(key);
      } else if (pos != nullptr) {
        auto [it, fresh] =
            unit_group.emplace(pos->unit, std::make_pair(g, key));
        if (!fresh && it->second.first != g) {
          return absl::InvalidArgumentError(absl::StrFormat(
              "param_groups[%d] holds %s and param_groups[%d] holds %s, both "
              "of flat parameter \"%s\": without use_orig_params "
              "(align_addresses) a flat parameter is one tensor of the "
              "optimizer, in one param group; put them in one group, wrap "
              "them in different units, or use align_addresses",
              it->second.first, DescribeKey(it->second.second), g,
              DescribeKey(key), index.unit(pos->unit).unit()));
        }
        flat_keys.insert(int64_t{pos->unit});
      } else {
        unmanaged_positions.insert(
            index.unmanaged_.at(std::get<std::string>(key)));
      }
    }
    if (!use_orig_params) {
      for (int64_t unit : flat_keys) group.params.push_back(ParamKey(unit));
      for (size_t i : unmanaged_positions) {
        group.params.push_back(ParamKey(index.unmanaged_order_[i]));
      }
    }
    out.push_back(std::move(group));
  }
  return out;
}

// ---------------------------------------------------------------------------
// Consolidating.

absl::StatusOr<std::vector<ParamGroup>> UnflattenGroups(
    const ModelIndex& index, const std::vector<ParamGroup>& groups,
    bool use_orig_params) {
  std::vector<ParamGroup> out;
  for (size_t g = 0; g < groups.size(); ++g) {
    ParamGroup group;
    group.hyperparams = groups[g].hyperparams;
    for (const ParamKey& key : groups[g].params) {
      if (use_orig_params || std::holds_alternative<std::string>(key)) {
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
    out.push_back(std::move(group));
  }
  return out;
}

absl::Status ValidateFlatRanks(const ModelIndex& index,
                               const std::vector<StateMeta>& metas,
                               bool compare_replicated, std::vector<int>* units,
                               std::vector<std::string>* mismatches) {
  assert(!metas.empty());
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
    // State name -> "rank r has v" for the ranks that differ from rank 0.
    std::map<std::string, std::vector<std::string>> differing;
    for (size_t r = 0; r < metas.size(); ++r) {
      const ParamStateMeta& st = metas[r].at(key);
      const std::set<std::string> a = StateNames(state0), b = StateNames(st);
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
        if (!v.pos_dim) {
          if (PyEqual(v.value, v0.value)) continue;
          if (compare_replicated) {
            return absl::InvalidArgumentError(absl::StrFormat(
                "Differing replicated optimizer state values across ranks for "
                "state %s of %s: rank 0 has %s, rank %d has %s",
                name, where, v0.Describe(), r, v.Describe()));
          }
          differing[name].push_back(
              absl::StrFormat("rank %d has %s", r, v.Describe()));
          continue;
        }
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
    if (mismatches == nullptr) continue;
    for (const auto& [name, ranks] : differing) {
      mismatches->push_back(absl::StrFormat(
          "Differing replicated optimizer state values across ranks for "
          "state %s of %s: rank 0 has %s, %s",
          name, where, state0.at(name).Describe(), absl::StrJoin(ranks, ", ")));
    }
  }
  return absl::OkStatus();
}

}  // namespace internal_optim
}  // namespace optim
}  // namespace flatparam
