// The deterministic multi-rank simulator: a world of in-process ranks that
// run one function each and talk through simulated collectives that
// implement the Communicator interface (comm/communicator.h).
//
//   SimOptions options;
//   options.world_size = 8;
//   options.seed = 42;
//   FLATPARAM_ASSIGN_OR_RETURN(std::unique_ptr<SimWorld> world,
//                              SimWorld::Create(options));
//   absl::Status status = world->Run([](Communicator& comm) -> absl::Status {
//     std::vector<float> x(16, comm.rank());
//     BufferRef buf{x.data(), 16, DType::kFloat32};
//     return comm.AllReduce(buf, buf, {})->Wait();
//   });
//   FLATPARAM_RETURN_IF_ERROR(world->WriteChromeTrace("/tmp/trace.json"));
//
// Scheduling. Each rank runs on its own thread (or, with
// SimOptions::Execution::kFibers, as a fiber on one thread: a resumable
// task with its own stack, for thousands of ranks), but a baton makes sure
// that exactly one rank runs at a time. A rank gives up the baton only at a
// scheduling point: when it issues a collective (unless
// SimOptions::yield_on_issue is off), waits on an unfinished Work, calls
// SimCommunicator::Yield() or returns. The next rank to run is
// drawn from the runnable ranks by one PRNG seeded with SimOptions::seed,
// so a seed fixes the interleaving (schedule()), and with it every byte and
// trace event of a deterministic program; other seeds explore other
// interleavings. Ranks may share memory without locks, since no two run at
// once, but must not block on each other outside the simulator (a rank that
// waits on a real mutex or condition variable that only another rank can
// release stalls the world; see SimOptions::stall_timeout).
//
// Collectives. A collective is matched by (group, sequence number): the n-th
// call of each member of a group belongs to operation n. It executes when
// its last member arrives: data moves with memmove, and reductions fold
// contributions in group-rank order with HostReduceStep/HostReduceFinish, so
// results are bitwise reproducible. Issuing never blocks; Work::Wait() on
// an unfinished operation blocks the rank until the operation runs. Only
// host buffers are accepted (Unimplemented otherwise); besides the checks of
// ValidateAllGather etc., a partial overlap of input and output other than
// the documented in-place layout is an InvalidArgument.
//
// Errors (all name the rank, op, sequence number and group):
//   * Argument errors: the caller's Work fails with the validator's status at
//     once, and its peers' Works of the same operation fail with the same
//     code, naming the offending rank, instead of waiting for it.
//   * Desynchronisation: members that issue different collectives (kind,
//     count, dtype, reduce op or factors, root) at the same sequence number
//     all get Internal with a per-rank listing of what each issued; the
//     group is then aborted (later collectives on it fail with Aborted).
//   * Deadlock: when no rank can run but some wait (a rank returned early, a
//     rank waits on a group its peers never use, ...), every unfinished
//     operation fails with Internal listing, for every rank, what it waits
//     on (op and sequence number), or that it returned or died; the groups
//     involved are aborted. Detection is exact and immediate: nothing is
//     left to hang and no wall-clock timeout is involved.
//   * Timeouts are on the virtual clock, so they are as reproducible as the
//     rest: a member whose wait for the operation to start (for its slowest
//     peer) exceeds its CollectiveOptions::timeout makes the operation fail
//     with DeadlineExceeded on every member, naming that member and the last
//     rank to be ready, and the group is aborted, as NCCL's watchdog would.
//     A peer that never arrives is a deadlock (above), reported at once.
//
// Faults (sim/fault.h):
//   * kill:rank=R:op=K: rank R's collective K and every later call on any of
//     its communicators fail with Aborted; every group containing R is
//     aborted, so its peers' unfinished and later collectives in those groups
//     fail with Aborted naming rank R and its op. R's function keeps running
//     (a thread cannot be killed) and should return its error.
//   * delay:rank=R:seconds=S[:op=K]: R's clock advances by S before each of
//     its collectives (or only collective K); peers start late with it, and
//     fail with DeadlineExceeded when S exceeds their timeout.
//   * flip:rank=R:op=K[:bit=B]: one bit of the payload R sends in collective
//     K is flipped on its way to the other members (for a broadcast where R
//     is not the root, in the copy R receives). Without checksums the
//     corrupted data is delivered silently. With SimOptions::checksum, each
//     sender's payload is hashed (XXH3-64) when issued and again when
//     delivered, so the operation fails with DataLoss on every member,
//     naming the sender and the ranks that received the bad data; this also
//     catches a buffer modified between issue and completion. A flip on an
//     operation without payload (barrier, split, empty buffers) or a bit past
//     the payload fails that operation with FailedPrecondition. At most one
//     flip takes effect per operation (the lowest group rank's).
//
// Virtual time. Each rank has a virtual clock. Before each collective it
// advances by CostModel::compute_per_op (plus any delay fault); that is the
// rank's arrival time (or, for a collective a device queue issues, the
// later time SimCommunicator::ArriveNextAt gave). Each rank has one
// communication stream: an operation starts at the latest of its members'
// arrivals and the ends of their previous operations -- previous in issue
// order with SimOptions::one_stream_per_rank, in the order operations
// became complete otherwise -- and lasts latency + bytes * bus_factor /
// bytes_per_second (nccl-tests' bytes and bus factors, so a measured busbw
// can be plugged in), or CostModel::collective_time. Wait() advances the
// rank's clock to the operation's end. SimCommunicator::Compute() models
// computation between collectives; sim/sim_device.h models device streams
// on the same clock.
//
// Trace. Every collective call gives one TraceEvent per rank (failed ones
// too, with their status), and ChromeTraceJson() renders them as Chrome
// trace-event JSON (one track per rank; opens in Perfetto or
// chrome://tracing). Equal seeds give byte-identical JSON. The slices do
// not depend on the interleaving at all (only on the ranks' programs, the
// options and the faults), with one exception: groups made by Splits of
// different parent groups are numbered in the order those Splits complete.
//
// Ownership and thread-safety: SimWorld owns the ranks' threads and all
// simulator state. Run() may be called once, from one thread. Communicators
// (the one passed to the rank function and those returned by Split) and
// Work handles belong to their rank's thread and must not outlive Run(). A
// Work destroyed before it finished fails its operation on every member
// with FailedPrecondition, since its buffers may be gone. The accessors
// (rank_statuses(), trace(), ...) may be called after Run() returns.
#ifndef FLATPARAM_SIM_SIM_H_
#define FLATPARAM_SIM_SIM_H_

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "comm/communicator.h"
#include "comm/flight_recorder.h"
#include "sim/fault.h"

