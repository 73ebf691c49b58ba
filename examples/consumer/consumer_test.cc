#include <gtest/gtest.h>

#include <vector>

#include "flatparam/layout.h"

TEST(ConsumerTest, LaysOutThroughTheDependency) {
  std::vector<flatparam::ParamSpec> params = {{"w", {5, 7}}, {"b", {5}}};
  flatparam::LayoutOptions options;
  options.world_size = 8;
  auto layout = flatparam::FlatParamLayout::Create("", params, options);
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_EQ(layout->sharded_numel(), 5);  // ceil(40 / 8)
  EXPECT_EQ(layout->padded_unsharded_numel(), 40);
}
