#include "refmodel/mlp_model.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "flatparam/base/dtype.h"
#include "flatparam/base/status_matchers.h"
#include "flatparam/flatten.h"
#include "flatparam/model_layout.h"

namespace flatparam {
namespace refmodel {
namespace {

using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;

using TensorMap = std::map<std::string, HostTensor>;

ReferenceModel MakeModel(Config config) {
  auto model = ReferenceModel::Create(std::move(config));
  EXPECT_TRUE(model.ok()) << model.status();
  return *std::move(model);
}

TensorMap ToDouble(const TensorMap& params) {
  TensorMap out;
  for (const auto& [name, t] : params) {
    HostTensor d(DType::kFloat64, t.shape());
    for (int64_t i = 0; i < t.numel(); ++i) d.SetDouble(i, t.GetDouble(i));
    out.emplace(name, std::move(d));
  }
  return out;
}

bool BitwiseEqual(const TensorMap& a, const TensorMap& b) { return a == b; }

template <typename T>
T Loss(const ReferenceModel& model, const Batch& batch,
       const TensorMap& params) {
  TensorMap grads;
  BasicMapParamAccess<T> access(&params, &grads);
  auto loss = model.ForwardBackward(batch, access);
  EXPECT_TRUE(loss.ok()) << loss.status();
  return *loss;
}

TEST(ReferenceModelTest, SpecListsParametersInTraversalOrder) {
  FLATPARAM_ASSERT_OK_AND_ASSIGN(ModelSpec spec, Spec(Config{}));
  std::vector<std::string> names;
  for (const ParamSpec& p : spec.params) names.push_back(p.fqn);
  EXPECT_THAT(names,
              ElementsAre("embed.weight", "layers.0.fc.weight",
                          "layers.0.fc.bias", "layers.1.fc.weight",
                          "layers.1.fc.bias", "layers.2.fc.weight",
                          "layers.2.fc.bias", "head.weight", "head.bias"));
  EXPECT_EQ(spec.params[0].shape, (std::vector<int64_t>{17, 13}));
  EXPECT_EQ(spec.params[1].shape, (std::vector<int64_t>{37, 13}));
  EXPECT_EQ(spec.params[3].shape, (std::vector<int64_t>{29, 37}));
  EXPECT_EQ(spec.params[5].shape, (std::vector<int64_t>{13, 29}));
  EXPECT_EQ(spec.params[6].shape, (std::vector<int64_t>{13}));
  EXPECT_EQ(spec.params[7].tied_to, "embed.weight");
  EXPECT_EQ(spec.params[8].shape, (std::vector<int64_t>{17}));
  EXPECT_THAT(spec.wrap, ElementsAre("layers.0", "layers.1", "layers.2"));

  // It wraps into a root unit (embedding and head) plus one unit per layer.
  LayoutOptions options;
  options.world_size = 3;
  options.align_addresses = true;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(ModelLayout layout,
                                 ModelLayout::Create(spec, options));
  ASSERT_EQ(layout.flat_params().size(), 4u);
  const FlatParamLayout& root = layout.flat_params()[0];
  EXPECT_EQ(root.unit(), "");
  ASSERT_EQ(root.params().size(), 2u);
  EXPECT_EQ(root.params()[0].fqn, "embed.weight");
  EXPECT_EQ(root.params()[1].fqn, "head.bias");
  ASSERT_EQ(root.shared_params().size(), 1u);
  EXPECT_EQ(root.shared_params()[0].fqn, "head.weight");
  EXPECT_EQ(layout.flat_params()[2].unit(), "layers.1");
}

TEST(ReferenceModelTest, RejectsBadConfigs) {
  Config c;
  c.vocab = 0;
  EXPECT_THAT(ReferenceModel::Create(c),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("vocab must be >= 1, got 0")));
  c = Config{};
  c.dims = {};
  EXPECT_THAT(ReferenceModel::Create(c),
              StatusIs(absl::StatusCode::kInvalidArgument));
  c.dims = {4, 0};
  EXPECT_THAT(ReferenceModel::Create(c),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("dims[1] must be >= 1, got 0")));
}

TEST(ReferenceModelTest, InitParamsIsDeterministicAndSeeded) {
  Config c;
  c.seed = 7;
  const ReferenceModel model = MakeModel(c);
  const TensorMap a = model.InitParams();
  EXPECT_THAT(model.CheckParams(a), IsOk());
  EXPECT_TRUE(BitwiseEqual(a, MakeModel(c).InitParams()));
  c.seed = 8;
  const TensorMap b = MakeModel(c).InitParams();
  for (const auto& [name, t] : a) {
    EXPECT_NE(t, b.at(name)) << name;
  }
  // Bounds: 1 for the embedding, 1/sqrt(fan_in) for the rest.
  for (const auto& [name, t] : a) {
    double bound = 1.0;
    for (int i = 0; i < 3; ++i) {
      if (name == LayerWeightName(i) || name == LayerBiasName(i)) {
        bound = 1.0 / std::sqrt(static_cast<double>(c.dims[i]));
      }
    }
    if (name == "head.bias") bound = 1.0 / std::sqrt(13.0);
    double max_abs = 0;
    for (int64_t i = 0; i < t.numel(); ++i) {
      max_abs = std::max(max_abs, std::abs(t.GetDouble(i)));
    }
    EXPECT_LE(max_abs, bound) << name;
    EXPECT_GT(max_abs, 0.5 * bound) << name;
  }
}

TEST(ReferenceModelTest, CheckParamsNamesTheProblem) {
  const ReferenceModel model = MakeModel(Config{});
  TensorMap params = model.InitParams();
  params.erase("layers.1.fc.bias");
  EXPECT_THAT(model.CheckParams(params),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("\"layers.1.fc.bias\" is missing")));
  params = model.InitParams();
  params["head.bias"] = HostTensor(DType::kFloat32, {16});
  EXPECT_THAT(model.CheckParams(params),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("shape [16]; expected float32 and [17]")));
  params = model.InitParams();
  params["head.weight"] = HostTensor(DType::kFloat32, {17, 13});
  EXPECT_THAT(model.CheckParams(params),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("\"head.weight\" is not a parameter")));
}

