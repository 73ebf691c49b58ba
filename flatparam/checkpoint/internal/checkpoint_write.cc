#include "flatparam/checkpoint/internal/checkpoint_write.h"

#include <algorithm>
#include <cassert>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/random/random.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "absl/types/span.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/checkpoint/checkpoint_names.h"
#include "flatparam/checkpoint/internal/checkpoint_format.h"
#include "flatparam/checkpoint/safetensors.h"
#include "flatparam/layout_json.h"
#include "flatparam/model_json.h"

namespace flatparam {
namespace checkpoint {
namespace {

using json = nlohmann::json;
using internal_checkpoint::NormalizeDir;

absl::Status Annotate(const absl::Status& status, absl::string_view context) {
  if (status.ok()) return status;
  return absl::Status(status.code(),
                      absl::StrCat(context, ": ", status.message()));
}

absl::Status CheckDirName(const std::string& dir) {
  const std::string base = Basename(dir);
  if (dir.empty() || base == "." || base == ".." || base == "/") {
    return absl::InvalidArgumentError(absl::StrCat(
        "'", dir, "' cannot be a checkpoint directory: it needs a name"));
  }
  return absl::OkStatus();
}

// Counts and checksums what goes through it, and reports progress.
class TrackedFile : public WritableFile {
 public:
  TrackedFile(std::unique_ptr<WritableFile> base, uint64_t expected_size,
              std::function<void(uint64_t)> on_bytes)
      : base_(std::move(base)),
        on_bytes_(std::move(on_bytes)),
        hasher_(ChecksumBlockBytes(expected_size)) {}

  absl::Status Append(absl::string_view data) override {
    FLATPARAM_RETURN_IF_ERROR(base_->Append(data));
    hasher_.Update(data);
    size_ += data.size();
    on_bytes_(data.size());
    return absl::OkStatus();
  }
  absl::Status Sync() override { return base_->Sync(); }
  absl::Status Close() override { return base_->Close(); }

  uint64_t size() const { return size_; }
  ManifestEntry entry(std::string path) const {
    return hasher_.Entry(std::move(path));
  }

