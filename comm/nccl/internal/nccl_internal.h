// Private to //comm/nccl:nccl_communicator: what the implementation files of
// the NCCL backend share besides nccl_communicator.h. They are
//   nccl_communicator.cc  NcclCommunicator's creation (Create, Wrap, the
//                         sub-groups of Split), its teardown
//                         (~CommState) and accessors;
//   nccl_collectives.cc   the data collectives (AllGather, ReduceScatter,
//                         AllReduce, Broadcast) and their argument checks;
//   nccl_work.cc          issuing a collective (Issue) and its Work:
//                         waiting on events and on ncclInProgress,
//                         timeouts, failure bookkeeping and aborts;
//   nccl_scratch.cc       the host-blocking collectives (AllGatherBytes,
//                         Barrier) and the scratch buffers they use.
//
// How they fit. A collective checks its arguments, then calls Issue(),
// which orders the communicator's stream after the caller's (when asked),
// enqueues the NCCL call there and returns an NcclWork waiting on an event
// recorded after it. Every wait (AwaitEvent, PollComm) polls with a
// deadline; a timeout or an asynchronous error aborts the communicator
// (AbortState), after which every call returns AbortedError(). Failed()
// notes each failed operation, per communicator and per process, so that
// destruction aborts instead of finalizing after a failure.
//
// Ownership: a CommState is shared by its NcclCommunicator and every Work
// it issued (the ncclComm_t is released when the last is gone); a
// StreamHandle by a communicator and the communicators split from it.
// Thread-safety: one thread at a time per communicator and its Work, like
// the NCCL communicator itself (Communicator's contract); the process-wide
// failure count (ProcessFailures) is atomic.
#ifndef FLATPARAM_COMM_NCCL_INTERNAL_NCCL_INTERNAL_H_
#define FLATPARAM_COMM_NCCL_INTERNAL_NCCL_INTERNAL_H_

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "comm/communicator.h"
#include "comm/nccl/nccl_api.h"
#include "comm/nccl/nccl_options.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/device/cuda/cuda_runtime.h"

namespace flatparam {
namespace internal_nccl {

// A CUDA stream shared by a communicator and the communicators split from
// it, so that their collectives stay in issue order.
struct StreamHandle {
  CudaRuntime* cuda = nullptr;
  cudaStream_t stream = nullptr;
  bool owned = false;

  ~StreamHandle() {
    if (owned) cuda->StreamDestroy(stream);
  }
};

// Everything a communicator and its outstanding Work share. Invariant: once
// `aborted`, `comm` is null and `abort_status` holds the first error.
struct CommState {
  NcclApi* api = nullptr;
  CudaRuntime* cuda = nullptr;
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

// Failure and waiting (nccl_work.cc).

// What a call on an aborted communicator returns: Aborted, quoting the error
// that aborted it.
absl::Status AbortedError(const CommState& s, absl::string_view context);

// How many NCCL communicators of this process have failed so far. A
// communicator made before another one failed aborts at destruction instead
// of finalizing: ncclCommFinalize completes only once every rank finalizes,
// which the failed group's peers (and, through them, this group's) may
// never do.
int64_t ProcessFailures();

// Records that an operation failed with `status` (not OK) and returns it.
absl::Status Failed(CommState& s, absl::Status status);

// Aborts the communicator because of `reason` and returns `reason`, noting
// the abort. NCCL requires an abort after an asynchronous error or a hang.
absl::Status AbortState(CommState& s, absl::Status reason);

// Waits until `comm` has left ncclInProgress (a non-blocking communicator
// finishing initialization, a split or the enqueueing of a collective), and
// returns its asynchronous error state.
absl::Status PollComm(NcclApi& api, ncclComm_t comm, absl::Time deadline,
                      absl::Duration timeout, absl::string_view context);

// Blocks until `event` has completed, the communicator reports an
// asynchronous error, or `deadline`; aborts the communicator on failure.
absl::Status AwaitEvent(CommState& s, cudaEvent_t event, absl::Time deadline,
                        absl::Duration timeout, absl::string_view context);

// Issuing a collective (nccl_work.cc).

// How a reduction runs in NCCL: a built-in operator, or a pre-multiplied
// sum with `scalar` (one element of `dtype`) for divide factors.
struct ResolvedOp {
  ncclRedOp_t builtin = ncclSum;
  bool premul = false;
  ncclDataType_t dtype = ncclFloat32;
  alignas(8) unsigned char scalar[8] = {};
};

using NcclCall = absl::FunctionRef<ncclResult_t(
    ncclComm_t comm, cudaStream_t stream, ncclRedOp_t op)>;

// Enqueues `call` on the communicator's stream (creating and destroying a
// pre-multiplied sum operator around it when `op` asks for one) and returns
// a Work that waits for it.
std::unique_ptr<Work> Issue(const std::shared_ptr<CommState>& state,
                            const std::string& context, absl::Time deadline,
                            const CollectiveOptions& options,
                            const ResolvedOp* op, NcclCall call);

}  // namespace internal_nccl
}  // namespace flatparam

#endif  // FLATPARAM_COMM_NCCL_INTERNAL_NCCL_INTERNAL_H_
