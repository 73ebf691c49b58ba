#include "comm/mpi/mpi_communicator.h"

#include <algorithm>
#include <atomic>
#include <cassert>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "comm/host_reduce.h"
#include "flatparam/base/dtype.h"
#include "flatparam/base/status_macros.h"

namespace flatparam {
namespace internal_mpi {

// The state a communicator shares with its in-flight Work, so that a Work
// outliving its communicator still has a valid MPI_Comm and can still mark
// the group broken.
struct CommState {
  MPI_Comm comm = MPI_COMM_NULL;
  int rank = 0;
  int size = 1;
  MpiOptions options;
  int64_t next_seq = 0;
  // OK while usable; the error that broke the communicator otherwise.
  absl::Status broken;

  ~CommState() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (comm != MPI_COMM_NULL && !finalized) MPI_Comm_free(&comm);
  }
};

}  // namespace internal_mpi

namespace {

using internal_mpi::CommState;

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

// One collective call, for error messages.
struct OpInfo {
  int rank = 0;
  OpCode code = OpCode::kBarrier;
  int64_t seq = 0;
  std::string sizes;

  // "rank 1: all_reduce #7", the prefix ValidateAllReduce & co. use too.
  std::string Prefix() const {
    return absl::StrFormat("rank %d: %s #%d", rank,
                           OpName(static_cast<int32_t>(code)), seq);
  }
  // The prefix with the sizes: "rank 1: all_reduce #7 (7 x float32)".
  std::string Describe() const {
    return sizes.empty() ? Prefix() : absl::StrCat(Prefix(), " (", sizes, ")");
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

void MarkBroken(CommState& state, const absl::Status& status) {
  if (state.broken.ok()) state.broken = status;
}

absl::Status BrokenError(const CommState& state, const OpInfo& info) {
  return absl::AbortedError(
      absl::StrFormat("%s: the communicator is broken, so nothing was sent; "
                      "it broke on: %s",
                      info.Describe(), state.broken.message()));
}

// Collective requests abandoned after a timeout, with the memory MPI may
// still write. MPI forbids freeing an active collective request, so they are
// tested until they complete. Process-wide; never destroyed, because MPI
// may still write into the buffers during static destruction.
struct Abandoned {
  MPI_Request request;
  std::shared_ptr<void> keep_alive;
};
std::mutex& AbandonedMutex() {
  static auto* mu = new std::mutex;
  return *mu;
}
std::vector<Abandoned>& AbandonedRequests() {
  static auto* requests = new std::vector<Abandoned>;
  return *requests;
}
std::atomic<int> g_abandoned_count{0};

void Abandon(MPI_Request request, std::shared_ptr<void> keep_alive) {
  std::lock_guard<std::mutex> lock(AbandonedMutex());
  AbandonedRequests().push_back({request, std::move(keep_alive)});
  g_abandoned_count.store(static_cast<int>(AbandonedRequests().size()));
}

// Memory of collectives that failed with an MPI error: MPI may still write
// into it, and there is no request left to tell when it stops.
void KeepForever(std::shared_ptr<void> memory) {
  static auto* kept = new std::vector<std::shared_ptr<void>>;
  std::lock_guard<std::mutex> lock(AbandonedMutex());
  kept->push_back(std::move(memory));
}

// Tests every abandoned request once and releases the finished ones.
// Returns how many are still pending.
int PollAbandoned() {
  if (g_abandoned_count.load() == 0) return 0;
  std::lock_guard<std::mutex> lock(AbandonedMutex());
  auto& requests = AbandonedRequests();
  requests.erase(std::remove_if(requests.begin(), requests.end(),
                                [](Abandoned& a) {
                                  int flag = 0;
                                  const int rc = MPI_Test(&a.request, &flag,
                                                          MPI_STATUS_IGNORE);
                                  // An erroring request will never finish.
                                  return rc != MPI_SUCCESS || flag != 0;
                                }),
                 requests.end());
  g_abandoned_count.store(static_cast<int>(requests.size()));
  return static_cast<int>(requests.size());
}

// Tests `*request` until it completes or `deadline` passes; sets `*done`.
// Spins for the first polls (among running peers a small collective ends in
// microseconds), then sleeps, doubling up to 1 ms, so that oversubscribed
// ranks leave the CPU to the peers they wait for. Returns the MPI code.
int PollUntil(MPI_Request* request, absl::Time deadline, bool* done) {
  absl::Duration nap = absl::Microseconds(5);
  for (int polls = 0;; ++polls) {
    int flag = 0;
    const int rc = MPI_Test(request, &flag, MPI_STATUS_IGNORE);
    if (rc != MPI_SUCCESS || flag != 0) {
      *done = flag != 0;
      return rc;
    }
    if (absl::Now() >= deadline) {
      *done = false;
      return MPI_SUCCESS;
    }
    if (polls >= 64) {
      absl::SleepFor(nap);
      nap = std::min(nap * 2, absl::Milliseconds(1));
    }
  }
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

// A process-wide cache of staging buffers. A large buffer allocated afresh
// for every collective page-faults on every call (measured: a 256 MiB
// all-gather ran at 0.12x of raw MPI), so buffers return here when their
// collective is done and are reused by the next one of a similar size. At
// most kMaxCachedBytes stay cached; the rest go back to the allocator.
class StagingPool {
 public:
  static constexpr int64_t kMaxCachedBytes = int64_t{1} << 30;
  static constexpr size_t kMaxCachedBuffers = 16;

  static StagingPool& Get() {
    static StagingPool* pool = new StagingPool;  // Never destroyed: buffers
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

struct StagingDeleter {
  int64_t capacity = 0;
  void operator()(char* p) const { StagingPool::Get().Release(p, capacity); }
};
using StagingBuffer = std::unique_ptr<char[], StagingDeleter>;

// Memory a collective owns while MPI uses it.
struct Staging {
  Header header;
  std::vector<Header> headers;
  StagingBuffer send;
  StagingBuffer recv;
  StagingBuffer acc;
  std::vector<int> counts;
  std::vector<int> displs;
  std::vector<int> recv_counts;
  std::vector<int> recv_displs;
  int64_t length = 0;
  std::vector<int64_t> lengths;
};

// Uninitialised; never null, so MPI gets a valid pointer for 0 bytes too.
StagingBuffer Alloc(int64_t bytes) {
  int64_t capacity = 0;
  char* p = StagingPool::Get().Acquire(bytes, &capacity);
  return StagingBuffer(p, StagingDeleter{capacity});
}

void CopyBytes(void* dst, const void* src, int64_t bytes) {
  if (bytes > 0) std::memcpy(dst, src, bytes);
}

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

// One nonblocking MPI operation of a collective and the local work after it.
struct Step {
  const char* call;
  // Starts the operation; returns the MPI result code.
  std::function<int(MPI_Request*)> start;
  // Runs once it completed (may be empty).
  std::function<absl::Status()> finish;
};

class MpiWork final : public Work {
 public:
  MpiWork(std::shared_ptr<CommState> state, OpInfo info, absl::Duration timeout,
          std::shared_ptr<Staging> staging, std::vector<Step> steps)
      : state_(std::move(state)),
        info_(std::move(info)),
        timeout_(timeout),
        deadline_(absl::Now() + timeout),
        staging_(std::move(staging)),
        steps_(std::move(steps)) {
    if (!steps_.empty()) start_status_ = StartNext();
  }

  // Waiting here keeps every rank issuing the same MPI operations in the
  // same order even when a caller drops a Work without waiting on it.
  ~MpiWork() override { Wait().IgnoreError(); }

  absl::Status Wait() override {
    if (!done_) {
      PollAbandoned();
      status_ = start_status_.ok() ? Drive() : start_status_;
      done_ = true;
      steps_.clear();
      staging_.reset();
    }
    return status_;
  }

 private:
  absl::Status StartNext() {
    if (!state_->broken.ok()) return BrokenError(*state_, info_);
    const int rc = steps_[next_].start(&request_);
    if (rc != MPI_SUCCESS) {
      absl::Status status = FromMpi(rc, steps_[next_].call, info_.Describe());
      MarkBroken(*state_, status);
      return status;
    }
    active_ = true;
    return absl::OkStatus();
  }

  absl::Status Drive() {
    while (true) {
      if (active_) {
        active_ = false;
        bool done = false;
        const int rc = PollUntil(&request_, deadline_, &done);
        if (rc != MPI_SUCCESS) {
          // An MPI error aborts the collective's schedule, but its other
          // point-to-point parts may still land in the staging buffers.
          KeepForever(staging_);
          absl::Status status = FromMpi(rc, "MPI_Test", info_.Describe());
          MarkBroken(*state_, status);
          return status;
        }
        if (!done) return TimedOut();
        if (steps_[next_].finish) {
          FLATPARAM_RETURN_IF_ERROR(steps_[next_].finish());
        }
        ++next_;
      }
      if (next_ == steps_.size()) return absl::OkStatus();
      FLATPARAM_RETURN_IF_ERROR(StartNext());
    }
  }

  absl::Status TimedOut() {
    Abandon(request_, staging_);
    request_ = MPI_REQUEST_NULL;
    absl::Status status = absl::DeadlineExceededError(absl::StrFormat(
        "%s timed out after %s in %s (step %d of %d): a peer did not call "
        "it, is too slow, or is stuck elsewhere; the communicator is now "
        "broken and later calls on it fail with Aborted",
        info_.Describe(), absl::FormatDuration(timeout_), steps_[next_].call,
        next_ + 1, steps_.size()));
    MarkBroken(*state_, status);
    return status;
  }

  std::shared_ptr<CommState> state_;
  OpInfo info_;
  absl::Duration timeout_;
  absl::Time deadline_;
  std::shared_ptr<Staging> staging_;
  std::vector<Step> steps_;
  size_t next_ = 0;
  MPI_Request request_ = MPI_REQUEST_NULL;
  bool active_ = false;
  absl::Status start_status_;
  bool done_ = false;
  absl::Status status_;
};

Step HeaderStep(const CommState& state, const OpInfo& info,
                const Header& header, const absl::Status& valid,
                Staging* staging) {
  staging->header = header;
  staging->header.valid = valid.ok() ? 1 : 0;
  staging->headers.resize(state.size);
  const MPI_Comm comm = state.comm;
  return {"MPI_Iallgather (check header)",
          [comm, staging](MPI_Request* request) {
            return MPI_Iallgather(&staging->header, sizeof(Header), MPI_BYTE,
                                  staging->headers.data(), sizeof(Header),
                                  MPI_BYTE, comm, request);
          },
          [info, valid, staging]() {
            return CompareHeaders(info, staging->headers, valid);
          }};
}

using Plan = std::function<void(Staging&, std::vector<Step>&)>;

// Issues a collective: fails fast on a broken communicator, adds the header
// step when checking, and the data steps from `plan` when `valid` is OK.
std::unique_ptr<Work> Launch(const std::shared_ptr<CommState>& state,
                             const OpInfo& info, absl::Duration timeout,
                             const absl::Status& valid, const Header& header,
                             bool check, const Plan& plan) {
  if (!state->broken.ok()) return CompletedWork(BrokenError(*state, info));
  if (!check && !valid.ok()) return CompletedWork(valid);
  auto staging = std::make_shared<Staging>();
  std::vector<Step> steps;
  if (check) {
    steps.push_back(HeaderStep(*state, info, header, valid, staging.get()));
  }
  if (valid.ok() && plan) plan(*staging, steps);
  return std::make_unique<MpiWork>(state, info, timeout, std::move(staging),
                                   std::move(steps));
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

std::string Sizes(ConstBufferRef b) {
  return absl::StrFormat("%d x %s", b.count, DTypeName(b.dtype));
}

std::string Sizes(ConstBufferRef input, ConstBufferRef output) {
  return absl::StrFormat("input %s, output %s", Sizes(input), Sizes(output));
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

int PendingAbandonedMpiRequests() { return PollAbandoned(); }

absl::Status FinalizeMpi(absl::Duration grace) {
  int initialized = 0;
  int finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (!initialized || finalized) return absl::OkStatus();
  const absl::Time deadline = absl::Now() + grace;
  while (PollAbandoned() > 0 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  if (!g_flatparam_initialized_mpi) return absl::OkStatus();
  g_flatparam_initialized_mpi = false;
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

MpiCommunicator::~MpiCommunicator() { PollAbandoned(); }

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
  const std::string where = absl::StrFormat("rank %d: Wrap", rank);
  // MPI writes the new handle when the request completes, possibly after a
  // timeout: the handle lives on the heap, kept alive by the request.
  auto dup = std::make_shared<MPI_Comm>(MPI_COMM_NULL);
  MPI_Request request = MPI_REQUEST_NULL;
  FLATPARAM_RETURN_IF_ERROR(FromMpi(MPI_Comm_idup(comm, dup.get(), &request),
                                    "MPI_Comm_idup", where));
  bool done = false;
  FLATPARAM_RETURN_IF_ERROR(
      FromMpi(PollUntil(&request, absl::Now() + options.create_timeout, &done),
              "MPI_Test", where));
  if (!done) {
    Abandon(request, dup);
    return absl::DeadlineExceededError(absl::StrFormat(
        "%s: MPI_Comm_idup did not complete within %s: not every process of "
        "the communicator called CreateWorld/Wrap",
        where, absl::FormatDuration(options.create_timeout)));
  }
  FLATPARAM_ASSIGN_OR_RETURN(std::shared_ptr<CommState> state,
                             Adopt(*dup, options));
  return std::unique_ptr<MpiCommunicator>(new MpiCommunicator(state));
}

int MpiCommunicator::rank() const { return state_->rank; }
int MpiCommunicator::size() const { return state_->size; }
MPI_Comm MpiCommunicator::mpi_comm() const { return state_->comm; }
absl::Status MpiCommunicator::health() const { return state_->broken; }
const MpiOptions& MpiCommunicator::options() const { return state_->options; }

std::unique_ptr<Work> MpiCommunicator::AllGather(
    ConstBufferRef input, BufferRef output, const CollectiveOptions& options) {
  const CommState& st = *state_;
  const OpInfo info{st.rank, OpCode::kAllGather, state_->next_seq++,
                    Sizes(input, output)};
  absl::Status valid =
      ValidateAllGather(st.rank, st.size, info.seq, input, output);
  if (valid.ok()) valid = CheckMpiLimits(info, input.device, input.count);
  const MPI_Comm comm = st.comm;
  const int size = st.size;
  return Launch(
      state_, info, options.timeout, valid,
      DataHeader(info, input.count, input.dtype), st.options.check_collectives,
      [&](Staging& s, std::vector<Step>& steps) {
        const int64_t bytes = input.bytes();
        s.send = Alloc(bytes);
        CopyBytes(s.send.get(), input.data, bytes);
        s.recv = Alloc(bytes * size);
        const int n = static_cast<int>(input.count);
        const MPI_Datatype type = ElementType(input.dtype);
        Staging* sp = &s;
        steps.push_back({"MPI_Iallgather",
                         [=](MPI_Request* request) {
                           return MPI_Iallgather(sp->send.get(), n, type,
                                                 sp->recv.get(), n, type, comm,
                                                 request);
                         },
                         [=]() {
                           CopyBytes(output.data, sp->recv.get(), bytes * size);
                           return absl::OkStatus();
                         }});
      });
}

std::unique_ptr<Work> MpiCommunicator::ReduceScatter(
    ConstBufferRef input, BufferRef output, const ReduceOptions& options) {
  const CommState& st = *state_;
  const OpInfo info{st.rank, OpCode::kReduceScatter, state_->next_seq++,
                    Sizes(input, output)};
  absl::Status valid =
      ValidateReduceScatter(st.rank, st.size, info.seq, input, output, options);
  if (valid.ok()) valid = CheckMpiLimits(info, input.device, output.count);
  const MPI_Comm comm = st.comm;
  const int size = st.size;
  return Launch(
      state_, info, options.timeout, valid,
      ReduceHeader(info, output.count, output.dtype, options),
      st.options.check_collectives, [&](Staging& s, std::vector<Step>& steps) {
        const int64_t bytes = input.bytes();
        s.send = Alloc(bytes);
        CopyBytes(s.send.get(), input.data, bytes);
        s.recv = Alloc(bytes);
        const int n = static_cast<int>(output.count);
        const int64_t slice_bytes = output.bytes();
        const MPI_Datatype type = ElementType(input.dtype);
        const ReduceOptions reduce = options;
        Staging* sp = &s;
        steps.push_back(
            {"MPI_Ialltoall",
             [=](MPI_Request* request) {
               return MPI_Ialltoall(sp->send.get(), n, type, sp->recv.get(), n,
                                    type, comm, request);
             },
             [=]() {
               // recv holds slice rank() of every rank, in rank order.
               for (int r = 0; r < size; ++r) {
                 HostReduceStep(output.data, sp->recv.get() + r * slice_bytes,
                                n, output.dtype, reduce, r == 0);
               }
               HostReduceFinish(output.data, n, output.dtype, reduce, size);
               return absl::OkStatus();
             }});
      });
}

std::unique_ptr<Work> MpiCommunicator::AllReduce(ConstBufferRef input,
                                                 BufferRef output,
                                                 const ReduceOptions& options) {
  const CommState& st = *state_;
  const OpInfo info{st.rank, OpCode::kAllReduce, state_->next_seq++,
                    Sizes(input, output)};
  absl::Status valid =
      ValidateAllReduce(st.rank, st.size, info.seq, input, output, options);
  if (valid.ok()) valid = CheckMpiLimits(info, input.device, input.count);
  const MPI_Comm comm = st.comm;
  const int size = st.size;
  const int rank = st.rank;
  return Launch(
      state_, info, options.timeout, valid,
      ReduceHeader(info, input.count, input.dtype, options),
      st.options.check_collectives, [&](Staging& s, std::vector<Step>& steps) {
        const int64_t elem = DTypeSize(input.dtype);
        const int64_t bytes = input.bytes();
        // Rank i reduces chunk i: the first count % size chunks have one
        // element more.
        const int n = static_cast<int>(input.count);
        s.counts.resize(size);
        s.displs.resize(size);
        for (int r = 0, offset = 0; r < size; ++r) {
          s.counts[r] = n / size + (r < n % size ? 1 : 0);
          s.displs[r] = offset;
          offset += s.counts[r];
        }
        const int mine = s.counts[rank];
        s.recv_counts.assign(size, mine);
        s.recv_displs.resize(size);
        for (int r = 0; r < size; ++r) s.recv_displs[r] = r * mine;
        s.send = Alloc(bytes);
        CopyBytes(s.send.get(), input.data, bytes);
        s.recv = Alloc(static_cast<int64_t>(mine) * size * elem);
        s.acc = Alloc(static_cast<int64_t>(mine) * elem);
        const MPI_Datatype type = ElementType(input.dtype);
        const ReduceOptions reduce = options;
        const DType dtype = input.dtype;
        Staging* sp = &s;
        steps.push_back(
            {"MPI_Ialltoallv",
             [=](MPI_Request* request) {
               return MPI_Ialltoallv(
                   sp->send.get(), sp->counts.data(), sp->displs.data(), type,
                   sp->recv.get(), sp->recv_counts.data(),
                   sp->recv_displs.data(), type, comm, request);
             },
             [=]() {
               for (int r = 0; r < size; ++r) {
                 HostReduceStep(sp->acc.get(), sp->recv.get() + r * mine * elem,
                                mine, dtype, reduce, r == 0);
               }
               HostReduceFinish(sp->acc.get(), mine, dtype, reduce, size);
               return absl::OkStatus();
             }});
        // The staged input is no longer needed: gather into it.
        steps.push_back({"MPI_Iallgatherv",
                         [=](MPI_Request* request) {
                           return MPI_Iallgatherv(
                               sp->acc.get(), mine, type, sp->send.get(),
                               sp->counts.data(), sp->displs.data(), type, comm,
                               request);
                         },
                         [=]() {
                           CopyBytes(output.data, sp->send.get(), bytes);
                           return absl::OkStatus();
                         }});
      });
}

std::unique_ptr<Work> MpiCommunicator::Broadcast(
    BufferRef buffer, const BroadcastOptions& options) {
  const CommState& st = *state_;
  const OpInfo info{
      st.rank, OpCode::kBroadcast, state_->next_seq++,
      absl::StrFormat("%s, root %d", Sizes(buffer), options.root)};
  absl::Status valid =
      ValidateBroadcast(st.rank, st.size, info.seq, buffer, options);
  if (valid.ok()) valid = CheckMpiLimits(info, buffer.device, buffer.count);
  Header header = DataHeader(info, buffer.count, buffer.dtype);
  header.root = options.root;
  const MPI_Comm comm = st.comm;
  const bool is_root = options.root == st.rank;
  return Launch(
      state_, info, options.timeout, valid, header,
      st.options.check_collectives, [&](Staging& s, std::vector<Step>& steps) {
        const int64_t bytes = buffer.bytes();
        s.send = Alloc(bytes);
        if (is_root) CopyBytes(s.send.get(), buffer.data, bytes);
        const int n = static_cast<int>(buffer.count);
        const MPI_Datatype type = ElementType(buffer.dtype);
        const int root = options.root;
        Staging* sp = &s;
        steps.push_back({"MPI_Ibcast",
                         [=](MPI_Request* request) {
                           return MPI_Ibcast(sp->send.get(), n, type, root,
                                             comm, request);
                         },
                         [=]() {
                           if (!is_root) {
                             CopyBytes(buffer.data, sp->send.get(), bytes);
                           }
                           return absl::OkStatus();
                         }});
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
  const MPI_Comm comm = st.comm;
  const int size = st.size;
  std::vector<std::string> result;
  std::vector<std::string>* out = &result;
  // Lengths are checked after they are exchanged, so that every rank fails
  // alike instead of one failing and the others timing out.
  std::unique_ptr<Work> work = Launch(
      state_, info, options.timeout, absl::OkStatus(), header,
      st.options.check_collectives, [&](Staging& s, std::vector<Step>& steps) {
        s.length = static_cast<int64_t>(bytes.size());
        s.lengths.resize(size);
        s.send = Alloc(s.length);
        CopyBytes(s.send.get(), bytes.data(), s.length);
        Staging* sp = &s;
        steps.push_back(
            {"MPI_Iallgather (lengths)",
             [=](MPI_Request* request) {
               return MPI_Iallgather(&sp->length, 1, MPI_INT64_T,
                                     sp->lengths.data(), 1, MPI_INT64_T, comm,
                                     request);
             },
             [=]() {
               int64_t total = 0;
               for (int64_t length : sp->lengths) total += length;
               if (total > INT_MAX) {
                 return absl::UnimplementedError(absl::StrFormat(
                     "%s: the ranks' strings total %d bytes (lengths %s), "
                     "over MPI's int count limit %d",
                     info.Describe(), total, absl::StrJoin(sp->lengths, ","),
                     INT_MAX));
               }
               sp->counts.resize(size);
               sp->displs.resize(size);
               for (int r = 0, offset = 0; r < size; ++r) {
                 sp->counts[r] = static_cast<int>(sp->lengths[r]);
                 sp->displs[r] = offset;
                 offset += sp->counts[r];
               }
               sp->recv = Alloc(total);
               return absl::OkStatus();
             }});
        steps.push_back({"MPI_Iallgatherv",
                         [=](MPI_Request* request) {
                           return MPI_Iallgatherv(
                               sp->send.get(), static_cast<int>(sp->length),
                               MPI_BYTE, sp->recv.get(), sp->counts.data(),
                               sp->displs.data(), MPI_BYTE, comm, request);
                         },
                         [=]() {
                           out->clear();
                           for (int r = 0; r < size; ++r) {
                             out->emplace_back(sp->recv.get() + sp->displs[r],
                                               sp->counts[r]);
                           }
                           return absl::OkStatus();
                         }});
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
                [&](Staging&, std::vector<Step>& steps) {
                  steps.push_back({"MPI_Ibarrier",
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
  // sure every rank has arrived (and called split), so it cannot hang.
  FLATPARAM_RETURN_IF_ERROR(Launch(state_, info, options.timeout,
                                   absl::OkStatus(), header, /*check=*/true,
                                   nullptr)
                                ->Wait());
  MPI_Comm comm = MPI_COMM_NULL;
  absl::Status status = FromMpi(
      MPI_Comm_split(st.comm, color < 0 ? MPI_UNDEFINED : color, key, &comm),
      "MPI_Comm_split", info.Describe());
  if (!status.ok()) {
    MarkBroken(*state_, status);
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

absl::Status RunOnMpiWorld(
    const std::function<absl::Status(MpiCommunicator&)>& fn,
    const MpiOptions& options) {
  FLATPARAM_ASSIGN_OR_RETURN(MpiSession session,
                             MpiSession::Start(nullptr, nullptr));
  absl::Status status;
  {
    // Communicators go before MPI is finalised.
    absl::StatusOr<std::unique_ptr<MpiCommunicator>> world =
        MpiCommunicator::CreateWorld(options);
    status = world.ok() ? fn(**world) : world.status();
  }
  const absl::Status finished = session.Finish();
  return status.ok() ? finished : status;
}

}  // namespace flatparam
