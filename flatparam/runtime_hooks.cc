#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/device/device.h"
#include "flatparam/handle.h"
#include "flatparam/internal/handle_test_hooks.h"
#include "flatparam/runtime.h"

// FsdpRuntime's hooks (PreForward, PostForward, PreBackward, PostBackward,
// FinalizeBackward): the iterations, the execution order, prefetch under
// limit_all_gathers with the rate limiter (Limited), and the reductions
// that overlap the backward. runtime.h's file comment says what they do;
// internal/runtime_internal.h lists the runtime's files.

namespace flatparam {

// ---------------------------------------------------------------------------
// Iterations and the execution order

absl::Status FsdpRuntime::Limited(
    int unit, const std::function<absl::Status(FlatParamHandle&)>& call) {
  FlatParamHandle& h = *handles_[unit];
  const size_t limit = static_cast<size_t>(options_.limit_all_gathers);
  if (limit > 0 && !h.is_unsharded() && h.NeedsUnshard() &&
      free_events_.size() >= limit) {
    const Event oldest = free_events_.front();
    free_events_.pop_front();
    FLATPARAM_RETURN_IF_ERROR(device_->SynchronizeEvent(oldest));
  }
  const bool held = h.uses_sharded_strategy() && !h.NeedsUnshard();
  FLATPARAM_RETURN_IF_ERROR(Track(unit, call));
  if (limit > 0 && held && h.NeedsUnshard()) {
    FLATPARAM_ASSIGN_OR_RETURN(
        Event freed, device_->RecordEvent(h.options().streams.compute));
    free_events_.push_back(freed);
  }
  return absl::OkStatus();
}

absl::Status FsdpRuntime::UnshardStreamWaitsForCompute() {
  // The optimizer's (and the caller's) updates of the local shards come
  // before any unshard of the iteration: one wait for every unit.
  const HandleStreams& streams = handles_[0]->options().streams;
  if (streams.unshard != streams.compute &&
      !internal_handle::IsSkippedForTesting(
          internal_handle::SkippedOrdering::kUnshardWaitsForCompute)) {
    FLATPARAM_ASSIGN_OR_RETURN(Event updated,
                               device_->RecordEvent(streams.compute));
    FLATPARAM_RETURN_IF_ERROR(device_->WaitEvent(streams.unshard, updated));
  }
  for (auto& h : handles_) h->NoteUnshardStreamWaitedForCompute();
  return absl::OkStatus();
}

absl::Status FsdpRuntime::BeginRetainedBackward() {
  phase_ = Phase::kBackward;
  // PyTorch reads `_sync_gradients` in each hook: this backward's own.
  sync_ = require_sync_;
  // The forward's post-forward order stays: prefetch follows it again.
  std::fill(ran_pre_backward_.begin(), ran_pre_backward_.end(), 0);
  prefetched_.clear();
  reducing_.clear();
  return UnshardStreamWaitsForCompute();
}

void FsdpRuntime::BeginIteration() {
  phase_ = Phase::kForward;
  backward_may_rerun_ = false;
  forward_pass_ = 0;
  // Until a backward fixes it, each iteration records the order afresh
  // (a forward-only pass, e.g. validation, does not fix it).
  if (!order_fixed_) {
    forward_order_.clear();
    std::fill(forward_index_.begin(), forward_index_.end(), -1);
  }
  // PyTorch reads `_sync_gradients` in each hook; fixing it per iteration
  // keeps one iteration's units consistent.
  sync_ = require_sync_;
  forward_position_ = 0;
  post_forward_order_.clear();
  std::fill(post_forward_index_.begin(), post_forward_index_.end(), -1);
  std::fill(ran_pre_forward_.begin(), ran_pre_forward_.end(), 0);
  std::fill(ran_pre_backward_.begin(), ran_pre_backward_.end(), 0);
  prefetched_.clear();
  reducing_.clear();
}

std::optional<std::string> FsdpRuntime::OrderDeviation(int unit) const {
  if (!order_fixed_) return std::nullopt;
  const int position = phase_ == Phase::kIdle ? 0 : forward_position_;
  if (position < static_cast<int>(forward_order_.size()) &&
      forward_order_[position] == unit) {
    return std::nullopt;
  }
  const std::string expected =
      position < static_cast<int>(forward_order_.size())
          ? UnitName(forward_order_[position])
          : std::string("no further unit");
  return absl::StrFormat(
      "iteration %d runs %s as forward unit #%d, but the first training "
      "iteration ran %s there (recorded order: %s)",
      stats_.iterations + 1, UnitName(unit), position, expected,
      absl::StrJoin(forward_order_, ", "));
}

absl::Status FsdpRuntime::PreForward(int unit) {
  FLATPARAM_RETURN_IF_ERROR(CheckUnit("PreForward", unit));
  const bool recompute = phase_ == Phase::kBackward;
  // The unit that began the iteration's forward (the root, when the model
  // has one) running again begins another forward in the same iteration
  // (two forwards before one backward); any other unit running again is a
  // module used twice in one forward.
  const bool another_forward = phase_ == Phase::kForward && !recompute &&
                               unit == first_forward_unit_ &&
                               ran_pre_forward_[unit] != 0;
  const bool first_use =
      !recompute && (phase_ == Phase::kIdle || !ran_pre_forward_[unit]);
  // PyTorch records and checks the order only in training
  // (`_ExecOrderData.record_pre_forward(handle, is_training)`), and only
  // for the iteration's first forward.
  const bool ordered = first_use && handles_[unit]->training() &&
                       (phase_ == Phase::kIdle || forward_pass_ == 0);
  if (ordered) {
    if (std::optional<std::string> deviation = OrderDeviation(unit)) {
      ++stats_.exec_order_deviations;
      if (options_.exec_order == ExecOrderCheck::kError) {
        return absl::FailedPreconditionError(absl::StrFormat(
            "FsdpRuntime: PreForward: execution order changed: %s",
            *deviation));
      }
      if (options_.exec_order == ExecOrderCheck::kWarn && !warned_order_) {
        warned_order_ = true;
        std::fprintf(stderr,
                     "flatparam warning: FsdpRuntime: the forward order "
                     "changed, so prefetching may target the wrong units "
                     "(warned once): %s\n",
                     deviation->c_str());
      }
    }
  }
  if (phase_ == Phase::kIdle) {
    BeginIteration();
    first_forward_unit_ = unit;
    FLATPARAM_RETURN_IF_ERROR(UnshardStreamWaitsForCompute());
  } else if (another_forward) {
    ++forward_pass_;
    std::fill(ran_pre_forward_.begin(), ran_pre_forward_.end(), 0);
  }
  {
    const auto context =
        Context(unit, recompute ? CollectivePhase::kRecomputeUnshard
                                : CollectivePhase::kForwardUnshard);
    FLATPARAM_RETURN_IF_ERROR(WithUnit(
        Limited(unit, [](FlatParamHandle& h) { return h.PreForward(); }),
        "PreForward", unit));
  }
  // The pre-hook consumes a prefetch, a recompute's too.
  prefetched_.erase(std::remove(prefetched_.begin(), prefetched_.end(), unit),
                    prefetched_.end());
  if (recompute) return absl::OkStatus();
  ran_pre_forward_[unit] = 1;
  if (ordered) {
    ++forward_position_;
    if (!order_fixed_) {
      forward_index_[unit] = static_cast<int>(forward_order_.size());
      forward_order_.push_back(unit);
    }
  }
  if (!options_.forward_prefetch || !order_fixed_ || forward_index_[unit] < 0) {
    return absl::OkStatus();
  }
  std::vector<int> candidates;
  const int n = static_cast<int>(forward_order_.size());
  for (int i = forward_index_[unit] + 1;
       i < n && i <= forward_index_[unit] + options_.prefetch_depth; ++i) {
    const int v = forward_order_[i];
    if (!ran_pre_forward_[v]) candidates.push_back(v);
  }
  return Prefetch(candidates, CollectivePhase::kForwardPrefetch);
}

absl::Status FsdpRuntime::PostForward(int unit) {
  FLATPARAM_RETURN_IF_ERROR(CheckUnit("PostForward", unit));
  const bool is_root = root_.has_value() && *root_ == unit;
  const auto context = Context(unit, CollectivePhase::kPostForward);
  FLATPARAM_RETURN_IF_ERROR(WithUnit(
      Limited(unit,
              [is_root](FlatParamHandle& h) { return h.PostForward(is_root); }),
      "PostForward", unit));
  if (phase_ == Phase::kForward && post_forward_index_[unit] < 0) {
    post_forward_index_[unit] = static_cast<int>(post_forward_order_.size());
    post_forward_order_.push_back(unit);
  }
  return absl::OkStatus();
}

absl::Status FsdpRuntime::PreBackward(int unit) {
  FLATPARAM_RETURN_IF_ERROR(CheckUnit("PreBackward", unit));
  if (phase_ == Phase::kIdle && backward_may_rerun_) {
    FLATPARAM_RETURN_IF_ERROR(BeginRetainedBackward());
  } else if (phase_ == Phase::kIdle) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "FsdpRuntime: PreBackward of %s: no forward ran in this iteration "
        "(PreForward begins one, FinalizeBackward ends it; a further "
        "backward over the same forward follows a backward)",
        UnitName(unit)));
  }
  {
    const auto context = Context(unit, CollectivePhase::kPreBackwardUnshard);
    FLATPARAM_RETURN_IF_ERROR(WithUnit(
        Limited(unit, [](FlatParamHandle& h) { return h.PreBackward(); }),
        "PreBackward", unit));
  }
  phase_ = Phase::kBackward;
  ran_pre_backward_[unit] = 1;
  prefetched_.erase(std::remove(prefetched_.begin(), prefetched_.end(), unit),
                    prefetched_.end());
  if (options_.backward_prefetch != BackwardPrefetch::kBackwardPre) {
    return absl::OkStatus();
  }
  std::vector<int> candidates;
  for (int i = post_forward_index_[unit] - 1;
       post_forward_index_[unit] >= 0 && i >= 0 &&
       i >= post_forward_index_[unit] - options_.prefetch_depth;
       --i) {
    const int v = post_forward_order_[i];
    if (WillRunPreBackward(v)) candidates.push_back(v);
  }
  return Prefetch(candidates, CollectivePhase::kBackwardPrefetch);
}

