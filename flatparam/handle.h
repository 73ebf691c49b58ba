// FlatParamHandle: the runtime of one FSDP unit's flat parameter on one rank,
// PyTorch's `FlatParamHandle` (torch/distributed/fsdp/_flat_param.py) plus
// the per-handle parts of FSDP's runtime hooks (`_runtime_utils.py`:
// pre/post-forward, pre/post-backward, gradient reduction, summon full
// parameters), for a C++ trainer with its own forward and backward.
//
// A handle owns this rank's sharded flat parameter (the full-precision
// "local shard"), all-gathers it into the padded unsharded flat parameter
// for computation (Unshard), frees that again (Reshard), reduce-scatters the
// gradient the backward accumulated into an unsharded flat gradient
// (ReduceGrad), and keeps the resulting sharded gradient for the optimizer.
//
// One training iteration, as FSDP drives it (`is_root` and `sync` are the
// caller's):
//
//   FLATPARAM_RETURN_IF_ERROR(h->PreForward());           // IDLE -> FORWARD
//   ... read h->Param(i) (views into the unsharded flat parameter) ...
//   FLATPARAM_RETURN_IF_ERROR(h->PostForward(is_root));   // FORWARD -> IDLE
//   FLATPARAM_RETURN_IF_ERROR(h->PreBackward());          // -> BACKWARD_PRE
//   ... h->AccumulateGrad(i, grad_i) or add into h->GradView(i) ...
//   FLATPARAM_RETURN_IF_ERROR(h->PostBackward(sync));     // -> BACKWARD_POST
//   FLATPARAM_RETURN_IF_ERROR(h->FinalizeBackward(sync)); // -> IDLE
//   ... optimizer: h->sharded_param(), h->sharded_grad() ...
//   FLATPARAM_RETURN_IF_ERROR(h->ZeroGrad());
//
// Collectives. Every rank of the shard group must make the same sequence of
// calls that communicate: Unshard (and the hooks and summon that unshard
// when the parameter is not unsharded yet) all-gathers over the shard group;
// ReduceGrad (PostBackward with sync) reduce-scatters over the shard group
// (all-reduces for NO_SHARD) and, for the hybrid strategies, then
// all-reduces over the replicate group. Nothing else communicates.
//
// Strategies (taken from the layout's options):
//   FULL_SHARD, HYBRID_SHARD       free the unsharded parameter after forward
//                                  (PyTorch's RESHARD_AFTER_FORWARD
//                                  strategies) and after backward;
//   SHARD_GRAD_OP, HYBRID_SHARD_ZERO2  keep it from forward to backward and
//                                  free it after a synchronizing backward;
//   NO_SHARD                       every rank holds the whole flat parameter;
//                                  unshard only switches views (and casts for
//                                  mixed precision); gradients are
//                                  all-reduced.
//   The hybrid strategies shard over `shard_group` (the layout's world size)
//   and replicate over `replicate_group`.
//
// Original-parameter views (PyTorch's `use_orig_params=True` model). While
// the handle is unsharded, Param(i) is parameter i, unflattened, inside the
// unsharded flat parameter (in the unsharded dtype: `param_dtype` under
// mixed precision, full precision while summoning); while sharded, it is the
// flattened part of parameter i in this rank's local shard, possibly empty.
// Views are raw memory: each carries the handle's view epoch, which changes
// on every unshard and reshard, and CheckView() reports a stale one. Views
// of the unsharded parameter must not be used after the reshard (or the
// handle's destruction) that ended their epoch.
//
// Gradients. PreBackward() provides the unsharded flat gradient (padded,
// zero-initialized, in the unsharded parameter dtype), or the one
// accumulated under no_sync; the backward adds each parameter's gradient
// into GradView(i) (or calls AccumulateGrad). Frozen parameters
// (`requires_grad = false`) and padding get no gradient: their segments are
// zeroed before the reduction. See ReduceGrad() for the exact arithmetic.
//
// Training states (PyTorch's HandleTrainingState) and what each call needs:
//   PreForward              IDLE -> FORWARD (unshards unless unsharded);
//                           in BACKWARD_PRE nothing (a recompute, below)
//   PostForward             FORWARD -> IDLE (reshards); in BACKWARD_PRE
//                           nothing
//   PreBackward             IDLE -> BACKWARD_PRE (unshards unless unsharded)
//   PostBackward            BACKWARD_PRE -> BACKWARD_POST (reshards, reduces)
//   FinalizeBackward        any but SUMMON_FULL_PARAMS -> IDLE (reshards)
//   SetTraining             IDLE, while sharded
//   BeginSummonFullParams   IDLE (sharded) -> SUMMON_FULL_PARAMS
//   EndSummonFullParams     SUMMON_FULL_PARAMS -> IDLE
//   Unshard                 IDLE, FORWARD or BACKWARD_PRE, while sharded
//   Reshard                 any state but SUMMON_FULL_PARAMS, while unsharded
//   ReduceGrad              BACKWARD_PRE or BACKWARD_POST, with an unsharded
//                           gradient
//   GradView/AccumulateGrad BACKWARD_PRE, with an unsharded gradient
//   ZeroGrad                IDLE
// Activation checkpointing recomputes a unit's forward inside its backward.
// Non-reentrant (PyTorch's default `checkpoint`, and `fully_shard` with
// it): PreBackward, then PreForward, the forward, PostForward, then the
// backward: the two forward hooks do nothing, as PyTorch's return early in
// BACKWARD_PRE, and the parameter stays unsharded throughout. Reentrant:
// PreForward and PostForward in IDLE before PreBackward, as for a forward.
// Any other use returns FailedPrecondition naming the operation and the
// current state, and changes nothing: the handle stays usable. A collective
// that fails leaves the handle in a consistent state (see each method).
//
// Mixed precision follows PyTorch's `_init_param_reduce_dtypes`: with
// `param_dtype` set and `reduce_dtype` unset, gradients are reduced in
// `param_dtype`; otherwise each defaults to the parameters' dtype. Summoning
// full parameters forces full precision.
//
// CPU offload: the local shard and the sharded gradient live on the host
// (pinned where the DeviceOps supports it); each unshard copies the shard to
// the compute device first, and each reduction copies the new sharded
// gradient back. Unlike PyTorch 2.x (which overwrites `_cpu_grad`), gradients
// accumulate across synchronized iterations with offload too.
//
// Where this differs from PyTorch 2.x, on purpose:
//   * Frozen parameters inside a flat parameter get a zero gradient (PyTorch
//     computes and reduces one and only hides it from the optimizer).
//   * NO_SHARD reduces each backward's fresh gradient and adds it to the
//     sharded gradient (PyTorch lets autograd add into the reduced gradient
//     and all-reduces the sum again; equal in exact arithmetic).
//   * The unsharded gradient is allocated padded, so the reduce-scatter
//     needs no padded copy (PyTorch's `F.pad`).
//   * Between PostForward and PreBackward, SHARD_GRAD_OP and
//     HYBRID_SHARD_ZERO2 expose sharded views (PyTorch keeps exposing the
//     unsharded ones); the unsharded parameter is kept and reused all the
//     same.
//   * FinalizeBackward(sync) frees an unsharded parameter kept past the
//     backward (the root's, when its backward did not run), which would be
//     stale after the optimizer step; PyTorch's catch-all reshard keeps it
//     and reuses it in the next forward.
//   * FSDP_USE_FULL_PREC_IN_EVAL, FSDP_USE_FAKE_ALL_GATHER and
//     FSDP_USE_FAKE_REDUCE are HandleOptions, not environment variables;
//     eval mode is SetTraining(false) (PyTorch's `module.training`).
//   * Summoning with gradients does not need use_orig_params (views are
//     always per original parameter here).
//   * Not modeled: communication hooks, storage changes of
//     original parameters (`_writeback_orig_params`: here views are the
//     storage, so in-place writes need no writeback).
//
// Memory: the handle owns every buffer it allocates, through `device`, and
// counts them in memory(); a caller-provided local shard
// (CreateWithLocalShard) stays the caller's and is not counted. The handle
// keeps a copy of the layout; the communicators and the DeviceOps must
// outlive it.
//
// Device work and streams. The handle runs copies, casts, fills, scales
// and adds through the DeviceOps on three streams (HandleOptions::streams,
// PyTorch's): the unshard's casts on the unshard stream, the reduction's on
// the post-backward stream, everything the caller uses on the compute
// stream. Every hand-off between them is an event, and every buffer one
// stream allocated and another used is declared with RecordStream before
// it is freed:
//   * the first unshard after the handle's creation, a FinalizeBackward or
//     a summon's writeback starts after the compute stream's work issued
//     so far (the optimizer's or the caller's update of the local shard),
//     unless the caller already made the unshard stream wait for it
//     (NoteUnshardStreamWaitedForCompute, which FsdpRuntime calls once per
//     iteration, as PyTorch's root pre-forward does); later unshards of
//     the iteration do not wait for the compute stream, so an all-gather
//     overlaps the kernels issued before it;
//   * the unsharded parameter, allocated on the unshard stream, is
//     recorded for the compute stream, which reads it;
//   * the reduction starts after the compute stream's work issued so far
//     (the backward's gradient), which is recorded for the post-backward
//     stream;
//   * FinalizeBackward makes the compute stream wait for the post-backward
//     stream, so the optimizer, issued on the compute stream afterwards,
//     sees the sharded gradient; the sharded gradient is recorded for both.
// Collectives are ordered with the streams in one of two ways:
//   * stream-ordered (NCCL; comm/communicator.h), when the communicators
//     SupportsStreams(device) and the DeviceOps has NativeStreams (and
//     HandleOptions::stream_ordered is on): the all-gather is issued
//     ordered after the unshard stream's casts (CollectiveOptions::stream),
//     and finishing the unshard makes the unshard stream wait for it
//     (Work::WaitStream) and the compute stream wait for the unshard
//     stream; the reduce-scatter is issued after the post-backward
//     stream's work, and finishing it makes the post-backward stream wait
//     for it, which also issues the hybrid all-reduce on that stream. The
//     host never waits for a collective on these paths; it waits for each
//     of them once, in FinalizeBackward (and the destructor), to report a
//     timeout or a peer's failure before the optimizer uses the results
//     (c10d leaves that to its watchdog), and for the oldest when more
//     than four are unchecked (a forward-only loop never finalizes); such
//     a failure is reported by the call that checked it.
//   * host-completed (the simulator, MPI; NCCL with stream_ordered off):
//     the host waits for the producing stream before issuing the
//     collective (its input must be there) and for the collective before
//     finishing (Work::Wait); device work issued afterwards follows.
// Either way the host never waits for the compute stream on these paths (a
// forward's kernels still run while the next unit's all-gather is
// prepared), and the caller orders its own work by issuing it on the
// compute stream: views are valid to use there once PreForward/PreBackward
// returned, gradients once FinalizeBackward returned. Host code that
// reads device memory synchronizes first, as with any CUDA stream. The
// rarer calls (summon, SetGradNone, ZeroGrad without set_to_none) also
// synchronize the device before returning; ZeroGrad(set_to_none) only
// frees, and the streams that used those gradients were recorded.
// sim/sim_device.h checks all of this, on both paths: the handle's tests
// run on it with separate streams and its race detector reports nothing,
// and reports each ordering above when a test switch leaves it out. The
// asynchronous calls (StartUnshard, PostBackwardAsync) return before their
// collective has completed; until the matching finish, the buffers it uses
// are the pending operation's, not exposed.
//
// Thread-safety: a handle is used by one thread at a time (the rank's
// thread, which also owns its communicators).
//
// Implementation, one file per responsibility behind this one header:
// handle.cc (creation, options, the training-state machine and its hooks),
// handle_unshard.cc (collectives, stream discipline, unshard and reshard),
// handle_grad.cc (the gradient reduction, gradient views, the None mask
// and requires_grad changes), handle_summon.cc (original-parameter views,
// summoning parameters and gradients), internal/handle_internal.h (what
// they share).
#ifndef FLATPARAM_HANDLE_H_
#define FLATPARAM_HANDLE_H_

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "comm/communicator.h"
#include "flatparam/base/dtype.h"
#include "flatparam/device/device.h"
#include "flatparam/flatten.h"
#include "flatparam/internal/tracked_buffer.h"
#include "flatparam/layout.h"
#include "flatparam/memory_stats.h"

