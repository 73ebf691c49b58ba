// NcclCommunicator's logic against FakeNcclApi: no GPU needed. Each test
// also checks that the fake saw no misuse of the NCCL/CUDA APIs.
#include "comm/nccl/nccl_communicator.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "comm/communicator.h"
#include "comm/flight_recorder.h"
#include "comm/nccl/fake_nccl_api.h"
#include "comm/nccl/nccl_api.h"
#include "comm/nccl/thread_bootstrap_testutil.h"
#include "flatparam/base/dtype.h"
#include "flatparam/base/status_matchers.h"

namespace flatparam {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::IsNull;
using ::testing::NotNull;
using ::testing::StartsWith;

using Ownership = NcclCommunicator::Ownership;

class NcclCommunicatorTest : public ::testing::Test {
 protected:
  void TearDown() override { EXPECT_THAT(api_.misuse(), IsEmpty()); }

  // Rank `rank` of a fake NCCL communicator of `nranks` on device 0.
  std::unique_ptr<NcclCommunicator> Make(int nranks, int rank,
                                         NcclOptions options = {},
                                         bool blocking = true) {
    ncclUniqueId id;
    std::memset(&id, 0, sizeof(id));
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = blocking ? 1 : 0;
    ncclComm_t comm = nullptr;
    EXPECT_EQ(api_.CommInitRankConfig(&comm, nranks, id, rank, &config),
              ncclSuccess);
    absl::StatusOr<std::unique_ptr<NcclCommunicator>> nccl =
        NcclCommunicator::Wrap(api_, api_, comm, Ownership::kTakeOwnership,
                               options);
    EXPECT_THAT(nccl, IsOk());
    return nccl.ok() ? *std::move(nccl) : nullptr;
  }

  // Fake device memory on `device`, holding `values` (zeros by default).
  BufferRef Alloc(int64_t count, DType dtype = DType::kFloat32, int device = 0,
                  std::vector<double> values = {}) {
    int previous = 0;
    api_.GetDevice(&previous);
    api_.SetDevice(device);
    void* ptr = nullptr;
    EXPECT_EQ(api_.Malloc(&ptr, count * DTypeSize(dtype)), cudaSuccess);
    api_.SetDevice(previous);
    for (size_t i = 0; i < values.size(); ++i) {
      StoreFromDouble(ptr, dtype, i, values[i]);
    }
    return {ptr, count, dtype, Device::Cuda(0)};
  }

  static std::vector<double> Read(ConstBufferRef b) {
    std::vector<double> values;
    for (int64_t i = 0; i < b.count; ++i) {
      values.push_back(LoadAsDouble(b.data, b.dtype, i));
    }
    return values;
  }

  FakeNcclApi api_{/*device_count=*/2};
};

// ---------------------------------------------------------------------------
// Stream-ordered completion (CollectiveOptions::stream, Work::WaitStream).

// Index of the first call named `name` in `calls`, or -1.
int IndexOf(const std::vector<std::string>& calls, absl::string_view name) {
  auto it = std::find(calls.begin(), calls.end(), name);
  return it == calls.end() ? -1 : static_cast<int>(it - calls.begin());
}

TEST_F(NcclCommunicatorTest, SupportsStreamsOfItsDeviceOnly) {
  std::unique_ptr<NcclCommunicator> nccl = Make(1, 0);
  EXPECT_TRUE(nccl->SupportsStreams(Device::Cuda(0)));
  EXPECT_FALSE(nccl->SupportsStreams(Device::Cuda(1)));
  EXPECT_FALSE(nccl->SupportsStreams(Device::Host()));
}

TEST_F(NcclCommunicatorTest, StreamOrderedCollectiveWaitsForTheCallersStream) {
  std::unique_ptr<NcclCommunicator> nccl = Make(2, 0);
  cudaStream_t caller = nullptr;
  ASSERT_EQ(api_.StreamCreateWithFlags(&caller, cudaStreamNonBlocking),
            cudaSuccess);
  const DeviceStream stream{Device::Cuda(0), nullptr,
                            reinterpret_cast<uintptr_t>(caller)};
  const BufferRef in = Alloc(4);
  const BufferRef out = Alloc(8);
  CollectiveOptions options;
  options.stream = stream;
  std::unique_ptr<Work> work = nccl->AllGather(in, out, options);
  const std::vector<std::string> calls = api_.calls();
  const int gather = IndexOf(calls, "ncclAllGather");
  ASSERT_GE(gather, 0);
  // Before the collective was enqueued, the communicator's stream waited
  // for an event recorded on the caller's stream; the host did not wait.
  std::vector<FakeNcclApi::StreamWait> waits = api_.stream_waits();
  ASSERT_EQ(waits.size(), 1u);
  EXPECT_EQ(waits[0].stream, nccl->stream());
  EXPECT_EQ(waits[0].recorded_on, caller);
  EXPECT_LT(waits[0].call, gather);
  EXPECT_LT(waits[0].recorded_at, waits[0].call);
  EXPECT_EQ(api_.CallCount("cudaEventQuery"), 0);
  EXPECT_EQ(api_.CallCount("cudaStreamSynchronize"), 0);

  // The consumer's stream waits for the event recorded after it.
  ASSERT_THAT(work->WaitStream(stream), IsOk());
  waits = api_.stream_waits();
  ASSERT_EQ(waits.size(), 2u);
  EXPECT_EQ(waits[1].stream, caller);
  EXPECT_EQ(waits[1].recorded_on, nccl->stream());
  EXPECT_GT(waits[1].recorded_at, gather);
  EXPECT_EQ(api_.CallCount("cudaEventQuery"), 0);
  // The host's check still reports the collective's status.
  EXPECT_THAT(work->Wait(), IsOk());
  work.reset();
  EXPECT_EQ(api_.StreamDestroy(caller), cudaSuccess);
}

TEST_F(NcclCommunicatorTest, WithoutAStreamNothingWaitsOnTheDevice) {
  std::unique_ptr<NcclCommunicator> nccl = Make(2, 0);
  const BufferRef in = Alloc(4);
  const BufferRef out = Alloc(8);
  EXPECT_THAT(nccl->AllGather(in, out, {})->Wait(), IsOk());
  EXPECT_THAT(api_.stream_waits(), IsEmpty());
}

TEST_F(NcclCommunicatorTest, StreamsOfAnotherDeviceOrASimulatorAreRejected) {
  std::unique_ptr<NcclCommunicator> nccl = Make(2, 0);
  const BufferRef in = Alloc(4);
  const BufferRef out = Alloc(8);
  int dummy = 0;
  for (const DeviceStream& bad : {DeviceStream{Device::Cuda(1), nullptr, 0},
                                  DeviceStream{Device::Host(), nullptr, 0},
                                  DeviceStream{Device::Cuda(0), &dummy, 1}}) {
    CollectiveOptions options;
    options.stream = bad;
    EXPECT_THAT(nccl->AllGather(in, out, options)->Wait(),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("not a CUDA stream of this communicator's "
                                   "device cuda:0")));
  }
  EXPECT_EQ(api_.CallCount("ncclAllGather"), 0);
  std::unique_ptr<Work> work = nccl->AllGather(in, out, {});
  EXPECT_THAT(work->WaitStream(DeviceStream{Device::Cuda(1), nullptr, 0}),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(work->Wait(), IsOk());
  EXPECT_THAT(api_.stream_waits(), IsEmpty());
}

TEST_F(NcclCommunicatorTest, AFailedStreamWaitEnqueuesNothing) {
  std::unique_ptr<NcclCommunicator> nccl = Make(2, 0);
  cudaStream_t caller = nullptr;
  ASSERT_EQ(api_.StreamCreateWithFlags(&caller, cudaStreamNonBlocking),
            cudaSuccess);
  const BufferRef in = Alloc(4);
  const BufferRef out = Alloc(8);
  CollectiveOptions options;
  options.stream = DeviceStream{Device::Cuda(0), nullptr,
                                reinterpret_cast<uintptr_t>(caller)};
  api_.FailNext("cudaStreamWaitEvent", cudaErrorInvalidResourceHandle);
  EXPECT_THAT(
      nccl->AllGather(in, out, options)->Wait(),
      StatusIs(absl::StatusCode::kInternal, HasSubstr("cudaStreamWaitEvent")));
  EXPECT_EQ(api_.CallCount("ncclAllGather"), 0);
  EXPECT_FALSE(nccl->aborted());
  // Still usable.
  std::unique_ptr<Work> work = nccl->AllGather(in, out, options);
  // A stream wait that fails says so; the collective itself is fine.
  api_.FailNext("cudaStreamWaitEvent", cudaErrorInvalidResourceHandle);
  EXPECT_THAT(work->WaitStream(*options.stream),
              StatusIs(absl::StatusCode::kInternal,
                       AllOf(HasSubstr("WaitStream"),
                             HasSubstr("cudaStreamWaitEvent"))));
  EXPECT_THAT(work->Wait(), IsOk());
  work.reset();
  EXPECT_EQ(api_.StreamDestroy(caller), cudaSuccess);
}

// ---------------------------------------------------------------------------
// Creation from a bootstrap group.

TEST_F(NcclCommunicatorTest, CreateSharesTheIdAndMakesANonBlockingComm) {
  std::vector<std::unique_ptr<Communicator>> group = MakeThreadGroup(1);
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      std::unique_ptr<NcclCommunicator> nccl,
      NcclCommunicator::Create(api_, api_, *group[0], /*cuda_device=*/1));
  EXPECT_EQ(nccl->rank(), 0);
  EXPECT_EQ(nccl->size(), 1);
  EXPECT_EQ(nccl->backend(), "nccl");
  EXPECT_EQ(nccl->device(), 1);
  EXPECT_EQ(api_.CallCount("ncclGetUniqueId"), 1);
  ASSERT_EQ(api_.comms().size(), 1u);
  const FakeNcclApi::CommInfo info = api_.comms()[0];
  EXPECT_FALSE(info.blocking);
  EXPECT_EQ(info.device, 1);
  EXPECT_THAT(info.unique_id, StartsWith("fake-unique-id-1"));
  ASSERT_EQ(api_.streams().size(), 1u);
  EXPECT_EQ(api_.streams()[0].flags,
            static_cast<unsigned>(cudaStreamNonBlocking));
  EXPECT_EQ(api_.streams()[0].device, 1);
  int current = -1;
  api_.GetDevice(&current);
  EXPECT_EQ(current, 0) << "Create must restore the caller's device";

