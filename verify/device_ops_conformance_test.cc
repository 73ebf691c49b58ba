// The DeviceOps contract (testing/device_ops_conformance.h) on the host
// implementation, the simulated device (two scheduling seeds: streams'
// work runs in different orders) and testing's FakeCudaDeviceOps.
// CudaDeviceOps runs the same suite in flatparam/device/cuda's
// cuda_device_fake_test (on FakeCudaRuntime) and cuda_device_test (GPU).
#include "testing/device_ops_conformance.h"

#include <gtest/gtest.h>

#include <memory>

#include "flatparam/device/device.h"
#include "sim/sim_device.h"
#include "testing/handle_testutil.h"

namespace flatparam {
namespace {

template <typename Ops, bool kNativeStreams>
class OwnedOps : public DeviceOpsFixture {
 public:
  template <typename... Args>
  explicit OwnedOps(Args&&... args) : ops_(std::forward<Args>(args)...) {}
  DeviceOps& ops() override { return ops_; }
  bool has_native_streams() const override { return kNativeStreams; }

 private:
  Ops ops_;
};

std::unique_ptr<DeviceOpsFixture> Sim(uint64_t seed) {
  SimDeviceOptions options;
  options.seed = seed;
  return std::make_unique<OwnedOps<SimDeviceOps, true>>(options);
}

INSTANTIATE_TEST_SUITE_P(
    Implementations, DeviceOpsConformanceTest,
    ::testing::Values(
        DeviceOpsUnderTest{
            "Host",
            [] { return std::make_unique<OwnedOps<HostDeviceOps, false>>(); }},
        DeviceOpsUnderTest{"SimSeed1", [] { return Sim(1); }},
        DeviceOpsUnderTest{"SimSeed7", [] { return Sim(7); }},
        DeviceOpsUnderTest{
            "FakeCudaDeviceOps",
            [] {
              return std::make_unique<
                  OwnedOps<testing_handle::FakeCudaDeviceOps, false>>();
            }}),
    DeviceOpsUnderTestName);

}  // namespace
}  // namespace flatparam
