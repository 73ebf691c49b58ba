// TrackedBuffer: a typed DeviceBuffer whose bytes are counted in a
// MemoryTracker under one category while it is allocated. Private to the
// flat-parameter runtime (flatparam/handle.h).
//
// Ownership: owns its DeviceBuffer; the DeviceOps and MemoryTracker it was
// allocated with must outlive it. Thread-safety: none (one owner thread).
#ifndef FLATPARAM_INTERNAL_TRACKED_BUFFER_H_
#define FLATPARAM_INTERNAL_TRACKED_BUFFER_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "comm/communicator.h"
#include "flatparam/base/dtype.h"
#include "flatparam/device/device.h"
#include "flatparam/memory_stats.h"

namespace flatparam {
namespace internal_handle {

class TrackedBuffer {
 public:
  TrackedBuffer() = default;
  ~TrackedBuffer() { Reset(); }
  TrackedBuffer(TrackedBuffer&& other) noexcept;
  TrackedBuffer& operator=(TrackedBuffer&& other) noexcept;
  TrackedBuffer(const TrackedBuffer&) = delete;
  TrackedBuffer& operator=(const TrackedBuffer&) = delete;

  // `count` elements of `dtype` on `device` (uninitialized).
  static absl::StatusOr<TrackedBuffer> Allocate(
      DeviceOps& ops, MemoryTracker& tracker, MemoryCategory category,
      MemoryPlacement placement, Device device, DType dtype, int64_t count,
      bool pinned = false);

  bool allocated() const { return buffer_.allocated(); }
  DType dtype() const { return dtype_; }
  int64_t count() const { return count_; }
  MemoryCategory category() const { return category_; }
  // The whole buffer; {nullptr, 0, ...} when not allocated.
  BufferRef ref() const {
    return {buffer_.data(), count_, dtype_, buffer_.device()};
  }

  // Frees the memory (if any) and stops counting it.
  void Reset();
  // Counts the bytes under `category` from now on.
  void Recategorize(MemoryCategory category);

 private:
  DeviceBuffer buffer_;
  MemoryTracker* tracker_ = nullptr;
  MemoryCategory category_ = MemoryCategory::kShardedParams;
  MemoryPlacement placement_ = MemoryPlacement::kCompute;
  DType dtype_ = DType::kFloat32;
  int64_t count_ = 0;
};

}  // namespace internal_handle
}  // namespace flatparam

#endif  // FLATPARAM_INTERNAL_TRACKED_BUFFER_H_
