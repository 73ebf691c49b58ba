#include "benchmarks/internal/event_bracket.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace flatparam {
namespace bench {

EventBracket::~EventBracket() {
  if (start_ != nullptr) cuda_.EventDestroy(start_);
  if (stop_ != nullptr) cuda_.EventDestroy(stop_);
}

absl::Status EventBracket::Arm(int device) {
  if (armed_) {
    return absl::FailedPreconditionError(absl::StrCat(
        owner_, "::Arm: the previous Arm() was not followed by a ", call_));
  }
  if (device_ != device) {
    if (device_ >= 0) {
      return absl::FailedPreconditionError(
          absl::StrCat(owner_, "::Arm: events were created on device ", device_,
                       ", not ", device));
    }
    CudaDeviceGuard guard(cuda_);
    absl::Status st = guard.Set(device, absl::StrCat(owner_, "::Arm"));
    if (st.ok()) {
      st = CudaStatus(cuda_,
                      cuda_.EventCreateWithFlags(&start_, cudaEventDefault),
                      "cudaEventCreateWithFlags (start)");
    }
    if (st.ok()) {
      st = CudaStatus(cuda_,
                      cuda_.EventCreateWithFlags(&stop_, cudaEventDefault),
                      "cudaEventCreateWithFlags (stop)");
    }
    if (!st.ok()) return st;
    device_ = device;
  }
  armed_ = true;
  recorded_ = false;
  record_status_ = absl::OkStatus();
  return absl::OkStatus();
}

void EventBracket::Begin(cudaStream_t stream) {
  armed_ = false;
  record_status_ = CudaStatus(cuda_, cuda_.EventRecord(start_, stream),
                              "cudaEventRecord (start)");
}

void EventBracket::Fail(absl::Status status) {
  if (record_status_.ok()) record_status_ = std::move(status);
}

void EventBracket::End(cudaStream_t stream) {
  if (record_status_.ok()) {
    record_status_ = CudaStatus(cuda_, cuda_.EventRecord(stop_, stream),
                                "cudaEventRecord (stop)");
  }
  recorded_ = true;
}

absl::StatusOr<double> EventBracket::ElapsedSeconds() {
  if (!record_status_.ok()) return record_status_;
  if (!recorded_) {
    return absl::FailedPreconditionError(absl::StrCat(
        owner_, "::ElapsedSeconds: no armed ", call_, " was issued"));
  }
  absl::Status st = CudaStatus(cuda_, cuda_.EventSynchronize(stop_),
                               "cudaEventSynchronize (stop)");
  if (!st.ok()) return st;
  float ms = 0;
  st = CudaStatus(cuda_, cudaEventElapsedTime(&ms, start_, stop_),
                  "cudaEventElapsedTime");
  if (!st.ok()) return st;
  return ms * 1e-3;
}

}  // namespace bench
}  // namespace flatparam
