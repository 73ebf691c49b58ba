// One training iteration of a model whose compute is synthetic -- a kernel
// of known duration per unit, as sim/cost_model.h models compute -- driven
// through FsdpRuntime in PyTorch FSDP's hook order, so that a run of the
// real runtime (on the simulated device, on MPI) can be set beside
// `fsdp plan`'s prediction for the same model: verify/plan_agreement_test
// and benchmarks/step_bench. Not the product (refmodel is testonly in
// spirit: internal to this repository).
//
// Compute follows cost_model.h: unit u's forward is 2 P_u T FLOPs and its
// backward twice that, P_u its parameter count (FlatParamLayout::
// param_numel), T the tokens per rank; the root unit (module prefix "",
// which must be unit 0, the first flat parameter, as `fsdp plan` assumes)
// splits its work evenly between before the layers and after them,
// mirrored in the backward. The order of calls, units 1..L being the
// layers in layout order:
//
//   PreForward(0)  F(0, pre)
//   for u = 1..L:  PreForward(u)  F(u)  PostForward(u)
//   F(0, post)  PostForward(0)
//   PreBackward(0)  B(0, post)
//   for u = L..1:  PreBackward(u)  B(u)  PostBackward(u)
//   B(0, pre)  PostBackward(0)  FinalizeBackward()
//
// where each F/B is a call of the caller's kernel function: on the
// simulated device a SimDeviceOps::Kernel of that duration that reads the
// unsharded parameter (and, backward, writes the unsharded gradient); on
// a host a busy wait (SpinKernel).
//
// Thread-safety: a plain function on the caller's runtime (one thread).
#ifndef FLATPARAM_REFMODEL_SYNTHETIC_STEP_H_
#define FLATPARAM_REFMODEL_SYNTHETIC_STEP_H_

#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "flatparam/handle.h"
#include "flatparam/model_layout.h"
#include "flatparam/runtime.h"

namespace flatparam {
namespace refmodel {

// One synthetic kernel to run now, on the handle's compute stream.
struct KernelCall {
  std::string name;  // e.g. "forward layers.3", "backward root (pre)"
  int unit = 0;
  bool backward = false;
  absl::Duration duration;
  // The unit's handle: unsharded, in FORWARD or BACKWARD_PRE.
  FlatParamHandle* handle = nullptr;
};
using KernelFn = std::function<absl::Status(const KernelCall&)>;

// Per unit, the forward's duration: 2 P_u T / flops_per_second (the root's
// whole forward, both halves). InvalidArgument unless tokens and
// flops_per_second are positive and finite.
absl::StatusOr<std::vector<absl::Duration>> SyntheticForwardTimes(
    const ModelLayout& layout, double tokens_per_rank, double flops_per_second);

// Runs one iteration (see the file comment). `forward[u]` is unit u's
// forward duration (backward: twice). With `blocking_reductions` each
// unit's reduction is finished right after its PostBackward (the handle's
// FinishReduceGrad) instead of overlapping the next unit's backward: with
// BackwardPrefetch::kNone, the runtime without overlap. InvalidArgument
// unless unit 0 is the root (prefix "") and `forward` has one entry per
// unit; the runtime's and the kernel's errors are returned as they are.
//
// `skipped_units` (layers, not the root) are left out on this rank: their
// hooks and kernels are not called, as for a conditional module that this
// rank's input does not reach -- a program whose ranks disagree, for
// showing how the simulator reports it.
absl::Status RunSyntheticStep(FsdpRuntime& runtime,
                              const std::vector<absl::Duration>& forward,
                              const KernelFn& kernel,
                              bool blocking_reductions = false,
                              const std::vector<int>& skipped_units = {});

// A kernel for host devices: spins for the call's duration of wall-clock
// time (a CPU busy with compute, so that collectives progressing in the
// background are what overlap).
absl::Status SpinKernel(const KernelCall& call);

}  // namespace refmodel
}  // namespace flatparam

#endif  // FLATPARAM_REFMODEL_SYNTHETIC_STEP_H_
