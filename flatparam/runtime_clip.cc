#include <cmath>
#include <limits>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"
#include "comm/communicator.h"
#include "flatparam/base/buffer.h"
#include "flatparam/base/dtype.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/device/device.h"
#include "flatparam/handle.h"
#include "flatparam/internal/on_stream.h"
#include "flatparam/internal/runtime_internal.h"
#include "flatparam/layout.h"
#include "flatparam/runtime.h"

// FsdpRuntime's gradient clipping (ClipGradNorm, as PyTorch FSDP's
// clip_grad_norm_) and the float32 norm arithmetic it needs.
// internal/runtime_internal.h lists the runtime's files.

namespace flatparam {

using internal_runtime::WithContext;

namespace {

using internal_handle::OnStream;

// ||x||_p of float32 values, accumulated in double and rounded to float32
// (torch.linalg.vector_norm(x, p, dtype=torch.float32)).
float VectorNorm(const std::vector<float>& x, double p) {
  if (std::isinf(p)) {
    float m = 0.0f;
    for (float v : x) {
      const float a = std::fabs(v);
      // NaN propagates, as torch's max reduction does.
      if (std::isnan(a) || a > m) m = a;
      if (std::isnan(m)) break;
    }
    return m;
  }
  double acc = 0.0;
  for (float v : x) {
    const double a = std::fabs(static_cast<double>(v));
    acc += p == 1.0 ? a : p == 2.0 ? a * a : std::pow(a, p);
  }
  const double norm = p == 1.0   ? acc
                      : p == 2.0 ? std::sqrt(acc)
                                 : std::pow(acc, 1.0 / p);
  return static_cast<float>(norm);
}

// x ** p for a float32 tensor and a Python float (torch's pow special-cases
// 1 and 2).
float PowF(float x, double p) {
  if (p == 1.0) return x;
  if (p == 2.0) return x * x;
  if (p == 0.5) return std::sqrt(x);
  return std::pow(x, static_cast<float>(p));
}

// `value` rounded to `dtype` (as `tensor.to(dtype)`), as a double.
double RoundToDType(float value, DType dtype) {
  unsigned char storage[8];
  HostCast(storage, dtype, &value, DType::kFloat32, 1);
  double out = 0;
  HostCast(&out, DType::kFloat64, storage, dtype, 1);
  return out;
}

}  // namespace

// ---------------------------------------------------------------------------
// Gradient clipping

absl::Status FsdpRuntime::AllReduceScalar(float* value, ReduceOp op) {
  ReduceOptions reduce;
  static_cast<CollectiveOptions&>(reduce) = options_.collective_options;
  reduce.op = op;
  const ScopedCollectiveContext context(recorder_,
                                        {"", -1, CollectivePhase::kGradNorm});
  const Device dev = device_->device();
  if (dev == Device::Host()) {
    const BufferRef buf{value, 1, DType::kFloat32, Device::Host()};
    return shard_group_->AllReduce(buf, buf, reduce)->Wait();
  }
  // Device backends (NCCL) reduce device buffers only.
  FLATPARAM_ASSIGN_OR_RETURN(DeviceBuffer staging,
                             device_->Allocate(dev, sizeof(float)));
  const BufferRef buf = staging.As(DType::kFloat32);
  const ConstBufferRef host{value, 1, DType::kFloat32, Device::Host()};
  FLATPARAM_RETURN_IF_ERROR(device_->Copy(buf, host));
  FLATPARAM_RETURN_IF_ERROR(device_->Synchronize());
  FLATPARAM_RETURN_IF_ERROR(shard_group_->AllReduce(buf, buf, reduce)->Wait());
  FLATPARAM_RETURN_IF_ERROR(
      device_->Copy(BufferRef{value, 1, DType::kFloat32, Device::Host()}, buf));
  return device_->Synchronize();
}

absl::StatusOr<double> FsdpRuntime::ClipGradNorm(double max_norm,
                                                 double norm_type) {
  // Any positive p, as clip_grad_norm_ takes it (0 < p < 1 is not a norm,
  // but the same formula).
  if (!(norm_type > 0.0)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "FsdpRuntime: ClipGradNorm: norm_type must be positive (or "
        "infinity), got %g",
        norm_type));
  }
  if (!(max_norm >= 0.0)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "FsdpRuntime: ClipGradNorm: max_norm must be >= 0, got %g", max_norm));
  }
  if (phase_ != Phase::kIdle) {
    return absl::FailedPreconditionError(
        "FsdpRuntime: ClipGradNorm: an iteration is in progress (call it "
        "after FinalizeBackward)");
  }
  const bool inf = std::isinf(norm_type);
  // The handles leave the sharded gradients ordered on their compute stream
  // (FinalizeBackward), where the optimizer runs too: read and scale there.
  OnStream on_compute(device_, handles_[0]->options().streams.compute);
  FLATPARAM_RETURN_IF_ERROR(on_compute.status());

  // 1. The gradients, as PyTorch's `param.grad` / `flat_param.grad`.
  std::vector<BufferRef> sharded, nonsharded;
  for (const auto& handle : handles_) {
    const FlatParamHandle& h = *handle;
    std::vector<BufferRef>& target =
        h.uses_sharded_strategy() ? sharded : nonsharded;
    if (h.layout().options().align_addresses) {
      for (int i = 0; i < static_cast<int>(h.layout().params().size()); ++i) {
        FLATPARAM_ASSIGN_OR_RETURN(std::optional<BufferRef> g,
                                   h.ShardedGradView(i));
        if (g.has_value()) target.push_back(*g);
      }
    } else if (std::optional<BufferRef> g = h.sharded_grad()) {
      target.push_back(*g);
    }
  }

  // 2. Local norms in float32.
  auto local_norm =
      [&](const std::vector<BufferRef>& grads) -> absl::StatusOr<float> {
    std::vector<float> norms;
    std::vector<float> values;
    std::vector<unsigned char> staging;
    for (const BufferRef& g : grads) {
      const void* host = g.data;
      if (g.device != Device::Host()) {
        staging.resize(g.bytes());
        FLATPARAM_RETURN_IF_ERROR(device_->Copy(
            BufferRef{staging.data(), g.count, g.dtype, Device::Host()}, g));
        host = staging.data();
      }
      values.resize(g.count);
      if (g.count > 0) {
        HostCast(values.data(), DType::kFloat32, host, g.dtype, g.count);
      }
      norms.push_back(VectorNorm(values, norm_type));
    }
    return VectorNorm(norms, norm_type);
  };
  FLATPARAM_ASSIGN_OR_RETURN(const float local_sharded, local_norm(sharded));
  FLATPARAM_ASSIGN_OR_RETURN(const float local_nonsharded,
                             local_norm(nonsharded));

  // 3. The total norm. All units share the layout's strategy; PyTorch
  // communicates only when some unit is sharded.
  const bool any_sharded = UsesShardedStrategy(layout_.options().strategy);
  float total = 0.0f;
  if (inf) {
    total = std::isnan(local_sharded) || local_sharded > local_nonsharded
                ? local_sharded
                : local_nonsharded;
    if (any_sharded) {
      FLATPARAM_RETURN_IF_ERROR(WithContext(
          AllReduceScalar(&total, ReduceOp::kMax),
          "FsdpRuntime: ClipGradNorm: all-reduce of the local norm"));
    }
  } else {
    total = PowF(local_sharded, norm_type);
    if (any_sharded) {
      FLATPARAM_RETURN_IF_ERROR(WithContext(
          AllReduceScalar(&total, ReduceOp::kSum),
          "FsdpRuntime: ClipGradNorm: all-reduce of the local norm"));
    }
    total += PowF(local_nonsharded, norm_type);
    total = PowF(total, 1.0 / norm_type);
  }

  // 4. `max_norm / (total + 1e-6)` is `(total + 1e-6).reciprocal() *
  // max_norm` for a tensor, in float32; then clamped to 1 (NaN stays NaN).
  const float denominator = total + 1e-6f;
  const float coef = (1.0f / denominator) * static_cast<float>(max_norm);
  const float clamped = coef > 1.0f ? 1.0f : coef;
  for (const std::vector<BufferRef>* grads : {&sharded, &nonsharded}) {
    for (const BufferRef& g : *grads) {
      if (g.count == 0) continue;
      if (std::isnan(clamped)) {
        // g * NaN is NaN everywhere; DeviceOps::Scale takes finite factors.
        FLATPARAM_RETURN_IF_ERROR(
            device_->Fill(g, std::numeric_limits<double>::quiet_NaN()));
        continue;
      }
      FLATPARAM_RETURN_IF_ERROR(device_->Scale(g, ScaleOp::kMultiply,
                                               RoundToDType(clamped, g.dtype)));
    }
  }
  FLATPARAM_RETURN_IF_ERROR(device_->Synchronize());
  return static_cast<double>(total);
}

}  // namespace flatparam
