#include "tools/train.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <utility>
#include <variant>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/checkpoint/checkpoint_dir.h"
#include "flatparam/checkpoint/collective_checkpoint.h"
#include "flatparam/checkpoint/convert.h"
#include "flatparam/checkpoint/file_system.h"
#include "flatparam/checkpoint/training_checkpoints.h"
#include "flatparam/checkpoint/training_state.h"
#include "flatparam/layout.h"
#include "refmodel/mlp_model.h"
#include "refmodel/optimizer.h"
#include "refmodel/reference_trainer.h"
#include "refmodel/tensor_diff.h"
#include "refmodel/train_state.h"
#include "sim/sim.h"
#include "tools/collective_timeout.h"
#include "tools/layout_request.h"
#include "tools/paths.h"

namespace flatparam {
namespace tools {
namespace {

// --save and --load: stands for the global step in a directory name.

using TensorMap = std::map<std::string, HostTensor>;
using json = nlohmann::json;

absl::Status Bad(absl::string_view message) {
  return absl::InvalidArgumentError(message);
}

// Largest |a - b| over two runs' parameters or optimizer states
// (refmodel/tensor_diff.h), and here over two loss sequences.
using refmodel::MaxAbs;
using refmodel::MaxAbsDiff;

double MaxAbsDiff(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return std::nan("");
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isnan(a[i]) != std::isnan(b[i])) return std::nan("");
    if (!std::isnan(a[i])) {
      worst = std::max(worst, std::abs(static_cast<double>(a[i]) - b[i]));
    }
  }
  return worst;
}

// Maximum of differences, NaN-propagating.
double Worst(std::initializer_list<double> diffs) {
  double worst = 0;
  for (double d : diffs) {
    if (std::isnan(d)) return d;
    worst = std::max(worst, d);
  }
  return worst;
}

// RankSummary <-> bytes, for AllGatherBytes.
std::string Serialize(const RankSummary& s) {
  std::vector<int64_t> v = {s.rank,
                            s.optimizer_state_bytes,
                            s.nonzero_padding_grads,
                            s.memory.compute_peak,
                            s.memory.offload_peak,
                            absl::ToInt64Nanoseconds(s.save_blocked_max),
                            absl::ToInt64Nanoseconds(s.save_blocked_total)};
  for (int c = 0; c < kNumMemoryCategories; ++c) {
    v.push_back(s.memory.peak[c]);
    v.push_back(s.memory.current[c]);
  }
  for (const CollectiveTraffic* t :
       {&s.comm.all_gather, &s.comm.reduce_scatter, &s.comm.all_reduce}) {
    v.insert(v.end(), {t->calls, t->bytes, t->sent_bytes});
  }
  return std::string(reinterpret_cast<const char*>(v.data()),
                     v.size() * sizeof(int64_t));
}

absl::StatusOr<RankSummary> Deserialize(const std::string& bytes) {
  constexpr size_t kFields = 7 + 2 * kNumMemoryCategories + 9;
  if (bytes.size() != kFields * sizeof(int64_t)) {
    return absl::InternalError(
        absl::StrFormat("a rank sent a summary of %d bytes, want %d",
                        bytes.size(), kFields * sizeof(int64_t)));
  }
  std::vector<int64_t> v(kFields);
  std::memcpy(v.data(), bytes.data(), bytes.size());
  RankSummary s;
  size_t i = 0;
  s.rank = static_cast<int>(v[i++]);
  s.optimizer_state_bytes = v[i++];
  s.nonzero_padding_grads = v[i++];
  s.memory.compute_peak = v[i++];
  s.memory.offload_peak = v[i++];
  s.save_blocked_max = absl::Nanoseconds(v[i++]);
  s.save_blocked_total = absl::Nanoseconds(v[i++]);
  for (int c = 0; c < kNumMemoryCategories; ++c) {
    s.memory.peak[c] = v[i++];
    s.memory.current[c] = v[i++];
  }
  for (CollectiveTraffic* t :
       {&s.comm.all_gather, &s.comm.reduce_scatter, &s.comm.all_reduce}) {
    t->calls = v[i++];
    t->bytes = v[i++];
    t->sent_bytes = v[i++];
  }
  return s;
}

std::string DescribeOptimizer(const refmodel::OptimizerOptions& o) {
  if (const auto* sgd = std::get_if<refmodel::SgdOptions>(&o)) {
    return absl::StrFormat("sgd (lr %g, momentum %g)", sgd->lr, sgd->momentum);
  }
  const auto& adamw = std::get<refmodel::AdamWOptions>(o);
  return absl::StrFormat("adamw (lr %g, betas %g/%g, weight decay %g)",
                         adamw.lr, adamw.beta1, adamw.beta2,
                         adamw.weight_decay);
}

std::string Precision(const refmodel::FsdpTrainOptions& o) {
  return o.param_dtype.has_value()
             ? absl::StrFormat("%s parameters and gradients",
                               DTypeName(*o.param_dtype))
             : std::string("none (float32)");
}

json OptimizerJson(const refmodel::OptimizerOptions& o) {
  if (const auto* sgd = std::get_if<refmodel::SgdOptions>(&o)) {
    return {{"kind", "sgd"},
            {"lr", sgd->lr},
            {"momentum", sgd->momentum},
            {"dampening", sgd->dampening},
            {"weight_decay", sgd->weight_decay},
            {"nesterov", sgd->nesterov},
            {"maximize", sgd->maximize}};
  }
  const auto& a = std::get<refmodel::AdamWOptions>(o);
  return {{"kind", "adamw"},       {"lr", a.lr},
          {"beta1", a.beta1},      {"beta2", a.beta2},
          {"eps", a.eps},          {"weight_decay", a.weight_decay},
          {"maximize", a.maximize}};
}

// PyTorch's param_groups entry for the optimizer over flat parameters
// 0..n-1 (the flat-parameter path's keys).
optim::ParamGroup ParamGroupFor(const refmodel::OptimizerOptions& o,
                                int64_t n) {
  optim::ParamGroup group;
  if (const auto* sgd = std::get_if<refmodel::SgdOptions>(&o)) {
    group.hyperparams = {{"lr", sgd->lr},
                         {"momentum", sgd->momentum},
                         {"dampening", sgd->dampening},
                         {"weight_decay", sgd->weight_decay},
                         {"nesterov", sgd->nesterov},
                         {"maximize", sgd->maximize}};
  } else {
    const auto& a = std::get<refmodel::AdamWOptions>(o);
    group.hyperparams = {
        {"lr", a.lr},       {"betas", std::vector<double>{a.beta1, a.beta2}},
        {"eps", a.eps},     {"weight_decay", a.weight_decay},
        {"amsgrad", false}, {"maximize", a.maximize}};
  }
  // Built in place: GCC 12 at -O2 reports a moved temporary variant's
  // inactive string member as maybe-uninitialized.
  for (int64_t i = 0; i < n; ++i) {
    group.params.emplace_back(std::in_place_type<int64_t>, i);
  }
  return group;
}

json SegmentJson(const TrainSegment& s) {
  return {{"first_step", s.first_step},
          {"steps", s.steps},
          {"world_size", s.world_size},
          {"strategy", std::string(ShardingStrategyName(s.strategy))},
          {"shard_group_size", s.shard_group_size},
          {"global_batch", s.global_batch},
          {"micro_batches", s.micro_batches}};
}

TrainSegment SegmentOf(const refmodel::FsdpTrainOptions& o, int world_size) {
  return {o.first_step,       o.steps,        world_size,     o.strategy,
          o.shard_group_size, o.global_batch, o.micro_batches};
}

// The segments, with their batch where it differs from `o`'s (this run's).
std::string DescribeSegments(const std::vector<TrainSegment>& segments,
                             const refmodel::FsdpTrainOptions& o) {
  std::vector<std::string> parts;
  for (const TrainSegment& s : segments) {
    parts.push_back(absl::StrFormat(
        "steps %d-%d on %d ranks %s%s%s", s.first_step,
        s.first_step + s.steps - 1, s.world_size,
        ShardingStrategyName(s.strategy),
        IsHybridStrategy(s.strategy)
            ? absl::StrFormat(" (groups of %d)", s.shard_group_size)
            : "",
        s.global_batch != o.global_batch || s.micro_batches != o.micro_batches
            ? absl::StrFormat(" with %d micro-batch%s of %d samples",
                              s.micro_batches, s.micro_batches == 1 ? "" : "es",
                              s.global_batch)
            : ""));
  }
  return absl::StrJoin(parts, "; ");
}

// Single-process training of every segment of `history` and then of
// `options` (see train.h), chained; `fp32` drops mixed precision.
absl::StatusOr<refmodel::TrainResult> ChainedReference(
    const refmodel::FsdpTrainOptions& options, int world_size,
    const std::vector<TrainSegment>& history, bool fp32) {
  FLATPARAM_ASSIGN_OR_RETURN(
      refmodel::TrainOptions base,
      refmodel::ReferenceOptionsFor(options, world_size));
  if (fp32) {
    base.param_dtype.reset();
    base.reduce_dtype.reset();
  }
  std::optional<refmodel::TrainResult> previous;
  auto run = [&](refmodel::TrainOptions o) -> absl::Status {
    if (previous.has_value()) {
      o.initial_params = previous->params;
      o.initial_optimizer_state = previous->optimizer_state;
    }
    FLATPARAM_ASSIGN_OR_RETURN(previous,
                               refmodel::TrainReference(options.model, o));
    return absl::OkStatus();
  };
  for (const TrainSegment& s : history) {
    refmodel::TrainOptions o = base;
    o.first_step = s.first_step;
    o.steps = s.steps;
    o.global_batch = s.global_batch;
    o.micro_batches = s.micro_batches;
    o.reduction = IsHybridStrategy(s.strategy)
                      ? refmodel::GradientReduction::Hybrid(s.world_size,
                                                            s.shard_group_size)
                      : refmodel::GradientReduction::Fsdp(s.world_size);
    FLATPARAM_RETURN_IF_ERROR(run(o));
  }
  FLATPARAM_RETURN_IF_ERROR(run(base));
  return *std::move(previous);
}

}  // namespace

