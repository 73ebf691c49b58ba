#include "flatparam/checkpoint/training_state.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <set>
#include <utility>
#include <variant>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "flatparam/base/json_limits.h"
#include "flatparam/base/shape.h"
#include "flatparam/base/status_macros.h"

namespace flatparam {
namespace checkpoint {
namespace {

using json = nlohmann::json;
using optim::HyperValue;
using optim::OptimStateValue;
using optim::ParamKey;

constexpr uint64_t kCanonicalNan = 0x7ff8000000000000ULL;
constexpr char kOptimTensorPrefix[] = "optim.";
constexpr char kStateTensorPrefix[] = "state.";

json FloatToJson(double d) {
  if (std::isfinite(d)) return d;
  if (std::isinf(d)) return d > 0 ? "inf" : "-inf";
  uint64_t bits;
  std::memcpy(&bits, &d, sizeof(bits));
  if (bits == kCanonicalNan) return "nan";
  return absl::StrFormat("nan:%016x", bits);
}

json KeyToJson(const ParamKey& key) {
  if (const auto* id = std::get_if<int64_t>(&key)) return *id;
  return std::get<std::string>(key);
}

// `j` for an error message: never throws (a caller's json may hold invalid
// UTF-8) and stays short however large the value.
std::string Snippet(const json& j) {
  constexpr size_t kMax = 200;
  std::string s = j.dump(-1, ' ', false, json::error_handler_t::replace);
  if (s.size() > kMax) {
    s.resize(kMax);
    s += "...";
  }
  return s;
}

// Parsing context: the file and the JSON path so far.
class Parser {
 public:
  explicit Parser(absl::string_view file) : file_(file) {}

  absl::Status Error(const std::string& path, absl::string_view what) const {
    return absl::DataLossError(absl::StrCat(file_, ": ", path, ": ", what));
  }

  absl::StatusOr<double> Float(const json& j, const std::string& path) const {
    if (j.is_number()) return j.get<double>();
    if (j.is_string()) {
      const std::string s = j.get<std::string>();
      if (s == "inf") return std::numeric_limits<double>::infinity();
      if (s == "-inf") return -std::numeric_limits<double>::infinity();
      uint64_t bits = kCanonicalNan;
      if (s == "nan" ||
          (absl::StartsWith(s, "nan:") && s.size() == 20 &&
           absl::SimpleHexAtoi(absl::string_view(s).substr(4), &bits))) {
        double d;
        std::memcpy(&d, &bits, sizeof(d));
        if (std::isnan(d)) return d;
      }
    }
    return Error(path, absl::StrCat("expected a float (a number, \"inf\", "
                                    "\"-inf\", \"nan\" or \"nan:<16 hex "
                                    "digits>\"), got ",
                                    Snippet(j)));
  }

  absl::StatusOr<int64_t> Int(const json& j, const std::string& path) const {
    if (j.is_number_integer()) {
      if (j.is_number_unsigned() &&
          j.get<uint64_t>() >
              static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        return Error(path, absl::StrCat("integer ", Snippet(j),
                                        " does not fit in int64"));
      }
      return j.get<int64_t>();
    }
    return Error(path, absl::StrCat("expected an integer, got ", Snippet(j)));
  }

  absl::StatusOr<ParamKey> Key(const json& j, const std::string& path) const {
    if (j.is_string()) return ParamKey(j.get<std::string>());
    if (j.is_number_integer()) {
      FLATPARAM_ASSIGN_OR_RETURN(int64_t id, Int(j, path));
      return ParamKey(id);
    }
    return Error(path, absl::StrCat("expected an integer or string key, got ",
                                    Snippet(j)));
  }

  // A tagged value: {"<type>": payload}. Returns the tag and the payload.
  absl::StatusOr<std::pair<std::string, const json*>> Tagged(
      const json& j, const std::string& path) const {
    if (!j.is_object() || j.size() != 1) {
      return Error(path, absl::StrCat("expected an object with one member "
                                      "naming the value's type, got ",
                                      Snippet(j)));
    }
    return std::make_pair(j.begin().key(), &j.begin().value());
  }