TEST(MakeBatchTest, GlobalBatchIsTheConcatenationOfLocalBatches) {
  const Batch global = MakeBatch(3, 17, 5, 1, 0, 12);
  Batch joined;
  for (int r = 0; r < 4; ++r) {
    const Batch local = MakeBatch(3, 17, 5, 1, r * 3, 3);
    joined.tokens.insert(joined.tokens.end(), local.tokens.begin(),
                         local.tokens.end());
    joined.targets.insert(joined.targets.end(), local.targets.begin(),
                          local.targets.end());
  }
  EXPECT_EQ(joined.tokens, global.tokens);
  EXPECT_EQ(joined.targets, global.targets);
  std::set<int32_t> distinct(global.tokens.begin(), global.tokens.end());
  EXPECT_GT(distinct.size(), 4u);
  for (int64_t n = 0; n < global.size(); ++n) {
    EXPECT_GE(global.tokens[n], 0);
    EXPECT_LT(global.tokens[n], 17);
    EXPECT_EQ(global.targets[n], (5 * global.tokens[n] + 3) % 17);
  }
  // Steps, micro-batches and seeds draw different samples.
  EXPECT_NE(MakeBatch(3, 17, 6, 1, 0, 12).tokens, global.tokens);
  EXPECT_NE(MakeBatch(3, 17, 5, 2, 0, 12).tokens, global.tokens);
  EXPECT_NE(MakeBatch(4, 17, 5, 1, 0, 12).tokens, global.tokens);
}

TEST(ReferenceModelTest, CheckBatchNamesTheSample) {
  const ReferenceModel model = MakeModel(Config{});
  EXPECT_THAT(model.CheckBatch({}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("empty")));
  EXPECT_THAT(model.CheckBatch({{1, 2}, {3}}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("2 tokens but 1 targets")));
  EXPECT_THAT(model.CheckBatch({{1, 2}, {3, 17}}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("sample 1 has token 2 and target 17")));
}

