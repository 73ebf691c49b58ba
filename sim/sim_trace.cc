// The trace: one TraceEvent per collective call and rank, and its Chrome
// trace-event JSON (see "Trace" in sim.h).
#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/time.h"
#include "nlohmann/json.hpp"
#include "sim/chrome_trace.h"
#include "sim/fault.h"
#include "sim/internal/sim_internal.h"
#include "sim/sim.h"

namespace flatparam {

using internal_sim::Detail;
using internal_sim::KindName;

void SimWorld::Record(const OpMember& m, const Group& group, int group_rank,
                      int64_t seq) {
  if (!options_.keep_trace) return;
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
