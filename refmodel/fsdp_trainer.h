// Sharded (FSDP) training of the reference model (refmodel/mlp_model.h)
// through the model-level runtime (FsdpRuntime, flatparam/runtime.h), on
// any Communicator backend: the system under test of the proof that sharded
// training equals unsharded training (TrainReference,
// refmodel/reference_trainer.h).
//
//   // On every rank of `world` (the simulator, MPI, NCCL, ...):
//   FsdpTrainOptions options;
//   options.strategy = ShardingStrategy::kFullShard;
//   options.steps = 3;
//   HostDeviceOps device;
//   FLATPARAM_ASSIGN_OR_RETURN(FsdpRankResult r,
//                              TrainFsdpOnRank(world, device, options));
//   // Bitwise equal on the simulator and MPI:
//   FLATPARAM_ASSIGN_OR_RETURN(TrainOptions ref,
//                              ReferenceOptionsFor(options, world.size()));
//   FLATPARAM_ASSIGN_OR_RETURN(TrainResult want,
//                              TrainReference(options.model, ref));
//   assert(r.params == want.params && r.losses == want.losses);
//
// What one rank does, as PyTorch FSDP does it:
//   * Layout: ModelLayout of the model's spec (units "" and "layers.i") for
//     the shard group's size (the hybrid strategies: `shard_group_size`;
//     otherwise the world), the strategy, `align_addresses`, and alignment
//     for param_dtype.
//   * One FsdpRuntime over the layout (FsdpRuntime::CreateFromNamedParams
//     from the model's InitParams(): every rank computes the same full
//     parameters and keeps its shard; the runtime splits the world into
//     shard and replicate groups for the hybrid strategies), with the
//     prefetch settings of FsdpTrainOptions.
//   * Each micro-batch m of step k is one runtime iteration: the rank's
//     local batch is MakeBatch(data_seed, vocab, k, m, rank * B, B) with B =
//     global_batch / W, and ReferenceModel::ForwardBackward runs through a
//     ParamAccess that maps the model's units onto the runtime's hooks:
//         BeginUnit(u, forward)   PreForward(u)    (may prefetch)
//         EndUnit(u, forward)     PostForward(u)   (the root "" stays
//                                                   unsharded)
//         BeginUnit(u, backward)  PreBackward(u)   (may prefetch)
//         EndUnit(u, backward)    PostBackward(u)  (starts u's reduction,
//                                                   finishes the previous)
//     and then FinalizeBackward() (FSDP's final callback, on every unit).
//     Gradient sync (SetRequireGradientSync) is on for every micro-batch
//     with kShardedAccumulation and only for the last with kNoSync
//     (no_sync). Param() is the runtime's view of the unsharded parameter
//     (float32 on the host: in place; otherwise a float32 host copy);
//     Grad() is its GradView (float32 on the host: in place), or a zeroed
//     float32 host buffer whose contents EndUnit casts to param_dtype and
//     adds with AccumulateGrad, as autograd accumulates a low-precision
//     gradient.
//   * After the micro-batches: the optimizer steps each of the runtime's
//     handles' sharded parameter with its sharded gradient and its own state
//     (1-D tensors of the shard's size, "step" 0-d), then the runtime's
//     ZeroGrad(set_to_none).
//   * The step's loss: the ranks' per-micro-batch losses are all-gathered
//     over the world and folded in rank order as TrainReference defines it.
//   * At the end, every sharded parameter and state tensor is all-gathered
//     over the shard group and unflattened per original parameter
//     (alignment and right padding dropped), in TrainResult's format.
//
// Memory and traffic are the runtime's (FsdpRuntime::memory(), the rank's
// exact per-category peak over all handles; comm_stats(), the handles'
// collectives). ExpectedPeakMemory() is the closed form of that peak; see
// there.
//
// Accuracy (proven by verify/training_equivalence_test.cc, which states the
// bounds in full): on the simulator and MPI, float32 runs equal
// ReferenceOptionsFor()'s TrainReference bit for bit, and so do bf16/fp16
// runs, whose reference emulates the same mixed precision, whatever the
// prefetch settings (prefetching moves collectives, not arithmetic).
// Against float32 training a mixed-precision run's one-step gradient stays
// within (gamma_K(u_low) + gamma_K(2^-24)) * sum |local gradients| / W per
// element (K = 2M + W + 2 roundings), and its AdamW parameters within
// AdamWDivergenceBound (refmodel/optimizer.h).
//
// Thread-safety: TrainFsdpOnRank runs on its rank's thread and shares
// nothing with other ranks; ranks may run concurrently (threads, processes).
#ifndef FLATPARAM_REFMODEL_FSDP_TRAINER_H_
#define FLATPARAM_REFMODEL_FSDP_TRAINER_H_

