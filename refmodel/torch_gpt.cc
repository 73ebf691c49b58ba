#include "refmodel/torch_gpt.h"

#include <torch/autograd.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/normalization.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/types.h>
#include <torch/utils.h>

#include <cmath>
#include <cstdint>
#include <fstream>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/handle.h"

namespace flatparam {
namespace refmodel {

Conv1DImpl::Conv1DImpl(int64_t in, int64_t out) {
  weight = register_parameter("weight", torch::empty({in, out}));
  bias = register_parameter("bias", torch::zeros({out}));
  torch::NoGradGuard no_grad;
  weight.normal_(0.0, 0.02);
}

torch::Tensor Conv1DImpl::forward(const torch::Tensor& x) {
  auto sizes = x.sizes().vec();
  sizes.back() = weight.size(1);
  return torch::addmm(bias, x.reshape({-1, x.size(-1)}), weight).view(sizes);
}

GptAttentionImpl::GptAttentionImpl(const GptConfig& config)
    : n_head(config.n_head) {
  c_attn = register_module("c_attn", Conv1D(config.n_embd, 3 * config.n_embd));
  c_proj = register_module("c_proj", Conv1D(config.n_embd, config.n_embd));
}

torch::Tensor GptAttentionImpl::forward(const torch::Tensor& x) {
  const int64_t b = x.size(0), s = x.size(1), e = x.size(2);
  const int64_t d = e / n_head;
  std::vector<torch::Tensor> qkv = c_attn(x).split(e, /*dim=*/2);
  auto heads = [&](const torch::Tensor& t) {
    return t.view({b, s, n_head, d}).transpose(1, 2);  // [b, h, s, d]
  };
  torch::Tensor q = heads(qkv[0]), k = heads(qkv[1]), v = heads(qkv[2]);
  torch::Tensor scores =
      torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(d));
  torch::Tensor causal =
      torch::ones({s, s}, torch::dtype(torch::kBool).device(x.device()))
          .triu(/*diagonal=*/1);
  scores = scores.masked_fill(causal, -std::numeric_limits<float>::infinity());
  torch::Tensor y = torch::matmul(torch::softmax(scores, -1), v);
  return c_proj(y.transpose(1, 2).contiguous().view({b, s, e}));
}

GptMlpImpl::GptMlpImpl(const GptConfig& config) {
  c_fc = register_module("c_fc", Conv1D(config.n_embd, 4 * config.n_embd));
  c_proj = register_module("c_proj", Conv1D(4 * config.n_embd, config.n_embd));
}

torch::Tensor GptMlpImpl::forward(const torch::Tensor& x) {
  return c_proj(torch::gelu(c_fc(x), "tanh"));
}

GptBlockImpl::GptBlockImpl(const GptConfig& config) {
  auto norm = [&] {
    return torch::nn::LayerNorm(
        torch::nn::LayerNormOptions({config.n_embd}).eps(1e-5));
  };
  ln_1 = register_module("ln_1", norm());
  attn = register_module("attn", GptAttention(config));
  ln_2 = register_module("ln_2", norm());
  mlp = register_module("mlp", GptMlp(config));
}

torch::Tensor GptBlockImpl::forward(const torch::Tensor& x) {
  torch::Tensor h = x + attn(ln_1(x));
  return h + mlp(ln_2(h));
}

GptTransformerImpl::GptTransformerImpl(const GptConfig& config) {
  wte = register_module("wte",
                        torch::nn::Embedding(config.vocab_size, config.n_embd));
  wpe = register_module(
      "wpe", torch::nn::Embedding(config.n_positions, config.n_embd));
  h = register_module("h", torch::nn::ModuleList());
  for (int64_t i = 0; i < config.n_layer; ++i) h->push_back(GptBlock(config));
  ln_f = register_module(
      "ln_f", torch::nn::LayerNorm(
                  torch::nn::LayerNormOptions({config.n_embd}).eps(1e-5)));
  torch::NoGradGuard no_grad;
  wte->weight.normal_(0.0, 0.02);
  wpe->weight.normal_(0.0, 0.01);
  // GPT-2 scales the residual projections by 1/sqrt(2 * n_layer).
  const double scaled = 0.02 / std::sqrt(2.0 * config.n_layer);
  for (const auto& item : named_parameters()) {
    if (item.key().find("c_proj.weight") != std::string::npos) {
      item.value().normal_(0.0, scaled);
    }
  }
}

GptImpl::GptImpl(const GptConfig& config) : config(config) {
  transformer = register_module("transformer", GptTransformer(config));
  lm_head = register_module("lm_head", std::make_shared<torch::nn::Module>());
  lm_head->register_parameter("weight", transformer->wte->weight);
}

torch::Tensor GptImpl::Embed(const torch::Tensor& tokens) {
  torch::Tensor positions = torch::arange(
      tokens.size(1), torch::dtype(torch::kLong).device(tokens.device()));
  return transformer->wte(tokens) + transformer->wpe(positions);
}

torch::Tensor GptImpl::Head(const torch::Tensor& x) {
  return torch::matmul(transformer->ln_f(x), transformer->wte->weight.t());
}

GptBlockImpl& GptImpl::block(size_t i) {
  return *transformer->h[i]->as<GptBlockImpl>();
}

torch::Tensor GptImpl::forward(const torch::Tensor& tokens) {
  torch::Tensor x = Embed(tokens);
  for (size_t i = 0; i < transformer->h->size(); ++i) {
    x = block(i).forward(x);
  }
  return Head(x);
}

absl::StatusOr<torch::Tensor> GptForward(Gpt& model, libtorch::FsdpModule& fsdp,
                                         const torch::Tensor& tokens,
                                         libtorch::Recomputation recompute) {
  return fsdp.Forward([&]() -> absl::StatusOr<torch::Tensor> {
    torch::Tensor x = model->Embed(tokens);
    for (size_t i = 0; i < model->transformer->h->size(); ++i) {
      // By value: a recompute runs it again in the backward.
      std::shared_ptr<GptBlockImpl> block =
          model->transformer->h->ptr<GptBlockImpl>(i);
      FLATPARAM_ASSIGN_OR_RETURN(x, fsdp.RecomputedUnit(
                                        absl::StrCat("transformer.h.", i), x,
                                        [block](const torch::Tensor& in) {
                                          return block->forward(in);
                                        },
                                        recompute));
    }
    return model->Head(x);
  });
}

torch::Tensor NextTokenLoss(const torch::Tensor& logits,
                            const torch::Tensor& tokens) {
  const int64_t s = logits.size(1);
  torch::Tensor targets = tokens.narrow(1, 1, s).reshape({-1});
  return torch::nn::functional::cross_entropy(
      logits.reshape({-1, logits.size(-1)}), targets);
}

absl::StatusOr<TextBatches> TextBatches::FromFile(const std::string& path,
                                                  int64_t seq) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  std::ostringstream text;
  text << in.rdbuf();
  if (static_cast<int64_t>(text.str().size()) < seq + 2) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, " has ", text.str().size(), " bytes; sequences of ",
                     seq, " need at least ", seq + 2));
  }
  return TextBatches(text.str(), seq);
}

