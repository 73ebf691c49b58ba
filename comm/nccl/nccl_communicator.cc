#include "comm/nccl/nccl_communicator.h"

#include <algorithm>
#include <atomic>
#include <cassert>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "flatparam/base/backoff.h"
#include "flatparam/base/buffer_checks.h"
#include "flatparam/base/dtype.h"
#include "flatparam/base/status_macros.h"

namespace flatparam {
namespace internal_nccl {

// A CUDA stream shared by a communicator and the communicators split from
// it, so that their collectives stay in issue order.
struct StreamHandle {
  NcclApi* api = nullptr;
  cudaStream_t stream = nullptr;
  bool owned = false;

  ~StreamHandle() {
    if (owned) api->CudaStreamDestroy(stream);
  }
};

// Everything a communicator and its outstanding Work share. Invariant: once
// `aborted`, `comm` is null and `abort_status` holds the first error.
struct CommState {
  NcclApi* api = nullptr;
  ncclComm_t comm = nullptr;
  bool owns_comm = false;
  int rank = 0;
  int size = 0;
  int device = 0;
  NcclOptions options;
  std::shared_ptr<StreamHandle> stream;
  bool aborted = false;
  absl::Status abort_status;
  // An operation of this communicator failed (an argument error included):
  // the caller is likely unwinding, and its peers may wait in a collective
  // it never issued, so destruction aborts instead of finalizing.
  bool failed = false;
  // ProcessFailures() when the communicator was made.
  int64_t process_failures_at_creation = 0;
  // Scratch for Barrier() and AllGatherBytes(), kept between calls: device
  // memory from the stream-ordered allocator (on `stream`) and pinned host
  // staging. With several ranks in one process, a cudaMalloc or cudaFree
  // between collectives (each synchronizes the device) or a copy with
  // pageable memory can deadlock against NCCL kernels that wait for a peer
  // (NCCL's documented pattern); these never happen between collectives.
  // Outgrown staging is freed at destruction (cudaFreeHost synchronizes).
  void* device_scratch = nullptr;
  size_t device_scratch_bytes = 0;
  void* host_staging = nullptr;
  size_t host_staging_bytes = 0;
  std::vector<void*> retired_staging;

  ~CommState();
};

}  // namespace internal_nccl

namespace {

using internal_nccl::CommState;
using internal_nccl::StreamHandle;

// Makes `device` current and restores the caller's device when destroyed:
// events must be created on the device of the stream they are recorded on.
class DeviceGuard {
 public:
  explicit DeviceGuard(NcclApi& api) : api_(api) {}
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
  ~DeviceGuard() {
    if (restore_) api_.CudaSetDevice(previous_);
  }

  absl::Status Set(int device, absl::string_view context) {
    int current = -1;
    FLATPARAM_RETURN_IF_ERROR(
        CudaStatus(api_, api_.CudaGetDevice(&current),
                   absl::StrCat(context, ": cudaGetDevice")));
    if (current == device) return absl::OkStatus();
    FLATPARAM_RETURN_IF_ERROR(
        CudaStatus(api_, api_.CudaSetDevice(device),
                   absl::StrFormat("%s: cudaSetDevice(%d)", context, device)));
    if (!restore_) {
      previous_ = current;
      restore_ = true;
    }
    return absl::OkStatus();
  }

