// FsdpModule: wrapping a module, binding its parameters to flatparam's
// memory, and the forward's and backward's hooks. State dicts, optimizer
// state and checkpoints are in fsdp_module_state.cc.
#include "flatparam/torch/fsdp_module.h"

#include <ATen/SequenceNumber.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "absl/memory/memory.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
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

torch::Tensor Over(const BufferRef& buffer) {
  return torch::from_blob(buffer.data, {buffer.count}, Options(buffer.dtype));
}

void SwappableViews::Make(DType new_dtype, const FlatParamLayout& layout) {
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
}

void SwappableViews::Point(const std::optional<BufferRef>& buffer) {
  void* data = buffer ? buffer->data : nullptr;
  if (data == bound) return;
  storage.set_data_ptr_noswap(at::DataPtr(data, at::Device(at::kCPU)));
  storage.set_nbytes(buffer ? buffer->bytes() : 0);
  bound = data;
}

}  // namespace internal_fsdp_module

using internal_fsdp_module::FromTorch;
using internal_fsdp_module::Options;
using internal_fsdp_module::Over;
using torch::autograd::Node;
using torch::autograd::variable_list;

namespace {

std::string Describe(const std::vector<std::string>& names) {
  std::vector<std::string> quoted;
  for (const std::string& n : names)
    quoted.push_back(absl::StrCat("\"", n, "\""));
  return absl::StrJoin(quoted, ", ");
}

// PyTorch's sync_module_states for one tensor: rank 0's bytes on every
// rank. Collectives move floating elements, so other dtypes' bytes travel
// as float32 words (a broadcast copies them unchanged) and come back.
absl::Status BroadcastFromRank0(Communicator& world, torch::Tensor& t,
                                const std::string& what) {
  if (t.numel() == 0) return absl::OkStatus();
  BroadcastOptions from_rank0;
  from_rank0.root = 0;
  absl::Status status;
  absl::StatusOr<DType> dtype = FromTorch(t.scalar_type());
  if (dtype.ok()) {
    status = world
                 .Broadcast(
                     BufferRef{t.data_ptr(), t.numel(), *dtype, Device::Host()},
                     from_rank0)
                 ->Wait();
  } else {
    const int64_t nbytes = static_cast<int64_t>(t.nbytes());
    std::vector<float> words((nbytes + 3) / 4, 0.0f);
    std::memcpy(words.data(), t.data_ptr(), nbytes);
    status = world
                 .Broadcast(
                     BufferRef{words.data(), static_cast<int64_t>(words.size()),
                               DType::kFloat32, Device::Host()},
                     from_rank0)
                 ->Wait();
    std::memcpy(t.data_ptr(), words.data(), nbytes);
  }
  if (status.ok()) return status;
  return absl::Status(status.code(), absl::StrCat("sync_module_states, ", what,
                                                  ": ", status.message()));
}

// A Status for an exception the caller's forward threw, naming `where`.
absl::Status ForwardException(const std::string& where) {
  try {
    throw;
  } catch (const c10::Error& e) {
    return absl::InvalidArgumentError(
        absl::StrCat("LibTorch error in the forward", where, ": ",
                     e.what_without_backtrace(),
                     " (if a parameter is empty: a unit's parameters hold "
                     "values only inside its FsdpModule::Unit(...) call)"));
  } catch (const std::exception& e) {
    return absl::UnknownError(
        absl::StrCat("exception in the forward", where, ": ", e.what()));
  } catch (...) {
    return absl::UnknownError(
        absl::StrCat("an exception that is not a std::exception was thrown "
                     "in the forward",
                     where));
  }
}

bool NeedsGradient(const torch::Tensor& t) {
  return t.defined() && t.requires_grad();
}

// Whether the backward the engine runs now will run `node` (it is in the
// graph, and a backward that computes only some gradients needs it).
bool WillRun(Node* node) {
  const std::unordered_set<Node*>* in_graph =
      torch::autograd::get_current_graph_task_nodes_in_graph();
  if (in_graph == nullptr || in_graph->count(node) == 0) return false;
  const auto* exec = torch::autograd::get_current_graph_task_exec_info();
  if (exec == nullptr || exec->empty()) return true;
  auto it = exec->find(node);
  return it != exec->end() && it->second.needed_;
}

}  // namespace

// ---------------------------------------------------------------------------
// The hooks: thin objects that call back into the module while it lives.

struct FsdpModule::HookTarget {
  FsdpModule* module = nullptr;
};

// On a trainable parameter's gradient accumulator: after it accumulated
// (PyTorch's post-accumulate-grad hook on the flat parameter).
class FsdpModule::AccumulateHook : public torch::autograd::FunctionPostHook {
 public:
  AccumulateHook(std::shared_ptr<HookTarget> target, int unit, int index)
      : target_(std::move(target)), unit_(unit), index_(index) {}
  variable_list operator()(const variable_list& outputs,
                           const variable_list& /*inputs*/) override {
    if (target_->module != nullptr) {
      target_->module->OnGradAccumulated(unit_, index_);
    }
    return outputs;
  }

