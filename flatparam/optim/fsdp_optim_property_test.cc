// Property suite for FSDP's optimizer-state operations (fsdp_optim.h), on
// the simulator, for random models (verify/generators.h), layouts (world
// size, strategy, alignment, compute dtype) and full state dicts of every
// shape PyTorch's optimizers produce (optim_generators.h), on both paths:
//
//   * full -> shard on every rank -> consolidate gives the full dict back
//     bit for bit (flat path: with zeros for missing tensor states), on all
//     ranks or only rank 0, with and without a temporary-memory budget, and
//     within MaxTempBytes of temporary memory;
//   * resharding in memory: shard(W) -> consolidate -> shard(W') ->
//     consolidate gives the same dict;
//   * scatter from rank 0 equals sharding, on every rank;
//   * the flat path's shards are the flat parameter's layout exactly
//     (cross-checked against flatparam/flatten.h's FlattenShard);
//   * re-keying both ways is the identity, and an ID-keyed dict shards like
//     its name-keyed form.
//
// A failure prints the seed and the shrunk case; rerun with
//   bazel test //flatparam/optim:fsdp_optim_property_test
//     --test_env=RC_PARAMS="reproduce=<string printed on failure>"
#include <gtest/gtest.h>
#include <rapidcheck.h>
#include <rapidcheck/gtest.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "comm/communicator.h"
#include "flatparam/base/dtype.h"
#include "flatparam/flatten.h"
#include "flatparam/layout.h"
#include "flatparam/model_layout.h"
#include "flatparam/optim/fsdp_optim.h"
#include "flatparam/optim/optim_generators.h"
#include "flatparam/optim/optim_state.h"
#include "sim/sim.h"
#include "verify/generators.h"

