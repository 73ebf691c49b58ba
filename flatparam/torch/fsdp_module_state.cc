// FsdpModule's state: the full state dict, the optimizer's state as
// flatparam's optimizer-state dicts (both FSDP paths), and checkpoints.
// Wrapping and the hooks are in fsdp_module.cc.
#include <torch/torch.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <tuple>
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
#include "flatparam/checkpoint/optim_io.h"
#include "flatparam/torch/fsdp_module.h"
#include "flatparam/torch/internal/fsdp_module_internal.h"

namespace flatparam {
namespace libtorch {

using internal_fsdp_module::FromTorch;
using internal_fsdp_module::Options;

std::vector<FsdpModule::StateEntry> FsdpModule::StateEntries() const {
  std::map<const c10::TensorImpl*, std::pair<int, int>> param_at;
  for (int u = 0; u < static_cast<int>(units_.size()); ++u) {
    for (size_t i = 0; i < units_[u]->params.size(); ++i) {
      param_at[units_[u]->params[i].unsafeGetTensorImpl()] = {
          u, static_cast<int>(i)};
    }
  }
  std::map<std::string, int> buffer_at;
  for (size_t b = 0; b < buffers_.size(); ++b) {
    buffer_at[buffers_[b].first] = static_cast<int>(b);
  }
  // Python's state_dict order: a module's own parameters, its own buffers,
  // then each submodule's, depth first (named_modules() is pre-order).
  std::vector<StateEntry> out;
  for (const auto& item : module_->named_modules()) {
    const std::string prefix = item.key().empty() ? "" : item.key() + ".";
    for (const auto& p : item.value()->named_parameters(/*recurse=*/false)) {
      auto it = param_at.find(p.value().unsafeGetTensorImpl());
      if (it == param_at.end()) continue;
      out.push_back({prefix + p.key(), it->second.first, it->second.second});
    }
    for (const auto& b : item.value()->named_buffers(/*recurse=*/false)) {
      auto it = buffer_at.find(prefix + b.key());
      if (it == buffer_at.end()) continue;
      out.push_back({prefix + b.key(), -1, 0, it->second});
    }
  }
  return out;
}

torch::Tensor FsdpModule::BufferValue(int buffer) const {
  const torch::Tensor& b = buffers_[buffer].second;
  return b.to(buffer_dtypes_[buffer]).clone();
}

absl::StatusOr<torch::OrderedDict<std::string, torch::Tensor>>
FsdpModule::StateDict(const StateDictOptions& options) {
  FLATPARAM_RETURN_IF_ERROR(BetweenIterations("StateDict"));
  const std::vector<StateEntry> entries = StateEntries();
  // Parameters by (unit, index), one unit gathered at a time.
  std::map<std::pair<int, int>, torch::Tensor> params;
  const bool mine = !options.rank0_only || runtime_->handle(0).rank() == 0;
  for (int u = 0; u < runtime_->num_units(); ++u) {
    FlatParamHandle& handle = runtime_->handle(u);
    SummonOptions summon;
    summon.rank0_only = options.rank0_only;
    FLATPARAM_RETURN_IF_ERROR(handle.BeginSummonFullParams(summon));
    absl::Status status;
    for (int i = 0; mine && i < static_cast<int>(units_[u]->params.size());
         ++i) {
      absl::StatusOr<OrigParamView> view = handle.Param(i);
      if (!view.ok()) {
        status = view.status();
        break;
      }
      params[{u, i}] = torch::from_blob(view->data.data, view->shape,
                                        Options(view->data.dtype))
                           .clone();
    }
    absl::Status end = handle.EndSummonFullParams();
    FLATPARAM_RETURN_IF_ERROR(status);
    FLATPARAM_RETURN_IF_ERROR(end);
  }
  torch::OrderedDict<std::string, torch::Tensor> out;
  if (!mine) return out;
  for (const StateEntry& e : entries) {
    out.insert(e.name, e.buffer >= 0 ? BufferValue(e.buffer)
                                     : params.at({e.unit, e.index}));
  }
  return out;
}

absl::Status FsdpModule::CheckStateKeys(
    const torch::OrderedDict<std::string, torch::Tensor>& state,
    bool strict) const {
  std::set<std::string> expected;
  for (const StateEntry& e : StateEntries()) expected.insert(e.name);
  std::vector<std::string> missing, unexpected;
  for (const std::string& name : expected) {
    if (state.find(name) == nullptr) missing.push_back(name);
  }
  for (const auto& item : state) {
    if (expected.count(item.key()) == 0) unexpected.push_back(item.key());
  }
  if (strict && (!missing.empty() || !unexpected.empty())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the state dict does not match the module (strict): missing keys [",
        absl::StrJoin(missing, ", "), "], unexpected keys [",
        absl::StrJoin(unexpected, ", "), "]"));
  }
  return absl::OkStatus();
}

absl::Status FsdpModule::LoadStateDict(
    const torch::OrderedDict<std::string, torch::Tensor>& state, bool strict) {
  FLATPARAM_RETURN_IF_ERROR(BetweenIterations("LoadStateDict"));
  FLATPARAM_RETURN_IF_ERROR(CheckStateKeys(state, strict));
  const std::vector<StateEntry> entries = StateEntries();
  // Validate everything before changing anything.
  std::map<std::pair<int, int>, const torch::Tensor*> params;
  for (const StateEntry& e : entries) {
    const torch::Tensor* t = state.find(e.name);
    if (t == nullptr) continue;
    const torch::Tensor& target = e.buffer >= 0
                                      ? buffers_[e.buffer].second
                                      : units_[e.unit]->params[e.index];
    const std::vector<int64_t> want =
        e.buffer >= 0
            ? std::vector<int64_t>(target.sizes().begin(), target.sizes().end())
            : layout().flat_params()[e.unit].params()[e.index].shape;
    if (std::vector<int64_t>(t->sizes().begin(), t->sizes().end()) != want) {
      return absl::InvalidArgumentError(absl::StrCat(
          "size mismatch for \"", e.name, "\": the state dict's is ",
          c10::str(t->sizes()), ", the module's ", c10::str(want)));
    }
    if (e.buffer >= 0) continue;
    auto [it, fresh] = params.emplace(std::make_pair(e.unit, e.index), t);
    if (!fresh && !torch::equal(*it->second, *t)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "\"", e.name,
          "\" is tied to another name of the state dict whose value differs"));
    }
  }
  torch::NoGradGuard no_grad;
  for (int u = 0; u < runtime_->num_units(); ++u) {
    bool any = false;
    for (const auto& [key, unused] : params) any = any || key.first == u;
    if (!any) continue;
    FlatParamHandle& handle = runtime_->handle(u);
    FLATPARAM_RETURN_IF_ERROR(handle.BeginSummonFullParams(/*writeback=*/true));
    absl::Status status;
    for (const auto& [key, value] : params) {
      if (key.first != u) continue;
      absl::StatusOr<OrigParamView> view = handle.Param(key.second);
      if (!view.ok()) {
        status = view.status();
        break;
      }
      torch::from_blob(view->data.data, view->shape, Options(view->data.dtype))
          .copy_(*value);
    }
    absl::Status end = handle.EndSummonFullParams();
    FLATPARAM_RETURN_IF_ERROR(status);
    FLATPARAM_RETURN_IF_ERROR(end);
  }
  for (const StateEntry& e : entries) {
    const torch::Tensor* t = state.find(e.name);
    if (t != nullptr && e.buffer >= 0) buffers_[e.buffer].second.copy_(*t);
  }
  return absl::OkStatus();
}

