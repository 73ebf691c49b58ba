#include "flatparam/device/device.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>

#include "absl/strings/str_format.h"
#include "flatparam/base/buffer_checks.h"
#include "flatparam/base/copy.h"
#include "flatparam/base/element_traits.h"
#include "flatparam/base/status_macros.h"

namespace flatparam {
namespace {

bool Identical(ConstBufferRef a, ConstBufferRef b) {
  return a.data == b.data && a.device == b.device && a.bytes() == b.bytes();
}

absl::Status CheckBuffer(absl::string_view op, absl::string_view which,
                         ConstBufferRef b) {
  if (b.count < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: %s has a negative count %d", op, which, b.count));
  }
  if (!IsFloatingPoint(b.dtype)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: %s (%s) is not float32, float64, float16 or bfloat16", op, which,
        DescribeBuffer(b)));
  }
  if (b.count > 0 && b.data == nullptr) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: %s (%s) has a null pointer", op, which, DescribeBuffer(b)));
  }
  return absl::OkStatus();
}

template <DType D>
using Elem = ElementTraits<D>;

template <DType D>
void ScaleLoop(void* buf, int64_t count, ScaleOp op, double factor) {
  using E = Elem<D>;
  using C = typename E::Compute;
  auto* p = static_cast<typename E::Storage*>(buf);
  // PyTorch converts the Python scalar to the compute type first.
  const C f = static_cast<C>(factor);
  int exponent = 0;
  if (op == ScaleOp::kDivide && std::frexp(factor, &exponent) == 0.5 &&
      exponent >= -125 && exponent <= 127) {
    // A power of two 2^k: x / 2^k and x * 2^-k are the same real number,
    // rounded alike, and the multiplication is several times cheaper.
    const C r = static_cast<C>(std::ldexp(1.0, 1 - exponent));
    for (int64_t i = 0; i < count; ++i) p[i] = E::Store(E::Load(p[i]) * r);
  } else if (op == ScaleOp::kDivide) {
    for (int64_t i = 0; i < count; ++i) p[i] = E::Store(E::Load(p[i]) / f);
  } else {
    for (int64_t i = 0; i < count; ++i) p[i] = E::Store(E::Load(p[i]) * f);
  }
}

template <DType D>
void AddLoop(void* acc, const void* x, int64_t count) {
  using E = Elem<D>;
  auto* a = static_cast<typename E::Storage*>(acc);
  const auto* b = static_cast<const typename E::Storage*>(x);
  for (int64_t i = 0; i < count; ++i) {
    a[i] = E::Store(E::Load(a[i]) + E::Load(b[i]));
  }
}

}  // namespace

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : ops_(std::exchange(other.ops_, nullptr)),
      data_(std::exchange(other.data_, nullptr)),
      bytes_(std::exchange(other.bytes_, 0)),
      device_(other.device_),
      pinned_(std::exchange(other.pinned_, false)) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    Reset();
    ops_ = std::exchange(other.ops_, nullptr);
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
    device_ = other.device_;
    pinned_ = std::exchange(other.pinned_, false);
  }
  return *this;
}

BufferRef DeviceBuffer::As(DType dtype) const {
  const int64_t size = static_cast<int64_t>(DTypeSize(dtype));
  assert(bytes_ % size == 0);
  return {data_, bytes_ / size, dtype, device_};
}

void DeviceBuffer::Reset() {
  if (ops_ != nullptr && data_ != nullptr) {
    ops_->DoFree(data_, device_, pinned_);
  }
  ops_ = nullptr;
  data_ = nullptr;
  bytes_ = 0;
  pinned_ = false;
}

absl::string_view ScaleOpName(ScaleOp op) {
  return op == ScaleOp::kDivide ? "divide" : "multiply";
}

absl::Status DeviceOps::CheckPlacement(absl::string_view op,
                                       ConstBufferRef b) const {
  if (b.device != Device::Host() && b.device != device()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s (%s ops on %s): buffer %s is neither on the host nor on the "
        "compute device",
        op, name(), DeviceName(device()), DescribeBuffer(b)));
  }
  return absl::OkStatus();
}

