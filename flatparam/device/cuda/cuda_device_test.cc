// CudaDeviceOps on a real GPU, through the entry point every build has.
// Without CUDA in the build the test checks the Unimplemented error and
// skips; with CUDA but no driver or device it skips with "no usable GPU:
// ...". On a GPU it checks every kernel bit for bit against the host kernels
// (with PyTorch's CUDA reciprocal division), and a FlatParamHandle on the
// GPU (one rank, NCCL) against the same handle on the host.
//
// Built a second time with FLATPARAM_CUDA_FAKE (cuda_device_fake_test), the
// same cases run on FakeCudaRuntime in CI (the handle's with
// FakeNcclOnCuda). The cases that need a stream that does not finish (a
// collective whose peer never arrives) hold it with a kernel that spins on
// a flag in pinned memory until the test sets it (LaunchWaitFlag), on the
// GPU and on the model alike; they need CudaDeviceOps itself, so they run
// where CUDA was in the build (FLATPARAM_CUDA_BUILD) or on the model. Last
// come the cases only the model can show (a misuse caught, an injected
// failure).
#include "flatparam/device/cuda/cuda_device.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "comm/communicator.h"
#include "comm/nccl/nccl_backend.h"
#include "flatparam/base/dtype.h"
#include "flatparam/base/gpu_testutil.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/base/status_matchers.h"
#include "flatparam/device/device.h"
#include "flatparam/handle.h"
#include "flatparam/layout.h"
#include "sim/sim.h"
#include "testing/device_ops_conformance.h"
#include "testing/handle_testutil.h"

#if defined(FLATPARAM_CUDA_FAKE) || defined(FLATPARAM_CUDA_BUILD)
#define FLATPARAM_CUDA_OPS_TESTS 1
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "flatparam/device/cuda/cuda_device_ops.h"
#include "flatparam/device/cuda/cuda_runtime.h"
#endif
#ifdef FLATPARAM_CUDA_FAKE
#include "comm/nccl/nccl_communicator.h"
#include "flatparam/device/cuda/fake_cuda_runtime.h"
#include "flatparam/device/cuda/fake_nccl_on_cuda.h"
#endif

namespace flatparam {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr DType kFloatDTypes[] = {DType::kFloat32, DType::kFloat64,
                                  DType::kFloat16, DType::kBFloat16};

BufferRef HostRef(std::vector<unsigned char>& b, DType dtype) {
  return {b.data(), static_cast<int64_t>(b.size() / DTypeSize(dtype)), dtype,
          Device::Host()};
}

class CudaDeviceOpsTest : public ::testing::Test {
 protected:
  void SetUp() override {
#ifdef FLATPARAM_CUDA_FAKE
    FakeCudaRuntime::Options options;
    // Streams finish in their own time: unordered work shows.
    options.max_op_delay = absl::Microseconds(50);
    fake_ = std::make_unique<FakeCudaRuntime>(options);
    absl::StatusOr<std::unique_ptr<CudaDeviceOps>> cuda =
        CudaDeviceOps::Create(0, nullptr, nullptr, fake_.get());
    ASSERT_THAT(cuda, IsOk());
    rt_ = fake_.get();
    cuda_ = cuda->get();
    ops_ = *std::move(cuda);
    return;
#endif
    absl::StatusOr<std::unique_ptr<DeviceOps>> ops = CreateCudaDeviceOps(0);
    if (!CudaDeviceOpsAvailable()) {
      EXPECT_THAT(ops, StatusIs(absl::StatusCode::kUnimplemented,
                                HasSubstr("no CUDA support")));
      FLATPARAM_SKIP_WITHOUT_GPU(ops.status());
    }
    if (!ops.ok()) {
      EXPECT_THAT(ops, StatusIs(absl::StatusCode::kFailedPrecondition,
                                HasSubstr("no usable GPU")));
      FLATPARAM_SKIP_WITHOUT_GPU(ops.status());
    }
    ops_ = *std::move(ops);
    EXPECT_EQ(ops_->device(), Device::Cuda(0));
    EXPECT_EQ(ops_->name(), "cuda");
#ifdef FLATPARAM_CUDA_BUILD
    rt_ = &RealCudaRuntime();
    cuda_ = static_cast<CudaDeviceOps*>(ops_.get());
#endif
  }

