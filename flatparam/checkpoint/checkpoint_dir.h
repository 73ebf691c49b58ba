// Checkpoint directories on disk: the storage layer under model and
// optimizer checkpoints. It writes content the caller has already prepared
// (tensors as streaming TensorSources, JSON documents) and reads it back
// after verifying it; what the tensors mean is the caller's business.
//
// Two kinds of directory:
//
//   Full (consolidated), as PyTorch's full state dicts:
//     model.safetensors   one tensor per parameter and per buffer, keyed
//                         by FQN (a state dict)
//     optim.safetensors   tensor optimizer state, keyed
//                         "state.{fqn}.{state_name}"; 0-d state (e.g. step)
//                         as shape-[] tensors
//     optim.json          {"param_groups": [...FQN lists...], ...}: the
//                         optimizer's non-tensor state (a JSON object)
//     manifest.json
//
//   Sharded, as every rank of an FSDP job holds it:
//     layout.json             the `fsdp inspect --format=json` document
//                             (layout_json.h) for the saved world size,
//                             strategy and alignment, plus "model_spec": the
//                             model file (model_json.h) it was computed from
//     rank{r:05d}.safetensors for each flat parameter i (its index in
//                             layout.json's "flat_params"): "flat_params.{i}",
//                             rank r's padded shard (1-D, sharded_numel
//                             elements of the flat parameter's dtype), and
//                             "optim.{i}.{state_name}": tensor optimizer
//                             state, a padded shard of the same numel or a
//                             shape-[] tensor; and "buffers.{fqn}" for each
//                             buffer of the model spec (model_layout.h's
//                             BufferSpec): rank r's whole buffer
//     rank{r:05d}.json        rank r's non-tensor optimizer state and
//                             param_groups (a JSON object)
//     manifest.json
//   There is one rank file per rank of the shard group (layout.json's
//   "shard_group_size"): the hybrid strategies' replicas hold identical
//   shards and are not stored twice (nor their buffers: a replica's are
//   its shard-group rank's when loaded).
//
// manifest.json (manifest.h) is written last and lists every other file
// with its size and XXH3 checksum. Opening a checkpoint verifies it (and,
// by default, every checksum) before reading anything, then checks that the
// files fit together: a sharded checkpoint's layout.json must be exactly the
// layout recomputed from its own model spec and options, and every rank
// file must hold exactly the tensors that layout implies. Errors say which
// file and what differs; a damaged checkpoint is DataLoss, a checkpoint that
// does not fit what the caller asks for is FailedPrecondition.
//
// Crash safety. A write to DIR never modifies DIR in place:
//   0. RecoverCheckpointDir(DIR) settles an earlier interrupted write (see
//      there) and removes stale DIR.tmp-* directories.
//   1. Every file is written into a new directory T = DIR.tmp-<random>:
//      create, append, fsync, close.
//   2. T is fsynced (the names are durable), then T/manifest.json is written
//      atomically (manifest.json.tmp, fsync, rename, fsync T).
//   3. If DIR exists, it is renamed to B = DIR.previous; the parent is
//      fsynced.
//   4. T is renamed to DIR; the parent is fsynced.
//   5. B, if step 3 made it, is removed; the parent is fsynced.
// Invariant: DIR only comes into being by the rename in step 4, when T is
// complete and durable, so whenever DIR exists it is a complete checkpoint.
// B exists only from step 3 on, holding the previous complete checkpoint.
// A crash therefore leaves, durably, one of:
//   - DIR = the previous checkpoint (or nothing, for a first write), maybe a
//     partial T: a crash before the rename of step 3 reached the disk;
//   - no DIR, B = the previous checkpoint: between steps 3 and 4;
//   - DIR = the new checkpoint, maybe a (partly removed) B: after step 4.
// ResolveCheckpointDir maps each to its checkpoint (DIR if it exists, else
// B), and the readers use it, so a reader after any crash sees the previous
// or the new checkpoint, whole. This holds whether renames reach the disk
// early or only at the fsyncs; checkpoint_dir_test checks it at every
// operation of a write with FaultInjectionFileSystem.
//
// Since step 5 removes the previous DIR whole, step 0 refuses (with
// FailedPrecondition, before anything is written) an existing DIR that holds
// anything but a checkpoint of the kind being written: the files its
// manifest lists and manifest.json. No write deletes a file it did not
// write.
//
// One writer per DIR at a time; readers must not run while DIR is being
// written (step 5 removes B from under a reader that fell back to it).
//
// Thread-safety: the functions are reentrant; a reader's const methods may
// be called from several threads. FileSystems are borrowed and must outlive
// the readers.
#ifndef FLATPARAM_CHECKPOINT_CHECKPOINT_DIR_H_
#define FLATPARAM_CHECKPOINT_CHECKPOINT_DIR_H_

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "flatparam/checkpoint/checkpoint_names.h"
#include "flatparam/checkpoint/file_system.h"
#include "flatparam/checkpoint/manifest.h"
#include "flatparam/checkpoint/safetensors.h"
#include "flatparam/model_layout.h"

