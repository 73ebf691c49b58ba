#include "flatparam/checkpoint/training_checkpoints.h"

#include <algorithm>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/checkpoint/manifest.h"

namespace flatparam {
namespace checkpoint {

absl::Status WriteRankStateCollective(FileSystem& fs, const std::string& dir,
                                      const ModelLayout& layout,
                                      Communicator& world,
                                      const absl::StatusOr<RankState>& mine,
                                      const CollectiveWriteOptions& options) {
  const int64_t shard_rank = world.rank() % layout.options().world_size;
  const absl::StatusOr<RankContent> content =
      mine.ok() ? MakeRankContent(layout, shard_rank, *mine)
                : absl::StatusOr<RankContent>(mine.status());
  FLATPARAM_ASSIGN_OR_RETURN(
      CollectiveWrite begun,
      BeginCollectiveWrite(fs, dir, layout, world.size(), world, options,
                           content.status()));
  const absl::Status written =
      WriteCollectiveRankFiles(fs, begun, *content, options);
  return FinishCollectiveWrite(fs, begun, written, world, options);
}

std::string StepCheckpointDir(absl::string_view pattern, int64_t step) {
  return absl::StrReplaceAll(pattern, {{kStepPlaceholder, absl::StrCat(step)}});
}

absl::StatusOr<LatestCheckpoint> FindLatestCheckpoint(
    FileSystem& fs, absl::string_view pattern) {
  LatestCheckpoint latest;
  const size_t at = pattern.find(kStepPlaceholder);
  if (at == absl::string_view::npos) {
    latest.dir = std::string(pattern);
    return latest;
  }
  const size_t slash = pattern.rfind('/', at);
  const size_t base = slash == absl::string_view::npos ? 0 : slash + 1;
  const std::string parent = slash == absl::string_view::npos
                                 ? "."
                                 : std::string(pattern.substr(0, slash));
  const absl::string_view prefix = pattern.substr(base, at - base);
  const absl::string_view suffix = pattern.substr(at + kStepPlaceholder.size());
  if (absl::StrContains(suffix, '/') ||
      absl::StrContains(suffix, kStepPlaceholder)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "\"{step}\" must stand once, in the last path component, in %s",
        pattern));
  }
  FLATPARAM_ASSIGN_OR_RETURN(std::vector<std::string> children,
                             fs.GetChildren(parent));
  std::vector<std::pair<int64_t, std::string>> steps;
  for (const std::string& name : children) {
    if (name.size() <= prefix.size() + suffix.size() ||
        !absl::StartsWith(name, prefix) || !absl::EndsWith(name, suffix)) {
      continue;
    }
    const absl::string_view digits = absl::string_view(name).substr(
        prefix.size(), name.size() - prefix.size() - suffix.size());
    int64_t step = 0;
    // SimpleAtoi alone would take "+2" and " 2".
    if (!std::all_of(digits.begin(), digits.end(),
                     [](char c) { return absl::ascii_isdigit(c); }) ||
        !absl::SimpleAtoi(digits, &step)) {
      continue;
    }
    steps.emplace_back(step, absl::StrCat(parent, "/", name));
  }
  latest.candidates = static_cast<int>(steps.size());
  std::sort(steps.rbegin(), steps.rend());
  for (const auto& [step, dir] : steps) {
    // Published, and every listed file there at its size: a cheap check
    // that passes over a save that never finished or a truncated file.
    VerifyOptions sizes_only;
    sizes_only.verify_checksums = false;
    const absl::Status verified = VerifyManifest(fs, dir, sizes_only).status();
    if (verified.ok()) {
      latest.dir = dir;
      return latest;
    }
    latest.skipped.push_back(absl::StrCat(dir, " (", verified.message(), ")"));
  }
  return absl::NotFoundError(absl::StrFormat(
      "no complete checkpoint matches %s (%d directories of %s matched the "
      "name%s%s)",
      pattern, steps.size(), parent,
      latest.skipped.empty() ? "" : "; skipped: ",
      absl::StrJoin(latest.skipped, "; ")));
}

namespace {

absl::Status InSave(const std::string& dir, const absl::Status& s) {
  if (s.ok()) return s;
  return absl::Status(s.code(),
                      absl::StrCat("save to ", dir, ": ", s.message()));
}

}  // namespace

StepCheckpointSaver::StepCheckpointSaver(FileSystem& fs, Communicator& world,
                                         StepSaveOptions options)
    : fs_(fs), world_(world), options_(std::move(options)) {
  if (options_.async) {
    AsyncSaveOptions async;
    async.write = options_.write;
    async_.emplace(fs, world, async);
  }
}

bool StepCheckpointSaver::Due(int64_t step, bool last) const {
  return last || (options_.every > 0 && step % options_.every == 0);
}

absl::Status StepCheckpointSaver::AfterStep(
    const ModelLayout& layout, int64_t step, bool last,
    absl::FunctionRef<absl::StatusOr<RankState>()> state) {
  if (options_.every < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "StepSaveOptions::every must be 0 or positive, not ", options_.every));
  }
  if (!Due(step, last)) return absl::OkStatus();
  const absl::Time begin = absl::Now();
  const absl::Status saved = Save(layout, step, state);
  Blocked(absl::Now() - begin);
  return saved;
}

absl::Status StepCheckpointSaver::Finish() {
  if (!async_.has_value() || !async_->pending()) return absl::OkStatus();
  const absl::Time begin = absl::Now();
  const absl::Status finished = InSave(pending_dir_, async_->Finish());
  Blocked(absl::Now() - begin);
  return finished;
}

void StepCheckpointSaver::Blocked(absl::Duration d) {
  blocked_max_ = std::max(blocked_max_, d);
  blocked_total_ += d;
}

absl::Status StepCheckpointSaver::Save(
    const ModelLayout& layout, int64_t step,
    absl::FunctionRef<absl::StatusOr<RankState>()> state) {
  const std::string dir = StepCheckpointDir(options_.dir, step);
  // At most one snapshot is staged: the previous save finishes before this
  // state is copied.
  FLATPARAM_RETURN_IF_ERROR(Finish());
  absl::StatusOr<RankState> mine = state();
  if (async_.has_value()) {
    // A rank without a state must still take part, so that the others do
    // not wait for it in the exchange: it fails them all there.
    if (!mine.ok()) {
      return InSave(dir, WriteRankStateCollective(fs_, dir, layout, world_,
                                                  mine, options_.write));
    }
    FLATPARAM_RETURN_IF_ERROR(InSave(
        dir, async_->Start(dir, layout, world_.size(), std::move(*mine))));
    pending_dir_ = dir;
  } else {
    FLATPARAM_RETURN_IF_ERROR(
        InSave(dir, WriteRankStateCollective(fs_, dir, layout, world_, mine,
                                             options_.write)));
  }
  saved_steps_.push_back(step);
  last_dir_ = dir;
  return absl::OkStatus();
}

}  // namespace checkpoint
}  // namespace flatparam
