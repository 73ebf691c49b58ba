#include "flatparam/device/device.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "flatparam/base/dtype.h"
#include "flatparam/base/status_matchers.h"

namespace flatparam {
namespace {

using ::testing::HasSubstr;

constexpr DType kFloatDTypes[] = {DType::kFloat32, DType::kFloat64,
                                  DType::kFloat16, DType::kBFloat16};

// A host buffer of doubles stored as `dtype`.
struct HostArray {
  HostArray(DType dtype, std::vector<double> values)
      : dtype(dtype), bytes(values.size() * DTypeSize(dtype)) {
    for (size_t i = 0; i < values.size(); ++i) {
      StoreFromDouble(bytes.data(), dtype, i, values[i]);
    }
  }
  BufferRef ref() {
    return {bytes.data(), static_cast<int64_t>(bytes.size() / DTypeSize(dtype)),
            dtype, Device::Host()};
  }
  double at(size_t i) const { return LoadAsDouble(bytes.data(), dtype, i); }

  DType dtype;
  std::vector<unsigned char> bytes;
};

// Rounds `v` to `dtype` as a PyTorch cast from float64 would.
double RoundTo(DType dtype, double v) {
  unsigned char b[8];
  StoreFromDouble(b, dtype, 0, v);
  return LoadAsDouble(b, dtype, 0);
}

TEST(HostDeviceOpsTest, AllocateOnHostOnly) {
  HostDeviceOps ops;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(DeviceBuffer buf,
                                 ops.Allocate(Device::Host(), 100));
  EXPECT_TRUE(buf.allocated());
  EXPECT_EQ(buf.bytes(), 100);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(buf.data()) % 64, 0u);
  EXPECT_EQ(buf.device(), Device::Host());

  FLATPARAM_ASSERT_OK_AND_ASSIGN(DeviceBuffer empty,
                                 ops.Allocate(Device::Host(), 0));
  EXPECT_TRUE(empty.allocated());
  EXPECT_EQ(empty.bytes(), 0);

  EXPECT_THAT(ops.Allocate(Device::Cuda(0), 16),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("cannot allocate on cuda:0")));
  EXPECT_THAT(ops.Allocate(Device::Host(), -1),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("-1")));
}

// Counts allocations and frees, to check DeviceBuffer's ownership.
class CountingOps final : public DeviceOps {
 public:
  Device device() const override { return Device::Host(); }
  absl::string_view name() const override { return "counting"; }
  absl::Status Synchronize() override { return absl::OkStatus(); }
  int live = 0;

 protected:
  absl::StatusOr<void*> DoAllocate(Device, int64_t bytes, bool) override {
    ++live;
    return ::operator new(bytes);
  }
  void DoFree(void* data, Device, bool) override {
    --live;
    ::operator delete(data);
  }
  absl::Status DoCopy(BufferRef, ConstBufferRef) override {
    return absl::OkStatus();
  }
  absl::Status DoFill(BufferRef, double) override { return absl::OkStatus(); }
  absl::Status DoCast(BufferRef, ConstBufferRef) override {
    return absl::OkStatus();
  }
  absl::Status DoScale(BufferRef, ScaleOp, double) override {
    return absl::OkStatus();
  }
  absl::Status DoAdd(BufferRef, ConstBufferRef) override {
    return absl::OkStatus();
  }
};

TEST(DeviceBufferTest, MoveTransfersOwnershipAndResetFrees) {
  CountingOps ops;
  {
    FLATPARAM_ASSERT_OK_AND_ASSIGN(DeviceBuffer a,
                                   ops.Allocate(Device::Host(), 8));
    EXPECT_EQ(ops.live, 1);
    DeviceBuffer b = std::move(a);
    EXPECT_FALSE(a.allocated());  // NOLINT(bugprone-use-after-move)
    EXPECT_TRUE(b.allocated());
    EXPECT_EQ(ops.live, 1);
    FLATPARAM_ASSERT_OK_AND_ASSIGN(DeviceBuffer c,
                                   ops.Allocate(Device::Host(), 8));
    EXPECT_EQ(ops.live, 2);
    c = std::move(b);  // frees c's old memory
    EXPECT_EQ(ops.live, 1);
    c.Reset();
    EXPECT_EQ(ops.live, 0);
    EXPECT_FALSE(c.allocated());
    FLATPARAM_ASSERT_OK_AND_ASSIGN(DeviceBuffer d,
                                   ops.Allocate(Device::Host(), 8));
    EXPECT_EQ(ops.live, 1);
  }
  EXPECT_EQ(ops.live, 0);
}

