// The flat-parameter layout: how one FSDP unit's parameters are laid out in a
// single contiguous flat parameter, and how that flat parameter is sharded.
//
// This is PyTorch FSDP's `FlatParamHandle._init_flat_param_and_metadata`,
// `_get_shard`, `_get_shard_metadata` and `shard_metadata`, bit for bit:
//
//   * Parameters are flattened in the order given. A parameter that is tied to
//     an earlier one (`ParamSpec::tied_to`) is a shared parameter: it is
//     recorded in `shared_params` and not flattened again.
//   * With `align_addresses` (PyTorch's `use_orig_params=True`), each
//     parameter starts at a multiple of `aligned_numel = 16 / sizeof(compute
//     dtype)` elements, and the total is padded to a multiple of the world
//     size. Padding segments appear in `numels_with_padding` and
//     `is_padding_mask`, never in the per-parameter tables.
//   * Sharding follows `torch.chunk`: `chunk = ceil(N / W)`; rank r holds
//     `[r*chunk, min(N, (r+1)*chunk))`, right-padded with zeros to `chunk`.
//   * Padding written by flattening holds 42; sharding's right padding is 0.
//
// Example:
//
//   std::vector<ParamSpec> params = {
//       {"fc.weight", {3, 5}, DType::kFloat32},
//       {"fc.bias", {3}, DType::kFloat32},
//   };
//   FLATPARAM_ASSIGN_OR_RETURN(
//       FlatParamLayout layout,
//       FlatParamLayout::Create("", params, {.world_size = 4}));
//   ShardInterval iv = layout.shard_interval(/*rank=*/2);  // [10, 14]
//
// A FlatParamLayout is an immutable value: it owns its metadata, holds no
// tensor data, and is safe to share between threads.
#ifndef FLATPARAM_LAYOUT_H_
#define FLATPARAM_LAYOUT_H_

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "flatparam/base/dtype.h"

namespace flatparam {

// The value PyTorch writes into alignment and world-size padding.
inline constexpr int kFlatParamPaddingValue = 42;

// The byte alignment PyTorch's `use_orig_params=True` path guarantees for
// each original parameter inside the flat parameter.
inline constexpr int kAlignmentBytes = 16;

// PyTorch's `ShardingStrategy`.
enum class ShardingStrategy {
  kFullShard,
  kShardGradOp,
  kNoShard,
  kHybridShard,
  kHybridShardZero2,
};

// "FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD",
// "HYBRID_SHARD_ZERO2".
absl::string_view ShardingStrategyName(ShardingStrategy strategy);

// Parses the names above (case-insensitive). InvalidArgument otherwise.
absl::StatusOr<ShardingStrategy> ParseShardingStrategy(absl::string_view name);

// True for every strategy except NO_SHARD.
bool UsesShardedStrategy(ShardingStrategy strategy);

// True for HYBRID_SHARD and HYBRID_SHARD_ZERO2.
bool IsHybridStrategy(ShardingStrategy strategy);

// One original parameter as the caller describes it.
struct ParamSpec {
  // Fully-qualified name, e.g. "layers.0.attn.wq.weight".
  std::string fqn;
  // Shape; empty for a 0-d scalar; zero-size dimensions are allowed.
  std::vector<int64_t> shape;
  DType dtype = DType::kFloat32;
  bool requires_grad = true;
  // Non-empty: this parameter is the same tensor as the earlier parameter
  // with this fqn (a tied/shared parameter); shape and dtype are ignored.
  std::string tied_to;
};

// Number of elements of `shape` (1 for a 0-d scalar).
int64_t NumElements(absl::Span<const int64_t> shape);

// How a unit is flattened and sharded.
struct LayoutOptions {
  // Number of ranks the flat parameter is sharded over (for the hybrid
  // strategies, the shard group's size). Must be >= 1.
  int64_t world_size = 1;
  ShardingStrategy strategy = ShardingStrategy::kFullShard;
  // PyTorch's `use_orig_params=True`: alignment and world-size padding.
  bool align_addresses = false;
  // The unsharded (forward/backward) parameter dtype that alignment is
  // computed for: mixed precision's `param_dtype`, or unset for the
  // parameters' own dtype.
  std::optional<DType> compute_dtype;
};

// An original parameter inside the flat parameter (PyTorch's ParamInfo plus
// its shape, numel and offset).
struct ParamInfo {
  std::string fqn;
  // `fqn` split at its last dot: "layers.0.attn" and "weight".
  std::string module_name;
  std::string param_name;
  std::vector<int64_t> shape;
  int64_t numel = 0;
  bool requires_grad = true;
  // First element in the unsharded flat parameter.
  int64_t offset = 0;
};

// A parameter that shares another's storage (PyTorch's SharedParamInfo).
struct SharedParamInfo {
  std::string fqn;
  std::string module_name;
  std::string param_name;
  std::string prim_fqn;
  std::string prim_module_name;
  std::string prim_param_name;
  // Index of the primary in FlatParamLayout::params().
  int prim_index = 0;
};

// What one rank's shard holds of one parameter (PyTorch's _ShardParamInfo).
// When `in_shard` is false the other fields are 0 and meaningless (PyTorch
// stores None).
struct ShardParamInfo {
  bool in_shard = false;
  int64_t offset_in_shard = 0;
  int64_t numel_in_shard = 0;
  int64_t intra_param_start_idx = 0;
  // Inclusive; -1 relative to the start for an in-shard zero-numel parameter.
  int64_t intra_param_end_idx = 0;

