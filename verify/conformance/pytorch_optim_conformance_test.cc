// Conformance of flatparam's optimizer-state functions (fsdp_optim.h) with
// PyTorch FSDP on the flat-parameter path, against golden data that
// tools/pytorch/gen_optim_golden.py recorded from real torch 1.13 training
// runs on 1..4 gloo ranks: verify/testdata/pytorch_optim_state.json, whose
// "schema" field describes every value. Torch is not needed here.
//
// Each case (model x optimizer x world size) is one parameterized test that
// rebuilds the ModelLayout from the recorded spec and checks, bit for bit:
//   * ShardFullOptimState(full, r) == torch's shard_full_optim_state_dict on
//     rank r, for the trained full dict and for the edited "variants";
//   * ConsolidateOptimState over the simulator of the ranks' real sharded
//     optimizer states == torch's full_optim_state_dict, on every rank, and
//     on rank 0 only (the others empty) with rank0_only;
//   * consolidating torch's own shard_full_optim_state_dict outputs gives the
//     full dict back;
//   * and, for the tied model with Adam at W = 2, 3, 4, the full dict brought
//     as files -- optim.safetensors and PyTorch's param_groups in
//     optim.json beside model.safetensors, no manifest -- and imported by
//     the checkpoint tools (ImportHfCheckpoint, `fsdp checkpoint shard`)
//     gives every rank torch's shard and consolidates back to the full dict.
//
// Keys: torch keys a sharded dict by optimizer parameter ID; flatparam by
// flat-parameter index (ModelLayout::flat_params()) and, for parameters of
// ignored modules, by FQN (OptimStateOptions::unmanaged_params). The test
// maps IDs through the recorded "param_ids" table. A sharded dict's group
// lists are sorted IDs in torch: flat parameters, then (in these models,
// where ignored modules come last) the ignored modules' parameters in
// optimizer order, which is flatparam's order too; they are compared as
// lists.
//
// Where torch 1.13 differs from flatparam's documented behaviour (the JSON's
// "deviations"), flatparam is held to its documented behaviour and the test
// checks that torch still fails in exactly the recorded way, so that new
// differences fail.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "comm/communicator.h"
#include "flatparam/base/dtype.h"
#include "flatparam/base/status_matchers.h"
#include "flatparam/checkpoint/checkpoint_dir.h"
#include "flatparam/checkpoint/convert.h"
#include "flatparam/checkpoint/file_system.h"
#include "flatparam/checkpoint/safetensors.h"
#include "flatparam/checkpoint/training_state.h"
#include "flatparam/flatten.h"
#include "flatparam/interop/hf/hf_checkpoint.h"
#include "flatparam/layout.h"
#include "flatparam/model_layout.h"
#include "flatparam/optim/fsdp_optim.h"
#include "flatparam/optim/optim_state.h"
#include "sim/sim.h"
#include "verify/conformance/golden_data.h"

