#include "comm/mpi/mpi_communicator.h"

#include <mpi.h>

#include <memory>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"
#include "absl/time/time.h"
#include "comm/communicator.h"
#include "comm/mpi/internal/mpi_internal.h"
#include "flatparam/base/status_macros.h"

// MpiCommunicator itself: making one (CreateWorld, Wrap, Split) and its
// accessors. Its collectives are in mpi_collectives.cc;
// internal/mpi_internal.h says how the backend's files fit together.

namespace flatparam {

using internal_mpi::CommState;
using internal_mpi::Engine;
using internal_mpi::EnsureMpi;
using internal_mpi::FromMpi;
using internal_mpi::Header;
using internal_mpi::Launch;
using internal_mpi::Op;
using internal_mpi::OpCode;
using internal_mpi::OpInfo;
using internal_mpi::OpMemory;

MpiCommunicator::MpiCommunicator(std::shared_ptr<internal_mpi::CommState> state)
    : state_(std::move(state)) {}

MpiCommunicator::~MpiCommunicator() = default;

namespace {

// Takes ownership of `comm` (on success and on failure).
absl::StatusOr<std::shared_ptr<CommState>> Adopt(MPI_Comm comm,
                                                 const MpiOptions& options) {
  auto state = std::make_shared<CommState>();
  state->comm = comm;
  state->options = options;
  FLATPARAM_RETURN_IF_ERROR(
      FromMpi(MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN),
              "MPI_Comm_set_errhandler", "flatparam communicator"));
  FLATPARAM_RETURN_IF_ERROR(FromMpi(MPI_Comm_rank(comm, &state->rank),
                                    "MPI_Comm_rank", "flatparam communicator"));
  FLATPARAM_RETURN_IF_ERROR(FromMpi(MPI_Comm_size(comm, &state->size),
                                    "MPI_Comm_size", "flatparam communicator"));
  return state;
}

}  // namespace

absl::StatusOr<std::unique_ptr<MpiCommunicator>> MpiCommunicator::CreateWorld(
    const MpiOptions& options) {
  bool initialized_here = false;
  FLATPARAM_RETURN_IF_ERROR(EnsureMpi(nullptr, nullptr, &initialized_here));
  return Wrap(MPI_COMM_WORLD, options);
}

absl::StatusOr<std::unique_ptr<MpiCommunicator>> MpiCommunicator::Wrap(
    MPI_Comm comm, const MpiOptions& options) {
  int initialized = 0;
  int finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (!initialized || finalized) {
    return absl::FailedPreconditionError(
        "MpiCommunicator::Wrap needs MPI to be initialized and not finalized");
  }
  if (comm == MPI_COMM_NULL) {
    return absl::InvalidArgumentError(
        "MpiCommunicator::Wrap got MPI_COMM_NULL");
  }
  int rank = 0;
  FLATPARAM_RETURN_IF_ERROR(
      FromMpi(MPI_Comm_rank(comm, &rank), "MPI_Comm_rank", "Wrap"));
  // The duplication goes through the engine like a collective (of no
  // communicator's queue), so that a timed-out MPI_Comm_idup is kept and
  // completed like an abandoned collective: MPI writes the new handle into
  // the op's memory when the request completes, possibly after a timeout.
  auto op = std::make_shared<Op>(nullptr, OpInfo{rank, OpCode::kSplit, -1, ""},
                                 options.create_timeout);
  op->label = absl::StrFormat("rank %d: Wrap", rank);
  OpMemory* memory = &op->memory;
  op->steps.push_back({"MPI_Comm_idup",
                       [comm, memory](MPI_Request* request) {
                         return MPI_Comm_idup(comm, &memory->new_comm, request);
                       },
                       nullptr});
  Engine::Get().Submit(op);
  const absl::Status status = Engine::Get().Wait(*op);
  if (absl::IsDeadlineExceeded(status)) {
    return absl::DeadlineExceededError(absl::StrFormat(
        "%s: MPI_Comm_idup did not complete within %s: not every process of "
        "the communicator called CreateWorld/Wrap",
        op->label, absl::FormatDuration(options.create_timeout)));
  }
  FLATPARAM_RETURN_IF_ERROR(status);
  FLATPARAM_ASSIGN_OR_RETURN(std::shared_ptr<CommState> state,
                             Adopt(memory->new_comm, options));
  return std::unique_ptr<MpiCommunicator>(new MpiCommunicator(state));
}

int MpiCommunicator::rank() const { return state_->rank; }
int MpiCommunicator::size() const { return state_->size; }
MPI_Comm MpiCommunicator::mpi_comm() const { return state_->comm; }
absl::Status MpiCommunicator::health() const {
  return Engine::Get().Health(*state_);
}
const MpiOptions& MpiCommunicator::options() const { return state_->options; }

absl::StatusOr<std::unique_ptr<Communicator>> MpiCommunicator::Split(
    int color, int key, const CollectiveOptions& options) {
  const CommState& st = *state_;
  const OpInfo info{st.rank, OpCode::kSplit, state_->next_seq++,
                    absl::StrFormat("color %d, key %d", color, key)};
  Header header;
  header.seq = info.seq;
  header.op = static_cast<int32_t>(info.code);
  header.pre_divide = header.post_divide = 1.0;
  // MPI_Comm_split blocks with no timeout: the header exchange first makes
  // sure every rank has arrived (and called split), so it cannot hang. By
  // then every collective issued before it has started all its steps (the
  // engine starts steps in issue order), so MPI sees the same order on
  // every rank.
  FLATPARAM_RETURN_IF_ERROR(Launch(state_, info, options.timeout,
                                   absl::OkStatus(), header, /*check=*/true,
                                   nullptr)
                                ->Wait());
  MPI_Comm comm = MPI_COMM_NULL;
  absl::Status status = FromMpi(
      MPI_Comm_split(st.comm, color < 0 ? MPI_UNDEFINED : color, key, &comm),
      "MPI_Comm_split", info.Describe());
  if (!status.ok()) {
    Engine::Get().Break(*state_, status);
    return status;
  }
  if (comm == MPI_COMM_NULL) return std::unique_ptr<Communicator>();
  FLATPARAM_ASSIGN_OR_RETURN(std::shared_ptr<CommState> state,
                             Adopt(comm, st.options));
  return std::unique_ptr<Communicator>(new MpiCommunicator(state));
}

}  // namespace flatparam
