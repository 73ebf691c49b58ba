// FlatParamHandle: original-parameter views and summoning full parameters
// and gradients (PyTorch's `_use_unsharded_views`, `_unshard_params` and
// `_unshard_grads`).
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
// Views

absl::StatusOr<OrigParamView> FlatParamHandle::Param(int index) const {
  FLATPARAM_RETURN_IF_ERROR(CheckIndex("Param", index));
  const ParamInfo& p = layout_.params()[index];
  OrigParamView view;
  view.epoch = view_epoch_;
  if (unsharded_) {
    view.data = unsharded_ref_.Slice(p.offset, p.numel);
    view.shape = p.shape;
    view.sharded = false;
    return view;
  }
  view.sharded = true;
  if (!uses_sharded_strategy()) {
    // NO_SHARD's sharded views are the unflattened parameters themselves.
    view.data = local_shard_ref_.Slice(p.offset, p.numel);
    view.shape = p.shape;
    return view;
  }
  const ShardParamInfo info = layout_.shard_param_info(rank_, index);
  const int64_t numel =
      info.in_shard ? std::max<int64_t>(0, info.numel_in_shard) : 0;
  view.data =
      local_shard_ref_.Slice(info.in_shard ? info.offset_in_shard : 0, numel);
  view.shape = {numel};
  return view;
}

absl::StatusOr<OrigParamView> FlatParamHandle::UnshardedParam(int index) const {
  FLATPARAM_RETURN_IF_ERROR(CheckIndex("UnshardedParam", index));
  if (!unsharded_) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "%s: UnshardedParam: parameter '%s' is not unsharded (state %s); "
        "unshard first",
        Name(), layout_.params()[index].fqn, HandleTrainingStateName(state_)));
  }
  return Param(index);
}

absl::Status FlatParamHandle::CheckView(const OrigParamView& view) const {
  if (view.epoch == view_epoch_) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrFormat(
      "%s: a %s view from epoch %d is stale: the handle has been %s since "
      "(epoch %d, state %s)",
      Name(), view.sharded ? "sharded" : "unsharded", view.epoch,
      view.sharded ? "unsharded" : "resharded", view_epoch_,
      HandleTrainingStateName(state_)));
}

std::optional<BufferRef> FlatParamHandle::unsharded_flat_param() const {
  if (!unsharded_) return std::nullopt;
  return unsharded_ref_;
}

BufferRef FlatParamHandle::sharded_param() const { return local_shard_ref_; }

FlatParamShardMetadata FlatParamHandle::ShardMetadata() const {
  return layout_.shard_metadata(rank_);
}

// ---------------------------------------------------------------------------
// Summon full parameters

absl::Status FlatParamHandle::BeginSummonFullParams(bool writeback) {
  SummonOptions options;
  options.writeback = writeback;
  return BeginSummonFullParams(options);
}

