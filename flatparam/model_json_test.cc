#include "flatparam/model_json.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>

#include "flatparam/base/status_matchers.h"
#include "flatparam/presets.h"

namespace flatparam {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::StartsWith;

constexpr absl::StatusCode kInvalid = absl::StatusCode::kInvalidArgument;

void ExpectSameSpec(const ModelSpec& a, const ModelSpec& b) {
  EXPECT_EQ(a.name, b.name);
  EXPECT_EQ(a.wrap, b.wrap);
  ASSERT_EQ(a.params.size(), b.params.size());
  for (size_t i = 0; i < a.params.size(); ++i) {
    const ParamSpec& x = a.params[i];
    const ParamSpec& y = b.params[i];
    EXPECT_EQ(x.fqn, y.fqn) << i;
    EXPECT_EQ(x.tied_to, y.tied_to) << x.fqn;
    if (!x.tied_to.empty()) continue;
    EXPECT_EQ(x.shape, y.shape) << x.fqn;
    EXPECT_EQ(x.dtype, y.dtype) << x.fqn;
    EXPECT_EQ(x.requires_grad, y.requires_grad) << x.fqn;
  }
}

TEST(ModelJsonTest, ParsesTheIssueExample) {
  FLATPARAM_ASSERT_OK_AND_ASSIGN(ModelSpec spec,
                                 ParseModelSpecJson(R"({"params": [
          {"fqn": "emb.weight", "shape": [11, 3], "dtype": "float32",
           "requires_grad": true},
          {"fqn": "seq.2.weight", "shape": [7, 3], "dtype": "torch.bfloat16",
           "requires_grad": false},
          {"fqn": "seq.4.scale", "shape": []},
          {"fqn": "head.weight", "tied_to": "emb.weight"}],
        "wrap": ["seq.2", "seq.4"]})",
                                                    "example.json"));
  EXPECT_EQ(spec.name, "example.json");  // Defaults to the source name.
  ASSERT_EQ(spec.params.size(), 4);
  EXPECT_EQ(spec.params[0].fqn, "emb.weight");
  EXPECT_THAT(spec.params[0].shape, ElementsAre(11, 3));
  EXPECT_EQ(spec.params[0].dtype, DType::kFloat32);
  EXPECT_TRUE(spec.params[0].requires_grad);
  EXPECT_EQ(spec.params[1].dtype, DType::kBFloat16);
  EXPECT_FALSE(spec.params[1].requires_grad);
  EXPECT_TRUE(spec.params[2].shape.empty());
  EXPECT_EQ(spec.params[2].dtype, DType::kFloat32);  // The default.
  EXPECT_TRUE(spec.params[2].requires_grad);         // The default.
  EXPECT_EQ(spec.params[3].tied_to, "emb.weight");
  EXPECT_THAT(spec.wrap, ElementsAre("seq.2", "seq.4"));
}

TEST(ModelJsonTest, NameAndMissingWrap) {
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      ModelSpec spec,
      ParseModelSpecJson(
          R"({"name": "m", "params": [{"fqn": "w", "shape": [2]}]})",
          "x.json"));
  EXPECT_EQ(spec.name, "m");
  EXPECT_TRUE(spec.wrap.empty());
}

TEST(ModelJsonTest, WrapGlobsAreKeptAndExpandWhenLaidOut) {
  const std::string text = R"({"params": [
      {"fqn": "emb.weight", "shape": [4, 2]},
      {"fqn": "layers.0.w", "shape": [2]},
      {"fqn": "layers.1.w", "shape": [2]},
      {"fqn": "head.weight", "tied_to": "emb.weight"}],
    "wrap": ["layers.*"]})";
  FLATPARAM_ASSERT_OK_AND_ASSIGN(ModelSpec spec,
                                 ParseModelSpecJson(text, "glob.json"));
  EXPECT_THAT(spec.wrap, ElementsAre("layers.*"));
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      ModelSpec again, ParseModelSpecJson(ModelSpecToJson(spec).dump(), "x"));
  again.name = spec.name;
  ExpectSameSpec(spec, again);
  FLATPARAM_ASSERT_OK_AND_ASSIGN(ModelLayout layout,
                                 ModelLayout::Create(spec, LayoutOptions()));
  EXPECT_THAT(layout.spec().wrap, ElementsAre("layers.0", "layers.1"));
  EXPECT_THAT(ModelSpecToJson(layout.spec())["wrap"],
              ElementsAre("layers.0", "layers.1"));
}