 private:
  std::shared_ptr<HookTarget> target_;
  int unit_;
  int index_;
};

// Before an autograd node of a unit's forward runs: the unit is gathered
// (if no output hook did it yet).
class FsdpModule::NodePreHook : public torch::autograd::FunctionPreHook {
 public:
  NodePreHook(std::shared_ptr<HookTarget> target, int64_t iteration, int unit)
      : target_(std::move(target)), iteration_(iteration), unit_(unit) {}
  variable_list operator()(const variable_list& grads) override {
    if (FsdpModule* m = target_->module) {
      m->CheckHookIteration(iteration_);
      m->OnNodeStart(unit_);
    }
    return grads;
  }

 private:
  std::shared_ptr<HookTarget> target_;
  int64_t iteration_;
  int unit_;
};

// After it ran: one node fewer before the unit's backward is complete.
class FsdpModule::NodePostHook : public torch::autograd::FunctionPostHook {
 public:
  NodePostHook(std::shared_ptr<HookTarget> target, int64_t iteration, int unit,
               size_t node)
      : target_(std::move(target)),
        iteration_(iteration),
        unit_(unit),
        node_(node) {}
  variable_list operator()(const variable_list& outputs,
                           const variable_list& /*inputs*/) override {
    FsdpModule* m = target_->module;
    if (m != nullptr && m->iteration_ == iteration_) {
      m->OnNodeDone(unit_, node_);
    }
    return outputs;
  }

