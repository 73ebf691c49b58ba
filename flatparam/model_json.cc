#include "flatparam/model_json.h"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "flatparam/base/dtype.h"
#include "flatparam/base/json_limits.h"
#include "flatparam/base/shape.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/presets.h"

namespace flatparam {
namespace {

using json = nlohmann::json;

// Bounds every element count so that later padding and byte arithmetic in
// int64 cannot overflow.
constexpr int64_t kMaxModelNumel = int64_t{1} << 56;

// A short rendering of a JSON value for "got ..." in messages.
std::string Describe(const json& j) {
  std::string s = j.dump(-1, ' ', false, json::error_handler_t::replace);
  if (s.size() > 40) s = s.substr(0, 37) + "...";
  return absl::StrCat(j.type_name(), " ", s);
}

// Builds the schema errors of one document: "<source>: <path>: <what>".
class SchemaErrors {
 public:
  explicit SchemaErrors(absl::string_view source) : source_(source) {}

  absl::Status Error(absl::string_view path, absl::string_view what) const {
    return absl::InvalidArgumentError(
        absl::StrCat(source_, ": ", path, ": ", what));
  }
  absl::Status Expected(absl::string_view path, absl::string_view expected,
                        const json& got) const {
    return Error(path,
                 absl::StrCat("expected ", expected, ", got ", Describe(got)));
  }

  // Rejects keys of `object` outside `allowed`.
  absl::Status CheckKeys(absl::string_view path, const json& object,
                         const std::vector<std::string>& allowed) const {
    for (auto it = object.begin(); it != object.end(); ++it) {
      bool known = false;
      for (const std::string& a : allowed) known = known || a == it.key();
      if (!known) {
        return Error(path,
                     absl::StrFormat("unknown key \"%s\" (allowed keys: %s)",
                                     it.key(), absl::StrJoin(allowed, ", ")));
      }
    }
    return absl::OkStatus();
  }

  absl::StatusOr<std::string> String(absl::string_view path,
                                     const json& j) const {
    if (!j.is_string()) return Expected(path, "a string", j);
    return j.get<std::string>();
  }

  absl::StatusOr<int64_t> NonNegativeInt(absl::string_view path,
                                         const json& j) const {
    if (!j.is_number_unsigned() ||
        j.get<uint64_t>() >
            static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return Expected(path, "a non-negative integer", j);
    }
    return static_cast<int64_t>(j.get<uint64_t>());
  }

