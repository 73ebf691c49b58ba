#include "flatparam/flatten.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <vector>

#include "flatparam/base/copy.h"
#include "flatparam/base/status_matchers.h"

namespace flatparam {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::vector<double> Values(const HostTensor& t) {
  std::vector<double> v;
  for (int64_t i = 0; i < t.numel(); ++i) v.push_back(t.GetDouble(i));
  return v;
}

class FlattenTest : public ::testing::Test {
 protected:
  // a = [1 2 3], b = [10..14], c = 7; aligned float32 over 3 ranks gives
  // a | 42 | b | 42 42 42 | c | 42 42 (see layout_test.cc).
  void SetUp() override {
    std::vector<ParamSpec> specs = {{"a", {3}}, {"b", {5}}, {"c", {}}};
    LayoutOptions o;
    o.world_size = 3;
    o.align_addresses = true;
    layout_ = *FlatParamLayout::Create("", specs, o);
    params_ = {HostTensor(DType::kFloat32, {3}),
               HostTensor(DType::kFloat32, {5}),
               HostTensor(DType::kFloat32, {})};
    for (int i = 0; i < 3; ++i) params_[0].SetDouble(i, i + 1);
    for (int i = 0; i < 5; ++i) params_[1].SetDouble(i, 10 + i);
    params_[2].SetDouble(0, 7);
  }
  std::vector<ConstBufferRef> Refs() const {
    std::vector<ConstBufferRef> r;
    for (const HostTensor& t : params_) r.push_back(t.cref());
    return r;
  }

  std::optional<FlatParamLayout> layout_;
  std::vector<HostTensor> params_;
};

TEST_F(FlattenTest, FlattenWritesPaddingValue42) {
  HostTensor flat = HostTensor::Flat(DType::kFloat32, 15);
  FLATPARAM_ASSERT_OK(Flatten(*layout_, Refs(), flat.ref()));
  EXPECT_THAT(Values(flat), ElementsAre(1, 2, 3, 42, 10, 11, 12, 13, 14, 42, 42,
                                        42, 7, 42, 42));
}

TEST_F(FlattenTest, DeviceViewsAreRejected) {
  // One view type for every layer: the host functions reject device memory
  // instead of reading it.
  HostTensor flat = HostTensor::Flat(DType::kFloat32, 15);
  std::vector<ConstBufferRef> refs = Refs();
  refs[1].device = Device::Cuda(0);
  EXPECT_THAT(Flatten(*layout_, refs, flat.ref()),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("parameter \"b\" is on cuda:0")));
  BufferRef out = flat.ref();
  out.device = Device::Cuda(0);
  EXPECT_THAT(Flatten(*layout_, Refs(), out),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("is on cuda:0; flattening works on host")));
}

TEST_F(FlattenTest, ShardsMatchFlattenAndCopy) {
  HostTensor flat = HostTensor::Flat(DType::kFloat32, 15);
  FLATPARAM_ASSERT_OK(Flatten(*layout_, Refs(), flat.ref()));
  std::vector<HostTensor> shards;
  for (int r = 0; r < 3; ++r) {
    HostTensor a = HostTensor::Flat(DType::kFloat32, 5);
    HostTensor b = HostTensor::Flat(DType::kFloat32, 5);
    FLATPARAM_ASSERT_OK(CopyShard(*layout_, flat.cref(), r, a.ref()));
    FLATPARAM_ASSERT_OK(FlattenShard(*layout_, Refs(), r, b.ref()));
    EXPECT_EQ(a, b) << "rank " << r;
    shards.push_back(std::move(a));
  }
  EXPECT_THAT(Values(shards[1]), ElementsAre(11, 12, 13, 14, 42));
  std::vector<ConstBufferRef> refs;
  for (const HostTensor& s : shards) refs.push_back(s.cref());
  HostTensor gathered = HostTensor::Flat(DType::kFloat32, 15);
  FLATPARAM_ASSERT_OK(ConcatShards(*layout_, refs, gathered.ref()));
  EXPECT_EQ(gathered, flat);

  std::vector<HostTensor> out = {HostTensor(DType::kFloat32, {3}),
                                 HostTensor(DType::kFloat32, {5}),
                                 HostTensor(DType::kFloat32, {})};
  std::vector<BufferRef> out_refs;
  for (HostTensor& t : out) out_refs.push_back(t.ref());
  FLATPARAM_ASSERT_OK(Unflatten(*layout_, gathered.cref(), out_refs));
  EXPECT_EQ(out, params_);

  std::vector<HostTensor> pieces = {HostTensor(DType::kFloat32, {3}),
                                    HostTensor(DType::kFloat32, {5}),
                                    HostTensor(DType::kFloat32, {})};
  std::vector<BufferRef> piece_refs;
  for (HostTensor& t : pieces) piece_refs.push_back(t.ref());
  for (int r = 0; r < 3; ++r) {
    FLATPARAM_ASSERT_OK(
        UnflattenShard(*layout_, shards[r].cref(), r, piece_refs));
  }
  EXPECT_EQ(pieces, params_);
}

TEST_F(FlattenTest, ShardPaddingIsZero) {
  std::vector<ParamSpec> specs = {{"w", {7}, DType::kBFloat16}};
  LayoutOptions o;
  o.world_size = 4;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(FlatParamLayout l,
                                 FlatParamLayout::Create("", specs, o));
  HostTensor w(DType::kBFloat16, {7});
  for (int i = 0; i < 7; ++i) w.SetDouble(i, i + 1);
  HostTensor shard = HostTensor::Flat(DType::kBFloat16, 2);
  FLATPARAM_ASSERT_OK(FlattenShard(l, {w.cref()}, 3, shard.ref()));
  EXPECT_THAT(Values(shard), ElementsAre(7, 0));
}