 private:
  NcclApi& api_;
  int previous_ = 0;
  bool restore_ = false;
};

ncclDataType_t NcclDType(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return ncclFloat32;
    case DType::kFloat64:
      return ncclFloat64;
    case DType::kFloat16:
      return ncclFloat16;
    case DType::kBFloat16:
      return ncclBfloat16;
    default:
      // The Validate* functions reject every other dtype first.
      assert(false && "not a collective dtype");
      return ncclFloat32;
  }
}

std::string Describe(ConstBufferRef b) {
  return absl::StrFormat("%d x %s", b.count, DTypeName(b.dtype));
}

std::string OpContext(const CommState& s, absl::string_view op, int64_t seq,
                      ConstBufferRef input, ConstBufferRef output) {
  return absl::StrFormat("rank %d: %s #%d (input %s, output %s on cuda:%d)",
                         s.rank, op, seq, Describe(input), Describe(output),
                         s.device);
}

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

// The options of a collective that the host waits for (internal ones).
CollectiveOptions HostOrdered(CollectiveOptions options) {
  options.stream.reset();
  return options;
}

absl::Status AbortedError(const CommState& s, absl::string_view context) {
  return absl::AbortedError(
      absl::StrFormat("%s: the NCCL communicator was aborted earlier: %s",
                      context, s.abort_status.message()));
}

// Aborts the communicator because of `reason` and returns `reason`, noting
// the abort. NCCL requires an abort after an asynchronous error or a hang.
// How many NCCL communicators of this process have failed so far. A
// communicator made before another one failed aborts at destruction instead
// of finalizing: ncclCommFinalize completes only once every rank finalizes,
// which the failed group's peers (and, through them, this group's) may
// never do.
std::atomic<int64_t> process_failures{0};

int64_t ProcessFailures() { return process_failures.load(); }

// Records that an operation failed with `status` (not OK) and returns it.
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

// Waits until `comm` has left ncclInProgress (a non-blocking communicator
// finishing initialization, a split or the enqueueing of a collective), and
// returns its asynchronous error state.
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

// Blocks until `event` has completed, the communicator reports an
// asynchronous error, or `deadline`; aborts the communicator on failure.
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
    const cudaError_t e = s.api->CudaEventQuery(event);
    if (e == cudaSuccess) return absl::OkStatus();
    if (e != cudaErrorNotReady) {
      return AbortState(
          s, CudaStatus(*s.api, e, absl::StrCat(context, ": cudaEventQuery")));
    }
    // "Not ready" is an answer, but the runtime keeps it as the thread's
    // last error, and the next kernel launch (which reports
    // cudaGetLastError()) would fail with it: clear it, as c10 does.
    s.api->CudaGetLastError();
    if (absl::Now() >= deadline) {
      return AbortState(s, absl::DeadlineExceededError(absl::StrFormat(
                               "%s: did not finish within %s", context,
                               absl::FormatDuration(timeout))));
    }
    backoff.Pause(deadline);
  }
}

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
  ~NcclWork() override { state_->api->CudaEventDestroy(event_); }

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
    NcclApi& api = *s.api;
    const std::string context = absl::StrCat(context_, ": WaitStream");
    FLATPARAM_RETURN_IF_ERROR(CheckStream(s, stream, context));
    DeviceGuard guard(api);
    FLATPARAM_RETURN_IF_ERROR(guard.Set(s.device, context));
    return CudaStatus(
        api,
        api.CudaStreamWaitEvent(reinterpret_cast<cudaStream_t>(stream.handle),
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

// How a reduction runs in NCCL: a built-in operator, or a pre-multiplied
// sum with `scalar` (one element of `dtype`) for divide factors.
struct ResolvedOp {
  ncclRedOp_t builtin = ncclSum;
  bool premul = false;
  ncclDataType_t dtype = ncclFloat32;
  alignas(8) unsigned char scalar[8] = {};
};

absl::StatusOr<ResolvedOp> ResolveOp(const CommState& s, absl::string_view op,
                                     int64_t seq, const ReduceOptions& options,
                                     DType dtype) {
  ResolvedOp resolved;
  resolved.dtype = NcclDType(dtype);
  const bool divides =
      options.pre_divide_factor != 1.0 || options.post_divide_factor != 1.0;
  switch (options.op) {
    case ReduceOp::kSum:
      resolved.builtin = ncclSum;
      break;
    case ReduceOp::kAvg:
      resolved.builtin = ncclAvg;
      break;
    case ReduceOp::kMax:
      resolved.builtin = ncclMax;
      return resolved;
    case ReduceOp::kMin:
      resolved.builtin = ncclMin;
      return resolved;
  }
  if (!divides) return resolved;
  double product = options.pre_divide_factor * options.post_divide_factor;
  if (options.op == ReduceOp::kAvg) product *= s.size;
  const double scale = 1.0 / product;
  StoreFromDouble(resolved.scalar, dtype, 0, scale);
  const double stored = LoadAsDouble(resolved.scalar, dtype, 0);
  if (!(stored > 0) || std::isinf(stored)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "rank %d: %s #%d: divide factors %g and %g%s give the scale %g, "
        "which is %g in %s",
        s.rank, op, seq, options.pre_divide_factor, options.post_divide_factor,
        options.op == ReduceOp::kAvg
            ? absl::StrFormat(" and the group size %d", s.size)
            : std::string(),
        scale, stored, DTypeName(dtype)));
  }
  resolved.premul = true;
  return resolved;
}

// Host buffers are Unimplemented (NCCL reads device memory); a buffer of
// another device, or one whose memory is not what its label says, is
// InvalidArgument.
absl::Status CheckCudaBuffer(const CommState& s, absl::string_view op,
                             int64_t seq, absl::string_view which,
                             ConstBufferRef b) {
  if (b.device.type != DeviceType::kCuda) {
    return absl::UnimplementedError(absl::StrFormat(
        "rank %d: %s #%d: the NCCL backend takes CUDA buffers on cuda:%d; "
        "%s is %s on %s",
        s.rank, op, seq, s.device, which, Describe(b), DeviceName(b.device)));
  }
  if (b.device.index != s.device) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "rank %d: %s #%d: %s (%s) is on %s but this communicator's device is "
        "cuda:%d",
        s.rank, op, seq, which, Describe(b), DeviceName(b.device), s.device));
  }
  if (!s.options.check_pointers || b.count == 0) return absl::OkStatus();
  cudaPointerAttributes attributes;
  std::memset(&attributes, 0, sizeof(attributes));
  FLATPARAM_RETURN_IF_ERROR(CudaStatus(
      *s.api, s.api->CudaPointerGetAttributes(&attributes, b.data),
      absl::StrFormat("rank %d: %s #%d: cudaPointerGetAttributes(%s at %p)",
                      s.rank, op, seq, which, b.data)));
  if (attributes.type == cudaMemoryTypeManaged) return absl::OkStatus();
  if (attributes.type != cudaMemoryTypeDevice) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "rank %d: %s #%d: %s (%s at %p) is labelled cuda:%d but is not device "
        "memory (cudaMemoryType %d)",
        s.rank, op, seq, which, Describe(b), b.data, s.device,
        static_cast<int>(attributes.type)));
  }
  if (attributes.device != s.device) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "rank %d: %s #%d: %s (%s at %p) is labelled cuda:%d but was "
        "allocated on cuda:%d",
        s.rank, op, seq, which, Describe(b), b.data, s.device,
        attributes.device));
  }
  return absl::OkStatus();
}