namespace {

// torch.chunk's rows of rank `rank` of `world`: [first, first + count).
std::pair<int64_t, int64_t> ChunkRows(int64_t rows, int world, int rank) {
  const int64_t chunk = (rows + world - 1) / world;
  const int64_t first = std::min(rows, chunk * rank);
  return {first, std::min(rows, first + chunk) - first};
}

}  // namespace

absl::StatusOr<torch::OrderedDict<std::string, torch::Tensor>>
FsdpModule::ShardedStateDict() {
  FLATPARAM_ASSIGN_OR_RETURN(auto full, StateDict());
  torch::OrderedDict<std::string, torch::Tensor> out;
  const std::vector<StateEntry> entries = StateEntries();
  for (const StateEntry& e : entries) {
    const torch::Tensor& t = full[e.name];
    if (e.buffer >= 0 || t.dim() == 0) {
      out.insert(e.name, t);
      continue;
    }
    auto [first, count] = ChunkRows(t.size(0), world_->size(), world_->rank());
    out.insert(e.name, t.narrow(0, first, count).clone());
  }
  return out;
}

absl::Status FsdpModule::LoadShardedStateDict(
    const torch::OrderedDict<std::string, torch::Tensor>& state) {
  FLATPARAM_RETURN_IF_ERROR(BetweenIterations("LoadShardedStateDict"));
  // Every rank checks its own dict, then the ranks agree before any
  // collective that needs them all.
  absl::Status mine = CheckStateKeys(state, /*strict=*/true);
  const std::vector<StateEntry> entries = StateEntries();
  for (const StateEntry& e : entries) {
    if (!mine.ok()) break;
    const torch::Tensor& t = state[e.name];
    std::vector<int64_t> want;
    if (e.buffer >= 0) {
      const torch::Tensor& b = buffers_[e.buffer].second;
      want.assign(b.sizes().begin(), b.sizes().end());
    } else {
      want = layout().flat_params()[e.unit].params()[e.index].shape;
      if (!want.empty()) {
        want[0] = ChunkRows(want[0], world_->size(), world_->rank()).second;
      }
    }
    if (std::vector<int64_t>(t.sizes().begin(), t.sizes().end()) != want) {
      mine = absl::InvalidArgumentError(absl::StrCat(
          "rank ", world_->rank(), ": \"", e.name, "\" is ",
          c10::str(t.sizes()), "; this rank's chunk is ", c10::str(want)));
    }
  }
  FLATPARAM_RETURN_IF_ERROR(checkpoint::AgreeOnLoad(
      *world_, mine, runtime_->options().collective_options));
  // Gather every parameter's chunks into a full state dict, one parameter
  // at a time (the chunks are padded to the first rank's).
  torch::OrderedDict<std::string, torch::Tensor> full;
  for (const StateEntry& e : entries) {
    torch::Tensor t = state[e.name].contiguous();
    if (e.buffer >= 0 || t.dim() == 0) {
      full.insert(e.name, t);
      continue;
    }
    const std::vector<int64_t>& shape =
        layout().flat_params()[e.unit].params()[e.index].shape;
    int64_t row_numel = 1;
    for (size_t d = 1; d < shape.size(); ++d) row_numel *= shape[d];
    const int64_t chunk = (shape[0] + world_->size() - 1) / world_->size();
    absl::StatusOr<DType> dtype = FromTorch(t.scalar_type());
    if (!dtype.ok()) return dtype.status();
    torch::Tensor padded = torch::zeros({chunk * row_numel}, t.options());
    padded.narrow(0, 0, t.numel()).copy_(t.reshape({-1}));
    torch::Tensor gathered =
        torch::empty({chunk * row_numel * world_->size()}, t.options());
    FLATPARAM_RETURN_IF_ERROR(
        world_
            ->AllGather(ConstBufferRef{padded.data_ptr(), padded.numel(),
                                       *dtype, Device::Host()},
                        BufferRef{gathered.data_ptr(), gathered.numel(), *dtype,
                                  Device::Host()},
                        runtime_->options().collective_options)
            ->Wait());
    full.insert(e.name,
                gathered.narrow(0, 0, shape[0] * row_numel).reshape(shape));
  }
  return LoadStateDict(full, /*strict=*/true);
}

