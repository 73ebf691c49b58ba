// GPU benchmarks on one CUDA device, one process, no MPI: each figure next
// to a physical baseline measured in the same run, as a `vs_baseline`
// counter (the benchmark's time per iteration divided by the baseline's for
// the same bytes; 1.0 = as fast as the hardware path, higher = slower).
//
//   copy_d2d/memcpy              cudaMemcpyAsync device-to-device (baseline)
//   copy_d2d/device_ops          DeviceOps::Copy of the same bytes on the
//                                GPU (CudaDeviceOps: the copy that flatten,
//                                shard and unshard issue on device)
//   copy_d2d/device_ops_16views  the same bytes as 16 Copy calls into
//                                consecutive views (flattening 16 params)
//       baseline of the three: copy_d2d/memcpy of the same bytes.
//   h2d/memcpy_pinned, d2h/memcpy_pinned
//                                cudaMemcpyAsync between pinned host memory
//                                and the device (baselines)
//   h2d/device_ops:1, d2h/device_ops:1
//                                DeviceOps::Copy between pinned host memory
//                                and the device (CPU offload's copies), the
//                                copy on the GPU: events around the
//                                cudaMemcpyAsync that CudaDeviceOps issues
//                                (TimedCudaRuntime), its host waits before
//                                and after outside them; baseline: the
//                                pinned cudaMemcpy.
//   h2d/device_ops:2, d2h/device_ops:2
//                                the same Copy as its caller waits for it:
//                                events around the whole synchronous call,
//                                its host waits and their polling included;
//                                baseline: the pinned cudaMemcpy.
//   nccl/all_gather, nccl/reduce_scatter
//                                NcclCommunicator at world size 1 (the
//                                latency floor of the collective path);
//                                baseline: copy_d2d/memcpy of the same bytes
//                                (at one rank both are a copy).
//   handle/unshard_reshard, handle/reduce_grad
//                                FlatParamHandle on CUDA (CudaDeviceOps and
//                                a one-rank NcclCommunicator, SHARD_GRAD_OP,
//                                one float32 parameter); baselines: the bare
//                                Communicator::AllGather / ReduceScatter of
//                                the same bytes, wall time alike.
//
//   step/overlap:1, step/overlap:0
//                                one training step of the gpt2 preset
//                                (124 M float32 parameters, 14 units,
//                                FULL_SHARD at world size 1) through
//                                FsdpRuntime on CudaDeviceOps and the
//                                one-rank NCCL communicator, its compute
//                                synthetic kernels on the compute stream
//                                (refmodel/synthetic_step.h: 2 P T / F per
//                                unit forward, twice that backward, T =
//                                2048 tokens, F = 100 TFLOP/s; spin_kernel.h
//                                spins for that long on the GPU, so the
//                                host runs ahead as with real kernels);
//                                overlap:1 with BACKWARD_PRE prefetch,
//                                overlap:0 without prefetch and each
//                                reduction finished at once. Baseline: the
//                                plan (sim/cost_model.h's PredictStep for
//                                the same units, tokens and FLOP/s at world
//                                size 1, which has no communication): the
//                                counters compute_ms, exposed_ms (step -
//                                compute: the copies, kernels and host
//                                work the compute did not hide),
//                                plan_step_ms, step_vs_plan. Wall time of
//                                the step to the device's idle, 5 steps
//                                after one that records the order.
//
// Timing. Copies and collectives: UseManualTime with CUDA events on the
// stream the work runs on, recorded immediately around it (for collectives
// around the NCCL call itself, TimedNcclApi, as nccl-tests does); the
// copy_d2d DeviceOps rows include DeviceOps' own host-side enqueue, which
// is the library's cost. Host<->device DeviceOps copies are synchronous by
// contract, so they have two rows: device_ops:1 times the copy on the GPU
// alone (as the baseline is timed), device_ops:2 the whole call, whose
// host wait polls (flatparam/base/backoff.h) with sleeps of at most 1/16
// of the time waited so far, so it finds the copy done at most about 6%
// (or 10 us) late; that lateness is the library's cost to a caller.
// Handle rows: wall time of the round trip including its device
// synchronization (the handle issues work on several streams), and so is
// their baseline, whose Wait polls the same way. Sizes 1 MiB to 256 MiB
// (--max_bytes caps them; x4 steps). Counters: bytes_per_second
// (SetBytesProcessed), algbw and busbw for the collectives (nccl-tests'
// factors: at n = 1 busbw is 0), median_us and vs_baseline: the median
// iteration over the median baseline, the same statistic on both sides. Before
// the first row, 200 ms of device work warms the GPU up. Every host wait is
// bounded (kHostWaitLimit).
//
//   bazel build -c opt //benchmarks:gpu_bench
//   bazel-bin/benchmarks/gpu_bench --benchmark_min_time=0.1
//
// A benchmark that cannot run (no usable GPU, a CUDA or NCCL error) is
// skipped with the reason (SkipWithError) and the binary exits 1 at the
// end; tools/gpu/run.sh runs it.
#include <benchmark/benchmark.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/time.h"
#include "benchmarks/bench_flags.h"
#include "benchmarks/spin_kernel.h"
#include "benchmarks/timed_cuda_runtime.h"
#include "benchmarks/timed_nccl_api.h"
#include "comm/communicator.h"
#include "comm/conformance/bandwidth.h"
#include "comm/nccl/nccl_api.h"
#include "comm/nccl/nccl_communicator.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/device/cuda/cuda_device_ops.h"
#include "flatparam/device/cuda/cuda_runtime.h"
#include "flatparam/device/device.h"
#include "flatparam/handle.h"
#include "flatparam/layout.h"
#include "flatparam/model_layout.h"
#include "flatparam/presets.h"
#include "flatparam/runtime.h"
#include "refmodel/synthetic_step.h"
#include "sim/cost_model.h"