absl::Status CheckCudaPair(const CommState& s, absl::string_view op,
                           int64_t seq, ConstBufferRef input,
                           ConstBufferRef output, bool in_place) {
  FLATPARAM_RETURN_IF_ERROR(CheckCudaBuffer(s, op, seq, "input", input));
  FLATPARAM_RETURN_IF_ERROR(CheckCudaBuffer(s, op, seq, "output", output));
  if (!in_place && BuffersOverlap(input, output)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "rank %d: %s #%d: input (%s at %p) and output (%s at %p) overlap but "
        "are not in place",
        s.rank, op, seq, Describe(input), input.data, Describe(output),
        output.data));
  }
  return absl::OkStatus();
}

using NcclCall = absl::FunctionRef<ncclResult_t(
    ncclComm_t comm, cudaStream_t stream, ncclRedOp_t op)>;

// Makes the communicator's stream wait for the work issued on the caller's
// `after` stream so far (CollectiveOptions::stream): an event recorded
// there, waited for, and destroyed (the wait keeps what it captured).
absl::Status WaitForCallerStream(CommState& s, const DeviceStream& after,
                                 absl::string_view context) {
  NcclApi& api = *s.api;
  cudaEvent_t event = nullptr;
  FLATPARAM_RETURN_IF_ERROR(CudaStatus(
      api, api.CudaEventCreateWithFlags(&event, cudaEventDisableTiming),
      absl::StrCat(context, ": cudaEventCreateWithFlags (stream order)")));
  absl::Status st = CudaStatus(
      api,
      api.CudaEventRecord(event, reinterpret_cast<cudaStream_t>(after.handle)),
      absl::StrCat(context, ": cudaEventRecord on the caller's stream"));
  if (st.ok()) {
    st = CudaStatus(api, api.CudaStreamWaitEvent(s.stream->stream, event, 0),
                    absl::StrCat(context, ": cudaStreamWaitEvent"));
  }
  api.CudaEventDestroy(event);
  return st;
}

