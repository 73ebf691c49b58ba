// FsdpModule: FSDP for a LibTorch `torch::nn::Module` on one rank, the C++
// counterpart of PyTorch's `FullyShardedDataParallel(module,
// auto_wrap_policy=...)`, which PyTorch offers only in Python. The module's
// parameters move into flatparam's flat parameters (flatparam/runtime.h,
// one FlatParamHandle per unit); the module's own code runs unchanged on the
// gathered parameters, and autograd's gradients flow into flatparam's flat
// gradients and are reduced while the backward goes on.
//
//   // On every rank of `world` (the same module, initialized alike):
//   auto model = std::make_shared<Gpt>(config);
//   libtorch::FsdpOptions options;
//   options.wrap = {"h.*"};                          // one unit per block
//   FLATPARAM_ASSIGN_OR_RETURN(
//       std::unique_ptr<libtorch::FsdpModule> fsdp,
//       libtorch::FsdpModule::Wrap(model, &world, &device, options));
//   torch::optim::AdamW adamw(fsdp->ShardedParameters(), adamw_options);
//   // A step:
//   FLATPARAM_ASSIGN_OR_RETURN(
//       torch::Tensor logits,
//       fsdp->Forward([&]() -> absl::StatusOr<torch::Tensor> {
//         torch::Tensor x = model->Embed(tokens);
//         for (size_t i = 0; i < model->h.size(); ++i) {
//           FLATPARAM_ASSIGN_OR_RETURN(
//               x, fsdp->Unit(absl::StrCat("h.", i),
//                             [&] { return model->h[i]->forward(x); }));
//         }
//         return model->Head(x);
//       }));
//   FLATPARAM_RETURN_IF_ERROR(fsdp->Backward(Loss(logits, targets)));
//   adamw.step();                // steps the sharded flat parameters
//   FLATPARAM_RETURN_IF_ERROR(fsdp->ZeroGrad());
//
// Units. `FsdpOptions::wrap` lists module names (as `named_modules()` gives
// them, globs allowed: flatparam/model_layout.h's ModelSpec::wrap); each is a
// unit that owns the parameters under it that no deeper unit owns, and the root
// unit ("") owns the rest. Parameters are laid out in `named_parameters()`
// order (registration order, PyTorch's); a parameter registered under two
// names (the same tensor: a tied embedding and head) is a shared parameter
// of its first name; two different tensors over one storage are refused;
// `requires_grad() == false` marks a frozen parameter.
//
// How the module's parameters see flatparam's memory. Each unit has one
// LibTorch storage whose data pointer is flatparam's unsharded flat
// parameter while the unit is unsharded and null otherwise; every module
// parameter of the unit is, while unsharded, a view into it (set_data,
// which keeps the parameter's autograd identity), and an empty tensor
// while sharded, so that using it outside its unit's forward fails with an
// error rather than reading freed memory. Tensors autograd saved from the
// parameters in the forward (a transposed weight) are views of the same
// storage, so when the backward unshards the unit again (maybe into other
// memory) they see the gathered parameter, as PyTorch FSDP's storage
// resize does. Likewise each trainable parameter's `grad()` is, during the
// unit's backward, a view into flatparam's unsharded flat gradient, so
// autograd accumulates into it in place: no copy of parameters or
// gradients per step beyond what PyTorch FSDP makes.
//
// Hooks (PyTorch's `_runtime_utils.py`, without module hooks, which C++
// modules lack):
//   * Forward(f): the root's pre-forward (lazy initialization, the
//     iteration's start), f, the root's post-forward; the pre-backward hook
//     on the result.
//   * Unit(name, f): the unit's pre-forward (its unshard, prefetching the
//     next with forward_prefetch), f, its post-forward (reshard); a
//     pre-backward hook (Tensor::register_hook) on the result unshards the
//     unit when the result's gradient arrives, before the unit's backward.
//   * Post-backward: a hook on each trainable parameter's gradient
//     accumulator (`AccumulateGrad`, as PyTorch's on the flat parameter's)
//     and on every autograd node the unit's forward made (found from its
//     outputs). A unit reshards and its reduction starts, overlapping the
//     rest of the backward, once its backward is complete: every node of
//     its forward that this backward runs has run (so its parameters, frozen
//     ones included, are no longer read) and every trainable parameter
//     this backward reaches has its gradient. Parameters are counted once
//     however often their accumulator fires, and the nodes include a
//     recompute's (below), so a parameter reached twice (a shared weight
//     used inside a recomputed block and outside it, a block applied
//     twice) has all its gradient before the reduction. A unit none of
//     whose trainable parameters got a gradient (torch::autograd::grad,
//     which accumulates nothing) is not reduced: its gradient stays as it
//     was (None), as in PyTorch. A node's pre-hook also gathers its unit
//     if no output hook did (a tensor that left the unit without being
//     returned).
//   * The end of the backward (a callback queued on the autograd engine
//     from the first hook, which is on the outermost graph, as PyTorch's
//     final callback): units whose backward did not complete reduce now,
//     then FsdpRuntime::FinalizeBackward, then the sharded gradients are
//     bound to ShardedParameters()' `grad()` for the optimizer.
//   * A forward whose outputs need no gradient (evaluation under
//     torch::NoGradGuard, or a frozen model) ends its iteration when it
//     returns: the root's gathered parameters are freed and the module is
//     between iterations, as PyTorch's is. A forward whose loss is never
//     back-propagated is ended by the next call that needs the module
//     between iterations (StateDict, SaveCheckpoint, LoadCheckpoint,
//     ClipGradNorm), or by the next Forward once the optimizer has stepped
//     (ShardedParameters() changed); a backward over its graph after that
//     is refused. An evaluation between a step's forward and its backward
//     (and ZeroGrad there) leaves the step's iteration open.
//   * At each Forward between iterations, the module's own state is read
//     back: `module->eval()` / `train()` (FlatParamHandle::SetTraining:
//     eval passes are neither order-checked nor recorded, and
//     HandleOptions::use_full_prec_in_eval applies), `requires_grad`
//     changed on a module parameter since Wrap (applied with
//     FlatParamHandle::SetRequiresGrad; without use_orig_params only a
//     whole unit may change), and gradients the caller set to None on
//     ShardedParameters() (`zero_grad(set_to_none)`: the handle's sharded
//     gradient becomes None too, so the next reduction does not add to
//     it) or replaced (copied in).
//   * Gradients of gradients (`create_graph`) are refused at the
//     backward's first hook, as PyTorch's FSDP refuses them.
// Several backwards per forward (retain_graph) work as flatparam/runtime.h
// describes.
//
// Activation recomputation (flatparam/torch/recompute.h's Recompute, the
// reentrant torch.utils.checkpoint), at either of the places PyTorch
// allows, through RecomputedUnit or composed by hand:
//   * inside the unit, as PyTorch's FSDP(checkpoint_wrapper(block)): the
//     forward keeps only the unit's input; in the backward the unit's
//     pre-backward hook gathers its parameters, the recompute runs on them
//     and its backward produces the unit's gradients (one all-gather per
//     unit in the backward, as without recomputation);
//     `Unit(name, [&] { return Recompute(f, x); })`.
//   * around the unit, as checkpoint_wrapper(FSDP(block)): the recompute
//     in the backward runs the unit's forward hooks again (Unit may be
//     called inside a recompute during the backward), which gather the
//     parameters for it and free them after, and the recomputed output's
//     pre-backward hook gathers them once more for the unit's backward
//     (two all-gathers per unit in the backward, as PyTorch makes).
//   `Recompute(g, x)` where g calls `Unit(name, ...)` and throws on error.
// Either way the gradients are bitwise those without recomputation.
//
// Optimizers. By default they step the sharded flat parameters (FSDP's
// flat path, `use_orig_params=False`): ShardedParameters() gives one leaf
// tensor per unit over the handle's local shard, whose `grad()` is the
// sharded gradient after a backward (undefined while it is None), so
// `torch::optim` SGD, Adam and AdamW work unchanged. Their state is per
// flat parameter. A unit must then be all trainable or all frozen (the
// optimizer steps every element of a flat shard, and weight decay would
// move frozen elements): Wrap refuses a unit that mixes them.
// With FsdpOptions::use_orig_params (PyTorch's `use_orig_params=True`)
// ShardedParameters() gives one leaf tensor per original parameter instead:
// the 1-D piece of it this rank's shard holds (possibly empty), over the
// same memory, its `grad()` the matching piece of the sharded gradient
// (undefined for a frozen parameter, or one this rank holds none of). So
// a frozen parameter is never stepped even in a unit with trainable ones
// (LoRA), and optimizer parameter groups are built per original parameter
// (NamedShardedParameters(): no weight decay on biases and norms, say),
// each group's options applied to its elements only; the optimizer's state
// is per original parameter (fsdp_optim.h's original-parameter path).
// Elementwise optimizers (SGD, Adam, AdamW) give the same bits either way.
//
// Errors. Every error a caller can cause is an absl::Status: invalid
// options or modules (unsupported dtypes or devices, views sharing a
// storage), a unit name that is not a unit, a module changed after
// wrapping (its parameters replaced or added), a LibTorch error thrown by
// the caller's forward (named with the unit), and a collective's failure
// inside the backward's hooks (the backward is abandoned with a
// c10::Error and Backward() returns the failure).
//
// Devices and dtypes: the module's parameters and buffers are on the
// TorchDevice's LibTorch device (flatparam/torch/torch_device.h): CPU
// tensors with a host DeviceOps (Wrap(module, world, &host_ops)), CUDA
// tensors with TorchCudaDeviceOps (flatparam/torch/torch_cuda.h: LibTorch's
// current stream and caching allocator). The flat parameters live in the
// DeviceOps' memory; the module's parameters and gradients are views of
// it on that device; the optimizer's tensors (ShardedParameters()) are on
// it too, or on the CPU under CPU offload (PyTorch's optimizer then steps
// on the CPU, as with PyTorch's CPUOffload). LibTorch's kernels run on
// stream 0 of the DeviceOps, the compute stream; the unshard and
// post-backward streams (HandleOptions::streams) are ordered with it by
// events, and FsdpModule checks at every forward, unit and backward hook
// that LibTorch's current stream is still that stream (a
// CUDAStreamGuard around a step is refused, naming both streams). State
// dicts and checkpoints are copied to the host with LibTorch's copies.
// float32, float64, float16 and bfloat16 parameters, one dtype per unit
// (flatparam's rule). Parameters on another device, the meta device
// included, are refused (FsdpOptions::param_init_fn defers initialisation
// instead).
//
// Memory: the FsdpModule keeps the module (shared_ptr) and owns the
// runtime; after Wrap the module's parameters hold no memory of their own
// (flatparam's local shards hold the values). `world` and `device` are the
// caller's and must outlive it. Destroying the FsdpModule leaves the
// module's parameters empty: call FullStateDict() first to keep them. Its
// hooks stay in autograd graphs and gradient accumulators that may outlive
// it; they do nothing once it is destroyed.
//
// Thread-safety: one thread at a time, the rank's (which runs the forward
// and the backward: LibTorch runs a CPU backward on the calling thread, a
// CUDA backward on its device thread while the calling thread waits in
// Backward(), and the hooks then run there).
#ifndef FLATPARAM_TORCH_FSDP_MODULE_H_
#define FLATPARAM_TORCH_FSDP_MODULE_H_

