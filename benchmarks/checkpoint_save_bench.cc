// How long a training step is blocked by a checkpoint save, synchronous
// (WriteShardedCheckpointCollective) against asynchronous
// (AsyncCheckpointSaver: snapshot + Start, the files written in the
// background), for a checkpoint of --state_mib MiB (default 1536: 512 MiB of
// parameters and 1 GiB of AdamW state), measured in the same run on the same
// disk.
//
//   bazel run -c opt //benchmarks:checkpoint_save_bench
//   bazel run -c opt //benchmarks:checkpoint_save_bench -- --dir=/mnt/fast
//
// One rank (the simulator's, so that the collective protocol runs as in a
// job) holds the whole state. Benchmarks, each reporting the time the
// caller is blocked (manual time):
//   sync        the collective write: the step waits for every byte and
//               fsync.
//   async       copying the state into a snapshot (the staging memory a
//               trainer needs: its state is on the device or about to
//               change) plus Start; then the "training" goes on (the thread
//               sleeps for --train_ms) and Finish publishes. start_s counts
//               Start alone, finish_s Finish's wait, total_s the whole
//               save.
//   snapshot    the copy alone: the floor of any save that lets training
//               change the state.
// Counters: bytes_per_second over the checkpoint's tensor bytes (for the
// blocked time), checkpoint_bytes. Each iteration writes a fresh directory;
// the previous one is removed and written back (sync) untimed.
#include <benchmark/benchmark.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "benchmarks/bench_flags.h"
#include "flatparam/base/dtype.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/checkpoint/async_checkpoint.h"
#include "flatparam/checkpoint/collective_checkpoint.h"
#include "flatparam/checkpoint/file_system.h"
#include "flatparam/checkpoint/training_state.h"
#include "flatparam/model_layout.h"
#include "flatparam/optim/optim_state.h"
#include "sim/sim.h"

