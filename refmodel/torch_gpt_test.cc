#include "refmodel/torch_gpt.h"

#include <gtest/gtest.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/types.h>
#include <torch/utils.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/base/status_matchers.h"
#include "flatparam/checkpoint/file_system.h"
#include "flatparam/checkpoint/safetensors.h"
#include "flatparam/device/device.h"
#include "flatparam/interop/hf/hf_checkpoint.h"
#include "flatparam/torch/fsdp_module.h"
#include "sim/sim.h"

namespace flatparam {
namespace refmodel {
namespace {

constexpr char kText[] = "/usr/share/common-licenses/GPL-3";

GptConfig SmallConfig() {
  GptConfig config;
  config.n_positions = 32;
  config.n_embd = 32;
  config.n_layer = 2;
  config.n_head = 4;
  return config;
}

// The parameters every run starts from (made once, on one thread).
const std::map<std::string, torch::Tensor>& InitialParams() {
  static const auto* params = [] {
    torch::manual_seed(3);
    Gpt model(SmallConfig());
    auto* out = new std::map<std::string, torch::Tensor>();
    for (const auto& p : model->named_parameters()) {
      (*out)[p.key()] = p.value().detach().clone();
    }
    return out;
  }();
  return *params;
}

Gpt MakeGpt() {
  Gpt model(SmallConfig());
  torch::NoGradGuard no_grad;
  for (auto& p : model->named_parameters()) {
    p.value().copy_(InitialParams().at(p.key()));
  }
  return model;
}

torch::optim::AdamWOptions Adamw() {
  return torch::optim::AdamWOptions(3e-3).weight_decay(0.01);
}

const TextBatches& Text() {
  static const auto* text = [] {
    absl::StatusOr<TextBatches> t =
        TextBatches::FromFile(kText, SmallConfig().n_positions);
    if (!t.ok()) {
      std::fprintf(stderr, "%s\n", t.status().ToString().c_str());
      std::abort();
    }
    return new TextBatches(*std::move(t));
  }();
  return *text;
}

// Single-process training of `reference` (TrainFolded) on the text: `fold`
// steps from data step `first_step`, each virtual rank taking `local`
// samples. Rank 0's loss per step.
std::vector<float> TrainReference(Gpt& reference,
                                  torch::optim::Optimizer& adamw,
                                  const FoldOptions& fold, int64_t local,
                                  int first_step = 0) {
  return TrainFolded(*reference, adamw, fold, [&](int step, int, int rank) {
    torch::Tensor batch = Text().Batch(first_step + step, rank * local, local);
    return NextTokenLoss(reference->forward(batch.narrow(1, 0, Text().seq())),
                         batch);
  });
}

// TrainGptUnderFsdp of MakeGpt() on `world_size` simulated ranks; rank 0's
// run.
absl::StatusOr<GptFsdpRun> TrainOnSim(
    int world_size, int steps, int64_t local, const GptFsdpOptions& options,
    const std::function<absl::Status(
        libtorch::FsdpModule&, torch::optim::Optimizer&)>& after = nullptr) {
  SimOptions sim;
  sim.world_size = world_size;
  FLATPARAM_ASSIGN_OR_RETURN(std::unique_ptr<SimWorld> world,
                             SimWorld::Create(sim));
  GptFsdpRun run0;
  FLATPARAM_RETURN_IF_ERROR(
      world->Run([&](SimCommunicator& comm) -> absl::Status {
        HostDeviceOps device;
        Gpt model = MakeGpt();
        FLATPARAM_ASSIGN_OR_RETURN(
            GptFsdpRun run,
            TrainGptUnderFsdp(model, comm, device, Text(), steps, local,
                              Adamw(), nullptr, after, options));
        if (comm.rank() == 0) run0 = std::move(run);
        return absl::OkStatus();
      }));
  return run0;
}

void ExpectParamsEqual(const std::map<std::string, torch::Tensor>& got,
                       Gpt& reference) {
  ASSERT_FALSE(got.empty());
  for (const auto& [name, tensor] : got) {
    EXPECT_TRUE(
        torch::equal(tensor, reference->named_parameters()[name].detach()))
        << name;
  }
}

TEST(TorchGptTest, HuggingFaceNamesAndShapes) {
  Gpt model(GptConfig{});
  std::vector<std::string> names;
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const auto& p : model->named_parameters()) {
    names.push_back(p.key());
    shapes[p.key()] = p.value().sizes().vec();
  }
  const std::vector<std::string> block = {
      "ln_1.weight",      "ln_1.bias",          "attn.c_attn.weight",
      "attn.c_attn.bias", "attn.c_proj.weight", "attn.c_proj.bias",
      "ln_2.weight",      "ln_2.bias",          "mlp.c_fc.weight",
      "mlp.c_fc.bias",    "mlp.c_proj.weight",  "mlp.c_proj.bias"};
  std::vector<std::string> want = {"transformer.wte.weight",
                                   "transformer.wpe.weight"};
  for (int i = 0; i < 2; ++i) {
    for (const std::string& b : block) {
      want.push_back("transformer.h." + std::to_string(i) + "." + b);
    }
  }
  want.insert(want.end(), {"transformer.ln_f.weight", "transformer.ln_f.bias",
                           "lm_head.weight"});
  EXPECT_EQ(names, want);
  // Conv1D weights are [in, out], as GPT-2's.
  EXPECT_EQ(shapes["transformer.h.0.attn.c_attn.weight"],
            (std::vector<int64_t>{64, 192}));
  EXPECT_EQ(shapes["transformer.h.1.mlp.c_proj.weight"],
            (std::vector<int64_t>{256, 64}));
  EXPECT_EQ(model->lm_head->named_parameters()["weight"].unsafeGetTensorImpl(),
            model->transformer->wte->weight.unsafeGetTensorImpl());
}

// The GPT learns real text under FsdpModule (FULL_SHARD, 2 simulated
// ranks, AdamW): its loss falls far below the uniform baseline ln 256, and
// every parameter and loss is bitwise single-process LibTorch training
// with the ranks' gradients folded in FSDP's order.
TEST(TorchGptTest, LearnsTextUnderFsdpBitwiseAsSingleProcess) {
  constexpr int kWorld = 2;
  constexpr int kSteps = 150;
  constexpr int64_t kLocal = 4;
  Gpt reference = MakeGpt();
  torch::optim::AdamW reference_adamw(TrainableTensors(*reference), Adamw());
  FoldOptions fold;
  fold.world = kWorld;
  fold.steps = kSteps;
  std::vector<float> expected_losses =
      TrainReference(reference, reference_adamw, fold, kLocal);

  const std::string checkpoint_dir =
      absl::StrCat(std::getenv("TEST_TMPDIR"), "/gpt");
  absl::StatusOr<GptFsdpRun> run = TrainOnSim(
      kWorld, kSteps, kLocal, GptFsdpOptions{},
      [&](libtorch::FsdpModule& fsdp, torch::optim::Optimizer& adamw) {
        return fsdp.SaveCheckpoint(checkpoint::PosixFileSystem(),
                                   checkpoint_dir, &adamw);
      });
  ASSERT_THAT(run.status(), IsOk());
  const std::vector<float>& losses = run->losses;
  const std::map<std::string, torch::Tensor>& trained = run->full_state;

  ASSERT_EQ(losses.size(), static_cast<size_t>(kSteps));
  EXPECT_EQ(losses, expected_losses);
  // From the uniform baseline, ln 256 = 5.55, to well below it (the last
  // ten steps' mean; single batches are noisy).
  EXPECT_GT(losses.front(), 5.0f);
  float last = 0;
  for (int i = kSteps - 10; i < kSteps; ++i) last += losses[i] / 10;
  EXPECT_LT(last, 3.0f);
  for (int i = 0; i < kSteps; i += 15) {
    std::printf("step %3d  loss %.3f\n", i, losses[i]);
  }
  std::printf("last ten steps' mean loss %.3f\n", last);
  ExpectParamsEqual(trained, reference);

  // The checkpoint FsdpModule saved exports to Hugging Face safetensors
  // under GPT-2's names (as `fsdp checkpoint export` does).
  absl::StatusOr<checkpoint::HfExportReport> exported =
      checkpoint::ExportHfCheckpoint(checkpoint::PosixFileSystem(),
                                     checkpoint_dir, checkpoint_dir + "-hf");
  ASSERT_THAT(exported.status(), IsOk());
  EXPECT_GE(exported->tensors, static_cast<int64_t>(trained.size()));
}

// The GPT under every sharding strategy, with its blocks' activations
// recomputed inside or around their units or not at all, on 4 simulated
// ranks: every loss and parameter bitwise single-process LibTorch training
// (which does not recompute) with the ranks' gradients folded in FSDP's
// order.
struct GptCase {
  ShardingStrategy strategy;
  int shard_group_size;
  libtorch::Recomputation recompute;
};

class TorchGptStrategiesTest : public ::testing::TestWithParam<GptCase> {};

TEST_P(TorchGptStrategiesTest, BitwiseAsSingleProcess) {
  const GptCase& c = GetParam();
  constexpr int kWorld = 4;
  constexpr int kSteps = 3;
  constexpr int64_t kLocal = 2;
  Gpt reference = MakeGpt();
  torch::optim::AdamW reference_adamw(TrainableTensors(*reference), Adamw());
  FoldOptions fold;
  fold.world = kWorld;
  fold.shard_group_size = c.shard_group_size;
  fold.steps = kSteps;
  std::vector<float> expected_losses =
      TrainReference(reference, reference_adamw, fold, kLocal);

  GptFsdpOptions options;
  options.strategy = c.strategy;
  options.shard_group_size = c.shard_group_size;
  options.recompute = c.recompute;
  absl::StatusOr<GptFsdpRun> run = TrainOnSim(kWorld, kSteps, kLocal, options);
  ASSERT_THAT(run.status(), IsOk());
  EXPECT_EQ(run->losses, expected_losses);
  ExpectParamsEqual(run->full_state, reference);
}

INSTANTIATE_TEST_SUITE_P(
    Strategies, TorchGptStrategiesTest,
    ::testing::Values(GptCase{ShardingStrategy::kFullShard, 0,
                              libtorch::Recomputation::kNone},
                      GptCase{ShardingStrategy::kFullShard, 0,
                              libtorch::Recomputation::kInsideUnit},
                      GptCase{ShardingStrategy::kFullShard, 0,
                              libtorch::Recomputation::kAroundUnit},
                      GptCase{ShardingStrategy::kShardGradOp, 0,
                              libtorch::Recomputation::kInsideUnit},
                      GptCase{ShardingStrategy::kNoShard, 0,
                              libtorch::Recomputation::kAroundUnit},
                      GptCase{ShardingStrategy::kHybridShard, 2,
                              libtorch::Recomputation::kAroundUnit},
                      GptCase{ShardingStrategy::kHybridShardZero2, 2,
                              libtorch::Recomputation::kInsideUnit}),
    [](const ::testing::TestParamInfo<GptCase>& info) {
      return absl::StrCat(ShardingStrategyName(info.param.strategy), "_",
                          libtorch::RecomputationName(info.param.recompute));
    });

// Save, reshard, resume: two steps on 2 ranks (FULL_SHARD) saved with
// AdamW's state, loaded on 4 ranks (HYBRID_SHARD in pairs, each block
// recomputed inside its unit), two more steps: every loss and parameter is
// bitwise single-process training that folds the first steps' gradients
// over 2 ranks and the next over 4 (the same global batch of 8).
TEST(TorchGptTest, SavesReshardsAndResumesBitwise) {
  const std::string dir = absl::StrCat(std::getenv("TEST_TMPDIR"), "/resume");
  Gpt reference = MakeGpt();
  torch::optim::AdamW reference_adamw(TrainableTensors(*reference), Adamw());
  FoldOptions before;
  before.world = 2;
  before.steps = 2;
  std::vector<float> expected =
      TrainReference(reference, reference_adamw, before, 4);
  FoldOptions after;
  after.world = 4;
  after.shard_group_size = 2;
  after.steps = 2;
  for (float l : TrainReference(reference, reference_adamw, after, 2, 2)) {
    expected.push_back(l);
  }

  absl::StatusOr<GptFsdpRun> first = TrainOnSim(
      2, 2, 4, GptFsdpOptions{},
      [&](libtorch::FsdpModule& fsdp, torch::optim::Optimizer& adamw) {
        return fsdp.SaveCheckpoint(checkpoint::PosixFileSystem(), dir, &adamw);
      });
  ASSERT_THAT(first.status(), IsOk());
  GptFsdpOptions resumed;
  resumed.strategy = ShardingStrategy::kHybridShard;
  resumed.shard_group_size = 2;
  resumed.recompute = libtorch::Recomputation::kInsideUnit;
  resumed.first_step = 2;
  resumed.before = [&](libtorch::FsdpModule& fsdp,
                       torch::optim::Optimizer& adamw) {
    return fsdp.LoadCheckpoint(checkpoint::PosixFileSystem(), dir, &adamw);
  };
  absl::StatusOr<GptFsdpRun> second = TrainOnSim(4, 2, 2, resumed);
  ASSERT_THAT(second.status(), IsOk());

  std::vector<float> losses = first->losses;
  losses.insert(losses.end(), second->losses.begin(), second->losses.end());
  EXPECT_EQ(losses, expected);
  ExpectParamsEqual(second->full_state, reference);
}

// A GPT-2 checkpoint as Hugging Face publishes it ("gpt2"'s safetensors,
// saved from the bare GPT2Model: no "transformer." prefix, no lm_head,
// which is tied to the token embedding, and each attention's causal-mask
// buffers) imports into this GPT through flatparam's Hugging Face import,
// resharded for two ranks, and loads under FsdpModule: every parameter,
// the tied head included, equals the file's.
TEST(TorchGptTest, AGpt2SafetensorsCheckpointImports) {
  torch::manual_seed(11);
  Gpt source(SmallConfig());
  const int64_t n = SmallConfig().n_positions;
  std::vector<torch::Tensor> keep;  // alive until written
  std::vector<checkpoint::TensorSource> tensors;
  for (const auto& p : source->named_parameters()) {
    if (p.key() == "lm_head.weight") continue;  // tied: not in the file
    torch::Tensor t = p.value().detach().contiguous();
    keep.push_back(t);
    tensors.push_back(checkpoint::TensorSourceFromBytes(
        p.key().substr(std::string("transformer.").size()), DType::kFloat32,
        t.sizes().vec(), t.data_ptr()));
  }
  for (int64_t i = 0; i < SmallConfig().n_layer; ++i) {
    torch::Tensor mask = torch::tril(torch::ones({n, n})).view({1, 1, n, n});
    torch::Tensor masked = torch::full({}, -1e4);
    keep.push_back(mask);
    keep.push_back(masked);
    const std::string block = absl::StrCat("h.", i, ".attn.");
    tensors.push_back(checkpoint::TensorSourceFromBytes(
        block + "bias", DType::kFloat32, {1, 1, n, n}, mask.data_ptr()));
    tensors.push_back(checkpoint::TensorSourceFromBytes(
        block + "masked_bias", DType::kFloat32, {}, masked.data_ptr()));
  }
  const std::string dir = absl::StrCat(std::getenv("TEST_TMPDIR"), "/gpt2");
  checkpoint::FileSystem& fs = checkpoint::PosixFileSystem();
  ASSERT_THAT(fs.CreateDir(dir), IsOk());
  {
    absl::StatusOr<std::unique_ptr<checkpoint::WritableFile>> file =
        fs.NewWritableFile(dir + "/model.safetensors");
    ASSERT_THAT(file.status(), IsOk());
    ASSERT_THAT(checkpoint::WriteSafetensors(**file, "model.safetensors",
                                             tensors, {{"format", "pt"}}),
                IsOk());
    ASSERT_THAT((*file)->Close(), IsOk());
  }

  SimOptions sim;
  sim.world_size = 2;
  absl::StatusOr<std::unique_ptr<SimWorld>> world = SimWorld::Create(sim);
  ASSERT_THAT(world.status(), IsOk());
  std::map<std::string, torch::Tensor> loaded;
  ASSERT_THAT((*world)->Run([&](SimCommunicator& comm) -> absl::Status {
    HostDeviceOps device;
    Gpt model = MakeGpt();
    libtorch::FsdpOptions options;
    options.wrap = {"transformer.h.*"};
    FLATPARAM_ASSIGN_OR_RETURN(
        std::unique_ptr<libtorch::FsdpModule> fsdp,
        libtorch::FsdpModule::Wrap(model.ptr(), &comm, &device, options));
    if (comm.rank() == 0) {
      checkpoint::HfImportOptions import;
      import.names.add_prefix = "transformer.";
      import.ignored_suffixes = {".attn.bias", ".attn.masked_bias"};
      FLATPARAM_ASSIGN_OR_RETURN(
          checkpoint::HfImportReport report,
          checkpoint::ImportHfCheckpoint(fs, dir, fsdp->layout().spec(),
                                         fsdp->layout().options(), 2,
                                         dir + "-sharded", import));
      EXPECT_EQ(report.tied_copies, 0);
      EXPECT_EQ(report.ignored, 2 * SmallConfig().n_layer);
    }
    FLATPARAM_RETURN_IF_ERROR(comm.Barrier({}));
    FLATPARAM_RETURN_IF_ERROR(
        fsdp->LoadCheckpoint(fs, dir + "-sharded", nullptr));
    FLATPARAM_ASSIGN_OR_RETURN(auto state, fsdp->FullStateDict());
    if (comm.rank() == 0) loaded = std::move(state);
    return absl::OkStatus();
  }),
              IsOk());
  ASSERT_FALSE(loaded.empty());
  for (const auto& p : source->named_parameters()) {
    // The state dict names a tied parameter once: the head is the
    // embedding (checked under its own name).
    if (p.key() == "lm_head.weight") continue;
    ASSERT_TRUE(loaded.count(p.key())) << p.key();
    EXPECT_TRUE(torch::equal(loaded.at(p.key()), p.value().detach()))
        << p.key();
  }
}

// The bitwise comparisons rely on torch_test_main's single intra-op
// thread.
TEST(TorchTestMainTest, OneIntraOpThread) {
  EXPECT_EQ(torch::get_num_threads(), 1);
}

}  // namespace
}  // namespace refmodel
}  // namespace flatparam
