// Memory accounting of the flat-parameter runtime: how many bytes a
// FlatParamHandle (flatparam/handle.h) has allocated, per category and per
// placement, now and at its peak, so that tests and the memory planner can
// check peak memory against a formula.
//
// Categories follow what PyTorch FSDP keeps per FlatParameter:
//   kShardedParams     the full-precision local shard (`_local_shard`), and
//                      its transient compute-device copy when parameters are
//                      offloaded to the host;
//   kUnshardedParams   the padded unsharded flat parameter
//                      (`_full_param_padded`, or `_full_prec_full_param_padded`
//                      when summoning full parameters under mixed precision);
//                      for NO_SHARD with CPU offload, the compute-device copy
//                      that serves as the unsharded parameter;
//   kShardedGrads      the sharded gradient (`_saved_grad_shard`, `_cpu_grad`),
//                      the low-precision copy kept for
//                      `keep_low_precision_grads`, and the transient new
//                      sharded gradient of a reduce-scatter;
//   kUnshardedGrads    the unsharded gradient the backward accumulates into,
//                      and its reduce-dtype copy during the reduction;
//   kLowPrecisionParams the low-precision shard (`_mp_shard`) of parameter
//                      mixed precision.
//
// Thread-safety: a plain value.
#ifndef FLATPARAM_MEMORY_STATS_H_
#define FLATPARAM_MEMORY_STATS_H_

#include <array>
#include <cstdint>

#include "absl/strings/string_view.h"

namespace flatparam {

enum class MemoryCategory : uint8_t {
  kShardedParams,
  kUnshardedParams,
  kShardedGrads,
  kUnshardedGrads,
  kLowPrecisionParams,
};
inline constexpr int kNumMemoryCategories = 5;

// "sharded_params", "unsharded_params", "sharded_grads", "unsharded_grads",
// "low_precision_params".
absl::string_view MemoryCategoryName(MemoryCategory category);

// Where an allocation lives: on the compute device, or on the host because
// of CPU offload. (When the compute device is the host itself, both are host
// memory; the split still says which allocations offloading put there.)
enum class MemoryPlacement : uint8_t { kCompute, kOffload };

struct MemoryStats {
  // Indexed by MemoryCategory. peak[c] is the largest current[c] seen.
  std::array<int64_t, kNumMemoryCategories> current{};
  std::array<int64_t, kNumMemoryCategories> peak{};
  // Sums over categories per placement; *_peak is the peak of the sum (not
  // the sum of the per-category peaks).
  int64_t compute_current = 0;
  int64_t compute_peak = 0;
  int64_t offload_current = 0;
  int64_t offload_peak = 0;

  int64_t current_bytes(MemoryCategory c) const {
    return current[static_cast<int>(c)];
  }
  int64_t peak_bytes(MemoryCategory c) const {
    return peak[static_cast<int>(c)];
  }
};

// Accumulates MemoryStats from allocation and free events.
class MemoryTracker {
 public:
  void Allocated(MemoryCategory category, MemoryPlacement placement,
                 int64_t bytes);
  void Freed(MemoryCategory category, MemoryPlacement placement, int64_t bytes);
  // Sets every peak to the current value.
  void ResetPeaks();
  const MemoryStats& stats() const { return stats_; }
  // Reports the bytes counted now to `parent` as allocations, and every
  // later Allocated/Freed as well, so that `parent` totals several
  // trackers with exact peaks (FsdpRuntime's model-wide accounting).
  // `parent` must outlive this tracker's last event; null stops
  // forwarding (what was forwarded stays counted in the old parent).
  void ForwardTo(MemoryTracker* parent);

 private:
  MemoryStats stats_;
  // Current bytes per category and placement, to forward.
  std::array<std::array<int64_t, 2>, kNumMemoryCategories> cells_{};
  MemoryTracker* parent_ = nullptr;
};

}  // namespace flatparam

#endif  // FLATPARAM_MEMORY_STATS_H_
