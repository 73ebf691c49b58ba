// `fsdp plan`: flags in, RunPlan, exit code out.
#include <cmath>
#include <iostream>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "absl/flags/internal/parse.h"
#include "absl/status/status.h"
#include "absl/strings/str_replace.h"
#include "tools/common_flags.h"
#include "tools/plan.h"
#include "tools/simulate.h"
#include "tools/subcommand.h"

// Shared with `fsdp train` (train_command.cc) and `fsdp collectives`
// (collectives_command.cc), which define them.
ABSL_DECLARE_FLAG(std::string, mixed_precision);
ABSL_DECLARE_FLAG(std::string, optimizer);
ABSL_DECLARE_FLAG(std::string, trace);
// common_flags.cc.
ABSL_DECLARE_FLAG(uint64_t, seed);

ABSL_FLAG(int64_t, nodes, 1, "plan: number of nodes.");
ABSL_FLAG(int64_t, gpus_per_node, 0,
          "plan: GPUs per node (default: the topology's, 8).");
ABSL_FLAG(double, tokens_per_gpu, 4096,
          "plan: training tokens per GPU per step.");
ABSL_FLAG(std::string, topology, "dgx-h100",
          "plan: dgx-h100, ib-hdr, h100-pcie-ndr or ethernet-100g.");
ABSL_FLAG(double, intra_bandwidth, 0,
          "plan: override the intra-node bandwidth, GB/s per GPU and "
          "direction.");
ABSL_FLAG(double, inter_bandwidth, 0,
          "plan: override the inter-node bandwidth, GB/s per GPU.");
ABSL_FLAG(double, intra_latency_us, -1,
          "plan: override the intra-node latency per ring step, us.");
ABSL_FLAG(double, inter_latency_us, -1,
          "plan: override the inter-node latency per ring step, us.");
ABSL_FLAG(double, peak_tflops, 0,
          "plan: override the GPU's dense peak TFLOP/s for the compute dtype.");
ABSL_FLAG(double, efficiency, 0.4,
          "plan: fraction of peak FLOP/s the model achieves, in (0, 1].");
ABSL_FLAG(std::string, gpu_memory, "",
          "plan: GPU memory for the fits column, e.g. 80GiB (default: the "
          "topology's GPU).");

ABSL_FLAG(bool, simulate, false,
          "plan: also run one training step of the runtime on every rank of "
          "the planned world, on the simulator without data.");
ABSL_FLAG(std::string, conditional_unit, "",
          "plan --simulate: UNIT:RANKS, layer UNIT runs on those ranks only.");
ABSL_FLAG(bool, simulate_save, false,
          "plan --simulate: after the step, every rank saves a sharded "
          "checkpoint (the collective protocol, files sized not written).");
ABSL_FLAG(double, save_gbps, 2.0,
          "plan --simulate-save: GB/s each writing rank copies to the host "
          "and writes.");

