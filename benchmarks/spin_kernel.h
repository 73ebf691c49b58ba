// Synthetic compute on a CUDA stream, for benchmarks: a kernel that keeps
// the stream busy for a given time of the GPU's global timer, as a layer's
// real kernels would, so that a step's compute has a known duration while
// the host runs ahead of it (as with real kernels) and collectives on other
// streams may overlap it.
//
// One thread block of one thread: it occupies one SM, not the GPU, so
// collective kernels are never starved of SMs as they could be by a real
// layer. Thread-safety: as any kernel launch.
#ifndef FLATPARAM_BENCHMARKS_SPIN_KERNEL_H_
#define FLATPARAM_BENCHMARKS_SPIN_KERNEL_H_

#include <cuda_runtime_api.h>

#include <cstdint>

namespace flatparam {
namespace bench {

// Enqueues on `stream` a kernel that spins for `nanoseconds` of the global
// timer; returns cudaGetLastError() after the launch.
cudaError_t LaunchSpinKernel(cudaStream_t stream, int64_t nanoseconds);

}  // namespace bench
}  // namespace flatparam

#endif  // FLATPARAM_BENCHMARKS_SPIN_KERNEL_H_
