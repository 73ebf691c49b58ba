#include "flatparam/handle.h"

#include <algorithm>
#include <atomic>
#include <cassert>
#include <cstdio>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/internal/handle_internal.h"
#include "flatparam/internal/handle_test_hooks.h"

namespace flatparam {
namespace {

using internal_handle::OnStream;
using internal_handle::Skipped;
using internal_handle::TrackedBuffer;

// internal/handle_test_hooks.h.
std::atomic<internal_handle::SkippedOrdering> skipped_ordering{
    internal_handle::SkippedOrdering::kNone};

}  // namespace

absl::string_view HandleTrainingStateName(HandleTrainingState state) {
  switch (state) {
    case HandleTrainingState::kIdle:
      return "IDLE";
    case HandleTrainingState::kForward:
      return "FORWARD";
    case HandleTrainingState::kBackwardPre:
      return "BACKWARD_PRE";
    case HandleTrainingState::kBackwardPost:
      return "BACKWARD_POST";
    case HandleTrainingState::kSummonFullParams:
      return "SUMMON_FULL_PARAMS";
  }
  return "UNKNOWN";
}

bool ReshardsAfterForward(ShardingStrategy strategy) {
  return strategy == ShardingStrategy::kFullShard ||
         strategy == ShardingStrategy::kHybridShard;
}

double GradientPredivideFactor(int64_t world_size) {
  assert(world_size >= 1);
  int64_t factor = 1;
  while (world_size % factor == 0 && world_size / factor > factor) {
    factor *= 2;
  }
  return static_cast<double>(factor);
}

FlatParamHandle::FlatParamHandle(std::shared_ptr<const FlatParamLayout> layout,
                                 Communicator* shard_group,
                                 Communicator* replicate_group,
                                 DeviceOps* device,
                                 const HandleOptions& options)
    : layout_storage_(std::move(layout)),
      layout_(*layout_storage_),
      shard_group_(shard_group),
      replicate_group_(replicate_group),
      device_(device),
      options_(options),
      rank_(shard_group->rank()),
      world_size_(shard_group->size()) {
  // PyTorch's `_init_param_reduce_dtypes`.
  const DType orig = layout_.dtype();
  if (options.param_dtype.has_value() && !options.reduce_dtype.has_value()) {
    param_dtype_ = *options.param_dtype;
    reduce_dtype_ = param_dtype_;
  } else {
    param_dtype_ = options.param_dtype.value_or(orig);
    reduce_dtype_ = options.reduce_dtype.value_or(orig);
  }
  // PyTorch divides by factors of the whole data-parallel world, also for
  // the hybrid strategies (`_init_process_group_state`).
  dp_world_size_ = world_size_;
  if (IsHybridStrategy(layout_.options().strategy)) {
    dp_world_size_ *= replicate_group->size();
  }
  predivide_ = GradientPredivideFactor(dp_world_size_);
  postdivide_ = dp_world_size_ / predivide_;
  // The simulator and MPI fold reductions on the host with PyTorch's CPU
  // arithmetic (comm/host_reduce.h), dividing each contribution exactly as
  // HostDeviceOps::Scale would: on the host device, dividing inside their
  // collectives gives the same bits and saves two passes over the gradient.
  auto host_folds = [](const Communicator* c) {
    return c == nullptr || c->backend() == "sim" || c->backend() == "mpi";
  };
  divide_in_collectives_ =
      options.divide_in_collectives ||
      (device->device() == Device::Host() && host_folds(shard_group) &&
       host_folds(replicate_group));
  for (const ParamInfo& p : layout_.params()) {
    requires_grad_.push_back(p.requires_grad ? 1 : 0);
  }
  grad_none_.assign(layout_.params().size(), 0);
  // Stream-ordered collectives need both groups to order with the device's
  // streams, and the streams to have native handles.
  const Device d = device->device();
  const HandleStreams& st = options.streams;
  stream_ordered_ =
      options.stream_ordered && d != Device::Host() &&
      shard_group->SupportsStreams(d) &&
      (replicate_group == nullptr || replicate_group->SupportsStreams(d)) &&
      device->NativeStream(st.compute).has_value() &&
      device->NativeStream(st.unshard).has_value() &&
      device->NativeStream(st.post_backward).has_value();
}

FlatParamHandle::~FlatParamHandle() {
  // A collective in flight still uses buffers the handle owns: wait for it
  // before they are freed (its status no longer matters to anyone).
  if (pending_unshard_.has_value() && pending_unshard_->work != nullptr) {
    (void)pending_unshard_->work->Wait();
  }
  if (pending_reduce_.has_value() && pending_reduce_->work != nullptr) {
    (void)pending_reduce_->work->Wait();
  }
  (void)CheckCollectives();
}

absl::StatusOr<std::unique_ptr<FlatParamHandle>> FlatParamHandle::CreateCommon(
    std::shared_ptr<const FlatParamLayout> layout_storage,
    Communicator* shard_group, Communicator* replicate_group, DeviceOps* device,
    const HandleOptions& options) {
  const FlatParamLayout& layout = *layout_storage;
  const std::string unit = layout.unit().empty() ? "<root>" : layout.unit();
  if (shard_group == nullptr || device == nullptr) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "FlatParamHandle(unit '%s'): the shard group and the DeviceOps are "
        "required",
        unit));
  }
  const ShardingStrategy strategy = layout.options().strategy;
  if (shard_group->size() != layout.world_size()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "FlatParamHandle(unit '%s'): the layout is for world size %d but the "
        "shard group has %d ranks",
        unit, layout.world_size(), shard_group->size()));
  }
  if (IsHybridStrategy(strategy) != (replicate_group != nullptr)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "FlatParamHandle(unit '%s'): %s %s a replicate group", unit,
        ShardingStrategyName(strategy),
        IsHybridStrategy(strategy) ? "requires" : "does not take"));
  }
  for (const auto& [what, dtype] :
       {std::make_pair("param_dtype", options.param_dtype),
        std::make_pair("reduce_dtype", options.reduce_dtype)}) {
    if (dtype.has_value() && !IsFloatingPoint(*dtype)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "FlatParamHandle(unit '%s'): %s %s is not a floating dtype", unit,
          what, DTypeName(*dtype)));
    }
  }
  auto handle = std::unique_ptr<FlatParamHandle>(
      new FlatParamHandle(std::move(layout_storage), shard_group,
                          replicate_group, device, options));
  if (layout.options().align_addresses) {
    const DType aligned_for =
        layout.options().compute_dtype.value_or(layout.dtype());
    if (aligned_for != handle->param_dtype_) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "FlatParamHandle(unit '%s'): the layout aligns addresses for %s but "
          "the unsharded parameter dtype is %s; set "
          "LayoutOptions::compute_dtype to param_dtype",
          unit, DTypeName(aligned_for), DTypeName(handle->param_dtype_)));
    }
  }
  if (options.fake_all_gather || options.fake_reduce) {
    std::fprintf(stderr,
                 "flatparam warning: %s: fake %s: those collectives are "
                 "skipped, so training is incorrect (for measuring compute "
                 "alone)\n",
                 handle->Name().c_str(),
                 options.fake_all_gather && options.fake_reduce
                     ? "all-gather and reduce-scatter"
                 : options.fake_all_gather ? "all-gather"
                                           : "reduce-scatter");
  }
  if (options.cpu_offload) {
    // PyTorch pre-allocates `_cpu_grad` (zeros, pinned) for the whole run.
    FLATPARAM_ASSIGN_OR_RETURN(
        handle->cpu_grad_,
        handle->Alloc(MemoryCategory::kShardedGrads, layout.dtype(),
                      layout.sharded_numel(), MemoryPlacement::kOffload));
    FLATPARAM_RETURN_IF_ERROR(device->Fill(handle->cpu_grad_.ref(), 0));
  }
  return handle;
}