  absl::StatusOr<SidecarValue> Value(const json& j,
                                     const std::string& path) const {
    FLATPARAM_ASSIGN_OR_RETURN(auto tagged, Tagged(j, path));
    const std::string& tag = tagged.first;
    const json& v = *tagged.second;
    const std::string at = absl::StrCat(path, ".", tag);
    SidecarValue out;
    if (tag == "tensor") {
      if (!v.is_string() || v.get<std::string>().empty()) {
        return Error(at, "expected a tensor name");
      }
      out.tensor = v.get<std::string>();
    } else if (tag == "int") {
      FLATPARAM_ASSIGN_OR_RETURN(int64_t i, Int(v, at));
      out.value = i;
    } else if (tag == "float") {
      FLATPARAM_ASSIGN_OR_RETURN(double d, Float(v, at));
      out.value = d;
    } else if (tag == "bool") {
      if (!v.is_boolean()) return Error(at, "expected true or false");
      out.value = v.get<bool>();
    } else if (tag == "str") {
      if (!v.is_string()) return Error(at, "expected a string");
      out.value = v.get<std::string>();
    } else if (tag == "str_bytes") {
      if (!v.is_string() || v.get<std::string>().size() % 2 != 0 ||
          !std::all_of(v.get_ref<const std::string&>().begin(),
                       v.get_ref<const std::string&>().end(),
                       [](char c) { return absl::ascii_isxdigit(c); })) {
        return Error(at, "expected an even number of hex digits");
      }
      out.value = absl::HexStringToBytes(v.get<std::string>());
    } else if (tag == "none") {
      if (!v.is_null()) return Error(at, "expected null");
      out.value = std::monostate();
    } else {
      return Error(path, absl::StrCat("unknown value type \"", tag,
                                      "\" (expected tensor, int, float, "
                                      "bool, str, str_bytes or none)"));
    }
    return out;
  }

  absl::StatusOr<HyperValue> Hyper(const json& j,
                                   const std::string& path) const {
    FLATPARAM_ASSIGN_OR_RETURN(auto tagged, Tagged(j, path));
    const std::string& tag = tagged.first;
    const json& v = *tagged.second;
    const std::string at = absl::StrCat(path, ".", tag);
    if (tag == "floats") {
      if (!v.is_array()) return Error(at, "expected an array of floats");
      std::vector<double> out;
      for (size_t i = 0; i < v.size(); ++i) {
        FLATPARAM_ASSIGN_OR_RETURN(double d,
                                   Float(v[i], absl::StrCat(at, "[", i, "]")));
        out.push_back(d);
      }
      return HyperValue(std::move(out));
    }
    if (tag == "tensor") {
      return Error(path, "a hyperparameter cannot be a tensor");
    }
    FLATPARAM_ASSIGN_OR_RETURN(SidecarValue sv, Value(j, path));
    return std::visit(
        [](const auto& x) -> HyperValue {
          using T = std::decay_t<decltype(x)>;
          if constexpr (std::is_same_v<T, HostTensor>) {
            return std::monostate();  // Unreachable: rejected above.
          } else {
            return x;
          }
        },
        sv.value);
  }