#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "comm/communicator.h"
#include "flatparam/base/dtype.h"
#include "flatparam/device/device.h"
#include "flatparam/flatten.h"
#include "flatparam/layout.h"
#include "flatparam/memory_stats.h"
#include "flatparam/model_layout.h"
#include "flatparam/runtime.h"
#include "refmodel/mlp_model.h"
#include "refmodel/optimizer.h"
#include "refmodel/reference_trainer.h"

namespace flatparam {
namespace refmodel {

// One rank's sharded training state: what it needs to go on training, and
// what a sharded checkpoint stores for it
// (flatparam/checkpoint/training_state.h's RankState). Indexed like
// FsdpModelLayout()'s flat parameters (the units in model order: the root, then
// the layers).
struct FsdpRankState {
  // This rank's padded shard of each float32 flat parameter:
  // layout.sharded_numel() elements (the whole padded flat parameter for
  // NO_SHARD), padding included, as FlatParamHandle::sharded_param() holds it.
  std::vector<HostTensor> flat_params;
  // Each flat parameter's optimizer state as the sharded optimizer steps it:
  // buffers 1-D of the shard's numel, AdamW's "step" 0-d.
  std::vector<OptimizerState> optimizer;
};

struct FsdpTrainOptions {
  Config model;
  ShardingStrategy strategy = ShardingStrategy::kFullShard;
  // The hybrid strategies: ranks per shard group (a node); must divide the
  // world size. Must be 0 for the other strategies.
  int shard_group_size = 0;
  // PyTorch's use_orig_params=True padding (LayoutOptions).
  bool align_addresses = false;
  // Mixed precision (HandleOptions): unset is float32.
  std::optional<DType> param_dtype;
  std::optional<DType> reduce_dtype;
  bool cpu_offload = false;

  // The runtime's prefetching (RuntimeOptions, flatparam/runtime.h), with
  // PyTorch's defaults: BACKWARD_PRE, no forward prefetch, one unit ahead,
  // at most two prefetched all-gathers in flight. They change when
  // parameters are all-gathered and how many are unsharded at once (see
  // ExpectedPeakMemory), never the results.
  bool forward_prefetch = false;
  BackwardPrefetch backward_prefetch = BackwardPrefetch::kBackwardPre;
  // Units a prefetch reaches ahead (>= 1).
  int prefetch_depth = 1;
  // Prefetched all-gathers not yet consumed (>= 0; 0 = unlimited).
  int limit_all_gathers = 2;
  // Give the handles their own unshard and post-backward streams
  // (HandleStreams, PyTorch's `_unshard_stream` and `_post_backward_stream`)
  // instead of running everything on the device's stream 0: on devices
  // with asynchronous streams (CUDA) the collectives and their casts then
  // overlap the compute, ordered by events. Never changes the results.
  bool separate_streams = false;

  int64_t steps = 1;
  // Samples per micro-batch over all ranks; a multiple of the world size.
  int64_t global_batch = 8;
  int64_t micro_batches = 1;
  AccumulationMode accumulation = AccumulationMode::kShardedAccumulation;
  // Activation checkpointing of every layer: its forward (PreForward and
  // PostForward too) runs again inside its backward, as PyTorch's
  // non-reentrant `checkpoint` does (ReferenceModel::ForwardBackward's
  // recompute_layers). Results are bitwise those without it.
  bool recompute_activations = false;
  OptimizerOptions optimizer = SgdOptions{};
  uint64_t data_seed = 0;
  // Start from these parameters instead of the model's InitParams()
  // (ReferenceModel::CheckParams must accept them).
  std::optional<std::map<std::string, HostTensor>> initial_params;

