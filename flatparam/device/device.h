// DeviceOps: the small set of memory operations the flat-parameter runtime
// (flatparam/handle.h) needs on its compute device, behind an interface so
// that the same runtime runs on the host (HostDeviceOps, tested everywhere)
// and on a CUDA GPU (CudaDeviceOps in flatparam/device/cuda/).
//
//   HostDeviceOps ops;
//   FLATPARAM_ASSIGN_OR_RETURN(DeviceBuffer buf,
//                              ops.Allocate(ops.device(), 16 * 4));
//   BufferRef x = buf.As(DType::kFloat32);
//   FLATPARAM_RETURN_IF_ERROR(ops.Fill(x, 1.0));
//   FLATPARAM_RETURN_IF_ERROR(ops.Scale(x, ScaleOp::kDivide, 4.0));
//
// Placement. Every buffer an operation touches lives either on the host or
// on the implementation's compute device (device()). Copy() moves data
// between any two of those; Fill, Cast, Scale and Add take buffers that are
// all on the host or all on the compute device (an implementation runs the
// host case on the CPU). Anything else is InvalidArgument.
//
// Arithmetic follows PyTorch on the implementation's device:
//   * Cast rounds to nearest, ties to even, as `Tensor.to(dtype)` /
//     `copy_()` do; float64 -> float16/bfloat16 goes through float32.
//   * Scale(kDivide, f) is PyTorch's `tensor.div_(f)` with a Python float:
//     on the CPU each element is divided by f in the dtype's compute type
//     (float32 for float32/float16/bfloat16, float64 for float64) and
//     rounded back; PyTorch's CUDA kernel instead multiplies by the
//     reciprocal computed in the compute type (BinaryDivTrueKernel.cu), so
//     the two differ in the last bit for factors that are not powers of two.
//     Scale(kMultiply, f) is `tensor.mul_(f)`.
//   * Add is `acc += x` (`add_` with alpha 1) in the compute type, rounded
//     once per element.
//
// Ordering. Operations are issued in call order on the current stream
// (stream 0, the default, unless SetStream chose another) and may run
// asynchronously on a device; an operation that touches host memory has
// completed when it returns (HostDeviceOps completes everything before
// returning). Synchronize() blocks until every issued operation on every
// stream has completed; call it before another agent (a Communicator, the
// caller's own code) reads or writes memory these operations wrote.
//
// Streams and events, CUDA's model. Work on one stream runs in issue
// order; work on different streams is unordered unless an event orders
// it: RecordEvent(s) marks the work issued on `s` so far, WaitEvent(t, e)
// makes work issued on `t` afterwards wait until e's work has completed
// (a device-side wait: the host does not block), SynchronizeEvent(e)
// blocks the host until then. Memory belongs to the stream that was
// current when it was allocated: another stream may use it only once
// ordered after the allocation (a WaitEvent for an event recorded on the
// allocating stream after Allocate, or a host synchronization), since the
// memory may still be in use by work its previous owner queued on the
// allocating stream (CUDA's stream-ordered allocator). Freeing it makes it
// reusable by later work on that stream at once (stream order protects
// it), so a buffer that another stream also used must be declared with
// RecordStream(buf, other) (PyTorch's `record_stream`) before it is freed,
// and its memory is not handed out again until the other stream's work
// issued before the free has completed. Implementations without concurrency
// (HostDeviceOps) run everything at once, so there every event has passed when
// recorded; sim/sim_device.h models the streams on the host and reports any
// access that the rules above leave unordered.
//
// Memory: Allocate() returns an owning DeviceBuffer; its destructor frees the
// memory through the DeviceOps that allocated it, which must outlive it. The
// operations themselves never keep pointers to caller memory after
// completing.
//
// Thread-safety: a DeviceOps is used by one thread at a time; HostDeviceOps
// may be shared between threads (its allocator cache has a mutex).
#ifndef FLATPARAM_DEVICE_DEVICE_H_
#define FLATPARAM_DEVICE_DEVICE_H_

#include <cstdint>
#include <optional>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "flatparam/base/buffer.h"
#include "flatparam/base/dtype.h"
#include "flatparam/device/caching_allocator.h"

namespace flatparam {

class DeviceOps;

// An owning, move-only allocation made by a DeviceOps. A default-constructed
// DeviceBuffer owns nothing. A zero-byte allocation is still "allocated"
// (allocated() is true) but may have a null data().
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  ~DeviceBuffer() { Reset(); }
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  bool allocated() const { return ops_ != nullptr; }
  void* data() const { return data_; }
  int64_t bytes() const { return bytes_; }
  Device device() const { return device_; }
  // Page-locked host memory (only for host allocations, where supported).
  bool pinned() const { return pinned_; }

  // The whole buffer as `bytes() / DTypeSize(dtype)` elements of `dtype`.
  BufferRef As(DType dtype) const;

