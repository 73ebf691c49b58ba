// A whole training step of a realistically shaped model on MPI ranks, with
// and without overlap, next to `fsdp plan`'s prediction for the same model
// and link: issue 10's question whether the runtime overlaps communication
// with compute as the plan says it can.
//
// The model is a preset (--model, default gpt2: 124 M float32 parameters,
// 14 units) laid out FULL_SHARD (--strategy) over the job's ranks. Compute
// is synthetic (refmodel/synthetic_step.h): per unit a kernel of the cost
// model's duration, 2 P T / F forward and twice that backward, with T =
// --tokens per rank and F = --gflops; the kernel either sleeps
// (--kernel=sleep, default: a GPU computing while the CPU is free, so the
// MPI backend's progress thread can move data) or spins (--kernel=spin: the
// CPU is the compute device and the progress thread competes with it).
// FsdpRuntime drives the handles in PyTorch's hook order on HostDeviceOps
// over the MPI backend:
//
//   overlap:1   forward prefetch and BACKWARD_PRE prefetch (depth 1,
//               limit_all_gathers 2), reductions finished in the next
//               unit's post-backward. Forward prefetch because here the
//               kernels run on the host thread: the host cannot run ahead
//               of them as a CPU runs ahead of a GPU, which is what gives
//               the plan's forward (and a GPU trainer's, without forward
//               prefetch) its overlap; PyTorch offers forward_prefetch for
//               the same reason (CPU-bound forwards);
//   overlap:0   no prefetch and every reduction finished at once: one
//               collective or kernel at a time.
//   overlap:1/recorder_cost
//               overlap:1 with and without the flight recorder
//               (MpiOptions::flight_recorder.capacity = 0 on a second
//               world), a step of each back to back: recorded_ms,
//               unrecorded_ms and overhead_pct;
//   fake        overlap:1 with the all-gathers and reduce-scatters skipped
//               (HandleOptions::fake_all_gather / fake_reduce, PyTorch's
//               FSDP_USE_FAKE_*): compute plus the host work alone, which
//               splits the exposed time into host work and communication.
//
// Each benchmark iteration is one step (after an untimed first step, which
// records the execution order), timed on every rank between barriers; the
// reported time is the slowest rank's. Counters (milliseconds per step):
//   compute_ms       the kernels' durations summed (what the plan calls
//                    compute);
//   exposed_ms       step - compute: communication and host work the
//                    compute did not hide;
//   plan_step_ms, plan_exposed_ms
//                    sim/cost_model.h's PredictStep for the same units,
//                    tokens and FLOP/s, overlap as the run, on a one-node
//                    link whose bandwidth and latency are measured in the
//                    same process before the benchmarks: the raw MPI
//                    all-gather of the largest unit's unsharded size
//                    (busbw) and of 4 bytes (latency), medians of 5;
//   link_busbw_GBps  that bandwidth.
// Not in the plan: the host work the handles do on HostDeviceOps (filling
// new gradients with zeros, the reduction's fold and divides, which the
// backend runs on the CPU), so exposed_ms exceeds plan_exposed_ms by about
// that much; with --kernel=spin also the progress thread's contention.
//
//   bazel build -c opt //benchmarks:step_bench
//   mpirun --allow-run-as-root --oversubscribe --bind-to none -np 2
//       bazel-bin/benchmarks/step_bench --benchmark_repetitions=3
//
// Flags: --model=PRESET, --strategy=FULL_SHARD|SHARD_GRAD_OP|NO_SHARD,
// --tokens=N (default 256), --gflops=N (default 100), --kernel=sleep|spin.
#include <benchmark/benchmark.h>
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "benchmarks/mpi_bench_driver.h"
#include "comm/communicator.h"
#include "comm/mpi/mpi_communicator.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/device/device.h"
#include "flatparam/flatten.h"
#include "flatparam/layout.h"
#include "flatparam/model_layout.h"
#include "flatparam/presets.h"
#include "flatparam/runtime.h"
#include "refmodel/synthetic_step.h"
#include "sim/cost_model.h"

