#include "refmodel/train_state.h"

#include <utility>

#include "absl/strings/str_format.h"
#include "flatparam/base/status_macros.h"

namespace flatparam {
namespace refmodel {
namespace {

using optim::DescribeKey;
using optim::DescribeValue;
using optim::OptimStateDict;
using optim::OptimStateValue;
using optim::ParamKey;
using optim::ParamState;

ParamState ToParamState(const OptimizerState& state) {
  ParamState out;
  for (const auto& [name, tensor] : state.tensors) out[name] = tensor;
  return out;
}

absl::StatusOr<OptimizerState> ToTrainState(const ParamKey& key,
                                            const ParamState& state) {
  OptimizerState out;
  for (const auto& [name, value] : state) {
    if (std::holds_alternative<std::monostate>(value)) continue;
    const auto* t = std::get_if<HostTensor>(&value);
    if (t == nullptr) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "state %s of %s is %s, but the training optimizers keep tensors "
          "only",
          name, DescribeKey(key), DescribeValue(value)));
    }
    out.tensors[name] = *t;
  }
  return out;
}

}  // namespace

OptimStateDict ShardedFromTrainStates(absl::Span<const OptimizerState> states) {
  OptimStateDict out;
  for (size_t i = 0; i < states.size(); ++i) {
    if (states[i].tensors.empty()) continue;
    out.state[ParamKey(static_cast<int64_t>(i))] = ToParamState(states[i]);
  }
  return out;
}

absl::StatusOr<std::vector<OptimizerState>> TrainStatesFromSharded(
    const ModelLayout& layout, const OptimStateDict& sharded) {
  const int64_t n = static_cast<int64_t>(layout.flat_params().size());
  std::vector<OptimizerState> out(n);
  for (const auto& [key, state] : sharded.state) {
    const auto* id = std::get_if<int64_t>(&key);
    if (id == nullptr || *id < 0 || *id >= n) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "state key %s is not a flat-parameter index of the model (it has "
          "%d flat parameters)",
          DescribeKey(key), n));
    }
    FLATPARAM_ASSIGN_OR_RETURN(out[*id], ToTrainState(key, state));
  }
  return out;
}

OptimStateDict FullFromTrainStates(
    const std::map<std::string, OptimizerState>& states) {
  OptimStateDict out;
  for (const auto& [fqn, state] : states) {
    out.state[ParamKey(fqn)] = ToParamState(state);
  }
  return out;
}

absl::StatusOr<std::map<std::string, OptimizerState>> TrainStatesFromFull(
    const OptimStateDict& full) {
  std::map<std::string, OptimizerState> out;
  for (const auto& [key, state] : full.state) {
    const auto* fqn = std::get_if<std::string>(&key);
    if (fqn == nullptr) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "state key %s is a parameter ID; re-key the dict by name first "
          "(RekeyOptimStateDict)",
          DescribeKey(key)));
    }
    FLATPARAM_ASSIGN_OR_RETURN(out[*fqn], ToTrainState(key, state));
  }
  return out;
}

}  // namespace refmodel
}  // namespace flatparam
