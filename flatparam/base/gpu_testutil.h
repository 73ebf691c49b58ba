// GPU tests on machines without a GPU. CI machines have none, so a GPU test
// skips there with its reason ("no usable GPU: ..."); on a machine that is
// meant to have one, a skip would hide the failure. With
// FLATPARAM_REQUIRE_GPU=1 in the environment (the GPU bundle's run script
// sets it) the same condition is a test failure instead.
//
// Thread-safety: reads the environment; call from the test's thread.
#ifndef FLATPARAM_BASE_GPU_TESTUTIL_H_
#define FLATPARAM_BASE_GPU_TESTUTIL_H_

#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>

namespace flatparam {

// True when FLATPARAM_REQUIRE_GPU is "1".
inline bool GpuRequiredByEnvironment() {
  const char* v = std::getenv("FLATPARAM_REQUIRE_GPU");
  return v != nullptr && std::strcmp(v, "1") == 0;
}

}  // namespace flatparam

// Ends the current test (or SetUp) because the GPU or CUDA/NCCL it needs is
// not there, with `why`: a skip, or under FLATPARAM_REQUIRE_GPU=1 a fatal
// failure. Only for "no GPU" conditions; a test that needs more GPUs than
// the machine has still skips.
#define FLATPARAM_SKIP_WITHOUT_GPU(why)                                 \
  do {                                                                  \
    if (::flatparam::GpuRequiredByEnvironment()) {                      \
      GTEST_FAIL() << "FLATPARAM_REQUIRE_GPU=1, so a missing GPU is a " \
                      "failure, not a skip: "                           \
                   << (why);                                            \
    }                                                                   \
    GTEST_SKIP() << (why);                                              \
  } while (0)

#endif  // FLATPARAM_BASE_GPU_TESTUTIL_H_
