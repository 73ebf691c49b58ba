#include "flatparam/runtime.h"

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "comm/communicator.h"
#include "comm/forwarding_communicator.h"
#include "flatparam/base/buffer.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/device/device.h"
#include "flatparam/handle.h"
#include "flatparam/internal/runtime_internal.h"
#include "flatparam/layout.h"
#include "flatparam/model_layout.h"

// FsdpRuntime's creation (the counted groups, one handle per unit), its
// units and parameters by name, and ZeroGrad. The hooks are in
// runtime_hooks.cc, the memory accounting in runtime_memory.cc, gradient
// clipping in runtime_clip.cc; internal/runtime_internal.h lists them.

namespace flatparam {

using internal_runtime::WithContext;

namespace {

// Forwards every call to `inner` and counts the buffer collectives in
// `stats`. Neither is owned.
class CountingCommunicator final : public ForwardingCommunicator {
 public:
  CountingCommunicator(Communicator* inner, CommStats* stats)
      : ForwardingCommunicator(inner), stats_(stats) {}

  std::unique_ptr<Work> AllGather(ConstBufferRef input, BufferRef output,
                                  const CollectiveOptions& options) override {
    Count(stats_->all_gather, output.bytes(), 1);
    return inner().AllGather(input, output, options);
  }
  std::unique_ptr<Work> ReduceScatter(ConstBufferRef input, BufferRef output,
                                      const ReduceOptions& options) override {
    Count(stats_->reduce_scatter, input.bytes(), 1);
    return inner().ReduceScatter(input, output, options);
  }
  std::unique_ptr<Work> AllReduce(ConstBufferRef input, BufferRef output,
                                  const ReduceOptions& options) override {
    Count(stats_->all_reduce, input.bytes(), 2);
    return inner().AllReduce(input, output, options);
  }

 private:
  // nccl-tests' bus factor: `factor` * (n - 1) / n.
  void Count(CollectiveTraffic& t, int64_t bytes, int factor) const {
    const int n = size();
    ++t.calls;
    t.bytes += bytes;
    t.sent_bytes += bytes * factor * (n - 1) / n;
  }

  CommStats* stats_;
};

std::string QuotedUnit(const std::string& unit) {
  return unit.empty() ? "<root>" : absl::StrFormat("\"%s\"", unit);
}

}  // namespace

absl::string_view BackwardPrefetchName(BackwardPrefetch prefetch) {
  switch (prefetch) {
    case BackwardPrefetch::kNone:
      return "NONE";
    case BackwardPrefetch::kBackwardPre:
      return "BACKWARD_PRE";
    case BackwardPrefetch::kBackwardPost:
      return "BACKWARD_POST";
  }
  return "UNKNOWN";
}

FsdpRuntime::FsdpRuntime(std::shared_ptr<const ModelLayout> layout,
                         DeviceOps* device, const RuntimeOptions& options)
    : layout_storage_(std::move(layout)),
      layout_(*layout_storage_),
      device_(device),
      options_(options),
      comm_stats_(std::make_unique<CommStats>()) {}

FsdpRuntime::~FsdpRuntime() {
  // Handles wait for their pending collectives when destroyed; they use the
  // counting groups, so they go first.
  handles_.clear();
}

namespace {

absl::Status CheckInitialCount(const FlatParamLayout& l, int unit,
                               size_t count) {
  if (count == l.params().size()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrFormat(
      "FsdpRuntime: %d initial parameters for unit %d (%s), which has %d",
      count, unit, QuotedUnit(l.unit()), l.params().size()));
}

}  // namespace

absl::StatusOr<std::unique_ptr<FsdpRuntime>> FsdpRuntime::Create(
    const ModelLayout& layout,
    absl::Span<const std::vector<ConstBufferRef>> initial_params,
    Communicator* world, DeviceOps* device, const HandleOptions& handle_options,
    const RuntimeOptions& options) {
  const std::vector<FlatParamLayout>& flat = layout.flat_params();
  if (!flat.empty() && initial_params.size() != flat.size()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "FsdpRuntime: %d lists of initial parameters for %d flat parameters",
        initial_params.size(), flat.size()));
  }
  // Checked before anything communicates (CreateUnitByUnit checks each
  // unit's as it comes).
  for (size_t u = 0; u < initial_params.size(); ++u) {
    FLATPARAM_RETURN_IF_ERROR(CheckInitialCount(flat[u], static_cast<int>(u),
                                                initial_params[u].size()));
  }
  return CreateUnitByUnit(
      layout,
      [&](int u) -> absl::StatusOr<std::vector<ConstBufferRef>> {
        return initial_params[u];
      },
      nullptr, world, device, handle_options, options);
}

absl::StatusOr<std::unique_ptr<FsdpRuntime>> FsdpRuntime::CreateUnitByUnit(
    const ModelLayout& layout, const UnitParamsFn& unit_params,
    const std::function<void(int unit)>& release, Communicator* world,
    DeviceOps* device, const HandleOptions& handle_options,
    const RuntimeOptions& options) {
  return CreateUnitByUnit(std::make_shared<const ModelLayout>(layout),
                          unit_params, release, world, device, handle_options,
                          options);
}

