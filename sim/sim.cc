#include "sim/sim.h"

#include <pthread.h>
#include <sched.h>
#include <xxhash.h>

#include <algorithm>
#include <cassert>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <fstream>
#include <map>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "comm/host_reduce.h"
#include "flatparam/base/buffer_checks.h"
#include "flatparam/base/splitmix64.h"
#include "flatparam/base/status_macros.h"
#include "nlohmann/json.hpp"
#include "sim/chrome_trace.h"

namespace flatparam {
namespace internal_sim {

// One collective call as a rank issued it.
struct Call {
  OpKind kind = OpKind::kBarrier;
  ConstBufferRef input;
  BufferRef output;  // broadcast: the buffer (input views it too)
  ReduceOptions reduce;
  int root = 0;
  absl::Duration timeout = kDefaultCollectiveTimeout;
  std::string bytes;  // all_gather_bytes
  int color = 0;
  int key = 0;

  // The per-rank count that members must agree on.
  int64_t count() const {
    return kind == OpKind::kReduceScatter ? output.count : input.count;
  }
};

}  // namespace internal_sim

namespace {

using internal_sim::OpKind;

absl::string_view KindName(OpKind kind) { return CollectiveOpName(kind); }

bool IsReduction(OpKind kind) {
  return kind == OpKind::kReduceScatter || kind == OpKind::kAllReduce;
}

bool HasBuffers(OpKind kind) {
  return kind == OpKind::kAllGather || kind == OpKind::kReduceScatter ||
         kind == OpKind::kAllReduce || kind == OpKind::kBroadcast;
}

// The rank currently running on this thread, to catch a communicator or Work
// used from another rank's thread.
thread_local const void* tls_rank = nullptr;

std::string FormatTime(absl::Duration d) { return absl::FormatDuration(d); }

// "ranks 0-6: text" for runs of consecutive ranks with equal text.
std::string ListByRank(const std::vector<std::pair<int, std::string>>& items) {
  std::string out;
  size_t i = 0;
  while (i < items.size()) {
    size_t j = i + 1;
    while (j < items.size() && items[j].second == items[i].second &&
           items[j].first == items[j - 1].first + 1) {
      ++j;
    }
    if (j - i == 1) {
      absl::StrAppendFormat(&out, "\n  rank %d: %s", items[i].first,
                            items[i].second);
    } else {
      absl::StrAppendFormat(&out, "\n  ranks %d-%d: %s", items[i].first,
                            items[j - 1].first, items[i].second);
    }
    i = j;
  }
  return out;
}

std::string JoinCapped(const std::vector<int>& ranks, size_t cap) {
  std::vector<int> head(ranks.begin(),
                        ranks.begin() + std::min(cap, ranks.size()));
  std::string s = absl::StrJoin(head, ", ");
  if (ranks.size() > cap) {
    absl::StrAppend(&s, " and ", ranks.size() - cap, " more");
  }
  return s;
}

}  // namespace

// ---------------------------------------------------------------------------
// State.

struct SimWorld::OpMember {
  bool present = false;
  bool done = false;
  bool waited = false;
  bool abandoned = false;
  bool invalid = false;
  int world_rank = 0;
  int64_t rank_op = 0;
  int64_t bytes = 0;
  Call call;
  absl::Duration arrive;
  absl::Duration start;
  absl::Duration end;
  std::vector<uint64_t> sent_hashes;  // checksum mode
  const FaultSpec* flip = nullptr;
  absl::Status status;
  // split: the member's new group, or -1.
  int new_group = -1;
  int new_rank = -1;
};

struct SimWorld::Op {
  Group* group = nullptr;
  int64_t seq = 0;
  int arrived = 0;
  std::vector<OpMember> members;  // by group rank
  // all_gather_bytes: what every member receives, and the sender of a
  // flipped payload, which keeps its own original.
  std::vector<std::string> gathered;
  int flipped_sender = -1;
  std::string flipped_original;
  // No longer pending: executed or failed.
  bool finished = false;
};

struct SimWorld::Group {
  int id = 0;
  std::vector<int> members;  // world ranks by group rank
  std::vector<int64_t> next_seq;
  std::map<int64_t, std::shared_ptr<Op>> pending;  // unfinished, by seq
  bool aborted = false;
  std::string abort_reason;
};

struct SimWorld::Rank {
  enum class State : uint8_t { kReady, kBlocked, kDone };

  SimWorld* world = nullptr;
  int id = 0;
  pthread_t thread{};
  bool started = false;
  std::condition_variable cv;
  State state = State::kReady;
  int runnable_index = -1;
  absl::Duration clock;
  absl::Duration stream_free;  // end of the rank's last operation
  // SimCommunicator::ArriveNextAt's time for the next collective.
  std::optional<absl::Duration> next_arrival;
  // one_stream_per_rank: the operations this rank joined, oldest first
  // (finished ones are dropped from the front).
  std::deque<std::shared_ptr<Op>> in_order;
  int64_t ops = 0;  // collective calls so far
  Op* wait_op = nullptr;
  int wait_member = -1;
  bool dead = false;
  std::string death;
  std::vector<int> groups;
  std::vector<const FaultSpec*> faults;
  std::unique_ptr<SimCommunicator> comm;
};

class SimWorld::SimWork final : public Work {
 public:
  SimWork(SimWorld* world, int world_rank, std::shared_ptr<Op> op, int member)
      : world_(world),
        world_rank_(world_rank),
        op_(std::move(op)),
        member_(member) {}
  ~SimWork() override { world_->Abandon(*op_, member_); }

  absl::Status Wait() override {
    return world_->WaitFor(world_rank_, *op_, member_);
  }
  absl::Duration WaitOnDevice() {
    absl::Duration end;
    world_->WaitFor(world_rank_, *op_, member_, /*device_wait=*/true, &end)
        .IgnoreError();  // a stream wait cannot fail; Wait() reports it
    return end;
  }

