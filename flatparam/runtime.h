// FsdpRuntime: the model-level FSDP runtime on one rank, PyTorch's FSDP root
// state and `_runtime_utils.py` for a C++ trainer that runs its own forward
// and backward. It owns one FlatParamHandle (flatparam/handle.h) per flat
// parameter of a ModelLayout and drives them as FSDP's hooks do: lazy root
// initialization, the execution order, forward and backward prefetch under a
// limit on all-gathers in flight, reductions that overlap the backward,
// no_sync, the final callback that finalizes every unit, gradient clipping,
// and memory and traffic accounting summed over the units.
//
//   // On every rank of `world`:
//   FLATPARAM_ASSIGN_OR_RETURN(
//       std::unique_ptr<FsdpRuntime> rt,
//       FsdpRuntime::CreateFromNamedParams(layout, params_by_fqn, &world,
//                                          &device, handle_options, options));
//   // One iteration, the caller's forward and backward around the hooks
//   // (units are indices into layout.flat_params(); 0 is the root "" here):
//   FLATPARAM_RETURN_IF_ERROR(rt->PreForward(0));   // root: lazy init
//   FLATPARAM_RETURN_IF_ERROR(rt->PreForward(1));   // may prefetch unit 2
//   ... read rt->Param("layers.0.w") ...
//   FLATPARAM_RETURN_IF_ERROR(rt->PostForward(1));
//   ...
//   FLATPARAM_RETURN_IF_ERROR(rt->PostForward(0));
//   FLATPARAM_RETURN_IF_ERROR(rt->PreBackward(0));  // may prefetch the last
//   ...                                              // layer (BACKWARD_PRE)
//   FLATPARAM_RETURN_IF_ERROR(rt->PreBackward(1));
//   ... rt->AccumulateGrad("layers.0.w", g) or add into rt->GradView(...) ...
//   FLATPARAM_RETURN_IF_ERROR(rt->PostBackward(1));  // reduction started
//   ...
//   FLATPARAM_RETURN_IF_ERROR(rt->PostBackward(0));
//   FLATPARAM_RETURN_IF_ERROR(rt->FinalizeBackward());  // every unit
//   FLATPARAM_ASSIGN_OR_RETURN(double norm, rt->ClipGradNorm(1.0));
//   ... optimizer on rt->handle(u).sharded_param() / sharded_grad() ...
//   FLATPARAM_RETURN_IF_ERROR(rt->ZeroGrad());
//
// Iterations. An iteration runs from the first PreForward after creation or
// after FinalizeBackward (PyTorch's `_root_pre_forward`; the first one is
// the lazy-init point) to the next FinalizeBackward (PyTorch's
// `_post_backward_final_callback`), which also ends a forward-only pass. The
// first PreBackward ends the forward; a PreForward/PostForward after it is
// an activation-checkpointing recompute: it drives the handle only (no
// order recording or check, no forward prefetch). Inside the unit's own
// backward (after its PreBackward: non-reentrant checkpointing) the handle
// does nothing; before it (reentrant) the unit unshards and reshards as in
// a forward (handle.h).
//
// The root unit is the one whose module prefix is "" (the root module's
// own parameters); its PostForward keeps the unsharded parameter for the
// backward (handle.h's PostForward(is_root)). A layout without one has no
// root handle, as in PyTorch when the root FSDP module owns no parameter.
//
// Execution order (PyTorch's `_ExecOrderData`):
//   * The pre-forward order is recorded in the first iteration with a
//     backward (the first PreForward of each unit in training mode, see
//     FlatParamHandle::SetTraining) and fixed by its FinalizeBackward;
//     forward prefetch follows it, so there is no forward prefetch before
//     (as in PyTorch). A forward-only pass (validation) neither records
//     nor fixes it, and units in eval mode are neither recorded nor
//     checked, as PyTorch records and checks only in training. Once fixed,
//     each unit's first PreForward in training is checked against it; a
//     deviation (a different unit, or more units) is handled by
//     RuntimeOptions::exec_order: ignored, a warning on stderr (once per
//     runtime, as PyTorch warns once) or a FailedPrecondition before
//     anything changes. Every deviation is counted in stats(). A second
//     forward in one iteration (the PreForward of the unit that began the
//     iteration, the root when there is one, again before the backward)
//     is prefetched as the first is, and not checked again.
//   * The post-forward order is recorded in every iteration; the backward
//     order is its reverse, so backward prefetch follows what this
//     iteration's forward actually ran (PyTorch re-records it every
//     iteration too).
//
// Prefetch (a prefetch is the handle's StartUnshard; the unit's own
// PreForward/PreBackward finishes it, "consumes" it):
//   * forward_prefetch: PreForward(u), once u is unsharded, starts the
//     unshard of the next `prefetch_depth` units after u in the recorded
//     pre-forward order whose PreForward has not run in this iteration.
//   * BACKWARD_PRE: PreBackward(u), once u is unsharded (before the caller
//     computes u's backward), starts the next `prefetch_depth` units in the
//     backward order that ran forward and whose PreBackward has not run,
//     leaving out units whose PreBackward did not run in the last backward
//     (a frozen unit whose outputs need no gradient: PyTorch prefetches
//     only handles that will run their pre-backward unshard; the first
//     backward, with nothing learnt, prefetches them).
//   * BACKWARD_POST: the same at PostBackward(u), after u's reshard.
//   A candidate that is not IDLE, already unsharded or pending is skipped.
//   limit_all_gathers bounds the number of prefetches that all-gathered
//   (allocated a padded unsharded parameter) and were not consumed yet; a
//   prefetch that would exceed it is not issued (the unit's own pre-hook,
//   or a later prefetch once a slot is free, unshards it). Prefetches that
//   need no all-gather (NO_SHARD, a kept unsharded parameter) are not
//   limited. Every rank must run the same hooks in the same order, since
//   prefetching issues collectives. So for FULL_SHARD / HYBRID_SHARD with
//   k = min(prefetch_depth, limit_all_gathers), forward prefetch or
//   BACKWARD_PRE hold at most the root's, the running unit's and k more
//   units' unsharded parameters (runtime_test.cc derives the peak).
//
// Rate limiting (PyTorch's `_FreeEventQueue`). On a device whose streams
// run behind the host (CUDA, with stream-ordered collectives the host
// never waits for a collective), the host could issue every unit's
// all-gather far ahead of the kernels that free the earlier units'
// parameters, and device memory would grow without bound. So, with
// limit_all_gathers = L > 0, every reshard that frees an unsharded
// parameter records an event on the compute stream, and before an
// all-gather the host waits for the event of the free L frees back (the
// oldest of the last L) if there are L. Where the host already waits for
// every collective (the host-completed path) the event has passed and
// nothing blocks.
//
// Streams. The unshard stream waits for the compute stream once per
// iteration, at its first PreForward (PyTorch's root pre-forward
// `_wait_for_computation_stream`: the optimizer's updates of the local
// shards come first), and the handles are told so
// (FlatParamHandle::NoteUnshardStreamWaitedForCompute); within an
// iteration an all-gather therefore overlaps the kernels issued before it.
//
// Reductions. PostBackward(u) starts u's reduction (PostBackwardAsync), then
// finishes every earlier one still pending, so one reduction at a time
// overlaps the next unit's backward while the unsharded gradients of
// finished units are freed (FSDP2 waits for the previous reduce-scatter
// likewise); FinalizeBackward finishes the last. The overlap costs one
// unit's unsharded gradient over the blocking PostBackward.
//
// no_sync: SetRequireGradientSync(false), or a NoSync() scope, as FSDP's
// no_sync(): gradients accumulate unsharded and nothing is reduced. The
// setting in force when an iteration begins applies to the whole iteration.
//
// Where this differs from PyTorch FSDP (1.x API, torch 2.x), on purpose:
//   * BACKWARD_POST issues the prefetch's all-gather after u's reduction
//     (PostBackwardAsync reshards and starts the reduction in one call);
//     PyTorch issues the all-gather between the reshard and the
//     reduce-scatter.
//   * prefetch_depth > 1 prefetches every one of the next units (as FSDP2's
//     explicit prefetch lists); PyTorch's private `_forward_prefetch_limit`
//     / `_backward_prefetch_limit` prefetch only the one that many ahead.
//   * limit_all_gathers counts unconsumed prefetched all-gathers and skips a
//     prefetch over the limit; PyTorch's rate limiter blocks the CPU on the
//     event of the oldest of its last two frees (limit 2).
//   * ClipGradNorm computes norms in double and rounds each to float32
//     (PyTorch reduces in float32; for an all-NO_SHARD model it calls
//     torch.nn.utils.clip_grad_norm_, which works in the gradients' dtype),
//     returns the float32 norm (PyTorch casts it to the promoted gradient
//     dtype), and rejects a negative or NaN max_norm (PyTorch does not
//     check). See ClipGradNorm.
//
// Memory: the runtime owns its handles, the hybrid groups it makes and
// counting wrappers around the groups; `world` and `device` are the
// caller's and must outlive the runtime. Views (Param, GradView, ...) are
// the handles' (see handle.h for how long they stay valid).
//
// Thread-safety: one thread at a time (the rank's own, which also owns
// `world`).
#ifndef FLATPARAM_RUNTIME_H_
#define FLATPARAM_RUNTIME_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "comm/communicator.h"
#include "comm/flight_recorder.h"
#include "flatparam/base/buffer.h"
#include "flatparam/device/device.h"
#include "flatparam/handle.h"
#include "flatparam/layout.h"
#include "flatparam/memory_stats.h"
#include "flatparam/model_layout.h"

