#include "sim/chrome_trace.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <string>
#include <utility>

#include "absl/strings/str_format.h"

namespace flatparam {
namespace {

nlohmann::json Metadata(const char* what, int64_t pid, int64_t tid,
                        nlohmann::json args) {
  return {{"name", what},
          {"ph", "M"},
          {"pid", pid},
          {"tid", tid},
          {"args", std::move(args)}};
}

}  // namespace

void ChromeTrace::ProcessName(int64_t pid, absl::string_view name,
                              int64_t sort_index) {
  events_.push_back(
      Metadata("process_name", pid, 0, {{"name", std::string(name)}}));
  if (sort_index >= 0) {
    events_.push_back(
        Metadata("process_sort_index", pid, 0, {{"sort_index", sort_index}}));
  }
}

void ChromeTrace::ThreadName(int64_t pid, int64_t tid, absl::string_view name,
                             int64_t sort_index) {
  events_.push_back(
      Metadata("thread_name", pid, tid, {{"name", std::string(name)}}));
  if (sort_index >= 0) {
    events_.push_back(
        Metadata("thread_sort_index", pid, tid, {{"sort_index", sort_index}}));
  }
}

void ChromeTrace::Complete(int64_t pid, int64_t tid, absl::string_view name,
                           absl::string_view category, double ts_us,
                           double dur_us, nlohmann::json args) {
  events_.push_back({{"name", std::string(name)},
                     {"cat", std::string(category)},
                     {"ph", "X"},
                     {"ts", ts_us},
                     {"dur", dur_us},
                     {"pid", pid},
                     {"tid", tid},
                     {"args", std::move(args)}});
}

void ChromeTrace::Counter(int64_t pid, absl::string_view name, double ts_us,
                          nlohmann::json values) {
  events_.push_back({{"name", std::string(name)},
                     {"ph", "C"},
                     {"ts", ts_us},
                     {"pid", pid},
                     {"tid", 0},
                     {"args", std::move(values)}});
}

std::string ChromeTrace::Json(nlohmann::json other_data) const {
  const nlohmann::json doc = {{"traceEvents", events_},
                              {"displayTimeUnit", "ns"},
                              {"otherData", std::move(other_data)}};
  return doc.dump();
}

absl::Status ChromeTrace::Write(const std::string& path,
                                nlohmann::json other_data) const {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) {
    return absl::InternalError(
        absl::StrFormat("cannot open trace file %s for writing: %s", path,
                        std::strerror(errno)));
  }
  out << Json(std::move(other_data));
  out.close();
  if (!out) {
    return absl::InternalError(
        absl::StrFormat("error writing the trace to %s", path));
  }
  return absl::OkStatus();
}

}  // namespace flatparam
