// Bandwidth of flatparam's all_gather, reduce_scatter and all_reduce on one
// backend, from 1 KiB up to 1 GiB (nccl-tests' sizes: all_gather's output,
// reduce_scatter's input, all_reduce's buffer), float32 sums, with
// nccl-tests' algbw and busbw (comm/conformance/bandwidth.h) as counters in
// bytes per second, and "wrong": output elements that differed from the
// expected values after the last iteration (nccl-tests' #wrong; must be 0).
//
//   # The simulator: 8 in-process ranks, wall time.
//   bazel run -c opt //benchmarks:collectives_bench -- --backend=sim
//
//   # MPI, 4 processes; only rank 0 reports. Also runs the raw
//   # MPI_Allgather / MPI_Reduce_scatter_block / MPI_Allreduce (MPI_FLOAT,
//   # MPI_SUM) on the same sizes as baselines ("mpi_raw/...").
//   bazel build -c opt //benchmarks:collectives_bench
//   mpirun --allow-run-as-root --oversubscribe --bind-to none -np 4
//       bazel-bin/benchmarks/collectives_bench --backend=mpi
//
//   # c10d (ProcessGroupGloo, as under torchrun), 2 processes, next to
//   # gloo's own collectives ("c10d_raw/...": for reduce_scatter, which
//   # 1.13's gloo lacks, its all_reduce of the input), flatparam's MPI
//   # backend ("mpi/...") and raw MPI ("mpi_raw/...") on the same sizes in
//   # the same run; mpirun only drives the benchmark.
//   bazel build -c opt //benchmarks:collectives_bench_c10d
//   mpirun --allow-run-as-root --oversubscribe --bind-to none -np 2
//       bazel-bin/benchmarks/collectives_bench_c10d --backend=c10d
//
//   # NCCL, one GPU per rank (the node-local rank), CUDA-event timing.
//   mpirun -np 8 bazel-bin/benchmarks/collectives_bench --backend=nccl
//
// Flags (besides Google Benchmark's):
//   --backend=sim|mpi|c10d|nccl  default sim
//   --ranks=N               sim only: ranks in the world (default 8)
//   --max_bytes=B           the largest size; default per backend: sim
//                           64 MiB (8 ranks x an output and an input buffer
//                           of up to 64 MiB, with the simulator's own
//                           staging, stays well under 8 GiB), mpi 256 MiB
//                           (4 processes x about 1.5 GiB for all_reduce's
//                           buffers and MPI's staging), c10d 256 MiB,
//                           nccl 1 GiB.
// The sizes grow by 4x. With --benchmark_min_time=0.05 the whole sim sweep
// takes about 10 s and the MPI sweep about a minute on a 2-core machine.
//
// Timing: every iteration is one collective, issued and waited on, timed
// with UseManualTime: the wall time of the collective on rank 0 (sim, MPI)
// or the CUDA events around it on the communicator's stream (NCCL). Ranks
// are synchronised before the first iteration. On the simulator, rank 0's
// collective finishes only after every rank has taken its turn, so the time
// is the whole simulated collective's.
//
// MPI and NCCL: every rank must run the same collectives, but Google
// Benchmark decides on rank 0 alone how many iterations to run. So rank 0
// broadcasts each benchmark run (which one, iterations) over MPI_COMM_WORLD
// before it starts, and the other ranks run exactly that
// (benchmarks/mpi_bench_driver.h), then report their wrong elements with
// MPI_Reduce.
#include <benchmark/benchmark.h>
#include <mpi.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "benchmarks/collectives_bench_c10d.h"
#include "benchmarks/collectives_bench_gpu.h"
#include "benchmarks/mpi_bench_driver.h"
#include "comm/communicator.h"
#include "comm/conformance/bandwidth.h"
#include "comm/conformance/case_values.h"
#include "comm/conformance/device_memory.h"
#include "comm/mpi/mpi_communicator.h"
#include "flatparam/base/status_macros.h"
#include "sim/sim.h"