absl::Status DeviceOps::CheckStream(absl::string_view op, Stream stream) const {
  if (stream.id < 0 || stream.id >= num_streams_) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s (%s ops): stream %d was not created by these ops (they have %d)",
        op, name(), stream.id, num_streams_));
  }
  return absl::OkStatus();
}

std::optional<DeviceStream> DeviceOps::NativeStream(Stream stream) const {
  if (stream.id < 0 || stream.id >= num_streams_) return std::nullopt;
  return DoNativeStream(stream);
}

absl::StatusOr<Stream> DeviceOps::NewStream() {
  const Stream stream{num_streams_};
  FLATPARAM_RETURN_IF_ERROR(DoNewStream(stream));
  ++num_streams_;
  return stream;
}

absl::Status DeviceOps::SetStream(Stream stream) {
  FLATPARAM_RETURN_IF_ERROR(CheckStream("SetStream", stream));
  FLATPARAM_RETURN_IF_ERROR(DoSetStream(stream));
  current_ = stream;
  return absl::OkStatus();
}

absl::StatusOr<Event> DeviceOps::RecordEvent(Stream stream) {
  FLATPARAM_RETURN_IF_ERROR(CheckStream("RecordEvent", stream));
  const Event event{next_event_, stream};
  FLATPARAM_RETURN_IF_ERROR(DoRecordEvent(event));
  ++next_event_;
  return event;
}

absl::Status DeviceOps::WaitEvent(Stream stream, Event event) {
  FLATPARAM_RETURN_IF_ERROR(CheckStream("WaitEvent", stream));
  if (event.id < 0 || event.id >= next_event_) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "WaitEvent (%s ops): event %d was not recorded by these ops", name(),
        event.id));
  }
  return DoWaitEvent(stream, event);
}

absl::Status DeviceOps::SynchronizeEvent(Event event) {
  if (event.id < 0 || event.id >= next_event_) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "SynchronizeEvent (%s ops): event %d was not recorded by these ops",
        name(), event.id));
  }
  return DoSynchronizeEvent(event);
}

absl::Status DeviceOps::RecordStream(ConstBufferRef buffer, Stream stream) {
  FLATPARAM_RETURN_IF_ERROR(CheckStream("RecordStream", stream));
  FLATPARAM_RETURN_IF_ERROR(CheckBuffer("RecordStream", "buffer", buffer));
  if (buffer.count == 0) return absl::OkStatus();
  return DoRecordStream(buffer, stream);
}

absl::StatusOr<DeviceBuffer> DeviceOps::Allocate(Device device, int64_t bytes,
                                                 bool pinned) {
  if (bytes < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("Allocate: negative size %d bytes", bytes));
  }
  if (device != Device::Host() && device != this->device()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "Allocate (%s ops on %s): cannot allocate on %s", name(),
        DeviceName(this->device()), DeviceName(device)));
  }
  const bool pin = pinned && device == Device::Host();
  if (bytes == 0) return DeviceBuffer(this, nullptr, 0, device, pin);
  FLATPARAM_ASSIGN_OR_RETURN(void* data, DoAllocate(device, bytes, pin));
  return DeviceBuffer(this, data, bytes, device, pin);
}

absl::Status DeviceOps::Copy(BufferRef dst, ConstBufferRef src) {
  FLATPARAM_RETURN_IF_ERROR(CheckBuffer("Copy", "dst", dst));
  FLATPARAM_RETURN_IF_ERROR(CheckBuffer("Copy", "src", src));
  FLATPARAM_RETURN_IF_ERROR(CheckPlacement("Copy", dst));
  FLATPARAM_RETURN_IF_ERROR(CheckPlacement("Copy", src));
  if (dst.dtype != src.dtype || dst.count != src.count) {
    return absl::InvalidArgumentError(
        absl::StrFormat("Copy: dst (%s) and src (%s) differ in dtype or count",
                        DescribeBuffer(dst), DescribeBuffer(src)));
  }
  if (dst.count == 0 || Identical(dst, src)) return absl::OkStatus();
  if (BuffersOverlap(dst, src)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "Copy: dst (%s at %p) and src (%s at %p) overlap", DescribeBuffer(dst),
        dst.data, DescribeBuffer(src), src.data));
  }
  return DoCopy(dst, src);
}