 private:
  SimWorld* world_;
  int world_rank_;
  std::shared_ptr<Op> op_;
  int member_;
};

namespace {

std::string Detail(OpKind kind, const internal_sim::Call& c) {
  const std::string buffer =
      absl::StrFormat("%d x %s", c.count(), DTypeName(c.input.dtype));
  std::string reduce;
  if (IsReduction(kind)) {
    reduce = absl::StrCat(", ", ReduceOpName(c.reduce.op));
    if (c.reduce.pre_divide_factor != 1.0) {
      absl::StrAppendFormat(&reduce, ", pre-divide %g",
                            c.reduce.pre_divide_factor);
    }
    if (c.reduce.post_divide_factor != 1.0) {
      absl::StrAppendFormat(&reduce, ", post-divide %g",
                            c.reduce.post_divide_factor);
    }
  }
  switch (kind) {
    case OpKind::kAllGather:
      return absl::StrCat(buffer, " per rank");
    case OpKind::kReduceScatter:
      return absl::StrCat(buffer, " per rank", reduce);
    case OpKind::kAllReduce:
      return absl::StrCat(buffer, reduce);
    case OpKind::kBroadcast:
      return absl::StrCat(buffer, ", root ", c.root);
    case OpKind::kAllGatherBytes:
      return absl::StrCat(c.bytes.size(), " bytes");
    case OpKind::kBarrier:
      return "";
    case OpKind::kSplit:
      return absl::StrFormat("color %d, key %d", c.color, c.key);
  }
  return "";
}

// " (detail)", or "" for collectives without details (barrier).
std::string InParens(const std::string& detail) {
  return detail.empty() ? "" : absl::StrCat(" (", detail, ")");
}

bool SameCollective(OpKind ka, const internal_sim::Call& a, OpKind kb,
                    const internal_sim::Call& b) {
  if (ka != kb) return false;
  if (!HasBuffers(ka)) return true;
  if (a.count() != b.count() || a.input.dtype != b.input.dtype) return false;
  if (IsReduction(ka) &&
      (a.reduce.op != b.reduce.op ||
       a.reduce.pre_divide_factor != b.reduce.pre_divide_factor ||
       a.reduce.post_divide_factor != b.reduce.post_divide_factor)) {
    return false;
  }
  return ka != OpKind::kBroadcast || a.root == b.root;
}

// nccl-tests' "size" of an operation, and its bus-bandwidth factor.
int64_t SizeBytes(const internal_sim::Call& c, int n) {
  switch (c.kind) {
    case OpKind::kAllGather:
      return c.input.bytes() * n;
    case OpKind::kReduceScatter:
      return c.output.bytes() * n;
    case OpKind::kAllReduce:
    case OpKind::kBroadcast:
      return c.input.bytes();
    case OpKind::kAllGatherBytes:
      return static_cast<int64_t>(c.bytes.size());
    case OpKind::kBarrier:
    case OpKind::kSplit:
      return 0;
  }
  return 0;
}

double BusFactor(OpKind kind, int n) {
  if (n <= 1) return 0;
  switch (kind) {
    case OpKind::kAllGather:
    case OpKind::kReduceScatter:
    case OpKind::kAllGatherBytes:
      return static_cast<double>(n - 1) / n;
    case OpKind::kAllReduce:
      return 2.0 * (n - 1) / n;
    case OpKind::kBroadcast:
      return 1.0;
    case OpKind::kBarrier:
    case OpKind::kSplit:
      return 0;
  }
  return 0;
}

// `rank` names the caller in messages; `group_rank` places it in the group.
absl::Status ValidateCall(const internal_sim::Call& c, int rank, int group_rank,
                          int size, int64_t seq) {
  const absl::string_view name = KindName(c.kind);
  switch (c.kind) {
    case OpKind::kAllGather:
      FLATPARAM_RETURN_IF_ERROR(
          ValidateAllGather(rank, size, seq, c.input, c.output));
      break;
    case OpKind::kReduceScatter:
      FLATPARAM_RETURN_IF_ERROR(
          ValidateReduceScatter(rank, size, seq, c.input, c.output, c.reduce));
      break;
    case OpKind::kAllReduce:
      FLATPARAM_RETURN_IF_ERROR(
          ValidateAllReduce(rank, size, seq, c.input, c.output, c.reduce));
      break;
    case OpKind::kBroadcast: {
      BroadcastOptions options;
      options.root = c.root;
      FLATPARAM_RETURN_IF_ERROR(
          ValidateBroadcast(rank, size, seq, c.output, options));
      break;
    }
    case OpKind::kAllGatherBytes:
    case OpKind::kBarrier:
    case OpKind::kSplit:
      return absl::OkStatus();
  }
  if (c.input.device != Device::Host() || c.output.device != Device::Host()) {
    return absl::UnimplementedError(absl::StrFormat(
        "rank %d: %s #%d: the simulator takes host buffers only, got %s", rank,
        name, seq, DeviceName(c.output.device)));
  }
  // The validators check sizes; the simulator also rejects overlaps that
  // are not the documented in-place layout, which a real backend would
  // silently corrupt.
  const int64_t in_bytes = c.input.bytes();
  const int64_t out_bytes = c.output.bytes();
  const char* in = static_cast<const char*>(c.input.data);
  const char* out = static_cast<const char*>(c.output.data);
  if (c.kind == OpKind::kBroadcast ||
      !BytesOverlap(in, in_bytes, out, out_bytes)) {
    return absl::OkStatus();
  }
  bool in_place = false;
  absl::string_view layout;
  switch (c.kind) {
    case OpKind::kAllGather:
      in_place = in == out + group_rank * in_bytes;
      layout = "input == output + rank * count";
      break;
    case OpKind::kReduceScatter:
      in_place = out == in + group_rank * out_bytes;
      layout = "output == input + rank * count";
      break;
    default:
      in_place = in == out;
      layout = "input == output";
      break;
  }
  if (!in_place) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "rank %d: %s #%d: input and output overlap without being in place "
        "(in place needs %s)",
        rank, name, seq, layout));
  }
  return absl::OkStatus();
}

}  // namespace

// ---------------------------------------------------------------------------
// SimCommunicator.

SimCommunicator::~SimCommunicator() = default;

std::unique_ptr<Work> SimCommunicator::AllGather(
    ConstBufferRef input, BufferRef output, const CollectiveOptions& options) {
  internal_sim::Call call;
  call.kind = OpKind::kAllGather;
  call.input = input;
  call.output = output;
  call.timeout = options.timeout;
  return world_->Issue(*this, std::move(call));
}

std::unique_ptr<Work> SimCommunicator::ReduceScatter(
    ConstBufferRef input, BufferRef output, const ReduceOptions& options) {
  internal_sim::Call call;
  call.kind = OpKind::kReduceScatter;
  call.input = input;
  call.output = output;
  call.reduce = options;
  call.timeout = options.timeout;
  return world_->Issue(*this, std::move(call));
}

std::unique_ptr<Work> SimCommunicator::AllReduce(ConstBufferRef input,
                                                 BufferRef output,
                                                 const ReduceOptions& options) {
  internal_sim::Call call;
  call.kind = OpKind::kAllReduce;
  call.input = input;
  call.output = output;
  call.reduce = options;
  call.timeout = options.timeout;
  return world_->Issue(*this, std::move(call));
}

std::unique_ptr<Work> SimCommunicator::Broadcast(
    BufferRef buffer, const BroadcastOptions& options) {
  internal_sim::Call call;
  call.kind = OpKind::kBroadcast;
  call.input = buffer;
  call.output = buffer;
  call.root = options.root;
  call.timeout = options.timeout;
  return world_->Issue(*this, std::move(call));
}

absl::StatusOr<std::vector<std::string>> SimCommunicator::AllGatherBytes(
    absl::string_view bytes, const CollectiveOptions& options) {
  internal_sim::Call call;
  call.kind = OpKind::kAllGatherBytes;
  call.bytes = std::string(bytes);
  call.timeout = options.timeout;
  return world_->IssueGatherBytes(*this, std::move(call));
}

