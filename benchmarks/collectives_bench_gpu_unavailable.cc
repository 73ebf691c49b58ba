// MakeGpuContext() in a build without NCCL.
#include "absl/strings/str_format.h"
#include "benchmarks/collectives_bench_gpu.h"

namespace flatparam {
namespace bench {

absl::StatusOr<GpuContext> MakeGpuContext(Communicator& bootstrap, int device) {
  return absl::UnimplementedError(absl::StrFormat(
      "rank %d: --backend=nccl on cuda:%d: this build has no NCCL backend "
      "(no CUDA installation with nccl.h was found when it was configured)",
      bootstrap.rank(), device));
}

}  // namespace bench
}  // namespace flatparam