  // A device buffer holding `host` (synchronously).
  DeviceBuffer Upload(const std::vector<unsigned char>& host) {
    absl::StatusOr<DeviceBuffer> buf =
        ops_->Allocate(ops_->device(), static_cast<int64_t>(host.size()));
    EXPECT_THAT(buf, IsOk());
    EXPECT_THAT(ops_->Copy(buf->As(DType::kBFloat16).Slice(0, host.size() / 2),
                           ConstBufferRef{host.data(),
                                          static_cast<int64_t>(host.size() / 2),
                                          DType::kBFloat16, Device::Host()}),
                IsOk());
    return *std::move(buf);
  }
  std::vector<unsigned char> Download(ConstBufferRef device) {
    std::vector<unsigned char> host(device.bytes());
    EXPECT_THAT(ops_->Copy(BufferRef{host.data(), device.count, device.dtype,
                                     Device::Host()},
                           device),
                IsOk());
    EXPECT_THAT(ops_->Synchronize(), IsOk());
    return host;
  }

#ifdef FLATPARAM_CUDA_OPS_TESTS
  void TearDown() override {
    if (rt_ != nullptr) Release();  // a failed test may leave a stream held
    ops_.reset();
    if (flags_ != nullptr) {
      EXPECT_EQ(rt_->FreeHost(const_cast<uint32_t*>(flags_)), cudaSuccess);
    }
#ifdef FLATPARAM_CUDA_FAKE
    if (fake_ != nullptr) {
      EXPECT_THAT(fake_->misuse(), ::testing::IsEmpty());
    }
#endif
  }

  // Holds `stream` at its current end until Release(): a kernel that spins
  // on a flag of its own in pinned memory, on the GPU as on the model.
  void Hold(cudaStream_t stream) {
    constexpr int kFlags = 64;
    if (flags_ == nullptr) {
      void* p = nullptr;
      ASSERT_EQ(rt_->MallocHost(&p, kFlags * sizeof(uint32_t)), cudaSuccess);
      flags_ = static_cast<volatile uint32_t*>(p);
      for (int i = 0; i < kFlags; ++i) flags_[i] = 0;
    }
    ASSERT_LT(holds_, kFlags);
    ASSERT_EQ(rt_->LaunchWaitFlag(flags_ + holds_, stream), cudaSuccess);
    ++holds_;
  }
  // Lets every held stream go on. A flag once set stays set: a spinning
  // kernel that has not yet seen it still will.
  void Release() {
    for (int i = 0; i < holds_; ++i) {
      __atomic_store_n(const_cast<uint32_t*>(flags_ + i), 1u, __ATOMIC_RELEASE);
    }
  }

  CudaRuntime* rt_ = nullptr;           // the fake's or the real runtime
  CudaDeviceOps* cuda_ = nullptr;       // ops_, as CudaDeviceOps
  volatile uint32_t* flags_ = nullptr;  // pinned; one per Hold
  int holds_ = 0;
#endif
#ifdef FLATPARAM_CUDA_FAKE
  std::unique_ptr<FakeCudaRuntime> fake_;  // outlives ops_
#endif
  std::unique_ptr<DeviceOps> ops_;
};

// Streams and events on the GPU: a producer on its own stream, a consumer
// on stream 0 that waits for its event, RecordStream before a free.
TEST_F(CudaDeviceOpsTest, StreamsAndEventsOrderWork) {
  FLATPARAM_ASSERT_OK_AND_ASSIGN(Stream side, ops_->NewStream());
  const int64_t n = int64_t{1} << 22;  // long enough to overlap
  FLATPARAM_ASSERT_OK_AND_ASSIGN(DeviceBuffer x,
                                 ops_->Allocate(ops_->device(), n * 4));
  FLATPARAM_ASSERT_OK_AND_ASSIGN(DeviceBuffer y,
                                 ops_->Allocate(ops_->device(), n * 4));
  BufferRef xs = x.As(DType::kFloat32), ys = y.As(DType::kFloat32);
  ASSERT_THAT(ops_->Fill(ys, 0), IsOk());
  // Memory from stream 0's pool is the side stream's to use once the side
  // stream is ordered after the allocation.
  FLATPARAM_ASSERT_OK_AND_ASSIGN(Event allocated, ops_->RecordEvent(Stream{0}));
  ASSERT_THAT(ops_->WaitEvent(side, allocated), IsOk());
  ASSERT_THAT(ops_->SetStream(side), IsOk());
  ASSERT_THAT(ops_->Fill(xs, 1), IsOk());
  for (int i = 0; i < 8; ++i) {
    ASSERT_THAT(ops_->Scale(xs, ScaleOp::kMultiply, 2), IsOk());
  }
  FLATPARAM_ASSERT_OK_AND_ASSIGN(Event produced, ops_->RecordEvent(side));
  ASSERT_THAT(ops_->SetStream(Stream{0}), IsOk());
  ASSERT_THAT(ops_->WaitEvent(Stream{0}, produced), IsOk());
  ASSERT_THAT(ops_->Add(ys, xs), IsOk());
  ASSERT_THAT(ops_->RecordStream(xs, Stream{0}), IsOk());
  std::vector<float> host(n);
  ASSERT_THAT(
      ops_->Copy(BufferRef{host.data(), n, DType::kFloat32, Device::Host()},
                 ys),
      IsOk());
  for (int64_t i = 0; i < n; i += 4099) ASSERT_EQ(host[i], 256.0f) << i;
  x.Reset();
  ASSERT_THAT(ops_->Synchronize(), IsOk());
}

// LibTorch's default stream is CUDA's legacy default stream, which
// LibTorch names by the null handle and TorchCudaDeviceOps passes as
// cudaStreamLegacy (flatparam/torch/torch_cuda.h): ops made on it use it
// as their stream 0, so another library's work on the null handle is in
// order with theirs. (A null stream would make the ops create a stream of
// their own, unordered with it.)
TEST_F(CudaDeviceOpsTest, TheLegacyDefaultStreamCanBeStreamZero) {
  if (rt_ == nullptr) GTEST_SKIP() << "no CUDA runtime to make ops with";
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      std::unique_ptr<CudaDeviceOps> legacy,
      CudaDeviceOps::Create(0, cudaStreamLegacy, nullptr, rt_));
  EXPECT_EQ(legacy->cuda_stream(Stream{0}), cudaStreamLegacy);
  const int64_t n = int64_t{1} << 20;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(DeviceBuffer buf,
                                 legacy->Allocate(legacy->device(), n * 4));
  ASSERT_THAT(legacy->Fill(buf.As(DType::kFloat32), 0.5), IsOk());
  std::vector<float> host(n, 0.0f);
  ASSERT_EQ(rt_->MemcpyAsync(host.data(), buf.data(), n * 4, cudaMemcpyDefault,
                             nullptr),
            cudaSuccess);
  ASSERT_EQ(rt_->StreamSynchronize(nullptr), cudaSuccess);
  for (int64_t i = 0; i < n; i += 4093) ASSERT_EQ(host[i], 0.5f) << i;
  buf.Reset();
  ASSERT_THAT(legacy->Synchronize(), IsOk());
}

