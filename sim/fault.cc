#include "sim/fault.h"

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "flatparam/base/status_macros.h"

namespace flatparam {
namespace {

constexpr absl::string_view kGrammar =
    "expected kill:rank=R:op=K, delay:rank=R:seconds=S[:op=K] or "
    "flip:rank=R:op=K[:bit=B]";

absl::Status SpecError(absl::string_view spec, absl::string_view what) {
  return absl::InvalidArgumentError(
      absl::StrFormat("bad fault spec \"%s\": %s (%s)", spec, what, kGrammar));
}

absl::StatusOr<int64_t> ParseCount(absl::string_view spec,
                                   absl::string_view key,
                                   absl::string_view value) {
  int64_t v = 0;
  if (!absl::SimpleAtoi(value, &v) || v < 0) {
    return SpecError(
        spec,
        absl::StrFormat("%s=%s is not a non-negative integer", key, value));
  }
  return v;
}

// Seconds as a decimal number, parsed exactly (absl::ParseDuration reads the
// fraction digit by digit, so "0.1" is exactly 100ms).
absl::StatusOr<absl::Duration> ParseSeconds(absl::string_view spec,
                                            absl::string_view value) {
  absl::Duration d;
  const bool plain_number =
      !value.empty() &&
      value.find_first_not_of("0123456789.") == absl::string_view::npos;
  if (!plain_number || !absl::ParseDuration(absl::StrCat(value, "s"), &d)) {
    return SpecError(
        spec, absl::StrFormat("seconds=%s is not a non-negative decimal number",
                              value));
  }
  return d;
}

std::string FormatSeconds(absl::Duration d) {
  const int64_t ns = absl::ToInt64Nanoseconds(d);
  std::string s = absl::StrFormat("%d.%09d", ns / 1000000000, ns % 1000000000);
  while (s.back() == '0') s.pop_back();
  if (s.back() == '.') s.pop_back();
  return s;
}

}  // namespace

absl::string_view FaultKindName(FaultSpec::Kind kind) {
  switch (kind) {
    case FaultSpec::Kind::kKill:
      return "kill";
    case FaultSpec::Kind::kDelay:
      return "delay";
    case FaultSpec::Kind::kFlip:
      return "flip";
  }
  return "unknown";
}

std::string FaultSpec::ToString() const {
  std::string s = absl::StrCat(FaultKindName(kind), ":rank=", rank);
  switch (kind) {
    case Kind::kKill:
      absl::StrAppend(&s, ":op=", op);
      break;
    case Kind::kDelay:
      absl::StrAppend(&s, ":seconds=", FormatSeconds(delay));
      if (op >= 0) absl::StrAppend(&s, ":op=", op);
      break;
    case Kind::kFlip:
      absl::StrAppend(&s, ":op=", op);
      if (bit >= 0) absl::StrAppend(&s, ":bit=", bit);
      break;
  }
  return s;
}

absl::StatusOr<FaultSpec> ParseFaultSpec(absl::string_view spec) {
  const absl::string_view text = absl::StripAsciiWhitespace(spec);
  std::vector<absl::string_view> parts = absl::StrSplit(text, ':');
  FaultSpec fault;
  if (parts[0] == "kill") {
    fault.kind = FaultSpec::Kind::kKill;
  } else if (parts[0] == "delay") {
    fault.kind = FaultSpec::Kind::kDelay;
  } else if (parts[0] == "flip") {
    fault.kind = FaultSpec::Kind::kFlip;
  } else {
    return SpecError(text,
                     absl::StrFormat("unknown fault kind \"%s\"", parts[0]));
  }

  std::map<std::string, std::string> values;
  for (size_t i = 1; i < parts.size(); ++i) {
    std::pair<absl::string_view, absl::string_view> kv =
        absl::StrSplit(parts[i], absl::MaxSplits('=', 1));
    if (kv.first.empty() || parts[i].find('=') == absl::string_view::npos) {
      return SpecError(text,
                       absl::StrFormat("\"%s\" is not key=value", parts[i]));
    }
    if (!values.emplace(std::string(kv.first), std::string(kv.second)).second) {
      return SpecError(text,
                       absl::StrFormat("key \"%s\" is repeated", kv.first));
    }
  }

  // The keys each kind takes, and which of them it needs.
  std::map<std::string, bool> allowed;  // key -> required
  switch (fault.kind) {
    case FaultSpec::Kind::kKill:
      allowed = {{"rank", true}, {"op", true}};
      break;
    case FaultSpec::Kind::kDelay:
      allowed = {{"rank", true}, {"seconds", true}, {"op", false}};
      break;
    case FaultSpec::Kind::kFlip:
      allowed = {{"rank", true}, {"op", true}, {"bit", false}};
      break;
  }
  for (const auto& [key, value] : values) {
    if (allowed.count(key) == 0) {
      return SpecError(text, absl::StrFormat("%s takes no key \"%s\"",
                                             FaultKindName(fault.kind), key));
    }
  }
  for (const auto& [key, required] : allowed) {
    if (required && values.count(key) == 0) {
      return SpecError(
          text,
          absl::StrFormat("%s needs %s=", FaultKindName(fault.kind), key));
    }
  }

  for (const auto& [key, value] : values) {
    if (key == "seconds") {
      FLATPARAM_ASSIGN_OR_RETURN(fault.delay, ParseSeconds(text, value));
      continue;
    }
    FLATPARAM_ASSIGN_OR_RETURN(const int64_t v, ParseCount(text, key, value));
    if (key == "rank") {
      if (v > INT32_MAX) {
        return SpecError(text, absl::StrFormat("rank=%d is too large", v));
      }
      fault.rank = static_cast<int>(v);
    } else if (key == "op") {
      fault.op = v;
    } else {
      fault.bit = v;
    }
  }
  return fault;
}

absl::StatusOr<std::vector<FaultSpec>> ParseFaultSpecs(
    absl::string_view specs) {
  std::vector<FaultSpec> faults;
  for (absl::string_view item : absl::StrSplit(specs, absl::ByAnyChar(",;"))) {
    if (absl::StripAsciiWhitespace(item).empty()) continue;
    FLATPARAM_ASSIGN_OR_RETURN(FaultSpec fault, ParseFaultSpec(item));
    faults.push_back(fault);
  }
  return faults;
}

}  // namespace flatparam
