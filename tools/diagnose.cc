#include "tools/diagnose.h"

#include <dirent.h>

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <limits>
#include <map>
#include <optional>
#include <ostream>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "flatparam/base/json_limits.h"
#include "flatparam/base/status_macros.h"
#include "nlohmann/json.hpp"

namespace flatparam {
namespace tools {
namespace {

using nlohmann::json;

// Dumps are at most a few MB (2000 entries by default); this bounds what a
// stray file in the directory can make us read.
constexpr int64_t kMaxDumpBytes = int64_t{1} << 30;

template <typename T>
absl::Status Field(const json& j, const char* key, T* out,
                   const std::string& where) {
  auto it = j.find(key);
  if (it == j.end()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: missing \"%s\"", where, key));
  }
  try {
    *out = it->get<T>();
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: \"%s\": %s", where, key, e.what()));
  }
  return absl::OkStatus();
}

// "ranks 0, 2 and 3" / "rank 1".
std::string Ranks(const std::vector<int>& ranks) {
  if (ranks.size() == 1) return absl::StrCat("rank ", ranks[0]);
  if (ranks.empty()) return "no rank";
  std::vector<int> head(ranks.begin(), ranks.end() - 1);
  if (head.size() > 16) {
    return absl::StrFormat("%d ranks (%s, ... %d)", ranks.size(),
                           absl::StrJoin(head.begin(), head.begin() + 8, ", "),
                           ranks.back());
  }
  return absl::StrCat("ranks ", absl::StrJoin(head, ", "), " and ",
                      ranks.back());
}

std::string Context(const FlightDumpEntry& e) {
  if (e.unit.empty() && e.phase.empty()) return "";
  if (e.unit.empty()) return e.phase;
  if (e.phase.empty()) return absl::StrCat("unit ", e.unit);
  return absl::StrCat("unit ", e.unit, ", ", e.phase);
}

// "all_gather #26 of 276 float32 (unit layers.1, forward unshard)".
std::string Describe(const FlightDumpEntry& e, bool with_context = true) {
  std::string s = absl::StrFormat("%s #%d", e.op, e.seq);
  if (!e.dtype.empty()) {
    absl::StrAppendFormat(&s, " of %d %s", e.count, e.dtype);
  } else if (e.op == "all_gather_bytes") {
    absl::StrAppendFormat(&s, " of %d bytes", e.count);
  }
  const std::string context = Context(e);
  if (with_context && !context.empty()) absl::StrAppend(&s, " (", context, ")");
  return s;
}

std::string Shorten(const std::string& text, size_t max = 240) {
  if (text.size() <= max) return text;
  return absl::StrCat(text.substr(0, max), "...");
}

bool Completed(const FlightDumpEntry& e) { return e.state == "completed"; }

// What must agree across a group for one collective: all but the length of
// all_gather_bytes, which is each rank's own.
std::string Signature(const FlightDumpEntry& e) {
  if (e.op == "all_gather_bytes") return e.op;
  return absl::StrFormat("%s|%s|%d", e.op, e.dtype, e.count);
}

std::string ContextKey(const FlightDumpEntry& e) {
  return absl::StrCat(e.unit, "|", e.phase);
}

struct RankInGroup {
  int rank = 0;
  std::map<int64_t, const FlightDumpEntry*> by_seq;
  // The oldest seq the ring still holds (earlier ones were dropped).
  int64_t first = 0;
  int64_t last = -1;
};

// The ranks listed at the start of `text`: "rank 2", "ranks 2 and 3",
// "ranks 0, 2 and 3"; sets `*end` past the list.
std::vector<int> ListedRanks(absl::string_view text, size_t* end) {
  std::vector<int> out;
  absl::string_view rest = text;
  if (!absl::ConsumePrefix(&rest, "ranks ") &&
      !absl::ConsumePrefix(&rest, "rank ")) {
    return out;
  }
  while (true) {
    size_t digits = 0;
    while (digits < rest.size() && rest[digits] >= '0' && rest[digits] <= '9') {
      ++digits;
    }
    int r = 0;
    if (digits == 0 || !absl::SimpleAtoi(rest.substr(0, digits), &r)) break;
    out.push_back(r);
    rest.remove_prefix(digits);
    if (!absl::ConsumePrefix(&rest, ", ") &&
        !absl::ConsumePrefix(&rest, " and ")) {
      break;
    }
  }
  *end = text.size() - rest.size();
  return out;
}

