#include "flatparam/base/json_limits.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "flatparam/base/status_matchers.h"

namespace flatparam {
namespace {

using ::testing::HasSubstr;
using json = nlohmann::json;

constexpr absl::StatusCode kDataLoss = absl::StatusCode::kDataLoss;
constexpr absl::StatusCode kInvalid = absl::StatusCode::kInvalidArgument;

std::string Repeat(absl::string_view s, int n) {
  std::string out;
  out.reserve(s.size() * n);
  for (int i = 0; i < n; ++i) absl::StrAppend(&out, s);
  return out;
}

// `depth` levels: arrays around a scalar (which is one level itself).
std::string NestedArrays(int depth) {
  return Repeat("[", depth - 1) + "0" + Repeat("]", depth - 1);
}

// `depth` levels of {"k": ...} around an empty object.
std::string NestedObjects(int depth) {
  return Repeat(R"({"k": )", depth - 1) + "{}" + Repeat("}", depth - 1);
}

// The same, built as a value (moves only: copying would recurse).
json NestedValue(int depth) {
  json inner = 0;
  for (int i = 1; i < depth; ++i) {
    json outer = json::array();
    outer.push_back(std::move(inner));
    inner = std::move(outer);
  }
  return inner;
}

TEST(JsonLimitsTest, ParsesOrdinaryDocuments) {
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      json doc, ParseJson(R"({"a": [1, 2.5, "x", null, true, {}]})", "f.json"));
  EXPECT_EQ(doc["a"][1], 2.5);
  EXPECT_EQ(doc["a"].size(), 6u);
}

TEST(JsonLimitsTest, DepthLimitIsExact) {
  for (int depth = kMaxJsonDepth - 3; depth <= kMaxJsonDepth + 3; ++depth) {
    SCOPED_TRACE(depth);
    const bool fits = depth <= kMaxJsonDepth;
    for (const std::string& text :
         {NestedArrays(depth), NestedObjects(depth)}) {
      absl::StatusOr<json> doc = ParseJson(text, "f.json");
      if (fits) {
        ASSERT_THAT(doc, IsOk());
        EXPECT_FALSE(JsonNestedDeeperThan(*doc, kMaxJsonDepth));
        EXPECT_TRUE(JsonNestedDeeperThan(*doc, depth - 1));
      } else {
        EXPECT_THAT(doc, StatusIs(kInvalid, HasSubstr("f.json: nested deeper "
                                                      "than 512 levels")));
      }
    }
    EXPECT_EQ(JsonNestedDeeperThan(NestedValue(depth), kMaxJsonDepth), !fits);
  }
  EXPECT_FALSE(JsonNestedDeeperThan(json(1), 1));
  EXPECT_FALSE(JsonNestedDeeperThan(json::array(), 1));
  EXPECT_TRUE(JsonNestedDeeperThan(json::array({1}), 1));
  EXPECT_TRUE(JsonNestedDeeperThan(json{{"a", 1}}, 1));
}

// The stack overflow the limit exists for: a document of 100,000 levels is
// refused without recursing, whatever the nesting is made of, and a value
// that deep is checked without recursing either.
TEST(JsonLimitsTest, HundredThousandLevelsAreRefusedWithoutCrashing) {
  constexpr int kDeep = 100000;
  for (const std::string& text :
       {NestedArrays(kDeep), NestedObjects(kDeep), Repeat("[", kDeep),
        absl::StrCat(R"({"a": 1, "b": )", NestedArrays(kDeep), "}")}) {
    EXPECT_THAT(ParseJson(text, "deep.json", {kDataLoss}),
                StatusIs(kDataLoss, HasSubstr("deep.json: nested deeper than "
                                              "512 levels")));
  }
  const json deep = NestedValue(kDeep);
  EXPECT_TRUE(JsonNestedDeeperThan(deep, kMaxJsonDepth));
  EXPECT_THAT(CheckJsonDepth(deep, "value", kDataLoss),
              StatusIs(kDataLoss, HasSubstr("value: nested deeper than 512")));
  EXPECT_THAT(CheckJsonDepth(NestedValue(10), "value", kDataLoss), IsOk());
}

TEST(JsonLimitsTest, OtherLimits) {
  JsonParseOptions options;
  options.max_depth = 2;
  EXPECT_THAT(ParseJson("[[]]", "f", options), IsOk());
  EXPECT_THAT(ParseJson("[[1]]", "f", options),
              StatusIs(kInvalid, HasSubstr("f: nested deeper than 2 levels")));
  EXPECT_THAT(ParseJson(R"({"a": {"b": 1}})", "f", options),
              StatusIs(kInvalid, HasSubstr("nested deeper than 2")));
}

TEST(JsonLimitsTest, MalformedJsonNamesTheSourceLineAndColumn) {
  EXPECT_THAT(ParseJson("{\n  \"a\": 1,\n  \"b\" 2}", "m.json"),
              StatusIs(kInvalid, HasSubstr("m.json:3:7: malformed JSON: "
                                           "syntax error")));
  EXPECT_THAT(ParseJson("", "empty.json", {kDataLoss}),
              StatusIs(kDataLoss, HasSubstr("empty.json:1:1: malformed JSON")));
  EXPECT_THAT(ParseJson("{} {}", "two.json"),
              StatusIs(kInvalid, HasSubstr("two.json:1:4: malformed JSON")));
  // Not a parse_error but out_of_range, without a position: still a status.
  EXPECT_THAT(ParseJson("[1e999]", "big.json"),
              StatusIs(kInvalid, HasSubstr("big.json: malformed JSON: number "
                                           "overflow parsing '1e999'")));
}

TEST(JsonLimitsTest, CallbackSeesEveryEventAndCanDiscard) {
  std::vector<std::string> keys;
  JsonParseOptions options;
  options.callback = [&keys](int depth, json::parse_event_t event,
                             json& parsed) {
    if (event == json::parse_event_t::key && depth == 1) {
      keys.push_back(parsed.get<std::string>());
    }
    // Drop every member called "drop".
    return !(event == json::parse_event_t::key && parsed == "drop");
  };
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      json doc, ParseJson(R"({"a": 1, "drop": 2, "a": 3})", "f", options));
  EXPECT_EQ(keys, (std::vector<std::string>{"a", "drop", "a"}));
  EXPECT_EQ(doc, json({{"a", 3}}));
  // The depth check comes first.
  keys.clear();
  options.max_depth = 1;
  EXPECT_THAT(ParseJson(R"({"a": 1})", "f", options),
              StatusIs(kInvalid, HasSubstr("nested deeper than 1 levels")));
  EXPECT_TRUE(keys.empty());
}

}  // namespace
}  // namespace flatparam
