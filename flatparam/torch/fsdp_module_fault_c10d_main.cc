// fsdp_module_fault_main's trainer on c10d: a LibTorch trainer as a user
// writes it for torchrun (its own main, the world from torchrun's
// environment, FsdpModule over it), run by fsdp_module_fault_c10d_test.sh:
// one rank stops itself (SIGSTOP) in a step's backward, and the others,
// waiting in a collective inside FsdpModule's backward hooks, must end
// within the collective timeout plus a little, saying which rank sent
// nothing and in which unit.
//
//   fsdp_module_fault_c10d_main --fault=none|stop-in-backward
//       [--fault_rank=2] [--timeout=3s] [--steps=4]
//
// A rank whose step fails prints "fsdp_module_fault: rank R: <error>", then
// "fsdp_module_fault: rank R: ended at T" (Unix milliseconds), and returns
// 1 from main; a rank that finishes prints
// "fsdp_module_fault: rank R: OK".
#include <torch/types.h>
#include <torch/utils.h>

#include <cstdio>
#include <memory>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "comm/c10d/c10d_communicator.h"
#include "flatparam/base/status_macros.h"
#include "testing/torch_fault_testutil.h"

ABSL_FLAG(std::string, fault, "none",
          "none, stop-in-backward or exit-in-backward");
ABSL_FLAG(int, fault_rank, 2, "The rank that stops.");
ABSL_FLAG(absl::Duration, timeout, absl::Seconds(3),
          "Every collective's timeout.");
ABSL_FLAG(int, steps, 4, "Training steps; the fault comes in step 2.");

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  torch::set_num_threads(1);
  absl::StatusOr<std::unique_ptr<flatparam::C10dCommunicator>> world =
      flatparam::C10dCommunicator::FromEnvironment();
  if (!world.ok()) {
    std::fprintf(stderr, "fsdp_module_fault: %s\n",
                 world.status().ToString().c_str());
    return 1;
  }
  flatparam::libtorch::FaultTrainOptions options;
  options.fault = absl::GetFlag(FLAGS_fault);
  options.fault_rank = absl::GetFlag(FLAGS_fault_rank);
  options.timeout = absl::GetFlag(FLAGS_timeout);
  options.steps = absl::GetFlag(FLAGS_steps);
  const int rank = (*world)->rank();
  const absl::Status status =
      flatparam::libtorch::TrainWithFault(**world, options);
  if (!status.ok()) {
    if (!flatparam::IsReported(status)) {
      std::fprintf(stderr, "fsdp_module_fault: rank %d: %s\n", rank,
                   status.ToString().c_str());
    }
    std::fprintf(stderr, "fsdp_module_fault: rank %d: ended at %lld\n", rank,
                 static_cast<long long>(absl::ToUnixMillis(absl::Now())));
    return 1;
  }
  std::printf("fsdp_module_fault: rank %d: OK\n", rank);
  return 0;
}