#include <torch/autograd.h>
#include <torch/nn/init.h>
#include <torch/nn/module.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/types.h>
#include <torch/utils.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "comm/communicator.h"
#include "flatparam/checkpoint/file_system.h"
#include "flatparam/checkpoint/training_state.h"
#include "flatparam/device/device.h"
#include "flatparam/handle.h"
#include "flatparam/interop/dcp/dcp_export.h"
#include "flatparam/model_layout.h"
#include "flatparam/optim/optim_state.h"
#include "flatparam/runtime.h"
#include "flatparam/torch/recompute.h"
#include "flatparam/torch/torch_device.h"

namespace flatparam {
namespace libtorch {

struct FsdpOptions {
  // Module names (or globs over them) that are units of their own; see the
  // file comment. Empty (and no wrap_module_types): the whole module is
  // one unit.
  std::vector<std::string> wrap;
  // Module types whose every instance is a unit of its own (PyTorch's
  // ModuleWrapPolicy({Block})), as `torch::nn::Module::name()` gives them
  // ("my::BlockImpl" for TORCH_MODULE(Block)) or by its last component
  // ("BlockImpl"). Added to `wrap`; InvalidArgument for a type no
  // submodule has.
  std::vector<std::string> wrap_module_types;
  ShardingStrategy strategy = ShardingStrategy::kFullShard;
  // Hybrid strategies: ranks per shard group (a divisor of the world size);
  // 0 means the world.
  int shard_group_size = 0;
  // PyTorch's use_orig_params=True layout (alignment padding).
  bool align_addresses = false;
  // PyTorch's use_orig_params=True: the optimizer steps each original
  // parameter's piece of the shard (see the file comment), so a unit may
  // mix frozen and trainable parameters. Implies align_addresses.
  bool use_orig_params = false;
  // PyTorch's sync_module_states: rank 0's parameter (and buffer) values
  // are broadcast to every rank before they are sharded, unit by unit, so
  // ranks that initialized their modules differently (different seeds)
  // start alike; the other ranks may build theirs with uninitialised
  // storage (rank 0 alone initialises the model). Each unit's full values
  // are freed once its shard is made.
  bool sync_module_states = false;
  // PyTorch's param_init_fn, for a module too large to initialise whole on
  // every rank: build it with uninitialised CPU storage (torch::empty,
  // which touches no memory until written; LibTorch 1.13 cannot move a
  // parameter off the meta device in place, so meta parameters are
  // refused), and Wrap makes the units one at a time, calling
  // param_init_fn(m) before each on every submodule `m` owning one of the
  // unit's parameters (and, after the last, on those with buffers only).
  // It gives `m`'s own parameters and buffers their values in place
  // (torch::nn::init, copy_ from a file); replacing a parameter is
  // InvalidArgument. Each unit's full values are freed once its shard is
  // made, so a rank writes no more than one unit's full parameters at a
  // time besides its shards. On an error, the units already made have
  // empty parameters.
  std::function<void(torch::nn::Module&)> param_init_fn;
  // PyTorch's MixedPrecision.cast_root_forward_inputs and
  // cast_forward_inputs: with a param_dtype, the floating inputs given to
  // Forward(inputs, f) (root) and Unit(name, inputs, f) are cast to it
  // (differentiably: their gradients come back in their own dtype); not in
  // eval mode under use_full_prec_in_eval. Inputs a function captures are
  // not seen, and not cast.
  bool cast_root_forward_inputs = true;
  bool cast_forward_inputs = false;
  // PyTorch's MixedPrecision.buffer_dtype: the module's floating buffers
  // (BatchNorm's running statistics, ...) are cast to it at Wrap; state
  // dicts give them back in their own dtype. Unset: they keep theirs.
  std::optional<DType> buffer_dtype;
  // Mixed precision, CPU offload, ... (HandleOptions), and prefetch,
  // limit_all_gathers, ... (RuntimeOptions).
  HandleOptions handle;
  RuntimeOptions runtime;
};

// Where RecomputedUnit recomputes a unit's activations (see the file
// comment).
enum class Recomputation { kNone, kInsideUnit, kAroundUnit };
// "none", "inside", "around".
const char* RecomputationName(Recomputation r);

// PyTorch's FullStateDictConfig.
struct StateDictOptions {
  // Only rank 0 of each shard group gets the tensors (every rank of a
  // non-hybrid world but rank 0 gets an empty dict); the others still take
  // part in the all-gathers.
  bool rank0_only = false;
  // PyTorch's offload_to_cpu: the tensors are copied to the CPU; false
  // leaves them on the module's device (PyTorch's default is false; on the
  // CPU the two are the same).
  bool offload_to_cpu = true;
};

// What the hooks did, summed over the backwards.
struct FsdpModuleStats {
  // Backwards that ran the hooks (ended by the final callback).
  int64_t backwards = 0;
  // Units' post-backwards (reshard, and reduction unless every parameter is
  // frozen) run by a hook while the backward went on (overlapping it), and
  // those left to the end of the backward (a unit whose backward the hooks
  // could not see complete: one used outside the graph the loss reached).
  int64_t reductions_in_backward = 0;
  int64_t reductions_at_end = 0;
  // Units whose backward began but that got no gradient (not reduced).
  int64_t units_without_gradient = 0;
  // Iterations ended by a forward that needed no gradient, or by a call
  // that needs the module between iterations.
  int64_t forward_only_iterations = 0;
};

// FsdpModule::SaveDcpCheckpoint's and LoadDcpCheckpoint's options.
struct FsdpDcpOptions {
  // PyTorch 2.x's layout (torch.distributed.checkpoint), or 1.13's.
  DcpExportOptions::Format format = DcpExportOptions::Format::kPyTorch2;
  // The keys' prefixes: DCP 2.x's flattening of {"model": ..., "optim":
  // ...}.
  std::string model_prefix = "model.";
  std::string optim_prefix = "optim.";
};

// One rank's FSDP of a module (see the file comment).
class FsdpModule {
 public:
  // Wraps `module` on this rank: collective over `world` (every rank must
  // wrap a module of the same structure with the same options). The
  // module's parameter values become the initial flat parameters: every
  // rank's must be equal (as for FsdpRuntime::Create), or
  // sync_module_states makes them rank 0's. InvalidArgument, naming
  // the values, for: a null module, world or device; a parameter that is
  // undefined, not on the device's LibTorch device, not contiguous, or not
  // of a supported floating dtype; two parameters viewing one storage; a
  // shard group size that does not divide the world; a compute stream
  // other than stream 0 (torch_device.h); every error of
  // ModelLayout::Create and FsdpRuntime::Create.
  static absl::StatusOr<std::unique_ptr<FsdpModule>> Wrap(
      std::shared_ptr<torch::nn::Module> module, Communicator* world,
      TorchDevice* device, const FsdpOptions& options = {});
  // The same on the CPU, with a host DeviceOps (HostTorchDevice over it);
  // InvalidArgument for a DeviceOps of another device (a GPU's needs the
  // TorchDevice that orders it with LibTorch: TorchCudaDeviceOps).
  static absl::StatusOr<std::unique_ptr<FsdpModule>> Wrap(
      std::shared_ptr<torch::nn::Module> module, Communicator* world,
      DeviceOps* device, const FsdpOptions& options = {});