absl::StatusOr<std::unique_ptr<FlatParamHandle>> FlatParamHandle::Create(
    const FlatParamLayout& layout,
    absl::Span<const ConstBufferRef> initial_params, Communicator* shard_group,
    Communicator* replicate_group, DeviceOps* device,
    const HandleOptions& options) {
  return Create(std::make_shared<const FlatParamLayout>(layout), initial_params,
                shard_group, replicate_group, device, options);
}

absl::StatusOr<std::unique_ptr<FlatParamHandle>> FlatParamHandle::Create(
    std::shared_ptr<const FlatParamLayout> layout_storage,
    absl::Span<const ConstBufferRef> initial_params, Communicator* shard_group,
    Communicator* replicate_group, DeviceOps* device,
    const HandleOptions& options) {
  const FlatParamLayout& layout = *layout_storage;
  FLATPARAM_ASSIGN_OR_RETURN(
      std::unique_ptr<FlatParamHandle> handle,
      CreateCommon(std::move(layout_storage), shard_group, replicate_group,
                   device, options));
  FlatParamHandle& h = *handle;
  FLATPARAM_ASSIGN_OR_RETURN(
      h.local_shard_, h.Alloc(MemoryCategory::kShardedParams, layout.dtype(),
                              layout.sharded_numel(), h.shard_placement()));
  h.local_shard_ref_ = h.local_shard_.ref();
  const BufferRef shard = h.local_shard_ref_;
  if (options.meta_init) {
    if (initial_params.size() != layout.params().size()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: %d initial parameters for %d parameters", h.Name(),
          initial_params.size(), layout.params().size()));
    }
    for (size_t i = 0; i < initial_params.size(); ++i) {
      const ParamInfo& p = layout.params()[i];
      if (initial_params[i].count != p.numel ||
          initial_params[i].dtype != layout.dtype()) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "%s: meta parameter %s is %d x %s, the layout's is %d x %s",
            h.Name(), p.fqn, initial_params[i].count,
            DTypeName(initial_params[i].dtype), p.numel,
            DTypeName(layout.dtype())));
      }
    }
    FLATPARAM_RETURN_IF_ERROR(device->Fill(shard, 0));
    if (shard.device != Device::Host()) {
      FLATPARAM_RETURN_IF_ERROR(device->Synchronize());
    }
  } else if (shard.device == Device::Host()) {
    FLATPARAM_RETURN_IF_ERROR(
        FlattenShard(layout, initial_params, h.rank_, shard));
  } else {
    HostTensor staging = HostTensor::Flat(layout.dtype(), shard.count);
    FLATPARAM_RETURN_IF_ERROR(
        FlattenShard(layout, initial_params, h.rank_, staging.ref()));
    FLATPARAM_RETURN_IF_ERROR(
        device->Copy(shard, ConstBufferRef{staging.data(), staging.numel(),
                                           staging.dtype(), Device::Host()}));
    FLATPARAM_RETURN_IF_ERROR(device->Synchronize());
  }
  return handle;
}