std::string DescribePrefetch(const refmodel::FsdpTrainOptions& o) {
  std::vector<std::string> kinds;
  if (o.forward_prefetch) kinds.push_back("forward");
  if (o.backward_prefetch != BackwardPrefetch::kNone) {
    kinds.push_back(std::string(BackwardPrefetchName(o.backward_prefetch)));
  }
  if (kinds.empty()) return "prefetch none";
  return absl::StrFormat("prefetch %s (depth %d, limit_all_gathers %s)",
                         absl::StrJoin(kinds, " + "), o.prefetch_depth,
                         o.limit_all_gathers == 0
                             ? std::string("0: unlimited")
                             : absl::StrCat(o.limit_all_gathers));
}

json TrainExtra(const TrainCommandOptions& command,
                const refmodel::FsdpTrainOptions& options, int world_size,
                const std::vector<TrainSegment>& history) {
  json segments = json::array();
  for (const TrainSegment& s : history) segments.push_back(SegmentJson(s));
  segments.push_back(SegmentJson(SegmentOf(options, world_size)));
  return {
      {"step", options.first_step + options.steps},
      {"segments", segments},
      // The flags a resumed run takes over (ResumeFromExtra).
      {"settings",
       {{"seed", command.seed},
        {"optimizer", command.optimizer},
        {"lr", command.lr},
        {"global_batch", options.global_batch},
        {"micro_batches", command.micro_batches},
        {"no_sync", command.no_sync},
        {"mixed_precision", command.mixed_precision}}},
      // What they mean, for readers other than fsdp train.
      {"model",
       {{"vocab", options.model.vocab},
        {"dims", options.model.dims},
        {"seed", options.model.seed}}},
      {"data_seed", options.data_seed},
      {"optimizer", OptimizerJson(options.optimizer)},
  };
}

