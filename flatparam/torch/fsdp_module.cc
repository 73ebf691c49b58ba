// FsdpModule: wrapping a module (units, flat parameters, initialisation,
// sync_module_states). Binding its tensors to flatparam's memory is in
// fsdp_module_bind.cc, the forward's and backward's hooks in
// fsdp_module_hooks.cc, state dicts in fsdp_module_state.cc, optimizer
// state and checkpoints in fsdp_module_optim.cc.
#include "flatparam/torch/fsdp_module.h"

#include <torch/autograd.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/nn/init.h>
#include <torch/nn/module.h>
#include <torch/types.h>
#include <torch/utils.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/memory/memory.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/model_json.h"
#include "flatparam/torch/internal/fsdp_module_internal.h"

namespace flatparam {
namespace libtorch {

namespace internal_fsdp_module {

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

absl::StatusOr<DType> AnyDTypeFromTorch(c10::ScalarType type) {
  switch (type) {
    case c10::ScalarType::Char:
      return DType::kInt8;
    case c10::ScalarType::Byte:
      return DType::kUInt8;
    case c10::ScalarType::Short:
      return DType::kInt16;
    case c10::ScalarType::Int:
      return DType::kInt32;
    case c10::ScalarType::Long:
      return DType::kInt64;
    case c10::ScalarType::Bool:
      return DType::kBool;
    default:
      return FromTorch(type);
  }
}

c10::ScalarType ToTorch(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return c10::ScalarType::Float;
    case DType::kFloat64:
      return c10::ScalarType::Double;
    case DType::kFloat16:
      return c10::ScalarType::Half;
    case DType::kBFloat16:
      return c10::ScalarType::BFloat16;
    case DType::kInt8:
      return c10::ScalarType::Char;
    case DType::kUInt8:
      return c10::ScalarType::Byte;
    case DType::kInt16:
      return c10::ScalarType::Short;
    case DType::kInt32:
      return c10::ScalarType::Int;
    case DType::kInt64:
      return c10::ScalarType::Long;
    case DType::kBool:
      return c10::ScalarType::Bool;
  }
  return c10::ScalarType::Float;
}

torch::TensorOptions OptionsOn(DType dtype, c10::Device device) {
  return torch::TensorOptions().dtype(ToTorch(dtype)).device(device);
}

std::string Quoted(const std::vector<std::string>& names) {
  std::vector<std::string> quoted;
  for (const std::string& n : names) {
    quoted.push_back(absl::StrCat("\"", n, "\""));
  }
  return absl::StrJoin(quoted, ", ");
}

torch::Tensor OverOn(const BufferRef& buffer, c10::Device device) {
  return torch::from_blob(buffer.data, {buffer.count},
                          OptionsOn(buffer.dtype, device));
}

torch::Tensor CpuCopy(const torch::Tensor& t) {
  return t.to(c10::Device(c10::kCPU), t.scalar_type(), /*non_blocking=*/false,
              /*copy=*/true);
}

void SwappableViews::Make(DType new_dtype, const FlatParamLayout& layout,
                          c10::Device on) {
  torch::NoGradGuard no_grad;
  dtype = new_dtype;
  device = on;
  int64_t numel = 0;
  for (const ParamInfo& p : layout.params()) {
    numel = std::max(numel, p.offset + p.numel);
  }
  const int64_t bytes = numel * DTypeSize(dtype);
  storage = c10::Storage(c10::Storage::use_byte_size_t(), bytes,
                         at::DataPtr(nullptr, device),
                         /*allocator=*/nullptr, /*resizable=*/false);
  views.clear();
  for (const ParamInfo& p : layout.params()) {
    std::vector<int64_t> strides(p.shape.size(), 1);
    for (int d = static_cast<int>(p.shape.size()) - 2; d >= 0; --d) {
      strides[d] = strides[d + 1] * p.shape[d + 1];
    }
    torch::Tensor view = torch::empty({0}, OptionsOn(dtype, device));
    view.set_(storage, p.offset, p.shape, strides);
    views.push_back(view);
  }
  bound = nullptr;
}

void SwappableViews::Point(const std::optional<BufferRef>& buffer) {
  void* data = buffer ? buffer->data : nullptr;
  if (data == bound) return;
  storage.set_data_ptr_noswap(at::DataPtr(data, device));
  storage.set_nbytes(buffer ? buffer->bytes() : 0);
  bound = data;
}

}  // namespace internal_fsdp_module

using internal_fsdp_module::FromTorch;
using internal_fsdp_module::OptionsOn;
using internal_fsdp_module::OverOn;
using internal_fsdp_module::Quoted;

namespace {

// PyTorch's sync_module_states for one tensor, whose memory is on
// `device` (flatparam's name for it): rank 0's bytes on every rank.
// Collectives move floating elements, so other dtypes' bytes travel as
// float32 words (a broadcast copies them unchanged) and come back.
absl::Status BroadcastFromRank0(Communicator& world, torch::Tensor& t,
                                Device device, const std::string& what) {
  if (t.numel() == 0) return absl::OkStatus();
  BroadcastOptions from_rank0;
  from_rank0.root = 0;
  absl::Status status;
  absl::StatusOr<DType> dtype = FromTorch(t.scalar_type());
  if (dtype.ok()) {
    status = world
                 .Broadcast(BufferRef{t.data_ptr(), t.numel(), *dtype, device},
                            from_rank0)
                 ->Wait();
  } else {
    torch::NoGradGuard no_grad;
    const int64_t nbytes = static_cast<int64_t>(t.nbytes());
    const torch::Tensor bytes = t.view({-1}).view(torch::kUInt8);
    torch::Tensor words =
        torch::zeros({(nbytes + 3) / 4}, t.options().dtype(torch::kFloat32));
    torch::Tensor word_bytes = words.view(torch::kUInt8).narrow(0, 0, nbytes);
    word_bytes.copy_(bytes);
    status = world
                 .Broadcast(BufferRef{words.data_ptr(), words.numel(),
                                      DType::kFloat32, device},
                            from_rank0)
                 ->Wait();
    bytes.copy_(word_bytes);
  }
  if (status.ok()) return status;
  return absl::Status(status.code(), absl::StrCat("sync_module_states, ", what,
                                                  ": ", status.message()));
}

}  // namespace

// ---------------------------------------------------------------------------
// Wrapping

FsdpModule::FsdpModule(std::shared_ptr<torch::nn::Module> module,
                       Communicator* world, bool use_orig_params)
    : module_(std::move(module)),
      world_(world),
      use_orig_params_(use_orig_params),
      hooks_(std::make_shared<HookTarget>()) {
  hooks_->module = this;
}

FsdpModule::~FsdpModule() {
  hooks_->module = nullptr;
  // The module's parameters (and tensors autograd saved from them) must
  // not point into the runtime's memory once it is freed.
  torch::NoGradGuard no_grad;
  for (auto& u : units_) {
    torch::Tensor empty = torch::empty({0}, Options(u->param_views.dtype));
    for (torch::Tensor& t : u->params) {
      t.set_data(empty);
      t.mutable_grad().reset();
    }
    u->param_views.Point(std::nullopt);
    u->grad_views.Point(std::nullopt);
  }
}

absl::StatusOr<std::unique_ptr<FsdpModule>> FsdpModule::Wrap(
    std::shared_ptr<torch::nn::Module> module, Communicator* world,
    DeviceOps* device, const FsdpOptions& options) {
  if (device != nullptr && device->device() != Device::Host()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "FsdpModule::Wrap: DeviceOps on ", DeviceName(device->device()),
        "; LibTorch tensors on a device need the TorchDevice that orders "
        "LibTorch's kernels with it (TorchCudaDeviceOps for CUDA, "
        "flatparam/torch/torch_cuda.h)"));
  }
  std::unique_ptr<TorchDevice> host =
      device == nullptr ? nullptr : std::make_unique<HostTorchDevice>(device);
  FLATPARAM_ASSIGN_OR_RETURN(
      std::unique_ptr<FsdpModule> fsdp,
      Wrap(std::move(module), world, host.get(), options));
  fsdp->owned_device_ = std::move(host);
  return fsdp;
}

