// Reading and writing model descriptions (ModelSpec) as JSON model files.
//
// A model file lists the parameters in module traversal order (the order of
// PyTorch's `model.named_parameters(remove_duplicate=False)`) and the unit
// prefixes to wrap:
//
//   {
//     "name": "tiny",                                  (optional)
//     "params": [
//       {"fqn": "emb.weight", "shape": [11, 3], "dtype": "float32",
//        "requires_grad": true},
//       {"fqn": "seq.2.weight", "shape": [7, 5]},
//       {"fqn": "head.weight", "tied_to": "emb.weight"}
//     ],
//     "wrap": ["seq.2"],                               (optional)
//     "buffers": [                                     (optional)
//       {"fqn": "bn.running_mean", "shape": [5]},
//       {"fqn": "bn.num_batches_tracked", "shape": [], "dtype": "int64"}
//     ]
//   }
//
// `dtype` defaults to "float32" and accepts every name flatparam::ParseDType
// does (integer dtypes parse; laying them out fails later, as in PyTorch);
// `requires_grad` defaults to true; `shape` is required ([] for a scalar)
// except on a tied entry, which shares its primary's tensor: it needs only
// `fqn` and `tied_to`, and may repeat `shape`, `dtype` and `requires_grad`
// as exporters write them, each of which must then equal its (earlier)
// primary's (InvalidArgument naming both otherwise); the parsed spec drops
// them. Unknown keys are errors. `name` defaults to the source name.
// `buffers` (model.h's BufferSpec) lists the module's buffers in
// `named_buffers()` order, each with `fqn` and `shape` and an optional
// `dtype` ("float32" by default, any dtype); ModelSpecToJson writes the key
// only for a model that has buffers.
//
// A `wrap` entry may be a glob ("layers.*", "h.*.mlp"; see ModelSpec in
// model.h): it is kept as written here and expanded by ModelLayout::Create.
//
// Cross-parameter rules (unique names, ties to earlier parameters, wrap
// prefixes and globs that match) are ModelLayout::Create's to check.
//
// Thread-safety: pure functions, except that LoadModelSpec reads a file.
#ifndef FLATPARAM_MODEL_JSON_H_
#define FLATPARAM_MODEL_JSON_H_

#include <nlohmann/json_fwd.hpp>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "flatparam/model_layout.h"

namespace flatparam {

// Parses the model file `text`; `source_name` (a path, or e.g. "<stdin>")
// prefixes every error message. Returns InvalidArgument with
// "<source>:<line>:<column>: ..." for malformed JSON, "<source>: nested
// deeper than ..." for a document deeper than kMaxJsonDepth
// (base/json_limits.h), and with the JSON path
// of the offending value (e.g. "params[3].shape[1]: expected a non-negative
// integer, got -2") for a document that does not fit the schema.
absl::StatusOr<ModelSpec> ParseModelSpecJson(absl::string_view text,
                                             absl::string_view source_name);

// A preset name (see presets.h) gives that preset; anything else is read as
// a model file path. A path that does not exist gives NotFound naming it and
// listing the presets; other read errors give InvalidArgument with the
// system's reason; parse errors are ParseModelSpecJson's.
absl::StatusOr<ModelSpec> LoadModelSpec(absl::string_view preset_or_path);

// The model file for `spec`; ParseModelSpecJson(ModelSpecToJson(s).dump())
// gives back `s` (tied entries drop their ignored shape and dtype).
nlohmann::json ModelSpecToJson(const ModelSpec& spec);

}  // namespace flatparam

#endif  // FLATPARAM_MODEL_JSON_H_