absl::StatusOr<ResumePoint> ResumeFromExtra(const TrainCommandOptions& command,
                                            const json& extra) {
  ResumePoint point;
  point.command = command;
  TrainCommandOptions& c = point.command;
  auto text = [](const auto& v) -> std::string {
    using T = std::decay_t<decltype(v)>;
    if constexpr (std::is_same_v<T, std::string>) {
      return v;
    } else if constexpr (std::is_floating_point_v<T>) {
      return absl::StrFormat("%g", v);
    } else {
      return absl::StrCat(v);
    }
  };
  auto conflict = [&](const std::string& flag, const auto& given,
                      const auto& saved) -> absl::Status {
    std::string name = flag;
    std::replace(name.begin(), name.end(), '_', '-');
    return Bad(absl::StrCat(
        "--", name, "=", text(given), " differs from the checkpoint's ",
        text(saved),
        ": a resumed run continues with the saved settings (leave out --", name,
        ")"));
  };
  try {
    if (!extra.is_object())
      throw json::type_error::create(302, "not an object", nullptr);
    point.first_step = extra.at("step").get<int64_t>();
    for (const json& s : extra.at("segments")) {
      TrainSegment segment;
      segment.first_step = s.at("first_step").get<int64_t>();
      segment.steps = s.at("steps").get<int64_t>();
      segment.world_size = s.at("world_size").get<int>();
      absl::StatusOr<ShardingStrategy> strategy =
          ParseShardingStrategy(s.at("strategy").get<std::string>());
      if (!strategy.ok()) {
        return absl::DataLossError(
            absl::StrCat("the checkpoint's training history: ",
                         strategy.status().message()));
      }
      segment.strategy = *strategy;
      segment.shard_group_size = s.at("shard_group_size").get<int>();
      // Checkpoints written before segments recorded their batch trained
      // every segment with the settings' batch.
      segment.global_batch =
          s.value("global_batch",
                  extra.at("settings").at("global_batch").get<int64_t>());
      segment.micro_batches =
          s.value("micro_batches",
                  extra.at("settings").at("micro_batches").get<int64_t>());
      point.history.push_back(segment);
    }
    const json& settings = extra.at("settings");
    // The batch may change from here on (a restart on fewer or more
    // ranks): the new segment trains with the given value.
    const auto take_or_change = [&](const std::string& flag, const char* key,
                                    int64_t& field) {
      if (command.given_flags.count(flag) == 0) {
        field = settings.at(key).get<int64_t>();
      }
    };
    const auto take = [&](const std::string& flag, const char* key,
                          auto& field) -> absl::Status {
      using T = std::decay_t<decltype(field)>;
      const T saved = settings.at(key).get<T>();
      if (command.given_flags.count(flag) != 0 && field != saved) {
        return conflict(flag, field, saved);
      }
      field = saved;
      return absl::OkStatus();
    };
    FLATPARAM_RETURN_IF_ERROR(take("seed", "seed", c.seed));
    FLATPARAM_RETURN_IF_ERROR(take("optimizer", "optimizer", c.optimizer));
    FLATPARAM_RETURN_IF_ERROR(take("lr", "lr", c.lr));
    take_or_change("global_batch", "global_batch", c.global_batch);
    take_or_change("micro_batches", "micro_batches", c.micro_batches);
    FLATPARAM_RETURN_IF_ERROR(
        take("mixed_precision", "mixed_precision", c.mixed_precision));
    const bool saved_no_sync = settings.at("no_sync").get<bool>();
    if (command.given_flags.count("sync") != 0 && c.no_sync != saved_no_sync) {
      return Bad(absl::StrCat("--", c.no_sync ? "no-sync" : "sync",
                              " differs from the checkpoint, which was "
                              "trained with --",
                              saved_no_sync ? "no-sync" : "sync",
                              ": a resumed run continues with the saved "
                              "settings"));
    }
    c.no_sync = saved_no_sync;
  } catch (const json::exception& e) {
    return absl::DataLossError(
        absl::StrCat("the checkpoint's \"extra\".", kTrainExtraKey,
                     " is not what fsdp train writes: ", e.what()));
  }
  return point;
}

namespace {

struct SkipForwardFault {
  int rank = 0;
  int64_t step = 0;
  std::string unit;
};

absl::StatusOr<SkipForwardFault> ParseSkipForward(const std::string& text) {
  const std::vector<std::string> parts = absl::StrSplit(text, ':');
  SkipForwardFault f;
  if (parts.size() != 3 || !absl::SimpleAtoi(parts[0], &f.rank) ||
      !absl::SimpleAtoi(parts[1], &f.step) || f.rank < 0 || f.step < 0) {
    return Bad(absl::StrFormat(
        "--fault-skip-forward=%s: expected RANK:STEP:UNIT (for example "
        "1:3:layers.1)",
        text));
  }
  f.unit = parts[2];
  return f;
}

}  // namespace

absl::Status ValidateTrainCommandOptions(const TrainCommandOptions& o) {
  if (!o.fault_skip_forward.empty()) {
    FLATPARAM_RETURN_IF_ERROR(ParseSkipForward(o.fault_skip_forward).status());
  }
  if (o.backend != "sim" && o.backend != "mpi" && o.backend != "nccl" &&
      o.backend != "c10d") {
    return Bad(absl::StrFormat("--backend=%s: expected sim, mpi, nccl or c10d",
                               o.backend));
  }
  if (o.world_size < 1) {
    return Bad(absl::StrFormat("--world-size=%d: must be >= 1", o.world_size));
  }
  if (!ParseShardingStrategy(o.strategy).ok()) {
    return Bad(absl::StrFormat(
        "--strategy=%s: expected FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, "
        "HYBRID_SHARD or HYBRID_SHARD_ZERO2",
        o.strategy));
  }
  if (o.shard_group_size < 0) {
    return Bad(absl::StrFormat("--shard-group-size=%d: must be >= 1",
                               o.shard_group_size));
  }
  if (o.steps < 1) {
    return Bad(absl::StrFormat("--steps=%d: must be >= 1", o.steps));
  }
  if (o.micro_batches < 1) {
    return Bad(
        absl::StrFormat("--micro-batches=%d: must be >= 1", o.micro_batches));
  }
  if (o.mixed_precision != "none" && o.mixed_precision != "bf16" &&
      o.mixed_precision != "fp16") {
    return Bad(
        absl::StrFormat("--mixed-precision=%s: expected bf16, fp16 or none",
                        o.mixed_precision));
  }
  if (o.backward_prefetch != "none" && o.backward_prefetch != "pre" &&
      o.backward_prefetch != "post") {
    return Bad(absl::StrFormat(
        "--backward-prefetch=%s: expected none, pre (BACKWARD_PRE) or post "
        "(BACKWARD_POST)",
        o.backward_prefetch));
  }
  // The runtime takes ints.
  constexpr int64_t kMaxInt = std::numeric_limits<int>::max();
  if (o.prefetch_depth < 1 || o.prefetch_depth > kMaxInt) {
    return Bad(absl::StrFormat("--prefetch-depth=%d: must be in [1, %d]",
                               o.prefetch_depth, kMaxInt));
  }
  if (o.limit_all_gathers < 0 || o.limit_all_gathers > kMaxInt) {
    return Bad(absl::StrFormat(
        "--limit-all-gathers=%d: must be in [0, %d] (0: unlimited)",
        o.limit_all_gathers, kMaxInt));
  }
  if (o.optimizer != "adamw" && o.optimizer != "sgd") {
    return Bad(
        absl::StrFormat("--optimizer=%s: expected adamw or sgd", o.optimizer));
  }
  if (!(std::isfinite(o.lr) && o.lr > 0)) {
    return Bad(absl::StrFormat("--lr=%g: must be finite and > 0", o.lr));
  }
  if (o.global_batch < 0) {
    return Bad(
        absl::StrFormat("--global-batch=%d: must be >= 1 (0: 2 per "
                        "rank)",
                        o.global_batch));
  }
  if (o.log_every < 0) {
    return Bad(absl::StrFormat("--log-every=%d: must be >= 0", o.log_every));
  }
  if (o.save_every.has_value() && *o.save_every < 1) {
    return Bad(absl::StrFormat("--save-every=%d: must be >= 1", *o.save_every));
  }
  if (o.save_every.has_value() && o.save_dir.empty()) {
    return Bad(absl::StrFormat(
        "--save-every=%d needs --save=DIR (where to save)", *o.save_every));
  }
  if (o.async_save && o.save_dir.empty()) {
    return Bad("--async-save needs --save=DIR (where to save)");
  }
  if (o.resume &&
      !absl::StrContains(o.save_dir, checkpoint::kStepPlaceholder)) {
    return Bad(absl::StrFormat(
        "--resume needs --save with \"{step}\" in its last component (the "
        "checkpoints it resumes from), got --save=%s",
        o.save_dir.empty() ? "(none)" : o.save_dir));
  }
  if (o.resume && !o.load_dir.empty()) {
    return Bad(absl::StrFormat(
        "--resume resumes from --save's checkpoints; drop --load=%s",
        o.load_dir));
  }
  return ValidateCollectiveTimeout(o.timeout);
}

