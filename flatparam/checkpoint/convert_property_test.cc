// Properties of the offline checkpoint tools (convert.h), on real files
// (PosixFileSystem under $TEST_TMPDIR), for random models
// (verify/generators.h: dtypes, ties, 0-d and zero-size parameters, wrap
// prefixes), layouts (world sizes 1..8, every strategy, alignment on and
// off, compute dtypes) and full optimizer state dicts of the flat path
// (optim_generators.h: 0-d and non-tensor states, None, parameters and
// flat parameters without state, user-defined keys, param groups):
//
//   * full -> shard(W) -> consolidate is the identity, bit for bit (with
//     the flat path's normalisation: zeros for missing tensor states);
//   * shard(W) -> reshard(W2, another strategy/alignment) -> consolidate
//     gives the same;
//   * the on-disk tools agree with the in-memory operations: every rank of
//     ShardCheckpoint's and ReshardCheckpoint's output reads back
//     (ReadRankState) as FlattenShard of the parameters and
//     optim::ShardFullOptimState of the dict;
//   * resharding at load time (LoadRankState from the W checkpoint, for the
//     second layout) equals the offline reshard read back, rank by rank.
//
// Sharded checkpoints hold only the tensors of flat parameters, so tensor
// states of unmanaged keys are dropped from the generated dicts.
//
// Rerun a failure with
//   bazel test //flatparam/checkpoint:convert_property_test
//     --test_env=RC_PARAMS="reproduce=<string printed on failure>"
#include <gtest/gtest.h>
#include <rapidcheck.h>
#include <rapidcheck/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "flatparam/base/dtype.h"
#include "flatparam/base/splitmix64.h"
#include "flatparam/checkpoint/checkpoint_dir.h"
#include "flatparam/checkpoint/convert.h"
#include "flatparam/checkpoint/file_system.h"
#include "flatparam/checkpoint/training_state.h"
#include "flatparam/flatten.h"
#include "flatparam/layout.h"
#include "flatparam/model_layout.h"
#include "flatparam/optim/fsdp_optim.h"
#include "flatparam/optim/optim_generators.h"
#include "flatparam/optim/optim_state.h"
#include "verify/generators.h"