  nccl.reset();
  EXPECT_TRUE(api_.comms()[0].finalized);
  EXPECT_TRUE(api_.comms()[0].destroyed);
  EXPECT_FALSE(api_.comms()[0].aborted);
  EXPECT_TRUE(api_.streams()[0].destroyed);
}

// After a failure elsewhere in the job, the caller aborts through the
// Communicator interface, and destruction then never waits in
// ncclCommFinalize for peers that may be gone.
TEST_F(NcclCommunicatorTest, AbortThroughTheInterfaceSkipsFinalize) {
  std::vector<std::unique_ptr<Communicator>> group = MakeThreadGroup(1);
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      std::unique_ptr<NcclCommunicator> nccl,
      NcclCommunicator::Create(api_, api_, *group[0], /*cuda_device=*/0));
  std::unique_ptr<Communicator> comm = std::move(nccl);
  comm->Abort(absl::DeadlineExceededError("rank 2 timed out elsewhere"));
  comm->Abort(absl::InternalError("a second abort changes nothing"));
  BufferRef b = Alloc(4);
  EXPECT_THAT(
      comm->AllReduce(b, b, {})->Wait(),
      StatusIs(absl::StatusCode::kAborted, HasSubstr("rank 2 timed out")));
  comm.reset();
  ASSERT_EQ(api_.comms().size(), 1u);
  EXPECT_TRUE(api_.comms()[0].aborted);
  EXPECT_FALSE(api_.comms()[0].finalized);
  EXPECT_EQ(api_.CallCount("ncclCommFinalize"), 0);
}

TEST_F(NcclCommunicatorTest, CreateOnThreeThreadsJoinsOneCommunicator) {
  FakeNcclApi api(/*device_count=*/3);
  std::vector<std::unique_ptr<Communicator>> group = MakeThreadGroup(3);
  std::vector<absl::StatusOr<std::unique_ptr<NcclCommunicator>>> results(3);
  std::vector<std::thread> threads;
  for (int r = 0; r < 3; ++r) {
    threads.emplace_back([&, r] {
      results[r] = NcclCommunicator::Create(api, api, *group[r], r);
    });
  }
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < 3; ++r) {
    ASSERT_THAT(results[r], IsOk());
    EXPECT_EQ((*results[r])->rank(), r);
    EXPECT_EQ((*results[r])->size(), 3);
    EXPECT_EQ((*results[r])->device(), r);
  }
  EXPECT_EQ(api.CallCount("ncclGetUniqueId"), 1);
  const std::vector<FakeNcclApi::CommInfo> comms = api.comms();
  ASSERT_EQ(comms.size(), 3u);
  for (const FakeNcclApi::CommInfo& info : comms) {
    EXPECT_EQ(info.unique_id, comms[0].unique_id);
    EXPECT_EQ(info.nranks, 3);
  }
  results.clear();
  EXPECT_THAT(api.misuse(), IsEmpty());
}

// Initialization ends in a barrier over the bootstrap: a rank whose
// ncclCommInitRank failed fails every rank's Create (which would otherwise
// succeed and hang in the first collective), and each aborts its comm.
TEST_F(NcclCommunicatorTest, OneRanksFailedInitFailsEveryRank) {
  FakeNcclApi api(/*device_count=*/3);
  api.FailNext("ncclCommInitRankConfig", ncclSystemError);
  std::vector<std::unique_ptr<Communicator>> group = MakeThreadGroup(3);
  std::vector<absl::StatusOr<std::unique_ptr<NcclCommunicator>>> results(3);
  std::vector<std::thread> threads;
  for (int r = 0; r < 3; ++r) {
    threads.emplace_back([&, r] {
      results[r] = NcclCommunicator::Create(api, api, *group[r], r);
    });
  }
  for (std::thread& t : threads) t.join();
  int failed_init = 0;
  for (int r = 0; r < 3; ++r) {
    ASSERT_FALSE(results[r].ok()) << "rank " << r;
    if (results[r].status().code() == absl::StatusCode::kUnavailable) {
      ++failed_init;  // ncclSystemError, its own
    } else {
      EXPECT_THAT(results[r],
                  StatusIs(absl::StatusCode::kAborted,
                           AllOf(HasSubstr("failed to initialize its NCCL "
                                           "communicator"),
                                 HasSubstr("ncclSystemError"))));
    }
  }
  EXPECT_EQ(failed_init, 1);
  for (const FakeNcclApi::CommInfo& info : api.comms()) {
    EXPECT_TRUE(info.aborted);
  }
}

