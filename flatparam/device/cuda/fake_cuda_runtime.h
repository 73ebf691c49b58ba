// FakeCudaRuntime: a model of the CUDA runtime on the host, for running
// CudaDeviceOps in CI without a GPU (test-only). It follows the CUDA
// runtime API's documented semantics where they decide whether code is
// correct, in the rules below. It is kinder than CUDA where it does not
// model a rule: it has no peer access, unified memory or graphs, no
// legacy-default-stream synchronization, and one host clock for all
// threads (a thread that issues work after another thread synchronized is
// taken to be ordered after that synchronization). Speed aside, these are
// the ways code that passes here can still fail on a GPU:
//
// - Last errors are per thread: every call that fails (cudaErrorNotReady
//   from a query included) sets the calling thread's last error, which
//   cudaGetLastError returns and clears and cudaPeekAtLastError returns.
//   Kernel launches return cudaGetLastError() after the launch, so an error
//   an earlier call left there is reported by the next launch, as
//   cuda_kernels.cu's launchers do on a real device.
// - Streams run asynchronously, each on its own worker thread, in issue
//   order; with Options::max_op_delay each operation waits a seeded random
//   time first, so streams finish in their own time. Events complete when
//   their stream reaches them (cudaEventQuery says cudaErrorNotReady until
//   then); cudaStreamWaitEvent makes a stream wait for the work recorded at
//   the call. HoldStream makes a stream stop at its current end until
//   ReleaseStreams: a collective that never completes, for host-wait tests.
// - Device memory is host memory that host code cannot dereference: its
//   pages are mapped PROT_NONE at the address cudaMalloc returns (a
//   segmentation fault, as on a GPU), and the model's streams work through a
//   read-write view of the same pages (HostAlias). It starts uninitialised
//   (0xA5 bytes), as cudaMalloc's does.
//   cudaFree and cudaFreeHost synchronize the device.
// - Stream-ordered allocation follows CUDA's default memory pool, which
//   reuses freed memory as early as its rules allow: memory freed with
//   cudaFreeAsync on stream s goes to the next cudaMallocAsync on s at
//   once, before the free has run; to an allocation on another stream once
//   that stream is ordered after the free (an event) or the free has run,
//   and otherwise behind a wait for the free that the pool inserts into the
//   allocating stream; and a smaller allocation is carved out of a bigger
//   freed range (adjacent freed ranges merge). The smallest range that
//   fits goes first, the most recently freed of equal ones. A free overwrites
//   its bytes with 0xFF when it runs. Every operation gets a vector clock when
//   issued (its stream's order, cudaStreamWaitEvent, and what the host has seen
//   complete through synchronizations and successful queries), and the model
//   checks, at issue, that an operation touching a stream-ordered allocation is
//   ordered after its cudaMallocAsync and that each cudaFreeAsync is
//   ordered after every operation that touched the allocation, as
//   compute-sanitizer's --track-stream-ordered-races does. A breach is
//   recorded in misuse() whatever the streams' timing, and the operation
//   (the use, or the free) becomes an illegal address when it runs. Pool
//   reservation is reported through cudaMemPoolAttrReservedMem{Current,
//   High}; with a release threshold of 0 (CUDA's default) a synchronization
//   returns wholly free segments whose frees have run.
// - Kernels run as host loops with PyTorch's CUDA arithmetic (the same as
//   cuda_kernels.cu). A kernel, copy or memset that touches device memory
//   that is not allocated when it is issued is an illegal address when it
//   runs: the error becomes sticky, every later call returns it, and
//   misuse() says which operation did it. So is a kernel that touches
//   another device's memory (peer access is
//   not modelled: CUDA faults without cudaDeviceEnablePeerAccess). A kernel
//   launched into a stream of a device that is not current is refused with
//   cudaErrorInvalidResourceHandle, as CUDA refuses it (copies and memsets
//   may use any device's stream).
// - Copies from pageable host memory to the device return once the source
//   has been read (after the stream drained), copies to pageable host memory
//   return once done, as the CUDA documentation describes for pageable
//   memory; copies with pinned memory are asynchronous.
// - FailNext makes the next call of a given name fail with a given error.
//
// Counters (live events, streams, blocks, event creations) let tests check
// that resources stay bounded.
//
// Thread-safety: thread-safe. The current device and the last error are per
// thread, as in CUDA. Destroying the fake joins the stream workers (after
// releasing held streams) and frees all memory.
#ifndef FLATPARAM_DEVICE_CUDA_FAKE_CUDA_RUNTIME_H_
#define FLATPARAM_DEVICE_CUDA_FAKE_CUDA_RUNTIME_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "flatparam/device/cuda/cuda_runtime.h"

