#include "flatparam/runtime.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"
#include "comm/communicator.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/base/status_matchers.h"
#include "flatparam/device/device.h"
#include "flatparam/flatten.h"
#include "flatparam/handle.h"
#include "flatparam/layout.h"
#include "flatparam/memory_stats.h"
#include "flatparam/model_layout.h"
#include "refmodel/synthetic_step.h"
#include "sim/sim.h"
#include "sim/sim_device.h"
#include "testing/handle_testutil.h"

namespace flatparam {
namespace {

using ::flatparam::testing_handle::ReadValues;
using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr int kWorld = 4;
constexpr ShardingStrategy kAllStrategies[] = {
    ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp,
    ShardingStrategy::kNoShard, ShardingStrategy::kHybridShard,
    ShardingStrategy::kHybridShardZero2};

int ShardSize(ShardingStrategy s) { return IsHybridStrategy(s) ? 2 : kWorld; }

// A root ("" : an embedding, a head bias and the head weight tied to the
// embedding) around three equal layers: units 0 (root), 1, 2, 3. Every flat
// parameter has 15 elements or 20, so the shards of 4 ranks are padded.
ModelSpec TestModel() {
  ModelSpec spec;
  spec.name = "tiny";
  spec.params = {{"embed.w", {5, 3}}, {"layers.0.w", {3, 4}},
                 {"layers.0.b", {3}}, {"layers.1.w", {3, 4}},
                 {"layers.1.b", {3}}, {"layers.2.w", {3, 4}},
                 {"layers.2.b", {3}}, {"head.b", {5}}};
  ParamSpec tied{"head.w", {5, 3}};
  tied.tied_to = "embed.w";
  spec.params.push_back(tied);
  spec.wrap = {"layers.0", "layers.1", "layers.2"};
  return spec;
}

absl::StatusOr<ModelLayout> MakeModel(ShardingStrategy strategy, bool align) {
  LayoutOptions o;
  o.world_size = ShardSize(strategy);
  o.strategy = strategy;
  o.align_addresses = align;
  return ModelLayout::Create(TestModel(), o);
}

// Dyadic initial values, the same on every rank.
std::map<std::string, HostTensor> InitialTensors(const ModelSpec& spec) {
  std::map<std::string, HostTensor> out;
  for (size_t p = 0; p < spec.params.size(); ++p) {
    const ParamSpec& s = spec.params[p];
    if (!s.tied_to.empty()) continue;
    HostTensor t(DType::kFloat32, s.shape);
    for (int64_t k = 0; k < t.numel(); ++k) {
      t.SetDouble(k, static_cast<double>((p * 7 + k * 3) % 11) / 8.0 - 0.625);
    }
    out.emplace(s.fqn, std::move(t));
  }
  return out;
}

std::map<std::string, ConstBufferRef> Refs(
    const std::map<std::string, HostTensor>& tensors) {
  std::map<std::string, ConstBufferRef> out;
  for (const auto& [fqn, t] : tensors) out[fqn] = t.cref();
  return out;
}

// The gradient of element k of parameter i of unit u on world rank `rank`
// in iteration `iter`: depends on the parameter's current (unsharded)
// value, so a stale or wrong unshard changes it.
float GradValue(int rank, int iter, int u, int i, int64_t k, double param) {
  const int m =
      static_cast<int>((rank * 5 + iter * 3 + u * 7 + i * 2 + k) % 13);
  return static_cast<float>((m - 6) / 16.0 + 0.25 * param);
}

// ---------------------------------------------------------------------------
// Two ways to drive the same program: the runtime, and the handles one by
// one (the reference, with no prefetch and blocking reductions).

class Driver {
 public:
  virtual ~Driver() = default;
  virtual absl::Status PreForward(int u) = 0;
  virtual absl::Status PostForward(int u) = 0;
  virtual absl::Status PreBackward(int u) = 0;
  virtual absl::Status PostBackward(int u) = 0;
  virtual absl::Status Finalize() = 0;
  virtual void SetSync(bool sync) = 0;
  virtual FlatParamHandle& handle(int u) = 0;
  virtual int num_units() const = 0;
  virtual FsdpRuntime* runtime() { return nullptr; }

  Communicator& world() { return *world_; }
  int rank() const { return world_->rank(); }
  // The host waits for the device before reading or writing device memory.
  absl::Status SyncHost() { return ops_->Synchronize(); }
  // Called after every hook.
  std::function<void()> observe = [] {};

 protected:
  Driver(Communicator* world, DeviceOps* ops) : world_(world), ops_(ops) {}

 private:
  Communicator* world_;
  DeviceOps* ops_;
};

class RuntimeDriver final : public Driver {
 public:
  RuntimeDriver(std::unique_ptr<FsdpRuntime> rt, Communicator* world,
                DeviceOps* ops)
      : Driver(world, ops), rt_(std::move(rt)) {}
  absl::Status PreForward(int u) override { return Done(rt_->PreForward(u)); }
  absl::Status PostForward(int u) override { return Done(rt_->PostForward(u)); }
  absl::Status PreBackward(int u) override { return Done(rt_->PreBackward(u)); }
  absl::Status PostBackward(int u) override {
    return Done(rt_->PostBackward(u));
  }
  absl::Status Finalize() override { return Done(rt_->FinalizeBackward()); }
  void SetSync(bool sync) override { rt_->SetRequireGradientSync(sync); }
  FlatParamHandle& handle(int u) override { return rt_->handle(u); }
  int num_units() const override { return rt_->num_units(); }
  FsdpRuntime* runtime() override { return rt_.get(); }

 private:
  absl::Status Done(absl::Status s) {
    observe();
    return s;
  }
  std::unique_ptr<FsdpRuntime> rt_;
};

class DirectDriver final : public Driver {
 public:
  static absl::StatusOr<std::unique_ptr<DirectDriver>> Create(
      const ModelLayout& layout,
      const std::map<std::string, HostTensor>& params, Communicator* world,
      DeviceOps* ops, const HandleOptions& options) {
    auto d = std::unique_ptr<DirectDriver>(new DirectDriver(world, ops));
    Communicator* shard = world;
    if (IsHybridStrategy(layout.options().strategy)) {
      FLATPARAM_ASSIGN_OR_RETURN(
          d->groups_,
          MakeHybridGroups(*world,
                           static_cast<int>(layout.options().world_size)));
      shard = d->groups_.shard.get();
    }
    for (const FlatParamLayout& l : layout.flat_params()) {
      std::vector<ConstBufferRef> refs;
      for (const ParamInfo& p : l.params()) {
        refs.push_back(params.at(p.fqn).cref());
      }
      FLATPARAM_ASSIGN_OR_RETURN(
          std::unique_ptr<FlatParamHandle> h,
          FlatParamHandle::Create(l, refs, shard, d->groups_.replicate.get(),
                                  ops, options));
      d->handles_.push_back(std::move(h));
    }
    return d;
  }
  absl::Status PreForward(int u) override { return h(u).PreForward(); }
  absl::Status PostForward(int u) override {
    return h(u).PostForward(/*is_root=*/u == 0);
  }
  absl::Status PreBackward(int u) override { return h(u).PreBackward(); }
  absl::Status PostBackward(int u) override { return h(u).PostBackward(sync_); }
  absl::Status Finalize() override {
    for (auto& handle : handles_) {
      FLATPARAM_RETURN_IF_ERROR(handle->FinalizeBackward(sync_));
    }
    return absl::OkStatus();
  }
  void SetSync(bool sync) override { sync_ = sync; }
  FlatParamHandle& handle(int u) override { return h(u); }
  int num_units() const override { return static_cast<int>(handles_.size()); }

 private:
  DirectDriver(Communicator* world, DeviceOps* ops) : Driver(world, ops) {}
  FlatParamHandle& h(int u) { return *handles_[u]; }

