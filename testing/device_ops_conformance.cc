#include "testing/device_ops_conformance.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "flatparam/base/dtype.h"
#include "flatparam/base/status_matchers.h"

namespace flatparam {
namespace {

constexpr DType kDTypes[] = {DType::kFloat32, DType::kFloat64, DType::kBFloat16,
                             DType::kFloat16};

int64_t Count(const std::vector<unsigned char>& b, DType dtype) {
  return static_cast<int64_t>(b.size() / DTypeSize(dtype));
}

// Host bytes into a new device buffer, and back, through the ops.
DeviceBuffer Upload(DeviceOps& ops, const std::vector<unsigned char>& host,
                    DType dtype) {
  absl::StatusOr<DeviceBuffer> d =
      ops.Allocate(ops.device(), static_cast<int64_t>(host.size()));
  EXPECT_THAT(d, IsOk());
  if (!d.ok()) return DeviceBuffer();
  EXPECT_THAT(ops.Copy(d->As(dtype), {host.data(), Count(host, dtype), dtype,
                                      Device::Host()}),
              IsOk());
  return *std::move(d);
}

std::vector<unsigned char> Download(DeviceOps& ops, const DeviceBuffer& d,
                                    DType dtype) {
  std::vector<unsigned char> out(d.bytes());
  EXPECT_THAT(ops.Copy({out.data(), Count(out, dtype), dtype, Device::Host()},
                       d.As(dtype)),
              IsOk());
  EXPECT_THAT(ops.Synchronize(), IsOk());
  return out;
}

TEST_P(DeviceOpsConformanceTest, AllocationIsCheckedAndPlaced) {
  for (Device device : {ops().device(), Device::Host()}) {
    for (int64_t bytes : {int64_t{0}, int64_t{1}, int64_t{4096}}) {
      absl::StatusOr<DeviceBuffer> b = ops().Allocate(device, bytes);
      ASSERT_THAT(b, IsOk()) << DeviceName(device) << " " << bytes;
      EXPECT_TRUE(b->allocated());
      EXPECT_EQ(b->bytes(), bytes);
      EXPECT_EQ(b->device(), device);
    }
  }
  absl::StatusOr<DeviceBuffer> pinned =
      ops().Allocate(Device::Host(), 64, /*pinned=*/true);
  ASSERT_THAT(pinned, IsOk());
  EXPECT_EQ(ops().Allocate(ops().device(), -1).status().code(),
            absl::StatusCode::kInvalidArgument);
  // Neither the compute device nor the host.
  EXPECT_EQ(ops().Allocate(Device::Cuda(7), 64).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_P(DeviceOpsConformanceTest, MismatchedArgumentsAreRefused) {
  const DType f32 = DType::kFloat32;
  absl::StatusOr<DeviceBuffer> a = ops().Allocate(ops().device(), 64);
  absl::StatusOr<DeviceBuffer> b = ops().Allocate(ops().device(), 32);
  ASSERT_THAT(a, IsOk());
  ASSERT_THAT(b, IsOk());
  EXPECT_EQ(ops().Copy(a->As(f32), b->As(f32)).code(),
            absl::StatusCode::kInvalidArgument);  // counts differ
  EXPECT_EQ(ops().Add(a->As(f32), b->As(f32)).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ops().Scale(a->As(f32), ScaleOp::kDivide, 0).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ops()
                .Scale(a->As(f32), ScaleOp::kMultiply,
                       std::numeric_limits<double>::infinity())
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ops().SetStream(Stream{ops().num_streams() + 3}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(ops().Synchronize(), IsOk());
}

TEST_P(DeviceOpsConformanceTest, FillCastAndAddAreTheHostKernels) {
  const std::vector<double> values = DeviceTestValues();
  std::vector<double> other;
  for (size_t i = 0; i < values.size(); ++i) other.push_back(std::cos(i) * 3);
  for (DType dtype : kDTypes) {
    const std::string name(DTypeName(dtype));
    for (double value : {0.0, -0.0, 1.0 / 3, 65520.0}) {
      absl::StatusOr<DeviceBuffer> d =
          ops().Allocate(ops().device(), 301 * DTypeSize(dtype));
      ASSERT_THAT(d, IsOk());
      ASSERT_THAT(ops().Fill(d->As(dtype), value), IsOk());
      std::vector<unsigned char> want(d->bytes());
      HostFill(want.data(), dtype, 301, value);
      ExpectSameValues(Download(ops(), *d, dtype), want, dtype,
                       absl::StrCat("fill ", name, " ", value));
    }
    std::vector<unsigned char> acc = HostBytes(dtype, values);
    const std::vector<unsigned char> x = HostBytes(dtype, other);
    DeviceBuffer d_acc = Upload(ops(), acc, dtype);
    DeviceBuffer d_x = Upload(ops(), x, dtype);
    ASSERT_THAT(ops().Add(d_acc.As(dtype), d_x.As(dtype)), IsOk());
    HostAdd(acc.data(), x.data(), dtype, Count(acc, dtype));
    ExpectSameValues(Download(ops(), d_acc, dtype), acc, dtype,
                     absl::StrCat("add ", name));
    const std::vector<unsigned char> src = HostBytes(dtype, values);
    DeviceBuffer d_src = Upload(ops(), src, dtype);
    for (DType to : kDTypes) {
      absl::StatusOr<DeviceBuffer> d_dst =
          ops().Allocate(ops().device(), values.size() * DTypeSize(to));
      ASSERT_THAT(d_dst, IsOk());
      ASSERT_THAT(ops().Cast(d_dst->As(to), d_src.As(dtype)), IsOk());
      std::vector<unsigned char> want(d_dst->bytes());
      HostCast(want.data(), to, src.data(), dtype, Count(src, dtype));
      ExpectSameValues(Download(ops(), *d_dst, to), want, to,
                       absl::StrCat("cast ", name, " -> ", DTypeName(to)));
    }
  }
}

TEST_P(DeviceOpsConformanceTest, ScaleAgreesWhereCpuAndCudaArithmeticDo) {
  const std::vector<double> values = DeviceTestValues();
  for (DType dtype : kDTypes) {
    // Division by a power of two is exact both ways; multiplication is one
    // rounding both ways.
    for (const auto& [op, factor] :
         std::vector<std::pair<ScaleOp, double>>{{ScaleOp::kDivide, 4.0},
                                                 {ScaleOp::kDivide, 0.5},
                                                 {ScaleOp::kMultiply, 0.7},
                                                 {ScaleOp::kMultiply, 3.0}}) {
      std::vector<unsigned char> host = HostBytes(dtype, values);
      DeviceBuffer d = Upload(ops(), host, dtype);
      ASSERT_THAT(ops().Scale(d.As(dtype), op, factor), IsOk());
      HostScale(host.data(), dtype, Count(host, dtype), op, factor);
      ExpectSameValues(
          Download(ops(), d, dtype), host, dtype,
          absl::StrCat(DTypeName(dtype), " ", ScaleOpName(op), " ", factor));
    }
  }
}

TEST_P(DeviceOpsConformanceTest, CopiesBetweenEveryPlacement) {
  const DType f32 = DType::kFloat32;
  const std::vector<unsigned char> bytes = HostBytes(f32, DeviceTestValues());
  const int64_t n = Count(bytes, f32);
  absl::StatusOr<DeviceBuffer> pinned =
      ops().Allocate(Device::Host(), bytes.size(), /*pinned=*/true);
  absl::StatusOr<DeviceBuffer> pageable =
      ops().Allocate(Device::Host(), bytes.size());
  absl::StatusOr<DeviceBuffer> d1 =
      ops().Allocate(ops().device(), bytes.size());
  absl::StatusOr<DeviceBuffer> d2 =
      ops().Allocate(ops().device(), bytes.size());
  ASSERT_THAT(pinned, IsOk());
  ASSERT_THAT(pageable, IsOk());
  ASSERT_THAT(d1, IsOk());
  ASSERT_THAT(d2, IsOk());
  std::memcpy(pageable->data(), bytes.data(), bytes.size());
  // pageable -> device -> device -> pinned -> device -> vector.
  ASSERT_THAT(ops().Copy(d1->As(f32), pageable->As(f32)), IsOk());
  ASSERT_THAT(ops().Copy(d2->As(f32), d1->As(f32)), IsOk());
  ASSERT_THAT(ops().Copy(pinned->As(f32), d2->As(f32)), IsOk());
  ASSERT_THAT(ops().Fill(d1->As(f32), 0), IsOk());
  ASSERT_THAT(ops().Copy(d1->As(f32), pinned->As(f32)), IsOk());
  std::vector<unsigned char> out = Download(ops(), *d1, f32);
  EXPECT_EQ(out, bytes);
  EXPECT_EQ(n, Count(out, f32));
}

TEST_P(DeviceOpsConformanceTest, EventsOrderWorkAcrossStreams) {
  const DType f32 = DType::kFloat32;
  const int64_t n = 1 << 16;
  absl::StatusOr<Stream> producer = ops().NewStream();
  absl::StatusOr<Stream> consumer = ops().NewStream();
  ASSERT_THAT(producer, IsOk());
  ASSERT_THAT(consumer, IsOk());
  EXPECT_NE(*producer, *consumer);
  EXPECT_EQ(ops().NativeStream(*producer).has_value(), has_native_streams());
  absl::StatusOr<DeviceBuffer> x = ops().Allocate(ops().device(), n * 4);
  absl::StatusOr<DeviceBuffer> y = ops().Allocate(ops().device(), n * 4);
  ASSERT_THAT(x, IsOk());
  ASSERT_THAT(y, IsOk());
  ASSERT_THAT(ops().Fill(x->As(f32), 0), IsOk());
  ASSERT_THAT(ops().Synchronize(), IsOk());
  for (int round = 1; round <= 8; ++round) {
    ASSERT_THAT(ops().SetStream(*producer), IsOk());
    ASSERT_THAT(ops().Fill(x->As(f32), round), IsOk());
    absl::StatusOr<Event> filled = ops().RecordEvent(*producer);
    ASSERT_THAT(filled, IsOk());
    ASSERT_THAT(ops().WaitEvent(*consumer, *filled), IsOk());
    ASSERT_THAT(ops().SetStream(*consumer), IsOk());
    ASSERT_THAT(ops().Copy(y->As(f32), x->As(f32)), IsOk());
    ASSERT_THAT(ops().RecordStream(x->As(f32), *consumer), IsOk());
    absl::StatusOr<Event> copied = ops().RecordEvent(*consumer);
    ASSERT_THAT(copied, IsOk());
    ASSERT_THAT(ops().SynchronizeEvent(*copied), IsOk());
    ASSERT_THAT(ops().SetStream(Stream{0}), IsOk());
    std::vector<unsigned char> want(n * 4);
    HostFill(want.data(), f32, n, round);
    EXPECT_EQ(Download(ops(), *y, f32), want) << "round " << round;
  }
}

}  // namespace

// Binaries that link the suite for its helpers need not instantiate it
// (cuda_device_test on a GPU).
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(DeviceOpsConformanceTest);

std::vector<double> DeviceTestValues() {
  std::vector<double> v = {0.0,
                           -0.0,
                           1.0,
                           -1.0,
                           1.0 / 3,
                           1 + std::ldexp(1.0, -8),
                           1 + 3 * std::ldexp(1.0, -8),
                           1 + std::ldexp(1.0, -11),
                           65504.0,
                           65520.0,
                           1e-8,
                           std::ldexp(1.0, -130),
                           3.4e38,
                           1e300,
                           -1e-300,
                           std::numeric_limits<double>::infinity(),
                           -std::numeric_limits<double>::infinity(),
                           std::numeric_limits<double>::quiet_NaN()};
  for (int i = 0; i < 200; ++i) v.push_back(std::sin(i * 1.37) * (i + 1));
  return v;
}

std::vector<unsigned char> HostBytes(DType dtype,
                                     const std::vector<double>& values) {
  std::vector<unsigned char> b(values.size() * DTypeSize(dtype));
  for (size_t i = 0; i < values.size(); ++i) {
    StoreFromDouble(b.data(), dtype, i, values[i]);
  }
  return b;
}

void ExpectSameValues(const std::vector<unsigned char>& got,
                      const std::vector<unsigned char>& want, DType dtype,
                      const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  const size_t size = DTypeSize(dtype);
  int reported = 0;
  for (size_t i = 0; i < got.size() / size && reported < 5; ++i) {
    if (std::isnan(LoadAsDouble(want.data(), dtype, i)) &&
        std::isnan(LoadAsDouble(got.data(), dtype, i))) {
      continue;
    }
    if (std::memcmp(got.data() + i * size, want.data() + i * size, size) != 0) {
      ADD_FAILURE() << what << " element " << i << ": got "
                    << LoadAsDouble(got.data(), dtype, i) << ", want "
                    << LoadAsDouble(want.data(), dtype, i);
      ++reported;
    }
  }
}

std::string DeviceOpsUnderTestName(
    const ::testing::TestParamInfo<DeviceOpsUnderTest>& info) {
  return info.param.name;
}

}  // namespace flatparam
