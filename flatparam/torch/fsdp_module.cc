#include "flatparam/torch/fsdp_module.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/memory/memory.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/checkpoint/checkpoint_dir.h"
#include "flatparam/checkpoint/collective_checkpoint.h"
#include "flatparam/checkpoint/convert.h"
#include "flatparam/checkpoint/optim_io.h"

namespace flatparam {
namespace libtorch {
namespace {

absl::StatusOr<DType> FromTorch(c10::ScalarType type) {
  switch (type) {
    case c10::ScalarType::Float:
      return DType::kFloat32;
    case c10::ScalarType::Double:
      return DType::kFloat64;
    case c10::ScalarType::Half:
      return DType::kFloat16;
    case c10::ScalarType::BFloat16:
      return DType::kBFloat16;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("dtype ", c10::toString(type),
                       " is not supported (float32, float64, float16 and "
                       "bfloat16 parameters are)"));
  }
}

c10::ScalarType ToTorch(DType dtype) {
  switch (dtype) {
    case DType::kFloat64:
      return c10::ScalarType::Double;
    case DType::kFloat16:
      return c10::ScalarType::Half;
    case DType::kBFloat16:
      return c10::ScalarType::BFloat16;
    default:
      return c10::ScalarType::Float;
  }
}

torch::TensorOptions Options(DType dtype) {
  return torch::TensorOptions().dtype(ToTorch(dtype)).device(torch::kCPU);
}

// A CPU tensor over `buffer`'s memory (not owned).
torch::Tensor Over(const BufferRef& buffer) {
  return torch::from_blob(buffer.data, {buffer.count}, Options(buffer.dtype));
}

// Runs `hook` after a gradient accumulator has accumulated (PyTorch's
// post-accumulate-grad hook on the flat parameter).
class PostAccumulateHook : public torch::autograd::FunctionPostHook {
 public:
  explicit PostAccumulateHook(std::function<void()> hook)
      : hook_(std::move(hook)) {}
  torch::autograd::variable_list operator()(
      const torch::autograd::variable_list& outputs,
      const torch::autograd::variable_list& /*inputs*/) override {
    hook_();
    return outputs;
  }

 private:
  std::function<void()> hook_;
};

// Tensors over one storage whose data pointer is swapped (see the file
// comment of fsdp_module.h): one view per parameter.
struct SwappableViews {
  DType dtype = DType::kFloat32;
  c10::Storage storage;
  std::vector<torch::Tensor> views;
  void* bound = nullptr;
  bool made = false;

  // (Re)makes the views for `dtype`; `layout` gives offsets and shapes.
  void Make(DType new_dtype, const FlatParamLayout& layout) {
    torch::NoGradGuard no_grad;
    dtype = new_dtype;
    int64_t numel = 0;
    for (const ParamInfo& p : layout.params()) {
      numel = std::max(numel, p.offset + p.numel);
    }
    const int64_t bytes = numel * DTypeSize(dtype);
    storage = c10::Storage(c10::Storage::use_byte_size_t(), bytes,
                           at::DataPtr(nullptr, at::Device(at::kCPU)),
                           /*allocator=*/nullptr, /*resizable=*/false);
    views.clear();
    for (const ParamInfo& p : layout.params()) {
      std::vector<int64_t> strides(p.shape.size(), 1);
      for (int d = static_cast<int>(p.shape.size()) - 2; d >= 0; --d) {
        strides[d] = strides[d + 1] * p.shape[d + 1];
      }
      torch::Tensor view = torch::empty({0}, Options(dtype));
      view.set_(storage, p.offset, p.shape, strides);
      views.push_back(view);
    }
    bound = nullptr;
    made = true;
  }

