// Runs the sidecar fuzz target (optim_sidecar_fuzz.cc) as an ordinary test:
// over seeds made by the real writers and hand-made damaged ones (wrong
// types, huge numbers, deep nesting, non-UTF-8, NaN encodings), over the
// checked-in seeds, over every truncation of a valid sidecar, then over
// deterministic random mutations. A finding aborts the process with the
// reason. Seeds named valid_* must parse, invalid_* must be DataLoss.
//
// With TEST_UNDECLARED_OUTPUTS_DIR set (bazel test does), the generated
// seeds of at most 4 KiB are also written there, which is where
// testdata/optim_sidecar came from.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "flatparam/base/dtype.h"
#include "flatparam/base/status_matchers.h"
#include "flatparam/checkpoint/checkpoint_dir.h"
#include "flatparam/checkpoint/file_system.h"
#include "flatparam/checkpoint/training_state.h"
#include "flatparam/flatten.h"
#include "flatparam/layout.h"
#include "flatparam/optim/optim_state.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

// Defined in optim_sidecar_fuzz.cc.
struct OptimSidecarFuzzStats {
  int64_t parsed = 0;
  int64_t rank_read = 0;
  int64_t full_read = 0;
};
OptimSidecarFuzzStats& GetOptimSidecarFuzzStats();

