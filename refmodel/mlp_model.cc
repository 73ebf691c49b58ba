#include "refmodel/mlp_model.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "flatparam/base/shape.h"
#include "flatparam/base/status_macros.h"

namespace flatparam {
namespace refmodel {
namespace {

// A row-major [rows, cols] matrix of T owned by the model's scratch space.
template <typename T>
struct Matrix {
  int64_t rows = 0;
  int64_t cols = 0;
  std::vector<T> data;

  Matrix() = default;
  Matrix(int64_t r, int64_t c)
      : rows(r), cols(c), data(static_cast<size_t>(r * c), T(0)) {}
  T* row(int64_t r) { return data.data() + r * cols; }
  const T* row(int64_t r) const { return data.data() + r * cols; }
};

// grad[i] += g[i]: the single accumulation each parameter gets per call.
template <typename T>
void Accumulate(T* grad, const std::vector<T>& g) {
  for (size_t i = 0; i < g.size(); ++i) grad[i] += g[i];
}

}  // namespace

std::string LayerUnit(int layer) { return absl::StrCat("layers.", layer); }
std::string LayerWeightName(int layer) {
  return absl::StrCat("layers.", layer, ".fc.weight");
}
std::string LayerBiasName(int layer) {
  return absl::StrCat("layers.", layer, ".fc.bias");
}

absl::string_view PhaseName(Phase phase) {
  return phase == Phase::kForward ? "forward" : "backward";
}

Batch MakeBatch(uint64_t data_seed, int64_t vocab, int64_t step,
                int64_t micro_batch, int64_t first_sample,
                int64_t num_samples) {
  assert(vocab >= 1 && num_samples >= 0);
  Batch batch;
  batch.tokens.reserve(static_cast<size_t>(num_samples));
  batch.targets.reserve(static_cast<size_t>(num_samples));
  const uint64_t base = SplitMix64(
      SplitMix64(SplitMix64(data_seed) ^ static_cast<uint64_t>(step)) ^
      static_cast<uint64_t>(micro_batch));
  const uint64_t v = static_cast<uint64_t>(vocab);
  for (int64_t n = 0; n < num_samples; ++n) {
    const uint64_t h =
        SplitMix64(base ^ static_cast<uint64_t>(first_sample + n));
    const uint64_t token = h % v;
    batch.tokens.push_back(static_cast<int32_t>(token));
    batch.targets.push_back(static_cast<int32_t>((5 * token + 3) % v));
  }
  return batch;
}

// --- BasicMapParamAccess ---------------------------------------------------

template <typename T>
absl::StatusOr<const HostTensor*> BasicMapParamAccess<T>::FindParam(
    absl::string_view fqn) const {
  auto it = params_->find(std::string(fqn));
  if (it == params_->end()) {
    return absl::NotFoundError(
        absl::StrFormat("no parameter \"%s\" in the parameter map", fqn));
  }
  if (it->second.dtype() != DTypeOf<T>()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "parameter \"%s\" has dtype %s, expected %s", fqn,
        DTypeName(it->second.dtype()), DTypeName(DTypeOf<T>())));
  }
  return &it->second;
}

template <typename T>
absl::StatusOr<const T*> BasicMapParamAccess<T>::Param(absl::string_view fqn) {
  FLATPARAM_ASSIGN_OR_RETURN(const HostTensor* p, FindParam(fqn));
  return p->template data_as<T>();
}

template <typename T>
absl::StatusOr<T*> BasicMapParamAccess<T>::Grad(absl::string_view fqn) {
  FLATPARAM_ASSIGN_OR_RETURN(const HostTensor* p, FindParam(fqn));
  auto [it, inserted] =
      grads_->try_emplace(std::string(fqn), DTypeOf<T>(), p->shape());
  HostTensor& g = it->second;
  if (!inserted && (g.dtype() != DTypeOf<T>() || g.numel() != p->numel())) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "gradient of \"%s\" has dtype %s and %d elements; the parameter has "
        "dtype %s and %d elements",
        fqn, DTypeName(g.dtype()), g.numel(), DTypeName(DTypeOf<T>()),
        p->numel()));
  }
  return g.template data_as<T>();
}

template class BasicMapParamAccess<float>;
template class BasicMapParamAccess<double>;

// --- ReferenceModel --------------------------------------------------------

