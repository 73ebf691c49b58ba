#include "refmodel/fsdp_trainer.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <utility>

#include "absl/strings/str_format.h"
#include "comm/communicator.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/handle.h"
#include "flatparam/runtime.h"

namespace flatparam {
namespace refmodel {
namespace {

using TensorMap = std::map<std::string, HostTensor>;

absl::Status WithContext(const absl::Status& status, absl::string_view what) {
  if (status.ok()) return status;
  return absl::Status(status.code(),
                      absl::StrFormat("%s: %s", what, status.message()));
}

// ---------------------------------------------------------------------------
// Host staging.

// `src` (host or compute device, any floating dtype) as float32 in `out`.
absl::Status ToHostFloat(DeviceOps& device, ConstBufferRef src,
                         std::vector<float>& out) {
  out.resize(src.count);
  if (src.count == 0) return absl::OkStatus();
  std::vector<unsigned char> staging;
  const void* host = src.data;
  if (src.device != Device::Host()) {
    staging.resize(src.bytes());
    FLATPARAM_RETURN_IF_ERROR(device.Copy(
        BufferRef{staging.data(), src.count, src.dtype, Device::Host()}, src));
    host = staging.data();
  }
  HostCast(out.data(), DType::kFloat32, host, src.dtype, src.count);
  return absl::OkStatus();
}

// Copies host `src` into `dst` (host or compute device; same count and
// dtype).
absl::Status FromHost(DeviceOps& device, ConstBufferRef src, BufferRef dst) {
  if (dst.device == Device::Host()) {
    if (src.count > 0) std::memcpy(dst.data, src.data, src.bytes());
    return absl::OkStatus();
  }
  FLATPARAM_RETURN_IF_ERROR(device.Copy(dst, src));
  return device.Synchronize();
}

// All-gathers the host buffer `in` over `comm` into the host buffer `out`,
// through compute-device staging when the compute device is not the host
// (NCCL takes device buffers only).
absl::Status AllGatherHost(Communicator& comm, DeviceOps& device,
                           ConstBufferRef in, BufferRef out,
                           const CollectiveOptions& options,
                           absl::string_view what) {
  if (device.device() == Device::Host()) {
    return WithContext(comm.AllGather(in, out, options)->Wait(), what);
  }
  FLATPARAM_ASSIGN_OR_RETURN(DeviceBuffer din,
                             device.Allocate(device.device(), in.bytes()));
  FLATPARAM_ASSIGN_OR_RETURN(DeviceBuffer dout,
                             device.Allocate(device.device(), out.bytes()));
  const BufferRef din_ref = din.As(in.dtype).Slice(0, in.count);
  const BufferRef dout_ref = dout.As(out.dtype).Slice(0, out.count);
  FLATPARAM_RETURN_IF_ERROR(device.Copy(din_ref, in));
  FLATPARAM_RETURN_IF_ERROR(device.Synchronize());
  FLATPARAM_RETURN_IF_ERROR(
      WithContext(comm.AllGather(din_ref, dout_ref, options)->Wait(), what));
  return device.Copy(out, dout_ref);
}

// A host copy of `buf` (host or compute device).
absl::StatusOr<HostTensor> ToHostTensor(DeviceOps& device, ConstBufferRef buf) {
  HostTensor t = HostTensor::Flat(buf.dtype, buf.count);
  if (buf.count == 0) return t;
  if (buf.device == Device::Host()) {
    std::memcpy(t.data(), buf.data, buf.bytes());
  } else {
    FLATPARAM_RETURN_IF_ERROR(device.Copy(
        BufferRef{t.data(), buf.count, buf.dtype, Device::Host()}, buf));
  }
  return t;
}

// ---------------------------------------------------------------------------
// Layout helpers.

// [begin, end) ranges of `rank`'s shard that hold padding: alignment and
// world-size padding segments, and the right padding past the flat
// parameter.
std::vector<std::pair<int64_t, int64_t>> PaddingRanges(
    const FlatParamLayout& layout, int rank) {
  const bool sharded = UsesShardedStrategy(layout.options().strategy);
  const int64_t chunk = layout.sharded_numel();
  const int64_t begin = sharded ? rank * chunk : 0;
  const int64_t end = begin + chunk;
  std::vector<std::pair<int64_t, int64_t>> ranges;
  auto add = [&](int64_t lo, int64_t hi) {
    lo = std::max(lo, begin);
    hi = std::min(hi, end);
    if (lo < hi) ranges.emplace_back(lo - begin, hi - begin);
  };
  int64_t offset = 0;
  for (size_t s = 0; s < layout.numels_with_padding().size(); ++s) {
    const int64_t n = layout.numels_with_padding()[s];
    if (layout.is_padding_mask()[s]) add(offset, offset + n);
    offset += n;
  }
  add(layout.unpadded_unsharded_numel(), end);
  return ranges;
}

// Unflattens a gathered flat tensor into one tensor per parameter, shaped
// like it, into `out` by fqn.
absl::Status UnflattenInto(const FlatParamLayout& layout,
                           const HostTensor& flat, TensorMap& out) {
  std::vector<HostTensor> tensors;
  for (const ParamInfo& p : layout.params()) {
    tensors.emplace_back(flat.dtype(), p.shape);
  }
  std::vector<BufferRef> refs;
  for (HostTensor& t : tensors) refs.push_back(t.ref());
  FLATPARAM_RETURN_IF_ERROR(Unflatten(layout, flat.cref(), refs));
  for (size_t i = 0; i < tensors.size(); ++i) {
    out[layout.params()[i].fqn] = std::move(tensors[i]);
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// The ParamAccess over the runtime.

// The model's units are the runtime's: each BeginUnit/EndUnit is one of its
// hooks, and parameters and gradients are its views by fqn.
class RuntimeParamAccess final : public ParamAccess {
 public:
  // `skip_forward`: FsdpTrainOptions::skip_forward_for_testing for this
  // step (may be empty).
  RuntimeParamAccess(FsdpRuntime& runtime, DeviceOps& device,
                     std::function<bool(absl::string_view)> skip_forward = {})
      : runtime_(runtime),
        device_(device),
        skip_forward_(std::move(skip_forward)) {}

  absl::StatusOr<const float*> Param(absl::string_view fqn) override {
    FLATPARAM_ASSIGN_OR_RETURN(const ParamLocation loc, runtime_.Find(fqn));
    if (loc.unit == skipped_unit_) {
      const int64_t numel =
          runtime_.layout().flat_params()[loc.unit].params()[loc.index].numel;
      std::vector<float>& zeros = zeros_[std::string(fqn)];
      zeros.assign(static_cast<size_t>(numel), 0.0f);
      return zeros.data();
    }
    FLATPARAM_ASSIGN_OR_RETURN(OrigParamView view, runtime_.Param(fqn));
    if (view.sharded) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "parameter \"%s\" is not unsharded (handle state %s)", fqn,
          HandleTrainingStateName(runtime_.handle(loc.unit).training_state())));
    }
    if (IsHostFloat(view.data)) {
      return static_cast<const float*>(view.data.data);
    }
    Staged& staged = params_[std::string(fqn)];
    staged.unit = loc.unit;
    FLATPARAM_RETURN_IF_ERROR(ToHostFloat(device_, view.data, staged.data));
    return staged.data.data();
  }

