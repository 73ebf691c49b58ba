// An analytical cost model of one FSDP training step at cluster scale:
// alpha-beta collectives on a nodes x GPUs topology, compute from FLOPs, the
// FSDP schedule of every sharding strategy on a compute stream and a
// communication stream, and a per-rank memory timeline. It predicts; it runs
// nothing (the simulator in sim/sim.h executes real collectives on the host).
//
//   Topology topo = *FindTopologyPreset("dgx-h100");  // .link, .gpu
//   topo.link.nodes = 4;
//   StepOptions options;
//   options.strategy = ShardingStrategy::kFullShard;
//   options.link = topo.link;
//   options.peak_flops = topo.gpu.peak_flops_low_precision;
//   FLATPARAM_ASSIGN_OR_RETURN(StepPrediction p, PredictStep(units, options));
//   // p.step_seconds, p.exposed_comm_seconds, p.peak_bytes, p.ops, ...
//
// Collectives (CollectiveTime). nccl-tests' relations: a collective of size S
// (all-gather output, reduce-scatter input, all-reduce buffer) over n ranks
// takes steps * latency + S * factor / busbw, factor (n-1)/n for all-gather
// and reduce-scatter and 2(n-1)/n for all-reduce (a ring). A group inside one
// node uses the intra-node link. A group that spans N nodes with g ranks on
// each runs hierarchically, each phase on its own link: all-gather = an
// inter-node all-gather of S/g among the N ranks with the same local index
// (g "rails" in parallel, each on its GPU's share of the network) followed
// by an intra-node all-gather of S among the g local ranks; reduce-scatter
// is the mirror image; all-reduce = intra reduce-scatter, inter all-reduce of
// S/g, intra all-gather. Per rank this sends exactly what a flat ring sends,
// S (n-1)/n (twice that for all-reduce), and the network carries the
// bottleneck share S/g (N-1)/N per GPU. Rings only: no trees, no NVLS/SHARP,
// no protocol switching, so latency grows linearly with N and small
// collectives at thousands of ranks are pessimistic.
//
// Compute. Training costs 6 x parameters x tokens FLOPs (forward 2, backward
// 4) per unit, at peak_flops x efficiency. The root unit's work is split
// evenly between before the layers (embedding) and after them (head), in the
// forward and, mirrored, in the backward. Activations, recomputation,
// attention's sequence-length term and the optimizer step are not modelled.
//
// Schedule (PyTorch FSDP's order, one micro-batch per step). Units are the
// root (index 0) then the layers. Ops are issued in CPU order; each op
// starts when its stream is free and its dependencies have ended (CUDA
// stream/event semantics, with the CPU running ahead):
//   forward   AG(0), F(root, pre), then per layer u: AG(u), F(u), reshard
//             (FULL_SHARD/HYBRID_SHARD free the unsharded parameter after
//             F(u)); then F(root, post). The root stays unsharded until the
//             end of the backward (reshard_after_forward is off for it).
//   backward  B(root, post), then per layer u = L..1: [AG(u) for the
//             strategies that resharded], B(u), reshard, reduction(u); then
//             B(root, pre), reduction(0). With backward_prefetch
//             (BACKWARD_PRE), AG(u-1) is issued before B(u), so the comm
//             stream runs AG(u-1), RS(u) while B(u) computes. A layer's
//             backward all-gather does not wait for its forward (as in
//             PyTorch and flatparam's runtime, it fills a new block; the
//             caching allocator keeps the freed one until the forward ran).
//   rate limit PyTorch's limit_all_gathers: an all-gather waits for the
//             free (reshard) issued max_inflight_all_gathers frees ago.
//   reduction FULL_SHARD, SHARD_GRAD_OP: reduce-scatter over the world;
//             NO_SHARD: all-reduce; hybrid: reduce-scatter in the shard group
//             (one node) then all-reduce of the shard across replicas.
// With overlap = false every op also waits for the previously issued one:
// one collective or kernel at a time (FsdpRuntime without prefetch and with
// each reduction finished at once).
//
// Agreement with the runtime (verify/plan_agreement_test.cc). This is the
// schedule flatparam's FsdpRuntime runs: on the simulator in virtual time,
// with collectives priced by SimulatedCollectiveTime and one kernel per
// unit of this file's duration, a step's time and exposed communication
// equal the prediction for every strategy, mixed precision and
// backward_prefetch setting (within 2%; equal in practice) with
// stream-ordered collectives (NCCL's). With host-completed collectives (the
// simulator's and MPI's backends) they agree too, except for the hybrid
// strategies: there the replicate all-reduce of unit u can only be issued
// once the host has waited for u's reduce-scatter, in the next unit's
// post-backward, not right after the reduce-scatter as here, so the
// measured step is longer. Not modelled on either side: activations and
// recomputation, the optimizer step, memory-bound kernels (the handle's
// casts, copies and fills), and host overheads (kernel launches, the host
// reductions of the MPI backend); benchmarks/step_bench measures a real
// step on MPI next to this prediction.
//
// Memory (per rank, MemoryKind). The timeline holds the buffers FSDP
// allocates, as flatparam's FlatParamHandle accounts them (MemoryStats'
// categories, same names) plus the optimizer's state tensors:
//   sharded_params     sum_u n_s(u) b_o: the shards in the original dtype
//                      (with mixed precision these are the float32 master
//                      weights);
//   unsharded_params   n_p(u) b_p from an all-gather's start to its reshard;
//   sharded_grads      from the first reduction on, the reduced shards in
//                      b_o, plus each reduction's new shard n_s b_r from its
//                      start until it is finished, when it is cast to b_o;
//   unsharded_grads    n_p(u) b_p from B(u)'s start; when reduce dtype !=
//                      param dtype the reduction's copy n_p(u) b_r replaces
//                      it at the reduction's start; the reduction holds its
//                      input (the copy or the gradient) until it is
//                      finished (NO_SHARD reduces in place: its input becomes
//                      the sharded gradient at the start);
//   low_precision_params  mixed precision: the cast shard n_s b_p during
//                      each all-gather; NO_SHARD: the cast parameter n_p b_p
//                      from each F/B's start (with backward_prefetch, a
//                      layer's backward cast from the start of the op
//                      before it, as a prefetch) to its reshard;
//   optimizer_state    optimizer_state_bytes_per_element * sum_u n_s(u),
//                      all step long (steady state: step >= 2).
// A reduction is finished as flatparam's runtime (flatparam/runtime.h)
// finishes it: when the next one starts (the next unit's post-backward
// starts its own first), the last at its own end (FinalizeBackward). So one
// reduction's buffers overlap the next unit's backward.
// Gradients are set to None by the previous step's zero_grad (PyTorch's
// default), so they build up during the backward. With overlap = false,
// max_inflight_all_gathers = 1 and host dtypes the first five categories'
// peaks equal refmodel::ExpectedPeakMemory's closed form for the reference
// model run without forward prefetch, backward_prefetch = false being
// BackwardPrefetch NONE and true BACKWARD_PRE one unit ahead (tested); with
// overlap, lifetimes follow the times of the ops instead.
//
// Thread-safety: pure functions; values are plain and copyable.
#ifndef FLATPARAM_SIM_COST_MODEL_H_
#define FLATPARAM_SIM_COST_MODEL_H_

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "comm/communicator.h"
#include "flatparam/base/dtype.h"
#include "flatparam/layout.h"
#include "flatparam/model_layout.h"

