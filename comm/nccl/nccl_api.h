// NcclApi: the NCCL and CUDA runtime calls the NCCL backend makes, behind an
// interface, so that the backend's logic (argument checks, dtype and op
// mapping, divide factors, completion and timeout handling, aborts, error
// mapping) is unit-tested on machines without a GPU against a fake
// (fake_nccl_api.h), as c10d's and LevelDB's Env-style seams do.
//
// Each method forwards to the function of the same name in libnccl
// (`AllReduce` -> ncclAllReduce) or libcudart (`CudaEventQuery` ->
// cudaEventQuery) with the same arguments and result code; the real
// implementation (RealNcclApi) adds nothing. The backend checks every result
// through exactly two functions, NcclStatus() and CudaStatus(), below.
//
// Only targets built where cuda_configure found NCCL (`HAVE_NCCL`) may
// include this header: it includes <nccl.h> and <cuda_runtime_api.h>.
//
// Thread-safety: RealNcclApi() is as thread-safe as NCCL and the CUDA runtime
// are (NCCL calls on one communicator from one thread at a time).
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

  // CUDA runtime (cuda_runtime_api.h).
  virtual cudaError_t CudaGetLastError() = 0;
  virtual cudaError_t CudaPeekAtLastError() = 0;
  virtual cudaError_t CudaGetDeviceCount(int* count) = 0;
  virtual cudaError_t CudaGetDevice(int* device) = 0;
  virtual cudaError_t CudaSetDevice(int device) = 0;
  virtual cudaError_t CudaStreamCreateWithFlags(cudaStream_t* stream,
                                                unsigned int flags) = 0;
  virtual cudaError_t CudaStreamDestroy(cudaStream_t stream) = 0;
  virtual cudaError_t CudaEventCreateWithFlags(cudaEvent_t* event,
                                               unsigned int flags) = 0;
  virtual cudaError_t CudaEventRecord(cudaEvent_t event,
                                      cudaStream_t stream) = 0;
  virtual cudaError_t CudaEventQuery(cudaEvent_t event) = 0;
  virtual cudaError_t CudaStreamWaitEvent(cudaStream_t stream,
                                          cudaEvent_t event,
                                          unsigned int flags) = 0;
  virtual cudaError_t CudaEventDestroy(cudaEvent_t event) = 0;
  virtual cudaError_t CudaPointerGetAttributes(
      cudaPointerAttributes* attributes, const void* ptr) = 0;
  virtual cudaError_t CudaMalloc(void** ptr, size_t bytes) = 0;
  virtual cudaError_t CudaFree(void* ptr) = 0;
  virtual cudaError_t CudaMallocAsync(void** ptr, size_t bytes,
                                      cudaStream_t stream) = 0;
  virtual cudaError_t CudaFreeAsync(void* ptr, cudaStream_t stream) = 0;
  virtual cudaError_t CudaMallocHost(void** ptr, size_t bytes) = 0;
  virtual cudaError_t CudaFreeHost(void* ptr) = 0;
  virtual cudaError_t CudaMemsetAsync(void* dst, int value, size_t bytes,
                                      cudaStream_t stream) = 0;
  virtual cudaError_t CudaMemcpyAsync(void* dst, const void* src, size_t bytes,
                                      cudaMemcpyKind kind,
                                      cudaStream_t stream) = 0;
  virtual const char* CudaGetErrorName(cudaError_t error) = 0;
  virtual const char* CudaGetErrorString(cudaError_t error) = 0;
};

// The process-wide implementation that calls libnccl and libcudart. Never
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

// The one place a cudaError_t becomes a Status. OK for cudaSuccess;
// otherwise "<context>: CUDA <cudaGetErrorName> (<code>):
// <cudaGetErrorString>", with FailedPrecondition when there is no usable
// GPU or driver, InvalidArgument for invalid values, devices and pointers,
// ResourceExhausted when out of memory, and Internal otherwise (sticky
// errors such as an illegal address leave the CUDA context unusable).
// A reported error is cleared from the thread's last-error state
// (cudaGetLastError), so that the next kernel launch on the thread, which
// reports cudaGetLastError(), does not report it again as its own.
absl::Status CudaStatus(NcclApi& api, cudaError_t error,
                        absl::string_view context);

// The bytes of one element of `datatype` (the fp8 types: 1).
size_t NcclElementSize(ncclDataType_t datatype);

// The flatparam dtype of a floating-point NCCL type (float32, float64,
// float16, bfloat16), for arithmetic on it; false for the others.
bool NcclFloatDType(ncclDataType_t datatype, DType* dtype);

}  // namespace flatparam

#endif  // FLATPARAM_COMM_NCCL_NCCL_API_H_
