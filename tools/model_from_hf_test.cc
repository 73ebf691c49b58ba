// `fsdp model --from`: the order of names with and without an architecture
// template, the default wrap, Hugging Face directories in memory (single
// file and indexed, config.json, buffers, ties) made into model files that
// read back and fit the checkpoint, and the command's output rules on the
// POSIX file system. The binary end to end is //tools:model_cli_test.
#include "tools/model_from_hf.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "flatparam/base/dtype.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/base/status_matchers.h"
#include "flatparam/checkpoint/file_system.h"
#include "flatparam/checkpoint/safetensors.h"
#include "flatparam/interop/hf/hf_checkpoint.h"
#include "flatparam/model_json.h"
#include "flatparam/model_layout.h"
#include "flatparam/presets.h"

namespace flatparam {
namespace tools {
namespace {

using checkpoint::FaultInjectionFileSystem;
using checkpoint::FileSystem;
using json = nlohmann::json;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;
using ::testing::StartsWith;

constexpr auto kInvalid = absl::StatusCode::kInvalidArgument;

// A tensor of zeros to write under `name`.
struct Tensor {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
};

// Writes `tensors` (in this order, names as given) as one safetensors file.
absl::Status WriteSafetensorsFile(FileSystem& fs, const std::string& path,
                                  const std::vector<Tensor>& tensors) {
  static const std::vector<char> kZeros(4096, 0);
  std::vector<checkpoint::TensorSource> sources;
  for (const Tensor& t : tensors) {
    sources.push_back(checkpoint::TensorSourceFromBytes(
        t.name, t.dtype, t.shape, kZeros.data()));
  }
  FLATPARAM_ASSIGN_OR_RETURN(std::unique_ptr<checkpoint::WritableFile> f,
                             fs.NewWritableFile(path));
  FLATPARAM_RETURN_IF_ERROR(
      checkpoint::WriteSafetensors(*f, path, sources, {{"format", "pt"}}));
  return f->Close();
}

// An index-sharded checkpoint: `files[i]` in model-0000{i+1}-of-0000n.
void WriteIndexed(FileSystem& fs, const std::string& dir,
                  const std::vector<std::vector<Tensor>>& files) {
  FLATPARAM_ASSERT_OK(fs.CreateDir(dir));
  json weight_map = json::object();
  for (size_t i = 0; i < files.size(); ++i) {
    const std::string name = absl::StrCat("model-0000", i + 1, "-of-0000",
                                          files.size(), ".safetensors");
    FLATPARAM_ASSERT_OK(
        WriteSafetensorsFile(fs, checkpoint::JoinPath(dir, name), files[i]));
    for (const Tensor& t : files[i]) weight_map[t.name] = name;
  }
  FLATPARAM_ASSERT_OK(checkpoint::WriteFileDurably(
      fs, checkpoint::JoinPath(dir, checkpoint::kHfIndexFileName),
      json({{"weight_map", weight_map}}).dump(2)));
}

void WriteConfig(FileSystem& fs, const std::string& dir, const json& config) {
  FLATPARAM_ASSERT_OK(checkpoint::WriteFileDurably(
      fs, checkpoint::JoinPath(dir, "config.json"), config.dump(2)));
}

// The parameters of a 3-layer LlamaForCausalLM (hidden 4, intermediate 6,
// vocab 8) in module order, as transformers registers them.
std::vector<Tensor> TinyLlama(bool with_head = true) {
  const DType bf16 = DType::kBFloat16;
  std::vector<Tensor> t = {{"model.embed_tokens.weight", bf16, {8, 4}}};
  for (int i = 0; i < 3; ++i) {
    const std::string b = absl::StrCat("model.layers.", i, ".");
    t.push_back({b + "self_attn.q_proj.weight", bf16, {4, 4}});
    t.push_back({b + "self_attn.k_proj.weight", bf16, {2, 4}});
    t.push_back({b + "self_attn.v_proj.weight", bf16, {2, 4}});
    t.push_back({b + "self_attn.o_proj.weight", bf16, {4, 4}});
    t.push_back({b + "mlp.gate_proj.weight", bf16, {6, 4}});
    t.push_back({b + "mlp.up_proj.weight", bf16, {6, 4}});
    t.push_back({b + "mlp.down_proj.weight", bf16, {4, 6}});
    t.push_back({b + "input_layernorm.weight", bf16, {4}});
    t.push_back({b + "post_attention_layernorm.weight", bf16, {4}});
  }
  t.push_back({"model.norm.weight", bf16, {4}});
  if (with_head) t.push_back({"lm_head.weight", bf16, {8, 4}});
  return t;
}

std::vector<std::string> Names(const std::vector<Tensor>& tensors) {
  std::vector<std::string> out;
  for (const Tensor& t : tensors) out.push_back(t.name);
  return out;
}

std::vector<std::string> Fqns(const ModelSpec& spec) {
  std::vector<std::string> out;
  for (const ParamSpec& p : spec.params) out.push_back(p.fqn);
  return out;
}

// `tensors` as save_pretrained stores them: sorted by name.
std::vector<Tensor> Sorted(std::vector<Tensor> tensors) {
  std::sort(tensors.begin(), tensors.end(),
            [](const Tensor& a, const Tensor& b) { return a.name < b.name; });
  return tensors;
}

TEST(OrderNamesTest, NumbersByValueThenNamesByBytes) {
  EXPECT_THAT(
      OrderNames({"layers.10.w", "layers.2.w", "layers.1.b", "head",
                  "emb.weight", "layers.1.a", "layers.02.w", "x.a", "x.0.w"},
                 nullptr),
      ElementsAre("emb.weight", "head", "layers.1.a", "layers.1.b",
                  "layers.02.w", "layers.2.w", "layers.10.w", "x.0.w", "x.a"));
  // Longer than any integer type.
  EXPECT_THAT(OrderNames({"a.100000000000000000000000.w", "a.99.w"}, nullptr),
              ElementsAre("a.99.w", "a.100000000000000000000000.w"));
}

TEST(OrderNamesTest, AnArchitectureTemplateGivesModuleOrder) {
  FLATPARAM_ASSERT_OK_AND_ASSIGN(ModelSpec llama, PresetModel("llama2-7b-hf"));
  std::vector<std::string> want = Names(TinyLlama());
  std::vector<std::string> shuffled = want;
  std::shuffle(shuffled.begin(), shuffled.end(), std::mt19937(7));
  EXPECT_THAT(OrderNames(shuffled, &llama), ElementsAreArray(want));

  // Names the template lacks come after their known siblings, by name;
  // numbers still by value.
  EXPECT_THAT(OrderNames({"model.layers.10.self_attn.q_proj.weight",
                          "model.layers.2.self_attn.q_proj.bias",
                          "model.layers.2.self_attn.q_proj.weight",
                          "model.layers.2.self_attn.k_norm.weight",
                          "model.layers.2.self_attn.k_proj.weight",
                          "model.extra.weight", "lm_head.weight",
                          "model.norm.weight", "aaa.weight"},
                         &llama),
              ElementsAre("model.layers.2.self_attn.q_proj.weight",
                          "model.layers.2.self_attn.q_proj.bias",
                          "model.layers.2.self_attn.k_proj.weight",
                          "model.layers.2.self_attn.k_norm.weight",
                          "model.layers.10.self_attn.q_proj.weight",
                          "model.norm.weight", "model.extra.weight",
                          "lm_head.weight", "aaa.weight"));
}

TEST(OrderNamesTest, KnownArchitectures) {
  EXPECT_EQ(ArchitectureTemplate("LlamaForCausalLM"), "llama2-7b-hf");
  EXPECT_EQ(ArchitectureTemplate("MistralForCausalLM"), "llama2-7b-hf");
  EXPECT_EQ(ArchitectureTemplate("Qwen2ForCausalLM"), "llama2-7b-hf");
  EXPECT_EQ(ArchitectureTemplate("GPT2LMHeadModel"), "gpt2");
  EXPECT_EQ(ArchitectureTemplate("T5ForConditionalGeneration"), "");
  // The gpt2 preset's names in any order come back in its order.
  FLATPARAM_ASSERT_OK_AND_ASSIGN(ModelSpec gpt2, PresetModel("gpt2"));
  std::vector<std::string> names = Fqns(gpt2);
  std::sort(names.begin(), names.end());
  EXPECT_THAT(OrderNames(names, &gpt2), ElementsAreArray(Fqns(gpt2)));
}

std::vector<ParamSpec> Params(const std::vector<std::string>& names) {
  std::vector<ParamSpec> out;
  for (const std::string& n : names) out.push_back({n, {2}});
  return out;
}

TEST(DefaultWrapGlobTest, OnlyOneNumberedModuleList) {
  std::string why;
  EXPECT_EQ(DefaultWrapGlob(Params(Names(TinyLlama())), &why),
            "model.layers.*");
  EXPECT_EQ(why, "the one numbered module list, 3 modules");
  // Numbers inside a block (experts) count for the block list only.
  EXPECT_EQ(DefaultWrapGlob(Params({"h.0.experts.0.w", "h.0.experts.1.w",
                                    "h.1.experts.0.w", "ln.weight"}),
                            &why),
            "h.*");
  EXPECT_EQ(why, "the one numbered module list, 2 modules");
  EXPECT_EQ(DefaultWrapGlob(Params({"encoder.block.0.w", "encoder.block.1.w",
                                    "decoder.block.0.w"}),
                            &why),
            std::nullopt);
  EXPECT_EQ(why, "2 numbered module lists: encoder.block, decoder.block");
  EXPECT_EQ(DefaultWrapGlob(Params({"a.weight", "b.weight", "c.3"}), &why),
            std::nullopt);
  EXPECT_EQ(why, "no numbered module list");
  // A numbered list at the root (nn.Sequential) has no glob of its own.
  EXPECT_EQ(DefaultWrapGlob(Params({"0.weight", "1.weight"}), &why),
            std::nullopt);
  EXPECT_EQ(why, "1 numbered module list: <root>");
}

TEST(ParseWrapListTest, CommaSeparatedEntries) {
  FLATPARAM_ASSERT_OK_AND_ASSIGN(std::vector<std::string> w,
                                 ParseWrapList("model.layers.*, lm_head"));
  EXPECT_THAT(w, ElementsAre("model.layers.*", "lm_head"));
  FLATPARAM_ASSERT_OK_AND_ASSIGN(w, ParseWrapList(""));
  EXPECT_TRUE(w.empty());
  EXPECT_THAT(ParseWrapList("a,,b"),
              StatusIs(kInvalid, HasSubstr("entry \"\" is not a module")));
  EXPECT_THAT(ParseWrapList("layers..*"),
              StatusIs(kInvalid, HasSubstr("entry \"layers..*\"")));
}

TEST(ModelFromHfCheckpointTest, IndexedLlamaInModuleOrder) {
  FaultInjectionFileSystem fs;
  FLATPARAM_ASSERT_OK(fs.CreateDir("/hub"));
  // save_pretrained's files: names sorted, split in module order; plus a
  // rotary buffer the import skips.
  std::vector<Tensor> tensors = TinyLlama();
  std::vector<Tensor> one(tensors.begin(), tensors.begin() + 12);
  std::vector<Tensor> two(tensors.begin() + 12, tensors.end());
  two.push_back(
      {"model.layers.1.self_attn.rotary_emb.inv_freq", DType::kFloat32, {2}});
  WriteIndexed(fs, "/hub/tiny-llama", {Sorted(one), Sorted(two)});
  WriteConfig(fs, "/hub/tiny-llama",
              {{"architectures", {"LlamaForCausalLM"}},
               {"tie_word_embeddings", false}});

  HfModelOptions options;
  options.from = "/hub/tiny-llama";
  FLATPARAM_ASSERT_OK_AND_ASSIGN(HfModel m, ModelFromHfCheckpoint(fs, options));
  EXPECT_EQ(m.spec.name, "tiny-llama");
  EXPECT_THAT(Fqns(m.spec), ElementsAreArray(Names(tensors)));
  for (size_t i = 0; i < tensors.size(); ++i) {
    EXPECT_EQ(m.spec.params[i].shape, tensors[i].shape) << tensors[i].name;
    EXPECT_EQ(m.spec.params[i].dtype, DType::kBFloat16) << tensors[i].name;
    EXPECT_TRUE(m.spec.params[i].requires_grad);
    EXPECT_TRUE(m.spec.params[i].tied_to.empty());
  }
  EXPECT_THAT(m.spec.wrap, ElementsAre("model.layers.*"));
  EXPECT_EQ(m.files, 2);
  EXPECT_EQ(m.ignored, 1);
  EXPECT_EQ(m.units, 4);
  EXPECT_THAT(m.order_note, StartsWith("LlamaForCausalLM's module order"));
  EXPECT_THAT(m.wrap_note,
              HasSubstr("default --wrap=model.layers.* (the one numbered "
                        "module list, 3 modules)"));
  EXPECT_EQ(m.tie_note, "");

  // The file reads back as the same model, and imports the checkpoint.
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      ModelSpec back, ParseModelSpecJson(ModelFileText(m.spec), "m.json"));
  EXPECT_EQ(back.name, m.spec.name);
  EXPECT_EQ(Fqns(back), Fqns(m.spec));
  EXPECT_EQ(back.wrap, m.spec.wrap);
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      checkpoint::HfCheckpointReader reader,
      checkpoint::HfCheckpointReader::Open(fs, "/hub/tiny-llama"));
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      checkpoint::HfImportReport fits,
      checkpoint::CheckHfCheckpointFits(reader, back));
  EXPECT_EQ(fits.imported, static_cast<int64_t>(tensors.size()));
  EXPECT_EQ(fits.ignored, 1);
}

