#include "flatparam/model_layout.h"

#include <algorithm>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/match.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
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

// Whether `text` matches the one-component glob `pattern` ('*': any run of
// characters, `text` holding no '.'). Backtracks to the last '*' only, so
// it is linear in practice and O(|pattern| * |text|) at worst.
bool GlobMatch(absl::string_view pattern, absl::string_view text) {
  size_t p = 0, t = 0;
  size_t star = absl::string_view::npos, star_t = 0;
  while (t < text.size()) {
    if (p < pattern.size() && pattern[p] == '*') {
      star = p++;
      star_t = t;
    } else if (p < pattern.size() && pattern[p] == text[t]) {
      ++p;
      ++t;
    } else if (star != absl::string_view::npos) {
      p = star + 1;
      t = ++star_t;
    } else {
      return false;
    }
  }
  while (p < pattern.size() && pattern[p] == '*') ++p;
  return p == pattern.size();
}

// The prefix of `fqn` that the glob's components `pattern` match, if `fqn`
// has more components than the glob (the prefix is then a module).
std::optional<std::string> GlobPrefix(
    const std::vector<absl::string_view>& pattern, const std::string& fqn) {
  std::vector<absl::string_view> parts = absl::StrSplit(fqn, '.');
  if (parts.size() <= pattern.size()) return std::nullopt;
  for (size_t i = 0; i < pattern.size(); ++i) {
    if (!GlobMatch(pattern[i], parts[i])) return std::nullopt;
  }
  parts.resize(pattern.size());
  return absl::StrJoin(parts, ".");
}

}  // namespace

bool IsWrapGlob(absl::string_view entry) {
  return absl::StrContains(entry, '*');
}

absl::StatusOr<ModelSpec> ExpandWrapPatterns(const ModelSpec& spec) {
  ModelSpec out = spec;
  out.wrap.clear();
  // Each prefix -> the entry that gave it, for the duplicate's message.
  absl::flat_hash_map<std::string, std::string> source;
  for (const std::string& entry : spec.wrap) {
    if (entry.empty() || entry.front() == '.' || entry.back() == '.') {
      return absl::InvalidArgumentError(absl::StrFormat(
          "wrap prefix \"%s\" is not a module name (the root is always a "
          "unit and is not listed)",
          entry));
    }
    std::vector<std::string> prefixes;
    if (!IsWrapGlob(entry)) {
      prefixes.push_back(entry);
    } else {
      const std::vector<absl::string_view> pattern = absl::StrSplit(entry, '.');
      absl::flat_hash_set<std::string> seen;
      for (const ParamSpec& p : spec.params) {
        std::optional<std::string> prefix = GlobPrefix(pattern, p.fqn);
        if (prefix && seen.insert(*prefix).second) {
          prefixes.push_back(*std::move(prefix));
        }
      }
      if (prefixes.empty()) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "wrap glob \"%s\" matches no module: no parameter fqn has %d "
            "leading components matching it and more after them",
            entry, pattern.size()));
      }
    }
    for (std::string& prefix : prefixes) {
      auto [it, inserted] = source.emplace(prefix, entry);
      if (!inserted) {
        if (it->second == entry) {
          return absl::InvalidArgumentError(
              absl::StrFormat("wrap prefix \"%s\" is listed twice", entry));
        }
        return absl::InvalidArgumentError(absl::StrFormat(
            "wrap prefix \"%s\" is listed twice: by \"%s\" and by \"%s\" "
            "(each unit must come from one wrap entry)",
            prefix, it->second, entry));
      }
      out.wrap.push_back(std::move(prefix));
    }
  }
  return out;
}

std::string OwningUnit(const std::string& fqn,
                       const std::vector<std::string>& wrap) {
  std::string best;
  for (const std::string& p : wrap) {
    if (IsUnder(fqn, p) && p.size() > best.size()) best = p;
  }
  return best;
}

absl::StatusOr<ModelLayout> ModelLayout::Create(const ModelSpec& given,
                                                const LayoutOptions& options) {
  if (given.params.empty()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("model \"%s\" has no parameters", given.name));
  }
  FLATPARAM_ASSIGN_OR_RETURN(const ModelSpec spec, ExpandWrapPatterns(given));

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

  // Buffers are not laid out, but share the parameters' namespace (a state
  // dict holds both).
  absl::flat_hash_set<std::string> buffer_names;
  for (size_t i = 0; i < spec.buffers.size(); ++i) {
    const BufferSpec& b = spec.buffers[i];
    if (b.fqn.empty()) {
      return absl::InvalidArgumentError(
          absl::StrFormat("buffer %d has an empty fqn", i));
    }
    if (index_of.contains(b.fqn)) {
      return absl::InvalidArgumentError(
          absl::StrFormat("buffer \"%s\" has the name of a parameter", b.fqn));
    }
    if (!buffer_names.insert(b.fqn).second) {
      return absl::InvalidArgumentError(
          absl::StrFormat("duplicate buffer name \"%s\"", b.fqn));
    }
    for (int64_t d : b.shape) {
      if (d < 0) {
        return absl::InvalidArgumentError(
            absl::StrFormat("buffer \"%s\" has a negative dimension: [%s]",
                            b.fqn, absl::StrJoin(b.shape, ", ")));
      }
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

std::string DescribeBufferDifference(const ModelSpec& a, const ModelSpec& b,
                                     absl::string_view a_name,
                                     absl::string_view b_name) {
  const auto describe = [](const BufferSpec& x) {
    return absl::StrFormat("[%s] %s", absl::StrJoin(x.shape, ", "),
                           DTypeName(x.dtype));
  };
  absl::flat_hash_map<std::string, const BufferSpec*> in_b;
  for (const BufferSpec& x : b.buffers) in_b[x.fqn] = &x;
  absl::flat_hash_set<std::string> in_a;
  for (const BufferSpec& x : a.buffers) {
    in_a.insert(x.fqn);
    auto it = in_b.find(x.fqn);
    if (it == in_b.end()) {
      return absl::StrFormat("buffer '%s' (%s) of %s model is not in %s", x.fqn,
                             describe(x), a_name, b_name);
    }
    if (*it->second != x) {
      return absl::StrFormat("buffer '%s' is %s in %s model and %s in %s",
                             x.fqn, describe(x), a_name, describe(*it->second),
                             b_name);
    }
  }
  for (const BufferSpec& x : b.buffers) {
    if (!in_a.contains(x.fqn)) {
      return absl::StrFormat("buffer '%s' (%s) of %s model is not in %s", x.fqn,
                             describe(x), b_name, a_name);
    }
  }
  for (size_t i = 0; i < a.buffers.size(); ++i) {
    if (a.buffers[i].fqn != b.buffers[i].fqn) {
      return absl::StrFormat(
          "the buffers come in another order: #%d is '%s' in %s model and "
          "'%s' in %s",
          i, a.buffers[i].fqn, a_name, b.buffers[i].fqn, b_name);
    }
  }
  return "";
}

}  // namespace flatparam