namespace flatparam {

// PyTorch's HandleTrainingState.
enum class HandleTrainingState : uint8_t {
  kIdle,
  kForward,
  kBackwardPre,
  kBackwardPost,
  kSummonFullParams,
};

// "IDLE", "FORWARD", "BACKWARD_PRE", "BACKWARD_POST", "SUMMON_FULL_PARAMS".
absl::string_view HandleTrainingStateName(HandleTrainingState state);

// True for FULL_SHARD and HYBRID_SHARD (PyTorch's
// RESHARD_AFTER_FORWARD_HANDLE_STRATEGIES).
bool ReshardsAfterForward(ShardingStrategy strategy);

// PyTorch's `DefaultState._get_gradient_predivide_factor`: the largest power
// of two f with world_size % f == 0 reached while world_size / f > f, found
// by doubling from 1 (for world_size 6 it is 4: doubling stops at the first
// f that fails either test). REQUIRES: world_size >= 1.
double GradientPredivideFactor(int64_t world_size);

// The streams of the handle's device work (DeviceOps streams; see the file
// comment). All default to stream 0: one stream, nothing to order.
struct HandleStreams {
  // The caller's computation: its forward and backward kernels read the
  // views and write the gradients, its optimizer updates the local shard
  // and reads the sharded gradient. The handle's own work for the caller
  // (gradient buffers, AccumulateGrad, ZeroGrad, summon) runs here.
  Stream compute;
  // The unshard: the cast to param_dtype (and the offload copy) before the
  // all-gather. PyTorch's `_unshard_stream`.
  Stream unshard;
  // The gradient reduction: casts and divides around the reduce-scatter
  // and the accumulation into the sharded gradient. PyTorch's
  // `_post_backward_stream`.
  Stream post_backward;
};

struct HandleOptions {
  // Mixed precision (PyTorch's MixedPrecision.param_dtype / reduce_dtype).
  std::optional<DType> param_dtype;
  std::optional<DType> reduce_dtype;
  // Leave the sharded gradient in `param_dtype` after the backward instead
  // of the parameters' dtype.
  bool keep_low_precision_grads = false;
  // Keep the local shard and the sharded gradient on the host.
  bool cpu_offload = false;
  // Divide gradients inside the collectives (ReduceOptions' divide factors)
  // instead of with DeviceOps::Scale before and after them. Off by default:
  // the NCCL backend folds both factors into one pre-multiplied sum, which
  // rounds differently from PyTorch's two `div_` calls. On the host device
  // with host-reducing communicators (the simulator, MPI) the handle
  // divides inside the collectives anyway: their folds divide each
  // contribution exactly as the separate passes would (comm/host_reduce.h),
  // so the bits are the same and two passes over the gradient are saved.
  bool divide_in_collectives = false;
  // PyTorch's FSDP_USE_FULL_PREC_IN_EVAL=1: in eval mode (SetTraining(false))
  // mixed precision is off, so unshards gather the full-precision parameter
  // and views are in the parameters' dtype, as while summoning; a backward
  // in eval computes, reduces and keeps the gradient in the parameters'
  // dtype too (no cast to the reduce dtype, keep_low_precision_grads
  // ignored), as PyTorch skips those casts under _force_full_precision.
  bool use_full_prec_in_eval = false;
  // PyTorch's FSDP_USE_FAKE_ALL_GATHER=1 / FSDP_USE_FAKE_REDUCE=1, for
  // measuring compute alone: the sharded strategies' all-gather of the
  // parameter / reduce-scatter of the gradient is skipped (nothing is sent
  // or awaited) and its output buffer keeps whatever the allocator gave it,
  // so training is incorrect. Everything else runs as usual: casts, copies,
  // the hybrid strategies' replicate all-reduce and NO_SHARD's all-reduce
  // (PyTorch fakes only those two collectives). Creating a handle with
  // either set prints a warning to stderr, as PyTorch logs one.
  bool fake_all_gather = false;
  bool fake_reduce = false;
  // Parameters on the meta device (PyTorch's `device="meta"`, shapes
  // only): Create reads nothing from `initial_params` (their data may be
  // null; counts and dtypes are still checked) and zero-fills the local
  // shard on the device, where PyTorch would call `param_init_fn` or
  // `reset_parameters()`. No host staging is made, so a simulated device
  // without memory (SimDeviceOptions::metadata_only) can hold a shard of
  // any size.
  bool meta_init = false;
  // Timeout etc. of every collective the handle issues.
  CollectiveOptions collective_options;
  // Streams of the DeviceOps (created by the caller, who keeps them).
  HandleStreams streams;
  // Order collectives with the streams on the device, without host waits,
  // where the communicators and the DeviceOps support it (see "Device work
  // and streams"); off makes every collective host-completed.
  bool stream_ordered = true;
};

// How BeginSummonFullParams summons (PyTorch's `summon_full_params`
// arguments).
struct SummonOptions {
  // EndSummonFullParams copies each rank's part of the (possibly modified)
  // full parameter -- and with `with_grads`, gradient -- back into its
  // shard.
  bool writeback = false;
  // Only rank 0 of the shard group keeps the full parameter (PyTorch's
  // `state.rank`, the rank in the FSDP process group: rank 0 of every shard
  // group under the hybrid strategies); the other ranks take part in the
  // all-gather, then reshard at once and see sharded views.
  bool rank0_only = false;
  // Sharded strategies only: the full parameter moves to host memory for
  // the summon and the device copy is freed (PyTorch's `to_cpu`), so a
  // model larger than device memory can be saved unit by unit.
  bool offload_to_cpu = false;
  // Also unshard the gradient (PyTorch's `unshard_grad`): an all-reduce of
  // the number of ranks whose gradient is None, then, unless every rank's
  // is, an all-gather of the sharded gradients (a None one counts as
  // zeros). UnshardedGradView exposes the result.
  bool with_grads = false;
};

// A view of one original parameter (see the file comment).
struct OrigParamView {
  // Elements in the unsharded dtype (unsharded) or the parameters' dtype
  // (sharded), on the compute device (or the host for a sharded view under
  // CPU offload). count may be 0.
  BufferRef data;
  // The parameter's shape when unsharded; {numel in this shard} when sharded.
  std::vector<int64_t> shape;
  bool sharded = true;
  int64_t epoch = 0;
};

class FlatParamHandle {
 public:
  // Creates the handle of `layout` for this rank (`shard_group->rank()`),
  // filling the local shard from `initial_params` (host memory, one entry per
  // layout.params() element, in the layout's dtype, as for FlattenShard).
  //
  // `shard_group->size()` must equal layout.world_size(). For the hybrid
  // strategies `replicate_group` is required (its size times the shard
  // group's is the data-parallel world size); otherwise it must be null.
  // With `align_addresses`, the layout's alignment must have been computed
  // for the unsharded dtype (LayoutOptions::compute_dtype == param_dtype).
  // InvalidArgument naming the offending values otherwise.
  static absl::StatusOr<std::unique_ptr<FlatParamHandle>> Create(
      const FlatParamLayout& layout,
      absl::Span<const ConstBufferRef> initial_params,
      Communicator* shard_group, Communicator* replicate_group,
      DeviceOps* device, const HandleOptions& options = {});
  // The same, sharing `layout` (immutable) instead of copying it: many
  // handles of one model in one process (FsdpRuntime's, thousands of
  // simulated ranks') hold one copy. REQUIRES: layout is not null.
  static absl::StatusOr<std::unique_ptr<FlatParamHandle>> Create(
      std::shared_ptr<const FlatParamLayout> layout,
      absl::Span<const ConstBufferRef> initial_params,
      Communicator* shard_group, Communicator* replicate_group,
      DeviceOps* device, const HandleOptions& options = {});