absl::Status SimCommunicator::Barrier(const CollectiveOptions& options) {
  internal_sim::Call call;
  call.kind = OpKind::kBarrier;
  call.timeout = options.timeout;
  return world_->Issue(*this, std::move(call))->Wait();
}

absl::StatusOr<std::unique_ptr<Communicator>> SimCommunicator::Split(
    int color, int key, const CollectiveOptions& options) {
  internal_sim::Call call;
  call.kind = OpKind::kSplit;
  call.color = color;
  call.key = key;
  call.timeout = options.timeout;
  return world_->IssueSplit(*this, std::move(call));
}

void SimCommunicator::Yield() { world_->Yield(world_rank_); }

absl::Status SimCommunicator::Compute(absl::Duration duration) {
  return world_->Compute(world_rank_, duration);
}

absl::Duration SimCommunicator::Now() const { return world_->Now(world_rank_); }

void SimCommunicator::ArriveNextAt(absl::Duration t) {
  world_->ArriveNextAt(world_rank_, t);
}

absl::Duration SimCommunicator::WaitOnDevice(Work& work) {
  if (auto* sim = dynamic_cast<SimWorld::SimWork*>(&work)) {
    return sim->WaitOnDevice();
  }
  work.Wait().IgnoreError();  // a stream wait cannot fail; Wait() reports it
  return Now();
}

// ---------------------------------------------------------------------------
// SimWorld: creation and running.

absl::StatusOr<std::unique_ptr<SimWorld>> SimWorld::Create(SimOptions options) {
  constexpr int kMaxWorld = 1 << 16;
  if (options.world_size < 1 || options.world_size > kMaxWorld) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "sim: world_size %d is not in [1, %d]", options.world_size, kMaxWorld));
  }
  const CostModel& cost = options.cost;
  if (!(cost.bytes_per_second > 0) || std::isinf(cost.bytes_per_second)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "sim: cost.bytes_per_second must be positive and finite, got %g",
        cost.bytes_per_second));
  }
  if (cost.latency < absl::ZeroDuration() ||
      cost.latency == absl::InfiniteDuration() ||
      cost.compute_per_op < absl::ZeroDuration() ||
      cost.compute_per_op == absl::InfiniteDuration()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "sim: cost.latency (%s) and cost.compute_per_op (%s) must be finite "
        "and non-negative",
        FormatTime(cost.latency), FormatTime(cost.compute_per_op)));
  }
  if (options.stack_bytes < (64 << 10)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "sim: stack_bytes %d is under 64 KiB", options.stack_bytes));
  }
  for (const FaultSpec& f : options.faults) {
    if (f.rank < 0 || f.rank >= options.world_size) {
      return absl::InvalidArgumentError(
          absl::StrFormat("sim: fault %s names rank %d outside the world of %d",
                          f.ToString(), f.rank, options.world_size));
    }
    const bool needs_op = f.kind != FaultSpec::Kind::kDelay;
    if ((needs_op && f.op < 0) || f.op < -1) {
      return absl::InvalidArgumentError(
          absl::StrFormat("sim: fault %s needs an op >= 0", f.ToString()));
    }
    if (f.delay < absl::ZeroDuration() || f.delay == absl::InfiniteDuration()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "sim: fault %s has a negative or infinite delay", f.ToString()));
    }
  }
  return std::unique_ptr<SimWorld>(new SimWorld(std::move(options)));
}

SimWorld::SimWorld(SimOptions options)
    : options_(std::move(options)), rng_(options_.seed) {
  const int n = options_.world_size;
  auto world = std::make_unique<Group>();
  world->id = 0;
  world->next_seq.assign(n, 0);
  for (int r = 0; r < n; ++r) {
    auto rank = std::make_unique<Rank>();
    rank->world = this;
    rank->id = r;
    rank->groups.push_back(0);
    rank->comm.reset(new SimCommunicator(this, r, 0, r, n));
    world->members.push_back(r);
    ranks_.push_back(std::move(rank));
  }
  for (const FaultSpec& f : options_.faults) {
    ranks_[f.rank]->faults.push_back(&f);
  }
  groups_.push_back(std::move(world));
}

// Run() joins every thread it started before it returns.
SimWorld::~SimWorld() = default;

void* SimWorld::ThreadEntry(void* arg) {
  Rank* rank = static_cast<Rank*>(arg);
  rank->world->ThreadMain(rank->id);
  return nullptr;
}

void SimWorld::ThreadMain(int world_rank) {
  Rank& r = *ranks_[world_rank];
  tls_rank = &r;
  {
    std::unique_lock<std::mutex> lock(mu_);
    r.cv.wait(lock, [&] { return running_ == r.id || start_failed_; });
    if (start_failed_) return;
  }
  absl::Status status;
  try {
    status = fn_(*r.comm);
  } catch (const std::exception& e) {
    status = absl::InternalError(absl::StrFormat(
        "rank %d: the rank function threw: %s", r.id, e.what()));
  } catch (...) {
    status = absl::InternalError(absl::StrFormat(
        "rank %d: the rank function threw a non-std exception", r.id));
  }
  std::unique_lock<std::mutex> lock(mu_);
  rank_statuses_[r.id] = std::move(status);
  MakeUnrunnable(r);
  r.state = Rank::State::kDone;
  ++finished_;
  PassBaton(lock, &r);
}

absl::Status SimWorld::Run(RankFn fn) {
  if (ran_) {
    return absl::FailedPreconditionError(
        "sim: Run() may be called once per SimWorld");
  }
  ran_ = true;
  fn_ = std::move(fn);
  const int n = options_.world_size;
  rank_statuses_.assign(n, absl::OkStatus());
  for (auto& rank : ranks_) MakeRunnable(*rank);

  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setstacksize(&attr, options_.stack_bytes);
  // The CPU this thread runs on is one the process may use.
  cpu_set_t one_cpu;
  CPU_ZERO(&one_cpu);
  const int cpu = options_.single_cpu ? sched_getcpu() : -1;
  if (cpu >= 0) CPU_SET(cpu, &one_cpu);
  absl::Status start_status;
  for (auto& rank : ranks_) {
    const int err = pthread_create(&rank->thread, &attr, &SimWorld::ThreadEntry,
                                   rank.get());
    if (err != 0) {
      start_status = absl::ResourceExhaustedError(absl::StrFormat(
          "sim: could not start the thread of rank %d of %d: %s", rank->id, n,
          std::strerror(err)));
      break;
    }
    rank->started = true;
    // Best effort: without it the ranks merely hand over more slowly.
    if (cpu >= 0) {
      pthread_setaffinity_np(rank->thread, sizeof(one_cpu), &one_cpu);
    }
  }
  pthread_attr_destroy(&attr);

  {
    std::unique_lock<std::mutex> lock(mu_);
    if (!start_status.ok()) {
      start_failed_ = true;
      for (auto& rank : ranks_) rank->cv.notify_one();
    } else {
      PassBaton(lock, nullptr);
      AwaitCompletion(lock);
    }
  }
  for (auto& rank : ranks_) {
    if (rank->started) pthread_join(rank->thread, nullptr);
    rank->started = false;
  }
  if (!start_status.ok()) return start_status;

  std::stable_sort(trace_.begin(), trace_.end(),
                   [](const TraceEvent& a, const TraceEvent& b) {
                     return std::tie(a.rank, a.op) < std::tie(b.rank, b.op);
                   });
  std::vector<int> failed;
  for (int r = 0; r < n; ++r) {
    if (!rank_statuses_[r].ok()) failed.push_back(r);
  }
  if (failed.empty()) return absl::OkStatus();
  const absl::Status& first = rank_statuses_[failed[0]];
  return absl::Status(
      first.code(),
      absl::StrFormat("sim: %d of %d ranks failed (ranks %s); rank %d: %s",
                      failed.size(), n, JoinCapped(failed, 16), failed[0],
                      first.message()));
}

