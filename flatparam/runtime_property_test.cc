// Properties of FsdpRuntime (flatparam/runtime.h) over random models
// (verify/generators.h), every sharding strategy (hybrid included) on 1..4
// simulated ranks, alignment, mixed precision (bf16, or fp16 reducing in
// float32), CPU offload, forward prefetch, BACKWARD_PRE/POST, prefetch
// depths 1..3 and limit_all_gathers 0..3, 1..2 micro-batches per step
// (no_sync on all but the last), a random forward order of the units (the
// root, when the model has one, wraps the others; the order is fixed across
// iterations and checked with ExecOrderCheck::kError), activation
// recomputation or not (non-reentrant checkpointing: each non-root unit's
// PreForward, forward and PostForward again right after its PreBackward),
// and two SGD steps.
//
// The program every rank runs: the forward reads each unit's unsharded
// flat parameter with a device copy on the compute stream into an
// "activation" kept until the unit's backward; the backward reads the
// activation and the unsharded parameter again and adds a gradient that
// depends on both (so a stale or early unshard, in either pass, changes
// it) with AccumulateGrad; the optimizer steps p += -0.125 * g on the
// sharded parameters with DeviceOps work on the compute stream.
//
// What one property run proves, for the generated case:
//   (a) On SimDeviceOps with three streams per rank (compute 0, the
//       handles' unshard and post-backward streams) and
//       StreamCheckedCommunicators -- host-completed, or stream-ordered as
//       NCCL's (drawn per case) -- the race detector reports nothing on
//       any rank (CheckNoRaces). The detector works on vector clocks, so
//       this holds whatever order the simulated device runs work in; the
//       device seed draws one, so (b) also checks that the bytes do not
//       depend on it.
//   (b) Every rank's sharded gradients after each step and sharded
//       parameters after the last are bitwise those of the same program
//       driven on HostDeviceOps by the handles one by one (no prefetch,
//       blocking reductions). In float32 without mixed precision they are
//       also bitwise those of single-process training: the gradient of
//       every world rank summed in FSDP's order (shard group in rank order,
//       then replicas in rank order) with the pre/post divide, as
//       testing_handle::ReducedShard computes it, and the same SGD step.
//       With mixed precision only the first comparison is made.
//   (c) Every rank's model-wide peak of MemoryCategory::kUnshardedParams
//       (FsdpRuntime::memory()) equals the peak of a replay of the hook
//       schedule written here from runtime.h's and handle.h's documented
//       rules (which units hold an unsharded parameter at once, which
//       prefetches the depth and limit_all_gathers let through), and the
//       runtime's max_all_gathers_in_flight and prefetches_over_limit
//       equal the replay's. This generalises runtime_test.cc's formula
//       (R + layers * P) to units of random sizes and orders.
// A second property shows that (a) has teeth: with one of the handle's
// stream orderings left out (flatparam/internal/handle_test_hooks.h), the
// detector reports a problem on some rank.
//
// A failure prints the seed and the shrunk case; rerun it with
//   bazel test //flatparam:runtime_property_test
//     --test_env=RC_PARAMS="reproduce=<string printed on failure>"
#include <gtest/gtest.h>
#include <rapidcheck.h>
#include <rapidcheck/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "comm/communicator.h"
#include "flatparam/base/buffer.h"
#include "flatparam/base/dtype.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/device/device.h"
#include "flatparam/flatten.h"
#include "flatparam/handle.h"
#include "flatparam/internal/handle_test_hooks.h"
#include "flatparam/layout.h"
#include "flatparam/memory_stats.h"
#include "flatparam/model_layout.h"
#include "flatparam/runtime.h"
#include "sim/sim.h"
#include "sim/sim_device.h"
#include "testing/handle_testutil.h"
#include "verify/generators.h"

namespace flatparam {
namespace {

namespace gen = rc::gen;
using testing_handle::AddIn;
using testing_handle::ReducedShard;
using testing_handle::Scenario;

// ---------------------------------------------------------------------------
// The generated case.

struct Case {
  ModelSpec spec;  // float32 parameters
  // world_size is the shard group's size; hybrid strategies have
  // `replicas` shard groups.
  LayoutOptions layout;
  int replicas = 1;
  // param_dtype / reduce_dtype / cpu_offload; streams are set per rank.
  HandleOptions handle;
  RuntimeOptions runtime;
  // Micro-batches of each optimizer step; all but the last run no_sync.
  std::vector<int> micro_batches;
  uint64_t sim_seed = 0;
  uint64_t device_seed = 0;
  // The collectives order with the streams on the device (a simulated
  // NCCL) instead of completing on the host.
  bool stream_ordered = false;
  // Activation checkpointing (non-reentrant): each non-root unit's forward
  // runs again inside its backward, between PreBackward and the backward.
  bool recompute = false;

