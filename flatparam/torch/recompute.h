// Activation recomputation for LibTorch: the C++ counterpart of PyTorch's
// `torch.utils.checkpoint.checkpoint(f, *inputs, use_reentrant=True,
// preserve_rng_state=True)`, which LibTorch lacks. A transformer trained at
// scale keeps only each block's input from the forward and recomputes the
// block's activations in the backward, trading compute for memory.
//
//   torch::Tensor y = libtorch::Recompute(
//       [block](const torch::Tensor& x) { return block->forward(x); }, x);
//
// The forward runs `f(inputs)` with gradients off, so autograd saves none
// of its activations; only `inputs` are kept. When the backward reaches
// the outputs, `f` runs again, with gradients on, on detached views of the
// same inputs and with LibTorch's default CPU generator in the state it
// had in the forward (dropout draws the same masks), and the incoming
// gradients are backpropagated through that recomputed graph (a reentrant
// backward, on the same thread). The parameters `f` reads get their
// gradients then, and their gradient accumulators' hooks fire then (so
// under FsdpModule a unit's reduction starts when its recompute's backward
// has produced its gradients). The gradients are bitwise those of running
// `f` without recomputation, as long as `f` is deterministic.
//
// One difference from PyTorch's reentrant checkpoint: the outputs join the
// graph whenever gradient mode is on, even when no input requires a
// gradient (the first block's input may come from a frozen embedding), so
// the parameters inside `f` still get gradients; PyTorch warns and drops
// them. PyTorch's non-reentrant variant relies on saved-tensor hooks that
// LibTorch 1.13 exposes only to Python.
//
// Ownership and lifetime: `f` is copied and kept in the autograd graph
// until the graph is freed (after the backward, unless retain_graph); it
// is called again during the backward, so everything it captures must
// still be alive then: capture modules and values by value (a
// `torch::nn::ModuleHolder` is a shared pointer), not locals by reference.
// The inputs are saved as autograd saves tensors: modifying one in place
// before the backward is an error the backward reports.
//
// Errors: an exception `f` throws in the forward propagates to the caller;
// one it throws in the backward propagates out of `backward()` (a
// c10::Error, as every LibTorch backward failure). With gradient mode off
// (evaluation) Recompute is `f(inputs)`. A backward that computes only some
// gradients (`torch::autograd::grad()`, or `backward()` with `inputs`) is
// refused with a c10::Error when it reaches a recompute, as PyTorch's
// reentrant checkpoint refuses it: the recompute's own backward would
// accumulate into every parameter `f` reads.
//
// Random numbers (preserve_rng_state): the default generators of the CPU
// and of every device an input is on (a CUDA device's, as PyTorch's
// checkpoint saves with get_device_states) are saved at the forward, set
// to those states for the recompute and put back afterwards. They are
// process-wide (another thread drawing from one between the forward and
// the recompute does not change what the recompute draws, but the
// recompute moves it for nobody else either). A generator of a device no
// input is on is not saved (PyTorch's rule too). The autocast state is not
// saved: LibTorch's autocast is off unless the caller turns it on.
//
// Thread-safety: as `f`; the generator's state is read and set under its
// mutex.
#ifndef FLATPARAM_TORCH_RECOMPUTE_H_
#define FLATPARAM_TORCH_RECOMPUTE_H_

#include <torch/autograd.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>
#include <torch/utils.h>

#include <functional>

namespace flatparam {
namespace libtorch {

using TensorFunction = std::function<torch::Tensor(const torch::Tensor&)>;
using TensorsFunction = std::function<torch::autograd::variable_list(
    const torch::autograd::variable_list&)>;

struct RecomputeOptions {
  // Restore the default CPU generator's forward-time state for the
  // recompute (PyTorch's preserve_rng_state). Off saves copying the
  // generator's state per call when `f` draws no random numbers.
  bool preserve_rng_state = true;
};

// `f(inputs)`, its activations recomputed in the backward (see the file
// comment). Undefined inputs are passed through as they are.
torch::autograd::variable_list Recompute(
    const TensorsFunction& f, const torch::autograd::variable_list& inputs,
    const RecomputeOptions& options = {});
// The same for one input and one output.
torch::Tensor Recompute(const TensorFunction& f, const torch::Tensor& input,
                        const RecomputeOptions& options = {});

namespace internal {
// Which backward graph the calling thread's autograd hooks run in, as far
// as Recompute can tell: 0 outside any recompute's backward, and a value
// not seen before on this thread for each backward a recompute runs inside
// the engine (restored when it ends). FsdpModule uses it to notice a new
// graph.
uint64_t RecomputeGraphId();
}  // namespace internal

}  // namespace libtorch
}  // namespace flatparam

#endif  // FLATPARAM_TORCH_RECOMPUTE_H_
