// The buffer collectives by kind, and nccl-tests' arithmetic for reporting
// their speed: the size of a collective in bytes, algorithm bandwidth and bus
// bandwidth. Every report of collective bandwidth in flatparam (the `fsdp
// collectives` sweep, //benchmarks:collectives_bench) uses these functions,
// so their numbers compare with each other and with nccl-tests'.
//
//   size   all_gather: the output bytes of one rank (n * count elements);
//          reduce_scatter: the input bytes of one rank (n * count);
//          all_reduce, broadcast: the buffer bytes (count).
//   algbw  = size / time
//   busbw  = algbw * factor, factor = (n - 1) / n for all_gather and
//            reduce_scatter, 2 (n - 1) / n for all_reduce, 1 for broadcast.
// Bandwidths are in bytes per second; nccl-tests prints them in GB/s
// (1e9 bytes per second).
//
// Thread-safety: pure functions.
#ifndef FLATPARAM_COMM_CONFORMANCE_BANDWIDTH_H_
#define FLATPARAM_COMM_CONFORMANCE_BANDWIDTH_H_

#include <cstdint>

#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "flatparam/base/dtype.h"

namespace flatparam {
namespace conformance {

// The collectives that move buffers. Counts follow the Communicator's
// convention: `count` is all_gather's input, reduce_scatter's output, and
// all_reduce's and broadcast's buffer, per rank.
enum class CollectiveKind : uint8_t {
  kAllGather,
  kReduceScatter,
  kAllReduce,
  kBroadcast,
};

// "all_gather", "reduce_scatter", "all_reduce", "broadcast": the names the
// backends use in their errors and the simulator in its trace.
absl::string_view CollectiveKindName(CollectiveKind kind);

// nccl-tests' bus factor of `kind` on `n` ranks (above). REQUIRES: n >= 1.
double BusBandwidthFactor(CollectiveKind kind, int n);

// nccl-tests' size in bytes of `kind` with `count` elements per rank (above).
int64_t CollectiveBytes(CollectiveKind kind, int64_t count, int n, DType dtype);

// The per-rank count whose CollectiveBytes is the largest not above `bytes`
// (at least 1): bytes / element size, divided by n for all_gather and
// reduce_scatter.
int64_t CountForBytes(CollectiveKind kind, int64_t bytes, int n, DType dtype);

struct Bandwidth {
  double algbw = 0;  // bytes per second
  double busbw = 0;  // bytes per second
};

// The bandwidths of moving `bytes` (nccl-tests' size) in `time` on `n`
// ranks. Zero bandwidths for a non-positive time.
Bandwidth ComputeBandwidth(CollectiveKind kind, int64_t bytes, int n,
                           absl::Duration time);

}  // namespace conformance
}  // namespace flatparam

#endif  // FLATPARAM_COMM_CONFORMANCE_BANDWIDTH_H_
