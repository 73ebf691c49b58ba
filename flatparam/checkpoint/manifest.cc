#include "flatparam/checkpoint/manifest.h"

#include <xxhash.h>

// libxxhash's run-time dispatch: XXH3_64bits_dispatch and
// XXH3_64bits_update_dispatch pick the widest vector code the CPU has
// (AVX2, AVX-512) and give the same values as XXH3_64bits and
// XXH3_64bits_update, whose code the library's build fixes (SSE2 on a
// generic x86-64 build such as Debian's). Declared weak: a libxxhash built
// without dispatch (its DISPATCH=1 make option) leaves them null and
// Xxh3 uses the plain functions.
#if defined(__x86_64__) && defined(__has_include)
#if __has_include(<xxh_x86dispatch.h>)
#define XXH_DISPATCH_DISABLE_REPLACE 1
#include <xxh_x86dispatch.h>
#define FLATPARAM_XXH3_DISPATCH 1
extern "C" {
XXH64_hash_t XXH3_64bits_dispatch(const void* input, size_t len)
    __attribute__((weak));
XXH_errorcode XXH3_64bits_update_dispatch(XXH3_state_t* state,
                                          const void* input, size_t len)
    __attribute__((weak));
}
#endif
#endif

#include <algorithm>
#include <cassert>
#include <nlohmann/json.hpp>
#include <set>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "flatparam/base/json_limits.h"
#include "flatparam/base/status_macros.h"