 private:
  std::shared_ptr<HookTarget> target_;
  int64_t iteration_;
  int unit_;
  size_t node_;
};

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

  auto fsdp =
      absl::WrapUnique(new FsdpModule(module, world, options.use_orig_params));
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
    tensors[name] = t;
  }
  if (spec.params.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("module \"", module->name(), "\" has no parameters"));
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
              if (!t.device().is_cpu() || shape != info.shape ||
                  FromTorch(t.scalar_type()).value_or(DType::kInt64) !=
                      unit_dtype ||
                  !t.is_contiguous()) {
                return absl::InvalidArgumentError(absl::StrCat(
                    "parameter \"", info.fqn, "\" became ", t.device().str(),
                    " ", c10::toString(t.scalar_type()), " ",
                    c10::str(t.sizes()),
                    t.is_contiguous() ? "" : " (not contiguous)",
                    " in param_init_fn; it must stay a contiguous CPU tensor "
                    "of its shape and dtype"));
              }
              if (sync) {
                FLATPARAM_RETURN_IF_ERROR(BroadcastFromRank0(
                    *world, t, absl::StrCat("parameter \"", info.fqn, "\"")));
              }
              refs.push_back(ConstBufferRef{t.data_ptr(), t.numel(), unit_dtype,
                                            Device::Host()});
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
    if (!b.device().is_cpu() || !b.is_contiguous()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "buffer \"", item.key(), "\" is ",
          b.device().is_cpu() ? "not contiguous" : b.device().str(),
          "; FsdpModule keeps buffers as contiguous CPU tensors"));
    }
    if (sync) {
      FLATPARAM_RETURN_IF_ERROR(BroadcastFromRank0(
          *world, b, absl::StrCat("buffer \"", item.key(), "\"")));
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
    state->param_views.Make(dtype, fp);
    state->grad_views.Make(dtype, fp);
    torch::Tensor empty = torch::empty({0}, Options(dtype));
    for (torch::Tensor& t : state->params) t.set_data(empty);
    fsdp->units_.push_back(std::move(state));
    if (!options.use_orig_params) {
      fsdp->optimizer_tensors_.push_back(
          Over(handle.sharded_param()).set_requires_grad(true));
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
  return fsdp;
}

nlohmann::json FsdpModule::ModelFile() const {
  return ModelSpecToJson(layout().spec());
}

std::vector<std::string> FsdpModule::unit_names() const {
  std::vector<std::string> names;
  for (const auto& u : units_) names.push_back(u->name);
  return names;
}

absl::Status FsdpModule::CheckModuleUnchanged() const {
  // named_parameters() builds an ordered dict of strings; walking the
  // modules compares tensors without it.
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

// ---------------------------------------------------------------------------
// Binding the module's tensors to flatparam's memory

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
      std::shared_ptr<Node> acc =
          torch::autograd::impl::grad_accumulator(u.params[i]);
      if (acc == nullptr || acc == u.accumulators[i]) continue;
      acc->add_post_hook(
          std::make_unique<AccumulateHook>(hooks_, unit, static_cast<int>(i)));
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
  auto bind = [](torch::Tensor& t, const BufferRef& memory,
                 const std::optional<BufferRef>& grad, torch::Tensor& bound,
                 bool requires_grad) {
    if (!t.defined() || (memory.count > 0 && t.data_ptr() != memory.data) ||
        t.numel() != memory.count) {
      torch::Tensor over = Over(memory);
      if (t.defined()) {
        t.set_data(over);
      } else {
        t = over.set_requires_grad(requires_grad);
      }
    }
    if (grad.has_value()) {
      if (!bound.defined() || bound.data_ptr() != grad->data ||
          bound.numel() != grad->count) {
        bound = Over(*grad);
      }
      t.mutable_grad() = bound;
    } else {
      bound = torch::Tensor();
      t.mutable_grad().reset();
    }
  };
  if (!use_orig_params_) {
    for (int u = 0; u < static_cast<int>(units_.size()); ++u) {
      const FlatParamHandle& handle = runtime_->handle(u);
      bind(optimizer_tensors_[u], handle.sharded_param(), handle.sharded_grad(),
           bound_grads_[u], true);
    }
    return;
  }
  for (size_t k = 0; k < orig_params_.size(); ++k) {
    const OrigParam& p = orig_params_[k];
    const FlatParamHandle& handle = runtime_->handle(p.unit);
    const ShardParamInfo info =
        layout().flat_params()[p.unit].shard_param_info(handle.rank(), p.index);
    BufferRef shard = handle.sharded_param();
    BufferRef piece{static_cast<char*>(shard.data) +
                        info.offset_in_shard * DTypeSize(shard.dtype),
                    info.in_shard ? info.numel_in_shard : 0, shard.dtype,
                    shard.device};
    absl::StatusOr<std::optional<BufferRef>> grad =
        handle.ShardedGradView(p.index);
    bind(optimizer_tensors_[k], piece,
         grad.ok() ? *grad : std::optional<BufferRef>(), bound_grads_[k],
         handle.requires_grad(p.index));
  }
}

std::vector<torch::Tensor> FsdpModule::ShardedParameters() const {
  return optimizer_tensors_;
}

absl::StatusOr<std::vector<std::pair<std::string, torch::Tensor>>>
FsdpModule::NamedShardedParameters() const {
  if (!use_orig_params_) {
    return absl::FailedPreconditionError(
        "FsdpModule::NamedShardedParameters needs FsdpOptions::"
        "use_orig_params (without it the optimizer steps one flat shard per "
        "unit: ShardedParameters())");
  }
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (size_t k = 0; k < orig_params_.size(); ++k) {
    out.emplace_back(orig_params_[k].fqn, optimizer_tensors_[k]);
  }
  return out;
}

// ---------------------------------------------------------------------------
// Iterations

bool FsdpModule::OptimizerStepped() const {
  for (size_t k = 0; k < optimizer_tensors_.size(); ++k) {
    if (static_cast<uint32_t>(optimizer_tensors_[k]._version()) !=
        versions_at_forward_[k]) {
      return true;
    }
  }
  return false;
}

absl::Status FsdpModule::SyncFromModule() {
  // module->eval() / train().
  const bool training = module_->is_training();
  if (training != training_) {
    for (int u = 0; u < runtime_->num_units(); ++u) {
      FLATPARAM_RETURN_IF_ERROR(runtime_->handle(u).SetTraining(training));
    }
    training_ = training;
  }
  // requires_grad changed on the module's parameters.
  for (int unit = 0; unit < static_cast<int>(units_.size()); ++unit) {
    UnitState& u = *units_[unit];
    FlatParamHandle& handle = runtime_->handle(unit);
    bool changed = false;
    for (size_t i = 0; i < u.params.size(); ++i) {
      changed =
          changed || (u.params[i].requires_grad() != (u.trainable[i] != 0));
    }
    if (!changed) continue;
    if (!use_orig_params_) {
      const bool first = u.params[0].requires_grad();
      for (size_t i = 1; i < u.params.size(); ++i) {
        if (u.params[i].requires_grad() != first) {
          return absl::FailedPreconditionError(absl::StrCat(
              "parameter \"", u.fqns[i], "\" of unit \"", u.name,
              "\" has requires_grad=", u.params[i].requires_grad() ? 1 : 0,
              " and \"", u.fqns[0], "\" requires_grad=", first ? 1 : 0,
              " (changed after Wrap); without FsdpOptions::use_orig_params a "
              "unit's parameters are all frozen or all trainable: change "
              "every parameter of the unit, or wrap with use_orig_params"));
        }
      }
      FLATPARAM_RETURN_IF_ERROR(handle.SetAllRequiresGrad(first));
    } else {
      for (size_t i = 0; i < u.params.size(); ++i) {
        const bool now = u.params[i].requires_grad();
        if (now == (u.trainable[i] != 0)) continue;
        FLATPARAM_RETURN_IF_ERROR(
            handle.SetRequiresGrad(static_cast<int>(i), now));
      }
    }
    u.num_trainable = 0;
    for (size_t i = 0; i < u.params.size(); ++i) {
      u.trainable[i] = handle.requires_grad(static_cast<int>(i)) ? 1 : 0;
      u.num_trainable += u.trainable[i];
    }
  }
  for (size_t k = 0; k < orig_params_.size(); ++k) {
    const bool trainable =
        units_[orig_params_[k].unit]->trainable[orig_params_[k].index] != 0;
    if (optimizer_tensors_[k].requires_grad() != trainable) {
      optimizer_tensors_[k].set_requires_grad(trainable);
    }
  }
  // The caller's changes to the optimizer tensors' gradients: set to None
  // (zero_grad(set_to_none)) or replaced.
  for (size_t k = 0; k < optimizer_tensors_.size(); ++k) {
    const torch::Tensor& grad = optimizer_tensors_[k].grad();
    const torch::Tensor& bound = bound_grads_[k];
    if (grad.defined() && bound.defined() &&
        grad.unsafeGetTensorImpl() == bound.unsafeGetTensorImpl()) {
      continue;
    }
    if (!grad.defined() && !bound.defined()) continue;
    const int unit =
        use_orig_params_ ? orig_params_[k].unit : static_cast<int>(k);
    FlatParamHandle& handle = runtime_->handle(unit);
    if (!grad.defined()) {
      FLATPARAM_RETURN_IF_ERROR(use_orig_params_
                                    ? handle.SetGradNone(orig_params_[k].index)
                                    : handle.ZeroGrad(/*set_to_none=*/true));
      continue;
    }
    const std::string what =
        use_orig_params_
            ? absl::StrCat("parameter \"", orig_params_[k].fqn, "\"")
            : absl::StrCat("unit \"", units_[unit]->name, "\"");
    if (!bound.defined() || grad.numel() != bound.numel() ||
        grad.scalar_type() != bound.scalar_type()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "the gradient of ShardedParameters() of ", what,
          " was replaced by a tensor of ", grad.numel(), " ",
          c10::toString(grad.scalar_type()),
          " elements; FSDP's gradient there ",
          bound.defined()
              ? absl::StrCat("has ", bound.numel(), " ",
                             c10::toString(bound.scalar_type()), " elements")
              : std::string("is None"),
          ". Change it in place, or set it to None"));
    }
    torch::NoGradGuard no_grad;
    bound.copy_(grad.reshape({-1}));
  }
  BindShardedGrads();
  return absl::OkStatus();
}