namespace flatparam {
namespace {

using checkpoint::AsyncCheckpointSaver;
using checkpoint::FileSystem;
using checkpoint::PosixFileSystem;
using checkpoint::RankState;

struct Flags {
  int64_t state_mib = 1536;
  int64_t train_ms = 3000;
  std::string dir;
};
Flags& GetFlags() {
  static Flags flags;
  return flags;
}

// Layers of [rows, 4096] float32 weights, one unit each: a third of
// --state_mib in parameters, two thirds in exp_avg and exp_avg_sq.
ModelSpec BenchModel(int64_t state_mib) {
  const int64_t layers = 8;
  const int64_t param_bytes = state_mib * (int64_t{1} << 20) / 3;
  const int64_t rows = std::max<int64_t>(1, param_bytes / 4 / 4096 / layers);
  ModelSpec spec;
  spec.name = absl::StrFormat("checkpoint_save_bench_%dmib", state_mib);
  for (int64_t l = 0; l < layers; ++l) {
    spec.params.push_back({absl::StrFormat("layers.%d.weight", l),
                           {rows, 4096},
                           DType::kFloat32});
    spec.wrap.push_back(absl::StrFormat("layers.%d", l));
  }
  return spec;
}

const ModelLayout& BenchLayout() {
  static const ModelLayout* layout = [] {
    LayoutOptions o;
    o.world_size = 1;
    return new ModelLayout(
        *ModelLayout::Create(BenchModel(GetFlags().state_mib), o));
  }();
  return *layout;
}

// The trainer's state: parameters and AdamW state, filled.
const RankState& BenchState() {
  static const RankState* state = [] {
    auto* s = new RankState;
    const ModelLayout& layout = BenchLayout();
    for (size_t i = 0; i < layout.flat_params().size(); ++i) {
      const int64_t n = layout.flat_params()[i].sharded_numel();
      HostTensor p = HostTensor::Flat(DType::kFloat32, n);
      float* d = p.data_as<float>();
      for (int64_t k = 0; k < n; ++k) d[k] = static_cast<float>(k % 997);
      auto& st = s->optim.state[optim::ParamKey(static_cast<int64_t>(i))];
      st["exp_avg"] = p;
      st["exp_avg_sq"] = p;
      st["step"] = optim::ScalarTensor(DType::kFloat32, 10);
      s->flat_params.push_back(std::move(p));
    }
    s->extra = {{"step", 10}};
    return s;
  }();
  return *state;
}

int64_t StateBytes() {
  int64_t b = optim::TensorBytes(BenchState().optim);
  for (const HostTensor& t : BenchState().flat_params) b += t.nbytes();
  return b;
}

std::string Root() {
  static const std::string root = [] {
    std::string base = GetFlags().dir;
    if (base.empty()) {
      const char* t = std::getenv("TEST_TMPDIR");
      if (t == nullptr) t = std::getenv("TMPDIR");
      base = t != nullptr ? t : "/tmp";
    }
    std::string dir = absl::StrCat(base, "/checkpoint_save_bench.",
                                   static_cast<int64_t>(getpid()));
    if (!PosixFileSystem().CreateDir(dir).ok()) std::abort();
    return dir;
  }();
  return root;
}

void RemoveTree(const std::string& path) {
  if (std::system(absl::StrCat("rm -rf '", path, "' && sync").c_str()) != 0) {
    std::fprintf(stderr, "checkpoint_save_bench: could not remove %s\n",
                 path.c_str());
  }
}

enum class Mode { kSync, kAsync, kSnapshot };

void BM_Save(benchmark::State& state, Mode mode) {
  const ModelLayout& layout = BenchLayout();
  const RankState& live = BenchState();
  double finish_s = 0, total_s = 0, start_s = 0;
  int64_t n = 0;
  for (auto _ : state) {
    const std::string dir = absl::StrCat(Root(), "/ckpt");
    RemoveTree(dir);
    double blocked = 0;
    SimOptions sim;
    sim.world_size = 1;
    auto world = SimWorld::Create(sim);
    if (!world.ok()) {
      state.SkipWithError(std::string(world.status().message()).c_str());
      return;
    }
    absl::Status run = (*world)->Run([&](Communicator& comm) -> absl::Status {
      const absl::Time t0 = absl::Now();
      if (mode == Mode::kSync) {
        FLATPARAM_ASSIGN_OR_RETURN(
            checkpoint::RankContent c,
            checkpoint::MakeRankContent(layout, 0, live));
        FLATPARAM_RETURN_IF_ERROR(checkpoint::WriteShardedCheckpointCollective(
            PosixFileSystem(), dir, layout, 1, c, comm));
        blocked = absl::ToDoubleSeconds(absl::Now() - t0);
        total_s += blocked;
        return absl::OkStatus();
      }
      RankState snapshot = live;  // device -> host in a real trainer
      if (mode == Mode::kSnapshot) {
        blocked = absl::ToDoubleSeconds(absl::Now() - t0);
        benchmark::DoNotOptimize(snapshot.flat_params.data());
        return absl::OkStatus();
      }
      AsyncCheckpointSaver saver(PosixFileSystem(), comm);
      FLATPARAM_RETURN_IF_ERROR(
          saver.Start(dir, layout, 1, std::move(snapshot)));
      start_s += absl::ToDoubleSeconds(saver.last_start_blocked());
      blocked = absl::ToDoubleSeconds(absl::Now() - t0);
      std::this_thread::sleep_for(
          std::chrono::milliseconds(GetFlags().train_ms));
      const absl::Time f0 = absl::Now();
      FLATPARAM_RETURN_IF_ERROR(saver.Finish());
      finish_s += absl::ToDoubleSeconds(absl::Now() - f0);
      total_s += absl::ToDoubleSeconds(absl::Now() - t0);
      return absl::OkStatus();
    });
    if (!run.ok()) {
      state.SkipWithError(std::string(run.message()).c_str());
      return;
    }
    state.SetIterationTime(blocked);
    ++n;
  }
  RemoveTree(absl::StrCat(Root(), "/ckpt"));
  state.SetBytesProcessed(StateBytes() * n);
  state.counters["checkpoint_bytes"] = static_cast<double>(StateBytes());
  if (mode != Mode::kSnapshot && n > 0) {
    state.counters["total_s"] = total_s / n;
  }
  if (mode == Mode::kAsync && n > 0) {
    state.counters["finish_s"] = finish_s / n;
    state.counters["start_s"] = start_s / n;
  }
}

}  // namespace
}  // namespace flatparam

int main(int argc, char** argv) {
  flatparam::Flags& flags = flatparam::GetFlags();
  flatparam::bench::BenchFlags parser("checkpoint_save_bench");
  parser.Int64("state_mib", &flags.state_mib, 1);
  parser.Int64("train_ms", &flags.train_ms, 0);
  parser.String("dir", &flags.dir);
  parser.Parse(&argc, argv);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 2;
  using flatparam::Mode;
  const std::pair<const char*, Mode> runs[] = {
      {"checkpoint_save/snapshot", Mode::kSnapshot},
      {"checkpoint_save/sync", Mode::kSync},
      {"checkpoint_save/async", Mode::kAsync},
  };
  for (const auto& [name, mode] : runs) {
    benchmark::RegisterBenchmark(
        name,
        [mode = mode](benchmark::State& s) { flatparam::BM_Save(s, mode); })
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond)
        ->Iterations(3);
  }
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
