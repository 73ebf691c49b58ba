// Rules of FakeCudaRuntime that CUDA enforces and the code under test must
// not break: each test plants the misuse and checks the model catches it as
// CUDA would (the error code, and misuse() naming it). The stream, event and
// stream-ordered allocation rules are exercised through CudaDeviceOps in
// cuda_device_fake_test.
#include "flatparam/device/cuda/fake_cuda_runtime.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace flatparam {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

FakeCudaRuntime::Options Devices(int n) {
  FakeCudaRuntime::Options options;
  options.device_count = n;
  return options;
}

// The NCCL backend checks buffers with cudaPointerGetAttributes; the model
// answers as CUDA 11+ does.
TEST(FakeCudaRuntimeTest, PointerAttributesSayWhereMemoryLives) {
  FakeCudaRuntime::Options options;
  options.device_count = 2;
  FakeCudaRuntime rt(options);
  ASSERT_EQ(rt.SetDevice(1), cudaSuccess);
  void* device = nullptr;
  ASSERT_EQ(rt.Malloc(&device, 64), cudaSuccess);
  void* pinned = nullptr;
  ASSERT_EQ(rt.MallocHost(&pinned, 64), cudaSuccess);
  int pageable = 0;

  cudaPointerAttributes a;
  ASSERT_EQ(rt.PointerGetAttributes(&a, static_cast<char*>(device) + 63),
            cudaSuccess);
  EXPECT_EQ(a.type, cudaMemoryTypeDevice);
  EXPECT_EQ(a.device, 1);
  ASSERT_EQ(rt.PointerGetAttributes(&a, pinned), cudaSuccess);
  EXPECT_EQ(a.type, cudaMemoryTypeHost);
  ASSERT_EQ(rt.PointerGetAttributes(&a, &pageable), cudaSuccess);
  EXPECT_EQ(a.type, cudaMemoryTypeUnregistered);

  ASSERT_EQ(rt.Free(device), cudaSuccess);
  ASSERT_EQ(rt.PointerGetAttributes(&a, device), cudaSuccess);
  EXPECT_EQ(a.type, cudaMemoryTypeUnregistered);  // freed: no longer known
  ASSERT_EQ(rt.FreeHost(pinned), cudaSuccess);

  rt.FailNext("cudaPointerGetAttributes", cudaErrorInvalidValue);
  EXPECT_EQ(rt.PointerGetAttributes(&a, &pageable), cudaErrorInvalidValue);
  EXPECT_EQ(rt.GetLastError(), cudaErrorInvalidValue);
  EXPECT_THAT(rt.misuse(), ::testing::IsEmpty());
}

// Host code that dereferences device memory faults, as on a GPU.
TEST(FakeCudaRuntimeDeathTest, HostCodeCannotDereferenceDeviceMemory) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(
      {
        FakeCudaRuntime rt;
        void* p = nullptr;
        if (rt.Malloc(&p, 64) == cudaSuccess) {
          *static_cast<volatile char*>(p) = 1;
        }
      },
      "");
}

// The model's streams, and other models' work, reach device memory through
// its read-write view.
TEST(FakeCudaRuntimeTest, StreamsWorkThroughTheHostView) {
  FakeCudaRuntime rt;
  void* p = nullptr;
  ASSERT_EQ(rt.Malloc(&p, 64), cudaSuccess);
  char* view = static_cast<char*>(rt.HostAlias(p));
  EXPECT_NE(view, p);
  EXPECT_EQ(view[0], static_cast<char>(0xA5));  // uninitialised, recognisably
  ASSERT_EQ(rt.MemsetAsync(static_cast<char*>(p) + 32, 7, 32, nullptr),
            cudaSuccess);
  ASSERT_EQ(rt.StreamSynchronize(nullptr), cudaSuccess);
  EXPECT_EQ(view[31], static_cast<char>(0xA5));
  EXPECT_EQ(view[32], 7);
  EXPECT_EQ(view[63], 7);
  EXPECT_EQ(rt.HostAlias(static_cast<char*>(p) + 10), view + 10);
  int host = 0;
  EXPECT_EQ(rt.HostAlias(&host), &host);  // host memory is its own view
  int back[16];
  ASSERT_EQ(
      rt.MemcpyAsync(back, p, sizeof(back), cudaMemcpyDeviceToHost, nullptr),
      cudaSuccess);
  EXPECT_EQ(reinterpret_cast<char*>(back)[40], 7);
  ASSERT_EQ(rt.Free(p), cudaSuccess);
  EXPECT_THAT(rt.misuse(), IsEmpty());
}

