#include "flatparam/checkpoint/manifest.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "flatparam/base/status_matchers.h"
#include "flatparam/checkpoint/file_system.h"

namespace flatparam {
namespace checkpoint {
namespace {

using ::testing::HasSubstr;
using json = nlohmann::json;

constexpr absl::StatusCode kDataLoss = absl::StatusCode::kDataLoss;

TEST(Xxh3Test, KnownValueAndStreamingAgree) {
  // XXH3_64bits of the empty input, from xxHash's documentation and tests.
  EXPECT_EQ(Xxh3(""), 0x2D06800538D394C2u);
  std::string data;
  for (int i = 0; i < 100000; ++i) data.push_back(static_cast<char>(i * 7));
  Xxh3Hasher hasher;
  for (size_t at = 0; at < data.size(); at += 997) {
    hasher.Update(absl::string_view(data).substr(at, 997));
  }
  EXPECT_EQ(hasher.Digest(), Xxh3(data));
  EXPECT_NE(Xxh3(data), Xxh3(data.substr(1)));
  EXPECT_EQ(ChecksumHex(0x2D06800538D394C2u), "2d06800538d394c2");
  EXPECT_EQ(ChecksumHex(1), "0000000000000001");
}

TEST(Xxh3Test, LongInputsHashAsXxHashsPortableCode) {
  // XXH3_64bits of bytes i * 31 + 7, computed by libxxhash 0.8.1's
  // XXH3_64bits (its SSE2 code, which wrote every manifest before Xxh3 used
  // the run-time dispatch): the vector code Xxh3 picks must agree, from
  // the sizes where XXH3 changes code paths (240, 241) to many stripes.
  struct Known {
    size_t size;
    uint64_t xxh3;
  };
  const Known kKnown[] = {{240, 0xCCC7375172C41F03u},
                          {241, 0x0B3B630948CE4A00u},
                          {1024, 0x23BC880EBF0D29C6u},
                          {100003, 0xE0950E66CF107FE8u},
                          {1048581, 0xCD50EAFEA5A559C6u}};
  std::string data(1048581, '\0');
  for (size_t i = 0; i < data.size(); ++i) {
    data[i] = static_cast<char>(i * 31 + 7);
  }
  for (const Known& k : kKnown) {
    const absl::string_view bytes = absl::string_view(data).substr(0, k.size);
    EXPECT_EQ(Xxh3(bytes), k.xxh3) << k.size;
    Xxh3Hasher hasher;
    for (size_t at = 0; at < bytes.size(); at += 65537) {
      hasher.Update(bytes.substr(at, 65537));
    }
    EXPECT_EQ(hasher.Digest(), k.xxh3) << k.size;
  }
}

TEST(ManifestJsonTest, RoundTrips) {
  Manifest m;
  m.kind = CheckpointKind::kSharded;
  m.files = {{"layout.json", 10, 0xabcdefu}, {"rank00000.json", 0, ~0ull}};
  const nlohmann::json doc = ManifestToJson(m);
  EXPECT_EQ(doc["format"], "flatparam.checkpoint.v1");
  EXPECT_EQ(doc["kind"], "sharded");
  EXPECT_EQ(doc["files"][0]["xxh3_64"], "0000000000abcdef");
  FLATPARAM_ASSERT_OK_AND_ASSIGN(Manifest back,
                                 ParseManifestJson(doc.dump(), "m.json"));
  EXPECT_EQ(back.kind, m.kind);
  EXPECT_EQ(back.files, m.files);
}

TEST(ManifestJsonTest, RejectsMalformedDocuments) {
  auto parse = [](const std::string& text) {
    return ParseManifestJson(text, "dir/manifest.json").status();
  };
  auto with_file = [](const std::string& file) {
    return absl::StrCat(
        R"({"format": "flatparam.checkpoint.v1", "kind": "full", "files": [)",
        file, "]}");
  };
  EXPECT_THAT(
      parse("{"),
      StatusIs(kDataLoss, HasSubstr("dir/manifest.json:1:2: malformed JSON")));
  EXPECT_THAT(parse("[]"), StatusIs(kDataLoss, HasSubstr("not a JSON object")));
  // Deep nesting used to overflow the stack when quoting "kind".
  EXPECT_THAT(
      parse(absl::StrCat(R"({"format": "flatparam.checkpoint.v1", "kind": )",
                         std::string(100000, '['), std::string(100000, ']'),
                         "}")),
      StatusIs(kDataLoss,
               HasSubstr("dir/manifest.json: nested deeper than 512 levels")));
  EXPECT_THAT(parse(R"({"format": "v0", "kind": "full", "files": []})"),
              StatusIs(kDataLoss, HasSubstr("format: is \"v0\"")));
  EXPECT_THAT(
      parse(
          R"({"format": "flatparam.checkpoint.v1", "kind": "half", "files": []})"),
      StatusIs(kDataLoss, HasSubstr("kind: is \"half\"")));
  EXPECT_THAT(parse(R"({"format": "flatparam.checkpoint.v1", "kind": "full"})"),
              StatusIs(kDataLoss, HasSubstr("files: missing")));
  EXPECT_THAT(
      parse(
          R"({"format": "flatparam.checkpoint.v1", "kind": "full", "files": [], "x": 1})"),
      StatusIs(kDataLoss, HasSubstr("x: unknown key")));
  EXPECT_THAT(
      parse(with_file(R"({"path": "a", "size": 1, "xxh3_64": "12"})")),
      StatusIs(kDataLoss, HasSubstr("files[0].xxh3_64: expected 16 lowercase "
                                    "hex digits, got \"12\"")));
  EXPECT_THAT(
      parse(with_file(
          R"({"path": "a", "size": 1, "xxh3_64": "0123456789ABCDEF"})")),
      StatusIs(kDataLoss, HasSubstr("files[0].xxh3_64")));
  EXPECT_THAT(
      parse(with_file(
          R"({"path": "a", "size": -1, "xxh3_64": "0123456789abcdef"})")),
      StatusIs(kDataLoss, HasSubstr("files[0].size")));
  for (const char* path : {"../x", "a/b", "", ".", "manifest.json"}) {
    EXPECT_THAT(parse(with_file(absl::StrCat(
                    R"({"path": ")", path,
                    R"(", "size": 1, "xxh3_64": "0123456789abcdef"})"))),
                StatusIs(kDataLoss, HasSubstr("files[0].path")))
        << path;
  }
  const std::string entry =
      R"({"path": "a", "size": 1, "xxh3_64": "0123456789abcdef"})";
  EXPECT_THAT(
      parse(with_file(entry + "," + entry)),
      StatusIs(kDataLoss, HasSubstr("files[1].path: 'a' is listed twice")));
}

class ManifestVerifyTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_THAT(fs_.CreateDir("ckpt"), IsOk());
    ASSERT_THAT(WriteFileDurably(fs_, "ckpt/a.bin", std::string(3000, 'a')),
                IsOk());
    ASSERT_THAT(WriteFileDurably(fs_, "ckpt/b.json", "{}"), IsOk());
    Manifest m;
    m.kind = CheckpointKind::kFull;
    for (const char* name : {"a.bin", "b.json"}) {
      FLATPARAM_ASSERT_OK_AND_ASSIGN(ManifestEntry e,
                                     DescribeFile(fs_, "ckpt", name));
      m.files.push_back(e);
    }
    ASSERT_THAT(WriteManifest(fs_, "ckpt", m), IsOk());
  }

