// Asynchronous collective checkpoint saves: the training step is blocked only
// while the ranks agree on a temporary directory; each rank's files are
// written by a background thread from a snapshot the saver owns, while the
// caller trains on; the save is published (checkpoint_dir.h's crash-safe
// protocol, as WriteShardedCheckpointCollective) by the next Finish() --
// which the next Start() calls, and which the caller calls before exiting.
//
//   AsyncCheckpointSaver saver(PosixFileSystem(), world);
//   ...
//   // Every rank, at the same step: the snapshot is this rank's state,
//   // copied to the host (RankState owns its tensors).
//   FLATPARAM_RETURN_IF_ERROR(
//       saver.Start("/ckpt/step100", layout, world.size(), Snapshot()));
//   ... train on: the snapshot is the saver's ...
//   FLATPARAM_RETURN_IF_ERROR(saver.Finish());  // or the next Start
//
// Staging memory: exactly one snapshot (the RankState handed to Start) is
// held at a time, because Start finishes the previous save first. A snapshot
// larger than AsyncSaveOptions::max_staging_bytes is written inside Start
// instead (correct, only not overlapped), so a host never holds more than
// that limit for a save in flight.
//
// Crash safety is the collective write's: until Finish publishes, `dir`
// resolves to the previous checkpoint; a crash (or a saver destroyed without
// Finish) at any point leaves the previous or the new complete checkpoint,
// and the next write to `dir` removes the leftover temporary directory.
//
// Ownership and threads: the FileSystem, the communicator and the layout
// passed to Start must outlive the save (until Finish or destruction). Start
// and Finish are collective over `world` and run on the rank's thread, which
// owns the communicator; the background thread touches only the file system
// (which must be thread-safe: PosixFileSystem and FaultInjectionFileSystem
// are) and the snapshot. `options.write.progress` is called on the
// background thread. Not thread-safe itself: one thread calls Start/Finish.
#ifndef FLATPARAM_CHECKPOINT_ASYNC_CHECKPOINT_H_
#define FLATPARAM_CHECKPOINT_ASYNC_CHECKPOINT_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "comm/communicator.h"
#include "flatparam/checkpoint/collective_checkpoint.h"
#include "flatparam/checkpoint/file_system.h"
#include "flatparam/checkpoint/training_state.h"
#include "flatparam/model_layout.h"

namespace flatparam {
namespace checkpoint {

struct AsyncSaveOptions {
  CollectiveWriteOptions write;
  // The most tensor bytes a snapshot may have for a background write; a
  // larger one is written synchronously inside Start.
  int64_t max_staging_bytes = int64_t{64} << 30;
};

class AsyncCheckpointSaver {
 public:
  AsyncCheckpointSaver(FileSystem& fs, Communicator& world,
                       AsyncSaveOptions options = {});
  // Waits for a background write; a save that was not finished is not
  // published (the previous checkpoint stays; see the file comment).
  ~AsyncCheckpointSaver();
  AsyncCheckpointSaver(const AsyncCheckpointSaver&) = delete;
  AsyncCheckpointSaver& operator=(const AsyncCheckpointSaver&) = delete;

  // Collective. Finishes a pending save (returning its error, if any, and
  // starting nothing), then begins saving `snapshot` -- this rank's state as
  // shard-group rank world.rank() % G, ignored on ranks >= G -- to `dir` for
  // a job of `world_size` ranks, as WriteShardedCheckpointCollective would.
  // Returns once the ranks agree on the temporary directory; errors there
  // (a bad layout or world size, ranks that disagree, content that does not
  // fit the layout on any rank) are agreed by every rank.
  absl::Status Start(const std::string& dir, const ModelLayout& layout,
                     int64_t world_size, RankState snapshot);

  // Collective. Waits for this rank's background write, then the ranks
  // agree and rank 0 publishes. Returns the agreed status (OK when nothing
  // is pending). After it, the snapshot is freed.
  absl::Status Finish();

  bool pending() const { return write_.has_value(); }
  // How long the last Start blocked its caller.
  absl::Duration last_start_blocked() const { return last_start_blocked_; }

 private:
  FileSystem& fs_;
  Communicator& world_;
  const AsyncSaveOptions options_;

  std::optional<CollectiveWrite> write_;
  std::unique_ptr<RankState> snapshot_;
  RankContent content_;  // points into *snapshot_
  std::thread writer_;
  // Phase b's result; written by the writer thread, read after join().
  absl::Status written_;
  absl::Duration last_start_blocked_;
};

}  // namespace checkpoint
}  // namespace flatparam

#endif  // FLATPARAM_CHECKPOINT_ASYNC_CHECKPOINT_H_
