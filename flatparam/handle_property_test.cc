// Properties of FlatParamHandle over generated layouts (verify/generators.h),
// world sizes, strategies and precisions, on the simulator: the unsharded
// flat parameter is Flatten's; the sharded gradient is the reference fold;
// summon-with-writeback changes exactly what was written, on every rank.
#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "flatparam/base/status_macros.h"
#include "flatparam/flatten.h"
#include "flatparam/handle.h"
#include "flatparam/layout.h"
#include "testing/handle_testutil.h"
#include "verify/generators.h"

namespace flatparam {
namespace {

using testing_handle::InitialParams;
using testing_handle::LocalGradient;
using testing_handle::MakeLayout;
using testing_handle::RankContext;
using testing_handle::ReadValues;
using testing_handle::ReducedShard;
using testing_handle::RunIteration;
using testing_handle::RunWithHandles;
using testing_handle::Scenario;
using testing_handle::WriteValues;

std::vector<unsigned char> Bytes(ConstBufferRef b) {
  const auto* p = static_cast<const unsigned char*>(b.data);
  return std::vector<unsigned char>(p, p + b.bytes());
}

rc::Gen<Scenario> GenScenario() {
  return rc::gen::exec([] {
    Scenario s;
    s.dtype = *rc::gen::element(DType::kFloat32, DType::kBFloat16)
                   .as("parameter dtype");
    s.specs = *verify::GenParamSpecs(s.dtype, verify::Scale::kData);
    s.strategy = *verify::GenShardingStrategy();
    s.shard_size = *rc::gen::inRange(1, 6).as("shard group size");
    s.replicate_size = IsHybridStrategy(s.strategy)
                           ? *rc::gen::inRange(1, 3).as("replicas")
                           : 1;
    s.align = *rc::gen::arbitrary<bool>().as("align addresses");
    const int precision = *rc::gen::inRange(0, 3).as("mixed precision");
    if (precision == 1) s.options.param_dtype = DType::kBFloat16;
    if (precision == 2) {
      s.options.param_dtype = DType::kFloat16;
      s.options.reduce_dtype = DType::kFloat32;
    }
    s.options.keep_low_precision_grads = *rc::gen::arbitrary<bool>();
    s.options.cpu_offload = *rc::gen::arbitrary<bool>();
    s.options.divide_in_collectives = *rc::gen::arbitrary<bool>();
    s.rounding_values = true;
    s.sim_seed = *rc::gen::arbitrary<uint64_t>();
    return s;
  });
}

RC_GTEST_PROP(HandleProperties, GatherReduceAndWriteback, ()) {
  const Scenario s = *GenScenario();
  RC_TAG(ShardingStrategyName(s.strategy));
  absl::StatusOr<FlatParamLayout> layout_or = MakeLayout(s);
  // Lists whose every parameter is zero-size have no flat parameter.
  RC_PRE(layout_or.ok());
  const FlatParamLayout& layout = *layout_or;
  const std::vector<HostTensor> params = InitialParams(s, layout);
  std::vector<ConstBufferRef> refs;
  for (const HostTensor& t : params) refs.push_back(t.cref());
  HostTensor flat =
      HostTensor::Flat(layout.dtype(), layout.unpadded_unsharded_numel());
  RC_ASSERT(Flatten(layout, refs, flat.ref()).ok());
  // The modification summon writes: negate every parameter element.
  std::vector<HostTensor> negated = params;
  for (HostTensor& t : negated) {
    for (int64_t k = 0; k < t.numel(); ++k) t.SetDouble(k, -t.GetDouble(k));
  }
  std::vector<ConstBufferRef> negated_refs;
  for (const HostTensor& t : negated) negated_refs.push_back(t.cref());

  const int world = s.world_size();
  std::vector<std::vector<unsigned char>> unsharded(world), shard_after(world),
      shard_want(world);
  std::vector<std::vector<double>> grads(world), want_grads(world);
  std::vector<int> ranks(world);
  DType param_dtype = layout.dtype(), reduce_dtype = layout.dtype();
  double pre = 1, post = 1;
  const absl::Status status =
      RunWithHandles(s, [&](RankContext& ctx) -> absl::Status {
        FlatParamHandle& h = ctx.handle;
        param_dtype = h.param_dtype();
        reduce_dtype = h.reduce_dtype();
        pre = h.gradient_predivide_factor();
        post = h.gradient_postdivide_factor();
        ranks[ctx.world_rank] = h.rank();
        FLATPARAM_RETURN_IF_ERROR(h.BeginSummonFullParams(true));
        unsharded[ctx.world_rank] = Bytes(*h.unsharded_flat_param());
        for (int i = 0; i < static_cast<int>(layout.params().size()); ++i) {
          FLATPARAM_ASSIGN_OR_RETURN(OrigParamView v, h.Param(i));
          WriteValues(v.data, ReadValues(ConstBufferRef{
                                  negated[i].data(), negated[i].numel(),
                                  negated[i].dtype(), Device::Host()}));
        }
        FLATPARAM_RETURN_IF_ERROR(h.EndSummonFullParams());
        shard_after[ctx.world_rank] = Bytes(h.sharded_param());
        HostTensor want =
            HostTensor::Flat(layout.dtype(), layout.sharded_numel());
        FLATPARAM_RETURN_IF_ERROR(
            FlattenShard(layout, negated_refs, h.rank(), want.ref()));
        shard_want[ctx.world_rank] = Bytes(ConstBufferRef{
            want.data(), want.numel(), want.dtype(), Device::Host()});
        FLATPARAM_RETURN_IF_ERROR(RunIteration(s, ctx, 0, true));
        if (layout.requires_grad()) {
          grads[ctx.world_rank] = ReadValues(*h.sharded_grad());
        } else if (h.sharded_grad().has_value()) {
          return absl::InternalError(
              "a gradient without parameters that "
              "require one");
        }
        return absl::OkStatus();
      });
  RC_ASSERT(status.ok());
  const std::vector<unsigned char> flat_bytes = Bytes(
      ConstBufferRef{flat.data(), flat.numel(), flat.dtype(), Device::Host()});
  std::vector<std::vector<double>> local;
  for (int w = 0; w < world; ++w) {
    local.push_back(LocalGradient(s, layout, param_dtype, w, {0}));
  }
  const bool no_shard_low = s.strategy == ShardingStrategy::kNoShard &&
                            s.options.keep_low_precision_grads &&
                            !s.options.cpu_offload;
  const DType accum = no_shard_low ? reduce_dtype : layout.dtype();
  for (int w = 0; w < world; ++w) {
    RC_ASSERT(unsharded[w] == flat_bytes);
    RC_ASSERT(shard_after[w] == shard_want[w]);
    if (!layout.requires_grad()) continue;
    std::vector<double> want = ReducedShard(s, layout, local, ranks[w],
                                            reduce_dtype, accum, pre, post);
    // keep_low_precision_grads: the optimizer sees param_dtype, except
    // NO_SHARD without offload, which PyTorch leaves in the reduce dtype.
    if (s.options.keep_low_precision_grads && !no_shard_low) {
      for (double& x : want) {
        x = testing_handle::RoundTo(param_dtype, x);
      }
    }
    RC_ASSERT(grads[w] == want);
  }
}

}  // namespace
}  // namespace flatparam
