// RunTorchDemo with LibTorch (see demo_torch.h).
#include "tools/demo_torch.h"

#include <torch/optim/adamw.h>
#include <torch/types.h>
#include <torch/utils.h>

#include <chrono>
#include <cstdint>
#include <fstream>
#include <map>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"
#include "comm/communicator.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/device/device.h"
#include "flatparam/torch/fsdp_module.h"
#include "refmodel/torch_gpt.h"
#include "sim/sim.h"

namespace flatparam {
namespace tools {
namespace {

constexpr char kText[] = "/usr/share/common-licenses/GPL-3";
constexpr int kWorld = 4;
constexpr int64_t kLocalBatch = 2;

refmodel::GptConfig DemoConfig() {
  refmodel::GptConfig config;
  config.n_positions = 32;
  config.n_embd = 32;
  config.n_layer = 2;
  config.n_head = 4;
  return config;
}

torch::optim::AdamWOptions DemoAdamW() {
  return torch::optim::AdamWOptions(3e-3).weight_decay(0.01);
}

}  // namespace

absl::StatusOr<TorchDemoResult> RunTorchDemo(int steps, uint64_t seed,
                                             std::ostream& out,
                                             Communicator* world) {
  TorchDemoResult result;
  result.text_path = kText;
  const int world_size = world != nullptr ? world->size() : kWorld;
  result.world_size = world_size;
  if (!std::ifstream(kText)) {
    result.skipped = absl::StrFormat(
        "%s is missing (Debian's base-files "
        "package ships it)",
        kText);
    return result;
  }
  const auto start = std::chrono::steady_clock::now();
  // One intra-op thread: LibTorch's kernels then reduce in one order, so
  // the runs can be compared bit for bit.
  torch::set_num_threads(1);
  FLATPARAM_ASSIGN_OR_RETURN(
      refmodel::TextBatches text,
      refmodel::TextBatches::FromFile(kText, DemoConfig().n_positions));

  // The initial parameters, made once on this thread.
  torch::manual_seed(seed);
  std::map<std::string, torch::Tensor> initial;
  {
    refmodel::Gpt model(DemoConfig());
    for (const auto& p : model->named_parameters()) {
      initial[p.key()] = p.value().detach().clone();
    }
    for (const torch::Tensor& p : refmodel::TrainableTensors(*model)) {
      result.parameters += p.numel();
    }
  }
  auto make = [&] {
    refmodel::Gpt model(DemoConfig());
    torch::NoGradGuard no_grad;
    for (auto& p : model->named_parameters()) {
      p.value().copy_(initial.at(p.key()));
    }
    return model;
  };

  std::map<std::string, torch::Tensor> trained;
  auto train = [&](Communicator& comm) -> absl::Status {
    HostDeviceOps device;
    refmodel::Gpt model = make();
    // Recomputation, as transformers are trained at scale: the forward
    // keeps only each block's input.
    refmodel::GptFsdpOptions gpt_options;
    gpt_options.recompute = libtorch::Recomputation::kInsideUnit;
    const bool first = comm.rank() == 0;
    // Under torchrun every process is one rank and checks its own result.
    const bool keep = first || world != nullptr;
    FLATPARAM_ASSIGN_OR_RETURN(
        refmodel::GptFsdpRun run,
        refmodel::TrainGptUnderFsdp(
            model, comm, device, text, steps, kLocalBatch, DemoAdamW(),
            [&](int step, float loss) {
              if (first && (step % 25 == 0 || step == steps - 1)) {
                out << absl::StrFormat("      step %3d  loss %.3f\n", step,
                                       loss);
                out.flush();
              }
            },
            nullptr, gpt_options));
    if (keep) {
      result.losses = std::move(run.losses);
      trained = std::move(run.full_state);
    }
    return absl::OkStatus();
  };
  if (world != nullptr) {
    FLATPARAM_RETURN_IF_ERROR(train(*world));
  } else {
    SimOptions sim;
    sim.world_size = kWorld;
    sim.seed = seed;
    FLATPARAM_ASSIGN_OR_RETURN(std::unique_ptr<SimWorld> sim_world,
                               SimWorld::Create(sim));
    FLATPARAM_RETURN_IF_ERROR(sim_world->Run(
        [&](SimCommunicator& comm) -> absl::Status { return train(comm); }));
  }

  if (world == nullptr || world->rank() == 0) {
    out << "      the same training in one process, folding the ranks' "
           "gradients in FSDP's order\n";
    out.flush();
  }
  refmodel::Gpt reference = make();
  torch::optim::AdamW adamw(refmodel::TrainableTensors(*reference),
                            DemoAdamW());
  refmodel::FoldOptions fold;
  fold.world = world_size;
  fold.steps = steps;
  result.reference_losses = refmodel::TrainFolded(
      *reference, adamw, fold, [&](int step, int, int rank) {
        torch::Tensor batch = text.Batch(step, rank * kLocalBatch, kLocalBatch);
        return refmodel::NextTokenLoss(
            reference->forward(batch.narrow(1, 0, text.seq())), batch);
      });
  result.params_equal = !trained.empty();
  auto named = reference->named_parameters();
  for (const auto& [name, tensor] : trained) {
    const torch::Tensor* want = named.find(name);
    result.params_equal = result.params_equal && want != nullptr &&
                          torch::equal(tensor, want->detach());
  }
  result.ran = true;
  result.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
  return result;
}

}  // namespace tools
}  // namespace flatparam