  // Resuming. Step k of this run trains on data step first_step + k
  // (MakeBatch(data_seed, vocab, first_step + k, ...)), so a run of K steps
  // resumed at first_step = K from the state of K earlier steps sees the
  // data an unbroken run of 2K steps sees.
  int64_t first_step = 0;
  // This rank's own sharded state to start from (FsdpRankResult::state of
  // an earlier run with the same layout and world size, or a checkpoint's
  // rank file for this rank's shard-group rank), instead of
  // initial_params/InitParams() and empty optimizer state. Unlike the other
  // options it differs per rank. No collective is needed to load it.
  std::optional<FsdpRankState> initial_state;
  // Whether to all-gather the final parameters and optimizer state into
  // FsdpRankResult::params/optimizer_state (collective over the shard
  // group). FsdpRankResult::state is filled either way.
  bool gather_results = true;

  // Verification: after creating the handles, write this value into every
  // padding element (alignment, world-size and right padding) of every
  // local shard. With NaN, bitwise equality with TrainReference shows that
  // padding never reaches a parameter, a gradient or the loss.
  std::optional<float> padding_fill;
  // Also all-gather the last step's reduced gradients
  // (FsdpRankResult::grads).
  bool gather_grads = false;
  // Fault injection, for tests of desynchronised ranks: when it returns
  // true for (data step, unit), this rank runs that unit's forward without
  // FSDP's hooks, as a rank that took another branch around the unit
  // would (no unshard; its parameters read as zeros). The ranks' collective
  // sequences then differ, which the backends' checks and flight records
  // must show (`fsdp train --fault-skip-forward`). The runtime's
  // execution-order check, which would stop the rank first from the
  // second iteration on, only warns while this is set.
  std::function<bool(int64_t step, absl::string_view unit)>
      skip_forward_for_testing;

  // Called on every rank after each step's optimizer update (and the
  // step's loss all-gather), with the number of steps this run has done so
  // far (1..steps; the global step the state holds is first_step +
  // steps_done) and `copy_state`, which returns a host copy of the rank's
  // current sharded state (FsdpRankResult::state's format) when called:
  // only a hook that needs the state pays for the copy, and the copy is
  // the hook's to keep (an asynchronous checkpoint's snapshot). copy_state
  // is valid only during the call. A non-OK status stops training and is
  // returned, prefixed "after step S" (S = first_step + steps_done - 1,
  // the data step just trained). The hook may issue collectives
  // (such as a collective checkpoint save) if it does so alike on every
  // rank; it does not change the training, which stays bitwise the same.
  // Runs on the rank's thread.
  std::function<absl::Status(
      int64_t steps_done,
      absl::FunctionRef<absl::StatusOr<FsdpRankState>()> copy_state)>
      after_step;

  // Called on every rank after each step's loss all-gather with the global
  // step just trained and its loss (FsdpRankResult::losses' value): for
  // progress lines. Runs on the rank's thread; it must not issue
  // collectives.
  std::function<void(int64_t step, float loss)> on_loss;

