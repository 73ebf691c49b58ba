#include "comm/mpi/mpi_communicator.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cassert>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <iostream>
#include <map>
#include <mutex>
#include <thread>
#include <utility>

#include "absl/container/inlined_vector.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "comm/host_reduce.h"
#include "flatparam/base/buffer_checks.h"
#include "flatparam/base/dtype.h"
#include "flatparam/base/status_macros.h"

// How this file is organised. Each collective call builds an Op: its MPI
// steps (a nonblocking MPI call each, plus local work to run once the call
// completed) and the memory they use. The Op goes to the process's one
// Engine, which starts the steps in issue order per communicator and drives
// them to completion from whichever thread holds the engine's driver role:
// a thread blocked in Wait(), or else the engine's progress thread. See
// "Progress" in the header for the behaviour and "Engine" below for the
// synchronisation.

namespace flatparam {
namespace {

// Whether flatparam called MPI_Init_thread (and so owns MPI_Finalize).
bool g_flatparam_initialized_mpi = false;

using OpCode = CollectiveOp;

// The name of an op code that may have come off the wire.
absl::string_view OpName(int32_t code) {
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
absl::Status FromMpi(int rc, absl::string_view call, absl::string_view where) {
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
absl::Status BrokenError(const absl::Status& broken, absl::string_view where) {
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
  int32_t reserved = 0;
};

bool SameCall(const Header& a, const Header& b) {
  return a.seq == b.seq && a.count == b.count && a.pre_divide == b.pre_divide &&
         a.post_divide == b.post_divide && a.op == b.op && a.dtype == b.dtype &&
         a.reduce_op == b.reduce_op && a.root == b.root;
}

std::string DescribeCall(const Header& h) {
  std::string s = absl::StrFormat("%s #%d", OpName(h.op), h.seq);
  switch (static_cast<OpCode>(h.op)) {
    case OpCode::kAllGather:
    case OpCode::kReduceScatter:
    case OpCode::kAllReduce:
    case OpCode::kBroadcast:
      absl::StrAppendFormat(&s, " count %d %s", h.count,
                            DTypeName(static_cast<DType>(h.dtype)));
      break;
    default:
      break;
  }
  if (static_cast<OpCode>(h.op) == OpCode::kReduceScatter ||
      static_cast<OpCode>(h.op) == OpCode::kAllReduce) {
    absl::StrAppendFormat(&s, " %s",
                          ReduceOpName(static_cast<ReduceOp>(h.reduce_op)));
    if (h.pre_divide != 1.0 || h.post_divide != 1.0) {
      absl::StrAppendFormat(&s, " pre/post divide %g/%g", h.pre_divide,
                            h.post_divide);
    }
  }
  if (static_cast<OpCode>(h.op) == OpCode::kBroadcast) {
    absl::StrAppendFormat(&s, " root %d", h.root);
  }
  return s;
}

// What went wrong in a checked collective, identically on every rank except
// that a rank with invalid arguments gets its own error.
absl::Status CompareHeaders(const OpInfo& info,
                            const std::vector<Header>& headers,
                            const absl::Status& local) {
  if (!local.ok()) return local;
  std::vector<int> invalid;
  for (int r = 0; r < static_cast<int>(headers.size()); ++r) {
    if (!headers[r].valid) invalid.push_back(r);
  }
  if (!invalid.empty()) {
    return absl::InternalError(absl::StrFormat(
        "%s: rank(s) %s passed invalid arguments to this collective (their "
        "own errors say which); no data was exchanged",
        info.Describe(), absl::StrJoin(invalid, ",")));
  }
  bool agree = true;
  for (const Header& h : headers) agree = agree && SameCall(h, headers[0]);
  if (agree) return absl::OkStatus();
  // Group ranks by call: "ranks 0,1,2: all_reduce #5 ...; rank 3: ...".
  std::vector<bool> listed(headers.size(), false);
  std::vector<std::string> groups;
  for (size_t r = 0; r < headers.size(); ++r) {
    if (listed[r]) continue;
    std::vector<size_t> same;
    for (size_t q = r; q < headers.size(); ++q) {
      if (!listed[q] && SameCall(headers[q], headers[r])) {
        listed[q] = true;
        same.push_back(q);
      }
    }
    groups.push_back(
        absl::StrFormat("rank%s %s called %s", same.size() > 1 ? "s" : "",
                        absl::StrJoin(same, ","), DescribeCall(headers[r])));
  }
  return absl::InternalError(
      absl::StrFormat("%s: the group is desynchronised (%s); no data was "
                      "exchanged",
                      info.Describe(), absl::StrJoin(groups, "; ")));
}

// A process-wide cache of the buffers collectives own: reduce_scatter's and
// all_reduce's receive buffers and, with MpiOptions::stage_buffers, the
// staging copies. A large buffer allocated afresh for every collective
// page-faults on every call (measured: a 256 MiB all-gather ran at 0.12x of
// raw MPI), so buffers return here when their collective is done and are
// reused by the next one of a similar size. At most kMaxCachedBytes stay
// cached; the rest go back to the allocator. Thread-safe (its own mutex):
// the progress thread releases buffers too.
class BufferPool {
 public:
  static constexpr int64_t kMaxCachedBytes = int64_t{1} << 30;
  static constexpr size_t kMaxCachedBuffers = 16;

  static BufferPool& Get() {
    static BufferPool* pool = new BufferPool;  // Never destroyed: buffers
    return *pool;  // of abandoned collectives may be released at exit.
  }

  // A buffer of at least `bytes` (at least 1, so MPI always gets a valid
  // pointer); `*capacity` receives its real size.
  char* Acquire(int64_t bytes, int64_t* capacity) {
    bytes = std::max<int64_t>(bytes, 1);
    {
      std::lock_guard<std::mutex> lock(mu_);
      // The smallest cached buffer that fits, unless it is much larger.
      auto it = free_.lower_bound(bytes);
      if (it != free_.end() && it->first <= 2 * bytes + 4096) {
        *capacity = it->first;
        char* p = it->second;
        cached_bytes_ -= it->first;
        free_.erase(it);
        return p;
      }
    }
    *capacity = bytes;
    return new char[bytes];
  }

  void Release(char* p, int64_t capacity) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (cached_bytes_ + capacity <= kMaxCachedBytes &&
          free_.size() < kMaxCachedBuffers) {
        free_.emplace(capacity, p);
        cached_bytes_ += capacity;
        return;
      }
    }
    delete[] p;
  }

 private:
  std::mutex mu_;
  std::multimap<int64_t, char*> free_;
  int64_t cached_bytes_ = 0;
};

struct PooledDeleter {
  int64_t capacity = 0;
  void operator()(char* p) const { BufferPool::Get().Release(p, capacity); }
};
using PooledBuffer = std::unique_ptr<char[], PooledDeleter>;

// Uninitialised; never null, so MPI gets a valid pointer for 0 bytes too.
PooledBuffer Alloc(int64_t bytes) {
  int64_t capacity = 0;
  char* p = BufferPool::Get().Acquire(bytes, &capacity);
  return PooledBuffer(p, PooledDeleter{capacity});
}

// all_reduce gathers every rank's whole input and folds it locally (one
// collective) up to this many gathered bytes, and reduces chunks with an
// all-to-all and an all-gather (two collectives, less data) above.
constexpr int64_t kSmallAllReduceBytes = int64_t{64} << 10;

// Bytes copied between callers' buffers and staging buffers (MpiStagedBytes).
std::atomic<int64_t> g_staged_bytes{0};

void CopyBytes(void* dst, const void* src, int64_t bytes) {
  if (bytes > 0) std::memcpy(dst, src, bytes);
}

// A staging copy of `bytes` of the caller's `src`, counted.
PooledBuffer StageIn(const void* src, int64_t bytes) {
  PooledBuffer buffer = Alloc(bytes);
  CopyBytes(buffer.get(), src, bytes);
  g_staged_bytes.fetch_add(bytes, std::memory_order_relaxed);
  return buffer;
}

// Copies a staging buffer out to the caller's `dst`, counted.
void StageOut(void* dst, const void* src, int64_t bytes) {
  CopyBytes(dst, src, bytes);
  g_staged_bytes.fetch_add(bytes, std::memory_order_relaxed);
}

// MPI gets this for the caller's null pointers of empty buffers, which some
// MPI argument checks reject even with a count of 0.
char g_empty_buffer[1];

void* NonNull(void* p) { return p != nullptr ? p : g_empty_buffer; }
const void* NonNull(const void* p) { return p != nullptr ? p : g_empty_buffer; }

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

MPI_Datatype ElementType(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return MPI_FLOAT;
    case DType::kFloat64:
      return MPI_DOUBLE;
    default:
      // float16 and bfloat16: MPI only moves them; HostReduce does the math.
      assert(DTypeSize(dtype) == 2);
      return MPI_UINT16_T;
  }
}

// A step's requests: inline up to a group of 5 (its exchanges post 2 per
// peer), so that small collectives do not allocate them.
using Requests = absl::InlinedVector<MPI_Request, 8>;

// The tag of the point-to-point messages of PostExchange. MPI delivers the
// messages between two ranks with one tag and communicator in the order they
// were sent, and every rank posts its exchanges in the collectives' issue
// order, so the k-th exchange's messages always meet the k-th exchange's
// receives. (Collectives' own traffic is in a separate context.)
constexpr int kExchangeTag = 0x464c;

// Posts a linear exchange with every other rank: receives (first, so that
// messages land in place rather than in MPI's unexpected queue) from the
// ranks below, nearest first, then sends to the ranks above, nearest first,
// so that the ranks do not all send to the same peer at once. `recv(r)` and
// `send(r)` return rank r's block as {pointer, element count}. Appends the
// requests; returns the first error's code.
template <typename RecvBlock, typename SendBlock>
int PostExchange(const OpMemory& m, RecvBlock recv, SendBlock send,
                 Requests* requests) {
  requests->reserve(requests->size() + 2 * (m.size - 1));
  for (int k = 1; k < m.size; ++k) {
    const int r = (m.rank - k + m.size) % m.size;
    const auto [data, count] = recv(r);
    requests->push_back(MPI_REQUEST_NULL);
    const int rc = MPI_Irecv(data, count, m.type, r, kExchangeTag, m.comm,
                             &requests->back());
    if (rc != MPI_SUCCESS) return rc;
  }
  for (int k = 1; k < m.size; ++k) {
    const int r = (m.rank + k) % m.size;
    const auto [data, count] = send(r);
    requests->push_back(MPI_REQUEST_NULL);
    const int rc = MPI_Isend(data, count, m.type, r, kExchangeTag, m.comm,
                             &requests->back());
    if (rc != MPI_SUCCESS) return rc;
  }
  return MPI_SUCCESS;
}

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

// A step of point-to-point operations (PostExchange).
Step ExchangeStep(const char* call, std::function<int(Requests*)> post,
                  std::function<absl::Status()> finish) {
  return {call, nullptr, std::move(finish), std::move(post), true};
}

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

}  // namespace

