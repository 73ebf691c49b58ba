#include "flatparam/checkpoint/collective_checkpoint.h"

#include <algorithm>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "comm/flight_recorder.h"
#include "flatparam/base/json_limits.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/checkpoint/internal/checkpoint_write.h"
#include "flatparam/checkpoint/manifest.h"
#include "flatparam/layout_json.h"
#include "flatparam/model_json.h"

namespace flatparam {
namespace checkpoint {
namespace {

using json = nlohmann::json;
using internal_checkpoint::PendingFile;

// What a rank reports at an exchange: its status so far and a payload.
struct Report {
  absl::Status status;
  json payload;
};

// Every rank's report, each distinct text parsed once: most ranks send the
// same bytes (OK and the same digest, or no files), and a rank of a large
// job would otherwise parse thousands of equal reports at every exchange
// (a simulation of W ranks in one process, W times that).
class Reports {
 public:
  size_t size() const { return of_rank_.size(); }
  const Report& operator[](size_t rank) const {
    return distinct_[of_rank_[rank]];
  }
  // Equal indices: equal reports.
  size_t index(size_t rank) const { return of_rank_[rank]; }

 private:
  friend absl::StatusOr<Reports> Exchange(Communicator&, const absl::Status&,
                                          const json&, const CollectiveOptions&,
                                          absl::string_view);
  std::vector<Report> distinct_;
  std::vector<size_t> of_rank_;
};

std::string Encode(const absl::Status& status, const json& payload) {
  const json doc = {{"code", static_cast<int>(status.code())},
                    {"message", std::string(status.message())},
                    {"payload", payload}};
  return doc.dump(-1, ' ', false, json::error_handler_t::replace);
}

// Every rank's report, in rank order; the communicator's error when the
// exchange fails (a peer died or timed out).
absl::StatusOr<Reports> Exchange(Communicator& world,
                                 const absl::Status& status,
                                 const json& payload,
                                 const CollectiveOptions& options,
                                 absl::string_view phase) {
  const ScopedCollectiveContext context(world.flight_recorder(),
                                        {"", -1, CollectivePhase::kCheckpoint});
  absl::StatusOr<std::vector<std::string>> all =
      world.AllGatherBytes(Encode(status, payload), options);
  if (!all.ok()) {
    return absl::Status(
        all.status().code(),
        absl::StrCat("collective checkpoint write, ", phase,
                     ": exchanging the ranks' statuses failed: ",
                     all.status().message()));
  }
  Reports reports;
  absl::flat_hash_map<absl::string_view, size_t> seen;
  for (size_t r = 0; r < all->size(); ++r) {
    const auto [it, added] =
        seen.try_emplace((*all)[r], reports.distinct_.size());
    reports.of_rank_.push_back(it->second);
    if (!added) continue;
    const std::string from = absl::StrFormat(
        "collective checkpoint write, %s: rank %d's report", phase, r);
    JsonParseOptions parse;
    parse.code = absl::StatusCode::kInternal;
    FLATPARAM_ASSIGN_OR_RETURN(const json doc,
                               ParseJson((*all)[r], from, parse));
    try {
      reports.distinct_.push_back(
          {absl::Status(
               static_cast<absl::StatusCode>(doc.at("code").get<int>()),
               doc.at("message").get<std::string>()),
           doc.at("payload")});
    } catch (const json::exception& e) {
      return absl::InternalError(absl::StrFormat(
          "collective checkpoint write, %s: rank %d sent a malformed report: "
          "%s",
          phase, r, e.what()));
    }
  }
  return reports;
}

// OK, or the error of the lowest failing rank, named; the same on every rank.
absl::Status Agreed(const Reports& reports) {
  for (size_t r = 0; r < reports.size(); ++r) {
    const absl::Status& s = reports[r].status;
    if (!s.ok()) {
      return absl::Status(s.code(),
                          absl::StrFormat("rank %d: %s", r, s.message()));
    }
  }
  return absl::OkStatus();
}

// Phase b's files for `rank` (rank 0: layout.json too), not yet written.
absl::StatusOr<std::vector<PendingFile>> MyFiles(
    const ModelLayout& layout, int64_t world_size, int64_t rank,
    const RankContent& mine, const CheckpointWriteOptions& options) {
  std::vector<PendingFile> files;
  if (rank == 0) {
    FLATPARAM_ASSIGN_OR_RETURN(
        PendingFile layout_file,
        internal_checkpoint::LayoutFile(layout, world_size));
    files.push_back(std::move(layout_file));
  }
  FLATPARAM_ASSIGN_OR_RETURN(
      std::vector<PendingFile> rank_files,
      internal_checkpoint::RankFiles(layout, rank, mine, options.chunk_bytes));
  for (PendingFile& f : rank_files) files.push_back(std::move(f));
  return files;
}

// Phase b: this rank's files (rank 0: and layout.json) into `tmp`.
absl::Status WriteMyFiles(FileSystem& fs, const std::string& tmp,
                          const ModelLayout& layout, int64_t world_size,
                          int64_t rank, const RankContent& mine,
                          const CheckpointWriteOptions& options,
                          json& entries) {
  FLATPARAM_ASSIGN_OR_RETURN(const std::vector<PendingFile> files,
                             MyFiles(layout, world_size, rank, mine, options));
  uint64_t total = 0;
  for (const PendingFile& f : files) total += f.size;
  uint64_t done = 0;
  const std::function<void(uint64_t)> on_bytes = [&](uint64_t n) {
    done += n;
    if (options.progress) options.progress(done, total);
  };
  for (const PendingFile& f : files) {
    FLATPARAM_ASSIGN_OR_RETURN(
        ManifestEntry entry,
        internal_checkpoint::WritePendingFile(fs, tmp, f, on_bytes));
    entries.push_back(ManifestEntryToJson(entry));
  }
  if (options.progress && total == 0) options.progress(0, 0);
  return absl::OkStatus();
}

// Phase c on rank 0: the manifest from every rank's entries.
absl::StatusOr<Manifest> CollectManifest(const Reports& reports) {
  Manifest manifest;
  manifest.kind = CheckpointKind::kSharded;
  for (size_t r = 0; r < reports.size(); ++r) {
    const json* files = nullptr;
    if (reports[r].payload.contains("files")) {
      files = &reports[r].payload["files"];
    }
    if (files == nullptr || !files->is_array()) {
      return absl::InternalError(
          absl::StrFormat("rank %d reported no file list", r));
    }
    for (size_t i = 0; i < files->size(); ++i) {
      absl::StatusOr<ManifestEntry> entry = ManifestEntryFromJson(
          (*files)[i], absl::StrFormat("rank %d's files[%d]", r, i));
      if (!entry.ok()) {
        return absl::InternalError(absl::StrCat(
            "a malformed file list from a rank: ", entry.status().message()));
      }
      manifest.files.push_back(*std::move(entry));
    }
  }
  return manifest;
}

}  // namespace

std::string CollectiveLayoutDigest(const ModelLayout& layout,
                                   int64_t world_size) {
  LayoutJsonOptions options;
  options.world_size = world_size;
  const std::string text =
      absl::StrCat(world_size, "\n", ModelLayoutToJson(layout, options).dump(),
                   "\n", ModelSpecToJson(layout.spec()).dump());
  return ChecksumHex(Xxh3(text));
}

absl::StatusOr<CollectiveWrite> BeginCollectiveWrite(
    FileSystem& fs, const std::string& dir, const ModelLayout& layout,
    int64_t world_size, Communicator& world,
    const CollectiveWriteOptions& options, const absl::Status& local) {
  CollectiveWrite w;
  w.rank = world.rank();
  const CollectiveOptions& comm = options.collective;

  // a. Rank 0 prepares the temporary directory; everyone checks that they
  // save the same thing.
  absl::Status status = local;
  if (status.ok()) {
    status = internal_checkpoint::ShardedWorldSize(layout, world_size).status();
  }
  if (status.ok() && world_size != world.size()) {
    status = absl::InvalidArgumentError(absl::StrFormat(
        "saving for world size %d on a communicator of %d ranks", world_size,
        world.size()));
  }
  if (w.rank == 0 && status.ok()) {
    absl::StatusOr<std::string> prepared =
        internal_checkpoint::PrepareCheckpointWrite(
            fs, dir, options.write, internal_checkpoint::DirKind::kSharded);
    status = prepared.status();
    if (status.ok()) {
      w.target = *prepared;
      w.tmp = internal_checkpoint::NewTempDirFor(w.target);
      status = fs.CreateDir(w.tmp);
    }
  }
  const std::string digest = options.layout_digest.empty()
                                 ? CollectiveLayoutDigest(layout, world_size)
                                 : options.layout_digest;
  absl::StatusOr<Reports> prepared =
      Exchange(world, status, {{"layout", digest}, {"tmp", w.tmp}}, comm,
               "preparing the directory");
  if (!prepared.ok()) {
    AbandonCollectiveWrite(fs, w);
    return prepared.status();
  }
  const Reports reports = *std::move(prepared);
  absl::Status agreed = Agreed(reports);
  for (size_t r = 1; agreed.ok() && r < reports.size(); ++r) {
    if (reports.index(r) != reports.index(0) &&
        reports[r].payload.value("layout", "") !=
            reports[0].payload.value("layout", "")) {
      agreed = absl::InvalidArgumentError(absl::StrFormat(
          "rank %d saves a different layout or world size than rank 0", r));
    }
  }
  if (!agreed.ok()) {
    AbandonCollectiveWrite(fs, w);
    return agreed;
  }
  w.tmp = reports[0].payload.value("tmp", "");
  w.layout = &layout;
  w.world_size = world_size;
  return w;
}

absl::Status WriteCollectiveRankFiles(FileSystem& fs, CollectiveWrite& w,
                                      const RankContent& mine,
                                      const CollectiveWriteOptions& options) {
  // b. The first shard group writes its rank files.
  w.entries = json::array();
  if (w.rank >= w.layout->options().world_size) return absl::OkStatus();
  if (w.rank != 0) {
    // Ranks with only a local disk each would write where rank 0 never
    // looks; say so rather than fail on a missing directory.
    absl::StatusOr<bool> visible = fs.IsDirectory(w.tmp);
    if (!visible.ok() || !*visible) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "this rank does not see %s, the temporary directory that rank 0 "
          "made for the checkpoint: a collective checkpoint needs a "
          "directory that every rank sees (a shared or parallel file "
          "system); ranks that each have only a local disk cannot write one "
          "checkpoint together",
          w.tmp));
    }
  }
  return WriteMyFiles(fs, w.tmp, *w.layout, w.world_size, w.rank, mine,
                      options.write, w.entries);
}

