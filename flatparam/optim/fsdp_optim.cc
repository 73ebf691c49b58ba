#include "flatparam/optim/fsdp_optim.h"

#include <algorithm>
#include <cassert>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "flatparam/base/fqn.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/layout.h"
#include "flatparam/optim/internal/flat_plan.h"
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
using internal_optim::FlatUnitPlan;
using internal_optim::MetaOf;
using internal_optim::ModelIndex;
using internal_optim::NameSet;
using internal_optim::ParamStateMeta;
using internal_optim::PlanFlatUnit;
using internal_optim::PlanGroups;
using internal_optim::ShapeString;
using internal_optim::StateMeta;
using internal_optim::UnflattenGroups;
using internal_optim::UnflattenRange;
using internal_optim::ValidateFlatRanks;
using internal_optim::ValueMeta;
using internal_optim::Window;

// ---------------------------------------------------------------------------
// Small helpers.
// ---------------------------------------------------------------------------

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

// A device buffer for staging a collective's host buffer of `bytes`, when
// options.device is a real device (see OptimStateOptions::device); nothing
// otherwise. Counted in the tracker while alive.
class DeviceStaging {
 public:
  static absl::StatusOr<DeviceStaging> Create(const OptimStateOptions& options,
                                              int64_t bytes) {
    DeviceStaging s;
    if (options.device == nullptr ||
        options.device->device() == Device::Host()) {
      return s;
    }
    FLATPARAM_ASSIGN_OR_RETURN(
        s.buffer_, options.device->Allocate(options.device->device(), bytes));
    s.ops_ = options.device;
    s.tracker_ = options.tracker;
    if (s.tracker_ != nullptr) s.tracker_->Allocated(bytes);
    return s;
  }
  DeviceStaging() = default;
  DeviceStaging(DeviceStaging&& o) noexcept
      : ops_(std::exchange(o.ops_, nullptr)),
        tracker_(o.tracker_),
        buffer_(std::move(o.buffer_)) {}
  DeviceStaging& operator=(DeviceStaging&&) = delete;
  ~DeviceStaging() {
    if (ops_ != nullptr && tracker_ != nullptr) {
      tracker_->Freed(buffer_.bytes());
    }
  }

  bool active() const { return ops_ != nullptr; }
  // `count` elements of `dtype` at element `offset` of the staging buffer.
  BufferRef Ref(DType dtype, int64_t offset, int64_t count) const {
    return BufferRef{static_cast<unsigned char*>(buffer_.data()) +
                         offset * static_cast<int64_t>(DTypeSize(dtype)),
                     count, dtype, buffer_.device()};
  }
  absl::Status Copy(BufferRef dst, ConstBufferRef src) {
    FLATPARAM_RETURN_IF_ERROR(ops_->Copy(dst, src));
    return ops_->Synchronize();
  }

 private:
  DeviceOps* ops_ = nullptr;
  AllocationTracker* tracker_ = nullptr;
  DeviceBuffer buffer_;
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
// The rank's optimizer's keys (OptimStateOptions::sharded_keys).
// ---------------------------------------------------------------------------

}  // namespace

std::string FlatParamFqn(const FlatParamLayout& unit) {
  return unit.unit().empty() ? "_flat_param"
                             : absl::StrCat(unit.unit(), "._flat_param");
}