 private:
  std::string source_;
};

// "emb.weight" and "seq.0.bias" are module paths; "", ".a", "a..b" are not.
bool IsDottedName(const std::string& name) {
  for (absl::string_view part : absl::StrSplit(name, '.')) {
    if (part.empty()) return false;
  }
  return true;
}

// The fields a parameter entry may carry besides its name and tie, each as
// the entry gives it (absent: not given).
struct ParamFields {
  std::optional<std::vector<int64_t>> shape;
  std::optional<DType> dtype;
  std::optional<bool> requires_grad;
};

absl::StatusOr<ParamFields> ParseFields(const SchemaErrors& errors,
                                        const std::string& path,
                                        const std::string& fqn, const json& j,
                                        int64_t* model_numel) {
  ParamFields f;
  if (j.contains("shape")) {
    const json& shape = j["shape"];
    if (!shape.is_array()) {
      return errors.Expected(path + ".shape", "an array of integers", shape);
    }
    f.shape.emplace();
    int64_t numel = 1;
    for (size_t d = 0; d < shape.size(); ++d) {
      FLATPARAM_ASSIGN_OR_RETURN(
          int64_t dim, errors.NonNegativeInt(
                           absl::StrCat(path, ".shape[", d, "]"), shape[d]));
      f.shape->push_back(dim);
      if (dim > 0 && numel > kMaxModelNumel / dim) {
        return errors.Error(path + ".shape",
                            absl::StrFormat("parameter \"%s\" has more than "
                                            "%d elements",
                                            fqn, kMaxModelNumel));
      }
      numel *= dim;
    }
    *model_numel += numel;
    if (*model_numel > kMaxModelNumel) {
      return errors.Error(path, absl::StrFormat("the model has more than %d "
                                                "elements",
                                                kMaxModelNumel));
    }
  }
  if (j.contains("dtype")) {
    FLATPARAM_ASSIGN_OR_RETURN(std::string name,
                               errors.String(path + ".dtype", j["dtype"]));
    absl::StatusOr<DType> dtype = ParseDType(name);
    if (!dtype.ok()) {
      return errors.Error(path + ".dtype", dtype.status().message());
    }
    f.dtype = *dtype;
  }
  if (j.contains("requires_grad")) {
    const json& rg = j["requires_grad"];
    if (!rg.is_boolean()) {
      return errors.Expected(path + ".requires_grad", "true or false", rg);
    }
    f.requires_grad = rg.get<bool>();
  }
  return f;
}

// A parameter entry. A tied one's own fields, which exporters repeat from
// the tie's target, go to `tied_fields` for CheckTiedFields.
absl::StatusOr<ParamSpec> ParseParam(const SchemaErrors& errors,
                                     const std::string& path, const json& j,
                                     int64_t* model_numel,
                                     ParamFields* tied_fields) {
  if (!j.is_object()) return errors.Expected(path, "an object", j);
  FLATPARAM_RETURN_IF_ERROR(errors.CheckKeys(
      path, j, {"fqn", "shape", "dtype", "requires_grad", "tied_to"}));
  ParamSpec p;
  if (!j.contains("fqn")) return errors.Error(path, "missing key \"fqn\"");
  FLATPARAM_ASSIGN_OR_RETURN(p.fqn, errors.String(path + ".fqn", j["fqn"]));
  if (!IsDottedName(p.fqn)) {
    return errors.Error(
        path + ".fqn",
        absl::StrFormat("\"%s\" is not a dotted parameter name", p.fqn));
  }
  if (j.contains("tied_to")) {
    FLATPARAM_ASSIGN_OR_RETURN(p.tied_to,
                               errors.String(path + ".tied_to", j["tied_to"]));
    if (p.tied_to.empty()) {
      return errors.Error(path + ".tied_to", "expected a parameter name");
    }
    // A tied parameter shares its target's storage: its elements are not
    // counted again.
    int64_t not_counted = 0;
    FLATPARAM_ASSIGN_OR_RETURN(
        *tied_fields, ParseFields(errors, path, p.fqn, j, &not_counted));
    return p;
  }
  if (!j.contains("shape")) {
    return errors.Error(path, absl::StrFormat("parameter \"%s\" is missing "
                                              "\"shape\" ([] for a scalar)",
                                              p.fqn));
  }
  FLATPARAM_ASSIGN_OR_RETURN(ParamFields f,
                             ParseFields(errors, path, p.fqn, j, model_numel));
  p.shape = *std::move(f.shape);
  if (f.dtype.has_value()) p.dtype = *f.dtype;
  if (f.requires_grad.has_value()) p.requires_grad = *f.requires_grad;
  return p;
}

// A tied parameter may repeat its target's shape, dtype and requires_grad
// (as exporters write it); each one given must equal the target's. The
// target must then be an earlier parameter (ModelLayout::Create reports a
// missing one otherwise).
absl::Status CheckTiedFields(const SchemaErrors& errors,
                             const std::string& path, const ParamSpec& tied,
                             const ParamFields& f,
                             const std::vector<ParamSpec>& earlier) {
  if (!f.shape.has_value() && !f.dtype.has_value() &&
      !f.requires_grad.has_value()) {
    return absl::OkStatus();
  }
  const ParamSpec* target = nullptr;
  for (const ParamSpec& e : earlier) {
    if (e.fqn == tied.tied_to) target = &e;
  }
  // Follow a chain of ties to the parameter that holds the tensor.
  for (int hops = 0; target != nullptr && !target->tied_to.empty() &&
                     hops < static_cast<int>(earlier.size());
       ++hops) {
    const ParamSpec* next = nullptr;
    for (const ParamSpec& e : earlier) {
      if (e.fqn == target->tied_to) next = &e;
    }
    target = next;
  }
  if (target == nullptr) {
    return errors.Error(
        path, absl::StrFormat("tied parameter \"%s\" repeats shape, dtype "
                              "or requires_grad, but \"%s\" is not an "
                              "earlier parameter to check them against",
                              tied.fqn, tied.tied_to));
  }
  const auto differs = [&](absl::string_view key, const std::string& mine,
                           const std::string& theirs) {
    return errors.Error(
        path, absl::StrFormat("tied parameter \"%s\" has %s %s, but \"%s\", "
                              "whose tensor it shares, has %s",
                              tied.fqn, key, mine, target->fqn, theirs));
  };
  if (f.shape.has_value() && *f.shape != target->shape) {
    return differs("shape", ShapeString(*f.shape), ShapeString(target->shape));
  }
  if (f.dtype.has_value() && *f.dtype != target->dtype) {
    return differs("dtype", std::string(DTypeName(*f.dtype)),
                   std::string(DTypeName(target->dtype)));
  }
  if (f.requires_grad.has_value() &&
      *f.requires_grad != target->requires_grad) {
    return differs("requires_grad", *f.requires_grad ? "true" : "false",
                   target->requires_grad ? "true" : "false");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  struct stat st;
  if (stat(path.c_str(), &st) != 0) {
    const int err = errno;
    const std::string reason = absl::StrFormat(
        "model \"%s\" is not a preset (%s) and cannot be read "
        "as a model file: %s",
        path, absl::StrJoin(PresetNames(), ", "), std::strerror(err));
    return err == ENOENT ? absl::NotFoundError(reason)
                         : absl::InvalidArgumentError(reason);
  }
  if (S_ISDIR(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "model file \"%s\" is a directory, not a JSON file", path));
  }
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "cannot open model file \"%s\": %s", path, std::strerror(errno)));
  }
  std::string text;
  char buf[1 << 16];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0) text.append(buf, n);
  const bool failed = std::ferror(f) != 0;
  const int err = errno;
  std::fclose(f);
  if (failed) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "cannot read model file \"%s\": %s", path, std::strerror(err)));
  }
  return text;
}

}  // namespace