namespace flatparam {
namespace optim {
namespace {

namespace gen = rc::gen;
using testing::ExpectedRoundTrip;
using testing::GenFullOptimStateDict;
using testing::UnmanagedParams;

// World sizes the simulator runs per case in well under a second.
rc::Gen<int64_t> GenSimWorldSize() {
  return gen::weightedElement<int64_t>(
      {{2, 1}, {4, 2}, {3, 3}, {4, 4}, {1, 5}, {2, 8}, {1, 13}});
}

// A wrapped data-sized model with a layout the simulator can run.
struct Case {
  ModelLayout layout;
  bool use_orig_params = false;
  OptimStateDict full;
};

ModelLayout GenLayout(ModelSpec spec) {
  LayoutOptions options = *verify::GenLayoutOptions();
  options.world_size = *GenSimWorldSize();
  verify::FitRequiresGrad(options, &spec);
  absl::StatusOr<ModelLayout> layout = ModelLayout::Create(spec, options);
  RC_PRE(layout.ok());
  return *std::move(layout);
}

OptimStateOptions GenOptions(bool use_orig_params) {
  OptimStateOptions options;
  options.use_orig_params = use_orig_params;
  options.unmanaged_params = UnmanagedParams();
  options.on_warning = [](absl::string_view) {};
  options.max_temp_bytes =
      *gen::weightedElement<int64_t>({{4, 0}, {1, 1}, {1, 24}, {1, 1000}});
  return options;
}

void AssertSame(const OptimStateDict& got, const OptimStateDict& want,
                const std::string& what) {
  if (auto diff = FirstDifference(got, want)) {
    RC_FAIL(absl::StrCat(what, ": ", *diff, "\ngot:\n", DebugString(got),
                         "\nwant:\n", DebugString(want)));
  }
}

// Runs `fn(comm)` on every rank of a simulated world of the layout's size.
absl::Status RunRanks(const ModelLayout& layout,
                      const std::function<absl::Status(Communicator&)>& fn) {
  SimOptions sim;
  sim.world_size = static_cast<int>(layout.options().world_size);
  sim.seed = *gen::arbitrary<uint64_t>();
  absl::StatusOr<std::unique_ptr<SimWorld>> world = SimWorld::Create(sim);
  if (!world.ok()) return world.status();
  return (*world)->Run([&](SimCommunicator& comm) { return fn(comm); });
}

// Shards `full` on every rank and consolidates; returns each rank's result.
std::vector<OptimStateDict> ShardAndConsolidate(
    const ModelLayout& layout, const OptimStateDict& full,
    const OptimStateOptions& options, int64_t* max_peak) {
  const int64_t w = layout.options().world_size;
  std::vector<OptimStateDict> out(w);
  std::vector<AllocationTracker> trackers(w);
  const absl::Status status = RunRanks(layout, [&](Communicator& comm) {
    absl::StatusOr<OptimStateDict> shard =
        ShardFullOptimState(layout, full, comm.rank(), options);
    if (!shard.ok()) return shard.status();
    OptimStateOptions o = options;
    o.tracker = &trackers[comm.rank()];
    // The simulated world is one shard group: the whole job.
    o.global_rank = comm.rank();
    absl::StatusOr<OptimStateDict> full_again =
        ConsolidateOptimState(layout, *shard, comm, o);
    if (!full_again.ok()) return full_again.status();
    out[comm.rank()] = *std::move(full_again);
    return absl::OkStatus();
  });
  RC_ASSERT(status.ok());
  *max_peak = 0;
  for (const AllocationTracker& t : trackers) {
    RC_ASSERT(t.current_bytes() == 0);
    *max_peak = std::max(*max_peak, t.peak_bytes());
  }
  return out;
}

RC_GTEST_PROP(FsdpOptimProperties, ShardThenConsolidateIsIdentity, ()) {
  const ModelLayout layout =
      GenLayout(*verify::GenModelSpec(verify::Scale::kData));
  const bool orig = *gen::arbitrary<bool>();
  const OptimStateDict full = *GenFullOptimStateDict(layout, orig);
  OptimStateOptions options = GenOptions(orig);
  options.rank0_only = *gen::arbitrary<bool>();
  RC_TAG(orig ? "use_orig_params" : "flat params");
  RC_CLASSIFY(options.max_temp_bytes > 0, "chunked");
  RC_CLASSIFY(layout.options().align_addresses, "aligned");
  RC_CLASSIFY(layout.options().world_size > 1, "sharded over ranks");
  RC_CLASSIFY(TensorBytes(full) > 0, "tensor state");

  int64_t peak = 0;
  const std::vector<OptimStateDict> got =
      ShardAndConsolidate(layout, full, options, &peak);
  const OptimStateDict want = ExpectedRoundTrip(layout, full, orig);
  for (size_t r = 0; r < got.size(); ++r) {
    if (options.rank0_only && r > 0) {
      RC_ASSERT(got[r].empty());
      continue;
    }
    AssertSame(got[r], want, absl::StrCat("rank ", r));
  }
  // Temporary memory: at most one flat parameter's state (of the widest
  // dtype generated) at a time.
  RC_ASSERT(peak <= MaxTempBytes(layout, DType::kFloat64, options));
}

RC_GTEST_PROP(FsdpOptimProperties, ReshardingInMemoryIsIdentity, ()) {
  ModelSpec spec = *verify::GenModelSpec(verify::Scale::kData);
  // Both layouts must agree on which parameters train, aligned or not.
  verify::FitRequiresGrad(LayoutOptions{}, &spec);
  const ModelLayout from = GenLayout(spec);
  const ModelLayout to = GenLayout(spec);
  const bool orig = *gen::arbitrary<bool>();
  const OptimStateDict full = *GenFullOptimStateDict(from, orig);
  const OptimStateOptions options = GenOptions(orig);
  int64_t peak = 0;
  const std::vector<OptimStateDict> once =
      ShardAndConsolidate(from, full, options, &peak);
  const std::vector<OptimStateDict> twice =
      ShardAndConsolidate(to, once[0], options, &peak);
  const OptimStateDict want = ExpectedRoundTrip(from, full, orig);
  for (size_t r = 0; r < twice.size(); ++r) {
    AssertSame(twice[r], want, absl::StrCat("rank ", r, " after resharding"));
  }
}

RC_GTEST_PROP(FsdpOptimProperties, ScatterEqualsShard, ()) {
  const ModelLayout layout =
      GenLayout(*verify::GenModelSpec(verify::Scale::kData));
  const bool orig = *gen::arbitrary<bool>();
  const OptimStateDict full = *GenFullOptimStateDict(layout, orig);
  const OptimStateOptions options = GenOptions(orig);
  const int64_t w = layout.options().world_size;
  std::vector<OptimStateDict> scattered(w);
  std::vector<AllocationTracker> trackers(w);
  const absl::Status status = RunRanks(layout, [&](Communicator& comm) {
    OptimStateOptions o = options;
    o.tracker = &trackers[comm.rank()];
    o.rank0_only = true;
    absl::StatusOr<OptimStateDict> got = OptimStateDictToLoad(
        layout, comm.rank() == 0 ? full : OptimStateDict(), comm, o);
    if (!got.ok()) return got.status();
    scattered[comm.rank()] = *std::move(got);
    return absl::OkStatus();
  });
  RC_ASSERT(status.ok());
  for (int64_t r = 0; r < w; ++r) {
    absl::StatusOr<OptimStateDict> want =
        ShardFullOptimState(layout, full, r, options);
    RC_ASSERT(want.ok());
    AssertSame(scattered[r], *want, absl::StrCat("rank ", r));
    RC_ASSERT(trackers[r].peak_bytes() <=
              MaxTempBytes(layout, DType::kFloat64, options));
  }
}

// The flat path's shard of a state is the flat parameter's shard layout:
// what FlattenShard writes for parameters holding the state's values.
RC_GTEST_PROP(FsdpOptimProperties, FlatShardsMatchFlattenShard, ()) {
  const ModelLayout layout =
      GenLayout(*verify::GenModelSpec(verify::Scale::kData));
  const OptimStateDict full = *GenFullOptimStateDict(layout, false);
  const OptimStateOptions options = GenOptions(false);
  const int64_t w = layout.options().world_size;
  const OptimStateDict filled = ExpectedRoundTrip(layout, full, false);
  int checked = 0;
  for (int64_t r = 0; r < w; ++r) {
    absl::StatusOr<OptimStateDict> shard =
        ShardFullOptimState(layout, full, r, options);
    RC_ASSERT(shard.ok());
    for (const auto& [key, state] : shard->state) {
      const auto* u = std::get_if<int64_t>(&key);
      if (u == nullptr) continue;
      const FlatParamLayout& unit = layout.flat_params()[*u];
      for (const auto& [name, value] : state) {
        if (!IsPosDimTensor(value)) continue;
        const HostTensor& got = std::get<HostTensor>(value);
        RC_ASSERT(got.shape() == std::vector<int64_t>{unit.sharded_numel()});
        if (got.dtype() != unit.dtype()) continue;
        std::vector<ConstBufferRef> params;
        for (const ParamInfo& p : unit.params()) {
          params.push_back(
              std::get<HostTensor>(filled.state.at(p.fqn).at(name)).cref());
        }
        HostTensor want = HostTensor::Flat(unit.dtype(), unit.sharded_numel());
        RC_ASSERT(FlattenShard(unit, params, r, want.ref()).ok());
        RC_ASSERT(got == want);
        ++checked;
      }
    }
  }
  RC_CLASSIFY(checked > 0, "compared shards");
}

RC_GTEST_PROP(FsdpOptimProperties, RekeyBothWaysIsIdentity, ()) {
  const ModelLayout layout =
      GenLayout(*verify::GenModelSpec(verify::Scale::kData));
  const bool orig = *gen::arbitrary<bool>();
  const OptimStateDict full = *GenFullOptimStateDict(layout, orig);
  std::vector<std::string> order = ModelParamOrder(layout);
  order.insert(order.end(), UnmanagedParams().begin(), UnmanagedParams().end());
  absl::StatusOr<OptimStateDict> by_id =
      RekeyOptimStateDict(full, OptimStateKeyType::kParamId, order);
  RC_ASSERT(by_id.ok());
  for (const auto& [key, state] : by_id->state) {
    // Only the user-defined key stays a name.
    const bool ok = std::holds_alternative<int64_t>(key) ||
                    std::get<std::string>(key) == testing::kUserKey;
    RC_ASSERT(ok);
  }
  absl::StatusOr<OptimStateDict> by_name =
      RekeyOptimStateDict(*by_id, OptimStateKeyType::kParamName, order);
  RC_ASSERT(by_name.ok());
  AssertSame(*by_name, full, "ID -> name");
  absl::StatusOr<OptimStateDict> back =
      RekeyOptimStateDict(*by_name, OptimStateKeyType::kParamId, order);
  RC_ASSERT(back.ok());
  AssertSame(*back, *by_id, "name -> ID");

  // Sharding accepts either keying.
  const OptimStateOptions options = GenOptions(orig);
  const int64_t rank = *gen::inRange<int64_t>(0, layout.options().world_size);
  absl::StatusOr<OptimStateDict> a =
      ShardFullOptimState(layout, full, rank, options);
  absl::StatusOr<OptimStateDict> b =
      ShardFullOptimState(layout, *by_id, rank, options);
  RC_ASSERT(a.ok());
  RC_ASSERT(b.ok());
  AssertSame(*b, *a, "sharded from IDs");
}

}  // namespace
}  // namespace optim
}  // namespace flatparam
