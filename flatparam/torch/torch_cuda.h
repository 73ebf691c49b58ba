// LibTorch's CUDA machinery as flatparam's DeviceOps: a CudaDeviceOps whose
// stream 0 is LibTorch's current stream on a device and whose device memory
// comes from LibTorch's caching allocator.
//
//   FLATPARAM_ASSIGN_OR_RETURN(std::unique_ptr<TorchCudaDeviceOps> cuda,
//                              TorchCudaDeviceOps::Create(/*device_index=*/0));
//   // FSDP of a module on cuda:0 (flatparam/torch/fsdp_module.h):
//   model->to(torch::Device(torch::kCUDA, 0));
//   FLATPARAM_ASSIGN_OR_RETURN(auto fsdp,
//                              FsdpModule::Wrap(model, &nccl, cuda.get()));
//   // Or flatparam's operations directly:
//   DeviceOps& ops = cuda->ops();
//   FLATPARAM_ASSIGN_OR_RETURN(DeviceBuffer flat,
//                              ops.Allocate(ops.device(), 1 << 20));
//   // A LibTorch kernel on the current stream sees what ops wrote on
//   // stream 0 without a host synchronization:
//   torch::Tensor t = torch::from_blob(flat.data(), {1 << 18},
//                                      torch::dtype(torch::kFloat32)
//                                          .device(torch::kCUDA, 0));
//
// Why LibTorch's allocator and not CudaDeviceOps' own pool
// (cudaMallocAsync): a process with two caching pools fragments the GPU,
// since memory one pool holds free the other cannot hand out, and LibTorch's
// model, activations and optimizer already live in the caching allocator,
// as PyTorch's own FSDP's flat parameters do. Through it, flatparam's
// buffers count in LibTorch's memory statistics and are released by its
// emptyCache. The stream discipline stays CudaDeviceOps': a block belongs to
// the stream it was allocated on (the caching allocator's rule too), and
// CudaDeviceOps frees it on that stream only after that stream has waited
// for every stream recorded with RecordStream, so the allocator never needs
// LibTorch's recordStream.
//
// Stream 0 is LibTorch's current stream when Create ran. LibTorch's
// default, CUDA's legacy default stream, which LibTorch names by the null
// handle, is cudaStreamLegacy here (a null stream would ask CudaDeviceOps
// for a stream of its own, unordered with LibTorch's kernels). LibTorch kernels
// issued on another stream (inside a c10::cuda::CUDAStreamGuard) would be
// unordered with flatparam's work: CheckCurrentStream() says so.
//
// Where it builds: against LibTorch's c10/cuda and ATen/cuda headers and a
// CUDA installation's (@system_libtorch//:defs.bzl's CUDA_HEADERS_AVAILABLE);
// it links only against a LibTorch with CUDA (libc10_cuda.so). Debian's
// LibTorch is CPU-only, so in CI it is compiled, not run.
//
// Ownership: a TorchCudaDeviceOps owns its CudaDeviceOps and the allocator
// adapter that outlives it; LibTorch's streams are never destroyed. Thread
// safety: as CudaDeviceOps (one thread at a time).
#ifndef FLATPARAM_TORCH_TORCH_CUDA_H_
#define FLATPARAM_TORCH_TORCH_CUDA_H_

#include <c10/core/Device.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "flatparam/device/cuda/cuda_device_ops.h"
#include "flatparam/torch/torch_device.h"

namespace flatparam {

// CudaAllocator over LibTorch's caching allocator
// (c10::cuda::CUDACachingAllocator::raw_alloc_with_stream / raw_delete).
class TorchCachingAllocator final : public CudaAllocator {
 public:
  // ResourceExhausted with LibTorch's message when the device is out of
  // memory; Internal for any other LibTorch error. Zero bytes: nullptr.
  absl::StatusOr<void*> Allocate(int64_t bytes, cudaStream_t stream) override;
  void Free(void* p, cudaStream_t stream) override;
};

class TorchCudaDeviceOps final : public TorchDevice {
 public:
  // CudaDeviceOps on CUDA device `device_index`, on LibTorch's current
  // stream there, allocating through LibTorch's caching allocator.
  // InvalidArgument for a device index LibTorch does not have (naming how
  // many it has); Unavailable when LibTorch sees no CUDA device.
  static absl::StatusOr<std::unique_ptr<TorchCudaDeviceOps>> Create(
      int device_index);

  // TorchDevice (torch_device.h): FsdpModule::Wrap(module, world, this).
  CudaDeviceOps& ops() override { return *ops_; }
  c10::Device torch_device() const override {
    return c10::Device(c10::kCUDA,
                       static_cast<c10::DeviceIndex>(device_index_));
  }
  // LibTorch's kernels are queued on stream 0 behind flatparam's work.
  absl::Status HandToTorch() override { return absl::OkStatus(); }

  int device_index() const { return device_index_; }
  // Stream 0 of ops(): LibTorch's current stream when Create ran, as CUDA
  // names it (cudaStreamLegacy for LibTorch's default stream).
  cudaStream_t stream() const { return stream_; }

  // FailedPrecondition, naming both streams, when LibTorch's current stream
  // on the device is no longer stream(): its kernels would not be ordered
  // with the ops' work.
  absl::Status CheckCurrentStream() const override;

 private:
  TorchCudaDeviceOps(int device_index, cudaStream_t stream)
      : device_index_(device_index), stream_(stream) {}

  int device_index_;
  cudaStream_t stream_;
  // Declared before ops_, so that it outlives the ops that borrow it.
  TorchCachingAllocator allocator_;
  std::unique_ptr<CudaDeviceOps> ops_;
};

}  // namespace flatparam

#endif  // FLATPARAM_TORCH_TORCH_CUDA_H_
