// `fsdp plan`: what each FSDP sharding strategy costs a model at a given
// scale, before launching it: bytes per rank for parameters, gradients and
// optimizer state, the peak of the memory timeline, communication per step,
// the predicted step time and how much communication the compute stream
// waits for (sim/cost_model.h), and whether it fits a GPU's memory.
//
//   fsdp plan --model=llama2-7b --nodes=4 --gpus-per-node=8
//       --mixed-precision=bf16 --optimizer=adamw --format=table
//
// Model states ("bytes_per_rank"): the standard mixed-precision accounting
// (ZeRO, Rajbhandari et al. 2020, section 3.1): per parameter element,
//   params     b_p bytes (the bf16/fp16 compute copy; the parameter dtype
//              without mixed precision),
//   grads      b_p bytes,
//   optimizer  with mixed precision 4 bytes of float32 master weights, plus
//              AdamW's momentum and variance, 2 x b_o (b_o = 4 with mixed
//              precision, else the parameter dtype); SGD with momentum
//              (as `fsdp train` runs it) one buffer, b_o,
// so bf16 + AdamW is 2 + 2 + 12 = 16 bytes. Each is counted over the padded
// sharded flat parameters (sum over units of the layout's sharded_numel)
// where the strategy shards it, else over the padded unsharded ones:
//   FULL_SHARD, HYBRID_SHARD          params, grads, optimizer sharded;
//   SHARD_GRAD_OP, _HYBRID_SHARD_ZERO2 grads and optimizer sharded;
//   NO_SHARD                           nothing sharded;
// over W ranks, or over the GPUs of one node for the hybrid strategies.
// "Exactly" means these integers: when every unit's numel is divisible by
// the shard degree D (no padding, e.g. llama2-7b for D a power of two up
// to 4096) they equal 16 Psi / D etc. with Psi the parameter count; in
// general each exceeds it by less than one element per unit per rank.
//
// Peak memory is the cost model's timeline of the buffers FSDP really
// allocates (the float32 shards serve as master weights, gradients are
// reduced into float32 shards), so its categories differ from the
// accounting above. For sharded parameters and states it is at least the
// model states (float32 shards + float32 gradients + AdamW state are the
// same 16 bytes); for SHARD_GRAD_OP and HYBRID_SHARD_ZERO2 it can be lower,
// since gradients are set to None between steps and do not exist yet when
// every parameter is unsharded at the end of the forward. Activations, the
// CUDA context and allocator fragmentation are not included. "fits"
// compares the peak with --gpu-memory.
//
// MakePlan/RunPlan are the whole command minus flag parsing.
// Thread-safety: reentrant; reads the model file and writes only `out` and
// the trace file.
#ifndef TOOLS_PLAN_H_
#define TOOLS_PLAN_H_

#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "flatparam/base/dtype.h"
#include "flatparam/layout.h"
#include "sim/cost_model.h"
#include "tools/layout_request.h"

namespace flatparam {
namespace tools {

// The largest --nodes accepted.
inline constexpr int64_t kMaxPlanNodes = 65536;

struct PlanOptions {
  // A preset or a model JSON file.
  std::string model;
  int64_t nodes = 1;
  // 0: the topology's.
  int64_t gpus_per_node = 0;
  // "all" or one ShardingStrategy name.
  std::string strategy = "all";
  // "none" (train in the parameters' dtype), "bf16" or "fp16" (float32
  // master weights, computed and reduced in the low precision).
  std::string mixed_precision = "none";
  // "adamw" or "sgd".
  std::string optimizer = "adamw";
  double tokens_per_gpu = 4096;
  // A cost::TopologyPresetNames() entry, and overrides of its figures.
  std::string topology = "dgx-h100";
  std::optional<double> intra_gbps;  // GB/s = 1e9 bytes/s
  std::optional<double> inter_gbps;
  std::optional<double> intra_latency_us;
  std::optional<double> inter_latency_us;
  std::optional<double> peak_tflops;
  double efficiency = 0.4;
  // "80GiB", "80GB", "85899345920"; "" for the topology's GPU.
  std::string gpu_memory;
  bool align_addresses = false;
  // "table" or "json".
  std::string format = "table";
  // Non-empty: write the predicted timelines as Chrome trace-event JSON.
  std::string trace_path;
};

// Bytes per parameter element of the standard accounting.
struct BytesPerElement {
  int64_t params = 0;
  int64_t grads = 0;
  int64_t optimizer = 0;
};

struct StrategyPlan {
  ShardingStrategy strategy = ShardingStrategy::kFullShard;
  // Ranks the sharded states are divided over (1 for NO_SHARD).
  int64_t shard_degree = 1;
  int64_t param_bytes = 0;
  int64_t grad_bytes = 0;
  int64_t optimizer_bytes = 0;
  int64_t model_state_bytes() const {
    return param_bytes + grad_bytes + optimizer_bytes;
  }
  cost::StepPrediction prediction;
  bool fits = false;
};

struct Plan {
  std::string model;
  int64_t param_numel = 0;
  int64_t units = 0;
  cost::Topology topology;  // with --nodes, --gpus-per-node and overrides
  std::string mixed_precision;
  std::string optimizer;
  DType orig_dtype = DType::kFloat32;
  DType param_dtype = DType::kFloat32;
  double tokens_per_gpu = 0;
  double peak_flops = 0;
  double efficiency = 0;
  int64_t gpu_memory_bytes = 0;
  BytesPerElement bytes_per_element;
  std::vector<StrategyPlan> strategies;

  int64_t world_size() const { return topology.link.world_size(); }
};

// "80GiB", "80 GB", "512MiB", "1024": bytes (binary K/M/G/TiB and decimal
// KB/MB/GB/TB, case-insensitive, fractions allowed). InvalidArgument naming
// the text otherwise.
absl::StatusOr<int64_t> ParseByteSize(absl::string_view text);

// Checks everything but the model file. InvalidArgument naming the flag and
// value (the command exits 2).
absl::Status ValidatePlanOptions(const PlanOptions& options);

// The layout MakePlan prices for `strategy` on `link`'s world: the hybrid
// strategies shard over one node; with mixed precision the parameters are
// float32 master weights computed in the low precision.
absl::StatusOr<ResolvedLayout> ResolvePlanLayout(const PlanOptions& options,
                                                 const cost::LinkSpec& link,
                                                 ShardingStrategy strategy);

// Lays the model out for each strategy and predicts its step. Errors:
// ValidatePlanOptions', and the model's and layout's.
absl::StatusOr<Plan> MakePlan(const PlanOptions& options);

// The JSON document: {"world_size", "strategies": [{"strategy",
// "bytes_per_rank": {"params", "grads", "optimizer", "model_states"},
// "peak_bytes", "comm_bytes_per_step", "step_time_s", "exposed_comm_s",
// "fits", ...}], ...}; bytes are integers.
nlohmann::json PlanJson(const Plan& plan);

// A header describing the inputs, then one row per strategy.
void PrintPlanTable(const Plan& plan, std::ostream& out);

// MakePlan, then the table or JSON to `out`, and the trace file when asked.
// Nothing is written to `out` on error.
absl::Status RunPlan(const PlanOptions& options, std::ostream& out);

}  // namespace tools
}  // namespace flatparam

#endif  // TOOLS_PLAN_H_