absl::StatusOr<refmodel::FsdpTrainOptions> MakeFsdpTrainOptions(
    const TrainCommandOptions& c, int world_size) {
  FLATPARAM_RETURN_IF_ERROR(ValidateTrainCommandOptions(c));
  refmodel::FsdpTrainOptions o;
  FLATPARAM_ASSIGN_OR_RETURN(o.strategy, ParseShardingStrategy(c.strategy));
  if (IsHybridStrategy(o.strategy)) {
    const int64_t group = c.shard_group_size != 0
                              ? c.shard_group_size
                              : DefaultShardGroupSize(world_size);
    if (world_size % group != 0) {
      return Bad(absl::StrFormat(
          "--shard-group-size=%d must divide the world size %d (%s shards "
          "over groups of that many ranks)",
          group, world_size, c.strategy));
    }
    o.shard_group_size = static_cast<int>(group);
  } else if (c.shard_group_size != 0) {
    return Bad(
        absl::StrFormat("--shard-group-size=%d is only for HYBRID_SHARD and "
                        "HYBRID_SHARD_ZERO2, not %s",
                        c.shard_group_size, ShardingStrategyName(o.strategy)));
  }
  o.align_addresses = c.align_addresses;
  o.cpu_offload = c.cpu_offload;
  o.backward_prefetch = c.backward_prefetch == "none" ? BackwardPrefetch::kNone
                        : c.backward_prefetch == "post"
                            ? BackwardPrefetch::kBackwardPost
                            : BackwardPrefetch::kBackwardPre;
  o.forward_prefetch = c.forward_prefetch;
  o.prefetch_depth = static_cast<int>(c.prefetch_depth);
  o.limit_all_gathers = static_cast<int>(c.limit_all_gathers);
  if (c.mixed_precision == "bf16") o.param_dtype = DType::kBFloat16;
  if (c.mixed_precision == "fp16") o.param_dtype = DType::kFloat16;
  o.steps = c.steps;
  o.micro_batches = c.micro_batches;
  o.accumulation = c.no_sync ? refmodel::AccumulationMode::kNoSync
                             : refmodel::AccumulationMode::kShardedAccumulation;
  if (c.optimizer == "adamw") {
    refmodel::AdamWOptions adamw;
    adamw.lr = c.lr;
    o.optimizer = adamw;
  } else {
    o.optimizer = refmodel::SgdOptions{c.lr, 0.9};
  }
  o.global_batch = c.global_batch != 0 ? c.global_batch : 2 * world_size;
  if (o.global_batch % world_size != 0) {
    if (c.given_flags.count("global_batch") == 0 && !c.load_dir.empty()) {
      // Taken over from the checkpoint, for another world size.
      const int64_t below = o.global_batch / world_size * world_size;
      const int64_t above = below + world_size;
      return Bad(absl::StrFormat(
          "the checkpoint trained with a global batch of %d, which %d ranks "
          "cannot split evenly: give --global-batch=%s to train on with "
          "that batch from here on (the checkpoint's history records the "
          "change, and --check-reference replays it)",
          o.global_batch, world_size,
          below > 0 ? absl::StrFormat("%d or %d", below, above)
                    : absl::StrCat(above)));
    }
    return Bad(absl::StrFormat(
        "--global-batch=%d must be a multiple of the world size %d",
        o.global_batch, world_size));
  }
  o.model.seed = c.seed;
  o.data_seed = c.seed;
  o.collective_options.timeout = c.timeout;
  FLATPARAM_RETURN_IF_ERROR(refmodel::ValidateFsdpTrainOptions(o, world_size));
  return o;
}

absl::StatusOr<ReferenceCheck> CheckAgainstReference(
    const refmodel::FsdpTrainOptions& options, int world_size, bool exact,
    const refmodel::FsdpRankResult& result,
    const std::optional<std::array<int64_t, kNumMemoryCategories>>&
        expected_memory,
    const std::vector<RankSummary>& ranks,
    const std::vector<TrainSegment>& history) {
  FLATPARAM_ASSIGN_OR_RETURN(
      refmodel::TrainResult want,
      ChainedReference(options, world_size, history, /*fp32=*/false));
  int64_t total_steps = options.steps;
  for (const TrainSegment& s : history) total_steps += s.steps;
  ReferenceCheck check;
  check.max_abs_diff =
      Worst({MaxAbsDiff(result.losses, want.losses),
             MaxAbsDiff(result.params, want.params),
             MaxAbsDiff(result.optimizer_state, want.optimizer_state)});
  check.bitwise_equal = result.losses.size() == want.losses.size() &&
                        std::memcmp(result.losses.data(), want.losses.data(),
                                    want.losses.size() * sizeof(float)) == 0 &&
                        result.params == want.params &&
                        result.optimizer_state == want.optimizer_state;
  check.exact = exact;
  check.param_max_abs_diff = MaxAbsDiff(result.params, want.params);
  FLATPARAM_ASSIGN_OR_RETURN(refmodel::ReferenceModel model,
                             refmodel::ReferenceModel::Create(options.model));
  const double max_abs_param =
      MaxAbs(options.initial_params.has_value() ? *options.initial_params
                                                : model.InitParams());
  const auto* adamw = std::get_if<refmodel::AdamWOptions>(&options.optimizer);
  bool matches = check.bitwise_equal;
  if (!exact && adamw != nullptr) {
    check.inexact_bound =
        refmodel::AdamWDivergenceBound(*adamw, total_steps, max_abs_param);
    matches = matches || check.param_max_abs_diff <= *check.inexact_bound;
  }
  bool within_bound = true;
  if (options.param_dtype.has_value() || options.reduce_dtype.has_value()) {
    check.mixed_precision = true;
    FLATPARAM_ASSIGN_OR_RETURN(
        refmodel::TrainResult full,
        ChainedReference(options, world_size, history, /*fp32=*/true));
    check.fp32_max_abs_diff = MaxAbsDiff(result.params, full.params);
    if (adamw != nullptr) {
      check.fp32_bound =
          refmodel::AdamWDivergenceBound(*adamw, total_steps, max_abs_param);
      within_bound = check.fp32_max_abs_diff <= *check.fp32_bound;
    }
  }
  for (const RankSummary& r : ranks) {
    check.nonzero_padding_grads += r.nonzero_padding_grads;
  }
  if (expected_memory.has_value()) {
    bool holds = true;
    for (const RankSummary& r : ranks) {
      for (int c = 0; c < kNumMemoryCategories; ++c) {
        holds = holds && r.memory.peak[c] == (*expected_memory)[c];
      }
    }
    check.memory_formula_holds = holds;
  }
  check.passed = matches && within_bound && check.nonzero_padding_grads == 0 &&
                 check.memory_formula_holds.value_or(true);
  return check;
}

