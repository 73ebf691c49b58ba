// CudaDeviceOps: DeviceOps (flatparam/device/device.h) on one CUDA device,
// for code with CUDA headers. Most code uses CreateCudaDeviceOps()
// (cuda_device.h) instead.
//
// Streams. Stream 0 (the default) is a non-blocking stream the ops own, or
// one the caller passes in (its compute stream: the ops then run on the
// caller's stream, ordered with its own kernels without host syncs);
// NewStream creates more. Every device operation is enqueued on the current
// stream (stream()). NativeStream gives the cudaStream_t of each, so that
// NCCL orders its collectives with them and FlatParamHandle never waits on
// the host for a collective (comm/communicator.h's stream-ordered
// completion, handle.h).
//
// Memory. Device memory comes from a stream-ordered allocator: by default
// the device's memory pool (cudaMallocAsync / cudaFreeAsync), with its
// release threshold raised so that freed memory stays reserved for reuse,
// as PyTorch's caching allocator keeps it: after the first iterations no
// allocation reaches the driver (stats().device_mallocs stops growing). A
// block is freed on the stream it was allocated on, after that stream has
// waited for an event on every stream recorded with RecordStream, so the
// pool hands it out again only after their work. Without memory pools
// (old devices), cudaMalloc / cudaFree. A trainer can plug in its own
// stream-ordered allocator (CudaAllocator). Pinned host memory comes from
// cudaMallocHost and is cached: a freed block is kept, with an event
// recorded on every stream, and handed out again for the same size once
// those events have passed, so that CPU offload's per-step pinned buffers
// neither reach the driver nor synchronize the device (cudaFreeHost does)
// after the first step; the cache is released when the ops are destroyed.
// Unpinned host memory is ordinary 64-byte aligned heap memory.
//
// Completion. Copies that touch host memory are synchronous (they return
// once the copy is done); copies between device buffers and
// Fill/Cast/Scale/Add on device buffers are asynchronous. Fill/Cast/Scale/Add
// on host buffers run on the CPU with the host kernels (PyTorch's CPU
// arithmetic). Kernel arithmetic is PyTorch's CUDA arithmetic: in particular
// Scale(kDivide, f) multiplies by the reciprocal of f computed in the
// compute type, as PyTorch's `div_` by a scalar does on CUDA.
//
// Host waits. Every wait of the host for device work (Synchronize,
// SynchronizeEvent, copies to or from host memory, freeing pinned memory)
// polls an event (cudaEventQuery) rather than blocking in the driver, so
// that it can be bounded: with SetHostWaitLimit, a wait that has not ended
// within the limit (the work waits for a collective that a dead peer never
// joins) calls the caller's handler (which aborts the communicator) and
// returns its error. Without a limit the waits are unbounded.
//
// Events. RecordEvent takes a CUDA event from a pool and returns it there
// once a later query on its stream shows it has passed (streams complete in
// order), so the number of CUDA events alive stays bounded by the events in
// flight however many steps run.
//
// Errors: CUDA errors become absl::Status naming the call and the CUDA
// error: ResourceExhausted for out-of-memory, FailedPrecondition for a
// missing driver or device, Internal otherwise. An error (or a query's
// cudaErrorNotReady) the ops have handled is cleared from the thread's
// last-error state, and kernels are launched from a clean state, so that no
// launch reports an earlier call's result as its own.
//
// Thread-safety: one thread at a time. Each call makes the ops' device
// current for its duration and restores the caller's device.
#ifndef FLATPARAM_DEVICE_CUDA_CUDA_DEVICE_OPS_H_
#define FLATPARAM_DEVICE_CUDA_CUDA_DEVICE_OPS_H_

#include <cuda_runtime_api.h>

#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "flatparam/device/cuda/cuda_runtime.h"
#include "flatparam/device/device.h"

