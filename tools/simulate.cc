#include "tools/simulate.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "comm/communicator.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/checkpoint/checkpoint_names.h"
#include "flatparam/checkpoint/collective_checkpoint.h"
#include "flatparam/checkpoint/file_system.h"
#include "flatparam/checkpoint/training_state.h"
#include "flatparam/handle.h"
#include "flatparam/runtime.h"
#include "refmodel/synthetic_step.h"
#include "sim/sim.h"
#include "sim/sim_device.h"
#include "tools/inspect.h"

namespace flatparam {
namespace tools {
namespace {

// "0-3,8" -> {0, 1, 2, 3, 8}; every rank in [0, world).
absl::StatusOr<std::set<int>> ParseRankSet(absl::string_view text,
                                           int64_t world) {
  std::set<int> ranks;
  for (absl::string_view part : absl::StrSplit(text, ',')) {
    std::pair<absl::string_view, absl::string_view> range =
        absl::StrSplit(part, absl::MaxSplits('-', 1));
    int lo = 0;
    int hi = 0;
    if (!absl::SimpleAtoi(range.first, &lo) ||
        !absl::SimpleAtoi(range.second.empty() ? range.first : range.second,
                          &hi) ||
        lo < 0 || hi < lo || hi >= world) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "--conditional-unit: \"%s\" is not a rank or range of ranks in "
          "[0, %d)",
          part, world));
    }
    for (int r = lo; r <= hi; ++r) ranks.insert(r);
  }
  return ranks;
}

struct Conditional {
  int unit = -1;  // -1: none
  std::set<int> ranks;
};

absl::StatusOr<Conditional> ParseConditional(absl::string_view text,
                                             const ModelLayout& layout,
                                             int64_t world) {
  Conditional out;
  if (text.empty()) return out;
  const size_t colon = text.rfind(':');
  if (colon == absl::string_view::npos) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--conditional-unit must be UNIT:RANKS (e.g. layers.3:0-3), got "
        "\"%s\"",
        text));
  }
  const absl::string_view unit = text.substr(0, colon);
  const std::vector<FlatParamLayout>& flat = layout.flat_params();
  for (size_t u = 0; u < flat.size(); ++u) {
    if (flat[u].unit() == unit) out.unit = static_cast<int>(u);
  }
  if (out.unit <= 0) {
    std::vector<std::string> names;
    for (size_t u = 1; u < flat.size() && names.size() < 4; ++u) {
      names.push_back(flat[u].unit());
    }
    return absl::InvalidArgumentError(absl::StrFormat(
        "--conditional-unit: \"%s\" is not a layer unit of the model (%s, "
        "...; the root cannot be conditional)",
        unit, absl::StrJoin(names, ", ")));
  }
  FLATPARAM_ASSIGN_OR_RETURN(out.ranks,
                             ParseRankSet(text.substr(colon + 1), world));
  return out;
}

// What `fsdp train --save` writes for a rank of the first shard group (its
// shards of the parameters, the optimizer's state tensors, the sidecar), as
// dtypes and shapes: the sources fail if called, so only sizes can be
// taken from it (SimulateCollectiveRankFiles).
absl::StatusOr<checkpoint::RankContent> SizedRankContent(
    const ModelLayout& layout, const std::string& optimizer) {
  checkpoint::RankContent content;
  const auto source = [](std::string name, DType dtype,
                         std::vector<int64_t> shape) {
    checkpoint::TensorSource t;
    t.name = std::move(name);
    t.dtype = dtype;
    t.shape = std::move(shape);
    t.fill = [](uint64_t, absl::Span<char>) {
      return absl::InternalError("a simulated save has no tensor bytes");
    };
    return t;
  };
  const std::vector<std::string> states =
      optimizer == "adamw" ? std::vector<std::string>{"exp_avg", "exp_avg_sq"}
                           : std::vector<std::string>{"momentum_buffer"};
  checkpoint::OptimSidecar sidecar;
  optim::ParamGroup group;
  const std::vector<FlatParamLayout>& flat = layout.flat_params();
  for (size_t i = 0; i < flat.size(); ++i) {
    const int64_t id = static_cast<int64_t>(i);
    const std::vector<int64_t> shard = {flat[i].sharded_numel()};
    content.tensors.push_back(
        source(checkpoint::FlatParamTensorName(id), flat[i].dtype(), shard));
    auto& values = sidecar.state[optim::ParamKey(id)];
    for (const std::string& name : states) {
      std::string tensor = checkpoint::OptimShardTensorName(id, name);
      content.tensors.push_back(source(tensor, flat[i].dtype(), shard));
      values[name] = {std::move(tensor), std::monostate()};
    }
    if (optimizer == "adamw") {  // PyTorch's 0-d float32 step
      std::string tensor = checkpoint::OptimShardTensorName(id, "step");
      content.tensors.push_back(source(tensor, DType::kFloat32, {}));
      values["step"] = {std::move(tensor), std::monostate()};
    }
    group.params.emplace_back(std::in_place_type<int64_t>, id);
  }
  for (const BufferSpec& b : layout.spec().buffers) {
    content.tensors.push_back(
        source(checkpoint::BufferTensorName(b.fqn), b.dtype, b.shape));
  }
  sidecar.param_groups.push_back(std::move(group));
  FLATPARAM_ASSIGN_OR_RETURN(
      content.sidecar,
      checkpoint::OptimSidecarToJson(sidecar, /*with_extra=*/true));
  return content;
}

