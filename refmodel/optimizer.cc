#include "refmodel/optimizer.h"

#include <cmath>
#include <initializer_list>
#include <utility>
#include <vector>

#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "flatparam/base/dtype.h"
#include "flatparam/base/shape.h"
#include "flatparam/base/status_macros.h"

namespace flatparam {
namespace refmodel {
namespace {

absl::Status CheckArgs(BufferRef param, const ConstBufferRef& grad) {
  if (param.dtype != DType::kFloat32) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "the parameter has dtype %s; optimizers support float32 only",
        DTypeName(param.dtype)));
  }
  if (grad.dtype != DType::kFloat32) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "the gradient has dtype %s; optimizers support float32 only",
        DTypeName(grad.dtype)));
  }
  if (param.count != grad.count) {
    return absl::InvalidArgumentError(
        absl::StrFormat("the parameter has %d elements but the gradient %d",
                        param.count, grad.count));
  }
  return absl::OkStatus();
}

// Checks that every state tensor is one of `allowed` with the right dtype
// and numel ("step" is 0-d: one element).
absl::Status CheckState(const OptimizerState& state, int64_t numel,
                        absl::string_view optimizer,
                        std::initializer_list<absl::string_view> allowed) {
  for (const auto& [name, t] : state.tensors) {
    bool known = false;
    for (absl::string_view a : allowed) known |= name == a;
    if (!known) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s state has an entry \"%s\"; %s uses only: %s", optimizer, name,
          optimizer, absl::StrJoin(allowed, ", ")));
    }
    const bool is_step = name == kStepState;
    const int64_t want = is_step ? 1 : numel;
    if (t.dtype() != DType::kFloat32 || t.numel() != want ||
        (is_step && !t.shape().empty())) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s state \"%s\" has dtype %s and shape %s; expected float32 "
          "with %s",
          optimizer, name, DTypeName(t.dtype()), ShapeString(t.shape()),
          is_step ? std::string("shape [] (0-d)")
                  : absl::StrFormat("%d elements", numel)));
    }
  }
  return absl::OkStatus();
}

class Sgd final : public Optimizer {
 public:
  explicit Sgd(const SgdOptions& options) : options_(options) {}

  absl::string_view name() const override { return "sgd"; }

  absl::Status Step(BufferRef param, std::optional<ConstBufferRef> grad_ref,
                    OptimizerState& state) const override {
    if (!grad_ref.has_value()) return absl::OkStatus();
    FLATPARAM_RETURN_IF_ERROR(CheckArgs(param, *grad_ref));
    FLATPARAM_RETURN_IF_ERROR(
        CheckState(state, param.count, "SGD", {kMomentumBuffer}));
    const int64_t n = param.count;
    float* p = static_cast<float*>(param.data);
    const float* grad = static_cast<const float*>(grad_ref->data);

    const bool use_momentum = options_.momentum != 0.0;
    float* buf = nullptr;
    bool first = false;
    if (use_momentum) {
      auto it = state.tensors.find(std::string(kMomentumBuffer));
      if (it == state.tensors.end()) {
        it = state.tensors
                 .emplace(std::string(kMomentumBuffer),
                          HostTensor::Flat(DType::kFloat32, n))
                 .first;
        first = true;
      }
      buf = it->second.data_as<float>();
    }
    const bool decay = options_.weight_decay != 0.0;
    const float weight_decay = static_cast<float>(options_.weight_decay);
    const float momentum = static_cast<float>(options_.momentum);
    const float one_minus_dampening =
        static_cast<float>(1.0 - options_.dampening);
    const float neg_lr = static_cast<float>(-options_.lr);
    for (int64_t i = 0; i < n; ++i) {
      float g = options_.maximize ? -grad[i] : grad[i];
      if (decay) g = g + weight_decay * p[i];
      if (use_momentum) {
        if (first) {
          buf[i] = g;
        } else {
          const float scaled = buf[i] * momentum;
          buf[i] = scaled + one_minus_dampening * g;
        }
        g = options_.nesterov ? g + momentum * buf[i] : buf[i];
      }
      p[i] = p[i] + neg_lr * g;
    }
    return absl::OkStatus();
  }

 private:
  SgdOptions options_;
};

class AdamW final : public Optimizer {
 public:
  explicit AdamW(const AdamWOptions& options) : options_(options) {}

  absl::string_view name() const override { return "adamw"; }

