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
#include "flatparam/internal/handle_test_hooks.h"

namespace flatparam {
namespace {

using internal_handle::TrackedBuffer;

// internal/handle_test_hooks.h.
std::atomic<internal_handle::SkippedOrdering> skipped_ordering{
    internal_handle::SkippedOrdering::kNone};

bool Skipped(internal_handle::SkippedOrdering which) {
  return skipped_ordering.load(std::memory_order_relaxed) == which;
}

// Makes `stream` current for the scope, restoring the previous one.
class OnStream {
 public:
  OnStream(DeviceOps* device, Stream stream)
      : device_(device), previous_(device->current_stream()) {
    const absl::Status set = device_->SetStream(stream);
    assert(set.ok());
    (void)set;
  }
  ~OnStream() { (void)device_->SetStream(previous_); }
  OnStream(const OnStream&) = delete;
  OnStream& operator=(const OnStream&) = delete;

 private:
  DeviceOps* device_;
  Stream previous_;
};

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

FlatParamHandle::FlatParamHandle(const FlatParamLayout& layout,
                                 Communicator* shard_group,
                                 Communicator* replicate_group,
                                 DeviceOps* device,
                                 const HandleOptions& options)
    : layout_(layout),
      shard_group_(shard_group),
      replicate_group_(replicate_group),
      device_(device),
      options_(options),
      rank_(shard_group->rank()),
      world_size_(shard_group->size()) {
  // PyTorch's `_init_param_reduce_dtypes`.
  const DType orig = layout.dtype();
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
  if (IsHybridStrategy(layout.options().strategy)) {
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
  for (const ParamInfo& p : layout.params()) {
    requires_grad_.push_back(p.requires_grad ? 1 : 0);
  }
  grad_none_.assign(layout.params().size(), 0);
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
    const FlatParamLayout& layout, Communicator* shard_group,
    Communicator* replicate_group, DeviceOps* device,
    const HandleOptions& options) {
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
  auto handle = std::unique_ptr<FlatParamHandle>(new FlatParamHandle(
      layout, shard_group, replicate_group, device, options));
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
  FLATPARAM_ASSIGN_OR_RETURN(
      std::unique_ptr<FlatParamHandle> handle,
      CreateCommon(layout, shard_group, replicate_group, device, options));
  FlatParamHandle& h = *handle;
  FLATPARAM_ASSIGN_OR_RETURN(
      h.local_shard_, h.Alloc(MemoryCategory::kShardedParams, layout.dtype(),
                              layout.sharded_numel(), h.shard_placement()));
  h.local_shard_ref_ = h.local_shard_.ref();
  const BufferRef shard = h.local_shard_ref_;
  if (shard.device == Device::Host()) {
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
      CreateCommon(layout, shard_group, replicate_group, device, options));
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

absl::Status FlatParamHandle::Named(const absl::Status& status,
                                    absl::string_view what) const {
  if (status.ok()) return status;
  return absl::Status(status.code(),
                      absl::StrCat(Name(), ": ", what, ": ", status.message()));
}

absl::Status FlatParamHandle::Wait(std::unique_ptr<Work> work,
                                   absl::string_view what) {
  return Named(work->Wait(), what);
}

absl::Status FlatParamHandle::StreamWaitsFor(std::unique_ptr<Work> work,
                                             Stream stream,
                                             absl::string_view what) {
  const absl::Status status = work->WaitStream(*Native(stream));
  if (!status.ok()) {
    // The stream is not ordered after the collective: the host waits for
    // it instead, so that its buffers may be freed.
    (void)work->Wait();
    return Named(status, what);
  }
  unchecked_.emplace_back(std::move(work), std::string(what));
  // Loops without a FinalizeBackward (evaluation) would keep every work:
  // the oldest, long finished in practice, are checked now.
  return CheckCollectives(kMaxUncheckedCollectives);
}

absl::Status FlatParamHandle::CheckCollectives(size_t keep) {
  absl::Status first = absl::OkStatus();
  while (unchecked_.size() > keep) {
    const absl::Status status =
        Named(unchecked_.front().first->Wait(), unchecked_.front().second);
    if (first.ok()) first = status;
    unchecked_.pop_front();
  }
  return first;
}

std::optional<DeviceStream> FlatParamHandle::Native(Stream stream) const {
  return device_->NativeStream(stream);
}

absl::Status FlatParamHandle::StreamWaits(Stream waiter, Stream on) {
  if (waiter == on) return absl::OkStatus();
  FLATPARAM_ASSIGN_OR_RETURN(Event event, device_->RecordEvent(on));
  return device_->WaitEvent(waiter, event);
}

absl::Status FlatParamHandle::HostWaitsFor(Stream stream) {
  FLATPARAM_ASSIGN_OR_RETURN(Event event, device_->RecordEvent(stream));
  return device_->SynchronizeEvent(event);
}

absl::Status FlatParamHandle::UsedBy(const TrackedBuffer& buffer,
                                     Stream stream) {
  if (!buffer.allocated()) return absl::OkStatus();
  return device_->RecordStream(buffer.ref(), stream);
}

absl::StatusOr<BufferRef> FlatParamHandle::LocalShardOnCompute(
    TrackedBuffer* copy) {
  if (!options_.cpu_offload) return local_shard_ref_;
  // PyTorch's `flat_param_to(device)`: a compute-device copy of the shard.
  // It is the unsharded parameter for NO_SHARD, and transient otherwise.
  const MemoryCategory category = uses_sharded_strategy()
                                      ? MemoryCategory::kShardedParams
                                      : MemoryCategory::kUnshardedParams;
  FLATPARAM_ASSIGN_OR_RETURN(
      *copy, Alloc(category, orig_dtype(), local_shard_ref_.count));
  FLATPARAM_RETURN_IF_ERROR(device_->Copy(copy->ref(), local_shard_ref_));
  return copy->ref();
}

// ---------------------------------------------------------------------------
// Unshard / reshard

absl::Status FlatParamHandle::UnshardImpl() {
  FLATPARAM_RETURN_IF_ERROR(StartUnshardImpl());
  return FinishUnshardImpl();
}

absl::Status FlatParamHandle::StartUnshardImpl() {
  assert(!unsharded_ && !pending_unshard_.has_value());
  const int64_t unpadded = layout_.unpadded_unsharded_numel();
  const bool low_precision =
      uses_param_mixed_precision() && !force_full_precision();
  const HandleStreams& streams = options_.streams;
  // The unshard reads the local shard after the compute stream's updates
  // of it (the optimizer step), once per iteration.
  if (local_shard_written_ &&
      !Skipped(internal_handle::SkippedOrdering::kUnshardWaitsForCompute)) {
    FLATPARAM_RETURN_IF_ERROR(StreamWaits(streams.unshard, streams.compute));
  }
  local_shard_written_ = false;
  OnStream on_unshard(device_, streams.unshard);
  if (uses_sharded_strategy()) {
    TrackedBuffer& target = padded_unsharded();
    if (!target.allocated()) {
      // Pre-unshard: what to all-gather (PyTorch's `pre_unshard`). The
      // collective reads `source` until it completes, so its buffers (the
      // offload copy, the low-precision shard) belong to the pending
      // unshard until FinishUnshardImpl.
      PendingUnshard pending;
      pending.target = &target;
      BufferRef source;
      if (low_precision) {
        TrackedBuffer copy;
        FLATPARAM_ASSIGN_OR_RETURN(BufferRef full, LocalShardOnCompute(&copy));
        FLATPARAM_ASSIGN_OR_RETURN(pending.mp_shard,
                                   Alloc(MemoryCategory::kLowPrecisionParams,
                                         param_dtype_, full.count));
        FLATPARAM_RETURN_IF_ERROR(device_->Cast(pending.mp_shard.ref(), full));
        // Freed at once, as before this became asynchronous: DeviceOps work
        // runs in issue order on one stream, so a later reuse of the block
        // comes after the cast that reads it.
        copy.Reset();
        source = pending.mp_shard.ref();
      } else {
        FLATPARAM_ASSIGN_OR_RETURN(source, LocalShardOnCompute(&pending.copy));
      }
      FLATPARAM_ASSIGN_OR_RETURN(
          pending.padded,
          Alloc(MemoryCategory::kUnshardedParams, unsharded_dtype(),
                layout_.padded_unsharded_numel()));
      // The all-gather reads what the unshard stream's work above wrote:
      // it is issued after that work (stream-ordered), or the host waits
      // for it.
      CollectiveOptions options = options_.collective_options;
      if (!Skipped(internal_handle::SkippedOrdering::kSyncBeforeAllGather)) {
        if (stream_ordered_) {
          options.stream = Native(streams.unshard);
        } else {
          FLATPARAM_RETURN_IF_ERROR(HostWaitsFor(streams.unshard));
        }
      }
      if (!options_.fake_all_gather) {
        pending.work =
            shard_group_->AllGather(source, pending.padded->ref(), options);
      }
      pending_unshard_.emplace(std::move(pending));
      return absl::OkStatus();
    }
    unsharded_ref_ = target.ref().Slice(0, unpadded);
  } else if (low_precision) {
    // NO_SHARD: the low-precision shard is the unsharded parameter until the
    // reshard (PyTorch's `post_reshard`).
    TrackedBuffer copy;
    FLATPARAM_ASSIGN_OR_RETURN(BufferRef full, LocalShardOnCompute(&copy));
    FLATPARAM_ASSIGN_OR_RETURN(
        mp_shard_,
        Alloc(MemoryCategory::kLowPrecisionParams, param_dtype_, full.count));
    absl::Status cast = device_->Cast(mp_shard_.ref(), full);
    // The compute stream reads the cast shard as the unsharded parameter.
    if (cast.ok()) cast = StreamWaits(streams.compute, streams.unshard);
    if (cast.ok()) cast = UsedBy(mp_shard_, streams.compute);
    if (!cast.ok()) {
      mp_shard_.Reset();
      return cast;
    }
    unsharded_ref_ = mp_shard_.ref();
  } else {
    FLATPARAM_ASSIGN_OR_RETURN(unsharded_ref_,
                               LocalShardOnCompute(&offload_copy_));
    FLATPARAM_RETURN_IF_ERROR(StreamWaits(streams.compute, streams.unshard));
    FLATPARAM_RETURN_IF_ERROR(UsedBy(offload_copy_, streams.compute));
  }
  unsharded_ = true;
  ++view_epoch_;
  return absl::OkStatus();
}

absl::Status FlatParamHandle::FinishUnshardImpl() {
  if (!pending_unshard_.has_value()) return absl::OkStatus();
  PendingUnshard pending = std::move(*pending_unshard_);
  pending_unshard_.reset();
  absl::Status status = absl::OkStatus();
  if (pending.work != nullptr) {
    constexpr absl::string_view kWhat = "all-gather of the flat parameter";
    if (stream_ordered_) {
      // The unshard stream waits for the all-gather, so the inputs below
      // are freed after it on the stream that allocated them, and the
      // compute stream waits for the unshard stream before reading the
      // output.
      status = StreamWaitsFor(std::move(pending.work), options_.streams.unshard,
                              kWhat);
      if (status.ok() &&
          !Skipped(internal_handle::SkippedOrdering::kComputeWaitsForUnshard)) {
        status =
            StreamWaits(options_.streams.compute, options_.streams.unshard);
      }
    } else {
      status = Wait(std::move(pending.work), kWhat);
    }
  }
  // Post-unshard: the collective is done with its input.
  pending.copy.Reset();
  pending.mp_shard.Reset();
  if (!status.ok()) return status;  // `padded` is freed with `pending`
  // Allocated on the unshard stream, read by the compute stream's work
  // (issued after this host wait): its reuse must follow that work.
  if (!Skipped(
          internal_handle::SkippedOrdering::kRecordUnshardedParamOnCompute)) {
    FLATPARAM_RETURN_IF_ERROR(
        UsedBy(*pending.padded, options_.streams.compute));
  }
  *pending.target = std::move(*pending.padded);
  unsharded_ref_ =
      pending.target->ref().Slice(0, layout_.unpadded_unsharded_numel());
  unsharded_ = true;
  ++view_epoch_;
  return absl::OkStatus();
}

absl::Status FlatParamHandle::StartUnshard() {
  if (state_ != HandleTrainingState::kIdle &&
      state_ != HandleTrainingState::kForward &&
      state_ != HandleTrainingState::kBackwardPre) {
    return WrongState("StartUnshard", "IDLE, FORWARD or BACKWARD_PRE");
  }
  if (unsharded_ || pending_unshard_.has_value()) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "%s: StartUnshard: the flat parameter is already %s (state %s)", Name(),
        unsharded_ ? "unsharded" : "being unsharded",
        HandleTrainingStateName(state_)));
  }
  return StartUnshardImpl();
}

absl::Status FlatParamHandle::FinishUnshard() { return FinishUnshardImpl(); }

absl::Status FlatParamHandle::CheckNoPendingUnshard(
    absl::string_view op) const {
  if (!pending_unshard_.has_value()) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrFormat(
      "%s: %s: an unshard is in flight (StartUnshard); FinishUnshard first",
      Name(), op));
}