namespace flatparam {

// PyTorch's BackwardPrefetch (kNone is PyTorch's `None`).
enum class BackwardPrefetch : uint8_t { kNone, kBackwardPre, kBackwardPost };

// "NONE", "BACKWARD_PRE", "BACKWARD_POST".
absl::string_view BackwardPrefetchName(BackwardPrefetch prefetch);

// What a deviation from the first iteration's forward order does.
enum class ExecOrderCheck : uint8_t { kIgnore, kWarn, kError };

struct RuntimeOptions {
  // PyTorch's `forward_prefetch` (default False).
  bool forward_prefetch = false;
  // PyTorch's `backward_prefetch` (default BACKWARD_PRE).
  BackwardPrefetch backward_prefetch = BackwardPrefetch::kBackwardPre;
  // How many units ahead a prefetch reaches (>= 1).
  int prefetch_depth = 1;
  // Most prefetched all-gathers not yet consumed by their unit's pre-hook,
  // and the rate limiter's depth (see the file comment) (>= 0; 0 =
  // unlimited). PyTorch's limit_all_gathers=True (its default) allows two
  // in flight.
  int limit_all_gathers = 2;
  ExecOrderCheck exec_order = ExecOrderCheck::kWarn;
  // The runtime's own collectives: the hybrid groups' splits and
  // ClipGradNorm's all-reduce. The handles' are HandleOptions'.
  CollectiveOptions collective_options;
};

// Where a parameter lives: flat parameter `unit` (an index into
// ModelLayout::flat_params()), original parameter `index` of it. A tied
// (shared) name resolves to its primary, with `shared` set.
struct ParamLocation {
  int unit = 0;
  int index = 0;
  bool shared = false;
};

// Collective traffic through the runtime's groups. `bytes` is nccl-tests'
// size (all-gather output, reduce-scatter input, all-reduce buffer);
// `sent_bytes` what a ring algorithm sends per rank: bytes * (n-1)/n for
// all-gather and reduce-scatter, 2(n-1)/n for all-reduce.
struct CollectiveTraffic {
  int64_t calls = 0;
  int64_t bytes = 0;
  int64_t sent_bytes = 0;
};

// Every buffer collective the handles and ClipGradNorm issue through the
// shard and replicate groups (not the groups' creation).
struct CommStats {
  CollectiveTraffic all_gather;
  CollectiveTraffic reduce_scatter;
  CollectiveTraffic all_reduce;

