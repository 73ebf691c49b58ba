#include <algorithm>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "flatparam/base/shape.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/checkpoint/checkpoint_dir.h"
#include "flatparam/checkpoint/internal/checkpoint_write.h"
#include "flatparam/checkpoint/internal/flat_stream.h"
#include "flatparam/checkpoint/manifest.h"
#include "flatparam/interop/hf/hf_checkpoint.h"
#include "flatparam/interop/hf/internal/hf_internal.h"

namespace flatparam {
namespace checkpoint {
namespace {

using json = nlohmann::json;
using internal_checkpoint::CheckDistinct;
using internal_checkpoint::ChunkBytes;
using internal_checkpoint::IsDir;
using internal_checkpoint::kSingleFileName;
using internal_checkpoint::PendingFile;
using internal_checkpoint::RankFileSet;
using internal_checkpoint::ReadConverted;

}  // namespace

// ---------------------------------------------------------------------------
// Export

namespace internal_checkpoint {

std::vector<std::vector<size_t>> SplitIntoShards(
    absl::Span<const uint64_t> sizes, uint64_t max_shard_bytes) {
  std::vector<std::vector<size_t>> shards;
  std::vector<size_t> current;
  uint64_t current_size = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (sizes[i] > max_shard_bytes) {
      shards.push_back({i});
      continue;
    }
    if (current_size + sizes[i] > max_shard_bytes) {
      shards.push_back(std::move(current));
      current.clear();
      current_size = 0;
    }
    current.push_back(i);
    current_size += sizes[i];
  }
  if (!current.empty()) shards.push_back(std::move(current));
  return shards;
}

}  // namespace internal_checkpoint

namespace {

// A tensor to export: its name, its dtype and shape in the input, and how
// to read its bytes there.
struct ExportTensor {
  std::string name;
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;
  std::function<absl::Status(uint64_t offset, absl::Span<char> out)> read;
};

TensorSource ExportSource(const ExportTensor& t, DType out_dtype) {
  TensorSource src;
  src.name = t.name;
  src.dtype = out_dtype;
  src.shape = t.shape;
  if (out_dtype == t.dtype) {
    src.fill = t.read;
    return src;
  }
  src.fill = [read = t.read, in_dtype = t.dtype, out_dtype](
                 uint64_t offset, absl::Span<char> out) -> absl::Status {
    const size_t size = DTypeSize(out_dtype);
    if (offset % size != 0 || out.size() % size != 0) {
      return absl::InternalError(absl::StrFormat(
          "chunk [%d, +%d) is not element-aligned", offset, out.size()));
    }
    return ReadConverted(read, in_dtype, out_dtype, offset / size,
                         out.size() / size, out.data());
  };
  return src;
}

// With overwrite: moves the files written into `tmp` into `dir`, which
// holds files the export did not write (CheckpointWriteOptions::overwrite).
// The previous export's entry points go first and the new one comes last,
// so that no crash leaves an index (or a model.safetensors) beside shards
// of the other export.
absl::Status MergeIntoDirectory(FileSystem& fs, const std::string& dir,
                                const std::string& tmp,
                                const std::vector<PendingFile>& files,
                                const internal_checkpoint::DirContents& before,
                                DirWriteOutcome* outcome) {
  std::set<std::string> written;
  for (const PendingFile& f : files) written.insert(f.name);
  const std::string entry =
      written.count(kHfIndexFileName) > 0 ? kHfIndexFileName : kSingleFileName;
  std::set<std::string> replaced;
  // The previous export's entry points, then the rest of it (files of the
  // export's names: a previous export or the original download's weights).
  for (const char* name : {kHfIndexFileName, kSingleFileName}) {
    if (std::find(before.ours.begin(), before.ours.end(), name) ==
        before.ours.end()) {
      continue;
    }
    FLATPARAM_RETURN_IF_ERROR(fs.RemoveFile(JoinPath(dir, name)));
    replaced.insert(name);
  }
  FLATPARAM_RETURN_IF_ERROR(fs.SyncDir(dir));
  for (const std::string& name : before.ours) {
    if (replaced.count(name) > 0) continue;
    replaced.insert(name);
    if (written.count(name) > 0) continue;  // replaced by the rename below
    FLATPARAM_RETURN_IF_ERROR(fs.RemoveFile(JoinPath(dir, name)));
  }
  std::vector<std::string> kept;
  for (const std::string& name : before.foreign) {
    if (written.count(name) > 0) {
      replaced.insert(name);
    } else {
      kept.push_back(name);
    }
  }
  // The new files, the entry point last.
  for (const PendingFile& f : files) {
    if (f.name == entry) continue;
    FLATPARAM_RETURN_IF_ERROR(
        fs.Rename(JoinPath(tmp, f.name), JoinPath(dir, f.name)));
  }
  FLATPARAM_RETURN_IF_ERROR(fs.SyncDir(dir));
  FLATPARAM_RETURN_IF_ERROR(
      fs.Rename(JoinPath(tmp, entry), JoinPath(dir, entry)));
  FLATPARAM_RETURN_IF_ERROR(fs.SyncDir(dir));
  FLATPARAM_RETURN_IF_ERROR(fs.RemoveDir(tmp));
  FLATPARAM_RETURN_IF_ERROR(fs.SyncDir(Dirname(dir)));
  if (outcome != nullptr) {
    outcome->dir = dir;
    outcome->replaced.assign(replaced.begin(), replaced.end());
    outcome->kept = std::move(kept);
  }
  return absl::OkStatus();
}

// Writes `files` into a new temporary directory and swaps it in as `dir`,
// as checkpoint_dir.h does, but without a manifest; with overwrite, into a
// directory holding other files, MergeIntoDirectory. `identical`: the side
// files' names and content.
absl::Status WriteDirectory(FileSystem& fs, const std::string& dir_arg,
                            const std::vector<PendingFile>& files,
                            const std::map<std::string, std::string>& identical,
                            const CheckpointWriteOptions& options) {
  constexpr auto kKind = internal_checkpoint::DirKind::kHfExport;
  FLATPARAM_ASSIGN_OR_RETURN(const std::string dir,
                             internal_checkpoint::PrepareCheckpointWrite(
                                 fs, dir_arg, options, kKind, identical));
  const std::string tmp = internal_checkpoint::NewTempDirFor(dir);
  const auto write = [&]() -> absl::Status {
    uint64_t total = 0;
    for (const PendingFile& f : files) total += f.size;
    uint64_t done = 0;
    const auto on_bytes = [&](uint64_t n) {
      done += n;
      if (options.progress) options.progress(done, total);
    };
    FLATPARAM_RETURN_IF_ERROR(fs.CreateDir(tmp));
    for (const PendingFile& f : files) {
      FLATPARAM_RETURN_IF_ERROR(
          internal_checkpoint::WritePendingFile(fs, tmp, f, on_bytes).status());
    }
    FLATPARAM_RETURN_IF_ERROR(fs.SyncDir(tmp));
    // What `dir` holds now, not at the start of a long write.
    FLATPARAM_ASSIGN_OR_RETURN(
        const internal_checkpoint::DirContents before,
        internal_checkpoint::InspectCheckpointDir(fs, dir, kKind, identical));
    if (before.foreign.empty()) {
      return internal_checkpoint::SwapInDirectory(fs, dir, tmp,
                                                  options.outcome);
    }
    if (!options.overwrite) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "%s: %s appeared during the export; nothing was replaced", dir,
          before.foreign.front()));
    }
    return MergeIntoDirectory(fs, dir, tmp, files, before, options.outcome);
  };
  absl::Status status = write();
  if (!status.ok()) RecoverCheckpointDir(fs, dir).IgnoreError();
  return status;
}

