#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "flatparam/base/dtype.h"
#include "flatparam/device/cuda/fake_cuda_runtime.h"
#include "flatparam/device/cuda/fake_cuda_runtime_internal.h"

// FakeCudaRuntime's kernel launches: cuda_kernels.cu's arithmetic as host
// loops, enqueued on a stream like any operation (Launch), working through
// the device memory's read-write view (HostAlias).
// fake_cuda_runtime_internal.h lists the other files.

namespace flatparam {

using internal_cuda::KernelDType;

namespace {

DType ToDType(KernelDType d) {
  switch (d) {
    case KernelDType::kFloat64:
      return DType::kFloat64;
    case KernelDType::kFloat16:
      return DType::kFloat16;
    case KernelDType::kBFloat16:
      return DType::kBFloat16;
    case KernelDType::kFloat32:
      break;
  }
  return DType::kFloat32;
}

bool ValidKernelDType(KernelDType d) {
  const int v = static_cast<int>(d);
  return v >= 0 && v <= 3;
}

// A value in the dtype's compute type (float32, or float64 for float64),
// as cuda_kernels.cu's Elem<T>::Load gives it.
double Compute(DType dtype, double v) {
  return dtype == DType::kFloat64 ? v
                                  : static_cast<double>(static_cast<float>(v));
}

}  // namespace

cudaError_t FakeCudaRuntime::Launch(absl::string_view what, cudaStream_t stream,
                                    std::vector<Touch> touches,
                                    std::function<void()> run) {
  cudaError_t launch = cudaSuccess;
  {
    absl::MutexLock lock(&mu_);
    launch = Precheck(what);
    if (launch == cudaSuccess) {
      StreamState* s = FindStream(stream);
      if (s == nullptr) {
        launch = cudaErrorInvalidResourceHandle;
      } else if (s->device != CurrentDevice()) {
        // CUDA: "a kernel launch will fail if it is issued to a stream that
        // is not associated to the current device".
        misuse_.push_back(absl::StrFormat(
            "%s launched into a stream of cuda:%d while cuda:%d is current",
            what, s->device, CurrentDevice()));
        launch = cudaErrorInvalidResourceHandle;
      } else {
        Op op;
        op.what = std::string(what);
        op.run = std::move(run);
        op.touches = std::move(touches);
        op.kernel = true;
        Enqueue(s, std::move(op));
      }
    }
  }
  Result(launch);
  // A launch reports what cudaGetLastError() says after it.
  return GetLastError();
}

// ---- Kernels: cuda_kernels.cu's arithmetic as host loops ----

cudaError_t FakeCudaRuntime::LaunchFill(void* dst, int element_bytes,
                                        uint64_t pattern, int64_t count,
                                        cudaStream_t stream) {
  if (element_bytes != 2 && element_bytes != 4 && element_bytes != 8) {
    Result(cudaErrorInvalidValue);
    return GetLastError();
  }
  const size_t bytes = static_cast<size_t>(count) * element_bytes;
  return Launch("fill kernel", stream, {{dst, bytes}},
                [this, dst, element_bytes, pattern, count] {
                  char* p = static_cast<char*>(HostAlias(dst));
                  for (int64_t i = 0; i < count; ++i) {
                    std::memcpy(p + i * element_bytes, &pattern,
                                static_cast<size_t>(element_bytes));
                  }
                });
}

cudaError_t FakeCudaRuntime::LaunchCast(void* dst, KernelDType dst_dtype,
                                        const void* src, KernelDType src_dtype,
                                        int64_t count, cudaStream_t stream) {
  if (!ValidKernelDType(dst_dtype) || !ValidKernelDType(src_dtype)) {
    Result(cudaErrorInvalidValue);
    return GetLastError();
  }
  const DType d = ToDType(dst_dtype);
  const DType s = ToDType(src_dtype);
  return Launch("cast kernel", stream,
                {{dst, count * DTypeSize(d)}, {src, count * DTypeSize(s)}},
                [this, dst_device = dst, d, src_device = src, s, count] {
                  void* dst = HostAlias(dst_device);
                  const void* src = HostAlias(src_device);
                  for (int64_t i = 0; i < count; ++i) {
                    double v = LoadAsDouble(src, s, static_cast<size_t>(i));
                    // float64 reaches the 16-bit types through float32 (c10).
                    if (s == DType::kFloat64 && d != DType::kFloat32) {
                      v = static_cast<double>(static_cast<float>(v));
                    }
                    StoreFromDouble(dst, d, static_cast<size_t>(i), v);
                  }
                });
}

cudaError_t FakeCudaRuntime::LaunchMultiply(void* buf, KernelDType dtype,
                                            double scalar, int64_t count,
                                            cudaStream_t stream) {
  if (!ValidKernelDType(dtype)) {
    Result(cudaErrorInvalidValue);
    return GetLastError();
  }
  const DType d = ToDType(dtype);
  const double k = Compute(d, scalar);
  return Launch("multiply kernel", stream, {{buf, count * DTypeSize(d)}},
                [this, buf_device = buf, d, k, count] {
                  void* buf = HostAlias(buf_device);
                  for (int64_t i = 0; i < count; ++i) {
                    const size_t j = static_cast<size_t>(i);
                    const double v = LoadAsDouble(buf, d, j);
                    StoreFromDouble(
                        buf, d, j,
                        d == DType::kFloat64
                            ? v * k
                            : static_cast<double>(static_cast<float>(v) *
                                                  static_cast<float>(k)));
                  }
                });
}

cudaError_t FakeCudaRuntime::LaunchAdd(void* acc, const void* x,
                                       KernelDType dtype, int64_t count,
                                       cudaStream_t stream) {
  if (!ValidKernelDType(dtype)) {
    Result(cudaErrorInvalidValue);
    return GetLastError();
  }
  const DType d = ToDType(dtype);
  const size_t bytes = count * DTypeSize(d);
  return Launch("add kernel", stream, {{acc, bytes}, {x, bytes}},
                [this, acc_device = acc, x_device = x, d, count] {
                  void* acc = HostAlias(acc_device);
                  const void* x = HostAlias(x_device);
                  for (int64_t i = 0; i < count; ++i) {
                    const size_t j = static_cast<size_t>(i);
                    const double a = LoadAsDouble(acc, d, j);
                    const double b = LoadAsDouble(x, d, j);
                    StoreFromDouble(
                        acc, d, j,
                        d == DType::kFloat64
                            ? a + b
                            : static_cast<double>(static_cast<float>(a) +
                                                  static_cast<float>(b)));
                  }
                });
}

cudaError_t FakeCudaRuntime::LaunchWaitFlag(const volatile uint32_t* flag,
                                            cudaStream_t stream) {
  {
    absl::MutexLock lock(&mu_);
    if (!IsPinned(const_cast<const uint32_t*>(flag))) {
      misuse_.push_back(absl::StrFormat(
          "wait-flag kernel: %p is not cudaMallocHost memory, which a kernel "
          "cannot read",
          static_cast<const void*>(const_cast<const uint32_t*>(flag))));
      Result(cudaErrorInvalidValue);
      return GetLastError();
    }
  }
  return Launch("wait-flag kernel", stream, {}, [this, flag] {
    const uint32_t* f = const_cast<const uint32_t*>(flag);
    while (__atomic_load_n(f, __ATOMIC_ACQUIRE) == 0) {
      {
        absl::MutexLock lock(&mu_);
        if (shutting_down_) return;
      }
      absl::SleepFor(absl::Microseconds(100));
    }
  });
}

}  // namespace flatparam