  ~FsdpModule();
  FsdpModule(const FsdpModule&) = delete;
  FsdpModule& operator=(const FsdpModule&) = delete;

  // ---- The forward and the backward ----
  // The whole forward (the root's hooks around `forward`); returns its
  // result. Errors: `forward`'s own, a c10::Error it throws (as
  // InvalidArgument with LibTorch's message), a module changed since Wrap
  // (FailedPrecondition), and the runtime's. Not reentrant.
  absl::StatusOr<torch::Tensor> Forward(
      const std::function<absl::StatusOr<torch::Tensor>()>& forward);
  // The same for a forward with several outputs (hidden states, an
  // auxiliary loss): every floating output that requires a gradient is
  // hooked.
  absl::StatusOr<torch::autograd::variable_list> Forward(
      const std::function<absl::StatusOr<torch::autograd::variable_list>()>&
          forward);
  // The same with the forward's inputs passed through, as a module's
  // forward takes them: floating inputs are cast to the mixed-precision
  // param_dtype first (FsdpOptions::cast_root_forward_inputs).
  absl::StatusOr<torch::autograd::variable_list> Forward(
      const torch::autograd::variable_list& inputs,
      const std::function<absl::StatusOr<torch::autograd::variable_list>(
          const torch::autograd::variable_list&)>& forward);
  // Unit `name`'s forward inside Forward's (its hooks around `forward`).
  // NotFound for a name that is not a unit (listing the units),
  // FailedPrecondition outside Forward or for the root unit.
  absl::StatusOr<torch::Tensor> Unit(
      absl::string_view name, const std::function<torch::Tensor()>& forward);
  // The same for a unit with several outputs (an MoE block's output and
  // its auxiliary loss): each output that requires a gradient gets the
  // pre-backward hook.
  absl::StatusOr<torch::autograd::variable_list> Unit(
      absl::string_view name,
      const std::function<torch::autograd::variable_list()>& forward);
  // The same with the unit's inputs passed through: with
  // FsdpOptions::cast_forward_inputs, floating inputs are cast to the
  // unit's param_dtype first (an fp32 activation into a bf16 unit).
  absl::StatusOr<torch::autograd::variable_list> Unit(
      absl::string_view name, const torch::autograd::variable_list& inputs,
      const std::function<torch::autograd::variable_list(
          const torch::autograd::variable_list&)>& forward);
  // Unit `name`'s forward `forward(input)` inside Forward's, its
  // activations recomputed in the backward (Recompute) at `where` (see the
  // file comment). `forward` runs again during the backward: what it
  // captures must be alive then (capture by value). kNone is
  // Unit(name, [&] { return forward(input); }). Errors as Unit's; in the
  // backward, Backward() returns them.
  absl::StatusOr<torch::Tensor> RecomputedUnit(
      absl::string_view name, const torch::Tensor& input,
      const std::function<torch::Tensor(const torch::Tensor&)>& forward,
      Recomputation where = Recomputation::kInsideUnit);
  // `loss.backward()` (with `retain_graph`), returning the first failure of
  // the hooks, or the c10::Error the backward threw, as a Status. A failure
  // after the backward's first hook (a collective, a recompute) leaves the
  // module failed: every later call returns FailedPrecondition with it.
  absl::Status Backward(const torch::Tensor& loss, bool retain_graph = false);

