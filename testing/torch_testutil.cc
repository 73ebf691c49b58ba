#include "testing/torch_testutil.h"

#include <torch/autograd.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/sgd.h>
#include <torch/types.h>
#include <torch/utils.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/handle.h"
#include "refmodel/torch_gpt.h"

namespace flatparam {
namespace libtorch {
namespace testing {

BlockImpl::BlockImpl(int64_t d)
    : ln(register_module(
          "ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})))),
      fc1(register_module("fc1", torch::nn::Linear(d, 2 * d))),
      fc2(register_module("fc2", torch::nn::Linear(2 * d, d))) {}

torch::Tensor BlockImpl::forward(const torch::Tensor& x) {
  return x + fc2(torch::gelu(fc1(ln(x))));
}

NetImpl::NetImpl(int64_t vocab, int64_t d, int layers) {
  wte = register_module("wte", torch::nn::Embedding(vocab, d));
  h = register_module("h", torch::nn::ModuleList());
  for (int i = 0; i < layers; ++i) h->push_back(Block(d));
  ln_f = register_module(
      "ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
  // The head is the embedding, registered under a second name.
  lm_head = register_module("lm_head", std::make_shared<torch::nn::Module>());
  lm_head->register_parameter("weight", wte->weight);
}

torch::Tensor NetImpl::Head(const torch::Tensor& x) {
  return torch::matmul(ln_f(x), wte->weight.t());
}

// The initial parameters every run starts from (made once, on one thread:
// the default generator is global).
const std::map<std::string, torch::Tensor>& InitialParams() {
  static const auto* params = [] {
    torch::manual_seed(7);
    Net net(kVocab, kDim, kLayers);
    auto* out = new std::map<std::string, torch::Tensor>();
    for (const auto& p : net->named_parameters()) {
      (*out)[p.key()] = p.value().detach().clone();
    }
    return out;
  }();
  return *params;
}

// The network at InitialParams(); `frozen_prefix` freezes the parameters
// whose names start with it.
Net MakeNet(const std::string& frozen_prefix) {
  Net net(kVocab, kDim, kLayers);
  torch::NoGradGuard no_grad;
  for (auto& p : net->named_parameters()) {
    p.value().copy_(InitialParams().at(p.key()));
    if (!frozen_prefix.empty() && p.key().rfind(frozen_prefix, 0) == 0) {
      p.value().set_requires_grad(false);
    }
  }
  return net;
}

torch::Tensor Tokens(int64_t step, int64_t first_sample, int64_t samples) {
  torch::Tensor t = torch::empty({samples, kSeq + 1}, torch::kLong);
  for (int64_t s = 0; s < samples; ++s) {
    for (int64_t j = 0; j <= kSeq; ++j) {
      t[s][j] = ((first_sample + s) * 7 + j * 3 + step * 5 + j * j) % kVocab;
    }
  }
  return t;
}

torch::Tensor Loss(const torch::Tensor& logits, const torch::Tensor& tokens) {
  torch::Tensor targets = tokens.narrow(1, 1, kSeq).reshape({-1});
  return torch::nn::functional::cross_entropy(logits.reshape({-1, kVocab}),
                                              targets);
}

std::unique_ptr<torch::optim::Optimizer> MakeOptimizer(
    Optim optim, std::vector<torch::Tensor> params) {
  if (optim == Optim::kSgd) {
    return std::make_unique<torch::optim::SGD>(
        params, torch::optim::SGDOptions(0.1).momentum(0.9).weight_decay(0.01));
  }
  return std::make_unique<torch::optim::AdamW>(
      params, torch::optim::AdamWOptions(0.01).weight_decay(0.1));
}

std::string Name(const Case& c) {
  return absl::StrFormat(
      "%s_w%d%s_%s%s%s%s%s", ShardingStrategyName(c.strategy), c.world,
      c.shard_group_size ? absl::StrCat("x", c.shard_group_size) : "",
      c.optim == Optim::kSgd ? "sgd" : "adamw",
      c.frozen.empty() ? "" : "_frozen",
      c.micro_batches > 1 ? absl::StrCat("_nosync", c.micro_batches) : "",
      c.cpu_offload ? "_offload" : "",
      c.recompute == Recomputation::kNone
          ? ""
          : absl::StrCat("_recompute_", RecomputationName(c.recompute)));
}

// Single-process LibTorch training of the global batch, with the ranks'
// gradients folded as FSDP's reduction does: per element, in float32,
// acc = g_0 / pre; acc = acc + g_r / pre (rank order); acc = acc / post,
// a division by exactly 1 skipped; hybrid: a fold per shard group, then
// the groups' sums in order.
std::map<std::string, torch::Tensor> TrainReference(const Case& c) {
  Net net = MakeNet(c.frozen);
  auto optimizer = MakeOptimizer(c.optim, refmodel::TrainableTensors(*net));
  const int64_t local = c.global_batch / c.world;
  refmodel::FoldOptions fold;
  fold.world = c.world;
  fold.shard_group_size = c.shard_group_size;
  fold.steps = c.steps;
  fold.micro_batches = c.micro_batches;
  refmodel::TrainFolded(*net, *optimizer, fold, [&](int step, int m, int r) {
    torch::Tensor tokens = Tokens(step * c.micro_batches + m, r * local, local);
    torch::Tensor x = net->wte(tokens.narrow(1, 0, kSeq));
    for (size_t i = 0; i < net->h->size(); ++i) {
      x = net->h[i]->as<BlockImpl>()->forward(x);
    }
    return Loss(net->Head(x), tokens);
  });
  std::map<std::string, torch::Tensor> out;
  for (const auto& p : net->named_parameters()) {
    out[p.key()] = p.value().detach().clone();
  }
  return out;
}

absl::StatusOr<torch::Tensor> ForwardNet(
    Net& net, FsdpModule& fsdp, const torch::Tensor& tokens,
    const std::function<void(BlockImpl&)>& check, Recomputation recompute) {
  return fsdp.Forward([&]() -> absl::StatusOr<torch::Tensor> {
    torch::Tensor x = net->wte(tokens.narrow(1, 0, kSeq));
    for (size_t i = 0; i < net->h->size(); ++i) {
      // By value: a recompute runs it again in the backward.
      std::shared_ptr<BlockImpl> block = net->h->ptr<BlockImpl>(i);
      FLATPARAM_ASSIGN_OR_RETURN(x,
                                 fsdp.RecomputedUnit(
                                     absl::StrCat("h.", i), x,
                                     [block, check](const torch::Tensor& in) {
                                       if (check) check(*block);
                                       return block->forward(in);
                                     },
                                     recompute));
    }
    return net->Head(x);
  });
}

absl::StatusOr<FsdpResult> TrainFsdpOnRank(Communicator& world,
                                           DeviceOps& device, const Case& c) {
  HostTorchDevice host(&device);
  return TrainFsdpOnRank(world, host, c);
}

absl::StatusOr<FsdpResult> TrainFsdpOnRank(Communicator& world,
                                           TorchDevice& device, const Case& c,
                                           const HandleStreams& streams) {
  if (world.size() != c.world) {
    return absl::InvalidArgumentError(
        absl::StrFormat("case %s needs %d ranks, the communicator has %d",
                        Name(c), c.world, world.size()));
  }
  Net net = MakeNet(c.frozen);
  FsdpOptions options;
  options.wrap = {"h.*"};
  options.strategy = c.strategy;
  options.shard_group_size = c.shard_group_size;
  options.handle.cpu_offload = c.cpu_offload;
  options.handle.streams = streams;
  FLATPARAM_ASSIGN_OR_RETURN(
      std::unique_ptr<FsdpModule> fsdp,
      FsdpModule::Wrap(net.ptr(), &world, &device, options));
  auto optimizer = MakeOptimizer(c.optim, fsdp->ShardedParameters());
  const int64_t local = c.global_batch / c.world;
  for (int micro = 0; micro < c.steps * c.micro_batches; ++micro) {
    const bool last = micro % c.micro_batches == c.micro_batches - 1;
    fsdp->runtime().SetRequireGradientSync(last);
    torch::Tensor tokens = Tokens(micro, world.rank() * local, local);
    FLATPARAM_ASSIGN_OR_RETURN(
        torch::Tensor logits,
        ForwardNet(net, *fsdp, tokens, nullptr, c.recompute));
    FLATPARAM_RETURN_IF_ERROR(fsdp->Backward(Loss(logits, tokens)));
    if (!last) continue;
    optimizer->step();
    FLATPARAM_RETURN_IF_ERROR(fsdp->ZeroGrad());
  }
  FLATPARAM_ASSIGN_OR_RETURN(auto state, fsdp->FullStateDict());
  FsdpResult result;
  result.state = std::move(state);
  result.stats = fsdp->stats();
  return result;
}

}  // namespace testing
}  // namespace libtorch
}  // namespace flatparam