  // Frees the memory now; the buffer then owns nothing.
  void Reset();

 private:
  friend class DeviceOps;
  DeviceBuffer(DeviceOps* ops, void* data, int64_t bytes, Device device,
               bool pinned)
      : ops_(ops),
        data_(data),
        bytes_(bytes),
        device_(device),
        pinned_(pinned) {}

  DeviceOps* ops_ = nullptr;
  void* data_ = nullptr;
  int64_t bytes_ = 0;
  Device device_;
  bool pinned_ = false;
};

// A stream of one DeviceOps (an id it gave out). Stream 0 is the default
// stream, which every DeviceOps has.
struct Stream {
  int32_t id = 0;
  friend bool operator==(Stream a, Stream b) { return a.id == b.id; }
  friend bool operator!=(Stream a, Stream b) { return a.id != b.id; }
};

// A point in a stream, recorded by DeviceOps::RecordEvent. Copyable; valid
// for the lifetime of the DeviceOps that recorded it.
struct Event {
  int64_t id = -1;
  Stream stream;
};

enum class ScaleOp : uint8_t { kDivide, kMultiply };

absl::string_view ScaleOpName(ScaleOp op);

class DeviceOps {
 public:
  virtual ~DeviceOps() = default;

  // The compute device: Device::Host() for HostDeviceOps.
  virtual Device device() const = 0;
  // "host" or "cuda".
  virtual absl::string_view name() const = 0;

  // Allocates `bytes` (>= 0) on `device`, which must be device() or the
  // host. `pinned` asks for page-locked host memory, for fast and
  // asynchronous transfers to the device; implementations without a device
  // ignore it. The contents are uninitialized. InvalidArgument for a bad
  // device or size; ResourceExhausted when the allocation fails.
  absl::StatusOr<DeviceBuffer> Allocate(Device device, int64_t bytes,
                                        bool pinned = false);

  // dst[i] = src[i]. Same dtype and count; any placement pair. The buffers
  // must not overlap unless they are identical (then it is a no-op).
  absl::Status Copy(BufferRef dst, ConstBufferRef src);
  // dst[i] = value, rounded to dst's dtype.
  absl::Status Fill(BufferRef dst, double value);
  // dst[i] = src[i] converted to dst's dtype. Same count and placement;
  // distinct dtypes must not overlap.
  absl::Status Cast(BufferRef dst, ConstBufferRef src);
  // buf[i] = buf[i] / factor (kDivide) or * factor (kMultiply). `factor`
  // must be finite, and non-zero for kDivide.
  absl::Status Scale(BufferRef buf, ScaleOp op, double factor);
  // acc[i] += x[i]. Same dtype, count and placement; `x` may alias `acc`.
  absl::Status Add(BufferRef acc, ConstBufferRef x);
  // Blocks until every issued operation has completed; returns the first
  // asynchronous error, if any.
  virtual absl::Status Synchronize() = 0;

  // ---- Streams and events (see the file comment) ----
  // A new stream, distinct from every other of these ops.
  absl::StatusOr<Stream> NewStream();
  // Makes `stream` current: later operations (and allocations) are issued
  // on it. InvalidArgument for a stream these ops did not create.
  absl::Status SetStream(Stream stream);
  Stream current_stream() const { return current_; }
  // Marks the work issued on `stream` so far.
  absl::StatusOr<Event> RecordEvent(Stream stream);
  // Work issued on `stream` from now on waits for `event`'s work.
  absl::Status WaitEvent(Stream stream, Event event);
  // Blocks the host until `event`'s work has completed.
  absl::Status SynchronizeEvent(Event event);
  // Declares that `stream` uses `buffer` (the whole allocation it lies in):
  // when that allocation is freed, its memory is not reused before the work
  // issued on `stream` up to the free has completed.
  absl::Status RecordStream(ConstBufferRef buffer, Stream stream);
  // The streams created so far, the default included.
  int32_t num_streams() const { return num_streams_; }
  // `stream` as a collective backend orders with it (base/buffer.h's
  // DeviceStream; comm/communicator.h's stream-ordered completion): the
  // CUDA stream for CudaDeviceOps, the simulated stream for SimDeviceOps.
  // nullopt for implementations without device streams (HostDeviceOps)
  // and for a stream these ops did not create.
  std::optional<DeviceStream> NativeStream(Stream stream) const;