  // ---- The optimizer ----
  // The tensors a `torch::optim` optimizer steps (see the file comment):
  // one leaf per unit (in unit order) over its local shard; with
  // use_orig_params one per original parameter (a tied one once, in
  // `named_parameters()` order) over its piece of the shard. `grad()` is
  // the matching (piece of the) sharded gradient. The tensors stay valid
  // as long as the FsdpModule.
  std::vector<torch::Tensor> ShardedParameters() const;
  // With use_orig_params: ShardedParameters() by name, to build parameter
  // groups, e.g. weight decay for matrices only:
  //   std::vector<torch::Tensor> decay, no_decay;
  //   for (auto& [name, p] : fsdp->NamedShardedParameters())
  //     (absl::EndsWith(name, "weight") && !IsNorm(name) ? decay : no_decay)
  //         .push_back(p);
  //   torch::optim::AdamW adamw(
  //       {torch::optim::OptimizerParamGroup(decay, decay_options),
  //        torch::optim::OptimizerParamGroup(no_decay, no_decay_options)},
  //       defaults);
  // FailedPrecondition without use_orig_params (the flat shards are not
  // per parameter).
  absl::StatusOr<std::vector<std::pair<std::string, torch::Tensor>>>
  NamedShardedParameters() const;
  // FsdpRuntime::ZeroGrad, and ShardedParameters()' gradients undefined
  // (set_to_none) or zero.
  absl::Status ZeroGrad(bool set_to_none = true);
  // FsdpRuntime::ClipGradNorm (collective).
  absl::StatusOr<double> ClipGradNorm(double max_norm, double norm_type = 2.0);
  // PyTorch's `with model.no_sync():`: gradients accumulate unsharded and
  // nothing is reduced in the backwards that begin while the scope lives
  // (each post-backward reads the setting, as PyTorch's reads
  // `_sync_gradients`); the previous setting comes back when it ends.
  FsdpRuntime::NoSyncScope NoSync() { return runtime_->NoSync(); }