namespace {

using StateCopier =
    absl::FunctionRef<absl::StatusOr<refmodel::FsdpRankState>()>;

// One rank's saves during a run (--save, --save-every, --async-save):
// checkpoint::StepCheckpointSaver with the trainer's state and, in each
// checkpoint's "extra", what a run resumed from it needs. AfterStep is the
// trainer's after_step hook; Finish must be called after training (also
// when it failed) while a save may be in flight.
//
// Borrows `fs`, `world` and `layout`, which must outlive it; copies the
// rest. Not thread-safe: the rank's thread alone calls it.
class RunSaver {
 public:
  // `options` are the run's, given before their initial_state and
  // after_step are set (it copies them and needs neither); `command` the
  // resolved flags.
  RunSaver(checkpoint::FileSystem& fs, Communicator& world,
           const TrainCommandOptions& command,
           const refmodel::FsdpTrainOptions& options, const ModelLayout& layout,
           const std::vector<TrainSegment>& history)
      : world_size_(world.size()),
        command_(command),
        options_(options),
        steps_(options.steps),
        layout_(layout),
        history_(history),
        saver_(fs, world, SaveOptions(command, options)) {}

  // Saves when the global step reached after `steps_done` steps of this run
  // is due (a multiple of --save-every, or the run's last).
  absl::Status AfterStep(int64_t steps_done, StateCopier copy_state) {
    return saver_.AfterStep(
        layout_, options_.first_step + steps_done, steps_done == steps_,
        [&]() -> absl::StatusOr<checkpoint::RankState> {
          FLATPARAM_ASSIGN_OR_RETURN(refmodel::FsdpRankState state,
                                     copy_state());
          checkpoint::RankState mine;
          mine.flat_params = std::move(state.flat_params);
          mine.optim = refmodel::ShardedFromTrainStates(state.optimizer);
          mine.optim.param_groups.push_back(ParamGroupFor(
              options_.optimizer,
              static_cast<int64_t>(layout_.flat_params().size())));
          // The extra describes this step: the run's segment ends here.
          options_.steps = steps_done;
          mine.extra = {{kTrainExtraKey, TrainExtra(command_, options_,
                                                    world_size_, history_)}};
          return mine;
        });
  }

  absl::Status Finish() { return saver_.Finish(); }
  const checkpoint::StepCheckpointSaver& saver() const { return saver_; }

 private:
  static checkpoint::StepSaveOptions SaveOptions(
      const TrainCommandOptions& command,
      const refmodel::FsdpTrainOptions& options) {
    checkpoint::StepSaveOptions save;
    save.dir = command.save_dir;
    save.every = command.save_every.value_or(0);
    save.async = command.async_save;
    save.write.collective = options.collective_options;
    return save;
  }

  const int world_size_;
  const TrainCommandOptions command_;
  // The run's options; `steps` is set to the steps done at each save.
  refmodel::FsdpTrainOptions options_;
  const int64_t steps_;  // the run's
  const ModelLayout& layout_;
  const std::vector<TrainSegment> history_;
  checkpoint::StepCheckpointSaver saver_;
};

}  // namespace