namespace flatparam {
namespace checkpoint {

// JSON documents (layout.json, optim.json, rank*.json) larger than this are
// rejected unread.
inline constexpr uint64_t kMaxJsonFileBytes = uint64_t{1} << 30;

// The directory holding the checkpoint at `dir` after any crash: `dir` if
// it exists, else BackupDirFor(dir) if that exists, else NotFound. Reads
// only.
absl::StatusOr<std::string> ResolveCheckpointDir(FileSystem& fs,
                                                 const std::string& dir);

// Settles an interrupted write to `dir` (run by every writer first; also
// safe for an operator to run): with `dir` present, removes a leftover
// BackupDirFor(dir); with `dir` absent, renames the backup back to `dir`.
// Then removes every `dir`.tmp-* directory. Each change is fsynced, so the
// recovery itself is crash-safe.
absl::Status RecoverCheckpointDir(FileSystem& fs, const std::string& dir);

// What a write did to what its directory held before, for a summary.
struct DirWriteOutcome {
  // The directory written, normalised.
  std::string dir;
  // The files it held that the write replaced or removed, sorted: a
  // previous checkpoint of the same kind (whole), and with `overwrite` the
  // same-named files.
  std::vector<std::string> replaced;
  // With `overwrite`: the files it held that the write left as they were,
  // sorted.
  std::vector<std::string> kept;
};

struct CheckpointWriteOptions {
  // Tensor bytes are pulled from TensorSources in chunks of at most this.
  uint64_t chunk_bytes = kDefaultChunkBytes;
  // Bytes written so far of the total of every file but manifest.json.
  ProgressCallback progress;
  // A write replaces its directory whole, so by default a directory that
  // holds anything but a checkpoint of the same kind is refused before
  // anything is written (FailedPrecondition naming the files). With
  // `overwrite`, a Hugging Face export (flatparam/interop/hf/hf_checkpoint.h)
  // writes into such a directory instead: it replaces the previous export's
  // files and the same-named ones, and keeps every other file (a model's
  // README.md, .gitattributes). Not crash-atomic as a whole: the previous
  // export's index (or single file) is removed first and the new one put in
  // last, so a crash leaves a directory that does not load, never a mix of old
  // and new shards that does. For flatparam's own checkpoints `overwrite`
  // changes nothing: their readers reject any file the manifest does not
  // list, so they cannot share a directory, and such a write is refused
  // saying so.
  bool overwrite = false;
  // When not null, set by a successful write.
  DirWriteOutcome* outcome = nullptr;
};

// What a full checkpoint holds. TensorSources are pulled during the write,
// once each, in order.
struct FullCheckpointContent {
  // model.safetensors, keyed by FQN.
  std::vector<TensorSource> model;
  // optim.safetensors; every name must start with "state."
  // (OptimStateTensorName).
  std::vector<TensorSource> optim;
  // optim.json; must be a JSON object.
  nlohmann::json optim_json = nlohmann::json::object();
};

// Writes a full checkpoint to `dir` (replacing one there, crash-safely; see
// the file comment; FailedPrecondition when `dir` holds anything else). The
// parent of `dir` must exist. InvalidArgument for
// content that does not fit the format (naming the tensor or document); the
// file system's errors otherwise. On error `dir` is unchanged (a stale
// `dir`.tmp-* may remain until the next write).
absl::Status WriteFullCheckpoint(FileSystem& fs, const std::string& dir,
                                 const FullCheckpointContent& content,
                                 const CheckpointWriteOptions& options = {});

// One rank's files of a sharded checkpoint.
struct RankContent {
  // rank{r:05d}.safetensors: "flat_params.{i}" for every flat parameter,
  // any "optim.{i}.{state}", and "buffers.{fqn}" for every buffer, as
  // described in the file comment.
  std::vector<TensorSource> tensors;
  // rank{r:05d}.json; must be a JSON object.
  nlohmann::json sidecar = nlohmann::json::object();
};

struct ShardedCheckpointContent {
  // The layout the shards follow; borrowed for the call. Its spec and
  // options go to layout.json.
  const ModelLayout* layout = nullptr;
  // W, the job's world size; 0 for the layout's own. For the hybrid
  // strategies a multiple of the layout's (shard group) world size; for
  // the others equal to it.
  int64_t world_size = 0;
  // One per shard-group rank 0 .. layout->options().world_size - 1.
  std::vector<RankContent> ranks;
};

// Writes a sharded checkpoint to `dir`, as WriteFullCheckpoint does.
// InvalidArgument, naming the rank and tensor, when the world size, the
// number of ranks or any rank's tensors do not match the layout.
absl::Status WriteShardedCheckpoint(FileSystem& fs, const std::string& dir,
                                    const ShardedCheckpointContent& content,
                                    const CheckpointWriteOptions& options = {});

struct CheckpointOpenOptions {
  // Checksum every file (reads every byte once). When false only the
  // manifest's file list and sizes are checked.
  bool verify_checksums = true;
  // Bytes checksummed so far, of the checkpoint's total.
  ProgressCallback progress;
  // Sharded checkpoints: the shard-group ranks whose tensor files Open
  // checksums whole. Open always checksums and validates the metadata
  // (manifest.json, layout.json, every rank's small JSON sidecar); the
  // other ranks' tensor files are checked for presence and size only, and
  // are verified as they are read (OpenRank). A job loading its shards
  // passes {}: each of W processes then reads its share plus the metadata,
  // once, not the whole checkpoint W times (or its share twice).
  // Unset: every rank.
  std::optional<std::vector<int64_t>> ranks;
};

// A verified full checkpoint. Movable.
class FullCheckpointReader {
 public:
  // Resolves `dir` (ResolveCheckpointDir), verifies the manifest (kind
  // "full") and opens the three files. NotFound when there is no
  // checkpoint; DataLoss, naming the file, for a damaged one.
  static absl::StatusOr<FullCheckpointReader> Open(
      FileSystem& fs, const std::string& dir,
      const CheckpointOpenOptions& options = {});