namespace flatparam {
namespace bench {
namespace {

using conformance::CollectiveCase;
using conformance::CollectiveKind;
using conformance::DeviceBuffer;
using conformance::DeviceMemory;

constexpr CollectiveKind kKinds[] = {
    CollectiveKind::kAllGather,
    CollectiveKind::kReduceScatter,
    CollectiveKind::kAllReduce,
};
constexpr char kProgram[] = "collectives_bench";
constexpr DType kDType = DType::kFloat32;
constexpr int64_t kMinBytes = int64_t{1} << 10;
constexpr int64_t kMaxBytes = int64_t{1} << 30;

struct Flags {
  std::string backend = "sim";
  int64_t ranks = 8;
  int64_t max_bytes = 0;  // 0: the backend's default
};

// Whose collective a benchmark times.
enum class Impl : int32_t {
  kFlatparam = 0,   // the Communicator
  kRawMpi = 1,      // MPI's own collective on MPI_COMM_WORLD
  kMpiBackend = 2,  // flatparam's MPI backend, next to another backend
  kRawC10d = 3,     // c10d's gloo group itself (--backend=c10d)
};

// One benchmark's buffers on one rank, filled with kExact values (sums
// exact in any order, so every backend's result is checkable).
class Collective {
 public:
  static absl::StatusOr<Collective> Make(Communicator& comm,
                                         DeviceMemory& memory,
                                         CollectiveKind kind, int64_t bytes) {
    Collective c(comm, memory);
    const int n = comm.size();
    c.case_.kind = kind;
    c.case_.dtype = kDType;
    c.case_.values = conformance::Values::kExact;
    c.case_.count = conformance::CountForBytes(kind, bytes, n, kDType);
    c.bytes_ = conformance::CollectiveBytes(kind, c.case_.count, n, kDType);
    FLATPARAM_ASSIGN_OR_RETURN(
        c.input_,
        DeviceBuffer::Allocate(memory, kDType, c.case_.input_count(n)));
    FLATPARAM_ASSIGN_OR_RETURN(
        c.output_,
        DeviceBuffer::Allocate(memory, kDType, c.case_.output_count(n)));
    conformance::HostBuffer host(kDType, c.case_.input_count(n));
    conformance::FillInput(c.case_, comm.rank(), 0, host.ref());
    FLATPARAM_RETURN_IF_ERROR(c.input_.Upload(host));
    FLATPARAM_RETURN_IF_ERROR(c.output_.Fill(0));
    return c;
  }

  int64_t bytes() const { return bytes_; }
  CollectiveKind kind() const { return case_.kind; }

  std::unique_ptr<Work> Issue() {
    switch (case_.kind) {
      case CollectiveKind::kAllGather:
        return comm_->AllGather(input_.ref(), output_.ref(), {});
      case CollectiveKind::kReduceScatter:
        return comm_->ReduceScatter(input_.ref(), output_.ref(), {});
      case CollectiveKind::kAllReduce:
        return comm_->AllReduce(input_.ref(), output_.ref(), {});
      case CollectiveKind::kBroadcast:
        return comm_->Broadcast(output_.ref(), {});
    }
    return CompletedWork(absl::InternalError("unknown collective"));
  }

  // The same collective by `raw` (c10d's own), on this collective's
  // buffers.
  std::unique_ptr<Work> IssueRaw(
      const std::function<std::unique_ptr<Work>(CollectiveKind, const void*,
                                                void*, int64_t)>& raw) {
    return raw(case_.kind, input_.ref().data, output_.ref().data, case_.count);
  }