absl::StatusOr<TrainReport> RunTrainOnRank(Communicator& world,
                                           DeviceOps& device,
                                           const TrainCommandOptions& options,
                                           bool host_device) {
  const int world_size = world.size();
  TrainReport report;
  report.backend = options.backend;
  report.world_size = world_size;
  checkpoint::FileSystem& fs = checkpoint::PosixFileSystem();
  TrainCommandOptions command = options;
  std::optional<checkpoint::ShardedCheckpointReader> reader;
  int64_t first_step = 0;
  // --resume: --save's pattern, when a complete checkpoint matches it yet
  // (the ranks see one file system and nothing writes it now, so they
  // decide alike); else a run from step 0.
  std::string load_pattern = options.load_dir;
  if (options.resume) {
    if (checkpoint::FindLatestCheckpoint(fs, options.save_dir).ok()) {
      load_pattern = options.save_dir;
    }
  }
  const auto in_load = [&](const absl::Status& s) {
    return absl::Status(
        s.code(), absl::StrCat(options.resume ? "--resume from " : "--load=",
                               load_pattern, ": ", s.message()));
  };
  if (!load_pattern.empty()) {
    // Every rank opens the checkpoint itself (metadata only: manifest,
    // layout and the small sidecars), and verifies and reads only its own
    // rank's tensors below. "{step}": every rank picks the newest published
    // checkpoint itself (the ranks see one file system, so they pick the
    // same).
    absl::StatusOr<ResumePoint> point = [&]() -> absl::StatusOr<ResumePoint> {
      FLATPARAM_ASSIGN_OR_RETURN(
          checkpoint::LatestCheckpoint latest,
          checkpoint::FindLatestCheckpoint(fs, load_pattern));
      report.load_resolved_from = latest.dir;
      report.load_candidates = latest.candidates;
      report.load_skipped = std::move(latest.skipped);
      report.load_pattern = load_pattern;
      checkpoint::CheckpointOpenOptions metadata_only;
      metadata_only.ranks.emplace();  // no rank's tensors yet
      FLATPARAM_ASSIGN_OR_RETURN(
          checkpoint::ShardedCheckpointReader opened,
          checkpoint::ShardedCheckpointReader::Open(
              fs, report.load_resolved_from, metadata_only));
      reader.emplace(std::move(opened));
      FLATPARAM_ASSIGN_OR_RETURN(json sidecar, reader->ReadRankJson(0));
      const json extra = sidecar.value("extra", json::object());
      if (!extra.contains(kTrainExtraKey)) {
        return absl::FailedPreconditionError(
            absl::StrCat("rank00000.json has no \"extra\".", kTrainExtraKey,
                         ": not a checkpoint of fsdp train"));
      }
      return ResumeFromExtra(options, extra[kTrainExtraKey]);
    }();
    // The ranks agree before anything else: a rank that cannot open the
    // checkpoint (it is not on a file system every rank sees) fails every
    // rank at once instead of leaving the others in their next collective.
    CollectiveOptions agree;
    agree.timeout = options.timeout;
    const absl::Status agreed =
        checkpoint::AgreeOnLoad(world, point.status(), agree);
    if (!agreed.ok()) return in_load(agreed);
    command = point->command;
    first_step = point->first_step;
    report.history = point->history;
    report.loaded_from = reader->path();
    if (options.resume) {
      report.resumed = true;
      // --steps is the run's total.
      command.steps = options.steps - first_step;
      if (world.rank() == 0) {
        const std::string line =
            absl::StrFormat("fsdp train: resumed from %s at step %d\n",
                            reader->path(), first_step);
        std::fwrite(line.data(), 1, line.size(), stderr);
        std::fflush(stderr);
      }
      if (command.steps <= 0) {
        report.nothing_left = true;
        report.options.steps = 0;
        report.options.first_step = first_step;
        return report;
      }
    }
  }
  report.optimizer = command.optimizer;
  FLATPARAM_ASSIGN_OR_RETURN(report.options,
                             MakeFsdpTrainOptions(command, world_size));
  report.options.first_step = first_step;
  if (!command.fault_skip_forward.empty()) {
    FLATPARAM_ASSIGN_OR_RETURN(const SkipForwardFault fault,
                               ParseSkipForward(command.fault_skip_forward));
    if (fault.rank == world.rank()) {
      report.options.skip_forward_for_testing =
          [fault](int64_t step, absl::string_view unit) {
            return step == fault.step && unit == fault.unit;
          };
    }
  }
  std::optional<ModelLayout> layout;
  // The loaded state, handed to the trainer after the saver has copied the
  // options (it needs no copy of the state).
  std::optional<refmodel::FsdpRankState> initial_state;
  int64_t shard_rank = 0;
  if (reader.has_value() || !options.save_dir.empty()) {
    FLATPARAM_ASSIGN_OR_RETURN(
        layout, refmodel::FsdpModelLayout(report.options, world_size));
    shard_rank = world.rank() % layout->options().world_size;
  }
  if (reader.has_value()) {
    // The rank's own files when the job fits the checkpoint; otherwise
    // resharded at load time: the byte ranges of the old ranks' files that
    // this rank's new shards hold (no intermediate files). Either way every
    // byte read is verified against the manifest, and no rank reads the
    // others' share.
    checkpoint::LoadPath path = checkpoint::LoadPath::kOwnRank;
    absl::StatusOr<checkpoint::RankState> state = checkpoint::LoadRankState(
        *reader, *layout, world_size, shard_rank, &path);
    // The ranks agree, so that one rank's damaged file fails every rank
    // instead of leaving the others waiting in their first collective.
    const absl::Status loaded = checkpoint::AgreeOnLoad(
        world, state.status(), report.options.collective_options);
    if (!loaded.ok()) return in_load(loaded);
    if (path == checkpoint::LoadPath::kResharded) {
      report.resharded_from = absl::StrFormat(
          "%d ranks, %s%s", reader->world_size(),
          ShardingStrategyName(reader->layout().options().strategy),
          IsHybridStrategy(reader->layout().options().strategy)
              ? absl::StrFormat(" (shard groups of %d)", reader->num_ranks())
              : "");
    }
    refmodel::FsdpRankState& initial = initial_state.emplace();
    initial.flat_params = std::move(state->flat_params);
    absl::StatusOr<std::vector<refmodel::OptimizerState>> optimizer =
        refmodel::TrainStatesFromSharded(*layout, state->optim);
    if (!optimizer.ok()) return in_load(optimizer.status());
    initial.optimizer = *std::move(optimizer);
  }
  // Every save, mid-run and final, is made by the hook, on the state of its
  // step.
  std::optional<RunSaver> saver;
  if (!options.save_dir.empty()) {
    saver.emplace(fs, world, command, report.options, *layout, report.history);
    report.options.after_step = [&saver](int64_t steps_done,
                                         StateCopier copy_state) {
      return saver->AfterStep(steps_done, copy_state);
    };
  }
  if (initial_state.has_value()) {
    report.options.initial_state.emplace(*std::move(initial_state));
  }
  if (command.log_every > 0 && world.rank() == 0) {
    report.options.on_loss = [every = command.log_every, first_step,
                              begin = absl::Now()](int64_t step, float loss) {
      if ((step - first_step + 1) % every != 0) return;
      // One write per line: under mpirun the lines of ranks' streams
      // interleave, never their characters.
      const std::string line = absl::StrFormat(
          "fsdp train: step %d loss %.9g (%s elapsed)\n", step, loss,
          absl::FormatDuration(
              absl::Trunc(absl::Now() - begin, absl::Milliseconds(1))));
      std::fwrite(line.data(), 1, line.size(), stderr);
      std::fflush(stderr);
    };
  }
  absl::StatusOr<refmodel::FsdpRankResult> trained =
      refmodel::TrainFsdpOnRank(world, device, report.options);
  // Neither the loaded state nor the hook is part of the report.
  report.options.initial_state.reset();
  report.options.after_step = nullptr;
  report.options.on_loss = nullptr;
  if (saver.has_value()) {
    // Also after a failure, a save in flight is finished (collectively:
    // every save's errors and every collective failure reach every rank,
    // so the ranks get here alike), and the last good one is published.
    const absl::Status finished = saver->Finish();
    if (!trained.ok() && !finished.ok()) {
      return absl::Status(trained.status().code(),
                          absl::StrCat(trained.status().message(),
                                       " (and the save in flight failed: ",
                                       finished.message(), ")"));
    }
    FLATPARAM_RETURN_IF_ERROR(finished);
    report.saved_steps = saver->saver().saved_steps();
    report.saved_to = saver->saver().last_dir();
    report.async_save = command.async_save;
  }
  FLATPARAM_RETURN_IF_ERROR(trained.status());
  const refmodel::FsdpRankResult& result = *trained;
  report.losses = result.losses;
  RankSummary mine;
  mine.rank = world.rank();
  mine.memory = result.memory;
  mine.optimizer_state_bytes = result.optimizer_state_bytes;
  mine.comm = result.comm;
  mine.nonzero_padding_grads = result.nonzero_padding_grads;
  if (saver.has_value()) {
    mine.save_blocked_max = saver->saver().blocked_max();
    mine.save_blocked_total = saver->saver().blocked_total();
  }
  FLATPARAM_ASSIGN_OR_RETURN(
      std::vector<std::string> all,
      world.AllGatherBytes(Serialize(mine), report.options.collective_options));
  for (const std::string& bytes : all) {
    FLATPARAM_ASSIGN_OR_RETURN(RankSummary s, Deserialize(bytes));
    report.save_blocked_max =
        std::max(report.save_blocked_max, s.save_blocked_max);
    report.save_blocked_total =
        std::max(report.save_blocked_total, s.save_blocked_total);
    report.ranks.push_back(s);
  }
  if (host_device) {
    FLATPARAM_ASSIGN_OR_RETURN(
        report.expected_memory,
        refmodel::ExpectedPeakMemory(report.options, world_size));
  }
  if (options.check_reference) {
    FLATPARAM_ASSIGN_OR_RETURN(
        report.check, CheckAgainstReference(report.options, world_size,
                                            /*exact=*/host_device, result,
                                            report.expected_memory,
                                            report.ranks, report.history));
  }
  return report;
}

