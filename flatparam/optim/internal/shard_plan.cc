#include "flatparam/optim/internal/shard_plan.h"

#include <cassert>
#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "flatparam/base/shape.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/flatten.h"
#include "flatparam/optim/internal/optim_common.h"

namespace flatparam {
namespace optim {
namespace internal_optim {
namespace {

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

}  // namespace

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
  FLATPARAM_ASSIGN_OR_RETURN(
      plan.groups, PlanGroups(index, groups, options.use_orig_params));
  return plan;
}

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

OrigUnitOutput AllocateOrigUnit(const FlatParamLayout& layout,
                                const OrigUnitPlan& plan, int64_t rank,
                                bool fill_empty) {
  OrigUnitOutput out;
  const bool unsharded = Unsharded(layout);
  for (const auto& [name, dtype] : plan.tensors) {
    out.windows[name].assign(plan.params.size(), Window());
  }
  for (size_t i = 0; i < plan.params.size(); ++i) {
    const ParamStateMeta* meta = plan.params[i];
    if (meta == nullptr) continue;
    if (!unsharded && !fill_empty &&
        !HoldsParam(layout, rank, static_cast<int>(i))) {
      continue;
    }
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

}  // namespace internal_optim
}  // namespace optim
}  // namespace flatparam
