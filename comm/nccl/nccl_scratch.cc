#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
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
#include "comm/nccl/nccl_communicator.h"
#include "flatparam/base/status_macros.h"

// The collectives of NcclCommunicator that the host waits for
// (AllGatherBytes, Barrier), and the scratch buffers they go through (see
// CommState). internal/nccl_internal.h says how the backend's files fit
// together.

namespace flatparam {

using internal_nccl::AbortedError;
using internal_nccl::AwaitEvent;
using internal_nccl::CommState;
using internal_nccl::Failed;
using internal_nccl::Issue;

namespace {

// The options of a collective that the host waits for (internal ones).
CollectiveOptions HostOrdered(CollectiveOptions options) {
  options.stream.reset();
  return options;
}

// Enqueues a host<->device copy on the communicator's stream.
absl::Status CopyAsync(CommState& s, void* dst, const void* src, size_t bytes,
                       cudaMemcpyKind kind, absl::string_view context) {
  if (bytes == 0) return absl::OkStatus();
  return CudaStatus(
      *s.cuda, s.cuda->MemcpyAsync(dst, src, bytes, kind, s.stream->stream),
      absl::StrFormat("%s: cudaMemcpyAsync(%d bytes)", context, bytes));
}

// Grows the device scratch to `bytes`, stream-ordered (see CommState).
absl::Status EnsureDeviceScratch(CommState& s, size_t bytes,
                                 absl::string_view context) {
  if (bytes <= s.device_scratch_bytes) return absl::OkStatus();
  CudaRuntime& cuda = *s.cuda;
  if (s.device_scratch != nullptr) {
    void* old = s.device_scratch;
    s.device_scratch = nullptr;
    s.device_scratch_bytes = 0;
    FLATPARAM_RETURN_IF_ERROR(
        CudaStatus(cuda, cuda.FreeAsync(old, s.stream->stream),
                   absl::StrCat(context, ": cudaFreeAsync")));
  }
  const size_t grown = std::max<size_t>(bytes, 256);
  FLATPARAM_RETURN_IF_ERROR(CudaStatus(
      cuda, cuda.MallocAsync(&s.device_scratch, grown, s.stream->stream),
      absl::StrFormat("%s: cudaMallocAsync(%d)", context, grown)));
  s.device_scratch_bytes = grown;
  return absl::OkStatus();
}

// Grows the pinned host staging to `bytes`; the outgrown block is kept
// until destruction (see CommState).
absl::Status EnsureHostStaging(CommState& s, size_t bytes,
                               absl::string_view context) {
  if (bytes <= s.host_staging_bytes) return absl::OkStatus();
  CudaRuntime& cuda = *s.cuda;
  const size_t grown = std::max<size_t>({bytes, 2 * s.host_staging_bytes, 256});
  void* p = nullptr;
  FLATPARAM_RETURN_IF_ERROR(
      CudaStatus(cuda, cuda.MallocHost(&p, grown),
                 absl::StrFormat("%s: cudaMallocHost(%d)", context, grown)));
  if (s.host_staging != nullptr) s.retired_staging.push_back(s.host_staging);
  s.host_staging = p;
  s.host_staging_bytes = grown;
  return absl::OkStatus();
}

// Blocks until everything enqueued so far on the stream has finished.
absl::Status AwaitStream(CommState& s, absl::Time deadline,
                         absl::Duration timeout, absl::string_view context) {
  CudaRuntime& cuda = *s.cuda;
  cudaEvent_t event = nullptr;
  FLATPARAM_RETURN_IF_ERROR(CudaStatus(
      cuda, cuda.EventCreateWithFlags(&event, cudaEventDisableTiming),
      absl::StrCat(context, ": cudaEventCreateWithFlags")));
  absl::Status st = CudaStatus(cuda, cuda.EventRecord(event, s.stream->stream),
                               absl::StrCat(context, ": cudaEventRecord"));
  if (st.ok()) st = AwaitEvent(s, event, deadline, timeout, context);
  cuda.EventDestroy(event);
  return st;
}

}  // namespace

absl::StatusOr<std::vector<std::string>> NcclCommunicator::AllGatherBytes(
    absl::string_view bytes, const CollectiveOptions& options) {
  const absl::Time deadline = absl::Now() + options.timeout;
  CommState& s = *state_;
  NcclApi& api = *s.api;
  CudaRuntime& cuda = *s.cuda;
  const int64_t seq = seq_++;
  const std::string context =
      absl::StrFormat("rank %d: all_gather_bytes #%d (%d bytes on cuda:%d)",
                      s.rank, seq, bytes.size(), s.device);
  if (s.aborted) return AbortedError(s, context);
  auto run = [&]() -> absl::StatusOr<std::vector<std::string>> {
    CudaDeviceGuard guard(cuda);
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
  CudaRuntime& cuda = *s.cuda;
  const int64_t seq = seq_++;
  const std::string context =
      absl::StrFormat("rank %d: barrier #%d on cuda:%d", s.rank, seq, s.device);
  if (s.aborted) return AbortedError(s, context);
  auto run = [&]() -> absl::Status {
    CudaDeviceGuard guard(cuda);
    FLATPARAM_RETURN_IF_ERROR(guard.Set(s.device, context));
    FLATPARAM_RETURN_IF_ERROR(EnsureDeviceScratch(s, sizeof(float), context));
    FLATPARAM_RETURN_IF_ERROR(CudaStatus(
        cuda,
        cuda.MemsetAsync(s.device_scratch, 0, sizeof(float), s.stream->stream),
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

}  // namespace flatparam