namespace flatparam {

// The alpha-beta cost of a collective on the virtual clock.
struct CostModel {
  // alpha: fixed cost of every collective.
  absl::Duration latency = absl::Microseconds(10);
  // beta: bus bandwidth in bytes per second (nccl-tests' busbw). Must be
  // positive.
  double bytes_per_second = 100e9;
  // Virtual compute time every rank spends before each collective it issues.
  absl::Duration compute_per_op = absl::ZeroDuration();
  // When set, the duration of every collective, instead of latency + bytes
  // * bus factor / bytes_per_second: called (under the simulator's lock,
  // so it must not call back into the simulator) with the operation, its
  // nccl-tests size in bytes and the world ranks of its group in group-rank
  // order -- e.g. sim/cost_model.h's CollectiveTime on a topology, so that
  // a simulated run and `fsdp plan` price collectives alike.
  std::function<absl::Duration(CollectiveOp op, int64_t bytes,
                               const std::vector<int>& world_ranks)>
      collective_time;
};

struct SimOptions {
  // Number of ranks, >= 1.
  int world_size = 1;
  // Seeds the scheduler's PRNG and flip faults without a bit.
  uint64_t seed = 0;
  std::vector<FaultSpec> faults;
  // Hash every payload when sent and when delivered; see "Faults" above.
  bool checksum = false;
  CostModel cost;
  // Wall-clock limit on one rank holding the baton without reaching a
  // scheduling point. A rank that blocks outside the simulator can neither
  // be preempted nor unblocked, so when this passes the simulator prints
  // which rank holds the baton and what every rank waits on to stderr and
  // aborts the process rather than hang. absl::InfiniteDuration() disables.
  absl::Duration stall_timeout = absl::Minutes(5);
  // Stack size of each rank's thread or fiber: small, so that thousands of
  // ranks are cheap; raise it for rank functions with large stack frames.
  size_t stack_bytes = 1 << 20;
  // How the ranks run. kThreads: a thread per rank, the baton handed from
  // thread to thread. kFibers: every rank is a fiber (its own stack, a
  // ucontext) on one thread, resumed where it gave up the baton, so a
  // hand-off is a user-space context switch rather than a wake-up through
  // the kernel -- what makes a step at thousands of ranks affordable
  // (`fsdp plan --simulate`). Schedules, results, detection and the stall
  // check are the same (the stall check watches from the calling thread).
  // Fibers share their thread's thread_local variables: a rank function
  // keeping per-rank state in them needs kThreads.
  enum class Execution : uint8_t { kThreads, kFibers };
  Execution execution = Execution::kThreads;
  // Issuing a collective is a scheduling point (the baton may pass to
  // another rank), so that seeds explore interleavings of issues. Off, a
  // rank keeps the baton until it waits on an unfinished operation, yields
  // or returns: fewer hand-offs, the same results (virtual time does not
  // depend on the interleaving), fewer interleavings explored.
  bool yield_on_issue = true;
  // Every rank's collectives, over all its groups, run in the order the
  // rank issued them, as NCCL's do on one CUDA stream: an operation starts
  // only once it is the oldest unfinished operation of each of its
  // members, so its start on the virtual clock follows each member's
  // previously issued operation (see "Virtual time"). Ranks that issue the
  // collectives of different groups in orders that cannot be reconciled
  // then deadlock, as they would under NCCL, and the deadlock is reported.
  // Off, an operation runs as soon as all its members have issued it, and
  // a rank's communication stream serves operations in that order.
  bool one_stream_per_rank = false;
  // Run every rank's thread on one CPU, the one Run() is called on. Only one
  // rank runs at a time anyway, and handing the baton to a thread on the
  // same CPU is an order of magnitude cheaper than waking one on another
  // CPU (1.6 us against 21 us per hand-off on the 2-core CI machine). Turn
  // it off when that CPU is busy with other work.
  bool single_cpu = true;
  // Collectives carry sizes, not data: buffers are checked, matched,
  // ordered and timed as usual, but no byte is read or written, so their
  // pointers may be placeholders that map no memory (SimDeviceOptions::
  // metadata_only's) -- how `fsdp plan --simulate` runs a step of a model
  // far larger than this machine. AllGatherBytes and Split still move their
  // (small, host) payloads. Checksums and flip faults, which need the
  // bytes, are refused with it.
  bool metadata_only = false;
  // Members of an operation must also agree on the FSDP context their
  // callers set (the unit and phase of the rank's flight recorder context,
  // comm/flight_recorder.h), as `--desync-check` makes real backends check:
  // ranks that issue equal collectives from different units (one skipped a
  // unit, or ran a conditional one) are desynchronised at that operation
  // rather than silently exchanging the wrong unit's data. A member with no
  // context matches any. Needs the flight recorder (capacity > 0).
  bool check_context = false;
  // Keep every collective call's TraceEvent (trace(), ChromeTraceJson()).
  // Off, trace() stays empty: at thousands of ranks the events are most of
  // the simulator's memory.
  bool keep_trace = true;
  // Each rank's flight recorder (comm/flight_recorder.h): every collective
  // of the rank, on any of its groups, with the FSDP context its caller
  // set. Capacity 0 records nothing.
  FlightRecorderOptions flight_recorder = FlightRecorderOptionsFromEnv();
};

// One collective call of one rank, on the virtual clock.
struct TraceEvent {
  int rank = 0;        // world rank: the trace track
  std::string name;    // "all_gather", "reduce_scatter", "all_reduce",
                       // "broadcast", "all_gather_bytes", "barrier", "split"
  std::string detail;  // e.g. "16 x float32, sum"
  int group = 0;       // 0 is the world; Split numbers groups from 1
  int group_rank = 0;
  int64_t seq = 0;    // sequence number in the group
  int64_t op = 0;     // the rank's collective index (FaultSpec::op)
  int64_t bytes = 0;  // nccl-tests' size: all-gather output, reduce-scatter
                      // input, all-reduce/broadcast buffer, all-gather-bytes
                      // total; 0 for barrier and split
  absl::Duration arrive;  // the rank's clock when it issued the collective
  absl::Duration start;   // when the operation started
  absl::Duration end;     // when the rank's Wait() returns
  absl::Status status;
};

class SimWorld;
class ChromeTrace;  // sim/chrome_trace.h

namespace internal_sim {
using OpKind = ::flatparam::CollectiveOp;
struct Call;
class FiberContext;
}  // namespace internal_sim

// The Communicator of one rank in one group of a SimWorld. Besides the
// interface it lets a rank yield and model computation on its virtual clock.
// Used only on its rank's thread, during Run().
class SimCommunicator final : public Communicator {
 public:
  ~SimCommunicator() override;

