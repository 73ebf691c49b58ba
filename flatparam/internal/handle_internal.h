// Private to //flatparam:handle: what the implementation files of
// FlatParamHandle (handle.cc: creation and the training-state machine;
// handle_unshard.cc: collectives, streams, unshard and reshard;
// handle_grad.cc: gradient reduction, views and masks; handle_summon.cc:
// parameter views and summoning) share besides handle.h.
//
// Thread-safety: as FlatParamHandle (one thread per handle); the testing
// switches are atomics.
#ifndef FLATPARAM_INTERNAL_HANDLE_INTERNAL_H_
#define FLATPARAM_INTERNAL_HANDLE_INTERNAL_H_

#include <cassert>

#include "flatparam/device/device.h"
#include "flatparam/internal/handle_test_hooks.h"

namespace flatparam {
namespace internal_handle {

// Whether a test switched `which` ordering off (handle_test_hooks.h).
inline bool Skipped(SkippedOrdering which) {
  return IsSkippedForTesting(which);
}

// Makes `stream` current for the scope, restoring the previous one.
class OnStream {
 public:
  OnStream(DeviceOps* device, Stream stream)
      : device_(device), previous_(device->current_stream()) {
    const absl::Status set = device_->SetStream(stream);
    assert(set.ok());
    (void)set;
  }
  ~OnStream() { (void)device_->SetStream(previous_); }
  OnStream(const OnStream&) = delete;
  OnStream& operator=(const OnStream&) = delete;

 private:
  DeviceOps* device_;
  Stream previous_;
};

}  // namespace internal_handle
}  // namespace flatparam

#endif  // FLATPARAM_INTERNAL_HANDLE_INTERNAL_H_