absl::StatusOr<uint64_t> SimulateCollectiveRankFiles(
    CollectiveWrite& w, const RankContent& mine,
    const CollectiveWriteOptions& options) {
  w.entries = json::array();
  if (w.rank >= w.layout->options().world_size) return 0;
  FLATPARAM_ASSIGN_OR_RETURN(
      const std::vector<PendingFile> files,
      MyFiles(*w.layout, w.world_size, w.rank, mine, options.write));
  uint64_t total = 0;
  for (const PendingFile& f : files) {
    ManifestEntry entry;
    entry.path = f.name;
    entry.size = f.size;
    w.entries.push_back(ManifestEntryToJson(entry));
    total += f.size;
  }
  return total;
}

absl::Status FinishCollectiveWrite(FileSystem& fs, const CollectiveWrite& w,
                                   const absl::Status& written_status,
                                   Communicator& world,
                                   const CollectiveWriteOptions& options) {
  const CollectiveOptions& comm = options.collective;
  absl::StatusOr<Reports> written = Exchange(
      world, written_status, {{"files", w.entries}}, comm, "writing the ranks");
  if (!written.ok()) {
    AbandonCollectiveWrite(fs, w);
    return written.status();
  }
  absl::Status agreed = Agreed(*written);
  if (!agreed.ok()) {
    AbandonCollectiveWrite(fs, w);
    return agreed;
  }

  // c. Rank 0 publishes.
  absl::Status status = absl::OkStatus();
  if (w.rank == 0) {
    absl::StatusOr<Manifest> manifest = CollectManifest(*written);
    status = manifest.status();
    if (status.ok()) {
      status = internal_checkpoint::PublishCheckpoint(
          fs, w.target, w.tmp, *std::move(manifest), options.write.outcome);
    }
    if (!status.ok()) AbandonCollectiveWrite(fs, w);
  }
  FLATPARAM_ASSIGN_OR_RETURN(
      const Reports reports,
      Exchange(world, status, json::object(), comm, "publishing"));
  return Agreed(reports);
}

