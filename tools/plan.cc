#include "tools/plan.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "flatparam/base/status_macros.h"
#include "tools/inspect.h"
#include "tools/layout_request.h"

namespace flatparam {
namespace tools {
namespace {

constexpr ShardingStrategy kAllStrategies[] = {
    ShardingStrategy::kFullShard,        ShardingStrategy::kShardGradOp,
    ShardingStrategy::kNoShard,          ShardingStrategy::kHybridShard,
    ShardingStrategy::kHybridShardZero2,
};

// "bf16"/"bfloat16", "fp16"/"float16"; nullopt for "none".
absl::StatusOr<std::optional<DType>> ParseMixedPrecision(
    absl::string_view text) {
  const std::string s = absl::AsciiStrToLower(text);
  if (s == "none" || s.empty()) return std::optional<DType>();
  if (s == "bf16" || s == "bfloat16") return std::optional(DType::kBFloat16);
  if (s == "fp16" || s == "float16") return std::optional(DType::kFloat16);
  return absl::InvalidArgumentError(absl::StrFormat(
      "--mixed-precision must be none, bf16 or fp16, got \"%s\"", text));
}

absl::StatusOr<std::vector<ShardingStrategy>> ParseStrategies(
    absl::string_view text) {
  if (absl::AsciiStrToLower(text) == "all") {
    return std::vector<ShardingStrategy>(std::begin(kAllStrategies),
                                         std::end(kAllStrategies));
  }
  absl::StatusOr<ShardingStrategy> s = ParseShardingStrategy(text);
  if (!s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--strategy must be all or a strategy name: ", s.status().message()));
  }
  return std::vector<ShardingStrategy>{*s};
}

absl::Status CheckPositive(const char* flag, double value) {
  if (!(value > 0) || !std::isfinite(value)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s must be a positive number, got %g", flag, value));
  }
  return absl::OkStatus();
}

absl::Status CheckNonNegative(const char* flag, double value) {
  if (!(value >= 0) || !std::isfinite(value)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s must be a number >= 0, got %g", flag, value));
  }
  return absl::OkStatus();
}

// The topology with the user's scale and overrides applied.
absl::StatusOr<cost::Topology> ResolveTopology(const PlanOptions& o) {
  absl::StatusOr<cost::Topology> t = cost::FindTopologyPreset(o.topology);
  if (!t.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--topology: ", t.status().message()));
  }
  t->link.nodes = static_cast<int>(o.nodes);
  if (o.gpus_per_node != 0) {
    t->link.gpus_per_node = static_cast<int>(o.gpus_per_node);
  }
  if (o.intra_gbps) t->link.intra_bytes_per_second = *o.intra_gbps * 1e9;
  if (o.inter_gbps) t->link.inter_bytes_per_second = *o.inter_gbps * 1e9;
  if (o.intra_latency_us) t->link.intra_latency_s = *o.intra_latency_us * 1e-6;
  if (o.inter_latency_us) t->link.inter_latency_s = *o.inter_latency_us * 1e-6;
  if (!o.gpu_memory.empty()) {
    absl::StatusOr<int64_t> bytes = ParseByteSize(o.gpu_memory);
    if (!bytes.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--gpu-memory: ", bytes.status().message()));
    }
    t->gpu.memory_bytes = *bytes;
  }
  return t;
}

int64_t SumOf(const ModelLayout& layout,
              int64_t (FlatParamLayout::*f)() const) {
  int64_t s = 0;
  for (const FlatParamLayout& l : layout.flat_params()) s += (l.*f)();
  return s;
}

std::string Seconds(double s) {
  if (s >= 1) return absl::StrFormat("%.3f s", s);
  if (s >= 1e-3) return absl::StrFormat("%.2f ms", s * 1e3);
  return absl::StrFormat("%.1f us", s * 1e6);
}

}  // namespace

absl::StatusOr<int64_t> ParseByteSize(absl::string_view text) {
  std::string s = absl::AsciiStrToLower(absl::StripAsciiWhitespace(text));
  struct Unit {
    const char* suffix;
    double scale;
  };
  // Longest suffixes first.
  const Unit units[] = {
      {"kib", 1024.0},
      {"mib", 1024.0 * 1024},
      {"gib", 1024.0 * 1024 * 1024},
      {"tib", 1024.0 * 1024 * 1024 * 1024},
      {"kb", 1e3},
      {"mb", 1e6},
      {"gb", 1e9},
      {"tb", 1e12},
      {"b", 1},
  };
  double scale = 1;
  absl::string_view number = s;
  for (const Unit& u : units) {
    if (absl::ConsumeSuffix(&number, u.suffix)) {
      scale = u.scale;
      break;
    }
  }
  number = absl::StripAsciiWhitespace(number);
  double value = 0;
  if (number.empty() || !absl::SimpleAtod(number, &value) ||
      !std::isfinite(value) || value <= 0 || value * scale > 9e18) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "\"%s\" is not a positive size such as 80GiB, 80GB or 1024", text));
  }
  return static_cast<int64_t>(std::llround(value * scale));
}