TEST_F(FlattenTest, ViewsPointIntoTheBuffers) {
  HostTensor flat = HostTensor::Flat(DType::kFloat32, 15);
  FLATPARAM_ASSERT_OK(Flatten(*layout_, Refs(), flat.ref()));
  const ConstBufferRef b = ParamView(*layout_, flat.cref(), 1);
  EXPECT_EQ(b.count, 5);
  EXPECT_EQ(static_cast<const float*>(b.data)[0], 10.0f);
  HostTensor shard = HostTensor::Flat(DType::kFloat32, 5);
  FLATPARAM_ASSERT_OK(FlattenShard(*layout_, Refs(), 1, shard.ref()));
  const ConstBufferRef b1 = ShardView(*layout_, shard.cref(), 1, 1);
  EXPECT_EQ(b1.count, 4);
  EXPECT_EQ(static_cast<const float*>(b1.data)[0], 11.0f);
  EXPECT_EQ(ShardView(*layout_, shard.cref(), 1, 0).count, 0);
}

// Above kStreamingCopyThreshold the copies take the streaming path; the
// round trip must still be exact.
TEST(FlattenLargeTest, StreamingCopiesRoundTripExactly) {
  std::vector<ParamSpec> specs = {
      {"a", {4099}}, {"b", {9000001}}, {"c", {3}}, {"d", {8388617}}};
  LayoutOptions o;
  o.world_size = 3;
  o.align_addresses = true;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(FlatParamLayout l,
                                 FlatParamLayout::Create("", specs, o));
  ASSERT_GE(l.unpadded_unsharded_numel() * 4, kStreamingCopyThreshold);
  std::vector<HostTensor> params;
  std::vector<ConstBufferRef> refs;
  uint32_t next = 1;
  for (const ParamInfo& p : l.params()) {
    params.emplace_back(DType::kFloat32, p.shape);
    uint32_t* d = params.back().data_as<uint32_t>();
    for (int64_t i = 0; i < p.numel; ++i) d[i] = next++;
  }
  for (const HostTensor& t : params) refs.push_back(t.cref());
  HostTensor flat =
      HostTensor::Flat(DType::kFloat32, l.padded_unsharded_numel());
  FLATPARAM_ASSERT_OK(Flatten(l, refs, flat.ref()));
  std::vector<HostTensor> shards;
  std::vector<ConstBufferRef> shard_refs;
  for (int r = 0; r < 3; ++r) {
    shards.push_back(HostTensor::Flat(DType::kFloat32, l.sharded_numel()));
    HostTensor copy = HostTensor::Flat(DType::kFloat32, l.sharded_numel());
    FLATPARAM_ASSERT_OK(FlattenShard(l, refs, r, shards.back().ref()));
    FLATPARAM_ASSERT_OK(CopyShard(l, flat.cref(), r, copy.ref()));
    ASSERT_EQ(copy, shards.back()) << "rank " << r;
  }
  for (const HostTensor& t : shards) shard_refs.push_back(t.cref());
  HostTensor gathered =
      HostTensor::Flat(DType::kFloat32, l.padded_unsharded_numel());
  FLATPARAM_ASSERT_OK(ConcatShards(l, shard_refs, gathered.ref()));
  std::vector<HostTensor> out;
  std::vector<BufferRef> out_refs;
  for (const ParamInfo& p : l.params())
    out.emplace_back(DType::kFloat32, p.shape);
  for (HostTensor& t : out) out_refs.push_back(t.ref());
  FLATPARAM_ASSERT_OK(Unflatten(l, gathered.cref(), out_refs));
  EXPECT_TRUE(out == params);
}

TEST_F(FlattenTest, WrongBuffersAreErrors) {
  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  HostTensor flat = HostTensor::Flat(DType::kFloat32, 14);
  EXPECT_THAT(Flatten(*layout_, Refs(), flat.ref()),
              StatusIs(kInvalid, HasSubstr("must be 15 elements of float32, "
                                           "got 14 elements of float32")));
  std::vector<ConstBufferRef> refs = Refs();
  refs.pop_back();
  HostTensor ok = HostTensor::Flat(DType::kFloat32, 15);
  EXPECT_THAT(Flatten(*layout_, refs, ok.ref()),
              StatusIs(kInvalid, HasSubstr("expected 3 parameter buffers")));
  HostTensor wrong_dtype(DType::kFloat64, {5});
  refs = Refs();
  refs[1] = wrong_dtype.cref();
  EXPECT_THAT(Flatten(*layout_, refs, ok.ref()),
              StatusIs(kInvalid, HasSubstr("parameter \"b\"")));
  HostTensor shard = HostTensor::Flat(DType::kFloat32, 5);
  EXPECT_THAT(FlattenShard(*layout_, Refs(), 3, shard.ref()),
              StatusIs(kInvalid, HasSubstr("rank 3 is out of range")));
  EXPECT_THAT(ConcatShards(*layout_, {shard.cref()}, ok.ref()),
              StatusIs(kInvalid, HasSubstr("expected 3 shards, got 1")));
}

}  // namespace
}  // namespace flatparam
