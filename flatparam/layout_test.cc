#include "flatparam/layout.h"

#include <gtest/gtest.h>

namespace flatparam {
namespace {

TEST(LayoutTest, Smoke) {
  std::vector<ParamSpec> params = {{"fc.weight", {3, 5}}, {"fc.bias", {3}}};
  LayoutOptions o;
  o.world_size = 4;
  auto l = FlatParamLayout::Create("", params, o);
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_EQ(l->sharded_numel(), 5);
}

}  // namespace
}  // namespace flatparam