 private:
  std::string file_;
};

bool IsValidUtf8(const std::string& s) {
  try {
    (void)json(s).dump();
  } catch (const json::exception&) {
    return false;
  }
  return true;
}

absl::Status CheckDumpable(const json& doc, absl::string_view what) {
  try {
    (void)doc.dump();
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", e.what()));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<json> OptimValueToJson(const OptimStateValue& value) {
  json out = json::object();
  if (std::holds_alternative<HostTensor>(value)) {
    return absl::InvalidArgumentError(
        "a tensor value goes into the safetensors file, not the sidecar");
  } else if (const auto* i = std::get_if<int64_t>(&value)) {
    out["int"] = *i;
  } else if (const auto* d = std::get_if<double>(&value)) {
    out["float"] = FloatToJson(*d);
  } else if (const auto* b = std::get_if<bool>(&value)) {
    out["bool"] = *b;
  } else if (const auto* s = std::get_if<std::string>(&value)) {
    if (IsValidUtf8(*s)) {
      out["str"] = *s;
    } else {
      out["str_bytes"] = absl::BytesToHexString(*s);
    }
  } else {
    out["none"] = nullptr;
  }
  FLATPARAM_RETURN_IF_ERROR(CheckDumpable(out, "value"));
  return out;
}

absl::StatusOr<json> HyperValueToJson(const HyperValue& value) {
  json out = json::object();
  if (const auto* v = std::get_if<std::vector<double>>(&value)) {
    json a = json::array();
    for (double d : *v) a.push_back(FloatToJson(d));
    out["floats"] = std::move(a);
    return out;
  }
  return std::visit(
      [](const auto& x) -> absl::StatusOr<json> {
        using T = std::decay_t<decltype(x)>;
        if constexpr (std::is_same_v<T, std::vector<double>>) {
          return json();  // Handled above.
        } else {
          return OptimValueToJson(OptimStateValue(x));
        }
      },
      value);
}

absl::StatusOr<json> OptimSidecarToJson(const OptimSidecar& sidecar,
                                        bool with_extra) {
  json doc = json::object();
  doc["format"] = kOptimSidecarFormat;
  json state = json::array();
  for (const auto& [key, values] : sidecar.state) {
    json entry = json::object();
    entry["key"] = KeyToJson(key);
    json vs = json::object();
    for (const auto& [name, v] : values) {
      const std::string where = absl::StrCat("state ", optim::DescribeKey(key),
                                             " value '", name, "'");
      if (v.tensor.has_value()) {
        vs[name] = json{{"tensor", *v.tensor}};
        continue;
      }
      absl::StatusOr<json> j = OptimValueToJson(v.value);
      if (!j.ok()) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, ": ", j.status().message()));
      }
      vs[name] = *std::move(j);
    }
    entry["values"] = std::move(vs);
    state.push_back(std::move(entry));
  }
  doc["state"] = std::move(state);
  json groups = json::array();
  for (size_t g = 0; g < sidecar.param_groups.size(); ++g) {
    const optim::ParamGroup& group = sidecar.param_groups[g];
    json params = json::array();
    for (const ParamKey& k : group.params) params.push_back(KeyToJson(k));
    json hyper = json::object();
    for (const auto& [name, v] : group.hyperparams) {
      absl::StatusOr<json> j = HyperValueToJson(v);
      if (!j.ok()) {
        return absl::InvalidArgumentError(
            absl::StrCat("param_groups[", g, "] hyperparameter '", name,
                         "': ", j.status().message()));
      }
      hyper[name] = *std::move(j);
    }
    groups.push_back(
        json{{"params", std::move(params)}, {"hyperparams", std::move(hyper)}});
  }
  doc["param_groups"] = std::move(groups);
  if (with_extra) {
    if (!sidecar.extra.is_object()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "extra must be a JSON object, not a ", sidecar.extra.type_name()));
    }
    // The reader would refuse it (and dumping it could overflow the stack).
    // One level goes to the document around it.
    FLATPARAM_RETURN_IF_ERROR(CheckJsonDepth(sidecar.extra, "extra",
                                             absl::StatusCode::kInvalidArgument,
                                             kMaxJsonDepth - 1));
    doc["extra"] = sidecar.extra;
  }
  FLATPARAM_RETURN_IF_ERROR(CheckDumpable(doc, "optimizer sidecar"));
  return doc;
}

