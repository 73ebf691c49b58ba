// FlatParamHandle at several ranks on the model of CUDA and NCCL
// (CudaDeviceOps on FakeCudaRuntime, NcclCommunicator on FakeNcclOnCuda:
// one thread and one fake device per rank, streams that run asynchronously)
// against the same handle on the host over the simulator. Over generated
// layouts, strategies (hybrid included), precisions, CPU offload and the
// handle's own streams, two micro-batches (the first under no_sync) and a
// third forward: the sharded gradient each rank keeps and the unsharded
// parameter it gathers are bitwise the host's. World sizes 1, 2 and 4, whose
// divide factors are powers of two (exact in NCCL's pre-multiplied sum as
// in the host's division), so bitwise is the bar.
#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "comm/communicator.h"
#include "comm/nccl/nccl_communicator.h"
#include "comm/nccl/thread_bootstrap_testutil.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/device/cuda/cuda_device_ops.h"
#include "flatparam/device/cuda/fake_cuda_runtime.h"
#include "flatparam/device/cuda/fake_nccl_on_cuda.h"
#include "flatparam/device/device.h"
#include "flatparam/handle.h"
#include "flatparam/layout.h"
#include "testing/handle_testutil.h"
#include "verify/generators.h"

namespace flatparam {
namespace {

using testing_handle::InitialParams;
using testing_handle::MakeLayout;
using testing_handle::RankContext;
using testing_handle::RunIteration;
using testing_handle::RunWithHandles;
using testing_handle::Scenario;

constexpr int kFakeDevices = 4;

// What one rank ends with, as bytes.
// (No std::optional<std::vector>: GCC 12 -O2 warns it may be used
// uninitialized.)
struct Outcome {
  bool has_sharded_grad = false;
  std::vector<unsigned char> sharded_grad;
  std::vector<unsigned char> unsharded_param;
};

absl::StatusOr<std::vector<unsigned char>> Download(DeviceOps& ops,
                                                    ConstBufferRef b) {
  std::vector<unsigned char> host(b.bytes());
  FLATPARAM_RETURN_IF_ERROR(
      ops.Copy(BufferRef{host.data(), b.count, b.dtype, Device::Host()}, b));
  FLATPARAM_RETURN_IF_ERROR(ops.Synchronize());
  return host;
}

// Micro-batch 0 under no_sync, micro-batch 1 synchronized, then a forward's
// unshard: the sharded gradient and the gathered parameter.
absl::StatusOr<Outcome> Observe(const Scenario& s, RankContext& ctx) {
  FLATPARAM_RETURN_IF_ERROR(RunIteration(s, ctx, 0, /*sync=*/false));
  FLATPARAM_RETURN_IF_ERROR(RunIteration(s, ctx, 1, /*sync=*/true));
  Outcome out;
  if (std::optional<BufferRef> g = ctx.handle.sharded_grad()) {
    out.has_sharded_grad = true;
    FLATPARAM_ASSIGN_OR_RETURN(out.sharded_grad, Download(ctx.ops, *g));
  }
  FLATPARAM_RETURN_IF_ERROR(ctx.handle.PreForward());
  std::optional<BufferRef> p = ctx.handle.unsharded_flat_param();
  if (!p.has_value()) return absl::InternalError("no unsharded parameter");
  FLATPARAM_ASSIGN_OR_RETURN(out.unsharded_param, Download(ctx.ops, *p));
  FLATPARAM_RETURN_IF_ERROR(ctx.handle.PostForward());
  return out;
}

// The scenario on the model of CUDA and NCCL; each world rank's outcome.
std::vector<absl::StatusOr<Outcome>> RunOnFakeGpus(const Scenario& s,
                                                   uint64_t cuda_seed) {
  const int world = s.world_size();
  std::vector<absl::StatusOr<Outcome>> outcomes(world,
                                                absl::UnknownError("not run"));
  absl::StatusOr<FlatParamLayout> layout = MakeLayout(s);
  if (!layout.ok()) {
    for (auto& o : outcomes) o = layout.status();
    return outcomes;
  }
  const std::vector<HostTensor> params = InitialParams(s, *layout);
  std::vector<ConstBufferRef> refs;
  for (const HostTensor& t : params) refs.push_back(t.cref());

  FakeCudaRuntime::Options options;
  options.device_count = kFakeDevices;
  options.max_op_delay = absl::Microseconds(20);
  options.seed = cuda_seed;
  auto cuda = std::make_unique<FakeCudaRuntime>(options);
  auto nccl = std::make_unique<FakeNcclOnCuda>(*cuda);
  std::vector<std::unique_ptr<Communicator>> bootstrap = MakeThreadGroup(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      outcomes[r] = [&]() -> absl::StatusOr<Outcome> {
        FLATPARAM_ASSIGN_OR_RETURN(
            std::unique_ptr<DeviceOps> ops,
            CudaDeviceOps::Create(r, nullptr, nullptr, cuda.get()));
        FLATPARAM_ASSIGN_OR_RETURN(
            std::unique_ptr<Communicator> comm,
            NcclCommunicator::Create(*nccl, *cuda, *bootstrap[r], r));
        HybridGroups groups;
        Communicator* shard = comm.get();
        Communicator* replicate = nullptr;
        if (s.hybrid()) {
          FLATPARAM_ASSIGN_OR_RETURN(groups,
                                     MakeHybridGroups(*comm, s.shard_size));
          shard = groups.shard.get();
          replicate = groups.replicate.get();
        }
        HandleOptions handle_options = s.options;
        if (s.separate_streams) {
          FLATPARAM_ASSIGN_OR_RETURN(handle_options.streams.unshard,
                                     ops->NewStream());
          FLATPARAM_ASSIGN_OR_RETURN(handle_options.streams.post_backward,
                                     ops->NewStream());
        }
        absl::StatusOr<Outcome> out;
        {
          FLATPARAM_ASSIGN_OR_RETURN(
              std::unique_ptr<FlatParamHandle> handle,
              FlatParamHandle::Create(*layout, refs, shard, replicate,
                                      ops.get(), handle_options));
          RankContext ctx{*comm, r, *handle, *layout, *ops};
          out = Observe(s, ctx);
        }
        // Drain the streams before the communicators go.
        FLATPARAM_RETURN_IF_ERROR(ops->Synchronize());
        return out;
      }();
    });
  }
  for (std::thread& t : threads) t.join();
  const std::vector<std::string> cuda_misuse = cuda->misuse();
  const std::vector<std::string> nccl_misuse = nccl->misuse();
  cuda.reset();
  nccl.reset();
  for (const std::string& m : cuda_misuse) {
    RC_FAIL("CUDA misuse: " + m);
  }
  for (const std::string& m : nccl_misuse) {
    RC_FAIL("NCCL misuse: " + m);
  }
  return outcomes;
}

