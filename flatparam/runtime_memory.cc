#include <algorithm>
#include <functional>

#include "absl/status/status.h"
#include "flatparam/handle.h"
#include "flatparam/memory_stats.h"
#include "flatparam/runtime.h"

// FsdpRuntime's model-wide memory accounting: Track runs every call on a
// handle and Observe folds the called handle's peak into the model-wide
// one (see memory() in runtime.h). internal/runtime_internal.h lists the
// runtime's files.

namespace flatparam {

absl::Status FsdpRuntime::Track(
    int unit, const std::function<absl::Status(FlatParamHandle&)>& call) {
  FlatParamHandle& h = *handles_[unit];
  h.ResetPeakMemory();
  absl::Status status = call(h);
  Observe(unit);
  return status;
}

// Only the called handle allocated or freed since the last observation, so
// the model-wide bytes during the call were the others' current bytes plus
// the called handle's, whose peak during the call its tracker holds.
void FsdpRuntime::Observe(int called) {
  MemoryStats others;
  for (int u = 0; u < num_units(); ++u) {
    if (u == called) continue;
    const MemoryStats& m = handles_[u]->memory();
    for (int c = 0; c < kNumMemoryCategories; ++c) {
      others.current[c] += m.current[c];
    }
    others.compute_current += m.compute_current;
    others.offload_current += m.offload_current;
  }
  const MemoryStats mine =
      called >= 0 ? handles_[called]->memory() : MemoryStats{};
  for (int c = 0; c < kNumMemoryCategories; ++c) {
    peak_.peak[c] = std::max(peak_.peak[c], others.current[c] + mine.peak[c]);
  }
  peak_.compute_peak =
      std::max(peak_.compute_peak, others.compute_current + mine.compute_peak);
  peak_.offload_peak =
      std::max(peak_.offload_peak, others.offload_current + mine.offload_peak);
}

MemoryStats FsdpRuntime::memory() const {
  MemoryStats out;
  for (const auto& h : handles_) {
    const MemoryStats& m = h->memory();
    for (int c = 0; c < kNumMemoryCategories; ++c) {
      out.current[c] += m.current[c];
    }
    out.compute_current += m.compute_current;
    out.offload_current += m.offload_current;
  }
  // Direct handle calls since the last observation may have raised the
  // current bytes past the recorded peak.
  for (int c = 0; c < kNumMemoryCategories; ++c) {
    out.peak[c] = std::max(peak_.peak[c], out.current[c]);
  }
  out.compute_peak = std::max(peak_.compute_peak, out.compute_current);
  out.offload_peak = std::max(peak_.offload_peak, out.offload_current);
  return out;
}

void FsdpRuntime::ResetPeakMemory() {
  const MemoryStats now = memory();
  peak_.peak = now.current;
  peak_.compute_peak = now.compute_current;
  peak_.offload_peak = now.offload_current;
}

}  // namespace flatparam
