// FsdpModule's optimizer state as flatparam's optimizer-state dicts (both
// FSDP paths, hyperparameters restored on request), and its sharded
// checkpoints.
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/sgd.h>
#include <torch/types.h>
#include <torch/utils.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/checkpoint/checkpoint_dir.h"
#include "flatparam/checkpoint/collective_checkpoint.h"
#include "flatparam/checkpoint/convert.h"
#include "flatparam/checkpoint/training_checkpoints.h"
#include "flatparam/checkpoint/training_state.h"
#include "flatparam/torch/fsdp_module.h"
#include "flatparam/torch/internal/fsdp_module_internal.h"

namespace flatparam {
namespace libtorch {

using internal_fsdp_module::FromTorch;
using internal_fsdp_module::OptionsOn;

namespace {

optim::OptimStateValue ToHost(const torch::Tensor& t) {
  const torch::Tensor c = t.detach().to(torch::kCPU).contiguous();
  DType dtype = FromTorch(c.scalar_type()).value_or(DType::kFloat32);
  HostTensor out(dtype,
                 std::vector<int64_t>(c.sizes().begin(), c.sizes().end()));
  std::memcpy(out.data(), c.data_ptr(), out.nbytes());
  return out;
}

// The optimizer's kind and its PyTorch hyperparameters.
struct OptimizerKind {
  enum { kSgd, kAdam } kind;
  const char* name;
};

absl::StatusOr<OptimizerKind> KindOf(torch::optim::Optimizer& optimizer) {
  if (dynamic_cast<torch::optim::SGD*>(&optimizer) != nullptr) {
    return OptimizerKind{OptimizerKind::kSgd, "SGD"};
  }
  if (dynamic_cast<torch::optim::AdamW*>(&optimizer) != nullptr) {
    return OptimizerKind{OptimizerKind::kAdam, "AdamW"};
  }
  if (dynamic_cast<torch::optim::Adam*>(&optimizer) != nullptr) {
    return OptimizerKind{OptimizerKind::kAdam, "Adam"};
  }
  return absl::InvalidArgumentError(
      "optimizer state: only torch::optim::SGD, Adam and AdamW are "
      "supported");
}

// Adam's and AdamW's options: the same fields, two classes.
template <typename Options>
void AdamHyperparams(const Options& o,
                     std::map<std::string, optim::HyperValue>& h) {
  h["lr"] = o.lr();
  h["betas"] =
      std::vector<double>{std::get<0>(o.betas()), std::get<1>(o.betas())};
  h["eps"] = o.eps();
  h["weight_decay"] = o.weight_decay();
  h["amsgrad"] = o.amsgrad();
}

std::map<std::string, optim::HyperValue> Hyperparams(
    const torch::optim::OptimizerOptions& options) {
  std::map<std::string, optim::HyperValue> h;
  h["maximize"] = false;
  if (auto* o = dynamic_cast<const torch::optim::SGDOptions*>(&options)) {
    h["lr"] = o->lr();
    h["momentum"] = o->momentum();
    h["dampening"] = o->dampening();
    h["weight_decay"] = o->weight_decay();
    h["nesterov"] = o->nesterov();
  } else if (auto* o =
                 dynamic_cast<const torch::optim::AdamWOptions*>(&options)) {
    AdamHyperparams(*o, h);
  } else if (auto* o =
                 dynamic_cast<const torch::optim::AdamOptions*>(&options)) {
    AdamHyperparams(*o, h);
  }
  return h;
}

// Adam's and AdamW's per-parameter states: the same fields, two classes.
template <typename State>
std::unique_ptr<torch::optim::OptimizerParamState> MakeAdamState(
    int64_t step, torch::Tensor avg, torch::Tensor avg_sq,
    torch::Tensor max_avg_sq) {
  auto state = std::make_unique<State>();
  state->step(step);
  state->exp_avg(std::move(avg));
  state->exp_avg_sq(std::move(avg_sq));
  state->max_exp_avg_sq(std::move(max_avg_sq));
  return state;
}

// PyTorch's names; "step" a 0-d float32 tensor, as PyTorch >= 1.12 keeps it.
template <typename State>
void ReadAdamState(const State& state, optim::ParamState& out) {
  out["step"] =
      optim::ScalarTensor(DType::kFloat32, static_cast<double>(state.step()));
  out["exp_avg"] = ToHost(state.exp_avg());
  out["exp_avg_sq"] = ToHost(state.exp_avg_sq());
  if (state.max_exp_avg_sq().defined()) {
    out["max_exp_avg_sq"] = ToHost(state.max_exp_avg_sq());
  }
}

// `t`'s key in an optimizer's state(): its TensorImpl's address, printed
// (LibTorch 1.13, as c10::guts::to_string prints it) or not (2.x).
template <typename Key>
Key StateKeyOf(const torch::Tensor& t) {
  if constexpr (std::is_same_v<Key, std::string>) {
    std::ostringstream address;
    address << t.unsafeGetTensorImpl();
    return address.str();
  } else {
    return static_cast<Key>(t.unsafeGetTensorImpl());
  }
}

}  // namespace

absl::StatusOr<checkpoint::RankState> FsdpModule::CheckpointState(
    torch::optim::Optimizer* optimizer, const nlohmann::json& extra) {
  FLATPARAM_RETURN_IF_ERROR(BetweenIterations("CheckpointState"));
  return CopyCheckpointState(optimizer, extra);
}

absl::StatusOr<checkpoint::RankState> FsdpModule::CopyCheckpointState(
    torch::optim::Optimizer* optimizer, const nlohmann::json& extra) {
  const ModelLayout& model = layout();
  checkpoint::RankState mine;
  // This rank's buffers in their own dtype (a buffer_dtype cast undone), as
  // the spec lists them.
  for (size_t b = 0; b < buffers_.size(); ++b) {
    const torch::Tensor c =
        buffers_[b].second.to(buffer_dtypes_[b]).to(torch::kCPU).contiguous();
    const BufferSpec& spec = model.spec().buffers[b];
    HostTensor t = HostTensor::Uninitialized(spec.dtype, spec.shape);
    std::memcpy(t.data(), c.data_ptr(), t.nbytes());
    mine.buffers.emplace(buffers_[b].first, std::move(t));
  }
  for (int u = 0; u < runtime_->num_units(); ++u) {
    BufferRef shard = runtime_->handle(u).sharded_param();
    HostTensor t = HostTensor::Uninitialized(shard.dtype, {shard.count});
    // LibTorch's copy, in order with the optimizer's kernels that wrote it.
    const torch::Tensor c = Over(shard).to(torch::kCPU);
    std::memcpy(t.data(), c.data_ptr(), t.nbytes());
    mine.flat_params.push_back(std::move(t));
  }
  if (optimizer != nullptr) {
    FLATPARAM_ASSIGN_OR_RETURN(optim::OptimStateDict state,
                               ShardedOptimState(*optimizer));
    if (use_orig_params_) {
      FLATPARAM_ASSIGN_OR_RETURN(state, OrigToFlatOptimState(state));
    }
    mine.optim = std::move(state);
  }
  mine.extra = extra;
  return mine;
}

absl::Status FsdpModule::SaveCheckpoint(checkpoint::FileSystem& fs,
                                        const std::string& dir,
                                        torch::optim::Optimizer* optimizer,
                                        const nlohmann::json& extra) {
  checkpoint::CollectiveWriteOptions options;
  options.collective = runtime_->options().collective_options;
  // A rank whose state cannot be made still takes part: it fails every
  // rank in the exchange instead of leaving them there.
  const absl::Status between = BetweenIterations("SaveCheckpoint");
  return checkpoint::WriteRankStateCollective(
      fs, dir, layout(), *world_,
      between.ok() ? CopyCheckpointState(optimizer, extra)
                   : absl::StatusOr<checkpoint::RankState>(between),
      options);
}

absl::Status FsdpModule::LoadCheckpoint(checkpoint::FileSystem& fs,
                                        const std::string& dir,
                                        torch::optim::Optimizer* optimizer,
                                        nlohmann::json* extra,
                                        bool restore_hyperparameters) {
  Communicator& world = *world_;
  const ModelLayout& model = layout();
  const int64_t shard_rank = world.rank() % model.options().world_size;
  OptimizerStates optimizer_states;
  std::vector<std::map<std::string, optim::HyperValue>> hyperparams;
  auto load = [&]() -> absl::StatusOr<checkpoint::RankState> {
    FLATPARAM_RETURN_IF_ERROR(BetweenIterations("LoadCheckpoint"));
    checkpoint::CheckpointOpenOptions open;
    open.ranks = std::vector<int64_t>{};
    FLATPARAM_ASSIGN_OR_RETURN(
        checkpoint::ShardedCheckpointReader reader,
        checkpoint::ShardedCheckpointReader::Open(fs, dir, open));
    FLATPARAM_ASSIGN_OR_RETURN(
        checkpoint::RankState state,
        checkpoint::LoadRankState(reader, model, world.size(), shard_rank));
    if (optimizer != nullptr && state.optim.state.empty()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "the checkpoint at ", dir,
          " holds no optimizer state; load it without an optimizer to "
          "start the optimizer afresh"));
    }
    if (optimizer != nullptr && use_orig_params_) {
      FLATPARAM_ASSIGN_OR_RETURN(optim::OptimStateDict orig,
                                 FlatToOrigOptimState(state.optim));
      FLATPARAM_ASSIGN_OR_RETURN(optimizer_states,
                                 ParseOptimState(orig, *optimizer));
    } else if (optimizer != nullptr) {
      FLATPARAM_ASSIGN_OR_RETURN(optimizer_states,
                                 ParseOptimState(state.optim, *optimizer));
    }
    if (optimizer != nullptr && restore_hyperparameters) {
      FLATPARAM_ASSIGN_OR_RETURN(hyperparams,
                                 ParseHyperparams(state.optim, *optimizer));
    }
    for (int u = 0; u < runtime_->num_units(); ++u) {
      BufferRef shard = runtime_->handle(u).sharded_param();
      const HostTensor& t = state.flat_params[u];
      if (t.dtype() != shard.dtype || t.numel() != shard.count) {
        return absl::FailedPreconditionError(absl::StrCat(
            "the checkpoint's shard of unit ", u, " has ", t.numel(), " ",
            DTypeName(t.dtype()), " elements; this rank's has ", shard.count,
            " ", DTypeName(shard.dtype)));
      }
    }
    return state;
  };
  absl::StatusOr<checkpoint::RankState> state = load();
  FLATPARAM_RETURN_IF_ERROR(checkpoint::AgreeOnLoad(
      world, state.status(), runtime_->options().collective_options));
  if (optimizer != nullptr) {
    InstallOptimState(std::move(optimizer_states), *optimizer);
    if (restore_hyperparameters) InstallHyperparams(hyperparams, *optimizer);
  }
  for (int u = 0; u < runtime_->num_units(); ++u) {
    BufferRef shard = runtime_->handle(u).sharded_param();
    const HostTensor& saved = state->flat_params[u];
    torch::NoGradGuard no_grad;
    Over(shard).copy_(
        torch::from_blob(const_cast<void*>(saved.data()), {saved.numel()},
                         OptionsOn(saved.dtype(), c10::Device(c10::kCPU))));
  }
  {
    torch::NoGradGuard no_grad;
    for (auto& [name, b] : buffers_) {
      const HostTensor& saved = state->buffers.at(name);
      // copy_ casts to the buffer_dtype the module runs with.
      b.copy_(torch::from_blob(
          const_cast<void*>(saved.data()),
          std::vector<int64_t>(saved.shape().begin(), saved.shape().end()),
          torch::TensorOptions().dtype(
              internal_fsdp_module::ToTorch(saved.dtype()))));
    }
  }
  if (extra != nullptr) *extra = state->extra;
  return absl::OkStatus();
}