  int world_size() const {
    return static_cast<int>(layout.world_size) * replicas;
  }
  bool mixed_precision() const { return handle.param_dtype.has_value(); }
};

void showValue(const Case& c, std::ostream& os) {
  os << "{spec=";
  showValue(c.spec, os);
  os << ",\n layout=";
  showValue(c.layout, os);
  os << ", replicas=" << c.replicas << ", param_dtype="
     << (c.handle.param_dtype ? DTypeName(*c.handle.param_dtype) : "none")
     << ", reduce_dtype="
     << (c.handle.reduce_dtype ? DTypeName(*c.handle.reduce_dtype) : "none")
     << ", cpu_offload=" << c.handle.cpu_offload
     << ",\n forward_prefetch=" << c.runtime.forward_prefetch
     << ", backward_prefetch="
     << BackwardPrefetchName(c.runtime.backward_prefetch)
     << ", prefetch_depth=" << c.runtime.prefetch_depth
     << ", limit_all_gathers=" << c.runtime.limit_all_gathers
     << ", micro_batches=[" << absl::StrJoin(c.micro_batches, ", ")
     << "], sim_seed=" << c.sim_seed << ", device_seed=" << c.device_seed
     << ", stream_ordered=" << c.stream_ordered << ", recompute=" << c.recompute
     << "}";
}

// (shard group size, replicas) with at most 4 ranks in all.
rc::Gen<std::pair<int, int>> GenRanks(ShardingStrategy strategy) {
  if (!IsHybridStrategy(strategy)) {
    return gen::map(verify::UniformInRange(1, 5),
                    [](int s) { return std::make_pair(s, 1); })
        .as("ranks");
  }
  return gen::elementOf(std::vector<std::pair<int, int>>{{2, 2},
                                                         {2, 1},
                                                         {1, 2},
                                                         {1, 1},
                                                         {3, 1},
                                                         {1, 3},
                                                         {4, 1},
                                                         {1, 4}})
      .as("(shard group size, replicas)");
}

rc::Gen<RuntimeOptions> GenRuntimeOptions() {
  return gen::exec([] {
           RuntimeOptions o;
           o.forward_prefetch = *gen::arbitrary<bool>().as("forward_prefetch");
           o.backward_prefetch = *gen::element(BackwardPrefetch::kNone,
                                               BackwardPrefetch::kBackwardPre,
                                               BackwardPrefetch::kBackwardPost)
                                      .as("backward_prefetch");
           o.prefetch_depth =
               *verify::UniformInRange(1, 4).as("prefetch_depth");
           o.limit_all_gathers =
               *verify::UniformInRange(0, 4).as("limit_all_gathers");
           // The order is fixed by construction: any deviation is a bug.
           o.exec_order = ExecOrderCheck::kError;
           return o;
         })
      .as("runtime options");
}

rc::Gen<Case> GenCase() {
  return gen::exec([] {
           Case c;
           c.spec = *verify::GenModelSpec(verify::Scale::kData);
           // (b)'s single-process reference is float32 training.
           for (ParamSpec& p : c.spec.params) p.dtype = DType::kFloat32;
           c.layout.strategy = *verify::GenShardingStrategy();
           const auto [shard, replicas] = *GenRanks(c.layout.strategy);
           c.layout.world_size = shard;
           c.replicas = replicas;
           c.layout.align_addresses =
               *gen::arbitrary<bool>().as("align addresses");
           const int precision =
               *gen::element(0, 1, 2).as("mixed precision (none/bf16/fp16)");
           if (precision == 1) c.handle.param_dtype = DType::kBFloat16;
           if (precision == 2) {
             c.handle.param_dtype = DType::kFloat16;
             c.handle.reduce_dtype = DType::kFloat32;
           }
           // The handle requires alignment for the unsharded dtype.
           c.layout.compute_dtype = c.handle.param_dtype;
           c.handle.cpu_offload = *gen::arbitrary<bool>().as("cpu_offload");
           verify::FitRequiresGrad(c.layout, &c.spec);
           c.runtime = *GenRuntimeOptions();
           c.micro_batches = *gen::container<std::vector<int>>(
                                  2, verify::UniformInRange(1, 3))
                                  .as("micro-batches per step");
           c.sim_seed = *gen::arbitrary<uint64_t>().as("simulator seed");
           c.device_seed = *gen::arbitrary<uint64_t>().as("device seed");
           c.stream_ordered =
               *gen::arbitrary<bool>().as("stream-ordered collectives");
           c.recompute = *gen::arbitrary<bool>().as("activation recomputation");
           return c;
         })
      .as("runtime case");
}

// A permutation of `units` (Fisher-Yates; shrinks towards the given order).
rc::Gen<std::vector<int>> GenForwardOrder(std::vector<int> units) {
  return gen::exec([units] {
           std::vector<int> order = units;
           for (int i = static_cast<int>(order.size()) - 1; i > 0; --i) {
             std::swap(order[i], order[*gen::inRange(0, i + 1)]);
           }
           return order;
         })
      .as("forward order");
}

// ---------------------------------------------------------------------------
// The schedule: one iteration's hook calls and the caller's work, the same
// on every rank and in every iteration.

enum class Call : uint8_t {
  kPreForward,
  kForward,  // read the unsharded parameter into an activation
  kPostForward,
  kPreBackward,
  kBackward,  // read it again, accumulate the gradient
  kPostBackward,
};

struct Plan {
  std::optional<int> root;
  std::vector<int> order;  // the non-root units, in forward order
  std::vector<std::pair<Call, int>> calls;
};

// The root opens first and closes last in both passes (it wraps the other
// units, as in PyTorch); the others run one after the other. With
// `recompute`, each non-root unit's forward runs again right after its
// PreBackward (non-reentrant activation checkpointing, PyTorch's order).
Plan MakePlan(std::optional<int> root, std::vector<int> order, bool recompute) {
  Plan p;
  p.root = root;
  p.order = std::move(order);
  auto add = [&p](Call c, int u) { p.calls.emplace_back(c, u); };
  if (root) {
    add(Call::kPreForward, *root);
    add(Call::kForward, *root);
  }
  for (int u : p.order) {
    add(Call::kPreForward, u);
    add(Call::kForward, u);
    add(Call::kPostForward, u);
  }
  if (root) {
    add(Call::kPostForward, *root);
    add(Call::kPreBackward, *root);
  }
  for (auto it = p.order.rbegin(); it != p.order.rend(); ++it) {
    add(Call::kPreBackward, *it);
    if (recompute) {
      add(Call::kPreForward, *it);
      add(Call::kForward, *it);
      add(Call::kPostForward, *it);
    }
    add(Call::kBackward, *it);
    add(Call::kPostBackward, *it);
  }
  if (root) {
    add(Call::kBackward, *root);
    add(Call::kPostBackward, *root);
  }
  return p;
}

// Initial value of element k of spec parameter p: dyadic, the same on every
// rank.
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

// The gradient world rank `rank` adds in micro-batch `iter` for element k of
// parameter i of unit u, from what its forward read (`fwd`) and what its
// backward reads (`bwd`): the two are equal unless an unshard is stale.
float GradValue(int rank, int iter, int u, int i, int64_t k, double fwd,
                double bwd) {
  const int m =
      static_cast<int>((rank * 5 + iter * 3 + u * 7 + i * 2 + k) % 13);
  return static_cast<float>((m - 6) / 16.0 + 0.25 * fwd - 0.125 * bwd);
}

// ---------------------------------------------------------------------------
// Two ways to drive the program: the runtime, and the handles one by one.

class Driver {
 public:
  virtual ~Driver() = default;
  virtual absl::Status Hook(Call call, int u) = 0;
  virtual absl::Status Finalize() = 0;
  virtual void SetSync(bool sync) = 0;
  virtual absl::Status AccumulateGrad(int u, int i, ConstBufferRef grad) = 0;
  virtual absl::Status ZeroGrad() = 0;
  virtual FlatParamHandle& handle(int u) = 0;
  virtual int num_units() const = 0;
};

class RuntimeDriver final : public Driver {
 public:
  explicit RuntimeDriver(FsdpRuntime* rt) : rt_(rt) {}
  absl::Status Hook(Call call, int u) override {
    switch (call) {
      case Call::kPreForward:
        return rt_->PreForward(u);
      case Call::kPostForward:
        return rt_->PostForward(u);
      case Call::kPreBackward:
        return rt_->PreBackward(u);
      case Call::kPostBackward:
        return rt_->PostBackward(u);
      default:
        return absl::InternalError("not a hook");
    }
  }
  absl::Status Finalize() override { return rt_->FinalizeBackward(); }
  void SetSync(bool sync) override { rt_->SetRequireGradientSync(sync); }
  absl::Status AccumulateGrad(int u, int i, ConstBufferRef grad) override {
    // By name, as a trainer would (and memory-tracked).
    return rt_->AccumulateGrad(rt_->handle(u).layout().params()[i].fqn, grad);
  }
  absl::Status ZeroGrad() override { return rt_->ZeroGrad(); }
  FlatParamHandle& handle(int u) override { return rt_->handle(u); }
  int num_units() const override { return rt_->num_units(); }

