// A GPT-2-style decoder written with LibTorch modules, with Hugging Face's
// GPT-2 parameter names (GPT2LMHeadModel: "transformer.wte.weight",
// "transformer.h.0.attn.c_attn.weight", ..., "lm_head.weight" tied to the
// token embedding), so that a GPT-2 checkpoint in safetensors imports into
// it; byte-level text batches to train it on; and the single-process
// reference trainer that reproduces FSDP's gradient fold (TrainFolded).
// Not the product: the model FsdpModule (flatparam/torch) is shown and
// tested on.
//
//   GptConfig config;                              // byte-level, tiny
//   Gpt model(config);
//   torch::Tensor logits = model->forward(tokens); // [batch, seq, vocab]
//
// Under FsdpModule each block "transformer.h.i" is a unit (GptForward runs
// the forward with the unit calls).
//
// The layers are GPT-2's: learned token and position embeddings; per block
// a pre-norm causal self-attention (fused q/k/v projection "c_attn" and an
// output projection "c_proj", both Conv1D: weight [in, out]) and a pre-norm
// MLP (4x, GELU with the tanh approximation, "gelu_new"); a final layer
// norm and the tied head. Initialization as GPT-2's: normal(0, 0.02)
// weights, zero biases, unit layer norms, the residual projections scaled
// by 1/sqrt(2 * n_layer).
//
// Thread-safety: a module is used by one thread at a time; the functions
// are pure.
#ifndef FLATPARAM_REFMODEL_TORCH_GPT_H_
#define FLATPARAM_REFMODEL_TORCH_GPT_H_

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/normalization.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/types.h>
#include <torch/utils.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "comm/communicator.h"
#include "flatparam/device/device.h"
#include "flatparam/layout.h"
#include "flatparam/torch/fsdp_module.h"

namespace flatparam {
namespace refmodel {

struct GptConfig {
  int64_t vocab_size = 256;  // bytes
  int64_t n_positions = 64;
  int64_t n_embd = 64;
  int64_t n_layer = 2;
  int64_t n_head = 4;
};

// GPT-2's Conv1D: y = x W + b with W of shape [in, out].
struct Conv1DImpl : torch::nn::Module {
  Conv1DImpl(int64_t in, int64_t out);
  torch::Tensor forward(const torch::Tensor& x);
  torch::Tensor weight, bias;
};
TORCH_MODULE(Conv1D);

struct GptAttentionImpl : torch::nn::Module {
  explicit GptAttentionImpl(const GptConfig& config);
  torch::Tensor forward(const torch::Tensor& x);
  int64_t n_head;
  Conv1D c_attn{nullptr}, c_proj{nullptr};
};
TORCH_MODULE(GptAttention);

struct GptMlpImpl : torch::nn::Module {
  explicit GptMlpImpl(const GptConfig& config);
  torch::Tensor forward(const torch::Tensor& x);
  Conv1D c_fc{nullptr}, c_proj{nullptr};
};
TORCH_MODULE(GptMlp);

struct GptBlockImpl : torch::nn::Module {
  explicit GptBlockImpl(const GptConfig& config);
  torch::Tensor forward(const torch::Tensor& x);
  torch::nn::LayerNorm ln_1{nullptr}, ln_2{nullptr};
  GptAttention attn{nullptr};
  GptMlp mlp{nullptr};
};
TORCH_MODULE(GptBlock);

struct GptTransformerImpl : torch::nn::Module {
  explicit GptTransformerImpl(const GptConfig& config);
  torch::nn::Embedding wte{nullptr}, wpe{nullptr};
  torch::nn::ModuleList h{nullptr};
  torch::nn::LayerNorm ln_f{nullptr};
};
TORCH_MODULE(GptTransformer);

struct GptImpl : torch::nn::Module {
  // Initializes from LibTorch's default generator (seed it first).
  explicit GptImpl(const GptConfig& config);
  // Logits [batch, seq, vocab] of tokens [batch, seq] (seq <= n_positions).
  torch::Tensor forward(const torch::Tensor& tokens);
  // The pieces of the forward, for a forward with FSDP units between them.
  torch::Tensor Embed(const torch::Tensor& tokens);
  torch::Tensor Head(const torch::Tensor& x);
  GptBlockImpl& block(size_t i);

