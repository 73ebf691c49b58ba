#include "flatparam/torch/dcp.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "flatparam/base/status_matchers.h"
#include "nlohmann/json.hpp"

namespace flatparam {
namespace libtorch {
namespace {

using ::testing::HasSubstr;
using json = nlohmann::json;

checkpoint::FileSystem& Fs() { return checkpoint::PosixFileSystem(); }

std::string Fixture(const std::string& name) {
  return absl::StrCat("flatparam/torch/testdata/dcp/", name);
}

// testdata/dcp/make_fixtures.py's expected.json.
const json& Expected() {
  static const json* expected = [] {
    std::ifstream in(Fixture("expected.json"));
    std::stringstream s;
    s << in.rdbuf();
    return new json(json::parse(s.str()));
  }();
  return *expected;
}

// Every tensor of `dir` equals Python's, bit for bit; every bytes item too.
void ExpectAllItems(const DcpReader& dcp, const json& expected) {
  ASSERT_EQ(dcp.metadata().entries.size(), expected.size());
  for (const auto& [key, want] : expected.items()) {
    SCOPED_TRACE(key);
    auto it = dcp.metadata().entries.find(key);
    ASSERT_NE(it, dcp.metadata().entries.end());
    if (want.contains("bytes")) {
      ASSERT_EQ(it->second.kind, DcpEntry::Kind::kBytes);
      absl::StatusOr<json> value = dcp.ReadBytes(key);
      ASSERT_THAT(value, IsOk());
      // Tuples read as arrays, as JSON wrote them.
      EXPECT_EQ(*value, want["bytes"]);
      continue;
    }
    ASSERT_EQ(it->second.kind, DcpEntry::Kind::kTensor);
    absl::StatusOr<HostTensor> t = dcp.ReadTensor(key);
    ASSERT_THAT(t, IsOk());
    EXPECT_EQ(DTypeName(t->dtype()), want["dtype"].get<std::string>());
    EXPECT_EQ(t->shape(), want["shape"].get<std::vector<int64_t>>());
    const std::vector<double> values =
        want["values"].get<std::vector<double>>();
    ASSERT_EQ(t->numel(), static_cast<int64_t>(values.size()));
    for (int64_t i = 0; i < t->numel(); ++i) {
      const double got = t->dtype() == DType::kInt64
                             ? static_cast<double>(t->data_as<int64_t>()[i])
                             : t->GetDouble(i);
      ASSERT_EQ(got, values[i]) << "element " << i;
    }
  }
}

// PyTorch 1.13's own DCP, saved by 2 and 4 gloo ranks: ShardedTensors
// chunked on dim 0 (with 4 ranks, a 5-row tensor has 3 chunks and rank 3
// none), a replicated tensor, an int.
TEST(DcpReaderTest, ReadsPyTorch113CheckpointsOfTwoAndFourRanks) {
  for (const char* dir : {"w2", "w4"}) {
    SCOPED_TRACE(dir);
    EXPECT_THAT(IsDcpCheckpoint(Fs(), Fixture(dir)), IsOkAndHolds(true));
    absl::StatusOr<DcpReader> dcp = DcpReader::Open(Fs(), Fixture(dir));
    ASSERT_THAT(dcp, IsOk());
    EXPECT_EQ(dcp->metadata().module, "torch.distributed._shard.checkpoint");
    EXPECT_EQ(dcp->metadata().version, "");
    ExpectAllItems(*dcp, Expected()["v1"]);
  }
  absl::StatusOr<DcpReader> w4 = DcpReader::Open(Fs(), Fixture("w4"));
  ASSERT_THAT(w4, IsOk());
  const DcpEntry& weight = w4->metadata().entries.at("layers.0.weight");
  ASSERT_EQ(weight.chunks.size(), 3);
  EXPECT_EQ(weight.chunks[2].offsets, (std::vector<int64_t>{4, 0}));
  EXPECT_EQ(weight.chunks[2].sizes, (std::vector<int64_t>{1, 3}));
  EXPECT_EQ(w4->metadata().entries.at("embed.weight").chunks.size(), 4);
}

// The 2.x layout: concatenated items, flattened keys, optimizer state,
// param_groups as a bytes item, storage_meta and version.
TEST(DcpReaderTest, ReadsThePyTorch2Layout) {
  absl::StatusOr<DcpReader> dcp = DcpReader::Open(Fs(), Fixture("v2"));
  ASSERT_THAT(dcp, IsOk());
  EXPECT_EQ(dcp->metadata().module, "torch.distributed.checkpoint");
  EXPECT_EQ(dcp->metadata().version, "1.0.0");
  ExpectAllItems(*dcp, Expected()["v2"]);
  // Items of one rank share its file.
  const DcpEntry& e = dcp->metadata().entries.at("model.layers.0.weight");
  ASSERT_EQ(e.chunks.size(), 3);
  EXPECT_EQ(e.chunks[0].storage.file, "__0_0.distcp");
  EXPECT_GT(e.chunks[0].storage.offset, 0);
  EXPECT_EQ(e.chunks[2].storage.file, "__2_0.distcp");
  // A scalar tensor (the optimizer's step) is one chunk of rank 0.
  const DcpEntry& step =
      dcp->metadata().entries.at("optim.state.embed.weight.step");
  EXPECT_TRUE(step.shape.empty());
  ASSERT_EQ(step.chunks.size(), 1);
}

TEST(DcpReaderTest, ReadChunkGivesTheStoredPieceAndRejectsMisuse) {
  absl::StatusOr<DcpReader> dcp = DcpReader::Open(Fs(), Fixture("bad/ok"));
  ASSERT_THAT(dcp, IsOk());
  absl::StatusOr<HostTensor> chunk = dcp->ReadChunk("w", 1);
  ASSERT_THAT(chunk, IsOk());
  EXPECT_EQ(chunk->shape(), (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(chunk->data_as<float>()[0], 4.0f);
  EXPECT_THAT(dcp->ReadChunk("w", 2),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(dcp->ReadTensor("nope"), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(dcp->ReadBytes("w"),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(IsDcpCheckpoint(Fs(), Fixture("")), IsOkAndHolds(false));
}

// Hostile and damaged metadata: a clear error at Open, naming what is
// wrong, before any item is read.
TEST(DcpReaderTest, RefusesHostileOrDamagedMetadata) {
  struct Case {
    const char* dir;
    absl::StatusCode code;
    const char* message;
  };
  const Case cases[] = {
      {"overlap", absl::StatusCode::kDataLoss,
       "w: chunks at [0, 0] (sizes [3, 2]) and [1, 0] (sizes [1, 2]) overlap"},
      {"gap", absl::StatusCode::kDataLoss,
       "w: its chunks hold 6 of its 8 elements (a gap)"},
      {"beyond", absl::StatusCode::kDataLoss,
       "w: a chunk at [2, 0] of sizes [3, 2] reaches beyond the tensor's "
       "size [4, 2]"},
      {"huge", absl::StatusCode::kDataLoss, "w: size overflows"},
      {"slash", absl::StatusCode::kDataLoss,
       "relative_path \"../__0_0.distcp\" is not a file name"},
      {"dotdot", absl::StatusCode::kDataLoss,
       "relative_path \"..\" is not a file name"},
      {"past_end", absl::StatusCode::kDataLoss, "of __0_0.distcp, which has"},
      {"duplicate", absl::StatusCode::kDataLoss,
       "w: two storage entries for the item at [2, 0]"},
      {"missing", absl::StatusCode::kDataLoss,
       "w: no storage for its chunk at [2, 0]"},
      {"global", absl::StatusCode::kFailedPrecondition,
       "the pickle names the global 'posix.system'"},
      {"zstd", absl::StatusCode::kFailedPrecondition,
       "stored through DCP's extensions [zstd]"},
      {"unknown_key", absl::StatusCode::kDataLoss,
       "storage_data names \"v\", which state_dict_metadata lacks"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.dir);
    EXPECT_THAT(DcpReader::Open(Fs(), Fixture(absl::StrCat("bad/", c.dir))),
                StatusIs(c.code, HasSubstr(c.message)));
  }
  // Metadata that disagrees with the item: found when it is read.
  absl::StatusOr<DcpReader> dcp =
      DcpReader::Open(Fs(), Fixture("bad/wrong_dtype"));
  ASSERT_THAT(dcp, IsOk());
  EXPECT_THAT(dcp->ReadTensor("w"),
              StatusIs(absl::StatusCode::kDataLoss,
                       HasSubstr("holds a float32 tensor of [2, 2], the "
                                 "metadata says float64 [2, 2]")));
}

TEST(DcpReaderTest, ATruncatedOrMissingMetadataIsAnError) {
  EXPECT_THAT(ParseDcpMetadata("\x80\x04\x95", "m"),
              StatusIs(absl::StatusCode::kDataLoss));
  EXPECT_THAT(ParseDcpMetadata("", "m"), StatusIs(absl::StatusCode::kDataLoss));
  // A pickle of something else than Metadata.
  EXPECT_THAT(ParseDcpMetadata(std::string("\x80\x02}q\x00.", 6), "m"),
              StatusIs(absl::StatusCode::kDataLoss,
                       HasSubstr("the pickle is a dict, not a Metadata")));
  EXPECT_THAT(DcpReader::Open(Fs(), Fixture("nowhere")),
              StatusIs(absl::StatusCode::kNotFound));
}

}  // namespace
}  // namespace libtorch
}  // namespace flatparam
