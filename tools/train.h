// `fsdp train`: trains the reference model (refmodel/mlp_model.h) through the
// model-level runtime (FsdpRuntime, flatparam/runtime.h; the trainer is
// refmodel/fsdp_trainer.h) on the simulator, MPI or NCCL, and prints the
// per-step loss, every rank's peak memory by category next to the
// closed-form formula, the handles' communication, and, when asked, the
// comparison with single-process training (TrainReference).
//
// Prefetching. --backward-prefetch=none|pre|post (default pre, PyTorch's
// BACKWARD_PRE), --forward-prefetch, --prefetch-depth=N (default 1) and
// --limit-all-gathers=N (default 2; 0: unlimited) are the runtime's
// RuntimeOptions. They change when parameters are all-gathered and so the
// peak memory (the formula follows them), never the results; a resumed
// run does not take them from the checkpoint.
//
//   fsdp train --world-size=8 --strategy=FULL_SHARD --steps=3 --check-reference
//   fsdp train --strategy=HYBRID_SHARD --shard-group-size=4
//       --mixed-precision=bf16 --check-reference   (one command line)
//   mpirun -np 4 fsdp train --backend=mpi --check-reference
//
// The check. In float32 the sharded run must equal single-process training
// bit for bit (the simulator and MPI fold reductions on the host in rank
// order; hybrid strategies against the two-level fold). With bf16/fp16 mixed
// precision it must equal single-process training with the same mixed
// precision emulated, bit for bit, and its distance to float32
// single-process training is reported; with AdamW it must be within
// AdamWDivergenceBound (refmodel/optimizer.h), a bound that holds for
// any two AdamW runs from the same start (SGD has no model-independent
// bound, so only the distance is shown). On the host backends the measured
// peak memory must also equal ExpectedPeakMemory. On NCCL (reductions in
// NCCL's order, CUDA's reciprocal division) several GPUs are not bitwise
// equal to the host's arithmetic: there the check passes when the run is
// bitwise equal or, with AdamW, within AdamWDivergenceBound of the
// reference; with SGD it cannot be decided and fails, saying so.
//
// Checkpoints. --save=DIR writes, after the last step, a sharded checkpoint
// (flatparam/checkpoint/checkpoint_dir.h) collectively: every rank of the
// first shard group writes its own rank files into DIR's temporary
// directory and rank 0 publishes it (collective_checkpoint.h); with MPI, DIR
// must be on a file system every rank sees. layout.json's model spec is the
// trainer's model; each rank sidecar's "extra" (training_state.h) holds what a
// resumed run needs (kTrainExtraKey below): the next data step, the
// model's config and seed, the data seed, the optimizer and its
// hyperparameters, the global batch, micro-batches, accumulation and mixed
// precision, and the history of the segments trained so far.
//
// Saving mid-run. --save-every=N also saves after every step whose global
// step count (the data step the checkpoint resumes at) is a multiple of N,
// from the trainer's after_step hook (FsdpTrainOptions), and still after
// the last step. Each checkpoint's "extra" describes the state at its own
// step (this run's segment cut there), so --load of any of them resumes
// exactly. The literal "{step}" in DIR is replaced by that step
// (--save=ckpt/step{step}: one checkpoint per save); without it every save
// replaces DIR crash-safely, so DIR always holds the latest complete one.
// The saves are checkpoint::StepCheckpointSaver's
// (flatparam/checkpoint/training_checkpoints.h, which LibTorch trainers
// use too). --async-save writes them with AsyncCheckpointSaver
// (flatparam/checkpoint/async_checkpoint.h): at a save the step is blocked
// while the previous save finishes (if still writing), the rank's state is
// copied to a host snapshot and the ranks agree on the temporary
// directory; each rank's background thread writes its files while
// training goes on, and the save is published by the next save or at the
// end of the run (also when training fails). The checkpoints are the same,
// byte for byte, as synchronous saves, and training is unchanged. The
// report counts the saves and how long they blocked training.
//
// --load=DIR resumes from such a checkpoint, and training continues at the
// saved step with the saved settings. Flags for those settings may be
// given only with the saved values (a flag at its default counts as not
// given). The job's layout (world size, strategy, shard group, alignment)
// may differ from the checkpoint's: checkpoint::LoadRankState
// (flatparam/checkpoint/convert.h) reads each rank's own files when the
// job fits the checkpoint and otherwise reshards at load time, each rank
// reading only the byte ranges of the saved ranks' files that its new
// shards hold -- bit for bit what `fsdp checkpoint reshard` followed by
// --load gives, without the intermediate checkpoint. Every rank opens the
// checkpoint for its metadata only, and every byte it reads is verified
// against the manifest's checksums (per block), so W ranks read the
// checkpoint about once in total, not W times. The ranks agree on the
// outcome: one rank's damaged file fails every rank. The model (its
// config, hence its parameters) and the mixed precision must be the
// saved ones ("extra" holds them).
//
// --check-reference after --load compares with single-process training of
// ALL steps so far, not just this run's: TrainReference segments are
// chained, each from the previous one's parameters and optimizer state,
// each with the gradient fold of the run that trained it (the saved
// history's world size and strategy: GradientReduction::Fsdp(W) or
// Hybrid(W, S)), then this run's. Splitting training at a step boundary
// changes nothing in single-process training (TrainReference resumed with
// first_step equals the unbroken run bit for bit), so in float32 the
// resumed sharded run must equal this chain bit for bit, whatever world
// sizes and strategies the segments ran on. The AdamW bounds use the total
// number of steps.
//
// Thread-safety: RunTrain* are called once, from main; RunTrainOnRank once
// per rank thread.
#ifndef TOOLS_TRAIN_H_
#define TOOLS_TRAIN_H_

