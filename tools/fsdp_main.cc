// The `fsdp` command-line tool: `fsdp SUBCOMMAND [--flags...]`.
//
// Exit codes: 0 success; 1 the command failed (message on stderr); 2 no or
// unknown subcommand, an unknown flag (with the closest known one), or a
// malformed command line.
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "tools/common_flags.h"
#include "tools/subcommand.h"

namespace flatparam {
namespace tools {
namespace {

const Subcommand* const kSubcommands[] = {
    // In `fsdp` usage order: the one to try first, then by topic.
    &kDemoSubcommand,         //
    &kInspectSubcommand,      //
    &kPlanSubcommand,         //
    &kTrainSubcommand,        //
    &kCheckpointSubcommand,   //
    &kModelSubcommand,        //
    &kCollectivesSubcommand,  //
    &kDiagnoseSubcommand,
};

const Subcommand* FindSubcommand(absl::string_view name) {
  for (const Subcommand* s : kSubcommands) {
    if (s->name == name) return s;
  }
  return nullptr;
}

void PrintUsage(std::ostream& out) {
  out << "usage: fsdp SUBCOMMAND [--flags...]\n"
         "       fsdp SUBCOMMAND --help\n\n"
         "subcommands:\n";
  for (const Subcommand* s : kSubcommands) {
    out << "  " << s->name
        << std::string(12 - std::min<size_t>(11, s->name.size()), ' ')
        << s->summary << "\n";
  }
}

bool IsHelpFlag(absl::string_view arg) {
  return arg == "--help" || arg == "-h" || arg == "-help" ||
         arg == "--helpfull";
}

// absl flag names use underscores; accept the dashed spelling users type
// (`--world-size=8` -> `--world_size=8`, `--no-align-addresses` ->
// `--noalign_addresses`). Only the name part of `--name` or `--name=value`
// changes, and nothing after a bare `--`.
std::vector<std::string> NormalizeFlagNames(int argc, char** argv) {
  std::vector<std::string> out;
  bool flags_done = false;
  for (int i = 0; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--") flags_done = true;
    if (!flags_done && i > 0 && absl::StartsWith(arg, "--")) {
      const size_t end = std::min(arg.find('='), arg.size());
      for (size_t c = 2; c < end; ++c) {
        if (arg[c] == '-') arg[c] = '_';
      }
      // absl negates booleans as --noNAME.
      if (absl::StartsWith(argv[i], "--no-")) arg.erase(4, 1);
    }
    out.push_back(std::move(arg));
  }
  return out;
}

// Levenshtein distance, for suggesting the flag a user meant.
size_t EditDistance(absl::string_view a, absl::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1,
                         diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

// The first flag of `args` (underscored, as absl sees them) that no
// command knows, with a suggestion, for exit 2 instead of absl's exit 1.
// `typed` holds the arguments as the user typed them, index for index.
std::optional<std::string> UnknownFlag(absl::string_view command,
                                       const std::vector<std::string>& args,
                                       char** typed) {
  const auto flags = absl::GetAllFlags();
  for (size_t i = 1; i < args.size(); ++i) {
    absl::string_view name = args[i];
    if (name == "--") break;
    if (!absl::ConsumePrefix(&name, "--") && !absl::ConsumePrefix(&name, "-")) {
      continue;
    }
    name = name.substr(0, name.find('='));
    absl::string_view positive = name;
    if (flags.contains(name) ||
        (absl::ConsumePrefix(&positive, "no") && flags.contains(positive))) {
      continue;
    }
    std::string best;
    size_t best_distance = std::string::npos;
    for (const auto& [flag_name, flag] : flags) {
      if (flag->IsRetired() || absl::StrContains(flag->Filename(), "absl/")) {
        continue;
      }
      const size_t d = EditDistance(name, flag_name);
      if (d < best_distance || (d == best_distance && flag_name < best)) {
        best_distance = d;
        best = std::string(flag_name);
      }
    }
    absl::string_view as_typed = typed[i];
    as_typed = as_typed.substr(0, as_typed.find('='));
    std::string message =
        absl::StrCat("fsdp ", command, ": unknown flag ", as_typed);
    if (!best.empty() &&
        best_distance <= std::max<size_t>(2, name.size() / 3)) {
      std::replace(best.begin(), best.end(), '_', '-');
      absl::StrAppend(&message, "; did you mean --", best, "?");
    }
    absl::StrAppend(&message, " (fsdp ", command, " --help lists its flags)");
    return message;
  }
  return std::nullopt;
}

int Main(int argc, char** argv) {
  // Under `bazel run` the tool starts in its runfiles directory; relative
  // paths (--model=my_model.json, --out=dir) mean the user's directory, as
  // with Bazel's own tools.
  if (const char* dir = std::getenv("BUILD_WORKING_DIRECTORY");
      dir != nullptr && *dir != '\0' && chdir(dir) != 0) {
    std::cerr << "fsdp: cannot change to BUILD_WORKING_DIRECTORY " << dir
              << ": " << std::strerror(errno) << "\n";
    return kExitError;
  }
  if (argc < 2) {
    PrintUsage(std::cerr);
    return kExitUsage;
  }
  const absl::string_view name = argv[1];
  if (name == "help" || IsHelpFlag(name)) {
    const Subcommand* s = argc > 2 ? FindSubcommand(argv[2]) : nullptr;
    if (s != nullptr) {
      s->print_help(std::cout);
    } else {
      PrintUsage(std::cout);
    }
    return kExitOk;
  }
  const Subcommand* command = FindSubcommand(name);
  if (command == nullptr) {
    std::cerr << "fsdp: unknown subcommand \"" << name << "\"\n\n";
    PrintUsage(std::cerr);
    return kExitUsage;
  }
  for (int i = 2; i < argc && absl::string_view(argv[i]) != "--"; ++i) {
    if (IsHelpFlag(argv[i])) {
      command->print_help(std::cout);
      return kExitOk;
    }
  }

  // absl parses as if the subcommand were the program: "fsdp inspect".
  std::vector<std::string> args = NormalizeFlagNames(argc - 1, argv + 1);
  args[0] = absl::StrCat("fsdp ", name);
  // What was given, whatever its value: an explicit default still counts.
  SetGivenFlags(args);
  if (std::optional<std::string> unknown = UnknownFlag(name, args, argv + 1)) {
    std::cerr << *unknown << "\n";
    return kExitUsage;
  }
  std::vector<char*> arg_ptrs;
  for (std::string& a : args) arg_ptrs.push_back(a.data());
  absl::SetProgramUsageMessage(absl::StrCat("fsdp ", name, ": ",
                                            command->summary, "\nRun `fsdp ",
                                            name, " --help` for its flags."));
  std::vector<char*> positional = absl::ParseCommandLine(
      static_cast<int>(arg_ptrs.size()), arg_ptrs.data());
  positional.erase(positional.begin());  // The program name.
  return command->run(positional);
}

}  // namespace
}  // namespace tools
}  // namespace flatparam

int main(int argc, char** argv) { return flatparam::tools::Main(argc, argv); }