namespace flatparam {
namespace bench {
namespace {

constexpr int64_t kMinBytes = int64_t{1} << 20;
constexpr int64_t kMaxBytes = int64_t{256} << 20;
constexpr int kDevice = 0;
// Baseline timings per benchmark run: the median of this many.
constexpr int kBaselineRuns = 9;
// The longest any host wait of the benchmarks may take: the slowest row
// (256 MiB, a handle round trip) takes milliseconds.
constexpr absl::Duration kHostWaitLimit = absl::Seconds(60);

// Benchmarks that could not run (SkipWithError), for the exit status.
int failures = 0;

void Fail(benchmark::State& state, const absl::Status& status) {
  ++failures;
  state.SkipWithError(status.ToString().c_str());
}

absl::Status Cuda(cudaError_t e, absl::string_view what) {
  return CudaStatus(RealCudaRuntime(), e, what);
}

TimedNcclApi& BenchNcclApi() {
  static TimedNcclApi* const api =
      new TimedNcclApi(RealNcclApi(), RealCudaRuntime());
  return *api;
}

// Everything the benchmarks share, created once: the CUDA ops, a one-rank
// NCCL communicator on their device, and two timing events. Never
// destroyed (the process ends after the benchmarks).
struct Gpu {
  // The runtime under `ops`: the real one, with copies that can be timed.
  std::unique_ptr<TimedCudaRuntime> cuda;
  std::unique_ptr<CudaDeviceOps> ops;
  std::unique_ptr<NcclCommunicator> comm;
  cudaStream_t stream = nullptr;  // ops' stream 0
  cudaEvent_t start = nullptr;
  cudaEvent_t stop = nullptr;
};

absl::StatusOr<Gpu*> MakeGpu() {
  int count = 0;
  FLATPARAM_RETURN_IF_ERROR(
      Cuda(cudaGetDeviceCount(&count), "no usable GPU: cudaGetDeviceCount"));
  if (count == 0) return absl::FailedPreconditionError("no usable GPU: none");
  auto gpu = std::make_unique<Gpu>();
  gpu->cuda = std::make_unique<TimedCudaRuntime>(RealCudaRuntime());
  FLATPARAM_ASSIGN_OR_RETURN(
      gpu->ops,
      CudaDeviceOps::Create(kDevice, nullptr, nullptr, gpu->cuda.get()));
  gpu->stream = gpu->ops->stream();
  FLATPARAM_RETURN_IF_ERROR(Cuda(cudaSetDevice(kDevice), "cudaSetDevice"));
  FLATPARAM_RETURN_IF_ERROR(Cuda(cudaEventCreate(&gpu->start), "event"));
  FLATPARAM_RETURN_IF_ERROR(Cuda(cudaEventCreate(&gpu->stop), "event"));
  ncclComm_t comm = nullptr;
  int devices[] = {kDevice};
  FLATPARAM_RETURN_IF_ERROR(NcclStatus(RealNcclApi(),
                                       ncclCommInitAll(&comm, 1, devices),
                                       nullptr, "ncclCommInitAll (one rank)"));
  FLATPARAM_ASSIGN_OR_RETURN(
      gpu->comm,
      NcclCommunicator::Wrap(BenchNcclApi(), RealCudaRuntime(), comm,
                             NcclCommunicator::Ownership::kTakeOwnership));
  // Every host wait ends within kHostWaitLimit, aborting the communicator,
  // instead of blocking in the driver behind device work that never
  // finishes (tools/gpu/run.sh has a budget to keep).
  NcclCommunicator* nccl = gpu->comm.get();
  gpu->ops->SetHostWaitLimit(kHostWaitLimit, [nccl](absl::string_view what) {
    absl::Status error = absl::DeadlineExceededError(absl::StrFormat(
        "gpu_bench: %s did not complete within %s; aborted the NCCL "
        "communicator",
        what, absl::FormatDuration(kHostWaitLimit)));
    nccl->Abort(error);
    return error;
  });
  // Warm-up: 200 ms of device work before the first row, so that the
  // GPU's clocks have left their idle state when timing starts.
  FLATPARAM_RETURN_IF_ERROR(
      Cuda(LaunchSpinKernel(gpu->stream, 200 * 1000 * 1000), "warm-up spin"));
  FLATPARAM_RETURN_IF_ERROR(gpu->ops->Synchronize());
  return gpu.release();
}

// The process's GPU, made on first use; its error when there is none.
absl::StatusOr<Gpu*>& TheGpu() {
  static absl::StatusOr<Gpu*>* const gpu = new absl::StatusOr<Gpu*>(MakeGpu());
  return *gpu;
}

// Seconds between events recorded on `stream` around `enqueue`.
absl::StatusOr<double> EventTime(Gpu& gpu, cudaStream_t stream,
                                 const std::function<absl::Status()>& enqueue) {
  FLATPARAM_RETURN_IF_ERROR(
      Cuda(cudaEventRecord(gpu.start, stream), "cudaEventRecord"));
  FLATPARAM_RETURN_IF_ERROR(enqueue());
  FLATPARAM_RETURN_IF_ERROR(
      Cuda(cudaEventRecord(gpu.stop, stream), "cudaEventRecord"));
  FLATPARAM_RETURN_IF_ERROR(
      Cuda(cudaEventSynchronize(gpu.stop), "cudaEventSynchronize"));
  float ms = 0;
  FLATPARAM_RETURN_IF_ERROR(Cuda(cudaEventElapsedTime(&ms, gpu.start, gpu.stop),
                                 "cudaEventElapsedTime"));
  return ms * 1e-3;
}

// Seconds of the one cudaMemcpyAsync that `copy` issues through gpu.cuda
// (CudaDeviceOps' own), between events around it; waits for it.
absl::StatusOr<double> DeviceCopyTime(
    Gpu& gpu, const std::function<absl::Status()>& copy) {
  FLATPARAM_RETURN_IF_ERROR(gpu.cuda->Arm(kDevice));
  FLATPARAM_RETURN_IF_ERROR(copy());
  return gpu.cuda->ElapsedSeconds();
}

// Seconds of one NCCL collective that `issue` starts on gpu.comm, between
// events around the NCCL call (TimedNcclApi); waits for it.
absl::StatusOr<double> CollectiveTime(
    Gpu& gpu, const std::function<std::unique_ptr<Work>()>& issue) {
  FLATPARAM_RETURN_IF_ERROR(BenchNcclApi().Arm(kDevice));
  std::unique_ptr<Work> work = issue();
  FLATPARAM_RETURN_IF_ERROR(work->Wait());
  return BenchNcclApi().ElapsedSeconds();
}

absl::StatusOr<double> WallTime(const std::function<absl::Status()>& run) {
  const auto t0 = std::chrono::steady_clock::now();
  FLATPARAM_RETURN_IF_ERROR(run());
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
      .count();
}

double MedianOf(std::vector<double> t) {
  if (t.empty()) return 0;
  std::nth_element(t.begin(), t.begin() + t.size() / 2, t.end());
  return t[t.size() / 2];
}

// The median of kBaselineRuns timings (after one untimed warm-up).
absl::StatusOr<double> Median(
    const std::function<absl::StatusOr<double>()>& time) {
  FLATPARAM_RETURN_IF_ERROR(time().status());
  std::vector<double> t;
  for (int i = 0; i < kBaselineRuns; ++i) {
    FLATPARAM_ASSIGN_OR_RETURN(double s, time());
    t.push_back(s);
  }
  return MedianOf(std::move(t));
}

// Runs the benchmark loop: `time` measures one iteration, `baseline` one
// run of the physical baseline (its median is taken first). Sets
// SetBytesProcessed(bytes) per iteration and vs_baseline, the median
// iteration over the median baseline (the same statistic on both sides);
// `kind`, when set, adds algbw/busbw for a collective of `bytes` on one
// rank, from the median iteration.
void Loop(benchmark::State& state, int64_t bytes,
          const std::function<absl::StatusOr<double>()>& time,
          const std::function<absl::StatusOr<double>()>& baseline,
          const conformance::CollectiveKind* kind = nullptr) {
  absl::StatusOr<double> base = Median(baseline);
  if (!base.ok()) {
    Fail(state, base.status());
    return;
  }
  std::vector<double> times;
  for (auto _ : state) {
    absl::StatusOr<double> t = time();
    if (!t.ok()) {
      Fail(state, t.status());
      return;
    }
    state.SetIterationTime(*t);
    times.push_back(*t);
  }
  const int64_t n = state.iterations();
  state.SetBytesProcessed(bytes * n);
  const double per = MedianOf(std::move(times));
  state.counters["median_us"] = per * 1e6;
  state.counters["vs_baseline"] = *base > 0 ? per / *base : 0;
  state.counters["baseline_us"] = *base * 1e6;
  if (kind != nullptr) {
    const conformance::Bandwidth bw = conformance::ComputeBandwidth(
        *kind, bytes, /*n=*/1, absl::Seconds(per));
    state.counters["algbw"] = benchmark::Counter(
        bw.algbw, benchmark::Counter::kDefaults, benchmark::Counter::kIs1000);
    state.counters["busbw"] = benchmark::Counter(
        bw.busbw, benchmark::Counter::kDefaults, benchmark::Counter::kIs1000);
  }
}

// Device buffers of `bytes` as float32 on gpu.ops; the state is skipped
// (and null returned) on failure.
struct Buffers {
  DeviceBuffer a, b;
  BufferRef a_ref() const { return a.As(DType::kFloat32); }
  BufferRef b_ref() const { return b.As(DType::kFloat32); }
};

Gpu* GpuOrSkip(benchmark::State& state) {
  absl::StatusOr<Gpu*>& gpu = TheGpu();
  if (!gpu.ok()) {
    Fail(state, gpu.status());
    return nullptr;
  }
  return *gpu;
}

absl::StatusOr<Buffers> Allocate(Gpu& gpu, Device a, Device b, int64_t bytes) {
  Buffers buf;
  FLATPARAM_ASSIGN_OR_RETURN(buf.a, gpu.ops->Allocate(a, bytes, true));
  FLATPARAM_ASSIGN_OR_RETURN(buf.b, gpu.ops->Allocate(b, bytes, true));
  FLATPARAM_RETURN_IF_ERROR(gpu.ops->Fill(buf.a_ref(), 1.0));
  FLATPARAM_RETURN_IF_ERROR(gpu.ops->Fill(buf.b_ref(), 0.0));
  FLATPARAM_RETURN_IF_ERROR(gpu.ops->Synchronize());
  return buf;
}

std::function<absl::StatusOr<double>()> MemcpyTime(Gpu& gpu, void* dst,
                                                   const void* src,
                                                   int64_t bytes,
                                                   cudaMemcpyKind kind) {
  return [&gpu, dst, src, bytes, kind] {
    return EventTime(gpu, gpu.stream, [&] {
      return Cuda(cudaMemcpyAsync(dst, src, bytes, kind, gpu.stream),
                  "cudaMemcpyAsync");
    });
  };
}

// copy_d2d/{memcpy,device_ops,device_ops_16views}; range(0): bytes,
// range(1): 0, 1 or 16 (memcpy, one Copy, 16 Copy calls).
void BM_CopyD2D(benchmark::State& state) {
  const int64_t bytes = state.range(0);
  const int64_t pieces = state.range(1);
  Gpu* gpu = GpuOrSkip(state);
  if (gpu == nullptr) return;
  const Device dev = gpu->ops->device();
  absl::StatusOr<Buffers> buf = Allocate(*gpu, dev, dev, bytes);
  if (!buf.ok()) return Fail(state, buf.status());
  const auto memcpy_time = MemcpyTime(*gpu, buf->b.data(), buf->a.data(), bytes,
                                      cudaMemcpyDeviceToDevice);
  if (pieces == 0) return Loop(state, bytes, memcpy_time, memcpy_time);
  const BufferRef src = buf->a_ref();
  const BufferRef dst = buf->b_ref();
  const int64_t count = src.count;
  Loop(
      state, bytes,
      [&] {
        return EventTime(*gpu, gpu->stream, [&]() -> absl::Status {
          for (int64_t p = 0; p < pieces; ++p) {
            const int64_t lo = count * p / pieces;
            const int64_t hi = count * (p + 1) / pieces;
            FLATPARAM_RETURN_IF_ERROR(
                gpu->ops->Copy(dst.Slice(lo, hi - lo), src.Slice(lo, hi - lo)));
          }
          return absl::OkStatus();
        });
      },
      memcpy_time);
}

// h2d/... and d2h/...; range(0): bytes, range(1): 1 for host-to-device,
// range(2): 0 for cudaMemcpyAsync, 1 for DeviceOps::Copy's copy on the
// GPU, 2 for the whole synchronous DeviceOps::Copy.
void BM_Offload(benchmark::State& state) {
  const int64_t bytes = state.range(0);
  const bool h2d = state.range(1) == 1;
  const int64_t ops = state.range(2);
  Gpu* gpu = GpuOrSkip(state);
  if (gpu == nullptr) return;
  const Device dev = gpu->ops->device();
  absl::StatusOr<Buffers> buf = Allocate(*gpu, h2d ? Device::Host() : dev,
                                         h2d ? dev : Device::Host(), bytes);
  if (!buf.ok()) return Fail(state, buf.status());
  const auto memcpy_time =
      MemcpyTime(*gpu, buf->b.data(), buf->a.data(), bytes,
                 h2d ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost);
  if (ops == 0) return Loop(state, bytes, memcpy_time, memcpy_time);
  const BufferRef src = buf->a_ref();
  const BufferRef dst = buf->b_ref();
  const auto copy = [&] { return gpu->ops->Copy(dst, src); };
  if (ops == 1) {
    return Loop(
        state, bytes, [&] { return DeviceCopyTime(*gpu, copy); }, memcpy_time);
  }
  Loop(
      state, bytes, [&] { return EventTime(*gpu, gpu->stream, copy); },
      memcpy_time);
}

// nccl/{all_gather,reduce_scatter} at world size 1; range(0): bytes,
// range(1): 0 all_gather, 1 reduce_scatter.
void BM_Nccl(benchmark::State& state) {
  const int64_t bytes = state.range(0);
  const bool gather = state.range(1) == 0;
  Gpu* gpu = GpuOrSkip(state);
  if (gpu == nullptr) return;
  const Device dev = gpu->ops->device();
  absl::StatusOr<Buffers> buf = Allocate(*gpu, dev, dev, bytes);
  if (!buf.ok()) return Fail(state, buf.status());
  const BufferRef in = buf->a_ref();
  const BufferRef out = buf->b_ref();
  Communicator& comm = *gpu->comm;
  const conformance::CollectiveKind kind =
      gather ? conformance::CollectiveKind::kAllGather
             : conformance::CollectiveKind::kReduceScatter;
  Loop(
      state, bytes,
      [&] {
        return CollectiveTime(*gpu, [&] {
          return gather ? comm.AllGather(in, out, {})
                        : comm.ReduceScatter(in, out, {});
        });
      },
      MemcpyTime(*gpu, buf->b.data(), buf->a.data(), bytes,
                 cudaMemcpyDeviceToDevice),
      &kind);
}

// handle/{unshard_reshard,reduce_grad}; range(0): bytes, range(1): 0
// unshard_reshard, 1 reduce_grad. Wall time, baseline the bare collective.
void BM_Handle(benchmark::State& state) {
  const int64_t bytes = state.range(0);
  const bool unshard = state.range(1) == 0;
  Gpu* gpu = GpuOrSkip(state);
  if (gpu == nullptr) return;
  DeviceOps& ops = *gpu->ops;
  Communicator& comm = *gpu->comm;
  auto run = [&]() -> absl::Status {
    LayoutOptions options;
    options.world_size = 1;
    options.strategy = ShardingStrategy::kShardGradOp;
    const std::vector<ParamSpec> params = {{"w", {bytes / 4}, DType::kFloat32}};
    FLATPARAM_ASSIGN_OR_RETURN(
        FlatParamLayout layout,
        FlatParamLayout::Create("unit", params, options));
    const int64_t chunk = layout.sharded_numel();
    FLATPARAM_ASSIGN_OR_RETURN(DeviceBuffer shard,
                               ops.Allocate(ops.device(), chunk * 4));
    FLATPARAM_ASSIGN_OR_RETURN(DeviceBuffer full,
                               ops.Allocate(ops.device(), chunk * 4));
    const BufferRef shard_ref = shard.As(DType::kFloat32).Slice(0, chunk);
    const BufferRef full_ref = full.As(DType::kFloat32).Slice(0, chunk);
    FLATPARAM_RETURN_IF_ERROR(ops.Fill(shard_ref, 1.0));
    FLATPARAM_RETURN_IF_ERROR(ops.Fill(full_ref, 1.0));
    FLATPARAM_RETURN_IF_ERROR(ops.Synchronize());
    FLATPARAM_ASSIGN_OR_RETURN(std::unique_ptr<FlatParamHandle> handle,
                               FlatParamHandle::CreateWithLocalShard(
                                   layout, shard_ref, &comm, nullptr, &ops));
    FlatParamHandle* h = handle.get();
    // The bare collective, wall time to completion.
    auto bare = [&]() -> absl::StatusOr<double> {
      return WallTime([&] {
        return unshard ? comm.AllGather(shard_ref, full_ref, {})->Wait()
                       : comm.ReduceScatter(full_ref, shard_ref, {})->Wait();
      });
    };
    // One handle round trip, as handle_bench: unshard+reshard, or
    // ReduceGrad after an untimed PreBackward and gradient fill.
    auto round_trip = [&]() -> absl::StatusOr<double> {
      if (unshard) {
        return WallTime([&]() -> absl::Status {
          FLATPARAM_RETURN_IF_ERROR(h->Unshard());
          FLATPARAM_RETURN_IF_ERROR(h->Reshard(/*free_unsharded=*/true));
          return ops.Synchronize();
        });
      }
      FLATPARAM_RETURN_IF_ERROR(h->ZeroGrad(/*set_to_none=*/true));
      FLATPARAM_RETURN_IF_ERROR(h->PreBackward());
      FLATPARAM_RETURN_IF_ERROR(ops.Fill(*h->unsharded_grad(), 1.0));
      FLATPARAM_RETURN_IF_ERROR(ops.Synchronize());
      FLATPARAM_ASSIGN_OR_RETURN(double t, WallTime([&]() -> absl::Status {
                                   FLATPARAM_RETURN_IF_ERROR(h->ReduceGrad());
                                   return ops.Synchronize();
                                 }));
      FLATPARAM_RETURN_IF_ERROR(h->PostBackward(/*sync_gradients=*/false));
      FLATPARAM_RETURN_IF_ERROR(h->FinalizeBackward(false));
      return t;
    };
    FLATPARAM_RETURN_IF_ERROR(round_trip().status());  // warm-up
    const conformance::CollectiveKind kind =
        unshard ? conformance::CollectiveKind::kAllGather
                : conformance::CollectiveKind::kReduceScatter;
    Loop(state, layout.padded_unsharded_numel() * 4, round_trip, bare, &kind);
    return absl::OkStatus();
  };
  const absl::Status st = run();
  if (!st.ok()) Fail(state, st);
}

// step/overlap:{1,0}; range(0): 1 with BACKWARD_PRE prefetch and
// overlapped reductions, 0 without.
constexpr char kStepModel[] = "gpt2";
constexpr double kStepTokens = 2048;
constexpr double kStepFlops = 100e12;

void BM_Step(benchmark::State& state) {
  const bool overlap = state.range(0) == 1;
  Gpu* gpu = GpuOrSkip(state);
  if (gpu == nullptr) return;
  CudaDeviceOps& ops = *gpu->ops;
  auto run = [&]() -> absl::Status {
    FLATPARAM_ASSIGN_OR_RETURN(ModelSpec spec, PresetModel(kStepModel));
    for (ParamSpec& p : spec.params) p.dtype = DType::kFloat32;
    LayoutOptions lo;
    lo.world_size = 1;
    lo.strategy = ShardingStrategy::kFullShard;
    FLATPARAM_ASSIGN_OR_RETURN(ModelLayout layout,
                               ModelLayout::Create(spec, lo));
    std::map<std::string, HostTensor> init;
    std::map<std::string, ConstBufferRef> refs;
    for (const ParamSpec& p : layout.spec().params) {
      if (!p.tied_to.empty()) continue;
      HostTensor t(DType::kFloat32, p.shape);
      for (int64_t k = 0; k < t.numel(); ++k) t.SetDouble(k, 0.001 * (k % 7));
      refs[p.fqn] = t.cref();
      init.emplace(p.fqn, std::move(t));
    }
    FLATPARAM_ASSIGN_OR_RETURN(
        std::vector<absl::Duration> forward,
        refmodel::SyntheticForwardTimes(layout, kStepTokens, kStepFlops));
    double compute = 0;
    for (absl::Duration d : forward) compute += 3 * absl::ToDoubleSeconds(d);

    RuntimeOptions options;
    // The host runs ahead of the kernels, as a GPU trainer's does: the
    // forward needs no prefetch to overlap (PyTorch's default).
    options.forward_prefetch = false;
    options.backward_prefetch =
        overlap ? BackwardPrefetch::kBackwardPre : BackwardPrefetch::kNone;
    FLATPARAM_ASSIGN_OR_RETURN(
        std::unique_ptr<FsdpRuntime> rt,
        FsdpRuntime::CreateFromNamedParams(layout, refs, gpu->comm.get(), &ops,
                                           HandleOptions{}, options));
    init.clear();  // the runtime holds the values on the device now
    // On the current stream when the runtime calls: the compute stream.
    const refmodel::KernelFn kernel =
        [&ops](const refmodel::KernelCall& call) -> absl::Status {
      return Cuda(LaunchSpinKernel(ops.stream(),
                                   absl::ToInt64Nanoseconds(call.duration)),
                  call.name);
    };
    auto step = [&]() -> absl::StatusOr<double> {
      FLATPARAM_RETURN_IF_ERROR(
          Cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize"));
      return WallTime([&]() -> absl::Status {
        FLATPARAM_RETURN_IF_ERROR(
            refmodel::RunSyntheticStep(*rt, forward, kernel, !overlap));
        FLATPARAM_RETURN_IF_ERROR(rt->ZeroGrad());
        return Cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
      });
    };
    FLATPARAM_RETURN_IF_ERROR(step().status());  // records the order
    double total = 0;
    for (auto _ : state) {
      FLATPARAM_ASSIGN_OR_RETURN(double t, step());
      state.SetIterationTime(t);
      total += t;
    }

    cost::StepOptions plan_options;
    plan_options.strategy = lo.strategy;
    plan_options.link.nodes = 1;
    plan_options.link.gpus_per_node = 1;
    plan_options.tokens_per_rank = kStepTokens;
    plan_options.peak_flops = kStepFlops;
    plan_options.efficiency = 1;
    plan_options.overlap = overlap;
    plan_options.backward_prefetch = overlap;
    FLATPARAM_ASSIGN_OR_RETURN(
        cost::StepPrediction plan,
        cost::PredictStep(cost::UnitsOf(layout), plan_options));
    const double per_step =
        total / static_cast<double>(std::max<int64_t>(1, state.iterations()));
    state.counters["compute_ms"] = compute * 1e3;
    state.counters["exposed_ms"] = (per_step - compute) * 1e3;
    state.counters["plan_step_ms"] = plan.step_seconds * 1e3;
    state.counters["plan_exposed_ms"] = plan.exposed_comm_seconds * 1e3;
    state.counters["step_vs_plan"] = per_step / plan.step_seconds;
    return absl::OkStatus();
  };
  const absl::Status st = run();
  if (!st.ok()) Fail(state, st);
}

void Sizes(benchmark::internal::Benchmark* b, int64_t max_bytes,
           std::vector<int64_t> variants, const std::string& arg_name) {
  b->ArgNames({"bytes", arg_name});
  for (int64_t v : variants) {
    for (int64_t bytes = kMinBytes; bytes <= max_bytes; bytes *= 4) {
      b->Args({bytes, v});
    }
  }
  b->UseManualTime()->Unit(benchmark::kMicrosecond);
}

void Register(int64_t max_bytes) {
  Sizes(benchmark::RegisterBenchmark("copy_d2d", BM_CopyD2D), max_bytes,
        {0, 1, 16}, "pieces");
  for (int h2d : {1, 0}) {
    auto* b = benchmark::RegisterBenchmark(h2d ? "h2d" : "d2h", BM_Offload);
    b->ArgNames({"bytes", "h2d", "device_ops"});
    for (int ops : {0, 1, 2}) {
      for (int64_t bytes = kMinBytes; bytes <= max_bytes; bytes *= 4) {
        b->Args({bytes, h2d, ops});
      }
    }
    b->UseManualTime()->Unit(benchmark::kMicrosecond);
  }
  Sizes(benchmark::RegisterBenchmark("nccl", BM_Nccl), max_bytes, {0, 1},
        "reduce_scatter");
  Sizes(benchmark::RegisterBenchmark("handle", BM_Handle), max_bytes, {0, 1},
        "reduce_grad");
  benchmark::RegisterBenchmark("step", BM_Step)
      ->ArgName("overlap")
      ->Arg(1)
      ->Arg(0)
      ->UseManualTime()
      ->Unit(benchmark::kMillisecond)
      ->Iterations(5);
}

}  // namespace
}  // namespace bench
}  // namespace flatparam

int main(int argc, char** argv) {
  int64_t max_bytes = flatparam::bench::kMaxBytes;
  flatparam::bench::BenchFlags flags("gpu_bench");
  flags.Int64("max_bytes", &max_bytes, flatparam::bench::kMinBytes);
  flags.Parse(&argc, argv);
  flatparam::bench::Register(max_bytes);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  if (flatparam::bench::failures > 0) {
    std::fprintf(stderr, "gpu_bench: %d benchmarks could not run (above)\n",
                 flatparam::bench::failures);
    return 1;
  }
  return 0;
}
