// Bandwidth of FlatParamHandle's communication round trips next to the raw
// collectives they are built on, on the same communicator and sizes, in the
// same run: one FSDP unit (a single float32 parameter of `bytes` bytes,
// SHARD_GRAD_OP, host memory) per rank, 1 MiB to 256 MiB.
//
//   unshard_reshard   Unshard() + Reshard(free_unsharded = true): allocate
//                     the padded unsharded flat parameter, all-gather the
//                     local shard into it, free it (after one untimed
//                     warm-up round trip, so that HostDeviceOps' caching
//                     allocator has seen the size, as in a training loop's
//                     steady state).
//   all_gather        Communicator::AllGather of the same shard into a
//                     preallocated buffer of the same size.
//   reduce_grad       ReduceGrad(): gradient pre-divide, reduce-scatter into
//                     a new sharded gradient, post-divide (the unsharded
//                     gradient is prepared, untimed, by PreBackward and a
//                     fill of ones; the parameter stays unsharded between
//                     iterations, as SHARD_GRAD_OP keeps it under no_sync).
//   reduce_scatter    Communicator::ReduceScatter of the same sizes into a
//                     preallocated buffer.
// Both reduce ops start their timed part after the same untimed
// preparation: the input freshly written (reduce_grad: zeroed and filled
// as a backward writes the gradient; reduce_scatter: filled), then a
// barrier. Without the barrier, a rank still preparing would be timed;
// without the write, the bare reduce-scatter would send a clean buffer
// (cheaper for the peer's copy out of this process) that a gradient never
// is.
// Sizes are nccl-tests': the all-gather output / reduce-scatter input, i.e.
// the padded unsharded flat parameter. Counters: bytes_per_second
// (SetBytesProcessed), algbw and busbw (nccl-tests' factors, bytes per
// second) and "wrong": elements that differed from the expected values after
// the last iteration (must be 0).
//
//   # The simulator: 4 in-process ranks (--ranks=N), wall time.
//   bazel run -c opt //benchmarks:handle_bench -- --backend=sim
//
//   # MPI, 4 processes; rank 0 reports.
//   bazel build -c opt //benchmarks:handle_bench
//   mpirun --allow-run-as-root --oversubscribe --bind-to none -np 4
//       bazel-bin/benchmarks/handle_bench --backend=mpi
//
// --host_cache_bytes=B: HostDeviceOps' max_cached_bytes (default: its
// default, 1 GiB); 0 turns its caching allocator off, each Unshard() then
// allocates and first-touches fresh memory.
//
// Caps (--max_bytes=B, default 256 MiB on both backends; sizes grow by 4x):
// per rank the unit needs the unsharded parameter and gradient (2 x B) plus
// shards and the raw collectives' buffers. Measured peaks at 256 MiB on 4
// ranks: the simulator (every rank in one process, plus its reduction
// scratch) 2.7 GB resident; MPI, which also stages each collective's input
// and output, 1.5 GB per process (6 GB for 4). Both stay under 8 GiB. On a
// 2-core machine the sweeps took 22 s (sim) and 31 s (MPI) with
// --benchmark_min_time=0.05, 44 s and 39 s with 0.5.
//
// Timing: UseManualTime with the wall time of the timed part on rank 0.
// On the simulator ranks take turns, so rank 0's collective finishes only
// after every rank's share of the work: the time is the whole simulated
// operation's. Under MPI, rank 0 runs Google Benchmark and broadcasts each
// run (which one, iterations) so that every rank runs the same collectives
// (benchmarks/mpi_bench_driver.h).
#include <benchmark/benchmark.h>
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"
#include "benchmarks/mpi_bench_driver.h"
#include "comm/communicator.h"
#include "comm/conformance/bandwidth.h"
#include "comm/mpi/mpi_communicator.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/device/caching_allocator.h"
#include "flatparam/device/device.h"
#include "flatparam/handle.h"
#include "flatparam/layout.h"
#include "sim/sim.h"

