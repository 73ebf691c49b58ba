// FsdpModule on CUDA tensors (TorchCudaDeviceOps, one rank over the real
// NCCL): the GPT of refmodel/torch_gpt.h trained for 50 steps under
// FsdpModule follows plain LibTorch's training on the same GPU; a step
// under another current stream is refused; state dicts come back on the
// CPU or the GPU as asked. Skips without a GPU (fails under
// FLATPARAM_REQUIRE_GPU=1); in CI (Debian's CPU-only LibTorch) this file
// is compiled, not linked or run.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>
#include <torch/optim/adamw.h>
#include <torch/types.h>
#include <torch/utils.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "comm/communicator.h"
#include "comm/nccl/nccl_api.h"
#include "comm/nccl/nccl_communicator.h"
#include "comm/nccl/thread_bootstrap_testutil.h"
#include "flatparam/base/gpu_testutil.h"
#include "flatparam/base/status_matchers.h"
#include "flatparam/device/cuda/cuda_runtime.h"
#include "flatparam/torch/fsdp_module.h"
#include "flatparam/torch/torch_cuda.h"
#include "refmodel/torch_gpt.h"

namespace flatparam {
namespace {

using ::flatparam::IsOk;

constexpr int kSteps = 50;
constexpr int64_t kBatch = 4;

refmodel::GptConfig Config() {
  refmodel::GptConfig config;
  config.n_positions = 32;
  config.n_embd = 64;
  config.n_layer = 3;
  config.n_head = 4;
  return config;
}

refmodel::TextBatches Text() {
  std::string text;
  for (int i = 0; i < 200; ++i) {
    absl::StrAppend(&text, "flatparam trains a GPT on CUDA, line ", i, ". ");
  }
  return refmodel::TextBatches(text, /*seq=*/24);
}

// The GPT at seed 0, on cuda:0.
refmodel::Gpt MakeGpt() {
  torch::manual_seed(0);
  refmodel::Gpt model(Config());
  model->to(torch::Device(torch::kCUDA, 0));
  return model;
}

class FsdpModuleCudaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!torch::cuda::is_available()) {
      FLATPARAM_SKIP_WITHOUT_GPU("no usable GPU: LibTorch sees no CUDA device");
    }
    absl::StatusOr<std::unique_ptr<TorchCudaDeviceOps>> cuda =
        TorchCudaDeviceOps::Create(0);
    ASSERT_THAT(cuda.status(), IsOk());
    cuda_ = *std::move(cuda);
    group_ = MakeThreadGroup(1);
    absl::StatusOr<std::unique_ptr<NcclCommunicator>> nccl =
        NcclCommunicator::Create(RealNcclApi(), RealCudaRuntime(), *group_[0],
                                 /*cuda_device=*/0);
    ASSERT_THAT(nccl.status(), IsOk());
    nccl_ = *std::move(nccl);
  }

  std::unique_ptr<TorchCudaDeviceOps> cuda_;
  std::vector<std::unique_ptr<Communicator>> group_;
  std::unique_ptr<NcclCommunicator> nccl_;
};

// Losses step by step within a relative 1e-4 of plain LibTorch's (the
// same kernels on the same GPU; cuBLAS may pick other algorithms for the
// flat parameters' views, so bits may differ), and the parameters after
// training within 1e-4 too.
TEST_F(FsdpModuleCudaTest, GptTrainsAsPlainLibTorchDoes) {
  const refmodel::TextBatches text = Text();
  const torch::optim::AdamWOptions adamw(1e-3);

  refmodel::Gpt plain = MakeGpt();
  torch::optim::AdamW plain_optimizer(refmodel::TrainableTensors(*plain.ptr()),
                                      adamw);
  std::vector<float> plain_losses;
  for (int step = 0; step < kSteps; ++step) {
    torch::Tensor batch =
        text.Batch(step, 0, kBatch).to(torch::Device(torch::kCUDA, 0));
    torch::Tensor loss = refmodel::NextTokenLoss(
        plain->forward(batch.narrow(1, 0, text.seq())), batch);
    plain_losses.push_back(loss.item<float>());
    loss.backward();
    plain_optimizer.step();
    plain_optimizer.zero_grad();
  }

  // PyTorch's streams: all-gathers on an unshard stream, reductions on a
  // post-backward stream, ordered with LibTorch's by events.
  refmodel::GptFsdpOptions options;
  absl::StatusOr<Stream> unshard = cuda_->ops().NewStream();
  absl::StatusOr<Stream> post_backward = cuda_->ops().NewStream();
  ASSERT_THAT(unshard.status(), IsOk());
  ASSERT_THAT(post_backward.status(), IsOk());
  options.streams.unshard = *unshard;
  options.streams.post_backward = *post_backward;
  refmodel::Gpt model = MakeGpt();
  absl::StatusOr<refmodel::GptFsdpRun> run =
      refmodel::TrainGptUnderFsdp(model, *nccl_, *cuda_, text, kSteps, kBatch,
                                  adamw, nullptr, nullptr, options);
  ASSERT_THAT(run.status(), IsOk());
  ASSERT_EQ(run->losses.size(), plain_losses.size());
  float worst = 0;
  for (int step = 0; step < kSteps; ++step) {
    const float a = run->losses[step], b = plain_losses[step];
    worst = std::max(worst, std::abs(a - b) / std::max(1.0f, std::abs(b)));
  }
  RecordProperty("max_relative_loss_difference", absl::StrCat(worst));
  EXPECT_LE(worst, 1e-4) << "first loss " << run->losses[0] << " vs "
                         << plain_losses[0] << "; last " << run->losses.back()
                         << " vs " << plain_losses.back();
  EXPECT_LT(run->losses.back(), run->losses.front());
  for (const auto& item : plain->named_parameters()) {
    const std::string& name = item.key();
    const torch::Tensor& value = item.value();
    if (run->full_state.count(name) == 0) continue;  // the tied head
    const torch::Tensor& got = run->full_state.at(name);
    EXPECT_TRUE(got.device().is_cpu()) << name;
    EXPECT_TRUE(torch::allclose(got, value.cpu(), 1e-4, 1e-5))
        << name << ": max difference "
        << (got - value.cpu()).abs().max().item<float>();
  }
}