  // ---- Optimizer state (flatparam/optim) ----
  // `optimizer`'s state as this rank's sharded optimizer-state dict
  // (flatparam/optim/fsdp_optim.h), so that it consolidates
  // (ConsolidateOptimState over runtime().shard_group(), with
  // FsdpOptimOptions::use_orig_params as the module's), reshards to any
  // world size and strategy (ShardFullOptimState), and goes into
  // checkpoints like any flatparam model's. `optimizer`'s parameters must
  // be ShardedParameters() (in any order and groups). The flat-parameter
  // path: keys are unit indices. With use_orig_params, the
  // original-parameter path: keys are parameter names, tensor states the
  // 1-D pieces of this rank's shard, for the parameters it holds. States as
  // Python's torch.optim names them: SGD's "momentum_buffer" (with momentum,
  // once it has stepped), Adam's and AdamW's "step" (a 0-d float32 tensor, as
  // PyTorch >= 1.12 keeps it), "exp_avg", "exp_avg_sq" and, with amsgrad,
  // "max_exp_avg_sq". param_groups carry the hyperparameters under PyTorch's
  // names. InvalidArgument for another optimizer type, or a parameter that is
  // not a shard of this module.
  absl::StatusOr<optim::OptimStateDict> ShardedOptimState(
      torch::optim::Optimizer& optimizer) const;
  // Sets `optimizer`'s per-parameter state from such a dict of this rank
  // (ShardedOptimState's, or one ShardFullOptimState made from a full
  // dict at another world size), replacing what it had; the optimizer's
  // own options (learning rate, ...) stay. InvalidArgument, naming the
  // unit or parameter and the state, for a key that is not a unit (or,
  // with use_orig_params, a parameter this rank holds), a state the
  // optimizer does not keep, a missing one, or a tensor of another size
  // or a non-floating dtype. With `restore_hyperparameters`, each of the
  // optimizer's parameter groups also takes the dict's group's
  // hyperparameters (lr, betas, eps, weight_decay, amsgrad; SGD's lr,
  // momentum, dampening, weight_decay, nesterov), so that a learning-rate
  // schedule resumes where it stopped, as Python's load_state_dict does:
  // the groups pair by position and must list the same parameters
  // (InvalidArgument naming the group otherwise).
  absl::Status LoadShardedOptimState(
      const optim::OptimStateDict& sharded, torch::optim::Optimizer& optimizer,
      bool restore_hyperparameters = false) const;

  // ---- Checkpoints (flatparam/checkpoint) ----
  // Writes a sharded checkpoint of the module's parameters and, when
  // `optimizer` is given, its state (ShardedOptimState) into `dir`: the
  // format `fsdp train --save` writes (checkpoint_dir.h), crash-safe, each
  // rank writing its own shard files; `extra` (a JSON object) is kept in
  // the rank files. `fsdp checkpoint` consolidates, reshards and exports it
  // to Hugging Face safetensors. Collective over the world; between
  // iterations. Errors are agreed by every rank (checkpoint's). The
  // checkpoint holds optimizer state on the flat-parameter path; with
  // use_orig_params each unit's parameters' states are laid out in its
  // flat shard (zeros for a parameter without state), which needs one
  // "step" per unit (InvalidArgument, naming the parameters, otherwise),
  // and the groups list parameter names; LoadCheckpoint gives each
  // trainable parameter its piece back. The module's buffers are saved
  // whole, each rank's own, in their own dtype (a buffer_dtype cast
  // undone); the hybrid strategies' replicas are not stored twice, so a
  // replica's come back as its shard-group rank's.
  absl::Status SaveCheckpoint(
      checkpoint::FileSystem& fs, const std::string& dir,
      torch::optim::Optimizer* optimizer,
      const nlohmann::json& extra = nlohmann::json::object());
  // What SaveCheckpoint writes for this rank, copied to the host: its
  // shards, buffers, the optimizer's state when `optimizer` is given, and
  // `extra`. Not collective. For trainers that save through
  // checkpoint::StepCheckpointSaver (flatparam/checkpoint/
  // training_checkpoints.h: every N steps, in the background, resumed with
  // FindLatestCheckpoint and LoadCheckpoint). Between iterations;
  // SaveCheckpoint's errors for the optimizer state.
  absl::StatusOr<checkpoint::RankState> CheckpointState(
      torch::optim::Optimizer* optimizer,
      const nlohmann::json& extra = nlohmann::json::object());
  // Loads a sharded checkpoint of this module into the local shards and,
  // when `optimizer` is given, its state: saved at any world size,
  // strategy or alignment (resharded at load time: each rank reads only
  // the byte ranges of its own new shard). Collective; between iterations;
  // the ranks agree on the outcome (one rank's damaged file fails every
  // rank, naming it). FailedPrecondition when the checkpoint is of another
  // model (the first difference named) or holds no optimizer state while
  // `optimizer` is given; DataLoss for damaged files. The rank files'
  // "extra" goes to `extra` if set. `restore_hyperparameters`: as
  // LoadShardedOptimState's. Buffers: each rank gets its own saved ones
  // when the checkpoint fits the job unresharded, otherwise saved rank 0's
  // (as a load of PyTorch's full state dict gives them); a checkpoint
  // without the module's buffers (one written before they were saved) is
  // another model (FailedPrecondition naming the buffer).
  absl::Status LoadCheckpoint(checkpoint::FileSystem& fs,
                              const std::string& dir,
                              torch::optim::Optimizer* optimizer,
                              nlohmann::json* extra = nullptr,
                              bool restore_hyperparameters = false);

