// Chrome trace-event JSON (the format Perfetto and chrome://tracing open),
// the one writer behind every trace flatparam produces: the simulator's
// record of what its ranks did (SimWorld::ChromeTraceJson) and the cost
// model's prediction of what they would do (cost::PredictionTraceJson).
//
//   ChromeTrace trace;
//   trace.ProcessName(0, "flatparam sim: 8 ranks, seed 0");
//   trace.ThreadName(0, 3, "rank 3", /*sort_index=*/3);
//   trace.Complete(0, 3, "all_gather", "collective", 12.5, 3.0,
//                  {{"bytes", 4096}});
//   std::string json = trace.Json({{"backend", "sim"}});
//
// Events are kept in the order they are added and written as one
// {"traceEvents": [...], "displayTimeUnit": "ns", "otherData": {...}}
// document; timestamps and durations are microseconds. The output is a
// function of the calls alone, so equal inputs give byte-identical traces.
//
// A ChromeTrace owns its events; it is not synchronised (one thread builds
// it).
#ifndef FLATPARAM_SIM_CHROME_TRACE_H_
#define FLATPARAM_SIM_CHROME_TRACE_H_

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace flatparam {

class ChromeTrace {
 public:
  // Metadata: the name (and, if >= 0, the sort position) of process `pid`
  // and of thread `tid` in it.
  void ProcessName(int64_t pid, absl::string_view name,
                   int64_t sort_index = -1);
  void ThreadName(int64_t pid, int64_t tid, absl::string_view name,
                  int64_t sort_index = -1);
  // A complete ("X") event: `name` on thread `tid` of process `pid` from
  // `ts_us` for `dur_us` microseconds, in category `category`, with `args`
  // shown when it is selected.
  void Complete(int64_t pid, int64_t tid, absl::string_view name,
                absl::string_view category, double ts_us, double dur_us,
                nlohmann::json args = nlohmann::json::object());
  // A counter ("C") sample of process `pid` at `ts_us`: one series per
  // member of `values` (a JSON object of numbers).
  void Counter(int64_t pid, absl::string_view name, double ts_us,
               nlohmann::json values);

  // The whole document with `other_data` as "otherData".
  std::string Json(nlohmann::json other_data = nlohmann::json::object()) const;
  // Writes Json(other_data) to `path`. Internal naming the path and the
  // error when it cannot be written.
  absl::Status Write(
      const std::string& path,
      nlohmann::json other_data = nlohmann::json::object()) const;

  int64_t size() const { return static_cast<int64_t>(events_.size()); }

 private:
  nlohmann::json events_ = nlohmann::json::array();
};

}  // namespace flatparam

#endif  // FLATPARAM_SIM_CHROME_TRACE_H_