  HybridGroups groups_;
  std::vector<std::unique_ptr<FlatParamHandle>> handles_;
  bool sync_ = true;
};

struct RunSetup {
  ShardingStrategy strategy = ShardingStrategy::kFullShard;
  bool align = false;
  HandleOptions handle_options;
  // Unset: drive the handles directly.
  std::optional<RuntimeOptions> runtime;
  // Run on FakeCudaDeviceOps (host memory labelled cuda:0) with the world
  // relabelling buffers for the simulator, so the device paths run.
  bool fake_device = false;
  // Run on SimDeviceOps (queued device work on simulated streams, executed
  // in an order drawn from `device_seed`, with the race detector) and
  // StreamCheckedCommunicators; with `separate_streams` the handles get
  // their own unshard and post-backward streams. RunRanks then fails with
  // the detector's reports.
  bool sim_device = false;
  bool separate_streams = false;
  uint64_t device_seed = 0;
};

using Program = std::function<absl::Status(Driver&)>;

absl::Status RunRanks(const RunSetup& setup, const Program& program) {
  FLATPARAM_ASSIGN_OR_RETURN(ModelLayout layout,
                             MakeModel(setup.strategy, setup.align));
  const std::map<std::string, HostTensor> init = InitialTensors(layout.spec());
  SimOptions options;
  options.world_size = kWorld;
  FLATPARAM_ASSIGN_OR_RETURN(std::unique_ptr<SimWorld> world,
                             SimWorld::Create(options));
  return world->Run([&](SimCommunicator& sim) -> absl::Status {
    HostDeviceOps host_ops;
    testing_handle::FakeCudaDeviceOps fake_ops;
    SimDeviceOps sim_ops(SimDeviceOptions{setup.device_seed});
    std::unique_ptr<Communicator> wrapped;
    Communicator* comm = &sim;
    DeviceOps* ops = &host_ops;
    if (setup.fake_device) {
      wrapped = testing_handle::RelabelCudaAsHost(&sim);
      comm = wrapped.get();
      ops = &fake_ops;
    } else if (setup.sim_device) {
      wrapped = std::make_unique<StreamCheckedCommunicator>(&sim, &sim_ops);
      comm = wrapped.get();
      ops = &sim_ops;
    }
    HandleOptions handle_options = setup.handle_options;
    if (setup.separate_streams) {
      FLATPARAM_ASSIGN_OR_RETURN(handle_options.streams.unshard,
                                 ops->NewStream());
      FLATPARAM_ASSIGN_OR_RETURN(handle_options.streams.post_backward,
                                 ops->NewStream());
    }
    absl::Status ran;
    {
      std::unique_ptr<Driver> driver;
      if (setup.runtime.has_value()) {
        FLATPARAM_ASSIGN_OR_RETURN(
            std::unique_ptr<FsdpRuntime> rt,
            FsdpRuntime::CreateFromNamedParams(layout, Refs(init), comm, ops,
                                               handle_options, *setup.runtime));
        driver = std::make_unique<RuntimeDriver>(std::move(rt), comm, ops);
      } else {
        FLATPARAM_ASSIGN_OR_RETURN(
            driver,
            DirectDriver::Create(layout, init, comm, ops, handle_options));
      }
      ran = program(*driver);
    }
    if (!ran.ok() || !setup.sim_device) return ran;
    FLATPARAM_RETURN_IF_ERROR(sim_ops.Synchronize());
    return sim_ops.CheckNoRaces();
  });
}

struct Plan {
  std::set<int> skip_forward;   // layers that do not run at all
  std::set<int> skip_backward;  // layers that run forward only
};

// Reads every parameter of unit u (its unsharded views) into `checksum`.
absl::Status ReadParams(Driver& d, int u, double* checksum) {
  FlatParamHandle& h = d.handle(u);
  for (int i = 0; i < static_cast<int>(h.layout().params().size()); ++i) {
    FLATPARAM_ASSIGN_OR_RETURN(OrigParamView v, h.Param(i));
    FLATPARAM_RETURN_IF_ERROR(d.SyncHost());
    if (v.sharded) {
      return absl::InternalError(absl::StrFormat("unit %d is sharded", u));
    }
    const std::vector<double> values = ReadValues(v.data);
    for (size_t k = 0; k < values.size(); ++k) *checksum += values[k] * (k + 1);
  }
  return absl::OkStatus();
}

absl::Status AddGrads(Driver& d, int u, int iter) {
  FlatParamHandle& h = d.handle(u);
  for (int i = 0; i < static_cast<int>(h.layout().params().size()); ++i) {
    FLATPARAM_ASSIGN_OR_RETURN(OrigParamView v, h.UnshardedParam(i));
    FLATPARAM_RETURN_IF_ERROR(d.SyncHost());
    const std::vector<double> param = ReadValues(v.data);
    std::vector<float> g(param.size());
    for (size_t k = 0; k < g.size(); ++k) {
      g[k] = GradValue(d.rank(), iter, u, i, static_cast<int64_t>(k), param[k]);
    }
    FLATPARAM_RETURN_IF_ERROR(h.AccumulateGrad(
        i, ConstBufferRef{g.data(), static_cast<int64_t>(g.size()),
                          DType::kFloat32, Device::Host()}));
  }
  return absl::OkStatus();
}

// One iteration of a model whose root (unit 0) wraps the layers, as
// refmodel's: the root opens first and closes last in both passes.
absl::Status RunIteration(Driver& d, int iter, const Plan& plan = {},
                          double* checksum = nullptr) {
  double scratch = 0;
  if (checksum == nullptr) checksum = &scratch;
  const int n = d.num_units();
  FLATPARAM_RETURN_IF_ERROR(d.PreForward(0));
  FLATPARAM_RETURN_IF_ERROR(ReadParams(d, 0, checksum));
  for (int u = 1; u < n; ++u) {
    if (plan.skip_forward.count(u)) continue;
    FLATPARAM_RETURN_IF_ERROR(d.PreForward(u));
    FLATPARAM_RETURN_IF_ERROR(ReadParams(d, u, checksum));
    FLATPARAM_RETURN_IF_ERROR(d.PostForward(u));
  }
  FLATPARAM_RETURN_IF_ERROR(d.PostForward(0));
  FLATPARAM_RETURN_IF_ERROR(d.PreBackward(0));
  for (int u = n - 1; u >= 1; --u) {
    if (plan.skip_forward.count(u) || plan.skip_backward.count(u)) continue;
    FLATPARAM_RETURN_IF_ERROR(d.PreBackward(u));
    FLATPARAM_RETURN_IF_ERROR(AddGrads(d, u, iter));
    FLATPARAM_RETURN_IF_ERROR(d.PostBackward(u));
  }
  FLATPARAM_RETURN_IF_ERROR(AddGrads(d, 0, iter));
  FLATPARAM_RETURN_IF_ERROR(d.PostBackward(0));
  return d.Finalize();
}

using Grads = std::vector<std::optional<std::vector<double>>>;

Grads ShardedGrads(Driver& d) {
  EXPECT_THAT(d.SyncHost(), IsOk());
  Grads out;
  for (int u = 0; u < d.num_units(); ++u) {
    const std::optional<BufferRef> g = d.handle(u).sharded_grad();
    out.push_back(g.has_value() ? std::optional(ReadValues(*g)) : std::nullopt);
  }
  return out;
}

std::vector<std::vector<double>> ShardedParams(Driver& d) {
  EXPECT_THAT(d.SyncHost(), IsOk());
  std::vector<std::vector<double>> out;
  for (int u = 0; u < d.num_units(); ++u) {
    out.push_back(ReadValues(d.handle(u).sharded_param()));
  }
  return out;
}

// SGD on every sharded parameter (float32 on the host), then ZeroGrad.
absl::Status Step(Driver& d) {
  FLATPARAM_RETURN_IF_ERROR(d.SyncHost());
  for (int u = 0; u < d.num_units(); ++u) {
    FlatParamHandle& h = d.handle(u);
    const std::optional<BufferRef> g = h.sharded_grad();
    if (!g.has_value()) continue;
    float* p = static_cast<float*>(h.sharded_param().data);
    const float* gv = static_cast<const float*>(g->data);
    for (int64_t k = 0; k < g->count; ++k) p[k] = p[k] - 0.125f * gv[k];
    FLATPARAM_RETURN_IF_ERROR(h.ZeroGrad());
  }
  return absl::OkStatus();
}

struct RankResult {
  std::vector<Grads> grads;  // per iteration, before the step
  std::vector<std::vector<double>> params;
  double checksum = 0;
};

// Runs `iterations` of `plans` (the last plan repeats) with a step after
// each, on every rank.
absl::StatusOr<std::vector<RankResult>> Train(
    const RunSetup& setup, const std::vector<Plan>& plans,
    const std::function<void(Driver&)>& on_start = nullptr,
    const std::vector<bool>& sync = {}) {
  std::vector<RankResult> results(kWorld);
  FLATPARAM_RETURN_IF_ERROR(RunRanks(setup, [&](Driver& d) -> absl::Status {
    if (on_start) on_start(d);
    RankResult& r = results[d.rank()];
    for (size_t iter = 0; iter < plans.size(); ++iter) {
      const bool s = iter < sync.size() ? sync[iter] : true;
      d.SetSync(s);
      FLATPARAM_RETURN_IF_ERROR(
          RunIteration(d, static_cast<int>(iter), plans[iter], &r.checksum));
      if (!s) continue;
      r.grads.push_back(ShardedGrads(d));
      FLATPARAM_RETURN_IF_ERROR(Step(d));
    }
    r.params = ShardedParams(d);
    return absl::OkStatus();
  }));
  return results;
}

void ExpectSameResults(const std::vector<RankResult>& got,
                       const std::vector<RankResult>& want,
                       const std::string& what) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t r = 0; r < got.size(); ++r) {
    EXPECT_EQ(got[r].grads, want[r].grads) << what << " rank " << r;
    EXPECT_EQ(got[r].params, want[r].params) << what << " rank " << r;
    EXPECT_EQ(got[r].checksum, want[r].checksum) << what << " rank " << r;
  }
}

RuntimeOptions Options(bool forward, BackwardPrefetch backward, int depth,
                       int limit) {
  RuntimeOptions o;
  o.forward_prefetch = forward;
  o.backward_prefetch = backward;
  o.prefetch_depth = depth;
  o.limit_all_gathers = limit;
  o.exec_order = ExecOrderCheck::kError;
  return o;
}

std::string Describe(const RuntimeOptions& o) {
  return absl::StrFormat(
      "forward_prefetch=%d backward_prefetch=%s depth=%d "
      "limit=%d",
      o.forward_prefetch, BackwardPrefetchName(o.backward_prefetch),
      o.prefetch_depth, o.limit_all_gathers);
}

const std::vector<RuntimeOptions>& PrefetchConfigs() {
  static const auto* configs = new std::vector<RuntimeOptions>{
      Options(false, BackwardPrefetch::kNone, 1, 0),
      Options(false, BackwardPrefetch::kBackwardPre, 1, 2),
      Options(false, BackwardPrefetch::kBackwardPost, 1, 0),
      Options(true, BackwardPrefetch::kNone, 1, 1),
      Options(true, BackwardPrefetch::kBackwardPre, 2, 1),
      Options(true, BackwardPrefetch::kBackwardPre, 3, 2),
      Options(true, BackwardPrefetch::kBackwardPost, 3, 0),
  };
  return *configs;
}

// ---------------------------------------------------------------------------
// (1) Every prefetch configuration trains bitwise like the handles driven
// one by one, for every strategy, with and without alignment.

class EquivalenceTest
    : public ::testing::TestWithParam<std::tuple<ShardingStrategy, bool>> {};

