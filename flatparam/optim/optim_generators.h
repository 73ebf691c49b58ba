// RapidCheck generators of full optimizer state dicts for a wrapped model
// (test-only), and the round trip's expected result.
//
// GenFullOptimStateDict draws a dict that the chosen path accepts, the
// way PyTorch's optimizers fill one:
//   * AdamW-like: "step" (0-d float32), "exp_avg", "exp_avg_sq";
//   * SGD with momentum: "momentum_buffer";
//   * SGD without momentum: "momentum_buffer" None;
//   * custom: a tensor plus int, float, bool and str states;
// positive-dimension states in float32 or the parameters' dtype, with
// arbitrary bit patterns (NaNs included, so that any conversion shows);
// flat parameters without state; parameters without state (flat path:
// only where the state has no scalars, as PyTorch requires; original-
// parameter path: only frozen ones); frozen parameters with state; 0-d
// and zero-size parameters; states of unmanaged parameters; a user-defined
// key; parameter groups with hyperparameters.
//
// Thread-safety: like all of RapidCheck, use from the property's thread.
#ifndef FLATPARAM_OPTIM_OPTIM_GENERATORS_H_
#define FLATPARAM_OPTIM_OPTIM_GENERATORS_H_

#include <rapidcheck.h>

#include <ostream>
#include <string>
#include <vector>

#include "flatparam/model_layout.h"
#include "flatparam/optim/optim_state.h"

namespace flatparam {
namespace optim {

// RapidCheck's printer for counterexamples.
void showValue(const OptimStateDict& dict, std::ostream& os);

namespace testing {

// The unmanaged parameters GenFullOptimStateDict may give state to.
inline const std::vector<std::string>& UnmanagedParams() {
  static const auto* names = new std::vector<std::string>{"ignored.weight"};
  return *names;
}

// The user-defined key GenFullOptimStateDict may add.
inline constexpr const char* kUserKey = "__user_counter__";

// A full state dict for `layout`'s model that the flat-parameter path
// (use_orig_params false) or the original-parameter path accepts.
rc::Gen<OptimStateDict> GenFullOptimStateDict(const ModelLayout& layout,
                                              bool use_orig_params);

// What consolidating the sharded `full` gives back: `full` itself on the
// original-parameter path; on the flat path, every parameter of a flat
// parameter with state gets every state name, with zeros for tensors it
// lacked and the flat parameter's common scalar values.
OptimStateDict ExpectedRoundTrip(const ModelLayout& layout,
                                 const OptimStateDict& full,
                                 bool use_orig_params);

}  // namespace testing
}  // namespace optim
}  // namespace flatparam

#endif  // FLATPARAM_OPTIM_OPTIM_GENERATORS_H_