std::vector<absl::Duration> SimWorld::clocks() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<absl::Duration> out;
  for (const auto& rank : ranks_) out.push_back(rank->clock);
  return out;
}

// ---------------------------------------------------------------------------
// The baton.

void SimWorld::MakeRunnable(Rank& rank) {
  if (rank.runnable_index >= 0) return;
  rank.runnable_index = static_cast<int>(runnable_.size());
  runnable_.push_back(rank.id);
}

void SimWorld::MakeUnrunnable(Rank& rank) {
  const int i = rank.runnable_index;
  if (i < 0) return;
  const int last = runnable_.back();
  runnable_[i] = last;
  ranks_[last]->runnable_index = i;
  runnable_.pop_back();
  rank.runnable_index = -1;
}

void SimWorld::PassBaton(std::unique_lock<std::mutex>& lock, Rank* self) {
  ++handoffs_;
  if (runnable_.empty() && blocked_ > 0) BreakDeadlock();
  if (runnable_.empty()) {
    assert(finished_ == options_.world_size);
    running_ = -1;
    main_cv_.notify_one();
    return;
  }
  // rng() % n rather than std::uniform_int_distribution, whose algorithm
  // differs between standard libraries: schedules must not.
  const int next = runnable_[rng_() % runnable_.size()];
  schedule_.push_back(next);
  running_ = next;
  if (self != nullptr && next == self->id) return;
  ranks_[next]->cv.notify_one();
  if (self == nullptr || self->state == Rank::State::kDone) return;
  self->cv.wait(lock, [&] { return running_ == self->id; });
}

void SimWorld::AwaitCompletion(std::unique_lock<std::mutex>& lock) {
  auto done = [&] {
    return running_ == -1 && finished_ == options_.world_size;
  };
  if (options_.stall_timeout == absl::InfiniteDuration()) {
    main_cv_.wait(lock, done);
    return;
  }
  const auto limit = absl::ToChronoNanoseconds(options_.stall_timeout);
  int64_t seen = handoffs_;
  auto since = std::chrono::steady_clock::now();
  while (!done()) {
    const auto now = std::chrono::steady_clock::now();
    if (handoffs_ != seen) {
      seen = handoffs_;
      since = now;
    } else if (now - since >= limit) {
      std::fprintf(stderr,
                   "flatparam sim: rank %d has held the baton for %s without "
                   "reaching a scheduling point; it is probably blocked "
                   "outside the simulator (only one rank runs at a time, so "
                   "a rank cannot wait for another rank except through "
                   "collectives). Ranks:%s\n",
                   running_, FormatTime(options_.stall_timeout).c_str(),
                   DescribeRanks().c_str());
      std::abort();
    }
    main_cv_.wait_for(lock, std::min<std::chrono::nanoseconds>(
                                limit, std::chrono::seconds(1)));
  }
}

std::string SimWorld::DescribeRanks() const {
  std::vector<std::pair<int, std::string>> items;
  for (const auto& rank : ranks_) {
    std::string s;
    if (rank->id == running_ && rank->state == Rank::State::kReady) {
      s = "running (holds the baton)";
    } else {
      switch (rank->state) {
        case Rank::State::kReady:
          s = "runnable";
          break;
        case Rank::State::kBlocked: {
          const Op& op = *rank->wait_op;
          const OpMember& m = op.members[rank->wait_member];
          std::vector<int> missing;
          for (const OpMember& other : op.members) {
            if (!other.present) missing.push_back(other.world_rank);
          }
          s = absl::StrFormat(
              "waiting on %s #%d in group %d%s; %d of %d members arrived, "
              "missing rank%s %s",
              KindName(m.call.kind), op.seq, op.group->id,
              InParens(Detail(m.call.kind, m.call)), op.arrived,
              op.members.size(), missing.size() == 1 ? "" : "s",
              JoinCapped(missing, 8));
          break;
        }
        case Rank::State::kDone:
          s = absl::StrFormat("returned after %d collectives", rank->ops);
          break;
      }
    }
    if (rank->dead) absl::StrAppend(&s, " (dead: ", rank->death, ")");
    items.emplace_back(rank->id, std::move(s));
  }
  return ListByRank(items);
}

void SimWorld::BreakDeadlock() {
  const std::string text = absl::StrCat(
      "deadlock: no rank can make progress (ranks issued different "
      "collectives, or one returned or died while others wait); per rank:",
      DescribeRanks());
  std::vector<std::shared_ptr<Op>> stuck;
  for (auto& group : groups_) {
    if (group->pending.empty()) continue;
    for (auto& [seq, op] : group->pending) stuck.push_back(op);
    group->aborted = true;
    group->abort_reason = absl::StrFormat(
        "a deadlock was detected at its operation #%d (see that error)",
        group->pending.begin()->first);
  }
  for (auto& op : stuck) FailOp(*op, absl::StatusCode::kInternal, text);
  ExecuteUnblocked();
  assert(!runnable_.empty());
}

// ---------------------------------------------------------------------------
// Issuing and waiting.

absl::Status SimWorld::EarlyFailure(Rank& r, Group& g, OpKind kind, int64_t seq,
                                    int64_t rank_op) {
  auto where = [&] {
    return absl::StrFormat("rank %d: %s #%d in group %d", r.id, KindName(kind),
                           seq, g.id);
  };
  if (r.dead) {
    return absl::AbortedError(
        absl::StrCat(where(), ": this rank is dead (", r.death, ")"));
  }
  if (g.aborted) {
    return absl::AbortedError(absl::StrCat(where(), ": group ", g.id,
                                           " was aborted: ", g.abort_reason));
  }
  for (const FaultSpec* f : r.faults) {
    if (f->kind != FaultSpec::Kind::kKill || f->op != rank_op) continue;
    r.dead = true;
    r.death = absl::StrFormat("killed by fault %s at its %s #%d in group %d",
                              f->ToString(), KindName(kind), seq, g.id);
    const std::string reason =
        absl::StrFormat("rank %d died (%s)", r.id, r.death);
    for (int gid : r.groups) AbortGroup(*groups_[gid], reason);
    return absl::AbortedError(
        absl::StrCat(where(), ": this rank was ", r.death));
  }
  return absl::OkStatus();
}

