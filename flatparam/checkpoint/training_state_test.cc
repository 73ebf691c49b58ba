#include "flatparam/checkpoint/training_state.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "flatparam/base/dtype.h"
#include "flatparam/base/status_matchers.h"
#include "flatparam/checkpoint/checkpoint_dir.h"
#include "flatparam/checkpoint/file_system.h"
#include "flatparam/checkpoint/internal/checkpoint_testutil.h"
#include "flatparam/flatten.h"
#include "flatparam/layout.h"
#include "flatparam/optim/optim_state.h"

namespace flatparam {
namespace checkpoint {
namespace {

using ::testing::HasSubstr;
using json = nlohmann::json;
using optim::OptimStateDict;
using optim::ParamKey;

constexpr absl::StatusCode kDataLoss = absl::StatusCode::kDataLoss;
constexpr absl::StatusCode kInvalid = absl::StatusCode::kInvalidArgument;

ModelLayout Layout(int64_t world_size, bool align) {
  return MakeTestLayout(
      TinyModelSpec(),
      TestLayoutOptions(world_size, ShardingStrategy::kFullShard, align));
}

// A tensor of `dtype` and `shape` whose bytes are a deterministic pattern
// (NaNs and all).
HostTensor Pattern(DType dtype, std::vector<int64_t> shape, int seed) {
  HostTensor t(dtype, std::move(shape));
  auto* p = static_cast<unsigned char*>(t.data());
  for (size_t i = 0; i < t.nbytes(); ++i) {
    p[i] = static_cast<unsigned char>(i * 131 + seed * 17 + 7);
  }
  return t;
}

double FromBits(uint64_t bits) {
  double d;
  std::memcpy(&d, &bits, sizeof(d));
  return d;
}

// Every kind of value the schema has to preserve.
optim::ParamState Scalars() {
  optim::ParamState s;
  s["i"] = int64_t{-7};
  s["big"] = std::numeric_limits<int64_t>::min();
  s["f"] = 0.1;
  s["f_int"] = 3.0;
  s["negzero"] = -0.0;
  s["inf"] = std::numeric_limits<double>::infinity();
  s["ninf"] = -std::numeric_limits<double>::infinity();
  s["nan"] = std::numeric_limits<double>::quiet_NaN();
  s["nan_payload"] = FromBits(0xfff0000000000123ULL);
  s["b"] = true;
  s["s"] = std::string("adam \"w\" \xc3\xa9");
  s["bytes"] = std::string("not utf-8: \xff\xfe", 13);
  s["none"] = std::monostate();
  return s;
}

std::vector<optim::ParamGroup> Groups(std::vector<ParamKey> params) {
  optim::ParamGroup g;
  g.params = std::move(params);
  g.hyperparams["lr"] = 1e-3;
  g.hyperparams["betas"] = std::vector<double>{0.9, 0.999};
  g.hyperparams["amsgrad"] = false;
  g.hyperparams["foreach"] = std::monostate();
  g.hyperparams["steps"] = int64_t{4};
  g.hyperparams["name"] = std::string("decay");
  optim::ParamGroup empty;
  return {g, empty};
}

RankState MakeRank(const ModelLayout& layout, int64_t rank) {
  RankState state;
  int seed = static_cast<int>(rank) * 10;
  for (const FlatParamLayout& f : layout.flat_params()) {
    state.flat_params.push_back(
        Pattern(f.dtype(), {f.sharded_numel()}, ++seed));
  }
  const int64_t n0 = layout.flat_params()[0].sharded_numel();
  optim::ParamState s0 = Scalars();
  s0["exp_avg"] = Pattern(DType::kFloat32, {n0}, ++seed);
  s0["exp.avg.sq"] = Pattern(DType::kBFloat16, {n0}, ++seed);
  s0["step"] = optim::ScalarTensor(DType::kFloat32, 5);
  s0["istep"] = optim::ScalarTensor(DType::kInt64, 5);
  state.optim.state[ParamKey(int64_t{0})] = std::move(s0);
  state.optim.state[ParamKey(int64_t{1})] = {};
  state.optim.state[ParamKey(std::string("ignored.weight"))] = Scalars();
  state.optim.param_groups = Groups({ParamKey(int64_t{0}), ParamKey(int64_t{1}),
                                     ParamKey(std::string("ignored.weight"))});
  state.extra = json{{"step", 12}, {"options", {{"lr", 0.5}}}};
  return state;
}

absl::Status WriteRanks(FileSystem& fs, const std::string& dir,
                        const ModelLayout& layout,
                        const std::vector<RankState>& states) {
  ShardedCheckpointContent content;
  content.layout = &layout;
  for (size_t r = 0; r < states.size(); ++r) {
    absl::StatusOr<RankContent> c = MakeRankContent(layout, r, states[r]);
    if (!c.ok()) return c.status();
    content.ranks.push_back(*std::move(c));
  }
  return WriteShardedCheckpoint(fs, dir, content);
}

void ExpectSameRank(const RankState& a, const RankState& b) {
  ASSERT_EQ(a.flat_params.size(), b.flat_params.size());
  for (size_t i = 0; i < a.flat_params.size(); ++i) {
    EXPECT_TRUE(a.flat_params[i] == b.flat_params[i]) << "flat_params " << i;
  }
  EXPECT_EQ(optim::FirstDifference(a.optim, b.optim), std::nullopt);
  EXPECT_TRUE(a.optim == b.optim);
  EXPECT_EQ(a.extra, b.extra);
}

class OptimIoTest : public ::testing::TestWithParam<std::tuple<int, bool>> {};

TEST_P(OptimIoTest, RankStateRoundTripsBitForBit) {
  const auto [world, align] = GetParam();
  const ModelLayout layout = Layout(world, align);
  FaultInjectionFileSystem fs;
  std::vector<RankState> states;
  for (int r = 0; r < world; ++r) states.push_back(MakeRank(layout, r));
  FLATPARAM_ASSERT_OK(WriteRanks(fs, "/ckpt", layout, states));
  FLATPARAM_ASSERT_OK_AND_ASSIGN(ShardedCheckpointReader reader,
                                 ShardedCheckpointReader::Open(fs, "/ckpt"));
  for (int r = 0; r < world; ++r) {
    FLATPARAM_ASSERT_OK_AND_ASSIGN(RankState back, ReadRankState(reader, r));
    ExpectSameRank(states[r], back);
  }
}

INSTANTIATE_TEST_SUITE_P(Worlds, OptimIoTest,
                         ::testing::Combine(::testing::Values(1, 2, 3),
                                            ::testing::Bool()));

TEST(OptimIoTest, ScalarsKeepTheirTypeAndBits) {
  // Bitwise equality of the dicts already checks this; spell out the
  // cases that a lossy encoding would get wrong.
  const ModelLayout layout = Layout(1, false);
  FaultInjectionFileSystem fs;
  FLATPARAM_ASSERT_OK(WriteRanks(fs, "/ckpt", layout, {MakeRank(layout, 0)}));
  FLATPARAM_ASSERT_OK_AND_ASSIGN(ShardedCheckpointReader reader,
                                 ShardedCheckpointReader::Open(fs, "/ckpt"));
  FLATPARAM_ASSERT_OK_AND_ASSIGN(RankState back, ReadRankState(reader, 0));
  const optim::ParamState& s = back.optim.state.at(ParamKey(int64_t{0}));
  EXPECT_TRUE(std::holds_alternative<double>(s.at("f_int")));
  EXPECT_TRUE(std::signbit(std::get<double>(s.at("negzero"))));
  uint64_t bits;
  const double payload = std::get<double>(s.at("nan_payload"));
  std::memcpy(&bits, &payload, sizeof(bits));
  EXPECT_EQ(bits, 0xfff0000000000123ULL);
  EXPECT_TRUE(std::holds_alternative<std::monostate>(s.at("none")));
  EXPECT_TRUE(std::holds_alternative<bool>(s.at("b")));
  EXPECT_EQ(std::get<HostTensor>(s.at("istep")).dtype(), DType::kInt64);
  // The sidecar on disk follows the documented schema.
  FLATPARAM_ASSERT_OK_AND_ASSIGN(json doc, reader.ReadRankJson(0));
  EXPECT_EQ(doc["format"], kOptimSidecarFormat);
  EXPECT_EQ(doc["state"][0]["key"], 0);
  EXPECT_EQ(doc["state"][0]["values"]["inf"], json({{"float", "inf"}}));
  EXPECT_EQ(doc["state"][0]["values"]["nan"], json({{"float", "nan"}}));
  EXPECT_EQ(doc["state"][0]["values"]["nan_payload"],
            json({{"float", "nan:fff0000000000123"}}));
  EXPECT_EQ(doc["state"][0]["values"]["exp_avg"],
            json({{"tensor", "optim.0.exp_avg"}}));
  EXPECT_EQ(doc["param_groups"][0]["hyperparams"]["betas"],
            json({{"floats", {0.9, 0.999}}}));
  EXPECT_EQ(doc["state"][0]["values"]["bytes"],
            json({{"str_bytes", "6e6f74207574662d383a20fffe"}}));
  EXPECT_EQ(doc["extra"]["step"], 12);
}

TEST(OptimIoTest, FullStateRoundTripsBitForBit) {
  FullState state;
  state.params["emb.weight"] = Pattern(DType::kFloat32, {5, 3}, 1);
  state.params["seq.0.bias"] = Pattern(DType::kBFloat16, {4}, 2);
  state.params["norm.scale"] = Pattern(DType::kFloat16, {}, 3);
  optim::ParamState s = Scalars();
  s["exp_avg"] = Pattern(DType::kFloat32, {5, 3}, 4);
  s["step"] = optim::ScalarTensor(DType::kFloat32, 2);
  state.optim.state[ParamKey(std::string("emb.weight"))] = s;
  // A dotted state name on a dotted key: the sidecar, not the tensor name,
  // says where the FQN ends.
  state.optim.state[ParamKey(std::string("seq.0"))]["bias.exp_avg"] =
      Pattern(DType::kFloat32, {4}, 5);
  state.optim.state[ParamKey(std::string("__user__"))]["count"] = int64_t{3};
  state.optim.state[ParamKey(std::string("norm.scale"))] = {};
  state.optim.param_groups = Groups({ParamKey(std::string("emb.weight"))});
  FLATPARAM_ASSERT_OK_AND_ASSIGN(FullCheckpointContent content,
                                 MakeFullContent(state));
  FaultInjectionFileSystem fs;
  FLATPARAM_ASSERT_OK(WriteFullCheckpoint(fs, "/full", content));
  FLATPARAM_ASSERT_OK_AND_ASSIGN(FullCheckpointReader reader,
                                 FullCheckpointReader::Open(fs, "/full"));
  FLATPARAM_ASSERT_OK_AND_ASSIGN(FullState back, ReadFullState(reader));
  EXPECT_TRUE(back.params == state.params);
  EXPECT_EQ(optim::FirstDifference(back.optim, state.optim), std::nullopt);
}

TEST(OptimIoTest, MakeRankContentRejectsWhatTheFormatCannotHold) {
  const ModelLayout layout = Layout(2, false);
  {
    RankState s = MakeRank(layout, 0);
    s.optim.state[ParamKey(std::string("ignored.weight"))]["m"] =
        Pattern(DType::kFloat32, {3}, 1);
    EXPECT_THAT(MakeRankContent(layout, 0, s),
                StatusIs(kInvalid, HasSubstr("'ignored.weight' 'm' is a "
                                             "tensor")));
  }
  {
    RankState s = MakeRank(layout, 0);
    s.optim.state[ParamKey(int64_t{0})]["exp_avg"] =
        Pattern(DType::kFloat32, {2, 2}, 1);
    EXPECT_THAT(MakeRankContent(layout, 0, s),
                StatusIs(kInvalid, HasSubstr("state 0 'exp_avg'")));
  }
  {
    RankState s = MakeRank(layout, 0);
    s.optim.state[ParamKey(int64_t{2})]["m"] = int64_t{1};
    EXPECT_THAT(MakeRankContent(layout, 0, s),
                StatusIs(kInvalid, HasSubstr("key 2 is not a flat-parameter "
                                             "index in [0, 2)")));
  }
  {
    RankState s = MakeRank(layout, 0);
    s.flat_params[1] = HostTensor::Flat(DType::kFloat32, 1);
    EXPECT_THAT(MakeRankContent(layout, 0, s),
                StatusIs(kInvalid, HasSubstr("flat_params[1] is float32 [1]")));
    s.flat_params.pop_back();
    EXPECT_THAT(MakeRankContent(layout, 0, s),
                StatusIs(kInvalid, HasSubstr("1 flat parameter shards")));
  }
  {
    RankState s = MakeRank(layout, 0);
    EXPECT_THAT(MakeRankContent(layout, 2, s),
                StatusIs(kInvalid, HasSubstr("rank 2 is not in [0, 2)")));
    s.extra = json::array();
    EXPECT_THAT(MakeRankContent(layout, 0, s),
                StatusIs(kInvalid, HasSubstr("extra must be a JSON object")));
  }
  {
    RankState s = MakeRank(layout, 0);
    s.optim.state[ParamKey(int64_t{0})]["bad\xff"] = int64_t{1};
    EXPECT_THAT(MakeRankContent(layout, 0, s), StatusIs(kInvalid));
  }
}

TEST(OptimIoTest, MakeFullContentRejectsIdsAndCollisions) {
  FullState state;
  state.optim.state[ParamKey(int64_t{0})]["m"] = int64_t{1};
  EXPECT_THAT(MakeFullContent(state),
              StatusIs(kInvalid, HasSubstr("is a parameter ID")));
  state.optim.state.clear();
  state.optim.state[ParamKey(std::string("a.b"))]["c"] =
      Pattern(DType::kFloat32, {1}, 1);
  state.optim.state[ParamKey(std::string("a"))]["b.c"] =
      Pattern(DType::kFloat32, {1}, 2);
  EXPECT_THAT(MakeFullContent(state),
              StatusIs(kInvalid, HasSubstr("'state.a.b.c'")));
}

// A sharded checkpoint whose rank 0 sidecar is `sidecar` (valid tensors).
absl::Status WriteWithSidecar(FileSystem& fs, const ModelLayout& layout,
                              const RankState& state, json sidecar) {
  absl::StatusOr<RankContent> c = MakeRankContent(layout, 0, state);
  if (!c.ok()) return c.status();
  c->sidecar = std::move(sidecar);
  ShardedCheckpointContent content;
  content.layout = &layout;
  content.ranks.push_back(*std::move(c));
  return WriteShardedCheckpoint(fs, "/bad", content);
}

TEST(OptimIoTest, ReadRankStateRejectsMalformedSidecars) {
  const ModelLayout layout = Layout(1, false);
  const RankState state = MakeRank(layout, 0);
  FLATPARAM_ASSERT_OK_AND_ASSIGN(RankContent good,
                                 MakeRankContent(layout, 0, state));
  struct Case {
    std::string name;
    std::function<void(json&)> mutate;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"format", [](json& d) { d["format"] = "v0"; }, "format: expected"},
      {"member", [](json& d) { d["bogus"] = 1; }, "bogus: unexpected member"},
      {"float",
       [](json& d) {
         d["state"][0]["values"]["f"] = {{"float", "nan:zz"}};
       },
       "state[0].values.f.float: expected a float"},
      {"tag",
       [](json& d) {
         d["state"][0]["values"]["f"] = {{"complex", 1}};
       },
       "unknown value type \"complex\""},
      {"unlisted", [](json& d) { d["state"][0]["values"].erase("exp_avg"); },
       "tensor 'optim.0.exp_avg' is not listed"},
      {"renamed",
       [](json& d) {
         d["state"][0]["values"]["exp_avg"] = {{"tensor", "optim.0.step"}};
       },
       "names tensor 'optim.0.step', expected 'optim.0.exp_avg'"},
      {"missing tensor",
       [](json& d) {
         d["state"][0]["values"]["x"] = {{"tensor", "optim.0.x"}};
       },
       "tensor 'optim.0.x' is not in"},
      {"string key tensor",
       [](json& d) {
         d["state"][2]["values"]["x"] = {{"tensor", "optim.0.x"}};
       },
       "a tensor state needs a flat-parameter index key"},
      {"duplicate key", [](json& d) { d["state"][1]["key"] = 0; },
       "duplicate key 0"},
      {"key type", [](json& d) { d["state"][0]["key"] = 1.5; },
       "state[0].key: expected an integer or string key"},
      {"groups",
       [](json& d) { d["param_groups"][0]["hyperparams"]["lr"] = 0.1; },
       "param_groups[0].hyperparams.lr: expected an object"},
      {"extra", [](json& d) { d["extra"] = 3; }, "extra: not a JSON object"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    json doc = good.sidecar;
    c.mutate(doc);
    FaultInjectionFileSystem fs;
    FLATPARAM_ASSERT_OK(WriteWithSidecar(fs, layout, state, doc));
    FLATPARAM_ASSERT_OK_AND_ASSIGN(ShardedCheckpointReader reader,
                                   ShardedCheckpointReader::Open(fs, "/bad"));
    EXPECT_THAT(ReadRankState(reader, 0),
                StatusIs(kDataLoss, HasSubstr(c.message)));
  }
}

}  // namespace
}  // namespace checkpoint
}  // namespace flatparam
