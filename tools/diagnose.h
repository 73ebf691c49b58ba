// `fsdp diagnose DIR`: reads every rank's flight-recorder dump
// (comm/flight_recorder.h) in DIR and says why a job hung or failed, in a
// few lines a person reads first:
//   * the ranks that are behind, where they stopped (the last collective
//     each issued, with its unit and phase), and where the others wait;
//   * the first sequence number of a group at which the ranks' collectives
//     disagree (operation, dtype, count, or the FSDP unit and phase that
//     issued them), with each side's ranks and context;
//   * the ranks with no dump (killed, stopped, or on a host that is gone).
// PyTorch's flight-recorder analyser (tools/flight_recorder) reports the
// first mismatched collective and the ranks missing from it; this adds the
// FSDP context and works from the dumps of the ranks that wrote one.
//
//   FLATPARAM_ASSIGN_OR_RETURN(std::vector<FlightDump> dumps,
//                              ReadFlightDumps("/tmp/trace"));
//   const Diagnosis d = Diagnose(dumps);
//   PrintDiagnosis(d, std::cout);
//   return d.ExitCode();
//
// Thread-safety: pure functions.
#ifndef TOOLS_DIAGNOSE_H_
#define TOOLS_DIAGNOSE_H_

#include <cstdint>
#include <map>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace flatparam {
namespace tools {

// One collective of a dump (the format's "entries").
struct FlightDumpEntry {
  std::string group;
  int64_t seq = 0;
  std::string op;
  std::string dtype;
  int64_t count = 0;
  int64_t bytes = 0;
  std::string unit;
  int handle = -1;
  std::string phase;
  // "enqueued", "started", "completed" or "failed".
  std::string state;
  int64_t enqueued_ns = 0;
  int64_t started_ns = 0;
  int64_t finished_ns = 0;
  std::string error;
};

// One rank's dump.
struct FlightDump {
  std::string path;
  int rank = 0;
  int world_size = 0;
  std::string backend;
  std::string host;
  int64_t pid = 0;
  std::string reason;
  std::string first_failure;
  int64_t dumped_at_ns = 0;
  uint64_t recorded = 0;
  int64_t capacity = 0;
  // Group id -> its members' world ranks.
  std::map<std::string, std::vector<int>> groups;
  std::vector<FlightDumpEntry> entries;
};

// Parses one dump; InvalidArgument naming `path` and the field for
// anything that is not the documented format.
absl::StatusOr<FlightDump> ParseFlightDump(const std::string& text,
                                           const std::string& path);

// Reads DIR/rank_*.json; where a rank has several dumps (a file from an
// earlier job kept, see FlightRecorder::Dump), the newest (dumped_at_ns)
// wins and the others are listed in `ignored`. NotFound without any dump;
// a file that does not parse is an error naming it.
absl::StatusOr<std::vector<FlightDump>> ReadFlightDumps(
    const std::string& dir, std::vector<std::string>* ignored = nullptr);

struct Diagnosis {
  int world_size = 0;
  int dumps = 0;
  std::string backend;
  // The findings (each also an exit-code bit).
  bool stuck = false;    // a collective some rank never completed
  bool desync = false;   // ranks disagree on a collective
  bool missing = false;  // ranks without a dump
  std::vector<int> missing_ranks;
  // What to print: the verdict lines first, then the details.
  std::vector<std::string> verdict;
  std::vector<std::string> details;

  // 0: nothing found; otherwise 4 (stuck) | 8 (desync) | 16 (missing).
  int ExitCode() const;
};

inline constexpr int kDiagnoseStuck = 4;
inline constexpr int kDiagnoseDesync = 8;
inline constexpr int kDiagnoseMissing = 16;

Diagnosis Diagnose(const std::vector<FlightDump>& dumps);

void PrintDiagnosis(const Diagnosis& d, std::ostream& out);

}  // namespace tools
}  // namespace flatparam

#endif  // TOOLS_DIAGNOSE_H_