  // ---- PyTorch Distributed Checkpoint (flatparam/interop/dcp/dcp.h) ----
  // Saves the module, and the optimizer's state when `optimizer` is given,
  // as a DCP directory, what PyTorch FSDP's SHARDED_STATE_DICT and
  // optim_state_dict saved by torch.distributed.checkpoint.save at this
  // world size hold (dcp_export.h's layout): every state_dict() name
  // (tied ones too), "optim.state.<fqn>.<state>" and "optim.param_groups";
  // each parameter and state of at least one dimension chunked on dim 0
  // across the world's ranks as torch.chunk chunks it, rank r writing its
  // rows to __r_0.distcp; buffers (rank 0's), 0-d tensors and bytes items
  // written by rank 0, which writes .metadata last (under a temporary name,
  // then renamed: until then the directory is no checkpoint). `dir` must
  // be new or empty (FailedPrecondition naming it otherwise: nothing is
  // overwritten). Collective over the world; between iterations; errors
  // agreed by every rank; on error each rank removes its own file.
  // Memory: the whole model and optimizer state on every rank (StateDict
  // and ConsolidateOptimState gather them), as PyTorch's FULL_STATE_DICT
  // holds on rank 0.
  absl::Status SaveDcpCheckpoint(checkpoint::FileSystem& fs,
                                 const std::string& dir,
                                 torch::optim::Optimizer* optimizer,
                                 const FsdpDcpOptions& options = {});
  // Loads a DCP directory saved at any world size (by SaveDcpCheckpoint,
  // PyTorch FSDP or FSDP2, torchtitan, or ExportDcpCheckpoint): each rank
  // reads its own rows of each parameter (the chunks that meet them) and
  // buffers whole, then LoadShardedStateDict; with `optimizer`, the
  // optimizer state whole on every rank, sharded for the rank
  // (ShardFullOptimState) and installed as LoadCheckpoint installs it
  // (`restore_hyperparameters` likewise; a checkpoint saved before the
  // optimizer's first step holds param groups but no state, and leaves the
  // optimizer as it is). FailedPrecondition naming the key for a missing
  // tensor or one of another shape, or for no optimizer keys at all while
  // `optimizer` is given; the reader's errors (dcp.h).
  // Collective; between iterations; nothing changes unless every rank
  // succeeds.
  absl::Status LoadDcpCheckpoint(checkpoint::FileSystem& fs,
                                 const std::string& dir,
                                 torch::optim::Optimizer* optimizer,
                                 const FsdpDcpOptions& options = {},
                                 bool restore_hyperparameters = false);

  // ---- State dicts (PyTorch's FSDP state_dict_type) ----
  // The full, unsharded parameters by name (every non-tied parameter, in
  // the parameters' dtype and shape): collective (it all-gathers every
  // unit), CPU tensors. Between iterations. Kept for its callers;
  // StateDict() is PyTorch's FULL_STATE_DICT.
  absl::StatusOr<std::map<std::string, torch::Tensor>> FullStateDict();
  // PyTorch's FULL_STATE_DICT, what Python's `module.state_dict()` holds:
  // every parameter and buffer, in state_dict order (each module's own
  // parameters, then its buffers, then its submodules'), a tied parameter
  // under each of its names (one tensor), parameters unsharded in their
  // dtype and shape, buffers as the module holds them (cast back to their
  // dtype under buffer_dtype). Collective, one unit gathered at a time;
  // between iterations (a forward without backward is ended first).
  absl::StatusOr<torch::OrderedDict<std::string, torch::Tensor>> StateDict(
      const StateDictOptions& options = {});
  // Loads such a dict on every rank (collective: each rank passes the same
  // values, as Python's FSDP FULL_STATE_DICT load does): parameters into
  // their shards, buffers into the module. Values are copied with
  // LibTorch's casting (as `load_state_dict`), shapes must match.
  // `strict`: InvalidArgument naming the missing and the unexpected keys,
  // as Python's load_state_dict(strict=True). InvalidArgument too for a
  // shape that differs, or the names of one tied parameter with different
  // values. Nothing changes when it fails.
  absl::Status LoadStateDict(
      const torch::OrderedDict<std::string, torch::Tensor>& state,
      bool strict = true);
  // PyTorch's SHARDED_STATE_DICT: each parameter chunked on dim 0 across
  // the world's ranks as torch.chunk does (rank r holds rows
  // [r * c, min(rows, (r + 1) * c)), c = ceil(rows / world), possibly none;
  // a 0-d parameter whole on every rank); buffers each rank's own; keys as
  // StateDict's. Collective.
  absl::StatusOr<torch::OrderedDict<std::string, torch::Tensor>>
  ShardedStateDict();
  // Loads every rank's ShardedStateDict() (made at this world size; each
  // rank passes its own): collective. InvalidArgument naming missing and
  // unexpected keys, or a chunk of another shape.
  absl::Status LoadShardedStateDict(
      const torch::OrderedDict<std::string, torch::Tensor>& state);