// Exporters repeat a tied parameter's shape and dtype; agreeing fields
// (through a chain of ties too) give the same spec as the bare tie.
TEST(ModelJsonTest, TiedEntriesMayRepeatTheirTargetsFields) {
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      ModelSpec bare, ParseModelSpecJson(
                          R"({"params": [{"fqn": "emb.weight", "shape": [4, 2],
                           "dtype": "bfloat16", "requires_grad": false},
                          {"fqn": "head.weight", "tied_to": "emb.weight"},
                          {"fqn": "out.weight", "tied_to": "head.weight"}]})",
                          "m.json"));
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      ModelSpec repeated,
      ParseModelSpecJson(
          R"({"params": [{"fqn": "emb.weight", "shape": [4, 2],
                           "dtype": "bfloat16", "requires_grad": false},
                          {"fqn": "head.weight", "tied_to": "emb.weight",
                           "shape": [4, 2], "dtype": "bfloat16",
                           "requires_grad": false},
                          {"fqn": "out.weight", "tied_to": "head.weight",
                           "shape": [4, 2]}]})",
          "m.json"));
  EXPECT_EQ(ModelSpecToJson(repeated), ModelSpecToJson(bare));
}

TEST(ModelJsonTest, IntegerDtypesParse) {
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      ModelSpec spec,
      ParseModelSpecJson(
          R"({"params": [{"fqn": "ids", "shape": [4], "dtype": "int64"}]})",
          "x.json"));
  EXPECT_EQ(spec.params[0].dtype, DType::kInt64);
}

// Line and column are 1-based and point at the offending character.
TEST(ModelJsonTest, MalformedJsonReportsLineAndColumn) {
  EXPECT_THAT(ParseModelSpecJson("{\n  \"params\": [\n    {\"fqn\": x}\n]}",
                                 "bad.json"),
              StatusIs(kInvalid, AllOf(StartsWith("bad.json:3:13: "),
                                       HasSubstr("malformed JSON"))));
  EXPECT_THAT(ParseModelSpecJson("{\"params\": [1, 2,]}", "trailing.json"),
              StatusIs(kInvalid, StartsWith("trailing.json:1:18: ")));
  EXPECT_THAT(ParseModelSpecJson("{\"params\": [", "short.json"),
              StatusIs(kInvalid, AllOf(StartsWith("short.json:1:13: "),
                                       HasSubstr("end of input"))));
  EXPECT_THAT(ParseModelSpecJson("", "empty.json"),
              StatusIs(kInvalid, StartsWith("empty.json:1:1: ")));
}

