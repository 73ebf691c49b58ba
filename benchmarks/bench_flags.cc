#include "benchmarks/bench_flags.h"

#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/strip.h"

namespace flatparam {
namespace bench {

void BenchFlags::Int64(std::string name, int64_t* value, int64_t min) {
  flags_.push_back({Flag::Kind::kInt64, std::move(name), value, min, {}});
}

void BenchFlags::String(std::string name, std::string* value,
                        std::vector<std::string> choices) {
  flags_.push_back(
      {Flag::Kind::kString, std::move(name), value, 0, std::move(choices)});
}

void BenchFlags::Bool(std::string name, bool* value) {
  flags_.push_back({Flag::Kind::kBool, std::move(name), value, 0, {}});
}

bool BenchFlags::Match(const Flag& f, absl::string_view arg,
                       std::string* error) const {
  if (!absl::ConsumePrefix(&arg, "--")) return false;
  const std::string dashed = absl::StrReplaceAll(f.name, {{"_", "-"}});
  if (f.kind == Flag::Kind::kBool) {
    bool* value = static_cast<bool*>(f.value);
    if (arg == f.name || arg == dashed) {
      *value = true;
      return true;
    }
    if (arg == "no" + f.name || arg == "no" + dashed) {
      *value = false;
      return true;
    }
  }
  if (!absl::ConsumePrefix(&arg, f.name + "=") &&
      !absl::ConsumePrefix(&arg, dashed + "=")) {
    return false;
  }
  switch (f.kind) {
    case Flag::Kind::kInt64: {
      int64_t* value = static_cast<int64_t*>(f.value);
      if (!absl::SimpleAtoi(arg, value) || *value < f.min) {
        *error = "an integer >= " + std::to_string(f.min);
      }
      break;
    }
    case Flag::Kind::kString: {
      *static_cast<std::string*>(f.value) = std::string(arg);
      bool ok = f.choices.empty();
      for (const std::string& c : f.choices) ok = ok || arg == c;
      if (!ok) *error = "one of " + absl::StrJoin(f.choices, ", ");
      break;
    }
    case Flag::Kind::kBool:
      if (!absl::SimpleAtob(arg, static_cast<bool*>(f.value))) {
        *error = "true or false";
      }
      break;
  }
  return true;
}

void BenchFlags::Parse(int* argc, char** argv) const {
  int out = 1;
  for (int i = 1; i < *argc; ++i) {
    bool matched = false;
    for (const Flag& f : flags_) {
      std::string error;
      if (!Match(f, argv[i], &error)) continue;
      if (!error.empty()) {
        std::fprintf(stderr, "%s: bad flag %s (expected %s)\n",
                     program_.c_str(), argv[i], error.c_str());
        std::exit(2);
      }
      matched = true;
      break;
    }
    if (!matched) argv[out++] = argv[i];
  }
  *argc = out;
}

}  // namespace bench
}  // namespace flatparam
