// The layout JSON document: a ModelLayout written out as JSON for people and
// tools (`fsdp inspect --format=json`, a checkpoint's layout.json).
//
// The document (keys beyond these may be added, never removed):
//
//   {
//     "version": 1,
//     "model": "gpt2",
//     "world_size": W,            total ranks
//     "shard_group_size": G,      ranks one flat parameter is sharded over
//                                 (W except for the hybrid strategies)
//     "strategy": "FULL_SHARD",
//     "align_addresses": false,
//     "compute_dtype": "bfloat16" or null,
//     "flat_params": [{
//       "unit": "transformer.h.0",        "" for the root
//       "dtype": "float32",
//       "aligned_numel": 0,
//       "requires_grad": true,
//       "param_numel": ...,               parameters only, padding excluded
//       "unpadded_unsharded_numel": ..., "padded_unsharded_numel": ...,
//       "sharded_numel": ...,
//       "numels_with_padding": [...], "is_padding_mask": [...],
//       "params": [{"fqn", "shape", "numel", "start", "end_inclusive"}],
//       "shared_params": [{"fqn", "prim_fqn"}],
//       "ranks": [{                       one per shard rank 0..G-1
//         "rank", "numel_padded", "unsharded_start",
//         "unsharded_end_inclusive",
//         "shard_param_infos": [{"fqn", "in_shard", "offset_in_shard",
//             "numel_in_shard", "intra_param_start_idx",
//             "intra_param_end_idx"}]  one per "params" entry; the numeric
//                                      fields are null when in_shard is false
//       }]
//     }]
//   }
//
// Offsets and intervals are in elements of the flat parameter, inclusive
// where the key says so, exactly as PyTorch FSDP's FlatParameter metadata.
// `fqn` is always the full model name.
//
// Thread-safety: pure functions.
#ifndef FLATPARAM_LAYOUT_JSON_H_
#define FLATPARAM_LAYOUT_JSON_H_

#include <cstdint>
#include <nlohmann/json_fwd.hpp>

#include "flatparam/layout.h"
#include "flatparam/model_layout.h"

namespace flatparam {

// The version written to "version"; bumped on incompatible changes.
inline constexpr int kLayoutJsonVersion = 1;

struct LayoutJsonOptions {
  // "world_size": the total number of ranks. 0 means the layout's own world
  // size. For the hybrid strategies the layout is sharded over a shard group
  // and this is the whole job. REQUIRES: 0, or a multiple of the layout's
  // world size.
  int64_t world_size = 0;
};

// The document above for `layout`.
nlohmann::json ModelLayoutToJson(const ModelLayout& layout,
                                 const LayoutJsonOptions& options = {});

// One element of "flat_params".
nlohmann::json FlatParamLayoutToJson(const FlatParamLayout& layout);

}  // namespace flatparam

#endif  // FLATPARAM_LAYOUT_JSON_H_
