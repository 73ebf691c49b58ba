// The contract of flatparam::DeviceOps (flatparam/device/device.h) as one
// test suite, run against every implementation -- HostDeviceOps,
// SimDeviceOps, CudaDeviceOps (on FakeCudaRuntime in CI, on the GPU where
// there is one) and testing's FakeCudaDeviceOps -- as comm/conformance runs
// one suite against every Communicator: the handle and runtime tests run on
// one of them at a time and are worth what their agreement is worth.
//
//   INSTANTIATE_TEST_SUITE_P(
//       Mine, DeviceOpsConformanceTest,
//       ::testing::Values(DeviceOpsUnderTest{"mine", [] {
//         return std::make_unique<MyDeviceOpsFixture>();
//       }}),
//       DeviceOpsUnderTestName);
//
// What it checks: argument and placement checks; Fill, Cast and Add equal
// to the host kernels (PyTorch's CPU arithmetic) bit for bit, NaN payloads
// aside; Scale by a power of two (where PyTorch's CUDA multiply-by-
// reciprocal and the CPU's division agree) and multiplication; copies
// between host, pinned host and device memory; work ordered across streams
// by events; streams these ops did not create refused.
//
// Ownership: each test makes its own fixture (the ops and whatever runtime
// they stand on) and drops it at the end. Thread-safety: one test at a time.
#ifndef TESTING_DEVICE_OPS_CONFORMANCE_H_
#define TESTING_DEVICE_OPS_CONFORMANCE_H_

#include <gtest/gtest.h>

#include <functional>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "flatparam/base/dtype.h"
#include "flatparam/device/device.h"

namespace flatparam {

class DeviceOpsFixture {
 public:
  virtual ~DeviceOpsFixture() = default;
  virtual DeviceOps& ops() = 0;
  // Whether the ops have device streams (NativeStream gives one for each
  // stream they created); false for implementations that finish every
  // operation before returning.
  virtual bool has_native_streams() const = 0;
};

struct DeviceOpsUnderTest {
  std::string name;
  std::function<std::unique_ptr<DeviceOpsFixture>()> make;
};

inline void PrintTo(const DeviceOpsUnderTest& d, std::ostream* os) {
  *os << d.name;
}

// Values that exercise rounding, ties, overflow, subnormals and specials in
// every floating dtype.
std::vector<double> DeviceTestValues();
// `values` rounded into a host byte vector of `dtype`.
std::vector<unsigned char> HostBytes(DType dtype,
                                     const std::vector<double>& values);
// Equal bytes, except that any NaN matches any NaN (payloads differ between
// c10's CPU and CUDA conversions); reports the first few differences.
void ExpectSameValues(const std::vector<unsigned char>& got,
                      const std::vector<unsigned char>& want, DType dtype,
                      const std::string& what);

// For INSTANTIATE_TEST_SUITE_P's name generator.
std::string DeviceOpsUnderTestName(
    const ::testing::TestParamInfo<DeviceOpsUnderTest>& info);

class DeviceOpsConformanceTest
    : public ::testing::TestWithParam<DeviceOpsUnderTest> {
 protected:
  void SetUp() override { fixture_ = GetParam().make(); }
  // Buffers first: every DeviceBuffer must be gone before its ops.
  void TearDown() override { fixture_.reset(); }
  DeviceOps& ops() { return fixture_->ops(); }
  bool has_native_streams() const { return fixture_->has_native_streams(); }

 private:
  std::unique_ptr<DeviceOpsFixture> fixture_;
};

}  // namespace flatparam

#endif  // TESTING_DEVICE_OPS_CONFORMANCE_H_
