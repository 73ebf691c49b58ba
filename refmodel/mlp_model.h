// A small reference model with a hand-written forward and backward, for
// proving that sharded (FSDP) training computes exactly what single-process
// training computes.
//
// The model is a per-token MLP language model with a tied output head:
//
//   h_0      = E[token]                                   E: [vocab, d_0]
//   h_{i+1}  = tanh(W_i h_i + b_i)        W_i: [d_{(i+1) % L}, d_i], i < L
//   logits   = E h_L + head_bias                          head_bias: [vocab]
//   loss     = mean over the batch of (logsumexp(logits) - logits[target])
//
// where L = config.dims.size() is the number of layers and d_i = dims[i]; the
// last layer maps back to d_0 so that the head can reuse E ("head.weight" is
// tied to "embed.weight"). Everything is float32 (a double twin exists for
// gradient checks) and uses only IEEE basic operations and std::tanh,
// std::exp, std::log, so a binary computes the same bits every time.
//
// Parameters, in module traversal order (what `Spec()` returns):
//
//   embed.weight            [vocab, d_0]        unit "" (the root)
//   layers.{i}.fc.weight    [d_{(i+1)%L}, d_i]  unit "layers.{i}"
//   layers.{i}.fc.bias      [d_{(i+1)%L}]       unit "layers.{i}"
//   head.weight             tied to embed.weight, unit ""
//   head.bias               [vocab]             unit ""
//
// The model never owns parameters or gradients: it reads and writes them
// through a ParamAccess, bracketing each unit's use with BeginUnit/EndUnit
// so that an FSDP runtime can unshard and reshard around it. See
// ReferenceModel::ForwardBackward for the exact call sequence.
//
// Thread-safety: ReferenceModel is immutable after Create; concurrent
// ForwardBackward calls are safe with distinct ParamAccess objects.
#ifndef FLATPARAM_REFMODEL_MODEL_H_
#define FLATPARAM_REFMODEL_MODEL_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "flatparam/base/dtype.h"
#include "flatparam/base/splitmix64.h"
#include "flatparam/flatten.h"
#include "flatparam/model_layout.h"

namespace flatparam {
namespace refmodel {

// The model's shape and initialisation seed.
struct Config {
  int64_t vocab = 17;
  // Layer widths; dims[0] is the embedding width and layer i maps dims[i] to
  // dims[(i + 1) % dims.size()]. One layer per entry. Awkward sizes by
  // default, so that flat parameters straddle shard boundaries.
  std::vector<int64_t> dims = {13, 37, 29};
  // Seeds InitParams.
  uint64_t seed = 0;

  int num_layers() const { return static_cast<int>(dims.size()); }
};

// A batch of independent samples: sample n predicts targets[n] from
// tokens[n]. The loss is the mean over the samples.
struct Batch {
  std::vector<int32_t> tokens;
  std::vector<int32_t> targets;

  int64_t size() const { return static_cast<int64_t>(tokens.size()); }
};

// Samples [first_sample, first_sample + num_samples) of micro-batch
// `micro_batch` of training step `step`. Every sample is a pure function of
// (data_seed, step, micro_batch, sample index), so the global batch of a step
// is the concatenation of the ranks' local batches by construction: rank r
// of W with local size B takes first_sample = r * B. The target is a fixed
// function of the token (learnable) chosen from `vocab` classes.
// REQUIRES: vocab >= 1, num_samples >= 0.
Batch MakeBatch(uint64_t data_seed, int64_t vocab, int64_t step,
                int64_t micro_batch, int64_t first_sample, int64_t num_samples);

// Which pass of a step a unit is used in.
enum class Phase { kForward, kBackward };

// "forward" or "backward".
absl::string_view PhaseName(Phase phase);

// How the model reaches its parameters and gradients: the seam where an FSDP
// runtime plugs in. T is float for training and double for the gradient
// check twin.
//
// Contract:
//   * Param(fqn) / Grad(fqn) are called only for parameters of units that are
//     open (between BeginUnit and EndUnit of the same phase); Grad only in
//     the backward phase.
//   * The returned pointers address the parameter's full, unsharded,
//     row-major data and stay valid until EndUnit of the owning unit in the
//     current phase; the model asks again after every BeginUnit.
//   * Grad(fqn) returns the gradient the model accumulates into (+=); it must
//     hold the gradient accumulated so far (zeros for a fresh step).
//   * The model asks for "embed.weight" for both uses of the tied embedding;
//     it never asks for "head.weight".
//   * A non-OK status from any call is returned by ForwardBackward at once,
//     without further calls (no EndUnit for open units).
template <typename T>
class BasicParamAccess {
 public:
  virtual ~BasicParamAccess() = default;

