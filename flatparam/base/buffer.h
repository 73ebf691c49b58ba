// The shared vocabulary of buffers: where memory lives (Device) and a view of
// `count` elements of one dtype at an address on a device (BufferRef /
// ConstBufferRef). Everything that moves data speaks it: the collectives
// (comm/communicator.h), the device operations (flatparam/device), the
// handle and the host-side flatten/shard functions (flatparam/flatten.h).
//
// Views are plain values that own nothing: whoever made the memory keeps it
// alive for as long as a view is used. Not synchronised; copying a view is
// free.
#ifndef FLATPARAM_BASE_BUFFER_H_
#define FLATPARAM_BASE_BUFFER_H_

#include <cstdint>
#include <string>

#include "flatparam/base/dtype.h"

namespace flatparam {

// Where a buffer lives.
enum class DeviceType : uint8_t { kHost, kCuda };

struct Device {
  DeviceType type = DeviceType::kHost;
  int index = 0;  // CUDA device ordinal; 0 for host.

  static Device Host() { return {}; }
  static Device Cuda(int index) { return {DeviceType::kCuda, index}; }
  friend bool operator==(Device a, Device b) {
    return a.type == b.type && a.index == b.index;
  }
  friend bool operator!=(Device a, Device b) { return !(a == b); }
};

// "host" or "cuda:N".
std::string DeviceName(Device device);

// A queue of work on a device (a CUDA stream), named so that a collective
// can be ordered with it without the host waiting: CollectiveOptions::stream
// and Work::WaitStream (comm/communicator.h) take one, and
// DeviceOps::NativeStream (flatparam/device/device.h) makes one from a
// DeviceOps stream. For CUDA, `handle` is the cudaStream_t and `owner`
// null; for the simulated device (sim/sim_device.h), `owner` is the
// SimDeviceOps and `handle` the stream's id. A plain value; the stream
// belongs to whoever made it and must outlive every use.
struct DeviceStream {
  Device device;
  const void* owner = nullptr;
  uintptr_t handle = 0;
};

// A read-only buffer of `count` elements of `dtype` at `data` on `device`.
struct ConstBufferRef {
  const void* data = nullptr;
  int64_t count = 0;
  DType dtype = DType::kFloat32;
  Device device;

  int64_t bytes() const;
  // Elements [offset, offset + count) of this buffer.
  ConstBufferRef Slice(int64_t offset, int64_t count) const;
};

// A writable buffer; converts to ConstBufferRef.
struct BufferRef {
  void* data = nullptr;
  int64_t count = 0;
  DType dtype = DType::kFloat32;
  Device device;

  int64_t bytes() const;
  operator ConstBufferRef() const { return {data, count, dtype, device}; }
  // Elements [offset, offset + count) of this buffer.
  BufferRef Slice(int64_t offset, int64_t count) const;
};

}  // namespace flatparam

#endif  // FLATPARAM_BASE_BUFFER_H_
