// The job runner RunOnMpiWorld, an MPI program's whole main() that never
// waits without a deadline for a peer (tools use it; communicators do
// not), the job's abort (AbortJob), and what the launcher's environment
// tells (NodeLocalRank).
#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "comm/communicator.h"
#include "comm/mpi/internal/mpi_internal.h"
#include "comm/mpi/mpi_communicator.h"
#include "flatparam/base/dtype.h"
#include "flatparam/base/status_macros.h"

namespace flatparam {

using internal_mpi::AbortJob;
using internal_mpi::Engine;

int NodeLocalRank() {
  for (const char* name : {"OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID"}) {
    const char* value = std::getenv(name);
    int rank = 0;
    if (value != nullptr && absl::SimpleAtoi(value, &rank) && rank >= 0) {
      return rank;
    }
  }
  return 0;
}

namespace {

void FlushOutput() {
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);
}

// Prints "<program>: <message>" to stderr and flushes everything.
void PrintNow(absl::string_view program, absl::string_view message) {
  FlushOutput();
  std::fprintf(stderr, "%s: %s\n", std::string(program).c_str(),
               std::string(message).c_str());
  FlushOutput();
}

// Ends the process with `_exit(1)` after printing `message` (as PrintNow)
// unless destroyed within `timeout`: for waits that involve other processes
// and have no deadline of their own (MPI_Init_thread, MPI_Finalize,
// MPI_Abort). _exit, not exit: other threads may be inside MPI, and static
// destructors could block on them. mpirun ends the rest of the job when a
// process exits with an error.
class Watchdog {
 public:
  Watchdog(absl::Duration timeout, std::string program, std::string message)
      : thread_([this, timeout, program = std::move(program),
                 message = std::move(message)] {
          std::unique_lock<std::mutex> lock(mu_);
          const auto deadline =
              std::chrono::steady_clock::now() +
              absl::ToChronoNanoseconds(std::min(timeout, absl::Hours(24)));
          if (cv_.wait_until(lock, deadline, [this] { return disarmed_; })) {
            return;
          }
          PrintNow(program, message);
          _exit(1);
        }) {}
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;
  ~Watchdog() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      disarmed_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool disarmed_ = false;
  std::thread thread_;  // Last: started after the fields it reads.
};

// This process's rank in the job before MPI can tell it, from the
// launcher's environment; -1 when none says.
int LauncherRank() {
  for (const char* name :
       {"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID"}) {
    int rank = 0;
    const char* value = std::getenv(name);
    if (value != nullptr && absl::SimpleAtoi(value, &rank) && rank >= 0) {
      return rank;
    }
  }
  return -1;
}

// Errors after which the peers cannot be trusted to reach any further
// collective: a timeout, a broken or aborted communicator, a lost peer, an
// MPI error.
bool EndsCommunication(const absl::Status& status) {
  return absl::IsDeadlineExceeded(status) || absl::IsAborted(status) ||
         absl::IsUnavailable(status) || absl::IsInternal(status);
}

}  // namespace

namespace internal_mpi {

[[noreturn]] void AbortJob(absl::string_view program, absl::string_view who,
                           absl::string_view why) {
  PrintNow(program,
           absl::StrFormat("%s: ending the MPI job (MPI_Abort) %s", who, why));
  Watchdog fallback(
      absl::Seconds(2), std::string(program),
      absl::StrFormat("%s: MPI_Abort did not end this process within 2s; "
                      "exiting",
                      who));
  // The progress thread may be inside MPI_Test on an abandoned request;
  // MPI_Abort tears MPI down under it.
  Engine::Get().StopThread();
  MPI_Abort(MPI_COMM_WORLD, 1);
  _exit(1);
}

}  // namespace internal_mpi

absl::Status RunOnMpiWorld(
    const std::function<absl::Status(MpiCommunicator&)>& fn,
    const MpiOptions& options) {
  MpiWorldOptions world;
  world.comm = options;
  world.timeout = options.create_timeout;
  return RunOnMpiWorld(fn, world);
}

