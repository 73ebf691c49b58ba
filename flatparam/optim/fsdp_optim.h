// FSDP's optimizer-state operations (PyTorch's `_optim_utils.py`): turning
// the per-rank sharded optimizer state of a wrapped model into the full,
// unflattened state dict and back.
//
//   ConsolidateOptimState   sharded (every rank) -> full      collective
//   ShardFullOptimState     full -> this rank's sharded       local
//   ScatterFullOptimState   full (rank 0 only) -> sharded     collective
//   OptimStateDictToLoad    full -> sharded (either of the two above)
//
// The full state dict (optim_state.h) is keyed by original-parameter FQN,
// each shared parameter once under its first name; tensor states have
// their parameter's shape. FSDP-managed parameters are those of the
// ModelLayout; `unmanaged_params` names parameters the optimizer also holds
// that no flat parameter manages (PyTorch: parameters of ignored modules),
// whose state passes through unchanged and replicated. Any other key is a
// user-defined state: it passes through unchanged with a warning. A full
// dict keyed by parameter ID is accepted and re-keyed by ModelParamOrder
// followed by `unmanaged_params`.
//
// The sharded form: each rank's OptimStateDict, as PyTorch's optimizer
// holds it on that rank. Two paths, as in PyTorch:
//
//   * Flat-parameter path (use_orig_params = false): state keyed by the
//     flat parameter's index in ModelLayout::flat_params() (PyTorch keys
//     the optimizer by flat-parameter ID). A positive-dimension tensor state
//     is the rank's shard of the flattened state: 1-D, sharded_numel()
//     elements of the state's dtype, laid out exactly like the flat
//     parameter's shard (alignment and world-size padding hold 42, the
//     right padding 0). Zero-dimension and non-tensor states are replicated
//     (one value for the whole flat parameter, equal on every rank). Groups
//     list flat-parameter indices (sorted), then unmanaged FQNs in
//     `unmanaged_params` order: PyTorch sorts optimizer IDs, so with
//     unmanaged_params in the optimizer's order (and ignored modules after
//     the wrapped ones, whose IDs come first) the order is PyTorch's.
//   * Original-parameter path (use_orig_params = true): state keyed by
//     original-parameter FQN, present on a rank only for the parameters
//     its shard holds (ShardParamInfo::in_shard). A positive-dimension
//     tensor state is the rank's flattened piece of it: 1-D, elements
//     [intra_param_start_idx, intra_param_end_idx]. Other states are
//     replicated to every rank holding the parameter. Groups list FQNs.
//     Deviation: a zero-numel parameter that no rank's shard holds (one at
//     a shard boundary) keeps its state on rank 0 instead of losing it.
//   With NO_SHARD or a world of one rank there is nothing to shard
//   (PyTorch switches to NO_SHARD for one rank): the flat path holds the
//   whole flattened state (sharded_numel() is the unpadded numel), the
//   original-parameter path every parameter's state whole, in its shape.
//
// Hybrid strategies: `layout` describes the shard group (its world size is
// the shard group's size) and `comm` must be that shard group. Every
// replicate group holds identical state, so consolidating or loading
// within any one shard group gives the whole state; nothing communicates
// across replicate groups.
//
// Rules and errors (PyTorch's, with the values named):
//   * Flattening a flat parameter's states (flat path): its parameters that
//     have state must have the same state names; positive-dimension states
//     must have one floating dtype and their parameter's shape; parameters
//     without the state get zeros (not allowed for a 0-d parameter);
//     zero-dimension tensor and non-tensor states must be present for every
//     parameter with one value (and dtype). Violations are InvalidArgument
//     naming the state and the parameters. A flat parameter none of whose
//     parameters has state gets no entry.
//   * Original-parameter path: positive-dimension states must have their
//     parameter's shape and a floating dtype, one per state name within a
//     flat parameter (the consolidating all-gather has one dtype).
//   * Consolidation checks what the ranks hold before communicating, so
//     every rank returns the same error: FailedPrecondition when a rank
//     lacks state that rank 0 has (flat path) or that the parameter's other
//     shards have (original-parameter path), naming the ranks and the
//     parameters, or when a trainable parameter of a flat parameter with
//     state has none on any rank (original-parameter path);
//     InvalidArgument when ranks disagree on names, kinds, dtypes or
//     replicated values, or a tensor has the wrong size.
//   * Deviations: a flat parameter counts as having state when any of its
//     parameters has state (PyTorch looks only at the first parameter and
//     otherwise passes the others through unflattened), and
//     positive-dimension tensor states must have a floating dtype on both
//     paths.
//
// Memory: consolidation streams one flat parameter and one state name at a
// time: it all-gathers that state into one temporary buffer of the padded
// unsharded size (at most `max_temp_bytes` when set, in chunks of at least
// one element per rank), copies each parameter's part out (skipping
// padding) and frees the buffer before the next one. Scatter streams the
// same way with broadcasts. So the temporary memory beyond the result is
// at most MaxTempBytes() (the largest flat parameter's state), never the
// whole model's. (PyTorch all-gathers every state of a flat parameter at
// once onto the device, and without cpu_offload keeps the whole
// consolidated dict there, a well-known cause of rank-0 out-of-memory
// failures.) The exchanged metadata (state names, dtypes, shapes,
// scalars) is not counted.
//
// Ownership: the functions take caller-owned inputs by const reference and
// return new dicts. Thread-safety: they run on the calling rank's thread;
// the collective ones follow the Communicator contract (every rank of the
// group calls the same function with the same layout and options).
//
// Implementation, one file per responsibility behind this one header:
// fsdp_optim_consolidate.cc (sharded -> full), fsdp_optim_shard.cc (full ->
// this rank's shard, local), fsdp_optim_scatter.cc (full on rank 0 ->
// every rank's shard), fsdp_optim.cc (the rest); what they share in
// internal/optim_common.h, internal/sharded_keys.h and
// internal/shard_plan.h.
#ifndef FLATPARAM_OPTIM_FSDP_OPTIM_H_
#define FLATPARAM_OPTIM_FSDP_OPTIM_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "comm/communicator.h"
#include "flatparam/base/dtype.h"
#include "flatparam/device/device.h"
#include "flatparam/model_layout.h"
#include "flatparam/optim/optim_state.h"

