// NcclCommunicator: the Communicator (comm/communicator.h) of one rank of an
// NCCL communicator, running collectives on CUDA device buffers of one
// device. Most code creates it through CreateNcclCommunicator()
// (nccl_backend.h); this header is for code that has CUDA headers and wants
// to wrap an existing `ncclComm_t`, choose the CUDA stream, or inject the
// NCCL and CUDA runtime calls (NcclApi and CudaRuntime; tests use
// FakeNcclApi and its cuda(), or FakeNcclOnCuda on a FakeCudaRuntime).
//
// Collectives. Each maps to one NCCL call on stream(); counts below are
// elements, `n` is size(), `r` is rank():
//   AllGather(in, out)      ncclAllGather(in, out, sendcount = in.count).
//                           out holds n * in.count elements; rank i's input
//                           lands at out + i * in.count. In place when
//                           in.data == out.data + r * in.count.
//   ReduceScatter(in, out)  ncclReduceScatter(in, out, recvcount = out.count).
//                           in holds n * out.count elements; rank i receives
//                           the reduction of block i ([i * out.count,
//                           (i + 1) * out.count)) over all ranks. In place
//                           when out.data == in.data + r * out.count.
//   AllReduce(in, out)      ncclAllReduce(in, out, count). In place when
//                           in.data == out.data.
//   Broadcast(buf, root)    ncclBroadcast(buf, buf, count, root): always in
//                           place; `root` is a rank, not a device.
//   Barrier()               a one-element ncclAllReduce on a scratch buffer,
//                           waited on.
//   AllGatherBytes(s)       two ncclAllGathers (the lengths as ncclInt64, then
//                           the bytes padded to the longest as ncclUint8)
//                           through temporary device buffers; blocking.
//   Split(color, key)       ncclCommSplit(color or NCCL_SPLIT_NOCOLOR when
//                           negative, key); the child shares this stream.
// Buffers that are not in place must not overlap (InvalidArgument). A
// collective with zero elements calls no NCCL function and succeeds.
//
// Dtypes: float32, float64, float16, bfloat16 -> ncclFloat32, ncclFloat64,
// ncclFloat16, ncclBfloat16. Reductions: kSum -> ncclSum, kAvg -> ncclAvg,
// kMax -> ncclMax, kMin -> ncclMin.
//
// Divide factors (ReduceOptions::pre_divide_factor / post_divide_factor)
// use a pre-multiplied sum instead of extra kernels: sum and average are
// linear, so post(avg(sum_i pre(x_i))) = sum_i x_i * s with
//   s = 1 / (pre * post)        for kSum,
//   s = 1 / (pre * post * n)    for kAvg,
// created per call with ncclRedOpCreatePreMulSum(&op, &s, dtype,
// ncclScalarHostImmediate, comm) and destroyed once the collective is
// enqueued. `s` is rounded once to the buffer's dtype (as a PyTorch cast
// would: through float32 for float16/bfloat16), and NCCL multiplies each
// input by it before summing, so results differ in the last bits from the
// host reference (comm/host_reduce.h), which divides by `pre` before and by
// `post` after the fold, rounding at each step. Scaling before the sum keeps
// FSDP's purpose of the pre-divide: partial sums stay small. A factor
// product whose reciprocal rounds to zero or infinity in the dtype is
// InvalidArgument.
//
// Ordering and completion. Collectives are enqueued on stream() in call
// order; NCCL reads the inputs when the collective runs on that stream, so
// work that produces them on another stream must be ordered before it:
// with CollectiveOptions::stream (a CUDA stream of this device: an event is
// recorded there and stream() waits for it, cudaStreamWaitEvent, before the
// collective is enqueued -- c10d's NCCL stream waiting for the current
// stream), or by the caller (a host synchronization). The returned Work
// records a CUDA event after the collective; Work::WaitStream(s) makes
// stream `s` wait for that event (no host wait: c10d's `work.wait()`), and
// Work::Wait() blocks the host until it has completed, polling
// cudaEventQuery and ncclCommGetAsyncError -- the only place a timeout or
// an asynchronous error is seen, so call it before trusting the results.
// A collective's timeout runs from the call that issued it. Work may
// outlive the communicator: the NCCL communicator is released when the
// last of them is gone.
//
// Failure. When a collective does not finish within its timeout, or NCCL
// reports an asynchronous error (ncclCommGetAsyncError: a peer or the
// network failed), or CUDA reports a failure, the communicator is aborted
// with ncclCommAbort (as c10d's watchdog does), this Wait() returns
// DeadlineExceeded / the mapped NCCL error / the mapped CUDA error, and every
// later call, and every Wait() not finished yet, returns Aborted quoting the
// first error. Errors name the rank, the op, its sequence number in this
// communicator and the buffer sizes; NCCL and CUDA codes are mapped by
// NcclStatus() (nccl_api.h) and CudaStatus() (cuda_runtime.h). Host buffers are
// Unimplemented; buffers on another device are InvalidArgument.
//
// Memory: buffers belong to the caller and must stay alive and untouched
// until their Work has been waited on. After a Wait that failed (the
// communicator aborted), NCCL's kernels leave stream() only once they see
// the abort: wait for stream() to drain (cudaStreamQuery says cudaSuccess;
// bound the wait) before freeing or reusing the buffers of the collectives
// that were in flight. The communicator owns its stream
// (unless one was passed in), its events and scratch buffers, and the
// `ncclComm_t` unless it was wrapped with Ownership::kBorrow.
//
// Thread-safety: one thread at a time, like the NCCL communicator itself
// (Communicator's contract). Each call makes the communicator's device
// current for its duration and restores the caller's device.
#ifndef FLATPARAM_COMM_NCCL_NCCL_COMMUNICATOR_H_
#define FLATPARAM_COMM_NCCL_NCCL_COMMUNICATOR_H_

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "comm/communicator.h"
#include "comm/flight_recorder.h"
#include "comm/nccl/nccl_api.h"
#include "comm/nccl/nccl_options.h"
#include "flatparam/device/cuda/cuda_runtime.h"