// Central differences of the double-precision twin against its hand-written
// backward, for every parameter element.
void ExpectGradientMatchesFiniteDifferences(const Config& config,
                                            int64_t batch_size) {
  const ReferenceModel model = MakeModel(config);
  TensorMap params = ToDouble(model.InitParams());
  const Batch batch = MakeBatch(11, config.vocab, 0, 0, 0, batch_size);
  TensorMap grads;
  BasicMapParamAccess<double> access(&params, &grads);
  FLATPARAM_ASSERT_OK(model.ForwardBackward(batch, access).status());
  constexpr double kEps = 1e-6;
  int64_t checked = 0;
  double max_grad = 0;
  for (auto& [name, p] : params) {
    const HostTensor& g = grads.at(name);
    double* data = p.data_as<double>();
    for (int64_t i = 0; i < p.numel(); ++i) {
      const double saved = data[i];
      data[i] = saved + kEps;
      const double plus = Loss<double>(model, batch, params);
      data[i] = saved - kEps;
      const double minus = Loss<double>(model, batch, params);
      data[i] = saved;
      const double numeric = (plus - minus) / (2 * kEps);
      const double analytic = g.data_as<double>()[i];
      ASSERT_NEAR(analytic, numeric, 1e-7 + 1e-6 * std::abs(numeric))
          << name << "[" << i << "]";
      max_grad = std::max(max_grad, std::abs(analytic));
      ++checked;
    }
  }
  EXPECT_EQ(checked, [&] {
    int64_t n = 0;
    for (const auto& [name, p] : params) n += p.numel();
    return n;
  }());
  EXPECT_GT(max_grad, 1e-3);
}

TEST(ReferenceModelTest, GradientMatchesFiniteDifferences) {
  ExpectGradientMatchesFiniteDifferences(Config{}, 6);
}

TEST(ReferenceModelTest, GradientMatchesFiniteDifferencesOneLayer) {
  Config c;
  c.vocab = 5;
  c.dims = {3};
  c.seed = 2;
  ExpectGradientMatchesFiniteDifferences(c, 9);
}

// Serves two different embedding matrices to the two uses of the tied
// parameter, telling them apart by the documented call sequence: the lookup
// happens before the first layer's forward; the head (forward and backward)
// after the last layer's forward.
class UntyingAccess final : public BasicParamAccess<double> {
 public:
  UntyingAccess(const TensorMap* params, const HostTensor* embed_in,
                const HostTensor* embed_out, TensorMap* grads)
      : inner_(params, grads), embed_in_(embed_in), embed_out_(embed_out) {}

  absl::StatusOr<const double*> Param(absl::string_view fqn) override {
    if (fqn == kEmbedWeight) {
      return (layers_begun_ == 0 ? embed_in_ : embed_out_)->data_as<double>();
    }
    return inner_.Param(fqn);
  }
  absl::StatusOr<double*> Grad(absl::string_view fqn) override {
    return inner_.Grad(fqn);
  }
  absl::Status BeginUnit(absl::string_view unit, Phase phase) override {
    if (!unit.empty()) ++layers_begun_;
    return absl::OkStatus();
  }
  absl::Status EndUnit(absl::string_view unit, Phase phase) override {
    return absl::OkStatus();
  }

 private:
  BasicMapParamAccess<double> inner_;
  const HostTensor* embed_in_;
  const HostTensor* embed_out_;
  int layers_begun_ = 0;
};