int FsdpModule::OptimizerTensorIndex(const torch::Tensor& t) const {
  for (size_t k = 0; k < optimizer_tensors_.size(); ++k) {
    if (optimizer_tensors_[k].unsafeGetTensorImpl() ==
        t.unsafeGetTensorImpl()) {
      return static_cast<int>(k);
    }
  }
  return -1;
}

absl::StatusOr<optim::OptimStateDict> FsdpModule::ShardedOptimState(
    torch::optim::Optimizer& optimizer) const {
  FLATPARAM_ASSIGN_OR_RETURN(OptimizerKind kind, KindOf(optimizer));
  optim::OptimStateDict dict;
  for (auto& group : optimizer.param_groups()) {
    optim::ParamGroup out;
    out.hyperparams = Hyperparams(group.options());
    for (const torch::Tensor& p : group.params()) {
      const int k = OptimizerTensorIndex(p);
      if (k < 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "optimizer state: the ", kind.name,
            " optimizer steps a tensor that is not one of this module's "
            "ShardedParameters() (shape ",
            c10::str(p.sizes()), ")"));
      }
      const optim::ParamKey key =
          use_orig_params_ ? optim::ParamKey(orig_params_[k].fqn)
                           : optim::ParamKey(static_cast<int64_t>(k));
      out.params.push_back(key);
      auto state = optimizer.state().find(StateKeyOf<OptimizerStateKey>(p));
      if (state == optimizer.state().end()) continue;
      optim::ParamState& mine = dict.state[key];
      if (kind.kind == OptimizerKind::kSgd) {
        auto& s = static_cast<torch::optim::SGDParamState&>(*state->second);
        if (s.momentum_buffer().defined()) {
          mine["momentum_buffer"] = ToHost(s.momentum_buffer());
        }
      } else {
        // AdamWParamState has AdamParamState's fields in another class.
        if (auto* w = dynamic_cast<torch::optim::AdamWParamState*>(
                state->second.get())) {
          ReadAdamState(*w, mine);
        } else {
          ReadAdamState(
              static_cast<torch::optim::AdamParamState&>(*state->second), mine);
        }
      }
      if (mine.empty()) dict.state.erase(key);
    }
    dict.param_groups.push_back(std::move(out));
  }
  return dict;
}

