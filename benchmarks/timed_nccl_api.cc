// TimedNcclApi's events; the forwarding calls are in the header.
#include "benchmarks/timed_nccl_api.h"

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

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

ncclResult_t TimedNcclApi::Timed(cudaStream_t stream, ncclComm_t comm,
                                 absl::FunctionRef<ncclResult_t()> call) {
  if (!armed_) return call();
  armed_ = false;
  record_status_ = CudaStatus(cuda_, cuda_.EventRecord(start_, stream),
                              "cudaEventRecord (start)");
  const ncclResult_t result = call();
  if (result == ncclInProgress && record_status_.ok()) {
    const absl::Time deadline = absl::Now() + absl::Seconds(60);
    while (true) {
      ncclResult_t state = ncclSuccess;
      const ncclResult_t r = inner_.CommGetAsyncError(comm, &state);
      if (r != ncclSuccess) {
        record_status_ =
            NcclStatus(inner_, r, comm, "TimedNcclApi: ncclCommGetAsyncError");
        break;
      }
      // An asynchronous error is the communicator's to report; the
      // collective is as enqueued as it will be.
      if (state != ncclInProgress) break;
      if (absl::Now() > deadline) {
        record_status_ = absl::DeadlineExceededError(
            "TimedNcclApi: the collective was still being enqueued (NCCL "
            "ncclInProgress) after 60s");
        break;
      }
      absl::SleepFor(absl::Microseconds(20));
    }
  }
  if (record_status_.ok()) {
    record_status_ = CudaStatus(cuda_, cuda_.EventRecord(stop_, stream),
                                "cudaEventRecord (stop)");
  }
  recorded_ = true;
  return result;
}

}  // namespace bench
}  // namespace flatparam
