// CudaStatus and CudaDeviceGuard, the CUDA helpers CudaDeviceOps and the
// NCCL backend share, on FakeCudaRuntime; and the real runtime's error
// strings, which need libcudart but no GPU.
#include "flatparam/device/cuda/cuda_runtime.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "flatparam/base/status_matchers.h"
#include "flatparam/device/cuda/fake_cuda_runtime.h"

namespace flatparam {
namespace {

using ::testing::HasSubstr;

TEST(CudaStatusTest, SuccessIsOk) {
  FakeCudaRuntime rt;
  EXPECT_THAT(CudaStatus(rt, cudaSuccess, "ctx"), IsOk());
}

TEST(CudaStatusTest, MapsErrors) {
  FakeCudaRuntime rt;
  EXPECT_THAT(
      CudaStatus(rt, cudaErrorInsufficientDriver, "ctx"),
      StatusIs(absl::StatusCode::kFailedPrecondition,
               HasSubstr("ctx: CUDA cudaErrorInsufficientDriver (35)")));
  EXPECT_THAT(CudaStatus(rt, cudaErrorNoDevice, "ctx"),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(CudaStatus(rt, cudaErrorInitializationError, "ctx"),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(CudaStatus(rt, cudaErrorInvalidDevice, "ctx"),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(CudaStatus(rt, cudaErrorInvalidValue, "ctx"),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(CudaStatus(rt, cudaErrorMemoryAllocation, "ctx"),
              StatusIs(absl::StatusCode::kResourceExhausted));
  EXPECT_THAT(CudaStatus(rt, cudaErrorIllegalAddress, "ctx"),
              StatusIs(absl::StatusCode::kInternal,
                       HasSubstr("cudaErrorIllegalAddress (700)")));
}

// A reported error must not resurface as the next kernel launch's own.
TEST(CudaStatusTest, ClearsTheThreadsLastError) {
  FakeCudaRuntime rt;
  EXPECT_EQ(rt.SetDevice(7), cudaErrorInvalidDevice);
  ASSERT_EQ(rt.PeekAtLastError(), cudaErrorInvalidDevice);
  EXPECT_THAT(CudaStatus(rt, cudaErrorInvalidDevice, "ctx"),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_EQ(rt.PeekAtLastError(), cudaSuccess);
}

TEST(CudaDeviceGuardTest, RestoresTheCallersDevice) {
  FakeCudaRuntime::Options options;
  options.device_count = 3;
  FakeCudaRuntime rt(options);
  ASSERT_EQ(rt.SetDevice(2), cudaSuccess);
  {
    CudaDeviceGuard guard(rt);
    ASSERT_THAT(guard.Set(1, "ctx"), IsOk());
    int device = -1;
    ASSERT_EQ(rt.GetDevice(&device), cudaSuccess);
    EXPECT_EQ(device, 1);
    ASSERT_THAT(guard.Set(0, "ctx"), IsOk());  // still restores to 2
  }
  int device = -1;
  ASSERT_EQ(rt.GetDevice(&device), cudaSuccess);
  EXPECT_EQ(device, 2);
}

TEST(CudaDeviceGuardTest, LeavesTheDeviceAloneWhenAlreadyCurrent) {
  FakeCudaRuntime::Options options;
  options.device_count = 2;
  FakeCudaRuntime rt(options);
  ASSERT_EQ(rt.SetDevice(1), cudaSuccess);
  {
    CudaDeviceGuard guard(rt);
    ASSERT_THAT(guard.Set(1, "ctx"), IsOk());
    // Changed behind the guard's back: not the guard's to restore.
    ASSERT_EQ(rt.SetDevice(0), cudaSuccess);
  }
  int device = -1;
  ASSERT_EQ(rt.GetDevice(&device), cudaSuccess);
  EXPECT_EQ(device, 0);
}

TEST(CudaDeviceGuardTest, ABadDeviceIsAnErrorNamingTheCall) {
  FakeCudaRuntime rt;
  CudaDeviceGuard guard(rt);
  EXPECT_THAT(guard.Set(4, "rank 3: create stream"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("rank 3: create stream: cudaSetDevice(4): "
                                 "CUDA cudaErrorInvalidDevice")));
  EXPECT_EQ(rt.PeekAtLastError(), cudaSuccess);
}

TEST(CudaDeviceGuardTest, AFailedQueryIsReported) {
  FakeCudaRuntime rt;
  rt.FailNext("cudaGetDevice", cudaErrorInsufficientDriver);
  CudaDeviceGuard guard(rt);
  EXPECT_THAT(guard.Set(0, "ctx"),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("ctx: cudaGetDevice: CUDA")));
}

// The real runtime's names and strings; no GPU is needed for these.
TEST(RealCudaRuntimeTest, ErrorStringsComeFromTheLibrary) {
  EXPECT_THAT(
      CudaStatus(RealCudaRuntime(), cudaErrorInsufficientDriver, "probe"),
      StatusIs(absl::StatusCode::kFailedPrecondition,
               HasSubstr("probe: CUDA cudaErrorInsufficientDriver")));
}

}  // namespace
}  // namespace flatparam
