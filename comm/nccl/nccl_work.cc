#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "comm/communicator.h"
#include "comm/nccl/internal/nccl_internal.h"
#include "comm/nccl/nccl_api.h"
#include "flatparam/base/backoff.h"
#include "flatparam/base/status_macros.h"

// Issuing a collective and its Work: Issue() enqueues the NCCL call after
// the caller's stream, NcclWork waits on the event recorded after it, and
// every wait here polls with a deadline. A timeout or an asynchronous error
// aborts the communicator (AbortState); Failed() keeps the failure counts
// that decide between finalizing and aborting at destruction.
// internal/nccl_internal.h says how the backend's files fit together.

namespace flatparam {
namespace internal_nccl {
namespace {

// CollectiveOptions::stream and Work::WaitStream take CUDA streams of the
// communicator's device only.
absl::Status CheckStream(const CommState& s, const DeviceStream& stream,
                         absl::string_view context) {
  if (stream.owner == nullptr && stream.device == Device::Cuda(s.device)) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrFormat(
      "%s: the stream to order with is %s%s, not a CUDA stream of this "
      "communicator's device cuda:%d",
      context, stream.owner != nullptr ? "a simulated stream of " : "",
      DeviceName(stream.device), s.device));
}

// How many NCCL communicators of this process have failed so far (see
// ProcessFailures()).
std::atomic<int64_t> process_failures{0};

// The Work of an enqueued collective: waits on the event recorded after it.
class NcclWork final : public Work {
 public:
  NcclWork(std::shared_ptr<CommState> state, cudaEvent_t event,
           absl::Time deadline, absl::Duration timeout, std::string context,
           absl::Status after)
      : state_(std::move(state)),
        event_(event),
        deadline_(deadline),
        timeout_(timeout),
        context_(std::move(context)),
        after_(std::move(after)) {}
  ~NcclWork() override { state_->cuda->EventDestroy(event_); }

  absl::Status Wait() override {
    if (!done_) {
      status_ = AwaitEvent(*state_, event_, deadline_, timeout_, context_);
      if (status_.ok()) status_ = after_;
      Failed(*state_, status_).IgnoreError();
      done_ = true;
    }
    return status_;
  }

  // cudaStreamWaitEvent on the event recorded after the collective: the
  // stream's later work runs after it, and the host does not wait.
  absl::Status WaitStream(const DeviceStream& stream) override {
    CommState& s = *state_;
    CudaRuntime& cuda = *s.cuda;
    const std::string context = absl::StrCat(context_, ": WaitStream");
    FLATPARAM_RETURN_IF_ERROR(CheckStream(s, stream, context));
    CudaDeviceGuard guard(cuda);
    FLATPARAM_RETURN_IF_ERROR(guard.Set(s.device, context));
    return CudaStatus(
        cuda,
        cuda.StreamWaitEvent(reinterpret_cast<cudaStream_t>(stream.handle),
                             event_, 0),
        absl::StrCat(context, ": cudaStreamWaitEvent"));
  }

