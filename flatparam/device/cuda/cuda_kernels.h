// The CUDA kernels behind CudaDeviceOps (private to flatparam/device/cuda).
// Compiled by nvcc (see BUILD.bazel); this header is plain C++ so that the
// host-compiled CudaDeviceOps can call the launchers.
//
// Every launcher enqueues one kernel on `stream`, returns at once, and
// reports the launch error (cudaSuccess otherwise). `count` > 0; pointers are
// device memory of the given element type. Arithmetic is PyTorch's CUDA
// arithmetic: see flatparam/device/device.h.
//
// Thread-safety: launchers are reentrant.
#ifndef FLATPARAM_DEVICE_CUDA_CUDA_KERNELS_H_
#define FLATPARAM_DEVICE_CUDA_CUDA_KERNELS_H_

#include <cuda_runtime_api.h>

#include <cstdint>

namespace flatparam {
namespace internal_cuda {

// The floating dtypes, numbered like nothing else: CudaDeviceOps maps
// flatparam::DType onto these.
enum class KernelDType : int {
  kFloat32 = 0,
  kFloat64 = 1,
  kFloat16 = 2,
  kBFloat16 = 3,
};

// dst[i] = the `element_bytes`-byte (2, 4 or 8) little-endian `pattern`.
cudaError_t LaunchFill(void* dst, int element_bytes, uint64_t pattern,
                       int64_t count, cudaStream_t stream);

// dst[i] = src[i] converted (round to nearest even; float64 to 16-bit
// types through float32, as c10's conversions do). Distinct dtypes.
cudaError_t LaunchCast(void* dst, KernelDType dst_dtype, const void* src,
                       KernelDType src_dtype, int64_t count,
                       cudaStream_t stream);

// buf[i] = buf[i] * scalar in the dtype's compute type (float32, or float64
// for float64), rounded back. The caller passes the scalar already in the
// compute type: the factor itself to multiply, its reciprocal (computed in
// the compute type) to divide, as PyTorch's CUDA `div_` by a scalar does.
cudaError_t LaunchMultiply(void* buf, KernelDType dtype, double scalar,
                           int64_t count, cudaStream_t stream);

// acc[i] = acc[i] + x[i] in the compute type, rounded back. `x` may equal
// `acc`.
cudaError_t LaunchAdd(void* acc, const void* x, KernelDType dtype,
                      int64_t count, cudaStream_t stream);

// One thread that spins until `*flag` is nonzero, rereading it about every
// microsecond. `flag` is cudaMallocHost memory, which kernels reach at the
// host's address (unified addressing): the host sets it to let the stream
// go on. A stream that does not finish until the host says so: tests use it
// for a collective whose peer never arrives. Not a count-sized kernel.
cudaError_t LaunchWaitFlag(const volatile uint32_t* flag, cudaStream_t stream);

}  // namespace internal_cuda
}  // namespace flatparam

#endif  // FLATPARAM_DEVICE_CUDA_CUDA_KERNELS_H_
