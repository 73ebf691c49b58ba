#include "comm/conformance/device_memory.h"

#include <cassert>
#include <cstring>
#include <new>
#include <utility>

#include "absl/strings/str_format.h"

namespace flatparam {
namespace conformance {
namespace {

class HostMemoryImpl final : public DeviceMemory {
 public:
  Device device() const override { return Device::Host(); }
  absl::StatusOr<void*> Allocate(size_t bytes) override {
    void* ptr = ::operator new(bytes, std::nothrow);
    if (ptr == nullptr) {
      return absl::ResourceExhaustedError(
          absl::StrFormat("cannot allocate %d bytes of host memory", bytes));
    }
    return ptr;
  }
  void Free(void* ptr) override { ::operator delete(ptr); }
  absl::Status CopyToDevice(void* dst, const void* src, size_t bytes) override {
    if (bytes > 0) std::memcpy(dst, src, bytes);
    return absl::OkStatus();
  }
  absl::Status CopyToHost(void* dst, const void* src, size_t bytes) override {
    if (bytes > 0) std::memcpy(dst, src, bytes);
    return absl::OkStatus();
  }
  absl::Status Memset(void* dst, int byte, size_t bytes) override {
    if (bytes > 0) std::memset(dst, byte, bytes);
    return absl::OkStatus();
  }
  const void* HostView(const void* ptr) const override { return ptr; }
};

}  // namespace

HostBuffer::HostBuffer(DType dtype, int64_t count)
    : dtype_(dtype),
      count_(count),
      bytes_(static_cast<size_t>(count) * DTypeSize(dtype)) {}

DeviceMemory& HostMemory() {
  static DeviceMemory* const memory = new HostMemoryImpl();
  return *memory;
}

absl::StatusOr<DeviceBuffer> DeviceBuffer::Allocate(DeviceMemory& memory,
                                                    DType dtype,
                                                    int64_t count) {
  assert(count >= 0);
  const size_t bytes = static_cast<size_t>(count) * DTypeSize(dtype);
  absl::StatusOr<void*> data = memory.Allocate(bytes > 0 ? bytes : 1);
  if (!data.ok()) return data.status();
  DeviceBuffer buffer;
  buffer.memory_ = &memory;
  buffer.data_ = *data;
  buffer.dtype_ = dtype;
  buffer.count_ = count;
  return buffer;
}

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : memory_(std::exchange(other.memory_, nullptr)),
      data_(std::exchange(other.data_, nullptr)),
      dtype_(other.dtype_),
      count_(std::exchange(other.count_, 0)) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    if (data_ != nullptr) memory_->Free(data_);
    memory_ = std::exchange(other.memory_, nullptr);
    data_ = std::exchange(other.data_, nullptr);
    dtype_ = other.dtype_;
    count_ = std::exchange(other.count_, 0);
  }
  return *this;
}

DeviceBuffer::~DeviceBuffer() {
  if (data_ != nullptr) memory_->Free(data_);
}

BufferRef DeviceBuffer::ref() const {
  return {data_, count_, dtype_,
          memory_ != nullptr ? memory_->device() : Device::Host()};
}

absl::Status DeviceBuffer::Upload(const HostBuffer& host, int64_t offset) {
  assert(host.dtype() == dtype_);
  assert(offset >= 0 && offset + host.count() <= count_);
  if (host.count() == 0) return absl::OkStatus();
  return memory_->CopyToDevice(
      static_cast<char*>(data_) + offset * DTypeSize(dtype_), host.data(),
      static_cast<size_t>(host.bytes()));
}

absl::Status DeviceBuffer::Fill(int byte) {
  const size_t bytes = static_cast<size_t>(count_) * DTypeSize(dtype_);
  if (bytes == 0) return absl::OkStatus();
  return memory_->Memset(data_, byte, bytes);
}

absl::StatusOr<const void*> ReadBack(DeviceMemory& memory, ConstBufferRef ref,
                                     std::vector<char>& storage) {
  if (const void* view = memory.HostView(ref.data); view != nullptr) {
    return view;
  }
  storage.resize(static_cast<size_t>(ref.bytes()));
  if (!storage.empty()) {
    absl::Status status =
        memory.CopyToHost(storage.data(), ref.data, storage.size());
    if (!status.ok()) return status;
  }
  return static_cast<const void*>(storage.data());
}

}  // namespace conformance
}  // namespace flatparam