  absl::StatusOr<float*> Grad(absl::string_view fqn) override {
    FLATPARAM_ASSIGN_OR_RETURN(const ParamLocation loc, runtime_.Find(fqn));
    FLATPARAM_ASSIGN_OR_RETURN(BufferRef view, runtime_.GradView(fqn));
    if (IsHostFloat(view)) return static_cast<float*>(view.data);
    auto [it, fresh] = grads_.try_emplace(std::string(fqn));
    if (fresh) {
      it->second.unit = loc.unit;
      it->second.data.assign(view.count, 0.0f);
    }
    return it->second.data.data();
  }

  absl::Status BeginUnit(absl::string_view unit, Phase phase) override {
    FLATPARAM_ASSIGN_OR_RETURN(const int u, runtime_.FindUnit(unit));
    if (phase == Phase::kForward && skip_forward_ && skip_forward_(unit)) {
      skipped_unit_ = u;
      return absl::OkStatus();
    }
    return phase == Phase::kForward ? runtime_.PreForward(u)
                                    : runtime_.PreBackward(u);
  }

  absl::Status EndUnit(absl::string_view unit, Phase phase) override {
    FLATPARAM_ASSIGN_OR_RETURN(const int u, runtime_.FindUnit(unit));
    if (u == skipped_unit_ && phase == Phase::kForward) {
      skipped_unit_ = -1;
      return absl::OkStatus();
    }
    Drop(params_, u);
    if (phase == Phase::kForward) return runtime_.PostForward(u);
    FLATPARAM_RETURN_IF_ERROR(FlushGrads(u));
    return runtime_.PostBackward(u);
  }

 private:
  struct Staged {
    int unit = 0;
    std::vector<float> data;
  };

  static bool IsHostFloat(ConstBufferRef b) {
    return b.device == Device::Host() && b.dtype == DType::kFloat32;
  }

  static void Drop(std::map<std::string, Staged>& staged, int unit) {
    for (auto it = staged.begin(); it != staged.end();) {
      it = it->second.unit == unit ? staged.erase(it) : std::next(it);
    }
  }

