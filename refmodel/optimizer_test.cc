#include "refmodel/optimizer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <vector>

#include "flatparam/base/dtype.h"
#include "flatparam/base/status_matchers.h"
#include "flatparam/flatten.h"

namespace flatparam {
namespace refmodel {
namespace {

using ::testing::ElementsAreArray;
using ::testing::HasSubstr;

// Bit patterns, so that comparisons are exact (and -0.0 != 0.0).
uint32_t Bits(float x) {
  uint32_t b;
  std::memcpy(&b, &x, sizeof(b));
  return b;
}
std::vector<uint32_t> Bits(const float* x, int64_t n) {
  std::vector<uint32_t> out;
  for (int64_t i = 0; i < n; ++i) out.push_back(Bits(x[i]));
  return out;
}
std::vector<uint32_t> Bits(const std::vector<float>& x) {
  return Bits(x.data(), static_cast<int64_t>(x.size()));
}
std::vector<uint32_t> Bits(const HostTensor& t) {
  return Bits(t.data_as<float>(), t.numel());
}

// The common fixture of the formula tests: three elements, three steps.
const std::vector<float> kInitialParam = {1.0f, -2.0f, 0.5f};
const std::vector<std::vector<float>> kGrads = {
    {0.5f, -0.25f, 0.125f}, {0.25f, 0.5f, -1.0f}, {-0.75f, 0.1f, 0.3f}};

BufferRef Ref(std::vector<float>& v) {
  return {v.data(), static_cast<int64_t>(v.size()), DType::kFloat32,
          Device::Host()};
}
ConstBufferRef CRef(const std::vector<float>& v) {
  return {v.data(), static_cast<int64_t>(v.size()), DType::kFloat32,
          Device::Host()};
}

// Expected values below were derived from the documented formulas with every
// float32 operation rounded separately (a Python transcription using
// struct-packing to round to float32; Python's own `**` for the bias
// corrections), i.e. what torch.optim computes on CPU through its scalar
// kernels.

struct SgdExpect {
  std::vector<float> param;
  std::vector<float> momentum_buffer;  // empty: no buffer
};

void RunSgd(const SgdOptions& options, const std::vector<SgdExpect>& expected) {
  FLATPARAM_ASSERT_OK_AND_ASSIGN(auto sgd, MakeSgd(options));
  std::vector<float> p = kInitialParam;
  OptimizerState state;
  for (size_t k = 0; k < expected.size(); ++k) {
    SCOPED_TRACE(testing::Message() << "step " << k + 1);
    FLATPARAM_ASSERT_OK(sgd->Step(Ref(p), CRef(kGrads[k]), state));
    EXPECT_THAT(Bits(p), ElementsAreArray(Bits(expected[k].param)));
    if (expected[k].momentum_buffer.empty()) {
      EXPECT_TRUE(state.tensors.empty());
    } else {
      ASSERT_EQ(state.tensors.size(), 1u);
      const HostTensor& buf = state.tensors.at("momentum_buffer");
      EXPECT_EQ(buf.shape(), std::vector<int64_t>{3});
      EXPECT_THAT(Bits(buf),
                  ElementsAreArray(Bits(expected[k].momentum_buffer)));
    }
  }
}

TEST(SgdTest, PlainStep) {
  // p = p - 0.1 * g: 1 - 0.05 = 0.95, 0.95 - 0.025 = 0.925, 0.925 + 0.075 = 1.
  SgdOptions o;
  o.lr = 0.1;
  RunSgd(o, {
                {{0x1.e66666p-1f, -0x1.f9999ap+0f, 0x1.f33334p-2f}, {}},
                {{0x1.d9999ap-1f, -0x1.033334p+1f, 0x1.2ccccep-1f}, {}},
                {{0x1p+0f, -0x1.047ae2p+1f, 0x1.1d70a4p-1f}, {}},
            });
}

TEST(SgdTest, MomentumDampeningWeightDecay) {
  // lr 0.1, momentum 0.9, dampening 0.5, weight decay 0.01. Element 0:
  //   step 1: g = 0.5 + 0.01*1 = 0.51; buf = g (dampening NOT applied on the
  //           first step, as PyTorch clones the gradient); p = 1 - 0.051.
  //   step 2: g = 0.25 + 0.01*0.949 = 0.25949; buf = 0.9*0.51 + 0.5*g
  //           = 0.588745; p = 0.949 - 0.0588745 = 0.8901255.
  SgdOptions o;
  o.lr = 0.1;
  o.momentum = 0.9;
  o.dampening = 0.5;
  o.weight_decay = 0.01;
  RunSgd(o, {
                {{0x1.e5e354p-1f, -0x1.f91688p+0f, 0x1.f2b02p-2f},
                 {0x1.051eb8p-1f, -0x1.147ae2p-2f, 0x1.0a3d7p-3f}},
                {{0x1.c7be88p-1f, -0x1.f903c2p+0f, 0x1.0cd434p-1f},
                 {0x1.2d6ffcp-1f, -0x1.77858p-9f, -0x1.85b2d6p-2f}},
                {{0x1.bf9648p-1f, -0x1.f9f9e6p+0f, 0x1.168d0ap-1f},
                 {0x1.464a28p-3f, 0x1.33acb2p-5f, -0x1.84e17cp-3f}},
            });
  // The hand-derived decimals agree.
  FLATPARAM_ASSERT_OK_AND_ASSIGN(auto sgd, MakeSgd(o));
  std::vector<float> p = kInitialParam;
  OptimizerState state;
  FLATPARAM_ASSERT_OK(sgd->Step(Ref(p), CRef(kGrads[0]), state));
  FLATPARAM_ASSERT_OK(sgd->Step(Ref(p), CRef(kGrads[1]), state));
  EXPECT_NEAR(p[0], 0.8901255, 1e-6);
  EXPECT_NEAR(state.tensors.at("momentum_buffer").data_as<float>()[0], 0.588745,
              1e-6);
}

TEST(SgdTest, NesterovMaximize) {
  // maximize negates g; nesterov steps with g + 0.9 * buf. Element 0, step 1:
  // g = -0.5, buf = -0.5, update = -0.95, p = 1 + 0.095 = 1.095.
  SgdOptions o;
  o.lr = 0.1;
  o.momentum = 0.9;
  o.nesterov = true;
  o.maximize = true;
  RunSgd(o, {
                {{0x1.1851ecp+0f, -0x1.06147ap+1f, 0x1.0c28f6p-1f},
                 {-0x1p-1f, 0x1p-2f, -0x1p-3f}},
                {{0x1.2ed918p+0f, -0x1.f90624p+0f, 0x1.6020c4p-2f},
                 {-0x1.666666p-1f, -0x1.19999ap-2f, 0x1.c66666p-1f}},
                {{0x1.18e21ap+0f, -0x1.ee7524p+0f, 0x1.50e21ap-2f},
                 {0x1.eb852p-4f, -0x1.63d70ap-2f, 0x1.feb85p-2f}},
            });
}

struct AdamExpect {
  std::vector<float> param, exp_avg, exp_avg_sq;
};

void RunAdamW(const AdamWOptions& options,
              const std::vector<AdamExpect>& expected) {
  FLATPARAM_ASSERT_OK_AND_ASSIGN(auto adamw, MakeAdamW(options));
  std::vector<float> p = kInitialParam;
  OptimizerState state;
  for (size_t k = 0; k < expected.size(); ++k) {
    SCOPED_TRACE(testing::Message() << "step " << k + 1);
    FLATPARAM_ASSERT_OK(adamw->Step(Ref(p), CRef(kGrads[k]), state));
    EXPECT_THAT(Bits(p), ElementsAreArray(Bits(expected[k].param)));
    ASSERT_EQ(state.tensors.size(), 3u);
    const HostTensor& step = state.tensors.at("step");
    EXPECT_TRUE(step.shape().empty());
    EXPECT_EQ(step.dtype(), DType::kFloat32);
    EXPECT_EQ(step.data_as<float>()[0], static_cast<float>(k + 1));
    EXPECT_THAT(Bits(state.tensors.at("exp_avg")),
                ElementsAreArray(Bits(expected[k].exp_avg)));
    EXPECT_THAT(Bits(state.tensors.at("exp_avg_sq")),
                ElementsAreArray(Bits(expected[k].exp_avg_sq)));
  }
}

TEST(AdamWTest, ThreeSteps) {
  // lr 0.1, betas (0.9, 0.999), eps 1e-8, weight decay 0.01. Element 0:
  //   step 1: p = 0.999; m = 0.05; v = 0.00025; bc1 = 0.1, bc2 = 0.001;
  //           step_size = 1; denom = 0.5 + 1e-8; p = 0.999 - 0.1 = 0.899
  //           (Adam's first step moves by lr * sign(g)).
  //   step 2: p = 0.899 * 0.999 = 0.898101; m = 0.05 + 0.1 * (0.25 - 0.05)
  //           = 0.07; v = 0.999 * 0.00025 + 0.001 * 0.0625 = 0.00031225;
  //           bc1 = 0.19, bc2 = 0.001999; denom = sqrt(0.00031225) /
  //           sqrt(0.001999) = 0.3952249; p = 0.898101 - (0.1 / 0.19) * 0.07
  //           / 0.3952249 = 0.8048831.
  AdamWOptions o;
  o.lr = 0.1;
  RunAdamW(o, {
                  {{0x1.cc49bcp-1f, -0x1.e5e354p+0f, 0x1.991688p-2f},
                   {0x1.99999ap-5f, -0x1.99999ap-6f, 0x1.99999ap-7f},
                   {0x1.0624dep-12f, 0x1.0624dep-14f, 0x1.0624dep-16f}},
                  {{0x1.9c19a2p-1f, -0x1.eec63ep+0f, 0x1.dbc8ccp-2f},
                   {0x1.1eb852p-4f, 0x1.c28f5ap-6f, -0x1.6b852p-4f},
                   {0x1.476afap-12f, 0x1.479d4ep-12f, 0x1.0a3c66p-10f}},
                  {{0x1.9fe29ep-1f, -0x1.f84adcp+0f, 0x1.fa59dcp-2f},
                   {-0x1.89375p-7f, 0x1.1cac08p-5f, -0x1.989376p-5f},
                   {0x1.ca750cp-11f, 0x1.51c5cap-12f, 0x1.21900ap-10f}},
              });
  FLATPARAM_ASSERT_OK_AND_ASSIGN(auto adamw, MakeAdamW(o));
  std::vector<float> p = kInitialParam;
  OptimizerState state;
  FLATPARAM_ASSERT_OK(adamw->Step(Ref(p), CRef(kGrads[0]), state));
  EXPECT_NEAR(p[0], 0.899, 1e-6);
  FLATPARAM_ASSERT_OK(adamw->Step(Ref(p), CRef(kGrads[1]), state));
  EXPECT_NEAR(p[0], 0.8048831, 1e-6);
}

TEST(AdamWTest, LargeLerpWeightUsesTheOtherBranch) {
  // beta1 = 0.3 makes lerp's weight 0.7 >= 0.5: m = g - (g - m) * (1 - w).
  AdamWOptions o;
  o.lr = 0.1;
  o.beta1 = 0.3;
  o.beta2 = 0.9;
  o.eps = 1e-3;
  o.weight_decay = 0.5;
  RunAdamW(o, {
                  {{0x1.b34d5cp-1f, -0x1.cce6e8p+0f, 0x1.80d00cp-2f},
                   {0x1.666666p-2f, -0x1.666666p-3f, 0x1.666666p-4f},
                   {0x1.99999ap-6f, 0x1.99999ap-8f, 0x1.99999ap-10f}},
                  {{0x1.752454p-1f, -0x1.caa6b2p+0f, 0x1.d53516p-2f},
                   {0x1.1eb852p-2f, 0x1.30a3d6p-2f, -0x1.58f5c2p-1f},
                   {0x1.d70a3cp-6f, 0x1.f5c29p-6f, 0x1.9f5c2ap-4f}},
                  {{0x1.8c901p-1f, -0x1.c095c4p+0f, 0x1.bc62fep-2f},
                   {-0x1.c3958p-2f, 0x1.4624dep-3f, 0x1.020c4p-7f},
                   {0x1.50624ep-4f, 0x1.d3f7cep-6f, 0x1.9ab022p-4f}},
              });
}

// A deterministic pseudo-random vector.
std::vector<float> Values(int64_t n, uint32_t seed) {
  std::vector<float> v(static_cast<size_t>(n));
  uint32_t x = seed * 2654435761u + 1;
  for (auto& e : v) {
    x = x * 1664525u + 1013904223u;
    e = static_cast<float>(static_cast<int32_t>(x >> 8) - (1 << 23)) /
        static_cast<float>(1 << 22);
  }
  return v;
}

// Stepping a parameter in two pieces with split state gives the same bits as
// stepping it whole: what makes sharded optimizer steps exact.
void ExpectShardedStepMatchesWhole(const OptimizerOptions& options) {
  FLATPARAM_ASSERT_OK_AND_ASSIGN(auto opt, MakeOptimizer(options));
  constexpr int64_t kN = 37;
  constexpr int64_t kSplit = 13;
  std::vector<float> whole = Values(kN, 1);
  std::vector<float> lo(whole.begin(), whole.begin() + kSplit);
  std::vector<float> hi(whole.begin() + kSplit, whole.end());
  OptimizerState s_whole, s_lo, s_hi;
  for (uint32_t step = 0; step < 4; ++step) {
    const std::vector<float> g = Values(kN, 100 + step);
    const std::vector<float> g_lo(g.begin(), g.begin() + kSplit);
    const std::vector<float> g_hi(g.begin() + kSplit, g.end());
    FLATPARAM_ASSERT_OK(opt->Step(Ref(whole), CRef(g), s_whole));
    FLATPARAM_ASSERT_OK(opt->Step(Ref(lo), CRef(g_lo), s_lo));
    FLATPARAM_ASSERT_OK(opt->Step(Ref(hi), CRef(g_hi), s_hi));
  }
  std::vector<float> joined = lo;
  joined.insert(joined.end(), hi.begin(), hi.end());
  EXPECT_THAT(Bits(joined), ElementsAreArray(Bits(whole)));
  for (const auto& [name, t] : s_whole.tensors) {
    SCOPED_TRACE(name);
    if (name == "step") {
      EXPECT_EQ(s_lo.tensors.at(name), t);
      continue;
    }
    std::vector<uint32_t> parts = Bits(s_lo.tensors.at(name));
    for (uint32_t b : Bits(s_hi.tensors.at(name))) parts.push_back(b);
    EXPECT_THAT(parts, ElementsAreArray(Bits(t)));
  }
}

TEST(OptimizerTest, ShardedStepMatchesWholeStepSgd) {
  SgdOptions o;
  o.lr = 0.05;
  o.momentum = 0.9;
  o.weight_decay = 0.1;
  o.nesterov = true;
  ExpectShardedStepMatchesWhole(o);
}

TEST(OptimizerTest, ShardedStepMatchesWholeStepAdamW) {
  AdamWOptions o;
  o.lr = 0.01;
  ExpectShardedStepMatchesWhole(o);
}

TEST(OptimizerTest, AbsentGradientSkipsTheParameter) {
  for (const OptimizerOptions& options :
       {OptimizerOptions(SgdOptions{0.1, 0.9}),
        OptimizerOptions(AdamWOptions{})}) {
    FLATPARAM_ASSERT_OK_AND_ASSIGN(auto opt, MakeOptimizer(options));
    SCOPED_TRACE(opt->name());
    std::vector<float> p = kInitialParam;
    OptimizerState state;
    FLATPARAM_ASSERT_OK(opt->Step(Ref(p), std::nullopt, state));
    EXPECT_THAT(Bits(p), ElementsAreArray(Bits(kInitialParam)));
    EXPECT_TRUE(state.tensors.empty());
    FLATPARAM_ASSERT_OK(opt->Step(Ref(p), CRef(kGrads[0]), state));
    const OptimizerState after_one = state;
    const std::vector<float> p_after_one = p;
    FLATPARAM_ASSERT_OK(opt->Step(Ref(p), std::nullopt, state));
    EXPECT_EQ(state, after_one);  // step count included
    EXPECT_THAT(Bits(p), ElementsAreArray(Bits(p_after_one)));
  }
}

TEST(OptimizerTest, ZeroMomentumSgdKeepsNoState) {
  FLATPARAM_ASSERT_OK_AND_ASSIGN(auto sgd, MakeSgd({0.1}));
  std::vector<float> p = kInitialParam;
  OptimizerState state;
  FLATPARAM_ASSERT_OK(sgd->Step(Ref(p), CRef(kGrads[0]), state));
  EXPECT_TRUE(state.tensors.empty());
}

TEST(OptimizerTest, AcceptsStateShapedLikeTheParameter) {
  FLATPARAM_ASSERT_OK_AND_ASSIGN(auto adamw, MakeAdamW({}));
  std::vector<float> p = Values(6, 3);
  const std::vector<float> g = Values(6, 4);
  OptimizerState flat, shaped;
  FLATPARAM_ASSERT_OK(adamw->Step(Ref(p), CRef(g), flat));
  shaped.tensors.emplace("step", HostTensor(DType::kFloat32, {}));
  shaped.tensors.emplace("exp_avg", HostTensor(DType::kFloat32, {2, 3}));
  shaped.tensors.emplace("exp_avg_sq", HostTensor(DType::kFloat32, {2, 3}));
  std::vector<float> p2 = Values(6, 3);
  FLATPARAM_ASSERT_OK(adamw->Step(Ref(p2), CRef(g), shaped));
  EXPECT_THAT(Bits(p2), ElementsAreArray(Bits(p)));
  EXPECT_EQ(shaped.tensors.at("exp_avg").shape(), (std::vector<int64_t>{2, 3}));
}

TEST(OptimizerTest, RejectsBadArguments) {
  FLATPARAM_ASSERT_OK_AND_ASSIGN(auto adamw, MakeAdamW({}));
  FLATPARAM_ASSERT_OK_AND_ASSIGN(auto sgd, MakeSgd({0.1, 0.9}));
  std::vector<float> p = kInitialParam;
  const std::vector<float> p_before = p;
  OptimizerState state;

  std::vector<double> p64 = {1.0, 2.0, 3.0};
  EXPECT_THAT(
      adamw->Step({p64.data(), 3, DType::kFloat64, Device::Host()},
                  CRef(kGrads[0]), state),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("float64")));
  const std::vector<float> short_grad = {1.0f, 2.0f};
  EXPECT_THAT(adamw->Step(Ref(p), CRef(short_grad), state),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("3 elements but the gradient 2")));