rc::Gen<Scenario> GenScenario() {
  return rc::gen::exec([] {
    Scenario s;
    s.dtype = *rc::gen::element(DType::kFloat32, DType::kBFloat16)
                   .as("parameter dtype");
    s.specs = *verify::GenParamSpecs(s.dtype, verify::Scale::kData);
    s.strategy = *verify::GenShardingStrategy();
    if (s.hybrid()) {
      s.shard_size = *rc::gen::element(1, 2).as("shard group size");
      s.replicate_size = *rc::gen::element(2, 4 / s.shard_size).as("replicas");
    } else {
      s.shard_size = *rc::gen::element(1, 2, 4).as("world size");
    }
    s.align = *rc::gen::arbitrary<bool>().as("align addresses");
    const int precision = *rc::gen::inRange(0, 3).as("mixed precision");
    if (precision == 1) s.options.param_dtype = DType::kBFloat16;
    if (precision == 2) {
      s.options.param_dtype = DType::kFloat16;
      s.options.reduce_dtype = DType::kFloat32;
    }
    s.options.keep_low_precision_grads = *rc::gen::arbitrary<bool>();
    s.options.cpu_offload = *rc::gen::arbitrary<bool>().as("offload");
    s.options.divide_in_collectives = *rc::gen::arbitrary<bool>();
    s.separate_streams = *rc::gen::arbitrary<bool>().as("separate streams");
    s.rounding_values = true;
    s.sim_seed = *rc::gen::arbitrary<uint64_t>();
    return s;
  });
}

RC_GTEST_PROP(HandleFakeNcclPropertyTest, FakeGpusEqualTheHostBitwise, ()) {
  const Scenario s = *GenScenario();
  const uint64_t cuda_seed = *rc::gen::arbitrary<uint64_t>().as("cuda seed");
  RC_TAG(ShardingStrategyName(s.strategy), s.world_size());
  // Layouts flatparam refuses (mixed requires_grad without alignment) are
  // not this test's subject.
  RC_PRE(MakeLayout(s).ok());

  // The host's device has one stream: the reference runs on it.
  Scenario on_host = s;
  on_host.separate_streams = false;
  std::vector<std::optional<Outcome>> want(s.world_size());
  const absl::Status host = RunWithHandles(on_host, [&](RankContext& ctx) {
    FLATPARAM_ASSIGN_OR_RETURN(Outcome out, Observe(on_host, ctx));
    want[ctx.world_rank] = std::move(out);
    return absl::OkStatus();
  });
  if (!host.ok()) RC_FAIL(absl::StrCat("on the host: ", host.ToString()));

  std::vector<absl::StatusOr<Outcome>> got = RunOnFakeGpus(s, cuda_seed);
  for (int r = 0; r < s.world_size(); ++r) {
    if (!got[r].ok()) {
      RC_FAIL(absl::StrCat("rank ", r, ": ", got[r].status().ToString()));
    }
    RC_ASSERT(want[r].has_value());
    RC_ASSERT(got[r]->has_sharded_grad == want[r]->has_sharded_grad);
    RC_ASSERT(got[r]->sharded_grad == want[r]->sharded_grad);
    RC_ASSERT(got[r]->unsharded_param == want[r]->unsharded_param);
  }
}

}  // namespace
}  // namespace flatparam
