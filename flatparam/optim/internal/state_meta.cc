#include "flatparam/optim/internal/state_meta.h"

#include <cstring>
#include <limits>
#include <utility>

#include "absl/strings/str_format.h"
#include "flatparam/base/shape.h"

namespace flatparam {
namespace optim {
namespace internal_optim {
namespace {

enum ValueTag : uint8_t {
  kNone = 0,
  kTensorMeta = 1,
  kTensorData = 2,
  kInt = 3,
  kDouble = 4,
  kBool = 5,
  kString = 6,
};

enum HyperTag : uint8_t {
  kHyperNone = 0,
  kHyperBool = 1,
  kHyperInt = 2,
  kHyperDouble = 3,
  kHyperString = 4,
  kHyperTuple = 5,
};

constexpr uint8_t kNumDTypes = static_cast<uint8_t>(DType::kBool) + 1;
constexpr int64_t kMaxRank = 64;
constexpr int64_t kMaxNumel = int64_t{1} << 56;

}  // namespace

const HostTensor* ValueMeta::data() const {
  if (tensor != nullptr) return tensor;
  return std::get_if<HostTensor>(&value);
}

OptimStateValue ValueMeta::Materialize() const {
  if (!pos_dim) return value;
  return *data();
}

std::string ValueMeta::Describe() const {
  if (!pos_dim) return DescribeValue(value);
  return absl::StrFormat("tensor(%s, %s)", DTypeName(dtype),
                         ShapeString(shape));
}

ParamStateMeta MetaOf(const ParamState& state) {
  ParamStateMeta meta;
  for (const auto& [name, value] : state) {
    ValueMeta& m = meta[name];
    const auto* t = std::get_if<HostTensor>(&value);
    if (t != nullptr && !t->shape().empty()) {
      m.pos_dim = true;
      m.dtype = t->dtype();
      m.shape = t->shape();
      m.tensor = t;
    } else {
      m.value = value;
    }
  }
  return meta;
}

StateMeta MetaOf(const std::map<ParamKey, ParamState>& state) {
  StateMeta meta;
  for (const auto& [key, s] : state) meta.emplace(key, MetaOf(s));
  return meta;
}

void Encoder::I64(int64_t v) { Raw(&v, sizeof v); }

void Encoder::Str(absl::string_view s) {
  I64(static_cast<int64_t>(s.size()));
  out_.append(s.data(), s.size());
}

void Encoder::Raw(const void* data, size_t n) {
  out_.append(static_cast<const char*>(data), n);
}

void Encoder::Key(const ParamKey& key) {
  if (const auto* id = std::get_if<int64_t>(&key)) {
    U8(0);
    I64(*id);
  } else {
    U8(1);
    Str(std::get<std::string>(key));
  }
}

void Encoder::Value(const OptimStateValue& v, bool with_data) {
  struct Visitor {
    Encoder& e;
    bool with_data;
    void operator()(std::monostate) const { e.U8(kNone); }
    void operator()(const HostTensor& t) const {
      const bool data = with_data || t.shape().empty();
      e.U8(data ? kTensorData : kTensorMeta);
      e.U8(static_cast<uint8_t>(t.dtype()));
      e.I64(static_cast<int64_t>(t.shape().size()));
      for (int64_t d : t.shape()) e.I64(d);
      if (data) e.Raw(t.data(), t.nbytes());
    }
    void operator()(int64_t i) const {
      e.U8(kInt);
      e.I64(i);
    }
    void operator()(double d) const {
      e.U8(kDouble);
      e.Raw(&d, sizeof d);
    }
    void operator()(bool b) const {
      e.U8(kBool);
      e.U8(b ? 1 : 0);
    }
    void operator()(const std::string& s) const {
      e.U8(kString);
      e.Str(s);
    }
  };
  std::visit(Visitor{*this, with_data}, v);
}

void Encoder::Value(const ValueMeta& v, bool with_data) {
  if (!v.pos_dim) {
    Value(v.value, with_data);
    return;
  }
  const HostTensor* t = v.data();
  if (with_data && t != nullptr) {
    Value(OptimStateValue(*t), true);
    return;
  }
  U8(kTensorMeta);
  U8(static_cast<uint8_t>(v.dtype));
  I64(static_cast<int64_t>(v.shape.size()));
  for (int64_t d : v.shape) I64(d);
}

void Encoder::Hyper(const HyperValue& v) {
  struct Visitor {
    Encoder& e;
    void operator()(std::monostate) const { e.U8(kHyperNone); }
    void operator()(bool b) const {
      e.U8(kHyperBool);
      e.U8(b ? 1 : 0);
    }
    void operator()(int64_t i) const {
      e.U8(kHyperInt);
      e.I64(i);
    }
    void operator()(double d) const {
      e.U8(kHyperDouble);
      e.Raw(&d, sizeof d);
    }
    void operator()(const std::string& s) const {
      e.U8(kHyperString);
      e.Str(s);
    }
    void operator()(const std::vector<double>& v) const {
      e.U8(kHyperTuple);
      e.I64(static_cast<int64_t>(v.size()));
      for (double d : v) e.Raw(&d, sizeof d);
    }
  };
  std::visit(Visitor{*this}, v);
}

void Encoder::Group(const ParamGroup& g) {
  I64(static_cast<int64_t>(g.hyperparams.size()));
  for (const auto& [name, value] : g.hyperparams) {
    Str(name);
    Hyper(value);
  }
  I64(static_cast<int64_t>(g.params.size()));
  for (const ParamKey& k : g.params) Key(k);
}

bool Decoder::U8(uint8_t* v) { return Raw(v, 1); }

bool Decoder::I64(int64_t* v) { return Raw(v, sizeof *v); }

bool Decoder::Raw(void* data, size_t n) {
  if (in_.size() < n) return false;
  if (n > 0) std::memcpy(data, in_.data(), n);
  in_.remove_prefix(n);
  return true;
}

bool Decoder::Str(std::string* s) {
  int64_t n;
  if (!I64(&n) || n < 0 || static_cast<uint64_t>(n) > in_.size()) {
    return false;
  }
  s->assign(in_.data(), n);
  in_.remove_prefix(n);
  return true;
}

bool Decoder::Key(ParamKey* key) {
  uint8_t tag;
  if (!U8(&tag)) return false;
  if (tag == 0) {
    int64_t id;
    if (!I64(&id)) return false;
    *key = id;
    return true;
  }
  std::string name;
  if (tag != 1 || !Str(&name)) return false;
  *key = std::move(name);
  return true;
}

bool Decoder::Value(ValueMeta* v) {
  *v = ValueMeta();
  uint8_t tag;
  if (!U8(&tag)) return false;
  switch (tag) {
    case kNone:
      v->value = std::monostate();
      return true;
    case kTensorMeta:
    case kTensorData: {
      uint8_t dtype;
      int64_t rank;
      if (!U8(&dtype) || dtype >= kNumDTypes || !I64(&rank) || rank < 0 ||
          rank > kMaxRank) {
        return false;
      }
      std::vector<int64_t> shape(rank);
      int64_t numel = 1;
      for (int64_t& d : shape) {
        if (!I64(&d) || d < 0 || d > kMaxNumel) return false;
        numel =
            d == 0 ? 0 : (numel > kMaxNumel / d ? kMaxNumel + 1 : numel * d);
      }
      if (numel > kMaxNumel) return false;
      if (tag == kTensorMeta) {
        if (rank == 0) return false;
        v->pos_dim = true;
        v->dtype = static_cast<DType>(dtype);
        v->shape = std::move(shape);
        return true;
      }
      const size_t bytes =
          static_cast<size_t>(numel) * DTypeSize(static_cast<DType>(dtype));
      if (bytes > in_.size()) return false;
      HostTensor t(static_cast<DType>(dtype), shape);
      if (!Raw(t.data(), bytes)) return false;
      v->pos_dim = rank > 0;
      v->dtype = t.dtype();
      v->shape = std::move(shape);
      v->value = std::move(t);
      return true;
    }
    case kInt: {
      int64_t i;
      if (!I64(&i)) return false;
      v->value = i;
      return true;
    }
    case kDouble: {
      double d;
      if (!Raw(&d, sizeof d)) return false;
      v->value = d;
      return true;
    }
    case kBool: {
      uint8_t b;
      if (!U8(&b) || b > 1) return false;
      v->value = b == 1;
      return true;
    }
    case kString: {
      std::string s;
      if (!Str(&s)) return false;
      v->value = std::move(s);
      return true;
    }
    default:
      return false;
  }
}

bool Decoder::Hyper(HyperValue* v) {
  uint8_t tag;
  if (!U8(&tag)) return false;
  switch (tag) {
    case kHyperNone:
      *v = std::monostate();
      return true;
    case kHyperBool: {
      uint8_t b;
      if (!U8(&b) || b > 1) return false;
      *v = b == 1;
      return true;
    }
    case kHyperInt: {
      int64_t i;
      if (!I64(&i)) return false;
      *v = i;
      return true;
    }
    case kHyperDouble: {
      double d;
      if (!Raw(&d, sizeof d)) return false;
      *v = d;
      return true;
    }
    case kHyperString: {
      std::string s;
      if (!Str(&s)) return false;
      *v = std::move(s);
      return true;
    }
    case kHyperTuple: {
      int64_t n;
      if (!I64(&n) || n < 0 ||
          static_cast<uint64_t>(n) > in_.size() / sizeof(double)) {
        return false;
      }
      std::vector<double> t(n);
      for (double& d : t) {
        if (!Raw(&d, sizeof d)) return false;
      }
      *v = std::move(t);
      return true;
    }
    default:
      return false;
  }
}

bool Decoder::Group(ParamGroup* g) {
  *g = ParamGroup();
  int64_t n;
  if (!I64(&n) || n < 0 || static_cast<uint64_t>(n) > in_.size()) return false;
  for (int64_t i = 0; i < n; ++i) {
    std::string name;
    HyperValue value;
    if (!Str(&name) || !Hyper(&value)) return false;
    g->hyperparams[name] = std::move(value);
  }
  if (!I64(&n) || n < 0 || static_cast<uint64_t>(n) > in_.size()) return false;
  g->params.resize(n);
  for (ParamKey& k : g->params) {
    if (!Key(&k)) return false;
  }
  return true;
}

}  // namespace internal_optim
}  // namespace optim
}  // namespace flatparam