absl::StatusOr<std::unique_ptr<FlatParamHandle>>
FlatParamHandle::CreateWithLocalShard(const FlatParamLayout& layout,
                                      BufferRef local_shard,
                                      Communicator* shard_group,
                                      Communicator* replicate_group,
                                      DeviceOps* device,
                                      const HandleOptions& options) {
  FLATPARAM_ASSIGN_OR_RETURN(
      std::unique_ptr<FlatParamHandle> handle,
      CreateCommon(std::make_shared<const FlatParamLayout>(layout), shard_group,
                   replicate_group, device, options));
  if (local_shard.dtype != layout.dtype() ||
      local_shard.count != layout.sharded_numel() ||
      local_shard.device != handle->shard_device() ||
      (local_shard.count > 0 && local_shard.data == nullptr)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: the local shard must be %d x %s on %s, got %d x %s on %s%s",
        handle->Name(), layout.sharded_numel(), DTypeName(layout.dtype()),
        DeviceName(handle->shard_device()), local_shard.count,
        DTypeName(local_shard.dtype), DeviceName(local_shard.device),
        local_shard.data == nullptr ? " (null)" : ""));
  }
  handle->local_shard_ref_ = local_shard;
  return handle;
}

// ---------------------------------------------------------------------------
// Helpers

std::string FlatParamHandle::Name() const {
  return absl::StrFormat("FlatParamHandle(unit '%s', rank %d of %d)",
                         layout_.unit().empty() ? "<root>" : layout_.unit(),
                         rank_, world_size_);
}

absl::Status FlatParamHandle::WrongState(absl::string_view op,
                                         absl::string_view expected) const {
  return absl::FailedPreconditionError(
      absl::StrFormat("%s: %s requires %s, but the handle is in state %s",
                      Name(), op, expected, HandleTrainingStateName(state_)));
}

