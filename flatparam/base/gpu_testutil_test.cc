#include "flatparam/base/gpu_testutil.h"

#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>

#include <cstdlib>

namespace flatparam {
namespace {

void NoGpuHere() { FLATPARAM_SKIP_WITHOUT_GPU("no usable GPU: none here"); }

TEST(GpuTestingTest, OnlyTheValueOneRequiresAGpu) {
  ASSERT_EQ(unsetenv("FLATPARAM_REQUIRE_GPU"), 0);
  EXPECT_FALSE(GpuRequiredByEnvironment());
  ASSERT_EQ(setenv("FLATPARAM_REQUIRE_GPU", "0", 1), 0);
  EXPECT_FALSE(GpuRequiredByEnvironment());
  ASSERT_EQ(setenv("FLATPARAM_REQUIRE_GPU", "1", 1), 0);
  EXPECT_TRUE(GpuRequiredByEnvironment());
  ASSERT_EQ(unsetenv("FLATPARAM_REQUIRE_GPU"), 0);
}

// Required, the missing GPU fails the test, naming the reason.
TEST(GpuTestingTest, RequiredMakesTheSkipAFailure) {
  ASSERT_EQ(setenv("FLATPARAM_REQUIRE_GPU", "1", 1), 0);
  EXPECT_FATAL_FAILURE(NoGpuHere(),
                       "FLATPARAM_REQUIRE_GPU=1, so a missing GPU is a "
                       "failure, not a skip: no usable GPU: none here");
  ASSERT_EQ(unsetenv("FLATPARAM_REQUIRE_GPU"), 0);
}

// Not required, it is a skip (so this test ends skipped, not failed).
TEST(GpuTestingTest, NotRequiredSkips) {
  ASSERT_EQ(unsetenv("FLATPARAM_REQUIRE_GPU"), 0);
  NoGpuHere();
  EXPECT_TRUE(IsSkipped());
  EXPECT_FALSE(HasFailure());
}

}  // namespace
}  // namespace flatparam