  OptimizerState partial;
  partial.tensors.emplace("exp_avg", HostTensor::Flat(DType::kFloat32, 3));
  EXPECT_THAT(adamw->Step(Ref(p), CRef(kGrads[0]), partial),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("only [exp_avg]")));

  OptimizerState wrong_size;
  wrong_size.tensors.emplace("momentum_buffer",
                             HostTensor::Flat(DType::kFloat32, 4));
  EXPECT_THAT(sgd->Step(Ref(p), CRef(kGrads[0]), wrong_size),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("\"momentum_buffer\" has dtype float32 and "
                                 "shape [4]; expected float32 with 3")));

  OptimizerState adam_state;
  FLATPARAM_ASSERT_OK(adamw->Step(Ref(p), CRef(kGrads[0]), adam_state));
  std::vector<float> p_copy = p;
  EXPECT_THAT(sgd->Step(Ref(p_copy), CRef(kGrads[0]), adam_state),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("entry \"exp_avg\"")));
  EXPECT_THAT(Bits(p_copy), ElementsAreArray(Bits(p)));

  OptimizerState step_not_scalar;
  step_not_scalar.tensors.emplace("step", HostTensor::Flat(DType::kFloat32, 1));
  step_not_scalar.tensors.emplace("exp_avg",
                                  HostTensor::Flat(DType::kFloat32, 3));
  step_not_scalar.tensors.emplace("exp_avg_sq",
                                  HostTensor::Flat(DType::kFloat32, 3));
  EXPECT_THAT(adamw->Step(Ref(p), CRef(kGrads[0]), step_not_scalar),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("shape [] (0-d)")));
}

