#include "sim/cost_model.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <deque>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "flatparam/base/status_macros.h"
#include "nlohmann/json.hpp"
#include "sim/chrome_trace.h"

namespace flatparam {
namespace cost {
namespace {

std::vector<Topology> Presets() {
  std::vector<Topology> presets;
  // H100 SXM: NVLink 4 is 900 GB/s bidirectional per GPU (18 links x 25
  // GB/s per direction); 8 ConnectX-7 NDR 400 Gb/s HCAs per node, one per
  // GPU (NVIDIA DGX H100 user guide). Dense bf16 989 TFLOP/s, TF32 495
  // (H100 datasheet). Latencies are NCCL-typical orders of magnitude, not
  // measurements.
  Topology h100;
  h100.name = "dgx-h100";
  h100.description =
      "DGX H100: 8 GPUs/node, NVLink4 450 GB/s/dir per GPU, 8x NDR 400 Gb/s "
      "(50 GB/s per GPU), 989 TFLOP/s bf16, 80 GiB";
  h100.link = {1, 8, 450e9, 1e-6, 50e9, 5e-6};
  h100.gpu = {"H100-SXM", 989e12, 495e12, int64_t{80} * (int64_t{1} << 30)};
  presets.push_back(h100);

  // A100 SXM: NVLink 3 is 600 GB/s bidirectional; DGX A100 has 8 HDR
  // 200 Gb/s HCAs for compute (one per GPU). Dense bf16 312 TFLOP/s, TF32
  // 156 (A100 datasheet).
  Topology hdr;
  hdr.name = "ib-hdr";
  hdr.description =
      "A100 nodes (DGX A100): 8 GPUs/node, NVLink3 300 GB/s/dir, one HDR "
      "200 Gb/s HCA per GPU (25 GB/s), 312 TFLOP/s bf16, 80 GiB";
  hdr.link = {1, 8, 300e9, 1e-6, 25e9, 5e-6};
  hdr.gpu = {"A100-SXM-80GB", 312e12, 156e12, int64_t{80} * (int64_t{1} << 30)};
  presets.push_back(hdr);

  // PCIe servers: 8 H100 PCIe per node without NVSwitch, so the ring inside
  // a node runs over PCIe Gen5 x16 (64 GB/s per direction on paper, about
  // 50 GB/s achieved), and four NDR 400 Gb/s HCAs per node (25 GB/s per
  // GPU) on a three-level fat tree. H100 PCIe: 756 TFLOP/s bf16 dense.
  Topology pcie;
  pcie.name = "h100-pcie-ndr";
  pcie.description =
      "H100 PCIe servers: 8 GPUs/node over PCIe Gen5 (50 GB/s/dir), 4x NDR "
      "400 Gb/s per node (25 GB/s per GPU), 7 us per inter-node step, 756 "
      "TFLOP/s bf16, 80 GiB";
  pcie.link = {1, 8, 50e9, 2e-6, 25e9, 7e-6};
  pcie.gpu = {"H100-PCIe", 756e12, 378e12, int64_t{80} * (int64_t{1} << 30)};
  presets.push_back(pcie);

  // Commodity: NVLink inside the node, one 100 GbE NIC (RoCE) per node
  // shared by its 8 GPUs: 12.5 GB/s / 8 per GPU.
  Topology eth = h100;
  eth.name = "ethernet-100g";
  eth.description =
      "H100 nodes with one 100 GbE NIC per node: 8 GPUs/node, NVLink4 450 "
      "GB/s/dir, 1.5625 GB/s network per GPU, 20 us per inter-node step";
  eth.link.inter_bytes_per_second = 12.5e9 / 8;
  eth.link.inter_latency_s = 20e-6;
  presets.push_back(eth);
  return presets;
}

// A ring phase over `n` ranks moving `bytes` (nccl-tests size) with bus
// factor `factor_num * (n-1) / n`.
double RingSeconds(int64_t n, double bytes, int factor_num, double bw,
                   double latency) {
  if (n <= 1) return 0;
  const double steps = factor_num * static_cast<double>(n - 1);
  return steps * latency + bytes * factor_num * static_cast<double>(n - 1) /
                               static_cast<double>(n) / bw;
}

}  // namespace

std::vector<std::string> TopologyPresetNames() {
  std::vector<std::string> names;
  for (const Topology& t : Presets()) names.push_back(t.name);
  return names;
}

absl::StatusOr<Topology> FindTopologyPreset(absl::string_view name) {
  for (Topology& t : Presets()) {
    if (t.name == name) return std::move(t);
  }
  return absl::InvalidArgumentError(
      absl::StrFormat("unknown topology \"%s\"; the presets are %s", name,
                      absl::StrJoin(TopologyPresetNames(), ", ")));
}

absl::Status ValidateLinkSpec(const LinkSpec& link) {
  if (link.nodes < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("nodes must be >= 1, got %d", link.nodes));
  }
  if (link.gpus_per_node < 1) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "gpus per node must be >= 1, got %d", link.gpus_per_node));
  }
  const std::pair<const char*, double> bandwidths[] = {
      {"intra-node bandwidth", link.intra_bytes_per_second},
      {"inter-node bandwidth", link.inter_bytes_per_second}};
  for (const auto& [what, bw] : bandwidths) {
    if (!(bw > 0) || !std::isfinite(bw)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s must be a positive number of bytes/s, got %g", what, bw));
    }
  }
  const std::pair<const char*, double> latencies[] = {
      {"intra-node latency", link.intra_latency_s},
      {"inter-node latency", link.inter_latency_s}};
  for (const auto& [what, lat] : latencies) {
    if (!(lat >= 0) || !std::isfinite(lat)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s must be a finite number of seconds >= 0, got %g", what, lat));
    }
  }
  return absl::OkStatus();
}

