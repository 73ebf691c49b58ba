// Sharded training on GPUs: FlatParamHandles on CUDA DeviceOps with an NCCL
// communicator (bootstrapped by an in-process thread group), one rank per
// visible GPU (up to 4), against TrainReference.
//
// On one GPU there is no reduction arithmetic (one rank: the gradient
// factors are 1, the collectives copy), and the CUDA kernels cast and add
// exactly as the host does, so the results are bitwise identical, mixed
// precision included. On several GPUs NCCL sums in its own order and CUDA
// divides by multiplying with the reciprocal, so one step's gradients are
// checked against 2 gamma_K(u) T (verify/training_equivalence_test.cc
// explains the bound) with two more roundings per term for the reciprocal.
//
// Skips, saying why, without CUDA or NCCL in the build or without a usable
// GPU ("no usable GPU: ..."), as on CPU-only CI machines.
//
// Built with FLATPARAM_CUDA_FAKE (training_nccl_fake_test), the same tests
// run in CI on the model of CUDA and NCCL: CudaDeviceOps on FakeCudaRuntime
// and NcclCommunicator on FakeNcclOnCuda, four fake devices.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "comm/communicator.h"
#include "comm/nccl/nccl_backend.h"
#include "comm/nccl/thread_bootstrap_testutil.h"
#include "flatparam/base/gpu_testutil.h"
#include "flatparam/device/cuda/cuda_device.h"
#include "flatparam/device/device.h"
#include "flatparam/layout.h"
#include "flatparam/memory_stats.h"
#include "refmodel/fsdp_trainer.h"
#include "refmodel/mlp_model.h"
#include "refmodel/reference_trainer.h"
#include "verify/training_testutil.h"

#ifdef FLATPARAM_CUDA_FAKE
#include "comm/nccl/nccl_communicator.h"
#include "flatparam/device/cuda/cuda_device_ops.h"
#include "flatparam/device/cuda/fake_cuda_runtime.h"
#include "flatparam/device/cuda/fake_nccl_on_cuda.h"
#endif

namespace flatparam {
namespace verify {
namespace {

using refmodel::FsdpRankResult;
using refmodel::FsdpTrainOptions;

#ifdef FLATPARAM_CUDA_FAKE
constexpr int kFakeDevices = 4;

// Four fake devices and NCCL over them. The runtime goes first: draining
// its streams may still run the fake NCCL's collectives.
struct FakeWorld {
  FakeWorld() {
    FakeCudaRuntime::Options options;
    options.device_count = kFakeDevices;
    options.max_op_delay = absl::Microseconds(20);
    cuda = std::make_unique<FakeCudaRuntime>(options);
    nccl = std::make_unique<FakeNcclOnCuda>(*cuda);
  }
  ~FakeWorld() {
    EXPECT_THAT(cuda->misuse(), ::testing::IsEmpty());
    EXPECT_THAT(nccl->misuse(), ::testing::IsEmpty());
    cuda.reset();
    nccl.reset();
  }
  std::unique_ptr<FakeCudaRuntime> cuda;
  std::unique_ptr<FakeNcclOnCuda> nccl;
};
#endif

// The number of usable GPUs (at most 4); skips the test when there is none.
int UsableGpus(std::string* why) {
#ifdef FLATPARAM_CUDA_FAKE
  return kFakeDevices;
#endif
  if (!CudaDeviceOpsAvailable() || !NcclBackendAvailable()) {
    *why = "no CUDA/NCCL in this build";
    return 0;
  }
  int n = 0;
  for (; n < 4; ++n) {
    absl::StatusOr<std::unique_ptr<DeviceOps>> ops = CreateCudaDeviceOps(n);
    if (!ops.ok()) {
      if (n == 0) *why = std::string(ops.status().message());
      break;
    }
  }
  return n;
}

// Trains on `world` GPUs, one thread per rank.
std::vector<absl::StatusOr<FsdpRankResult>> TrainOnGpus(
    const FsdpTrainOptions& options, int world) {
  std::vector<std::unique_ptr<Communicator>> bootstrap = MakeThreadGroup(world);
  std::vector<absl::StatusOr<FsdpRankResult>> results(
      world, absl::UnknownError("not run"));
  std::vector<std::thread> threads;
#ifdef FLATPARAM_CUDA_FAKE
  FakeWorld fake;
#endif
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
#ifdef FLATPARAM_CUDA_FAKE
      absl::StatusOr<std::unique_ptr<DeviceOps>> ops =
          CudaDeviceOps::Create(r, nullptr, nullptr, fake.cuda.get());
      if (!ops.ok()) {
        results[r] = ops.status();
        return;
      }
      absl::StatusOr<std::unique_ptr<Communicator>> nccl =
          NcclCommunicator::Create(*fake.nccl, *fake.cuda, *bootstrap[r], r);
#else
      absl::StatusOr<std::unique_ptr<DeviceOps>> ops = CreateCudaDeviceOps(r);
      if (!ops.ok()) {
        results[r] = ops.status();
        return;
      }
      absl::StatusOr<std::unique_ptr<Communicator>> nccl =
          CreateNcclCommunicator(*bootstrap[r], r);
#endif
      if (!nccl.ok()) {
        results[r] = nccl.status();
        return;
      }
      results[r] = refmodel::TrainFsdpOnRank(**nccl, **ops, options);
    });
  }
  for (std::thread& t : threads) t.join();
  return results;
}

