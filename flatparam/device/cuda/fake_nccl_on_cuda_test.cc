// The model of NCCL on the model of CUDA, through NcclCommunicator: the
// collectives' results at several ranks, and the behaviours of the real
// library that the model must reproduce for the tests that use it to mean
// anything (a desynchronized group hangs until the timeout, two ranks on
// one device are refused, finalizing needs every rank).
#include "flatparam/device/cuda/fake_nccl_on_cuda.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <functional>
#include <map>
#include <memory>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "comm/nccl/nccl_communicator.h"
#include "comm/nccl/thread_bootstrap_testutil.h"
#include "flatparam/base/dtype.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/base/status_matchers.h"
#include "flatparam/device/cuda/cuda_device_ops.h"
#include "flatparam/device/cuda/fake_cuda_runtime.h"

namespace flatparam {
namespace {

using ::testing::HasSubstr;
using ::testing::IsEmpty;

class FakeNcclOnCudaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    FakeCudaRuntime::Options options;
    options.device_count = 3;
    options.max_op_delay = absl::Microseconds(20);
    cuda_ = std::make_unique<FakeCudaRuntime>(options);
    nccl_ = std::make_unique<FakeNcclOnCuda>(*cuda_);
  }
  void TearDown() override {
    EXPECT_THAT(cuda_->misuse(), IsEmpty());
    cuda_.reset();  // first: its streams may still run the fake's work
    nccl_.reset();
  }

  // Runs body(rank, ops, comm) on `world` threads, rank r on device
  // devices[r] (default r).
  void RunRanks(
      int world,
      const std::function<void(int, CudaDeviceOps&, NcclCommunicator&)>& body,
      NcclOptions options = {}, std::vector<int> devices = {}) {
    std::vector<std::unique_ptr<Communicator>> group = MakeThreadGroup(world);
    std::vector<std::thread> threads;
    for (int r = 0; r < world; ++r) {
      threads.emplace_back([&, r] {
        const int device = devices.empty() ? r : devices[r];
        absl::StatusOr<std::unique_ptr<CudaDeviceOps>> ops =
            CudaDeviceOps::Create(device, nullptr, nullptr, cuda_.get());
        ASSERT_THAT(ops, IsOk());
        absl::StatusOr<std::unique_ptr<NcclCommunicator>> comm =
            NcclCommunicator::Create(*nccl_, *cuda_, *group[r], device,
                                     options);
        if (!comm.ok()) {
          // The ranks' threads fail together (two ranks on one device):
          // the map is shared.
          absl::MutexLock lock(&create_errors_mu_);
          create_errors_[r] = comm.status();
          return;
        }
        body(r, **ops, **comm);
      });
    }
    for (std::thread& t : threads) t.join();
  }

  // All-reduces one float32 element at three ranks, rank r contributing
  // x(r) with options(r); every rank must get `want`, and nothing be
  // misused.
  void ExpectAllReduceOfOne(const std::function<float(int)>& x,
                            const std::function<ReduceOptions(int)>& options,
                            float want);

  std::unique_ptr<FakeCudaRuntime> cuda_;
  std::unique_ptr<FakeNcclOnCuda> nccl_;
  absl::Mutex create_errors_mu_;
  // Written by the ranks' threads under create_errors_mu_; read after they
  // are joined.
  std::map<int, absl::Status> create_errors_;
};

// A device buffer of float32 `values`.
DeviceBuffer Upload(CudaDeviceOps& ops, const std::vector<float>& values) {
  absl::StatusOr<DeviceBuffer> b = ops.Allocate(
      ops.device(), static_cast<int64_t>(values.size() * sizeof(float)));
  EXPECT_THAT(b, IsOk());
  EXPECT_THAT(ops.Copy(b->As(DType::kFloat32),
                       ConstBufferRef{values.data(),
                                      static_cast<int64_t>(values.size()),
                                      DType::kFloat32, Device::Host()}),
              IsOk());
  return *std::move(b);
}

