// FakeNcclApi: an in-memory NcclApi and CudaRuntime for testing the NCCL
// backend's call sequences without a GPU (test-only): one object behind both
// interfaces, since its NCCL calls check the CUDA state (streams, devices,
// memory) it keeps. Pass it as both:
//
//   FakeNcclApi fake(/*device_count=*/2);
//   auto comm = NcclCommunicator::Create(fake, fake, bootstrap, 0);
//   ...
//   EXPECT_THAT(fake.misuse(), IsEmpty());
//
// Its CUDA model is deliberately small and synchronous (work completes when
// issued, events after a set number of queries), so tests drive every wait
// and timeout step by step; FakeCudaRuntime (flatparam/device/cuda) is the
// asynchronous model on which CudaDeviceOps and FakeNcclOnCuda run.
//
// Model:
// - "Device memory" is host memory handed out by CudaMalloc, tagged with the
//   calling thread's current device; CudaPointerGetAttributes knows it, and
//   reports everything else as unregistered host memory.
// - Collectives run when they are called. The fake holds one rank of each
//   communicator; the other ranks are modelled as contributing zeros: an
//   all-gather fills their blocks with zeros, a reduction folds zeros into
//   this rank's values (sum: x, max: max(x, 0), avg: x / nranks, pre-mul
//   sum: x * scalar), a broadcast from another root writes zeros. With one
//   rank this is exactly NCCL's result.
// - Events complete after a configurable number of cudaEventQuery calls (0
//   by default, -1 for never), which is how tests make a collective hang.
//   cudaStreamWaitEvent is recorded (stream_waits(): which stream waited
//   for which recording) so that tests can check the stream ordering.
// - Non-blocking communicators can be made to report ncclInProgress for a
//   number of ncclCommGetAsyncError polls after each call.
// - Faults: FailNext makes the next call of a given name return an error
//   code; SetAsyncError makes every communicator report an asynchronous
//   error.
// - Misuse the real libraries would punish (using a communicator after
//   ncclCommAbort/ncclCommDestroy, calling into a non-blocking communicator
//   while it is still in progress, recording an event on another device's
//   stream, buffers that are not fake device memory, leaked or twice-freed
//   handles) is recorded in misuse() rather than crashing; tests assert it
//   stays empty.
//
// Thread-safety: thread-safe (one mutex), so that ranks on several threads
// can share one fake. The current device is per thread, as in CUDA.
#ifndef FLATPARAM_COMM_NCCL_FAKE_NCCL_API_H_
#define FLATPARAM_COMM_NCCL_FAKE_NCCL_API_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "comm/nccl/nccl_api.h"
#include "flatparam/device/cuda/cuda_runtime.h"

namespace flatparam {

class FakeNcclApi final : public NcclApi, public CudaRuntime {
 public:
  // One NCCL collective as called.
  struct Collective {
    std::string name;  // "ncclAllGather", "ncclReduceScatter", ...
    ncclComm_t comm = nullptr;
    const void* sendbuff = nullptr;
    void* recvbuff = nullptr;
    size_t count = 0;  // The count argument as NCCL takes it.
    ncclDataType_t datatype = ncclFloat32;
    ncclRedOp_t op = ncclSum;  // Reductions only.
    int root = -1;             // Broadcast only.
    cudaStream_t stream = nullptr;
    int current_device = -1;  // The calling thread's device.
  };

  // An operator made by ncclRedOpCreatePreMulSum; `scalar` is the value
  // NCCL read, converted from `datatype`.
  struct PreMulSum {
    ncclRedOp_t op = ncclSum;
    double scalar = 0;
    ncclDataType_t datatype = ncclFloat32;
    ncclScalarResidence_t residence = ncclScalarDevice;
    ncclComm_t comm = nullptr;
    bool destroyed = false;
  };

  struct CommInfo {
    int nranks = 0;
    int rank = 0;
    int device = 0;
    bool blocking = true;
    std::string unique_id;  // Empty for split communicators.
    ncclComm_t parent = nullptr;
    int split_color = 0;
    int split_key = 0;
    bool finalized = false;
    bool destroyed = false;
    bool aborted = false;
  };

  struct Stream {
    int device = 0;
    unsigned int flags = 0;
    bool destroyed = false;
  };

  // One cudaStreamWaitEvent: `stream` waits for the work that was on
  // `recorded_on` when the event was recorded (call index `recorded_at` in
  // calls()); the wait itself is call `call`.
  struct StreamWait {
    cudaStream_t stream = nullptr;
    cudaStream_t recorded_on = nullptr;
    int recorded_at = -1;
    int call = -1;
  };

  explicit FakeNcclApi(int device_count = 1);
  ~FakeNcclApi() override;