// The ranks a backend's error names as missing: after "no data arrived
// from" and "every peer's data arrived, but" (MPI), before "did not reach"
// (c10d).
// The ranks a backend's error blames: senders whose data never came ("no
// data arrived from ..."; only with `senders`), receivers that never took
// this rank's ("every peer's data arrived, but rank R has not taken ..."),
// ranks that did not reach it.
std::vector<int> NamedRanks(absl::string_view text, bool senders = true) {
  std::vector<int> out;
  for (absl::string_view lead :
       {"no data arrived from ", "every peer's data arrived, but "}) {
    if (!senders && lead == "no data arrived from ") continue;
    for (size_t at = text.find(lead); at != absl::string_view::npos;
         at = text.find(lead, at + 1)) {
      size_t end = 0;
      for (int r : ListedRanks(text.substr(at + lead.size()), &end)) {
        out.push_back(r);
      }
    }
  }
  constexpr absl::string_view kReach = " did not reach";
  for (size_t at = text.find(kReach); at != absl::string_view::npos;
       at = text.find(kReach, at + 1)) {
    const size_t from = text.rfind("rank", at);
    if (from == absl::string_view::npos) continue;
    size_t end = 0;
    std::vector<int> listed = ListedRanks(text.substr(from), &end);
    if (from + end == at) out.insert(out.end(), listed.begin(), listed.end());
  }
  return out;
}

}  // namespace