std::vector<float> Download(CudaDeviceOps& ops, BufferRef b) {
  std::vector<float> out(b.count);
  EXPECT_THAT(
      ops.Copy(BufferRef{out.data(), b.count, DType::kFloat32, Device::Host()},
               b),
      IsOk());
  return out;
}

void FakeNcclOnCudaTest::ExpectAllReduceOfOne(
    const std::function<float(int)>& x,
    const std::function<ReduceOptions(int)>& options, float want) {
  RunRanks(3, [&](int r, CudaDeviceOps& ops, NcclCommunicator& comm) {
    DeviceBuffer a = Upload(ops, {x(r)});
    ASSERT_THAT(
        comm.AllReduce(a.As(DType::kFloat32), a.As(DType::kFloat32), options(r))
            ->Wait(),
        IsOk());
    EXPECT_THAT(Download(ops, a.As(DType::kFloat32)),
                ::testing::ElementsAre(want));
  });
  EXPECT_THAT(create_errors_, IsEmpty());
  EXPECT_THAT(nccl_->misuse(), IsEmpty());
}

TEST_F(FakeNcclOnCudaTest, CollectivesAtThreeRanks) {
  RunRanks(3, [](int r, CudaDeviceOps& ops, NcclCommunicator& comm) {
    const float x = static_cast<float>(r + 1);
    // All-reduce: 1 + 2 + 3; average; max.
    DeviceBuffer a = Upload(ops, {x, -x});
    ASSERT_THAT(comm.AllReduce(a.As(DType::kFloat32), a.As(DType::kFloat32),
                               ReduceOptions{})
                    ->Wait(),
                IsOk());
    EXPECT_THAT(Download(ops, a.As(DType::kFloat32)),
                ::testing::ElementsAre(6, -6));
    ReduceOptions max;
    max.op = ReduceOp::kMax;
    DeviceBuffer m = Upload(ops, {x});
    ASSERT_THAT(
        comm.AllReduce(m.As(DType::kFloat32), m.As(DType::kFloat32), max)
            ->Wait(),
        IsOk());
    EXPECT_THAT(Download(ops, m.As(DType::kFloat32)),
                ::testing::ElementsAre(3));
    // All-gather: rank i's element lands at i.
    DeviceBuffer in = Upload(ops, {x});
    DeviceBuffer out = Upload(ops, {0, 0, 0});
    ASSERT_THAT(comm.AllGather(in.As(DType::kFloat32), out.As(DType::kFloat32),
                               CollectiveOptions{})
                    ->Wait(),
                IsOk());
    EXPECT_THAT(Download(ops, out.As(DType::kFloat32)),
                ::testing::ElementsAre(1, 2, 3));
    // Reduce-scatter with a post-divide factor: block i summed, / 2.
    DeviceBuffer rs = Upload(ops, {x, 10 * x, 100 * x});
    DeviceBuffer mine = Upload(ops, {0});
    ReduceOptions divide;
    divide.post_divide_factor = 2;
    ASSERT_THAT(comm.ReduceScatter(rs.As(DType::kFloat32),
                                   mine.As(DType::kFloat32), divide)
                    ->Wait(),
                IsOk());
    const float want[] = {3, 30, 300};
    EXPECT_THAT(Download(ops, mine.As(DType::kFloat32)),
                ::testing::ElementsAre(want[r]));
    // Broadcast from rank 2; the byte exchange and the barrier.
    DeviceBuffer b = Upload(ops, {x});
    BroadcastOptions from2;
    from2.root = 2;
    ASSERT_THAT(comm.Broadcast(b.As(DType::kFloat32), from2)->Wait(), IsOk());
    EXPECT_THAT(Download(ops, b.As(DType::kFloat32)),
                ::testing::ElementsAre(3));
    absl::StatusOr<std::vector<std::string>> all =
        comm.AllGatherBytes(std::string(r + 1, 'a' + r), {});
    ASSERT_THAT(all, IsOk());
    EXPECT_THAT(*all, ::testing::ElementsAre("a", "bb", "ccc"));
    EXPECT_THAT(comm.Barrier({}), IsOk());
  });
  EXPECT_THAT(create_errors_, IsEmpty());
  EXPECT_THAT(nccl_->misuse(), IsEmpty());
}

