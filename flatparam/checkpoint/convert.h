// Offline checkpoint conversion: between full (consolidated) and sharded
// checkpoint directories (checkpoint_dir.h), and between sharded ones of
// different world sizes, strategies and alignment, in one process without
// communication -- the tools behind `fsdp checkpoint`.
//
//   ConsolidateCheckpoint   sharded -> full
//   ShardCheckpoint         full    -> sharded (for a layout and world size)
//   ReshardCheckpoint       sharded -> sharded (another layout/world size)
//   VerifyCheckpoint        checks either kind and describes it
//   InitCheckpoint          writes a full checkpoint of pseudo-random weights
//   LoadRankState           the reshard at load time: one rank of a job,
//                           read from a checkpoint of any layout, in memory
//
// Semantics are those of the in-memory operations on the flat-parameter
// path (flatparam/optim/fsdp_optim.h), so that, bit for bit,
//   ReadRankState(ShardCheckpoint(full), r) ==
//       {FlattenShard(params, r), ShardFullOptimState(full.optim, r)}
//   ReadFullState(ConsolidateCheckpoint(sharded)) ==
//       {Unflatten(params), ConsolidateOptimState(rank states)}
// and full -> shard -> (reshard ->) consolidate returns the full state,
// with the flat path's normalisation (every parameter of a flat parameter
// with state gets every state name; zeros where it had none). Shard
// applies PyTorch's flattening rules and InvalidArgument messages
// (differing state names, types or dtypes, integer tensor state, a state
// shaped unlike its parameter, a 0-d parameter without a state to
// flatten, differing scalar values). Consolidate and reshard check what
// the ranks hold against rank 0: FailedPrecondition when a rank lacks
// states rank 0 has, InvalidArgument when ranks differ in state names,
// kinds, dtypes or replicated (0-d and non-tensor) values. States of keys
// that are not model parameters (unmanaged parameters, user-defined keys)
// pass through; a sharded checkpoint can hold only their non-tensor
// values (InvalidArgument otherwise). Param-group keys that are not model
// parameters are kept as unmanaged keys: a sharded group lists its flat
// parameters (sorted), then those keys in the order they first appear in
// the groups (the optimizer's), as ShardFullOptimState lists
// unmanaged_params; a full checkpoint's groups must list names (DataLoss
// for an ID). The rules are the in-memory operations' own code
// (flatparam/optim/internal/flat_plan.h). Rank sidecars' "extra" is taken
// from rank 0 by reshard and dropped by consolidate. Buffers (model_layout.h's
// BufferSpec) are not sharded: consolidate takes shard-group rank 0's into
// model.safetensors, shard gives every rank model.safetensors' values,
// reshard (and LoadRankState when it reshards) gives every new rank the
// old rank 0's, and init writes zeros.
//
// Streaming and memory. Nothing reads a whole tensor, let alone the whole
// model: every output tensor is a TensorSource whose fill reads the byte
// ranges it needs straight from the input files into the writer's chunk
// buffer (a parameter's elements are ranges of the rank files' flat
// shards; a shard's elements are ranges of parameters in
// model.safetensors / optim.safetensors, or of the old layout's shards
// when resharding; padding is generated: 42 for alignment and world-size
// padding, 0 for the right padding, as flatten.h writes it). So the extra
// memory is bounded by
//   one chunk buffer of min(chunk_bytes, largest output tensor) bytes
//   + the optimizer metadata of every input rank (parsed sidecars, tensor
//     names, dtypes and 0-d values: no tensor data)
//   + the open input files' safetensors headers (all old rank files are
//     kept open while converting from a sharded checkpoint),
// independent of the model's size. Measured (convert_memory_test): init,
// shard, reshard and consolidate of a 96 MiB checkpoint with 1 MiB chunks
// raise the peak resident set by about 3 MiB; `fsdp checkpoint` on gpt2
// (500 MB per checkpoint, 4 MiB chunks) peaks at about 17 MiB RSS for the
// whole process.
// chunk_bytes is rounded down to a multiple of 8 (at least 8) so that
// chunks hold whole elements.
//
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
  uint64_t chunk_bytes = kDefaultChunkBytes;  // streaming granularity
  ProgressCallback progress;                  // (done, total) bytes written
  bool verify_checksums = true;               // when opening the input
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