namespace internal_mpi {

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

}  // namespace internal_mpi

namespace {

using internal_mpi::CommState;
using internal_mpi::Op;

// Collectives that failed with an MPI error: MPI may still write into their
// memory, and there is no request left to tell when it stops.
void KeepForever(std::shared_ptr<Op> op) {
  static auto* mu = new std::mutex;
  static auto* kept = new std::vector<std::shared_ptr<Op>>;
  std::lock_guard<std::mutex> lock(*mu);
  kept->push_back(std::move(op));
}

int StopEngineOnFinalize(MPI_Comm, int, void*, void*);

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
  static Engine& Get() {
    static Engine* engine = new Engine;  // Never destroyed: the progress
    return *engine;  // thread and abandoned requests may outlive main().
  }

  // Starts `op`, or queues it behind the collectives issued before it on
  // its communicator. Fails it at once (kDone) on a broken communicator.
  void Submit(const std::shared_ptr<Op>& op) {
    EnsureThread();
    std::lock_guard<std::mutex> lock(mu_);
    if (op->comm == nullptr) {
      StartStepLocked(op);
    } else if (!op->comm->broken.ok()) {
      FinishLocked(*op, BrokenError(op->comm->broken, op->Where()));
    } else {
      op->comm->unstarted.push_back(op);
      StartQueuedLocked(*op->comm);
    }
    last_submit_ = op->issued;
    if (thread_dormant_) thread_cv_.notify_one();
  }

  // Blocks until `op` is done or its deadline passed (then it times out and
  // breaks its communicator); drives the engine meanwhile.
  absl::Status Wait(Op& op) {
    std::unique_lock<std::mutex> lock(mu_);
    ++waiters_;
    Backoff backoff(kWaiterSpinFor, kWaiterMaxNap);
    while (op.phase != Phase::kDone && op.phase != Phase::kAbandoned) {
      // Poll first (a collective that completed meanwhile is OK even past
      // its deadline), then look at the clock.
      bool polled = false;
      bool progressed = false;
      if (!driving_) {
        driving_ = true;
        progressed = PollLocked(lock, kWaiterSweeps);
        ReleaseDriverLocked();
        polled = true;
        if (op.phase == Phase::kDone) break;
      }
      const absl::Time now = absl::Now();
      // A finishing step is local work that is about to end; waiting for
      // it keeps "after Wait returned, nothing writes the caller's
      // buffers" true for staged collectives.
      if (now >= op.deadline && op.phase != Phase::kFinishing) {
        // Naming the missing peers reads the requests' states, which only
        // the driver may touch: wait for the driving thread to let go
        // (the end of one poll).
        if (driving_ && op.phase == Phase::kInFlight) {
          done_cv_.wait_until(lock, absl::ToChronoTime(now + kDriverWait));
          continue;
        }
        TimeOutLocked(op);
        break;
      }
      if (!polled) {
        // The progress thread or another communicator's waiter drives; it
        // notifies done_cv_ when it lets go.
        done_cv_.wait_until(
            lock, absl::ToChronoTime(std::min(op.deadline, now + kDriverWait)));
      } else if (progressed) {
        backoff.Reset();
      } else if (const absl::Duration nap = backoff.Next(now);
                 nap > absl::ZeroDuration()) {
        lock.unlock();
        absl::SleepFor(nap);
        lock.lock();
      }
    }
    --waiters_;
    // The ops still in flight (a prefetch issued before this one) go on in
    // the background.
    if (waiters_ == 0 && HasLiveInflightLocked()) thread_cv_.notify_one();
    return op.status;
  }

  absl::Status Health(const CommState& state) {
    std::lock_guard<std::mutex> lock(mu_);
    return state.broken;
  }