namespace flatparam {
namespace checkpoint {
namespace {

namespace gen = rc::gen;
using optim::OptimStateDict;
using optim::ParamKey;

struct Target {
  LayoutOptions options;
  int64_t world_size = 1;
};

Target GenTarget() {
  Target t;
  t.options = *verify::GenLayoutOptions();
  t.options.world_size = *gen::inRange<int64_t>(1, 9);
  t.world_size = t.options.world_size;
  if (IsHybridStrategy(t.options.strategy)) {
    t.world_size *= *gen::inRange<int64_t>(1, 3);
  }
  return t;
}

// Parameters with arbitrary bit patterns (NaNs included).
std::map<std::string, HostTensor> GenParams(const ModelSpec& spec) {
  const uint64_t seed = *gen::arbitrary<uint64_t>();
  std::map<std::string, HostTensor> params;
  uint64_t k = seed;
  for (const ParamSpec& p : spec.params) {
    if (!p.tied_to.empty()) continue;
    HostTensor t(p.dtype, p.shape);
    auto* bytes = static_cast<unsigned char*>(t.data());
    for (size_t i = 0; i < t.nbytes(); ++i) {
      bytes[i] = static_cast<unsigned char>(SplitMix64(++k));
    }
    params.emplace(p.fqn, std::move(t));
  }
  return params;
}

optim::OptimStateOptions InMemoryOptions() {
  optim::OptimStateOptions o;
  o.unmanaged_params = optim::testing::UnmanagedParams();
  o.on_warning = [](absl::string_view) {};
  return o;
}

std::string TempRoot() {
  const char* tmp = std::getenv("TEST_TMPDIR");
  return tmp != nullptr ? tmp : "/tmp";
}

// The rank files of `dir` hold what the in-memory operations give for
// `layout`.
void CheckRanksMatchInMemory(FileSystem& fs, const std::string& dir,
                             const ModelLayout& layout,
                             const std::map<std::string, HostTensor>& params,
                             const OptimStateDict& full) {
  absl::StatusOr<ShardedCheckpointReader> reader =
      ShardedCheckpointReader::Open(fs, dir);
  RC_ASSERT(reader.ok());
  for (int64_t r = 0; r < layout.options().world_size; ++r) {
    absl::StatusOr<RankState> state = ReadRankState(*reader, r);
    RC_ASSERT(state.ok());
    for (size_t u = 0; u < layout.flat_params().size(); ++u) {
      const FlatParamLayout& unit = layout.flat_params()[u];
      std::vector<ConstBufferRef> refs;
      for (const ParamInfo& p : unit.params()) {
        refs.push_back(params.at(p.fqn).cref());
      }
      HostTensor want = HostTensor::Flat(unit.dtype(), unit.sharded_numel());
      RC_ASSERT(FlattenShard(unit, refs, r, want.ref()).ok());
      RC_ASSERT(state->flat_params[u] == want);
    }
    absl::StatusOr<OptimStateDict> want =
        optim::ShardFullOptimState(layout, full, r, InMemoryOptions());
    RC_ASSERT(want.ok());
    const auto diff = optim::FirstDifference(state->optim, *want);
    if (diff.has_value()) RC_FAIL(absl::StrCat("rank ", r, ": ", *diff));
  }
}

// Resharding at load time gives, rank by rank, bit for bit what the
// offline reshard wrote to `offline_dir`, reading only the metadata and the
// byte ranges it needs of `old_dir`.
void CheckLoadEqualsOffline(FileSystem& fs, const std::string& old_dir,
                            const std::string& offline_dir,
                            const ModelLayout& layout, int64_t world_size) {
  CheckpointOpenOptions metadata_only;
  metadata_only.ranks.emplace();
  absl::StatusOr<ShardedCheckpointReader> old_reader =
      ShardedCheckpointReader::Open(fs, old_dir, metadata_only);
  RC_ASSERT(old_reader.ok());
  absl::StatusOr<ShardedCheckpointReader> offline =
      ShardedCheckpointReader::Open(fs, offline_dir);
  RC_ASSERT(offline.ok());
  for (int64_t r = 0; r < layout.options().world_size; ++r) {
    LoadPath path = LoadPath::kOwnRank;
    absl::StatusOr<RankState> loaded =
        LoadRankState(*old_reader, layout, world_size, r, &path);
    if (!loaded.ok()) RC_FAIL(loaded.status().ToString());
    if (r == 0) RC_TAG(path == LoadPath::kOwnRank ? "fits" : "resharded");
    absl::StatusOr<RankState> want = ReadRankState(*offline, r);
    RC_ASSERT(want.ok());
    RC_ASSERT(loaded->flat_params == want->flat_params);
    const auto diff = optim::FirstDifference(loaded->optim, want->optim);
    if (diff.has_value()) RC_FAIL(absl::StrCat("rank ", r, ": ", *diff));
    RC_ASSERT(loaded->extra == want->extra);
  }
}

// Consolidating `dir` gives `params` and `expected`.
void CheckConsolidates(FileSystem& fs, const std::string& dir,
                       const std::string& out,
                       const std::map<std::string, HostTensor>& params,
                       const OptimStateDict& expected) {
  const absl::Status consolidated = ConsolidateCheckpoint(fs, dir, out);
  if (!consolidated.ok()) RC_FAIL(consolidated.ToString());
  absl::StatusOr<FullCheckpointReader> reader =
      FullCheckpointReader::Open(fs, out);
  RC_ASSERT(reader.ok());
  absl::StatusOr<FullState> back = ReadFullState(*reader);
  RC_ASSERT(back.ok());
  RC_ASSERT(back->params == params);
  const auto diff = optim::FirstDifference(back->optim, expected);
  if (diff.has_value()) RC_FAIL(*diff);
}

RC_GTEST_PROP(ConvertProperties, ShardReshardConsolidateRoundTrips, ()) {
  const ModelSpec spec = *verify::GenModelSpec(verify::Scale::kData);
  const Target target = GenTarget();
  absl::StatusOr<ModelLayout> layout_or =
      ModelLayout::Create(spec, target.options);
  RC_PRE(layout_or.ok());
  const ModelLayout& layout = *layout_or;
  OptimStateDict full =
      *optim::testing::GenFullOptimStateDict(layout, /*use_orig_params=*/false);
  // Rank files hold only flat parameters' tensors.
  std::set<std::string> managed;
  for (const FlatParamLayout& u : layout.flat_params()) {
    for (const ParamInfo& p : u.params()) managed.insert(p.fqn);
  }
  for (auto it = full.state.begin(); it != full.state.end();) {
    const auto* name = std::get_if<std::string>(&it->first);
    bool tensor = false;
    for (const auto& [n, v] : it->second) tensor |= optim::IsTensor(v);
    if (name != nullptr && managed.count(*name) == 0 && tensor) {
      it = full.state.erase(it);
    } else {
      ++it;
    }
  }
  const std::map<std::string, HostTensor> params = GenParams(spec);
  const OptimStateDict expected =
      optim::testing::ExpectedRoundTrip(layout, full, false);
  RC_TAG(ShardingStrategyName(target.options.strategy),
         target.options.align_addresses ? "aligned" : "unaligned");

  FileSystem& fs = PosixFileSystem();
  static int counter = 0;
  const std::string root =
      JoinPath(TempRoot(), absl::StrCat("convert_prop_", ++counter));
  RC_ASSERT(RemoveRecursively(fs, root).ok());
  RC_ASSERT(fs.CreateDir(root).ok());
  const std::string full_dir = JoinPath(root, "full");
  const std::string sharded = JoinPath(root, "sharded");
  const std::string resharded = JoinPath(root, "resharded");

  FullState state{params, full};
  absl::StatusOr<FullCheckpointContent> content = MakeFullContent(state);
  if (!content.ok()) RC_FAIL(content.status().ToString());
  RC_ASSERT(WriteFullCheckpoint(fs, full_dir, *content).ok());

  ConvertOptions options;
  // Small chunks, so tensors span several fills.
  options.chunk_bytes = *gen::element<uint64_t>(8, 24, 4096);
  const absl::Status shard = ShardCheckpoint(
      fs, full_dir, spec, target.options, target.world_size, sharded, options);
  if (!shard.ok()) RC_FAIL(shard.ToString());
  CheckRanksMatchInMemory(fs, sharded, layout, params, full);
  CheckConsolidates(fs, sharded, JoinPath(root, "full2"), params, expected);

  const Target target2 = GenTarget();
  absl::StatusOr<ModelLayout> layout2 =
      ModelLayout::Create(spec, target2.options);
  RC_PRE(layout2.ok());
  const absl::Status reshard = ReshardCheckpoint(
      fs, sharded, target2.options, target2.world_size, resharded, options);
  if (!reshard.ok()) RC_FAIL(reshard.ToString());
  CheckRanksMatchInMemory(fs, resharded, *layout2, params, full);
  CheckConsolidates(fs, resharded, JoinPath(root, "full3"), params, expected);
  CheckLoadEqualsOffline(fs, sharded, resharded, *layout2, target2.world_size);
  RC_ASSERT(RemoveRecursively(fs, root).ok());
}

}  // namespace
}  // namespace checkpoint
}  // namespace flatparam
