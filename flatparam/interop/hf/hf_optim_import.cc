#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "flatparam/base/json_limits.h"
#include "flatparam/base/shape.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/checkpoint/checkpoint_dir.h"
#include "flatparam/checkpoint/checkpoint_names.h"
#include "flatparam/checkpoint/internal/full_optim_shards.h"
#include "flatparam/checkpoint/manifest.h"
#include "flatparam/checkpoint/training_state.h"
#include "flatparam/interop/hf/hf_checkpoint.h"
#include "flatparam/interop/hf/internal/hf_internal.h"
#include "flatparam/optim/optim_state.h"

namespace flatparam {
namespace checkpoint {

// ---------------------------------------------------------------------------
// Optimizer state beside the weights

namespace {

using json = nlohmann::json;
using internal_checkpoint::FullOptimShards;
using internal_checkpoint::Problems;

constexpr char kOptimizerFilePrefix[] = "optimizer";

// Who a "state.{fqn}.{state}" tensor of optim.safetensors belongs to: the
// longest FQN of the model (a tied alias included) followed by a non-empty
// state name, as FullCheckpointReader::CheckFitsModel reads it.
struct StateOwner {
  std::string fqn;
  std::string state;
  const ParamSpec* param = nullptr;  // the parameter named by `fqn`
};
std::optional<StateOwner> FindStateOwner(
    absl::string_view tensor,
    const std::map<std::string, const ParamSpec*, std::less<>>& params) {
  if (!absl::ConsumePrefix(&tensor, kOptimStatePrefix)) return std::nullopt;
  std::optional<StateOwner> owner;
  for (size_t dot = tensor.find('.'); dot != absl::string_view::npos;
       dot = tensor.find('.', dot + 1)) {
    if (dot + 1 >= tensor.size()) break;
    auto it = params.find(tensor.substr(0, dot));
    if (it != params.end()) {
      owner = StateOwner{it->first, std::string(tensor.substr(dot + 1)),
                         it->second};
    }
  }
  return owner;
}

// optim.safetensors against the model, as ShardCheckpoint checks a full
// checkpoint's (FullCheckpointReader::CheckFitsModel): every tensor is
// "state.{fqn}.{state}" for a parameter, shaped like it or 0-d.
absl::Status CheckOptimFitsModel(
    const SafetensorsReader& file, const ModelSpec& spec,
    const std::map<std::string, const ParamSpec*, std::less<>>& params) {
  Problems problems;
  for (const SafetensorsEntry& e : file.tensors()) {
    const std::optional<StateOwner> owner = FindStateOwner(e.name, params);
    if (!owner.has_value()) {
      problems.Add(absl::StrFormat(
          "tensor '%s' is not state.{fqn}.{state_name} for a parameter of "
          "model '%s'",
          e.name, spec.name));
      continue;
    }
    const std::vector<int64_t>& shape = owner->param->shape;
    if (!e.shape.empty() && e.shape != shape) {
      problems.Add(absl::StrFormat(
          "tensor '%s' has shape %s, expected [] or %s of parameter '%s'",
          e.name, ShapeString(e.shape), ShapeString(shape), owner->fqn));
    }
  }
  return problems.ToStatus(
      absl::StatusCode::kFailedPrecondition,
      absl::StrFormat("%s does not fit model '%s'", file.name(), spec.name));
}

// A hyperparameter as Python's json.dumps writes it: None, bool, int,
// float, str, or a tuple (Adam's betas) as a list of numbers.
absl::StatusOr<optim::HyperValue> HyperFromJson(const json& v,
                                                const std::string& where) {
  switch (v.type()) {
    case json::value_t::null:
      return optim::HyperValue(std::monostate());
    case json::value_t::boolean:
      return optim::HyperValue(v.get<bool>());
    case json::value_t::number_unsigned:
      if (v.get<uint64_t>() >
          static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        break;
      }
      return optim::HyperValue(static_cast<int64_t>(v.get<uint64_t>()));
    case json::value_t::number_integer:
      return optim::HyperValue(v.get<int64_t>());
    case json::value_t::number_float:
      return optim::HyperValue(v.get<double>());
    case json::value_t::string:
      return optim::HyperValue(v.get<std::string>());
    case json::value_t::array: {
      std::vector<double> values;
      for (const json& x : v) {
        if (!x.is_number()) break;
        values.push_back(x.get<double>());
      }
      if (values.size() != v.size()) break;
      return optim::HyperValue(std::move(values));
    }
    default:
      break;
  }
  std::string text = v.dump(-1, ' ', false, json::error_handler_t::replace);
  if (text.size() > 80) text = absl::StrCat(text.substr(0, 77), "...");
  return absl::DataLossError(absl::StrFormat(
      "%s is %s, which is not a hyperparameter that can be imported (None, "
      "a bool, an int, a float, a str, or a tuple of numbers)",
      where, text));
}

// The sidecar of optim.json as PyTorch writes it, the JSON array
// json.dumps(optimizer.state_dict()["param_groups"]): each group's members
// but "params" are hyperparameters; "params" lists parameter IDs, ID i
// being the i-th parameter of the model's parameters() (ModelParamOrder).
// The state is optim.safetensors's: every "state.{fqn}.{state}" tensor, a
// value of parameter fqn (CheckOptimFitsModel has found its owner).
absl::StatusOr<OptimSidecar> SidecarFromPyTorch(
    const json& groups, const std::string& path, const SafetensorsReader& file,
    const ModelLayout& layout,
    const std::map<std::string, const ParamSpec*, std::less<>>& params) {
  const ModelSpec& spec = layout.spec();
  OptimSidecar out;
  for (const SafetensorsEntry& e : file.tensors()) {
    const StateOwner owner = *FindStateOwner(e.name, params);
    if (owner.fqn != owner.param->fqn) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "%s: tensor '%s' is state of '%s', which is tied to '%s' in model "
          "'%s': PyTorch keeps one state for a shared parameter, under its "
          "first name ('%s')",
          file.name(), e.name, owner.fqn, owner.param->fqn, spec.name,
          OptimStateTensorName(owner.param->fqn, owner.state)));
    }
    out.state[optim::ParamKey(owner.fqn)][owner.state] =
        SidecarValue{e.name, std::monostate()};
  }
  const std::vector<std::string> order = optim::ModelParamOrder(layout);
  for (size_t g = 0; g < groups.size(); ++g) {
    const json& group = groups[g];
    const std::string at = absl::StrFormat("%s: param_groups[%d]", path, g);
    if (!group.is_object()) {
      return absl::DataLossError(absl::StrCat(at, ": not a JSON object"));
    }
    auto ids = group.find("params");
    if (ids == group.end() || !ids->is_array()) {
      return absl::DataLossError(
          absl::StrCat(at, ": \"params\" is missing or not a list"));
    }
    optim::ParamGroup out_group;
    for (size_t i = 0; i < ids->size(); ++i) {
      const json& id = (*ids)[i];
      // FSDP.full_optim_state_dict lists parameter names (a shared
      // parameter under its first name); optimizer.state_dict() IDs.
      if (id.is_string()) {
        auto it = params.find(id.get<std::string>());
        if (it == params.end()) {
          return absl::FailedPreconditionError(absl::StrFormat(
              "%s.params[%d] is \"%s\", which is not a parameter of model "
              "'%s' (params are parameter names, as "
              "FSDP.full_optim_state_dict lists them, or IDs, as "
              "optimizer.state_dict() does)",
              at, i, id.get<std::string>(), spec.name));
        }
        out_group.params.push_back(it->second->fqn);
        continue;
      }
      if (!id.is_number_unsigned()) {
        return absl::DataLossError(absl::StrFormat(
            "%s.params[%d] is %s, neither a parameter ID (a non-negative "
            "integer) nor a parameter name",
            at, i, id.dump(-1, ' ', false, json::error_handler_t::replace)));
      }
      if (id.get<uint64_t>() >= order.size()) {
        return absl::FailedPreconditionError(absl::StrFormat(
            "%s.params[%d] is parameter ID %d, but model '%s' has %d "
            "parameters (IDs count its parameters() in order, each shared "
            "parameter once)",
            at, i, id.get<uint64_t>(), spec.name, order.size()));
      }
      out_group.params.push_back(order[id.get<uint64_t>()]);
    }
    for (const auto& [name, value] : group.items()) {
      if (name == "params") continue;
      FLATPARAM_ASSIGN_OR_RETURN(
          out_group.hyperparams[name],
          HyperFromJson(value, absl::StrCat(at, ".", name)));
    }
    out.param_groups.push_back(std::move(out_group));
  }
  return out;
}

}  // namespace