  int64_t total_bytes() const {
    return all_gather.bytes + reduce_scatter.bytes + all_reduce.bytes;
  }
  int64_t total_sent_bytes() const {
    return all_gather.sent_bytes + reduce_scatter.sent_bytes +
           all_reduce.sent_bytes;
  }
};

struct RuntimeStats {
  // Iterations ended by FinalizeBackward.
  int64_t iterations = 0;
  // Prefetches started (StartUnshard), and those of them that all-gathered.
  int64_t prefetches = 0;
  int64_t prefetched_all_gathers = 0;
  // Prefetches not issued because of limit_all_gathers.
  int64_t prefetches_over_limit = 0;
  // Most prefetched all-gathers unconsumed at once.
  int max_all_gathers_in_flight = 0;
  // Forward pre-hooks that deviated from the recorded order.
  int64_t exec_order_deviations = 0;
};

class FsdpRuntime {
 public:
  // Creates the runtime of `layout` on this rank; collective over `world`
  // for the hybrid strategies (it splits `world` with MakeHybridGroups into
  // shard groups of layout.options().world_size consecutive ranks and
  // replicate groups); otherwise `world` is the shard group and its size
  // must be the layout's world size. `initial_params[u][i]` is parameter i
  // of flat parameter u (host memory, the layout's dtype and numel; every
  // rank passes the same values), as for FlatParamHandle::Create.
  //
  // InvalidArgument, naming the values, for: a null `world` or `device`;
  // prefetch_depth < 1; limit_all_gathers < 0; a world size that does not
  // match (or, hybrid, is not a multiple of) the layout's; initial_params
  // that do not have one entry per flat parameter and per parameter; and
  // every error of FlatParamHandle::Create, prefixed with the unit.
  static absl::StatusOr<std::unique_ptr<FsdpRuntime>> Create(
      const ModelLayout& layout,
      absl::Span<const std::vector<ConstBufferRef>> initial_params,
      Communicator* world, DeviceOps* device,
      const HandleOptions& handle_options = {},
      const RuntimeOptions& options = {});

