// `fsdp collectives`: flags in, RunCollectivesSim/RunCollectivesMpi, exit
// code out.
#include <cstdint>
#include <iostream>
#include <ostream>
#include <string>
#include <vector>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/flag.h"
#include "absl/flags/reflection.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "comm/conformance/collective_cases.h"
#include "flatparam/base/dtype.h"
#include "flatparam/base/status_macros.h"
#include "tools/collectives.h"
#include "tools/common_flags.h"
#include "tools/subcommand.h"

ABSL_FLAG(std::string, fault, "",
          "Simulator faults, e.g. kill:rank=3:op=5 (see sim/fault.h).");
ABSL_FLAG(std::string, trace, "",
          "Write the simulator's Chrome trace-event JSON to this file.");
ABSL_FLAG(bool, checksum, true,
          "Simulator: hash payloads so that a flipped bit fails the "
          "collective.");
ABSL_FLAG(bool, conformance, true, "Run the conformance suite.");
ABSL_FLAG(int64_t, large_elements,
          flatparam::conformance::kDefaultLargeElements,
          "Elements of the conformance suite's large cases (0: none).");
ABSL_FLAG(bool, sweep, true, "Run the bandwidth sweep.");
ABSL_FLAG(bool, progress, false,
          "Rank 0 prints each sweep row to stderr as it starts.");
ABSL_FLAG(int64_t, min_bytes, 1 << 10, "The sweep's smallest size.");
ABSL_FLAG(int64_t, max_bytes, 16 << 20, "The sweep's largest size.");
ABSL_FLAG(int64_t, step_factor, 4, "Ratio of consecutive sweep sizes.");
ABSL_FLAG(int64_t, iterations, 0,
          "Timed collectives per size (0: 1 on sim, 10 otherwise).");
ABSL_FLAG(int64_t, warmup, -1,
          "Untimed collectives per size (-1: 0 on sim, 2 otherwise).");

