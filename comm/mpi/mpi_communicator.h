// The OpenMPI backend of the Communicator interface: host buffers, one rank
// per process, processes launched by `mpirun` (or Slurm's `srun` with PMIx)
// on one or many machines. It is also how NCCL ranks are launched and
// bootstrapped. How it works and why: DESIGN.md in this folder.
//
//   int main(int argc, char** argv) {
//     auto session = flatparam::MpiSession::Start(&argc, &argv);
//     if (!session.ok()) return 1;
//     auto world = flatparam::MpiCommunicator::CreateWorld();
//     if (!world.ok()) return 1;
//     ... (*world)->AllReduce(...)->Wait() ...
//     world->reset();  // Communicators go before MPI is finalized.
//   }                  // ~MpiSession calls MPI_Finalize.
//
// Launch with, for example,
//   mpirun --allow-run-as-root --oversubscribe --bind-to none -np 4 ./trainer
//
// The contract, beyond comm/communicator.h's:
//   * MPI is initialised (MPI_THREAD_MULTIPLE asked for) unless it already
//     is, and finalised only by whoever initialised it: the MpiSession, or
//     FinalizeMpi() after CreateWorld initialised it. Communicators and
//     Works go first.
//   * Reductions are comm/host_reduce.h's left fold in rank order, never
//     MPI's operators: bitwise equal to HostReduce() and the simulator.
//   * Collectives are zero-copy by default: after Wait() returned an error,
//     MPI may still read the input and write the output when late peers
//     arrive, so the caller keeps those buffers alive and unused (the error
//     says so). MpiOptions::stage_buffers buys the opposite guarantee with
//     one host copy each way.
//   * Issue collectives in the same order on every rank; Wait() on them in
//     any order. A background progress thread (with MPI_THREAD_MULTIPLE)
//     completes them while the rank computes.
//   * Wait() past the deadline (issue time + options.timeout) returns
//     DeadlineExceeded and breaks the communicator: later collectives fail
//     with Aborted without communicating. It never calls MPI_Abort
//     (RunOnMpiWorld does, after such an error).
//   * MpiOptions::check_collectives compares a header of each collective
//     (operation, sequence, counts, dtype, reduce op, root, FSDP context)
//     across the group first: a desynchronised call fails on every rank with
//     Internal naming each rank's call, before any data moves. Split always
//     checks.
//   * Every collective is recorded in the flight recorder
//     (comm/flight_recorder.h); a failed Wait() dumps it first.
//   * Error messages name collectives as "op #seq", seq counting every call
//     on the communicator from 0.
//
// Thread-safety: as Communicator, one thread at a time per communicator;
// different communicators may be used from different threads concurrently
// (MPI_THREAD_MULTIPLE). MpiSession and FinalizeMpi are not thread-safe.
#ifndef FLATPARAM_COMM_MPI_MPI_COMMUNICATOR_H_
#define FLATPARAM_COMM_MPI_MPI_COMMUNICATOR_H_

#include <mpi.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "comm/communicator.h"
#include "comm/flight_recorder.h"
#include "flatparam/base/status_macros.h"  // IsReported

