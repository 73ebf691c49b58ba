// How the simulator names calls and ranks in its messages and trace.
#include <algorithm>
#include <cstddef>
#include <map>
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

std::string RankSet(const std::vector<int>& ranks, size_t cap) {
  std::vector<std::string> pieces;
  size_t shown = 0;
  size_t i = 0;
  while (i < ranks.size()) {
    size_t j = i + 1;
    if (j < ranks.size()) {
      const int stride = ranks[j] - ranks[i];
      while (j + 1 < ranks.size() && ranks[j + 1] - ranks[j] == stride) ++j;
      // A run: consecutive ranks, or three or more at one stride.
      if (stride == 1 || j - i >= 2) {
        if (pieces.size() < cap) {
          pieces.push_back(stride == 1
                               ? absl::StrFormat("%d-%d", ranks[i], ranks[j])
                               : absl::StrFormat("%d-%d step %d", ranks[i],
                                                 ranks[j], stride));
          shown += j - i + 1;
        }
        i = j + 1;
        continue;
      }
    }
    if (pieces.size() < cap) {
      pieces.push_back(absl::StrCat(ranks[i]));
      ++shown;
    }
    i = i + 1;
  }
  std::string out = absl::StrJoin(pieces, ", ");
  if (shown < ranks.size()) {
    absl::StrAppend(&out, " and ", ranks.size() - shown, " more");
  }
  return out;
}

std::string ListByRank(const std::vector<std::pair<int, std::string>>& items) {
  // One line per distinct text, in order of first appearance, with its
  // ranks (sorted) as runs: a desync of a replicate group (every 8th rank)
  // at thousands of ranks stays two lines.
  std::vector<const std::string*> texts;
  std::map<absl::string_view, std::vector<int>> ranks_of;
  for (const auto& [rank, text] : items) {
    std::vector<int>& ranks = ranks_of[text];
    if (ranks.empty()) texts.push_back(&text);
    ranks.push_back(rank);
  }
  std::string out;
  for (const std::string* text : texts) {
    std::vector<int>& ranks = ranks_of[*text];
    std::sort(ranks.begin(), ranks.end());
    absl::StrAppendFormat(&out, "\n  rank%s %s: %s",
                          ranks.size() == 1 ? "" : "s", RankSet(ranks, 16),
                          *text);
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
