#include "flatparam/model_layout.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "flatparam/base/status_matchers.h"

namespace flatparam {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::vector<std::string> Fqns(const FlatParamLayout& l) {
  std::vector<std::string> out;
  for (const ParamInfo& p : l.params()) out.push_back(p.fqn);
  return out;
}

ModelSpec TinyModel() {
  ModelSpec m;
  m.name = "tiny";
  m.params = {{"emb.weight", {11, 3}},
              {"seq.0.weight", {3, 3}},
              {"seq.2.weight", {3, 3}},
              {"seq.2.inner.weight", {3}},
              {"seq.2.inner2.weight", {3}},
              {"seq.4.weight", {3, 3}},
              {"seq.4.bias", {3}},
              {"norm.weight", {3}},
              {"head.weight", {}, DType::kFloat32, true, "emb.weight"}};
  m.wrap = {"seq.4", "seq.2", "seq.2.inner"};
  return m;
}

TEST(ModelLayoutTest, UnitsOwnTheirDeepestPrefix) {
  LayoutOptions o;
  o.world_size = 2;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(ModelLayout m,
                                 ModelLayout::Create(TinyModel(), o));
  ASSERT_EQ(m.flat_params().size(), 4u);
  EXPECT_EQ(m.flat_params()[0].unit(), "");
  EXPECT_THAT(Fqns(m.flat_params()[0]),
              ElementsAre("emb.weight", "seq.0.weight", "norm.weight"));
  ASSERT_EQ(m.flat_params()[0].shared_params().size(), 1u);
  EXPECT_EQ(m.flat_params()[0].shared_params()[0].prim_fqn, "emb.weight");
  EXPECT_EQ(m.flat_params()[1].unit(), "seq.2");
  EXPECT_THAT(Fqns(m.flat_params()[1]),
              ElementsAre("seq.2.weight", "seq.2.inner2.weight"));
  EXPECT_EQ(m.flat_params()[2].unit(), "seq.2.inner");
  EXPECT_EQ(m.flat_params()[3].unit(), "seq.4");
  EXPECT_EQ(m.param_numel(), 33 + 9 + 9 + 3 + 3 + 9 + 3 + 3);
}

TEST(ModelLayoutTest, OwningUnitRespectsModuleBoundaries) {
  EXPECT_EQ(OwningUnit("seq.20.weight", {"seq.2"}), "");
  EXPECT_EQ(OwningUnit("seq.2.weight", {"seq.2", "seq"}), "seq.2");
  EXPECT_EQ(OwningUnit("seq.2", {"seq.2"}), "");
}

TEST(ModelLayoutTest, CrossUnitTieIsAnError) {
  ModelSpec m = TinyModel();
  m.params.push_back({"seq.4.tied", {}, DType::kFloat32, true, "norm.weight"});
  EXPECT_THAT(ModelLayout::Create(m, LayoutOptions()),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("\"seq.4.tied\" (unit \"seq.4\") is tied to "
                                 "\"norm.weight\" (unit <root>)")));
}

TEST(ModelLayoutTest, BadWrapPrefixesAreErrors) {
  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  ModelSpec m = TinyModel();
  m.wrap.push_back("seq.9");
  EXPECT_THAT(ModelLayout::Create(m, LayoutOptions()),
              StatusIs(kInvalid, HasSubstr("\"seq.9\" matches no parameter")));
  m = TinyModel();
  m.wrap.push_back("seq.4");
  EXPECT_THAT(ModelLayout::Create(m, LayoutOptions()),
              StatusIs(kInvalid, HasSubstr("listed twice")));
  m = TinyModel();
  m.wrap.push_back("");
  EXPECT_THAT(ModelLayout::Create(m, LayoutOptions()),
              StatusIs(kInvalid, HasSubstr("not a module name")));
  m = TinyModel();
  m.params.clear();
  EXPECT_THAT(ModelLayout::Create(m, LayoutOptions()),
              StatusIs(kInvalid, HasSubstr("no parameters")));
}

