// The check of MpiOptions::check_collectives (see "Desynchronisation" in
// DESIGN.md): the header every rank all-gathers before a checked
// collective, and the comparison that names each rank's call when the
// ranks disagree.
#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "comm/communicator.h"
#include "comm/mpi/internal/mpi_internal.h"
#include "flatparam/base/dtype.h"
#include "xxhash.h"

namespace flatparam {
namespace internal_mpi {
namespace {

bool SameCall(const Header& a, const Header& b) {
  return a.seq == b.seq && a.count == b.count && a.pre_divide == b.pre_divide &&
         a.post_divide == b.post_divide && a.op == b.op && a.dtype == b.dtype &&
         a.reduce_op == b.reduce_op && a.root == b.root &&
         a.context == b.context;
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
  if (h.context != 0) absl::StrAppendFormat(&s, " context %08x", h.context);
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
  std::string mine;
  if (!info.context.empty()) {
    mine = absl::StrFormat("; this rank issued it from %s (context %08x)",
                           info.context, headers[info.rank].context);
  }
  return absl::InternalError(
      absl::StrFormat("%s: the group is desynchronised (%s)%s; no data was "
                      "exchanged",
                      info.Describe(), absl::StrJoin(groups, "; "), mine));
}

}  // namespace

uint32_t ContextHash(const CollectiveContext& context) {
  if (context.unit.empty() && context.phase == CollectivePhase::kNone) {
    return 0;
  }
  const std::string key =
      absl::StrCat(context.unit, "\n", CollectivePhaseName(context.phase));
  const uint32_t h = XXH32(key.data(), key.size(), 0);
  return h == 0 ? 1 : h;
}

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

}  // namespace internal_mpi
}  // namespace flatparam