  void Break(CommState& state, const absl::Status& status) {
    std::lock_guard<std::mutex> lock(mu_);
    BreakLocked(state, status);
  }

  // The first error that broke any communicator of this process.
  absl::Status FirstBreak() {
    std::lock_guard<std::mutex> lock(mu_);
    return first_break_;
  }

  // Tests the in-flight requests once (unless another thread is driving)
  // and returns how many abandoned ones MPI has not completed.
  int PendingAbandoned() {
    std::unique_lock<std::mutex> lock(mu_);
    if (abandoned_ == 0 || driving_) return abandoned_;
    driving_ = true;
    PollLocked(lock, 1);
    ReleaseDriverLocked();
    return abandoned_;
  }

  bool HasProgressThread() {
    EnsureThread();
    std::lock_guard<std::mutex> lock(mu_);
    return thread_.joinable() && !stop_;
  }

  // Stops and joins the progress thread; collectives then progress only
  // inside Wait(). Idempotent; the thread never restarts.
  void StopThread() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
      thread_cv_.notify_all();
    }
    if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) {
      thread_.join();
    }
  }

 private:
  // Waiters poll back to back (a small collective among running peers ends
  // in microseconds; a sleep, rounded up to the timer slack of about 50 us,
  // would cost more than it) for kWaiterSpinFor after the last progress,
  // then sleep with doubling naps so that a long wait for a late peer does
  // not hold a core. The cap is low because a large transfer between two
  // completions also needs polls to move its data.
  static constexpr absl::Duration kWaiterSpinFor = absl::Milliseconds(10);
  // Tests per op between two looks at the mutex and the clock.
  static constexpr int kWaiterSweeps = 16;
  static constexpr absl::Duration kWaiterMaxNap = absl::Microseconds(250);
  // How long a waiter sleeps at most before re-checking while another
  // thread drives (it is woken when the driver lets go).
  static constexpr absl::Duration kDriverWait = absl::Milliseconds(1);
  // The progress thread, while the ranks compute: polls back to back
  // briefly, then naps doubling up to kThreadMaxNap, so that a collective
  // that needs this rank advances within a fraction of a millisecond
  // without taking a core from the computation.
  static constexpr absl::Duration kThreadSpinFor = absl::Microseconds(20);
  static constexpr absl::Duration kThreadMaxNap = absl::Microseconds(200);
  // When only abandoned requests are in flight, a slow check.
  static constexpr absl::Duration kAbandonedPeriod = absl::Milliseconds(10);
  // The progress thread is not woken for each collective (a wake-up per
  // collective costs a context switch, which collectives waited on at once
  // cannot afford): while collectives are being issued it checks every
  // kArmedPeriod whether any is in flight with no thread waiting. After
  // kDormantAfter without a Submit it sleeps until the next Submit wakes it.
  static constexpr absl::Duration kArmedPeriod = absl::Milliseconds(1);
  static constexpr absl::Duration kDormantAfter = absl::Milliseconds(100);

  // Pauses between polls that completed nothing: polls back to back until
  // `spin_for` has passed since the last progress, then naps doubling from
  // 5 us up to `max_nap`. (Spinning needs no sched_yield of its own: MPI's
  // progress yields when the node is oversubscribed.)
  class Backoff {
   public:
    Backoff(absl::Duration spin_for, absl::Duration max_nap)
        : spin_for_(spin_for), max_nap_(max_nap) {}
    void Reset() {
      spin_until_ = absl::InfinitePast();
      nap_ = absl::Microseconds(5);
    }
    // The next pause at time `now`: zero to poll again at once.
    absl::Duration Next(absl::Time now) {
      if (spin_for_ > absl::ZeroDuration()) {
        if (spin_until_ == absl::InfinitePast()) spin_until_ = now + spin_for_;
        if (now < spin_until_) return absl::ZeroDuration();
      }
      const absl::Duration nap = nap_;
      nap_ = std::min(nap_ * 2, max_nap_);
      return nap;
    }

   private:
    const absl::Duration spin_for_;
    const absl::Duration max_nap_;
    absl::Time spin_until_ = absl::InfinitePast();
    absl::Duration nap_ = absl::Microseconds(5);
  };

  Engine() = default;

  // Starts the progress thread once, if MPI provides MPI_THREAD_MULTIPLE;
  // with less, flatparam must not call MPI from a thread of its own.
  void EnsureThread() {
    std::call_once(thread_once_, [this] {
      int provided = MPI_THREAD_SINGLE;
      if (MPI_Query_thread(&provided) != MPI_SUCCESS ||
          provided != MPI_THREAD_MULTIPLE) {
        return;
      }
      // MPI_Finalize deletes MPI_COMM_SELF's attributes first, while MPI
      // still works; the callback stops the thread there, so that it never
      // calls MPI after MPI_Finalize, also when the program finalises MPI
      // itself rather than through FinalizeMpi().
      int keyval = MPI_KEYVAL_INVALID;
      if (MPI_Comm_create_keyval(MPI_COMM_NULL_COPY_FN, &StopEngineOnFinalize,
                                 &keyval, nullptr) != MPI_SUCCESS ||
          MPI_Comm_set_attr(MPI_COMM_SELF, keyval, nullptr) != MPI_SUCCESS) {
        return;
      }
      std::lock_guard<std::mutex> lock(mu_);
      if (stop_) return;
      thread_ = std::thread([this] { ThreadMain(); });
    });
  }

  void ThreadMain() {
    std::unique_lock<std::mutex> lock(mu_);
    Backoff backoff(kThreadSpinFor, kThreadMaxNap);
    absl::Time next_abandoned_poll = absl::InfinitePast();
    while (!stop_) {
      const bool live = HasLiveInflightLocked();
      const absl::Time now = absl::Now();
      if (waiters_ > 0 || driving_ ||
          !(live || (!inflight_.empty() && now >= next_abandoned_poll))) {
        backoff.Reset();
        // Collectives are being issued: look again within kArmedPeriod.
        // After a quiet spell, sleep until Submit() wakes us (or the next
        // slow check of abandoned requests).
        thread_dormant_ = now - last_submit_ > kDormantAfter;
        if (thread_dormant_ && inflight_.empty()) {
          thread_cv_.wait(lock);
        } else {
          thread_cv_.wait_for(
              lock, absl::ToChronoNanoseconds(thread_dormant_ ? kAbandonedPeriod
                                                              : kArmedPeriod));
        }
        thread_dormant_ = false;
        continue;
      }
      driving_ = true;
      const bool progressed = PollLocked(lock, 1);
      ReleaseDriverLocked();
      if (!live) {
        next_abandoned_poll = absl::Now() + kAbandonedPeriod;
      } else if (progressed) {
        backoff.Reset();
      } else if (const absl::Duration nap = backoff.Next(absl::Now());
                 nap > absl::ZeroDuration()) {
        thread_cv_.wait_for(lock, absl::ToChronoNanoseconds(nap));
      }
    }
  }

  // Whether any op in flight is not abandoned (abandoned ones alone get
  // only the slow check).
  bool HasLiveInflightLocked() const {
    return static_cast<int>(inflight_.size()) > abandoned_;
  }

  void ReleaseDriverLocked() {
    driving_ = false;
    if (waiters_ > 0) done_cv_.notify_all();
  }

  // Tests every op in flight, up to `sweeps` times until one completes,
  // and handles the completed ones. Called by the driver (driving_ set by
  // it) with `lock` held; the tests run without it (several sweeps per
  // lock, so that a waiter's tight loop does not pay the mutex and the
  // clock per test). Ops submitted meanwhile are tested from the next
  // call. Returns, with `lock` held, whether any request completed.
  bool PollLocked(std::unique_lock<std::mutex>& lock, int sweeps) {
    polling_.assign(inflight_.begin(), inflight_.end());
    lock.unlock();
    bool progressed = false;
    // Each op is tested at most once per sweep, and no sweep follows one
    // that completed something: a completed op's requests are gone (or are
    // its next step's, which the next call tests).
    for (int sweep = 0; sweep < sweeps && !progressed; ++sweep) {
      for (const std::shared_ptr<Op>& op : polling_) {
        int flag = 0;
        const int rc = TestRequests(*op, &flag);
        if (rc == MPI_SUCCESS && flag == 0) continue;
        progressed = true;
        lock.lock();
        CompleteLocked(op, rc, lock);
        lock.unlock();
      }
    }
    // The last references to finished ops may go here, outside mu_: their
    // memory returns to the pool and a communicator may be freed.
    polling_.clear();
    lock.lock();
    return progressed;
  }

  // Tests `op`'s requests (driver only). Sets `*flag` when all completed or
  // one failed; returns MPI_Test's code, or the first failed request's.
  int TestRequests(Op& op, int* flag) {
    Requests& requests = op.requests;
    if (requests.size() == 1) {
      return MPI_Test(&requests[0], flag, MPI_STATUS_IGNORE);
    }
    statuses_.resize(requests.size());
    const int rc = MPI_Testall(static_cast<int>(requests.size()),
                               requests.data(), flag, statuses_.data());
    if (rc != MPI_ERR_IN_STATUS) return rc;
    *flag = 1;
    for (const MPI_Status& status : statuses_) {
      if (status.MPI_ERROR != MPI_SUCCESS &&
          status.MPI_ERROR != MPI_ERR_PENDING) {
        return status.MPI_ERROR;
      }
    }
    return rc;
  }

  // The driver saw `op`'s requests complete (rc: the test's code). Runs the
  // step's finish with `lock` released.
  void CompleteLocked(const std::shared_ptr<Op>& op, int rc,
                      std::unique_lock<std::mutex>& lock) {
    Op& o = *op;
    inflight_.erase(std::find(inflight_.begin(), inflight_.end(), op));
    if (o.phase == Phase::kAbandoned) {
      --abandoned_;
      if (rc != MPI_SUCCESS) KeepForever(op);
      return;
    }
    if (rc != MPI_SUCCESS) {
      // An MPI error aborts the collective's schedule, but its other
      // point-to-point parts may still land in its memory.
      KeepForever(op);
      const absl::Status status = FromMpi(
          rc, o.requests.size() == 1 ? "MPI_Test" : "MPI_Testall", o.Where());
      FinishLocked(o, status);
      if (o.comm != nullptr) BreakLocked(*o.comm, status);
      return;
    }
    absl::Status status;
    const Step& step = o.steps[o.step];
    if (step.finish) {
      o.phase = Phase::kFinishing;
      lock.unlock();
      status = step.finish();
      lock.lock();
    }
    ++o.step;
    if (!status.ok() || o.step == o.steps.size()) {
      FinishLocked(o, status);
    } else {
      StartStepLocked(op);
    }
    if (o.comm != nullptr) StartQueuedLocked(*o.comm);
  }

  // Starts o.steps[o.step]: kInFlight on success; kDone with the error on a
  // broken communicator or an MPI error. An op whose last step started, or
  // that failed, leaves its communicator's queue.
  void StartStepLocked(const std::shared_ptr<Op>& op) {
    Op& o = *op;
    if (o.comm != nullptr && !o.comm->broken.ok()) {
      FinishLocked(o, BrokenError(o.comm->broken, o.Where()));
      return;
    }
    const Step& step = o.steps[o.step];
    o.requests.clear();
    int rc = MPI_SUCCESS;
    if (step.post) {
      rc = step.post(&o.requests);
    } else {
      o.requests.push_back(MPI_REQUEST_NULL);
      rc = step.start(&o.requests[0]);
    }
    if (rc != MPI_SUCCESS) {
      // Requests posted before the error may still use the memory.
      if (std::any_of(o.requests.begin(), o.requests.end(),
                      [](MPI_Request r) { return r != MPI_REQUEST_NULL; })) {
        KeepForever(op);
      }
      const absl::Status status = FromMpi(rc, step.call, o.Where());
      FinishLocked(o, status);
      if (o.comm != nullptr) BreakLocked(*o.comm, status);
      return;
    }
    o.phase = Phase::kInFlight;
    inflight_.push_back(op);
    if (o.step + 1 == o.steps.size()) PopLocked(o);
  }

  // Starts the queue's front ops while they can start: each one's first
  // step; a multi-step op stays at the front until its last step starts.
  void StartQueuedLocked(CommState& state) {
    while (!state.unstarted.empty()) {
      const std::shared_ptr<Op> head = state.unstarted.front();
      if (head->phase != Phase::kQueued) return;
      if (head->steps.empty()) {
        FinishLocked(*head, absl::OkStatus());
      } else {
        StartStepLocked(head);
      }
    }
  }

  void PopLocked(const Op& o) {
    if (o.comm != nullptr && !o.comm->unstarted.empty() &&
        o.comm->unstarted.front().get() == &o) {
      o.comm->unstarted.pop_front();
    }
  }

  void FinishLocked(Op& o, absl::Status status) {
    o.status = std::move(status);
    o.phase = Phase::kDone;
    PopLocked(o);
    if (waiters_ > 0) done_cv_.notify_all();
  }

  // Marks `state` broken (keeping the first error) and fails its queued
  // collectives: nothing more may be sent on it, since which collectives
  // the peers matched is unknown. A part-way front op fails when its next
  // step would start.
  void BreakLocked(CommState& state, const absl::Status& status) {
    if (state.broken.ok()) {
      state.broken = status;
      state.is_broken.store(true, std::memory_order_release);
    }
    if (first_break_.ok()) first_break_ = status;
    std::deque<std::shared_ptr<Op>> keep;
    for (const std::shared_ptr<Op>& op : state.unstarted) {
      if (op->phase == Phase::kQueued) {
        op->status = BrokenError(state.broken, op->Where());
        op->phase = Phase::kDone;
      } else {
        keep.push_back(op);
      }
    }
    state.unstarted.swap(keep);
    if (waiters_ > 0) done_cv_.notify_all();
  }

  // Who `o`'s current step is still waiting for, as a timeout message says
  // it: the peers whose part of an exchange never arrived (its receives are
  // still open), or that MPI's own collectives do not tell.
  // Called with mu_ held and no thread driving (only the driver touches the
  // requests; MPI_Request_get_status neither completes nor frees them).
  std::string MissingPeersLocked(const Op& o) {
    constexpr absl::string_view kUnknown =
        "a peer did not call it, is too slow, or is stuck elsewhere";
    if (o.phase != Phase::kInFlight || o.comm == nullptr) {
      return std::string(kUnknown);
    }
    const CommState& c = *o.comm;
    const Step& step = o.steps[o.step];
    const size_t peers = static_cast<size_t>(c.size - 1);
    if (!step.exchange || o.requests.size() < 2 * peers) {
      return absl::StrFormat(
          "%s (%s does not tell which: the rank that reports no timeout is "
          "the one)",
          kUnknown, step.call);
    }
    std::vector<int> missing;  // No data from them.
    std::vector<int> unread;   // They did not take this rank's data.
    for (size_t k = 1; k <= peers; ++k) {
      const int below = (c.rank - static_cast<int>(k) + c.size) % c.size;
      const int above = (c.rank + static_cast<int>(k)) % c.size;
      if (!RequestDone(o.requests[k - 1])) missing.push_back(below);
      if (!RequestDone(o.requests[peers + k - 1])) unread.push_back(above);
    }
    if (missing.empty() && unread.empty()) return std::string(kUnknown);
    std::sort(missing.begin(), missing.end());
    std::sort(unread.begin(), unread.end());
    if (missing.empty()) {
      return absl::StrFormat(
          "every peer's data arrived, but %s not taken this rank's "
          "(stopped, dead, or stuck before this collective, or the link is "
          "lost)",
          RankList(c, unread, "has", "have"));
    }
    const bool one = missing.size() == 1;
    return absl::StrFormat(
        "no data arrived from %s: %s not reached this collective (stopped, "
        "dead, or stuck before it) or %s messages are lost on the way; this "
        "rank is at %s #%d, and which collective %s in cannot be learned from "
        "here",
        RankList(c, missing, "", ""), one ? "it has" : "they have",
        one ? "its" : "their", OpName(static_cast<int32_t>(o.info.code)),
        o.info.seq, one ? "it is" : "they are");
  }

  static bool RequestDone(MPI_Request request) {
    if (request == MPI_REQUEST_NULL) return true;
    int flag = 0;
    return MPI_Request_get_status(request, &flag, MPI_STATUS_IGNORE) ==
               MPI_SUCCESS &&
           flag != 0;
  }

  // "rank 2", "ranks 1 and 3", with world ranks where `c` is a subgroup:
  // "rank 1 (world rank 5)". `has`/`have`: a verb to follow, or empty.
  static std::string RankList(const CommState& c, const std::vector<int>& ranks,
                              absl::string_view has, absl::string_view have) {
    std::vector<int> world(ranks.size(), MPI_UNDEFINED);
    int world_size = 0;
    MPI_Comm_size(MPI_COMM_WORLD, &world_size);
    if (world_size != c.size) {
      MPI_Group group = MPI_GROUP_NULL;
      MPI_Group world_group = MPI_GROUP_NULL;
      if (MPI_Comm_group(c.comm, &group) == MPI_SUCCESS &&
          MPI_Comm_group(MPI_COMM_WORLD, &world_group) == MPI_SUCCESS) {
        MPI_Group_translate_ranks(group, static_cast<int>(ranks.size()),
                                  ranks.data(), world_group, world.data());
      }
      if (group != MPI_GROUP_NULL) MPI_Group_free(&group);
      if (world_group != MPI_GROUP_NULL) MPI_Group_free(&world_group);
    }
    std::string out = ranks.size() == 1 ? "rank " : "ranks ";
    for (size_t i = 0; i < ranks.size(); ++i) {
      if (i > 0) out += i + 1 == ranks.size() ? " and " : ", ";
      absl::StrAppend(&out, ranks[i]);
      if (world[i] != MPI_UNDEFINED && world[i] != ranks[i]) {
        absl::StrAppend(&out, " (world rank ", world[i], ")");
      }
    }
    const absl::string_view verb = ranks.size() == 1 ? has : have;
    if (!verb.empty()) absl::StrAppend(&out, " ", verb);
    return out;
  }

  void TimeOutLocked(Op& o) {
    const std::string tail = absl::StrFormat(
        "; the communicator is now broken and later calls on it fail with "
        "Aborted%s",
        o.zero_copy ? "; MPI may still read this collective's input and "
                      "write its output, so keep both alive and unused "
                      "(or set MpiOptions::stage_buffers)"
                    : "");
    if (o.phase == Phase::kQueued) {
      std::string ahead = "an earlier collective";
      std::string who =
          "a peer did not call it, is too slow, or is stuck elsewhere";
      if (o.comm != nullptr) {
        auto& q = o.comm->unstarted;
        const auto it = std::find_if(
            q.begin(), q.end(),
            [&o](const std::shared_ptr<Op>& p) { return p.get() == &o; });
        if (it != q.begin() && it != q.end()) {
          ahead = q.front()->Where();
          // The front op's requests are the driver's while one drives.
          if (!driving_) who = MissingPeersLocked(*q.front());
        }
        if (it != q.end()) q.erase(it);
      }
      o.status = absl::DeadlineExceededError(absl::StrFormat(
          "%s timed out after %s before it started, queued behind %s on "
          "this communicator, which had not completed: %s%s",
          o.Where(), absl::FormatDuration(o.timeout), ahead, who, tail));
      o.phase = Phase::kDone;
    } else {
      o.status = absl::DeadlineExceededError(absl::StrFormat(
          "%s timed out after %s in %s (step %d of %d): %s%s", o.Where(),
          absl::FormatDuration(o.timeout), o.steps[o.step].call, o.step + 1,
          o.steps.size(), MissingPeersLocked(o), tail));
      o.phase = Phase::kAbandoned;
      ++abandoned_;
      PopLocked(o);
    }
    if (o.comm != nullptr) BreakLocked(*o.comm, o.status);
  }

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