 private:
  std::unique_ptr<WritableFile> base_;
  std::function<void(uint64_t)> on_bytes_;
  FileHasher hasher_;
  uint64_t size_ = 0;
};

}  // namespace

namespace internal_checkpoint {

absl::StatusOr<std::string> DumpJson(const json& doc, absl::string_view what) {
  try {
    return doc.dump(2) + "\n";
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", e.what()));
  }
}

PendingFile JsonFile(std::string name, std::string text) {
  const uint64_t size = text.size();
  return {std::move(name), size,
          [text = std::move(text)](WritableFile& f) { return f.Append(text); }};
}

namespace {

absl::string_view DirKindName(DirKind kind) {
  switch (kind) {
    case DirKind::kFull:
      return "full checkpoint";
    case DirKind::kSharded:
      return "sharded checkpoint";
    case DirKind::kHfExport:
      return "Hugging Face export";
  }
  return "checkpoint";
}

// model.safetensors, model.safetensors.index.json, or
// model-NNNNN-of-NNNNN.safetensors (any number of digits).
bool IsHfExportName(absl::string_view name) {
  if (name == "model.safetensors" || name == "model.safetensors.index.json") {
    return true;
  }
  if (!absl::ConsumePrefix(&name, "model-") ||
      !absl::ConsumeSuffix(&name, ".safetensors")) {
    return false;
  }
  const size_t of = name.find("-of-");
  if (of == absl::string_view::npos || of == 0 || of + 4 == name.size()) {
    return false;
  }
  const auto digits = [](absl::string_view s) {
    return std::all_of(s.begin(), s.end(), absl::ascii_isdigit);
  };
  return digits(name.substr(0, of)) && digits(name.substr(of + 4));
}

}  // namespace

absl::StatusOr<DirContents> InspectCheckpointDir(
    FileSystem& fs, const std::string& dir, DirKind kind,
    const std::map<std::string, std::string>& identical) {
  DirContents contents;
  FLATPARAM_ASSIGN_OR_RETURN(contents.exists, fs.Exists(dir));
  if (!contents.exists) return contents;
  FLATPARAM_ASSIGN_OR_RETURN(const bool is_dir, fs.IsDirectory(dir));
  if (!is_dir) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "%s exists and is not a directory: refusing to replace it with a %s",
        dir, DirKindName(kind)));
  }
  FLATPARAM_ASSIGN_OR_RETURN(std::vector<std::string> children,
                             fs.GetChildren(dir));
  std::sort(children.begin(), children.end());
  std::set<std::string> known;
  if (kind == DirKind::kHfExport) {
    for (const std::string& c : children) {
      if (IsHfExportName(c)) known.insert(c);
    }
  } else if (std::binary_search(children.begin(), children.end(),
                                kManifestFileName)) {
    absl::StatusOr<std::string> text = ReadFileToString(
        fs, JoinPath(dir, kManifestFileName), kMaxManifestBytes);
    absl::StatusOr<Manifest> manifest =
        text.ok() ? ParseManifestJson(*text, kManifestFileName)
                  : absl::StatusOr<Manifest>(text.status());
    const CheckpointKind want = kind == DirKind::kFull
                                    ? CheckpointKind::kFull
                                    : CheckpointKind::kSharded;
    if (manifest.ok() && manifest->kind != want) {
      contents.other_kind =
          absl::StrCat("a ", CheckpointKindName(manifest->kind), " checkpoint");
    } else if (manifest.ok()) {
      known.insert(kManifestFileName);
      for (const ManifestEntry& e : manifest->files) known.insert(e.path);
    }
  }
  for (const std::string& c : children) {
    bool ours = known.count(c) > 0;
    auto same = identical.find(c);
    if (!ours && same != identical.end()) {
      // A side file this write writes: the same bytes are not a replacement.
      absl::StatusOr<uint64_t> size = fs.GetFileSize(JoinPath(dir, c));
      if (size.ok() && *size == same->second.size()) {
        absl::StatusOr<std::string> text =
            ReadFileToString(fs, JoinPath(dir, c), *size);
        ours = text.ok() && *text == same->second;
      }
    }
    (ours ? contents.ours : contents.foreign).push_back(c);
  }
  return contents;
}

namespace {

// PrepareCheckpointWrite's refusal of a directory holding `contents`.
absl::Status RefuseToReplace(const std::string& dir, const DirContents& c,
                             DirKind kind, bool overwrite) {
  constexpr size_t kNamed = 5;
  std::string holds = c.other_kind;
  if (holds.empty()) {
    holds = absl::StrCat(
        c.foreign.size() == 1 ? "a file"
                              : absl::StrCat(c.foreign.size(), " files"),
        " that no ", DirKindName(kind), " written here has: ",
        absl::StrJoin(c.foreign.begin(),
                      c.foreign.begin() + std::min(kNamed, c.foreign.size()),
                      ", "),
        c.foreign.size() > kNamed
            ? absl::StrFormat(" and %d more", c.foreign.size() - kNamed)
            : "");
  }
  if (kind == DirKind::kHfExport) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "%s holds %s: refusing to write a %s there, since it replaces the "
        "directory whole and that would delete what it did not write; write "
        "to a new or empty directory, or give overwrite (--overwrite) to "
        "write into this one, keeping those files and replacing same-named "
        "ones",
        dir, holds, DirKindName(kind)));
  }
  return absl::FailedPreconditionError(absl::StrFormat(
      "%s holds %s: refusing to write a %s there, since it replaces the "
      "directory whole and that would delete what it did not write%s; write "
      "to a new or empty directory (and copy other files next to it after)",
      dir, holds, DirKindName(kind),
      overwrite ? " (overwrite cannot keep them: a checkpoint's readers "
                  "reject any file its manifest does not list)"
                : ""));
}

}  // namespace