void PrintTrainReport(const TrainReport& report, std::ostream& out) {
  if (report.nothing_left) {
    out << absl::StrFormat(
        "# fsdp train: backend %s, %d ranks; resumed from %s at step %d: "
        "the run's --steps are done, nothing left to train\n",
        report.backend, report.world_size, report.loaded_from,
        report.options.first_step);
    return;
  }
  const refmodel::FsdpTrainOptions& o = report.options;
  out << absl::StrFormat(
      "# fsdp train: backend %s, %d ranks, %s%s, seed %d; %s\n", report.backend,
      report.world_size, ShardingStrategyName(o.strategy),
      IsHybridStrategy(o.strategy)
          ? absl::StrFormat(" (shard groups of %d ranks, %d replicas)",
                            o.shard_group_size,
                            report.world_size / o.shard_group_size)
          : "",
      o.data_seed, DescribePrefetch(o));
  out << absl::StrFormat(
      "# model: vocab %d, dims [%s]; %d steps, global batch %d (%d per "
      "rank), %d micro-batch%s (%s), %s\n",
      o.model.vocab, absl::StrJoin(o.model.dims, ", "), o.steps, o.global_batch,
      o.global_batch / report.world_size, o.micro_batches,
      o.micro_batches == 1 ? "" : "es",
      o.accumulation == refmodel::AccumulationMode::kNoSync
          ? "accumulated under no_sync"
          : "each reduced",
      DescribeOptimizer(o.optimizer));
  out << absl::StrFormat(
      "# mixed precision: %s; cpu offload %s; align addresses %s\n",
      Precision(o), o.cpu_offload ? "on" : "off",
      o.align_addresses ? "on" : "off");
  if (!report.loaded_from.empty()) {
    out << absl::StrFormat(
        "# resumed from %s at step %d (trained before: %s)\n",
        AbsolutePath(report.loaded_from), o.first_step,
        DescribeSegments(report.history, o));
    if (report.load_candidates > 0) {
      out << absl::StrFormat(
          "# the newest complete checkpoint of %d matching --load=%s\n",
          report.load_candidates, report.load_pattern);
      for (const std::string& skipped : report.load_skipped) {
        out << "# skipped, incomplete or damaged: " << skipped << "\n";
      }
    }
    if (!report.resharded_from.empty()) {
      out << absl::StrFormat(
          "# resharded at load time from %s to this job's layout (each rank "
          "read its byte ranges of the saved ranks' files)\n",
          report.resharded_from);
    }
  }
  out << "step  loss\n";
  for (size_t k = 0; k < report.losses.size(); ++k) {
    out << absl::StrFormat("%4d  %.9g\n",
                           o.first_step + static_cast<int64_t>(k),
                           report.losses[k]);
  }

  out << "# peak memory per rank in bytes (FlatParamHandle accounting; the "
         "optimizer state is host memory)\n";
  std::string header = "rank   ";
  for (int c = 0; c < kNumMemoryCategories; ++c) {
    header += absl::StrFormat(" %20s", MemoryCategoryName(MemoryCategory(c)));
  }
  header += absl::StrFormat(" %12s %12s %15s", "compute", "offload",
                            "optimizer_state");
  out << header << "\n";
  for (const RankSummary& r : report.ranks) {
    std::string row = absl::StrFormat("%-7d", r.rank);
    for (int c = 0; c < kNumMemoryCategories; ++c) {
      row += absl::StrFormat(" %20d", r.memory.peak[c]);
    }
    row += absl::StrFormat(" %12d %12d %15d", r.memory.compute_peak,
                           r.memory.offload_peak, r.optimizer_state_bytes);
    out << row << "\n";
  }
  if (report.expected_memory.has_value()) {
    std::string row = "formula";
    bool holds = true;
    for (int c = 0; c < kNumMemoryCategories; ++c) {
      row += absl::StrFormat(" %20d", (*report.expected_memory)[c]);
      for (const RankSummary& r : report.ranks) {
        holds = holds && r.memory.peak[c] == (*report.expected_memory)[c];
      }
    }
    out << row << "\n";
    out << "# formula: ExpectedPeakMemory (refmodel/fsdp_trainer.h); "
        << (holds ? "every rank matches it" : "SOME RANKS DIFFER") << "\n";
  }

  out << "# communication of the handles per rank (nccl-tests sizes; sent = "
         "what a ring sends per rank)\n";
  out << "rank      all_gather (calls/bytes)  reduce_scatter (calls/bytes)  "
         "all_reduce (calls/bytes)        sent\n";
  for (const RankSummary& r : report.ranks) {
    out << absl::StrFormat("%-7d %6d %16d    %6d %19d    %6d %15d %11d\n",
                           r.rank, r.comm.all_gather.calls,
                           r.comm.all_gather.bytes, r.comm.reduce_scatter.calls,
                           r.comm.reduce_scatter.bytes, r.comm.all_reduce.calls,
                           r.comm.all_reduce.bytes, r.comm.total_sent_bytes());
  }

  if (!report.saved_to.empty()) {
    out << absl::StrFormat(
        "# saved a sharded checkpoint of step %d to %s (written by the "
        "ranks collectively%s)\n",
        report.saved_steps.back(), AbsolutePath(report.saved_to),
        report.async_save ? ", in the background" : "");
    out << absl::StrFormat(
        "# saves: %d (steps %s), %s; training blocked by saving: longest "
        "%s, total %s (slowest rank)\n",
        report.saved_steps.size(), absl::StrJoin(report.saved_steps, ", "),
        report.async_save ? "asynchronous" : "synchronous",
        absl::FormatDuration(report.save_blocked_max),
        absl::FormatDuration(report.save_blocked_total));
  }
  if (!report.check.has_value()) return;
  const ReferenceCheck& c = *report.check;
  const std::string history =
      report.history.empty()
          ? std::string()
          : absl::StrFormat(" of all %d steps (chained: %s; then this run)",
                            o.first_step + o.steps,
                            DescribeSegments(report.history, o));
  const std::string against =
      (c.mixed_precision
           ? absl::StrFormat("single-process training with the same mixed "
                             "precision (%s emulated)",
                             DTypeName(*o.param_dtype))
           : std::string("single-process training")) +
      history;
  out << absl::StrFormat(
      "# check: max |difference| against %s: %g (losses, parameters, "
      "optimizer state); %s\n",
      against, c.max_abs_diff,
      c.bitwise_equal ? "bitwise equal"
      : c.exact       ? "NOT bitwise equal"
                      : "not bitwise equal");
  if (!c.exact && !c.bitwise_equal) {
    if (c.inexact_bound.has_value()) {
      out << absl::StrFormat(
          "# check: %s reduces in its own order, so bitwise equality is not "
          "expected; parameters differ by %g, %s the bound %g "
          "(AdamWDivergenceBound)\n",
          report.backend, c.param_max_abs_diff,
          c.param_max_abs_diff <= *c.inexact_bound ? "within" : "OUTSIDE",
          *c.inexact_bound);
    } else {
      out << absl::StrFormat(
          "# check: %s reduces in its own order and SGD has no "
          "model-independent bound: the difference cannot be checked (use "
          "--optimizer=adamw)\n",
          report.backend);
    }
  }
  if (c.mixed_precision) {
    if (c.fp32_bound.has_value()) {
      out << absl::StrFormat(
          "# check: max |difference| of the parameters against float32 "
          "single-process training: %g, %s the bound %g "
          "(AdamWDivergenceBound, refmodel/optimizer.h)\n",
          c.fp32_max_abs_diff,
          c.fp32_max_abs_diff <= *c.fp32_bound ? "within" : "OUTSIDE",
          *c.fp32_bound);
    } else {
      out << absl::StrFormat(
          "# check: max |difference| of the parameters against float32 "
          "single-process training: %g (SGD has no model-independent "
          "bound; not checked)\n",
          c.fp32_max_abs_diff);
    }
  }
  if (c.nonzero_padding_grads != 0) {
    out << absl::StrFormat(
        "# check: %d padding elements of sharded gradients were not zero\n",
        c.nonzero_padding_grads);
  }
  if (c.memory_formula_holds.has_value() && !*c.memory_formula_holds) {
    out << "# check: the measured peak memory differs from the formula\n";
  }
  out << "# check: " << (c.passed ? "passed" : "FAILED") << "\n";
}

