// Import and export of Hugging Face checkpoints: against the conversions
// they must agree with bit for bit (ShardCheckpoint, ConsolidateCheckpoint),
// every validation with its message, casts, shard splitting, and the
// published Llama layouts checked at full scale on a file system of
// headers. The files as an independent reader sees them are
// //tools:hf_cli_test's (numpy).
#include "flatparam/interop/hf/hf_checkpoint.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "flatparam/base/dtype.h"
#include "flatparam/base/status_matchers.h"
#include "flatparam/checkpoint/checkpoint_dir.h"
#include "flatparam/checkpoint/convert.h"
#include "flatparam/checkpoint/file_system.h"
#include "flatparam/checkpoint/internal/checkpoint_testutil.h"
#include "flatparam/checkpoint/manifest.h"
#include "flatparam/checkpoint/safetensors.h"
#include "flatparam/checkpoint/training_state.h"
#include "flatparam/flatten.h"
#include "flatparam/layout.h"
#include "flatparam/model_layout.h"
#include "flatparam/optim/optim_state.h"
#include "flatparam/presets.h"

namespace flatparam {
namespace checkpoint {
namespace {

using json = nlohmann::json;
using internal_checkpoint::SplitIntoShards;
using optim::BitwiseEqual;
using optim::HyperValue;
using optim::OptimStateDict;
using optim::ParamGroup;
using optim::ParamKey;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;

constexpr auto kInvalid = absl::StatusCode::kInvalidArgument;
constexpr auto kMismatch = absl::StatusCode::kFailedPrecondition;
constexpr auto kDataLoss = absl::StatusCode::kDataLoss;
constexpr auto kNotFound = absl::StatusCode::kNotFound;

// A named tensor to write.
struct Named {
  std::string name;
  HostTensor tensor;
};

absl::Status WriteFile(FileSystem& fs, const std::string& path,
                       const std::vector<Named>& tensors,
                       const std::map<std::string, std::string>& metadata = {
                           {"format", "pt"}}) {
  std::vector<TensorSource> sources;
  for (const Named& t : tensors) {
    sources.push_back(TensorSourceFromHostTensor(t.name, t.tensor));
  }
  FLATPARAM_ASSIGN_OR_RETURN(std::unique_ptr<WritableFile> f,
                             fs.NewWritableFile(path));
  FLATPARAM_RETURN_IF_ERROR(WriteSafetensors(*f, path, sources, metadata));
  return f->Close();
}

void WriteText(FileSystem& fs, const std::string& path,
               const std::string& text) {
  FLATPARAM_ASSERT_OK(WriteFileDurably(fs, path, text));
}

void MakeDir(FileSystem& fs, const std::string& path) {
  FLATPARAM_ASSERT_OK(fs.CreateDir(path));
}

// The untied parameters of `spec` with distinct values, in spec order.
std::vector<Named> Weights(const ModelSpec& spec, DType dtype, int seed = 0) {
  std::vector<Named> out;
  int index = 0;
  for (const ParamSpec& p : spec.params) {
    if (!p.tied_to.empty()) continue;
    HostTensor t(dtype, p.shape);
    for (int64_t i = 0; i < t.numel(); ++i) {
      t.SetDouble(i, seed * 1000 + index * 100 + i + 0.25);
    }
    out.push_back({p.fqn, std::move(t)});
    ++index;
  }
  return out;
}

// A full checkpoint of `weights` (no optimizer state) at `dir`.
void WriteFull(FileSystem& fs, const std::string& dir,
               const std::vector<Named>& weights) {
  FullCheckpointContent content;
  for (const Named& w : weights) {
    content.model.push_back(TensorSourceFromHostTensor(w.name, w.tensor));
  }
  content.optim_json = {{"format", "flatparam.optim.v1"},
                        {"param_groups", json::array()},
                        {"state", json::array()}};
  FLATPARAM_ASSERT_OK(WriteFullCheckpoint(fs, dir, content));
}

std::string IndexJson(const std::map<std::string, std::string>& weight_map,
                      std::optional<uint64_t> total_size) {
  json doc = {{"weight_map", weight_map}};
  if (total_size.has_value()) doc["metadata"] = {{"total_size", *total_size}};
  return doc.dump(2);
}

uint64_t Bytes(const std::vector<Named>& tensors) {
  uint64_t n = 0;
  for (const Named& t : tensors) n += t.tensor.nbytes();
  return n;
}

TEST(HfCheckpointTest, CleanTensorNameIsPyTorchs) {
  EXPECT_EQ(CleanTensorName("layers.0.w"), "layers.0.w");
  EXPECT_EQ(CleanTensorName("_fsdp_wrapped_module.layers.0."
                            "_fsdp_wrapped_module.w"),
            "layers.0.w");
  EXPECT_EQ(CleanTensorName("_fsdp_wrapped_module.layers.0."
                            "_checkpoint_wrapped_module.mlp.w"),
            "layers.0.mlp.w");
  EXPECT_EQ(CleanTensorName("_orig_mod.model.norm.weight"),
            "model.norm.weight");
  EXPECT_EQ(CleanTensorName("a._orig_mod._fsdp_wrapped_module.b"), "a.b");
  // str.replace semantics: a substring anywhere, not only whole components.
  EXPECT_EQ(CleanTensorName("x_fsdp_wrapped_module.y"), "xy");
  // _orig_mod only as a whole component.
  EXPECT_EQ(CleanTensorName("my_orig_mod.w"), "my_orig_mod.w");
}

TEST(HfCheckpointTest, ParseByteSizeFollowsHuggingFaceUnits) {
  EXPECT_THAT(ParseByteSize("5GB"), IsOkAndHolds(uint64_t{5'000'000'000}));
  EXPECT_THAT(ParseByteSize("500MB"), IsOkAndHolds(uint64_t{500'000'000}));
  EXPECT_THAT(ParseByteSize("500mB"), IsOkAndHolds(uint64_t{500'000'000}));
  EXPECT_THAT(ParseByteSize("2GiB"), IsOkAndHolds(uint64_t{2} << 30));
  EXPECT_THAT(ParseByteSize("10KiB"), IsOkAndHolds(uint64_t{10240}));
  EXPECT_THAT(ParseByteSize("1TB"), IsOkAndHolds(uint64_t{1'000'000'000'000}));
  EXPECT_THAT(ParseByteSize("1234"), IsOkAndHolds(uint64_t{1234}));
  EXPECT_THAT(ParseByteSize("1234B"), IsOkAndHolds(uint64_t{1234}));
  for (const char* bad : {"", "GB", "5Gb", "5mb", "1.5GB", "5 GB", "-1", "0",
                          "0GB", "5PB", "99999999999999999999", "20000000TB"}) {
    EXPECT_THAT(ParseByteSize(bad), StatusIs(kInvalid, HasSubstr("not a size")))
        << bad;
  }
}

TEST(HfCheckpointTest, SplitIntoShardsIsHuggingFaceHubs) {
  // Fits: one file.
  EXPECT_THAT(SplitIntoShards({10, 20, 30}, 100),
              ElementsAre(ElementsAre(0, 1, 2)));
  // A tensor that would overflow starts the next file; exactly the cap fits.
  EXPECT_THAT(
      SplitIntoShards({60, 40, 50, 50, 1}, 100),
      ElementsAre(ElementsAre(0, 1), ElementsAre(2, 3), ElementsAre(4)));
  // A tensor over the cap gets a file of its own, listed when it is met;
  // the current file goes on filling.
  EXPECT_THAT(SplitIntoShards({30, 150, 40, 200, 50}, 100),
              ElementsAre(ElementsAre(1), ElementsAre(3), ElementsAre(0, 2),
                          ElementsAre(4)));
  EXPECT_THAT(SplitIntoShards({}, 100), ElementsAre());
  EXPECT_THAT(SplitIntoShards({0, 0}, 1), ElementsAre(ElementsAre(0, 1)));
}

// A single model.safetensors imports into exactly what ShardCheckpoint
// writes from a full checkpoint holding the same file, for several layouts.
TEST(HfCheckpointTest, SingleFileImportEqualsShardOfAFullCheckpoint) {
  FaultInjectionFileSystem fs;
  const ModelSpec spec = TinyModelSpec();
  const std::vector<Named> weights = Weights(spec, DType::kFloat32);
  WriteFull(fs, "/full", weights);
  MakeDir(fs, "/hf");
  FLATPARAM_ASSERT_OK(
      WriteFile(fs, "/hf/model.safetensors", weights, /*metadata=*/{}));
  const std::vector<std::pair<LayoutOptions, int64_t>> layouts = {
      {TestLayoutOptions(1), 0},
      {TestLayoutOptions(3), 0},
      {TestLayoutOptions(4, ShardingStrategy::kFullShard, true), 0},
      {TestLayoutOptions(2, ShardingStrategy::kHybridShard), 6},
      {TestLayoutOptions(2, ShardingStrategy::kNoShard), 0},
  };
  for (size_t i = 0; i < layouts.size(); ++i) {
    SCOPED_TRACE(i);
    const auto& [options, world] = layouts[i];
    FLATPARAM_ASSERT_OK(ShardCheckpoint(fs, "/full", spec, options, world,
                                        absl::StrCat("/ref", i)));
    FLATPARAM_ASSERT_OK_AND_ASSIGN(
        HfImportReport report,
        ImportHfCheckpoint(fs, "/hf", spec, options, world,
                           absl::StrCat("/imp", i)));
    EXPECT_EQ(report.files, 1);
    EXPECT_EQ(report.imported, 6);
    EXPECT_EQ(report.tied_copies, 0);
    ExpectSameDirectory(fs, absl::StrCat("/ref", i), absl::StrCat("/imp", i));
    EXPECT_THAT(VerifyCheckpoint(fs, absl::StrCat("/imp", i)), IsOk());
  }
  // The file's path works as well as its directory.
  FLATPARAM_ASSERT_OK(ImportHfCheckpoint(fs, "/hf/model.safetensors", spec,
                                         TestLayoutOptions(3), 0, "/imp_file")
                          .status());
  ExpectSameDirectory(fs, "/ref1", "/imp_file");
}

// The same weights spread over an index, under wrapper-prefixed names, with
// the tied parameter repeated and a rotary buffer: the same result.
TEST(HfCheckpointTest, IndexShardedImportWithWrappersTiesAndBuffers) {
  FaultInjectionFileSystem fs;
  const ModelSpec spec = TinyModelSpec();
  const std::vector<Named> weights = Weights(spec, DType::kFloat32);
  WriteFull(fs, "/full", weights);
  FLATPARAM_ASSERT_OK(
      ShardCheckpoint(fs, "/full", spec, TestLayoutOptions(3), 0, "/ref"));

  std::vector<Named> one, two;
  for (const Named& w : weights) {
    const std::string name =
        absl::StrCat("_orig_mod._fsdp_wrapped_module.", w.name);
    (one.size() < 3 ? one : two).push_back({name, w.tensor});
  }
  // head.weight, tied to emb.weight, repeated by the exporter.
  two.push_back({"head.weight", weights[0].tensor});
  HostTensor freq(DType::kFloat32, {4});
  two.push_back({"model.layers.0.self_attn.rotary_emb.inv_freq", freq});
  MakeDir(fs, "/hf");
  FLATPARAM_ASSERT_OK(
      WriteFile(fs, "/hf/model-00001-of-00002.safetensors", one));
  FLATPARAM_ASSERT_OK(
      WriteFile(fs, "/hf/model-00002-of-00002.safetensors", two));
  std::map<std::string, std::string> weight_map;
  for (const Named& t : one) {
    weight_map[t.name] = "model-00001-of-00002.safetensors";
  }
  for (const Named& t : two) {
    weight_map[t.name] = "model-00002-of-00002.safetensors";
  }
  WriteText(fs, "/hf/model.safetensors.index.json",
            IndexJson(weight_map, Bytes(one) + Bytes(two)));
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      HfImportReport report,
      ImportHfCheckpoint(fs, "/hf", spec, TestLayoutOptions(3), 0, "/imp"));
  EXPECT_EQ(report.files, 2);
  EXPECT_EQ(report.imported, 6);
  EXPECT_EQ(report.tied_copies, 1);
  EXPECT_EQ(report.ignored, 1);
  ExpectSameDirectory(fs, "/ref", "/imp");

  // A checkpoint that lists only the tied copy: it is read in the target's
  // place.
  std::vector<Named> only_copy;
  for (const Named& w : weights) {
    only_copy.push_back(
        {w.name == "emb.weight" ? "head.weight" : w.name, w.tensor});
  }
  MakeDir(fs, "/hf2");
  FLATPARAM_ASSERT_OK(WriteFile(fs, "/hf2/model.safetensors", only_copy));
  FLATPARAM_ASSERT_OK(
      ImportHfCheckpoint(fs, "/hf2", spec, TestLayoutOptions(3), 0, "/imp2")
          .status());
  ExpectSameDirectory(fs, "/ref", "/imp2");
}

// Import -> reshard -> export gives the weights back bit for bit; export of
// a sharded checkpoint equals export of its consolidation.
TEST(HfCheckpointTest, ExportRoundTripsAndAgreesWithConsolidation) {
  FaultInjectionFileSystem fs;
  const ModelSpec spec = TinyModelSpec();
  const std::vector<Named> weights = Weights(spec, DType::kBFloat16);
  ModelSpec bf16 = spec;
  for (ParamSpec& p : bf16.params) p.dtype = DType::kBFloat16;
  MakeDir(fs, "/hf");
  FLATPARAM_ASSERT_OK(WriteFile(fs, "/hf/model.safetensors", weights));
  FLATPARAM_ASSERT_OK(
      ImportHfCheckpoint(fs, "/hf", bf16, TestLayoutOptions(4), 0, "/s4")
          .status());
  FLATPARAM_ASSERT_OK(ReshardCheckpoint(
      fs, "/s4", TestLayoutOptions(3, ShardingStrategy::kFullShard, true), 0,
      "/s3"));
  FLATPARAM_ASSERT_OK_AND_ASSIGN(HfExportReport report,
                                 ExportHfCheckpoint(fs, "/s3", "/out"));
  EXPECT_THAT(report.files, ElementsAre("model.safetensors"));
  EXPECT_EQ(report.tensors, 6);
  EXPECT_EQ(report.total_size, Bytes(weights));
  EXPECT_THAT(ListDir(fs, "/out"), ElementsAre("model.safetensors"));
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      SafetensorsReader out,
      SafetensorsReader::Open(fs, "/out/model.safetensors"));
  EXPECT_EQ(out.metadata(),
            (std::map<std::string, std::string>{{"format", "pt"}}));
  ASSERT_EQ(out.tensors().size(), weights.size());
  for (size_t i = 0; i < weights.size(); ++i) {
    // In the spec's order, each untied parameter once (head.weight is not
    // written: it is tied).
    EXPECT_EQ(out.tensors()[i].name, weights[i].name);
    FLATPARAM_ASSERT_OK_AND_ASSIGN(HostTensor t,
                                   out.ReadHostTensor(weights[i].name));
    EXPECT_TRUE(t == weights[i].tensor) << weights[i].name;
  }
  // Exporting the consolidated checkpoint writes the same bytes.
  FLATPARAM_ASSERT_OK(ConsolidateCheckpoint(fs, "/s3", "/full"));
  FLATPARAM_ASSERT_OK(ExportHfCheckpoint(fs, "/full", "/out_full").status());
  ExpectSameDirectory(fs, "/out", "/out_full");
  // And importing the export at the first layout gives the first checkpoint
  // back, byte for byte.
  FLATPARAM_ASSERT_OK(
      ImportHfCheckpoint(fs, "/out", bf16, TestLayoutOptions(4), 0, "/s4b")
          .status());
  ExpectSameDirectory(fs, "/s4", "/s4b");
}

TEST(HfCheckpointTest, ExportSplitsAtTensorBoundariesWithAnIndex) {
  FaultInjectionFileSystem fs;
  const ModelSpec spec = TinyModelSpec();
  const std::vector<Named> weights = Weights(spec, DType::kFloat32);
  // Bytes: emb 132, seq.0.weight 60, seq.0.bias 20, seq.2.weight 140,
  // seq.2.bias 28, norm.scale 4.
  WriteFull(fs, "/full", weights);
  HfExportOptions options;
  options.max_shard_bytes = 100;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      HfExportReport report, ExportHfCheckpoint(fs, "/full", "/out", options));
  // emb and seq.2.weight are over the cap: each gets a file of its own when
  // it is met, while the others fill files of at most 100 bytes in order.
  const std::vector<std::string> files = {
      "model-00001-of-00004.safetensors", "model-00002-of-00004.safetensors",
      "model-00003-of-00004.safetensors", "model-00004-of-00004.safetensors",
      kHfIndexFileName};
  EXPECT_EQ(report.files, files);
  EXPECT_EQ(ListDir(fs, "/out"), files);
  const std::vector<std::vector<std::string>> want = {
      {"emb.weight"},
      {"seq.2.weight"},
      {"seq.0.weight", "seq.0.bias"},
      {"seq.2.bias", "norm.scale"}};
  std::map<std::string, std::string> weight_map;
  for (size_t f = 0; f < want.size(); ++f) {
    FLATPARAM_ASSERT_OK_AND_ASSIGN(
        SafetensorsReader r,
        SafetensorsReader::Open(fs, JoinPath("/out", files[f])));
    EXPECT_EQ(r.metadata().at("format"), "pt");
    std::vector<std::string> names;
    for (const SafetensorsEntry& e : r.tensors()) {
      names.push_back(e.name);
      weight_map[e.name] = files[f];
    }
    EXPECT_EQ(names, want[f]) << files[f];
  }
  const json index =
      json::parse(ReadWholeFile(fs, JoinPath("/out", kHfIndexFileName)));
  EXPECT_EQ(index, json({{"metadata", {{"total_size", 384}}},
                         {"weight_map", weight_map}}));
  EXPECT_EQ(report.total_size, 384u);
  // What the export wrote imports back (index and all).
  FLATPARAM_ASSERT_OK(
      ShardCheckpoint(fs, "/full", spec, TestLayoutOptions(2), 0, "/ref"));
  FLATPARAM_ASSERT_OK(
      ImportHfCheckpoint(fs, "/out", spec, TestLayoutOptions(2), 0, "/imp")
          .status());
  ExpectSameDirectory(fs, "/ref", "/imp");
  // No manifest: an export is not a flatparam checkpoint. Writing again
  // replaces it whole.
  options.max_shard_bytes = 1000;
  FLATPARAM_ASSERT_OK(
      ExportHfCheckpoint(fs, "/full", "/out", options).status());
  EXPECT_THAT(ListDir(fs, "/out"), ElementsAre("model.safetensors"));
}

// Published files saved from another class than the model's (gpt2's, from
// the bare GPT2Model: no "transformer." prefix, plus attn.bias buffers)
// import with a prefix added and the buffers ignored.
TEST(HfCheckpointTest, NameOptionsRenameBeforeMatching) {
  FaultInjectionFileSystem fs;
  ModelSpec spec;
  spec.name = "gpt2ish";
  spec.params = {{"transformer.wte.weight", {4, 2}},
                 {"transformer.h.0.attn.c_attn.bias", {6}},
                 {"lm_head.weight", {4, 2}}};
  spec.params[2].tied_to = "transformer.wte.weight";
  std::vector<Named> bare;
  for (const Named& w : Weights(spec, DType::kFloat32)) {
    bare.push_back(
        {std::string(absl::StripPrefix(w.name, "transformer.")), w.tensor});
  }
  bare.push_back({"h.0.attn.bias", HostTensor(DType::kFloat32, {1, 1, 2, 2})});
  MakeDir(fs, "/hf");
  FLATPARAM_ASSERT_OK(WriteFile(fs, "/hf/model.safetensors", bare));
  EXPECT_THAT(
      ImportHfCheckpoint(fs, "/hf", spec, TestLayoutOptions(2), 0, "/x"),
      StatusIs(kMismatch, HasSubstr("unexpected tensor 'wte.weight'")));
  HfImportOptions options;
  options.names.add_prefix = "transformer.";
  options.ignored_suffixes.push_back(".attn.bias");
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      HfImportReport report,
      ImportHfCheckpoint(fs, "/hf", spec, TestLayoutOptions(2), 0, "/s",
                         options));
  EXPECT_EQ(report.imported, 2);
  EXPECT_EQ(report.ignored, 1);
  // The same as the files with the model's names.
  std::vector<Named> named = Weights(spec, DType::kFloat32);
  MakeDir(fs, "/hf2");
  FLATPARAM_ASSERT_OK(WriteFile(fs, "/hf2/model.safetensors", named));
  FLATPARAM_ASSERT_OK(
      ImportHfCheckpoint(fs, "/hf2", spec, TestLayoutOptions(2), 0, "/ref")
          .status());
  ExpectSameDirectory(fs, "/ref", "/s");
  // Stripping goes first, and leaves names without the prefix alone.
  HfNameOptions swap;
  swap.strip_prefix = "h.";
  swap.add_prefix = "x.";
  FLATPARAM_ASSERT_OK_AND_ASSIGN(HfCheckpointReader r,
                                 HfCheckpointReader::Open(fs, "/hf", swap));
  EXPECT_EQ(r.tensors().count("x.0.attn.c_attn.bias"), 1u);
  EXPECT_EQ(r.tensors().count("x.wte.weight"), 1u);
  EXPECT_EQ(r.tensors().at("x.wte.weight").stored_name, "wte.weight");
}

// Which of `versions` the Hugging Face checkpoint at `dir` holds: its
// index + 1, 0 when it does not open, -1 for a mix (or anything else).
int WhichWeights(FileSystem& fs, const std::string& dir,
                 const std::vector<std::vector<Named>>& versions) {
  absl::StatusOr<HfCheckpointReader> r = HfCheckpointReader::Open(fs, dir);
  if (!r.ok()) return 0;
  for (size_t v = 0; v < versions.size(); ++v) {
    bool same = r->tensors().size() == versions[v].size();
    for (const Named& w : versions[v]) {
      auto it = r->tensors().find(w.name);
      if (!same || it == r->tensors().end() ||
          it->second.nbytes != w.tensor.nbytes()) {
        same = false;
        break;
      }
      std::string bytes(w.tensor.nbytes(), '\0');
      same = r->ReadRange(it->second, 0, absl::MakeSpan(bytes)).ok() &&
             std::memcmp(bytes.data(), w.tensor.data(), bytes.size()) == 0;
    }
    if (same) return static_cast<int>(v) + 1;
  }
  return -1;
}

// No export deletes or replaces a file it did not write, unless told to;
// told to (overwrite), it keeps every file but the previous export's and
// the same-named ones, and says which it replaced and kept.
TEST(HfCheckpointTest, ExportOverwriteKeepsOtherFilesAndSaysWhatItReplaced) {
  FaultInjectionFileSystem fs;
  const ModelSpec spec = TinyModelSpec();
  const std::vector<Named> old_weights = Weights(spec, DType::kFloat32, 1);
  const std::vector<Named> new_weights = Weights(spec, DType::kFloat32, 2);
  WriteFull(fs, "/old", old_weights);
  WriteFull(fs, "/new", new_weights);
  // A download: the old weights in 4 shards with an index, and the model's
  // other files.
  HfExportOptions sharded;
  sharded.max_shard_bytes = 100;
  FLATPARAM_ASSERT_OK(ExportHfCheckpoint(fs, "/old", "/dl", sharded).status());
  WriteText(fs, "/dl/README.md", "# the model card");
  WriteText(fs, "/dl/config.json", "{\"model_type\": \"tiny\"}");
  const std::vector<std::string> shards = {
      "model-00001-of-00004.safetensors", "model-00002-of-00004.safetensors",
      "model-00003-of-00004.safetensors", "model-00004-of-00004.safetensors",
      kHfIndexFileName};

  // Refused without overwrite, naming the files and the way out; nothing
  // changes.
  EXPECT_THAT(
      ExportHfCheckpoint(fs, "/new", "/dl"),
      StatusIs(kMismatch, AllOf(HasSubstr("/dl holds 2 files that no Hugging "
                                          "Face export written here has: "
                                          "README.md, config.json"),
                                HasSubstr("--overwrite"))));
  EXPECT_EQ(WhichWeights(fs, "/dl", {old_weights, new_weights}), 1);

  // With overwrite: the previous export's files are replaced (a single
  // file now), the others kept byte for byte.
  DirWriteOutcome outcome;
  HfExportOptions overwrite;
  overwrite.convert.overwrite = true;
  overwrite.convert.outcome = &outcome;
  FLATPARAM_ASSERT_OK(
      ExportHfCheckpoint(fs, "/new", "/dl", overwrite).status());
  EXPECT_THAT(ListDir(fs, "/dl"),
              ElementsAre("README.md", "config.json", "model.safetensors"));
  EXPECT_EQ(WhichWeights(fs, "/dl", {old_weights, new_weights}), 2);
  EXPECT_EQ(ReadWholeFile(fs, "/dl/README.md"), "# the model card");
  EXPECT_EQ(ReadWholeFile(fs, "/dl/config.json"), "{\"model_type\": \"tiny\"}");
  EXPECT_EQ(outcome.dir, "/dl");
  EXPECT_EQ(outcome.replaced, shards);
  EXPECT_THAT(outcome.kept, ElementsAre("README.md", "config.json"));
  // No temporary directory is left behind.
  EXPECT_THAT(ListDir(fs, "/"), ElementsAre("dl", "new", "old"));

  // --copy-from brings the original's config and tokenizer along; a
  // different config.json already there is replaced (and said so).
  MakeDir(fs, "/orig");
  WriteText(fs, "/orig/config.json", "{\"model_type\": \"llama\"}");
  WriteText(fs, "/orig/tokenizer.json", "{\"version\": \"1.0\"}");
  WriteText(fs, "/orig/model.safetensors", "not copied");
  HfExportOptions copy = overwrite;
  copy.copy_from = "/orig";
  FLATPARAM_ASSERT_OK_AND_ASSIGN(HfExportReport report,
                                 ExportHfCheckpoint(fs, "/old", "/dl", copy));
  EXPECT_THAT(report.copied, ElementsAre("config.json", "tokenizer.json"));
  EXPECT_THAT(ListDir(fs, "/dl"),
              ElementsAre("README.md", "config.json", "model.safetensors",
                          "tokenizer.json"));
  EXPECT_EQ(ReadWholeFile(fs, "/dl/config.json"),
            "{\"model_type\": \"llama\"}");
  EXPECT_EQ(WhichWeights(fs, "/dl", {old_weights, new_weights}), 1);
  EXPECT_THAT(outcome.replaced,
              ElementsAre("config.json", "model.safetensors"));
  EXPECT_THAT(outcome.kept, ElementsAre("README.md"));
}

TEST(HfCheckpointTest, ExportCopyFromMakesALoadableDirectory) {
  FaultInjectionFileSystem fs;
  const ModelSpec spec = TinyModelSpec();
  const std::vector<Named> weights = Weights(spec, DType::kFloat32);
  WriteFull(fs, "/full", weights);
  MakeDir(fs, "/orig");
  WriteText(fs, "/orig/config.json", "{\"model_type\": \"llama\"}");
  WriteText(fs, "/orig/generation_config.json", "{}");
  WriteText(fs, "/orig/tokenizer.model", std::string("\0\1spm", 5));
  WriteText(fs, "/orig/optimizer.pt", "not copied");
  HfExportOptions copy;
  copy.copy_from = "/orig";
  FLATPARAM_ASSERT_OK_AND_ASSIGN(HfExportReport report,
                                 ExportHfCheckpoint(fs, "/full", "/out", copy));
  EXPECT_THAT(
      report.copied,
      ElementsAre("config.json", "generation_config.json", "tokenizer.model"));
  EXPECT_THAT(ListDir(fs, "/out"),
              ElementsAre("config.json", "generation_config.json",
                          "model.safetensors", "tokenizer.model"));
  EXPECT_EQ(ReadWholeFile(fs, "/out/tokenizer.model"),
            std::string("\0\1spm", 5));
  EXPECT_EQ(WhichWeights(fs, "/out", {weights}), 1);
  // Exporting again with the same files needs no overwrite: the copied
  // files there are exactly what it writes.
  FLATPARAM_ASSERT_OK(ExportHfCheckpoint(fs, "/full", "/out", copy).status());
  // A config.json edited since is the user's: refused, and kept.
  WriteText(fs, "/out/config.json", "{\"model_type\": \"edited\"}");
  EXPECT_THAT(ExportHfCheckpoint(fs, "/full", "/out", copy),
              StatusIs(kMismatch, HasSubstr("holds a file that no Hugging "
                                            "Face export written here has: "
                                            "config.json")));
  EXPECT_EQ(ReadWholeFile(fs, "/out/config.json"),
            "{\"model_type\": \"edited\"}");
  // A directory with none of the files is a mistake, said before writing.
  MakeDir(fs, "/empty");
  EXPECT_THAT(
      ExportHfCheckpoint(
          fs, "/full", "/out2",
          HfExportOptions{{}, kHfDefaultMaxShardBytes, std::nullopt, "/empty"}),
      StatusIs(kInvalid, HasSubstr("/empty holds none of the files "
                                   "it copies (config.json, ")));
  EXPECT_FALSE(*fs.Exists("/out2"));
}

// An overwrite is not atomic, but a crash at any point of it (each
// mutating operation failing, then a power cut, then a partial loss) leaves
// the directory
// holding the old weights, the new ones, or nothing that opens: never a
// mix that opens. The other files always survive.
TEST(HfCheckpointTest, CrashDuringAnOverwriteNeverLeavesAMixThatOpens) {
  const ModelSpec spec = TinyModelSpec();
  const std::vector<Named> old_weights = Weights(spec, DType::kFloat32, 1);
  const std::vector<Named> new_weights = Weights(spec, DType::kFloat32, 2);
  std::set<int> seen;
  for (const uint64_t old_cap : {uint64_t{100}, kHfDefaultMaxShardBytes}) {
    for (const uint64_t new_cap :
         {uint64_t{100}, uint64_t{150}, kHfDefaultMaxShardBytes}) {
      for (int64_t n = 0;; ++n) {
        FaultInjectionFileSystem fs;
        WriteFull(fs, "/old", old_weights);
        WriteFull(fs, "/new", new_weights);
        HfExportOptions first;
        first.max_shard_bytes = old_cap;
        FLATPARAM_ASSERT_OK(
            ExportHfCheckpoint(fs, "/old", "/dl", first).status());
        WriteText(fs, "/dl/README.md", "card");
        FLATPARAM_ASSERT_OK(fs.SyncDir("/dl"));
        HfExportOptions overwrite;
        overwrite.max_shard_bytes = new_cap;
        overwrite.convert.overwrite = true;
        fs.FailOperationsFrom(n);
        const absl::Status status =
            ExportHfCheckpoint(fs, "/new", "/dl", overwrite).status();
        const bool failed = fs.failed();
        // The process dies at the failure; then the power goes, losing what
        // was not synced; then a partial loss.
        for (int stop = 0; stop < 3; ++stop) {
          if (stop == 1) fs.Crash();
          if (stop == 2) fs.CrashKeepingSome(n);
          const int which = WhichWeights(fs, "/dl", {old_weights, new_weights});
          ASSERT_GE(which, 0) << "a mix opens after failing operation " << n
                              << " (stop " << stop << "):\n"
                              << fs.DebugString();
          if (status.ok()) {
            ASSERT_EQ(which, 2) << fs.DebugString();
          }
          ASSERT_EQ(ReadWholeFile(fs, "/dl/README.md"), "card");
          seen.insert(which);
        }
        // The next overwrite recovers and leaves no temporary directory.
        FLATPARAM_ASSERT_OK(
            ExportHfCheckpoint(fs, "/new", "/dl", overwrite).status());
        ASSERT_EQ(WhichWeights(fs, "/dl", {old_weights, new_weights}), 2);
        ASSERT_THAT(ListDir(fs, "/"), ElementsAre("dl", "new", "old"));
        if (!failed) break;
      }
    }
  }
  EXPECT_EQ(seen, (std::set<int>{0, 1, 2}));
}

// bf16 <-> float32 casts round to nearest even, both on import (--cast) and
// on export (--dtype).
TEST(HfCheckpointTest, CastsRoundToNearestEven) {
  FaultInjectionFileSystem fs;
  ModelSpec spec;
  spec.name = "one";
  spec.params = {{"w", {6}, DType::kBFloat16}};
  // 1 + 2^-8 is halfway between bf16 1 and 1 + 2^-7: ties to even (1);
  // 1 + 3 * 2^-8 ties up to 1 + 2^-6; 1 + 2^-8 + 2^-20 rounds up; 2^-130
  // stays a subnormal.
  const std::vector<float> values = {
      1.0f + 0x1p-8f, 1.0f + 3 * 0x1p-8f,     1.0f + 0x1p-8f + 0x1p-20f,
      -2.5f,          std::ldexp(1.0f, -130), 3e38f};
  HostTensor f32(DType::kFloat32, {6});
  std::memcpy(f32.data(), values.data(), sizeof(float) * values.size());
  MakeDir(fs, "/hf");
  FLATPARAM_ASSERT_OK(WriteFile(fs, "/hf/model.safetensors", {{"w", f32}}));

  EXPECT_THAT(
      ImportHfCheckpoint(fs, "/hf", spec, TestLayoutOptions(2), 0, "/x"),
      StatusIs(kMismatch,
               AllOf(HasSubstr("/hf/model.safetensors: tensor 'w' is "
                               "F32, the model's parameter 'w' is "
                               "bfloat16"),
                     HasSubstr("--cast"))));
  EXPECT_FALSE(*fs.Exists("/x"));
  HfImportOptions cast;
  cast.cast = true;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      HfImportReport report,
      ImportHfCheckpoint(fs, "/hf", spec, TestLayoutOptions(2), 0, "/s", cast));
  EXPECT_EQ(report.cast, 1);
  FLATPARAM_ASSERT_OK(ExportHfCheckpoint(fs, "/s", "/out").status());
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      SafetensorsReader r,
      SafetensorsReader::Open(fs, "/out/model.safetensors"));
  FLATPARAM_ASSERT_OK_AND_ASSIGN(HostTensor w, r.ReadHostTensor("w"));
  ASSERT_EQ(w.dtype(), DType::kBFloat16);
  const std::vector<uint16_t> want = {0x3f80, 0x3f82, 0x3f81,
                                      0xc020, 0x0008, 0x7f62};
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(w.data_as<uint16_t>()[i], want[i]) << i;
    EXPECT_EQ(w.data_as<uint16_t>()[i], FloatToBFloat16Bits(values[i])) << i;
  }
  // Export with --dtype=float32 widens exactly; --dtype=float16 rounds.
  HfExportOptions to_f32;
  to_f32.dtype = DType::kFloat32;
  FLATPARAM_ASSERT_OK(ExportHfCheckpoint(fs, "/s", "/out32", to_f32).status());
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      SafetensorsReader r32,
      SafetensorsReader::Open(fs, "/out32/model.safetensors"));
  FLATPARAM_ASSERT_OK_AND_ASSIGN(HostTensor w32, r32.ReadHostTensor("w"));
  ASSERT_EQ(w32.dtype(), DType::kFloat32);
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(w32.data_as<float>()[i], BFloat16BitsToFloat(want[i])) << i;
  }
  HfExportOptions bad;
  bad.dtype = DType::kInt32;
  EXPECT_THAT(ExportHfCheckpoint(fs, "/s", "/bad", bad),
              StatusIs(kInvalid, HasSubstr("int32")));
}