absl::StatusOr<OptimSidecar> ParseOptimSidecar(const json& doc,
                                               absl::string_view file) {
  const Parser p(file);
  if (!doc.is_object()) return p.Error("(document)", "not a JSON object");
  // The document may not come from ParseJson, and the schema's checks
  // below copy and dump parts of it.
  FLATPARAM_RETURN_IF_ERROR(CheckJsonDepth(
      doc, absl::StrCat(file, ": (document)"), absl::StatusCode::kDataLoss));
  auto format = doc.find("format");
  if (format == doc.end() || *format != kOptimSidecarFormat) {
    return p.Error("format",
                   absl::StrCat("expected \"", kOptimSidecarFormat, "\", got ",
                                format == doc.end() ? std::string("nothing")
                                                    : Snippet(*format)));
  }
  for (auto it = doc.begin(); it != doc.end(); ++it) {
    if (it.key() != "format" && it.key() != "state" &&
        it.key() != "param_groups" && it.key() != "extra") {
      return p.Error(it.key(), "unexpected member");
    }
  }
  OptimSidecar out;
  auto state = doc.find("state");
  if (state == doc.end() || !state->is_array()) {
    return p.Error("state", "missing or not an array");
  }
  for (size_t e = 0; e < state->size(); ++e) {
    const json& entry = (*state)[e];
    const std::string at = absl::StrCat("state[", e, "]");
    if (!entry.is_object() || entry.size() != 2 || !entry.contains("key") ||
        !entry.contains("values") || !entry["values"].is_object()) {
      return p.Error(at, "expected {\"key\": ..., \"values\": {...}}");
    }
    FLATPARAM_ASSIGN_OR_RETURN(ParamKey key,
                               p.Key(entry["key"], absl::StrCat(at, ".key")));
    auto [slot, inserted] =
        out.state.emplace(key, std::map<std::string, SidecarValue>());
    if (!inserted) {
      return p.Error(at,
                     absl::StrCat("duplicate key ", optim::DescribeKey(key)));
    }
    const json& values = entry["values"];
    for (auto it = values.begin(); it != values.end(); ++it) {
      if (it.key().empty()) {
        return p.Error(absl::StrCat(at, ".values"), "empty state name");
      }
      FLATPARAM_ASSIGN_OR_RETURN(
          SidecarValue v,
          p.Value(it.value(), absl::StrCat(at, ".values.", it.key())));
      slot->second.emplace(it.key(), std::move(v));
    }
  }
  auto groups = doc.find("param_groups");
  if (groups == doc.end() || !groups->is_array()) {
    return p.Error("param_groups", "missing or not an array");
  }
  for (size_t g = 0; g < groups->size(); ++g) {
    const json& group = (*groups)[g];
    const std::string at = absl::StrCat("param_groups[", g, "]");
    if (!group.is_object() || group.size() != 2 || !group.contains("params") ||
        !group["params"].is_array() || !group.contains("hyperparams") ||
        !group["hyperparams"].is_object()) {
      return p.Error(at,
                     "expected {\"params\": [...], \"hyperparams\": {...}}");
    }
    optim::ParamGroup pg;
    const json& params = group["params"];
    for (size_t i = 0; i < params.size(); ++i) {
      FLATPARAM_ASSIGN_OR_RETURN(
          ParamKey k, p.Key(params[i], absl::StrCat(at, ".params[", i, "]")));
      pg.params.push_back(std::move(k));
    }
    const json& hyper = group["hyperparams"];
    for (auto it = hyper.begin(); it != hyper.end(); ++it) {
      FLATPARAM_ASSIGN_OR_RETURN(
          HyperValue v,
          p.Hyper(it.value(), absl::StrCat(at, ".hyperparams.", it.key())));
      pg.hyperparams.emplace(it.key(), std::move(v));
    }
    out.param_groups.push_back(std::move(pg));
  }
  auto extra = doc.find("extra");
  if (extra != doc.end()) {
    if (!extra->is_object()) return p.Error("extra", "not a JSON object");
    out.extra = *extra;
  }
  return out;
}

