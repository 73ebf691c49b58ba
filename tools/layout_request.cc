#include "tools/layout_request.h"

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "flatparam/base/dtype.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/checkpoint/checkpoint_dir.h"
#include "flatparam/checkpoint/file_system.h"
#include "flatparam/model_json.h"
#include "flatparam/presets.h"

namespace flatparam {
namespace tools {

int64_t DefaultShardGroupSize(int64_t world_size) {
  return world_size % kDefaultShardGroupSize == 0 ? kDefaultShardGroupSize
                                                  : world_size;
}

absl::StatusOr<int64_t> ShardGroupSize(ShardingStrategy strategy,
                                       int64_t world_size, int64_t requested) {
  if (requested < 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--shard-group-size must be >= 1 (or 0 for the default), got %d",
        requested));
  }
  if (!IsHybridStrategy(strategy)) {
    if (requested != 0) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "--shard-group-size=%d applies only to HYBRID_SHARD and "
          "HYBRID_SHARD_ZERO2; %s lays flat parameters out over all "
          "--world-size=%d ranks",
          requested, ShardingStrategyName(strategy), world_size));
    }
    return world_size;
  }
  if (requested == 0) return DefaultShardGroupSize(world_size);
  if (world_size % requested != 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--shard-group-size=%d does not divide --world-size=%d",
                        requested, world_size));
  }
  return requested;
}

absl::StatusOr<ModelSpec> LoadModel(const std::string& model) {
  checkpoint::FileSystem& fs = checkpoint::PosixFileSystem();
  absl::StatusOr<bool> is_dir = fs.IsDirectory(model);
  if (!is_dir.ok() || !*is_dir) return LoadModelSpec(model);
  checkpoint::CheckpointOpenOptions open;
  open.ranks.emplace();  // metadata only: no rank file is read
  absl::StatusOr<checkpoint::ShardedCheckpointReader> reader =
      checkpoint::ShardedCheckpointReader::Open(fs, model, open);
  if (!reader.ok()) {
    return absl::Status(
        reader.status().code(),
        absl::StrCat("--model=", model,
                     " is a directory, so it must hold a sharded checkpoint "
                     "whose model it names: ",
                     reader.status().message()));
  }
  return reader->spec();
}

absl::StatusOr<ResolvedLayout> ResolveLayout(const LayoutRequest& request) {
  if (request.model.empty()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--model is required: a preset (%s) or a model file path",
        absl::StrJoin(PresetNames(), ", ")));
  }
  if (request.world_size < 1 || request.world_size > kMaxWorldSize) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--world-size must be between 1 and %d, got %d",
                        kMaxWorldSize, request.world_size));
  }
  absl::StatusOr<ShardingStrategy> strategy =
      ParseShardingStrategy(request.strategy);
  if (!strategy.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--strategy: ", strategy.status().message()));
  }
  LayoutOptions options;
  options.strategy = *strategy;
  options.align_addresses = request.align_addresses;
  if (!request.compute_dtype.empty()) {
    absl::StatusOr<DType> dtype = ParseDType(request.compute_dtype);
    if (!dtype.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--compute-dtype: ", dtype.status().message()));
    }
    if (!IsFloatingPoint(*dtype)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "--compute-dtype must be a floating-point dtype, got %s",
          request.compute_dtype));
    }
    options.compute_dtype = *dtype;
  }
  std::optional<DType> dtype_override;
  if (!request.dtype.empty()) {
    absl::StatusOr<DType> dtype = ParseDType(request.dtype);
    if (!dtype.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--dtype: ", dtype.status().message()));
    }
    dtype_override = *dtype;
  }
  ResolvedLayout resolved;
  resolved.world_size = request.world_size;
  FLATPARAM_ASSIGN_OR_RETURN(
      resolved.shard_group_size,
      ShardGroupSize(*strategy, request.world_size, request.shard_group_size));
  options.world_size = resolved.shard_group_size;

  FLATPARAM_ASSIGN_OR_RETURN(ModelSpec spec, LoadModel(request.model));
  if (dtype_override.has_value()) {
    for (ParamSpec& p : spec.params) p.dtype = *dtype_override;
  }
  FLATPARAM_ASSIGN_OR_RETURN(resolved.layout,
                             ModelLayout::Create(spec, options));
  return resolved;
}

}  // namespace tools
}  // namespace flatparam