// Tensors larger than the cast scratch (kCastScratchBytes) convert piece by
// piece, on import and on export, every element as ConvertElements does.
TEST(HfCheckpointTest, LargeCastsGoThroughTheScratchPieceByPiece) {
  FaultInjectionFileSystem fs;
  const int64_t n = 3 * (kCastScratchBytes / 4) + 12345;
  ModelSpec spec;
  spec.name = "large";
  spec.params = {{"w", {n}, DType::kBFloat16}};
  HostTensor f32(DType::kFloat32, {n});
  for (int64_t i = 0; i < n; ++i) {
    f32.data_as<float>()[i] = 1.0f + static_cast<float>(i) * 0x1p-21f;
  }
  MakeDir(fs, "/hf");
  FLATPARAM_ASSERT_OK(WriteFile(fs, "/hf/model.safetensors", {{"w", f32}}));
  HfImportOptions cast;
  cast.cast = true;
  FLATPARAM_ASSERT_OK(
      ImportHfCheckpoint(fs, "/hf", spec, TestLayoutOptions(1), 0, "/s", cast)
          .status());
  FLATPARAM_ASSERT_OK(ExportHfCheckpoint(fs, "/s", "/out").status());
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      SafetensorsReader r,
      SafetensorsReader::Open(fs, "/out/model.safetensors"));
  FLATPARAM_ASSERT_OK_AND_ASSIGN(HostTensor w, r.ReadHostTensor("w"));
  HostTensor want(DType::kBFloat16, {n});
  ConvertElements(f32.data(), DType::kFloat32, want.data(), DType::kBFloat16,
                  n);
  EXPECT_TRUE(w == want);
  // Export casts the same way from float32 shards.
  ModelSpec spec32 = spec;
  spec32.params[0].dtype = DType::kFloat32;
  FLATPARAM_ASSERT_OK(
      ImportHfCheckpoint(fs, "/hf", spec32, TestLayoutOptions(2), 0, "/s32")
          .status());
  HfExportOptions to_bf16;
  to_bf16.dtype = DType::kBFloat16;
  FLATPARAM_ASSERT_OK(
      ExportHfCheckpoint(fs, "/s32", "/out16", to_bf16).status());
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      SafetensorsReader r16,
      SafetensorsReader::Open(fs, "/out16/model.safetensors"));
  FLATPARAM_ASSERT_OK_AND_ASSIGN(HostTensor w16, r16.ReadHostTensor("w"));
  EXPECT_TRUE(w16 == want);
}

