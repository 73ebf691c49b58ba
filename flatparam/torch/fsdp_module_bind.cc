// FsdpModule: binding the module's parameters and gradients to flatparam's
// memory (the flat parameters' views, the sharded parameters the optimizer
// steps, and the copy back from the module).
#include <torch/autograd.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/nn/module.h>
#include <torch/types.h>
#include <torch/utils.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/torch/fsdp_module.h"
#include "flatparam/torch/internal/fsdp_module_internal.h"

namespace flatparam {
namespace libtorch {

using internal_fsdp_module::FromTorch;
using internal_fsdp_module::NodePtr;
using internal_fsdp_module::Quoted;

// ---------------------------------------------------------------------------
// Binding the module's tensors to flatparam's memory

absl::Status FsdpModule::Bind(int unit) {
  UnitState& u = *units_[unit];
  const FlatParamHandle& handle = runtime_->handle(unit);
  const FlatParamLayout& fp = layout().flat_params()[unit];
  torch::NoGradGuard no_grad;
  std::optional<BufferRef> flat = handle.unsharded_flat_param();
  if (flat.has_value()) {
    if (flat->dtype != u.param_views.dtype ||
        TorchDeviceOf(flat->device) != u.param_views.device) {
      u.param_views.Make(flat->dtype, fp, TorchDeviceOf(flat->device));
      u.exposed = false;
    }
    u.param_views.Point(flat);
    if (!u.exposed) {
      for (size_t i = 0; i < u.params.size(); ++i) {
        u.params[i].set_data(u.param_views.views[i]);
      }
      u.exposed = true;
    }
    // set_data to another dtype resets a parameter's gradient
    // accumulator: hook the one autograd will use from now on.
    for (size_t i = 0; i < u.params.size(); ++i) {
      if (!u.trainable[i]) continue;
      NodePtr acc = torch::autograd::impl::grad_accumulator(u.params[i]);
      if (acc == nullptr || acc == u.accumulators[i]) continue;
      acc->add_post_hook(
          std::make_unique<AccumulateHook>(hooks_, unit, static_cast<int>(i)));
      u.accumulators[i] = std::move(acc);
    }
  } else {
    if (u.exposed) {
      torch::Tensor empty = torch::empty({0}, Options(u.param_views.dtype));
      for (torch::Tensor& t : u.params) t.set_data(empty);
      u.exposed = false;
    }
    u.param_views.Point(std::nullopt);
  }

  std::optional<BufferRef> grad = handle.unsharded_grad();
  const bool in_backward =
      handle.training_state() == HandleTrainingState::kBackwardPre;
  if (grad.has_value() && in_backward) {
    if (grad->dtype != u.grad_views.dtype ||
        TorchDeviceOf(grad->device) != u.grad_views.device) {
      u.grad_views.Make(grad->dtype, fp, TorchDeviceOf(grad->device));
    }
    u.grad_views.Point(grad);
    for (size_t i = 0; i < u.params.size(); ++i) {
      if (u.trainable[i]) u.params[i].mutable_grad() = u.grad_views.views[i];
    }
    u.grads_exposed = true;
  } else {
    if (u.grads_exposed) {
      for (torch::Tensor& t : u.params) t.mutable_grad().reset();
      u.grads_exposed = false;
    }
    u.grad_views.Point(std::nullopt);
  }
  // LibTorch's kernels use the views next (the unit's forward or
  // backward).
  return HandToTorch();
}

absl::Status FsdpModule::BindAll() {
  for (int u = 0; u < static_cast<int>(units_.size()); ++u) {
    FLATPARAM_RETURN_IF_ERROR(Bind(u));
  }
  return absl::OkStatus();
}

void FsdpModule::BindShardedGrads() {
  torch::NoGradGuard no_grad;
  auto bind = [this](torch::Tensor& t, const BufferRef& memory,
                     const std::optional<BufferRef>& grad, torch::Tensor& bound,
                     bool requires_grad) {
    if (!t.defined() || (memory.count > 0 && t.data_ptr() != memory.data) ||
        t.numel() != memory.count) {
      torch::Tensor over = Over(memory);
      if (t.defined()) {
        t.set_data(over);
      } else {
        t = over.set_requires_grad(requires_grad);
      }
    }
    if (grad.has_value()) {
      if (!bound.defined() || bound.data_ptr() != grad->data ||
          bound.numel() != grad->count) {
        bound = Over(*grad);
      }
      t.mutable_grad() = bound;
    } else {
      bound = torch::Tensor();
      t.mutable_grad().reset();
    }
  };
  if (!use_orig_params_) {
    for (int u = 0; u < static_cast<int>(units_.size()); ++u) {
      const FlatParamHandle& handle = runtime_->handle(u);
      bind(optimizer_tensors_[u], handle.sharded_param(), handle.sharded_grad(),
           bound_grads_[u], true);
    }
    return;
  }
  for (size_t k = 0; k < orig_params_.size(); ++k) {
    const OrigParam& p = orig_params_[k];
    const FlatParamHandle& handle = runtime_->handle(p.unit);
    const ShardParamInfo info =
        layout().flat_params()[p.unit].shard_param_info(handle.rank(), p.index);
    BufferRef shard = handle.sharded_param();
    BufferRef piece{static_cast<char*>(shard.data) +
                        info.offset_in_shard * DTypeSize(shard.dtype),
                    info.in_shard ? info.numel_in_shard : 0, shard.dtype,
                    shard.device};
    absl::StatusOr<std::optional<BufferRef>> grad =
        handle.ShardedGradView(p.index);
    bind(optimizer_tensors_[k], piece,
         grad.ok() ? *grad : std::optional<BufferRef>(), bound_grads_[k],
         handle.requires_grad(p.index));
  }
}

std::vector<torch::Tensor> FsdpModule::ShardedParameters() const {
  return optimizer_tensors_;
}

absl::StatusOr<std::vector<std::pair<std::string, torch::Tensor>>>
FsdpModule::NamedShardedParameters() const {
  if (!use_orig_params_) {
    return absl::FailedPreconditionError(
        "FsdpModule::NamedShardedParameters needs FsdpOptions::"
        "use_orig_params (without it the optimizer steps one flat shard per "
        "unit: ShardedParameters())");
  }
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (size_t k = 0; k < orig_params_.size(); ++k) {
    out.emplace_back(orig_params_[k].fqn, optimizer_tensors_[k]);
  }
  return out;
}

absl::Status FsdpModule::SyncFromModule() {
  // module->eval() / train().
  const bool training = module_->is_training();
  if (training != training_) {
    for (int u = 0; u < runtime_->num_units(); ++u) {
      FLATPARAM_RETURN_IF_ERROR(runtime_->handle(u).SetTraining(training));
    }
    training_ = training;
  }
  // requires_grad changed on the module's parameters.
  for (int unit = 0; unit < static_cast<int>(units_.size()); ++unit) {
    UnitState& u = *units_[unit];
    FlatParamHandle& handle = runtime_->handle(unit);
    bool changed = false;
    for (size_t i = 0; i < u.params.size(); ++i) {
      changed =
          changed || (u.params[i].requires_grad() != (u.trainable[i] != 0));
    }
    if (!changed) continue;
    if (!use_orig_params_) {
      const bool first = u.params[0].requires_grad();
      for (size_t i = 1; i < u.params.size(); ++i) {
        if (u.params[i].requires_grad() != first) {
          return absl::FailedPreconditionError(absl::StrCat(
              "parameter \"", u.fqns[i], "\" of unit \"", u.name,
              "\" has requires_grad=", u.params[i].requires_grad() ? 1 : 0,
              " and \"", u.fqns[0], "\" requires_grad=", first ? 1 : 0,
              " (changed after Wrap); without FsdpOptions::use_orig_params a "
              "unit's parameters are all frozen or all trainable: change "
              "every parameter of the unit, or wrap with use_orig_params"));
        }
      }
      FLATPARAM_RETURN_IF_ERROR(handle.SetAllRequiresGrad(first));
    } else {
      for (size_t i = 0; i < u.params.size(); ++i) {
        const bool now = u.params[i].requires_grad();
        if (now == (u.trainable[i] != 0)) continue;
        FLATPARAM_RETURN_IF_ERROR(
            handle.SetRequiresGrad(static_cast<int>(i), now));
      }
    }
    u.num_trainable = 0;
    for (size_t i = 0; i < u.params.size(); ++i) {
      u.trainable[i] = handle.requires_grad(static_cast<int>(i)) ? 1 : 0;
      u.num_trainable += u.trainable[i];
    }
  }
  for (size_t k = 0; k < orig_params_.size(); ++k) {
    const bool trainable =
        units_[orig_params_[k].unit]->trainable[orig_params_[k].index] != 0;
    if (optimizer_tensors_[k].requires_grad() != trainable) {
      optimizer_tensors_[k].set_requires_grad(trainable);
    }
  }
  // The caller's changes to the optimizer tensors' gradients: set to None
  // (zero_grad(set_to_none)) or replaced.
  for (size_t k = 0; k < optimizer_tensors_.size(); ++k) {
    const torch::Tensor& grad = optimizer_tensors_[k].grad();
    const torch::Tensor& bound = bound_grads_[k];
    if (grad.defined() && bound.defined() &&
        grad.unsafeGetTensorImpl() == bound.unsafeGetTensorImpl()) {
      continue;
    }
    if (!grad.defined() && !bound.defined()) continue;
    const int unit =
        use_orig_params_ ? orig_params_[k].unit : static_cast<int>(k);
    FlatParamHandle& handle = runtime_->handle(unit);
    if (!grad.defined()) {
      FLATPARAM_RETURN_IF_ERROR(use_orig_params_
                                    ? handle.SetGradNone(orig_params_[k].index)
                                    : handle.ZeroGrad(/*set_to_none=*/true));
      continue;
    }
    const std::string what =
        use_orig_params_
            ? absl::StrCat("parameter \"", orig_params_[k].fqn, "\"")
            : absl::StrCat("unit \"", units_[unit]->name, "\"");
    if (!bound.defined() || grad.numel() != bound.numel() ||
        grad.scalar_type() != bound.scalar_type()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "the gradient of ShardedParameters() of ", what,
          " was replaced by a tensor of ", grad.numel(), " ",
          c10::toString(grad.scalar_type()),
          " elements; FSDP's gradient there ",
          bound.defined()
              ? absl::StrCat("has ", bound.numel(), " ",
                             c10::toString(bound.scalar_type()), " elements")
              : std::string("is None"),
          ". Change it in place, or set it to None"));
    }
    torch::NoGradGuard no_grad;
    bound.copy_(grad.reshape({-1}));
  }
  BindShardedGrads();
  return absl::OkStatus();
}

}  // namespace libtorch
}  // namespace flatparam