ReferenceModel::ReferenceModel(Config config) : config_(std::move(config)) {
  const int layers = config_.num_layers();
  const std::vector<int64_t>& d = config_.dims;
  spec_.name = "reference_mlp";
  // Initialisation bounds: 1 for the embedding, 1/sqrt(fan_in) otherwise.
  auto add = [&](ParamSpec p, double fan_in) {
    spec_.params.push_back(std::move(p));
    init_bound_.push_back(fan_in > 0 ? 1.0 / std::sqrt(fan_in) : 1.0);
  };
  add({std::string(kEmbedWeight), {config_.vocab, d[0]}, DType::kFloat32}, 0);
  for (int i = 0; i < layers; ++i) {
    const int64_t in = d[i];
    const int64_t out = d[(i + 1) % layers];
    add({LayerWeightName(i), {out, in}, DType::kFloat32},
        static_cast<double>(in));
    add({LayerBiasName(i), {out}, DType::kFloat32}, static_cast<double>(in));
    spec_.wrap.push_back(LayerUnit(i));
  }
  ParamSpec head;
  head.fqn = std::string(kHeadWeight);
  head.tied_to = std::string(kEmbedWeight);
  add(head, 0);
  add({std::string(kHeadBias), {config_.vocab}, DType::kFloat32},
      static_cast<double>(d[0]));
}

absl::StatusOr<ReferenceModel> ReferenceModel::Create(Config config) {
  if (config.vocab < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("vocab must be >= 1, got %d", config.vocab));
  }
  if (config.dims.empty()) {
    return absl::InvalidArgumentError("dims is empty: the model needs a layer");
  }
  for (size_t i = 0; i < config.dims.size(); ++i) {
    if (config.dims[i] < 1) {
      return absl::InvalidArgumentError(
          absl::StrFormat("dims[%d] must be >= 1, got %d", i, config.dims[i]));
    }
  }
  return ReferenceModel(std::move(config));
}

absl::StatusOr<ModelSpec> Spec(const Config& config) {
  FLATPARAM_ASSIGN_OR_RETURN(ReferenceModel model,
                             ReferenceModel::Create(config));
  return model.spec();
}

std::map<std::string, HostTensor> ReferenceModel::InitParams() const {
  std::map<std::string, HostTensor> params;
  const uint64_t seed_mix = SplitMix64(config_.seed);
  uint64_t k = 0;
  for (size_t index = 0; index < spec_.params.size(); ++index) {
    const ParamSpec& p = spec_.params[index];
    if (!p.tied_to.empty()) continue;
    ++k;
    const double a = init_bound_[index];
    HostTensor t(DType::kFloat32, p.shape);
    float* data = t.data_as<float>();
    uint64_t state = seed_mix ^ k;
    for (int64_t i = 0; i < t.numel(); ++i) {
      const uint64_t x = SplitMix64Next(&state);
      const double u = static_cast<double>(x >> 40) * 0x1p-24;
      data[i] = static_cast<float>((2.0 * u - 1.0) * a);
    }
    params.emplace(p.fqn, std::move(t));
  }
  return params;
}

absl::Status ReferenceModel::CheckParams(
    const std::map<std::string, HostTensor>& params, DType dtype) const {
  size_t expected = 0;
  for (const ParamSpec& p : spec_.params) {
    if (!p.tied_to.empty()) continue;
    ++expected;
    auto it = params.find(p.fqn);
    if (it == params.end()) {
      return absl::InvalidArgumentError(
          absl::StrFormat("parameter \"%s\" is missing", p.fqn));
    }
    const HostTensor& t = it->second;
    if (t.dtype() != dtype || t.shape() != p.shape) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "parameter \"%s\" has dtype %s and shape %s; expected %s and %s",
          p.fqn, DTypeName(t.dtype()), ShapeString(t.shape()), DTypeName(dtype),
          ShapeString(p.shape)));
    }
  }
  if (params.size() != expected) {
    for (const auto& [name, t] : params) {
      bool known = false;
      for (const ParamSpec& p : spec_.params) {
        known |= p.tied_to.empty() && p.fqn == name;
      }
      if (!known) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "\"%s\" is not a parameter of the model (tied parameters such as "
            "\"%s\" are not listed separately)",
            name, kHeadWeight));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status ReferenceModel::CheckBatch(const Batch& batch) const {
  if (batch.tokens.empty()) {
    return absl::InvalidArgumentError("the batch is empty");
  }
  if (batch.tokens.size() != batch.targets.size()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("the batch has %d tokens but %d targets",
                        batch.tokens.size(), batch.targets.size()));
  }
  for (size_t n = 0; n < batch.tokens.size(); ++n) {
    for (int32_t v : {batch.tokens[n], batch.targets[n]}) {
      if (v < 0 || v >= config_.vocab) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "sample %d has token %d and target %d; both must be in [0, %d)", n,
            batch.tokens[n], batch.targets[n], config_.vocab));
      }
    }
  }
  return absl::OkStatus();
}

namespace {

// Layer i's forward on its input `x`: y[o] = tanh(W x + b), into `y`.
template <typename T>
void LayerForward(const T* w, const T* b, const Matrix<T>& x, int64_t in,
                  int64_t out, Matrix<T>& y) {
  for (int64_t n = 0; n < x.rows; ++n) {
    const T* xn = x.row(n);
    for (int64_t o = 0; o < out; ++o) {
      T acc = T(0);
      for (int64_t k = 0; k < in; ++k) acc += w[o * in + k] * xn[k];
      y.row(n)[o] = std::tanh(acc + b[o]);
    }
  }
}

}  // namespace

