// Offline checkpoint conversion, in one process without communication:
// the tools behind `fsdp checkpoint`.
//
// clang-format off
//   ConsolidateCheckpoint   sharded -> full
//   ShardCheckpoint         full    -> sharded (for a layout and world size)
//   ReshardCheckpoint       sharded -> sharded (another layout/world size)
//   VerifyCheckpoint        checks either kind and describes it
//   InitCheckpoint          writes a full checkpoint of pseudo-random weights
//   LoadRankState           the reshard at load time: one rank of a job,
//                           read from a checkpoint of any layout, in memory
// clang-format on
//
//   // 8 ranks of FULL_SHARD to 2 x 2 of HYBRID_SHARD, and back to full:
//   LayoutOptions hybrid = layout.options();
//   hybrid.strategy = ShardingStrategy::kHybridShard;
//   hybrid.world_size = 2;  // the shard group
//   FLATPARAM_RETURN_IF_ERROR(ReshardCheckpoint(
//       PosixFileSystem(), "/ckpt/step100", hybrid, /*world_size=*/4,
//       "/ckpt/step100-hybrid"));
//   FLATPARAM_RETURN_IF_ERROR(ConsolidateCheckpoint(
//       PosixFileSystem(), "/ckpt/step100-hybrid", "/ckpt/step100-full"));
//
// Each conversion is the in-memory operation of the flat-parameter path
// (flatparam/optim/fsdp_optim.h) on files, bit for bit, with PyTorch's
// flattening rules and errors; see DESIGN.md's "Offline conversion" for
// the identities, what happens to optimizer state, "extra" and buffers.
// Nothing reads a whole tensor: memory is one chunk buffer plus metadata,
// independent of the model's size (DESIGN.md, "Streaming and memory").
// Every output is written crash-safely by checkpoint_dir.h (temporary
// directory, manifest last, rename); an error leaves the output directory
// as it was. Outputs are never written over the input directory
// (InvalidArgument).
//
// Thread-safety: the functions are reentrant; the FileSystem is borrowed.
#ifndef FLATPARAM_CHECKPOINT_CONVERT_H_
#define FLATPARAM_CHECKPOINT_CONVERT_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "flatparam/checkpoint/checkpoint_dir.h"
#include "flatparam/checkpoint/file_system.h"
#include "flatparam/checkpoint/manifest.h"
#include "flatparam/checkpoint/safetensors.h"
#include "flatparam/checkpoint/training_state.h"
#include "flatparam/layout.h"
#include "flatparam/model_layout.h"

