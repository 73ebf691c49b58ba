// Element-wise reductions of host buffers with a fixed, documented order, so
// that every backend that reduces on the host (the simulator, MPI's user
// operations) gets bitwise-reproducible results.
//
// Arithmetic follows PyTorch's CPU kernels: float16 and bfloat16 values are
// computed in float32 and rounded back to their dtype after every operation;
// float32 in float32; float64 in float64. The reduction over ranks is a left
// fold in rank order: ((x0 + x1) + x2) + ...
//
// Thread-safety: pure functions on caller-owned memory.
#ifndef FLATPARAM_COMM_HOST_REDUCE_H_
#define FLATPARAM_COMM_HOST_REDUCE_H_

#include <cstdint>

#include "absl/types/span.h"
#include "comm/communicator.h"
#include "flatparam/base/dtype.h"

namespace flatparam {

// out[i] = post(avg(fold(op, pre(inputs[0][i]), pre(inputs[1][i]), ...)))
// where pre/post divide by the options' factors and avg divides by
// `group_size` when options.op is kAvg. `out` may alias inputs[0].
// REQUIRES: inputs non-empty, IsFloatingPoint(dtype).
void HostReduce(absl::Span<const void* const> inputs, void* out, int64_t count,
                DType dtype, const ReduceOptions& options, int group_size);

// Accumulates one more rank's contribution: acc[i] = op(acc[i], pre(x[i])),
// the step HostReduce folds with. With `first`, acc[i] = pre(x[i]).
void HostReduceStep(void* acc, const void* x, int64_t count, DType dtype,
                    const ReduceOptions& options, bool first);

// The final step: acc[i] = post(avg(acc[i])).
void HostReduceFinish(void* acc, int64_t count, DType dtype,
                      const ReduceOptions& options, int group_size);

}  // namespace flatparam

#endif  // FLATPARAM_COMM_HOST_REDUCE_H_