absl::StatusOr<RankContent> MakeRankContent(const ModelLayout& layout,
                                            int64_t rank,
                                            const RankState& state) {
  const int64_t g = layout.options().world_size;
  if (rank < 0 || rank >= g) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "rank %d is not in [0, %d) of the layout's shard group", rank, g));
  }
  const std::vector<FlatParamLayout>& flat = layout.flat_params();
  if (state.flat_params.size() != flat.size()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "rank %d: %d flat parameter shards, the layout has %d flat parameters",
        rank, state.flat_params.size(), flat.size()));
  }
  RankContent content;
  for (size_t i = 0; i < flat.size(); ++i) {
    const HostTensor& t = state.flat_params[i];
    const std::vector<int64_t> want = {flat[i].sharded_numel()};
    if (t.dtype() != flat[i].dtype() || t.shape() != want) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "rank %d: flat_params[%d] is %s %s, the layout's shard of flat "
          "parameter %d (unit '%s') is %s %s",
          rank, i, DTypeName(t.dtype()), ShapeString(t.shape()), i,
          flat[i].unit(), DTypeName(flat[i].dtype()), ShapeString(want)));
    }
    content.tensors.push_back(
        TensorSourceFromHostTensor(FlatParamTensorName(i), t));
  }
  const std::vector<BufferSpec>& buffers = layout.spec().buffers;
  for (const BufferSpec& b : buffers) {
    auto it = state.buffers.find(b.fqn);
    if (it == state.buffers.end()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "rank %d: no value for buffer '%s' of the model", rank, b.fqn));
    }
    const HostTensor& t = it->second;
    if (t.dtype() != b.dtype || t.shape() != b.shape) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "rank %d: buffer '%s' is %s %s, the model's is %s %s", rank, b.fqn,
          DTypeName(t.dtype()), ShapeString(t.shape()), DTypeName(b.dtype),
          ShapeString(b.shape)));
    }
    content.tensors.push_back(
        TensorSourceFromHostTensor(BufferTensorName(b.fqn), t));
  }
  if (state.buffers.size() != buffers.size()) {
    for (const auto& entry : state.buffers) {
      const std::string& fqn = entry.first;
      if (std::none_of(buffers.begin(), buffers.end(),
                       [&](const BufferSpec& b) { return b.fqn == fqn; })) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "rank %d: '%s' is not a buffer of the model", rank, fqn));
      }
    }
  }
  OptimSidecar sidecar;
  sidecar.param_groups = state.optim.param_groups;
  sidecar.extra = state.extra;
  for (const auto& [key, values] : state.optim.state) {
    const auto* id = std::get_if<int64_t>(&key);
    if (id != nullptr &&
        (*id < 0 || *id >= static_cast<int64_t>(flat.size()))) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "rank %d: optimizer state key %d is not a flat-parameter index in "
          "[0, %d)",
          rank, *id, flat.size()));
    }
    auto& out = sidecar.state[key];
    for (const auto& [name, value] : values) {
      if (name.empty()) {
        return absl::InvalidArgumentError(
            absl::StrFormat("rank %d: state %s has an empty state name", rank,
                            optim::DescribeKey(key)));
      }
      const auto* t = std::get_if<HostTensor>(&value);
      if (t == nullptr) {
        out[name] = SidecarValue{std::nullopt, value};
        continue;
      }
      if (id == nullptr) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "rank %d: state %s '%s' is a tensor, but rank files hold only "
            "the tensors of flat parameters (int keys)",
            rank, optim::DescribeKey(key), name));
      }
      const int64_t numel = flat[*id].sharded_numel();
      if (!t->shape().empty() && t->shape() != std::vector<int64_t>{numel}) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "rank %d: state %d '%s' is %s, expected a 0-d tensor or the 1-D "
            "shard [%d] of flat parameter %d",
            rank, *id, name, optim::DescribeValue(value), numel, *id));
      }
      std::string tensor = OptimShardTensorName(*id, name);
      content.tensors.push_back(TensorSourceFromHostTensor(tensor, *t));
      out[name] = SidecarValue{std::move(tensor), std::monostate()};
    }
  }
  absl::StatusOr<json> doc = OptimSidecarToJson(sidecar, /*with_extra=*/true);
  if (!doc.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", rank, ": ", doc.status().message()));
  }
  content.sidecar = *std::move(doc);
  return content;
}

