// README.md's LibTorch snippet (snippet_3.cc) runs: TrainMlp on 2
// simulated ranks.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <memory>

#include "absl/status/status.h"
#include "comm/communicator.h"
#include "flatparam/base/status_matchers.h"
#include "flatparam/device/device.h"
#include "sim/sim.h"

// snippet_3.cc
absl::Status TrainMlp(flatparam::Communicator& world,
                      flatparam::DeviceOps& device, int steps);

namespace flatparam {
namespace {

TEST(ReadmeTorchSnippetTest, TrainsOnTwoSimulatedRanks) {
  torch::set_num_threads(1);
  SimOptions sim;
  sim.world_size = 2;
  absl::StatusOr<std::unique_ptr<SimWorld>> world = SimWorld::Create(sim);
  ASSERT_THAT(world.status(), IsOk());
  EXPECT_THAT((*world)->Run([](SimCommunicator& comm) -> absl::Status {
    HostDeviceOps device;
    return TrainMlp(comm, device, 3);
  }),
              IsOk());
}

}  // namespace
}  // namespace flatparam
