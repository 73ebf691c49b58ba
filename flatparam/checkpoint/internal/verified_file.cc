#include "flatparam/checkpoint/internal/verified_file.h"

#include <algorithm>
#include <cassert>
#include <utility>

#include "absl/strings/str_format.h"
#include "flatparam/base/status_macros.h"

namespace flatparam {
namespace checkpoint {
namespace internal_checkpoint {

absl::StatusOr<std::unique_ptr<RandomAccessFile>> BlockVerifiedFile::Open(
    std::unique_ptr<RandomAccessFile> base, ManifestEntry entry,
    uint64_t read_piece_bytes) {
  assert(entry.has_blocks());
  assert(read_piece_bytes > 0);
  FLATPARAM_ASSIGN_OR_RETURN(const uint64_t size, base->Size());
  if (size != entry.size) {
    return absl::DataLossError(
        absl::StrFormat("%s: size is %d bytes, %s says %d", base->name(), size,
                        kManifestFileName, entry.size));
  }
  return std::unique_ptr<RandomAccessFile>(new BlockVerifiedFile(
      std::move(base), std::move(entry), read_piece_bytes));
}

BlockVerifiedFile::BlockVerifiedFile(std::unique_ptr<RandomAccessFile> base,
                                     ManifestEntry entry,
                                     uint64_t read_piece_bytes)
    : base_(std::move(base)),
      entry_(std::move(entry)),
      piece_blocks_(
          std::max<uint64_t>(1, read_piece_bytes / entry_.block_size)) {}

absl::Status BlockVerifiedFile::ReadBlock(uint64_t k,
                                          absl::Span<char> out) const {
  const uint64_t begin = k * entry_.block_size;
  assert(out.size() == std::min(entry_.size - begin, entry_.block_size));
  FLATPARAM_RETURN_IF_ERROR(base_->ReadAt(begin, out));
  return CheckBlock(k, absl::string_view(out.data(), out.size()));
}

absl::Status BlockVerifiedFile::CheckBlock(uint64_t k,
                                           absl::string_view bytes) const {
  assert(k < entry_.block_xxh3_64.size());
  const uint64_t begin = k * entry_.block_size;
  const uint64_t actual = Xxh3(bytes);
  if (actual != entry_.block_xxh3_64[k]) {
    return absl::DataLossError(absl::StrFormat(
        "%s: bytes [%d, %d) (checksum block %d of %d) have xxh3_64 %s, %s says "
        "%s (the file is corrupt)",
        name(), begin, begin + bytes.size(), k, entry_.block_xxh3_64.size(),
        ChecksumHex(actual), kManifestFileName,
        ChecksumHex(entry_.block_xxh3_64[k])));
  }
  return absl::OkStatus();
}

absl::Status BlockVerifiedFile::ReadAt(uint64_t offset,
                                       absl::Span<char> out) const {
  const uint64_t size = entry_.size;
  if (offset > size || out.size() > size - offset) {
    return absl::DataLossError(absl::StrFormat(
        "%s: reading bytes [%d, %d) but the file has only %d bytes", name(),
        offset, offset + out.size(), size));
  }
  const uint64_t b = entry_.block_size;
  const uint64_t end = offset + out.size();
  uint64_t pos = offset;
  while (pos < end) {
    const uint64_t k = pos / b;
    const uint64_t block_begin = k * b;
    const uint64_t block_end = std::min(size, block_begin + b);
    char* dst = out.data() + (pos - offset);
    if (pos == block_begin && end >= block_end) {
      // The run of blocks wholly inside the request, up to the last block
      // boundary in it (the file's end closes the last, shorter block):
      // read straight into the caller's buffer a piece at a time, each
      // piece verified there right after its read, while it is still in
      // cache. On a mismatch the caller gets an error, so the bytes it
      // holds are moot.
      const uint64_t last = end == size ? size : end - end % b;
      assert(last >= block_end);
      while (pos < last) {
        const uint64_t piece_end = std::min(last, pos + piece_blocks_ * b);
        char* piece = out.data() + (pos - offset);
        FLATPARAM_RETURN_IF_ERROR(
            base_->ReadAt(pos, absl::MakeSpan(piece, piece_end - pos)));
        for (uint64_t at = pos; at < piece_end; at += b) {
          const uint64_t n = std::min(b, piece_end - at);
          FLATPARAM_RETURN_IF_ERROR(
              CheckBlock(at / b, absl::string_view(piece + (at - pos), n)));
        }
        pos = piece_end;
      }
      continue;
    }
    const uint64_t n = std::min(end, block_end) - pos;
    absl::MutexLock lock(&mu_);
    auto it = std::find_if(cache_.begin(), cache_.end(),
                           [k](const CachedBlock& c) { return c.index == k; });
    if (it == cache_.end()) {
      CachedBlock block{k, std::vector<char>(block_end - block_begin)};
      FLATPARAM_RETURN_IF_ERROR(ReadBlock(k, absl::MakeSpan(block.bytes)));
      cache_.push_front(std::move(block));
      if (cache_.size() > kCachedBlocks) cache_.pop_back();
    } else {
      cache_.splice(cache_.begin(), cache_, it);
    }
    std::copy_n(cache_.front().bytes.data() + (pos - block_begin), n, dst);
    pos += n;
  }
  return absl::OkStatus();
}

}  // namespace internal_checkpoint
}  // namespace checkpoint
}  // namespace flatparam
