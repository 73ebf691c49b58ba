// MakeC10dWorld() in collectives_bench, which does not link LibTorch.
#include "absl/strings/str_format.h"
#include "benchmarks/collectives_bench_c10d.h"

namespace flatparam {
namespace bench {

absl::StatusOr<C10dWorld> MakeC10dWorld(Communicator& bootstrap) {
  return absl::UnimplementedError(absl::StrFormat(
      "rank %d: --backend=c10d: run collectives_bench_c10d, the build of "
      "this benchmark that links LibTorch's c10d (this one must not need "
      "LibTorch)",
      bootstrap.rank()));
}

}  // namespace bench
}  // namespace flatparam
