// Optimizer state dicts, as PyTorch's `torch.optim.Optimizer.state_dict()`
// and FSDP's optimizer-state functions represent them.
//
// An OptimStateDict has two parts:
//   * `state`: per parameter key, the parameter's state, a map from state
//     name to value. A value is None, a tensor (positive-dimension like
//     "exp_avg", or zero-dimension with its dtype like AdamW's "step"), or a
//     Python int, float, bool or str.
//   * `param_groups`: each group's hyperparameters and the keys of its
//     parameters.
// Keys are parameter IDs (int64: the position in the optimizer's parameter
// order) or names (std::string: a fully-qualified parameter name, or a
// user-defined key that belongs to no parameter). RekeyOptimStateDict
// converts between the two.
//
// Full and sharded dicts (flatparam/optim/fsdp_optim.h) use the same type:
// a full dict is keyed by original-parameter FQN with tensors shaped like
// the parameters; a sharded dict is one rank's view, keyed by flat-parameter
// index (the flat-parameter path) or FQN (the use_orig_params path).
//
//   OptimStateDict dict;
//   dict.state["fc.weight"]["step"] = ScalarTensor(DType::kFloat32, 3.0);
//   dict.state["fc.weight"]["exp_avg"] = HostTensor(DType::kFloat32, {3, 5});
//   dict.param_groups.push_back({{{"lr", 1e-3}}, {ParamKey("fc.weight")}});
//
// Equality (operator==) is bitwise: tensors compare dtype, shape and bytes,
// floats compare bit patterns (so NaN equals the same NaN, and 0.0 differs
// from -0.0). That is the equality round trips are held to.
//
// These are plain values: they own their tensors, copy deeply, and are not
// synchronised (one thread mutates at a time).
#ifndef FLATPARAM_OPTIM_OPTIM_STATE_H_
#define FLATPARAM_OPTIM_OPTIM_STATE_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "flatparam/base/dtype.h"
#include "flatparam/flatten.h"
#include "flatparam/model_layout.h"

namespace flatparam {
namespace optim {

// One state value. std::monostate is Python's None (PyTorch's SGD stores
// `momentum_buffer: None` without momentum). A HostTensor with an empty
// shape is a zero-dimension tensor.
using OptimStateValue = std::variant<std::monostate, HostTensor, int64_t,
                                     double, bool, std::string>;

// The state of one parameter: PyTorch's `optimizer.state[p]`.
using ParamState = std::map<std::string, OptimStateValue>;

// A parameter key: an ID or a name.
using ParamKey = std::variant<int64_t, std::string>;

// A hyperparameter of a parameter group: None, bool, int, float, str, or a
// tuple of floats (Adam's `betas`).
using HyperValue = std::variant<std::monostate, bool, int64_t, double,
                                std::string, std::vector<double>>;

struct ParamGroup {
  std::map<std::string, HyperValue> hyperparams;
  std::vector<ParamKey> params;
};

struct OptimStateDict {
  std::map<ParamKey, ParamState> state;
  std::vector<ParamGroup> param_groups;

  bool empty() const { return state.empty() && param_groups.empty(); }
};

// Bitwise equality; see the file comment.
bool BitwiseEqual(const OptimStateValue& a, const OptimStateValue& b);
bool BitwiseEqual(const HyperValue& a, const HyperValue& b);
bool operator==(const ParamGroup& a, const ParamGroup& b);
inline bool operator!=(const ParamGroup& a, const ParamGroup& b) {
  return !(a == b);
}
bool operator==(const OptimStateDict& a, const OptimStateDict& b);
inline bool operator!=(const OptimStateDict& a, const OptimStateDict& b) {
  return !(a == b);
}

// std::nullopt when a == b; otherwise where they first differ, e.g.
// `state["fc.weight"]["exp_avg"]: tensor(float32, [3, 5]) differs at
// element 7` or `state[3]: only in the first dict`.
std::optional<std::string> FirstDifference(const OptimStateDict& a,
                                           const OptimStateDict& b);

// A 0-d tensor of `dtype` holding `value` (rounded as a PyTorch cast
// would; integer and bool dtypes truncate).
HostTensor ScalarTensor(DType dtype, double value);

// Classification, as PyTorch's optimizer-state code distinguishes values.
bool IsTensor(const OptimStateValue& v);
bool IsPosDimTensor(const OptimStateValue& v);
bool IsZeroDimTensor(const OptimStateValue& v);

// Python's name of the value's type: "NoneType", "Tensor", "int",
// "float", "bool", "str".
const char* ValueTypeName(const OptimStateValue& v);

// A short description for messages: "tensor(float32, [3, 5])",
// "tensor(3., dtype=float32)", "7", "0.9", "True", "'adam'", "None".
std::string DescribeValue(const OptimStateValue& v);

// "3" for an ID, "'fc.weight'" for a name.
std::string DescribeKey(const ParamKey& key);

// A readable multi-line rendering (tensors by dtype, shape and their first
// `max_elements` elements), for test failures and debugging.
std::string DebugString(const OptimStateDict& dict, int max_elements = 4);

// Total bytes of the tensors in `dict`.
int64_t TensorBytes(const OptimStateDict& dict);

// PyTorch's OptimStateKeyType.
enum class OptimStateKeyType { kParamName, kParamId };

// The order PyTorch numbers a model's parameters in when the optimizer is
// built from `model.parameters()`: the model's parameters in their given
// (module traversal) order, each shared parameter once, under its first
// name.
std::vector<std::string> ModelParamOrder(const ModelLayout& layout);

// PyTorch's `FSDP.rekey_optim_state_dict`: re-keys `state` and the groups'
// `params` between IDs and names, where ID i is `param_order[i]`.
//   * To kParamName: every int key becomes its name; string keys stay.
//   * To kParamId: every string key that names a parameter of
//     `param_order` becomes its ID; other strings (user-defined keys) stay.
// Group parameter lists are mapped element by element, keeping their order,
// so re-keying one way and back is the identity.
//
// InvalidArgument, naming the values, when `param_order` repeats a name,
// an int key or group entry is not in [0, param_order.size()), or a
// re-keyed key collides with a key already present.
absl::StatusOr<OptimStateDict> RekeyOptimStateDict(
    const OptimStateDict& dict, OptimStateKeyType to,
    absl::Span<const std::string> param_order);
// The same with ModelParamOrder(layout).
absl::StatusOr<OptimStateDict> RekeyOptimStateDict(const OptimStateDict& dict,
                                                   OptimStateKeyType to,
                                                   const ModelLayout& layout);

}  // namespace optim
}  // namespace flatparam

#endif  // FLATPARAM_OPTIM_OPTIM_STATE_H_
