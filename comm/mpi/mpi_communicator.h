// The OpenMPI backend of the Communicator interface: host buffers, one rank
// per process, processes launched by `mpirun` (or Slurm's `srun` with PMIx)
// on one or many machines. It is also how NCCL ranks are launched and
// bootstrapped.
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
// Initialisation and finalisation. MpiSession::Start and CreateWorld call
// MPI_Init_thread (asking for MPI_THREAD_MULTIPLE) unless MPI is already
// initialised. flatparam finalises MPI only if it initialised it: when the
// MpiSession that initialised it is destroyed or finished, or, after
// CreateWorld initialised it, when the caller calls FinalizeMpi(). A program
// that initialised MPI itself also finalises it itself. Every communicator
// and Work should be destroyed before MPI is finalised; one that outlives it
// skips MPI_Comm_free. When flatparam initialises MPI it also sets
// MPI_COMM_WORLD's error handler to MPI_ERRORS_RETURN, because OpenMPI 4.1
// reports errors found while testing a nonblocking collective through
// MPI_COMM_WORLD's handler rather than the collective's communicator's; a
// program that initialises MPI itself does the same if it wants those
// errors as a Status rather than a job abort.
//
// Algorithms. Reductions never use MPI's reduction operators: MPI has no
// float16/bfloat16 types, and its summation order depends on the MPI
// library and the process layout. Data moves as raw elements (MPI_FLOAT,
// MPI_DOUBLE, or MPI_UINT16_T for 16-bit floats) and every reduction is the
// left fold in rank order of comm/host_reduce.h, done locally, so results
// are bitwise identical to HostReduce() and to the simulator. The data
// collectives are linear exchanges of point-to-point messages
// (MPI_Irecv from every other rank, then MPI_Isend to every other rank, on
// the communicator with one reserved tag): measured with Open MPI 4.1 on
// one node, they ran at 1.0-1.5x MPI's blocking collectives where its
// nonblocking ones (MPI_Iallgather & co.) ran at 0.45-1.0x. Every rank
// exchanges with every other: across many nodes a ring or a tree would use
// the network better.
//   all_gather        every rank's input to every rank.
//   reduce_scatter    slice i of every rank's input to rank i (an
//                     all-to-all), then a local fold.
//   all_reduce        the same over size() near-equal chunks, then an
//                     all-gather of the reduced chunks in place in the
//                     output; while the size() inputs total at most 64 KiB,
//                     every rank's whole input to every rank and a local
//                     fold (one exchange: latency dominates there).
//   broadcast         MPI_Ibcast.
//   barrier           MPI_Ibarrier.
//   all_gather_bytes  MPI_Iallgather of the lengths, then MPI_Iallgatherv.
//   split             a header exchange (below), then MPI_Comm_split.
// MPI counts are ints: a collective whose per-rank element count (or
// all_gather_bytes' total length) exceeds INT_MAX fails with Unimplemented.
//
// Memory. By default all_gather, reduce_scatter, all_reduce and broadcast
// are zero-copy: MPI sends straight from the caller's input and receives
// straight into the caller's output (all_gather, broadcast, all_reduce's
// all-gather phase; all_gather copies this rank's own block locally unless
// in place). reduce_scatter and all_reduce receive the other ranks'
// contributions into a receive buffer the collective owns (pooled; about the
// input's size) and fold them straight into the caller's output. As
// comm/communicator.h says, the caller keeps every buffer alive and untouched
// until Wait() has returned; once it returned OK, nothing touches them any
// more. After Wait() returned DeadlineExceeded (or an MPI error), MPI may still
// read the input and write the output later, when the late peers arrive: MPI
// cannot cancel a collective. The process must then keep those buffers alive
// and not reuse them (or exit); the error message says so. Callers that cannot
// give that guarantee set MpiOptions::stage_buffers: each collective then
// copies its input into buffers it owns when issued and copies the result
// out before its Wait() returns, so that once Wait() has returned, even with
// DeadlineExceeded, nothing touches the caller's buffers again; the price is
// one extra host copy each way and staging memory of about the input plus
// the output size. MpiStagedBytes() counts the bytes copied that way.
//
// Progress. MPI advances nonblocking collectives only inside MPI calls, so
// every process has one progress engine for all its communicators. A thread
// blocked in Wait() drives it: it tests every collective in flight back to
// back (MPI itself yields the CPU on an oversubscribed node) and, after
// 10 ms without a completion, with naps doubling up to 0.25 ms. While no
// thread waits -- the rank computes between issuing a collective and
// waiting on it -- a progress thread drives it instead, so that the
// collective completes and this rank's peers are not held up: it polls with
// naps of at most 0.2 ms while collectives are in flight, sleeps otherwise,
// and looks for new collectives every millisecond (after a quiet spell, the
// next collective wakes it). Whoever drives also runs the later steps of
// multi-step collectives (reduce_scatter's fold, all_reduce's fold and
// all-gather, the data step of a checked collective), so a collective can
// be complete before Wait() is called. The progress thread exists only when
// MPI provides MPI_THREAD_MULTIPLE (MpiSession::Start and CreateWorld ask
// for it; Debian's OpenMPI 4.1 provides it; MpiHasProgressThread() tells).
// With less (a program that initialised MPI itself with
// MPI_THREAD_FUNNELED or SERIALIZED), flatparam calls MPI only on the
// threads that call flatparam, and collectives progress only inside Wait()
// and the calls that issue them. MPI_Finalize stops the thread (through an
// attribute on MPI_COMM_SELF), also when the program finalises MPI itself.
//
// Ordering. MPI matches collectives on a communicator by the order in which
// they are started. Each collective starts all its steps before the next
// collective issued on the same communicator starts its first one: a
// collective issued while the one before it is part-way waits in a queue
// (NCCL serialises collectives on a communicator the same way), and each
// step starts as soon as the previous one completes. So MPI sees the same
// order on every rank however the completions interleave with the ranks'
// calls: issue collectives in the same order on every rank, and Wait() on
// them in any order.
//
// Timeouts and failures. A collective's deadline is its issue time plus
// options.timeout. When Wait() passes it, Wait() returns DeadlineExceeded and
// marks the communicator broken: every later collective on it, and the later
// steps of collectives already issued (and those still queued), fail at once
// with Aborted and do not communicate, because which collectives the peers
// have matched is unknown and anything further could pair mismatched
// operations. Only Wait() enforces the deadline: a collective that completed
// in the background before its Wait() is OK even if its deadline has passed.
// The communicator never calls MPI_Abort, which would kill every process of
// the job; RunOnMpiWorld does, after such an error (see there). The timed-out
// MPI request and the memory it owns are kept alive (MPI forbids freeing an
// active collective request) and tested by the engine until MPI completes
// them (zero-copy, MPI then writes the caller's output: see Memory); they
// complete if the missing peers call the collective late
// (PendingAbandonedMpiRequests() counts those still pending), and
// FinalizeMpi() waits a grace period for them. MPI errors (the
// communicators use MPI_ERRORS_RETURN) become Internal with MPI_Error_string's
// text and also mark the communicator broken. When a peer process dies, mpirun
// by default kills the whole job (OpenMPI 4 has no fault tolerance); when the
// survivors keep running (a hung peer, a launcher that does not kill them),
// the loss shows up as DeadlineExceeded.
//
// Desynchronisation. MPI checks almost nothing across ranks: ranks that call
// different collectives, or the same one with different counts, dtypes,
// roots or reduce ops, get undefined behaviour: a hang (which the timeout
// catches), an MPI_ERR_TRUNCATE error, or silently wrong data. With
// MpiOptions::check_collectives, every collective first all-gathers a small
// header (operation, sequence number, per-rank count, dtype, reduce op,
// divide factors, root, whether the local arguments were valid, and a hash
// of the FSDP context the caller set in the flight recorder, so that equal
// collectives issued from different units disagree), and if the
// ranks disagree every rank fails, before any data moves, with Internal
// naming each rank's call; a rank whose own arguments were invalid gets its
// own InvalidArgument/Unimplemented error and the others get Internal. The
// group stays usable afterwards. The check costs one small all-gather per
// collective. Split always performs it. What remains undetectable: ranks
// waiting on collectives of different communicators (a cross-group
// deadlock, reported as a timeout) and, without the check, everything above.
// Without the check, a call with invalid arguments fails on its own rank at
// once without communicating, and its peers time out.
//
// Sequence numbers count every collective call on a communicator, starting
// at 0, including calls that fail; error messages name them as "op #seq".
//
// Flight recorder. Every collective is recorded in the process's
// FlightRecorder (comm/flight_recorder.h; MpiOptions::flight_recorder):
// enqueued at the call, started when its first MPI step starts, completed
// when its last finishes, failed when Wait() returns the error (which dumps
// the ring to the trace directory, if one is set, before Wait returns).
//
// Thread-safety: as Communicator, one thread at a time per communicator, and
// its Works are waited on from that thread. Different communicators may be
// used from different threads concurrently when MPI provides
// MPI_THREAD_MULTIPLE (Debian's OpenMPI 4.1 does). The progress thread is
// internal: from the issuing call until its Wait() returns, a collective's
// buffers (the caller's and its own) belong to whichever thread drives the
// engine; the engine's mutex orders every hand-over (a collective is marked
// done under it after its last write, and Wait() returns after reading that
// mark under it). MpiSession and FinalizeMpi are not thread-safe.
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
  // the exit handshake and MPI_Finalize.
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
//    on a communicator of its own bounded by options.timeout, and finalise
//    MPI under a watchdog with the same bound. A rank that does not arrive
//    (it failed elsewhere, or it hangs) is named in the error, and the job
//    is aborted as above.
//
// So after a fault every process exits within about options.timeout of the
// collective that waited for the faulty peer (plus the MPI_Abort's spread).
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