void AbandonCollectiveWrite(FileSystem& fs, const CollectiveWrite& w) {
  // Rank 0 removes the temporary directory (and puts back a checkpoint
  // moved away by a failed swap).
  if (w.rank == 0 && !w.target.empty()) {
    RecoverCheckpointDir(fs, w.target).IgnoreError();
  }
}

absl::Status WriteShardedCheckpointCollective(
    FileSystem& fs, const std::string& dir, const ModelLayout& layout,
    int64_t world_size, const RankContent& mine, Communicator& world,
    const CollectiveWriteOptions& options) {
  FLATPARAM_ASSIGN_OR_RETURN(
      CollectiveWrite w,
      BeginCollectiveWrite(fs, dir, layout, world_size, world, options));
  const absl::Status written = WriteCollectiveRankFiles(fs, w, mine, options);
  return FinishCollectiveWrite(fs, w, written, world, options);
}

absl::Status AgreeOnLoad(Communicator& world, const absl::Status& mine,
                         const CollectiveOptions& options) {
  const ScopedCollectiveContext context(world.flight_recorder(),
                                        {"", -1, CollectivePhase::kCheckpoint});
  FLATPARAM_ASSIGN_OR_RETURN(
      std::vector<std::string> verdicts,
      world.AllGatherBytes(mine.ok()
                               ? std::string()
                               : absl::StrCat(static_cast<int>(mine.code()),
                                              ":", mine.message()),
                           options));
  std::vector<int> ok_ranks;
  for (size_t r = 0; r < verdicts.size(); ++r) {
    if (verdicts[r].empty()) ok_ranks.push_back(static_cast<int>(r));
  }
  // The same error everywhere (a flag that disagrees with the checkpoint)
  // is this rank's own, without naming a rank.
  if (!mine.ok() &&
      std::all_of(verdicts.begin(), verdicts.end(),
                  [&](const std::string& v) { return v == verdicts[0]; })) {
    return mine;
  }
  for (size_t r = 0; r < verdicts.size(); ++r) {
    if (verdicts[r].empty()) continue;
    const size_t colon = verdicts[r].find(':');
    int code = static_cast<int>(absl::StatusCode::kDataLoss);
    if (colon == std::string::npos ||
        !absl::SimpleAtoi(verdicts[r].substr(0, colon), &code)) {
      return absl::InternalError(
          absl::StrFormat("rank %d sent a malformed verdict", r));
    }
    std::string message =
        absl::StrFormat("rank %d: %s", r, verdicts[r].substr(colon + 1));
    if (static_cast<absl::StatusCode>(code) == absl::StatusCode::kNotFound &&
        !ok_ranks.empty()) {
      absl::StrAppendFormat(
          &message,
          " (rank %d found it: a checkpoint must be on a file system that "
          "every rank sees, such as a shared or parallel one; ranks with "
          "only local disks cannot load one)",
          ok_ranks[0]);
    }
    return absl::Status(static_cast<absl::StatusCode>(code), message);
  }
  return absl::OkStatus();
}

}  // namespace checkpoint
}  // namespace flatparam
