#include "flatparam/optim/optim_generators.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <utility>

#include "flatparam/flatten.h"

namespace flatparam {
namespace optim {

void showValue(const OptimStateDict& dict, std::ostream& os) {
  os << DebugString(dict);
}

namespace testing {
namespace {

namespace gen = rc::gen;

enum class Kind { kAdamW, kSgdMomentum, kSgdNone, kCustom };

// Arbitrary bytes: every bit pattern, NaNs and subnormals included.
HostTensor RandomTensor(DType dtype, std::vector<int64_t> shape,
                        std::mt19937_64& rng) {
  HostTensor t(dtype, std::move(shape));
  auto* p = static_cast<unsigned char*>(t.data());
  for (size_t i = 0; i < t.nbytes(); ++i)
    p[i] = static_cast<unsigned char>(rng());
  return t;
}

std::vector<std::string> TensorNames(Kind kind) {
  switch (kind) {
    case Kind::kAdamW:
      return {"exp_avg", "exp_avg_sq"};
    case Kind::kSgdMomentum:
      return {"momentum_buffer"};
    case Kind::kSgdNone:
      return {};
    case Kind::kCustom:
      return {"exp_avg"};
  }
  return {};
}

// The states every parameter shares (flat path) or one parameter has.
ParamState Scalars(Kind kind, std::mt19937_64& rng) {
  ParamState st;
  switch (kind) {
    case Kind::kAdamW:
      st["step"] =
          ScalarTensor(DType::kFloat32, static_cast<double>(1 + rng() % 1000));
      break;
    case Kind::kSgdMomentum:
      break;
    case Kind::kSgdNone:
      st["momentum_buffer"] = std::monostate();
      break;
    case Kind::kCustom:
      st["count"] = static_cast<int64_t>(rng() % 100000) - 50000;
      st["scale"] = std::ldexp(static_cast<double>(rng() % 4096), -7);
      st["flag"] = rng() % 2 == 0;
      st["tag"] = std::string(rng() % 2 == 0 ? "adam" : "lamb\x01\xff");
      break;
  }
  return st;
}

OptimStateDict Generate(const ModelLayout& layout, bool use_orig_params) {
  const Kind kind = *gen::weightedElement<Kind>({{4, Kind::kAdamW},
                                                 {2, Kind::kSgdMomentum},
                                                 {1, Kind::kSgdNone},
                                                 {2, Kind::kCustom}});
  std::mt19937_64 rng(*gen::arbitrary<uint64_t>());
  OptimStateDict d;
  const auto& units = layout.flat_params();
  for (const FlatParamLayout& unit : units) {
    if (!*gen::weightedElement<bool>({{4, true}, {1, false}})) continue;
    const DType tdtype = *gen::weightedElement<DType>(
        {{3, DType::kFloat32}, {2, unit.dtype()}, {1, DType::kFloat64}});
    const std::vector<std::string> tensor_names = TensorNames(kind);
    const auto& params = unit.params();
    if (!use_orig_params) {
      const bool has_0d =
          std::any_of(params.begin(), params.end(),
                      [](const ParamInfo& p) { return p.shape.empty(); });
      // PyTorch cannot flatten tensor state with a 0-d parameter in the
      // flat parameter.
      if (has_0d && !tensor_names.empty()) continue;
      const ParamState scalars = Scalars(kind, rng);
      // Parameters may lack state only when nothing is replicated.
      const bool may_miss = scalars.empty();
      std::vector<bool> has(params.size(), true);
      if (may_miss) {
        for (size_t i = 0; i < params.size(); ++i) {
          has[i] = *gen::weightedElement<bool>({{3, true}, {1, false}});
        }
        if (std::none_of(has.begin(), has.end(), [](bool b) { return b; })) {
          has[0] = true;
        }
      }
      for (size_t i = 0; i < params.size(); ++i) {
        if (!has[i]) continue;
        ParamState st = scalars;
        for (const std::string& name : tensor_names) {
          st[name] = RandomTensor(tdtype, params[i].shape, rng);
        }
        d.state[params[i].fqn] = std::move(st);
      }
      continue;
    }
    for (const ParamInfo& p : params) {
      const bool has = p.requires_grad ||
                       *gen::weightedElement<bool>({{1, true}, {2, false}});
      if (!has) continue;
      ParamState st = Scalars(kind, rng);
      for (const std::string& name : tensor_names) {
        // A 0-d parameter's state is 0-d, hence replicated.
        st[name] = RandomTensor(p.shape.empty() ? DType::kFloat32 : tdtype,
                                p.shape, rng);
      }
      d.state[p.fqn] = std::move(st);
    }
  }
  if (*gen::weightedElement<bool>({{2, false}, {1, true}})) {
    ParamState& st = d.state[UnmanagedParams()[0]];
    st["momentum_buffer"] = RandomTensor(DType::kFloat32, {5}, rng);
    st["step"] = ScalarTensor(DType::kFloat32, 7);
  }
  if (*gen::weightedElement<bool>({{3, false}, {1, true}})) {
    d.state[kUserKey]["counter"] = static_cast<int64_t>(rng() % 1000);
  }

  // Groups in the order consolidation lists them: whole flat parameters in
  // order, then the unmanaged parameters.
  const int num_groups = units.size() > 1 ? *gen::inRange(1, 3) : 1;
  std::vector<ParamGroup> groups(num_groups);
  for (int g = 0; g < num_groups; ++g) {
    groups[g].hyperparams["lr"] = std::ldexp(static_cast<double>(g + 1), -10);
    groups[g].hyperparams["betas"] = std::vector<double>{0.9, 0.999};
    groups[g].hyperparams["weight_decay"] = 0.01;
    groups[g].hyperparams["amsgrad"] = false;
    groups[g].hyperparams["foreach"] = std::monostate();
    groups[g].hyperparams["name"] = std::string("group") + std::to_string(g);
    groups[g].hyperparams["initial_step"] = int64_t{g};
  }
  for (const FlatParamLayout& unit : units) {
    const int g = *gen::inRange(0, num_groups);
    for (const ParamInfo& p : unit.params()) {
      groups[g].params.push_back(p.fqn);
    }
  }
  for (const std::string& name : UnmanagedParams()) {
    groups[0].params.push_back(name);
  }
  for (ParamGroup& g : groups) {
    if (!g.params.empty()) d.param_groups.push_back(std::move(g));
  }
  return d;
}

}  // namespace

rc::Gen<OptimStateDict> GenFullOptimStateDict(const ModelLayout& layout,
                                              bool use_orig_params) {
  return gen::exec([layout, use_orig_params] {
           return Generate(layout, use_orig_params);
         })
      .as("full optimizer state dict");
}

OptimStateDict ExpectedRoundTrip(const ModelLayout& layout,
                                 const OptimStateDict& full,
                                 bool use_orig_params) {
  if (use_orig_params) return full;
  OptimStateDict out = full;
  for (const FlatParamLayout& unit : layout.flat_params()) {
    const auto& params = unit.params();
    std::vector<const ParamState*> states(params.size(), nullptr);
    const ParamState* first = nullptr;
    for (size_t i = 0; i < params.size(); ++i) {
      auto it = full.state.find(params[i].fqn);
      if (it == full.state.end()) continue;
      states[i] = &it->second;
      if (first == nullptr) first = &it->second;
    }
    if (first == nullptr) continue;
    for (const auto& [name, unused] : *first) {
      const HostTensor* tensor = nullptr;
      OptimStateValue scalar = std::monostate();
      for (const ParamState* st : states) {
        if (st == nullptr) continue;
        const OptimStateValue& v = st->at(name);
        if (IsPosDimTensor(v)) tensor = &std::get<HostTensor>(v);
        if (!std::holds_alternative<std::monostate>(v) &&
            std::holds_alternative<std::monostate>(scalar)) {
          scalar = v;
        }
      }
      for (size_t i = 0; i < params.size(); ++i) {
        OptimStateValue& dst = out.state[params[i].fqn][name];
        if (tensor == nullptr) {
          dst = scalar;
        } else if (states[i] == nullptr ||
                   !IsPosDimTensor(states[i]->at(name))) {
          dst = HostTensor(tensor->dtype(), params[i].shape);
        }
      }
    }
  }
  return out;
}

}  // namespace testing
}  // namespace optim
}  // namespace flatparam
