// The NCCL part of collectives_bench, behind a header without CUDA headers:
// collectives_bench_gpu.cc where the build found NCCL, else
// collectives_bench_gpu_unavailable.cc (Unimplemented).
//
// Thread-safety: one thread, like the communicator.
#ifndef FLATPARAM_BENCHMARKS_COLLECTIVES_BENCH_GPU_H_
#define FLATPARAM_BENCHMARKS_COLLECTIVES_BENCH_GPU_H_

#include <functional>
#include <memory>

#include "absl/status/statusor.h"
#include "comm/communicator.h"
#include "comm/conformance/device_memory.h"

namespace flatparam {
namespace bench {

// Times one collective: `issue` starts it and returns its Work.
using IssueFn = std::function<std::unique_ptr<Work>()>;

struct GpuContext {
  std::unique_ptr<Communicator> comm;
  std::unique_ptr<conformance::DeviceMemory> memory;
  // The seconds between CUDA events recorded on the communicator's stream
  // immediately before and after the NCCL call of the collective that
  // `issue` starts (not around `issue`, whose host-side checks would count);
  // waits for the collective (Work::Wait) and returns its error if it
  // failed.
  std::function<absl::StatusOr<double>(const IssueFn& issue)> time;
};

// Collective over `bootstrap`: an NCCL communicator of the same ranks on
// CUDA device `device`, device memory, and a CUDA-event timer.
absl::StatusOr<GpuContext> MakeGpuContext(Communicator& bootstrap, int device);

}  // namespace bench
}  // namespace flatparam

#endif  // FLATPARAM_BENCHMARKS_COLLECTIVES_BENCH_GPU_H_
