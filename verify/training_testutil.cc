#include "verify/training_testutil.h"

#include <cstring>
#include <memory>
#include <variant>

#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "flatparam/base/shape.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/device/device.h"
#include "flatparam/layout.h"
#include "sim/sim.h"
#include "verify/generators.h"

namespace flatparam {
namespace verify {

using refmodel::FsdpRankResult;
using refmodel::FsdpTrainOptions;
using refmodel::OptimizerState;

namespace {

absl::StatusOr<std::vector<FsdpRankResult>> TrainOnSim(
    const std::function<FsdpTrainOptions(int)>& options_of, int world_size,
    uint64_t sim_seed, const AfterTraining& after) {
  SimOptions sim;
  sim.world_size = world_size;
  sim.seed = sim_seed;
  FLATPARAM_ASSIGN_OR_RETURN(std::unique_ptr<SimWorld> world,
                             SimWorld::Create(sim));
  std::vector<FsdpRankResult> results(world_size);
  FLATPARAM_RETURN_IF_ERROR(
      world->Run([&](SimCommunicator& comm) -> absl::Status {
        HostDeviceOps device;
        const FsdpTrainOptions options = options_of(comm.rank());
        FsdpRankResult& mine = results[comm.rank()];
        FLATPARAM_ASSIGN_OR_RETURN(
            mine, refmodel::TrainFsdpOnRank(comm, device, options));
        if (after == nullptr) return absl::OkStatus();
        return after(comm, options, mine);
      }));
  return results;
}

}  // namespace

absl::StatusOr<std::vector<FsdpRankResult>> TrainFsdpOnSim(
    const FsdpTrainOptions& options, int world_size, uint64_t sim_seed) {
  FLATPARAM_RETURN_IF_ERROR(
      refmodel::ValidateFsdpTrainOptions(options, world_size));
  return TrainOnSim([&](int) { return options; }, world_size, sim_seed,
                    nullptr);
}

absl::StatusOr<std::vector<FsdpRankResult>> TrainFsdpPerRankOnSim(
    const std::function<FsdpTrainOptions(int)>& options_of, int world_size,
    const AfterTraining& after) {
  return TrainOnSim(options_of, world_size, /*sim_seed=*/0, after);
}

namespace {

std::string DescribeOptimizer(const refmodel::OptimizerOptions& o) {
  if (const auto* sgd = std::get_if<refmodel::SgdOptions>(&o)) {
    return absl::StrFormat(
        "sgd(lr=%g, momentum=%g, dampening=%g, weight_decay=%g, nesterov=%d)",
        sgd->lr, sgd->momentum, sgd->dampening, sgd->weight_decay,
        sgd->nesterov);
  }
  const auto& adamw = std::get<refmodel::AdamWOptions>(o);
  return absl::StrFormat("adamw(lr=%g, betas=(%g, %g), eps=%g, wd=%g)",
                         adamw.lr, adamw.beta1, adamw.beta2, adamw.eps,
                         adamw.weight_decay);
}

}  // namespace

std::string Describe(const TrainingCase& c) {
  const FsdpTrainOptions& o = c.options;
  return absl::StrFormat(
      "{world %d, %s%s, vocab %d, dims [%s], model seed %d, align %d, "
      "param_dtype %s, reduce_dtype %s, offload %d, steps %d, global batch "
      "%d, micro-batches %d (%s), %s, data seed %d, prefetch forward %d "
      "backward %s depth %d limit %d%s%s}",
      c.world_size, ShardingStrategyName(o.strategy),
      IsHybridStrategy(o.strategy)
          ? absl::StrFormat(" (shard group %d)", o.shard_group_size)
          : "",
      o.model.vocab, absl::StrJoin(o.model.dims, ", "), o.model.seed,
      o.align_addresses,
      o.param_dtype.has_value() ? DTypeName(*o.param_dtype) : "-",
      o.reduce_dtype.has_value() ? DTypeName(*o.reduce_dtype) : "-",
      o.cpu_offload, o.steps, o.global_batch, o.micro_batches,
      o.accumulation == refmodel::AccumulationMode::kNoSync ? "no_sync"
                                                            : "sharded",
      DescribeOptimizer(o.optimizer), o.data_seed, o.forward_prefetch,
      BackwardPrefetchName(o.backward_prefetch), o.prefetch_depth,
      o.limit_all_gathers, o.recompute_activations ? ", recompute" : "",
      o.padding_fill.has_value()
          ? absl::StrFormat(", padding %g", *o.padding_fill)
          : "");
}

void showValue(const TrainingCase& c, std::ostream& os) { os << Describe(c); }

rc::Gen<refmodel::Config> GenModelConfig() {
  return rc::gen::exec([] {
           refmodel::Config config;
           config.vocab = *UniformInRange<int64_t>(1, 13);
           const int layers = *UniformInRange(1, 4);
           config.dims.clear();
           for (int i = 0; i < layers; ++i) {
             config.dims.push_back(*UniformInRange<int64_t>(1, 13));
           }
           config.seed = *rc::gen::arbitrary<uint64_t>();
           return config;
         })
      .as("model config");
}

rc::Gen<refmodel::OptimizerOptions> GenOptimizerOptions() {
  return rc::gen::exec([]() -> refmodel::OptimizerOptions {
           if (*rc::gen::arbitrary<bool>()) {
             refmodel::SgdOptions sgd;
             sgd.lr = *rc::gen::element(0.05, 0.1, 0.5);
             sgd.momentum = *rc::gen::element(0.0, 0.9);
             sgd.weight_decay = *rc::gen::element(0.0, 0.01);
             sgd.nesterov = sgd.momentum > 0 && *rc::gen::arbitrary<bool>();
             return sgd;
           }
           refmodel::AdamWOptions adamw;
           adamw.lr = *rc::gen::element(1e-3, 1e-2);
           adamw.weight_decay = *rc::gen::element(0.0, 0.01);
           return adamw;
         })
      .as("optimizer");
}

rc::Gen<TrainingCase> GenTrainingCase() {
  return rc::gen::exec([] {
           TrainingCase c;
           c.world_size = *UniformInRange(1, 9);
           FsdpTrainOptions& o = c.options;
           o.model = *GenModelConfig();
           o.strategy = *rc::gen::element(
               ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp,
               ShardingStrategy::kNoShard, ShardingStrategy::kHybridShard,
               ShardingStrategy::kHybridShardZero2);
           if (IsHybridStrategy(o.strategy)) {
             std::vector<int> divisors;
             for (int g = 1; g <= c.world_size; ++g) {
               if (c.world_size % g == 0) divisors.push_back(g);
             }
             o.shard_group_size = *rc::gen::elementOf(divisors);
           }
           o.align_addresses = *rc::gen::arbitrary<bool>();
           o.cpu_offload =
               *rc::gen::weightedElement<bool>({{3, false}, {1, true}});
           o.steps = *UniformInRange<int64_t>(1, 4);
           o.micro_batches = *UniformInRange<int64_t>(1, 4);
           o.accumulation = *rc::gen::element(
               refmodel::AccumulationMode::kShardedAccumulation,
               refmodel::AccumulationMode::kNoSync);
           o.global_batch = c.world_size * *UniformInRange<int64_t>(1, 3);
           o.optimizer = *GenOptimizerOptions();
           o.data_seed = *rc::gen::arbitrary<uint64_t>();
           o.forward_prefetch = *rc::gen::arbitrary<bool>();
           o.backward_prefetch = *rc::gen::element(
               BackwardPrefetch::kNone, BackwardPrefetch::kBackwardPre,
               BackwardPrefetch::kBackwardPost);
           o.prefetch_depth = *UniformInRange(1, 4);
           o.limit_all_gathers = *UniformInRange(0, 3);
           o.recompute_activations = *rc::gen::arbitrary<bool>();
           return c;
         })
      .as("training case");
}

namespace {

// Where two tensors first differ, or "" when bitwise equal.
std::string FirstDifference(const HostTensor& a, const HostTensor& b) {
  if (a.dtype() != b.dtype() || a.shape() != b.shape()) {
    return absl::StrFormat("%s %s vs %s %s", DTypeName(a.dtype()),
                           ShapeString(a.shape()), DTypeName(b.dtype()),
                           ShapeString(b.shape()));
  }
  const size_t size = DTypeSize(a.dtype());
  for (int64_t i = 0; i < a.numel(); ++i) {
    if (std::memcmp(static_cast<const char*>(a.data()) + i * size,
                    static_cast<const char*>(b.data()) + i * size, size) != 0) {
      return absl::StrFormat("element %d: %.9g vs %.9g", i, a.GetDouble(i),
                             b.GetDouble(i));
    }
  }
  return "";
}

template <typename V, typename F>
bool SameKeys(const std::map<std::string, V>& a,
              const std::map<std::string, V>& b, std::string* why,
              F&& compare) {
  for (const auto& [name, x] : a) {
    auto it = b.find(name);
    if (it == b.end()) {
      if (why != nullptr) *why = absl::StrFormat("\"%s\" missing", name);
      return false;
    }
    std::string diff = compare(x, it->second);
    if (!diff.empty()) {
      if (why != nullptr) *why = absl::StrFormat("\"%s\": %s", name, diff);
      return false;
    }
  }
  if (a.size() != b.size()) {
    if (why != nullptr) {
      *why = absl::StrFormat("%d vs %d entries", a.size(), b.size());
    }
    return false;
  }
  return true;
}

}  // namespace

bool SameTensors(const std::map<std::string, HostTensor>& a,
                 const std::map<std::string, HostTensor>& b, std::string* why) {
  return SameKeys(a, b, why, FirstDifference);
}

bool SameStates(const std::map<std::string, OptimizerState>& a,
                const std::map<std::string, OptimizerState>& b,
                std::string* why) {
  return SameKeys(
      a, b, why, [](const OptimizerState& x, const OptimizerState& y) {
        std::string inner;
        return SameTensors(x.tensors, y.tensors, &inner) ? std::string()
                                                         : inner;
      });
}

bool SameFloats(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() &&
         std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

}  // namespace verify
}  // namespace flatparam