  // The directory actually read (`dir` or its backup).
  const std::string& path() const { return path_; }
  const Manifest& manifest() const { return manifest_; }
  const SafetensorsReader& model() const { return model_; }
  const SafetensorsReader& optim() const { return optim_; }
  const nlohmann::json& optim_json() const { return optim_json_; }

  // Checks the checkpoint against `spec`: every untied parameter and every
  // buffer is in model.safetensors with its dtype and shape; a tied
  // parameter, if present, matches its primary; nothing else is there;
  // every
  // optim.safetensors tensor is "state.{fqn}.{name}" for a parameter of
  // the model, shaped like it or 0-d. FailedPrecondition naming the file,
  // tensor and both values otherwise.
  absl::Status CheckFitsModel(const ModelSpec& spec) const;

 private:
  FullCheckpointReader(std::string path, Manifest manifest,
                       SafetensorsReader model, SafetensorsReader optim,
                       nlohmann::json optim_json);

  std::string path_;
  Manifest manifest_;
  SafetensorsReader model_;
  SafetensorsReader optim_;
  nlohmann::json optim_json_;
};

// A verified sharded checkpoint. Rank files are opened on demand, so a
// checkpoint of many ranks does not hold many files open. Movable.
class ShardedCheckpointReader {
 public:
  // Resolves `dir`, verifies the manifest (kind "sharded"), parses
  // layout.json, recomputes the layout from its model spec and options and
  // requires it to equal the stored one, and validates every rank file's
  // header against it (names, dtypes, shapes; "flat_params.{i}" present for
  // every i, "buffers.{fqn}" for every buffer of the spec) and every rank
  // JSON as an object. DataLoss naming the file and
  // the difference otherwise ("layout.json: flat_params[1].sharded_numel
  // is 6, but the layout recomputed from model_spec has 8").
  static absl::StatusOr<ShardedCheckpointReader> Open(
      FileSystem& fs, const std::string& dir,
      const CheckpointOpenOptions& options = {});