  // The same with each unit's initial parameters asked for when its handle
  // is made, in unit order (the handle copies what it keeps), then
  // `release(unit)` (if set): so a caller can materialise one unit's
  // parameters at a time (a model initialised on the meta device) and hold
  // no more than one unit's full values besides the shards. An error from
  // `unit_params` is returned with the unit; so is a list of the wrong
  // length. Otherwise as Create.
  using UnitParamsFn =
      std::function<absl::StatusOr<std::vector<ConstBufferRef>>(int unit)>;
  static absl::StatusOr<std::unique_ptr<FsdpRuntime>> CreateUnitByUnit(
      const ModelLayout& layout, const UnitParamsFn& unit_params,
      const std::function<void(int unit)>& release, Communicator* world,
      DeviceOps* device, const HandleOptions& handle_options = {},
      const RuntimeOptions& options = {});
  // The same, sharing `layout` (immutable) with the runtime and its handles
  // instead of copying it: thousands of runtimes of one model in one
  // process (fsdp plan --simulate's ranks) hold one layout.
  // InvalidArgument for a null layout.
  static absl::StatusOr<std::unique_ptr<FsdpRuntime>> CreateUnitByUnit(
      std::shared_ptr<const ModelLayout> layout,
      const UnitParamsFn& unit_params,
      const std::function<void(int unit)>& release, Communicator* world,
      DeviceOps* device, const HandleOptions& handle_options = {},
      const RuntimeOptions& options = {});

  // The same with the initial parameters by fully-qualified name (as a
  // state dict): every non-tied parameter of layout.spec() must be present;
  // a tied parameter's name may be present and is ignored (it shares its
  // primary's storage). InvalidArgument naming a missing or unknown fqn.
  static absl::StatusOr<std::unique_ptr<FsdpRuntime>> CreateFromNamedParams(
      const ModelLayout& layout,
      const std::map<std::string, ConstBufferRef>& params, Communicator* world,
      DeviceOps* device, const HandleOptions& handle_options = {},
      const RuntimeOptions& options = {});

  ~FsdpRuntime();
  FsdpRuntime(const FsdpRuntime&) = delete;
  FsdpRuntime& operator=(const FsdpRuntime&) = delete;

