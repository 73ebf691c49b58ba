#include "flatparam/layout_json.h"

#include <cassert>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "flatparam/base/dtype.h"

namespace flatparam {
namespace {

using json = nlohmann::json;

json RankToJson(const FlatParamLayout& layout, int64_t rank) {
  const ShardInterval iv = layout.shard_interval(rank);
  const std::vector<ShardParamInfo> infos = layout.shard_param_infos(rank);
  json shard_infos = json::array();
  for (size_t i = 0; i < infos.size(); ++i) {
    const ShardParamInfo& s = infos[i];
    json entry = {{"fqn", layout.params()[i].fqn}, {"in_shard", s.in_shard}};
    if (s.in_shard) {
      entry["offset_in_shard"] = s.offset_in_shard;
      entry["numel_in_shard"] = s.numel_in_shard;
      entry["intra_param_start_idx"] = s.intra_param_start_idx;
      entry["intra_param_end_idx"] = s.intra_param_end_idx;
    } else {
      // PyTorch's _ShardParamInfo holds None for these.
      entry["offset_in_shard"] = nullptr;
      entry["numel_in_shard"] = nullptr;
      entry["intra_param_start_idx"] = nullptr;
      entry["intra_param_end_idx"] = nullptr;
    }
    shard_infos.push_back(std::move(entry));
  }
  return {{"rank", rank},
          {"numel_padded", iv.numel_padded},
          {"unsharded_start", iv.start},
          {"unsharded_end_inclusive", iv.end_inclusive},
          {"shard_param_infos", std::move(shard_infos)}};
}

}  // namespace

json FlatParamLayoutToJson(const FlatParamLayout& layout) {
  json params = json::array();
  for (const ParamInfo& p : layout.params()) {
    params.push_back({{"fqn", p.fqn},
                      {"shape", p.shape},
                      {"numel", p.numel},
                      {"start", p.offset},
                      {"end_inclusive", p.offset + p.numel - 1}});
  }
  json shared = json::array();
  for (const SharedParamInfo& s : layout.shared_params()) {
    shared.push_back({{"fqn", s.fqn}, {"prim_fqn", s.prim_fqn}});
  }
  json ranks = json::array();
  for (int64_t r = 0; r < layout.world_size(); ++r) {
    ranks.push_back(RankToJson(layout, r));
  }
  return {
      {"unit", layout.unit()},
      {"dtype", std::string(DTypeName(layout.dtype()))},
      {"aligned_numel", layout.aligned_numel()},
      {"requires_grad", layout.requires_grad()},
      {"param_numel", layout.param_numel()},
      {"unpadded_unsharded_numel", layout.unpadded_unsharded_numel()},
      {"padded_unsharded_numel", layout.padded_unsharded_numel()},
      {"sharded_numel", layout.sharded_numel()},
      {"numels_with_padding", layout.numels_with_padding()},
      {"is_padding_mask", layout.is_padding_mask()},
      {"params", std::move(params)},
      {"shared_params", std::move(shared)},
      {"ranks", std::move(ranks)},
  };
}

json ModelLayoutToJson(const ModelLayout& layout,
                       const LayoutJsonOptions& options) {
  const LayoutOptions& lo = layout.options();
  const int64_t world_size =
      options.world_size > 0 ? options.world_size : lo.world_size;
  assert(world_size % lo.world_size == 0);
  json flat_params = json::array();
  for (const FlatParamLayout& f : layout.flat_params()) {
    flat_params.push_back(FlatParamLayoutToJson(f));
  }
  return {
      {"version", kLayoutJsonVersion},
      {"model", layout.spec().name},
      {"world_size", world_size},
      {"shard_group_size", lo.world_size},
      {"strategy", std::string(ShardingStrategyName(lo.strategy))},
      {"align_addresses", lo.align_addresses},
      {"compute_dtype", lo.compute_dtype.has_value()
                            ? json(std::string(DTypeName(*lo.compute_dtype)))
                            : json(nullptr)},
      {"flat_params", std::move(flat_params)},
  };
}

}  // namespace flatparam
