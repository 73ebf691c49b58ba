// How the simulator names calls and ranks in its messages and trace.
#include <algorithm>
#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "comm/communicator.h"
#include "flatparam/base/dtype.h"
#include "sim/internal/sim_internal.h"

namespace flatparam {
namespace internal_sim {

std::string ListByRank(const std::vector<std::pair<int, std::string>>& items) {
  std::string out;
  size_t i = 0;
  while (i < items.size()) {
    size_t j = i + 1;
    while (j < items.size() && items[j].second == items[i].second &&
           items[j].first == items[j - 1].first + 1) {
      ++j;
    }
    if (j - i == 1) {
      absl::StrAppendFormat(&out, "\n  rank %d: %s", items[i].first,
                            items[i].second);
    } else {
      absl::StrAppendFormat(&out, "\n  ranks %d-%d: %s", items[i].first,
                            items[j - 1].first, items[i].second);
    }
    i = j;
  }
  return out;
}

std::string JoinCapped(const std::vector<int>& ranks, size_t cap) {
  std::vector<int> head(ranks.begin(),
                        ranks.begin() + std::min(cap, ranks.size()));
  std::string s = absl::StrJoin(head, ", ");
  if (ranks.size() > cap) {
    absl::StrAppend(&s, " and ", ranks.size() - cap, " more");
  }
  return s;
}

std::string Detail(OpKind kind, const internal_sim::Call& c) {
  const std::string buffer =
      absl::StrFormat("%d x %s", c.count(), DTypeName(c.input.dtype));
  std::string reduce;
  if (IsReduction(kind)) {
    reduce = absl::StrCat(", ", ReduceOpName(c.reduce.op));
    if (c.reduce.pre_divide_factor != 1.0) {
      absl::StrAppendFormat(&reduce, ", pre-divide %g",
                            c.reduce.pre_divide_factor);
    }
    if (c.reduce.post_divide_factor != 1.0) {
      absl::StrAppendFormat(&reduce, ", post-divide %g",
                            c.reduce.post_divide_factor);
    }
  }
  switch (kind) {
    case OpKind::kAllGather:
      return absl::StrCat(buffer, " per rank");
    case OpKind::kReduceScatter:
      return absl::StrCat(buffer, " per rank", reduce);
    case OpKind::kAllReduce:
      return absl::StrCat(buffer, reduce);
    case OpKind::kBroadcast:
      return absl::StrCat(buffer, ", root ", c.root);
    case OpKind::kAllGatherBytes:
      return absl::StrCat(c.bytes.size(), " bytes");
    case OpKind::kBarrier:
      return "";
    case OpKind::kSplit:
      return absl::StrFormat("color %d, key %d", c.color, c.key);
  }
  return "";
}

std::string InParens(const std::string& detail) {
  return detail.empty() ? "" : absl::StrCat(" (", detail, ")");
}

}  // namespace internal_sim
}  // namespace flatparam