absl::StatusOr<std::unique_ptr<FsdpModule>> FsdpModule::Wrap(
    std::shared_ptr<torch::nn::Module> module, Communicator* world,
    TorchDevice* torch_device, const FsdpOptions& options) {
  if (module == nullptr || world == nullptr || torch_device == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "FsdpModule::Wrap needs a module, a communicator and a device (",
        module == nullptr ? "module" : "", world == nullptr ? " world" : "",
        torch_device == nullptr ? " device" : "", " missing)"));
  }
  DeviceOps* const device = &torch_device->ops();
  if (options.handle.streams.compute != Stream{0}) {
    return absl::InvalidArgumentError(absl::StrCat(
        "FsdpModule::Wrap: HandleOptions::streams.compute is stream ",
        options.handle.streams.compute.id,
        "; LibTorch's kernels run in order with the DeviceOps' stream 0 "
        "(torch_device.h), so the compute stream must be stream 0"));
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

  auto fsdp =
      absl::WrapUnique(new FsdpModule(module, world, options.use_orig_params));
  fsdp->device_ = torch_device;
  fsdp->cast_root_forward_inputs_ = options.cast_root_forward_inputs;
  fsdp->cast_forward_inputs_ = options.cast_forward_inputs;
  ModelSpec spec;
  spec.name = module->name();
  spec.wrap = options.wrap;
  if (!options.wrap_module_types.empty()) {
    std::set<std::string> types;
    std::set<std::string> matched;
    for (const auto& item : module->named_modules(/*name_prefix=*/"",
                                                  /*include_self=*/false)) {
      // Module::name() is the qualified class name; the last component
      // alone names it too.
      const std::string type = item.value()->name();
      const size_t colon = type.rfind("::");
      const std::string last =
          colon == std::string::npos ? type : type.substr(colon + 2);
      types.insert(last);
      for (const std::string& want : options.wrap_module_types) {
        if (want == type || want == last) {
          spec.wrap.push_back(item.key());
          matched.insert(want);
          break;
        }
      }
    }
    for (const std::string& type : options.wrap_module_types) {
      if (matched.count(type) == 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "FsdpOptions::wrap_module_types: no module of \"", module->name(),
            "\" is a \"", type,
            "\" (its submodules' types: ", absl::StrJoin(types, ", "), ")"));
      }
    }
  }
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
    if (t.is_meta()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "parameter \"", name,
          "\" is on the meta device. LibTorch 1.13 cannot move a parameter "
          "from the meta device to the CPU in place (set_data: \"incompatible "
          "tensor type\"), and FsdpModule keeps the module's parameter "
          "objects: build the module on the CPU with uninitialised storage "
          "(torch::empty touches no memory until written) and give "
          "FsdpOptions::param_init_fn, which Wrap calls unit by unit, "
          "freeing each unit's full values once sharded"));
    }
    FLATPARAM_RETURN_IF_ERROR(
        fsdp->CheckOnDevice(t, absl::StrCat("parameter \"", name, "\"")));
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
    tensors[name] = t;
  }
  if (spec.params.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("module \"", module->name(), "\" has no parameters"));
  }
  // The buffers as a state dict holds them: their own dtype, before any
  // buffer_dtype cast, so that checkpoints do not depend on it.
  for (const auto& item : module->named_buffers(/*recurse=*/true)) {
    const torch::Tensor& b = item.value();
    if (!b.defined()) continue;
    BufferSpec buffer;
    buffer.fqn = item.key();
    buffer.shape.assign(b.sizes().begin(), b.sizes().end());
    absl::StatusOr<DType> dtype =
        internal_fsdp_module::AnyDTypeFromTorch(b.scalar_type());
    if (!dtype.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "buffer \"", item.key(), "\": ", dtype.status().message()));
    }
    buffer.dtype = *dtype;
    spec.buffers.push_back(std::move(buffer));
  }
  LayoutOptions layout_options;
  layout_options.world_size = shard_size;
  layout_options.strategy = options.strategy;
  layout_options.align_addresses =
      options.align_addresses || options.use_orig_params;
  layout_options.compute_dtype = options.handle.param_dtype;
  FLATPARAM_ASSIGN_OR_RETURN(ModelLayout layout,
                             ModelLayout::Create(spec, layout_options));
  // The flat path's optimizer steps a unit's whole shard: weight decay
  // would move the frozen elements of a unit that mixes them.
  if (!options.use_orig_params) {
    for (const FlatParamLayout& fp : layout.flat_params()) {
      const ParamInfo* frozen = nullptr;
      const ParamInfo* trainable = nullptr;
      for (const ParamInfo& p : fp.params()) {
        (p.requires_grad ? trainable : frozen) = &p;
      }
      if (frozen != nullptr && trainable != nullptr) {
        return absl::InvalidArgumentError(absl::StrCat(
            "FsdpModule::Wrap: unit \"", fp.unit(),
            "\" mixes frozen parameters (\"", frozen->fqn,
            "\") and trainable ones (\"", trainable->fqn,
            "\"); an optimizer over its flat shard would step the frozen "
            "elements too (weight decay moves them). Set "
            "FsdpOptions::use_orig_params = true (PyTorch's "
            "use_orig_params=True: the optimizer steps each trainable "
            "parameter's piece), or give the frozen parameters units of "
            "their own"));
      }
    }
  }
  // Each parameter's own module, for param_init_fn.
  std::map<const c10::TensorImpl*, std::shared_ptr<torch::nn::Module>> owner;
  for (const auto& item : module->named_modules()) {
    for (const auto& p : item.value()->named_parameters(/*recurse=*/false)) {
      owner.emplace(p.value().unsafeGetTensorImpl(), item.value());
    }
  }
  std::set<const torch::nn::Module*> initialised;
  // Runs param_init_fn on `m` once, checking it kept the parameters.
  auto initialise = [&](torch::nn::Module& m) -> absl::Status {
    if (!options.param_init_fn || !initialised.insert(&m).second) {
      return absl::OkStatus();
    }
    torch::NoGradGuard no_grad;
    std::vector<const c10::TensorImpl*> before;
    for (const auto& p : m.named_parameters(/*recurse=*/false)) {
      before.push_back(p.value().unsafeGetTensorImpl());
    }
    options.param_init_fn(m);
    size_t i = 0;
    for (const auto& p : m.named_parameters(/*recurse=*/false)) {
      if (i >= before.size() ||
          p.value().unsafeGetTensorImpl() != before[i++]) {
        return absl::InvalidArgumentError(
            absl::StrCat("param_init_fn replaced parameter \"", p.key(),
                         "\" of module \"", m.name(),
                         "\"; give the parameter its values in place (copy_, "
                         "torch::nn::init)"));
      }
    }
    return absl::OkStatus();
  };
  const bool sync = options.sync_module_states;
  // With an initialisation or rank 0's values to receive, each unit's full
  // values are freed as soon as its shard is made (a rank then holds one
  // unit's full values at a time); otherwise they are the caller's,
  // freed once every unit is made.
  const bool free_per_unit = options.param_init_fn != nullptr || sync;
  FLATPARAM_ASSIGN_OR_RETURN(
      fsdp->runtime_,
      FsdpRuntime::CreateUnitByUnit(
          layout,
          [&](int u) -> absl::StatusOr<std::vector<ConstBufferRef>> {
            std::vector<ConstBufferRef> refs;
            const DType unit_dtype = layout.flat_params()[u].dtype();
            for (const ParamInfo& info : layout.flat_params()[u].params()) {
              torch::Tensor& t = tensors.at(info.fqn);
              FLATPARAM_RETURN_IF_ERROR(
                  initialise(*owner.at(t.unsafeGetTensorImpl())));
              const std::vector<int64_t> shape(t.sizes().begin(),
                                               t.sizes().end());
              if (t.device() != torch_device->torch_device() ||
                  shape != info.shape ||
                  FromTorch(t.scalar_type()).value_or(DType::kInt64) !=
                      unit_dtype ||
                  !t.is_contiguous()) {
                return absl::InvalidArgumentError(absl::StrCat(
                    "parameter \"", info.fqn, "\" became ", t.device().str(),
                    " ", c10::toString(t.scalar_type()), " ",
                    c10::str(t.sizes()),
                    t.is_contiguous() ? "" : " (not contiguous)",
                    " in param_init_fn; it must stay a contiguous tensor on ",
                    torch_device->torch_device().str(),
                    " of its shape and dtype"));
              }
              if (sync) {
                FLATPARAM_RETURN_IF_ERROR(fsdp->WaitForTorch());
                FLATPARAM_RETURN_IF_ERROR(BroadcastFromRank0(
                    *world, t, fsdp->FlatDeviceOf(t),
                    absl::StrCat("parameter \"", info.fqn, "\"")));
              }
              refs.push_back(ConstBufferRef{t.data_ptr(), t.numel(), unit_dtype,
                                            fsdp->FlatDeviceOf(t)});
            }
            return refs;
          },
          // The handle holds the unit's shard now: the full values go (one
          // unit's at a time, for a module made on the meta device).
          [&](int u) {
            torch::NoGradGuard no_grad;
            for (const ParamInfo& info : layout.flat_params()[u].params()) {
              torch::Tensor& t = tensors.at(info.fqn);
              if (free_per_unit) t.set_data(torch::empty({0}, t.options()));
            }
          },
          world, device, options.handle, options.runtime));

  // Buffers: initialised where their module owns no parameter (so
  // param_init_fn has not run on it), rank 0's if synced, cast if asked.
  for (const auto& item : module->named_modules()) {
    if (!item.value()->named_buffers(/*recurse=*/false).is_empty()) {
      FLATPARAM_RETURN_IF_ERROR(initialise(*item.value()));
    }
  }
  for (const auto& item : module->named_buffers(/*recurse=*/true)) {
    torch::Tensor b = item.value();
    if (!b.defined()) continue;
    FLATPARAM_RETURN_IF_ERROR(
        fsdp->CheckOnDevice(b, absl::StrCat("buffer \"", item.key(), "\"")));
    if (!b.is_contiguous()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "buffer \"", item.key(),
          "\" is not contiguous; FsdpModule keeps buffers as contiguous "
          "tensors"));
    }
    if (sync) {
      FLATPARAM_RETURN_IF_ERROR(fsdp->WaitForTorch());
      FLATPARAM_RETURN_IF_ERROR(
          BroadcastFromRank0(*world, b, fsdp->FlatDeviceOf(b),
                             absl::StrCat("buffer \"", item.key(), "\"")));
    }
    fsdp->buffers_.emplace_back(item.key(), b);
    fsdp->buffer_dtypes_.push_back(b.scalar_type());
  }
  if (options.buffer_dtype.has_value()) {
    torch::NoGradGuard no_grad;
    const c10::ScalarType dtype =
        internal_fsdp_module::ToTorch(*options.buffer_dtype);
    for (auto& [name, b] : fsdp->buffers_) {
      if (b.is_floating_point() && b.scalar_type() != dtype) {
        b.set_data(b.to(dtype));
      }
    }
  }

  // The module's parameters give up their memory: flatparam's local shards
  // hold the values now.
  torch::NoGradGuard no_grad;
  const ModelLayout& final_layout = fsdp->runtime_->layout();
  std::map<std::string, std::pair<int, int>> where;
  for (int u = 0; u < fsdp->runtime_->num_units(); ++u) {
    const FlatParamLayout& fp = final_layout.flat_params()[u];
    auto state = std::make_unique<UnitState>();
    state->name = fp.unit();
    const FlatParamHandle& handle = fsdp->runtime_->handle(u);
    for (int i = 0; i < static_cast<int>(fp.params().size()); ++i) {
      state->params.push_back(tensors.at(fp.params()[i].fqn));
      state->fqns.push_back(fp.params()[i].fqn);
      const bool trainable = handle.requires_grad(i);
      state->trainable.push_back(trainable ? 1 : 0);
      state->num_trainable += trainable ? 1 : 0;
      where[fp.params()[i].fqn] = {u, i};
    }
    state->accumulators.resize(fp.params().size());
    state->expected_graphs.resize(fp.params().size());
    state->arrived.assign(fp.params().size(), 0);
    const DType dtype = options.handle.param_dtype.value_or(fp.dtype());
    state->param_views.Make(dtype, fp, torch_device->torch_device());
    state->grad_views.Make(dtype, fp, torch_device->torch_device());
    torch::Tensor empty = torch::empty({0}, fsdp->Options(dtype));
    for (torch::Tensor& t : state->params) t.set_data(empty);
    fsdp->units_.push_back(std::move(state));
    if (!options.use_orig_params) {
      fsdp->optimizer_tensors_.push_back(
          fsdp->Over(handle.sharded_param()).set_requires_grad(true));
    }
  }
  if (options.use_orig_params) {
    // One tensor per original parameter, in named_parameters() order.
    for (const auto& [name, t] : fsdp->wrapped_params_) {
      auto it = where.find(name);
      if (it == where.end() || tensors.count(name) == 0) continue;
      auto [u, i] = it->second;
      fsdp->orig_params_.push_back(OrigParam{name, u, i});
      fsdp->optimizer_tensors_.push_back(torch::Tensor());
    }
  }
  fsdp->bound_grads_.resize(fsdp->optimizer_tensors_.size());
  fsdp->versions_at_forward_.resize(fsdp->optimizer_tensors_.size());
  fsdp->training_ = module->is_training();
  for (int u = 0; u < fsdp->runtime_->num_units(); ++u) {
    FLATPARAM_RETURN_IF_ERROR(
        fsdp->runtime_->handle(u).SetTraining(fsdp->training_));
  }
  fsdp->BindShardedGrads();
  // The optimizer's first step reads the shards the runtime wrote.
  FLATPARAM_RETURN_IF_ERROR(fsdp->HandToTorch());
  return fsdp;
}

