// Private to //comm/mpi:mpi_communicator: what the implementation files of
// the MPI backend share besides mpi_communicator.h. They are
//   mpi_communicator.cc  MpiCommunicator's creation (CreateWorld, Wrap,
//                        Split) and accessors;
//   mpi_collectives.cc   the collectives, each an Op issued with Launch();
//   mpi_desync.cc        the header check of MpiOptions::check_collectives;
//   mpi_progress.cc      the progress engine (Engine);
//   mpi_buffers.cc       the buffer pool and the staging copies;
//   mpi_session.cc       MPI's initialisation and finalisation (MpiSession,
//                        FinalizeMpi);
//   mpi_world.cc         the job runner RunOnMpiWorld and the launcher's
//                        environment (NodeLocalRank).
//
// How they fit. Each collective call builds an Op: its MPI steps (a
// nonblocking MPI call each, plus local work to run once the call
// completed) and the memory they use. The Op goes to the process's one
// Engine, which starts the steps in issue order per communicator and drives
// them to completion from whichever thread holds the engine's driver role:
// a thread blocked in Wait(), or else the engine's progress thread. See
// "Progress" in DESIGN.md for the behaviour and Engine below for
// the synchronisation.
//
// Ownership: an Op owns its OpMemory, whose PooledBuffers return to the
// process's buffer pool; an Op is shared by its Work and the Engine, a
// CommState by its MpiCommunicator and its Ops. Thread-safety: each type
// says; Engine's mutex orders everything shared between threads.
#ifndef FLATPARAM_COMM_MPI_INTERNAL_MPI_INTERNAL_H_
#define FLATPARAM_COMM_MPI_INTERNAL_MPI_INTERNAL_H_

#include <mpi.h>

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/container/inlined_vector.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "comm/communicator.h"
#include "comm/flight_recorder.h"
#include "comm/mpi/mpi_communicator.h"
#include "flatparam/base/dtype.h"

namespace flatparam {
namespace internal_mpi {

using OpCode = CollectiveOp;

// The name of an op code that may have come off the wire.
inline absl::string_view OpName(int32_t code) {
  if (code < static_cast<int32_t>(OpCode::kAllGather) ||
      code > static_cast<int32_t>(OpCode::kSplit)) {
    return "unknown_op";
  }
  return CollectiveOpName(static_cast<OpCode>(code));
}

// One collective call, for error messages. The sizes are formatted only
// when a message needs them: formatting them on every call cost a
// measurable share of a small collective.
struct OpInfo {
  int rank = 0;
  OpCode code = OpCode::kBarrier;
  int64_t seq = 0;
  // The sizes, if not from the buffers below.
  std::string sizes;
  // The FSDP context of a checked call (DescribeContext), for its desync
  // message; empty otherwise.
  std::string context;
  // 0: no buffers; 1: `input` (and `root`: broadcast); 2: `input`, `output`.
  int buffers = 0;
  int64_t input_count = 0;
  DType input_dtype = DType::kFloat32;
  int64_t output_count = 0;
  DType output_dtype = DType::kFloat32;
  int root = 0;

  static OpInfo Pair(int rank, OpCode code, int64_t seq, ConstBufferRef input,
                     ConstBufferRef output) {
    OpInfo info{rank, code, seq};
    info.buffers = 2;
    info.input_count = input.count;
    info.input_dtype = input.dtype;
    info.output_count = output.count;
    info.output_dtype = output.dtype;
    return info;
  }