absl::Status FlatParamHandle::ReshardImpl(bool free_unsharded) {
  assert(unsharded_);
  unsharded_ = false;
  unsharded_ref_ = BufferRef{};
  ++view_epoch_;
  if (uses_sharded_strategy()) {
    if (free_unsharded) padded_unsharded().Reset();
  } else {
    mp_shard_.Reset();
    offload_copy_.Reset();
  }
  return absl::OkStatus();
}

absl::Status FlatParamHandle::Unshard() {
  if (state_ != HandleTrainingState::kIdle &&
      state_ != HandleTrainingState::kForward &&
      state_ != HandleTrainingState::kBackwardPre) {
    return WrongState("Unshard", "IDLE, FORWARD or BACKWARD_PRE");
  }
  if (unsharded_) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "%s: Unshard: the flat parameter is already unsharded (state %s); "
        "Reshard first",
        Name(), HandleTrainingStateName(state_)));
  }
  if (pending_unshard_.has_value()) return FinishUnshardImpl();
  return UnshardImpl();
}

absl::Status FlatParamHandle::Reshard(bool free_unsharded) {
  if (state_ == HandleTrainingState::kSummonFullParams) {
    return WrongState("Reshard",
                      "a state other than SUMMON_FULL_PARAMS (use "
                      "EndSummonFullParams)");
  }
  FLATPARAM_RETURN_IF_ERROR(CheckNoPendingUnshard("Reshard"));
  if (!unsharded_) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "%s: Reshard: the flat parameter is not unsharded (state %s)", Name(),
        HandleTrainingStateName(state_)));
  }
  return ReshardImpl(free_unsharded);
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

namespace internal_handle {
void SetSkippedOrderingForTesting(SkippedOrdering skip) {
  skipped_ordering.store(skip, std::memory_order_relaxed);
}
bool IsSkippedForTesting(SkippedOrdering which) { return Skipped(which); }
void SetSkipSyncBeforeAllGatherForTesting(bool skip) {
  SetSkippedOrderingForTesting(skip ? SkippedOrdering::kSyncBeforeAllGather
                                    : SkippedOrdering::kNone);
}
}  // namespace internal_handle

}  // namespace flatparam