// ---------------------------------------------------------------------------
// Devices

torch::TensorOptions FsdpModule::Options(DType dtype) const {
  return OptionsOn(dtype, device_->torch_device());
}

c10::Device FsdpModule::TorchDeviceOf(Device device) const {
  return device == Device::Host() ? c10::Device(c10::kCPU)
                                  : device_->torch_device();
}

torch::Tensor FsdpModule::Over(const BufferRef& buffer) const {
  return OverOn(buffer, TorchDeviceOf(buffer.device));
}

torch::Tensor FsdpModule::Over(const BufferRef& buffer,
                               c10::IntArrayRef shape) const {
  return torch::from_blob(
      buffer.data, shape,
      OptionsOn(buffer.dtype, TorchDeviceOf(buffer.device)));
}

Device FsdpModule::FlatDeviceOf(const torch::Tensor& t) const {
  // A CPU tensor's memory is the host's even where the DeviceOps' device
  // memory is host memory too (a simulated device under CPU tensors).
  if (t.device().is_cpu()) return Device::Host();
  return device_->ops().device();
}

absl::Status FsdpModule::CheckOnDevice(const torch::Tensor& t,
                                       absl::string_view what) const {
  if (t.device() == device_->torch_device()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      what, " is on ", t.device().str(), "; FsdpModule's device is ",
      device_->torch_device().str(), " (", DeviceName(device_->ops().device()),
      " of DeviceOps \"", device_->ops().name(), "\")"));
}

