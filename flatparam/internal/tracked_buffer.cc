#include "flatparam/internal/tracked_buffer.h"

#include <utility>

#include "flatparam/base/status_macros.h"

namespace flatparam {
namespace internal_handle {

TrackedBuffer::TrackedBuffer(TrackedBuffer&& other) noexcept
    : buffer_(std::move(other.buffer_)),
      tracker_(std::exchange(other.tracker_, nullptr)),
      category_(other.category_),
      placement_(other.placement_),
      dtype_(other.dtype_),
      count_(std::exchange(other.count_, 0)) {}

TrackedBuffer& TrackedBuffer::operator=(TrackedBuffer&& other) noexcept {
  if (this != &other) {
    Reset();
    buffer_ = std::move(other.buffer_);
    tracker_ = std::exchange(other.tracker_, nullptr);
    category_ = other.category_;
    placement_ = other.placement_;
    dtype_ = other.dtype_;
    count_ = std::exchange(other.count_, 0);
  }
  return *this;
}

absl::StatusOr<TrackedBuffer> TrackedBuffer::Allocate(
    DeviceOps& ops, MemoryTracker& tracker, MemoryCategory category,
    MemoryPlacement placement, Device device, DType dtype, int64_t count,
    bool pinned) {
  const int64_t bytes = count * static_cast<int64_t>(DTypeSize(dtype));
  FLATPARAM_ASSIGN_OR_RETURN(DeviceBuffer buffer,
                             ops.Allocate(device, bytes, pinned));
  TrackedBuffer t;
  t.buffer_ = std::move(buffer);
  t.tracker_ = &tracker;
  t.category_ = category;
  t.placement_ = placement;
  t.dtype_ = dtype;
  t.count_ = count;
  tracker.Allocated(category, placement, bytes);
  return t;
}

void TrackedBuffer::Reset() {
  if (tracker_ != nullptr) {
    tracker_->Freed(category_, placement_, buffer_.bytes());
  }
  buffer_.Reset();
  tracker_ = nullptr;
  count_ = 0;
}

void TrackedBuffer::Recategorize(MemoryCategory category) {
  if (tracker_ != nullptr && category != category_) {
    tracker_->Freed(category_, placement_, buffer_.bytes());
    tracker_->Allocated(category, placement_, buffer_.bytes());
  }
  category_ = category;
}

}  // namespace internal_handle
}  // namespace flatparam