 private:
  FsdpRuntime* rt_;
};

class HandleDriver final : public Driver {
 public:
  HandleDriver(std::vector<std::unique_ptr<FlatParamHandle>>* handles,
               std::optional<int> root)
      : handles_(*handles), root_(root) {}
  absl::Status Hook(Call call, int u) override {
    FlatParamHandle& h = *handles_[u];
    switch (call) {
      case Call::kPreForward:
        return h.PreForward();
      case Call::kPostForward:
        return h.PostForward(/*is_root=*/root_ == u);
      case Call::kPreBackward:
        return h.PreBackward();
      case Call::kPostBackward:
        return h.PostBackward(sync_);
      default:
        return absl::InternalError("not a hook");
    }
  }
  absl::Status Finalize() override {
    for (auto& h : handles_) {
      FLATPARAM_RETURN_IF_ERROR(h->FinalizeBackward(sync_));
    }
    return absl::OkStatus();
  }
  void SetSync(bool sync) override { sync_ = sync; }
  absl::Status AccumulateGrad(int u, int i, ConstBufferRef grad) override {
    return handles_[u]->AccumulateGrad(i, grad);
  }
  absl::Status ZeroGrad() override {
    for (auto& h : handles_) FLATPARAM_RETURN_IF_ERROR(h->ZeroGrad());
    return absl::OkStatus();
  }
  FlatParamHandle& handle(int u) override { return *handles_[u]; }
  int num_units() const override { return static_cast<int>(handles_.size()); }

 private:
  std::vector<std::unique_ptr<FlatParamHandle>>& handles_;
  std::optional<int> root_;
  bool sync_ = true;
};

using Bits = std::vector<uint32_t>;

struct RankResult {
  // [step][unit]: the sharded gradient after the step's last micro-batch.
  std::vector<std::vector<std::optional<Bits>>> grads;
  // [unit]: the sharded parameter after the last step.
  std::vector<Bits> params;
  // Runtime runs only.
  std::string races;
  int64_t peak_unsharded = 0;
  RuntimeStats stats;
};

// A float32 buffer's bits, copied to the host by the compute stream (where
// the runtime leaves parameters and gradients ordered for the optimizer).
absl::StatusOr<Bits> ReadBits(DeviceOps& ops, ConstBufferRef b) {
  if (b.dtype != DType::kFloat32) {
    return absl::InternalError(
        absl::StrCat("expected float32, got ", DTypeName(b.dtype)));
  }
  Bits out(b.count);
  if (b.count > 0) {
    FLATPARAM_RETURN_IF_ERROR(ops.Copy(
        BufferRef{out.data(), b.count, DType::kFloat32, Device::Host()}, b));
  }
  return out;
}

// One rank's program: the plan for every micro-batch, SGD after each step.
class Program {
 public:
  Program(const Case& c, const Plan& plan, Driver& d, DeviceOps& ops, int rank)
      : c_(c),
        plan_(plan),
        d_(d),
        ops_(ops),
        rank_(rank),
        activations_(d.num_units()) {}

  absl::Status Run(RankResult& out) {
    int iter = 0;
    for (int mb_count : c_.micro_batches) {
      for (int mb = 0; mb < mb_count; ++mb, ++iter) {
        d_.SetSync(mb + 1 == mb_count);
        for (const auto& [call, u] : plan_.calls) {
          if (call == Call::kForward) {
            FLATPARAM_RETURN_IF_ERROR(Forward(u));
          } else if (call == Call::kBackward) {
            FLATPARAM_RETURN_IF_ERROR(Backward(u, iter));
          } else {
            FLATPARAM_RETURN_IF_ERROR(d_.Hook(call, u));
          }
        }
        FLATPARAM_RETURN_IF_ERROR(d_.Finalize());
      }
      std::vector<std::optional<Bits>>& grads = out.grads.emplace_back();
      for (int u = 0; u < d_.num_units(); ++u) {
        std::optional<BufferRef> g = d_.handle(u).sharded_grad();
        if (!g.has_value()) {
          grads.push_back(std::nullopt);
          continue;
        }
        FLATPARAM_ASSIGN_OR_RETURN(Bits bits, ReadBits(ops_, *g));
        grads.push_back(std::move(bits));
      }
      FLATPARAM_RETURN_IF_ERROR(Step());
    }
    for (int u = 0; u < d_.num_units(); ++u) {
      FLATPARAM_ASSIGN_OR_RETURN(Bits bits,
                                 ReadBits(ops_, d_.handle(u).sharded_param()));
      out.params.push_back(std::move(bits));
    }
    return absl::OkStatus();
  }

