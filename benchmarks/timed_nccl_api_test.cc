// TimedNcclApi brackets exactly the NCCL call of a collective with its two
// events: checked against FakeNcclApi's call record (no GPU needed), alone and
// under NcclCommunicator, whose host-side checks (pointer-attribute queries,
// event creation) must fall outside the events.
#include "benchmarks/timed_nccl_api.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "comm/communicator.h"
#include "comm/nccl/fake_nccl_api.h"
#include "comm/nccl/nccl_communicator.h"
#include "flatparam/base/buffer.h"
#include "flatparam/base/dtype.h"
#include "flatparam/base/status_matchers.h"

namespace flatparam {
namespace bench {
namespace {

using ::testing::ElementsAre;

// The calls `api` recorded since `from`.
std::vector<std::string> CallsSince(const FakeNcclApi& api, size_t from) {
  const std::vector<std::string> all = api.calls();
  return std::vector<std::string>(all.begin() + from, all.end());
}

// A one-rank communicator, a stream and a buffer of the fake.
struct OneRank {
  explicit OneRank(FakeNcclApi& api) {
    ncclUniqueId id;
    std::memset(&id, 0, sizeof(id));
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    EXPECT_EQ(api.CommInitRankConfig(&comm, 1, id, 0, &config), ncclSuccess);
    EXPECT_EQ(api.StreamCreateWithFlags(&stream, 0), cudaSuccess);
    EXPECT_EQ(api.Malloc(&buffer, 256), cudaSuccess);
  }
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  void* buffer = nullptr;
};

TEST(TimedNcclApiTest, BracketsOnlyTheArmedCollective) {
  FakeNcclApi inner;
  TimedNcclApi api(inner, inner);
  OneRank one(inner);
  size_t from = inner.calls().size();
  EXPECT_EQ(api.AllGather(one.buffer, one.buffer, 4, ncclFloat32, one.comm,
                          one.stream),
            ncclSuccess);
  EXPECT_THAT(CallsSince(inner, from), ElementsAre("ncclAllGather"));
  EXPECT_THAT(api.ElapsedSeconds().status(),
              StatusIs(absl::StatusCode::kFailedPrecondition));

  ASSERT_THAT(api.Arm(0), IsOk());
  EXPECT_THAT(api.Arm(0), StatusIs(absl::StatusCode::kFailedPrecondition));
  from = inner.calls().size();
  EXPECT_EQ(api.ReduceScatter(one.buffer, one.buffer, 4, ncclFloat32, ncclSum,
                              one.comm, one.stream),
            ncclSuccess);
  EXPECT_THAT(
      CallsSince(inner, from),
      ElementsAre("cudaEventRecord", "ncclReduceScatter", "cudaEventRecord"));
  // Disarmed after one collective.
  from = inner.calls().size();
  EXPECT_EQ(api.AllReduce(one.buffer, one.buffer, 4, ncclFloat32, ncclSum,
                          one.comm, one.stream),
            ncclSuccess);
  EXPECT_THAT(CallsSince(inner, from), ElementsAre("ncclAllReduce"));
  EXPECT_EQ(inner.CommDestroy(one.comm), ncclSuccess);
  EXPECT_EQ(inner.Free(one.buffer), cudaSuccess);
  EXPECT_EQ(inner.StreamDestroy(one.stream), cudaSuccess);
}

TEST(TimedNcclApiTest, EventsAreCreatedOnceOnTheArmedDevice) {
  FakeNcclApi inner(/*device_count=*/2);
  TimedNcclApi api(inner, inner);
  size_t from = inner.calls().size();
  ASSERT_THAT(api.Arm(0), IsOk());  // device 0 is already current
  EXPECT_THAT(CallsSince(inner, from),
              ElementsAre("cudaGetDevice", "cudaEventCreateWithFlags",
                          "cudaEventCreateWithFlags"));
  OneRank one(inner);
  EXPECT_EQ(api.Broadcast(one.buffer, one.buffer, 4, ncclFloat32, 0, one.comm,
                          one.stream),
            ncclSuccess);
  from = inner.calls().size();
  ASSERT_THAT(api.Arm(0), IsOk());
  EXPECT_THAT(CallsSince(inner, from), ElementsAre());
  EXPECT_THAT(api.Arm(1), StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_EQ(inner.CommDestroy(one.comm), ncclSuccess);
  EXPECT_EQ(inner.Free(one.buffer), cudaSuccess);
  EXPECT_EQ(inner.StreamDestroy(one.stream), cudaSuccess);
}

// A non-blocking communicator may return ncclInProgress before the
// collective is on the stream: the stop event waits until it is.
TEST(TimedNcclApiTest, TheStopEventFollowsANonBlockingEnqueue) {
  FakeNcclApi inner;
  TimedNcclApi api(inner, inner);
  ncclUniqueId id;
  std::memset(&id, 0, sizeof(id));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t comm = nullptr;
  ASSERT_EQ(inner.CommInitRankConfig(&comm, 1, id, 0, &config), ncclSuccess);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(inner.StreamCreateWithFlags(&stream, 0), cudaSuccess);
  void* buffer = nullptr;
  ASSERT_EQ(inner.Malloc(&buffer, 256), cudaSuccess);
  inner.set_in_progress_polls(2);
  ASSERT_THAT(api.Arm(0), IsOk());
  const size_t from = inner.calls().size();
  EXPECT_EQ(api.AllGather(buffer, buffer, 4, ncclFloat32, comm, stream),
            ncclInProgress);
  EXPECT_THAT(CallsSince(inner, from),
              ElementsAre("cudaEventRecord", "ncclAllGather",
                          "ncclCommGetAsyncError", "ncclCommGetAsyncError",
                          "ncclCommGetAsyncError", "cudaEventRecord"));
  inner.set_in_progress_polls(0);
  EXPECT_EQ(inner.CommDestroy(comm), ncclSuccess);
  EXPECT_EQ(inner.Free(buffer), cudaSuccess);
  EXPECT_EQ(inner.StreamDestroy(stream), cudaSuccess);
  EXPECT_THAT(inner.misuse(), ::testing::IsEmpty());
}

// Under NcclCommunicator: its pointer checks and event creation happen
// before the start event, its completion event after the stop event.
TEST(TimedNcclApiTest, CommunicatorHostWorkFallsOutsideTheEvents) {
  FakeNcclApi inner;
  TimedNcclApi api(inner, inner);
  OneRank one(inner);
  auto comm_or = NcclCommunicator::Wrap(api, inner, one.comm,
                                        NcclCommunicator::Ownership::kBorrow);
  ASSERT_THAT(comm_or.status(), IsOk());
  std::unique_ptr<NcclCommunicator> comm = *std::move(comm_or);
  void* out = nullptr;
  ASSERT_EQ(inner.Malloc(&out, 64), cudaSuccess);
  BufferRef in{one.buffer, 16, DType::kFloat32, Device::Cuda(0)};
  BufferRef all{out, 16, DType::kFloat32, Device::Cuda(0)};
  ASSERT_THAT(api.Arm(0), IsOk());  // as the benchmarks do: just before
  const size_t from = inner.calls().size();
  std::unique_ptr<Work> work = comm->AllGather(in, all, {});
  ASSERT_THAT(work->Wait(), IsOk());
  const std::vector<std::string> c = CallsSince(inner, from);
  const auto call = std::find(c.begin(), c.end(), "ncclAllGather");
  ASSERT_NE(call, c.end()) << ::testing::PrintToString(c);
  ASSERT_NE(call, c.begin());
  ASSERT_NE(call + 1, c.end());
  EXPECT_EQ(call[-1], "cudaEventRecord");  // start
  EXPECT_EQ(call[1], "cudaEventRecord");   // stop
  // The communicator's host-side work before the call is outside.
  EXPECT_NE(std::find(c.begin(), call - 1, "cudaPointerGetAttributes"),
            call - 1)
      << ::testing::PrintToString(c);
  EXPECT_EQ(std::find(call - 1, c.end(), "cudaPointerGetAttributes"), c.end());
  work.reset();
  comm.reset();
  EXPECT_EQ(inner.CommDestroy(one.comm), ncclSuccess);
  EXPECT_EQ(inner.Free(out), cudaSuccess);
  EXPECT_EQ(inner.Free(one.buffer), cudaSuccess);
  EXPECT_EQ(inner.StreamDestroy(one.stream), cudaSuccess);
  EXPECT_THAT(inner.misuse(), ::testing::IsEmpty());
}

}  // namespace
}  // namespace bench
}  // namespace flatparam
