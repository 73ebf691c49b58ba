// Checks that the CUDA runtime and NCCL found by cuda_configure link and
// load. Without a GPU (or a driver) the device part is skipped with a
// message; without a CUDA installation the whole test is skipped.
#include <gtest/gtest.h>

#ifdef FLATPARAM_HAVE_CUDA
#include <cuda_runtime.h>
#include <nccl.h>
#endif

namespace {

TEST(CudaSmokeTest, RuntimeAndNcclLink) {
#ifndef FLATPARAM_HAVE_CUDA
  GTEST_SKIP() << "built without CUDA (no CUDA installation was detected)";
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
    GTEST_SKIP() << "no usable GPU: " << cudaGetErrorString(err)
                 << " (CUDA runtime " << runtime_version << ", NCCL "
                 << nccl_version << " linked fine)";
  }
  EXPECT_EQ(cudaSetDevice(0), cudaSuccess);
#endif
}

}  // namespace