// "4.306 s", "8.472 ms", "735.0 us".
std::string Time(double seconds) {
  if (seconds >= 1) return absl::StrFormat("%.3f s", seconds);
  if (seconds >= 1e-3) return absl::StrFormat("%.3f ms", seconds * 1e3);
  return absl::StrFormat("%.1f us", seconds * 1e6);
}

std::string Percent(double measured, double predicted) {
  if (predicted == 0) return measured == 0 ? "+0.00%" : "n/a";
  return absl::StrFormat("%+.2f%%", 100.0 * (measured - predicted) / predicted);
}

// One strategy's world, both iterations.
absl::StatusOr<SimulatedStrategy> SimulateStrategy(
    const Plan& plan, const PlanOptions& options,
    const SimulateOptions& simulate, const StrategyPlan& sp) {
  const auto wall_start = std::chrono::steady_clock::now();
  const cost::LinkSpec& link = plan.topology.link;
  const int64_t world = plan.world_size();
  FLATPARAM_ASSIGN_OR_RETURN(ResolvedLayout resolved,
                             ResolvePlanLayout(options, link, sp.strategy));
  // One layout for every rank's runtime and handles.
  const auto shared_layout =
      std::make_shared<const ModelLayout>(std::move(resolved.layout));
  const ModelLayout& layout = *shared_layout;
  FLATPARAM_ASSIGN_OR_RETURN(
      const Conditional conditional,
      ParseConditional(simulate.conditional_unit, layout, world));
  FLATPARAM_ASSIGN_OR_RETURN(
      const std::vector<absl::Duration> forward,
      refmodel::SyntheticForwardTimes(layout, plan.tokens_per_gpu,
                                      plan.peak_flops * plan.efficiency));

  // Shapes only: every rank's handles read no values (meta_init).
  std::vector<std::vector<ConstBufferRef>> meta;
  for (const FlatParamLayout& l : layout.flat_params()) {
    std::vector<ConstBufferRef>& refs = meta.emplace_back();
    for (const ParamInfo& p : l.params()) {
      refs.push_back({nullptr, p.numel, l.dtype(), Device::Host()});
    }
  }
  // The plan's optimizer state (its bytes per element less the float32
  // master weights, which are the sharded parameters here).
  const int64_t state_per_element = plan.bytes_per_element.optimizer -
                                    (plan.mixed_precision != "none" ? 4 : 0);
  int64_t sharded = 0;
  for (const FlatParamLayout& l : layout.flat_params()) {
    sharded += l.sharded_numel();
  }

  // The save's content is the same on every writing rank up to its bytes.
  checkpoint::RankContent save_content;
  checkpoint::FaultInjectionFileSystem save_fs;
  checkpoint::CollectiveWriteOptions save_options;
  const std::string save_dir = "/simulated/checkpoint";
  if (simulate.save) {
    if (!(simulate.save_bytes_per_second > 0)) {
      return absl::InvalidArgumentError(
          absl::StrFormat("the save bandwidth must be positive, got %g bytes/s",
                          simulate.save_bytes_per_second));
    }
    FLATPARAM_ASSIGN_OR_RETURN(save_content,
                               SizedRankContent(layout, plan.optimizer));
    FLATPARAM_RETURN_IF_ERROR(save_fs.CreateDir("/simulated"));
    // Computed once here, not by each of the ranks in this process.
    save_options.layout_digest =
        checkpoint::CollectiveLayoutDigest(layout, world);
  }

  SimOptions sim_options;
  sim_options.world_size = static_cast<int>(world);
  sim_options.seed = simulate.seed;
  sim_options.one_stream_per_rank = true;
  // Ranks as fibers, each keeping the baton until it waits: the results do
  // not depend on the interleaving, and hand-offs are most of the cost.
  sim_options.execution = SimOptions::Execution::kFibers;
  sim_options.yield_on_issue = false;
  sim_options.metadata_only = true;
  sim_options.check_context = true;
  sim_options.keep_trace = false;
  // The context is all check_context needs from the recorder.
  sim_options.flight_recorder.capacity = 4;
  sim_options.flight_recorder.trace_dir.clear();
  sim_options.cost.collective_time = [link](CollectiveOp op, int64_t bytes,
                                            const std::vector<int>& ranks) {
    return cost::SimulatedCollectiveTime(link, op, bytes, ranks);
  };
  FLATPARAM_ASSIGN_OR_RETURN(std::unique_ptr<SimWorld> sim,
                             SimWorld::Create(std::move(sim_options)));

  struct RankResult {
    double step = 0;
    double compute = 0;
    double save = 0;
    uint64_t save_bytes = 0;
    MemoryStats memory;
    std::vector<std::string> races;
  };
  std::vector<RankResult> results(world);
  int64_t collectives = 0;
  int first_done = 0;
  const absl::Status run = sim->Run([&](SimCommunicator& comm) -> absl::Status {
    const int rank = comm.world_rank();
    SimRankClock clock(&comm);
    SimDeviceOptions device_options;
    device_options.seed = simulate.seed + static_cast<uint64_t>(rank);
    device_options.host_clock = &clock;
    device_options.metadata_only = true;
    SimDeviceOps ops(device_options);
    StreamCheckedCommunicator checked(&comm, &ops, /*stream_ordered=*/true);
    HandleOptions handle_options;
    handle_options.meta_init = true;
    FLATPARAM_ASSIGN_OR_RETURN(handle_options.streams.unshard, ops.NewStream());
    FLATPARAM_ASSIGN_OR_RETURN(handle_options.streams.post_backward,
                               ops.NewStream());
    if (plan.param_dtype != plan.orig_dtype) {
      handle_options.param_dtype = plan.param_dtype;
      handle_options.reduce_dtype = plan.param_dtype;
    }
    RuntimeOptions runtime_options;
    runtime_options.backward_prefetch = BackwardPrefetch::kBackwardPre;
    std::vector<int> skipped;
    if (conditional.unit > 0 && conditional.ranks.count(rank) == 0) {
      skipped.push_back(conditional.unit);
    }
    RankResult& result = results[rank];
    {
      FLATPARAM_ASSIGN_OR_RETURN(
          std::unique_ptr<FsdpRuntime> rt,
          FsdpRuntime::CreateUnitByUnit(
              shared_layout,
              [&](int u) -> absl::StatusOr<std::vector<ConstBufferRef>> {
                return meta[u];
              },
              nullptr, &checked, &ops, handle_options, runtime_options));
      double compute = 0;
      auto kernel = [&](const refmodel::KernelCall& call) -> absl::Status {
        compute += absl::ToDoubleSeconds(call.duration);
        std::vector<ConstBufferRef> reads;
        std::vector<BufferRef> writes;
        if (auto p = call.handle->unsharded_flat_param()) reads.push_back(*p);
        if (call.backward) {
          if (auto g = call.handle->unsharded_grad()) writes.push_back(*g);
        }
        return ops.Kernel(call.name, reads, writes, call.duration);
      };
      // The first iteration records the execution order; the second is the
      // steady state the plan predicts.
      FLATPARAM_RETURN_IF_ERROR(refmodel::RunSyntheticStep(
          *rt, forward, kernel, /*blocking_reductions=*/false, skipped));
      FLATPARAM_RETURN_IF_ERROR(ops.Synchronize());
      FLATPARAM_RETURN_IF_ERROR(rt->ZeroGrad());
      FLATPARAM_RETURN_IF_ERROR(comm.Barrier({}));
      if (++first_done == world && simulate.progress) {
        simulate.progress("iteration 1 (records the execution order) done");
      }
      rt->ResetPeakMemory();
      compute = 0;
      const absl::Duration start = comm.Now();
      FLATPARAM_RETURN_IF_ERROR(refmodel::RunSyntheticStep(
          *rt, forward, kernel, /*blocking_reductions=*/false, skipped));
      FLATPARAM_RETURN_IF_ERROR(ops.Synchronize());
      result.step = absl::ToDoubleSeconds(comm.Now() - start);
      result.compute = compute;
      result.memory = rt->memory();
      const CommStats& stats = rt->comm_stats();
      collectives += stats.all_gather.calls + stats.reduce_scatter.calls +
                     stats.all_reduce.calls;
    }
    FLATPARAM_RETURN_IF_ERROR(ops.Synchronize());
    result.races = ops.reports();
    if (simulate.save) {
      const absl::Duration start = comm.Now();
      FLATPARAM_ASSIGN_OR_RETURN(
          checkpoint::CollectiveWrite w,
          checkpoint::BeginCollectiveWrite(save_fs, save_dir, layout, world,
                                           comm, save_options));
      FLATPARAM_ASSIGN_OR_RETURN(result.save_bytes,
                                 checkpoint::SimulateCollectiveRankFiles(
                                     w, save_content, save_options));
      FLATPARAM_RETURN_IF_ERROR(
          comm.Compute(absl::Seconds(static_cast<double>(result.save_bytes) /
                                     simulate.save_bytes_per_second)));
      FLATPARAM_RETURN_IF_ERROR(checkpoint::FinishCollectiveWrite(
          save_fs, w, absl::OkStatus(), comm, save_options));
      result.save = absl::ToDoubleSeconds(comm.Now() - start);
    }
    return absl::OkStatus();
  });
  if (!run.ok()) {
    // The cause first: ranks usually return a later error (a stream-ordered
    // collective's failure surfaces at the next host wait).
    const absl::Status& cause = sim->first_failure();
    return absl::FailedPreconditionError(absl::StrCat(
        ShardingStrategyName(sp.strategy), " on ", world, " ranks: ",
        cause.ok() ? run.message()
                   : absl::StrCat(cause.message(), "\nthen ", run.message())));
  }
  SimulatedStrategy out;
  out.strategy = sp.strategy;
  out.world_size = world;
  out.optimizer_bytes = state_per_element * sharded;
  out.collectives = collectives;
  if (simulate.save) {
    out.saved = true;
    // The staged state: the shard in its dtype and the optimizer's state.
    out.save_host_bytes =
        sharded * DTypeSize(plan.orig_dtype) + out.optimizer_bytes;
  }
  for (int64_t r = 0; r < world; ++r) {
    const RankResult& rr = results[r];
    out.save_seconds = std::max(out.save_seconds, rr.save);
    out.save_bytes += static_cast<int64_t>(rr.save_bytes);
    out.save_max_rank_bytes =
        std::max(out.save_max_rank_bytes, static_cast<int64_t>(rr.save_bytes));
    out.step_seconds = std::max(out.step_seconds, rr.step);
    out.compute_seconds = std::max(out.compute_seconds, rr.compute);
    out.peak_runtime_bytes =
        std::max(out.peak_runtime_bytes, rr.memory.compute_peak);
    for (int c = 0; c < kNumMemoryCategories; ++c) {
      out.peak_by_category[c] =
          std::max(out.peak_by_category[c], rr.memory.peak[c]);
    }
    for (const std::string& race : rr.races) {
      if (out.races.size() < 8) {
        out.races.push_back(absl::StrCat("rank ", r, ": ", race));
      }
    }
  }
  out.wall_seconds = std::chrono::duration<double>(
                         std::chrono::steady_clock::now() - wall_start)
                         .count();
  return out;
}

}  // namespace