namespace flatparam {
namespace checkpoint {
namespace {

using json = nlohmann::json;

// Read size for checksumming.
constexpr uint64_t kHashChunkBytes = uint64_t{1} << 20;

absl::Status CheckFileName(absl::string_view name) {
  if (name.empty() || name == "." || name == ".." ||
      name.find('/') != absl::string_view::npos ||
      name.find('\0') != absl::string_view::npos || name == kManifestFileName) {
    return absl::InvalidArgumentError(absl::StrCat(
        "'", name, "' is not a plain file name that a manifest may list"));
  }
  return absl::OkStatus();
}

absl::Status Annotate(const absl::Status& status, absl::string_view context) {
  if (status.ok()) return status;
  return absl::Status(status.code(),
                      absl::StrCat(context, ": ", status.message()));
}

}  // namespace

absl::Status CheckAgainstManifest(const std::string& dir,
                                  const ManifestEntry& listed,
                                  const ManifestEntry& actual) {
  const std::string path = JoinPath(dir, listed.path);
  if (actual.size != listed.size || actual.xxh3_64 != listed.xxh3_64) {
    return absl::DataLossError(absl::StrFormat(
        "%s: xxh3_64 checksum is %s, %s says %s (the file is corrupt)", path,
        ChecksumHex(actual.xxh3_64), kManifestFileName,
        ChecksumHex(listed.xxh3_64)));
  }
  // The whole file is intact, so a differing block checksum is the
  // manifest's fault; a range read would fail on it later.
  if (actual.block_xxh3_64 != listed.block_xxh3_64) {
    return absl::DataLossError(absl::StrFormat(
        "%s: the file matches its xxh3_64 but not the block checksums %s "
        "lists (the manifest is corrupt)",
        path, kManifestFileName));
  }
  return absl::OkStatus();
}

absl::string_view CheckpointKindName(CheckpointKind kind) {
  switch (kind) {
    case CheckpointKind::kFull:
      return "full";
    case CheckpointKind::kSharded:
      return "sharded";
  }
  assert(false);
  return "";
}

struct Xxh3Hasher::State {
  XXH3_state_t* state = nullptr;
};

Xxh3Hasher::Xxh3Hasher() : state_(std::make_unique<State>()) {
  state_->state = XXH3_createState();
  assert(state_->state != nullptr);
  XXH3_64bits_reset(state_->state);
}

Xxh3Hasher::~Xxh3Hasher() { XXH3_freeState(state_->state); }

void Xxh3Hasher::Update(absl::string_view bytes) {
#ifdef FLATPARAM_XXH3_DISPATCH
  if (XXH3_64bits_update_dispatch != nullptr) {
    XXH3_64bits_update_dispatch(state_->state, bytes.data(), bytes.size());
    return;
  }
#endif
  XXH3_64bits_update(state_->state, bytes.data(), bytes.size());
}

void Xxh3Hasher::Reset() { XXH3_64bits_reset(state_->state); }

uint64_t Xxh3Hasher::Digest() const {
  return XXH3_64bits_digest(state_->state);
}

uint64_t Xxh3(absl::string_view bytes) {
#ifdef FLATPARAM_XXH3_DISPATCH
  if (XXH3_64bits_dispatch != nullptr) {
    return XXH3_64bits_dispatch(bytes.data(), bytes.size());
  }
#endif
  return XXH3_64bits(bytes.data(), bytes.size());
}

std::string ChecksumHex(uint64_t checksum) {
  return absl::StrFormat("%016x", checksum);
}

uint64_t ChecksumBlockBytes(uint64_t file_size) {
  constexpr uint64_t kMaxBlocks = 16384;
  uint64_t block = uint64_t{64} << 10;
  while (file_size / block >= kMaxBlocks) block *= 2;
  return block;
}

FileHasher::FileHasher(uint64_t block_size) : block_size_(block_size) {}

void FileHasher::Update(absl::string_view bytes) {
  whole_.Update(bytes);
  if (block_size_ == 0) {
    size_ += bytes.size();
    return;
  }
  while (!bytes.empty()) {
    const uint64_t in_block = size_ % block_size_;
    const size_t n = static_cast<size_t>(
        std::min<uint64_t>(bytes.size(), block_size_ - in_block));
    block_.Update(bytes.substr(0, n));
    size_ += n;
    bytes.remove_prefix(n);
    if (size_ % block_size_ == 0) {
      blocks_.push_back(block_.Digest());
      block_.Reset();
    }
  }
}

ManifestEntry FileHasher::Entry(std::string path) const {
  ManifestEntry entry{std::move(path), size_, whole_.Digest()};
  if (block_size_ != 0) {
    entry.block_size = block_size_;
    entry.block_xxh3_64 = blocks_;
    if (size_ % block_size_ != 0)
      entry.block_xxh3_64.push_back(block_.Digest());
  }
  return entry;
}

absl::StatusOr<ManifestEntry> DescribeFile(FileSystem& fs,
                                           const std::string& dir,
                                           const std::string& name,
                                           const ProgressCallback& progress,
                                           uint64_t block_size) {
  const std::string path = JoinPath(dir, name);
  FLATPARAM_ASSIGN_OR_RETURN(std::unique_ptr<RandomAccessFile> file,
                             fs.NewRandomAccessFile(path));
  FLATPARAM_ASSIGN_OR_RETURN(const uint64_t size, file->Size());
  FileHasher hasher(block_size);
  std::vector<char> buffer(std::min(size, kHashChunkBytes));
  for (uint64_t done = 0; done < size;) {
    const uint64_t n = std::min<uint64_t>(buffer.size(), size - done);
    FLATPARAM_RETURN_IF_ERROR(
        file->ReadAt(done, absl::MakeSpan(buffer.data(), n)));
    hasher.Update(absl::string_view(buffer.data(), n));
    done += n;
    if (progress) progress(done, size);
  }
  return hasher.Entry(name);
}

json ManifestEntryToJson(const ManifestEntry& e) {
  json doc = {
      {"path", e.path}, {"size", e.size}, {"xxh3_64", ChecksumHex(e.xxh3_64)}};
  if (e.has_blocks()) {
    json blocks = json::array();
    for (uint64_t b : e.block_xxh3_64) blocks.push_back(ChecksumHex(b));
    doc["block_size"] = e.block_size;
    doc["block_xxh3_64"] = std::move(blocks);
  }
  return doc;
}

absl::StatusOr<ManifestEntry> ManifestEntryFromJson(const json& f,
                                                    absl::string_view where) {
  auto error = [&](absl::string_view field, absl::string_view what) {
    return absl::DataLossError(
        absl::StrCat(where, field.empty() ? "" : ".", field, ": ", what));
  };
  // 16 lowercase hex digits, as ChecksumHex writes them.
  auto parse_hex = [](const json& v, uint64_t* out) {
    if (!v.is_string()) return false;
    const std::string& hex = v.get_ref<const std::string&>();
    return hex.size() == 16 &&
           std::all_of(hex.begin(), hex.end(),
                       [](char c) {
                         return absl::ascii_isdigit(c) ||
                                (c >= 'a' && c <= 'f');
                       }) &&
           absl::SimpleHexAtoi(hex, out);
  };
  if (!f.is_object()) return error("", "not an object");
  for (const auto& kv : f.items()) {
    if (kv.key() != "path" && kv.key() != "size" && kv.key() != "xxh3_64" &&
        kv.key() != "block_size" && kv.key() != "block_xxh3_64") {
      return error(kv.key(), "unknown key");
    }
  }
  ManifestEntry entry;
  if (!f.contains("path") || !f["path"].is_string()) {
    return error("path", "missing or not a string");
  }
  entry.path = f["path"].get<std::string>();
  if (!f.contains("size") || !f["size"].is_number_unsigned()) {
    return error("size", "missing or not a non-negative integer");
  }
  entry.size = f["size"].get<uint64_t>();
  if (!f.contains("xxh3_64") || !parse_hex(f["xxh3_64"], &entry.xxh3_64)) {
    return error(
        "xxh3_64",
        absl::StrCat("expected 16 lowercase hex digits, got ",
                     f.contains("xxh3_64") ? f["xxh3_64"].dump() : "nothing"));
  }
  if (f.contains("block_size") != f.contains("block_xxh3_64")) {
    return error(f.contains("block_size") ? "block_xxh3_64" : "block_size",
                 "missing (block_size and block_xxh3_64 come together)");
  }
  if (!f.contains("block_size")) return entry;
  if (!f["block_size"].is_number_unsigned() ||
      f["block_size"].get<uint64_t>() == 0 ||
      f["block_size"].get<uint64_t>() > (uint64_t{1} << 40)) {
    return error("block_size",
                 absl::StrCat("expected an integer in [1, 2^40], got ",
                              f["block_size"].dump()));
  }
  entry.block_size = f["block_size"].get<uint64_t>();
  const json& blocks = f["block_xxh3_64"];
  const uint64_t expected =
      entry.size / entry.block_size + (entry.size % entry.block_size != 0);
  if (!blocks.is_array() || blocks.size() != expected) {
    return error("block_xxh3_64",
                 absl::StrFormat("expected an array of %d checksums (%d bytes "
                                 "in blocks of %d), got %s",
                                 expected, entry.size, entry.block_size,
                                 blocks.is_array()
                                     ? absl::StrCat(blocks.size(), " entries")
                                     : std::string("no array")));
  }
  entry.block_xxh3_64.resize(blocks.size());
  for (size_t k = 0; k < blocks.size(); ++k) {
    if (!parse_hex(blocks[k], &entry.block_xxh3_64[k])) {
      return error(absl::StrCat("block_xxh3_64[", k, "]"),
                   absl::StrCat("expected 16 lowercase hex digits, got ",
                                blocks[k].dump()));
    }
  }
  return entry;
}

json ManifestToJson(const Manifest& manifest) {
  json files = json::array();
  for (const ManifestEntry& e : manifest.files) {
    files.push_back(ManifestEntryToJson(e));
  }
  return {{"format", kManifestFormat},
          {"kind", std::string(CheckpointKindName(manifest.kind))},
          {"files", std::move(files)}};
}

absl::StatusOr<Manifest> ParseManifestJson(absl::string_view text,
                                           absl::string_view source) {
  auto error = [&](absl::string_view where, absl::string_view what) {
    return absl::DataLossError(
        absl::StrCat(source, ": ", where, where.empty() ? "" : ": ", what));
  };
  JsonParseOptions options;
  options.code = absl::StatusCode::kDataLoss;
  FLATPARAM_ASSIGN_OR_RETURN(json doc, ParseJson(text, source, options));
  if (!doc.is_object()) return error("", "not a JSON object");
  for (const auto& kv : doc.items()) {
    if (kv.key() != "format" && kv.key() != "kind" && kv.key() != "files") {
      return error(kv.key(), "unknown key");
    }
  }
  if (!doc.contains("format") || !doc["format"].is_string()) {
    return error("format", "missing or not a string");
  }
  if (doc["format"] != kManifestFormat) {
    return error("format",
                 absl::StrCat("is ", doc["format"].dump(), ", expected \"",
                              kManifestFormat, "\""));
  }
  Manifest manifest;
  if (doc.contains("kind") && doc["kind"] == "full") {
    manifest.kind = CheckpointKind::kFull;
  } else if (doc.contains("kind") && doc["kind"] == "sharded") {
    manifest.kind = CheckpointKind::kSharded;
  } else {
    return error("kind", absl::StrCat("is ",
                                      doc.contains("kind") ? doc["kind"].dump()
                                                           : "missing",
                                      ", expected \"full\" or \"sharded\""));
  }
  if (!doc.contains("files") || !doc["files"].is_array()) {
    return error("files", "missing or not an array");
  }
  std::set<std::string> seen;
  const json& files = doc["files"];
  for (size_t i = 0; i < files.size(); ++i) {
    const std::string where = absl::StrCat("files[", i, "]");
    FLATPARAM_ASSIGN_OR_RETURN(
        ManifestEntry entry,
        ManifestEntryFromJson(files[i], absl::StrCat(source, ": ", where)));
    if (absl::Status s = CheckFileName(entry.path); !s.ok()) {
      return error(where + ".path", s.message());
    }
    if (!seen.insert(entry.path).second) {
      return error(where + ".path",
                   absl::StrCat("'", entry.path, "' is listed twice"));
    }
    manifest.files.push_back(std::move(entry));
  }
  return manifest;
}

absl::Status WriteManifest(FileSystem& fs, const std::string& dir,
                           const Manifest& manifest) {
  for (const ManifestEntry& e : manifest.files) {
    FLATPARAM_RETURN_IF_ERROR(CheckFileName(e.path));
  }
  const std::string tmp =
      JoinPath(dir, absl::StrCat(kManifestFileName, ".tmp"));
  FLATPARAM_RETURN_IF_ERROR(
      WriteFileDurably(fs, tmp, ManifestToJson(manifest).dump(2) + "\n"));
  FLATPARAM_RETURN_IF_ERROR(fs.Rename(tmp, JoinPath(dir, kManifestFileName)));
  return fs.SyncDir(dir);
}

absl::StatusOr<Manifest> VerifyManifest(FileSystem& fs, const std::string& dir,
                                        const VerifyOptions& options) {
  FLATPARAM_ASSIGN_OR_RETURN(const bool dir_exists, fs.Exists(dir));
  if (!dir_exists) {
    return absl::NotFoundError(
        absl::StrCat(dir, ": checkpoint directory does not exist"));
  }
  const std::string manifest_path = JoinPath(dir, kManifestFileName);
  FLATPARAM_ASSIGN_OR_RETURN(const bool has_manifest, fs.Exists(manifest_path));
  if (!has_manifest) {
    return absl::DataLossError(
        absl::StrCat(dir, ": no ", kManifestFileName,
                     " (the checkpoint was not completely written)"));
  }
  absl::StatusOr<std::string> text =
      ReadFileToString(fs, manifest_path, kMaxManifestBytes);
  if (!text.ok()) {
    return absl::DataLossError(std::string(text.status().message()));
  }
  FLATPARAM_ASSIGN_OR_RETURN(Manifest manifest,
                             ParseManifestJson(*text, manifest_path));
  if (options.expected_kind.has_value() &&
      manifest.kind != *options.expected_kind) {
    return absl::DataLossError(
        absl::StrCat(manifest_path, ": a ", CheckpointKindName(manifest.kind),
                     " checkpoint, expected a ",
                     CheckpointKindName(*options.expected_kind), " one"));
  }

  FLATPARAM_ASSIGN_OR_RETURN(std::vector<std::string> children,
                             fs.GetChildren(dir));
  std::set<std::string> listed;
  uint64_t total = 0;
  for (const ManifestEntry& e : manifest.files) {
    listed.insert(e.path);
    total += e.size;
  }
  for (const std::string& child : children) {
    if (child != kManifestFileName && listed.count(child) == 0) {
      return absl::DataLossError(
          absl::StrCat(JoinPath(dir, child), ": not listed in ",
                       kManifestFileName, " (an unexpected file)"));
    }
  }
  const std::set<std::string> present(children.begin(), children.end());
  uint64_t done = 0;
  for (const ManifestEntry& e : manifest.files) {
    const std::string path = JoinPath(dir, e.path);
    if (present.count(e.path) == 0) {
      return absl::DataLossError(absl::StrCat(
          path, ": listed in ", kManifestFileName, " but missing"));
    }
    FLATPARAM_ASSIGN_OR_RETURN(const bool is_dir, fs.IsDirectory(path));
    if (is_dir) {
      return absl::DataLossError(
          absl::StrCat(path, ": a directory, the manifest lists a file"));
    }
    FLATPARAM_ASSIGN_OR_RETURN(const uint64_t size, fs.GetFileSize(path));
    if (size != e.size) {
      return absl::DataLossError(
          absl::StrFormat("%s: size is %d bytes, %s says %d", path, size,
                          kManifestFileName, e.size));
    }
    if (!options.verify_checksums) continue;
    if (options.checksum_only && !options.checksum_only(e.path)) continue;
    const uint64_t before = done;
    ProgressCallback file_progress;
    if (options.progress) {
      file_progress = [&](uint64_t file_done, uint64_t) {
        options.progress(before + file_done, total);
      };
    }
    absl::StatusOr<ManifestEntry> actual =
        DescribeFile(fs, dir, e.path, file_progress, e.block_size);
    if (!actual.ok()) return Annotate(actual.status(), "verifying checksum");
    FLATPARAM_RETURN_IF_ERROR(CheckAgainstManifest(dir, e, *actual));
    done += e.size;
  }
  if (options.progress && total == 0) options.progress(0, 0);
  return manifest;
}

}  // namespace checkpoint
}  // namespace flatparam