 private:
  absl::StatusOr<BufferRef> Unsharded(int u, absl::string_view where) {
    std::optional<BufferRef> flat = d_.handle(u).unsharded_flat_param();
    if (!flat.has_value()) {
      return absl::InternalError(
          absl::StrFormat("unit %d is sharded in its %s", u, where));
    }
    return *flat;
  }

  // The forward's kernel: reads the whole unsharded parameter on the compute
  // stream (asynchronously on the simulated device) into an activation that
  // lives until the unit's backward.
  absl::Status Forward(int u) {
    FLATPARAM_ASSIGN_OR_RETURN(const BufferRef flat, Unsharded(u, "forward"));
    FLATPARAM_ASSIGN_OR_RETURN(activations_[u],
                               ops_.Allocate(ops_.device(), flat.bytes()));
    return ops_.Copy(activations_[u].As(flat.dtype), flat);
  }

  // The backward: the host reads the activation and the parameter (copies
  // on the compute stream), computes the gradient and adds it.
  absl::Status Backward(int u, int iter) {
    FLATPARAM_ASSIGN_OR_RETURN(const BufferRef flat, Unsharded(u, "backward"));
    HostTensor fwd = HostTensor::Flat(flat.dtype, flat.count);
    HostTensor bwd = HostTensor::Flat(flat.dtype, flat.count);
    FLATPARAM_RETURN_IF_ERROR(
        ops_.Copy(fwd.ref(), activations_[u].As(flat.dtype)));
    FLATPARAM_RETURN_IF_ERROR(ops_.Copy(bwd.ref(), flat));
    activations_[u].Reset();
    FlatParamHandle& h = d_.handle(u);
    const std::vector<ParamInfo>& params = h.layout().params();
    for (int i = 0; i < static_cast<int>(params.size()); ++i) {
      const ParamInfo& p = params[i];
      if (!h.requires_grad(i) || p.numel == 0) continue;
      std::vector<float> g(p.numel);
      for (int64_t k = 0; k < p.numel; ++k) {
        g[k] = GradValue(rank_, iter, u, i, k, fwd.GetDouble(p.offset + k),
                         bwd.GetDouble(p.offset + k));
      }
      FLATPARAM_RETURN_IF_ERROR(d_.AccumulateGrad(
          u, i,
          ConstBufferRef{g.data(), p.numel, DType::kFloat32, Device::Host()}));
    }
    return absl::OkStatus();
  }

  // SGD, p += -0.125 * g, as device work on the compute stream (so the next
  // unshard must be ordered after it), then ZeroGrad.
  absl::Status Step() {
    for (int u = 0; u < d_.num_units(); ++u) {
      FlatParamHandle& h = d_.handle(u);
      const std::optional<BufferRef> g = h.sharded_grad();
      if (!g.has_value() || g->count == 0) continue;
      FLATPARAM_ASSIGN_OR_RETURN(DeviceBuffer scratch,
                                 ops_.Allocate(g->device, g->bytes()));
      const BufferRef t = scratch.As(g->dtype);
      FLATPARAM_RETURN_IF_ERROR(ops_.Copy(t, *g));
      FLATPARAM_RETURN_IF_ERROR(ops_.Scale(t, ScaleOp::kMultiply, -0.125));
      FLATPARAM_RETURN_IF_ERROR(ops_.Add(h.sharded_param(), t));
    }
    return d_.ZeroGrad();
  }