 private:
  std::shared_ptr<CommState> state_;
  cudaEvent_t event_;
  absl::Time deadline_;
  absl::Duration timeout_;
  std::string context_;
  // An error found after the collective was enqueued (destroying its
  // reduction operator), reported once it has finished.
  absl::Status after_;
  bool done_ = false;
  absl::Status status_;
};

// Makes the communicator's stream wait for the work issued on the caller's
// `after` stream so far (CollectiveOptions::stream): an event recorded
// there, waited for, and destroyed (the wait keeps what it captured).
absl::Status WaitForCallerStream(CommState& s, const DeviceStream& after,
                                 absl::string_view context) {
  CudaRuntime& cuda = *s.cuda;
  cudaEvent_t event = nullptr;
  FLATPARAM_RETURN_IF_ERROR(CudaStatus(
      cuda, cuda.EventCreateWithFlags(&event, cudaEventDisableTiming),
      absl::StrCat(context, ": cudaEventCreateWithFlags (stream order)")));
  absl::Status st = CudaStatus(
      cuda,
      cuda.EventRecord(event, reinterpret_cast<cudaStream_t>(after.handle)),
      absl::StrCat(context, ": cudaEventRecord on the caller's stream"));
  if (st.ok()) {
    st = CudaStatus(cuda, cuda.StreamWaitEvent(s.stream->stream, event, 0),
                    absl::StrCat(context, ": cudaStreamWaitEvent"));
  }
  cuda.EventDestroy(event);
  return st;
}

}  // namespace

absl::Status AbortedError(const CommState& s, absl::string_view context) {
  return absl::AbortedError(
      absl::StrFormat("%s: the NCCL communicator was aborted earlier: %s",
                      context, s.abort_status.message()));
}

int64_t ProcessFailures() { return process_failures.load(); }

absl::Status Failed(CommState& s, absl::Status status) {
  if (!status.ok() && !s.failed) {
    s.failed = true;
    process_failures.fetch_add(1);
  }
  return status;
}

absl::Status AbortState(CommState& s, absl::Status reason) {
  Failed(s, reason).IgnoreError();
  if (s.aborted) return reason;
  std::string note = "; aborted the NCCL communicator (ncclCommAbort)";
  if (s.comm != nullptr) {
    const ncclResult_t r = s.api->CommAbort(s.comm);
    if (r != ncclSuccess) {
      absl::StrAppend(
          &note, ", which failed: ",
          NcclStatus(*s.api, r, nullptr, "ncclCommAbort").message());
    }
    s.comm = nullptr;
  }
  s.aborted = true;
  s.abort_status =
      absl::Status(reason.code(), absl::StrCat(reason.message(), note));
  return s.abort_status;
}

absl::Status PollComm(NcclApi& api, ncclComm_t comm, absl::Time deadline,
                      absl::Duration timeout, absl::string_view context) {
  Backoff backoff;
  while (true) {
    ncclResult_t state = ncclSuccess;
    const ncclResult_t r = api.CommGetAsyncError(comm, &state);
    if (r != ncclSuccess) {
      return NcclStatus(api, r, comm,
                        absl::StrCat(context, ": ncclCommGetAsyncError"));
    }
    if (state != ncclInProgress) return NcclStatus(api, state, comm, context);
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrFormat("%s: NCCL still in progress after %s", context,
                          absl::FormatDuration(timeout)));
    }
    backoff.Pause(deadline);
  }
}

absl::Status AwaitEvent(CommState& s, cudaEvent_t event, absl::Time deadline,
                        absl::Duration timeout, absl::string_view context) {
  Backoff backoff;
  while (true) {
    if (s.aborted) return AbortedError(s, context);
    ncclResult_t async = ncclSuccess;
    const ncclResult_t r = s.api->CommGetAsyncError(s.comm, &async);
    if (r != ncclSuccess) {
      return AbortState(
          s, NcclStatus(*s.api, r, s.comm,
                        absl::StrCat(context, ": ncclCommGetAsyncError")));
    }
    if (async != ncclSuccess && async != ncclInProgress) {
      return AbortState(s, NcclStatus(*s.api, async, s.comm, context));
    }
    const cudaError_t e = s.cuda->EventQuery(event);
    if (e == cudaSuccess) return absl::OkStatus();
    if (e != cudaErrorNotReady) {
      return AbortState(
          s, CudaStatus(*s.cuda, e, absl::StrCat(context, ": cudaEventQuery")));
    }
    // "Not ready" is an answer, but the runtime keeps it as the thread's
    // last error, and the next kernel launch (which reports
    // cudaGetLastError()) would fail with it: clear it, as c10 does.
    s.cuda->GetLastError();
    if (absl::Now() >= deadline) {
      return AbortState(s, absl::DeadlineExceededError(absl::StrFormat(
                               "%s: did not finish within %s", context,
                               absl::FormatDuration(timeout))));
    }
    backoff.Pause(deadline);
  }
}

