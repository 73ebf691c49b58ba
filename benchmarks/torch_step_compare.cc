// One rank's training step of the GPT of refmodel/torch_gpt.h under
// FsdpModule next to plain LibTorch's, on the CPU or on a GPU, for the GPU
// kit (tools/gpu/torch_kit: built with CMake against the GPU machine's
// PyTorch, run by run.sh's torch_bench step beside PyTorch's own FSDP,
// tools/gpu/torch_kit/pytorch_fsdp_step.py, which trains the same model).
// torch_step_bench is the MPI benchmark of the same comparison; this one
// needs neither MPI nor Google Benchmark, which the GPU machine lacks.
//
//   torch_step_compare --device=cuda --layers=12 --width=768 --heads=12
//       --seq=512 --batch=8 --steps=20 --warmup=5
//
// Each of `steps` timed steps (after `warmup` untimed ones) is forward,
// backward, AdamW and zero_grad on the same batch of random bytes, timed
// on the host with the device synchronized at the step's end; plain
// LibTorch and FsdpModule (FULL_SHARD, each block a unit, PyTorch's
// unshard and post-backward streams on CUDA, the real NCCL with one rank)
// alternate step by step so both see the same machine state. Prints one
// JSON object: the configuration, each side's median step in ms, and
// fsdp_vs_plain = fsdp median / plain median (1.0: FSDP costs nothing at
// one rank). On CUDA it needs a LibTorch with CUDA and the build's
// FLATPARAM_TORCH_CUDA=1 (the kit's CMake sets it); Bazel builds the CPU
// side only. Exit status 1 with the error on stderr.
#include <torch/optim/adamw.h>
#include <torch/types.h>
#include <torch/utils.h>
#include <torch/version.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "comm/communicator.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/device/device.h"
#include "flatparam/torch/fsdp_module.h"
#include "flatparam/torch/torch_device.h"
#include "refmodel/torch_gpt.h"
#include "sim/sim.h"

#if defined(FLATPARAM_TORCH_CUDA)
#include <torch/cuda.h>

#include "comm/nccl/nccl_api.h"
#include "comm/nccl/nccl_communicator.h"
#include "comm/nccl/thread_bootstrap_testutil.h"
#include "flatparam/device/cuda/cuda_runtime.h"
#include "flatparam/torch/torch_cuda.h"
#endif

ABSL_FLAG(std::string, device, "cpu", "cpu, or cuda (GPU 0)");
ABSL_FLAG(int64_t, layers, 2, "GPT blocks");
ABSL_FLAG(int64_t, width, 64, "embedding width");
ABSL_FLAG(int64_t, heads, 4, "attention heads");
ABSL_FLAG(int64_t, seq, 32, "tokens per sequence");
ABSL_FLAG(int64_t, batch, 4, "sequences per step");
ABSL_FLAG(int, steps, 10, "timed steps per side");
ABSL_FLAG(int, warmup, 2, "untimed steps per side first");