absl::StatusOr<FsdpModule::OptimizerStates> FsdpModule::ParseOptimState(
    const optim::OptimStateDict& sharded,
    torch::optim::Optimizer& optimizer) const {
  FLATPARAM_ASSIGN_OR_RETURN(OptimizerKind kind, KindOf(optimizer));
  // What a key names, for messages.
  auto what = [&](int k) {
    return use_orig_params_
               ? absl::StrCat("parameter \"", orig_params_[k].fqn, "\"")
               : absl::StrCat("unit ", k, " (\"", units_[k]->name, "\")");
  };
  // Validate everything first, then replace the state.
  auto tensor = [&](int k, const optim::ParamState& state,
                    const std::string& name,
                    bool required) -> absl::StatusOr<torch::Tensor> {
    auto it = state.find(name);
    if (it == state.end()) {
      if (!required) return torch::Tensor();
      return absl::InvalidArgumentError(
          absl::StrCat("optimizer state of ", what(k), ": no \"", name,
                       "\", which ", kind.name, " keeps"));
    }
    const HostTensor* t = std::get_if<HostTensor>(&it->second);
    const int64_t numel = optimizer_tensors_[k].numel();
    if (t == nullptr || !IsFloatingPoint(t->dtype()) ||
        (name != "step" && t->numel() != numel) ||
        (name == "step" && t->numel() != 1)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "optimizer state of ", what(k), ": \"", name, "\" is ",
          optim::DescribeValue(it->second), "; want ",
          name == "step" ? "a 0-d floating tensor"
                         : absl::StrCat("a floating tensor of ", numel,
                                        " elements (this rank's shard)")));
    }
    torch::Tensor out =
        torch::from_blob(const_cast<void*>(t->data()), {t->numel()},
                         OptionsOn(t->dtype(), c10::Device(c10::kCPU)))
            .to(optimizer_tensors_[k].options(), /*non_blocking=*/false,
                /*copy=*/true);
    return out;
  };
  OptimizerStates loaded;
  for (const auto& [key, state] : sharded.state) {
    int k = -1;
    if (use_orig_params_) {
      if (const std::string* fqn = std::get_if<std::string>(&key)) {
        for (size_t j = 0; j < orig_params_.size(); ++j) {
          if (orig_params_[j].fqn == *fqn) k = static_cast<int>(j);
        }
      }
      if (k < 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "optimizer state key ", optim::DescribeKey(key),
            " is not a parameter of this module (with use_orig_params the "
            "keys are parameter names)"));
      }
    } else {
      const int64_t* index = std::get_if<int64_t>(&key);
      const int units = static_cast<int>(units_.size());
      if (index == nullptr || *index < 0 || *index >= units) {
        return absl::InvalidArgumentError(absl::StrCat(
            "optimizer state key ", optim::DescribeKey(key),
            " is not a unit index (the flat-parameter path's keys are 0..",
            units - 1, ")"));
      }
      k = static_cast<int>(*index);
    }
    const std::vector<std::string> allowed =
        kind.kind == OptimizerKind::kSgd
            ? std::vector<std::string>{"momentum_buffer"}
            : std::vector<std::string>{"step", "exp_avg", "exp_avg_sq",
                                       "max_exp_avg_sq"};
    for (const auto& [name, value] : state) {
      if (std::find(allowed.begin(), allowed.end(), name) == allowed.end()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "optimizer state of ", what(k), ": \"", name, "\" is not a state ",
            kind.name, " keeps (", absl::StrJoin(allowed, ", "), ")"));
      }
    }
    const OptimizerStateKey key_string =
        StateKeyOf<OptimizerStateKey>(optimizer_tensors_[k]);
    if (kind.kind == OptimizerKind::kSgd) {
      FLATPARAM_ASSIGN_OR_RETURN(torch::Tensor buffer,
                                 tensor(k, state, "momentum_buffer", true));
      auto s = std::make_unique<torch::optim::SGDParamState>();
      s->momentum_buffer(buffer);
      loaded[key_string] = std::move(s);
      continue;
    }
    FLATPARAM_ASSIGN_OR_RETURN(torch::Tensor step,
                               tensor(k, state, "step", true));
    FLATPARAM_ASSIGN_OR_RETURN(torch::Tensor avg,
                               tensor(k, state, "exp_avg", true));
    FLATPARAM_ASSIGN_OR_RETURN(torch::Tensor avg_sq,
                               tensor(k, state, "exp_avg_sq", true));
    FLATPARAM_ASSIGN_OR_RETURN(torch::Tensor max_avg_sq,
                               tensor(k, state, "max_exp_avg_sq", false));
    const int64_t steps =
        static_cast<int64_t>(step.to(torch::kDouble).item<double>());
    loaded[key_string] = std::string(kind.name) == "AdamW"
                             ? MakeAdamState<torch::optim::AdamWParamState>(
                                   steps, avg, avg_sq, max_avg_sq)
                             : MakeAdamState<torch::optim::AdamParamState>(
                                   steps, avg, avg_sq, max_avg_sq);
  }
  return loaded;
}

