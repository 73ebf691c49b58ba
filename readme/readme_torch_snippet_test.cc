// README.md's LibTorch snippets run: TrainMlp (snippet_3.cc) on 2
// simulated ranks; SaveAndResumeDcp (snippet_4.cc) on a wrapped linear
// layer there.
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/types.h>
#include <torch/utils.h>

#include <cstdlib>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "comm/communicator.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/base/status_matchers.h"
#include "flatparam/device/device.h"
#include "flatparam/torch/fsdp_module.h"
#include "sim/sim.h"

// snippet_3.cc
absl::Status TrainMlp(flatparam::Communicator& world,
                      flatparam::DeviceOps& device, int steps);
// snippet_4.cc
absl::Status SaveAndResumeDcp(flatparam::libtorch::FsdpModule& fsdp,
                              torch::optim::Optimizer& adamw,
                              const std::string& dir);

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

TEST(ReadmeTorchSnippetTest, SavesAndResumesADistributedCheckpoint) {
  torch::set_num_threads(1);
  SimOptions sim;
  sim.world_size = 2;
  absl::StatusOr<std::unique_ptr<SimWorld>> world = SimWorld::Create(sim);
  ASSERT_THAT(world.status(), IsOk());
  const std::string dir =
      absl::StrCat(std::getenv("TEST_TMPDIR"), "/readme_dcp");
  EXPECT_THAT((*world)->Run([&](SimCommunicator& comm) -> absl::Status {
    HostDeviceOps device;
    torch::manual_seed(3);
    torch::nn::Linear linear(5, 3);
    FLATPARAM_ASSIGN_OR_RETURN(
        std::unique_ptr<libtorch::FsdpModule> fsdp,
        libtorch::FsdpModule::Wrap(linear.ptr(), &comm, &device, {}));
    torch::optim::AdamW adamw(fsdp->ShardedParameters(),
                              torch::optim::AdamWOptions(0.01));
    return SaveAndResumeDcp(*fsdp, adamw, dir);
  }),
              IsOk());
}

}  // namespace
}  // namespace flatparam