  friend bool operator==(const ShardParamInfo& a, const ShardParamInfo& b) {
    return a.in_shard == b.in_shard && a.offset_in_shard == b.offset_in_shard &&
           a.numel_in_shard == b.numel_in_shard &&
           a.intra_param_start_idx == b.intra_param_start_idx &&
           a.intra_param_end_idx == b.intra_param_end_idx;
  }
};

// The interval of the padded unsharded flat parameter a rank holds.
struct ShardInterval {
  // Inclusive bounds, PyTorch's `unsharded_start_idx` / `unsharded_end_idx`;
  // they may lie past the unsharded numel for ranks holding only padding.
  int64_t start = 0;
  int64_t end_inclusive = 0;
  // Zeros appended to the rank's data to reach the shard size
  // (PyTorch's `_shard_numel_padded`).
  int64_t numel_padded = 0;
};

// PyTorch's FlatParamShardMetadata: the parameters present in one rank's
// shard, in flat order.
struct FlatParamShardMetadata {
  std::vector<std::string> param_names;
  std::vector<std::vector<int64_t>> param_shapes;
  std::vector<int64_t> param_numels;
  // Inclusive [start, end] element ranges within each parameter.
  std::vector<std::pair<int64_t, int64_t>> param_offsets;
};

// The layout of one flat parameter. See the file comment.
class FlatParamLayout {
 public:
  // Lays out `params`, the parameters of the unit whose module prefix is
  // `unit` ("" for the root), in traversal order.
  //
  // Returns InvalidArgument, naming the offending values, for: an empty
  // list; world_size < 1; a negative dimension; an empty or duplicate fqn; a
  // tie to an unknown or later parameter; a non-floating dtype; dtypes that
  // differ; `requires_grad` that differs without align_addresses (PyTorch's
  // use_orig_params=False, which needs it uniform); a flat parameter with no
  // elements under a strategy that needs shard metadata (PyTorch asserts
  // there).
  static absl::StatusOr<FlatParamLayout> Create(
      std::string unit, absl::Span<const ParamSpec> params,
      const LayoutOptions& options);

  const std::string& unit() const { return unit_; }
  const LayoutOptions& options() const { return options_; }
  int64_t world_size() const { return options_.world_size; }
  DType dtype() const { return dtype_; }
  // 0 when alignment is off.
  int64_t aligned_numel() const { return aligned_numel_; }
  // True when any parameter requires a gradient (PyTorch ORs them).
  bool requires_grad() const { return requires_grad_; }

  const std::vector<ParamInfo>& params() const { return params_; }
  const std::vector<SharedParamInfo>& shared_params() const {
    return shared_params_;
  }
  // Segments of the flat parameter in order, parameters and padding alike.
  const std::vector<int64_t>& numels_with_padding() const {
    return numels_with_padding_;
  }
  const std::vector<bool>& is_padding_mask() const { return is_padding_mask_; }

  // Numel of the flat parameter as flattened, alignment and world-size
  // padding included (PyTorch's `_unpadded_unsharded_size`).
  int64_t unpadded_unsharded_numel() const { return unpadded_numel_; }
  // Numel of every rank's shard; the whole flat parameter for NO_SHARD.
  int64_t sharded_numel() const { return sharded_numel_; }
  // sharded_numel() * world_size for sharded strategies, else the unpadded
  // numel: the all-gather output size.
  int64_t padded_unsharded_numel() const;
  // Sum of numels of the original parameters (padding excluded).
  int64_t param_numel() const;

  // [start, end] (inclusive) of each segment in numels_with_padding();
  // PyTorch's
  // `_get_flat_param_offsets`.
  std::vector<std::pair<int64_t, int64_t>> flat_param_offsets() const;

  // The interval rank `rank` holds. REQUIRES: 0 <= rank < world_size.
  ShardInterval shard_interval(int64_t rank) const;
  // Per-parameter shard info for `rank`, one entry per params() element.
  std::vector<ShardParamInfo> shard_param_infos(int64_t rank) const;
  // The same for parameter `index` alone.
  ShardParamInfo shard_param_info(int64_t rank, int index) const;
  // PyTorch's `shard_metadata()` for `rank`.
  FlatParamShardMetadata shard_metadata(int64_t rank) const;

  // Bounds-checked versions for caller-supplied ranks.
  absl::StatusOr<ShardInterval> ShardIntervalFor(int64_t rank) const;
  absl::Status CheckRank(int64_t rank) const;

 private:
  FlatParamLayout() = default;

  std::string unit_;
  LayoutOptions options_;
  DType dtype_ = DType::kFloat32;
  int64_t aligned_numel_ = 0;
  bool requires_grad_ = false;
  std::vector<ParamInfo> params_;
  std::vector<SharedParamInfo> shared_params_;
  std::vector<int64_t> numels_with_padding_;
  std::vector<bool> is_padding_mask_;
  int64_t unpadded_numel_ = 0;
  int64_t sharded_numel_ = 0;
};

// PyTorch's `_get_aligned_numel`: 16 bytes in elements of `dtype`.
int64_t AlignedNumel(DType dtype);

// torch.chunk-based sharding of a 1-D tensor of `numel` elements over
// `world_size` ranks: PyTorch's `_get_unpadded_shard` returns [begin, end)
// of rank's chunk and the zeros to append. REQUIRES: numel >= 0,
// world_size >= 1, 0 <= rank < world_size.
struct UnpaddedShard {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t numel_to_pad = 0;
};
UnpaddedShard GetUnpaddedShard(int64_t numel, int64_t rank, int64_t world_size);

}  // namespace flatparam

#endif  // FLATPARAM_LAYOUT_H_