  // --- Behaviour.
  // cudaGetDeviceCount fails with `error` (cudaSuccess restores it).
  void set_device_count_error(cudaError_t error);
  // The next call named `name` ("ncclAllReduce", "cudaEventRecord", ...)
  // returns `code` (an ncclResult_t or cudaError_t value) and does nothing.
  void FailNext(absl::string_view name, int code);
  // After each later call on a non-blocking communicator, it stays
  // ncclInProgress for `polls` ncclCommGetAsyncError calls (-1: forever),
  // and the call itself returns ncclInProgress.
  void set_in_progress_polls(int polls);
  // From now on ncclCommGetAsyncError reports `error` on every
  // communicator.
  void SetAsyncError(ncclResult_t error);
  // Events recorded from now on complete after `queries` cudaEventQuery
  // calls (-1: never).
  void set_event_pending_queries(int queries);
  // The next ncclCommSplit with a color creates a communicator of `nranks`
  // ranks in which this one has rank `rank` (default: the parent's).
  void SetNextSplit(int nranks, int rank);
  // What ncclGetLastError returns.
  void set_last_error(std::string text);

  // --- Inspection.
  std::vector<std::string> calls() const;
  int CallCount(absl::string_view name) const;
  std::vector<Collective> collectives() const;
  std::vector<PreMulSum> premul_ops() const;
  std::vector<CommInfo> comms() const;  // In creation order.
  CommInfo comm_info(ncclComm_t comm) const;
  std::vector<Stream> streams() const;
  std::vector<StreamWait> stream_waits() const;
  std::vector<std::string> misuse() const;
  int live_events() const;
  int live_allocations() const;
  // Copies between the device and host memory that did not come from
  // cudaMallocHost (pageable: with several ranks in one process, NCCL's
  // documented deadlock pattern when issued between collectives).
  int pageable_copies() const;

  // --- NcclApi.
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

  // --- CudaRuntime: the calls the NCCL backend makes, modelled as above.
  cudaError_t GetDeviceCount(int* count) override;
  cudaError_t GetDevice(int* device) override;
  cudaError_t SetDevice(int device) override;
  // The calling thread's last error, as the CUDA runtime keeps it: set by
  // every failing CUDA call of this fake (and of any other FakeNcclApi on
  // the thread).
  cudaError_t GetLastError() override;
  cudaError_t PeekAtLastError() override;
  const char* GetErrorName(cudaError_t error) override;
  const char* GetErrorString(cudaError_t error) override;
  cudaError_t StreamCreateWithFlags(cudaStream_t* stream,
                                    unsigned int flags) override;
  cudaError_t StreamDestroy(cudaStream_t stream) override;
  cudaError_t StreamWaitEvent(cudaStream_t stream, cudaEvent_t event,
                              unsigned int flags) override;
  cudaError_t EventCreateWithFlags(cudaEvent_t* event,
                                   unsigned int flags) override;
  cudaError_t EventRecord(cudaEvent_t event, cudaStream_t stream) override;
  cudaError_t EventQuery(cudaEvent_t event) override;
  cudaError_t EventDestroy(cudaEvent_t event) override;
  cudaError_t PointerGetAttributes(cudaPointerAttributes* attributes,
                                   const void* ptr) override;
  cudaError_t Malloc(void** ptr, size_t bytes) override;
  cudaError_t Free(void* ptr) override;
  cudaError_t MallocAsync(void** ptr, size_t bytes,
                          cudaStream_t stream) override;
  cudaError_t FreeAsync(void* ptr, cudaStream_t stream) override;
  cudaError_t MallocHost(void** ptr, size_t bytes) override;
  cudaError_t FreeHost(void* ptr) override;
  cudaError_t MemcpyAsync(void* dst, const void* src, size_t bytes,
                          cudaMemcpyKind kind, cudaStream_t stream) override;
  cudaError_t MemsetAsync(void* dst, int value, size_t bytes,
                          cudaStream_t stream) override;