namespace flatparam {
namespace tools {
namespace {

// A flag given on the command line (even with its default value).
bool Given(absl::string_view name) {
  return absl::flags_internal::WasPresentOnCommandLine(name);
}

std::optional<double> Override(absl::string_view name, double value) {
  return Given(name) ? std::optional<double>(value) : std::nullopt;
}

// --simulate found a deadlock, a desync or a stream race.
constexpr int kExitCheckFailed = 4;

int PlanMain(const std::vector<char*>& args) {
  if (!args.empty()) {
    std::cerr << "fsdp plan: unexpected argument \"" << args[0]
              << "\"; see fsdp plan --help\n";
    return kExitUsage;
  }
  PlanOptions options;
  options.model = absl::GetFlag(FLAGS_model);
  options.nodes = absl::GetFlag(FLAGS_nodes);
  options.gpus_per_node = absl::GetFlag(FLAGS_gpus_per_node);
  if (Given("gpus_per_node") && options.gpus_per_node == 0) {
    std::cerr << "fsdp plan: --gpus-per-node must be >= 1, got 0\n";
    return kExitUsage;
  }
  options.strategy =
      Given("strategy") ? absl::GetFlag(FLAGS_strategy) : std::string("all");
  options.mixed_precision = absl::GetFlag(FLAGS_mixed_precision);
  options.optimizer = absl::GetFlag(FLAGS_optimizer);
  options.tokens_per_gpu = absl::GetFlag(FLAGS_tokens_per_gpu);
  options.topology = absl::GetFlag(FLAGS_topology);
  options.intra_gbps =
      Override("intra_bandwidth", absl::GetFlag(FLAGS_intra_bandwidth));
  options.inter_gbps =
      Override("inter_bandwidth", absl::GetFlag(FLAGS_inter_bandwidth));
  options.intra_latency_us =
      Override("intra_latency_us", absl::GetFlag(FLAGS_intra_latency_us));
  options.inter_latency_us =
      Override("inter_latency_us", absl::GetFlag(FLAGS_inter_latency_us));
  options.peak_tflops =
      Override("peak_tflops", absl::GetFlag(FLAGS_peak_tflops));
  options.efficiency = absl::GetFlag(FLAGS_efficiency);
  options.gpu_memory = absl::GetFlag(FLAGS_gpu_memory);
  options.align_addresses = absl::GetFlag(FLAGS_align_addresses);
  options.format = absl::GetFlag(FLAGS_format);
  options.trace_path = absl::GetFlag(FLAGS_trace);
  for (const char* other :
       {"world_size", "shard_group_size", "dtype", "compute_dtype"}) {
    if (Given(other)) {
      std::cerr << "fsdp plan: --" << other
                << " does not apply; the plan takes --nodes, --gpus-per-node "
                   "and --mixed-precision\n";
      return kExitUsage;
    }
  }

  if (absl::Status status = ValidatePlanOptions(options); !status.ok()) {
    std::cerr << "fsdp plan: " << status.message() << "\n";
    return kExitUsage;
  }
  if (absl::GetFlag(FLAGS_simulate)) {
    if (!options.trace_path.empty()) {
      std::cerr << "fsdp plan: --trace writes the plan's predicted "
                   "timelines; run it without --simulate\n";
      return kExitUsage;
    }
    SimulateOptions simulate;
    simulate.seed = absl::GetFlag(FLAGS_seed);
    simulate.conditional_unit = absl::GetFlag(FLAGS_conditional_unit);
    simulate.save = absl::GetFlag(FLAGS_simulate_save);
    const double save_gbps = absl::GetFlag(FLAGS_save_gbps);
    if (!(save_gbps > 0) || !std::isfinite(save_gbps)) {
      std::cerr << "fsdp plan: --save-gbps must be a positive number of GB/s, "
                   "got "
                << save_gbps << "\n";
      return kExitUsage;
    }
    simulate.save_bytes_per_second = save_gbps * 1e9;
    simulate.progress = [](absl::string_view line) {
      std::cerr << "fsdp plan: " << line << "\n";
    };
    const absl::StatusOr<bool> passed =
        RunSimulation(options, simulate, std::cout);
    std::cout.flush();
    if (!passed.ok()) {
      std::cerr << "fsdp plan: " << passed.status().message() << "\n";
      return passed.status().code() == absl::StatusCode::kFailedPrecondition
                 ? kExitCheckFailed
             : passed.status().code() == absl::StatusCode::kInvalidArgument
                 ? kExitUsage
                 : kExitError;
    }
    if (!*passed) return kExitCheckFailed;
    return std::cout.good() ? kExitOk : kExitError;
  }
  for (const char* flag : {"conditional_unit", "simulate_save", "save_gbps"}) {
    if (Given(flag)) {
      std::cerr << "fsdp plan: --" << absl::StrReplaceAll(flag, {{"_", "-"}})
                << " needs --simulate\n";
      return kExitUsage;
    }
  }
  const absl::Status status = RunPlan(options, std::cout);
  std::cout.flush();
  if (!status.ok()) {
    std::cerr << "fsdp plan: " << status.message() << "\n";
    return kExitError;
  }
  return std::cout.good() ? kExitOk : kExitError;
}

constexpr char kHelp[] =
    "usage: fsdp plan --model=NAME|PATH --nodes=N [--gpus-per-node=G]\n"
    "                 [--strategy=all|FULL_SHARD|...] "
    "[--mixed-precision=none|bf16|fp16]\n"
    "                 [--optimizer=adamw|sgd] [--tokens-per-gpu=T]\n"
    "                 [--topology=NAME] [--gpu-memory=80GiB]\n"
    "                 [--format=table|json] [--trace=FILE.json]\n"
    "                 [--simulate [--seed=S] [--conditional-unit=UNIT:RANKS]\n"
    "                  [--simulate-save [--save-gbps=GBPS]]]\n"
    "\n"
    "Predicts, per sharding strategy, bytes per rank for parameters,\n"
    "gradients and optimizer state (2 + 2 + 12 bytes per parameter for\n"
    "bf16 + AdamW, divided by the shard degree where the strategy shards\n"
    "them), the peak of the per-rank memory timeline, bytes sent per step,\n"
    "the step time and the communication the compute stream waits for, on\n"
    "an alpha-beta model of the cluster. Activations are not included.\n"
    "\n"
    "flags:\n"
    "  --model=NAME|PATH        preset, model JSON file, or a sharded\n"
    "                           checkpoint directory (its model; required)\n"
    "  --nodes=N                nodes (default 1)\n"
    "  --gpus-per-node=G        GPUs per node (default: the topology's)\n"
    "  --strategy=S             all (default) or one strategy name\n"
    "  --mixed-precision=MP     none (default: the parameters' dtype), bf16\n"
    "                           or fp16 (float32 master weights)\n"
    "  --optimizer=O            adamw (default) or sgd (with momentum)\n"
    "  --tokens-per-gpu=T       tokens per GPU per step (default 4096)\n"
    "  --topology=NAME          dgx-h100 (default), ib-hdr, h100-pcie-ndr,\n"
    "                           ethernet-100g\n"
    "  --intra-bandwidth=GBPS   override: GB/s per GPU and direction\n"
    "  --inter-bandwidth=GBPS   override: network GB/s per GPU\n"
    "  --intra-latency-us=US    override: latency per intra-node ring step\n"
    "  --inter-latency-us=US    override: latency per inter-node ring step\n"
    "  --peak-tflops=TF         override: dense peak of the compute dtype\n"
    "  --efficiency=F           achieved fraction of peak (default 0.4)\n"
    "  --gpu-memory=SIZE        memory per GPU for the fits column\n"
    "                           (default: the topology's GPU, 80GiB)\n"
    "  --align-addresses        16-byte aligned parameters "
    "(use_orig_params=True)\n"
    "  --format=table|json      output format (default table)\n"
    "  --trace=FILE.json        write the predicted timelines (Chrome\n"
    "                           trace-event JSON: compute and comm threads,\n"
    "                           memory counters; one process per strategy)\n"
    "  --simulate               also run one step of the runtime on every\n"
    "                           rank, on the simulator without data: its\n"
    "                           step time, peak memory by category, and\n"
    "                           the checks (no deadlock, no desync, no\n"
    "                           stream race); exit 4 when a check fails\n"
    "  --seed=S                 the simulator's interleaving (default 0)\n"
    "  --conditional-unit=UNIT:RANKS  with --simulate: layer UNIT runs on\n"
    "                           RANKS only (e.g. layers.3:0-3), which the\n"
    "                           simulation reports as a desync\n"
    "  --simulate-save          with --simulate: then every rank saves a\n"
    "                           sharded checkpoint as fsdp train --save\n"
    "                           does (its collective protocol; the files\n"
    "                           are sized, not written): its time, bytes\n"
    "                           and host staging per rank\n"
    "  --save-gbps=GBPS         GB/s each writing rank copies to the host\n"
    "                           and writes (default 2)\n";

void PrintHelp(std::ostream& out) { out << kHelp << "\n" << PresetsHelp(); }

}  // namespace

const Subcommand kPlanSubcommand = {
    "plan",
    "predict memory, communication and step time of each strategy at scale",
    PrintHelp,
    PlanMain,
};

}  // namespace tools
}  // namespace flatparam
