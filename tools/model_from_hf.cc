#include "tools/model_from_hf.h"

#include <algorithm>
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "flatparam/base/json_limits.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/interop/hf/hf_checkpoint.h"
#include "flatparam/layout.h"
#include "flatparam/model_json.h"
#include "flatparam/presets.h"
#include "tools/paths.h"

namespace flatparam {
namespace tools {
namespace {

using json = nlohmann::json;

// config.json files are a few KiB; this bounds a hostile one.
constexpr uint64_t kMaxConfigBytes = uint64_t{16} << 20;

bool IsNumber(absl::string_view s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), absl::ascii_isdigit);
}

// "" , ".a", "a..b" are not dotted names.
bool IsDottedName(absl::string_view name) {
  for (absl::string_view part : absl::StrSplit(name, '.')) {
    if (part.empty()) return false;
  }
  return true;
}

// The rank of each module or parameter name among its siblings in a model
// whose parameters come in module order, keyed by its path with every
// number replaced by "#" (".model.layers.#.mlp").
class OrderTemplate {
 public:
  explicit OrderTemplate(const ModelSpec* spec) {
    if (spec == nullptr) return;
    absl::flat_hash_map<std::string, int> children;
    for (const ParamSpec& p : spec->params) {
      std::string key;
      for (absl::string_view part : absl::StrSplit(p.fqn, '.')) {
        const std::string parent = key;
        absl::StrAppend(&key, ".", IsNumber(part) ? "#" : part);
        if (!rank_.contains(key)) rank_[key] = children[parent]++;
      }
    }
  }

  std::optional<int> Rank(const std::string& key) const {
    auto it = rank_.find(key);
    if (it == rank_.end()) return std::nullopt;
    return it->second;
  }

 private:
  absl::flat_hash_map<std::string, int> rank_;
};

// One component's place among its siblings: known to the template (by
// rank) before unknown; numbers (by value) before other names (by bytes).
using ComponentKey = std::tuple<int, int, int, size_t, std::string>;

std::vector<ComponentKey> SortKey(const std::string& name,
                                  const OrderTemplate& order) {
  std::vector<ComponentKey> key;
  std::string path;
  for (absl::string_view part : absl::StrSplit(name, '.')) {
    const bool number = IsNumber(part);
    absl::StrAppend(&path, ".", number ? "#" : part);
    const std::optional<int> rank = order.Rank(path);
    std::string text(part);
    size_t length = 0;
    if (number) {
      const size_t first = std::min(text.find_first_not_of('0'), text.size());
      text.erase(0, first);
      length = text.size();
    }
    key.emplace_back(rank.has_value() ? 0 : 1, rank.value_or(0), number ? 0 : 1,
                     length, std::move(text));
  }
  return key;
}

std::string Quoted(absl::string_view s) { return absl::StrCat("\"", s, "\""); }

// A JSON value on one line, arrays as [a, b].
std::string Compact(const json& j) {
  if (!j.is_array()) return j.dump();
  std::vector<std::string> items;
  for (const json& item : j) items.push_back(Compact(item));
  return absl::StrCat("[", absl::StrJoin(items, ", "), "]");
}

// The name of the directory `dir`: the last component of its absolute path
// (so "." names the working directory).
std::string DirectoryName(const std::string& dir) {
  const std::string name = checkpoint::Basename(AbsolutePath(dir));
  return name.empty() || name == "/" ? "model" : name;
}

struct HfConfig {
  std::string architecture;
  std::optional<bool> tie_word_embeddings;
};

// What config.json next to the checkpoint says, if it is there.
absl::StatusOr<std::optional<HfConfig>> ReadConfig(checkpoint::FileSystem& fs,
                                                   const std::string& dir) {
  const std::string path = checkpoint::JoinPath(dir, "config.json");
  FLATPARAM_ASSIGN_OR_RETURN(const bool exists, fs.Exists(path));
  if (!exists) return std::nullopt;
  FLATPARAM_ASSIGN_OR_RETURN(
      const std::string text,
      checkpoint::ReadFileToString(fs, path, kMaxConfigBytes));
  FLATPARAM_ASSIGN_OR_RETURN(const json doc, ParseJson(text, path));
  if (!doc.is_object()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: expected a JSON object, got %s", path, doc.type_name()));
  }
  HfConfig config;
  auto arch = doc.find("architectures");
  if (arch != doc.end() && arch->is_array() && !arch->empty() &&
      (*arch)[0].is_string()) {
    config.architecture = (*arch)[0].get<std::string>();
  }
  auto tie = doc.find("tie_word_embeddings");
  if (tie != doc.end() && tie->is_boolean()) {
    config.tie_word_embeddings = tie->get<bool>();
  }
  return config;
}

}  // namespace