  // Adds the staged float32 gradients of `unit` into its handle: cast to the
  // gradient's dtype on the host, moved to its device, then AccumulateGrad
  // (which then needs no temporary of its own).
  absl::Status FlushGrads(int unit) {
    for (auto& [fqn, staged] : grads_) {
      if (staged.unit != unit) continue;
      FLATPARAM_ASSIGN_OR_RETURN(BufferRef view, runtime_.GradView(fqn));
      std::vector<unsigned char> host(view.bytes());
      HostCast(host.data(), view.dtype, staged.data.data(), DType::kFloat32,
               view.count);
      ConstBufferRef grad{host.data(), view.count, view.dtype, Device::Host()};
      DeviceBuffer on_device;
      if (view.device != Device::Host()) {
        FLATPARAM_ASSIGN_OR_RETURN(on_device,
                                   device_.Allocate(view.device, view.bytes()));
        const BufferRef d = on_device.As(view.dtype).Slice(0, view.count);
        FLATPARAM_RETURN_IF_ERROR(device_.Copy(d, grad));
        grad = d;
      }
      FLATPARAM_RETURN_IF_ERROR(runtime_.AccumulateGrad(fqn, grad));
    }
    Drop(grads_, unit);
    return absl::OkStatus();
  }

  FsdpRuntime& runtime_;
  DeviceOps& device_;
  std::function<bool(absl::string_view)> skip_forward_;
  // The unit whose forward runs without hooks (skip_forward_), or -1, and
  // the zeros its parameters read as.
  int skipped_unit_ = -1;
  std::map<std::string, std::vector<float>> zeros_;
  std::map<std::string, Staged> params_;
  std::map<std::string, Staged> grads_;
};

int ShardGroupSize(const FsdpTrainOptions& o, int world_size) {
  return IsHybridStrategy(o.strategy) ? o.shard_group_size : world_size;
}

// The step's loss from losses[r * M + m], as TrainReference defines it.
float FoldLosses(const std::vector<float>& losses, int world, int64_t m_count) {
  float total = 0.0f;
  for (int64_t m = 0; m < m_count; ++m) {
    float acc = losses[m];
    for (int r = 1; r < world; ++r) acc = acc + losses[r * m_count + m];
    const float mean = acc / static_cast<float>(world);
    total = m == 0 ? mean : total + mean;
  }
  return total / static_cast<float>(m_count);
}

// One rank's training, with its runtime.
class RankTrainer {
 public:
  RankTrainer(Communicator& world, DeviceOps& device,
              const FsdpTrainOptions& options, const ReferenceModel& model,
              ModelLayout layout)
      : world_(world),
        device_(device),
        options_(options),
        model_(model),
        layout_(std::move(layout)) {}

  absl::StatusOr<FsdpRankResult> Run() {
    FLATPARAM_RETURN_IF_ERROR(Setup());
    FLATPARAM_ASSIGN_OR_RETURN(std::unique_ptr<Optimizer> optimizer,
                               MakeOptimizer(options_.optimizer));
    result_.rank = world_.rank();
    if (options_.initial_state.has_value()) {
      states_ = options_.initial_state->optimizer;
    }
    states_.resize(runtime_->num_units());
    for (int64_t k = 0; k < options_.steps; ++k) {
      const int64_t step = options_.first_step + k;
      FLATPARAM_RETURN_IF_ERROR(WithContext(Step(k, step, *optimizer),
                                            absl::StrFormat("step %d", step)));
      if (options_.after_step) {
        FLATPARAM_RETURN_IF_ERROR(WithContext(
            options_.after_step(k + 1, [this] { return CopyState(); }),
            absl::StrFormat("after step %d", step)));
      }
    }
    FLATPARAM_ASSIGN_OR_RETURN(result_.state, CopyState());
    if (options_.gather_results) {
      FLATPARAM_RETURN_IF_ERROR(GatherResults());
    }
    result_.memory = runtime_->memory();
    for (const OptimizerState& state : states_) {
      for (const auto& [name, t] : state.tensors) {
        result_.optimizer_state_bytes += static_cast<int64_t>(t.nbytes());
      }
    }
    return std::move(result_);
  }