  // Points the storage at `buffer` (or at nothing).
  void Point(const std::optional<BufferRef>& buffer) {
    void* data = buffer ? buffer->data : nullptr;
    if (data == bound) return;
    storage.set_data_ptr_noswap(at::DataPtr(data, at::Device(at::kCPU)));
    storage.set_nbytes(buffer ? buffer->bytes() : 0);
    bound = data;
  }
};

std::string Describe(const std::vector<std::string>& names) {
  std::vector<std::string> quoted;
  for (const std::string& n : names)
    quoted.push_back(absl::StrCat("\"", n, "\""));
  return absl::StrJoin(quoted, ", ");
}

}  // namespace

struct FsdpModule::UnitState {
  std::string name;
  // The module's tensor of each layout parameter (primaries; a tied name is
  // the same tensor).
  std::vector<torch::Tensor> params;
  std::vector<char> trainable;
  // The gradient accumulator each trainable parameter's hook is on.
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators;
  int num_trainable = 0;
  bool has_frozen = false;
  SwappableViews param_views;
  SwappableViews grad_views;
  // Whether the parameters are the views now (else empty tensors), and
  // whether their grad() are the gradient views.
  bool exposed = false;
  bool grads_exposed = false;
  // This backward.
  bool pre_backward_ran = false;
  bool post_backward_ran = false;
  int grads_arrived = 0;
};

FsdpModule::FsdpModule(std::shared_ptr<torch::nn::Module> module,
                       Communicator* world)
    : module_(std::move(module)), world_(world) {}

FsdpModule::~FsdpModule() = default;

absl::StatusOr<std::unique_ptr<FsdpModule>> FsdpModule::Wrap(
    std::shared_ptr<torch::nn::Module> module, Communicator* world,
    DeviceOps* device, const FsdpOptions& options) {
  if (module == nullptr || world == nullptr || device == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "FsdpModule::Wrap needs a module, a communicator and a DeviceOps (",
        module == nullptr ? "module" : "", world == nullptr ? " world" : "",
        device == nullptr ? " device" : "", " missing)"));
  }
  if (device->device() != Device::Host()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "FsdpModule::Wrap: DeviceOps on ", DeviceName(device->device()),
        "; LibTorch modules are supported with host DeviceOps (CPU tensors)"));
  }
  const bool hybrid = IsHybridStrategy(options.strategy);
  int64_t shard_size = world->size();
  if (hybrid) {
    shard_size =
        options.shard_group_size > 0 ? options.shard_group_size : world->size();
    if (world->size() % shard_size != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("FsdpModule::Wrap: shard_group_size ", shard_size,
                       " does not divide the world size ", world->size()));
    }
  } else if (options.shard_group_size != 0 &&
             options.shard_group_size != world->size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "FsdpModule::Wrap: shard_group_size ", options.shard_group_size,
        " is only for the hybrid strategies; ",
        ShardingStrategyName(options.strategy), " shards over the world (",
        world->size(), " ranks)"));
  }

  auto fsdp = absl::WrapUnique(new FsdpModule(module, world));
  ModelSpec spec;
  spec.name = module->name();
  spec.wrap = options.wrap;
  std::map<std::string, ConstBufferRef> initial;
  std::map<const c10::TensorImpl*, std::string> by_impl;
  std::map<const c10::StorageImpl*, std::string> by_storage;
  std::map<std::string, torch::Tensor> tensors;
  for (const auto& item : module->named_parameters(/*recurse=*/true)) {
    const std::string& name = item.key();
    const torch::Tensor& t = item.value();
    fsdp->wrapped_params_.emplace_back(name, t);
    ParamSpec p;
    p.fqn = name;
    if (!t.defined()) {
      return absl::InvalidArgumentError(
          absl::StrCat("parameter \"", name, "\" is undefined"));
    }
    auto tied = by_impl.find(t.unsafeGetTensorImpl());
    if (tied != by_impl.end()) {
      p.tied_to = tied->second;
      spec.params.push_back(p);
      continue;
    }
    if (!t.device().is_cpu()) {
      return absl::InvalidArgumentError(
          absl::StrCat("parameter \"", name, "\" is on ", t.device().str(),
                       "; only CPU tensors are supported"));
    }
    absl::StatusOr<DType> dtype = FromTorch(t.scalar_type());
    if (!dtype.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("parameter \"", name, "\": ", dtype.status().message()));
    }
    if (!t.is_contiguous()) {
      return absl::InvalidArgumentError(
          absl::StrCat("parameter \"", name, "\" is not contiguous (strides ",
                       c10::str(t.strides()), ")"));
    }
    if (t.numel() > 0) {
      auto [it, inserted] =
          by_storage.emplace(t.storage().unsafeGetStorageImpl(), name);
      if (!inserted) {
        return absl::InvalidArgumentError(absl::StrCat(
            "parameters \"", it->second, "\" and \"", name,
            "\" are different tensors over one storage (views); register "
            "the same tensor under both names to tie them"));
      }
    }
    by_impl.emplace(t.unsafeGetTensorImpl(), name);
    p.shape.assign(t.sizes().begin(), t.sizes().end());
    p.dtype = *dtype;
    p.requires_grad = t.requires_grad();
    spec.params.push_back(p);
    initial[name] =
        ConstBufferRef{t.data_ptr(), t.numel(), *dtype, Device::Host()};
    tensors[name] = t;
  }
  if (spec.params.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("module \"", module->name(), "\" has no parameters"));
  }
  if (options.sync_module_states) {
    BroadcastOptions from_rank0;
    from_rank0.root = 0;
    for (auto& [name, t] : tensors) {
      torch::NoGradGuard no_grad;
      BufferRef buffer{t.data_ptr(), t.numel(), initial[name].dtype,
                       Device::Host()};
      absl::Status status = world->Broadcast(buffer, from_rank0)->Wait();
      if (!status.ok()) {
        return absl::Status(status.code(),
                            absl::StrCat("sync_module_states, parameter \"",
                                         name, "\": ", status.message()));
      }
    }
  }
  LayoutOptions layout_options;
  layout_options.world_size = shard_size;
  layout_options.strategy = options.strategy;
  layout_options.align_addresses = options.align_addresses;
  layout_options.compute_dtype = options.handle.param_dtype;
  FLATPARAM_ASSIGN_OR_RETURN(ModelLayout layout,
                             ModelLayout::Create(spec, layout_options));
  FLATPARAM_ASSIGN_OR_RETURN(
      fsdp->runtime_,
      FsdpRuntime::CreateFromNamedParams(layout, initial, world, device,
                                         options.handle, options.runtime));

  // The module's parameters give up their memory: flatparam's local shards
  // hold the values now.
  torch::NoGradGuard no_grad;
  const ModelLayout& final_layout = fsdp->runtime_->layout();
  for (int u = 0; u < fsdp->runtime_->num_units(); ++u) {
    const FlatParamLayout& fp = final_layout.flat_params()[u];
    auto state = std::make_unique<UnitState>();
    state->name = fp.unit();
    const FlatParamHandle& handle = fsdp->runtime_->handle(u);
    for (int i = 0; i < static_cast<int>(fp.params().size()); ++i) {
      state->params.push_back(tensors.at(fp.params()[i].fqn));
      const bool trainable = handle.requires_grad(i);
      state->trainable.push_back(trainable ? 1 : 0);
      state->num_trainable += trainable ? 1 : 0;
      state->has_frozen = state->has_frozen || !trainable;
    }
    state->accumulators.resize(fp.params().size());
    const DType dtype = options.handle.param_dtype.value_or(fp.dtype());
    state->param_views.Make(dtype, fp);
    state->grad_views.Make(dtype, fp);
    torch::Tensor empty = torch::empty({0}, Options(dtype));
    for (torch::Tensor& t : state->params) t.set_data(empty);
    fsdp->units_.push_back(std::move(state));
    BufferRef shard = handle.sharded_param();
    fsdp->sharded_params_.push_back(Over(shard).set_requires_grad(true));
  }
  return fsdp;
}

