#include "flatparam/checkpoint/internal/verified_file.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "flatparam/base/status_matchers.h"
#include "flatparam/checkpoint/file_system.h"
#include "flatparam/checkpoint/internal/counting_file_system.h"
#include "flatparam/checkpoint/manifest.h"

namespace flatparam {
namespace checkpoint {
namespace internal_checkpoint {
namespace {

using ::testing::HasSubstr;
constexpr absl::StatusCode kDataLoss = absl::StatusCode::kDataLoss;

// Forwards to `base`, appending each ReadAt's (offset, length) to `reads`.
class RecordingFile : public RandomAccessFile {
 public:
  RecordingFile(std::unique_ptr<RandomAccessFile> base,
                std::vector<std::pair<uint64_t, uint64_t>>* reads)
      : base_(std::move(base)), reads_(reads) {}
  absl::Status ReadAt(uint64_t offset, absl::Span<char> out) const override {
    reads_->emplace_back(offset, out.size());
    return base_->ReadAt(offset, out);
  }
  absl::StatusOr<uint64_t> Size() const override { return base_->Size(); }
  const std::string& name() const override { return base_->name(); }

 private:
  std::unique_ptr<RandomAccessFile> base_;
  std::vector<std::pair<uint64_t, uint64_t>>* reads_;
};

class BlockVerifiedFileTest : public ::testing::Test {
 protected:
  static constexpr uint64_t kBlock = 100;

  void SetUp() override {
    data_.resize(1050);
    for (size_t i = 0; i < data_.size(); ++i) {
      data_[i] = static_cast<char>(i * 31 + 7);
    }
    ASSERT_THAT(WriteFileDurably(disk_, "f", data_), IsOk());
    FLATPARAM_ASSERT_OK_AND_ASSIGN(entry_,
                                   DescribeFile(disk_, "", "f", {}, kBlock));
  }

  // With `reads` set, records the (offset, length) of every read of the
  // underlying file.
  std::unique_ptr<RandomAccessFile> Open(
      uint64_t read_piece_bytes = BlockVerifiedFile::kReadPieceBytes,
      std::vector<std::pair<uint64_t, uint64_t>>* reads = nullptr) {
    auto base = counting_.NewRandomAccessFile("f");
    EXPECT_THAT(base.status(), IsOk());
    std::unique_ptr<RandomAccessFile> under = *std::move(base);
    if (reads != nullptr) {
      under = std::make_unique<RecordingFile>(std::move(under), reads);
    }
    auto file =
        BlockVerifiedFile::Open(std::move(under), entry_, read_piece_bytes);
    EXPECT_THAT(file.status(), IsOk());
    return *std::move(file);
  }

  absl::StatusOr<std::string> Read(const RandomAccessFile& f, uint64_t at,
                                   uint64_t n) {
    std::string out(n, '\0');
    absl::Status s = f.ReadAt(at, absl::MakeSpan(out.data(), n));
    if (!s.ok()) return s;
    return out;
  }