namespace flatparam {
namespace bench {
namespace {

constexpr char kProgram[] = "step_bench";

struct Flags {
  std::string model = "gpt2";
  std::string strategy = "FULL_SHARD";
  int64_t tokens = 256;
  int64_t gflops = 100;
  std::string kernel = "sleep";
};

Flags ParseFlags(int* argc, char** argv) {
  Flags flags;
  BenchFlags parser(kProgram);
  parser.String("model", &flags.model);
  parser.String("strategy", &flags.strategy,
                {"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"});
  parser.Int64("tokens", &flags.tokens, 1);
  parser.Int64("gflops", &flags.gflops, 1);
  parser.String("kernel", &flags.kernel, {"sleep", "spin"});
  parser.Parse(argc, argv);
  return flags;
}

double Now() {
  return std::chrono::duration<double>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

double MaxOverRanks(double value) {
  double out = 0;
  MPI_Allreduce(&value, &out, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return out;
}

// Median seconds of 5 raw all-gathers of `bytes` (the output) on `comm`.
absl::StatusOr<double> TimeAllGather(Communicator& comm, int64_t bytes) {
  const int64_t n = comm.size();
  const int64_t count = std::max<int64_t>(1, bytes / 4 / n);
  std::vector<float> in(count, 1.0f), out(count * n);
  const ConstBufferRef input{in.data(), count, DType::kFloat32};
  const BufferRef output{out.data(), count * n, DType::kFloat32};
  FLATPARAM_RETURN_IF_ERROR(comm.AllGather(input, output, {})->Wait());
  std::vector<double> times;
  for (int i = 0; i < 5; ++i) {
    MPI_Barrier(MPI_COMM_WORLD);
    const double start = Now();
    FLATPARAM_RETURN_IF_ERROR(comm.AllGather(input, output, {})->Wait());
    times.push_back(MaxOverRanks(Now() - start));
  }
  std::sort(times.begin(), times.end());
  return times[2];
}

// The link as the plan sees it, measured: one node of `comm.size()` ranks.
absl::StatusOr<cost::LinkSpec> MeasureLink(Communicator& comm,
                                           int64_t largest_bytes) {
  const int n = comm.size();
  FLATPARAM_ASSIGN_OR_RETURN(const double small,
                             TimeAllGather(comm, 4 * int64_t{n}));
  FLATPARAM_ASSIGN_OR_RETURN(const double large,
                             TimeAllGather(comm, largest_bytes));
  cost::LinkSpec link;
  link.nodes = 1;
  link.gpus_per_node = n;
  // A ring all-gather takes (n - 1) steps: latency per step, and the bytes
  // each rank passes on, S (n - 1) / n, at busbw.
  link.intra_latency_s = n > 1 ? small / (n - 1) : 0;
  const double moved = static_cast<double>(largest_bytes) * (n - 1) / n;
  link.intra_bytes_per_second =
      n > 1 ? moved / std::max(1e-9, large - small) : 1e12;
  return link;
}

struct Setup {
  Flags flags;
  ModelLayout layout;
  std::map<std::string, HostTensor> init;
  std::vector<absl::Duration> forward;
  cost::LinkSpec link;
  double compute_seconds = 0;
};

absl::StatusOr<Setup> MakeSetup(const Flags& flags, Communicator& comm) {
  FLATPARAM_ASSIGN_OR_RETURN(ModelSpec spec, PresetModel(flags.model));
  for (ParamSpec& p : spec.params) p.dtype = DType::kFloat32;
  LayoutOptions lo;
  lo.world_size = comm.size();
  FLATPARAM_ASSIGN_OR_RETURN(lo.strategy,
                             ParseShardingStrategy(flags.strategy));
  FLATPARAM_ASSIGN_OR_RETURN(ModelLayout layout, ModelLayout::Create(spec, lo));
  Setup s{flags, std::move(layout), {}, {}, {}, 0};
  for (const ParamSpec& p : s.layout.spec().params) {
    if (!p.tied_to.empty()) continue;
    HostTensor t(DType::kFloat32, p.shape);
    for (int64_t k = 0; k < t.numel(); ++k) t.SetDouble(k, 0.001 * (k % 7));
    s.init.emplace(p.fqn, std::move(t));
  }
  FLATPARAM_ASSIGN_OR_RETURN(s.forward,
                             refmodel::SyntheticForwardTimes(
                                 s.layout, static_cast<double>(flags.tokens),
                                 static_cast<double>(flags.gflops) * 1e9));
  for (absl::Duration d : s.forward) {
    s.compute_seconds += 3 * absl::ToDoubleSeconds(d);
  }
  int64_t largest = 0;
  for (const FlatParamLayout& l : s.layout.flat_params()) {
    largest = std::max(largest, l.padded_unsharded_numel() * 4);
  }
  FLATPARAM_ASSIGN_OR_RETURN(s.link, MeasureLink(comm, largest));
  return s;
}

absl::StatusOr<cost::StepPrediction> Plan(const Setup& s, bool overlap) {
  cost::StepOptions o;
  o.strategy = s.layout.options().strategy;
  o.link = s.link;
  o.tokens_per_rank = static_cast<double>(s.flags.tokens);
  o.peak_flops = static_cast<double>(s.flags.gflops) * 1e9;
  o.efficiency = 1;
  o.overlap = overlap;
  o.backward_prefetch = overlap;
  o.max_inflight_all_gathers = 2;
  return cost::PredictStep(cost::UnitsOf(s.layout), o);
}

// One runtime on `comm` and a function that runs one timed step of it
// (the slowest rank's seconds).
struct Stepper {
  HostDeviceOps ops;
  std::unique_ptr<FsdpRuntime> runtime;
  std::function<double()> step;
};

std::unique_ptr<Stepper> MakeStepper(const Setup& s, Communicator& comm,
                                     bool overlap, bool fake) {
  auto stepper = std::make_unique<Stepper>();
  std::map<std::string, ConstBufferRef> refs;
  for (const auto& [fqn, t] : s.init) refs[fqn] = t.cref();
  HostDeviceOps& ops = stepper->ops;
  RuntimeOptions options;
  options.forward_prefetch = overlap;
  options.backward_prefetch =
      overlap ? BackwardPrefetch::kBackwardPre : BackwardPrefetch::kNone;
  HandleOptions handle_options;
  handle_options.fake_all_gather = fake;
  handle_options.fake_reduce = fake;
  absl::StatusOr<std::unique_ptr<FsdpRuntime>> rt =
      FsdpRuntime::CreateFromNamedParams(s.layout, refs, &comm, &ops,
                                         handle_options, options);
  if (!rt.ok()) Die(kProgram, rt.status());
  const bool spin = s.flags.kernel == "spin";
  const refmodel::KernelFn kernel =
      [spin](const refmodel::KernelCall& call) -> absl::Status {
    if (spin) return refmodel::SpinKernel(call);
    std::this_thread::sleep_for(absl::ToChronoNanoseconds(call.duration));
    return absl::OkStatus();
  };
  stepper->runtime = *std::move(rt);
  FsdpRuntime* runtime = stepper->runtime.get();
  const Setup* setup = &s;
  stepper->step = [runtime, setup, kernel, overlap]() -> double {
    MPI_Barrier(MPI_COMM_WORLD);
    const double start = Now();
    absl::Status done =
        refmodel::RunSyntheticStep(*runtime, setup->forward, kernel, !overlap);
    if (done.ok()) done = runtime->ZeroGrad();
    if (!done.ok()) Die(kProgram, done);
    return MaxOverRanks(Now() - start);
  };
  stepper->step();  // records the execution order
  return stepper;
}

void Run(const Setup& s, Communicator& comm, bool overlap, bool fake,
         benchmark::State* state, int64_t iterations) {
  std::unique_ptr<Stepper> stepper = MakeStepper(s, comm, overlap, fake);
  const std::function<double()>& step = stepper->step;
  double total = 0;
  RunIterations(state, iterations, [&]() -> double {
    const double t = step();
    total += t;
    return t;
  });
  if (state == nullptr) return;
  absl::StatusOr<cost::StepPrediction> plan = Plan(s, overlap);
  if (!plan.ok()) Die(kProgram, plan.status());
  const double per_step = total / static_cast<double>(iterations);
  auto ms = [](double seconds) { return seconds * 1e3; };
  state->counters["compute_ms"] = ms(s.compute_seconds);
  state->counters["exposed_ms"] = ms(per_step - s.compute_seconds);
  state->counters["plan_step_ms"] = ms(plan->step_seconds);
  state->counters["plan_exposed_ms"] = ms(plan->exposed_comm_seconds);
  state->counters["step_vs_plan"] = per_step / plan->step_seconds;
  state->counters["link_busbw_GBps"] = s.link.intra_bytes_per_second / 1e9;
  state->counters["link_latency_us"] = s.link.intra_latency_s * 1e6;
}

// The flight recorder's cost: each iteration times a step on a world with
// the recorder and one on a world without it, back to back (so that both
// see the same machine state), and reports the recorded step's time;
// counters recorded_ms, unrecorded_ms (means) and overhead_pct.
void RunRecorderCost(const Setup& s, Communicator& recorded,
                     Communicator& unrecorded, benchmark::State* state,
                     int64_t iterations) {
  std::unique_ptr<Stepper> on = MakeStepper(s, recorded, true, false);
  std::unique_ptr<Stepper> off = MakeStepper(s, unrecorded, true, false);
  double total_on = 0;
  double total_off = 0;
  RunIterations(state, iterations, [&]() -> double {
    total_off += off->step();
    const double t = on->step();
    total_on += t;
    return t;
  });
  if (state == nullptr) return;
  const double n = static_cast<double>(iterations);
  state->counters["recorded_ms"] = total_on / n * 1e3;
  state->counters["unrecorded_ms"] = total_off / n * 1e3;
  state->counters["overhead_pct"] = (total_on / total_off - 1) * 100;
}

int Main(int argc, char** argv) {
  const Flags flags = ParseFlags(&argc, argv);
  benchmark::Initialize(&argc, argv);
  absl::StatusOr<MpiSession> session = MpiSession::Start(&argc, &argv);
  if (!session.ok()) Die(kProgram, session.status());
  {
    absl::StatusOr<std::unique_ptr<MpiCommunicator>> world =
        MpiCommunicator::CreateWorld();
    if (!world.ok()) Die(kProgram, world.status());
    Communicator& comm = **world;
    // The same world without a flight recorder: the recorder's cost is
    // the overlap:1 row's time over this one's.
    MpiOptions unrecorded_options;
    unrecorded_options.flight_recorder.capacity = 0;
    absl::StatusOr<std::unique_ptr<MpiCommunicator>> unrecorded =
        MpiCommunicator::Wrap(MPI_COMM_WORLD, unrecorded_options);
    if (!unrecorded.ok()) Die(kProgram, unrecorded.status());
    absl::StatusOr<Setup> setup = MakeSetup(flags, comm);
    if (!setup.ok()) Die(kProgram, setup.status());
    std::vector<MpiBenchmark> benchmarks;
    for (const auto& [overlap, fake] :
         {std::make_pair(true, false), std::make_pair(false, false),
          std::make_pair(true, true)}) {
      MpiBenchmark b;
      b.name =
          absl::StrFormat("mpi/step/%s/%s/ranks:%d/kernel:%s/%s", flags.model,
                          flags.strategy, comm.size(), flags.kernel,
                          fake      ? "fake"
                          : overlap ? "overlap:1"
                                    : "overlap:0");
      b.run = [&comm, &setup, overlap = overlap, fake = fake](
                  benchmark::State* state, int64_t iterations) {
        Run(*setup, comm, overlap, fake, state, iterations);
      };
      b.configure = [](benchmark::internal::Benchmark* r) {
        r->UseManualTime()->Unit(benchmark::kMillisecond)->Iterations(5);
      };
      benchmarks.push_back(std::move(b));
    }
    MpiBenchmark recorder;
    recorder.name = absl::StrFormat(
        "mpi/step/%s/%s/ranks:%d/kernel:%s/overlap:1/recorder_cost",
        flags.model, flags.strategy, comm.size(), flags.kernel);
    recorder.run = [&comm, &unrecorded, &setup](benchmark::State* state,
                                                int64_t iterations) {
      RunRecorderCost(*setup, comm, **unrecorded, state, iterations);
    };
    recorder.configure = [](benchmark::internal::Benchmark* r) {
      r->UseManualTime()->Unit(benchmark::kMillisecond)->Iterations(5);
    };
    benchmarks.push_back(std::move(recorder));
    RunMpiBenchmarks(benchmarks);
  }
  const absl::Status finished = session->Finish();
  if (!finished.ok()) Die(kProgram, finished);
  return 0;
}

}  // namespace
}  // namespace bench
}  // namespace flatparam

int main(int argc, char** argv) { return flatparam::bench::Main(argc, argv); }