namespace flatparam {

// A trainer's own stream-ordered device allocator (its caching allocator),
// for CudaDeviceOps to allocate through. Allocate returns memory usable by
// work enqueued on `stream` from now on; Free makes it reusable by work
// enqueued on `stream` after the call (cudaMallocAsync's contract).
// Borrowed by the ops; must outlive them. Called from the ops' thread.
class CudaAllocator {
 public:
  virtual ~CudaAllocator() = default;
  virtual absl::StatusOr<void*> Allocate(int64_t bytes,
                                         cudaStream_t stream) = 0;
  virtual void Free(void* p, cudaStream_t stream) = 0;
};

// The device allocations of a CudaDeviceOps.
struct CudaAllocatorStats {
  int64_t allocated_bytes = 0;  // live DeviceBuffers on the device
  int64_t peak_allocated_bytes = 0;
  int64_t allocations = 0;  // Allocate calls for device memory
  // The default pool only: memory the pool holds from the driver, now and
  // at its peak, and how many allocations made it grow (the driver calls
  // on the per-step path; 0 once warm).
  int64_t reserved_bytes = 0;
  int64_t peak_reserved_bytes = 0;
  int64_t device_mallocs = 0;
  // Pinned host memory: cudaMallocHost calls (0 more once warm) and the
  // bytes cached for reuse.
  int64_t pinned_mallocs = 0;
  int64_t pinned_cached_bytes = 0;
};

class CudaDeviceOps final : public DeviceOps {
 public:
  // Ops on device `ordinal`. `stream`: a stream of that device to use as
  // stream 0 (not owned; it must outlive the ops), or null for a new
  // non-blocking stream. `allocator`: the caller's, or null for the
  // device's memory pool. `runtime`: the CUDA runtime to call (tests pass
  // a FakeCudaRuntime; it must outlive the ops), or null for the real one.
  static absl::StatusOr<std::unique_ptr<CudaDeviceOps>> Create(
      int ordinal, cudaStream_t stream = nullptr,
      CudaAllocator* allocator = nullptr, CudaRuntime* runtime = nullptr);

  CudaAllocatorStats stats() const;

  // Bounds every host wait (see "Host waits") by `limit`. When a wait
  // exceeds it, `on_expiry(what)` is called with what was waited for (e.g.
  // "Synchronize on stream 1") and its error is returned; a trainer passes
  // its communicator's timeout and a handler that aborts the communicator
  // and names the rank and collective. A null handler returns
  // DeadlineExceeded naming the device and the wait.
  using HostWaitExpiry = std::function<absl::Status(absl::string_view what)>;
  void SetHostWaitLimit(absl::Duration limit, HostWaitExpiry on_expiry);

  // CUDA events the ops hold (recorded and pending, or pooled), for tests
  // that check they stay bounded.
  int64_t cuda_events_held() const;

  // Synchronizes the stream and destroys it if owned. Every DeviceBuffer
  // allocated by these ops must be gone before.
  ~CudaDeviceOps() override;
  CudaDeviceOps(const CudaDeviceOps&) = delete;
  CudaDeviceOps& operator=(const CudaDeviceOps&) = delete;

  Device device() const override { return Device::Cuda(ordinal_); }
  absl::string_view name() const override { return "cuda"; }
  absl::Status Synchronize() override;

  // The current stream's CUDA stream.
  cudaStream_t stream() const { return stream_; }
  cudaStream_t cuda_stream(Stream stream) const { return streams_[stream.id]; }

 protected:
  absl::StatusOr<void*> DoAllocate(Device device, int64_t bytes,
                                   bool pinned) override;
  void DoFree(void* data, Device device, bool pinned) override;
  absl::Status DoCopy(BufferRef dst, ConstBufferRef src) override;
  absl::Status DoFill(BufferRef dst, double value) override;
  absl::Status DoCast(BufferRef dst, ConstBufferRef src) override;
  absl::Status DoScale(BufferRef buf, ScaleOp op, double factor) override;
  absl::Status DoAdd(BufferRef acc, ConstBufferRef x) override;
  // Streams: NewStream creates a non-blocking CUDA stream; events are CUDA
  // events (cudaEventDisableTiming); a device allocation remembers the
  // stream it was allocated on and the streams recorded on it, and is freed
  // with cudaFreeAsync on its stream after that stream has waited for an
  // event recorded on each recorded stream (so the pool reuses it only
  // after their work), or with cudaFree (which synchronizes the device)
  // without stream-ordered allocation.
  absl::Status DoNewStream(Stream stream) override;
  absl::Status DoSetStream(Stream stream) override;
  absl::Status DoRecordEvent(Event event) override;
  absl::Status DoWaitEvent(Stream stream, Event event) override;
  absl::Status DoSynchronizeEvent(Event event) override;
  absl::Status DoRecordStream(ConstBufferRef buffer, Stream stream) override;
  // The cudaStream_t, for NCCL to order its collectives with.
  std::optional<DeviceStream> DoNativeStream(Stream stream) const override;