absl::StatusOr<FlightDump> ParseFlightDump(const std::string& text,
                                           const std::string& path) {
  FLATPARAM_ASSIGN_OR_RETURN(const json j, ParseJson(text, path));
  if (!j.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: not a JSON object", path));
  }
  std::string format;
  int version = 0;
  FLATPARAM_RETURN_IF_ERROR(Field(j, "format", &format, path));
  FLATPARAM_RETURN_IF_ERROR(Field(j, "version", &version, path));
  if (format != "flatparam.flight" || version != 1) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: format \"%s\" version %d; expected a flatparam.flight version 1 "
        "dump",
        path, format, version));
  }
  FlightDump d;
  d.path = path;
  FLATPARAM_RETURN_IF_ERROR(Field(j, "rank", &d.rank, path));
  FLATPARAM_RETURN_IF_ERROR(Field(j, "world_size", &d.world_size, path));
  FLATPARAM_RETURN_IF_ERROR(Field(j, "backend", &d.backend, path));
  FLATPARAM_RETURN_IF_ERROR(Field(j, "host", &d.host, path));
  FLATPARAM_RETURN_IF_ERROR(Field(j, "pid", &d.pid, path));
  FLATPARAM_RETURN_IF_ERROR(Field(j, "reason", &d.reason, path));
  FLATPARAM_RETURN_IF_ERROR(Field(j, "first_failure", &d.first_failure, path));
  FLATPARAM_RETURN_IF_ERROR(Field(j, "dumped_at_ns", &d.dumped_at_ns, path));
  FLATPARAM_RETURN_IF_ERROR(Field(j, "recorded", &d.recorded, path));
  FLATPARAM_RETURN_IF_ERROR(Field(j, "capacity", &d.capacity, path));
  if (d.world_size < 1 || d.rank < 0 || d.rank >= d.world_size) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: rank %d of a world of %d", path, d.rank, d.world_size));
  }
  json groups;
  json entries;
  FLATPARAM_RETURN_IF_ERROR(Field(j, "groups", &groups, path));
  FLATPARAM_RETURN_IF_ERROR(Field(j, "entries", &entries, path));
  if (!groups.is_array() || !entries.is_array()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: \"groups\" and \"entries\" must be arrays", path));
  }
  for (size_t i = 0; i < groups.size(); ++i) {
    const std::string where = absl::StrFormat("%s: groups[%d]", path, i);
    std::string id;
    std::vector<int> ranks;
    FLATPARAM_RETURN_IF_ERROR(Field(groups[i], "id", &id, where));
    FLATPARAM_RETURN_IF_ERROR(Field(groups[i], "ranks", &ranks, where));
    for (int r : ranks) {
      if (r < 0 || r >= d.world_size) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "%s: rank %d outside the world of %d", where, r, d.world_size));
      }
    }
    d.groups[id] = std::move(ranks);
  }
  for (size_t i = 0; i < entries.size(); ++i) {
    const std::string where = absl::StrFormat("%s: entries[%d]", path, i);
    const json& x = entries[i];
    FlightDumpEntry e;
    FLATPARAM_RETURN_IF_ERROR(Field(x, "group", &e.group, where));
    FLATPARAM_RETURN_IF_ERROR(Field(x, "seq", &e.seq, where));
    FLATPARAM_RETURN_IF_ERROR(Field(x, "op", &e.op, where));
    FLATPARAM_RETURN_IF_ERROR(Field(x, "dtype", &e.dtype, where));
    FLATPARAM_RETURN_IF_ERROR(Field(x, "count", &e.count, where));
    FLATPARAM_RETURN_IF_ERROR(Field(x, "bytes", &e.bytes, where));
    FLATPARAM_RETURN_IF_ERROR(Field(x, "unit", &e.unit, where));
    FLATPARAM_RETURN_IF_ERROR(Field(x, "handle", &e.handle, where));
    FLATPARAM_RETURN_IF_ERROR(Field(x, "phase", &e.phase, where));
    FLATPARAM_RETURN_IF_ERROR(Field(x, "state", &e.state, where));
    FLATPARAM_RETURN_IF_ERROR(Field(x, "enqueued_ns", &e.enqueued_ns, where));
    FLATPARAM_RETURN_IF_ERROR(Field(x, "started_ns", &e.started_ns, where));
    FLATPARAM_RETURN_IF_ERROR(Field(x, "finished_ns", &e.finished_ns, where));
    FLATPARAM_RETURN_IF_ERROR(Field(x, "error", &e.error, where));
    static const std::set<std::string> kStates = {"enqueued", "started",
                                                  "completed", "failed"};
    if (kStates.count(e.state) == 0 || e.seq < 0) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s: state \"%s\", seq %d", where, e.state, e.seq));
    }
    d.entries.push_back(std::move(e));
  }
  return d;
}

absl::StatusOr<std::vector<FlightDump>> ReadFlightDumps(
    const std::string& dir, std::vector<std::string>* ignored) {
  DIR* handle = opendir(dir.c_str());
  if (handle == nullptr) {
    return absl::NotFoundError(
        absl::StrFormat("%s: cannot open the directory", dir));
  }
  std::vector<std::string> names;
  while (const dirent* e = readdir(handle)) {
    const std::string name = e->d_name;
    if (absl::StartsWith(name, "rank_") && absl::EndsWith(name, ".json")) {
      names.push_back(name);
    }
  }
  closedir(handle);
  std::sort(names.begin(), names.end());
  std::map<int, FlightDump> newest;
  for (const std::string& name : names) {
    const std::string path = absl::StrCat(dir, "/", name);
    std::ifstream in(path, std::ios::binary);
    std::ostringstream text;
    if (!in || !(text << in.rdbuf())) {
      return absl::UnavailableError(
          absl::StrFormat("%s: cannot read it", path));
    }
    if (static_cast<int64_t>(text.str().size()) > kMaxDumpBytes) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: %d bytes, more than a dump holds", path, text.str().size()));
    }
    FLATPARAM_ASSIGN_OR_RETURN(FlightDump d, ParseFlightDump(text.str(), path));
    auto it = newest.find(d.rank);
    if (it == newest.end()) {
      newest.emplace(d.rank, std::move(d));
    } else if (d.dumped_at_ns > it->second.dumped_at_ns) {
      if (ignored != nullptr) ignored->push_back(it->second.path);
      it->second = std::move(d);
    } else if (ignored != nullptr) {
      ignored->push_back(path);
    }
  }
  if (newest.empty()) {
    return absl::NotFoundError(absl::StrFormat(
        "%s: no flight-recorder dumps (rank_<R>.json) in it", dir));
  }
  std::vector<FlightDump> out;
  for (auto& [rank, d] : newest) out.push_back(std::move(d));
  return out;
}