absl::Status FsdpModule::EndForwardOnlyIteration() {
  absl::Status status = runtime_->FinalizeBackward();
  absl::Status bind = BindAll();
  if (status.ok()) status = bind;
  iteration_ended_early_ = true;
  ++stats_.forward_only_iterations;
  return status;
}

absl::Status FsdpModule::BetweenIterations(absl::string_view op) {
  if (summoned_) {
    return absl::FailedPreconditionError(
        absl::StrCat("FsdpModule::", op,
                     " while SummonFullParams' scope lives (end it first)"));
  }
  if (in_forward_ || in_backward_) {
    return absl::FailedPreconditionError(
        absl::StrCat("FsdpModule::", op, " inside a ",
                     in_forward_ ? "forward" : "backward"));
  }
  if (runtime_->in_iteration() && !backward_began_) {
    return EndForwardOnlyIteration();
  }
  return absl::OkStatus();
}

void FsdpModule::CheckHookIteration(int64_t iteration) const {
  TORCH_CHECK(iteration == iteration_ && !iteration_ended_early_,
              "FsdpModule: this backward runs over the graph of a forward "
              "whose iteration has ended (a later forward began, or a call "
              "that needs the module between iterations ended a forward "
              "without backward); run the forward again");
}

absl::StatusOr<FsdpModule::Outputs> FsdpModule::RunUnit(
    int unit, const std::function<absl::StatusOr<Outputs>()>& forward) {
  FLATPARAM_RETURN_IF_ERROR(runtime_->PreForward(unit));
  FLATPARAM_RETURN_IF_ERROR(Bind(unit));
  const uint64_t first = at::sequence_number::peek();
  absl::StatusOr<Outputs> out;
  try {
    out = forward();
  } catch (...) {
    const std::string& name = units_[unit]->name;
    out = ForwardException(
        name.empty() ? "" : absl::StrCat(" of unit \"", name, "\""));
  }
  const uint64_t end = at::sequence_number::peek();
  absl::Status post = runtime_->PostForward(unit);
  if (post.ok()) post = Bind(unit);
  FLATPARAM_RETURN_IF_ERROR(out.status());
  FLATPARAM_RETURN_IF_ERROR(post);
  if (torch::GradMode::is_enabled()) {
    TrackNodes(unit, *out, first, end, /*gather=*/true);
    for (const torch::Tensor& t : *out) {
      if (NeedsGradient(t)) RegisterPreBackward(t, unit);
    }
  }
  return out;
}