// Ranks that issue different collectives hang on GPUs; the model hangs too,
// and the communicators' timeout ends it with an abort on each rank.
TEST_F(FakeNcclOnCudaTest, ADesynchronizedGroupHangsUntilTheTimeout) {
  RunRanks(2, [this](int r, CudaDeviceOps& ops, NcclCommunicator& comm) {
    DeviceBuffer a = Upload(ops, {1, 2});
    DeviceBuffer g = Upload(ops, {0, 0, 0, 0});
    ReduceOptions options;
    options.timeout = absl::Milliseconds(200);
    const absl::Time start = absl::Now();
    absl::Status st = r == 0 ? comm.AllReduce(a.As(DType::kFloat32),
                                              a.As(DType::kFloat32), options)
                                   ->Wait()
                             : comm.AllGather(a.As(DType::kFloat32),
                                              g.As(DType::kFloat32), options)
                                   ->Wait();
    EXPECT_THAT(st, StatusIs(absl::StatusCode::kDeadlineExceeded,
                             HasSubstr("did not finish within 200ms")));
    EXPECT_GE(absl::Now() - start, absl::Milliseconds(200));
    EXPECT_TRUE(comm.aborted());
    // The aborted kernel leaves the stream in its own time: the buffers are
    // freed once it has (nccl_communicator.h).
    const absl::Time limit = absl::Now() + absl::Seconds(30);
    while (cuda_->StreamQuery(comm.stream()) != cudaSuccess &&
           absl::Now() < limit) {
      cuda_->GetLastError();
      absl::SleepFor(absl::Milliseconds(1));
    }
    EXPECT_EQ(cuda_->StreamQuery(comm.stream()), cudaSuccess);
  });
  EXPECT_THAT(nccl_->misuse(),
              ::testing::ElementsAre(HasSubstr("ncclAllGather")));
}

// NCCL refuses two ranks of one communicator on one GPU; every rank's
// Create fails (the barrier after initialization).
TEST_F(FakeNcclOnCudaTest, TwoRanksOnOneDeviceAreRefused) {
  NcclOptions options;
  options.setup_timeout = absl::Seconds(20);
  const absl::Time start = absl::Now();
  RunRanks(2,
           [](int, CudaDeviceOps&, NcclCommunicator&) {
             ADD_FAILURE() << "created";
           },
           options, {1, 1});
  EXPECT_LT(absl::Now() - start, absl::Seconds(10)) << "not by the timeout";
  ASSERT_EQ(create_errors_.size(), 2u);
  EXPECT_THAT(create_errors_[0].ToString() + create_errors_[1].ToString(),
              HasSubstr("ncclInvalidUsage"));
}

// Destruction finalizes: when every rank gets there, the communicators are
// destroyed, not aborted.
TEST_F(FakeNcclOnCudaTest, FinalizeCompletesWhenEveryRankFinalizes) {
  RunRanks(2, [](int, CudaDeviceOps&, NcclCommunicator& comm) {
    EXPECT_THAT(comm.Barrier({}), IsOk());
  });
  EXPECT_THAT(create_errors_, IsEmpty());
  EXPECT_EQ(nccl_->comms_destroyed(), 2);
  EXPECT_EQ(nccl_->comms_aborted(), 0);
}

// Finalizing needs every rank: a rank that finalizes while its peer lives
// on polls for the setup timeout and then aborts, and the peer, whose
// partner is gone, does the same; nothing hangs.
TEST_F(FakeNcclOnCudaTest, FinalizeWithoutThePeerAbortsAfterTheTimeout) {
  NcclOptions options;
  options.setup_timeout = absl::Milliseconds(300);
  RunRanks(
      2,
      [](int r, CudaDeviceOps&, NcclCommunicator& comm) {
        EXPECT_THAT(comm.Barrier({}), IsOk());
        if (r == 1) absl::SleepFor(absl::Milliseconds(800));
      },
      options);
  EXPECT_THAT(create_errors_, IsEmpty());
  EXPECT_EQ(nccl_->comms_aborted(), 2);
}