absl::Status FlatParamHandle::BeginSummonFullParams(
    const SummonOptions& options) {
  // PyTorch's `_validate_unshard_params_args`.
  if (options.writeback && options.rank0_only) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: BeginSummonFullParams: writeback=true and rank0_only=true is not "
        "supported (the other ranks hold no full parameter to write back)",
        Name()));
  }
  if (options.with_grads && options.offload_to_cpu) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: BeginSummonFullParams: with_grads=true and offload_to_cpu=true "
        "is not supported",
        Name()));
  }
  if (options.offload_to_cpu && !uses_sharded_strategy()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: BeginSummonFullParams: offload_to_cpu=true and NO_SHARD is not "
        "supported",
        Name()));
  }
  if (state_ != HandleTrainingState::kIdle) {
    return WrongState("BeginSummonFullParams", "IDLE");
  }
  FLATPARAM_RETURN_IF_ERROR(CheckNoPendingUnshard("BeginSummonFullParams"));
  if (unsharded_) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "%s: BeginSummonFullParams: the flat parameter is unsharded (state "
        "%s); Reshard first",
        Name(), HandleTrainingStateName(state_)));
  }
  state_ = HandleTrainingState::kSummonFullParams;
  if (uses_sharded_strategy() && force_full_precision() &&
      uses_param_mixed_precision()) {
    // The full-precision parameter may change: a kept low-precision one
    // would go stale, so PyTorch frees it to force a new all-gather.
    full_param_padded_.Reset();
  }
  summon_free_at_end_ = NeedsUnshard();
  summon_ = options;
  summon_writeback_ = options.writeback;
  absl::Status status = UnshardImpl();
  if (status.ok() && options.with_grads) status = UnshardGrad();
  if (!status.ok()) {
    if (unsharded_)
      (void)ReshardImpl(uses_sharded_strategy() && summon_free_at_end_);
    summon_grad_.Reset();
    summon_has_grad_ = false;
    state_ = HandleTrainingState::kIdle;
    return status;
  }
  if (options.rank0_only && rank_ != 0) {
    // PyTorch reshards the other ranks at once: sharded views, no memory.
    summon_grad_.Reset();
    summon_has_grad_ = false;
    return ReshardImpl(uses_sharded_strategy() && summon_free_at_end_);
  }
  if (options.offload_to_cpu) {
    // PyTorch's `to_cpu`: the unpadded parameter to the host; the device
    // copy is freed (also one kept from before the summon).
    const int64_t unpadded = layout_.unpadded_unsharded_numel();
    FLATPARAM_ASSIGN_OR_RETURN(
        summon_host_param_,
        Alloc(MemoryCategory::kUnshardedParams, unsharded_ref_.dtype, unpadded,
              MemoryPlacement::kOffload));
    FLATPARAM_RETURN_IF_ERROR(
        device_->Copy(summon_host_param_.ref(), unsharded_ref_));
    FLATPARAM_RETURN_IF_ERROR(device_->Synchronize());
    padded_unsharded().Reset();
    unsharded_ref_ = summon_host_param_.ref();
    ++view_epoch_;
  }
  return absl::OkStatus();
}

absl::Status FlatParamHandle::UnshardGrad() {
  summon_grad_.Reset();
  summon_has_grad_ = false;
  if (!uses_sharded_strategy()) {
    // NO_SHARD: the sharded gradient is the full one.
    summon_has_grad_ = has_sharded_grad_;
    return absl::OkStatus();
  }
  // PyTorch's `unshard_grad`: are all ranks' gradients None?
  FLATPARAM_ASSIGN_OR_RETURN(
      TrackedBuffer none_count,
      Alloc(MemoryCategory::kUnshardedGrads, DType::kFloat32, 1));
  FLATPARAM_RETURN_IF_ERROR(
      device_->Fill(none_count.ref(), has_sharded_grad_ ? 0 : 1));
  FLATPARAM_RETURN_IF_ERROR(device_->Synchronize());
  ReduceOptions sum;
  static_cast<CollectiveOptions&>(sum) = options_.collective_options;
  sum.op = ReduceOp::kSum;
  FLATPARAM_RETURN_IF_ERROR(
      Wait(shard_group_->AllReduce(none_count.ref(), none_count.ref(), sum),
           "all-reduce of the None-gradient count"));
  float count = 0;
  FLATPARAM_RETURN_IF_ERROR(device_->Copy(
      BufferRef{&count, 1, DType::kFloat32, Device::Host()}, none_count.ref()));
  FLATPARAM_RETURN_IF_ERROR(device_->Synchronize());
  if (count == static_cast<float>(world_size_)) return absl::OkStatus();
  // The gradient's dtype on every rank that has one (what the optimizer
  // sees); a None gradient is all-gathered as zeros of that dtype.
  const DType dtype =
      keeps_low_precision_grads() ? param_dtype_ : grad_accum_dtype();
  TrackedBuffer zeros, staged;
  BufferRef source;
  if (has_sharded_grad_) {
    source = *sharded_grad();
    if (source.device != device_->device()) {
      FLATPARAM_ASSIGN_OR_RETURN(staged, Alloc(MemoryCategory::kShardedGrads,
                                               source.dtype, source.count));
      FLATPARAM_RETURN_IF_ERROR(device_->Copy(staged.ref(), source));
      source = staged.ref();
    }
  } else {
    FLATPARAM_ASSIGN_OR_RETURN(zeros, Alloc(MemoryCategory::kShardedGrads,
                                            dtype, layout_.sharded_numel()));
    FLATPARAM_RETURN_IF_ERROR(device_->Fill(zeros.ref(), 0));
    source = zeros.ref();
  }
  FLATPARAM_ASSIGN_OR_RETURN(
      summon_grad_, Alloc(MemoryCategory::kUnshardedGrads, source.dtype,
                          layout_.padded_unsharded_numel()));
  FLATPARAM_RETURN_IF_ERROR(device_->Synchronize());
  FLATPARAM_RETURN_IF_ERROR(
      Wait(shard_group_->AllGather(source, summon_grad_.ref(),
                                   options_.collective_options),
           "all-gather of the gradient"));
  summon_has_grad_ = true;
  return absl::OkStatus();
}