TEST(ModelFromHfCheckpointTest, WithoutConfigNamesSortNumerically) {
  FaultInjectionFileSystem fs;
  FLATPARAM_ASSERT_OK(fs.CreateDir("/m"));
  std::vector<Tensor> tensors;
  for (int i = 0; i < 12; ++i) {
    tensors.push_back(
        {absl::StrCat("blocks.", i, ".w"), DType::kFloat16, {2, 3}});
  }
  tensors.push_back({"embed.weight", DType::kFloat32, {5, 2}});
  FLATPARAM_ASSERT_OK(
      WriteSafetensorsFile(fs, "/m/model.safetensors", Sorted(tensors)));
  HfModelOptions options;
  options.from = "/m/model.safetensors";
  options.wrap = std::vector<std::string>{"blocks.1*", "embed"};
  FLATPARAM_ASSERT_OK_AND_ASSIGN(HfModel m, ModelFromHfCheckpoint(fs, options));
  EXPECT_EQ(m.spec.name, "m");
  std::vector<std::string> fqns = Fqns(m.spec);
  EXPECT_EQ(fqns.front(), "blocks.0.w");
  EXPECT_EQ(fqns[2], "blocks.2.w");
  EXPECT_EQ(fqns[10], "blocks.10.w");
  EXPECT_EQ(fqns.back(), "embed.weight");
  EXPECT_EQ(m.spec.params[0].dtype, DType::kFloat16);
  EXPECT_EQ(m.spec.params.back().dtype, DType::kFloat32);
  EXPECT_EQ(m.order_note,
            "by name, numbered modules by number (no config.json)");
  // Globs stay as given in the file; the layout expands them.
  EXPECT_THAT(m.spec.wrap, ElementsAre("blocks.1*", "embed"));
  EXPECT_EQ(m.wrap_note, "--wrap=blocks.1*,embed");
  EXPECT_EQ(m.units, 5);  // root, blocks.1, blocks.10, blocks.11, embed

  // A --wrap that does not fit names itself and the glob.
  options.wrap = std::vector<std::string>{"layers.*"};
  EXPECT_THAT(ModelFromHfCheckpoint(fs, options),
              StatusIs(kInvalid, HasSubstr("the model of /m with "
                                           "--wrap=layers.* does not lay out: "
                                           "wrap glob \"layers.*\" matches "
                                           "no module")));
  options.wrap = std::vector<std::string>{"blocks.3", "blocks.*"};
  EXPECT_THAT(ModelFromHfCheckpoint(fs, options),
              StatusIs(kInvalid, HasSubstr("\"blocks.3\" is listed twice")));
  // --wrap= (no entries): the root alone, which here mixes dtypes.
  options.wrap = std::vector<std::string>{};
  EXPECT_THAT(ModelFromHfCheckpoint(fs, options),
              StatusIs(kInvalid, AllOf(HasSubstr("with --wrap= does not lay "
                                                 "out"),
                                       HasSubstr("uniform dtype"))));
  options.wrap = std::vector<std::string>{"embed"};
  FLATPARAM_ASSERT_OK_AND_ASSIGN(m, ModelFromHfCheckpoint(fs, options));
  EXPECT_EQ(m.units, 2);
}