TEST_P(EquivalenceTest, PrefetchChangesNothingButTheSchedule) {
  const auto [strategy, align] = GetParam();
  RunSetup setup;
  setup.strategy = strategy;
  setup.align = align;
  const std::vector<Plan> plans(3);
  FLATPARAM_ASSERT_OK_AND_ASSIGN(std::vector<RankResult> want,
                                 Train(setup, plans));
  for (const RuntimeOptions& o : PrefetchConfigs()) {
    setup.runtime = o;
    int64_t prefetches = 0;
    std::vector<RuntimeStats> stats(kWorld);
    FLATPARAM_ASSERT_OK_AND_ASSIGN(
        std::vector<RankResult> got, Train(setup, plans, [&](Driver& d) {
          FsdpRuntime* rt = d.runtime();
          const int rank = d.rank();
          d.observe = [rt, rank, &stats] { stats[rank] = rt->stats(); };
        }));
    ExpectSameResults(
        got, want,
        absl::StrCat(ShardingStrategyName(strategy), " ", Describe(o)));
    for (const RuntimeStats& s : stats) {
      EXPECT_EQ(s.iterations, 3);
      EXPECT_EQ(s.exec_order_deviations, 0);
      prefetches += s.prefetches;
    }
    // The configuration did prefetch (NO_SHARD's unshards are view switches,
    // prefetched all the same).
    const bool any =
        o.forward_prefetch || o.backward_prefetch != BackwardPrefetch::kNone;
    EXPECT_EQ(prefetches > 0, any) << Describe(o);
  }
}

INSTANTIATE_TEST_SUITE_P(AllStrategies, EquivalenceTest,
                         ::testing::Combine(::testing::ValuesIn(kAllStrategies),
                                            ::testing::Bool()),
                         [](const auto& info) {
                           return absl::StrCat(
                               ShardingStrategyName(std::get<0>(info.param)),
                               std::get<1>(info.param) ? "_aligned" : "");
                         });

// Mixed precision and CPU offload pass through to the handles unchanged.
TEST(MixedPrecisionTest, OffloadAndBFloat16MatchTheHandles) {
  for (ShardingStrategy strategy :
       {ShardingStrategy::kFullShard, ShardingStrategy::kNoShard,
        ShardingStrategy::kHybridShardZero2}) {
    RunSetup setup;
    setup.strategy = strategy;
    setup.handle_options.param_dtype = DType::kBFloat16;
    setup.handle_options.cpu_offload = true;
    const std::vector<Plan> plans(2);
    FLATPARAM_ASSERT_OK_AND_ASSIGN(std::vector<RankResult> want,
                                   Train(setup, plans));
    setup.runtime = Options(true, BackwardPrefetch::kBackwardPre, 2, 1);
    FLATPARAM_ASSERT_OK_AND_ASSIGN(std::vector<RankResult> got,
                                   Train(setup, plans));
    ExpectSameResults(got, want, std::string(ShardingStrategyName(strategy)));
  }
}

// On a (fake) device the runtime computes what it computes on the host,
// clipping included (its all-reduce stages the norm on the device).
TEST(DeviceTest, FakeDeviceMatchesTheHost) {
  for (ShardingStrategy strategy :
       {ShardingStrategy::kFullShard, ShardingStrategy::kNoShard,
        ShardingStrategy::kHybridShard}) {
    std::vector<std::vector<double>> norms(2, std::vector<double>(kWorld));
    std::vector<std::vector<RankResult>> results;
    for (bool fake : {false, true}) {
      RunSetup setup;
      setup.strategy = strategy;
      setup.fake_device = fake;
      setup.runtime = Options(true, BackwardPrefetch::kBackwardPost, 2, 0);
      std::vector<RankResult> out(kWorld);
      ASSERT_THAT(RunRanks(setup,
                           [&](Driver& d) -> absl::Status {
                             RankResult& r = out[d.rank()];
                             for (int iter = 0; iter < 2; ++iter) {
                               FLATPARAM_RETURN_IF_ERROR(
                                   RunIteration(d, iter, {}, &r.checksum));
                               FLATPARAM_ASSIGN_OR_RETURN(
                                   norms[fake][d.rank()],
                                   d.runtime()->ClipGradNorm(0.25));
                               r.grads.push_back(ShardedGrads(d));
                               FLATPARAM_RETURN_IF_ERROR(Step(d));
                             }
                             r.params = ShardedParams(d);
                             return absl::OkStatus();
                           }),
                  IsOk());
      results.push_back(std::move(out));
    }
    ExpectSameResults(results[1], results[0],
                      std::string(ShardingStrategyName(strategy)));
    EXPECT_EQ(norms[1], norms[0]);
    EXPECT_GT(norms[0][0], 0.25);  // it clipped
  }
}

// On the simulated device with three streams per handle, prefetching
// (all-gathers started while the compute stream still works), overlapped
// reductions and clipping are race-free for every device execution order
// tried and compute what the host computes.
TEST(DeviceTest, StreamsAreRaceFreeAndMatchTheHost) {
  for (ShardingStrategy strategy :
       {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp,
        ShardingStrategy::kHybridShard}) {
    for (const RuntimeOptions& o :
         {Options(true, BackwardPrefetch::kBackwardPre, 2, 2),
          Options(true, BackwardPrefetch::kBackwardPost, 3, 0)}) {
      std::vector<std::vector<RankResult>> results;
      std::vector<std::vector<double>> norms;
      for (int device : {0, 1, 2}) {  // host, sim seed 1, sim seed 2
        RunSetup setup;
        setup.strategy = strategy;
        setup.runtime = o;
        setup.sim_device = device > 0;
        setup.separate_streams = device > 0;
        setup.device_seed = device;
        std::vector<RankResult> out(kWorld);
        std::vector<double> norm(kWorld);
        ASSERT_THAT(RunRanks(setup,
                             [&](Driver& d) -> absl::Status {
                               RankResult& r = out[d.rank()];
                               for (int iter = 0; iter < 3; ++iter) {
                                 FLATPARAM_RETURN_IF_ERROR(
                                     RunIteration(d, iter, {}, &r.checksum));
                                 FLATPARAM_ASSIGN_OR_RETURN(
                                     norm[d.rank()],
                                     d.runtime()->ClipGradNorm(0.5));
                                 r.grads.push_back(ShardedGrads(d));
                                 FLATPARAM_RETURN_IF_ERROR(Step(d));
                               }
                               r.params = ShardedParams(d);
                               return absl::OkStatus();
                             }),
                    IsOk())
            << ShardingStrategyName(strategy) << " " << Describe(o)
            << " device " << device;
        results.push_back(std::move(out));
        norms.push_back(norm);
      }
      for (int device : {1, 2}) {
        ExpectSameResults(
            results[device], results[0],
            absl::StrCat(ShardingStrategyName(strategy), " ", Describe(o)));
        EXPECT_EQ(norms[device], norms[0]);
      }
    }
  }
}

// ---------------------------------------------------------------------------
// (2) limit_all_gathers bounds the prefetched all-gathers in flight, and the
// peak unsharded-parameter memory follows from it.
//
// With the root (R bytes padded unsharded) kept unsharded from its forward
// through its backward, L = 3 equal layers (P bytes each) freed after their
// forward and backward (FULL_SHARD, HYBRID_SHARD), and k = min(depth,
// limit) prefetches ahead (limit 0: depth):
//   forward with forward_prefetch: PreForward(i) holds layer i and the next
//     min(k, L - i) layers: R + min(1 + k, L) P at PreForward(layer 0);
//   BACKWARD_PRE: the same in the backward: R + min(1 + k, L) P;
//   BACKWARD_POST: PostBackward(i) frees i before prefetching, so at most k
//     layers and at most L - 1 (the last layer is gathered on demand):
//     R + max(1, min(k, L - 1)) P;
//   no prefetch: R + P.
// PyTorch's limit_all_gathers=True is limit 2: with depth >= 2, three
// layers' unsharded parameters at once.

struct LimitCase {
  ShardingStrategy strategy;
  bool forward;
  BackwardPrefetch backward;
  int depth;
  int limit;
};

class LimitTest : public ::testing::TestWithParam<LimitCase> {};

TEST_P(LimitTest, InFlightAndPeakMemoryFollowTheFormula) {
  const LimitCase c = GetParam();
  RunSetup setup;
  setup.strategy = c.strategy;
  setup.runtime = Options(c.forward, c.backward, c.depth, c.limit);
  FLATPARAM_ASSERT_OK_AND_ASSIGN(ModelLayout layout,
                                 MakeModel(c.strategy, false));
  const int64_t R = layout.flat_params()[0].padded_unsharded_numel() * 4;
  const int64_t P = layout.flat_params()[1].padded_unsharded_numel() * 4;
  ASSERT_EQ(P, layout.flat_params()[3].padded_unsharded_numel() * 4);
  const int L = 3;
  const int k = c.limit == 0 ? c.depth : std::min(c.depth, c.limit);
  int64_t layers = 1;
  if (c.forward) layers = std::max<int64_t>(layers, std::min(1 + k, L));
  if (c.backward == BackwardPrefetch::kBackwardPre) {
    layers = std::max<int64_t>(layers, std::min(1 + k, L));
  }
  if (c.backward == BackwardPrefetch::kBackwardPost) {
    layers = std::max<int64_t>(layers, std::max(1, std::min(k, L - 1)));
  }
  const int64_t want_peak = R + layers * P;
  int want_in_flight = 0;
  if (c.forward) want_in_flight = std::min(k, L);
  if (c.backward == BackwardPrefetch::kBackwardPre) {
    want_in_flight = std::max(want_in_flight, std::min(k, L));
  }
  if (c.backward == BackwardPrefetch::kBackwardPost) {
    want_in_flight = std::max(want_in_flight, std::min(k, L - 1));
  }

  std::vector<int> max_seen(kWorld, 0);
  std::vector<MemoryStats> memory(kWorld);
  std::vector<RuntimeStats> stats(kWorld);
  ASSERT_THAT(
      RunRanks(setup,
               [&](Driver& d) -> absl::Status {
                 FsdpRuntime& rt = *d.runtime();
                 const int rank = d.rank();
                 d.observe = [&, rank] {
                   // Prefetched and not consumed: IDLE, unsharded or pending.
                   int n = 0;
                   for (int u = 1; u < rt.num_units(); ++u) {
                     const FlatParamHandle& h = rt.handle(u);
                     if (h.training_state() == HandleTrainingState::kIdle &&
                         (h.unshard_pending() || h.is_unsharded())) {
                       ++n;
                     }
                   }
                   max_seen[rank] = std::max(max_seen[rank], n);
                 };
                 for (int iter = 0; iter < 3; ++iter) {
                   FLATPARAM_RETURN_IF_ERROR(RunIteration(d, iter));
                   FLATPARAM_RETURN_IF_ERROR(Step(d));
                 }
                 memory[rank] = rt.memory();
                 stats[rank] = rt.stats();
                 return absl::OkStatus();
               }),
      IsOk());
  for (int r = 0; r < kWorld; ++r) {
    if (c.limit > 0) {
      EXPECT_LE(max_seen[r], c.limit) << "rank " << r;
    }
    EXPECT_EQ(max_seen[r], want_in_flight) << "rank " << r;
    EXPECT_EQ(stats[r].max_all_gathers_in_flight, want_in_flight);
    EXPECT_EQ(memory[r].peak_bytes(MemoryCategory::kUnshardedParams), want_peak)
        << "rank " << r << ": R=" << R << " P=" << P;
    EXPECT_EQ(memory[r].current_bytes(MemoryCategory::kUnshardedParams), 0);
    // Unsharded gradients (float32, padded like the parameters): the root's
    // for the whole backward, plus one layer's reduction in flight while
    // the next layer's backward runs.
    EXPECT_EQ(memory[r].peak_bytes(MemoryCategory::kUnshardedGrads), R + 2 * P)
        << "rank " << r;
    // The limit binds when more units are in reach than it allows.
    const int reach =
        c.forward || c.backward == BackwardPrefetch::kBackwardPre ? L : L - 1;
    EXPECT_EQ(stats[r].prefetches_over_limit > 0,
              c.limit > 0 && std::min(c.depth, reach) > c.limit);
  }
}

