// Executing an operation whose members have all arrived: its start on the
// virtual clock or its timeout, the data it moves, the groups a split
// makes; completing and failing operations, aborting groups.
#include <algorithm>
#include <cassert>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "comm/communicator.h"
#include "comm/host_reduce.h"
#include "sim/internal/sim_internal.h"
#include "sim/sim.h"

namespace flatparam {

using internal_sim::FormatTime;
using internal_sim::HasBuffers;
using internal_sim::KindName;
using internal_sim::OpKind;

namespace {

// nccl-tests' bus-bandwidth factor of an operation (its "size" is
// SizeBytes, sim_issue.cc).

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

}  // namespace

// A member's view of the operation in messages: "rank 3: all_reduce #5 in
// group 0".
std::string SimWorld::Where(const Op& op, int member) const {
  const OpMember& m = op.members[member];
  return absl::StrFormat("rank %d: %s #%d in group %d", m.world_rank,
                         KindName(m.call.kind), op.seq, op.group->id);
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

void SimWorld::MoveData(Op& op, const Delivery& d) {
  std::vector<OpMember>& ms = op.members;
  const int n = static_cast<int>(ms.size());
  const Call& c0 = ms[0].call;
  const int64_t chunk =
      c0.kind == OpKind::kReduceScatter ? c0.output.bytes() : c0.input.bytes();
  auto move = [chunk](void* dst, const char* src) {
    if (dst != src && chunk > 0) std::memmove(dst, src, chunk);
  };
  if (options_.metadata_only && HasBuffers(d.kind)) return;
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
    auto flight = std::make_shared<FlightGroup>();
    flight->id = SplitGroupId(op.group->flight->id, op.seq, color);
    flight->ranks = sub->members;
    sub->flight = std::move(flight);
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
  if (!m.status.ok() && first_failure_.ok()) first_failure_ = m.status;
  m.start = start;
  m.end = end;
  Record(m, *op.group, member, op.seq);
  Rank& r = *ranks_[m.world_rank];
  // A success is recorded now; a failure when the rank sees it (WaitFor),
  // where dumping the ring holds up no other rank.
  if (r.recorder != nullptr && m.status.ok()) {
    r.recorder->Started(m.flight_id);
    r.recorder->Finished(m.flight_id, m.status);
  }
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
  for (const OpMember& m : op.members) AdvanceFront(*ranks_[m.world_rank]);
}

void SimWorld::AdvanceFront(Rank& r) {
  std::deque<std::shared_ptr<Op>>& q = r.in_order;
  while (!q.empty() && q.front()->finished) q.pop_front();
  if (q.empty() || q.front()->uid == r.front_counted) return;
  Op& front = *q.front();
  r.front_counted = front.uid;
  // Counted once per member, so an operation of n members costs O(n)
  // however its members' earlier operations finish.
  if (++front.at_front == static_cast<int>(front.members.size()) &&
      front.blocked) {
    unblock_candidates_.push_back(q.front());
  }
}

bool SimWorld::AtFront(const Op& op) const {
  return op.at_front == static_cast<int>(op.members.size());
}

void SimWorld::ExecuteUnblocked() {
  // Each runs once it is at the front of all its members' queues; which
  // runs first does not matter (its times depend only on its members'
  // earlier operations).
  while (!unblock_candidates_.empty()) {
    std::shared_ptr<Op> op = std::move(unblock_candidates_.front());
    unblock_candidates_.pop_front();
    if (!op->blocked || op->finished) continue;
    op->blocked = false;
    Execute(*op);
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

}  // namespace flatparam