namespace flatparam {
namespace bench {
namespace {

using conformance::CollectiveKind;

constexpr char kProgram[] = "handle_bench";
constexpr int64_t kMinBytes = int64_t{1} << 20;
constexpr int64_t kMaxBytes = int64_t{256} << 20;

enum class Op : int32_t {
  kUnshardReshard = 0,
  kAllGather = 1,
  kReduceGrad = 2,
  kReduceScatter = 3,
};
constexpr Op kOps[] = {Op::kUnshardReshard, Op::kAllGather, Op::kReduceGrad,
                       Op::kReduceScatter};

const char* OpName(Op op) {
  switch (op) {
    case Op::kUnshardReshard:
      return "unshard_reshard";
    case Op::kAllGather:
      return "all_gather";
    case Op::kReduceGrad:
      return "reduce_grad";
    case Op::kReduceScatter:
      return "reduce_scatter";
  }
  return "?";
}

CollectiveKind KindOf(Op op) {
  return op == Op::kUnshardReshard || op == Op::kAllGather
             ? CollectiveKind::kAllGather
             : CollectiveKind::kReduceScatter;
}

struct Flags {
  std::string backend = "sim";
  int64_t ranks = 4;
  int64_t max_bytes = kMaxBytes;
  CachingAllocatorOptions cache;
};

double Seconds(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
      .count();
}

// One rank's unit, handle and raw buffers for one op and size.
class Unit {
 public:
  static absl::StatusOr<std::unique_ptr<Unit>> Make(
      Communicator& comm, Op op, int64_t bytes,
      const CachingAllocatorOptions& cache) {
    auto u = std::unique_ptr<Unit>(new Unit(comm, op, cache));
    const int n = comm.size();
    LayoutOptions options;
    options.world_size = n;
    options.strategy = ShardingStrategy::kShardGradOp;
    const std::vector<ParamSpec> params = {{"w", {bytes / 4}, DType::kFloat32}};
    FLATPARAM_ASSIGN_OR_RETURN(
        FlatParamLayout layout,
        FlatParamLayout::Create("unit", params, options));
    u->numel_ = layout.unpadded_unsharded_numel();
    u->chunk_ = layout.sharded_numel();
    u->bytes_ = layout.padded_unsharded_numel() * 4;
    FLATPARAM_ASSIGN_OR_RETURN(
        u->shard_, u->device_.Allocate(Device::Host(), u->chunk_ * 4));
    FLATPARAM_RETURN_IF_ERROR(u->device_.Fill(u->shard_ref(), comm.rank() + 1));
    if (op == Op::kAllGather || op == Op::kReduceScatter) {
      FLATPARAM_ASSIGN_OR_RETURN(
          u->full_, u->device_.Allocate(Device::Host(), n * u->chunk_ * 4));
      FLATPARAM_RETURN_IF_ERROR(u->device_.Fill(u->full_ref(), 1.0));
      return u;
    }
    FLATPARAM_ASSIGN_OR_RETURN(
        u->handle_, FlatParamHandle::CreateWithLocalShard(
                        layout, u->shard_ref(), &comm, nullptr, &u->device_));
    // Untimed warm-up. reduce_grad: the first PreBackward all-gathers;
    // later ones reuse the parameter SHARD_GRAD_OP keeps. unshard_reshard:
    // the first Unshard() allocates what later ones find cached.
    FLATPARAM_ASSIGN_OR_RETURN(double ignored, u->Iterate());
    (void)ignored;
    return u;
  }

  int64_t bytes() const { return bytes_; }

  // Runs one iteration; returns the seconds of its timed part.
  absl::StatusOr<double> Iterate() {
    FlatParamHandle* h = handle_.get();
    std::chrono::steady_clock::time_point start;
    switch (op_) {
      case Op::kUnshardReshard:
        start = std::chrono::steady_clock::now();
        FLATPARAM_RETURN_IF_ERROR(h->Unshard());
        FLATPARAM_RETURN_IF_ERROR(h->Reshard(/*free_unsharded=*/true));
        return Seconds(start);
      case Op::kAllGather:
        start = std::chrono::steady_clock::now();
        FLATPARAM_RETURN_IF_ERROR(
            comm_->AllGather(shard_ref(), full_ref(), {})->Wait());
        return Seconds(start);
      case Op::kReduceGrad: {
        FLATPARAM_RETURN_IF_ERROR(h->ZeroGrad(/*set_to_none=*/true));
        FLATPARAM_RETURN_IF_ERROR(h->PreBackward());
        FLATPARAM_RETURN_IF_ERROR(device_.Fill(*h->unsharded_grad(), 1.0));
        // Every rank's untimed preparation is done before the clock starts
        // (on 2 cores a rank still filling would otherwise be timed).
        FLATPARAM_RETURN_IF_ERROR(comm_->Barrier({}));
        start = std::chrono::steady_clock::now();
        FLATPARAM_RETURN_IF_ERROR(h->ReduceGrad());
        const double t = Seconds(start);
        FLATPARAM_RETURN_IF_ERROR(h->PostBackward(/*sync_gradients=*/false));
        FLATPARAM_RETURN_IF_ERROR(h->FinalizeBackward(false));
        return t;
      }
      case Op::kReduceScatter:
        // As reduce_grad: the input freshly written (as a backward writes
        // the gradient) and every rank starting the timed part together.
        FLATPARAM_RETURN_IF_ERROR(device_.Fill(full_ref(), 1.0));
        FLATPARAM_RETURN_IF_ERROR(comm_->Barrier({}));
        start = std::chrono::steady_clock::now();
        FLATPARAM_RETURN_IF_ERROR(
            comm_->ReduceScatter(full_ref(), shard_ref(), {})->Wait());
        return Seconds(start);
    }
    return absl::InternalError("unknown op");
  }

