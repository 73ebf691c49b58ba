// The cost of FSDP for a LibTorch model: one training step of the GPT-2-style
// transformer (refmodel/torch_gpt.h) under FsdpModule (FULL_SHARD, each
// block a unit, AdamW over the sharded flat parameters) next to the same
// step of plain LibTorch (the module's own parameters, torch::optim::AdamW),
// on every rank's local batch, in the same run.
//
//   step/fsdp/ranks:N   one step under FsdpModule over MPI: forward with the
//                       unit calls, Backward (the reduce-scatters start from
//                       the gradient accumulators' hooks, overlapping the
//                       rest of the backward), AdamW, ZeroGrad.
//
//   step/fsdp/ranks:N/recorder:0
//                       step/fsdp on a world without the flight recorder
//                       (MpiOptions::flight_recorder.capacity = 0): the
//                       recorder's cost is step/fsdp's fsdp_ms over this
//                       row's.
//
//   step/fsdp_recompute_inside/ranks:N, step/fsdp_recompute_around/ranks:N
//                       the same with each block's activations recomputed
//                       in the backward inside or around its unit
//                       (FsdpModule::RecomputedUnit): the price of the
//                       memory recomputation saves.
//
// Each iteration times a plain step and an FSDP step back to back (so both
// see the same machine state) and reports the FSDP step's time; counters:
//   plain_ms, fsdp_ms        mean step times
//   speed_vs_plain           plain_ms / fsdp_ms (1.0: FSDP costs nothing;
//                            the goal at one rank is >= 0.95)
//   exposed_ms               fsdp_ms - plain_ms: what FSDP adds per step
//                            (at N > 1 ranks: the communication the backward
//                            did not hide, plus the flat-parameter work)
// One intra-op thread per rank (as the bitwise tests run), so that ranks on
// one machine do not fight over cores.
//
//   bazel build -c opt //benchmarks:torch_step_bench
//   mpirun --allow-run-as-root -np 1 bazel-bin/benchmarks/torch_step_bench
//   mpirun --allow-run-as-root --oversubscribe --bind-to none -np 2
//       bazel-bin/benchmarks/torch_step_bench
#include <benchmark/benchmark.h>
#include <torch/optim/adamw.h>
#include <torch/types.h>
#include <torch/utils.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "benchmarks/mpi_bench_driver.h"
#include "comm/mpi/mpi_communicator.h"
#include "flatparam/device/device.h"
#include "flatparam/torch/fsdp_module.h"
#include "refmodel/torch_gpt.h"

namespace flatparam {
namespace bench {
namespace {

constexpr char kProgram[] = "torch_step_bench";
constexpr char kText[] = "/usr/share/common-licenses/GPL-3";
constexpr int64_t kLocalBatch = 8;

refmodel::GptConfig Config() {
  refmodel::GptConfig config;
  config.n_positions = 64;
  config.n_embd = 128;
  config.n_layer = 4;
  config.n_head = 4;
  return config;
}

torch::optim::AdamWOptions AdamW() {
  return torch::optim::AdamWOptions(3e-4).weight_decay(0.01);
}

double Seconds(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
      .count();
}

// The two models of a run, trained side by side from the same parameters.
// Not movable: the FsdpModule points at its members.
class StepPair {
 public:
  static std::unique_ptr<StepPair> Make(Communicator& world) {
    absl::StatusOr<refmodel::TextBatches> text =
        refmodel::TextBatches::FromFile(kText, Config().n_positions);
    if (!text.ok()) Die(kProgram, text.status());
    return std::unique_ptr<StepPair>(new StepPair(world, *std::move(text)));
  }
  StepPair(const StepPair&) = delete;
  StepPair& operator=(const StepPair&) = delete;

  // One plain LibTorch step on this rank's samples of `step`.
  void PlainStep(int64_t step) {
    torch::Tensor batch = Batch(step);
    torch::Tensor loss = refmodel::NextTokenLoss(
        plain_->forward(batch.narrow(1, 0, text_.seq())), batch);
    loss.backward();
    plain_adamw_->step();
    plain_adamw_->zero_grad();
  }

  // One FSDP step on the same samples, each block's activations
  // recomputed at `recompute`; collective.
  void FsdpStep(int64_t step, libtorch::Recomputation recompute) {
    torch::Tensor batch = Batch(step);
    absl::StatusOr<torch::Tensor> logits = refmodel::GptForward(
        sharded_, *fsdp_, batch.narrow(1, 0, text_.seq()), recompute);
    if (!logits.ok()) Die(kProgram, logits.status());
    torch::Tensor loss = refmodel::NextTokenLoss(*logits, batch);
    absl::Status st = fsdp_->Backward(loss);
    if (st.ok()) {
      fsdp_adamw_->step();
      st = fsdp_->ZeroGrad();
    }
    if (!st.ok()) Die(kProgram, st);
  }

