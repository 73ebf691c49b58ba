// fsdp train, part 3: the check against single-process training, the
// report and the verdict (train.h).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <utility>
#include <variant>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/checkpoint/checkpoint_dir.h"
#include "flatparam/checkpoint/file_system.h"
#include "refmodel/mlp_model.h"
#include "refmodel/optimizer.h"
#include "refmodel/reference_trainer.h"
#include "refmodel/tensor_diff.h"
#include "tools/paths.h"
#include "tools/train.h"

namespace flatparam {
namespace tools {
namespace {

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

}  // namespace tools
}  // namespace flatparam