 private:
  // The state must be this layout's: one float32 shard of the right size
  // per flat parameter, and at most one optimizer state each.
  absl::Status CheckInitialState(const FsdpRankState& state) const {
    const std::vector<FlatParamLayout>& flat = layout_.flat_params();
    if (state.flat_params.size() != flat.size() ||
        state.optimizer.size() > flat.size()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "initial state: %d flat parameter shards and %d optimizer states "
          "for a layout of %d flat parameters",
          state.flat_params.size(), state.optimizer.size(), flat.size()));
    }
    for (size_t u = 0; u < flat.size(); ++u) {
      const HostTensor& t = state.flat_params[u];
      if (t.dtype() != DType::kFloat32 || t.shape().size() != 1 ||
          t.numel() != flat[u].sharded_numel()) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "initial state: the shard of flat parameter %d (unit \"%s\") is "
            "%s with %d elements, expected 1-D float32 with %d",
            u, flat[u].unit(), DTypeName(t.dtype()), t.numel(),
            flat[u].sharded_numel()));
      }
    }
    return absl::OkStatus();
  }

  absl::Status Setup() {
    HandleOptions handle_options;
    handle_options.param_dtype = options_.param_dtype;
    handle_options.reduce_dtype = options_.reduce_dtype;
    handle_options.cpu_offload = options_.cpu_offload;
    handle_options.collective_options = options_.collective_options;
    if (options_.separate_streams) {
      FLATPARAM_ASSIGN_OR_RETURN(handle_options.streams.unshard,
                                 device_.NewStream());
      FLATPARAM_ASSIGN_OR_RETURN(handle_options.streams.post_backward,
                                 device_.NewStream());
    }
    RuntimeOptions runtime_options;
    runtime_options.forward_prefetch = options_.forward_prefetch;
    runtime_options.backward_prefetch = options_.backward_prefetch;
    runtime_options.prefetch_depth = options_.prefetch_depth;
    runtime_options.limit_all_gathers = options_.limit_all_gathers;
    // The reference model runs its units in one fixed order: a deviation
    // would be a bug of this trainer, not something to warn about.
    // A fault test that skips a unit on purpose wants the collectives, not
    // the order check, to meet the desynchronisation: it only warns then.
    runtime_options.exec_order = options_.skip_forward_for_testing
                                     ? ExecOrderCheck::kWarn
                                     : ExecOrderCheck::kError;
    runtime_options.collective_options = options_.collective_options;

    const TensorMap params = options_.initial_params.has_value()
                                 ? *options_.initial_params
                                 : model_.InitParams();
    FLATPARAM_RETURN_IF_ERROR(model_.CheckParams(params));
    if (options_.initial_state.has_value()) {
      FLATPARAM_RETURN_IF_ERROR(CheckInitialState(*options_.initial_state));
    }
    std::map<std::string, ConstBufferRef> named;
    for (const auto& [fqn, t] : params) named.emplace(fqn, t.cref());
    FLATPARAM_ASSIGN_OR_RETURN(runtime_, FsdpRuntime::CreateFromNamedParams(
                                             layout_, named, &world_, &device_,
                                             handle_options, runtime_options));
    const int shard_rank = runtime_->shard_group().rank();
    for (int u = 0; u < runtime_->num_units(); ++u) {
      const BufferRef shard_param = runtime_->handle(u).sharded_param();
      if (options_.initial_state.has_value()) {
        const HostTensor& mine = options_.initial_state->flat_params[u];
        FLATPARAM_RETURN_IF_ERROR(
            FromHost(device_,
                     ConstBufferRef{mine.data(), mine.numel(), mine.dtype(),
                                    Device::Host()},
                     shard_param));
      }
      if (options_.padding_fill.has_value()) {
        for (const auto& [lo, hi] :
             PaddingRanges(layout_.flat_params()[u], shard_rank)) {
          FLATPARAM_RETURN_IF_ERROR(device_.Fill(shard_param.Slice(lo, hi - lo),
                                                 *options_.padding_fill));
        }
        FLATPARAM_RETURN_IF_ERROR(device_.Synchronize());
      }
    }
    return absl::OkStatus();
  }

  // A host copy of the rank's sharded parameters and optimizer state.
  absl::StatusOr<FsdpRankState> CopyState() const {
    FsdpRankState state;
    for (int u = 0; u < runtime_->num_units(); ++u) {
      FLATPARAM_ASSIGN_OR_RETURN(
          HostTensor shard,
          ToHostTensor(device_, runtime_->handle(u).sharded_param()));
      state.flat_params.push_back(std::move(shard));
    }
    state.optimizer = states_;
    return state;
  }

  // Step k of this run, on data step `step`.
  absl::Status Step(int64_t k, int64_t step, const Optimizer& optimizer) {
    const int world = world_.size();
    const int64_t m_count = options_.micro_batches;
    const int64_t local_batch = options_.global_batch / world;
    std::vector<float> local_losses(m_count);
    for (int64_t m = 0; m < m_count; ++m) {
      const bool sync =
          options_.accumulation == AccumulationMode::kShardedAccumulation ||
          m == m_count - 1;
      const Batch batch =
          MakeBatch(options_.data_seed, options_.model.vocab, step, m,
                    world_.rank() * local_batch, local_batch);
      // Read at the iteration's first PreForward (no_sync).
      runtime_->SetRequireGradientSync(sync);
      std::function<bool(absl::string_view)> skip;
      if (options_.skip_forward_for_testing) {
        skip = [this, step](absl::string_view unit) {
          return options_.skip_forward_for_testing(step, unit);
        };
      }
      RuntimeParamAccess access(*runtime_, device_, std::move(skip));
      absl::StatusOr<float> loss =
          model_.ForwardBackward(batch, access, options_.recompute_activations);
      absl::Status status = loss.status();
      if (status.ok()) status = runtime_->FinalizeBackward();
      FLATPARAM_RETURN_IF_ERROR(
          WithContext(status, absl::StrFormat("micro-batch %d", m)));
      local_losses[m] = *loss;
    }
    // The handles communicate only in the hooks above; the gathers below
    // and at the end use the runtime's (counted) shard group too, so the
    // handles' traffic is taken here.
    result_.comm = runtime_->comm_stats();

    const bool last = k == options_.steps - 1;
    const int shard_rank = runtime_->shard_group().rank();
    for (int u = 0; u < runtime_->num_units(); ++u) {
      FlatParamHandle& h = runtime_->handle(u);
      const FlatParamLayout& layout = layout_.flat_params()[u];
      const std::optional<BufferRef> grad = h.sharded_grad();
      std::optional<HostTensor> host_grad;
      if (grad.has_value()) {
        FLATPARAM_ASSIGN_OR_RETURN(host_grad, ToHostTensor(device_, *grad));
        const float* g = host_grad->data_as<float>();
        for (const auto& [lo, hi] : PaddingRanges(layout, shard_rank)) {
          for (int64_t i = lo; i < hi; ++i) {
            result_.nonzero_padding_grads += g[i] != 0.0f;
          }
        }
        if (last && options_.gather_grads) {
          FLATPARAM_ASSIGN_OR_RETURN(HostTensor flat,
                                     GatherFlat(layout, host_grad->cref()));
          FLATPARAM_RETURN_IF_ERROR(UnflattenInto(layout, flat, result_.grads));
        }
      }
      FLATPARAM_RETURN_IF_ERROR(WithContext(
          StepOptimizer(h, host_grad, optimizer, states_[u]),
          absl::StrFormat("optimizer step of unit \"%s\"", layout.unit())));
    }
    FLATPARAM_RETURN_IF_ERROR(runtime_->ZeroGrad(/*set_to_none=*/true));

    std::vector<float> all(static_cast<size_t>(world) * m_count);
    FLATPARAM_RETURN_IF_ERROR(
        AllGatherHost(world_, device_,
                      ConstBufferRef{local_losses.data(), m_count,
                                     DType::kFloat32, Device::Host()},
                      BufferRef{all.data(), static_cast<int64_t>(all.size()),
                                DType::kFloat32, Device::Host()},
                      options_.collective_options, "all-gather of the losses"));
    result_.losses.push_back(FoldLosses(all, world, m_count));
    if (options_.on_loss) options_.on_loss(step, result_.losses.back());
    return absl::OkStatus();
  }

  // Steps the optimizer on the handle's sharded parameter in place (through
  // a host copy when it lives on a device).
  absl::Status StepOptimizer(FlatParamHandle& h,
                             const std::optional<HostTensor>& grad,
                             const Optimizer& optimizer,
                             OptimizerState& state) {
    const BufferRef param = h.sharded_param();
    std::optional<ConstBufferRef> g;
    if (grad.has_value()) g = grad->cref();
    if (param.device == Device::Host()) {
      return optimizer.Step(param, g, state);
    }
    FLATPARAM_ASSIGN_OR_RETURN(HostTensor host, ToHostTensor(device_, param));
    FLATPARAM_RETURN_IF_ERROR(optimizer.Step(host.ref(), g, state));
    return FromHost(
        device_,
        ConstBufferRef{host.data(), host.numel(), host.dtype(), Device::Host()},
        param);
  }

  // All-gathers a shard-sized host tensor over the shard group into the
  // padded unsharded flat tensor (NO_SHARD: the shard is the whole).
  absl::StatusOr<HostTensor> GatherFlat(const FlatParamLayout& layout,
                                        ConstBufferRef shard) {
    if (!UsesShardedStrategy(layout.options().strategy)) {
      HostTensor flat = HostTensor::Flat(shard.dtype, shard.count);
      if (shard.count > 0) std::memcpy(flat.data(), shard.data, flat.nbytes());
      return flat;
    }
    HostTensor flat =
        HostTensor::Flat(shard.dtype, layout.padded_unsharded_numel());
    FLATPARAM_RETURN_IF_ERROR(AllGatherHost(
        runtime_->shard_group(), device_,
        ConstBufferRef{shard.data, shard.count, shard.dtype, Device::Host()},
        BufferRef{flat.data(), flat.numel(), flat.dtype(), Device::Host()},
        options_.collective_options,
        absl::StrFormat("gathering unit \"%s\"", layout.unit())));
    return flat;
  }

  absl::Status GatherResults() {
    for (int u = 0; u < runtime_->num_units(); ++u) {
      const FlatParamLayout& layout = layout_.flat_params()[u];
      FLATPARAM_ASSIGN_OR_RETURN(
          HostTensor shard,
          ToHostTensor(device_, runtime_->handle(u).sharded_param()));
      FLATPARAM_ASSIGN_OR_RETURN(HostTensor flat,
                                 GatherFlat(layout, shard.cref()));
      FLATPARAM_RETURN_IF_ERROR(UnflattenInto(layout, flat, result_.params));
      for (const ParamInfo& p : layout.params()) {
        result_.optimizer_state[p.fqn];  // Every parameter has an entry.
      }
      for (const auto& [name, t] : states_[u].tensors) {
        if (name == kStepState) {
          for (const ParamInfo& p : layout.params()) {
            result_.optimizer_state[p.fqn].tensors[name] = t;
          }
          continue;
        }
        FLATPARAM_ASSIGN_OR_RETURN(HostTensor flat_state,
                                   GatherFlat(layout, t.cref()));
        TensorMap per_param;
        FLATPARAM_RETURN_IF_ERROR(UnflattenInto(layout, flat_state, per_param));
        for (auto& [fqn, tensor] : per_param) {
          result_.optimizer_state[fqn].tensors[name] = std::move(tensor);
        }
      }
    }
    return absl::OkStatus();
  }

  Communicator& world_;
  DeviceOps& device_;
  const FsdpTrainOptions& options_;
  const ReferenceModel& model_;
  const ModelLayout layout_;

  std::unique_ptr<FsdpRuntime> runtime_;
  std::vector<OptimizerState> states_;
  FsdpRankResult result_;
};

}  // namespace

