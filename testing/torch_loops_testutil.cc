#include "testing/torch_loops_testutil.h"

#include <torch/autograd.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/types.h>
#include <torch/utils.h>

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/checkpoint/file_system.h"
#include "flatparam/torch/recompute.h"
#include "refmodel/torch_gpt.h"
#include "testing/torch_testutil.h"

namespace flatparam {
namespace libtorch {
namespace testing {
namespace {

constexpr int64_t kLoraDim = 8;
constexpr int64_t kLoraRank = 2;
// Samples per rank per step.
constexpr int64_t kLocal = 2;

using Params = std::map<std::string, torch::Tensor>;

Params Named(torch::nn::Module& module) {
  Params out;
  for (const auto& p : module.named_parameters()) {
    out[p.key()] = p.value().detach().clone();
  }
  return out;
}

// OK when every tensor of `got` equals `want`'s of that name, bit for bit.
absl::Status ExpectEqual(const Params& got, const Params& want,
                         const std::string& what) {
  if (got.empty()) return absl::InternalError(what + ": no parameters");
  for (const auto& [name, tensor] : got) {
    auto it = want.find(name);
    if (it == want.end()) {
      return absl::InternalError(
          absl::StrCat(what, ": \"", name, "\" is not in the reference"));
    }
    if (!torch::equal(tensor, it->second)) {
      return absl::InternalError(absl::StrCat(
          what, ": \"", name, "\" differs from the reference by up to ",
          (tensor - it->second).abs().max().item<double>()));
    }
  }
  return absl::OkStatus();
}

refmodel::FoldOptions Fold(const Communicator& world, const LoopOptions& o,
                           int steps) {
  refmodel::FoldOptions fold;
  fold.world = world.size();
  fold.shard_group_size = IsHybridStrategy(o.strategy) ? o.shard_group_size : 0;
  fold.steps = steps;
  return fold;
}

FsdpOptions Wrapping(const LoopOptions& o) {
  FsdpOptions options;
  options.wrap = {"h.*"};
  options.strategy = o.strategy;
  options.shard_group_size = o.shard_group_size;
  options.use_orig_params = o.use_orig_params;
  options.handle.streams = o.streams;
  return options;
}

torch::Tensor Inputs(const torch::Tensor& tokens) {
  return tokens.narrow(1, 0, kSeq);
}

// The testing Net's forward in plain LibTorch.
torch::Tensor NetForward(Net& net, const torch::Tensor& tokens) {
  torch::Tensor x = net->wte(Inputs(tokens));
  for (size_t i = 0; i < net->h->size(); ++i) {
    x = net->h[i]->as<BlockImpl>()->forward(x);
  }
  return net->Head(x);
}

torch::Tensor RankTokens(int step, int rank) {
  return Tokens(step, rank * kLocal, kLocal);
}

// `steps` reference steps from data step `first` (TrainFolded counts from 0).
void TrainNetReference(Net& net, torch::optim::Optimizer& optimizer,
                       const refmodel::FoldOptions& fold, int first) {
  refmodel::TrainFolded(*net, optimizer, fold, [&](int step, int, int r) {
    torch::Tensor tokens = RankTokens(first + step, r);
    return Loss(NetForward(net, tokens), tokens);
  });
}

// One FSDP training step of the testing Net on this rank's data.
absl::Status FsdpNetStep(Net& net, FsdpModule& fsdp,
                         torch::optim::Optimizer& optimizer, int step, int rank,
                         Recomputation recompute, bool zero_grad = true) {
  torch::Tensor tokens = RankTokens(step, rank);
  FLATPARAM_ASSIGN_OR_RETURN(torch::Tensor logits,
                             ForwardNet(net, fsdp, tokens, nullptr, recompute));
  FLATPARAM_RETURN_IF_ERROR(fsdp.Backward(Loss(logits, tokens)));
  optimizer.step();
  if (zero_grad) FLATPARAM_RETURN_IF_ERROR(fsdp.ZeroGrad());
  return absl::OkStatus();
}

// The testing Net trained `steps` reference steps with AdamW from data
// step 0: its parameters.
Params ReferenceNetParams(const Communicator& world, const LoopOptions& o,
                          int steps) {
  Net reference = MakeNet();
  auto optimizer =
      MakeOptimizer(Optim::kAdamW, refmodel::TrainableTensors(*reference));
  TrainNetReference(reference, *optimizer, Fold(world, o, steps), 0);
  return Named(*reference);
}

// A fresh testing Net under FsdpModule with AdamW over its shards.
struct WrappedNet {
  Net net{nullptr};
  std::unique_ptr<FsdpModule> fsdp;
  std::unique_ptr<torch::optim::Optimizer> optimizer;
};
absl::StatusOr<WrappedNet> WrapNetWithAdamW(Communicator& world,
                                            TorchDevice& device,
                                            const LoopOptions& o) {
  WrappedNet w;
  w.net = MakeNet();
  FLATPARAM_ASSIGN_OR_RETURN(
      w.fsdp, FsdpModule::Wrap(w.net.ptr(), &world, &device, Wrapping(o)));
  w.optimizer = MakeOptimizer(Optim::kAdamW, w.fsdp->ShardedParameters());
  return w;
}

// Data steps [first, last) of `w` on this rank.
absl::Status TrainWrapped(WrappedNet& w, const Communicator& world,
                          const LoopOptions& o, int first, int last) {
  for (int step = first; step < last; ++step) {
    FLATPARAM_RETURN_IF_ERROR(FsdpNetStep(w.net, *w.fsdp, *w.optimizer, step,
                                          world.rank(), o.recompute));
  }
  return absl::OkStatus();
}

const Params& LoraInitial() {
  static const Params* params = [] {
    torch::manual_seed(11);
    LoraNet net(kVocab, kLoraDim, kLoraRank, kLoraLayers);
    return new Params(Named(*net));
  }();
  return *params;
}

LoraNet MakeLoraNet() {
  LoraNet net(kVocab, kLoraDim, kLoraRank, kLoraLayers);
  torch::NoGradGuard no_grad;
  for (auto& p : net->named_parameters()) {
    p.value().copy_(LoraInitial().at(p.key()));
    p.value().set_requires_grad(absl::StrContains(p.key(), "lora_"));
  }
  return net;
}

}  // namespace

std::string LoopName(const LoopOptions& o) {
  return absl::StrFormat(
      "%s%s%s%s", ShardingStrategyName(o.strategy),
      o.shard_group_size ? absl::StrCat("x", o.shard_group_size) : "",
      o.recompute == Recomputation::kNone
          ? ""
          : absl::StrCat("_recompute_", RecomputationName(o.recompute)),
      o.use_orig_params ? "_orig_params" : "");
}

LoraBlockImpl::LoraBlockImpl(int64_t d, int64_t r)
    : ln(register_module(
          "ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})))),
      fc(register_module("fc", torch::nn::Linear(d, d))) {
  lora_a = register_parameter("lora_a", torch::randn({r, d}) * 0.3);
  lora_b = register_parameter("lora_b", torch::randn({d, r}) * 0.3);
}

torch::Tensor LoraBlockImpl::forward(const torch::Tensor& x) {
  torch::Tensor h = ln(x);
  return x + torch::gelu(fc(h) + torch::matmul(torch::matmul(h, lora_a.t()),
                                               lora_b.t()));
}

LoraNetImpl::LoraNetImpl(int64_t vocab, int64_t d, int64_t r, int layers) {
  wte = register_module("wte", torch::nn::Embedding(vocab, d));
  h = register_module("h", torch::nn::ModuleList());
  for (int i = 0; i < layers; ++i) h->push_back(LoraBlock(d, r));
  ln_f = register_module(
      "ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
}

torch::Tensor LoraNetImpl::forward(const torch::Tensor& tokens) {
  torch::Tensor x = wte(Inputs(tokens));
  for (size_t i = 0; i < h->size(); ++i) {
    x = h[i]->as<LoraBlockImpl>()->forward(x);
  }
  return torch::matmul(ln_f(x), wte->weight.t());
}

absl::Status LoraLoop(Communicator& world, TorchDevice& device,
                      const LoopOptions& options, int steps, int64_t* peak,
                      int64_t* bound) {
  // The reference: plain LibTorch, AdamW over every parameter (the frozen
  // ones get no gradient, so it skips them), LibTorch's default decay.
  LoraNet reference = MakeLoraNet();
  torch::optim::AdamW ref_adamw(reference->parameters(),
                                torch::optim::AdamWOptions(0.01));
  refmodel::TrainFolded(*reference, ref_adamw, Fold(world, options, steps),
                        [&](int step, int, int r) {
                          torch::Tensor tokens = RankTokens(step, r);
                          return Loss(reference->forward(tokens), tokens);
                        });

  LoraNet net = MakeLoraNet();
  FsdpOptions wrapping = Wrapping(options);
  wrapping.use_orig_params = true;
  FLATPARAM_ASSIGN_OR_RETURN(
      std::unique_ptr<FsdpModule> fsdp,
      FsdpModule::Wrap(net.ptr(), &world, &device, wrapping));
  torch::optim::AdamW adamw(fsdp->ShardedParameters(),
                            torch::optim::AdamWOptions(0.01));
  fsdp->runtime().ResetPeakMemory();
  for (int step = 0; step < steps; ++step) {
    torch::Tensor tokens = RankTokens(step, world.rank());
    FLATPARAM_ASSIGN_OR_RETURN(
        torch::Tensor logits,
        fsdp->Forward([&]() -> absl::StatusOr<torch::Tensor> {
          torch::Tensor x = net->wte(Inputs(tokens));
          for (size_t i = 0; i < net->h->size(); ++i) {
            std::shared_ptr<LoraBlockImpl> block =
                net->h->ptr<LoraBlockImpl>(i);
            FLATPARAM_ASSIGN_OR_RETURN(x, fsdp->RecomputedUnit(
                                              absl::StrCat("h.", i), x,
                                              [block](const torch::Tensor& in) {
                                                return block->forward(in);
                                              },
                                              options.recompute));
          }
          return torch::matmul(net->ln_f(x), net->wte->weight.t());
        }));
    FLATPARAM_RETURN_IF_ERROR(fsdp->Backward(Loss(logits, tokens)));
    adamw.step();
    FLATPARAM_RETURN_IF_ERROR(fsdp->ZeroGrad());
  }
  const MemoryStats memory = fsdp->runtime().memory();
  const int64_t element = DTypeSize(DType::kFloat32);
  int64_t root = 0, block = 0;
  for (const FlatParamLayout& fp : fsdp->layout().flat_params()) {
    const int64_t bytes = fp.padded_unsharded_numel() * element;
    (fp.unit().empty() ? root : block) =
        std::max(fp.unit().empty() ? root : block, bytes);
  }
  *peak = memory.peak_bytes(MemoryCategory::kUnshardedParams);
  *bound = root + 2 * block;

  FLATPARAM_ASSIGN_OR_RETURN(Params got, fsdp->FullStateDict());
  FLATPARAM_RETURN_IF_ERROR(
      ExpectEqual(got, Named(*reference), "LoRA after training"));
  for (const auto& [name, tensor] : got) {
    if (absl::StrContains(name, "lora_")) continue;
    if (!torch::equal(tensor, LoraInitial().at(name))) {
      return absl::InternalError(
          absl::StrCat("frozen \"", name, "\" moved in training"));
    }
  }
  // The bound is FULL_SHARD's (the others keep units gathered by design).
  if (options.strategy != ShardingStrategy::kFullShard) {
    return absl::OkStatus();
  }
  if (*peak > *bound) {
    return absl::InternalError(
        absl::StrCat("peak unsharded parameters ", *peak,
                     " bytes > root + 2 blocks = ", *bound));
  }
  return absl::OkStatus();
}

absl::Status SharedWeightLoop(Communicator& world, TorchDevice& device,
                              const LoopOptions& options, int steps) {
  // Block `i` as a function that also reads the embedding's weight.
  auto block_fn = [](Net& net, int i) {
    std::shared_ptr<BlockImpl> block = net->h->ptr<BlockImpl>(i);
    torch::nn::Embedding wte = net->wte;
    return [block, wte](const torch::Tensor& x) {
      torch::Tensor attend =
          torch::softmax(torch::matmul(x, wte->weight.t()), /*dim=*/-1);
      return block->forward(x) + 0.5 * torch::matmul(attend, wte->weight);
    };
  };
  const std::vector<int> order = {0, 0, 1, 2};

  Net reference = MakeNet();
  auto ref_opt =
      MakeOptimizer(Optim::kAdamW, refmodel::TrainableTensors(*reference));
  refmodel::TrainFolded(*reference, *ref_opt, Fold(world, options, steps),
                        [&](int step, int, int r) {
                          torch::Tensor tokens = RankTokens(step, r);
                          torch::Tensor x = reference->wte(Inputs(tokens));
                          for (int i : order) {
                            x = options.recompute == Recomputation::kNone
                                    ? block_fn(reference, i)(x)
                                    : Recompute(block_fn(reference, i), x);
                          }
                          return Loss(reference->Head(x), tokens);
                        });

  Net net = MakeNet();
  FLATPARAM_ASSIGN_OR_RETURN(
      std::unique_ptr<FsdpModule> fsdp,
      FsdpModule::Wrap(net.ptr(), &world, &device, Wrapping(options)));
  auto optimizer = MakeOptimizer(Optim::kAdamW, fsdp->ShardedParameters());
  for (int step = 0; step < steps; ++step) {
    torch::Tensor tokens = RankTokens(step, world.rank());
    FLATPARAM_ASSIGN_OR_RETURN(
        torch::Tensor logits,
        fsdp->Forward([&]() -> absl::StatusOr<torch::Tensor> {
          torch::Tensor x = net->wte(Inputs(tokens));
          for (int i : order) {
            FLATPARAM_ASSIGN_OR_RETURN(
                x, fsdp->RecomputedUnit(absl::StrCat("h.", i), x,
                                        block_fn(net, i), options.recompute));
          }
          return net->Head(x);
        }));
    FLATPARAM_RETURN_IF_ERROR(fsdp->Backward(Loss(logits, tokens)));
    optimizer->step();
    FLATPARAM_RETURN_IF_ERROR(fsdp->ZeroGrad());
  }
  FLATPARAM_ASSIGN_OR_RETURN(Params got, fsdp->FullStateDict());
  return ExpectEqual(got, Named(*reference), "a weight reached twice");
}

absl::Status AutogradGradLoop(Communicator& world, TorchDevice& device,
                              const LoopOptions& options) {
  const int steps = 3;
  const Params reference = ReferenceNetParams(world, options, steps);
  FLATPARAM_ASSIGN_OR_RETURN(WrappedNet w,
                             WrapNetWithAdamW(world, device, options));
  Net& net = w.net;
  std::unique_ptr<FsdpModule>& fsdp = w.fsdp;
  torch::optim::Optimizer* optimizer = w.optimizer.get();
  FLATPARAM_RETURN_IF_ERROR(
      FsdpNetStep(net, *fsdp, *optimizer, 0, world.rank(), options.recompute));

  // The gradient of this rank's loss with respect to one weight, from the
  // module and from plain LibTorch over the same parameters.
  torch::Tensor tokens = RankTokens(1, world.rank());
  FLATPARAM_ASSIGN_OR_RETURN(torch::Tensor logits,
                             ForwardNet(net, *fsdp, tokens));
  const FsdpModuleStats before = fsdp->stats();
  torch::autograd::variable_list grads;
  try {
    grads = torch::autograd::grad({Loss(logits, tokens)},
                                  {net->h[1]->as<BlockImpl>()->fc1->weight});
  } catch (const c10::Error& e) {
    return absl::InternalError(
        absl::StrCat("autograd::grad failed: ", e.what_without_backtrace()));
  }
  // Plain LibTorch's gradient over the same parameters is the same.
  {
    FLATPARAM_ASSIGN_OR_RETURN(Params now, fsdp->FullStateDict());
    Net plain = MakeNet();
    {
      torch::NoGradGuard no_grad;
      for (auto& p : plain->named_parameters()) {
        auto it = now.find(p.key());
        if (it != now.end()) p.value().copy_(it->second);
      }
    }
    torch::autograd::variable_list want =
        torch::autograd::grad({Loss(NetForward(plain, tokens), tokens)},
                              {plain->h[1]->as<BlockImpl>()->fc1->weight});
    if (grads.size() != 1 || !grads[0].defined() ||
        !torch::equal(grads[0], want[0])) {
      return absl::InternalError(
          "autograd::grad under FsdpModule differs from plain LibTorch's");
    }
  }
  for (size_t k = 0; k < fsdp->ShardedParameters().size(); ++k) {
    if (fsdp->ShardedParameters()[k].grad().defined()) {
      return absl::InternalError(
          absl::StrCat("after autograd::grad, ShardedParameters()[", k,
                       "] has a gradient; it had none"));
    }
  }
  if (fsdp->stats().reductions_in_backward + fsdp->stats().reductions_at_end !=
      before.reductions_in_backward + before.reductions_at_end) {
    return absl::InternalError("autograd::grad reduced gradients");
  }
  if (grads[0].abs().sum().item<float>() == 0) {
    return absl::InternalError("autograd::grad returned a zero gradient");
  }

  // Gradients of gradients are refused, and the module goes on.
  FLATPARAM_ASSIGN_OR_RETURN(logits, ForwardNet(net, *fsdp, tokens));
  bool refused = false;
  try {
    torch::autograd::grad({Loss(logits, tokens)},
                          {net->h[1]->as<BlockImpl>()->fc1->weight}, {},
                          /*retain_graph=*/true, /*create_graph=*/true);
  } catch (const c10::Error& e) {
    refused =
        absl::StrContains(e.what_without_backtrace(), "gradients of gradients");
    if (!refused) {
      return absl::InternalError(absl::StrCat("create_graph failed with: ",
                                              e.what_without_backtrace()));
    }
  }
  if (!refused) {
    return absl::InternalError("a create_graph backward was not refused");
  }
  for (int step = 1; step < steps; ++step) {
    FLATPARAM_RETURN_IF_ERROR(FsdpNetStep(net, *fsdp, *optimizer, step,
                                          world.rank(), options.recompute));
  }
  FLATPARAM_ASSIGN_OR_RETURN(Params got, fsdp->FullStateDict());
  return ExpectEqual(got, reference, "training around autograd::grad calls");
}

absl::Status RequiresGradChangeLoop(Communicator& world, TorchDevice& device,
                                    const LoopOptions& options) {
  const int steps = 5;
  // The parameters frozen after step 1 and unfrozen after step 3.
  auto changed = [&](Net& net) {
    std::vector<torch::Tensor> out;
    auto* block = net->h[1]->as<BlockImpl>();
    out.push_back(block->fc1->weight);
    if (!options.use_orig_params) {
      // Without use_orig_params only a whole unit may change.
      for (const torch::Tensor& p : block->parameters()) {
        if (p.unsafeGetTensorImpl() !=
            block->fc1->weight.unsafeGetTensorImpl()) {
          out.push_back(p);
        }
      }
    }
    return out;
  };
  auto set = [](std::vector<torch::Tensor> params, bool requires_grad) {
    for (torch::Tensor& p : params) {
      p.set_requires_grad(requires_grad);
      // The optimizer's set-to-None for what is frozen, as FSDP's None.
      if (!requires_grad) p.mutable_grad().reset();
    }
  };

  Net reference = MakeNet();
  auto ref_opt =
      MakeOptimizer(Optim::kAdamW, refmodel::TrainableTensors(*reference));
  for (int step = 0; step < steps; ++step) {
    if (step == 2) set(changed(reference), false);
    if (step == 4) set(changed(reference), true);
    TrainNetReference(reference, *ref_opt, Fold(world, options, 1), step);
  }

  Net net = MakeNet();
  FLATPARAM_ASSIGN_OR_RETURN(
      std::unique_ptr<FsdpModule> fsdp,
      FsdpModule::Wrap(net.ptr(), &world, &device, Wrapping(options)));
  auto optimizer = MakeOptimizer(Optim::kAdamW, fsdp->ShardedParameters());
  for (int step = 0; step < steps; ++step) {
    if (step == 2 || step == 4) {
      for (torch::Tensor& p : changed(net)) p.set_requires_grad(step == 4);
    }
    FLATPARAM_RETURN_IF_ERROR(FsdpNetStep(net, *fsdp, *optimizer, step,
                                          world.rank(), options.recompute));
  }
  FLATPARAM_ASSIGN_OR_RETURN(Params got, fsdp->FullStateDict());
  return ExpectEqual(got, Named(*reference), "requires_grad changed");
}

absl::Status SetToNoneLoop(Communicator& world, TorchDevice& device,
                           const LoopOptions& options) {
  const int steps = 3;
  const Params reference = ReferenceNetParams(world, options, steps);
  FLATPARAM_ASSIGN_OR_RETURN(WrappedNet w,
                             WrapNetWithAdamW(world, device, options));
  for (int step = 0; step < steps; ++step) {
    FLATPARAM_RETURN_IF_ERROR(FsdpNetStep(w.net, *w.fsdp, *w.optimizer, step,
                                          world.rank(), options.recompute,
                                          /*zero_grad=*/false));
    // zero_grad(set_to_none=true), as LibTorch 2.x's optimizers do it.
    for (torch::Tensor p : w.fsdp->ShardedParameters()) {
      p.mutable_grad().reset();
    }
  }
  FLATPARAM_ASSIGN_OR_RETURN(Params got, w.fsdp->FullStateDict());
  return ExpectEqual(got, reference, "gradients set to None");
}

absl::Status DcpResumeLoop(Communicator& world, TorchDevice& device,
                           const LoopOptions& options, const std::string& dir) {
  const Params reference = ReferenceNetParams(world, options, 4);
  {
    FLATPARAM_ASSIGN_OR_RETURN(WrappedNet w,
                               WrapNetWithAdamW(world, device, options));
    FLATPARAM_RETURN_IF_ERROR(TrainWrapped(w, world, options, 0, 2));
    FLATPARAM_RETURN_IF_ERROR(w.fsdp->SaveDcpCheckpoint(
        checkpoint::PosixFileSystem(), dir, w.optimizer.get()));
  }
  FLATPARAM_ASSIGN_OR_RETURN(WrappedNet w,
                             WrapNetWithAdamW(world, device, options));
  FLATPARAM_RETURN_IF_ERROR(w.fsdp->LoadDcpCheckpoint(
      checkpoint::PosixFileSystem(), dir, w.optimizer.get()));
  FLATPARAM_RETURN_IF_ERROR(TrainWrapped(w, world, options, 2, 4));
  FLATPARAM_ASSIGN_OR_RETURN(Params got, w.fsdp->FullStateDict());
  return ExpectEqual(got, reference, "saved and resumed through DCP");
}

absl::Status DcpSaveOrReshardLoop(Communicator& world, TorchDevice& device,
                                  const LoopOptions& options,
                                  const std::string& dir,
                                  const std::string& again) {
  FLATPARAM_ASSIGN_OR_RETURN(WrappedNet w,
                             WrapNetWithAdamW(world, device, options));
  if (again.empty()) {
    FLATPARAM_RETURN_IF_ERROR(TrainWrapped(w, world, options, 0, 2));
    return w.fsdp->SaveDcpCheckpoint(checkpoint::PosixFileSystem(), dir,
                                     w.optimizer.get());
  }
  FLATPARAM_RETURN_IF_ERROR(w.fsdp->LoadDcpCheckpoint(
      checkpoint::PosixFileSystem(), dir, w.optimizer.get()));
  return w.fsdp->SaveDcpCheckpoint(checkpoint::PosixFileSystem(), again,
                                   w.optimizer.get());
}

absl::Status EvaluateThenSaveLoop(Communicator& world, TorchDevice& device,
                                  const LoopOptions& options,
                                  const std::string& dir) {
  const Params reference = ReferenceNetParams(world, options, 4);
  {
    FLATPARAM_ASSIGN_OR_RETURN(WrappedNet w,
                               WrapNetWithAdamW(world, device, options));
    Net& net = w.net;
    std::unique_ptr<FsdpModule>& fsdp = w.fsdp;
    torch::optim::Optimizer* optimizer = w.optimizer.get();
    for (int step = 0; step < 2; ++step) {
      FLATPARAM_RETURN_IF_ERROR(FsdpNetStep(net, *fsdp, *optimizer, step,
                                            world.rank(), options.recompute));
    }
    // Evaluation without gradients: the iteration ends with the forward.
    torch::Tensor tokens = RankTokens(100, world.rank());
    {
      torch::NoGradGuard no_grad;
      FLATPARAM_ASSIGN_OR_RETURN(torch::Tensor logits,
                                 ForwardNet(net, *fsdp, tokens));
      if (fsdp->runtime().in_iteration()) {
        return absl::InternalError("an evaluation left the iteration open");
      }
      const MemoryStats memory = fsdp->runtime().memory();
      if (memory.current_bytes(MemoryCategory::kUnshardedParams) != 0) {
        return absl::InternalError(
            "an evaluation left unsharded parameters allocated");
      }
    }
    // Evaluation with gradients on, the loss never back-propagated.
    FLATPARAM_ASSIGN_OR_RETURN(torch::Tensor logits,
                               ForwardNet(net, *fsdp, tokens));
    torch::Tensor eval_loss = Loss(logits, tokens);
    FLATPARAM_RETURN_IF_ERROR(
        fsdp->SaveCheckpoint(checkpoint::PosixFileSystem(), dir, optimizer));
    // Its graph cannot be back-propagated once the iteration is over.
    bool refused = false;
    try {
      eval_loss.backward();
    } catch (const c10::Error& e) {
      refused =
          absl::StrContains(e.what_without_backtrace(), "iteration has ended");
    }
    if (!refused) {
      return absl::InternalError(
          "a backward over an ended iteration's graph was not refused");
    }
    FLATPARAM_RETURN_IF_ERROR(fsdp->SaveCheckpoint(
        checkpoint::PosixFileSystem(), dir + ".again", optimizer));
  }
  FLATPARAM_ASSIGN_OR_RETURN(WrappedNet w,
                             WrapNetWithAdamW(world, device, options));
  Net& net = w.net;
  std::unique_ptr<FsdpModule>& fsdp = w.fsdp;
  torch::optim::Optimizer* optimizer = w.optimizer.get();
  FLATPARAM_RETURN_IF_ERROR(
      fsdp->LoadCheckpoint(checkpoint::PosixFileSystem(), dir, optimizer));
  // Step 2, then a forward with gradients on whose loss is never
  // back-propagated between the backward and the optimizer's step: the
  // next forward must see the stepped parameters, not the root's stale
  // gathered ones.
  {
    torch::Tensor tokens = RankTokens(2, world.rank());
    FLATPARAM_ASSIGN_OR_RETURN(torch::Tensor logits,
                               ForwardNet(net, *fsdp, tokens));
    FLATPARAM_RETURN_IF_ERROR(fsdp->Backward(Loss(logits, tokens)));
    FLATPARAM_ASSIGN_OR_RETURN(torch::Tensor unused,
                               ForwardNet(net, *fsdp, RankTokens(101, 0)));
    optimizer->step();
    for (torch::Tensor p : fsdp->ShardedParameters()) p.mutable_grad().reset();
  }
  FLATPARAM_RETURN_IF_ERROR(
      FsdpNetStep(net, *fsdp, *optimizer, 3, world.rank(), options.recompute));
  FLATPARAM_ASSIGN_OR_RETURN(Params got, fsdp->FullStateDict());
  return ExpectEqual(got, reference, "evaluation, save, load");
}

absl::Status InsideAStepLoop(Communicator& world, TorchDevice& device,
                             const LoopOptions& options) {
  const int steps = 3;
  const Params reference = ReferenceNetParams(world, options, steps);
  FLATPARAM_ASSIGN_OR_RETURN(WrappedNet w,
                             WrapNetWithAdamW(world, device, options));
  for (int step = 0; step < steps; ++step) {
    torch::Tensor tokens = RankTokens(step, world.rank());
    FLATPARAM_ASSIGN_OR_RETURN(
        torch::Tensor logits,
        ForwardNet(w.net, *w.fsdp, tokens, nullptr, options.recompute));
    FLATPARAM_RETURN_IF_ERROR(w.fsdp->ZeroGrad());
    {
      torch::NoGradGuard no_grad;
      FLATPARAM_ASSIGN_OR_RETURN(
          torch::Tensor eval,
          ForwardNet(w.net, *w.fsdp, RankTokens(50 + step, world.rank())));
    }
    FLATPARAM_RETURN_IF_ERROR(w.fsdp->Backward(Loss(logits, tokens)));
    w.optimizer->step();
  }
  FLATPARAM_ASSIGN_OR_RETURN(Params got, w.fsdp->FullStateDict());
  return ExpectEqual(got, reference, "ZeroGrad and evaluation inside a step");
}

absl::Status SeveralOutputsLoop(Communicator& world, TorchDevice& device,
                                const LoopOptions& options) {
  const int steps = 3;
  // A block's auxiliary loss, from its own parameters.
  auto aux_of = [](BlockImpl& block, const torch::Tensor& x) {
    return block.fc1(block.ln(x)).pow(2).mean();
  };
  Net reference = MakeNet();
  auto ref_opt =
      MakeOptimizer(Optim::kAdamW, refmodel::TrainableTensors(*reference));
  refmodel::TrainFolded(*reference, *ref_opt, Fold(world, options, steps),
                        [&](int step, int, int r) {
                          torch::Tensor tokens = RankTokens(step, r);
                          torch::Tensor x = reference->wte(Inputs(tokens));
                          torch::Tensor aux = torch::zeros({});
                          for (size_t i = 0; i < reference->h->size(); ++i) {
                            auto* block = reference->h[i]->as<BlockImpl>();
                            torch::Tensor y = block->forward(x);
                            aux = aux + aux_of(*block, x);
                            x = y;
                          }
                          return Loss(reference->Head(x), tokens) + 0.1 * aux;
                        });

  Net net = MakeNet();
  FLATPARAM_ASSIGN_OR_RETURN(
      std::unique_ptr<FsdpModule> fsdp,
      FsdpModule::Wrap(net.ptr(), &world, &device, Wrapping(options)));
  auto optimizer = MakeOptimizer(Optim::kAdamW, fsdp->ShardedParameters());
  for (int step = 0; step < steps; ++step) {
    torch::Tensor tokens = RankTokens(step, world.rank());
    FLATPARAM_ASSIGN_OR_RETURN(
        torch::autograd::variable_list out,
        fsdp->Forward([&]() -> absl::StatusOr<torch::autograd::variable_list> {
          torch::Tensor x = net->wte(Inputs(tokens));
          torch::Tensor aux = torch::zeros({});
          for (size_t i = 0; i < net->h->size(); ++i) {
            auto* block = net->h[i]->as<BlockImpl>();
            FLATPARAM_ASSIGN_OR_RETURN(
                torch::autograd::variable_list y,
                fsdp->Unit(absl::StrCat("h.", i),
                           [&]() -> torch::autograd::variable_list {
                             return {block->forward(x), aux_of(*block, x)};
                           }));
            aux = aux + y[1];
            x = y[0];
          }
          return torch::autograd::variable_list{net->Head(x), aux};
        }));
    FLATPARAM_RETURN_IF_ERROR(
        fsdp->Backward(Loss(out[0], tokens) + 0.1 * out[1]));
    optimizer->step();
    FLATPARAM_RETURN_IF_ERROR(fsdp->ZeroGrad());
  }
  FLATPARAM_ASSIGN_OR_RETURN(Params got, fsdp->FullStateDict());
  return ExpectEqual(got, Named(*reference), "several outputs per unit");
}

absl::Status ParamGroupsLoop(Communicator& world, TorchDevice& device,
                             const LoopOptions& options,
                             const std::string& dir) {
  const int steps = 4;
  const int micro = 2;
  auto decays = [](const std::string& name) {
    return absl::StrContains(name, "fc") && absl::EndsWith(name, ".weight");
  };
  auto make =
      [&](const std::vector<std::pair<std::string, torch::Tensor>>& named) {
        std::vector<torch::Tensor> decay, no_decay;
        for (const auto& [name, p] : named) {
          (decays(name) ? decay : no_decay).push_back(p);
        }
        std::vector<torch::optim::OptimizerParamGroup> groups;
        groups.emplace_back(
            decay, std::make_unique<torch::optim::AdamWOptions>(
                       torch::optim::AdamWOptions(0.01).weight_decay(0.1)));
        groups.emplace_back(
            no_decay, std::make_unique<torch::optim::AdamWOptions>(
                          torch::optim::AdamWOptions(0.01).weight_decay(0)));
        return std::make_unique<torch::optim::AdamW>(
            groups, torch::optim::AdamWOptions(0.01));
      };

  Net reference = MakeNet();
  std::vector<std::pair<std::string, torch::Tensor>> ref_named;
  for (const auto& p : reference->named_parameters()) {
    if (p.key() != "lm_head.weight") ref_named.emplace_back(p.key(), p.value());
  }
  auto ref_opt = make(ref_named);
  refmodel::FoldOptions fold = Fold(world, options, steps);
  fold.micro_batches = micro;
  refmodel::TrainFolded(
      *reference, *ref_opt, fold, [&](int step, int m, int r) {
        torch::Tensor tokens = RankTokens(step * micro + m, r);
        return Loss(NetForward(reference, tokens), tokens);
      });

  LoopOptions orig = options;
  orig.use_orig_params = true;
  auto run = [&](int first, int last, bool load, bool save) -> absl::Status {
    Net net = MakeNet();
    FLATPARAM_ASSIGN_OR_RETURN(
        std::unique_ptr<FsdpModule> fsdp,
        FsdpModule::Wrap(net.ptr(), &world, &device, Wrapping(orig)));
    FLATPARAM_ASSIGN_OR_RETURN(auto named, fsdp->NamedShardedParameters());
    auto optimizer = make(named);
    if (load) {
      FLATPARAM_RETURN_IF_ERROR(fsdp->LoadCheckpoint(
          checkpoint::PosixFileSystem(), dir, optimizer.get()));
    }
    for (int step = first; step < last; ++step) {
      for (int m = 0; m < micro; ++m) {
        // PyTorch's `with model.no_sync():` for all but the last.
        std::optional<FsdpRuntime::NoSyncScope> no_sync;
        if (m < micro - 1) no_sync.emplace(fsdp->NoSync());
        torch::Tensor tokens = RankTokens(step * micro + m, world.rank());
        FLATPARAM_ASSIGN_OR_RETURN(
            torch::Tensor logits,
            ForwardNet(net, *fsdp, tokens, nullptr, options.recompute));
        FLATPARAM_RETURN_IF_ERROR(fsdp->Backward(Loss(logits, tokens)));
      }
      optimizer->step();
      FLATPARAM_RETURN_IF_ERROR(fsdp->ZeroGrad());
    }
    if (save) {
      return fsdp->SaveCheckpoint(checkpoint::PosixFileSystem(), dir,
                                  optimizer.get());
    }
    FLATPARAM_ASSIGN_OR_RETURN(Params got, fsdp->FullStateDict());
    return ExpectEqual(got, Named(*reference), "parameter groups");
  };
  FLATPARAM_RETURN_IF_ERROR(run(0, steps / 2, false, true));
  return run(steps / 2, steps, true, false);
}

BnNet MakeBnNet() {
  static const auto* initial = [] {
    torch::manual_seed(5);
    BnNet net;
    auto* out = new std::map<std::string, torch::Tensor>();
    for (const auto& p : net->named_parameters()) {
      (*out)[p.key()] = p.value().detach().clone();
    }
    return out;
  }();
  BnNet net;
  torch::NoGradGuard no_grad;
  for (auto& p : net->named_parameters()) p.value().copy_(initial->at(p.key()));
  return net;
}

// One step of the BN network under FsdpModule on this rank's batch.
absl::Status BnStep(BnNet& net, FsdpModule& fsdp,
                    torch::optim::Optimizer& optimizer, int step, int rank) {
  torch::Tensor x = torch::sin(torch::arange(24, torch::kFloat) * 0.37 +
                               step * 1.3 + rank * 0.7)
                        .reshape({4, 6});
  torch::Tensor target = torch::tensor({0, 1, 2, (step + rank) % 3});
  FLATPARAM_ASSIGN_OR_RETURN(
      torch::Tensor logits,
      fsdp.Forward([&]() -> absl::StatusOr<torch::Tensor> {
        torch::Tensor y = x;
        for (size_t i = 0; i < net->h->size(); ++i) {
          auto* block = net->h[i]->as<BnBlockImpl>();
          FLATPARAM_ASSIGN_OR_RETURN(y, fsdp.Unit(absl::StrCat("h.", i), [&] {
            return block->forward(y);
          }));
        }
        return net->head(y);
      }));
  FLATPARAM_RETURN_IF_ERROR(
      fsdp.Backward(torch::nn::functional::cross_entropy(logits, target)));
  optimizer.step();
  return fsdp.ZeroGrad();
}

absl::Status ExpectSameDict(
    const torch::OrderedDict<std::string, torch::Tensor>& a,
    const torch::OrderedDict<std::string, torch::Tensor>& b) {
  if (a.keys() != b.keys()) return absl::InternalError("keys differ");
  for (const auto& item : a) {
    if (!torch::equal(item.value(), b[item.key()])) {
      return absl::InternalError(absl::StrCat("\"", item.key(), "\" differs"));
    }
  }
  return absl::OkStatus();
}

absl::Status BatchNormCheckpointLoop(Communicator& world, TorchDevice& device,
                                     const std::string& dir) {
  using Dict = torch::OrderedDict<std::string, torch::Tensor>;
  FsdpOptions options;
  options.wrap = {"h.*"};
  auto run = [&](int first, int last, bool load,
                 bool save) -> absl::StatusOr<Dict> {
    BnNet net = MakeBnNet();
    FLATPARAM_ASSIGN_OR_RETURN(
        std::unique_ptr<FsdpModule> fsdp,
        FsdpModule::Wrap(net.ptr(), &world, &device, options));
    torch::optim::AdamW adamw(fsdp->ShardedParameters(),
                              torch::optim::AdamWOptions(0.01));
    if (load) {
      FLATPARAM_RETURN_IF_ERROR(
          fsdp->LoadCheckpoint(checkpoint::PosixFileSystem(), dir, &adamw));
    }
    for (int step = first; step < last; ++step) {
      FLATPARAM_RETURN_IF_ERROR(BnStep(net, *fsdp, adamw, step, world.rank()));
    }
    if (save) {
      FLATPARAM_RETURN_IF_ERROR(
          fsdp->SaveCheckpoint(checkpoint::PosixFileSystem(), dir, &adamw));
    }
    return fsdp->StateDict();
  };
  FLATPARAM_ASSIGN_OR_RETURN(Dict straight, run(0, 4, false, false));
  FLATPARAM_RETURN_IF_ERROR(run(0, 2, false, true).status());
  FLATPARAM_ASSIGN_OR_RETURN(Dict resumed, run(2, 4, true, false));
  if (!straight.contains("h.1.bn.running_var")) {
    return absl::InternalError("no buffers in StateDict");
  }
  return ExpectSameDict(straight, resumed);
}

}  // namespace testing
}  // namespace libtorch
}  // namespace flatparam