namespace flatparam {
namespace checkpoint {
namespace {

using ::testing::HasSubstr;
using json = nlohmann::json;
using optim::ParamKey;

constexpr int kMutations = 3000;
constexpr absl::StatusCode kDataLoss = absl::StatusCode::kDataLoss;

struct Seed {
  std::string name;
  std::string bytes;
};

int RunTarget(const std::string& bytes) {
  return LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(bytes.data()),
                                bytes.size());
}

absl::StatusOr<OptimSidecar> Parse(const std::string& bytes) {
  const json doc = json::parse(bytes, nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded()) return absl::DataLossError("not JSON");
  return ParseOptimSidecar(doc, "seed.json");
}

double FromBits(uint64_t bits) {
  double d;
  std::memcpy(&d, &bits, sizeof(d));
  return d;
}

// Every kind of value the schema holds.
optim::ParamState Scalars() {
  optim::ParamState s;
  s["i"] = int64_t{-7};
  s["min"] = std::numeric_limits<int64_t>::min();
  s["max"] = std::numeric_limits<int64_t>::max();
  s["f"] = 0.1;
  s["f_int"] = 3.0;
  s["tiny"] = std::numeric_limits<double>::denorm_min();
  s["huge"] = std::numeric_limits<double>::max();
  s["negzero"] = -0.0;
  s["inf"] = std::numeric_limits<double>::infinity();
  s["ninf"] = -std::numeric_limits<double>::infinity();
  s["nan"] = std::numeric_limits<double>::quiet_NaN();
  s["nan_payload"] = FromBits(0xfff0000000000123ULL);
  s["b"] = true;
  s["s"] = std::string("adam \"w\" \xc3\xa9 \x01");
  s["bytes"] = std::string("not utf-8: \xff\xfe\0", 14);
  s["none"] = std::monostate();
  return s;
}

std::vector<optim::ParamGroup> Groups(std::vector<ParamKey> params) {
  optim::ParamGroup g;
  g.params = std::move(params);
  g.hyperparams["lr"] = 1e-3;
  g.hyperparams["betas"] = std::vector<double>{0.9, 0.999, -0.0};
  g.hyperparams["nans"] = std::vector<double>{
      std::numeric_limits<double>::quiet_NaN(), FromBits(0x7ff0000000000001)};
  g.hyperparams["empty"] = std::vector<double>{};
  g.hyperparams["amsgrad"] = false;
  g.hyperparams["foreach"] = std::monostate();
  g.hyperparams["steps"] = int64_t{4};
  g.hyperparams["name"] = std::string("decay");
  g.hyperparams["raw"] = std::string("\xc0\xaf", 2);  // overlong '/'
  return {g, optim::ParamGroup()};
}

// The sidecars the real writers produce.
std::vector<Seed> WriterSeeds() {
  std::vector<Seed> seeds;
  ModelSpec spec;
  spec.name = "fuzz";
  spec.params = {{"a.weight", {3, 2}}, {"b.weight", {5}}, {"b.bias", {}}};
  spec.wrap = {"b"};
  LayoutOptions options;
  options.world_size = 2;
  absl::StatusOr<ModelLayout> layout = ModelLayout::Create(spec, options);
  EXPECT_THAT(layout, IsOk());
  if (!layout.ok()) return seeds;

  RankState rank;
  for (const FlatParamLayout& f : layout->flat_params()) {
    rank.flat_params.push_back(HostTensor::Flat(f.dtype(), f.sharded_numel()));
  }
  optim::ParamState s0 = Scalars();
  s0["exp_avg"] = HostTensor::Flat(DType::kFloat32,
                                   layout->flat_params()[0].sharded_numel());
  s0["step"] = optim::ScalarTensor(DType::kFloat32, 3);
  rank.optim.state[ParamKey(int64_t{0})] = std::move(s0);
  rank.optim.state[ParamKey(int64_t{1})] = {};
  rank.optim.state[ParamKey(std::string("ignored.weight"))] = Scalars();
  rank.optim.state[ParamKey(std::string(""))]["x"] = int64_t{1};
  rank.optim.param_groups = Groups({ParamKey(int64_t{0}), ParamKey(int64_t{1}),
                                    ParamKey(std::string("ignored.weight"))});
  rank.extra = json{{"step", 12},
                    {"options", {{"lr", 0.5}, {"list", {1, "two", nullptr}}}}};
  absl::StatusOr<RankContent> rc = MakeRankContent(*layout, 0, rank);
  EXPECT_THAT(rc, IsOk());
  if (rc.ok()) seeds.push_back({"valid_rank.json", rc->sidecar.dump(1)});

  // The fuzz target's own fixture checkpoint: rank 0 of it as written, so
  // mutations of it reach the success path of ReadRankState.
  RankState fixture;
  for (const FlatParamLayout& f : layout->flat_params()) {
    fixture.flat_params.push_back(
        HostTensor::Flat(f.dtype(), f.sharded_numel()));
  }
  auto& p0 = fixture.optim.state[ParamKey(int64_t{0})];
  p0["exp_avg"] = HostTensor::Flat(DType::kFloat32,
                                   layout->flat_params()[0].sharded_numel());
  p0["step"] = optim::ScalarTensor(DType::kFloat32, 3);
  p0["count"] = int64_t{3};
  fixture.optim.state[ParamKey(std::string("user"))]["note"] = std::string("x");
  optim::ParamGroup group;
  group.params = {ParamKey(int64_t{0}), ParamKey(int64_t{1})};
  group.hyperparams["lr"] = 0.5;
  fixture.optim.param_groups.push_back(group);
  fixture.extra = json{{"step", 7}};
  absl::StatusOr<RankContent> fc = MakeRankContent(*layout, 0, fixture);
  EXPECT_THAT(fc, IsOk());
  if (fc.ok()) seeds.push_back({"valid_fixture_rank.json", fc->sidecar.dump()});

  FullState full;
  full.optim.state[ParamKey(std::string("a.weight"))] = Scalars();
  full.optim.state[ParamKey(std::string("a.weight"))]["exp_avg"] =
      HostTensor(DType::kBFloat16, {3, 2});
  full.optim.state[ParamKey(std::string("b"))]["weight.step"] =
      optim::ScalarTensor(DType::kInt64, 2);
  full.optim.param_groups = Groups({ParamKey(std::string("a.weight"))});
  absl::StatusOr<FullCheckpointContent> fu = MakeFullContent(full);
  EXPECT_THAT(fu, IsOk());
  if (fu.ok()) seeds.push_back({"valid_full.json", fu->optim_json.dump(2)});
  return seeds;
}

// A valid document with `value` as the one state value, and one with it as
// the one hyperparameter.
std::string WithValue(const std::string& value) {
  return absl::StrCat(
      R"({"format": "flatparam.optim.v1", "state": [{"key": "k", "values": )",
      R"({"v": )", value, R"(}}], "param_groups": []})");
}
std::string WithHyper(const std::string& value) {
  return absl::StrCat(R"({"format": "flatparam.optim.v1", "state": [], )",
                      R"("param_groups": [{"params": [], "hyperparams": )",
                      R"({"h": )", value, "}}]}");
}
std::string WithKey(const std::string& key) {
  return absl::StrCat(R"({"format": "flatparam.optim.v1", "state": [{"key": )",
                      key, R"(, "values": {}}], "param_groups": []})");
}
std::string Nested(const std::string& open, const std::string& inner,
                   const std::string& close, int depth) {
  std::string s;
  s.reserve((open.size() + close.size()) * depth + inner.size());
  for (int i = 0; i < depth; ++i) s += open;
  s += inner;
  for (int i = 0; i < depth; ++i) s += close;
  return s;
}

std::vector<Seed> HandSeeds() {
  const std::string minimal =
      R"({"format": "flatparam.optim.v1", "state": [], "param_groups": []})";
  std::vector<Seed> s = {
      {"valid_minimal.json", minimal},
      {"valid_extra.json",
       R"({"format": "flatparam.optim.v1", "state": [], "param_groups": [],)"
       R"( "extra": {"a": [1, {"b": null}], "": "\u0000"}})"},
      // NaN and infinity encodings.
      {"valid_nan.json", WithValue(R"({"float": "nan"})")},
      {"valid_nan_payload.json",
       WithValue(R"({"float": "nan:7ff8000000000001"})")},
      {"valid_nan_upper.json",
       WithValue(R"({"float": "nan:FFF8000000000000"})")},
      {"valid_nan_canonical_hex.json",
       WithValue(R"({"float": "nan:7ff8000000000000"})")},
      {"valid_nan_signalling.json",
       WithHyper(R"({"floats": ["nan:7ff0000000000001", "-inf", -0.0]})")},
      {"valid_inf.json", WithValue(R"({"float": "-inf"})")},
      {"invalid_nan_inf_bits.json",
       WithValue(R"({"float": "nan:7ff0000000000000"})")},
      {"invalid_nan_zero_bits.json",
       WithValue(R"({"float": "nan:0000000000000000"})")},
      {"invalid_nan_short.json",
       WithValue(R"({"float": "nan:7ff800000000001"})")},
      {"invalid_nan_long.json",
       WithValue(R"({"float": "nan:07ff8000000000001"})")},
      {"invalid_nan_sign.json",
       WithValue(R"({"float": "nan:-7ff800000000001"})")},
      {"invalid_nan_0x.json",
       WithValue(R"({"float": "nan:0x7ff80000000001"})")},
      {"invalid_nan_space.json",
       WithValue(R"({"float": "nan: 7ff80000000001"})")},
      {"invalid_nan_python.json", WithValue(R"({"float": "NaN"})")},
      {"invalid_infinity.json", WithValue(R"({"float": "Infinity"})")},
      {"invalid_nan_literal.json", WithValue(R"({"float": NaN})")},
      {"invalid_inf_literal.json", WithValue(R"({"float": Infinity})")},
      // Huge and odd numbers.
      {"invalid_float_overflow.json", WithValue(R"({"float": 1e400})")},
      {"valid_float_underflow.json", WithValue(R"({"float": -1e-400})")},
      {"valid_float_from_uint.json",
       WithValue(R"({"float": 18446744073709551615})")},
      {"valid_int_min.json", WithValue(R"({"int": -9223372036854775808})")},
      {"invalid_int_over.json", WithValue(R"({"int": 9223372036854775808})")},
      {"invalid_int_under.json", WithValue(R"({"int": -9223372036854775809})")},
      {"invalid_int_uint_max.json",
       WithValue(R"({"int": 18446744073709551615})")},
      {"invalid_int_huge.json",
       WithValue(R"({"int": 123456789012345678901234567890})")},
      {"invalid_int_exp.json", WithValue(R"({"int": 1e3})")},
      {"invalid_key_huge.json", WithKey("99999999999999999999")},
      {"invalid_key_float.json", WithKey("1.5")},
      {"valid_key_negative.json", WithKey("-3")},
      // Wrong types.
      {"invalid_int_float.json", WithValue(R"({"int": 1.5})")},
      {"invalid_int_string.json", WithValue(R"({"int": "1"})")},
      {"invalid_bool_int.json", WithValue(R"({"bool": 1})")},
      {"invalid_float_bool.json", WithValue(R"({"float": true})")},
      {"invalid_float_null.json", WithValue(R"({"float": null})")},
      {"invalid_str_number.json", WithValue(R"({"str": 1})")},
      {"invalid_none_zero.json", WithValue(R"({"none": 0})")},
      {"invalid_tensor_empty.json", WithValue(R"({"tensor": ""})")},
      {"invalid_tensor_number.json", WithValue(R"({"tensor": 3})")},
      {"invalid_two_tags.json", WithValue(R"({"int": 1, "float": 1.0})")},
      {"invalid_no_tag.json", WithValue("{}")},
      {"invalid_bare_value.json", WithValue("3")},
      {"invalid_unknown_tag.json", WithValue(R"({"tuple": [1]})")},
      {"invalid_floats_state.json", WithValue(R"({"floats": [1.0]})")},
      {"invalid_hyper_tensor.json", WithHyper(R"({"tensor": "x"})")},
      {"invalid_floats_not_array.json", WithHyper(R"({"floats": 1.0})")},
      {"invalid_floats_element.json", WithHyper(R"({"floats": [1.0, "x"]})")},
      {"invalid_key_null.json", WithKey("null")},
      {"invalid_key_object.json", WithKey("{}")},
      {"invalid_state_object.json",
       R"({"format": "flatparam.optim.v1", "state": {}, "param_groups": []})"},
      {"invalid_values_array.json",
       R"({"format": "flatparam.optim.v1", "state": [{"key": 0, "values": []}],)"
       R"( "param_groups": []})"},
      {"invalid_entry_extra_member.json",
       R"({"format": "flatparam.optim.v1", "state": [{"key": 0, "values": {},)"
       R"( "x": 1}], "param_groups": []})"},
      {"invalid_empty_state_name.json",
       R"({"format": "flatparam.optim.v1", "state": [{"key": 0, "values":)"
       R"( {"": {"int": 1}}}], "param_groups": []})"},
      {"invalid_duplicate_key.json",
       R"({"format": "flatparam.optim.v1", "state": [{"key": 0, "values": {}},)"
       R"( {"key": 0, "values": {}}], "param_groups": []})"},
      {"invalid_group_params_object.json",
       R"({"format": "flatparam.optim.v1", "state": [], "param_groups":)"
       R"( [{"params": {}, "hyperparams": {}}]})"},
      {"invalid_group_key.json",
       R"({"format": "flatparam.optim.v1", "state": [], "param_groups":)"
       R"( [{"params": [true], "hyperparams": {}}]})"},
      {"invalid_extra_array.json",
       R"({"format": "flatparam.optim.v1", "state": [], "param_groups": [],)"
       R"( "extra": []})"},
      {"invalid_unknown_member.json",
       R"({"format": "flatparam.optim.v1", "state": [], "param_groups": [],)"
       R"( "version": 2})"},
      {"invalid_format.json",
       R"({"format": "flatparam.optim.v2", "state": [], "param_groups": []})"},
      {"invalid_format_missing.json", R"({"state": [], "param_groups": []})"},
      {"invalid_not_object.json", "[]"},
      {"invalid_empty.json", ""},
      {"invalid_str_bytes_odd.json", WithValue(R"({"str_bytes": "abc"})")},
      {"invalid_str_bytes_hex.json", WithValue(R"({"str_bytes": "zz"})")},
      {"valid_str_bytes_utf8.json", WithValue(R"({"str_bytes": "c3a9"})")},
      {"valid_str_bytes_surrogate.json",
       WithValue(R"({"str_bytes": "eda080"})")},
      // Non-UTF-8 where JSON text must be UTF-8.
      {"invalid_raw_ff.json", WithValue("{\"str\": \"\xff\"}")},
      {"invalid_overlong.json", WithValue("{\"str\": \"\xc0\xaf\"}")},
      {"invalid_utf16_surrogate.json",
       WithValue("{\"str\": \"\xed\xa0\x80\"}")},
      {"invalid_lone_surrogate.json", WithValue(R"({"str": "\ud800"})")},
      {"invalid_lone_low_surrogate.json", WithValue(R"({"str": "\udc00x"})")},
      {"invalid_key_ff.json", WithKey("\"\xff\"")},
      {"valid_escaped_pair.json",
       WithValue(R"({"str": "\ud83d\ude00\u0000"})")},
      // Deep nesting (small; the big ones are made in DeepSeeds).
      {"invalid_nested_value.json",
       WithValue(Nested(R"({"str": )", "1", "}", 200))},
      {"valid_nested_extra.json",
       absl::StrCat(R"({"format": "flatparam.optim.v1", "state": [], )",
                    R"("param_groups": [], "extra": {"x": )",
                    Nested("[", "", "]", 100), "}}")},
      {"invalid_nested_extra.json",
       absl::StrCat(R"({"format": "flatparam.optim.v1", "state": [], )",
                    R"("param_groups": [], "extra": {"x": )",
                    Nested("[", "", "]", 600), "}}")},
  };
  return s;
}

// Nested far beyond any stack: must be rejected, not recursed into.
std::vector<Seed> DeepSeeds() {
  constexpr int kDeep = 100000;
  return {
      {"invalid_deep_extra.json",
       absl::StrCat(R"({"format": "flatparam.optim.v1", "state": [], )",
                    R"("param_groups": [], "extra": {"x": )",
                    Nested("[", "", "]", kDeep), "}}")},
      {"invalid_deep_extra_objects.json",
       absl::StrCat(R"({"format": "flatparam.optim.v1", "state": [], )",
                    R"("param_groups": [], "extra": )",
                    Nested(R"({"a":)", "0", "}", kDeep), "}")},
      {"invalid_deep_value.json", WithValue(Nested("[", "", "]", kDeep))},
      {"invalid_deep_format.json",
       absl::StrCat(R"({"format": )", Nested("[", "", "]", kDeep), "}")},
      {"invalid_deep_unknown_member.json",
       absl::StrCat(R"({"format": "flatparam.optim.v1", "x": )",
                    Nested("[", "", "]", kDeep), "}")},
  };
}

std::string SeedDir() {
  const std::string path = "flatparam/checkpoint/testdata/optim_sidecar";
  const char* srcdir = std::getenv("TEST_SRCDIR");
  const char* workspace = std::getenv("TEST_WORKSPACE");
  if (srcdir == nullptr || workspace == nullptr) return path;
  return absl::StrCat(srcdir, "/", workspace, "/", path);
}

std::vector<Seed> CheckedInSeeds() {
  std::vector<Seed> seeds;
  FileSystem& fs = PosixFileSystem();
  absl::StatusOr<std::vector<std::string>> names = fs.GetChildren(SeedDir());
  EXPECT_THAT(names, IsOk());
  if (!names.ok()) return seeds;
  for (const std::string& name : *names) {
    absl::StatusOr<std::string> bytes =
        ReadFileToString(fs, JoinPath(SeedDir(), name), 1 << 20);
    EXPECT_THAT(bytes, IsOk());
    if (bytes.ok()) seeds.push_back({name, *bytes});
  }
  return seeds;
}

std::vector<Seed> AllSeeds() {
  std::vector<Seed> seeds = WriterSeeds();
  for (Seed& s : HandSeeds()) seeds.push_back(std::move(s));
  return seeds;
}

void ExpectBehavesAsNamed(const Seed& seed) {
  SCOPED_TRACE(seed.name);
  EXPECT_EQ(RunTarget(seed.bytes), 0);
  if (absl::StartsWith(seed.name, "valid_")) {
    EXPECT_THAT(Parse(seed.bytes), IsOk());
  } else {
    ASSERT_TRUE(absl::StartsWith(seed.name, "invalid_")) << "bad seed name";
    EXPECT_THAT(Parse(seed.bytes), StatusIs(kDataLoss));
  }
}

// The round-trip checks behind ReadRankState and ReadFullState run only
// for inputs those accept: the writers' seeds must be.
TEST(OptimSidecarFuzzTest, WriterSeedsReachEveryReader) {
  for (const Seed& seed : WriterSeeds()) {
    SCOPED_TRACE(seed.name);
    const OptimSidecarFuzzStats before = GetOptimSidecarFuzzStats();
    EXPECT_EQ(RunTarget(seed.bytes), 0);
    const OptimSidecarFuzzStats& after = GetOptimSidecarFuzzStats();
    EXPECT_EQ(after.parsed, before.parsed + 1);
    EXPECT_EQ(after.full_read,
              before.full_read + (seed.name == "valid_full.json"));
    EXPECT_EQ(after.rank_read,
              before.rank_read + (seed.name != "valid_full.json"));
  }
}

TEST(OptimSidecarFuzzTest, GeneratedSeedsBehaveAsNamed) {
  const std::vector<Seed> seeds = AllSeeds();
  ASSERT_GE(seeds.size(), 60u);
  const char* out = std::getenv("TEST_UNDECLARED_OUTPUTS_DIR");
  for (const Seed& seed : seeds) {
    ExpectBehavesAsNamed(seed);
    if (out != nullptr && seed.bytes.size() <= 4096) {
      absl::StatusOr<std::unique_ptr<WritableFile>> file =
          PosixFileSystem().NewWritableFile(JoinPath(out, seed.name));
      ASSERT_THAT(file, IsOk());
      EXPECT_THAT((*file)->Append(seed.bytes), IsOk());
      EXPECT_THAT((*file)->Close(), IsOk());
    }
  }
}

TEST(OptimSidecarFuzzTest, CheckedInSeedsBehaveAsNamed) {
  const std::vector<Seed> seeds = CheckedInSeeds();
  ASSERT_GE(seeds.size(), 60u);
  for (const Seed& seed : seeds) ExpectBehavesAsNamed(seed);
}

TEST(OptimSidecarFuzzTest, DeepNestingIsRejectedWithoutRecursion) {
  for (const Seed& seed : DeepSeeds()) {
    SCOPED_TRACE(seed.name);
    EXPECT_EQ(RunTarget(seed.bytes), 0);
    EXPECT_THAT(Parse(seed.bytes),
                StatusIs(kDataLoss, HasSubstr("nested deeper than")));
  }
}

// What the writers refuse the readers must refuse too.
TEST(OptimSidecarFuzzTest, RankReaderRejectsKeysOutsideTheFlatParams) {
  // Key 2 holds no tensor, so only the key check can catch it.
  for (const Seed& seed : WriterSeeds()) {
    if (seed.name != "valid_fixture_rank.json") continue;
    json doc = json::parse(seed.bytes);
    for (const int64_t key : {int64_t{2}, int64_t{-1}}) {
      json bad = doc;
      bad["state"].push_back({{"key", key}, {"values", json::object()}});
      EXPECT_EQ(RunTarget(bad.dump()), 0);
    }
  }
}

TEST(OptimSidecarFuzzTest, FullReaderRejectsIntKeysAndSharedTensors) {
  const std::string state =
      R"({"format": "flatparam.optim.v1", "param_groups": [], "state": )";
  // RunTarget aborts if ReadFullState accepts what MakeFullContent cannot
  // write back.
  EXPECT_EQ(RunTarget(state + R"([{"key": 0, "values": {}}]})"), 0);
  EXPECT_EQ(RunTarget(state + R"([{"key": "a.b", "values": {"c": )"
                              R"({"tensor": "state.a.b.c"}}},)"
                              R"( {"key": "a", "values": {"b.c": )"
                              R"({"tensor": "state.a.b.c"}}}]})"),
            0);
}

TEST(OptimSidecarFuzzTest, TruncationsAreRejected) {
  for (const Seed& seed : WriterSeeds()) {
    SCOPED_TRACE(seed.name);
    // Every one for the small seeds; a few hundred of the large one.
    const size_t step = 1 + seed.bytes.size() / 400;
    for (size_t n = 0; n < seed.bytes.size(); n += step) {
      const std::string prefix = seed.bytes.substr(0, n);
      ASSERT_EQ(RunTarget(prefix), 0);
      ASSERT_THAT(Parse(prefix), StatusIs(kDataLoss)) << n;
    }
  }
}

// ParseOptimSidecar takes any json, not only parsed text: its messages
// must not throw on invalid UTF-8 (json::dump would) and stay short.
TEST(OptimSidecarFuzzTest, ErrorMessagesNeverThrowAndStayShort) {
  const json bad_utf8 = {{"format", std::string("\xff\xfe")}};
  EXPECT_THAT(ParseOptimSidecar(bad_utf8, "f.json"),
              StatusIs(kDataLoss, HasSubstr("f.json: format: expected")));
  json huge = json::parse(WithValue(R"({"int": 1.5})"));
  huge["state"][0]["values"]["v"]["int"] = std::vector<double>(100000, 1.5);
  absl::StatusOr<OptimSidecar> parsed = ParseOptimSidecar(huge, "f.json");
  EXPECT_THAT(parsed, StatusIs(kDataLoss, HasSubstr("state[0].values.v.int")));
  EXPECT_LT(parsed.status().message().size(), 1000u);
}

// The writer refuses the "extra" the reader would refuse, and no more.
TEST(OptimSidecarFuzzTest, WriterAndReaderAgreeOnDepth) {
  for (int depth = 500; depth <= 520; ++depth) {
    SCOPED_TRACE(depth);
    OptimSidecar sidecar;
    // An object nesting arrays: depth levels in all.
    json inner = json::array();
    for (int i = 2; i < depth; ++i) inner = json::array({std::move(inner)});
    sidecar.extra = {{"x", std::move(inner)}};
    absl::StatusOr<json> doc = OptimSidecarToJson(sidecar, /*with_extra=*/true);
    if (!doc.ok()) {
      EXPECT_THAT(doc, StatusIs(absl::StatusCode::kInvalidArgument,
                                HasSubstr("nested deeper than")));
      EXPECT_GE(depth, 512);
      continue;
    }
    EXPECT_LT(depth, 512);
    EXPECT_THAT(ParseOptimSidecar(*doc, "f.json"), IsOk());
  }
}

// One random edit, biased towards JSON structure: punctuation, numbers,
// type tags, NaN spellings, nesting.
void Mutate(std::mt19937_64& random, const std::vector<Seed>& seeds,
            std::string& bytes) {
  auto below = [&random](uint64_t n) {
    return n == 0 ? 0 : static_cast<size_t>(random() % n);
  };
  static const char kBytes[] = {'\0', '\xff', '\xc3', '{', '}', '[', ']',
                                '"',  ',',    ':',    '-', '0', '9', ' ',
                                '.',  'e',    '\\',   'n', 'u'};
  static const char* const kTokens[] = {
      "null",
      "true",
      "0",
      "-0.0",
      "1.5",
      "1e400",
      "-1e-400",
      "9223372036854775807",
      "9223372036854775808",
      "-9223372036854775809",
      "18446744073709551616",
      "\"nan\"",
      "\"inf\"",
      "\"-inf\"",
      "\"nan:7ff0000000000001\"",
      "\"nan:7ff0000000000000\"",
      "\"nan:FFFFFFFFFFFFFFFF\"",
      "\"\"",
      "\"\\ud800\"",
      "\"\\u0000\"",
      "\"\xff\"",
      "[]",
      "{}",
      "{\"int\": 1}",
      "{\"float\": \"nan\"}",
      "{\"tensor\": \"optim.0.exp_avg\"}",
      "{\"tensor\": \"state.a.weight.exp_avg\"}",
      "{\"str_bytes\": \"ff\"}",
      "{\"none\": null}",
      "{\"floats\": [1, \"nan\"]}",
      "{\"key\": 1, \"values\": {}}",
      "\"key\"",
      "\"values\"",
      "\"extra\"",
      "\"format\"",
  };
  auto token_boundary = [&]() {
    // A position just after one of  : , [ {  (where a value starts).
    std::vector<size_t> at;
    for (size_t i = 0; i < bytes.size(); ++i) {
      const char c = bytes[i];
      if (c == ':' || c == ',' || c == '[' || c == '{') at.push_back(i + 1);
    }
    return at.empty() ? below(bytes.size() + 1) : at[below(at.size())];
  };
  switch (random() % 9) {
    case 0:  // flip a bit
      if (!bytes.empty()) bytes[below(bytes.size())] ^= 1 << below(8);
      break;
    case 1:  // an interesting byte
      if (!bytes.empty())
        bytes[below(bytes.size())] = kBytes[below(sizeof kBytes)];
      break;
    case 2:  // truncate
      bytes.resize(below(bytes.size() + 1));
      break;
    case 3: {  // delete a piece
      const size_t from = below(bytes.size() + 1);
      bytes.erase(from, below(17));
      break;
    }
    case 4: {  // duplicate a piece somewhere
      if (bytes.empty()) break;
      const size_t from = below(bytes.size());
      const size_t len = below(std::min<size_t>(32, bytes.size() - from) + 1);
      bytes.insert(below(bytes.size() + 1), bytes.substr(from, len));
      break;
    }
    case 5: {  // replace the value starting at a boundary by a token
      const size_t at = token_boundary();
      size_t end = at;
      while (end < bytes.size() && bytes[end] != ',' && bytes[end] != '}' &&
             bytes[end] != ']') {
        ++end;
      }
      const char* token = kTokens[below(sizeof kTokens / sizeof kTokens[0])];
      bytes.replace(at, end - at, token);
      break;
    }
    case 6: {  // insert a token at a boundary
      const char* token = kTokens[below(sizeof kTokens / sizeof kTokens[0])];
      bytes.insert(token_boundary(), absl::StrCat(token, ","));
      break;
    }
    case 7: {  // wrap a value in nesting
      const size_t at = token_boundary();
      const int depth = 1 + static_cast<int>(below(64));
      bytes.insert(at, std::string(depth, '['));
      size_t end = at + depth;
      while (end < bytes.size() && bytes[end] != ',' && bytes[end] != '}') {
        ++end;
      }
      bytes.insert(end, std::string(depth, ']'));
      break;
    }
    case 8: {  // splice with another seed
      const std::string& other = seeds[below(seeds.size())].bytes;
      bytes = bytes.substr(0, below(bytes.size() + 1)) +
              other.substr(below(other.size() + 1));
      break;
    }
  }
}

TEST(OptimSidecarFuzzTest, DeterministicMutationsNeverCrash) {
  std::vector<Seed> seeds = AllSeeds();
  for (Seed& s : CheckedInSeeds()) seeds.push_back(std::move(s));
  ASSERT_FALSE(seeds.empty());
  std::vector<const Seed*> valid;
  for (const Seed& s : seeds) {
    if (absl::StartsWith(s.name, "valid_")) valid.push_back(&s);
  }
  std::mt19937_64 random(20240611);
  int accepted = 0;
  const OptimSidecarFuzzStats before = GetOptimSidecarFuzzStats();
  for (int i = 0; i < kMutations; ++i) {
    // Mostly valid seeds: edits of them reach deeper than edits of broken
    // ones.
    std::string bytes = random() % 4 != 0
                            ? valid[random() % valid.size()]->bytes
                            : seeds[random() % seeds.size()].bytes;
    // Mostly one edit: JSON rarely survives more.
    const int edits = random() % 4 == 0 ? 2 : 1;
    for (int e = 0; e < edits; ++e) Mutate(random, seeds, bytes);
    ASSERT_EQ(RunTarget(bytes), 0);
    accepted += Parse(bytes).ok();
  }
  // Both paths of the target ran, into both readers.
  EXPECT_GT(accepted, kMutations / 50);
  EXPECT_LT(accepted, kMutations);
  const OptimSidecarFuzzStats& after = GetOptimSidecarFuzzStats();
  EXPECT_GT(after.rank_read - before.rank_read, 0);
  EXPECT_GT(after.full_read - before.full_read, 0);
  std::printf(
      "%d of %d mutants parsed; ReadRankState accepted %lld, "
      "ReadFullState %lld\n",
      accepted, kMutations,
      static_cast<long long>(after.rank_read - before.rank_read),
      static_cast<long long>(after.full_read - before.full_read));
}

}  // namespace
}  // namespace checkpoint
}  // namespace flatparam
