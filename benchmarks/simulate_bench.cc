// `fsdp plan --simulate` at scale: one training step of llama2-70b (80
// blocks) with HYBRID_SHARD (shard groups of 8, bf16 mixed precision) on
// every rank of W = 64 ... 4,096, the ranks as fibers on one thread
// (tools/simulate.h).
//
//   bazel run -c opt //benchmarks:simulate_bench
//
// Counters per world size: collective calls simulated per second of wall
// time, the simulated step against `fsdp plan`'s closed form (step_err_pct,
// 0 when they agree), and the process's peak RSS so far (maxrss_GiB; the
// sizes run in increasing order, so it is this size's). With the save
// (BM_SimulatedStepAndSave), save_s is its time on the virtual clock. The
// goal (issue 29):
// W = 4,096 in under 60 s and 8 GiB on the 2-core CI machine.
#include <benchmark/benchmark.h>
#include <sys/resource.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "tools/plan.h"
#include "tools/simulate.h"

namespace flatparam {
namespace {

double MaxRssGiB() {
  struct rusage usage {};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_maxrss) / (1 << 20);  // KiB -> GiB
}

void Simulate(benchmark::State& state, bool save) {
  tools::PlanOptions options;
  options.model = "llama2-70b";
  options.gpus_per_node = 8;
  options.nodes = state.range(0) / 8;
  options.strategy = "HYBRID_SHARD";
  options.mixed_precision = "bf16";
  absl::StatusOr<tools::Plan> plan = tools::MakePlan(options);
  if (!plan.ok()) {
    state.SkipWithError(std::string(plan.status().message()).c_str());
    return;
  }
  tools::SimulateOptions simulate;
  simulate.save = save;
  double calls = 0;
  double error = 0;
  double save_seconds = 0;
  for (auto _ : state) {
    absl::StatusOr<std::vector<tools::SimulatedStrategy>> simulated =
        tools::SimulatePlan(*plan, options, simulate);
    if (!simulated.ok()) {
      state.SkipWithError(std::string(simulated.status().message()).c_str());
      return;
    }
    const tools::SimulatedStrategy& s = simulated->front();
    const double predicted = plan->strategies.front().prediction.step_seconds;
    calls += static_cast<double>(s.collectives);
    error = std::max(error,
                     100.0 * std::abs(s.step_seconds - predicted) / predicted);
    save_seconds = s.save_seconds;
    if (!s.races.empty()) state.SkipWithError(s.races.front().c_str());
  }
  if (save) state.counters["save_s"] = save_seconds;
  state.counters["calls/s"] =
      benchmark::Counter(calls, benchmark::Counter::kIsRate);
  state.counters["step_err_pct"] = error;
  state.counters["maxrss_GiB"] = MaxRssGiB();
}
void BM_SimulatedStep(benchmark::State& state) { Simulate(state, false); }
// The step, then the collective sharded save (--simulate-save): its
// exchanges over every rank, the first shard group's files sized; save_s is
// the save's time on the virtual clock at the default 2 GB/s per writer.
void BM_SimulatedStepAndSave(benchmark::State& state) { Simulate(state, true); }
BENCHMARK(BM_SimulatedStep)
    ->ArgName("ranks")
    ->Arg(64)
    ->Arg(256)
    ->Arg(1024)
    ->Arg(2048)
    ->Arg(4096)
    ->Iterations(1)
    ->Unit(benchmark::kSecond)
    ->UseRealTime();
BENCHMARK(BM_SimulatedStepAndSave)
    ->ArgName("ranks")
    ->Arg(1024)
    ->Arg(4096)
    ->Iterations(1)
    ->Unit(benchmark::kSecond)
    ->UseRealTime();

}  // namespace
}  // namespace flatparam

BENCHMARK_MAIN();
