#include "flatparam/base/backoff.h"

#include <algorithm>
#include <thread>

#include "absl/time/clock.h"

namespace flatparam {

absl::Duration Backoff::SleepAfter(absl::Duration waited) {
  return std::clamp(waited / 16, absl::Microseconds(10), absl::Milliseconds(1));
}

void Backoff::Pause(absl::Time deadline) {
  const absl::Time now = absl::Now();
  if (spins_ == 0) start_ = now;
  if (spins_ < 64) {
    ++spins_;
    std::this_thread::yield();
    return;
  }
  const absl::Duration nap = std::min(SleepAfter(now - start_), deadline - now);
  if (nap > absl::ZeroDuration()) absl::SleepFor(nap);
}

}  // namespace flatparam
