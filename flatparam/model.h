// A whole model wrapped into FSDP units, each with one flat parameter.
//
// A unit is a module prefix (PyTorch's fully sharded module, e.g.
// "layers.3"). A unit owns the parameters under its prefix that no deeper
// unit owns; the root unit ("") owns the rest. Units are ordered as PyTorch
// registers their flat parameters in `model.parameters()`: the root first,
// then in module pre-order. Units that end up owning no parameter get no
// flat parameter, as in PyTorch.
//
// A ModelSpec is a plain value; ModelLayout is immutable after Create and
// safe to share between threads.
#ifndef FLATPARAM_MODEL_H_
#define FLATPARAM_MODEL_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "flatparam/layout.h"

namespace flatparam {

// A model as its parameters in module traversal order plus the unit
// prefixes to wrap.
struct ModelSpec {
  std::string name;
  std::vector<ParamSpec> params;
  std::vector<std::string> wrap;
};

// The flat parameters of a wrapped model.
class ModelLayout {
 public:
  // Splits `spec` into units and lays out each. InvalidArgument, naming the
  // values, for: a duplicate or empty fqn, a tie to an unknown or later
  // parameter, a tie that crosses units (both parameter names and both
  // units), a wrap prefix that is empty, duplicated or names no parameter,
  // and every error FlatParamLayout::Create reports.
  static absl::StatusOr<ModelLayout> Create(const ModelSpec& spec,
                                            const LayoutOptions& options);

  const ModelSpec& spec() const { return spec_; }
  const LayoutOptions& options() const { return options_; }
  const std::vector<FlatParamLayout>& flat_params() const {
    return flat_params_;
  }

  // Totals over all flat parameters.
  int64_t param_numel() const;
  int64_t padded_unsharded_numel() const;
  int64_t sharded_numel() const;

 private:
  ModelSpec spec_;
  LayoutOptions options_;
  std::vector<FlatParamLayout> flat_params_;
};

// The unit (a prefix from `wrap`, or "" for the root) that owns `fqn`: the
// longest prefix p with fqn == p + "." + rest.
std::string OwningUnit(const std::string& fqn,
                       const std::vector<std::string>& wrap);

}  // namespace flatparam

#endif  // FLATPARAM_MODEL_H_