std::vector<LimitCase> LimitCases() {
  std::vector<LimitCase> out;
  for (ShardingStrategy s :
       {ShardingStrategy::kFullShard, ShardingStrategy::kHybridShard}) {
    out.push_back({s, false, BackwardPrefetch::kNone, 1, 0});
    for (int limit : {1, 2, 0}) {
      out.push_back({s, true, BackwardPrefetch::kBackwardPre, 3, limit});
      out.push_back({s, false, BackwardPrefetch::kBackwardPost, 3, limit});
      out.push_back({s, true, BackwardPrefetch::kNone, 2, limit});
    }
    out.push_back({s, true, BackwardPrefetch::kBackwardPre, 1, 0});
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Limits, LimitTest, ::testing::ValuesIn(LimitCases()),
                         [](const auto& info) {
                           const LimitCase& c = info.param;
                           return absl::StrFormat(
                               "%s_%s%s_depth%d_limit%d",
                               ShardingStrategyName(c.strategy),
                               c.forward ? "fwd_" : "",
                               BackwardPrefetchName(c.backward), c.depth,
                               c.limit);
                         });

// ---------------------------------------------------------------------------
// (3) Conditional computation: FinalizeBackward finalizes units that took no
// part in the backward (or the forward), including mistargeted prefetches.

// PyTorch's rate limiter on a device that runs behind the host: with
// stream-ordered collectives (a simulated NCCL) the host never waits for
// a collective, so in the forward it would race ahead; limit_all_gathers =
// L makes it wait, before each all-gather, for the free L frees back.
// Every unit's forward kernel lasts 10 us (the root's in two halves around
// the layers) and collectives 1 us, so unlimited, layer k's forward ends at
// 16 + 10 (k - 1) us. With L = 2 the host issues layer 3's all-gather once
// layer 1 is freed (16 us); with L = 1 it issues layer 2's then (which
// delays layer 2's forward to [17, 27] us) and layer 3's once layer 2 is
// freed (27 us); without a limit it never waits.
TEST(RateLimitTest, TheHostWaitsForTheFreeLimitFreesBack) {
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      ModelLayout layout, MakeModel(ShardingStrategy::kFullShard, false));
  const std::map<std::string, HostTensor> init = InitialTensors(layout.spec());
  for (int limit : {0, 1, 2}) {
    SimOptions options;
    options.world_size = kWorld;
    options.cost.latency = absl::Microseconds(1);
    options.cost.bytes_per_second = 1e18;
    FLATPARAM_ASSERT_OK_AND_ASSIGN(std::unique_ptr<SimWorld> world,
                                   SimWorld::Create(options));
    std::vector<std::vector<absl::Duration>> issued(kWorld);
    ASSERT_THAT(world->Run([&](SimCommunicator& sim) -> absl::Status {
      SimRankClock clock(&sim);
      SimDeviceOptions device_options;
      device_options.host_clock = &clock;
      SimDeviceOps ops(device_options);
      StreamCheckedCommunicator comm(&sim, &ops, /*stream_ordered=*/true);
      HandleOptions handle_options;
      FLATPARAM_ASSIGN_OR_RETURN(handle_options.streams.unshard,
                                 ops.NewStream());
      FLATPARAM_ASSIGN_OR_RETURN(handle_options.streams.post_backward,
                                 ops.NewStream());
      RuntimeOptions runtime_options;
      runtime_options.limit_all_gathers = limit;
      {
        FLATPARAM_ASSIGN_OR_RETURN(std::unique_ptr<FsdpRuntime> rt,
                                   FsdpRuntime::CreateFromNamedParams(
                                       layout, Refs(init), &comm, &ops,
                                       handle_options, runtime_options));
        const std::vector<absl::Duration> forward(rt->num_units(),
                                                  absl::Microseconds(10));
        FLATPARAM_RETURN_IF_ERROR(refmodel::RunSyntheticStep(
            *rt, forward,
            [&](const refmodel::KernelCall& call) -> absl::Status {
              if (!call.backward &&
                  call.name.find("after") == std::string::npos) {
                issued[sim.rank()].push_back(sim.Now());
              }
              return ops.Kernel(call.name,
                                {*call.handle->unsharded_flat_param()}, {},
                                call.duration);
            }));
      }
      FLATPARAM_RETURN_IF_ERROR(ops.Synchronize());
      return ops.CheckNoRaces();
    }),
                IsOk());
    const auto us = [](int64_t n) { return absl::Microseconds(n); };
    const std::vector<absl::Duration> want =
        limit == 0   ? std::vector<absl::Duration>{us(0), us(0), us(0), us(0)}
        : limit == 1 ? std::vector<absl::Duration>{us(0), us(0), us(16), us(27)}
                     : std::vector<absl::Duration>{us(0), us(0), us(0), us(16)};
    for (int r = 0; r < kWorld; ++r) {
      EXPECT_EQ(issued[r], want) << "limit " << limit << " rank " << r;
    }
  }
}

TEST(ConditionalTest, SkippedUnitsAreFinalizedAndResharded) {
  // Iteration 2 skips layer 2 (unit 2)'s backward and layer 3 entirely.
  // With forward prefetch, PreForward(2) prefetches unit 3, which never
  // runs; BACKWARD_PRE at the root prefetches unit 2, whose backward never
  // runs.
  const std::vector<Plan> plans = {Plan{}, Plan{{3}, {2}}, Plan{}};
  for (ShardingStrategy strategy : kAllStrategies) {
    RunSetup setup;
    setup.strategy = strategy;
    FLATPARAM_ASSERT_OK_AND_ASSIGN(std::vector<RankResult> want,
                                   Train(setup, plans));
    RuntimeOptions o = Options(true, BackwardPrefetch::kBackwardPre, 1, 2);
    o.exec_order = ExecOrderCheck::kIgnore;
    setup.runtime = o;
    std::vector<RankResult> got(kWorld);
    ASSERT_THAT(
        RunRanks(
            setup,
            [&](Driver& d) -> absl::Status {
              FsdpRuntime& rt = *d.runtime();
              RankResult& r = got[d.rank()];
              for (int iter = 0; iter < 3; ++iter) {
                FLATPARAM_RETURN_IF_ERROR(
                    RunIteration(d, iter, plans[iter], &r.checksum));
                if (iter == 1) {
                  for (int u = 0; u < rt.num_units(); ++u) {
                    const FlatParamHandle& h = rt.handle(u);
                    EXPECT_EQ(h.training_state(), HandleTrainingState::kIdle);
                    EXPECT_FALSE(h.is_unsharded()) << "unit " << u;
                    EXPECT_FALSE(h.unshard_pending()) << "unit " << u;
                    EXPECT_FALSE(h.reduce_pending()) << "unit " << u;
                  }
                  // The skipped units' gradients stay None (ZeroGrad set
                  // them to None after iteration 1).
                  EXPECT_EQ(rt.handle(2).sharded_grad(), std::nullopt);
                  EXPECT_EQ(rt.handle(3).sharded_grad(), std::nullopt);
                  EXPECT_NE(rt.handle(1).sharded_grad(), std::nullopt);
                  const MemoryStats m = rt.memory();
                  EXPECT_EQ(m.current_bytes(MemoryCategory::kUnshardedParams),
                            0);
                  EXPECT_EQ(m.current_bytes(MemoryCategory::kUnshardedGrads),
                            0);
                  if (UsesShardedStrategy(strategy)) {
                    // Both mistargeted prefetches all-gathered.
                    EXPECT_GE(rt.stats().prefetched_all_gathers, 2);
                  }
                }
                r.grads.push_back(ShardedGrads(d));
                FLATPARAM_RETURN_IF_ERROR(Step(d));
              }
              r.params = ShardedParams(d);
              return absl::OkStatus();
            }),
        IsOk());
    ExpectSameResults(got, want, std::string(ShardingStrategyName(strategy)));
  }
}

// ---------------------------------------------------------------------------
// (4) no_sync: the first micro-batch accumulates unsharded without
// communicating; the result equals the handles' no_sync accumulation.