std::vector<std::string> FsdpModule::unit_names() const {
  std::vector<std::string> names;
  for (const auto& u : units_) names.push_back(u->name);
  return names;
}

absl::Status FsdpModule::CheckModuleUnchanged() const {
  auto now = module_->named_parameters(/*recurse=*/true);
  size_t i = 0;
  for (const auto& item : now) {
    if (i >= wrapped_params_.size()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "the module has a parameter \"", item.key(),
          "\" it did not have when it was wrapped; wrap the module again "
          "(after FullStateDict) to change its parameters"));
    }
    const auto& [name, tensor] = wrapped_params_[i];
    if (item.key() != name ||
        item.value().unsafeGetTensorImpl() != tensor.unsafeGetTensorImpl()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "the module's parameter \"", item.key(), "\" (number ", i,
          ") is not the tensor \"", name,
          "\" it was wrapped with (a parameter replaced or reassigned "
          "after Wrap); wrap the module again to change its parameters"));
    }
    ++i;
  }
  if (i != wrapped_params_.size()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the module lost parameter \"", wrapped_params_[i].first,
        "\" after it was wrapped; wrap the module again to change its "
        "parameters"));
  }
  return absl::OkStatus();
}

absl::Status FsdpModule::Bind(int unit) {
  UnitState& u = *units_[unit];
  const FlatParamHandle& handle = runtime_->handle(unit);
  const FlatParamLayout& fp = layout().flat_params()[unit];
  torch::NoGradGuard no_grad;
  std::optional<BufferRef> flat = handle.unsharded_flat_param();
  if (flat.has_value()) {
    if (flat->dtype != u.param_views.dtype) {
      u.param_views.Make(flat->dtype, fp);
      u.exposed = false;
    }
    u.param_views.Point(flat);
    if (!u.exposed) {
      for (size_t i = 0; i < u.params.size(); ++i) {
        u.params[i].set_data(u.param_views.views[i]);
      }
      u.exposed = true;
    }
    // set_data to another dtype resets a parameter's gradient
    // accumulator: hook the one autograd will use from now on.
    for (size_t i = 0; i < u.params.size(); ++i) {
      if (!u.trainable[i]) continue;
      std::shared_ptr<torch::autograd::Node> acc =
          torch::autograd::impl::grad_accumulator(u.params[i]);
      if (acc == nullptr || acc == u.accumulators[i]) continue;
      acc->add_post_hook(std::make_unique<PostAccumulateHook>(
          [this, unit] { OnGradAccumulated(unit); }));
      u.accumulators[i] = std::move(acc);
    }
  } else {
    if (u.exposed) {
      torch::Tensor empty = torch::empty({0}, Options(u.param_views.dtype));
      for (torch::Tensor& t : u.params) t.set_data(empty);
      u.exposed = false;
    }
    u.param_views.Point(std::nullopt);
  }

  std::optional<BufferRef> grad = handle.unsharded_grad();
  const bool in_backward =
      handle.training_state() == HandleTrainingState::kBackwardPre;
  if (grad.has_value() && in_backward) {
    if (grad->dtype != u.grad_views.dtype) u.grad_views.Make(grad->dtype, fp);
    u.grad_views.Point(grad);
    for (size_t i = 0; i < u.params.size(); ++i) {
      if (u.trainable[i]) u.params[i].mutable_grad() = u.grad_views.views[i];
    }
    u.grads_exposed = true;
  } else {
    if (u.grads_exposed) {
      for (torch::Tensor& t : u.params) t.mutable_grad().reset();
      u.grads_exposed = false;
    }
    u.grad_views.Point(std::nullopt);
  }
  return absl::OkStatus();
}

absl::Status FsdpModule::BindAll() {
  for (int u = 0; u < static_cast<int>(units_.size()); ++u) {
    FLATPARAM_RETURN_IF_ERROR(Bind(u));
  }
  return absl::OkStatus();
}

void FsdpModule::BindShardedGrads() {
  torch::NoGradGuard no_grad;
  for (int u = 0; u < static_cast<int>(units_.size()); ++u) {
    const FlatParamHandle& handle = runtime_->handle(u);
    torch::Tensor& shard = sharded_params_[u];
    BufferRef param = handle.sharded_param();
    if (shard.data_ptr() != param.data) shard.set_data(Over(param));
    std::optional<BufferRef> grad = handle.sharded_grad();
    if (grad.has_value()) {
      shard.mutable_grad() = Over(*grad);
    } else {
      shard.mutable_grad().reset();
    }
  }
}

