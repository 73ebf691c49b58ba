// dcp.h, part 2: importing a DCP checkpoint into a flatparam checkpoint,
// staged as safetensors for the Hugging Face import (internal/staging.h).
#include <algorithm>
#include <cstring>
#include <iterator>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/checkpoint/checkpoint_names.h"
#include "flatparam/checkpoint/safetensors.h"
#include "flatparam/checkpoint/training_state.h"
#include "flatparam/interop/dcp/dcp.h"
#include "flatparam/interop/internal/staging.h"

namespace flatparam {
namespace libtorch {
namespace {

using checkpoint::FileSystem;
using checkpoint::JoinPath;
using nlohmann::json;

// A tensor of the DCP checkpoint as a safetensors source, read chunk by
// chunk as the writer pulls its bytes: a tensor chunked on its first
// dimension only (FSDP, FSDP2, torchtitan's data-parallel shards) holds one
// chunk in memory at a time; any other chunking, the whole tensor.
checkpoint::TensorSource DcpTensorSource(const DcpReader& dcp,
                                         const std::string& key,
                                         std::string name) {
  const DcpEntry& e = dcp.metadata().entries.at(key);
  checkpoint::TensorSource s;
  s.name = std::move(name);
  s.dtype = e.dtype;
  s.shape = e.shape;
  bool rows = !e.shape.empty();
  for (const DcpChunk& c : e.chunks) {
    for (size_t d = 1; d < e.shape.size(); ++d) {
      rows &= c.offsets[d] == 0 && c.sizes[d] == e.shape[d];
    }
  }
  uint64_t row_bytes = DTypeSize(e.dtype);
  for (size_t d = 1; d < e.shape.size(); ++d) row_bytes *= e.shape[d];
  struct State {
    int64_t chunk = -1;  // the chunk held, by index; -1: the whole tensor
    std::optional<HostTensor> held;
  };
  // The first byte of each chunk that holds any, in order (the chunks
  // are ordered by offsets and tile the tensor).
  std::vector<std::pair<uint64_t, int64_t>> starts;
  for (size_t k = 0; k < e.chunks.size(); ++k) {
    if (!e.shape.empty() && e.chunks[k].sizes[0] > 0) {
      starts.emplace_back(
          static_cast<uint64_t>(e.chunks[k].offsets[0]) * row_bytes, k);
    }
  }
  auto state = std::make_shared<State>();
  s.fill = [&dcp, key, rows, state, starts = std::move(starts)](
               uint64_t offset, absl::Span<char> out) -> absl::Status {
    size_t done = 0;
    while (done < out.size()) {
      const uint64_t at = offset + done;
      uint64_t begin = 0;  // the held piece's first byte in the tensor
      if (rows) {
        // The last chunk starting at or before `at`.
        auto next = std::upper_bound(
            starts.begin(), starts.end(), at,
            [](uint64_t a, const std::pair<uint64_t, int64_t>& s) {
              return a < s.first;
            });
        if (next == starts.begin()) {
          return absl::InternalError(
              absl::StrCat(key, ": byte ", at, " before its chunks"));
        }
        const int64_t k = std::prev(next)->second;
        begin = std::prev(next)->first;
        if (state->chunk != k || !state->held.has_value()) {
          state->held.reset();
          FLATPARAM_ASSIGN_OR_RETURN(HostTensor t, dcp.ReadChunk(key, k));
          state->held.emplace(std::move(t));
          state->chunk = k;
        }
      } else if (!state->held.has_value()) {
        FLATPARAM_ASSIGN_OR_RETURN(HostTensor t, dcp.ReadTensor(key));
        state->held.emplace(std::move(t));
      }
      const HostTensor& t = *state->held;
      const uint64_t in = at - begin;
      if (in >= t.nbytes()) {
        return absl::InternalError(
            absl::StrCat(key, ": byte ", at, " outside its chunks"));
      }
      const size_t n = std::min<uint64_t>(out.size() - done, t.nbytes() - in);
      std::memcpy(out.data() + done, static_cast<const char*>(t.data()) + in,
                  n);
      done += n;
      // The writer pulls each byte once, in order: a piece read to its end
      // is not needed again (and every tensor's source is alive until the
      // file is written, so a piece kept would keep them all).
      if (in + n == t.nbytes()) state->held.reset();
    }
    return absl::OkStatus();
  };
  return s;
}

absl::StatusOr<optim::HyperValue> ToHyper(const json& v,
                                          const std::string& where) {
  if (v.is_null()) return optim::HyperValue(std::monostate());
  if (v.is_boolean()) return optim::HyperValue(v.get<bool>());
  if (v.is_number_integer()) return optim::HyperValue(v.get<int64_t>());
  if (v.is_number_float()) return optim::HyperValue(v.get<double>());
  if (v.is_string()) return optim::HyperValue(v.get<std::string>());
  if (v.is_array()) {
    std::vector<double> out;
    for (const json& x : v) {
      if (!x.is_number()) break;
      out.push_back(x.get<double>());
    }
    if (out.size() == v.size()) return optim::HyperValue(std::move(out));
  }
  return absl::FailedPreconditionError(absl::StrCat(
      where, " is ", v.dump().substr(0, 200),
      " (a hyperparameter is None, bool, int, float, str or a tuple of "
      "numbers)"));
}

absl::StatusOr<optim::OptimStateValue> ToStateValue(const json& v,
                                                    const std::string& where) {
  if (v.is_null()) return optim::OptimStateValue(std::monostate());
  if (v.is_boolean()) return optim::OptimStateValue(v.get<bool>());
  if (v.is_number_integer()) return optim::OptimStateValue(v.get<int64_t>());
  if (v.is_number_float()) return optim::OptimStateValue(v.get<double>());
  if (v.is_string()) return optim::OptimStateValue(v.get<std::string>());
  return absl::FailedPreconditionError(
      absl::StrCat(where, " is ", v.dump().substr(0, 200),
                   " (a state value is a tensor, None, bool, int, float or "
                   "str)"));
}

bool IsOptimKey(const std::string& key, const std::string& prefix) {
  return absl::StartsWith(key, absl::StrCat(prefix, "state.")) ||
         absl::StartsWith(key, absl::StrCat(prefix, "param_groups"));
}

// The optimizer's keys' prefix: the one under which some parameter of the
// model has state.
std::optional<std::string> FindOptimPrefix(
    const DcpMetadata& md, const std::vector<std::string>& params) {
  for (const char* prefix : {"optim.", "optimizer.", ""}) {
    for (const std::string& p : params) {
      const std::string head = absl::StrCat(prefix, "state.", p, ".");
      auto it = md.entries.lower_bound(head);
      if (it != md.entries.end() && absl::StartsWith(it->first, head)) {
        return std::string(prefix);
      }
    }
  }
  return std::nullopt;
}

// The model's keys' prefix: the candidate under which most of the model's
// parameters are found ("model." when DCP flattened {"model": ...}).
std::string FindModelPrefix(const DcpMetadata& md,
                            const std::vector<std::string>& params) {
  std::string best;
  size_t best_count = 0;
  for (const char* prefix : {"", "model."}) {
    size_t count = 0;
    for (const std::string& p : params) {
      count += md.entries.count(absl::StrCat(prefix, p));
    }
    if (count > best_count) {
      best = prefix;
      best_count = count;
    }
  }
  return best;
}

// The optimizer state under a prefix, as found: each parameter's states
// (a tensor by its DCP key, or a value), and the param groups.
struct DcpOptim {
  std::map<
      std::string,
      std::map<std::string, std::variant<std::string, optim::OptimStateValue>>>
      state;
  std::vector<optim::ParamGroup> param_groups;
};

// Parses the optimizer keys under `prefix` (see DcpImportOptions), reading
// the bytes items; tensors are left unread.
absl::StatusOr<DcpOptim> ParseOptim(const DcpReader& dcp,
                                    const std::string& prefix,
                                    const std::vector<std::string>& params) {
  const DcpMetadata& md = dcp.metadata();
  const std::string where = dcp.dir();
  const std::set<std::string> known(params.begin(), params.end());
  DcpOptim sidecar;
  const std::string state_head = absl::StrCat(prefix, "state.");
  const std::string groups_key = absl::StrCat(prefix, "param_groups");
  const std::string groups_head = absl::StrCat(groups_key, ".");
  // Flattened param groups (flatten_optimizer_state_dict): each
  // parameter's hyperparameters.
  std::map<std::string, std::map<std::string, optim::HyperValue>> flat_groups;
  bool listed_groups = false;
  for (const auto& [key, e] : md.entries) {
    if (absl::StartsWith(key, state_head)) {
      const std::string rest = key.substr(state_head.size());
      const size_t dot = rest.rfind('.');
      const std::string fqn =
          dot == std::string::npos ? "" : rest.substr(0, dot);
      if (known.count(fqn) == 0) {
        return absl::FailedPreconditionError(
            absl::StrCat(where, ": optimizer state ", key,
                         " is not of a parameter of the model (expected ",
                         state_head, "<parameter>.<state name>)"));
      }
      const std::string name = rest.substr(dot + 1);
      if (e.kind == DcpEntry::Kind::kTensor) {
        sidecar.state[fqn].emplace(name, key);
      } else {
        FLATPARAM_ASSIGN_OR_RETURN(json v, dcp.ReadBytes(key));
        FLATPARAM_ASSIGN_OR_RETURN(
            optim::OptimStateValue value,
            ToStateValue(v, absl::StrCat(where, ": ", key)));
        sidecar.state[fqn].emplace(name, std::move(value));
      }
      continue;
    }
    if (key == groups_key) {
      FLATPARAM_ASSIGN_OR_RETURN(json groups, dcp.ReadBytes(key));
      if (!groups.is_array()) {
        return absl::FailedPreconditionError(
            absl::StrCat(where, ": ", key, " is not a list of param groups"));
      }
      for (size_t g = 0; g < groups.size(); ++g) {
        const std::string at = absl::StrCat(where, ": ", key, "[", g, "]");
        if (!groups[g].is_object() || !groups[g].contains("params") ||
            !groups[g]["params"].is_array()) {
          return absl::FailedPreconditionError(
              absl::StrCat(at, " is not a dict with \"params\""));
        }
        optim::ParamGroup group;
        for (const auto& [h, v] : groups[g].items()) {
          if (h == "params") continue;
          FLATPARAM_ASSIGN_OR_RETURN(
              group.hyperparams[h],
              ToHyper(v, absl::StrCat(at, "[\"", h, "\"]")));
        }
        for (const json& p : groups[g]["params"]) {
          if (!p.is_string() || known.count(p.get<std::string>()) == 0) {
            return absl::FailedPreconditionError(absl::StrCat(
                at, " lists ", p.dump().substr(0, 200),
                ", not a parameter name of the model (DCP's optimizer state "
                "dicts are keyed by name)"));
          }
          group.params.push_back(p.get<std::string>());
        }
        sidecar.param_groups.push_back(std::move(group));
      }
      listed_groups = true;
      continue;
    }
    if (absl::StartsWith(key, groups_head)) {
      const std::string rest = key.substr(groups_head.size());
      const size_t dot = rest.rfind('.');
      const std::string fqn =
          dot == std::string::npos ? "" : rest.substr(0, dot);
      if (known.count(fqn) == 0 || e.kind != DcpEntry::Kind::kBytes) {
        return absl::FailedPreconditionError(
            absl::StrCat(where, ": ", key,
                         " is not a hyperparameter of a parameter of "
                         "the model (expected ",
                         groups_head, "<parameter>.<name>)"));
      }
      FLATPARAM_ASSIGN_OR_RETURN(json v, dcp.ReadBytes(key));
      FLATPARAM_ASSIGN_OR_RETURN(flat_groups[fqn][rest.substr(dot + 1)],
                                 ToHyper(v, absl::StrCat(where, ": ", key)));
    }
  }
  if (listed_groups && !flat_groups.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat(where, ": both ", groups_key, " and ", groups_head,
                     "<parameter> keys; expected one form"));
  }
  // Flattened groups: parameters with the same hyperparameters form a
  // group, in the model's parameter order.
  for (const std::string& p : params) {
    auto it = flat_groups.find(p);
    if (it == flat_groups.end()) continue;
    auto g =
        std::find_if(sidecar.param_groups.begin(), sidecar.param_groups.end(),
                     [&](const optim::ParamGroup& pg) {
                       return pg.hyperparams == it->second;
                     });
    if (g == sidecar.param_groups.end()) {
      sidecar.param_groups.push_back({it->second, {}});
      g = sidecar.param_groups.end() - 1;
    }
    g->params.push_back(p);
  }
  if (!sidecar.state.empty() && sidecar.param_groups.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat(where, ": optimizer state under \"", prefix,
                     "\" without param groups (", groups_key, ")"));
  }
  return sidecar;
}

// Stages the optimizer state under `prefix` as optim.safetensors +
// optim.json in `dir`; false when there is none.
absl::StatusOr<bool> StageOptimizer(FileSystem& fs, const DcpReader& dcp,
                                    const std::string& prefix,
                                    const std::vector<std::string>& params,
                                    const std::string& dir) {
  FLATPARAM_ASSIGN_OR_RETURN(DcpOptim parsed, ParseOptim(dcp, prefix, params));
  if (parsed.state.empty() && parsed.param_groups.empty()) return false;
  checkpoint::OptimSidecar sidecar;
  std::vector<checkpoint::TensorSource> sources;
  for (auto& [fqn, states] : parsed.state) {
    for (auto& [name, v] : states) {
      checkpoint::SidecarValue sv;
      if (const auto* key = std::get_if<std::string>(&v)) {
        sv.tensor = checkpoint::OptimStateTensorName(fqn, name);
        sources.push_back(DcpTensorSource(dcp, *key, *sv.tensor));
      } else {
        sv.value = std::move(std::get<optim::OptimStateValue>(v));
      }
      sidecar.state[optim::ParamKey(fqn)].emplace(name, std::move(sv));
    }
  }
  sidecar.param_groups = std::move(parsed.param_groups);
  FLATPARAM_ASSIGN_OR_RETURN(json doc,
                             checkpoint::OptimSidecarToJson(sidecar, false));
  FLATPARAM_RETURN_IF_ERROR(internal_torch::WriteSafetensorsFile(
      fs, JoinPath(dir, checkpoint::kOptimFileName), sources));
  FLATPARAM_RETURN_IF_ERROR(checkpoint::WriteFileDurably(
      fs, JoinPath(dir, checkpoint::kOptimJsonFileName), doc.dump(1)));
  return true;
}

}  // namespace