// Enqueues `call` on the communicator's stream (creating and destroying a
// pre-multiplied sum operator around it when `op` asks for one) and returns
// a Work that waits for it.
std::unique_ptr<Work> Issue(const std::shared_ptr<CommState>& state,
                            const std::string& context, absl::Time deadline,
                            const CollectiveOptions& options,
                            const ResolvedOp* op, NcclCall call) {
  CommState& s = *state;
  NcclApi& api = *s.api;
  const absl::Duration timeout = options.timeout;
  if (s.aborted) return CompletedWork(AbortedError(s, context));
  if (options.stream.has_value()) {
    if (absl::Status st = CheckStream(s, *options.stream, context); !st.ok()) {
      return CompletedWork(Failed(s, std::move(st)));
    }
  }
  DeviceGuard guard(api);
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
          api, api.CudaEventCreateWithFlags(&event, cudaEventDisableTiming),
          absl::StrCat(context, ": cudaEventCreateWithFlags"));
      !st.ok()) {
    return CompletedWork(Failed(s, std::move(st)));
  }
  auto fail = [&](absl::Status st) {
    api.CudaEventDestroy(event);
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
          CudaStatus(api, api.CudaEventRecord(event, s.stream->stream),
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

// Enqueues a host<->device copy on the communicator's stream.
absl::Status CopyAsync(CommState& s, void* dst, const void* src, size_t bytes,
                       cudaMemcpyKind kind, absl::string_view context) {
  if (bytes == 0) return absl::OkStatus();
  return CudaStatus(
      *s.api, s.api->CudaMemcpyAsync(dst, src, bytes, kind, s.stream->stream),
      absl::StrFormat("%s: cudaMemcpyAsync(%d bytes)", context, bytes));
}

// Grows the device scratch to `bytes`, stream-ordered (see CommState).
absl::Status EnsureDeviceScratch(CommState& s, size_t bytes,
                                 absl::string_view context) {
  if (bytes <= s.device_scratch_bytes) return absl::OkStatus();
  NcclApi& api = *s.api;
  if (s.device_scratch != nullptr) {
    void* old = s.device_scratch;
    s.device_scratch = nullptr;
    s.device_scratch_bytes = 0;
    FLATPARAM_RETURN_IF_ERROR(
        CudaStatus(api, api.CudaFreeAsync(old, s.stream->stream),
                   absl::StrCat(context, ": cudaFreeAsync")));
  }
  const size_t grown = std::max<size_t>(bytes, 256);
  FLATPARAM_RETURN_IF_ERROR(CudaStatus(
      api, api.CudaMallocAsync(&s.device_scratch, grown, s.stream->stream),
      absl::StrFormat("%s: cudaMallocAsync(%d)", context, grown)));
  s.device_scratch_bytes = grown;
  return absl::OkStatus();
}

// Grows the pinned host staging to `bytes`; the outgrown block is kept
// until destruction (see CommState).
absl::Status EnsureHostStaging(CommState& s, size_t bytes,
                               absl::string_view context) {
  if (bytes <= s.host_staging_bytes) return absl::OkStatus();
  NcclApi& api = *s.api;
  const size_t grown = std::max<size_t>({bytes, 2 * s.host_staging_bytes, 256});
  void* p = nullptr;
  FLATPARAM_RETURN_IF_ERROR(
      CudaStatus(api, api.CudaMallocHost(&p, grown),
                 absl::StrFormat("%s: cudaMallocHost(%d)", context, grown)));
  if (s.host_staging != nullptr) s.retired_staging.push_back(s.host_staging);
  s.host_staging = p;
  s.host_staging_bytes = grown;
  return absl::OkStatus();
}

// Blocks until everything enqueued so far on the stream has finished.
absl::Status AwaitStream(CommState& s, absl::Time deadline,
                         absl::Duration timeout, absl::string_view context) {
  NcclApi& api = *s.api;
  cudaEvent_t event = nullptr;
  FLATPARAM_RETURN_IF_ERROR(CudaStatus(
      api, api.CudaEventCreateWithFlags(&event, cudaEventDisableTiming),
      absl::StrCat(context, ": cudaEventCreateWithFlags")));
  absl::Status st =
      CudaStatus(api, api.CudaEventRecord(event, s.stream->stream),
                 absl::StrCat(context, ": cudaEventRecord"));
  if (st.ok()) st = AwaitEvent(s, event, deadline, timeout, context);
  api.CudaEventDestroy(event);
  return st;
}

}  // namespace

namespace internal_nccl {

CommState::~CommState() {
  DeviceGuard guard(*api);
  guard.Set(device, "").IgnoreError();
  const bool after_failure =
      failed || ProcessFailures() != process_failures_at_creation;
  if (comm != nullptr && owns_comm && !aborted && after_failure) {
    // After a failure here or in another communicator of the process, a
    // finalize would wait for peers that may never finalize (for the whole
    // setup timeout): abort at once, as c10d does without a clean shutdown.
    api->CommAbort(comm);
  } else if (comm != nullptr && owns_comm && !aborted) {
    // Finalize flushes outstanding operations; a non-blocking communicator
    // reports completion through its asynchronous state. There is no caller
    // to report failures to: a communicator that cannot be finalized is
    // aborted instead.
    const ncclResult_t r = api->CommFinalize(comm);
    bool ok = r == ncclSuccess || r == ncclInProgress;
    if (ok) {
      ok = PollComm(*api, comm, absl::Now() + options.setup_timeout,
                    options.setup_timeout, "ncclCommFinalize")
               .ok();
    }
    if (ok) {
      api->CommDestroy(comm);
    } else {
      api->CommAbort(comm);
    }
  }
  comm = nullptr;
  if (device_scratch != nullptr) {
    // Stream-ordered: released after the work already on the stream.
    if (api->CudaFreeAsync(device_scratch, stream->stream) != cudaSuccess) {
      api->CudaGetLastError();
    }
  }
  if (host_staging != nullptr) retired_staging.push_back(host_staging);
  // cudaFreeHost synchronizes the device: after a failure the device may
  // never become idle, and a leak is better than a hang.
  if (!failed && !aborted) {
    for (void* p : retired_staging) {
      if (api->CudaFreeHost(p) != cudaSuccess) api->CudaGetLastError();
    }
  }
}

}  // namespace internal_nccl

NcclCommunicator::NcclCommunicator(std::shared_ptr<CommState> state)
    : state_(std::move(state)) {}

NcclCommunicator::~NcclCommunicator() = default;

absl::StatusOr<std::unique_ptr<NcclCommunicator>> NcclCommunicator::Create(
    NcclApi& api, Communicator& bootstrap, int cuda_device,
    const NcclOptions& options, cudaStream_t stream) {
  const int rank = bootstrap.rank();
  const int size = bootstrap.size();
  const std::string context = absl::StrFormat(
      "rank %d: creating the NCCL communicator (%d ranks, cuda:%d)", rank, size,
      cuda_device);
  const absl::Time deadline = absl::Now() + options.setup_timeout;
  DeviceGuard guard(api);
  ncclUniqueId id;
  std::memset(&id, 0, sizeof(id));

  // Local checks first; their outcome travels with the id so that no rank
  // waits for one that has already given up.
  const absl::Status local = [&]() -> absl::Status {
    int count = 0;
    const cudaError_t e = api.CudaGetDeviceCount(&count);
    if (e != cudaSuccess) {
      const absl::Status st = CudaStatus(api, e, "cudaGetDeviceCount");
      return absl::Status(st.code(), absl::StrFormat("%s: no usable GPU: %s",
                                                     context, st.message()));
    }
    if (count == 0) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "%s: no usable GPU: cudaGetDeviceCount found no device", context));
    }
    if (cuda_device < 0 || cuda_device >= count) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: CUDA device %d is not in [0, %d)", context, cuda_device, count));
    }
    FLATPARAM_RETURN_IF_ERROR(guard.Set(cuda_device, context));
    if (rank == 0) {
      FLATPARAM_RETURN_IF_ERROR(
          NcclStatus(api, api.GetUniqueId(&id), nullptr,
                     absl::StrCat(context, ": ncclGetUniqueId")));
    }
    return absl::OkStatus();
  }();

  std::string payload;
  if (!local.ok()) {
    payload = absl::StrCat("E", local.message());
  } else if (rank == 0) {
    payload = absl::StrCat("K", absl::string_view(id.internal, sizeof(id)));
  } else {
    payload = "K";
  }
  CollectiveOptions exchange;
  exchange.timeout = options.setup_timeout;
  absl::StatusOr<std::vector<std::string>> all =
      bootstrap.AllGatherBytes(payload, exchange);
  if (!all.ok()) {
    return absl::Status(
        all.status().code(),
        absl::StrFormat("%s: sharing the ncclUniqueId over the %s bootstrap "
                        "failed: %s",
                        context, bootstrap.backend(), all.status().message()));
  }
  if (!local.ok()) return local;
  if (static_cast<int>(all->size()) != size) {
    return absl::InternalError(
        absl::StrFormat("%s: the bootstrap returned %d messages for %d ranks",
                        context, all->size(), size));
  }
  for (int r = 0; r < size; ++r) {
    const std::string& message = (*all)[r];
    if (message.empty() || (message[0] != 'K' && message[0] != 'E')) {
      return absl::InternalError(
          absl::StrFormat("%s: rank %d sent a malformed message of %d bytes",
                          context, r, message.size()));
    }
    if (message[0] == 'E') {
      return absl::AbortedError(absl::StrFormat("%s: rank %d failed: %s",
                                                context, r, message.substr(1)));
    }
  }
  if ((*all)[0].size() != 1 + sizeof(id)) {
    return absl::InternalError(
        absl::StrFormat("%s: rank 0 sent a unique id of %d bytes, expected %d",
                        context, (*all)[0].size() - 1, sizeof(id)));
  }
  std::memcpy(id.internal, (*all)[0].data() + 1, sizeof(id));

  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = options.blocking ? 1 : 0;
  ncclComm_t comm = nullptr;
  const absl::Status init = [&]() -> absl::Status {
    const ncclResult_t r =
        api.CommInitRankConfig(&comm, size, id, rank, &config);
    if (r != ncclSuccess && r != ncclInProgress) {
      return NcclStatus(api, r, comm,
                        absl::StrCat(context, ": ncclCommInitRankConfig"));
    }
    return PollComm(api, comm, deadline, options.setup_timeout, context);
  }();
  // Every rank's outcome, over the bootstrap: a barrier, so that no rank
  // enqueues its first collective while a peer is still initializing (with
  // several ranks in one process, NCCL's kernels on one device can then
  // wait for a rank whose initialization waits for the device), and so that
  // a failed initialization fails every rank here instead of hanging their
  // first collective.
  absl::StatusOr<std::vector<std::string>> outcomes = bootstrap.AllGatherBytes(
      init.ok() ? std::string("K") : absl::StrCat("E", init.message()),
      exchange);
  absl::Status st = init;
  if (st.ok() && !outcomes.ok()) {
    st = absl::Status(
        outcomes.status().code(),
        absl::StrFormat("%s: the barrier after initialization over the %s "
                        "bootstrap failed: %s",
                        context, bootstrap.backend(),
                        outcomes.status().message()));
  }
  for (int r = 0; st.ok() && r < size; ++r) {
    const std::string& message = (*outcomes)[r];
    if (message.empty() || message[0] != 'K') {
      st = absl::AbortedError(absl::StrFormat(
          "%s: rank %d failed to initialize its NCCL communicator: %s", context,
          r, message.empty() ? "(no message)" : message.substr(1)));
    }
  }
  if (!st.ok()) {
    if (comm != nullptr) api.CommAbort(comm);
    return absl::Status(
        st.code(),
        absl::StrCat(st.message(),
                     comm != nullptr
                         ? "; aborted the NCCL communicator (ncclCommAbort)"
                         : ""));
  }
  return FromComm(api, comm, /*owned=*/true, options, nullptr, stream);
}

