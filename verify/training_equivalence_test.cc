// Sharded training equals unsharded training.
//
// Sharded training (refmodel/fsdp_trainer.h: FsdpRuntime, one
// FlatParamHandle per unit, the simulator's collectives) is compared with
// single-process training (TrainReference, refmodel/reference_trainer.h)
// on the options ReferenceOptionsFor() derives. What is proven, for random
// model shapes, world sizes 1..8, every strategy, alignment on and off, CPU
// offload on and off, 1..3 micro-batches in both accumulation modes, SGD
// and AdamW, 1..3 steps, every prefetch setting (GenTrainingCase):
//
//   * float32: every rank's per-step losses, the gathered parameters and the
//     gathered optimizer state are bitwise identical to TrainReference with
//     GradientReduction::Fsdp(W) (Hybrid(W, S) for the hybrid strategies: a
//     fold over each node of S ranks, then across nodes). With padding
//     poisoned with NaN the results are still bitwise identical, and every
//     padding element of every sharded gradient is exactly zero: padding
//     never leaks.
//   * bf16 / fp16 mixed precision: bitwise identical to TrainReference's
//     mixed-precision emulation (parameters rounded for the forward and
//     backward, gradients accumulated and reduced in low precision). Against
//     float32 training, two bounds hold:
//       - one step's reduced gradient, at parameters representable in the
//         low dtype (so both runs compute the same local gradients x_i),
//         differs per element by at most
//             (gamma_K(u_low) + gamma_K(2^-24)) * T + 2 K eta_low,
//         with T = sum_i |x_i| / (pre * post) over ranks and micro-batches,
//         K = 2M + W + 2 (the most roundings any x_i goes through: the cast
//         to the low dtype, M-1 no_sync additions, the reduce-dtype cast,
//         the pre-divide, W-1 fold additions, the post-divide, M-1 float32
//         additions), gamma_K(u) = K u / (1 - K u), u_low = 2^-8 (bf16) or
//         2^-11 (fp16), and eta_low half the dtype's smallest subnormal
//         (underflow): Higham's bound for sums whose terms each pass
//         through at most K roundings, applied to both runs;
//       - after K steps of AdamW, parameters differ by at most
//         AdamWDivergenceBound (refmodel/optimizer.h), which holds
//         for any two AdamW runs from the same start.
//   * HYBRID_SHARD on 2 x 4 ranks and FULL_SHARD on 8 ranks each equal their
//     own reference bitwise (two-level vs one-level fold). They are not
//     bitwise equal to each other: ((g0+..+g3)+(g4+..+g7)) and the left fold
//     over 8 round differently; one step's gradients differ by at most
//     2 gamma_K(2^-24) T (the same argument in float32).
//   * Peak memory: every rank's measured per-category peak equals
//     ExpectedPeakMemory's closed form, for every strategy, with mixed
//     precision, offload, micro-batches, both accumulation modes and every
//     prefetch setting.
//   * Activation recomputation (every layer's forward again inside its
//     backward, non-reentrant) is drawn in every case above: the results
//     stay bitwise the reference's and the peak the formula's.
#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include <cmath>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "flatparam/base/dtype.h"
#include "flatparam/flatten.h"
#include "flatparam/layout.h"
#include "flatparam/memory_stats.h"
#include "refmodel/fsdp_trainer.h"
#include "refmodel/mlp_model.h"
#include "refmodel/optimizer.h"
#include "refmodel/reference_trainer.h"
#include "refmodel/tensor_diff.h"
#include "verify/training_testutil.h"