absl::StatusOr<optim::OptimStateDict> ReadDcpOptimState(
    const DcpReader& dcp, const std::string& prefix,
    const std::vector<std::string>& params) {
  FLATPARAM_ASSIGN_OR_RETURN(DcpOptim parsed, ParseOptim(dcp, prefix, params));
  optim::OptimStateDict out;
  for (auto& [fqn, states] : parsed.state) {
    optim::ParamState& mine = out.state[optim::ParamKey(fqn)];
    for (auto& [name, v] : states) {
      if (const auto* key = std::get_if<std::string>(&v)) {
        FLATPARAM_ASSIGN_OR_RETURN(HostTensor t, dcp.ReadTensor(*key));
        mine.emplace(name, std::move(t));
      } else {
        mine.emplace(name, std::move(std::get<optim::OptimStateValue>(v)));
      }
    }
  }
  out.param_groups = std::move(parsed.param_groups);
  return out;
}

absl::StatusOr<checkpoint::HfImportReport> ImportDcpCheckpoint(
    FileSystem& fs, const std::string& in_dir, const ModelSpec& spec,
    const LayoutOptions& layout_options, int64_t world_size,
    const std::string& out_dir, const DcpImportOptions& options) {
  FLATPARAM_RETURN_IF_ERROR(internal_torch::CheckDistinct(in_dir, out_dir));
  FLATPARAM_ASSIGN_OR_RETURN(DcpReader dcp, DcpReader::Open(fs, in_dir));
  const DcpMetadata& md = dcp.metadata();
  std::vector<std::string> params;
  for (const ParamSpec& p : spec.params) params.push_back(p.fqn);
  for (const BufferSpec& b : spec.buffers) params.push_back(b.fqn);
  const std::string model_prefix =
      options.model_prefix.value_or(FindModelPrefix(md, params));
  std::optional<std::string> optim_prefix = options.optim_prefix;
  if (!optim_prefix.has_value()) optim_prefix = FindOptimPrefix(md, params);

  internal_torch::StagingDir staging(
      fs, internal_torch::StagingPath(out_dir, "dcp-import"));
  FLATPARAM_RETURN_IF_ERROR(staging.Create());
  // The model: every tensor under its prefix that is not the optimizer's.
  std::vector<checkpoint::TensorSource> sources;
  for (const auto& [key, e] : md.entries) {
    if (e.kind != DcpEntry::Kind::kTensor ||
        !absl::StartsWith(key, model_prefix)) {
      continue;
    }
    if (optim_prefix.has_value() && IsOptimKey(key, *optim_prefix)) continue;
    if (model_prefix.empty() && (absl::StartsWith(key, "optim.") ||
                                 absl::StartsWith(key, "optimizer."))) {
      continue;
    }
    sources.push_back(
        DcpTensorSource(dcp, key, key.substr(model_prefix.size())));
  }
  if (sources.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        in_dir, ": no tensor under the model prefix \"", model_prefix, "\""));
  }
  std::map<std::string, std::string> renames;
  renames[staging.path()] = in_dir;
  const std::string staged_model =
      JoinPath(staging.path(), "model.safetensors");
  renames[staged_model] = in_dir;
  FLATPARAM_RETURN_IF_ERROR(
      internal_torch::WriteSafetensorsFile(fs, staged_model, sources));
  bool has_optim = false;
  if (options.optimizer && optim_prefix.has_value()) {
    FLATPARAM_ASSIGN_OR_RETURN(
        has_optim,
        StageOptimizer(fs, dcp, *optim_prefix, params, staging.path()));
    renames[JoinPath(staging.path(), checkpoint::kOptimFileName)] = in_dir;
    renames[JoinPath(staging.path(), checkpoint::kOptimJsonFileName)] = in_dir;
  }
  checkpoint::HfImportOptions hf = options.hf;
  hf.weights_only = !has_optim;
  absl::StatusOr<checkpoint::HfImportReport> report =
      checkpoint::ImportHfCheckpoint(fs, staging.path(), spec, layout_options,
                                     world_size, out_dir, hf);
  if (!report.ok()) {
    return internal_torch::WithUserPaths(report.status(), renames,
                                         absl::StrCat("importing ", in_dir));
  }
  report->files = 1;
  return report;
}

}  // namespace libtorch
}  // namespace flatparam
