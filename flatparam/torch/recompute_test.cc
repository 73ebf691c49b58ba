#include "flatparam/torch/recompute.h"

#include <gtest/gtest.h>
#include <torch/autograd.h>
#include <torch/nn/modules/linear.h>
#include <torch/types.h>
#include <torch/utils.h>

#include <memory>
#include <vector>

namespace flatparam {
namespace libtorch {
namespace {

using torch::autograd::variable_list;

// Two linears with a GELU and dropout between them; `calls` counts the
// calls and `grad_on` records gradient mode in each.
struct Mlp {
  Mlp() {
    torch::manual_seed(7);
    fc1 = torch::nn::Linear(4, 8);
    fc2 = torch::nn::Linear(8, 4);
  }
  torch::Tensor operator()(const torch::Tensor& x, const torch::Tensor& y) {
    ++*calls;
    grad_on->push_back(torch::GradMode::is_enabled());
    torch::Tensor h = torch::gelu(fc1(x)) * y;
    h = torch::dropout(h, dropout, /*train=*/true);
    return fc2(h);
  }
  std::vector<torch::Tensor> Grads() const {
    return {fc1->weight.grad().clone(), fc1->bias.grad().clone(),
            fc2->weight.grad().clone(), fc2->bias.grad().clone()};
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  double dropout = 0.0;
  std::shared_ptr<int> calls = std::make_shared<int>(0);
  std::shared_ptr<std::vector<bool>> grad_on =
      std::make_shared<std::vector<bool>>();
};

// x: [3, 4], the MLP's input; y: [3, 8], a gate on its hidden layer.
torch::Tensor Input(int seed, bool requires_grad, int64_t width = 4) {
  torch::manual_seed(seed);
  return torch::randn({3, width}).requires_grad_(requires_grad);
}

void ExpectEqual(const std::vector<torch::Tensor>& a,
                 const std::vector<torch::Tensor>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(torch::equal(a[i], b[i])) << "tensor " << i;
  }
}

// Two inputs (one without a gradient): the outputs, the inputs' and the
// parameters' gradients are bitwise plain autograd's; the function ran
// twice, without gradients in the forward (no activations kept) and with
// them in the backward.
TEST(RecomputeTest, GradientsAreBitwisePlainAutograds) {
  Mlp plain_mlp;
  torch::Tensor x = Input(1, true);
  torch::Tensor y = Input(2, false, 8);
  torch::Tensor plain = plain_mlp(x, y);
  plain.pow(2).sum().backward();
  const torch::Tensor plain_x_grad = x.grad().clone();

  Mlp mlp;
  torch::Tensor x2 = Input(1, true);
  torch::Tensor y2 = Input(2, false, 8);
  variable_list out = Recompute(
      [mlp](const variable_list& in) mutable {
        return variable_list{mlp(in[0], in[1])};
      },
      {x2, y2});
  ASSERT_EQ(out.size(), 1u);
  EXPECT_TRUE(torch::equal(out[0], plain));
  EXPECT_EQ(*mlp.calls, 1);
  out[0].pow(2).sum().backward();
  EXPECT_EQ(*mlp.calls, 2);
  EXPECT_EQ(*mlp.grad_on, (std::vector<bool>{false, true}));
  EXPECT_TRUE(torch::equal(x2.grad(), plain_x_grad));
  EXPECT_FALSE(y2.grad().defined());
  ExpectEqual(mlp.Grads(), plain_mlp.Grads());
}

// Dropout draws the same mask in the recompute as in the forward (the
// generator's state restored), so the gradients are plain autograd's;
// without preserve_rng_state they are not, which shows the check can fail.
TEST(RecomputeTest, RandomNumbersAreDrawnAgainAlike) {
  auto run = [](bool recompute, bool preserve) {
    Mlp mlp;
    mlp.dropout = 0.5;
    torch::Tensor x = Input(1, true);
    torch::Tensor y = Input(2, false, 8);
    torch::manual_seed(11);
    torch::Tensor out;
    if (recompute) {
      RecomputeOptions options;
      options.preserve_rng_state = preserve;
      out = Recompute(
          [mlp, y](const torch::Tensor& in) mutable { return mlp(in, y); }, x,
          options);
    } else {
      out = mlp(x, y);
    }
    // Draws between the forward and the backward, as a next layer would.
    torch::Tensor after_forward = torch::rand({1});
    out.pow(2).sum().backward();
    std::vector<torch::Tensor> grads = mlp.Grads();
    grads.push_back(x.grad().clone());
    // The recompute leaves the generator where the backward found it.
    grads.push_back(torch::rand({4}));
    return grads;
  };
  ExpectEqual(run(true, true), run(false, false));
  std::vector<torch::Tensor> unpreserved = run(true, false);
  std::vector<torch::Tensor> plain = run(false, false);
  EXPECT_FALSE(torch::equal(unpreserved[4], plain[4]))
      << "the input's gradient should differ with another dropout mask";
}

// No input requires a gradient (a frozen embedding's output): the
// parameters inside still get theirs, as without recomputation.
TEST(RecomputeTest, ParametersGetGradientsWhenNoInputRequiresOne) {
  Mlp plain_mlp;
  plain_mlp(Input(1, false), Input(2, false, 8)).sum().backward();
  Mlp mlp;
  torch::Tensor y = Input(2, false, 8);
  torch::Tensor out = Recompute(
      [mlp, y](const torch::Tensor& in) mutable { return mlp(in, y); },
      Input(1, false));
  ASSERT_TRUE(out.requires_grad());
  out.sum().backward();
  ExpectEqual(mlp.Grads(), plain_mlp.Grads());
}

// Evaluation (gradients off): the function runs once, nothing is kept.
TEST(RecomputeTest, WithoutGradientsItIsTheFunction) {
  Mlp mlp;
  torch::NoGradGuard no_grad;
  torch::Tensor y = Input(2, false, 8);
  torch::Tensor out = Recompute(
      [mlp, y](const torch::Tensor& in) mutable { return mlp(in, y); },
      Input(1, true));
  EXPECT_FALSE(out.requires_grad());
  EXPECT_EQ(*mlp.calls, 1);
}

// retain_graph: a second backward recomputes again and accumulates the
// same gradients once more.
TEST(RecomputeTest, ASecondBackwardRecomputesAgain) {
  Mlp mlp;
  torch::Tensor y = Input(2, false, 8);
  torch::Tensor x = Input(1, true);
  torch::Tensor out = Recompute(
      [mlp, y](const torch::Tensor& in) mutable { return mlp(in, y); }, x);
  torch::Tensor loss = out.pow(2).sum();
  loss.backward({}, /*retain_graph=*/true);
  std::vector<torch::Tensor> once = mlp.Grads();
  loss.backward();
  EXPECT_EQ(*mlp.calls, 3);
  std::vector<torch::Tensor> twice = mlp.Grads();
  for (size_t i = 0; i < once.size(); ++i) {
    EXPECT_TRUE(torch::equal(twice[i], once[i] + once[i])) << i;
  }
}

// A function that fails in the recompute fails the backward with a
// c10::Error carrying its message; one whose recompute returns another
// number of tensors is reported, not trusted.
TEST(RecomputeTest, FailuresInTheBackwardAreLibTorchErrors) {
  auto calls = std::make_shared<int>(0);
  torch::Tensor x = Input(1, true);
  torch::Tensor out = Recompute(
      [calls](const torch::Tensor& in) {
        TORCH_CHECK(++*calls == 1, "the recompute failed");
        return in * 2;
      },
      x);
  try {
    out.sum().backward();
    FAIL() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("the recompute failed"),
              std::string::npos)
        << e.what();
  }

  auto count = std::make_shared<int>(0);
  variable_list outs = Recompute(
      [count](const variable_list& in) {
        return ++*count == 1 ? variable_list{in[0] * 2}
                             : variable_list{in[0] * 2, in[0] * 3};
      },
      {x});
  try {
    outs[0].sum().backward();
    FAIL() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("must be deterministic"),
              std::string::npos)
        << e.what();
  }
}

// The bitwise comparisons rely on torch_test_main's single intra-op
// thread.
TEST(TorchTestMainTest, OneIntraOpThread) {
  EXPECT_EQ(torch::get_num_threads(), 1);
}

}  // namespace
}  // namespace libtorch
}  // namespace flatparam