absl::Status TrainVerdict(const TrainReport& report) {
  if (!report.check.has_value() || report.check->passed) {
    return absl::OkStatus();
  }
  const ReferenceCheck& c = *report.check;
  std::vector<std::string> why;
  if (!c.bitwise_equal && c.exact) {
    why.push_back(absl::StrFormat(
        "not bitwise equal to single-process training (max |difference| %g)",
        c.max_abs_diff));
  }
  if (!c.bitwise_equal && !c.exact) {
    why.push_back(
        c.inexact_bound.has_value()
            ? absl::StrFormat("parameters differ from single-process "
                              "training by %g, more than the bound %g",
                              c.param_max_abs_diff, *c.inexact_bound)
            : std::string("not bitwise equal to single-process training, "
                          "and SGD has no bound to check against"));
  }
  if (c.fp32_bound.has_value() && !(c.fp32_max_abs_diff <= *c.fp32_bound)) {
    why.push_back(
        absl::StrFormat("%g from float32 training, outside the bound %g",
                        c.fp32_max_abs_diff, *c.fp32_bound));
  }
  if (c.nonzero_padding_grads != 0) {
    why.push_back(absl::StrFormat("%d non-zero padding gradients",
                                  c.nonzero_padding_grads));
  }
  if (c.memory_formula_holds.has_value() && !*c.memory_formula_holds) {
    why.push_back("peak memory differs from ExpectedPeakMemory");
  }
  return absl::FailedPreconditionError(
      absl::StrCat("the check against single-process training failed: ",
                   absl::StrJoin(why, "; ")));
}

absl::StatusOr<TrainReport> TrainOnSim(const TrainCommandOptions& options,
                                       const std::string& trace_path) {
  FLATPARAM_RETURN_IF_ERROR(ValidateTrainCommandOptions(options));
  // Inconsistent options fail before any rank starts.
  FLATPARAM_RETURN_IF_ERROR(
      MakeFsdpTrainOptions(options, static_cast<int>(options.world_size))
          .status());
  SimOptions sim;
  sim.world_size = static_cast<int>(options.world_size);
  sim.seed = options.seed;
  if (!options.trace_dir.empty()) {
    sim.flight_recorder.trace_dir = options.trace_dir;
  }
  FLATPARAM_ASSIGN_OR_RETURN(std::unique_ptr<SimWorld> world,
                             SimWorld::Create(sim));
  TrainReport report;
  FLATPARAM_RETURN_IF_ERROR(
      world->Run([&](SimCommunicator& comm) -> absl::Status {
        HostDeviceOps device;
        FLATPARAM_ASSIGN_OR_RETURN(
            TrainReport mine,
            RunTrainOnRank(comm, device, options, /*host_device=*/true));
        if (comm.rank() == 0) report = std::move(mine);
        return absl::OkStatus();
      }));
  if (!trace_path.empty()) {
    FLATPARAM_RETURN_IF_ERROR(world->WriteChromeTrace(trace_path));
  }
  return report;
}

absl::Status RunTrainSim(const TrainCommandOptions& options,
                         std::ostream& out) {
  FLATPARAM_ASSIGN_OR_RETURN(TrainReport report, TrainOnSim(options));
  PrintTrainReport(report, out);
  return TrainVerdict(report);
}

}  // namespace tools
}  // namespace flatparam