// CUDA: "a kernel launch will fail if it is issued to a stream that is not
// associated to the current device"; copies and memsets may use any
// device's stream.
TEST(FakeCudaRuntimeTest, AKernelIntoAnotherDevicesStreamIsRefused) {
  FakeCudaRuntime rt(Devices(2));
  ASSERT_EQ(rt.SetDevice(1), cudaSuccess);
  cudaStream_t stream1 = nullptr;
  ASSERT_EQ(rt.StreamCreateWithFlags(&stream1, cudaStreamNonBlocking),
            cudaSuccess);
  void* p = nullptr;
  ASSERT_EQ(rt.Malloc(&p, 64), cudaSuccess);
  ASSERT_EQ(rt.SetDevice(0), cudaSuccess);

  EXPECT_EQ(rt.LaunchFill(p, 4, 0, 16, stream1),
            cudaErrorInvalidResourceHandle);
  EXPECT_THAT(rt.misuse(),
              ElementsAre(HasSubstr(
                  "launched into a stream of cuda:1 while cuda:0 is current")));
  EXPECT_EQ(rt.MemsetAsync(p, 0, 64, stream1), cudaSuccess);
  EXPECT_EQ(rt.StreamSynchronize(stream1), cudaSuccess);

  ASSERT_EQ(rt.SetDevice(1), cudaSuccess);  // the right device: launches
  EXPECT_EQ(rt.LaunchFill(p, 4, 0, 16, stream1), cudaSuccess);
  EXPECT_EQ(rt.StreamSynchronize(stream1), cudaSuccess);
  EXPECT_EQ(rt.StreamDestroy(stream1), cudaSuccess);
  EXPECT_EQ(rt.Free(p), cudaSuccess);
}

// Without cudaDeviceEnablePeerAccess, a kernel that touches another
// device's memory faults; a copy between devices is fine.
TEST(FakeCudaRuntimeTest, AKernelTouchingAnotherDevicesMemoryFaults) {
  FakeCudaRuntime rt(Devices(2));
  ASSERT_EQ(rt.SetDevice(1), cudaSuccess);
  void* other = nullptr;
  ASSERT_EQ(rt.Malloc(&other, 64), cudaSuccess);
  ASSERT_EQ(rt.SetDevice(0), cudaSuccess);
  void* mine = nullptr;
  ASSERT_EQ(rt.Malloc(&mine, 64), cudaSuccess);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(rt.StreamCreateWithFlags(&stream, cudaStreamNonBlocking),
            cudaSuccess);

  EXPECT_EQ(rt.MemcpyAsync(mine, other, 64, cudaMemcpyDeviceToDevice, stream),
            cudaSuccess);
  EXPECT_EQ(rt.StreamSynchronize(stream), cudaSuccess);
  EXPECT_THAT(rt.misuse(), IsEmpty());

  // The launch itself is accepted; running it faults, which the launch
  // reports too if the stream got there first (as CUDA reports an
  // asynchronous error from any later call).
  const cudaError_t launch = rt.LaunchAdd(
      mine, other, internal_cuda::KernelDType::kFloat32, 16, stream);
  EXPECT_TRUE(launch == cudaSuccess || launch == cudaErrorIllegalAddress)
      << launch;
  EXPECT_EQ(rt.StreamSynchronize(stream), cudaErrorIllegalAddress);
  EXPECT_THAT(rt.misuse(),
              ElementsAre(HasSubstr("of cuda:1, without peer access")));
}

}  // namespace
}  // namespace flatparam