void FsdpModule::InstallOptimState(OptimizerStates states,
                                   torch::optim::Optimizer& optimizer) const {
  for (const torch::Tensor& p : optimizer_tensors_) {
    optimizer.state().erase(StateKeyOf<OptimizerStateKey>(p));
  }
  for (auto& [key, state] : states) {
    optimizer.state()[key] = std::move(state);
  }
}

absl::StatusOr<std::vector<std::map<std::string, optim::HyperValue>>>
FsdpModule::ParseHyperparams(const optim::OptimStateDict& sharded,
                             torch::optim::Optimizer& optimizer) const {
  FLATPARAM_ASSIGN_OR_RETURN(OptimizerKind kind, KindOf(optimizer));
  auto& groups = optimizer.param_groups();
  if (sharded.param_groups.size() != groups.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("restoring hyperparameters: the state has ",
                     sharded.param_groups.size(), " parameter groups, the ",
                     kind.name, " optimizer ", groups.size()));
  }
  std::vector<std::map<std::string, optim::HyperValue>> out;
  for (size_t g = 0; g < groups.size(); ++g) {
    std::vector<optim::ParamKey> mine;
    for (const torch::Tensor& p : groups[g].params()) {
      const int k = OptimizerTensorIndex(p);
      if (k < 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "restoring hyperparameters: group ", g, " of the ", kind.name,
            " optimizer steps a tensor that is not one of this module's "
            "ShardedParameters()"));
      }
      mine.push_back(use_orig_params_
                         ? optim::ParamKey(orig_params_[k].fqn)
                         : optim::ParamKey(static_cast<int64_t>(k)));
    }
    std::vector<optim::ParamKey> theirs = sharded.param_groups[g].params;
    std::sort(mine.begin(), mine.end());
    std::sort(theirs.begin(), theirs.end());
    if (mine != theirs) {
      return absl::InvalidArgumentError(absl::StrCat(
          "restoring hyperparameters: parameter group ", g,
          " of the state lists other parameters than the optimizer's group ", g,
          " (groups pair by position, as load_state_dict pairs them)"));
    }
    const auto& h = sharded.param_groups[g].hyperparams;
    const std::vector<std::string> names =
        kind.kind == OptimizerKind::kSgd
            ? std::vector<std::string>{"lr", "momentum", "dampening",
                                       "weight_decay", "nesterov"}
            : std::vector<std::string>{"lr", "betas", "eps", "weight_decay",
                                       "amsgrad"};
    std::map<std::string, optim::HyperValue> values;
    for (const std::string& name : names) {
      auto it = h.find(name);
      const bool is_bool = name == "nesterov" || name == "amsgrad";
      const bool ok =
          it != h.end() &&
          (is_bool ? std::holds_alternative<bool>(it->second)
           : name == "betas"
               ? std::holds_alternative<std::vector<double>>(it->second) &&
                     std::get<std::vector<double>>(it->second).size() == 2
               : std::holds_alternative<double>(it->second) ||
                     std::holds_alternative<int64_t>(it->second));
      if (!ok) {
        return absl::InvalidArgumentError(
            absl::StrCat("restoring hyperparameters: parameter group ", g,
                         " has ", it == h.end() ? "no" : "an unusable", " \"",
                         name, "\", which ", kind.name, " needs"));
      }
      values[name] = it->second;
    }
    out.push_back(std::move(values));
  }
  return out;
}