  const Case& c_;
  const Plan& plan_;
  Driver& d_;
  DeviceOps& ops_;
  const int rank_;
  std::vector<DeviceBuffer> activations_;
};

std::map<std::string, ConstBufferRef> Refs(
    const std::map<std::string, HostTensor>& tensors) {
  std::map<std::string, ConstBufferRef> out;
  for (const auto& [fqn, t] : tensors) out[fqn] = t.cref();
  return out;
}

// How much device work SimDeviceOps queues before running it (its default:
// work runs late and reordered among the orders streams and events allow).
constexpr int kSimMaxQueued = SimDeviceOptions().max_queued;

// The runtime on SimDeviceOps with three streams, every rank; each rank's
// race reports land in its result.
absl::Status RunRuntime(const Case& c, const ModelLayout& layout,
                        const Plan& plan,
                        const std::map<std::string, HostTensor>& init,
                        std::vector<RankResult>* results) {
  SimOptions options;
  options.world_size = c.world_size();
  options.seed = c.sim_seed;
  FLATPARAM_ASSIGN_OR_RETURN(std::unique_ptr<SimWorld> world,
                             SimWorld::Create(options));
  results->assign(c.world_size(), RankResult());
  return world->Run([&](SimCommunicator& sim) -> absl::Status {
    const int rank = sim.rank();
    RankResult& r = (*results)[rank];
    SimDeviceOptions device_options;
    device_options.seed = c.device_seed + rank;
    device_options.max_queued = kSimMaxQueued;
    SimDeviceOps ops(device_options);
    StreamCheckedCommunicator comm(&sim, &ops, c.stream_ordered);
    HandleOptions handle_options = c.handle;
    FLATPARAM_ASSIGN_OR_RETURN(handle_options.streams.unshard, ops.NewStream());
    FLATPARAM_ASSIGN_OR_RETURN(handle_options.streams.post_backward,
                               ops.NewStream());
    absl::Status ran;
    {
      FLATPARAM_ASSIGN_OR_RETURN(
          std::unique_ptr<FsdpRuntime> rt,
          FsdpRuntime::CreateFromNamedParams(layout, Refs(init), &comm, &ops,
                                             handle_options, c.runtime));
      RuntimeDriver driver(rt.get());
      ran = Program(c, plan, driver, ops, rank).Run(r);
      r.peak_unsharded =
          rt->memory().peak_bytes(MemoryCategory::kUnshardedParams);
      r.stats = rt->stats();
    }
    const absl::Status synced = ops.Synchronize();
    const absl::Status races = ops.CheckNoRaces();
    if (!races.ok()) r.races = std::string(races.message());
    FLATPARAM_RETURN_IF_ERROR(ran);
    return synced;
  });
}

// The handles one by one on HostDeviceOps, every rank.
absl::Status RunHandles(const Case& c, const ModelLayout& layout,
                        const Plan& plan,
                        const std::map<std::string, HostTensor>& init,
                        std::vector<RankResult>* results) {
  SimOptions options;
  options.world_size = c.world_size();
  options.seed = c.sim_seed;
  FLATPARAM_ASSIGN_OR_RETURN(std::unique_ptr<SimWorld> world,
                             SimWorld::Create(options));
  results->assign(c.world_size(), RankResult());
  return world->Run([&](SimCommunicator& sim) -> absl::Status {
    HostDeviceOps ops;
    HybridGroups groups;
    Communicator* shard = &sim;
    if (IsHybridStrategy(c.layout.strategy)) {
      FLATPARAM_ASSIGN_OR_RETURN(
          groups, MakeHybridGroups(sim, static_cast<int>(c.layout.world_size)));
      shard = groups.shard.get();
    }
    std::vector<std::unique_ptr<FlatParamHandle>> handles;
    for (const FlatParamLayout& l : layout.flat_params()) {
      std::vector<ConstBufferRef> refs;
      for (const ParamInfo& p : l.params())
        refs.push_back(init.at(p.fqn).cref());
      FLATPARAM_ASSIGN_OR_RETURN(
          std::unique_ptr<FlatParamHandle> h,
          FlatParamHandle::Create(l, refs, shard, groups.replicate.get(), &ops,
                                  c.handle));
      handles.push_back(std::move(h));
    }
    HandleDriver driver(&handles, plan.root);
    return Program(c, plan, driver, ops, sim.rank())
        .Run((*results)[sim.rank()]);
  });
}

// ---------------------------------------------------------------------------
// (b)'s single-process reference, float32 only: every rank's local gradient
// computed here, reduced with testing_handle::ReducedShard (FSDP's pre/post
// divide and fold order), and the same SGD step on the whole flat
// parameters. Returns, per step and unit, the full reduced gradient
// (nullopt without one) and, last, the full parameters.
struct Reference {
  std::vector<std::vector<std::optional<std::vector<float>>>> grads;
  std::vector<std::vector<float>> params;
};

Reference TrainReference(const Case& c, const ModelLayout& layout,
                         const std::map<std::string, HostTensor>& init) {
  const std::vector<FlatParamLayout>& flat = layout.flat_params();
  const int n = static_cast<int>(flat.size());
  const int world = c.world_size();
  const int shard_size = static_cast<int>(c.layout.world_size);
  const bool sharded = UsesShardedStrategy(c.layout.strategy);
  Scenario s;
  s.strategy = c.layout.strategy;
  s.shard_size = shard_size;
  s.replicate_size = c.replicas;
  const double pre = GradientPredivideFactor(world);
  const double post = world / pre;

  Reference ref;
  // The padded flat parameters: Flatten's (alignment padding included),
  // then zeros up to the padded size.
  for (const FlatParamLayout& l : flat) {
    std::vector<ConstBufferRef> refs;
    for (const ParamInfo& p : l.params()) refs.push_back(init.at(p.fqn).cref());
    HostTensor t =
        HostTensor::Flat(DType::kFloat32, l.unpadded_unsharded_numel());
    const absl::Status flattened = Flatten(l, refs, t.ref());
    RC_ASSERT(flattened.ok());
    std::vector<float>& v = ref.params.emplace_back(l.padded_unsharded_numel());
    std::memcpy(v.data(), t.data(), t.nbytes());
  }
  int iter = 0;
  for (int mb_count : c.micro_batches) {
    // [unit][world rank]
    std::vector<std::vector<std::vector<double>>> local(n);
    for (int u = 0; u < n; ++u) {
      local[u].assign(world,
                      std::vector<double>(flat[u].padded_unsharded_numel()));
    }
    for (int mb = 0; mb < mb_count; ++mb, ++iter) {
      for (int w = 0; w < world; ++w) {
        for (int u = 0; u < n; ++u) {
          const std::vector<ParamInfo>& params = flat[u].params();
          for (int i = 0; i < static_cast<int>(params.size()); ++i) {
            const ParamInfo& p = params[i];
            if (!p.requires_grad) continue;
            for (int64_t k = 0; k < p.numel; ++k) {
              const double x = ref.params[u][p.offset + k];
              double& acc = local[u][w][p.offset + k];
              acc = AddIn(DType::kFloat32, acc,
                          GradValue(w, iter, u, i, k, x, x));
            }
          }
        }
      }
    }
    std::vector<std::optional<std::vector<float>>>& grads =
        ref.grads.emplace_back();
    for (int u = 0; u < n; ++u) {
      const std::vector<ParamInfo>& params = flat[u].params();
      if (std::none_of(params.begin(), params.end(),
                       [](const ParamInfo& p) { return p.requires_grad; })) {
        grads.push_back(std::nullopt);
        continue;
      }
      std::vector<float> full;
      for (int r = 0; r < (sharded ? shard_size : 1); ++r) {
        for (double g : ReducedShard(s, flat[u], local[u], r, DType::kFloat32,
                                     DType::kFloat32, pre, post)) {
          full.push_back(static_cast<float>(g));
        }
      }
      for (size_t j = 0; j < full.size(); ++j) {
        ref.params[u][j] = ref.params[u][j] + full[j] * -0.125f;
      }
      grads.push_back(std::move(full));
    }
  }
  return ref;
}

// World rank w's part of a full flat vector, as bits.
Bits ShardOf(const Case& c, const FlatParamLayout& l,
             const std::vector<float>& full, int w) {
  const int64_t chunk = l.sharded_numel();
  const int64_t begin = UsesShardedStrategy(c.layout.strategy)
                            ? (w % c.layout.world_size) * chunk
                            : 0;
  Bits out(chunk);
  std::memcpy(out.data(), full.data() + begin, chunk * sizeof(float));
  return out;
}

// ---------------------------------------------------------------------------
// (c): a replay of the schedule that tracks which units hold an unsharded
// parameter (kUnshardedParams bytes), from the documented rules:
//   * sharded strategies hold the padded unsharded parameter (param_dtype)
//     from the unshard -- a prefetch's StartUnshard included -- to a reshard
//     that frees it: PostForward for FULL_SHARD/HYBRID_SHARD except the
//     root; PostBackward when synchronizing or resharding after forward;
//     FinalizeBackward when synchronizing. An unshard of a held parameter
//     reuses it without an all-gather;
//   * NO_SHARD with CPU offload holds the float32 device copy of the shard
//     while unsharded (with mixed precision the copy only lives inside the
//     unshard: a transient peak); otherwise NO_SHARD holds nothing here;
//   * prefetch (runtime.h): forward_prefetch from the second iteration on,
//     over the recorded forward order, BACKWARD_PRE at PreBackward and
//     BACKWARD_POST after PostBackward over the reverse of this iteration's
//     post-forward order, `prefetch_depth` units ahead that have not run
//     the hook yet; a candidate already unsharded or pending is skipped; one
//     that needs an all-gather with `limit_all_gathers` unconsumed
//     all-gathered prefetches outstanding stops the prefetch.
class UnshardedMemoryReplay {
 public:
  UnshardedMemoryReplay(const Case& c, const ModelLayout& layout,
                        std::optional<int> root)
      : c_(c),
        root_(root),
        sharded_(UsesShardedStrategy(c.layout.strategy)),
        reshard_after_forward_(
            c.layout.strategy == ShardingStrategy::kFullShard ||
            c.layout.strategy == ShardingStrategy::kHybridShard) {
    const bool mp = c.mixed_precision();
    for (const FlatParamLayout& l : layout.flat_params()) {
      Unit u;
      if (sharded_) {
        u.bytes = l.padded_unsharded_numel() *
                  static_cast<int64_t>(
                      DTypeSize(mp ? *c.handle.param_dtype : DType::kFloat32));
      } else if (c.handle.cpu_offload) {
        (mp ? u.transient : u.bytes) = l.sharded_numel() * 4;
      }
      units_.push_back(u);
    }
    const int n = static_cast<int>(units_.size());
    ran_forward_.assign(n, 0);
    ran_backward_.assign(n, 0);
    in_backward_pre_.assign(n, 0);
  }

