// A small LibTorch network and its training, single-process and under
// FsdpModule, shared by the LibTorch integration's tests (simulator and
// MPI). Test-only.
//
// The network: a tied embedding and head and pre-norm residual blocks
// ("h.0", "h.1", ...), each block an FSDP unit. TrainReference trains it in
// one process with the ranks' gradients folded as FSDP's reduction folds
// them; TrainFsdpOnRank trains it under FsdpModule on one rank of any
// communicator; for every case the two agree bit for bit.
//
// Thread-safety: InitialParams() is made once (thread-safe); the rest are
// functions of their arguments (MakeNet overwrites what the default
// generator drew).
#ifndef TESTING_TORCH_TESTUTIL_H_
#define TESTING_TORCH_TESTUTIL_H_

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/optim/optimizer.h>
#include <torch/types.h>
#include <torch/utils.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "comm/communicator.h"
#include "flatparam/device/device.h"
#include "flatparam/layout.h"
#include "flatparam/torch/fsdp_module.h"

namespace flatparam {
namespace libtorch {
namespace testing {

// A pre-norm residual block (layer norm, two linears): an FSDP unit.
struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(int64_t d);
  torch::Tensor forward(const torch::Tensor& x);
  torch::nn::LayerNorm ln{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Block);

// Embedding "wte", blocks "h.i", final norm "ln_f", and the head
// "lm_head.weight", which is the embedding's tensor under a second name.
struct NetImpl : torch::nn::Module {
  NetImpl(int64_t vocab, int64_t d, int layers);
  torch::Tensor Head(const torch::Tensor& x);
  torch::nn::Embedding wte{nullptr};
  torch::nn::ModuleList h{nullptr};
  torch::nn::LayerNorm ln_f{nullptr};
  std::shared_ptr<torch::nn::Module> lm_head;
};
TORCH_MODULE(Net);

constexpr int64_t kVocab = 11;
constexpr int64_t kDim = 6;
constexpr int kLayers = 3;
constexpr int64_t kSeq = 5;

// The initial parameters every run starts from, by name.
const std::map<std::string, torch::Tensor>& InitialParams();
// The network at InitialParams(); `frozen_prefix` freezes the parameters
// whose names start with it.
Net MakeNet(const std::string& frozen_prefix = "");
// Samples [first_sample, first_sample + samples) of data step `step`:
// kSeq + 1 tokens each (inputs, and targets shifted by one).
torch::Tensor Tokens(int64_t step, int64_t first_sample, int64_t samples);
// Mean next-token cross-entropy.
torch::Tensor Loss(const torch::Tensor& logits, const torch::Tensor& tokens);

enum class Optim { kSgd, kAdamW };
// SGD (momentum, weight decay) or AdamW (weight decay) over `params`.
std::unique_ptr<torch::optim::Optimizer> MakeOptimizer(
    Optim optim, std::vector<torch::Tensor> params);

struct Case {
  int world = 2;
  ShardingStrategy strategy = ShardingStrategy::kFullShard;
  int shard_group_size = 0;
  Optim optim = Optim::kAdamW;
  int steps = 3;
  int64_t global_batch = 4;
  // Parameters frozen by name prefix ("h.0.": a whole unit).
  std::string frozen;
  // Micro-batches per step, all but the last under no_sync.
  int micro_batches = 1;
  bool cpu_offload = false;
  // Each block's activations recomputed in the backward, inside or around
  // its unit (FsdpModule::RecomputedUnit); the reference does not
  // recompute.
  Recomputation recompute = Recomputation::kNone;
};
// A name for the case, for test names.
std::string Name(const Case& c);

// Single-process training of the case's global batch
// (refmodel::TrainFolded); every
// parameter by name afterwards.
std::map<std::string, torch::Tensor> TrainReference(const Case& c);

struct FsdpResult {
  // The full state dict after training (FsdpModule::FullStateDict), and
  // the hooks' statistics.
  std::map<std::string, torch::Tensor> state;
  FsdpModuleStats stats;
};
// The case's training under FsdpModule on this rank of `world` (of
// c.world ranks): collective.
absl::StatusOr<FsdpResult> TrainFsdpOnRank(Communicator& world,
                                           DeviceOps& device, const Case& c);
// The same on `device`, with the handles' work on `streams` of its ops.
absl::StatusOr<FsdpResult> TrainFsdpOnRank(Communicator& world,
                                           TorchDevice& device, const Case& c,
                                           const HandleStreams& streams = {});

// The whole forward of `net` under `fsdp`, one unit per block, each
// recomputed in the backward at `recompute`; `check` runs inside each
// block's unit (again in a recompute).
absl::StatusOr<torch::Tensor> ForwardNet(
    Net& net, FsdpModule& fsdp, const torch::Tensor& tokens,
    const std::function<void(BlockImpl&)>& check = nullptr,
    Recomputation recompute = Recomputation::kNone);

}  // namespace testing
}  // namespace libtorch
}  // namespace flatparam

#endif  // TESTING_TORCH_TESTUTIL_H_
