// `fsdp train`: flags in, RunTrainSim/RunTrainMpi, exit code out.
#include <cstdint>
#include <iostream>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/flag.h"
#include "absl/flags/reflection.h"
#include "absl/status/status.h"
#include "flatparam/base/status_macros.h"
#include "tools/collectives.h"
#include "tools/common_flags.h"
#include "tools/subcommand.h"
#include "tools/train.h"

ABSL_FLAG(int64_t, steps, 3, "Training steps.");
ABSL_FLAG(int64_t, micro_batches, 1, "Micro-batches per step.");
ABSL_FLAG(bool, sync, true,
          "Reduce the gradients of every micro-batch; --no-sync accumulates "
          "them under no_sync and reduces once per step.");
ABSL_FLAG(std::string, mixed_precision, "none",
          "bf16, fp16 or none: the parameters' and gradients' dtype in the "
          "forward, backward and reduction.");
ABSL_FLAG(bool, cpu_offload, false,
          "Keep the sharded parameters and gradients on the host.");
ABSL_FLAG(std::string, backward_prefetch, "pre",
          "none, pre or post: the runtime's backward prefetch (PyTorch's "
          "BackwardPrefetch: None, BACKWARD_PRE, BACKWARD_POST).");
ABSL_FLAG(bool, forward_prefetch, false,
          "Prefetch the next units' parameters in the forward (from the "
          "second iteration on, in the order the first one recorded).");
ABSL_FLAG(int64_t, prefetch_depth, 1,
          "How many units ahead a prefetch reaches (>= 1).");
ABSL_FLAG(int64_t, limit_all_gathers, 2,
          "The most prefetched all-gathers in flight (>= 0; 0: unlimited; "
          "PyTorch's limit_all_gathers=True allows 2).");
ABSL_FLAG(bool, check_reference, false,
          "Compare with single-process training; exit 1 if the check fails.");
ABSL_FLAG(std::string, optimizer, "adamw", "adamw or sgd (momentum 0.9).");
ABSL_FLAG(double, lr, 1e-2, "The learning rate.");
ABSL_FLAG(int64_t, global_batch, 0,
          "Samples per micro-batch over all ranks (default: 2 per rank).");
ABSL_FLAG(std::string, save, "",
          "After the last step, write a sharded checkpoint to this directory "
          "(collectively; on a file system every rank sees); \"{step}\" in "
          "it is replaced by the step the checkpoint holds.");
ABSL_FLAG(std::optional<int64_t>, save_every, std::nullopt,
          "With --save: also save after every global step that is a "
          "multiple of this (>= 1).");
ABSL_FLAG(bool, async_save, false,
          "With --save: write the checkpoints in the background while "
          "training goes on (AsyncCheckpointSaver).");
ABSL_FLAG(int64_t, log_every, 0,
          "Rank 0 prints the step and its loss to stderr after every N-th "
          "step (0: never).");
ABSL_FLAG(bool, resume, false,
          "Start or restart a run with the same command line (for elastic "
          "launchers): resume from the newest complete checkpoint matching "
          "--save's {step} pattern, if any; --steps is then the run's total.");
ABSL_FLAG(std::string, load, "",
          "Resume from the sharded checkpoint in this directory.");
ABSL_FLAG(std::string, fault_skip_forward, "",
          "For fault tests: RANK:STEP:UNIT makes rank RANK run UNIT's "
          "forward of data step STEP without FSDP's hooks, desynchronising "
          "the ranks.");