namespace {

// Checks the tensor values of a parsed sidecar against `file`: each names
// `expected_name(key, state)`, which `file` holds, and no tensor is named
// twice; every tensor named `prefix`* in `file` is named.
template <typename ExpectedName>
absl::Status CheckSidecarTensors(const OptimSidecar& sidecar,
                                 const SafetensorsReader& file,
                                 absl::string_view sidecar_name,
                                 absl::string_view prefix,
                                 ExpectedName expected_name) {
  std::set<std::string> listed;
  for (const auto& [key, values] : sidecar.state) {
    for (const auto& [name, v] : values) {
      if (!v.tensor.has_value()) continue;
      const std::string where = absl::StrCat(
          sidecar_name, ": state ", optim::DescribeKey(key), " '", name, "'");
      absl::StatusOr<std::string> want = expected_name(key, name);
      if (!want.ok()) {
        return absl::DataLossError(
            absl::StrCat(where, ": ", want.status().message()));
      }
      if (*v.tensor != *want) {
        return absl::DataLossError(absl::StrCat(
            where, " names tensor '", *v.tensor, "', expected '", *want, "'"));
      }
      if (!file.Contains(*v.tensor)) {
        return absl::DataLossError(absl::StrCat(where, ": tensor '", *v.tensor,
                                                "' is not in ", file.name()));
      }
      // Two state names can map to one tensor name (full checkpoints:
      // "a.b" + "c" and "a" + "b.c"); the writer refuses that, so must we.
      if (!listed.insert(*v.tensor).second) {
        return absl::DataLossError(absl::StrCat(where, ": tensor '", *v.tensor,
                                                "' is listed more than once"));
      }
    }
  }
  for (const SafetensorsEntry& e : file.tensors()) {
    if (absl::StartsWith(e.name, prefix) && listed.count(e.name) == 0) {
      return absl::DataLossError(absl::StrCat(file.name(), ": tensor '", e.name,
                                              "' is not listed in ",
                                              sidecar_name));
    }
  }
  return absl::OkStatus();
}

// Fills `dict` from a sidecar that Check{Rank,Full}Sidecar accepted,
// reading its tensors with `read`.
absl::Status FillState(
    const OptimSidecar& sidecar,
    const std::function<absl::StatusOr<HostTensor>(const std::string&)>& read,
    optim::OptimStateDict& dict) {
  for (const auto& [key, values] : sidecar.state) {
    optim::ParamState& out = dict.state[key];
    for (const auto& [name, v] : values) {
      if (!v.tensor.has_value()) {
        out[name] = v.value;
        continue;
      }
      FLATPARAM_ASSIGN_OR_RETURN(HostTensor t, read(*v.tensor));
      out[name] = std::move(t);
    }
  }
  dict.param_groups = sidecar.param_groups;
  return absl::OkStatus();
}

// Pulls `source` whole, in the writer's chunks.
absl::StatusOr<HostTensor> PullSource(const TensorSource& source) {
  // Filled whole below: no zero-fill first.
  HostTensor t = HostTensor::Uninitialized(source.dtype, source.shape);
  char* data = static_cast<char*>(t.data());
  for (uint64_t done = 0; done < t.nbytes();) {
    const uint64_t n =
        std::min<uint64_t>(kDefaultChunkBytes, t.nbytes() - done);
    absl::Status s = source.fill(done, absl::MakeSpan(data + done, n));
    if (!s.ok()) {
      return absl::Status(s.code(),
                          absl::StrCat(source.name, ": ", s.message()));
    }
    done += n;
  }
  return t;
}

}  // namespace

absl::Status CheckRankSidecar(const OptimSidecar& sidecar,
                              const SafetensorsReader& file,
                              int64_t num_flat_params,
                              absl::string_view sidecar_name) {
  const int64_t n = num_flat_params;
  // As MakeRankContent: an int key is a flat-parameter index, even when it
  // holds no tensor.
  for (const auto& [key, values] : sidecar.state) {
    const auto* id = std::get_if<int64_t>(&key);
    if (id != nullptr && (*id < 0 || *id >= n)) {
      return absl::DataLossError(absl::StrFormat(
          "%s: optimizer state key %d is not a flat-parameter index in "
          "[0, %d)",
          sidecar_name, *id, n));
    }
  }
  return CheckSidecarTensors(
      sidecar, file, sidecar_name, kOptimTensorPrefix,
      [n](const ParamKey& key,
          const std::string& name) -> absl::StatusOr<std::string> {
        const auto* id = std::get_if<int64_t>(&key);
        if (id == nullptr) {
          return absl::InvalidArgumentError(absl::StrFormat(
              "a tensor state needs a flat-parameter index key in [0, %d)", n));
        }
        return OptimShardTensorName(*id, name);
      });
}