absl::Status FsdpModule::WaitForTorch() {
  // LibTorch's kernels run in order with stream 0 (torch_device.h).
  return device_->ops().Synchronize();
}

absl::Status FsdpModule::HandToTorch() { return device_->HandToTorch(); }

void FsdpModule::HandToTorchInHook() {
  absl::Status status = device_->HandToTorch();
  if (status.ok()) return;
  Fail(status);
  TORCH_CHECK(false, status.ToString());
}

void FsdpModule::CheckStreamInHook() {
  absl::Status status = device_->CheckCurrentStream();
  if (status.ok()) return;
  Fail(status);
  TORCH_CHECK(false, status.ToString());
}

nlohmann::json FsdpModule::ModelFile() const {
  return ModelSpecToJson(layout().spec());
}

std::vector<std::string> FsdpModule::unit_names() const {
  std::vector<std::string> names;
  for (const auto& u : units_) names.push_back(u->name);
  return names;
}

namespace {

// Module::parameters_ is protected: a derived class may name it, and a
// pointer to it reads any module's parameters in place, without the
// ordered dict of joined names that named_parameters() builds.
struct OwnParameters : torch::nn::Module {
  static const torch::OrderedDict<std::string, torch::Tensor>& Of(
      const torch::nn::Module& m) {
    return m.*(&OwnParameters::parameters_);
  }
};

// Compares `m`'s parameters, in named_parameters(recurse=true)'s order
// (the module's own, then each child's in turn), with `wrapped` from
// `*next` on; false at the first difference.
bool SameParameters(
    const torch::nn::Module& m,
    const std::vector<std::pair<std::string, torch::Tensor>>& wrapped,
    size_t* next) {
  for (const auto& item : OwnParameters::Of(m)) {
    if (!item.value().defined()) continue;  // named_parameters skips them
    if (*next >= wrapped.size() ||
        item.value().unsafeGetTensorImpl() !=
            wrapped[*next].second.unsafeGetTensorImpl()) {
      return false;
    }
    ++*next;
  }
  for (const auto& child : m.children()) {
    if (!SameParameters(*child, wrapped, next)) return false;
  }
  return true;
}

}  // namespace

