#include "flatparam/optim/internal/sharded_keys.h"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "flatparam/base/fqn.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/layout.h"

namespace flatparam {
namespace optim {
namespace internal_optim {
namespace {

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

}  // namespace

bool FillsEmpty(const OptimStateOptions& options) {
  return options.use_orig_params &&
         options.sharded_keys != ShardedKeys::kLayout;
}

// Each key through OptimizerKeys::ToLayout.
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

// Each key through OptimizerKeys::FromLayout.
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

}  // namespace internal_optim
}  // namespace optim
}  // namespace flatparam