absl::Status FsdpRuntime::PostBackward(int unit) {
  FLATPARAM_RETURN_IF_ERROR(CheckUnit("PostBackward", unit));
  const bool sync = sync_;
  {
    const auto context = Context(unit, CollectivePhase::kPostBackwardReduce);
    FLATPARAM_RETURN_IF_ERROR(WithUnit(
        Limited(
            unit,
            [sync](FlatParamHandle& h) { return h.PostBackwardAsync(sync); }),
        "PostBackward", unit));
  }
  std::vector<int> earlier;
  earlier.swap(reducing_);
  if (handles_[unit]->reduce_pending()) reducing_.push_back(unit);
  if (options_.backward_prefetch == BackwardPrefetch::kBackwardPost) {
    std::vector<int> candidates;
    for (int i = post_forward_index_[unit] - 1;
         post_forward_index_[unit] >= 0 && i >= 0 &&
         i >= post_forward_index_[unit] - options_.prefetch_depth;
         --i) {
      const int v = post_forward_order_[i];
      if (WillRunPreBackward(v)) candidates.push_back(v);
    }
    FLATPARAM_RETURN_IF_ERROR(
        Prefetch(candidates, CollectivePhase::kBackwardPrefetch));
  }
  // The earlier reductions overlapped this unit's backward; finishing them
  // now frees their unsharded gradients.
  for (int v : earlier) {
    const auto context = Context(v, CollectivePhase::kPostBackwardReduce);
    FLATPARAM_RETURN_IF_ERROR(WithUnit(
        Track(v, [](FlatParamHandle& h) { return h.FinishReduceGrad(); }),
        "finishing the reduction", v));
  }
  return absl::OkStatus();
}

