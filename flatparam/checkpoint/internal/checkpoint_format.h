// Private to //flatparam/checkpoint: what the format requires of a rank
// file (and the keys layout.json and the rank files add to what
// layout_json.h and safetensors.h define), in one place for the writers
// (internal/checkpoint_write.h's RankFiles and LayoutFile) and the readers
// (checkpoint_dir.h's ShardedCheckpointReader, checkpoint_dir_read.cc), so
// that what one writes is exactly what the other accepts.
//
// Ownership: nothing is kept; arguments are borrowed for the call.
// Thread-safety: constants and pure functions.
#ifndef FLATPARAM_CHECKPOINT_INTERNAL_CHECKPOINT_FORMAT_H_
#define FLATPARAM_CHECKPOINT_INTERNAL_CHECKPOINT_FORMAT_H_

#include <string>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "flatparam/checkpoint/safetensors.h"
#include "flatparam/model_layout.h"

namespace flatparam {
namespace checkpoint {
namespace internal_checkpoint {

// Metadata keys of rank files.
inline constexpr char kRankKey[] = "rank";
inline constexpr char kShardGroupSizeKey[] = "shard_group_size";
// layout.json's model spec (model_json.h), beside the layout_json.h
// document.
inline constexpr char kModelSpecKey[] = "model_spec";

// The tensors of a rank file must be exactly what `layout` implies.
// `code` is InvalidArgument when writing, DataLoss when reading.
absl::Status CheckRankTensors(const ModelLayout& layout,
                              absl::Span<const TensorDecl> tensors,
                              const std::string& file, absl::StatusCode code);

}  // namespace internal_checkpoint
}  // namespace checkpoint
}  // namespace flatparam

#endif  // FLATPARAM_CHECKPOINT_INTERNAL_CHECKPOINT_FORMAT_H_