absl::StatusOr<std::string> PrepareCheckpointWrite(
    FileSystem& fs, const std::string& dir_arg,
    const CheckpointWriteOptions& options, DirKind kind,
    const std::map<std::string, std::string>& identical) {
  const std::string dir = NormalizeDir(dir_arg);
  FLATPARAM_RETURN_IF_ERROR(CheckDirName(dir));
  if (options.chunk_bytes == 0) {
    return absl::InvalidArgumentError("chunk_bytes must be at least 1");
  }
  const std::string parent = Dirname(dir);
  absl::StatusOr<bool> parent_is_dir = fs.IsDirectory(parent);
  if (!parent_is_dir.ok() || !*parent_is_dir) {
    return absl::NotFoundError(absl::StrCat(dir, ": the parent directory ",
                                            parent, " does not exist"));
  }
  FLATPARAM_RETURN_IF_ERROR(RecoverCheckpointDir(fs, dir));
  FLATPARAM_ASSIGN_OR_RETURN(const DirContents contents,
                             InspectCheckpointDir(fs, dir, kind, identical));
  const bool clean = contents.foreign.empty() && contents.other_kind.empty();
  if (!clean && !(options.overwrite && kind == DirKind::kHfExport)) {
    return RefuseToReplace(dir, contents, kind, options.overwrite);
  }
  return dir;
}

std::string NewTempDirFor(const std::string& dir) {
  absl::BitGen gen;
  return absl::StrCat(dir, kTmpInfix,
                      absl::StrFormat("%016x", absl::Uniform<uint64_t>(gen)));
}

absl::StatusOr<ManifestEntry> WritePendingFile(
    FileSystem& fs, const std::string& tmp, const PendingFile& f,
    const std::function<void(uint64_t)>& on_bytes) {
  FLATPARAM_ASSIGN_OR_RETURN(std::unique_ptr<WritableFile> base,
                             fs.NewWritableFile(JoinPath(tmp, f.name)));
  TrackedFile file(std::move(base), f.size, on_bytes);
  FLATPARAM_RETURN_IF_ERROR(f.write(file));
  FLATPARAM_RETURN_IF_ERROR(file.Sync());
  FLATPARAM_RETURN_IF_ERROR(file.Close());
  assert(file.size() == f.size);
  return file.entry(f.name);
}

absl::Status SwapInDirectory(FileSystem& fs, const std::string& dir,
                             const std::string& tmp, DirWriteOutcome* outcome) {
  const std::string parent = Dirname(dir);
  // 3. The previous checkpoint out of the way.
  const std::string backup = BackupDirFor(dir);
  FLATPARAM_ASSIGN_OR_RETURN(const bool replacing, fs.Exists(dir));
  std::vector<std::string> previous;
  if (replacing) {
    FLATPARAM_ASSIGN_OR_RETURN(previous, fs.GetChildren(dir));
    std::sort(previous.begin(), previous.end());
    FLATPARAM_RETURN_IF_ERROR(fs.Rename(dir, backup));
    FLATPARAM_RETURN_IF_ERROR(fs.SyncDir(parent));
  }
  // 4. The new one in.
  FLATPARAM_RETURN_IF_ERROR(fs.Rename(tmp, dir));
  FLATPARAM_RETURN_IF_ERROR(fs.SyncDir(parent));
  // 5. The previous one gone.
  if (replacing) {
    FLATPARAM_RETURN_IF_ERROR(RemoveRecursively(fs, backup));
    FLATPARAM_RETURN_IF_ERROR(fs.SyncDir(parent));
  }
  if (outcome != nullptr) {
    outcome->dir = dir;
    outcome->replaced = std::move(previous);
    outcome->kept.clear();
  }
  return absl::OkStatus();
}

absl::Status PublishCheckpoint(FileSystem& fs, const std::string& dir,
                               const std::string& tmp, Manifest manifest,
                               DirWriteOutcome* outcome) {
  std::sort(manifest.files.begin(), manifest.files.end(),
            [](const ManifestEntry& a, const ManifestEntry& b) {
              return a.path < b.path;
            });
  // 2. The files' names, then the manifest.
  FLATPARAM_RETURN_IF_ERROR(fs.SyncDir(tmp));
  FLATPARAM_RETURN_IF_ERROR(WriteManifest(fs, tmp, manifest));
  // 3-5.
  return SwapInDirectory(fs, dir, tmp, outcome);
}

