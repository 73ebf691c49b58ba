// main() of the LibTorch tests that compare bits: one intra-op thread, so
// that LibTorch's kernels reduce in one order in every run.
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

int main(int argc, char** argv) {
  at::set_num_threads(1);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
