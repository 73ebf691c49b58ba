#include <algorithm>
#include <functional>

#include "absl/status/status.h"
#include "flatparam/handle.h"
#include "flatparam/memory_stats.h"
#include "flatparam/runtime.h"

// FsdpRuntime's model-wide memory accounting: the handles forward their
// allocations to one tracker (see memory() in runtime.h); Track resets the
// called handle's own peaks. internal/runtime_internal.h lists the
// runtime's files.

namespace flatparam {

absl::Status FsdpRuntime::Track(
    int unit, const std::function<absl::Status(FlatParamHandle&)>& call) {
  FlatParamHandle& h = *handles_[unit];
  h.ResetPeakMemory();
  return call(h);
}

MemoryStats FsdpRuntime::memory() const { return memory_.stats(); }

void FsdpRuntime::ResetPeakMemory() { memory_.ResetPeaks(); }

}  // namespace flatparam