  // ---- Configuration ----
  const ModelLayout& layout() const { return layout_; }
  const RuntimeOptions& options() const { return options_; }
  int num_units() const { return static_cast<int>(handles_.size()); }
  // The unit of module prefix "" (see the file comment), if any.
  std::optional<int> root_unit() const;
  // The unit of module prefix `name` ("" for the root, "layers.3", ...).
  // NotFound naming it.
  absl::StatusOr<int> FindUnit(absl::string_view name) const;
  // Unit `unit`'s handle. REQUIRES: 0 <= unit < num_units(). The caller may
  // use it directly (sharded_param() for the optimizer, SetGradNone,
  // SetRequiresGrad, ...); hooks called on it directly bypass the runtime's
  // bookkeeping (their memory is still counted by memory()).
  FlatParamHandle& handle(int unit) { return *handles_[unit]; }
  const FlatParamHandle& handle(int unit) const { return *handles_[unit]; }
  // The groups the handles use (counted; see comm_stats()). The replicate
  // group is null unless the strategy is hybrid.
  Communicator& shard_group() const { return *shard_group_; }
  Communicator* replicate_group() const { return replicate_group_.get(); }

  // ---- Hooks (see the file comment). `unit` must be in [0, num_units()):
  // InvalidArgument otherwise. Handle errors are returned with the unit.
  // PyTorch's `_pre_forward` (and, for the first call of an iteration,
  // `_root_pre_forward`): unshards `unit` (finishing its prefetch) and,
  // with forward_prefetch, prefetches. FailedPrecondition, before anything
  // changes, for an execution-order deviation under ExecOrderCheck::kError.
  absl::Status PreForward(int unit);
  // Reshards `unit` (keeping the root's unsharded parameter).
  absl::Status PostForward(int unit);
  // Unshards `unit` and prepares its unsharded gradient; with BACKWARD_PRE,
  // prefetches. FailedPrecondition when no forward ran in this iteration.
  // Several backwards per forward (`loss1.backward(retain_graph=True);
  // loss2.backward()`): after a backward's FinalizeBackward and before the
  // next PreForward, PreBackward begins another backward over the same
  // forward, as PyTorch re-arms its pre-backward hooks: units unshard
  // again, BACKWARD_PRE/POST prefetch over the forward's order, and each
  // reduction adds to the sharded gradient the previous backward left (as
  // a micro-batch does), ending with its own FinalizeBackward. The sum is
  // bitwise that of two iterations over the same parameters without
  // ZeroGrad between them.
  absl::Status PreBackward(int unit);
  // Reshards `unit` and starts its reduction (unless no_sync), finishes
  // earlier reductions; with BACKWARD_POST, prefetches.
  absl::Status PostBackward(int unit);
  // PyTorch's post-backward final callback: FinalizeBackward on every
  // handle, in unit order, including units that took no part in this
  // backward (skipped layers or experts): a pending prefetch or reduction
  // completes, anything still unsharded is resharded (a catch-all), and an
  // unsharded gradient whose PostBackward never ran is dropped (or kept
  // under no_sync), as handle.h's FinalizeBackward documents. Ends the
  // iteration. Every handle is finalized even when one fails; the first
  // error is returned. OK outside an iteration (nothing to do but the
  // handles' no-op finalize).
  absl::Status FinalizeBackward();

  // True between an iteration's first PreForward and its FinalizeBackward.
  bool in_iteration() const { return phase_ != Phase::kIdle; }
  // The recorded pre-forward order (units); empty until the first
  // iteration's first PreForward, fixed after its FinalizeBackward.
  const std::vector<int>& forward_order() const { return forward_order_; }
  // This iteration's post-forward order (the backward runs its reverse).
  const std::vector<int>& post_forward_order() const {
    return post_forward_order_;
  }

  // ---- no_sync ----
  // Takes effect at the next iteration's first PreForward.
  void SetRequireGradientSync(bool sync) { require_sync_ = sync; }
  bool require_gradient_sync() const { return require_sync_; }
  // RAII form: gradient sync off while the scope lives, then the previous
  // setting back (PyTorch's `with model.no_sync():`).
  class NoSyncScope {
   public:
    explicit NoSyncScope(FsdpRuntime* runtime)
        : runtime_(runtime), previous_(runtime->require_sync_) {
      runtime_->require_sync_ = false;
    }
    ~NoSyncScope() {
      if (runtime_ != nullptr) runtime_->require_sync_ = previous_;
    }
    NoSyncScope(NoSyncScope&& other) noexcept
        : runtime_(other.runtime_), previous_(other.previous_) {
      other.runtime_ = nullptr;
    }
    NoSyncScope(const NoSyncScope&) = delete;
    NoSyncScope& operator=(const NoSyncScope&) = delete;
    NoSyncScope& operator=(NoSyncScope&&) = delete;

