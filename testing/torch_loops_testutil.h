// Training loops as LibTorch users write them, each run under FsdpModule on
// one rank of any communicator and checked bit for bit against the same
// loop in plain single-process LibTorch (the ranks' gradients folded as
// FSDP's reduction folds them, refmodel::TrainFolded). Shared by the
// simulator test (fsdp_module_loops_test) and the MPI one
// (fsdp_module_mpi_test). Test-only.
//
// Each loop is collective: every rank of `world` calls it with the same
// options; it returns OK when this rank's parameters (and whatever else
// the loop checks) equal the reference's, and an error naming the first
// difference otherwise.
//
// Thread-safety: the initial parameters are made once (thread-safe); the
// loops are functions of their arguments.
#ifndef TESTING_TORCH_LOOPS_TESTUTIL_H_
#define TESTING_TORCH_LOOPS_TESTUTIL_H_

#include <torch/autograd.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/optim/optimizer.h>
#include <torch/types.h>
#include <torch/utils.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "comm/communicator.h"
#include "flatparam/device/device.h"
#include "flatparam/layout.h"
#include "flatparam/torch/fsdp_module.h"

namespace flatparam {
namespace libtorch {
namespace testing {

struct LoopOptions {
  ShardingStrategy strategy = ShardingStrategy::kFullShard;
  // Hybrid strategies: ranks per shard group (0: the world).
  int shard_group_size = 0;
  Recomputation recompute = Recomputation::kNone;
  bool use_orig_params = false;
  // The handles' streams on the device's ops (created by the caller, with
  // the same ids on every rank).
  HandleStreams streams;
};
std::string LoopName(const LoopOptions& o);

// A LoRA block: a frozen layer norm and linear layer plus trainable
// low-rank adapters `lora_a` [r, d] and `lora_b` [d, r] in the same block.
struct LoraBlockImpl : torch::nn::Module {
  LoraBlockImpl(int64_t d, int64_t r);
  torch::Tensor forward(const torch::Tensor& x);
  torch::nn::LayerNorm ln{nullptr};
  torch::nn::Linear fc{nullptr};
  torch::Tensor lora_a, lora_b;
};
TORCH_MODULE(LoraBlock);

// A frozen embedding "wte" (tied to the head), LoRA blocks "h.i" and a
// frozen final norm "ln_f": only the adapters train.
struct LoraNetImpl : torch::nn::Module {
  LoraNetImpl(int64_t vocab, int64_t d, int64_t r, int layers);
  torch::Tensor forward(const torch::Tensor& tokens);
  torch::nn::Embedding wte{nullptr};
  torch::nn::ModuleList h{nullptr};
  torch::nn::LayerNorm ln_f{nullptr};
};
TORCH_MODULE(LoraNet);
inline constexpr int kLoraLayers = 4;

// LoRA fine-tuning with AdamW (weight decay 0.01, LibTorch's default) for
// `steps` steps, use_orig_params on: the frozen weights stay bitwise
// unchanged, the adapters are bitwise single-process training, and the
// peak unsharded-parameter memory of the rank (FULL_SHARD) is at most
// root + 2 x the largest block's padded unsharded bytes (the root kept,
// the unit whose backward runs, the one BACKWARD_PRE prefetched), where
// keeping the mixed units gathered until the backward's end would take
// root + kLoraLayers x block. `*peak` and `*bound` get the figures.
absl::Status LoraLoop(Communicator& world, TorchDevice& device,
                      const LoopOptions& options, int steps, int64_t* peak,
                      int64_t* bound);

// A weight reached twice in one backward: each block also reads the tied
// embedding (owned by the root unit), and block h.0 is applied twice; the
// blocks are recomputed per options.recompute, in the reference too.
absl::Status SharedWeightLoop(Communicator& world, TorchDevice& device,
                              const LoopOptions& options, int steps);

// torch::autograd::grad() over the module's parameters between steps: it
// returns their gradients, leaves ShardedParameters()' gradients as they
// were (None) and reduces nothing; gradients of gradients
// (create_graph) are refused with an error that says so, and the module
// trains on afterwards, bitwise the loop without them.
absl::Status AutogradGradLoop(Communicator& world, TorchDevice& device,
                              const LoopOptions& options);

// requires_grad changed on module parameters between steps (a block's
// fc1 frozen after step 1 and unfrozen after step 3, with use_orig_params;
// a whole block without it): bitwise the reference making the same
// changes.
absl::Status RequiresGradChangeLoop(Communicator& world, TorchDevice& device,
                                    const LoopOptions& options);

// The optimizer's own set-to-None zero_grad (each parameter's grad()
// reset) instead of FsdpModule::ZeroGrad: bitwise the reference.
absl::Status SetToNoneLoop(Communicator& world, TorchDevice& device,
                           const LoopOptions& options);

// Train, evaluate under torch::NoGradGuard (and with gradients on, a loss
// never back-propagated), save a checkpoint, load it into a fresh wrap,
// train on: bitwise the loop without evaluation.
absl::Status EvaluateThenSaveLoop(Communicator& world, TorchDevice& device,
                                  const LoopOptions& options,
                                  const std::string& dir);

// Train two steps, SaveDcpCheckpoint into `dir` (new), load it with
// LoadDcpCheckpoint into a fresh wrap and optimizer, train two more:
// bitwise the four-step reference.
absl::Status DcpResumeLoop(Communicator& world, TorchDevice& device,
                           const LoopOptions& options, const std::string& dir);

// With `again` empty: trains two steps and saves a DCP directory to `dir`.
// Otherwise: loads `dir` (saved at any world size) into a fresh wrap and
// optimizer and saves them to `again` at this world size.
absl::Status DcpSaveOrReshardLoop(Communicator& world, TorchDevice& device,
                                  const LoopOptions& options,
                                  const std::string& dir,
                                  const std::string& again);

// Inside each step, between the forward and the backward: ZeroGrad (the
// loop that zeroes after the forward) and an evaluation forward under
// torch::NoGradGuard; the step still trains bitwise as the reference.
absl::Status InsideAStepLoop(Communicator& world, TorchDevice& device,
                             const LoopOptions& options);

// Each block returns two tensors (its output and an auxiliary loss from
// its own parameters) and the loss adds the auxiliary ones: bitwise the
// reference.
absl::Status SeveralOutputsLoop(Communicator& world, TorchDevice& device,
                                const LoopOptions& options);

// AdamW with PyTorch's usual two parameter groups, built by name with
// use_orig_params: weight decay for the matrices, none for biases, norms
// and the embedding, and micro-batches under FsdpModule::NoSync(); saved
// and loaded (the checkpoint keeps the groups' names) halfway: bitwise the
// reference with the same groups.
absl::Status ParamGroupsLoop(Communicator& world, TorchDevice& device,
                             const LoopOptions& options,
                             const std::string& dir);

// A small network with BatchNorm: blocks "h.i" of Linear + BatchNorm1d,
// a head; buffers: each norm's running statistics and batch count.
struct BnBlockImpl : torch::nn::Module {
  BnBlockImpl()
      : fc(register_module("fc", torch::nn::Linear(6, 6))),
        bn(register_module("bn", torch::nn::BatchNorm1d(6))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    return x + torch::relu(bn(fc(x)));
  }
  torch::nn::Linear fc;
  torch::nn::BatchNorm1d bn;
};
TORCH_MODULE(BnBlock);
struct BnNetImpl : torch::nn::Module {
  BnNetImpl() {
    h = register_module("h", torch::nn::ModuleList());
    for (int i = 0; i < 2; ++i) h->push_back(BnBlock());
    head = register_module("head", torch::nn::Linear(6, 3));
  }
  torch::nn::ModuleList h{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(BnNet);

// The network with its initial parameters (the same in every call and on
// every rank).
BnNet MakeBnNet();

// One step of the BN network under FsdpModule on this rank's batch (each
// rank's differs, so each rank's running statistics do).
absl::Status BnStep(BnNet& net, FsdpModule& fsdp,
                    torch::optim::Optimizer& optimizer, int step, int rank);

// OK when `a` and `b` have the same keys in the same order and equal
// tensors; otherwise an error naming the first that differs.
absl::Status ExpectSameDict(
    const torch::OrderedDict<std::string, torch::Tensor>& a,
    const torch::OrderedDict<std::string, torch::Tensor>& b);

// The BN network trained 2 steps, saved with SaveCheckpoint into `dir`,
// loaded into a fresh wrap with LoadCheckpoint and trained 2 more: this
// rank's StateDict (its parameters and its own running statistics) is
// bitwise that of 4 steps straight.
absl::Status BatchNormCheckpointLoop(Communicator& world, TorchDevice& device,
                                     const std::string& dir);

}  // namespace testing
}  // namespace libtorch
}  // namespace flatparam

#endif  // TESTING_TORCH_LOOPS_TESTUTIL_H_