absl::StatusOr<std::unique_ptr<NcclCommunicator>> NcclCommunicator::Wrap(
    NcclApi& api, ncclComm_t comm, Ownership ownership,
    const NcclOptions& options, cudaStream_t stream) {
  if (comm == nullptr) {
    return absl::InvalidArgumentError("cannot wrap a null ncclComm_t");
  }
  if (absl::Status st =
          PollComm(api, comm, absl::Now() + options.setup_timeout,
                   options.setup_timeout, "wrapping an ncclComm_t");
      !st.ok()) {
    return st;
  }
  return FromComm(api, comm, ownership == Ownership::kTakeOwnership, options,
                  nullptr, stream);
}

absl::StatusOr<std::unique_ptr<NcclCommunicator>> NcclCommunicator::FromComm(
    NcclApi& api, ncclComm_t comm, bool owned, const NcclOptions& options,
    std::shared_ptr<StreamHandle> stream, cudaStream_t user_stream) {
  // The state owns `comm` from here on, so every failure below releases it.
  auto state = std::make_shared<CommState>();
  state->process_failures_at_creation = ProcessFailures();
  state->api = &api;
  state->comm = comm;
  state->owns_comm = owned;
  state->options = options;
  const absl::string_view context = "wrapping an ncclComm_t";
  FLATPARAM_RETURN_IF_ERROR(
      NcclStatus(api, api.CommCuDevice(comm, &state->device), comm,
                 absl::StrCat(context, ": ncclCommCuDevice")));
  FLATPARAM_RETURN_IF_ERROR(
      NcclStatus(api, api.CommCount(comm, &state->size), comm,
                 absl::StrCat(context, ": ncclCommCount")));
  FLATPARAM_RETURN_IF_ERROR(
      NcclStatus(api, api.CommUserRank(comm, &state->rank), comm,
                 absl::StrCat(context, ": ncclCommUserRank")));
  if (stream == nullptr) {
    stream = std::make_shared<StreamHandle>();
    stream->api = &api;
    if (user_stream != nullptr) {
      stream->stream = user_stream;
    } else {
      DeviceGuard guard(api);
      FLATPARAM_RETURN_IF_ERROR(guard.Set(state->device, context));
      FLATPARAM_RETURN_IF_ERROR(CudaStatus(
          api,
          api.CudaStreamCreateWithFlags(&stream->stream, cudaStreamNonBlocking),
          absl::StrCat(context, ": cudaStreamCreateWithFlags")));
      stream->owned = true;
    }
  }
  state->stream = std::move(stream);
  return std::unique_ptr<NcclCommunicator>(
      new NcclCommunicator(std::move(state)));
}

