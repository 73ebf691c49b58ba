#include "flatparam/runtime.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <utility>

#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "comm/forwarding_communicator.h"
#include "flatparam/base/dtype.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/internal/handle_test_hooks.h"
#include "flatparam/internal/on_stream.h"

namespace flatparam {
namespace {

using internal_handle::OnStream;

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

absl::Status WithContext(const absl::Status& status, absl::string_view what) {
  if (status.ok()) return status;
  return absl::Status(status.code(),
                      absl::StrFormat("%s: %s", what, status.message()));
}

std::string QuotedUnit(const std::string& unit) {
  return unit.empty() ? "<root>" : absl::StrFormat("\"%s\"", unit);
}

// ||x||_p of float32 values, accumulated in double and rounded to float32
// (torch.linalg.vector_norm(x, p, dtype=torch.float32)).
float VectorNorm(const std::vector<float>& x, double p) {
  if (std::isinf(p)) {
    float m = 0.0f;
    for (float v : x) {
      const float a = std::fabs(v);
      // NaN propagates, as torch's max reduction does.
      if (std::isnan(a) || a > m) m = a;
      if (std::isnan(m)) break;
    }
    return m;
  }
  double acc = 0.0;
  for (float v : x) {
    const double a = std::fabs(static_cast<double>(v));
    acc += p == 1.0 ? a : p == 2.0 ? a * a : std::pow(a, p);
  }
  const double norm = p == 1.0   ? acc
                      : p == 2.0 ? std::sqrt(acc)
                                 : std::pow(acc, 1.0 / p);
  return static_cast<float>(norm);
}

// x ** p for a float32 tensor and a Python float (torch's pow special-cases
// 1 and 2).
float PowF(float x, double p) {
  if (p == 1.0) return x;
  if (p == 2.0) return x * x;
  if (p == 0.5) return std::sqrt(x);
  return std::pow(x, static_cast<float>(p));
}

// `value` rounded to `dtype` (as `tensor.to(dtype)`), as a double.
double RoundToDType(float value, DType dtype) {
  unsigned char storage[8];
  HostCast(storage, dtype, &value, DType::kFloat32, 1);
  double out = 0;
  HostCast(&out, DType::kFloat64, storage, dtype, 1);
  return out;
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

FsdpRuntime::FsdpRuntime(const ModelLayout& layout, DeviceOps* device,
                         const RuntimeOptions& options)
    : layout_(layout),
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
  auto rt =
      std::unique_ptr<FsdpRuntime>(new FsdpRuntime(layout, device, options));
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
    absl::StatusOr<std::unique_ptr<FlatParamHandle>> handle =
        FlatParamHandle::Create(l, *initial, rt->shard_group_.get(),
                                rt->replicate_group_.get(), device,
                                handle_options);
    if (release) release(u);
    FLATPARAM_RETURN_IF_ERROR(WithContext(
        handle.status(),
        absl::StrFormat("FsdpRuntime: unit %d (%s)", u, QuotedUnit(l.unit()))));
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
  rt->Observe(-1);
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

absl::Status FsdpRuntime::Track(
    int unit, const std::function<absl::Status(FlatParamHandle&)>& call) {
  FlatParamHandle& h = *handles_[unit];
  h.ResetPeakMemory();
  absl::Status status = call(h);
  Observe(unit);
  return status;
}

// Only the called handle allocated or freed since the last observation, so
// the model-wide bytes during the call were the others' current bytes plus
// the called handle's, whose peak during the call its tracker holds.
void FsdpRuntime::Observe(int called) {
  MemoryStats others;
  for (int u = 0; u < num_units(); ++u) {
    if (u == called) continue;
    const MemoryStats& m = handles_[u]->memory();
    for (int c = 0; c < kNumMemoryCategories; ++c) {
      others.current[c] += m.current[c];
    }
    others.compute_current += m.compute_current;
    others.offload_current += m.offload_current;
  }
  const MemoryStats mine =
      called >= 0 ? handles_[called]->memory() : MemoryStats{};
  for (int c = 0; c < kNumMemoryCategories; ++c) {
    peak_.peak[c] = std::max(peak_.peak[c], others.current[c] + mine.peak[c]);
  }
  peak_.compute_peak =
      std::max(peak_.compute_peak, others.compute_current + mine.compute_peak);
  peak_.offload_peak =
      std::max(peak_.offload_peak, others.offload_current + mine.offload_peak);
}

MemoryStats FsdpRuntime::memory() const {
  MemoryStats out;
  for (const auto& h : handles_) {
    const MemoryStats& m = h->memory();
    for (int c = 0; c < kNumMemoryCategories; ++c) {
      out.current[c] += m.current[c];
    }
    out.compute_current += m.compute_current;
    out.offload_current += m.offload_current;
  }
  // Direct handle calls since the last observation may have raised the
  // current bytes past the recorded peak.
  for (int c = 0; c < kNumMemoryCategories; ++c) {
    out.peak[c] = std::max(peak_.peak[c], out.current[c]);
  }
  out.compute_peak = std::max(peak_.compute_peak, out.compute_current);
  out.offload_peak = std::max(peak_.offload_peak, out.offload_current);
  return out;
}

void FsdpRuntime::ResetPeakMemory() {
  const MemoryStats now = memory();
  peak_.peak = now.current;
  peak_.compute_peak = now.compute_current;
  peak_.offload_peak = now.offload_current;
}

// ---------------------------------------------------------------------------
// Iterations and the execution order

absl::Status FsdpRuntime::Limited(
    int unit, const std::function<absl::Status(FlatParamHandle&)>& call) {
  FlatParamHandle& h = *handles_[unit];
  const size_t limit = static_cast<size_t>(options_.limit_all_gathers);
  if (limit > 0 && !h.is_unsharded() && h.NeedsUnshard() &&
      free_events_.size() >= limit) {
    const Event oldest = free_events_.front();
    free_events_.pop_front();
    FLATPARAM_RETURN_IF_ERROR(device_->SynchronizeEvent(oldest));
  }
  const bool held = h.uses_sharded_strategy() && !h.NeedsUnshard();
  FLATPARAM_RETURN_IF_ERROR(Track(unit, call));
  if (limit > 0 && held && h.NeedsUnshard()) {
    FLATPARAM_ASSIGN_OR_RETURN(
        Event freed, device_->RecordEvent(h.options().streams.compute));
    free_events_.push_back(freed);
  }
  return absl::OkStatus();
}

absl::Status FsdpRuntime::UnshardStreamWaitsForCompute() {
  // The optimizer's (and the caller's) updates of the local shards come
  // before any unshard of the iteration: one wait for every unit.
  const HandleStreams& streams = handles_[0]->options().streams;
  if (streams.unshard != streams.compute &&
      !internal_handle::IsSkippedForTesting(
          internal_handle::SkippedOrdering::kUnshardWaitsForCompute)) {
    FLATPARAM_ASSIGN_OR_RETURN(Event updated,
                               device_->RecordEvent(streams.compute));
    FLATPARAM_RETURN_IF_ERROR(device_->WaitEvent(streams.unshard, updated));
  }
  for (auto& h : handles_) h->NoteUnshardStreamWaitedForCompute();
  return absl::OkStatus();
}

absl::Status FsdpRuntime::BeginRetainedBackward() {
  phase_ = Phase::kBackward;
  // PyTorch reads `_sync_gradients` in each hook: this backward's own.
  sync_ = require_sync_;
  // The forward's post-forward order stays: prefetch follows it again.
  std::fill(ran_pre_backward_.begin(), ran_pre_backward_.end(), 0);
  prefetched_.clear();
  reducing_.clear();
  return UnshardStreamWaitsForCompute();
}

void FsdpRuntime::BeginIteration() {
  phase_ = Phase::kForward;
  backward_may_rerun_ = false;
  forward_pass_ = 0;
  // Until a backward fixes it, each iteration records the order afresh
  // (a forward-only pass, e.g. validation, does not fix it).
  if (!order_fixed_) {
    forward_order_.clear();
    std::fill(forward_index_.begin(), forward_index_.end(), -1);
  }
  // PyTorch reads `_sync_gradients` in each hook; fixing it per iteration
  // keeps one iteration's units consistent.
  sync_ = require_sync_;
  forward_position_ = 0;
  post_forward_order_.clear();
  std::fill(post_forward_index_.begin(), post_forward_index_.end(), -1);
  std::fill(ran_pre_forward_.begin(), ran_pre_forward_.end(), 0);
  std::fill(ran_pre_backward_.begin(), ran_pre_backward_.end(), 0);
  prefetched_.clear();
  reducing_.clear();
}

std::optional<std::string> FsdpRuntime::OrderDeviation(int unit) const {
  if (!order_fixed_) return std::nullopt;
  const int position = phase_ == Phase::kIdle ? 0 : forward_position_;
  if (position < static_cast<int>(forward_order_.size()) &&
      forward_order_[position] == unit) {
    return std::nullopt;
  }
  const std::string expected =
      position < static_cast<int>(forward_order_.size())
          ? UnitName(forward_order_[position])
          : std::string("no further unit");
  return absl::StrFormat(
      "iteration %d runs %s as forward unit #%d, but the first training "
      "iteration ran %s there (recorded order: %s)",
      stats_.iterations + 1, UnitName(unit), position, expected,
      absl::StrJoin(forward_order_, ", "));
}

absl::Status FsdpRuntime::PreForward(int unit) {
  FLATPARAM_RETURN_IF_ERROR(CheckUnit("PreForward", unit));
  const bool recompute = phase_ == Phase::kBackward;
  // The unit that began the iteration's forward (the root, when the model
  // has one) running again begins another forward in the same iteration
  // (two forwards before one backward); any other unit running again is a
  // module used twice in one forward.
  const bool another_forward = phase_ == Phase::kForward && !recompute &&
                               unit == first_forward_unit_ &&
                               ran_pre_forward_[unit] != 0;
  const bool first_use =
      !recompute && (phase_ == Phase::kIdle || !ran_pre_forward_[unit]);
  // PyTorch records and checks the order only in training
  // (`_ExecOrderData.record_pre_forward(handle, is_training)`), and only
  // for the iteration's first forward.
  const bool ordered = first_use && handles_[unit]->training() &&
                       (phase_ == Phase::kIdle || forward_pass_ == 0);
  if (ordered) {
    if (std::optional<std::string> deviation = OrderDeviation(unit)) {
      ++stats_.exec_order_deviations;
      if (options_.exec_order == ExecOrderCheck::kError) {
        return absl::FailedPreconditionError(absl::StrFormat(
            "FsdpRuntime: PreForward: execution order changed: %s",
            *deviation));
      }
      if (options_.exec_order == ExecOrderCheck::kWarn && !warned_order_) {
        warned_order_ = true;
        std::fprintf(stderr,
                     "flatparam warning: FsdpRuntime: the forward order "
                     "changed, so prefetching may target the wrong units "
                     "(warned once): %s\n",
                     deviation->c_str());
      }
    }
  }
  if (phase_ == Phase::kIdle) {
    BeginIteration();
    first_forward_unit_ = unit;
    FLATPARAM_RETURN_IF_ERROR(UnshardStreamWaitsForCompute());
  } else if (another_forward) {
    ++forward_pass_;
    std::fill(ran_pre_forward_.begin(), ran_pre_forward_.end(), 0);
  }
  FLATPARAM_RETURN_IF_ERROR(
      WithUnit(Limited(unit, [](FlatParamHandle& h) { return h.PreForward(); }),
               "PreForward", unit));
  // The pre-hook consumes a prefetch, a recompute's too.
  prefetched_.erase(std::remove(prefetched_.begin(), prefetched_.end(), unit),
                    prefetched_.end());
  if (recompute) return absl::OkStatus();
  ran_pre_forward_[unit] = 1;
  if (ordered) {
    ++forward_position_;
    if (!order_fixed_) {
      forward_index_[unit] = static_cast<int>(forward_order_.size());
      forward_order_.push_back(unit);
    }
  }
  if (!options_.forward_prefetch || !order_fixed_ || forward_index_[unit] < 0) {
    return absl::OkStatus();
  }
  std::vector<int> candidates;
  const int n = static_cast<int>(forward_order_.size());
  for (int i = forward_index_[unit] + 1;
       i < n && i <= forward_index_[unit] + options_.prefetch_depth; ++i) {
    const int v = forward_order_[i];
    if (!ran_pre_forward_[v]) candidates.push_back(v);
  }
  return Prefetch(candidates);
}

absl::Status FsdpRuntime::PostForward(int unit) {
  FLATPARAM_RETURN_IF_ERROR(CheckUnit("PostForward", unit));
  const bool is_root = root_.has_value() && *root_ == unit;
  FLATPARAM_RETURN_IF_ERROR(WithUnit(
      Limited(unit,
              [is_root](FlatParamHandle& h) { return h.PostForward(is_root); }),
      "PostForward", unit));
  if (phase_ == Phase::kForward && post_forward_index_[unit] < 0) {
    post_forward_index_[unit] = static_cast<int>(post_forward_order_.size());
    post_forward_order_.push_back(unit);
  }
  return absl::OkStatus();
}

absl::Status FsdpRuntime::PreBackward(int unit) {
  FLATPARAM_RETURN_IF_ERROR(CheckUnit("PreBackward", unit));
  if (phase_ == Phase::kIdle && backward_may_rerun_) {
    FLATPARAM_RETURN_IF_ERROR(BeginRetainedBackward());
  } else if (phase_ == Phase::kIdle) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "FsdpRuntime: PreBackward of %s: no forward ran in this iteration "
        "(PreForward begins one, FinalizeBackward ends it; a further "
        "backward over the same forward follows a backward)",
        UnitName(unit)));
  }
  FLATPARAM_RETURN_IF_ERROR(WithUnit(
      Limited(unit, [](FlatParamHandle& h) { return h.PreBackward(); }),
      "PreBackward", unit));
  phase_ = Phase::kBackward;
  ran_pre_backward_[unit] = 1;
  prefetched_.erase(std::remove(prefetched_.begin(), prefetched_.end(), unit),
                    prefetched_.end());
  if (options_.backward_prefetch != BackwardPrefetch::kBackwardPre) {
    return absl::OkStatus();
  }
  std::vector<int> candidates;
  for (int i = post_forward_index_[unit] - 1;
       post_forward_index_[unit] >= 0 && i >= 0 &&
       i >= post_forward_index_[unit] - options_.prefetch_depth;
       --i) {
    const int v = post_forward_order_[i];
    if (WillRunPreBackward(v)) candidates.push_back(v);
  }
  return Prefetch(candidates);
}