bool FsdpRuntime::WillRunPreBackward(int unit) const {
  return !ran_pre_backward_[unit] && last_backward_ran_[unit];
}

absl::Status FsdpRuntime::Prefetch(const std::vector<int>& candidates,
                                   CollectivePhase phase) {
  const size_t limit = static_cast<size_t>(options_.limit_all_gathers);
  for (int v : candidates) {
    FlatParamHandle& h = *handles_[v];
    if (h.training_state() != HandleTrainingState::kIdle || h.is_unsharded() ||
        h.unshard_pending()) {
      continue;
    }
    if (h.NeedsUnshard() && limit > 0 && prefetched_.size() >= limit) {
      // Later candidates are further ahead: leave them for later too.
      ++stats_.prefetches_over_limit;
      break;
    }
    const auto context = Context(v, phase);
    FLATPARAM_RETURN_IF_ERROR(WithUnit(
        Limited(v, [](FlatParamHandle& h) { return h.StartUnshard(); }),
        "prefetch", v));
    ++stats_.prefetches;
    if (h.unshard_pending()) {
      ++stats_.prefetched_all_gathers;
      prefetched_.push_back(v);
      stats_.max_all_gathers_in_flight =
          std::max(stats_.max_all_gathers_in_flight,
                   static_cast<int>(prefetched_.size()));
    }
  }
  return absl::OkStatus();
}

absl::Status FsdpRuntime::FinalizeBackward() {
  const bool sync = phase_ == Phase::kIdle ? require_sync_ : sync_;
  absl::Status first = absl::OkStatus();
  for (int u = 0; u < num_units(); ++u) {
    const auto context = Context(u, CollectivePhase::kFinalizeBackward);
    absl::Status status = WithUnit(
        Limited(
            u, [sync](FlatParamHandle& h) { return h.FinalizeBackward(sync); }),
        "FinalizeBackward", u);
    if (first.ok()) first = status;
  }
  if (phase_ != Phase::kIdle) ++stats_.iterations;
  // PyTorch fixes the order in its post-backward final callback: only a
  // pass with a backward (in training) fixes it.
  if (phase_ == Phase::kBackward && !forward_order_.empty()) {
    order_fixed_ = true;
  }
  if (phase_ == Phase::kBackward) last_backward_ran_ = ran_pre_backward_;
  backward_may_rerun_ = phase_ == Phase::kBackward;
  phase_ = Phase::kIdle;
  prefetched_.clear();
  reducing_.clear();
  return first;
}

}  // namespace flatparam
