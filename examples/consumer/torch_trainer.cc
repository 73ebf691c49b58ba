// A LibTorch trainer in another team's workspace: a torch::nn::Module
// sharded with flatparam's FsdpModule (@flatparam//:torch) over MPI, or
// over c10d when torchrun started it (@flatparam//:c10d), trained with
// torch::optim::AdamW, saved as a sharded checkpoint and loaded back into
// a fresh model. Exits non-zero when the loss does not fall or the loaded
// model differs from the trained one.
//
//   mpirun -np 2 bazel-bin/torch_trainer CHECKPOINT_DIR
//   torchrun --nproc_per_node=2 --no_python bazel-bin/torch_trainer DIR
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "comm/c10d/c10d_communicator.h"
#include "comm/mpi/mpi_communicator.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/checkpoint/file_system.h"
#include "flatparam/device/device.h"
#include "flatparam/torch/fsdp_module.h"

namespace {

struct Mlp : torch::nn::Module {
  Mlp() {
    embed = register_module("embed", torch::nn::Linear(16, 64));
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int i = 0; i < 3; ++i) blocks->push_back(torch::nn::Linear(64, 64));
    head = register_module("head", torch::nn::Linear(64, 1));
  }
  torch::nn::Linear embed{nullptr}, head{nullptr};
  torch::nn::ModuleList blocks{nullptr};
};

// The forward with each block as its FSDP unit.
absl::StatusOr<torch::Tensor> Forward(Mlp& model,
                                      flatparam::libtorch::FsdpModule& fsdp,
                                      const torch::Tensor& x) {
  return fsdp.Forward([&]() -> absl::StatusOr<torch::Tensor> {
    torch::Tensor h = torch::relu(model.embed(x));
    for (size_t i = 0; i < model.blocks->size(); ++i) {
      auto block = model.blocks[i]->as<torch::nn::Linear>();
      FLATPARAM_ASSIGN_OR_RETURN(h, fsdp.Unit(absl::StrCat("blocks.", i), [&] {
        return torch::relu(block->forward(h));
      }));
    }
    return model.head(h);
  });
}

// This rank's batch of `step`: y = 0.1 * sum(x), learnable by the MLP.
std::pair<torch::Tensor, torch::Tensor> Batch(int rank, int step) {
  torch::manual_seed(1000 * step + rank);
  torch::Tensor x = torch::randn({16, 16});
  return {x, 0.1 * x.sum(1, /*keepdim=*/true)};
}

absl::Status Run(flatparam::Communicator& world, const std::string& dir) {
  flatparam::HostDeviceOps device;
  flatparam::libtorch::FsdpOptions options;
  options.wrap = {"blocks.*"};
  options.sync_module_states = true;     // every rank starts from rank 0's
  torch::manual_seed(7 + world.rank());  // different until synced
  auto model = std::make_shared<Mlp>();
  FLATPARAM_ASSIGN_OR_RETURN(auto fsdp, flatparam::libtorch::FsdpModule::Wrap(
                                            model, &world, &device, options));
  torch::optim::AdamW adamw(fsdp->ShardedParameters(),
                            torch::optim::AdamWOptions(3e-3));
  constexpr int kSteps = 60;
  float first = 0, last = 0;
  for (int step = 0; step < kSteps; ++step) {
    auto [x, y] = Batch(world.rank(), step);
    FLATPARAM_ASSIGN_OR_RETURN(torch::Tensor out, Forward(*model, *fsdp, x));
    torch::Tensor loss = torch::mse_loss(out, y);
    if (step < 5) first += loss.item<float>() / 5;
    if (step >= kSteps - 5) last += loss.item<float>() / 5;
    FLATPARAM_RETURN_IF_ERROR(fsdp->Backward(loss));
    adamw.step();
    FLATPARAM_RETURN_IF_ERROR(fsdp->ZeroGrad());
  }
  if (world.rank() == 0) {
    std::printf("torch_trainer: %d ranks, loss %.4f -> %.4f\n", world.size(),
                first, last);
  }
  if (!(last < first / 2)) {
    return absl::InternalError(
        absl::StrFormat("rank %d: the loss did not fall: %.4f -> %.4f",
                        world.rank(), first, last));
  }

  // Save sharded, load into a fresh model, compare the full state dicts.
  flatparam::checkpoint::FileSystem& fs =
      flatparam::checkpoint::PosixFileSystem();
  FLATPARAM_RETURN_IF_ERROR(fsdp->SaveCheckpoint(fs, dir, &adamw));
  FLATPARAM_ASSIGN_OR_RETURN(auto trained, fsdp->FullStateDict());
  torch::manual_seed(99);
  auto fresh = std::make_shared<Mlp>();
  options.sync_module_states = false;
  FLATPARAM_ASSIGN_OR_RETURN(auto loaded, flatparam::libtorch::FsdpModule::Wrap(
                                              fresh, &world, &device, options));
  torch::optim::AdamW loaded_adamw(loaded->ShardedParameters(),
                                   torch::optim::AdamWOptions(3e-3));
  FLATPARAM_RETURN_IF_ERROR(loaded->LoadCheckpoint(fs, dir, &loaded_adamw));
  FLATPARAM_ASSIGN_OR_RETURN(auto back, loaded->FullStateDict());
  for (const auto& [name, tensor] : trained) {
    auto it = back.find(name);
    if (it == back.end() || !torch::equal(it->second, tensor)) {
      return absl::InternalError(
          absl::StrFormat("rank %d: %s differs after the checkpoint round trip",
                          world.rank(), name));
    }
  }
  return absl::OkStatus();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr,
                 "usage: mpirun -np N %s CHECKPOINT_DIR\n"
                 "       torchrun --nproc_per_node=N --no_python %s "
                 "CHECKPOINT_DIR\n",
                 argv[0], argv[0]);
    return 2;
  }
  torch::set_num_threads(1);
  const std::string dir = argv[1];
  int rank = -1;
  absl::Status status;
  if (std::getenv("TORCHELASTIC_RUN_ID") != nullptr) {
    // torchrun's worker: the world from its environment (a gloo group).
    auto world = flatparam::C10dCommunicator::FromEnvironment();
    status = world.status();
    if (world.ok()) {
      rank = (*world)->rank();
      status = Run(**world, dir);
    }
  } else {
    status = flatparam::RunOnMpiWorld([&](flatparam::MpiCommunicator& world) {
      rank = world.rank();
      return Run(world, dir);
    });
  }
  if (!status.ok()) {
    if (!flatparam::IsReported(status)) {
      std::fprintf(stderr, "torch_trainer: rank %d: %s\n", rank,
                   status.ToString().c_str());
    }
    return 1;
  }
  if (rank == 0) std::printf("torch_trainer: OK\n");
  return 0;
}