bool NcclCommunicator::SupportsStreams(Device device) const {
  return device == Device::Cuda(state_->device);
}

int NcclCommunicator::rank() const { return state_->rank; }
int NcclCommunicator::size() const { return state_->size; }
int NcclCommunicator::device() const { return state_->device; }
cudaStream_t NcclCommunicator::stream() const { return state_->stream->stream; }
ncclComm_t NcclCommunicator::comm() const { return state_->comm; }
bool NcclCommunicator::aborted() const { return state_->aborted; }
absl::Status NcclCommunicator::abort_status() const {
  return state_->abort_status;
}

void NcclCommunicator::Abort(absl::Status reason) {
  if (reason.ok()) reason = absl::AbortedError("aborted by the caller");
  AbortState(*state_, std::move(reason)).IgnoreError();
}

std::unique_ptr<Work> NcclCommunicator::AllGather(
    ConstBufferRef input, BufferRef output, const CollectiveOptions& options) {
  const absl::Time deadline = absl::Now() + options.timeout;
  CommState& s = *state_;
  const int64_t seq = seq_++;
  constexpr absl::string_view kOp = "all_gather";
  if (absl::Status st = ValidateAllGather(s.rank, s.size, seq, input, output);
      !st.ok()) {
    return CompletedWork(Failed(s, std::move(st)));
  }
  const std::string context = OpContext(s, kOp, seq, input, output);
  if (s.aborted) return CompletedWork(AbortedError(s, context));
  const bool in_place =
      input.data == static_cast<const char*>(output.data) +
                        static_cast<int64_t>(s.rank) * input.bytes();
  if (absl::Status st = CheckCudaPair(s, kOp, seq, input, output, in_place);
      !st.ok()) {
    return CompletedWork(Failed(s, std::move(st)));
  }
  if (input.count == 0) return CompletedWork(absl::OkStatus());
  return Issue(state_, context, deadline, options, nullptr,
               [&](ncclComm_t comm, cudaStream_t stream, ncclRedOp_t) {
                 return s.api->AllGather(input.data, output.data, input.count,
                                         NcclDType(input.dtype), comm, stream);
               });
}

std::unique_ptr<Work> NcclCommunicator::ReduceScatter(
    ConstBufferRef input, BufferRef output, const ReduceOptions& options) {
  const absl::Time deadline = absl::Now() + options.timeout;
  CommState& s = *state_;
  const int64_t seq = seq_++;
  constexpr absl::string_view kOp = "reduce_scatter";
  if (absl::Status st =
          ValidateReduceScatter(s.rank, s.size, seq, input, output, options);
      !st.ok()) {
    return CompletedWork(Failed(s, std::move(st)));
  }
  const std::string context = OpContext(s, kOp, seq, input, output);
  if (s.aborted) return CompletedWork(AbortedError(s, context));
  const bool in_place =
      output.data == static_cast<const char*>(input.data) +
                         static_cast<int64_t>(s.rank) * output.bytes();
  if (absl::Status st = CheckCudaPair(s, kOp, seq, input, output, in_place);
      !st.ok()) {
    return CompletedWork(Failed(s, std::move(st)));
  }
  absl::StatusOr<ResolvedOp> op = ResolveOp(s, kOp, seq, options, input.dtype);
  if (!op.ok()) return CompletedWork(op.status());
  if (output.count == 0) return CompletedWork(absl::OkStatus());
  return Issue(state_, context, deadline, options, &*op,
               [&](ncclComm_t comm, cudaStream_t stream, ncclRedOp_t redop) {
                 return s.api->ReduceScatter(
                     input.data, output.data, output.count,
                     NcclDType(input.dtype), redop, comm, stream);
               });
}