absl::Status ValidateFsdpTrainOptions(const FsdpTrainOptions& o,
                                      int world_size) {
  if (world_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("world size must be >= 1, got %d", world_size));
  }
  if (o.steps < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("steps must be >= 0, got %d", o.steps));
  }
  if (o.global_batch < 1 || o.global_batch % world_size != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "global batch %d must be >= 1 and a multiple of the world size %d",
        o.global_batch, world_size));
  }
  if (o.first_step < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("first step must be >= 0, got %d", o.first_step));
  }
  if (o.micro_batches < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("micro-batches must be >= 1, got %d", o.micro_batches));
  }
  if (IsHybridStrategy(o.strategy)) {
    if (o.shard_group_size < 1 || world_size % o.shard_group_size != 0) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: the shard group size %d must be >= 1 and divide the world "
          "size %d",
          ShardingStrategyName(o.strategy), o.shard_group_size, world_size));
    }
  } else if (o.shard_group_size != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "a shard group size (%d) is only meaningful for HYBRID_SHARD and "
        "HYBRID_SHARD_ZERO2, not %s",
        o.shard_group_size, ShardingStrategyName(o.strategy)));
  }
  if (o.prefetch_depth < 1) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "prefetch depth must be >= 1, got %d", o.prefetch_depth));
  }
  if (o.limit_all_gathers < 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "limit_all_gathers must be >= 0 (0 = unlimited), got %d",
        o.limit_all_gathers));
  }
  for (const auto& [what, dtype] :
       {std::make_pair("param dtype", o.param_dtype),
        std::make_pair("reduce dtype", o.reduce_dtype)}) {
    if (dtype.has_value() && !IsFloatingPoint(*dtype)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "the %s %s is not a floating dtype", what, DTypeName(*dtype)));
    }
  }
  return ReferenceModel::Create(o.model).status();
}

