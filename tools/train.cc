// fsdp train, part 2: running it, on each rank and on the simulator
// (train.h). The flags are train_options.cc's, the report train_report.cc's.
#include "tools/train.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <type_traits>
#include <utility>
#include <variant>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
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
#include "refmodel/train_state.h"
#include "sim/sim.h"
#include "tools/internal/train_internal.h"
#include "tools/paths.h"

namespace flatparam {
namespace tools {
namespace {

using json = nlohmann::json;
using internal_train::ParamGroupFor;
using internal_train::ParseSkipForward;
using internal_train::SkipForwardFault;

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
