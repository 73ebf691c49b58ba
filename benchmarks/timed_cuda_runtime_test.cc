// TimedCudaRuntime brackets exactly the cudaMemcpyAsync of a copy with its
// two events: checked against FakeCudaRuntime through a recorder of the
// calls (no GPU needed), alone and under CudaDeviceOps, whose host waits
// before and after a host<->device copy must fall outside the events.
#include "benchmarks/timed_cuda_runtime.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "flatparam/base/buffer.h"
#include "flatparam/base/dtype.h"
#include "flatparam/base/status_matchers.h"
#include "flatparam/device/cuda/cuda_device_ops.h"
#include "flatparam/device/cuda/fake_cuda_runtime.h"
#include "flatparam/device/device.h"

namespace flatparam {
namespace bench {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// Logs the calls the timing is about, naming the events the test made
// known (`names`) and marking the streams: "record start on s", "memcpy on
// s", "query", "sync".
class Recorder final : public ForwardingCudaRuntime {
 public:
  using ForwardingCudaRuntime::ForwardingCudaRuntime;

  std::vector<std::string> log;
  std::vector<cudaEvent_t> created;

  cudaError_t EventCreateWithFlags(cudaEvent_t* event,
                                   unsigned int flags) override {
    const cudaError_t e = inner().EventCreateWithFlags(event, flags);
    if (e == cudaSuccess) created.push_back(*event);
    return e;
  }
  cudaError_t EventRecord(cudaEvent_t event, cudaStream_t stream) override {
    log.push_back(absl::StrCat("record ", Name(event), " on ", Name(stream)));
    return inner().EventRecord(event, stream);
  }
  cudaError_t MemcpyAsync(void* dst, const void* src, size_t bytes,
                          cudaMemcpyKind kind, cudaStream_t stream) override {
    log.push_back(absl::StrCat("memcpy on ", Name(stream)));
    return inner().MemcpyAsync(dst, src, bytes, kind, stream);
  }
  cudaError_t EventQuery(cudaEvent_t event) override {
    log.push_back("query");
    return inner().EventQuery(event);
  }
  cudaError_t StreamQuery(cudaStream_t stream) override {
    log.push_back("query");
    return inner().StreamQuery(stream);
  }
  cudaError_t EventSynchronize(cudaEvent_t event) override {
    log.push_back("sync");
    return inner().EventSynchronize(event);
  }
  cudaError_t StreamSynchronize(cudaStream_t stream) override {
    log.push_back("sync");
    return inner().StreamSynchronize(stream);
  }

  cudaEvent_t start = nullptr, stop = nullptr;  // the timer's, once known
  cudaStream_t stream = nullptr;                // the one named "s"

 private:
  std::string Name(cudaEvent_t e) const {
    if (e != nullptr && e == start) return "start";
    if (e != nullptr && e == stop) return "stop";
    return "other";
  }
  std::string Name(cudaStream_t s) const { return s == stream ? "s" : "t"; }
};

class TimedCudaRuntimeTest : public ::testing::Test {
 protected:
  TimedCudaRuntimeTest() : recorder_(fake_), timed_(recorder_) {}

  // Arms the timer on device 0 and learns its events (made on the first
  // Arm).
  void Arm() {
    const size_t before = recorder_.created.size();
    ASSERT_THAT(timed_.Arm(0), IsOk());
    if (recorder_.created.size() == before + 2) {
      recorder_.start = recorder_.created[before];
      recorder_.stop = recorder_.created[before + 1];
    }
    ASSERT_NE(recorder_.start, nullptr);
    recorder_.log.clear();
  }

  // A stream and a device buffer of `bytes`, through the timer; synchronized
  // and released at the end of the test.
  struct Scratch {
    Scratch(CudaRuntime& rt, size_t bytes) : rt(rt), host(bytes, 7) {
      EXPECT_EQ(rt.StreamCreateWithFlags(&stream, cudaStreamNonBlocking),
                cudaSuccess);
      EXPECT_EQ(rt.Malloc(&dev, bytes), cudaSuccess);
    }
    ~Scratch() {
      EXPECT_EQ(rt.StreamSynchronize(stream), cudaSuccess);
      EXPECT_EQ(rt.Free(dev), cudaSuccess);
      EXPECT_EQ(rt.StreamDestroy(stream), cudaSuccess);
    }
    CudaRuntime& rt;
    cudaStream_t stream = nullptr;
    void* dev = nullptr;
    std::vector<unsigned char> host;
  };

