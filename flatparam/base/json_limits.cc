#include "flatparam/base/json_limits.h"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace flatparam {
namespace {

using json = nlohmann::json;

// Thrown from the parser callback to stop at the first level too deep:
// returning false would only discard the value and parse on.
struct TooDeep {};

std::string TooDeepMessage(absl::string_view source, int max_depth) {
  return absl::StrCat(source, ": nested deeper than ", max_depth, " levels");
}

// Line and column (both 1-based) of the byte nlohmann stopped at. nlohmann's
// `byte` counts the characters read, so the offending one is byte - 1.
std::pair<int64_t, int64_t> LineAndColumn(absl::string_view text, size_t byte) {
  const size_t index = std::min(byte > 0 ? byte - 1 : 0, text.size());
  int64_t line = 1;
  size_t line_start = 0;
  for (size_t i = 0; i < index; ++i) {
    if (text[i] == '\n') {
      ++line;
      line_start = i + 1;
    }
  }
  return {line, static_cast<int64_t>(index - line_start) + 1};
}

// nlohmann's what() is "[json.exception.parse_error.101] parse error at line
// 1, column 2: syntax error ..." or "[json.exception.out_of_range.406]
// number overflow ..."; keep what follows the tag and the position.
std::string ErrorReason(const std::string& what, bool has_position) {
  const size_t tag_end = what.find("] ");
  const size_t start = tag_end == std::string::npos ? 0 : tag_end + 2;
  if (!has_position) return what.substr(start);
  const size_t colon = what.find(": ", start);
  return colon == std::string::npos ? what.substr(start)
                                    : what.substr(colon + 2);
}

}  // namespace

absl::StatusOr<json> ParseJson(absl::string_view text, absl::string_view source,
                               const JsonParseOptions& options) {
  // The callback's depth is the number of enclosing arrays and objects, so
  // a value it reports (a scalar, a key's member, a container's start) is
  // at level depth + 1.
  const int max_depth = options.max_depth;
  const json::parser_callback_t& user = options.callback;
  const json::parser_callback_t check =
      [max_depth, &user](int depth, json::parse_event_t event, json& parsed) {
        if (depth >= max_depth && event != json::parse_event_t::object_end &&
            event != json::parse_event_t::array_end) {
          throw TooDeep();
        }
        return user ? user(depth, event, parsed) : true;
      };
  try {
    return json::parse(text.begin(), text.end(), check);
  } catch (const TooDeep&) {
    return absl::Status(options.code, TooDeepMessage(source, max_depth));
  } catch (const json::parse_error& e) {
    const auto [line, column] = LineAndColumn(text, e.byte);
    return absl::Status(
        options.code,
        absl::StrFormat("%s:%d:%d: malformed JSON: %s", source, line, column,
                        ErrorReason(e.what(), /*has_position=*/true)));
  } catch (const json::exception& e) {
    // A number too large for a double (out_of_range.406) has no position.
    return absl::Status(
        options.code,
        absl::StrCat(source, ": malformed JSON: ",
                     ErrorReason(e.what(), /*has_position=*/false)));
  }
}

bool JsonNestedDeeperThan(const json& value, int max_depth) {
  // Depth-first with an explicit stack: recursion is what this guards
  // against.
  std::vector<std::pair<const json*, int>> stack = {{&value, 1}};
  while (!stack.empty()) {
    const auto [j, depth] = stack.back();
    stack.pop_back();
    if (depth > max_depth) return true;
    if (j->is_structured()) {
      for (const json& child : *j) stack.emplace_back(&child, depth + 1);
    }
  }
  return false;
}

absl::Status CheckJsonDepth(const json& value, absl::string_view source,
                            absl::StatusCode code, int max_depth) {
  if (JsonNestedDeeperThan(value, max_depth)) {
    return absl::Status(code, TooDeepMessage(source, max_depth));
  }
  return absl::OkStatus();
}

}  // namespace flatparam