  // "rank 1: all_reduce #7", the prefix ValidateAllReduce & co. use too.
  std::string Prefix() const {
    return absl::StrFormat("rank %d: %s #%d", rank,
                           OpName(static_cast<int32_t>(code)), seq);
  }
  // "input 7 x float32, output 7 x float32", or "7 x float32, root 0".
  std::string Sizes() const {
    switch (buffers) {
      case 1:
        return absl::StrFormat("%d x %s, root %d", input_count,
                               DTypeName(input_dtype), root);
      case 2:
        return absl::StrFormat("input %d x %s, output %d x %s", input_count,
                               DTypeName(input_dtype), output_count,
                               DTypeName(output_dtype));
      default:
        return sizes;
    }
  }
  // The prefix with the sizes: "rank 1: all_reduce #7 (input 7 x ...)".
  std::string Describe() const {
    const std::string s = Sizes();
    return s.empty() ? Prefix() : absl::StrCat(Prefix(), " (", s, ")");
  }
};

// The one place where MPI result codes become Status.
inline absl::Status FromMpi(int rc, absl::string_view call,
                            absl::string_view where) {
  if (rc == MPI_SUCCESS) return absl::OkStatus();
  char text[MPI_MAX_ERROR_STRING] = {};
  int length = 0;
  if (MPI_Error_string(rc, text, &length) != MPI_SUCCESS) length = 0;
  int error_class = rc;
  MPI_Error_class(rc, &error_class);
  return absl::InternalError(
      absl::StrFormat("%s: %s failed with MPI error %d (class %d): %s", where,
                      call, rc, error_class, absl::string_view(text, length)));
}

// What a collective on a broken communicator returns; `broken` is the error
// that broke it.
inline absl::Status BrokenError(const absl::Status& broken,
                                absl::string_view where) {
  return absl::AbortedError(
      absl::StrFormat("%s: the communicator is broken, so nothing was sent; "
                      "it broke on: %s",
                      where, broken.message()));
}

// The small record exchanged before a checked collective. Fields that do
// not apply to an operation are zero. Trivially copyable: sent as bytes.
struct Header {
  int64_t seq = 0;
  // The count that must agree across ranks: all_gather's input count,
  // reduce_scatter's output count, all_reduce's and broadcast's count.
  int64_t count = 0;
  double pre_divide = 0;
  double post_divide = 0;
  int32_t op = 0;
  int32_t dtype = 0;
  int32_t reduce_op = 0;
  int32_t root = 0;
  int32_t valid = 0;
  // A hash of the FSDP context that issued the call (ContextHash), so that
  // ranks issuing equal-sized collectives from different units disagree.
  uint32_t context = 0;
};

// The hash of `context` the header carries (0 for no context).
uint32_t ContextHash(const CollectiveContext& context);

// Buffers (mpi_buffers.cc). A collective's own buffers come from a
// process-wide pool, to which a PooledBuffer returns its buffer when
// destroyed (from any thread).
struct PooledDeleter {
  int64_t capacity = 0;
  void operator()(char* p) const;
};
using PooledBuffer = std::unique_ptr<char[], PooledDeleter>;

// Uninitialised; never null, so MPI gets a valid pointer for 0 bytes too.
PooledBuffer Alloc(int64_t bytes);

void CopyBytes(void* dst, const void* src, int64_t bytes);

// A staging copy of `bytes` of the caller's `src`, counted (MpiStagedBytes).
PooledBuffer StageIn(const void* src, int64_t bytes);

// Copies a staging buffer out to the caller's `dst`, counted.
void StageOut(void* dst, const void* src, int64_t bytes);

// `p`, or for a null `p` (the caller's empty buffers) a valid pointer,
// since some MPI argument checks reject null even with a count of 0.
void* NonNull(void* p);
const void* NonNull(const void* p);

// Memory a collective owns while MPI uses it (the check header, receive and
// staging buffers, MPI's count arrays) and the arguments its steps need. The
// steps' lambdas capture only a pointer to this, so that std::function
// stores them without allocating. Ownership: the issuing thread fills it in
// before Engine::Submit; from then on only the thread holding the engine's
// driver role uses it (MPI and the steps), ordered by Engine::mu_; it is
// freed with its Op, by whichever thread drops the last reference once the
// Op is done (or once MPI completed an abandoned Op's request).
struct OpMemory {
  MPI_Comm comm = MPI_COMM_NULL;
  int rank = 0;
  int size = 1;
  MPI_Datatype type = MPI_BYTE;
  DType dtype = DType::kFloat32;
  // Elements per rank (all_gather, reduce_scatter's slice, broadcast) or
  // this rank's chunk (all_reduce).
  int n = 0;
  int64_t bytes = 0;
  ReduceOptions reduce;
  int root = 0;
  bool is_root = false;
  // What MPI sends from and where results go: the caller's buffers
  // (zero-copy) or staging buffers.
  const void* in = nullptr;
  void* out = nullptr;
  // The caller's output, for a staged result or a fold.
  void* user_out = nullptr;
  // Whether this rank's own block to fold was copied into `recv` (because
  // the fold's output overlaps it in the input).
  bool own_copied = false;

