// Throughput of the deterministic simulator (//sim) in wall-clock time.
//
//   bazel run -c opt //benchmarks:sim_bench
//
// BM_SimManyRanks: a whole SimWorld (thread start-up included) of `ranks`
// ranks, each issuing and waiting on `ops` all-reduces of 16 floats; the
// counters give collectives and baton hand-offs per second. This is the
// "1024 ranks x 100 collectives complete in seconds" check; fibers:1 runs
// the ranks as fibers (SimOptions::Execution::kFibers) instead of threads.
//
// BM_SimAllGather / BM_SimReduceScatter / BM_SimAllReduce: one collective
// per iteration at 8 ranks, `bytes` being nccl-tests' size (all-gather:
// output bytes per rank; reduce-scatter: input bytes per rank; all-reduce:
// buffer bytes). algbw = bytes / time and busbw = algbw * factor with
// nccl-tests' factors ((n-1)/n for all-gather and reduce-scatter, 2(n-1)/n
// for all-reduce), both in bytes per second of wall-clock time. "wrong"
// counts output elements that differ from the expected values after the
// last iteration (nccl-tests' #wrong); it must be 0.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "comm/communicator.h"
#include "sim/sim.h"

namespace flatparam {
namespace {

std::unique_ptr<SimWorld> MakeWorld(int ranks, bool fibers = false) {
  SimOptions options;
  options.world_size = ranks;
  options.seed = 1;
  if (fibers) options.execution = SimOptions::Execution::kFibers;
  auto world = SimWorld::Create(options);
  if (!world.ok()) std::abort();
  return std::move(world).value();
}

void BM_SimManyRanks(benchmark::State& state) {
  const int ranks = static_cast<int>(state.range(0));
  const int ops = static_cast<int>(state.range(1));
  const bool fibers = state.range(2) != 0;
  int64_t handoffs = 0;
  for (auto _ : state) {
    auto world = MakeWorld(ranks, fibers);
    const absl::Status status =
        world->Run([&](Communicator& comm) -> absl::Status {
          std::vector<float> buf(16, 1.0f);
          BufferRef ref{buf.data(), 16, DType::kFloat32};
          for (int i = 0; i < ops; ++i) {
            const absl::Status s = comm.AllReduce(ref, ref, {})->Wait();
            if (!s.ok()) return s;
          }
          return absl::OkStatus();
        });
    if (!status.ok()) {
      state.SkipWithError(std::string(status.message()).c_str());
      return;
    }
    handoffs += static_cast<int64_t>(world->schedule().size());
  }
  const double iters = static_cast<double>(state.iterations());
  state.counters["collectives/s"] =
      benchmark::Counter(ops * iters, benchmark::Counter::kIsRate);
  state.counters["rank_calls/s"] =
      benchmark::Counter(ranks * ops * iters, benchmark::Counter::kIsRate);
  state.counters["handoffs/s"] = benchmark::Counter(
      static_cast<double>(handoffs), benchmark::Counter::kIsRate);
}
BENCHMARK(BM_SimManyRanks)
    ->ArgNames({"ranks", "ops", "fibers"})
    ->Args({64, 100, 0})
    ->Args({256, 100, 0})
    ->Args({1024, 100, 0})
    ->Args({1024, 100, 1})
    ->Args({4096, 100, 1})
    ->Iterations(3)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

enum class Kind { kAllGather, kReduceScatter, kAllReduce };

// One collective per benchmark iteration, inside a single Run(): rank 0
// drives the benchmark loop and publishes, before each operation, whether it
// is the last (an untimed extra one); the others read the flag of an
// operation after it completed, which needs rank 0 to have issued it.
void RunCollective(benchmark::State& state, Kind kind) {
  const int n = static_cast<int>(state.range(0));
  const int64_t size = state.range(1);
  const int64_t elems = size / 4;
  const int64_t count = kind == Kind::kAllReduce ? elems : elems / n;
  auto world = MakeWorld(n);
  std::vector<char> keep;
  int64_t wrong = 0;
  const absl::Status status = world->Run([&](Communicator& comm) {
    const int r = comm.rank();
    const int64_t in_count = kind == Kind::kReduceScatter ? count * n : count;
    const int64_t out_count = kind == Kind::kAllGather ? count * n : count;
    std::vector<float> in(in_count, static_cast<float>(r + 1));
    std::vector<float> out(out_count, 0.0f);
    BufferRef i{in.data(), in_count, DType::kFloat32};
    BufferRef o{out.data(), out_count, DType::kFloat32};
    absl::Status s = comm.Barrier({});
    for (size_t k = 0; s.ok(); ++k) {
      if (r == 0) keep.push_back(state.KeepRunning());
      switch (kind) {
        case Kind::kAllGather:
          s = comm.AllGather(i, o, {})->Wait();
          break;
        case Kind::kReduceScatter:
          s = comm.ReduceScatter(i, o, {})->Wait();
          break;
        case Kind::kAllReduce:
          s = comm.AllReduce(i, o, {})->Wait();
          break;
      }
      if (!keep[k]) break;
    }
    const float sum = n * (n + 1) / 2.0f;
    for (int64_t e = 0; e < out_count; ++e) {
      const float want =
          kind == Kind::kAllGather ? static_cast<float>(e / count + 1) : sum;
      wrong += out[e] != want;
    }
    return s;
  });
  if (!status.ok()) {
    state.SkipWithError(std::string(status.message()).c_str());
    return;
  }
  const double factor = kind == Kind::kAllReduce
                            ? 2.0 * (n - 1) / n
                            : static_cast<double>(n - 1) / n;
  const double bytes = static_cast<double>(size) * state.iterations();
  state.SetBytesProcessed(static_cast<int64_t>(bytes));
  state.counters["algbw"] =
      benchmark::Counter(bytes, benchmark::Counter::kIsRate);
  state.counters["busbw"] =
      benchmark::Counter(bytes * factor, benchmark::Counter::kIsRate);
  state.counters["wrong"] = static_cast<double>(wrong);
}

void BM_SimAllGather(benchmark::State& state) {
  RunCollective(state, Kind::kAllGather);
}
void BM_SimReduceScatter(benchmark::State& state) {
  RunCollective(state, Kind::kReduceScatter);
}
void BM_SimAllReduce(benchmark::State& state) {
  RunCollective(state, Kind::kAllReduce);
}

void Sizes(benchmark::internal::Benchmark* b) {
  b->ArgNames({"ranks", "bytes"});
  for (int64_t bytes = 1 << 10; bytes <= (64 << 20); bytes *= 4) {
    b->Args({8, bytes});
  }
  b->UseRealTime();
}
BENCHMARK(BM_SimAllGather)->Apply(Sizes);
BENCHMARK(BM_SimReduceScatter)->Apply(Sizes);
BENCHMARK(BM_SimAllReduce)->Apply(Sizes);

}  // namespace
}  // namespace flatparam

BENCHMARK_MAIN();
