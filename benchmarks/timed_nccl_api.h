// TimedNcclApi: an NcclApi (comm/nccl/nccl_api.h) that forwards every call
// to another one (normally RealNcclApi()) and, once armed, brackets the next
// collective call (AllGather, ReduceScatter, AllReduce or Broadcast) with two
// CUDA events recorded on that collective's stream immediately before and
// after the NCCL call (after its enqueue has completed, for a non-blocking
// communicator), as nccl-tests does. The benchmarks time a
// Communicator's collective with it: the argument checks, pointer-attribute
// queries, event creation and stream waits that NcclCommunicator does on the
// host before and after the NCCL call fall outside the two events, so the
// elapsed time is the collective's on the GPU (plus NCCL's own enqueue,
// which nccl-tests also counts).
//
//   TimedNcclApi api(RealNcclApi(), RealCudaRuntime());
//   ASSIGN_OR_RETURN(auto comm, NcclCommunicator::Create(
//                                   api, RealCudaRuntime(), bootstrap, 0));
//   RETURN_IF_ERROR(api.Arm(comm->device()));
//   std::unique_ptr<Work> work = comm->AllGather(in, out, {});
//   RETURN_IF_ERROR(work->Wait());
//   ASSIGN_OR_RETURN(double seconds, api.ElapsedSeconds());
//
// Memory: owns its two events (made through `cuda` by Arm on the
// collective's device, destroyed with the object); `inner` and `cuda` must
// outlive it, and it must outlive every communicator that uses it.
// ElapsedSeconds reads the events with libcudart's cudaEventElapsedTime
// (CudaRuntime has no timing call): `cuda` must be the real runtime there.
//
// Thread-safety: one thread, like the communicator using it.
#ifndef FLATPARAM_BENCHMARKS_TIMED_NCCL_API_H_
#define FLATPARAM_BENCHMARKS_TIMED_NCCL_API_H_

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstddef>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "benchmarks/internal/event_bracket.h"
#include "comm/nccl/nccl_api.h"
#include "flatparam/device/cuda/cuda_runtime.h"

namespace flatparam {
namespace bench {

class TimedNcclApi final : public NcclApi {
 public:
  TimedNcclApi(NcclApi& inner, CudaRuntime& cuda)
      : inner_(inner), bracket_(cuda, "TimedNcclApi", "collective") {}

  TimedNcclApi(const TimedNcclApi&) = delete;
  TimedNcclApi& operator=(const TimedNcclApi&) = delete;

  // Brackets the next collective call with the events. `device`: the CUDA
  // device of the communicator that will issue it (the events are created
  // there once). FailedPrecondition if a collective is still armed.
  absl::Status Arm(int device) { return bracket_.Arm(device); }

  // Seconds between the two events of the last armed collective, waiting for
  // the second one (cudaEventSynchronize). FailedPrecondition if no armed
  // collective was issued since Arm(); the CUDA error if recording failed.
  absl::StatusOr<double> ElapsedSeconds() { return bracket_.ElapsedSeconds(); }

  ncclResult_t GetVersion(int* version) override {
    return inner_.GetVersion(version);
  }
  ncclResult_t GetUniqueId(ncclUniqueId* id) override {
    return inner_.GetUniqueId(id);
  }
  ncclResult_t CommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId id,
                                  int rank, ncclConfig_t* config) override {
    return inner_.CommInitRankConfig(comm, nranks, id, rank, config);
  }
  ncclResult_t CommSplit(ncclComm_t comm, int color, int key,
                         ncclComm_t* newcomm, ncclConfig_t* config) override {
    return inner_.CommSplit(comm, color, key, newcomm, config);
  }
  ncclResult_t CommFinalize(ncclComm_t comm) override {
    return inner_.CommFinalize(comm);
  }
  ncclResult_t CommDestroy(ncclComm_t comm) override {
    return inner_.CommDestroy(comm);
  }
  ncclResult_t CommAbort(ncclComm_t comm) override {
    return inner_.CommAbort(comm);
  }
  ncclResult_t CommGetAsyncError(ncclComm_t comm,
                                 ncclResult_t* async_error) override {
    return inner_.CommGetAsyncError(comm, async_error);
  }
  ncclResult_t CommCount(ncclComm_t comm, int* count) override {
    return inner_.CommCount(comm, count);
  }
  ncclResult_t CommUserRank(ncclComm_t comm, int* rank) override {
    return inner_.CommUserRank(comm, rank);
  }
  ncclResult_t CommCuDevice(ncclComm_t comm, int* device) override {
    return inner_.CommCuDevice(comm, device);
  }
  ncclResult_t RedOpCreatePreMulSum(ncclRedOp_t* op, void* scalar,
                                    ncclDataType_t datatype,
                                    ncclScalarResidence_t residence,
                                    ncclComm_t comm) override {
    return inner_.RedOpCreatePreMulSum(op, scalar, datatype, residence, comm);
  }
  ncclResult_t RedOpDestroy(ncclRedOp_t op, ncclComm_t comm) override {
    return inner_.RedOpDestroy(op, comm);
  }
  ncclResult_t AllGather(const void* sendbuff, void* recvbuff, size_t sendcount,
                         ncclDataType_t datatype, ncclComm_t comm,
                         cudaStream_t stream) override {
    return Timed(stream, comm, [&] {
      return inner_.AllGather(sendbuff, recvbuff, sendcount, datatype, comm,
                              stream);
    });
  }
  ncclResult_t ReduceScatter(const void* sendbuff, void* recvbuff,
                             size_t recvcount, ncclDataType_t datatype,
                             ncclRedOp_t op, ncclComm_t comm,
                             cudaStream_t stream) override {
    return Timed(stream, comm, [&] {
      return inner_.ReduceScatter(sendbuff, recvbuff, recvcount, datatype, op,
                                  comm, stream);
    });
  }
  ncclResult_t AllReduce(const void* sendbuff, void* recvbuff, size_t count,
                         ncclDataType_t datatype, ncclRedOp_t op,
                         ncclComm_t comm, cudaStream_t stream) override {
    return Timed(stream, comm, [&] {
      return inner_.AllReduce(sendbuff, recvbuff, count, datatype, op, comm,
                              stream);
    });
  }
  ncclResult_t Broadcast(const void* sendbuff, void* recvbuff, size_t count,
                         ncclDataType_t datatype, int root, ncclComm_t comm,
                         cudaStream_t stream) override {
    return Timed(stream, comm, [&] {
      return inner_.Broadcast(sendbuff, recvbuff, count, datatype, root, comm,
                              stream);
    });
  }
  const char* GetErrorString(ncclResult_t result) override {
    return inner_.GetErrorString(result);
  }
  const char* GetLastError(ncclComm_t comm) override {
    return inner_.GetLastError(comm);
  }

 private:
  // Runs `call` (one NCCL collective on `comm` and `stream`), bracketed by
  // the events when armed, then disarms. When a non-blocking communicator
  // returns ncclInProgress, the collective may not be on the stream yet:
  // the stop event is recorded once ncclCommGetAsyncError no longer says
  // ncclInProgress (at most 60 s).
  ncclResult_t Timed(cudaStream_t stream, ncclComm_t comm,
                     absl::FunctionRef<ncclResult_t()> call);

  NcclApi& inner_;
  EventBracket bracket_;
};

}  // namespace bench
}  // namespace flatparam

#endif  // FLATPARAM_BENCHMARKS_TIMED_NCCL_API_H_