  Header header;
  std::vector<Header> headers;
  PooledBuffer send;
  PooledBuffer recv;
  PooledBuffer acc;
  std::vector<int> counts;
  std::vector<int> displs;
  std::vector<int> recv_counts;
  std::vector<int> recv_displs;
  int64_t length = 0;
  std::vector<int64_t> lengths;
  // Wrap's MPI_Comm_idup writes the new communicator here.
  MPI_Comm new_comm = MPI_COMM_NULL;
};

// A step's requests: inline up to a group of 5 (its exchanges post 2 per
// peer), so that small collectives do not allocate them.
using Requests = absl::InlinedVector<MPI_Request, 8>;

// One nonblocking MPI operation of a collective (or a set of point-to-point
// ones) and the local work after it. Both run on whichever thread drives the
// engine (see Engine).
struct Step {
  const char* call;
  // Starts one operation; returns the MPI result code.
  std::function<int(MPI_Request*)> start;
  // Runs once it completed (may be empty).
  std::function<absl::Status()> finish;
  // Or, when set instead of `start`, posts several operations (appending
  // their requests) and returns the first error's code; the step completes
  // when all have.
  std::function<int(Requests*)> post;
  // Whether `post` is a PostExchange: its first size - 1 requests receive
  // from the ranks below this one, nearest first. A timeout then names the
  // ranks whose data never came (MissingSenders).
  bool exchange = false;
};

// Where an Op is in its life. Transitions happen under Engine::mu_.
enum class Phase {
  // Issued; its current step has not started. It waits in its
  // communicator's `unstarted` queue for the collectives before it.
  kQueued,
  // Its current step's request is active; the op is in Engine::inflight_.
  kInFlight,
  // The driver runs its current step's finish, outside the mutex.
  kFinishing,
  // `status` is final and MPI holds nothing of the op.
  kDone,
  // Timed out in flight: `status` is final, but MPI still owns the request
  // and the memory (the op's and, zero-copy, the caller's). It stays in
  // Engine::inflight_ until MPI completes the request; its finish never
  // runs.
  kAbandoned,
};

// One issued collective, shared by its MpiWork (the rank's thread) and the
// engine (any driving thread).
struct Op {
  Op(std::shared_ptr<CommState> comm_in, OpInfo info_in, absl::Duration t)
      : comm(std::move(comm_in)),
        info(std::move(info_in)),
        timeout(t),
        issued(absl::Now()),
        deadline(issued + t) {}

  // "rank 1: all_reduce #7 (...)", or `label` when set.
  std::string Where() const { return label.empty() ? info.Describe() : label; }

  // Set before the op is submitted, then immutable (read by every thread).
  // Null only for Wrap's MPI_Comm_idup, which belongs to no queue.
  const std::shared_ptr<CommState> comm;
  const OpInfo info;
  const absl::Duration timeout;
  const absl::Time issued;
  const absl::Time deadline;
  std::string label;
  // Whether MPI reads and writes the caller's buffers directly (for the
  // timeout message).
  bool zero_copy = false;
  // The op's entry in its communicator's flight recorder (0: none). Marked
  // started by the engine, finished by the engine (success) or by MpiWork's
  // Wait (failure, which may dump the ring, on the rank's thread).
  uint64_t flight_id = 0;
  // A copy Launch makes on the issuing thread right after Submit, so that
  // it overlaps the exchange: all_gather's own block, which MPI does not
  // touch. {destination, source, bytes}; none when `bytes` is 0.
  struct {
    void* dst = nullptr;
    const void* src = nullptr;
    int64_t bytes = 0;
  } own_block;
  OpMemory memory;
  absl::InlinedVector<Step, 3> steps;

