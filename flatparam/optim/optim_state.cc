#include "flatparam/optim/optim_state.h"

#include <cmath>
#include <cstring>
#include <set>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "flatparam/base/shape.h"
#include "flatparam/base/status_macros.h"

namespace flatparam {
namespace optim {
namespace {

uint64_t Bits(double v) {
  uint64_t b;
  std::memcpy(&b, &v, sizeof b);
  return b;
}

// Element i of any dtype as double (exact for everything but huge int64).
double ElementAsDouble(const HostTensor& t, int64_t i) {
  const unsigned char* p = static_cast<const unsigned char*>(t.data());
  switch (t.dtype()) {
    case DType::kInt8:
      return static_cast<double>(reinterpret_cast<const int8_t*>(p)[i]);
    case DType::kUInt8:
      return static_cast<double>(p[i]);
    case DType::kInt16:
      return static_cast<double>(reinterpret_cast<const int16_t*>(p)[i]);
    case DType::kInt32:
      return static_cast<double>(reinterpret_cast<const int32_t*>(p)[i]);
    case DType::kInt64:
      return static_cast<double>(reinterpret_cast<const int64_t*>(p)[i]);
    case DType::kBool:
      return p[i] != 0 ? 1.0 : 0.0;
    default:
      return LoadAsDouble(p, t.dtype(), i);
  }
}

std::string FormatFloat(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  std::string s = absl::StrFormat("%.17g", v);
  // Shortest representation that round-trips, as Python's repr does.
  for (int precision = 1; precision < 17; ++precision) {
    std::string t = absl::StrFormat("%.*g", precision, v);
    if (std::strtod(t.c_str(), nullptr) == v) {
      s = t;
      break;
    }
  }
  if (s.find_first_of(".eni") == std::string::npos) s += ".0";
  return s;
}

std::string FormatElement(const HostTensor& t, int64_t i) {
  const double v = ElementAsDouble(t, i);
  if (t.dtype() == DType::kBool) return v != 0 ? "True" : "False";
  if (!IsFloatingPoint(t.dtype())) {
    if (t.dtype() == DType::kInt64) {
      return absl::StrCat(reinterpret_cast<const int64_t*>(t.data())[i]);
    }
    return absl::StrCat(static_cast<int64_t>(v));
  }
  return FormatFloat(v);
}

std::string Quote(const std::string& s) { return absl::StrCat("'", s, "'"); }

std::string DescribeHyper(const HyperValue& v) {
  struct Visitor {
    std::string operator()(std::monostate) const { return "None"; }
    std::string operator()(bool b) const { return b ? "True" : "False"; }
    std::string operator()(int64_t i) const { return absl::StrCat(i); }
    std::string operator()(double d) const { return FormatFloat(d); }
    std::string operator()(const std::string& s) const { return Quote(s); }
    std::string operator()(const std::vector<double>& v) const {
      std::vector<std::string> parts;
      for (double d : v) parts.push_back(FormatFloat(d));
      return absl::StrCat("(", absl::StrJoin(parts, ", "), ")");
    }
  };
  return std::visit(Visitor{}, v);
}

std::string TensorDifference(const HostTensor& a, const HostTensor& b) {
  if (a.dtype() != b.dtype() || a.shape() != b.shape()) {
    return absl::StrCat(DescribeValue(a), " vs ", DescribeValue(b));
  }
  const size_t size = DTypeSize(a.dtype());
  const auto* pa = static_cast<const unsigned char*>(a.data());
  const auto* pb = static_cast<const unsigned char*>(b.data());
  for (int64_t i = 0; i < a.numel(); ++i) {
    if (std::memcmp(pa + i * size, pb + i * size, size) != 0) {
      return absl::StrFormat("%s differs at element %d: %s vs %s",
                             DescribeValue(a), i, FormatElement(a, i),
                             FormatElement(b, i));
    }
  }
  return "equal";
}

}  // namespace

bool BitwiseEqual(const OptimStateValue& a, const OptimStateValue& b) {
  if (a.index() != b.index()) return false;
  if (const auto* d = std::get_if<double>(&a)) {
    return Bits(*d) == Bits(std::get<double>(b));
  }
  return a == b;
}

bool BitwiseEqual(const HyperValue& a, const HyperValue& b) {
  if (a.index() != b.index()) return false;
  if (const auto* d = std::get_if<double>(&a)) {
    return Bits(*d) == Bits(std::get<double>(b));
  }
  if (const auto* v = std::get_if<std::vector<double>>(&a)) {
    const auto& w = std::get<std::vector<double>>(b);
    if (v->size() != w.size()) return false;
    for (size_t i = 0; i < v->size(); ++i) {
      if (Bits((*v)[i]) != Bits(w[i])) return false;
    }
    return true;
  }
  return a == b;
}

bool operator==(const ParamGroup& a, const ParamGroup& b) {
  if (a.params != b.params) return false;
  if (a.hyperparams.size() != b.hyperparams.size()) return false;
  for (auto ia = a.hyperparams.begin(), ib = b.hyperparams.begin();
       ia != a.hyperparams.end(); ++ia, ++ib) {
    if (ia->first != ib->first || !BitwiseEqual(ia->second, ib->second)) {
      return false;
    }
  }
  return true;
}

bool operator==(const OptimStateDict& a, const OptimStateDict& b) {
  return !FirstDifference(a, b).has_value();
}

std::optional<std::string> FirstDifference(const OptimStateDict& a,
                                           const OptimStateDict& b) {
  std::set<ParamKey> keys;
  for (const auto& [k, v] : a.state) keys.insert(k);
  for (const auto& [k, v] : b.state) keys.insert(k);
  for (const ParamKey& key : keys) {
    const std::string where = absl::StrCat("state[", DescribeKey(key), "]");
    auto ia = a.state.find(key);
    auto ib = b.state.find(key);
    if (ib == b.state.end()) return where + ": only in the first dict";
    if (ia == a.state.end()) return where + ": only in the second dict";
    std::set<std::string> names;
    for (const auto& [n, v] : ia->second) names.insert(n);
    for (const auto& [n, v] : ib->second) names.insert(n);
    for (const std::string& name : names) {
      const std::string w = absl::StrCat(where, "[", Quote(name), "]");
      auto va = ia->second.find(name);
      auto vb = ib->second.find(name);
      if (vb == ib->second.end()) return w + ": only in the first dict";
      if (va == ia->second.end()) return w + ": only in the second dict";
      if (BitwiseEqual(va->second, vb->second)) continue;
      const auto* ta = std::get_if<HostTensor>(&va->second);
      const auto* tb = std::get_if<HostTensor>(&vb->second);
      if (ta != nullptr && tb != nullptr) {
        return absl::StrCat(w, ": ", TensorDifference(*ta, *tb));
      }
      return absl::StrCat(w, ": ", DescribeValue(va->second), " vs ",
                          DescribeValue(vb->second));
    }
  }
  if (a.param_groups.size() != b.param_groups.size()) {
    return absl::StrFormat("param_groups: %d groups vs %d",
                           a.param_groups.size(), b.param_groups.size());
  }
  for (size_t g = 0; g < a.param_groups.size(); ++g) {
    const ParamGroup& ga = a.param_groups[g];
    const ParamGroup& gb = b.param_groups[g];
    if (ga.params != gb.params) {
      std::vector<std::string> pa, pb;
      for (const ParamKey& k : ga.params) pa.push_back(DescribeKey(k));
      for (const ParamKey& k : gb.params) pb.push_back(DescribeKey(k));
      return absl::StrFormat("param_groups[%d].params: [%s] vs [%s]", g,
                             absl::StrJoin(pa, ", "), absl::StrJoin(pb, ", "));
    }
    if (!(ga == gb)) {
      std::set<std::string> names;
      for (const auto& [n, v] : ga.hyperparams) names.insert(n);
      for (const auto& [n, v] : gb.hyperparams) names.insert(n);
      for (const std::string& n : names) {
        auto ia = ga.hyperparams.find(n);
        auto ib = gb.hyperparams.find(n);
        if (ia == ga.hyperparams.end() || ib == gb.hyperparams.end() ||
            !BitwiseEqual(ia->second, ib->second)) {
          return absl::StrFormat(
              "param_groups[%d][%s]: %s vs %s", g, Quote(n),
              ia == ga.hyperparams.end() ? "absent" : DescribeHyper(ia->second),
              ib == gb.hyperparams.end() ? "absent"
                                         : DescribeHyper(ib->second));
        }
      }
    }
  }
  return std::nullopt;
}

HostTensor ScalarTensor(DType dtype, double value) {
  HostTensor t(dtype, {});
  void* p = t.data();
  switch (dtype) {
    case DType::kInt8:
      *static_cast<int8_t*>(p) = static_cast<int8_t>(value);
      break;
    case DType::kUInt8:
      *static_cast<uint8_t*>(p) = static_cast<uint8_t>(value);
      break;
    case DType::kInt16:
      *static_cast<int16_t*>(p) = static_cast<int16_t>(value);
      break;
    case DType::kInt32:
      *static_cast<int32_t*>(p) = static_cast<int32_t>(value);
      break;
    case DType::kInt64:
      *static_cast<int64_t*>(p) = static_cast<int64_t>(value);
      break;
    case DType::kBool:
      *static_cast<uint8_t*>(p) = value != 0 ? 1 : 0;
      break;
    default:
      StoreFromDouble(p, dtype, 0, value);
  }
  return t;
}

bool IsTensor(const OptimStateValue& v) {
  return std::holds_alternative<HostTensor>(v);
}

bool IsPosDimTensor(const OptimStateValue& v) {
  const auto* t = std::get_if<HostTensor>(&v);
  return t != nullptr && !t->shape().empty();
}

bool IsZeroDimTensor(const OptimStateValue& v) {
  const auto* t = std::get_if<HostTensor>(&v);
  return t != nullptr && t->shape().empty();
}

const char* ValueTypeName(const OptimStateValue& v) {
  static constexpr const char* kNames[] = {"NoneType", "Tensor", "int",
                                           "float",    "bool",   "str"};
  return kNames[v.index()];
}

std::string DescribeValue(const OptimStateValue& v) {
  struct Visitor {
    std::string operator()(std::monostate) const { return "None"; }
    std::string operator()(const HostTensor& t) const {
      if (t.shape().empty()) {
        return absl::StrFormat("tensor(%s, dtype=%s)", FormatElement(t, 0),
                               DTypeName(t.dtype()));
      }
      return absl::StrFormat("tensor(%s, %s)", DTypeName(t.dtype()),
                             ShapeString(t.shape()));
    }
    std::string operator()(int64_t i) const { return absl::StrCat(i); }
    std::string operator()(double d) const { return FormatFloat(d); }
    std::string operator()(bool b) const { return b ? "True" : "False"; }
    std::string operator()(const std::string& s) const { return Quote(s); }
  };
  return std::visit(Visitor{}, v);
}

std::string DescribeKey(const ParamKey& key) {
  if (const auto* i = std::get_if<int64_t>(&key)) return absl::StrCat(*i);
  return Quote(std::get<std::string>(key));
}

std::string DebugString(const OptimStateDict& dict, int max_elements) {
  std::string out = "{state: {";
  for (const auto& [key, state] : dict.state) {
    absl::StrAppend(&out, "\n  ", DescribeKey(key), ": {");
    for (const auto& [name, value] : state) {
      absl::StrAppend(&out, "\n    ", Quote(name), ": ", DescribeValue(value));
      const auto* t = std::get_if<HostTensor>(&value);
      if (t != nullptr && !t->shape().empty()) {
        std::vector<std::string> elems;
        for (int64_t i = 0; i < t->numel() && i < max_elements; ++i) {
          elems.push_back(FormatElement(*t, i));
        }
        if (t->numel() > max_elements) elems.push_back("...");
        absl::StrAppend(&out, " = [", absl::StrJoin(elems, ", "), "]");
      }
    }
    absl::StrAppend(&out, "}");
  }
  absl::StrAppend(&out, "},\n param_groups: [");
  for (const ParamGroup& g : dict.param_groups) {
    std::vector<std::string> parts;
    for (const auto& [name, value] : g.hyperparams) {
      parts.push_back(absl::StrCat(Quote(name), ": ", DescribeHyper(value)));
    }
    std::vector<std::string> params;
    for (const ParamKey& k : g.params) params.push_back(DescribeKey(k));
    parts.push_back(
        absl::StrCat("'params': [", absl::StrJoin(params, ", "), "]"));
    absl::StrAppend(&out, "\n  {", absl::StrJoin(parts, ", "), "}");
  }
  absl::StrAppend(&out, "]}");
  return out;
}

int64_t TensorBytes(const OptimStateDict& dict) {
  int64_t total = 0;
  for (const auto& [key, state] : dict.state) {
    for (const auto& [name, value] : state) {
      if (const auto* t = std::get_if<HostTensor>(&value)) {
        total += static_cast<int64_t>(t->nbytes());
      }
    }
  }
  return total;
}

std::vector<std::string> ModelParamOrder(const ModelLayout& layout) {
  std::vector<std::string> order;
  for (const ParamSpec& p : layout.spec().params) {
    if (p.tied_to.empty()) order.push_back(p.fqn);
  }
  return order;
}

absl::StatusOr<OptimStateDict> RekeyOptimStateDict(
    const OptimStateDict& dict, OptimStateKeyType to,
    absl::Span<const std::string> param_order) {
  absl::flat_hash_map<std::string, int64_t> id_of;
  for (size_t i = 0; i < param_order.size(); ++i) {
    if (!id_of.emplace(param_order[i], static_cast<int64_t>(i)).second) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "rekey_optim_state_dict: the parameter order names '%s' twice "
          "(at IDs %d and %d)",
          param_order[i], id_of[param_order[i]], i));
    }
  }
  const int64_t n = static_cast<int64_t>(param_order.size());
  auto map_key = [&](const ParamKey& key,
                     const std::string& where) -> absl::StatusOr<ParamKey> {
    if (to == OptimStateKeyType::kParamName) {
      const auto* id = std::get_if<int64_t>(&key);
      if (id == nullptr) return key;
      if (*id < 0 || *id >= n) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "rekey_optim_state_dict: %s has parameter ID %d, but the "
            "optimizer has %d parameters (IDs 0..%d)",
            where, *id, n, n - 1));
      }
      return ParamKey(param_order[*id]);
    }
    const auto* name = std::get_if<std::string>(&key);
    if (name == nullptr) return key;
    auto it = id_of.find(*name);
    return it == id_of.end() ? key : ParamKey(it->second);
  };

  OptimStateDict out;
  for (const auto& [key, state] : dict.state) {
    FLATPARAM_ASSIGN_OR_RETURN(
        ParamKey new_key,
        map_key(key, absl::StrCat("state key ", DescribeKey(key))));
    if (!out.state.emplace(new_key, state).second) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "rekey_optim_state_dict: state key %s becomes %s, which another "
          "state key also becomes",
          DescribeKey(key), DescribeKey(new_key)));
    }
  }
  for (size_t g = 0; g < dict.param_groups.size(); ++g) {
    ParamGroup group;
    group.hyperparams = dict.param_groups[g].hyperparams;
    for (const ParamKey& key : dict.param_groups[g].params) {
      FLATPARAM_ASSIGN_OR_RETURN(
          ParamKey new_key,
          map_key(key, absl::StrFormat("param_groups[%d]", g)));
      group.params.push_back(std::move(new_key));
    }
    out.param_groups.push_back(std::move(group));
  }
  return out;
}

absl::StatusOr<OptimStateDict> RekeyOptimStateDict(const OptimStateDict& dict,
                                                   OptimStateKeyType to,
                                                   const ModelLayout& layout) {
  const std::vector<std::string> order = ModelParamOrder(layout);
  return RekeyOptimStateDict(dict, to, order);
}

}  // namespace optim
}  // namespace flatparam
