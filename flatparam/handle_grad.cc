// FlatParamHandle: gradients -- the reduction (pre-divide, reduce-scatter,
// hybrid all-reduce, post-divide, casts, accumulation), the views a
// backward writes into, the None mask and requires_grad changes (PyTorch's
// `_post_backward_hook`, `_reduce_grad` and `_use_sharded_grad_views`).
#include <algorithm>
#include <cassert>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/handle.h"
#include "flatparam/internal/handle_internal.h"

namespace flatparam {

using internal_handle::OnStream;
using internal_handle::Skipped;
using internal_handle::TrackedBuffer;

// ---------------------------------------------------------------------------
// Gradients

absl::Status FlatParamHandle::ZeroUngradedSegments(BufferRef grad) {
  const auto& numels = layout_.numels_with_padding();
  const auto& padding = layout_.is_padding_mask();
  int64_t offset = 0;
  int param = 0;
  for (size_t s = 0; s < numels.size(); ++s) {
    const bool zero = padding[s] || !requires_grad_[param];
    if (zero && numels[s] > 0) {
      FLATPARAM_RETURN_IF_ERROR(
          device_->Fill(grad.Slice(offset, numels[s]), 0));
    }
    if (!padding[s]) ++param;
    offset += numels[s];
  }
  if (grad.count > offset) {
    FLATPARAM_RETURN_IF_ERROR(
        device_->Fill(grad.Slice(offset, grad.count - offset), 0));
  }
  return absl::OkStatus();
}

absl::Status FlatParamHandle::ReduceGrad() {
  if (state_ != HandleTrainingState::kBackwardPre &&
      state_ != HandleTrainingState::kBackwardPost) {
    return WrongState("ReduceGrad", "BACKWARD_PRE or BACKWARD_POST");
  }
  if (pending_reduce_.has_value()) return FinishReduceGradImpl();
  if (!unsharded_grad_.allocated()) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "%s: ReduceGrad: there is no unsharded gradient to reduce (state %s)",
        Name(), HandleTrainingStateName(state_)));
  }
  FLATPARAM_RETURN_IF_ERROR(StartReduceGradImpl());
  return FinishReduceGradImpl();
}

absl::Status FlatParamHandle::FinishReduceGrad() {
  return FinishReduceGradImpl();
}