absl::Status FsdpModule::CheckModuleUnchanged() const {
  // Every Forward checks: compare tensor pointers in place first, and
  // build the names only to say what changed.
  size_t next = 0;
  if (SameParameters(*module_, wrapped_params_, &next) &&
      next == wrapped_params_.size()) {
    return absl::OkStatus();
  }
  size_t i = 0;
  absl::Status status;
  auto check = [&](const std::string& name, const torch::Tensor& t) {
    if (!status.ok()) return;
    if (i >= wrapped_params_.size()) {
      status = absl::FailedPreconditionError(absl::StrCat(
          "the module has a parameter \"", name,
          "\" it did not have when it was wrapped; wrap the module again "
          "(after FullStateDict) to change its parameters"));
      return;
    }
    if (t.unsafeGetTensorImpl() !=
        wrapped_params_[i].second.unsafeGetTensorImpl()) {
      status = absl::FailedPreconditionError(absl::StrCat(
          "the module's parameter \"", name, "\" (number ", i,
          ") is not the tensor \"", wrapped_params_[i].first,
          "\" it was wrapped with (a parameter replaced or reassigned "
          "after Wrap); wrap the module again to change its parameters"));
    }
    ++i;
  };
  for (const auto& item : module_->named_parameters(/*recurse=*/true)) {
    check(item.key(), item.value());
  }
  FLATPARAM_RETURN_IF_ERROR(status);
  if (i != wrapped_params_.size()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the module lost parameter \"", wrapped_params_[i].first,
        "\" after it was wrapped; wrap the module again to change its "
        "parameters"));
  }
  return absl::OkStatus();
}

}  // namespace libtorch
}  // namespace flatparam
