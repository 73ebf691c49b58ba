// TorchDevice: where FsdpModule's flat parameters live as LibTorch sees
// them -- the DeviceOps that owns their memory, the LibTorch device of
// tensors over that memory, and how LibTorch's kernels are ordered with
// the DeviceOps' work.
//
//   // The CPU (what FsdpModule::Wrap(module, world, &host_ops) makes):
//   HostDeviceOps host_ops;
//   HostTorchDevice cpu(&host_ops);
//   // A GPU, on LibTorch's current stream and caching allocator
//   // (flatparam/torch/torch_cuda.h):
//   FLATPARAM_ASSIGN_OR_RETURN(std::unique_ptr<TorchCudaDeviceOps> gpu,
//                              TorchCudaDeviceOps::Create(0));
//   FLATPARAM_ASSIGN_OR_RETURN(auto fsdp,
//                              FsdpModule::Wrap(model, &world, gpu.get()));
//
// The contract FsdpModule relies on. ops()' stream 0 is the compute stream
// (HandleOptions::streams.compute must be stream 0): the flat-parameter
// runtime orders its unshard and post-backward streams with it by events
// (flatparam/handle.h), so LibTorch's kernels -- the module's forward,
// autograd's backward, the optimizer -- see flatparam's memory correctly
// exactly when they run in order with stream 0. CheckCurrentStream() says
// whether LibTorch's kernels issued now would; FsdpModule calls it at
// every forward, unit and backward hook, and refuses to go on otherwise.
// HandToTorch() is called wherever control passes from flatparam to
// LibTorch code that may read memory flatparam's work wrote (a unit's
// forward about to run, a backward hook returning, the optimizer's turn);
// on CUDA it does nothing, since LibTorch's kernels are queued behind that
// work on the same stream.
//
// Memory placement: tensors over ops()' device memory are on
// torch_device(); over host memory (CPU offload's shards, pinned or not)
// on the CPU.
//
// Ownership: a TorchDevice borrows or owns its DeviceOps as each
// implementation says; FsdpModule borrows the TorchDevice, which must
// outlive it. Thread-safety: as the DeviceOps (one thread at a time;
// LibTorch may run the backward's hooks on its own device thread while the
// caller's thread waits in backward()).
#ifndef FLATPARAM_TORCH_TORCH_DEVICE_H_
#define FLATPARAM_TORCH_TORCH_DEVICE_H_

#include <c10/core/Device.h>

#include "absl/status/status.h"
#include "flatparam/device/device.h"

namespace flatparam {

class TorchDevice {
 public:
  virtual ~TorchDevice() = default;

  // The DeviceOps that allocates and moves the flat parameters.
  virtual DeviceOps& ops() = 0;
  // The LibTorch device of tensors over ops()' device memory.
  virtual c10::Device torch_device() const = 0;
  // OK when LibTorch's kernels issued now, on the calling thread, run in
  // order with ops()' stream 0; FailedPrecondition, naming both, otherwise.
  virtual absl::Status CheckCurrentStream() const = 0;
  // LibTorch's kernels issued from now on see every effect of the work
  // issued on ops()' stream 0 so far (and of the work stream 0 waits for).
  virtual absl::Status HandToTorch() = 0;
};

// The CPU: a host DeviceOps (its device() is Device::Host()) under LibTorch's
// CPU tensors, which run at once on the calling thread as the host
// DeviceOps' operations complete before returning. Borrows `ops`.
class HostTorchDevice final : public TorchDevice {
 public:
  explicit HostTorchDevice(DeviceOps* ops) : ops_(ops) {}

  DeviceOps& ops() override { return *ops_; }
  c10::Device torch_device() const override { return c10::Device(c10::kCPU); }
  absl::Status CheckCurrentStream() const override { return absl::OkStatus(); }
  // A host DeviceOps has completed every operation when it returns.
  absl::Status HandToTorch() override { return absl::OkStatus(); }

 private:
  DeviceOps* ops_;
};

}  // namespace flatparam

#endif  // FLATPARAM_TORCH_TORCH_DEVICE_H_