  void Run(const Plan& plan) {
    for (int mb_count : c_.micro_batches) {
      for (int mb = 0; mb < mb_count; ++mb) {
        sync_ = mb + 1 == mb_count;
        std::fill(ran_forward_.begin(), ran_forward_.end(), 0);
        std::fill(ran_backward_.begin(), ran_backward_.end(), 0);
        post_forward_order_.clear();
        for (const auto& [call, u] : plan.calls) Hook(call, u);
        Finalize();
      }
    }
  }

  int64_t peak() const { return peak_; }
  int max_in_flight() const { return max_in_flight_; }
  int64_t over_limit() const { return over_limit_; }

 private:
  struct Unit {
    int64_t bytes = 0;      // held while allocated
    int64_t transient = 0;  // allocated and freed inside each unshard
    bool held = false;
    bool unsharded = false;
    bool pending = false;
  };

  void Hold(Unit& u) {
    if (u.held) return;
    u.held = true;
    current_ += u.bytes;
    peak_ = std::max(peak_, current_ + u.transient);
  }
  void Release(Unit& u) {
    if (!u.held) return;
    u.held = false;
    current_ -= u.bytes;
  }
  // An unshard that completes (a pending one finishes here).
  void Unshard(Unit& u) {
    if (!u.pending) Hold(u);
    u.pending = false;
    u.unsharded = true;
  }
  void Reshard(Unit& u, bool free) {
    u.unsharded = false;
    if (!sharded_ || free) Release(u);
  }
  void Prefetch(const std::vector<int>& candidates) {
    const size_t limit = c_.runtime.limit_all_gathers;
    for (int v : candidates) {
      Unit& u = units_[v];
      if (u.unsharded || u.pending) continue;
      const bool needs_all_gather = sharded_ && !u.held;
      if (needs_all_gather && limit > 0 && prefetched_.size() >= limit) {
        ++over_limit_;
        break;
      }
      if (needs_all_gather) {
        Hold(u);
        u.pending = true;
        prefetched_.push_back(v);
        max_in_flight_ =
            std::max(max_in_flight_, static_cast<int>(prefetched_.size()));
      } else {
        Unshard(u);
      }
    }
  }
  void Consume(int v) {
    prefetched_.erase(std::remove(prefetched_.begin(), prefetched_.end(), v),
                      prefetched_.end());
  }
  // The next `prefetch_depth` units after `v` in `order` not yet `ran`.
  std::vector<int> Next(const std::vector<int>& order, int v,
                        const std::vector<char>& ran, bool backwards) const {
    std::vector<int> out;
    const auto it = std::find(order.begin(), order.end(), v);
    if (it == order.end()) return out;
    const int at = static_cast<int>(it - order.begin());
    for (int d = 1; d <= c_.runtime.prefetch_depth; ++d) {
      const int j = backwards ? at - d : at + d;
      if (j < 0 || j >= static_cast<int>(order.size())) break;
      if (!ran[order[j]]) out.push_back(order[j]);
    }
    return out;
  }