namespace flatparam {
namespace verify {
namespace {

using refmodel::AccumulationMode;
using refmodel::AdamWOptions;
using refmodel::FsdpRankResult;
using refmodel::FsdpTrainOptions;
using refmodel::TrainOptions;
using refmodel::TrainResult;
using TensorMap = std::map<std::string, HostTensor>;

constexpr double kU32 = 1.0 / (1 << 24);

std::vector<FsdpRankResult> RunSharded(const TrainingCase& c,
                                       uint64_t sim_seed = 0) {
  absl::StatusOr<std::vector<FsdpRankResult>> ranks =
      TrainFsdpOnSim(c.options, c.world_size, sim_seed);
  RC_ASSERT(ranks.ok());
  return *std::move(ranks);
}

TrainResult RunReference(const refmodel::Config& config,
                         const TrainOptions& options) {
  absl::StatusOr<TrainResult> result =
      refmodel::TrainReference(config, options);
  RC_ASSERT(result.ok());
  return *std::move(result);
}

TrainOptions ReferenceOptions(const TrainingCase& c) {
  absl::StatusOr<TrainOptions> options =
      refmodel::ReferenceOptionsFor(c.options, c.world_size);
  RC_ASSERT(options.ok());
  return *std::move(options);
}

// Every rank's losses, parameters and state equal `want` bit for bit.
void AssertBitwiseEqual(const std::vector<FsdpRankResult>& ranks,
                        const TrainResult& want) {
  for (const FsdpRankResult& r : ranks) {
    std::string why;
    RC_ASSERT(SameFloats(r.losses, want.losses));
    if (!SameTensors(r.params, want.params, &why)) {
      RC_FAIL(absl::StrFormat("rank %d parameters: %s", r.rank, why));
    }
    if (!SameStates(r.optimizer_state, want.optimizer_state, &why)) {
      RC_FAIL(absl::StrFormat("rank %d optimizer state: %s", r.rank, why));
    }
    RC_ASSERT(r.nonzero_padding_grads == 0);
  }
}

void Classify(const TrainingCase& c) {
  RC_TAG(std::string(ShardingStrategyName(c.options.strategy)));
  RC_CLASSIFY(c.options.align_addresses, "aligned");
  RC_CLASSIFY(c.options.cpu_offload, "offload");
  RC_CLASSIFY(c.options.micro_batches > 1 &&
                  c.options.accumulation == AccumulationMode::kNoSync,
              "no_sync");
  RC_CLASSIFY(c.options.recompute_activations, "recompute");
}

RC_GTEST_PROP(TrainingEquivalence, Float32ShardedTrainingEqualsReferenceBitwise,
              ()) {
  TrainingCase c = *GenTrainingCase();
  if (*rc::gen::arbitrary<bool>()) {
    c.options.padding_fill = std::numeric_limits<float>::quiet_NaN();
  }
  Classify(c);
  RC_CLASSIFY(c.options.padding_fill.has_value(), "NaN padding");
  const uint64_t sim_seed = *rc::gen::arbitrary<uint64_t>();
  AssertBitwiseEqual(RunSharded(c, sim_seed),
                     RunReference(c.options.model, ReferenceOptions(c)));
}

// A mixed-precision case: a low param dtype, and the reduce dtype unset
// (= param dtype), float32 or the param dtype.
TrainingCase GenMixedPrecisionCase() {
  TrainingCase c = *GenTrainingCase();
  c.options.param_dtype = *rc::gen::element(DType::kBFloat16, DType::kFloat16);
  const int reduce = *rc::gen::inRange(0, 3);
  if (reduce == 1) c.options.reduce_dtype = DType::kFloat32;
  if (reduce == 2) c.options.reduce_dtype = c.options.param_dtype;
  return c;
}

RC_GTEST_PROP(TrainingEquivalence,
              MixedPrecisionEqualsEmulationBitwiseAndStaysWithinAdamWBound,
              ()) {
  TrainingCase c = GenMixedPrecisionCase();
  AdamWOptions adamw;
  adamw.lr = *rc::gen::element(1e-3, 1e-2);
  adamw.weight_decay = *rc::gen::element(0.0, 0.01);
  c.options.optimizer = adamw;
  Classify(c);
  RC_TAG(std::string(DTypeName(*c.options.param_dtype)));
  const std::vector<FsdpRankResult> ranks = RunSharded(c);
  AssertBitwiseEqual(ranks, RunReference(c.options.model, ReferenceOptions(c)));

  TrainOptions fp32 = ReferenceOptions(c);
  fp32.param_dtype.reset();
  fp32.reduce_dtype.reset();
  const TrainResult full = RunReference(c.options.model, fp32);
  absl::StatusOr<refmodel::ReferenceModel> model =
      refmodel::ReferenceModel::Create(c.options.model);
  RC_ASSERT(model.ok());
  const double bound = refmodel::AdamWDivergenceBound(
      adamw, c.options.steps, refmodel::MaxAbs(model->InitParams()));
  const double diff = MaxAbsDiff(ranks[0].params, full.params);
  RC_ASSERT(diff <= bound);
}

// Higham's gamma_k(u) = k u / (1 - k u).
double Gamma(int k, double u) { return k * u / (1 - k * u); }

// T per element: sum over ranks and micro-batches of |x| / (pre * post),
// x being that rank's micro-batch gradient at `params` (TrainOptions'
// batches, float32).
TensorMap AbsGradientSum(const refmodel::ReferenceModel& model,
                         const TensorMap& params, const TrainOptions& o) {
  const int world = o.reduction.world_size;
  const int64_t local = o.global_batch / world;
  const double scale =
      o.reduction.pre_divide_factor * o.reduction.post_divide_factor;
  TensorMap total;
  for (const auto& [name, p] : params) {
    total.emplace(name, HostTensor(DType::kFloat64, p.shape()));
  }
  for (int64_t m = 0; m < o.micro_batches; ++m) {
    for (int r = 0; r < world; ++r) {
      TensorMap grads;
      refmodel::MapParamAccess access(&params, &grads);
      const refmodel::Batch batch = refmodel::MakeBatch(
          o.data_seed, model.config().vocab, 0, m, r * local, local);
      RC_ASSERT(model.ForwardBackward(batch, access).ok());
      for (auto& [name, t] : total) {
        const HostTensor& g = grads.at(name);
        for (int64_t i = 0; i < t.numel(); ++i) {
          t.SetDouble(i, t.GetDouble(i) + std::abs(g.GetDouble(i)) / scale);
        }
      }
    }
  }
  return total;
}

// Asserts |a - b| <= gamma * T + eta per element.
void AssertWithin(const TensorMap& a, const TensorMap& b, const TensorMap& t,
                  double gamma, double eta) {
  for (const auto& [name, x] : a) {
    const HostTensor& y = b.at(name);
    const HostTensor& s = t.at(name);
    for (int64_t i = 0; i < x.numel(); ++i) {
      const double diff = std::abs(x.GetDouble(i) - y.GetDouble(i));
      const double bound = gamma * s.GetDouble(i) + eta;
      if (!(diff <= bound)) {
        RC_FAIL(absl::StrFormat("%s[%d]: |%.9g - %.9g| = %g > %g", name, i,
                                x.GetDouble(i), y.GetDouble(i), diff, bound));
      }
    }
  }
}

RC_GTEST_PROP(TrainingEquivalence,
              MixedPrecisionGradientIsWithinTheRoundingBound, ()) {
  TrainingCase c = GenMixedPrecisionCase();
  c.options.steps = 1;
  c.options.gather_grads = true;
  const DType low = *c.options.param_dtype;
  RC_TAG(std::string(DTypeName(low)));
  absl::StatusOr<refmodel::ReferenceModel> model =
      refmodel::ReferenceModel::Create(c.options.model);
  RC_ASSERT(model.ok());
  // Parameters representable in the low dtype: both runs then compute the
  // same local gradients and differ only in how they round their sum.
  TensorMap params = model->InitParams();
  for (auto& [name, p] : params) {
    for (int64_t i = 0; i < p.numel(); ++i) {
      HostTensor one = HostTensor::Flat(low, 1);
      one.SetDouble(0, p.GetDouble(i));
      p.SetDouble(i, one.GetDouble(0));
    }
  }
  c.options.initial_params = params;
  const std::vector<FsdpRankResult> ranks = RunSharded(c);

  TrainOptions fp32 = ReferenceOptions(c);
  fp32.param_dtype.reset();
  fp32.reduce_dtype.reset();
  absl::StatusOr<refmodel::StepGradients> want =
      refmodel::ComputeStepGradients(*model, params, fp32, 0);
  RC_ASSERT(want.ok());
  const int k =
      2 * static_cast<int>(c.options.micro_batches) + c.world_size + 2;
  const double u_low =
      low == DType::kBFloat16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
  const double eta_low =
      low == DType::kBFloat16 ? std::ldexp(1.0, -134) : std::ldexp(1.0, -25);
  AssertWithin(ranks[0].grads, want->grads,
               AbsGradientSum(*model, params, fp32),
               Gamma(k, u_low) + Gamma(k, kU32), 2 * k * eta_low);
}

RC_GTEST_PROP(TrainingEquivalence, PeakMemoryEqualsTheFormula, ()) {
  TrainingCase c = *GenTrainingCase();
  c.options.steps = *rc::gen::inRange<int64_t>(1, 3);
  switch (*rc::gen::inRange(0, 4)) {
    case 1:
      c.options.param_dtype = DType::kBFloat16;
      break;
    case 2:
      c.options.param_dtype = DType::kFloat16;
      c.options.reduce_dtype = DType::kFloat32;
      break;
    case 3:
      c.options.reduce_dtype = DType::kBFloat16;
      break;
  }
  Classify(c);
  RC_CLASSIFY(c.options.param_dtype.has_value(), "mixed precision");
  absl::StatusOr<std::array<int64_t, kNumMemoryCategories>> want =
      refmodel::ExpectedPeakMemory(c.options, c.world_size);
  RC_ASSERT(want.ok());
  for (const FsdpRankResult& r : RunSharded(c)) {
    for (int k = 0; k < kNumMemoryCategories; ++k) {
      if (r.memory.peak[k] != (*want)[k]) {
        RC_FAIL(absl::StrFormat("rank %d %s: measured %d, formula %d", r.rank,
                                MemoryCategoryName(MemoryCategory(k)),
                                r.memory.peak[k], (*want)[k]));
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Fixed cases.

TrainingCase DefaultCase(ShardingStrategy strategy, int world, int group = 0) {
  TrainingCase c;
  c.world_size = world;
  c.options.strategy = strategy;
  c.options.shard_group_size = group;
  c.options.steps = 3;
  c.options.global_batch = 2 * world;
  c.options.micro_batches = 2;
  c.options.optimizer = refmodel::SgdOptions{0.1, 0.9};
  c.options.data_seed = 5;
  return c;
}

std::vector<FsdpRankResult> MustRun(const TrainingCase& c,
                                    uint64_t sim_seed = 0) {
  absl::StatusOr<std::vector<FsdpRankResult>> r =
      TrainFsdpOnSim(c.options, c.world_size, sim_seed);
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? *std::move(r) : std::vector<FsdpRankResult>{};
}

TrainResult MustReference(const TrainingCase& c) {
  absl::StatusOr<TrainOptions> o =
      refmodel::ReferenceOptionsFor(c.options, c.world_size);
  EXPECT_TRUE(o.ok()) << o.status();
  absl::StatusOr<TrainResult> r = refmodel::TrainReference(c.options.model, *o);
  EXPECT_TRUE(r.ok()) << r.status();
  return *std::move(r);
}

// The strategies with the same one-level fold compute the same bits.
TEST(TrainingEquivalenceTest, StrategiesWithTheSameFoldAgreeBitwise) {
  const TrainResult want =
      MustReference(DefaultCase(ShardingStrategy::kFullShard, 4));
  for (ShardingStrategy s :
       {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp,
        ShardingStrategy::kNoShard}) {
    SCOPED_TRACE(ShardingStrategyName(s));
    const std::vector<FsdpRankResult> ranks = MustRun(DefaultCase(s, 4));
    ASSERT_EQ(ranks.size(), 4u);
    for (const FsdpRankResult& r : ranks) {
      std::string why;
      EXPECT_EQ(r.losses, want.losses);
      EXPECT_TRUE(SameTensors(r.params, want.params, &why)) << why;
      EXPECT_TRUE(SameStates(r.optimizer_state, want.optimizer_state, &why))
          << why;
    }
  }
}

TEST(TrainingEquivalenceTest, ResultsDoNotDependOnTheSchedule) {
  TrainingCase c = DefaultCase(ShardingStrategy::kHybridShard, 6, 3);
  c.options.align_addresses = true;
  const std::vector<FsdpRankResult> a = MustRun(c, 1);
  const std::vector<FsdpRankResult> b = MustRun(c, 99);
  ASSERT_EQ(a.size(), b.size());
  for (size_t r = 0; r < a.size(); ++r) {
    EXPECT_EQ(a[r].losses, b[r].losses);
    EXPECT_EQ(a[r].params, b[r].params);
    EXPECT_EQ(a[r].optimizer_state, b[r].optimizer_state);
    EXPECT_EQ(a[r].memory.peak, b[r].memory.peak);
  }
}

// HYBRID_SHARD on 2 nodes x 4 ranks against FULL_SHARD on 8 ranks.
TEST(TrainingEquivalenceTest, HybridShard2x4AndFullShard8) {
  TrainingCase hybrid = DefaultCase(ShardingStrategy::kHybridShard, 8, 4);
  TrainingCase full = DefaultCase(ShardingStrategy::kFullShard, 8);
  for (TrainingCase* c : {&hybrid, &full}) {
    c->options.steps = 1;
    c->options.micro_batches = 1;
    c->options.gather_grads = true;
  }
  const std::vector<FsdpRankResult> h = MustRun(hybrid);
  const std::vector<FsdpRankResult> f = MustRun(full);
  ASSERT_EQ(h.size(), 8u);
  ASSERT_EQ(f.size(), 8u);
  // Each equals its own reference bitwise.
  std::string why;
  const TrainResult want_h = MustReference(hybrid);
  const TrainResult want_f = MustReference(full);
  EXPECT_TRUE(SameTensors(h[5].params, want_h.params, &why)) << why;
  EXPECT_TRUE(SameTensors(f[5].params, want_f.params, &why)) << why;
  EXPECT_EQ(h[0].losses, f[0].losses);  // The loss fold is the same.
  // The two folds round differently ...
  EXPECT_FALSE(SameTensors(h[0].grads, f[0].grads, &why));
  EXPECT_FALSE(SameTensors(h[0].params, f[0].params, &why));
  // ... by at most the reassociation bound.
  absl::StatusOr<refmodel::ReferenceModel> model =
      refmodel::ReferenceModel::Create(full.options.model);
  ASSERT_TRUE(model.ok());
  absl::StatusOr<TrainOptions> o =
      refmodel::ReferenceOptionsFor(full.options, 8);
  ASSERT_TRUE(o.ok());
  const TensorMap t = AbsGradientSum(*model, model->InitParams(), *o);
  const double gamma = 2 * Gamma(2 * 1 + 8 + 1, kU32);
  double worst_ratio = 0;
  for (const auto& [name, g] : h[0].grads) {
    for (int64_t i = 0; i < g.numel(); ++i) {
      const double diff =
          std::abs(g.GetDouble(i) - f[0].grads.at(name).GetDouble(i));
      const double bound = gamma * t.at(name).GetDouble(i);
      EXPECT_LE(diff, bound) << name << "[" << i << "]";
      if (bound > 0) worst_ratio = std::max(worst_ratio, diff / bound);
    }
  }
  EXPECT_GT(worst_ratio, 0);
}

// Collective counts per step follow from the hooks: FULL_SHARD all-gathers
// every unit in the forward and every layer again in the backward (the
// root is kept); SHARD_GRAD_OP only in the forward; every unit's gradient is
// reduce-scattered per synchronizing micro-batch; NO_SHARD all-reduces.
TEST(TrainingEquivalenceTest, CountsCollectives) {
  struct Case {
    ShardingStrategy strategy;
    AccumulationMode mode;
    int64_t all_gathers, reduce_scatters, all_reduces;
  };
  // Default model: 3 layers, 4 units; 2 micro-batches; 3 steps.
  const Case cases[] = {
      {ShardingStrategy::kFullShard, AccumulationMode::kShardedAccumulation,
       3 * 2 * 7, 3 * 2 * 4, 0},
      {ShardingStrategy::kShardGradOp, AccumulationMode::kShardedAccumulation,
       3 * 2 * 4, 3 * 2 * 4, 0},
      // no_sync keeps SHARD_GRAD_OP's parameters between micro-batches.
      {ShardingStrategy::kShardGradOp, AccumulationMode::kNoSync, 3 * 4, 3 * 4,
       0},
      {ShardingStrategy::kNoShard, AccumulationMode::kShardedAccumulation, 0, 0,
       3 * 2 * 4},
  };
  for (const Case& k : cases) {
    TrainingCase c = DefaultCase(k.strategy, 4);
    c.options.accumulation = k.mode;
    const std::vector<FsdpRankResult> r = MustRun(c);
    ASSERT_FALSE(r.empty());
    SCOPED_TRACE(ShardingStrategyName(k.strategy));
    EXPECT_EQ(r[0].comm.all_gather.calls, k.all_gathers);
    EXPECT_EQ(r[0].comm.reduce_scatter.calls, k.reduce_scatters);
    EXPECT_EQ(r[0].comm.all_reduce.calls, k.all_reduces);
    EXPECT_EQ(r[0].comm.all_gather.sent_bytes,
              r[0].comm.all_gather.bytes * 3 / 4);
  }
}

TEST(TrainingEquivalenceTest, RejectsInconsistentOptions) {
  FsdpTrainOptions o;
  o.strategy = ShardingStrategy::kHybridShard;
  o.shard_group_size = 3;
  EXPECT_FALSE(TrainFsdpOnSim(o, 8).ok());
  o.strategy = ShardingStrategy::kFullShard;
  EXPECT_FALSE(TrainFsdpOnSim(o, 8).ok());  // A group size without hybrid.
  o.shard_group_size = 0;
  o.global_batch = 6;
  EXPECT_FALSE(TrainFsdpOnSim(o, 4).ok());
}

}  // namespace
}  // namespace verify
}  // namespace flatparam