absl::Status FlatParamHandle::CheckIndex(absl::string_view op,
                                         int index) const {
  if (index < 0 || index >= static_cast<int>(layout_.params().size())) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: %s: parameter index %d is out of range [0, %d)",
                        Name(), op, index, layout_.params().size()));
  }
  return absl::OkStatus();
}

bool FlatParamHandle::uses_sharded_strategy() const {
  return UsesShardedStrategy(strategy());
}

bool FlatParamHandle::force_full_precision() const {
  return (uses_param_mixed_precision() || uses_reduce_mixed_precision()) &&
         (state_ == HandleTrainingState::kSummonFullParams ||
          (!training_ && options_.use_full_prec_in_eval));
}

absl::Status FlatParamHandle::SetTraining(bool training) {
  if (state_ != HandleTrainingState::kIdle) {
    return WrongState("SetTraining", "IDLE");
  }
  FLATPARAM_RETURN_IF_ERROR(CheckNoPendingUnshard("SetTraining"));
  if (unsharded_) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "%s: SetTraining: the flat parameter is unsharded (state %s); "
        "Reshard first",
        Name(), HandleTrainingStateName(state_)));
  }
  if (training == training_) return absl::OkStatus();
  const bool was_full = force_full_precision();
  training_ = training;
  if (force_full_precision() != was_full) {
    // A kept unsharded parameter is in the other precision (and a kept
    // full-precision one may be stale by the next eval).
    full_param_padded_.Reset();
    full_prec_full_param_padded_.Reset();
  }
  return absl::OkStatus();
}

DType FlatParamHandle::unsharded_dtype() const {
  return force_full_precision() ? orig_dtype() : param_dtype_;
}

internal_handle::TrackedBuffer& FlatParamHandle::padded_unsharded() {
  return force_full_precision() && uses_param_mixed_precision()
             ? full_prec_full_param_padded_
             : full_param_padded_;
}

const internal_handle::TrackedBuffer& FlatParamHandle::padded_unsharded()
    const {
  return force_full_precision() && uses_param_mixed_precision()
             ? full_prec_full_param_padded_
             : full_param_padded_;
}

DType FlatParamHandle::grad_accum_dtype() const {
  // PyTorch casts the reduced gradient back to the parameters' dtype, except
  // for NO_SHARD with keep_low_precision_grads, which keeps it as reduced.
  // Offloaded gradients always land in `_cpu_grad`, of the parameters' dtype.
  if (!uses_sharded_strategy() && keeps_low_precision_grads() &&
      !options_.cpu_offload) {
    return reduce_dtype_;
  }
  return orig_dtype();
}

DType FlatParamHandle::grad_reduce_dtype() const {
  // Forced full precision (eval with use_full_prec_in_eval) computes and
  // reduces the gradient in the parameters' dtype: PyTorch's post-backward
  // skips its cast to the reduce dtype then.
  return force_full_precision() ? orig_dtype() : reduce_dtype_;
}

bool FlatParamHandle::keeps_low_precision_grads() const {
  return options_.keep_low_precision_grads && !force_full_precision();
}

bool FlatParamHandle::NeedsUnshard() const {
  return uses_sharded_strategy() && !padded_unsharded().allocated() &&
         !pending_unshard_.has_value();
}

absl::StatusOr<TrackedBuffer> FlatParamHandle::Alloc(
    MemoryCategory category, DType dtype, int64_t count,
    MemoryPlacement placement) {
  const bool offload = placement == MemoryPlacement::kOffload;
  return TrackedBuffer::Allocate(*device_, tracker_, category, placement,
                                 offload ? Device::Host() : device_->device(),
                                 dtype, count,
                                 /*pinned=*/offload);
}

// ---------------------------------------------------------------------------
// Runtime hooks

absl::Status FlatParamHandle::PreForward() {
  // An activation-checkpointing recompute inside this unit's backward:
  // PyTorch's _pre_forward returns early in BACKWARD_PRE (the parameter is
  // unsharded for the backward already).
  if (state_ == HandleTrainingState::kBackwardPre) return absl::OkStatus();
  if (state_ != HandleTrainingState::kIdle) {
    return WrongState("PreForward", "IDLE");
  }
  state_ = HandleTrainingState::kForward;
  if (!unsharded_) {
    absl::Status status =
        pending_unshard_.has_value() ? FinishUnshardImpl() : UnshardImpl();
    if (!status.ok()) {
      state_ = HandleTrainingState::kIdle;
      return status;
    }
  }
  return absl::OkStatus();
}