absl::StatusOr<PendingFile> SafetensorsFile(
    std::string name, const std::vector<TensorSource>& tensors,
    std::map<std::string, std::string> metadata, uint64_t chunk_bytes) {
  absl::StatusOr<uint64_t> size = SafetensorsFileSize(tensors, metadata);
  if (!size.ok()) return Annotate(size.status(), name);
  PendingFile file;
  file.name = name;
  file.size = *size;
  file.write = [name, &tensors, metadata = std::move(metadata),
                chunk_bytes](WritableFile& f) {
    return WriteSafetensors(f, name, tensors, metadata, chunk_bytes);
  };
  return file;
}

namespace {

// Steps 1-5 of the file comment of checkpoint_dir.h.
absl::Status WriteFilesAndSwap(FileSystem& fs, const std::string& dir,
                               const std::string& tmp, CheckpointKind kind,
                               const std::vector<PendingFile>& files,
                               const CheckpointWriteOptions& options) {
  uint64_t total = 0;
  for (const PendingFile& f : files) total += f.size;
  uint64_t done = 0;
  const auto on_bytes = [&](uint64_t n) {
    done += n;
    if (options.progress) options.progress(done, total);
  };

  // 1. The files, each durable.
  FLATPARAM_RETURN_IF_ERROR(fs.CreateDir(tmp));
  Manifest manifest;
  manifest.kind = kind;
  for (const PendingFile& f : files) {
    FLATPARAM_ASSIGN_OR_RETURN(
        ManifestEntry entry,
        internal_checkpoint::WritePendingFile(fs, tmp, f, on_bytes));
    manifest.files.push_back(std::move(entry));
  }
  if (options.progress && total == 0) options.progress(0, 0);
  // 2-5.
  return internal_checkpoint::PublishCheckpoint(
      fs, dir, tmp, std::move(manifest), options.outcome);
}

}  // namespace

absl::Status WriteCheckpointFiles(FileSystem& fs, const std::string& dir_arg,
                                  CheckpointKind kind,
                                  const std::vector<PendingFile>& files,
                                  const CheckpointWriteOptions& options) {
  FLATPARAM_ASSIGN_OR_RETURN(const std::string dir,
                             internal_checkpoint::PrepareCheckpointWrite(
                                 fs, dir_arg, options,
                                 kind == CheckpointKind::kFull
                                     ? internal_checkpoint::DirKind::kFull
                                     : internal_checkpoint::DirKind::kSharded));
  const std::string tmp = internal_checkpoint::NewTempDirFor(dir);
  absl::Status status = WriteFilesAndSwap(fs, dir, tmp, kind, files, options);
  if (!status.ok()) {
    // Best effort: put a moved-away checkpoint back and drop the temporary
    // directory. Whatever happens here, `dir` resolves to the old or the new
    // checkpoint.
    RecoverCheckpointDir(fs, dir).IgnoreError();
  }
  return status;
}

namespace {

std::vector<TensorDecl> DeclsOf(absl::Span<const TensorSource> sources) {
  std::vector<TensorDecl> decls;
  for (const TensorSource& s : sources) {
    decls.push_back({s.name, s.dtype, s.shape});
  }
  return decls;
}

// The layout document of a sharded checkpoint.
json LayoutDocument(const ModelLayout& layout, int64_t world_size) {
  LayoutJsonOptions options;
  options.world_size = world_size;
  json doc = ModelLayoutToJson(layout, options);
  doc[kModelSpecKey] = ModelSpecToJson(layout.spec());
  return doc;
}

}  // namespace

absl::StatusOr<int64_t> ShardedWorldSize(const ModelLayout& layout,
                                         int64_t world_size) {
  const int64_t g = layout.options().world_size;
  const int64_t w = world_size == 0 ? g : world_size;
  if (w < 1 || w % g != 0 ||
      (!IsHybridStrategy(layout.options().strategy) && w != g)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("world size %d does not fit a %s layout over %d ranks",
                        w, ShardingStrategyName(layout.options().strategy), g));
  }
  return w;
}

