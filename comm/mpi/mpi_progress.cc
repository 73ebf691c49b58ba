// The MPI backend's progress engine (Engine in internal/mpi_internal.h):
// submitting collectives' steps in issue order per communicator, driving
// them to completion from a waiting thread or the progress thread, timeouts
// and abandoned requests. See "Progress", "Ordering" and "Timeouts and
// failures" in DESIGN.md for the behaviour.
#include <mpi.h>

#include <algorithm>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "comm/mpi/internal/mpi_internal.h"
#include "comm/mpi/mpi_communicator.h"

namespace flatparam {
namespace internal_mpi {
namespace {

// Collectives that failed with an MPI error: MPI may still write into their
// memory, and there is no request left to tell when it stops.
void KeepForever(std::shared_ptr<Op> op) {
  static auto* mu = new std::mutex;
  static auto* kept = new std::vector<std::shared_ptr<Op>>;
  std::lock_guard<std::mutex> lock(*mu);
  kept->push_back(std::move(op));
}

int StopEngineOnFinalize(MPI_Comm, int, void*, void*);

// Waiters poll back to back (a small collective among running peers ends
// in microseconds; a sleep, rounded up to the timer slack of about 50 us,
// would cost more than it) for kWaiterSpinFor after the last progress,
// then sleep with doubling naps so that a long wait for a late peer does
// not hold a core. The cap is low because a large transfer between two
// completions also needs polls to move its data.
constexpr absl::Duration kWaiterSpinFor = absl::Milliseconds(10);
// Tests per op between two looks at the mutex and the clock.
constexpr int kWaiterSweeps = 16;
constexpr absl::Duration kWaiterMaxNap = absl::Microseconds(250);
// How long a waiter sleeps at most before re-checking while another
// thread drives (it is woken when the driver lets go).
constexpr absl::Duration kDriverWait = absl::Milliseconds(1);
// The progress thread, while the ranks compute: polls back to back
// briefly, then naps doubling up to kThreadMaxNap, so that a collective
// that needs this rank advances within a fraction of a millisecond
// without taking a core from the computation.
constexpr absl::Duration kThreadSpinFor = absl::Microseconds(20);
constexpr absl::Duration kThreadMaxNap = absl::Microseconds(200);
// When only abandoned requests are in flight, a slow check.
constexpr absl::Duration kAbandonedPeriod = absl::Milliseconds(10);
// The progress thread is not woken for each collective (a wake-up per
// collective costs a context switch, which collectives waited on at once
// cannot afford): while collectives are being issued it checks every
// kArmedPeriod whether any is in flight with no thread waiting. After
// kDormantAfter without a Submit it sleeps until the next Submit wakes it.
constexpr absl::Duration kArmedPeriod = absl::Milliseconds(1);
constexpr absl::Duration kDormantAfter = absl::Milliseconds(100);

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

bool RequestDone(MPI_Request request) {
  if (request == MPI_REQUEST_NULL) return true;
  int flag = 0;
  return MPI_Request_get_status(request, &flag, MPI_STATUS_IGNORE) ==
             MPI_SUCCESS &&
         flag != 0;
}

// "rank 2", "ranks 1 and 3", with world ranks where `c` is a subgroup:
// "rank 1 (world rank 5)". `has`/`have`: a verb to follow, or empty.
std::string RankList(const CommState& c, const std::vector<int>& ranks,
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

}  // namespace

Engine& Engine::Get() {
  static Engine* engine = new Engine;  // Never destroyed: the progress
  return *engine;  // thread and abandoned requests may outlive main().
}

void Engine::Submit(const std::shared_ptr<Op>& op) {
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

absl::Status Engine::Wait(Op& op) {
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

absl::Status Engine::Health(const CommState& state) {
  std::lock_guard<std::mutex> lock(mu_);
  return state.broken;
}

void Engine::Break(CommState& state, const absl::Status& status) {
  std::lock_guard<std::mutex> lock(mu_);
  BreakLocked(state, status);
}

absl::Status Engine::FirstBreak() {
  std::lock_guard<std::mutex> lock(mu_);
  return first_break_;
}

int Engine::PendingAbandoned() {
  std::unique_lock<std::mutex> lock(mu_);
  if (abandoned_ == 0 || driving_) return abandoned_;
  driving_ = true;
  PollLocked(lock, 1);
  ReleaseDriverLocked();
  return abandoned_;
}

bool Engine::HasProgressThread() {
  EnsureThread();
  std::lock_guard<std::mutex> lock(mu_);
  return thread_.joinable() && !stop_;
}

void Engine::StopThread() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    thread_cv_.notify_all();
  }
  if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) {
    thread_.join();
  }
}

// Starts the progress thread once, if MPI provides MPI_THREAD_MULTIPLE;
// with less, flatparam must not call MPI from a thread of its own.
void Engine::EnsureThread() {
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

void Engine::ThreadMain() {
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
bool Engine::HasLiveInflightLocked() const {
  return static_cast<int>(inflight_.size()) > abandoned_;
}

void Engine::ReleaseDriverLocked() {
  driving_ = false;
  if (waiters_ > 0) done_cv_.notify_all();
}

// Tests every op in flight, up to `sweeps` times until one completes,
// and handles the completed ones. Called by the driver (driving_ set by
// it) with `lock` held; the tests run without it (several sweeps per
// lock, so that a waiter's tight loop does not pay the mutex and the
// clock per test). Ops submitted meanwhile are tested from the next
// call. Returns, with `lock` held, whether any request completed.
bool Engine::PollLocked(std::unique_lock<std::mutex>& lock, int sweeps) {
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
int Engine::TestRequests(Op& op, int* flag) {
  Requests& requests = op.requests;
  if (requests.size() == 1) {
    return MPI_Test(&requests[0], flag, MPI_STATUS_IGNORE);
  }
  statuses_.resize(requests.size());
  const int rc = MPI_Testall(static_cast<int>(requests.size()), requests.data(),
                             flag, statuses_.data());
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
void Engine::CompleteLocked(const std::shared_ptr<Op>& op, int rc,
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
void Engine::StartStepLocked(const std::shared_ptr<Op>& op) {
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
  if (o.step == 0 && o.comm != nullptr && o.comm->recorder != nullptr) {
    o.comm->recorder->Started(o.flight_id);
  }
  if (o.step + 1 == o.steps.size()) PopLocked(o);
}

// Starts the queue's front ops while they can start: each one's first
// step; a multi-step op stays at the front until its last step starts.
void Engine::StartQueuedLocked(CommState& state) {
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

void Engine::PopLocked(const Op& o) {
  if (o.comm != nullptr && !o.comm->unstarted.empty() &&
      o.comm->unstarted.front().get() == &o) {
    o.comm->unstarted.pop_front();
  }
}

void Engine::FinishLocked(Op& o, absl::Status status) {
  // A success is recorded when it happens; a failure when MpiWork::Wait
  // sees it (where dumping the ring holds no lock).
  if (status.ok() && o.comm != nullptr && o.comm->recorder != nullptr) {
    o.comm->recorder->Finished(o.flight_id, status);
  }
  o.status = std::move(status);
  o.phase = Phase::kDone;
  PopLocked(o);
  if (waiters_ > 0) done_cv_.notify_all();
}

// Marks `state` broken (keeping the first error) and fails its queued
// collectives: nothing more may be sent on it, since which collectives
// the peers matched is unknown. A part-way front op fails when its next
// step would start.
void Engine::BreakLocked(CommState& state, const absl::Status& status) {
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
std::string Engine::MissingPeersLocked(const Op& o) {
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

void Engine::TimeOutLocked(Op& o) {
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

namespace {

int StopEngineOnFinalize(MPI_Comm, int, void*, void*) {
  Engine::Get().StopThread();
  return MPI_SUCCESS;
}

}  // namespace

}  // namespace internal_mpi

using internal_mpi::Engine;

int PendingAbandonedMpiRequests() { return Engine::Get().PendingAbandoned(); }

bool MpiHasProgressThread() {
  int initialized = 0;
  int finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  return initialized && !finalized && Engine::Get().HasProgressThread();
}

}  // namespace flatparam