  // Replaces file `name` with `contents`.
  void Overwrite(const std::string& name, const std::string& contents) {
    ASSERT_THAT(WriteFileDurably(fs_, JoinPath("ckpt", name), contents),
                IsOk());
  }

  FaultInjectionFileSystem fs_;
};

TEST_F(ManifestVerifyTest, IntactDirectoryVerifies) {
  std::vector<std::pair<uint64_t, uint64_t>> progress;
  VerifyOptions options;
  options.expected_kind = CheckpointKind::kFull;
  options.progress = [&](uint64_t done, uint64_t total) {
    progress.emplace_back(done, total);
  };
  FLATPARAM_ASSERT_OK_AND_ASSIGN(Manifest m,
                                 VerifyManifest(fs_, "ckpt", options));
  ASSERT_EQ(m.files.size(), 2u);
  EXPECT_EQ(m.files[0].size, 3000u);
  ASSERT_FALSE(progress.empty());
  EXPECT_EQ(progress.back(), std::make_pair(uint64_t{3002}, uint64_t{3002}));
  // The manifest went through a temporary name and is the only addition.
  FLATPARAM_ASSERT_OK_AND_ASSIGN(std::vector<std::string> children,
                                 fs_.GetChildren("ckpt"));
  EXPECT_THAT(children,
              ::testing::ElementsAre("a.bin", "b.json", "manifest.json"));
}

TEST_F(ManifestVerifyTest, CatchesAFlippedByte) {
  std::string bytes(3000, 'a');
  bytes[1234] = 'b';
  Overwrite("a.bin", bytes);
  EXPECT_THAT(
      VerifyManifest(fs_, "ckpt"),
      StatusIs(kDataLoss, HasSubstr("ckpt/a.bin: xxh3_64 checksum is")));
  // Sizes alone cannot see it.
  VerifyOptions sizes_only;
  sizes_only.verify_checksums = false;
  EXPECT_THAT(VerifyManifest(fs_, "ckpt", sizes_only), IsOk());
}

TEST_F(ManifestVerifyTest, CatchesATruncatedFile) {
  Overwrite("a.bin", std::string(2999, 'a'));
  VerifyOptions sizes_only;
  sizes_only.verify_checksums = false;
  EXPECT_THAT(VerifyManifest(fs_, "ckpt", sizes_only),
              StatusIs(kDataLoss, HasSubstr("ckpt/a.bin: size is 2999 bytes, "
                                            "manifest.json says 3000")));
}

TEST_F(ManifestVerifyTest, CatchesAMissingFile) {
  ASSERT_THAT(fs_.RemoveFile("ckpt/b.json"), IsOk());
  EXPECT_THAT(
      VerifyManifest(fs_, "ckpt"),
      StatusIs(kDataLoss, HasSubstr("ckpt/b.json: listed in manifest.json "
                                    "but missing")));
}

TEST_F(ManifestVerifyTest, CatchesAnExtraFile) {
  Overwrite("c.bin", "extra");
  EXPECT_THAT(VerifyManifest(fs_, "ckpt"),
              StatusIs(kDataLoss,
                       HasSubstr("ckpt/c.bin: not listed in manifest.json")));
  ASSERT_THAT(fs_.RemoveFile("ckpt/c.bin"), IsOk());
  ASSERT_THAT(fs_.CreateDir("ckpt/sub"), IsOk());
  EXPECT_THAT(VerifyManifest(fs_, "ckpt"),
              StatusIs(kDataLoss, HasSubstr("ckpt/sub: not listed")));
}

TEST_F(ManifestVerifyTest, CatchesMissingOrCorruptManifestAndWrongKind) {
  VerifyOptions sharded;
  sharded.expected_kind = CheckpointKind::kSharded;
  EXPECT_THAT(VerifyManifest(fs_, "ckpt", sharded),
              StatusIs(kDataLoss,
                       HasSubstr("a full checkpoint, expected a sharded one")));
  Overwrite("manifest.json", "{\"format\": ");
  EXPECT_THAT(VerifyManifest(fs_, "ckpt"),
              StatusIs(kDataLoss,
                       HasSubstr("ckpt/manifest.json:1:12: malformed JSON")));
  ASSERT_THAT(fs_.RemoveFile("ckpt/manifest.json"), IsOk());
  EXPECT_THAT(
      VerifyManifest(fs_, "ckpt"),
      StatusIs(kDataLoss, HasSubstr("ckpt: no manifest.json (the checkpoint "
                                    "was not completely written)")));
  EXPECT_THAT(VerifyManifest(fs_, "nowhere"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("nowhere")));
}

// --- Block checksums ---------------------------------------------------------

TEST(BlockChecksumTest, BlockSizeKeepsTheBlockCountBounded) {
  EXPECT_EQ(ChecksumBlockBytes(0), uint64_t{64} << 10);
  EXPECT_EQ(ChecksumBlockBytes((uint64_t{1} << 30) - 1), uint64_t{64} << 10);
  EXPECT_EQ(ChecksumBlockBytes(uint64_t{1} << 30), uint64_t{128} << 10);
  EXPECT_EQ(ChecksumBlockBytes(uint64_t{4} << 30), uint64_t{512} << 10);
  for (uint64_t size : {uint64_t{2} << 30, uint64_t{17} << 30,
                        uint64_t{1} << 40, (uint64_t{1} << 40) + 1}) {
    const uint64_t b = ChecksumBlockBytes(size);
    EXPECT_LE(size / b, 16384u) << size;
    EXPECT_GT(size / (b / 2), 16383u) << size;
  }
}

TEST(BlockChecksumTest, HasherAgreesWithBlockwiseXxh3InAnyPieces) {
  std::string data(1000, '\0');
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>(i * 7);
  for (uint64_t block : {uint64_t{1}, uint64_t{64}, uint64_t{100},
                         uint64_t{999}, uint64_t{1000}, uint64_t{4096}}) {
    for (size_t piece : {size_t{1}, size_t{33}, size_t{1000}}) {
      FileHasher hasher(block);
      for (size_t at = 0; at < data.size(); at += piece) {
        hasher.Update(absl::string_view(data).substr(at, piece));
      }
      const ManifestEntry e = hasher.Entry("f");
      EXPECT_EQ(e.size, data.size());
      EXPECT_EQ(e.xxh3_64, Xxh3(data));
      ASSERT_EQ(e.block_size, block);
      ASSERT_EQ(e.block_xxh3_64.size(), (data.size() + block - 1) / block);
      for (size_t k = 0; k < e.block_xxh3_64.size(); ++k) {
        EXPECT_EQ(e.block_xxh3_64[k],
                  Xxh3(absl::string_view(data).substr(k * block, block)))
            << block << " " << piece << " " << k;
      }
    }
  }
  EXPECT_FALSE(FileHasher(0).Entry("f").has_blocks());
  EXPECT_TRUE(FileHasher(8).Entry("f").block_xxh3_64.empty());  // 0 bytes
}

TEST(BlockChecksumTest, JsonRoundTripsAndRejectsInconsistentBlocks) {
  FileHasher hasher(4);
  hasher.Update("0123456789");
  Manifest m;
  m.kind = CheckpointKind::kSharded;
  m.files.push_back(hasher.Entry("a"));
  m.files.push_back(ManifestEntry{"b", 3, 42});  // no blocks: older writers
  const std::string text = ManifestToJson(m).dump();
  FLATPARAM_ASSERT_OK_AND_ASSIGN(Manifest back, ParseManifestJson(text, "m"));
  EXPECT_EQ(back.files, m.files);
  EXPECT_EQ(back.files[0].block_xxh3_64.size(), 3u);

  auto parse_entry = [](const std::string& entry) {
    return ManifestEntryFromJson(json::parse(entry), "m: files[0]").status();
  };
  const std::string h = R"("0123456789abcdef")";
  EXPECT_THAT(parse_entry(R"({"path": "a", "size": 10, "xxh3_64": )" + h +
                          R"(, "block_size": 4, "block_xxh3_64": [)" + h + "," +
                          h + "]}"),
              StatusIs(kDataLoss,
                       HasSubstr("m: files[0].block_xxh3_64: expected an array "
                                 "of 3 checksums (10 bytes in blocks of 4), "
                                 "got 2 entries")));
  EXPECT_THAT(parse_entry(R"({"path": "a", "size": 1, "xxh3_64": )" + h +
                          R"(, "block_size": 4})"),
              StatusIs(kDataLoss, HasSubstr("block_xxh3_64: missing")));
  EXPECT_THAT(
      parse_entry(R"({"path": "a", "size": 1, "xxh3_64": )" + h +
                  R"(, "block_size": 0, "block_xxh3_64": []})"),
      StatusIs(kDataLoss, HasSubstr("block_size: expected an integer")));
  EXPECT_THAT(parse_entry(R"({"path": "a", "size": 1, "xxh3_64": )" + h +
                          R"(, "block_size": 4, "block_xxh3_64": ["x"]})"),
              StatusIs(kDataLoss, HasSubstr("block_xxh3_64[0]: expected 16")));
}

TEST_F(ManifestVerifyTest, BlockChecksumsAreVerifiedToo) {
  // A manifest whose whole-file checksums are right but a block checksum
  // is wrong is itself damaged.
  Manifest m;
  m.kind = CheckpointKind::kFull;
  for (const char* name : {"a.bin", "b.json"}) {
    FLATPARAM_ASSERT_OK_AND_ASSIGN(ManifestEntry e,
                                   DescribeFile(fs_, "ckpt", name, {}, 1024));
    m.files.push_back(e);
  }
  ASSERT_EQ(m.files[0].block_xxh3_64.size(), 3u);
  ASSERT_THAT(WriteManifest(fs_, "ckpt", m), IsOk());
  FLATPARAM_ASSERT_OK(VerifyManifest(fs_, "ckpt").status());
  m.files[0].block_xxh3_64[2] ^= 1;
  ASSERT_THAT(WriteManifest(fs_, "ckpt", m), IsOk());
  EXPECT_THAT(VerifyManifest(fs_, "ckpt").status(),
              StatusIs(kDataLoss, HasSubstr("ckpt/a.bin: the file matches its "
                                            "xxh3_64 but not the block")));
}

TEST(WriteManifestTest, RejectsUnsafeNames) {
  FaultInjectionFileSystem fs;
  Manifest m;
  m.files = {{"../escape", 0, 0}};
  EXPECT_THAT(
      WriteManifest(fs, "/", m),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("../escape")));
}

}  // namespace
}  // namespace checkpoint
}  // namespace flatparam
