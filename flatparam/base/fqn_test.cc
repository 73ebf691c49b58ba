#include "flatparam/base/fqn.h"

#include <gtest/gtest.h>

namespace flatparam {
namespace {

TEST(CleanTensorNameTest, RemovesWrapperPrefixesAtEveryDepth) {
  EXPECT_EQ(CleanTensorName("layers.0.w"), "layers.0.w");
  EXPECT_EQ(CleanTensorName(""), "");
  EXPECT_EQ(CleanTensorName("_fsdp_wrapped_module.w"), "w");
  EXPECT_EQ(CleanTensorName("_fsdp_wrapped_module.layers.0."
                            "_fsdp_wrapped_module._flat_param"),
            "layers.0._flat_param");
  EXPECT_EQ(CleanTensorName("_fsdp_wrapped_module.layers.0."
                            "_fsdp_wrapped_module."
                            "_checkpoint_wrapped_module.mlp.w"),
            "layers.0.mlp.w");
  EXPECT_EQ(CleanTensorName("_orig_mod.model.norm.weight"),
            "model.norm.weight");
  EXPECT_EQ(CleanTensorName("a._orig_mod._fsdp_wrapped_module.b"), "a.b");
  EXPECT_EQ(CleanTensorName("a._orig_mod"), "a");
}

TEST(CleanTensorNameTest, IsPythonsStrReplace) {
  // str.replace removes the prefix wherever it occurs, even mid-component.
  EXPECT_EQ(CleanTensorName("x_fsdp_wrapped_module.y"), "xy");
  EXPECT_EQ(CleanTensorName("x_checkpoint_wrapped_module.y"), "xy");
  // FSDP's prefix first, then the checkpoint wrapper's: removing the first
  // can form the second.
  EXPECT_EQ(CleanTensorName("_checkpoint_wrapped_fsdp_wrapped_module."
                            "_module.w"),
            "w");
  // Without the dot nothing is removed.
  EXPECT_EQ(CleanTensorName("a._fsdp_wrapped_module"),
            "a._fsdp_wrapped_module");
  // _orig_mod only as a whole component.
  EXPECT_EQ(CleanTensorName("my_orig_mod.w"), "my_orig_mod.w");
  EXPECT_EQ(CleanTensorName("_orig_mod_x.w"), "_orig_mod_x.w");
}

}  // namespace
}  // namespace flatparam
