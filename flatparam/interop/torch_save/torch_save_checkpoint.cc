// torch_save.h, part 2: importing torch.save files into flatparam
// checkpoints (through the Hugging Face import) and exporting them.
#include <algorithm>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/checkpoint/checkpoint_dir.h"
#include "flatparam/checkpoint/safetensors.h"
#include "flatparam/checkpoint/training_state.h"
#include "flatparam/interop/internal/staging.h"
#include "flatparam/interop/torch_save/torch_save.h"

namespace flatparam {
namespace libtorch {
namespace {

using checkpoint::FileSystem;
using checkpoint::JoinPath;
using internal_torch::CheckDistinct;
using internal_torch::StagingDir;
using internal_torch::StagingPath;
using internal_torch::WithUserPaths;
using internal_torch::WriteSafetensorsFile;

// Writes one torch.save file's tensors as the safetensors file `staged`.
absl::Status StageFile(FileSystem& fs, const TorchStateDict& tensors,
                       const std::string& staged) {
  std::vector<checkpoint::TensorSource> sources;
  for (const auto& [name, t] : tensors) {
    sources.push_back(checkpoint::TensorSourceFromHostTensor(name, t));
  }
  return WriteSafetensorsFile(fs, staged, sources);
}

// Stages the torch.save checkpoint at `in` (a .bin file, an index, or a
// directory holding one of them) in `dir` as safetensors of the same
// form, one torch.save file in memory at a time. `renames` gets each
// staged path -> the user's path, for messages.
absl::Status StageWeights(FileSystem& fs, const std::string& in,
                          const std::string& dir,
                          std::map<std::string, std::string>& renames) {
  FLATPARAM_ASSIGN_OR_RETURN(bool exists, fs.Exists(in));
  if (!exists) {
    return absl::NotFoundError(
        absl::StrCat("no torch.save checkpoint at ", in));
  }
  FLATPARAM_ASSIGN_OR_RETURN(bool is_dir, fs.IsDirectory(in));
  std::string path = in;
  if (is_dir) {
    const std::string single = JoinPath(in, kTorchModelFileName);
    const std::string index = JoinPath(in, kTorchIndexFileName);
    FLATPARAM_ASSIGN_OR_RETURN(bool has_single, fs.Exists(single));
    FLATPARAM_ASSIGN_OR_RETURN(bool has_index, fs.Exists(index));
    if (has_single && has_index) {
      return absl::InvalidArgumentError(absl::StrCat(
          in, " holds both ", kTorchModelFileName, " and ", kTorchIndexFileName,
          ": ambiguous; name the file to import"));
    }
    if (!has_single && !has_index) {
      return absl::NotFoundError(absl::StrCat(in, " holds neither ",
                                              kTorchModelFileName, " nor ",
                                              kTorchIndexFileName));
    }
    path = has_single ? single : index;
  }
  if (!absl::EndsWith(path, ".json")) {
    FLATPARAM_ASSIGN_OR_RETURN(TorchStateDict tensors,
                               ReadTorchStateDict(fs, path));
    const std::string staged = JoinPath(dir, checkpoint::kModelFileName);
    renames[staged] = path;
    return StageFile(fs, tensors, staged);
  }

  // Index-sharded: file by file.
  FLATPARAM_ASSIGN_OR_RETURN(
      std::string text,
      checkpoint::ReadFileToString(fs, path, checkpoint::kMaxHfIndexBytes));
  nlohmann::json doc = nlohmann::json::parse(text, nullptr, false);
  if (doc.is_discarded() || !doc.is_object() || !doc.contains("weight_map") ||
      !doc["weight_map"].is_object()) {
    return absl::DataLossError(
        absl::StrCat(path, ": not a JSON object with a \"weight_map\" object"));
  }
  std::map<std::string, std::set<std::string>> by_file;
  for (const auto& [name, file] : doc["weight_map"].items()) {
    if (!file.is_string() || file.get<std::string>().empty() ||
        absl::StrContains(file.get<std::string>(), "/")) {
      return absl::DataLossError(absl::StrCat(path, ": weight_map[\"", name,
                                              "\"] is not a plain file name"));
    }
    by_file[file.get<std::string>()].insert(name);
  }
  const std::string user_dir = checkpoint::Dirname(path);
  nlohmann::json staged_map = nlohmann::json::object();
  uint64_t total = 0;
  int file_index = 0;
  for (const auto& [file, names] : by_file) {
    const std::string file_path = JoinPath(user_dir, file);
    FLATPARAM_ASSIGN_OR_RETURN(TorchStateDict part,
                               ReadTorchStateDict(fs, file_path));
    const std::string staged_name =
        absl::StrFormat("model-%05d-of-%05d.safetensors", ++file_index,
                        static_cast<int>(by_file.size()));
    std::set<std::string> held;
    for (const auto& [name, t] : part) {
      if (names.count(name) == 0) {
        return absl::DataLossError(absl::StrCat(file_path, " holds '", name,
                                                "', which ", path,
                                                " does not map to it"));
      }
      held.insert(name);
      total += t.nbytes();
      staged_map[name] = staged_name;
    }
    for (const std::string& name : names) {
      if (held.count(name) == 0) {
        return absl::DataLossError(absl::StrCat(
            path, " maps '", name, "' to ", file, ", which does not hold it"));
      }
    }
    const std::string staged = JoinPath(dir, staged_name);
    renames[staged] = file_path;
    FLATPARAM_RETURN_IF_ERROR(StageFile(fs, part, staged));
  }
  if (doc.contains("metadata") && doc["metadata"].is_object() &&
      doc["metadata"].contains("total_size")) {
    const nlohmann::json& ts = doc["metadata"]["total_size"];
    if (!ts.is_number_integer() || ts.get<uint64_t>() != total) {
      return absl::DataLossError(absl::StrCat(path, ": metadata.total_size is ",
                                              ts.dump(), ", the tensors hold ",
                                              total, " bytes"));
    }
  }
  nlohmann::json staged_index;
  staged_index["metadata"]["total_size"] = total;
  staged_index["weight_map"] = std::move(staged_map);
  const std::string staged = JoinPath(dir, checkpoint::kHfIndexFileName);
  renames[staged] = path;
  return checkpoint::WriteFileDurably(fs, staged, staged_index.dump(1));
}

// The optimizer state of `path`, keyed by name, as a full checkpoint's
// optim.safetensors + optim.json in `dir`.
absl::Status StageOptimizer(FileSystem& fs, const std::string& path,
                            const ModelSpec& spec,
                            const LayoutOptions& layout_options,
                            const std::string& dir) {
  FLATPARAM_ASSIGN_OR_RETURN(optim::OptimStateDict dict,
                             ReadTorchOptimStateDict(fs, path));
  bool has_ids = false;
  for (const auto& [key, ps] : dict.state) {
    has_ids |= std::holds_alternative<int64_t>(key);
  }
  for (const optim::ParamGroup& g : dict.param_groups) {
    for (const optim::ParamKey& k : g.params) {
      has_ids |= std::holds_alternative<int64_t>(k);
    }
  }
  if (has_ids) {
    FLATPARAM_ASSIGN_OR_RETURN(ModelLayout layout,
                               ModelLayout::Create(spec, layout_options));
    auto named = optim::RekeyOptimStateDict(
        dict, optim::OptimStateKeyType::kParamName, layout);
    if (!named.ok()) {
      return absl::Status(
          named.status().code(),
          absl::StrCat(path, ": parameter IDs: ", named.status().message()));
    }
    dict = *std::move(named);
  }
  checkpoint::OptimSidecar sidecar;
  std::vector<checkpoint::TensorSource> sources;
  for (const auto& [key, ps] : dict.state) {
    const auto* name = std::get_if<std::string>(&key);
    if (name == nullptr) {  // RekeyOptimStateDict renamed every ID
      return absl::InternalError(absl::StrCat(
          path, ": state key ", optim::DescribeKey(key), " left unnamed"));
    }
    const std::string& fqn = *name;
    auto& out = sidecar.state[key];
    for (const auto& [name, value] : ps) {
      checkpoint::SidecarValue sv;
      if (const auto* t = std::get_if<HostTensor>(&value)) {
        sv.tensor = checkpoint::OptimStateTensorName(fqn, name);
        sources.push_back(
            checkpoint::TensorSourceFromHostTensor(*sv.tensor, *t));
      } else {
        sv.value = value;
      }
      out.emplace(name, std::move(sv));
    }
  }
  sidecar.param_groups = dict.param_groups;
  FLATPARAM_ASSIGN_OR_RETURN(nlohmann::json json,
                             checkpoint::OptimSidecarToJson(sidecar, false));
  // The tensors point into `dict`, alive until here.
  FLATPARAM_RETURN_IF_ERROR(WriteSafetensorsFile(
      fs, JoinPath(dir, checkpoint::kOptimFileName), sources));
  return checkpoint::WriteFileDurably(
      fs, JoinPath(dir, checkpoint::kOptimJsonFileName), json.dump(1));
}

// pytorch_model[-i-of-n].bin for model[-i-of-n].safetensors.
std::string TorchFileName(absl::string_view hf_name) {
  std::string name(hf_name);
  if (absl::StartsWith(name, "model")) name = "pytorch_model" + name.substr(5);
  if (absl::EndsWith(name, ".safetensors")) {
    name = name.substr(0, name.size() - 12) + ".bin";
  }
  return name;
}

// `dict` (keyed by name) with every group's parameters in `order` (names
// not in it after, as they were), keyed by ID -- a name's index in `order`
// -- when `by_id`.
optim::OptimStateDict InModelOrder(const optim::OptimStateDict& dict,
                                   const std::vector<std::string>& order,
                                   bool by_id) {
  std::map<optim::ParamKey, int64_t> ids;
  for (size_t i = 0; i < order.size(); ++i) {
    ids.emplace(order[i], static_cast<int64_t>(i));
  }
  auto rekey = [&](const optim::ParamKey& k) -> optim::ParamKey {
    auto it = ids.find(k);
    return by_id && it != ids.end() ? optim::ParamKey(it->second) : k;
  };
  optim::OptimStateDict out;
  for (const optim::ParamGroup& g : dict.param_groups) {
    std::vector<optim::ParamKey> params = g.params;
    std::stable_sort(
        params.begin(), params.end(),
        [&](const optim::ParamKey& a, const optim::ParamKey& b) {
          auto ia = ids.find(a);
          auto ib = ids.find(b);
          const size_t ra = ia == ids.end() ? order.size() : ia->second;
          const size_t rb = ib == ids.end() ? order.size() : ib->second;
          return ra < rb;
        });
    optim::ParamGroup ng;
    ng.hyperparams = g.hyperparams;
    for (const optim::ParamKey& k : params) ng.params.push_back(rekey(k));
    out.param_groups.push_back(std::move(ng));
  }
  for (const auto& [k, ps] : dict.state) out.state[rekey(k)] = ps;
  return out;
}

}  // namespace

absl::StatusOr<checkpoint::HfImportReport> ImportTorchCheckpoint(
    FileSystem& fs, const std::string& in, const ModelSpec& spec,
    const LayoutOptions& layout_options, int64_t world_size,
    const std::string& out_dir, const TorchImportOptions& options) {
  FLATPARAM_RETURN_IF_ERROR(CheckDistinct(in, out_dir));
  if (!options.optimizer.empty()) {
    FLATPARAM_RETURN_IF_ERROR(CheckDistinct(options.optimizer, out_dir));
  }
  StagingDir staging(fs, StagingPath(out_dir, "torch-import"));
  FLATPARAM_RETURN_IF_ERROR(staging.Create());
  std::map<std::string, std::string> renames;
  FLATPARAM_RETURN_IF_ERROR(StageWeights(fs, in, staging.path(), renames));
  if (!options.optimizer.empty()) {
    FLATPARAM_RETURN_IF_ERROR(StageOptimizer(fs, options.optimizer, spec,
                                             layout_options, staging.path()));
  }
  checkpoint::HfImportOptions hf = options.hf;
  hf.weights_only = false;
  auto report = checkpoint::ImportHfCheckpoint(
      fs, staging.path(), spec, layout_options, world_size, out_dir, hf);
  if (!report.ok()) {
    // The staged files are gone: name the user's files instead.
    const std::string& st = staging.path();
    const std::string& opt = options.optimizer;
    renames[JoinPath(st, checkpoint::kOptimFileName)] = opt;
    renames[JoinPath(st, checkpoint::kOptimJsonFileName)] = opt;
    renames[st] = in;
    return WithUserPaths(
        report.status(), renames,
        absl::StrCat("importing ", in, opt.empty() ? "" : " and ", opt));
  }
  return report;
}

absl::StatusOr<TorchExportReport> ExportTorchCheckpoint(
    FileSystem& fs, const std::string& in_dir, const std::string& out_dir,
    const TorchExportOptions& options) {
  FLATPARAM_RETURN_IF_ERROR(CheckDistinct(in_dir, out_dir));
  FLATPARAM_ASSIGN_OR_RETURN(bool out_exists, fs.Exists(out_dir));
  if (out_exists && !options.convert.overwrite) {
    return absl::FailedPreconditionError(
        absl::StrCat(out_dir, " exists; set overwrite to replace it"));
  }
  StagingDir hf_dir(fs, StagingPath(out_dir, "torch-export-hf"));
  checkpoint::HfExportOptions hf;
  hf.convert = options.convert;
  hf.convert.overwrite = true;
  hf.convert.outcome = nullptr;
  hf.max_shard_bytes = options.max_shard_bytes;
  hf.dtype = options.dtype;
  FLATPARAM_ASSIGN_OR_RETURN(
      checkpoint::HfExportReport hf_report,
      checkpoint::ExportHfCheckpoint(fs, in_dir, hf_dir.path(), hf));

  StagingDir staging(fs, StagingPath(out_dir, "torch-export"));
  FLATPARAM_RETURN_IF_ERROR(staging.Create());
  // The model's tied names (tied name, target), from the sharded
  // checkpoint's layout or the caller's model.
  std::vector<std::pair<std::string, std::string>> ties;
  {
    std::optional<ModelSpec> spec = options.model;
    if (!spec.has_value()) {
      absl::StatusOr<checkpoint::ShardedCheckpointReader> sharded =
          checkpoint::ShardedCheckpointReader::Open(fs, in_dir);
      if (sharded.ok()) spec = sharded->layout().spec();
    }
    if (spec.has_value()) {
      for (const ParamSpec& p : spec->params) {
        if (!p.tied_to.empty()) ties.emplace_back(p.fqn, p.tied_to);
      }
    }
  }
  TorchExportReport report;
  report.tensors = hf_report.tensors;
  report.total_size = hf_report.total_size;
  for (const std::string& file : hf_report.files) {
    const std::string name = checkpoint::Basename(file);
    const std::string src = JoinPath(hf_dir.path(), name);
    const std::string dst = JoinPath(staging.path(), TorchFileName(name));
    if (name == checkpoint::kHfIndexFileName) {
      FLATPARAM_ASSIGN_OR_RETURN(
          std::string text,
          checkpoint::ReadFileToString(fs, src, checkpoint::kMaxHfIndexBytes));
      nlohmann::json doc = nlohmann::json::parse(text);
      for (auto& [tensor, f] : doc["weight_map"].items()) {
        f = TorchFileName(f.get<std::string>());
      }
      for (const auto& [name, target] : ties) {
        if (doc["weight_map"].contains(target)) {
          doc["weight_map"][name] = doc["weight_map"][target];
        }
      }
      FLATPARAM_RETURN_IF_ERROR(checkpoint::WriteFileDurably(
          fs, JoinPath(staging.path(), kTorchIndexFileName),
          doc.dump(2) + "\n"));
      report.files.push_back(kTorchIndexFileName);
      continue;
    }
    FLATPARAM_ASSIGN_OR_RETURN(checkpoint::SafetensorsReader reader,
                               checkpoint::SafetensorsReader::Open(fs, src));
    TorchStateDict tensors;
    std::set<std::string> here;
    for (const checkpoint::SafetensorsEntry& e : reader.tensors()) {
      FLATPARAM_ASSIGN_OR_RETURN(HostTensor t, reader.ReadHostTensor(e.name));
      tensors.emplace_back(e.name, std::move(t));
      here.insert(e.name);
    }
    std::vector<std::pair<std::string, std::string>> tied_here;
    for (const auto& tie : ties) {
      if (here.count(tie.second) > 0 && here.count(tie.first) == 0) {
        tied_here.push_back(tie);
      }
    }
    FLATPARAM_RETURN_IF_ERROR(WriteTorchStateDict(fs, dst, tensors, tied_here));
    report.files.push_back(TorchFileName(name));
  }

  if (options.optimizer) {
    StagingDir full_dir(fs, StagingPath(out_dir, "torch-export-full"));
    std::vector<std::string> order = options.param_order;
    std::optional<ModelLayout> sharded;
    FLATPARAM_ASSIGN_OR_RETURN(
        checkpoint::FullCheckpointReader reader,
        internal_torch::OpenAsFull(fs, in_dir, full_dir, options.convert,
                                   &sharded));
    if (order.empty() && sharded.has_value()) {
      order = optim::ModelParamOrder(*sharded);
    }
    FLATPARAM_ASSIGN_OR_RETURN(checkpoint::FullState state,
                               checkpoint::ReadFullState(reader));
    if (!state.optim.empty()) {
      if (order.empty()) {  // a full checkpoint: its groups' order
        std::set<std::string> seen;
        for (const optim::ParamGroup& g : state.optim.param_groups) {
          for (const optim::ParamKey& k : g.params) {
            const auto* name = std::get_if<std::string>(&k);
            if (name != nullptr && seen.insert(*name).second) {
              order.push_back(*name);
            }
          }
        }
      }
      const optim::OptimStateDict dict = InModelOrder(
          state.optim, order,
          options.optimizer_keys == optim::OptimStateKeyType::kParamId);
      FLATPARAM_RETURN_IF_ERROR(WriteTorchOptimStateDict(
          fs, JoinPath(staging.path(), kTorchOptimFileName), dict));
      report.files.push_back(kTorchOptimFileName);
      report.optimizer = true;
    }
  }
  FLATPARAM_RETURN_IF_ERROR(
      internal_torch::PublishStaged(fs, staging, out_dir, out_exists));
  return report;
}

}  // namespace libtorch
}  // namespace flatparam