int StopEngineOnFinalize(MPI_Comm, int, void*, void*) {
  Engine::Get().StopThread();
  return MPI_SUCCESS;
}

class MpiWork final : public Work {
 public:
  explicit MpiWork(std::shared_ptr<Op> op) : op_(std::move(op)) {}

  // Waiting here keeps every rank's collectives completing even when a
  // caller drops a Work without waiting on it.
  ~MpiWork() override { Wait().IgnoreError(); }

  absl::Status Wait() override {
    if (op_ != nullptr) {
      status_ = Engine::Get().Wait(*op_);
      op_.reset();
    }
    return status_;
  }

 private:
  std::shared_ptr<Op> op_;
  absl::Status status_;
};

Step HeaderStep(const CommState& state, const OpInfo& info,
                const Header& header, const absl::Status& valid,
                OpMemory* memory) {
  memory->header = header;
  memory->header.valid = valid.ok() ? 1 : 0;
  memory->headers.resize(state.size);
  const MPI_Comm comm = state.comm;
  return {"MPI_Iallgather (check header)",
          [comm, memory](MPI_Request* request) {
            return MPI_Iallgather(&memory->header, sizeof(Header), MPI_BYTE,
                                  memory->headers.data(), sizeof(Header),
                                  MPI_BYTE, comm, request);
          },
          [info, valid, memory]() {
            return CompareHeaders(info, memory->headers, valid);
          }};
}