absl::StatusOr<ModelLayout> FsdpModelLayout(const FsdpTrainOptions& options,
                                            int world_size) {
  FLATPARAM_RETURN_IF_ERROR(ValidateFsdpTrainOptions(options, world_size));
  FLATPARAM_ASSIGN_OR_RETURN(ModelSpec spec, Spec(options.model));
  LayoutOptions layout_options;
  layout_options.world_size = ShardGroupSize(options, world_size);
  layout_options.strategy = options.strategy;
  layout_options.align_addresses = options.align_addresses;
  layout_options.compute_dtype = options.param_dtype;
  return ModelLayout::Create(spec, layout_options);
}

absl::StatusOr<TrainOptions> ReferenceOptionsFor(
    const FsdpTrainOptions& options, int world_size) {
  FLATPARAM_RETURN_IF_ERROR(ValidateFsdpTrainOptions(options, world_size));
  TrainOptions r;
  r.steps = options.steps;
  r.global_batch = options.global_batch;
  r.micro_batches = options.micro_batches;
  r.accumulation = options.accumulation;
  r.reduction =
      IsHybridStrategy(options.strategy)
          ? GradientReduction::Hybrid(world_size, options.shard_group_size)
          : GradientReduction::Fsdp(world_size);
  r.optimizer = options.optimizer;
  r.data_seed = options.data_seed;
  r.first_step = options.first_step;
  r.initial_params = options.initial_params;
  r.param_dtype = options.param_dtype;
  r.reduce_dtype = options.reduce_dtype;
  return r;
}

