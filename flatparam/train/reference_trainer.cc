#include "flatparam/train/reference_trainer.h"

#include <cmath>
#include <cstring>
#include <memory>
#include <utility>

#include "absl/strings/str_format.h"
#include "comm/communicator.h"
#include "comm/host_reduce.h"
#include "flatparam/base/status_macros.h"

namespace flatparam {
namespace train {
namespace {

using TensorMap = std::map<std::string, HostTensor>;

absl::Status CheckOptions(const TrainOptions& o) {
  const GradientReduction& r = o.reduction;
  if (o.steps < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("steps must be >= 0, got %d", o.steps));
  }
  if (r.world_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("world_size must be >= 1, got %d", r.world_size));
  }
  for (double f : {r.pre_divide_factor, r.post_divide_factor}) {
    if (!(std::isfinite(f) && f > 0.0)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "gradient divide factors must be finite and > 0, got pre %g and "
          "post %g",
          r.pre_divide_factor, r.post_divide_factor));
    }
  }
  if (o.global_batch < 1 || o.global_batch % r.world_size != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "global_batch %d must be >= 1 and a multiple of world_size %d",
        o.global_batch, r.world_size));
  }
  if (o.micro_batches < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("micro_batches must be >= 1, got %d", o.micro_batches));
  }
  return absl::OkStatus();
}

// Zero gradients for every parameter in `params`.
TensorMap ZerosLike(const TensorMap& params) {
  TensorMap zeros;
  for (const auto& [name, p] : params) {
    zeros.emplace(name, HostTensor(p.dtype(), p.shape()));
  }
  return zeros;
}

ReduceOptions ToReduceOptions(const GradientReduction& r) {
  ReduceOptions options;
  options.op = ReduceOp::kSum;
  options.pre_divide_factor = r.pre_divide_factor;
  options.post_divide_factor = r.post_divide_factor;
  return options;
}

// One rank's contribution to the fold: acc = pre(x) or acc + pre(x).
void FoldRank(const TensorMap& local, const ReduceOptions& options, bool first,
              TensorMap& acc) {
  for (const auto& [name, g] : local) {
    HostTensor& a = acc.at(name);
    HostReduceStep(a.data(), g.data(), g.numel(), DType::kFloat32, options,
                   first);
  }
}

void FinishFold(const ReduceOptions& options, int world_size, TensorMap& acc) {
  for (auto& [name, a] : acc) {
    HostReduceFinish(a.data(), a.numel(), DType::kFloat32, options, world_size);
  }
}

// A copy of `t` with `shape` (same numel).
HostTensor Reshaped(const HostTensor& t, const std::vector<int64_t>& shape) {
  HostTensor out(t.dtype(), shape);
  std::memcpy(out.data(), t.data(), t.nbytes());
  return out;
}

// The loss of a step from losses[m][r]: fold over ranks / W, then over
// micro-batches / M.
float StepLoss(const std::vector<std::vector<float>>& losses) {
  float total = 0.0f;
  for (size_t m = 0; m < losses.size(); ++m) {
    const std::vector<float>& l = losses[m];
    float acc = l[0];
    for (size_t r = 1; r < l.size(); ++r) acc = acc + l[r];
    const float mean = acc / static_cast<float>(l.size());
    total = m == 0 ? mean : total + mean;
  }
  return total / static_cast<float>(losses.size());
}

}  // namespace

GradientReduction GradientReduction::Fsdp(int world_size) {
  int64_t factor = 1;
  while (world_size % factor == 0 &&
         static_cast<double>(world_size) / static_cast<double>(factor) >
             static_cast<double>(factor)) {
    factor *= 2;
  }
  GradientReduction r;
  r.world_size = world_size;
  r.pre_divide_factor = static_cast<double>(factor);
  r.post_divide_factor =
      static_cast<double>(world_size) / static_cast<double>(factor);
  return r;
}

