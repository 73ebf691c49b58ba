// gpu_bench in a build without CUDA and NCCL: says so and exits 1.
#include <cstdio>

int main() {
  std::fprintf(stderr,
               "gpu_bench: built without CUDA/NCCL (no CUDA installation was "
               "found when the build was configured); see README.md\n");
  return 1;
}