template <typename T>
absl::StatusOr<T> ReferenceModel::ForwardBackward(const Batch& batch,
                                                  BasicParamAccess<T>& access,
                                                  bool recompute_layers) const {
  FLATPARAM_RETURN_IF_ERROR(CheckBatch(batch));
  const int layers = config_.num_layers();
  const std::vector<int64_t>& d = config_.dims;
  const int64_t n_samples = batch.size();
  const int64_t vocab = config_.vocab;
  const std::string root;

  // ---- Forward. h[i] is the input of layer i; h[layers] feeds the head.
  std::vector<Matrix<T>> h;
  h.reserve(layers + 1);
  FLATPARAM_RETURN_IF_ERROR(access.BeginUnit(root, Phase::kForward));
  {
    FLATPARAM_ASSIGN_OR_RETURN(const T* embed, access.Param(kEmbedWeight));
    Matrix<T>& h0 = h.emplace_back(n_samples, d[0]);
    for (int64_t n = 0; n < n_samples; ++n) {
      std::copy_n(embed + batch.tokens[n] * d[0], d[0], h0.row(n));
    }
  }
  for (int i = 0; i < layers; ++i) {
    const std::string unit = LayerUnit(i);
    const int64_t in = d[i];
    const int64_t out = d[(i + 1) % layers];
    FLATPARAM_RETURN_IF_ERROR(access.BeginUnit(unit, Phase::kForward));
    FLATPARAM_ASSIGN_OR_RETURN(const T* w, access.Param(LayerWeightName(i)));
    FLATPARAM_ASSIGN_OR_RETURN(const T* b, access.Param(LayerBiasName(i)));
    Matrix<T> next(n_samples, out);
    LayerForward(w, b, h[i], in, out, next);
    h.push_back(std::move(next));
    FLATPARAM_RETURN_IF_ERROR(access.EndUnit(unit, Phase::kForward));
  }
  const Matrix<T>& h_last = h[layers];
  // probs holds softmax(logits) after the loop.
  Matrix<T> probs(n_samples, vocab);
  T loss_sum = T(0);
  {
    FLATPARAM_ASSIGN_OR_RETURN(const T* embed, access.Param(kEmbedWeight));
    FLATPARAM_ASSIGN_OR_RETURN(const T* head_bias, access.Param(kHeadBias));
    for (int64_t n = 0; n < n_samples; ++n) {
      T* z = probs.row(n);
      for (int64_t j = 0; j < vocab; ++j) {
        T acc = T(0);
        for (int64_t k = 0; k < d[0]; ++k) {
          acc += h_last.row(n)[k] * embed[j * d[0] + k];
        }
        z[j] = acc + head_bias[j];
      }
      T max = z[0];
      for (int64_t j = 1; j < vocab; ++j) max = std::max(max, z[j]);
      const T target_logit = z[batch.targets[n]];
      T sum = T(0);
      for (int64_t j = 0; j < vocab; ++j) {
        z[j] = std::exp(z[j] - max);
        sum += z[j];
      }
      loss_sum += (max + std::log(sum)) - target_logit;
      for (int64_t j = 0; j < vocab; ++j) z[j] = z[j] / sum;
    }
  }
  const T loss = loss_sum / static_cast<T>(n_samples);
  FLATPARAM_RETURN_IF_ERROR(access.EndUnit(root, Phase::kForward));

  // ---- Backward.
  FLATPARAM_RETURN_IF_ERROR(access.BeginUnit(root, Phase::kBackward));
  // probs becomes dlogits in place.
  for (int64_t n = 0; n < n_samples; ++n) {
    T* g = probs.row(n);
    for (int64_t j = 0; j < vocab; ++j) {
      const T one_hot = j == batch.targets[n] ? T(1) : T(0);
      g[j] = (g[j] - one_hot) / static_cast<T>(n_samples);
    }
  }
  const Matrix<T>& dlogits = probs;
  std::vector<T> d_embed(static_cast<size_t>(vocab * d[0]), T(0));
  Matrix<T> dh(n_samples, d[0]);  // gradient w.r.t. h[layers]
  {
    FLATPARAM_ASSIGN_OR_RETURN(const T* embed, access.Param(kEmbedWeight));
    for (int64_t j = 0; j < vocab; ++j) {
      for (int64_t k = 0; k < d[0]; ++k) {
        T acc = T(0);
        for (int64_t n = 0; n < n_samples; ++n) {
          acc += dlogits.row(n)[j] * h_last.row(n)[k];
        }
        d_embed[j * d[0] + k] = acc;
      }
    }
    std::vector<T> d_head_bias(static_cast<size_t>(vocab));
    for (int64_t j = 0; j < vocab; ++j) {
      T acc = T(0);
      for (int64_t n = 0; n < n_samples; ++n) acc += dlogits.row(n)[j];
      d_head_bias[j] = acc;
    }
    for (int64_t n = 0; n < n_samples; ++n) {
      for (int64_t k = 0; k < d[0]; ++k) {
        T acc = T(0);
        for (int64_t j = 0; j < vocab; ++j) {
          acc += dlogits.row(n)[j] * embed[j * d[0] + k];
        }
        dh.row(n)[k] = acc;
      }
    }
    FLATPARAM_ASSIGN_OR_RETURN(T * grad, access.Grad(kHeadBias));
    Accumulate(grad, d_head_bias);
  }
  for (int i = layers - 1; i >= 0; --i) {
    const std::string unit = LayerUnit(i);
    const int64_t in = d[i];
    const int64_t out = d[(i + 1) % layers];
    FLATPARAM_RETURN_IF_ERROR(access.BeginUnit(unit, Phase::kBackward));
    std::optional<Matrix<T>> recomputed;
    if (recompute_layers) {
      FLATPARAM_RETURN_IF_ERROR(access.BeginUnit(unit, Phase::kForward));
      FLATPARAM_ASSIGN_OR_RETURN(const T* rw, access.Param(LayerWeightName(i)));
      FLATPARAM_ASSIGN_OR_RETURN(const T* rb, access.Param(LayerBiasName(i)));
      recomputed.emplace(n_samples, out);
      LayerForward(rw, rb, h[i], in, out, *recomputed);
      FLATPARAM_RETURN_IF_ERROR(access.EndUnit(unit, Phase::kForward));
    }
    FLATPARAM_ASSIGN_OR_RETURN(const T* w, access.Param(LayerWeightName(i)));
    // dh becomes dz in place: dz = dh * tanh'(.) = dh * (1 - y^2).
    const Matrix<T>& y = recomputed ? *recomputed : h[i + 1];
    for (int64_t n = 0; n < n_samples; ++n) {
      for (int64_t o = 0; o < out; ++o) {
        const T yv = y.row(n)[o];
        dh.row(n)[o] = dh.row(n)[o] * (T(1) - yv * yv);
      }
    }
    const Matrix<T>& dz = dh;
    const Matrix<T>& x = h[i];
    std::vector<T> dw(static_cast<size_t>(out * in));
    std::vector<T> db(static_cast<size_t>(out));
    for (int64_t o = 0; o < out; ++o) {
      for (int64_t k = 0; k < in; ++k) {
        T acc = T(0);
        for (int64_t n = 0; n < n_samples; ++n) {
          acc += dz.row(n)[o] * x.row(n)[k];
        }
        dw[o * in + k] = acc;
      }
      T acc = T(0);
      for (int64_t n = 0; n < n_samples; ++n) acc += dz.row(n)[o];
      db[o] = acc;
    }
    Matrix<T> dx(n_samples, in);
    for (int64_t n = 0; n < n_samples; ++n) {
      for (int64_t k = 0; k < in; ++k) {
        T acc = T(0);
        for (int64_t o = 0; o < out; ++o) acc += dz.row(n)[o] * w[o * in + k];
        dx.row(n)[k] = acc;
      }
    }
    dh = std::move(dx);
    FLATPARAM_ASSIGN_OR_RETURN(T * grad_w, access.Grad(LayerWeightName(i)));
    Accumulate(grad_w, dw);
    FLATPARAM_ASSIGN_OR_RETURN(T * grad_b, access.Grad(LayerBiasName(i)));
    Accumulate(grad_b, db);
    FLATPARAM_RETURN_IF_ERROR(access.EndUnit(unit, Phase::kBackward));
  }
  // The embedding's own use, added after the head's in sample order.
  for (int64_t n = 0; n < n_samples; ++n) {
    T* row = d_embed.data() + batch.tokens[n] * d[0];
    for (int64_t k = 0; k < d[0]; ++k) row[k] += dh.row(n)[k];
  }
  FLATPARAM_ASSIGN_OR_RETURN(T * grad_embed, access.Grad(kEmbedWeight));
  Accumulate(grad_embed, d_embed);
  FLATPARAM_RETURN_IF_ERROR(access.EndUnit(root, Phase::kBackward));
  return loss;
}

template absl::StatusOr<float> ReferenceModel::ForwardBackward<float>(
    const Batch&, BasicParamAccess<float>&, bool) const;
template absl::StatusOr<double> ReferenceModel::ForwardBackward<double>(
    const Batch&, BasicParamAccess<double>&, bool) const;

}  // namespace refmodel
}  // namespace flatparam
