#include "flatparam/interop/internal/staging.h"

#include <memory>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/checkpoint/checkpoint_dir.h"

namespace flatparam {
namespace libtorch {
namespace internal_torch {

StagingDir::~StagingDir() {
  checkpoint::RemoveRecursively(fs_, path_).IgnoreError();
}

absl::Status StagingDir::Create() {
  FLATPARAM_RETURN_IF_ERROR(checkpoint::RemoveRecursively(fs_, path_));
  return fs_.CreateDir(path_);
}

std::string StagingPath(const std::string& out_dir, absl::string_view what) {
  std::string base = out_dir;
  while (base.size() > 1 && base.back() == '/') base.pop_back();
  return absl::StrCat(base, ".", what, ".tmp");
}

absl::Status CheckDistinct(const std::string& in, const std::string& out) {
  auto strip = [](std::string p) {
    while (p.size() > 1 && p.back() == '/') p.pop_back();
    return p;
  };
  const std::string i = strip(in);
  const std::string o = strip(out);
  if (i == o || absl::StartsWith(i, absl::StrCat(o, "/"))) {
    return absl::InvalidArgumentError(
        absl::StrCat("the output directory ", out, " is or holds the input ",
                     in, ", and writing it would replace it; write elsewhere"));
  }
  return absl::OkStatus();
}

absl::StatusOr<checkpoint::FullCheckpointReader> OpenAsFull(
    checkpoint::FileSystem& fs, const std::string& in_dir,
    const StagingDir& full_dir, const checkpoint::ConvertOptions& convert,
    std::optional<ModelLayout>* sharded_layout) {
  if (checkpoint::FullCheckpointReader::Open(fs, in_dir).ok()) {
    return checkpoint::FullCheckpointReader::Open(fs, in_dir);
  }
  FLATPARAM_ASSIGN_OR_RETURN(
      checkpoint::ShardedCheckpointReader sharded,
      checkpoint::ShardedCheckpointReader::Open(fs, in_dir));
  sharded_layout->emplace(sharded.layout());
  checkpoint::ConvertOptions options = convert;
  options.overwrite = true;
  options.outcome = nullptr;
  options.progress = nullptr;
  FLATPARAM_RETURN_IF_ERROR(
      checkpoint::ConsolidateCheckpoint(fs, in_dir, full_dir.path(), options));
  return checkpoint::FullCheckpointReader::Open(fs, full_dir.path());
}

absl::Status PublishStaged(checkpoint::FileSystem& fs,
                           const StagingDir& staging,
                           const std::string& out_dir, bool replace) {
  FLATPARAM_RETURN_IF_ERROR(fs.SyncDir(staging.path()));
  if (replace) {
    FLATPARAM_RETURN_IF_ERROR(checkpoint::RemoveRecursively(fs, out_dir));
  }
  FLATPARAM_RETURN_IF_ERROR(fs.Rename(staging.path(), out_dir));
  return fs.SyncDir(checkpoint::Dirname(out_dir));
}

absl::Status WriteSafetensorsFile(
    checkpoint::FileSystem& fs, const std::string& path,
    const std::vector<checkpoint::TensorSource>& sources) {
  FLATPARAM_ASSIGN_OR_RETURN(std::unique_ptr<checkpoint::WritableFile> file,
                             fs.NewWritableFile(path));
  FLATPARAM_RETURN_IF_ERROR(
      checkpoint::WriteSafetensors(*file, path, sources, {{"format", "pt"}}));
  FLATPARAM_RETURN_IF_ERROR(file->Sync());
  return file->Close();
}

absl::Status WithUserPaths(const absl::Status& status,
                           const std::map<std::string, std::string>& renames,
                           absl::string_view what) {
  std::string message(status.message());
  // Reverse order: a path before its prefixes (the directory last).
  for (auto it = renames.rbegin(); it != renames.rend(); ++it) {
    message = absl::StrReplaceAll(message, {{it->first, it->second}});
  }
  return absl::Status(status.code(), absl::StrCat(what, ": ", message));
}

}  // namespace internal_torch
}  // namespace libtorch
}  // namespace flatparam
