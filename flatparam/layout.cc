#include "flatparam/layout.h"

#include <algorithm>
#include <cassert>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_format.h"
#include "flatparam/base/shape.h"
#include "flatparam/base/status_macros.h"

namespace flatparam {
namespace {

void SplitFqn(const std::string& fqn, std::string* module_name,
              std::string* param_name) {
  const size_t dot = fqn.rfind('.');
  if (dot == std::string::npos) {
    module_name->clear();
    *param_name = fqn;
  } else {
    *module_name = fqn.substr(0, dot);
    *param_name = fqn.substr(dot + 1);
  }
}

// PyTorch's padding rule: pad `multiple - total % multiple` when that is
// strictly between 0 and `multiple`.
int64_t PaddingFor(int64_t total, int64_t multiple) {
  const int64_t pad = multiple - (total % multiple);
  return (pad > 0 && pad < multiple) ? pad : 0;
}

}  // namespace

absl::string_view ShardingStrategyName(ShardingStrategy strategy) {
  switch (strategy) {
    case ShardingStrategy::kFullShard:
      return "FULL_SHARD";
    case ShardingStrategy::kShardGradOp:
      return "SHARD_GRAD_OP";
    case ShardingStrategy::kNoShard:
      return "NO_SHARD";
    case ShardingStrategy::kHybridShard:
      return "HYBRID_SHARD";
    case ShardingStrategy::kHybridShardZero2:
      return "HYBRID_SHARD_ZERO2";
  }
  return "UNKNOWN";
}

absl::StatusOr<ShardingStrategy> ParseShardingStrategy(absl::string_view name) {
  const std::string upper = absl::AsciiStrToUpper(name);
  for (ShardingStrategy s :
       {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp,
        ShardingStrategy::kNoShard, ShardingStrategy::kHybridShard,
        ShardingStrategy::kHybridShardZero2}) {
    if (upper == ShardingStrategyName(s)) return s;
  }
  return absl::InvalidArgumentError(absl::StrFormat(
      "unknown sharding strategy \"%s\"; expected FULL_SHARD, SHARD_GRAD_OP, "
      "NO_SHARD, HYBRID_SHARD or HYBRID_SHARD_ZERO2",
      name));
}

bool UsesShardedStrategy(ShardingStrategy strategy) {
  return strategy != ShardingStrategy::kNoShard;
}

bool IsHybridStrategy(ShardingStrategy strategy) {
  return strategy == ShardingStrategy::kHybridShard ||
         strategy == ShardingStrategy::kHybridShardZero2;
}

int64_t NumElements(absl::Span<const int64_t> shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

int64_t AlignedNumel(DType dtype) {
  return kAlignmentBytes / static_cast<int64_t>(DTypeSize(dtype));
}

UnpaddedShard GetUnpaddedShard(int64_t numel, int64_t rank,
                               int64_t world_size) {
  assert(numel >= 0 && world_size >= 1 && rank >= 0 && rank < world_size);
  if (numel == 0) return {0, 0, 0};
  const int64_t chunk = (numel + world_size - 1) / world_size;
  const int64_t num_chunks = (numel + chunk - 1) / chunk;
  UnpaddedShard s;
  if (rank < num_chunks) {
    s.begin = rank * chunk;
    s.end = std::min(numel, (rank + 1) * chunk);
  } else {
    s.begin = s.end = numel;
  }
  s.numel_to_pad = chunk - (s.end - s.begin);
  return s;
}

absl::StatusOr<FlatParamLayout> FlatParamLayout::Create(
    std::string unit, absl::Span<const ParamSpec> params,
    const LayoutOptions& options) {
  const std::string unit_label = unit.empty() ? "<root>" : unit;
  if (params.empty()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "unit %s: expects a non-empty parameter list", unit_label));
  }
  if (options.world_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("unit %s: world_size must be >= 1, got %d", unit_label,
                        options.world_size));
  }
  if (options.compute_dtype.has_value() &&
      !IsFloatingPoint(*options.compute_dtype)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("unit %s: compute dtype must be floating point, got %s",
                        unit_label, DTypeName(*options.compute_dtype)));
  }

  FlatParamLayout layout;
  layout.unit_ = std::move(unit);
  layout.options_ = options;

  // Pass 1: validate names, ties, shapes and dtypes (PyTorch's
  // `_validate_tensors_to_flatten`), resolving each tie to its primary.
  absl::flat_hash_map<std::string, int> index_of;  // fqn -> spec index
  std::vector<int> primary_of(params.size(), -1);
  std::optional<DType> dtype;
  std::string dtype_fqn;
  for (size_t i = 0; i < params.size(); ++i) {
    const ParamSpec& p = params[i];
    if (p.fqn.empty()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "unit %s: parameter %d has an empty fqn", unit_label, i));
    }
    if (!index_of.emplace(p.fqn, static_cast<int>(i)).second) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "unit %s: duplicate parameter name \"%s\"", unit_label, p.fqn));
    }
    if (!p.tied_to.empty()) {
      auto it = index_of.find(p.tied_to);
      if (it == index_of.end() || it->second == static_cast<int>(i)) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "unit %s: parameter \"%s\" is tied to \"%s\", which is not an "
            "earlier parameter of this unit",
            unit_label, p.fqn, p.tied_to));
      }
      int prim = it->second;
      while (primary_of[prim] != prim) prim = primary_of[prim];
      primary_of[i] = prim;
      continue;
    }
    primary_of[i] = static_cast<int>(i);
    for (int64_t d : p.shape) {
      if (d < 0) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "unit %s: parameter \"%s\" has a negative dimension in shape %s",
            unit_label, p.fqn, ShapeString(p.shape)));
      }
    }
    if (!IsFloatingPoint(p.dtype)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "unit %s: cannot flatten integer dtype tensors: parameter \"%s\" "
          "has dtype %s",
          unit_label, p.fqn, DTypeName(p.dtype)));
    }
    if (dtype.has_value() && *dtype != p.dtype) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "unit %s: must flatten tensors with uniform dtype but got %s "
          "(\"%s\") "
          "and %s (\"%s\")",
          unit_label, DTypeName(*dtype), dtype_fqn, DTypeName(p.dtype), p.fqn));
    }
    if (!dtype.has_value()) {
      dtype = p.dtype;
      dtype_fqn = p.fqn;
    }
    // PyTorch permits mixed `requires_grad` only with use_orig_params, whose
    // layouts are the aligned ones here.
    if (!options.align_addresses &&
        p.requires_grad != params[0].requires_grad) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "unit %s: must flatten tensors with uniform `requires_grad` when "
          "`use_orig_params=False` (align_addresses off): \"%s\" has "
          "requires_grad=%s but \"%s\" has requires_grad=%s",
          unit_label, params[0].fqn, params[0].requires_grad ? "true" : "false",
          p.fqn, p.requires_grad ? "true" : "false"));
    }
  }
  layout.dtype_ = *dtype;  // Non-empty list, and ties need a primary.
  layout.aligned_numel_ =
      options.align_addresses
          ? AlignedNumel(options.compute_dtype.value_or(layout.dtype_))
          : 0;

  // Pass 2: the layout proper.
  std::vector<int> param_index_of(params.size(), -1);
  int64_t total = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    const ParamSpec& p = params[i];
    if (primary_of[i] != static_cast<int>(i)) {
      const ParamSpec& prim = params[primary_of[i]];
      SharedParamInfo s;
      s.fqn = p.fqn;
      SplitFqn(p.fqn, &s.module_name, &s.param_name);
      s.prim_fqn = prim.fqn;
      SplitFqn(prim.fqn, &s.prim_module_name, &s.prim_param_name);
      s.prim_index = param_index_of[primary_of[i]];
      layout.shared_params_.push_back(std::move(s));
      continue;
    }
    if (layout.aligned_numel_ > 0) {
      const int64_t pad = PaddingFor(total, layout.aligned_numel_);
      if (pad > 0) {
        layout.numels_with_padding_.push_back(pad);
        layout.is_padding_mask_.push_back(true);
        total += pad;
      }
    }
    ParamInfo info;
    info.fqn = p.fqn;
    SplitFqn(p.fqn, &info.module_name, &info.param_name);
    info.shape = p.shape;
    info.numel = NumElements(p.shape);
    info.requires_grad = p.requires_grad;
    info.offset = total;
    layout.requires_grad_ = layout.requires_grad_ || p.requires_grad;
    layout.numels_with_padding_.push_back(info.numel);
    layout.is_padding_mask_.push_back(false);
    total += info.numel;
    param_index_of[i] = static_cast<int>(layout.params_.size());
    layout.params_.push_back(std::move(info));
  }
  if (layout.aligned_numel_ > 0) {
    const int64_t pad = PaddingFor(total, options.world_size);
    if (pad > 0) {
      layout.numels_with_padding_.push_back(pad);
      layout.is_padding_mask_.push_back(true);
      total += pad;
    }
  }
  layout.unpadded_numel_ = total;
  if (total == 0) {
    // PyTorch's `_init_shard_metadata` asserts start <= end, which an empty
    // flat parameter cannot satisfy under any strategy.
    return absl::InvalidArgumentError(absl::StrFormat(
        "unit %s: the flat parameter has no elements (every parameter has a "
        "zero-size dimension); PyTorch FSDP cannot shard it",
        unit_label));
  }
  if (UsesShardedStrategy(options.strategy)) {
    const UnpaddedShard s0 = GetUnpaddedShard(total, 0, options.world_size);
    layout.sharded_numel_ = (s0.end - s0.begin) + s0.numel_to_pad;
  } else {
    layout.sharded_numel_ = total;
  }
  return layout;
}