// A small transformer: blocks h.0 .. h.11 (h.10 after h.9, as modules
// register), each with attn and mlp, between an embedding and a head.
ModelSpec Blocks() {
  ModelSpec m;
  m.name = "blocks";
  m.params = {{"wte.weight", {8, 2}}};
  for (int i = 0; i < 12; ++i) {
    const std::string b = "h." + std::to_string(i);
    m.params.push_back({b + ".attn.weight", {2, 2}});
    m.params.push_back({b + ".mlp.fc.weight", {2, 2}});
    m.params.push_back({b + ".mlp.proj.weight", {2, 2}});
  }
  m.params.push_back({"ln_f.weight", {2}});
  return m;
}

std::vector<std::string> Units(const ModelLayout& l) {
  std::vector<std::string> out;
  for (const FlatParamLayout& f : l.flat_params()) out.push_back(f.unit());
  return out;
}

TEST(WrapGlobTest, ExpandsInParameterOrder) {
  ModelSpec m = Blocks();
  m.wrap = {"h.*"};
  FLATPARAM_ASSERT_OK_AND_ASSIGN(ModelSpec e, ExpandWrapPatterns(m));
  EXPECT_THAT(e.wrap, ElementsAre("h.0", "h.1", "h.2", "h.3", "h.4", "h.5",
                                  "h.6", "h.7", "h.8", "h.9", "h.10", "h.11"));
  EXPECT_EQ(e.params.size(), m.params.size());

  // ModelLayout::Create expands too, and keeps the expanded list.
  FLATPARAM_ASSERT_OK_AND_ASSIGN(ModelLayout l,
                                 ModelLayout::Create(m, LayoutOptions()));
  EXPECT_EQ(l.spec().wrap, e.wrap);
  ASSERT_EQ(l.flat_params().size(), 13u);
  EXPECT_EQ(l.flat_params()[0].unit(), "");
  EXPECT_THAT(Fqns(l.flat_params()[0]),
              ElementsAre("wte.weight", "ln_f.weight"));
  EXPECT_EQ(l.flat_params()[11].unit(), "h.10");
  EXPECT_THAT(Fqns(l.flat_params()[11]),
              ElementsAre("h.10.attn.weight", "h.10.mlp.fc.weight",
                          "h.10.mlp.proj.weight"));
}

TEST(WrapGlobTest, PlainPrefixesStayWhereTheyAre) {
  ModelSpec m = Blocks();
  m.wrap = {"ln_f", "h.1*", "wte"};
  FLATPARAM_ASSERT_OK_AND_ASSIGN(ModelSpec e, ExpandWrapPatterns(m));
  // "h.1*" is one component: "h.1", "h.10", "h.11", not "h.1.attn".
  EXPECT_THAT(e.wrap, ElementsAre("ln_f", "h.1", "h.10", "h.11", "wte"));
  m.wrap = {"h.3", "h.5"};
  FLATPARAM_ASSERT_OK_AND_ASSIGN(e, ExpandWrapPatterns(m));
  EXPECT_EQ(e.wrap, m.wrap);
}

TEST(WrapGlobTest, NestedGlobs) {
  ModelSpec m = Blocks();
  m.wrap = {"h.*.mlp", "h.1*"};
  FLATPARAM_ASSERT_OK_AND_ASSIGN(ModelLayout l,
                                 ModelLayout::Create(m, LayoutOptions()));
  EXPECT_EQ(l.spec().wrap.size(), 15u);
  // Outer units first, then by first parameter: h.0.mlp, ..., h.1, h.1.mlp.
  EXPECT_THAT(Units(l),
              ElementsAre("", "h.0.mlp", "h.1", "h.1.mlp", "h.2.mlp", "h.3.mlp",
                          "h.4.mlp", "h.5.mlp", "h.6.mlp", "h.7.mlp", "h.8.mlp",
                          "h.9.mlp", "h.10", "h.10.mlp", "h.11", "h.11.mlp"));
  EXPECT_THAT(Fqns(l.flat_params()[2]), ElementsAre("h.1.attn.weight"));
  m.wrap = {"*.*.m*"};
  FLATPARAM_ASSERT_OK_AND_ASSIGN(ModelSpec e, ExpandWrapPatterns(m));
  EXPECT_EQ(e.wrap.size(), 12u);
  EXPECT_EQ(e.wrap[11], "h.11.mlp");
}