namespace {

// Keyed optimizers need an entry for every parameter with state.
bool FillsEmpty(const OptimStateOptions& options) {
  return options.use_orig_params &&
         options.sharded_keys != ShardedKeys::kLayout;
}

// Maps every state key and group entry with `fn`; with `sort_groups`, group
// lists are sorted (PyTorch sorts re-keyed IDs). InvalidArgument naming
// both keys when two state keys map to one (rather than keeping either
// silently); `describe` names the key they map to.
absl::StatusOr<OptimStateDict> MapKeys(
    const OptimStateDict& dict,
    const std::function<absl::StatusOr<ParamKey>(const ParamKey&)>& fn,
    bool sort_groups,
    const std::function<std::string(const ParamKey&)>& describe) {
  OptimStateDict out;
  std::map<ParamKey, ParamKey> source;  // mapped key -> the key it came from
  for (const auto& [key, st] : dict.state) {
    FLATPARAM_ASSIGN_OR_RETURN(ParamKey mapped, fn(key));
    auto [it, inserted] = source.emplace(mapped, key);
    if (!inserted) {
      const bool names = std::holds_alternative<std::string>(it->second) &&
                         std::holds_alternative<std::string>(key);
      return absl::InvalidArgumentError(absl::StrFormat(
          "optimizer state keys %s and %s both name %s%s",
          DescribeKey(it->second), DescribeKey(key), describe(mapped),
          names ? absl::StrFormat(" (parameter names are compared without the "
                                  "module-wrapper prefixes %s, %s and %s., as "
                                  "PyTorch's clean_tensor_name does)",
                                  kFsdpWrappedPrefix, kCheckpointWrappedPrefix,
                                  kCompiledModuleComponent)
                : ""));
    }
    out.state.emplace(std::move(mapped), st);
  }
  for (const ParamGroup& g : dict.param_groups) {
    ParamGroup mapped = g;
    mapped.params.clear();
    for (const ParamKey& k : g.params) {
      FLATPARAM_ASSIGN_OR_RETURN(ParamKey m, fn(k));
      mapped.params.push_back(std::move(m));
    }
    if (sort_groups) std::sort(mapped.params.begin(), mapped.params.end());
    out.param_groups.push_back(std::move(mapped));
  }
  return out;
}

// The correspondence between the rank's optimizer's keys (sharded_keys
// kNames or kOptimizerIds) and the layout's (flat-parameter indices on the
// flat path, FQNs on the original-parameter path).
//
// A name is a parameter's when its clean form (CleanTensorName, as
// PyTorch's `_get_param_key_to_param` matches a NamedOptimizer's
// `named_parameters()` names to FQNs) is a flat parameter's FlatParamFqn
// (flat path), a managed parameter's FQN (original-parameter path) or one
// of unmanaged_params; its layout key is then the flat-parameter index or
// the clean FQN. Any other name is user-defined state and stays as it is
// (PyTorch copies such keys unchanged).
class OptimizerKeys {
 public:
  // InvalidArgument when two optimizer_params name one parameter (also
  // after cleaning), naming both.
  static absl::StatusOr<OptimizerKeys> Create(
      const ModelLayout& layout, const OptimStateOptions& options) {
    OptimizerKeys k;
    k.layout_ = &layout;
    k.orig_ = options.use_orig_params;
    k.ids_ = options.sharded_keys == ShardedKeys::kOptimizerIds;
    k.names_ = &options.optimizer_params;
    for (size_t u = 0; u < layout.flat_params().size(); ++u) {
      const FlatParamLayout& unit = layout.flat_params()[u];
      k.flat_index_[FlatParamFqn(unit)] = static_cast<int64_t>(u);
      for (const ParamInfo& p : unit.params()) k.managed_.insert(p.fqn);
    }
    k.unmanaged_.insert(options.unmanaged_params.begin(),
                        options.unmanaged_params.end());
    const std::vector<std::string>& names = options.optimizer_params;
    for (size_t i = 0; i < names.size(); ++i) {
      const ParamKey key = k.LayoutKeyOf(names[i]);
      auto [it, inserted] = k.position_.emplace(key, i);
      if (inserted) continue;
      const std::string& first = names[it->second];
      if (first == names[i]) {
        return absl::InvalidArgumentError(
            absl::StrFormat("optimizer_params lists '%s' twice (IDs %d and %d)",
                            names[i], it->second, i));
      }
      return absl::InvalidArgumentError(absl::StrFormat(
          "optimizer_params lists '%s' (ID %d) and '%s' (ID %d), which both "
          "name %s once the module-wrapper prefixes are removed",
          first, it->second, names[i], i, k.Describe(key)));
    }
    return k;
  }