absl::StatusOr<std::unique_ptr<FsdpRuntime>> FsdpRuntime::CreateUnitByUnit(
    std::shared_ptr<const ModelLayout> layout_storage,
    const UnitParamsFn& unit_params,
    const std::function<void(int unit)>& release, Communicator* world,
    DeviceOps* device, const HandleOptions& handle_options,
    const RuntimeOptions& options) {
  if (layout_storage == nullptr) {
    return absl::InvalidArgumentError("FsdpRuntime: the layout is null");
  }
  const ModelLayout& layout = *layout_storage;
  if (world == nullptr || device == nullptr) {
    return absl::InvalidArgumentError(
        "FsdpRuntime: the world communicator and the DeviceOps are required");
  }
  if (options.prefetch_depth < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("FsdpRuntime: prefetch_depth must be >= 1, got %d",
                        options.prefetch_depth));
  }
  if (options.limit_all_gathers < 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "FsdpRuntime: limit_all_gathers must be >= 0 (0 = unlimited), got %d",
        options.limit_all_gathers));
  }
  const std::vector<FlatParamLayout>& flat = layout.flat_params();
  if (flat.empty()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("FsdpRuntime: model \"%s\" has no flat parameters",
                        layout.spec().name));
  }
  const ShardingStrategy strategy = layout.options().strategy;
  const int64_t shard_size = layout.options().world_size;
  const bool hybrid = IsHybridStrategy(strategy);
  if (hybrid ? world->size() % shard_size != 0 : world->size() != shard_size) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "FsdpRuntime: the layout shards over %d ranks (%s) but the world has "
        "%d ranks%s",
        shard_size, ShardingStrategyName(strategy), world->size(),
        hybrid ? ", not a multiple" : ""));
  }
  auto rt = std::unique_ptr<FsdpRuntime>(
      new FsdpRuntime(layout_storage, device, options));
  rt->recorder_ = world->flight_recorder();
  Communicator* shard = world;
  Communicator* replicate = nullptr;
  if (hybrid) {
    FLATPARAM_ASSIGN_OR_RETURN(
        rt->groups_, MakeHybridGroups(*world, static_cast<int>(shard_size),
                                      options.collective_options));
    shard = rt->groups_.shard.get();
    replicate = rt->groups_.replicate.get();
  }
  rt->shard_group_ =
      std::make_unique<CountingCommunicator>(shard, rt->comm_stats_.get());
  if (replicate != nullptr) {
    rt->replicate_group_ = std::make_unique<CountingCommunicator>(
        replicate, rt->comm_stats_.get());
  }
  const int n = static_cast<int>(flat.size());
  for (int u = 0; u < n; ++u) {
    const FlatParamLayout& l = flat[u];
    absl::StatusOr<std::vector<ConstBufferRef>> initial = unit_params(u);
    FLATPARAM_RETURN_IF_ERROR(WithContext(
        initial.status(), absl::StrFormat("FsdpRuntime: initial parameters of "
                                          "unit %d (%s)",
                                          u, QuotedUnit(l.unit()))));
    FLATPARAM_RETURN_IF_ERROR(CheckInitialCount(l, u, initial->size()));
    absl::StatusOr<std::unique_ptr<FlatParamHandle>> handle;
    {
      ScopedCollectiveContext context(
          rt->recorder_,
          {l.unit().empty() ? "<root>" : l.unit(), u, CollectivePhase::kInit});
      // Shares the runtime's layout (the aliasing constructor).
      handle = FlatParamHandle::Create(
          std::shared_ptr<const FlatParamLayout>(layout_storage, &l), *initial,
          rt->shard_group_.get(), rt->replicate_group_.get(), device,
          handle_options);
    }
    if (release) release(u);
    FLATPARAM_RETURN_IF_ERROR(WithContext(
        handle.status(),
        absl::StrFormat("FsdpRuntime: unit %d (%s)", u, QuotedUnit(l.unit()))));
    (*handle)->ForwardMemoryTo(&rt->memory_);
    rt->handles_.push_back(*std::move(handle));
    rt->units_by_name_[l.unit()] = u;
    if (l.unit().empty()) rt->root_ = u;
    for (size_t i = 0; i < l.params().size(); ++i) {
      rt->params_by_fqn_[l.params()[i].fqn] =
          ParamLocation{u, static_cast<int>(i), /*shared=*/false};
    }
    for (const SharedParamInfo& s : l.shared_params()) {
      rt->params_by_fqn_[s.fqn] = ParamLocation{u, s.prim_index,
                                                /*shared=*/true};
    }
  }
  rt->forward_index_.assign(n, -1);
  rt->post_forward_index_.assign(n, -1);
  rt->ran_pre_forward_.assign(n, 0);
  rt->ran_pre_backward_.assign(n, 0);
  rt->last_backward_ran_.assign(n, 1);
  return rt;
}