  int rank() const override { return group_rank_; }
  int size() const override { return group_size_; }
  absl::string_view backend() const override { return "sim"; }

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
  absl::StatusOr<std::unique_ptr<Communicator>> Split(
      int color, int key, const CollectiveOptions& options) override;
  // The rank's recorder, shared by all its groups.
  FlightRecorder* flight_recorder() const override;

  // This rank's index in the world (rank() is its index in this group).
  int world_rank() const { return world_rank_; }
  // The group's id: 0 for the world, then 1, 2, ... in order of creation.
  int group_id() const { return group_id_; }
  // A scheduling point: the PRNG picks the next rank to run, which may be
  // this one.
  void Yield();
  // Advances this rank's virtual clock by `duration`. InvalidArgument unless
  // it is finite and non-negative.
  absl::Status Compute(absl::Duration duration);
  // This rank's virtual clock.
  absl::Duration Now() const;
  // For device-queued collectives (sim/sim_device.h's stream-ordered
  // mode): the next collective this rank issues, on any of its
  // communicators, arrives at the later of `t` and the rank's clock, which
  // does not move (a device queue issues it, not the host).
  void ArriveNextAt(absl::Duration t);
  // Waits for `work` (a Work of this rank's communicators) as a device
  // stream would: blocks until the operation is done and returns its end
  // on the virtual clock, leaving the rank's clock alone (a later Wait()
  // advances it as usual). A Work of another backend is simply waited on;
  // its end is then the rank's clock.
  absl::Duration WaitOnDevice(Work& work);

