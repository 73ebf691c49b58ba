// Tests of the private helpers: FlattenRange / UnflattenRange against
// flatparam/flatten.h (an independent implementation of the same layout),
// the metadata encoding's exactness and its rejection of bad input, and
// the groups of flat_plan.h (its flattening rules are fsdp_optim_test's and
// convert_test's).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "flatparam/base/dtype.h"
#include "flatparam/base/status_matchers.h"
#include "flatparam/flatten.h"
#include "flatparam/layout.h"
#include "flatparam/model_layout.h"
#include "flatparam/optim/internal/flat_plan.h"
#include "flatparam/optim/internal/flat_range.h"
#include "flatparam/optim/internal/state_meta.h"
#include "flatparam/optim/optim_state.h"

namespace flatparam {
namespace optim {
namespace internal_optim {
namespace {

struct LayoutCase {
  std::vector<ParamSpec> params;
  LayoutOptions options;
};

std::vector<LayoutCase> Cases() {
  std::vector<ParamSpec> p = {{"a", {3, 3}, DType::kBFloat16},
                              {"z", {0}, DType::kBFloat16},
                              {"b", {5}, DType::kBFloat16},
                              {"s", {}, DType::kBFloat16},
                              {"c", {2, 7}, DType::kBFloat16}};
  std::vector<LayoutCase> cases;
  for (int64_t w : {1, 2, 3, 4, 7, 64}) {
    for (bool align : {false, true}) {
      cases.push_back({p, {.world_size = w, .align_addresses = align}});
    }
  }
  cases.push_back(
      {p, {.world_size = 3, .strategy = ShardingStrategy::kNoShard}});
  return cases;
}

TEST(FlatRangeTest, AgreesWithFlattenAndUnflatten) {
  std::mt19937 rng(1);
  for (const LayoutCase& c : Cases()) {
    FLATPARAM_ASSERT_OK_AND_ASSIGN(
        FlatParamLayout layout,
        FlatParamLayout::Create("", c.params, c.options));
    std::vector<HostTensor> params;
    std::vector<ConstBufferRef> refs;
    std::vector<ConstWindow> windows;
    for (const ParamInfo& p : layout.params()) {
      params.emplace_back(layout.dtype(), p.shape);
    }
    for (HostTensor& t : params) {
      for (int64_t i = 0; i < t.numel(); ++i) t.SetDouble(i, rng() % 100);
      refs.push_back(t.cref());
      windows.push_back({t.data(), 0, t.numel()});
    }
    // The whole padded flat parameter, any range of it.
    HostTensor want =
        HostTensor::Flat(layout.dtype(), layout.padded_unsharded_numel());
    {
      HostTensor unpadded =
          HostTensor::Flat(layout.dtype(), layout.unpadded_unsharded_numel());
      ASSERT_THAT(Flatten(layout, refs, unpadded.ref()), IsOk());
      std::memcpy(want.data(), unpadded.data(), unpadded.nbytes());
    }
    const int64_t n = want.numel();
    const size_t size = DTypeSize(layout.dtype());
    for (int64_t begin = 0; begin <= n; begin += 3) {
      for (int64_t count : {int64_t{1}, int64_t{5}, n - begin}) {
        if (count <= 0 || begin + count > n) continue;
        HostTensor got = HostTensor::Flat(layout.dtype(), count);
        FlattenRange(layout, layout.dtype(), windows, begin, count,
                     kFlatParamPaddingValue, got.data());
        ASSERT_EQ(
            std::memcmp(got.data(),
                        static_cast<const char*>(want.data()) + begin * size,
                        count * size),
            0)
            << "begin " << begin << " count " << count;
      }
    }
    // Each rank's shard, and unflattening the shards back.
    std::vector<HostTensor> back;
    std::vector<Window> out;
    for (const ParamInfo& p : layout.params()) {
      back.emplace_back(layout.dtype(), p.shape);
    }
    for (HostTensor& t : back) out.push_back({t.data(), 0, t.numel()});
    const int64_t shards =
        UsesShardedStrategy(c.options.strategy) ? c.options.world_size : 1;
    for (int64_t r = 0; r < shards; ++r) {
      const int64_t start = layout.shard_interval(r).start;
      HostTensor got = HostTensor::Flat(layout.dtype(), layout.sharded_numel());
      HostTensor shard =
          HostTensor::Flat(layout.dtype(), layout.sharded_numel());
      FlattenRange(layout, layout.dtype(), windows, start,
                   layout.sharded_numel(), kFlatParamPaddingValue, got.data());
      ASSERT_THAT(FlattenShard(layout, refs, r, shard.ref()), IsOk());
      ASSERT_EQ(got, shard) << "rank " << r;
      UnflattenRange(layout, size, got.data(), start, layout.sharded_numel(),
                     out);
    }
    for (size_t i = 0; i < params.size(); ++i) EXPECT_EQ(back[i], params[i]);
  }
}

TEST(FlatRangeTest, PartialWindowsAndMissingState) {
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      FlatParamLayout layout,
      FlatParamLayout::Create("", {{"a", {4}}, {"b", {3}}}, {.world_size = 1}));
  const float a_piece[2] = {7, 8};  // elements 1..2 of a
  std::vector<ConstWindow> windows = {{a_piece, 1, 3}, {}};
  float out[7];
  FlattenRange(layout, DType::kFloat32, windows, 0, 7, 42, out);
  EXPECT_THAT(out, ::testing::ElementsAre(0, 7, 8, 0, 0, 0, 0));
  float into[2] = {-1, -1};
  std::vector<Window> w = {{into, 2, 4}, {}};
  const float flat[7] = {1, 2, 3, 4, 5, 6, 7};
  UnflattenRange(layout, sizeof(float), flat + 3, 3, 4, w);
  EXPECT_THAT(into, ::testing::ElementsAre(-1, 4));
}

TEST(StateMetaTest, EncodingIsExact) {
  Encoder e;
  HostTensor t(DType::kFloat64, {2});
  t.data_as<double>()[0] = std::numeric_limits<double>::quiet_NaN();
  t.data_as<double>()[1] = -0.0;
  const std::vector<OptimStateValue> values = {std::monostate(),
                                               t,
                                               ScalarTensor(DType::kInt64, -5),
                                               int64_t{-7},
                                               -0.0,
                                               true,
                                               std::string("a\0b\xff", 4)};
  for (const OptimStateValue& v : values) e.Value(v, /*with_data=*/true);
  e.Value(t, /*with_data=*/false);
  ParamGroup g{{{"betas", std::vector<double>{0.9, 0.999}},
                {"foreach", std::monostate()},
                {"name", std::string("x")},
                {"n", int64_t{3}},
                {"amsgrad", false},
                {"lr", 1e-3}},
               {ParamKey(int64_t{4}), ParamKey("w")}};
  e.Group(g);
  const std::string bytes = e.Take();
  Decoder d(bytes);
  for (const OptimStateValue& v : values) {
    ValueMeta m;
    ASSERT_TRUE(d.Value(&m));
    EXPECT_TRUE(BitwiseEqual(m.Materialize(), v)) << DescribeValue(v);
  }
  ValueMeta meta;
  ASSERT_TRUE(d.Value(&meta));
  EXPECT_TRUE(meta.pos_dim);
  EXPECT_EQ(meta.data(), nullptr);
  EXPECT_EQ(meta.shape, std::vector<int64_t>{2});
  EXPECT_EQ(meta.Describe(), "tensor(float64, [2])");
  ParamGroup back;
  ASSERT_TRUE(d.Group(&back));
  EXPECT_EQ(back, g);
  EXPECT_TRUE(d.done());

  // Every truncation is rejected, never read past.
  for (size_t n = 0; n < bytes.size(); ++n) {
    Decoder t2(absl::string_view(bytes.data(), n));
    bool ok = true;
    for (size_t i = 0; i < values.size() + 1 && ok; ++i) {
      ValueMeta m;
      ok = t2.Value(&m);
    }
    ParamGroup gg;
    ok = ok && t2.Group(&gg);
    EXPECT_FALSE(ok) << "prefix of " << n << " bytes decoded";
  }
}

TEST(StateMetaTest, RejectsMalformedInput) {
  ValueMeta m;
  const std::string bad_tag("\x09", 1);
  EXPECT_FALSE(Decoder(bad_tag).Value(&m));
  Encoder e;
  e.U8(1);   // tensor metadata
  e.U8(99);  // no such dtype
  EXPECT_FALSE(Decoder(e.Take()).Value(&m));
  Encoder huge;
  huge.U8(2);  // tensor with data
  huge.U8(0);
  huge.I64(1);
  huge.I64(int64_t{1} << 40);  // far more data than present
  EXPECT_FALSE(Decoder(huge.Take()).Value(&m));
  Encoder neg;
  neg.Str("x");
  std::string s = neg.Take();
  s[7] = '\x80';  // negative length
  std::string out;
  EXPECT_FALSE(Decoder(s).Str(&out));
}

TEST(StateMetaTest, MetaOfPointsIntoTheDict) {
  ParamState st;
  st["exp_avg"] = HostTensor(DType::kFloat32, {3});
  st["step"] = ScalarTensor(DType::kFloat32, 2);
  ParamStateMeta meta = MetaOf(st);
  EXPECT_TRUE(meta.at("exp_avg").pos_dim);
  EXPECT_EQ(meta.at("exp_avg").data(), &std::get<HostTensor>(st["exp_avg"]));
  EXPECT_FALSE(meta.at("step").pos_dim);
  EXPECT_TRUE(BitwiseEqual(meta.at("step").Materialize(), st["step"]));
}

// Without use_orig_params a flat parameter's parameters in two groups
// (a bias without weight decay beside its weight) are refused: the flat
// parameter would be put in both groups and stepped twice. With it, each
// parameter keeps its own group.
TEST(FlatPlanTest, AFlatParameterSplitAcrossGroupsIsRefused) {
  ModelSpec spec;
  spec.params = {{"a.w", {4}}, {"a.b", {2}}, {"c.w", {3}}};
  spec.wrap = {"a"};
  FLATPARAM_ASSERT_OK_AND_ASSIGN(ModelLayout layout,
                                 ModelLayout::Create(spec, LayoutOptions()));
  const ModelIndex index(layout, {});
  ParamGroup decay;
  decay.params = {std::string("c.w"), std::string("a.w")};
  decay.hyperparams = {{"weight_decay", 0.1}};
  ParamGroup no_decay;
  no_decay.params = {std::string("a.b")};
  no_decay.hyperparams = {{"weight_decay", 0.0}};
  EXPECT_THAT(
      PlanGroups(index, {decay, no_decay}, false),
      StatusIs(absl::StatusCode::kInvalidArgument,
               ::testing::HasSubstr("param_groups[0] holds 'a.w' and "
                                    "param_groups[1] holds 'a.b', both of "
                                    "flat parameter \"a\"")));
  FLATPARAM_ASSERT_OK_AND_ASSIGN(std::vector<ParamGroup> orig,
                                 PlanGroups(index, {decay, no_decay}, true));
  EXPECT_EQ(orig[1].params, no_decay.params);
  // Units wholly in one group each are fine.
  no_decay.params = {std::string("c.w")};
  decay.params = {std::string("a.w"), std::string("a.b")};
  EXPECT_THAT(PlanGroups(index, {decay, no_decay}, false), IsOk());
}

// The flat path's groups: flat parameters sorted, then unmanaged
// parameters in unmanaged_params order (first occurrence), and back.
TEST(FlatPlanTest, GroupsKeepTheOptimizersOrderOfUnmanagedParams) {
  ModelSpec spec;
  spec.params = {{"a.w", {4}}, {"a.b", {2}}, {"c.w", {3}}};
  spec.wrap = {"a"};
  FLATPARAM_ASSERT_OK_AND_ASSIGN(ModelLayout layout,
                                 ModelLayout::Create(spec, LayoutOptions()));
  const ModelIndex index(layout, {"z", "a.w", "b", "z"});
  EXPECT_TRUE(index.Unmanaged(ParamKey(std::string("z"))));
  EXPECT_FALSE(index.Unmanaged(ParamKey(std::string("a.w"))));
  ASSERT_NE(index.Managed(ParamKey(std::string("a.b"))), nullptr);
  EXPECT_EQ(index.Managed(ParamKey(std::string("a.b")))->unit, 1);

  ParamGroup g;
  g.params = {std::string("b"),   std::string("a.b"), std::string("z"),
              std::string("c.w"), std::string("a.w"), std::string("b")};
  g.hyperparams = {{"lr", 0.5}};
  FLATPARAM_ASSERT_OK_AND_ASSIGN(std::vector<ParamGroup> flat,
                                 PlanGroups(index, {g}, false));
  ASSERT_EQ(flat.size(), 1u);
  EXPECT_EQ(flat[0].params,
            (std::vector<ParamKey>{int64_t{0}, int64_t{1}, std::string("z"),
                                   std::string("b")}));
  EXPECT_EQ(flat[0].hyperparams, g.hyperparams);
  FLATPARAM_ASSERT_OK_AND_ASSIGN(std::vector<ParamGroup> orig,
                                 PlanGroups(index, {g}, true));
  EXPECT_EQ(orig[0].params, g.params);
  FLATPARAM_ASSERT_OK_AND_ASSIGN(std::vector<ParamGroup> back,
                                 UnflattenGroups(index, flat, false));
  EXPECT_EQ(back[0].params,
            (std::vector<ParamKey>{std::string("c.w"), std::string("a.w"),
                                   std::string("a.b"), std::string("z"),
                                   std::string("b")}));

  g.params.push_back(std::string("y"));
  EXPECT_THAT(PlanGroups(index, {g}, false),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       ::testing::HasSubstr("param_groups[0] lists 'y'")));
  flat[0].params.push_back(int64_t{2});
  EXPECT_THAT(UnflattenGroups(index, flat, false),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       ::testing::HasSubstr("lists flat parameter 2, but the "
                                            "model has 2")));
}

}  // namespace
}  // namespace internal_optim
}  // namespace optim
}  // namespace flatparam