absl::Status ValidatePlanOptions(const PlanOptions& o) {
  if (o.model.empty()) {
    return absl::InvalidArgumentError(
        "--model is required: a preset (gpt2, llama2-7b, ...) or a model "
        "file path");
  }
  if (o.nodes < 1 || o.nodes > kMaxPlanNodes) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--nodes must be between 1 and %d, got %d", kMaxPlanNodes, o.nodes));
  }
  if (o.gpus_per_node < 0 || o.gpus_per_node > 1024) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--gpus-per-node must be between 1 and 1024 (or 0 for the "
        "topology's), got %d",
        o.gpus_per_node));
  }
  FLATPARAM_RETURN_IF_ERROR(ParseStrategies(o.strategy).status());
  FLATPARAM_RETURN_IF_ERROR(ParseMixedPrecision(o.mixed_precision).status());
  const std::string optimizer = absl::AsciiStrToLower(o.optimizer);
  if (optimizer != "adamw" && optimizer != "sgd") {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--optimizer must be adamw or sgd, got \"%s\"", o.optimizer));
  }
  FLATPARAM_RETURN_IF_ERROR(
      CheckPositive("--tokens-per-gpu", o.tokens_per_gpu));
  if (o.intra_gbps) {
    FLATPARAM_RETURN_IF_ERROR(
        CheckPositive("--intra-bandwidth", *o.intra_gbps));
  }
  if (o.inter_gbps) {
    FLATPARAM_RETURN_IF_ERROR(
        CheckPositive("--inter-bandwidth", *o.inter_gbps));
  }
  if (o.intra_latency_us) {
    FLATPARAM_RETURN_IF_ERROR(
        CheckNonNegative("--intra-latency-us", *o.intra_latency_us));
  }
  if (o.inter_latency_us) {
    FLATPARAM_RETURN_IF_ERROR(
        CheckNonNegative("--inter-latency-us", *o.inter_latency_us));
  }
  if (o.peak_tflops) {
    FLATPARAM_RETURN_IF_ERROR(CheckPositive("--peak-tflops", *o.peak_tflops));
  }
  if (!(o.efficiency > 0 && o.efficiency <= 1)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--efficiency must be in (0, 1], got %g", o.efficiency));
  }
  FLATPARAM_RETURN_IF_ERROR(ParseOutputFormat(o.format).status());
  FLATPARAM_ASSIGN_OR_RETURN(cost::Topology topology, ResolveTopology(o));
  if (topology.link.world_size() > kMaxWorldSize) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--nodes=%d x --gpus-per-node=%d is more than %d ranks",
                        o.nodes, topology.link.gpus_per_node, kMaxWorldSize));
  }
  return absl::OkStatus();
}