std::unique_ptr<Work> Issue(const std::shared_ptr<CommState>& state,
                            const std::string& context, absl::Time deadline,
                            const CollectiveOptions& options,
                            const ResolvedOp* op, NcclCall call) {
  CommState& s = *state;
  NcclApi& api = *s.api;
  CudaRuntime& cuda = *s.cuda;
  const absl::Duration timeout = options.timeout;
  if (s.aborted) return CompletedWork(AbortedError(s, context));
  if (options.stream.has_value()) {
    if (absl::Status st = CheckStream(s, *options.stream, context); !st.ok()) {
      return CompletedWork(Failed(s, std::move(st)));
    }
  }
  CudaDeviceGuard guard(cuda);
  if (absl::Status st = guard.Set(s.device, context); !st.ok()) {
    return CompletedWork(Failed(s, std::move(st)));
  }
  // Stream-ordered: the collective's input comes from the caller's stream.
  // Nothing is enqueued yet, so a failure leaves nothing in flight.
  if (options.stream.has_value()) {
    if (absl::Status st = WaitForCallerStream(s, *options.stream, context);
        !st.ok()) {
      return CompletedWork(Failed(s, std::move(st)));
    }
  }
  // Created before anything is enqueued, so that a failure leaves nothing
  // in flight.
  cudaEvent_t event = nullptr;
  if (absl::Status st = CudaStatus(
          cuda, cuda.EventCreateWithFlags(&event, cudaEventDisableTiming),
          absl::StrCat(context, ": cudaEventCreateWithFlags"));
      !st.ok()) {
    return CompletedWork(Failed(s, std::move(st)));
  }
  auto fail = [&](absl::Status st) {
    cuda.EventDestroy(event);
    return CompletedWork(Failed(s, std::move(st)));
  };

  ncclRedOp_t redop = op != nullptr ? op->builtin : ncclSum;
  bool created = false;
  if (op != nullptr && op->premul) {
    ResolvedOp scalar = *op;  // NCCL takes a non-const pointer.
    const ncclResult_t r = api.RedOpCreatePreMulSum(
        &redop, scalar.scalar, op->dtype, ncclScalarHostImmediate, s.comm);
    if (r != ncclSuccess && r != ncclInProgress) {
      return fail(NcclStatus(
          api, r, s.comm, absl::StrCat(context, ": ncclRedOpCreatePreMulSum")));
    }
    if (absl::Status st = PollComm(api, s.comm, deadline, timeout, context);
        !st.ok()) {
      return fail(AbortState(s, std::move(st)));
    }
    created = true;
  }

  const ncclResult_t r = call(s.comm, s.stream->stream, redop);
  if (r != ncclSuccess && r != ncclInProgress) {
    // Rejected synchronously (bad arguments or usage): nothing was
    // enqueued and the communicator stays usable.
    absl::Status st = NcclStatus(api, r, s.comm, context);
    if (created) api.RedOpDestroy(redop, s.comm);
    return fail(std::move(st));
  }
  if (absl::Status st = PollComm(api, s.comm, deadline, timeout, context);
      !st.ok()) {
    return fail(AbortState(s, std::move(st)));
  }
  if (absl::Status st =
          CudaStatus(cuda, cuda.EventRecord(event, s.stream->stream),
                     absl::StrCat(context, ": cudaEventRecord"));
      !st.ok()) {
    // The collective is in flight and cannot be tracked: tear it down.
    return fail(AbortState(s, std::move(st)));
  }
  absl::Status after;
  if (created) {
    after = NcclStatus(api, api.RedOpDestroy(redop, s.comm), s.comm,
                       absl::StrCat(context, ": ncclRedOpDestroy"));
  }
  return std::make_unique<NcclWork>(state, event, deadline, timeout, context,
                                    std::move(after));
}

}  // namespace internal_nccl
}  // namespace flatparam