absl::string_view CollectiveName(Collective c) {
  switch (c) {
    case Collective::kAllGather:
      return "all_gather";
    case Collective::kReduceScatter:
      return "reduce_scatter";
    case Collective::kAllReduce:
      return "all_reduce";
  }
  return "?";
}

CollectiveCost CollectiveTime(Collective c, int64_t bytes,
                              const CommGroup& group, const LinkSpec& link) {
  assert(bytes >= 0 && group.nodes >= 1 && group.ranks_per_node >= 1);
  CollectiveCost cost;
  const int64_t n = group.size();
  if (n <= 1) return cost;
  const bool all_reduce = c == Collective::kAllReduce;
  const int factor = all_reduce ? 2 : 1;
  const int64_t nodes = group.nodes;
  const int64_t g = group.ranks_per_node;
  const double s = static_cast<double>(bytes);
  const double bi = link.intra_bytes_per_second;
  const double li = link.intra_latency_s;
  const double be = link.inter_bytes_per_second;
  const double le = link.inter_latency_s;
  // Intra phases see S; the inter phase S/g per rail. A one-node group has
  // no inter phase, one rank per node no intra phase.
  cost.seconds = RingSeconds(g, s, factor, bi, li) +
                 RingSeconds(nodes, s / static_cast<double>(g), factor, be, le);
  // Integral: S is n shards for all-gather and reduce-scatter.
  cost.sent_bytes =
      all_reduce
          ? static_cast<int64_t>((static_cast<__int128>(2) * bytes * (n - 1)) /
                                 n)
          : static_cast<int64_t>((static_cast<__int128>(bytes) * (n - 1)) / n);
  if (cost.seconds > 0) {
    cost.bus_bytes_per_second = s * factor * static_cast<double>(n - 1) /
                                static_cast<double>(n) / cost.seconds;
  }
  return cost;
}