// The side files of `copy_from` (HfExportOptions), by name.
absl::StatusOr<std::map<std::string, std::string>> ReadSideFiles(
    FileSystem& fs, const std::string& copy_from) {
  constexpr uint64_t kMaxSideFileBytes = uint64_t{1} << 30;
  FLATPARAM_ASSIGN_OR_RETURN(const bool is_dir, IsDir(fs, copy_from));
  if (!is_dir) {
    return absl::InvalidArgumentError(
        absl::StrCat("copy-from: ", copy_from,
                     " is not a directory (give the original "
                     "model's directory, which holds its config.json)"));
  }
  std::map<std::string, std::string> side;
  for (const std::string& name : HfSideFileNames()) {
    const std::string path = JoinPath(copy_from, name);
    FLATPARAM_ASSIGN_OR_RETURN(const bool exists, fs.Exists(path));
    if (!exists) continue;
    FLATPARAM_ASSIGN_OR_RETURN(std::string text,
                               ReadFileToString(fs, path, kMaxSideFileBytes));
    side.emplace(name, std::move(text));
  }
  if (side.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "copy-from: ", copy_from, " holds none of the files it copies (",
        absl::StrJoin(HfSideFileNames(), ", "), ")"));
  }
  return side;
}

}  // namespace

absl::StatusOr<HfExportReport> ExportHfCheckpoint(
    FileSystem& fs, const std::string& in_dir, const std::string& out_dir,
    const HfExportOptions& options) {
  FLATPARAM_RETURN_IF_ERROR(CheckDistinct(in_dir, out_dir));
  if (options.max_shard_bytes == 0) {
    return absl::InvalidArgumentError("max_shard_bytes must be at least 1");
  }
  if (options.dtype.has_value() && !IsFloatingPoint(*options.dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot export to ", DTypeName(*options.dtype),
                     ": only floating-point dtypes"));
  }
  std::map<std::string, std::string> side_files;
  if (!options.copy_from.empty()) {
    FLATPARAM_ASSIGN_OR_RETURN(side_files,
                               ReadSideFiles(fs, options.copy_from));
  }
  FLATPARAM_ASSIGN_OR_RETURN(const std::string path,
                             ResolveCheckpointDir(fs, in_dir));
  absl::StatusOr<std::string> text = ReadFileToString(
      fs, JoinPath(path, kManifestFileName), kMaxManifestBytes);
  if (!text.ok()) {
    return absl::DataLossError(absl::StrCat(
        path, ": no readable ", kManifestFileName,
        " (not a flatparam checkpoint, or its write did not finish): ",
        text.status().message()));
  }
  FLATPARAM_ASSIGN_OR_RETURN(
      const Manifest manifest,
      ParseManifestJson(*text, JoinPath(path, kManifestFileName)));
  CheckpointOpenOptions open;
  open.verify_checksums = options.convert.verify_checksums;

  // The readers must outlive the write: the sources read through them.
  std::optional<FullCheckpointReader> full;
  std::optional<ShardedCheckpointReader> sharded;
  std::unique_ptr<RankFileSet> rank_files;
  std::vector<ExportTensor> tensors;
  if (manifest.kind == CheckpointKind::kFull) {
    FLATPARAM_ASSIGN_OR_RETURN(FullCheckpointReader r,
                               FullCheckpointReader::Open(fs, path, open));
    full.emplace(std::move(r));
    const SafetensorsReader* model = &full->model();
    for (const SafetensorsEntry& e : model->tensors()) {
      tensors.push_back(
          {e.name, e.dtype, e.shape,
           [model, name = e.name](uint64_t offset, absl::Span<char> out) {
             return model->ReadRange(name, offset, out);
           }});
    }
  } else {
    FLATPARAM_ASSIGN_OR_RETURN(ShardedCheckpointReader r,
                               ShardedCheckpointReader::Open(fs, path, open));
    sharded.emplace(std::move(r));
    rank_files = std::make_unique<RankFileSet>(*sharded);
    const auto& flat = sharded->layout().flat_params();
    std::map<std::string, std::pair<int, const ParamInfo*>> by_fqn;
    for (int u = 0; u < static_cast<int>(flat.size()); ++u) {
      for (const ParamInfo& p : flat[u].params()) by_fqn[p.fqn] = {u, &p};
    }
    RankFileSet* files = rank_files.get();
    for (const ParamSpec& p : sharded->spec().params) {
      if (!p.tied_to.empty()) continue;
      const auto [u, info] = by_fqn.at(p.fqn);
      const DType dtype = flat[u].dtype();
      const size_t size = DTypeSize(dtype);
      tensors.push_back({p.fqn, dtype, info->shape,
                         [files, u = u, size, base = info->offset * size](
                             uint64_t offset, absl::Span<char> out) {
                           return files->ReadFlatBytes(
                               u, FlatParamTensorName(u), size, base + offset,
                               out);
                         }});
    }
    // Buffers, as `save_pretrained` writes a model's persistent buffers:
    // shard-group rank 0's.
    for (const BufferSpec& b : sharded->spec().buffers) {
      tensors.push_back({b.fqn, b.dtype, b.shape,
                         [files, name = BufferTensorName(b.fqn)](
                             uint64_t offset, absl::Span<char> out) {
                           return files->ReadRange(0, name, offset, out);
                         }});
    }
  }

  std::vector<TensorSource> sources;
  std::vector<uint64_t> sizes;
  HfExportReport report;
  for (const ExportTensor& t : tensors) {
    const DType out_dtype =
        options.dtype.has_value() && IsFloatingPoint(t.dtype) ? *options.dtype
                                                              : t.dtype;
    sources.push_back(ExportSource(t, out_dtype));
    sizes.push_back(static_cast<uint64_t>(NumElements(t.shape)) *
                    DTypeSize(out_dtype));
    report.total_size += sizes.back();
  }
  report.tensors = static_cast<int64_t>(tensors.size());
  const std::vector<std::vector<size_t>> shards =
      internal_checkpoint::SplitIntoShards(sizes, options.max_shard_bytes);

  const uint64_t chunk = ChunkBytes(options.convert.chunk_bytes);
  const std::map<std::string, std::string> metadata = {{"format", "pt"}};
  // Per file, its sources (borrowed by the pending file's write).
  std::vector<std::vector<TensorSource>> file_sources(shards.size());
  std::vector<PendingFile> files;
  json weight_map = json::object();
  for (size_t s = 0; s < shards.size(); ++s) {
    const std::string name =
        shards.size() == 1 ? std::string(kSingleFileName)
                           : absl::StrFormat("model-%05d-of-%05d.safetensors",
                                             s + 1, shards.size());
    for (size_t i : shards[s]) {
      file_sources[s].push_back(sources[i]);
      weight_map[sources[i].name] = name;
    }
    FLATPARAM_ASSIGN_OR_RETURN(const uint64_t size,
                               SafetensorsFileSize(file_sources[s], metadata));
    const std::vector<TensorSource>* srcs = &file_sources[s];
    files.push_back(
        {name, size, [name, srcs, &metadata, chunk](WritableFile& f) {
           return WriteSafetensors(f, name, *srcs, metadata, chunk);
         }});
    report.files.push_back(name);
  }
  if (shards.size() > 1) {
    json index = json::object();
    index["metadata"] = {{"total_size", report.total_size}};
    index["weight_map"] = std::move(weight_map);
    FLATPARAM_ASSIGN_OR_RETURN(std::string text, internal_checkpoint::DumpJson(
                                                     index, kHfIndexFileName));
    files.push_back(internal_checkpoint::JsonFile(kHfIndexFileName, text));
    report.files.push_back(kHfIndexFileName);
  }
  for (const std::string& name : HfSideFileNames()) {
    auto it = side_files.find(name);
    if (it == side_files.end()) continue;
    files.push_back(internal_checkpoint::JsonFile(name, it->second));
    report.copied.push_back(name);
  }
  CheckpointWriteOptions write;
  write.chunk_bytes = chunk;
  write.progress = options.convert.progress;
  write.overwrite = options.convert.overwrite;
  write.outcome = options.convert.outcome;
  FLATPARAM_RETURN_IF_ERROR(
      WriteDirectory(fs, out_dir, files, side_files, write));
  return report;
}

}  // namespace checkpoint
}  // namespace flatparam
