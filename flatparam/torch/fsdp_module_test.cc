#include "flatparam/torch/fsdp_module.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/base/status_matchers.h"
#include "flatparam/device/device.h"
#include "flatparam/handle.h"
#include "sim/sim.h"

namespace flatparam {
namespace libtorch {
namespace {

using ::flatparam::IsOk;

// A small pre-norm decoder-style network: a tied embedding and head, and
// residual blocks (layer norm, two linears) that are FSDP units.
struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(int64_t d)
      : ln(register_module(
            "ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})))),
        fc1(register_module("fc1", torch::nn::Linear(d, 2 * d))),
        fc2(register_module("fc2", torch::nn::Linear(2 * d, d))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    return x + fc2(torch::gelu(fc1(ln(x))));
  }
  torch::nn::LayerNorm ln;
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(Block);

struct NetImpl : torch::nn::Module {
  NetImpl(int64_t vocab, int64_t d, int layers) {
    wte = register_module("wte", torch::nn::Embedding(vocab, d));
    h = register_module("h", torch::nn::ModuleList());
    for (int i = 0; i < layers; ++i) h->push_back(Block(d));
    ln_f = register_module(
        "ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
    // The head is the embedding, registered under a second name.
    lm_head = register_module("lm_head", std::make_shared<torch::nn::Module>());
    lm_head->register_parameter("weight", wte->weight);
  }
  torch::Tensor Head(const torch::Tensor& x) {
    return torch::matmul(ln_f(x), wte->weight.t());
  }
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
Net MakeNet(const std::string& frozen_prefix = "") {
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

// Tokens of sample `sample` at step `step` (inputs and targets).
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

enum class Optim { kSgd, kAdamW };

std::unique_ptr<torch::optim::Optimizer> MakeOptimizer(
    Optim optim, std::vector<torch::Tensor> params) {
  if (optim == Optim::kSgd) {
    return std::make_unique<torch::optim::SGD>(
        params, torch::optim::SGDOptions(0.1).momentum(0.9).weight_decay(0.01));
  }
  return std::make_unique<torch::optim::AdamW>(
      params, torch::optim::AdamWOptions(0.01).weight_decay(0.1));
}

struct Case {
  int world = 2;
  ShardingStrategy strategy = ShardingStrategy::kFullShard;
  int shard_group_size = 0;
  Optim optim = Optim::kAdamW;
  int steps = 3;
  int64_t global_batch = 4;
  // Parameters frozen by name prefix ("h.0.": a whole unit).
  std::string frozen;
};

std::string Name(const Case& c) {
  return absl::StrFormat(
      "%s_w%d%s_%s%s", ShardingStrategyName(c.strategy), c.world,
      c.shard_group_size ? absl::StrCat("x", c.shard_group_size) : "",
      c.optim == Optim::kSgd ? "sgd" : "adamw",
      c.frozen.empty() ? "" : "_frozen");
}

// Single-process LibTorch training of the global batch, with the ranks'
// gradients folded as FSDP's reduction does: per element, in float32,
// acc = g_0 / pre; acc = acc + g_r / pre (rank order); acc = acc / post,
// a division by exactly 1 skipped; hybrid: a fold per shard group, then
// the groups' sums in order.
std::map<std::string, torch::Tensor> TrainReference(const Case& c) {
  Net net = MakeNet(c.frozen);
  std::vector<torch::Tensor> params = net->parameters();
  const int w = c.world;
  const int s = c.shard_group_size > 0 ? c.shard_group_size : w;
  const float pre = static_cast<float>(GradientPredivideFactor(w));
  const float post = static_cast<float>(w / GradientPredivideFactor(w));
  const int64_t local = c.global_batch / w;
  // Unique trainable tensors (the tied weight is one, and is stepped once).
  std::vector<torch::Tensor> unique;
  for (const torch::Tensor& p : params) {
    bool seen = !p.requires_grad();
    for (const torch::Tensor& q : unique) {
      seen = seen || q.unsafeGetTensorImpl() == p.unsafeGetTensorImpl();
    }
    if (!seen) unique.push_back(p);
  }
  auto optimizer = MakeOptimizer(c.optim, unique);
  for (int step = 0; step < c.steps; ++step) {
    std::vector<std::vector<torch::Tensor>> grads(w);
    for (int r = 0; r < w; ++r) {
      for (torch::Tensor& p : unique) p.mutable_grad().reset();
      torch::Tensor tokens = Tokens(step, r * local, local);
      torch::Tensor x = net->wte(tokens.narrow(1, 0, kSeq));
      for (size_t i = 0; i < net->h->size(); ++i) {
        x = net->h[i]->as<BlockImpl>()->forward(x);
      }
      Loss(net->Head(x), tokens).backward();
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
    optimizer->step();
  }
  std::map<std::string, torch::Tensor> out;
  for (const auto& p : net->named_parameters()) {
    out[p.key()] = p.value().detach().clone();
  }
  return out;
}

struct FsdpResult {
  // Rank 0's full state dict and hook statistics.
  std::map<std::string, torch::Tensor> state;
  FsdpModuleStats stats;
};

// The same training with FsdpModule on `c.world` simulated ranks.
absl::StatusOr<FsdpResult> TrainFsdp(const Case& c) {
  SimOptions sim;
  sim.world_size = c.world;
  FLATPARAM_ASSIGN_OR_RETURN(std::unique_ptr<SimWorld> world,
                             SimWorld::Create(sim));
  FsdpResult result;
  FLATPARAM_RETURN_IF_ERROR(
      world->Run([&](SimCommunicator& comm) -> absl::Status {
        HostDeviceOps device;
        Net net = MakeNet(c.frozen);
        FsdpOptions options;
        options.wrap = {"h.*"};
        options.strategy = c.strategy;
        options.shard_group_size = c.shard_group_size;
        FLATPARAM_ASSIGN_OR_RETURN(
            std::unique_ptr<FsdpModule> fsdp,
            FsdpModule::Wrap(net.ptr(), &comm, &device, options));
        auto optimizer = MakeOptimizer(c.optim, fsdp->ShardedParameters());
        const int64_t local = c.global_batch / c.world;
        for (int step = 0; step < c.steps; ++step) {
          torch::Tensor tokens = Tokens(step, comm.rank() * local, local);
          FLATPARAM_ASSIGN_OR_RETURN(
              torch::Tensor logits,
              fsdp->Forward([&]() -> absl::StatusOr<torch::Tensor> {
                torch::Tensor x = net->wte(tokens.narrow(1, 0, kSeq));
                for (size_t i = 0; i < net->h->size(); ++i) {
                  FLATPARAM_ASSIGN_OR_RETURN(
                      x, fsdp->Unit(absl::StrCat("h.", i), [&] {
                        return net->h[i]->as<BlockImpl>()->forward(x);
                      }));
                }
                return net->Head(x);
              }));
          FLATPARAM_RETURN_IF_ERROR(fsdp->Backward(Loss(logits, tokens)));
          optimizer->step();
          FLATPARAM_RETURN_IF_ERROR(fsdp->ZeroGrad());
        }
        FLATPARAM_ASSIGN_OR_RETURN(auto state, fsdp->FullStateDict());
        if (comm.rank() == 0) {
          result.state = std::move(state);
          result.stats = fsdp->stats();
        }
        return absl::OkStatus();
      }));
  return result;
}

class FsdpModuleTrainingTest : public ::testing::TestWithParam<Case> {};

// Every parameter after training is bitwise the single-process result.
TEST_P(FsdpModuleTrainingTest, BitwiseEqualToSingleProcessTraining) {
  const Case& c = GetParam();
  std::map<std::string, torch::Tensor> expected = TrainReference(c);
  absl::StatusOr<FsdpResult> got = TrainFsdp(c);
  ASSERT_THAT(got.status(), IsOk());
  // The tied head is stored once, under the embedding's name.
  EXPECT_EQ(got->state.size(), expected.size() - 1);
  for (const auto& [name, tensor] : got->state) {
    ASSERT_TRUE(expected.count(name)) << name;
    EXPECT_TRUE(torch::equal(tensor, expected.at(name)))
        << name << ": max difference "
        << (tensor - expected.at(name)).abs().max().item<float>();
    // Training moved it, unless it is frozen.
    const bool frozen = !c.frozen.empty() && name.rfind(c.frozen, 0) == 0;
    EXPECT_EQ(torch::equal(tensor, InitialParams().at(name)), frozen) << name;
  }
  // Every unit reduced once per backward: during the backward (as its
  // last gradient arrived), except a unit with a frozen parameter, which
  // reduces at its end.
  const int frozen_units = c.frozen.empty() ? 0 : 1;
  EXPECT_EQ(got->stats.backwards, c.steps);
  EXPECT_EQ(got->stats.reductions_in_backward,
            c.steps * (kLayers + 1 - frozen_units));
  EXPECT_EQ(got->stats.reductions_at_end, c.steps * frozen_units);
}

INSTANTIATE_TEST_SUITE_P(
    Strategies, FsdpModuleTrainingTest,
    ::testing::Values(
        Case{1, ShardingStrategy::kFullShard, 0, Optim::kSgd, 1},
        Case{2, ShardingStrategy::kFullShard, 0, Optim::kSgd, 1},
        Case{2, ShardingStrategy::kFullShard, 0, Optim::kAdamW},
        Case{4, ShardingStrategy::kFullShard, 0, Optim::kSgd},
        Case{2, ShardingStrategy::kShardGradOp, 0, Optim::kAdamW},
        Case{2, ShardingStrategy::kNoShard, 0, Optim::kAdamW},
        Case{4, ShardingStrategy::kHybridShard, 2, Optim::kAdamW},
        Case{4, ShardingStrategy::kHybridShardZero2, 2, Optim::kSgd},
        Case{2, ShardingStrategy::kFullShard, 0, Optim::kAdamW, 3, 4, "h.0."},
        Case{4, ShardingStrategy::kShardGradOp, 0, Optim::kSgd, 3, 4, "h.1."}),
    [](const ::testing::TestParamInfo<Case>& info) {
      return Name(info.param);
    });

// Runs `body` on one simulated rank with host DeviceOps.
void OnOneRank(const std::function<void(SimCommunicator&, DeviceOps&)>& body) {
  SimOptions sim;
  sim.world_size = 1;
  absl::StatusOr<std::unique_ptr<SimWorld>> world = SimWorld::Create(sim);
  ASSERT_THAT(world.status(), IsOk());
  ASSERT_THAT((*world)->Run([&](SimCommunicator& comm) -> absl::Status {
    HostDeviceOps device;
    body(comm, device);
    return absl::OkStatus();
  }),
              IsOk());
}

// A one-unit-per-block wrap of a fresh network.
absl::StatusOr<std::unique_ptr<FsdpModule>> WrapNet(const Net& net,
                                                    Communicator& comm,
                                                    DeviceOps& device) {
  FsdpOptions options;
  options.wrap = {"h.*"};
  return FsdpModule::Wrap(net.ptr(), &comm, &device, options);
}

TEST(FsdpModuleErrorsTest, WrapRefusesWhatItCannotShard) {
  OnOneRank([](SimCommunicator& comm, DeviceOps& device) {
    Net net = MakeNet();
    EXPECT_EQ(FsdpModule::Wrap(net.ptr(), nullptr, &device).status().code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(FsdpModule::Wrap(nullptr, &comm, &device).status().code(),
              absl::StatusCode::kInvalidArgument);

    // Two tensors over one storage.
    auto views = std::make_shared<torch::nn::Module>();
    torch::Tensor base = torch::zeros({10});
    views->register_parameter("a", base.narrow(0, 0, 5));
    views->register_parameter("b", base.narrow(0, 5, 5));
    absl::Status status = FsdpModule::Wrap(views, &comm, &device).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(status.message().find("\"a\" and \"b\""), std::string::npos)
        << status;

    // An integer parameter.
    auto ints = std::make_shared<torch::nn::Module>();
    ints->register_parameter("w", torch::zeros({3}));
    ints->register_parameter("count", torch::zeros({2}, torch::kLong),
                             /*requires_grad=*/false);
    status = FsdpModule::Wrap(ints, &comm, &device).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(status.message().find("\"count\""), std::string::npos) << status;

    // A wrap name that is no module.
    FsdpOptions options;
    options.wrap = {"blocks.*"};
    status =
        FsdpModule::Wrap(MakeNet().ptr(), &comm, &device, options).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  });
}

TEST(FsdpModuleErrorsTest, MisuseInTheForwardIsAStatus) {
  OnOneRank([](SimCommunicator& comm, DeviceOps& device) {
    Net net = MakeNet();
    absl::StatusOr<std::unique_ptr<FsdpModule>> fsdp =
        WrapNet(net, comm, device);
    ASSERT_THAT(fsdp.status(), IsOk());
    torch::Tensor tokens = Tokens(0, 0, 2).narrow(1, 0, kSeq);

    // Unit outside Forward, and a name that is not a unit.
    EXPECT_EQ(
        (*fsdp)->Unit("h.0", [] { return torch::Tensor(); }).status().code(),
        absl::StatusCode::kFailedPrecondition);
    absl::StatusOr<torch::Tensor> out =
        (*fsdp)->Forward([&]() -> absl::StatusOr<torch::Tensor> {
          return (*fsdp)->Unit("h.9", [] { return torch::Tensor(); });
        });
    EXPECT_EQ(out.status().code(), absl::StatusCode::kNotFound);
    EXPECT_NE(out.status().message().find("\"h.2\""), std::string::npos)
        << out.status();

    // A block's parameters used outside its Unit: they are empty there.
    out = (*fsdp)->Forward([&]() -> absl::StatusOr<torch::Tensor> {
      return net->h[1]->as<BlockImpl>()->forward(net->wte(tokens));
    });
    EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(out.status().message().find("Unit("), std::string::npos)
        << out.status();

    // The wrapper still works after those errors.
    out = (*fsdp)->Forward([&]() -> absl::StatusOr<torch::Tensor> {
      torch::Tensor x = net->wte(tokens);
      for (size_t i = 0; i < net->h->size(); ++i) {
        FLATPARAM_ASSIGN_OR_RETURN(x, (*fsdp)->Unit(absl::StrCat("h.", i), [&] {
          return net->h[i]->as<BlockImpl>()->forward(x);
        }));
      }
      return net->Head(x);
    });
    ASSERT_THAT(out.status(), IsOk());
    EXPECT_THAT((*fsdp)->Backward(out->sum()), IsOk());
    EXPECT_EQ((*fsdp)->stats().backwards, 1);

    // A module changed after wrapping.
    net->register_parameter("extra", torch::zeros({2}));
    out = (*fsdp)->Forward([&]() -> absl::StatusOr<torch::Tensor> {
      return net->Head(net->wte(tokens));
    });
    EXPECT_EQ(out.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_NE(out.status().message().find("\"extra\""), std::string::npos)
        << out.status();
  });
}

}  // namespace
}  // namespace libtorch
}  // namespace flatparam

int main(int argc, char** argv) {
  // One intra-op thread: LibTorch's kernels then reduce in one order.
  torch::set_num_threads(1);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
