#include "tools/demo.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <iostream>
#include <ostream>
#include <string>
#include <system_error>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/checkpoint/convert.h"
#include "flatparam/checkpoint/file_system.h"
#include "flatparam/layout.h"
#include "flatparam/model_layout.h"
#include "flatparam/runtime.h"
#include "refmodel/fsdp_trainer.h"
#include "tools/demo_torch.h"
#include "tools/paths.h"

namespace flatparam {
namespace tools {
namespace {

constexpr int kFirstWorld = 8;
constexpr int kSecondWorld = 4;
constexpr int kShardGroup = 2;
// Steps of the LibTorch transformer (stage 6).
constexpr int kTorchSteps = 150;

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
      .count();
}

// "1.5 MiB" style sizes for the report (exact bytes are in the traces and
// `fsdp train`'s own output).
std::string Bytes(int64_t n) {
  if (n >= (int64_t{1} << 20)) {
    return absl::StrFormat("%.2f MiB", static_cast<double>(n) / (1 << 20));
  }
  if (n >= 1024) {
    return absl::StrFormat("%.1f KiB", static_cast<double>(n) / 1024);
  }
  return absl::StrFormat("%d B", n);
}

std::string PhaseName(const TrainReport& r) {
  const refmodel::FsdpTrainOptions& o = r.options;
  if (IsHybridStrategy(o.strategy)) {
    return absl::StrFormat("%s %dx%d", ShardingStrategyName(o.strategy),
                           r.world_size / o.shard_group_size,
                           o.shard_group_size);
  }
  return absl::StrFormat("%s x%d", ShardingStrategyName(o.strategy),
                         r.world_size);
}

// The checks one training phase contributes.
void AddTrainChecks(const TrainReport& report, const std::string& what,
                    std::vector<DemoCheck>& checks) {
  const bool have = report.check.has_value();
  checks.push_back(
      {absl::StrFormat("%s: losses, parameters and optimizer state bitwise "
                       "equal to single-process training%s",
                       what,
                       report.history.empty()
                           ? ""
                           : " of every step so far (chained at the "
                             "checkpoint, each segment with its own "
                             "gradient fold)"),
       have && report.check->bitwise_equal && report.check->passed});
  checks.push_back(
      {absl::StrFormat("%s: every rank's peak memory equals the "
                       "closed-form formula",
                       what),
       have && report.check->memory_formula_holds.value_or(false)});
  checks.push_back(
      {absl::StrFormat("%s: padding never received a gradient", what),
       have && report.check->nonzero_padding_grads == 0});
}

absl::Status VerifyInto(checkpoint::FileSystem& fs, const std::string& dir,
                        std::vector<DemoCheck>& checks) {
  absl::StatusOr<checkpoint::CheckpointReport> r =
      checkpoint::VerifyCheckpoint(fs, dir);
  if (!r.ok()) {
    checks.push_back(
        {absl::StrFormat("%s: %s", dir, r.status().ToString()), false});
    return absl::OkStatus();
  }
  checks.push_back(
      {absl::StrFormat("%s verified: %s checkpoint, %d files, %s, manifest and "
                       "XXH3 checksums match",
                       dir, checkpoint::CheckpointKindName(r->kind), r->files,
                       Bytes(static_cast<int64_t>(r->bytes))),
       true});
  return absl::OkStatus();
}

}  // namespace

bool DemoResult::passed() const {
  if (checks.empty()) return false;
  for (const DemoCheck& c : checks) {
    if (!c.passed) return false;
  }
  return true;
}

absl::StatusOr<DemoResult> RunDemo(const DemoOptions& options,
                                   std::ostream& out) {
  if (options.out_dir.empty()) {
    return absl::InvalidArgumentError("demo: --out must name a directory");
  }
  if (options.steps < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("demo: --steps must be >= 1, got %d", options.steps));
  }
  std::error_code ec;
  std::filesystem::create_directories(options.out_dir, ec);
  if (ec) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "demo: cannot create %s: %s", options.out_dir, ec.message()));
  }
  const auto start = std::chrono::steady_clock::now();
  checkpoint::FileSystem& fs = checkpoint::PosixFileSystem();
  DemoResult result;
  const auto path = [&](const char* name) {
    return checkpoint::JoinPath(options.out_dir, name);
  };
  result.first_trace = path("trace-full-shard-x8.json");
  result.second_trace = path("trace-hybrid-shard-2x2.json");
  result.first_checkpoint = path("ckpt-full-shard-x8");
  result.resharded_checkpoint = path("ckpt-hybrid-shard-2x2");
  result.final_checkpoint = path("ckpt-final-hybrid-shard-2x2");
  result.consolidated_checkpoint = path("ckpt-final-full");

  // 1-2. Train on 8 ranks and save.
  TrainCommandOptions first;
  first.backend = "sim";
  first.world_size = kFirstWorld;
  first.world_size_given = true;
  first.strategy = "FULL_SHARD";
  first.steps = options.steps;
  first.seed = options.seed;
  first.optimizer = "adamw";
  first.check_reference = true;
  first.save_dir = result.first_checkpoint;
  out << absl::StrFormat(
      "[1/6] train %d steps on %d simulated ranks with FULL_SHARD, save a "
      "sharded checkpoint\n",
      options.steps, kFirstWorld);
  out.flush();
  FLATPARAM_ASSIGN_OR_RETURN(result.first,
                             TrainOnSim(first, result.first_trace));
  AddTrainChecks(result.first, "FULL_SHARD on 8 ranks", result.checks);

  // 3. Reshard offline to the second job's layout.
  TrainCommandOptions second = first;
  second.world_size = kSecondWorld;
  second.strategy = "HYBRID_SHARD";
  second.shard_group_size = kShardGroup;
  second.save_dir = result.final_checkpoint;
  second.load_dir = result.resharded_checkpoint;
  FLATPARAM_ASSIGN_OR_RETURN(refmodel::FsdpTrainOptions second_train,
                             MakeFsdpTrainOptions(second, kSecondWorld));
  FLATPARAM_ASSIGN_OR_RETURN(
      ModelLayout second_layout,
      refmodel::FsdpModelLayout(second_train, kSecondWorld));
  out << absl::StrFormat(
      "[2/6] reshard it offline to HYBRID_SHARD on %d ranks (%d shard groups "
      "of %d), streaming, in this process\n",
      kSecondWorld, kSecondWorld / kShardGroup, kShardGroup);
  out.flush();
  FLATPARAM_RETURN_IF_ERROR(checkpoint::ReshardCheckpoint(
      fs, result.first_checkpoint, second_layout.options(), kSecondWorld,
      result.resharded_checkpoint));

  // 4. Resume on 4 ranks.
  out << absl::StrFormat(
      "[3/6] resume from it for %d more steps on %d ranks with HYBRID_SHARD, "
      "save again\n",
      options.steps, kSecondWorld);
  out.flush();
  FLATPARAM_ASSIGN_OR_RETURN(result.second,
                             TrainOnSim(second, result.second_trace));
  AddTrainChecks(result.second, "HYBRID_SHARD 2x2 resumed", result.checks);
  result.checks.push_back(
      {absl::StrFormat("the resumed run continued at step %d", options.steps),
       result.second.options.first_step == options.steps});

  // 5. Verify and consolidate.
  out << "[4/6] verify every checkpoint\n";
  out.flush();
  for (const std::string* dir :
       {&result.first_checkpoint, &result.resharded_checkpoint,
        &result.final_checkpoint}) {
    FLATPARAM_RETURN_IF_ERROR(VerifyInto(fs, *dir, result.checks));
  }
  out << "[5/6] consolidate the final checkpoint into a full one\n";
  out.flush();
  const absl::Status consolidated = checkpoint::ConsolidateCheckpoint(
      fs, result.final_checkpoint, result.consolidated_checkpoint);
  if (consolidated.ok()) {
    FLATPARAM_RETURN_IF_ERROR(
        VerifyInto(fs, result.consolidated_checkpoint, result.checks));
  } else {
    result.checks.push_back(
        {absl::StrFormat("consolidate: %s", consolidated.ToString()), false});
  }

  // 6. A real network: the LibTorch transformer on real text.
  out << absl::StrFormat(
      "[6/6] train a GPT-2-style transformer written with LibTorch under "
      "flatparam's FsdpModule, byte-level on GPL-3's text, %d steps, each "
      "block's activations recomputed in its backward\n",
      kTorchSteps);
  out.flush();
  std::cout.flush();
  FLATPARAM_ASSIGN_OR_RETURN(
      result.torch, RunTorchDemoProcess(kTorchSteps, options.seed,
                                        path("torch-demo-result.json")));
  if (result.torch.ran) {
    const std::vector<float>& l = result.torch.losses;
    float last = 0;
    const size_t tail = std::min<size_t>(10, l.size());
    for (size_t i = l.size() - tail; i < l.size(); ++i) last += l[i] / tail;
    result.checks.push_back(
        {absl::StrFormat("LibTorch GPT, FULL_SHARD on %d ranks, blocks "
                         "recomputed: every loss and parameter bitwise "
                         "single-process LibTorch training (no recomputation)",
                         result.torch.world_size),
         l == result.torch.reference_losses && result.torch.params_equal});
    result.checks.push_back(
        {absl::StrFormat("LibTorch GPT learnt the text: loss %.2f -> %.2f "
                         "(last 10 steps' mean), well below uniform ln 256 "
                         "= 5.55",
                         l.front(), last),
         last < 3.3f});
  }
  result.seconds = SecondsSince(start);
  return result;
}