std::vector<std::string> OrderNames(std::vector<std::string> names,
                                    const ModelSpec* order_template) {
  const OrderTemplate order(order_template);
  std::vector<std::pair<std::vector<ComponentKey>, std::string>> keyed;
  keyed.reserve(names.size());
  for (std::string& name : names) {
    keyed.emplace_back(SortKey(name, order), std::move(name));
  }
  std::stable_sort(keyed.begin(), keyed.end());
  std::vector<std::string> out;
  out.reserve(keyed.size());
  for (auto& [key, name] : keyed) out.push_back(std::move(name));
  return out;
}

std::string ArchitectureTemplate(absl::string_view architecture) {
  if (architecture == "LlamaForCausalLM" ||
      architecture == "MistralForCausalLM" ||
      architecture == "Qwen2ForCausalLM") {
    return "llama2-7b-hf";
  }
  if (architecture == "GPT2LMHeadModel") return "gpt2";
  return "";
}

std::optional<std::string> DefaultWrapGlob(const std::vector<ParamSpec>& params,
                                           std::string* why) {
  std::vector<std::string> lists;
  absl::flat_hash_map<std::string, absl::flat_hash_set<std::string>> members;
  for (const ParamSpec& p : params) {
    const std::vector<absl::string_view> parts = absl::StrSplit(p.fqn, '.');
    for (size_t i = 0; i + 1 < parts.size(); ++i) {
      if (!IsNumber(parts[i])) continue;
      const std::string list =
          absl::StrJoin(parts.begin(), parts.begin() + i, ".");
      if (!members.contains(list)) lists.push_back(list);
      members[list].insert(std::string(parts[i]));
      break;
    }
  }
  std::string found;
  std::optional<std::string> glob;
  if (lists.empty()) {
    found = "no numbered module list";
  } else if (lists.size() == 1 && !lists[0].empty()) {
    found = absl::StrFormat("the one numbered module list, %d modules",
                            members[lists[0]].size());
    glob = lists[0] + ".*";
  } else {
    std::vector<std::string> shown;
    for (size_t i = 0; i < lists.size() && i < 5; ++i) {
      shown.push_back(lists[i].empty() ? "<root>" : lists[i]);
    }
    if (lists.size() > shown.size()) shown.push_back("...");
    found = absl::StrFormat("%d numbered module list%s: %s", lists.size(),
                            lists.size() == 1 ? "" : "s",
                            absl::StrJoin(shown, ", "));
  }
  if (why != nullptr) *why = found;
  return glob;
}

absl::StatusOr<std::vector<std::string>> ParseWrapList(absl::string_view text) {
  std::vector<std::string> out;
  if (absl::StripAsciiWhitespace(text).empty()) return out;
  for (absl::string_view entry : absl::StrSplit(text, ',')) {
    entry = absl::StripAsciiWhitespace(entry);
    if (!IsDottedName(entry)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "--wrap=%s: entry \"%s\" is not a module prefix or glob such as "
          "\"model.layers.*\" (entries are comma-separated; --wrap= for "
          "none)",
          text, entry));
    }
    out.emplace_back(entry);
  }
  return out;
}

