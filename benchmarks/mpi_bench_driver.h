// Pieces every MPI-launched Google Benchmark binary of benchmarks/ needs:
// its own flags parsed out of argv before Google Benchmark sees the rest
// (BenchFlags, bench_flags.h, included here), a fatal error that takes the
// whole job down, and the driver that keeps the ranks in step while Google
// Benchmark runs on rank 0 alone.
//
// Why a driver: every rank must run the same collectives (or barriers) the
// same number of times, but Google Benchmark decides on rank 0 how many
// iterations and repetitions to run. So rank 0 registers and runs the
// benchmarks, and before each run broadcasts which benchmark it is and its
// iteration count over MPI_COMM_WORLD; the other ranks wait in a loop and
// run exactly that.
//
//   BenchFlags flags("my_bench");
//   flags.Int64("size_mib", &size_mib, /*min=*/1);
//   flags.Parse(&argc, argv);           // exits 2 on a bad value
//   benchmark::Initialize(&argc, argv);
//   ... MpiSession::Start ...
//   std::vector<MpiBenchmark> runs = {{"op/ranks:4", Run, Configure}};
//   RunMpiBenchmarks(runs);             // on every rank
//
// Thread-safety: everything here runs on the main thread of each rank.
#ifndef FLATPARAM_BENCHMARKS_MPI_BENCH_DRIVER_H_
#define FLATPARAM_BENCHMARKS_MPI_BENCH_DRIVER_H_

#include <benchmark/benchmark.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "benchmarks/bench_flags.h"

namespace flatparam {
namespace bench {

// Prints "<program>: <status>" to stderr and ends the job: MPI_Abort when
// MPI is initialised (so that no rank waits forever for a dead one), exit(1)
// otherwise.
[[noreturn]] void Die(absl::string_view program, const absl::Status& status);

// One benchmark that every rank runs.
struct MpiBenchmark {
  std::string name;
  // Runs on every rank. `state` is rank 0's Google Benchmark state and null
  // on the other ranks; `iterations` is the number of iterations rank 0's
  // state will run, which the other ranks must run too (RunIterations does
  // both).
  std::function<void(benchmark::State* state, int64_t iterations)> run;
  // Applied on rank 0 to the registered benchmark (UseManualTime, Unit,
  // Iterations, Repetitions...). May be empty.
  std::function<void(benchmark::internal::Benchmark*)> configure;
};

// Runs `benchmarks` as Google Benchmark selects them (--benchmark_filter,
// repetitions...) on rank 0, with the other ranks in step; returns on every
// rank when rank 0 has run them all (RunSpecifiedBenchmarks and Shutdown
// included). Call on every rank of MPI_COMM_WORLD, after MPI_Init and
// benchmark::Initialize.
void RunMpiBenchmarks(const std::vector<MpiBenchmark>& benchmarks);

// Calls `iteration` once per benchmark iteration: on rank 0 (`state` set)
// as Google Benchmark's loop and with SetIterationTime(returned seconds)
// for benchmarks that UseManualTime; elsewhere `iterations` times.
void RunIterations(benchmark::State* state, int64_t iterations,
                   const std::function<double()>& iteration);

}  // namespace bench
}  // namespace flatparam

#endif  // FLATPARAM_BENCHMARKS_MPI_BENCH_DRIVER_H_