TextBatches::TextBatches(std::string text, int64_t seq)
    : text_(std::move(text)), seq_(seq) {}

torch::Tensor TextBatches::Batch(int64_t step, int64_t first,
                                 int64_t count) const {
  torch::Tensor out = torch::empty({count, seq_ + 1}, torch::kLong);
  auto a = out.accessor<int64_t, 2>();
  const uint64_t span = static_cast<uint64_t>(size() - seq_ - 1);
  for (int64_t i = 0; i < count; ++i) {
    // A generator per (step, sample): the same offset on every rank and
    // in every run, whatever else drew numbers.
    std::seed_seq seed{static_cast<uint64_t>(step),
                       static_cast<uint64_t>(first + i)};
    std::mt19937_64 generator(seed);
    const uint64_t offset = generator() % span;
    for (int64_t j = 0; j <= seq_; ++j) {
      a[i][j] = static_cast<unsigned char>(text_[offset + j]);
    }
  }
  return out;
}

std::vector<torch::Tensor> TrainableTensors(torch::nn::Module& module) {
  std::vector<torch::Tensor> unique;
  for (const torch::Tensor& p : module.parameters()) {
    bool seen = !p.requires_grad();
    for (const torch::Tensor& q : unique) {
      seen = seen || q.unsafeGetTensorImpl() == p.unsafeGetTensorImpl();
    }
    if (!seen) unique.push_back(p);
  }
  return unique;
}

