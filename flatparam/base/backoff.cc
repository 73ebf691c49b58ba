#include "flatparam/base/backoff.h"

#include <algorithm>
#include <thread>

#include "absl/time/clock.h"

namespace flatparam {

void Backoff::Pause(absl::Time deadline) {
  if (spins_ < 64) {
    ++spins_;
    std::this_thread::yield();
    return;
  }
  const absl::Duration nap = std::min(sleep_, deadline - absl::Now());
  if (nap > absl::ZeroDuration()) absl::SleepFor(nap);
  sleep_ = std::min(sleep_ * 2, absl::Milliseconds(1));
}

}  // namespace flatparam