FsdpTrainOptions Options(ShardingStrategy strategy, int world) {
  FsdpTrainOptions o;
  o.strategy = strategy;
  o.steps = 3;
  o.global_batch = 2 * world;
  o.micro_batches = 2;
  o.optimizer = refmodel::AdamWOptions{1e-2};
  o.data_seed = 3;
  return o;
}

TEST(TrainingNcclTest, OneGpuEqualsTheReferenceBitwise) {
  std::string why;
  if (UsableGpus(&why) < 1) FLATPARAM_SKIP_WITHOUT_GPU(why);
  struct Case {
    ShardingStrategy strategy;
    bool bf16, offload;
  };
  for (const Case& c : {Case{ShardingStrategy::kFullShard, false, false},
                        Case{ShardingStrategy::kShardGradOp, true, false},
                        Case{ShardingStrategy::kNoShard, false, true},
                        Case{ShardingStrategy::kFullShard, true, true}}) {
    FsdpTrainOptions o = Options(c.strategy, 1);
    o.align_addresses = true;
    o.cpu_offload = c.offload;
    if (c.bf16) o.param_dtype = DType::kBFloat16;
    SCOPED_TRACE(Describe({o, 1}));
    std::vector<absl::StatusOr<FsdpRankResult>> got = TrainOnGpus(o, 1);
    ASSERT_TRUE(got[0].ok()) << got[0].status();
    absl::StatusOr<refmodel::TrainOptions> ref =
        refmodel::ReferenceOptionsFor(o, 1);
    ASSERT_TRUE(ref.ok()) << ref.status();
    absl::StatusOr<refmodel::TrainResult> want =
        refmodel::TrainReference(o.model, *ref);
    ASSERT_TRUE(want.ok()) << want.status();
    EXPECT_EQ(got[0]->losses, want->losses);
    EXPECT_TRUE(SameTensors(got[0]->params, want->params, &why)) << why;
    EXPECT_TRUE(
        SameStates(got[0]->optimizer_state, want->optimizer_state, &why))
        << why;
    if (!c.offload) {
      // Without offload a device needs no staging: the formula holds.
      absl::StatusOr<std::array<int64_t, kNumMemoryCategories>> memory =
          refmodel::ExpectedPeakMemory(o, 1);
      ASSERT_TRUE(memory.ok());
      for (int k = 0; k < kNumMemoryCategories; ++k) {
        EXPECT_EQ(got[0]->memory.peak[k], (*memory)[k])
            << MemoryCategoryName(MemoryCategory(k));
      }
    }
  }
}

