#include "refmodel/reference_trainer.h"

#include <cmath>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_format.h"
#include "comm/communicator.h"
#include "comm/host_reduce.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/device/device.h"

namespace flatparam {
namespace refmodel {
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
  if (r.shard_group_size < 0 ||
      (r.shard_group_size > 0 && r.world_size % r.shard_group_size != 0)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("shard_group_size %d must be 0 or divide world_size %d",
                        r.shard_group_size, r.world_size));
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
  for (const auto& [what, dtype] :
       {std::make_pair("param_dtype", o.param_dtype),
        std::make_pair("reduce_dtype", o.reduce_dtype)}) {
    if (dtype.has_value() && !IsFloatingPoint(*dtype)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s %s is not a floating dtype", what, DTypeName(*dtype)));
    }
  }
  return absl::OkStatus();
}

// The dtypes of the mixed-precision emulation, resolved as
// FlatParamHandle resolves them.
struct Precision {
  DType param = DType::kFloat32;
  DType reduce = DType::kFloat32;
};

Precision ResolvePrecision(const TrainOptions& o) {
  Precision p;
  if (o.param_dtype.has_value() && !o.reduce_dtype.has_value()) {
    p.param = p.reduce = *o.param_dtype;
  } else {
    p.param = o.param_dtype.value_or(DType::kFloat32);
    p.reduce = o.reduce_dtype.value_or(DType::kFloat32);
  }
  return p;
}

// Zero tensors of `dtype` shaped like every parameter in `params`.
TensorMap ZerosLike(const TensorMap& params, DType dtype = DType::kFloat32) {
  TensorMap zeros;
  for (const auto& [name, p] : params) {
    zeros.emplace(name, HostTensor(dtype, p.shape()));
  }
  return zeros;
}

HostTensor CastTo(const HostTensor& t, DType dtype) {
  HostTensor out(dtype, t.shape());
  HostCast(out.data(), dtype, t.data(), t.dtype(), t.numel());
  return out;
}

// Every parameter rounded to `dtype`, held in float32 again: what the model
// computes with under mixed precision.
TensorMap RoundedTo(const TensorMap& params, DType dtype) {
  TensorMap out;
  for (const auto& [name, p] : params) {
    out.emplace(name, CastTo(CastTo(p, dtype), DType::kFloat32));
  }
  return out;
}

ReduceOptions ToReduceOptions(const GradientReduction& r) {
  ReduceOptions options;
  options.op = ReduceOp::kSum;
  options.pre_divide_factor = r.pre_divide_factor;
  options.post_divide_factor = r.post_divide_factor;
  return options;
}

// Step 1 for one micro-batch: runs `batch` at `model_params` and adds its
// gradient into `local` (tensors of `param_dtype`); returns the loss.
absl::StatusOr<float> AccumulateLocal(const ReferenceModel& model,
                                      const TensorMap& model_params,
                                      const Batch& batch, DType param_dtype,
                                      TensorMap& local) {
  if (param_dtype == DType::kFloat32) {
    MapParamAccess access(&model_params, &local);
    return model.ForwardBackward(batch, access);
  }
  TensorMap fresh = ZerosLike(model_params);
  MapParamAccess access(&model_params, &fresh);
  FLATPARAM_ASSIGN_OR_RETURN(const float loss,
                             model.ForwardBackward(batch, access));
  for (auto& [name, acc] : local) {
    const HostTensor low = CastTo(fresh.at(name), param_dtype);
    HostAdd(acc.data(), low.data(), param_dtype, acc.numel());
  }
  return loss;
}

// Step 2: folds the ranks' local gradients (`locals[r]`, in the param dtype)
// into float32 gradients.
TensorMap FoldRanks(const std::vector<TensorMap>& locals,
                    const GradientReduction& r, Precision precision) {
  const ReduceOptions reduce = ToReduceOptions(r);
  ReduceOptions plain;
  plain.op = ReduceOp::kSum;
  const int world = static_cast<int>(locals.size());
  const int node_size = r.shard_group_size == 0 ? world : r.shard_group_size;
  const DType dtype = precision.reduce;
  TensorMap out;
  for (const auto& [name, first] : locals[0]) {
    const int64_t n = first.numel();
    std::vector<HostTensor> cast;
    if (precision.param != dtype) {
      for (const TensorMap& local : locals) {
        cast.push_back(CastTo(local.at(name), dtype));
      }
    }
    auto input = [&](int rank) -> const void* {
      return cast.empty() ? locals[rank].at(name).data() : cast[rank].data();
    };
    HostTensor acc(dtype, first.shape());
    HostTensor node(dtype, first.shape());
    for (int q = 0; q < world / node_size; ++q) {
      for (int k = 0; k < node_size; ++k) {
        HostReduceStep(node.data(), input(q * node_size + k), n, dtype, reduce,
                       k == 0);
      }
      HostReduceStep(acc.data(), node.data(), n, dtype, plain, q == 0);
    }
    HostReduceFinish(acc.data(), n, dtype, reduce, world);
    out.emplace(name, dtype == DType::kFloat32 ? std::move(acc)
                                               : CastTo(acc, DType::kFloat32));
  }
  return out;
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

GradientReduction GradientReduction::Hybrid(int world_size,
                                            int shard_group_size) {
  GradientReduction r = Fsdp(world_size);
  r.shard_group_size = shard_group_size;
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
  const Precision precision = ResolvePrecision(options);
  TensorMap rounded;
  if (precision.param != DType::kFloat32) {
    rounded = RoundedTo(params, precision.param);
  }
  const TensorMap& model_params =
      precision.param == DType::kFloat32 ? params : rounded;

  auto local_batch_of = [&](int64_t m, int r) {
    return MakeBatch(options.data_seed, vocab, step, m, r * local_batch,
                     local_batch);
  };
  std::vector<std::vector<float>> losses(micro_batches,
                                         std::vector<float>(world));
  TensorMap grads;
  if (options.accumulation == AccumulationMode::kShardedAccumulation) {
    for (int64_t m = 0; m < micro_batches; ++m) {
      std::vector<TensorMap> locals;
      for (int r = 0; r < world; ++r) {
        locals.push_back(ZerosLike(params, precision.param));
        FLATPARAM_ASSIGN_OR_RETURN(
            losses[m][r],
            AccumulateLocal(model, model_params, local_batch_of(m, r),
                            precision.param, locals.back()));
      }
      TensorMap reduced = FoldRanks(locals, options.reduction, precision);
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
    std::vector<TensorMap> locals;
    for (int r = 0; r < world; ++r) {
      locals.push_back(ZerosLike(params, precision.param));
      for (int64_t m = 0; m < micro_batches; ++m) {
        FLATPARAM_ASSIGN_OR_RETURN(
            losses[m][r],
            AccumulateLocal(model, model_params, local_batch_of(m, r),
                            precision.param, locals.back()));
      }
    }
    grads = FoldRanks(locals, options.reduction, precision);
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

}  // namespace refmodel
}  // namespace flatparam