TEST(ReferenceModelTest, TiedEmbeddingGradientIsTheSumOfBothUses) {
  Config c;
  c.vocab = 6;
  c.dims = {4, 5};
  const ReferenceModel model = MakeModel(c);
  TensorMap params = ToDouble(model.InitParams());
  const Batch batch = MakeBatch(1, c.vocab, 0, 0, 0, 10);
  TensorMap grads;
  BasicMapParamAccess<double> access(&params, &grads);
  FLATPARAM_ASSERT_OK(model.ForwardBackward(batch, access).status());
  const HostTensor& tied_grad = grads.at("embed.weight");

  HostTensor embed_in = params.at("embed.weight");
  HostTensor embed_out = params.at("embed.weight");
  auto untied_loss = [&] {
    TensorMap unused;
    UntyingAccess untying(&params, &embed_in, &embed_out, &unused);
    auto loss = model.ForwardBackward(batch, untying);
    EXPECT_TRUE(loss.ok()) << loss.status();
    return *loss;
  };
  EXPECT_EQ(untied_loss(), Loss<double>(model, batch, params));
  constexpr double kEps = 1e-6;
  double max_in = 0, max_out = 0;
  for (int64_t i = 0; i < tied_grad.numel(); ++i) {
    double partial[2];
    for (HostTensor* e : {&embed_in, &embed_out}) {
      double* d = e->data_as<double>();
      const double saved = d[i];
      d[i] = saved + kEps;
      const double plus = untied_loss();
      d[i] = saved - kEps;
      const double minus = untied_loss();
      d[i] = saved;
      partial[e == &embed_in ? 0 : 1] = (plus - minus) / (2 * kEps);
    }
    max_in = std::max(max_in, std::abs(partial[0]));
    max_out = std::max(max_out, std::abs(partial[1]));
    EXPECT_NEAR(tied_grad.data_as<double>()[i], partial[0] + partial[1], 1e-7)
        << "embed.weight[" << i << "]";
  }
  // Both uses contribute.
  EXPECT_GT(max_in, 1e-3);
  EXPECT_GT(max_out, 1e-3);
}

TEST(ReferenceModelTest, FloatModelAgreesWithDoubleTwin) {
  const ReferenceModel model = MakeModel(Config{});
  const TensorMap params = model.InitParams();
  const TensorMap params64 = ToDouble(params);
  const Batch batch = MakeBatch(5, 17, 0, 0, 0, 16);
  TensorMap grads, grads64;
  MapParamAccess access(&params, &grads);
  BasicMapParamAccess<double> access64(&params64, &grads64);
  FLATPARAM_ASSERT_OK_AND_ASSIGN(float loss,
                                 model.ForwardBackward(batch, access));
  FLATPARAM_ASSERT_OK_AND_ASSIGN(double loss64,
                                 model.ForwardBackward(batch, access64));
  EXPECT_NEAR(loss, loss64, 1e-5);
  EXPECT_GT(loss, 1.0);
  for (const auto& [name, g] : grads) {
    const HostTensor& g64 = grads64.at(name);
    for (int64_t i = 0; i < g.numel(); ++i) {
      ASSERT_NEAR(g.GetDouble(i), g64.GetDouble(i), 1e-6) << name << i;
    }
  }
}

TEST(ReferenceModelTest, IsBitwiseDeterministic) {
  const ReferenceModel model = MakeModel(Config{});
  const TensorMap params = model.InitParams();
  const Batch batch = MakeBatch(5, 17, 0, 0, 0, 8);
  TensorMap g1, g2;
  MapParamAccess a1(&params, &g1), a2(&params, &g2);
  FLATPARAM_ASSERT_OK_AND_ASSIGN(float l1, model.ForwardBackward(batch, a1));
  FLATPARAM_ASSERT_OK_AND_ASSIGN(float l2, model.ForwardBackward(batch, a2));
  EXPECT_EQ(std::memcmp(&l1, &l2, sizeof(float)), 0);
  EXPECT_TRUE(BitwiseEqual(g1, g2));
}