namespace flatparam {
namespace {

using Clock = std::chrono::steady_clock;

refmodel::GptConfig Config() {
  refmodel::GptConfig config;
  config.n_layer = absl::GetFlag(FLAGS_layers);
  config.n_embd = absl::GetFlag(FLAGS_width);
  config.n_head = absl::GetFlag(FLAGS_heads);
  config.n_positions = absl::GetFlag(FLAGS_seq);
  return config;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

// Both sides on `device` over `world` (one rank); `sync` waits for the
// device's work.
absl::Status Compare(Communicator& world, TorchDevice& device,
                     const HandleStreams& streams,
                     const std::function<void()>& sync) {
  const c10::Device on = device.torch_device();
  const int64_t batch = absl::GetFlag(FLAGS_batch);
  const int64_t seq = absl::GetFlag(FLAGS_seq);
  const int steps = absl::GetFlag(FLAGS_steps);
  const int warmup = absl::GetFlag(FLAGS_warmup);
  if (steps < 1 || warmup < 0 || batch < 1 || seq < 2) {
    return absl::InvalidArgumentError(absl::StrCat(
        "want --steps >= 1, --warmup >= 0, --batch >= 1, --seq >= 2; got ",
        steps, ", ", warmup, ", ", batch, ", ", seq));
  }
  torch::manual_seed(0);
  // Tokens [batch, seq + 1]: inputs and next-token targets.
  const torch::Tensor tokens =
      torch::randint(0, 256, {batch, seq + 1}, torch::kLong).to(on);
  const torch::Tensor inputs = tokens.narrow(1, 0, seq);
  const torch::optim::AdamWOptions adamw(1e-4);

  torch::manual_seed(1);
  refmodel::Gpt plain(Config());
  plain->to(on);
  torch::optim::AdamW plain_optimizer(refmodel::TrainableTensors(*plain.ptr()),
                                      adamw);
  torch::manual_seed(1);
  refmodel::Gpt model(Config());
  model->to(on);
  libtorch::FsdpOptions options;
  options.wrap = {"transformer.h.*"};
  options.handle.streams = streams;
  FLATPARAM_ASSIGN_OR_RETURN(
      std::unique_ptr<libtorch::FsdpModule> fsdp,
      libtorch::FsdpModule::Wrap(model.ptr(), &world, &device, options));
  torch::optim::AdamW optimizer(fsdp->ShardedParameters(), adamw);

  auto plain_step = [&]() -> absl::Status {
    torch::Tensor loss =
        refmodel::NextTokenLoss(plain->forward(inputs), tokens);
    loss.backward();
    plain_optimizer.step();
    plain_optimizer.zero_grad();
    return absl::OkStatus();
  };
  auto fsdp_step = [&]() -> absl::Status {
    FLATPARAM_ASSIGN_OR_RETURN(torch::Tensor logits,
                               refmodel::GptForward(model, *fsdp, inputs));
    FLATPARAM_RETURN_IF_ERROR(
        fsdp->Backward(refmodel::NextTokenLoss(logits, tokens)));
    optimizer.step();
    return fsdp->ZeroGrad();
  };
  auto timed = [&](const std::function<absl::Status()>& step,
                   std::vector<double>* ms) -> absl::Status {
    sync();
    const Clock::time_point t0 = Clock::now();
    FLATPARAM_RETURN_IF_ERROR(step());
    sync();
    ms->push_back(
        std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
    return absl::OkStatus();
  };
  std::vector<double> plain_ms, fsdp_ms, unused;
  for (int i = 0; i < warmup + steps; ++i) {
    const bool keep = i >= warmup;
    FLATPARAM_RETURN_IF_ERROR(timed(plain_step, keep ? &plain_ms : &unused));
    FLATPARAM_RETURN_IF_ERROR(timed(fsdp_step, keep ? &fsdp_ms : &unused));
  }
  const double plain_median = Median(plain_ms);
  const double fsdp_median = Median(fsdp_ms);
  std::cout << "{\"device\": \"" << on.str() << "\", \"libtorch\": \""
            << TORCH_VERSION << "\", \"layers\": " << Config().n_layer
            << ", \"width\": " << Config().n_embd
            << ", \"heads\": " << Config().n_head << ", \"seq\": " << seq
            << ", \"batch\": " << batch << ", \"steps\": " << steps
            << ", \"plain_ms_median\": " << plain_median
            << ", \"fsdp_ms_median\": " << fsdp_median
            << ", \"fsdp_vs_plain\": " << fsdp_median / plain_median << "}"
            << std::endl;
  return absl::OkStatus();
}

absl::Status Run() {
  const std::string device = absl::GetFlag(FLAGS_device);
  if (device == "cpu") {
    SimOptions sim;
    sim.world_size = 1;
    FLATPARAM_ASSIGN_OR_RETURN(std::unique_ptr<SimWorld> world,
                               SimWorld::Create(sim));
    return world->Run([](SimCommunicator& comm) {
      HostDeviceOps ops;
      HostTorchDevice cpu(&ops);
      return Compare(comm, cpu, HandleStreams(), [] {});
    });
  }
  if (device != "cuda") {
    return absl::InvalidArgumentError(
        absl::StrCat("--device=", device, ": want cpu or cuda"));
  }
#if defined(FLATPARAM_TORCH_CUDA)
  if (!torch::cuda::is_available()) {
    return absl::UnavailableError("--device=cuda: LibTorch sees no GPU");
  }
  FLATPARAM_ASSIGN_OR_RETURN(std::unique_ptr<TorchCudaDeviceOps> cuda,
                             TorchCudaDeviceOps::Create(0));
  std::vector<std::unique_ptr<Communicator>> group = MakeThreadGroup(1);
  FLATPARAM_ASSIGN_OR_RETURN(
      std::unique_ptr<NcclCommunicator> nccl,
      NcclCommunicator::Create(RealNcclApi(), RealCudaRuntime(), *group[0],
                               /*cuda_device=*/0));
  HandleStreams streams;
  FLATPARAM_ASSIGN_OR_RETURN(streams.unshard, cuda->ops().NewStream());
  FLATPARAM_ASSIGN_OR_RETURN(streams.post_backward, cuda->ops().NewStream());
  return Compare(*nccl, *cuda, streams, [] { torch::cuda::synchronize(); });
#else
  return absl::UnimplementedError(
      "--device=cuda: this build has no CUDA (build it with "
      "FLATPARAM_TORCH_CUDA=1 against a LibTorch with CUDA: the GPU kit's "
      "CMake does)");
#endif
}

}  // namespace
}  // namespace flatparam

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  absl::Status status = flatparam::Run();
  if (!status.ok()) {
    std::cerr << "torch_step_compare: " << status << std::endl;
    return 1;
  }
  return 0;
}
