// A LibTorch trainer as a user writes it (its own main, MpiSession or
// RunOnMpiWorld, FsdpModule over MPI), run under mpirun by
// fsdp_module_fault_test.sh: one rank stops itself (SIGSTOP) in a step's
// backward, and the others, waiting in a collective inside FsdpModule's
// backward hooks, must end within the collective timeout plus a little,
// saying which rank sent nothing and in which unit.
//
//   fsdp_module_fault_main --fault=none|stop-in-backward [--fault_rank=2]
//       [--timeout=3s] [--launcher=session|run_on_mpi_world] [--steps=4]
//
// The training is testing/torch_fault_testutil.h's (which says what the
// faulting rank prints); a rank whose step fails prints "fsdp_module_fault:
// rank R: <error>" and returns 1 from main, as a user's trainer would.
#include <torch/types.h>
#include <torch/utils.h>

#include <cstdio>
#include <memory>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "comm/mpi/mpi_communicator.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/device/device.h"
#include "flatparam/torch/fsdp_module.h"
#include "testing/torch_fault_testutil.h"

ABSL_FLAG(std::string, fault, "none",
          "none, stop-in-backward or exit-in-backward");
ABSL_FLAG(int, fault_rank, 2, "The rank that stops.");
ABSL_FLAG(absl::Duration, timeout, absl::Seconds(3),
          "Every collective's timeout (FsdpModule's and the launcher's).");
ABSL_FLAG(std::string, launcher, "session",
          "session (the user's own main with MpiSession) or "
          "run_on_mpi_world");
ABSL_FLAG(int, steps, 4, "Training steps; the fault comes in step 2.");

namespace flatparam {
namespace libtorch {
namespace {

FaultTrainOptions FromFlags() {
  FaultTrainOptions options;
  options.fault = absl::GetFlag(FLAGS_fault);
  options.fault_rank = absl::GetFlag(FLAGS_fault_rank);
  options.timeout = absl::GetFlag(FLAGS_timeout);
  options.steps = absl::GetFlag(FLAGS_steps);
  return options;
}

int Main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  torch::set_num_threads(1);
  const absl::Duration timeout = absl::GetFlag(FLAGS_timeout);
  int rank = -1;
  absl::Status status;
  if (absl::GetFlag(FLAGS_launcher) == "run_on_mpi_world") {
    MpiWorldOptions options;
    options.comm.create_timeout = timeout;
    options.timeout = timeout;
    options.program = "fsdp_module_fault";
    status = RunOnMpiWorld(
        [&](MpiCommunicator& world) {
          rank = world.rank();
          return TrainWithFault(world, FromFlags());
        },
        options);
  } else {
    // The user's own main: a session, a world, the loop, an error printed
    // and returned.
    absl::StatusOr<MpiSession> session = MpiSession::Start(&argc, &argv);
    if (!session.ok()) {
      std::fprintf(stderr, "fsdp_module_fault: %s\n",
                   session.status().ToString().c_str());
      return 1;
    }
    MpiOptions comm;
    comm.create_timeout = timeout;
    absl::StatusOr<std::unique_ptr<MpiCommunicator>> world =
        MpiCommunicator::CreateWorld(comm);
    if (!world.ok()) {
      status = world.status();
    } else {
      rank = (*world)->rank();
      status = TrainWithFault(**world, FromFlags());
    }
    if (!status.ok()) {
      std::fprintf(stderr, "fsdp_module_fault: rank %d: %s\n", rank,
                   status.ToString().c_str());
      return 1;  // The session's end (FinalizeMpi) follows.
    }
  }
  if (!status.ok()) {
    if (!IsReported(status)) {
      std::fprintf(stderr, "fsdp_module_fault: rank %d: %s\n", rank,
                   status.ToString().c_str());
    }
    return 1;
  }
  std::printf("fsdp_module_fault: rank %d: OK\n", rank);
  return 0;
}

}  // namespace
}  // namespace libtorch
}  // namespace flatparam

int main(int argc, char** argv) {
  return flatparam::libtorch::Main(argc, argv);
}