namespace flatparam {

class FakeCudaRuntime final : public CudaRuntime {
 public:
  struct Options {
    int device_count = 1;
    // cudaDevAttrMemoryPoolsSupported (stream-ordered allocation).
    bool memory_pools = true;
    // Each stream operation first waits a random time in [0, max_op_delay]
    // drawn from `seed`.
    absl::Duration max_op_delay = absl::ZeroDuration();
    uint64_t seed = 1;
  };

  FakeCudaRuntime();
  explicit FakeCudaRuntime(Options options);
  ~FakeCudaRuntime() override;
  FakeCudaRuntime(const FakeCudaRuntime&) = delete;
  FakeCudaRuntime& operator=(const FakeCudaRuntime&) = delete;

  // ---- Test controls ----
  // The next call named `call` ("cudaMallocAsync", "cudaEventQuery", ...)
  // fails with `error` without doing anything.
  void FailNext(absl::string_view call, cudaError_t error);
  // `stream` stops before any work issued on it from now on, until
  // ReleaseStreams().
  void HoldStream(cudaStream_t stream);
  void ReleaseStreams();
  // Misuse the real runtime would punish with a crash or corruption, in
  // words; empty when the code under test behaved.
  std::vector<std::string> misuse() const;
  int64_t live_events() const;
  int64_t event_creations() const;
  int64_t live_streams() const;
  int64_t live_device_blocks() const;  // allocated and not freed
  int64_t device_mallocs() const;      // blocks that grew the memory

  // ---- For other models on the same device (fake NCCL) ----
  // Enqueues `work` on `stream`, to run on the stream's worker in issue
  // order, like a kernel (cudaLaunchHostFunc's position in the stream);
  // `touches` are the device ranges it reads or writes, checked when it
  // runs. `work` may block (a collective waiting for its peers).
  struct Range {
    const void* ptr;
    size_t bytes;
  };
  cudaError_t EnqueueWork(cudaStream_t stream, absl::string_view what,
                          std::vector<Range> touches,
                          std::function<void()> work);
  // The address through which the model reads and writes the device
  // memory at `ptr`: device memory itself is mapped PROT_NONE, so that host
  // code that dereferences it faults as it would on a GPU. `ptr` itself if
  // it is not device memory (pinned or pageable host memory). For other
  // models' work (fake NCCL, in EnqueueWork's `work`) and for tests that
  // look inside device memory.
  void* HostAlias(const void* ptr) const;
  // The device of the live device block holding `ptr`, or -1; `pinned`
  // (may be null) says whether `ptr` is in cudaMallocHost memory.
  int DeviceOf(const void* ptr, bool* pinned = nullptr) const;
  // The device of `stream`, or -1 for an unknown stream.
  int StreamDevice(cudaStream_t stream);
  // Runs `f` with the fake's lock held, so that another model can keep its
  // state under the same lock (and WaitUntil sees its changes). `f` must
  // not call into the fake.
  void Locked(const std::function<void()>& f);
  // Blocks (a stream worker, in EnqueueWork's `work`) until `ready()`
  // holds, evaluated under the fake's lock; false if the fake is being
  // destroyed first. `ready` must not call into the fake.
  bool WaitUntil(const std::function<bool()>& ready);