absl::Status FlatParamHandle::StartReduceGradImpl() {
  assert(!pending_reduce_.has_value() && unsharded_grad_.allocated());
  const HandleStreams& streams = options_.streams;
  // The reduction reads the gradient the backward wrote on the compute
  // stream; the compute stream allocated it, so it is recorded for the
  // post-backward stream before it is freed.
  if (!Skipped(
          internal_handle::SkippedOrdering::kPostBackwardWaitsForCompute)) {
    FLATPARAM_RETURN_IF_ERROR(
        StreamWaits(streams.post_backward, streams.compute));
  }
  FLATPARAM_RETURN_IF_ERROR(UsedBy(unsharded_grad_, streams.post_backward));
  OnStream on_post_backward(device_, streams.post_backward);
  assert(on_post_backward.status().ok());
  TrackedBuffer grad = std::move(unsharded_grad_);
  ++grad_epoch_;
  FLATPARAM_RETURN_IF_ERROR(ZeroUngradedSegments(grad.ref()));
  // 1. To the reduce dtype (PyTorch's post-backward `.to(reduce_dtype)`).
  if (grad.dtype() != grad_reduce_dtype()) {
    FLATPARAM_ASSIGN_OR_RETURN(TrackedBuffer reduced,
                               Alloc(MemoryCategory::kUnshardedGrads,
                                     grad_reduce_dtype(), grad.count()));
    FLATPARAM_RETURN_IF_ERROR(device_->Cast(reduced.ref(), grad.ref()));
    grad = std::move(reduced);
  }
  const bool hybrid = IsHybridStrategy(strategy());
  const bool in_collectives = divide_in_collectives_;
  // 2. Pre-divide (PyTorch's `_div_if_needed`: only factors > 1).
  if (!in_collectives && predivide_ > 1) {
    FLATPARAM_RETURN_IF_ERROR(
        device_->Scale(grad.ref(), ScaleOp::kDivide, predivide_));
  }
  PendingReduce pending;
  ReduceOptions first;
  static_cast<CollectiveOptions&>(first) = options_.collective_options;
  first.op = ReduceOp::kSum;
  pending.second = first;
  if (in_collectives) {
    if (predivide_ > 1) first.pre_divide_factor = predivide_;
    if (postdivide_ > 1) {
      (hybrid ? pending.second : first).post_divide_factor = postdivide_;
    }
  }
  // The collective reads what the post-backward stream's work above wrote:
  // it is issued after that work (stream-ordered), or the host waits for
  // it.
  if (stream_ordered_) {
    first.stream = Native(streams.post_backward);
    pending.second.stream = first.stream;
  } else {
    FLATPARAM_RETURN_IF_ERROR(HostWaitsFor(streams.post_backward));
  }
  if (uses_sharded_strategy()) {
    // 3. Reduce-scatter into a new sharded gradient; `grad` is the
    // collective's input until it completes.
    FLATPARAM_ASSIGN_OR_RETURN(
        pending.shard, Alloc(MemoryCategory::kShardedGrads, grad_reduce_dtype(),
                             layout_.sharded_numel()));
    if (!options_.fake_reduce) {
      pending.work =
          shard_group_->ReduceScatter(grad.ref(), pending.shard.ref(), first);
    }
    pending.input = std::move(grad);
    if (stream_ordered_ && hybrid) {
      // 4. Stream-ordered, the all-reduce over the replicate group follows
      // on the post-backward stream at once, as PyTorch issues it in the
      // post-backward hook (host-completed, it waits for FinishReduceGrad).
      if (pending.work != nullptr) {
        absl::Status waited =
            StreamWaitsFor(std::move(pending.work), streams.post_backward,
                           "reduce-scatter of the gradient");
        if (!waited.ok()) return waited;
      }
      pending.work = replicate_group_->AllReduce(
          pending.shard.ref(), pending.shard.ref(), pending.second);
      pending.all_reduce_issued = true;
    }
  } else {
    pending.work = shard_group_->AllReduce(grad.ref(), grad.ref(), first);
    pending.shard = std::move(grad);
    pending.shard.Recategorize(MemoryCategory::kShardedGrads);
  }
  pending_reduce_.emplace(std::move(pending));
  return absl::OkStatus();
}

absl::Status FlatParamHandle::FinishReduceGradImpl() {
  if (!pending_reduce_.has_value()) return absl::OkStatus();
  PendingReduce pending = std::move(*pending_reduce_);
  pending_reduce_.reset();
  const Stream post_backward = options_.streams.post_backward;
  // Stream-ordered, the post-backward stream waits for each collective and
  // runs everything after it; the input (recorded for that stream) is then
  // freed after the reduction.
  auto complete = [&](std::unique_ptr<Work> work, absl::string_view what) {
    return stream_ordered_
               ? StreamWaitsFor(std::move(work), post_backward, what)
               : Wait(std::move(work), what);
  };
  constexpr absl::string_view kReplicated =
      "all-reduce of the gradient over the replicate group";
  if (pending.work != nullptr) {
    FLATPARAM_RETURN_IF_ERROR(complete(std::move(pending.work),
                                       pending.all_reduce_issued ? kReplicated
                                       : uses_sharded_strategy()
                                           ? "reduce-scatter of the gradient"
                                           : "all-reduce of the gradient"));
  }
  pending.input.Reset();
  OnStream on_post_backward(device_, post_backward);
  assert(on_post_backward.status().ok());
  TrackedBuffer shard = std::move(pending.shard);
  // 4. Hybrid: sum the shard group's results across replicas.
  if (IsHybridStrategy(strategy()) && !pending.all_reduce_issued) {
    FLATPARAM_RETURN_IF_ERROR(complete(
        replicate_group_->AllReduce(shard.ref(), shard.ref(), pending.second),
        kReplicated));
  }
  // 5. Post-divide.
  if (!divide_in_collectives_ && postdivide_ > 1) {
    FLATPARAM_RETURN_IF_ERROR(
        device_->Scale(shard.ref(), ScaleOp::kDivide, postdivide_));
  }
  // 6. To the accumulation dtype (PyTorch's `_cast_grad_to_param_dtype`).
  const DType accum = grad_accum_dtype();
  if (shard.dtype() != accum) {
    FLATPARAM_ASSIGN_OR_RETURN(
        TrackedBuffer cast,
        Alloc(MemoryCategory::kShardedGrads, accum, shard.count()));
    FLATPARAM_RETURN_IF_ERROR(device_->Cast(cast.ref(), shard.ref()));
    shard = std::move(cast);
  }
  // 7. Accumulate.
  return AccumulateShardedGrad(std::move(shard));
}