absl::StatusOr<StepGradients> ComputeStepGradients(const ReferenceModel& model,
                                                   const TensorMap& params,
                                                   const TrainOptions& options,
                                                   int64_t step) {
  FLATPARAM_RETURN_IF_ERROR(CheckOptions(options));
  FLATPARAM_RETURN_IF_ERROR(model.CheckParams(params));
  const int world = options.reduction.world_size;
  const int64_t micro_batches = options.micro_batches;
  const int64_t local_batch = options.global_batch / world;
  const int64_t vocab = model.config().vocab;
  const ReduceOptions reduce = ToReduceOptions(options.reduction);

  auto local_batch_of = [&](int64_t m, int r) {
    return MakeBatch(options.data_seed, vocab, step, m, r * local_batch,
                     local_batch);
  };
  std::vector<std::vector<float>> losses(micro_batches,
                                         std::vector<float>(world));
  TensorMap grads = ZerosLike(params);
  if (options.accumulation == AccumulationMode::kShardedAccumulation) {
    for (int64_t m = 0; m < micro_batches; ++m) {
      TensorMap reduced = ZerosLike(params);
      for (int r = 0; r < world; ++r) {
        TensorMap local = ZerosLike(params);
        MapParamAccess access(&params, &local);
        FLATPARAM_ASSIGN_OR_RETURN(
            losses[m][r], model.ForwardBackward(local_batch_of(m, r), access));
        FoldRank(local, reduce, r == 0, reduced);
      }
      FinishFold(reduce, world, reduced);
      if (m == 0) {
        grads = std::move(reduced);
        continue;
      }
      for (auto& [name, g] : grads) {
        float* acc = g.data_as<float>();
        const float* x = reduced.at(name).data_as<float>();
        for (int64_t i = 0; i < g.numel(); ++i) acc[i] = acc[i] + x[i];
      }
    }
  } else {
    for (int r = 0; r < world; ++r) {
      TensorMap local = ZerosLike(params);
      MapParamAccess access(&params, &local);
      for (int64_t m = 0; m < micro_batches; ++m) {
        FLATPARAM_ASSIGN_OR_RETURN(
            losses[m][r], model.ForwardBackward(local_batch_of(m, r), access));
      }
      FoldRank(local, reduce, r == 0, grads);
    }
    FinishFold(reduce, world, grads);
  }
  StepGradients result;
  result.loss = StepLoss(losses);
  result.grads = std::move(grads);
  return result;
}

absl::StatusOr<TrainResult> TrainReference(const Config& config,
                                           const TrainOptions& options) {
  FLATPARAM_ASSIGN_OR_RETURN(ReferenceModel model,
                             ReferenceModel::Create(config));
  FLATPARAM_RETURN_IF_ERROR(CheckOptions(options));
  FLATPARAM_ASSIGN_OR_RETURN(std::unique_ptr<Optimizer> optimizer,
                             MakeOptimizer(options.optimizer));
  TrainResult result;
  result.params = options.initial_params.has_value() ? *options.initial_params
                                                     : model.InitParams();
  FLATPARAM_RETURN_IF_ERROR(model.CheckParams(result.params));
  for (const auto& [name, state] : options.initial_optimizer_state) {
    if (result.params.count(name) == 0) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "initial optimizer state for \"%s\", which is not a parameter of "
          "the model",
          name));
    }
  }
  result.optimizer_state = options.initial_optimizer_state;

  for (int64_t k = 0; k < options.steps; ++k) {
    FLATPARAM_ASSIGN_OR_RETURN(
        StepGradients step, ComputeStepGradients(model, result.params, options,
                                                 options.first_step + k));
    result.losses.push_back(step.loss);
    for (auto& [name, param] : result.params) {
      OptimizerState& state = result.optimizer_state[name];
      absl::Status status =
          optimizer->Step(param.ref(), step.grads.at(name).cref(), state);
      if (!status.ok()) {
        return absl::Status(
            status.code(),
            absl::StrFormat("optimizer step %d of \"%s\": %s",
                            options.first_step + k, name, status.message()));
      }
      for (auto& [state_name, t] : state.tensors) {
        if (state_name != kStepState && t.shape() != param.shape()) {
          t = Reshaped(t, param.shape());
        }
      }
    }
  }
  return result;
}

}  // namespace train
}  // namespace flatparam