#include <array>
#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <ostream>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "comm/communicator.h"
#include "flatparam/checkpoint/file_system.h"
#include "flatparam/device/device.h"
#include "flatparam/memory_stats.h"
#include "flatparam/runtime.h"
#include "refmodel/fsdp_trainer.h"

namespace flatparam {
namespace tools {

struct TrainCommandOptions {
  // "sim", "mpi" or "nccl".
  std::string backend = "sim";
  // sim: the number of ranks. mpi/nccl: must equal the job's size when
  // world_size_given (mpirun's -np decides).
  int64_t world_size = 8;
  bool world_size_given = false;
  std::string strategy = "FULL_SHARD";
  // The hybrid strategies' ranks per shard group; 0: 2 when the world size
  // is even, else the world size. Must be 0 for other strategies.
  int64_t shard_group_size = 0;
  int64_t steps = 3;
  int64_t micro_batches = 1;
  // Accumulate micro-batches under no_sync instead of reducing each.
  bool no_sync = false;
  // "none", "bf16" or "fp16": param_dtype (gradients reduced in it).
  std::string mixed_precision = "none";
  bool cpu_offload = false;
  bool align_addresses = false;
  // The runtime's prefetching (see the file comment): "none", "pre" or
  // "post"; forward prefetch; units ahead (>= 1); prefetched all-gathers in
  // flight (>= 0, 0: unlimited).
  std::string backward_prefetch = "pre";
  bool forward_prefetch = false;
  int64_t prefetch_depth = 1;
  int64_t limit_all_gathers = 2;
  // Seeds the model's initialisation, the data and the simulator.
  uint64_t seed = 0;
  // "adamw" or "sgd" (momentum 0.9), with this learning rate.
  std::string optimizer = "adamw";
  double lr = 1e-2;
  // Samples per micro-batch over all ranks; 0: 2 per rank.
  int64_t global_batch = 0;
  bool check_reference = false;
  // --save=DIR / --load=DIR (empty: none); see the file comment. DIR of
  // --save may contain "{step}".
  std::string save_dir;
  // DIR of --load may contain "{step}": the newest published checkpoint
  // whose name matches (checkpoint::FindLatestCheckpoint).
  std::string load_dir;
  // --resume (needs a --save with "{step}"; not with --load): the same
  // command line starts or restarts a run, as an elastic launcher
  // (torchrun --max_restarts) reruns it: it resumes from the newest
  // complete checkpoint --save's pattern matches (none: from step 0), and
  // --steps counts the run's total steps, not those after the resume.
  bool resume = false;
  // --save-every=N (>= 1; needs --save): also save after each global step
  // count that is a multiple of N. Unset: only after the last step.
  std::optional<int64_t> save_every;
  // --async-save (needs --save): write the saves in the background
  // (AsyncCheckpointSaver).
  bool async_save = false;
  // --log-every=N (>= 0): rank 0 prints "fsdp train: step S loss L (T
  // elapsed)" to stderr after every N-th step of the run (0: never), so
  // that a long run shows it is alive.
  int64_t log_every = 0;
  // --timeout: the CollectiveOptions::timeout of every collective the
  // command issues: the handles' and the rest of the trainer's
  // (FsdpTrainOptions::collective_options), the status exchanges of a
  // --save (CollectiveWriteOptions::collective: they wait for the slowest
  // rank's writing) and the gather of the ranks' summaries; under mpirun
  // also creating the MPI world and the NCCL communicator. A rank that
  // waits longer for its peers fails the run with DeadlineExceeded naming
  // the rank and the op. Not a setting that --load carries over.
  absl::Duration timeout = kDefaultCollectiveTimeout;
  // --trace-dir: where every rank's flight recorder dumps (empty:
  // $FLATPARAM_TRACE_DIR, else nowhere).
  std::string trace_dir;
  // --desync-check: every collective's fingerprint is compared across its
  // group first (MpiOptions::check_collectives; c10d's check; the
  // simulator always checks).
  bool desync_check = false;
  // --fault-skip-forward=RANK:STEP:UNIT, for fault tests: rank RANK runs
  // unit UNIT's forward of data step STEP without FSDP's hooks
  // (FsdpTrainOptions::skip_forward_for_testing). Empty: none.
  std::string fault_skip_forward;
  // Names of the flags given on the command line with a non-default value
  // (FlagChanged: "lr", "seed", ...): with --load, these must agree with
  // the checkpoint; the others take its values.
  std::set<std::string> given_flags;
};

// The key of the trainer's object in a rank sidecar's "extra".
inline constexpr char kTrainExtraKey[] = "fsdp_train";

// A stretch of training done by one run: the data steps [first_step,
// first_step + steps) on `world_size` ranks with `strategy` (and
// `shard_group_size` for the hybrid strategies), which fixes its gradient
// fold, with `global_batch` samples per micro-batch and `micro_batches`
// per step (a resumed run may change both).
struct TrainSegment {
  int64_t first_step = 0;
  int64_t steps = 0;
  int world_size = 1;
  ShardingStrategy strategy = ShardingStrategy::kFullShard;
  int shard_group_size = 0;
  int64_t global_batch = 0;
  int64_t micro_batches = 1;
};

// The checkpoint's "extra"[kTrainExtraKey] for a run with `command`
// options (resolved: global_batch set) of `options` on `world_size` ranks,
// after `history` and this run's options.steps steps (for a save in the
// middle of the run, pass options with steps = the steps done so far).
nlohmann::json TrainExtra(const TrainCommandOptions& command,
                          const refmodel::FsdpTrainOptions& options,
                          int world_size,
                          const std::vector<TrainSegment>& history);

// What --load takes from a checkpoint: `command` with the saved settings
// filled in, the step to start at, and the history. InvalidArgument naming
// the flag and both values when a given flag differs from the checkpoint
// (except --global-batch and --micro-batches, which a resumed run may
// change: the new segment trains with them); DataLoss when the extra
// object is missing or malformed. Checkpoints written before segments
// recorded their batch take the saved settings' batch for every segment.
struct ResumePoint {
  TrainCommandOptions command;
  int64_t first_step = 0;
  std::vector<TrainSegment> history;
};
absl::StatusOr<ResumePoint> ResumeFromExtra(const TrainCommandOptions& command,
                                            const nlohmann::json& extra);

// InvalidArgument naming the flag for options that make no sense before
// the world size is known (an unknown backend, strategy, precision,
// backward prefetch or optimizer; steps, micro-batches or the prefetch
// depth < 1; a negative all-gather limit; a timeout that is not positive
// and finite; --save-every < 1; --save-every or --async-save without
// --save; ...).
absl::Status ValidateTrainCommandOptions(const TrainCommandOptions& options);

// The trainer's options for `world_size` ranks (defaults resolved; the
// timeout in collective_options); InvalidArgument naming the flag for
// inconsistent ones, such as a shard group size that does not divide the
// world size.
absl::StatusOr<refmodel::FsdpTrainOptions> MakeFsdpTrainOptions(
    const TrainCommandOptions& options, int world_size);

// One rank's figures.
struct RankSummary {
  int rank = 0;
  MemoryStats memory;
  int64_t optimizer_state_bytes = 0;
  CommStats comm;
  int64_t nonzero_padding_grads = 0;
  // How long this rank's training thread was blocked by saving: the
  // longest single pause and the sum of them (see TrainReport).
  absl::Duration save_blocked_max;
  absl::Duration save_blocked_total;
};

// The comparison with single-process training.
struct ReferenceCheck {
  // Against TrainReference on ReferenceOptionsFor() (mixed precision
  // emulated): the largest |difference| over the losses, parameters and
  // optimizer state, and whether all of them are bitwise equal.
  double max_abs_diff = 0;
  bool bitwise_equal = false;
  // Whether bitwise equality is required (the backend reduces as the
  // reference does); otherwise, with AdamW, the parameters' largest
  // |difference| must be within `inexact_bound` (AdamWDivergenceBound).
  bool exact = true;
  double param_max_abs_diff = 0;
  std::optional<double> inexact_bound;
  // Mixed precision: against float32 single-process training (parameters),
  // and AdamWDivergenceBound for AdamW.
  bool mixed_precision = false;
  double fp32_max_abs_diff = 0;
  std::optional<double> fp32_bound;
  // Padding elements of sharded gradients that were not zero (must be 0).
  int64_t nonzero_padding_grads = 0;
  // Measured peaks against ExpectedPeakMemory (host compute devices only).
  std::optional<bool> memory_formula_holds;
  bool passed = false;
};

// What a run found; the same on every rank.
struct TrainReport {
  std::string backend;
  int world_size = 0;
  refmodel::FsdpTrainOptions options;
  std::string optimizer;  // as given: "adamw" or "sgd"
  std::vector<float> losses;
  std::vector<RankSummary> ranks;
  // The formula, on a host compute device.
  std::optional<std::array<int64_t, kNumMemoryCategories>> expected_memory;
  std::optional<ReferenceCheck> check;
  // Segments before this run (from --load) and the directories involved
  // (saved_to: the last save's, "{step}" replaced).
  std::vector<TrainSegment> history;
  std::string loaded_from;
  // --load as given and the directory it named
  // (checkpoint::FindLatestCheckpoint), and how many directories matched a
  // "{step}" pattern (0 without one).
  std::string load_pattern;
  std::string load_resolved_from;
  int load_candidates = 0;
  std::vector<std::string> load_skipped;
  // Set when --load resharded the checkpoint at load time: what it was
  // saved with ("8 ranks, FULL_SHARD").
  std::string resharded_from;
  // --resume: whether a checkpoint was there to resume from, and whether
  // the run had already trained its --steps (nothing was trained).
  bool resumed = false;
  bool nothing_left = false;
  std::string saved_to;
  // The saves this run made, by the global step each holds (their number
  // is the number of saves), and whether they were asynchronous.
  std::vector<int64_t> saved_steps;
  bool async_save = false;
  // How long saving blocked the training thread, on the slowest rank (the
  // largest over ranks of each figure). A pause is, synchronously, a whole
  // save (copying the state and the collective write); asynchronously,
  // waiting for the previous save to finish and publish, copying the
  // state, and AsyncCheckpointSaver::Start (last_start_blocked), or, at
  // the end of the run, the wait for the last save. `max` is the longest
  // pause, `total` their sum.
  absl::Duration save_blocked_max;
  absl::Duration save_blocked_total;
};

// Compares one rank's result of `options` on `world_size` ranks with
// single-process training (see ReferenceCheck); `exact` says whether the
// backend must match bit for bit. `expected_memory` and `ranks`, when
// given, add the memory formula to the check.
// With a non-empty `history` (a resumed run, options.first_step > 0) the
// reference is the chain of TrainReference segments described in the file
// comment.
absl::StatusOr<ReferenceCheck> CheckAgainstReference(
    const refmodel::FsdpTrainOptions& options, int world_size, bool exact,
    const refmodel::FsdpRankResult& result,
    const std::optional<std::array<int64_t, kNumMemoryCategories>>&
        expected_memory,
    const std::vector<RankSummary>& ranks,
    const std::vector<TrainSegment>& history = {});

// The whole command on one rank of `world` (every rank calls it alike),
// with the handles' buffers from `device`; `host_device` says whether the
// compute device is the host (then the memory formula applies and results
// must be bitwise equal: the simulator and MPI). Gathers every rank's
// summary over `world`.
absl::StatusOr<TrainReport> RunTrainOnRank(Communicator& world,
                                           DeviceOps& device,
                                           const TrainCommandOptions& options,
                                           bool host_device);

// The prefetch settings in words: "prefetch BACKWARD_PRE (depth 1,
// limit_all_gathers 2)", "prefetch forward + BACKWARD_POST (depth 2,
// limit_all_gathers 0: unlimited)", "prefetch none".
std::string DescribePrefetch(const refmodel::FsdpTrainOptions& options);

// The output: a header (with the prefetch settings), the loss per step,
// the per-rank memory table with the formula's row, communication, and the
// check.
void PrintTrainReport(const TrainReport& report, std::ostream& out);

// OK without a check or when it passed; FailedPrecondition saying what
// failed otherwise.
absl::Status TrainVerdict(const TrainReport& report);

// --backend=sim: options.world_size ranks on a SimWorld (seed
// options.seed); prints the report to `out` and returns the verdict.
absl::Status RunTrainSim(const TrainCommandOptions& options, std::ostream& out);

// RunTrainSim's run without printing or judging it: rank 0's report. With a
// non-empty `trace_path`, also writes the simulator's Chrome trace of the
// run's collectives there (SimWorld::WriteChromeTrace).
absl::StatusOr<TrainReport> TrainOnSim(const TrainCommandOptions& options,
                                       const std::string& trace_path = "");

// --backend=mpi or nccl, on this process's rank of an MPI job: initialises
// and finalises MPI; nccl trains on the GPU numbered by the node-local rank
// with an NCCL communicator bootstrapped over MPI. Rank 0 prints. Every
// rank returns the verdict. Unimplemented without OpenMPI in the build.
absl::Status RunTrainMpi(const TrainCommandOptions& options, std::ostream& out);

// --backend=c10d, as one of torchrun's workers: the world from torchrun's
// environment (comm/c10d's C10dCommunicator::FromEnvironment), host
// buffers. Rank 0 prints the report; every rank prints its own error and
// returns the verdict. In `fsdp`, which does not link LibTorch, this runs
// the command in fsdp_c10d instead (train_c10d_exec.cc), which does.
absl::Status RunTrainC10d(const TrainCommandOptions& options,
                          std::ostream& out);

}  // namespace tools
}  // namespace flatparam

#endif  // TOOLS_TRAIN_H_