// After a warm-up round, freeing and reallocating the same sizes never
// reaches the driver: the pool keeps the memory.
TEST_F(CudaDeviceOpsTest, WarmAllocationsStayInThePool) {
  ASSERT_GE(CudaDeviceMallocs(*ops_), 0);
  int64_t warm = -1;
  for (int round = 0; round < 3; ++round) {
    std::vector<DeviceBuffer> buffers;
    for (int64_t bytes :
         {int64_t{1} << 20, int64_t{3} << 20, int64_t{64} << 20}) {
      FLATPARAM_ASSERT_OK_AND_ASSIGN(DeviceBuffer b,
                                     ops_->Allocate(ops_->device(), bytes));
      ASSERT_THAT(ops_->Fill(b.As(DType::kFloat32), 0), IsOk());
      buffers.push_back(std::move(b));
    }
    buffers.clear();
    ASSERT_THAT(ops_->Synchronize(), IsOk());
    if (round == 0) warm = CudaDeviceMallocs(*ops_);
  }
  EXPECT_EQ(CudaDeviceMallocs(*ops_), warm);
}

TEST_F(CudaDeviceOpsTest, CopiesBetweenHostPinnedHostAndDevice) {
  std::vector<unsigned char> src =
      HostBytes(DType::kFloat32, DeviceTestValues());
  const int64_t n = static_cast<int64_t>(src.size() / 4);
  FLATPARAM_ASSERT_OK_AND_ASSIGN(DeviceBuffer pinned,
                                 ops_->Allocate(Device::Host(), n * 4, true));
  EXPECT_TRUE(pinned.pinned());
  FLATPARAM_ASSERT_OK_AND_ASSIGN(DeviceBuffer a,
                                 ops_->Allocate(ops_->device(), n * 4));
  FLATPARAM_ASSERT_OK_AND_ASSIGN(DeviceBuffer b,
                                 ops_->Allocate(ops_->device(), n * 4));
  FLATPARAM_ASSERT_OK(
      ops_->Copy(pinned.As(DType::kFloat32), HostRef(src, DType::kFloat32)));
  FLATPARAM_ASSERT_OK(
      ops_->Copy(a.As(DType::kFloat32), pinned.As(DType::kFloat32)));
  FLATPARAM_ASSERT_OK(ops_->Copy(b.As(DType::kFloat32), a.As(DType::kFloat32)));
  EXPECT_EQ(Download(b.As(DType::kFloat32)), src);
  EXPECT_THAT(ops_->Allocate(Device::Cuda(1234), 4),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST_F(CudaDeviceOpsTest, FillMatchesTheHost) {
  for (DType dtype : kFloatDTypes) {
    for (double value : {0.0, -0.0, 1.0 / 3, 65520.0, -7.5}) {
      FLATPARAM_ASSERT_OK_AND_ASSIGN(
          DeviceBuffer d,
          ops_->Allocate(ops_->device(), 1001 * DTypeSize(dtype)));
      FLATPARAM_ASSERT_OK(ops_->Fill(d.As(dtype), value));
      std::vector<unsigned char> want(1001 * DTypeSize(dtype));
      HostFill(want.data(), dtype, 1001, value);
      EXPECT_EQ(Download(d.As(dtype)), want)
          << DTypeName(dtype) << " " << value;
    }
  }
}

TEST_F(CudaDeviceOpsTest, CastMatchesTheHostForEveryPair) {
  const std::vector<double> values = DeviceTestValues();
  for (DType from : kFloatDTypes) {
    std::vector<unsigned char> src = HostBytes(from, values);
    DeviceBuffer d_src = Upload(src);
    for (DType to : kFloatDTypes) {
      FLATPARAM_ASSERT_OK_AND_ASSIGN(
          DeviceBuffer d_dst,
          ops_->Allocate(ops_->device(), values.size() * DTypeSize(to)));
      FLATPARAM_ASSERT_OK(ops_->Cast(d_dst.As(to), d_src.As(from)));
      std::vector<unsigned char> want(values.size() * DTypeSize(to));
      HostCast(want.data(), to, src.data(), from, values.size());
      ExpectSameValues(Download(d_dst.As(to)), want, to,
                       absl::StrCat(DTypeName(from), " -> ", DTypeName(to)));
    }
  }
}

TEST_F(CudaDeviceOpsTest, ScaleIsPyTorchCudaArithmetic) {
  const std::vector<double> values = DeviceTestValues();
  for (DType dtype : kFloatDTypes) {
    for (double factor : {2.0, 4.0, 1.5, 3.0, 0.7}) {
      for (ScaleOp op : {ScaleOp::kDivide, ScaleOp::kMultiply}) {
        std::vector<unsigned char> host = HostBytes(dtype, values);
        DeviceBuffer d = Upload(host);
        FLATPARAM_ASSERT_OK(ops_->Scale(d.As(dtype), op, factor));
        // PyTorch's CUDA division multiplies by the reciprocal computed in
        // the compute type.
        double scalar = factor;
        if (op == ScaleOp::kDivide) {
          scalar = dtype == DType::kFloat64
                       ? 1.0 / factor
                       : static_cast<double>(1.0f / static_cast<float>(factor));
        }
        HostScale(host.data(), dtype, values.size(), ScaleOp::kMultiply,
                  scalar);
        ExpectSameValues(
            Download(d.As(dtype)), host, dtype,
            absl::StrCat(DTypeName(dtype), " ", ScaleOpName(op), " ", factor));
      }
    }
  }
}

TEST_F(CudaDeviceOpsTest, AddMatchesTheHost) {
  const std::vector<double> values = DeviceTestValues();
  std::vector<double> other;
  for (size_t i = 0; i < values.size(); ++i) other.push_back(std::cos(i) * 3);
  for (DType dtype : kFloatDTypes) {
    std::vector<unsigned char> acc = HostBytes(dtype, values);
    std::vector<unsigned char> x = HostBytes(dtype, other);
    DeviceBuffer d_acc = Upload(acc);
    DeviceBuffer d_x = Upload(x);
    FLATPARAM_ASSERT_OK(ops_->Add(d_acc.As(dtype), d_x.As(dtype)));
    HostAdd(acc.data(), x.data(), dtype, values.size());
    ExpectSameValues(Download(d_acc.As(dtype)), acc, dtype,
                     std::string(DTypeName(dtype)));
  }
}

TEST_F(CudaDeviceOpsTest, LargeBuffersUseEveryElement) {
  // More elements than one pass of the grid covers.
  const int64_t n = (int64_t{1} << 23) + 3;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(DeviceBuffer d,
                                 ops_->Allocate(ops_->device(), n * 2));
  FLATPARAM_ASSERT_OK(ops_->Fill(d.As(DType::kBFloat16), 3.0));
  FLATPARAM_ASSERT_OK(
      ops_->Scale(d.As(DType::kBFloat16), ScaleOp::kMultiply, 2.0));
  FLATPARAM_ASSERT_OK(
      ops_->Add(d.As(DType::kBFloat16), d.As(DType::kBFloat16)));
  const std::vector<unsigned char> got = Download(d.As(DType::kBFloat16));
  EXPECT_EQ(LoadAsDouble(got.data(), DType::kBFloat16, 0), 12.0);
  EXPECT_EQ(LoadAsDouble(got.data(), DType::kBFloat16, n - 1), 12.0);
}

// A FlatParamHandle on the GPU (one rank, NCCL) computes what the same
// handle computes on the host: with one rank there is no division, so every
// step is a cast, an add or a copy, which agree bit for bit.
TEST_F(CudaDeviceOpsTest, HandleOnTheGpuMatchesTheHost) {
  using testing_handle::InitialParams;
  using testing_handle::MakeLayout;
  using testing_handle::RankContext;
  using testing_handle::ReadValues;
  using testing_handle::RunIteration;
  using testing_handle::RunWithHandles;
  using testing_handle::Scenario;
#ifndef FLATPARAM_CUDA_FAKE
  if (!NcclBackendAvailable()) GTEST_SKIP() << "no NCCL backend";
#endif
  for (ShardingStrategy strategy :
       {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp,
        ShardingStrategy::kNoShard}) {
    for (bool offload : {false, true}) {
      Scenario s;
      s.specs = {{"a.w", {3, 5}}, {"a.b", {3}}, {"c", {}}, {"d.w", {7}}};
      s.strategy = strategy;
      s.shard_size = 1;
      s.align = true;
      s.rounding_values = true;
      s.options.param_dtype = DType::kBFloat16;
      s.options.reduce_dtype = DType::kFloat32;
      s.options.cpu_offload = offload;
      // The host run.
      std::vector<double> want;
      ASSERT_THAT(RunWithHandles(s,
                                 [&](RankContext& ctx) -> absl::Status {
                                   for (int i = 0; i < 3; ++i) {
                                     FLATPARAM_RETURN_IF_ERROR(
                                         RunIteration(s, ctx, i, i != 1));
                                   }
                                   want =
                                       ReadValues(*ctx.handle.sharded_grad());
                                   return absl::OkStatus();
                                 }),
                  IsOk());
      // The GPU run, with a one-rank NCCL communicator bootstrapped by the
      // simulator.
      FLATPARAM_ASSERT_OK_AND_ASSIGN(FlatParamLayout layout, MakeLayout(s));
      const std::vector<HostTensor> params = InitialParams(s, layout);
      std::vector<ConstBufferRef> refs;
      for (const HostTensor& t : params) refs.push_back(t.cref());
      SimOptions sim_options;
      FLATPARAM_ASSERT_OK_AND_ASSIGN(std::unique_ptr<SimWorld> world,
                                     SimWorld::Create(sim_options));
      std::vector<double> got;
      ASSERT_THAT(world->Run([&](SimCommunicator& comm) -> absl::Status {
#ifdef FLATPARAM_CUDA_FAKE
        FakeNcclOnCuda fake_nccl(*fake_);
        FLATPARAM_ASSIGN_OR_RETURN(
            std::unique_ptr<Communicator> nccl,
            NcclCommunicator::Create(fake_nccl, *fake_, comm, 0));
#else
        FLATPARAM_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> nccl,
                                   CreateNcclCommunicator(comm, 0));
#endif
        FLATPARAM_ASSIGN_OR_RETURN(
            std::unique_ptr<FlatParamHandle> h,
            FlatParamHandle::Create(layout, refs, nccl.get(), nullptr,
                                    ops_.get(), s.options));
        RankContext ctx{comm, 0, *h, layout, *ops_};
        for (int i = 0; i < 3; ++i) {
          FLATPARAM_RETURN_IF_ERROR(RunIteration(s, ctx, i, i != 1));
        }
        const BufferRef g = *h->sharded_grad();
        EXPECT_EQ(g.device, offload ? Device::Host() : ops_->device());
        std::vector<unsigned char> host(g.bytes());
        FLATPARAM_RETURN_IF_ERROR(ops_->Copy(
            BufferRef{host.data(), g.count, g.dtype, Device::Host()}, g));
        got = ReadValues(
            ConstBufferRef{host.data(), g.count, g.dtype, Device::Host()});
        // The parameters on the device match too.
        FLATPARAM_RETURN_IF_ERROR(h->PreForward());
        FLATPARAM_ASSIGN_OR_RETURN(OrigParamView v, h->Param(0));
        EXPECT_EQ(v.data.device, ops_->device());
        EXPECT_EQ(v.data.dtype, DType::kBFloat16);
        return h->PostForward();
      }),
                  IsOk());
      EXPECT_EQ(got, want) << ShardingStrategyName(strategy) << " offload "
                           << offload;
    }
  }
}

#ifdef FLATPARAM_CUDA_OPS_TESTS
// Every host wait ends within the limit when the stream never gets there
// (a collective whose peer died), in the handler's error; without a limit
// the same calls would block forever in cudaStreamSynchronize.
TEST_F(CudaDeviceOpsTest, HostWaitsEndWithinTheLimit) {
  std::vector<std::string> expired;
  cuda_->SetHostWaitLimit(absl::Milliseconds(100), [&](absl::string_view what) {
    expired.emplace_back(what);
    return absl::AbortedError(
        absl::StrCat("rank 0: aborted the communicator: ", what));
  });
  FLATPARAM_ASSERT_OK_AND_ASSIGN(DeviceBuffer d,
                                 ops_->Allocate(ops_->device(), 64));
  Hold(cuda_->cuda_stream(Stream{0}));
  ASSERT_THAT(ops_->Fill(d.As(DType::kFloat32), 1), IsOk());
  FLATPARAM_ASSERT_OK_AND_ASSIGN(Event ev, ops_->RecordEvent(Stream{0}));
  const absl::Time start = absl::Now();
  EXPECT_THAT(ops_->Synchronize(),
              StatusIs(absl::StatusCode::kAborted,
                       HasSubstr("Synchronize on stream 0")));
  EXPECT_THAT(ops_->SynchronizeEvent(ev),
              StatusIs(absl::StatusCode::kAborted,
                       HasSubstr("SynchronizeEvent on stream 0")));
  std::vector<float> host(16);
  EXPECT_THAT(
      ops_->Copy(BufferRef{host.data(), 16, DType::kFloat32, Device::Host()},
                 d.As(DType::kFloat32)),
      StatusIs(absl::StatusCode::kAborted, HasSubstr("cudaMemcpyAsync")));
  EXPECT_LT(absl::Now() - start, absl::Seconds(30));
  EXPECT_EQ(expired.size(), 3u);
  Release();
  cuda_->SetHostWaitLimit(absl::InfiniteDuration(), nullptr);
  EXPECT_THAT(ops_->Synchronize(), IsOk());
}

// The entry point for code without CUDA headers sets the same limit, and
// refuses DeviceOps that are not CUDA's.
TEST_F(CudaDeviceOpsTest, SetCudaHostWaitLimitFromAnyCode) {
  HostDeviceOps host;
  EXPECT_THAT(
      SetCudaHostWaitLimit(host, absl::Seconds(1), nullptr),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not CUDA's")));
  ASSERT_THAT(SetCudaHostWaitLimit(*ops_, absl::Milliseconds(30), nullptr),
              IsOk());
  Hold(cuda_->cuda_stream(Stream{0}));
  EXPECT_THAT(ops_->Synchronize(),
              StatusIs(absl::StatusCode::kDeadlineExceeded));
  Release();
}

// CPU offload allocates and frees pinned buffers every step: they are
// cached (no cudaMallocHost once warm) and freeing one never waits for the
// streams (cudaFreeHost would synchronize the device); a cached block is
// reused only after the work issued before its free has passed.
TEST_F(CudaDeviceOpsTest, PinnedMemoryIsCachedAndItsFreeDoesNotWait) {
  int expired = 0;
  cuda_->SetHostWaitLimit(absl::Milliseconds(50), [&](absl::string_view) {
    ++expired;
    return absl::DeadlineExceededError("expired");
  });
  FLATPARAM_ASSERT_OK_AND_ASSIGN(DeviceBuffer d,
                                 ops_->Allocate(ops_->device(), 4096));
  ASSERT_THAT(ops_->Fill(d.As(DType::kFloat32), 2), IsOk());
  for (int step = 0; step < 50; ++step) {
    FLATPARAM_ASSERT_OK_AND_ASSIGN(
        DeviceBuffer a, ops_->Allocate(Device::Host(), 4096, /*pinned=*/true));
    FLATPARAM_ASSERT_OK_AND_ASSIGN(
        DeviceBuffer b, ops_->Allocate(Device::Host(), 1024, /*pinned=*/true));
    ASSERT_THAT(ops_->Copy(a.As(DType::kFloat32), d.As(DType::kFloat32)),
                IsOk());
    ASSERT_EQ(LoadAsDouble(a.data(), DType::kFloat32, 1023), 2.0);
  }
  EXPECT_EQ(cuda_->stats().pinned_mallocs, 2);
  EXPECT_EQ(cuda_->stats().pinned_cached_bytes, 5120);
  // A stream that is stuck: the free returns at once, and the block is not
  // reused while the stream's earlier work may still use it.
  Hold(cuda_->cuda_stream(Stream{0}));
  ASSERT_THAT(ops_->Fill(d.As(DType::kFloat32), 3), IsOk());
  {
    FLATPARAM_ASSERT_OK_AND_ASSIGN(
        DeviceBuffer a, ops_->Allocate(Device::Host(), 4096, /*pinned=*/true));
  }
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      DeviceBuffer again,
      ops_->Allocate(Device::Host(), 4096, /*pinned=*/true));
  EXPECT_EQ(cuda_->stats().pinned_mallocs, 3);
  EXPECT_EQ(expired, 0);
  Release();
  again.Reset();
  ASSERT_THAT(ops_->Synchronize(), IsOk());
}

// Without a handler the limit still holds, as DeadlineExceeded naming the
// device and the wait; destroying the ops with a stuck stream does not hang.
TEST_F(CudaDeviceOpsTest, HostWaitLimitWithoutHandler) {
  cuda_->SetHostWaitLimit(absl::Milliseconds(50), nullptr);
  Hold(cuda_->cuda_stream(Stream{0}));
  EXPECT_THAT(ops_->Synchronize(),
              StatusIs(absl::StatusCode::kDeadlineExceeded,
                       HasSubstr("cuda:0: Synchronize on stream 0 did not "
                                 "complete within 50ms")));
  ops_.reset();  // bounded too
  Release();
}

// CUDA events come from a pool and go back once passed: a thousand steps of
// record / wait / synchronize keep the same handful alive.
TEST_F(CudaDeviceOpsTest, EventsStayBoundedOverAThousandSteps) {
  FLATPARAM_ASSERT_OK_AND_ASSIGN(Stream side, ops_->NewStream());
  FLATPARAM_ASSERT_OK_AND_ASSIGN(DeviceBuffer d,
                                 ops_->Allocate(ops_->device(), 1024));
  // The side stream uses memory of stream 0's pool: ordered after it.
  FLATPARAM_ASSERT_OK_AND_ASSIGN(Event allocated, ops_->RecordEvent(Stream{0}));
  ASSERT_THAT(ops_->WaitEvent(side, allocated), IsOk());
  [[maybe_unused]] int64_t after_warmup = 0;
  for (int step = 0; step < 1000; ++step) {
    ASSERT_THAT(ops_->SetStream(side), IsOk());
    ASSERT_THAT(ops_->Fill(d.As(DType::kFloat32), step), IsOk());
    FLATPARAM_ASSERT_OK_AND_ASSIGN(Event produced, ops_->RecordEvent(side));
    ASSERT_THAT(ops_->SetStream(Stream{0}), IsOk());
    ASSERT_THAT(ops_->WaitEvent(Stream{0}, produced), IsOk());
    ASSERT_THAT(ops_->Scale(d.As(DType::kFloat32), ScaleOp::kMultiply, 2),
                IsOk());
    FLATPARAM_ASSERT_OK_AND_ASSIGN(Event done, ops_->RecordEvent(Stream{0}));
    ASSERT_THAT(ops_->WaitEvent(side, done), IsOk());
    if (step % 10 == 9) {
      ASSERT_THAT(ops_->SynchronizeEvent(done), IsOk());
    }
#ifdef FLATPARAM_CUDA_FAKE
    if (step == 20) after_warmup = fake_->event_creations();
#endif
  }
  ASSERT_THAT(ops_->Synchronize(), IsOk());
  // Between synchronizations at most ~20 events are in flight.
  EXPECT_LE(cuda_->cuda_events_held(), 32);
#ifdef FLATPARAM_CUDA_FAKE
  EXPECT_LE(fake_->event_creations(), 32);
  EXPECT_LE(fake_->event_creations() - after_warmup, 8);
  EXPECT_EQ(fake_->live_events(), cuda_->cuda_events_held());
#endif
}

// A buffer used on another stream is freed only after that stream's work:
// with RecordStream the free waits for the other stream, which is held.
TEST_F(CudaDeviceOpsTest, RecordStreamMakesTheFreeWait) {
  FLATPARAM_ASSERT_OK_AND_ASSIGN(Stream side, ops_->NewStream());
  FLATPARAM_ASSERT_OK_AND_ASSIGN(DeviceBuffer x,
                                 ops_->Allocate(ops_->device(), 4096));
  FLATPARAM_ASSERT_OK_AND_ASSIGN(DeviceBuffer y,
                                 ops_->Allocate(ops_->device(), 4096));
  ASSERT_THAT(ops_->Fill(x.As(DType::kFloat32), 1), IsOk());
  ASSERT_THAT(ops_->Fill(y.As(DType::kFloat32), 2), IsOk());
  FLATPARAM_ASSERT_OK_AND_ASSIGN(Event filled, ops_->RecordEvent(Stream{0}));
  ASSERT_THAT(ops_->WaitEvent(side, filled), IsOk());
  Hold(cuda_->cuda_stream(side));
  ASSERT_THAT(ops_->SetStream(side), IsOk());
  ASSERT_THAT(ops_->Add(y.As(DType::kFloat32), x.As(DType::kFloat32)), IsOk());
  FLATPARAM_ASSERT_OK_AND_ASSIGN(Event added, ops_->RecordEvent(side));
  ASSERT_THAT(ops_->SetStream(Stream{0}), IsOk());
  ASSERT_THAT(ops_->RecordStream(x.As(DType::kFloat32), side), IsOk());
  x.Reset();
  // Stream 0's free waits for the held side stream, and so does what
  // stream 0 does next.
  cudaEvent_t e = nullptr;
  ASSERT_EQ(rt_->EventCreateWithFlags(&e, cudaEventDisableTiming), cudaSuccess);
  ASSERT_EQ(rt_->EventRecord(e, cuda_->cuda_stream(Stream{0})), cudaSuccess);
  absl::SleepFor(absl::Milliseconds(20));
  EXPECT_EQ(rt_->EventQuery(e), cudaErrorNotReady);
  rt_->GetLastError();
  Release();
  ASSERT_THAT(ops_->WaitEvent(Stream{0}, added), IsOk());
  EXPECT_EQ(Download(y.As(DType::kFloat32)),
            HostBytes(DType::kFloat32, std::vector<double>(1024, 3.0)));
  ASSERT_EQ(rt_->EventDestroy(e), cudaSuccess);
}
#endif  // FLATPARAM_CUDA_OPS_TESTS

#ifdef FLATPARAM_CUDA_FAKE
// A query that found work not ready leaves cudaErrorNotReady as the
// thread's last error, and a failed cudaMallocAsync leaves its error there
// (the CUDA runtime's per-thread state); a kernel launch reports
// cudaGetLastError(), so the next Fill/Cast/Scale/Add used to fail with an
// error that was not its own.
TEST_F(CudaDeviceOpsTest, AStaleLastErrorDoesNotFailTheNextKernel) {
  FLATPARAM_ASSERT_OK_AND_ASSIGN(DeviceBuffer d,
                                 ops_->Allocate(ops_->device(), 64));
  // Another agent on this thread (NCCL's completion check) polls an event
  // of a busy stream.
  cudaStream_t busy = cuda_->cuda_stream(Stream{0});
  cudaEvent_t e = nullptr;
  ASSERT_EQ(fake_->EventCreateWithFlags(&e, cudaEventDisableTiming),
            cudaSuccess);
  fake_->HoldStream(busy);
  ASSERT_EQ(fake_->EventRecord(e, busy), cudaSuccess);
  ASSERT_EQ(fake_->EventQuery(e), cudaErrorNotReady);
  EXPECT_THAT(ops_->Fill(d.As(DType::kFloat32), 1), IsOk());
  EXPECT_THAT(ops_->Scale(d.As(DType::kFloat32), ScaleOp::kMultiply, 3),
              IsOk());
  // A failed allocation, reported as such, does not fail the next launch.
  fake_->FailNext("cudaMallocAsync", cudaErrorMemoryAllocation);
  EXPECT_THAT(ops_->Allocate(ops_->device(), 64).status(),
              StatusIs(absl::StatusCode::kResourceExhausted));
  EXPECT_THAT(ops_->Add(d.As(DType::kFloat32), d.As(DType::kFloat32)), IsOk());
  fake_->ReleaseStreams();
  const std::vector<unsigned char> got = Download(d.As(DType::kFloat32));
  EXPECT_EQ(LoadAsDouble(got.data(), DType::kFloat32, 0), 6.0);
  EXPECT_EQ(fake_->EventDestroy(e), cudaSuccess);
  EXPECT_EQ(fake_->PeekAtLastError(), cudaSuccess);
}

// A buffer used on another stream and freed without RecordStream can be
// handed out again while that stream's work still runs (a GPU corrupts
// silently): the model reports the free, when it is issued, as not ordered
// after the use.
TEST_F(CudaDeviceOpsTest, AFreeWithoutRecordStreamIsCaught) {
  FLATPARAM_ASSERT_OK_AND_ASSIGN(Stream side, ops_->NewStream());
  FLATPARAM_ASSERT_OK_AND_ASSIGN(DeviceBuffer x,
                                 ops_->Allocate(ops_->device(), 4096));
  FLATPARAM_ASSERT_OK_AND_ASSIGN(DeviceBuffer y,
                                 ops_->Allocate(ops_->device(), 4096));
  ASSERT_THAT(ops_->Fill(x.As(DType::kFloat32), 1), IsOk());
  FLATPARAM_ASSERT_OK_AND_ASSIGN(Event filled, ops_->RecordEvent(Stream{0}));
  ASSERT_THAT(ops_->WaitEvent(side, filled), IsOk());
  Hold(cuda_->cuda_stream(side));
  ASSERT_THAT(ops_->SetStream(side), IsOk());
  ASSERT_THAT(ops_->Add(y.As(DType::kFloat32), x.As(DType::kFloat32)), IsOk());
  ASSERT_THAT(ops_->SetStream(Stream{0}), IsOk());
  x.Reset();  // no RecordStream
  // Caught at the free, before either stream ran it.
  EXPECT_THAT(fake_->misuse(),
              ::testing::ElementsAre(
                  AllOf(HasSubstr("cudaFreeAsync"),
                        HasSubstr("is not ordered after add kernel"))));
  Release();
  EXPECT_THAT(ops_->Synchronize(),
              StatusIs(absl::StatusCode::kInternal,
                       HasSubstr("cudaErrorIllegalAddress")));
  y.Reset();
  ops_.reset();
  fake_.reset();  // the context is unusable after an illegal address
  rt_ = nullptr;  // and its pinned flags went with it
  flags_ = nullptr;
  holds_ = 0;
}
#endif  // FLATPARAM_CUDA_FAKE

}  // namespace
}  // namespace flatparam