 private:
  friend class SimWorld;
  SimCommunicator(SimWorld* world, int world_rank, int group_id, int group_rank,
                  int group_size)
      : world_(world),
        world_rank_(world_rank),
        group_id_(group_id),
        group_rank_(group_rank),
        group_size_(group_size) {}

  SimWorld* world_;
  int world_rank_;
  int group_id_;
  int group_rank_;
  int group_size_;
};

class SimWorld {
 public:
  // InvalidArgument for world_size < 1, a non-positive bandwidth, a negative
  // latency or compute time, stack_bytes under 64 KiB, a fault whose rank
  // is outside the world, or metadata_only with checksums or a flip fault.
  static absl::StatusOr<std::unique_ptr<SimWorld>> Create(SimOptions options);

  ~SimWorld();
  SimWorld(const SimWorld&) = delete;
  SimWorld& operator=(const SimWorld&) = delete;

  using RankFn = std::function<absl::Status(SimCommunicator&)>;

  // Runs `fn` once per rank, each with its world communicator, and returns
  // when every rank has returned. OK when every rank returned OK; otherwise
  // an error with the code of the lowest failing rank and a message listing
  // the failing ranks' statuses (the first few; rank_statuses() has all).
  // A function that throws counts as returning Internal. `fn` may take a
  // Communicator& instead. FailedPrecondition on a second call.
  absl::Status Run(RankFn fn);

