#include "comm/nccl/nccl_communicator.h"

#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "comm/communicator.h"
#include "comm/nccl/internal/nccl_internal.h"
#include "comm/nccl/nccl_api.h"
#include "comm/nccl/nccl_options.h"
#include "flatparam/base/status_macros.h"

// NcclCommunicator itself: making one (Create, Wrap, and the sub-groups of
// Split), its teardown (~CommState) and accessors. Its collectives are in
// nccl_collectives.cc and nccl_scratch.cc; internal/nccl_internal.h says
// how the backend's files fit together.

namespace flatparam {

using internal_nccl::AbortedError;
using internal_nccl::AbortState;
using internal_nccl::CommState;
using internal_nccl::PollComm;
using internal_nccl::ProcessFailures;
using internal_nccl::StreamHandle;

namespace internal_nccl {

CommState::~CommState() {
  CudaDeviceGuard guard(*cuda);
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
    if (cuda->FreeAsync(device_scratch, stream->stream) != cudaSuccess) {
      cuda->GetLastError();
    }
  }
  if (host_staging != nullptr) retired_staging.push_back(host_staging);
  // cudaFreeHost synchronizes the device: after a failure the device may
  // never become idle, and a leak is better than a hang.
  if (!failed && !aborted) {
    for (void* p : retired_staging) {
      if (cuda->FreeHost(p) != cudaSuccess) cuda->GetLastError();
    }
  }
}

}  // namespace internal_nccl

NcclCommunicator::NcclCommunicator(std::shared_ptr<CommState> state)
    : state_(std::move(state)) {}

NcclCommunicator::~NcclCommunicator() = default;

absl::StatusOr<std::unique_ptr<NcclCommunicator>> NcclCommunicator::Create(
    NcclApi& api, CudaRuntime& cuda, Communicator& bootstrap, int cuda_device,
    const NcclOptions& options, cudaStream_t stream) {
  const int rank = bootstrap.rank();
  const int size = bootstrap.size();
  const std::string context = absl::StrFormat(
      "rank %d: creating the NCCL communicator (%d ranks, cuda:%d)", rank, size,
      cuda_device);
  const absl::Time deadline = absl::Now() + options.setup_timeout;
  CudaDeviceGuard guard(cuda);
  ncclUniqueId id;
  std::memset(&id, 0, sizeof(id));

  // Local checks first; their outcome travels with the id so that no rank
  // waits for one that has already given up.
  const absl::Status local = [&]() -> absl::Status {
    int count = 0;
    const cudaError_t e = cuda.GetDeviceCount(&count);
    if (e != cudaSuccess) {
      const absl::Status st = CudaStatus(cuda, e, "cudaGetDeviceCount");
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
  return FromComm(api, cuda, comm, /*owned=*/true, options, nullptr, stream);
}

absl::StatusOr<std::unique_ptr<NcclCommunicator>> NcclCommunicator::Wrap(
    NcclApi& api, CudaRuntime& cuda, ncclComm_t comm, Ownership ownership,
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
  return FromComm(api, cuda, comm, ownership == Ownership::kTakeOwnership,
                  options, nullptr, stream);
}

absl::StatusOr<std::unique_ptr<NcclCommunicator>> NcclCommunicator::FromComm(
    NcclApi& api, CudaRuntime& cuda, ncclComm_t comm, bool owned,
    const NcclOptions& options, std::shared_ptr<StreamHandle> stream,
    cudaStream_t user_stream) {
  // The state owns `comm` from here on, so every failure below releases it.
  auto state = std::make_shared<CommState>();
  state->process_failures_at_creation = ProcessFailures();
  state->api = &api;
  state->cuda = &cuda;
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
    stream->cuda = &cuda;
    if (user_stream != nullptr) {
      stream->stream = user_stream;
    } else {
      CudaDeviceGuard guard(cuda);
      FLATPARAM_RETURN_IF_ERROR(guard.Set(state->device, context));
      FLATPARAM_RETURN_IF_ERROR(CudaStatus(
          cuda,
          cuda.StreamCreateWithFlags(&stream->stream, cudaStreamNonBlocking),
          absl::StrCat(context, ": cudaStreamCreateWithFlags")));
      stream->owned = true;
    }
  }
  state->stream = std::move(stream);
  auto made =
      std::unique_ptr<NcclCommunicator>(new NcclCommunicator(std::move(state)));
  // A world of its own (Split replaces it with the parent's recorder).
  if (options.flight_recorder.capacity > 0) {
    made->recorder_ = FlightRecorder::Create(made->rank(), made->size(), "nccl",
                                             options.flight_recorder);
    auto world = std::make_shared<FlightGroup>();
    world->id = "world";
    for (int r = 0; r < made->size(); ++r) world->ranks.push_back(r);
    made->group_ = std::move(world);
  }
  return made;
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

absl::StatusOr<std::unique_ptr<Communicator>> NcclCommunicator::Split(
    int color, int key, const CollectiveOptions& options) {
  const absl::Time deadline = absl::Now() + options.timeout;
  CommState& s = *state_;
  NcclApi& api = *s.api;
  CudaRuntime& cuda = *s.cuda;
  const int64_t seq = seq_++;
  const std::string context = absl::StrFormat(
      "rank %d: split #%d (color %d, key %d)", s.rank, seq, color, key);
  if (s.aborted) return AbortedError(s, context);
  CudaDeviceGuard guard(cuda);
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
  NcclOptions child_options = s.options;
  child_options.flight_recorder.capacity = 0;  // Records into ours.
  FLATPARAM_ASSIGN_OR_RETURN(std::unique_ptr<NcclCommunicator> split,
                             FromComm(api, cuda, child, /*owned=*/true,
                                      child_options, s.stream, nullptr));
  if (recorder_ != nullptr) {
    split->recorder_ = recorder_;
    auto group = std::make_shared<FlightGroup>();
    // ncclCommSplit does not tell the members' world ranks.
    group->id = SplitGroupId(group_->id, seq, color);
    split->group_ = std::move(group);
  }
  return std::unique_ptr<Communicator>(std::move(split));
}

}  // namespace flatparam
