#include "testing/handle_testutil.h"

#include <cmath>
#include <cstring>
#include <new>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "comm/forwarding_communicator.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/device/device.h"
#include "sim/sim_device.h"

namespace flatparam {
namespace testing_handle {

std::string Scenario::ToString() const {
  std::vector<std::string> params;
  for (const ParamSpec& p : specs) {
    params.push_back(
        absl::StrFormat("%s[%s]%s%s", p.fqn, absl::StrJoin(p.shape, ","),
                        p.requires_grad ? "" : " frozen",
                        p.tied_to.empty() ? "" : " tied to " + p.tied_to));
  }
  return absl::StrCat("{", absl::StrJoin(params, "; "), "} ", Options());
}

std::string Scenario::Options() const {
  return absl::StrFormat(
      "%s %s shard=%d replicate=%d align=%d param_dtype=%s reduce_dtype=%s "
      "keep_low=%d offload=%d in_collectives=%d fake_device=%d sim_device=%d "
      "device_seed=%d streams=%d stream_ordered=%d seed=%d",
      ShardingStrategyName(strategy), DTypeName(dtype), shard_size,
      replicate_size, align,
      options.param_dtype ? DTypeName(*options.param_dtype) : "-",
      options.reduce_dtype ? DTypeName(*options.reduce_dtype) : "-",
      options.keep_low_precision_grads, options.cpu_offload,
      options.divide_in_collectives, fake_device, sim_device, device_seed,
      separate_streams ? 3 : 1, stream_ordered_comm, sim_seed);
}

absl::StatusOr<FlatParamLayout> MakeLayout(const Scenario& s) {
  std::vector<ParamSpec> specs = s.specs;
  for (ParamSpec& p : specs) p.dtype = s.dtype;
  LayoutOptions o;
  o.world_size = s.shard_size;
  o.strategy = s.strategy;
  o.align_addresses = s.align;
  if (s.options.param_dtype.has_value()) {
    o.compute_dtype = *s.options.param_dtype;
  }
  return FlatParamLayout::Create("unit", specs, o);
}

double InitialValue(const Scenario& s, int param, int64_t k) {
  if (s.rounding_values) {
    return std::sin(1.0 + param * 17.0 + k * 0.37) * 3.0;
  }
  return ((param * 31 + k * 7) % 23 - 11) * 0.125;
}

std::vector<HostTensor> InitialParams(const Scenario& s,
                                      const FlatParamLayout& layout) {
  std::vector<HostTensor> params;
  for (size_t i = 0; i < layout.params().size(); ++i) {
    const ParamInfo& p = layout.params()[i];
    HostTensor t(layout.dtype(), p.shape);
    for (int64_t k = 0; k < p.numel; ++k) {
      t.SetDouble(k, InitialValue(s, static_cast<int>(i), k));
    }
    params.push_back(std::move(t));
  }
  return params;
}

float GradValue(const Scenario& s, int iter, int rank, int param, int64_t k) {
  if (s.rounding_values) {
    return static_cast<float>(
        std::cos(0.3 + iter * 1.7 + rank * 0.91 + param * 5.3 + k * 0.13) *
        2.0);
  }
  return static_cast<float>(((iter * 5 + rank * 3 + param * 11 + k) % 13 - 6) *
                            0.25);
}

absl::StatusOr<void*> FakeCudaDeviceOps::DoAllocate(Device device,
                                                    int64_t bytes,
                                                    bool pinned) {
  return ::operator new (static_cast<size_t>(bytes), std::align_val_t{64});
}

void FakeCudaDeviceOps::DoFree(void* data, Device device, bool pinned) {
  ::operator delete (data, std::align_val_t{64});
}

absl::Status FakeCudaDeviceOps::DoCopy(BufferRef dst, ConstBufferRef src) {
  if (dst.device != src.device) {
    ++(dst.device == Device::Host() ? device_to_host : host_to_device);
  }
  std::memcpy(dst.data, src.data, static_cast<size_t>(dst.bytes()));
  return absl::OkStatus();
}

absl::Status FakeCudaDeviceOps::DoFill(BufferRef dst, double value) {
  HostFill(dst.data, dst.dtype, dst.count, value);
  return absl::OkStatus();
}

absl::Status FakeCudaDeviceOps::DoCast(BufferRef dst, ConstBufferRef src) {
  HostCast(dst.data, dst.dtype, src.data, src.dtype, dst.count);
  return absl::OkStatus();
}

absl::Status FakeCudaDeviceOps::DoScale(BufferRef buf, ScaleOp op,
                                        double factor) {
  HostScale(buf.data, buf.dtype, buf.count, op, factor);
  return absl::OkStatus();
}

absl::Status FakeCudaDeviceOps::DoAdd(BufferRef acc, ConstBufferRef x) {
  HostAdd(acc.data, x.data, acc.dtype, acc.count);
  return absl::OkStatus();
}

namespace {

class RelabellingCommunicator final : public ForwardingCommunicator {
 public:
  using ForwardingCommunicator::ForwardingCommunicator;