absl::Status RunOnMpiWorld(
    const std::function<absl::Status(MpiCommunicator&)>& fn,
    const MpiWorldOptions& options) {
  const std::string& program = options.program;
  const std::string start_timeout = absl::FormatDuration(options.start_timeout);
  const std::string timeout = absl::FormatDuration(options.timeout);
  std::string who = LauncherRank() >= 0
                        ? absl::StrFormat("rank %d", LauncherRank())
                        : std::string("this process");
  absl::StatusOr<MpiSession> session = [&] {
    Watchdog start(
        options.start_timeout, program,
        absl::StrFormat(
            "%s: MPI did not start within %s: MPI_Init waits for every "
            "process of the job, and at least one has not reached it "
            "(stopped, still starting, or not launched); exiting, so that "
            "mpirun ends the job",
            who, start_timeout));
    return MpiSession::Start(nullptr, nullptr);
  }();
  if (!session.ok()) return session.status();
  {
    int rank = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    who = absl::StrFormat("rank %d", rank);
  }
  absl::Status status;
  bool broken = false;
  // The exit handshake's own communicator: `fn` may have left the world's
  // collectives part-way on some ranks, and a handshake there could pair
  // with them.
  std::unique_ptr<MpiCommunicator> exit_comm;
  {
    // Communicators go before MPI is finalised.
    absl::StatusOr<std::unique_ptr<MpiCommunicator>> world =
        MpiCommunicator::CreateWorld(options.comm);
    if (world.ok()) {
      MpiOptions exit_options;
      exit_options.create_timeout = options.comm.create_timeout;
      // After a timeout, MPI writes nothing into this frame's buffers.
      exit_options.stage_buffers = true;
      absl::StatusOr<std::unique_ptr<MpiCommunicator>> made =
          MpiCommunicator::Wrap(MPI_COMM_WORLD, exit_options);
      if (made.ok()) exit_comm = *std::move(made);
      status = made.ok() ? fn(**world) : made.status();
      broken = !(*world)->health().ok();
    } else {
      status = world.status();
    }
  }
  if (!status.ok()) {
    PrintNow(program, status.message());
    status = MarkReported(std::move(status));
    if (broken || exit_comm == nullptr || EndsCommunication(status)) {
      AbortJob(program, who,
               "after the error above, so that no process waits for a peer "
               "that may never come");
    }
  }
  // Every rank says how it ended; a rank that does not arrive is named.
  // A rank that failed on its own waits twice as long: the peers it left
  // waiting in a collective then time out first and name it. Waiting no
  // longer than they do, it raced them (CI, a loaded machine: it aborted the
  // job first, naming as missing the peers that were waiting for it).
  double code = static_cast<double>(status.code());
  std::vector<double> codes(exit_comm->size());
  CollectiveOptions handshake;
  handshake.timeout = status.ok() ? options.timeout : 2 * options.timeout;
  const absl::Status met =
      exit_comm
          ->AllGather(
              ConstBufferRef{&code, 1, DType::kFloat64},
              BufferRef{codes.data(), exit_comm->size(), DType::kFloat64},
              handshake)
          ->Wait();
  if (!met.ok()) {
    AbortJob(program, who,
             absl::StrFormat("because the ranks did not all reach the end of "
                             "the run within %s: %s",
                             timeout, met.message()));
  }
  exit_comm.reset();
  absl::Status finished;
  {
    Watchdog finalize(
        options.timeout, program,
        absl::StrFormat("%s: MPI_Finalize did not complete within %s: a "
                        "peer stopped after the end of the run; exiting",
                        who, timeout));
    finished = session->Finish();
  }
  if (!status.ok()) return status;
  if (!finished.ok()) {
    PrintNow(program, finished.message());
    finished = MarkReported(std::move(finished));
  }
  return finished;
}

}  // namespace flatparam