  virtual absl::StatusOr<const T*> Param(absl::string_view fqn) = 0;
  virtual absl::StatusOr<T*> Grad(absl::string_view fqn) = 0;
  // `unit` is "" for the root or "layers.{i}".
  virtual absl::Status BeginUnit(absl::string_view unit, Phase phase) = 0;
  virtual absl::Status EndUnit(absl::string_view unit, Phase phase) = 0;
};

using ParamAccess = BasicParamAccess<float>;

// The DType matching T (kFloat32 for float, kFloat64 for double).
template <typename T>
constexpr DType DTypeOf();
template <>
constexpr DType DTypeOf<float>() {
  return DType::kFloat32;
}
template <>
constexpr DType DTypeOf<double>() {
  return DType::kFloat64;
}

// A ParamAccess over maps from fqn to HostTensor, for single-process use.
// Neither map is owned; both must outlive this object. Parameters must have
// dtype DTypeOf<T>(). Grad(fqn) inserts a zero tensor shaped like the
// parameter when `grads` has none. BeginUnit/EndUnit do nothing. Not
// thread-safe.
template <typename T>
class BasicMapParamAccess final : public BasicParamAccess<T> {
 public:
  BasicMapParamAccess(const std::map<std::string, HostTensor>* params,
                      std::map<std::string, HostTensor>* grads)
      : params_(params), grads_(grads) {}

  // NotFound for an fqn missing from `params`; InvalidArgument for a tensor
  // of the wrong dtype, or an existing gradient whose dtype or numel differs
  // from the parameter's.
  absl::StatusOr<const T*> Param(absl::string_view fqn) override;
  absl::StatusOr<T*> Grad(absl::string_view fqn) override;
  absl::Status BeginUnit(absl::string_view unit, Phase phase) override {
    return absl::OkStatus();
  }
  absl::Status EndUnit(absl::string_view unit, Phase phase) override {
    return absl::OkStatus();
  }

 private:
  absl::StatusOr<const HostTensor*> FindParam(absl::string_view fqn) const;

  const std::map<std::string, HostTensor>* params_;
  std::map<std::string, HostTensor>* grads_;
};

using MapParamAccess = BasicMapParamAccess<float>;

// The reference model for one Config. See the file comment.
class ReferenceModel {
 public:
  // InvalidArgument, naming the value, for vocab < 1, no layers, or a
  // dimension < 1.
  static absl::StatusOr<ReferenceModel> Create(Config config);

  const Config& config() const { return config_; }

  // The parameters in module traversal order (names and shapes as in the
  // file comment, float32) and wrap = {"layers.0", ..., "layers.{L-1}"}.
  // Spec name: "reference_mlp".
  const ModelSpec& spec() const { return spec_; }

  // The model's own (non-tied) parameters, float32, initialised from
  // config().seed: parameter k of spec() (tied ones skipped) draws its
  // elements in row-major order from splitmix64 seeded with
  // splitmix64(seed) ^ (k + 1); element = (2u - 1) * a rounded to float,
  // u = (x >> 40) * 2^-24, with a = 1 for embed.weight and 1/sqrt(fan_in)
  // for the rest (fan_in = d_i for layer i, d_0 for head.bias).
  std::map<std::string, HostTensor> InitParams() const;

  // Checks that `params` holds exactly the non-tied parameters with their
  // shapes and `dtype`. InvalidArgument naming the parameter otherwise.
  absl::Status CheckParams(const std::map<std::string, HostTensor>& params,
                           DType dtype = DType::kFloat32) const;

  // InvalidArgument for an empty batch, mismatched lengths, or a token or
  // target outside [0, vocab), naming the sample and value.
  absl::Status CheckBatch(const Batch& batch) const;