  // Guarded by Engine::mu_.
  Phase phase = Phase::kQueued;
  size_t step = 0;  // The step in flight, or the next to start.
  absl::Status status;

  // The current step's requests. Written under Engine::mu_ when a step
  // starts, before the op enters Engine::inflight_; from then on only the
  // thread holding the driver role touches them (MPI_Test), until the op
  // leaves inflight_.
  Requests requests;
};

// The state a communicator shares with its in-flight Ops, so that an Op
// outliving its communicator still has a valid MPI_Comm and can still mark
// the group broken.
struct CommState {
  MPI_Comm comm = MPI_COMM_NULL;
  int rank = 0;
  int size = 1;
  MpiOptions options;
  // The rank's thread only.
  int64_t next_seq = 0;
  // The process's flight recorder (shared by all its communicators) and
  // this group's name in it. Set by Adopt, then immutable.
  std::shared_ptr<FlightRecorder> recorder;
  std::shared_ptr<const FlightGroup> group;

  // Guarded by Engine::mu_.
  // OK while usable; the error that broke the communicator otherwise.
  absl::Status broken;
  // Whether `broken` is set: read without the mutex, so that issuing a
  // collective on a healthy communicator does not take it twice.
  std::atomic<bool> is_broken{false};
  // Issued collectives, in issue order, that have not yet started their
  // last step. Only the front one can have started a step: every step of a
  // collective starts before the first step of the next one, so that MPI
  // sees the same order on every rank, however the steps' completions
  // interleave with the caller's calls.
  std::deque<std::shared_ptr<Op>> unstarted;

  ~CommState() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (comm != MPI_COMM_NULL && !finalized) MPI_Comm_free(&comm);
  }
};

// The process's progress engine: every issued Op of every communicator.
//
// Threads. The rank threads issue (Submit) and wait (Wait); the progress
// thread exists when MPI provides MPI_THREAD_MULTIPLE. Exactly one thread
// at a time holds the driver role (`driving_`): it tests the in-flight
// requests, runs the completed steps' finishes and starts the next steps.
// A thread blocked in Wait() takes the role itself (it has nothing else to
// do, and a hand-off to another thread would cost a wake-up per
// collective); the progress thread drives only while no thread waits, i.e.
// while the ranks compute.
//
// Synchronisation. `mu_` guards every Op's phase, step and status, each
// CommState's `broken` and `unstarted`, and the fields below. Every MPI
// call that starts a step is made under `mu_`, which fixes the start order
// per communicator. MPI_Test and the finishes (local folds and copies into
// the caller's output, possibly long) run outside `mu_`, by the driver
// only, on ops it took from `inflight_` under `mu_`. An op becomes kDone
// under `mu_` after its last finish has returned, and Wait() returns only
// after seeing kDone under `mu_`: so everything the driver wrote into the
// caller's buffers happens-before the caller's next access.
//
// Buffer ownership. From Submit until the op is kDone, the caller's buffers
// and the op's memory belong to the op (MPI and the driver). A kAbandoned
// op keeps its memory (and MPI the caller's buffers, zero-copy) until MPI
// completes its request.
class Engine {
 public:
  // The process's one engine (never destroyed).
  static Engine& Get();

  // Starts `op`, or queues it behind the collectives issued before it on
  // its communicator. Fails it at once (kDone) on a broken communicator.
  void Submit(const std::shared_ptr<Op>& op);
  // Blocks until `op` is done or its deadline passed (then it times out and
  // breaks its communicator); drives the engine meanwhile.
  absl::Status Wait(Op& op);

  // OK while `state` is usable; otherwise the error that broke it.
  absl::Status Health(const CommState& state);
  // Marks `state` broken by `status` (see BreakLocked).
  void Break(CommState& state, const absl::Status& status);
  // The first error that broke any communicator of this process.
  absl::Status FirstBreak();