// Adds a collective's data steps (and sets Op::zero_copy). Runs on the
// rank's thread before the op is submitted.
using Plan = std::function<void(Op&)>;

// Issues a collective: fails fast on a broken communicator (or the engine
// does, if it breaks meanwhile), adds the header step when checking, and the
// data steps from `plan` when `valid` is OK.
std::unique_ptr<Work> Launch(const std::shared_ptr<CommState>& state,
                             const OpInfo& info, absl::Duration timeout,
                             const absl::Status& valid, const Header& header,
                             bool check, const Plan& plan) {
  if (state->is_broken.load(std::memory_order_acquire)) {
    return CompletedWork(
        BrokenError(Engine::Get().Health(*state), info.Describe()));
  }
  if (!check && !valid.ok()) return CompletedWork(valid);
  auto op = std::make_shared<Op>(state, info, timeout);
  op->memory.comm = state->comm;
  op->memory.rank = state->rank;
  op->memory.size = state->size;
  if (check) {
    op->steps.push_back(HeaderStep(*state, info, header, valid, &op->memory));
  }
  if (valid.ok() && plan) plan(*op);
  Engine::Get().Submit(op);
  // The op owns the caller's buffers now, and this thread returns the Work
  // only after the copy, so no Wait() can return before it.
  CopyBytes(op->own_block.dst, op->own_block.src, op->own_block.bytes);
  return std::make_unique<MpiWork>(std::move(op));
}