  // The same, using `local_shard` (caller-owned, layout.sharded_numel()
  // elements of layout.dtype(); on the host with cpu_offload, else on the
  // compute device) as the local shard in place. It must outlive the handle.
  static absl::StatusOr<std::unique_ptr<FlatParamHandle>> CreateWithLocalShard(
      const FlatParamLayout& layout, BufferRef local_shard,
      Communicator* shard_group, Communicator* replicate_group,
      DeviceOps* device, const HandleOptions& options = {});

  ~FlatParamHandle();
  FlatParamHandle(const FlatParamHandle&) = delete;
  FlatParamHandle& operator=(const FlatParamHandle&) = delete;

  // ---- Configuration ----
  const FlatParamLayout& layout() const { return layout_; }
  ShardingStrategy strategy() const { return layout_.options().strategy; }
  bool uses_sharded_strategy() const;
  // This rank and the size of the shard group.
  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  // Shard group size times replicate group size (hybrid), else world_size().
  int data_parallel_world_size() const { return dp_world_size_; }
  DType orig_dtype() const { return layout_.dtype(); }
  // PyTorch's `_fwd_bwd_param_dtype` and `_reduce_dtype`.
  DType param_dtype() const { return param_dtype_; }
  DType reduce_dtype() const { return reduce_dtype_; }
  bool uses_param_mixed_precision() const {
    return param_dtype_ != orig_dtype();
  }
  bool uses_reduce_mixed_precision() const {
    return reduce_dtype_ != orig_dtype();
  }
  const HandleOptions& options() const { return options_; }
  // The factors ReduceGrad divides by: GradientPredivideFactor(
  // data_parallel_world_size()) and data_parallel_world_size() / that.
  double gradient_predivide_factor() const { return predivide_; }
  double gradient_postdivide_factor() const { return postdivide_; }