// NCCL averages floating-point types as a sum pre-multiplied by 1/n in the
// dtype; at three ranks its bits are not those of sum-then-divide.
TEST_F(FakeNcclOnCudaTest, AverageIsAPreMultipliedSumByOneOverN) {
  // Ranks hold 1, 1 and 3.
  const float third = static_cast<float>(1.0 / 3);
  const float want = (1.0f * third + 1.0f * third) + 3.0f * third;
  ASSERT_NE(want, (1.0f + 1.0f + 3.0f) / 3.0f)
      << "the case must tell the two apart";
  ReduceOptions avg;
  avg.op = ReduceOp::kAvg;
  ExpectAllReduceOfOne([](int r) { return r == 2 ? 3.0f : 1.0f; },
                       [avg](int) { return avg; }, want);
}

// Each rank's ncclRedOpCreatePreMulSum scalar multiplies that rank's input:
// ranks with different pre-divide factors (2, 3, 4) are summed each by its
// own.
TEST_F(FakeNcclOnCudaTest, EachRankPreMultipliesByItsOwnScalar) {
  ExpectAllReduceOfOne([](int) { return 1.0f; },
                       [](int r) {
                         ReduceOptions options;
                         options.pre_divide_factor = r + 2;
                         return options;
                       },
                       (0.5f + static_cast<float>(1.0 / 3)) + 0.25f);
}

// NcclCommunicator checks these rules itself, so the model's are planted
// through the NCCL calls directly, as other code using the model would
// make them.
class FakeNcclOnCudaRawTest : public FakeNcclOnCudaTest {
 protected:
  // The ranks of one non-blocking communicator, rank r on device r, made
  // from this thread; its stream and 64 bytes of device memory per rank.
  void MakeRanks(int nranks) {
    ncclUniqueId id;
    ASSERT_EQ(nccl_->GetUniqueId(&id), ncclSuccess);
    comms_.assign(nranks, nullptr);
    streams_.assign(nranks, nullptr);
    buffers_.assign(nranks, nullptr);
    for (int r = 0; r < nranks; ++r) {
      ASSERT_EQ(cuda_->SetDevice(r), cudaSuccess);
      ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
      config.blocking = 0;
      const ncclResult_t init =
          nccl_->CommInitRankConfig(&comms_[r], nranks, id, r, &config);
      ASSERT_TRUE(init == ncclSuccess || init == ncclInProgress) << init;
      ASSERT_EQ(cuda_->StreamCreateWithFlags(&streams_[r], 0), cudaSuccess);
      ASSERT_EQ(cuda_->Malloc(&buffers_[r], 64), cudaSuccess);
    }
    ASSERT_EQ(cuda_->SetDevice(0), cudaSuccess);
  }
  void Release() {
    for (size_t r = 0; r < comms_.size(); ++r) {
      ASSERT_EQ(cuda_->SetDevice(static_cast<int>(r)), cudaSuccess);
      EXPECT_EQ(cuda_->StreamSynchronize(streams_[r]), cudaSuccess);
      EXPECT_EQ(cuda_->StreamDestroy(streams_[r]), cudaSuccess);
      EXPECT_EQ(cuda_->Free(buffers_[r]), cudaSuccess);
      EXPECT_EQ(nccl_->CommAbort(comms_[r]), ncclSuccess);
    }
    ASSERT_EQ(cuda_->SetDevice(0), cudaSuccess);
  }
  float* At(int rank, int element) {
    return static_cast<float*>(buffers_[rank]) + element;
  }

  std::vector<ncclComm_t> comms_;
  std::vector<cudaStream_t> streams_;
  std::vector<void*> buffers_;
};

