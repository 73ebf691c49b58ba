// NcclCommunicator on real GPUs with the real NCCL. Every test skips with
// "no usable GPU: ..." where cudaGetDeviceCount fails (no driver) or finds
// no device; the multi-GPU tests run one rank per visible device (up to 4)
// on threads and skip with fewer than two devices. The conformance suite
// (comm/conformance) runs on every visible device, up to 4, one or more.
#include <cuda_runtime_api.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nccl.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "comm/communicator.h"
#include "comm/conformance/collective_cases.h"
#include "comm/conformance/collective_cases_testutil.h"
#include "comm/conformance/cuda_memory.h"
#include "comm/conformance/device_memory.h"
#include "comm/nccl/nccl_api.h"
#include "comm/nccl/nccl_communicator.h"
#include "comm/nccl/thread_bootstrap_testutil.h"
#include "flatparam/base/dtype.h"
#include "flatparam/base/gpu_testutil.h"
#include "flatparam/base/status_matchers.h"
#include "flatparam/device/cuda/cuda_runtime.h"

namespace flatparam {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsNull;
using ::testing::NotNull;

// Device memory of `count` elements of `dtype`; copies are synchronous and
// followed by a device synchronization, because the communicator's stream
// does not synchronize with the legacy default stream.
class DeviceArray {
 public:
  DeviceArray(int device, int64_t count, DType dtype)
      : device_(device), count_(count), dtype_(dtype) {
    cudaSetDevice(device);
    EXPECT_EQ(cudaMalloc(&ptr_, std::max<int64_t>(1, bytes())), cudaSuccess);
  }
  ~DeviceArray() { cudaFree(ptr_); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;

  BufferRef ref() const {
    return {ptr_, count_, dtype_, Device::Cuda(device_)};
  }
  void Set(const std::vector<double>& values) {
    std::vector<char> host(bytes());
    for (size_t i = 0; i < values.size(); ++i) {
      StoreFromDouble(host.data(), dtype_, i, values[i]);
    }
    cudaSetDevice(device_);
    EXPECT_EQ(cudaMemcpy(ptr_, host.data(), bytes(), cudaMemcpyHostToDevice),
              cudaSuccess);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }
  std::vector<double> Get() const {
    std::vector<char> host(bytes());
    cudaSetDevice(device_);
    EXPECT_EQ(cudaMemcpy(host.data(), ptr_, bytes(), cudaMemcpyDeviceToHost),
              cudaSuccess);
    std::vector<double> values;
    for (int64_t i = 0; i < count_; ++i) {
      values.push_back(LoadAsDouble(host.data(), dtype_, i));
    }
    return values;
  }

 private:
  int64_t bytes() const { return count_ * DTypeSize(dtype_); }

  int device_;
  int64_t count_;
  DType dtype_;
  void* ptr_ = nullptr;
};

// The GPUs the multi-rank tests place their ranks on: rank r on GPU
// r % g_devices (set by NcclGpuTest::SetUp).
int g_devices = 1;
int DeviceOf(int rank) { return rank % g_devices; }

// How many ranks a multi-rank test runs, at most `most`: one per GPU, or,
// on a single GPU, 2 where NCCL lets ranks share one (NCCL 2.30 and later
// with NCCL_MULTI_RANK_GPU_ENABLE=1, which tools/gpu/run.sh sets; earlier
// releases fail "Duplicate GPU detected"). 0, with the reason in `why`,
// where neither holds.
int MultiRankCount(int devices, int most, std::string* why) {
  if (devices >= 2) return std::min(devices, most);
  int version = 0;
  ncclGetVersion(&version);
  const char* enable = std::getenv("NCCL_MULTI_RANK_GPU_ENABLE");
  const bool shared = enable != nullptr && std::string(enable) == "1";
  if (version >= 23000 && shared) return 2;
  *why = absl::StrCat("needs 2 GPUs, found ", devices,
                      "; two ranks on one GPU need NCCL "
                      "2.30 or later with NCCL_MULTI_RANK_GPU_ENABLE=1 (NCCL ",
                      version / 10000, ".", version / 100 % 100,
                      ", NCCL_MULTI_RANK_GPU_ENABLE=",
                      enable == nullptr ? "unset" : enable, ")");
  return 0;
}

// Runs without a GPU: which rank counts the multi-rank tests choose.
TEST(MultiRankCountTest, OneRankPerGpuOrTwoOnOneWhereNcclAllowsIt) {
  std::string why;
  EXPECT_EQ(MultiRankCount(3, 4, &why), 3);
  EXPECT_EQ(MultiRankCount(8, 4, &why), 4);
  EXPECT_EQ(MultiRankCount(8, 2, &why), 2);

  int version = 0;
  ASSERT_EQ(ncclGetVersion(&version), ncclSuccess);
  // tools/gpu/run.sh may have set it for the tests below: restored at the end.
  const char* was = std::getenv("NCCL_MULTI_RANK_GPU_ENABLE");
  const std::optional<std::string> saved =
      was == nullptr ? std::nullopt : std::optional<std::string>(was);
  unsetenv("NCCL_MULTI_RANK_GPU_ENABLE");
  EXPECT_EQ(MultiRankCount(1, 4, &why), 0);
  EXPECT_THAT(why, HasSubstr("NCCL_MULTI_RANK_GPU_ENABLE=unset"));
  setenv("NCCL_MULTI_RANK_GPU_ENABLE", "1", /*overwrite=*/1);
  why.clear();
  if (version >= 23000) {
    EXPECT_EQ(MultiRankCount(1, 4, &why), 2);
  } else {
    EXPECT_EQ(MultiRankCount(1, 4, &why), 0);
    EXPECT_THAT(why, HasSubstr(absl::StrCat("(NCCL ", version / 10000, ".",
                                            version / 100 % 100, ",")));
  }
  if (saved) {
    setenv("NCCL_MULTI_RANK_GPU_ENABLE", saved->c_str(), /*overwrite=*/1);
  } else {
    unsetenv("NCCL_MULTI_RANK_GPU_ENABLE");
  }
  const char* now = std::getenv("NCCL_MULTI_RANK_GPU_ENABLE");
  EXPECT_EQ(now == nullptr ? std::nullopt : std::optional<std::string>(now),
            saved);
}

class NcclGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const cudaError_t e = cudaGetDeviceCount(&devices_);
    if (e != cudaSuccess) {
      FLATPARAM_SKIP_WITHOUT_GPU(absl::StrCat(
          "no usable GPU: cudaGetDeviceCount: ", cudaGetErrorName(e), ": ",
          cudaGetErrorString(e)));
    }
    if (devices_ == 0) {
      FLATPARAM_SKIP_WITHOUT_GPU(
          "no usable GPU: cudaGetDeviceCount found no device");
    }
    g_devices = devices_;
  }