void FsdpModule::InstallHyperparams(
    const std::vector<std::map<std::string, optim::HyperValue>>& groups,
    torch::optim::Optimizer& optimizer) {
  auto number = [](const optim::HyperValue& v) {
    return std::holds_alternative<double>(v)
               ? std::get<double>(v)
               : static_cast<double>(std::get<int64_t>(v));
  };
  for (size_t g = 0; g < groups.size(); ++g) {
    const auto& h = groups[g];
    torch::optim::OptimizerOptions& options =
        optimizer.param_groups()[g].options();
    if (auto* o = dynamic_cast<torch::optim::SGDOptions*>(&options)) {
      o->lr(number(h.at("lr")));
      o->momentum(number(h.at("momentum")));
      o->dampening(number(h.at("dampening")));
      o->weight_decay(number(h.at("weight_decay")));
      o->nesterov(std::get<bool>(h.at("nesterov")));
      continue;
    }
    auto adam = [&](auto* o) {
      const auto& betas = std::get<std::vector<double>>(h.at("betas"));
      o->lr(number(h.at("lr")));
      o->betas(std::make_tuple(betas[0], betas[1]));
      o->eps(number(h.at("eps")));
      o->weight_decay(number(h.at("weight_decay")));
      o->amsgrad(std::get<bool>(h.at("amsgrad")));
    };
    if (auto* o = dynamic_cast<torch::optim::AdamWOptions*>(&options)) {
      adam(o);
    } else if (auto* o = dynamic_cast<torch::optim::AdamOptions*>(&options)) {
      adam(o);
    }
  }
}