  std::unique_ptr<Work> AllGather(ConstBufferRef input, BufferRef output,
                                  const CollectiveOptions& options) override {
    return inner().AllGather(Host(input), Host(output), options);
  }
  std::unique_ptr<Work> ReduceScatter(ConstBufferRef input, BufferRef output,
                                      const ReduceOptions& options) override {
    return inner().ReduceScatter(Host(input), Host(output), options);
  }
  std::unique_ptr<Work> AllReduce(ConstBufferRef input, BufferRef output,
                                  const ReduceOptions& options) override {
    return inner().AllReduce(Host(input), Host(output), options);
  }
  std::unique_ptr<Work> Broadcast(BufferRef buffer,
                                  const BroadcastOptions& options) override {
    return inner().Broadcast(Host(buffer), options);
  }
  absl::StatusOr<std::unique_ptr<Communicator>> Split(
      int color, int key, const CollectiveOptions& options) override {
    FLATPARAM_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> child,
                               inner().Split(color, key, options));
    if (child == nullptr) return child;
    return RelabelCudaAsHost(std::move(child));
  }

 private:
  // Only the compute device's buffers may reach a collective.
  template <typename Ref>
  static Ref Host(Ref b) {
    if (b.device == Device::Cuda(0)) {
      b.device = Device::Host();
    } else {
      // A host buffer here means the handle passed one the real device
      // could not use: make the simulator reject it.
      b.device = Device::Cuda(1);
    }
    return b;
  }
};

}  // namespace

std::unique_ptr<Communicator> RelabelCudaAsHost(
    std::unique_ptr<Communicator> inner) {
  return std::make_unique<RelabellingCommunicator>(std::move(inner));
}

std::unique_ptr<Communicator> RelabelCudaAsHost(Communicator* inner) {
  return std::make_unique<RelabellingCommunicator>(inner);
}

absl::Status RunWithHandles(const Scenario& s, const RankFn& fn,
                            std::unique_ptr<SimWorld>* world_out) {
  FLATPARAM_ASSIGN_OR_RETURN(FlatParamLayout layout, MakeLayout(s));
  const std::vector<HostTensor> params = InitialParams(s, layout);
  std::vector<ConstBufferRef> refs;
  for (const HostTensor& t : params) refs.push_back(t.cref());
  SimOptions options;
  options.world_size = s.world_size();
  options.seed = s.sim_seed;
  options.faults = s.faults;
  FLATPARAM_ASSIGN_OR_RETURN(std::unique_ptr<SimWorld> world,
                             SimWorld::Create(options));
  absl::Status status = world->Run([&](SimCommunicator& comm) -> absl::Status {
    HybridGroups groups;
    Communicator* shard = &comm;
    Communicator* replicate = nullptr;
    if (s.hybrid()) {
      FLATPARAM_ASSIGN_OR_RETURN(groups, MakeHybridGroups(comm, s.shard_size));
      shard = groups.shard.get();
      replicate = groups.replicate.get();
    }
    std::unique_ptr<Communicator> fake_shard, fake_replicate;
    HostDeviceOps host_ops;
    FakeCudaDeviceOps fake_ops;
    SimDeviceOps sim_ops(SimDeviceOptions{s.device_seed});
    DeviceOps* ops = &host_ops;
    if (s.fake_device || s.sim_device) {
      auto wrap = [&](Communicator* c) -> std::unique_ptr<Communicator> {
        if (s.sim_device) {
          return std::make_unique<StreamCheckedCommunicator>(
              c, &sim_ops, s.stream_ordered_comm);
        }
        return RelabelCudaAsHost(c);
      };
      fake_shard = wrap(shard);
      shard = fake_shard.get();
      if (replicate != nullptr) {
        fake_replicate = wrap(replicate);
        replicate = fake_replicate.get();
      }
      ops = s.sim_device ? static_cast<DeviceOps*>(&sim_ops) : &fake_ops;
    }
    absl::Status ran;
    {
      HandleOptions options = s.options;
      if (s.separate_streams) {
        FLATPARAM_ASSIGN_OR_RETURN(options.streams.unshard, ops->NewStream());
        FLATPARAM_ASSIGN_OR_RETURN(options.streams.post_backward,
                                   ops->NewStream());
      }
      FLATPARAM_ASSIGN_OR_RETURN(
          std::unique_ptr<FlatParamHandle> handle,
          FlatParamHandle::Create(layout, refs, shard, replicate, ops,
                                  options));
      RankContext ctx{comm, comm.rank(), *handle, layout, *ops};
      ran = fn(ctx);
    }
    if (!ran.ok() || !s.sim_device) return ran;
    FLATPARAM_RETURN_IF_ERROR(sim_ops.Synchronize());
    return sim_ops.CheckNoRaces();
  });
  if (world_out != nullptr) *world_out = std::move(world);
  return status;
}

absl::Status AddGradients(const Scenario& s, RankContext& ctx, int iter) {
  for (size_t i = 0; i < ctx.layout.params().size(); ++i) {
    const ParamInfo& p = ctx.layout.params()[i];
    if (!ctx.handle.requires_grad(static_cast<int>(i))) continue;
    std::vector<float> g(p.numel);
    for (int64_t k = 0; k < p.numel; ++k) {
      g[k] = GradValue(s, iter, ctx.world_rank, static_cast<int>(i), k);
    }
    FLATPARAM_RETURN_IF_ERROR(ctx.handle.AccumulateGrad(
        static_cast<int>(i),
        ConstBufferRef{g.data(), p.numel, DType::kFloat32, Device::Host()}));
  }
  return absl::OkStatus();
}

absl::Status RunIteration(const Scenario& s, RankContext& ctx, int iter,
                          bool sync) {
  FLATPARAM_RETURN_IF_ERROR(ctx.handle.PreForward());
  FLATPARAM_RETURN_IF_ERROR(ctx.handle.PostForward());
  FLATPARAM_RETURN_IF_ERROR(ctx.handle.PreBackward());
  FLATPARAM_RETURN_IF_ERROR(AddGradients(s, ctx, iter));
  FLATPARAM_RETURN_IF_ERROR(ctx.handle.PostBackward(sync));
  return ctx.handle.FinalizeBackward(sync);
}

std::vector<double> ReadValues(ConstBufferRef b) {
  std::vector<double> v(b.count);
  for (int64_t i = 0; i < b.count; ++i) {
    v[i] = LoadAsDouble(b.data, b.dtype, i);
  }
  return v;
}

void WriteValues(BufferRef b, const std::vector<double>& values) {
  for (int64_t i = 0; i < b.count; ++i) {
    StoreFromDouble(b.data, b.dtype, i, values[i]);
  }
}

double RoundTo(DType dtype, double v) {
  unsigned char bytes[8];
  StoreFromDouble(bytes, dtype, 0, v);
  return LoadAsDouble(bytes, dtype, 0);
}

// float32 compute: a float64 result of one operation on float32 operands,
// rounded to float32, is the float32 result (53 >= 2 * 24 + 2 bits).
double AddIn(DType dtype, double a, double b) {
  if (dtype == DType::kFloat64) return a + b;
  return RoundTo(dtype, static_cast<float>(a) + static_cast<float>(b));
}

double DivIn(DType dtype, double a, double factor) {
  if (dtype == DType::kFloat64) return a / factor;
  return RoundTo(dtype, static_cast<float>(a) / static_cast<float>(factor));
}

std::vector<double> LocalGradient(const Scenario& s,
                                  const FlatParamLayout& layout,
                                  DType param_dtype, int rank,
                                  const std::vector<int>& iters) {
  const int64_t n = UsesShardedStrategy(s.strategy)
                        ? layout.padded_unsharded_numel()
                        : layout.unpadded_unsharded_numel();
  std::vector<double> g(n, 0.0);
  for (int iter : iters) {
    for (size_t i = 0; i < layout.params().size(); ++i) {
      const ParamInfo& p = layout.params()[i];
      if (!p.requires_grad) continue;
      for (int64_t k = 0; k < p.numel; ++k) {
        const double x = RoundTo(
            param_dtype, GradValue(s, iter, rank, static_cast<int>(i), k));
        g[p.offset + k] = AddIn(param_dtype, g[p.offset + k], x);
      }
    }
  }
  return g;
}

std::vector<double> ReducedShard(const Scenario& s,
                                 const FlatParamLayout& layout,
                                 const std::vector<std::vector<double>>& local,
                                 int shard_rank, DType reduce_dtype,
                                 DType accum_dtype, double predivide,
                                 double postdivide) {
  const bool sharded = UsesShardedStrategy(s.strategy);
  const int64_t chunk = layout.sharded_numel();
  const int64_t begin = sharded ? shard_rank * chunk : 0;
  const int replicas = s.hybrid() ? s.replicate_size : 1;
  const int group = sharded ? s.shard_size : s.world_size();
  std::vector<double> out(chunk);
  for (int64_t j = 0; j < chunk; ++j) {
    double total = 0;
    for (int q = 0; q < replicas; ++q) {
      double partial = 0;
      for (int r = 0; r < group; ++r) {
        double v = RoundTo(reduce_dtype, local[q * group + r][begin + j]);
        if (predivide > 1) v = DivIn(reduce_dtype, v, predivide);
        partial = r == 0 ? v : AddIn(reduce_dtype, partial, v);
      }
      total = q == 0 ? partial : AddIn(reduce_dtype, total, partial);
    }
    if (postdivide > 1) total = DivIn(reduce_dtype, total, postdivide);
    out[j] = RoundTo(accum_dtype, total);
  }
  return out;
}

}  // namespace testing_handle
}  // namespace flatparam