namespace flatparam {
namespace internal_nccl {
struct CommState;
struct StreamHandle;
}  // namespace internal_nccl

class NcclCommunicator final : public Communicator {
 public:
  enum class Ownership {
    // The communicator finalizes and destroys the ncclComm_t when it (and
    // every Work it issued) is gone.
    kTakeOwnership,
    // The caller keeps the ncclComm_t and destroys it after this
    // communicator and its Work are gone. A timeout or asynchronous error
    // still aborts it (ncclCommAbort frees it): check aborted() before using
    // the handle again.
    kBorrow,
  };

  // Collective over `bootstrap`; see CreateNcclCommunicator(). `stream`:
  // the CUDA stream of `cuda_device` to enqueue on, or null for a new
  // non-blocking stream owned by the communicator. `api` and `cuda` (the
  // NCCL and CUDA runtime calls: RealNcclApi() and RealCudaRuntime() outside
  // tests) must outlive the result.
  static absl::StatusOr<std::unique_ptr<NcclCommunicator>> Create(
      NcclApi& api, CudaRuntime& cuda, Communicator& bootstrap, int cuda_device,
      const NcclOptions& options = {}, cudaStream_t stream = nullptr);

  // Wraps an initialized `comm` (its rank, size and device come from
  // ncclCommUserRank, ncclCommCount and ncclCommCuDevice). `stream` as for
  // Create(). Only `options.check_pointers` and `options.setup_timeout` (for
  // finalizing an owned comm) apply.
  static absl::StatusOr<std::unique_ptr<NcclCommunicator>> Wrap(
      NcclApi& api, CudaRuntime& cuda, ncclComm_t comm, Ownership ownership,
      const NcclOptions& options = {}, cudaStream_t stream = nullptr);