  // Tests the in-flight requests once (unless another thread is driving)
  // and returns how many abandoned ones MPI has not completed.
  int PendingAbandoned();

  // Whether the progress thread runs (it starts on first use if MPI
  // provides MPI_THREAD_MULTIPLE).
  bool HasProgressThread();
  // Stops and joins the progress thread; collectives then progress only
  // inside Wait(). Idempotent; the thread never restarts.
  void StopThread();

 private:
  Engine() = default;

  // The driver's machinery (mpi_progress.cc says what each does); the
  // *Locked ones are called with mu_ held.
  void EnsureThread();
  void ThreadMain();
  bool HasLiveInflightLocked() const;
  void ReleaseDriverLocked();
  bool PollLocked(std::unique_lock<std::mutex>& lock, int sweeps);
  int TestRequests(Op& op, int* flag);
  void CompleteLocked(const std::shared_ptr<Op>& op, int rc,
                      std::unique_lock<std::mutex>& lock);
  void StartStepLocked(const std::shared_ptr<Op>& op);
  void StartQueuedLocked(CommState& state);
  void PopLocked(const Op& o);
  void FinishLocked(Op& o, absl::Status status);
  void BreakLocked(CommState& state, const absl::Status& status);
  std::string MissingPeersLocked(const Op& o);
  void TimeOutLocked(Op& o);

  std::mutex mu_;
  // Waiters sleep here while another thread drives.
  std::condition_variable done_cv_;
  // The progress thread sleeps here.
  std::condition_variable thread_cv_;
  std::vector<std::shared_ptr<Op>> inflight_;
  bool driving_ = false;
  int waiters_ = 0;
  int abandoned_ = 0;
  absl::Status first_break_;
  absl::Time last_submit_ = absl::InfinitePast();
  bool thread_dormant_ = false;
  bool stop_ = false;
  std::once_flag thread_once_;
  std::thread thread_;  // Written once under mu_ (in call_once).
  // The driver's snapshot of inflight_ and MPI_Testall's statuses (only the
  // driver touches them).
  std::vector<std::shared_ptr<Op>> polling_;
  std::vector<MPI_Status> statuses_;
};

// The check of MpiOptions::check_collectives (mpi_desync.cc).

// The first step of a checked collective: all-gathers `header` (with
// whether `valid` is OK) and fails unless every rank made the same call.
Step HeaderStep(const CommState& state, const OpInfo& info,
                const Header& header, const absl::Status& valid,
                OpMemory* memory);

// The header of a data collective: its op, sequence number, count and
// dtype.
Header DataHeader(const OpInfo& info, int64_t count, DType dtype);

// The header of a reduction: a data header with the reduce options.
Header ReduceHeader(const OpInfo& info, int64_t count, DType dtype,
                    const ReduceOptions& options);

// Issuing a collective (mpi_collectives.cc).

// Adds a collective's data steps (and sets Op::zero_copy). Runs on the
// rank's thread before the op is submitted.
using Plan = std::function<void(Op&)>;

// Issues a collective: fails fast on a broken communicator (or the engine
// does, if it breaks meanwhile), adds the header step when checking, and the
// data steps from `plan` when `valid` is OK.
std::unique_ptr<Work> Launch(const std::shared_ptr<CommState>& state,
                             const OpInfo& info, absl::Duration timeout,
                             const absl::Status& valid, const Header& header,
                             bool check, const Plan& plan);

// MPI's initialisation (mpi_session.cc).

// Initialises MPI unless it is; sets `*initialized_here`.
absl::Status EnsureMpi(int* argc, char*** argv, bool* initialized_here);

// Ending the job (mpi_world.cc).

// Prints why, then ends every process of the job. Does not return.
[[noreturn]] void AbortJob(absl::string_view program, absl::string_view who,
                           absl::string_view why);

}  // namespace internal_mpi
}  // namespace flatparam

#endif  // FLATPARAM_COMM_MPI_INTERNAL_MPI_INTERNAL_H_