void PrintDemoReport(const DemoResult& result, std::ostream& out) {
  const TrainReport* phases[] = {&result.first, &result.second};
  const refmodel::FsdpTrainOptions& o = result.first.options;
  out << absl::StrFormat(
      "\n# fsdp demo: the reference model (vocab %d, dims [%s]), AdamW, "
      "global batch %d, %s, on the deterministic simulator\n",
      o.model.vocab, absl::StrJoin(o.model.dims, ", "), o.global_batch,
      DescribePrefetch(o));

  out << "\nstep  ranks  strategy             loss\n";
  for (const TrainReport* r : phases) {
    for (size_t k = 0; k < r->losses.size(); ++k) {
      out << absl::StrFormat("%4d  %5d  %-18s  %.9g\n",
                             r->options.first_step + static_cast<int64_t>(k),
                             r->world_size, PhaseName(*r), r->losses[k]);
    }
  }

  out << "\npeak memory per rank (FlatParamHandle accounting: parameters "
         "and gradients; optimizer state on the host)\n";
  out << "phase                 rank   peak (all categories)   optimizer "
         "state\n";
  for (const TrainReport* r : phases) {
    for (const RankSummary& s : r->ranks) {
      out << absl::StrFormat("%-20s  %4d  %22s  %16s\n", PhaseName(*r), s.rank,
                             Bytes(s.memory.compute_peak),
                             Bytes(s.optimizer_state_bytes));
    }
  }

  out << "\ncommunication (the handles' collectives, nccl-tests sizes; sent "
         "= what a ring sends)\n";
  out << "phase                 all_gather     reduce_scatter  all_reduce     "
         "sent, all ranks\n";
  for (const TrainReport* r : phases) {
    CommStats total;
    int64_t sent = 0;
    for (const RankSummary& s : r->ranks) {
      total.all_gather.bytes += s.comm.all_gather.bytes;
      total.reduce_scatter.bytes += s.comm.reduce_scatter.bytes;
      total.all_reduce.bytes += s.comm.all_reduce.bytes;
      sent += s.comm.total_sent_bytes();
    }
    out << absl::StrFormat("%-20s  %-13s  %-14s  %-13s  %s\n", PhaseName(*r),
                           Bytes(total.all_gather.bytes),
                           Bytes(total.reduce_scatter.bytes),
                           Bytes(total.all_reduce.bytes), Bytes(sent));
  }

  if (result.torch.ran) {
    const TorchDemoResult& t = result.torch;
    out << absl::StrFormat(
        "\n# a GPT-2-style transformer in LibTorch (%d parameters, Hugging "
        "Face GPT-2 names), byte-level on %s, AdamW, FULL_SHARD on %d "
        "simulated ranks, each block's activations recomputed inside its "
        "unit\n",
        t.parameters, t.text_path, t.world_size);
    out << "\nstep  loss (FSDP, rank 0)  loss (single process)\n";
    for (size_t k = 0; k < t.losses.size(); ++k) {
      if (k % 25 != 0 && k + 1 != t.losses.size()) continue;
      out << absl::StrFormat("%4d  %19.6f  %21.6f\n", k, t.losses[k],
                             t.reference_losses[k]);
    }
  } else {
    out << "\nLibTorch stage skipped: " << result.torch.skipped << "\n";
  }

  out << "\nchecks\n";
  for (const DemoCheck& c : result.checks) {
    out << (c.passed ? "  [ok]   " : "  [FAIL] ") << c.what << "\n";
  }

  out << "\nwritten\n";
  out << "  Chrome traces (open in https://ui.perfetto.dev or "
         "chrome://tracing):\n";
  out << "    " << AbsolutePath(result.first_trace) << "\n    "
      << AbsolutePath(result.second_trace) << "\n";
  out << "  sharded checkpoints: " << AbsolutePath(result.first_checkpoint)
      << " (8 ranks), " << AbsolutePath(result.resharded_checkpoint)
      << " (resharded), " << AbsolutePath(result.final_checkpoint)
      << " (after resuming)\n";
  out << "  full checkpoint (safetensors, keyed by parameter name): "
      << AbsolutePath(result.consolidated_checkpoint) << "\n";
  out << absl::StrFormat("\n%s in %.1f s\n",
                         result.passed() ? "demo PASSED: every check holds"
                                         : "demo FAILED: see the checks above",
                         result.seconds);
}

}  // namespace tools
}  // namespace flatparam