std::vector<torch::Tensor> FsdpModule::ShardedParameters() const {
  return sharded_params_;
}

void FsdpModule::Fail(const absl::Status& status) {
  if (hook_error_.ok()) hook_error_ = status;
}

void FsdpModule::RegisterPreBackward(const torch::Tensor& output, int unit) {
  output.register_hook(
      [this, unit](const torch::Tensor&) { OnPreBackward(unit); });
}

void FsdpModule::BeginBackward() {
  if (in_backward_) return;
  in_backward_ = true;
  for (auto& u : units_) {
    u->pre_backward_ran = false;
    u->post_backward_ran = false;
    u->grads_arrived = 0;
  }
  torch::autograd::Engine::get_default_engine().queue_callback(
      [this] { OnBackwardEnd(); });
}

void FsdpModule::OnPreBackward(int unit) {
  if (!hook_error_.ok()) TORCH_CHECK(false, hook_error_.ToString());
  BeginBackward();
  UnitState& u = *units_[unit];
  if (u.pre_backward_ran) return;
  u.pre_backward_ran = true;
  absl::Status status = runtime_->PreBackward(unit);
  if (status.ok()) status = Bind(unit);
  if (!status.ok()) {
    Fail(status);
    TORCH_CHECK(false, status.ToString());
  }
}

void FsdpModule::OnGradAccumulated(int unit) {
  UnitState& u = *units_[unit];
  if (!in_backward_ || !u.pre_backward_ran || u.post_backward_ran) return;
  ++u.grads_arrived;
  if (u.has_frozen || u.grads_arrived < u.num_trainable) return;
  u.post_backward_ran = true;
  ++stats_.reductions_in_backward;
  absl::Status status = runtime_->PostBackward(unit);
  if (status.ok()) status = Bind(unit);
  if (!status.ok()) {
    Fail(status);
    TORCH_CHECK(false, status.ToString());
  }
}

void FsdpModule::OnBackwardEnd() {
  // Recorded, not thrown: the engine has finished the graph; Backward()
  // (or the next Forward) reports it.
  absl::Status status = hook_error_;
  for (int u = 0; u < static_cast<int>(units_.size()) && status.ok(); ++u) {
    UnitState& state = *units_[u];
    if (!state.pre_backward_ran || state.post_backward_ran) continue;
    state.post_backward_ran = true;
    ++stats_.reductions_at_end;
    status = runtime_->PostBackward(u);
  }
  absl::Status finalize = runtime_->FinalizeBackward();
  if (status.ok()) status = finalize;
  absl::Status bind = BindAll();
  if (status.ok()) status = bind;
  BindShardedGrads();
  in_backward_ = false;
  ++stats_.backwards;
  Fail(status);
}

const char* RecomputationName(Recomputation r) {
  switch (r) {
    case Recomputation::kNone:
      return "none";
    case Recomputation::kInsideUnit:
      return "inside";
    case Recomputation::kAroundUnit:
      break;
  }
  return "around";
}

absl::StatusOr<torch::Tensor> FsdpModule::RunUnit(
    int unit, const std::function<absl::StatusOr<torch::Tensor>()>& forward) {
  FLATPARAM_RETURN_IF_ERROR(runtime_->PreForward(unit));
  FLATPARAM_RETURN_IF_ERROR(Bind(unit));
  absl::StatusOr<torch::Tensor> out;
  try {
    out = forward();
  } catch (const c10::Error& e) {
    const std::string& name = units_[unit]->name;
    out = absl::InvalidArgumentError(absl::StrCat(
        "LibTorch error in the forward",
        name.empty() ? "" : absl::StrCat(" of unit \"", name, "\""), ": ",
        e.what_without_backtrace(),
        " (if a parameter is empty: a unit's parameters hold values only "
        "inside its FsdpModule::Unit(...) call)"));
  }
  absl::Status post = runtime_->PostForward(unit);
  if (post.ok()) post = Bind(unit);
  FLATPARAM_RETURN_IF_ERROR(out.status());
  FLATPARAM_RETURN_IF_ERROR(post);
  if (out->defined() && out->requires_grad() && torch::GradMode::is_enabled()) {
    RegisterPreBackward(*out, unit);
  }
  return out;
}

absl::StatusOr<torch::Tensor> FsdpModule::Forward(
    const std::function<absl::StatusOr<torch::Tensor>()>& forward) {
  if (!hook_error_.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("a previous backward failed: ", hook_error_.ToString()));
  }
  if (in_forward_) {
    return absl::FailedPreconditionError(
        "FsdpModule::Forward inside Forward (use Unit for a unit's forward)");
  }
  FLATPARAM_RETURN_IF_ERROR(CheckModuleUnchanged());
  in_forward_ = true;
  absl::StatusOr<torch::Tensor> out;
  std::optional<int> root = runtime_->root_unit();
  if (root.has_value()) {
    out = RunUnit(*root, forward);
  } else {
    try {
      out = forward();
    } catch (const c10::Error& e) {
      out = absl::InvalidArgumentError(absl::StrCat(
          "LibTorch error in the forward: ", e.what_without_backtrace()));
    }
    // Without a root unit no pre-backward hook marks the backward's start;
    // this one does, before any recompute in the backward runs a unit.
    if (out.ok() && out->defined() && out->requires_grad() &&
        torch::GradMode::is_enabled()) {
      out->register_hook([this](const torch::Tensor&) { BeginBackward(); });
    }
  }
  in_forward_ = false;
  return out;
}