TEST_F(NcclCommunicatorTest, OneRanksBadDeviceFailsEveryRankWithoutHanging) {
  std::vector<std::unique_ptr<Communicator>> group = MakeThreadGroup(3);
  std::vector<absl::StatusOr<std::unique_ptr<NcclCommunicator>>> results(3);
  std::vector<std::thread> threads;
  for (int r = 0; r < 3; ++r) {
    threads.emplace_back([&, r] {
      results[r] =
          NcclCommunicator::Create(api_, api_, *group[r], r == 1 ? 5 : 0);
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_THAT(
      results[1],
      StatusIs(absl::StatusCode::kInvalidArgument,
               AllOf(HasSubstr("rank 1: creating the NCCL communicator"),
                     HasSubstr("CUDA device 5 is not in [0, 2)"))));
  for (int r : {0, 2}) {
    EXPECT_THAT(results[r], StatusIs(absl::StatusCode::kAborted,
                                     AllOf(HasSubstr("rank 1 failed"),
                                           HasSubstr("CUDA device 5"))));
  }
  EXPECT_EQ(api_.CallCount("ncclCommInitRankConfig"), 0);
}

TEST_F(NcclCommunicatorTest, CreateWithoutAGpuSaysSo) {
  api_.set_device_count_error(cudaErrorInsufficientDriver);
  std::vector<std::unique_ptr<Communicator>> group = MakeThreadGroup(1);
  EXPECT_THAT(NcclCommunicator::Create(api_, api_, *group[0], 0),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr("no usable GPU"),
                             HasSubstr("cudaErrorInsufficientDriver"))));
}

TEST_F(NcclCommunicatorTest, CreateReportsNcclErrorsWithTheLastError) {
  api_.FailNext("ncclCommInitRankConfig", ncclSystemError);
  api_.set_last_error("bootstrap: socket timed out");
  std::vector<std::unique_ptr<Communicator>> group = MakeThreadGroup(1);
  EXPECT_THAT(
      NcclCommunicator::Create(api_, api_, *group[0], 0),
      StatusIs(absl::StatusCode::kUnavailable,
               AllOf(HasSubstr("rank 0: creating the NCCL communicator"),
                     HasSubstr("ncclCommInitRankConfig"),
                     HasSubstr("ncclSystemError"),
                     HasSubstr("bootstrap: socket timed out"))));
}

TEST_F(NcclCommunicatorTest, NonBlockingInitIsPolledUntilReady) {
  api_.set_in_progress_polls(3);
  std::vector<std::unique_ptr<Communicator>> group = MakeThreadGroup(1);
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      std::unique_ptr<NcclCommunicator> nccl,
      NcclCommunicator::Create(api_, api_, *group[0], 0));
  EXPECT_GE(api_.CallCount("ncclCommGetAsyncError"), 4);
  api_.set_in_progress_polls(0);
}

TEST_F(NcclCommunicatorTest, InitThatNeverFinishesTimesOutAndAborts) {
  api_.set_in_progress_polls(-1);
  std::vector<std::unique_ptr<Communicator>> group = MakeThreadGroup(1);
  NcclOptions options;
  options.setup_timeout = absl::Milliseconds(20);
  EXPECT_THAT(NcclCommunicator::Create(api_, api_, *group[0], 0, options),
              StatusIs(absl::StatusCode::kDeadlineExceeded,
                       AllOf(HasSubstr("still in progress after 20ms"),
                             HasSubstr("ncclCommAbort"))));
  ASSERT_EQ(api_.comms().size(), 1u);
  EXPECT_TRUE(api_.comms()[0].aborted);
}

TEST_F(NcclCommunicatorTest, BlockingOptionMakesABlockingComm) {
  std::vector<std::unique_ptr<Communicator>> group = MakeThreadGroup(1);
  NcclOptions options;
  options.blocking = true;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      std::unique_ptr<NcclCommunicator> nccl,
      NcclCommunicator::Create(api_, api_, *group[0], 0, options));
  EXPECT_TRUE(api_.comms()[0].blocking);
}

// ---------------------------------------------------------------------------
// Wrapping.

TEST_F(NcclCommunicatorTest, WrapReadsRankSizeAndDeviceFromTheComm) {
  api_.SetDevice(1);
  ncclUniqueId id;
  std::memset(&id, 0, sizeof(id));
  ncclComm_t comm = nullptr;
  ASSERT_EQ(api_.CommInitRankConfig(&comm, 8, id, 5, nullptr), ncclSuccess);
  api_.SetDevice(0);
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      std::unique_ptr<NcclCommunicator> nccl,
      NcclCommunicator::Wrap(api_, api_, comm, Ownership::kBorrow));
  EXPECT_EQ(nccl->rank(), 5);
  EXPECT_EQ(nccl->size(), 8);
  EXPECT_EQ(nccl->device(), 1);
  EXPECT_EQ(nccl->comm(), comm);
  nccl.reset();
  EXPECT_FALSE(api_.comm_info(comm).finalized);
  EXPECT_FALSE(api_.comm_info(comm).destroyed);
  EXPECT_EQ(api_.CommDestroy(comm), ncclSuccess);
}

TEST_F(NcclCommunicatorTest, WrapUsesTheCallersStreamAndLeavesIt) {
  cudaStream_t stream = nullptr;
  ASSERT_EQ(api_.StreamCreateWithFlags(&stream, 0), cudaSuccess);
  ncclUniqueId id;
  std::memset(&id, 0, sizeof(id));
  ncclComm_t comm = nullptr;
  ASSERT_EQ(api_.CommInitRankConfig(&comm, 1, id, 0, nullptr), ncclSuccess);
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      std::unique_ptr<NcclCommunicator> nccl,
      NcclCommunicator::Wrap(api_, api_, comm, Ownership::kTakeOwnership, {},
                             stream));
  EXPECT_EQ(nccl->stream(), stream);
  BufferRef b = Alloc(4);
  EXPECT_THAT(nccl->AllReduce(b, b, {})->Wait(), IsOk());
  EXPECT_EQ(api_.collectives()[0].stream, stream);
  nccl.reset();
  EXPECT_TRUE(api_.comm_info(comm).destroyed);
  EXPECT_FALSE(api_.streams()[0].destroyed);
  EXPECT_EQ(api_.StreamDestroy(stream), cudaSuccess);
}

