#include "flatparam/optim/optim_state.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "flatparam/base/dtype.h"
#include "flatparam/base/status_matchers.h"
#include "flatparam/flatten.h"
#include "flatparam/model_layout.h"

namespace flatparam {
namespace optim {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Optional;

HostTensor F32(std::vector<int64_t> shape, std::vector<float> values) {
  HostTensor t(DType::kFloat32, std::move(shape));
  for (size_t i = 0; i < values.size(); ++i) t.data_as<float>()[i] = values[i];
  return t;
}

TEST(OptimStateValueTest, Classification) {
  EXPECT_TRUE(IsPosDimTensor(F32({2}, {1, 2})));
  EXPECT_TRUE(IsPosDimTensor(HostTensor(DType::kFloat32, {3, 0})));
  EXPECT_TRUE(IsZeroDimTensor(ScalarTensor(DType::kFloat32, 1)));
  EXPECT_FALSE(IsTensor(OptimStateValue(1.0)));
  EXPECT_STREQ(ValueTypeName(std::monostate()), "NoneType");
  EXPECT_STREQ(ValueTypeName(int64_t{1}), "int");
  EXPECT_STREQ(ValueTypeName(true), "bool");
  EXPECT_STREQ(ValueTypeName(std::string("x")), "str");
}

TEST(OptimStateValueTest, DescribeValueIsPythonLike) {
  EXPECT_EQ(DescribeValue(F32({3, 5}, {})), "tensor(float32, [3, 5])");
  EXPECT_EQ(DescribeValue(ScalarTensor(DType::kFloat32, 3)),
            "tensor(3.0, dtype=float32)");
  EXPECT_EQ(DescribeValue(ScalarTensor(DType::kInt64, 7)),
            "tensor(7, dtype=int64)");
  EXPECT_EQ(DescribeValue(ScalarTensor(DType::kBool, 1)),
            "tensor(True, dtype=bool)");
  EXPECT_EQ(DescribeValue(0.9), "0.9");
  EXPECT_EQ(DescribeValue(2.0), "2.0");
  EXPECT_EQ(DescribeValue(int64_t{-4}), "-4");
  EXPECT_EQ(DescribeValue(false), "False");
  EXPECT_EQ(DescribeValue(std::string("adam")), "'adam'");
  EXPECT_EQ(DescribeValue(std::monostate()), "None");
  EXPECT_EQ(DescribeKey(ParamKey(int64_t{3})), "3");
  EXPECT_EQ(DescribeKey(ParamKey("fc.weight")), "'fc.weight'");
}

TEST(OptimStateValueTest, ScalarTensorOfEveryDtype) {
  EXPECT_EQ(*ScalarTensor(DType::kInt64, 12).data_as<int64_t>(), 12);
  EXPECT_EQ(*ScalarTensor(DType::kInt32, -3).data_as<int32_t>(), -3);
  EXPECT_EQ(*ScalarTensor(DType::kBool, 2).data_as<uint8_t>(), 1);
  EXPECT_EQ(ScalarTensor(DType::kBFloat16, 1.5).GetDouble(0), 1.5);
  EXPECT_TRUE(ScalarTensor(DType::kFloat64, 1).shape().empty());
}

TEST(OptimStateDictTest, EqualityIsBitwise) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  EXPECT_TRUE(BitwiseEqual(OptimStateValue(nan), OptimStateValue(nan)));
  EXPECT_FALSE(BitwiseEqual(OptimStateValue(0.0), OptimStateValue(-0.0)));
  EXPECT_FALSE(BitwiseEqual(OptimStateValue(int64_t{1}), OptimStateValue(1.0)));
  EXPECT_FALSE(
      BitwiseEqual(OptimStateValue(true), OptimStateValue(int64_t{1})));
  HostTensor a = F32({2}, {1, std::nanf("")});
  HostTensor b = a;
  EXPECT_TRUE(BitwiseEqual(a, b));
  b.data_as<uint8_t>()[0] ^= 1;
  EXPECT_FALSE(BitwiseEqual(a, b));
  EXPECT_FALSE(BitwiseEqual(F32({2}, {1, 2}), F32({1, 2}, {1, 2})));
  EXPECT_TRUE(BitwiseEqual(HyperValue(std::vector<double>{0.9, nan}),
                           HyperValue(std::vector<double>{0.9, nan})));
  EXPECT_FALSE(BitwiseEqual(HyperValue(std::vector<double>{0.9}),
                            HyperValue(std::vector<double>{0.9, 0.999})));
}

TEST(OptimStateDictTest, FirstDifferenceSaysWhere) {
  OptimStateDict a;
  a.state["w"]["exp_avg"] = F32({3}, {1, 2, 3});
  a.state["w"]["step"] = ScalarTensor(DType::kFloat32, 1);
  a.param_groups.push_back({{{"lr", 0.1}}, {ParamKey("w")}});
  OptimStateDict b = a;
  EXPECT_EQ(FirstDifference(a, b), std::nullopt);
  EXPECT_EQ(a, b);
  std::get<HostTensor>(b.state["w"]["exp_avg"]).data_as<float>()[2] = 4;
  EXPECT_THAT(FirstDifference(a, b),
              Optional(std::string("state['w']['exp_avg']: tensor(float32, "
                                   "[3]) differs at element 2: 3.0 vs 4.0")));
  EXPECT_NE(a, b);
  b = a;
  b.state[ParamKey(int64_t{0})];
  EXPECT_THAT(FirstDifference(a, b),
              Optional(std::string("state[0]: only in the second dict")));
  b = a;
  b.param_groups[0].hyperparams["lr"] = 0.2;
  EXPECT_THAT(FirstDifference(a, b),
              Optional(std::string("param_groups[0]['lr']: 0.1 vs 0.2")));
  b = a;
  b.param_groups[0].params.push_back(ParamKey(int64_t{1}));
  EXPECT_THAT(FirstDifference(a, b),
              Optional(std::string("param_groups[0].params: ['w'] vs ['w', "
                                   "1]")));
}

TEST(OptimStateDictTest, DebugStringAndBytes) {
  OptimStateDict d;
  d.state["w"]["exp_avg"] = F32({6}, {1, 2, 3, 4, 5, 6});
  d.state["w"]["step"] = ScalarTensor(DType::kFloat32, 1);
  d.param_groups.push_back(
      {{{"betas", std::vector<double>{0.9, 0.999}}}, {ParamKey("w")}});
  const std::string s = DebugString(d, 2);
  EXPECT_THAT(s,
              HasSubstr("'exp_avg': tensor(float32, [6]) = [1.0, 2.0, ...]"));
  EXPECT_THAT(s, HasSubstr("'betas': (0.9, 0.999), 'params': ['w']"));
  EXPECT_EQ(TensorBytes(d), 6 * 4 + 4);
}

ModelLayout TiedModel() {
  ModelSpec spec;
  spec.params = {{"emb", {4, 2}},
                 {"h.w", {2, 2}},
                 {"out", {4, 2}, DType::kFloat32, true, "emb"}};
  auto layout = ModelLayout::Create(spec, {.world_size = 2});
  EXPECT_TRUE(layout.ok());
  return *layout;
}

TEST(RekeyTest, BothWaysIsTheIdentity) {
  const ModelLayout layout = TiedModel();
  EXPECT_THAT(ModelParamOrder(layout), ElementsAre("emb", "h.w"));
  OptimStateDict by_name;
  by_name.state["h.w"]["step"] = 1.0;
  by_name.state["emb"]["step"] = 2.0;
  by_name.state["user"]["x"] = int64_t{3};
  by_name.param_groups.push_back({{}, {ParamKey("h.w"), ParamKey("emb")}});
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      OptimStateDict by_id,
      RekeyOptimStateDict(by_name, OptimStateKeyType::kParamId, layout));
  EXPECT_TRUE(BitwiseEqual(by_id.state.at(ParamKey(int64_t{1})).at("step"),
                           OptimStateValue(1.0)));
  EXPECT_TRUE(by_id.state.count(ParamKey("user")));
  EXPECT_THAT(by_id.param_groups[0].params,
              ElementsAre(ParamKey(int64_t{1}), ParamKey(int64_t{0})));
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      OptimStateDict back,
      RekeyOptimStateDict(by_id, OptimStateKeyType::kParamName, layout));
  EXPECT_EQ(FirstDifference(back, by_name), std::nullopt);
  // Already keyed as asked: unchanged.
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      OptimStateDict same,
      RekeyOptimStateDict(by_name, OptimStateKeyType::kParamName, layout));
  EXPECT_EQ(same, by_name);
}

TEST(RekeyTest, Errors) {
  const std::vector<std::string> order = {"a", "b"};
  OptimStateDict d;
  d.state[ParamKey(int64_t{2})]["step"] = 1.0;
  EXPECT_THAT(RekeyOptimStateDict(d, OptimStateKeyType::kParamName, order),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("state key 2 has parameter ID 2, but the "
                                 "optimizer has 2 parameters")));
  d = OptimStateDict();
  d.param_groups.push_back({{}, {ParamKey(int64_t{-1})}});
  EXPECT_THAT(RekeyOptimStateDict(d, OptimStateKeyType::kParamName, order),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("param_groups[0] has parameter ID -1")));
  d = OptimStateDict();
  d.state[ParamKey(int64_t{0})]["step"] = 1.0;
  d.state[ParamKey("a")]["step"] = 1.0;
  EXPECT_THAT(
      RekeyOptimStateDict(d, OptimStateKeyType::kParamName, order),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("becomes 'a'")));
  const std::vector<std::string> dup = {"a", "a"};
  EXPECT_THAT(RekeyOptimStateDict(d, OptimStateKeyType::kParamId, dup),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("names 'a' twice")));
}

}  // namespace
}  // namespace optim
}  // namespace flatparam