namespace flatparam {
namespace optim {
namespace {

using json = nlohmann::json;
using verify::FindByName;
using verify::GoldenCaseNames;
using verify::GoldenCaseTestName;
using verify::GoldenData;
using verify::LoadGoldenData;

constexpr char kGoldenPath[] = "verify/testdata/pytorch_optim_state.json";

// How torch 1.13 fails on SGD without momentum (deviations[0]): it drops the
// Nones and then finds no type. flatparam keeps the None.
constexpr char kNoneStateError[] =
    "ValueError: Differing optimizer state types for state momentum_buffer, "
    "values [], ";

const GoldenData& Golden() { return LoadGoldenData(kGoldenPath); }

const json& FindCase(const std::string& name) {
  return FindByName(Golden().data.at("cases"), name);
}

// ---------------------------------------------------------------------------
// Decoding the JSON's typed values into flatparam's types. Malformed input
// is a test failure (ADD_FAILURE) naming `where`.
// ---------------------------------------------------------------------------

HostTensor DecodeTensor(const json& v, const std::string& where) {
  absl::StatusOr<DType> dtype = ParseDType(v.at("dtype").get<std::string>());
  if (!dtype.ok()) {
    ADD_FAILURE() << where << ": " << dtype.status();
    return HostTensor();
  }
  HostTensor t(*dtype, v.at("shape").get<std::vector<int64_t>>());
  std::string bytes;
  if (!absl::Base64Unescape(v.at("data").get<std::string>(), &bytes) ||
      bytes.size() != t.nbytes()) {
    ADD_FAILURE() << where << ": bad tensor data (" << bytes.size()
                  << " bytes for " << t.nbytes() << ")";
    return t;
  }
  if (!bytes.empty()) std::memcpy(t.data(), bytes.data(), bytes.size());
  return t;
}

OptimStateValue DecodeValue(const json& v, const std::string& where) {
  const std::string t = v.at("t").get<std::string>();
  if (t == "none") return std::monostate();
  if (t == "bool") return v.at("v").get<bool>();
  if (t == "int") return v.at("v").get<int64_t>();
  if (t == "float") return v.at("v").get<double>();
  if (t == "str") return v.at("v").get<std::string>();
  if (t == "tensor") return DecodeTensor(v, where);
  ADD_FAILURE() << where << ": unexpected state value type " << t;
  return std::monostate();
}

HyperValue DecodeHyper(const json& v, const std::string& where) {
  const std::string t = v.at("t").get<std::string>();
  if (t == "none") return std::monostate();
  if (t == "bool") return v.at("v").get<bool>();
  if (t == "int") return v.at("v").get<int64_t>();
  if (t == "float") return v.at("v").get<double>();
  if (t == "str") return v.at("v").get<std::string>();
  if (t == "tuple") return v.at("v").get<std::vector<double>>();
  ADD_FAILURE() << where << ": unexpected hyperparameter type " << t;
  return std::monostate();
}

// What a torch parameter key becomes in flatparam: FQNs stay; an optimizer
// parameter ID becomes its flat-parameter index or its unmanaged FQN.
using KeyMap = std::map<int64_t, ParamKey>;

ParamKey DecodeKey(const json& k, const KeyMap& ids, const std::string& where) {
  if (k.is_string()) return k.get<std::string>();
  const int64_t id = k.get<int64_t>();
  auto it = ids.find(id);
  if (it == ids.end()) {
    ADD_FAILURE() << where << ": parameter ID " << id << " is not in param_ids";
    return id;
  }
  return it->second;
}

// Groups keep torch's order (sorted IDs, mapped to flatparam's keys).
OptimStateDict DecodeDict(const json& d, const KeyMap& ids,
                          const std::string& where) {
  OptimStateDict out;
  for (const json& entry : d.at("state")) {
    const ParamKey key = DecodeKey(entry.at("key"), ids, where);
    ParamState& state = out.state[key];
    for (const auto& [name, value] : entry.at("state").items()) {
      state[name] = DecodeValue(
          value,
          absl::StrCat(where, " state[", DescribeKey(key), "][", name, "]"));
    }
  }
  for (const json& g : d.at("param_groups")) {
    ParamGroup group;
    for (const auto& [name, value] : g.at("hyper").items()) {
      group.hyperparams[name] = DecodeHyper(value, where + " " + name);
    }
    for (const json& k : g.at("params")) {
      group.params.push_back(DecodeKey(k, ids, where));
    }
    out.param_groups.push_back(std::move(group));
  }
  return out;
}

// Bitwise equality with the first difference and both dicts in the message.
testing::AssertionResult SameDict(const std::string& where,
                                  const OptimStateDict& got,
                                  const OptimStateDict& want) {
  const std::optional<std::string> diff = FirstDifference(got, want);
  if (!diff.has_value()) return testing::AssertionSuccess();
  return testing::AssertionFailure()
         << where << ": flatparam and torch differ at " << *diff
         << "\n--- flatparam:\n"
         << DebugString(got) << "--- torch:\n"
         << DebugString(want);
}

// ---------------------------------------------------------------------------
// A case
// ---------------------------------------------------------------------------

struct Case {
  std::string name;
  const json* c = nullptr;
  int world_size = 0;
  std::optional<ModelLayout> layout;
  KeyMap ids;
  OptimStateOptions options;
};

// Rebuilds the layout and maps torch's parameter IDs to flatparam keys,
// checking that every flat parameter holds the parameters torch's does.
void Prepare(Case& k) {
  const json& spec_json = k.c->at("spec");
  ModelSpec spec;
  spec.name = k.c->at("model").get<std::string>();
  for (const json& p : spec_json.at("params")) {
    ParamSpec s;
    s.fqn = p.at("fqn").get<std::string>();
    s.shape = p.at("shape").get<std::vector<int64_t>>();
    absl::StatusOr<DType> dtype = ParseDType(p.at("dtype").get<std::string>());
    ASSERT_TRUE(dtype.ok()) << dtype.status();
    s.dtype = *dtype;
    s.requires_grad = p.at("requires_grad").get<bool>();
    s.tied_to = p.at("tied_to").get<std::string>();
    spec.params.push_back(std::move(s));
  }
  spec.wrap = spec_json.at("wrap").get<std::vector<std::string>>();
  LayoutOptions options;
  options.world_size = k.world_size;
  options.strategy =
      *ParseShardingStrategy(k.c->at("strategy").get<std::string>());
  options.align_addresses = false;  // torch 1.13 has no use_orig_params
  absl::StatusOr<ModelLayout> layout = ModelLayout::Create(spec, options);
  ASSERT_TRUE(layout.ok()) << k.name << ": " << layout.status();
  k.layout = *std::move(layout);

  k.options.use_orig_params = false;
  k.options.unmanaged_params =
      spec_json.at("unmanaged").get<std::vector<std::string>>();
  k.options.on_warning = [name = k.name](absl::string_view message) {
    ADD_FAILURE() << name << ": unexpected warning: " << message;
  };

  const std::vector<FlatParamLayout>& units = k.layout->flat_params();
  std::set<int64_t> seen_units;
  const json& ids = k.c->at("param_ids");
  for (size_t id = 0; id < ids.size(); ++id) {
    const json& entry = ids[id];
    if (entry.contains("unmanaged")) {
      k.ids[id] = entry.at("unmanaged").get<std::string>();
      continue;
    }
    const auto fqns = entry.at("flat").get<std::vector<std::string>>();
    int64_t found = -1;
    for (size_t u = 0; u < units.size(); ++u) {
      std::vector<std::string> ours;
      for (const ParamInfo& p : units[u].params()) ours.push_back(p.fqn);
      if (ours == fqns) found = static_cast<int64_t>(u);
    }
    ASSERT_GE(found, 0) << k.name << ": no flat parameter of the layout holds "
                        << testing::PrintToString(fqns)
                        << " (torch's parameter ID " << id << ")";
    seen_units.insert(found);
    k.ids[id] = found;
  }
  EXPECT_EQ(seen_units.size(), units.size())
      << k.name << ": the layout has flat parameters torch's optimizer lacks";
}

// Runs ConsolidateOptimState on every rank of a simulated world, rank r
// passing `sharded[r]`.
std::vector<absl::StatusOr<OptimStateDict>> Consolidate(
    const Case& k, const std::vector<OptimStateDict>& sharded,
    bool rank0_only) {
  std::vector<absl::StatusOr<OptimStateDict>> out(
      sharded.size(), absl::UnknownError("rank did not run"));
  SimOptions sim;
  sim.world_size = static_cast<int>(sharded.size());
  absl::StatusOr<std::unique_ptr<SimWorld>> world = SimWorld::Create(sim);
  EXPECT_TRUE(world.ok()) << world.status();
  if (!world.ok()) return out;
  OptimStateOptions options = k.options;
  options.rank0_only = rank0_only;
  (void)(*world)->Run([&](Communicator& comm) {
    out[comm.rank()] =
        ConsolidateOptimState(*k.layout, sharded[comm.rank()], comm, options);
    return out[comm.rank()].status();
  });
  return out;
}

// Deviation (deviations[1]): torch 1.13 gives a flat parameter none of whose
// parameters has state an empty entry; flatparam, as documented and as the
// 2.x reference, gives it none. Removes those entries from torch's `shard`
// after checking that the full dict indeed has no state for any of the
// flat parameter's parameters.
void DropEmptyFlatEntries(const Case& k, const OptimStateDict& full,
                          const std::string& where, OptimStateDict& shard) {
  for (auto it = shard.state.begin(); it != shard.state.end();) {
    if (!it->second.empty()) {
      ++it;
      continue;
    }
    ASSERT_TRUE(std::holds_alternative<int64_t>(it->first))
        << where << ": torch has an empty entry for " << DescribeKey(it->first);
    const FlatParamLayout& unit =
        k.layout->flat_params()[std::get<int64_t>(it->first)];
    for (const ParamInfo& p : unit.params()) {
      EXPECT_EQ(full.state.count(ParamKey(p.fqn)), 0u)
          << where << ": torch's empty entry for flat parameter "
          << DescribeKey(it->first) << ", but '" << p.fqn << "' has state";
    }
    it = shard.state.erase(it);
  }
}

// ShardFullOptimState of `full_json` on every rank against the recorded
// torch shards `ranks_json`. Returns torch's shards as decoded (groups in
// torch's order; empty when torch raised on any rank).
std::vector<OptimStateDict> CheckShards(const Case& k, const json& full_json,
                                        const json& ranks_json,
                                        const std::string& what) {
  const OptimStateDict full = DecodeDict(full_json, k.ids, k.name + " full");
  std::vector<OptimStateDict> torch_shards;
  bool torch_failed = false;
  EXPECT_EQ(static_cast<int>(ranks_json.size()), k.world_size)
      << k.name << " " << what << ": number of ranks";
  for (const json& r : ranks_json) {
    const int64_t rank = r.at("rank").get<int64_t>();
    const std::string where = absl::StrCat(k.name, " ", what, ", rank ", rank,
                                           ": ShardFullOptimState");
    const absl::StatusOr<OptimStateDict> got =
        ShardFullOptimState(*k.layout, full, rank, k.options);
    const json& shard = r.at("shard");
    if (!shard.contains("error")) {
      OptimStateDict want = DecodeDict(shard, k.ids, where);
      DropEmptyFlatEntries(k, full, where, want);
      EXPECT_TRUE(got.ok()) << where << ": " << got.status();
      if (got.ok()) {
        EXPECT_TRUE(SameDict(where, *got, want));
      }
      torch_shards.push_back(DecodeDict(shard, k.ids, where));
      DropEmptyFlatEntries(k, full, where, torch_shards.back());
      continue;
    }
    torch_failed = true;
    const std::string error = shard.at("error").get<std::string>();
    if (absl::StartsWith(error, kNoneStateError)) {
      // Deviation (deviations[0]): torch 1.13 cannot shard an all-None
      // state; flatparam gives the flat parameter None, which is exactly
      // what torch's own optimizer holds on this rank (its state_dict()).
      if (!r.contains("optimizer")) {
        ADD_FAILURE() << where << ": torch failed on a variant: " << error;
        continue;
      }
      const OptimStateDict want = DecodeDict(r.at("optimizer"), k.ids, where);
      EXPECT_TRUE(got.ok()) << where << ": " << got.status();
      if (got.ok()) {
        EXPECT_TRUE(SameDict(where + " (vs optimizer)", *got, want));
      }
      continue;
    }
    // Torch rejects the dict for another reason (a 0-d parameter's 0-d state
    // next to positive-dimension ones): flatparam must reject it too, with
    // torch's message.
    const std::string message = error.substr(
        error.find(": ") + 2, error.find(", values") - error.find(": ") - 2);
    const std::string names = error.substr(error.find("parameter names ") + 16);
    EXPECT_THAT(got, StatusIs(absl::StatusCode::kInvalidArgument,
                              testing::AllOf(testing::HasSubstr(message),
                                             testing::HasSubstr(names))))
        << where << ": torch raised " << error;
  }
  if (torch_failed) torch_shards.clear();
  return torch_shards;
}

class PytorchOptimConformanceTest : public testing::TestWithParam<std::string> {
};

TEST_P(PytorchOptimConformanceTest, MatchesTorch) {
  const GoldenData& golden = Golden();
  ASSERT_TRUE(golden.error.empty()) << golden.error;
  Case k;
  k.name = GetParam();
  k.c = &FindCase(k.name);
  ASSERT_FALSE(k.c->is_null()) << "no case " << k.name;
  k.world_size = k.c->at("world_size").get<int>();
  Prepare(k);
  if (HasFatalFailure()) return;

  const json& ranks = k.c->at("ranks");
  ASSERT_EQ(static_cast<int>(ranks.size()), k.world_size);

  // full -> shard, per rank.
  const std::vector<OptimStateDict> torch_shards =
      CheckShards(k, k.c->at("full"), ranks, "shard");
  for (const json& v : k.c->at("variants")) {
    CheckShards(
        k, v.at("full"), v.at("ranks"),
        absl::StrCat("variant '", v.at("what").get<std::string>(), "'"));
  }

  // The ranks' real sharded optimizer state -> full, on the simulator.
  const OptimStateDict full =
      DecodeDict(k.c->at("full"), k.ids, k.name + " full");
  std::vector<OptimStateDict> optimizer;
  for (const json& r : ranks) {
    optimizer.push_back(DecodeDict(
        r.at("optimizer"), k.ids,
        absl::StrCat(k.name, " rank ", r.at("rank").get<int>(), " optimizer")));
  }
  for (const bool rank0_only : {false, true}) {
    const std::vector<absl::StatusOr<OptimStateDict>> got =
        Consolidate(k, optimizer, rank0_only);
    for (int r = 0; r < k.world_size; ++r) {
      const std::string where =
          absl::StrCat(k.name, ", rank ", r, ": ConsolidateOptimState",
                       rank0_only ? " (rank0_only)" : "");
      ASSERT_TRUE(got[r].ok()) << where << ": " << got[r].status();
      if (rank0_only && r != 0) {
        EXPECT_TRUE(got[r]->empty()) << where << ": " << DebugString(*got[r]);
      } else {
        EXPECT_TRUE(SameDict(where, *got[r], full));
      }
    }
  }

  // torch's own shards -> full.
  if (!torch_shards.empty()) {
    const std::vector<absl::StatusOr<OptimStateDict>> got =
        Consolidate(k, torch_shards, /*rank0_only=*/false);
    for (int r = 0; r < k.world_size; ++r) {
      const std::string where = absl::StrCat(
          k.name, ", rank ", r, ": ConsolidateOptimState of torch's shards");
      ASSERT_TRUE(got[r].ok()) << where << ": " << got[r].status();
      EXPECT_TRUE(SameDict(where, *got[r], full));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Golden, PytorchOptimConformanceTest,
                         testing::ValuesIn(GoldenCaseNames(Golden())),
                         GoldenCaseTestName);

// Sharded groups list ignored modules' parameters in the optimizer's
// order, as torch does (its sorted IDs), not by name.
TEST(PytorchOptimConformance, IgnoredParametersKeepOptimizerOrderInGroups) {
  const GoldenData& golden = Golden();
  ASSERT_TRUE(golden.error.empty()) << golden.error;
  Case k;
  k.name = "ignored/adam/world_size=2";
  k.c = &FindCase(k.name);
  ASSERT_FALSE(k.c->is_null()) << "no case " << k.name;
  k.world_size = 2;
  Prepare(k);
  if (HasFatalFailure()) return;
  const OptimStateDict full = DecodeDict(k.c->at("full"), k.ids, k.name);
  const OptimStateDict torch_shard =
      DecodeDict(k.c->at("ranks")[0].at("shard"), k.ids, k.name);
  ASSERT_EQ(torch_shard.param_groups.size(), 1u);
  const auto want =
      testing::ElementsAre(ParamKey(int64_t{0}), ParamKey(int64_t{1}),
                           ParamKey("side.weight"), ParamKey("side.bias"));
  EXPECT_THAT(torch_shard.param_groups[0].params, want);
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      const OptimStateDict ours,
      ShardFullOptimState(*k.layout, full, /*rank=*/0, k.options));
  ASSERT_EQ(ours.param_groups.size(), 1u);
  EXPECT_THAT(ours.param_groups[0].params, want);
}

// ---------------------------------------------------------------------------
// Full optimizer state brought as files (flatparam/checkpoint/
// hf_checkpoint.h): a directory without manifest.json holding
// model.safetensors, optim.safetensors (the full dict's tensors as
// "state.{fqn}.{state}") and optim.json with the param groups as PyTorch
// writes them, json.dumps(optimizer.state_dict()["param_groups"]) (IDs in
// the model's parameters() order), imported by `fsdp checkpoint shard`.

// Writes `tensors` (name, tensor) as the safetensors file `path` of `fs`.
void WriteTensors(
    checkpoint::FileSystem& fs, const std::string& path,
    const std::vector<std::pair<std::string, HostTensor>>& tensors) {
  std::vector<checkpoint::TensorSource> sources;
  for (const auto& [name, t] : tensors) {
    sources.push_back(checkpoint::TensorSourceFromHostTensor(name, t));
  }
  absl::StatusOr<std::unique_ptr<checkpoint::WritableFile>> f =
      fs.NewWritableFile(path);
  ASSERT_TRUE(f.ok()) << f.status();
  FLATPARAM_ASSERT_OK(checkpoint::WriteSafetensors(**f, path, sources));
  FLATPARAM_ASSERT_OK((*f)->Close());
}

// Torch's full dict of Adam after training the tied model (a parameter
// shared by two modules, a zero-numel one, a wrapped unit), imported at
// W = 2, 3, 4: each rank's optimizer state equals torch's
// shard_full_optim_state_dict on that rank, and consolidating the imported
// checkpoint gives torch's full_optim_state_dict back, bit for bit.
TEST(PytorchOptimConformance, ImportedFullStateShardsAsTorchDoes) {
  const GoldenData& golden = Golden();
  ASSERT_TRUE(golden.error.empty()) << golden.error;
  for (const int w : {2, 3, 4}) {
    Case k;
    k.name = absl::StrCat("tied/adam/world_size=", w);
    SCOPED_TRACE(k.name);
    k.c = &FindCase(k.name);
    ASSERT_FALSE(k.c->is_null()) << "no case " << k.name;
    k.world_size = w;
    Prepare(k);
    if (HasFatalFailure()) return;
    const ModelSpec& spec = k.layout->spec();
    const OptimStateDict full =
        DecodeDict(k.c->at("full"), k.ids, k.name + " full");

    checkpoint::FaultInjectionFileSystem fs;
    FLATPARAM_ASSERT_OK(fs.CreateDir("/in"));
    // The weights (torch's are not recorded: any values), each parameter
    // under every name, as state_dict() has them; and the IDs.
    std::map<std::string, HostTensor> weights;
    std::map<std::string, int64_t> id;
    std::vector<std::pair<std::string, HostTensor>> model;
    for (const ParamSpec& p : spec.params) {
      if (p.tied_to.empty()) {
        HostTensor t(p.dtype, p.shape);
        for (int64_t i = 0; i < t.numel(); ++i) {
          t.SetDouble(i, 0.5 * i + static_cast<double>(id.size()));
        }
        weights.emplace(p.fqn, t);
        id.emplace(p.fqn, static_cast<int64_t>(id.size()));
      }
      model.emplace_back(p.fqn,
                         weights.at(p.tied_to.empty() ? p.fqn : p.tied_to));
    }
    WriteTensors(fs, "/in/model.safetensors", model);
    std::vector<std::pair<std::string, HostTensor>> states;
    for (const auto& [key, state] : full.state) {
      for (const auto& [name, value] : state) {
        ASSERT_TRUE(IsTensor(value)) << DescribeKey(key) << " " << name;
        states.emplace_back(
            checkpoint::OptimStateTensorName(std::get<std::string>(key), name),
            std::get<HostTensor>(value));
      }
    }
    WriteTensors(fs, "/in/optim.safetensors", states);
    json groups = json::array();
    for (const json& g : k.c->at("full").at("param_groups")) {
      json group = json::object();
      for (const auto& [name, v] : g.at("hyper").items()) {
        group[name] = v.contains("v") ? v.at("v") : json();
      }
      json params = json::array();
      for (const json& fqn : g.at("params")) params.push_back(id.at(fqn));
      group["params"] = std::move(params);
      groups.push_back(std::move(group));
    }
    FLATPARAM_ASSERT_OK(
        checkpoint::WriteFileDurably(fs, "/in/optim.json", groups.dump()));

    FLATPARAM_ASSERT_OK_AND_ASSIGN(
        const checkpoint::HfImportReport report,
        checkpoint::ImportHfCheckpoint(fs, "/in", spec, k.layout->options(), 0,
                                       "/out"));
    EXPECT_TRUE(report.optimizer);
    EXPECT_EQ(report.tied_copies, 1);
    FLATPARAM_ASSERT_OK_AND_ASSIGN(
        const checkpoint::ShardedCheckpointReader reader,
        checkpoint::ShardedCheckpointReader::Open(fs, "/out"));
    for (const json& r : k.c->at("ranks")) {
      const int64_t rank = r.at("rank").get<int64_t>();
      const std::string where =
          absl::StrCat(k.name, ", rank ", rank, ": the imported checkpoint");
      ASSERT_FALSE(r.at("shard").contains("error")) << where;
      OptimStateDict want = DecodeDict(r.at("shard"), k.ids, where);
      DropEmptyFlatEntries(k, full, where, want);
      FLATPARAM_ASSERT_OK_AND_ASSIGN(const checkpoint::RankState got,
                                     checkpoint::ReadRankState(reader, rank));
      EXPECT_TRUE(SameDict(where, got.optim, want));
    }

    FLATPARAM_ASSERT_OK(checkpoint::ConsolidateCheckpoint(fs, "/out", "/back"));
    FLATPARAM_ASSERT_OK_AND_ASSIGN(
        const checkpoint::FullCheckpointReader back,
        checkpoint::FullCheckpointReader::Open(fs, "/back"));
    FLATPARAM_ASSERT_OK_AND_ASSIGN(const checkpoint::FullState state,
                                   checkpoint::ReadFullState(back));
    EXPECT_TRUE(SameDict(k.name + ": consolidated", state.optim, full));
    EXPECT_TRUE(state.params == weights);
  }
}

// Guards the golden data itself, so that a regenerated file cannot silently
// drop the situations this suite exists to cover.
TEST(PytorchOptimConformance, GoldenDataCoversTheIntendedSituations) {
  const GoldenData& golden = Golden();
  ASSERT_TRUE(golden.error.empty()) << golden.error;
  const json& g = golden.data;
  EXPECT_EQ(g.at("format"), "flatparam.pytorch_optim_state.v1");
  EXPECT_THAT(g.at("torch_version").get<std::string>(),
              testing::StartsWith("1.13"));
  ASSERT_EQ(g.at("deviations").size(), 2u);
  EXPECT_THAT(g.at("deviations")[0].at("torch_1_13").get<std::string>(),
              testing::HasSubstr("momentum_buffer"));
  EXPECT_THAT(g.at("deviations")[1].at("torch_1_13").get<std::string>(),
              testing::HasSubstr("empty entry"));

  std::set<std::string> optimizers;
  std::set<int> world_sizes;
  std::set<std::string> dtypes;
  bool tied = false, zero_numel = false, frozen = false, unmanaged = false;
  bool unit_without_state = false, padded_state = false, none_state = false;
  bool zero_dim_state = false, variant = false, torch_rejects = false;
  for (const json& c : g.at("cases")) {
    optimizers.insert(c.at("optimizer").get<std::string>());
    world_sizes.insert(c.at("world_size").get<int>());
    for (const json& p : c.at("spec").at("params")) {
      dtypes.insert(p.at("dtype").get<std::string>());
      tied |= !p.at("tied_to").get<std::string>().empty();
      zero_numel |= NumElements(p.at("shape").get<std::vector<int64_t>>()) == 0;
      frozen |= !p.at("requires_grad").get<bool>();
    }
    unmanaged |= !c.at("spec").at("unmanaged").empty();
    // A flat parameter without state: fewer state entries than IDs.
    const json& r0 = c.at("ranks")[0];
    unit_without_state |=
        r0.at("optimizer").at("state").size() < c.at("param_ids").size();
    for (const json& r : c.at("ranks")) {
      torch_rejects |=
          r.at("shard").contains("error") &&
          !absl::StartsWith(r.at("shard").at("error"), kNoneStateError);
      for (const json& e : r.at("optimizer").at("state")) {
        for (const auto& [name, v] : e.at("state").items()) {
          none_state |= v.at("t") == "none";
          zero_dim_state |= v.at("t") == "tensor" && v.at("shape").empty();
        }
      }
    }
    variant |= !c.at("variants").empty();
    // Right padding: a flat parameter with state whose numel is not a
    // multiple of the world size, sharded by torch without error.
    std::map<std::string, int64_t> numel;
    for (const json& p : c.at("spec").at("params")) {
      if (!p.at("tied_to").get<std::string>().empty()) continue;
      numel[p.at("fqn").get<std::string>()] =
          NumElements(p.at("shape").get<std::vector<int64_t>>());
    }
    const int world_size = c.at("world_size").get<int>();
    if (world_size > 1 && !r0.at("shard").contains("error")) {
      for (const json& e : r0.at("shard").at("state")) {
        const json& id = c.at("param_ids")[e.at("key").get<size_t>()];
        if (!id.contains("flat")) continue;
        int64_t total = 0;
        for (const json& fqn : id.at("flat")) total += numel[fqn];
        padded_state |= total % world_size != 0;
      }
    }
  }
  EXPECT_THAT(optimizers, testing::UnorderedElementsAre("adam", "adamw",
                                                        "sgd_momentum", "sgd"));
  EXPECT_THAT(world_sizes, testing::ElementsAre(1, 2, 3, 4));
  EXPECT_THAT(dtypes, testing::IsSupersetOf({"float32", "float64"}));
  EXPECT_TRUE(tied) << "no tied parameter";
  EXPECT_TRUE(zero_numel) << "no zero-numel parameter";
  EXPECT_TRUE(frozen) << "no frozen parameter";
  EXPECT_TRUE(unmanaged) << "no parameter of an ignored module";
  EXPECT_TRUE(unit_without_state) << "no flat parameter without state";
  EXPECT_TRUE(padded_state) << "no sharded state with right padding";
  EXPECT_TRUE(none_state) << "no None state (SGD without momentum)";
  EXPECT_TRUE(zero_dim_state) << "no 0-d tensor state (step)";
  EXPECT_TRUE(variant) << "no edited full dict";
  EXPECT_TRUE(torch_rejects) << "no full dict that torch rejects";
}

}  // namespace
}  // namespace optim
}  // namespace flatparam
