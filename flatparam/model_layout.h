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
#ifndef FLATPARAM_MODEL_LAYOUT_H_
#define FLATPARAM_MODEL_LAYOUT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "flatparam/layout.h"

namespace flatparam {

// A model as its parameters in module traversal order plus the unit
// prefixes to wrap.
//
// A `wrap` entry is a module prefix ("layers.3") or a glob over module
// prefixes: `*` matches any run (possibly empty) of characters other than
// '.', so it never crosses a dotted component, and every other character
// (including '?' and '[') matches itself. A glob of k components stands for
// every distinct k-component module prefix that matches it and has a
// parameter under it, in the order of the first such parameter:
// "layers.*" is "layers.0", "layers.1", ... and "h.*.mlp" is "h.0.mlp",
// "h.1.mlp", ...; "layers.1*" matches "layers.1" and "layers.10" but not
// "layers.1.attn". ExpandWrapPatterns resolves the globs; ModelLayout::Create
// does so itself, so model files and presets may hold either form.
// A buffer: module state that is not a parameter (BatchNorm's running
// statistics, a step counter), saved with the parameters as
// `nn.Module.state_dict()` saves it. Buffers are not flattened or sharded:
// every rank holds each whole, and checkpoints store them whole
// (checkpoint_dir.h). Any dtype, integers and bool included.
struct BufferSpec {
  // Fully-qualified name, e.g. "bn.running_mean"; unique among parameters
  // and buffers.
  std::string fqn;
  // Shape; empty for a 0-d scalar (BatchNorm's num_batches_tracked).
  std::vector<int64_t> shape;
  DType dtype = DType::kFloat32;

  friend bool operator==(const BufferSpec& a, const BufferSpec& b) {
    return a.fqn == b.fqn && a.shape == b.shape && a.dtype == b.dtype;
  }
  friend bool operator!=(const BufferSpec& a, const BufferSpec& b) {
    return !(a == b);
  }
};

struct ModelSpec {
  std::string name;
  std::vector<ParamSpec> params;
  std::vector<std::string> wrap;
  // The model's buffers in module traversal order (`named_buffers()`);
  // empty for a model without any.
  std::vector<BufferSpec> buffers;
};

// The first difference between two models' buffers in a user's words
// ("buffer 'bn.running_mean' is [8] float32 in the checkpoint's model and
// [16] float32 in the job's"), with `a_name` and `b_name` naming the two
// models ("the checkpoint's", "the job's"); empty when they have the same
// buffers in the same order.
std::string DescribeBufferDifference(const ModelSpec& a, const ModelSpec& b,
                                     absl::string_view a_name,
                                     absl::string_view b_name);

// The flat parameters of a wrapped model.
class ModelLayout {
 public:
  // Splits `spec` into units and lays out each. InvalidArgument, naming the
  // values, for: a duplicate or empty fqn, a tie to an unknown or later
  // parameter, a tie that crosses units (both parameter names and both
  // units), ExpandWrapPatterns' errors, a wrap prefix that names no
  // parameter, a buffer with an empty name or the name of a parameter or
  // of another buffer, and every error FlatParamLayout::Create reports.
  static absl::StatusOr<ModelLayout> Create(const ModelSpec& spec,
                                            const LayoutOptions& options);

  // The spec given to Create with its wrap globs expanded
  // (ExpandWrapPatterns): `wrap` lists plain prefixes only, so that what is
  // saved with a checkpoint names every unit.
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

// Whether the wrap entry `entry` is a glob (holds a '*').
bool IsWrapGlob(absl::string_view entry);

// `spec` with every glob of `spec.wrap` replaced, in place, by the prefixes
// it stands for (see ModelSpec); plain prefixes stay as they are and where
// they are. InvalidArgument, naming the entry, for an entry that is empty
// or starts or ends with '.', a glob that matches no module prefix, and a
// prefix that appears twice, whether listed twice, listed and matched by a
// glob, or matched by two globs ("layers.*" next to "layers.0" is an
// error, not deduplicated: each unit is wrapped once, by one entry). A
// plain prefix that names no parameter is left for ModelLayout::Create to
// report.
absl::StatusOr<ModelSpec> ExpandWrapPatterns(const ModelSpec& spec);

// The unit (a prefix from `wrap`, or "" for the root) that owns `fqn`: the
// longest prefix p with fqn == p + "." + rest. `wrap` holds plain prefixes
// (globs expanded).
std::string OwningUnit(const std::string& fqn,
                       const std::vector<std::string>& wrap);

}  // namespace flatparam

#endif  // FLATPARAM_MODEL_LAYOUT_H_
