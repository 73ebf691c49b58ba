#include "flatparam/torch/recompute.h"

#include <torch/autograd.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/types.h>
#include <torch/utils.h>

#include <cstdint>
#include <mutex>
#include <optional>
#include <utility>

namespace flatparam {
namespace libtorch {
namespace {

// RecomputeGraphId's state (per thread: a CPU backward runs on the thread
// that called it, and its recomputes' backwards inside it).
thread_local uint64_t current_graph_id = 0;
thread_local uint64_t graphs_seen = 0;

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// What the backward needs besides the saved inputs, kept in the autograd
// context as a capsule (the context stores IValues only).
struct RecomputeState : torch::CustomClassHolder {
  TensorsFunction f;
  // The default CPU generator's state when the forward ran.
  std::optional<at::Tensor> rng_state;
};

at::Tensor GeneratorState() {
  at::Generator generator = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(generator.mutex());
  return generator.get_state();
}

void SetGeneratorState(const at::Tensor& state) {
  at::Generator generator = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(generator.mutex());
  generator.set_state(state);
}

// The autograd function. Its inputs are the caller's tensors followed by an
// anchor, an empty leaf that requires a gradient, so that the outputs are
// in the graph even when no caller input requires one.
struct RecomputeFunction : torch::autograd::Function<RecomputeFunction> {
  static variable_list forward(AutogradContext* ctx,
                               c10::intrusive_ptr<RecomputeState> state,
                               at::TensorList inputs_and_anchor) {
    variable_list inputs(inputs_and_anchor.begin(),
                         inputs_and_anchor.end() - 1);
    // LibTorch runs this with gradient mode off: f saves no activations.
    variable_list outputs = state->f(inputs);
    ctx->save_for_backward(inputs);
    ctx->saved_data["state"] = c10::IValue::make_capsule(std::move(state));
    return outputs;
  }

  static variable_list backward(AutogradContext* ctx,
                                variable_list grad_outputs) {
    // The recompute's backward would accumulate into every parameter f
    // reads, whatever the outer backward asked for.
    TORCH_CHECK(
        torch::autograd::Engine::get_default_engine().is_checkpoint_valid(),
        "flatparam Recompute is not compatible with "
        "torch::autograd::grad() or with backward() given `inputs`: "
        "use loss.backward() without `inputs` (PyTorch's reentrant "
        "checkpoint refuses them too)");
    auto state = c10::static_intrusive_pointer_cast<RecomputeState>(
        ctx->saved_data["state"].toCapsule());
    const variable_list saved = ctx->get_saved_variables();
    variable_list detached;
    detached.reserve(saved.size());
    for (const at::Tensor& t : saved) {
      if (!t.defined()) {
        detached.push_back(t);
        continue;
      }
      at::Tensor d = t.detach();
      if (t.requires_grad()) d.requires_grad_(true);
      detached.push_back(std::move(d));
    }

    variable_list outputs;
    {
      // The recompute draws what the forward drew; the generator is left
      // where the rest of the backward expects it.
      std::optional<at::Tensor> now;
      if (state->rng_state.has_value()) {
        now = GeneratorState();
        SetGeneratorState(*state->rng_state);
      }
      struct Restore {
        std::optional<at::Tensor>* now;
        ~Restore() {
          if (now->has_value()) SetGeneratorState(**now);
        }
      } restore{&now};
      torch::AutoGradMode grad_on(true);
      outputs = state->f(detached);
    }
    TORCH_CHECK(outputs.size() == grad_outputs.size(),
                "flatparam Recompute: the recompute returned ", outputs.size(),
                " tensors, but the forward returned ", grad_outputs.size(),
                " (the function must be deterministic)");

    variable_list roots;
    variable_list grads;
    for (size_t i = 0; i < outputs.size(); ++i) {
      if (outputs[i].defined() && outputs[i].requires_grad() &&
          grad_outputs[i].defined()) {
        roots.push_back(outputs[i]);
        grads.push_back(grad_outputs[i]);
      }
    }
    if (!roots.empty()) {
      struct GraphId {
        uint64_t outer = current_graph_id;
        GraphId() { current_graph_id = ++graphs_seen; }
        ~GraphId() { current_graph_id = outer; }
      } graph_id;
      torch::autograd::backward(roots, grads);
    }

    // One gradient per forward argument: none for the state, one per
    // input, none for the anchor.
    variable_list result;
    result.reserve(detached.size() + 2);
    result.emplace_back();
    for (const at::Tensor& d : detached) {
      result.push_back(d.defined() && d.requires_grad() ? d.grad()
                                                        : at::Tensor());
    }
    result.emplace_back();
    return result;
  }
};

}  // namespace

namespace internal {
uint64_t RecomputeGraphId() { return current_graph_id; }
}  // namespace internal

variable_list Recompute(const TensorsFunction& f, const variable_list& inputs,
                        const RecomputeOptions& options) {
  if (!torch::GradMode::is_enabled()) return f(inputs);
  auto state = c10::make_intrusive<RecomputeState>();
  state->f = f;
  if (options.preserve_rng_state) state->rng_state = GeneratorState();
  variable_list inputs_and_anchor = inputs;
  inputs_and_anchor.push_back(torch::empty({0}).requires_grad_(true));
  return RecomputeFunction::apply(std::move(state),
                                  at::TensorList(inputs_and_anchor));
}

torch::Tensor Recompute(const TensorFunction& f, const torch::Tensor& input,
                        const RecomputeOptions& options) {
  variable_list out = Recompute(
      [f](const variable_list& in) { return variable_list{f(in[0])}; },
      variable_list{input}, options);
  return out[0];
}

}  // namespace libtorch
}  // namespace flatparam