  // The layout key of a key of the rank's optimizer.
  absl::StatusOr<ParamKey> ToLayout(const ParamKey& key) const {
    if (const auto* name = std::get_if<std::string>(&key)) {
      return LayoutKeyOf(*name);
    }
    const int64_t id = std::get<int64_t>(key);
    if (!ids_) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "sharded_keys is kNames but the dict has the ID key %d", id));
    }
    if (id < 0 || id >= static_cast<int64_t>(names_->size())) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "optimizer ID %d is outside optimizer_params (%d parameters)", id,
          names_->size()));
    }
    return LayoutKeyOf((*names_)[id]);
  }

  // A layout key for messages: "flat parameter 1 ('a._flat_param')" or
  // "'a.w'".
  std::string Describe(const ParamKey& key) const {
    if (const auto* u = std::get_if<int64_t>(&key)) {
      return absl::StrFormat("flat parameter %d ('%s')", *u,
                             FlatParamFqn(layout_->flat_params()[*u]));
    }
    return DescribeKey(key);
  }

  // The rank's optimizer's key for a layout key: kOptimizerIds: the
  // position in optimizer_params; kNames: the name optimizer_params lists
  // for it, or, when optimizer_params is empty, the clean name.
  // InvalidArgument for a parameter (a flat parameter, or a managed one)
  // that a non-empty optimizer_params does not list.
  absl::StatusOr<ParamKey> FromLayout(const ParamKey& key) const {
    const auto* u = std::get_if<int64_t>(&key);
    const std::string name = u != nullptr
                                 ? FlatParamFqn(layout_->flat_params()[*u])
                                 : std::get<std::string>(key);
    if (!ids_ && names_->empty()) return ParamKey(name);
    auto it = position_.find(key);
    if (it != position_.end()) {
      return ids_ ? ParamKey(static_cast<int64_t>(it->second))
                  : ParamKey((*names_)[it->second]);
    }
    if (u != nullptr || managed_.count(name) > 0) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s '%s' has optimizer state but is not in optimizer_params",
          u != nullptr ? "flat parameter" : "parameter", name));
    }
    return ParamKey(name);  // a user-defined key stays a name
  }

 private:
  ParamKey LayoutKeyOf(const std::string& name) const {
    std::string clean = CleanTensorName(name);
    if (!orig_) {
      auto it = flat_index_.find(clean);
      if (it != flat_index_.end()) return ParamKey(it->second);
    } else if (managed_.count(clean) > 0) {
      return ParamKey(std::move(clean));
    }
    if (unmanaged_.count(clean) > 0) return ParamKey(std::move(clean));
    return ParamKey(name);
  }

  const ModelLayout* layout_ = nullptr;
  bool orig_ = false;
  bool ids_ = false;
  const std::vector<std::string>* names_ = nullptr;
  std::map<std::string, int64_t> flat_index_;  // FlatParamFqn -> index
  std::set<std::string> managed_;
  std::set<std::string> unmanaged_;
  // Layout key -> position in optimizer_params.
  std::map<ParamKey, size_t> position_;
};

// The sharded dict `dict`, keyed as the rank's optimizer keys it, keyed by
// layout (flat-parameter indices or FQNs); see OptimizerKeys::ToLayout.
absl::StatusOr<OptimStateDict> ToLayoutKeys(const ModelLayout& layout,
                                            const OptimStateDict& dict,
                                            const OptimStateOptions& options) {
  if (options.sharded_keys == ShardedKeys::kLayout) return dict;
  FLATPARAM_ASSIGN_OR_RETURN(const OptimizerKeys keys,
                             OptimizerKeys::Create(layout, options));
  return MapKeys(
      dict, [&](const ParamKey& key) { return keys.ToLayout(key); },
      /*sort_groups=*/false,
      [&](const ParamKey& key) { return keys.Describe(key); });
}

