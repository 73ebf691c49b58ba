#include "flatparam/checkpoint/checkpoint_dir.h"

#include <cstdint>
#include <cstring>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/checkpoint/checkpoint_names.h"
#include "flatparam/checkpoint/internal/checkpoint_write.h"
#include "flatparam/checkpoint/manifest.h"
#include "flatparam/checkpoint/safetensors.h"
#include "flatparam/model_layout.h"

namespace flatparam {
namespace checkpoint {
namespace {

using internal_checkpoint::DumpJson;
using internal_checkpoint::JsonFile;
using internal_checkpoint::PendingFile;
using internal_checkpoint::SafetensorsFile;
using internal_checkpoint::WriteCheckpointFiles;

}  // namespace

absl::Status WriteFullCheckpoint(FileSystem& fs, const std::string& dir,
                                 const FullCheckpointContent& content,
                                 const CheckpointWriteOptions& options) {
  for (const TensorSource& t : content.optim) {
    if (!absl::StartsWith(t.name, kOptimStatePrefix) ||
        t.name.size() == strlen(kOptimStatePrefix)) {
      return absl::InvalidArgumentError(
          absl::StrCat(kOptimFileName, ": tensor '", t.name,
                       "' is not named state.{fqn}.{state_name}"));
    }
  }
  if (!content.optim_json.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(kOptimJsonFileName, ": must be a JSON object, not a ",
                     content.optim_json.type_name()));
  }
  std::vector<PendingFile> files;
  FLATPARAM_ASSIGN_OR_RETURN(
      PendingFile model,
      SafetensorsFile(kModelFileName, content.model, {}, options.chunk_bytes));
  files.push_back(std::move(model));
  FLATPARAM_ASSIGN_OR_RETURN(
      PendingFile optim,
      SafetensorsFile(kOptimFileName, content.optim, {}, options.chunk_bytes));
  files.push_back(std::move(optim));
  FLATPARAM_ASSIGN_OR_RETURN(std::string optim_json,
                             DumpJson(content.optim_json, kOptimJsonFileName));
  files.push_back(JsonFile(kOptimJsonFileName, std::move(optim_json)));
  return WriteCheckpointFiles(fs, dir, CheckpointKind::kFull, files, options);
}

absl::Status WriteShardedCheckpoint(FileSystem& fs, const std::string& dir,
                                    const ShardedCheckpointContent& content,
                                    const CheckpointWriteOptions& options) {
  if (content.layout == nullptr) {
    return absl::InvalidArgumentError("sharded checkpoint without a layout");
  }
  const ModelLayout& layout = *content.layout;
  const int64_t g = layout.options().world_size;
  FLATPARAM_ASSIGN_OR_RETURN(
      const int64_t w,
      internal_checkpoint::ShardedWorldSize(layout, content.world_size));
  if (static_cast<int64_t>(content.ranks.size()) != g) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%d ranks of content for a layout over %d ranks",
                        content.ranks.size(), g));
  }
  std::vector<PendingFile> files;
  FLATPARAM_ASSIGN_OR_RETURN(PendingFile layout_file,
                             internal_checkpoint::LayoutFile(layout, w));
  files.push_back(std::move(layout_file));
  for (int64_t r = 0; r < g; ++r) {
    FLATPARAM_ASSIGN_OR_RETURN(
        std::vector<PendingFile> rank_files,
        internal_checkpoint::RankFiles(layout, r, content.ranks[r],
                                       options.chunk_bytes));
    for (PendingFile& f : rank_files) files.push_back(std::move(f));
  }
  return WriteCheckpointFiles(fs, dir, CheckpointKind::kSharded, files,
                              options);
}

}  // namespace checkpoint
}  // namespace flatparam