  // ---- Summoning full parameters (PyTorch's summon_full_params) ----
  // While the returned scope lives, the module's parameters hold their full
  // values (unit by unit gathered at once: the whole model's memory), for
  // generation, inspection or weight surgery; with writeback, changes made
  // in place go back into the shards when it ends; with with_grads, each
  // trainable parameter's grad() is its full gradient. rank0_only: only
  // rank 0 of each shard group sees them (others see empty parameters);
  // not with writeback. Collective (begin and end). Between iterations;
  // Forward and Backward fail while it lives. End() reports the
  // write-back's errors; the destructor ends it too, printing an error.
  class SummonedParams {
   public:
    ~SummonedParams();
    SummonedParams(const SummonedParams&) = delete;
    SummonedParams& operator=(const SummonedParams&) = delete;
    absl::Status End();

   private:
    friend class FsdpModule;
    explicit SummonedParams(FsdpModule* module) : module_(module) {}
    FsdpModule* module_;
  };
  absl::StatusOr<std::unique_ptr<SummonedParams>> SummonFullParams(
      const SummonOptions& options = {});

  // ---- Introspection ----
  FsdpRuntime& runtime() { return *runtime_; }
  const FsdpRuntime& runtime() const { return *runtime_; }
  const ModelLayout& layout() const { return runtime_->layout(); }
  torch::nn::Module& module() { return *module_; }
  // Unit names in unit order ("" is the root).
  std::vector<std::string> unit_names() const;
  // The model file (flatparam/model_json.h) of the wrapped module: its
  // parameters, ties and units, as `fsdp_torch_files import --model=` and
  // the `fsdp checkpoint` tools take it.
  nlohmann::json ModelFile() const;
  const FsdpModuleStats& stats() const { return stats_; }

 private:
  struct UnitState;
  // What the hooks call: the module while it lives, nothing once it is
  // destroyed (a graph or accumulator may outlive it).
  struct HookTarget;
  class NodePreHook;
  class NodePostHook;
  class AccumulateHook;
  // An optimizer tensor of use_orig_params: parameter `index` of `unit`.
  struct OrigParam {
    std::string fqn;
    int unit = 0;
    int index = 0;
  };
  // How an optimizer keys its state: LibTorch 1.13 by the parameter's
  // TensorImpl address printed as a string, 2.x by the address itself.
  using OptimizerStateKey = typename std::remove_reference_t<
      decltype(std::declval<torch::optim::Optimizer&>().state())>::key_type;
  using OptimizerStates =
      std::map<OptimizerStateKey,
               std::unique_ptr<torch::optim::OptimizerParamState>>;
  using Outputs = torch::autograd::variable_list;
  FsdpModule(std::shared_ptr<torch::nn::Module> module, Communicator* world,
             bool use_orig_params);

  // ---- Optimizer state (fsdp_module_state.cc) ----
  // LoadShardedOptimState in two steps: everything validated and made,
  // then installed (so that LoadCheckpoint changes nothing until every
  // rank agrees).
  absl::StatusOr<OptimizerStates> ParseOptimState(
      const optim::OptimStateDict& sharded,
      torch::optim::Optimizer& optimizer) const;
  void InstallOptimState(OptimizerStates states,
                         torch::optim::Optimizer& optimizer) const;
  // The dict's groups' hyperparameters, checked against `optimizer`'s
  // groups (see LoadShardedOptimState), and their installation.
  absl::StatusOr<std::vector<std::map<std::string, optim::HyperValue>>>
  ParseHyperparams(const optim::OptimStateDict& sharded,
                   torch::optim::Optimizer& optimizer) const;
  static void InstallHyperparams(
      const std::vector<std::map<std::string, optim::HyperValue>>& groups,
      torch::optim::Optimizer& optimizer);
  // use_orig_params: an original-parameter dict of this rank in the
  // checkpoint's flat-parameter form, and back.
  absl::StatusOr<optim::OptimStateDict> OrigToFlatOptimState(
      const optim::OptimStateDict& orig) const;
  absl::StatusOr<optim::OptimStateDict> FlatToOrigOptimState(
      const optim::OptimStateDict& flat) const;
  // The optimizer tensor's parameter (use_orig_params) or unit (flat), by
  // tensor identity; -1 when it is not one of ShardedParameters().
  int OptimizerTensorIndex(const torch::Tensor& t) const;

  // ---- Iterations ----
  absl::Status CheckModuleUnchanged() const;
  // At an iteration's first forward: eval/train, requires_grad changes and
  // the caller's changes to ShardedParameters()' gradients.
  absl::Status SyncFromModule();
  // Ends an iteration whose forward gets no backward (see the file
  // comment).
  absl::Status EndForwardOnlyIteration();
  // For calls that need the module between iterations: ends a
  // forward-only iteration; FailedPrecondition inside a forward or a
  // backward, naming `op`.
  absl::Status BetweenIterations(absl::string_view op);
  // CheckpointState's work, once the caller has checked BetweenIterations
  // under its own name (CheckpointState, SaveCheckpoint).
  absl::StatusOr<checkpoint::RankState> CopyCheckpointState(
      torch::optim::Optimizer* optimizer, const nlohmann::json& extra);
  bool OptimizerStepped() const;
  // State-dict order (see StateDict): each entry a parameter (unit, index)
  // or a buffer (index into buffers_).
  struct StateEntry {
    std::string name;
    int unit = -1;
    int index = 0;
    int buffer = -1;
  };
  std::vector<StateEntry> StateEntries() const;
  // The buffers' values in their own dtype.
  torch::Tensor BufferValue(int buffer) const;
  // Checks `state`'s keys against the module's (strict) and tied names'
  // agreement.
  absl::Status CheckStateKeys(
      const torch::OrderedDict<std::string, torch::Tensor>& state,
      bool strict) const;
  absl::Status EndSummon();
  // `inputs` with floating tensors cast to unit `unit`'s param_dtype when
  // `cast` and mixed precision is in force.
  torch::autograd::variable_list CastInputs(
      int unit, const torch::autograd::variable_list& inputs, bool cast) const;
  absl::StatusOr<Outputs> RunForward(
      const std::function<absl::StatusOr<Outputs>()>& forward);
  absl::StatusOr<Outputs> RunUnit(
      int unit, const std::function<absl::StatusOr<Outputs>()>& forward);
  // Hooks the autograd nodes unit `unit`'s forward made (sequence numbers
  // [first, end)), found from its outputs: each counts towards the unit's
  // backward being complete, and with `gather` its pre-hook gathers the
  // unit.
  void TrackNodes(int unit, const Outputs& outputs, uint64_t first,
                  uint64_t end, bool gather);
  // Points the unit's parameters (and, in its backward, gradients) at the
  // handle's current memory, or empties them.
  absl::Status Bind(int unit);
  absl::Status BindAll();
  void BindShardedGrads();
  absl::StatusOr<int> UnitIndex(absl::string_view name) const;
  void RegisterPreBackward(const torch::Tensor& output, int unit);

