#include "flatparam/memory_stats.h"

#include <algorithm>
#include <cassert>

namespace flatparam {

absl::string_view MemoryCategoryName(MemoryCategory category) {
  switch (category) {
    case MemoryCategory::kShardedParams:
      return "sharded_params";
    case MemoryCategory::kUnshardedParams:
      return "unsharded_params";
    case MemoryCategory::kShardedGrads:
      return "sharded_grads";
    case MemoryCategory::kUnshardedGrads:
      return "unsharded_grads";
    case MemoryCategory::kLowPrecisionParams:
      return "low_precision_params";
  }
  return "unknown";
}

void MemoryTracker::Allocated(MemoryCategory category,
                              MemoryPlacement placement, int64_t bytes) {
  const int c = static_cast<int>(category);
  cells_[c][static_cast<int>(placement)] += bytes;
  if (parent_ != nullptr) parent_->Allocated(category, placement, bytes);
  stats_.current[c] += bytes;
  stats_.peak[c] = std::max(stats_.peak[c], stats_.current[c]);
  if (placement == MemoryPlacement::kCompute) {
    stats_.compute_current += bytes;
    stats_.compute_peak = std::max(stats_.compute_peak, stats_.compute_current);
  } else {
    stats_.offload_current += bytes;
    stats_.offload_peak = std::max(stats_.offload_peak, stats_.offload_current);
  }
}

void MemoryTracker::Freed(MemoryCategory category, MemoryPlacement placement,
                          int64_t bytes) {
  const int c = static_cast<int>(category);
  cells_[c][static_cast<int>(placement)] -= bytes;
  if (parent_ != nullptr) parent_->Freed(category, placement, bytes);
  stats_.current[c] -= bytes;
  assert(stats_.current[c] >= 0);
  if (placement == MemoryPlacement::kCompute) {
    stats_.compute_current -= bytes;
    assert(stats_.compute_current >= 0);
  } else {
    stats_.offload_current -= bytes;
    assert(stats_.offload_current >= 0);
  }
}

void MemoryTracker::ResetPeaks() {
  stats_.peak = stats_.current;
  stats_.compute_peak = stats_.compute_current;
  stats_.offload_peak = stats_.offload_current;
}

void MemoryTracker::ForwardTo(MemoryTracker* parent) {
  parent_ = parent;
  if (parent_ == nullptr) return;
  for (int c = 0; c < kNumMemoryCategories; ++c) {
    for (int p = 0; p < 2; ++p) {
      if (cells_[c][p] == 0) continue;
      parent_->Allocated(static_cast<MemoryCategory>(c),
                         static_cast<MemoryPlacement>(p), cells_[c][p]);
    }
  }
}

}  // namespace flatparam
