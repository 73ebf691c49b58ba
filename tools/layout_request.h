// What every layout-based `fsdp` subcommand (inspect, plan, checkpoint, ...)
// is asked for: a model and how to shard it, as the user typed it. Resolving
// a request validates it, loads the model and lays it out.
//
// World size and shard group: a job has W ranks. FULL_SHARD, SHARD_GRAD_OP
// and NO_SHARD lay every flat parameter out over all W ranks. The hybrid
// strategies shard within a group of G ranks (e.g. the GPUs of one node) and
// replicate across the W / G groups, so their layout is over G ranks; G
// defaults to 8 when W is divisible by 8, else W.
//
// Thread-safety: pure functions, except that a model path is read from disk.
#ifndef TOOLS_LAYOUT_REQUEST_H_
#define TOOLS_LAYOUT_REQUEST_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "flatparam/layout.h"
#include "flatparam/model_layout.h"

namespace flatparam {
namespace tools {

// The largest --world-size accepted; far beyond any real job, it keeps
// per-rank output and arithmetic bounded.
inline constexpr int64_t kMaxWorldSize = int64_t{1} << 20;

// The user's request, with the flags' spelling and defaults.
struct LayoutRequest {
  // A preset name (flatparam::PresetNames()), a model file path, or a
  // sharded checkpoint directory (LoadModel). Required.
  std::string model;
  // W: ranks in the job.
  int64_t world_size = 8;
  // A ShardingStrategy name, case-insensitive.
  std::string strategy = "FULL_SHARD";
  bool align_addresses = false;
  // Mixed precision's param_dtype; "" for the parameters' own dtype.
  std::string compute_dtype;
  // Overrides every (untied) parameter's dtype; "" keeps the model's.
  std::string dtype;
  // G for the hybrid strategies; 0 for the default.
  int64_t shard_group_size = 0;
};

// A validated request and its layout.
struct ResolvedLayout {
  ModelLayout layout;
  // W.
  int64_t world_size = 1;
  // G: the ranks each flat parameter is sharded over (the layout's world
  // size); W for the non-hybrid strategies.
  int64_t shard_group_size = 1;
};

// The hybrid strategies' default shard group, the same in every
// subcommand: a node of 8 GPUs (kDefaultShardGroupSize) when 8 divides the
// world size, else the whole world (one group: PyTorch's HYBRID_SHARD
// shards within a node, and a job smaller than a node is one node).
inline constexpr int64_t kDefaultShardGroupSize = 8;
int64_t DefaultShardGroupSize(int64_t world_size);

// The shard group size for `strategy` on `world_size` ranks given the
// user's `requested` value (0: DefaultShardGroupSize). InvalidArgument, naming
// the values, when `requested` is negative, does not divide `world_size`, or is
// set for a non-hybrid strategy.
absl::StatusOr<int64_t> ShardGroupSize(ShardingStrategy strategy,
                                       int64_t world_size, int64_t requested);

// The model `model` names: a preset or a model file (LoadModelSpec), or,
// for a directory, the model a sharded checkpoint there was saved with (its
// layout.json's "model_spec", verified as ShardedCheckpointReader::Open
// verifies the metadata; no tensor file is read), so that a job's own
// checkpoint, or the file FsdpModule::ModelFile() writes, describes it.
// NotFound or InvalidArgument as LoadModelSpec gives them; the reader's
// errors for a directory that holds no valid sharded checkpoint.
absl::StatusOr<ModelSpec> LoadModel(const std::string& model);

// Validates `request`, loads its model (LoadModel), applies the dtype
// override and lays the model out. Errors name the offending flag and value;
// model and layout errors pass through with their own messages.
absl::StatusOr<ResolvedLayout> ResolveLayout(const LayoutRequest& request);

}  // namespace tools
}  // namespace flatparam

#endif  // TOOLS_LAYOUT_REQUEST_H_
