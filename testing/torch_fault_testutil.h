// The training loop of the fault tests' trainers (test-only): a LibTorch
// network under FsdpModule, as a user writes it, on any Communicator; one
// rank may stop itself (SIGSTOP) or end in a step's backward. Shared by
// fsdp_module_fault_main (MPI) and fsdp_module_fault_c10d_main (c10d).
//
// The faulting rank prints "fsdp_module_fault: rank R: fault F at T" (T:
// Unix time in milliseconds) to stderr, flushed, just before the fault.
#ifndef FLATPARAM_TESTING_TORCH_FAULT_TESTUTIL_H_
#define FLATPARAM_TESTING_TORCH_FAULT_TESTUTIL_H_

#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "comm/communicator.h"

namespace flatparam {
namespace libtorch {

struct FaultTrainOptions {
  // "none", "stop-in-backward" (SIGSTOP) or "exit-in-backward" (the
  // process ends at once, as if killed).
  std::string fault = "none";
  int fault_rank = 2;
  // Every collective's timeout.
  absl::Duration timeout = absl::Seconds(3);
  // Training steps; the fault comes in step 2.
  int steps = 4;
};

absl::Status TrainWithFault(Communicator& world,
                            const FaultTrainOptions& options);

}  // namespace libtorch
}  // namespace flatparam

#endif  // FLATPARAM_TESTING_TORCH_FAULT_TESTUTIL_H_
