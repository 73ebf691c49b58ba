#include "flatparam/interop/dcp/dcp.h"

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
#include "flatparam/checkpoint/convert.h"
#include "flatparam/checkpoint/safetensors.h"
#include "nlohmann/json.hpp"

namespace flatparam {
namespace libtorch {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;
using json = nlohmann::json;

checkpoint::FileSystem& Fs() { return checkpoint::PosixFileSystem(); }

std::string Fixture(const std::string& name) {
  return absl::StrCat("flatparam/interop/dcp/testdata/dcp/", name);
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

// `t` has expected.json's shape and values (exact doubles) for it.
void ExpectValues(const HostTensor& t, const json& want) {
  EXPECT_EQ(t.shape(), want["shape"].get<std::vector<int64_t>>());
  const std::vector<double> values = want["values"].get<std::vector<double>>();
  ASSERT_EQ(t.numel(), static_cast<int64_t>(values.size()));
  for (int64_t i = 0; i < t.numel(); ++i) {
    const double got = t.dtype() == DType::kInt64
                           ? static_cast<double>(t.data_as<int64_t>()[i])
                           : t.GetDouble(i);
    ASSERT_EQ(got, values[i]) << "element " << i;
  }
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
    ExpectValues(*t, want);
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

// A box across chunks (rows 1-3 of a tensor chunked 2, 2, 1 by 4 ranks;
// columns 1-2) equals that slice of Python's tensor.
TEST(DcpReaderTest, ReadBoxAssemblesTheChunksItMeets) {
  absl::StatusOr<DcpReader> dcp = DcpReader::Open(Fs(), Fixture("w4"));
  ASSERT_THAT(dcp, IsOk());
  absl::StatusOr<HostTensor> box =
      dcp->ReadBox("layers.0.weight", {1, 1}, {3, 2});
  ASSERT_THAT(box, IsOk());
  ASSERT_EQ(box->shape(), (std::vector<int64_t>{3, 2}));
  const std::vector<double> all =
      Expected()["v1"]["layers.0.weight"]["values"].get<std::vector<double>>();
  for (int64_t r = 0; r < 3; ++r) {
    for (int64_t c = 0; c < 2; ++c) {
      EXPECT_EQ(box->GetDouble(r * 2 + c), all[(1 + r) * 3 + 1 + c])
          << r << "," << c;
    }
  }
  // An empty box, and a 0-d tensor's one element.
  EXPECT_THAT(dcp->ReadBox("layers.0.weight", {5, 0}, {0, 3}), IsOk());
  EXPECT_THAT(dcp->ReadBox("layers.0.weight", {4, 0}, {2, 3}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("no box at [4, 0] of sizes [2, 3]")));
  EXPECT_THAT(
      dcp->ReadBox("step", {}, {}),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("a bytes item")));
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
      {"claims_more", absl::StatusCode::kDataLoss,
       "w: a chunk at [0, 0] of sizes [524288, 2] (float32) is stored in"},
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
  // Items serialized as safetensors: refused, saying how to save.
  absl::StatusOr<DcpReader> st =
      DcpReader::Open(Fs(), Fixture("bad/safetensors"));
  ASSERT_THAT(st, IsOk());
  EXPECT_THAT(st->ReadTensor("w"),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("serialization_format=SAFETENSORS")));
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

std::string TempDir(const std::string& name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  return absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/", name);
}

// The fixtures' model: float32 weights (the bfloat16 bias is cast), the
// int64 "count" of the 1.13 fixtures a buffer.
ModelSpec FixtureModel(bool with_count) {
  ModelSpec m;
  m.name = "dcp-fixture";
  m.params = {{"embed.weight", {7, 3}},
              {"layers.0.weight", {5, 3}},
              {"layers.0.bias", {5}}};
  m.wrap = {"layers.0"};
  if (with_count) m.buffers = {{"count", {3}, DType::kInt64}};
  return m;
}

LayoutOptions Layout(int64_t world_size) {
  LayoutOptions o;
  o.world_size = world_size;
  return o;
}

void ExpectTensor(const checkpoint::SafetensorsReader& file,
                  const std::string& name, const json& want) {
  SCOPED_TRACE(name);
  absl::StatusOr<HostTensor> t = file.ReadHostTensor(name);
  ASSERT_THAT(t, IsOk());
  ExpectValues(*t, want);
}

// The 2.x layout's model and AdamW state, imported at 3 ranks and
// consolidated: every value equals what Python saved, bit for bit, and the
// param group carries over.
TEST(ImportDcpCheckpointTest, ModelAndOptimizerOfThe2LayoutAtThreeRanks) {
  const std::string out = TempDir("v2_w3");
  DcpImportOptions options;
  options.hf.cast = true;
  absl::StatusOr<checkpoint::HfImportReport> report = ImportDcpCheckpoint(
      Fs(), Fixture("v2"), FixtureModel(false), Layout(3), 3, out, options);
  ASSERT_THAT(report, IsOk());
  EXPECT_EQ(report->imported, 3);
  EXPECT_EQ(report->cast, 1);
  EXPECT_TRUE(report->optimizer);
  EXPECT_EQ(report->optimizer_params, 3);
  EXPECT_EQ(report->optimizer_groups, 1);
  ASSERT_THAT(checkpoint::ConsolidateCheckpoint(Fs(), out, out + "_full"),
              IsOk());
  absl::StatusOr<checkpoint::FullCheckpointReader> full =
      checkpoint::FullCheckpointReader::Open(Fs(), out + "_full");
  ASSERT_THAT(full, IsOk());
  const json& want = Expected()["v2"];
  for (const char* fqn : {"embed.weight", "layers.0.weight", "layers.0.bias"}) {
    ExpectTensor(full->model(), fqn, want[absl::StrCat("model.", fqn)]);
    for (const char* state : {"exp_avg", "exp_avg_sq", "step"}) {
      ExpectTensor(full->optim(), absl::StrCat("state.", fqn, ".", state),
                   want[absl::StrCat("optim.state.", fqn, ".", state)]);
    }
  }
  ASSERT_TRUE(full->optim_json().contains("param_groups"))
      << full->optim_json().dump();
  const json& groups = full->optim_json()["param_groups"];
  ASSERT_EQ(groups.size(), 1) << full->optim_json().dump();
  EXPECT_EQ(groups[0].value("hyperparams", json()).value("lr", json()),
            json({{"float", 0.01}}))
      << groups.dump();
  EXPECT_EQ(groups[0].value("hyperparams", json()).value("betas", json()),
            json({{"floats", {0.9, 0.999}}}));
  EXPECT_EQ(groups[0].value("params", json()),
            json({"embed.weight", "layers.0.weight", "layers.0.bias"}));
}

// torchtitan's layout: model keys at the top level, the optimizer under
// "optimizer." with flattened param groups (the embedding without weight
// decay: two groups), other states as bytes items. The prefixes are found.
TEST(ImportDcpCheckpointTest, TorchtitanLayoutWithFlattenedParamGroups) {
  const std::string out = TempDir("titan_w2");
  absl::StatusOr<checkpoint::HfImportReport> report = ImportDcpCheckpoint(
      Fs(), Fixture("titan"), FixtureModel(false), Layout(2), 2, out);
  ASSERT_THAT(report, IsOk());
  EXPECT_EQ(report->imported, 3);
  EXPECT_EQ(report->optimizer_params, 3);
  EXPECT_EQ(report->optimizer_groups, 2);
  ASSERT_THAT(checkpoint::ConsolidateCheckpoint(Fs(), out, out + "_full"),
              IsOk());
  absl::StatusOr<checkpoint::FullCheckpointReader> full =
      checkpoint::FullCheckpointReader::Open(Fs(), out + "_full");
  ASSERT_THAT(full, IsOk());
  const json& want = Expected()["titan"];
  for (const char* fqn : {"embed.weight", "layers.0.weight", "layers.0.bias"}) {
    ExpectTensor(full->model(), fqn, want[fqn]);
    for (const char* state : {"exp_avg", "exp_avg_sq", "step"}) {
      ExpectTensor(full->optim(), absl::StrCat("state.", fqn, ".", state),
                   want[absl::StrCat("optimizer.state.", fqn, ".", state)]);
    }
  }
  const json& groups = full->optim_json()["param_groups"];
  ASSERT_EQ(groups.size(), 2) << groups.dump();
  EXPECT_EQ(groups[0]["params"], json({"embed.weight"}));
  EXPECT_EQ(groups[0]["hyperparams"]["weight_decay"], json({{"float", 0.0}}));
  EXPECT_EQ(groups[1]["params"], json({"layers.0.weight", "layers.0.bias"}));
  EXPECT_EQ(groups[1]["hyperparams"]["weight_decay"], json({{"float", 0.01}}));
  // Naming a prefix that holds nothing of the model: a clear error.
  DcpImportOptions wrong;
  wrong.model_prefix = "model.";
  EXPECT_THAT(
      ImportDcpCheckpoint(Fs(), Fixture("titan"), FixtureModel(false),
                          Layout(2), 2, TempDir("titan_wrong"), wrong),
      StatusIs(absl::StatusCode::kFailedPrecondition,
               HasSubstr("no tensor under the model prefix \"model.\"")));
}

// PyTorch 1.13's checkpoints (keys at the top level, no optimizer), saved
// by 2 and 4 ranks, imported at 3: the weights and the buffer equal
// Python's.
TEST(ImportDcpCheckpointTest, WeightsOfPyTorch113CheckpointsAtThreeRanks) {
  for (const char* dir : {"w2", "w4"}) {
    SCOPED_TRACE(dir);
    const std::string out = TempDir(absl::StrCat(dir, "_w3"));
    DcpImportOptions options;
    options.hf.cast = true;
    absl::StatusOr<checkpoint::HfImportReport> report = ImportDcpCheckpoint(
        Fs(), Fixture(dir), FixtureModel(true), Layout(3), 3, out, options);
    ASSERT_THAT(report, IsOk());
    EXPECT_FALSE(report->optimizer);
    ASSERT_THAT(checkpoint::ConsolidateCheckpoint(Fs(), out, out + "_full"),
                IsOk());
    absl::StatusOr<checkpoint::FullCheckpointReader> full =
        checkpoint::FullCheckpointReader::Open(Fs(), out + "_full");
    ASSERT_THAT(full, IsOk());
    for (const char* fqn :
         {"embed.weight", "layers.0.weight", "layers.0.bias", "count"}) {
      ExpectTensor(full->model(), fqn, Expected()["v1"][fqn]);
    }
  }
}

// What does not fit the model is refused before anything is written,
// naming the user's directory, not the staged files.
TEST(ImportDcpCheckpointTest, AMismatchIsRefusedNamingTheCheckpoint) {
  const std::string out = TempDir("mismatch");
  ModelSpec wrong = FixtureModel(false);
  wrong.params[0].shape = {7, 4};
  DcpImportOptions options;
  options.hf.cast = true;
  absl::StatusOr<checkpoint::HfImportReport> report = ImportDcpCheckpoint(
      Fs(), Fixture("v2"), wrong, Layout(2), 2, out, options);
  EXPECT_THAT(report, StatusIs(absl::StatusCode::kFailedPrecondition,
                               AllOf(HasSubstr(Fixture("v2")),
                                     HasSubstr("embed.weight"),
                                     Not(HasSubstr(".tmp")))));
  EXPECT_THAT(Fs().Exists(out), IsOkAndHolds(false));
  // Without the cast, the bfloat16 bias is named.
  EXPECT_THAT(ImportDcpCheckpoint(Fs(), Fixture("v2"), FixtureModel(false),
                                  Layout(2), 2, out),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("layers.0.bias")));
  EXPECT_THAT(Fs().Exists(out), IsOkAndHolds(false));
}

}  // namespace
}  // namespace libtorch
}  // namespace flatparam
