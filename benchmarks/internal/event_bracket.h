// EventBracket: the two CUDA events that the benchmarks' timing wrappers
// (TimedNcclApi around an NCCL collective, TimedCudaRuntime around a
// cudaMemcpyAsync) record on a call's stream immediately before and after
// the one call they were armed for, and the elapsed time between them.
//
//   EventBracket bracket(cuda, "TimedCudaRuntime", "cudaMemcpyAsync");
//   RETURN_IF_ERROR(bracket.Arm(device));
//   ...in the wrapper, around the call on `stream`:
//   if (bracket.armed()) { bracket.Begin(stream); call(); bracket.End(stream);
//   }
//   ...
//   ASSIGN_OR_RETURN(double seconds, bracket.ElapsedSeconds());
//
// Memory: owns its two events (made through `cuda` by the first Arm, on
// the armed device; destroyed with the object); `cuda` must outlive it.
// ElapsedSeconds reads the events with libcudart's cudaEventElapsedTime
// (CudaRuntime has no timing call): `cuda` must be the real runtime there.
//
// Thread-safety: none; one thread arms, calls and reads.
#ifndef FLATPARAM_BENCHMARKS_INTERNAL_EVENT_BRACKET_H_
#define FLATPARAM_BENCHMARKS_INTERNAL_EVENT_BRACKET_H_

#include <cuda_runtime_api.h>

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "flatparam/device/cuda/cuda_runtime.h"

namespace flatparam {
namespace bench {

class EventBracket {
 public:
  // `owner` and `call` name the wrapper and what it brackets in messages.
  EventBracket(CudaRuntime& cuda, absl::string_view owner,
               absl::string_view call)
      : cuda_(cuda), owner_(owner), call_(call) {}
  ~EventBracket();

  EventBracket(const EventBracket&) = delete;
  EventBracket& operator=(const EventBracket&) = delete;

  // Brackets the next call. `device`: the CUDA device of its stream (the
  // events are made there once). FailedPrecondition if a call is still
  // armed, or if the events were made on another device.
  absl::Status Arm(int device);
  bool armed() const { return armed_; }

  // Around the armed call: Begin records the start event on `stream` and
  // disarms; End records the stop event there unless recording already
  // failed. Errors are kept for ElapsedSeconds, not returned: the call
  // itself goes ahead and reports its own.
  void Begin(cudaStream_t stream);
  void End(cudaStream_t stream);
  // Between Begin and End: the call's enqueue could not be confirmed;
  // ElapsedSeconds returns `status` and End records nothing.
  void Fail(absl::Status status);

  // Seconds between the events of the last armed call, waiting for the
  // stop event (cudaEventSynchronize). FailedPrecondition if no armed call
  // was made since Arm(); the recording's error if it failed.
  absl::StatusOr<double> ElapsedSeconds();

 private:
  CudaRuntime& cuda_;
  const std::string owner_;
  const std::string call_;
  int device_ = -1;  // Where the events were made; -1 before the first Arm.
  cudaEvent_t start_ = nullptr;
  cudaEvent_t stop_ = nullptr;
  bool armed_ = false;
  bool recorded_ = false;
  absl::Status record_status_;
};

}  // namespace bench
}  // namespace flatparam

#endif  // FLATPARAM_BENCHMARKS_INTERNAL_EVENT_BRACKET_H_