FsdpModule::SummonedParams::~SummonedParams() {
  if (module_ == nullptr) return;
  absl::Status status = End();
  if (!status.ok()) {
    std::cerr << "FsdpModule::SummonFullParams: ending the scope failed: "
              << status << "\n";
  }
}

absl::Status FsdpModule::SummonedParams::End() {
  if (module_ == nullptr) return absl::OkStatus();
  FsdpModule* module = std::exchange(module_, nullptr);
  return module->EndSummon();
}

absl::StatusOr<std::unique_ptr<FsdpModule::SummonedParams>>
FsdpModule::SummonFullParams(const SummonOptions& options) {
  FLATPARAM_RETURN_IF_ERROR(BetweenIterations("SummonFullParams"));
  int begun = 0;
  absl::Status status;
  for (; begun < runtime_->num_units() && status.ok(); ++begun) {
    status = runtime_->handle(begun).BeginSummonFullParams(options);
  }
  if (!status.ok()) {
    for (int u = 0; u < begun - 1; ++u) {
      runtime_->handle(u).EndSummonFullParams().IgnoreError();
    }
    return status;
  }
  summoned_ = true;
  summon_options_ = options;
  // The module's parameters (and gradients) are the full views now.
  torch::NoGradGuard no_grad;
  for (int u = 0; u < runtime_->num_units(); ++u) {
    UnitState& unit = *units_[u];
    FlatParamHandle& handle = runtime_->handle(u);
    for (size_t i = 0; i < unit.params.size(); ++i) {
      absl::StatusOr<OrigParamView> view = handle.Param(static_cast<int>(i));
      if (!view.ok()) return view.status();
      const bool full =
          view->shape == layout().flat_params()[u].params()[i].shape;
      unit.params[i].set_data(
          full ? torch::from_blob(view->data.data, view->shape,
                                  Options(view->data.dtype))
               : torch::empty({0}, Options(view->data.dtype)));
      if (options.with_grads && unit.trainable[i]) {
        absl::StatusOr<std::optional<BufferRef>> grad =
            handle.UnshardedGradView(static_cast<int>(i));
        if (grad.ok() && grad->has_value()) {
          unit.params[i].mutable_grad() = torch::from_blob(
              (*grad)->data, view->shape, Options((*grad)->dtype));
        }
      }
    }
    unit.exposed = false;
  }
  return absl::WrapUnique(new SummonedParams(this));
}