TEST(NoSyncTest, AccumulatesLikeTheHandles) {
  for (ShardingStrategy strategy : kAllStrategies) {
    RunSetup setup;
    setup.strategy = strategy;
    const std::vector<Plan> plans(3);
    // Micro-batches 0 and 1 make step 1, micro-batch 2 step 2.
    const std::vector<bool> sync = {false, true, true};
    FLATPARAM_ASSERT_OK_AND_ASSIGN(std::vector<RankResult> want,
                                   Train(setup, plans, nullptr, sync));
    setup.runtime = RuntimeOptions();
    std::vector<RankResult> got(kWorld);
    ASSERT_THAT(
        RunRanks(
            setup,
            [&](Driver& d) -> absl::Status {
              FsdpRuntime& rt = *d.runtime();
              RankResult& r = got[d.rank()];
              {
                FsdpRuntime::NoSyncScope no_sync = rt.NoSync();
                EXPECT_FALSE(rt.require_gradient_sync());
                FLATPARAM_RETURN_IF_ERROR(RunIteration(d, 0, {}, &r.checksum));
              }
              EXPECT_TRUE(rt.require_gradient_sync());
              EXPECT_EQ(rt.comm_stats().reduce_scatter.calls, 0);
              EXPECT_EQ(rt.comm_stats().all_reduce.calls, 0);
              for (int u = 0; u < rt.num_units(); ++u) {
                EXPECT_NE(rt.handle(u).unsharded_grad(), std::nullopt);
                EXPECT_EQ(rt.handle(u).sharded_grad(), std::nullopt);
              }
              for (int iter = 1; iter < 3; ++iter) {
                FLATPARAM_RETURN_IF_ERROR(
                    RunIteration(d, iter, {}, &r.checksum));
                r.grads.push_back(ShardedGrads(d));
                FLATPARAM_RETURN_IF_ERROR(Step(d));
              }
              // One reduction per unit per synchronized iteration.
              const CommStats& c = rt.comm_stats();
              EXPECT_EQ(UsesShardedStrategy(strategy) ? c.reduce_scatter.calls
                                                      : c.all_reduce.calls,
                        2 * rt.num_units());
              r.params = ShardedParams(d);
              return absl::OkStatus();
            }),
        IsOk());
    ExpectSameResults(got, want, std::string(ShardingStrategyName(strategy)));
  }
}

// The setting in force when an iteration begins holds for all of it.
TEST(NoSyncTest, SettingChangesTakeEffectAtTheNextIteration) {
  RunSetup setup;
  setup.runtime = RuntimeOptions();
  ASSERT_THAT(RunRanks(setup,
                       [&](Driver& d) -> absl::Status {
                         FsdpRuntime& rt = *d.runtime();
                         FLATPARAM_RETURN_IF_ERROR(rt.PreForward(0));
                         rt.SetRequireGradientSync(false);
                         FLATPARAM_RETURN_IF_ERROR(rt.PostForward(0));
                         FLATPARAM_RETURN_IF_ERROR(rt.PreBackward(0));
                         FLATPARAM_RETURN_IF_ERROR(AddGrads(d, 0, 0));
                         FLATPARAM_RETURN_IF_ERROR(rt.PostBackward(0));
                         FLATPARAM_RETURN_IF_ERROR(rt.FinalizeBackward());
                         EXPECT_NE(rt.handle(0).sharded_grad(), std::nullopt);
                         EXPECT_EQ(rt.comm_stats().reduce_scatter.calls, 1);
                         return absl::OkStatus();
                       }),
              IsOk());
}

// ---------------------------------------------------------------------------
// (5) ClipGradNorm against the norm of the full gradients in double.

struct ClipCase {
  ShardingStrategy strategy;
  bool align;
  double norm_type;
};

class ClipTest : public ::testing::TestWithParam<ClipCase> {};

// The p-norm of all elements of `full`, in double.
double FullNorm(const std::vector<std::vector<double>>& full, double p) {
  double acc = 0;
  for (const auto& v : full) {
    for (double x : v) {
      acc = std::isinf(p) ? std::max(acc, std::fabs(x))
                          : acc + std::pow(std::fabs(x), p);
    }
  }
  return std::isinf(p) ? acc : std::pow(acc, 1.0 / p);
}

TEST_P(ClipTest, MatchesTheFullGradientNorm) {
  const ClipCase c = GetParam();
  RunSetup setup;
  setup.strategy = c.strategy;
  setup.align = c.align;
  setup.runtime = RuntimeOptions();
  const int shard_size = ShardSize(c.strategy);
  const bool sharded = UsesShardedStrategy(c.strategy);
  // Each rank's sharded gradients per unit, before clipping.
  std::vector<std::vector<std::vector<double>>> shards(kWorld);
  ASSERT_THAT(
      RunRanks(
          setup,
          [&](Driver& d) -> absl::Status {
            FsdpRuntime& rt = *d.runtime();
            const int rank = d.rank();
            FLATPARAM_RETURN_IF_ERROR(RunIteration(d, 0));
            for (int u = 0; u < rt.num_units(); ++u) {
              shards[rank].push_back(ReadValues(*rt.handle(u).sharded_grad()));
            }
            FLATPARAM_RETURN_IF_ERROR(d.world().Barrier({}));
            // The full (padded) flat gradients: the shards of node 0's
            // ranks in order (every replica holds the same), or rank 0's
            // whole gradient for NO_SHARD.
            std::vector<std::vector<double>> full;
            for (int u = 0; u < rt.num_units(); ++u) {
              std::vector<double>& f = full.emplace_back();
              for (int s = 0; s < (sharded ? shard_size : 1); ++s) {
                f.insert(f.end(), shards[s][u].begin(), shards[s][u].end());
              }
            }
            const double want = FullNorm(full, c.norm_type);
            // No clipping: a huge max_norm leaves every gradient as it was.
            const int64_t all_reduces = rt.comm_stats().all_reduce.calls;
            FLATPARAM_ASSIGN_OR_RETURN(double norm,
                                       rt.ClipGradNorm(1e30, c.norm_type));
            EXPECT_EQ(rt.comm_stats().all_reduce.calls - all_reduces,
                      sharded ? 1 : 0);
            EXPECT_NEAR(norm, want, 1e-5 * want);
            for (int u = 0; u < rt.num_units(); ++u) {
              EXPECT_EQ(ReadValues(*rt.handle(u).sharded_grad()),
                        shards[rank][u]);
            }
            // Clipping to half the norm halves every gradient.
            const double max_norm = want / 2;
            FLATPARAM_ASSIGN_OR_RETURN(norm,
                                       rt.ClipGradNorm(max_norm, c.norm_type));
            EXPECT_NEAR(norm, want, 1e-5 * want);
            const double coef = max_norm / (want + 1e-6);
            for (int u = 0; u < rt.num_units(); ++u) {
              const std::vector<double> got =
                  ReadValues(*rt.handle(u).sharded_grad());
              for (size_t k = 0; k < got.size(); ++k) {
                const double expect = shards[rank][u][k] * coef;
                EXPECT_NEAR(got[k], expect, 1e-5 * std::fabs(expect) + 1e-9)
                    << "rank " << rank << " unit " << u << " element " << k;
              }
            }
            return absl::OkStatus();
          }),
      IsOk());
}