void FsdpModule::TrackNodes(int unit, const Outputs& outputs, uint64_t first,
                            uint64_t end, bool gather) {
  if (first == end) return;
  UnitState& u = *units_[unit];
  std::unordered_set<Node*> seen;
  std::vector<std::shared_ptr<Node>> stack;
  auto consider = [&](const std::shared_ptr<Node>& node) {
    if (node == nullptr) return;
    const uint64_t seq = node->sequence_nr();
    if (seq < first || seq >= end || !seen.insert(node.get()).second) return;
    stack.push_back(node);
  };
  for (const torch::Tensor& t : outputs) {
    if (t.defined()) consider(t.grad_fn());
  }
  while (!stack.empty()) {
    std::shared_ptr<Node> node = std::move(stack.back());
    stack.pop_back();
    const size_t index = u.nodes.size();
    u.nodes.push_back({node, false, false});
    if (gather) {
      node->add_pre_hook(
          std::make_unique<NodePreHook>(hooks_, iteration_, unit));
    }
    node->add_post_hook(
        std::make_unique<NodePostHook>(hooks_, iteration_, unit, index));
    for (const torch::autograd::Edge& edge : node->next_edges()) {
      consider(edge.function);
    }
  }
}

absl::StatusOr<FsdpModule::Outputs> FsdpModule::RunForward(
    const std::function<absl::StatusOr<Outputs>()>& forward) {
  if (!hook_error_.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("a previous backward failed: ", hook_error_.ToString()));
  }
  if (in_forward_) {
    return absl::FailedPreconditionError(
        "FsdpModule::Forward inside Forward (use Unit for a unit's forward)");
  }
  if (in_backward_) {
    return absl::FailedPreconditionError(
        "FsdpModule::Forward inside a backward");
  }
  if (summoned_) {
    return absl::FailedPreconditionError(
        "FsdpModule::Forward while SummonFullParams' scope lives (end it "
        "first)");
  }
  FLATPARAM_RETURN_IF_ERROR(CheckModuleUnchanged());
  // A forward whose loss was never back-propagated, then an optimizer step:
  // the root's gathered parameters are stale; that iteration is over.
  if (runtime_->in_iteration() && !backward_began_ && OptimizerStepped()) {
    FLATPARAM_RETURN_IF_ERROR(EndForwardOnlyIteration());
  }
  if (!runtime_->in_iteration()) {
    ++iteration_;
    iteration_ended_early_ = false;
    backward_began_ = false;
    for (auto& u : units_) u->nodes.clear();
    FLATPARAM_RETURN_IF_ERROR(SyncFromModule());
  }
  struct InForward {
    bool* flag;
    explicit InForward(bool* f) : flag(f) { *flag = true; }
    ~InForward() { *flag = false; }
  };
  absl::StatusOr<Outputs> out;
  bool hooked = false;
  {
    InForward in_forward(&in_forward_);
    std::optional<int> root = runtime_->root_unit();
    if (root.has_value()) {
      out = RunUnit(*root, forward);
    } else {
      try {
        out = forward();
      } catch (...) {
        out = ForwardException("");
      }
    }
    if (out.ok() && torch::GradMode::is_enabled()) {
      for (const torch::Tensor& t : *out) {
        if (!NeedsGradient(t)) continue;
        hooked = true;
        // Without a root unit no pre-backward hook marks the backward's
        // start; this one does, on the outermost graph, before any
        // recompute in the backward runs a unit.
        if (!root.has_value()) {
          t.register_hook(
              [target = hooks_, iteration = iteration_](const torch::Tensor&) {
                if (FsdpModule* m = target->module) {
                  m->CheckHookIteration(iteration);
                  m->BeginBackward();
                }
              });
        }
      }
    }
  }
  for (size_t k = 0; k < optimizer_tensors_.size(); ++k) {
    versions_at_forward_[k] =
        static_cast<uint32_t>(optimizer_tensors_[k]._version());
  }
  // Nothing will run a backward over this forward (evaluation, or a
  // failed forward): the iteration ends here, as PyTorch's does.
  if (!hooked) {
    absl::Status ended = EndForwardOnlyIteration();
    if (out.ok() && !ended.ok()) return ended;
  }
  return out;
}