TEST_F(NcclCommunicatorTest, WrapRejectsANullComm) {
  EXPECT_THAT(NcclCommunicator::Wrap(api_, api_, nullptr, Ownership::kBorrow),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

// ---------------------------------------------------------------------------
// Collectives: mapping to NCCL calls.

TEST_F(NcclCommunicatorTest, AllGatherCallsNcclAllGatherWithSendCount) {
  std::unique_ptr<NcclCommunicator> nccl = Make(4, 2);
  BufferRef in = Alloc(3, DType::kFloat32, 0, {1, 2, 3});
  BufferRef out = Alloc(12);
  EXPECT_THAT(nccl->AllGather(in, out, {})->Wait(), IsOk());
  ASSERT_EQ(api_.collectives().size(), 1u);
  const FakeNcclApi::Collective call = api_.collectives()[0];
  EXPECT_EQ(call.name, "ncclAllGather");
  EXPECT_EQ(call.sendbuff, in.data);
  EXPECT_EQ(call.recvbuff, out.data);
  EXPECT_EQ(call.count, 3u);
  EXPECT_EQ(call.datatype, ncclFloat32);
  EXPECT_EQ(call.stream, nccl->stream());
  EXPECT_EQ(call.comm, nccl->comm());
  // Rank 2's block; the fake's peers contribute zeros.
  EXPECT_THAT(Read(out), ElementsAre(0, 0, 0, 0, 0, 0, 1, 2, 3, 0, 0, 0));
  EXPECT_EQ(api_.live_events(), 0) << "the Work destroyed its event";
}

TEST_F(NcclCommunicatorTest, EveryCollectiveIsInTheFlightRecorder) {
  std::unique_ptr<NcclCommunicator> nccl = Make(4, 2);
  FlightRecorder* recorder = nccl->flight_recorder();
  ASSERT_NE(recorder, nullptr);
  BufferRef in = Alloc(3, DType::kFloat32, 0, {1, 2, 3});
  BufferRef out = Alloc(12);
  {
    ScopedCollectiveContext context(
        recorder, {"h.1", 2, CollectivePhase::kForwardUnshard});
    EXPECT_THAT(nccl->AllGather(in, out, {})->Wait(), IsOk());
  }
  BufferRef bad = Alloc(11);
  EXPECT_FALSE(nccl->AllGather(in, bad, {})->Wait().ok());
  const std::vector<FlightEntry> entries = recorder->Snapshot();
  ASSERT_EQ(entries.size(), 2u);
  EXPECT_EQ(entries[0].group->id, "world");
  EXPECT_EQ(entries[0].seq, 0);
  EXPECT_EQ(entries[0].op, CollectiveOp::kAllGather);
  EXPECT_EQ(entries[0].count, 3);
  EXPECT_EQ(entries[0].bytes, 12);
  EXPECT_EQ(entries[0].context.unit, "h.1");
  EXPECT_EQ(entries[0].state, FlightState::kCompleted);
  EXPECT_EQ(entries[1].seq, 1);
  EXPECT_EQ(entries[1].state, FlightState::kFailed);
  EXPECT_THAT(entries[1].error, HasSubstr("rank 2: all_gather #1"));
}

TEST_F(NcclCommunicatorTest, MapsEveryDtype) {
  std::unique_ptr<NcclCommunicator> nccl = Make(1, 0);
  const std::pair<DType, ncclDataType_t> cases[] = {
      {DType::kFloat32, ncclFloat32},
      {DType::kFloat64, ncclFloat64},
      {DType::kFloat16, ncclFloat16},
      {DType::kBFloat16, ncclBfloat16},
  };
  for (const auto& [dtype, expected] : cases) {
    BufferRef b = Alloc(2, dtype, 0, {1.5, -2});
    EXPECT_THAT(nccl->AllReduce(b, b, {})->Wait(), IsOk());
    EXPECT_EQ(api_.collectives().back().datatype, expected) << DTypeName(dtype);
    EXPECT_THAT(Read(b), ElementsAre(1.5, -2));
  }
}

TEST_F(NcclCommunicatorTest, UnsupportedDtypeIsUnimplemented) {
  std::unique_ptr<NcclCommunicator> nccl = Make(1, 0);
  BufferRef b = Alloc(2, DType::kInt32);
  EXPECT_THAT(nccl->AllReduce(b, b, {})->Wait(),
              StatusIs(absl::StatusCode::kUnimplemented, HasSubstr("int32")));
  EXPECT_THAT(api_.collectives(), IsEmpty());
}

TEST_F(NcclCommunicatorTest, AllGatherInPlace) {
  std::unique_ptr<NcclCommunicator> nccl = Make(4, 2);
  BufferRef out = Alloc(12);
  BufferRef in = out.Slice(2 * 3, 3);
  EXPECT_THAT(nccl->AllGather(in, out, {})->Wait(), IsOk());
  EXPECT_EQ(api_.collectives()[0].sendbuff,
            static_cast<char*>(out.data) + 6 * sizeof(float));
}

TEST_F(NcclCommunicatorTest, OverlappingBuffersThatAreNotInPlaceAreRejected) {
  std::unique_ptr<NcclCommunicator> nccl = Make(4, 2);
  BufferRef out = Alloc(12);
  EXPECT_THAT(nccl->AllGather(out.Slice(1, 3), out, {})->Wait(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("rank 2: all_gather #0"),
                             HasSubstr("overlap"))));
  BufferRef buf = Alloc(8);
  EXPECT_THAT(
      nccl->AllReduce(buf.Slice(0, 4), buf.Slice(2, 4), {})->Wait(),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("overlap")));
  EXPECT_THAT(api_.collectives(), IsEmpty());
}

TEST_F(NcclCommunicatorTest, ReduceScatterInPlaceAndData) {
  std::unique_ptr<NcclCommunicator> nccl = Make(4, 1);
  BufferRef in = Alloc(8, DType::kFloat32, 0, {1, 2, 3, 4, 5, 6, 7, 8});
  BufferRef out = Alloc(2);
  EXPECT_THAT(nccl->ReduceScatter(in, out, {})->Wait(), IsOk());
  EXPECT_EQ(api_.collectives()[0].name, "ncclReduceScatter");
  EXPECT_EQ(api_.collectives()[0].count, 2u) << "recvcount";
  EXPECT_THAT(Read(out), ElementsAre(3, 4));
  // In place: the output is this rank's block of the input.
  EXPECT_THAT(nccl->ReduceScatter(in, in.Slice(2, 2), {})->Wait(), IsOk());
  EXPECT_EQ(api_.collectives()[1].recvbuff,
            static_cast<char*>(in.data) + 2 * sizeof(float));
}

TEST_F(NcclCommunicatorTest, ReduceOpsMapToNcclBuiltins) {
  std::unique_ptr<NcclCommunicator> nccl = Make(2, 0);
  const std::pair<ReduceOp, ncclRedOp_t> cases[] = {
      {ReduceOp::kSum, ncclSum},
      {ReduceOp::kAvg, ncclAvg},
      {ReduceOp::kMax, ncclMax},
      {ReduceOp::kMin, ncclMin},
  };
  for (const auto& [op, expected] : cases) {
    BufferRef in = Alloc(4);
    BufferRef out = Alloc(2);
    ReduceOptions options;
    options.op = op;
    EXPECT_THAT(nccl->ReduceScatter(in, out, options)->Wait(), IsOk());
    EXPECT_EQ(api_.collectives().back().op, expected) << ReduceOpName(op);
    EXPECT_THAT(nccl->AllReduce(in, in, options)->Wait(), IsOk());
    EXPECT_EQ(api_.collectives().back().op, expected) << ReduceOpName(op);
  }
  EXPECT_THAT(api_.premul_ops(), IsEmpty());
}