  // The same collective by MPI itself (host buffers only).
  std::unique_ptr<Work> IssueRawMpi() {
    const int count = static_cast<int>(case_.count);
    void* in = input_.ref().data;
    void* out = output_.ref().data;
    int rc = MPI_SUCCESS;
    switch (case_.kind) {
      case CollectiveKind::kAllGather:
        rc = MPI_Allgather(in, count, MPI_FLOAT, out, count, MPI_FLOAT,
                           MPI_COMM_WORLD);
        break;
      case CollectiveKind::kReduceScatter:
        rc = MPI_Reduce_scatter_block(in, out, count, MPI_FLOAT, MPI_SUM,
                                      MPI_COMM_WORLD);
        break;
      case CollectiveKind::kAllReduce:
        rc = MPI_Allreduce(in, out, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        break;
      case CollectiveKind::kBroadcast:
        rc = MPI_Bcast(out, count, MPI_FLOAT, 0, MPI_COMM_WORLD);
        break;
    }
    return CompletedWork(rc == MPI_SUCCESS ? absl::OkStatus()
                                           : absl::InternalError(absl::StrCat(
                                                 "MPI error ", rc)));
  }

  // Output elements that differ from the expected ones.
  absl::StatusOr<int64_t> Wrong() {
    const conformance::HostBuffer want =
        conformance::ExpectedOutput(case_, comm_->size(), comm_->rank());
    std::vector<char> storage;
    FLATPARAM_ASSIGN_OR_RETURN(
        const void* got,
        conformance::ReadBack(*memory_, output_.ref(), storage));
    int64_t first = -1;
    return conformance::CountMismatches(got, want.data(), want.count(), kDType,
                                        &first);
  }

 private:
  Collective(Communicator& comm, DeviceMemory& memory)
      : comm_(&comm), memory_(&memory) {}

  Communicator* comm_;
  DeviceMemory* memory_;
  CollectiveCase case_;
  int64_t bytes_ = 0;
  DeviceBuffer input_;
  DeviceBuffer output_;
};

double WallSeconds(const IssueFn& issue, absl::Status* status) {
  const auto start = std::chrono::steady_clock::now();
  *status = issue()->Wait();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
      .count();
}

// algbw, busbw, bytes processed and wrong elements.
void SetCounters(benchmark::State& state, CollectiveKind kind, int64_t bytes,
                 int n, double seconds, int64_t wrong) {
  const int64_t iterations = state.iterations();
  state.SetBytesProcessed(bytes * iterations);
  const conformance::Bandwidth bw = conformance::ComputeBandwidth(
      kind, bytes, n, absl::Seconds(iterations > 0 ? seconds / iterations : 0));
  state.counters["algbw"] = benchmark::Counter(
      bw.algbw, benchmark::Counter::kDefaults, benchmark::Counter::kIs1000);
  state.counters["busbw"] = benchmark::Counter(
      bw.busbw, benchmark::Counter::kDefaults, benchmark::Counter::kIs1000);
  state.counters["wrong"] = static_cast<double>(wrong);
  state.counters["ranks"] = n;
}

// ---------------------------------------------------------------------------
// The simulator: one SimWorld per benchmark run, rank 0 drives the loop.

void RunSim(benchmark::State& state, CollectiveKind kind, int64_t bytes,
            int ranks) {
  SimOptions options;
  options.world_size = ranks;
  options.seed = 1;
  absl::StatusOr<std::unique_ptr<SimWorld>> world = SimWorld::Create(options);
  if (!world.ok()) Die(kProgram, world.status());
  // Rank 0 publishes, before each collective, whether it is timed; the
  // others read the flag of a collective once it has completed, which needs
  // rank 0 to have issued it. The last one is an untimed extra.
  std::vector<char> keep;
  double seconds = 0;
  int64_t wrong = 0;
  int64_t size = 0;
  const absl::Status status =
      (*world)->Run([&](Communicator& comm) -> absl::Status {
        FLATPARAM_ASSIGN_OR_RETURN(
            Collective c,
            Collective::Make(comm, conformance::HostMemory(), kind, bytes));
        size = c.bytes();
        FLATPARAM_RETURN_IF_ERROR(comm.Barrier({}));
        const bool driver = comm.rank() == 0;
        for (size_t k = 0;; ++k) {
          if (driver) keep.push_back(state.KeepRunning());
          absl::Status s;
          const double t = WallSeconds([&c] { return c.Issue(); }, &s);
          FLATPARAM_RETURN_IF_ERROR(s);
          if (driver && keep[k]) {
            state.SetIterationTime(t);
            seconds += t;
          }
          if (!keep[k]) break;
        }
        FLATPARAM_ASSIGN_OR_RETURN(const int64_t w, c.Wrong());
        wrong += w;
        return absl::OkStatus();
      });
  if (!status.ok()) {
    state.SkipWithError(std::string(status.message()).c_str());
    return;
  }
  SetCounters(state, kind, size, ranks, seconds, wrong);
}

// ---------------------------------------------------------------------------
// MPI and NCCL: rank 0 runs Google Benchmark, the other ranks follow
// (RunMpiBenchmarks).

struct Context {
  Communicator* comm = nullptr;
  // flatparam's MPI backend, when `comm` is another one (Impl::kMpiBackend).
  Communicator* mpi = nullptr;
  // c10d's own collectives (Impl::kRawC10d).
  std::function<std::unique_ptr<Work>(CollectiveKind, const void*, void*,
                                      int64_t)>
      raw_c10d;
  DeviceMemory* memory = nullptr;
  // Times one collective (wall clock or CUDA events).
  std::function<absl::StatusOr<double>(const IssueFn&)> time;
};

// Runs `iterations` collectives of `kind` and `bytes` by `impl` on this
// rank; `state` is rank 0's, null elsewhere.
void Execute(CollectiveKind kind, Impl impl, int64_t bytes, int64_t iterations,
             Context& context, benchmark::State* state) {
  const bool raw = impl == Impl::kRawMpi;
  Communicator& comm = impl == Impl::kMpiBackend ? *context.mpi : *context.comm;
  absl::StatusOr<Collective> made =
      Collective::Make(comm, *context.memory, kind, bytes);
  // Every rank learns whether every rank could allocate, so none hangs.
  int failed = made.ok() ? 0 : 1;
  int any = 0;
  MPI_Allreduce(&failed, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (any) {
    if (state != nullptr) {
      state->SkipWithError(made.ok()
                               ? "another rank could not allocate its buffers"
                               : std::string(made.status().message()).c_str());
      for (auto _ : *state) {
      }
    }
    return;
  }
  Collective& c = *made;
  double seconds = 0;
  const IssueFn issue = [&c, raw, impl, &context] {
    if (impl == Impl::kRawC10d) return c.IssueRaw(context.raw_c10d);
    return raw ? c.IssueRawMpi() : c.Issue();
  };
  auto once = [&]() -> double {
    absl::StatusOr<double> t = context.time(issue);
    if (!t.ok()) Die(kProgram, t.status());
    seconds += *t;
    return *t;
  };
  MPI_Barrier(MPI_COMM_WORLD);
  RunIterations(state, iterations, once);
  absl::StatusOr<int64_t> wrong = c.Wrong();
  if (!wrong.ok()) Die(kProgram, wrong.status());
  int64_t mine = *wrong;
  int64_t total = 0;
  MPI_Reduce(&mine, &total, 1, MPI_INT64_T, MPI_SUM, 0, MPI_COMM_WORLD);
  if (state != nullptr) {
    SetCounters(*state, kind, c.bytes(), context.comm->size(), seconds, total);
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
  parser.String("backend", &flags.backend, {"sim", "mpi", "c10d", "nccl"});
  parser.Int64("ranks", &flags.ranks, 1);
  parser.Int64("max_bytes", &flags.max_bytes, 1);
  parser.Parse(argc, argv);
  if (flags.max_bytes == 0) {
    flags.max_bytes = flags.backend == "sim" ? int64_t{64} << 20
                      : flags.backend == "mpi" || flags.backend == "c10d"
                          ? int64_t{256} << 20
                          : kMaxBytes;
  }
  return flags;
}

int SimMain(const Flags& flags) {
  for (CollectiveKind kind : kKinds) {
    for (int64_t bytes : Sizes(flags.max_bytes)) {
      benchmark::RegisterBenchmark(
          absl::StrFormat("sim/%s/ranks:%d/bytes:%d",
                          conformance::CollectiveKindName(kind), flags.ranks,
                          bytes)
              .c_str(),
          [kind, bytes, ranks = static_cast<int>(flags.ranks)](
              benchmark::State& state) { RunSim(state, kind, bytes, ranks); })
          ->UseManualTime()
          ->Unit(benchmark::kMicrosecond);
    }
  }
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}

int LocalRank() {
  int rank = 0;
  const char* s = std::getenv("OMPI_COMM_WORLD_LOCAL_RANK");
  return s != nullptr && absl::SimpleAtoi(s, &rank) ? rank : 0;
}

int MpiMain(const Flags& flags, int* argc, char*** argv) {
  absl::StatusOr<MpiSession> session = MpiSession::Start(argc, argv);
  if (!session.ok()) Die(kProgram, session.status());
  {
    absl::StatusOr<std::unique_ptr<MpiCommunicator>> world =
        MpiCommunicator::CreateWorld();
    if (!world.ok()) Die(kProgram, world.status());
    Context context;
    context.comm = world->get();
    context.memory = &conformance::HostMemory();
    context.time = [](const IssueFn& issue) -> absl::StatusOr<double> {
      absl::Status status;
      const double t = WallSeconds(issue, &status);
      if (!status.ok()) return status;
      return t;
    };
    GpuContext gpu;
    std::unique_ptr<Communicator> c10d;
    const bool nccl = flags.backend == "nccl";
    if (flags.backend == "c10d") {
      absl::StatusOr<C10dWorld> made = MakeC10dWorld(**world);
      if (!made.ok()) Die(kProgram, made.status());
      c10d = std::move(made->comm);
      context.raw_c10d = std::move(made->raw);
      context.mpi = context.comm;
      context.comm = c10d.get();
    }
    if (nccl) {
      absl::StatusOr<GpuContext> made = MakeGpuContext(**world, LocalRank());
      if (!made.ok()) {
        // Every rank fails alike (the NCCL bootstrap shares errors).
        if ((*world)->rank() == 0) {
          std::fprintf(stderr, "collectives_bench: %s\n",
                       made.status().ToString().c_str());
        }
        world->reset();
        (void)session->Finish();
        return 1;
      }
      gpu = *std::move(made);
      context.comm = gpu.comm.get();
      context.memory = gpu.memory.get();
      context.time = gpu.time;
    }
    const int n = context.comm->size();
    std::vector<Impl> impls = {Impl::kFlatparam};
    if (c10d != nullptr) {
      impls.push_back(Impl::kRawC10d);
      impls.push_back(Impl::kMpiBackend);
    }
    if (!nccl) impls.push_back(Impl::kRawMpi);
    std::vector<MpiBenchmark> benchmarks;
    for (CollectiveKind kind : kKinds) {
      for (Impl impl : impls) {
        for (int64_t bytes : Sizes(flags.max_bytes)) {
          MpiBenchmark b;
          const std::string name = impl == Impl::kRawMpi       ? "mpi_raw"
                                   : impl == Impl::kMpiBackend ? "mpi"
                                   : impl == Impl::kRawC10d    ? "c10d_raw"
                                                               : flags.backend;
          b.name =
              absl::StrFormat("%s/%s/ranks:%d/bytes:%d", name,
                              conformance::CollectiveKindName(kind), n, bytes);
          b.run = [&context, kind, impl, bytes](benchmark::State* state,
                                                int64_t iterations) {
            Execute(kind, impl, bytes, iterations, context, state);
          };
          b.configure = [](benchmark::internal::Benchmark* r) {
            r->UseManualTime()->Unit(benchmark::kMicrosecond);
          };
          benchmarks.push_back(std::move(b));
        }
      }
    }
    RunMpiBenchmarks(benchmarks);
    gpu = GpuContext();
    context.raw_c10d = nullptr;
    c10d.reset();
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
