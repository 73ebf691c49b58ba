#include "comm/conformance/bandwidth.h"

#include <algorithm>
#include <cassert>

namespace flatparam {
namespace conformance {

absl::string_view CollectiveKindName(CollectiveKind kind) {
  switch (kind) {
    case CollectiveKind::kAllGather:
      return "all_gather";
    case CollectiveKind::kReduceScatter:
      return "reduce_scatter";
    case CollectiveKind::kAllReduce:
      return "all_reduce";
    case CollectiveKind::kBroadcast:
      return "broadcast";
  }
  return "unknown";
}

double BusBandwidthFactor(CollectiveKind kind, int n) {
  assert(n >= 1);
  switch (kind) {
    case CollectiveKind::kAllGather:
    case CollectiveKind::kReduceScatter:
      return static_cast<double>(n - 1) / n;
    case CollectiveKind::kAllReduce:
      return 2.0 * (n - 1) / n;
    case CollectiveKind::kBroadcast:
      return 1.0;
  }
  return 1.0;
}

int64_t CollectiveBytes(CollectiveKind kind, int64_t count, int n,
                        DType dtype) {
  const int64_t elements = kind == CollectiveKind::kAllGather ||
                                   kind == CollectiveKind::kReduceScatter
                               ? count * n
                               : count;
  return elements * static_cast<int64_t>(DTypeSize(dtype));
}

int64_t CountForBytes(CollectiveKind kind, int64_t bytes, int n, DType dtype) {
  int64_t count = bytes / static_cast<int64_t>(DTypeSize(dtype));
  if (kind == CollectiveKind::kAllGather ||
      kind == CollectiveKind::kReduceScatter) {
    count /= n;
  }
  return std::max<int64_t>(1, count);
}

Bandwidth ComputeBandwidth(CollectiveKind kind, int64_t bytes, int n,
                           absl::Duration time) {
  const double seconds = absl::ToDoubleSeconds(time);
  if (!(seconds > 0)) return {};
  Bandwidth b;
  b.algbw = static_cast<double>(bytes) / seconds;
  b.busbw = b.algbw * BusBandwidthFactor(kind, n);
  return b;
}

}  // namespace conformance
}  // namespace flatparam
