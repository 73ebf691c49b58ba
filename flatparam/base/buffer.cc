#include "flatparam/base/buffer.h"

#include "absl/strings/str_cat.h"

namespace flatparam {

std::string DeviceName(Device device) {
  return device.type == DeviceType::kHost ? "host"
                                          : absl::StrCat("cuda:", device.index);
}

int64_t ConstBufferRef::bytes() const {
  return count * static_cast<int64_t>(DTypeSize(dtype));
}

ConstBufferRef ConstBufferRef::Slice(int64_t offset, int64_t n) const {
  return {static_cast<const char*>(data) + offset * DTypeSize(dtype), n, dtype,
          device};
}

int64_t BufferRef::bytes() const {
  return count * static_cast<int64_t>(DTypeSize(dtype));
}

BufferRef BufferRef::Slice(int64_t offset, int64_t n) const {
  return {static_cast<char*>(data) + offset * DTypeSize(dtype), n, dtype,
          device};
}

}  // namespace flatparam