  absl::Status Step(BufferRef param, std::optional<ConstBufferRef> grad_ref,
                    OptimizerState& state) const override {
    if (!grad_ref.has_value()) return absl::OkStatus();
    FLATPARAM_RETURN_IF_ERROR(CheckArgs(param, *grad_ref));
    FLATPARAM_RETURN_IF_ERROR(CheckState(state, param.count, "AdamW",
                                         {kStepState, kExpAvg, kExpAvgSq}));
    const int64_t n = param.count;
    auto& tensors = state.tensors;
    if (tensors.empty()) {
      tensors.emplace(std::string(kStepState), HostTensor(DType::kFloat32, {}));
      tensors.emplace(std::string(kExpAvg),
                      HostTensor::Flat(DType::kFloat32, n));
      tensors.emplace(std::string(kExpAvgSq),
                      HostTensor::Flat(DType::kFloat32, n));
    } else if (tensors.size() != 3) {
      std::vector<std::string> names;
      for (const auto& entry : tensors) names.push_back(entry.first);
      return absl::InvalidArgumentError(absl::StrFormat(
          "AdamW state has only [%s]; it needs step, exp_avg and exp_avg_sq",
          absl::StrJoin(names, ", ")));
    }
    float* p = static_cast<float*>(param.data);
    const float* grad = static_cast<const float*>(grad_ref->data);
    float& step_t = *tensors.at(std::string(kStepState)).data_as<float>();
    float* m = tensors.at(std::string(kExpAvg)).data_as<float>();
    float* v = tensors.at(std::string(kExpAvgSq)).data_as<float>();

    step_t += 1.0f;
    const double lr = options_.lr;
    const double step = static_cast<double>(step_t);
    const double bias_correction1 = 1.0 - std::pow(options_.beta1, step);
    const double bias_correction2 = 1.0 - std::pow(options_.beta2, step);
    const double step_size = lr / bias_correction1;
    const double bias_correction2_sqrt = std::sqrt(bias_correction2);

    const float decay = static_cast<float>(1.0 - lr * options_.weight_decay);
    const float w = static_cast<float>(1.0 - options_.beta1);
    const bool w_small = std::abs(w) < 0.5f;
    const float one_minus_w = 1.0f - w;
    const float beta2 = static_cast<float>(options_.beta2);
    const float one_minus_beta2 = static_cast<float>(1.0 - options_.beta2);
    const float bc2_sqrt = static_cast<float>(bias_correction2_sqrt);
    const float eps = static_cast<float>(options_.eps);
    const float neg_step_size = static_cast<float>(-step_size);
    for (int64_t i = 0; i < n; ++i) {
      const float g = options_.maximize ? -grad[i] : grad[i];
      p[i] = p[i] * decay;
      // ATen's scalar lerp.
      const float diff = g - m[i];
      m[i] = w_small ? m[i] + w * diff : g - diff * one_minus_w;
      const float v_scaled = v[i] * beta2;
      v[i] = v_scaled + (one_minus_beta2 * g) * g;
      const float denom = std::sqrt(v[i]) / bc2_sqrt + eps;
      p[i] = p[i] + (neg_step_size * m[i]) / denom;
    }
    return absl::OkStatus();
  }

 private:
  AdamWOptions options_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Optimizer>> MakeSgd(const SgdOptions& o) {
  if (!(o.lr >= 0.0)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("Invalid learning rate: %g", o.lr));
  }
  if (!(o.momentum >= 0.0)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("Invalid momentum value: %g", o.momentum));
  }
  if (!(o.weight_decay >= 0.0)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("Invalid weight_decay value: %g", o.weight_decay));
  }
  if (o.nesterov && (o.momentum <= 0.0 || o.dampening != 0.0)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "Nesterov momentum requires a momentum and zero dampening (momentum "
        "%g, dampening %g)",
        o.momentum, o.dampening));
  }
  return std::unique_ptr<Optimizer>(new Sgd(o));
}

absl::StatusOr<std::unique_ptr<Optimizer>> MakeAdamW(const AdamWOptions& o) {
  if (!(o.lr >= 0.0)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("Invalid learning rate: %g", o.lr));
  }
  if (!(o.eps >= 0.0)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("Invalid epsilon value: %g", o.eps));
  }
  if (!(o.beta1 >= 0.0 && o.beta1 < 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("Invalid beta parameter at index 0: %g", o.beta1));
  }
  if (!(o.beta2 >= 0.0 && o.beta2 < 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("Invalid beta parameter at index 1: %g", o.beta2));
  }
  if (!(o.weight_decay >= 0.0)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("Invalid weight_decay value: %g", o.weight_decay));
  }
  return std::unique_ptr<Optimizer>(new AdamW(o));
}

absl::StatusOr<std::unique_ptr<Optimizer>> MakeOptimizer(
    const OptimizerOptions& options) {
  if (const auto* sgd = std::get_if<SgdOptions>(&options)) return MakeSgd(*sgd);
  return MakeAdamW(std::get<AdamWOptions>(options));
}

double AdamWUpdateBound(const AdamWOptions& o, int64_t step) {
  const double t = static_cast<double>(step);
  const double ratio = o.beta1 * o.beta1 / o.beta2;
  double series = 0;
  double term = 1;
  for (int64_t k = 0; k < step; ++k) {
    series += term;
    term *= ratio;
  }
  return (1 - o.beta1) * std::sqrt(1 - std::pow(o.beta2, t)) /
         ((1 - std::pow(o.beta1, t)) * std::sqrt(1 - o.beta2)) *
         std::sqrt(series);
}

double AdamWDivergenceBound(const AdamWOptions& o, int64_t steps,
                            double max_abs_param) {
  constexpr double kU = 1.0 / (1 << 24);  // float32's unit roundoff
  double moves = 0;
  for (int64_t t = 1; t <= steps; ++t) moves += o.lr * AdamWUpdateBound(o, t);
  const double p = max_abs_param + moves;
  double bound = 0;
  for (int64_t t = 1; t <= steps; ++t) {
    bound += 2 * o.lr * AdamWUpdateBound(o, t) * (1 + 16 * t * kU) + 4 * kU * p;
  }
  return bound;
}

}  // namespace refmodel
}  // namespace flatparam