  // ---- State ----
  HandleTrainingState training_state() const { return state_; }
  // True while views point into the unsharded flat parameter.
  bool is_unsharded() const { return unsharded_; }
  // PyTorch's `needs_unshard()`: a sharded strategy whose padded unsharded
  // flat parameter (for the current precision) is not allocated, so an
  // unshard must all-gather. False for NO_SHARD.
  bool NeedsUnshard() const;
  // Changes on every unshard and reshard.
  int64_t view_epoch() const { return view_epoch_; }
  // Changes whenever the unsharded gradient is allocated or freed.
  int64_t grad_epoch() const { return grad_epoch_; }

  // ---- Runtime hooks (see the file comment) ----
  // PyTorch's pre-forward unshard. On a collective failure the handle is
  // back in IDLE, sharded.
  absl::Status PreForward();
  // Reshards, freeing the unsharded parameter when the strategy reshards
  // after forward and this is not the root unit (PyTorch keeps the root's
  // parameters for the backward that immediately follows).
  absl::Status PostForward(bool is_root = false);
  // Unshards (reusing a parameter kept since forward) and prepares the
  // unsharded gradient: the one accumulated under no_sync, or a new zeroed
  // one. A kept sharded gradient in low precision
  // (keep_low_precision_grads) goes back to full precision to accumulate.
  absl::Status PreBackward();
  // Reshards (freeing the unsharded parameter for sharded strategies when
  // `sync_gradients` or the strategy reshards after forward: PyTorch's
  // `_should_free_in_backward`), then, when `sync_gradients`, ReduceGrad();
  // without it (no_sync) the unsharded gradient is kept and accumulates over
  // the following backwards.
  absl::Status PostBackward(bool sync_gradients = true);
  // Ends the backward (PyTorch's post-backward final callback for this
  // handle). Tolerant, as PyTorch is, of a handle that took no part in the
  // backward (conditional computation: a skipped layer or expert): accepted
  // in any state but SUMMON_FULL_PARAMS. An unsharded parameter still held
  // is resharded first (PyTorch's `_catch_all_reshard`, freeing it as
  // PostBackward would), and with `sync_gradients` a kept one is freed (see
  // the differences from PyTorch); an unsharded gradient that PostBackward
  // never reduced is dropped when `sync_gradients` (PyTorch reduces only in the
  // post-backward hook) and kept for accumulation otherwise; nothing
  // communicates. With `sync_gradients` and keep_low_precision_grads,
  // casts the sharded gradient to param_dtype (PyTorch's
  // `prepare_gradient_for_optim`), except for NO_SHARD without CPU offload,
  // whose gradient stays in reduce_dtype as PyTorch's does (it has neither
  // `_cpu_grad` nor `_saved_grad_shard`, the only gradients PyTorch casts).
  absl::Status FinalizeBackward(bool sync_gradients = true);