absl::StatusOr<torch::Tensor> FsdpModule::Forward(
    const std::function<absl::StatusOr<torch::Tensor>()>& forward) {
  FLATPARAM_ASSIGN_OR_RETURN(
      Outputs out, RunForward([&]() -> absl::StatusOr<Outputs> {
        FLATPARAM_ASSIGN_OR_RETURN(torch::Tensor t, forward());
        return Outputs{std::move(t)};
      }));
  return std::move(out[0]);
}

absl::StatusOr<torch::autograd::variable_list> FsdpModule::Forward(
    const std::function<absl::StatusOr<torch::autograd::variable_list>()>&
        forward) {
  return RunForward(forward);
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
  FLATPARAM_ASSIGN_OR_RETURN(Outputs out,
                             RunUnit(unit, [&]() -> absl::StatusOr<Outputs> {
                               return Outputs{forward()};
                             }));
  return std::move(out[0]);
}

absl::StatusOr<torch::autograd::variable_list> FsdpModule::Unit(
    absl::string_view name,
    const std::function<torch::autograd::variable_list()>& forward) {
  FLATPARAM_ASSIGN_OR_RETURN(int unit, UnitIndex(name));
  return RunUnit(unit, [&]() -> absl::StatusOr<Outputs> { return forward(); });
}

torch::autograd::variable_list FsdpModule::CastInputs(
    int unit, const torch::autograd::variable_list& inputs, bool cast) const {
  const FlatParamHandle& handle = runtime_->handle(unit);
  // PyTorch casts to param_dtype only where it computes in it (not in eval
  // under use_full_prec_in_eval).
  if (!cast || !handle.uses_param_mixed_precision() ||
      (!training_ && handle.options().use_full_prec_in_eval)) {
    return inputs;
  }
  const c10::ScalarType dtype =
      internal_fsdp_module::ToTorch(handle.param_dtype());
  torch::autograd::variable_list out;
  out.reserve(inputs.size());
  for (const torch::Tensor& t : inputs) {
    out.push_back(t.defined() && t.is_floating_point() &&
                          t.scalar_type() != dtype
                      ? t.to(dtype)
                      : t);
  }
  return out;
}

absl::StatusOr<torch::autograd::variable_list> FsdpModule::Forward(
    const torch::autograd::variable_list& inputs,
    const std::function<absl::StatusOr<torch::autograd::variable_list>(
        const torch::autograd::variable_list&)>& forward) {
  return RunForward([&]() -> absl::StatusOr<Outputs> {
    std::optional<int> root = runtime_->root_unit();
    return forward(root.has_value()
                       ? CastInputs(*root, inputs, cast_root_forward_inputs_)
                       : inputs);
  });
}

absl::StatusOr<torch::autograd::variable_list> FsdpModule::Unit(
    absl::string_view name, const torch::autograd::variable_list& inputs,
    const std::function<torch::autograd::variable_list(
        const torch::autograd::variable_list&)>& forward) {
  FLATPARAM_ASSIGN_OR_RETURN(int unit, UnitIndex(name));
  return RunUnit(unit, [&]() -> absl::StatusOr<Outputs> {
    return forward(CastInputs(unit, inputs, cast_forward_inputs_));
  });
}

absl::StatusOr<torch::Tensor> FsdpModule::RecomputedUnit(
    absl::string_view name, const torch::Tensor& input,
    const std::function<torch::Tensor(const torch::Tensor&)>& forward,
    Recomputation where) {
  FLATPARAM_ASSIGN_OR_RETURN(int unit, UnitIndex(name));
  switch (where) {
    case Recomputation::kNone:
      return Unit(name, [&] { return forward(input); });
    case Recomputation::kInsideUnit:
      return Unit(name, [&] { return Recompute(forward, input); });
    case Recomputation::kAroundUnit:
      break;
  }
  // The unit's hooks run inside the recomputed function: in the forward
  // (gradients off, so no pre-backward hook) and again in the backward. A
  // failure there is thrown through LibTorch, its Status kept: for this
  // call in the forward, for Backward() in the backward (Fail).
  around_failure_ = absl::OkStatus();
  auto run = [this, unit, forward](const torch::Tensor& x) -> torch::Tensor {
    absl::StatusOr<Outputs> out = RunUnit(
        unit, [&]() -> absl::StatusOr<Outputs> { return Outputs{forward(x)}; });
    if (out.ok()) return (*out)[0];
    if (in_backward_) {
      Fail(out.status());
    } else {
      around_failure_ = out.status();
    }
    C10_THROW_ERROR(Error, out.status().ToString());
  };
  const uint64_t first = at::sequence_number::peek();
  torch::Tensor out;
  try {
    out = Recompute(run, input);
  } catch (const c10::Error& e) {
    if (!around_failure_.ok()) return std::exchange(around_failure_, {});
    return absl::InvalidArgumentError(
        absl::StrCat("LibTorch error around the forward of unit \"", name,
                     "\": ", e.what_without_backtrace()));
  }
  // The unit's backward is complete only once every recompute that runs
  // it again has run (a unit applied twice is recomputed twice): count the
  // recompute's node, without gathering the unit there (its forward hooks
  // inside the recompute do that).
  if (torch::GradMode::is_enabled()) {
    TrackNodes(unit, {out}, first, at::sequence_number::peek(),
               /*gather=*/false);
  }
  return out;
}