   private:
    FsdpRuntime* runtime_;
    bool previous_;
  };
  NoSyncScope NoSync() { return NoSyncScope(this); }

  // ---- Parameters by fully-qualified name ----
  // NotFound naming `fqn` when no unit holds it.
  absl::StatusOr<ParamLocation> Find(absl::string_view fqn) const;
  // The handle's views of the parameter Find(fqn) names (handle.h's Param,
  // GradView, ShardedGradView).
  absl::StatusOr<OrigParamView> Param(absl::string_view fqn) const;
  absl::StatusOr<BufferRef> GradView(absl::string_view fqn) const;
  absl::StatusOr<std::optional<BufferRef>> ShardedGradView(
      absl::string_view fqn) const;
  // handle.h's AccumulateGrad, memory-tracked.
  absl::Status AccumulateGrad(absl::string_view fqn, ConstBufferRef grad);

  // ZeroGrad on every handle (between iterations).
  absl::Status ZeroGrad(bool set_to_none = true);

  // ---- Gradient clipping ----
  // FullyShardedDataParallel.clip_grad_norm_ (torch 2.x): collective over
  // the shard group for the sharded strategies, local for NO_SHARD. Between
  // iterations only (FailedPrecondition otherwise); InvalidArgument unless
  // norm_type > 0 (infinity allowed; below 1 the same formula, as
  // clip_grad_norm_ takes it) and max_norm >= 0 (not NaN).
  //   1. The gradients: per original parameter (ShardedGradView) when the
  //      layout aligns addresses (PyTorch's use_orig_params=True), else
  //      each whole sharded flat gradient; None ones are skipped.
  //   2. local = ||(||g||_p for each gradient)||_p, each norm rounded to
  //      float32 (PyTorch's `_get_grad_norm`, forced to float32); sharded
  //      strategies' gradients are "sharded", NO_SHARD's "nonsharded".
  //   3. p = inf: total = max(sharded, nonsharded), all-reduced with MAX
  //      over the shard group; else total = (allreduce_sum(sharded^p) +
  //      nonsharded^p)^(1/p) in float32, the all-reduce over the shard
  //      group only: the non-sharded norm is added locally since
  //      all-reducing it "would count it an extra world-size-many times",
  //      and for the hybrid strategies the replicate group is not reduced
  //      over, since every replica holds the same gradient and summing
  //      over replicas would count the norm replicate-size times (PyTorch
  //      reduces over `self.process_group`, the shard group).
  //   4. coef = min(max_norm / (total + 1e-6), 1) in float32 (PyTorch's
  //      reciprocal-then-multiply), cast to each gradient's dtype, and every
  //      gradient of step 1 is multiplied by it (also when it is 1).
  // Device work runs on the handles' compute stream; the host waits for it
  // (reading the norms; PyTorch avoids that sync) before returning.
  // Returns the float32 total norm.
  absl::StatusOr<double> ClipGradNorm(double max_norm, double norm_type = 2.0);

  // ---- Statistics ----
  // Summed over the handles: current[c] is the sum of the handles' current
  // bytes now; peak[c] (and compute_peak/offload_peak) the true model-wide
  // peak of the sum, not the sum of per-handle peaks: every handle reports
  // each allocation and free to one model-wide tracker as it happens
  // (FlatParamHandle::ForwardMemoryTo), direct calls on handles included.
  // (A handle's own memory().peak covers only the runtime's last call on
  // it: the runtime resets it before each.)
  MemoryStats memory() const;
  // Sets every peak to the current value.
  void ResetPeakMemory();
  const CommStats& comm_stats() const { return *comm_stats_; }
  const RuntimeStats& stats() const { return stats_; }

 private:
  enum class Phase : uint8_t { kIdle, kForward, kBackward };

  FsdpRuntime(std::shared_ptr<const ModelLayout> layout, DeviceOps* device,
              const RuntimeOptions& options);

