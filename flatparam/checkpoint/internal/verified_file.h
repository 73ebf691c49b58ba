// Private to //flatparam/checkpoint: a file whose reads are verified against
// a manifest entry's block checksums (manifest.h), so that a reader checks
// exactly the bytes it reads -- a job loading its shard, or the byte ranges
// a resharding load needs from other ranks' files -- instead of
// checksumming whole files first and reading them again.
//
// Every ReadAt reads the checksum blocks that cover the requested range:
// the run of blocks wholly inside it straight into the caller's buffer, in
// pieces of about kReadPieceBytes, each piece's blocks checked right after
// its read while they are still in the CPU's cache (one pass over memory,
// not a read and then a second pass to hash; a damaged block stops the
// read at its piece), partial ones
// into a small cache of the last kCachedBlocks partial blocks (so a
// sequential reader, such as a safetensors header followed by its tensors,
// reads every block once, and so does one that reads the tensors' pieces
// in another order than the file's, as a resharding load does, as long as
// the pieces that share a block are read close together). Memory: at most
// kCachedBlocks blocks per open file (128 KiB for files up to 1 GiB). A block
// whose checksum differs fails the read with DataLoss naming the file, the
// block and both checksums; nothing of an unverified block reaches the caller.
// A range read therefore costs its own bytes plus at most two partial
// blocks.
//
// Thread-safety: ReadAt may be called from several threads (the cache is
// guarded by a mutex). Owns the underlying file.
#ifndef FLATPARAM_CHECKPOINT_INTERNAL_VERIFIED_FILE_H_
#define FLATPARAM_CHECKPOINT_INTERNAL_VERIFIED_FILE_H_

#include <cstdint>
#include <list>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "flatparam/checkpoint/file_system.h"
#include "flatparam/checkpoint/manifest.h"

namespace flatparam {
namespace checkpoint {
namespace internal_checkpoint {

class BlockVerifiedFile : public RandomAccessFile {
 public:
  static constexpr int kCachedBlocks = 2;
  // A run of whole blocks is read in pieces of this many bytes (rounded down
  // to whole blocks, at least one), each piece checksummed right after its
  // read, while it is still in the caches. On the CI machine (2-core AMD
  // EPYC VM, Xxh3 running libxxhash's AVX-512 code) the checksums of a warm
  // 1 GiB read cost 26-32 ms in 1 MiB pieces; a second pass over the same
  // GiB, from memory, costs 46 ms. 4 MiB, the plain-read baseline's piece:
  // warm loads take the same time as with 1 MiB pieces (1.04-1.14x the
  // plain read, A/B at W = 1 and 4), and cold loads on 8 ranks 0.97-1.18x
  // against 1.00-1.28x (four interleaved pairs), the larger requests
  // keeping the disk busier.
  static constexpr uint64_t kReadPieceBytes = uint64_t{4} << 20;

  // `entry` must have block checksums (entry.has_blocks()). DataLoss when
  // the file's size differs from the entry's. `read_piece_bytes` (> 0)
  // replaces kReadPieceBytes, for tests.
  static absl::StatusOr<std::unique_ptr<RandomAccessFile>> Open(
      std::unique_ptr<RandomAccessFile> base, ManifestEntry entry,
      uint64_t read_piece_bytes = kReadPieceBytes);

  absl::Status ReadAt(uint64_t offset, absl::Span<char> out) const override;
  absl::StatusOr<uint64_t> Size() const override { return entry_.size; }
  const std::string& name() const override { return base_->name(); }

 private:
  BlockVerifiedFile(std::unique_ptr<RandomAccessFile> base, ManifestEntry entry,
                    uint64_t read_piece_bytes);
  // Reads block `k` whole into `out` (its size) and checks it.
  absl::Status ReadBlock(uint64_t k, absl::Span<char> out) const;
  // DataLoss unless `bytes` (block `k`, whole) match its checksum.
  absl::Status CheckBlock(uint64_t k, absl::string_view bytes) const;

  std::unique_ptr<RandomAccessFile> base_;
  const ManifestEntry entry_;
  // Whole blocks per read of a run of whole blocks: at least 1.
  const uint64_t piece_blocks_;
  struct CachedBlock {
    uint64_t index = 0;
    std::vector<char> bytes;  // verified
  };
  mutable absl::Mutex mu_;
  // The last partially read blocks, most recently used first.
  mutable std::list<CachedBlock> cache_ ABSL_GUARDED_BY(mu_);
};

}  // namespace internal_checkpoint
}  // namespace checkpoint
}  // namespace flatparam

#endif  // FLATPARAM_CHECKPOINT_INTERNAL_VERIFIED_FILE_H_