absl::Status CheckFullSidecar(const OptimSidecar& sidecar,
                              const SafetensorsReader& file,
                              absl::string_view sidecar_name) {
  // As MakeFullContent: keys are names, even for states without tensors.
  for (const auto& [key, values] : sidecar.state) {
    if (std::holds_alternative<int64_t>(key)) {
      return absl::DataLossError(absl::StrCat(
          sidecar_name, ": optimizer state key ", optim::DescribeKey(key),
          " is a parameter ID; a full checkpoint's keys are names"));
    }
  }
  return CheckSidecarTensors(
      sidecar, file, sidecar_name, kStateTensorPrefix,
      [](const ParamKey& key,
         const std::string& name) -> absl::StatusOr<std::string> {
        return OptimStateTensorName(std::get<std::string>(key), name);
      });
}

absl::StatusOr<RankState> ReadRankState(const ShardedCheckpointReader& reader,
                                        int64_t rank) {
  FLATPARAM_ASSIGN_OR_RETURN(SafetensorsReader file, reader.OpenRank(rank));
  FLATPARAM_ASSIGN_OR_RETURN(json doc, reader.ReadRankJson(rank));
  const std::string sidecar_name =
      JoinPath(reader.path(), RankJsonFileName(rank));
  FLATPARAM_ASSIGN_OR_RETURN(OptimSidecar sidecar,
                             ParseOptimSidecar(doc, sidecar_name));
  const int64_t n = static_cast<int64_t>(reader.layout().flat_params().size());
  FLATPARAM_RETURN_IF_ERROR(CheckRankSidecar(sidecar, file, n, sidecar_name));
  // Every tensor of the file is needed (CheckRankSidecar: each "optim.*"
  // one is named by the sidecar): read them in the file's data order, so
  // that the file is read front to back once -- with per-block
  // verification, no checksum block is read twice.
  std::map<std::string, HostTensor> tensors;
  for (const SafetensorsEntry& e : file.tensors()) {
    FLATPARAM_ASSIGN_OR_RETURN(HostTensor t, file.ReadHostTensor(e.name));
    tensors.emplace(e.name, std::move(t));
  }
  auto take = [&](const std::string& name) -> absl::StatusOr<HostTensor> {
    auto it = tensors.find(name);
    if (it == tensors.end()) {
      return absl::DataLossError(
          absl::StrCat(file.name(), ": no tensor '", name, "'"));
    }
    HostTensor t = std::move(it->second);
    tensors.erase(it);
    return t;
  };
  RankState state;
  for (int64_t i = 0; i < n; ++i) {
    FLATPARAM_ASSIGN_OR_RETURN(HostTensor t, take(FlatParamTensorName(i)));
    state.flat_params.push_back(std::move(t));
  }
  for (const BufferSpec& b : reader.spec().buffers) {
    FLATPARAM_ASSIGN_OR_RETURN(HostTensor t, take(BufferTensorName(b.fqn)));
    state.buffers.emplace(b.fqn, std::move(t));
  }
  FLATPARAM_RETURN_IF_ERROR(FillState(sidecar, take, state.optim));
  state.extra = std::move(sidecar.extra);
  return state;
}