absl::StatusOr<ResolvedLayout> ResolvePlanLayout(const PlanOptions& options,
                                                 const cost::LinkSpec& link,
                                                 ShardingStrategy strategy) {
  FLATPARAM_ASSIGN_OR_RETURN(std::optional<DType> low,
                             ParseMixedPrecision(options.mixed_precision));
  LayoutRequest request;
  request.model = options.model;
  request.world_size = link.world_size();
  request.strategy = std::string(ShardingStrategyName(strategy));
  request.align_addresses = options.align_addresses;
  request.shard_group_size =
      IsHybridStrategy(strategy) ? link.gpus_per_node : 0;
  if (low) {
    // Float32 master weights, computed in the low precision.
    request.dtype = "float32";
    request.compute_dtype = std::string(DTypeName(*low));
  }
  return ResolveLayout(request);
}

absl::StatusOr<Plan> MakePlan(const PlanOptions& options) {
  FLATPARAM_RETURN_IF_ERROR(ValidatePlanOptions(options));
  FLATPARAM_ASSIGN_OR_RETURN(std::vector<ShardingStrategy> strategies,
                             ParseStrategies(options.strategy));
  FLATPARAM_ASSIGN_OR_RETURN(std::optional<DType> low,
                             ParseMixedPrecision(options.mixed_precision));
  Plan plan;
  plan.model = options.model;
  FLATPARAM_ASSIGN_OR_RETURN(plan.topology, ResolveTopology(options));
  const cost::LinkSpec& link = plan.topology.link;
  plan.mixed_precision =
      low ? (*low == DType::kBFloat16 ? "bf16" : "fp16") : "none";
  plan.optimizer = absl::AsciiStrToLower(options.optimizer);
  plan.tokens_per_gpu = options.tokens_per_gpu;
  plan.efficiency = options.efficiency;
  plan.gpu_memory_bytes = plan.topology.gpu.memory_bytes;

  for (ShardingStrategy strategy : strategies) {
    FLATPARAM_ASSIGN_OR_RETURN(ResolvedLayout resolved,
                               ResolvePlanLayout(options, link, strategy));
    const ModelLayout& layout = resolved.layout;

    const DType orig = layout.flat_params().front().dtype();
    for (const FlatParamLayout& l : layout.flat_params()) {
      if (l.dtype() != orig) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "unit \"%s\" is %s but unit \"%s\" is %s; the plan needs one "
            "parameter dtype (or --mixed-precision, which keeps float32 "
            "master weights)",
            l.unit(), DTypeName(l.dtype()), layout.flat_params().front().unit(),
            DTypeName(orig)));
      }
    }
    const DType param = low.value_or(orig);
    const int64_t b_o = DTypeSize(orig);
    const int64_t b_p = DTypeSize(param);
    plan.orig_dtype = orig;
    plan.param_dtype = param;
    plan.param_numel = layout.param_numel();
    plan.units = static_cast<int64_t>(layout.flat_params().size());
    // AdamW: momentum and variance; SGD: the momentum buffer (fsdp train's
    // SGD uses momentum 0.9).
    const int64_t state_per_element = plan.optimizer == "adamw" ? 2 * b_o : b_o;
    plan.bytes_per_element = {b_p, b_p, (low ? 4 : 0) + state_per_element};
    plan.peak_flops = options.peak_tflops ? *options.peak_tflops * 1e12
                      : param == DType::kFloat32 || param == DType::kFloat64
                          ? plan.topology.gpu.peak_flops_fp32
                          : plan.topology.gpu.peak_flops_low_precision;

    StrategyPlan sp;
    sp.strategy = strategy;
    sp.shard_degree =
        UsesShardedStrategy(strategy) ? resolved.shard_group_size : 1;
    const int64_t sharded = SumOf(layout, &FlatParamLayout::sharded_numel);
    const int64_t whole =
        SumOf(layout, &FlatParamLayout::padded_unsharded_numel);
    const bool shard_params = strategy == ShardingStrategy::kFullShard ||
                              strategy == ShardingStrategy::kHybridShard;
    const bool shard_states = UsesShardedStrategy(strategy);
    const BytesPerElement& per = plan.bytes_per_element;
    sp.param_bytes = per.params * (shard_params ? sharded : whole);
    sp.grad_bytes = per.grads * (shard_states ? sharded : whole);
    sp.optimizer_bytes = per.optimizer * (shard_states ? sharded : whole);

    const std::vector<cost::UnitSpec> units = cost::UnitsOf(layout);
    cost::StepOptions step;
    step.strategy = strategy;
    step.link = link;
    step.orig_dtype = orig;
    step.param_dtype = param;
    step.reduce_dtype = param;
    step.optimizer_state_bytes_per_element = state_per_element;
    step.tokens_per_rank = options.tokens_per_gpu;
    step.peak_flops = plan.peak_flops;
    step.efficiency = options.efficiency;
    FLATPARAM_ASSIGN_OR_RETURN(sp.prediction, cost::PredictStep(units, step));
    sp.fits = sp.prediction.peak_bytes <= plan.gpu_memory_bytes;
    plan.strategies.push_back(std::move(sp));
  }
  return plan;
}

