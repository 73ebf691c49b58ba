// FlatParamHandle: collectives, stream discipline, unshard and reshard
// (handle.h's "Streams" and "Unshard / reshard"; PyTorch's `_unshard`,
// `_reshard` and `FlatParamHandle.unshard`/`reshard`).
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
  assert(on_unshard.status().ok());
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

}  // namespace flatparam