absl::Status FlatParamHandle::AccumulateShardedGrad(TrackedBuffer new_grad) {
  if (has_sharded_grad_) {
    FLATPARAM_RETURN_IF_ERROR(CastShardedGradTo(new_grad.dtype()));
  }
  if (options_.cpu_offload) {
    if (!has_sharded_grad_) {
      FLATPARAM_RETURN_IF_ERROR(device_->Copy(cpu_grad_.ref(), new_grad.ref()));
    } else if (new_grad.ref().device == Device::Host()) {
      FLATPARAM_RETURN_IF_ERROR(device_->Add(cpu_grad_.ref(), new_grad.ref()));
    } else {
      FLATPARAM_ASSIGN_OR_RETURN(
          TrackedBuffer staging,
          Alloc(MemoryCategory::kShardedGrads, new_grad.dtype(),
                new_grad.count(), MemoryPlacement::kOffload));
      FLATPARAM_RETURN_IF_ERROR(device_->Copy(staging.ref(), new_grad.ref()));
      new_grad.Reset();
      FLATPARAM_RETURN_IF_ERROR(device_->Add(cpu_grad_.ref(), staging.ref()));
    }
  } else if (!has_sharded_grad_) {
    sharded_grad_ = std::move(new_grad);
  } else {
    FLATPARAM_RETURN_IF_ERROR(
        device_->Add(sharded_grad_.ref(), new_grad.ref()));
  }
  has_sharded_grad_ = true;
  // The compute stream waits for this in FinalizeBackward.
  return absl::OkStatus();
}

absl::Status FlatParamHandle::CastShardedGradTo(DType dtype) {
  if (!has_sharded_grad_) return absl::OkStatus();
  if (options_.cpu_offload) {
    // `_cpu_grad` stays in the parameters' dtype; a low-precision copy is
    // what the optimizer sees under keep_low_precision_grads.
    if (low_prec_cpu_grad_.allocated()) {
      if (low_prec_cpu_grad_.dtype() == dtype) return absl::OkStatus();
      FLATPARAM_RETURN_IF_ERROR(
          device_->Cast(cpu_grad_.ref(), low_prec_cpu_grad_.ref()));
      low_prec_cpu_grad_.Reset();
    }
    if (dtype == cpu_grad_.dtype()) return absl::OkStatus();
    FLATPARAM_ASSIGN_OR_RETURN(
        low_prec_cpu_grad_,
        Alloc(MemoryCategory::kShardedGrads, dtype, cpu_grad_.count(),
              MemoryPlacement::kOffload));
    return device_->Cast(low_prec_cpu_grad_.ref(), cpu_grad_.ref());
  }
  if (sharded_grad_.dtype() == dtype) return absl::OkStatus();
  FLATPARAM_ASSIGN_OR_RETURN(
      TrackedBuffer cast,
      Alloc(MemoryCategory::kShardedGrads, dtype, sharded_grad_.count()));
  FLATPARAM_RETURN_IF_ERROR(device_->Cast(cast.ref(), sharded_grad_.ref()));
  sharded_grad_ = std::move(cast);
  return absl::OkStatus();
}