absl::StatusOr<std::unique_ptr<FsdpRuntime>> FsdpRuntime::CreateFromNamedParams(
    const ModelLayout& layout,
    const std::map<std::string, ConstBufferRef>& params, Communicator* world,
    DeviceOps* device, const HandleOptions& handle_options,
    const RuntimeOptions& options) {
  std::map<std::string, bool> known;  // fqn -> tied
  for (const ParamSpec& p : layout.spec().params) {
    known[p.fqn] = !p.tied_to.empty();
  }
  for (const auto& [fqn, buffer] : params) {
    if (known.find(fqn) == known.end()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "FsdpRuntime: initial value for \"%s\", which is not a parameter of "
          "model \"%s\"",
          fqn, layout.spec().name));
    }
  }
  std::vector<std::vector<ConstBufferRef>> per_unit;
  for (const FlatParamLayout& l : layout.flat_params()) {
    std::vector<ConstBufferRef>& refs = per_unit.emplace_back();
    for (const ParamInfo& p : l.params()) {
      auto it = params.find(p.fqn);
      if (it == params.end()) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "FsdpRuntime: no initial value for parameter \"%s\" (unit %s)",
            p.fqn, QuotedUnit(l.unit())));
      }
      refs.push_back(it->second);
    }
  }
  return Create(layout, per_unit, world, device, handle_options, options);
}

// ---------------------------------------------------------------------------
// Helpers

std::optional<int> FsdpRuntime::root_unit() const { return root_; }

absl::StatusOr<int> FsdpRuntime::FindUnit(absl::string_view name) const {
  auto it = units_by_name_.find(name);
  if (it == units_by_name_.end()) {
    return absl::NotFoundError(absl::StrFormat(
        "FsdpRuntime: no flat parameter for unit \"%s\"", name));
  }
  return it->second;
}

std::string FsdpRuntime::UnitName(int unit) const {
  return absl::StrFormat("unit %d (%s)", unit,
                         QuotedUnit(layout_.flat_params()[unit].unit()));
}

ScopedCollectiveContext FsdpRuntime::Context(int unit,
                                             CollectivePhase phase) const {
  const std::string& name = layout_.flat_params()[unit].unit();
  return ScopedCollectiveContext(
      recorder_, {name.empty() ? std::string("<root>") : name, unit, phase});
}

absl::Status FsdpRuntime::CheckUnit(absl::string_view op, int unit) const {
  if (unit >= 0 && unit < num_units()) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrFormat("FsdpRuntime: %s: unit %d is out of range [0, %d)", op,
                      unit, num_units()));
}

absl::Status FsdpRuntime::WithUnit(absl::Status status, absl::string_view op,
                                   int unit) const {
  return WithContext(
      status, absl::StrFormat("FsdpRuntime: %s of %s", op, UnitName(unit)));
}

// ---------------------------------------------------------------------------
// Parameters by name

absl::StatusOr<ParamLocation> FsdpRuntime::Find(absl::string_view fqn) const {
  auto it = params_by_fqn_.find(fqn);
  if (it == params_by_fqn_.end()) {
    return absl::NotFoundError(absl::StrFormat(
        "FsdpRuntime: no flat parameter of model \"%s\" holds \"%s\"",
        layout_.spec().name, fqn));
  }
  return it->second;
}

absl::StatusOr<OrigParamView> FsdpRuntime::Param(absl::string_view fqn) const {
  FLATPARAM_ASSIGN_OR_RETURN(const ParamLocation loc, Find(fqn));
  return handles_[loc.unit]->Param(loc.index);
}

absl::StatusOr<BufferRef> FsdpRuntime::GradView(absl::string_view fqn) const {
  FLATPARAM_ASSIGN_OR_RETURN(const ParamLocation loc, Find(fqn));
  return handles_[loc.unit]->GradView(loc.index);
}

absl::StatusOr<std::optional<BufferRef>> FsdpRuntime::ShardedGradView(
    absl::string_view fqn) const {
  FLATPARAM_ASSIGN_OR_RETURN(const ParamLocation loc, Find(fqn));
  return handles_[loc.unit]->ShardedGradView(loc.index);
}

absl::Status FsdpRuntime::AccumulateGrad(absl::string_view fqn,
                                         ConstBufferRef grad) {
  FLATPARAM_ASSIGN_OR_RETURN(const ParamLocation loc, Find(fqn));
  return Track(loc.unit, [&](FlatParamHandle& h) {
    return h.AccumulateGrad(loc.index, grad);
  });
}

absl::Status FsdpRuntime::ZeroGrad(bool set_to_none) {
  for (int u = 0; u < num_units(); ++u) {
    FLATPARAM_RETURN_IF_ERROR(WithUnit(
        Track(u, [set_to_none](
                     FlatParamHandle& h) { return h.ZeroGrad(set_to_none); }),
        "ZeroGrad", u));
  }
  return absl::OkStatus();
}

}  // namespace flatparam
