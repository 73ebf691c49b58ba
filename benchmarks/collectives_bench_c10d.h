// The c10d part of collectives_bench, behind a header without LibTorch's:
// collectives_bench_c10d.cc in the collectives_bench_c10d binary, and
// collectives_bench_c10d_unavailable.cc (Unimplemented) in
// collectives_bench, which must run where there is no LibTorch.
//
// Thread-safety: one thread, like the communicator.
#ifndef FLATPARAM_BENCHMARKS_COLLECTIVES_BENCH_C10D_H_
#define FLATPARAM_BENCHMARKS_COLLECTIVES_BENCH_C10D_H_

#include <cstdint>
#include <functional>
#include <memory>

#include "absl/status/statusor.h"
#include "comm/communicator.h"
#include "comm/conformance/case_values.h"

namespace flatparam {
namespace bench {

using conformance::CollectiveKind;

struct C10dWorld {
  std::unique_ptr<Communicator> comm;
  // The same collective by c10d's gloo group itself, on float32 host
  // buffers of `count` elements per rank (the baseline, "c10d_raw"):
  // all_gather and all_reduce are gloo's own; reduce_scatter, which 1.13's
  // gloo lacks, is gloo's all_reduce of the whole input (what a gloo user
  // has instead); broadcast is gloo's.
  std::function<std::unique_ptr<Work>(CollectiveKind kind, const void* in,
                                      void* out, int64_t count)>
      raw;
};

// Collective over `bootstrap` (the MPI world the benchmark runs on): a
// C10dCommunicator of the same ranks, as torchrun's workers would make it
// (rank 0 hosts the TCPStore on a free port it tells the others).
absl::StatusOr<C10dWorld> MakeC10dWorld(Communicator& bootstrap);

}  // namespace bench
}  // namespace flatparam

#endif  // FLATPARAM_BENCHMARKS_COLLECTIVES_BENCH_C10D_H_
