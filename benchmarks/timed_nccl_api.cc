// TimedNcclApi's bracketed collective; the forwarding calls are in the
// header.
#include "benchmarks/timed_nccl_api.h"

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace flatparam {
namespace bench {

ncclResult_t TimedNcclApi::Timed(cudaStream_t stream, ncclComm_t comm,
                                 absl::FunctionRef<ncclResult_t()> call) {
  if (!bracket_.armed()) return call();
  bracket_.Begin(stream);
  const ncclResult_t result = call();
  if (result == ncclInProgress) {
    const absl::Time deadline = absl::Now() + absl::Seconds(60);
    while (true) {
      ncclResult_t state = ncclSuccess;
      const ncclResult_t r = inner_.CommGetAsyncError(comm, &state);
      if (r != ncclSuccess) {
        bracket_.Fail(
            NcclStatus(inner_, r, comm, "TimedNcclApi: ncclCommGetAsyncError"));
        break;
      }
      // An asynchronous error is the communicator's to report; the
      // collective is as enqueued as it will be.
      if (state != ncclInProgress) break;
      if (absl::Now() > deadline) {
        bracket_.Fail(absl::DeadlineExceededError(
            "TimedNcclApi: the collective was still being enqueued (NCCL "
            "ncclInProgress) after 60s"));
        break;
      }
      absl::SleepFor(absl::Microseconds(20));
    }
  }
  bracket_.End(stream);
  return result;
}

}  // namespace bench
}  // namespace flatparam
