// Backoff: the pause between polls of work that usually ends within
// microseconds (a CUDA event, a NCCL communicator's asynchronous state).
// Spins briefly, yielding the core, then sleeps with exponential backoff up
// to 1 ms, never past the deadline.
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
  // The first 64 calls yield; later ones sleep 10 us, doubling up to 1 ms
  // (and never past `deadline`).
  void Pause(absl::Time deadline);

 private:
  int spins_ = 0;
  absl::Duration sleep_ = absl::Microseconds(10);
};

}  // namespace flatparam

#endif  // FLATPARAM_BASE_BACKOFF_H_