  // ---- The backward's hooks (run inside the autograd engine; failures
  // are recorded and abort the backward) ----
  // The first hook of a backward: its bookkeeping and the final callback.
  void BeginBackward();
  // Counts what the graph the engine runs now holds of `unit`: its nodes
  // and its trainable parameters' accumulators (once per graph).
  void ScanGraph(int unit);
  // The unit's post-backward once its backward is complete.
  void MaybeFinishUnit(int unit);
  void OnPreBackward(int unit);
  void OnGradAccumulated(int unit, int index);
  void OnNodeStart(int unit);
  void OnNodeDone(int unit, size_t node);
  void OnBackwardEnd();
  // Throws (a c10::Error) unless a hook of iteration `iteration` may run.
  void CheckHookIteration(int64_t iteration) const;
  void Fail(const absl::Status& status);

  // ---- Devices (fsdp_module.cc) ----
  // The LibTorch device of memory on `device`: the CPU for the host's, the
  // compute device for the DeviceOps'.
  c10::Device TorchDeviceOf(Device device) const;
  // Tensors of `dtype` on the compute device.
  torch::TensorOptions Options(DType dtype) const;
  // A tensor over `buffer` (not owned) on its LibTorch device: the compute
  // device for device memory, the CPU for host memory.
  torch::Tensor Over(const BufferRef& buffer) const;
  // The same, of `shape` (buffer.count elements).
  torch::Tensor Over(const BufferRef& buffer, c10::IntArrayRef shape) const;
  // flatparam's name for the memory of `t`: the host for a CPU tensor,
  // the DeviceOps' device for one on the compute device.
  Device FlatDeviceOf(const torch::Tensor& t) const;
  // InvalidArgument, naming `what`, unless `t` is on the compute device.
  absl::Status CheckOnDevice(const torch::Tensor& t,
                             absl::string_view what) const;
  // The host waits for LibTorch's kernels issued so far (before a
  // collective reads or writes memory they wrote).
  absl::Status WaitForTorch();
  // The TorchDevice's hand-over and stream check (torch_device.h); in a
  // hook, a failure is thrown (a c10::Error) after Fail.
  absl::Status HandToTorch();
  void HandToTorchInHook();
  void CheckStreamInHook();

  std::shared_ptr<torch::nn::Module> module_;
  Communicator* const world_;
  TorchDevice* device_ = nullptr;
  // HostTorchDevice made by Wrap(DeviceOps*).
  std::unique_ptr<TorchDevice> owned_device_;
  const bool use_orig_params_;
  // The module's buffers (named_buffers()), with their dtypes at Wrap.
  std::vector<std::pair<std::string, torch::Tensor>> buffers_;
  std::vector<c10::ScalarType> buffer_dtypes_;
  bool summoned_ = false;
  SummonOptions summon_options_;
  bool cast_root_forward_inputs_ = true;
  bool cast_forward_inputs_ = false;
  std::shared_ptr<HookTarget> hooks_;
  std::unique_ptr<FsdpRuntime> runtime_;
  std::vector<std::unique_ptr<UnitState>> units_;
  // The module's parameters as wrapped, by name (to detect changes).
  std::vector<std::pair<std::string, torch::Tensor>> wrapped_params_;
  // The optimizer's tensors (ShardedParameters()), the gradient each was
  // last given (to notice the caller's changes), and each one's version
  // when the last forward ended (to notice an optimizer step).
  std::vector<torch::Tensor> optimizer_tensors_;
  std::vector<OrigParam> orig_params_;
  std::vector<torch::Tensor> bound_grads_;
  std::vector<uint32_t> versions_at_forward_;
  bool training_ = true;
  bool in_forward_ = false;
  bool in_backward_ = false;
  // The iteration the hooks registered now belong to; a forward-only
  // iteration ended early refuses its graph's backward.
  int64_t iteration_ = 0;
  bool iteration_ended_early_ = false;
  bool backward_began_ = false;
  // Whether a forward of this iteration left a graph for a backward.
  bool graph_pending_ = false;
  // Counts the backwards, so that ScanGraph scans each graph once.
  uint64_t backward_serial_ = 0;
  absl::Status hook_error_;
  // RecomputedUnit(kAroundUnit)'s failure in the forward, thrown through
  // LibTorch's autograd function.
  absl::Status around_failure_;
  FsdpModuleStats stats_;
};

}  // namespace libtorch
}  // namespace flatparam

#endif  // FLATPARAM_TORCH_FSDP_MODULE_H_
