// A test program for RunOnMpiWorld's promise that a fault ends the job
// within its timeout, run under mpirun by mpi_fault_test.sh: every rank
// all-gathers in a loop, and one rank injects a fault.
//
//   mpi_fault_main --fault=F [--fault_rank=R] [--timeout=4s]
//                  [--start_timeout=60s] [--ops=N] [--others_late=D]
//
// Faults, on rank R (every rank for all-error):
//   none               no fault: the job finalises cleanly, every rank OK.
//   stop-before-init   SIGSTOP before MPI_Init (the others wait in MPI's
//                      start).
//   stop-mid           SIGSTOP before op N/2 (the others wait in an
//                      all-gather).
//   exit-mid           _exit(3) before op N/2 (a killed rank).
//   local-error        an InvalidArgument error before op N/2 on R alone
//                      (the others wait in an all-gather).
//   all-error          the same error on every rank: a clean end, exit 1.
//   stop-at-end        SIGSTOP after the last op (the others wait in the
//                      exit handshake).
// --others_late=D makes the other ranks sleep D before op N/2, as on a
// loaded machine where they reach it after R's fault.
// The faulting rank prints "mpi_fault: rank R: fault F at T" (T: Unix time
// in milliseconds) to stderr, flushed, just before the fault, so the test
// can measure the time from the fault to the job's end.
#include <signal.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "comm/communicator.h"
#include "comm/mpi/mpi_communicator.h"
#include "flatparam/base/status_macros.h"

ABSL_FLAG(std::string, fault, "none",
          "none, stop-before-init, stop-mid, exit-mid, local-error, "
          "all-error or stop-at-end");
ABSL_FLAG(int, fault_rank, 2, "The rank that injects the fault.");
ABSL_FLAG(absl::Duration, timeout, absl::Seconds(4),
          "Every collective's timeout, and RunOnMpiWorld's for the job's end.");
ABSL_FLAG(absl::Duration, start_timeout, absl::Seconds(60),
          "RunOnMpiWorld's bound on MPI's start.");
ABSL_FLAG(int, ops, 20, "All-gathers per rank.");
ABSL_FLAG(absl::Duration, others_late, absl::ZeroDuration(),
          "How long the ranks other than --fault_rank sleep before op N/2.");

namespace flatparam {
namespace {

int LaunchedRank() {
  int rank = -1;
  const char* value = std::getenv("OMPI_COMM_WORLD_RANK");
  if (value == nullptr || !absl::SimpleAtoi(value, &rank)) return -1;
  return rank;
}

void Announce(int rank, const std::string& fault) {
  std::fprintf(stderr, "mpi_fault: rank %d: fault %s at %lld\n", rank,
               fault.c_str(),
               static_cast<long long>(absl::ToUnixMillis(absl::Now())));
  std::fflush(stderr);
}

absl::Status Run(MpiCommunicator& world, const std::string& fault,
                 int fault_rank, absl::Duration timeout, int ops,
                 absl::Duration others_late) {
  const bool faulty = world.rank() == fault_rank;
  std::vector<float> input(1024, static_cast<float>(world.rank()));
  std::vector<float> output(input.size() * world.size());
  CollectiveOptions options;
  options.timeout = timeout;
  for (int op = 0; op < ops; ++op) {
    if (op == ops / 2 && !faulty) absl::SleepFor(others_late);
    if (op == ops / 2 && (faulty || fault == "all-error")) {
      if (fault == "stop-mid") {
        Announce(world.rank(), fault);
        raise(SIGSTOP);
      } else if (fault == "exit-mid") {
        Announce(world.rank(), fault);
        _exit(3);
      } else if (fault == "local-error" || fault == "all-error") {
        Announce(world.rank(), fault);
        return absl::InvalidArgumentError(absl::StrFormat(
            "rank %d: injected error before op %d", world.rank(), op));
      }
    }
    FLATPARAM_RETURN_IF_ERROR(
        world
            .AllGather(
                ConstBufferRef{input.data(),
                               static_cast<int64_t>(input.size())},
                BufferRef{output.data(), static_cast<int64_t>(output.size())},
                options)
            ->Wait());
    for (int r = 0; r < world.size(); ++r) {
      if (output[r * input.size()] != static_cast<float>(r)) {
        return absl::InternalError(absl::StrFormat(
            "rank %d: op %d: wrong data from rank %d", world.rank(), op, r));
      }
    }
  }
  if (faulty && fault == "stop-at-end") {
    Announce(world.rank(), fault);
    raise(SIGSTOP);
  }
  return absl::OkStatus();
}

int Main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const std::string fault = absl::GetFlag(FLAGS_fault);
  const int fault_rank = absl::GetFlag(FLAGS_fault_rank);
  const absl::Duration timeout = absl::GetFlag(FLAGS_timeout);
  const int ops = absl::GetFlag(FLAGS_ops);
  if (fault == "stop-before-init" && LaunchedRank() == fault_rank) {
    Announce(fault_rank, fault);
    raise(SIGSTOP);
  }
  MpiWorldOptions options;
  options.comm.create_timeout = timeout;
  options.timeout = timeout;
  options.start_timeout = absl::GetFlag(FLAGS_start_timeout);
  options.program = "mpi_fault";
  int rank = -1;
  const absl::Status status = RunOnMpiWorld(
      [&](MpiCommunicator& world) {
        rank = world.rank();
        return Run(world, fault, fault_rank, timeout, ops,
                   absl::GetFlag(FLAGS_others_late));
      },
      options);
  if (!status.ok()) {
    if (!IsReported(status)) {
      std::fprintf(stderr, "mpi_fault: %s\n",
                   std::string(status.message()).c_str());
    }
    return 1;
  }
  std::printf("mpi_fault: rank %d: OK\n", rank);
  return 0;
}

}  // namespace
}  // namespace flatparam

int main(int argc, char** argv) { return flatparam::Main(argc, argv); }
