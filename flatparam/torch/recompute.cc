#include "flatparam/torch/recompute.h"

#include <ATen/Context.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/types.h>
#include <torch/utils.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <utility>
#include <vector>

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
  // The default generators' states when the forward ran: the CPU's first,
  // then each device's that an input is on (PyTorch's checkpoint saves the
  // CUDA generators of its inputs' devices, get_device_states).
  std::vector<std::pair<c10::Device, at::Tensor>> rng_states;
};

at::Generator DefaultGenerator(c10::Device device) {
  return device.is_cpu() ? at::detail::getDefaultCPUGenerator()
                         : at::globalContext().defaultGenerator(device);
}

at::Tensor GeneratorState(c10::Device device) {
  at::Generator generator = DefaultGenerator(device);
  std::lock_guard<std::mutex> lock(generator.mutex());
  return generator.get_state();
}

void SetGeneratorState(c10::Device device, const at::Tensor& state) {
  at::Generator generator = DefaultGenerator(device);
  std::lock_guard<std::mutex> lock(generator.mutex());
  generator.set_state(state);
}

// The CPU and the devices of `inputs`, each once, in order of appearance.
std::vector<c10::Device> RngDevices(const variable_list& inputs) {
  std::vector<c10::Device> devices = {c10::Device(c10::kCPU)};
  for (const at::Tensor& t : inputs) {
    if (!t.defined()) continue;
    const c10::Device d = t.device();
    if (std::find(devices.begin(), devices.end(), d) == devices.end()) {
      devices.push_back(d);
    }
  }
  return devices;
}

std::vector<std::pair<c10::Device, at::Tensor>> SaveGenerators(
    const std::vector<c10::Device>& devices) {
  std::vector<std::pair<c10::Device, at::Tensor>> states;
  for (c10::Device d : devices) states.emplace_back(d, GeneratorState(d));
  return states;
}

void RestoreGenerators(
    const std::vector<std::pair<c10::Device, at::Tensor>>& states) {
  for (const auto& [device, state] : states) SetGeneratorState(device, state);
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
      std::vector<c10::Device> devices;
      for (const auto& saved_state : state->rng_states) {
        devices.push_back(saved_state.first);
      }
      struct Restore {
        std::vector<std::pair<c10::Device, at::Tensor>> now;
        ~Restore() { RestoreGenerators(now); }
      } restore{SaveGenerators(devices)};
      RestoreGenerators(state->rng_states);
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
  if (options.preserve_rng_state) {
    state->rng_states = SaveGenerators(RngDevices(inputs));
  }
  // The anchor is on the inputs' device, so that the backward does not
  // cross to the CPU's autograd queue for it.
  c10::Device anchor_device(c10::kCPU);
  for (const at::Tensor& t : inputs) {
    if (t.defined()) {
      anchor_device = t.device();
      break;
    }
  }
  variable_list inputs_and_anchor = inputs;
  inputs_and_anchor.push_back(
      torch::empty({0}, torch::TensorOptions().device(anchor_device))
          .requires_grad_(true));
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