// LibTorch's kernels under another current stream would race flatparam's
// copies: the step is refused, naming both streams, and the module works
// again once the guard is gone.
TEST_F(FsdpModuleCudaTest, AnotherCurrentStreamIsRefused) {
  refmodel::Gpt model = MakeGpt();
  libtorch::FsdpOptions options;
  options.wrap = {"transformer.h.*"};
  absl::StatusOr<std::unique_ptr<libtorch::FsdpModule>> fsdp =
      libtorch::FsdpModule::Wrap(model.ptr(), nccl_.get(), cuda_.get(),
                                 options);
  ASSERT_THAT(fsdp.status(), IsOk());
  const refmodel::TextBatches text = Text();
  torch::Tensor batch =
      text.Batch(0, 0, kBatch).to(torch::Device(torch::kCUDA, 0));
  torch::Tensor tokens = batch.narrow(1, 0, text.seq());
  {
    c10::cuda::CUDAStreamGuard guard(c10::cuda::getStreamFromPool(false, 0));
    absl::StatusOr<torch::Tensor> logits =
        refmodel::GptForward(model, **fsdp, tokens);
    EXPECT_EQ(logits.status().code(), absl::StatusCode::kFailedPrecondition)
        << logits.status();
  }
  absl::StatusOr<torch::Tensor> logits =
      refmodel::GptForward(model, **fsdp, tokens);
  ASSERT_THAT(logits.status(), IsOk());
  EXPECT_TRUE(logits->is_cuda());
  EXPECT_THAT((*fsdp)->Backward(refmodel::NextTokenLoss(*logits, batch)),
              IsOk());
}

// StateDict on the CPU by default (offload_to_cpu), on the GPU when asked;
// the same values either way, and the module's own before wrapping.
TEST_F(FsdpModuleCudaTest, StateDictsOnEitherDevice) {
  refmodel::Gpt model = MakeGpt();
  std::map<std::string, torch::Tensor> before;
  for (const auto& item : model->named_parameters()) {
    before[item.key()] = item.value().detach().cpu();
  }
  libtorch::FsdpOptions options;
  options.wrap = {"transformer.h.*"};
  absl::StatusOr<std::unique_ptr<libtorch::FsdpModule>> fsdp =
      libtorch::FsdpModule::Wrap(model.ptr(), nccl_.get(), cuda_.get(),
                                 options);
  ASSERT_THAT(fsdp.status(), IsOk());
  auto on_cpu = (*fsdp)->StateDict();
  ASSERT_THAT(on_cpu.status(), IsOk());
  libtorch::StateDictOptions keep;
  keep.offload_to_cpu = false;
  auto on_gpu = (*fsdp)->StateDict(keep);
  ASSERT_THAT(on_gpu.status(), IsOk());
  for (const auto& [name, value] : before) {
    const torch::Tensor* cpu = on_cpu->find(name);
    const torch::Tensor* gpu = on_gpu->find(name);
    ASSERT_NE(cpu, nullptr) << name;
    ASSERT_NE(gpu, nullptr) << name;
    EXPECT_TRUE(cpu->is_cpu()) << name;
    EXPECT_TRUE(gpu->is_cuda()) << name;
    EXPECT_TRUE(torch::equal(*cpu, value)) << name;
    EXPECT_TRUE(torch::equal(gpu->cpu(), value)) << name;
  }
}

}  // namespace
}  // namespace flatparam