absl::Status FsdpModule::EndSummon() {
  absl::Status first;
  {
    torch::NoGradGuard no_grad;
    for (auto& unit : units_) {
      for (torch::Tensor& t : unit->params) {
        t.mutable_grad().reset();
        t.set_data(torch::empty({0}, Options(unit->param_views.dtype)));
      }
    }
  }
  for (int u = 0; u < runtime_->num_units(); ++u) {
    absl::Status status = runtime_->handle(u).EndSummonFullParams();
    if (first.ok()) first = status;
  }
  summoned_ = false;
  absl::Status bind = BindAll();
  if (first.ok()) first = bind;
  BindShardedGrads();
  return first;
}

absl::StatusOr<std::map<std::string, torch::Tensor>>
FsdpModule::FullStateDict() {
  FLATPARAM_RETURN_IF_ERROR(BetweenIterations("FullStateDict"));
  std::map<std::string, torch::Tensor> out;
  for (int u = 0; u < runtime_->num_units(); ++u) {
    FlatParamHandle& handle = runtime_->handle(u);
    const FlatParamLayout& fp = layout().flat_params()[u];
    FLATPARAM_RETURN_IF_ERROR(
        handle.BeginSummonFullParams(/*writeback=*/false));
    absl::Status status;
    for (int i = 0; i < static_cast<int>(fp.params().size()); ++i) {
      absl::StatusOr<OrigParamView> view = handle.Param(i);
      if (!view.ok()) {
        status = view.status();
        break;
      }
      torch::Tensor t = torch::from_blob(view->data.data, view->shape,
                                         Options(view->data.dtype))
                            .clone();
      out[fp.params()[i].fqn] = t;
    }
    absl::Status end = handle.EndSummonFullParams();
    FLATPARAM_RETURN_IF_ERROR(status);
    FLATPARAM_RETURN_IF_ERROR(end);
  }
  return out;
}

