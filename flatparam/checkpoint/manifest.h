// The manifest of a checkpoint directory: manifest.json, written last,
// listing every other file of the directory with its size and checksum, so
// that a reader can tell a complete, intact checkpoint from a partial or
// damaged one.
//
//   {
//     "format": "flatparam.checkpoint.v1",
//     "kind": "full" | "sharded",
//     "files": [
//       {"path": "model.safetensors", "size": 1234,
//        "xxh3_64": "0123456789abcdef",            16 lowercase hex digits
//        "block_size": 65536,                      optional, with:
//        "block_xxh3_64": ["...", ...]},           one per block
//       ...                                        sorted by path
//     ]
//   }
//
// Checksums are XXH3_64bits (seed 0) of the whole file, from the xxHash
// library (through its run-time dispatch to AVX2/AVX-512 code where the
// library and the CPU have it: the same values, twice as fast here as its
// SSE2 code), computed in a streaming fashion so that a file is never held in
// memory. Files written by this library also carry the checksums of their
// blocks -- bytes [k*block_size, min(size, (k+1)*block_size)), for k = 0 ..
// ceil(size / block_size) - 1 -- so that a reader can verify the byte
// ranges it reads without reading the whole file (a job loading its shard
// reads only the blocks it needs: internal/verified_file.h).
// ChecksumBlockBytes picks the block size. The block fields are optional
// (checkpoints written before them lack them; readers then checksum whole
// files) but must come together and agree with the size. `path` is a plain file
// name inside the directory: no '/', not "." or "..", not "manifest.json".
//
// Thread-safety: pure functions, except that Write/Verify use the file
// system; Xxh3Hasher is not thread-safe.
#ifndef FLATPARAM_CHECKPOINT_MANIFEST_H_
#define FLATPARAM_CHECKPOINT_MANIFEST_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "flatparam/checkpoint/file_system.h"

namespace flatparam {
namespace checkpoint {

inline constexpr char kManifestFileName[] = "manifest.json";
inline constexpr char kManifestFormat[] = "flatparam.checkpoint.v1";
// manifest.json files larger than this are rejected unread.
inline constexpr uint64_t kMaxManifestBytes = uint64_t{64} << 20;

enum class CheckpointKind { kFull, kSharded };

// "full" / "sharded".
absl::string_view CheckpointKindName(CheckpointKind kind);

// Reports progress of a long operation: `done` of `total` bytes.
// Called from the thread doing the work, with `done` non-decreasing.
using ProgressCallback = std::function<void(uint64_t done, uint64_t total)>;

struct ManifestEntry {
  std::string path;
  uint64_t size = 0;
  uint64_t xxh3_64 = 0;
  // 0 when the entry has no block checksums; otherwise block_xxh3_64 holds
  // ceil(size / block_size) checksums.
  uint64_t block_size = 0;
  std::vector<uint64_t> block_xxh3_64;

  bool has_blocks() const { return block_size != 0; }
  friend bool operator==(const ManifestEntry& a, const ManifestEntry& b) {
    return a.path == b.path && a.size == b.size && a.xxh3_64 == b.xxh3_64 &&
           a.block_size == b.block_size && a.block_xxh3_64 == b.block_xxh3_64;
  }
};

// The block size for a file of `file_size` bytes: 64 KiB, doubled until
// the file has at most 16384 blocks, so that a range read costs at most
// two partial blocks of a file's 1/16384 (64 KiB up to 1 GiB files) and the
// manifest stays small (about 20 bytes per block: 330 KB per file at most,
// 21 MB for a 1 TB checkpoint in 64 files).
uint64_t ChecksumBlockBytes(uint64_t file_size);

struct Manifest {
  CheckpointKind kind = CheckpointKind::kFull;
  // Sorted by path when produced by this library.
  std::vector<ManifestEntry> files;
};

// Incremental XXH3_64bits (seed 0) over a stream of bytes.
class Xxh3Hasher {
 public:
  Xxh3Hasher();
  ~Xxh3Hasher();
  Xxh3Hasher(const Xxh3Hasher&) = delete;
  Xxh3Hasher& operator=(const Xxh3Hasher&) = delete;