absl::StatusOr<int> FsdpModule::UnitIndex(absl::string_view name) const {
  // In the backward, only a recompute (gradients on) runs a unit's forward.
  if (!in_forward_ && !(in_backward_ && torch::GradMode::is_enabled())) {
    return absl::FailedPreconditionError(absl::StrCat(
        "FsdpModule::Unit(\"", name,
        "\") outside Forward (or, in the backward, outside a recompute)"));
  }
  absl::StatusOr<int> unit = runtime_->FindUnit(name);
  if (!unit.ok()) {
    return absl::NotFoundError(absl::StrCat("\"", name,
                                            "\" is not a unit; the units are ",
                                            Describe(unit_names())));
  }
  if (runtime_->root_unit() == *unit) {
    return absl::FailedPreconditionError(
        "FsdpModule::Unit of the root unit (Forward runs it)");
  }
  return *unit;
}

absl::StatusOr<torch::Tensor> FsdpModule::Unit(
    absl::string_view name, const std::function<torch::Tensor()>& forward) {
  FLATPARAM_ASSIGN_OR_RETURN(int unit, UnitIndex(name));
  return RunUnit(unit,
                 [&]() -> absl::StatusOr<torch::Tensor> { return forward(); });
}

absl::StatusOr<torch::Tensor> FsdpModule::RecomputedUnit(
    absl::string_view name, const torch::Tensor& input,
    const std::function<torch::Tensor(const torch::Tensor&)>& forward,
    Recomputation where) {
  FLATPARAM_ASSIGN_OR_RETURN(int unit, UnitIndex(name));
  switch (where) {
    case Recomputation::kNone:
      return RunUnit(unit, [&]() -> absl::StatusOr<torch::Tensor> {
        return forward(input);
      });
    case Recomputation::kInsideUnit:
      return RunUnit(unit, [&]() -> absl::StatusOr<torch::Tensor> {
        return Recompute(forward, input);
      });
    case Recomputation::kAroundUnit:
      break;
  }
  // The unit's hooks run inside the recomputed function: in the forward
  // (gradients off, so no pre-backward hook) and again in the backward. A
  // failure there is thrown through LibTorch, its Status kept: for this
  // call in the forward, for Backward() in the backward (Fail).
  around_failure_ = absl::OkStatus();
  auto run = [this, unit, forward](const torch::Tensor& x) -> torch::Tensor {
    absl::StatusOr<torch::Tensor> out = RunUnit(
        unit, [&]() -> absl::StatusOr<torch::Tensor> { return forward(x); });
    if (out.ok()) return *out;
    if (in_backward_) {
      Fail(out.status());
    } else {
      around_failure_ = out.status();
    }
    C10_THROW_ERROR(Error, out.status().ToString());
  };
  try {
    return Recompute(run, input);
  } catch (const c10::Error& e) {
    if (!around_failure_.ok()) return std::exchange(around_failure_, {});
    return absl::InvalidArgumentError(
        absl::StrCat("LibTorch error around the forward of unit \"", name,
                     "\": ", e.what_without_backtrace()));
  }
}

absl::Status FsdpModule::Backward(const torch::Tensor& loss,
                                  bool retain_graph) {
  if (!hook_error_.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("a previous backward failed: ", hook_error_.ToString()));
  }
  try {
    loss.backward({}, retain_graph);
  } catch (const c10::Error& e) {
    absl::Status error = absl::InvalidArgumentError(absl::StrCat(
        "LibTorch error in the backward: ", e.what_without_backtrace()));
    // Before any hook ran (a loss that needs no gradient, say) nothing
    // changed. After one, the backward was abandoned part-way (units
    // unsharded, reductions issued, no final callback): the module refuses
    // further steps, as after a hook's failure.
    if (!in_backward_) return error;
    Fail(error);
  }
  return hook_error_;
}

absl::Status FsdpModule::ZeroGrad(bool set_to_none) {
  FLATPARAM_RETURN_IF_ERROR(runtime_->ZeroGrad(set_to_none));
  BindShardedGrads();
  return absl::OkStatus();
}

absl::StatusOr<double> FsdpModule::ClipGradNorm(double max_norm,
                                                double norm_type) {
  return runtime_->ClipGradNorm(max_norm, norm_type);
}

absl::StatusOr<std::map<std::string, torch::Tensor>>
FsdpModule::FullStateDict() {
  if (in_forward_ || in_backward_ || runtime_->in_iteration()) {
    return absl::FailedPreconditionError(
        "FsdpModule::FullStateDict inside an iteration");
  }
  std::map<std::string, torch::Tensor> out;
  for (int u = 0; u < runtime_->num_units(); ++u) {
    FlatParamHandle& handle = runtime_->handle(u);
    const FlatParamLayout& fp = layout().flat_params()[u];
    FLATPARAM_RETURN_IF_ERROR(
        handle.BeginSummonFullParams(/*writeback=*/false));
    absl::Status status;
    for (int i = 0; i < static_cast<int>(fp.params().size()); ++i) {
      absl::StatusOr<OrigParamView> view = handle.Param(i);
      if (!view.ok()) {
        status = view.status();
        break;
      }
      torch::Tensor t = torch::from_blob(view->data.data, view->shape,
                                         Options(view->data.dtype))
                            .clone();
      out[fp.params()[i].fqn] = t;
    }
    absl::Status end = handle.EndSummonFullParams();
    FLATPARAM_RETURN_IF_ERROR(status);
    FLATPARAM_RETURN_IF_ERROR(end);
  }
  return out;
}