// The inverse: a layout-keyed sharded dict as the rank's optimizer keys it;
// see OptimizerKeys::FromLayout.
absl::StatusOr<OptimStateDict> FromLayoutKeys(
    const ModelLayout& layout, const OptimStateDict& dict,
    const OptimStateOptions& options) {
  if (options.sharded_keys == ShardedKeys::kLayout) return dict;
  FLATPARAM_ASSIGN_OR_RETURN(const OptimizerKeys keys,
                             OptimizerKeys::Create(layout, options));
  return MapKeys(
      dict, [&](const ParamKey& key) { return keys.FromLayout(key); },
      /*sort_groups=*/options.sharded_keys == ShardedKeys::kOptimizerIds,
      DescribeKey);
}

// ---------------------------------------------------------------------------
// Planning a full dict's sharding (ShardFullOptimState and
// ScatterFullOptimState). Works on metadata only, so that every rank of a
// scatter validates and plans alike.
// ---------------------------------------------------------------------------

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
  FLATPARAM_ASSIGN_OR_RETURN(
      plan.groups, PlanGroups(index, groups, options.use_orig_params));
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

// With `fill_empty` (keyed optimizers), a parameter with state that the
// rank holds no piece of gets zero-element tensors and its replicated values.
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

// ShardFullOptimState's work on a plan whose tensors are local.
OptimStateDict ShardLocally(const ModelIndex& index, const ShardPlan& plan,
                            int64_t rank, bool fill_empty) {
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
    OrigUnitOutput o = AllocateOrigUnit(layout, u, rank, fill_empty);
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
  FLATPARAM_ASSIGN_OR_RETURN(
      DeviceStaging staging,
      DeviceStaging::Create(options, chunk * static_cast<int64_t>(size)));
  BroadcastOptions bopts;
  static_cast<CollectiveOptions&>(bopts) = options.collective;
  bopts.root = 0;
  for (int64_t begin = 0; begin < total; begin += chunk) {
    const int64_t count = std::min(chunk, total - begin);
    if (comm.rank() == 0) {
      FlattenRange(layout, dtype, source, begin, count, kFlatParamPaddingValue,
                   buf.data());
    }
    const BufferRef host{buf.data(), count, dtype, Device::Host()};
    if (staging.active()) {
      const BufferRef dev = staging.Ref(dtype, 0, count);
      if (comm.rank() == 0) FLATPARAM_RETURN_IF_ERROR(staging.Copy(dev, host));
      FLATPARAM_RETURN_IF_ERROR(comm.Broadcast(dev, bopts)->Wait());
      FLATPARAM_RETURN_IF_ERROR(staging.Copy(host, dev));
    } else {
      FLATPARAM_RETURN_IF_ERROR(comm.Broadcast(host, bopts)->Wait());
    }
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
    OrigUnitOutput o = AllocateOrigUnit(layout, u, rank, FillsEmpty(options));
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
  FLATPARAM_ASSIGN_OR_RETURN(
      DeviceStaging staging,
      DeviceStaging::Create(options, w * chunk * static_cast<int64_t>(size)));
  for (int64_t off = 0; off < s; off += chunk) {
    const int64_t count = std::min(chunk, s - off);
    unsigned char* mine =
        buf.data() + rank * count * static_cast<int64_t>(size);
    fill_local(off, count, mine);
    // In place: this rank's input is its slot of the output.
    const BufferRef host_all{buf.data(), w * count, dtype, Device::Host()};
    if (staging.active()) {
      const BufferRef dev_all = staging.Ref(dtype, 0, w * count);
      const BufferRef dev_mine = dev_all.Slice(rank * count, count);
      FLATPARAM_RETURN_IF_ERROR(staging.Copy(
          dev_mine, ConstBufferRef{mine, count, dtype, Device::Host()}));
      FLATPARAM_RETURN_IF_ERROR(
          comm.AllGather(dev_mine, dev_all, options.collective)->Wait());
      FLATPARAM_RETURN_IF_ERROR(staging.Copy(host_all, dev_all));
    } else {
      FLATPARAM_RETURN_IF_ERROR(
          comm.AllGather(ConstBufferRef{mine, count, dtype, Device::Host()},
                         host_all, options.collective)
              ->Wait());
    }
    if (out.empty()) continue;
    for (int64_t q = 0; q < w; ++q) {
      UnflattenRange(layout, size,
                     buf.data() + q * count * static_cast<int64_t>(size),
                     q * s + off, count, out);
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<OptimStateDict> ConsolidateFlat(
    const ModelIndex& index, const OptimStateDict& sharded,
    const std::vector<StateMeta>& metas, Communicator& comm,
    const OptimStateOptions& options, bool to_save) {
  std::vector<int> units;
  std::vector<std::string> mismatches;
  FLATPARAM_RETURN_IF_ERROR(ValidateFlatRanks(
      index, metas, options.strict_replicated_values, &units, &mismatches));
  if (to_save) {
    for (const std::string& m : mismatches) {
      Warn(options, absl::StrCat(m,
                                 "; each rank keeps its own value, as "
                                 "PyTorch does"));
    }
  }
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
    const ModelLayout& layout, const OptimStateDict& sharded_as_keyed,
    Communicator& comm, const OptimStateOptions& options) {
  FLATPARAM_RETURN_IF_ERROR(CheckComm(layout, comm));
  // Keyed as this rank's optimizer keys it: to layout keys first. The ranks
  // agree on the outcome, so that a bad key on one rank is an error on all
  // rather than a hang.
  absl::StatusOr<OptimStateDict> keyed =
      ToLayoutKeys(layout, sharded_as_keyed, options);
  if (options.sharded_keys != ShardedKeys::kLayout) {
    FLATPARAM_ASSIGN_OR_RETURN(
        std::vector<std::string> errors,
        comm.AllGatherBytes(
            keyed.ok() ? std::string() : std::string(keyed.status().message()),
            options.collective));
    for (size_t r = 0; r < errors.size(); ++r) {
      if (errors[r].empty()) continue;
      return absl::InvalidArgumentError(absl::StrFormat(
          "rank %d's sharded optimizer state: %s", r, errors[r]));
    }
  }
  if (!keyed.ok()) return keyed.status();
  const OptimStateDict& sharded = *keyed;
  const ModelIndex index(layout, options.unmanaged_params);
  if (options.rank0_only && !options.global_rank.has_value() &&
      IsHybridStrategy(layout.options().strategy)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "rank0_only with %s needs OptimStateOptions::global_rank: rank %d of "
        "the shard group is not global rank 0 in every replicate group",
        ShardingStrategyName(layout.options().strategy), comm.rank()));
  }
  const int64_t global_rank = options.global_rank.value_or(comm.rank());
  const bool to_save = !options.rank0_only || global_rank == 0;
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
  FLATPARAM_ASSIGN_OR_RETURN(
      out.param_groups,
      UnflattenGroups(index, sharded.param_groups, options.use_orig_params));
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
  const ModelIndex index(layout, options.unmanaged_params);
  const StateMeta meta = MetaOf(dict.state);
  FLATPARAM_ASSIGN_OR_RETURN(
      ShardPlan plan, PlanShard(index, meta, dict.param_groups, options));
  return FromLayoutKeys(
      layout, ShardLocally(index, plan, rank, FillsEmpty(options)), options);
}

absl::StatusOr<OptimStateDict> ScatterFullOptimState(
    const ModelLayout& layout, const OptimStateDict& full, Communicator& comm,
    const OptimStateOptions& options) {
  FLATPARAM_RETURN_IF_ERROR(CheckComm(layout, comm));
  const ModelIndex index(layout, options.unmanaged_params);
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
  FLATPARAM_ASSIGN_OR_RETURN(OptimStateDict mine,
                             ScatterPlan(index, plan, comm, options));
  return FromLayoutKeys(layout, mine, options);
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