 private:
  CudaDeviceOps(CudaRuntime& rt, int ordinal, cudaStream_t stream,
                bool owns_stream, bool async_alloc, CudaAllocator* allocator)
      : rt_(rt),
        ordinal_(ordinal),
        stream_(stream),
        owns_stream_(owns_stream),
        async_alloc_(async_alloc),
        allocator_(allocator),
        streams_{stream},
        timelines_(1) {}
  // The pool's reserved bytes (0 without a pool or with a plug-in).
  int64_t PoolReserved(bool peak) const;
  // `error` as a Status (see "Errors"), clearing it from the thread's
  // last-error state.
  absl::Status Check(cudaError_t error, absl::string_view context) const;
  // Clears what an earlier call left in the last-error state; before a
  // kernel launch, whose result is cudaGetLastError().
  void ClearLastError() const;
  // A CUDA event from the pool (or a new one).
  absl::StatusOr<cudaEvent_t> TakeEvent();
  void ReturnEvent(cudaEvent_t event) { free_events_.push_back(event); }
  // Returns to the pool the events of stream `index` that have passed.
  void Retire(int32_t index);
  // Blocks until `event` has passed, polling; bounded by the host-wait
  // limit. `what` names the wait for errors.
  absl::Status HostWait(cudaEvent_t event, absl::string_view what);
  // Waits until the work issued so far on stream `index` has completed.
  absl::Status HostWaitStream(int32_t index, absl::string_view what);

  struct Allocation {
    int64_t bytes = 0;
    int32_t stream = 0;            // current when allocated
    std::vector<int32_t> used_by;  // RecordStream
  };

  CudaRuntime& rt_;
  int ordinal_;
  // The current stream (streams_[current_stream().id]).
  cudaStream_t stream_;
  bool owns_stream_;
  bool async_alloc_;
  CudaAllocator* allocator_;
  CudaAllocatorStats stats_;
  // streams_[0] is the default stream (owned iff owns_stream_); the others
  // are owned.
  std::vector<cudaStream_t> streams_;
  // Per stream: the recorded events that may not have passed yet, oldest
  // first (sequence number, CUDA event, Event id).
  struct Pending {
    uint64_t seq;
    cudaEvent_t event;
    int64_t id;
  };
  struct Timeline {
    std::deque<Pending> pending;
    uint64_t next_seq = 1;
  };
  std::vector<Timeline> timelines_;
  // Events that may not have passed yet, by Event id; an id not here has
  // passed.
  struct Recorded {
    int32_t stream;
    cudaEvent_t event;
  };
  std::map<int64_t, Recorded> events_;
  std::vector<cudaEvent_t> free_events_;
  // Freed pinned blocks by size, each with the events (one per stream)
  // that must pass before it is reused.
  struct PinnedBlock {
    void* data;
    std::vector<cudaEvent_t> events;
  };
  std::multimap<int64_t, PinnedBlock> pinned_cache_;
  // Sizes of the pinned blocks handed out.
  std::map<void*, int64_t> pinned_bytes_;
  // Whether every event of `block` has passed (returning them to the pool
  // if so).
  bool PinnedReady(PinnedBlock& block);
  absl::Duration host_wait_limit_ = absl::InfiniteDuration();
  HostWaitExpiry on_expiry_;
  // Device allocations by address.
  std::map<char*, Allocation> allocations_;
};

}  // namespace flatparam

#endif  // FLATPARAM_DEVICE_CUDA_CUDA_DEVICE_OPS_H_