  void Hook(Call call, int v) {
    Unit& u = units_[v];
    // A recompute inside the unit's backward: the hooks do nothing.
    if ((call == Call::kPreForward || call == Call::kPostForward) &&
        in_backward_pre_[v]) {
      return;
    }
    switch (call) {
      case Call::kPreForward:
        if (!u.unsharded) Unshard(u);
        Consume(v);
        ran_forward_[v] = 1;
        if (!order_fixed_) forward_order_.push_back(v);
        if (c_.runtime.forward_prefetch && order_fixed_) {
          Prefetch(Next(forward_order_, v, ran_forward_, false));
        }
        return;
      case Call::kPostForward:
        Reshard(u, reshard_after_forward_ && root_ != v);
        post_forward_order_.push_back(v);
        return;
      case Call::kPreBackward:
        if (!u.unsharded) Unshard(u);
        Consume(v);
        ran_backward_[v] = 1;
        in_backward_pre_[v] = 1;
        if (c_.runtime.backward_prefetch == BackwardPrefetch::kBackwardPre) {
          Prefetch(Next(post_forward_order_, v, ran_backward_, true));
        }
        return;
      case Call::kPostBackward:
        in_backward_pre_[v] = 0;
        Reshard(u, sync_ || reshard_after_forward_);
        if (c_.runtime.backward_prefetch == BackwardPrefetch::kBackwardPost) {
          Prefetch(Next(post_forward_order_, v, ran_backward_, true));
        }
        return;
      default:
        return;
    }
  }

  void Finalize() {
    std::fill(in_backward_pre_.begin(), in_backward_pre_.end(), 0);
    for (Unit& u : units_) {
      if (u.pending) Unshard(u);
      if (u.unsharded) Reshard(u, sync_ || reshard_after_forward_);
      if (sync_ && sharded_) Release(u);
    }
    prefetched_.clear();
    order_fixed_ = true;
  }