  int devices_ = 0;
};

std::unique_ptr<NcclCommunicator> CreateOne(int device) {
  std::vector<std::unique_ptr<Communicator>> group = MakeThreadGroup(1);
  absl::StatusOr<std::unique_ptr<NcclCommunicator>> nccl =
      NcclCommunicator::Create(RealNcclApi(), RealCudaRuntime(), *group[0],
                               device);
  EXPECT_THAT(nccl, IsOk());
  return nccl.ok() ? *std::move(nccl) : nullptr;
}

TEST_F(NcclGpuTest, EveryOpOnOneRank) {
  std::unique_ptr<NcclCommunicator> nccl = CreateOne(0);
  ASSERT_THAT(nccl, NotNull());
  EXPECT_EQ(nccl->size(), 1);

  DeviceArray in(0, 4, DType::kFloat32);
  DeviceArray out(0, 4, DType::kFloat32);
  in.Set({1, -2, 3.5, 8});

  EXPECT_THAT(nccl->AllGather(in.ref(), out.ref(), {})->Wait(), IsOk());
  EXPECT_THAT(out.Get(), ElementsAre(1, -2, 3.5, 8));
  for (ReduceOp op :
       {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax, ReduceOp::kMin}) {
    out.Set({0, 0, 0, 0});
    ReduceOptions options;
    options.op = op;
    EXPECT_THAT(nccl->ReduceScatter(in.ref(), out.ref(), options)->Wait(),
                IsOk());
    EXPECT_THAT(out.Get(), ElementsAre(1, -2, 3.5, 8)) << ReduceOpName(op);
    out.Set({0, 0, 0, 0});
    EXPECT_THAT(nccl->AllReduce(in.ref(), out.ref(), options)->Wait(), IsOk());
    EXPECT_THAT(out.Get(), ElementsAre(1, -2, 3.5, 8)) << ReduceOpName(op);
  }
  BroadcastOptions root;
  EXPECT_THAT(nccl->Broadcast(in.ref(), root)->Wait(), IsOk());
  EXPECT_THAT(in.Get(), ElementsAre(1, -2, 3.5, 8));
  // In place.
  EXPECT_THAT(nccl->AllGather(out.ref(), out.ref(), {})->Wait(), IsOk());
  EXPECT_THAT(nccl->AllReduce(out.ref(), out.ref(), {})->Wait(), IsOk());

  FLATPARAM_ASSERT_OK_AND_ASSIGN(std::vector<std::string> bytes,
                                 nccl->AllGatherBytes("hello", {}));
  EXPECT_THAT(bytes, ElementsAre("hello"));
  EXPECT_THAT(nccl->Barrier({}), IsOk());
}

