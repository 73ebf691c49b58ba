// Rejecting an operation whose members disagree: different collectives at
// one sequence number (desynchronisation), a member's invalid arguments, a
// member that dropped its Work (see "Errors" in sim.h).
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "comm/communicator.h"
#include "sim/internal/sim_internal.h"
#include "sim/sim.h"

namespace flatparam {

using internal_sim::Detail;
using internal_sim::HasBuffers;
using internal_sim::InParens;
using internal_sim::IsReduction;
using internal_sim::KindName;
using internal_sim::ListByRank;
using internal_sim::OpKind;

namespace {

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

// Contexts conflict when both name a unit or phase and they differ.
bool SameContext(const CollectiveContext& a, const CollectiveContext& b) {
  const bool a_set = a.handle >= 0 || a.phase != CollectivePhase::kNone;
  const bool b_set = b.handle >= 0 || b.phase != CollectivePhase::kNone;
  if (!a_set || !b_set) return true;
  return a.handle == b.handle && a.unit == b.unit && a.phase == b.phase;
}

}  // namespace

bool SimWorld::RejectMismatch(Op& op) {
  Group& g = *op.group;
  std::vector<OpMember>& ms = op.members;
  // 1. Every member must have issued the same collective.
  bool same = true;
  for (const OpMember& m : ms) {
    same = same &&
           SameCollective(ms[0].call.kind, ms[0].call, m.call.kind, m.call);
  }
  bool same_context = true;
  if (options_.check_context) {
    for (const OpMember& m : ms) {
      same_context = same_context && SameContext(ms[0].context, m.context);
    }
  }
  if (!same || !same_context) {
    std::vector<std::pair<int, std::string>> items;
    for (const OpMember& m : ms) {
      std::string s = absl::StrFormat("%s #%d%s", KindName(m.call.kind), op.seq,
                                      InParens(Detail(m.call.kind, m.call)));
      if (options_.check_context) {
        const std::string context = DescribeContext(m.context);
        if (!context.empty()) absl::StrAppend(&s, " from ", context);
      }
      if (m.invalid) {
        absl::StrAppend(&s, " [invalid: ", m.status.message(), "]");
      }
      items.emplace_back(m.world_rank, std::move(s));
    }
    FailOp(op, absl::StatusCode::kInternal,
           absl::StrFormat("desynchronised: the members of group %d issued "
                           "different collectives%s as its operation #%d; per "
                           "rank:%s",
                           g.id,
                           same ? " (equal sizes, different FSDP units "
                                  "or phases)"
                                : "",
                           op.seq, ListByRank(items)));
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

}  // namespace flatparam