  void Update(absl::string_view bytes);
  // The hash of everything passed to Update so far; Update may continue.
  uint64_t Digest() const;
  // Starts over, as if newly constructed.
  void Reset();

 private:
  struct State;
  std::unique_ptr<State> state_;
};

// The whole-file and per-block checksums of a stream of bytes, for a
// manifest entry. Not thread-safe.
class FileHasher {
 public:
  // `block_size` 0: no block checksums.
  explicit FileHasher(uint64_t block_size);
  void Update(absl::string_view bytes);
  // The entry for `path` of everything passed to Update so far.
  ManifestEntry Entry(std::string path) const;

 private:
  const uint64_t block_size_;
  Xxh3Hasher whole_;
  Xxh3Hasher block_;
  uint64_t size_ = 0;
  std::vector<uint64_t> blocks_;  // completed blocks
};

// XXH3_64bits of `bytes`, in one call.
uint64_t Xxh3(absl::string_view bytes);
// "0123456789abcdef": 16 lowercase hex digits.
std::string ChecksumHex(uint64_t checksum);

// Reads file `name` in directory `dir` in chunks and returns its entry,
// with block checksums of `block_size` (0: none). `progress`, if set, is
// called with bytes read so far (of the file size).
absl::StatusOr<ManifestEntry> DescribeFile(
    FileSystem& fs, const std::string& dir, const std::string& name,
    const ProgressCallback& progress = {}, uint64_t block_size = 0);

// DataLoss naming the file under `dir` when `actual` (DescribeFile with
// listed.block_size) differs from `listed` in size, checksum or block
// checksums.
absl::Status CheckAgainstManifest(const std::string& dir,
                                  const ManifestEntry& listed,
                                  const ManifestEntry& actual);
// The document above. Entries are written in the order given.
nlohmann::json ManifestToJson(const Manifest& manifest);
// One entry of "files", and back (DataLoss prefixed with `where`, e.g.
// "manifest.json: files[2]", naming the field). The parse checks the
// fields, not the path's safety or uniqueness (ParseManifestJson does).
nlohmann::json ManifestEntryToJson(const ManifestEntry& entry);
absl::StatusOr<ManifestEntry> ManifestEntryFromJson(const nlohmann::json& doc,
                                                    absl::string_view where);
// Parses and validates a manifest document; `source` (a path) prefixes
// errors, which are DataLoss and name the offending JSON path, e.g.
// "files[2].xxh3_64: expected 16 hex digits, got \"12\"". Duplicate paths
// and unsafe names are errors.
absl::StatusOr<Manifest> ParseManifestJson(absl::string_view text,
                                           absl::string_view source);

// Writes `dir`/manifest.json atomically: to manifest.json.tmp, synced, then
// renamed over manifest.json, then `dir` synced. InvalidArgument for
// entries with unsafe names.
absl::Status WriteManifest(FileSystem& fs, const std::string& dir,
                           const Manifest& manifest);

struct VerifyOptions {
  // When false only sizes are checked (a cheap check for huge checkpoints
  // whose bytes will be read anyway).
  bool verify_checksums = true;
  // If set, the manifest must be of this kind.
  std::optional<CheckpointKind> expected_kind;
  // Bytes checksummed so far, of the sum of the listed sizes.
  ProgressCallback progress;
  // If set, only the files (paths relative to the directory) for which it
  // returns true are checksummed; every file's presence and size is still
  // checked.
  std::function<bool(const std::string& path)> checksum_only;
};

// Reads `dir`/manifest.json and checks the directory against it: the
// manifest parses and has the expected kind; every listed file exists with
// the listed size and (if asked) checksum; the directory holds nothing
// else. Returns the manifest. Errors name the directory, the file and what
// differs ("rank00001.safetensors: size is 1000 bytes, manifest says 1024");
// DataLoss for anything wrong with the checkpoint (including a missing
// manifest.json: the write did not finish), NotFound when `dir` itself
// does not exist.
absl::StatusOr<Manifest> VerifyManifest(FileSystem& fs, const std::string& dir,
                                        const VerifyOptions& options = {});

}  // namespace checkpoint
}  // namespace flatparam

#endif  // FLATPARAM_CHECKPOINT_MANIFEST_H_
