// MPI's initialisation and finalisation: MpiSession and FinalizeMpi (see
// "Initialisation and finalisation" in DESIGN.md).
#include <mpi.h>

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "comm/mpi/internal/mpi_internal.h"
#include "comm/mpi/mpi_communicator.h"
#include "flatparam/base/status_macros.h"

namespace flatparam {

using internal_mpi::AbortJob;
using internal_mpi::Engine;
using internal_mpi::EnsureMpi;
using internal_mpi::FromMpi;

namespace {

// Whether flatparam called MPI_Init_thread (and so owns MPI_Finalize).
bool g_flatparam_initialized_mpi = false;

absl::Status InitMpi(int* argc, char*** argv) {
  int provided = 0;
  const int rc = MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &provided);
  FLATPARAM_RETURN_IF_ERROR(FromMpi(rc, "MPI_Init_thread", "flatparam"));
  g_flatparam_initialized_mpi = true;
  // OpenMPI 4.1 reports errors found while testing a nonblocking
  // collective's request through MPI_COMM_WORLD's error handler, not the
  // request's communicator's, so without this they abort the job instead
  // of becoming a Status.
  return FromMpi(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN),
                 "MPI_Comm_set_errhandler(MPI_COMM_WORLD)", "flatparam");
}

}  // namespace

namespace internal_mpi {

absl::Status EnsureMpi(int* argc, char*** argv, bool* initialized_here) {
  *initialized_here = false;
  int initialized = 0;
  int finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (finalized) {
    return absl::FailedPreconditionError(
        "MPI was already finalized and cannot be initialized again");
  }
  if (initialized) return absl::OkStatus();
  FLATPARAM_RETURN_IF_ERROR(InitMpi(argc, argv));
  *initialized_here = true;
  return absl::OkStatus();
}

}  // namespace internal_mpi

absl::Status FinalizeMpi(absl::Duration grace) {
  int initialized = 0;
  int finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (!initialized || finalized) return absl::OkStatus();
  const absl::Time deadline = absl::Now() + grace;
  while (Engine::Get().PendingAbandoned() > 0 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  if (!g_flatparam_initialized_mpi) return absl::OkStatus();
  // A collective that timed out and that its peers never completed: a peer
  // is stopped, gone or elsewhere, and MPI_Finalize, which waits for every
  // process, would wait for it forever. End the job instead, however the
  // program got here (its own main and MpiSession, a test harness).
  if (Engine::Get().PendingAbandoned() > 0) {
    int rank = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    AbortJob("flatparam", absl::StrFormat("rank %d", rank),
             absl::StrFormat(
                 "instead of finalising MPI: a collective of this process "
                 "timed out and its peers never completed it (%s), so a "
                 "peer may never reach MPI_Finalize",
                 Engine::Get().FirstBreak().message()));
  }
  g_flatparam_initialized_mpi = false;
  // MPI_Finalize would stop it too (StopEngineOnFinalize); stopping first
  // keeps MPI_Finalize from starting while the thread is inside MPI.
  Engine::Get().StopThread();
  return FromMpi(MPI_Finalize(), "MPI_Finalize", "flatparam");
}

absl::StatusOr<MpiSession> MpiSession::Start(int* argc, char*** argv) {
  bool initialized_here = false;
  FLATPARAM_RETURN_IF_ERROR(EnsureMpi(argc, argv, &initialized_here));
  return MpiSession(initialized_here);
}

MpiSession::MpiSession(MpiSession&& other) noexcept
    : owns_mpi_(std::exchange(other.owns_mpi_, false)) {}

MpiSession& MpiSession::operator=(MpiSession&& other) noexcept {
  if (this != &other) {
    Finish().IgnoreError();
    owns_mpi_ = std::exchange(other.owns_mpi_, false);
  }
  return *this;
}

MpiSession::~MpiSession() { Finish().IgnoreError(); }

absl::Status MpiSession::Finish() {
  if (!owns_mpi_) return absl::OkStatus();
  owns_mpi_ = false;
  return FinalizeMpi();
}

}  // namespace flatparam
