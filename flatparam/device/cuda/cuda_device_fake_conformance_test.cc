// The DeviceOps contract (testing/device_ops_conformance.h) on CudaDeviceOps
// over FakeCudaRuntime, whose streams finish in their own time, so work an
// event does not order shows. Part of cuda_device_fake_test.
#include <gtest/gtest.h>

#include <memory>

#include "flatparam/base/status_matchers.h"
#include "flatparam/device/cuda/cuda_device_ops.h"
#include "flatparam/device/cuda/fake_cuda_runtime.h"
#include "testing/device_ops_conformance.h"

namespace flatparam {
namespace {

class FakeCudaFixture : public DeviceOpsFixture {
 public:
  FakeCudaFixture() {
    FakeCudaRuntime::Options options;
    options.max_op_delay = absl::Microseconds(50);
    runtime_ = std::make_unique<FakeCudaRuntime>(options);
    absl::StatusOr<std::unique_ptr<CudaDeviceOps>> ops =
        CudaDeviceOps::Create(0, nullptr, nullptr, runtime_.get());
    EXPECT_THAT(ops, IsOk());
    if (ops.ok()) ops_ = *std::move(ops);
  }
  ~FakeCudaFixture() override { ops_.reset(); }  // before the runtime
  DeviceOps& ops() override { return *ops_; }
  bool has_native_streams() const override { return true; }

 private:
  std::unique_ptr<FakeCudaRuntime> runtime_;
  std::unique_ptr<CudaDeviceOps> ops_;
};

INSTANTIATE_TEST_SUITE_P(
    FakeCudaRuntime, DeviceOpsConformanceTest,
    ::testing::Values(DeviceOpsUnderTest{
        "CudaDeviceOps", [] { return std::make_unique<FakeCudaFixture>(); }}),
    DeviceOpsUnderTestName);

}  // namespace
}  // namespace flatparam