absl::Duration SimulatedCollectiveTime(const LinkSpec& link, CollectiveOp op,
                                       int64_t bytes,
                                       const std::vector<int>& world_ranks) {
  Collective c;
  switch (op) {
    case CollectiveOp::kAllGather:
    case CollectiveOp::kBroadcast:
      c = Collective::kAllGather;
      break;
    case CollectiveOp::kReduceScatter:
      c = Collective::kReduceScatter;
      break;
    case CollectiveOp::kAllReduce:
      c = Collective::kAllReduce;
      break;
    default:
      return absl::ZeroDuration();
  }
  std::map<int, int> per_node;
  for (int r : world_ranks) ++per_node[r / std::max(1, link.gpus_per_node)];
  CommGroup group;
  group.nodes = static_cast<int>(per_node.size());
  for (const auto& [node, ranks] : per_node) {
    group.ranks_per_node = std::max(group.ranks_per_node, ranks);
  }
  return absl::Seconds(CollectiveTime(c, bytes, group, link).seconds);
}

std::vector<UnitSpec> UnitsOf(const ModelLayout& layout) {
  std::vector<UnitSpec> units;
  for (const FlatParamLayout& l : layout.flat_params()) {
    units.push_back({l.unit(), l.param_numel(), l.padded_unsharded_numel(),
                     l.sharded_numel()});
  }
  return units;
}

absl::string_view MemoryKindName(MemoryKind kind) {
  switch (kind) {
    case MemoryKind::kShardedParams:
      return "sharded_params";
    case MemoryKind::kUnshardedParams:
      return "unsharded_params";
    case MemoryKind::kShardedGrads:
      return "sharded_grads";
    case MemoryKind::kUnshardedGrads:
      return "unsharded_grads";
    case MemoryKind::kLowPrecisionParams:
      return "low_precision_params";
    case MemoryKind::kOptimizerState:
      return "optimizer_state";
  }
  return "?";
}

int64_t MemorySample::total() const {
  int64_t t = 0;
  for (int64_t b : bytes) t += b;
  return t;
}

int64_t StepPrediction::comm_sent_bytes() const {
  int64_t t = 0;
  for (const CommVolume& v : comm) t += v.sent_bytes;
  return t;
}

namespace {

struct MemoryEvent {
  double time;
  int64_t seq;
  MemoryKind kind;
  int64_t delta;
};

// Builds the timeline op by op, in issue order.
class Scheduler {
 public:
  explicit Scheduler(bool overlap) : overlap_(overlap) {}

  // Issues an op after `deps` (op indices; -1 ignored); returns its index.
  int Issue(TimelineOp op, double duration, std::initializer_list<int> deps) {
    double start = stream_free_[static_cast<int>(op.stream)];
    for (int d : deps) {
      if (d >= 0) start = std::max(start, ops_[d].end);
    }
    if (!overlap_ && !ops_.empty()) start = std::max(start, ops_.back().end);
    op.start = start;
    op.end = start + duration;
    stream_free_[static_cast<int>(op.stream)] = op.end;
    ops_.push_back(std::move(op));
    return static_cast<int>(ops_.size()) - 1;
  }

  // Memory changes at the start or end of op `index`, ordered by time and
  // then by the order they are recorded in.
  void AtStart(int index, MemoryKind kind, int64_t delta) {
    Record(ops_[index].start, kind, delta);
  }
  void AtEnd(int index, MemoryKind kind, int64_t delta) {
    Record(ops_[index].end, kind, delta);
  }
  void Record(double time, MemoryKind kind, int64_t delta) {
    if (delta != 0) events_.push_back({time, seq_++, kind, delta});
  }

  std::vector<TimelineOp>& ops() { return ops_; }
  std::vector<MemoryEvent>& events() { return events_; }

