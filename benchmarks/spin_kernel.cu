// By bare name: nvcc_library compiles without the workspace on the path.
#include "spin_kernel.h"

namespace flatparam {
namespace bench {
namespace {

__device__ unsigned long long GlobalTimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void Spin(unsigned long long nanoseconds) {
  const unsigned long long start = GlobalTimer();
  while (GlobalTimer() - start < nanoseconds) {
  }
}

}  // namespace

cudaError_t LaunchSpinKernel(cudaStream_t stream, int64_t nanoseconds) {
  (void)cudaGetLastError();  // a clean state: the result is this launch's
  Spin<<<1, 1, 0, stream>>>(
      static_cast<unsigned long long>(nanoseconds > 0 ? nanoseconds : 0));
  return cudaGetLastError();
}

}  // namespace bench
}  // namespace flatparam