  // PyTorch's `module.train(training)` for this handle's unit: with
  // use_full_prec_in_eval and mixed precision, eval mode unshards in full
  // precision. A kept unsharded parameter of the other precision is freed
  // (the next unshard gathers again). FailedPrecondition outside IDLE or
  // while unsharded.
  absl::Status SetTraining(bool training);
  bool training() const { return training_; }

  // ---- Primitives ----
  // All-gathers the local shard (cast to param_dtype under mixed precision,
  // copied to the compute device under CPU offload) into the padded
  // unsharded flat parameter, or reuses it when it is still allocated, and
  // switches views to it. FailedPrecondition when already unsharded ("unshard
  // twice"). On a collective failure the buffers it allocated are freed and
  // the handle stays sharded.
  absl::Status Unshard();
  // Switches views to the local shard; with `free_unsharded` (sharded
  // strategies) frees the padded unsharded flat parameter. A kept unsharded
  // parameter is reused by the next Unshard without communication.
  absl::Status Reshard(bool free_unsharded);
  // Reduces the unsharded gradient and accumulates it into the sharded
  // gradient, then frees the unsharded gradient. Step by step, where g is
  // the unsharded flat gradient (padded; frozen and padding segments zeroed)
  // and all arithmetic is the DeviceOps' (PyTorch's on that device):
  //   1. g is cast to reduce_dtype if it differs (new buffer);
  //   2. g /= predivide            (DeviceOps::Scale; skipped when 1);
  //   3. s = reduce-scatter-sum(g) over the shard group (NO_SHARD:
  //      all-reduce-sum in place over it);
  //   4. hybrid only: s = all-reduce-sum(s) over the replicate group;
  //   5. s /= postdivide           (DeviceOps::Scale; skipped when 1);
  //   6. s is cast to the gradient dtype (the parameters' dtype; reduce_dtype
  //      for NO_SHARD with keep_low_precision_grads) if it differs;
  //   7. sharded_grad = s, or sharded_grad += s when a gradient exists
  //      (under CPU offload: copied to the host and added there).
  // With divide_in_collectives (or where it is implied, see HandleOptions),
  // step 2's factor goes to the reduce-scatter's
  // ReduceOptions::pre_divide_factor and step 5's to the post_divide_factor
  // of the last collective (the replicate all-reduce for hybrid). On a
  // collective failure the unsharded gradient is dropped and the sharded
  // gradient is left as it was.
  absl::Status ReduceGrad();