  absl::Status CheckUnit(absl::string_view op, int unit) const;
  absl::Status WithUnit(absl::Status status, absl::string_view op,
                        int unit) const;
  std::string UnitName(int unit) const;
  // Names `unit` and `phase` in the flight recorder for the collectives
  // issued in the scope (comm/flight_recorder.h).
  ScopedCollectiveContext Context(int unit, CollectivePhase phase) const;
  // Runs `call` on unit's handle with model-wide peak tracking.
  absl::Status Track(int unit,
                     const std::function<absl::Status(FlatParamHandle&)>& call);
  void BeginIteration();
  // A backward over the previous forward (PreBackward's retained graph).
  absl::Status BeginRetainedBackward();
  // The first unshard of an iteration follows the optimizer's (and the
  // caller's) work on the compute stream.
  absl::Status UnshardStreamWaitsForCompute();
  // The deviation of `unit` at the current forward position, if any.
  std::optional<std::string> OrderDeviation(int unit) const;
  absl::Status Prefetch(const std::vector<int>& candidates,
                        CollectivePhase phase);
  // A backward prefetch candidate: its PreBackward has not run in this
  // backward, and did in the last one.
  bool WillRunPreBackward(int unit) const;
  // Runs `call` on unit's handle (Track) with the rate limiter around it:
  // before, if the call will all-gather, the host waits for the oldest
  // free event when there are limit_all_gathers of them; after, if it
  // freed the unsharded parameter, a free event is recorded.
  absl::Status Limited(
      int unit, const std::function<absl::Status(FlatParamHandle&)>& call);
  absl::Status AllReduceScalar(float* value, ReduceOp op);

  // The layout, owned or shared (CreateUnitByUnit's overloads), and a
  // reference to it.
  const std::shared_ptr<const ModelLayout> layout_storage_;
  const ModelLayout& layout_;
  DeviceOps* const device_;
  const RuntimeOptions options_;

  HybridGroups groups_;
  // The world's flight recorder (null: none). Not owned.
  FlightRecorder* recorder_ = nullptr;
  std::unique_ptr<CommStats> comm_stats_;
  std::unique_ptr<Communicator> shard_group_;
  std::unique_ptr<Communicator> replicate_group_;
  // Memory: the model-wide total the handles forward to. Declared before
  // them: their buffers are freed into it when they are destroyed.
  MemoryTracker memory_;
  std::vector<std::unique_ptr<FlatParamHandle>> handles_;
  std::optional<int> root_;
  std::map<std::string, ParamLocation, std::less<>> params_by_fqn_;
  std::map<std::string, int, std::less<>> units_by_name_;

  // Settings.
  bool require_sync_ = true;

  // The iteration.
  Phase phase_ = Phase::kIdle;
  // A backward ran since the last forward began: another may follow
  // (retain_graph) until the next PreForward.
  bool backward_may_rerun_ = false;
  bool sync_ = true;
  bool order_fixed_ = false;
  bool warned_order_ = false;
  std::vector<int> forward_order_;
  // Position of each unit in forward_order_ (-1: not in it).
  std::vector<int> forward_index_;
  // Units whose first PreForward of this iteration has run, in order.
  int forward_position_ = 0;
  // The unit whose PreForward began the iteration, and the forwards begun
  // after the first (its PreForward again before the backward).
  int first_forward_unit_ = -1;
  int forward_pass_ = 0;
  std::vector<int> post_forward_order_;
  std::vector<int> post_forward_index_;
  std::vector<char> ran_pre_forward_;
  std::vector<char> ran_pre_backward_;
  // Units whose PreBackward ran in the last backward (all, before the
  // first): backward prefetch targets only those, as PyTorch prefetches
  // only handles that will run their pre-backward unshard (a frozen unit
  // whose outputs need no gradient, say a frozen embedding, never does).
  std::vector<char> last_backward_ran_;
  // Prefetched all-gathers not yet consumed, and reductions in flight
  // (started first first).
  std::vector<int> prefetched_;
  std::vector<int> reducing_;

  // The rate limiter's free events, oldest first (compute stream).
  std::deque<Event> free_events_;

  RuntimeStats stats_;
};

}  // namespace flatparam

#endif  // FLATPARAM_RUNTIME_H_