  // Elements that differ from the expected values after the last
  // iteration. Collective for unshard_reshard (all ranks call it alike).
  absl::StatusOr<int64_t> Wrong() {
    const int n = comm_->size();
    int64_t wrong = 0;
    auto count = [&](BufferRef b, auto expected) {
      const float* x = static_cast<const float*>(b.data);
      for (int64_t i = 0; i < b.count; ++i) wrong += x[i] != expected(i);
    };
    switch (op_) {
      case Op::kUnshardReshard: {
        FLATPARAM_RETURN_IF_ERROR(handle_->Unshard());
        count(*handle_->unsharded_flat_param(),
              [&](int64_t i) { return static_cast<float>(i / chunk_ + 1); });
        FLATPARAM_RETURN_IF_ERROR(handle_->Reshard(true));
        break;
      }
      case Op::kAllGather:
        count(full_ref(),
              [&](int64_t i) { return static_cast<float>(i / chunk_ + 1); });
        break;
      case Op::kReduceGrad:
        // n ones, each divided by pre, summed, divided by post = n / n.
        count(*handle_->sharded_grad(), [](int64_t) { return 1.0f; });
        break;
      case Op::kReduceScatter:
        count(shard_ref(), [&](int64_t) { return static_cast<float>(n); });
        break;
    }
    return wrong;
  }

 private:
  Unit(Communicator& comm, Op op, const CachingAllocatorOptions& cache)
      : comm_(&comm), op_(op), device_(cache) {}

  BufferRef shard_ref() const {
    return shard_.As(DType::kFloat32).Slice(0, chunk_);
  }
  BufferRef full_ref() const {
    return full_.As(DType::kFloat32).Slice(0, comm_->size() * chunk_);
  }