absl::Status FsdpModule::LoadShardedOptimState(
    const optim::OptimStateDict& sharded, torch::optim::Optimizer& optimizer,
    bool restore_hyperparameters) const {
  FLATPARAM_ASSIGN_OR_RETURN(OptimizerStates states,
                             ParseOptimState(sharded, optimizer));
  std::vector<std::map<std::string, optim::HyperValue>> hyper;
  if (restore_hyperparameters) {
    FLATPARAM_ASSIGN_OR_RETURN(hyper, ParseHyperparams(sharded, optimizer));
  }
  InstallOptimState(std::move(states), optimizer);
  if (restore_hyperparameters) InstallHyperparams(hyper, optimizer);
  return absl::OkStatus();
}

// The checkpoint keeps optimizer state on the flat-parameter path: each
// unit's parameters' tensor states laid out in its flat shard (zeros where
// a parameter has none, and in padding), their 0-d states one value per
// unit; the groups list the parameters by name (the flat path's
// consolidation keeps name keys as they are).
absl::StatusOr<optim::OptimStateDict> FsdpModule::OrigToFlatOptimState(
    const optim::OptimStateDict& orig) const {
  optim::OptimStateDict flat;
  flat.param_groups = orig.param_groups;
  for (int unit = 0; unit < static_cast<int>(units_.size()); ++unit) {
    const FlatParamHandle& handle = runtime_->handle(unit);
    const FlatParamLayout& fp = layout().flat_params()[unit];
    const int64_t numel = handle.sharded_param().count;
    optim::ParamState out;
    // The parameter whose 0-d value each 0-d state took.
    std::map<std::string, std::string> scalar_from;
    for (size_t i = 0; i < units_[unit]->fqns.size(); ++i) {
      const std::string& fqn = units_[unit]->fqns[i];
      auto it = orig.state.find(optim::ParamKey(fqn));
      if (it == orig.state.end()) continue;
      const ShardParamInfo info =
          fp.shard_param_info(handle.rank(), static_cast<int>(i));
      for (const auto& [name, value] : it->second) {
        const HostTensor* t = std::get_if<HostTensor>(&value);
        if (t == nullptr || t->shape().empty()) {
          auto [from, inserted] = scalar_from.emplace(name, fqn);
          if (inserted) {
            out[name] = value;
          } else if (!optim::BitwiseEqual(out.at(name), value)) {
            return absl::InvalidArgumentError(absl::StrCat(
                "SaveCheckpoint with use_orig_params: \"", name,
                "\" of parameters \"", from->second, "\" (",
                optim::DescribeValue(out.at(name)), ") and \"", fqn, "\" (",
                optim::DescribeValue(value), ") of unit \"", units_[unit]->name,
                "\" differ; the checkpoint keeps one value per unit"));
          }
          continue;
        }
        auto [slot, fresh] = out.emplace(name, optim::OptimStateValue());
        if (fresh) slot->second = HostTensor(t->dtype(), {numel});
        HostTensor* dst_tensor = std::get_if<HostTensor>(&slot->second);
        if (dst_tensor == nullptr || dst_tensor->shape().size() != 1 ||
            dst_tensor->numel() != numel) {
          return absl::InvalidArgumentError(absl::StrCat(
              "SaveCheckpoint with use_orig_params: \"", name,
              "\" is a tensor for parameter \"", fqn,
              "\" and not for another of unit \"", units_[unit]->name, "\""));
        }
        HostTensor& dst = *dst_tensor;
        const int64_t n = info.in_shard ? info.numel_in_shard : 0;
        if (dst.dtype() != t->dtype() || t->numel() != n) {
          return absl::InvalidArgumentError(absl::StrCat(
              "SaveCheckpoint with use_orig_params: \"", name,
              "\" of parameter \"", fqn, "\" is ", optim::DescribeValue(value),
              "; want ", n, " ", DTypeName(dst.dtype()),
              " elements (its piece of this rank's shard)"));
        }
        std::memcpy(static_cast<char*>(dst.data()) +
                        info.offset_in_shard * DTypeSize(dst.dtype()),
                    t->data(), t->nbytes());
      }
    }
    if (!out.empty()) flat.state[static_cast<int64_t>(unit)] = std::move(out);
  }
  return flat;
}