SimWorld::Issued SimWorld::IssueOp(SimCommunicator& comm, Call call) {
  std::unique_lock<std::mutex> lock(mu_);
  Rank& r = *ranks_[comm.world_rank_];
  Group& g = *groups_[comm.group_id_];
  const int me = comm.group_rank_;
  const int n = static_cast<int>(g.members.size());
  if (tls_rank != &r) {
    // Touch nothing: the calling thread does not hold the baton.
    return {nullptr, -1,
            absl::FailedPreconditionError(absl::StrFormat(
                "sim: the communicator of rank %d was used from another "
                "thread",
                r.id))};
  }
  const int64_t seq = g.next_seq[me]++;
  const int64_t rank_op = r.ops++;
  r.clock += options_.cost.compute_per_op;
  for (const FaultSpec* f : r.faults) {
    if (f->kind == FaultSpec::Kind::kDelay && (f->op < 0 || f->op == rank_op)) {
      r.clock += f->delay;
    }
  }

  OpMember m;
  m.present = true;
  m.world_rank = r.id;
  m.rank_op = rank_op;
  m.bytes = SizeBytes(call, n);
  m.arrive = m.start = m.end = r.clock;
  if (r.next_arrival.has_value()) {
    m.arrive = m.start = m.end = std::max(r.clock, *r.next_arrival);
    r.next_arrival.reset();
  }
  m.call = std::move(call);
  // Calls that fail without joining an operation.
  const absl::Status early = EarlyFailure(r, g, m.call.kind, seq, rank_op);
  if (!early.ok()) {
    m.status = early;
    m.done = true;
    Record(m, g, me, seq);
    ExecuteUnblocked();
    PassBaton(lock, &r);
    return {nullptr, -1, early};
  }

  std::shared_ptr<Op>& slot = g.pending[seq];
  if (slot == nullptr) {
    slot = std::make_shared<Op>();
    slot->group = &g;
    slot->seq = seq;
    slot->members.resize(n);
    for (int i = 0; i < n; ++i) slot->members[i].world_rank = g.members[i];
  }
  std::shared_ptr<Op> op = slot;
  OpMember& mine = op->members[me];
  mine = std::move(m);

  absl::Status invalid = ValidateCall(mine.call, r.id, me, n, seq);
  if (!invalid.ok()) {
    if (g.id != 0) {
      invalid =
          absl::Status(invalid.code(),
                       absl::StrFormat("%s (in group %d, where it is rank %d)",
                                       invalid.message(), g.id, me));
    }
    mine.invalid = true;
    Complete(*op, me, invalid, mine.arrive, mine.arrive);
  } else {
    for (const FaultSpec* f : r.faults) {
      if (f->kind == FaultSpec::Kind::kFlip && f->op == rank_op) mine.flip = f;
    }
    if (options_.checksum) mine.sent_hashes = Checksums(mine.call, n, me);
  }
  if (options_.one_stream_per_rank) r.in_order.push_back(op);
  if (++op->arrived == n) {
    if (!options_.one_stream_per_rank || AtFront(*op)) {
      Execute(*op);
    } else {
      blocked_ops_.push_back(op);
    }
  }
  ExecuteUnblocked();
  PassBaton(lock, &r);
  return {op, me, absl::OkStatus()};
}

std::unique_ptr<Work> SimWorld::Issue(SimCommunicator& comm, Call call) {
  Issued issued = IssueOp(comm, std::move(call));
  if (issued.op == nullptr) return CompletedWork(issued.early);
  return std::make_unique<SimWork>(this, comm.world_rank_, std::move(issued.op),
                                   issued.member);
}

absl::StatusOr<std::vector<std::string>> SimWorld::IssueGatherBytes(
    SimCommunicator& comm, Call call) {
  Issued issued = IssueOp(comm, std::move(call));
  if (issued.op == nullptr) return issued.early;
  FLATPARAM_RETURN_IF_ERROR(
      WaitFor(comm.world_rank_, *issued.op, issued.member));
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::string> out = issued.op->gathered;
  if (issued.op->flipped_sender == issued.member) {
    out[issued.member] = issued.op->flipped_original;
  }
  return out;
}

absl::StatusOr<std::unique_ptr<Communicator>> SimWorld::IssueSplit(
    SimCommunicator& comm, Call call) {
  Issued issued = IssueOp(comm, std::move(call));
  if (issued.op == nullptr) return issued.early;
  FLATPARAM_RETURN_IF_ERROR(
      WaitFor(comm.world_rank_, *issued.op, issued.member));
  std::lock_guard<std::mutex> lock(mu_);
  const OpMember& m = issued.op->members[issued.member];
  if (m.new_group < 0) return nullptr;
  return std::unique_ptr<Communicator>(new SimCommunicator(
      this, comm.world_rank_, m.new_group, m.new_rank,
      static_cast<int>(groups_[m.new_group]->members.size())));
}

absl::Status SimWorld::WaitFor(int world_rank, Op& op, int member,
                               bool device_wait, absl::Duration* end) {
  std::unique_lock<std::mutex> lock(mu_);
  Rank& r = *ranks_[world_rank];
  if (tls_rank != &r) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "sim: a Work of rank %d was waited on from another thread", r.id));
  }
  OpMember& m = op.members[member];
  if (!m.done) {
    r.state = Rank::State::kBlocked;
    r.wait_op = &op;
    r.wait_member = member;
    ++blocked_;
    MakeUnrunnable(r);
    PassBaton(lock, &r);
    assert(m.done);
  }
  if (end != nullptr) *end = m.end;
  if (!device_wait && !m.waited) {
    m.waited = true;
    r.clock = std::max(r.clock, m.end);
  }
  return m.status;
}

void SimWorld::Abandon(Op& op, int member) {
  std::lock_guard<std::mutex> lock(mu_);
  OpMember& m = op.members[member];
  if (!m.done) m.abandoned = true;
}

void SimWorld::Yield(int world_rank) {
  std::unique_lock<std::mutex> lock(mu_);
  Rank& r = *ranks_[world_rank];
  if (tls_rank != &r) return;
  PassBaton(lock, &r);
}

absl::Status SimWorld::Compute(int world_rank, absl::Duration duration) {
  if (duration < absl::ZeroDuration() || duration == absl::InfiniteDuration()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "rank %d: Compute(%s): the duration must be finite and non-negative",
        world_rank, FormatTime(duration)));
  }
  std::lock_guard<std::mutex> lock(mu_);
  ranks_[world_rank]->clock += duration;
  return absl::OkStatus();
}

