// What the files of FsdpModule share (fsdp_module.cc: wrapping and
// binding; fsdp_module_hooks.cc: the forward's and backward's hooks;
// fsdp_module_state.cc: state dicts; fsdp_module_optim.cc: optimizer state
// and checkpoints): conversions between LibTorch's and flatparam's
// tensors, a unit's state, and the hook objects. Private to
// //flatparam/torch.
#ifndef FLATPARAM_TORCH_INTERNAL_FSDP_MODULE_INTERNAL_H_
#define FLATPARAM_TORCH_INTERNAL_FSDP_MODULE_INTERNAL_H_

#include <torch/autograd.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/types.h>
#include <torch/utils.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "flatparam/base/buffer.h"
#include "flatparam/base/dtype.h"
#include "flatparam/layout.h"
#include "flatparam/torch/fsdp_module.h"

namespace flatparam {
namespace libtorch {
namespace internal_fsdp_module {

// LibTorch's owning pointer to an autograd Node, as Edge::function holds
// it: std::shared_ptr up to the 2.1x releases that moved autograd to
// c10::intrusive_ptr (pytorch/pytorch#181782; 2.14 has it), and the weak
// pointer that goes with it. Named from Edge so that one source compiles
// against either.
using NodePtr = decltype(torch::autograd::Edge::function);
template <typename Ptr>
struct WeakPtrOf;
template <typename T>
struct WeakPtrOf<std::shared_ptr<T>> {
  using type = std::weak_ptr<T>;
};
template <typename T, typename NullType>
struct WeakPtrOf<c10::intrusive_ptr<T, NullType>> {
  using type = c10::weak_intrusive_ptr<T, NullType>;
};
using WeakNodePtr = typename WeakPtrOf<NodePtr>::type;

// flatparam's dtype of a LibTorch floating dtype; InvalidArgument for
// another.
absl::StatusOr<DType> FromTorch(c10::ScalarType type);
// Every dtype flatparam names, integers and bool included (buffers);
// InvalidArgument for another (complex, quantized).
absl::StatusOr<DType> AnyDTypeFromTorch(c10::ScalarType type);
// Every DType.
c10::ScalarType ToTorch(DType dtype);
// Options of `dtype` on `device`.
torch::TensorOptions OptionsOn(DType dtype, c10::Device device);
// A tensor on `device` over `buffer`'s memory (not owned), 1-d.
torch::Tensor OverOn(const BufferRef& buffer, c10::Device device);
// A copy of `t` on the CPU, never `t` itself (Tensor::to returns a CPU
// tensor unchanged, which may be a view of flatparam's memory).
torch::Tensor CpuCopy(const torch::Tensor& t);
// "a", "b", ... for messages.
std::string Quoted(const std::vector<std::string>& names);
// torch.chunk's rows of rank `rank` of `world` ranks of a tensor of `rows`
// rows (PyTorch's SHARDED_STATE_DICT chunking): (first, count), count 0
// for a rank past the last chunk.
std::pair<int64_t, int64_t> ChunkRows(int64_t rows, int world, int rank);

// Tensors over one storage whose data pointer is swapped (see the file
// comment of fsdp_module.h): one view per parameter.
struct SwappableViews {
  DType dtype = DType::kFloat32;
  // The LibTorch device of the memory the storage points at.
  c10::Device device = c10::Device(c10::kCPU);
  c10::Storage storage;
  std::vector<torch::Tensor> views;
  void* bound = nullptr;

  // (Re)makes the views for `dtype` on `on`; `layout` gives offsets and
  // shapes.
  void Make(DType new_dtype, const FlatParamLayout& layout, c10::Device on);
  // Points the storage at `buffer` (or at nothing).
  void Point(const std::optional<BufferRef>& buffer);
};

}  // namespace internal_fsdp_module

// One unit's LibTorch side.
struct FsdpModule::UnitState {
  std::string name;
  // The module's tensor of each layout parameter (primaries; a tied name is
  // the same tensor), and its name.
  std::vector<torch::Tensor> params;
  std::vector<std::string> fqns;
  std::vector<char> trainable;
  // The gradient accumulator each trainable parameter's hook is on.
  std::vector<internal_fsdp_module::NodePtr> accumulators;
  int num_trainable = 0;
  internal_fsdp_module::SwappableViews param_views;
  internal_fsdp_module::SwappableViews grad_views;
  // Whether the parameters are the views now (else empty tensors), and
  // whether their grad() are the gradient views.
  bool exposed = false;
  bool grads_exposed = false;

  // The autograd nodes this iteration's forwards of the unit made (hooked
  // by TrackNodes), and per backward whether each is counted (in the graph
  // the engine runs) and has run.
  struct TrackedNode {
    internal_fsdp_module::WeakNodePtr node;
    bool counted = false;
    bool done = false;
  };
  std::vector<TrackedNode> nodes;

  // This backward.
  bool pre_backward_ran = false;
  bool post_backward_ran = false;
  // The graphs ScanGraph has counted (the backward's serial and
  // Recompute's graph id).
  std::vector<std::pair<uint64_t, uint64_t>> scanned;
  // Per parameter: the graphs this backward runs that hold its accumulator
  // and in which it has not fired yet (Recompute's graph ids), and whether
  // it has fired at all.
  std::vector<std::vector<uint64_t>> expected_graphs;
  std::vector<char> arrived;
  int expected_left = 0;
  int nodes_left = 0;
  bool any_arrived = false;
  // Whether ScanGraph found anything of the unit to wait for.
  bool tracked = false;
};

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
  torch::autograd::variable_list operator()(
      const torch::autograd::variable_list& outputs,
      const torch::autograd::variable_list& /*inputs*/) override {
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
  torch::autograd::variable_list operator()(
      const torch::autograd::variable_list& grads) override {
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
  torch::autograd::variable_list operator()(
      const torch::autograd::variable_list& outputs,
      const torch::autograd::variable_list& /*inputs*/) override {
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

}  // namespace libtorch
}  // namespace flatparam

#endif  // FLATPARAM_TORCH_INTERNAL_FSDP_MODULE_INTERNAL_H_
