// SimTorchDevice: FsdpModule's device path on the CPU. LibTorch's tensors
// stay CPU tensors, but the flat parameters live in SimDeviceOps' memory
// (labelled a CUDA device, so every placement rule and host <-> device
// copy applies), whose streams run late and reordered (sim/sim_device.h).
// LibTorch's kernels run at once on the host, which models a LibTorch
// stream equal to stream 0 only if the host waits for stream 0 wherever
// control passes to LibTorch: HandToTorch does exactly that, and nothing
// else does. So a hand-off FsdpModule forgets, or an event the runtime
// forgets, lets LibTorch read bytes that queued work has not written yet,
// and training differs from the reference (and the race detector reports
// flatparam's own unordered accesses).
//
//   SimDeviceOps ops({.seed = 3});
//   StreamCheckedCommunicator comm(&sim_comm, &ops, /*stream_ordered=*/true);
//   SimTorchDevice device(&ops);
//   auto fsdp = FsdpModule::Wrap(net, &comm, &device, options);
//
// Borrows `ops`; one thread at a time, as the ops.
#ifndef TESTING_SIM_TORCH_DEVICE_H_
#define TESTING_SIM_TORCH_DEVICE_H_

#include <c10/core/Device.h>

#include <cstdint>

#include "absl/status/status.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/device/device.h"
#include "flatparam/torch/torch_device.h"
#include "sim/sim_device.h"

namespace flatparam {

class SimTorchDevice final : public TorchDevice {
 public:
  explicit SimTorchDevice(SimDeviceOps* ops) : ops_(ops) {}

  DeviceOps& ops() override { return *ops_; }
  c10::Device torch_device() const override { return c10::Device(c10::kCPU); }
  absl::Status CheckCurrentStream() const override { return absl::OkStatus(); }
  absl::Status HandToTorch() override {
    ++hand_offs_;
    FLATPARAM_ASSIGN_OR_RETURN(Event now, ops_->RecordEvent(Stream{0}));
    return ops_->SynchronizeEvent(now);
  }

  // HandToTorch calls so far.
  int64_t hand_offs() const { return hand_offs_; }

 private:
  SimDeviceOps* ops_;
  int64_t hand_offs_ = 0;
};

}  // namespace flatparam

#endif  // TESTING_SIM_TORCH_DEVICE_H_