namespace {

optim::OptimStateValue ToHost(const torch::Tensor& t) {
  torch::Tensor c = t.contiguous();
  DType dtype = FromTorch(c.scalar_type()).value_or(DType::kFloat32);
  HostTensor out(dtype,
                 std::vector<int64_t>(c.sizes().begin(), c.sizes().end()));
  std::memcpy(out.data(), c.data_ptr(), out.nbytes());
  return out;
}

// The optimizer's kind and its PyTorch hyperparameters.
struct OptimizerKind {
  enum { kSgd, kAdam } kind;
  const char* name;
};

absl::StatusOr<OptimizerKind> KindOf(torch::optim::Optimizer& optimizer) {
  if (dynamic_cast<torch::optim::SGD*>(&optimizer) != nullptr) {
    return OptimizerKind{OptimizerKind::kSgd, "SGD"};
  }
  if (dynamic_cast<torch::optim::AdamW*>(&optimizer) != nullptr) {
    return OptimizerKind{OptimizerKind::kAdam, "AdamW"};
  }
  if (dynamic_cast<torch::optim::Adam*>(&optimizer) != nullptr) {
    return OptimizerKind{OptimizerKind::kAdam, "Adam"};
  }
  return absl::InvalidArgumentError(
      "optimizer state: only torch::optim::SGD, Adam and AdamW are "
      "supported");
}

// Adam's and AdamW's options: the same fields, two classes.
template <typename Options>
void AdamHyperparams(const Options& o,
                     std::map<std::string, optim::HyperValue>& h) {
  h["lr"] = o.lr();
  h["betas"] =
      std::vector<double>{std::get<0>(o.betas()), std::get<1>(o.betas())};
  h["eps"] = o.eps();
  h["weight_decay"] = o.weight_decay();
  h["amsgrad"] = o.amsgrad();
}

std::map<std::string, optim::HyperValue> Hyperparams(
    const torch::optim::OptimizerOptions& options) {
  std::map<std::string, optim::HyperValue> h;
  h["maximize"] = false;
  if (auto* o = dynamic_cast<const torch::optim::SGDOptions*>(&options)) {
    h["lr"] = o->lr();
    h["momentum"] = o->momentum();
    h["dampening"] = o->dampening();
    h["weight_decay"] = o->weight_decay();
    h["nesterov"] = o->nesterov();
  } else if (auto* o =
                 dynamic_cast<const torch::optim::AdamWOptions*>(&options)) {
    AdamHyperparams(*o, h);
  } else if (auto* o =
                 dynamic_cast<const torch::optim::AdamOptions*>(&options)) {
    AdamHyperparams(*o, h);
  }
  return h;
}

// Adam's and AdamW's per-parameter states: the same fields, two classes.
template <typename State>
std::unique_ptr<torch::optim::OptimizerParamState> MakeAdamState(
    int64_t step, torch::Tensor avg, torch::Tensor avg_sq,
    torch::Tensor max_avg_sq) {
  auto state = std::make_unique<State>();
  state->step(step);
  state->exp_avg(std::move(avg));
  state->exp_avg_sq(std::move(avg_sq));
  state->max_exp_avg_sq(std::move(max_avg_sq));
  return state;
}

// PyTorch's names; "step" a 0-d float32 tensor, as PyTorch >= 1.12 keeps it.
template <typename State>
void ReadAdamState(const State& state, optim::ParamState& out) {
  out["step"] =
      optim::ScalarTensor(DType::kFloat32, static_cast<double>(state.step()));
  out["exp_avg"] = ToHost(state.exp_avg());
  out["exp_avg_sq"] = ToHost(state.exp_avg_sq());
  if (state.max_exp_avg_sq().defined()) {
    out["max_exp_avg_sq"] = ToHost(state.max_exp_avg_sq());
  }
}

std::string StateKey(const torch::Tensor& t) {
  return c10::guts::to_string(t.unsafeGetTensorImpl());
}

}  // namespace

absl::Status FsdpModule::SaveCheckpoint(checkpoint::FileSystem& fs,
                                        const std::string& dir,
                                        torch::optim::Optimizer* optimizer,
                                        const nlohmann::json& extra) {
  Communicator& world = *world_;
  const ModelLayout& model = layout();
  const int64_t shard_rank = world.rank() % model.options().world_size;
  checkpoint::RankState mine;
  absl::Status prepared = absl::OkStatus();
  if (in_forward_ || in_backward_ || runtime_->in_iteration()) {
    prepared = absl::FailedPreconditionError(
        "FsdpModule::SaveCheckpoint inside an iteration");
  }
  for (int u = 0; u < runtime_->num_units() && prepared.ok(); ++u) {
    BufferRef shard = runtime_->handle(u).sharded_param();
    HostTensor t = HostTensor::Uninitialized(shard.dtype, {shard.count});
    std::memcpy(t.data(), shard.data, t.nbytes());
    mine.flat_params.push_back(std::move(t));
  }
  if (prepared.ok() && optimizer != nullptr) {
    absl::StatusOr<optim::OptimStateDict> state = ShardedOptimState(*optimizer);
    if (state.ok()) {
      mine.optim = std::move(*state);
    } else {
      prepared = state.status();
    }
  }
  mine.extra = extra;
  absl::StatusOr<checkpoint::RankContent> content =
      prepared.ok() ? checkpoint::MakeRankContent(model, shard_rank, mine)
                    : absl::StatusOr<checkpoint::RankContent>(prepared);
  // In phases, so that a rank whose content is bad fails every rank
  // (agreed in Begin) instead of leaving them in the exchange.
  checkpoint::CollectiveWriteOptions options;
  options.collective = runtime_->options().collective_options;
  FLATPARAM_ASSIGN_OR_RETURN(
      checkpoint::CollectiveWrite begun,
      checkpoint::BeginCollectiveWrite(fs, dir, model, world.size(), world,
                                       options, content.status()));
  const absl::Status written =
      checkpoint::WriteCollectiveRankFiles(fs, begun, *content, options);
  return checkpoint::FinishCollectiveWrite(fs, begun, written, world, options);
}