 private:
  bool overlap_;
  double stream_free_[2] = {0, 0};
  std::vector<TimelineOp> ops_;
  std::vector<MemoryEvent> events_;
  int64_t seq_ = 0;
};

absl::Status ValidateStep(absl::Span<const UnitSpec> units,
                          const StepOptions& o) {
  if (units.empty()) {
    return absl::InvalidArgumentError("the model has no units");
  }
  for (const UnitSpec& u : units) {
    if (u.param_numel < 0 || u.unsharded_numel < 0 || u.sharded_numel < 0 ||
        u.sharded_numel > u.unsharded_numel) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "unit \"%s\": numels must be >= 0 with sharded <= unsharded, got "
          "param %d, unsharded %d, sharded %d",
          u.name, u.param_numel, u.unsharded_numel, u.sharded_numel));
    }
    if (IsHybridStrategy(o.strategy) &&
        u.sharded_numel * o.link.gpus_per_node != u.unsharded_numel) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "unit \"%s\": %s shards within a node of %d GPUs, but its shard "
          "(%d) x %d != its unsharded numel %d",
          u.name, ShardingStrategyName(o.strategy), o.link.gpus_per_node,
          u.sharded_numel, o.link.gpus_per_node, u.unsharded_numel));
    }
  }
  if (!IsHybridStrategy(o.strategy) &&
      o.strategy != ShardingStrategy::kNoShard) {
    for (const UnitSpec& u : units) {
      if (u.sharded_numel * o.link.world_size() != u.unsharded_numel) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "unit \"%s\": %s shards over %d ranks, but its shard (%d) x %d != "
            "its unsharded numel %d",
            u.name, ShardingStrategyName(o.strategy), o.link.world_size(),
            u.sharded_numel, o.link.world_size(), u.unsharded_numel));
      }
    }
  }
  if (o.strategy == ShardingStrategy::kNoShard) {
    for (const UnitSpec& u : units) {
      if (u.sharded_numel != u.unsharded_numel) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "unit \"%s\": NO_SHARD keeps the whole flat parameter, but its "
            "shard (%d) != its numel %d",
            u.name, u.sharded_numel, u.unsharded_numel));
      }
    }
  }
  FLATPARAM_RETURN_IF_ERROR(ValidateLinkSpec(o.link));
  const std::pair<const char*, DType> dtypes[] = {{"original", o.orig_dtype},
                                                  {"param", o.param_dtype},
                                                  {"reduce", o.reduce_dtype}};
  for (const auto& [what, dtype] : dtypes) {
    if (!IsFloatingPoint(dtype)) {
      return absl::InvalidArgumentError(
          absl::StrFormat("the %s dtype must be floating point, got %s", what,
                          DTypeName(dtype)));
    }
  }
  if (o.optimizer_state_bytes_per_element < 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "optimizer state bytes per element must be >= 0, got %d",
        o.optimizer_state_bytes_per_element));
  }
  if (!(o.tokens_per_rank > 0) || !std::isfinite(o.tokens_per_rank)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "tokens per rank must be positive, got %g", o.tokens_per_rank));
  }
  if (!(o.peak_flops > 0) || !std::isfinite(o.peak_flops)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("peak FLOP/s must be positive, got %g", o.peak_flops));
  }
  if (!(o.efficiency > 0 && o.efficiency <= 1)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("efficiency must be in (0, 1], got %g", o.efficiency));
  }
  if (o.max_inflight_all_gathers < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("max in-flight all-gathers must be >= 1, got %d",
                        o.max_inflight_all_gathers));
  }
  return absl::OkStatus();
}

std::string DisplayName(const UnitSpec& u) {
  return u.name.empty() ? std::string("root") : u.name;
}

}  // namespace