std::unique_ptr<Work> NcclCommunicator::AllReduce(
    ConstBufferRef input, BufferRef output, const ReduceOptions& options) {
  const absl::Time deadline = absl::Now() + options.timeout;
  CommState& s = *state_;
  const int64_t seq = seq_++;
  constexpr absl::string_view kOp = "all_reduce";
  if (absl::Status st =
          ValidateAllReduce(s.rank, s.size, seq, input, output, options);
      !st.ok()) {
    return CompletedWork(Failed(s, std::move(st)));
  }
  const std::string context = OpContext(s, kOp, seq, input, output);
  if (s.aborted) return CompletedWork(AbortedError(s, context));
  const bool in_place = input.data == output.data;
  if (absl::Status st = CheckCudaPair(s, kOp, seq, input, output, in_place);
      !st.ok()) {
    return CompletedWork(Failed(s, std::move(st)));
  }
  absl::StatusOr<ResolvedOp> op = ResolveOp(s, kOp, seq, options, input.dtype);
  if (!op.ok()) return CompletedWork(op.status());
  if (input.count == 0) return CompletedWork(absl::OkStatus());
  return Issue(state_, context, deadline, options, &*op,
               [&](ncclComm_t comm, cudaStream_t stream, ncclRedOp_t redop) {
                 return s.api->AllReduce(input.data, output.data, input.count,
                                         NcclDType(input.dtype), redop, comm,
                                         stream);
               });
}

std::unique_ptr<Work> NcclCommunicator::Broadcast(
    BufferRef buffer, const BroadcastOptions& options) {
  const absl::Time deadline = absl::Now() + options.timeout;
  CommState& s = *state_;
  const int64_t seq = seq_++;
  constexpr absl::string_view kOp = "broadcast";
  if (absl::Status st = ValidateBroadcast(s.rank, s.size, seq, buffer, options);
      !st.ok()) {
    return CompletedWork(Failed(s, std::move(st)));
  }
  const std::string context =
      absl::StrFormat("rank %d: %s #%d (buffer %s on cuda:%d, root %d)", s.rank,
                      kOp, seq, Describe(buffer), s.device, options.root);
  if (s.aborted) return CompletedWork(AbortedError(s, context));
  if (absl::Status st = CheckCudaBuffer(s, kOp, seq, "buffer", buffer);
      !st.ok()) {
    return CompletedWork(Failed(s, std::move(st)));
  }
  if (buffer.count == 0) return CompletedWork(absl::OkStatus());
  return Issue(state_, context, deadline, options, nullptr,
               [&](ncclComm_t comm, cudaStream_t stream, ncclRedOp_t) {
                 return s.api->Broadcast(buffer.data, buffer.data, buffer.count,
                                         NcclDType(buffer.dtype), options.root,
                                         comm, stream);
               });
}

absl::StatusOr<std::vector<std::string>> NcclCommunicator::AllGatherBytes(
    absl::string_view bytes, const CollectiveOptions& options) {
  const absl::Time deadline = absl::Now() + options.timeout;
  CommState& s = *state_;
  NcclApi& api = *s.api;
  const int64_t seq = seq_++;
  const std::string context =
      absl::StrFormat("rank %d: all_gather_bytes #%d (%d bytes on cuda:%d)",
                      s.rank, seq, bytes.size(), s.device);
  if (s.aborted) return AbortedError(s, context);
  auto run = [&]() -> absl::StatusOr<std::vector<std::string>> {
    DeviceGuard guard(api);
    FLATPARAM_RETURN_IF_ERROR(guard.Set(s.device, context));

    // Round 1: every rank's length, through the scratch (no allocation,
    // free or pageable copy between the collectives: see CommState).
    const size_t n = static_cast<size_t>(s.size);
    const size_t rank = static_cast<size_t>(s.rank);
    FLATPARAM_RETURN_IF_ERROR(
        EnsureDeviceScratch(s, n * sizeof(int64_t), context));
    FLATPARAM_RETURN_IF_ERROR(
        EnsureHostStaging(s, n * sizeof(int64_t), context));
    const int64_t my_length = static_cast<int64_t>(bytes.size());
    auto* staged = static_cast<int64_t*>(s.host_staging);
    staged[rank] = my_length;
    char* lengths = static_cast<char*>(s.device_scratch);
    char* my_slot = lengths + rank * sizeof(int64_t);
    FLATPARAM_RETURN_IF_ERROR(CopyAsync(s, my_slot, &staged[rank],
                                        sizeof(int64_t), cudaMemcpyHostToDevice,
                                        context));
    FLATPARAM_RETURN_IF_ERROR(
        Issue(state_, context, deadline, HostOrdered(options), nullptr,
              [&](ncclComm_t comm, cudaStream_t stream, ncclRedOp_t) {
                return api.AllGather(my_slot, lengths, 1, ncclInt64, comm,
                                     stream);
              })
            ->Wait());
    FLATPARAM_RETURN_IF_ERROR(CopyAsync(s, staged, lengths, n * sizeof(int64_t),
                                        cudaMemcpyDeviceToHost, context));
    FLATPARAM_RETURN_IF_ERROR(
        AwaitStream(s, deadline, options.timeout, context));
    const std::vector<int64_t> sizes(staged, staged + n);
    int64_t longest = 0;
    for (size_t r = 0; r < n; ++r) {
      if (sizes[r] < 0 || (r == rank && sizes[r] != my_length)) {
        return absl::InternalError(absl::StrFormat(
            "%s: rank %d's length arrived as %d; the group is desynchronized",
            context, r, sizes[r]));
      }
      longest = std::max(longest, sizes[r]);
    }

    // Round 2: the bytes, each rank's padded to the longest.
    std::vector<std::string> result(n);
    if (longest == 0) return result;
    const size_t stride = static_cast<size_t>(longest);
    // Growing is stream-ordered (device) or allocation only (host): no
    // device synchronization between the collectives.
    FLATPARAM_RETURN_IF_ERROR(EnsureDeviceScratch(s, n * stride, context));
    FLATPARAM_RETURN_IF_ERROR(EnsureHostStaging(s, n * stride, context));
    char* host = static_cast<char*>(s.host_staging);
    char* data = static_cast<char*>(s.device_scratch);
    char* my_bytes = data + rank * stride;
    if (!bytes.empty()) {
      std::memcpy(host + rank * stride, bytes.data(), bytes.size());
    }
    FLATPARAM_RETURN_IF_ERROR(CopyAsync(s, my_bytes, host + rank * stride,
                                        bytes.size(), cudaMemcpyHostToDevice,
                                        context));
    FLATPARAM_RETURN_IF_ERROR(
        Issue(state_, context, deadline, HostOrdered(options), nullptr,
              [&](ncclComm_t comm, cudaStream_t stream, ncclRedOp_t) {
                return api.AllGather(my_bytes, data, stride, ncclUint8, comm,
                                     stream);
              })
            ->Wait());
    FLATPARAM_RETURN_IF_ERROR(
        CopyAsync(s, host, data, n * stride, cudaMemcpyDeviceToHost, context));
    FLATPARAM_RETURN_IF_ERROR(
        AwaitStream(s, deadline, options.timeout, context));
    for (size_t r = 0; r < n; ++r) {
      result[r].assign(host + r * stride, static_cast<size_t>(sizes[r]));
    }
    return result;
  };
  absl::StatusOr<std::vector<std::string>> result = run();
  Failed(s, result.status()).IgnoreError();
  return result;
}

