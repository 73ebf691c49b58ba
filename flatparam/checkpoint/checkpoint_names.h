// Every name in a checkpoint directory, in one place (as LevelDB's
// db/filename.h holds every file name of its database): the files of full
// and sharded checkpoints, the tensors in them, and the names a crash-safe
// write gives the directories beside DIR. The writers and readers
// (checkpoint_dir.h, which includes this header), the collective saves and
// the offline conversions (convert.h, interop/hf/hf_checkpoint.h) build and
// take names apart only with these.
//
// Thread-safety: constants and pure functions.
#ifndef FLATPARAM_CHECKPOINT_CHECKPOINT_NAMES_H_
#define FLATPARAM_CHECKPOINT_CHECKPOINT_NAMES_H_

#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"

namespace flatparam {
namespace checkpoint {

inline constexpr char kModelFileName[] = "model.safetensors";
inline constexpr char kOptimFileName[] = "optim.safetensors";
inline constexpr char kOptimJsonFileName[] = "optim.json";
inline constexpr char kLayoutFileName[] = "layout.json";

// The prefixes of the names below.
inline constexpr char kTmpInfix[] = ".tmp-";
inline constexpr char kBackupSuffix[] = ".previous";
inline constexpr char kOptimStatePrefix[] = "state.";
inline constexpr char kFlatParamPrefix[] = "flat_params.";
inline constexpr char kOptimShardPrefix[] = "optim.";
inline constexpr char kBufferPrefix[] = "buffers.";

// "rank00003.safetensors" / "rank00003.json".
std::string RankTensorFileName(int64_t rank);
std::string RankJsonFileName(int64_t rank);
// "flat_params.3", "optim.3.exp_avg": tensor names in rank files.
std::string FlatParamTensorName(int64_t flat_param_index);
std::string OptimShardTensorName(int64_t flat_param_index,
                                 absl::string_view state_name);
// "buffers.bn.running_mean": a buffer's tensor name in rank files.
std::string BufferTensorName(absl::string_view fqn);
// "state.layers.0.w.exp_avg": tensor names in optim.safetensors.
std::string OptimStateTensorName(absl::string_view fqn,
                                 absl::string_view state_name);

// DIR.previous: where a write keeps the checkpoint it replaces (step 3).
std::string BackupDirFor(absl::string_view dir);

namespace internal_checkpoint {

// `dir` without trailing slashes ("/" stays): the form of a directory name
// that BackupDirFor and the writers append to.
std::string NormalizeDir(absl::string_view dir);

}  // namespace internal_checkpoint

}  // namespace checkpoint
}  // namespace flatparam

#endif  // FLATPARAM_CHECKPOINT_CHECKPOINT_NAMES_H_