nlohmann::json PlanJson(const Plan& plan) {
  using nlohmann::json;
  const cost::Topology& t = plan.topology;
  json strategies = json::array();
  for (const StrategyPlan& s : plan.strategies) {
    const cost::StepPrediction& p = s.prediction;
    json peak_by = json::object();
    for (int k = 0; k < cost::kNumMemoryKinds; ++k) {
      peak_by[std::string(cost::MemoryKindName(
          static_cast<cost::MemoryKind>(k)))] = p.peak_breakdown[k];
    }
    json comm = json::object();
    for (int c = 0; c < 3; ++c) {
      const cost::CommVolume& v = p.comm[c];
      comm[std::string(cost::CollectiveName(
          static_cast<cost::Collective>(c)))] = {{"calls", v.calls},
                                                 {"bytes", v.bytes},
                                                 {"sent_bytes", v.sent_bytes},
                                                 {"seconds", v.seconds}};
    }
    strategies.push_back(
        {{"strategy", std::string(ShardingStrategyName(s.strategy))},
         {"shard_degree", s.shard_degree},
         {"bytes_per_rank",
          {{"params", s.param_bytes},
           {"grads", s.grad_bytes},
           {"optimizer", s.optimizer_bytes},
           {"model_states", s.model_state_bytes()}}},
         {"peak_bytes", p.peak_bytes},
         {"peak_breakdown", std::move(peak_by)},
         {"comm_bytes_per_step", p.comm_sent_bytes()},
         {"comm", std::move(comm)},
         {"step_time_s", p.step_seconds},
         {"compute_time_s", p.compute_seconds},
         {"exposed_comm_s", p.exposed_comm_seconds},
         {"fits", s.fits}});
  }
  return {
      {"model", plan.model},
      {"param_numel", plan.param_numel},
      {"units", plan.units},
      {"nodes", t.link.nodes},
      {"gpus_per_node", t.link.gpus_per_node},
      {"world_size", plan.world_size()},
      {"topology",
       {{"name", t.name},
        {"description", t.description},
        {"intra_bytes_per_second", t.link.intra_bytes_per_second},
        {"intra_latency_s", t.link.intra_latency_s},
        {"inter_bytes_per_second", t.link.inter_bytes_per_second},
        {"inter_latency_s", t.link.inter_latency_s}}},
      {"mixed_precision", plan.mixed_precision},
      {"param_dtype", std::string(DTypeName(plan.param_dtype))},
      {"master_dtype", std::string(DTypeName(plan.orig_dtype))},
      {"optimizer", plan.optimizer},
      {"bytes_per_param",
       {{"params", plan.bytes_per_element.params},
        {"grads", plan.bytes_per_element.grads},
        {"optimizer", plan.bytes_per_element.optimizer}}},
      {"tokens_per_gpu", plan.tokens_per_gpu},
      {"peak_flops", plan.peak_flops},
      {"efficiency", plan.efficiency},
      {"gpu_memory_bytes", plan.gpu_memory_bytes},
      {"strategies", std::move(strategies)},
  };
}