std::vector<ClipCase> ClipCases() {
  std::vector<ClipCase> out;
  for (ShardingStrategy s : kAllStrategies) {
    // 0.5 and 0.25: clip_grad_norm_ takes any positive norm_type (below 1
    // it is not a norm, but the same formula).
    for (double p :
         {2.0, 1.0, std::numeric_limits<double>::infinity(), 3.0, 0.5, 0.25}) {
      out.push_back({s, false, p});
    }
    out.push_back({s, true, 2.0});
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Norms, ClipTest, ::testing::ValuesIn(ClipCases()),
                         [](const auto& info) {
                           const ClipCase& c = info.param;
                           return absl::StrFormat(
                               "%s%s_p%s", ShardingStrategyName(c.strategy),
                               c.align ? "_aligned" : "",
                               std::isinf(c.norm_type)
                                   ? "inf"
                                   : absl::StrReplaceAll(
                                         absl::StrFormat("%g", c.norm_type),
                                         {{".", "_"}}));
                         });

// Parameters whose gradient is None are skipped; the others are clipped.
TEST(ClipGradNormTest, SkipsNoneGradients) {
  RunSetup setup;
  setup.align = true;
  setup.runtime = RuntimeOptions();
  ASSERT_THAT(
      RunRanks(
          setup,
          [&](Driver& d) -> absl::Status {
            FsdpRuntime& rt = *d.runtime();
            FLATPARAM_RETURN_IF_ERROR(RunIteration(d, 0));
            // Only unit 1's parameters keep a gradient.
            for (int u : {0, 2, 3}) {
              FLATPARAM_RETURN_IF_ERROR(rt.handle(u).ZeroGrad());
            }
            FLATPARAM_ASSIGN_OR_RETURN(ParamLocation b, rt.Find("layers.0.b"));
            FLATPARAM_RETURN_IF_ERROR(rt.handle(b.unit).SetGradNone(b.index));
            FLATPARAM_ASSIGN_OR_RETURN(double norm, rt.ClipGradNorm(1e30));
            // The local part of layers.0.w only, summed over ranks.
            double local = 0;
            FLATPARAM_ASSIGN_OR_RETURN(std::optional<BufferRef> w,
                                       rt.ShardedGradView("layers.0.w"));
            if (w.has_value()) {
              for (double x : ReadValues(*w)) local += x * x;
            }
            std::vector<float> sum = {static_cast<float>(local)};
            const BufferRef buf{sum.data(), 1, DType::kFloat32, Device::Host()};
            FLATPARAM_RETURN_IF_ERROR(
                d.world().AllReduce(buf, buf, {})->Wait());
            EXPECT_NEAR(norm, std::sqrt(sum[0]), 1e-5 * norm);
            EXPECT_GT(norm, 0);
            return absl::OkStatus();
          }),
      IsOk());
}

// keep_low_precision_grads: the gradients are bfloat16; the norm is taken
// in float32 and the coefficient rounded to bfloat16 before multiplying.
TEST(ClipGradNormTest, LowPrecisionGradients) {
  RunSetup setup;
  setup.handle_options.param_dtype = DType::kBFloat16;
  setup.handle_options.keep_low_precision_grads = true;
  setup.runtime = RuntimeOptions();
  std::vector<std::vector<std::vector<double>>> shards(kWorld);
  ASSERT_THAT(RunRanks(setup,
                       [&](Driver& d) -> absl::Status {
                         FsdpRuntime& rt = *d.runtime();
                         const int rank = d.rank();
                         FLATPARAM_RETURN_IF_ERROR(RunIteration(d, 0));
                         for (int u = 0; u < rt.num_units(); ++u) {
                           const BufferRef g = *rt.handle(u).sharded_grad();
                           EXPECT_EQ(g.dtype, DType::kBFloat16);
                           shards[rank].push_back(ReadValues(g));
                         }
                         FLATPARAM_RETURN_IF_ERROR(d.world().Barrier({}));
                         std::vector<std::vector<double>> full;
                         for (int s = 0; s < kWorld; ++s) {
                           for (const auto& v : shards[s]) full.push_back(v);
                         }
                         const double want = FullNorm(full, 2.0);
                         FLATPARAM_ASSIGN_OR_RETURN(double norm,
                                                    rt.ClipGradNorm(want / 4));
                         EXPECT_NEAR(norm, want, 1e-5 * want);
                         for (int u = 0; u < rt.num_units(); ++u) {
                           const std::vector<double> got =
                               ReadValues(*rt.handle(u).sharded_grad());
                           for (size_t k = 0; k < got.size(); ++k) {
                             const double expect = shards[rank][u][k] / 4;
                             EXPECT_NEAR(got[k], expect,
                                         std::fabs(expect) / 64);
                           }
                         }
                         return absl::OkStatus();
                       }),
              IsOk());
}

// ---------------------------------------------------------------------------
// (6) Parameters by name.

TEST(FindTest, ResolvesNamesAndTiesAndReportsUnknownOnes) {
  RunSetup setup;
  setup.runtime = RuntimeOptions();
  ASSERT_THAT(
      RunRanks(
          setup,
          [&](Driver& d) -> absl::Status {
            FsdpRuntime& rt = *d.runtime();
            EXPECT_EQ(rt.num_units(), 4);
            EXPECT_EQ(rt.root_unit(), std::optional<int>(0));
            EXPECT_THAT(rt.FindUnit("layers.1"), IsOkAndHolds(2));
            EXPECT_THAT(rt.FindUnit("layers.9"),
                        StatusIs(absl::StatusCode::kNotFound,
                                 HasSubstr("\"layers.9\"")));
            FLATPARAM_ASSIGN_OR_RETURN(ParamLocation l, rt.Find("layers.1.b"));
            EXPECT_EQ(l.unit, 2);
            EXPECT_EQ(l.index, 1);
            EXPECT_FALSE(l.shared);
            FLATPARAM_ASSIGN_OR_RETURN(ParamLocation tied, rt.Find("head.w"));
            FLATPARAM_ASSIGN_OR_RETURN(ParamLocation prim, rt.Find("embed.w"));
            EXPECT_TRUE(tied.shared);
            EXPECT_EQ(tied.unit, prim.unit);
            EXPECT_EQ(tied.index, prim.index);
            EXPECT_THAT(rt.Find("layers.1"),
                        StatusIs(absl::StatusCode::kNotFound,
                                 AllOf(HasSubstr("\"layers.1\""),
                                       HasSubstr("\"tiny\""))));
            EXPECT_THAT(rt.Param("nope"),
                        StatusIs(absl::StatusCode::kNotFound));
            EXPECT_THAT(rt.GradView("nope"),
                        StatusIs(absl::StatusCode::kNotFound));
            EXPECT_THAT(rt.ShardedGradView("nope"),
                        StatusIs(absl::StatusCode::kNotFound));
            EXPECT_THAT(rt.AccumulateGrad("nope", {}),
                        StatusIs(absl::StatusCode::kNotFound));

            // Sharded views outside the forward; the tied name's view is
            // the primary's.
            FLATPARAM_ASSIGN_OR_RETURN(OrigParamView v, rt.Param("head.w"));
            EXPECT_TRUE(v.sharded);
            FLATPARAM_RETURN_IF_ERROR(rt.PreForward(0));
            FLATPARAM_ASSIGN_OR_RETURN(v, rt.Param("head.w"));
            FLATPARAM_ASSIGN_OR_RETURN(OrigParamView e, rt.Param("embed.w"));
            EXPECT_FALSE(v.sharded);
            EXPECT_EQ(v.data.data, e.data.data);
            EXPECT_EQ(v.shape, (std::vector<int64_t>{5, 3}));
            // No gradient view outside the backward.
            EXPECT_THAT(rt.GradView("embed.w"),
                        StatusIs(absl::StatusCode::kFailedPrecondition));
            FLATPARAM_RETURN_IF_ERROR(rt.PostForward(0));
            FLATPARAM_RETURN_IF_ERROR(rt.PreBackward(0));
            FLATPARAM_ASSIGN_OR_RETURN(BufferRef g, rt.GradView("head.b"));
            EXPECT_EQ(g.count, 5);
            std::vector<float> ones(5, 1.0f);
            FLATPARAM_RETURN_IF_ERROR(rt.AccumulateGrad(
                "head.b", ConstBufferRef{ones.data(), 5, DType::kFloat32,
                                         Device::Host()}));
            EXPECT_EQ(ReadValues(g), std::vector<double>(5, 1.0));
            FLATPARAM_RETURN_IF_ERROR(rt.PostBackward(0));
            FLATPARAM_RETURN_IF_ERROR(rt.FinalizeBackward());
            // Each rank's part of head.b: 4 ranks x 1.0 / 4.
            FLATPARAM_ASSIGN_OR_RETURN(std::optional<BufferRef> s,
                                       rt.ShardedGradView("head.b"));
            if (s.has_value()) {
              EXPECT_EQ(ReadValues(*s), std::vector<double>(s->count, 1.0));
            }
            return absl::OkStatus();
          }),
      IsOk());
}

// ---------------------------------------------------------------------------
// (7) Errors.

TEST(CreateTest, RejectsBadArguments) {
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      ModelLayout layout, MakeModel(ShardingStrategy::kFullShard, false));
  const std::map<std::string, HostTensor> init = InitialTensors(layout.spec());
  SimOptions so;
  so.world_size = 2;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(std::unique_ptr<SimWorld> world,
                                 SimWorld::Create(so));
  ASSERT_THAT(world->Run([&](SimCommunicator& comm) -> absl::Status {
    HostDeviceOps ops;
    auto refs = Refs(init);
    EXPECT_THAT(
        FsdpRuntime::CreateFromNamedParams(layout, refs, nullptr, &ops),
        StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("required")));
    EXPECT_THAT(FsdpRuntime::CreateUnitByUnit(
                    std::shared_ptr<const ModelLayout>(),
                    [](int) -> absl::StatusOr<std::vector<ConstBufferRef>> {
                      return std::vector<ConstBufferRef>();
                    },
                    nullptr, &comm, &ops),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("the layout is null")));
    EXPECT_THAT(
        FsdpRuntime::CreateFromNamedParams(layout, refs, &comm, &ops),
        StatusIs(absl::StatusCode::kInvalidArgument,
                 AllOf(HasSubstr("4 ranks"), HasSubstr("has 2 ranks"))));
    RuntimeOptions bad;
    bad.prefetch_depth = 0;
    EXPECT_THAT(
        FsdpRuntime::CreateFromNamedParams(layout, refs, &comm, &ops, {}, bad),
        StatusIs(absl::StatusCode::kInvalidArgument,
                 HasSubstr("prefetch_depth must be >= 1, got 0")));
    bad = RuntimeOptions();
    bad.limit_all_gathers = -1;
    EXPECT_THAT(
        FsdpRuntime::CreateFromNamedParams(layout, refs, &comm, &ops, {}, bad),
        StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("got -1")));
    auto missing = refs;
    missing.erase("layers.1.w");
    EXPECT_THAT(
        FsdpRuntime::CreateFromNamedParams(layout, missing, &comm, &ops),
        StatusIs(
            absl::StatusCode::kInvalidArgument,
            AllOf(HasSubstr("\"layers.1.w\""), HasSubstr("\"layers.1\""))));
    auto unknown = refs;
    unknown["layers.7.w"] = refs.at("layers.1.w");
    EXPECT_THAT(
        FsdpRuntime::CreateFromNamedParams(layout, unknown, &comm, &ops),
        StatusIs(absl::StatusCode::kInvalidArgument,
                 HasSubstr("\"layers.7.w\"")));
    // The rest on a layout for this world.
    LayoutOptions two;
    two.world_size = 2;
    FLATPARAM_ASSIGN_OR_RETURN(const ModelLayout layout2,
                               ModelLayout::Create(TestModel(), two));
    EXPECT_THAT(FsdpRuntime::Create(layout2, {}, &comm, &ops),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("0 lists of initial parameters for 4")));
    std::vector<std::vector<ConstBufferRef>> short_unit(4);
    EXPECT_THAT(FsdpRuntime::Create(layout2, short_unit, &comm, &ops),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("0 initial parameters for unit 0")));
    // A hybrid layout over 3 ranks does not divide a world of 2.
    LayoutOptions o;
    o.world_size = 3;
    o.strategy = ShardingStrategy::kHybridShard;
    FLATPARAM_ASSIGN_OR_RETURN(ModelLayout hybrid,
                               ModelLayout::Create(TestModel(), o));
    EXPECT_THAT(FsdpRuntime::CreateFromNamedParams(hybrid, refs, &comm, &ops),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("not a multiple")));
    // A handle error carries the unit.
    auto wrong = refs;
    HostTensor small(DType::kFloat32, {2});
    wrong["layers.2.b"] = small.cref();
    EXPECT_THAT(FsdpRuntime::CreateFromNamedParams(layout2, wrong, &comm, &ops),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("unit 3 (\"layers.2\")")));
    return absl::OkStatus();
  }),
              IsOk());
}

