// NcclApi: the NCCL calls the NCCL backend makes, behind an interface, so
// that the backend's logic (argument checks, dtype and op mapping, divide
// factors, completion and timeout handling, aborts, error mapping) is
// unit-tested on machines without a GPU against a fake (fake_nccl_api.h), as
// c10d's and LevelDB's Env-style seams do. Its CUDA runtime calls go through
// CudaRuntime (flatparam/device/cuda/cuda_runtime.h), the interface
// CudaDeviceOps uses too.
//
// Each method forwards to the libnccl function of the same name
// (`AllReduce` -> ncclAllReduce) with the same arguments and result code;
// the real implementation (RealNcclApi) adds nothing. The backend checks
// every result through exactly two functions: NcclStatus() below and
// CudaStatus() (cuda_runtime.h).
//
//   ncclComm_t comm = ...;
//   NcclApi& nccl = RealNcclApi();
//   int count = 0;
//   RETURN_IF_ERROR(NcclStatus(nccl, nccl.CommCount(comm, &count), comm,
//                              "rank 0: ncclCommCount"));
//
// Only targets built where cuda_configure found NCCL (`HAVE_NCCL`) may
// include this header: it includes <nccl.h> and <cuda_runtime_api.h> (for
// cudaStream_t).
//
// Thread-safety: RealNcclApi() is as thread-safe as NCCL is (NCCL calls on
// one communicator from one thread at a time).
#ifndef FLATPARAM_COMM_NCCL_NCCL_API_H_
#define FLATPARAM_COMM_NCCL_NCCL_API_H_

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstddef>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "flatparam/base/dtype.h"

namespace flatparam {

class NcclApi {
 public:
  virtual ~NcclApi() = default;

  // NCCL (nccl.h).
  virtual ncclResult_t GetVersion(int* version) = 0;
  virtual ncclResult_t GetUniqueId(ncclUniqueId* id) = 0;
  virtual ncclResult_t CommInitRankConfig(ncclComm_t* comm, int nranks,
                                          ncclUniqueId id, int rank,
                                          ncclConfig_t* config) = 0;
  virtual ncclResult_t CommSplit(ncclComm_t comm, int color, int key,
                                 ncclComm_t* newcomm, ncclConfig_t* config) = 0;
  virtual ncclResult_t CommFinalize(ncclComm_t comm) = 0;
  virtual ncclResult_t CommDestroy(ncclComm_t comm) = 0;
  virtual ncclResult_t CommAbort(ncclComm_t comm) = 0;
  virtual ncclResult_t CommGetAsyncError(ncclComm_t comm,
                                         ncclResult_t* async_error) = 0;
  virtual ncclResult_t CommCount(ncclComm_t comm, int* count) = 0;
  virtual ncclResult_t CommUserRank(ncclComm_t comm, int* rank) = 0;
  virtual ncclResult_t CommCuDevice(ncclComm_t comm, int* device) = 0;
  virtual ncclResult_t RedOpCreatePreMulSum(ncclRedOp_t* op, void* scalar,
                                            ncclDataType_t datatype,
                                            ncclScalarResidence_t residence,
                                            ncclComm_t comm) = 0;
  virtual ncclResult_t RedOpDestroy(ncclRedOp_t op, ncclComm_t comm) = 0;
  virtual ncclResult_t AllGather(const void* sendbuff, void* recvbuff,
                                 size_t sendcount, ncclDataType_t datatype,
                                 ncclComm_t comm, cudaStream_t stream) = 0;
  virtual ncclResult_t ReduceScatter(const void* sendbuff, void* recvbuff,
                                     size_t recvcount, ncclDataType_t datatype,
                                     ncclRedOp_t op, ncclComm_t comm,
                                     cudaStream_t stream) = 0;
  virtual ncclResult_t AllReduce(const void* sendbuff, void* recvbuff,
                                 size_t count, ncclDataType_t datatype,
                                 ncclRedOp_t op, ncclComm_t comm,
                                 cudaStream_t stream) = 0;
  virtual ncclResult_t Broadcast(const void* sendbuff, void* recvbuff,
                                 size_t count, ncclDataType_t datatype,
                                 int root, ncclComm_t comm,
                                 cudaStream_t stream) = 0;
  virtual const char* GetErrorString(ncclResult_t result) = 0;
  virtual const char* GetLastError(ncclComm_t comm) = 0;
};

// The process-wide implementation that calls libnccl. Never
// destroyed.
NcclApi& RealNcclApi();

// The one place an ncclResult_t becomes a Status. OK for ncclSuccess;
// otherwise "<context>: NCCL <name> (<code>): <ncclGetErrorString>; last
// NCCL error: <ncclGetLastError(comm)>" with a code that says what to do:
//   ncclInvalidArgument -> InvalidArgument, ncclInvalidUsage ->
//   FailedPrecondition, ncclRemoteError -> Aborted (a peer failed),
//   ncclSystemError -> Unavailable (network or OS), ncclInProgress ->
//   Unavailable (still in progress), ncclUnhandledCudaError and
//   ncclInternalError -> Internal.
// `context` names the rank, the op, its sequence number and sizes. `comm`
// may be null (the last error is then NCCL's process-wide one).
absl::Status NcclStatus(NcclApi& api, ncclResult_t result, ncclComm_t comm,
                        absl::string_view context);

// The bytes of one element of `datatype` (the fp8 types: 1).
size_t NcclElementSize(ncclDataType_t datatype);

// The flatparam dtype of a floating-point NCCL type (float32, float64,
// float16, bfloat16), for arithmetic on it; false for the others.
bool NcclFloatDType(ncclDataType_t datatype, DType* dtype);

}  // namespace flatparam

#endif  // FLATPARAM_COMM_NCCL_NCCL_API_H_