absl::StatusOr<HfModel> ModelFromHfCheckpoint(checkpoint::FileSystem& fs,
                                              const HfModelOptions& options) {
  FLATPARAM_ASSIGN_OR_RETURN(
      checkpoint::HfCheckpointReader reader,
      checkpoint::HfCheckpointReader::Open(fs, options.from));
  HfModel model;
  model.dir = reader.dir();
  model.files = static_cast<int64_t>(reader.files().size());
  FLATPARAM_ASSIGN_OR_RETURN(const std::optional<HfConfig> config,
                             ReadConfig(fs, reader.dir()));

  const std::vector<std::string> ignored_suffixes =
      checkpoint::HfImportOptions().ignored_suffixes;
  std::vector<std::string> names;
  for (const auto& [name, tensor] : reader.tensors()) {
    if (std::any_of(ignored_suffixes.begin(), ignored_suffixes.end(),
                    [&](const std::string& suffix) {
                      return absl::EndsWith(name, suffix);
                    })) {
      ++model.ignored;
      continue;
    }
    if (!IsDottedName(name)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: tensor \"%s\" is not a dotted parameter name, so it cannot be "
          "a parameter of a model file",
          reader.dir(), tensor.stored_name));
    }
    names.push_back(name);
  }

  std::optional<ModelSpec> order_template;
  const std::string architecture =
      config.has_value() ? config->architecture : "";
  const std::string preset = ArchitectureTemplate(architecture);
  if (!preset.empty()) {
    FLATPARAM_ASSIGN_OR_RETURN(order_template, PresetModel(preset));
    model.order_note = absl::StrFormat(
        "%s's module order (config.json's architecture; the %s preset's), "
        "numbered modules by number, names it lacks after the others by name",
        architecture, preset);
  } else {
    model.order_note = absl::StrFormat(
        "by name, numbered modules by number (%s)",
        !config.has_value() ? "no config.json"
        : architecture.empty()
            ? "config.json names no architecture"
            : absl::StrFormat("config.json's architecture %s has no "
                              "known module order",
                              architecture));
  }
  for (std::string& name :
       OrderNames(std::move(names),
                  order_template.has_value() ? &*order_template : nullptr)) {
    const checkpoint::HfCheckpointReader::Tensor& t = reader.tensors().at(name);
    ParamSpec p;
    p.fqn = std::move(name);
    p.shape = t.shape;
    p.dtype = t.dtype;
    model.spec.params.push_back(std::move(p));
  }
  model.spec.name = DirectoryName(reader.dir());

  if (config.has_value() && config->tie_word_embeddings == true) {
    const bool has_head = reader.tensors().count("lm_head.weight") != 0;
    model.tie_note =
        has_head
            ? "config.json ties the word embeddings, but the files hold "
              "lm_head.weight: it is a parameter of its own here"
            : "config.json ties the word embeddings and the files hold no "
              "lm_head.weight: the model file lists none (a tied parameter "
              "takes no room in a flat parameter)";
  }

  if (options.wrap.has_value()) {
    model.spec.wrap = *options.wrap;
    model.wrap_note = absl::StrFormat(
        "--wrap=%s%s", absl::StrJoin(*options.wrap, ","),
        options.wrap->empty() ? " (none: the root is the only unit)" : "");
  } else {
    std::string why;
    std::optional<std::string> glob = DefaultWrapGlob(model.spec.params, &why);
    if (glob.has_value()) {
      model.spec.wrap.push_back(*glob);
      model.wrap_note = absl::StrFormat(
          "default --wrap=%s (%s); give --wrap to choose, --wrap= for none",
          *glob, why);
    } else {
      model.wrap_note = absl::StrFormat(
          "none by default (%s): the root is the only unit; give --wrap", why);
    }
  }

  absl::StatusOr<ModelLayout> layout =
      ModelLayout::Create(model.spec, LayoutOptions());
  if (!layout.ok()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "the model of %s with %s%s does not lay out: %s", reader.dir(),
        options.wrap.has_value() ? "--wrap=" : "the default --wrap=",
        absl::StrJoin(model.spec.wrap, ","), layout.status().message()));
  }
  model.units = static_cast<int64_t>(layout->flat_params().size());
  model.numel = layout->param_numel();

  // The file must import the checkpoint it was made from.
  const absl::StatusOr<checkpoint::HfImportReport> fits =
      checkpoint::CheckHfCheckpointFits(reader, model.spec);
  if (!fits.ok()) {
    return absl::InternalError(
        absl::StrFormat("the model made from %s does not fit it: %s",
                        reader.dir(), fits.status().message()));
  }
  return model;
}