  // ---- Asynchronous unshard and gradient reduction ----
  // The two collectives of an iteration, started and completed apart, so
  // that communication overlaps the caller's compute (the runtime's
  // prefetch; flatparam/runtime.h). A start returns once the collective is
  // issued (every backend makes progress without the caller: the
  // simulator's and MPI's ranks on their own threads, NCCL on its stream);
  // the buffers the collective reads and writes belong to the pending
  // operation -- counted in memory() from the start -- until it completes.
  // The blocking calls above are a start and a finish in a row. Every rank
  // of the group must start the same collectives in the same order, as
  // with the blocking calls; finishing order is free.
  //
  // StartUnshard: Unshard's pre-unshard work (copy, cast) and the
  // all-gather, not awaited. When no collective is needed (NO_SHARD, or an
  // unsharded parameter kept from before) the unshard completes at once
  // and nothing is pending. Same states as Unshard; FailedPrecondition when
  // already unsharded or pending. On an error before the collective is
  // issued, nothing is pending and the handle stays sharded.
  absl::Status StartUnshard();
  bool unshard_pending() const { return pending_unshard_.has_value(); }
  // Waits for a pending unshard and switches views to the unsharded
  // parameter (OK, doing nothing, when none is pending). PreForward,
  // PreBackward, Unshard, PostForward, PostBackward and FinalizeBackward
  // finish a pending unshard themselves; Reshard, SetTraining and
  // BeginSummonFullParams refuse to run while one is pending. On a
  // collective failure the pending buffers are freed and the handle stays
  // sharded.
  absl::Status FinishUnshard();
  // PostBackward whose reduction (ReduceGrad's steps 1-3) is started, not
  // awaited; the handle is in BACKWARD_POST with the reduction pending.
  // Until it completes, sharded_grad() is the previous gradient.
  absl::Status PostBackwardAsync(bool sync_gradients = true);
  bool reduce_pending() const { return pending_reduce_.has_value(); }
  // Waits for a pending reduction and runs ReduceGrad's steps 4-7 (the
  // hybrid all-reduce is issued and awaited here). OK, doing nothing, when
  // none is pending. FinalizeBackward and ReduceGrad finish a pending
  // reduction themselves (PyTorch's final callback waits for the
  // post-backward stream). On a collective failure the gradient being
  // reduced is dropped and the sharded gradient is left as it was.
  // Stream-ordered, "waits" is the post-backward stream's, the hybrid
  // all-reduce was already issued by PostBackwardAsync (right after the
  // reduce-scatter, as PyTorch's post-backward hook issues it), steps 5-7
  // are issued on that stream, and a failure is reported by
  // FinalizeBackward.
  absl::Status FinishReduceGrad();

  // Whether collectives are stream-ordered (see "Device work and
  // streams").
  bool stream_ordered() const { return stream_ordered_; }
  // Declares that the unshard stream already waits for every update of the
  // local shard the caller issued on the compute stream (the caller
  // recorded an event on the compute stream after its last write and made
  // the unshard stream wait for it), so the next unshard need not make it
  // wait again. FsdpRuntime does this once per iteration for all its
  // handles (PyTorch's `_wait_for_computation_stream` in the root's
  // pre-forward).
  void NoteUnshardStreamWaitedForCompute() { local_shard_written_ = false; }

  // ---- Views ----
  // The current view of parameter `index` (see the file comment).
  // InvalidArgument for a bad index.
  absl::StatusOr<OrigParamView> Param(int index) const;
  // The unsharded view; FailedPrecondition naming the state when sharded.
  absl::StatusOr<OrigParamView> UnshardedParam(int index) const;
  // OK when `view` is still valid (its epoch is the current one);
  // FailedPrecondition naming the parameter, both epochs and the state
  // otherwise.
  absl::Status CheckView(const OrigParamView& view) const;

  // While unsharded: the unsharded flat parameter (unpadded numel, alignment
  // padding included; in the unsharded dtype); nullopt while sharded.
  std::optional<BufferRef> unsharded_flat_param() const;

  // The local shard: layout.sharded_numel() elements of the parameters'
  // dtype (right padding included), on the host under CPU offload, else on
  // the compute device. The optimizer updates it in place, in IDLE.
  BufferRef sharded_param() const;
  // This rank's shard metadata (PyTorch's `shard_metadata()`).
  FlatParamShardMetadata ShardMetadata() const;

  // ---- Gradients ----
  // The unsharded gradient of parameter `index` (its numel elements in
  // param_dtype on the compute device), to add the backward's gradient into.
  // FailedPrecondition outside BACKWARD_PRE, without an unsharded gradient,
  // or for a frozen parameter.
  absl::StatusOr<BufferRef> GradView(int index) const;
  // GradView(index) += grad (cast to param_dtype first if it differs),
  // with DeviceOps::Add. `grad` is on the host or the compute device.
  absl::Status AccumulateGrad(int index, ConstBufferRef grad);
  // The whole unsharded flat gradient (padded for sharded strategies) when
  // it exists, in any state; nullopt otherwise.
  std::optional<BufferRef> unsharded_grad() const;
  // The sharded gradient (layout.sharded_numel() elements, on the host under
  // CPU offload); nullopt when it is None (never computed, or ZeroGrad with
  // set_to_none).
  std::optional<BufferRef> sharded_grad() const;
  // The flattened part of parameter `index` in the sharded gradient; nullopt
  // when the gradient is None (the whole one, or this parameter's after
  // SetGradNone), the parameter is frozen, or it is not in this rank's
  // shard (PyTorch's `_use_sharded_grad_views`).
  absl::StatusOr<std::optional<BufferRef>> ShardedGradView(int index) const;
  // PyTorch's `param.grad = None` for original parameter `index` with
  // use_orig_params (`_writeback_tensor` of a None gradient and
  // `_is_grad_none_mask`): in IDLE, zeroes the parameter's segment of the
  // sharded gradient (and of an unsharded gradient kept by no_sync) and
  // makes ShardedGradView(index) None -- not zeros -- until a backward
  // gives the parameter a gradient again (a synchronizing PostBackward, as
  // PyTorch's `_reset_is_grad_none`; under no_sync it stays None). When
  // every parameter of this rank's shard has a None gradient (parameters
  // outside it have none here) the sharded gradient is freed (PyTorch's
  // `_reset_flat_param_grad_info_if_needed`). Local: nothing communicates.
  absl::Status SetGradNone(int index);
  // True while parameter `index`'s gradient is None for the optimizer.
  bool grad_is_none(int index) const;
  // Changes parameter `index`'s `requires_grad` between iterations (in
  // IDLE) without rebuilding the handle: a frozen parameter's gradient
  // becomes None (SetGradNone: its segment zeroed, and zeroed before every
  // later reduction), so once unfrozen it has no gradient until its next
  // backward, as in PyTorch; when no parameter requires a gradient the handle
  // makes no unsharded gradient and the backward reduces nothing. Every
  // rank of the shard group must make the same change (it decides whether
  // the backward communicates). InvalidArgument when it would mix flags in
  // an unaligned layout (PyTorch's use_orig_params=False needs them
  // uniform) or for a bad index; FailedPrecondition outside IDLE.
  absl::Status SetRequiresGrad(int index, bool requires_grad);
  // Every parameter at once (PyTorch's `flat_param.requires_grad_()`, the
  // only change use_orig_params=False allows).
  absl::Status SetAllRequiresGrad(bool requires_grad);
  bool requires_grad(int index) const { return requires_grad_[index] != 0; }

