#include "comm/nccl/nccl_api.h"

#include "absl/strings/str_format.h"

namespace flatparam {
namespace {

class RealApi final : public NcclApi {
 public:
  ncclResult_t GetVersion(int* version) override {
    return ncclGetVersion(version);
  }
  ncclResult_t GetUniqueId(ncclUniqueId* id) override {
    return ncclGetUniqueId(id);
  }
  ncclResult_t CommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId id,
                                  int rank, ncclConfig_t* config) override {
    return ncclCommInitRankConfig(comm, nranks, id, rank, config);
  }
  ncclResult_t CommSplit(ncclComm_t comm, int color, int key,
                         ncclComm_t* newcomm, ncclConfig_t* config) override {
    return ncclCommSplit(comm, color, key, newcomm, config);
  }
  ncclResult_t CommFinalize(ncclComm_t comm) override {
    return ncclCommFinalize(comm);
  }
  ncclResult_t CommDestroy(ncclComm_t comm) override {
    return ncclCommDestroy(comm);
  }
  ncclResult_t CommAbort(ncclComm_t comm) override {
    return ncclCommAbort(comm);
  }
  ncclResult_t CommGetAsyncError(ncclComm_t comm,
                                 ncclResult_t* async_error) override {
    return ncclCommGetAsyncError(comm, async_error);
  }
  ncclResult_t CommCount(ncclComm_t comm, int* count) override {
    return ncclCommCount(comm, count);
  }
  ncclResult_t CommUserRank(ncclComm_t comm, int* rank) override {
    return ncclCommUserRank(comm, rank);
  }
  ncclResult_t CommCuDevice(ncclComm_t comm, int* device) override {
    return ncclCommCuDevice(comm, device);
  }
  ncclResult_t RedOpCreatePreMulSum(ncclRedOp_t* op, void* scalar,
                                    ncclDataType_t datatype,
                                    ncclScalarResidence_t residence,
                                    ncclComm_t comm) override {
    return ncclRedOpCreatePreMulSum(op, scalar, datatype, residence, comm);
  }
  ncclResult_t RedOpDestroy(ncclRedOp_t op, ncclComm_t comm) override {
    return ncclRedOpDestroy(op, comm);
  }
  ncclResult_t AllGather(const void* sendbuff, void* recvbuff, size_t sendcount,
                         ncclDataType_t datatype, ncclComm_t comm,
                         cudaStream_t stream) override {
    return ncclAllGather(sendbuff, recvbuff, sendcount, datatype, comm, stream);
  }
  ncclResult_t ReduceScatter(const void* sendbuff, void* recvbuff,
                             size_t recvcount, ncclDataType_t datatype,
                             ncclRedOp_t op, ncclComm_t comm,
                             cudaStream_t stream) override {
    return ncclReduceScatter(sendbuff, recvbuff, recvcount, datatype, op, comm,
                             stream);
  }
  ncclResult_t AllReduce(const void* sendbuff, void* recvbuff, size_t count,
                         ncclDataType_t datatype, ncclRedOp_t op,
                         ncclComm_t comm, cudaStream_t stream) override {
    return ncclAllReduce(sendbuff, recvbuff, count, datatype, op, comm, stream);
  }
  ncclResult_t Broadcast(const void* sendbuff, void* recvbuff, size_t count,
                         ncclDataType_t datatype, int root, ncclComm_t comm,
                         cudaStream_t stream) override {
    return ncclBroadcast(sendbuff, recvbuff, count, datatype, root, comm,
                         stream);
  }
  const char* GetErrorString(ncclResult_t result) override {
    return ncclGetErrorString(result);
  }
  const char* GetLastError(ncclComm_t comm) override {
    return ncclGetLastError(comm);
  }
};

const char* NcclResultName(ncclResult_t result) {
  switch (result) {
    case ncclSuccess:
      return "ncclSuccess";
    case ncclUnhandledCudaError:
      return "ncclUnhandledCudaError";
    case ncclSystemError:
      return "ncclSystemError";
    case ncclInternalError:
      return "ncclInternalError";
    case ncclInvalidArgument:
      return "ncclInvalidArgument";
    case ncclInvalidUsage:
      return "ncclInvalidUsage";
    case ncclRemoteError:
      return "ncclRemoteError";
    case ncclInProgress:
      return "ncclInProgress";
    default:
      return "unknown ncclResult_t";
  }
}

absl::StatusCode NcclCode(ncclResult_t result) {
  switch (result) {
    case ncclSuccess:
      return absl::StatusCode::kOk;
    case ncclInvalidArgument:
      return absl::StatusCode::kInvalidArgument;
    case ncclInvalidUsage:
      return absl::StatusCode::kFailedPrecondition;
    case ncclRemoteError:
      return absl::StatusCode::kAborted;
    case ncclSystemError:
    case ncclInProgress:
      return absl::StatusCode::kUnavailable;
    default:
      return absl::StatusCode::kInternal;
  }
}

const char* OrEmpty(const char* s) { return s == nullptr ? "" : s; }

}  // namespace

NcclApi& RealNcclApi() {
  static NcclApi* const api = new RealApi;
  return *api;
}

absl::Status NcclStatus(NcclApi& api, ncclResult_t result, ncclComm_t comm,
                        absl::string_view context) {
  if (result == ncclSuccess) return absl::OkStatus();
  return absl::Status(
      NcclCode(result),
      absl::StrFormat("%s: NCCL %s (%d): %s; last NCCL error: %s", context,
                      NcclResultName(result), static_cast<int>(result),
                      OrEmpty(api.GetErrorString(result)),
                      OrEmpty(api.GetLastError(comm))));
}

size_t NcclElementSize(ncclDataType_t datatype) {
  switch (datatype) {
    case ncclInt8:
    case ncclUint8:
    case ncclFloat8e4m3:
    case ncclFloat8e5m2:
      return 1;
    case ncclFloat16:
    case ncclBfloat16:
      return 2;
    case ncclInt32:
    case ncclUint32:
    case ncclFloat32:
      return 4;
    default:
      return 8;
  }
}

bool NcclFloatDType(ncclDataType_t datatype, DType* dtype) {
  switch (datatype) {
    case ncclFloat32:
      *dtype = DType::kFloat32;
      return true;
    case ncclFloat64:
      *dtype = DType::kFloat64;
      return true;
    case ncclFloat16:
      *dtype = DType::kFloat16;
      return true;
    case ncclBfloat16:
      *dtype = DType::kBFloat16;
      return true;
    default:
      return false;
  }
}

}  // namespace flatparam
