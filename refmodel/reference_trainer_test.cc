#include "refmodel/reference_trainer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include "flatparam/base/status_matchers.h"
#include "flatparam/flatten.h"
#include "refmodel/mlp_model.h"
#include "refmodel/optimizer.h"
#include "refmodel/tensor_diff.h"

namespace flatparam {
namespace refmodel {
namespace {

using ::testing::HasSubstr;

using TensorMap = std::map<std::string, HostTensor>;

ReferenceModel MakeModel(const Config& config) {
  auto model = ReferenceModel::Create(config);
  EXPECT_TRUE(model.ok()) << model.status();
  return *std::move(model);
}

TEST(GradientReductionTest, FsdpFactorsMatchPyTorch) {
  struct Case {
    int world;
    double pre, post;
  };
  for (const Case& c : {Case{1, 1, 1}, Case{2, 2, 1}, Case{3, 2, 1.5},
                        Case{4, 2, 2}, Case{6, 4, 1.5}, Case{8, 4, 2},
                        Case{16, 4, 4}, Case{32, 8, 4}, Case{64, 8, 8}}) {
    const GradientReduction r = GradientReduction::Fsdp(c.world);
    EXPECT_EQ(r.world_size, c.world);
    EXPECT_EQ(r.pre_divide_factor, c.pre) << c.world;
    EXPECT_EQ(r.post_divide_factor, c.post) << c.world;
  }
}

// The fold, written out: per element ((g0/pre + g1/pre) + g2/pre) / post.
TEST(ComputeStepGradientsTest, FoldsRanksExactlyAsTheCollective) {
  const ReferenceModel model = MakeModel(Config{});
  const TensorMap params = model.InitParams();
  TrainOptions o;
  o.global_batch = 9;
  o.reduction = {3, 2.0, 1.5};
  o.data_seed = 4;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(StepGradients got,
                                 ComputeStepGradients(model, params, o, 7));

  std::vector<TensorMap> local(3);
  std::vector<float> losses;
  for (int r = 0; r < 3; ++r) {
    MapParamAccess access(&params, &local[r]);
    FLATPARAM_ASSERT_OK_AND_ASSIGN(
        float loss,
        model.ForwardBackward(MakeBatch(4, 17, 7, 0, r * 3, 3), access));
    losses.push_back(loss);
  }
  for (const auto& [name, g] : got.grads) {
    SCOPED_TRACE(name);
    ASSERT_EQ(g.shape(), params.at(name).shape());
    for (int64_t i = 0; i < g.numel(); ++i) {
      float acc = local[0].at(name).data_as<float>()[i] / 2.0f;
      acc = acc + local[1].at(name).data_as<float>()[i] / 2.0f;
      acc = acc + local[2].at(name).data_as<float>()[i] / 2.0f;
      acc = acc / 1.5f;
      ASSERT_EQ(g.data_as<float>()[i], acc) << i;
    }
  }
  EXPECT_EQ(got.loss, ((losses[0] + losses[1]) + losses[2]) / 3.0f);
}

// Two micro-batches on two ranks, both accumulation modes, written out.
TEST(ComputeStepGradientsTest, AccumulatesMicroBatchesAsDocumented) {
  Config config;
  config.dims = {5, 7};
  config.vocab = 11;
  const ReferenceModel model = MakeModel(config);
  const TensorMap params = model.InitParams();
  TrainOptions o;
  o.global_batch = 4;
  o.micro_batches = 2;
  o.reduction = GradientReduction::Fsdp(2);  // pre 2, post 1

  // local[m][r]: each micro-batch's gradient alone.
  TensorMap local[2][2];
  // no_sync[r]: both micro-batches accumulated into one buffer.
  TensorMap no_sync[2];
  float loss[2][2];
  for (int r = 0; r < 2; ++r) {
    MapParamAccess accumulate(&params, &no_sync[r]);
    for (int m = 0; m < 2; ++m) {
      const Batch b = MakeBatch(0, 11, 3, m, r * 2, 2);
      MapParamAccess alone(&params, &local[m][r]);
      FLATPARAM_ASSERT_OK_AND_ASSIGN(loss[m][r],
                                     model.ForwardBackward(b, alone));
      FLATPARAM_ASSERT_OK(model.ForwardBackward(b, accumulate).status());
    }
  }
  const float want_loss =
      ((loss[0][0] + loss[0][1]) / 2.0f + (loss[1][0] + loss[1][1]) / 2.0f) /
      2.0f;

  o.accumulation = AccumulationMode::kShardedAccumulation;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(StepGradients sharded,
                                 ComputeStepGradients(model, params, o, 3));
  o.accumulation = AccumulationMode::kNoSync;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(StepGradients nosync,
                                 ComputeStepGradients(model, params, o, 3));
  EXPECT_EQ(sharded.loss, want_loss);
  EXPECT_EQ(nosync.loss, want_loss);
  int64_t differing = 0;
  for (const auto& [name, p] : params) {
    SCOPED_TRACE(name);
    for (int64_t i = 0; i < p.numel(); ++i) {
      auto at = [&](const TensorMap& t) {
        return t.at(name).data_as<float>()[i];
      };
      const float red0 = at(local[0][0]) / 2.0f + at(local[0][1]) / 2.0f;
      const float red1 = at(local[1][0]) / 2.0f + at(local[1][1]) / 2.0f;
      ASSERT_EQ(at(sharded.grads), red0 + red1) << i;
      ASSERT_EQ(at(nosync.grads), at(no_sync[0]) / 2.0f + at(no_sync[1]) / 2.0f)
          << i;
      differing += at(sharded.grads) != at(nosync.grads);
    }
  }
  // The two modes are different arithmetic (and close).
  EXPECT_GT(differing, 0);
  EXPECT_LT(MaxAbsDiff(sharded.grads, nosync.grads), 1e-6);
}

TEST(ComputeStepGradientsTest, ModesCoincideWithOneMicroBatch) {
  const ReferenceModel model = MakeModel(Config{});
  const TensorMap params = model.InitParams();
  TrainOptions o;
  o.global_batch = 12;
  o.reduction = GradientReduction::Fsdp(4);
  FLATPARAM_ASSERT_OK_AND_ASSIGN(StepGradients a,
                                 ComputeStepGradients(model, params, o, 0));
  o.accumulation = AccumulationMode::kNoSync;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(StepGradients b,
                                 ComputeStepGradients(model, params, o, 0));
  EXPECT_EQ(a.grads, b.grads);
  EXPECT_EQ(a.loss, b.loss);
}

// Hybrid's two-level fold, written out: ((g0/2 + g1/2) + (g2/2 + g3/2)) / 2
// on 2 nodes of 2 ranks, against the one-level fold over 4.
TEST(ComputeStepGradientsTest, HybridFoldsEachNodeThenAcrossNodes) {
  const ReferenceModel model = MakeModel(Config{});
  const TensorMap params = model.InitParams();
  TrainOptions o;
  o.global_batch = 4;
  o.reduction = GradientReduction::Hybrid(4, 2);
  EXPECT_EQ(o.reduction.pre_divide_factor, 2.0);
  EXPECT_EQ(o.reduction.post_divide_factor, 2.0);
  FLATPARAM_ASSERT_OK_AND_ASSIGN(StepGradients hybrid,
                                 ComputeStepGradients(model, params, o, 1));
  o.reduction = GradientReduction::Fsdp(4);
  FLATPARAM_ASSERT_OK_AND_ASSIGN(StepGradients flat,
                                 ComputeStepGradients(model, params, o, 1));
  std::vector<TensorMap> local(4);
  for (int r = 0; r < 4; ++r) {
    MapParamAccess access(&params, &local[r]);
    FLATPARAM_ASSERT_OK(
        model.ForwardBackward(MakeBatch(0, 17, 1, 0, r, 1), access).status());
  }
  int64_t differing = 0;
  for (const auto& [name, g] : hybrid.grads) {
    SCOPED_TRACE(name);
    for (int64_t i = 0; i < g.numel(); ++i) {
      auto x = [&](int r) { return local[r].at(name).data_as<float>()[i]; };
      const float node0 = x(0) / 2.0f + x(1) / 2.0f;
      const float node1 = x(2) / 2.0f + x(3) / 2.0f;
      ASSERT_EQ(g.data_as<float>()[i], (node0 + node1) / 2.0f) << i;
      const float left =
          ((x(0) / 2.0f + x(1) / 2.0f) + x(2) / 2.0f) + x(3) / 2.0f;
      ASSERT_EQ(flat.grads.at(name).data_as<float>()[i], left / 2.0f) << i;
      differing += g.data_as<float>()[i] != left / 2.0f;
    }
  }
  EXPECT_GT(differing, 0);
  EXPECT_EQ(hybrid.loss, flat.loss);
  // One node, or nodes of one rank, are the one-level fold.
  for (int group : {1, 4}) {
    o.reduction = GradientReduction::Hybrid(4, group);
    FLATPARAM_ASSERT_OK_AND_ASSIGN(StepGradients same,
                                   ComputeStepGradients(model, params, o, 1));
    EXPECT_EQ(same.grads, flat.grads) << group;
  }
}

// Mixed precision, written out for bf16 on two ranks with two no_sync
// micro-batches: parameters rounded for the model, gradients rounded and
// accumulated in bf16, folded in bf16, widened to float32.
TEST(ComputeStepGradientsTest, EmulatesMixedPrecision) {
  Config config;
  config.dims = {6, 5};
  config.vocab = 9;
  const ReferenceModel model = MakeModel(config);
  const TensorMap params = model.InitParams();
  TrainOptions o;
  o.global_batch = 2;
  o.micro_batches = 2;
  o.accumulation = AccumulationMode::kNoSync;
  o.reduction = GradientReduction::Fsdp(2);  // pre 2, post 1
  o.param_dtype = DType::kBFloat16;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(StepGradients got,
                                 ComputeStepGradients(model, params, o, 0));

  auto bf16 = [](float v) {
    HostTensor t = HostTensor::Flat(DType::kBFloat16, 1);
    t.SetDouble(0, v);
    return static_cast<float>(t.GetDouble(0));
  };
  TensorMap rounded = params;
  for (auto& [name, p] : rounded) {
    for (int64_t i = 0; i < p.numel(); ++i) {
      p.data_as<float>()[i] = bf16(p.data_as<float>()[i]);
    }
  }
  TensorMap local[2][2];  // [rank][micro-batch], float32
  float loss[2][2];
  for (int r = 0; r < 2; ++r) {
    for (int m = 0; m < 2; ++m) {
      MapParamAccess access(&rounded, &local[r][m]);
      FLATPARAM_ASSERT_OK_AND_ASSIGN(
          loss[r][m],
          model.ForwardBackward(MakeBatch(0, 9, 0, m, r, 1), access));
    }
  }
  int64_t inexact = 0;
  for (const auto& [name, g] : got.grads) {
    SCOPED_TRACE(name);
    for (int64_t i = 0; i < g.numel(); ++i) {
      auto acc = [&](int r) {
        const float a = bf16(local[r][0].at(name).data_as<float>()[i]);
        return bf16(a + bf16(local[r][1].at(name).data_as<float>()[i]));
      };
      const float want = bf16(bf16(acc(0) / 2.0f) + bf16(acc(1) / 2.0f));
      ASSERT_EQ(g.data_as<float>()[i], want) << i;
      const float exact = (local[0][0].at(name).data_as<float>()[i] +
                           local[0][1].at(name).data_as<float>()[i] +
                           local[1][0].at(name).data_as<float>()[i] +
                           local[1][1].at(name).data_as<float>()[i]) /
                          2.0f;
      inexact += want != exact;
    }
  }
  EXPECT_GT(inexact, 0);
  EXPECT_EQ(got.loss, ((loss[0][0] + loss[1][0]) / 2.0f +
                       (loss[0][1] + loss[1][1]) / 2.0f) /
                          2.0f);
  // reduce_dtype float32: the same local bf16 gradients, a float32 fold.
  o.reduce_dtype = DType::kFloat32;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(StepGradients wide,
                                 ComputeStepGradients(model, params, o, 0));
  for (const auto& [name, g] : wide.grads) {
    for (int64_t i = 0; i < g.numel(); ++i) {
      auto acc = [&](int r) {
        const float a = bf16(local[r][0].at(name).data_as<float>()[i]);
        return bf16(a + bf16(local[r][1].at(name).data_as<float>()[i]));
      };
      ASSERT_EQ(g.data_as<float>()[i], acc(0) / 2.0f + acc(1) / 2.0f)
          << name << " " << i;
    }
  }
}

TrainOptions AdamWOptionsFor(int world) {
  TrainOptions o;
  o.steps = 5;
  o.global_batch = 8;
  o.micro_batches = 2;
  o.reduction = GradientReduction::Fsdp(world);
  AdamWOptions adamw;
  adamw.lr = 0.01;
  o.optimizer = adamw;
  o.data_seed = 9;
  return o;
}

TEST(TrainReferenceTest, WorldSizesAgreeClosely) {
  Config config;
  config.seed = 3;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(TrainResult one,
                                 TrainReference(config, AdamWOptionsFor(1)));
  FLATPARAM_ASSERT_OK_AND_ASSIGN(TrainResult two,
                                 TrainReference(config, AdamWOptionsFor(2)));
  FLATPARAM_ASSERT_OK_AND_ASSIGN(TrainResult four,
                                 TrainReference(config, AdamWOptionsFor(4)));
  ASSERT_EQ(one.losses.size(), 5u);
  for (size_t k = 0; k < one.losses.size(); ++k) {
    EXPECT_NEAR(one.losses[k], two.losses[k], 1e-5);
    EXPECT_NEAR(one.losses[k], four.losses[k], 1e-5);
  }
  // AdamW normalises updates, so tiny gradient differences can move a
  // parameter by a fraction of lr where the gradient is near zero.
  EXPECT_LT(MaxAbsDiff(one.params, two.params), 1e-3);
  EXPECT_LT(MaxAbsDiff(one.params, four.params), 1e-3);
  // ... but they are not the same computation.
  EXPECT_NE(one.params, two.params);

  TrainOptions sgd = AdamWOptionsFor(1);
  sgd.optimizer = SgdOptions{0.5, 0.9};
  FLATPARAM_ASSERT_OK_AND_ASSIGN(TrainResult sgd_one,
                                 TrainReference(config, sgd));
  sgd.reduction = GradientReduction::Fsdp(2);
  FLATPARAM_ASSERT_OK_AND_ASSIGN(TrainResult sgd_two,
                                 TrainReference(config, sgd));
  EXPECT_LT(MaxAbsDiff(sgd_one.params, sgd_two.params), 1e-5);
}

TEST(TrainReferenceTest, IsBitwiseDeterministic) {
  const TrainOptions o = AdamWOptionsFor(2);
  FLATPARAM_ASSERT_OK_AND_ASSIGN(TrainResult a, TrainReference(Config{}, o));
  FLATPARAM_ASSERT_OK_AND_ASSIGN(TrainResult b, TrainReference(Config{}, o));
  EXPECT_EQ(a.params, b.params);
  EXPECT_EQ(a.optimizer_state, b.optimizer_state);
  EXPECT_EQ(a.losses, b.losses);
}

TEST(TrainReferenceTest, SgdReducesTheLoss) {
  Config tiny;
  tiny.vocab = 7;
  tiny.dims = {5, 6};
  TrainOptions o;
  o.steps = 30;
  o.global_batch = 16;
  o.reduction = GradientReduction::Fsdp(2);
  o.optimizer = SgdOptions{0.5, 0.9};
  FLATPARAM_ASSERT_OK_AND_ASSIGN(TrainResult r, TrainReference(tiny, o));
  ASSERT_EQ(r.losses.size(), 30u);
  const float first = r.losses.front();
  const float last = r.losses.back();
  EXPECT_LT(last, 0.5f * first) << "first " << first << " last " << last;
}

TEST(TrainReferenceTest, ResumingFromAStepMatchesAnUnbrokenRun) {
  TrainOptions o = AdamWOptionsFor(2);
  o.steps = 4;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(TrainResult whole,
                                 TrainReference(Config{}, o));
  o.steps = 2;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(TrainResult first,
                                 TrainReference(Config{}, o));
  o.first_step = 2;
  o.initial_params = first.params;
  o.initial_optimizer_state = first.optimizer_state;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(TrainResult second,
                                 TrainReference(Config{}, o));
  EXPECT_EQ(second.params, whole.params);
  EXPECT_EQ(second.optimizer_state, whole.optimizer_state);
  EXPECT_EQ(second.losses[1], whole.losses[3]);
}

TEST(TrainReferenceTest, StateIsShapedLikeThePyTorchStateDict) {
  FLATPARAM_ASSERT_OK_AND_ASSIGN(TrainResult r,
                                 TrainReference(Config{}, AdamWOptionsFor(1)));
  ASSERT_EQ(r.optimizer_state.size(), r.params.size());
  EXPECT_EQ(r.optimizer_state.count("head.weight"), 0u);
  for (const auto& [name, state] : r.optimizer_state) {
    SCOPED_TRACE(name);
    const HostTensor& step = state.tensors.at("step");
    EXPECT_TRUE(step.shape().empty());
    EXPECT_EQ(step.data_as<float>()[0], 5.0f);
    EXPECT_EQ(state.tensors.at("exp_avg").shape(), r.params.at(name).shape());
    EXPECT_EQ(state.tensors.at("exp_avg_sq").shape(),
              r.params.at(name).shape());
  }
}

TEST(TrainReferenceTest, RejectsBadOptions) {
  TrainOptions o;
  o.global_batch = 6;
  o.reduction.world_size = 4;
  EXPECT_THAT(TrainReference(Config{}, o),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("global_batch 6 must be >= 1 and a multiple "
                                 "of world_size 4")));
  o = TrainOptions{};
  o.reduction.pre_divide_factor = 0;
  EXPECT_THAT(TrainReference(Config{}, o),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("pre 0")));
  o = TrainOptions{};
  o.micro_batches = 0;
  EXPECT_THAT(TrainReference(Config{}, o),
              StatusIs(absl::StatusCode::kInvalidArgument));
  o = TrainOptions{};
  o.optimizer = SgdOptions{-1.0};
  EXPECT_THAT(TrainReference(Config{}, o),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("Invalid learning rate")));
  o = TrainOptions{};
  o.initial_optimizer_state["head.weight"] = {};
  EXPECT_THAT(TrainReference(Config{}, o),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("\"head.weight\"")));
  o = TrainOptions{};
  o.initial_optimizer_state["head.bias"].tensors.emplace(
      "exp_avg", HostTensor(DType::kFloat32, {17}));
  EXPECT_THAT(TrainReference(Config{}, o),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("optimizer step 0 of \"head.bias\"")));
  o = TrainOptions{};
  o.reduction.world_size = 4;
  o.reduction.shard_group_size = 3;
  EXPECT_THAT(TrainReference(Config{}, o),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("shard_group_size 3 must be 0 or divide "
                                 "world_size 4")));
  o = TrainOptions{};
  o.param_dtype = DType::kInt32;
  EXPECT_THAT(TrainReference(Config{}, o),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("param_dtype int32")));
  Config bad;
  bad.dims = {};
  EXPECT_THAT(TrainReference(bad, TrainOptions{}),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

}  // namespace
}  // namespace refmodel
}  // namespace flatparam