absl::Status NcclCommunicator::Barrier(const CollectiveOptions& options) {
  const absl::Time deadline = absl::Now() + options.timeout;
  CommState& s = *state_;
  NcclApi& api = *s.api;
  const int64_t seq = seq_++;
  const std::string context =
      absl::StrFormat("rank %d: barrier #%d on cuda:%d", s.rank, seq, s.device);
  if (s.aborted) return AbortedError(s, context);
  auto run = [&]() -> absl::Status {
    DeviceGuard guard(api);
    FLATPARAM_RETURN_IF_ERROR(guard.Set(s.device, context));
    FLATPARAM_RETURN_IF_ERROR(EnsureDeviceScratch(s, sizeof(float), context));
    FLATPARAM_RETURN_IF_ERROR(
        CudaStatus(api,
                   api.CudaMemsetAsync(s.device_scratch, 0, sizeof(float),
                                       s.stream->stream),
                   absl::StrCat(context, ": cudaMemsetAsync")));
    return Issue(state_, context, deadline, HostOrdered(options), nullptr,
                 [&](ncclComm_t comm, cudaStream_t stream, ncclRedOp_t) {
                   return api.AllReduce(s.device_scratch, s.device_scratch, 1,
                                        ncclFloat32, ncclSum, comm, stream);
                 })
        ->Wait();
  };
  return Failed(s, run());
}

absl::StatusOr<std::unique_ptr<Communicator>> NcclCommunicator::Split(
    int color, int key, const CollectiveOptions& options) {
  const absl::Time deadline = absl::Now() + options.timeout;
  CommState& s = *state_;
  NcclApi& api = *s.api;
  const int64_t seq = seq_++;
  const std::string context = absl::StrFormat(
      "rank %d: split #%d (color %d, key %d)", s.rank, seq, color, key);
  if (s.aborted) return AbortedError(s, context);
  DeviceGuard guard(api);
  FLATPARAM_RETURN_IF_ERROR(guard.Set(s.device, context));
  ncclComm_t child = nullptr;
  // A null config makes the child inherit the parent's (blocking mode
  // included).
  const ncclResult_t r = api.CommSplit(
      s.comm, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, &child, nullptr);
  if (r != ncclSuccess && r != ncclInProgress) {
    absl::Status st =
        NcclStatus(api, r, s.comm, absl::StrCat(context, ": ncclCommSplit"));
    if (child != nullptr) api.CommAbort(child);
    return st;
  }
  if (absl::Status st = PollComm(api, s.comm, deadline, options.timeout,
                                 absl::StrCat(context, ": parent"));
      !st.ok()) {
    if (child != nullptr) api.CommAbort(child);
    return AbortState(s, std::move(st));
  }
  if (child == nullptr) return std::unique_ptr<Communicator>();
  if (absl::Status st = PollComm(api, child, deadline, options.timeout,
                                 absl::StrCat(context, ": child"));
      !st.ok()) {
    api.CommAbort(child);
    return absl::Status(
        st.code(),
        absl::StrCat(st.message(),
                     "; aborted the new NCCL communicator (ncclCommAbort)"));
  }
  FLATPARAM_ASSIGN_OR_RETURN(
      std::unique_ptr<NcclCommunicator> split,
      FromComm(api, child, /*owned=*/true, s.options, s.stream, nullptr));
  return std::unique_ptr<Communicator>(std::move(split));
}

}  // namespace flatparam