absl::StatusOr<ModelSpec> ParseModelSpecJson(absl::string_view text,
                                             absl::string_view source_name) {
  FLATPARAM_ASSIGN_OR_RETURN(json doc, ParseJson(text, source_name));

  const SchemaErrors errors(source_name);
  if (!doc.is_object()) {
    return errors.Expected("(top level)", "an object with \"params\"", doc);
  }
  FLATPARAM_RETURN_IF_ERROR(errors.CheckKeys(
      "(top level)", doc, {"name", "params", "wrap", "buffers"}));
  ModelSpec spec;
  spec.name = std::string(source_name);
  if (doc.contains("name")) {
    FLATPARAM_ASSIGN_OR_RETURN(spec.name, errors.String("name", doc["name"]));
  }
  if (!doc.contains("params")) {
    return errors.Error("(top level)", "missing key \"params\"");
  }
  const json& params = doc["params"];
  if (!params.is_array()) {
    return errors.Expected("params", "an array of parameters", params);
  }
  int64_t model_numel = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    const std::string path = absl::StrCat("params[", i, "]");
    ParamFields tied_fields;
    FLATPARAM_ASSIGN_OR_RETURN(
        ParamSpec p,
        ParseParam(errors, path, params[i], &model_numel, &tied_fields));
    if (!p.tied_to.empty()) {
      FLATPARAM_RETURN_IF_ERROR(
          CheckTiedFields(errors, path, p, tied_fields, spec.params));
    }
    spec.params.push_back(std::move(p));
  }
  if (doc.contains("wrap")) {
    const json& wrap = doc["wrap"];
    if (!wrap.is_array()) {
      return errors.Expected("wrap", "an array of module prefixes", wrap);
    }
    for (size_t i = 0; i < wrap.size(); ++i) {
      const std::string path = absl::StrCat("wrap[", i, "]");
      FLATPARAM_ASSIGN_OR_RETURN(std::string prefix,
                                 errors.String(path, wrap[i]));
      if (!IsDottedName(prefix)) {
        return errors.Error(
            path, absl::StrFormat("\"%s\" is not a module prefix such as "
                                  "\"layers.0\" (the root is always a unit)",
                                  prefix));
      }
      spec.wrap.push_back(std::move(prefix));
    }
  }
  if (doc.contains("buffers")) {
    const json& buffers = doc["buffers"];
    if (!buffers.is_array()) {
      return errors.Expected("buffers", "an array of buffers", buffers);
    }
    for (size_t i = 0; i < buffers.size(); ++i) {
      const std::string path = absl::StrCat("buffers[", i, "]");
      const json& j = buffers[i];
      if (!j.is_object()) {
        return errors.Expected(path, "an object with \"fqn\" and \"shape\"", j);
      }
      FLATPARAM_RETURN_IF_ERROR(
          errors.CheckKeys(path, j, {"fqn", "shape", "dtype"}));
      if (!j.contains("fqn")) return errors.Error(path, "missing key \"fqn\"");
      BufferSpec b;
      FLATPARAM_ASSIGN_OR_RETURN(b.fqn, errors.String(path + ".fqn", j["fqn"]));
      if (!IsDottedName(b.fqn)) {
        return errors.Error(path + ".fqn",
                            absl::StrFormat("\"%s\" is not a dotted name "
                                            "such as \"bn.running_mean\"",
                                            b.fqn));
      }
      if (!j.contains("shape")) {
        return errors.Error(path, "missing key \"shape\"");
      }
      // (Moved out whole: GCC 12 at -O2 misreads a copy out of the
      // optional members as uninitialised.)
      absl::StatusOr<ParamFields> fields =
          ParseFields(errors, path, b.fqn, j, &model_numel);
      if (!fields.ok()) return fields.status();
      b.shape = std::move(fields->shape).value_or(std::vector<int64_t>());
      b.dtype = fields->dtype.value_or(DType::kFloat32);
      spec.buffers.push_back(std::move(b));
    }
  }
  return spec;
}

