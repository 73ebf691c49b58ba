// Reading JSON that may be hostile: every JSON file or string flatparam
// reads (model files, checkpoint sidecars, layouts, manifests, safetensors
// headers) goes through ParseJson.
//
// Why a depth limit: nlohmann's parser and destructor are iterative, but
// copying, comparing and dumping a value recurse once per level of nesting,
// so a few hundred KB of "[[[[..." parse fine and then overflow the stack
// of whatever touches the value next. ParseJson stops as soon as the
// document nests deeper than the limit, before building the rest of it
// (so a 1 GiB file of '[' costs no more memory than a small one), and
// JsonNestedDeeperThan checks a value built some other way, without
// recursion. No schema flatparam reads nests more than about 10 levels;
// kMaxJsonDepth leaves room for free-form members (a rank sidecar's
// "extra") and is small enough that recursing over it is safe even under
// ASan.
//
//   FLATPARAM_ASSIGN_OR_RETURN(
//       nlohmann::json doc,
//       ParseJson(text, path, {absl::StatusCode::kDataLoss}));
//
// Thread-safety: pure functions (a callback runs on the calling thread).
#ifndef FLATPARAM_BASE_JSON_LIMITS_H_
#define FLATPARAM_BASE_JSON_LIMITS_H_

#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace flatparam {

// The deepest nesting a reader accepts. Depth counts levels of values: a
// scalar or an empty array/object is 1 deep, [1] and {"a": []} are 2 deep.
inline constexpr int kMaxJsonDepth = 512;

struct JsonParseOptions {
  // The code of every error: DataLoss for files flatparam wrote (a
  // checkpoint), InvalidArgument for files a user wrote (a model file).
  absl::StatusCode code = absl::StatusCode::kInvalidArgument;
  // Documents nesting deeper than this are refused.
  int max_depth = kMaxJsonDepth;
  // Optional: nlohmann's parser callback, called for every parse event
  // after the depth check (for example to see duplicate keys, which the
  // parsed object keeps only once). Returning false discards the value,
  // as in nlohmann::json::parse.
  nlohmann::json::parser_callback_t callback = nullptr;
};

// Parses `text` as one JSON document (nothing but whitespace after it).
// `source` names it in errors (a path, or "<file>: header"). Errors, with
// `options.code`:
//   "<source>:<line>:<column>: malformed JSON: <reason>"
//   "<source>: nested deeper than <max_depth> levels"
// Line and column are 1-based, of the byte where parsing stopped.
absl::StatusOr<nlohmann::json> ParseJson(absl::string_view text,
                                         absl::string_view source,
                                         const JsonParseOptions& options = {});

// Whether `value` nests deeper than `max_depth` levels (see kMaxJsonDepth).
// Iterative: safe on any value, however deep. Stops at the first level
// past the limit.
bool JsonNestedDeeperThan(const nlohmann::json& value, int max_depth);

// OK, or `code` with "<source>: nested deeper than <max_depth> levels": for
// readers that take an already parsed value (which may not come from
// ParseJson) and are about to copy, compare or dump it.
absl::Status CheckJsonDepth(const nlohmann::json& value,
                            absl::string_view source, absl::StatusCode code,
                            int max_depth = kMaxJsonDepth);

}  // namespace flatparam

#endif  // FLATPARAM_BASE_JSON_LIMITS_H_