absl::StatusOr<std::vector<SimulatedStrategy>> SimulatePlan(
    const Plan& plan, const PlanOptions& options,
    const SimulateOptions& simulate) {
  std::vector<SimulatedStrategy> out;
  for (const StrategyPlan& sp : plan.strategies) {
    if (simulate.progress) {
      simulate.progress(absl::StrFormat("simulating %s on %d ranks (%d units)",
                                        ShardingStrategyName(sp.strategy),
                                        plan.world_size(), plan.units));
    }
    FLATPARAM_ASSIGN_OR_RETURN(SimulatedStrategy s,
                               SimulateStrategy(plan, options, simulate, sp));
    if (simulate.progress) {
      simulate.progress(absl::StrFormat("%s done in %.1f s",
                                        ShardingStrategyName(sp.strategy),
                                        s.wall_seconds));
    }
    out.push_back(std::move(s));
  }
  return out;
}

void PrintSimulationTable(const Plan& plan,
                          const std::vector<SimulatedStrategy>& simulated,
                          std::ostream& out) {
  PrintPlanTable(plan, out);
  for (size_t i = 0; i < simulated.size(); ++i) {
    const SimulatedStrategy& s = simulated[i];
    const cost::StepPrediction& p = plan.strategies[i].prediction;
    out << "\nsimulated " << ShardingStrategyName(s.strategy) << " on "
        << s.world_size << " ranks: " << s.collectives
        << " collective calls in " << absl::StrFormat("%.1f", s.wall_seconds)
        << " s\n";
    out << absl::StrFormat("  step time     %12s   plan %12s   %s\n",
                           Time(s.step_seconds), Time(p.step_seconds),
                           Percent(s.step_seconds, p.step_seconds));
    out << absl::StrFormat("  exposed comm  %12s   plan %12s\n",
                           Time(s.exposed_comm_seconds()),
                           Time(p.exposed_comm_seconds));
    out << absl::StrFormat(
        "  peak memory   %12s   plan %12s   of %s: %s\n",
        HumanBytes(s.peak_bytes()), HumanBytes(p.peak_bytes),
        HumanBytes(plan.gpu_memory_bytes),
        s.peak_bytes() <= plan.gpu_memory_bytes ? "fits" : "DOES NOT FIT");
    std::vector<std::string> parts;
    for (int c = 0; c < kNumMemoryCategories; ++c) {
      if (s.peak_by_category[c] == 0) continue;
      parts.push_back(
          absl::StrCat(MemoryCategoryName(static_cast<MemoryCategory>(c)), " ",
                       HumanBytes(s.peak_by_category[c])));
    }
    parts.push_back(
        absl::StrCat("optimizer_state ", HumanBytes(s.optimizer_bytes)));
    out << "  peaks by category: " << absl::StrJoin(parts, ", ") << "\n";
    out << "  checks        no deadlock, no desync, "
        << (s.races.empty() ? "no stream race"
                            : absl::StrCat(s.races.size(), " stream race(s)"))
        << "\n";
    for (const std::string& race : s.races) out << "    " << race << "\n";
    if (s.saved) {
      out << absl::StrFormat(
          "  checkpoint    %12s   %s written, at most %s by one rank; "
          "%s staged on the host per rank\n",
          Time(s.save_seconds), HumanBytes(s.save_bytes),
          HumanBytes(s.save_max_rank_bytes), HumanBytes(s.save_host_bytes));
    }
  }
}

