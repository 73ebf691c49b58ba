// FsdpModule's forward and backward: iterations, the units' forward
// hooks, and the backward's hooks on outputs, autograd nodes and gradient
// accumulators (see fsdp_module.h for what they do and when).
#include <ATen/SequenceNumber.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/types.h>
#include <torch/utils.h>

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
#include "flatparam/torch/fsdp_module.h"
#include "flatparam/torch/internal/fsdp_module_internal.h"

namespace flatparam {
namespace libtorch {

using internal_fsdp_module::NodePtr;
using internal_fsdp_module::Quoted;
using internal_fsdp_module::WeakNodePtr;
using torch::autograd::Node;

namespace {

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
  FLATPARAM_RETURN_IF_ERROR(device_->CheckCurrentStream());
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
  std::vector<NodePtr> stack;
  auto consider = [&](const NodePtr& node) {
    if (node == nullptr) return;
    const uint64_t seq = node->sequence_nr();
    if (seq < first || seq >= end || !seen.insert(node.get()).second) return;
    stack.push_back(node);
  };
  for (const torch::Tensor& t : outputs) {
    if (t.defined()) consider(t.grad_fn());
  }
  while (!stack.empty()) {
    NodePtr node = std::move(stack.back());
    stack.pop_back();
    const size_t index = u.nodes.size();
    u.nodes.push_back({WeakNodePtr(node), false, false});
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
  FLATPARAM_RETURN_IF_ERROR(device_->CheckCurrentStream());
  // A forward whose loss was never back-propagated, then an optimizer step:
  // the root's gathered parameters are stale; that iteration is over.
  if (runtime_->in_iteration() && !backward_began_ && OptimizerStepped()) {
    FLATPARAM_RETURN_IF_ERROR(EndForwardOnlyIteration());
  }
  if (!runtime_->in_iteration()) {
    ++iteration_;
    iteration_ended_early_ = false;
    backward_began_ = false;
    graph_pending_ = false;
    for (auto& u : units_) u->nodes.clear();
    FLATPARAM_RETURN_IF_ERROR(SyncFromModule());
  }
  // The forward may read what the iteration's start wrote (gradients set
  // to None, a frozen unit's), even with no root unit to bind.
  FLATPARAM_RETURN_IF_ERROR(HandToTorch());
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
        graph_pending_ = true;
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
  // Nothing will run a backward over this iteration's forwards
  // (evaluation, or a failed forward): the iteration ends here, as
  // PyTorch's does. (An evaluation inside a training step, between its
  // forward and its backward, leaves the step's iteration open.)
  if (!hooked && !graph_pending_) {
    absl::Status ended = EndForwardOnlyIteration();
    if (ended.ok()) ended = HandToTorch();
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
    return absl::NotFoundError(absl::StrCat(
        "\"", name, "\" is not a unit; the units are ", Quoted(unit_names())));
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
    NodePtr node = tracked.node.lock();
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
  // Autograd runs a node on the stream its forward ran on.
  CheckStreamInHook();
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
  CheckStreamInHook();
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
  // The optimizer reads the sharded gradients.
  absl::Status handed = HandToTorch();
  if (status.ok()) status = handed;
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
  FLATPARAM_RETURN_IF_ERROR(device_->CheckCurrentStream());
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
          Quoted(sharded),
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
  // Gradients only: allowed between a forward and its backward too (the
  // optimizer.zero_grad() of a loop that zeroes after the forward).
  if (in_forward_ || in_backward_ || summoned_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "FsdpModule::ZeroGrad inside a ", in_forward_ ? "forward"
                                          : in_backward_
                                              ? "backward"
                                              : "SummonFullParams scope"));
  }
  FLATPARAM_RETURN_IF_ERROR(runtime_->ZeroGrad(set_to_none));
  BindShardedGrads();
  return HandToTorch();
}

absl::StatusOr<double> FsdpModule::ClipGradNorm(double max_norm,
                                                double norm_type) {
  FLATPARAM_RETURN_IF_ERROR(BetweenIterations("ClipGradNorm"));
  FLATPARAM_ASSIGN_OR_RETURN(double norm,
                             runtime_->ClipGradNorm(max_norm, norm_type));
  FLATPARAM_RETURN_IF_ERROR(HandToTorch());
  return norm;
}

}  // namespace libtorch
}  // namespace flatparam
