// The GPT learns GPL-3's text under FsdpModule across processes
// (FULL_SHARD, AdamW), bitwise single-process LibTorch training with the
// ranks' gradients folded in FSDP's order: the MPI and c10d backends fold
// reductions on the host in rank order, as the simulator does
// (torch_gpt_test), so the property holds across processes.
//
// A multi-process test, one binary per backend from this file (main() is
// the backend's MultirankGtestMain): torch_gpt_mpi_test_2 and _4 run it
// under mpirun, torch_gpt_c10d_test_2 and _4 as torchrun's workers. Every
// rank trains and compares its losses and the full state dict with the
// single-process run computed on that rank.
#include <gtest/gtest.h>
#include <torch/optim/adamw.h>
#include <torch/types.h>
#include <torch/utils.h>

#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "flatparam/base/status_matchers.h"
#include "flatparam/device/device.h"
#include "refmodel/torch_gpt.h"
#include "testing/multirank_test_main.h"

namespace flatparam {
namespace refmodel {
namespace {

Communicator* g_world = nullptr;  // Set up by main().

constexpr char kText[] = "/usr/share/common-licenses/GPL-3";

GptConfig SmallConfig() {
  GptConfig config;
  config.n_positions = 32;
  config.n_embd = 32;
  config.n_layer = 2;
  config.n_head = 4;
  return config;
}

// The same initial parameters on every rank and for the reference: the
// default generator seeded alike before construction.
Gpt MakeGpt() {
  torch::manual_seed(3);
  return Gpt(SmallConfig());
}

TEST(TorchGptMultiprocessTest, LearnsTextBitwiseAsSingleProcess) {
  ASSERT_NE(g_world, nullptr);
  const int world = g_world->size();
  constexpr int kSteps = 60;
  constexpr int64_t kLocal = 2;
  absl::StatusOr<TextBatches> text =
      TextBatches::FromFile(kText, SmallConfig().n_positions);
  ASSERT_THAT(text.status(), IsOk());
  const auto adamw = torch::optim::AdamWOptions(3e-3).weight_decay(0.01);

  HostDeviceOps device;
  Gpt model = MakeGpt();
  absl::StatusOr<GptFsdpRun> run =
      TrainGptUnderFsdp(model, *g_world, device, *text, kSteps, kLocal, adamw);
  ASSERT_THAT(run.status(), IsOk());

  Gpt reference = MakeGpt();
  torch::optim::AdamW reference_adamw(TrainableTensors(*reference), adamw);
  FoldOptions fold;
  fold.world = world;
  fold.steps = kSteps;
  // Rank 0's losses are the reference's; every rank checks its own.
  std::vector<float> rank_losses;
  const std::vector<float> expected = TrainFolded(
      *reference, reference_adamw, fold, [&](int step, int, int rank) {
        torch::Tensor batch = text->Batch(step, rank * kLocal, kLocal);
        torch::Tensor loss = NextTokenLoss(
            reference->forward(batch.narrow(1, 0, text->seq())), batch);
        if (rank == g_world->rank()) rank_losses.push_back(loss.item<float>());
        return loss;
      });
  EXPECT_EQ(run->losses, rank_losses);
  if (g_world->rank() == 0) {
    EXPECT_EQ(run->losses, expected);
  }
  for (const auto& [name, tensor] : run->full_state) {
    EXPECT_TRUE(
        torch::equal(tensor, reference->named_parameters()[name].detach()))
        << name;
  }
  // It learns: from the uniform baseline (ln 256 = 5.55) to well below.
  float last = 0;
  for (int i = kSteps - 10; i < kSteps; ++i) last += expected[i] / 10;
  EXPECT_GT(expected.front(), 5.0f);
  EXPECT_LT(last, 4.0f);
  if (g_world->rank() == 0) {
    std::printf("%d ranks: loss %.3f -> %.3f (last ten steps' mean)\n", world,
                expected.front(), last);
  }
}

}  // namespace
}  // namespace refmodel
}  // namespace flatparam

int main(int argc, char** argv) {
  // One intra-op thread: LibTorch's kernels then reduce in one order.
  torch::set_num_threads(1);
  return flatparam::MultirankGtestMain(&argc, argv,
                                       &flatparam::refmodel::g_world);
}
