// FakeNcclOnCuda: NCCL for several ranks in one process on FakeCudaRuntime's
// devices (test-only), so that CudaDeviceOps and NcclCommunicator run
// together in CI without a GPU: the handle, runtime and training suites at
// several ranks, each rank a thread with its own fake device.
//
// Model, from NCCL's documentation:
// - Communicators rendezvous by ncclUniqueId; initialization completes once
//   every rank has joined (non-blocking communicators report ncclInProgress
//   until then). Two ranks of one communicator on one device are refused
//   (ncclInvalidUsage), as NCCL refuses duplicate GPUs.
// - A collective is enqueued on the caller's stream and runs when the
//   stream reaches it; it then waits for the same collective (by sequence
//   number) of every rank, and the last to arrive moves the data for all.
//   Ranks that issue different collectives, counts or dtypes at the same
//   sequence number hang, as on GPUs, until the communicator is aborted
//   (the caller's timeout); misuse() records the mismatch.
// - Reductions fold the ranks in rank order, rounding to the dtype after
//   every operation (float16 and bfloat16 computed in float32); a
//   pre-multiplied sum multiplies each rank's input by that rank's own
//   scalar first. ncclAvg on floating-point types is what NCCL makes of it:
//   a pre-multiplied sum by 1/n converted to the dtype (through float32),
//   which differs in its bits from a sum divided by n once n >= 3.
// - Send and receive buffers may overlap only in place as NCCL documents it
//   (all-gather: sendbuff == recvbuff + rank * sendcount; reduce-scatter:
//   recvbuff == sendbuff + rank * recvcount; all-reduce and broadcast:
//   equal); any other overlap is refused (ncclInvalidArgument) and recorded.
// - ncclCommFinalize completes only when every rank has finalized (global
//   quiescence): a peer that aborted or never finalizes keeps it
//   ncclInProgress. A collective issued after ncclCommFinalize, and an
//   ncclCommDestroy before the finalize has completed, are refused
//   (ncclInvalidUsage) and recorded, as NCCL's documentation forbids both.
//   SetAsyncError makes every communicator report a sticky asynchronous
//   error.
// - It makes no CUDA calls of its own: the communicator's CUDA runtime is
//   the FakeCudaRuntime itself, as in
//
//     FakeCudaRuntime::Options options;
//     options.device_count = 2;
//     FakeCudaRuntime cuda(options);
//     FakeNcclOnCuda nccl(cuda);
//     // On rank r's thread:
//     auto comm = NcclCommunicator::Create(nccl, cuda, bootstrap, r);
//
// Thread-safety: thread-safe; the state is kept under FakeCudaRuntime's
// lock. Destroy the FakeCudaRuntime first: it drains its streams, which may
// still run this fake's collectives (they give up once it shuts down); the
// fake must not be used after that.
#ifndef FLATPARAM_DEVICE_CUDA_FAKE_NCCL_ON_CUDA_H_
#define FLATPARAM_DEVICE_CUDA_FAKE_NCCL_ON_CUDA_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "comm/nccl/nccl_api.h"
#include "flatparam/device/cuda/fake_cuda_runtime.h"

namespace flatparam {

class FakeNcclOnCuda final : public NcclApi {
 public:
  explicit FakeNcclOnCuda(FakeCudaRuntime& cuda);
  ~FakeNcclOnCuda() override;
  FakeNcclOnCuda(const FakeNcclOnCuda&) = delete;
  FakeNcclOnCuda& operator=(const FakeNcclOnCuda&) = delete;

  // From now on every communicator reports `error` asynchronously.
  void SetAsyncError(ncclResult_t error);
  // What the real library would punish; empty when the code behaved.
  std::vector<std::string> misuse() const;
  // Collectives that completed, over all ranks.
  int64_t collectives_completed() const;
  // Communicators released with ncclCommDestroy / ncclCommAbort.
  int comms_destroyed() const;
  int comms_aborted() const;

  // NCCL.
  ncclResult_t GetVersion(int* version) override;
  ncclResult_t GetUniqueId(ncclUniqueId* id) override;
  ncclResult_t CommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId id,
                                  int rank, ncclConfig_t* config) override;
  ncclResult_t CommSplit(ncclComm_t comm, int color, int key,
                         ncclComm_t* newcomm, ncclConfig_t* config) override;
  ncclResult_t CommFinalize(ncclComm_t comm) override;
  ncclResult_t CommDestroy(ncclComm_t comm) override;
  ncclResult_t CommAbort(ncclComm_t comm) override;
  ncclResult_t CommGetAsyncError(ncclComm_t comm,
                                 ncclResult_t* async_error) override;
  ncclResult_t CommCount(ncclComm_t comm, int* count) override;
  ncclResult_t CommUserRank(ncclComm_t comm, int* rank) override;
  ncclResult_t CommCuDevice(ncclComm_t comm, int* device) override;
  ncclResult_t RedOpCreatePreMulSum(ncclRedOp_t* op, void* scalar,
                                    ncclDataType_t datatype,
                                    ncclScalarResidence_t residence,
                                    ncclComm_t comm) override;
  ncclResult_t RedOpDestroy(ncclRedOp_t op, ncclComm_t comm) override;
  ncclResult_t AllGather(const void* sendbuff, void* recvbuff, size_t sendcount,
                         ncclDataType_t datatype, ncclComm_t comm,
                         cudaStream_t stream) override;
  ncclResult_t ReduceScatter(const void* sendbuff, void* recvbuff,
                             size_t recvcount, ncclDataType_t datatype,
                             ncclRedOp_t op, ncclComm_t comm,
                             cudaStream_t stream) override;
  ncclResult_t AllReduce(const void* sendbuff, void* recvbuff, size_t count,
                         ncclDataType_t datatype, ncclRedOp_t op,
                         ncclComm_t comm, cudaStream_t stream) override;
  ncclResult_t Broadcast(const void* sendbuff, void* recvbuff, size_t count,
                         ncclDataType_t datatype, int root, ncclComm_t comm,
                         cudaStream_t stream) override;
  const char* GetErrorString(ncclResult_t result) override;
  const char* GetLastError(ncclComm_t comm) override;

 private:
  struct Comm;
  struct Group;
  struct Part;
  struct Slot;
  struct SplitSlot;

  // The live communicator behind `comm`, or null (recording misuse).
  Comm* Live(ncclComm_t comm, const char* call);
  ncclResult_t Enqueue(const char* name, Part part, ncclComm_t comm,
                       cudaStream_t stream);
  void Arrive(Comm* comm, uint64_t seq, const Part& part);
  // Why `part`'s buffers overlap other than in place, or "".
  static std::string BadOverlap(const Part& part);
  void Execute(const std::vector<Part>& parts);

  FakeCudaRuntime& cuda_;
  // Guarded by cuda_'s lock (FakeCudaRuntime::Locked / WaitUntil).
  std::map<std::string, std::unique_ptr<Group>> groups_;
  std::vector<std::unique_ptr<Group>> split_groups_;
  std::vector<std::unique_ptr<Comm>> comms_;
  std::vector<std::string> misuse_;
  ncclResult_t async_error_ = ncclSuccess;
  int64_t next_id_ = 0;
  int64_t completed_ = 0;
};

}  // namespace flatparam

#endif  // FLATPARAM_DEVICE_CUDA_FAKE_NCCL_ON_CUDA_H_