 protected:
  // Streams: the defaults suit implementations that complete every
  // operation before returning (no concurrency, so nothing to order).
  virtual absl::Status DoNewStream(Stream stream) { return absl::OkStatus(); }
  virtual absl::Status DoSetStream(Stream stream) { return absl::OkStatus(); }
  virtual absl::Status DoRecordEvent(Event event) { return absl::OkStatus(); }
  virtual absl::Status DoWaitEvent(Stream stream, Event event) {
    return absl::OkStatus();
  }
  virtual absl::Status DoSynchronizeEvent(Event event) {
    return absl::OkStatus();
  }
  virtual absl::Status DoRecordStream(ConstBufferRef buffer, Stream stream) {
    return absl::OkStatus();
  }
  // NativeStream for a valid stream; none by default.
  virtual std::optional<DeviceStream> DoNativeStream(Stream stream) const {
    return std::nullopt;
  }

  // The operations after argument checks (done by the public wrappers
  // above). Counts are > 0 and pointers non-null when called.
  virtual absl::StatusOr<void*> DoAllocate(Device device, int64_t bytes,
                                           bool pinned) = 0;
  virtual void DoFree(void* data, Device device, bool pinned) = 0;
  virtual absl::Status DoCopy(BufferRef dst, ConstBufferRef src) = 0;
  virtual absl::Status DoFill(BufferRef dst, double value) = 0;
  virtual absl::Status DoCast(BufferRef dst, ConstBufferRef src) = 0;
  virtual absl::Status DoScale(BufferRef buf, ScaleOp op, double factor) = 0;
  virtual absl::Status DoAdd(BufferRef acc, ConstBufferRef x) = 0;

 private:
  friend class DeviceBuffer;
  absl::Status CheckPlacement(absl::string_view op, ConstBufferRef b) const;
  absl::Status CheckStream(absl::string_view op, Stream stream) const;

  Stream current_;
  int32_t num_streams_ = 1;
  int64_t next_event_ = 0;
};

// The host kernels, with PyTorch's CPU arithmetic (see the file comment).
// HostDeviceOps uses them for everything, CudaDeviceOps for host buffers.
// REQUIRES: floating dtypes, valid non-overlapping memory of `count`
// elements (Add: `x` may equal `acc`).
void HostFill(void* dst, DType dtype, int64_t count, double value);
void HostCast(void* dst, DType dst_dtype, const void* src, DType src_dtype,
              int64_t count);
void HostScale(void* buf, DType dtype, int64_t count, ScaleOp op,
               double factor);
void HostAdd(void* acc, const void* x, DType dtype, int64_t count);

// DeviceOps on host memory: the compute device is the host, allocation is
// 64-byte aligned heap memory, every operation is synchronous.
//
// Allocation goes through a CachingAllocator (caching_allocator.h), on by
// default with its default cap (1 GiB of freed blocks kept): the runtime
// frees and reallocates buffers of the same sizes every iteration (Unshard()
// allocates the padded unsharded parameter afresh, Reshard() frees it, as
// PyTorch's storage resize does), and on the host each fresh large block
// costs a page fault per page, 3-5x the all-gather that fills it. PyTorch
// relies on its CUDA caching allocator for the same pattern, by default.
// What it costs: the process keeps up to the cap of freed memory that no
// handle's MemoryStats counts (they count logical allocations, unchanged);
// pass options with max_cached_bytes = 0 for the uncached behaviour, or call
// EmptyCache(). Pinned and pageable requests are cached apart (pinned() of
// a reused buffer is what was asked for), though on the host both are plain
// heap memory.
//
// Memory: every DeviceBuffer must be freed before the ops are destroyed;
// the destructor releases the cache.
class HostDeviceOps final : public DeviceOps {
 public:
  HostDeviceOps() : HostDeviceOps(CachingAllocatorOptions()) {}
  explicit HostDeviceOps(CachingAllocatorOptions options)
      : allocator_(&heap_, options) {}
  HostDeviceOps(const HostDeviceOps&) = delete;
  HostDeviceOps& operator=(const HostDeviceOps&) = delete;

  Device device() const override { return Device::Host(); }
  absl::string_view name() const override { return "host"; }
  absl::Status Synchronize() override { return absl::OkStatus(); }

  // The allocator cache: cached and live bytes, hits and misses.
  CachingAllocatorStats cache_stats() const { return allocator_.stats(); }
  // Frees every cached block for real (live buffers are untouched).
  void EmptyCache() { allocator_.EmptyCache(); }

 protected:
  absl::StatusOr<void*> DoAllocate(Device device, int64_t bytes,
                                   bool pinned) override;
  void DoFree(void* data, Device device, bool pinned) override;
  absl::Status DoCopy(BufferRef dst, ConstBufferRef src) override;
  absl::Status DoFill(BufferRef dst, double value) override;
  absl::Status DoCast(BufferRef dst, ConstBufferRef src) override;
  absl::Status DoScale(BufferRef buf, ScaleOp op, double factor) override;
  absl::Status DoAdd(BufferRef acc, ConstBufferRef x) override;

 private:
  HeapBlockSource heap_;
  CachingAllocator allocator_;
};

}  // namespace flatparam

#endif  // FLATPARAM_DEVICE_DEVICE_H_