TEST(HostDeviceOpsTest, CopyFillAndValidation) {
  HostDeviceOps ops;
  HostArray src(DType::kFloat32, {1, 2, 3, 4});
  HostArray dst(DType::kFloat32, {0, 0, 0, 0});
  FLATPARAM_ASSERT_OK(ops.Copy(dst.ref(), src.ref()));
  EXPECT_EQ(dst.at(3), 4);
  // Identical buffers: a no-op.
  FLATPARAM_ASSERT_OK(ops.Copy(dst.ref(), dst.ref()));

  EXPECT_THAT(ops.Copy(dst.ref().Slice(0, 3), src.ref()),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("differ in dtype or count")));
  EXPECT_THAT(
      ops.Copy(dst.ref().Slice(1, 2), dst.ref().Slice(0, 2)),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("overlap")));
  BufferRef on_gpu = dst.ref();
  on_gpu.device = Device::Cuda(0);
  EXPECT_THAT(ops.Copy(on_gpu, src.ref()),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("neither on the host nor on the compute")));
  BufferRef null_ref{nullptr, 4, DType::kFloat32, Device::Host()};
  EXPECT_THAT(
      ops.Fill(null_ref, 1),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("null pointer")));
  BufferRef ints = dst.ref();
  ints.dtype = DType::kInt32;
  EXPECT_THAT(ops.Fill(ints, 1),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("int32")));

  for (DType dtype : kFloatDTypes) {
    HostArray a(dtype, {9, 9, 9});
    FLATPARAM_ASSERT_OK(ops.Fill(a.ref(), 1.0 / 3));
    for (int i = 0; i < 3; ++i) {
      EXPECT_EQ(a.at(i), RoundTo(dtype, 1.0 / 3)) << DTypeName(dtype);
    }
    FLATPARAM_ASSERT_OK(ops.Fill(a.ref(), 0));
    EXPECT_EQ(a.at(1), 0);
    FLATPARAM_ASSERT_OK(ops.Fill(a.ref(), -0.0));
    EXPECT_TRUE(std::signbit(a.at(2)));
  }
}

TEST(HostDeviceOpsTest, CastRoundsToNearestEven) {
  HostDeviceOps ops;
  // 1 + 2^-8 is halfway between two bfloat16 values: ties to even gives 1;
  // 1 + 3 * 2^-8 rounds up to 1 + 2^-6.
  HostArray f32(DType::kFloat32,
                {1 + std::ldexp(1.0, -8), 1 + 3 * std::ldexp(1.0, -8), 65520.0,
                 -std::ldexp(1.0, -140)});
  HostArray bf16(DType::kBFloat16, {0, 0, 0, 0});
  FLATPARAM_ASSERT_OK(ops.Cast(bf16.ref(), f32.ref()));
  EXPECT_EQ(bf16.at(0), 1.0);
  EXPECT_EQ(bf16.at(1), 1 + std::ldexp(1.0, -6));
  HostArray f16(DType::kFloat16, {0, 0, 0, 0});
  FLATPARAM_ASSERT_OK(ops.Cast(f16.ref(), f32.ref()));
  // 65520 is the first value that rounds to infinity in float16.
  EXPECT_TRUE(std::isinf(f16.at(2)));
  // A tiny negative rounds to -0 in float16.
  EXPECT_EQ(f16.at(3), 0);
  EXPECT_TRUE(std::signbit(f16.at(3)));

  // Every pair of dtypes agrees with ConvertElements.
  const std::vector<double> values = {0.1, -2.5, 1e-7, 3e38, 1e300, -0.0};
  for (DType from : kFloatDTypes) {
    for (DType to : kFloatDTypes) {
      HostArray src(from, values);
      HostArray dst(to, std::vector<double>(values.size(), 0));
      FLATPARAM_ASSERT_OK(ops.Cast(dst.ref(), src.ref()));
      std::vector<unsigned char> want(values.size() * DTypeSize(to));
      ConvertElements(src.bytes.data(), from, want.data(), to, values.size());
      EXPECT_EQ(dst.bytes, want) << DTypeName(from) << " -> " << DTypeName(to);
    }
  }
  HostArray short_dst(DType::kFloat16, {0});
  EXPECT_THAT(ops.Cast(short_dst.ref(), f32.ref()),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("differ in count")));
}