// Overlapping send and receive buffers are defined only in place, at the
// offsets NCCL documents; anything else is refused and recorded.
TEST_F(FakeNcclOnCudaRawTest, OnlyTheDocumentedInPlaceOverlapsAreAccepted) {
  MakeRanks(1);
  // All-gather of 2 elements at one rank: in place is sendbuff == recvbuff.
  EXPECT_EQ(nccl_->AllGather(At(0, 1), At(0, 0), 2, ncclFloat32, comms_[0],
                             streams_[0]),
            ncclInvalidArgument);
  EXPECT_EQ(nccl_->AllGather(At(0, 0), At(0, 0), 2, ncclFloat32, comms_[0],
                             streams_[0]),
            ncclSuccess);
  // All-reduce: only equal buffers.
  EXPECT_EQ(nccl_->AllReduce(At(0, 0), At(0, 2), 4, ncclFloat32, ncclSum,
                             comms_[0], streams_[0]),
            ncclInvalidArgument);
  // Reduce-scatter: recvbuff == sendbuff + rank * recvcount (rank 0: equal).
  EXPECT_EQ(nccl_->ReduceScatter(At(0, 0), At(0, 1), 2, ncclFloat32, ncclSum,
                                 comms_[0], streams_[0]),
            ncclInvalidArgument);
  EXPECT_EQ(nccl_->ReduceScatter(At(0, 0), At(0, 0), 2, ncclFloat32, ncclSum,
                                 comms_[0], streams_[0]),
            ncclSuccess);
  // Disjoint buffers are always fine.
  EXPECT_EQ(nccl_->AllReduce(At(0, 0), At(0, 8), 4, ncclFloat32, ncclSum,
                             comms_[0], streams_[0]),
            ncclSuccess);
  EXPECT_THAT(nccl_->misuse(),
              ::testing::ElementsAre(HasSubstr("ncclAllGather: rank 0"),
                                     HasSubstr("ncclAllReduce: rank 0"),
                                     HasSubstr("ncclReduceScatter: rank 0")));
  Release();
}

// NCCL: after ncclCommFinalize no new operation may be issued, and the
// communicator may be destroyed only once the finalize has completed.
TEST_F(FakeNcclOnCudaRawTest, FinalizeEndsTheCommunicatorsOperations) {
  MakeRanks(2);
  ASSERT_EQ(nccl_->CommFinalize(comms_[0]), ncclInProgress);  // rank 1 lives
  EXPECT_EQ(nccl_->CommDestroy(comms_[0]), ncclInvalidUsage);
  EXPECT_EQ(nccl_->AllReduce(At(0, 0), At(0, 0), 4, ncclFloat32, ncclSum,
                             comms_[0], streams_[0]),
            ncclInvalidUsage);
  EXPECT_THAT(nccl_->misuse(),
              ::testing::ElementsAre(
                  HasSubstr("while its ncclCommFinalize was still in progress"),
                  HasSubstr("issued a collective after ncclCommFinalize")));
  // Once every rank has finalized, destroying is what NCCL expects.
  ASSERT_EQ(cuda_->SetDevice(1), cudaSuccess);
  ASSERT_EQ(nccl_->CommFinalize(comms_[1]), ncclInProgress);
  ncclResult_t state = ncclInProgress;
  ASSERT_EQ(nccl_->CommGetAsyncError(comms_[0], &state), ncclSuccess);
  EXPECT_EQ(state, ncclSuccess);
  EXPECT_EQ(nccl_->CommDestroy(comms_[0]), ncclSuccess);
  EXPECT_EQ(nccl_->CommDestroy(comms_[1]), ncclSuccess);
  EXPECT_EQ(nccl_->misuse().size(), 2u);
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(cuda_->SetDevice(r), cudaSuccess);
    EXPECT_EQ(cuda_->StreamDestroy(streams_[r]), cudaSuccess);
    EXPECT_EQ(cuda_->Free(buffers_[r]), cudaSuccess);
  }
  ASSERT_EQ(cuda_->SetDevice(0), cudaSuccess);
}

}  // namespace
}  // namespace flatparam
