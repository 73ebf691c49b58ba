// Backoff: the pause between polls of work that usually ends within
// microseconds (a CUDA event, a NCCL communicator's asynchronous state).
// Spins briefly, yielding the core, then sleeps for 1/16 of the time waited
// so far (at least 10 us, at most 1 ms), never past the deadline: a poll
// finds the work done at most about 6% (or 10 us) after it ended, so the
// wait adds little to what it measures, and a long wait polls about once a
// millisecond.
//
//   Backoff backoff;
//   while (!Done()) {
//     if (absl::Now() >= deadline) return Timeout();
//     backoff.Pause(deadline);
//   }
//
// Thread-safety: none (one poller owns it).
#ifndef FLATPARAM_BASE_BACKOFF_H_
#define FLATPARAM_BASE_BACKOFF_H_

#include "absl/time/time.h"

namespace flatparam {

class Backoff {
 public:
  // The first 64 calls yield; later ones sleep SleepAfter(time since the
  // first call), cut short at `deadline`.
  void Pause(absl::Time deadline);

  // The sleep after waiting `waited`: waited / 16, within [10 us, 1 ms].
  static absl::Duration SleepAfter(absl::Duration waited);

 private:
  int spins_ = 0;
  absl::Time start_;
};

}  // namespace flatparam

#endif  // FLATPARAM_BASE_BACKOFF_H_