  // Finalizes (ncclCommFinalize, then polling ncclCommGetAsyncError for at
  // most options.setup_timeout) and destroys an owned, unaborted
  // communicator, aborting it instead if finalizing fails; once every
  // outstanding Work is gone too.
  ~NcclCommunicator() override;

  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const override;
  int size() const override;
  absl::string_view backend() const override { return "nccl"; }
  // True for this communicator's CUDA device: collectives take
  // CollectiveOptions::stream and their Work takes WaitStream (see
  // "Ordering and completion").
  bool SupportsStreams(Device device) const override;

  std::unique_ptr<Work> AllGather(ConstBufferRef input, BufferRef output,
                                  const CollectiveOptions& options) override;
  std::unique_ptr<Work> ReduceScatter(ConstBufferRef input, BufferRef output,
                                      const ReduceOptions& options) override;
  std::unique_ptr<Work> AllReduce(ConstBufferRef input, BufferRef output,
                                  const ReduceOptions& options) override;
  std::unique_ptr<Work> Broadcast(BufferRef buffer,
                                  const BroadcastOptions& options) override;
  absl::StatusOr<std::vector<std::string>> AllGatherBytes(
      absl::string_view bytes, const CollectiveOptions& options) override;
  absl::Status Barrier(const CollectiveOptions& options) override;
  // Returns an NcclCommunicator (or null for a negative color) on the same
  // device and stream, owning its new ncclComm_t.
  absl::StatusOr<std::unique_ptr<Communicator>> Split(
      int color, int key, const CollectiveOptions& options) override;

  // The CUDA device ordinal all buffers must live on.
  int device() const;
  // The stream collectives are enqueued on.
  cudaStream_t stream() const;
  // The NCCL communicator; null once aborted.
  ncclComm_t comm() const;
  // Whether the communicator has been aborted, and the error that caused
  // it (OK while not aborted).
  bool aborted() const;
  absl::Status abort_status() const;
  // Aborts the communicator (ncclCommAbort) with `reason`, e.g. when another
  // group failed; idempotent. Later calls return Aborted quoting `reason`,
  // and destruction does not finalize (Communicator::Abort).
  void Abort(absl::Status reason) override;
  // The rank's recorder: every collective is recorded when issued and
  // finished when its Wait() returns (the device's start is not seen).
  FlightRecorder* flight_recorder() const override { return recorder_.get(); }

 private:
  NcclCommunicator(std::shared_ptr<internal_nccl::CommState> state);

  // The collectives themselves; the public ones record them.
  std::unique_ptr<Work> AllGatherImpl(ConstBufferRef input, BufferRef output,
                                      const CollectiveOptions& options);
  std::unique_ptr<Work> ReduceScatterImpl(ConstBufferRef input,
                                          BufferRef output,
                                          const ReduceOptions& options);
  std::unique_ptr<Work> AllReduceImpl(ConstBufferRef input, BufferRef output,
                                      const ReduceOptions& options);
  std::unique_ptr<Work> BroadcastImpl(BufferRef buffer,
                                      const BroadcastOptions& options);
  uint64_t Record(CollectiveOp op, DType dtype, int64_t count, int64_t bytes);

  static absl::StatusOr<std::unique_ptr<NcclCommunicator>> FromComm(
      NcclApi& api, CudaRuntime& cuda, ncclComm_t comm, bool owned,
      const NcclOptions& options,
      std::shared_ptr<internal_nccl::StreamHandle> stream,
      cudaStream_t user_stream);

  std::shared_ptr<internal_nccl::CommState> state_;
  // Sequence number of the next operation, for error messages.
  int64_t seq_ = 0;
  // The rank's flight recorder (the world's, shared by its splits) and
  // this group's name in it; null when recording is off.
  std::shared_ptr<FlightRecorder> recorder_;
  std::shared_ptr<const FlightGroup> group_;
};

}  // namespace flatparam

#endif  // FLATPARAM_COMM_NCCL_NCCL_COMMUNICATOR_H_