namespace flatparam {
namespace tools {
namespace {

int TrainMain(const std::vector<char*>& args) {
  if (!args.empty()) {
    std::cerr << "fsdp train: unexpected argument \"" << args[0]
              << "\"; see fsdp train --help\n";
    return kExitUsage;
  }
  TrainCommandOptions options;
  options.backend = absl::GetFlag(FLAGS_backend);
  if (options.backend.empty()) options.backend = DefaultCollectivesBackend();
  options.world_size = absl::GetFlag(FLAGS_world_size);
  options.world_size_given = FlagChanged("world_size");
  options.strategy = absl::GetFlag(FLAGS_strategy);
  options.shard_group_size = absl::GetFlag(FLAGS_shard_group_size);
  options.steps = absl::GetFlag(FLAGS_steps);
  options.micro_batches = absl::GetFlag(FLAGS_micro_batches);
  options.no_sync = !absl::GetFlag(FLAGS_sync);
  options.mixed_precision = absl::GetFlag(FLAGS_mixed_precision);
  options.cpu_offload = absl::GetFlag(FLAGS_cpu_offload);
  options.align_addresses = absl::GetFlag(FLAGS_align_addresses);
  options.backward_prefetch = absl::GetFlag(FLAGS_backward_prefetch);
  options.forward_prefetch = absl::GetFlag(FLAGS_forward_prefetch);
  options.prefetch_depth = absl::GetFlag(FLAGS_prefetch_depth);
  options.limit_all_gathers = absl::GetFlag(FLAGS_limit_all_gathers);
  options.seed = absl::GetFlag(FLAGS_seed);
  options.optimizer = absl::GetFlag(FLAGS_optimizer);
  options.lr = absl::GetFlag(FLAGS_lr);
  options.global_batch = absl::GetFlag(FLAGS_global_batch);
  options.check_reference = absl::GetFlag(FLAGS_check_reference);
  options.save_dir = absl::GetFlag(FLAGS_save);
  options.load_dir = absl::GetFlag(FLAGS_load);
  options.resume = absl::GetFlag(FLAGS_resume);
  options.save_every = absl::GetFlag(FLAGS_save_every);
  options.async_save = absl::GetFlag(FLAGS_async_save);
  options.log_every = absl::GetFlag(FLAGS_log_every);
  options.timeout = absl::GetFlag(FLAGS_timeout).value_or(options.timeout);
  options.trace_dir = absl::GetFlag(FLAGS_trace_dir);
  options.desync_check = absl::GetFlag(FLAGS_desync_check);
  options.fault_skip_forward = absl::GetFlag(FLAGS_fault_skip_forward);
  for (const char* flag : {"seed", "optimizer", "lr", "global_batch",
                           "micro_batches", "mixed_precision", "sync"}) {
    if (FlagChanged(flag)) options.given_flags.insert(flag);
  }
  const absl::Status status =
      options.backend == "sim"    ? RunTrainSim(options, std::cout)
      : options.backend == "c10d" ? RunTrainC10d(options, std::cout)
                                  : RunTrainMpi(options, std::cout);
  std::cout.flush();
  if (!status.ok()) {
    // Under mpirun the error was printed as it happened.
    if (!IsReported(status)) {
      std::cerr << "fsdp train: " << status.message() << "\n";
    }
    return kExitError;
  }
  return std::cout.good() ? kExitOk : kExitError;
}

constexpr char kHelp[] =
    "usage: fsdp train [--backend=sim|mpi|nccl|c10d] [--world-size=W] "
    "[--strategy=S]\n"
    "                  [--shard-group-size=G] [--steps=K] "
    "[--micro-batches=M] [--no-sync]\n"
    "                  [--mixed-precision=bf16|fp16|none] [--cpu-offload]\n"
    "                  [--align-addresses] [--seed=S] [--optimizer=adamw|sgd]"
    " [--lr=LR]\n"
    "                  [--backward-prefetch=none|pre|post] "
    "[--forward-prefetch]\n"
    "                  [--prefetch-depth=N] [--limit-all-gathers=N]\n"
    "                  [--global-batch=B] [--check-reference]\n"
    "                  [--save=DIR [--save-every=N] [--async-save]] "
    "[--load=DIR | --resume]\n"
    "                  [--log-every=N] [--timeout=DURATION]\n"
    "                  [--trace-dir=DIR] [--desync-check]\n"
    "       mpirun -np 4 fsdp train [--backend=mpi|nccl] ...\n"
    "       torchrun --nproc_per_node=4 --no_python fsdp train ...\n"
    "\n"
    "Trains the reference model (a per-token MLP language model: vocab 17,\n"
    "widths 13, 37, 29; units \"\" and layers.0-2) through the FSDP runtime\n"
    "(FsdpRuntime: one FlatParamHandle per unit, prefetching, reductions\n"
    "overlapping the backward), and prints the loss per step, every rank's\n"
    "peak memory by category with the closed-form formula's row, and the\n"
    "handles' communication.\n"
    "\n"
    "The prefetch flags change when parameters are all-gathered, hence the\n"
    "peak memory (the formula follows them), never the results.\n"
    "\n"
    "--check-reference compares the result with single-process training\n"
    "(TrainReference) on the same global batch and prints the maximum\n"
    "absolute difference and whether it is bitwise equal. In float32 it\n"
    "must be bitwise equal (the simulator, MPI and c10d reduce in rank\n"
    "order; the\n"
    "hybrid strategies fold each shard group, then across groups). With\n"
    "bf16/fp16 the run must be bitwise equal to single-process training with\n"
    "the same mixed precision emulated, and its distance to float32 training\n"
    "is shown; with AdamW it must stay within AdamWDivergenceBound\n"
    "(refmodel/optimizer.h). On the host backends the measured peak\n"
    "memory must also equal the formula. NCCL sums in its own order, so on\n"
    "several GPUs the check accepts, with AdamW, parameters within\n"
    "AdamWDivergenceBound of the reference. Exits 1 when the check fails.\n"
    "\n"
    "A collective that waits longer than --timeout for a hung or slow rank\n"
    "fails the run with DeadlineExceeded naming the rank and the op, instead\n"
    "of hanging.\n"
    "\n"
    "flags:\n"
    "  --backend=sim|mpi|nccl|c10d  default: mpi under mpirun, c10d under\n"
    "                           torchrun, else sim. c10d: a gloo group from\n"
    "                           torchrun's environment (run by fsdp_c10d,\n"
    "                           the build of fsdp with LibTorch)\n"
    "  --world-size=W           sim: ranks (default 8); mpi/nccl: mpirun's "
    "-np;\n"
    "                           c10d: torchrun's workers\n"
    "  --strategy=S             FULL_SHARD (default), SHARD_GRAD_OP, "
    "NO_SHARD,\n"
    "                           HYBRID_SHARD, HYBRID_SHARD_ZERO2\n"
    "  --shard-group-size=G     HYBRID_*: ranks per shard group (like GPUs "
    "per\n"
    "                           node); default 8 if it divides W, else W\n"
    "  --steps=K                training steps (default 3)\n"
    "  --micro-batches=M        micro-batches per step (default 1)\n"
    "  --no-sync                accumulate micro-batches under no_sync\n"
    "  --mixed-precision=P      bf16, fp16 or none (default)\n"
    "  --cpu-offload            sharded parameters and gradients on the "
    "host\n"
    "  --align-addresses        16-byte aligned parameters "
    "(use_orig_params=True)\n"
    "  --backward-prefetch=B    none, pre (default; BACKWARD_PRE: gather the\n"
    "                           next unit before a unit's backward) or post\n"
    "                           (BACKWARD_POST: after it)\n"
    "  --forward-prefetch       gather the next units during the forward "
    "(from\n"
    "                           the second iteration on)\n"
    "  --prefetch-depth=N       units a prefetch reaches ahead (default 1)\n"
    "  --limit-all-gathers=N    most prefetched all-gathers in flight "
    "(default 2;\n"
    "                           0: unlimited)\n"
    "  --seed=S                 model initialisation, data and simulator "
    "(default 0)\n"
    "  --optimizer=adamw|sgd    default adamw (sgd: momentum 0.9)\n"
    "  --lr=LR                  learning rate (default 0.01)\n"
    "  --global-batch=B         samples per micro-batch (default 2 per rank)\n"
    "  --check-reference        compare with single-process training\n"
    "  --save=DIR               after the last step, write a sharded "
    "checkpoint\n"
    "                           (each rank its own files; with mpi, DIR on a\n"
    "                           file system every rank sees); {step} in DIR\n"
    "                           is replaced by the step it holds (one\n"
    "                           checkpoint per save), else each save replaces\n"
    "                           DIR crash-safely\n"
    "  --save-every=N           with --save: also save after every step that\n"
    "                           is a multiple of N (global step count)\n"
    "  --async-save             with --save: write each checkpoint in the\n"
    "                           background while training goes on; the next\n"
    "                           save or the end of the run publishes it. The\n"
    "                           report shows how long saving blocked "
    "training\n"
    "  --load=DIR               resume from a sharded checkpoint of fsdp "
    "train:\n"
    "                           its step, seed, optimizer, lr, batch, micro-\n"
    "                           batches and precision carry over (the batch\n"
    "                           and micro-batches may be changed by giving\n"
    "                           them); another world size, strategy or\n"
    "                           alignment reshards it at load time (each rank\n"
    "                           reads its byte ranges of the saved ranks'\n"
    "                           files). {step} in DIR: the newest complete\n"
    "                           checkpoint that matches (after a crash, the\n"
    "                           same DIR as --save). With --check-reference,\n"
    "                           compares with single-process training of all\n"
    "                           steps so far\n"
    "  --resume                 with --save=.../step{step}: the same command\n"
    "                           line starts the run or, rerun after a crash\n"
    "                           (torchrun --max_restarts reruns it), resumes\n"
    "                           from the newest complete checkpoint there;\n"
    "                           --steps is then the run's total\n"
    "  --timeout=DURATION       the longest any one collective may wait "
    "(the\n"
    "                           handles', the loss and summary gathers, "
    "--save's\n"
    "                           exchanges; mpi/nccl: also setup), e.g. 30s "
    "or 2m;\n"
    "                           must be positive (default 5m; sim: virtual "
    "time);\n"
    "                           MPI's start may take the longer of it and 1m\n"
    "  --log-every=N            rank 0 prints \"fsdp train: step S loss L\"\n"
    "                           to stderr after every N-th step (default 0:\n"
    "                           never)\n"
    "  --trace-dir=DIR          flight recorder: each rank writes its last\n"
    "                           2000 collectives (unit, phase, state) to\n"
    "                           DIR/rank_<R>.json when one fails, on SIGUSR1\n"
    "                           and on SIGTERM; read them with\n"
    "                           `fsdp diagnose DIR` (default:\n"
    "                           $FLATPARAM_TRACE_DIR)\n"
    "  --desync-check           compare each collective's fingerprint (op,\n"
    "                           dtype, count, sequence, unit, phase) across\n"
    "                           the group before it runs (mpi, c10d; the\n"
    "                           simulator always checks op and sizes)\n";

void PrintHelp(std::ostream& out) { out << kHelp; }

}  // namespace

const Subcommand kTrainSubcommand = {
    "train",
    "train the reference model sharded and compare with single-process "
    "training",
    PrintHelp,
    TrainMain,
};

}  // namespace tools
}  // namespace flatparam