std::string ModelFileText(const ModelSpec& spec) {
  const json doc = ModelSpecToJson(spec);
  std::string text =
      absl::StrCat("{\n  \"name\": ", doc["name"].dump(), ",\n  \"params\": [");
  const json& params = doc["params"];
  for (size_t i = 0; i < params.size(); ++i) {
    std::vector<std::string> fields;
    for (const char* key :
         {"fqn", "tied_to", "shape", "dtype", "requires_grad"}) {
      if (params[i].contains(key)) {
        fields.push_back(
            absl::StrCat(Quoted(key), ": ", Compact(params[i][key])));
      }
    }
    absl::StrAppend(&text, i == 0 ? "\n" : ",\n", "    {",
                    absl::StrJoin(fields, ", "), "}");
  }
  absl::StrAppend(&text, params.empty() ? "],\n" : "\n  ],\n",
                  "  \"wrap\": ", Compact(doc["wrap"]), "\n}\n");
  return text;
}

absl::Status ValidateModelCommand(const ModelCommand& c) {
  if (c.from.empty()) {
    return absl::InvalidArgumentError(
        "model needs --from=DIR, a Hugging Face checkpoint");
  }
  if (c.wrap.has_value()) {
    FLATPARAM_RETURN_IF_ERROR(ParseWrapList(*c.wrap).status());
  }
  if (c.overwrite && c.out.empty()) {
    return absl::InvalidArgumentError(
        "model takes --overwrite only with --out (stdout is never refused)");
  }
  return absl::OkStatus();
}

absl::Status RunModel(const ModelCommand& c, std::ostream& out,
                      std::ostream& log) {
  checkpoint::FileSystem& fs = checkpoint::PosixFileSystem();
  if (!c.out.empty()) {
    FLATPARAM_ASSIGN_OR_RETURN(const bool exists, fs.Exists(c.out));
    if (exists) {
      FLATPARAM_ASSIGN_OR_RETURN(const bool is_dir, fs.IsDirectory(c.out));
      if (is_dir) {
        return absl::FailedPreconditionError(absl::StrFormat(
            "--out=%s is a directory; give the model file's path", c.out));
      }
      if (!c.overwrite) {
        return absl::FailedPreconditionError(absl::StrFormat(
            "--out=%s exists; pass --overwrite to replace it, or choose "
            "another path",
            c.out));
      }
    }
  }
  HfModelOptions options;
  options.from = c.from;
  if (c.wrap.has_value()) {
    FLATPARAM_ASSIGN_OR_RETURN(options.wrap, ParseWrapList(*c.wrap));
  }
  FLATPARAM_ASSIGN_OR_RETURN(const HfModel model,
                             ModelFromHfCheckpoint(fs, options));
  const std::string text = ModelFileText(model.spec);
  if (absl::Status s = ParseModelSpecJson(text, "<model file>").status();
      !s.ok()) {
    return absl::InternalError(
        absl::StrCat("the model file written for ", model.dir,
                     " does not read back: ", s.message()));
  }

  std::string written = "stdout";
  if (c.out.empty()) {
    out << text;
    out.flush();
    if (!out.good()) return absl::DataLossError("cannot write to stdout");
  } else {
    const std::string tmp = c.out + ".tmp";
    absl::Status s = checkpoint::WriteFileDurably(fs, tmp, text);
    if (s.ok()) s = fs.Rename(tmp, c.out);
    if (!s.ok()) {
      fs.RemoveFile(tmp).IgnoreError();
      return s;
    }
    FLATPARAM_RETURN_IF_ERROR(fs.SyncDir(checkpoint::Dirname(c.out)));
    written = AbsolutePath(c.out);
  }

  log << "fsdp model: order: " << model.order_note
      << ". A reconstruction: the layout, and every checkpoint sharded with "
         "this file, depends on it\n";
  log << "fsdp model: wrap: " << model.wrap_note << "\n";
  if (!model.tie_note.empty()) log << "fsdp model: " << model.tie_note << "\n";
  log << absl::StrFormat(
      "fsdp model: wrote %s: model \"%s\", %d parameters (%d elements) in %d "
      "unit%s, from %d Hugging Face file%s of %s (%d buffer%s skipped)\n",
      written, model.spec.name, model.spec.params.size(), model.numel,
      model.units, model.units == 1 ? "" : "s", model.files,
      model.files == 1 ? "" : "s", model.dir, model.ignored,
      model.ignored == 1 ? "" : "s");
  log.flush();
  return absl::OkStatus();
}

}  // namespace tools
}  // namespace flatparam