absl::Status FsdpRuntime::PostBackward(int unit) {
  FLATPARAM_RETURN_IF_ERROR(CheckUnit("PostBackward", unit));
  const bool sync = sync_;
  FLATPARAM_RETURN_IF_ERROR(WithUnit(
      Limited(unit,
              [sync](FlatParamHandle& h) { return h.PostBackwardAsync(sync); }),
      "PostBackward", unit));
  std::vector<int> earlier;
  earlier.swap(reducing_);
  if (handles_[unit]->reduce_pending()) reducing_.push_back(unit);
  if (options_.backward_prefetch == BackwardPrefetch::kBackwardPost) {
    std::vector<int> candidates;
    for (int i = post_forward_index_[unit] - 1;
         post_forward_index_[unit] >= 0 && i >= 0 &&
         i >= post_forward_index_[unit] - options_.prefetch_depth;
         --i) {
      const int v = post_forward_order_[i];
      if (WillRunPreBackward(v)) candidates.push_back(v);
    }
    FLATPARAM_RETURN_IF_ERROR(Prefetch(candidates));
  }
  // The earlier reductions overlapped this unit's backward; finishing them
  // now frees their unsharded gradients.
  for (int v : earlier) {
    FLATPARAM_RETURN_IF_ERROR(WithUnit(
        Track(v, [](FlatParamHandle& h) { return h.FinishReduceGrad(); }),
        "finishing the reduction", v));
  }
  return absl::OkStatus();
}

