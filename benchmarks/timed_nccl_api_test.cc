// TimedNcclApi brackets exactly the NCCL call of a collective with its two
// events: checked against a recording NcclApi (no GPU needed), alone and
// under NcclCommunicator, whose host-side checks (pointer-attribute queries,
// event creation) must fall outside the events.
#include "benchmarks/timed_nccl_api.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "comm/communicator.h"
#include "comm/nccl/nccl_communicator.h"
#include "flatparam/base/buffer.h"
#include "flatparam/base/dtype.h"
#include "flatparam/base/status_matchers.h"

namespace flatparam {
namespace bench {
namespace {

using ::testing::ElementsAre;

// Records each call by name; every call succeeds. The first two events
// created are TimedNcclApi's, named "start" and "stop".
class RecordingNcclApi final : public NcclApi {
 public:
  std::vector<std::string> calls;
  int events_created = 0;

  static std::string Name(cudaEvent_t event) {
    const auto v = reinterpret_cast<uintptr_t>(event);
    if (v == 0x1000) return "start";
    if (v == 0x1008) return "stop";
    return "other";
  }

  ncclResult_t GetVersion(int* version) override {
    calls.push_back("GetVersion");
    *version = 22809;
    return ncclSuccess;
  }
  ncclResult_t GetUniqueId(ncclUniqueId* id) override {
    calls.push_back("GetUniqueId");
    return ncclSuccess;
  }
  ncclResult_t CommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId id,
                                  int rank, ncclConfig_t* config) override {
    calls.push_back("CommInitRankConfig");
    return ncclSuccess;
  }
  ncclResult_t CommSplit(ncclComm_t comm, int color, int key,
                         ncclComm_t* newcomm, ncclConfig_t* config) override {
    calls.push_back("CommSplit");
    return ncclSuccess;
  }
  ncclResult_t CommFinalize(ncclComm_t comm) override {
    calls.push_back("CommFinalize");
    return ncclSuccess;
  }
  ncclResult_t CommDestroy(ncclComm_t comm) override {
    calls.push_back("CommDestroy");
    return ncclSuccess;
  }
  ncclResult_t CommAbort(ncclComm_t comm) override {
    calls.push_back("CommAbort");
    return ncclSuccess;
  }
  ncclResult_t CommGetAsyncError(ncclComm_t comm,
                                 ncclResult_t* async_error) override {
    calls.push_back("CommGetAsyncError");
    *async_error = ncclSuccess;
    return ncclSuccess;
  }
  ncclResult_t CommCount(ncclComm_t comm, int* count) override {
    calls.push_back("CommCount");
    *count = 1;
    return ncclSuccess;
  }
  ncclResult_t CommUserRank(ncclComm_t comm, int* rank) override {
    calls.push_back("CommUserRank");
    *rank = 0;
    return ncclSuccess;
  }
  ncclResult_t CommCuDevice(ncclComm_t comm, int* device) override {
    calls.push_back("CommCuDevice");
    *device = 0;
    return ncclSuccess;
  }
  ncclResult_t RedOpCreatePreMulSum(ncclRedOp_t* op, void* scalar,
                                    ncclDataType_t datatype,
                                    ncclScalarResidence_t residence,
                                    ncclComm_t comm) override {
    calls.push_back("RedOpCreatePreMulSum");
    *op = ncclSum;
    return ncclSuccess;
  }
  ncclResult_t RedOpDestroy(ncclRedOp_t op, ncclComm_t comm) override {
    calls.push_back("RedOpDestroy");
    return ncclSuccess;
  }
  ncclResult_t AllGather(const void* sendbuff, void* recvbuff, size_t sendcount,
                         ncclDataType_t datatype, ncclComm_t comm,
                         cudaStream_t stream) override {
    calls.push_back("AllGather");
    return ncclSuccess;
  }
  ncclResult_t ReduceScatter(const void* sendbuff, void* recvbuff,
                             size_t recvcount, ncclDataType_t datatype,
                             ncclRedOp_t op, ncclComm_t comm,
                             cudaStream_t stream) override {
    calls.push_back("ReduceScatter");
    return ncclSuccess;
  }
  ncclResult_t AllReduce(const void* sendbuff, void* recvbuff, size_t count,
                         ncclDataType_t datatype, ncclRedOp_t op,
                         ncclComm_t comm, cudaStream_t stream) override {
    calls.push_back("AllReduce");
    return ncclSuccess;
  }
  ncclResult_t Broadcast(const void* sendbuff, void* recvbuff, size_t count,
                         ncclDataType_t datatype, int root, ncclComm_t comm,
                         cudaStream_t stream) override {
    calls.push_back("Broadcast");
    return ncclSuccess;
  }
  const char* GetErrorString(ncclResult_t result) override {
    calls.push_back("GetErrorString");
    return "";
  }
  const char* GetLastError(ncclComm_t comm) override {
    calls.push_back("GetLastError");
    return "";
  }
  cudaError_t CudaGetDeviceCount(int* count) override {
    calls.push_back("CudaGetDeviceCount");
    *count = 1;
    return cudaSuccess;
  }
  cudaError_t CudaGetDevice(int* device) override {
    calls.push_back("CudaGetDevice");
    *device = 0;
    return cudaSuccess;
  }
  cudaError_t CudaSetDevice(int device) override {
    calls.push_back("CudaSetDevice");
    return cudaSuccess;
  }
  cudaError_t CudaStreamCreateWithFlags(cudaStream_t* stream,
                                        unsigned int flags) override {
    calls.push_back("CudaStreamCreateWithFlags");
    *stream = reinterpret_cast<cudaStream_t>(0x5000);
    return cudaSuccess;
  }
  cudaError_t CudaStreamDestroy(cudaStream_t stream) override {
    calls.push_back("CudaStreamDestroy");
    return cudaSuccess;
  }
  cudaError_t CudaEventCreateWithFlags(cudaEvent_t* event,
                                       unsigned int flags) override {
    calls.push_back("CudaEventCreateWithFlags");
    *event = reinterpret_cast<cudaEvent_t>(0x1000 + 8 * events_created++);
    return cudaSuccess;
  }
  cudaError_t CudaEventRecord(cudaEvent_t event, cudaStream_t stream) override {
    calls.push_back(absl::StrCat("CudaEventRecord(", Name(event), ")"));
    return cudaSuccess;
  }
  cudaError_t CudaEventQuery(cudaEvent_t event) override {
    calls.push_back("CudaEventQuery");
    return cudaSuccess;
  }
  cudaError_t CudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event,
                                  unsigned int flags) override {
    calls.push_back("CudaStreamWaitEvent");
    return cudaSuccess;
  }
  cudaError_t CudaEventDestroy(cudaEvent_t event) override {
    calls.push_back("CudaEventDestroy");
    return cudaSuccess;
  }
  cudaError_t CudaPointerGetAttributes(cudaPointerAttributes* attributes,
                                       const void* ptr) override {
    calls.push_back("CudaPointerGetAttributes");
    *attributes = cudaPointerAttributes{};
    attributes->type = cudaMemoryTypeDevice;
    attributes->device = 0;
    attributes->devicePointer = const_cast<void*>(ptr);
    return cudaSuccess;
  }
  cudaError_t CudaMalloc(void** ptr, size_t bytes) override {
    calls.push_back("CudaMalloc");
    return cudaSuccess;
  }
  cudaError_t CudaFree(void* ptr) override {
    calls.push_back("CudaFree");
    return cudaSuccess;
  }
  cudaError_t CudaMemcpyAsync(void* dst, const void* src, size_t bytes,
                              cudaMemcpyKind kind,
                              cudaStream_t stream) override {
    calls.push_back("CudaMemcpyAsync");
    return cudaSuccess;
  }
  const char* CudaGetErrorName(cudaError_t error) override {
    calls.push_back("CudaGetErrorName");
    return "";
  }
  const char* CudaGetErrorString(cudaError_t error) override {
    calls.push_back("CudaGetErrorString");
    return "";
  }
};

TEST(TimedNcclApiTest, BracketsOnlyTheArmedCollective) {
  RecordingNcclApi inner;
  TimedNcclApi api(inner);
  const auto stream = reinterpret_cast<cudaStream_t>(0x5000);
  EXPECT_EQ(api.AllGather(nullptr, nullptr, 4, ncclFloat32, nullptr, stream),
            ncclSuccess);
  EXPECT_THAT(inner.calls, ElementsAre("AllGather"));
  EXPECT_THAT(api.ElapsedSeconds().status(),
              StatusIs(absl::StatusCode::kFailedPrecondition));

  inner.calls.clear();
  ASSERT_THAT(api.Arm(0), IsOk());
  EXPECT_THAT(api.Arm(0), StatusIs(absl::StatusCode::kFailedPrecondition));
  inner.calls.clear();
  EXPECT_EQ(api.ReduceScatter(nullptr, nullptr, 4, ncclFloat32, ncclSum,
                              nullptr, stream),
            ncclSuccess);
  EXPECT_THAT(inner.calls,
              ElementsAre("CudaEventRecord(start)", "ReduceScatter",
                          "CudaEventRecord(stop)"));
  // Disarmed after one collective.
  inner.calls.clear();
  EXPECT_EQ(
      api.AllReduce(nullptr, nullptr, 4, ncclFloat32, ncclSum, nullptr, stream),
      ncclSuccess);
  EXPECT_THAT(inner.calls, ElementsAre("AllReduce"));
}

TEST(TimedNcclApiTest, EventsAreCreatedOnceOnTheArmedDevice) {
  RecordingNcclApi inner;
  TimedNcclApi api(inner);
  ASSERT_THAT(api.Arm(0), IsOk());
  EXPECT_THAT(
      inner.calls,
      ElementsAre("CudaGetDevice", "CudaSetDevice", "CudaEventCreateWithFlags",
                  "CudaEventCreateWithFlags", "CudaSetDevice"));
  EXPECT_EQ(
      api.Broadcast(nullptr, nullptr, 4, ncclFloat32, 0, nullptr, nullptr),
      ncclSuccess);
  inner.calls.clear();
  ASSERT_THAT(api.Arm(0), IsOk());
  EXPECT_THAT(inner.calls, ElementsAre());
  EXPECT_THAT(api.Arm(1), StatusIs(absl::StatusCode::kFailedPrecondition));
}

// Under NcclCommunicator: its pointer checks and event creation happen
// before the start event, its completion event after the stop event.
TEST(TimedNcclApiTest, CommunicatorHostWorkFallsOutsideTheEvents) {
  RecordingNcclApi inner;
  TimedNcclApi api(inner);
  auto comm_or =
      NcclCommunicator::Wrap(api, reinterpret_cast<ncclComm_t>(0x7000),
                             NcclCommunicator::Ownership::kBorrow);
  ASSERT_THAT(comm_or.status(), IsOk());
  std::unique_ptr<NcclCommunicator> comm = *std::move(comm_or);
  std::vector<float> a(16), b(16);
  BufferRef in{a.data(), 16, DType::kFloat32, Device::Cuda(0)};
  BufferRef out{b.data(), 16, DType::kFloat32, Device::Cuda(0)};
  inner.calls.clear();
  ASSERT_THAT(api.Arm(0), IsOk());  // as the benchmarks do: just before
  std::unique_ptr<Work> work = comm->AllGather(in, out, {});
  ASSERT_THAT(work->Wait(), IsOk());
  const std::vector<std::string>& c = inner.calls;
  const auto start = std::find(c.begin(), c.end(), "CudaEventRecord(start)");
  ASSERT_NE(start, c.end()) << ::testing::PrintToString(c);
  ASSERT_LE(start + 3, c.end());
  EXPECT_EQ(start[1], "AllGather");
  EXPECT_EQ(start[2], "CudaEventRecord(stop)");
  // The communicator's host-side work before the call is outside.
  EXPECT_NE(std::find(c.begin(), start, "CudaPointerGetAttributes"), start)
      << ::testing::PrintToString(c);
}

}  // namespace
}  // namespace bench
}  // namespace flatparam
