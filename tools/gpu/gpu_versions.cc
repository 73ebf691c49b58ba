// gpu_versions: prints the versions of NCCL, the CUDA runtime and the CUDA
// driver that this process loads, one `name: value` line each, for the GPU
// kit's run.sh (tools/gpu/run.sh) to report which libraries a run used:
//
//   nccl: 2.28.9 (code 22809)
//   cuda_runtime: 13.0
//   cuda_driver: 13.0        ("none (<error>)" without a driver)
//
// Exits 1 when NCCL or the CUDA runtime cannot report a version, or in a
// build without CUDA/NCCL (it then prints why).
#include <cstdio>

#ifdef FLATPARAM_HAVE_NCCL
#include <cuda_runtime_api.h>
#include <nccl.h>
#endif

int main() {
#ifndef FLATPARAM_HAVE_NCCL
  std::fprintf(stderr,
               "gpu_versions: built without CUDA/NCCL (no CUDA installation "
               "was found when the build was configured)\n");
  return 1;
#else
  int nccl = 0;
  const ncclResult_t nr = ncclGetVersion(&nccl);
  if (nr != ncclSuccess) {
    std::fprintf(stderr, "gpu_versions: ncclGetVersion: %s\n",
                 ncclGetErrorString(nr));
    return 1;
  }
  // NCCL >= 2.9 encodes major * 10000 + minor * 100 + patch.
  std::printf("nccl: %d.%d.%d (code %d)\n", nccl / 10000, (nccl / 100) % 100,
              nccl % 100, nccl);
  int runtime = 0;
  const cudaError_t re = cudaRuntimeGetVersion(&runtime);
  if (re != cudaSuccess) {
    std::fprintf(stderr, "gpu_versions: cudaRuntimeGetVersion: %s\n",
                 cudaGetErrorString(re));
    return 1;
  }
  std::printf("cuda_runtime: %d.%d\n", runtime / 1000, (runtime % 1000) / 10);
  int driver = 0;
  const cudaError_t de = cudaDriverGetVersion(&driver);
  if (de != cudaSuccess || driver == 0) {
    std::printf("cuda_driver: none (%s)\n",
                de != cudaSuccess ? cudaGetErrorString(de) : "no driver");
  } else {
    std::printf("cuda_driver: %d.%d\n", driver / 1000, (driver % 1000) / 10);
  }
  return 0;
#endif
}