// Stream-ordered completion with real streams: the input is written on the
// caller's stream behind a long copy, the all-gather is ordered after that
// stream (CollectiveOptions::stream) and the read-back after the collective
// (Work::WaitStream), with no host synchronization between them. Without
// the orderings the collective would read the stale input (zeros).
TEST_F(NcclGpuTest, StreamOrderedCollectiveWithoutHostWaits) {
  std::unique_ptr<NcclCommunicator> nccl = CreateOne(0);
  ASSERT_THAT(nccl, NotNull());
  ASSERT_TRUE(nccl->SupportsStreams(Device::Cuda(0)));
  cudaSetDevice(0);
  cudaStream_t caller = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&caller, cudaStreamNonBlocking),
            cudaSuccess);
  constexpr int64_t kCount = 1 << 20;
  DeviceArray in(0, kCount, DType::kFloat32);
  DeviceArray out(0, kCount, DType::kFloat32);
  in.Set(std::vector<double>(kCount, 0.0));
  // A long copy on the caller's stream first (512 MiB device to device).
  constexpr size_t kBusy = size_t{512} << 20;
  void* busy_src = nullptr;
  void* busy_dst = nullptr;
  ASSERT_EQ(cudaMalloc(&busy_src, kBusy), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&busy_dst, kBusy), cudaSuccess);
  float* host = nullptr;
  ASSERT_EQ(cudaMallocHost(&host, kCount * sizeof(float)), cudaSuccess);
  for (int64_t i = 0; i < kCount; ++i) host[i] = static_cast<float>(i % 97);
  ASSERT_EQ(cudaMemcpyAsync(busy_dst, busy_src, kBusy, cudaMemcpyDeviceToDevice,
                            caller),
            cudaSuccess);
  ASSERT_EQ(cudaMemcpyAsync(in.ref().data, host, kCount * sizeof(float),
                            cudaMemcpyHostToDevice, caller),
            cudaSuccess);
  const DeviceStream stream{Device::Cuda(0), nullptr,
                            reinterpret_cast<uintptr_t>(caller)};
  CollectiveOptions options;
  options.stream = stream;
  std::unique_ptr<Work> work = nccl->AllGather(in.ref(), out.ref(), options);
  ASSERT_THAT(work->WaitStream(stream), IsOk());
  ASSERT_EQ(cudaMemcpyAsync(host, out.ref().data, kCount * sizeof(float),
                            cudaMemcpyDeviceToHost, caller),
            cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(caller), cudaSuccess);
  int64_t wrong = 0;
  for (int64_t i = 0; i < kCount; ++i) {
    wrong += host[i] != static_cast<float>(i % 97) ? 1 : 0;
  }
  EXPECT_EQ(wrong, 0);
  EXPECT_THAT(work->Wait(), IsOk());
  cudaFreeHost(host);
  cudaFree(busy_src);
  cudaFree(busy_dst);
  cudaStreamDestroy(caller);
}