absl::Status FlatParamHandle::PostForward(bool is_root) {
  // The recompute's end: the backward goes on with the parameter unsharded
  // (PyTorch's _post_forward returns early in BACKWARD_PRE).
  if (state_ == HandleTrainingState::kBackwardPre) return absl::OkStatus();
  if (state_ != HandleTrainingState::kForward) {
    return WrongState("PostForward", "FORWARD");
  }
  // A prefetch started during the forward completes before the reshard.
  FLATPARAM_RETURN_IF_ERROR(FinishUnshardImpl());
  if (unsharded_) {
    FLATPARAM_RETURN_IF_ERROR(
        ReshardImpl(!is_root && ReshardsAfterForward(strategy())));
  }
  state_ = HandleTrainingState::kIdle;
  return absl::OkStatus();
}

absl::Status FlatParamHandle::PreBackward() {
  if (state_ != HandleTrainingState::kIdle) {
    return WrongState("PreBackward", "IDLE");
  }
  state_ = HandleTrainingState::kBackwardPre;
  if (!unsharded_) {
    absl::Status status =
        pending_unshard_.has_value() ? FinishUnshardImpl() : UnshardImpl();
    if (!status.ok()) {
      state_ = HandleTrainingState::kIdle;
      return status;
    }
  }
  return PrepareGradientForBackward();
}

absl::Status FlatParamHandle::PrepareGradientForBackward() {
  if (std::find(requires_grad_.begin(), requires_grad_.end(), 1) ==
      requires_grad_.end()) {
    return absl::OkStatus();
  }
  // The gradient buffers are the caller's backward's: compute stream.
  OnStream on_compute(device_, options_.streams.compute);
  assert(on_compute.status().ok());
  if (has_sharded_grad_ && keeps_low_precision_grads()) {
    FLATPARAM_RETURN_IF_ERROR(
        StreamWaits(options_.streams.compute, options_.streams.post_backward));
    FLATPARAM_RETURN_IF_ERROR(CastShardedGradTo(grad_accum_dtype()));
  }
  if (!unsharded_grad_.allocated()) {
    const int64_t numel = uses_sharded_strategy()
                              ? layout_.padded_unsharded_numel()
                              : layout_.unpadded_unsharded_numel();
    FLATPARAM_ASSIGN_OR_RETURN(
        unsharded_grad_,
        Alloc(MemoryCategory::kUnshardedGrads, unsharded_dtype(), numel));
    ++grad_epoch_;
    FLATPARAM_RETURN_IF_ERROR(device_->Fill(unsharded_grad_.ref(), 0));
  }
  // The backward's kernels follow on the compute stream.
  return absl::OkStatus();
}

absl::Status FlatParamHandle::PostBackward(bool sync_gradients) {
  FLATPARAM_RETURN_IF_ERROR(PostBackwardImpl(sync_gradients, "PostBackward"));
  return FinishReduceGradImpl();
}

absl::Status FlatParamHandle::PostBackwardAsync(bool sync_gradients) {
  return PostBackwardImpl(sync_gradients, "PostBackwardAsync");
}

absl::Status FlatParamHandle::PostBackwardImpl(bool sync_gradients,
                                               absl::string_view op) {
  if (state_ != HandleTrainingState::kBackwardPre) {
    return WrongState(op, "BACKWARD_PRE");
  }
  FLATPARAM_RETURN_IF_ERROR(FinishUnshardImpl());
  state_ = HandleTrainingState::kBackwardPost;
  if (unsharded_grad_.allocated() && sync_gradients) {
    // PyTorch's `_reset_is_grad_none`: a parameter that requires a gradient
    // received one (zeros included) -- once it is reduced: under no_sync it
    // only accumulates, and the optimizer still sees None.
    for (size_t i = 0; i < grad_none_.size(); ++i) {
      if (requires_grad_[i]) grad_none_[i] = 0;
    }
  }
  if (unsharded_) {
    // PyTorch's `_should_free_in_backward`.
    const bool free = uses_sharded_strategy() &&
                      (sync_gradients || ReshardsAfterForward(strategy()));
    FLATPARAM_RETURN_IF_ERROR(ReshardImpl(free));
  }
  if (!sync_gradients || !unsharded_grad_.allocated()) {
    return absl::OkStatus();
  }
  return StartReduceGradImpl();
}