// ---------------------------------------------------------------------------
// The backward

void FsdpModule::Fail(const absl::Status& status) {
  if (status.ok() || !hook_error_.ok()) return;
  hook_error_ = status;
  // A collective that timed out or failed inside the backward usually ends
  // the job soon after (RunOnMpiWorld, FinalizeMpi): say which unit, at
  // once, in case the caller never prints what Backward() returns.
  if (absl::IsDeadlineExceeded(status) || absl::IsAborted(status) ||
      absl::IsUnavailable(status)) {
    std::fprintf(stderr,
                 "FsdpModule: the backward failed in its hooks (rank %d; "
                 "the module refuses further steps): %s\n",
                 world_->rank(), status.ToString().c_str());
    std::fflush(stderr);
  }
}

void FsdpModule::RegisterPreBackward(const torch::Tensor& output, int unit) {
  output.register_hook(
      [target = hooks_, iteration = iteration_, unit](const torch::Tensor&) {
        if (FsdpModule* m = target->module) {
          m->CheckHookIteration(iteration);
          m->OnPreBackward(unit);
        }
      });
}

void FsdpModule::BeginBackward() {
  if (in_backward_) return;
  // PyTorch: "FSDP does not support gradients of gradients". The engine
  // runs a create_graph backward with gradient mode on.
  TORCH_CHECK(!torch::GradMode::is_enabled(),
              "FsdpModule does not support gradients of gradients (a "
              "backward with create_graph=true), as PyTorch's FSDP does not");
  in_backward_ = true;
  backward_began_ = true;
  ++backward_serial_;
  for (auto& u : units_) {
    u->pre_backward_ran = false;
    u->post_backward_ran = false;
    u->scanned.clear();
    std::fill(u->arrived.begin(), u->arrived.end(), 0);
    u->expected_graphs.assign(u->params.size(), {});
    u->expected_left = 0;
    u->nodes_left = 0;
    u->any_arrived = false;
    u->tracked = false;
    for (UnitState::TrackedNode& node : u->nodes) {
      node.counted = false;
      node.done = false;
    }
  }
  for (int unit = 0; unit < static_cast<int>(units_.size()); ++unit) {
    ScanGraph(unit);
  }
  torch::autograd::Engine::get_default_engine().queue_callback(
      [target = hooks_] {
        if (FsdpModule* m = target->module) m->OnBackwardEnd();
      });
}

void FsdpModule::ScanGraph(int unit) {
  UnitState& u = *units_[unit];
  const std::pair<uint64_t, uint64_t> graph{backward_serial_,
                                            internal::RecomputeGraphId()};
  if (std::find(u.scanned.begin(), u.scanned.end(), graph) != u.scanned.end()) {
    return;
  }
  u.scanned.push_back(graph);
  for (UnitState::TrackedNode& tracked : u.nodes) {
    if (tracked.counted) continue;
    std::shared_ptr<Node> node = tracked.node.lock();
    if (node == nullptr || !WillRun(node.get())) continue;
    tracked.counted = true;
    ++u.nodes_left;
    u.tracked = true;
  }
  for (size_t i = 0; i < u.params.size(); ++i) {
    if (!u.trainable[i] || u.accumulators[i] == nullptr ||
        !WillRun(u.accumulators[i].get())) {
      continue;
    }
    u.expected_graphs[i].push_back(graph.second);
    ++u.expected_left;
    u.tracked = true;
  }
}

void FsdpModule::MaybeFinishUnit(int unit) {
  UnitState& u = *units_[unit];
  if (!in_backward_ || !u.pre_backward_ran || u.post_backward_ran) return;
  if (!u.tracked || u.nodes_left > 0 || u.expected_left > 0) return;
  u.post_backward_ran = true;
  // Nothing reached its trainable parameters (torch::autograd::grad):
  // nothing to reduce; FinalizeBackward reshards it.
  if (u.num_trainable > 0 && !u.any_arrived) {
    ++stats_.units_without_gradient;
    return;
  }
  ++stats_.reductions_in_backward;
  absl::Status status = runtime_->PostBackward(unit);
  if (status.ok()) status = Bind(unit);
  if (!status.ok()) {
    Fail(status);
    TORCH_CHECK(false, status.ToString());
  }
}