TEST(ReferenceModelTest, AccumulatesWholeBatchGradients) {
  const ReferenceModel model = MakeModel(Config{});
  const TensorMap params = model.InitParams();
  const Batch b1 = MakeBatch(5, 17, 0, 0, 0, 4);
  const Batch b2 = MakeBatch(5, 17, 0, 1, 0, 4);
  TensorMap g1, g2, acc;
  MapParamAccess a1(&params, &g1), a2(&params, &g2), a_acc(&params, &acc);
  FLATPARAM_ASSERT_OK(model.ForwardBackward(b1, a1).status());
  FLATPARAM_ASSERT_OK(model.ForwardBackward(b2, a2).status());
  FLATPARAM_ASSERT_OK(model.ForwardBackward(b1, a_acc).status());
  FLATPARAM_ASSERT_OK(model.ForwardBackward(b2, a_acc).status());
  for (auto& [name, g] : g1) {
    float* x = g.data_as<float>();
    const float* y = g2.at(name).data_as<float>();
    for (int64_t i = 0; i < g.numel(); ++i) x[i] = x[i] + y[i];
  }
  EXPECT_TRUE(BitwiseEqual(g1, acc));
}

// Records the calls and enforces the ParamAccess contract: parameters only
// while their owning unit is open, gradients only in the backward phase.
class RecordingAccess final : public ParamAccess {
 public:
  RecordingAccess(const ModelSpec& spec, const TensorMap* params,
                  TensorMap* grads)
      : spec_(spec), inner_(params, grads) {}

  absl::StatusOr<const float*> Param(absl::string_view fqn) override {
    FLATPARAM_RETURN_IF_ERROR(CheckOpen(fqn, false));
    events_.push_back(absl::StrCat("Param ", fqn));
    return inner_.Param(fqn);
  }
  absl::StatusOr<float*> Grad(absl::string_view fqn) override {
    FLATPARAM_RETURN_IF_ERROR(CheckOpen(fqn, true));
    events_.push_back(absl::StrCat("Grad ", fqn));
    return inner_.Grad(fqn);
  }
  absl::Status BeginUnit(absl::string_view unit, Phase phase) override {
    events_.push_back(absl::StrCat("Begin '", unit, "' ", PhaseName(phase)));
    if (!open_.emplace(std::string(unit), phase).second) {
      return absl::InternalError(absl::StrCat("unit '", unit, "' begun twice"));
    }
    return absl::OkStatus();
  }
  absl::Status EndUnit(absl::string_view unit, Phase phase) override {
    events_.push_back(absl::StrCat("End '", unit, "' ", PhaseName(phase)));
    auto it = open_.find(std::string(unit));
    if (it == open_.end() || it->second != phase) {
      return absl::InternalError(absl::StrCat("unit '", unit, "' not open"));
    }
    open_.erase(it);
    return absl::OkStatus();
  }

  const std::vector<std::string>& events() const { return events_; }
  bool all_closed() const { return open_.empty(); }

 private:
  absl::Status CheckOpen(absl::string_view fqn, bool grad) {
    const std::string unit = OwningUnit(std::string(fqn), spec_.wrap);
    auto it = open_.find(unit);
    if (it == open_.end()) {
      return absl::InternalError(
          absl::StrCat(fqn, " used while unit '", unit, "' is not open"));
    }
    if (grad && it->second != Phase::kBackward) {
      return absl::InternalError(absl::StrCat("Grad ", fqn, " in forward"));
    }
    return absl::OkStatus();
  }

  const ModelSpec& spec_;
  MapParamAccess inner_;
  std::map<std::string, Phase> open_;
  std::vector<std::string> events_;
};

TEST(ReferenceModelTest, FollowsTheDocumentedCallSequence) {
  Config c;
  c.dims = {3, 4};
  c.vocab = 5;
  const ReferenceModel model = MakeModel(c);
  const TensorMap params = model.InitParams();
  TensorMap grads;
  RecordingAccess access(model.spec(), &params, &grads);
  FLATPARAM_ASSERT_OK(
      model.ForwardBackward(MakeBatch(0, 5, 0, 0, 0, 3), access).status());
  EXPECT_TRUE(access.all_closed());
  EXPECT_THAT(access.events(), ElementsAreArray({
                                   "Begin '' forward",
                                   "Param embed.weight",
                                   "Begin 'layers.0' forward",
                                   "Param layers.0.fc.weight",
                                   "Param layers.0.fc.bias",
                                   "End 'layers.0' forward",
                                   "Begin 'layers.1' forward",
                                   "Param layers.1.fc.weight",
                                   "Param layers.1.fc.bias",
                                   "End 'layers.1' forward",
                                   "Param embed.weight",
                                   "Param head.bias",
                                   "End '' forward",
                                   "Begin '' backward",
                                   "Param embed.weight",
                                   "Grad head.bias",
                                   "Begin 'layers.1' backward",
                                   "Param layers.1.fc.weight",
                                   "Grad layers.1.fc.weight",
                                   "Grad layers.1.fc.bias",
                                   "End 'layers.1' backward",
                                   "Begin 'layers.0' backward",
                                   "Param layers.0.fc.weight",
                                   "Grad layers.0.fc.weight",
                                   "Grad layers.0.fc.bias",
                                   "End 'layers.0' backward",
                                   "Grad embed.weight",
                                   "End '' backward",
                               }));
}