TEST(ModelJsonTest, SchemaErrorsNameTheJsonPath) {
  struct Case {
    const char* text;
    const char* message;
  };
  const Case cases[] = {
      {"[]", "m.json: (top level): expected an object"},
      {R"({"params": [], "wrapp": []})",
       "(top level): unknown key \"wrapp\" (allowed keys: name, params, "
       "wrap, buffers)"},
      {R"({"wrap": []})", "(top level): missing key \"params\""},
      {R"({"params": {}})",
       "params: expected an array of parameters, got "
       "object"},
      {R"({"params": [{"fqn": "a", "shape": [1]}, 3]})",
       "params[1]: expected an object, got number 3"},
      {R"({"params": [{"shape": [1]}]})", "params[0]: missing key \"fqn\""},
      {R"({"params": [{"fqn": 7, "shape": [1]}]})",
       "params[0].fqn: expected a string, got number 7"},
      {R"({"params": [{"fqn": "a..b", "shape": [1]}]})",
       "params[0].fqn: \"a..b\" is not a dotted parameter name"},
      {R"({"params": [{"fqn": "a"}]})",
       "params[0]: parameter \"a\" is missing \"shape\""},
      {R"({"params": [{"fqn": "a", "shape": 3}]})",
       "params[0].shape: expected an array of integers, got number 3"},
      {R"({"params": [{"fqn": "a", "shape": [1]}, {"fqn": "b", "shape": [4, -2]}]})",
       "params[1].shape[1]: expected a non-negative integer, got number -2"},
      {R"({"params": [{"fqn": "a", "shape": [1.5]}]})",
       "params[0].shape[0]: expected a non-negative integer, got number 1.5"},
      {R"({"params": [{"fqn": "a", "shape": [18446744073709551615]}]})",
       "params[0].shape[0]: expected a non-negative integer"},
      {R"({"params": [{"fqn": "a", "shape": [4294967296, 4294967296]}]})",
       "params[0].shape: parameter \"a\" has more than"},
      {R"({"params": [{"fqn": "a", "shape": [1], "dtype": "float8"}]})",
       "params[0].dtype: "},
      {R"({"params": [{"fqn": "a", "shape": [1], "requires_grad": 1}]})",
       "params[0].requires_grad: expected true or false, got number 1"},
      {R"({"params": [{"fqn": "a", "shape": [1], "grad": true}]})",
       "params[0]: unknown key \"grad\""},
      {R"({"params": [{"fqn": "a", "shape": [1]}, {"fqn": "b", "tied_to": "a", "shape": [2]}]})",
       "params[1]: tied parameter \"b\" has shape [2], but \"a\", whose "
       "tensor it shares, has [1]"},
      {R"({"params": [{"fqn": "a", "shape": [1]}, {"fqn": "b", "tied_to": "a", "dtype": "bfloat16"}]})",
       "params[1]: tied parameter \"b\" has dtype bfloat16, but \"a\", "
       "whose tensor it shares, has float32"},
      {R"({"params": [{"fqn": "a", "shape": [1], "requires_grad": false}, {"fqn": "b", "tied_to": "a", "requires_grad": true}]})",
       "params[1]: tied parameter \"b\" has requires_grad true, but \"a\""},
      {R"({"params": [{"fqn": "b", "tied_to": "a", "shape": [1]}, {"fqn": "a", "shape": [1]}]})",
       "params[0]: tied parameter \"b\" repeats shape, dtype or "
       "requires_grad, but \"a\" is not an earlier parameter"},
      {R"({"params": [{"fqn": "a", "shape": [1]}, {"fqn": "b", "tied_to": "a", "shape": [-1]}]})",
       "params[1].shape[0]: expected a non-negative integer"},
      {R"({"params": [{"fqn": "a", "shape": [1]}, {"fqn": "b", "tied_to": ""}]})",
       "params[1].tied_to: expected a parameter name"},
      {R"({"params": [{"fqn": "a", "shape": [1]}], "wrap": "a"})",
       "wrap: expected an array of module prefixes"},
      {R"({"params": [{"fqn": "a", "shape": [1]}], "wrap": ["x", ""]})",
       "wrap[1]: \"\" is not a module prefix"},
      {R"({"params": [{"fqn": "a", "shape": [1]}], "wrap": [null]})",
       "wrap[0]: expected a string, got null"},
  };
  for (const Case& c : cases) {
    EXPECT_THAT(
        ParseModelSpecJson(c.text, "m.json"),
        StatusIs(kInvalid, AllOf(StartsWith("m.json: "), HasSubstr(c.message))))
        << c.text;
  }
}

TEST(ModelJsonTest, RoundTripsEveryPreset) {
  for (const std::string& name : PresetNames()) {
    FLATPARAM_ASSERT_OK_AND_ASSIGN(ModelSpec preset, PresetModel(name));
    FLATPARAM_ASSERT_OK_AND_ASSIGN(
        ModelSpec parsed,
        ParseModelSpecJson(ModelSpecToJson(preset).dump(), "roundtrip"));
    ExpectSameSpec(parsed, preset);
  }
}

TEST(ModelJsonTest, ToJsonWritesTiesWithoutShape) {
  FLATPARAM_ASSERT_OK_AND_ASSIGN(ModelSpec gpt2, PresetModel("gpt2"));
  const nlohmann::json j = ModelSpecToJson(gpt2);
  EXPECT_EQ(j["name"], "gpt2");
  EXPECT_EQ(j["params"][0]["shape"], nlohmann::json({50257, 768}));
  EXPECT_EQ(j["params"][0]["dtype"], "float32");
  EXPECT_EQ(j["params"].back(),
            nlohmann::json({{"fqn", "lm_head.weight"},
                            {"tied_to", "transformer.wte.weight"}}));
  EXPECT_EQ(j["wrap"][3], "transformer.h.3");
}

