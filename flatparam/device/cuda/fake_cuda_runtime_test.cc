// Rules of FakeCudaRuntime that CUDA enforces and the code under test must
// not break: each test plants the misuse and checks the model catches it as
// CUDA would (the error code, and misuse() naming it). The stream-ordered
// pool's reuse and ordering rules are here too; the stream and event rules
// are exercised through CudaDeviceOps in cuda_device_fake_test.
#include "flatparam/device/cuda/fake_cuda_runtime.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>

#include "absl/time/clock.h"
#include "absl/time/time.h"

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

// ---- The stream-ordered pool: reuse as early as CUDA's, and the ordering
// check (each test plants the misuse, or shows the reuse a correct program
// sees) ----

class FakeCudaPoolTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (cudaStream_t* s : {&s1_, &s2_}) {
      ASSERT_EQ(rt_.StreamCreateWithFlags(s, cudaStreamNonBlocking),
                cudaSuccess);
    }
  }
  void TearDown() override {
    rt_.ReleaseStreams();
    rt_.StreamDestroy(s1_);
    rt_.StreamDestroy(s2_);
  }
  void* Alloc(size_t bytes, cudaStream_t stream) {
    void* p = nullptr;
    EXPECT_EQ(rt_.MallocAsync(&p, bytes, stream), cudaSuccess);
    return p;
  }
  // Fills `count` floats at `p` with `pattern`'s bits, on `stream`.
  cudaError_t Fill(void* p, uint32_t pattern, int64_t count,
                   cudaStream_t stream) {
    return rt_.LaunchFill(p, 4, pattern, count, stream);
  }
  // Records an event on `from` and makes `to` wait for it.
  void Order(cudaStream_t from, cudaStream_t to) {
    cudaEvent_t e = nullptr;
    ASSERT_EQ(rt_.EventCreateWithFlags(&e, 0), cudaSuccess);
    ASSERT_EQ(rt_.EventRecord(e, from), cudaSuccess);
    ASSERT_EQ(rt_.StreamWaitEvent(to, e, 0), cudaSuccess);
    ASSERT_EQ(rt_.EventDestroy(e), cudaSuccess);
  }
  uint32_t Word(void* p) {
    uint32_t v = 0;
    std::memcpy(&v, rt_.HostAlias(p), sizeof(v));
    return v;
  }
  uint64_t Reserved() {
    cudaMemPool_t pool = nullptr;
    EXPECT_EQ(rt_.DeviceGetDefaultMemPool(&pool, 0), cudaSuccess);
    uint64_t v = 0;
    EXPECT_EQ(
        rt_.MemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemCurrent, &v),
        cudaSuccess);
    return v;
  }

  FakeCudaRuntime rt_;
  cudaStream_t s1_ = nullptr;
  cudaStream_t s2_ = nullptr;
};

// CUDA's pool hands memory freed on a stream to the next allocation on the
// same stream before the free has run: stream order puts the free first.
TEST_F(FakeCudaPoolTest, TheFreeingStreamReusesBeforeTheFreeRuns) {
  rt_.HoldStream(s1_);
  void* a = Alloc(4096, s1_);
  ASSERT_EQ(Fill(a, 1, 1024, s1_), cudaSuccess);
  ASSERT_EQ(rt_.FreeAsync(a, s1_), cudaSuccess);
  void* b = Alloc(4096, s1_);
  EXPECT_EQ(b, a);  // nothing on s1 has run yet
  EXPECT_EQ(rt_.StreamQuery(s1_), cudaErrorNotReady);
  rt_.GetLastError();
  ASSERT_EQ(Fill(b, 2, 1024, s1_), cudaSuccess);
  rt_.ReleaseStreams();
  ASSERT_EQ(rt_.StreamSynchronize(s1_), cudaSuccess);
  EXPECT_EQ(Word(b), 2u);
  EXPECT_EQ(rt_.device_mallocs(), 1);
  EXPECT_THAT(rt_.misuse(), IsEmpty());
}

// Memory freed on another stream whose free has not run is reused behind a
// wait the pool inserts: the new owner's work runs after the free.
TEST_F(FakeCudaPoolTest, AnotherStreamReusesBehindAnInsertedWait) {
  void* a = Alloc(4096, s1_);
  ASSERT_EQ(Fill(a, 1, 1024, s1_), cudaSuccess);
  rt_.HoldStream(s1_);
  ASSERT_EQ(rt_.FreeAsync(a, s1_), cudaSuccess);
  void* b = Alloc(4096, s2_);
  EXPECT_EQ(b, a);
  ASSERT_EQ(Fill(b, 2, 1024, s2_), cudaSuccess);
  absl::SleepFor(absl::Milliseconds(20));
  EXPECT_EQ(rt_.StreamQuery(s2_), cudaErrorNotReady);  // waits for s1
  rt_.GetLastError();
  rt_.ReleaseStreams();
  ASSERT_EQ(rt_.StreamSynchronize(s2_), cudaSuccess);
  EXPECT_EQ(Word(b), 2u);  // the free's 0xFF came first
  EXPECT_EQ(rt_.device_mallocs(), 1);
  EXPECT_THAT(rt_.misuse(), IsEmpty());
}