namespace flatparam {

namespace internal_mpi {
struct CommState;
}  // namespace internal_mpi

struct MpiOptions {
  // Exchange and compare a header before every collective (see above).
  // Inherited by communicators made with Split().
  bool check_collectives = false;
  // How long CreateWorld()/Wrap() wait for the collective MPI_Comm_idup.
  absl::Duration create_timeout = kDefaultCollectiveTimeout;
  // Stage every collective's data through buffers it owns instead of
  // reading and writing the caller's buffers in place (see Memory above):
  // for callers that cannot keep their buffers alive and unused after a
  // timeout. Costs one host copy each way. Inherited by Split().
  bool stage_buffers = false;
  // The process's flight recorder (comm/flight_recorder.h), made by the
  // first communicator and shared by all: capacity 0 records nothing.
  FlightRecorderOptions flight_recorder = FlightRecorderOptionsFromEnv();
};

// Waits up to `grace` for collectives abandoned after a timeout to
// complete, then finalises MPI if flatparam initialised it (MpiSession::Start
// or CreateWorld) and it is not finalised yet. Does nothing when MPI is not
// initialised or already finalised.
// MPI_Finalize itself waits for every process of the job: it hangs if a
// peer never gets there. So when a timed-out collective is still pending
// after `grace` (its peer is stopped, dead or elsewhere), it does not
// finalise: it prints why (the timeout's message, naming the rank that
// sent nothing) and ends the whole job as RunOnMpiWorld does (MPI_Abort,
// _exit(1) 2 s later as a fallback), so that a program with its own main
// and MpiSession ends within the timeout plus `grace` too. Returns
// Internal if MPI_Finalize fails.
absl::Status FinalizeMpi(absl::Duration grace = absl::Seconds(1));

// How many collectives abandoned after a timeout MPI has not completed yet
// (each is tested once now). They complete when the missing peers join.
int PendingAbandonedMpiRequests();

// Bytes this process's collectives have copied between callers' buffers and
// staging buffers (MpiOptions::stage_buffers, or an all_gather whose input
// overlaps its output other than in place). Zero-copy collectives add
// nothing. For tests and benchmarks.
int64_t MpiStagedBytes();

// Whether a progress thread advances this process's collectives while no
// thread waits on them (see Progress above): MPI is initialised with
// MPI_THREAD_MULTIPLE and not finalised.
bool MpiHasProgressThread();

// Owns MPI's initialisation for a scope: Start() initialises MPI unless it
// already is, and the session that initialised it finalises it (FinalizeMpi)
// when destroyed or on Finish(). Move-only.
class MpiSession {
 public:
  // Calls MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE) unless MPI is
  // initialised. `argc`/`argv` may be null. FailedPrecondition if MPI was
  // already finalised (it cannot be initialised twice).
  static absl::StatusOr<MpiSession> Start(int* argc, char*** argv);

  MpiSession(MpiSession&& other) noexcept;
  MpiSession& operator=(MpiSession&& other) noexcept;
  MpiSession(const MpiSession&) = delete;
  MpiSession& operator=(const MpiSession&) = delete;
  ~MpiSession();

  // Whether this session initialised MPI (and so will finalise it).
  bool owns_mpi() const { return owns_mpi_; }
  // Finalises now if this session owns MPI and returns FinalizeMpi()'s
  // status; later calls and the destructor do nothing.
  absl::Status Finish();

 private:
  explicit MpiSession(bool owns_mpi) : owns_mpi_(owns_mpi) {}
  bool owns_mpi_ = false;
};

// This process's rank among the ranks on its node, from the launcher's
// environment (Open MPI's OMPI_COMM_WORLD_LOCAL_RANK; Slurm's SLURM_LOCALID),
// for choosing a GPU; 0 when neither is set.
int NodeLocalRank();

// A Communicator over an MPI communicator of its own (a duplicate, so that
// flatparam's traffic and error handler never touch the caller's). See the
// top of this file for the algorithms, timeouts and desync checks.
class MpiCommunicator final : public Communicator {
 public:
  // A communicator over every process of the job (a duplicate of
  // MPI_COMM_WORLD). Initialises MPI if needed; the caller must then call
  // FinalizeMpi() before exiting. Collective over MPI_COMM_WORLD.
  static absl::StatusOr<std::unique_ptr<MpiCommunicator>> CreateWorld(
      const MpiOptions& options = {});

  // A communicator over the processes of `comm` (duplicated with
  // MPI_Comm_idup; `comm` itself is not modified and may be freed after).
  // Collective over `comm`. InvalidArgument for MPI_COMM_NULL,
  // FailedPrecondition if MPI is not initialised, DeadlineExceeded after
  // options.create_timeout. Errors while duplicating are handled by `comm`'s
  // own error handler (MPI_ERRORS_ARE_FATAL unless the caller changed it).
  static absl::StatusOr<std::unique_ptr<MpiCommunicator>> Wrap(
      MPI_Comm comm, const MpiOptions& options = {});

  ~MpiCommunicator() override;

  int rank() const override;
  int size() const override;
  absl::string_view backend() const override { return "mpi"; }

  std::unique_ptr<Work> AllGather(ConstBufferRef input, BufferRef output,
                                  const CollectiveOptions& options) override;
  std::unique_ptr<Work> ReduceScatter(ConstBufferRef input, BufferRef output,
                                      const ReduceOptions& options) override;
  std::unique_ptr<Work> AllReduce(ConstBufferRef input, BufferRef output,
                                  const ReduceOptions& options) override;
  std::unique_ptr<Work> Broadcast(BufferRef buffer,
                                  const BroadcastOptions& options) override;
  absl::StatusOr<std::vector<std::string>> AllGatherBytes(
      absl::string_view bytes, const CollectiveOptions& options) override;
  absl::Status Barrier(const CollectiveOptions& options) override;
  // Also returns nullptr on ranks with a negative color.
  absl::StatusOr<std::unique_ptr<Communicator>> Split(
      int color, int key, const CollectiveOptions& options) override;