namespace {

optim::OptimStateValue ToHost(const torch::Tensor& t) {
  torch::Tensor c = t.contiguous();
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

std::string StateKey(const torch::Tensor& t) {
  return c10::guts::to_string(t.unsafeGetTensorImpl());
}

}  // namespace

absl::Status FsdpModule::SaveCheckpoint(checkpoint::FileSystem& fs,
                                        const std::string& dir,
                                        torch::optim::Optimizer* optimizer,
                                        const nlohmann::json& extra) {
  Communicator& world = *world_;
  const ModelLayout& model = layout();
  const int64_t shard_rank = world.rank() % model.options().world_size;
  checkpoint::RankState mine;
  absl::Status prepared = BetweenIterations("SaveCheckpoint");
  static std::once_flag buffers_warned;
  if (!buffers_.empty()) {
    std::call_once(buffers_warned, [&] {
      std::cerr << "FsdpModule::SaveCheckpoint: the module's buffers (\""
                << buffers_.front().first
                << "\", ...) are not saved in the checkpoint; keep "
                   "StateDict()'s buffers alongside\n";
    });
  }
  for (int u = 0; u < runtime_->num_units() && prepared.ok(); ++u) {
    BufferRef shard = runtime_->handle(u).sharded_param();
    HostTensor t = HostTensor::Uninitialized(shard.dtype, {shard.count});
    std::memcpy(t.data(), shard.data, t.nbytes());
    mine.flat_params.push_back(std::move(t));
  }
  if (prepared.ok() && optimizer != nullptr) {
    absl::StatusOr<optim::OptimStateDict> state = ShardedOptimState(*optimizer);
    if (state.ok() && use_orig_params_) state = OrigToFlatOptimState(*state);
    if (state.ok()) {
      mine.optim = std::move(*state);
    } else {
      prepared = state.status();
    }
  }
  mine.extra = extra;
  absl::StatusOr<checkpoint::RankContent> content =
      prepared.ok() ? checkpoint::MakeRankContent(model, shard_rank, mine)
                    : absl::StatusOr<checkpoint::RankContent>(prepared);
  // In phases, so that a rank whose content is bad fails every rank
  // (agreed in Begin) instead of leaving them in the exchange.
  checkpoint::CollectiveWriteOptions options;
  options.collective = runtime_->options().collective_options;
  FLATPARAM_ASSIGN_OR_RETURN(
      checkpoint::CollectiveWrite begun,
      checkpoint::BeginCollectiveWrite(fs, dir, model, world.size(), world,
                                       options, content.status()));
  const absl::Status written =
      checkpoint::WriteCollectiveRankFiles(fs, begun, *content, options);
  return checkpoint::FinishCollectiveWrite(fs, begun, written, world, options);
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
    std::memcpy(shard.data, state->flat_params[u].data(),
                state->flat_params[u].nbytes());
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
      auto state = optimizer.state().find(StateKey(p));
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
    torch::Tensor out = torch::from_blob(const_cast<void*>(t->data()),
                                         {t->numel()}, Options(t->dtype()))
                            .clone()
                            .to(optimizer_tensors_[k].scalar_type());
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
    const std::string key_string = StateKey(optimizer_tensors_[k]);
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
    optimizer.state().erase(StateKey(p));
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