  const std::string& path() const { return path_; }
  const Manifest& manifest() const { return manifest_; }
  // The layout recomputed from layout.json (equal to the stored one).
  const ModelLayout& layout() const { return layout_; }
  const ModelSpec& spec() const { return layout_.spec(); }
  // W, the world size the checkpoint was saved with.
  int64_t world_size() const { return world_size_; }
  // G, the number of rank files.
  int64_t num_ranks() const { return layout_.options().world_size; }
  const nlohmann::json& layout_json() const { return layout_json_; }

  // Opens rank `rank`'s tensor file, validated against the layout.
  // InvalidArgument for a rank outside [0, num_ranks()). With
  // verify_checksums, every byte read through the returned reader is
  // verified: when Open or VerifyRank checksummed the file whole, by that;
  // otherwise against the manifest's block checksums as it is read
  // (internal/verified_file.h: a read costs its bytes plus at most two
  // partial blocks, a damaged block fails that read with DataLoss, and the
  // reader keeps up to two blocks cached), or, for a checkpoint written
  // before block checksums, by checksumming the whole file here, once.
  absl::StatusOr<SafetensorsReader> OpenRank(int64_t rank) const;
  // Reads rank `rank`'s JSON sidecar.
  absl::StatusOr<nlohmann::json> ReadRankJson(int64_t rank) const;
  // Checksums rank `rank`'s whole tensor file against the manifest (when
  // the reader was opened with verify_checksums) and validates its header,
  // as Open does for every rank it verifies. Not needed before reading a
  // rank (OpenRank verifies what is read); for tools that check a file
  // without reading it. DataLoss naming the file otherwise;
  // InvalidArgument for a rank outside [0, num_ranks()).
  absl::Status VerifyRank(int64_t rank) const;

  // Checks that a job with `layout` on `world_size` ranks can load this
  // checkpoint without resharding: same world size, strategy, shard group,
  // alignment and compute dtype, the same flat parameters (units,
  // parameters, shapes, dtypes, sizes) and the same buffers
  // (names, shapes, dtypes, order). FailedPrecondition naming the
  // first difference ("world size: checkpoint 8, job 4 (reshard the
  // checkpoint offline)"; "flat_params[2].sharded_numel: checkpoint 10,
  // job 12").
  absl::Status CheckFits(const ModelLayout& layout, int64_t world_size) const;

 private:
  ShardedCheckpointReader(FileSystem* fs, std::string path, Manifest manifest,
                          ModelLayout layout, int64_t world_size,
                          nlohmann::json layout_json);

  // The rank's tensor file, verified as OpenRank describes.
  absl::StatusOr<std::unique_ptr<RandomAccessFile>> OpenRankFile(
      int64_t rank) const;
  const ManifestEntry* FindEntry(const std::string& name) const;

  // Ranks whose tensor files were checksummed whole; shared by moved-from
  // and moved-to readers, guarded for the const (thread-safe) methods.
  struct Verified;
  std::shared_ptr<Verified> verified_;
  bool verify_checksums_ = true;
  FileSystem* fs_;
  std::string path_;
  Manifest manifest_;
  ModelLayout layout_;
  int64_t world_size_;
  nlohmann::json layout_json_;
};

}  // namespace checkpoint
}  // namespace flatparam

#endif  // FLATPARAM_CHECKPOINT_CHECKPOINT_DIR_H_