absl::StatusOr<ModelSpec> LoadModelSpec(absl::string_view preset_or_path) {
  if (IsPresetName(preset_or_path)) return PresetModel(preset_or_path);
  const std::string path(preset_or_path);
  FLATPARAM_ASSIGN_OR_RETURN(std::string text, ReadFile(path));
  return ParseModelSpecJson(text, path);
}

nlohmann::json ModelSpecToJson(const ModelSpec& spec) {
  json params = json::array();
  for (const ParamSpec& p : spec.params) {
    if (!p.tied_to.empty()) {
      params.push_back({{"fqn", p.fqn}, {"tied_to", p.tied_to}});
      continue;
    }
    params.push_back({{"fqn", p.fqn},
                      {"shape", p.shape},
                      {"dtype", std::string(DTypeName(p.dtype))},
                      {"requires_grad", p.requires_grad}});
  }
  json doc = {{"name", spec.name}, {"params", params}, {"wrap", spec.wrap}};
  // Only when there are any, so that the files of models without buffers
  // (and the layout.json of checkpoints saved before buffers were) stay as
  // they were.
  if (!spec.buffers.empty()) {
    json buffers = json::array();
    for (const BufferSpec& b : spec.buffers) {
      buffers.push_back({{"fqn", b.fqn},
                         {"shape", b.shape},
                         {"dtype", std::string(DTypeName(b.dtype))}});
    }
    doc["buffers"] = std::move(buffers);
  }
  return doc;
}

}  // namespace flatparam
