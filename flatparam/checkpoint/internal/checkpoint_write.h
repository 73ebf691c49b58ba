// Private to //flatparam/checkpoint: the steps of checkpoint_dir.h's
// crash-safe write, taken apart so that a write spread over the ranks of a
// job (collective_checkpoint.h) runs exactly the same steps and produces
// exactly the same bytes as the single-process writers.
//
// The steps, as checkpoint_dir.h numbers them:
//   0. PrepareCheckpointWrite: validate the directory and options, settle an
//      interrupted earlier write (RecoverCheckpointDir).
//   1. CreateDir(NewTempDirFor(dir)); WritePendingFile for every file (by
//      any process that shares the file system).
//   2-5. PublishCheckpoint: the names, the manifest, the swap.
// On an error after step 0 the writer calls RecoverCheckpointDir (best
// effort), which removes the temporary directory and puts back a moved-away
// checkpoint. WriteCheckpointFiles runs the whole sequence in one process.
//
// checkpoint_write.cc defines these and the protocol's public ends,
// checkpoint_dir.h's ResolveCheckpointDir and RecoverCheckpointDir.
// Ownership: a PendingFile may borrow the content it was made from (see
// there); nothing else is kept.
// Thread-safety: pure functions apart from the file system they are given.
#ifndef FLATPARAM_CHECKPOINT_INTERNAL_CHECKPOINT_WRITE_H_
#define FLATPARAM_CHECKPOINT_INTERNAL_CHECKPOINT_WRITE_H_

#include <cstdint>
#include <functional>
#include <map>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "flatparam/checkpoint/checkpoint_dir.h"
#include "flatparam/checkpoint/file_system.h"
#include "flatparam/checkpoint/manifest.h"
#include "flatparam/checkpoint/safetensors.h"
#include "flatparam/layout.h"

