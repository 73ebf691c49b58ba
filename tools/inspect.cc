#include "tools/inspect.h"

#include <algorithm>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "flatparam/base/dtype.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/layout.h"
#include "flatparam/layout_json.h"

namespace flatparam {
namespace tools {
namespace {

// Table truncation limits; see PrintLayoutTable's comment.
constexpr int64_t kMaxRanksShown = 32;
constexpr int64_t kHeadRanks = 16;
constexpr int64_t kTailRanks = 4;
constexpr size_t kMaxParamsListed = 6;
constexpr size_t kHeadParams = 3;
constexpr size_t kTailParams = 2;

std::string WithCommas(int64_t n) {
  std::string digits = absl::StrCat(n < 0 ? -n : n);
  std::string out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out.push_back(',');
    out.push_back(digits[i]);
  }
  return n < 0 ? "-" + out : out;
}

std::string UnitLabel(const std::string& unit) {
  return unit.empty() ? "<root>" : unit;
}

// "a, b, c, ... (+4 more) ..., x, y" when `items` is long.
std::string Abbreviate(const std::vector<std::string>& items) {
  if (items.size() <= kMaxParamsListed) return absl::StrJoin(items, ", ");
  std::vector<std::string> shown(items.begin(), items.begin() + kHeadParams);
  shown.push_back(absl::StrFormat("... (+%d more) ...",
                                  items.size() - kHeadParams - kTailParams));
  shown.insert(shown.end(), items.end() - kTailParams, items.end());
  return absl::StrJoin(shown, ", ");
}

// Prints `rows` with columns padded to their widest cell; columns flagged in
// `right` are right-aligned; the last column is never padded.
void PrintColumns(const std::vector<std::vector<std::string>>& rows,
                  const std::vector<bool>& right, absl::string_view indent,
                  std::ostream& out) {
  std::vector<size_t> width(right.size(), 0);
  for (const auto& row : rows) {
    for (size_t c = 0; c < row.size(); ++c) {
      width[c] = std::max(width[c], row[c].size());
    }
  }
  for (const auto& row : rows) {
    std::string line(indent);
    for (size_t c = 0; c < row.size(); ++c) {
      const bool last = c + 1 == row.size();
      const size_t pad = width[c] - row[c].size();
      if (c > 0) line += "  ";
      if (right[c]) line.append(pad, ' ');
      line += row[c];
      if (!right[c] && !last) line.append(pad, ' ');
    }
    // Cells left empty (the "ranks not shown" row) leave trailing blanks.
    line.erase(line.find_last_not_of(' ') + 1);
    out << line << "\n";
  }
}

std::vector<std::string> RankRow(const FlatParamLayout& f, int64_t rank) {
  const ShardInterval iv = f.shard_interval(rank);
  const std::vector<ShardParamInfo> infos = f.shard_param_infos(rank);
  std::vector<std::string> held;
  int64_t elements = 0;
  for (size_t i = 0; i < infos.size(); ++i) {
    const ShardParamInfo& s = infos[i];
    if (!s.in_shard) continue;
    const ParamInfo& p = f.params()[i];
    elements += s.numel_in_shard;
    if (s.numel_in_shard == p.numel) {
      held.push_back(p.fqn);
    } else {
      held.push_back(absl::StrFormat("%s[%d:%d]", p.fqn,
                                     s.intra_param_start_idx,
                                     s.intra_param_end_idx + 1));
    }
  }
  return {absl::StrCat(rank),
          absl::StrFormat("[%d, %d]", iv.start, iv.end_inclusive),
          WithCommas(iv.numel_padded),
          WithCommas(elements),
          HumanBytes(elements * static_cast<int64_t>(DTypeSize(f.dtype()))),
          held.empty() ? "(padding only)" : Abbreviate(held)};
}

void PrintUnit(const FlatParamLayout& f, std::ostream& out) {
  const int64_t size = static_cast<int64_t>(DTypeSize(f.dtype()));
  std::string params = absl::StrCat(f.params().size(), " params");
  if (!f.shared_params().empty()) {
    absl::StrAppend(&params, " + ", f.shared_params().size(), " shared");
  }
  out << absl::StrFormat(
      "unit %s: %s, %s, numel %s, padding %s, unsharded %s, sharded %s per "
      "rank\n",
      UnitLabel(f.unit()), DTypeName(f.dtype()), params,
      WithCommas(f.param_numel()),
      WithCommas(f.padded_unsharded_numel() - f.param_numel()),
      HumanBytes(f.padded_unsharded_numel() * size),
      HumanBytes(f.sharded_numel() * size));
  if (!f.shared_params().empty()) {
    std::vector<std::string> shared;
    for (const SharedParamInfo& s : f.shared_params()) {
      shared.push_back(absl::StrCat(s.fqn, " -> ", s.prim_fqn));
    }
    out << "  shared: " << Abbreviate(shared) << "\n";
  }

  std::vector<std::vector<std::string>> rows = {
      {"rank", "interval", "padded", "elements", "bytes", "params held"}};
  const int64_t w = f.world_size();
  const bool truncate = w > kMaxRanksShown;
  for (int64_t r = 0; r < w; ++r) {
    if (truncate && r == kHeadRanks) {
      rows.push_back(
          {"...",
           absl::StrFormat("(%d ranks not shown)", w - kHeadRanks - kTailRanks),
           "", "", "", ""});
      r = w - kTailRanks;
    }
    rows.push_back(RankRow(f, r));
  }
  PrintColumns(rows, {true, false, true, true, true, false}, "  ", out);
}

}  // namespace

std::string HumanBytes(int64_t bytes) {
  static constexpr const char* kUnits[] = {"KiB", "MiB", "GiB", "TiB", "PiB"};
  if (bytes < 1024) return absl::StrCat(bytes, " B");
  double v = static_cast<double>(bytes);
  int unit = -1;
  while (v >= 1024 && unit + 1 < 5) {
    v /= 1024;
    ++unit;
  }
  return absl::StrFormat("%.2f %s", v, kUnits[unit]);
}

absl::StatusOr<OutputFormat> ParseOutputFormat(absl::string_view name) {
  const std::string lower = absl::AsciiStrToLower(name);
  if (lower == "table") return OutputFormat::kTable;
  if (lower == "json") return OutputFormat::kJson;
  return absl::InvalidArgumentError(
      absl::StrFormat("--format must be table or json, got \"%s\"", name));
}

nlohmann::json InspectJson(const ResolvedLayout& resolved) {
  LayoutJsonOptions options;
  options.world_size = resolved.world_size;
  return ModelLayoutToJson(resolved.layout, options);
}

void PrintLayoutTable(const ResolvedLayout& resolved, std::ostream& out) {
  const ModelLayout& model = resolved.layout;
  const LayoutOptions& o = model.options();
  const std::vector<FlatParamLayout>& flat = model.flat_params();
  int64_t shared = 0;
  int64_t unsharded_bytes = 0;
  int64_t sharded_bytes = 0;
  for (const FlatParamLayout& f : flat) {
    shared += static_cast<int64_t>(f.shared_params().size());
    const int64_t size = static_cast<int64_t>(DTypeSize(f.dtype()));
    unsharded_bytes += f.padded_unsharded_numel() * size;
    sharded_bytes += f.sharded_numel() * size;
  }

  out << absl::StrFormat(
      "model %s: %d parameters (%d shared), %s elements, %d flat parameters\n",
      model.spec().name, model.spec().params.size(), shared,
      WithCommas(model.param_numel()), flat.size());
  std::string world = absl::StrFormat("world size %d", resolved.world_size);
  std::string note;
  if (IsHybridStrategy(o.strategy)) {
    const int64_t g = resolved.shard_group_size;
    absl::StrAppendFormat(&world, " = %d replicas x shard group of %d",
                          resolved.world_size / g, g);
    note = absl::StrFormat(
        "rows are the shard ranks 0..%d of every replica (global rank = "
        "replica * %d + shard rank)\n",
        g - 1, g);
  } else if (!UsesShardedStrategy(o.strategy)) {
    note = "every rank holds every flat parameter whole\n";
  }
  out << absl::StrFormat(
      "strategy %s, %s, align_addresses %s, compute dtype %s\n",
      ShardingStrategyName(o.strategy), world, o.align_addresses ? "on" : "off",
      o.compute_dtype.has_value() ? DTypeName(*o.compute_dtype)
                                  : "= parameter dtype");
  out << note;
  out << "intervals are inclusive element ranges of the padded flat "
         "parameter; params held: fqn = whole, fqn[a:b] = flattened elements "
         "a..b-1\n";
  for (const FlatParamLayout& f : flat) {
    out << "\n";
    PrintUnit(f, out);
  }
  out << absl::StrFormat(
      "\ntotal: %d flat parameters, %s elements + %s padding; unsharded %s; "
      "sharded %s per rank\n",
      flat.size(), WithCommas(model.param_numel()),
      WithCommas(model.padded_unsharded_numel() - model.param_numel()),
      HumanBytes(unsharded_bytes), HumanBytes(sharded_bytes));
}

absl::Status RunInspect(const InspectOptions& options, std::ostream& out) {
  FLATPARAM_ASSIGN_OR_RETURN(OutputFormat format,
                             ParseOutputFormat(options.format));
  FLATPARAM_ASSIGN_OR_RETURN(ResolvedLayout resolved,
                             ResolveLayout(options.layout));
  // Render fully before writing so that a failure leaves `out` untouched.
  std::ostringstream text;
  if (format == OutputFormat::kJson) {
    text << InspectJson(resolved).dump(2, ' ', false,
                                       nlohmann::json::error_handler_t::replace)
         << "\n";
  } else {
    PrintLayoutTable(resolved, text);
  }
  out << text.str();
  return absl::OkStatus();
}

}  // namespace tools
}  // namespace flatparam