// The MPI backend's own limits, after the shared validation passed.
absl::Status CheckMpiLimits(const OpInfo& info, Device device,
                            int64_t per_rank_count) {
  if (device.type != DeviceType::kHost) {
    return absl::UnimplementedError(absl::StrFormat(
        "%s: buffers on %s; the MPI backend takes host buffers only",
        info.Describe(), DeviceName(device)));
  }
  if (per_rank_count > INT_MAX) {
    return absl::UnimplementedError(absl::StrFormat(
        "%s: %d elements per rank exceed MPI's int count limit %d",
        info.Describe(), per_rank_count, INT_MAX));
  }
  return absl::OkStatus();
}

Header DataHeader(const OpInfo& info, int64_t count, DType dtype) {
  Header h;
  h.seq = info.seq;
  h.op = static_cast<int32_t>(info.code);
  h.count = count;
  h.dtype = static_cast<int32_t>(dtype);
  h.pre_divide = 1.0;
  h.post_divide = 1.0;
  return h;
}

Header ReduceHeader(const OpInfo& info, int64_t count, DType dtype,
                    const ReduceOptions& options) {
  Header h = DataHeader(info, count, dtype);
  h.reduce_op = static_cast<int32_t>(options.op);
  h.pre_divide = options.pre_divide_factor;
  h.post_divide = options.post_divide_factor;
  return h;
}

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

// Initialises MPI unless it is; sets `*initialized_here`.
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

}  // namespace

int PendingAbandonedMpiRequests() { return Engine::Get().PendingAbandoned(); }

int64_t MpiStagedBytes() {
  return g_staged_bytes.load(std::memory_order_relaxed);
}

bool MpiHasProgressThread() {
  int initialized = 0;
  int finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  return initialized && !finalized && Engine::Get().HasProgressThread();
}

namespace {
[[noreturn]] void AbortJob(absl::string_view program, absl::string_view who,
                           absl::string_view why);
}  // namespace

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

std::unique_ptr<Work> MpiCommunicator::AllGather(
    ConstBufferRef input, BufferRef output, const CollectiveOptions& options) {
  const CommState& st = *state_;
  const OpInfo info = OpInfo::Pair(st.rank, OpCode::kAllGather,
                                   state_->next_seq++, input, output);
  absl::Status valid =
      ValidateAllGather(st.rank, st.size, info.seq, input, output);
  if (valid.ok()) valid = CheckMpiLimits(info, input.device, input.count);
  const bool stage = st.options.stage_buffers;
  return Launch(
      state_, info, options.timeout, valid,
      DataHeader(info, input.count, input.dtype), st.options.check_collectives,
      [&](Op& op) {
        OpMemory* m = &op.memory;
        m->n = static_cast<int>(input.count);
        m->type = ElementType(input.dtype);
        m->bytes = input.bytes();
        m->user_out = output.data;
        char* out = static_cast<char*>(NonNull(output.data));
        const void* in = NonNull(input.data);
        const bool in_place = input.data == out + m->rank * m->bytes;
        if (stage) {
          m->send = StageIn(input.data, m->bytes);
          m->recv = Alloc(m->bytes * m->size);
          in = m->send.get();
          out = m->recv.get();
        } else if (!in_place && BytesOverlap(input.data, m->bytes, out,
                                             m->bytes * m->size)) {
          // The sends read the input while the receives write the output.
          m->send = StageIn(input.data, m->bytes);
          in = m->send.get();
        }
        m->in = in;
        m->out = out;
        // This rank's own block: zero-copy, copied into the caller's output
        // once the exchange is posted (so that the copy overlaps it; nothing
        // else writes that block); staged, before (the finish copies the
        // whole staging buffer out, possibly on the progress thread).
        if (!in_place || stage) {
          char* const own = out + m->rank * m->bytes;
          if (stage) {
            CopyBytes(own, in, m->bytes);
          } else {
            op.own_block = {own, in, m->bytes};
          }
        }
        op.zero_copy = !stage;
        op.steps.push_back(ExchangeStep(
            "MPI_Isend/MPI_Irecv (all-gather)",
            [m](Requests* requests) {
              char* const out = static_cast<char*>(m->out);
              return PostExchange(
                  *m,
                  [m, out](int r) {
                    return std::pair<void*, int>(out + r * m->bytes, m->n);
                  },
                  [m](int) { return std::pair<const void*, int>(m->in, m->n); },
                  requests);
            },
            stage ? std::function<absl::Status()>([m]() {
              StageOut(m->user_out, m->out, m->bytes * m->size);
              return absl::OkStatus();
            })
                  : nullptr));
      });
}

std::unique_ptr<Work> MpiCommunicator::ReduceScatter(
    ConstBufferRef input, BufferRef output, const ReduceOptions& options) {
  const CommState& st = *state_;
  const OpInfo info = OpInfo::Pair(st.rank, OpCode::kReduceScatter,
                                   state_->next_seq++, input, output);
  absl::Status valid =
      ValidateReduceScatter(st.rank, st.size, info.seq, input, output, options);
  if (valid.ok()) valid = CheckMpiLimits(info, input.device, output.count);
  const bool stage = st.options.stage_buffers;
  return Launch(
      state_, info, options.timeout, valid,
      ReduceHeader(info, output.count, output.dtype, options),
      st.options.check_collectives, [&](Op& op) {
        OpMemory* m = &op.memory;
        m->n = static_cast<int>(output.count);
        m->type = ElementType(input.dtype);
        m->dtype = input.dtype;
        m->bytes = output.bytes();  // One slice.
        m->reduce = options;
        m->user_out = output.data;
        // Zero-copy, the sends read the caller's input. It is not read
        // after the exchange completes and the output is not written
        // before, so they may overlap (in place included).
        const char* in = static_cast<const char*>(NonNull(input.data));
        if (stage) {
          m->send = StageIn(input.data, input.bytes());
          in = m->send.get();
        } else {
          op.zero_copy = true;
        }
        m->in = in;
        // Slice rank() of every other rank, in rank order, to fold.
        m->recv = Alloc(input.bytes());
        // This rank's own slice is folded from the input where it is,
        // unless the fold's output overlaps it (in place): then from a copy.
        const char* own = in + m->rank * m->bytes;
        m->own_copied = BytesOverlap(output.data, m->bytes, own, m->bytes);
        if (m->own_copied) {
          CopyBytes(m->recv.get() + m->rank * m->bytes, own, m->bytes);
        }
        op.steps.push_back(ExchangeStep(
            "MPI_Isend/MPI_Irecv (all-to-all)",
            [m](Requests* requests) {
              const char* const in = static_cast<const char*>(m->in);
              char* const recv = m->recv.get();
              return PostExchange(
                  *m,
                  [m, recv](int r) {
                    return std::pair<void*, int>(recv + r * m->bytes, m->n);
                  },
                  [m, in](int r) {
                    return std::pair<const void*, int>(in + r * m->bytes, m->n);
                  },
                  requests);
            },
            [m]() {
              // Straight into the caller's output (staged too: this runs
              // before Wait() returns), in rank order.
              for (int r = 0; r < m->size; ++r) {
                const char* x =
                    r == m->rank && !m->own_copied
                        ? static_cast<const char*>(m->in) + r * m->bytes
                        : m->recv.get() + r * m->bytes;
                HostReduceStep(m->user_out, x, m->n, m->dtype, m->reduce,
                               r == 0);
              }
              HostReduceFinish(m->user_out, m->n, m->dtype, m->reduce, m->size);
              return absl::OkStatus();
            }));
      });
}

