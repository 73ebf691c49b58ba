#include "sim/chrome_trace.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "flatparam/base/status_matchers.h"

namespace flatparam {
namespace {

using nlohmann::json;

ChromeTrace Sample() {
  ChromeTrace trace;
  trace.ProcessName(0, "sim", /*sort_index=*/0);
  trace.ThreadName(0, 1, "rank 1", /*sort_index=*/1);
  trace.ThreadName(0, 2, "comm");
  trace.Complete(0, 1, "all_gather", "collective", 12.5, 3.25,
                 {{"bytes", 4096}});
  trace.Counter(0, "memory (bytes)", 14.0, {{"params", 100}, {"grads", 7}});
  return trace;
}

TEST(ChromeTraceTest, WritesTheTraceEventFormat) {
  const json doc = json::parse(Sample().Json({{"backend", "test"}}));
  EXPECT_EQ(doc.at("displayTimeUnit"), "ns");
  EXPECT_EQ(doc.at("otherData").at("backend"), "test");
  const json& events = doc.at("traceEvents");
  ASSERT_EQ(events.size(), 7u);
  EXPECT_EQ(events[0].at("name"), "process_name");
  EXPECT_EQ(events[0].at("ph"), "M");
  EXPECT_EQ(events[0].at("args").at("name"), "sim");
  EXPECT_EQ(events[1].at("name"), "process_sort_index");
  EXPECT_EQ(events[2].at("name"), "thread_name");
  EXPECT_EQ(events[2].at("tid"), 1);
  EXPECT_EQ(events[3].at("name"), "thread_sort_index");
  // No sort index asked for: none written.
  EXPECT_EQ(events[4].at("name"), "thread_name");
  EXPECT_EQ(events[4].at("args").at("name"), "comm");
  const json& x = events[5];
  EXPECT_EQ(x.at("ph"), "X");
  EXPECT_EQ(x.at("name"), "all_gather");
  EXPECT_EQ(x.at("cat"), "collective");
  EXPECT_EQ(x.at("ts"), 12.5);
  EXPECT_EQ(x.at("dur"), 3.25);
  EXPECT_EQ(x.at("pid"), 0);
  EXPECT_EQ(x.at("tid"), 1);
  EXPECT_EQ(x.at("args").at("bytes"), 4096);
  const json& c = events[6];
  EXPECT_EQ(c.at("ph"), "C");
  EXPECT_EQ(c.at("args").at("grads"), 7);
}

TEST(ChromeTraceTest, EqualCallsGiveEqualBytes) {
  EXPECT_EQ(Sample().Json(), Sample().Json());
  ChromeTrace other = Sample();
  other.Complete(0, 1, "x", "y", 0, 0);
  EXPECT_NE(Sample().Json(), other.Json());
  EXPECT_EQ(other.size(), Sample().size() + 1);
}

TEST(ChromeTraceTest, WritesAFileAndNamesAPathItCannotWrite) {
  const char* dir = std::getenv("TEST_TMPDIR");
  const std::string path = std::string(dir ? dir : "/tmp") + "/trace.json";
  FLATPARAM_ASSERT_OK(Sample().Write(path, {{"k", 1}}));
  std::ifstream in(path);
  std::stringstream contents;
  contents << in.rdbuf();
  EXPECT_EQ(contents.str(), Sample().Json({{"k", 1}}));
  EXPECT_THAT(Sample().Write("/nonexistent-dir/trace.json"),
              StatusIs(absl::StatusCode::kInternal,
                       testing::HasSubstr("/nonexistent-dir/trace.json")));
}

}  // namespace
}  // namespace flatparam