int Diagnosis::ExitCode() const {
  return (stuck ? kDiagnoseStuck : 0) | (desync ? kDiagnoseDesync : 0) |
         (missing ? kDiagnoseMissing : 0);
}

Diagnosis Diagnose(const std::vector<FlightDump>& dumps) {
  Diagnosis d;
  d.dumps = static_cast<int>(dumps.size());
  std::map<int, const FlightDump*> by_rank;
  std::map<std::string, std::vector<int>> groups;
  for (const FlightDump& dump : dumps) {
    d.world_size = std::max(d.world_size, dump.world_size);
    if (d.backend.empty()) d.backend = dump.backend;
    by_rank[dump.rank] = &dump;
    for (const auto& [id, ranks] : dump.groups) {
      if (!ranks.empty()) groups[id] = ranks;
    }
  }
  for (int r = 0; r < d.world_size; ++r) {
    if (by_rank.count(r) == 0) d.missing_ranks.push_back(r);
  }
  d.missing = !d.missing_ranks.empty();

  // Each dumping rank's entries by group and sequence number.
  std::map<std::string, std::map<int, RankInGroup>> per_group;
  for (const FlightDump& dump : dumps) {
    for (const FlightDumpEntry& e : dump.entries) {
      RankInGroup& g = per_group[e.group][dump.rank];
      g.rank = dump.rank;
      g.by_seq[e.seq] = &e;
    }
  }
  for (auto& [id, ranks] : per_group) {
    for (auto& [rank, g] : ranks) {
      g.first = g.by_seq.begin()->first;
      g.last = g.by_seq.rbegin()->first;
    }
  }
  // The members of each group that wrote a dump (those with no entry in it
  // too: they never reached its first collective).
  auto members = [&](const std::string& id) {
    std::vector<int> out;
    auto it = groups.find(id);
    if (it != groups.end()) {
      for (int r : it->second) {
        if (by_rank.count(r) != 0) out.push_back(r);
      }
    } else {
      for (const auto& [rank, g] : per_group[id]) out.push_back(rank);
    }
    return out;
  };
  auto missing_members = [&](const std::string& id) {
    std::vector<int> out;
    auto it = groups.find(id);
    const std::vector<int>& all =
        it != groups.end() ? it->second : d.missing_ranks;
    for (int r : all) {
      if (by_rank.count(r) == 0) out.push_back(r);
    }
    return out;
  };

  // 1. The first collective the ranks disagree on, per group: its
  // operation and sizes, or the unit and phase that issued it.
  struct Split {
    std::string group;
    int64_t seq = 0;
    bool sizes = false;
    int64_t when = std::numeric_limits<int64_t>::max();
    std::vector<std::pair<std::vector<int>, const FlightDumpEntry*>> sides;
  };
  std::optional<Split> first_split;
  for (const auto& [id, ranks] : per_group) {
    const std::vector<int> present = members(id);
    if (present.size() < 2) continue;
    int64_t lo = 0;
    int64_t hi = std::numeric_limits<int64_t>::max();
    for (int r : present) {
      auto it = ranks.find(r);
      if (it == ranks.end()) {
        hi = -1;
        break;
      }
      lo = std::max(lo, it->second.first);
      hi = std::min(hi, it->second.last);
    }
    for (int64_t seq = lo; seq <= hi; ++seq) {
      std::map<std::string, std::vector<int>> by_sig;
      std::map<std::string, std::vector<int>> by_ctx;
      std::map<int, const FlightDumpEntry*> entry;
      for (int r : present) {
        auto e = ranks.at(r).by_seq.find(seq);
        if (e == ranks.at(r).by_seq.end()) continue;
        entry[r] = e->second;
        by_sig[Signature(*e->second)].push_back(r);
        by_ctx[ContextKey(*e->second)].push_back(r);
      }
      const bool sizes = by_sig.size() > 1;
      if (!sizes && by_ctx.size() <= 1) continue;
      Split s;
      s.group = id;
      s.seq = seq;
      s.sizes = sizes;
      for (const auto& [r, e] : entry)
        s.when = std::min(s.when, e->enqueued_ns);
      for (const auto& [key, rs] : sizes ? by_sig : by_ctx) {
        s.sides.push_back({rs, entry[rs.front()]});
      }
      // The smaller side first: usually the ranks that went astray.
      std::sort(
          s.sides.begin(), s.sides.end(), [](const auto& a, const auto& b) {
            return a.first.size() < b.first.size() ||
                   (a.first.size() == b.first.size() && a.first < b.first);
          });
      if (!first_split.has_value() || s.when < first_split->when) {
        first_split = std::move(s);
      }
      break;
    }
  }
  if (first_split.has_value()) {
    d.desync = true;
    std::vector<std::string> sides;
    for (const auto& [rs, e] : first_split->sides) {
      sides.push_back(absl::StrCat(Ranks(rs), " issued ", Describe(*e)));
    }
    d.verdict.push_back(absl::StrFormat(
        "desync: in group %s at #%d the ranks disagree on the %s: %s",
        first_split->group, first_split->seq,
        first_split->sizes ? "collective" : "FSDP unit or phase that issued it",
        absl::StrJoin(sides, "; ")));
  }

  // 2. Where each rank stands relative to the oldest collective some rank
  // never finished (the hang's origin; the later ones follow from it).
  // Within a group, the lowest unfinished sequence number; across groups
  // (whose numbers do not compare), the earliest enqueued of those.
  const FlightDumpEntry* origin_entry = nullptr;
  std::string origin;
  for (const auto& [id, ranks] : per_group) {
    const FlightDumpEntry* lowest = nullptr;
    for (const auto& [rank, g] : ranks) {
      for (const auto& [seq, e] : g.by_seq) {
        if (!Completed(*e)) {
          if (lowest == nullptr || seq < lowest->seq) lowest = e;
          break;
        }
      }
    }
    if (lowest != nullptr &&
        (origin_entry == nullptr ||
         lowest->enqueued_ns < origin_entry->enqueued_ns)) {
      origin_entry = lowest;
      origin = id;
    }
  }
  if (origin_entry != nullptr) {
    d.stuck = true;
    const int64_t s = origin_entry->seq;
    const std::map<int, RankInGroup>& ranks = per_group[origin];
    const std::vector<int> present = members(origin);
    const std::string where =
        absl::StrCat(Describe(*origin_entry), " of group ", origin);
    // At the origin: still in it (failed there or not), past it (waiting
    // in a later one, or idle), or never there.
    std::vector<int> in_it, failed_in_it, unaware_in_it, past_it, behind;
    std::vector<std::string> behind_where;
    const FlightDumpEntry* later = nullptr;
    for (int r : present) {
      auto it = ranks.find(r);
      const FlightDumpEntry* at = nullptr;
      const FlightDumpEntry* last = nullptr;
      if (it != ranks.end()) {
        auto e = it->second.by_seq.find(s);
        if (e != it->second.by_seq.end()) at = e->second;
        last = it->second.by_seq.rbegin()->second;
      }
      if (at != nullptr && !Completed(*at)) {
        in_it.push_back(r);
        (at->state == "failed" ? failed_in_it : unaware_in_it).push_back(r);
      } else if (at != nullptr || (it != ranks.end() && it->second.first > s)) {
        past_it.push_back(r);
        for (const auto& [seq, e] : it->second.by_seq) {
          if (seq > s && !Completed(*e)) {
            if (later == nullptr || seq < later->seq) later = e;
            break;
          }
        }
      } else {
        behind.push_back(r);
        behind_where.push_back(
            last == nullptr ? absl::StrFormat("rank %d issued nothing in it", r)
                            : absl::StrFormat("rank %d's last is %s, %s", r,
                                              Describe(*last), last->state));
      }
    }
    const std::vector<int> no_dump = missing_members(origin);
    const bool explained = first_split.has_value() &&
                           first_split->group == origin &&
                           first_split->seq == s;
    if (!behind.empty()) {
      d.verdict.push_back(absl::StrFormat(
          "behind: %s never issued %s, where %s wait%s (%s)", Ranks(behind),
          where, Ranks(in_it), in_it.size() == 1 ? "s" : "",
          absl::StrJoin(behind_where, "; ")));
    }
    if (!no_dump.empty()) {
      d.verdict.push_back(absl::StrFormat(
          "no dump: %s wrote none (killed, stopped, or its host is gone)%s",
          Ranks(no_dump),
          in_it.empty()
              ? ""
              : absl::StrFormat(": %s wait%s for %s from %s", Ranks(in_it),
                                in_it.size() == 1 ? "s" : "",
                                no_dump.size() == 1 ? "it" : "them", where)));
    }
    // Ranks still in it that never saw it fail, while others timed out in
    // it, were stopped or stalled inside it (a stopped process resumed by
    // the launcher only to be ended dumps too).
    const bool stalled = behind.empty() && no_dump.empty() && !explained &&
                         !failed_in_it.empty() && !unaware_in_it.empty();
    if (stalled) {
      d.verdict.push_back(absl::StrFormat(
          "stalled: %s never saw %s fail, which %s timed out in: %s "
          "stopped or stalled inside it",
          Ranks(unaware_in_it), where, Ranks(failed_in_it),
          unaware_in_it.size() == 1 ? "it was" : "they were"));
    }
    if (behind.empty() && no_dump.empty() && !explained && !stalled) {
      std::string line = absl::StrFormat(
          "stuck: %s never finished %s (the oldest collective not finished)",
          Ranks(in_it), where);
      if (!past_it.empty()) {
        absl::StrAppendFormat(
            &line, "; %s finished it%s", Ranks(past_it),
            later != nullptr
                ? absl::StrCat(
                      past_it.size() == 1 ? " and waits in " : " and wait in ",
                      Describe(*later))
                : std::string());
      } else {
        absl::StrAppend(&line,
                        ": no rank is behind, so the transport between them "
                        "failed (a cut link, a lost peer) or the ranks "
                        "issued it from different groups");
      }
      d.verdict.push_back(line);
    }
    // The backends' errors name the ranks whose data never came: the rank
    // that the ranks still in the oldest unfinished collective name (or,
    // if they name none, the others) is the suspect. Ranks past it wait
    // for the ones still in it, so their errors name those instead.
    // Where some members finished it, every member's data was sent, so a
    // sender their errors blame is no evidence; a receiver that never took
    // a rank's data still is. Without such a receiver, one side of the
    // split is the odd one out: a single cut link or stalled process leaves
    // its rank alone on one side (it alone finished, or alone did not).
    const bool split = !past_it.empty() && !in_it.empty();
    const std::set<int> in_origin(in_it.begin(), in_it.end());
    std::map<int, std::set<int>> named_by;
    for (int pass = 0; pass < (split ? 1 : 2) && named_by.empty(); ++pass) {
      for (const FlightDump& dump : dumps) {
        if (pass == 0 && in_origin.count(dump.rank) == 0) continue;
        for (int r : NamedRanks(dump.first_failure, /*senders=*/!split)) {
          if (r != dump.rank) named_by[r].insert(dump.rank);
        }
      }
    }
    if (split && named_by.empty() && !explained && behind.empty() &&
        no_dump.empty() && in_it.size() != past_it.size()) {
      const bool alone_in = in_it.size() < past_it.size();
      const std::vector<int>& odd = alone_in ? in_it : past_it;
      const std::vector<int>& rest = alone_in ? past_it : in_it;
      d.verdict.push_back(absl::StrFormat(
          "suspect: %s: %s %s %s while %s %s, so what passed between them "
          "was lost (a cut link, or a process stalled on %s side)",
          Ranks(odd),
          odd.size() == 1 ? "the only rank that" : "the only ranks that",
          alone_in ? "never finished" : "finished", where, Ranks(rest),
          alone_in ? "did" : "did not", odd.size() == 1 ? "its" : "their"));
    }
    size_t most = 0;
    for (const auto& [r, by] : named_by) most = std::max(most, by.size());
    std::vector<int> suspects;
    std::set<int> accusers;
    for (const auto& [r, by] : named_by) {
      if (by.size() == most && most > 0) {
        suspects.push_back(r);
        accusers.insert(by.begin(), by.end());
      }
    }
    if (!suspects.empty() && !explained) {
      d.verdict.push_back(absl::StrFormat(
          "suspect: %s: the errors of %s name %s as the rank%s whose data "
          "never came or that never took theirs",
          Ranks(suspects),
          Ranks(std::vector<int>(accusers.begin(), accusers.end())),
          suspects.size() == 1 ? "it" : "them",
          suspects.size() == 1 ? "" : "s"));
    }
  } else if (d.missing) {
    d.verdict.push_back(absl::StrFormat(
        "no dump: %s wrote none; every collective the others recorded "
        "completed",
        Ranks(d.missing_ranks)));
  }
  if (d.verdict.empty()) {
    d.verdict.push_back(
        "ok: every rank dumped, every recorded collective completed and the "
        "ranks agree on all of them");
  }

  // Details: each rank's position and first failure.
  for (const FlightDump& dump : dumps) {
    const FlightDumpEntry* last_done = nullptr;
    const FlightDumpEntry* pending = nullptr;
    for (const FlightDumpEntry& e : dump.entries) {
      if (Completed(e)) {
        if (last_done == nullptr || e.enqueued_ns >= last_done->enqueued_ns) {
          last_done = &e;
        }
      } else if (pending == nullptr) {
        pending = &e;
      }
    }
    std::string line = absl::StrFormat("rank %d (%s, pid %d): ", dump.rank,
                                       dump.host, dump.pid);
    absl::StrAppend(&line,
                    last_done != nullptr
                        ? absl::StrCat("last completed ", Describe(*last_done),
                                       " of ", last_done->group)
                        : std::string("completed nothing recorded"));
    if (pending != nullptr) {
      absl::StrAppend(&line, "; then ", Describe(*pending), " of ",
                      pending->group, ", ", pending->state);
    }
    absl::StrAppend(&line, "; dumped on ", Shorten(dump.reason, 80));
    d.details.push_back(line);
    if (!dump.first_failure.empty()) {
      d.details.push_back(
          absl::StrFormat("  first failure: %s", Shorten(dump.first_failure)));
    }
  }
  return d;
}

void PrintDiagnosis(const Diagnosis& d, std::ostream& out) {
  out << absl::StrFormat("fsdp diagnose: dumps of %d of %d ranks (%s)\n",
                         d.dumps, d.world_size, d.backend);
  for (const std::string& line : d.verdict) out << line << "\n";
  out << "\n";
  for (const std::string& line : d.details) out << line << "\n";
}

}  // namespace tools
}  // namespace flatparam
