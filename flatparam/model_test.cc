#include "flatparam/model.h"

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