bool FsdpRuntime::WillRunPreBackward(int unit) const {
  return !ran_pre_backward_[unit] && last_backward_ran_[unit];
}

absl::Status FsdpRuntime::Prefetch(const std::vector<int>& candidates) {
  const size_t limit = static_cast<size_t>(options_.limit_all_gathers);
  for (int v : candidates) {
    FlatParamHandle& h = *handles_[v];
    if (h.training_state() != HandleTrainingState::kIdle || h.is_unsharded() ||
        h.unshard_pending()) {
      continue;
    }
    if (h.NeedsUnshard() && limit > 0 && prefetched_.size() >= limit) {
      // Later candidates are further ahead: leave them for later too.
      ++stats_.prefetches_over_limit;
      break;
    }
    FLATPARAM_RETURN_IF_ERROR(WithUnit(
        Limited(v, [](FlatParamHandle& h) { return h.StartUnshard(); }),
        "prefetch", v));
    ++stats_.prefetches;
    if (h.unshard_pending()) {
      ++stats_.prefetched_all_gathers;
      prefetched_.push_back(v);
      stats_.max_all_gathers_in_flight =
          std::max(stats_.max_all_gathers_in_flight,
                   static_cast<int>(prefetched_.size()));
    }
  }
  return absl::OkStatus();
}