  // In IDLE: with `set_to_none` frees the sharded gradient (under CPU
  // offload the host buffer stays allocated but is None) and any unsharded
  // gradient kept by no_sync; otherwise zeroes them.
  absl::Status ZeroGrad(bool set_to_none = true);

  // ---- Summon full parameters ----
  // From IDLE, while sharded: unshards in full precision (mixed precision
  // is forced off; a kept low-precision unsharded parameter is freed, as
  // PyTorch does) and enters SUMMON_FULL_PARAMS. With `writeback`,
  // EndSummonFullParams copies each rank's part of the (possibly modified)
  // full parameter back into its local shard.
  absl::Status BeginSummonFullParams(bool writeback);
  // The same with every option. InvalidArgument, as PyTorch's
  // NotImplementedError, for writeback with rank0_only, offload_to_cpu with
  // NO_SHARD, and with_grads with offload_to_cpu.
  absl::Status BeginSummonFullParams(const SummonOptions& options);
  // While summoning with_grads: parameter `index`'s full gradient (its
  // numel elements, in the sharded gradient's dtype, on the compute
  // device); nullopt when every rank's gradient is None, the parameter is
  // frozen or its gradient is None, or (rank0_only) this rank is not rank
  // 0. FailedPrecondition when not summoning with gradients.
  absl::StatusOr<std::optional<BufferRef>> UnshardedGradView(int index) const;
  // Writes back if requested, reshards (freeing the unsharded parameter
  // unless it was allocated before the summon) and returns to IDLE. For
  // NO_SHARD without offload the full parameter is the local shard itself,
  // so changes persist even without writeback (as in PyTorch).
  absl::Status EndSummonFullParams();

  // ---- Memory ----
  const MemoryStats& memory() const { return tracker_.stats(); }
  void ResetPeakMemory() { tracker_.ResetPeaks(); }
  // Counts this handle's bytes in `total` too, now and at every later
  // allocation and free (MemoryTracker::ForwardTo): how FsdpRuntime keeps
  // an exact model-wide peak. `total` must outlive the handle.
  void ForwardMemoryTo(MemoryTracker* total) { tracker_.ForwardTo(total); }

 private:
  using TrackedBuffer = internal_handle::TrackedBuffer;

  FlatParamHandle(std::shared_ptr<const FlatParamLayout> layout,
                  Communicator* shard_group, Communicator* replicate_group,
                  DeviceOps* device, const HandleOptions& options);

  static absl::StatusOr<std::unique_ptr<FlatParamHandle>> CreateCommon(
      std::shared_ptr<const FlatParamLayout> layout, Communicator* shard_group,
      Communicator* replicate_group, DeviceOps* device,
      const HandleOptions& options);

  absl::Status WrongState(absl::string_view op,
                          absl::string_view expected) const;
  absl::Status CheckIndex(absl::string_view op, int index) const;
  std::string Name() const;

  bool force_full_precision() const;
  // The unsharded dtype in the current context.
  DType unsharded_dtype() const;
  // The padded unsharded buffer for the current context (PyTorch's
  // `_get_padded_unsharded_flat_param`).
  TrackedBuffer& padded_unsharded();
  const TrackedBuffer& padded_unsharded() const;
  // Dtype the sharded gradient accumulates in.
  DType grad_accum_dtype() const;
  // Dtype the gradient is reduced in: the reduce dtype, or the parameters'
  // under forced full precision (no cast before the collective).
  DType grad_reduce_dtype() const;
  // keep_low_precision_grads, except under forced full precision (the
  // gradient was never in low precision).
  bool keeps_low_precision_grads() const;
  MemoryPlacement shard_placement() const {
    return options_.cpu_offload ? MemoryPlacement::kOffload
                                : MemoryPlacement::kCompute;
  }
  Device shard_device() const {
    return options_.cpu_offload ? Device::Host() : device_->device();
  }

