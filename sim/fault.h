// Faults the simulator can inject, and the small spec strings that name them
// so that tests and the `fsdp` tool can say which fault to run:
//
//   kill:rank=3:op=5            rank 3 dies when it issues its collective 5
//   delay:rank=1:seconds=0.25   rank 1 arrives 0.25 virtual seconds late at
//                               every collective
//   delay:rank=1:seconds=30:op=2     ... only at its collective 2
//   flip:rank=2:op=7            one bit of the data rank 2 sends in its
//                               collective 7 is flipped in flight (the bit
//                               is drawn from the world's seed)
//   flip:rank=2:op=7:bit=100    ... bit 100 of that payload
//
// `op` counts a rank's collective calls over all of its groups (the world and
// every Split), from 0, including calls that fail; it is the "op" field of
// the simulator's trace events. Several specs may be joined with ',' or ';'.
//
// What each fault does to a run is documented in sim/sim.h.
//
// Thread-safety: values and pure functions.
#ifndef FLATPARAM_SIM_FAULT_H_
#define FLATPARAM_SIM_FAULT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace flatparam {

struct FaultSpec {
  enum class Kind : uint8_t { kKill, kDelay, kFlip };

  Kind kind = Kind::kKill;
  // The world rank the fault applies to.
  int rank = 0;
  // The rank's collective index (see above). kill and flip need one; -1 on a
  // delay means every collective.
  int64_t op = -1;
  // delay only: virtual time added to the rank's clock before the
  // collective(s).
  absl::Duration delay = absl::ZeroDuration();
  // flip only: the bit of the payload to flip, counting from bit 0 of byte 0
  // (least significant first); -1 draws it from the world's seed.
  int64_t bit = -1;

  // The canonical spec string; ParseFaultSpec(ToString()) == *this.
  std::string ToString() const;

  friend bool operator==(const FaultSpec& a, const FaultSpec& b) {
    return a.kind == b.kind && a.rank == b.rank && a.op == b.op &&
           a.delay == b.delay && a.bit == b.bit;
  }
  friend bool operator!=(const FaultSpec& a, const FaultSpec& b) {
    return !(a == b);
  }
};

// "kill", "delay" or "flip".
absl::string_view FaultKindName(FaultSpec::Kind kind);

// Parses one spec as described above. Keys may come in any order; each at
// most once. InvalidArgument, quoting the spec and saying what is wrong, for
// an unknown kind or key, a missing or repeated key, a value that is not a
// non-negative number, or a key the kind does not take. World-size checks
// (rank < world size) happen in SimWorld::Create.
absl::StatusOr<FaultSpec> ParseFaultSpec(absl::string_view spec);

// Parses a list of specs separated by ',' or ';' (empty items are ignored,
// so "" gives no faults). The error names the failing item.
absl::StatusOr<std::vector<FaultSpec>> ParseFaultSpecs(absl::string_view specs);

}  // namespace flatparam

#endif  // FLATPARAM_SIM_FAULT_H_
