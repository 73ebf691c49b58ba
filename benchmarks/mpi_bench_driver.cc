#include "benchmarks/mpi_bench_driver.h"

#include <mpi.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace flatparam {
namespace bench {

void Die(absl::string_view program, const absl::Status& status) {
  std::fprintf(stderr, "%s: %s\n", std::string(program).c_str(),
               status.ToString().c_str());
  int initialized = 0;
  int finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) MPI_Abort(MPI_COMM_WORLD, 1);
  std::exit(1);
}

namespace {

// What rank 0 is about to run; index -1: no more benchmarks.
struct Command {
  int64_t index = -1;
  int64_t iterations = 0;
};

void Broadcast(Command& command) {
  MPI_Bcast(&command, sizeof(command), MPI_BYTE, 0, MPI_COMM_WORLD);
}

}  // namespace

void RunMpiBenchmarks(const std::vector<MpiBenchmark>& benchmarks) {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank != 0) {
    for (;;) {
      Command command;
      Broadcast(command);
      if (command.index < 0) return;
      benchmarks[command.index].run(nullptr, command.iterations);
    }
  }
  for (size_t i = 0; i < benchmarks.size(); ++i) {
    const MpiBenchmark& b = benchmarks[i];
    benchmark::internal::Benchmark* registered = benchmark::RegisterBenchmark(
        b.name.c_str(), [&b, i](benchmark::State& state) {
          Command command;
          command.index = static_cast<int64_t>(i);
          command.iterations = static_cast<int64_t>(state.max_iterations);
          Broadcast(command);
          b.run(&state, command.iterations);
        });
    if (b.configure) b.configure(registered);
  }
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  Command done;
  Broadcast(done);
}

void RunIterations(benchmark::State* state, int64_t iterations,
                   const std::function<double()>& iteration) {
  if (state != nullptr) {
    for (auto _ : *state) state->SetIterationTime(iteration());
    return;
  }
  for (int64_t i = 0; i < iterations; ++i) (void)iteration();
}

}  // namespace bench
}  // namespace flatparam