  // This communicator's own MPI communicator (for interoperation, such as
  // bootstrapping NCCL). Owned by this object; do not free it, do not
  // change its error handler, and send no point-to-point messages on it
  // (the collectives' exchanges use its point-to-point traffic).
  MPI_Comm mpi_comm() const;
  // OK while usable; otherwise the error (a timeout or an MPI error) that
  // broke it.
  absl::Status health() const;
  const MpiOptions& options() const;
  FlightRecorder* flight_recorder() const override;

 private:
  explicit MpiCommunicator(std::shared_ptr<internal_mpi::CommState> state);

  std::shared_ptr<internal_mpi::CommState> state_;
};

// RunOnMpiWorld's default bound on MPI's start.
inline constexpr absl::Duration kDefaultMpiStartTimeout = absl::Minutes(5);

// How RunOnMpiWorld starts and ends an MPI job.
struct MpiWorldOptions {
  // The world communicator's options (its create_timeout bounds the
  // world's creation).
  MpiOptions comm;
  // Bounds MPI_Init_thread, which waits for every process of the job.
  // Longer than a collective's timeout by default: a job's processes load
  // and start at their own pace (a loaded machine, a large binary, a slow
  // file system), while a collective's peers are already running.
  absl::Duration start_timeout = kDefaultMpiStartTimeout;
  // Bounds every wait of the job's end that involves the other processes:
  // the exit handshake (twice this on a rank whose fn failed) and
  // MPI_Finalize.
  absl::Duration timeout = kDefaultCollectiveTimeout;
  // Prefixes what RunOnMpiWorld prints: "<program>: <message>".
  std::string program = "flatparam";
};

// Starts MPI (if this process has not), runs `fn` on a world communicator,
// destroys the communicator and ends the job: the whole life of an MPI
// program's main(). It never waits without a deadline for a peer that may
// never come (a stopped or killed process, a cut link):
//
//  - Start. A watchdog bounds MPI_Init_thread by options.start_timeout: MPI's
//    start waits for every process of the job, so a process that never
//    reaches it (stopped, not launched) would hold the others forever. When
//    it fires, the process prints "<program>: rank R: MPI did not start
//    within T ..." and ends with _exit(1), which makes mpirun end the job.
//  - An error from `fn` is printed to stderr at once ("<program>:
//    <message>", flushed with stdout), before anything that may wait, so a
//    log always holds it, even if the job is killed afterwards. The status
//    returned then is marked so (IsReported() in
//    flatparam/base/status_macros.h), so the caller does not print it again.
//  - An error that leaves communication unusable (DeadlineExceeded, Aborted,
//    Unavailable or Internal, or a world communicator that `fn` broke) ends
//    the whole job at once: MPI_Abort on MPI_COMM_WORLD (every process of
//    the job is killed; mpirun prints its abort banner), with _exit(1) as a
//    fallback should MPI_Abort not end this process within 2 s. It never
//    waits in MPI_Finalize for a peer that may never arrive.
//  - Otherwise (success, or an error every rank can report on its own, such
//    as InvalidArgument) the ranks meet in an exit handshake, an all-gather
//    on a communicator of its own bounded by options.timeout (twice that
//    on a rank whose fn failed, so that peers still waiting for it in a
//    collective time out first and name it), and finalise MPI under a
//    watchdog with options.timeout. A rank that does not arrive (it failed
//    elsewhere, or it hangs) is named in the error, and the job is aborted
//    as above.
//
// So after a fault every process exits within about options.timeout of the
// collective that waited for the faulty peer (plus the MPI_Abort's spread),
// and a rank whose fn failed within twice options.timeout of its error.
// Returns fn's error, else the handshake's or finalisation's; on the abort
// paths it does not return. Call it once per process, from main's thread.
absl::Status RunOnMpiWorld(
    const std::function<absl::Status(MpiCommunicator&)>& fn,
    const MpiWorldOptions& options);
// The same with default MpiWorldOptions but for the communicator's options;
// options.create_timeout also bounds the end (the start keeps its default
// bound, kDefaultMpiStartTimeout).
absl::Status RunOnMpiWorld(
    const std::function<absl::Status(MpiCommunicator&)>& fn,
    const MpiOptions& options = {});

}  // namespace flatparam

#endif  // FLATPARAM_COMM_MPI_MPI_COMMUNICATOR_H_
