// Conformance of flatparam's layout, sharding and flattening with PyTorch
// FSDP, against golden data that tools/pytorch/gen_layout_golden.py recorded
// from torch 1.13's FlatParamHandle: verify/testdata/pytorch_layouts.json,
// whose "schema" field describes every value. Torch is not needed here.
//
// Each case (model x strategy x world size) is one parameterized test that
// builds FlatParamLayout::Create("", params, {world_size, strategy,
// align_addresses=false}) and compares every recorded field and the shard
// bytes; each failure names the case, the rank and the field.
//
// The 2.x reference (reference/flat_param.py) is the specification. Where
// torch 1.13 differs from it (the JSON's "divergences_from_2x"), flatparam
// is held to the 2.x behaviour and the test checks that the recorded 1.13
// value differs in exactly the documented way, so that new differences fail.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "flatparam/base/dtype.h"
#include "flatparam/base/status_matchers.h"
#include "flatparam/flatten.h"
#include "flatparam/layout.h"
#include "verify/conformance/golden_data.h"

namespace flatparam {
namespace {

using json = nlohmann::json;
using verify::FindByName;
using verify::GoldenCaseNames;
using verify::GoldenCaseTestName;
using verify::GoldenData;
using verify::LoadGoldenData;

constexpr char kGoldenPath[] = "verify/testdata/pytorch_layouts.json";

const GoldenData& Golden() { return LoadGoldenData(kGoldenPath); }

// "case <name>, rank <r>, field <field>"; rank < 0 for case-level fields.
std::string Where(const std::string& case_name, int64_t rank,
                  const std::string& field) {
  if (rank < 0) return absl::StrFormat("case %s, field %s", case_name, field);
  return absl::StrFormat("case %s, rank %d, field %s", case_name, rank, field);
}

std::vector<ParamSpec> ParseParamSpecs(const json& params) {
  std::vector<ParamSpec> specs;
  for (const json& p : params) {
    ParamSpec s;
    s.fqn = p.at("fqn").get<std::string>();
    s.shape = p.at("shape").get<std::vector<int64_t>>();
    absl::StatusOr<DType> dtype = ParseDType(p.at("dtype").get<std::string>());
    EXPECT_TRUE(dtype.ok()) << dtype.status();
    s.dtype = dtype.value_or(DType::kFloat32);
    s.requires_grad = p.at("requires_grad").get<bool>();
    s.tied_to = p.at("tied_to").get<std::string>();
    specs.push_back(std::move(s));
  }
  return specs;
}

int HexDigit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  return -1;
}

// Decodes lowercase hex; an empty vector and a test failure on bad input.
std::vector<unsigned char> DecodeHex(const std::string& hex,
                                     const std::string& where) {
  std::vector<unsigned char> bytes;
  if (hex.size() % 2 != 0) {
    ADD_FAILURE() << where << ": odd-length hex string";
    return bytes;
  }
  for (size_t i = 0; i < hex.size(); i += 2) {
    const int hi = HexDigit(hex[i]);
    const int lo = HexDigit(hex[i + 1]);
    if (hi < 0 || lo < 0) {
      ADD_FAILURE() << where << ": bad hex digit at " << i;
      return {};
    }
    bytes.push_back(static_cast<unsigned char>(hi * 16 + lo));
  }
  return bytes;
}

// Bytewise equality of `got` (a tensor of `dtype`) with `want`, reporting the
// first differing element's index and both values.
testing::AssertionResult SameBytes(const std::string& where,
                                   const HostTensor& got,
                                   const std::vector<unsigned char>& want) {
  const size_t size = DTypeSize(got.dtype());
  if (got.nbytes() != want.size()) {
    return testing::AssertionFailure()
           << where << ": flatparam has " << got.numel() << " elements, torch "
           << want.size() / size;
  }
  if (want.empty() ||  // memcmp's pointers must not be null
      std::memcmp(got.data(), want.data(), want.size()) == 0) {
    return testing::AssertionSuccess();
  }
  int64_t first = -1;
  int64_t differing = 0;
  for (int64_t i = 0; i < got.numel(); ++i) {
    if (std::memcmp(static_cast<const unsigned char*>(got.data()) + i * size,
                    want.data() + i * size, size) != 0) {
      if (first < 0) first = i;
      ++differing;
    }
  }
  return testing::AssertionFailure()
         << where << ": " << differing << " of " << got.numel()
         << " elements differ; first at element " << first << ": flatparam "
         << got.GetDouble(first) << ", torch "
         << LoadAsDouble(want.data(), got.dtype(), first);
}

// A golden case with everything the checks need.
struct Case {
  std::string name;
  const json* c = nullptr;
  const json* model = nullptr;
  const json* layout = nullptr;  // model["layout"]
  ShardingStrategy strategy = ShardingStrategy::kFullShard;
  int64_t world_size = 0;
};

// Layout fields that do not depend on the rank.
void CheckUnshardedLayout(const Case& k, const FlatParamLayout& layout) {
  const json& g = *k.layout;
  const std::string& n = k.name;
  absl::StatusOr<DType> dtype =
      ParseDType(k.model->at("dtype").get<std::string>());
  ASSERT_TRUE(dtype.ok()) << dtype.status();
  EXPECT_EQ(layout.dtype(), *dtype) << Where(n, -1, "dtype");
  EXPECT_EQ(layout.world_size(), k.world_size) << Where(n, -1, "world_size");
  EXPECT_EQ(layout.requires_grad(), g.at("requires_grad").get<bool>())
      << Where(n, -1, "requires_grad");
  EXPECT_EQ(layout.aligned_numel(), 0) << Where(n, -1, "aligned_numel");

  const json& infos = g.at("param_infos");
  const json& offsets = g.at("flat_param_offsets");
  ASSERT_EQ(layout.params().size(), infos.size())
      << Where(n, -1, "number of flattened parameters");
  ASSERT_EQ(offsets.size(), infos.size());
  for (size_t i = 0; i < infos.size(); ++i) {
    const ParamInfo& p = layout.params()[i];
    const json& want = infos[i];
    const std::string f = absl::StrCat("params[", i, "].");
    EXPECT_EQ(p.fqn, want.at("fqn").get<std::string>())
        << Where(n, -1, f + "fqn");
    EXPECT_EQ(p.module_name, want.at("module_name").get<std::string>())
        << Where(n, -1, f + "module_name");
    EXPECT_EQ(p.param_name, want.at("param_name").get<std::string>())
        << Where(n, -1, f + "param_name");
    EXPECT_EQ(p.shape, want.at("shape").get<std::vector<int64_t>>())
        << Where(n, -1, f + "shape");
    EXPECT_EQ(p.numel, want.at("numel").get<int64_t>())
        << Where(n, -1, f + "numel");
    EXPECT_EQ(p.requires_grad, want.at("requires_grad").get<bool>())
        << Where(n, -1, f + "requires_grad");
    EXPECT_EQ(p.offset, offsets[i].at(0).get<int64_t>())
        << Where(n, -1, f + "offset");
  }

  // torch 1.13 has no alignment padding: the segments are the parameters.
  std::vector<int64_t> numels;
  for (const json& p : infos) numels.push_back(p.at("numel").get<int64_t>());
  EXPECT_EQ(layout.numels_with_padding(), numels)
      << Where(n, -1, "numels_with_padding");
  EXPECT_EQ(layout.is_padding_mask(), std::vector<bool>(numels.size(), false))
      << Where(n, -1, "is_padding_mask");
  EXPECT_EQ(layout.flat_param_offsets(),
            (offsets.get<std::vector<std::pair<int64_t, int64_t>>>()))
      << Where(n, -1, "flat_param_offsets");

  const json& shared = g.at("shared_param_infos");
  ASSERT_EQ(layout.shared_params().size(), shared.size())
      << Where(n, -1, "number of shared parameters");
  for (size_t i = 0; i < shared.size(); ++i) {
    const SharedParamInfo& s = layout.shared_params()[i];
    const json& want = shared[i];
    const std::string f = absl::StrCat("shared_params[", i, "].");
    for (const auto& [name, got] :
         std::vector<std::pair<const char*, const std::string*>>{
             {"fqn", &s.fqn},
             {"module_name", &s.module_name},
             {"param_name", &s.param_name},
             {"prim_fqn", &s.prim_fqn},
             {"prim_module_name", &s.prim_module_name},
             {"prim_param_name", &s.prim_param_name}}) {
      EXPECT_EQ(*got, want.at(name).get<std::string>())
          << Where(n, -1, f + name);
    }
    ASSERT_GE(s.prim_index, 0) << Where(n, -1, f + "prim_index");
    ASSERT_LT(s.prim_index, static_cast<int>(layout.params().size()))
        << Where(n, -1, f + "prim_index");
    EXPECT_EQ(layout.params()[s.prim_index].fqn,
              want.at("prim_fqn").get<std::string>())
        << Where(n, -1, f + "prim_index");
  }

  EXPECT_EQ(layout.unpadded_unsharded_numel(),
            g.at("unpadded_unsharded_numel").get<int64_t>())
      << Where(n, -1, "unpadded_unsharded_numel");
  EXPECT_EQ(layout.sharded_numel(), k.c->at("sharded_numel").get<int64_t>())
      << Where(n, -1, "sharded_numel");
  EXPECT_EQ(layout.padded_unsharded_numel(),
            k.c->at("padded_unsharded_numel").get<int64_t>())
      << Where(n, -1, "padded_unsharded_numel");
}

void CheckShardMetadata(const Case& k, int64_t rank,
                        const FlatParamLayout& layout, const json& want) {
  const std::string& n = k.name;
  const FlatParamShardMetadata got = layout.shard_metadata(rank);
  if (want.at("param_offsets").empty()) {
    // Divergence: a rank holding no parameter element. torch 1.13's
    // `_shard_indices` is (0, 0) there and shard_metadata() slices [0:1], so
    // it reports the first parameter with no offsets; the 2.x reference
    // lists only in-shard parameters, i.e. nothing.
    EXPECT_THAT(got.param_names, testing::IsEmpty())
        << Where(n, rank, "shard_metadata.param_names");
    EXPECT_THAT(got.param_shapes, testing::IsEmpty())
        << Where(n, rank, "shard_metadata.param_shapes");
    EXPECT_THAT(got.param_numels, testing::IsEmpty())
        << Where(n, rank, "shard_metadata.param_numels");
    EXPECT_THAT(got.param_offsets, testing::IsEmpty())
        << Where(n, rank, "shard_metadata.param_offsets");
    const json& first = k.layout->at("param_infos").at(0);
    EXPECT_EQ(want.at("param_names"), json::array({first.at("fqn")}))
        << Where(n, rank, "shard_metadata.param_names")
        << ": torch 1.13 no longer shows the documented artefact";
    EXPECT_EQ(want.at("param_numels"), json::array({first.at("numel")}))
        << Where(n, rank, "shard_metadata.param_numels")
        << ": torch 1.13 no longer shows the documented artefact";
    return;
  }
  EXPECT_EQ(got.param_names,
            want.at("param_names").get<std::vector<std::string>>())
      << Where(n, rank, "shard_metadata.param_names");
  EXPECT_EQ(got.param_shapes,
            want.at("param_shapes").get<std::vector<std::vector<int64_t>>>())
      << Where(n, rank, "shard_metadata.param_shapes");
  EXPECT_EQ(got.param_numels,
            want.at("param_numels").get<std::vector<int64_t>>())
      << Where(n, rank, "shard_metadata.param_numels");
  EXPECT_EQ(got.param_offsets,
            (want.at("param_offsets")
                 .get<std::vector<std::pair<int64_t, int64_t>>>()))
      << Where(n, rank, "shard_metadata.param_offsets");
}

void CheckRank(const Case& k, int64_t rank, const FlatParamLayout& layout,
               const json& r) {
  const std::string& n = k.name;
  ASSERT_EQ(r.at("rank").get<int64_t>(), rank) << Where(n, rank, "rank");

  const ShardInterval iv = layout.shard_interval(rank);
  EXPECT_EQ(iv.start, r.at("shard_start").get<int64_t>())
      << Where(n, rank, "shard_interval.start");
  EXPECT_EQ(iv.end_inclusive, r.at("shard_end").get<int64_t>())
      << Where(n, rank, "shard_interval.end_inclusive");
  EXPECT_EQ(iv.numel_padded, r.at("numel_padded").get<int64_t>())
      << Where(n, rank, "shard_interval.numel_padded");

  const json& unpadded = r.at("unpadded_shard");
  if (!unpadded.is_null()) {
    const UnpaddedShard s = GetUnpaddedShard(layout.unpadded_unsharded_numel(),
                                             rank, layout.world_size());
    EXPECT_EQ(s.end - s.begin, unpadded.at("numel").get<int64_t>())
        << Where(n, rank, "GetUnpaddedShard (end - begin)");
    EXPECT_EQ(s.numel_to_pad, unpadded.at("numel_to_pad").get<int64_t>())
        << Where(n, rank, "GetUnpaddedShard.numel_to_pad");
    if (!unpadded.at("begin").is_null()) {
      EXPECT_EQ(s.begin, unpadded.at("begin").get<int64_t>())
          << Where(n, rank, "GetUnpaddedShard.begin");
    }
  }

  const json& infos = r.at("shard_param_infos");
  const std::vector<ShardParamInfo> got = layout.shard_param_infos(rank);
  ASSERT_EQ(got.size(), infos.size())
      << Where(n, rank, "number of shard_param_infos");
  for (size_t i = 0; i < infos.size(); ++i) {
    const std::string f = absl::StrCat("shard_param_infos[", i, "] (",
                                       layout.params()[i].fqn, ").");
    const json& want = infos[i];
    EXPECT_EQ(got[i].in_shard, !want.is_null())
        << Where(n, rank, f + "in_shard");
    EXPECT_EQ(layout.shard_param_info(rank, static_cast<int>(i)), got[i])
        << Where(n, rank, f + "(shard_param_info vs shard_param_infos)");
    if (want.is_null() || !got[i].in_shard) continue;
    EXPECT_EQ(got[i].offset_in_shard, want.at(0).get<int64_t>())
        << Where(n, rank, f + "offset_in_shard");
    EXPECT_EQ(got[i].numel_in_shard, want.at(1).get<int64_t>())
        << Where(n, rank, f + "numel_in_shard");
    EXPECT_EQ(got[i].intra_param_start_idx, want.at(2).get<int64_t>())
        << Where(n, rank, f + "intra_param_start_idx");
    EXPECT_EQ(got[i].intra_param_end_idx, want.at(3).get<int64_t>())
        << Where(n, rank, f + "intra_param_end_idx");
  }

  CheckShardMetadata(k, rank, layout, r.at("shard_metadata"));
}

class PytorchConformanceTest : public testing::TestWithParam<std::string> {};

TEST_P(PytorchConformanceTest, MatchesTorch) {
  const GoldenData& golden = Golden();
  ASSERT_TRUE(golden.error.empty()) << golden.error;
  Case k;
  k.name = GetParam();
  k.c = &FindByName(golden.data.at("cases"), k.name);
  ASSERT_FALSE(k.c->is_null()) << "no case " << k.name;
  k.model = &FindByName(golden.data.at("models"), k.c->at("model"));
  ASSERT_FALSE(k.model->is_null()) << Where(k.name, -1, "model");
  k.layout = &k.model->at("layout");
  absl::StatusOr<ShardingStrategy> strategy =
      ParseShardingStrategy(k.c->at("strategy").get<std::string>());
  ASSERT_TRUE(strategy.ok()) << strategy.status();
  k.strategy = *strategy;
  k.world_size = k.c->at("world_size").get<int64_t>();

  const std::vector<ParamSpec> specs = ParseParamSpecs(k.model->at("params"));
  LayoutOptions options;
  options.world_size = k.world_size;
  options.strategy = k.strategy;
  options.align_addresses = false;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(const FlatParamLayout layout,
                                 FlatParamLayout::Create("", specs, options));

  CheckUnshardedLayout(k, layout);
  if (HasFatalFailure()) return;

  // The parameters' data, in layout.params() order.
  std::vector<std::vector<unsigned char>> param_bytes;
  std::vector<ConstBufferRef> params;
  const json& data = k.model->at("param_data_hex");
  for (const ParamInfo& p : layout.params()) {
    param_bytes.push_back(
        DecodeHex(data.at(p.fqn).get<std::string>(),
                  Where(k.name, -1, "param_data_hex." + p.fqn)));
    ASSERT_EQ(param_bytes.back().size(), p.numel * DTypeSize(layout.dtype()))
        << Where(k.name, -1, "param_data_hex." + p.fqn);
  }
  for (size_t i = 0; i < param_bytes.size(); ++i) {
    params.push_back({param_bytes[i].data(), layout.params()[i].numel,
                      layout.dtype(), Device::Host()});
  }

  HostTensor flat =
      HostTensor::Flat(layout.dtype(), layout.unpadded_unsharded_numel());
  FLATPARAM_ASSERT_OK(Flatten(layout, params, flat.ref()));
  EXPECT_TRUE(SameBytes(
      Where(k.name, -1, "Flatten output vs torch flat parameter"), flat,
      DecodeHex(k.layout->at("flat_hex").get<std::string>(), "flat_hex")));

  const json& ranks = k.c->at("ranks");
  ASSERT_EQ(static_cast<int64_t>(ranks.size()), k.world_size)
      << Where(k.name, -1, "number of ranks");
  // Each parameter rebuilt from every rank's torch shard by UnflattenShard.
  std::vector<HostTensor> rebuilt;
  std::vector<BufferRef> rebuilt_refs;
  for (const ParamInfo& p : layout.params()) {
    rebuilt.push_back(HostTensor::Flat(layout.dtype(), p.numel));
  }
  for (HostTensor& t : rebuilt) rebuilt_refs.push_back(t.ref());

  for (int64_t rank = 0; rank < k.world_size; ++rank) {
    const json& r = ranks[rank];
    CheckRank(k, rank, layout, r);
    if (HasFatalFailure()) return;

    const std::vector<unsigned char> torch_shard = DecodeHex(
        r.at("shard_hex").get<std::string>(), Where(k.name, rank, "shard_hex"));
    HostTensor shard = HostTensor::Flat(layout.dtype(), layout.sharded_numel());
    FLATPARAM_ASSERT_OK(FlattenShard(layout, params, rank, shard.ref()));
    EXPECT_TRUE(
        SameBytes(Where(k.name, rank, "FlattenShard output vs torch shard"),
                  shard, torch_shard));

    HostTensor copied =
        HostTensor::Flat(layout.dtype(), layout.sharded_numel());
    FLATPARAM_ASSERT_OK(CopyShard(layout, flat.cref(), rank, copied.ref()));
    EXPECT_TRUE(SameBytes(
        Where(k.name, rank, "Flatten+CopyShard output vs torch shard"), copied,
        torch_shard));

    if (torch_shard.size() == shard.nbytes()) {
      const ConstBufferRef torch_ref{torch_shard.data(), layout.sharded_numel(),
                                     layout.dtype(), Device::Host()};
      FLATPARAM_ASSERT_OK(
          UnflattenShard(layout, torch_ref, rank, rebuilt_refs));
    }
  }
  for (size_t i = 0; i < rebuilt.size(); ++i) {
    EXPECT_TRUE(
        SameBytes(Where(k.name, -1,
                        absl::StrCat("UnflattenShard of all torch shards vs ",
                                     layout.params()[i].fqn)),
                  rebuilt[i], param_bytes[i]));
  }
}

INSTANTIATE_TEST_SUITE_P(Golden, PytorchConformanceTest,
                         testing::ValuesIn(GoldenCaseNames(Golden())),
                         GoldenCaseTestName);

// A flat parameter with no elements: torch 1.13 shards it (to 0-element
// shards); the 2.x reference asserts in `_init_shard_metadata`, and flatparam
// rejects it.
TEST(PytorchConformance, RejectsFlatParameterWithNoElements) {
  const GoldenData& golden = Golden();
  ASSERT_TRUE(golden.error.empty()) << golden.error;
  const json& rejected = golden.data.at("rejected_models");
  ASSERT_FALSE(rejected.empty());
  for (const json& model : rejected) {
    const std::string name = model.at("name").get<std::string>();
    const std::vector<ParamSpec> specs = ParseParamSpecs(model.at("params"));
    for (const char* strategy : {"FULL_SHARD", "NO_SHARD"}) {
      const std::string key = absl::StrCat(strategy, "/world_size=2");
      // Evidence that torch 1.13 accepted it.
      for (const json& r : model.at("torch_1_13").at(key)) {
        EXPECT_EQ(r.at("shard_numel").get<int64_t>(), 0)
            << "rejected model " << name << " " << key << " rank "
            << r.at("rank") << ": expected torch 1.13's 0-element shard";
      }
      LayoutOptions options;
      options.world_size = 2;
      options.strategy = *ParseShardingStrategy(strategy);
      EXPECT_THAT(FlatParamLayout::Create("", specs, options),
                  StatusIs(absl::StatusCode::kInvalidArgument,
                           testing::HasSubstr("no elements")))
          << "rejected model " << name << " " << key;
    }
  }
}

// Guards the golden data itself, so that a regenerated file cannot silently
// drop the situations this suite exists to cover.
TEST(PytorchConformance, GoldenDataCoversTheIntendedSituations) {
  const GoldenData& golden = Golden();
  ASSERT_TRUE(golden.error.empty()) << golden.error;
  const json& g = golden.data;
  EXPECT_EQ(g.at("format"), "flatparam.pytorch_layouts.v1");
  EXPECT_THAT(g.at("torch_version").get<std::string>(),
              testing::StartsWith("1.13"));

  std::set<std::string> dtypes;
  bool tied = false, scalar = false, zero_numel = false;
  for (const json& m : g.at("models")) {
    dtypes.insert(m.at("dtype").get<std::string>());
    for (const json& p : m.at("params")) {
      tied |= !p.at("tied_to").get<std::string>().empty();
      scalar |= p.at("shape").empty();
      zero_numel |= NumElements(p.at("shape").get<std::vector<int64_t>>()) == 0;
    }
    for (const char* strategy : {"FULL_SHARD", "NO_SHARD"}) {
      for (int w = 1; w <= 8; ++w) {
        const std::string name = absl::StrCat(m.at("name").get<std::string>(),
                                              "/", strategy, "/world_size=", w);
        EXPECT_FALSE(FindByName(g.at("cases"), name).is_null())
            << "missing case " << name;
      }
    }
  }
  EXPECT_THAT(dtypes, testing::UnorderedElementsAre("float32", "float64",
                                                    "float16", "bfloat16"));
  EXPECT_TRUE(tied) << "no tied parameter";
  EXPECT_TRUE(scalar) << "no 0-d parameter";
  EXPECT_TRUE(zero_numel) << "no zero-size-dim parameter";

  bool padding_only_rank = false, param_spans_ranks = false;
  bool zero_numel_in_shard = false;
  for (const json& c : g.at("cases")) {
    if (c.at("strategy") != "FULL_SHARD") continue;
    for (const json& r : c.at("ranks")) {
      padding_only_rank |= r.at("shard_param_offsets").empty();
      for (const json& info : r.at("shard_param_infos")) {
        if (info.is_null()) continue;
        zero_numel_in_shard |= info.at(1).get<int64_t>() == 0;
      }
    }
    const json& model = FindByName(g.at("models"), c.at("model"));
    for (const json& p : model.at("layout").at("param_infos")) {
      param_spans_ranks |= p.at("numel").get<int64_t>() >
                           2 * c.at("sharded_numel").get<int64_t>();
    }
  }
  EXPECT_TRUE(padding_only_rank) << "no rank holding only padding";
  EXPECT_TRUE(param_spans_ranks) << "no parameter larger than two shards";
  EXPECT_TRUE(zero_numel_in_shard) << "no zero-numel parameter in a shard";
}

}  // namespace
}  // namespace flatparam