absl::Duration SimWorld::Now(int world_rank) const {
  std::lock_guard<std::mutex> lock(mu_);
  return ranks_[world_rank]->clock;
}

void SimWorld::ArriveNextAt(int world_rank, absl::Duration t) {
  std::lock_guard<std::mutex> lock(mu_);
  ranks_[world_rank]->next_arrival = t;
}

// ---------------------------------------------------------------------------
// Executing operations.

std::vector<uint64_t> SimWorld::Checksums(const Call& c, int n, int me) const {
  // Reduce-scatter sends a different chunk to each rank: one hash per
  // destination, so that the receiver of a corrupted chunk can be named.
  if (c.kind == OpKind::kReduceScatter) {
    std::vector<uint64_t> out;
    const int64_t chunk = c.output.bytes();
    for (int j = 0; j < n; ++j) {
      out.push_back(XXH3_64bits(
          static_cast<const char*>(c.input.data) + j * chunk, chunk));
    }
    return out;
  }
  if (c.kind == OpKind::kAllGatherBytes) {
    return {XXH3_64bits(c.bytes.data(), c.bytes.size())};
  }
  if (c.kind == OpKind::kBroadcast && c.root != me) return {};
  if (!HasBuffers(c.kind)) return {};
  return {XXH3_64bits(c.input.data, c.input.bytes())};
}

// A member's view of the operation in messages: "rank 3: all_reduce #5 in
// group 0".
std::string SimWorld::Where(const Op& op, int member) const {
  const OpMember& m = op.members[member];
  return absl::StrFormat("rank %d: %s #%d in group %d", m.world_rank,
                         KindName(m.call.kind), op.seq, op.group->id);
}

bool SimWorld::RejectMismatch(Op& op) {
  Group& g = *op.group;
  std::vector<OpMember>& ms = op.members;
  // 1. Every member must have issued the same collective.
  bool same = true;
  for (const OpMember& m : ms) {
    same = same &&
           SameCollective(ms[0].call.kind, ms[0].call, m.call.kind, m.call);
  }
  if (!same) {
    std::vector<std::pair<int, std::string>> items;
    for (const OpMember& m : ms) {
      std::string s = absl::StrFormat("%s #%d%s", KindName(m.call.kind), op.seq,
                                      InParens(Detail(m.call.kind, m.call)));
      if (m.invalid) {
        absl::StrAppend(&s, " [invalid: ", m.status.message(), "]");
      }
      items.emplace_back(m.world_rank, std::move(s));
    }
    FailOp(op, absl::StatusCode::kInternal,
           absl::StrFormat("desynchronised: the members of group %d issued "
                           "different collectives as its operation #%d; per "
                           "rank:%s",
                           g.id, op.seq, ListByRank(items)));
    AbortGroup(g, absl::StrFormat("its members desynchronised at operation #%d",
                                  op.seq));
    return true;
  }
  // 2. A member's invalid arguments fail the whole operation.
  for (const OpMember& m : ms) {
    if (!m.invalid) continue;
    const absl::Status cause = m.status;
    FailOp(op, cause.code(),
           absl::StrFormat("rank %d passed invalid arguments: %s", m.world_rank,
                           cause.message()));
    return true;
  }
  // 3. A member that dropped its Work may have freed its buffers.
  for (const OpMember& m : ms) {
    if (!m.abandoned) continue;
    FailOp(op, absl::StatusCode::kFailedPrecondition,
           absl::StrFormat(
               "rank %d destroyed its Work before the operation finished, so "
               "its buffers may be gone; nothing was moved",
               m.world_rank));
    return true;
  }
  return false;
}

std::optional<absl::Duration> SimWorld::StartOrTimeOut(Op& op) {
  std::vector<OpMember>& ms = op.members;
  const int n = static_cast<int>(ms.size());
  // The operation starts when its last member is ready: arrived, and done
  // with its previous operation on its stream.
  absl::Duration start = absl::ZeroDuration();
  int last = 0;
  for (int i = 0; i < n; ++i) {
    const absl::Duration ready =
        std::max(ms[i].arrive, ranks_[ms[i].world_rank]->stream_free);
    if (i == 0 || ready > start) {
      start = ready;
      last = i;
    }
  }
  int timed_out = -1;
  int count = 0;
  for (int i = 0; i < n; ++i) {
    if (start - ms[i].arrive <= ms[i].call.timeout) continue;
    if (timed_out < 0) timed_out = i;
    ++count;
  }
  if (timed_out < 0) return start;

  const OpMember& first = ms[timed_out];
  const std::string text = absl::StrFormat(
      "timed out on the virtual clock: rank %d arrived at %s with a timeout "
      "of %s, but the operation could start only at %s, when rank %d was "
      "ready (%d member(s) timed out); group %d is aborted",
      first.world_rank, FormatTime(first.arrive),
      FormatTime(first.call.timeout), FormatTime(start), ms[last].world_rank,
      count, op.group->id);
  for (int i = 0; i < n; ++i) {
    // A member that timed out stops waiting at its deadline.
    const absl::Duration end =
        std::min(start, ms[i].arrive + ms[i].call.timeout);
    ranks_[ms[i].world_rank]->stream_free = end;
    Complete(
        op, i,
        absl::DeadlineExceededError(absl::StrCat(Where(op, i), ": ", text)),
        ms[i].arrive, end);
  }
  Finish(op);
  AbortGroup(*op.group, absl::StrFormat("operation #%d timed out", op.seq));
  return std::nullopt;
}

// What each member sends, and the one corrupted copy a flip fault makes.
struct SimWorld::Delivery {
  OpKind kind = OpKind::kBarrier;
  int root = -1;                 // broadcast only
  std::vector<const char*> src;  // each member's payload as sent
  std::vector<int64_t> payload;  // its size in bytes
  std::vector<char> flipped;     // the corrupted copy, if any
  int flip_member = -1;          // the member named by the flip fault

  // What `receiver` gets from `sender`. A sender never corrupts its own copy.
  const char* Source(int sender, int receiver) const {
    if (flip_member < 0 || receiver == sender) return src[sender];
    if (kind == OpKind::kBroadcast) {
      // The root's flip reaches every receiver, a receiver's only itself.
      return receiver == flip_member || flip_member == root ? flipped.data()
                                                            : src[sender];
    }
    return sender == flip_member ? flipped.data() : src[sender];
  }
  // What `sender` contributes to a reduction.
  const char* Contribution(int sender) const {
    return sender == flip_member ? flipped.data() : src[sender];
  }
};