TEST(HookTest, MisuseIsReportedWithTheUnit) {
  RunSetup setup;
  setup.runtime = RuntimeOptions();
  setup.runtime->exec_order = ExecOrderCheck::kError;
  ASSERT_THAT(
      RunRanks(
          setup,
          [&](Driver& d) -> absl::Status {
            FsdpRuntime& rt = *d.runtime();
            for (int bad : {-1, 4}) {
              EXPECT_THAT(
                  rt.PreForward(bad),
                  StatusIs(absl::StatusCode::kInvalidArgument,
                           HasSubstr(absl::StrFormat(
                               "unit %d is out of range [0, 4)", bad))));
              EXPECT_THAT(rt.PostForward(bad),
                          StatusIs(absl::StatusCode::kInvalidArgument));
              EXPECT_THAT(rt.PreBackward(bad),
                          StatusIs(absl::StatusCode::kInvalidArgument));
              EXPECT_THAT(rt.PostBackward(bad),
                          StatusIs(absl::StatusCode::kInvalidArgument));
            }
            EXPECT_THAT(rt.PreBackward(1),
                        StatusIs(absl::StatusCode::kFailedPrecondition,
                                 HasSubstr("no forward ran")));
            // A handle's own error, with the unit.
            EXPECT_THAT(rt.PostForward(2),
                        StatusIs(absl::StatusCode::kFailedPrecondition,
                                 AllOf(HasSubstr("PostForward of unit 2 "
                                                 "(\"layers.1\")"),
                                       HasSubstr("FORWARD"))));
            EXPECT_FALSE(rt.in_iteration());
            FLATPARAM_RETURN_IF_ERROR(RunIteration(d, 0));
            EXPECT_EQ(rt.forward_order(), (std::vector<int>{0, 1, 2, 3}));
            EXPECT_EQ(rt.post_forward_order(), (std::vector<int>{1, 2, 3, 0}));
            // A different forward order is an error under kError, before
            // anything changes.
            FLATPARAM_RETURN_IF_ERROR(rt.PreForward(0));
            EXPECT_THAT(rt.PreForward(2),
                        StatusIs(absl::StatusCode::kFailedPrecondition,
                                 AllOf(HasSubstr("unit 2 (\"layers.1\")"),
                                       HasSubstr("unit 1 (\"layers.0\")"),
                                       HasSubstr("0, 1, 2, 3"))));
            EXPECT_EQ(rt.handle(2).training_state(),
                      HandleTrainingState::kIdle);
            EXPECT_EQ(rt.stats().exec_order_deviations, 1);
            // Clipping is for between iterations.
            EXPECT_THAT(rt.ClipGradNorm(1.0),
                        StatusIs(absl::StatusCode::kFailedPrecondition,
                                 HasSubstr("in progress")));
            EXPECT_TRUE(rt.in_iteration());
            FLATPARAM_RETURN_IF_ERROR(rt.PostForward(0));
            FLATPARAM_RETURN_IF_ERROR(rt.FinalizeBackward());
            EXPECT_FALSE(rt.in_iteration());
            for (double p : {0.0, -1.0, std::nan("")}) {
              EXPECT_THAT(rt.ClipGradNorm(1.0, p),
                          StatusIs(absl::StatusCode::kInvalidArgument,
                                   HasSubstr("norm_type must be positive")));
            }
            for (double m : {-1.0, std::nan("")}) {
              EXPECT_THAT(rt.ClipGradNorm(m),
                          StatusIs(absl::StatusCode::kInvalidArgument,
                                   HasSubstr("max_norm must be >= 0")));
            }
            // FinalizeBackward outside an iteration does nothing.
            FLATPARAM_RETURN_IF_ERROR(rt.FinalizeBackward());
            return absl::OkStatus();
          }),
      IsOk());
}

// The backward half of RunIteration (the forward ran before).
absl::Status RunBackward(Driver& d, int iter) {
  FLATPARAM_RETURN_IF_ERROR(d.PreBackward(0));
  for (int u = d.num_units() - 1; u >= 1; --u) {
    FLATPARAM_RETURN_IF_ERROR(d.PreBackward(u));
    FLATPARAM_RETURN_IF_ERROR(AddGrads(d, u, iter));
    FLATPARAM_RETURN_IF_ERROR(d.PostBackward(u));
  }
  FLATPARAM_RETURN_IF_ERROR(AddGrads(d, 0, iter));
  FLATPARAM_RETURN_IF_ERROR(d.PostBackward(0));
  return d.Finalize();
}

// The forward half of RunIteration.
absl::Status RunForward(Driver& d) {
  double checksum = 0;
  FLATPARAM_RETURN_IF_ERROR(d.PreForward(0));
  FLATPARAM_RETURN_IF_ERROR(ReadParams(d, 0, &checksum));
  for (int u = 1; u < d.num_units(); ++u) {
    FLATPARAM_RETURN_IF_ERROR(d.PreForward(u));
    FLATPARAM_RETURN_IF_ERROR(ReadParams(d, u, &checksum));
    FLATPARAM_RETURN_IF_ERROR(d.PostForward(u));
  }
  return d.PostForward(0);
}

class SeveralBackwardsTest
    : public ::testing::TestWithParam<std::tuple<ShardingStrategy, bool>> {};