absl::Status DeviceOps::Fill(BufferRef dst, double value) {
  FLATPARAM_RETURN_IF_ERROR(CheckBuffer("Fill", "dst", dst));
  FLATPARAM_RETURN_IF_ERROR(CheckPlacement("Fill", dst));
  if (dst.count == 0) return absl::OkStatus();
  return DoFill(dst, value);
}

absl::Status DeviceOps::Cast(BufferRef dst, ConstBufferRef src) {
  FLATPARAM_RETURN_IF_ERROR(CheckBuffer("Cast", "dst", dst));
  FLATPARAM_RETURN_IF_ERROR(CheckBuffer("Cast", "src", src));
  FLATPARAM_RETURN_IF_ERROR(CheckPlacement("Cast", dst));
  FLATPARAM_RETURN_IF_ERROR(CheckPlacement("Cast", src));
  if (dst.count != src.count || dst.device != src.device) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "Cast: dst (%s) and src (%s) differ in count or placement; use Copy "
        "to move data between devices",
        DescribeBuffer(dst), DescribeBuffer(src)));
  }
  if (dst.count == 0) return absl::OkStatus();
  if (dst.dtype == src.dtype) {
    if (Identical(dst, src)) return absl::OkStatus();
    if (BuffersOverlap(dst, src)) {
      return absl::InvalidArgumentError(
          absl::StrFormat("Cast: dst (%s) and src (%s) overlap",
                          DescribeBuffer(dst), DescribeBuffer(src)));
    }
    return DoCopy(dst, src);
  }
  if (BuffersOverlap(dst, src)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("Cast: dst (%s) and src (%s) overlap and differ in "
                        "dtype",
                        DescribeBuffer(dst), DescribeBuffer(src)));
  }
  return DoCast(dst, src);
}

absl::Status DeviceOps::Scale(BufferRef buf, ScaleOp op, double factor) {
  FLATPARAM_RETURN_IF_ERROR(CheckBuffer("Scale", "buf", buf));
  FLATPARAM_RETURN_IF_ERROR(CheckPlacement("Scale", buf));
  if (!std::isfinite(factor) || (op == ScaleOp::kDivide && factor == 0)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("Scale: cannot %s by %g", ScaleOpName(op), factor));
  }
  if (buf.count == 0) return absl::OkStatus();
  return DoScale(buf, op, factor);
}

absl::Status DeviceOps::Add(BufferRef acc, ConstBufferRef x) {
  FLATPARAM_RETURN_IF_ERROR(CheckBuffer("Add", "acc", acc));
  FLATPARAM_RETURN_IF_ERROR(CheckBuffer("Add", "x", x));
  FLATPARAM_RETURN_IF_ERROR(CheckPlacement("Add", acc));
  FLATPARAM_RETURN_IF_ERROR(CheckPlacement("Add", x));
  if (acc.dtype != x.dtype || acc.count != x.count || acc.device != x.device) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "Add: acc (%s) and x (%s) differ in dtype, count or placement",
        DescribeBuffer(acc), DescribeBuffer(x)));
  }
  if (acc.count == 0) return absl::OkStatus();
  if (BuffersOverlap(acc, x) && !Identical(acc, x)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("Add: acc (%s) and x (%s) overlap partially",
                        DescribeBuffer(acc), DescribeBuffer(x)));
  }
  return DoAdd(acc, x);
}