  const SimOptions& options() const { return options_; }

  // After Run(): what each rank's function returned, indexed by world rank.
  const std::vector<absl::Status>& rank_statuses() const {
    return rank_statuses_;
  }
  // After Run(): every collective call, ordered by (rank, op).
  const std::vector<TraceEvent>& trace() const { return trace_; }
  // After Run(): the rank given the baton at each scheduling decision. Equal
  // seeds give equal schedules.
  const std::vector<int>& schedule() const { return schedule_; }
  // After Run(): each rank's final virtual clock.
  std::vector<absl::Duration> clocks() const;
  // After Run(): the first collective that failed, as its first member saw
  // it (OK when none did) -- the cause, where ranks return later errors
  // (an aborted group, a stream-ordered failure surfacing at a later host
  // wait).
  const absl::Status& first_failure() const { return first_failure_; }

  // The trace as Chrome trace-event JSON: process/thread-name metadata,
  // then one complete ("X") event per TraceEvent with ts/dur in virtual
  // microseconds and its fields in "args". Deterministic.
  std::string ChromeTraceJson() const;
  // Writes ChromeTraceJson() to `path`. Internal naming the path on an I/O
  // error.
  absl::Status WriteChromeTrace(const std::string& path) const;

  // Rank `world_rank`'s flight recorder (null when recording is off).
  FlightRecorder* flight_recorder(int world_rank) const;

 private:
  friend class SimCommunicator;
  struct Rank;
  struct Group;
  struct Op;
  struct OpMember;
  using Call = internal_sim::Call;
  class SimWork;

  explicit SimWorld(SimOptions options);

  // The trace's events and its "otherData" (ChromeTraceJson).
  ChromeTrace BuildChromeTrace() const;
  nlohmann::json TraceOtherData() const;

  // What issuing a call produced: the operation it joined and the caller's
  // member index, or (op == nullptr) an error known at once.
  struct Issued {
    std::shared_ptr<Op> op;
    int member = -1;
    absl::Status early;
  };

  // The error of a call that cannot join an operation: its rank is dead or
  // is killed now (which aborts its groups), or its group was aborted.
  absl::Status EarlyFailure(Rank& rank, Group& group, internal_sim::OpKind kind,
                            int64_t seq, int64_t rank_op);

  // Rank-thread entry points; each checks that it runs on its rank's thread.
  Issued IssueOp(SimCommunicator& comm, Call call);
  std::unique_ptr<Work> Issue(SimCommunicator& comm, Call call);
  absl::StatusOr<std::vector<std::string>> IssueGatherBytes(
      SimCommunicator& comm, Call call);
  absl::StatusOr<std::unique_ptr<Communicator>> IssueSplit(
      SimCommunicator& comm, Call call);
  // Blocks until the member is done; the first host wait (not
  // `device_wait`) advances the rank's clock to the operation's end, which
  // `*end` receives.
  absl::Status WaitFor(int world_rank, Op& op, int member,
                       bool device_wait = false, absl::Duration* end = nullptr);
  void Abandon(Op& op, int member);
  void Yield(int world_rank);
  absl::Status Compute(int world_rank, absl::Duration duration);
  absl::Duration Now(int world_rank) const;
  void ArriveNextAt(int world_rank, absl::Duration t);
  void ThreadMain(int world_rank);
  static void* ThreadEntry(void* arg);
  // The rank's function, its status recorded (either execution).
  void RunRankFunction(Rank& r);
  // After every rank returned: sorts the trace, and Run()'s status.
  absl::Status Finished();
  // Execution::kFibers: the runner thread's loop, a fiber's body, and a
  // switch from `from` (null: the runner) to `to` (null: the runner).
  static void* RunnerEntry(void* arg);
  static void FiberEntry(void* arg);
  void FiberMain(Rank& r);
  void SwitchFiber(Rank* from, Rank* to);
  bool fibers() const {
    return options_.execution == SimOptions::Execution::kFibers;
  }

