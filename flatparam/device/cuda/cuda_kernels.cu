// nvcc-compiled kernels for CudaDeviceOps; see cuda_kernels.h.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "cuda_kernels.h"

namespace flatparam {
namespace internal_cuda {
namespace {

constexpr int kThreads = 256;
// Enough blocks to fill any current GPU; kernels loop over the rest.
constexpr int64_t kMaxBlocks = 8192;

int Blocks(int64_t count) {
  const int64_t blocks = (count + kThreads - 1) / kThreads;
  return static_cast<int>(blocks < kMaxBlocks ? blocks : kMaxBlocks);
}

// Storage type <-> compute type, as c10::Half / c10::BFloat16 convert on
// CUDA (round to nearest, ties to even).
template <typename T>
struct Elem;
template <>
struct Elem<float> {
  using Compute = float;
  __device__ static float Load(float v) { return v; }
  __device__ static float Store(float v) { return v; }
};
template <>
struct Elem<double> {
  using Compute = double;
  __device__ static double Load(double v) { return v; }
  __device__ static double Store(double v) { return v; }
};
template <>
struct Elem<__half> {
  using Compute = float;
  __device__ static float Load(__half v) { return __half2float(v); }
  __device__ static __half Store(float v) { return __float2half_rn(v); }
};
template <>
struct Elem<__nv_bfloat16> {
  using Compute = float;
  __device__ static float Load(__nv_bfloat16 v) { return __bfloat162float(v); }
  __device__ static __nv_bfloat16 Store(float v) {
    return __float2bfloat16_rn(v);
  }
};

// static_cast<D>(S) with c10 semantics: 16-bit types convert through
// float32, and float64 reaches them through float32 too.
template <typename D, typename S>
__device__ D Convert(S v) {
  if constexpr (std::is_same<S, double>::value) {
    if constexpr (std::is_same<D, double>::value) {
      return v;
    } else {
      return Elem<D>::Store(static_cast<float>(v));
    }
  } else {
    const float f = Elem<S>::Load(v);
    if constexpr (std::is_same<D, double>::value) {
      return static_cast<double>(f);
    } else {
      return Elem<D>::Store(f);
    }
  }
}

template <typename T>
__global__ void FillKernel(T* dst, T value, int64_t count) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
       i < count; i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    dst[i] = value;
  }
}

template <typename D, typename S>
__global__ void CastKernel(D* dst, const S* src, int64_t count) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
       i < count; i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    dst[i] = Convert<D, S>(src[i]);
  }
}

template <typename T>
__global__ void MultiplyKernel(T* buf, typename Elem<T>::Compute scalar,
                               int64_t count) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
       i < count; i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    buf[i] = Elem<T>::Store(Elem<T>::Load(buf[i]) * scalar);
  }
}

template <typename T>
__global__ void AddKernel(T* acc, const T* x, int64_t count) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
       i < count; i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    acc[i] = Elem<T>::Store(Elem<T>::Load(acc[i]) + Elem<T>::Load(x[i]));
  }
}

template <typename S>
cudaError_t CastFrom(void* dst, KernelDType dst_dtype, const S* src,
                     int64_t count, cudaStream_t stream) {
  switch (dst_dtype) {
    case KernelDType::kFloat32:
      CastKernel<<<Blocks(count), kThreads, 0, stream>>>(
          static_cast<float*>(dst), src, count);
      break;
    case KernelDType::kFloat64:
      CastKernel<<<Blocks(count), kThreads, 0, stream>>>(
          static_cast<double*>(dst), src, count);
      break;
    case KernelDType::kFloat16:
      CastKernel<<<Blocks(count), kThreads, 0, stream>>>(
          static_cast<__half*>(dst), src, count);
      break;
    case KernelDType::kBFloat16:
      CastKernel<<<Blocks(count), kThreads, 0, stream>>>(
          static_cast<__nv_bfloat16*>(dst), src, count);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t Multiply(void* buf, double scalar, int64_t count,
                     cudaStream_t stream) {
  MultiplyKernel<<<Blocks(count), kThreads, 0, stream>>>(
      static_cast<T*>(buf), static_cast<typename Elem<T>::Compute>(scalar),
      count);
  return cudaGetLastError();
}

template <typename T>
cudaError_t Add(void* acc, const void* x, int64_t count, cudaStream_t stream) {
  AddKernel<<<Blocks(count), kThreads, 0, stream>>>(
      static_cast<T*>(acc), static_cast<const T*>(x), count);
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchFill(void* dst, int element_bytes, uint64_t pattern,
                       int64_t count, cudaStream_t stream) {
  switch (element_bytes) {
    case 2:
      FillKernel<<<Blocks(count), kThreads, 0, stream>>>(
          static_cast<uint16_t*>(dst), static_cast<uint16_t>(pattern), count);
      break;
    case 4:
      FillKernel<<<Blocks(count), kThreads, 0, stream>>>(
          static_cast<uint32_t*>(dst), static_cast<uint32_t>(pattern), count);
      break;
    case 8:
      FillKernel<<<Blocks(count), kThreads, 0, stream>>>(
          static_cast<uint64_t*>(dst), pattern, count);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

cudaError_t LaunchCast(void* dst, KernelDType dst_dtype, const void* src,
                       KernelDType src_dtype, int64_t count,
                       cudaStream_t stream) {
  switch (src_dtype) {
    case KernelDType::kFloat32:
      return CastFrom(dst, dst_dtype, static_cast<const float*>(src), count,
                      stream);
    case KernelDType::kFloat64:
      return CastFrom(dst, dst_dtype, static_cast<const double*>(src), count,
                      stream);
    case KernelDType::kFloat16:
      return CastFrom(dst, dst_dtype, static_cast<const __half*>(src), count,
                      stream);
    case KernelDType::kBFloat16:
      return CastFrom(dst, dst_dtype, static_cast<const __nv_bfloat16*>(src),
                      count, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t LaunchMultiply(void* buf, KernelDType dtype, double scalar,
                           int64_t count, cudaStream_t stream) {
  switch (dtype) {
    case KernelDType::kFloat32:
      return Multiply<float>(buf, scalar, count, stream);
    case KernelDType::kFloat64:
      return Multiply<double>(buf, scalar, count, stream);
    case KernelDType::kFloat16:
      return Multiply<__half>(buf, scalar, count, stream);
    case KernelDType::kBFloat16:
      return Multiply<__nv_bfloat16>(buf, scalar, count, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t LaunchAdd(void* acc, const void* x, KernelDType dtype,
                      int64_t count, cudaStream_t stream) {
  switch (dtype) {
    case KernelDType::kFloat32:
      return Add<float>(acc, x, count, stream);
    case KernelDType::kFloat64:
      return Add<double>(acc, x, count, stream);
    case KernelDType::kFloat16:
      return Add<__half>(acc, x, count, stream);
    case KernelDType::kBFloat16:
      return Add<__nv_bfloat16>(acc, x, count, stream);
  }
  return cudaErrorInvalidValue;
}

namespace {

__global__ void WaitFlagKernel(const volatile uint32_t* flag) {
  while (*flag == 0) {
#if __CUDA_ARCH__ >= 700
    __nanosleep(1000);
#endif
  }
}

}  // namespace

cudaError_t LaunchWaitFlag(const volatile uint32_t* flag, cudaStream_t stream) {
  WaitFlagKernel<<<1, 1, 0, stream>>>(flag);
  return cudaGetLastError();
}

}  // namespace internal_cuda
}  // namespace flatparam