  GptConfig config;
  GptTransformer transformer{nullptr};
  // Holds "weight": transformer.wte's tensor under a second name.
  std::shared_ptr<torch::nn::Module> lm_head;
};
TORCH_MODULE(Gpt);

// The forward under `fsdp` with each block as its unit
// ("transformer.h.i"), as FsdpModule's wrap {"transformer.h.*"} makes them,
// each block's activations recomputed in the backward at `recompute`.
absl::StatusOr<torch::Tensor> GptForward(
    Gpt& model, libtorch::FsdpModule& fsdp, const torch::Tensor& tokens,
    libtorch::Recomputation recompute = libtorch::Recomputation::kNone);

// Mean next-token cross-entropy of `logits` for `tokens` shifted by one:
// logits [b, s, v] predict tokens [b, 1..s].
torch::Tensor NextTokenLoss(const torch::Tensor& logits,
                            const torch::Tensor& tokens);

// Byte-level text batches: sample i of step t is the `seq + 1` bytes at a
// pseudo-random offset of the text drawn by a std::mt19937_64 seeded with
// (t, i), so every run and every rank sees the same data.
class TextBatches {
 public:
  // Reads `path` whole. InvalidArgument if it is shorter than seq + 2
  // bytes; NotFound if it cannot be read.
  static absl::StatusOr<TextBatches> FromFile(const std::string& path,
                                              int64_t seq);
  TextBatches(std::string text, int64_t seq);
  // Samples [first, first + count) of step `step`: int64 [count, seq + 1].
  torch::Tensor Batch(int64_t step, int64_t first, int64_t count) const;
  int64_t seq() const { return seq_; }
  int64_t size() const { return static_cast<int64_t>(text_.size()); }

 private:
  std::string text_;
  int64_t seq_;
};

// The module's trainable tensors, each once (a tied tensor registered
// under two names is one), in registration order.
std::vector<torch::Tensor> TrainableTensors(torch::nn::Module& module);

struct FoldOptions {
  int world = 1;
  // Hybrid: ranks per shard group (0: the world).
  int shard_group_size = 0;
  int steps = 1;
  int micro_batches = 1;
};
// Single-process training of `module` (`optimizer` over its
// TrainableTensors) with FSDP's arithmetic: per step, each virtual rank's
// local gradients (autograd accumulating `loss(step, micro, rank)` over the
// micro-batches, as no_sync does) folded as FSDP's reduction folds them:
// per element, in float32, acc = g_0 / pre; acc = acc + g_r / pre in rank
// order; acc = acc / post (a division by exactly 1 skipped); hybrid: a
// fold per shard group, then the groups' sums in order. Then one
// optimizer step. Returns rank 0's last micro-batch loss per step.
std::vector<float> TrainFolded(
    torch::nn::Module& module, torch::optim::Optimizer& optimizer,
    const FoldOptions& options,
    const std::function<torch::Tensor(int step, int micro, int rank)>& loss);

// How TrainGptUnderFsdp shards and recomputes.
struct GptFsdpOptions {
  ShardingStrategy strategy = ShardingStrategy::kFullShard;
  // Hybrid strategies: ranks per shard group (0: the world).
  int shard_group_size = 0;
  libtorch::Recomputation recompute = libtorch::Recomputation::kNone;
  // The handles' streams on the device's ops (HandleOptions::streams).
  HandleStreams streams;
  // Resuming: the data step of the first step, and what runs once the
  // model is wrapped and its optimizer made, before the first step (a
  // checkpoint load, say).
  int first_step = 0;
  std::function<absl::Status(libtorch::FsdpModule& fsdp,
                             torch::optim::Optimizer& optimizer)>
      before;
};

// One rank's FSDP training of `model`: each block a unit (`options`),
// AdamW with `adamw` over the sharded flat parameters, `steps` steps on
// `text`, this rank taking samples [rank * local_batch, (rank + 1) *
// local_batch) of each step (the global batch is world * local_batch).
// `on_step(step, loss)` runs after each forward, when set; `after(fsdp,
// optimizer)` once training is done (a checkpoint save, say), on every
// rank. Collective: every rank of `comm` calls it alike.
struct GptFsdpRun {
  std::vector<float> losses;                        // this rank's, per step
  std::map<std::string, torch::Tensor> full_state;  // FullStateDict()
};
// `device` is the FsdpModule's (flatparam/torch/torch_device.h): the model
// must be on its LibTorch device; batches are moved there.
absl::StatusOr<GptFsdpRun> TrainGptUnderFsdp(
    Gpt& model, Communicator& comm, TorchDevice& device,
    const TextBatches& text, int steps, int64_t local_batch,
    const torch::optim::AdamWOptions& adamw,
    const std::function<void(int step, float loss)>& on_step = nullptr,
    const std::function<absl::Status(libtorch::FsdpModule& fsdp,
                                     torch::optim::Optimizer& optimizer)>&
        after = nullptr,
    const GptFsdpOptions& options = {});
// The same on the CPU with a host DeviceOps.
absl::StatusOr<GptFsdpRun> TrainGptUnderFsdp(
    Gpt& model, Communicator& comm, DeviceOps& device, const TextBatches& text,
    int steps, int64_t local_batch, const torch::optim::AdamWOptions& adamw,
    const std::function<void(int step, float loss)>& on_step = nullptr,
    const std::function<absl::Status(libtorch::FsdpModule& fsdp,
                                     torch::optim::Optimizer& optimizer)>&
        after = nullptr,
    const GptFsdpOptions& options = {});

}  // namespace refmodel
}  // namespace flatparam

#endif  // FLATPARAM_REFMODEL_TORCH_GPT_H_