  // Scheduler internals; the caller holds mu_ (`lock`).
  void PassBaton(std::unique_lock<std::mutex>& lock, Rank* self);
  void MakeRunnable(Rank& rank);
  void MakeUnrunnable(Rank& rank);
  void BreakDeadlock();
  std::string DescribeRanks() const;
  // Waits for every rank to return, aborting the process on a stall.
  void AwaitCompletion(std::unique_lock<std::mutex>& lock);

  // Operation internals; the caller holds mu_.
  struct Delivery;
  std::vector<uint64_t> Checksums(const Call& call, int n, int me) const;
  std::string Where(const Op& op, int member) const;
  // Execute() runs an operation whose members have all arrived: it checks
  // that they agree (RejectMismatch), starts it on the virtual clock or
  // times it out (StartOrTimeOut), applies flip faults (PrepareDelivery),
  // verifies checksums and moves the data. The helpers return "failed" after
  // failing the operation on every member.
  void Execute(Op& op);
  bool RejectMismatch(Op& op);
  std::optional<absl::Duration> StartOrTimeOut(Op& op);
  std::optional<Delivery> PrepareDelivery(Op& op);
  std::string VerifyChecksums(const Op& op, const Delivery& delivery) const;
  void MoveData(Op& op, const Delivery& delivery);
  void MakeSubgroups(Op& op);
  void Complete(Op& op, int member, absl::Status status, absl::Duration start,
                absl::Duration end);
  // Marks `op` finished (no longer pending in its group).
  void Finish(Op& op);
  // one_stream_per_rank: whether `op` is the oldest unfinished operation of
  // each member, and running the operations that became so.
  bool AtFront(const Op& op) const;
  // Pops `r`'s finished operations off its queue and counts r for the
  // operation now at its front (Op::at_front), queueing that operation to
  // run when it is at every member's front and waits only for that.
  void AdvanceFront(Rank& r);
  void ExecuteUnblocked();
  void FailOp(Op& op, absl::StatusCode code, absl::string_view text);
  void AbortGroup(Group& group, absl::string_view reason);
  void Record(const OpMember& member, const Group& group, int group_rank,
              int64_t seq);

  const SimOptions options_;
  std::mt19937_64 rng_;

  mutable std::mutex mu_;
  std::condition_variable main_cv_;
  std::vector<std::unique_ptr<Rank>> ranks_;
  std::vector<std::unique_ptr<Group>> groups_;
  std::vector<int> runnable_;  // world ranks that may take the baton
  int running_ = -1;           // the baton holder; -1 for none
  int blocked_ = 0;            // ranks waiting on an operation
  int finished_ = 0;           // ranks whose function returned
  int64_t handoffs_ = 0;       // scheduling decisions, for the stall check
  bool ran_ = false;
  bool start_failed_ = false;  // a thread could not be created
  RankFn fn_;
  std::vector<char> scratch_;  // reduction accumulator
  // one_stream_per_rank: operations every member issued that wait for an
  // older operation of one of them (Op::blocked) and that may be at the
  // front of every member's queue now (an operation ahead of them in some
  // queue finished).
  std::deque<std::shared_ptr<Op>> unblock_candidates_;
  uint64_t next_op_uid_ = 0;

  std::vector<absl::Status> rank_statuses_;
  absl::Status first_failure_;
  // Execution::kFibers: the runner thread's own context.
  std::unique_ptr<internal_sim::FiberContext> runner_fiber_;
  std::vector<TraceEvent> trace_;
  std::vector<int> schedule_;
};

}  // namespace flatparam

#endif  // FLATPARAM_SIM_SIM_H_
