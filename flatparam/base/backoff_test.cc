#include "flatparam/base/backoff.h"

#include <gtest/gtest.h>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace flatparam {
namespace {

// A poll finds work done at most 1/16 of the wait late (10 us for short
// waits), and long waits poll once a millisecond.
TEST(BackoffTest, SleepsAreAFractionOfTheWait) {
  EXPECT_EQ(Backoff::SleepAfter(absl::ZeroDuration()), absl::Microseconds(10));
  EXPECT_EQ(Backoff::SleepAfter(absl::Microseconds(160)),
            absl::Microseconds(10));
  EXPECT_EQ(Backoff::SleepAfter(absl::Microseconds(800)),
            absl::Microseconds(50));
  EXPECT_EQ(Backoff::SleepAfter(absl::Milliseconds(8)),
            absl::Microseconds(500));
  EXPECT_EQ(Backoff::SleepAfter(absl::Milliseconds(16)), absl::Milliseconds(1));
  EXPECT_EQ(Backoff::SleepAfter(absl::Seconds(100)), absl::Milliseconds(1));
}

// A pause never sleeps past the deadline, however long the wait has been.
TEST(BackoffTest, NeverPastTheDeadline) {
  Backoff backoff;
  const absl::Time start = absl::Now();
  for (int i = 0; i < 200; ++i) backoff.Pause(start);  // already passed
  EXPECT_LT(absl::Now() - start, absl::Seconds(1));
}

}  // namespace
}  // namespace flatparam