TEST_F(NcclCommunicatorTest, DivideFactorsBecomeOnePreMultipliedSum) {
  std::unique_ptr<NcclCommunicator> nccl = Make(4, 1);
  BufferRef in = Alloc(8, DType::kFloat32, 0, {1, 2, 6, 12, 5, 6, 7, 8});
  BufferRef out = Alloc(2);
  ReduceOptions options;
  options.pre_divide_factor = 2;
  options.post_divide_factor = 3;
  EXPECT_THAT(nccl->ReduceScatter(in, out, options)->Wait(), IsOk());
  ASSERT_EQ(api_.premul_ops().size(), 1u);
  const FakeNcclApi::PreMulSum sum = api_.premul_ops()[0];
  EXPECT_EQ(sum.scalar, static_cast<double>(1.0f / 6.0f));
  EXPECT_EQ(sum.datatype, ncclFloat32);
  EXPECT_EQ(sum.residence, ncclScalarHostImmediate);
  EXPECT_EQ(sum.comm, nccl->comm());
  EXPECT_TRUE(sum.destroyed) << "destroyed once the collective is enqueued";
  EXPECT_EQ(api_.collectives()[0].op, sum.op);
  EXPECT_THAT(Read(out), ElementsAre(static_cast<float>(6 * (1.0f / 6.0f)),
                                     static_cast<float>(12 * (1.0f / 6.0f))));

  // kAvg folds the group size in too: 1 / (2 * 3 * 4).
  options.op = ReduceOp::kAvg;
  EXPECT_THAT(nccl->AllReduce(in, in, options)->Wait(), IsOk());
  ASSERT_EQ(api_.premul_ops().size(), 2u);
  EXPECT_EQ(api_.premul_ops()[1].scalar, static_cast<double>(1.0f / 24.0f));
  EXPECT_TRUE(api_.premul_ops()[1].destroyed);
}

TEST_F(NcclCommunicatorTest, PreMulScalarIsRoundedToTheBufferDtype) {
  std::unique_ptr<NcclCommunicator> nccl = Make(1, 0);
  ReduceOptions options;
  options.pre_divide_factor = 3;
  for (DType dtype : {DType::kFloat16, DType::kBFloat16, DType::kFloat64}) {
    BufferRef b = Alloc(2, dtype, 0, {3, 6});
    EXPECT_THAT(nccl->AllReduce(b, b, options)->Wait(), IsOk());
    alignas(8) char storage[8];
    StoreFromDouble(storage, dtype, 0, 1.0 / 3.0);
    const double expected = LoadAsDouble(storage, dtype, 0);
    EXPECT_EQ(api_.premul_ops().back().scalar, expected) << DTypeName(dtype);
    if (dtype == DType::kFloat16) {
      EXPECT_EQ(expected, 0.333251953125);
    }
  }
}

TEST_F(NcclCommunicatorTest, DivideFactorsThatUnderflowTheDtypeAreRejected) {
  std::unique_ptr<NcclCommunicator> nccl = Make(1, 0);
  BufferRef b = Alloc(2, DType::kFloat16);
  ReduceOptions options;
  options.pre_divide_factor = 1e5;
  options.post_divide_factor = 1e5;
  EXPECT_THAT(nccl->AllReduce(b, b, options)->Wait(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("rank 0: all_reduce #0"),
                             HasSubstr("divide factors 100000 and 100000"),
                             HasSubstr("float16"))));
  EXPECT_THAT(api_.calls(),
              ::testing::Not(::testing::Contains("ncclRedOpCreatePreMulSum")));
}

TEST_F(NcclCommunicatorTest, BroadcastIsInPlaceFromTheRootRank) {
  std::unique_ptr<NcclCommunicator> nccl = Make(3, 0);
  BufferRef b = Alloc(5, DType::kBFloat16);
  BroadcastOptions options;
  options.root = 2;
  EXPECT_THAT(nccl->Broadcast(b, options)->Wait(), IsOk());
  const FakeNcclApi::Collective call = api_.collectives()[0];
  EXPECT_EQ(call.name, "ncclBroadcast");
  EXPECT_EQ(call.sendbuff, b.data);
  EXPECT_EQ(call.recvbuff, b.data);
  EXPECT_EQ(call.root, 2);
  EXPECT_EQ(call.count, 5u);
  EXPECT_EQ(call.datatype, ncclBfloat16);
  options.root = 3;
  EXPECT_THAT(nccl->Broadcast(b, options)->Wait(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("root 3 is not in [0, 3)")));
}

TEST_F(NcclCommunicatorTest, ZeroElementsCallNoNcclFunction) {
  std::unique_ptr<NcclCommunicator> nccl = Make(2, 1);
  BufferRef none{nullptr, 0, DType::kFloat32, Device::Cuda(0)};
  EXPECT_THAT(nccl->AllGather(none, none, {})->Wait(), IsOk());
  EXPECT_THAT(nccl->ReduceScatter(none, none, {})->Wait(), IsOk());
  EXPECT_THAT(nccl->AllReduce(none, none, {})->Wait(), IsOk());
  EXPECT_THAT(nccl->Broadcast(none, {})->Wait(), IsOk());
  EXPECT_THAT(api_.collectives(), IsEmpty());
}

// ---------------------------------------------------------------------------
// Buffers.

TEST_F(NcclCommunicatorTest, HostBuffersAreUnimplemented) {
  std::unique_ptr<NcclCommunicator> nccl = Make(1, 0);
  std::vector<float> host(4);
  BufferRef b{host.data(), 4, DType::kFloat32, Device::Host()};
  EXPECT_THAT(nccl->AllReduce(b, b, {})->Wait(),
              StatusIs(absl::StatusCode::kUnimplemented,
                       AllOf(HasSubstr("rank 0: all_reduce #0"),
                             HasSubstr("takes CUDA buffers on cuda:0"),
                             HasSubstr("4 x float32 on host"))));
  EXPECT_THAT(
      nccl->Broadcast(b, {})->Wait(),
      StatusIs(absl::StatusCode::kUnimplemented, HasSubstr("broadcast #1")));
  EXPECT_THAT(api_.collectives(), IsEmpty());
}

TEST_F(NcclCommunicatorTest, BuffersOfAnotherDeviceAreInvalid) {
  std::unique_ptr<NcclCommunicator> nccl = Make(1, 0);
  BufferRef b = Alloc(4);
  b.device = Device::Cuda(1);
  EXPECT_THAT(nccl->AllReduce(b, b, {})->Wait(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("is on cuda:1 but this communicator's device "
                                 "is cuda:0")));
}

TEST_F(NcclCommunicatorTest, PointerChecksCatchMislabelledMemory) {
  std::unique_ptr<NcclCommunicator> nccl = Make(1, 0);
  std::vector<float> host(4);
  BufferRef fake_cuda{host.data(), 4, DType::kFloat32, Device::Cuda(0)};
  EXPECT_THAT(nccl->AllReduce(fake_cuda, fake_cuda, {})->Wait(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("is labelled cuda:0 but is not device "
                                 "memory")));
  BufferRef elsewhere = Alloc(4, DType::kFloat32, /*device=*/1);
  EXPECT_THAT(nccl->AllReduce(elsewhere, elsewhere, {})->Wait(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("was allocated on cuda:1")));
  EXPECT_THAT(api_.collectives(), IsEmpty());
}

