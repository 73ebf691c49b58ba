// OnStream: makes a DeviceOps stream current for a scope and restores the
// previous one when the scope ends. Private to the flat-parameter runtime
// (the handle's implementation files and runtime_clip.cc).
//
//   OnStream on_compute(device, streams.compute);
//   FLATPARAM_RETURN_IF_ERROR(on_compute.status());
//
// Ownership: `device` must outlive it. Thread-safety: as the DeviceOps (one
// thread).
#ifndef FLATPARAM_INTERNAL_ON_STREAM_H_
#define FLATPARAM_INTERNAL_ON_STREAM_H_

#include "absl/status/status.h"
#include "flatparam/device/device.h"

namespace flatparam {
namespace internal_handle {

class OnStream {
 public:
  OnStream(DeviceOps* device, Stream stream)
      : device_(device), previous_(device->current_stream()) {
    status_ = device_->SetStream(stream);
  }
  ~OnStream() { (void)device_->SetStream(previous_); }
  OnStream(const OnStream&) = delete;
  OnStream& operator=(const OnStream&) = delete;

  // Whether `stream` was made current (SetStream's status).
  const absl::Status& status() const { return status_; }

 private:
  DeviceOps* device_;
  Stream previous_;
  absl::Status status_;
};

}  // namespace internal_handle
}  // namespace flatparam

#endif  // FLATPARAM_INTERNAL_ON_STREAM_H_