  Communicator* comm_;
  Op op_;
  HostDeviceOps device_;
  int64_t numel_ = 0;
  int64_t chunk_ = 0;
  int64_t bytes_ = 0;
  DeviceBuffer shard_;
  DeviceBuffer full_;
  std::unique_ptr<FlatParamHandle> handle_;
};

void SetCounters(benchmark::State& state, Op op, int64_t bytes, int n,
                 double seconds, int64_t wrong) {
  const int64_t iterations = state.iterations();
  state.SetBytesProcessed(bytes * iterations);
  const conformance::Bandwidth bw = conformance::ComputeBandwidth(
      KindOf(op), bytes, n,
      absl::Seconds(iterations > 0 ? seconds / iterations : 0));
  state.counters["algbw"] = benchmark::Counter(
      bw.algbw, benchmark::Counter::kDefaults, benchmark::Counter::kIs1000);
  state.counters["busbw"] = benchmark::Counter(
      bw.busbw, benchmark::Counter::kDefaults, benchmark::Counter::kIs1000);
  state.counters["wrong"] = static_cast<double>(wrong);
  state.counters["ranks"] = n;
}

// ---------------------------------------------------------------------------
// The simulator: one SimWorld per benchmark run; rank 0 drives the loop.

void RunSim(benchmark::State& state, Op op, int64_t bytes, int ranks,
            const CachingAllocatorOptions& cache) {
  SimOptions options;
  options.world_size = ranks;
  options.seed = 1;
  absl::StatusOr<std::unique_ptr<SimWorld>> world = SimWorld::Create(options);
  if (!world.ok()) Die(kProgram, world.status());
  // Rank 0 publishes, before each iteration, whether it is timed; the others
  // read the flag once rank 0 has issued the iteration's collective. The
  // last iteration is an untimed extra.
  std::vector<char> keep;
  double seconds = 0;
  int64_t wrong = 0;
  int64_t size = 0;
  const absl::Status status =
      (*world)->Run([&](Communicator& comm) -> absl::Status {
        FLATPARAM_ASSIGN_OR_RETURN(std::unique_ptr<Unit> u,
                                   Unit::Make(comm, op, bytes, cache));
        size = u->bytes();
        FLATPARAM_RETURN_IF_ERROR(comm.Barrier({}));
        const bool driver = comm.rank() == 0;
        for (size_t k = 0;; ++k) {
          if (driver) keep.push_back(state.KeepRunning());
          FLATPARAM_ASSIGN_OR_RETURN(const double t, u->Iterate());
          if (driver && keep[k]) {
            state.SetIterationTime(t);
            seconds += t;
          }
          if (!keep[k]) break;
        }
        FLATPARAM_ASSIGN_OR_RETURN(const int64_t w, u->Wrong());
        wrong += w;
        return absl::OkStatus();
      });
  if (!status.ok()) {
    state.SkipWithError(std::string(status.message()).c_str());
    return;
  }
  SetCounters(state, op, size, ranks, seconds, wrong);
}

// ---------------------------------------------------------------------------
// MPI: rank 0 runs Google Benchmark, the other ranks follow
// (RunMpiBenchmarks).

// Runs `iterations` of `op` at `bytes` on this rank; `state` is rank 0's,
// null elsewhere.
void Execute(Op op, int64_t bytes, int64_t iterations, Communicator& comm,
             const CachingAllocatorOptions& cache, benchmark::State* state) {
  absl::StatusOr<std::unique_ptr<Unit>> made =
      Unit::Make(comm, op, bytes, cache);
  if (!made.ok()) Die(kProgram, made.status());
  Unit& u = **made;
  MPI_Barrier(MPI_COMM_WORLD);
  double seconds = 0;
  RunIterations(state, iterations, [&]() -> double {
    absl::StatusOr<double> t = u.Iterate();
    if (!t.ok()) Die(kProgram, t.status());
    seconds += *t;
    return *t;
  });
  absl::StatusOr<int64_t> wrong = u.Wrong();
  if (!wrong.ok()) Die(kProgram, wrong.status());
  int64_t mine = *wrong;
  int64_t total = 0;
  MPI_Reduce(&mine, &total, 1, MPI_INT64_T, MPI_SUM, 0, MPI_COMM_WORLD);
  if (state != nullptr) {
    SetCounters(*state, op, u.bytes(), comm.size(), seconds, total);
  }
}

// ---------------------------------------------------------------------------

std::vector<int64_t> Sizes(int64_t max_bytes) {
  std::vector<int64_t> sizes;
  for (int64_t b = kMinBytes; b <= std::min(max_bytes, kMaxBytes); b *= 4) {
    sizes.push_back(b);
  }
  return sizes;
}

// Removes this binary's own flags from argv; Google Benchmark gets the rest.
Flags ParseFlags(int* argc, char** argv) {
  Flags flags;
  BenchFlags parser(kProgram);
  parser.String("backend", &flags.backend, {"sim", "mpi"});
  parser.Int64("ranks", &flags.ranks, 1);
  parser.Int64("max_bytes", &flags.max_bytes, 1);
  parser.Int64("host_cache_bytes", &flags.cache.max_cached_bytes, 0);
  parser.Parse(argc, argv);
  return flags;
}

std::string Name(const std::string& backend, Op op, int64_t ranks,
                 int64_t bytes) {
  return absl::StrFormat("%s/%s/ranks:%d/bytes:%d", backend, OpName(op), ranks,
                         bytes);
}

int SimMain(const Flags& flags) {
  for (int64_t bytes : Sizes(flags.max_bytes)) {
    for (Op op : kOps) {
      benchmark::RegisterBenchmark(
          Name("sim", op, flags.ranks, bytes).c_str(),
          [op, bytes, ranks = static_cast<int>(flags.ranks),
           cache = flags.cache](benchmark::State& state) {
            RunSim(state, op, bytes, ranks, cache);
          })
          ->UseManualTime()
          ->Unit(benchmark::kMicrosecond);
    }
  }
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}

int MpiMain(const Flags& flags, int* argc, char*** argv) {
  absl::StatusOr<MpiSession> session = MpiSession::Start(argc, argv);
  if (!session.ok()) Die(kProgram, session.status());
  {
    absl::StatusOr<std::unique_ptr<MpiCommunicator>> world =
        MpiCommunicator::CreateWorld();
    if (!world.ok()) Die(kProgram, world.status());
    Communicator& comm = **world;
    std::vector<MpiBenchmark> benchmarks;
    for (int64_t bytes : Sizes(flags.max_bytes)) {
      for (Op op : kOps) {
        MpiBenchmark b;
        b.name = Name("mpi", op, comm.size(), bytes);
        b.run = [&comm, op, bytes, cache = flags.cache](benchmark::State* state,
                                                        int64_t iterations) {
          Execute(op, bytes, iterations, comm, cache, state);
        };
        b.configure = [](benchmark::internal::Benchmark* r) {
          r->UseManualTime()->Unit(benchmark::kMicrosecond);
        };
        benchmarks.push_back(std::move(b));
      }
    }
    RunMpiBenchmarks(benchmarks);
  }
  const absl::Status finished = session->Finish();
  if (!finished.ok()) Die(kProgram, finished);
  return 0;
}

}  // namespace
}  // namespace bench
}  // namespace flatparam

int main(int argc, char** argv) {
  using flatparam::bench::Flags;
  const Flags flags = flatparam::bench::ParseFlags(&argc, argv);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 2;
  if (flags.backend == "sim") return flatparam::bench::SimMain(flags);
  return flatparam::bench::MpiMain(flags, &argc, &argv);
}