namespace flatparam {
namespace cost {

// Links of a homogeneous cluster. Bandwidths are bytes per second in one
// direction per GPU (a ring's busbw ceiling); latencies are seconds per ring
// step.
struct LinkSpec {
  int nodes = 1;
  int gpus_per_node = 8;
  double intra_bytes_per_second = 450e9;
  double intra_latency_s = 1e-6;
  // The GPU's share of the node's network bandwidth (one NIC per GPU on a
  // rail-optimised fabric; node bandwidth / GPUs otherwise).
  double inter_bytes_per_second = 50e9;
  double inter_latency_s = 5e-6;

  int64_t world_size() const { return int64_t{nodes} * gpus_per_node; }
};

// The accelerator: dense peak FLOP/s and memory.
struct GpuSpec {
  std::string name;
  // bf16/fp16 tensor-core peak, and the float32 peak used without mixed
  // precision (TF32 tensor cores).
  double peak_flops_low_precision = 0;
  double peak_flops_fp32 = 0;
  int64_t memory_bytes = 0;
};

struct Topology {
  std::string name;
  // Where the figures come from and what is assumed.
  std::string description;
  LinkSpec link;
  GpuSpec gpu;
};

// "dgx-h100", "ib-hdr", "h100-pcie-ndr", "ethernet-100g"; each at nodes = 1.
std::vector<std::string> TopologyPresetNames();
// The preset `name`; InvalidArgument naming it and listing the presets.
absl::StatusOr<Topology> FindTopologyPreset(absl::string_view name);
// InvalidArgument, naming the field and value, unless nodes and
// gpus_per_node >= 1, bandwidths > 0 and finite, latencies >= 0 and finite.
absl::Status ValidateLinkSpec(const LinkSpec& link);

// The ranks of a communicator: `ranks_per_node` on each of `nodes` nodes.
struct CommGroup {
  int nodes = 1;
  int ranks_per_node = 1;
  int64_t size() const { return int64_t{nodes} * ranks_per_node; }
};

enum class Collective { kAllGather, kReduceScatter, kAllReduce };
// "all_gather", "reduce_scatter", "all_reduce".
absl::string_view CollectiveName(Collective c);

struct CollectiveCost {
  double seconds = 0;
  // What each rank sends: S (n-1)/n, or 2 S (n-1)/n for all-reduce (rounded
  // down).
  int64_t sent_bytes = 0;
  // nccl-tests' busbw: S * factor / seconds (0 for one rank).
  double bus_bytes_per_second = 0;
};

// The cost of collective `c` of nccl-tests size `bytes` over `group` (see
// the file comment). One rank costs nothing. REQUIRES: bytes >= 0, a valid
// link, group sizes >= 1.
CollectiveCost CollectiveTime(Collective c, int64_t bytes,
                              const CommGroup& group, const LinkSpec& link);

// The same for the simulator (SimOptions::cost.collective_time), so that a
// simulated run prices collectives as the plan does: `op` over the world
// ranks `world_ranks` of a world laid out as link.gpus_per_node
// consecutive ranks per node (the group spans the nodes its ranks are on,
// with the most ranks any node has). The buffer collectives are priced by
// CollectiveTime (a broadcast as an all-gather of its buffer); the rest
// (barrier, split, all_gather_bytes) cost nothing: they are bookkeeping
// outside the step the plan models.
absl::Duration SimulatedCollectiveTime(const LinkSpec& link, CollectiveOp op,
                                       int64_t bytes,
                                       const std::vector<int>& world_ranks);

// One FSDP unit's flat parameter, in elements.
struct UnitSpec {
  std::string name;
  // Original parameters (no padding, shared parameters once): the FLOPs.
  int64_t param_numel = 0;
  // The padded unsharded flat parameter (the all-gather output).
  int64_t unsharded_numel = 0;
  // One rank's shard; the whole flat parameter for NO_SHARD.
  int64_t sharded_numel = 0;
};

struct StepOptions {
  ShardingStrategy strategy = ShardingStrategy::kFullShard;
  LinkSpec link;
  // The parameters' original dtype and mixed precision's param_dtype and
  // reduce_dtype, resolved (all equal to orig_dtype without mixed
  // precision; FlatParamHandle's rules otherwise).
  DType orig_dtype = DType::kFloat32;
  DType param_dtype = DType::kFloat32;
  DType reduce_dtype = DType::kFloat32;
  // Optimizer state tensors per sharded element (AdamW: 2 * sizeof(orig)).
  int64_t optimizer_state_bytes_per_element = 0;
  // Training tokens each rank processes per step.
  double tokens_per_rank = 4096;
  double peak_flops = 989e12;
  double efficiency = 0.4;
  // See the file comment.
  bool overlap = true;
  bool backward_prefetch = true;
  int max_inflight_all_gathers = 2;
};

enum class Stream { kCompute, kComm };

// One op on the predicted timeline.
struct TimelineOp {
  // e.g. "forward layers.3", "all_gather layers.3".
  std::string name;
  // "forward", "backward", "all_gather", "reduce_scatter", "all_reduce".
  std::string kind;
  Stream stream = Stream::kCompute;
  int unit = 0;
  double start = 0;
  double end = 0;
  // Collectives: nccl-tests size and bytes this rank sends; compute: FLOPs.
  int64_t bytes = 0;
  int64_t sent_bytes = 0;
  double flops = 0;
};

enum class MemoryKind {
  kShardedParams,
  kUnshardedParams,
  kShardedGrads,
  kUnshardedGrads,
  kLowPrecisionParams,
  kOptimizerState,
};
inline constexpr int kNumMemoryKinds = 6;
using MemoryBytes = std::array<int64_t, kNumMemoryKinds>;

// MemoryStats' names for the first five, then "optimizer_state".
absl::string_view MemoryKindName(MemoryKind kind);

// The per-rank allocation after a change at `time`.
struct MemorySample {
  double time = 0;
  MemoryBytes bytes{};
  int64_t total() const;
};

struct CommVolume {
  int64_t calls = 0;
  int64_t bytes = 0;       // sum of nccl-tests sizes
  int64_t sent_bytes = 0;  // what this rank sends
  double seconds = 0;      // comm-stream busy time
};

struct StepPrediction {
  std::vector<TimelineOp> ops;  // in issue order
  std::vector<MemorySample> memory;
  // Largest value of each kind, and of the total (at peak_time; its split
  // in peak_breakdown).
  MemoryBytes peak_by_kind{};
  int64_t peak_bytes = 0;
  double peak_time = 0;
  MemoryBytes peak_breakdown{};
  // Indexed by Collective.
  std::array<CommVolume, 3> comm{};
  double step_seconds = 0;
  double compute_seconds = 0;
  // step_seconds - compute_seconds: time the compute stream waits on
  // communication.
  double exposed_comm_seconds = 0;

