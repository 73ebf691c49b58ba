#include "flatparam/checkpoint/async_checkpoint.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "flatparam/optim/optim_state.h"

namespace flatparam {
namespace checkpoint {
namespace {

int64_t SnapshotBytes(const RankState& s) {
  int64_t bytes = optim::TensorBytes(s.optim);
  for (const HostTensor& t : s.flat_params) {
    bytes += static_cast<int64_t>(t.nbytes());
  }
  return bytes;
}

}  // namespace

AsyncCheckpointSaver::AsyncCheckpointSaver(FileSystem& fs, Communicator& world,
                                           AsyncSaveOptions options)
    : fs_(fs), world_(world), options_(std::move(options)) {}

AsyncCheckpointSaver::~AsyncCheckpointSaver() {
  if (writer_.joinable()) writer_.join();
}

absl::Status AsyncCheckpointSaver::Start(const std::string& dir,
                                         const ModelLayout& layout,
                                         int64_t world_size,
                                         RankState snapshot) {
  const absl::Time begin = absl::Now();
  // One save in flight: the staging memory is one snapshot.
  absl::Status previous = Finish();
  if (!previous.ok()) {
    last_start_blocked_ = absl::Now() - begin;
    return absl::Status(
        previous.code(),
        absl::StrCat("finishing the previous save: ", previous.message()));
  }
  snapshot_ = std::make_unique<RankState>(std::move(snapshot));
  const int64_t g = layout.options().world_size;
  absl::Status content = absl::OkStatus();
  if (world_.rank() < g) {
    absl::StatusOr<RankContent> made =
        MakeRankContent(layout, world_.rank(), *snapshot_);
    content = made.status();
    if (made.ok()) content_ = *std::move(made);
  }
  absl::StatusOr<CollectiveWrite> begun = BeginCollectiveWrite(
      fs_, dir, layout, world_size, world_, options_.write, content);
  if (!begun.ok()) {
    snapshot_.reset();
    content_ = RankContent();
    last_start_blocked_ = absl::Now() - begin;
    return begun.status();
  }
  write_ = *std::move(begun);
  if (SnapshotBytes(*snapshot_) > options_.max_staging_bytes) {
    written_ = WriteCollectiveRankFiles(fs_, *write_, content_, options_.write);
  } else {
    written_ = absl::OkStatus();
    writer_ = std::thread([this] {
      written_ =
          WriteCollectiveRankFiles(fs_, *write_, content_, options_.write);
    });
  }
  last_start_blocked_ = absl::Now() - begin;
  return absl::OkStatus();
}

absl::Status AsyncCheckpointSaver::Finish() {
  if (!write_.has_value()) return absl::OkStatus();
  if (writer_.joinable()) writer_.join();
  const absl::Status status =
      FinishCollectiveWrite(fs_, *write_, written_, world_, options_.write);
  write_.reset();
  content_ = RankContent();
  snapshot_.reset();
  return status;
}

}  // namespace checkpoint
}  // namespace flatparam