  // The options (timeout) of every collective the trainer issues: the
  // handles' (HandleOptions::collective_options), the runtime's
  // (RuntimeOptions::collective_options: the hybrid strategies' group
  // splits), the losses' all-gather and the final gathers. A rank that waits
  // longer for a peer fails with the backend's DeadlineExceeded, which names
  // the rank and the op.
  CollectiveOptions collective_options;
};

// InvalidArgument, naming the values, for options that cannot run on
// `world_size` ranks: world_size < 1; steps < 0; global_batch < 1 or not a
// multiple of world_size; micro_batches < 1; a shard_group_size that is
// not >= 1 and a divisor of world_size for a hybrid strategy, or not 0 for
// another; a non-floating param/reduce dtype; a bad model config;
// first_step < 0; prefetch_depth < 1; limit_all_gathers < 0. (initial_state is
// checked against the layout when training starts.)
absl::Status ValidateFsdpTrainOptions(const FsdpTrainOptions& options,
                                      int world_size);

// The layout the trainer uses on `world_size` ranks (see the file comment).
absl::StatusOr<ModelLayout> FsdpModelLayout(const FsdpTrainOptions& options,
                                            int world_size);

// The single-process run that `options` on `world_size` ranks computes: the
// same steps, data, batch, micro-batches, accumulation and optimizer;
// GradientReduction::Fsdp(W), or Hybrid(W, shard_group_size) for the hybrid
// strategies; the same mixed precision. On backends that reduce with
// comm/host_reduce.h's left fold in rank order on the host (the simulator
// and MPI) with a host compute device, TrainFsdpOnRank's losses, parameters
// and optimizer state equal TrainReference's for these options bit for bit.
// NCCL sums in its own order and CUDA divides by multiplying with the
// reciprocal, so there the results only agree closely. first_step carries
// over; initial_state does not (it is sharded): a resumed run's reference
// starts from the gathered state it resumed from (initial_params and
// TrainOptions::initial_optimizer_state), or chains TrainReference over the
// whole history.
absl::StatusOr<TrainOptions> ReferenceOptionsFor(
    const FsdpTrainOptions& options, int world_size);

// What one rank computed. The losses and the gathered tensors are the same
// on every rank.
struct FsdpRankResult {
  int rank = 0;
  // One per step (TrainReference's definition).
  std::vector<float> losses;
  // This rank's handles together: peak[c] is the rank's peak of category
  // c, compute_peak/offload_peak the peaks of the sums per placement,
  // current[c] what is allocated at the end.
  MemoryStats memory;
  // This rank's optimizer state (host memory, not in `memory`).
  int64_t optimizer_state_bytes = 0;
  // The handles' collectives (FsdpRuntime::comm_stats(); not the loss and
  // final gathers).
  CommStats comm;
  // Gathered after the last step, in TrainResult's format: the non-tied
  // parameters by fqn with their shapes; the optimizer state by fqn
  // (buffers shaped like the parameter, "step" 0-d).
  std::map<std::string, HostTensor> params;
  std::map<std::string, OptimizerState> optimizer_state;
  // With gather_grads: the last step's reduced gradients by fqn (what the
  // optimizer stepped with).
  std::map<std::string, HostTensor> grads;
  // Padding elements of this rank's sharded gradients that were not zero
  // when the optimizer stepped, over all steps (must be 0: padding gets no
  // gradient).
  int64_t nonzero_padding_grads = 0;
  // This rank's state after the last step, ungathered: to resume from
  // (FsdpTrainOptions::initial_state) or to save in a sharded checkpoint.
  FsdpRankState state;
};

// Trains on this rank; collective over `world` (every rank calls it with
// the same options). `device` holds the handles' buffers (HostDeviceOps, or
// CUDA DeviceOps with an NCCL `world`). Errors: ValidateFsdpTrainOptions'
// for world.size(), and any error of the handles and collectives, with the
// step and unit.
absl::StatusOr<FsdpRankResult> TrainFsdpOnRank(Communicator& world,
                                               DeviceOps& device,
                                               const FsdpTrainOptions& options);

// The per-rank peak bytes of each MemoryCategory (indexed by it) that
// TrainFsdpOnRank measures, in closed form, for steps >= 1 on a host
// compute device (HostDeviceOps: with CPU offload, a device adds staging
// copies). Every rank gets the same value. With units u = 0 (the root) and
// 1..L (the layers), reduced in the backward in the order u_1..u_{L+1} =
// L, ..., 1, 0:
//
//   n_s(u) = layout.sharded_numel()  (the whole flat parameter for
//            NO_SHARD), n_p(u) = layout.padded_unsharded_numel();
//   b_o = 4 (float32), b_p = sizeof(param_dtype), b_r = sizeof(reduce_dtype);
//   mp = param_dtype != float32; sharded = strategy != NO_SHARD;
//   raf = the strategy reshards after forward (FULL_SHARD, HYBRID_SHARD);
//   once = gradients are reduced once per step (micro_batches == 1 or
//          kNoSync), else once per micro-batch.
//   Prefetch (flatparam/runtime.h): d = prefetch_depth; k = d, or
//     min(d, limit_all_gathers) when that is > 0 (how far the all-gathering
//     prefetches reach); pre/post = BACKWARD_PRE/BACKWARD_POST; fwd =
//     forward_prefetch acting: from the second iteration on (the order is
//     recorded in the first), on a forward that unshards: steps * M >= 2
//     for FULL_SHARD, HYBRID_SHARD and NO_SHARD; for SHARD_GRAD_OP and
//     HYBRID_SHARD_ZERO2, which keep their parameters through a backward
//     without sync, steps >= 2 or (M >= 2 and kShardedAccumulation).
//   W_n^m(x) = the largest sum of x over n consecutive layers among 1..m
//     (0 when m < 1): the running layer with those prefetched after it.
//
//   sharded_params   = sum_u n_s(u) b_o
//                      + (offload && sharded ? (mp ? max_u n_s(u) b_o
//                                                  : Pend(n_s b_o)) : 0)
//       the local shards, plus the compute copies offloaded shards need to
//       be all-gathered: transient before a cast under mixed precision,
//       else held by each pending prefetch, with
//       Pend(x) = max(max_u x(u), fwd || (raf && pre) ? W_k^L(x) : 0,
//                     raf && post ? W_k^{L-1}(x) : 0)
//       (at most k prefetched layers pending; a blocking unshard holds its
//       own while none is).
//   unsharded_params = sharded && raf:  n_p(0) b_p + max(max_{u>=1} P(u),
//                          fwd || pre ? W_{k+1}^L(P) : 0,
//                          post ? W_k^{L-1}(P) : 0),  P(u) = n_p(u) b_p
//                      sharded && !raf: sum_u n_p(u) b_p
//                      NO_SHARD: offload ? (mp ? max_u n_p(u) b_o
//                                              : H(n_p b_o))
//                                        : 0
//       FULL_SHARD frees each layer after its forward and backward, so the
//       root (kept from its forward to its backward), the running layer
//       and the k prefetched after it (forward, BACKWARD_PRE), or the k
//       prefetched after a layer's backward freed it (BACKWARD_POST; the
//       last layer is gathered on demand) are unsharded at once;
//       SHARD_GRAD_OP keeps every unit from forward to backward. NO_SHARD
//       needs memory only for the offloaded shard's compute copy (transient
//       before a cast under mixed precision), with
//       H(y) = y(0) + max(max_{u>=1} y(u), fwd || pre ? W_{d+1}^L(y) : 0,
//                         post ? W_d^{L-1}(y) : 0)
//       (NO_SHARD's prefetches all-gather nothing, so the limit does not
//       apply: d, not k).
//   low_precision_params (mp only)
//                    = sharded ? Pend(n_s b_p) (the cast shard, held until
//                                               the all-gather is consumed)
//                              : H(n_p b_p)    (the cast parameter, freed at
//                                               reshard)
//   unsharded_grads, with G(u) = n_p(u) b_p, X(u) = n_p(u) b_r when
//       reduce_dtype != param_dtype (the reduce-dtype copy, which replaces
//       the gradient when the reduction starts), else 0, and I(u) = what a
//       started reduction holds until the next unit's PostBackward finishes
//       it: sharded ? (X(u) > 0 ? X(u) : G(u)) : 0 (NO_SHARD reduces in
//       place, a sharded gradient), with I(u_0) = 0:
//         M >= 2 with kNoSync: max_k (sum_{j>=k} G(u_j) + X(u_k)
//           + I(u_{k-1})): every unit keeps its gradient until the last
//           micro-batch reduces it;
//         otherwise: max_k (G(u_k) + (u_k != 0 ? G(0) : 0) + X(u_k)
//           + I(u_{k-1})): the root's gradient lives through the whole
//           backward, a layer's until its reduction has started, and one
//           reduction overlaps the next unit's backward.
//   sharded_grads, with c(u) = n_s(u) b_r + (reduce_dtype != float32 ?
//       n_s(u) b_o : 0) (a finishing reduction's new shard and its float32
//       cast) and q(k) = n_s(u_{k+1}) b_r (the next reduction's new shard,
//       started before u_k's finishes; q(L+1) = 0):
//         offload:  sum_u n_s(u) b_o + max_k (c(u_k) + q(k))  (`_cpu_grad`
//                   is allocated at creation);
//         once:     max_k (sum_{j<k} n_s(u_j) b_o + c(u_k) + q(k)): the
//                   units reduced before u_k hold their gradients;
//         else:     sum_u n_s(u) b_o + max_k (c(u_k) + q(k)).
// InvalidArgument as ValidateFsdpTrainOptions.
absl::StatusOr<std::array<int64_t, kNumMemoryCategories>> ExpectedPeakMemory(
    const FsdpTrainOptions& options, int world_size);

}  // namespace refmodel
}  // namespace flatparam

#endif  // FLATPARAM_REFMODEL_FSDP_TRAINER_H_