  // ---- CudaRuntime ----
  cudaError_t GetLastError() override;
  cudaError_t PeekAtLastError() override;
  const char* GetErrorName(cudaError_t error) override;
  const char* GetErrorString(cudaError_t error) override;
  cudaError_t GetDeviceCount(int* count) override;
  cudaError_t GetDevice(int* device) override;
  cudaError_t SetDevice(int device) override;
  cudaError_t DeviceGetAttribute(int* value, cudaDeviceAttr attr,
                                 int device) override;
  cudaError_t DeviceGetDefaultMemPool(cudaMemPool_t* pool, int device) override;
  cudaError_t MemPoolSetAttribute(cudaMemPool_t pool, cudaMemPoolAttr attr,
                                  void* value) override;
  cudaError_t MemPoolGetAttribute(cudaMemPool_t pool, cudaMemPoolAttr attr,
                                  void* value) override;
  cudaError_t StreamCreateWithFlags(cudaStream_t* stream,
                                    unsigned int flags) override;
  cudaError_t StreamDestroy(cudaStream_t stream) override;
  cudaError_t StreamSynchronize(cudaStream_t stream) override;
  cudaError_t StreamQuery(cudaStream_t stream) override;
  cudaError_t StreamWaitEvent(cudaStream_t stream, cudaEvent_t event,
                              unsigned int flags) override;
  cudaError_t EventCreateWithFlags(cudaEvent_t* event,
                                   unsigned int flags) override;
  cudaError_t EventDestroy(cudaEvent_t event) override;
  cudaError_t EventRecord(cudaEvent_t event, cudaStream_t stream) override;
  cudaError_t EventQuery(cudaEvent_t event) override;
  cudaError_t EventSynchronize(cudaEvent_t event) override;
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
  // Device blocks report their device; cudaMallocHost memory is
  // cudaMemoryTypeHost; anything else is unregistered host memory.
  cudaError_t PointerGetAttributes(cudaPointerAttributes* attributes,
                                   const void* ptr) override;
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
  // Runs until `*flag` is nonzero (or the fake is destroyed); a `flag`
  // that is not cudaMallocHost memory is refused, as a GPU would fault on
  // it.
  cudaError_t LaunchWaitFlag(const volatile uint32_t* flag,
                             cudaStream_t stream) override;

 private:
  struct StreamState;
  struct EventState;
  struct PoolState;
  // A vector clock: entry i is the last operation (by its position in its
  // stream's issue order, from 1) of the stream with index i that a point
  // in the program is ordered after; missing entries are 0.
  using Clock = std::vector<uint64_t>;
  // A range of device memory an operation touches when it runs.
  struct Touch {
    const void* ptr;
    size_t bytes;
  };
  struct Op {
    std::string what;                 // for misuse()
    std::function<void()> run;        // may be empty (waits, holds)
    std::vector<Touch> touches;       // checked when issued and when run
    StreamState* wait_for = nullptr;  // cudaStreamWaitEvent
    uint64_t wait_seq = 0;
    int64_t hold = -1;  // HoldStream generation
    // A kernel: it may touch only its stream's device's memory (no peer
    // access is modelled).
    bool kernel = false;
    // Breaks a stream-ordering rule (misuse() says which): when it runs,
    // an illegal address instead of its work.
    bool poisoned = false;
  };
  // Memory the model maps: a cudaMalloc block, or a memory pool's segment
  // that stream-ordered allocations are carved from. Its key in segments_
  // is a PROT_NONE view of its pages; `host` a read-write view of them.
  struct Segment {
    size_t bytes = 0;
    int device = 0;
    bool pooled = false;
    char* host = nullptr;
  };
  // A live allocation: a whole cudaMalloc segment, or `span` bytes of a
  // pool segment from cudaMallocAsync.
  struct Allocation {
    size_t bytes = 0;  // as asked for
    size_t span = 0;   // as carved from the segment
    int device = 0;
    bool pooled = false;
    // cudaMallocAsync's place in its stream (an operation of its own);
    // null for cudaMalloc, which is ordered before all later work.
    StreamState* stream = nullptr;
    uint64_t seq = 0;
    // For each stream (by index), its last operation that touches the
    // allocation and what that was, which the free must be ordered after.
    std::map<int, std::pair<uint64_t, std::string>> uses;
  };
  // The stream position of a cudaFreeAsync and its clock there.
  struct FreePoint {
    StreamState* stream = nullptr;
    uint64_t seq = 0;
    Clock clock;
  };
  // Pool memory handed back by cudaFreeAsync (or cudaFree), which
  // cudaMallocAsync reuses: on the freeing stream at once, on another
  // stream once ordered after the frees or behind a wait it inserts (CUDA's
  // default pool allows all three). Adjacent ranges of one segment merge.
  struct FreeRange {
    size_t bytes = 0;
    int device = 0;
    std::vector<FreePoint> frees;  // empty: free since a synchronization
    uint64_t order = 0;            // later frees are reused first
  };
  // Maps a segment of `bytes` as two views of one memory file: a PROT_NONE
  // one (returned: the "device" address) and a read-write one (*host).
  // Null if the system refuses.
  static char* MapSegment(size_t bytes, char** host);
  static void UnmapSegment(char* device, const Segment& segment);