absl::StatusOr<StepPrediction> PredictStep(absl::Span<const UnitSpec> units,
                                           const StepOptions& options) {
  FLATPARAM_RETURN_IF_ERROR(ValidateStep(units, options));
  const StepOptions& o = options;
  const ShardingStrategy st = o.strategy;
  const bool sharded = UsesShardedStrategy(st);
  const bool raf = st == ShardingStrategy::kFullShard ||
                   st == ShardingStrategy::kHybridShard;
  const bool hybrid = IsHybridStrategy(st);
  const bool mp = o.param_dtype != o.orig_dtype;
  const int64_t b_o = static_cast<int64_t>(DTypeSize(o.orig_dtype));
  const int64_t b_p = static_cast<int64_t>(DTypeSize(o.param_dtype));
  const int64_t b_r = static_cast<int64_t>(DTypeSize(o.reduce_dtype));
  const bool copy_for_reduce = o.reduce_dtype != o.param_dtype;
  const bool cast_reduced = o.reduce_dtype != o.orig_dtype;
  const double flops_per_second = o.peak_flops * o.efficiency;
  const CommGroup world{o.link.nodes, o.link.gpus_per_node};
  const CommGroup shard_group =
      hybrid ? CommGroup{1, o.link.gpus_per_node} : world;
  const CommGroup replica_group{o.link.nodes, 1};
  const int last = static_cast<int>(units.size()) - 1;

  StepPrediction out;
  Scheduler s(o.overlap);
  auto np = [&](int u) { return units[u].unsharded_numel; };
  auto ns = [&](int u) { return units[u].sharded_numel; };

  // Persistent state: the shards (master weights) and the optimizer state.
  int64_t shard_elements = 0;
  for (const UnitSpec& u : units) shard_elements += u.sharded_numel;
  s.Record(0, MemoryKind::kShardedParams, shard_elements * b_o);
  s.Record(0, MemoryKind::kOptimizerState,
           shard_elements * o.optimizer_state_bytes_per_element);

  auto collective = [&](Collective c, int u, int64_t bytes,
                        const CommGroup& group,
                        std::initializer_list<int> deps) {
    const CollectiveCost cost = CollectiveTime(c, bytes, group, o.link);
    TimelineOp op;
    op.name = absl::StrCat(CollectiveName(c), " ", DisplayName(units[u]));
    op.kind = std::string(CollectiveName(c));
    op.stream = Stream::kComm;
    op.unit = u;
    op.bytes = bytes;
    op.sent_bytes = cost.sent_bytes;
    CommVolume& v = out.comm[static_cast<int>(c)];
    v.calls += 1;
    v.bytes += bytes;
    v.sent_bytes += cost.sent_bytes;
    v.seconds += cost.seconds;
    return s.Issue(std::move(op), cost.seconds, deps);
  };

  std::deque<int> frees;  // ops whose end frees an unsharded parameter
  auto all_gather = [&](int u, int after) {
    int limit = -1;
    if (static_cast<int>(frees.size()) >= o.max_inflight_all_gathers) {
      limit = frees.front();
      frees.pop_front();
    }
    const int i = collective(Collective::kAllGather, u, np(u) * b_p,
                             shard_group, {limit, after});
    s.AtStart(i, MemoryKind::kUnshardedParams, np(u) * b_p);
    if (mp) {
      s.AtStart(i, MemoryKind::kLowPrecisionParams, ns(u) * b_p);
      s.AtEnd(i, MemoryKind::kLowPrecisionParams, -ns(u) * b_p);
    }
    return i;
  };

  auto compute = [&](int u, const char* kind, double flops, const char* suffix,
                     int dep) {
    TimelineOp op;
    op.name = absl::StrCat(kind, " ", DisplayName(units[u]), suffix);
    op.kind = kind;
    op.stream = Stream::kCompute;
    op.unit = u;
    op.flops = flops;
    const double seconds = flops / flops_per_second;
    out.compute_seconds += seconds;
    return s.Issue(std::move(op), seconds, {dep});
  };

  // The gradient reduction of unit u after its backward op `after`. As the
  // runtime (flatparam/runtime.h) overlaps them, a reduction is started in
  // its unit's post-backward and finished in the next unit's, after that
  // one's has started (the last one in FinalizeBackward, at its end): until
  // then it holds its input (the reduce-dtype copy, else the gradient;
  // NO_SHARD reduces in place, its buffer becoming the sharded gradient)
  // and its new shard, which is cast to b_o when it finishes.
  int started = -1;  // the unit of the reduction started and not finished
  auto finish = [&](int u, int op, bool at_start) {
    auto at = [&](MemoryKind kind, int64_t delta) {
      at_start ? s.AtStart(op, kind, delta) : s.AtEnd(op, kind, delta);
    };
    if (cast_reduced) {
      at(MemoryKind::kShardedGrads, ns(u) * b_o);
      at(MemoryKind::kShardedGrads, -ns(u) * b_r);
    }
    if (sharded) {
      at(MemoryKind::kUnshardedGrads,
         -(copy_for_reduce ? np(u) * b_r : np(u) * b_p));
    }
  };
  auto reduce = [&](int u, int after) {
    const int64_t grad = np(u) * b_p;
    const int64_t copy = copy_for_reduce ? np(u) * b_r : 0;
    int first, final;
    if (!sharded) {
      first = final =
          collective(Collective::kAllReduce, u, np(u) * b_r, world, {after});
    } else {
      first = final = collective(Collective::kReduceScatter, u, np(u) * b_r,
                                 shard_group, {after});
      if (hybrid && replica_group.size() > 1) {
        final = collective(Collective::kAllReduce, u, ns(u) * b_r,
                           replica_group, {first});
      }
    }
    s.AtStart(first, MemoryKind::kUnshardedGrads, copy);
    if (copy_for_reduce) s.AtStart(first, MemoryKind::kUnshardedGrads, -grad);
    if (!sharded) {
      s.AtStart(first, MemoryKind::kUnshardedGrads,
                -(copy_for_reduce ? copy : grad));
    }
    s.AtStart(first, MemoryKind::kShardedGrads, ns(u) * b_r);
    if (started >= 0) finish(started, first, /*at_start=*/true);
    started = u;
    return final;
  };

  const double tokens = o.tokens_per_rank;
  auto forward_flops = [&](int u) {
    return 2.0 * static_cast<double>(units[u].param_numel) * tokens;
  };

  // Forward.
  std::vector<int> forward_op(units.size(), -1);
  const int ag_root = sharded ? all_gather(0, -1) : -1;
  const int f_root_pre =
      compute(0, "forward", forward_flops(0) / 2, " (before layers)", ag_root);
  if (!sharded && mp) {
    s.AtStart(f_root_pre, MemoryKind::kLowPrecisionParams, np(0) * b_p);
  }
  for (int u = 1; u <= last; ++u) {
    const int ag = sharded ? all_gather(u, -1) : -1;
    const int f = compute(u, "forward", forward_flops(u), "", ag);
    forward_op[u] = f;
    if (!sharded && mp) {
      s.AtStart(f, MemoryKind::kLowPrecisionParams, np(u) * b_p);
      s.AtEnd(f, MemoryKind::kLowPrecisionParams, -np(u) * b_p);
    }
    if (raf) {
      s.AtEnd(f, MemoryKind::kUnshardedParams, -np(u) * b_p);
      frees.push_back(f);
    }
  }
  compute(0, "forward", forward_flops(0) / 2, " (after layers)", -1);

  // Backward. A layer's backward all-gather waits for nothing but the comm
  // stream and the rate limiter: it fills a new block (the caching
  // allocator does not hand out the one its forward freed before that
  // forward has run), so no stream orders it after its forward.
  std::vector<int> ag_backward(units.size(), -1);
  auto ensure_unsharded = [&](int u) {
    if (raf && u >= 1 && ag_backward[u] < 0) {
      ag_backward[u] = all_gather(u, -1);
    }
  };
  if (o.backward_prefetch) ensure_unsharded(last);
  const int b_root_post =
      compute(0, "backward", 2 * forward_flops(0) / 2, " (after layers)", -1);
  s.AtStart(b_root_post, MemoryKind::kUnshardedGrads, np(0) * b_p);
  // NO_SHARD under mixed precision casts a layer for its backward; with
  // backward_prefetch the cast is the prefetch, made as the op before it
  // (the previous layer's backward, or the root's) starts.
  int cast_with = b_root_post;
  for (int u = last; u >= 1; --u) {
    ensure_unsharded(u);
    if (o.backward_prefetch) ensure_unsharded(u - 1);
    const int b =
        compute(u, "backward", 2 * forward_flops(u), "", ag_backward[u]);
    s.AtStart(b, MemoryKind::kUnshardedGrads, np(u) * b_p);
    if (!sharded && mp) {
      s.AtStart(o.backward_prefetch ? cast_with : b,
                MemoryKind::kLowPrecisionParams, np(u) * b_p);
      s.AtEnd(b, MemoryKind::kLowPrecisionParams, -np(u) * b_p);
    }
    cast_with = b;
    if (sharded) {
      s.AtEnd(b, MemoryKind::kUnshardedParams, -np(u) * b_p);
      frees.push_back(b);
    }
    reduce(u, b);
  }
  const int b_root_pre =
      compute(0, "backward", 2 * forward_flops(0) / 2, " (before layers)", -1);
  if (sharded) {
    s.AtEnd(b_root_pre, MemoryKind::kUnshardedParams, -np(0) * b_p);
  } else if (mp) {
    s.AtEnd(b_root_pre, MemoryKind::kLowPrecisionParams, -np(0) * b_p);
  }
  finish(0, reduce(0, b_root_pre), /*at_start=*/false);

  // Times.
  out.ops = std::move(s.ops());
  for (const TimelineOp& op : out.ops) {
    out.step_seconds = std::max(out.step_seconds, op.end);
  }
  out.exposed_comm_seconds =
      std::max(0.0, out.step_seconds - out.compute_seconds);

  // Memory: replay the changes in time order.
  std::vector<MemoryEvent>& events = s.events();
  std::stable_sort(events.begin(), events.end(),
                   [](const MemoryEvent& a, const MemoryEvent& b) {
                     if (a.time != b.time) return a.time < b.time;
                     return a.seq < b.seq;
                   });
  MemorySample now;
  for (const MemoryEvent& e : events) {
    now.time = e.time;
    int64_t& current = now.bytes[static_cast<int>(e.kind)];
    current += e.delta;
    assert(current >= 0);
    out.peak_by_kind[static_cast<int>(e.kind)] =
        std::max(out.peak_by_kind[static_cast<int>(e.kind)], current);
    const int64_t total = now.total();
    if (total > out.peak_bytes) {
      out.peak_bytes = total;
      out.peak_time = e.time;
      out.peak_breakdown = now.bytes;
    }
    if (!out.memory.empty() && out.memory.back().time == e.time) {
      out.memory.back() = now;
    } else {
      out.memory.push_back(now);
    }
  }
  // Everything unsharded is freed by the end of the step.
  assert(now.bytes[static_cast<int>(MemoryKind::kUnshardedParams)] == 0);
  assert(now.bytes[static_cast<int>(MemoryKind::kUnshardedGrads)] == 0);
  assert(now.bytes[static_cast<int>(MemoryKind::kLowPrecisionParams)] == 0);
  assert(now.bytes[static_cast<int>(MemoryKind::kShardedGrads)] ==
         shard_elements * b_o);
  return out;
}