  // --- CudaRuntime: calls the NCCL backend does not make (CudaDeviceOps'
  // device queries, pools, host synchronization and kernels). Each returns
  // cudaErrorNotSupported and records misuse, so that a backend change that
  // starts making one is seen; FakeCudaRuntime models them.
  cudaError_t DeviceGetAttribute(int* value, cudaDeviceAttr attr,
                                 int device) override;
  cudaError_t DeviceGetDefaultMemPool(cudaMemPool_t* pool, int device) override;
  cudaError_t MemPoolSetAttribute(cudaMemPool_t pool, cudaMemPoolAttr attr,
                                  void* value) override;
  cudaError_t MemPoolGetAttribute(cudaMemPool_t pool, cudaMemPoolAttr attr,
                                  void* value) override;
  cudaError_t StreamSynchronize(cudaStream_t stream) override;
  cudaError_t StreamQuery(cudaStream_t stream) override;
  cudaError_t EventSynchronize(cudaEvent_t event) override;
  cudaError_t LaunchFill(void* dst, int element_bytes, uint64_t pattern,
                         int64_t count, cudaStream_t stream) override;
  cudaError_t LaunchCast(void* dst, internal_cuda::KernelDType dst_dtype,
                         const void* src, internal_cuda::KernelDType src_dtype,
                         int64_t count, cudaStream_t stream) override;
  cudaError_t LaunchMultiply(void* buf, internal_cuda::KernelDType dtype,
                             double scalar, int64_t count,
                             cudaStream_t stream) override;
  cudaError_t LaunchAdd(void* acc, const void* x,
                        internal_cuda::KernelDType dtype, int64_t count,
                        cudaStream_t stream) override;
  cudaError_t LaunchWaitFlag(const volatile uint32_t* flag,
                             cudaStream_t stream) override;

 private:
  struct Comm {
    CommInfo info;
    int pending_polls = 0;  // ncclInProgress while non-zero; -1 forever.
  };
  struct Event {
    int device = 0;
    bool recorded = false;
    int pending_queries = 0;
    bool destroyed = false;
    cudaStream_t recorded_on = nullptr;
    int recorded_at = -1;  // index in calls_
  };
  struct Allocation {
    std::vector<char> bytes;
    int device = 0;
  };
  // Zeroed fake device memory of the calling thread's device.
  char* NewAllocation(size_t bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether [p, p + bytes) is inside a cudaMallocHost block.
  bool IsPinned(const void* p, size_t bytes) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Records the call and returns the injected failure for it, if any.
  bool Begin(absl::string_view name, int* code)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The live communicator behind `comm`, or null (recording misuse).
  Comm* LiveComm(ncclComm_t comm, absl::string_view call,
                 bool allow_in_progress = false)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Puts a non-blocking communicator in progress after a call.
  ncclResult_t Finish(Comm& comm) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether [ptr, ptr + bytes) lies in one fake allocation; records misuse
  // otherwise.
  bool CheckDeviceRange(const void* ptr, size_t bytes, absl::string_view what)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool CheckStream(cudaStream_t stream, const Comm& comm,
                   absl::string_view call) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  ncclResult_t Reduce(absl::string_view name, const void* sendbuff,
                      void* recvbuff, size_t count, size_t send_offset,
                      ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                      cudaStream_t stream);
  void Misuse(std::string what) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  cudaError_t NotModelled(absl::string_view call);

  const int device_count_;
  mutable absl::Mutex mu_;
  cudaError_t device_count_error_ ABSL_GUARDED_BY(mu_) = cudaSuccess;
  std::map<std::string, int> fail_next_ ABSL_GUARDED_BY(mu_);
  int in_progress_polls_ ABSL_GUARDED_BY(mu_) = 0;
  ncclResult_t async_error_ ABSL_GUARDED_BY(mu_) = ncclSuccess;
  int event_pending_queries_ ABSL_GUARDED_BY(mu_) = 0;
  bool next_split_set_ ABSL_GUARDED_BY(mu_) = false;
  int next_split_nranks_ ABSL_GUARDED_BY(mu_) = 0;
  int next_split_rank_ ABSL_GUARDED_BY(mu_) = 0;
  std::string last_error_ ABSL_GUARDED_BY(mu_) = "fake last error";
  int unique_ids_ ABSL_GUARDED_BY(mu_) = 0;

  std::vector<std::string> calls_ ABSL_GUARDED_BY(mu_);
  std::map<const char*, std::vector<char>> pinned_ ABSL_GUARDED_BY(mu_);
  int pageable_copies_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<Collective> collectives_ ABSL_GUARDED_BY(mu_);
  std::vector<PreMulSum> premul_ops_ ABSL_GUARDED_BY(mu_);
  std::vector<StreamWait> stream_waits_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> misuse_ ABSL_GUARDED_BY(mu_);
  // Handles are the addresses of these objects, kept until the fake dies.
  std::vector<std::unique_ptr<Comm>> comms_ ABSL_GUARDED_BY(mu_);
  std::vector<std::unique_ptr<Stream>> streams_ ABSL_GUARDED_BY(mu_);
  std::vector<std::unique_ptr<Event>> events_ ABSL_GUARDED_BY(mu_);
  std::map<const char*, Allocation> allocations_ ABSL_GUARDED_BY(mu_);
};

}  // namespace flatparam

#endif  // FLATPARAM_COMM_NCCL_FAKE_NCCL_API_H_