  FaultInjectionFileSystem disk_;
  CountingFileSystem counting_{disk_};
  std::string data_;
  ManifestEntry entry_;
};

TEST_F(BlockVerifiedFileTest, ReturnsTheBytesOfAnyRange) {
  std::unique_ptr<RandomAccessFile> f = Open();
  for (uint64_t at : {0, 1, 99, 100, 101, 250, 999, 1000, 1049, 1050}) {
    for (uint64_t n : {0, 1, 50, 100, 101, 333, 1050}) {
      if (at + n > data_.size()) continue;
      EXPECT_THAT(Read(*f, at, n), IsOkAndHolds(data_.substr(at, n)))
          << at << " " << n;
    }
  }
  EXPECT_THAT(Read(*f, 1000, 51),
              StatusIs(kDataLoss, HasSubstr("reading bytes [1000, 1051) but "
                                            "the file has only 1050 bytes")));
}

TEST_F(BlockVerifiedFileTest, ARangeCostsItsBytesPlusTwoPartialBlocks) {
  std::unique_ptr<RandomAccessFile> f = Open();
  counting_.Reset();
  ASSERT_THAT(Read(*f, 150, 700), IsOkAndHolds(data_.substr(150, 700)));
  // Blocks 1 (partial), 2..7 (whole, read in place), 8 (partial).
  EXPECT_EQ(counting_.total(), 800);
  // A sequential reader in small pieces reads every block once.
  std::unique_ptr<RandomAccessFile> g = Open();
  counting_.Reset();
  for (uint64_t at = 0; at < data_.size(); at += 30) {
    const uint64_t n = std::min<uint64_t>(30, data_.size() - at);
    ASSERT_THAT(Read(*g, at, n), IsOkAndHolds(data_.substr(at, n)));
  }
  EXPECT_EQ(counting_.total(), static_cast<int64_t>(data_.size()));
}

TEST_F(BlockVerifiedFileTest, ADamagedBlockFailsExactlyTheReadsThatTouchIt) {
  std::string damaged = data_;
  damaged[523] ^= 0x10;
  ASSERT_THAT(WriteFileDurably(disk_, "f", damaged), IsOk());
  std::unique_ptr<RandomAccessFile> f = Open();
  EXPECT_THAT(Read(*f, 0, 500), IsOkAndHolds(data_.substr(0, 500)));
  EXPECT_THAT(Read(*f, 600, 450), IsOkAndHolds(data_.substr(600, 450)));
  const auto damaged_block = StatusIs(
      kDataLoss, HasSubstr("f: bytes [500, 600) (checksum block 5 of 11) have "
                           "xxh3_64 "));
  EXPECT_THAT(Read(*f, 523, 1), damaged_block);    // partial: via the cache
  EXPECT_THAT(Read(*f, 500, 100), damaged_block);  // whole: in place
  EXPECT_THAT(Read(*f, 0, 1050), damaged_block);
  // A failed block is not cached as good.
  EXPECT_THAT(Read(*f, 520, 1), damaged_block);
}

TEST_F(BlockVerifiedFileTest, ReadsARunOfWholeBlocksInPieces) {
  using Reads = std::vector<std::pair<uint64_t, uint64_t>>;
  Reads reads;
  // 250 bytes: pieces of 2 blocks.
  std::unique_ptr<RandomAccessFile> f = Open(250, &reads);
  EXPECT_THAT(Read(*f, 0, 1050), IsOkAndHolds(data_));
  EXPECT_EQ(reads, (Reads{{0, 200},
                          {200, 200},
                          {400, 200},
                          {600, 200},
                          {800, 200},
                          {1000, 50}}));
  // From a block boundary; the partial blocks at the ends read whole.
  reads.clear();
  std::unique_ptr<RandomAccessFile> g = Open(250, &reads);
  EXPECT_THAT(Read(*g, 50, 660), IsOkAndHolds(data_.substr(50, 660)));
  EXPECT_EQ(reads,
            (Reads{{0, 100}, {100, 200}, {300, 200}, {500, 200}, {700, 100}}));
  // A piece smaller than a block is one block.
  reads.clear();
  std::unique_ptr<RandomAccessFile> h = Open(1, &reads);
  EXPECT_THAT(Read(*h, 800, 250), IsOkAndHolds(data_.substr(800)));
  EXPECT_EQ(reads, (Reads{{800, 100}, {900, 100}, {1000, 50}}));
}

TEST_F(BlockVerifiedFileTest, ADamagedBlockStopsTheReadAtItsPiece) {
  std::string damaged = data_;
  damaged[523] ^= 0x10;
  ASSERT_THAT(WriteFileDurably(disk_, "f", damaged), IsOk());
  std::unique_ptr<RandomAccessFile> f = Open(250);
  counting_.Reset();
  EXPECT_THAT(
      Read(*f, 0, 1050),
      StatusIs(kDataLoss, HasSubstr("f: bytes [500, 600) (checksum block 5 of "
                                    "11) have xxh3_64 ")));
  // Pieces [0, 200), [200, 400), [400, 600): nothing after the damage.
  EXPECT_EQ(counting_.total(), 600);
}

TEST_F(BlockVerifiedFileTest, RejectsAFileOfAnotherSize) {
  ASSERT_THAT(WriteFileDurably(disk_, "f", data_ + "x"), IsOk());
  FLATPARAM_ASSERT_OK_AND_ASSIGN(std::unique_ptr<RandomAccessFile> base,
                                 disk_.NewRandomAccessFile("f"));
  EXPECT_THAT(BlockVerifiedFile::Open(std::move(base), entry_).status(),
              StatusIs(kDataLoss, HasSubstr("size is 1051 bytes")));
}

}  // namespace
}  // namespace internal_checkpoint
}  // namespace checkpoint
}  // namespace flatparam
