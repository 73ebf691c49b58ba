#include "testing/torch_fault_testutil.h"

#include <signal.h>
#include <torch/optim/adamw.h>
#include <torch/types.h>
#include <torch/utils.h>
#include <unistd.h>

#include <cstdio>
#include <memory>

#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/device/device.h"
#include "flatparam/torch/fsdp_module.h"
#include "testing/torch_testutil.h"

namespace flatparam {
namespace libtorch {

using namespace ::flatparam::libtorch::testing;  // NOLINT

absl::Status TrainWithFault(Communicator& world,
                            const FaultTrainOptions& fault) {
  const absl::Duration timeout = fault.timeout;
  const bool faulty = fault.fault != "none" && world.rank() == fault.fault_rank;
  HostDeviceOps device;
  Net net = MakeNet();
  FsdpOptions options;
  options.wrap = {"h.*"};
  options.handle.collective_options.timeout = timeout;
  options.runtime.collective_options.timeout = timeout;
  FLATPARAM_ASSIGN_OR_RETURN(
      std::unique_ptr<FsdpModule> fsdp,
      FsdpModule::Wrap(net.ptr(), &world, &device, options));
  torch::optim::AdamW adamw(fsdp->ShardedParameters(),
                            torch::optim::AdamWOptions(0.01));
  for (int step = 0; step < fault.steps; ++step) {
    torch::Tensor tokens = Tokens(step, world.rank() * 2, 2);
    FLATPARAM_ASSIGN_OR_RETURN(torch::Tensor logits,
                               ForwardNet(net, *fsdp, tokens));
    torch::Tensor loss = Loss(logits, tokens);
    if (faulty && step == 2) {
      std::fprintf(stderr, "fsdp_module_fault: rank %d: fault %s at %lld\n",
                   world.rank(), fault.fault.c_str(),
                   static_cast<long long>(absl::ToUnixMillis(absl::Now())));
      std::fflush(stderr);
      if (fault.fault == "exit-in-backward") _exit(3);
      raise(SIGSTOP);
    }
    FLATPARAM_RETURN_IF_ERROR(fsdp->Backward(loss));
    adamw.step();
    FLATPARAM_RETURN_IF_ERROR(fsdp->ZeroGrad());
  }
  return absl::OkStatus();
}

}  // namespace libtorch
}  // namespace flatparam