TEST(ModelFromHfCheckpointTest, TiedEmbeddings) {
  FaultInjectionFileSystem fs;
  FLATPARAM_ASSERT_OK(fs.CreateDir("/tied"));
  FLATPARAM_ASSERT_OK(WriteSafetensorsFile(fs, "/tied/model.safetensors",
                                           Sorted(TinyLlama(false))));
  WriteConfig(
      fs, "/tied",
      {{"architectures", {"LlamaForCausalLM"}}, {"tie_word_embeddings", true}});
  HfModelOptions options;
  options.from = "/tied";
  FLATPARAM_ASSERT_OK_AND_ASSIGN(HfModel m, ModelFromHfCheckpoint(fs, options));
  EXPECT_THAT(Fqns(m.spec), ElementsAreArray(Names(TinyLlama(false))));
  EXPECT_THAT(m.tie_note, HasSubstr("files hold no lm_head.weight: the model "
                                    "file lists none"));

  // lm_head.weight present: a parameter of its own.
  FLATPARAM_ASSERT_OK(WriteSafetensorsFile(fs, "/tied/model.safetensors",
                                           Sorted(TinyLlama(true))));
  FLATPARAM_ASSERT_OK_AND_ASSIGN(m, ModelFromHfCheckpoint(fs, options));
  EXPECT_EQ(m.spec.params.back().fqn, "lm_head.weight");
  EXPECT_TRUE(m.spec.params.back().tied_to.empty());
  EXPECT_THAT(m.tie_note, HasSubstr("it is a parameter of its own"));

  // An unknown architecture: by name.
  WriteConfig(fs, "/tied", {{"architectures", {"FooForCausalLM"}}});
  FLATPARAM_ASSERT_OK_AND_ASSIGN(m, ModelFromHfCheckpoint(fs, options));
  EXPECT_EQ(m.spec.params.front().fqn, "lm_head.weight");
  EXPECT_THAT(m.order_note, HasSubstr("FooForCausalLM has no known module"));
  EXPECT_EQ(m.tie_note, "");

  WriteConfig(fs, "/tied", json::array());
  EXPECT_THAT(ModelFromHfCheckpoint(fs, options),
              StatusIs(kInvalid, HasSubstr("/tied/config.json: expected a "
                                           "JSON object, got array")));
}