absl::Status FsdpModule::LoadCheckpoint(checkpoint::FileSystem& fs,
                                        const std::string& dir,
                                        torch::optim::Optimizer* optimizer,
                                        nlohmann::json* extra) {
  Communicator& world = *world_;
  const ModelLayout& model = layout();
  const int64_t shard_rank = world.rank() % model.options().world_size;
  OptimizerStates optimizer_states;
  auto load = [&]() -> absl::StatusOr<checkpoint::RankState> {
    if (in_forward_ || in_backward_ || runtime_->in_iteration()) {
      return absl::FailedPreconditionError(
          "FsdpModule::LoadCheckpoint inside an iteration");
    }
    checkpoint::CheckpointOpenOptions open;
    open.ranks = std::vector<int64_t>{};
    FLATPARAM_ASSIGN_OR_RETURN(
        checkpoint::ShardedCheckpointReader reader,
        checkpoint::ShardedCheckpointReader::Open(fs, dir, open));
    FLATPARAM_ASSIGN_OR_RETURN(
        checkpoint::RankState state,
        checkpoint::LoadRankState(reader, model, world.size(), shard_rank));
    if (optimizer != nullptr && state.optim.state.empty()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "the checkpoint at ", dir,
          " holds no optimizer state; load it without an optimizer to "
          "start the optimizer afresh"));
    }
    if (optimizer != nullptr) {
      FLATPARAM_ASSIGN_OR_RETURN(optimizer_states,
                                 ParseOptimState(state.optim, *optimizer));
    }
    for (int u = 0; u < runtime_->num_units(); ++u) {
      BufferRef shard = runtime_->handle(u).sharded_param();
      const HostTensor& t = state.flat_params[u];
      if (t.dtype() != shard.dtype || t.numel() != shard.count) {
        return absl::FailedPreconditionError(absl::StrCat(
            "the checkpoint's shard of unit ", u, " has ", t.numel(), " ",
            DTypeName(t.dtype()), " elements; this rank's has ", shard.count,
            " ", DTypeName(shard.dtype)));
      }
    }
    return state;
  };
  absl::StatusOr<checkpoint::RankState> state = load();
  FLATPARAM_RETURN_IF_ERROR(checkpoint::AgreeOnLoad(
      world, state.status(), runtime_->options().collective_options));
  if (optimizer != nullptr) {
    InstallOptimState(std::move(optimizer_states), *optimizer);
  }
  for (int u = 0; u < runtime_->num_units(); ++u) {
    BufferRef shard = runtime_->handle(u).sharded_param();
    std::memcpy(shard.data, state->flat_params[u].data(),
                state->flat_params[u].nbytes());
  }
  if (extra != nullptr) *extra = state->extra;
  return absl::OkStatus();
}

absl::StatusOr<optim::OptimStateDict> FsdpModule::ShardedOptimState(
    torch::optim::Optimizer& optimizer) const {
  FLATPARAM_ASSIGN_OR_RETURN(OptimizerKind kind, KindOf(optimizer));
  std::map<const c10::TensorImpl*, int> unit_of;
  for (int u = 0; u < static_cast<int>(sharded_params_.size()); ++u) {
    unit_of[sharded_params_[u].unsafeGetTensorImpl()] = u;
  }
  optim::OptimStateDict dict;
  for (auto& group : optimizer.param_groups()) {
    optim::ParamGroup out;
    out.hyperparams = Hyperparams(group.options());
    for (const torch::Tensor& p : group.params()) {
      auto it = unit_of.find(p.unsafeGetTensorImpl());
      if (it == unit_of.end()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "optimizer state: the ", kind.name,
            " optimizer steps a tensor that is not one of this module's "
            "ShardedParameters() (shape ",
            c10::str(p.sizes()), ")"));
      }
      const int u = it->second;
      out.params.push_back(static_cast<int64_t>(u));
      auto state = optimizer.state().find(StateKey(p));
      if (state == optimizer.state().end()) continue;
      optim::ParamState& mine = dict.state[static_cast<int64_t>(u)];
      if (kind.kind == OptimizerKind::kSgd) {
        auto& s = static_cast<torch::optim::SGDParamState&>(*state->second);
        if (s.momentum_buffer().defined()) {
          mine["momentum_buffer"] = ToHost(s.momentum_buffer());
        }
      } else {
        // AdamWParamState has AdamParamState's fields in another class.
        if (auto* w = dynamic_cast<torch::optim::AdamWParamState*>(
                state->second.get())) {
          ReadAdamState(*w, mine);
        } else {
          ReadAdamState(
              static_cast<torch::optim::AdamParamState&>(*state->second), mine);
        }
      }
    }
    dict.param_groups.push_back(std::move(out));
  }
  return dict;
}