// Two backwards over one forward (loss1.backward(retain_graph=True);
// loss2.backward()): the second re-arms the hooks, unshards again and adds
// its reduced gradient to the first's, bitwise as two iterations over the
// same parameters without ZeroGrad between them, race-free on simulated
// streams. After a forward-only pass there is no backward to repeat.
TEST_P(SeveralBackwardsTest, SumEqualsTwoIterationsBitwise) {
  const auto [strategy, backward_pre] = GetParam();
  RunSetup setup;
  setup.strategy = strategy;
  setup.runtime = Options(false,
                          backward_pre ? BackwardPrefetch::kBackwardPre
                                       : BackwardPrefetch::kBackwardPost,
                          1, 2);
  setup.sim_device = true;
  setup.separate_streams = true;
  setup.device_seed = 7;
  const auto grads = [](Driver& d) {
    std::vector<std::vector<double>> out;
    for (int u = 0; u < d.num_units(); ++u) {
      std::optional<BufferRef> g = d.handle(u).sharded_grad();
      out.push_back(g.has_value() ? ReadValues(*g) : std::vector<double>{});
    }
    return out;
  };
  std::vector<std::vector<std::vector<double>>> retained(kWorld),
      iterations(kWorld);
  std::vector<int64_t> retained_gathers(kWorld), iteration_gathers(kWorld);
  ASSERT_THAT(RunRanks(setup,
                       [&](Driver& d) -> absl::Status {
                         FsdpRuntime& rt = *d.runtime();
                         FLATPARAM_RETURN_IF_ERROR(RunForward(d));
                         FLATPARAM_RETURN_IF_ERROR(RunBackward(d, 0));
                         const int64_t gathers =
                             rt.comm_stats().all_gather.calls;
                         FLATPARAM_RETURN_IF_ERROR(RunBackward(d, 1));
                         retained_gathers[d.rank()] =
                             rt.comm_stats().all_gather.calls - gathers;
                         FLATPARAM_RETURN_IF_ERROR(d.SyncHost());
                         retained[d.rank()] = grads(d);
                         EXPECT_EQ(rt.stats().iterations, 2);
                         return absl::OkStatus();
                       }),
              IsOk());
  ASSERT_THAT(
      RunRanks(setup,
               [&](Driver& d) -> absl::Status {
                 FsdpRuntime& rt = *d.runtime();
                 FLATPARAM_RETURN_IF_ERROR(RunIteration(d, 0));
                 const int64_t gathers = rt.comm_stats().all_gather.calls;
                 FLATPARAM_RETURN_IF_ERROR(RunIteration(d, 1));
                 iteration_gathers[d.rank()] =
                     rt.comm_stats().all_gather.calls - gathers;
                 FLATPARAM_RETURN_IF_ERROR(d.SyncHost());
                 iterations[d.rank()] = grads(d);
                 // A backward needs a forward or a backward before
                 // it in this iteration: after a forward-only pass
                 // there is none to repeat.
                 FLATPARAM_RETURN_IF_ERROR(RunForward(d));
                 FLATPARAM_RETURN_IF_ERROR(d.Finalize());
                 EXPECT_THAT(rt.PreBackward(0),
                             StatusIs(absl::StatusCode::kFailedPrecondition,
                                      HasSubstr("no forward ran")));
                 return absl::OkStatus();
               }),
      IsOk());
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_EQ(retained[r], iterations[r]) << "rank " << r;
    ASSERT_FALSE(retained[r].empty());
    // The second backward gathers what a backward does; the iteration's
    // forward gathers more (every unit but a kept root).
    EXPECT_LE(retained_gathers[r], iteration_gathers[r]) << "rank " << r;
    if (UsesShardedStrategy(strategy)) {
      EXPECT_GT(retained_gathers[r], 0) << "rank " << r;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Strategies, SeveralBackwardsTest,
                         ::testing::Combine(::testing::ValuesIn(kAllStrategies),
                                            ::testing::Bool()),
                         [](const auto& info) {
                           return absl::StrCat(
                               ShardingStrategyName(std::get<0>(info.param)),
                               std::get<1>(info.param) ? "_BackwardPre"
                                                       : "_BackwardPost");
                         });

// A forward with the layers in `order` (the root around them).
absl::Status RunForwardInOrder(Driver& d, const std::vector<int>& order) {
  double checksum = 0;
  FLATPARAM_RETURN_IF_ERROR(d.PreForward(0));
  for (int u : order) {
    FLATPARAM_RETURN_IF_ERROR(d.PreForward(u));
    FLATPARAM_RETURN_IF_ERROR(ReadParams(d, u, &checksum));
    FLATPARAM_RETURN_IF_ERROR(d.PostForward(u));
  }
  return d.PostForward(0);
}

absl::Status SetTraining(FsdpRuntime& rt, bool training) {
  for (int u = 0; u < rt.num_units(); ++u) {
    FLATPARAM_RETURN_IF_ERROR(rt.handle(u).SetTraining(training));
  }
  return absl::OkStatus();
}

// Validation passes (eval mode, or forward-only) neither fix nor fail the
// training order, whatever their unit order, as PyTorch records and checks
// the order only in training and fixes it only after a backward.
TEST(HookTest, EvalAndForwardOnlyPassesNeitherFixNorFailTheOrder) {
  RunSetup setup;
  setup.runtime = Options(true, BackwardPrefetch::kBackwardPre, 1, 0);
  ASSERT_EQ(setup.runtime->exec_order, ExecOrderCheck::kError);
  ASSERT_THAT(
      RunRanks(setup,
               [&](Driver& d) -> absl::Status {
                 FsdpRuntime& rt = *d.runtime();
                 // Validation before training: eval mode, another order.
                 FLATPARAM_RETURN_IF_ERROR(SetTraining(rt, false));
                 FLATPARAM_RETURN_IF_ERROR(RunForwardInOrder(d, {3, 2, 1}));
                 FLATPARAM_RETURN_IF_ERROR(d.Finalize());
                 FLATPARAM_RETURN_IF_ERROR(SetTraining(rt, true));
                 // A forward-only pass in training mode records but does not
                 // fix the order.
                 FLATPARAM_RETURN_IF_ERROR(RunForwardInOrder(d, {2, 1, 3}));
                 FLATPARAM_RETURN_IF_ERROR(d.Finalize());
                 // Training: its own order, fixed by its backward.
                 FLATPARAM_RETURN_IF_ERROR(RunIteration(d, 0));
                 FLATPARAM_RETURN_IF_ERROR(RunIteration(d, 1));
                 // Validation in between, reversed: not checked.
                 FLATPARAM_RETURN_IF_ERROR(SetTraining(rt, false));
                 FLATPARAM_RETURN_IF_ERROR(RunForwardInOrder(d, {3, 2, 1}));
                 FLATPARAM_RETURN_IF_ERROR(d.Finalize());
                 FLATPARAM_RETURN_IF_ERROR(SetTraining(rt, true));
                 FLATPARAM_RETURN_IF_ERROR(RunIteration(d, 2));
                 EXPECT_EQ(rt.stats().exec_order_deviations, 0);
                 // Training with another order is still caught.
                 FLATPARAM_RETURN_IF_ERROR(rt.PreForward(0));
                 EXPECT_THAT(rt.PreForward(2),
                             StatusIs(absl::StatusCode::kFailedPrecondition,
                                      HasSubstr("execution order changed")));
                 return absl::OkStatus();
               }),
      IsOk());
}

// A unit that runs forward but takes no part in the backward (a frozen
// first layer, whose output needs no gradient) is prefetched in the first
// backward, which cannot know, and never after: one all-gather fewer per
// step and a lower peak of unsharded parameters.
TEST(HookTest, UnitsWithoutABackwardAreNotPrefetchedOnceLearnt) {
  RunSetup setup;
  // Two units ahead: the frozen layer would be gathered while the last
  // layer's backward still holds its own and the next one's.
  setup.runtime = Options(false, BackwardPrefetch::kBackwardPre, 2, 0);
  const Plan frozen_first{{}, {1}};
  ASSERT_THAT(
      RunRanks(setup,
               [&](Driver& d) -> absl::Status {
                 FsdpRuntime& rt = *d.runtime();
                 std::vector<int64_t> gathers, peaks, prefetches;
                 for (int iter = 0; iter < 3; ++iter) {
                   const int64_t g = rt.comm_stats().all_gather.calls;
                   const int64_t p = rt.stats().prefetches;
                   rt.ResetPeakMemory();
                   FLATPARAM_RETURN_IF_ERROR(
                       RunIteration(d, iter, frozen_first));
                   gathers.push_back(rt.comm_stats().all_gather.calls - g);
                   prefetches.push_back(rt.stats().prefetches - p);
                   peaks.push_back(rt.memory().peak[static_cast<int>(
                       MemoryCategory::kUnshardedParams)]);
                 }
                 // FULL_SHARD, 4 units: the forward gathers all 4; the
                 // backward gathers the 2 layers that run one, and in the
                 // first iteration the frozen layer too.
                 EXPECT_EQ(gathers[0], 4 + 3);
                 EXPECT_EQ(gathers[1], 4 + 2);
                 EXPECT_EQ(gathers[2], 4 + 2);
                 EXPECT_EQ(prefetches[1], prefetches[0] - 1);
                 EXPECT_LT(peaks[1], peaks[0]);
                 EXPECT_EQ(peaks[2], peaks[1]);
                 return absl::OkStatus();
               }),
      IsOk());
}

// A second forward in one iteration (two forwards, then the backward) is
// prefetched as the first is.
TEST(HookTest, ASecondForwardInAnIterationIsPrefetchedAsTheFirst) {
  RunSetup setup;
  setup.runtime = Options(true, BackwardPrefetch::kNone, 1, 0);
  ASSERT_THAT(RunRanks(setup,
                       [&](Driver& d) -> absl::Status {
                         FsdpRuntime& rt = *d.runtime();
                         FLATPARAM_RETURN_IF_ERROR(RunIteration(d, 0));
                         const int64_t before = rt.stats().prefetches;
                         FLATPARAM_RETURN_IF_ERROR(RunForward(d));
                         const int64_t first = rt.stats().prefetches - before;
                         FLATPARAM_RETURN_IF_ERROR(RunForward(d));
                         const int64_t second =
                             rt.stats().prefetches - before - first;
                         EXPECT_GT(first, 0);
                         EXPECT_EQ(second, first);
                         EXPECT_EQ(rt.stats().exec_order_deviations, 0);
                         return RunBackward(d, 1);
                       }),
              IsOk());
}

// Under kWarn a changed order is counted and training goes on; a
// recompute (PreForward during the backward) is not checked.
TEST(HookTest, OrderChangesAreCountedUnderWarn) {
  RunSetup setup;
  setup.runtime = RuntimeOptions();
  setup.runtime->exec_order = ExecOrderCheck::kWarn;
  setup.runtime->forward_prefetch = true;
  ASSERT_THAT(
      RunRanks(setup,
               [&](Driver& d) -> absl::Status {
                 FsdpRuntime& rt = *d.runtime();
                 FLATPARAM_RETURN_IF_ERROR(RunIteration(d, 0));
                 FLATPARAM_RETURN_IF_ERROR(RunIteration(d, 1, Plan{{2}, {}}));
                 // Layer 2 ran where layer 1 did; skipping the
                 // last units is not a deviation PreForward sees.
                 EXPECT_EQ(rt.stats().exec_order_deviations, 1);
                 // Recompute of unit 3 inside its backward.
                 FLATPARAM_RETURN_IF_ERROR(rt.PreForward(0));
                 for (int u = 1; u < 4; ++u) {
                   FLATPARAM_RETURN_IF_ERROR(rt.PreForward(u));
                   FLATPARAM_RETURN_IF_ERROR(rt.PostForward(u));
                 }
                 FLATPARAM_RETURN_IF_ERROR(rt.PostForward(0));
                 FLATPARAM_RETURN_IF_ERROR(rt.PreBackward(0));
                 FLATPARAM_RETURN_IF_ERROR(rt.PreForward(3));
                 FLATPARAM_RETURN_IF_ERROR(rt.PostForward(3));
                 FLATPARAM_RETURN_IF_ERROR(rt.PreBackward(3));
                 FLATPARAM_RETURN_IF_ERROR(AddGrads(d, 3, 2));
                 FLATPARAM_RETURN_IF_ERROR(rt.PostBackward(3));
                 FLATPARAM_RETURN_IF_ERROR(rt.FinalizeBackward());
                 EXPECT_EQ(rt.stats().exec_order_deviations, 1);
                 EXPECT_EQ(rt.stats().iterations, 3);
                 return absl::OkStatus();
               }),
      IsOk());
}

// Traffic: one all-gather per unshard that communicates, one reduction per
// unit, with nccl-tests' sizes.
TEST(CommStatsTest, CountsTheHandlesCollectives) {
  RunSetup setup;
  setup.runtime = Options(false, BackwardPrefetch::kNone, 1, 0);
  ASSERT_THAT(
      RunRanks(setup,
               [&](Driver& d) -> absl::Status {
                 FsdpRuntime& rt = *d.runtime();
                 FLATPARAM_RETURN_IF_ERROR(RunIteration(d, 0));
                 const CommStats& c = rt.comm_stats();
                 int64_t padded = 0;
                 for (const FlatParamLayout& l : rt.layout().flat_params()) {
                   padded += l.padded_unsharded_numel() * 4;
                 }
                 const int64_t layers =
                     padded -
                     rt.layout().flat_params()[0].padded_unsharded_numel() * 4;
                 // FULL_SHARD: every unit in forward, the layers again in
                 // backward (the root kept its parameter).
                 EXPECT_EQ(c.all_gather.calls, 4 + 3);
                 EXPECT_EQ(c.all_gather.bytes, padded + layers);
                 EXPECT_EQ(c.all_gather.sent_bytes, (padded + layers) * 3 / 4);
                 EXPECT_EQ(c.reduce_scatter.calls, 4);
                 EXPECT_EQ(c.reduce_scatter.bytes, padded);
                 EXPECT_EQ(c.all_reduce.calls, 0);
                 EXPECT_EQ(c.total_bytes(), 2 * padded + layers);
                 return absl::OkStatus();
               }),
      IsOk());
}

TEST(NamesTest, BackwardPrefetch) {
  EXPECT_EQ(BackwardPrefetchName(BackwardPrefetch::kNone), "NONE");
  EXPECT_EQ(BackwardPrefetchName(BackwardPrefetch::kBackwardPre),
            "BACKWARD_PRE");
  EXPECT_EQ(BackwardPrefetchName(BackwardPrefetch::kBackwardPost),
            "BACKWARD_POST");
}

}  // namespace
}  // namespace flatparam
