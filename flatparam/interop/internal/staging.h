// Private to //flatparam/torch: what the importers of foreign checkpoints
// (torch.save, DCP) share. They stage the user's files as a Hugging Face
// safetensors checkpoint in a temporary sibling of the output directory and
// hand that to ImportHfCheckpoint, so that names, dtypes, shapes, ties and
// casts are checked exactly as for safetensors; errors then name the
// user's files instead of the staged ones.
//
// Thread-safety: reentrant; the FileSystem is borrowed.
#ifndef FLATPARAM_INTEROP_INTERNAL_STAGING_H_
#define FLATPARAM_INTEROP_INTERNAL_STAGING_H_

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "flatparam/checkpoint/checkpoint_dir.h"
#include "flatparam/checkpoint/convert.h"
#include "flatparam/checkpoint/file_system.h"
#include "flatparam/checkpoint/safetensors.h"
#include "flatparam/layout.h"

namespace flatparam {
namespace libtorch {
namespace internal_torch {

// A staging directory, removed (with what it holds) when this goes out of
// scope. Its path is the importer's own (StagingPath), never a user's.
class StagingDir {
 public:
  StagingDir(checkpoint::FileSystem& fs, std::string path)
      : fs_(fs), path_(std::move(path)) {}
  ~StagingDir();
  StagingDir(const StagingDir&) = delete;
  StagingDir& operator=(const StagingDir&) = delete;

  // Creates it empty (removing a leftover of an interrupted import).
  absl::Status Create();
  const std::string& path() const { return path_; }

 private:
  checkpoint::FileSystem& fs_;
  std::string path_;
};

// "<out_dir>.<what>.tmp": the staging directory of an import into
// `out_dir`.
std::string StagingPath(const std::string& out_dir, absl::string_view what);

// The output replaces whatever is at `out`: InvalidArgument when it is the
// input or a directory holding it (by spelling, as hf_checkpoint.cc
// checks).
absl::Status CheckDistinct(const std::string& in, const std::string& out);

// `in_dir` opened as a full checkpoint: itself when it is one, else the
// sharded checkpoint there consolidated into `full_dir` (with `convert`'s
// options but overwrite, outcome and progress); `sharded_layout` receives
// its layout then. The exporters' start.
absl::StatusOr<checkpoint::FullCheckpointReader> OpenAsFull(
    checkpoint::FileSystem& fs, const std::string& in_dir,
    const StagingDir& full_dir, const checkpoint::ConvertOptions& convert,
    std::optional<ModelLayout>* sharded_layout);

// Puts the finished `staging` in place as `out_dir`: syncs it, removes an
// existing `out_dir` when `replace` (the caller's overwrite, checked
// before anything was written), renames, syncs the parent.
absl::Status PublishStaged(checkpoint::FileSystem& fs,
                           const StagingDir& staging,
                           const std::string& out_dir, bool replace);

// Writes `sources` as the safetensors file `path` ("format": "pt"),
// synced and closed.
absl::Status WriteSafetensorsFile(
    checkpoint::FileSystem& fs, const std::string& path,
    const std::vector<checkpoint::TensorSource>& sources);

// `status` with every staged path in its message replaced by the user's
// (`renames`: staged -> user's; a path before its prefixes), prefixed
// with `what`.
absl::Status WithUserPaths(const absl::Status& status,
                           const std::map<std::string, std::string>& renames,
                           absl::string_view what);

}  // namespace internal_torch
}  // namespace libtorch
}  // namespace flatparam

#endif  // FLATPARAM_INTEROP_INTERNAL_STAGING_H_