absl::StatusOr<optim::OptimStateDict> FsdpModule::FlatToOrigOptimState(
    const optim::OptimStateDict& flat) const {
  optim::OptimStateDict orig;
  for (const auto& [key, state] : flat.state) {
    const int64_t* index = std::get_if<int64_t>(&key);
    if (index == nullptr || *index < 0 ||
        *index >= static_cast<int64_t>(units_.size())) {
      return absl::InvalidArgumentError(
          absl::StrCat("the checkpoint's optimizer state key ",
                       optim::DescribeKey(key), " is not a unit index"));
    }
    const int unit = static_cast<int>(*index);
    const FlatParamHandle& handle = runtime_->handle(unit);
    const FlatParamLayout& fp = layout().flat_params()[unit];
    const UnitState& u = *units_[unit];
    for (size_t i = 0; i < u.fqns.size(); ++i) {
      // Frozen parameters get none (the optimizer never stepped them), nor
      // do parameters this rank holds none of.
      if (!u.trainable[i]) continue;
      const ShardParamInfo info =
          fp.shard_param_info(handle.rank(), static_cast<int>(i));
      if (!info.in_shard) continue;
      const int64_t n = info.in_shard ? info.numel_in_shard : 0;
      optim::ParamState mine;
      for (const auto& [name, value] : state) {
        const HostTensor* t = std::get_if<HostTensor>(&value);
        if (t == nullptr || t->shape().empty()) {
          mine[name] = value;
          continue;
        }
        if (t->numel() < info.offset_in_shard + n) {
          return absl::InvalidArgumentError(absl::StrCat(
              "the checkpoint's \"", name, "\" of unit \"", u.name, "\" has ",
              t->numel(), " elements; this rank's shard has ",
              handle.sharded_param().count));
        }
        HostTensor piece(t->dtype(), {n});
        std::memcpy(piece.data(),
                    static_cast<const char*>(t->data()) +
                        info.offset_in_shard * DTypeSize(t->dtype()),
                    piece.nbytes());
        mine[name] = std::move(piece);
      }
      orig.state[optim::ParamKey(u.fqns[i])] = std::move(mine);
    }
  }
  return orig;
}

}  // namespace libtorch
}  // namespace flatparam