TEST_F(NcclGpuTest, DivideFactorsInEveryDtype) {
  std::unique_ptr<NcclCommunicator> nccl = CreateOne(0);
  ASSERT_THAT(nccl, NotNull());
  for (DType dtype :
       {DType::kFloat32, DType::kFloat64, DType::kFloat16, DType::kBFloat16}) {
    DeviceArray b(0, 3, dtype);
    b.Set({8, -16, 4});
    ReduceOptions options;
    options.pre_divide_factor = 2;
    options.post_divide_factor = 4;
    EXPECT_THAT(nccl->AllReduce(b.ref(), b.ref(), options)->Wait(), IsOk());
    EXPECT_THAT(b.Get(), ElementsAre(1, -2, 0.5)) << DTypeName(dtype);

    // 1/3 is inexact: one rounding of the scalar, one of the product.
    b.Set({3, 6, 9});
    options.pre_divide_factor = 3;
    options.post_divide_factor = 1;
    options.op = ReduceOp::kAvg;
    EXPECT_THAT(nccl->AllReduce(b.ref(), b.ref(), options)->Wait(), IsOk());
    const double tolerance = DTypeSize(dtype) == 2 ? 1e-2 : 1e-6;
    const std::vector<double> got = b.Get();
    for (int i = 0; i < 3; ++i) {
      EXPECT_NEAR(got[i], i + 1, tolerance * (i + 1)) << DTypeName(dtype);
    }
  }
}

TEST_F(NcclGpuTest, SplitAndBufferChecks) {
  std::unique_ptr<NcclCommunicator> nccl = CreateOne(0);
  ASSERT_THAT(nccl, NotNull());
  FLATPARAM_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Communicator> child,
                                 nccl->Split(0, 0, {}));
  ASSERT_THAT(child, NotNull());
  EXPECT_EQ(child->size(), 1);
  DeviceArray b(0, 2, DType::kFloat32);
  b.Set({1, 2});
  EXPECT_THAT(child->AllReduce(b.ref(), b.ref(), {})->Wait(), IsOk());
  EXPECT_THAT(b.Get(), ElementsAre(1, 2));
  FLATPARAM_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Communicator> none,
                                 nccl->Split(-1, 0, {}));
  EXPECT_THAT(none, IsNull());

  std::vector<float> host(2);
  BufferRef on_host{host.data(), 2, DType::kFloat32, Device::Host()};
  EXPECT_THAT(nccl->AllReduce(on_host, on_host, {})->Wait(),
              StatusIs(absl::StatusCode::kUnimplemented));
  BufferRef mislabelled{host.data(), 2, DType::kFloat32, Device::Cuda(0)};
  EXPECT_THAT(nccl->AllReduce(mislabelled, mislabelled, {})->Wait(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("not device memory")));
  EXPECT_FALSE(nccl->aborted());
}

// Runs `body(rank, communicator)` on one thread per rank, rank r on GPU
// DeviceOf(r).
template <typename Body>
void OnEveryRank(int n, absl::Duration setup_timeout, Body body) {
  std::vector<std::unique_ptr<Communicator>> group = MakeThreadGroup(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      NcclOptions options;
      options.setup_timeout = setup_timeout;
      absl::StatusOr<std::unique_ptr<NcclCommunicator>> nccl =
          NcclCommunicator::Create(RealNcclApi(), RealCudaRuntime(), *group[r],
                                   DeviceOf(r), options);
      ASSERT_THAT(nccl, IsOk());
      body(r, **nccl);
    });
  }
  for (std::thread& t : threads) t.join();
}