TEST(ModelJsonTest, BuffersRoundTripAndAreWrittenOnlyWhenThereAreAny) {
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      ModelSpec spec,
      ParseModelSpecJson(R"({"params": [{"fqn": "bn.weight", "shape": [5]}],
                             "buffers": [
                               {"fqn": "bn.running_mean", "shape": [5]},
                               {"fqn": "bn.num_batches_tracked", "shape": [],
                                "dtype": "int64"}]})",
                         "m.json"));
  ASSERT_EQ(spec.buffers.size(), 2u);
  EXPECT_EQ(spec.buffers[0],
            (BufferSpec{"bn.running_mean", {5}, DType::kFloat32}));
  EXPECT_EQ(spec.buffers[1],
            (BufferSpec{"bn.num_batches_tracked", {}, DType::kInt64}));
  const nlohmann::json j = ModelSpecToJson(spec);
  FLATPARAM_ASSERT_OK_AND_ASSIGN(ModelSpec back,
                                 ParseModelSpecJson(j.dump(), "again"));
  EXPECT_EQ(back.buffers, spec.buffers);
  spec.buffers.clear();
  EXPECT_FALSE(ModelSpecToJson(spec).contains("buffers"));

  const std::vector<std::pair<std::string, std::string>> errors = {
      {R"({"params": [], "buffers": {}})",
       "buffers: expected an array of buffers"},
      {R"({"params": [], "buffers": [{"fqn": "b"}]})",
       "buffers[0]: missing key \"shape\""},
      {R"({"params": [], "buffers": [{"shape": [1]}]})",
       "buffers[0]: missing key \"fqn\""},
      {R"({"params": [], "buffers": [{"fqn": "b.", "shape": [1]}]})",
       "buffers[0].fqn: \"b.\" is not a dotted name"},
      {R"({"params": [], "buffers": [{"fqn": "b", "shape": [-1]}]})",
       "buffers[0].shape[0]: expected a non-negative integer"},
      {R"({"params": [], "buffers": [{"fqn": "b", "shape": [], "x": 1}]})",
       "buffers[0]: unknown key \"x\""},
  };
  for (const auto& [text, message] : errors) {
    EXPECT_THAT(
        ParseModelSpecJson(text, "m.json"),
        StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(message)))
        << text;
  }
}

TEST(ModelJsonTest, LoadModelSpecPresetAndFile) {
  FLATPARAM_ASSERT_OK_AND_ASSIGN(ModelSpec preset, LoadModelSpec("llama3-8b"));
  EXPECT_EQ(preset.name, "llama3-8b");

  const std::string path =
      std::string(std::getenv("TEST_TMPDIR")) + "/model.json";
  std::FILE* f = std::fopen(path.c_str(), "w");
  ASSERT_NE(f, nullptr);
  std::fputs(R"({"params": [{"fqn": "w", "shape": [2, 2]}]})", f);
  std::fclose(f);
  FLATPARAM_ASSERT_OK_AND_ASSIGN(ModelSpec spec, LoadModelSpec(path));
  EXPECT_EQ(spec.name, path);
  EXPECT_THAT(spec.params[0].shape, ElementsAre(2, 2));
}

// `fsdp inspect --model=x.json` on hostile files: 100,000 levels of
// nesting used to overflow the stack when describing "name"; a number too
// large for a double used to escape as an uncaught nlohmann exception.
TEST(ModelJsonTest, HostileFilesAreErrorsNotCrashes) {
  const std::string path =
      std::string(std::getenv("TEST_TMPDIR")) + "/deep_model.json";
  std::FILE* f = std::fopen(path.c_str(), "w");
  ASSERT_NE(f, nullptr);
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  const std::string text = R"({"name": )" + deep + R"(, "params": []})";
  std::fputs(text.c_str(), f);
  std::fclose(f);
  EXPECT_THAT(LoadModelSpec(path),
              StatusIs(kInvalid, StartsWith(path + ": nested deeper than 512 "
                                                   "levels")));
  EXPECT_THAT(
      ParseModelSpecJson(R"({"params": [{"fqn": "w", "shape": [1e999]}]})",
                         "big.json"),
      StatusIs(kInvalid, StartsWith("big.json: malformed JSON: number "
                                    "overflow parsing '1e999'")));
}

TEST(ModelJsonTest, LoadModelSpecErrors) {
  EXPECT_THAT(LoadModelSpec("/nonexistent/model.json"),
              StatusIs(absl::StatusCode::kNotFound,
                       AllOf(HasSubstr("/nonexistent/model.json"),
                             HasSubstr("gpt2, "), HasSubstr("llama2-70b"))));
  EXPECT_THAT(LoadModelSpec("gpt-2"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("\"gpt-2\"")));
  EXPECT_THAT(LoadModelSpec(std::getenv("TEST_TMPDIR")),
              StatusIs(kInvalid, HasSubstr("is a directory")));
}

}  // namespace
}  // namespace flatparam
