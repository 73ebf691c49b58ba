// Element-wise optimizers with PyTorch's semantics (torch.optim.SGD and
// torch.optim.AdamW, single-tensor implementation) on flat float32 buffers.
//
// Every update is element-wise: element i of the parameter changes as a
// function of element i of the gradient and of the state buffers and of
// scalars only. So stepping a shard of a flat parameter with its shard of the
// state gives, element for element, the same bits as stepping the whole
// parameter: this is what lets FSDP's sharded optimizer step match
// single-process training exactly.
//
// Arithmetic: scalar hyperparameter expressions are computed in double, as
// Python does (e.g. `1 - lr * weight_decay`, `lr / bias_correction1`), then
// rounded once to float when they meet a tensor, as ATen's CPU kernels do
// (`Scalar::to<float>()`). Tensor operations are float32 with every
// operation rounded separately (the library is built with
// -ffp-contract=off). The exact sequences are documented on SgdOptions and
// AdamWOptions. ATen's vectorised CPU kernels (and CUDA) may fuse `a + s * b`
// into an FMA, so bitwise equality is with PyTorch's scalar CPU path, not
// with every PyTorch build; what this library guarantees is that sharded and
// unsharded steps agree bitwise.
//
// State: an OptimizerState per parameter (or per flat-parameter shard), named
// as in PyTorch's optimizer state dict: "step" (0-d float32 tensor, AdamW
// only), "exp_avg", "exp_avg_sq" (AdamW), "momentum_buffer" (SGD with
// momentum != 0; PyTorch stores None otherwise, this library nothing).
// Buffers have the parameter's numel; Step creates missing ones as 1-D
// tensors, and accepts existing ones of any shape with the right numel.
//
// Thread-safety: optimizers are immutable (hyperparameters only) and Step is
// const; concurrent Steps on distinct parameters and states are safe.
#ifndef FLATPARAM_REFMODEL_OPTIMIZER_H_
#define FLATPARAM_REFMODEL_OPTIMIZER_H_

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <variant>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "flatparam/flatten.h"

namespace flatparam {
namespace refmodel {

// State names, as in PyTorch's optimizer state dict.
inline constexpr absl::string_view kStepState = "step";
inline constexpr absl::string_view kExpAvg = "exp_avg";
inline constexpr absl::string_view kExpAvgSq = "exp_avg_sq";
inline constexpr absl::string_view kMomentumBuffer = "momentum_buffer";

// One parameter's optimizer state: PyTorch's `optimizer.state[p]`.
struct OptimizerState {
  std::map<std::string, HostTensor> tensors;

  friend bool operator==(const OptimizerState& a, const OptimizerState& b) {
    return a.tensors == b.tensors;
  }
  friend bool operator!=(const OptimizerState& a, const OptimizerState& b) {
    return !(a == b);
  }
};

// torch.optim.SGD. Per element, with g the gradient (negated first when
// `maximize`), p the parameter, buf the momentum buffer, and float(x) the
// rounding of a double scalar:
//
//   if weight_decay != 0:  g = g + float(weight_decay) * p
//   if momentum != 0:
//     first step (no buffer yet):  buf = g
//     later:   buf = buf * float(momentum);
//              buf = buf + float(1 - dampening) * g
//     g = nesterov ? g + float(momentum) * buf : buf
//   p = p + float(-lr) * g
struct SgdOptions {
  double lr = 1e-3;
  double momentum = 0.0;
  double dampening = 0.0;
  double weight_decay = 0.0;
  bool nesterov = false;
  bool maximize = false;
};

// torch.optim.AdamW (amsgrad off). Per step, in double: step_t (a float32
// tensor) += 1, step = step_t, bc1 = 1 - pow(beta1, step),
// bc2 = 1 - pow(beta2, step), step_size = lr / bc1, bc2_sqrt = sqrt(bc2).
// Then per element, with g negated first when `maximize`:
//
//   p     = p * float(1 - lr * weight_decay)
//   m     = lerp(m, g, w)  with w = float(1 - beta1):
//             |w| < 0.5 ? m + w * (g - m) : g - (g - m) * (1 - w)
//   v     = v * float(beta2);   v = v + (float(1 - beta2) * g) * g
//   denom = sqrt(v) / float(bc2_sqrt) + float(eps)
//   p     = p + (float(-step_size) * m) / denom
//
// m is "exp_avg", v "exp_avg_sq"; both start at zero and step at 0.
struct AdamWOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;
  bool maximize = false;
};

using OptimizerOptions = std::variant<SgdOptions, AdamWOptions>;

// An optimizer's update rule for one parameter (or one shard).
class Optimizer {
 public:
  virtual ~Optimizer() = default;