std::vector<float> TrainFolded(
    torch::nn::Module& module, torch::optim::Optimizer& optimizer,
    const FoldOptions& options,
    const std::function<torch::Tensor(int step, int micro, int rank)>& loss) {
  const int w = options.world;
  const int s = options.shard_group_size > 0 ? options.shard_group_size : w;
  const float pre = static_cast<float>(GradientPredivideFactor(w));
  const float post = static_cast<float>(w / GradientPredivideFactor(w));
  std::vector<torch::Tensor> unique = TrainableTensors(module);
  std::vector<float> losses;
  for (int step = 0; step < options.steps; ++step) {
    std::vector<std::vector<torch::Tensor>> grads(w);
    float step_loss = 0;
    for (int r = 0; r < w; ++r) {
      for (torch::Tensor& p : unique) p.mutable_grad().reset();
      // no_sync: autograd accumulates the micro-batches' local gradients.
      for (int m = 0; m < options.micro_batches; ++m) {
        torch::Tensor l = loss(step, m, r);
        if (r == 0 && m == options.micro_batches - 1) {
          step_loss = l.item<float>();
        }
        l.backward();
      }
      for (torch::Tensor& p : unique) grads[r].push_back(p.grad().clone());
    }
    for (size_t k = 0; k < unique.size(); ++k) {
      torch::Tensor out = torch::empty_like(unique[k]);
      float* o = out.data_ptr<float>();
      for (int64_t e = 0; e < out.numel(); ++e) {
        auto g = [&](int r) {
          float v = grads[r][k].data_ptr<float>()[e];
          return pre == 1.0f ? v : v / pre;
        };
        float total = 0;
        for (int q = 0; q < w / s; ++q) {
          float acc = g(q * s);
          for (int r = q * s + 1; r < (q + 1) * s; ++r) acc = acc + g(r);
          total = q == 0 ? acc : total + acc;
        }
        o[e] = post == 1.0f ? total : total / post;
      }
      unique[k].mutable_grad() = out;
    }
    optimizer.step();
    losses.push_back(step_loss);
  }
  return losses;
}

absl::StatusOr<GptFsdpRun> TrainGptUnderFsdp(
    Gpt& model, Communicator& comm, DeviceOps& device, const TextBatches& text,
    int steps, int64_t local_batch, const torch::optim::AdamWOptions& adamw,
    const std::function<void(int step, float loss)>& on_step,
    const std::function<absl::Status(
        libtorch::FsdpModule& fsdp, torch::optim::Optimizer& optimizer)>& after,
    const GptFsdpOptions& gpt_options) {
  HostTorchDevice host(&device);
  return TrainGptUnderFsdp(model, comm, host, text, steps, local_batch, adamw,
                           on_step, after, gpt_options);
}

absl::StatusOr<GptFsdpRun> TrainGptUnderFsdp(
    Gpt& model, Communicator& comm, TorchDevice& device,
    const TextBatches& text, int steps, int64_t local_batch,
    const torch::optim::AdamWOptions& adamw,
    const std::function<void(int step, float loss)>& on_step,
    const std::function<absl::Status(
        libtorch::FsdpModule& fsdp, torch::optim::Optimizer& optimizer)>& after,
    const GptFsdpOptions& gpt_options) {
  libtorch::FsdpOptions options;
  options.wrap = {"transformer.h.*"};
  options.strategy = gpt_options.strategy;
  options.shard_group_size = gpt_options.shard_group_size;
  options.handle.streams = gpt_options.streams;
  FLATPARAM_ASSIGN_OR_RETURN(
      std::unique_ptr<libtorch::FsdpModule> fsdp,
      libtorch::FsdpModule::Wrap(model.ptr(), &comm, &device, options));
  torch::optim::AdamW optimizer(fsdp->ShardedParameters(), adamw);
  if (gpt_options.before) {
    FLATPARAM_RETURN_IF_ERROR(gpt_options.before(*fsdp, optimizer));
  }
  GptFsdpRun run;
  for (int step = gpt_options.first_step; step < gpt_options.first_step + steps;
       ++step) {
    torch::Tensor batch =
        text.Batch(step, comm.rank() * local_batch, local_batch)
            .to(device.torch_device());
    FLATPARAM_ASSIGN_OR_RETURN(
        torch::Tensor logits,
        GptForward(model, *fsdp, batch.narrow(1, 0, text.seq()),
                   gpt_options.recompute));
    torch::Tensor loss = NextTokenLoss(logits, batch);
    run.losses.push_back(loss.item<float>());
    if (on_step) on_step(step, run.losses.back());
    FLATPARAM_RETURN_IF_ERROR(fsdp->Backward(loss));
    optimizer.step();
    FLATPARAM_RETURN_IF_ERROR(fsdp->ZeroGrad());
  }
  if (after) FLATPARAM_RETURN_IF_ERROR(after(*fsdp, optimizer));
  FLATPARAM_ASSIGN_OR_RETURN(run.full_state, fsdp->FullStateDict());
  return run;
}

}  // namespace refmodel
}  // namespace flatparam