absl::StatusOr<FsdpModule::OptimizerStates> FsdpModule::ParseOptimState(
    const optim::OptimStateDict& sharded,
    torch::optim::Optimizer& optimizer) const {
  FLATPARAM_ASSIGN_OR_RETURN(OptimizerKind kind, KindOf(optimizer));
  const int units = static_cast<int>(sharded_params_.size());
  // Validate everything first, then replace the state.
  auto tensor = [&](int u, const optim::ParamState& state,
                    const std::string& name,
                    bool required) -> absl::StatusOr<torch::Tensor> {
    auto it = state.find(name);
    if (it == state.end()) {
      if (!required) return torch::Tensor();
      return absl::InvalidArgumentError(
          absl::StrCat("optimizer state of unit ", u, " (\"", units_[u]->name,
                       "\"): no \"", name, "\", which ", kind.name, " keeps"));
    }
    const HostTensor* t = std::get_if<HostTensor>(&it->second);
    const int64_t numel = sharded_params_[u].numel();
    if (t == nullptr || !IsFloatingPoint(t->dtype()) ||
        (name != "step" && t->numel() != numel) ||
        (name == "step" && t->numel() != 1)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "optimizer state of unit ", u, " (\"", units_[u]->name, "\"): \"",
          name, "\" is ", optim::DescribeValue(it->second), "; want ",
          name == "step" ? "a 0-d floating tensor"
                         : absl::StrCat("a floating tensor of ", numel,
                                        " elements (this rank's shard)")));
    }
    torch::Tensor out = torch::from_blob(const_cast<void*>(t->data()),
                                         {t->numel()}, Options(t->dtype()))
                            .clone()
                            .to(sharded_params_[u].scalar_type());
    return out;
  };
  OptimizerStates loaded;
  for (const auto& [key, state] : sharded.state) {
    const int64_t* index = std::get_if<int64_t>(&key);
    if (index == nullptr || *index < 0 || *index >= units) {
      return absl::InvalidArgumentError(absl::StrCat(
          "optimizer state key ", optim::DescribeKey(key),
          " is not a unit index (the flat-parameter path's keys are 0..",
          units - 1, ")"));
    }
    const int u = static_cast<int>(*index);
    const std::vector<std::string> allowed =
        kind.kind == OptimizerKind::kSgd
            ? std::vector<std::string>{"momentum_buffer"}
            : std::vector<std::string>{"step", "exp_avg", "exp_avg_sq",
                                       "max_exp_avg_sq"};
    for (const auto& [name, value] : state) {
      if (std::find(allowed.begin(), allowed.end(), name) == allowed.end()) {
        return absl::InvalidArgumentError(
            absl::StrCat("optimizer state of unit ", u, " (\"", units_[u]->name,
                         "\"): \"", name, "\" is not a state ", kind.name,
                         " keeps (", absl::StrJoin(allowed, ", "), ")"));
      }
    }
    const std::string key_string = StateKey(sharded_params_[u]);
    if (kind.kind == OptimizerKind::kSgd) {
      FLATPARAM_ASSIGN_OR_RETURN(torch::Tensor buffer,
                                 tensor(u, state, "momentum_buffer", true));
      auto s = std::make_unique<torch::optim::SGDParamState>();
      s->momentum_buffer(buffer);
      loaded[key_string] = std::move(s);
      continue;
    }
    FLATPARAM_ASSIGN_OR_RETURN(torch::Tensor step,
                               tensor(u, state, "step", true));
    FLATPARAM_ASSIGN_OR_RETURN(torch::Tensor avg,
                               tensor(u, state, "exp_avg", true));
    FLATPARAM_ASSIGN_OR_RETURN(torch::Tensor avg_sq,
                               tensor(u, state, "exp_avg_sq", true));
    FLATPARAM_ASSIGN_OR_RETURN(torch::Tensor max_avg_sq,
                               tensor(u, state, "max_exp_avg_sq", false));
    const int64_t steps =
        static_cast<int64_t>(step.to(torch::kDouble).item<double>());
    loaded[key_string] = std::string(kind.name) == "AdamW"
                             ? MakeAdamState<torch::optim::AdamWParamState>(
                                   steps, avg, avg_sq, max_avg_sq)
                             : MakeAdamState<torch::optim::AdamParamState>(
                                   steps, avg, avg_sq, max_avg_sq);
  }
  return loaded;
}

void FsdpModule::InstallOptimState(OptimizerStates states,
                                   torch::optim::Optimizer& optimizer) const {
  for (const torch::Tensor& p : sharded_params_) {
    optimizer.state().erase(StateKey(p));
  }
  for (auto& [key, state] : states) {
    optimizer.state()[key] = std::move(state);
  }
}

absl::Status FsdpModule::LoadShardedOptimState(
    const optim::OptimStateDict& sharded,
    torch::optim::Optimizer& optimizer) const {
  FLATPARAM_ASSIGN_OR_RETURN(OptimizerStates states,
                             ParseOptimState(sharded, optimizer));
  InstallOptimState(std::move(states), optimizer);
  return absl::OkStatus();
}

}  // namespace libtorch
}  // namespace flatparam