absl::StatusOr<BufferRef> FlatParamHandle::GradView(int index) const {
  FLATPARAM_RETURN_IF_ERROR(CheckIndex("GradView", index));
  if (state_ != HandleTrainingState::kBackwardPre) {
    return WrongState("GradView", "BACKWARD_PRE");
  }
  const ParamInfo& p = layout_.params()[index];
  if (!requires_grad_[index]) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "%s: GradView: parameter '%s' does not require a gradient", Name(),
        p.fqn));
  }
  if (!unsharded_grad_.allocated()) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "%s: GradView: there is no unsharded gradient (state %s)", Name(),
        HandleTrainingStateName(state_)));
  }
  return unsharded_grad_.ref().Slice(p.offset, p.numel);
}

absl::Status FlatParamHandle::AccumulateGrad(int index, ConstBufferRef grad) {
  FLATPARAM_ASSIGN_OR_RETURN(BufferRef view, GradView(index));
  if (grad.count != view.count) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: AccumulateGrad: parameter '%s' has %d elements, the gradient %d",
        Name(), layout_.params()[index].fqn, view.count, grad.count));
  }
  // The caller's backward: the compute stream.
  OnStream on_compute(device_, options_.streams.compute);
  assert(on_compute.status().ok());
  TrackedBuffer moved;
  TrackedBuffer cast;
  if (grad.device != view.device) {
    FLATPARAM_ASSIGN_OR_RETURN(
        moved, Alloc(MemoryCategory::kUnshardedGrads, grad.dtype, grad.count));
    FLATPARAM_RETURN_IF_ERROR(device_->Copy(moved.ref(), grad));
    grad = moved.ref();
  }
  if (grad.dtype != view.dtype) {
    FLATPARAM_ASSIGN_OR_RETURN(
        cast, Alloc(MemoryCategory::kUnshardedGrads, view.dtype, grad.count));
    FLATPARAM_RETURN_IF_ERROR(device_->Cast(cast.ref(), grad));
    grad = cast.ref();
  }
  // The temporaries are the compute stream's: their memory is reused only
  // by work issued on it later.
  return device_->Add(view, grad);
}

std::optional<BufferRef> FlatParamHandle::unsharded_grad() const {
  if (!unsharded_grad_.allocated()) return std::nullopt;
  return unsharded_grad_.ref();
}

std::optional<BufferRef> FlatParamHandle::sharded_grad() const {
  if (!has_sharded_grad_) return std::nullopt;
  if (options_.cpu_offload) {
    return low_prec_cpu_grad_.allocated() ? low_prec_cpu_grad_.ref()
                                          : cpu_grad_.ref();
  }
  return sharded_grad_.ref();
}

absl::StatusOr<std::optional<BufferRef>> FlatParamHandle::ShardedGradView(
    int index) const {
  FLATPARAM_RETURN_IF_ERROR(CheckIndex("ShardedGradView", index));
  const std::optional<BufferRef> grad = sharded_grad();
  if (!grad.has_value() || !requires_grad_[index] || grad_none_[index]) {
    return std::optional<BufferRef>();
  }
  const ShardParamInfo info = layout_.shard_param_info(rank_, index);
  if (!info.in_shard) return std::optional<BufferRef>();
  return std::optional<BufferRef>(grad->Slice(
      info.offset_in_shard, std::max<int64_t>(0, info.numel_in_shard)));
}

bool FlatParamHandle::grad_is_none(int index) const {
  return !requires_grad_[index] || grad_none_[index] || !has_sharded_grad_;
}