TEST_F(NcclCommunicatorTest, PointerChecksCanBeTurnedOff) {
  NcclOptions options;
  options.check_pointers = false;
  std::unique_ptr<NcclCommunicator> nccl = Make(1, 0, options);
  BufferRef b = Alloc(4);
  EXPECT_THAT(nccl->AllReduce(b, b, {})->Wait(), IsOk());
  EXPECT_EQ(api_.CallCount("cudaPointerGetAttributes"), 0);
}

TEST_F(NcclCommunicatorTest, ArgumentErrorsNameRankOpAndSequenceNumber) {
  std::unique_ptr<NcclCommunicator> nccl = Make(4, 1);
  BufferRef in = Alloc(3);
  BufferRef out = Alloc(11);
  EXPECT_THAT(nccl->AllGather(in, out, {})->Wait(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("rank 1: all_gather #0"),
                             HasSubstr("12"), HasSubstr("11"))));
  EXPECT_THAT(nccl->AllGather(in, out, {})->Wait(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("rank 1: all_gather #1")));
  EXPECT_THAT(api_.collectives(), IsEmpty());
}

// ---------------------------------------------------------------------------
// Completion, timeouts, errors and aborts.

TEST_F(NcclCommunicatorTest, WaitPollsTheEventUntilItCompletes) {
  std::unique_ptr<NcclCommunicator> nccl = Make(1, 0);
  api_.set_event_pending_queries(5);
  BufferRef b = Alloc(4);
  std::unique_ptr<Work> work = nccl->AllReduce(b, b, {});
  EXPECT_THAT(work->Wait(), IsOk());
  EXPECT_EQ(api_.CallCount("cudaEventQuery"), 6);
  EXPECT_THAT(work->Wait(), IsOk());
  EXPECT_EQ(api_.CallCount("cudaEventQuery"), 6) << "the status is cached";
  // The five "not ready" answers are not left in the thread's last-error
  // state, where the next kernel launch on this thread would report them.
  EXPECT_EQ(api_.PeekAtLastError(), cudaSuccess);
}

// A failed CUDA call that the communicator reported is not reported again
// by the next launch on the thread.
TEST_F(NcclCommunicatorTest, AReportedCudaErrorIsClearedFromTheThread) {
  std::unique_ptr<NcclCommunicator> nccl = Make(1, 0);
  api_.FailNext("cudaMallocAsync", cudaErrorMemoryAllocation);
  EXPECT_THAT(nccl->AllGatherBytes("abc", {}).status(),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstr("cudaMallocAsync")));
  EXPECT_EQ(api_.PeekAtLastError(), cudaSuccess);
}

// ncclCommFinalize completes only when every rank finalizes; after a
// failure its peers may never get there. Destruction after any failure of
// the communicator (an argument error included: the caller is unwinding
// while its peers wait in the collective it never issued) aborts at once
// instead of polling for the setup timeout.
TEST_F(NcclCommunicatorTest, DestructionAfterAFailureAbortsAtOnce) {
  NcclOptions options;
  options.setup_timeout = absl::Seconds(30);
  std::unique_ptr<NcclCommunicator> nccl =
      Make(2, 0, options, /*blocking=*/false);
  BufferRef in = Alloc(4), out = Alloc(3);
  EXPECT_THAT(nccl->AllGather(in, out, {})->Wait(),
              StatusIs(absl::StatusCode::kInvalidArgument));
  api_.set_in_progress_polls(-1);  // a finalize would never complete
  const absl::Time start = absl::Now();
  nccl.reset();
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  EXPECT_EQ(api_.CallCount("ncclCommFinalize"), 0);
  ASSERT_EQ(api_.comms().size(), 1u);
  EXPECT_TRUE(api_.comms()[0].aborted);
  api_.set_in_progress_polls(0);
}

// The same when another communicator of the process failed (HSDP's other
// group): this one's peers are unwinding too.
TEST_F(NcclCommunicatorTest, DestructionAfterAnotherCommunicatorFailedAborts) {
  NcclOptions options;
  options.setup_timeout = absl::Seconds(30);
  std::unique_ptr<NcclCommunicator> healthy =
      Make(2, 0, options, /*blocking=*/false);
  std::unique_ptr<NcclCommunicator> failing = Make(2, 0);
  api_.set_event_pending_queries(-1);
  BufferRef b = Alloc(4);
  ReduceOptions timeout;
  timeout.timeout = absl::Milliseconds(10);
  EXPECT_THAT(failing->AllReduce(b, b, timeout)->Wait(),
              StatusIs(absl::StatusCode::kDeadlineExceeded));
  api_.set_event_pending_queries(0);
  api_.set_in_progress_polls(-1);
  const absl::Time start = absl::Now();
  healthy.reset();
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  EXPECT_EQ(api_.CallCount("ncclCommFinalize"), 0);
  ASSERT_EQ(api_.comms().size(), 2u);
  EXPECT_TRUE(api_.comms()[0].aborted);
  api_.set_in_progress_polls(0);
}

// Without a failure, destruction still finalizes (flushing outstanding
// work) before destroying.
TEST_F(NcclCommunicatorTest, CleanDestructionFinalizes) {
  std::unique_ptr<NcclCommunicator> nccl = Make(1, 0);
  BufferRef b = Alloc(4);
  EXPECT_THAT(nccl->AllReduce(b, b, {})->Wait(), IsOk());
  nccl.reset();
  EXPECT_EQ(api_.CallCount("ncclCommFinalize"), 1);
  ASSERT_EQ(api_.comms().size(), 1u);
  EXPECT_TRUE(api_.comms()[0].destroyed);
  EXPECT_FALSE(api_.comms()[0].aborted);
}

TEST_F(NcclCommunicatorTest, TimeoutAbortsAndLaterCallsFailFast) {
  std::unique_ptr<NcclCommunicator> nccl = Make(2, 0);
  api_.set_event_pending_queries(-1);
  BufferRef b = Alloc(4);
  ReduceOptions options;
  options.timeout = absl::Milliseconds(20);
  const absl::Time start = absl::Now();
  std::unique_ptr<Work> work = nccl->AllReduce(b, b, options);
  std::unique_ptr<Work> second = nccl->AllReduce(b, b, options);
  EXPECT_THAT(work->Wait(),
              StatusIs(absl::StatusCode::kDeadlineExceeded,
                       AllOf(HasSubstr("rank 0: all_reduce #0"),
                             HasSubstr("input 4 x float32"),
                             HasSubstr("did not finish within 20ms"),
                             HasSubstr("ncclCommAbort"))));
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(20));
  EXPECT_TRUE(nccl->aborted());
  EXPECT_EQ(nccl->comm(), nullptr);
  ASSERT_EQ(api_.comms().size(), 1u);
  EXPECT_TRUE(api_.comms()[0].aborted);

  // Unfinished Work and later calls fail at once, quoting the first error.
  EXPECT_THAT(
      second->Wait(),
      StatusIs(absl::StatusCode::kAborted,
               AllOf(HasSubstr("all_reduce #1"), HasSubstr("aborted earlier"),
                     HasSubstr("did not finish within 20ms"))));
  EXPECT_THAT(nccl->AllGather(b.Slice(0, 2), b, {})->Wait(),
              StatusIs(absl::StatusCode::kAborted, HasSubstr("all_gather #2")));
  EXPECT_THAT(nccl->Barrier({}),
              StatusIs(absl::StatusCode::kAborted, HasSubstr("barrier #3")));
  EXPECT_THAT(nccl->Split(0, 0, {}),
              StatusIs(absl::StatusCode::kAborted, HasSubstr("split #4")));
  EXPECT_THAT(nccl->AllGatherBytes("x", {}),
              StatusIs(absl::StatusCode::kAborted));
  work.reset();
  second.reset();
  nccl.reset();
  EXPECT_EQ(api_.CallCount("ncclCommFinalize"), 0);
  EXPECT_EQ(api_.CallCount("ncclCommDestroy"), 0);
  EXPECT_EQ(api_.live_events(), 0);
}

