// Checks that the CUDA runtime and NCCL found by cuda_configure link and
// load. Without a GPU (or a driver) the device part is skipped with a
// message; without a CUDA installation the whole test is skipped; under
// FLATPARAM_REQUIRE_GPU=1 either is a failure (flatparam/base/gpu_testutil.h).
#include <gtest/gtest.h>

#include <string>

#include "flatparam/base/gpu_testutil.h"

#ifdef FLATPARAM_HAVE_CUDA
#include <cuda_runtime.h>
#include <nccl.h>
#endif

namespace {

TEST(CudaSmokeTest, RuntimeAndNcclLink) {
#ifndef FLATPARAM_HAVE_CUDA
  FLATPARAM_SKIP_WITHOUT_GPU(
      "built without CUDA (no CUDA installation was detected)");
#else
  int nccl_version = 0;
  ASSERT_EQ(ncclGetVersion(&nccl_version), ncclSuccess);
  EXPECT_GE(nccl_version, 20000) << "NCCL version code " << nccl_version;
  int runtime_version = 0;
  ASSERT_EQ(cudaRuntimeGetVersion(&runtime_version), cudaSuccess);
  EXPECT_GT(runtime_version, 0);
  int devices = 0;
  const cudaError_t err = cudaGetDeviceCount(&devices);
  if (err != cudaSuccess || devices == 0) {
    FLATPARAM_SKIP_WITHOUT_GPU(
        "no usable GPU: " + std::string(cudaGetErrorString(err)) +
        " (CUDA runtime " + std::to_string(runtime_version) + ", NCCL " +
        std::to_string(nccl_version) + " linked fine)");
  }
  EXPECT_EQ(cudaSetDevice(0), cudaSuccess);
#endif
}

}  // namespace