// Each check of the model against the files, with the file, the tensor and
// what differs, all problems at once.
TEST(HfCheckpointTest, ImportChecksEveryNameShapeAndDtype) {
  FaultInjectionFileSystem fs;
  const ModelSpec spec = TinyModelSpec();
  const std::vector<Named> weights = Weights(spec, DType::kFloat32);
  struct Case {
    std::string what;
    std::function<void(std::vector<Named>&)> edit;
    std::vector<std::string> messages;
  };
  const std::vector<Case> cases = {
      {"missing",
       [](std::vector<Named>& t) { t.erase(t.begin() + 2); },
       {"missing tensor 'seq.0.bias' (float32 [5]), a parameter of model "
        "'tiny': in no file of the checkpoint"}},
      {"missing tied",
       [](std::vector<Named>& t) { t.erase(t.begin()); },
       {"missing tensor 'emb.weight' (float32 [11, 3]), a parameter of "
        "model 'tiny': in no file of the checkpoint, nor is its tied copy "
        "head.weight"}},
      {"unexpected",
       [](std::vector<Named>& t) {
         t.push_back({"extra.weight", HostTensor(DType::kFloat32, {2})});
       },
       {"/hf/model.safetensors: unexpected tensor 'extra.weight' (F32 [2]): "
        "not a parameter or buffer of model 'tiny'"}},
      {"unexpected wrapped",
       [](std::vector<Named>& t) {
         t.push_back({"_fsdp_wrapped_module.extra.weight",
                      HostTensor(DType::kFloat32, {2})});
       },
       {"unexpected tensor '_fsdp_wrapped_module.extra.weight' "
        "('extra.weight')"}},
      {"shape",
       [](std::vector<Named>& t) {
         t[1].tensor = HostTensor(DType::kFloat32, {3, 5});
       },
       {"/hf/model.safetensors: tensor 'seq.0.weight' has shape [3, 5], the "
        "model's parameter 'seq.0.weight' [5, 3]"}},
      {"dtype",
       [](std::vector<Named>& t) {
         t[4].tensor = HostTensor(DType::kFloat16, {7});
       },
       {"/hf/model.safetensors: tensor 'seq.2.bias' is F16, the model's "
        "parameter 'seq.2.bias' is float32 (give the model the file's dtype, "
        "--dtype=float16, or convert with --cast)"}},
      {"integer",
       [](std::vector<Named>& t) {
         t[4].tensor = HostTensor(DType::kInt64, {7});
       },
       {"tensor 'seq.2.bias' is I64"}},
      {"tied shape",
       [](std::vector<Named>& t) {
         t.push_back({"head.weight", HostTensor(DType::kFloat32, {3, 11})});
       },
       {"/hf/model.safetensors: tensor 'head.weight' is tied to "
        "'emb.weight' in model 'tiny', but it is F32 [3, 11] and "
        "'emb.weight' in /hf/model.safetensors is F32 [11, 3]"}},
      {"tied dtype",
       [](std::vector<Named>& t) {
         t.push_back({"head.weight", HostTensor(DType::kBFloat16, {11, 3})});
       },
       {"'head.weight' is tied to 'emb.weight' in model 'tiny', but it is "
        "BF16 [11, 3]"}},
      {"several",
       [](std::vector<Named>& t) {
         t.erase(t.begin() + 2);
         t.push_back({"extra.weight", HostTensor(DType::kFloat32, {2})});
       },
       {"does not fit model 'tiny': 2 problems:",
        "unexpected tensor 'extra.weight'", "missing tensor 'seq.0.bias'"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    std::vector<Named> tensors = weights;
    c.edit(tensors);
    RemoveRecursively(fs, "/hf").IgnoreError();
    MakeDir(fs, "/hf");
    FLATPARAM_ASSERT_OK(WriteFile(fs, "/hf/model.safetensors", tensors));
    absl::StatusOr<HfImportReport> r =
        ImportHfCheckpoint(fs, "/hf", spec, TestLayoutOptions(2), 0, "/x");
    for (const std::string& m : c.messages) {
      EXPECT_THAT(r, StatusIs(kMismatch, HasSubstr(m)));
    }
    EXPECT_FALSE(*fs.Exists("/x"));
  }

  // A tied copy with other values.
  std::vector<Named> tensors = weights;
  HostTensor head = weights[0].tensor;
  head.SetDouble(17, -1);
  tensors.push_back({"head.weight", head});
  RemoveRecursively(fs, "/hf").IgnoreError();
  MakeDir(fs, "/hf");
  FLATPARAM_ASSERT_OK(WriteFile(fs, "/hf/model.safetensors", tensors));
  EXPECT_THAT(
      ImportHfCheckpoint(fs, "/hf", spec, TestLayoutOptions(2), 0, "/x"),
      StatusIs(kMismatch,
               HasSubstr("/hf/model.safetensors: tensor 'head.weight' is "
                         "tied to 'emb.weight' in model 'tiny', but its "
                         "values differ from 'emb.weight' in "
                         "/hf/model.safetensors (first at element 17)")));
  // Ignored suffixes can be turned off.
  tensors = weights;
  tensors.push_back(
      {"a.rotary_emb.inv_freq", HostTensor(DType::kFloat32, {2})});
  RemoveRecursively(fs, "/hf").IgnoreError();
  MakeDir(fs, "/hf");
  FLATPARAM_ASSERT_OK(WriteFile(fs, "/hf/model.safetensors", tensors));
  EXPECT_THAT(
      ImportHfCheckpoint(fs, "/hf", spec, TestLayoutOptions(2), 0, "/ok"),
      IsOk());
  HfImportOptions strict;
  strict.ignored_suffixes.clear();
  EXPECT_THAT(ImportHfCheckpoint(fs, "/hf", spec, TestLayoutOptions(2), 0, "/x",
                                 strict),
              StatusIs(kMismatch, HasSubstr("unexpected tensor "
                                            "'a.rotary_emb.inv_freq'")));
}

// The index and the files must agree; every inconsistency is DataLoss
// naming the index or file.
TEST(HfCheckpointTest, IndexChecks) {
  FaultInjectionFileSystem fs;
  const ModelSpec spec = TinyModelSpec();
  const std::vector<Named> weights = Weights(spec, DType::kFloat32);
  const std::vector<Named> one(weights.begin(), weights.begin() + 3);
  const std::vector<Named> two(weights.begin() + 3, weights.end());
  const std::string f1 = "model-00001-of-00002.safetensors";
  const std::string f2 = "model-00002-of-00002.safetensors";
  std::map<std::string, std::string> good;
  for (const Named& t : one) good[t.name] = f1;
  for (const Named& t : two) good[t.name] = f2;
  const uint64_t total = Bytes(weights);
  const std::string index = "/hf/model.safetensors.index.json";

  struct Case {
    std::string what;
    std::string index_text;
    absl::StatusCode code;
    std::string message;
  };
  std::map<std::string, std::string> moved = good;
  moved["seq.0.bias"] = f2;
  std::map<std::string, std::string> lacking = good;
  lacking.erase("seq.2.bias");
  std::map<std::string, std::string> extra = good;
  extra["ghost.weight"] = f1;
  std::map<std::string, std::string> absent = good;
  absent["seq.0.bias"] = "model-00003-of-00003.safetensors";
  std::map<std::string, std::string> escape = good;
  escape["seq.0.bias"] = "../model.safetensors";
  const std::vector<Case> cases = {
      {"good", IndexJson(good, total), absl::StatusCode::kOk, ""},
      {"no total_size", IndexJson(good, std::nullopt), absl::StatusCode::kOk,
       ""},
      {"total_size", IndexJson(good, total + 4), kDataLoss,
       absl::StrFormat("%s: metadata.total_size is %d, but the tensors of the "
                       "weight_map hold %d bytes",
                       index, total + 4, total)},
      {"weight_map names the wrong file", IndexJson(moved, total), kDataLoss,
       "/hf/model-00001-of-00002.safetensors: tensor 'seq.0.bias' is here, "
       "but the weight_map puts it in model-00002-of-00002.safetensors"},
      {"tensor not in the weight_map", IndexJson(lacking, total), kDataLoss,
       "/hf/model-00002-of-00002.safetensors: tensor 'seq.2.bias' is not in "
       "the weight_map"},
      {"weight_map entry the file lacks", IndexJson(extra, total), kDataLoss,
       absl::StrCat(index,
                    ": the weight_map puts tensor 'ghost.weight' in "
                    "model-00001-of-00002.safetensors, which has no such "
                    "tensor")},
      {"missing file", IndexJson(absent, total), kDataLoss,
       "weight_map lists model-00003-of-00003.safetensors (for "
       "'seq.0.bias'), which does not exist"},
      {"path", IndexJson(escape, total), kDataLoss,
       "weight_map['seq.0.bias'] is '../model.safetensors', not a file name"},
      {"duplicate key",
       absl::StrCat("{\"weight_map\": {\"emb.weight\": \"", f1,
                    "\", \"emb.weight\": \"", f1, "\"}}"),
       kDataLoss, "weight_map lists 'emb.weight' twice"},
      {"not json", "{\"weight_map\": ", kDataLoss, "malformed JSON"},
      {"no weight_map", "{\"metadata\": {}}", kDataLoss,
       "\"weight_map\" is missing or not an object"},
      {"total_size type",
       "{\"metadata\": {\"total_size\": \"1\"}, "
       "\"weight_map\": {}}",
       kDataLoss, "metadata.total_size is \"1\", not a non-negative integer"},
      {"empty", "{\"weight_map\": {}}", kDataLoss, "weight_map is empty"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    RemoveRecursively(fs, "/hf").IgnoreError();
    MakeDir(fs, "/hf");
    FLATPARAM_ASSERT_OK(WriteFile(fs, JoinPath("/hf", f1), one));
    FLATPARAM_ASSERT_OK(WriteFile(fs, JoinPath("/hf", f2), two));
    WriteText(fs, index, c.index_text);
    absl::StatusOr<HfImportReport> r =
        ImportHfCheckpoint(fs, "/hf", spec, TestLayoutOptions(2), 0, "/x");
    if (c.code == absl::StatusCode::kOk) {
      EXPECT_THAT(r, IsOk());
      RemoveRecursively(fs, "/x").IgnoreError();
    } else {
      EXPECT_THAT(r, StatusIs(c.code, HasSubstr(c.message)));
      EXPECT_FALSE(*fs.Exists("/x"));
      // Each path once: no "index: index: ..." (a reported message).
      const std::string message(r.status().message());
      const size_t first = message.find(index);
      EXPECT_TRUE(first == std::string::npos ||
                  message.find(index, first + 1) == std::string::npos)
          << message;
    }
  }
}

TEST(HfCheckpointTest, DirectoryAndFileChecks) {
  FaultInjectionFileSystem fs;
  const ModelSpec spec = TinyModelSpec();
  const std::vector<Named> weights = Weights(spec, DType::kFloat32);
  const auto import = [&](const std::string& in, HfImportOptions o = {}) {
    return ImportHfCheckpoint(fs, in, spec, TestLayoutOptions(2), 0, "/x", o);
  };
  EXPECT_THAT(import("/nothing"), StatusIs(kNotFound));
  MakeDir(fs, "/empty");
  EXPECT_THAT(import("/empty"),
              StatusIs(kNotFound, HasSubstr("holds neither model.safetensors "
                                            "nor model.safetensors.index."
                                            "json")));
  MakeDir(fs, "/pickles");
  WriteText(fs, "/pickles/pytorch_model.bin", "pickle");
  EXPECT_THAT(import("/pickles"),
              StatusIs(kNotFound, HasSubstr("pickled torch objects")));
  MakeDir(fs, "/both");
  FLATPARAM_ASSERT_OK(WriteFile(fs, "/both/model.safetensors", weights));
  WriteText(fs, "/both/model.safetensors.index.json", "{}");
  EXPECT_THAT(import("/both"), StatusIs(kInvalid, HasSubstr("ambiguous")));
  // The path of either file picks it.
  EXPECT_THAT(import("/both/model.safetensors"), IsOk());
  RemoveRecursively(fs, "/x").IgnoreError();

  // Another tool's optimizer state is refused unless weights_only.
  MakeDir(fs, "/opt");
  FLATPARAM_ASSERT_OK(WriteFile(fs, "/opt/model.safetensors", weights));
  WriteText(fs, "/opt/optimizer.pt", "pickle");
  EXPECT_THAT(
      import("/opt"),
      StatusIs(kMismatch, AllOf(HasSubstr("/opt/optimizer.pt: optimizer state "
                                          "written by another tool cannot be "
                                          "imported"),
                                HasSubstr("--weights-only"))));
  HfImportOptions weights_only;
  weights_only.weights_only = true;
  EXPECT_THAT(import("/opt", weights_only), IsOk());
  RemoveRecursively(fs, "/x").IgnoreError();

  // Names that clean to the same name.
  MakeDir(fs, "/dup");
  std::vector<Named> dup = weights;
  dup.push_back({"_fsdp_wrapped_module.emb.weight", weights[0].tensor});
  FLATPARAM_ASSERT_OK(WriteFile(fs, "/dup/model.safetensors", dup));
  EXPECT_THAT(import("/dup"),
              StatusIs(kDataLoss, HasSubstr("are both 'emb.weight' once "
                                            "wrapper prefixes are removed")));

  // A damaged file: the reader's DataLoss, naming it.
  MakeDir(fs, "/bad");
  FLATPARAM_ASSERT_OK(WriteFile(fs, "/bad/model.safetensors", weights));
  std::string bytes = ReadWholeFile(fs, "/bad/model.safetensors");
  bytes.resize(bytes.size() - 1);
  WriteText(fs, "/bad/model.safetensors", bytes);
  EXPECT_THAT(import("/bad"),
              StatusIs(kDataLoss, HasSubstr("/bad/model.safetensors")));
  EXPECT_FALSE(*fs.Exists("/x"));

  // Output over input.
  EXPECT_THAT(ImportHfCheckpoint(fs, "/opt", spec, TestLayoutOptions(2), 0,
                                 "/opt/", weights_only),
              StatusIs(kInvalid, HasSubstr("is the input directory")));
  EXPECT_THAT(ExportHfCheckpoint(fs, "/x", "/x/"),
              StatusIs(kInvalid, HasSubstr("is the input directory")));
  EXPECT_THAT(ImportHfCheckpoint(fs, "/opt/model.safetensors", spec,
                                 TestLayoutOptions(2), 0, "/opt", weights_only),
              StatusIs(kInvalid, HasSubstr("holds the input")));
  EXPECT_THAT(ExportHfCheckpoint(fs, "/a/b", "/a"),
              StatusIs(kInvalid, HasSubstr("holds the input")));
  // Export needs a flatparam checkpoint.
  EXPECT_THAT(ExportHfCheckpoint(fs, "/opt", "/y"),
              StatusIs(kDataLoss, HasSubstr("no readable manifest.json")));
  HfExportOptions zero;
  zero.max_shard_bytes = 0;
  EXPECT_THAT(ExportHfCheckpoint(fs, "/opt", "/y", zero),
              StatusIs(kInvalid, HasSubstr("max_shard_bytes")));

  // Which inputs are Hugging Face checkpoints.
  EXPECT_THAT(IsHfCheckpoint(fs, "/opt"), IsOkAndHolds(true));
  EXPECT_THAT(IsHfCheckpoint(fs, "/opt/model.safetensors"), IsOkAndHolds(true));
  EXPECT_THAT(IsHfCheckpoint(fs, "/empty"), IsOkAndHolds(true));
  EXPECT_THAT(IsHfCheckpoint(fs, "/nothing"), IsOkAndHolds(false));
  WriteFull(fs, "/full", weights);
  EXPECT_THAT(IsHfCheckpoint(fs, "/full"), IsOkAndHolds(false));
}

// ---------------------------------------------------------------------------
// Optimizer state beside the weights.

// The param groups of `typed` (an optim.json of this project's form) as
// PyTorch writes them, json.dumps(optimizer.state_dict()["param_groups"]):
// untyped hyperparameters, "params" as IDs in the model's parameters()
// order (untied parameters in spec order).
json PyTorchParamGroups(const json& typed, const ModelSpec& spec) {
  std::map<std::string, int64_t> id;
  for (const ParamSpec& p : spec.params) {
    if (p.tied_to.empty()) id.emplace(p.fqn, static_cast<int64_t>(id.size()));
  }
  json out = json::array();
  for (const json& g : typed.at("param_groups")) {
    json group = json::object();
    for (const auto& [name, v] : g.at("hyperparams").items()) {
      group[name] = v.begin().value();  // {"float": 0.9} -> 0.9
    }
    json params = json::array();
    for (const json& fqn : g.at("params")) params.push_back(id.at(fqn));
    group["params"] = std::move(params);
    out.push_back(std::move(group));
  }
  return out;
}

// Every tensor of the safetensors file at `path`, in file order.
std::vector<Named> ReadTensors(FileSystem& fs, const std::string& path) {
  std::vector<Named> out;
  absl::StatusOr<SafetensorsReader> file = SafetensorsReader::Open(fs, path);
  EXPECT_TRUE(file.ok()) << file.status();
  if (!file.ok()) return out;
  for (const SafetensorsEntry& e : file->tensors()) {
    absl::StatusOr<HostTensor> t = file->ReadHostTensor(e.name);
    EXPECT_TRUE(t.ok()) << t.status();
    if (t.ok()) out.push_back({e.name, *std::move(t)});
  }
  return out;
}

// Copies files `names` of the directory `from` into a new directory `to`.
void CopyFiles(FileSystem& fs, const std::string& from, const std::string& to,
               const std::vector<std::string>& names) {
  MakeDir(fs, to);
  for (const std::string& name : names) {
    WriteText(fs, JoinPath(to, name), ReadWholeFile(fs, JoinPath(from, name)));
  }
}

// TinyModelSpec without its 0-d parameter, which PyTorch's rules cannot
// flatten with optimizer state that its unit's other parameters have.
ModelSpec TinyModelWithState() {
  ModelSpec spec = TinyModelSpec();
  spec.params.erase(
      std::remove_if(spec.params.begin(), spec.params.end(),
                     [](const ParamSpec& p) { return p.fqn == "norm.scale"; }),
      spec.params.end());
  return spec;
}

// A full checkpoint's files without its manifest.json, as a user brings
// them, import with the optimizer state into exactly what ShardCheckpoint
// writes from the checkpoint; so does the same state with PyTorch's
// param_groups as optim.json (and the tied parameter repeated in
// model.safetensors, as state_dict() has it). Both consolidate back to the
// original state, bit for bit.
TEST(HfCheckpointTest, OptimizerStateImportsAsShardCheckpointShardsIt) {
  FaultInjectionFileSystem fs;
  const ModelSpec spec = TinyModelWithState();
  const std::vector<std::pair<LayoutOptions, int64_t>> layouts = {
      {TestLayoutOptions(2), 0},
      {TestLayoutOptions(3), 0},
      {TestLayoutOptions(4), 0},
      {TestLayoutOptions(4, ShardingStrategy::kFullShard, true), 0},
      {TestLayoutOptions(2, ShardingStrategy::kHybridShard), 6},
  };
  for (const InitOptimizer optimizer :
       {InitOptimizer::kAdamW, InitOptimizer::kSgd}) {
    const std::string o = optimizer == InitOptimizer::kSgd ? "sgd" : "adamw";
    SCOPED_TRACE(o);
    const std::string full = "/full_" + o;
    InitOptions init;
    init.seed = 7;
    init.optimizer = optimizer;
    FLATPARAM_ASSERT_OK(InitCheckpoint(fs, spec, full, init));
    const std::string typed = "/typed_" + o;
    CopyFiles(fs, full, typed,
              {kModelFileName, kOptimFileName, kOptimJsonFileName});
    const std::string torch = "/torch_" + o;
    CopyFiles(fs, full, torch, {kOptimFileName});
    std::vector<Named> model = ReadTensors(fs, JoinPath(full, kModelFileName));
    for (const Named& t : ReadTensors(fs, JoinPath(full, kModelFileName))) {
      if (t.name == "emb.weight") model.push_back({"head.weight", t.tensor});
    }
    FLATPARAM_ASSERT_OK(WriteFile(fs, JoinPath(torch, kModelFileName), model));
    WriteText(fs, JoinPath(torch, kOptimJsonFileName),
              PyTorchParamGroups(json::parse(ReadWholeFile(
                                     fs, JoinPath(full, kOptimJsonFileName))),
                                 spec)
                  .dump());
    // FSDP.full_optim_state_dict's param groups list names, and a state
    // dict's JSON part is an object: both forms import alike.
    const std::string named = "/named_" + o;
    CopyFiles(fs, torch, named, {kModelFileName, kOptimFileName});
    json named_groups = PyTorchParamGroups(
        json::parse(ReadWholeFile(fs, JoinPath(full, kOptimJsonFileName))),
        spec);
    const json typed_groups =
        json::parse(ReadWholeFile(fs, JoinPath(full, kOptimJsonFileName)))
            .at("param_groups");
    for (size_t g = 0; g < named_groups.size(); ++g) {
      named_groups[g]["params"] = typed_groups[g].at("params");
    }
    WriteText(
        fs, JoinPath(named, kOptimJsonFileName),
        json{{"param_groups", named_groups}, {"state", json::object()}}.dump());

    for (size_t i = 0; i < layouts.size(); ++i) {
      SCOPED_TRACE(i);
      const auto& [options, world] = layouts[i];
      const std::string ref = absl::StrCat("/ref_", o, i);
      FLATPARAM_ASSERT_OK(ShardCheckpoint(fs, full, spec, options, world, ref));
      for (const std::string& in : {typed, torch, named}) {
        SCOPED_TRACE(in);
        const std::string out = absl::StrCat(in, "_", i);
        FLATPARAM_ASSERT_OK_AND_ASSIGN(
            const HfImportReport report,
            ImportHfCheckpoint(fs, in, spec, options, world, out));
        EXPECT_TRUE(report.optimizer);
        EXPECT_EQ(report.optimizer_params, 5);
        EXPECT_EQ(report.optimizer_groups, 1);
        EXPECT_THAT(report.optimizer_left_behind, ElementsAre());
        EXPECT_EQ(DescribeOptimizerImport(report),
                  "; optimizer state of 5 parameters in 1 param group "
                  "imported");
        ExpectSameDirectory(fs, ref, out);
      }
    }

    // Back to a full checkpoint: the original state.
    const std::string back = "/back_" + o;
    FLATPARAM_ASSERT_OK(ConsolidateCheckpoint(fs, torch + "_1", back));
    FLATPARAM_ASSERT_OK_AND_ASSIGN(const FullCheckpointReader want_reader,
                                   FullCheckpointReader::Open(fs, full));
    FLATPARAM_ASSERT_OK_AND_ASSIGN(const FullCheckpointReader got_reader,
                                   FullCheckpointReader::Open(fs, back));
    FLATPARAM_ASSERT_OK_AND_ASSIGN(FullState want, ReadFullState(want_reader));
    FLATPARAM_ASSERT_OK_AND_ASSIGN(FullState got, ReadFullState(got_reader));
    EXPECT_TRUE(got.params == want.params);
    ASSERT_EQ(got.optim.param_groups.size(), 1u);
    ASSERT_EQ(want.optim.param_groups.size(), 1u);
    // The groups list the parameters in flat-parameter order.
    for (OptimStateDict* d : {&got.optim, &want.optim}) {
      std::vector<ParamKey>& params = d->param_groups[0].params;
      std::sort(params.begin(), params.end());
    }
    EXPECT_EQ(FirstDifference(got.optim, want.optim), std::nullopt);
  }
}

// PyTorch's param_groups as json.dumps writes them: every hyperparameter
// keeps its Python type (0 an int, 0.0 a float, None, bools, a str, a
// tuple of floats), IDs name parameters in model order whatever the
// group's order, and groups stay apart.
TEST(HfCheckpointTest, PyTorchParamGroupsKeepTheirTypes) {
  FaultInjectionFileSystem fs;
  const ModelSpec spec = TinyModelWithState();
  MakeDir(fs, "/in");
  FLATPARAM_ASSERT_OK(
      WriteFile(fs, "/in/model.safetensors", Weights(spec, DType::kFloat32)));
  // Momentum for two parameters, one in each flat parameter.
  HostTensor m1(DType::kFloat32, {5, 3});
  FillSequence(m1, 1);
  HostTensor m2(DType::kFloat32, {7});
  FillSequence(m2, 2);
  FLATPARAM_ASSERT_OK(WriteFile(fs, "/in/optim.safetensors",
                                {{"state.seq.0.weight.momentum_buffer", m1},
                                 {"state.seq.2.bias.momentum_buffer", m2}}));
  // IDs: emb.weight 0, seq.0.weight 1, seq.0.bias 2, seq.2.weight 3,
  // seq.2.bias 4 (head.weight is emb.weight's).
  // Groups that split a flat parameter (seq.0.weight of the root's in
  // group 0, the rest of the root's in group 1) are refused: the flat
  // parameter would be in both groups, stepped twice.
  WriteText(fs, "/in/optim.json",
            R"([{"lr": 0.1, "momentum": 0.9, "params": [4, 1, 3]}, )"
            R"({"lr": 0.01, "momentum": 0, "params": [0, 2]}])");
  EXPECT_THAT(
      ImportHfCheckpoint(fs, "/in", spec, TestLayoutOptions(2), 0, "/out"),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("param_groups[0] holds 'seq.0.weight' and "
                         "param_groups[1] holds 'emb.weight'")));
  WriteText(fs, "/in/optim.json",
            R"([{"lr": 0.1, "momentum": 0.9, "dampening": 0, )"
            R"("weight_decay": 0.0, "nesterov": false, "maximize": false, )"
            R"("foreach": null, "differentiable": false, "note": "a", )"
            R"("betas": [0.9, 0.999], "params": [4, 3]}, )"
            R"({"lr": 0.01, "momentum": 0, "params": [0, 1, 2]}])");
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      const HfImportReport report,
      ImportHfCheckpoint(fs, "/in", spec, TestLayoutOptions(2), 0, "/out"));
  EXPECT_EQ(report.optimizer_params, 2);
  EXPECT_EQ(report.optimizer_groups, 2);
  FLATPARAM_ASSERT_OK_AND_ASSIGN(const ShardedCheckpointReader reader,
                                 ShardedCheckpointReader::Open(fs, "/out"));
  FLATPARAM_ASSERT_OK_AND_ASSIGN(const RankState rank,
                                 ReadRankState(reader, 0));
  ASSERT_EQ(rank.optim.param_groups.size(), 2u);
  const ParamGroup& g0 = rank.optim.param_groups[0];
  const std::map<std::string, HyperValue> want0 = {
      {"lr", 0.1},
      {"momentum", 0.9},
      {"dampening", int64_t{0}},
      {"weight_decay", 0.0},
      {"nesterov", false},
      {"maximize", false},
      {"foreach", std::monostate()},
      {"differentiable", false},
      {"note", std::string("a")},
      {"betas", std::vector<double>{0.9, 0.999}}};
  EXPECT_EQ(g0.hyperparams.size(), want0.size());
  for (const auto& [name, value] : want0) {
    ASSERT_EQ(g0.hyperparams.count(name), 1u) << name;
    EXPECT_TRUE(BitwiseEqual(g0.hyperparams.at(name), value)) << name;
  }
  // Group 0 holds seq.2's flat parameter, group 1 the root's.
  const int64_t root =
      reader.layout().flat_params()[0].params()[0].fqn == "seq.2.weight" ? 1
                                                                         : 0;
  EXPECT_THAT(g0.params, ElementsAre(ParamKey(1 - root)));
  EXPECT_THAT(rank.optim.param_groups[1].params, ElementsAre(ParamKey(root)));
  EXPECT_TRUE(
      BitwiseEqual(rank.optim.param_groups[1].hyperparams.at("momentum"),
                   HyperValue(int64_t{0})));
}

// Optimizer state is imported, refused naming the file and why, or with
// weights_only left behind and reported: never dropped unsaid.
TEST(HfCheckpointTest, OptimizerStateThatCannotBeImportedIsRefused) {
  FaultInjectionFileSystem fs;
  const ModelSpec spec = TinyModelWithState();
  const std::vector<Named> weights = Weights(spec, DType::kFloat32);
  InitOptions init;
  init.optimizer = InitOptimizer::kAdamW;
  FLATPARAM_ASSERT_OK(InitCheckpoint(fs, spec, "/full", init));
  WriteFull(fs, "/weights", weights);
  FLATPARAM_ASSERT_OK(
      ShardCheckpoint(fs, "/weights", spec, TestLayoutOptions(2), 0, "/ref"));
  HfImportOptions weights_only;
  weights_only.weights_only = true;
  const auto import = [&](const std::string& in, HfImportOptions o = {}) {
    return ImportHfCheckpoint(fs, in, spec, TestLayoutOptions(2), 0, "/x", o);
  };
  // A directory of weights and the given files of /full.
  int dirs = 0;
  const auto make = [&](const std::vector<std::string>& optim_files) {
    const std::string dir = absl::StrCat("/in", dirs++);
    CopyFiles(fs, "/full", dir, optim_files);
    EXPECT_THAT(WriteFile(fs, JoinPath(dir, kModelFileName), weights), IsOk());
    return dir;
  };
  // Each refused without weights_only, naming the file; with it, imported
  // as weights alone, the files listed as left behind.
  struct Refused {
    std::vector<std::string> optim_files;
    std::string extra;  // another tool's file, or ""
    std::string error;
  };
  const std::vector<Refused> refused = {
      {{kOptimFileName},
       "",
       "/optim.safetensors: optimizer state without its optim.json (the "
       "param groups and non-tensor state) cannot be imported"},
      {{kOptimJsonFileName},
       "",
       "/optim.json: optimizer state without its optim.safetensors (the "
       "tensor state, \"state.{fqn}.{state_name}\") cannot be imported"},
      {{kOptimFileName, kOptimJsonFileName},
       "optimizer.bin",
       "/optimizer.bin: optimizer state written by another tool cannot be "
       "imported (only optim.safetensors with optim.json can)"},
      {{}, "optim.pt", "/optim.pt: optimizer state written by another tool"},
  };
  for (const Refused& r : refused) {
    const std::string dir = make(r.optim_files);
    SCOPED_TRACE(dir);
    std::vector<std::string> files = r.optim_files;
    if (!r.extra.empty()) {
      WriteText(fs, JoinPath(dir, r.extra), "pickle");
      files.push_back(r.extra);
    }
    std::sort(files.begin(), files.end());
    EXPECT_THAT(import(dir),
                StatusIs(kMismatch, AllOf(HasSubstr(dir + r.error),
                                          HasSubstr("--weights-only"))));
    EXPECT_FALSE(*fs.Exists("/x"));
    FLATPARAM_ASSERT_OK_AND_ASSIGN(const HfImportReport report,
                                   import(dir, weights_only));
    EXPECT_FALSE(report.optimizer);
    EXPECT_EQ(report.optimizer_left_behind, files);
    EXPECT_EQ(DescribeOptimizerImport(report),
              absl::StrCat("; optimizer state left behind (--weights-only): ",
                           absl::StrJoin(files, ", ")));
    ExpectSameDirectory(fs, "/ref", "/x");
    FLATPARAM_ASSERT_OK(RemoveRecursively(fs, "/x"));
  }
  // Importable state is left behind too when told to.
  {
    const std::string dir = make({kOptimFileName, kOptimJsonFileName});
    FLATPARAM_ASSERT_OK_AND_ASSIGN(const HfImportReport report,
                                   import(dir, weights_only));
    EXPECT_THAT(report.optimizer_left_behind,
                ElementsAre(kOptimJsonFileName, kOptimFileName));
    ExpectSameDirectory(fs, "/ref", "/x");
    FLATPARAM_ASSERT_OK(RemoveRecursively(fs, "/x"));
  }
  // No optimizer state: nothing to say.
  {
    const std::string dir = make({});
    FLATPARAM_ASSERT_OK_AND_ASSIGN(const HfImportReport report, import(dir));
    EXPECT_EQ(DescribeOptimizerImport(report), "");
    FLATPARAM_ASSERT_OK(RemoveRecursively(fs, "/x"));
  }

  // Both files, but not fitting the model or their form.
  const std::string good_groups = R"([{"lr": 0.1, "params": [0, 1, 2, 3, 4]}])";
  struct Bad {
    std::vector<Named> tensors;  // optim.safetensors
    std::string optim_json;
    absl::StatusCode code;
    std::string error;
  };
  HostTensor emb(DType::kFloat32, {11, 3});
  HostTensor step = optim::ScalarTensor(DType::kFloat32, 3);
  const std::vector<Bad> bad = {
      {{{"state.nothing.exp_avg", emb}},
       good_groups,
       kMismatch,
       "tensor 'state.nothing.exp_avg' is not state.{fqn}.{state_name} for "
       "a parameter of model 'tiny'"},
      {{{"state.seq.0.bias.exp_avg", emb}},
       good_groups,
       kMismatch,
       "tensor 'state.seq.0.bias.exp_avg' has shape [11, 3], expected [] or "
       "[5] of parameter 'seq.0.bias'"},
      {{{"state.head.weight.exp_avg", emb}},
       good_groups,
       kMismatch,
       "tensor 'state.head.weight.exp_avg' is state of 'head.weight', which "
       "is tied to 'emb.weight' in model 'tiny': PyTorch keeps one state for "
       "a shared parameter, under its first name "
       "('state.emb.weight.exp_avg')"},
      {{{"state.emb.weight.step", step}},
       R"([{"lr": 0.1, "params": [0, 5]}])",
       kMismatch,
       "optim.json: param_groups[0].params[1] is parameter ID 5, but model "
       "'tiny' has 5 parameters"},
      {{{"state.emb.weight.step", step}},
       R"([{"lr": 0.1, "params": [0, "seq.9.bias"]}])",
       kMismatch,
       "optim.json: param_groups[0].params[1] is \"seq.9.bias\", which is "
       "not a parameter of model 'tiny'"},
      {{{"state.emb.weight.step", step}},
       R"([{"lr": 0.1, "params": [0, 1.5]}])",
       kDataLoss,
       "optim.json: param_groups[0].params[1] is 1.5, neither a parameter "
       "ID"},
      {{{"state.emb.weight.step", step}},
       R"({"param_groups": [], "extra": 1})",
       kDataLoss,
       "unexpected \"extra\" beside \"param_groups\""},
      {{{"state.emb.weight.step", step}},
       R"([{"lr": 0.1}])",
       kDataLoss,
       "optim.json: param_groups[0]: \"params\" is missing or not a list"},
      {{{"state.emb.weight.step", step}},
       R"([{"lr": {"x": 1}, "params": []}])",
       kDataLoss,
       "optim.json: param_groups[0].lr is {\"x\":1}, which is not a "
       "hyperparameter that can be imported"},
      {{{"state.emb.weight.step", step}},
       R"([{"lr": NaN, "params": []}])",
       kDataLoss,
       "optim.json:1:"},
      {{{"state.emb.weight.step", step}},
       R"({"format": "flatparam.optim.v1", "state": [], "param_groups": []})",
       kDataLoss,
       "tensor 'state.emb.weight.step'"},
      // State that does not flatten: PyTorch's rules, as ShardCheckpoint.
      {{{"state.seq.0.weight.exp_avg", HostTensor(DType::kFloat32, {5, 3})},
        {"state.seq.0.bias.other", HostTensor(DType::kFloat32, {5})}},
       good_groups,
       kInvalid,
       "Differing optimizer state names for the unflattened parameters"},
  };
  for (const Bad& b : bad) {
    const std::string dir = make({});
    SCOPED_TRACE(absl::StrCat(dir, " ", b.error));
    FLATPARAM_ASSERT_OK(
        WriteFile(fs, JoinPath(dir, kOptimFileName), b.tensors));
    WriteText(fs, JoinPath(dir, kOptimJsonFileName), b.optim_json);
    EXPECT_THAT(import(dir), StatusIs(b.code, HasSubstr(b.error)));
    EXPECT_FALSE(*fs.Exists("/x"));
  }
}

// ---------------------------------------------------------------------------
// The published Llama checkpoints at full scale, as headers over virtual
// zero data: the -hf presets accept them as they are.

// A read-only file system of safetensors files whose data sections read as
// zeros (never stored), and small text files.
class HeaderFileSystem : public FileSystem {
 public:
  void AddSafetensors(const std::string& path,
                      const std::vector<TensorDecl>& tensors) {
    absl::StatusOr<std::string> header =
        BuildSafetensorsHeader(tensors, {{"format", "pt"}});
    ASSERT_TRUE(header.ok()) << header.status();
    uint64_t data = 0;
    for (const TensorDecl& t : tensors) {
      data += NumElements(t.shape) * DTypeSize(t.dtype);
    }
    std::string prefix(8, '\0');
    const uint64_t n = header->size();
    std::memcpy(prefix.data(), &n, 8);
    files_[path] = {prefix + *header, 8 + n + data};
  }
  void AddText(const std::string& path, std::string text) {
    const uint64_t size = text.size();
    files_[path] = {std::move(text), size};
  }

  absl::StatusOr<std::unique_ptr<WritableFile>> NewWritableFile(
      const std::string& path) override {
    return absl::UnimplementedError("read-only");
  }
  absl::StatusOr<std::unique_ptr<RandomAccessFile>> NewRandomAccessFile(
      const std::string& path) override;
  absl::StatusOr<uint64_t> GetFileSize(const std::string& path) override {
    auto it = files_.find(path);
    if (it == files_.end()) return absl::NotFoundError(path);
    return it->second.size;
  }
  absl::StatusOr<bool> Exists(const std::string& path) override {
    return path == "/hf" || files_.count(path) > 0;
  }
  absl::StatusOr<bool> IsDirectory(const std::string& path) override {
    if (path == "/hf") return true;
    if (files_.count(path) > 0) return false;
    return absl::NotFoundError(path);
  }
  absl::StatusOr<std::vector<std::string>> GetChildren(
      const std::string& path) override {
    std::vector<std::string> names;
    for (const auto& [p, f] : files_) names.push_back(Basename(p));
    return names;
  }
  absl::Status CreateDir(const std::string&) override {
    return absl::UnimplementedError("read-only");
  }
  absl::Status RemoveFile(const std::string&) override {
    return absl::UnimplementedError("read-only");
  }
  absl::Status RemoveDir(const std::string&) override {
    return absl::UnimplementedError("read-only");
  }
  absl::Status Rename(const std::string&, const std::string&) override {
    return absl::UnimplementedError("read-only");
  }
  absl::Status SyncDir(const std::string&) override {
    return absl::UnimplementedError("read-only");
  }

 private:
  struct File {
    std::string prefix;  // the bytes held; zeros after them
    uint64_t size = 0;
  };
  class Reader : public RandomAccessFile {
   public:
    Reader(std::string name, const File* file)
        : name_(std::move(name)), file_(file) {}
    absl::Status ReadAt(uint64_t offset, absl::Span<char> out) const override {
      if (offset + out.size() > file_->size) {
        return absl::DataLossError(absl::StrCat(name_, ": short read"));
      }
      for (size_t i = 0; i < out.size(); ++i) {
        const uint64_t at = offset + i;
        out[i] = at < file_->prefix.size() ? file_->prefix[at] : '\0';
      }
      return absl::OkStatus();
    }
    absl::StatusOr<uint64_t> Size() const override { return file_->size; }
    const std::string& name() const override { return name_; }

   private:
    std::string name_;
    const File* file_;
  };
  std::map<std::string, File> files_;
};

absl::StatusOr<std::unique_ptr<RandomAccessFile>>
HeaderFileSystem::NewRandomAccessFile(const std::string& path) {
  auto it = files_.find(path);
  if (it == files_.end()) return absl::NotFoundError(path);
  return std::unique_ptr<RandomAccessFile>(new Reader(path, &it->second));
}

// The checkpoint files of a Hugging Face LlamaForCausalLM with this config,
// spelled out from transformers' modeling code (not from the presets),
// split by layer over `files` files as the published ones are, with
// `inv_freq` buffers as transformers 4.31 saved them (Llama 2).
void AddHfLlama(HeaderFileSystem& fs, int64_t hidden, int64_t intermediate,
                int64_t layers, int64_t heads, int64_t kv_heads, int64_t vocab,
                DType dtype, int files, bool inv_freq) {
  const int64_t kv = kv_heads * (hidden / heads);
  std::vector<std::vector<TensorDecl>> per_file(files);
  auto add = [&](int file, std::string name, std::vector<int64_t> shape,
                 DType d) {
    per_file[file].push_back({std::move(name), d, std::move(shape)});
  };
  add(0, "model.embed_tokens.weight", {vocab, hidden}, dtype);
  for (int64_t i = 0; i < layers; ++i) {
    const int file = static_cast<int>(i * files / layers);
    const std::string l = absl::StrCat("model.layers.", i, ".");
    add(file, l + "self_attn.q_proj.weight", {hidden, hidden}, dtype);
    add(file, l + "self_attn.k_proj.weight", {kv, hidden}, dtype);
    add(file, l + "self_attn.v_proj.weight", {kv, hidden}, dtype);
    add(file, l + "self_attn.o_proj.weight", {hidden, hidden}, dtype);
    add(file, l + "mlp.gate_proj.weight", {intermediate, hidden}, dtype);
    add(file, l + "mlp.up_proj.weight", {intermediate, hidden}, dtype);
    add(file, l + "mlp.down_proj.weight", {hidden, intermediate}, dtype);
    add(file, l + "input_layernorm.weight", {hidden}, dtype);
    add(file, l + "post_attention_layernorm.weight", {hidden}, dtype);
    if (inv_freq) {
      add(file, l + "self_attn.rotary_emb.inv_freq", {hidden / heads / 2},
          DType::kFloat32);
    }
  }
  add(files - 1, "model.norm.weight", {hidden}, dtype);
  add(files - 1, "lm_head.weight", {vocab, hidden}, dtype);
  json weight_map = json::object();
  uint64_t total = 0;
  for (int f = 0; f < files; ++f) {
    const std::string name =
        absl::StrFormat("model-%05d-of-%05d.safetensors", f + 1, files);
    fs.AddSafetensors(JoinPath("/hf", name), per_file[f]);
    for (const TensorDecl& t : per_file[f]) {
      weight_map[t.name] = name;
      total += NumElements(t.shape) * DTypeSize(t.dtype);
    }
  }
  fs.AddText(
      "/hf/model.safetensors.index.json",
      json({{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}})
          .dump(2));
}

TEST(HfCheckpointTest, PublishedLlamaCheckpointsFitTheHfPresets) {
  {
    // meta-llama/Llama-2-7b-hf: float16, two files, total_size 13476839424
    // (6,738,415,616 parameters x 2 bytes + 32 x 64 float32 inv_freq).
    HeaderFileSystem fs;
    AddHfLlama(fs, 4096, 11008, 32, 32, 32, 32000, DType::kFloat16, 2, true);
    FLATPARAM_ASSERT_OK_AND_ASSIGN(HfCheckpointReader ckpt,
                                   HfCheckpointReader::Open(fs, "/hf"));
    EXPECT_EQ(ckpt.data_bytes(), uint64_t{13476839424});
    FLATPARAM_ASSERT_OK_AND_ASSIGN(ModelSpec hf, PresetModel("llama2-7b-hf"));
    FLATPARAM_ASSERT_OK_AND_ASSIGN(HfImportReport report,
                                   CheckHfCheckpointFits(ckpt, hf));
    EXPECT_EQ(report.imported, 291);
    EXPECT_EQ(report.ignored, 32);
    EXPECT_EQ(report.cast, 0);
    // Meta's names do not fit: every tensor is unexpected and every
    // parameter missing, listed (up to a limit) with the files.
    FLATPARAM_ASSERT_OK_AND_ASSIGN(ModelSpec meta, PresetModel("llama2-7b"));
    EXPECT_THAT(
        CheckHfCheckpointFits(ckpt, meta),
        StatusIs(kMismatch,
                 AllOf(HasSubstr("/hf/model.safetensors.index.json does not "
                                 "fit model 'llama2-7b': 582 problems:"),
                       HasSubstr("/hf/model-00001-of-00002.safetensors: "
                                 "unexpected tensor 'model.embed_tokens."
                                 "weight' (F16 [32000, 4096])"),
                       HasSubstr("... and 562 more"))));
    // A bfloat16 model needs --cast (or --dtype=float16).
    ModelSpec bf16 = hf;
    for (ParamSpec& p : bf16.params) p.dtype = DType::kBFloat16;
    EXPECT_THAT(CheckHfCheckpointFits(ckpt, bf16),
                StatusIs(kMismatch, HasSubstr("--cast")));
    HfImportOptions cast;
    cast.cast = true;
    FLATPARAM_ASSERT_OK_AND_ASSIGN(report,
                                   CheckHfCheckpointFits(ckpt, bf16, cast));
    EXPECT_EQ(report.cast, 291);
  }
  {
    // meta-llama/Meta-Llama-3-8B: bfloat16, four files, no inv_freq,
    // grouped-query attention (k_proj, v_proj [1024, 4096]).
    HeaderFileSystem fs;
    AddHfLlama(fs, 4096, 14336, 32, 32, 8, 128256, DType::kBFloat16, 4, false);
    FLATPARAM_ASSERT_OK_AND_ASSIGN(HfCheckpointReader ckpt,
                                   HfCheckpointReader::Open(fs, "/hf"));
    EXPECT_EQ(ckpt.data_bytes(), uint64_t{8030261248} * 2);
    FLATPARAM_ASSERT_OK_AND_ASSIGN(ModelSpec hf, PresetModel("llama3-8b-hf"));
    FLATPARAM_ASSERT_OK_AND_ASSIGN(HfImportReport report,
                                   CheckHfCheckpointFits(ckpt, hf));
    EXPECT_EQ(report.imported, 291);
    EXPECT_EQ(report.ignored, 0);
    FLATPARAM_ASSERT_OK_AND_ASSIGN(ModelSpec l2, PresetModel("llama2-7b-hf"));
    EXPECT_THAT(CheckHfCheckpointFits(ckpt, l2),
                StatusIs(kMismatch,
                         HasSubstr("tensor 'model.layers.0.self_attn.k_proj."
                                   "weight' has shape [1024, 4096], the "
                                   "model's parameter 'model.layers.0."
                                   "self_attn.k_proj.weight' [4096, 4096]")));
  }
  {
    // meta-llama/Llama-2-70b-hf: float16, 15 files, GQA with 8 KV heads.
    HeaderFileSystem fs;
    AddHfLlama(fs, 8192, 28672, 80, 64, 8, 32000, DType::kFloat16, 15, true);
    FLATPARAM_ASSERT_OK_AND_ASSIGN(HfCheckpointReader ckpt,
                                   HfCheckpointReader::Open(fs, "/hf"));
    FLATPARAM_ASSERT_OK_AND_ASSIGN(ModelSpec hf, PresetModel("llama2-70b-hf"));
    FLATPARAM_ASSERT_OK_AND_ASSIGN(HfImportReport report,
                                   CheckHfCheckpointFits(ckpt, hf));
    EXPECT_EQ(report.imported, 723);
    EXPECT_EQ(report.files, 15);
  }
}

// Buffers (model_layout.h's BufferSpec) out and back in, each rank's its own.
TEST(HfCheckpointTest, ExportAndImportCarryBuffers) {
  FaultInjectionFileSystem fs;
  const ModelLayout two =
      MakeTestLayout(BufferModelSpec(), TestLayoutOptions(2));
  FLATPARAM_ASSERT_OK(
      WriteRankStates(fs, "/s", two, RankStatesWithBuffers(two)));
  FLATPARAM_ASSERT_OK(fs.CreateDir("/hf"));
  FLATPARAM_ASSERT_OK_AND_ASSIGN(HfExportReport report,
                                 ExportHfCheckpoint(fs, "/s", "/hf/out"));
  EXPECT_EQ(report.tensors, 3 + 3);
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      SafetensorsReader file,
      SafetensorsReader::Open(fs, "/hf/out/model.safetensors"));
  for (const auto& [fqn, t] : RankBuffers(BufferModelSpec(), 0)) {
    FLATPARAM_ASSERT_OK_AND_ASSIGN(HostTensor got, file.ReadHostTensor(fqn));
    EXPECT_TRUE(SameTensorBytes(got, t)) << fqn;
  }

  // The export imports back, every rank starting from its buffers.
  LayoutOptions three;
  three.world_size = 3;
  FLATPARAM_ASSERT_OK(ImportHfCheckpoint(fs, "/hf/out", BufferModelSpec(),
                                         three, 0, "/imported")
                          .status());
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      ShardedCheckpointReader imported,
      ShardedCheckpointReader::Open(fs, "/imported"));
  for (int r = 0; r < 3; ++r) {
    FLATPARAM_ASSERT_OK_AND_ASSIGN(RankState s, ReadRankState(imported, r));
    ExpectRanksBuffers(BufferModelSpec(), s.buffers, 0);
  }

  // A model with a buffer the files lack does not fit them.
  ModelSpec more = BufferModelSpec();
  more.buffers.push_back({"c.recomputed", {2}, DType::kFloat32});
  EXPECT_THAT(
      ImportHfCheckpoint(fs, "/hf/out", more, three, 0, "/x").status(),
      StatusIs(kMismatch,
               HasSubstr("missing tensor 'c.recomputed' (float32 [2]), a "
                         "buffer of model 'bn': in no file of the "
                         "checkpoint (if the model recomputes it, remove it "
                         "from the model file's \"buffers\")")));
  EXPECT_FALSE(*fs.Exists("/x"));
}

}  // namespace
}  // namespace checkpoint
}  // namespace flatparam