TEST_F(NcclCommunicatorTest, AsyncErrorAbortsWithNcclsMessage) {
  std::unique_ptr<NcclCommunicator> nccl = Make(2, 1);
  api_.set_event_pending_queries(-1);
  BufferRef b = Alloc(4);
  std::unique_ptr<Work> work = nccl->AllReduce(b, b, {});
  api_.SetAsyncError(ncclRemoteError);
  api_.set_last_error("peer 0 exited");
  EXPECT_THAT(work->Wait(), StatusIs(absl::StatusCode::kAborted,
                                     AllOf(HasSubstr("rank 1: all_reduce #0"),
                                           HasSubstr("ncclRemoteError"),
                                           HasSubstr("peer 0 exited"),
                                           HasSubstr("ncclCommAbort"))));
  EXPECT_TRUE(api_.comms()[0].aborted);
}

TEST_F(NcclCommunicatorTest, SynchronousNcclErrorsDoNotAbort) {
  std::unique_ptr<NcclCommunicator> nccl = Make(1, 0);
  BufferRef b = Alloc(4);
  ReduceOptions options;
  options.pre_divide_factor = 2;
  api_.FailNext("ncclAllReduce", ncclInvalidUsage);
  EXPECT_THAT(nccl->AllReduce(b, b, options)->Wait(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr("rank 0: all_reduce #0"),
                             HasSubstr("ncclInvalidUsage"),
                             HasSubstr("fake last error"))));
  EXPECT_FALSE(nccl->aborted());
  ASSERT_EQ(api_.premul_ops().size(), 1u);
  EXPECT_TRUE(api_.premul_ops()[0].destroyed);
  EXPECT_THAT(nccl->AllReduce(b, b, options)->Wait(), IsOk());
  EXPECT_EQ(api_.live_events(), 0);
}

TEST_F(NcclCommunicatorTest, CudaErrorsWhileWaitingAbort) {
  std::unique_ptr<NcclCommunicator> nccl = Make(1, 0);
  BufferRef b = Alloc(4);
  api_.FailNext("cudaEventQuery", cudaErrorIllegalAddress);
  EXPECT_THAT(
      nccl->AllReduce(b, b, {})->Wait(),
      StatusIs(absl::StatusCode::kInternal,
               AllOf(HasSubstr("all_reduce #0"), HasSubstr("cudaEventQuery"),
                     HasSubstr("cudaErrorIllegalAddress"))));
  EXPECT_TRUE(nccl->aborted());
}

TEST_F(NcclCommunicatorTest, NonBlockingCollectiveIsPolledBeforeItsEvent) {
  std::unique_ptr<NcclCommunicator> nccl = Make(1, 0, {}, /*blocking=*/false);
  api_.set_in_progress_polls(2);
  BufferRef b = Alloc(4);
  EXPECT_THAT(nccl->AllReduce(b, b, {})->Wait(), IsOk());
  api_.set_in_progress_polls(0);
  const std::vector<std::string> calls = api_.calls();
  const auto collective =
      std::find(calls.begin(), calls.end(), "ncclAllReduce");
  const auto record = std::find(calls.begin(), calls.end(), "cudaEventRecord");
  ASSERT_NE(collective, calls.end());
  ASSERT_NE(record, calls.end());
  EXPECT_GE(std::count(collective, record, "ncclCommGetAsyncError"), 3);
}

TEST_F(NcclCommunicatorTest, NonBlockingCollectiveStuckInProgressTimesOut) {
  std::unique_ptr<NcclCommunicator> nccl = Make(1, 0, {}, /*blocking=*/false);
  api_.set_in_progress_polls(-1);
  BufferRef b = Alloc(4);
  ReduceOptions options;
  options.timeout = absl::Milliseconds(10);
  EXPECT_THAT(nccl->AllReduce(b, b, options)->Wait(),
              StatusIs(absl::StatusCode::kDeadlineExceeded,
                       AllOf(HasSubstr("all_reduce #0"),
                             HasSubstr("still in progress"))));
  EXPECT_TRUE(nccl->aborted());
  EXPECT_EQ(api_.CallCount("cudaEventRecord"), 0);
}

TEST_F(NcclCommunicatorTest, AbortByTheCaller) {
  std::unique_ptr<NcclCommunicator> nccl = Make(1, 0);
  nccl->Abort(absl::UnavailableError("the replicate group failed"));
  EXPECT_THAT(nccl->abort_status(),
              StatusIs(absl::StatusCode::kUnavailable,
                       HasSubstr("the replicate group failed")));
  BufferRef b = Alloc(4);
  EXPECT_THAT(nccl->AllReduce(b, b, {})->Wait(),
              StatusIs(absl::StatusCode::kAborted,
                       HasSubstr("the replicate group failed")));
  nccl->Abort(absl::InternalError("again"));
  EXPECT_EQ(api_.CallCount("ncclCommAbort"), 1);
}

TEST_F(NcclCommunicatorTest, CallsRunOnTheCommDeviceAndRestoreTheCallers) {
  std::unique_ptr<NcclCommunicator> nccl = Make(1, 0);
  BufferRef b = Alloc(4);
  ASSERT_EQ(api_.SetDevice(1), cudaSuccess);
  EXPECT_THAT(nccl->AllReduce(b, b, {})->Wait(), IsOk());
  EXPECT_EQ(api_.collectives()[0].current_device, 0);
  int current = -1;
  api_.GetDevice(&current);
  EXPECT_EQ(current, 1);
}

TEST_F(NcclCommunicatorTest, WorkMayOutliveTheCommunicator) {
  std::unique_ptr<NcclCommunicator> nccl = Make(1, 0);
  api_.set_event_pending_queries(3);
  BufferRef b = Alloc(4);
  ncclComm_t comm = nccl->comm();
  std::unique_ptr<Work> work = nccl->AllReduce(b, b, {});
  nccl.reset();
  EXPECT_FALSE(api_.comm_info(comm).finalized);
  EXPECT_THAT(work->Wait(), IsOk());
  work.reset();
  EXPECT_TRUE(api_.comm_info(comm).finalized);
  EXPECT_TRUE(api_.comm_info(comm).destroyed);
}

// ---------------------------------------------------------------------------
// Split, AllGatherBytes, Barrier.

