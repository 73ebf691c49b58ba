// `fsdp plan --simulate`: one training step of the real runtime, on every
// rank of the planned world, before anything is launched. Each rank runs
// FsdpRuntime over its FlatParamHandles on a simulated device without
// memory (SimDeviceOptions::metadata_only: buffers are sizes, no bytes)
// and the deterministic simulator (sim/sim.h, metadata_only, NCCL's one
// stream per rank, collectives priced as the plan prices them), with the
// synthetic compute of refmodel/synthetic_step.h (one kernel per unit of
// the plan's duration). The first iteration records the execution order;
// the second is the steady state that is measured, against the plan:
//
//   fsdp plan --model=llama2-70b --nodes=512 --strategy=HYBRID_SHARD
//       --mixed-precision=bf16 --simulate
//
// What it reports per rank (the table shows the slowest / largest):
//   * the step's time and the communication the compute stream waited
//     for, on the virtual clock, next to the plan's closed form (they agree
//     within 2%, verify/plan_agreement_test's claim, now at the planned
//     scale);
//   * peak memory by category: the runtime's own accounting (MemoryStats,
//     host-ordered: a buffer counts from the call that allocates it to the
//     call that frees it), plus the optimizer state the plan adds, against
//     the GPU's memory and the plan's timeline peak;
//   * the checks: no deadlock and no desynchronisation (the simulator's,
//     with the ranks' FSDP contexts compared, so equal-sized collectives of
//     different units are caught: SimOptions::check_context), and no stream
//     race (SimDeviceOps' detector).
// A problem ends the simulation with the first failure: a desync names the
// collective, the units and the ranks on each side.
//
// Cost: the ranks run one at a time, so time grows with ranks x units;
// memory is each rank's runtime metadata (handles, streams, the race
// detector's clocks). BENCHMARKS.md has the scaling curve.
//
// Thread-safety: reentrant; each call owns its simulated world.
#ifndef TOOLS_SIMULATE_H_
#define TOOLS_SIMULATE_H_

#include <cstdint>
#include <functional>
#include <nlohmann/json_fwd.hpp>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "flatparam/layout.h"
#include "flatparam/memory_stats.h"
#include "sim/cost_model.h"
#include "tools/plan.h"

namespace flatparam {
namespace tools {

struct SimulateOptions {
  // The simulator's scheduling seed (a different interleaving of the
  // ranks; the results do not depend on it).
  uint64_t seed = 1;
  // "" or "UNIT:RANKS" (e.g. "layers.3:0-3,8"): layer UNIT runs on those
  // ranks only, as a conditional module does -- a program the simulation
  // reports as desynchronised.
  std::string conditional_unit;
  // Called from the simulating thread with a line of progress (a phase
  // begun, a strategy done); may be null.
  std::function<void(absl::string_view)> progress;
  // After the measured step, every rank saves a sharded checkpoint of its
  // state as `fsdp train --save` does: the collective protocol of
  // flatparam/checkpoint/collective_checkpoint.h (its status exchanges over
  // every rank, rank 0 preparing and publishing the directory on an
  // in-memory file system), with the rank files sized exactly and not
  // written (SimulateCollectiveRankFiles). Each writing rank (the first
  // shard group) spends bytes / save_bytes_per_second on its virtual clock
  // for the copy to the host and the write.
  bool save = false;
  // Per writing rank: a parallel file system client's share.
  double save_bytes_per_second = 2e9;
};

struct SimulatedStrategy {
  ShardingStrategy strategy = ShardingStrategy::kFullShard;
  int64_t world_size = 0;
  // The measured (second) step on the virtual clock: the slowest rank's
  // time, and its compute (the sum of its kernels).
  double step_seconds = 0;
  double compute_seconds = 0;
  double exposed_comm_seconds() const { return step_seconds - compute_seconds; }
  // Peak bytes of each MemoryCategory and of their sum during the measured
  // step, the largest over ranks; the optimizer state the plan counts.
  std::array<int64_t, kNumMemoryCategories> peak_by_category{};
  int64_t peak_runtime_bytes = 0;
  int64_t optimizer_bytes = 0;
  int64_t peak_bytes() const { return peak_runtime_bytes + optimizer_bytes; }
  // Collective calls of all ranks, both iterations.
  int64_t collectives = 0;
  // SimulateOptions::save: the slowest rank's save on the virtual clock,
  // the checkpoint's bytes (every file but the manifest), the most one rank
  // writes, and the host memory a rank's state is staged in (its shard of
  // the parameters and its optimizer state).
  bool saved = false;
  double save_seconds = 0;
  int64_t save_bytes = 0;
  int64_t save_max_rank_bytes = 0;
  int64_t save_host_bytes = 0;
  // Stream-race reports (empty when none). A deadlock or desync is the
  // status of SimulatePlan instead.
  std::vector<std::string> races;
  double wall_seconds = 0;
};

// Runs the step for every strategy of `plan` (made by MakePlan from
// `options`). The returned vector is parallel to plan.strategies.
// Errors: InvalidArgument for a bad conditional_unit (unknown unit, the
// root, ranks outside the world); FailedPrecondition carrying the
// simulator's report when the ranks deadlock or desynchronise, prefixed
// with the strategy; otherwise the layout's and runtime's errors.
absl::StatusOr<std::vector<SimulatedStrategy>> SimulatePlan(
    const Plan& plan, const PlanOptions& options,
    const SimulateOptions& simulate);

// The plan's table followed by, per strategy, the simulated step beside
// the plan's figures and the checks.
void PrintSimulationTable(const Plan& plan,
                          const std::vector<SimulatedStrategy>& simulated,
                          std::ostream& out);

// PlanJson with a "simulated" object in each strategy: {"step_time_s",
// "compute_s", "exposed_comm_s", "peak_bytes", "peak_by_category": {...},
// "optimizer_bytes", "collectives", "races": [...], "wall_s"}, and with
// SimulateOptions::save "save": {"time_s", "bytes", "max_rank_bytes",
// "host_bytes_per_rank"}.
nlohmann::json SimulationJson(const Plan& plan,
                              const std::vector<SimulatedStrategy>& simulated);

// MakePlan, SimulatePlan, then PrintSimulationTable or SimulationJson
// (options.format) to `out`. True when every check passed; false when a
// stream race was found (it is in the output). A deadlock or desync is
// SimulatePlan's FailedPrecondition, and nothing is written.
absl::StatusOr<bool> RunSimulation(const PlanOptions& options,
                                   const SimulateOptions& simulate,
                                   std::ostream& out);

}  // namespace tools
}  // namespace flatparam

#endif  // TOOLS_SIMULATE_H_
