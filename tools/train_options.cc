// fsdp train, part 1: the flags, the trainer's options they make, and the
// checkpoint's "extra" a resumed run takes them from (train.h).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
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
#include "flatparam/checkpoint/file_system.h"
#include "flatparam/checkpoint/training_checkpoints.h"
#include "refmodel/mlp_model.h"
#include "refmodel/optimizer.h"
#include "tools/collective_timeout.h"
#include "tools/internal/train_internal.h"
#include "tools/layout_request.h"
#include "tools/paths.h"
#include "tools/train.h"

namespace flatparam {
namespace tools {
namespace {

using json = nlohmann::json;

absl::Status Bad(absl::string_view message) {
  return absl::InvalidArgumentError(message);
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

}  // namespace

namespace internal_train {

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

}  // namespace internal_train

using internal_train::ParseSkipForward;

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

}  // namespace tools
}  // namespace flatparam