TEST(OptimizerTest, RejectsBadOptionsLikePyTorch) {
  EXPECT_THAT(MakeSgd({-0.1}), StatusIs(absl::StatusCode::kInvalidArgument,
                                        HasSubstr("Invalid learning rate")));
  SgdOptions nesterov;
  nesterov.nesterov = true;
  EXPECT_THAT(MakeSgd(nesterov),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("Nesterov momentum requires")));
  nesterov.momentum = 0.9;
  nesterov.dampening = 0.1;
  EXPECT_THAT(MakeSgd(nesterov), StatusIs(absl::StatusCode::kInvalidArgument,
                                          HasSubstr("dampening 0.1")));
  AdamWOptions beta;
  beta.beta2 = 1.0;
  EXPECT_THAT(MakeAdamW(beta),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("Invalid beta parameter at index 1: 1")));
  AdamWOptions eps;
  eps.eps = -1;
  EXPECT_THAT(MakeAdamW(eps), StatusIs(absl::StatusCode::kInvalidArgument,
                                       HasSubstr("Invalid epsilon value")));
}

// AdamW's per-step bound is Cauchy-Schwarz's: no gradient sequence moves
// an element further, and gradients proportional to (beta1/beta2)^(t-j)
// (the equality case) reach it at step t.
TEST(AdamWBoundTest, BoundsEveryUpdateAndIsReached) {
  AdamWOptions o;
  o.lr = 1.0;
  o.eps = 0.0;
  o.weight_decay = 0.0;
  EXPECT_DOUBLE_EQ(AdamWUpdateBound(o, 1), 1.0);
  FLATPARAM_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Optimizer> adamw,
                                 MakeAdamW(o));
  auto run = [&](const std::vector<float>& grads) {
    std::vector<double> moves;
    float p = 0.0f;
    OptimizerState state;
    for (float g : grads) {
      const float before = p;
      EXPECT_THAT(
          adamw->Step(BufferRef{&p, 1, DType::kFloat32, Device::Host()},
                      ConstBufferRef{&g, 1, DType::kFloat32, Device::Host()},
                      state),
          IsOk());
      moves.push_back(std::abs(static_cast<double>(p) - before));
    }
    return moves;
  };
  constexpr int kSteps = 10;
  std::vector<float> worst;
  for (int j = 1; j <= kSteps; ++j) {
    worst.push_back(
        static_cast<float>(std::pow(o.beta1 / o.beta2, kSteps - j)));
  }
  const std::vector<double> moves = run(worst);
  EXPECT_NEAR(moves.back(), AdamWUpdateBound(o, kSteps),
              1e-5 * AdamWUpdateBound(o, kSteps));
  EXPECT_GT(AdamWUpdateBound(o, kSteps), 1.0);
  EXPECT_GT(AdamWUpdateBound(o, 100000), 7.2);
  uint64_t state = 7;
  for (int trial = 0; trial < 50; ++trial) {
    std::vector<float> grads;
    for (int t = 0; t < 30; ++t) {
      state = state * 6364136223846793005ULL + 1442695040888963407ULL;
      grads.push_back(std::ldexp(static_cast<float>(state >> 40), -20) - 8.0f);
    }
    const std::vector<double> m = run(grads);
    for (int t = 0; t < 30; ++t) {
      ASSERT_LE(m[t], AdamWUpdateBound(o, t + 1) * (1 + 1e-5))
          << "trial " << trial << " step " << t + 1;
    }
  }
  // Two runs from the same start: twice the sum, plus rounding slack.
  o.lr = 0.01;
  double sum = 0;
  for (int t = 1; t <= 5; ++t) sum += 2 * o.lr * AdamWUpdateBound(o, t);
  const double bound = AdamWDivergenceBound(o, 5, 3.0);
  EXPECT_GE(bound, sum);
  EXPECT_LE(bound, sum * (1 + 1e-5) + 1e-5);
}

}  // namespace
}  // namespace refmodel
}  // namespace flatparam
