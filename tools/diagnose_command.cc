// `fsdp diagnose DIR`: see tools/diagnose.h.
#include <iostream>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "tools/diagnose.h"
#include "tools/subcommand.h"

namespace flatparam {
namespace tools {
namespace {

int DiagnoseMain(const std::vector<char*>& args) {
  if (args.size() != 1) {
    std::cerr << "fsdp diagnose: expected one directory (the --trace-dir of "
                 "the job); see fsdp diagnose --help\n";
    return kExitUsage;
  }
  std::vector<std::string> ignored;
  absl::StatusOr<std::vector<FlightDump>> dumps =
      ReadFlightDumps(args[0], &ignored);
  if (!dumps.ok()) {
    std::cerr << "fsdp diagnose: " << dumps.status().message() << "\n";
    return kExitError;
  }
  const Diagnosis d = Diagnose(*dumps);
  PrintDiagnosis(d, std::cout);
  for (const std::string& path : ignored) {
    std::cout << "ignored " << path << ": an older dump of the same rank\n";
  }
  std::cout.flush();
  return d.ExitCode();
}

constexpr char kHelp[] =
    "usage: fsdp diagnose DIR\n"
    "\n"
    "Reads the flight-recorder dumps every rank of a job wrote to DIR (its\n"
    "--trace-dir or $FLATPARAM_TRACE_DIR: rank_<R>.json, written when a\n"
    "collective fails, on SIGUSR1 and on SIGTERM) and prints first:\n"
    "  desync:  the first collective of a group on which the ranks disagree\n"
    "           (operation, dtype, count, or the FSDP unit and phase that\n"
    "           issued it), with each side's ranks;\n"
    "  behind:  the ranks that never reached the collective the others wait\n"
    "           in, and the last collective each of them issued;\n"
    "  no dump: the ranks that wrote none (killed, stopped, host gone);\n"
    "  stuck:   every rank reached the collective and none completed it\n"
    "           (a cut link, a lost transport);\n"
    "then each rank's last completed collective, what it waits in, and its\n"
    "first failure.\n"
    "\n"
    "Exit status: 0 when every rank dumped and every recorded collective\n"
    "completed alike; else the sum of 4 (a collective some rank never\n"
    "completed), 8 (a desync) and 16 (ranks without a dump); 1 when the\n"
    "dumps cannot be read, 2 for a wrong command line.\n";

void PrintHelp(std::ostream& out) { out << kHelp; }

}  // namespace

const Subcommand kDiagnoseSubcommand = {
    "diagnose",
    "say from the ranks' flight-recorder dumps why a job hung or failed",
    PrintHelp,
    DiagnoseMain,
};

}  // namespace tools
}  // namespace flatparam