TEST(WrapGlobTest, GlobMatchingNothingIsAnError) {
  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  ModelSpec m = Blocks();
  m.wrap = {"layers.*"};
  EXPECT_THAT(ModelLayout::Create(m, LayoutOptions()),
              StatusIs(kInvalid, HasSubstr("wrap glob \"layers.*\" matches "
                                           "no module")));
  // Modules only: "h.*.*.weight" would name parameters, not modules.
  m.wrap = {"h.*.*.weight"};
  EXPECT_THAT(ExpandWrapPatterns(m),
              StatusIs(kInvalid, HasSubstr("\"h.*.*.weight\" matches no")));
  m.wrap = {"*.weight"};  // "wte.weight" is a parameter, not a module
  EXPECT_THAT(ExpandWrapPatterns(m),
              StatusIs(kInvalid, HasSubstr("\"*.weight\" matches no")));
  m.wrap = {"h.*."};
  EXPECT_THAT(ExpandWrapPatterns(m),
              StatusIs(kInvalid, HasSubstr("not a module name")));
}

TEST(WrapGlobTest, APrefixFromTwoEntriesIsAnError) {
  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  ModelSpec m = Blocks();
  m.wrap = {"h.3", "h.*"};
  EXPECT_THAT(ModelLayout::Create(m, LayoutOptions()),
              StatusIs(kInvalid, HasSubstr("wrap prefix \"h.3\" is listed "
                                           "twice: by \"h.3\" and by "
                                           "\"h.*\"")));
  m.wrap = {"h.*", "*.1"};
  EXPECT_THAT(ExpandWrapPatterns(m),
              StatusIs(kInvalid, HasSubstr("\"h.1\" is listed twice: by "
                                           "\"h.*\" and by \"*.1\"")));
  m.wrap = {"h.*", "h.*"};
  EXPECT_THAT(ExpandWrapPatterns(m),
              StatusIs(kInvalid, HasSubstr("\"h.*\" is listed twice")));
}

TEST(WrapGlobTest, TiesAcrossExpandedUnitsAreErrors) {
  ModelSpec m = Blocks();
  m.params.push_back(
      {"h.11.mlp.tied", {}, DType::kFloat32, true, "h.0.attn.weight"});
  m.wrap = {"h.*"};
  EXPECT_THAT(ModelLayout::Create(m, LayoutOptions()),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("\"h.11.mlp.tied\" (unit \"h.11\") is tied "
                                 "to \"h.0.attn.weight\" (unit \"h.0\")")));
  // A tie inside one expanded unit is fine.
  m.params.back().tied_to = "h.11.attn.weight";
  FLATPARAM_ASSERT_OK_AND_ASSIGN(ModelLayout l,
                                 ModelLayout::Create(m, LayoutOptions()));
  ASSERT_EQ(l.flat_params().back().unit(), "h.11");
  EXPECT_EQ(l.flat_params().back().shared_params().size(), 1u);
}

TEST(ModelLayoutTest, EveryParameterInsideUnitsLeavesNoRoot) {
  ModelSpec m;
  m.params = {{"a.w", {2}}, {"b.w", {2}}};
  m.wrap = {"a", "b"};
  FLATPARAM_ASSERT_OK_AND_ASSIGN(ModelLayout l,
                                 ModelLayout::Create(m, LayoutOptions()));
  ASSERT_EQ(l.flat_params().size(), 2u);
  EXPECT_EQ(l.flat_params()[0].unit(), "a");
}

}  // namespace
}  // namespace flatparam
