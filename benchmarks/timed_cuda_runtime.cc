// TimedCudaRuntime's bracketed copy; the forwarding calls are in the header.
#include "benchmarks/timed_cuda_runtime.h"

namespace flatparam {
namespace bench {

cudaError_t TimedCudaRuntime::MemcpyAsync(void* dst, const void* src,
                                          size_t bytes, cudaMemcpyKind kind,
                                          cudaStream_t stream) {
  if (!bracket_.armed()) {
    return inner().MemcpyAsync(dst, src, bytes, kind, stream);
  }
  bracket_.Begin(stream);
  const cudaError_t result = inner().MemcpyAsync(dst, src, bytes, kind, stream);
  // Recorded even when the copy failed: the caller reports the copy's
  // error.
  bracket_.End(stream);
  return result;
}

}  // namespace bench
}  // namespace flatparam