TEST_F(NcclGpuTest, CollectivesAcrossDevices) {
  std::string why;
  const int n = MultiRankCount(devices_, 4, &why);
  if (n == 0) GTEST_SKIP() << why;
  OnEveryRank(n, absl::Minutes(1), [n](int r, NcclCommunicator& nccl) {
    DeviceArray a(DeviceOf(r), 2, DType::kFloat32);
    a.Set({static_cast<double>(r + 1), 1});
    EXPECT_THAT(nccl.AllReduce(a.ref(), a.ref(), {})->Wait(), IsOk());
    EXPECT_THAT(a.Get(), ElementsAre(n * (n + 1) / 2, n));

    DeviceArray gathered(DeviceOf(r), 2 * n, DType::kFloat32);
    a.Set({static_cast<double>(r), static_cast<double>(10 * r)});
    EXPECT_THAT(nccl.AllGather(a.ref(), gathered.ref(), {})->Wait(), IsOk());
    const std::vector<double> all = gathered.Get();
    for (int i = 0; i < n; ++i) {
      EXPECT_EQ(all[2 * i], i);
      EXPECT_EQ(all[2 * i + 1], 10 * i);
    }

    // Every rank contributes 8 * (block index + 1); avg with pre 2, post 2
    // gives 8 * (i + 1) / 4 on rank i.
    DeviceArray blocks(DeviceOf(r), n, DType::kFloat32);
    std::vector<double> values;
    for (int i = 0; i < n; ++i) values.push_back(8 * (i + 1));
    blocks.Set(values);
    DeviceArray mine(DeviceOf(r), 1, DType::kFloat32);
    ReduceOptions options;
    options.op = ReduceOp::kAvg;
    options.pre_divide_factor = 2;
    options.post_divide_factor = 2;
    EXPECT_THAT(nccl.ReduceScatter(blocks.ref(), mine.ref(), options)->Wait(),
                IsOk());
    EXPECT_NEAR(mine.Get()[0], 2.0 * (r + 1), 1e-5);

    BroadcastOptions root;
    root.root = n - 1;
    a.Set({static_cast<double>(r), 0});
    EXPECT_THAT(nccl.Broadcast(a.ref(), root)->Wait(), IsOk());
    EXPECT_THAT(a.Get(), ElementsAre(n - 1, 0));

    FLATPARAM_ASSERT_OK_AND_ASSIGN(
        std::vector<std::string> bytes,
        nccl.AllGatherBytes(std::string(r, 'x'), {}));
    ASSERT_EQ(bytes.size(), static_cast<size_t>(n));
    for (int i = 0; i < n; ++i) EXPECT_EQ(bytes[i], std::string(i, 'x'));

    FLATPARAM_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Communicator> parity,
                                   nccl.Split(r % 2, r, {}));
    ASSERT_THAT(parity, NotNull());
    EXPECT_EQ(parity->rank(), r / 2);
    a.Set({1, 0});
    EXPECT_THAT(parity->AllReduce(a.ref(), a.ref(), {})->Wait(), IsOk());
    EXPECT_EQ(a.Get()[0], parity->size());
    EXPECT_THAT(nccl.Barrier({}), IsOk());
  });
}

// The backend-independent suite, with buffers in device memory. NCCL
// reduces in its own order and applies divide factors and averages as one
// premultiplication, so only the cases whose results cannot depend on that
// run (SuiteOptions::exact_only); those must equal the simulator's bits.
TEST_F(NcclGpuTest, ConformanceSuite) {
  std::string why;
  const int n = std::max(MultiRankCount(devices_, 4, &why), 1);
  OnEveryRank(n, absl::Minutes(1), [n](int r, NcclCommunicator& nccl) {
    SCOPED_TRACE(absl::StrCat("rank ", r, " of ", n));
    absl::StatusOr<std::unique_ptr<conformance::DeviceMemory>> memory =
        conformance::CudaMemory(DeviceOf(r));
    ASSERT_THAT(memory, IsOk());
    conformance::SuiteOptions options;
    options.exact_only = true;
    const conformance::SuiteReport report =
        conformance::RunSuite(nccl, **memory, options);
    EXPECT_GT(report.cases, 100);
    conformance::ExpectSuiteOk(report);
  });
}

TEST_F(NcclGpuTest, APeerThatNeverJoinsACollectiveTimesOutAndAborts) {
  std::string why;
  if (MultiRankCount(devices_, 2, &why) == 0) GTEST_SKIP() << why;
  OnEveryRank(2, absl::Seconds(20), [](int r, NcclCommunicator& nccl) {
    if (r != 0) return;  // Rank 1 never calls the all-reduce.
    DeviceArray a(DeviceOf(r), 1024, DType::kFloat32);
    ReduceOptions options;
    options.timeout = absl::Seconds(2);
    EXPECT_THAT(nccl.AllReduce(a.ref(), a.ref(), options)->Wait(),
                StatusIs(absl::StatusCode::kDeadlineExceeded,
                         AllOf(HasSubstr("all_reduce #0"),
                               HasSubstr("ncclCommAbort"))));
    EXPECT_TRUE(nccl.aborted());
  });
}

}  // namespace
}  // namespace flatparam