  const Case& c_;
  const std::optional<int> root_;
  const bool sharded_;
  const bool reshard_after_forward_;
  std::vector<Unit> units_;
  bool sync_ = true;
  bool order_fixed_ = false;
  std::vector<int> forward_order_;
  std::vector<int> post_forward_order_;
  std::vector<char> ran_forward_;
  std::vector<char> ran_backward_;
  std::vector<char> in_backward_pre_;
  std::vector<int> prefetched_;
  int64_t current_ = 0;
  int64_t peak_ = 0;
  int max_in_flight_ = 0;
  int64_t over_limit_ = 0;
};

// ---------------------------------------------------------------------------
// The properties.

struct Setup {
  Case c;
  ModelLayout layout;
  Plan plan;
  std::map<std::string, HostTensor> init;
};

// Draws a case the runtime can run (ModelLayout rejects units of zero
// numel; those draws are discarded) and its forward order.
Setup DrawSetup() {
  Case c = *GenCase();
  absl::StatusOr<ModelLayout> layout = ModelLayout::Create(c.spec, c.layout);
  RC_PRE(layout.ok());
  std::optional<int> root;
  std::vector<int> others;
  for (int u = 0; u < static_cast<int>(layout->flat_params().size()); ++u) {
    if (layout->flat_params()[u].unit().empty()) {
      root = u;
    } else {
      others.push_back(u);
    }
  }
  const std::vector<int> order = *GenForwardOrder(others);
  RC_TAG(ShardingStrategyName(c.layout.strategy));
  std::map<std::string, HostTensor> init = InitialTensors(c.spec);
  RC_CLASSIFY(c.recompute, "recompute");
  Plan plan = MakePlan(root, order, c.recompute);
  return Setup{std::move(c), *std::move(layout), std::move(plan),
               std::move(init)};
}

float AsFloat(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Where two results differ: None-ness, size, or the first element.
std::string Difference(const std::optional<Bits>& got,
                       const std::optional<Bits>& want) {
  if (!got.has_value() || !want.has_value()) {
    return absl::StrFormat("%s, want %s", got ? "a gradient" : "None",
                           want ? "a gradient" : "None");
  }
  if (got->size() != want->size()) {
    return absl::StrFormat("%d elements, want %d", got->size(), want->size());
  }
  for (size_t k = 0; k < got->size(); ++k) {
    if ((*got)[k] != (*want)[k]) {
      return absl::StrFormat("element %d is %a, want %a", k, AsFloat((*got)[k]),
                             AsFloat((*want)[k]));
    }
  }
  return "equal";
}

// Fails with the first difference between two runs' results.
void ExpectSame(const std::vector<RankResult>& got,
                const std::vector<RankResult>& want, const std::string& what) {
  RC_ASSERT(got.size() == want.size());
  for (size_t r = 0; r < got.size(); ++r) {
    RC_ASSERT(got[r].grads.size() == want[r].grads.size());
    for (size_t step = 0; step < got[r].grads.size(); ++step) {
      for (size_t u = 0; u < got[r].grads[step].size(); ++u) {
        if (got[r].grads[step][u] != want[r].grads[step][u]) {
          RC_FAIL(absl::StrFormat(
              "%s: rank %d, step %d, unit %d: sharded gradient: %s", what, r,
              step, u,
              Difference(got[r].grads[step][u], want[r].grads[step][u])));
        }
      }
    }
    for (size_t u = 0; u < got[r].params.size(); ++u) {
      if (got[r].params[u] != want[r].params[u]) {
        RC_FAIL(absl::StrFormat(
            "%s: rank %d, unit %d: sharded parameter: %s", what, r, u,
            Difference(got[r].params[u], want[r].params[u])));
      }
    }
  }
}

RC_GTEST_PROP(RuntimeProperties, RaceFreeBitwiseAndPeakMemoryAsScheduled, ()) {
  const Setup s = DrawSetup();
  const Case& c = s.c;

  std::vector<RankResult> runtime;
  const absl::Status ran = RunRuntime(c, s.layout, s.plan, s.init, &runtime);
  if (!ran.ok()) RC_FAIL(absl::StrCat("runtime run: ", ran.ToString()));

  // (a) No stream-ordering problem on any rank.
  for (int r = 0; r < c.world_size(); ++r) {
    if (!runtime[r].races.empty()) {
      RC_FAIL(absl::StrFormat("(a) rank %d: %s", r, runtime[r].races));
    }
  }

  // (b) Bitwise the handles' training, and in float32 single-process
  // training.
  std::vector<RankResult> handles;
  const absl::Status ran_handles =
      RunHandles(c, s.layout, s.plan, s.init, &handles);
  if (!ran_handles.ok()) {
    RC_FAIL(absl::StrCat("handle-loop run: ", ran_handles.ToString()));
  }
  ExpectSame(runtime, handles, "(b) runtime vs handle loop");
  if (!c.mixed_precision()) {
    const Reference ref = TrainReference(c, s.layout, s.init);
    std::vector<RankResult> want(c.world_size());
    for (int w = 0; w < c.world_size(); ++w) {
      for (const auto& step : ref.grads) {
        std::vector<std::optional<Bits>>& grads = want[w].grads.emplace_back();
        for (size_t u = 0; u < step.size(); ++u) {
          grads.push_back(step[u].has_value()
                              ? std::optional(ShardOf(
                                    c, s.layout.flat_params()[u], *step[u], w))
                              : std::nullopt);
        }
      }
      for (size_t u = 0; u < ref.params.size(); ++u) {
        want[w].params.push_back(
            ShardOf(c, s.layout.flat_params()[u], ref.params[u], w));
      }
    }
    ExpectSame(runtime, want, "(b) runtime vs single-process float32");
  }

  // (c) The peak of unsharded parameters, and the prefetches in flight, as
  // the replay of the schedule says.
  UnshardedMemoryReplay replay(c, s.layout, s.plan.root);
  replay.Run(s.plan);
  RC_TAG(replay.max_in_flight() > 0 ? "prefetched all-gathers"
                                    : "no prefetched all-gather");
  for (int r = 0; r < c.world_size(); ++r) {
    const RankResult& got = runtime[r];
    if (got.peak_unsharded != replay.peak() ||
        got.stats.max_all_gathers_in_flight != replay.max_in_flight() ||
        got.stats.prefetches_over_limit != replay.over_limit()) {
      RC_FAIL(absl::StrFormat(
          "(c) rank %d: peak unsharded-parameter bytes %d (replay %d), most "
          "all-gathers in flight %d (replay %d), prefetches over the limit "
          "%d (replay %d)",
          r, got.peak_unsharded, replay.peak(),
          got.stats.max_all_gathers_in_flight, replay.max_in_flight(),
          got.stats.prefetches_over_limit, replay.over_limit()));
    }
    if (c.runtime.limit_all_gathers > 0) {
      RC_ASSERT(got.stats.max_all_gathers_in_flight <=
                c.runtime.limit_all_gathers);
    }
  }
}

// Restores the handle's full stream discipline when the property ends,
// however it ends (RapidCheck failures are exceptions).
class SkipOrdering {
 public:
  explicit SkipOrdering(internal_handle::SkippedOrdering skip) {
    internal_handle::SetSkippedOrderingForTesting(skip);
  }
  ~SkipOrdering() {
    internal_handle::SetSkippedOrderingForTesting(
        internal_handle::SkippedOrdering::kNone);
  }
  SkipOrdering(const SkipOrdering&) = delete;
  SkipOrdering& operator=(const SkipOrdering&) = delete;
};

// The mutation check of (a): leaving out an ordering this program depends
// on is reported on some rank.
//   * The reduction's wait for the compute stream, whenever a unit has a
//     gradient: the backward's AccumulateGrad adds on the compute stream
//     after the host's last wait for it.
//   * The RecordStream of the unsharded parameter for the compute stream,
//     when FULL_SHARD / HYBRID_SHARD free a non-root unit's parameter at
//     PostForward while the forward's copy from it is still the compute
//     stream's. (Where the parameter lives until the backward, the host's
//     reads in the backward order every compute read before the free, so
//     nothing needs the record there.)
RC_GTEST_PROP(RuntimeProperties, DetectorReportsASkippedOrdering, ()) {
  using internal_handle::SkippedOrdering;
  const Setup s = DrawSetup();
  const Case& c = s.c;
  bool has_grad = false;
  for (const FlatParamLayout& l : s.layout.flat_params()) {
    // A gradient the backward writes on the compute stream (AccumulateGrad
    // of a parameter with elements).
    for (const ParamInfo& p : l.params()) {
      has_grad |= p.requires_grad && p.numel > 0;
    }
  }
  std::vector<std::pair<SkippedOrdering, std::string>> applicable;
  if (has_grad) {
    applicable.emplace_back(SkippedOrdering::kPostBackwardWaitsForCompute,
                            "kPostBackwardWaitsForCompute");
  }
  if ((c.layout.strategy == ShardingStrategy::kFullShard ||
       c.layout.strategy == ShardingStrategy::kHybridShard) &&
      !s.plan.order.empty()) {
    applicable.emplace_back(SkippedOrdering::kRecordUnshardedParamOnCompute,
                            "kRecordUnshardedParamOnCompute");
  }
  // The optimizer's update of a device local shard (made when a gradient
  // exists) against the next iteration's cast or all-gather of it.
  if (has_grad && !c.handle.cpu_offload && !s.plan.order.empty() &&
      (UsesShardedStrategy(c.layout.strategy) || c.mixed_precision())) {
    applicable.emplace_back(SkippedOrdering::kUnshardWaitsForCompute,
                            "kUnshardWaitsForCompute");
  }
  if (c.stream_ordered && UsesShardedStrategy(c.layout.strategy) &&
      !s.plan.order.empty()) {
    applicable.emplace_back(SkippedOrdering::kComputeWaitsForUnshard,
                            "kComputeWaitsForUnshard");
  }
  RC_PRE(!applicable.empty());
  const int pick =
      *gen::inRange<int>(0, applicable.size()).as("skipped ordering (index)");
  const auto& [skip, name] = applicable[pick];
  RC_LOG() << "skipped ordering: " << name << "\n";
  RC_TAG(name);
  std::vector<RankResult> runtime;
  absl::Status ran;
  {
    SkipOrdering guard(skip);
    ran = RunRuntime(c, s.layout, s.plan, s.init, &runtime);
  }
  if (!ran.ok()) RC_FAIL(absl::StrCat("runtime run: ", ran.ToString()));
  bool reported = false;
  for (const RankResult& r : runtime) reported |= !r.races.empty();
  RC_ASSERT(reported);
}

}  // namespace
}  // namespace flatparam
