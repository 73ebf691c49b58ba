#include "comm/mpi/mpi_communicator.h"

#include <mpi.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"
#include "absl/time/time.h"
#include "comm/communicator.h"
#include "comm/flight_recorder.h"
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

// The process's flight recorder: one per MPI process (one rank), shared by
// every communicator; the first communicator's options make it.
std::shared_ptr<FlightRecorder> ProcessRecorder(
    const FlightRecorderOptions& options) {
  static std::mutex* mu = new std::mutex;
  static auto* recorder = new std::shared_ptr<FlightRecorder>;
  std::lock_guard<std::mutex> lock(*mu);
  if (*recorder == nullptr) {
    int rank = 0;
    int size = 1;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    *recorder = FlightRecorder::Create(rank, size, "mpi", options);
  }
  return *recorder;
}

// The world ranks of `comm`'s members, in its rank order.
std::vector<int> WorldRanks(MPI_Comm comm, int size) {
  std::vector<int> ranks(size), world(size);
  for (int i = 0; i < size; ++i) ranks[i] = i;
  MPI_Group group = MPI_GROUP_NULL;
  MPI_Group world_group = MPI_GROUP_NULL;
  if (MPI_Comm_group(comm, &group) != MPI_SUCCESS ||
      MPI_Comm_group(MPI_COMM_WORLD, &world_group) != MPI_SUCCESS ||
      MPI_Group_translate_ranks(group, size, ranks.data(), world_group,
                                world.data()) != MPI_SUCCESS) {
    world.clear();  // Unknown: the records say so.
  }
  if (group != MPI_GROUP_NULL) MPI_Group_free(&group);
  if (world_group != MPI_GROUP_NULL) MPI_Group_free(&world_group);
  return world;
}

// Takes ownership of `comm` (on success and on failure). `group_id` names
// the group in flight records.
absl::StatusOr<std::shared_ptr<CommState>> Adopt(MPI_Comm comm,
                                                 const MpiOptions& options,
                                                 std::string group_id) {
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
  if (options.flight_recorder.capacity > 0) {
    state->recorder = ProcessRecorder(options.flight_recorder);
    auto group = std::make_shared<FlightGroup>();
    group->id = std::move(group_id);
    group->ranks = WorldRanks(comm, state->size);
    state->group = std::move(group);
  }
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
  // The group's name in flight records: every member derives it alike.
  int world_size = 0;
  int size = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &world_size);
  MPI_Comm_size(comm, &size);
  // The k-th Wrap of the process (CreateWorld's included): "world" for
  // the first over every process, "world.<k>" and "wrap.<k>" after. Wrap
  // is collective, so every member counts alike.
  static std::atomic<int> wraps{0};
  const int k = wraps.fetch_add(1);
  std::string id = size != world_size ? absl::StrFormat("wrap.%d", k)
                   : k == 0           ? std::string("world")
                                      : absl::StrFormat("world.%d", k);
  FLATPARAM_ASSIGN_OR_RETURN(std::shared_ptr<CommState> state,
                             Adopt(memory->new_comm, options, std::move(id)));
  return std::unique_ptr<MpiCommunicator>(new MpiCommunicator(state));
}

int MpiCommunicator::rank() const { return state_->rank; }
int MpiCommunicator::size() const { return state_->size; }
MPI_Comm MpiCommunicator::mpi_comm() const { return state_->comm; }
absl::Status MpiCommunicator::health() const {
  return Engine::Get().Health(*state_);
}
const MpiOptions& MpiCommunicator::options() const { return state_->options; }
FlightRecorder* MpiCommunicator::flight_recorder() const {
  return state_->recorder.get();
}

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
  FLATPARAM_ASSIGN_OR_RETURN(
      std::shared_ptr<CommState> state,
      Adopt(comm, st.options,
            SplitGroupId(st.group != nullptr ? st.group->id : "world", info.seq,
                         color)));
  return std::unique_ptr<Communicator>(new MpiCommunicator(state));
}

}  // namespace flatparam