  absl::StatusOr<TrackedBuffer> Alloc(
      MemoryCategory category, DType dtype, int64_t count,
      MemoryPlacement placement = MemoryPlacement::kCompute);
  // The full-precision local shard on the compute device: the local shard
  // itself, or (CPU offload) a new copy in `*copy`.
  absl::StatusOr<BufferRef> LocalShardOnCompute(TrackedBuffer* copy);
  absl::Status UnshardImpl();
  absl::Status StartUnshardImpl();
  absl::Status FinishUnshardImpl();
  absl::Status CheckNoPendingUnshard(absl::string_view op) const;
  absl::Status ReshardImpl(bool free_unsharded);
  absl::Status PostBackwardImpl(bool sync_gradients, absl::string_view op);
  absl::Status StartReduceGradImpl();
  absl::Status FinishReduceGradImpl();
  absl::Status UnshardGrad();
  absl::Status PrepareGradientForBackward();
  absl::Status ZeroUngradedSegments(BufferRef grad);
  absl::Status AccumulateShardedGrad(TrackedBuffer new_grad);
  absl::Status CastShardedGradTo(DType dtype);
  absl::Status Wait(std::unique_ptr<Work> work, absl::string_view what);
  // Stream-ordered: makes `stream` wait for `work` and keeps the work for
  // the host's check in CheckCollectives.
  absl::Status StreamWaitsFor(std::unique_ptr<Work> work, Stream stream,
                              absl::string_view what);
  // The host waits for the oldest collectives kept by StreamWaitsFor until
  // at most `keep` remain; the first failure, named.
  absl::Status CheckCollectives(size_t keep = 0);
  // `status` prefixed with the handle's name and `what` (OK stays OK).
  absl::Status Named(const absl::Status& status, absl::string_view what) const;
  // CollectiveOptions::stream for `stream` (stream-ordered only).
  std::optional<DeviceStream> Native(Stream stream) const;
  // Work issued on `waiter` from now on waits for the work issued on `on`
  // so far (nothing when they are the same stream).
  absl::Status StreamWaits(Stream waiter, Stream on);
  // The host waits for the work issued on `stream` so far.
  absl::Status HostWaitsFor(Stream stream);
  // RecordStream of `buffer` for `stream` (when allocated).
  absl::Status UsedBy(const TrackedBuffer& buffer, Stream stream);

  // The layout, owned or shared (Create's overloads), and a reference to it.
  const std::shared_ptr<const FlatParamLayout> layout_storage_;
  const FlatParamLayout& layout_;
  Communicator* const shard_group_;
  Communicator* const replicate_group_;
  DeviceOps* const device_;
  const HandleOptions options_;
  const int rank_;
  const int world_size_;
  int dp_world_size_ = 1;
  DType param_dtype_;
  DType reduce_dtype_;
  double predivide_ = 1;
  double postdivide_ = 1;
  // options.divide_in_collectives, or implied where it is bitwise the same.
  bool divide_in_collectives_ = false;
  // See "Device work and streams".
  bool stream_ordered_ = false;
  // The local shard may have been written on the compute stream since the
  // unshard stream last waited for it.
  bool local_shard_written_ = true;
  // Stream-ordered collectives the host has not waited for yet, and what
  // they were, oldest first; at most kMaxUncheckedCollectives.
  static constexpr size_t kMaxUncheckedCollectives = 4;
  std::deque<std::pair<std::unique_ptr<Work>, std::string>> unchecked_;

  MemoryTracker tracker_;
  HandleTrainingState state_ = HandleTrainingState::kIdle;
  bool unsharded_ = false;
  int64_t view_epoch_ = 0;
  int64_t grad_epoch_ = 0;
  // The current unsharded flat parameter (unpadded numel) while unsharded_.
  BufferRef unsharded_ref_;

  // PyTorch's `_local_shard` (owned, or the caller's in local_shard_ref_).
  TrackedBuffer local_shard_;
  BufferRef local_shard_ref_;
  // `_mp_shard`: param_dtype shard on the compute device.
  TrackedBuffer mp_shard_;
  // CPU offload: the compute-device copy of the local shard, alive during an
  // unshard (and for NO_SHARD until the reshard, as the unsharded parameter).
  TrackedBuffer offload_copy_;
  // `_full_param_padded` (unsharded dtype) and
  // `_full_prec_full_param_padded` (parameters' dtype, summon under mixed
  // precision).
  TrackedBuffer full_param_padded_;
  TrackedBuffer full_prec_full_param_padded_;
  // The unsharded gradient (param_dtype; padded for sharded strategies).
  TrackedBuffer unsharded_grad_;
  // The sharded gradient without offload; `_cpu_grad` with offload, plus the
  // low-precision host copy exposed under keep_low_precision_grads.
  TrackedBuffer sharded_grad_;
  TrackedBuffer cpu_grad_;
  TrackedBuffer low_prec_cpu_grad_;
  bool has_sharded_grad_ = false;

  // PyTorch's `_fully_sharded_module.training`.
  bool training_ = true;
  // Per original parameter: `requires_grad` (the layout's, until
  // SetRequiresGrad) and PyTorch's `_is_grad_none_mask`.
  std::vector<char> requires_grad_;
  std::vector<char> grad_none_;

  // An unshard started and not finished: the all-gather (null when faked),
  // its output and input buffers, and where the output goes when done.
  struct PendingUnshard {
    std::unique_ptr<Work> work;
    std::optional<TrackedBuffer> padded;
    TrackedBuffer copy;      // CPU offload: the shard's device copy (input)
    TrackedBuffer mp_shard;  // mixed precision: the low-precision input
    TrackedBuffer* target = nullptr;  // full_param_padded_ or full-precision
  };
  std::optional<PendingUnshard> pending_unshard_;
  // A reduction started and not finished: the last collective issued (null
  // when faked), its input (sharded strategies) and output, and the options
  // of the hybrid all-reduce that follows the reduce-scatter, and whether
  // that is issued already (stream-ordered: `work` is then the all-reduce).
  struct PendingReduce {
    std::unique_ptr<Work> work;
    TrackedBuffer input;
    TrackedBuffer shard;
    ReduceOptions second;
    bool all_reduce_issued = false;
  };
  std::optional<PendingReduce> pending_reduce_;

  // Summon bookkeeping.
  SummonOptions summon_;
  // The summoned gradient: padded unsharded (sharded strategies) or none
  // (NO_SHARD uses the sharded gradient); and the host copy of the full
  // parameter under offload_to_cpu.
  TrackedBuffer summon_grad_;
  bool summon_has_grad_ = false;
  TrackedBuffer summon_host_param_;
  bool summon_writeback_ = false;
  bool summon_free_at_end_ = false;
};

}  // namespace flatparam

#endif  // FLATPARAM_HANDLE_H_