  // The result of a call: records a failure as the thread's last error.
  cudaError_t Result(cudaError_t error);
  // The injected or sticky error for `call`, or cudaSuccess.
  cudaError_t Precheck(absl::string_view call)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  int CurrentDevice() const;
  StreamState* FindStream(cudaStream_t stream)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  StreamState* NewStream(int device) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Issues `op` on `stream`: its position and clock (ordered after the
  // stream's earlier work and what the host has seen complete), and its
  // touches checked against the allocations they use.
  uint64_t Enqueue(StreamState* stream, Op op)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void CheckTouches(StreamState* stream, uint64_t seq, Op& op)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void WorkerLoop(StreamState* stream);
  // The segment holding `ptr` (its address in *base), or null.
  const Segment* SegmentAt(const void* ptr, char** base) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The live allocation holding [ptr, ptr + bytes), or null.
  Allocation* AllocationAt(const void* ptr, size_t bytes)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether [ptr, ptr + bytes) is inside a live allocation.
  bool IsLiveDevice(const void* ptr, size_t bytes) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether `ptr` is in mapped device memory, allocated or not.
  bool IsDevicePointer(const void* ptr) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The device of the live allocation holding `ptr`, or -1.
  int BlockDevice(const void* ptr) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool IsPinned(const void* ptr) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Returns [ptr, ptr + span) of a pool segment to the free ranges.
  void AddFreeRange(char* ptr, size_t span, int device, FreePoint free)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Blocks until every stream of `device` (-1: all), destroyed ones
  // included, has finished the work issued so far; the host is then ordered
  // after it.
  void DrainDevice(int device) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void DrainStream(StreamState* stream) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Unmaps pool segments that are wholly free, their frees done, where the
  // pool's release threshold is 0 (a synchronization's trim).
  void ReleaseIdleBlocks() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  cudaError_t Launch(absl::string_view what, cudaStream_t stream,
                     std::vector<Touch> touches, std::function<void()> run);

  const Options options_;
  const uint64_t id_;  // keys the per-thread state
  mutable absl::Mutex mu_;
  std::map<std::string, cudaError_t> fail_next_ ABSL_GUARDED_BY(mu_);
  cudaError_t sticky_ ABSL_GUARDED_BY(mu_) = cudaSuccess;
  std::vector<std::string> misuse_ ABSL_GUARDED_BY(mu_);
  std::vector<std::unique_ptr<StreamState>> streams_ ABSL_GUARDED_BY(mu_);
  std::vector<StreamState*> default_streams_ ABSL_GUARDED_BY(mu_);
  std::map<const EventState*, std::unique_ptr<EventState>> events_
      ABSL_GUARDED_BY(mu_);
  std::vector<std::unique_ptr<PoolState>> pools_ ABSL_GUARDED_BY(mu_);
  std::map<char*, Segment> segments_ ABSL_GUARDED_BY(mu_);
  std::map<char*, Allocation> allocations_ ABSL_GUARDED_BY(mu_);
  std::map<char*, FreeRange> free_ranges_ ABSL_GUARDED_BY(mu_);
  uint64_t frees_ ABSL_GUARDED_BY(mu_) = 0;  // FreeRange::order
  std::map<char*, size_t> pinned_ ABSL_GUARDED_BY(mu_);
  // What the host has seen complete (synchronizations, successful queries,
  // copies to pageable memory), in any thread: work issued afterwards is
  // ordered after it. (One clock for all host threads: kinder than CUDA
  // where threads hand work to each other without synchronizing.)
  Clock host_clock_ ABSL_GUARDED_BY(mu_);
  bool shutting_down_ ABSL_GUARDED_BY(mu_) = false;
  // Hold ops of an earlier generation than this have been released.
  int64_t hold_generation_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t event_creations_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t device_mallocs_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace flatparam

#endif  // FLATPARAM_DEVICE_CUDA_FAKE_CUDA_RUNTIME_H_
