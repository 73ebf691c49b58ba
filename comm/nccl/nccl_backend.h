// The NCCL backend's entry point: a Communicator (comm/communicator.h) that
// runs every collective with NCCL on CUDA device buffers, one CUDA device per
// rank.
//
//   // Every rank, with any bootstrap group of the same ranks (MPI, ...):
//   FLATPARAM_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> nccl,
//                              CreateNcclCommunicator(*mpi, local_gpu));
//
// This header needs no CUDA headers and its target, //comm/nccl, is built
// everywhere. Where the build found no CUDA/NCCL installation,
// NcclBackendAvailable() is false and CreateNcclCommunicator() returns
// Unimplemented, so tools and benchmarks can depend on the backend
// unconditionally and report at run time why it is missing. Code that
// already has an `ncclComm_t`, wants its own CUDA stream, or wants to inject
// an NcclApi uses NcclCommunicator (nccl_communicator.h) instead, which only
// exists where NCCL was found.
//
// Thread-safety: the functions are thread-compatible; the communicators they
// return follow the Communicator contract (one thread at a time).
#ifndef FLATPARAM_COMM_NCCL_NCCL_BACKEND_H_
#define FLATPARAM_COMM_NCCL_NCCL_BACKEND_H_

#include <memory>

#include "absl/status/statusor.h"
#include "comm/communicator.h"
#include "comm/nccl/nccl_options.h"

namespace flatparam {

// Whether this build contains the NCCL backend (a CUDA installation with NCCL
// was found when the build was configured). Says nothing about GPUs.
bool NcclBackendAvailable();

// Collective over `bootstrap`: every rank of `bootstrap` calls it, each with
// its own CUDA device ordinal. Rank 0 creates an ncclUniqueId and shares it
// through `bootstrap.AllGatherBytes`; each rank then joins the NCCL
// communicator with the same rank and size as in `bootstrap`. Any
// bootstrap backend works (MPI, the simulator); it is not used afterwards
// and need not outlive the result.
//
// A rank's local failure is shared through the same exchange, so no rank
// hangs: the failing rank returns its own error (FailedPrecondition when
// there is no usable GPU or driver, InvalidArgument for a bad
// `cuda_device`) and every other rank returns Aborted naming it.
// Unimplemented when NcclBackendAvailable() is false; DeadlineExceeded
// after `options.setup_timeout`.
//
// The communicator enqueues its collectives on a CUDA stream of its own
// (cudaStreamNonBlocking) on `cuda_device`; see nccl_communicator.h for the
// ordering this implies.
absl::StatusOr<std::unique_ptr<Communicator>> CreateNcclCommunicator(
    Communicator& bootstrap, int cuda_device, const NcclOptions& options = {});

}  // namespace flatparam

#endif  // FLATPARAM_COMM_NCCL_NCCL_BACKEND_H_