std::optional<SimWorld::Delivery> SimWorld::PrepareDelivery(Op& op) {
  std::vector<OpMember>& ms = op.members;
  const int n = static_cast<int>(ms.size());
  Delivery d;
  d.kind = ms[0].call.kind;
  d.root = d.kind == OpKind::kBroadcast ? ms[0].call.root : -1;
  d.src.assign(n, nullptr);
  d.payload.assign(n, 0);
  for (int i = 0; i < n; ++i) {
    const Call& c = ms[i].call;
    if (d.kind == OpKind::kAllGatherBytes) {
      d.src[i] = c.bytes.data();
      d.payload[i] = static_cast<int64_t>(c.bytes.size());
    } else if (HasBuffers(d.kind)) {
      d.src[i] = static_cast<const char*>(c.input.data);
      d.payload[i] = c.input.bytes();
    }
  }
  for (int i = 0; i < n; ++i) {
    const FaultSpec* f = ms[i].flip;
    if (f == nullptr) continue;
    // A non-root broadcast member sends nothing: corrupt what it receives.
    const int sender = d.kind == OpKind::kBroadcast ? d.root : i;
    const int64_t bits = d.payload[sender] * 8;
    int64_t bit = f->bit;
    if (bit < 0 && bits > 0) {
      // Drawn from the seed without touching the scheduler's PRNG.
      bit = static_cast<int64_t>(
          SplitMix64(options_.seed ^ SplitMix64(f->rank) ^ SplitMix64(~f->op)) %
          static_cast<uint64_t>(bits));
    }
    if (bit < 0 || bit >= bits) {
      FailOp(op, absl::StatusCode::kFailedPrecondition,
             absl::StrFormat(
                 "fault %s cannot apply: rank %d's payload in this operation "
                 "(%s #%d) has %d bits; a flip needs an op whose payload is "
                 "not empty (not a barrier, a split, or a collective of count "
                 "0, such as the conformance suite's first cases) and a bit "
                 "below its size: --trace shows what each op number is",
                 f->ToString(), ms[sender].world_rank, KindName(d.kind), op.seq,
                 bits));
      return std::nullopt;
    }
    d.flipped.assign(d.src[sender], d.src[sender] + d.payload[sender]);
    d.flipped[bit / 8] ^= static_cast<char>(1 << (bit % 8));
    d.flip_member = i;
    break;
  }
  return d;
}

std::string SimWorld::VerifyChecksums(const Op& op, const Delivery& d) const {
  const std::vector<OpMember>& ms = op.members;
  const int n = static_cast<int>(ms.size());
  std::string corruption;
  for (int i = 0; i < n; ++i) {
    if (ms[i].sent_hashes.empty()) continue;
    std::vector<int> receivers;
    uint64_t sent = 0, got = 0;
    auto check = [&](uint64_t want, const char* data, int64_t bytes,
                     int receiver) {
      const uint64_t h = XXH3_64bits(data, bytes);
      if (h == want) return;
      if (receivers.empty()) {
        sent = want;
        got = h;
      }
      receivers.push_back(ms[receiver].world_rank);
    };
    if (d.kind == OpKind::kReduceScatter) {
      // Chunk j of the sender's input goes to rank j.
      const int64_t chunk = ms[i].call.output.bytes();
      for (int j = 0; j < n; ++j) {
        check(ms[i].sent_hashes[j], d.Contribution(i) + j * chunk, chunk, j);
      }
    } else {
      for (int j = 0; j < n; ++j) {
        if (j != i)
          check(ms[i].sent_hashes[0], d.Source(i, j), d.payload[i], j);
      }
    }
    if (receivers.empty()) continue;
    absl::StrAppendFormat(
        &corruption,
        "%sdata sent by rank %d (its op %d) failed its checksum at rank%s %s "
        "(xxh3 %016x when sent, %016x when delivered)",
        corruption.empty() ? "" : "; ", ms[i].world_rank, ms[i].rank_op,
        receivers.size() == 1 ? "" : "s", JoinCapped(receivers, 8), sent, got);
  }
  return corruption;
}

void SimWorld::MoveData(Op& op, const Delivery& d) {
  std::vector<OpMember>& ms = op.members;
  const int n = static_cast<int>(ms.size());
  const Call& c0 = ms[0].call;
  const int64_t chunk =
      c0.kind == OpKind::kReduceScatter ? c0.output.bytes() : c0.input.bytes();
  auto move = [chunk](void* dst, const char* src) {
    if (dst != src && chunk > 0) std::memmove(dst, src, chunk);
  };
  switch (d.kind) {
    case OpKind::kAllGather:
      for (int i = 0; i < n; ++i) {
        for (int j = 0; j < n; ++j) {
          move(static_cast<char*>(ms[j].call.output.data) + i * chunk,
               d.Source(i, j));
        }
      }
      break;
    case OpKind::kReduceScatter:
      // Each chunk is reduced into scratch before it is stored, so in-place
      // outputs never overwrite an input that is still to be read.
      scratch_.resize(chunk);
      for (int j = 0; j < n; ++j) {
        for (int i = 0; i < n; ++i) {
          HostReduceStep(scratch_.data(), d.Contribution(i) + j * chunk,
                         c0.output.count, c0.input.dtype, c0.reduce, i == 0);
        }
        HostReduceFinish(scratch_.data(), c0.output.count, c0.input.dtype,
                         c0.reduce, n);
        move(ms[j].call.output.data, scratch_.data());
      }
      break;
    case OpKind::kAllReduce:
      scratch_.resize(chunk);
      for (int i = 0; i < n; ++i) {
        HostReduceStep(scratch_.data(), d.Contribution(i), c0.input.count,
                       c0.input.dtype, c0.reduce, i == 0);
      }
      HostReduceFinish(scratch_.data(), c0.input.count, c0.input.dtype,
                       c0.reduce, n);
      for (int j = 0; j < n; ++j) move(ms[j].call.output.data, scratch_.data());
      break;
    case OpKind::kBroadcast:
      for (int j = 0; j < n; ++j) {
        move(ms[j].call.output.data, d.Source(d.root, j));
      }
      break;
    case OpKind::kAllGatherBytes: {
      int64_t total = 0;
      op.gathered.clear();
      for (int i = 0; i < n; ++i) {
        total += d.payload[i];
        op.gathered.emplace_back(d.Contribution(i), d.payload[i]);
      }
      // The sender of a flipped payload keeps its own original.
      if (d.flip_member >= 0) {
        op.flipped_sender = d.flip_member;
        op.flipped_original = ms[d.flip_member].call.bytes;
      }
      for (OpMember& m : ms) m.bytes = total;
      break;
    }
    case OpKind::kBarrier:
      break;
    case OpKind::kSplit:
      MakeSubgroups(op);
      break;
  }
}

void SimWorld::MakeSubgroups(Op& op) {
  std::vector<OpMember>& ms = op.members;
  std::map<int, std::vector<int>> by_color;  // color -> members
  for (int i = 0; i < static_cast<int>(ms.size()); ++i) {
    if (ms[i].call.color >= 0) by_color[ms[i].call.color].push_back(i);
  }
  for (auto& [color, members] : by_color) {
    // Members are in old-rank order, so a stable sort orders by (key, rank).
    std::stable_sort(members.begin(), members.end(), [&](int a, int b) {
      return ms[a].call.key < ms[b].call.key;
    });
    auto sub = std::make_unique<Group>();
    sub->id = static_cast<int>(groups_.size());
    sub->next_seq.assign(members.size(), 0);
    for (size_t k = 0; k < members.size(); ++k) {
      OpMember& m = ms[members[k]];
      sub->members.push_back(m.world_rank);
      m.new_group = sub->id;
      m.new_rank = static_cast<int>(k);
      ranks_[m.world_rank]->groups.push_back(sub->id);
    }
    groups_.push_back(std::move(sub));
  }
}

