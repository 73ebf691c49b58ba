// TorchCudaDeviceOps on a GPU: its stream is LibTorch's, its memory is
// LibTorch's caching allocator's, and LibTorch's kernels on that stream see
// what it wrote without a host synchronization. Skips without a GPU; in CI
// (Debian's CPU-only LibTorch) this file is compiled, not linked or run.
#include "flatparam/torch/torch_cuda.h"

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>
#include <torch/types.h>
#include <torch/utils.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "flatparam/base/buffer.h"
#include "flatparam/base/dtype.h"
#include "flatparam/base/gpu_testutil.h"
#include "flatparam/base/status_matchers.h"
#include "flatparam/device/device.h"

namespace flatparam {
namespace {

using ::testing::HasSubstr;

int64_t TorchAllocatedBytes(int device) {
  // allocated_bytes[0] is StatType::AGGREGATE, whose namespace 2.x moved
  // (c10::CachingAllocator); the stats' type moved too, hence auto.
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(
      static_cast<c10::DeviceIndex>(device));
  return stats.allocated_bytes[0].current;
}

class TorchCudaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!torch::cuda::is_available()) {
      FLATPARAM_SKIP_WITHOUT_GPU("no usable GPU: LibTorch sees no CUDA device");
    }
  }
};

TEST_F(TorchCudaTest, StreamZeroIsLibTorchsCurrentStream) {
  FLATPARAM_ASSERT_OK_AND_ASSIGN(std::unique_ptr<TorchCudaDeviceOps> cuda,
                                 TorchCudaDeviceOps::Create(0));
  // LibTorch's default stream is CUDA's legacy default stream, which
  // LibTorch names by the null handle and flatparam by cudaStreamLegacy (a
  // null stream would have made CudaDeviceOps create a stream of its own).
  ASSERT_EQ(c10::cuda::getCurrentCUDAStream(0).stream(), nullptr);
  EXPECT_EQ(cuda->stream(), cudaStreamLegacy);
  EXPECT_EQ(cuda->ops().cuda_stream(Stream{0}), cudaStreamLegacy);
  EXPECT_THAT(cuda->CheckCurrentStream(), IsOk());
}

TEST_F(TorchCudaTest, AnotherCurrentStreamIsRefused) {
  FLATPARAM_ASSERT_OK_AND_ASSIGN(std::unique_ptr<TorchCudaDeviceOps> cuda,
                                 TorchCudaDeviceOps::Create(0));
  c10::cuda::CUDAStreamGuard guard(c10::cuda::getStreamFromPool(false, 0));
  EXPECT_THAT(cuda->CheckCurrentStream(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("CUDAStreamGuard")));
}

// Made under a guard, the ops use the guard's stream as it is, and refuse
// LibTorch's default stream once the guard is gone.
TEST_F(TorchCudaTest, AGuardedStreamIsStreamZero) {
  const c10::cuda::CUDAStream pool = c10::cuda::getStreamFromPool(false, 0);
  ASSERT_NE(pool.stream(), nullptr);
  std::unique_ptr<TorchCudaDeviceOps> cuda;
  {
    c10::cuda::CUDAStreamGuard guard(pool);
    FLATPARAM_ASSERT_OK_AND_ASSIGN(cuda, TorchCudaDeviceOps::Create(0));
    EXPECT_EQ(cuda->stream(), pool.stream());
    EXPECT_EQ(cuda->ops().cuda_stream(Stream{0}), pool.stream());
    EXPECT_THAT(cuda->CheckCurrentStream(), IsOk());
  }
  EXPECT_THAT(cuda->CheckCurrentStream(),
              StatusIs(absl::StatusCode::kFailedPrecondition));
}

TEST_F(TorchCudaTest, DeviceMemoryComesFromTheCachingAllocator) {
  FLATPARAM_ASSERT_OK_AND_ASSIGN(std::unique_ptr<TorchCudaDeviceOps> cuda,
                                 TorchCudaDeviceOps::Create(0));
  DeviceOps& ops = cuda->ops();
  const int64_t before = TorchAllocatedBytes(0);
  {
    FLATPARAM_ASSERT_OK_AND_ASSIGN(DeviceBuffer buf,
                                   ops.Allocate(ops.device(), 1 << 20));
    EXPECT_GE(TorchAllocatedBytes(0) - before, 1 << 20);
  }
  ASSERT_THAT(ops.Synchronize(), IsOk());
  EXPECT_EQ(TorchAllocatedBytes(0), before);
}

TEST_F(TorchCudaTest, LibTorchKernelsSeeTheOpsWritesInStreamOrder) {
  FLATPARAM_ASSERT_OK_AND_ASSIGN(std::unique_ptr<TorchCudaDeviceOps> cuda,
                                 TorchCudaDeviceOps::Create(0));
  DeviceOps& ops = cuda->ops();
  constexpr int64_t kCount = 1 << 22;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(DeviceBuffer buf,
                                 ops.Allocate(ops.device(), kCount * 4));
  ASSERT_THAT(ops.Fill(buf.As(DType::kFloat32), 0.5), IsOk());
  // No synchronization: the sum runs after the fill on the same stream.
  torch::Tensor t =
      torch::from_blob(buf.data(), {kCount},
                       torch::dtype(torch::kFloat32).device(torch::kCUDA, 0));
  EXPECT_EQ(t.sum().item<double>(), 0.5 * kCount);
}

TEST_F(TorchCudaTest, AnImpossibleAllocationIsResourceExhausted) {
  TorchCachingAllocator allocator;
  EXPECT_THAT(allocator
                  .Allocate(int64_t{1} << 50,
                            c10::cuda::getCurrentCUDAStream(0).stream())
                  .status(),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstr("out of memory")));
}

TEST_F(TorchCudaTest, AnUnknownDeviceIsNamed) {
  EXPECT_THAT(
      TorchCudaDeviceOps::Create(1000).status(),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("device 1000")));
}

}  // namespace
}  // namespace flatparam