absl::StatusOr<RankState> RankStateFromContent(const ModelLayout& layout,
                                               int64_t rank,
                                               const RankContent& content) {
  const int64_t g = layout.options().world_size;
  if (rank < 0 || rank >= g) {
    return absl::InvalidArgumentError(
        absl::StrFormat("rank %d is not in [0, %d)", rank, g));
  }
  std::map<std::string, const TensorSource*> sources;
  for (const TensorSource& s : content.tensors) {
    if (!sources.emplace(s.name, &s).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("rank content lists tensor '", s.name, "' twice"));
    }
  }
  absl::StatusOr<OptimSidecar> sidecar =
      ParseOptimSidecar(content.sidecar, "rank content sidecar");
  if (!sidecar.ok()) {
    return absl::InvalidArgumentError(sidecar.status().message());
  }
  const auto read = [&](const std::string& name) -> absl::StatusOr<HostTensor> {
    auto it = sources.find(name);
    if (it == sources.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("rank content has no tensor '", name, "'"));
    }
    return PullSource(*it->second);
  };
  RankState state;
  const auto& flat = layout.flat_params();
  for (int64_t i = 0; i < static_cast<int64_t>(flat.size()); ++i) {
    FLATPARAM_ASSIGN_OR_RETURN(HostTensor t, read(FlatParamTensorName(i)));
    if (t.dtype() != flat[i].dtype() ||
        t.shape() != std::vector<int64_t>{flat[i].sharded_numel()}) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "rank content tensor '%s' is %s %s, the layout's flat parameter "
          "is %s [%d]",
          FlatParamTensorName(i), DTypeName(t.dtype()), ShapeString(t.shape()),
          DTypeName(flat[i].dtype()), flat[i].sharded_numel()));
    }
    state.flat_params.push_back(std::move(t));
  }
  for (const BufferSpec& b : layout.spec().buffers) {
    FLATPARAM_ASSIGN_OR_RETURN(HostTensor t, read(BufferTensorName(b.fqn)));
    if (t.dtype() != b.dtype || t.shape() != b.shape) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "rank content tensor '%s' is %s %s, the model's buffer is %s %s",
          BufferTensorName(b.fqn), DTypeName(t.dtype()), ShapeString(t.shape()),
          DTypeName(b.dtype), ShapeString(b.shape)));
    }
    state.buffers.emplace(b.fqn, std::move(t));
  }
  FLATPARAM_RETURN_IF_ERROR(FillState(*sidecar, read, state.optim));
  state.extra = std::move(sidecar->extra);
  return state;
}

absl::StatusOr<FullCheckpointContent> MakeFullContent(const FullState& state) {
  FullCheckpointContent content;
  for (const auto& [fqn, tensor] : state.params) {
    content.model.push_back(TensorSourceFromHostTensor(fqn, tensor));
  }
  OptimSidecar sidecar;
  sidecar.param_groups = state.optim.param_groups;
  std::set<std::string> names;
  for (const auto& [key, values] : state.optim.state) {
    const auto* fqn = std::get_if<std::string>(&key);
    if (fqn == nullptr) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "optimizer state key %s is a parameter ID; a full checkpoint is "
          "keyed by name (RekeyOptimStateDict to kParamName first)",
          optim::DescribeKey(key)));
    }
    auto& out = sidecar.state[key];
    for (const auto& [name, value] : values) {
      if (name.empty()) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "state %s has an empty state name", optim::DescribeKey(key)));
      }
      const auto* t = std::get_if<HostTensor>(&value);
      if (t == nullptr) {
        out[name] = SidecarValue{std::nullopt, value};
        continue;
      }
      std::string tensor = OptimStateTensorName(*fqn, name);
      if (!names.insert(tensor).second) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "state '%s' '%s' would be stored as tensor '%s', which another "
            "key's state already uses",
            *fqn, name, tensor));
      }
      content.optim.push_back(TensorSourceFromHostTensor(tensor, *t));
      out[name] = SidecarValue{std::move(tensor), std::monostate()};
    }
  }
  FLATPARAM_ASSIGN_OR_RETURN(content.optim_json,
                             OptimSidecarToJson(sidecar, /*with_extra=*/false));
  return content;
}

absl::StatusOr<FullState> ReadFullState(const FullCheckpointReader& reader) {
  FullState state;
  for (const SafetensorsEntry& e : reader.model().tensors()) {
    FLATPARAM_ASSIGN_OR_RETURN(HostTensor t,
                               reader.model().ReadHostTensor(e.name));
    state.params.emplace(e.name, std::move(t));
  }
  const std::string sidecar_name = JoinPath(reader.path(), kOptimJsonFileName);
  FLATPARAM_ASSIGN_OR_RETURN(
      OptimSidecar sidecar,
      ParseOptimSidecar(reader.optim_json(), sidecar_name));
  FLATPARAM_RETURN_IF_ERROR(
      CheckFullSidecar(sidecar, reader.optim(), sidecar_name));
  FLATPARAM_RETURN_IF_ERROR(FillState(
      sidecar,
      [&reader](const std::string& name) {
        return reader.optim().ReadHostTensor(name);
      },
      state.optim));
  return state;
}

}  // namespace checkpoint
}  // namespace flatparam