 private:
  StepPair(Communicator& world, refmodel::TextBatches text)
      : world_(world), text_(std::move(text)) {
    torch::manual_seed(1);
    plain_ = refmodel::Gpt(Config());
    torch::manual_seed(1);
    sharded_ = refmodel::Gpt(Config());
    plain_adamw_ = std::make_unique<torch::optim::AdamW>(
        refmodel::TrainableTensors(*plain_), AdamW());
    libtorch::FsdpOptions options;
    options.wrap = {"transformer.h.*"};
    absl::StatusOr<std::unique_ptr<libtorch::FsdpModule>> fsdp =
        libtorch::FsdpModule::Wrap(sharded_.ptr(), &world_, &device_, options);
    if (!fsdp.ok()) Die(kProgram, fsdp.status());
    fsdp_ = *std::move(fsdp);
    fsdp_adamw_ = std::make_unique<torch::optim::AdamW>(
        fsdp_->ShardedParameters(), AdamW());
  }

  torch::Tensor Batch(int64_t step) const {
    return text_.Batch(step, world_.rank() * kLocalBatch, kLocalBatch);
  }

  Communicator& world_;
  refmodel::TextBatches text_;
  HostDeviceOps device_;
  refmodel::Gpt plain_{nullptr};
  refmodel::Gpt sharded_{nullptr};
  std::unique_ptr<torch::optim::AdamW> plain_adamw_;
  std::unique_ptr<libtorch::FsdpModule> fsdp_;
  std::unique_ptr<torch::optim::AdamW> fsdp_adamw_;
};

void Run(StepPair& pair, int64_t& step, libtorch::Recomputation recompute,
         benchmark::State* state, int64_t iterations) {
  double plain = 0, fsdp = 0;
  int64_t n = 0;
  RunIterations(state, iterations, [&]() {
    auto start = std::chrono::steady_clock::now();
    pair.PlainStep(step);
    plain += Seconds(start);
    start = std::chrono::steady_clock::now();
    pair.FsdpStep(step, recompute);
    const double seconds = Seconds(start);
    fsdp += seconds;
    ++step;
    ++n;
    return seconds;
  });
  if (state != nullptr && n > 0) {
    state->counters["plain_ms"] = 1e3 * plain / n;
    state->counters["fsdp_ms"] = 1e3 * fsdp / n;
    state->counters["speed_vs_plain"] = plain / fsdp;
    state->counters["exposed_ms"] = 1e3 * (fsdp - plain) / n;
  }
}

int Main(int* argc, char*** argv) {
  absl::StatusOr<MpiSession> session = MpiSession::Start(argc, argv);
  if (!session.ok()) Die(kProgram, session.status());
  {
    absl::StatusOr<std::unique_ptr<MpiCommunicator>> world =
        MpiCommunicator::CreateWorld();
    if (!world.ok()) Die(kProgram, world.status());
    std::unique_ptr<StepPair> made = StepPair::Make(**world);
    StepPair& pair = *made;
    int64_t step = 0;
    // Warm-up, untimed: LibTorch's allocator and the runtime's buffers
    // reach their steady state.
    for (int i = 0; i < 3; ++i, ++step) {
      pair.PlainStep(step);
      pair.FsdpStep(step, libtorch::Recomputation::kNone);
    }
    std::vector<MpiBenchmark> benchmarks;
    for (libtorch::Recomputation recompute :
         {libtorch::Recomputation::kNone, libtorch::Recomputation::kInsideUnit,
          libtorch::Recomputation::kAroundUnit}) {
      MpiBenchmark b;
      b.name = recompute == libtorch::Recomputation::kNone
                   ? absl::StrCat("step/fsdp/ranks:", (*world)->size())
                   : absl::StrCat("step/fsdp_recompute_",
                                  libtorch::RecomputationName(recompute),
                                  "/ranks:", (*world)->size());
      b.run = [&pair, &step, recompute](benchmark::State* state,
                                        int64_t iterations) {
        Run(pair, step, recompute, state, iterations);
      };
      b.configure = [](benchmark::internal::Benchmark* r) {
        r->UseManualTime()->Unit(benchmark::kMillisecond)->MinTime(2.0);
      };
      benchmarks.push_back(std::move(b));
    }
    // The same model on a world without the flight recorder: the
    // recorder's cost is step/fsdp's fsdp_ms over this row's.
    MpiOptions unrecorded_options;
    unrecorded_options.flight_recorder.capacity = 0;
    absl::StatusOr<std::unique_ptr<MpiCommunicator>> unrecorded =
        MpiCommunicator::Wrap(MPI_COMM_WORLD, unrecorded_options);
    if (!unrecorded.ok()) Die(kProgram, unrecorded.status());
    std::unique_ptr<StepPair> made_off = StepPair::Make(**unrecorded);
    StepPair& pair_off = *made_off;
    for (int i = 0; i < 3; ++i, ++step) {
      pair_off.PlainStep(step);
      pair_off.FsdpStep(step, libtorch::Recomputation::kNone);
    }
    MpiBenchmark off;
    off.name =
        absl::StrCat("step/fsdp/ranks:", (*world)->size(), "/recorder:0");
    off.run = [&pair_off, &step](benchmark::State* state, int64_t iterations) {
      Run(pair_off, step, libtorch::Recomputation::kNone, state, iterations);
    };
    off.configure = [](benchmark::internal::Benchmark* r) {
      r->UseManualTime()->Unit(benchmark::kMillisecond)->MinTime(2.0);
    };
    benchmarks.push_back(std::move(off));
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
  torch::set_num_threads(1);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 2;
  return flatparam::bench::Main(&argc, &argv);
}