std::unique_ptr<Work> MpiCommunicator::AllReduce(ConstBufferRef input,
                                                 BufferRef output,
                                                 const ReduceOptions& options) {
  const CommState& st = *state_;
  const OpInfo info = OpInfo::Pair(st.rank, OpCode::kAllReduce,
                                   state_->next_seq++, input, output);
  absl::Status valid =
      ValidateAllReduce(st.rank, st.size, info.seq, input, output, options);
  if (valid.ok()) valid = CheckMpiLimits(info, input.device, input.count);
  const bool stage = st.options.stage_buffers;
  return Launch(
      state_, info, options.timeout, valid,
      ReduceHeader(info, input.count, input.dtype, options),
      st.options.check_collectives, [&](Op& op) {
        OpMemory* m = &op.memory;
        const int size = m->size;
        const int rank = m->rank;
        const int64_t elem = DTypeSize(input.dtype);
        const int64_t bytes = input.bytes();
        m->type = ElementType(input.dtype);
        m->dtype = input.dtype;
        m->reduce = options;
        m->user_out = output.data;
        m->bytes = bytes;
        // Zero-copy, the sends read the caller's input and the results go
        // straight into its output. The input is not read after the first
        // exchange completes and the output not written before, so they
        // may overlap (in place included).
        const char* in = static_cast<const char*>(NonNull(input.data));
        if (stage) {
          m->send = StageIn(input.data, bytes);
          in = m->send.get();
        } else {
          op.zero_copy = true;
        }
        m->in = in;
        if (bytes * size <= kSmallAllReduceBytes) {
          // Small: every rank receives every input and folds the whole
          // buffer, in rank order (the same fold, element by element, as
          // the chunked algorithm below, so the same bits): one exchange
          // instead of two, as latency dominates at this size. The fold
          // writes the caller's output before Wait() returns, staged too.
          m->n = static_cast<int>(input.count);
          m->recv = Alloc(bytes * size);
          m->own_copied = BytesOverlap(output.data, bytes, in, bytes);
          if (m->own_copied) CopyBytes(m->recv.get() + rank * bytes, in, bytes);
          op.steps.push_back(ExchangeStep(
              "MPI_Isend/MPI_Irecv (all-gather of the inputs)",
              [m](Requests* requests) {
                char* const recv = m->recv.get();
                return PostExchange(
                    *m,
                    [m, recv](int r) {
                      return std::pair<void*, int>(recv + r * m->bytes, m->n);
                    },
                    [m](int) {
                      return std::pair<const void*, int>(m->in, m->n);
                    },
                    requests);
              },
              [m]() {
                for (int r = 0; r < m->size; ++r) {
                  const void* x = r == m->rank && !m->own_copied
                                      ? m->in
                                      : m->recv.get() + r * m->bytes;
                  HostReduceStep(m->user_out, x, m->n, m->dtype, m->reduce,
                                 r == 0);
                }
                HostReduceFinish(m->user_out, m->n, m->dtype, m->reduce,
                                 m->size);
                return absl::OkStatus();
              }));
          return;
        }
        // Rank i reduces chunk i: the first count % size chunks have one
        // element more. Staged, the chunks are reduced and gathered in a
        // staging buffer, copied out at the end.
        const int n = static_cast<int>(input.count);
        m->counts.resize(size);
        m->displs.resize(size);
        for (int r = 0, offset = 0; r < size; ++r) {
          m->counts[r] = n / size + (r < n % size ? 1 : 0);
          m->displs[r] = offset;
          offset += m->counts[r];
        }
        m->n = m->counts[rank];
        const int64_t chunk_bytes = static_cast<int64_t>(m->n) * elem;
        m->recv = Alloc(chunk_bytes * size);
        if (stage) {
          m->acc = Alloc(bytes);
          m->out = m->acc.get();
        } else {
          m->out = NonNull(output.data);
        }
        const char* own_in = in + static_cast<int64_t>(m->displs[rank]) * elem;
        char* own_out = static_cast<char*>(m->out) +
                        static_cast<int64_t>(m->displs[rank]) * elem;
        m->own_copied = BytesOverlap(own_out, chunk_bytes, own_in, chunk_bytes);
        if (m->own_copied) {
          CopyBytes(m->recv.get() + rank * chunk_bytes, own_in, chunk_bytes);
        }
        op.steps.push_back(ExchangeStep(
            "MPI_Isend/MPI_Irecv (all-to-all of the chunks)",
            [m](Requests* requests) {
              const int64_t elem = DTypeSize(m->dtype);
              const char* const in = static_cast<const char*>(m->in);
              char* const recv = m->recv.get();
              return PostExchange(
                  *m,
                  [m, recv, elem](int r) {
                    return std::pair<void*, int>(recv + r * m->n * elem, m->n);
                  },
                  [m, in, elem](int r) {
                    return std::pair<const void*, int>(
                        in + static_cast<int64_t>(m->displs[r]) * elem,
                        m->counts[r]);
                  },
                  requests);
            },
            [m]() {
              const int64_t elem = DTypeSize(m->dtype);
              const int64_t chunk_bytes = static_cast<int64_t>(m->n) * elem;
              const int64_t offset =
                  static_cast<int64_t>(m->displs[m->rank]) * elem;
              char* const acc = static_cast<char*>(m->out) + offset;
              for (int r = 0; r < m->size; ++r) {
                const char* x = r == m->rank && !m->own_copied
                                    ? static_cast<const char*>(m->in) + offset
                                    : m->recv.get() + r * chunk_bytes;
                HostReduceStep(acc, x, m->n, m->dtype, m->reduce, r == 0);
              }
              HostReduceFinish(acc, m->n, m->dtype, m->reduce, m->size);
              return absl::OkStatus();
            }));
        op.steps.push_back(ExchangeStep(
            "MPI_Isend/MPI_Irecv (all-gather of the chunks)",
            [m](Requests* requests) {
              const int64_t elem = DTypeSize(m->dtype);
              char* const out = static_cast<char*>(m->out);
              const char* own =
                  out + static_cast<int64_t>(m->displs[m->rank]) * elem;
              return PostExchange(
                  *m,
                  [m, out, elem](int r) {
                    return std::pair<void*, int>(
                        out + static_cast<int64_t>(m->displs[r]) * elem,
                        m->counts[r]);
                  },
                  [m, own](int) {
                    return std::pair<const void*, int>(own, m->n);
                  },
                  requests);
            },
            stage ? std::function<absl::Status()>([m]() {
              StageOut(m->user_out, m->out, m->bytes);
              return absl::OkStatus();
            })
                  : nullptr));
      });
}

