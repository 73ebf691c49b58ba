// FSDP's optimizer state, full -> sharded without communication:
// ShardFullOptimState (PyTorch's `shard_full_optim_state_dict`), which
// plans (internal/shard_plan.h) and keeps this rank's shard.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"
#include "flatparam/base/dtype.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/flatten.h"
#include "flatparam/layout.h"
#include "flatparam/model_layout.h"
#include "flatparam/optim/fsdp_optim.h"
#include "flatparam/optim/internal/flat_plan.h"
#include "flatparam/optim/internal/flat_range.h"
#include "flatparam/optim/internal/shard_plan.h"
#include "flatparam/optim/internal/sharded_keys.h"
#include "flatparam/optim/internal/state_meta.h"
#include "flatparam/optim/optim_state.h"

namespace flatparam {
namespace optim {
namespace {

using internal_optim::AllocateOrigUnit;
using internal_optim::EmitPassthrough;
using internal_optim::FillsEmpty;
using internal_optim::FlattenRange;
using internal_optim::FlatUnitPlan;
using internal_optim::FromLayoutKeys;
using internal_optim::FullWindows;
using internal_optim::MetaOf;
using internal_optim::ModelIndex;
using internal_optim::OrigUnitOutput;
using internal_optim::OrigUnitPlan;
using internal_optim::PlanShard;
using internal_optim::RekeyedByName;
using internal_optim::ShardPlan;
using internal_optim::StateMeta;
using internal_optim::Window;

// ShardFullOptimState's work on a plan whose tensors are local.
OptimStateDict ShardLocally(const ModelIndex& index, const ShardPlan& plan,
                            int64_t rank, bool fill_empty) {
  OptimStateDict out;
  for (const FlatUnitPlan& u : plan.flat) {
    const FlatParamLayout& layout = index.unit(u.unit);
    const int64_t start = layout.shard_interval(rank).start;
    ParamState st = u.scalars;
    for (const auto& [name, dtype] : u.tensors) {
      HostTensor t = HostTensor::Flat(dtype, layout.sharded_numel());
      FlattenRange(layout, dtype, FullWindows(layout, u.params, name), start,
                   layout.sharded_numel(), kFlatParamPaddingValue, t.data());
      st[name] = std::move(t);
    }
    out.state[ParamKey(int64_t{u.unit})] = std::move(st);
  }
  for (const OrigUnitPlan& u : plan.orig) {
    const FlatParamLayout& layout = index.unit(u.unit);
    OrigUnitOutput o = AllocateOrigUnit(layout, u, rank, fill_empty);
    for (auto& [name, windows] : o.windows) {
      const size_t size = DTypeSize(u.tensors.at(name));
      for (size_t i = 0; i < windows.size(); ++i) {
        const Window& w = windows[i];
        if (w.data == nullptr || w.hi <= w.lo) continue;
        const HostTensor* src = u.params[i]->at(name).data();
        std::memcpy(w.data,
                    static_cast<const unsigned char*>(src->data()) +
                        w.lo * static_cast<int64_t>(size),
                    (w.hi - w.lo) * size);
      }
    }
    for (auto& [i, st] : o.states) {
      out.state[ParamKey(layout.params()[i].fqn)] = std::move(st);
    }
  }
  EmitPassthrough(plan, out);
  return out;
}

}  // namespace

absl::StatusOr<OptimStateDict> ShardFullOptimState(
    const ModelLayout& layout, const OptimStateDict& full, int64_t rank,
    const OptimStateOptions& options) {
  const int64_t w = layout.options().world_size;
  if (rank < 0 || rank >= w) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "rank %d is outside the layout's world of %d ranks", rank, w));
  }
  bool rekeyed = false;
  FLATPARAM_ASSIGN_OR_RETURN(OptimStateDict by_name,
                             RekeyedByName(layout, full, options, &rekeyed));
  const OptimStateDict& dict = rekeyed ? by_name : full;
  const ModelIndex index(layout, options.unmanaged_params);
  const StateMeta meta = MetaOf(dict.state);
  FLATPARAM_ASSIGN_OR_RETURN(
      ShardPlan plan, PlanShard(index, meta, dict.param_groups, options));
  return FromLayoutKeys(
      layout, ShardLocally(index, plan, rank, FillsEmpty(options)), options);
}

}  // namespace optim
}  // namespace flatparam