TEST(TrainingNcclTest, SeveralGpusAgreeWithinTheReassociationBound) {
  std::string why;
  const int gpus = UsableGpus(&why);
  if (gpus == 0) FLATPARAM_SKIP_WITHOUT_GPU(why);
  if (gpus < 2) GTEST_SKIP() << "needs two GPUs";
  for (ShardingStrategy s :
       {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp,
        ShardingStrategy::kNoShard}) {
    FsdpTrainOptions o = Options(s, gpus);
    o.steps = 1;
    o.micro_batches = 1;
    o.gather_grads = true;
    SCOPED_TRACE(Describe({o, gpus}));
    std::vector<absl::StatusOr<FsdpRankResult>> got = TrainOnGpus(o, gpus);
    for (const auto& r : got) ASSERT_TRUE(r.ok()) << r.status();
    absl::StatusOr<refmodel::TrainOptions> ref =
        refmodel::ReferenceOptionsFor(o, gpus);
    ASSERT_TRUE(ref.ok());
    absl::StatusOr<refmodel::ReferenceModel> model =
        refmodel::ReferenceModel::Create(o.model);
    ASSERT_TRUE(model.ok());
    const std::map<std::string, HostTensor> params = model->InitParams();
    absl::StatusOr<refmodel::StepGradients> want =
        refmodel::ComputeStepGradients(*model, params, *ref, 0);
    ASSERT_TRUE(want.ok());
    // T: the sum of |local gradient| / (pre * post) per element.
    const int64_t local = o.global_batch / gpus;
    const double scale =
        ref->reduction.pre_divide_factor * ref->reduction.post_divide_factor;
    std::map<std::string, std::vector<double>> t;
    for (int r = 0; r < gpus; ++r) {
      std::map<std::string, HostTensor> g;
      refmodel::MapParamAccess access(&params, &g);
      ASSERT_TRUE(
          model
              ->ForwardBackward(refmodel::MakeBatch(o.data_seed, o.model.vocab,
                                                    0, 0, r * local, local),
                                access)
              .ok());
      for (const auto& [name, x] : g) {
        std::vector<double>& s = t[name];
        s.resize(x.numel());
        for (int64_t i = 0; i < x.numel(); ++i) {
          s[i] += std::abs(x.GetDouble(i)) / scale;
        }
      }
    }
    const int k = 2 + gpus + 1 + 2;
    const double u = std::ldexp(1.0, -24);
    const double gamma = 2 * k * u / (1 - k * u);
    for (const auto& [name, g] : got[0]->grads) {
      for (int64_t i = 0; i < g.numel(); ++i) {
        EXPECT_LE(std::abs(g.GetDouble(i) - want->grads.at(name).GetDouble(i)),
                  gamma * t[name][i])
            << name << "[" << i << "]";
      }
    }
  }
}

#ifdef FLATPARAM_CUDA_FAKE
// On the model, where the reduction folds the ranks in rank order as the
// simulator does, and the divide factors at 2 and 4 ranks are powers of
// two (exact as NCCL's pre-multiplied sum and as the host's division), the
// CUDA/NCCL path is bitwise the host path on the simulator: every strategy,
// mixed precision and CPU offload included, over several steps and
// micro-batches (the stream and event discipline of the runtime on real
// asynchronous streams).
TEST(TrainingNcclTest, FakeGpusEqualTheSimulatorBitwise) {
  struct Case {
    ShardingStrategy strategy;
    int world;
    bool bf16, offload;
    // The runtime's prefetching: which collectives overlap which compute.
    bool forward_prefetch = false;
    BackwardPrefetch backward_prefetch = BackwardPrefetch::kBackwardPre;
    int depth = 1;
  };
  for (const Case& c : {Case{ShardingStrategy::kFullShard, 4, false, false},
                        Case{ShardingStrategy::kFullShard, 2, true, true},
                        Case{ShardingStrategy::kShardGradOp, 4, true, false},
                        Case{ShardingStrategy::kNoShard, 2, false, true},
                        Case{ShardingStrategy::kFullShard, 4, true, false, true,
                             BackwardPrefetch::kBackwardPost, 2},
                        Case{ShardingStrategy::kHybridShard, 4, false, false,
                             true, BackwardPrefetch::kBackwardPre, 2}}) {
    FsdpTrainOptions o = Options(c.strategy, c.world);
    o.align_addresses = true;
    o.cpu_offload = c.offload;
    if (c.bf16) o.param_dtype = DType::kBFloat16;
    o.forward_prefetch = c.forward_prefetch;
    o.backward_prefetch = c.backward_prefetch;
    o.prefetch_depth = c.depth;
    // On the fake: the handles' own streams, really asynchronous, ordered
    // by events; on the simulator's host device they change nothing.
    o.separate_streams = true;
    if (c.strategy == ShardingStrategy::kHybridShard) o.shard_group_size = 2;
    SCOPED_TRACE(Describe({o, c.world}));
    std::vector<absl::StatusOr<FsdpRankResult>> got = TrainOnGpus(o, c.world);
    absl::StatusOr<std::vector<FsdpRankResult>> want =
        TrainFsdpOnSim(o, c.world);
    ASSERT_TRUE(want.ok()) << want.status();
    std::string why;
    for (int r = 0; r < c.world; ++r) {
      ASSERT_TRUE(got[r].ok()) << got[r].status();
      EXPECT_EQ(got[r]->losses, (*want)[r].losses) << "rank " << r;
      EXPECT_TRUE(SameTensors(got[r]->params, (*want)[r].params, &why))
          << "rank " << r << ": " << why;
      EXPECT_TRUE(
          SameStates(got[r]->optimizer_state, (*want)[r].optimizer_state, &why))
          << "rank " << r << ": " << why;
    }
  }
}
#endif  // FLATPARAM_CUDA_FAKE

}  // namespace
}  // namespace verify
}  // namespace flatparam