// Dividing by a power of two multiplies by its exact reciprocal: the bits
// must be a true division's, also where the result is subnormal or
// overflows, and for NaN and signed zeros.
TEST(HostDeviceOpsTest, DividingByAPowerOfTwoIsBitwiseADivision) {
  std::vector<double> values = {0.0,   -0.0,   1e-38,   1.1754e-38,
                                1e-44, 3.4e38, -2.5e38, 65504,
                                6e-8,  1.5,    -3.25};
  values.push_back(std::numeric_limits<double>::quiet_NaN());
  values.push_back(std::numeric_limits<double>::infinity());
  uint32_t bits = 777;
  for (int i = 0; i < 1000; ++i) {
    bits = bits * 1664525u + 1013904223u;
    float v;
    std::memcpy(&v, &bits, 4);
    values.push_back(v);
  }
  for (DType dtype : kFloatDTypes) {
    for (double factor : {2.0, 64.0, 0.25, 0x1p100, 0x1p-100, 0x1p126}) {
      std::vector<double> want;
      for (double v : values) {
        const double x = RoundTo(dtype, v);
        if (dtype == DType::kFloat64) {
          volatile double f = factor;
          want.push_back(x / f);
        } else {
          volatile float f = static_cast<float>(factor);
          want.push_back(RoundTo(dtype, static_cast<float>(x) / f));
        }
      }
      std::vector<unsigned char> buf(values.size() * DTypeSize(dtype));
      for (size_t i = 0; i < values.size(); ++i) {
        StoreFromDouble(buf.data(), dtype, i, values[i]);
      }
      HostScale(buf.data(), dtype, static_cast<int64_t>(values.size()),
                ScaleOp::kDivide, factor);
      for (size_t i = 0; i < values.size(); ++i) {
        const double got = LoadAsDouble(buf.data(), dtype, i);
        const bool same =
            std::isnan(want[i])
                ? std::isnan(got)
                : got == want[i] && std::signbit(got) == std::signbit(want[i]);
        ASSERT_TRUE(same) << DTypeName(dtype) << " " << values[i] << " / "
                          << factor << ": " << got << " != " << want[i];
      }
    }
  }
}

TEST(HostDeviceOpsTest, ScaleUsesTheComputeTypeAndRoundsOnce) {
  HostDeviceOps ops;
  for (DType dtype : kFloatDTypes) {
    const std::vector<double> values = {1, 3, 10, 0.1, -7.25, 1000};
    for (double factor : {2.0, 3.0, 1.5, 0.7}) {
      HostArray a(dtype, values);
      FLATPARAM_ASSERT_OK(ops.Scale(a.ref(), ScaleOp::kDivide, factor));
      HostArray m(dtype, values);
      FLATPARAM_ASSERT_OK(ops.Scale(m.ref(), ScaleOp::kMultiply, factor));
      for (size_t i = 0; i < values.size(); ++i) {
        const double x = RoundTo(dtype, values[i]);
        if (dtype == DType::kFloat64) {
          EXPECT_EQ(a.at(i), x / factor);
          EXPECT_EQ(m.at(i), x * factor);
        } else {
          // float32 arithmetic: the float64 result rounded to float32 is the
          // correctly rounded float32 result for one operation.
          const float f = static_cast<float>(factor);
          EXPECT_EQ(a.at(i), RoundTo(dtype, static_cast<float>(x) / f))
              << DTypeName(dtype) << " " << values[i] << " / " << factor;
          EXPECT_EQ(m.at(i), RoundTo(dtype, static_cast<float>(x) * f));
        }
      }
    }
  }
  HostArray a(DType::kFloat32, {1});
  EXPECT_THAT(ops.Scale(a.ref(), ScaleOp::kDivide, 0),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("cannot divide by 0")));
  EXPECT_THAT(
      ops.Scale(a.ref(), ScaleOp::kMultiply,
                std::numeric_limits<double>::infinity()),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("multiply")));
}

TEST(HostDeviceOpsTest, AddRoundsInTheDType) {
  HostDeviceOps ops;
  // In bfloat16, 256 + 1 is 256 (ties to even), 1 + 1 is 2.
  HostArray acc(DType::kBFloat16, {256, 1, -3});
  HostArray x(DType::kBFloat16, {1, 1, 0.5});
  FLATPARAM_ASSERT_OK(ops.Add(acc.ref(), x.ref()));
  EXPECT_EQ(acc.at(0), 256);
  EXPECT_EQ(acc.at(1), 2);
  EXPECT_EQ(acc.at(2), -2.5);
  // x may be acc itself.
  FLATPARAM_ASSERT_OK(ops.Add(acc.ref(), acc.ref()));
  EXPECT_EQ(acc.at(1), 4);

  HostArray f32(DType::kFloat32, {1, 2, 3});
  HostArray f32b(DType::kFloat32, {0.1, 0.2, 0.3});
  FLATPARAM_ASSERT_OK(ops.Add(f32.ref(), f32b.ref()));
  EXPECT_EQ(f32.at(0), static_cast<double>(1.0f + 0.1f));

  EXPECT_THAT(ops.Add(acc.ref(), f32.ref()),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("differ in dtype")));
  EXPECT_THAT(ops.Add(f32.ref().Slice(1, 2), f32.ref().Slice(0, 2)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("overlap partially")));
}

}  // namespace
}  // namespace flatparam