namespace flatparam {
namespace tools {
namespace {

int CollectivesMain(const std::vector<char*>& args) {
  if (!args.empty()) {
    std::cerr << "fsdp collectives: unexpected argument \"" << args[0]
              << "\"; see fsdp collectives --help\n";
    return kExitUsage;
  }
  CollectivesOptions options;
  options.backend = absl::GetFlag(FLAGS_backend);
  if (options.backend.empty()) options.backend = DefaultCollectivesBackend();
  options.world_size = absl::GetFlag(FLAGS_world_size);
  options.world_size_given = FlagChanged("world_size");
  options.seed = absl::GetFlag(FLAGS_seed);
  options.faults = absl::GetFlag(FLAGS_fault);
  options.trace_path = absl::GetFlag(FLAGS_trace);
  options.checksum = absl::GetFlag(FLAGS_checksum);
  options.conformance = absl::GetFlag(FLAGS_conformance);
  options.large_elements = absl::GetFlag(FLAGS_large_elements);
  options.sweep = absl::GetFlag(FLAGS_sweep);
  options.min_bytes = absl::GetFlag(FLAGS_min_bytes);
  options.max_bytes = absl::GetFlag(FLAGS_max_bytes);
  options.step_factor = absl::GetFlag(FLAGS_step_factor);
  options.iterations = absl::GetFlag(FLAGS_iterations);
  options.warmup = absl::GetFlag(FLAGS_warmup);
  options.progress = absl::GetFlag(FLAGS_progress);
  options.timeout = absl::GetFlag(FLAGS_timeout).value_or(options.timeout);
  options.trace_dir = absl::GetFlag(FLAGS_trace_dir);
  absl::Status status;
  if (const std::string dtype = absl::GetFlag(FLAGS_dtype); !dtype.empty()) {
    absl::StatusOr<DType> parsed = ParseDType(dtype);
    if (parsed.ok()) {
      options.dtype = *parsed;
    } else {
      status = parsed.status();
    }
  }
  if (status.ok()) {
    absl::StatusOr<CollectivesOptions> valid =
        ValidateCollectivesOptions(options);
    status = valid.status();
    if (valid.ok()) {
      status = valid->backend == "sim" ? RunCollectivesSim(*valid, std::cout)
               : valid->backend == "c10d"
                   ? RunCollectivesC10d(*valid, std::cout)
                   : RunCollectivesMpi(*valid, std::cout);
    }
  }
  std::cout.flush();
  if (!status.ok()) {
    // Under mpirun the error was printed as it happened.
    if (!IsReported(status)) {
      std::cerr << "fsdp collectives: " << status.message() << "\n";
    }
    return kExitError;
  }
  return std::cout.good() ? kExitOk : kExitError;
}

constexpr char kHelp[] =
    "usage: fsdp collectives [--backend=sim|mpi|nccl|c10d] [--world-size=W]\n"
    "                        [--seed=S] [--fault=SPEC] [--trace=FILE.json]\n"
    "                        [--min-bytes=B] [--max-bytes=B] "
    "[--step-factor=F]\n"
    "                        [--iterations=N] [--warmup=N] [--dtype=DTYPE]\n"
    "                        [--no-conformance] [--no-sweep] "
    "[--large-elements=N]\n"
    "                        [--progress] [--timeout=DURATION]\n"
    "       mpirun -np 4 fsdp collectives [--backend=mpi|nccl]\n"
    "       torchrun --nproc_per_node=4 --no_python fsdp collectives\n"
    "\n"
    "Runs the collective conformance suite (every op and dtype, counts 0, "
    "1,\n"
    "primes, uneven splits and ~2M elements, checked bit for bit against "
    "the\n"
    "simulator's arithmetic), then times all_gather, reduce_scatter and\n"
    "all_reduce from --min-bytes to --max-bytes and prints time, algbw and\n"
    "busbw (nccl-tests' factors) and wrong elements per size. Exits 1 if a\n"
    "case failed, an element was wrong or a collective failed (a fault's\n"
    "error names the rank and the op). A collective that waits longer than\n"
    "--timeout for a hung or slow rank fails the run with DeadlineExceeded\n"
    "naming the rank and the op, instead of hanging.\n"
    "\n"
    "On the simulator, time is virtual (its cost model), so equal seeds give\n"
    "byte-identical output and traces. Under mpirun, time is wall time and\n"
    "rank 0 prints; nccl uses one GPU per rank (the node-local rank).\n"
    "\n"
    "flags:\n"
    "  --backend=sim|mpi|nccl|c10d  default: mpi under mpirun, c10d under\n"
    "                           torchrun (run by fsdp_c10d), else sim\n"
    "  --world-size=W           sim: ranks (default 8); mpi/nccl: mpirun's "
    "-np\n"
    "  --seed=S                 sim: the scheduler's seed (default 0)\n"
    "  --fault=SPEC             sim: kill:rank=R:op=K, "
    "flip:rank=R:op=K[:bit=B],\n"
    "                           delay:rank=R:seconds=S[:op=K]; "
    "comma-separated\n"
    "  --trace=FILE.json        sim: write the Chrome trace (Perfetto)\n"
    "  --no-checksum            sim: let flipped bits reach the outputs\n"
    "  --min-bytes=B            smallest size (default 1024)\n"
    "  --max-bytes=B            largest size (default 16777216)\n"
    "  --step-factor=F          ratio of consecutive sizes (default 4)\n"
    "  --iterations=N           timed per size (default 1 sim, 10 others)\n"
    "  --warmup=N               untimed per size (default 0 sim, 2 others)\n"
    "  --dtype=DTYPE            the sweep's dtype (default float32)\n"
    "  --no-conformance         skip the conformance suite\n"
    "  --progress               rank 0 prints each sweep row to stderr as it\n"
    "                           starts\n"
    "  --no-sweep               skip the bandwidth sweep\n"
    "  --large-elements=N       the suite's large cases (default 2097155; "
    "0: none)\n"
    "  --timeout=DURATION       the longest any one collective may wait "
    "(every\n"
    "                           case, sweep collective and gather; mpi/nccl:"
    " also\n"
    "                           setup), e.g. 10s or 2m; must be positive "
    "(default\n"
    "                           30s, the conformance suite's case timeout; "
    "sim:\n"
    "                           virtual time); MPI's start may take the "
    "longer of\n"
    "                           it and 1m\n"
    "  --trace-dir=DIR          flight recorder: each rank writes its last\n"
    "                           collectives to DIR/rank_<R>.json when one\n"
    "                           fails, on SIGUSR1 and on SIGTERM; read them\n"
    "                           with `fsdp diagnose DIR` (sim, mpi, c10d;\n"
    "                           default: $FLATPARAM_TRACE_DIR)\n";

void PrintHelp(std::ostream& out) { out << kHelp; }

}  // namespace

const Subcommand kCollectivesSubcommand = {
    "collectives",
    "check and time the collectives of a backend (sim, mpi, nccl, c10d)",
    PrintHelp,
    CollectivesMain,
};

}  // namespace tools
}  // namespace flatparam
