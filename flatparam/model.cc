#include "flatparam/model.h"

#include <algorithm>
#include <string>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/match.h"
#include "absl/strings/str_format.h"
#include "flatparam/base/status_macros.h"

namespace flatparam {
namespace {

bool IsUnder(const std::string& fqn, const std::string& prefix) {
  return prefix.empty() ||
         (fqn.size() > prefix.size() + 1 && absl::StartsWith(fqn, prefix) &&
          fqn[prefix.size()] == '.');
}

std::string Label(const std::string& unit) {
  return unit.empty() ? "<root>" : "\"" + unit + "\"";
}

}  // namespace

std::string OwningUnit(const std::string& fqn,
                       const std::vector<std::string>& wrap) {
  std::string best;
  for (const std::string& p : wrap) {
    if (IsUnder(fqn, p) && p.size() > best.size()) best = p;
  }
  return best;
}

absl::StatusOr<ModelLayout> ModelLayout::Create(const ModelSpec& spec,
                                                const LayoutOptions& options) {
  if (spec.params.empty()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("model \"%s\" has no parameters", spec.name));
  }
  absl::flat_hash_set<std::string> prefixes;
  for (const std::string& p : spec.wrap) {
    if (p.empty() || p.front() == '.' || p.back() == '.') {
      return absl::InvalidArgumentError(absl::StrFormat(
          "wrap prefix \"%s\" is not a module name (the root is always a "
          "unit and is not listed)",
          p));
    }
    if (!prefixes.insert(p).second) {
      return absl::InvalidArgumentError(
          absl::StrFormat("wrap prefix \"%s\" is listed twice", p));
    }
  }

  // Names, ties and owners.
  const size_t n = spec.params.size();
  absl::flat_hash_map<std::string, size_t> index_of;
  std::vector<size_t> primary(n);
  std::vector<std::string> owner(n);
  for (size_t i = 0; i < n; ++i) {
    const ParamSpec& p = spec.params[i];
    if (p.fqn.empty()) {
      return absl::InvalidArgumentError(
          absl::StrFormat("parameter %d has an empty fqn", i));
    }
    if (!index_of.emplace(p.fqn, i).second) {
      return absl::InvalidArgumentError(
          absl::StrFormat("duplicate parameter name \"%s\"", p.fqn));
    }
    owner[i] = OwningUnit(p.fqn, spec.wrap);
    primary[i] = i;
    if (p.tied_to.empty()) continue;
    auto it = index_of.find(p.tied_to);
    if (it == index_of.end() || it->second == i) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "parameter \"%s\" is tied to \"%s\", which is not an earlier "
          "parameter of the model",
          p.fqn, p.tied_to));
    }
    primary[i] = primary[it->second];
    const size_t prim = primary[i];
    if (owner[prim] != owner[i]) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "parameter \"%s\" (unit %s) is tied to \"%s\" (unit %s): a shared "
          "parameter must belong to one FSDP unit; wrap their common "
          "ancestor instead",
          p.fqn, Label(owner[i]), spec.params[prim].fqn, Label(owner[prim])));
    }
  }

  // Unit order: root, then by first parameter under the prefix, outer first.
  struct UnitOrder {
    std::string prefix;
    size_t first;
    size_t depth;
  };
  std::vector<UnitOrder> units;
  for (const std::string& p : spec.wrap) {
    size_t first = n;
    for (size_t i = 0; i < n && first == n; ++i) {
      if (IsUnder(spec.params[i].fqn, p)) first = i;
    }
    if (first == n) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "wrap prefix \"%s\" matches no parameter (no fqn starts with "
          "\"%s.\")",
          p, p));
    }
    units.push_back(
        {p, first, static_cast<size_t>(std::count(p.begin(), p.end(), '.'))});
  }
  std::stable_sort(
      units.begin(), units.end(), [](const UnitOrder& a, const UnitOrder& b) {
        return a.first != b.first ? a.first < b.first : a.depth < b.depth;
      });
  units.insert(units.begin(), UnitOrder{"", 0, 0});

  ModelLayout model;
  model.spec_ = spec;
  model.options_ = options;
  for (const UnitOrder& u : units) {
    std::vector<ParamSpec> unit_params;
    for (size_t i = 0; i < n; ++i) {
      if (owner[i] != u.prefix) continue;
      ParamSpec p = spec.params[i];
      if (primary[i] != i) p.tied_to = spec.params[primary[i]].fqn;
      unit_params.push_back(std::move(p));
    }
    if (unit_params.empty()) continue;  // PyTorch makes no handle.
    FLATPARAM_ASSIGN_OR_RETURN(
        FlatParamLayout layout,
        FlatParamLayout::Create(u.prefix, unit_params, options));
    model.flat_params_.push_back(std::move(layout));
  }
  return model;
}

int64_t ModelLayout::param_numel() const {
  int64_t total = 0;
  for (const FlatParamLayout& f : flat_params_) total += f.param_numel();
  return total;
}

int64_t ModelLayout::padded_unsharded_numel() const {
  int64_t total = 0;
  for (const FlatParamLayout& f : flat_params_) {
    total += f.padded_unsharded_numel();
  }
  return total;
}

int64_t ModelLayout::sharded_numel() const {
  int64_t total = 0;
  for (const FlatParamLayout& f : flat_params_) total += f.sharded_numel();
  return total;
}

}  // namespace flatparam