void SimWorld::Execute(Op& op) {
  if (RejectMismatch(op)) return;
  const std::optional<absl::Duration> start = StartOrTimeOut(op);
  if (!start.has_value()) return;
  const std::optional<Delivery> delivery = PrepareDelivery(op);
  if (!delivery.has_value()) return;
  const std::string corruption =
      options_.checksum ? VerifyChecksums(op, *delivery) : "";
  MoveData(op, *delivery);

  std::vector<OpMember>& ms = op.members;
  const int n = static_cast<int>(ms.size());
  absl::Duration duration;
  if (options_.cost.collective_time) {
    duration = options_.cost.collective_time(delivery->kind, ms[0].bytes,
                                             op.group->members);
  } else {
    duration =
        options_.cost.latency + absl::Seconds(static_cast<double>(ms[0].bytes) *
                                              BusFactor(delivery->kind, n) /
                                              options_.cost.bytes_per_second);
  }
  const absl::Duration end = *start + duration;
  for (int i = 0; i < n; ++i) {
    ranks_[ms[i].world_rank]->stream_free = end;
    Complete(op, i,
             corruption.empty() ? absl::OkStatus()
                                : absl::DataLossError(absl::StrCat(
                                      Where(op, i), ": ", corruption)),
             *start, end);
  }
  Finish(op);
}

void SimWorld::Complete(Op& op, int member, absl::Status status,
                        absl::Duration start, absl::Duration end) {
  OpMember& m = op.members[member];
  assert(m.present && !m.done);
  m.done = true;
  m.status = std::move(status);
  m.start = start;
  m.end = end;
  Record(m, *op.group, member, op.seq);
  Rank& r = *ranks_[m.world_rank];
  if (r.state == Rank::State::kBlocked && r.wait_op == &op &&
      r.wait_member == member) {
    r.state = Rank::State::kReady;
    r.wait_op = nullptr;
    r.wait_member = -1;
    --blocked_;
    MakeRunnable(r);
  }
}

void SimWorld::Finish(Op& op) {
  op.group->pending.erase(op.seq);
  op.finished = true;
  if (!options_.one_stream_per_rank) return;
  for (const OpMember& m : op.members) {
    std::deque<std::shared_ptr<Op>>& q = ranks_[m.world_rank]->in_order;
    while (!q.empty() && q.front()->finished) q.pop_front();
  }
}

bool SimWorld::AtFront(Op& op) {
  for (const OpMember& m : op.members) {
    std::deque<std::shared_ptr<Op>>& q = ranks_[m.world_rank]->in_order;
    while (!q.empty() && q.front()->finished) q.pop_front();
    if (q.empty() || q.front().get() != &op) return false;
  }
  return true;
}

void SimWorld::ExecuteUnblocked() {
  bool progress = true;
  while (progress) {
    progress = false;
    for (size_t i = 0; i < blocked_ops_.size(); ++i) {
      std::shared_ptr<Op> op = blocked_ops_[i];
      if (!op->finished && !AtFront(*op)) continue;
      blocked_ops_.erase(blocked_ops_.begin() + static_cast<ptrdiff_t>(i));
      if (!op->finished) Execute(*op);
      progress = true;
      break;
    }
  }
}

void SimWorld::FailOp(Op& op, absl::StatusCode code, absl::string_view text) {
  for (int i = 0; i < static_cast<int>(op.members.size()); ++i) {
    OpMember& m = op.members[i];
    if (!m.present || m.done) continue;
    Complete(op, i, absl::Status(code, absl::StrCat(Where(op, i), ": ", text)),
             m.arrive, m.arrive);
  }
  Finish(op);
}

void SimWorld::AbortGroup(Group& group, absl::string_view reason) {
  if (group.aborted) return;
  group.aborted = true;
  group.abort_reason = std::string(reason);
  std::vector<std::shared_ptr<Op>> pending;
  for (auto& [seq, op] : group.pending) pending.push_back(op);
  for (auto& op : pending) {
    FailOp(*op, absl::StatusCode::kAborted, absl::StrCat("aborted: ", reason));
  }
}

void SimWorld::Record(const OpMember& m, const Group& group, int group_rank,
                      int64_t seq) {
  TraceEvent e;
  e.rank = m.world_rank;
  e.name = std::string(KindName(m.call.kind));
  e.detail = Detail(m.call.kind, m.call);
  e.group = group.id;
  e.group_rank = group_rank;
  e.seq = seq;
  e.op = m.rank_op;
  e.bytes = m.bytes;
  e.arrive = m.arrive;
  e.start = std::min(m.start, m.end);
  e.end = m.end;
  e.status = m.status;
  trace_.push_back(std::move(e));
}

// ---------------------------------------------------------------------------
// Chrome trace.

ChromeTrace SimWorld::BuildChromeTrace() const {
  ChromeTrace trace;
  trace.ProcessName(0, absl::StrFormat("flatparam sim: %d ranks, seed %d",
                                       options_.world_size, options_.seed));
  for (int r = 0; r < options_.world_size; ++r) {
    trace.ThreadName(0, r, absl::StrCat("rank ", r), /*sort_index=*/r);
  }
  for (const TraceEvent& e : trace_) {
    nlohmann::json args = {
        {"bytes", e.bytes},
        {"detail", e.detail},
        {"group", e.group},
        {"group_rank", e.group_rank},
        {"seq", e.seq},
        {"op", e.op},
        {"wait_us", absl::ToDoubleMicroseconds(e.start - e.arrive)}};
    if (!e.status.ok()) args["error"] = e.status.ToString();
    trace.Complete(
        0, e.rank, e.name, "collective", absl::ToDoubleMicroseconds(e.start),
        absl::ToDoubleMicroseconds(e.end - e.start), std::move(args));
  }
  return trace;
}

nlohmann::json SimWorld::TraceOtherData() const {
  nlohmann::json faults = nlohmann::json::array();
  for (const FaultSpec& f : options_.faults) faults.push_back(f.ToString());
  return {{"backend", "sim"},
          {"world_size", options_.world_size},
          {"seed", options_.seed},
          {"checksum", options_.checksum},
          {"faults", std::move(faults)}};
}

std::string SimWorld::ChromeTraceJson() const {
  return BuildChromeTrace().Json(TraceOtherData());
}

absl::Status SimWorld::WriteChromeTrace(const std::string& path) const {
  return BuildChromeTrace().Write(path, TraceOtherData());
}

}  // namespace flatparam
