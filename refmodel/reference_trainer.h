// A single-process trainer that reproduces FSDP's arithmetic exactly, as
// the ground truth that sharded training must match bit for bit.
//
// One training step with W virtual ranks, M micro-batches and a global batch
// of G samples per micro-batch (each rank's local batch is B = G / W
// samples: rank r takes samples [r*B, (r+1)*B) of MakeBatch(data_seed,
// vocab, step, m, ...)):
//
//   1. For each rank r in rank order, its local gradients start at zero and
//      ReferenceModel::ForwardBackward accumulates into them (the gradient of
//      the mean loss over the local batch).
//   2. The ranks' gradients are folded as FSDP's reduce-scatter with gradient
//      pre/post division computes them on the host (//comm:host_reduce,
//      ReduceOp::kSum): per element, in float32,
//          acc = g_0 / pre;  acc = acc + g_r / pre  for r = 1..W-1 in order;
//          acc = acc / post
//      where a division by a factor of exactly 1.0 is skipped and the factors
//      are rounded to float before dividing. With a shard group size S < W
//      (hybrid sharding: nodes of S consecutive ranks), the fold has two
//      levels, as a reduce-scatter over each node followed by an all-reduce
//      across nodes computes it:
//          acc_q = left fold of g_r / pre over r = qS..qS+S-1 (node q);
//          acc = acc_0;  acc = acc + acc_q  for q = 1..W/S-1;  acc = acc / post
//   3. Micro-batches, per AccumulationMode:
//        kShardedAccumulation (FSDP outside no_sync): steps 1-2 per
//          micro-batch; the reduced gradients are summed in micro-batch
//          order: grad = red_0; grad = grad + red_m (PyTorch's
//          `_saved_grad_shard += new_sharded_grad`).
//        kNoSync (no_sync for micro-batches 0..M-2, then a synced one): each
//          rank accumulates its local gradients over all M micro-batches in
//          order (ForwardBackward's +=), then steps 2 once.
//      With M == 1 the modes coincide bit for bit.
//   4. The optimizer steps every original parameter with its gradient
//      (head.weight is embed.weight and is stepped once, as "embed.weight").
//
// Mixed precision (TrainOptions::param_dtype / reduce_dtype, resolved as
// FlatParamHandle resolves them) emulates FSDP's MixedPrecision on a
// float32 model: the forward and backward see every parameter rounded to
// param_dtype (then held in float32, exactly); in step 1 each micro-batch's
// gradient g is rounded to param_dtype and added in param_dtype (computed in
// float32, rounded once: acc = rnd(acc + rnd(g))), as autograd accumulates a
// low-precision gradient; step 2 casts the local gradients to reduce_dtype
// and folds in reduce_dtype (each division and addition computed in float32
// and rounded to reduce_dtype), then casts the result to float32. Everything
// after that (step 3's sums, the optimizer) stays float32, on the float32
// master parameters.
//
// The step's loss: per micro-batch, the fold of the ranks' losses in rank
// order divided by float(W), ((l_0 + l_1) + ...) / W; then the fold of those
// over micro-batches divided by float(M). All in float32.
//
// Thread-safety: pure functions of their arguments.
#ifndef FLATPARAM_REFMODEL_REFERENCE_TRAINER_H_
#define FLATPARAM_REFMODEL_REFERENCE_TRAINER_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "flatparam/base/dtype.h"
#include "flatparam/flatten.h"
#include "refmodel/mlp_model.h"
#include "refmodel/optimizer.h"

namespace flatparam {
namespace refmodel {

// How the ranks' gradients are combined (see the file comment, step 2).
struct GradientReduction {
  int world_size = 1;
  double pre_divide_factor = 1.0;
  double post_divide_factor = 1.0;
  // Ranks per node of hybrid sharding's two-level fold (step 2); 0 or
  // world_size for the one-level fold. Must divide world_size.
  int shard_group_size = 0;

  // PyTorch FSDP's factors for `world_size` ranks:
  // pre = the smallest power of two f with W % f != 0 or W / f <= f
  // (`_get_gradient_predivide_factor`), post = W / pre. W=1: (1, 1); W=2:
  // (2, 1); W=4: (2, 2); W=8: (4, 2); W=3: (2, 1.5); W=6: (4, 1.5)
  // (pre need not divide W).
  static GradientReduction Fsdp(int world_size);
  // Fsdp(world_size) with the two-level fold of HYBRID_SHARD over nodes of
  // `shard_group_size` ranks (PyTorch divides by the factors of the whole
  // data-parallel world for the hybrid strategies too).
  static GradientReduction Hybrid(int world_size, int shard_group_size);
};

enum class AccumulationMode {
  // Reduce every micro-batch, then sum the reduced gradients.
  kShardedAccumulation,
  // Accumulate local gradients over the micro-batches, then reduce once.
  kNoSync,
};

struct TrainOptions {
  int64_t steps = 1;
  // Samples per micro-batch over all ranks; a multiple of the world size.
  int64_t global_batch = 8;
  int64_t micro_batches = 1;
  AccumulationMode accumulation = AccumulationMode::kShardedAccumulation;
  GradientReduction reduction;
  OptimizerOptions optimizer = SgdOptions{};
  uint64_t data_seed = 0;
  // The data step index of the first step (for resuming); step k of this run
  // uses MakeBatch(..., first_step + k, ...).
  int64_t first_step = 0;
  // Start from these parameters (ReferenceModel::CheckParams must accept
  // them) instead of InitParams(), and from this optimizer state (by fqn;
  // missing entries start empty).
  std::optional<std::map<std::string, HostTensor>> initial_params;
  std::map<std::string, OptimizerState> initial_optimizer_state;
  // Mixed precision (see the file comment); unset means float32. Like
  // PyTorch: with param_dtype set and reduce_dtype unset, gradients are
  // reduced in param_dtype.
  std::optional<DType> param_dtype;
  std::optional<DType> reduce_dtype;
};

struct TrainResult {
  // One per step.
  std::vector<float> losses;
  // The non-tied parameters by fqn, float32, with their model shapes.
  std::map<std::string, HostTensor> params;
  // By parameter fqn; buffers reshaped to the parameter's shape, "step" 0-d.
  std::map<std::string, OptimizerState> optimizer_state;
};

// One step's reduced gradients: what each original parameter's `.grad`
// holds before the optimizer step (steps 1-3 above).
struct StepGradients {
  float loss = 0.0f;
  // The non-tied parameters by fqn, shaped like them.
  std::map<std::string, HostTensor> grads;
};

// Steps 1-3 for data step `step` at parameters `params`.
// InvalidArgument for invalid options or parameters (see TrainReference).
absl::StatusOr<StepGradients> ComputeStepGradients(
    const ReferenceModel& model,
    const std::map<std::string, HostTensor>& params,
    const TrainOptions& options, int64_t step);

// Trains `options.steps` steps of the model `config` describes.
// InvalidArgument, naming the values, for: an invalid config; steps < 0;
// world_size < 1; a pre/post factor that is not finite and > 0; a shard
// group size that does not divide world_size; a non-floating
// param_dtype/reduce_dtype;
// global_batch < 1 or not a multiple of world_size; micro_batches < 1;
// invalid optimizer options; initial parameters or state that do not fit
// the model.
absl::StatusOr<TrainResult> TrainReference(const Config& config,
                                           const TrainOptions& options);

}  // namespace refmodel
}  // namespace flatparam

#endif  // FLATPARAM_REFMODEL_REFERENCE_TRAINER_H_