std::string PredictionTraceJson(absl::Span<const NamedPrediction> predictions) {
  ChromeTrace trace;
  for (size_t i = 0; i < predictions.size(); ++i) {
    const NamedPrediction& named = predictions[i];
    const int64_t pid = static_cast<int64_t>(i);
    trace.ProcessName(pid, named.name, /*sort_index=*/pid);
    trace.ThreadName(pid, 0, "compute");
    trace.ThreadName(pid, 1, "comm");
    if (named.prediction == nullptr) continue;
    const StepPrediction& p = *named.prediction;
    for (const TimelineOp& op : p.ops) {
      nlohmann::json args = {{"unit", op.unit}};
      if (op.stream == Stream::kComm) {
        args["bytes"] = op.bytes;
        args["sent_bytes"] = op.sent_bytes;
      } else {
        args["flops"] = op.flops;
      }
      trace.Complete(pid, op.stream == Stream::kCompute ? 0 : 1, op.name,
                     op.kind, op.start * 1e6, (op.end - op.start) * 1e6,
                     std::move(args));
    }
    for (const MemorySample& m : p.memory) {
      nlohmann::json values = nlohmann::json::object();
      for (int k = 0; k < kNumMemoryKinds; ++k) {
        values[std::string(MemoryKindName(static_cast<MemoryKind>(k)))] =
            m.bytes[k];
      }
      trace.Counter(pid, "memory (bytes)", m.time * 1e6, std::move(values));
    }
  }
  return trace.Json({{"backend", "cost_model"}});
}

}  // namespace cost
}  // namespace flatparam