  // Runs forward and backward on `batch`; returns the mean loss over the
  // batch and ACCUMULATES (+=) into each parameter's gradient the gradient
  // of that mean (so averaging the ranks' gradients gives the gradient of the
  // global mean).
  //
  // Call sequence on `access` (L layers):
  //
  //   BeginUnit("", kForward)          Param("embed.weight")   [lookup]
  //   for i in 0..L-1:
  //     BeginUnit("layers.i", kForward)
  //       Param("layers.i.fc.weight"), Param("layers.i.fc.bias")
  //     EndUnit("layers.i", kForward)
  //   Param("embed.weight"), Param("head.bias")                [head, loss]
  //   EndUnit("", kForward)
  //   BeginUnit("", kBackward)
  //     Param("embed.weight"); Grad("head.bias") += ...        [head]
  //   for i in L-1..0:
  //     BeginUnit("layers.i", kBackward)
  //       Param("layers.i.fc.weight")
  //       Grad("layers.i.fc.weight") += ..., Grad("layers.i.fc.bias") += ...
  //     EndUnit("layers.i", kBackward)
  //   Grad("embed.weight") += (head part + embedding part)     [embedding]
  //   EndUnit("", kBackward)
  //
  // With `recompute_layers` (activation checkpointing of each layer, as
  // PyTorch's non-reentrant `checkpoint` runs it), each layer's forward runs
  // again inside its backward, on the layer's saved input, and the backward
  // uses the recomputed output (bitwise the first one):
  //     BeginUnit("layers.i", kBackward)
  //       BeginUnit("layers.i", kForward)
  //         Param("layers.i.fc.weight"), Param("layers.i.fc.bias")
  //       EndUnit("layers.i", kForward)
  //       Param("layers.i.fc.weight"); Grad(...) += ...
  //     EndUnit("layers.i", kBackward)
  //
  // As in FSDP, the root is expected to stay unsharded from
  // BeginUnit("", kForward) to EndUnit("", kBackward); the model does not
  // rely on it (it asks again after BeginUnit("", kBackward)).
  //
  // Arithmetic (T = float or double, every operation rounded to T, no fused
  // multiply-add; sums are left folds from T(0) in increasing index order):
  //   layer:  y[o] = tanh((sum over k of W[o][k] * x[k]) + b[o])
  //   head:   z[j] = (sum over k of h_L[k] * E[j][k]) + head_bias[j]
  //   loss_n  = (m + log(s)) - z[target_n], m = max_j z[j],
  //             e[j] = exp(z[j] - m), s = sum over j of e[j]
  //   p[n][j] = e[j] / s;  loss = (sum over n of loss_n) / T(N)
  //   dlogits[n][j] = (p[n][j] - [j == target_n]) / T(N)
  //   head part of dE[j][k]  = sum over n of dlogits[n][j] * h_L[n][k]
  //   dhead_bias[j]          = sum over n of dlogits[n][j]
  //   dz = dh * (T(1) - y * y);  dW[o][k] = sum over n of dz[n][o] * h[n][k];
  //   db[o] = sum over n of dz[n][o]; dh_prev[n][k] = sum over o of
  //   dz[n][o] * W[o][k]
  //   dE = head part, then dE[token_n] += dh_0[n] for n = 0..N-1 in order.
  // Each parameter's batch gradient is complete before it is added to its
  // gradient buffer with one addition per element (grad[i] += g[i]), as
  // autograd's AccumulateGrad does, so accumulating micro-batches into one
  // buffer (no_sync) adds whole micro-batch gradients.
  //
  // Errors: CheckBatch's, and any error `access` returns.
  template <typename T>
  absl::StatusOr<T> ForwardBackward(const Batch& batch,
                                    BasicParamAccess<T>& access,
                                    bool recompute_layers = false) const;

 private:
  explicit ReferenceModel(Config config);

  Config config_;
  ModelSpec spec_;
  // InitParams' bound `a` for each element of spec_.params.
  std::vector<double> init_bound_;
};

// ReferenceModel::Create(config)->spec(), for callers that only need the
// parameter list.
absl::StatusOr<ModelSpec> Spec(const Config& config);

// Parameter names. LayerWeightName(2) == "layers.2.fc.weight".
inline constexpr absl::string_view kEmbedWeight = "embed.weight";
inline constexpr absl::string_view kHeadWeight = "head.weight";
inline constexpr absl::string_view kHeadBias = "head.bias";
std::string LayerUnit(int layer);
std::string LayerWeightName(int layer);
std::string LayerBiasName(int layer);

// splitmix64's output function applied to `state + golden ratio`: a 64-bit
// mixing function with a fixed, documented definition (base/splitmix64.h).
using ::flatparam::SplitMix64;

}  // namespace refmodel
}  // namespace flatparam

#endif  // FLATPARAM_REFMODEL_MODEL_H_