namespace flatparam {
namespace checkpoint {
namespace internal_checkpoint {

// A file of a checkpoint, ready to be written. `write` may borrow the
// content it was made from (a RankContent's TensorSources), which must
// outlive it.
struct PendingFile {
  std::string name;
  uint64_t size = 0;
  std::function<absl::Status(WritableFile&)> write;
};

// The canonical JSON text of a document (2-space indent, trailing newline);
// InvalidArgument naming `what` for what JSON cannot hold (invalid UTF-8).
absl::StatusOr<std::string> DumpJson(const nlohmann::json& doc,
                                     absl::string_view what);
PendingFile JsonFile(std::string name, std::string text);

// A safetensors file of `tensors` (borrowed: they must outlive the
// PendingFile) with `metadata`, written in pieces of at most `chunk_bytes`.
// SafetensorsFileSize's errors, prefixed with `name`.
absl::StatusOr<PendingFile> SafetensorsFile(
    std::string name, const std::vector<TensorSource>& tensors,
    std::map<std::string, std::string> metadata, uint64_t chunk_bytes);

// What a write puts into its directory, so that step 0 can tell a
// directory it may replace from one it must not touch.
enum class DirKind {
  kFull,     // a full checkpoint (manifest.json of kind "full")
  kSharded,  // a sharded checkpoint (manifest.json of kind "sharded")
  kHfExport  // a Hugging Face export: model.safetensors, or
             // model-NNNNN-of-NNNNN.safetensors with
             // model.safetensors.index.json (no manifest)
};

// What an existing directory holds, seen by a write of `kind`.
struct DirContents {
  bool exists = false;
  // Files a write of `kind` may replace: a checkpoint of `kind` (for kFull
  // and kSharded: the files its manifest lists and manifest.json; for
  // kHfExport: files of the export's names), and files named in
  // `identical` whose content is that text.
  std::vector<std::string> ours;
  // Every other entry, sorted.
  std::vector<std::string> foreign;
  // "a full checkpoint" when the manifest is of another kind, else empty.
  std::string other_kind;
};
absl::StatusOr<DirContents> InspectCheckpointDir(
    FileSystem& fs, const std::string& dir, DirKind kind,
    const std::map<std::string, std::string>& identical = {});

// Step 0. Returns the normalised directory name. InvalidArgument for a
// nameless directory or chunk_bytes 0, NotFound for a missing parent, the
// file system's errors from the recovery. A write replaces its directory
// whole, so an existing directory must be empty or hold only what
// InspectCheckpointDir calls ours (`identical`: side files this write
// writes with exactly that content); anything else is FailedPrecondition
// naming the directory and what it holds, before anything is written, so
// that no write deletes a file it did not write (a model's config.json
// beside an export, another kind of checkpoint, any unrelated directory).
// With options.overwrite a kHfExport write accepts such a directory (it
// then merges, keeping the foreign files).
absl::StatusOr<std::string> PrepareCheckpointWrite(
    FileSystem& fs, const std::string& dir,
    const CheckpointWriteOptions& options, DirKind kind,
    const std::map<std::string, std::string>& identical = {});

// "DIR.tmp-<16 random hex digits>" for a normalised `dir`.
std::string NewTempDirFor(const std::string& dir);

// Writes `file` into directory `tmp`: create, append, fsync, close.
// `on_bytes` (may be empty) is told of every appended piece. Returns the
// file's manifest entry (size and XXH3 of what was written).
absl::StatusOr<ManifestEntry> WritePendingFile(
    FileSystem& fs, const std::string& tmp, const PendingFile& file,
    const std::function<void(uint64_t)>& on_bytes);

// Steps 2-5: syncs `tmp`, writes its manifest (`manifest.files` are sorted
// by path here), and swaps `tmp` in as `dir` (normalised), removing the
// previous checkpoint. `outcome` (may be null) is filled on success.
absl::Status PublishCheckpoint(FileSystem& fs, const std::string& dir,
                               const std::string& tmp, Manifest manifest,
                               DirWriteOutcome* outcome = nullptr);

// Steps 3-5 for any directory: swaps the synced `tmp` in as `dir`, moving
// a previous `dir` to BackupDirFor(dir) and removing it after. Sets
// `outcome->replaced` (may be null) to what `dir` held.
absl::Status SwapInDirectory(FileSystem& fs, const std::string& dir,
                             const std::string& tmp, DirWriteOutcome* outcome);

// Steps 0-5 in one process (WriteFullCheckpoint, WriteShardedCheckpoint):
// prepares `dir` for a checkpoint of `kind`, writes `files` into a new
// temporary directory (reporting to options.progress), publishes it with
// its manifest, and on an error recovers `dir` (best effort) and returns
// the error.
absl::Status WriteCheckpointFiles(FileSystem& fs, const std::string& dir,
                                  CheckpointKind kind,
                                  const std::vector<PendingFile>& files,
                                  const CheckpointWriteOptions& options);

// W for a sharded checkpoint of `layout` on `world_size` ranks (0: the
// layout's own); InvalidArgument when it does not fit the strategy.
absl::StatusOr<int64_t> ShardedWorldSize(const ModelLayout& layout,
                                         int64_t world_size);

// layout.json for `layout` saved on `world_size` (W) ranks.
absl::StatusOr<PendingFile> LayoutFile(const ModelLayout& layout,
                                       int64_t world_size);

// Shard-group rank `rank`'s two files, rank{r}.safetensors and rank{r}.json,
// after checking the content against the layout (InvalidArgument naming the
// rank, file and tensor). The safetensors file borrows `content`.
absl::StatusOr<std::vector<PendingFile>> RankFiles(const ModelLayout& layout,
                                                   int64_t rank,
                                                   const RankContent& content,
                                                   uint64_t chunk_bytes);

}  // namespace internal_checkpoint
}  // namespace checkpoint
}  // namespace flatparam

#endif  // FLATPARAM_CHECKPOINT_INTERNAL_CHECKPOINT_WRITE_H_