  FakeCudaRuntime fake_;
  Recorder recorder_;
  TimedCudaRuntime timed_;
};

TEST_F(TimedCudaRuntimeTest, BracketsOnlyTheArmedCopy) {
  Scratch a(timed_, 256), b(timed_, 256);
  recorder_.stream = a.stream;
  void* dev = a.dev;
  unsigned char* host = a.host.data();

  EXPECT_THAT(timed_.ElapsedSeconds().status(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("no armed cudaMemcpyAsync")));
  // Unarmed: forwarded alone.
  EXPECT_EQ(
      timed_.MemcpyAsync(dev, host, 256, cudaMemcpyHostToDevice, b.stream),
      cudaSuccess);
  EXPECT_THAT(recorder_.log, ElementsAre("memcpy on t"));

  Arm();
  EXPECT_THAT(timed_.Arm(0), StatusIs(absl::StatusCode::kFailedPrecondition,
                                      HasSubstr("not followed")));
  // Work before the copy is not the copy's.
  EXPECT_EQ(timed_.MemsetAsync(dev, 0, 256, a.stream), cudaSuccess);
  EXPECT_EQ(
      timed_.MemcpyAsync(dev, host, 256, cudaMemcpyHostToDevice, a.stream),
      cudaSuccess);
  // One copy only: the next is forwarded alone again.
  EXPECT_EQ(
      timed_.MemcpyAsync(host, dev, 256, cudaMemcpyDeviceToHost, b.stream),
      cudaSuccess);
  EXPECT_THAT(recorder_.log, ElementsAre("record start on s", "memcpy on s",
                                         "record stop on s", "memcpy on t"));

  // Armed again: the copy on the other stream gets the events there.
  Arm();
  EXPECT_EQ(
      timed_.MemcpyAsync(host, dev, 256, cudaMemcpyDeviceToHost, b.stream),
      cudaSuccess);
  EXPECT_THAT(recorder_.log, ElementsAre("record start on t", "memcpy on t",
                                         "record stop on t"));
}

TEST_F(TimedCudaRuntimeTest, EventsAreMadeOnceOnTheArmedDevice) {
  Scratch a(timed_, 64);
  for (int i = 0; i < 3; ++i) {
    ASSERT_THAT(timed_.Arm(0), IsOk());
    EXPECT_EQ(timed_.MemcpyAsync(a.dev, a.host.data(), 64,
                                 cudaMemcpyHostToDevice, a.stream),
              cudaSuccess);
  }
  EXPECT_EQ(recorder_.created.size(), 2u);
  EXPECT_THAT(timed_.Arm(1), StatusIs(absl::StatusCode::kFailedPrecondition,
                                      HasSubstr("created on device 0")));
}

TEST_F(TimedCudaRuntimeTest, AFailedRecordingIsReported) {
  Scratch a(timed_, 64);
  Arm();
  fake_.FailNext("cudaEventRecord", cudaErrorInvalidValue);
  // The copy itself goes ahead; its timing is the error.
  EXPECT_EQ(timed_.MemcpyAsync(a.dev, a.host.data(), 64, cudaMemcpyHostToDevice,
                               a.stream),
            cudaSuccess);
  EXPECT_THAT(timed_.ElapsedSeconds().status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("cudaEventRecord (start)")));
}

// Under CudaDeviceOps, a host<->device Copy waits for its stream before the
// copy and for the copy after it (bounded host waits: event queries); both
// waits fall outside the events, which bracket the cudaMemcpyAsync alone.
TEST_F(TimedCudaRuntimeTest, TheHostWaitsOfACopyFallOutsideTheEvents) {
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      std::unique_ptr<CudaDeviceOps> ops,
      CudaDeviceOps::Create(0, nullptr, nullptr, &timed_));
  recorder_.stream = ops->stream();
  constexpr int64_t kCount = 1024;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(DeviceBuffer dev,
                                 ops->Allocate(ops->device(), kCount * 4));
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      DeviceBuffer pinned, ops->Allocate(Device::Host(), kCount * 4, true));
  BufferRef dev_ref = dev.As(DType::kFloat32);
  BufferRef host_ref = pinned.As(DType::kFloat32);
  for (int64_t i = 0; i < kCount; ++i) {
    static_cast<float*>(host_ref.data)[i] = static_cast<float>(i);
  }

  for (bool h2d : {true, false}) {
    SCOPED_TRACE(h2d ? "host to device" : "device to host");
    Arm();
    if (h2d) {
      ASSERT_THAT(ops->Copy(dev_ref, host_ref), IsOk());
    } else {
      ASSERT_THAT(ops->Copy(host_ref, dev_ref), IsOk());
    }
    const std::vector<std::string>& log = recorder_.log;
    int start = -1, stop = -1;
    for (int i = 0; i < static_cast<int>(log.size()); ++i) {
      if (log[i] == "record start on s") start = i;
      if (log[i] == "record stop on s") stop = i;
    }
    ASSERT_GE(start, 0) << ::testing::PrintToString(log);
    ASSERT_EQ(stop, start + 2) << ::testing::PrintToString(log);
    EXPECT_EQ(log[start + 1], "memcpy on s");
    // The wait for the stream before, and for the copy after.
    const auto query_in = [&](int from, int to) {
      for (int i = from; i < to; ++i) {
        if (log[i] == "query" || log[i] == "sync") return true;
      }
      return false;
    };
    EXPECT_TRUE(query_in(0, start)) << ::testing::PrintToString(log);
    EXPECT_TRUE(query_in(stop + 1, static_cast<int>(log.size())))
        << ::testing::PrintToString(log);
  }
  // The data made the round trip.
  for (int64_t i = 0; i < kCount; ++i) {
    ASSERT_EQ(static_cast<float*>(host_ref.data)[i], static_cast<float>(i));
  }
}

}  // namespace
}  // namespace bench
}  // namespace flatparam