absl::StatusOr<PendingFile> LayoutFile(const ModelLayout& layout,
                                       int64_t world_size) {
  FLATPARAM_ASSIGN_OR_RETURN(
      std::string text,
      DumpJson(LayoutDocument(layout, world_size), kLayoutFileName));
  return JsonFile(kLayoutFileName, std::move(text));
}

absl::StatusOr<std::vector<PendingFile>> RankFiles(const ModelLayout& layout,
                                                   int64_t r,
                                                   const RankContent& rank,
                                                   uint64_t chunk_bytes) {
  const int64_t g = layout.options().world_size;
  const std::string tensor_file = RankTensorFileName(r);
  FLATPARAM_RETURN_IF_ERROR(
      CheckRankTensors(layout, DeclsOf(rank.tensors), tensor_file,
                       absl::StatusCode::kInvalidArgument));
  const std::string json_file = RankJsonFileName(r);
  if (!rank.sidecar.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(json_file, ": must be a JSON object, not a ",
                     rank.sidecar.type_name()));
  }
  std::vector<PendingFile> files;
  std::map<std::string, std::string> metadata = {
      {kRankKey, absl::StrCat(r)}, {kShardGroupSizeKey, absl::StrCat(g)}};
  FLATPARAM_ASSIGN_OR_RETURN(PendingFile tensors,
                             SafetensorsFile(tensor_file, rank.tensors,
                                             std::move(metadata), chunk_bytes));
  files.push_back(std::move(tensors));
  FLATPARAM_ASSIGN_OR_RETURN(std::string sidecar,
                             DumpJson(rank.sidecar, json_file));
  files.push_back(JsonFile(json_file, std::move(sidecar)));
  return files;
}

}  // namespace internal_checkpoint

absl::StatusOr<std::string> ResolveCheckpointDir(FileSystem& fs,
                                                 const std::string& dir_arg) {
  const std::string dir = NormalizeDir(dir_arg);
  FLATPARAM_ASSIGN_OR_RETURN(const bool exists, fs.Exists(dir));
  if (exists) return dir;
  const std::string backup = BackupDirFor(dir);
  FLATPARAM_ASSIGN_OR_RETURN(const bool backup_exists, fs.Exists(backup));
  if (backup_exists) return backup;
  return absl::NotFoundError(absl::StrCat("no checkpoint at ", dir));
}

absl::Status RecoverCheckpointDir(FileSystem& fs, const std::string& dir_arg) {
  const std::string dir = NormalizeDir(dir_arg);
  FLATPARAM_RETURN_IF_ERROR(CheckDirName(dir));
  const std::string parent = Dirname(dir);
  const std::string backup = BackupDirFor(dir);
  FLATPARAM_ASSIGN_OR_RETURN(const bool backup_exists, fs.Exists(backup));
  if (backup_exists) {
    FLATPARAM_ASSIGN_OR_RETURN(const bool exists, fs.Exists(dir));
    if (exists) {
      FLATPARAM_RETURN_IF_ERROR(RemoveRecursively(fs, backup));
    } else {
      FLATPARAM_RETURN_IF_ERROR(fs.Rename(backup, dir));
    }
    FLATPARAM_RETURN_IF_ERROR(fs.SyncDir(parent));
  }
  FLATPARAM_ASSIGN_OR_RETURN(std::vector<std::string> siblings,
                             fs.GetChildren(parent));
  const std::string tmp_prefix = absl::StrCat(Basename(dir), kTmpInfix);
  bool removed = false;
  for (const std::string& sibling : siblings) {
    if (!absl::StartsWith(sibling, tmp_prefix)) continue;
    FLATPARAM_RETURN_IF_ERROR(RemoveRecursively(fs, JoinPath(parent, sibling)));
    removed = true;
  }
  if (removed) FLATPARAM_RETURN_IF_ERROR(fs.SyncDir(parent));
  return absl::OkStatus();
}
}  // namespace checkpoint
}  // namespace flatparam
