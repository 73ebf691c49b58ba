#include "flatparam/checkpoint/checkpoint_dir.h"

#include <algorithm>
#include <cassert>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <utility>

#include "absl/random/random.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "flatparam/base/dtype.h"
#include "flatparam/base/json_limits.h"
#include "flatparam/base/shape.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/checkpoint/checkpoint_names.h"
#include "flatparam/checkpoint/internal/checkpoint_write.h"
#include "flatparam/checkpoint/internal/verified_file.h"
#include "flatparam/layout.h"
#include "flatparam/layout_json.h"
#include "flatparam/model_json.h"

namespace flatparam {
namespace checkpoint {
namespace {

using json = nlohmann::json;
using internal_checkpoint::NormalizeDir;

// Metadata keys of rank files.
constexpr char kRankKey[] = "rank";
constexpr char kShardGroupSizeKey[] = "shard_group_size";
constexpr char kModelSpecKey[] = "model_spec";
// Longest JSON value quoted in an error message.
constexpr size_t kMaxQuotedJson = 120;

absl::Status Annotate(const absl::Status& status, absl::string_view context) {
  if (status.ok()) return status;
  return absl::Status(status.code(),
                      absl::StrCat(context, ": ", status.message()));
}

std::string Quote(const json& value) {
  std::string s = value.dump(-1, ' ', false, json::error_handler_t::replace);
  if (s.size() > kMaxQuotedJson) s = s.substr(0, kMaxQuotedJson) + "...";
  return s;
}

// "/flat_params/1/sharded_numel" -> "flat_params[1].sharded_numel".
std::string ReadablePointer(const std::string& pointer) {
  std::string out;
  size_t pos = 1;
  while (pos <= pointer.size() && !pointer.empty()) {
    size_t next = pointer.find('/', pos);
    if (next == std::string::npos) next = pointer.size();
    std::string token = pointer.substr(pos, next - pos);
    size_t t;
    while ((t = token.find("~1")) != std::string::npos)
      token.replace(t, 2, "/");
    while ((t = token.find("~0")) != std::string::npos)
      token.replace(t, 2, "~");
    const bool index =
        !token.empty() && std::all_of(token.begin(), token.end(), [](char c) {
          return absl::ascii_isdigit(c);
        });
    if (index) {
      absl::StrAppend(&out, "[", token, "]");
    } else {
      absl::StrAppend(&out, out.empty() ? "" : ".", token);
    }
    pos = next + 1;
  }
  return out.empty() ? "(document)" : out;
}

// The first place where `a` and `b` differ: its readable path and both
// values ("(absent)" where a side lacks it). Empty path when equal.
struct JsonDifference {
  std::string path;
  std::string a;
  std::string b;
};
std::optional<JsonDifference> FirstDifference(const json& a, const json& b) {
  if (a == b) return std::nullopt;
  const json patch = json::diff(a, b);
  assert(!patch.empty());
  std::string pointer = patch[0]["path"].get<std::string>();
  if (absl::EndsWith(pointer, "/-")) pointer.resize(pointer.size() - 2);
  auto at = [&pointer](const json& doc) -> std::string {
    try {
      const json::json_pointer p(pointer);
      if (doc.contains(p)) return Quote(doc.at(p));
    } catch (const json::exception&) {
    }
    return "(absent)";
  };
  return JsonDifference{ReadablePointer(pointer), at(a), at(b)};
}

absl::StatusOr<json> ReadJsonObject(FileSystem& fs, const std::string& path) {
  absl::StatusOr<std::string> text =
      ReadFileToString(fs, path, kMaxJsonFileBytes);
  if (!text.ok()) {
    return absl::DataLossError(std::string(text.status().message()));
  }
  JsonParseOptions options;
  options.code = absl::StatusCode::kDataLoss;
  FLATPARAM_ASSIGN_OR_RETURN(json doc, ParseJson(*text, path, options));
  if (!doc.is_object()) {
    return absl::DataLossError(
        absl::StrCat(path, ": a JSON ", doc.type_name(), ", not an object"));
  }
  return doc;
}

absl::Status CheckDirName(const std::string& dir) {
  const std::string base = Basename(dir);
  if (dir.empty() || base == "." || base == ".." || base == "/") {
    return absl::InvalidArgumentError(absl::StrCat(
        "'", dir, "' cannot be a checkpoint directory: it needs a name"));
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// Writing

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

}  // namespace internal_checkpoint

namespace {

using internal_checkpoint::DumpJson;
using internal_checkpoint::JsonFile;
using internal_checkpoint::PendingFile;

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

// The tensors of a rank file must be exactly what `layout` implies.
// `code` is InvalidArgument when writing, DataLoss when reading.
absl::Status CheckRankTensors(const ModelLayout& layout,
                              absl::Span<const TensorDecl> tensors,
                              const std::string& file, absl::StatusCode code) {
  const std::vector<FlatParamLayout>& flat = layout.flat_params();
  auto error = [&](const std::string& tensor, absl::string_view what) {
    return absl::Status(code,
                        absl::StrCat(file, ": tensor '", tensor, "': ", what));
  };
  // Parses a canonical flat parameter index at the start of `s`, up to the
  // end or a '.'.
  auto parse_index = [&](absl::string_view s, int64_t* index,
                         absl::string_view* rest) {
    const size_t dot = s.find('.');
    const absl::string_view digits = s.substr(0, dot);
    *rest = dot == absl::string_view::npos ? absl::string_view()
                                           : s.substr(dot + 1);
    return absl::SimpleAtoi(digits, index) && absl::StrCat(*index) == digits &&
           *index >= 0 && *index < static_cast<int64_t>(flat.size());
  };
  std::vector<bool> have(flat.size(), false);
  std::map<std::string, const BufferSpec*, std::less<>> buffers;
  for (const BufferSpec& b : layout.spec().buffers) buffers[b.fqn] = &b;
  std::set<std::string, std::less<>> have_buffers;
  for (const TensorDecl& t : tensors) {
    absl::string_view name = t.name;
    int64_t i = 0;
    absl::string_view rest;
    if (absl::ConsumePrefix(&name, kFlatParamPrefix)) {
      if (!parse_index(name, &i, &rest) ||
          name.find('.') != absl::string_view::npos) {
        return error(t.name,
                     absl::StrFormat("not flat_params.{i} for a flat parameter "
                                     "index i in [0, %d)",
                                     flat.size()));
      }
      const FlatParamLayout& f = flat[i];
      if (t.dtype != f.dtype()) {
        return error(t.name, absl::StrCat("dtype is ", DTypeName(t.dtype),
                                          ", the layout's flat parameter is ",
                                          DTypeName(f.dtype())));
      }
      if (t.shape != std::vector<int64_t>{f.sharded_numel()}) {
        return error(t.name, absl::StrCat("shape is ", ShapeString(t.shape),
                                          ", the layout's shard is [",
                                          f.sharded_numel(), "]"));
      }
      have[i] = true;
    } else if (absl::ConsumePrefix(&name, kOptimShardPrefix)) {
      if (!parse_index(name, &i, &rest) || rest.empty()) {
        return error(
            t.name,
            absl::StrFormat("not optim.{i}.{state} for a flat parameter index "
                            "i in [0, %d) and a state name",
                            flat.size()));
      }
      const int64_t numel = flat[i].sharded_numel();
      if (!t.shape.empty() && t.shape != std::vector<int64_t>{numel}) {
        return error(
            t.name, absl::StrCat("shape is ", ShapeString(t.shape),
                                 ", expected [] or the shard's [", numel, "]"));
      }
    } else if (absl::ConsumePrefix(&name, kBufferPrefix)) {
      auto it = buffers.find(name);
      if (it == buffers.end()) {
        return error(t.name, "not buffers.{fqn} for a buffer of the model");
      }
      const BufferSpec& b = *it->second;
      if (t.dtype != b.dtype || t.shape != b.shape) {
        return error(
            t.name,
            absl::StrCat("is ", DTypeName(t.dtype), " ", ShapeString(t.shape),
                         ", the model's buffer "
                         "is ",
                         DTypeName(b.dtype), " ", ShapeString(b.shape)));
      }
      have_buffers.emplace(name);
    } else {
      return error(t.name,
                   "unexpected: rank files hold only flat_params.{i}, "
                   "optim.{i}.{state} and buffers.{fqn}");
    }
  }
  for (const BufferSpec& b : layout.spec().buffers) {
    if (have_buffers.count(b.fqn) == 0) {
      return absl::Status(
          code, absl::StrCat(file, ": no tensor '", BufferTensorName(b.fqn),
                             "' (buffer of the model)"));
    }
  }
  for (size_t i = 0; i < have.size(); ++i) {
    if (!have[i]) {
      return absl::Status(
          code,
          absl::StrCat(file, ": no tensor '", FlatParamTensorName(i),
                       "' (flat parameter of unit '", flat[i].unit(), "')"));
    }
  }
  return absl::OkStatus();
}

std::vector<TensorDecl> DeclsOf(absl::Span<const TensorSource> sources) {
  std::vector<TensorDecl> decls;
  for (const TensorSource& s : sources) {
    decls.push_back({s.name, s.dtype, s.shape});
  }
  return decls;
}

std::vector<TensorDecl> DeclsOf(absl::Span<const SafetensorsEntry> entries) {
  std::vector<TensorDecl> decls;
  for (const SafetensorsEntry& e : entries) {
    decls.push_back({e.name, e.dtype, e.shape});
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

// Rebuilds the layout a layout.json document describes; DataLoss naming
// `file` and the offending key when the document is malformed or is not
// the layout its own model spec and options give.
absl::StatusOr<std::pair<ModelLayout, int64_t>> LayoutFromDocument(
    const json& doc, const std::string& file) {
  auto error = [&](absl::string_view what) {
    return absl::DataLossError(absl::StrCat(file, ": ", what));
  };
  auto get = [&](const char* key, json::value_t type) -> const json* {
    auto it = doc.find(key);
    if (it == doc.end()) return nullptr;
    if (type == json::value_t::number_unsigned) {
      return it->is_number_unsigned() ? &*it : nullptr;
    }
    return it->type() == type ? &*it : nullptr;
  };
  const json* version = get("version", json::value_t::number_unsigned);
  if (version == nullptr || *version != kLayoutJsonVersion) {
    return error(absl::StrCat(
        "\"version\" is ",
        doc.contains("version") ? Quote(doc["version"]) : "missing",
        ", expected ", kLayoutJsonVersion));
  }
  const json* spec_doc = get(kModelSpecKey, json::value_t::object);
  if (spec_doc == nullptr) {
    return error(
        absl::StrCat("\"", kModelSpecKey, "\" is missing or not an object"));
  }
  absl::StatusOr<ModelSpec> spec = ParseModelSpecJson(
      spec_doc->dump(), absl::StrCat(file, " ", kModelSpecKey));
  if (!spec.ok()) return absl::DataLossError(spec.status().message());

  const json* strategy = get("strategy", json::value_t::string);
  const json* group = get("shard_group_size", json::value_t::number_unsigned);
  const json* world = get("world_size", json::value_t::number_unsigned);
  const json* align = get("align_addresses", json::value_t::boolean);
  if (strategy == nullptr || group == nullptr || world == nullptr ||
      align == nullptr || !doc.contains("compute_dtype")) {
    return error(
        "\"strategy\", \"shard_group_size\", \"world_size\", "
        "\"align_addresses\" and \"compute_dtype\" are required, with a "
        "string, two non-negative integers, a boolean and a dtype or null");
  }
  LayoutOptions options;
  absl::StatusOr<ShardingStrategy> parsed_strategy =
      ParseShardingStrategy(strategy->get<std::string>());
  if (!parsed_strategy.ok()) {
    return error(
        absl::StrCat("\"strategy\": ", parsed_strategy.status().message()));
  }
  options.strategy = *parsed_strategy;
  options.align_addresses = align->get<bool>();
  const json& compute = doc["compute_dtype"];
  if (compute.is_string()) {
    absl::StatusOr<DType> dtype = ParseDType(compute.get<std::string>());
    if (!dtype.ok()) {
      return error(
          absl::StrCat("\"compute_dtype\": ", dtype.status().message()));
    }
    options.compute_dtype = *dtype;
  } else if (!compute.is_null()) {
    return error("\"compute_dtype\" is neither a dtype name nor null");
  }
  const uint64_t g = group->get<uint64_t>();
  const uint64_t w = world->get<uint64_t>();
  if (g < 1 || w < 1 || w % g != 0 || g > (uint64_t{1} << 40)) {
    return error(absl::StrFormat(
        "world_size %d is not a positive multiple of shard_group_size %d", w,
        g));
  }
  if (!IsHybridStrategy(options.strategy) && w != g) {
    return error(absl::StrFormat(
        "world_size %d differs from shard_group_size %d under %s", w, g,
        ShardingStrategyName(options.strategy)));
  }
  options.world_size = static_cast<int64_t>(g);
  absl::StatusOr<ModelLayout> layout = ModelLayout::Create(*spec, options);
  if (!layout.ok()) {
    return error(absl::StrCat("the model spec and options do not lay out: ",
                              layout.status().message()));
  }
  json stored = doc;
  stored.erase(kModelSpecKey);
  LayoutJsonOptions json_options;
  json_options.world_size = static_cast<int64_t>(w);
  const json recomputed = ModelLayoutToJson(*layout, json_options);
  if (std::optional<JsonDifference> d = FirstDifference(stored, recomputed)) {
    return error(absl::StrCat(d->path, " is ", d->a,
                              ", but the layout recomputed from ",
                              kModelSpecKey, " has ", d->b));
  }
  return std::make_pair(*std::move(layout), static_cast<int64_t>(w));
}

// The fqn a "state.{fqn}.{name}" tensor belongs to: the longest known fqn
// followed by a non-empty state name.
const ParamSpec* OptimStateOwner(
    absl::string_view tensor,
    const std::map<std::string, const ParamSpec*, std::less<>>& params) {
  if (!absl::ConsumePrefix(&tensor, kOptimStatePrefix)) return nullptr;
  const ParamSpec* owner = nullptr;
  for (size_t dot = tensor.find('.'); dot != absl::string_view::npos;
       dot = tensor.find('.', dot + 1)) {
    if (dot + 1 >= tensor.size()) break;
    auto it = params.find(tensor.substr(0, dot));
    if (it != params.end()) owner = it->second;
  }
  return owner;
}

}  // namespace

namespace internal_checkpoint {

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

absl::Status WriteFullCheckpoint(FileSystem& fs, const std::string& dir,
                                 const FullCheckpointContent& content,
                                 const CheckpointWriteOptions& options) {
  for (const TensorSource& t : content.optim) {
    if (!absl::StartsWith(t.name, kOptimStatePrefix) ||
        t.name.size() == strlen(kOptimStatePrefix)) {
      return absl::InvalidArgumentError(
          absl::StrCat(kOptimFileName, ": tensor '", t.name,
                       "' is not named state.{fqn}.{state_name}"));
    }
  }
  if (!content.optim_json.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(kOptimJsonFileName, ": must be a JSON object, not a ",
                     content.optim_json.type_name()));
  }
  std::vector<PendingFile> files;
  FLATPARAM_ASSIGN_OR_RETURN(
      PendingFile model,
      SafetensorsFile(kModelFileName, content.model, {}, options.chunk_bytes));
  files.push_back(std::move(model));
  FLATPARAM_ASSIGN_OR_RETURN(
      PendingFile optim,
      SafetensorsFile(kOptimFileName, content.optim, {}, options.chunk_bytes));
  files.push_back(std::move(optim));
  FLATPARAM_ASSIGN_OR_RETURN(std::string optim_json,
                             DumpJson(content.optim_json, kOptimJsonFileName));
  files.push_back(JsonFile(kOptimJsonFileName, std::move(optim_json)));
  return WriteCheckpointFiles(fs, dir, CheckpointKind::kFull, files, options);
}

absl::Status WriteShardedCheckpoint(FileSystem& fs, const std::string& dir,
                                    const ShardedCheckpointContent& content,
                                    const CheckpointWriteOptions& options) {
  if (content.layout == nullptr) {
    return absl::InvalidArgumentError("sharded checkpoint without a layout");
  }
  const ModelLayout& layout = *content.layout;
  const int64_t g = layout.options().world_size;
  FLATPARAM_ASSIGN_OR_RETURN(
      const int64_t w,
      internal_checkpoint::ShardedWorldSize(layout, content.world_size));
  if (static_cast<int64_t>(content.ranks.size()) != g) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%d ranks of content for a layout over %d ranks",
                        content.ranks.size(), g));
  }
  std::vector<PendingFile> files;
  FLATPARAM_ASSIGN_OR_RETURN(PendingFile layout_file,
                             internal_checkpoint::LayoutFile(layout, w));
  files.push_back(std::move(layout_file));
  for (int64_t r = 0; r < g; ++r) {
    FLATPARAM_ASSIGN_OR_RETURN(
        std::vector<PendingFile> rank_files,
        internal_checkpoint::RankFiles(layout, r, content.ranks[r],
                                       options.chunk_bytes));
    for (PendingFile& f : rank_files) files.push_back(std::move(f));
  }
  return WriteCheckpointFiles(fs, dir, CheckpointKind::kSharded, files,
                              options);
}

// ---------------------------------------------------------------------------
// Reading

namespace {

absl::StatusOr<std::pair<std::string, Manifest>> OpenVerified(
    FileSystem& fs, const std::string& dir, CheckpointKind kind,
    const CheckpointOpenOptions& options) {
  FLATPARAM_ASSIGN_OR_RETURN(std::string path, ResolveCheckpointDir(fs, dir));
  VerifyOptions verify;
  verify.verify_checksums = options.verify_checksums;
  verify.expected_kind = kind;
  verify.progress = options.progress;
  if (kind == CheckpointKind::kSharded && options.ranks.has_value()) {
    std::set<std::string> mine;
    for (int64_t r : *options.ranks) mine.insert(RankTensorFileName(r));
    verify.checksum_only = [mine](const std::string& file) {
      return !absl::EndsWith(file, ".safetensors") || mine.count(file) > 0;
    };
  }
  FLATPARAM_ASSIGN_OR_RETURN(Manifest manifest,
                             VerifyManifest(fs, path, verify));
  return std::make_pair(std::move(path), std::move(manifest));
}

// The manifest must list exactly `expected`.
absl::Status CheckFileSet(const std::string& dir, const Manifest& manifest,
                          const std::set<std::string>& expected,
                          CheckpointKind kind) {
  std::set<std::string> listed;
  for (const ManifestEntry& e : manifest.files) listed.insert(e.path);
  for (const std::string& name : expected) {
    if (listed.count(name) == 0) {
      return absl::DataLossError(
          absl::StrCat(dir, ": a ", CheckpointKindName(kind),
                       " checkpoint needs ", name, ", which is missing"));
    }
  }
  for (const std::string& name : listed) {
    if (expected.count(name) == 0) {
      return absl::DataLossError(
          absl::StrCat(JoinPath(dir, name), ": not part of a ",
                       CheckpointKindName(kind), " checkpoint"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

FullCheckpointReader::FullCheckpointReader(std::string path, Manifest manifest,
                                           SafetensorsReader model,
                                           SafetensorsReader optim,
                                           nlohmann::json optim_json)
    : path_(std::move(path)),
      manifest_(std::move(manifest)),
      model_(std::move(model)),
      optim_(std::move(optim)),
      optim_json_(std::move(optim_json)) {}

absl::StatusOr<FullCheckpointReader> FullCheckpointReader::Open(
    FileSystem& fs, const std::string& dir,
    const CheckpointOpenOptions& options) {
  FLATPARAM_ASSIGN_OR_RETURN(
      auto verified, OpenVerified(fs, dir, CheckpointKind::kFull, options));
  const std::string& path = verified.first;
  FLATPARAM_RETURN_IF_ERROR(
      CheckFileSet(path, verified.second,
                   {kModelFileName, kOptimFileName, kOptimJsonFileName},
                   CheckpointKind::kFull));
  FLATPARAM_ASSIGN_OR_RETURN(
      SafetensorsReader model,
      SafetensorsReader::Open(fs, JoinPath(path, kModelFileName)));
  FLATPARAM_ASSIGN_OR_RETURN(
      SafetensorsReader optim,
      SafetensorsReader::Open(fs, JoinPath(path, kOptimFileName)));
  for (const SafetensorsEntry& e : optim.tensors()) {
    if (!absl::StartsWith(e.name, kOptimStatePrefix)) {
      return absl::DataLossError(
          absl::StrCat(optim.name(), ": tensor '", e.name,
                       "' is not named state.{fqn}.{state_name}"));
    }
  }
  FLATPARAM_ASSIGN_OR_RETURN(
      json optim_json, ReadJsonObject(fs, JoinPath(path, kOptimJsonFileName)));
  return FullCheckpointReader(path, std::move(verified.second),
                              std::move(model), std::move(optim),
                              std::move(optim_json));
}

absl::Status FullCheckpointReader::CheckFitsModel(const ModelSpec& spec) const {
  // fqn -> the parameter whose tensor it is (the primary for a tied one).
  std::map<std::string, const ParamSpec*, std::less<>> params;
  for (const ParamSpec& p : spec.params) {
    if (p.tied_to.empty()) {
      params[p.fqn] = &p;
    } else {
      auto it = params.find(p.tied_to);
      if (it != params.end()) params[p.fqn] = it->second;
    }
  }
  auto error = [](const std::string& file, absl::string_view what) {
    return absl::FailedPreconditionError(absl::StrCat(file, ": ", what));
  };
  std::map<std::string, const BufferSpec*, std::less<>> buffers;
  for (const BufferSpec& b : spec.buffers) buffers[b.fqn] = &b;
  for (const SafetensorsEntry& e : model_.tensors()) {
    auto it = params.find(e.name);
    if (it == params.end()) {
      auto b = buffers.find(e.name);
      if (b == buffers.end()) {
        return error(model_.name(),
                     absl::StrCat("tensor '", e.name,
                                  "' is not a parameter or buffer of model '",
                                  spec.name, "'"));
      }
      if (e.dtype != b->second->dtype || e.shape != b->second->shape) {
        return error(
            model_.name(),
            absl::StrCat("tensor '", e.name, "' is ", DTypeName(e.dtype), " ",
                         ShapeString(e.shape), ", the model's buffer is ",
                         DTypeName(b->second->dtype), " ",
                         ShapeString(b->second->shape)));
      }
      continue;
    }
    const ParamSpec& p = *it->second;
    if (e.dtype != p.dtype || e.shape != p.shape) {
      return error(
          model_.name(),
          absl::StrCat("tensor '", e.name, "' is ", DTypeName(e.dtype), " ",
                       ShapeString(e.shape), ", the model's parameter is ",
                       DTypeName(p.dtype), " ", ShapeString(p.shape)));
    }
  }
  for (const ParamSpec& p : spec.params) {
    if (p.tied_to.empty() && !model_.Contains(p.fqn)) {
      return error(model_.name(),
                   absl::StrCat("parameter '", p.fqn, "' of model '", spec.name,
                                "' is missing"));
    }
  }
  for (const BufferSpec& b : spec.buffers) {
    if (!model_.Contains(b.fqn)) {
      return error(model_.name(),
                   absl::StrCat("buffer '", b.fqn, "' of model '", spec.name,
                                "' is missing"));
    }
  }
  for (const SafetensorsEntry& e : optim_.tensors()) {
    const ParamSpec* p = OptimStateOwner(e.name, params);
    if (p == nullptr) {
      return error(optim_.name(),
                   absl::StrCat("tensor '", e.name,
                                "' is not state.{fqn}.{state_name} for a "
                                "parameter of model '",
                                spec.name, "'"));
    }
    if (!e.shape.empty() && e.shape != p->shape) {
      return error(
          optim_.name(),
          absl::StrCat("tensor '", e.name, "' has shape ", ShapeString(e.shape),
                       ", expected [] or ", ShapeString(p->shape),
                       " of parameter '", p->fqn, "'"));
    }
  }
  return absl::OkStatus();
}

struct ShardedCheckpointReader::Verified {
  absl::Mutex mu;
  std::set<int64_t> ranks ABSL_GUARDED_BY(mu);
};

ShardedCheckpointReader::ShardedCheckpointReader(
    FileSystem* fs, std::string path, Manifest manifest, ModelLayout layout,
    int64_t world_size, nlohmann::json layout_json)
    : verified_(std::make_shared<Verified>()),
      fs_(fs),
      path_(std::move(path)),
      manifest_(std::move(manifest)),
      layout_(std::move(layout)),
      world_size_(world_size),
      layout_json_(std::move(layout_json)) {}

absl::StatusOr<ShardedCheckpointReader> ShardedCheckpointReader::Open(
    FileSystem& fs, const std::string& dir,
    const CheckpointOpenOptions& options) {
  FLATPARAM_ASSIGN_OR_RETURN(
      auto verified, OpenVerified(fs, dir, CheckpointKind::kSharded, options));
  const std::string& path = verified.first;
  const std::string layout_path = JoinPath(path, kLayoutFileName);
  {
    bool listed = false;
    for (const ManifestEntry& e : verified.second.files) {
      listed = listed || e.path == kLayoutFileName;
    }
    if (!listed) {
      return absl::DataLossError(
          absl::StrCat(path, ": a sharded checkpoint needs ", kLayoutFileName,
                       ", which is missing"));
    }
  }
  FLATPARAM_ASSIGN_OR_RETURN(json doc, ReadJsonObject(fs, layout_path));
  FLATPARAM_ASSIGN_OR_RETURN(auto layout, LayoutFromDocument(doc, layout_path));
  const int64_t g = layout.first.options().world_size;
  std::set<std::string> expected = {kLayoutFileName};
  for (int64_t r = 0; r < g; ++r) {
    expected.insert(RankTensorFileName(r));
    expected.insert(RankJsonFileName(r));
  }
  FLATPARAM_RETURN_IF_ERROR(
      CheckFileSet(path, verified.second, expected, CheckpointKind::kSharded));
  ShardedCheckpointReader reader(&fs, path, std::move(verified.second),
                                 std::move(layout.first), layout.second,
                                 std::move(doc));
  reader.verify_checksums_ = options.verify_checksums;
  {
    absl::MutexLock lock(&reader.verified_->mu);
    for (int64_t r = 0; r < g; ++r) {
      if (!options.ranks.has_value() ||
          std::count(options.ranks->begin(), options.ranks->end(), r) > 0) {
        reader.verified_->ranks.insert(r);
      }
    }
  }
  for (int64_t r = 0; r < g; ++r) {
    FLATPARAM_RETURN_IF_ERROR(reader.ReadRankJson(r).status());
  }
  if (options.ranks.has_value()) {
    for (int64_t r : *options.ranks) {
      // Checksummed above with the metadata; the header here.
      FLATPARAM_RETURN_IF_ERROR(reader.OpenRank(r).status());
    }
  } else {
    for (int64_t r = 0; r < g; ++r) {
      FLATPARAM_RETURN_IF_ERROR(reader.OpenRank(r).status());
    }
  }
  return reader;
}

const ManifestEntry* ShardedCheckpointReader::FindEntry(
    const std::string& name) const {
  for (const ManifestEntry& e : manifest_.files) {
    if (e.path == name) return &e;
  }
  return nullptr;
}

absl::Status ShardedCheckpointReader::VerifyRank(int64_t rank) const {
  if (rank < 0 || rank >= num_ranks()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("rank %d is not in [0, %d) of checkpoint %s", rank,
                        num_ranks(), path_));
  }
  const std::string name = RankTensorFileName(rank);
  if (verify_checksums_) {
    const ManifestEntry* listed = FindEntry(name);
    if (listed == nullptr) {
      return absl::DataLossError(
          absl::StrCat(path_, ": ", name, " is not in ", kManifestFileName));
    }
    FLATPARAM_ASSIGN_OR_RETURN(
        ManifestEntry actual,
        DescribeFile(*fs_, path_, name, nullptr, listed->block_size));
    FLATPARAM_RETURN_IF_ERROR(CheckAgainstManifest(path_, *listed, actual));
    absl::MutexLock lock(&verified_->mu);
    verified_->ranks.insert(rank);
  }
  return OpenRank(rank).status();
}

absl::StatusOr<std::unique_ptr<RandomAccessFile>>
ShardedCheckpointReader::OpenRankFile(int64_t rank) const {
  const std::string name = RankTensorFileName(rank);
  FLATPARAM_ASSIGN_OR_RETURN(std::unique_ptr<RandomAccessFile> file,
                             fs_->NewRandomAccessFile(JoinPath(path_, name)));
  if (!verify_checksums_) return file;
  const ManifestEntry* listed = FindEntry(name);
  if (listed == nullptr) {
    return absl::DataLossError(
        absl::StrCat(path_, ": ", name, " is not in ", kManifestFileName));
  }
  {
    // Checksummed whole already (Open or VerifyRank): not again.
    absl::MutexLock lock(&verified_->mu);
    if (verified_->ranks.count(rank) > 0) return file;
  }
  if (listed->has_blocks()) {
    return internal_checkpoint::BlockVerifiedFile::Open(std::move(file),
                                                        *listed);
  }
  // No block checksums: the whole file, once.
  FLATPARAM_ASSIGN_OR_RETURN(ManifestEntry actual,
                             DescribeFile(*fs_, path_, name, nullptr));
  FLATPARAM_RETURN_IF_ERROR(CheckAgainstManifest(path_, *listed, actual));
  absl::MutexLock lock(&verified_->mu);
  verified_->ranks.insert(rank);
  return file;
}

absl::StatusOr<SafetensorsReader> ShardedCheckpointReader::OpenRank(
    int64_t rank) const {
  if (rank < 0 || rank >= num_ranks()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("rank %d is not in [0, %d) of checkpoint %s", rank,
                        num_ranks(), path_));
  }
  FLATPARAM_ASSIGN_OR_RETURN(std::unique_ptr<RandomAccessFile> raw,
                             OpenRankFile(rank));
  const std::string file = raw->name();
  FLATPARAM_ASSIGN_OR_RETURN(SafetensorsReader reader,
                             SafetensorsReader::Open(std::move(raw)));
  const auto& metadata = reader.metadata();
  auto rank_it = metadata.find(kRankKey);
  auto group_it = metadata.find(kShardGroupSizeKey);
  if (rank_it == metadata.end() || rank_it->second != absl::StrCat(rank) ||
      group_it == metadata.end() ||
      group_it->second != absl::StrCat(num_ranks())) {
    return absl::DataLossError(absl::StrFormat(
        "%s: __metadata__ says rank %s of %s, expected rank %d of %d", file,
        rank_it == metadata.end() ? "(none)" : rank_it->second,
        group_it == metadata.end() ? "(none)" : group_it->second, rank,
        num_ranks()));
  }
  FLATPARAM_RETURN_IF_ERROR(CheckRankTensors(
      layout_, DeclsOf(reader.tensors()), file, absl::StatusCode::kDataLoss));
  return reader;
}

absl::StatusOr<nlohmann::json> ShardedCheckpointReader::ReadRankJson(
    int64_t rank) const {
  if (rank < 0 || rank >= num_ranks()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("rank %d is not in [0, %d) of checkpoint %s", rank,
                        num_ranks(), path_));
  }
  return ReadJsonObject(*fs_, JoinPath(path_, RankJsonFileName(rank)));
}

absl::Status ShardedCheckpointReader::CheckFits(const ModelLayout& layout,
                                                int64_t world_size) const {
  auto error = [](absl::string_view what) {
    return absl::FailedPreconditionError(what);
  };
  if (world_size != world_size_) {
    return error(absl::StrFormat(
        "world size: checkpoint %d, job %d (reshard the checkpoint offline)",
        world_size_, world_size));
  }
  if (layout.options().strategy != layout_.options().strategy) {
    return error(absl::StrFormat(
        "strategy: checkpoint %s, job %s (reshard the checkpoint offline)",
        ShardingStrategyName(layout_.options().strategy),
        ShardingStrategyName(layout.options().strategy)));
  }
  if (layout.flat_params().size() != layout_.flat_params().size()) {
    return error(absl::StrFormat(
        "flat parameters: checkpoint has %d, job has %d",
        layout_.flat_params().size(), layout.flat_params().size()));
  }
  if (layout.options().world_size < 1 ||
      world_size % layout.options().world_size != 0) {
    return error(absl::StrFormat("shard_group_size: checkpoint %d, job %d",
                                 num_ranks(), layout.options().world_size));
  }
  LayoutJsonOptions options;
  options.world_size = world_size;
  json ours = ModelLayoutToJson(layout_, options);
  json theirs = ModelLayoutToJson(layout, options);
  // The model's name is a label, not part of the layout.
  ours.erase("model");
  theirs.erase("model");
  if (std::optional<JsonDifference> d = FirstDifference(ours, theirs)) {
    return error(absl::StrCat(d->path, ": checkpoint ", d->a, ", job ", d->b));
  }
  const std::string buffers = DescribeBufferDifference(
      layout_.spec(), layout.spec(), "the checkpoint's", "the job's");
  if (!buffers.empty()) return error(buffers);
  return absl::OkStatus();
}

}  // namespace checkpoint
}  // namespace flatparam
