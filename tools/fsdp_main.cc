// The `fsdp` command-line tool: `fsdp SUBCOMMAND [--flags...]`.
//
// Exit codes: 0 success; 1 the command failed (message on stderr; absl's
// flag parser also exits 1 on an unknown flag); 2 no or unknown subcommand,
// or a malformed command line.
#include <algorithm>
#include <iostream>
#include <ostream>
#include <string>
#include <vector>

#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "tools/common_flags.h"
#include "tools/subcommand.h"

namespace flatparam {
namespace tools {
namespace {

const Subcommand* const kSubcommands[] = {
    // In `fsdp` usage order: the one to try first, then by topic.
    &kDemoSubcommand,        //
    &kInspectSubcommand,     //
    &kPlanSubcommand,        //
    &kTrainSubcommand,       //
    &kCheckpointSubcommand,  //
    &kCollectivesSubcommand,
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

int Main(int argc, char** argv) {
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