// A smaller allocation is carved out of a bigger freed range, two of them
// side by side, and freeing both merges the range again: one segment,
// returned to the system at the next synchronization.
TEST_F(FakeCudaPoolTest, SmallerAllocationsAreCarvedFromAFreedRange) {
  void* big = Alloc(1 << 20, s1_);
  ASSERT_EQ(rt_.FreeAsync(big, s1_), cudaSuccess);
  void* x = Alloc(256 << 10, s1_);
  void* y = Alloc(100 << 10, s1_);
  EXPECT_EQ(x, big);
  EXPECT_EQ(y, static_cast<char*>(big) + (256 << 10));
  EXPECT_EQ(rt_.device_mallocs(), 1);
  EXPECT_EQ(Reserved(), 1u << 20);
  ASSERT_EQ(Fill(x, 3, 64, s1_), cudaSuccess);
  ASSERT_EQ(Fill(y, 4, 64, s1_), cudaSuccess);
  ASSERT_EQ(rt_.FreeAsync(y, s1_), cudaSuccess);
  ASSERT_EQ(rt_.FreeAsync(x, s1_), cudaSuccess);
  ASSERT_EQ(rt_.StreamSynchronize(s1_), cudaSuccess);
  EXPECT_EQ(Reserved(), 0u);
  EXPECT_EQ(rt_.live_device_blocks(), 0);
  EXPECT_THAT(rt_.misuse(), IsEmpty());
}

// Work on another stream must be ordered after the cudaMallocAsync (an
// event recorded after it, or a synchronization); otherwise it may run on
// memory still in use by the allocation's previous owner. Caught when the
// work is issued, whatever the timing.
TEST_F(FakeCudaPoolTest, UseNotOrderedAfterTheAllocationIsCaught) {
  void* ordered = Alloc(4096, s1_);
  Order(s1_, s2_);
  ASSERT_EQ(Fill(ordered, 1, 1024, s2_), cudaSuccess);
  void* synced = Alloc(4096, s1_);
  ASSERT_EQ(rt_.StreamSynchronize(s1_), cudaSuccess);
  ASSERT_EQ(Fill(synced, 1, 1024, s2_), cudaSuccess);
  ASSERT_EQ(rt_.StreamSynchronize(s2_), cudaSuccess);
  EXPECT_THAT(rt_.misuse(), IsEmpty());

  void* racy = Alloc(4096, s1_);
  // Accepted; the launch reports the fault too if the idle stream got
  // there first.
  const cudaError_t launch = Fill(racy, 1, 1024, s2_);
  EXPECT_TRUE(launch == cudaSuccess || launch == cudaErrorIllegalAddress)
      << launch;
  EXPECT_THAT(rt_.misuse(),
              ElementsAre(HasSubstr("fill kernel on stream 1 touches")));
  EXPECT_THAT(rt_.misuse()[0],
              HasSubstr("without being ordered after the allocation"));
  EXPECT_EQ(rt_.StreamSynchronize(s2_), cudaErrorIllegalAddress);
}

// The free must be ordered after every use on other streams; otherwise the
// pool may hand the memory out while the use still runs. Caught at the
// free, before anything has run.
TEST_F(FakeCudaPoolTest, FreeNotOrderedAfterAUseIsCaught) {
  void* a = Alloc(4096, s1_);
  Order(s1_, s2_);
  rt_.HoldStream(s2_);
  ASSERT_EQ(Fill(a, 1, 1024, s2_), cudaSuccess);
  Order(s2_, s1_);  // as RecordStream does
  ASSERT_EQ(rt_.FreeAsync(a, s1_), cudaSuccess);
  EXPECT_THAT(rt_.misuse(), IsEmpty());
  rt_.ReleaseStreams();
  ASSERT_EQ(rt_.StreamSynchronize(s1_), cudaSuccess);

  void* b = Alloc(4096, s1_);
  Order(s1_, s2_);
  rt_.HoldStream(s2_);
  ASSERT_EQ(Fill(b, 1, 1024, s2_), cudaSuccess);
  ASSERT_EQ(rt_.FreeAsync(b, s1_), cudaSuccess);
  EXPECT_THAT(rt_.misuse(),
              ElementsAre(HasSubstr("is not ordered after fill kernel on "
                                    "stream 1, which uses the memory")));
  rt_.ReleaseStreams();
  EXPECT_EQ(rt_.StreamSynchronize(s1_), cudaErrorIllegalAddress);
}

// Freed memory belongs to nobody: work issued on it afterwards, on any
// stream, is caught even when the pool has not handed it out again.
TEST_F(FakeCudaPoolTest, UseAfterAStreamOrderedFreeIsCaught) {
  void* a = Alloc(4096, s1_);
  ASSERT_EQ(rt_.FreeAsync(a, s1_), cudaSuccess);
  const cudaError_t launch = Fill(a, 1, 1024, s1_);
  EXPECT_TRUE(launch == cudaSuccess || launch == cudaErrorIllegalAddress)
      << launch;
  EXPECT_THAT(rt_.misuse(),
              ElementsAre(HasSubstr("which is not allocated when it is "
                                    "issued")));
  EXPECT_EQ(rt_.StreamSynchronize(s1_), cudaErrorIllegalAddress);
}

}  // namespace
}  // namespace flatparam
