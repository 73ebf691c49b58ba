// Issuing a collective call (its validation, kill and delay faults, joining
// its operation) and waiting on it; the rank-thread entry points besides
// the collectives.
#include <algorithm>
#include <cassert>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "comm/communicator.h"
#include "flatparam/base/buffer_checks.h"
#include "flatparam/base/status_macros.h"
#include "sim/fault.h"
#include "sim/internal/sim_internal.h"
#include "sim/sim.h"

namespace flatparam {

using internal_sim::FormatTime;
using internal_sim::KindName;
using internal_sim::OpKind;
using internal_sim::tls_rank;

namespace {

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
  if (r.recorder != nullptr) {
    const Call& c = m.call;
    const bool bytes_only = c.kind == OpKind::kAllGatherBytes;
    const int64_t count = bytes_only ? static_cast<int64_t>(c.bytes.size())
                          : internal_sim::HasBuffers(c.kind) ? c.count()
                                                             : 0;
    const int64_t bytes = bytes_only                         ? count
                          : internal_sim::HasBuffers(c.kind) ? c.input.bytes()
                                                             : 0;
    m.flight_id =
        r.recorder->Enqueue(g.flight, seq, c.kind, c.input.dtype, count, bytes);
    if (options_.check_context) m.context = r.recorder->context();
  }
  // Calls that fail without joining an operation.
  const absl::Status early = EarlyFailure(r, g, m.call.kind, seq, rank_op);
  if (!early.ok()) {
    m.status = early;
    m.done = true;
    if (r.recorder != nullptr) r.recorder->Finished(m.flight_id, early);
    Record(m, g, me, seq);
    ExecuteUnblocked();
    PassBaton(lock, &r);
    return {nullptr, -1, early};
  }

  std::shared_ptr<Op>& slot = g.pending[seq];
  if (slot == nullptr) {
    slot = std::make_shared<Op>();
    slot->uid = ++next_op_uid_;
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
  if (options_.one_stream_per_rank) {
    r.in_order.push_back(op);
    AdvanceFront(r);
  }
  if (++op->arrived == n) {
    if (!options_.one_stream_per_rank || AtFront(*op)) {
      Execute(*op);
    } else {
      op->blocked = true;
    }
  }
  ExecuteUnblocked();
  if (options_.yield_on_issue) PassBaton(lock, &r);
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
  absl::Status status = m.status;
  FlightRecorder* recorder = r.recorder.get();
  const uint64_t flight_id = m.flight_id;
  lock.unlock();
  // A failure is recorded (and may dump) outside the world's lock.
  if (recorder != nullptr && !status.ok()) {
    recorder->Finished(flight_id, status);
  }
  return status;
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

}  // namespace flatparam