int64_t FlatParamLayout::padded_unsharded_numel() const {
  return UsesShardedStrategy(options_.strategy)
             ? sharded_numel_ * options_.world_size
             : unpadded_numel_;
}

int64_t FlatParamLayout::param_numel() const {
  int64_t n = 0;
  for (const ParamInfo& p : params_) n += p.numel;
  return n;
}

std::vector<std::pair<int64_t, int64_t>> FlatParamLayout::flat_param_offsets()
    const {
  std::vector<std::pair<int64_t, int64_t>> offsets;
  offsets.reserve(numels_with_padding_.size());
  int64_t start = 0;
  for (int64_t n : numels_with_padding_) {
    offsets.emplace_back(start, start + n - 1);
    start += n;
  }
  return offsets;
}

absl::Status FlatParamLayout::CheckRank(int64_t rank) const {
  if (rank < 0 || rank >= options_.world_size) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "unit %s: rank %d is out of range for world size %d",
        unit_.empty() ? "<root>" : unit_, rank, options_.world_size));
  }
  return absl::OkStatus();
}

ShardInterval FlatParamLayout::shard_interval(int64_t rank) const {
  assert(rank >= 0 && rank < options_.world_size);
  if (!UsesShardedStrategy(options_.strategy)) {
    return {0, unpadded_numel_ - 1, 0};
  }
  const UnpaddedShard s =
      GetUnpaddedShard(unpadded_numel_, rank, options_.world_size);
  return {sharded_numel_ * rank, sharded_numel_ * (rank + 1) - 1,
          s.numel_to_pad};
}