absl::Status FlatParamHandle::FinalizeBackward(bool sync_gradients) {
  if (state_ == HandleTrainingState::kSummonFullParams) {
    return WrongState("FinalizeBackward",
                      "a state other than SUMMON_FULL_PARAMS (use "
                      "EndSummonFullParams)");
  }
  // PyTorch's final callback waits for the post-backward stream: a
  // reduction in flight completes here, as does a prefetched unshard that
  // no backward consumed (its parameter is then resharded below).
  const absl::Status unsharded = FinishUnshardImpl();
  const absl::Status reduced = FinishReduceGradImpl();
  FLATPARAM_RETURN_IF_ERROR(unsharded);
  FLATPARAM_RETURN_IF_ERROR(reduced);
  if (unsharded_) {
    // PyTorch's `_catch_all_reshard`, freeing as `_should_free_in_backward`.
    const bool free = uses_sharded_strategy() &&
                      (sync_gradients || ReshardsAfterForward(strategy()));
    FLATPARAM_RETURN_IF_ERROR(ReshardImpl(free));
  }
  if (sync_gradients && uses_sharded_strategy()) {
    // An unsharded parameter kept past a synchronizing backward (a root
    // unit's from forward, when its backward never ran) would be stale once
    // the optimizer steps; PyTorch keeps it (pytorch/pytorch#83956).
    full_param_padded_.Reset();
    full_prec_full_param_padded_.Reset();
  }
  if (state_ != HandleTrainingState::kBackwardPost && sync_gradients &&
      unsharded_grad_.allocated()) {
    // The post-backward never ran: no reduction, as in PyTorch.
    unsharded_grad_.Reset();
    ++grad_epoch_;
  }
  // PyTorch's `prepare_gradient_for_optim` casts only the gradients that
  // live in `_cpu_grad` or `_saved_grad_shard`; NO_SHARD without offload has
  // neither, so its gradient stays in the reduce dtype.
  const bool has_saved_or_cpu_grad =
      uses_sharded_strategy() || options_.cpu_offload;
  const HandleStreams& streams = options_.streams;
  if (sync_gradients && has_sharded_grad_ && keeps_low_precision_grads() &&
      has_saved_or_cpu_grad) {
    OnStream on_post_backward(device_, streams.post_backward);
    assert(on_post_backward.status().ok());
    FLATPARAM_RETURN_IF_ERROR(CastShardedGradTo(param_dtype_));
  }
  // PyTorch's final callback: the computation stream waits for the
  // post-backward stream, so the optimizer sees the sharded gradient, which
  // both streams now use.
  if (!Skipped(
          internal_handle::SkippedOrdering::kComputeWaitsForPostBackward)) {
    FLATPARAM_RETURN_IF_ERROR(
        StreamWaits(streams.compute, streams.post_backward));
  }
  for (const TrackedBuffer* g : {&sharded_grad_, &low_prec_cpu_grad_}) {
    FLATPARAM_RETURN_IF_ERROR(UsedBy(*g, streams.compute));
    FLATPARAM_RETURN_IF_ERROR(UsedBy(*g, streams.post_backward));
  }
  state_ = HandleTrainingState::kIdle;
  // The optimizer updates the local shard next, on the compute stream.
  local_shard_written_ = true;
  // Stream-ordered collectives: report any failure before the optimizer
  // trusts the gradients.
  return CheckCollectives();
}

namespace internal_handle {
void SetSkippedOrderingForTesting(SkippedOrdering skip) {
  skipped_ordering.store(skip, std::memory_order_relaxed);
}
bool IsSkippedForTesting(SkippedOrdering which) {
  return skipped_ordering.load(std::memory_order_relaxed) == which;
}
void SetSkipSyncBeforeAllGatherForTesting(bool skip) {
  SetSkippedOrderingForTesting(skip ? SkippedOrdering::kSyncBeforeAllGather
                                    : SkippedOrdering::kNone);
}
}  // namespace internal_handle

}  // namespace flatparam