absl::Status FsdpRuntime::FinalizeBackward() {
  const bool sync = phase_ == Phase::kIdle ? require_sync_ : sync_;
  absl::Status first = absl::OkStatus();
  for (int u = 0; u < num_units(); ++u) {
    absl::Status status = WithUnit(
        Limited(
            u, [sync](FlatParamHandle& h) { return h.FinalizeBackward(sync); }),
        "FinalizeBackward", u);
    if (first.ok()) first = status;
  }
  if (phase_ != Phase::kIdle) ++stats_.iterations;
  // PyTorch fixes the order in its post-backward final callback: only a
  // pass with a backward (in training) fixes it.
  if (phase_ == Phase::kBackward && !forward_order_.empty()) {
    order_fixed_ = true;
  }
  if (phase_ == Phase::kBackward) last_backward_ran_ = ran_pre_backward_;
  backward_may_rerun_ = phase_ == Phase::kBackward;
  phase_ = Phase::kIdle;
  prefetched_.clear();
  reducing_.clear();
  return first;
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

// ---------------------------------------------------------------------------
// Gradient clipping

absl::Status FsdpRuntime::AllReduceScalar(float* value, ReduceOp op) {
  ReduceOptions reduce;
  static_cast<CollectiveOptions&>(reduce) = options_.collective_options;
  reduce.op = op;
  const Device dev = device_->device();
  if (dev == Device::Host()) {
    const BufferRef buf{value, 1, DType::kFloat32, Device::Host()};
    return shard_group_->AllReduce(buf, buf, reduce)->Wait();
  }
  // Device backends (NCCL) reduce device buffers only.
  FLATPARAM_ASSIGN_OR_RETURN(DeviceBuffer staging,
                             device_->Allocate(dev, sizeof(float)));
  const BufferRef buf = staging.As(DType::kFloat32);
  const ConstBufferRef host{value, 1, DType::kFloat32, Device::Host()};
  FLATPARAM_RETURN_IF_ERROR(device_->Copy(buf, host));
  FLATPARAM_RETURN_IF_ERROR(device_->Synchronize());
  FLATPARAM_RETURN_IF_ERROR(shard_group_->AllReduce(buf, buf, reduce)->Wait());
  FLATPARAM_RETURN_IF_ERROR(
      device_->Copy(BufferRef{value, 1, DType::kFloat32, Device::Host()}, buf));
  return device_->Synchronize();
}

absl::StatusOr<double> FsdpRuntime::ClipGradNorm(double max_norm,
                                                 double norm_type) {
  // Any positive p, as clip_grad_norm_ takes it (0 < p < 1 is not a norm,
  // but the same formula).
  if (!(norm_type > 0.0)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "FsdpRuntime: ClipGradNorm: norm_type must be positive (or "
        "infinity), got %g",
        norm_type));
  }
  if (!(max_norm >= 0.0)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "FsdpRuntime: ClipGradNorm: max_norm must be >= 0, got %g", max_norm));
  }
  if (phase_ != Phase::kIdle) {
    return absl::FailedPreconditionError(
        "FsdpRuntime: ClipGradNorm: an iteration is in progress (call it "
        "after FinalizeBackward)");
  }
  const bool inf = std::isinf(norm_type);
  // The handles leave the sharded gradients ordered on their compute stream
  // (FinalizeBackward), where the optimizer runs too: read and scale there.
  OnStream on_compute(device_, handles_[0]->options().streams.compute);
  FLATPARAM_RETURN_IF_ERROR(on_compute.status());

  // 1. The gradients, as PyTorch's `param.grad` / `flat_param.grad`.
  std::vector<BufferRef> sharded, nonsharded;
  for (const auto& handle : handles_) {
    const FlatParamHandle& h = *handle;
    std::vector<BufferRef>& target =
        h.uses_sharded_strategy() ? sharded : nonsharded;
    if (h.layout().options().align_addresses) {
      for (int i = 0; i < static_cast<int>(h.layout().params().size()); ++i) {
        FLATPARAM_ASSIGN_OR_RETURN(std::optional<BufferRef> g,
                                   h.ShardedGradView(i));
        if (g.has_value()) target.push_back(*g);
      }
    } else if (std::optional<BufferRef> g = h.sharded_grad()) {
      target.push_back(*g);
    }
  }

  // 2. Local norms in float32.
  auto local_norm =
      [&](const std::vector<BufferRef>& grads) -> absl::StatusOr<float> {
    std::vector<float> norms;
    std::vector<float> values;
    std::vector<unsigned char> staging;
    for (const BufferRef& g : grads) {
      const void* host = g.data;
      if (g.device != Device::Host()) {
        staging.resize(g.bytes());
        FLATPARAM_RETURN_IF_ERROR(device_->Copy(
            BufferRef{staging.data(), g.count, g.dtype, Device::Host()}, g));
        host = staging.data();
      }
      values.resize(g.count);
      if (g.count > 0) {
        HostCast(values.data(), DType::kFloat32, host, g.dtype, g.count);
      }
      norms.push_back(VectorNorm(values, norm_type));
    }
    return VectorNorm(norms, norm_type);
  };
  FLATPARAM_ASSIGN_OR_RETURN(const float local_sharded, local_norm(sharded));
  FLATPARAM_ASSIGN_OR_RETURN(const float local_nonsharded,
                             local_norm(nonsharded));

  // 3. The total norm. All units share the layout's strategy; PyTorch
  // communicates only when some unit is sharded.
  const bool any_sharded = UsesShardedStrategy(layout_.options().strategy);
  float total = 0.0f;
  if (inf) {
    total = std::isnan(local_sharded) || local_sharded > local_nonsharded
                ? local_sharded
                : local_nonsharded;
    if (any_sharded) {
      FLATPARAM_RETURN_IF_ERROR(WithContext(
          AllReduceScalar(&total, ReduceOp::kMax),
          "FsdpRuntime: ClipGradNorm: all-reduce of the local norm"));
    }
  } else {
    total = PowF(local_sharded, norm_type);
    if (any_sharded) {
      FLATPARAM_RETURN_IF_ERROR(WithContext(
          AllReduceScalar(&total, ReduceOp::kSum),
          "FsdpRuntime: ClipGradNorm: all-reduce of the local norm"));
    }
    total += PowF(local_nonsharded, norm_type);
    total = PowF(total, 1.0 / norm_type);
  }

  // 4. `max_norm / (total + 1e-6)` is `(total + 1e-6).reciprocal() *
  // max_norm` for a tensor, in float32; then clamped to 1 (NaN stays NaN).
  const float denominator = total + 1e-6f;
  const float coef = (1.0f / denominator) * static_cast<float>(max_norm);
  const float clamped = coef > 1.0f ? 1.0f : coef;
  for (const std::vector<BufferRef>* grads : {&sharded, &nonsharded}) {
    for (const BufferRef& g : *grads) {
      if (g.count == 0) continue;
      if (std::isnan(clamped)) {
        // g * NaN is NaN everywhere; DeviceOps::Scale takes finite factors.
        FLATPARAM_RETURN_IF_ERROR(
            device_->Fill(g, std::numeric_limits<double>::quiet_NaN()));
        continue;
      }
      FLATPARAM_RETURN_IF_ERROR(device_->Scale(g, ScaleOp::kMultiply,
                                               RoundToDType(clamped, g.dtype)));
    }
  }
  FLATPARAM_RETURN_IF_ERROR(device_->Synchronize());
  return static_cast<double>(total);
}

}  // namespace flatparam
