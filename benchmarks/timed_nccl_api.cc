// TimedNcclApi's events; the forwarding calls are in the header.
#include "benchmarks/timed_nccl_api.h"

#include "absl/strings/str_cat.h"

namespace flatparam {
namespace bench {

TimedNcclApi::~TimedNcclApi() {
  if (start_ != nullptr) cuda_.EventDestroy(start_);
  if (stop_ != nullptr) cuda_.EventDestroy(stop_);
}

absl::Status TimedNcclApi::Arm(int device) {
  if (armed_) {
    return absl::FailedPreconditionError(
        "TimedNcclApi::Arm: the previous Arm() was not followed by a "
        "collective");
  }
  if (device_ != device) {
    if (device_ >= 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("TimedNcclApi::Arm: events were created on device ",
                       device_, ", not ", device));
    }
    CudaDeviceGuard guard(cuda_);
    absl::Status st = guard.Set(device, "TimedNcclApi::Arm");
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

absl::StatusOr<double> TimedNcclApi::ElapsedSeconds() {
  if (!record_status_.ok()) return record_status_;
  if (!recorded_) {
    return absl::FailedPreconditionError(
        "TimedNcclApi::ElapsedSeconds: no armed collective was issued");
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

TimedNcclApi::Bracket::Bracket(TimedNcclApi& api, cudaStream_t stream)
    : api_(api), stream_(stream), active_(api.armed_) {
  if (!active_) return;
  api_.armed_ = false;
  api_.record_status_ =
      CudaStatus(api_.cuda_, api_.cuda_.EventRecord(api_.start_, stream_),
                 "cudaEventRecord (start)");
}

TimedNcclApi::Bracket::~Bracket() {
  if (!active_) return;
  if (api_.record_status_.ok()) {
    api_.record_status_ =
        CudaStatus(api_.cuda_, api_.cuda_.EventRecord(api_.stop_, stream_),
                   "cudaEventRecord (stop)");
  }
  api_.recorded_ = true;
}

}  // namespace bench
}  // namespace flatparam
