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
//   # NCCL, one GPU per rank (the node-local rank), CUDA-event timing.
//   mpirun -np 8 bazel-bin/benchmarks/collectives_bench --backend=nccl
//
// Flags (besides Google Benchmark's):
//   --backend=sim|mpi|nccl  default sim
//   --ranks=N               sim only: ranks in the world (default 8)
//   --max_bytes=B           the largest size; default per backend: sim
//                           64 MiB (8 ranks x an output and an input buffer
//                           of up to 64 MiB, with the simulator's own
//                           staging, stays well under 8 GiB), mpi 256 MiB
//                           (4 processes x about 1.5 GiB for all_reduce's
//                           buffers and MPI's staging), nccl 1 GiB.
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
// broadcasts each benchmark run (op, size, iterations) over MPI_COMM_WORLD
// before it starts, and the other ranks run exactly that, then report their
// wrong elements with MPI_Reduce.
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
#include "absl/strings/strip.h"
#include "benchmarks/collectives_bench_gpu.h"
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
constexpr DType kDType = DType::kFloat32;
constexpr int64_t kMinBytes = int64_t{1} << 10;
constexpr int64_t kMaxBytes = int64_t{1} << 30;

struct Flags {
  std::string backend = "sim";
  int ranks = 8;
  int64_t max_bytes = 0;  // 0: the backend's default
};

// Whose collective a benchmark times.
enum class Impl : int32_t {
  kFlatparam = 0,  // the Communicator
  kRawMpi = 1,     // MPI's own collective on MPI_COMM_WORLD
};

[[noreturn]] void Die(const absl::Status& status) {
  std::fprintf(stderr, "collectives_bench: %s\n", status.ToString().c_str());
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (initialized) MPI_Abort(MPI_COMM_WORLD, 1);
  std::exit(1);
}

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
  if (!world.ok()) Die(world.status());
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
// MPI and NCCL: rank 0 runs Google Benchmark and broadcasts each run.

struct Command {
  int32_t kind = -1;  // a CollectiveKind; -1: no more benchmarks
  int32_t impl = 0;
  int64_t bytes = 0;
  int64_t iterations = 0;
};

struct Context {
  Communicator* comm = nullptr;
  DeviceMemory* memory = nullptr;
  // Times one collective (wall clock or CUDA events).
  std::function<absl::StatusOr<double>(const IssueFn&)> time;
};

// Runs `command` on this rank; `state` is rank 0's, null elsewhere.
void Execute(const Command& command, Context& context,
             benchmark::State* state) {
  const CollectiveKind kind = static_cast<CollectiveKind>(command.kind);
  const bool raw = static_cast<Impl>(command.impl) == Impl::kRawMpi;
  absl::StatusOr<Collective> made =
      Collective::Make(*context.comm, *context.memory, kind, command.bytes);
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
  const IssueFn issue = [&c, raw] { return raw ? c.IssueRawMpi() : c.Issue(); };
  auto once = [&]() -> double {
    absl::StatusOr<double> t = context.time(issue);
    if (!t.ok()) Die(t.status());
    return *t;
  };
  MPI_Barrier(MPI_COMM_WORLD);
  double seconds = 0;
  if (state != nullptr) {
    for (auto _ : *state) {
      const double t = once();
      state->SetIterationTime(t);
      seconds += t;
    }
  } else {
    for (int64_t i = 0; i < command.iterations; ++i) once();
  }
  absl::StatusOr<int64_t> wrong = c.Wrong();
  if (!wrong.ok()) Die(wrong.status());
  int64_t mine = *wrong;
  int64_t total = 0;
  MPI_Reduce(&mine, &total, 1, MPI_INT64_T, MPI_SUM, 0, MPI_COMM_WORLD);
  if (state != nullptr) {
    SetCounters(*state, kind, c.bytes(), context.comm->size(), seconds, total);
  }
}

void Broadcast(Command& command) {
  MPI_Bcast(&command, sizeof(command), MPI_BYTE, 0, MPI_COMM_WORLD);
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
  int out = 1;
  for (int i = 1; i < *argc; ++i) {
    absl::string_view arg = argv[i];
    bool ok = true;
    if (absl::ConsumePrefix(&arg, "--backend=")) {
      flags.backend = std::string(arg);
      ok = arg == "sim" || arg == "mpi" || arg == "nccl";
    } else if (absl::ConsumePrefix(&arg, "--ranks=")) {
      ok = absl::SimpleAtoi(arg, &flags.ranks) && flags.ranks >= 1;
    } else if (absl::ConsumePrefix(&arg, "--max_bytes=") ||
               absl::ConsumePrefix(&arg, "--max-bytes=")) {
      ok = absl::SimpleAtoi(arg, &flags.max_bytes) && flags.max_bytes >= 1;
    } else {
      argv[out++] = argv[i];
      continue;
    }
    if (!ok) {
      std::fprintf(stderr,
                   "collectives_bench: bad flag %s (expected --backend=sim|"
                   "mpi|nccl, --ranks=N >= 1, --max_bytes=B >= 1)\n",
                   argv[i]);
      std::exit(2);
    }
  }
  *argc = out;
  if (flags.max_bytes == 0) {
    flags.max_bytes = flags.backend == "sim"   ? int64_t{64} << 20
                      : flags.backend == "mpi" ? int64_t{256} << 20
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
          [kind, bytes, ranks = flags.ranks](benchmark::State& state) {
            RunSim(state, kind, bytes, ranks);
          })
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
  if (!session.ok()) Die(session.status());
  {
    absl::StatusOr<std::unique_ptr<MpiCommunicator>> world =
        MpiCommunicator::CreateWorld();
    if (!world.ok()) Die(world.status());
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
    const bool nccl = flags.backend == "nccl";
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
    if ((*world)->rank() != 0) {
      for (;;) {
        Command command;
        Broadcast(command);
        if (command.kind < 0) break;
        Execute(command, context, nullptr);
      }
    } else {
      std::vector<Impl> impls = {Impl::kFlatparam};
      if (!nccl) impls.push_back(Impl::kRawMpi);
      for (CollectiveKind kind : kKinds) {
        for (Impl impl : impls) {
          for (int64_t bytes : Sizes(flags.max_bytes)) {
            const std::string name =
                impl == Impl::kRawMpi
                    ? absl::StrFormat("mpi_raw/%s/ranks:%d/bytes:%d",
                                      conformance::CollectiveKindName(kind), n,
                                      bytes)
                    : absl::StrFormat("%s/%s/ranks:%d/bytes:%d", flags.backend,
                                      conformance::CollectiveKindName(kind), n,
                                      bytes);
            benchmark::RegisterBenchmark(
                name.c_str(),
                [&context, kind, impl, bytes](benchmark::State& state) {
                  Command command;
                  command.kind = static_cast<int32_t>(kind);
                  command.impl = static_cast<int32_t>(impl);
                  command.bytes = bytes;
                  command.iterations = state.max_iterations;
                  Broadcast(command);
                  Execute(command, context, &state);
                })
                ->UseManualTime()
                ->Unit(benchmark::kMicrosecond);
          }
        }
      }
      benchmark::RunSpecifiedBenchmarks();
      benchmark::Shutdown();
      Command done;
      Broadcast(done);
    }
    gpu = GpuContext();
  }
  const absl::Status finished = session->Finish();
  if (!finished.ok()) Die(finished);
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