TEST_F(NcclCommunicatorTest, SplitMakesAChildOnTheSameStream) {
  std::unique_ptr<NcclCommunicator> nccl = Make(4, 1);
  api_.SetNextSplit(2, 0);
  FLATPARAM_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Communicator> child,
                                 nccl->Split(/*color=*/1, /*key=*/7, {}));
  ASSERT_THAT(child, NotNull());
  EXPECT_EQ(child->rank(), 0);
  EXPECT_EQ(child->size(), 2);
  EXPECT_EQ(child->backend(), "nccl");
  auto* nccl_child = dynamic_cast<NcclCommunicator*>(child.get());
  ASSERT_THAT(nccl_child, NotNull());
  EXPECT_EQ(nccl_child->stream(), nccl->stream());
  const FakeNcclApi::CommInfo info = api_.comm_info(nccl_child->comm());
  EXPECT_EQ(info.parent, nccl->comm());
  EXPECT_EQ(info.split_color, 1);
  EXPECT_EQ(info.split_key, 7);

  BufferRef b = Alloc(4);
  EXPECT_THAT(child->AllReduce(b, b, {})->Wait(), IsOk());
  EXPECT_EQ(api_.collectives()[0].comm, nccl_child->comm());

  ncclComm_t child_comm = nccl_child->comm();
  child.reset();
  EXPECT_TRUE(api_.comm_info(child_comm).destroyed);
  EXPECT_FALSE(api_.streams()[0].destroyed) << "still the parent's";
  nccl.reset();
  EXPECT_TRUE(api_.streams()[0].destroyed);
}

TEST_F(NcclCommunicatorTest, SplitWithANegativeColorJoinsNoGroup) {
  std::unique_ptr<NcclCommunicator> nccl = Make(4, 1);
  FLATPARAM_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Communicator> child,
                                 nccl->Split(/*color=*/-5, /*key=*/0, {}));
  EXPECT_THAT(child, IsNull());
  EXPECT_EQ(api_.CallCount("ncclCommSplit"), 1);
  EXPECT_EQ(api_.comms().size(), 1u);
}

TEST_F(NcclCommunicatorTest, NonBlockingSplitPollsParentAndChild) {
  std::unique_ptr<NcclCommunicator> nccl = Make(2, 0, {}, /*blocking=*/false);
  api_.set_in_progress_polls(2);
  FLATPARAM_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Communicator> child,
                                 nccl->Split(0, 0, {}));
  ASSERT_THAT(child, NotNull());
  api_.set_in_progress_polls(0);
  EXPECT_FALSE(api_.comms()[1].blocking) << "inherited";
}

TEST_F(NcclCommunicatorTest, SplitErrorsNameTheCall) {
  std::unique_ptr<NcclCommunicator> nccl = Make(2, 0);
  api_.FailNext("ncclCommSplit", ncclInvalidArgument);
  EXPECT_THAT(nccl->Split(3, 1, {}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("rank 0: split #0 (color 3, key 1)"),
                             HasSubstr("ncclCommSplit"))));
}

TEST_F(NcclCommunicatorTest, HybridGroupsComeFromTwoSplits) {
  std::unique_ptr<NcclCommunicator> nccl = Make(4, 3);
  FLATPARAM_ASSERT_OK_AND_ASSIGN(HybridGroups groups,
                                 MakeHybridGroups(*nccl, /*shard=*/2));
  ASSERT_THAT(groups.shard, NotNull());
  ASSERT_THAT(groups.replicate, NotNull());
  const std::vector<FakeNcclApi::CommInfo> comms = api_.comms();
  ASSERT_EQ(comms.size(), 3u);
  EXPECT_EQ(comms[1].split_color, 1);  // Node 1.
  EXPECT_EQ(comms[1].split_key, 1);    // Local rank 1.
  EXPECT_EQ(comms[2].split_color, 1);  // Local rank 1.
  EXPECT_EQ(comms[2].split_key, 1);    // Node 1.
}

TEST_F(NcclCommunicatorTest, AllGatherBytesOfOneRank) {
  std::unique_ptr<NcclCommunicator> nccl = Make(1, 0);
  const int allocations = api_.live_allocations();
  FLATPARAM_ASSERT_OK_AND_ASSIGN(std::vector<std::string> all,
                                 nccl->AllGatherBytes("hello", {}));
  EXPECT_THAT(all, ElementsAre("hello"));
  const std::vector<FakeNcclApi::Collective> calls = api_.collectives();
  ASSERT_EQ(calls.size(), 2u);
  EXPECT_EQ(calls[0].datatype, ncclInt64);
  EXPECT_EQ(calls[0].count, 1u);
  EXPECT_EQ(calls[1].datatype, ncclUint8);
  EXPECT_EQ(calls[1].count, 5u);
  EXPECT_EQ(api_.live_events(), 0);
  // The scratch stays for the next call: no allocation, free or pageable
  // copy between collectives (with several ranks in one process each can
  // deadlock against NCCL kernels waiting for a peer).
  EXPECT_EQ(api_.live_allocations(), allocations + 1);
  const int mallocs = api_.CallCount("cudaMallocAsync");
  FLATPARAM_ASSERT_OK_AND_ASSIGN(all, nccl->AllGatherBytes("world", {}));
  EXPECT_THAT(all, ElementsAre("world"));
  EXPECT_EQ(api_.CallCount("cudaMallocAsync"), mallocs);
  EXPECT_EQ(api_.CallCount("cudaMalloc"), 0);
  EXPECT_EQ(api_.CallCount("cudaFree"), 0);
  EXPECT_EQ(api_.CallCount("cudaFreeHost"), 0);
  EXPECT_EQ(api_.pageable_copies(), 0);
  nccl.reset();
  EXPECT_EQ(api_.live_allocations(), allocations);
}

TEST_F(NcclCommunicatorTest, AllGatherBytesPlacesEachRanksBytes) {
  // The fake's peers contribute zeros: empty strings.
  std::unique_ptr<NcclCommunicator> nccl = Make(3, 1);
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      std::vector<std::string> all,
      nccl->AllGatherBytes(std::string("a\0c", 3), {}));
  EXPECT_THAT(all, ElementsAre("", std::string("a\0c", 3), ""));
  FLATPARAM_ASSERT_OK_AND_ASSIGN(all, nccl->AllGatherBytes("", {}));
  EXPECT_THAT(all, ElementsAre("", "", ""));
  EXPECT_EQ(api_.collectives().size(), 3u) << "no second round when empty";
}

TEST_F(NcclCommunicatorTest, BarrierIsAOneElementAllReduce) {
  std::unique_ptr<NcclCommunicator> nccl = Make(2, 0);
  EXPECT_THAT(nccl->Barrier({}), IsOk());
  EXPECT_THAT(nccl->Barrier({}), IsOk());
  const std::vector<FakeNcclApi::Collective> calls = api_.collectives();
  ASSERT_EQ(calls.size(), 2u);
  EXPECT_EQ(calls[0].name, "ncclAllReduce");
  EXPECT_EQ(calls[0].count, 1u);
  EXPECT_EQ(api_.CallCount("cudaMallocAsync"), 1) << "the scratch is reused";
  EXPECT_EQ(api_.CallCount("cudaMalloc"), 0);
  EXPECT_EQ(api_.pageable_copies(), 0);
  nccl.reset();
  EXPECT_EQ(api_.live_allocations(), 0);
}

TEST_F(NcclCommunicatorTest, BarrierTimesOut) {
  std::unique_ptr<NcclCommunicator> nccl = Make(2, 0);
  api_.set_event_pending_queries(-1);
  CollectiveOptions options;
  options.timeout = absl::Milliseconds(10);
  EXPECT_THAT(nccl->Barrier(options),
              StatusIs(absl::StatusCode::kDeadlineExceeded,
                       HasSubstr("rank 0: barrier #0")));
  EXPECT_TRUE(nccl->aborted());
}

}  // namespace
}  // namespace flatparam