TEST(ModelFromHfCheckpointTest, IntegerTensorsDoNotLayOut) {
  FaultInjectionFileSystem fs;
  FLATPARAM_ASSERT_OK(fs.CreateDir("/bert"));
  FLATPARAM_ASSERT_OK(WriteSafetensorsFile(
      fs, "/bert/model.safetensors",
      {{"embeddings.position_ids", DType::kInt64, {1, 4}},
       {"embeddings.word.weight", DType::kFloat32, {4, 2}}}));
  HfModelOptions options;
  options.from = "/bert";
  EXPECT_THAT(ModelFromHfCheckpoint(fs, options),
              StatusIs(kInvalid, HasSubstr("the model of /bert with the "
                                           "default --wrap= does not lay "
                                           "out")));
  options.from = "/nothing";
  EXPECT_THAT(ModelFromHfCheckpoint(fs, options),
              StatusIs(absl::StatusCode::kNotFound));
}

TEST(ModelFileTextTest, OneParameterPerLine) {
  ModelSpec spec;
  spec.name = "m";
  spec.params = {{"a.weight", {2, 3}, DType::kBFloat16},
                 {"b", {}, DType::kFloat32, false},
                 {"c", {}, DType::kFloat32, true, "a.weight"}};
  spec.wrap = {"a", "x.*"};
  EXPECT_EQ(ModelFileText(spec),
            "{\n"
            "  \"name\": \"m\",\n"
            "  \"params\": [\n"
            "    {\"fqn\": \"a.weight\", \"shape\": [2, 3], \"dtype\": "
            "\"bfloat16\", \"requires_grad\": true},\n"
            "    {\"fqn\": \"b\", \"shape\": [], \"dtype\": \"float32\", "
            "\"requires_grad\": false},\n"
            "    {\"fqn\": \"c\", \"tied_to\": \"a.weight\"}\n"
            "  ],\n"
            "  \"wrap\": [\"a\", \"x.*\"]\n"
            "}\n");
}