void HostFill(void* dst, DType dtype, int64_t count, double value) {
  const size_t size = DTypeSize(dtype);
  alignas(8) unsigned char pattern[8];
  StoreFromDouble(pattern, dtype, 0, value);
  auto* out = static_cast<unsigned char*>(dst);
  if (value == 0 && !std::signbit(value)) {
    std::memset(out, 0, count * size);
    return;
  }
  // A typed fill per element size (a memcpy call per element was an order
  // of magnitude slower).
  switch (size) {
    case 2: {
      uint16_t v;
      std::memcpy(&v, pattern, 2);
      std::fill_n(static_cast<uint16_t*>(dst), count, v);
      return;
    }
    case 4: {
      uint32_t v;
      std::memcpy(&v, pattern, 4);
      std::fill_n(static_cast<uint32_t*>(dst), count, v);
      return;
    }
    case 8: {
      uint64_t v;
      std::memcpy(&v, pattern, 8);
      std::fill_n(static_cast<uint64_t*>(dst), count, v);
      return;
    }
    default:
      for (int64_t i = 0; i < count; ++i) {
        std::memcpy(out + i * size, pattern, size);
      }
  }
}

void HostCast(void* dst, DType dst_dtype, const void* src, DType src_dtype,
              int64_t count) {
  ConvertElements(src, src_dtype, dst, dst_dtype, static_cast<size_t>(count));
}

void HostScale(void* buf, DType dtype, int64_t count, ScaleOp op,
               double factor) {
  switch (dtype) {
    case DType::kFloat32:
      return ScaleLoop<DType::kFloat32>(buf, count, op, factor);
    case DType::kFloat64:
      return ScaleLoop<DType::kFloat64>(buf, count, op, factor);
    case DType::kFloat16:
      return ScaleLoop<DType::kFloat16>(buf, count, op, factor);
    case DType::kBFloat16:
      return ScaleLoop<DType::kBFloat16>(buf, count, op, factor);
    default:
      assert(false && "HostScale on a non-floating dtype");
  }
}

void HostAdd(void* acc, const void* x, DType dtype, int64_t count) {
  switch (dtype) {
    case DType::kFloat32:
      return AddLoop<DType::kFloat32>(acc, x, count);
    case DType::kFloat64:
      return AddLoop<DType::kFloat64>(acc, x, count);
    case DType::kFloat16:
      return AddLoop<DType::kFloat16>(acc, x, count);
    case DType::kBFloat16:
      return AddLoop<DType::kBFloat16>(acc, x, count);
    default:
      assert(false && "HostAdd on a non-floating dtype");
  }
}

absl::StatusOr<void*> HostDeviceOps::DoAllocate(Device device, int64_t bytes,
                                                bool pinned) {
  return allocator_.Allocate(device, bytes, pinned);
}

void HostDeviceOps::DoFree(void* data, Device device, bool pinned) {
  allocator_.Free(data, device, pinned);
}

absl::Status HostDeviceOps::DoCopy(BufferRef dst, ConstBufferRef src) {
  CopyBytes(dst.data, src.data, static_cast<size_t>(dst.bytes()),
            dst.bytes() >= kStreamingCopyThreshold);
  return absl::OkStatus();
}

absl::Status HostDeviceOps::DoFill(BufferRef dst, double value) {
  HostFill(dst.data, dst.dtype, dst.count, value);
  return absl::OkStatus();
}

absl::Status HostDeviceOps::DoCast(BufferRef dst, ConstBufferRef src) {
  HostCast(dst.data, dst.dtype, src.data, src.dtype, dst.count);
  return absl::OkStatus();
}

absl::Status HostDeviceOps::DoScale(BufferRef buf, ScaleOp op, double factor) {
  HostScale(buf.data, buf.dtype, buf.count, op, factor);
  return absl::OkStatus();
}

absl::Status HostDeviceOps::DoAdd(BufferRef acc, ConstBufferRef x) {
  HostAdd(acc.data, x.data, acc.dtype, acc.count);
  return absl::OkStatus();
}

}  // namespace flatparam