absl::Status FlatParamHandle::SetGradNone(int index) {
  FLATPARAM_RETURN_IF_ERROR(CheckIndex("SetGradNone", index));
  if (state_ != HandleTrainingState::kIdle) {
    return WrongState("SetGradNone", "IDLE");
  }
  grad_none_[index] = 1;
  const ParamInfo& p = layout_.params()[index];
  if (unsharded_grad_.allocated() && p.numel > 0) {
    FLATPARAM_RETURN_IF_ERROR(
        device_->Fill(unsharded_grad_.ref().Slice(p.offset, p.numel), 0));
  }
  if (has_sharded_grad_) {
    const ShardParamInfo info = layout_.shard_param_info(rank_, index);
    if (info.in_shard && info.numel_in_shard > 0) {
      const int64_t off = info.offset_in_shard, n = info.numel_in_shard;
      if (options_.cpu_offload) {
        FLATPARAM_RETURN_IF_ERROR(
            device_->Fill(cpu_grad_.ref().Slice(off, n), 0));
      }
      FLATPARAM_RETURN_IF_ERROR(
          device_->Fill(sharded_grad()->Slice(off, n), 0));
    }
    // Parameters outside this rank's shard have no gradient here
    // (`_use_sharded_grad_views` sets them None).
    bool all_none = true;
    for (size_t i = 0; i < grad_none_.size(); ++i) {
      const ShardParamInfo in = layout_.shard_param_info(rank_, i);
      all_none &= grad_none_[i] || !requires_grad_[i] || !in.in_shard ||
                  in.numel_in_shard == 0;
    }
    if (all_none && !unsharded_grad_.allocated()) {
      // PyTorch's `flat_param.grad = None` once every original one is.
      return ZeroGrad(/*set_to_none=*/true);
    }
  }
  return device_->Synchronize();
}

absl::Status FlatParamHandle::SetRequiresGrad(int index, bool requires_grad) {
  FLATPARAM_RETURN_IF_ERROR(CheckIndex("SetRequiresGrad", index));
  if (state_ != HandleTrainingState::kIdle) {
    return WrongState("SetRequiresGrad", "IDLE");
  }
  if (!layout_.options().align_addresses) {
    for (size_t i = 0; i < requires_grad_.size(); ++i) {
      if (static_cast<int>(i) == index ||
          (requires_grad_[i] != 0) == requires_grad) {
        continue;
      }
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: SetRequiresGrad: must flatten tensors with uniform "
          "`requires_grad` when `use_orig_params=False` (align_addresses "
          "off): '%s' would have requires_grad=%s but '%s' has %s",
          Name(), layout_.params()[index].fqn, requires_grad ? "true" : "false",
          layout_.params()[i].fqn, requires_grad_[i] ? "true" : "false"));
    }
  }
  if (requires_grad_[index] && !requires_grad) {
    // A frozen parameter's gradient is None (`_use_sharded_grad_views`),
    // which PyTorch writes back as a None mask and a zeroed segment: once
    // unfrozen it has no gradient until its next backward, so an optimizer
    // with weight decay or momentum skips it.
    FLATPARAM_RETURN_IF_ERROR(SetGradNone(index));
  }
  requires_grad_[index] = requires_grad ? 1 : 0;
  return absl::OkStatus();
}

absl::Status FlatParamHandle::SetAllRequiresGrad(bool requires_grad) {
  if (state_ != HandleTrainingState::kIdle) {
    return WrongState("SetAllRequiresGrad", "IDLE");
  }
  requires_grad_.assign(requires_grad_.size(), requires_grad ? 1 : 0);
  return absl::OkStatus();
}

absl::Status FlatParamHandle::ZeroGrad(bool set_to_none) {
  if (state_ != HandleTrainingState::kIdle) {
    return WrongState("ZeroGrad", "IDLE");
  }
  if (set_to_none) {
    if (unsharded_grad_.allocated()) {
      unsharded_grad_.Reset();
      ++grad_epoch_;
    }
    sharded_grad_.Reset();
    low_prec_cpu_grad_.Reset();
    has_sharded_grad_ = false;
    return absl::OkStatus();
  }
  if (unsharded_grad_.allocated()) {
    FLATPARAM_RETURN_IF_ERROR(device_->Fill(unsharded_grad_.ref(), 0));
  }
  if (has_sharded_grad_) {
    if (options_.cpu_offload) {
      FLATPARAM_RETURN_IF_ERROR(device_->Fill(cpu_grad_.ref(), 0));
    }
    FLATPARAM_RETURN_IF_ERROR(device_->Fill(*sharded_grad(), 0));
  }
  return device_->Synchronize();
}

}  // namespace flatparam
