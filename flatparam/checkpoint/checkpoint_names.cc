#include "flatparam/checkpoint/checkpoint_names.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace flatparam {
namespace checkpoint {
namespace internal_checkpoint {

std::string NormalizeDir(absl::string_view dir) {
  while (dir.size() > 1 && dir.back() == '/') dir.remove_suffix(1);
  return std::string(dir);
}

}  // namespace internal_checkpoint

namespace {

using internal_checkpoint::NormalizeDir;

}  // namespace

std::string RankTensorFileName(int64_t rank) {
  return absl::StrFormat("rank%05d.safetensors", rank);
}
std::string RankJsonFileName(int64_t rank) {
  return absl::StrFormat("rank%05d.json", rank);
}
std::string BufferTensorName(absl::string_view fqn) {
  return absl::StrCat(kBufferPrefix, fqn);
}

std::string FlatParamTensorName(int64_t flat_param_index) {
  return absl::StrCat(kFlatParamPrefix, flat_param_index);
}
std::string OptimShardTensorName(int64_t flat_param_index,
                                 absl::string_view state_name) {
  return absl::StrCat(kOptimShardPrefix, flat_param_index, ".", state_name);
}
std::string OptimStateTensorName(absl::string_view fqn,
                                 absl::string_view state_name) {
  return absl::StrCat(kOptimStatePrefix, fqn, ".", state_name);
}

std::string BackupDirFor(absl::string_view dir) {
  return absl::StrCat(NormalizeDir(dir), kBackupSuffix);
}

}  // namespace checkpoint
}  // namespace flatparam