void PrintPlanTable(const Plan& plan, std::ostream& out) {
  const cost::Topology& t = plan.topology;
  const BytesPerElement& per = plan.bytes_per_element;
  out << absl::StrFormat(
      "model %s: %d parameters in %d units; %d node%s x %d GPUs = %d ranks\n",
      plan.model, plan.param_numel, plan.units, t.link.nodes,
      t.link.nodes == 1 ? "" : "s", t.link.gpus_per_node, plan.world_size());
  out << absl::StrFormat(
      "topology %s: intra-node %.1f GB/s, %.1f us; inter-node %.2f GB/s per "
      "GPU, %.1f us\n",
      t.name, t.link.intra_bytes_per_second / 1e9, t.link.intra_latency_s * 1e6,
      t.link.inter_bytes_per_second / 1e9, t.link.inter_latency_s * 1e6);
  out << absl::StrFormat(
      "compute %.0f TFLOP/s x %.2f efficiency, %.0f tokens per GPU per step\n",
      plan.peak_flops / 1e12, plan.efficiency, plan.tokens_per_gpu);
  out << absl::StrFormat(
      "memory: mixed precision %s, %s: %d + %d + %d bytes per parameter "
      "(params + grads + optimizer); GPU memory %s, activations not "
      "included\n\n",
      plan.mixed_precision, plan.optimizer, per.params, per.grads,
      per.optimizer, HumanBytes(plan.gpu_memory_bytes));
  const char* row = "%-19s %6s %11s %11s %11s %12s %11s %11s %11s %12s  %s\n";
  out << absl::StrFormat(row, "strategy", "shards", "params", "grads",
                         "optimizer", "model states", "peak", "comm/step",
                         "step time", "exposed comm", "fits");
  for (const StrategyPlan& s : plan.strategies) {
    const cost::StepPrediction& p = s.prediction;
    out << absl::StrFormat(
        row, ShardingStrategyName(s.strategy), absl::StrCat(s.shard_degree),
        HumanBytes(s.param_bytes), HumanBytes(s.grad_bytes),
        HumanBytes(s.optimizer_bytes), HumanBytes(s.model_state_bytes()),
        HumanBytes(p.peak_bytes), HumanBytes(p.comm_sent_bytes()),
        Seconds(p.step_seconds), Seconds(p.exposed_comm_seconds),
        s.fits ? "yes" : "NO");
  }
  out << "\ncomm/step: bytes each rank sends (ring); peak: the per-rank "
         "memory timeline of FSDP's buffers.\n";
}

absl::Status RunPlan(const PlanOptions& options, std::ostream& out) {
  FLATPARAM_ASSIGN_OR_RETURN(Plan plan, MakePlan(options));
  if (!options.trace_path.empty()) {
    std::vector<cost::NamedPrediction> named;
    for (const StrategyPlan& s : plan.strategies) {
      named.push_back(
          {std::string(ShardingStrategyName(s.strategy)), &s.prediction});
    }
    std::ofstream file(options.trace_path, std::ios::binary | std::ios::trunc);
    if (!file) {
      return absl::InternalError(
          absl::StrFormat("cannot open --trace=%s for writing: %s",
                          options.trace_path, std::strerror(errno)));
    }
    file << cost::PredictionTraceJson(named);
    file.close();
    if (!file) {
      return absl::InternalError(absl::StrFormat(
          "error writing the trace to --trace=%s", options.trace_path));
    }
  }
  FLATPARAM_ASSIGN_OR_RETURN(OutputFormat format,
                             ParseOutputFormat(options.format));
  if (format == OutputFormat::kJson) {
    out << PlanJson(plan).dump(2) << "\n";
  } else {
    PrintPlanTable(plan, out);
  }
  return absl::OkStatus();
}

}  // namespace tools
}  // namespace flatparam