namespace flatparam {
namespace optim {

// Counts the bytes of the temporary buffers the functions below allocate
// (not their results): current and peak. Single-threaded, like the rank
// that uses it.
class AllocationTracker {
 public:
  void Allocated(int64_t bytes);
  void Freed(int64_t bytes);
  int64_t current_bytes() const { return current_; }
  int64_t peak_bytes() const { return peak_; }
  int64_t allocations() const { return allocations_; }
  // Sets the peak to the current value.
  void ResetPeak() { peak_ = current_; }

 private:
  int64_t current_ = 0;
  int64_t peak_ = 0;
  int64_t allocations_ = 0;
};

// How a rank's optimizer keys its sharded state dict (the dict that
// ConsolidateOptimState takes and the sharding functions return).
enum class ShardedKeys : uint8_t {
  // Flat path: the flat parameter's index in ModelLayout::flat_params();
  // original-parameter path: the parameter's FQN. The default.
  kLayout,
  // PyTorch's NamedOptimizer / KeyedOptimizer: flat path: the flat
  // parameter's FQN (FlatParamFqn: "layers.0._flat_param"); original-
  // parameter path: the FQN, with an entry for every managed parameter that
  // has state on every rank -- a rank that holds no piece of it gets
  // zero-element tensors and the replicated values (PyTorch fills these in
  // from the keyed optimizer's own state).
  //
  // Wrapper prefixes: a NamedOptimizer keys by the wrapped model's
  // `named_parameters()` names, which carry "_fsdp_wrapped_module." (at
  // every wrapped depth), "_checkpoint_wrapped_module." and torch.compile's
  // "_orig_mod." components. A name is a parameter's when its
  // CleanTensorName (flatparam/base/fqn.h; PyTorch's clean_tensor_name) is
  // a FlatParamFqn (flat path), a managed parameter's FQN (original-
  // parameter path) or one of `unmanaged_params`; so
  // "_fsdp_wrapped_module.layers.0._fsdp_wrapped_module._flat_param" names
  // "layers.0._flat_param". Any other name is user-defined state, passed
  // through unchanged (not cleaned). Two keys naming one parameter (say
  // "_fsdp_wrapped_module.w" and "w") are InvalidArgument naming both.
  // The sharding functions return clean names unless `optimizer_params`
  // lists the optimizer's own names (then those, as PyTorch's
  // `optim_state_dict_to_load` re-keys by them).
  kNames,
  // IDs in this rank's optimizer's parameter order (PyTorch's
  // `_rekey_sharded_optim_state_dict`): ID i is
  // OptimStateOptions::optimizer_params[i]. Groups list their IDs sorted.
  kOptimizerIds,
};

// PyTorch's name of the flat parameter of `unit` (`_get_flat_param_to_fqn`,
// cleaned): "<unit>._flat_param", or "_flat_param" for the root.
std::string FlatParamFqn(const FlatParamLayout& unit);

// Receives warnings (user-defined state keys passed through).
using WarningHandler = std::function<void(absl::string_view message)>;

struct OptimStateOptions {
  // PyTorch's use_orig_params: the original-parameter path. Independent of
  // the layout's `align_addresses` (PyTorch always pairs them; both
  // combinations work here).
  bool use_orig_params = false;
  // FQNs of parameters the optimizer holds that no flat parameter manages,
  // in the optimizer's parameter order (sharded groups list them so).
  std::vector<std::string> unmanaged_params;
  // ConsolidateOptimState: only global rank 0 returns the dict (others
  // return an empty one). OptimStateDictToLoad: only rank 0 of `comm` holds
  // the full dict, so scatter it.
  bool rank0_only = false;
  // This process's rank in the whole job (PyTorch's `dist.get_rank()`),
  // which decides "rank 0" for ConsolidateOptimState's rank0_only. Unset:
  // comm.rank(), which is the global rank for every strategy but the
  // hybrid ones; with a hybrid layout, rank0_only needs it set (the shard
  // group has a rank 0 in every replicate group), else InvalidArgument.
  std::optional<int64_t> global_rank;
  // Flat path: replicated values (zero-dimension and non-tensor states)
  // that differ across the ranks of a flat parameter. PyTorch keeps each
  // rank's own value without checking, and so does ConsolidateOptimState by
  // default, warning once per differing state with the state, the flat
  // parameter and every rank's value that differs from rank 0's. True:
  // InvalidArgument instead. (The original-parameter path always rejects
  // them, as PyTorch asserts.)
  bool strict_replicated_values = false;
  // How this rank's optimizer keys the sharded dict (see ShardedKeys).
  ShardedKeys sharded_keys = ShardedKeys::kLayout;
  // The rank's optimizer's parameters in its order, by name: FlatParamFqn
  // for flat parameters (flat path), FQNs for original parameters
  // (original-parameter path) and for unmanaged ones, each either clean or
  // as the wrapped model's `named_parameters()` spells it (matched after
  // CleanTensorName; see ShardedKeys::kNames). Two entries naming one
  // parameter are InvalidArgument.
  //   kOptimizerIds: required; ID i is optimizer_params[i].
  //   kNames: optional; when set, the sharding functions key each parameter
  //   by the name listed for it, so that a NamedOptimizer's wrapped names
  //   survive consolidate -> full dict (clean FQNs) -> load.
  // When set, a parameter with sharded state that it does not list is
  // InvalidArgument.
  std::vector<std::string> optimizer_params;
  // Upper bound on one temporary buffer in bytes; 0 for one whole flat
  // parameter's state. Chunks hold at least one element (per rank).
  int64_t max_temp_bytes = 0;
  // Where temporary buffers are counted; may be null.
  AllocationTracker* tracker = nullptr;
  // Null: warnings go to stderr.
  WarningHandler on_warning;
  // Timeout of each collective.
  CollectiveOptions collective;
  // The communicator's device, for communicators that take device buffers
  // only (NCCL): when set and its device() is not the host, every
  // collective's buffer is staged through device memory allocated from it
  // (the same size as the host buffer, so max_temp_bytes bounds both;
  // counted in `tracker` too): host -> device copy, the collective, device
  // -> host copy, each synchronized. Null or host: host buffers. Must
  // outlive the call.
  DeviceOps* device = nullptr;
};

// PyTorch's `full_optim_state_dict` / `_optim_state_dict`: the full state
// dict from every rank's sharded state (see the file comment for both
// paths). Collective over `comm` (the shard group, of the layout's world
// size).
//
// Keys: `sharded` is keyed as options.sharded_keys says. The result is
// keyed by clean FQN for every parameter (managed and unmanaged), whatever
// the rank's optimizer's keys, as PyTorch's `optim_state_dict` is: with
// kNames or kOptimizerIds, a name with wrapper prefixes
// ("_fsdp_wrapped_module.layers.0._fsdp_wrapped_module._flat_param",
// "_orig_mod.w") is recognised as its parameter's (ShardedKeys::kNames),
// and keys that are no parameter's are user-defined state, copied
// unchanged with a warning. Two keys naming one parameter on any rank are
// InvalidArgument on every rank, naming both.
//
// Tensor states come from the all-gather; zero-dimension and non-tensor
// states are this rank's values (flat path; see strict_replicated_values)
// or the value the parameter's holding ranks agree on (original-parameter
// path). Param groups: this rank's, with flat-parameter indices replaced by
// their parameters' FQNs. With `rank0_only`, ranks other than global rank
// 0 communicate and return an empty dict, allocating only the collectives'
// temporary buffers.
//
// InvalidArgument for a communicator whose size is not the layout's world
// size, rank0_only with a hybrid layout and no global_rank, and the errors
// in the file comment.
absl::StatusOr<OptimStateDict> ConsolidateOptimState(
    const ModelLayout& layout, const OptimStateDict& sharded,
    Communicator& comm, const OptimStateOptions& options = {});

// PyTorch's `shard_full_optim_state_dict` / `_flatten_optim_state_dict`:
// rank `rank`'s sharded state from the full dict, without communication.
// Param groups are re-keyed for the path. `full` is keyed by clean FQN (or
// parameter ID); the result is keyed as options.sharded_keys says (kNames:
// by the names optimizer_params lists, else clean ones).
//
// InvalidArgument for a rank outside [0, world size), a parameter group
// listing a key that is neither a model parameter nor an unmanaged one, and
// the flattening errors in the file comment.
absl::StatusOr<OptimStateDict> ShardFullOptimState(
    const ModelLayout& layout, const OptimStateDict& full, int64_t rank,
    const OptimStateOptions& options = {});

// PyTorch's `scatter_full_optim_state_dict`: like ShardFullOptimState on
// every rank, where only rank 0 holds `full` (other ranks pass an empty
// dict; theirs is ignored). Rank 0 first sends the metadata (every state
// but the positive-dimension tensors of managed parameters, which go as
// dtype and shape), every rank validates it, so all return the same
// error; then each flat parameter's flattened tensor states are broadcast
// one state at a time (in chunks of max_temp_bytes) and each rank keeps its
// shard. Returns exactly what ShardFullOptimState(layout, full,
// comm.rank()) returns. Collective over `comm`. Hybrid strategies: `comm`
// is the shard group, so rank 0 of every shard group must hold `full`
// (PyTorch broadcasts from global rank 0 over the whole job; with one full
// dict, broadcast it over the replicate group first, or load with
// rank0_only off).
absl::StatusOr<OptimStateDict> ScatterFullOptimState(
    const ModelLayout& layout, const OptimStateDict& full, Communicator& comm,
    const OptimStateOptions& options = {});

// PyTorch's `optim_state_dict_to_load`: this rank's sharded state to load
// into its optimizer. With `rank0_only`, ScatterFullOptimState; otherwise
// ShardFullOptimState(layout, full, comm.rank()) (no communication).
absl::StatusOr<OptimStateDict> OptimStateDictToLoad(
    const ModelLayout& layout, const OptimStateDict& full, Communicator& comm,
    const OptimStateOptions& options = {});

// The most temporary memory ConsolidateOptimState and ScatterFullOptimState
// allocate at once for a positive-dimension state of `state_dtype`: the
// buffer of the largest flat parameter (padded unsharded numel, or the
// max_temp_bytes chunk) times DTypeSize(state_dtype). Consolidation of an
// unsharded layout allocates nothing.
int64_t MaxTempBytes(const ModelLayout& layout, DType state_dtype,
                     const OptimStateOptions& options = {});

}  // namespace optim
}  // namespace flatparam

#endif  // FLATPARAM_OPTIM_FSDP_OPTIM_H_