// Fails BeginUnit of one unit.
class FailingAccess final : public ParamAccess {
 public:
  FailingAccess(const TensorMap* params, TensorMap* grads)
      : inner_(params, grads) {}
  absl::StatusOr<const float*> Param(absl::string_view fqn) override {
    ++calls_after_failure_;
    return inner_.Param(fqn);
  }
  absl::StatusOr<float*> Grad(absl::string_view fqn) override {
    ++calls_after_failure_;
    return inner_.Grad(fqn);
  }
  absl::Status BeginUnit(absl::string_view unit, Phase phase) override {
    if (unit == "layers.1" && phase == Phase::kBackward) {
      calls_after_failure_ = 0;
      return absl::UnavailableError("unshard of layers.1 failed");
    }
    return absl::OkStatus();
  }
  absl::Status EndUnit(absl::string_view unit, Phase phase) override {
    ++calls_after_failure_;
    return absl::OkStatus();
  }
  int calls_after_failure_ = -1;

 private:
  MapParamAccess inner_;
};

TEST(ReferenceModelTest, ReturnsAccessErrorsAtOnce) {
  Config c;
  c.dims = {3, 4, 2};
  const ReferenceModel model = MakeModel(c);
  const TensorMap params = model.InitParams();
  TensorMap grads;
  FailingAccess failing(&params, &grads);
  EXPECT_THAT(
      model.ForwardBackward(MakeBatch(0, 17, 0, 0, 0, 3), failing),
      StatusIs(absl::StatusCode::kUnavailable, HasSubstr("layers.1 failed")));
  EXPECT_EQ(failing.calls_after_failure_, 0);

  TensorMap missing = params;
  missing.erase("layers.2.fc.bias");
  MapParamAccess access(&missing, &grads);
  EXPECT_THAT(
      model.ForwardBackward(MakeBatch(0, 17, 0, 0, 0, 3), access),
      StatusIs(absl::StatusCode::kNotFound, HasSubstr("layers.2.fc.bias")));
  EXPECT_THAT(model.ForwardBackward(Batch{{1}, {40}}, access),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(MapParamAccessTest, ChecksDtypesAndGradientSizes) {
  TensorMap params;
  params.emplace("w", HostTensor(DType::kFloat64, {2, 3}));
  TensorMap grads;
  MapParamAccess access(&params, &grads);
  EXPECT_THAT(access.Param("w"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("dtype float64, expected float32")));
  params.emplace("v", HostTensor(DType::kFloat32, {2, 3}));
  FLATPARAM_ASSERT_OK_AND_ASSIGN(float* g, access.Grad("v"));
  EXPECT_EQ(g, grads.at("v").data_as<float>());
  EXPECT_EQ(grads.at("v").shape(), (std::vector<int64_t>{2, 3}));
  grads["v"] = HostTensor(DType::kFloat32, {5});
  EXPECT_THAT(access.Grad("v"), StatusIs(absl::StatusCode::kInvalidArgument,
                                         HasSubstr("5 elements")));
  EXPECT_THAT(access.Param("u"), StatusIs(absl::StatusCode::kNotFound));
}

}  // namespace
}  // namespace refmodel
}  // namespace flatparam
