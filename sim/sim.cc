#include "sim/sim.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"
#include "absl/time/time.h"
#include "sim/fault.h"
#include "sim/internal/sim_internal.h"

// SimWorld's creation and Run(): the ranks' threads. The scheduler, the
// collectives' issue and execution and the trace are in the files that
// sim/internal/sim_internal.h lists.

namespace flatparam {

using internal_sim::FormatTime;
using internal_sim::JoinCapped;
using internal_sim::tls_rank;

namespace internal_sim {

thread_local const void* tls_rank = nullptr;

}  // namespace internal_sim

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
  if (options.check_context && options.flight_recorder.capacity <= 0) {
    return absl::InvalidArgumentError(
        "sim: check_context reads the flight recorder's context, but the "
        "recorder is off (flight_recorder.capacity 0)");
  }
  if (options.metadata_only) {
    for (const FaultSpec& f : options.faults) {
      if (f.kind == FaultSpec::Kind::kFlip) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "sim: fault %s flips a payload bit, but metadata_only moves no "
            "payload",
            f.ToString()));
      }
    }
    if (options.checksum) {
      return absl::InvalidArgumentError(
          "sim: checksum hashes payloads, but metadata_only moves none");
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
    if (options_.flight_recorder.capacity > 0) {
      rank->recorder =
          FlightRecorder::Create(r, n, "sim", options_.flight_recorder);
    }
    world->members.push_back(r);
    ranks_.push_back(std::move(rank));
  }
  for (const FaultSpec& f : options_.faults) {
    ranks_[f.rank]->faults.push_back(&f);
  }
  auto flight = std::make_shared<FlightGroup>();
  flight->id = "world";
  flight->ranks = world->members;
  world->flight = std::move(flight);
  groups_.push_back(std::move(world));
}

FlightRecorder* SimWorld::flight_recorder(int world_rank) const {
  return ranks_[world_rank]->recorder.get();
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
  RunRankFunction(r);
}

void SimWorld::FiberEntry(void* arg) {
  Rank* rank = static_cast<Rank*>(arg);
  rank->world->FiberMain(*rank);
}

void SimWorld::FiberMain(Rank& r) {
  // Whoever switched here holds mu_ (every switch happens in PassBaton).
  std::unique_lock<std::mutex> held(mu_, std::adopt_lock);
  held.unlock();
  RunRankFunction(r);
  // Not reached: the finished fiber switched away for good.
}

void* SimWorld::RunnerEntry(void* arg) {
  SimWorld* world = static_cast<SimWorld*>(arg);
  world->runner_fiber_ = internal_sim::FiberContext::ForCurrentThread();
  std::unique_lock<std::mutex> lock(world->mu_);
  // Returns once every rank has returned (the last switches back here).
  world->PassBaton(lock, nullptr);
  return nullptr;
}

void SimWorld::SwitchFiber(Rank* from, Rank* to) {
  internal_sim::FiberContext& from_context =
      from != nullptr ? *from->fiber : *runner_fiber_;
  internal_sim::FiberContext& to_context =
      to != nullptr ? *to->fiber : *runner_fiber_;
  tls_rank = to;
  from_context.SwitchTo(to_context,
                        from != nullptr && from->state == Rank::State::kDone);
}

void SimWorld::RunRankFunction(Rank& r) {
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
  if (fibers()) {
    for (auto& rank : ranks_) {
      absl::StatusOr<std::unique_ptr<internal_sim::FiberContext>> fiber =
          internal_sim::FiberContext::Create(options_.stack_bytes,
                                             &SimWorld::FiberEntry, rank.get());
      if (!fiber.ok()) {
        return absl::Status(
            fiber.status().code(),
            absl::StrFormat("%s (rank %d of %d)", fiber.status().message(),
                            rank->id, n));
      }
      rank->fiber = *std::move(fiber);
    }
    pthread_t runner;
    const int err =
        pthread_create(&runner, nullptr, &SimWorld::RunnerEntry, this);
    if (err != 0) {
      return absl::ResourceExhaustedError(absl::StrFormat(
          "sim: could not start the thread that runs the ranks' fibers: %s",
          std::strerror(err)));
    }
    {
      std::unique_lock<std::mutex> lock(mu_);
      AwaitCompletion(lock);
    }
    pthread_join(runner, nullptr);
    for (auto& rank : ranks_) rank->fiber.reset();
    runner_fiber_.reset();
    return Finished();
  }

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
  return Finished();
}

absl::Status SimWorld::Finished() {
  const int n = options_.world_size;
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

}  // namespace flatparam