namespace flatparam {
namespace checkpoint {

struct ConvertOptions {
  // Streaming granularity: the chunk buffer's size, rounded down to a
  // multiple of 8 (at least 8) so that chunks hold whole elements.
  uint64_t chunk_bytes = kDefaultChunkBytes;
  ProgressCallback progress;     // (done, total) bytes written
  bool verify_checksums = true;  // when opening the input
  // The output directory's handling and report: CheckpointWriteOptions'
  // `overwrite` and `outcome`.
  bool overwrite = false;
  DirWriteOutcome* outcome = nullptr;
};

// Sharded dir -> full dir.
absl::Status ConsolidateCheckpoint(FileSystem& fs, const std::string& in_dir,
                                   const std::string& out_dir,
                                   const ConvertOptions& options = {});

// Full dir -> sharded dir for `layout_options` (world_size there = the shard
// group's size) and the job's `world_size` (0: layout_options.world_size).
// The full checkpoint must fit `spec` (FullCheckpointReader::CheckFitsModel,
// FailedPrecondition otherwise).
absl::Status ShardCheckpoint(FileSystem& fs, const std::string& in_dir,
                             const ModelSpec& spec,
                             const LayoutOptions& layout_options,
                             int64_t world_size, const std::string& out_dir,
                             const ConvertOptions& options = {});

// Sharded dir -> sharded dir with other layout options / world size
// (strategy and shard group may change: FULL_SHARD on 8 -> HYBRID_SHARD 2x2)
// for the same model. Directly: a new shard's elements are read from the
// old ranks' files; no full checkpoint is materialised.
absl::Status ReshardCheckpoint(FileSystem& fs, const std::string& in_dir,
                               const LayoutOptions& layout_options,
                               int64_t world_size, const std::string& out_dir,
                               const ConvertOptions& options = {});

// How LoadRankState read a rank.
enum class LoadPath {
  kOwnRank,    // the job fits the checkpoint: the rank's own files
  kResharded,  // resharded at load time from the old ranks' byte ranges
};

// Resharding at load time. Rank `rank` (a shard-group rank of `layout`) of
// a job of `world_size` ranks (0: the layout's own), read from the sharded
// checkpoint of `reader` -- saved at any world size, strategy, shard group
// or alignment, for the same model -- with no intermediate files. Bit for
// bit,
//   LoadRankState(reader, layout, W', r) ==
//       ReadRankState(open(ReshardCheckpoint(reader's dir, layout.options(),
//                                            W')), r)
// model and optimizer state, "extra" (rank 0's) included. When the job
// fits the checkpoint (reader.CheckFits) this is ReadRankState(reader, r).
// Otherwise the new shard's elements are read as byte ranges of the old
// ranks' tensor files -- the ranges ReshardCheckpoint would read for rank
// r and no others -- plus, for the optimizer state's cross-rank checks,
// every old rank's header and 0-d tensors; every byte read is verified
// (ShardedCheckpointReader::OpenRank), so open `reader` with
// CheckpointOpenOptions::ranks = {} to read no more than that. Memory: the
// returned state, plus every old rank's optimizer metadata.
// Errors: InvalidArgument for a rank or world size that does not fit
// `layout`; FailedPrecondition, naming the first difference, when `layout`
// is not the checkpoint's model under other options; the cross-rank
// checks' and the readers' errors (DataLoss for damaged files).
// `path`, if set, says which way was taken.
absl::StatusOr<RankState> LoadRankState(const ShardedCheckpointReader& reader,
                                        const ModelLayout& layout,
                                        int64_t world_size, int64_t rank,
                                        LoadPath* path = nullptr);

// What VerifyCheckpoint found.
struct CheckpointReport {
  std::string path;  // the directory read (the input or its backup)
  CheckpointKind kind = CheckpointKind::kFull;
  int64_t files = 0;    // listed in the manifest (manifest.json excluded)
  uint64_t bytes = 0;   // their total size
  int64_t tensors = 0;  // across the safetensors files
  // Sharded checkpoints only.
  std::string model;  // the model spec's name
  int64_t world_size = 0;
  int64_t shard_group_size = 0;
  ShardingStrategy strategy = ShardingStrategy::kFullShard;
  bool align_addresses = false;
  int64_t flat_params = 0;
};

// Opens the checkpoint at `dir` (either kind) with checksums, opens every
// rank file of a sharded one (validated against its layout), and parses
// every optimizer sidecar (training_state.h's schema, checked against the
// tensors it lists). The errors of the readers (DataLoss naming the file for a
// damaged checkpoint, NotFound when there is none). `progress` reports the
// checksummed bytes.
absl::StatusOr<CheckpointReport> VerifyCheckpoint(
    FileSystem& fs, const std::string& dir,
    const ProgressCallback& progress = {});

// The optimizer whose state InitCheckpoint writes.
enum class InitOptimizer {
  kNone,   // no optimizer state
  kSgd,    // "momentum_buffer" per parameter
  kAdamW,  // "step" (0-d float32), "exp_avg", "exp_avg_sq" per parameter
};

struct InitOptions {
  uint64_t seed = 0;
  InitOptimizer optimizer = InitOptimizer::kAdamW;
  ConvertOptions convert;
};

// Writes a full checkpoint of `spec` to `out_dir`: every untied parameter
// with deterministic pseudo-random values (a function of the seed, the
// parameter's FQN and the element index, uniform in [-0.5, 0.5) rounded to
// the dtype), its optimizer state likewise (exp_avg_sq non-negative, step
// 1000 + seed % 1000), and one parameter group of every parameter with
// AdamW's or SGD's default hyperparameters. Streams like the conversions:
// memory is bounded by one chunk, not the model.
absl::Status InitCheckpoint(FileSystem& fs, const ModelSpec& spec,
                            const std::string& out_dir,
                            const InitOptions& options = {});

}  // namespace checkpoint
}  // namespace flatparam

#endif  // FLATPARAM_CHECKPOINT_CONVERT_H_