absl::StatusOr<std::optional<BufferRef>> FlatParamHandle::UnshardedGradView(
    int index) const {
  FLATPARAM_RETURN_IF_ERROR(CheckIndex("UnshardedGradView", index));
  if (state_ != HandleTrainingState::kSummonFullParams || !summon_.with_grads) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "%s: UnshardedGradView requires summoning with gradients, but the "
        "handle is in state %s%s",
        Name(), HandleTrainingStateName(state_),
        state_ == HandleTrainingState::kSummonFullParams ? " without them"
                                                         : ""));
  }
  if (!summon_has_grad_ || !requires_grad_[index] || grad_none_[index]) {
    return std::optional<BufferRef>();
  }
  const ParamInfo& p = layout_.params()[index];
  const BufferRef all =
      uses_sharded_strategy() ? summon_grad_.ref() : *sharded_grad();
  return std::optional<BufferRef>(all.Slice(p.offset, p.numel));
}

absl::Status FlatParamHandle::EndSummonFullParams() {
  if (state_ != HandleTrainingState::kSummonFullParams) {
    return WrongState("EndSummonFullParams", "SUMMON_FULL_PARAMS");
  }
  absl::Status status;
  // The caller may have written the local shard while summoning.
  local_shard_written_ = true;
  if (summon_writeback_) {
    // PyTorch's `_writeback_to_local_shard`: this rank's unpadded chunk.
    const int64_t unpadded = layout_.unpadded_unsharded_numel();
    if (uses_sharded_strategy()) {
      const UnpaddedShard chunk =
          GetUnpaddedShard(unpadded, rank_, world_size_);
      const int64_t n = chunk.end - chunk.begin;
      status = device_->Copy(local_shard_ref_.Slice(0, n),
                             unsharded_ref_.Slice(chunk.begin, n));
      if (status.ok() && summon_grad_.allocated() && has_sharded_grad_) {
        status = device_->Copy(sharded_grad()->Slice(0, n),
                               summon_grad_.ref().Slice(chunk.begin, n));
      }
    } else if (unsharded_ref_.data != local_shard_ref_.data) {
      status =
          device_->Copy(local_shard_ref_, unsharded_ref_.Slice(0, unpadded));
    }
    if (status.ok()) status = device_->Synchronize();
  }
  absl::Status reshard = absl::OkStatus();
  if (unsharded_) {
    reshard = ReshardImpl(uses_sharded_strategy() && summon_free_at_end_);
  }
  summon_grad_.Reset();
  summon_has_grad_ = false;
  summon_host_param_.Reset();
  summon_ = SummonOptions();
  state_ = HandleTrainingState::kIdle;
  if (!status.ok()) return status;
  return reshard;
}

}  // namespace flatparam
