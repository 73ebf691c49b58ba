// A training job's checkpoints as a trainer takes them: one rank's state
// written collectively (WriteRankStateCollective), saves every N steps into
// "{step}" directories, synchronously or in the background
// (StepCheckpointSaver), and the newest complete one to resume from
// (FindLatestCheckpoint). `fsdp train` and LibTorch trainers
// (flatparam/torch/fsdp_module.h's CheckpointState) both use it.
//
//   StepSaveOptions save;
//   save.dir = "/ckpt/step{step}";
//   save.every = 100;
//   save.async = true;
//   StepCheckpointSaver saver(PosixFileSystem(), world, save);
//   for (int64_t step = first; step < last; ++step) {
//     ... train one step ...
//     FLATPARAM_RETURN_IF_ERROR(saver.AfterStep(
//         layout, step + 1, /*last=*/step + 1 == last, [&] {
//           return MyRankState();  // this rank's state, copied to the host
//         }));
//   }
//   FLATPARAM_RETURN_IF_ERROR(saver.Finish());
//
//   // At the next start, on every rank:
//   absl::StatusOr<LatestCheckpoint> latest =
//       FindLatestCheckpoint(PosixFileSystem(), "/ckpt/step{step}");
//   if (latest.ok()) { ... load latest->dir ... }
//
// A step's checkpoint is numbered by the steps done when it was taken (the
// step a resumed run starts at). Crash safety is the collective write's
// (collective_checkpoint.h): a directory holds its previous or its new
// complete checkpoint, and FindLatestCheckpoint skips a "{step}" directory
// whose save never published or whose files were damaged since.
//
// Ownership: the saver borrows the file system and the communicator, which
// must outlive it, and the layout passed to each save until the save is
// finished (the next save or Finish). Thread-safety: a saver is used by one
// thread, the rank's (the background writer of an asynchronous save is its
// own business); the functions are collective where they say so.
#ifndef FLATPARAM_CHECKPOINT_TRAINING_CHECKPOINTS_H_
#define FLATPARAM_CHECKPOINT_TRAINING_CHECKPOINTS_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "comm/communicator.h"
#include "flatparam/checkpoint/async_checkpoint.h"
#include "flatparam/checkpoint/collective_checkpoint.h"
#include "flatparam/checkpoint/file_system.h"
#include "flatparam/checkpoint/training_state.h"
#include "flatparam/layout.h"

namespace flatparam {
namespace checkpoint {

// Writes `mine` -- this rank's state as shard-group rank
// world.rank() % G, or the error that kept this rank from making it -- as a
// sharded checkpoint of `layout` at `dir`, collectively over `world`
// (WriteShardedCheckpointCollective, in its phases so that a rank whose
// state is an error or does not fit the layout fails every rank instead of
// leaving them in the exchange). Errors are agreed by every rank: the
// lowest failing rank's, "rank R: ...".
absl::Status WriteRankStateCollective(FileSystem& fs, const std::string& dir,
                                      const ModelLayout& layout,
                                      Communicator& world,
                                      const absl::StatusOr<RankState>& mine,
                                      const CollectiveWriteOptions& options);

// What stands for the step in a directory pattern.
inline constexpr absl::string_view kStepPlaceholder = "{step}";

// `pattern` with every "{step}" replaced by `step` (decimal).
std::string StepCheckpointDir(absl::string_view pattern, int64_t step);

struct LatestCheckpoint {
  std::string dir;
  // The directories whose names matched the pattern (0 without "{step}").
  int candidates = 0;
  // Newer matches that were passed over, newest first, each with the
  // reason ("DIR (no manifest.json ...)").
  std::vector<std::string> skipped;
};

// The checkpoint to resume from. Without "{step}" in `pattern`, the pattern
// itself (unchecked: the load verifies it). With it, "{step}" must stand
// once in the last path component (InvalidArgument otherwise); the
// directories beside it whose names match with a decimal step are tried
// from the highest step down, and the first that is published with every
// file of its manifest at its listed size is returned (the load verifies
// the checksums of what it reads). NotFound when none is complete (naming
// the skipped ones and why); the file system's error when the parent
// cannot be listed. Not collective: ranks that see one file system, which
// nothing writes meanwhile, find the same directory.
absl::StatusOr<LatestCheckpoint> FindLatestCheckpoint(
    FileSystem& fs, absl::string_view pattern);

struct StepSaveOptions {
  // Where step N's checkpoint goes: "{step}" replaced by N; without it
  // every save replaces `dir` crash-safely (it holds the latest).
  std::string dir;
  // Also save after every step that is a multiple of `every` (0: only at
  // the last step).
  int64_t every = 0;
  // Write in the background (AsyncCheckpointSaver): a save blocks the step
  // while the previous save finishes, the state is copied and the ranks
  // agree on the temporary directory; it is published by the next save or
  // Finish. The checkpoints are the same bytes as synchronous saves.
  bool async = false;
  CollectiveWriteOptions write;
};

class StepCheckpointSaver {
 public:
  // InvalidArgument is reported by the first save for a negative `every`.
  StepCheckpointSaver(FileSystem& fs, Communicator& world,
                      StepSaveOptions options);
  StepCheckpointSaver(const StepCheckpointSaver&) = delete;
  StepCheckpointSaver& operator=(const StepCheckpointSaver&) = delete;

  // Whether AfterStep(step, last) saves.
  bool Due(int64_t step, bool last) const;

  // Collective when due (every rank calls it after the same step, with the
  // same `step` and `last`): saves `state()` -- this rank's state after
  // `step` steps, called only when due -- as the checkpoint of `step` of
  // `layout` for a job of world.size() ranks. An error of `state()` fails
  // every rank's save. Errors name the directory: "save to DIR: ...".
  absl::Status AfterStep(const ModelLayout& layout, int64_t step, bool last,
                         absl::FunctionRef<absl::StatusOr<RankState>()> state);

  // Collective: waits for the save in flight, if any, and publishes it.
  // Call it after training, also when training failed. OK when nothing is
  // in flight.
  absl::Status Finish();

  // The steps saved so far (an asynchronous one counts once started).
  const std::vector<int64_t>& saved_steps() const { return saved_steps_; }
  // The directory of the last save ("" before the first).
  const std::string& last_dir() const { return last_dir_; }
  // How long saves blocked the caller: the longest one, and in all
  // (AfterStep and Finish).
  absl::Duration blocked_max() const { return blocked_max_; }
  absl::Duration blocked_total() const { return blocked_total_; }

 private:
  absl::Status Save(const ModelLayout& layout, int64_t step,
                    absl::FunctionRef<absl::StatusOr<RankState>()> state);
  void Blocked(absl::Duration d);

  FileSystem& fs_;
  Communicator& world_;
  const StepSaveOptions options_;
  std::optional<AsyncCheckpointSaver> async_;
  std::string pending_dir_;  // the asynchronous save in flight's

  std::vector<int64_t> saved_steps_;
  std::string last_dir_;
  absl::Duration blocked_max_;
  absl::Duration blocked_total_;
};

}  // namespace checkpoint
}  // namespace flatparam

#endif  // FLATPARAM_CHECKPOINT_TRAINING_CHECKPOINTS_H_
