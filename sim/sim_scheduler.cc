// The baton: exactly one rank runs at a time, and the next to run is drawn
// by the seeded PRNG from the runnable ranks (see "Scheduling" in sim.h);
// deadlock detection when none can run; the stall check.
#include <algorithm>
#include <cassert>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/time.h"
#include "sim/internal/sim_internal.h"
#include "sim/sim.h"

namespace flatparam {

using internal_sim::Detail;
using internal_sim::FormatTime;
using internal_sim::InParens;
using internal_sim::JoinCapped;
using internal_sim::KindName;
using internal_sim::ListByRank;

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
    // The last rank to return hands the runner thread its own stack back.
    if (fibers() && self != nullptr) SwitchFiber(self, nullptr);
    return;
  }
  // rng() % n rather than std::uniform_int_distribution, whose algorithm
  // differs between standard libraries: schedules must not.
  const int next = runnable_[rng_() % runnable_.size()];
  schedule_.push_back(next);
  running_ = next;
  if (self != nullptr && next == self->id) return;
  if (fibers()) {
    // Returns when some rank hands the baton back to `self` (never, for a
    // rank that returned).
    SwitchFiber(self, ranks_[next].get());
    return;
  }
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

}  // namespace flatparam
