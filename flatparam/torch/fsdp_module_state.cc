// FsdpModule's state dicts (PyTorch's FULL_STATE_DICT and
// SHARDED_STATE_DICT, and the older FullStateDict) and the
// SummonFullParams scope. Optimizer state and checkpoints are in
// fsdp_module_optim.cc.
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
#include "flatparam/checkpoint/training_state.h"
#include "flatparam/torch/fsdp_module.h"
#include "flatparam/torch/internal/fsdp_module_internal.h"

namespace flatparam {
namespace libtorch {

using internal_fsdp_module::CpuCopy;
using internal_fsdp_module::FromTorch;
using internal_fsdp_module::OptionsOn;

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
    // LibTorch reads (or writes) the gathered values.
    absl::Status status = HandToTorch();
    for (int i = 0;
         status.ok() && mine && i < static_cast<int>(units_[u]->params.size());
         ++i) {
      absl::StatusOr<OrigParamView> view = handle.Param(i);
      if (!view.ok()) {
        status = view.status();
        break;
      }
      params[{u, i}] = options.offload_to_cpu
                           ? CpuCopy(Over(view->data, view->shape))
                           : Over(view->data, view->shape).clone();
    }
    absl::Status end = handle.EndSummonFullParams();
    FLATPARAM_RETURN_IF_ERROR(status);
    FLATPARAM_RETURN_IF_ERROR(end);
  }
  torch::OrderedDict<std::string, torch::Tensor> out;
  if (!mine) return out;
  for (const StateEntry& e : entries) {
    if (e.buffer < 0) {
      out.insert(e.name, params.at({e.unit, e.index}));
    } else {
      torch::Tensor b = BufferValue(e.buffer);
      out.insert(e.name, options.offload_to_cpu ? b.to(torch::kCPU) : b);
    }
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
    // LibTorch reads (or writes) the gathered values.
    absl::Status status = HandToTorch();
    for (const auto& [key, value] : params) {
      if (!status.ok()) break;
      if (key.first != u) continue;
      absl::StatusOr<OrigParamView> view = handle.Param(key.second);
      if (!view.ok()) {
        status = view.status();
        break;
      }
      Over(view->data, view->shape).copy_(*value);
    }
    absl::Status end = handle.EndSummonFullParams();
    FLATPARAM_RETURN_IF_ERROR(status);
    FLATPARAM_RETURN_IF_ERROR(end);
  }
  for (const StateEntry& e : entries) {
    const torch::Tensor* t = state.find(e.name);
    if (t != nullptr && e.buffer >= 0) buffers_[e.buffer].second.copy_(*t);
  }
  // The optimizer reads the shards the write-back wrote.
  return HandToTorch();
}

namespace internal_fsdp_module {

std::pair<int64_t, int64_t> ChunkRows(int64_t rows, int world, int rank) {
  const int64_t chunk = (rows + world - 1) / world;
  const int64_t first = std::min(rows, chunk * rank);
  return {first, std::min(rows, first + chunk) - first};
}

}  // namespace internal_fsdp_module

using internal_fsdp_module::ChunkRows;

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
    // On the compute device, where the communicator moves data (NCCL
    // takes no host memory), whatever device the caller's chunk is on.
    const torch::TensorOptions on_device =
        t.options().device(device_->torch_device());
    torch::Tensor padded = torch::zeros({chunk * row_numel}, on_device);
    padded.narrow(0, 0, t.numel()).copy_(t.reshape({-1}));
    torch::Tensor gathered =
        torch::empty({chunk * row_numel * world_->size()}, on_device);
    FLATPARAM_RETURN_IF_ERROR(WaitForTorch());
    FLATPARAM_RETURN_IF_ERROR(
        world_
            ->AllGather(ConstBufferRef{padded.data_ptr(), padded.numel(),
                                       *dtype, FlatDeviceOf(padded)},
                        BufferRef{gathered.data_ptr(), gathered.numel(), *dtype,
                                  FlatDeviceOf(gathered)},
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
  // The caller's code reads (and may write) the gathered values.
  FLATPARAM_RETURN_IF_ERROR(HandToTorch());
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
          full
              ? Over(view->data, view->shape)
              : torch::empty({0}, OptionsOn(view->data.dtype,
                                            TorchDeviceOf(view->data.device))));
      if (options.with_grads && unit.trainable[i]) {
        absl::StatusOr<std::optional<BufferRef>> grad =
            handle.UnshardedGradView(static_cast<int>(i));
        if (grad.ok() && grad->has_value()) {
          unit.params[i].mutable_grad() = Over(**grad, view->shape);
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
    // LibTorch reads (or writes) the gathered values.
    absl::Status status = HandToTorch();
    for (int i = 0; status.ok() && i < static_cast<int>(fp.params().size());
         ++i) {
      absl::StatusOr<OrigParamView> view = handle.Param(i);
      if (!view.ok()) {
        status = view.status();
        break;
      }
      torch::Tensor t = CpuCopy(Over(view->data, view->shape));
      out[fp.params()[i].fqn] = t;
    }
    absl::Status end = handle.EndSummonFullParams();
    FLATPARAM_RETURN_IF_ERROR(status);
    FLATPARAM_RETURN_IF_ERROR(end);
  }
  return out;
}

}  // namespace libtorch
}  // namespace flatparam