absl::StatusOr<ShardInterval> FlatParamLayout::ShardIntervalFor(
    int64_t rank) const {
  FLATPARAM_RETURN_IF_ERROR(CheckRank(rank));
  return shard_interval(rank);
}

ShardParamInfo FlatParamLayout::shard_param_info(int64_t rank,
                                                 int index) const {
  const ShardInterval iv = shard_interval(rank);
  const ParamInfo& p = params_[index];
  // Inclusive bounds; a zero-numel parameter has end = start - 1.
  const int64_t p_start = p.offset;
  const int64_t p_end = p.offset + p.numel - 1;
  ShardParamInfo info;
  info.in_shard = iv.start <= p_end && iv.end_inclusive >= p_start;
  if (!info.in_shard) return info;
  if (iv.start <= p_start) {
    info.intra_param_start_idx = 0;
    info.offset_in_shard = p_start - iv.start;
  } else {
    info.intra_param_start_idx = iv.start - p_start;
    info.offset_in_shard = 0;
  }
  assert(info.offset_in_shard >= 0 &&
         info.offset_in_shard < iv.end_inclusive - iv.start + 1);
  info.intra_param_end_idx = std::min(p_end, iv.end_inclusive) - p_start;
  info.numel_in_shard =
      info.intra_param_end_idx - info.intra_param_start_idx + 1;
  return info;
}

std::vector<ShardParamInfo> FlatParamLayout::shard_param_infos(
    int64_t rank) const {
  std::vector<ShardParamInfo> infos;
  infos.reserve(params_.size());
  for (int i = 0; i < static_cast<int>(params_.size()); ++i) {
    infos.push_back(shard_param_info(rank, i));
  }
  return infos;
}

FlatParamShardMetadata FlatParamLayout::shard_metadata(int64_t rank) const {
  FlatParamShardMetadata md;
  const std::vector<ShardParamInfo> infos = shard_param_infos(rank);
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!infos[i].in_shard) continue;
    md.param_names.push_back(params_[i].fqn);
    md.param_shapes.push_back(params_[i].shape);
    md.param_numels.push_back(params_[i].numel);
    md.param_offsets.emplace_back(infos[i].intra_param_start_idx,
                                  infos[i].intra_param_end_idx);
  }
  return md;
}

}  // namespace flatparam