namespace internal_checkpoint {

// Whether a file of the input directory holds optimizer state: this
// project's pair (optim.safetensors, optim.json) or another tool's
// (optimizer.pt, optimizer.bin, optim.pt, optim_states.pt, ...).
bool IsOptimizerFileName(absl::string_view name) {
  return absl::StartsWith(name, kOptimizerFilePrefix) ||
         absl::StartsWith(name, "optim.") || absl::StartsWith(name, "optim_");
}

// The optimizer state of `dir` (optim.safetensors and optim.json, both
// present), planned for sharding as ShardCheckpoint plans a full
// checkpoint's. `file` receives the opened optim.safetensors, which the
// plan borrows.
absl::StatusOr<std::unique_ptr<FullOptimShards>> PlanOptimizerImport(
    FileSystem& fs, const std::string& dir, const ModelLayout& layout,
    std::optional<SafetensorsReader>& file, HfImportReport& report) {
  const ModelSpec& spec = layout.spec();
  // Every parameter name -> its parameter (the primary for a tied one).
  std::map<std::string, const ParamSpec*, std::less<>> params;
  for (const ParamSpec& p : spec.params) {
    params[p.fqn] = p.tied_to.empty() ? &p : params.at(p.tied_to);
  }
  FLATPARAM_ASSIGN_OR_RETURN(
      SafetensorsReader opened,
      SafetensorsReader::Open(fs, JoinPath(dir, kOptimFileName)));
  file.emplace(std::move(opened));
  FLATPARAM_RETURN_IF_ERROR(CheckOptimFitsModel(*file, spec, params));

  const std::string path = JoinPath(dir, kOptimJsonFileName);
  absl::StatusOr<std::string> text =
      ReadFileToString(fs, path, kMaxJsonFileBytes);
  if (!text.ok()) return absl::DataLossError(text.status().message());
  JsonParseOptions parse;
  parse.code = absl::StatusCode::kDataLoss;
  FLATPARAM_ASSIGN_OR_RETURN(const json doc, ParseJson(*text, path, parse));
  OptimSidecar sidecar;
  if (doc.is_array()) {
    FLATPARAM_ASSIGN_OR_RETURN(
        sidecar, SidecarFromPyTorch(doc, path, *file, layout, params));
  } else if (doc.is_object() && !doc.contains("format") &&
             doc.contains("param_groups")) {
    // {"param_groups": [...]} (and at most an empty "state": the tensors
    // are optim.safetensors's), as a state dict's JSON part is written.
    for (const auto& [key, value] : doc.items()) {
      if (key == "param_groups" ||
          (key == "state" && (value.empty() || value.is_null()))) {
        continue;
      }
      return absl::DataLossError(absl::StrFormat(
          "%s: unexpected \"%s\" beside \"param_groups\" (optim.json is "
          "the param groups of the optimizer's state dict, its state is "
          "optim.safetensors; or flatparam's \"format\": "
          "\"flatparam.optim.v1\" sidecar)",
          path, key));
    }
    if (!doc["param_groups"].is_array()) {
      return absl::DataLossError(
          absl::StrCat(path, ": \"param_groups\" is not a list"));
    }
    FLATPARAM_ASSIGN_OR_RETURN(
        sidecar,
        SidecarFromPyTorch(doc["param_groups"], path, *file, layout, params));
  } else {
    FLATPARAM_ASSIGN_OR_RETURN(sidecar, ParseOptimSidecar(doc, path));
  }
  report.optimizer = true;
  report.optimizer_params = static_cast<int64_t>(sidecar.state.size());
  report.optimizer_groups = static_cast<int64_t>(sidecar.param_groups.size());
  return FullOptimShards::Create(layout, sidecar, *file, path);
}

}  // namespace internal_checkpoint

std::string DescribeOptimizerImport(const HfImportReport& report) {
  if (!report.optimizer_left_behind.empty()) {
    return absl::StrCat("; optimizer state left behind (--weights-only): ",
                        absl::StrJoin(report.optimizer_left_behind, ", "));
  }
  if (!report.optimizer) return "";
  return absl::StrFormat(
      "; optimizer state of %d parameter%s in %d param group%s imported",
      report.optimizer_params, report.optimizer_params == 1 ? "" : "s",
      report.optimizer_groups, report.optimizer_groups == 1 ? "" : "s");
}

}  // namespace checkpoint
}  // namespace flatparam