  int64_t comm_sent_bytes() const;
};

// The units of `layout` as `fsdp plan` prices them: per flat parameter, in
// layout order, its unit name, parameter count, padded unsharded and
// sharded numels.
std::vector<UnitSpec> UnitsOf(const ModelLayout& layout);

// Predicts one steady-state step. InvalidArgument, naming the value, for
// no units, a negative numel, sharded_numel > unsharded_numel, a bad link,
// a non-floating dtype, a negative optimizer state size, tokens or
// peak_flops <= 0, efficiency outside (0, 1], max_inflight_all_gathers < 1,
// a NO_SHARD unit whose shard is not the whole, or a hybrid
// strategy whose shard group (gpus_per_node) does not give unsharded_numel
// = sharded_numel * gpus_per_node.
absl::StatusOr<StepPrediction> PredictStep(absl::Span<const UnitSpec> units,
                                           const StepOptions& options);

// A prediction to render, as one process of the trace.
struct NamedPrediction {
  std::string name;
  const StepPrediction* prediction = nullptr;
};

// Chrome trace-event JSON, written by the simulator's trace writer
// (sim/chrome_trace.h, as SimWorld::ChromeTraceJson): per prediction a process
// (pid = its index) with thread 0 "compute" and thread 1 "comm" of complete
// ("X") events, ts/dur in microseconds, and a "memory" counter ("C") per change
// with one series per MemoryKind. Opens in Perfetto or chrome://tracing.
// Deterministic.
std::string PredictionTraceJson(absl::Span<const NamedPrediction> predictions);

}  // namespace cost
}  // namespace flatparam

#endif  // FLATPARAM_SIM_COST_MODEL_H_