absl::StatusOr<FsdpRankResult> TrainFsdpOnRank(
    Communicator& world, DeviceOps& device, const FsdpTrainOptions& options) {
  FLATPARAM_ASSIGN_OR_RETURN(ModelLayout layout,
                             FsdpModelLayout(options, world.size()));
  FLATPARAM_ASSIGN_OR_RETURN(ReferenceModel model,
                             ReferenceModel::Create(options.model));
  RankTrainer trainer(world, device, options, model, std::move(layout));
  return trainer.Run();
}

absl::StatusOr<std::array<int64_t, kNumMemoryCategories>> ExpectedPeakMemory(
    const FsdpTrainOptions& options, int world_size) {
  FLATPARAM_ASSIGN_OR_RETURN(ModelLayout layout,
                             FsdpModelLayout(options, world_size));
  // Dtypes as FlatParamHandle resolves them.
  const DType orig = DType::kFloat32;
  DType param = options.param_dtype.value_or(orig);
  DType reduce = options.reduce_dtype.value_or(orig);
  if (options.param_dtype.has_value() && !options.reduce_dtype.has_value()) {
    reduce = param;
  }
  const int64_t b_o = DTypeSize(orig);
  const int64_t b_p = DTypeSize(param);
  const int64_t b_r = DTypeSize(reduce);
  const bool mp = param != orig;
  const bool sharded = UsesShardedStrategy(options.strategy);
  const bool raf = ReshardsAfterForward(options.strategy);
  const bool offload = options.cpu_offload;
  const bool no_sync = options.accumulation == AccumulationMode::kNoSync;
  const bool once = options.micro_batches == 1 || no_sync;

  // Prefetch. k: how far the limited (all-gathering) prefetches reach.
  const int64_t depth = options.prefetch_depth;
  const int64_t k = options.limit_all_gathers == 0
                        ? depth
                        : std::min<int64_t>(depth, options.limit_all_gathers);
  const bool pre = options.backward_prefetch == BackwardPrefetch::kBackwardPre;
  const bool post =
      options.backward_prefetch == BackwardPrefetch::kBackwardPost;
  // Forward prefetch follows the order recorded in the first iteration, so
  // it acts from the second one on, and only on a forward that unshards:
  // every forward of FULL_SHARD/HYBRID_SHARD (layers are freed after it)
  // and NO_SHARD (a cast or copy each time), but SHARD_GRAD_OP and
  // HYBRID_SHARD_ZERO2 keep their parameters through a backward without
  // sync, so only a step's first micro-batch, or any after a synchronizing
  // one, all-gathers.
  const bool fwd =
      options.forward_prefetch &&
      (sharded && !raf
           ? options.steps >= 2 || (options.micro_batches >= 2 &&
                                    options.accumulation ==
                                        AccumulationMode::kShardedAccumulation)
           : options.steps * options.micro_batches >= 2);

  // Units in layout order: the root first, then layers 1..L.
  std::vector<int64_t> ns, np;
  for (const FlatParamLayout& l : layout.flat_params()) {
    ns.push_back(l.sharded_numel());
    np.push_back(l.padded_unsharded_numel());
  }
  const size_t units = ns.size();
  const int64_t last_layer = static_cast<int64_t>(units) - 1;
  auto sum = [](const std::vector<int64_t>& v, int64_t scale) {
    int64_t s = 0;
    for (int64_t x : v) s += x * scale;
    return s;
  };
  auto max_from = [](const std::vector<int64_t>& v, size_t first,
                     int64_t scale) {
    int64_t m = 0;
    for (size_t u = first; u < v.size(); ++u) m = std::max(m, v[u] * scale);
    return m;
  };
  // The largest sum of x * scale over n consecutive layers among 1..last
  // (runs ending at a layer < n are shorter).
  auto window = [](const std::vector<int64_t>& x, int64_t n, int64_t last,
                   int64_t scale) {
    int64_t best = 0;
    for (int64_t i = 1; i <= last; ++i) {
      int64_t s = 0;
      for (int64_t j = i; j >= 1 && j > i - n; --j) s += x[j] * scale;
      best = std::max(best, s);
    }
    return best;
  };
  // Sharded strategies: what the pending prefetches hold (each its input:
  // the cast shard, or the offloaded shard's compute copy), at most k
  // consecutive layers; a blocking unshard holds its own while none is
  // pending.
  auto pending = [&](const std::vector<int64_t>& x, int64_t scale) {
    int64_t m = max_from(x, 0, scale);
    if (fwd || (raf && pre)) m = std::max(m, window(x, k, last_layer, scale));
    if (raf && post) m = std::max(m, window(x, k, last_layer - 1, scale));
    return m;
  };
  // NO_SHARD: the root's unsharded copy or cast (from its pre- to its
  // post-hook) plus the running layer's and those prefetched ahead of it;
  // NO_SHARD prefetches need no all-gather, so the limit does not apply.
  auto held = [&](const std::vector<int64_t>& x, int64_t scale) {
    int64_t layers = max_from(x, 1, scale);
    if (fwd || pre) {
      layers = std::max(layers, window(x, depth + 1, last_layer, scale));
    }
    if (post)
      layers = std::max(layers, window(x, depth, last_layer - 1, scale));
    return x[0] * scale + layers;
  };
  // The backward's reduction order: the last layer first, the root last.
  std::vector<size_t> order;
  for (size_t u = units; u-- > 1;) order.push_back(u);
  order.push_back(0);

  std::array<int64_t, kNumMemoryCategories> peak{};
  auto at = [&peak](MemoryCategory c) -> int64_t& {
    return peak[static_cast<int>(c)];
  };

  at(MemoryCategory::kShardedParams) =
      sum(ns, b_o) +
      (offload && sharded ? (mp ? max_from(ns, 0, b_o) : pending(ns, b_o)) : 0);

  if (sharded) {
    if (raf) {
      int64_t layers = max_from(np, 1, b_p);
      if (fwd || pre) {
        layers = std::max(layers, window(np, k + 1, last_layer, b_p));
      }
      if (post) layers = std::max(layers, window(np, k, last_layer - 1, b_p));
      at(MemoryCategory::kUnshardedParams) = np[0] * b_p + layers;
    } else {
      at(MemoryCategory::kUnshardedParams) = sum(np, b_p);
    }
  } else if (offload) {
    at(MemoryCategory::kUnshardedParams) =
        mp ? max_from(np, 0, b_o) : held(np, b_o);
  }

  if (mp) {
    at(MemoryCategory::kLowPrecisionParams) =
        sharded ? pending(ns, b_p) : held(np, b_p);
  }

  auto G = [&](size_t u) { return np[u] * b_p; };
  auto X = [&](size_t u) { return reduce != param ? np[u] * b_r : 0; };
  // What a started reduction holds in this category until the next
  // unit's PostBackward (or FinalizeBackward) finishes it: its input, the
  // reduce-dtype copy or else the gradient itself (NO_SHARD's input is
  // the reduced buffer, a sharded gradient).
  auto I = [&](size_t u) { return !sharded ? 0 : X(u) > 0 ? X(u) : G(u); };
  auto in_flight = [&](size_t j) { return j == 0 ? 0 : I(order[j - 1]); };
  int64_t& unsharded_grads = at(MemoryCategory::kUnshardedGrads);
  for (size_t j = 0; j < order.size(); ++j) {
    const size_t u = order[j];
    int64_t live = 0;
    if (options.micro_batches >= 2 && no_sync) {
      for (size_t i = j; i < order.size(); ++i) live += G(order[i]);
    } else {
      live = G(u) + (u != 0 ? G(0) : 0);
    }
    unsharded_grads = std::max(unsharded_grads, live + X(u) + in_flight(j));
  }

  // c(u): a finishing reduction's new shard and its float32 cast; pend(u):
  // a started reduction's new shard, alive while the previous finishes.
  auto c = [&](size_t u) {
    return ns[u] * b_r + (reduce != orig ? ns[u] * b_o : 0);
  };
  auto next_pend = [&](size_t j) {
    return j + 1 < order.size() ? ns[order[j + 1]] * b_r : 0;
  };
  int64_t& sharded_grads = at(MemoryCategory::kShardedGrads);
  int64_t held_grads = offload || !once ? sum(ns, b_o) : 0;
  for (size_t j = 0; j < order.size(); ++j) {
    sharded_grads =
        std::max(sharded_grads, held_grads + c(order[j]) + next_pend(j));
    if (!(offload || !once)) held_grads += ns[order[j]] * b_o;
  }
  return peak;
}

}  // namespace refmodel
}  // namespace flatparam