  // "sgd" or "adamw".
  virtual absl::string_view name() const = 0;

  // Updates `param` in place from `grad` and `state`, creating missing state
  // (zeros; SGD's momentum buffer from the first gradient). An absent
  // gradient (std::nullopt, PyTorch's `p.grad is None`) leaves the parameter
  // and state untouched, step count included.
  //
  // InvalidArgument, naming the values, when: param or grad is not float32;
  // their numels differ; a state tensor has the wrong dtype or numel, or a
  // name this optimizer does not use; AdamW state is partial (some of step,
  // exp_avg, exp_avg_sq missing). Nothing is modified on error.
  virtual absl::Status Step(BufferRef param, std::optional<ConstBufferRef> grad,
                            OptimizerState& state) const = 0;
};

// InvalidArgument, with PyTorch's checks: lr, momentum, weight_decay >= 0;
// nesterov needs momentum > 0 and dampening == 0.
absl::StatusOr<std::unique_ptr<Optimizer>> MakeSgd(const SgdOptions& options);

// InvalidArgument, with PyTorch's checks: lr, eps, weight_decay >= 0;
// 0 <= beta1, beta2 < 1.
absl::StatusOr<std::unique_ptr<Optimizer>> MakeAdamW(
    const AdamWOptions& options);

// MakeSgd or MakeAdamW.
absl::StatusOr<std::unique_ptr<Optimizer>> MakeOptimizer(
    const OptimizerOptions& options);

// The largest |change| AdamW's step t (1-based) makes to an element apart
// from weight decay, for any gradients, in exact arithmetic: lr * B_t with
//
//   B_t = (1 - beta1) sqrt(1 - beta2^t) / ((1 - beta1^t) sqrt(1 - beta2))
//         * sqrt(sum_{k=0}^{t-1} (beta1^2 / beta2)^k)
//
// by Cauchy-Schwarz on exp_avg = (1-beta1) sum_j beta1^(t-j) g_j against
// exp_avg_sq = (1-beta2) sum_j beta2^(t-j) g_j^2 (eps only shrinks the
// update). B_1 = 1; with the default betas B_t grows slowly (B_10 = 1.04,
// B_100 = 2.2) towards (1 - beta1) / sqrt((1 - beta2)(1 - beta1^2/beta2)) =
// 7.3.
// REQUIRES: step >= 1, 0 <= beta1 < 1, 0 < beta2 < 1.
double AdamWUpdateBound(const AdamWOptions& options, int64_t step);

// A bound on max |p - p'| over the elements of two AdamW runs of `steps`
// steps from the same parameters (max |p_0| <= max_abs_param) whatever
// gradients each run sees: sum over t of 2 lr B_t (the decoupled weight
// decay multiplies both runs by the same factor in (0, 1], which does not
// widen their difference), widened for float32 rounding by a relative
// 16 t 2^-24 on each update and 4 * 2^-24 * P per step, P bounding
// |p| (max_abs_param + sum_t lr B_t). It bounds, for example, how far
// mixed-precision training can drift from float32 training, whatever the
// model.
double AdamWDivergenceBound(const AdamWOptions& options, int64_t steps,
                            double max_abs_param);

}  // namespace refmodel
}  // namespace flatparam

#endif  // FLATPARAM_REFMODEL_OPTIMIZER_H_
