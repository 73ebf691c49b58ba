// Where the conformance cases (collective_cases.h) and the bandwidth sweeps
// put the buffers they hand to a communicator, and how their bytes reach the
// host: host memory for the simulator and MPI, CUDA device memory for NCCL
// (cuda_memory.h). The cases compute inputs and expectations on the host and
// move them with Upload()/ReadBack(), so one case runs on every backend.
//
//   DeviceMemory& memory = HostMemory();
//   FLATPARAM_ASSIGN_OR_RETURN(DeviceBuffer buffer,
//                              DeviceBuffer::Allocate(memory, dtype, count));
//   FLATPARAM_RETURN_IF_ERROR(buffer.Upload(host_input));
//   ... comm.AllReduce(buffer.ref(), buffer.ref(), options)->Wait() ...
//
// Memory: a DeviceBuffer owns its allocation and frees it through its
// DeviceMemory, which must outlive it. HostBuffer owns a std::vector.
//
// Thread-safety: a DeviceMemory is safe to use from several threads at once
// (each simulator rank allocates from the same HostMemory()); a
// DeviceBuffer or HostBuffer is used by one thread at a time.
#ifndef FLATPARAM_COMM_CONFORMANCE_DEVICE_MEMORY_H_
#define FLATPARAM_COMM_CONFORMANCE_DEVICE_MEMORY_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "comm/communicator.h"
#include "flatparam/base/dtype.h"

namespace flatparam {
namespace conformance {

// A zero-initialised host array of `count` elements of `dtype`.
class HostBuffer {
 public:
  HostBuffer(DType dtype, int64_t count);

  BufferRef ref() { return {bytes_.data(), count_, dtype_, Device::Host()}; }
  ConstBufferRef cref() const {
    return {bytes_.data(), count_, dtype_, Device::Host()};
  }
  void* data() { return bytes_.data(); }
  const void* data() const { return bytes_.data(); }
  int64_t count() const { return count_; }
  DType dtype() const { return dtype_; }
  int64_t bytes() const { return static_cast<int64_t>(bytes_.size()); }

 private:
  DType dtype_;
  int64_t count_;
  std::vector<char> bytes_;
};

// An allocator and copier for one device. Errors name the device and size.
class DeviceMemory {
 public:
  virtual ~DeviceMemory() = default;

  virtual Device device() const = 0;
  // `bytes` (> 0) bytes on device(); ResourceExhausted when out of memory.
  virtual absl::StatusOr<void*> Allocate(size_t bytes) = 0;
  virtual void Free(void* ptr) = 0;
  // Synchronous copies: the data has arrived when they return.
  virtual absl::Status CopyToDevice(void* device_dst, const void* host_src,
                                    size_t bytes) = 0;
  virtual absl::Status CopyToHost(void* host_dst, const void* device_src,
                                  size_t bytes) = 0;
  virtual absl::Status Memset(void* device_dst, int byte, size_t bytes) = 0;
  // `device_ptr` itself when the host may read device memory directly (host
  // memory), else nullptr; lets checks of large buffers skip a copy.
  virtual const void* HostView(const void* device_ptr) const = 0;
};

// Plain host memory (operator new); never destroyed.
DeviceMemory& HostMemory();

// `count` elements of `dtype` on a DeviceMemory. Move-only.
class DeviceBuffer {
 public:
  // Allocates at least one byte, so that even an empty buffer has a valid,
  // distinct address.
  static absl::StatusOr<DeviceBuffer> Allocate(DeviceMemory& memory,
                                               DType dtype, int64_t count);

  DeviceBuffer() = default;
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer();

  BufferRef ref() const;
  int64_t count() const { return count_; }
  DType dtype() const { return dtype_; }

  // Copies `host` into elements [offset, offset + host.count()).
  // REQUIRES: same dtype, and the range lies within the buffer.
  absl::Status Upload(const HostBuffer& host, int64_t offset = 0);
  // Sets every byte to `byte`.
  absl::Status Fill(int byte);

 private:
  DeviceMemory* memory_ = nullptr;
  void* data_ = nullptr;
  DType dtype_ = DType::kFloat32;
  int64_t count_ = 0;
};

// The elements of `ref` (a buffer of `memory`) readable on the host: a view
// of the buffer itself for host memory, else a copy made into `storage`.
absl::StatusOr<const void*> ReadBack(DeviceMemory& memory, ConstBufferRef ref,
                                     std::vector<char>& storage);

}  // namespace conformance
}  // namespace flatparam

#endif  // FLATPARAM_COMM_CONFORMANCE_DEVICE_MEMORY_H_