void FsdpModule::OnPreBackward(int unit) {
  if (!hook_error_.ok()) TORCH_CHECK(false, hook_error_.ToString());
  BeginBackward();
  ScanGraph(unit);
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

void FsdpModule::OnNodeStart(int unit) { OnPreBackward(unit); }

void FsdpModule::OnNodeDone(int unit, size_t node) {
  if (!in_backward_) return;
  UnitState& u = *units_[unit];
  if (node >= u.nodes.size()) return;
  UnitState::TrackedNode& tracked = u.nodes[node];
  if (!tracked.counted || tracked.done) return;
  tracked.done = true;
  --u.nodes_left;
  MaybeFinishUnit(unit);
}

void FsdpModule::OnGradAccumulated(int unit, int index) {
  if (!in_backward_) return;
  UnitState& u = *units_[unit];
  if (u.post_backward_ran) {
    // Never drop a gradient: this one came after the unit's reduction (a
    // backward flatparam's hooks did not see coming, such as a reentrant
    // backward of the caller's own).
    absl::Status late = absl::InternalError(absl::StrCat(
        "parameter \"", u.fqns[index], "\" of unit \"", u.name,
        "\" received a gradient after the unit's gradients were reduced "
        "(its backward looked complete); a reentrant backward other than "
        "flatparam's Recompute inside the unit is not supported"));
    Fail(late);
    TORCH_CHECK(false, late.ToString());
  }
  std::vector<uint64_t>& graphs = u.expected_graphs[index];
  auto it =
      std::find(graphs.begin(), graphs.end(), internal::RecomputeGraphId());
  if (it != graphs.end()) {
    graphs.erase(it);
    --u.expected_left;
  }
  u.arrived[index] = 1;
  u.any_arrived = true;
  MaybeFinishUnit(unit);
}

void FsdpModule::OnBackwardEnd() {
  // Recorded, not thrown: the engine has finished the graph; Backward()
  // (or the next Forward) reports it.
  absl::Status status = hook_error_;
  for (int unit = 0; unit < static_cast<int>(units_.size()) && status.ok();
       ++unit) {
    UnitState& u = *units_[unit];
    if (!u.pre_backward_ran || u.post_backward_ran) continue;
    u.post_backward_ran = true;
    if (u.num_trainable > 0 && !u.any_arrived) {
      ++stats_.units_without_gradient;
      continue;
    }
    ++stats_.reductions_at_end;
    status = runtime_->PostBackward(unit);
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

absl::Status FsdpModule::Backward(const torch::Tensor& loss,
                                  bool retain_graph) {
  if (!hook_error_.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("a previous backward failed: ", hook_error_.ToString()));
  }
  try {
    loss.backward({}, retain_graph);
  } catch (const c10::Error& e) {
    // A parameter's storage is empty outside its unit: a tensor made in a
    // unit's forward reached the loss without passing through the unit's
    // outputs, so nothing gathered the unit for its backward.
    std::string hint;
    if (absl::StrContains(e.what_without_backtrace(), "storage of size 0")) {
      std::vector<std::string> sharded;
      for (int unit = 0; unit < static_cast<int>(units_.size()); ++unit) {
        if (!units_[unit]->nodes.empty() && !units_[unit]->exposed) {
          sharded.push_back(units_[unit]->name);
        }
      }
      hint = absl::StrCat(
          " (a unit's parameters are empty outside its Unit(...) call and "
          "its backward; units that ran this forward and are not gathered "
          "now: ",
          Describe(sharded),
          ". If a tensor computed inside a unit reaches the loss without "
          "being returned by the unit's function, return it: Unit takes a "
          "function with several outputs)");
    }
    absl::Status error = absl::InvalidArgumentError(absl::StrCat(
        "LibTorch error in the backward: ", e.what_without_backtrace(), hint));
    // Before any hook ran (a loss that needs no gradient, gradients of
    // gradients) nothing changed. After one, the backward was abandoned
    // part-way (units unsharded, reductions issued, no final callback):
    // the module refuses further steps, as after a hook's failure.
    if (!in_backward_) return error;
    Fail(error);
  }
  return hook_error_;
}

absl::Status FsdpModule::ZeroGrad(bool set_to_none) {
  FLATPARAM_RETURN_IF_ERROR(BetweenIterations("ZeroGrad"));
  FLATPARAM_RETURN_IF_ERROR(runtime_->ZeroGrad(set_to_none));
  BindShardedGrads();
  return absl::OkStatus();
}

absl::StatusOr<double> FsdpModule::ClipGradNorm(double max_norm,
                                                double norm_type) {
  FLATPARAM_RETURN_IF_ERROR(BetweenIterations("ClipGradNorm"));
  return runtime_->ClipGradNorm(max_norm, norm_type);
}

}  // namespace libtorch
}  // namespace flatparam