nlohmann::json SimulationJson(const Plan& plan,
                              const std::vector<SimulatedStrategy>& simulated) {
  nlohmann::json doc = PlanJson(plan);
  for (size_t i = 0; i < simulated.size(); ++i) {
    const SimulatedStrategy& s = simulated[i];
    nlohmann::json by_category = nlohmann::json::object();
    for (int c = 0; c < kNumMemoryCategories; ++c) {
      by_category[std::string(MemoryCategoryName(
          static_cast<MemoryCategory>(c)))] = s.peak_by_category[c];
    }
    doc["strategies"][i]["simulated"] = {
        {"step_time_s", s.step_seconds},
        {"compute_s", s.compute_seconds},
        {"exposed_comm_s", s.exposed_comm_seconds()},
        {"peak_bytes", s.peak_bytes()},
        {"peak_by_category", std::move(by_category)},
        {"optimizer_bytes", s.optimizer_bytes},
        {"collectives", s.collectives},
        {"races", s.races},
        {"wall_s", s.wall_seconds},
    };
    if (s.saved) {
      doc["strategies"][i]["simulated"]["save"] = {
          {"time_s", s.save_seconds},
          {"bytes", s.save_bytes},
          {"max_rank_bytes", s.save_max_rank_bytes},
          {"host_bytes_per_rank", s.save_host_bytes},
      };
    }
  }
  return doc;
}

absl::StatusOr<bool> RunSimulation(const PlanOptions& options,
                                   const SimulateOptions& simulate,
                                   std::ostream& out) {
  FLATPARAM_ASSIGN_OR_RETURN(Plan plan, MakePlan(options));
  FLATPARAM_ASSIGN_OR_RETURN(std::vector<SimulatedStrategy> simulated,
                             SimulatePlan(plan, options, simulate));
  FLATPARAM_ASSIGN_OR_RETURN(OutputFormat format,
                             ParseOutputFormat(options.format));
  if (format == OutputFormat::kJson) {
    out << SimulationJson(plan, simulated).dump(2) << "\n";
  } else {
    PrintSimulationTable(plan, simulated, out);
  }
  for (const SimulatedStrategy& s : simulated) {
    if (!s.races.empty()) return false;
  }
  return true;
}

}  // namespace tools
}  // namespace flatparam