std::unique_ptr<Work> MpiCommunicator::Broadcast(
    BufferRef buffer, const BroadcastOptions& options) {
  const CommState& st = *state_;
  OpInfo info{st.rank, OpCode::kBroadcast, state_->next_seq++};
  info.buffers = 1;
  info.input_count = buffer.count;
  info.input_dtype = buffer.dtype;
  info.root = options.root;
  absl::Status valid =
      ValidateBroadcast(st.rank, st.size, info.seq, buffer, options);
  if (valid.ok()) valid = CheckMpiLimits(info, buffer.device, buffer.count);
  Header header = DataHeader(info, buffer.count, buffer.dtype);
  header.root = options.root;
  const bool is_root = options.root == st.rank;
  const bool stage = st.options.stage_buffers;
  return Launch(
      state_, info, options.timeout, valid, header,
      st.options.check_collectives, [&](Op& op) {
        OpMemory* m = &op.memory;
        m->n = static_cast<int>(buffer.count);
        m->type = ElementType(buffer.dtype);
        m->bytes = buffer.bytes();
        m->root = options.root;
        m->is_root = is_root;
        m->user_out = buffer.data;
        if (stage) {
          m->send = is_root ? StageIn(buffer.data, m->bytes) : Alloc(m->bytes);
          m->out = m->send.get();
        } else {
          m->out = NonNull(buffer.data);
          op.zero_copy = true;
        }
        op.steps.push_back({"MPI_Ibcast",
                            [m](MPI_Request* request) {
                              return MPI_Ibcast(m->out, m->n, m->type, m->root,
                                                m->comm, request);
                            },
                            stage ? std::function<absl::Status()>([m]() {
                              if (!m->is_root)
                                StageOut(m->user_out, m->out, m->bytes);
                              return absl::OkStatus();
                            })
                                  : nullptr});
      });
}

absl::StatusOr<std::vector<std::string>> MpiCommunicator::AllGatherBytes(
    absl::string_view bytes, const CollectiveOptions& options) {
  const CommState& st = *state_;
  const OpInfo info{st.rank, OpCode::kAllGatherBytes, state_->next_seq++,
                    absl::StrFormat("%d bytes", bytes.size())};
  Header header;
  header.seq = info.seq;
  header.op = static_cast<int32_t>(info.code);
  header.pre_divide = header.post_divide = 1.0;
  const int size = st.size;
  std::vector<std::string> result;
  std::vector<std::string>* out = &result;
  // Lengths are checked after they are exchanged, so that every rank fails
  // alike instead of one failing and the others timing out. The string is
  // always copied (metadata, small): this call returns even after a
  // timeout, when MPI may still read it.
  std::unique_ptr<Work> work = Launch(
      state_, info, options.timeout, absl::OkStatus(), header,
      st.options.check_collectives, [&](Op& op) {
        OpMemory* m = &op.memory;
        m->length = static_cast<int64_t>(bytes.size());
        m->lengths.resize(size);
        m->send = Alloc(m->length);
        CopyBytes(m->send.get(), bytes.data(), m->length);
        m->lengths[m->rank] = m->length;
        // Point-to-point exchanges, as the data collectives, so that a
        // timeout names the ranks whose part never came.
        op.steps.push_back(ExchangeStep(
            "MPI_Isend/MPI_Irecv (lengths)",
            [m](Requests* requests) {
              m->type = MPI_INT64_T;
              return PostExchange(
                  *m,
                  [m](int r) {
                    return std::pair<void*, int>(&m->lengths[r], 1);
                  },
                  [m](int) {
                    return std::pair<const void*, int>(&m->length, 1);
                  },
                  requests);
            },
            [=]() {
              int64_t total = 0;
              for (int64_t length : m->lengths) total += length;
              if (total > INT_MAX) {
                return absl::UnimplementedError(absl::StrFormat(
                    "%s: the ranks' strings total %d bytes (lengths %s), "
                    "over MPI's int count limit %d",
                    info.Describe(), total, absl::StrJoin(m->lengths, ","),
                    INT_MAX));
              }
              m->counts.resize(size);
              m->displs.resize(size);
              for (int r = 0, offset = 0; r < size; ++r) {
                m->counts[r] = static_cast<int>(m->lengths[r]);
                m->displs[r] = offset;
                offset += m->counts[r];
              }
              m->recv = Alloc(total);
              CopyBytes(m->recv.get() + m->displs[m->rank], m->send.get(),
                        m->length);
              return absl::OkStatus();
            }));
        // `out` is written before Wait() below returns OK; after a
        // timeout this step's finish never runs.
        op.steps.push_back(ExchangeStep(
            "MPI_Isend/MPI_Irecv (strings)",
            [m](Requests* requests) {
              m->type = MPI_BYTE;
              return PostExchange(
                  *m,
                  [m](int r) {
                    return std::pair<void*, int>(m->recv.get() + m->displs[r],
                                                 m->counts[r]);
                  },
                  [m](int) {
                    return std::pair<const void*, int>(
                        m->send.get(), static_cast<int>(m->length));
                  },
                  requests);
            },
            [=]() {
              out->clear();
              for (int r = 0; r < size; ++r) {
                out->emplace_back(m->recv.get() + m->displs[r], m->counts[r]);
              }
              return absl::OkStatus();
            }));
      });
  FLATPARAM_RETURN_IF_ERROR(work->Wait());
  return result;
}

absl::Status MpiCommunicator::Barrier(const CollectiveOptions& options) {
  const CommState& st = *state_;
  const OpInfo info{st.rank, OpCode::kBarrier, state_->next_seq++, ""};
  Header header;
  header.seq = info.seq;
  header.op = static_cast<int32_t>(info.code);
  header.pre_divide = header.post_divide = 1.0;
  const MPI_Comm comm = st.comm;
  return Launch(state_, info, options.timeout, absl::OkStatus(), header,
                st.options.check_collectives,
                [&](Op& op) {
                  op.steps.push_back({"MPI_Ibarrier",
                                      [=](MPI_Request* request) {
                                        return MPI_Ibarrier(comm, request);
                                      },
                                      nullptr});
                })
      ->Wait();
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
  FLATPARAM_ASSIGN_OR_RETURN(std::shared_ptr<CommState> state,
                             Adopt(comm, st.options));
  return std::unique_ptr<Communicator>(new MpiCommunicator(state));
}

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

// Prints why, then ends every process of the job. Does not return.
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

}  // namespace

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
  const std::string timeout = absl::FormatDuration(options.timeout);
  std::string who = LauncherRank() >= 0
                        ? absl::StrFormat("rank %d", LauncherRank())
                        : std::string("this process");
  absl::StatusOr<MpiSession> session = [&] {
    Watchdog start(
        options.timeout, program,
        absl::StrFormat(
            "%s: MPI did not start within %s: MPI_Init waits for every "
            "process of the job, and at least one has not reached it "
            "(stopped, still starting, or not launched); exiting, so that "
            "mpirun ends the job",
            who, timeout));
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
  double code = static_cast<double>(status.code());
  std::vector<double> codes(exit_comm->size());
  CollectiveOptions handshake;
  handshake.timeout = options.timeout;
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