std::string Tmp(const std::string& name) {
  const char* t = std::getenv("TEST_TMPDIR");
  return std::string(t != nullptr ? t : "/tmp") + "/" + name;
}

TEST(ModelCommandTest, ValidatesFlags) {
  ModelCommand c;
  EXPECT_THAT(ValidateModelCommand(c),
              StatusIs(kInvalid, HasSubstr("needs --from")));
  c.from = "/x";
  EXPECT_THAT(ValidateModelCommand(c), IsOk());
  c.overwrite = true;
  EXPECT_THAT(ValidateModelCommand(c),
              StatusIs(kInvalid, HasSubstr("--overwrite only with --out")));
  c.out = "/m.json";
  EXPECT_THAT(ValidateModelCommand(c), IsOk());
  c.wrap = "a,";
  EXPECT_THAT(ValidateModelCommand(c), StatusIs(kInvalid, HasSubstr("--wrap")));
  c.wrap = "";
  EXPECT_THAT(ValidateModelCommand(c), IsOk());
}

TEST(ModelCommandTest, WritesOnceRefusesThenOverwrites) {
  FileSystem& fs = checkpoint::PosixFileSystem();
  const std::string dir = Tmp("hf-run");
  FLATPARAM_ASSERT_OK(checkpoint::RemoveRecursively(fs, dir));
  FLATPARAM_ASSERT_OK(fs.CreateDir(dir));
  FLATPARAM_ASSERT_OK(WriteSafetensorsFile(fs, dir + "/model.safetensors",
                                           Sorted(TinyLlama())));

  ModelCommand c;
  c.from = dir;
  std::ostringstream out, log;
  FLATPARAM_ASSERT_OK(RunModel(c, out, log));  // to stdout
  FLATPARAM_ASSERT_OK_AND_ASSIGN(ModelSpec spec,
                                 ParseModelSpecJson(out.str(), "stdout"));
  EXPECT_EQ(spec.params.size(), TinyLlama().size());
  EXPECT_THAT(log.str(), HasSubstr("fsdp model: wrote stdout: model "
                                   "\"hf-run\", 30 parameters"));
  EXPECT_THAT(log.str(), HasSubstr("A reconstruction"));

  const std::string file = Tmp("hf-run.json");
  checkpoint::RemoveRecursively(fs, file).IgnoreError();
  c.out = file;
  c.wrap = "model.layers.1";
  out.str("");
  log.str("");
  FLATPARAM_ASSERT_OK(RunModel(c, out, log));
  EXPECT_EQ(out.str(), "");
  EXPECT_THAT(log.str(), HasSubstr(absl::StrCat("wrote ", file, ": model")));
  EXPECT_THAT(log.str(), HasSubstr("in 2 units"));
  FLATPARAM_ASSERT_OK_AND_ASSIGN(spec, LoadModelSpec(file));
  EXPECT_THAT(spec.wrap, ElementsAre("model.layers.1"));

  c.wrap.reset();
  EXPECT_THAT(RunModel(c, out, log),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("exists; pass --overwrite")));
  FLATPARAM_ASSERT_OK_AND_ASSIGN(spec, LoadModelSpec(file));
  EXPECT_THAT(spec.wrap, ElementsAre("model.layers.1"));  // unchanged
  c.overwrite = true;
  FLATPARAM_ASSERT_OK(RunModel(c, out, log));
  FLATPARAM_ASSERT_OK_AND_ASSIGN(spec, LoadModelSpec(file));
  EXPECT_THAT(spec.wrap, ElementsAre("model.layers.*"));
  FLATPARAM_ASSERT_OK_AND_ASSIGN(bool tmp_left, fs.Exists(file + ".tmp"));
  EXPECT_FALSE(tmp_left);

  c.out = dir;
  EXPECT_THAT(RunModel(c, out, log),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("is a directory")));
}

}  // namespace
}  // namespace tools
}  // namespace flatparam
