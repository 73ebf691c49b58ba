#include "flatparam/interop/dcp/dcp_export.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "flatparam/base/status_matchers.h"
#include "flatparam/checkpoint/checkpoint_dir.h"
#include "flatparam/interop/dcp/dcp.h"
#include "nlohmann/json.hpp"

namespace flatparam {
namespace libtorch {
namespace {

using ::testing::HasSubstr;
using json = nlohmann::json;

checkpoint::FileSystem& Fs() { return checkpoint::PosixFileSystem(); }

std::string Fixture(const std::string& name) {
  return absl::StrCat("flatparam/interop/dcp/testdata/dcp/", name);
}

std::string TempDir(const std::string& name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  return absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/", name);
}

json ExpectedV2() {
  std::ifstream in(Fixture("expected.json"));
  std::stringstream s;
  s << in.rdbuf();
  return json::parse(s.str())["v2"];
}

ModelSpec FixtureModel() {
  ModelSpec m;
  m.name = "dcp-fixture";
  m.params = {{"embed.weight", {7, 3}},
              {"layers.0.weight", {5, 3}},
              {"layers.0.bias", {5}},
              {"head.weight", {}, DType::kFloat32, true, "embed.weight"}};
  m.wrap = {"layers.0"};
  return m;
}

// The fixture imported at 3 ranks (the bfloat16 bias cast to float32).
std::string ImportedFixture() {
  static const std::string* dir = [] {
    auto* out = new std::string(TempDir("imported"));
    DcpImportOptions options;
    options.hf.cast = true;
    LayoutOptions layout;
    layout.world_size = 3;
    // The fixture has no head.weight: the tie is the model's.
    ModelSpec spec = FixtureModel();
    EXPECT_THAT(
        ImportDcpCheckpoint(Fs(), Fixture("v2"), spec, layout, 3, *out, options)
            .status(),
        IsOk());
    return out;
  }();
  return *dir;
}

// Exported at 4 ranks in both layouts and read back: every value equals
// the fixture's, chunked on dim 0 as torch.chunk chunks it, with the tied
// name and the param group.
TEST(ExportDcpCheckpointTest, RoundTripsThroughTheReader) {
  const json want = ExpectedV2();
  for (const auto format : {DcpExportOptions::Format::kPyTorch2,
                            DcpExportOptions::Format::kPyTorch113}) {
    const bool v2 = format == DcpExportOptions::Format::kPyTorch2;
    SCOPED_TRACE(v2 ? "2.x" : "1.13");
    const std::string out = TempDir(v2 ? "out2" : "out113");
    DcpExportOptions options;
    options.format = format;
    options.world_size = 4;
    absl::StatusOr<DcpExportReport> report =
        ExportDcpCheckpoint(Fs(), ImportedFixture(), out, options);
    ASSERT_THAT(report, IsOk());
    EXPECT_TRUE(report->optimizer);
    // 3 weights + the tie + 3 x 3 optimizer states; param_groups.
    EXPECT_EQ(report->tensors, 13);
    EXPECT_EQ(report->bytes_items, 1);
    absl::StatusOr<DcpReader> dcp = DcpReader::Open(Fs(), out);
    ASSERT_THAT(dcp, IsOk());
    EXPECT_EQ(dcp->metadata().module,
              v2 ? "torch.distributed.checkpoint"
                 : "torch.distributed._shard.checkpoint");
    EXPECT_EQ(dcp->metadata().version, v2 ? "1.0.0" : "");
    for (const auto& [key, w] : want.items()) {
      SCOPED_TRACE(key);
      if (w.contains("bytes")) {
        absl::StatusOr<json> groups = dcp->ReadBytes(key);
        ASSERT_THAT(groups, IsOk());
        EXPECT_EQ((*groups)[0]["params"], w["bytes"][0]["params"]);
        EXPECT_EQ((*groups)[0]["lr"], w["bytes"][0]["lr"]);
        EXPECT_EQ((*groups)[0]["betas"], w["bytes"][0]["betas"]);
        continue;
      }
      absl::StatusOr<HostTensor> t = dcp->ReadTensor(key);
      ASSERT_THAT(t, IsOk());
      EXPECT_EQ(t->shape(), w["shape"].get<std::vector<int64_t>>());
      const std::vector<double> values = w["values"].get<std::vector<double>>();
      ASSERT_EQ(t->numel(), static_cast<int64_t>(values.size()));
      for (int64_t i = 0; i < t->numel(); ++i) {
        ASSERT_EQ(t->GetDouble(i), values[i]) << "element " << i;
      }
    }
    // torch.chunk of 7 rows over 4 ranks: 2, 2, 2, 1; of 5 rows: 2, 2, 1.
    const DcpEntry& embed = dcp->metadata().entries.at("model.embed.weight");
    ASSERT_EQ(embed.chunks.size(), 4);
    EXPECT_EQ(embed.chunks[3].sizes, (std::vector<int64_t>{1, 3}));
    EXPECT_EQ(embed.chunks[3].storage.file, "__3_0.distcp");
    EXPECT_EQ(dcp->metadata().entries.at("model.layers.0.weight").chunks.size(),
              3);
    // The tie is written as state_dict() holds it.
    absl::StatusOr<HostTensor> head = dcp->ReadTensor("model.head.weight");
    absl::StatusOr<HostTensor> target = dcp->ReadTensor("model.embed.weight");
    ASSERT_THAT(head, IsOk());
    ASSERT_THAT(target, IsOk());
    EXPECT_TRUE(*head == *target);
  }
}

TEST(ExportDcpCheckpointTest, RefusesBadArguments) {
  DcpExportOptions options;
  options.world_size = 0;
  EXPECT_THAT(
      ExportDcpCheckpoint(Fs(), ImportedFixture(), TempDir("x"), options),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("DCP world size 0")));
  options.world_size = 2;
  const std::string out = TempDir("exists");
  ASSERT_THAT(ExportDcpCheckpoint(Fs(), ImportedFixture(), out, options),
              IsOk());
  EXPECT_THAT(
      ExportDcpCheckpoint(Fs(), ImportedFixture(), out, options),
      StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("exists")));
  EXPECT_THAT(
      ExportDcpCheckpoint(Fs(), ImportedFixture(), ImportedFixture(), options),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("is or holds the input")));
  options.convert.overwrite = true;
  EXPECT_THAT(ExportDcpCheckpoint(Fs(), ImportedFixture(), out, options),
              IsOk());
}

}  // namespace
}  // namespace libtorch
}  // namespace flatparam
