#include "tools/collective_timeout.h"

#include <algorithm>

#include "absl/strings/str_format.h"

namespace flatparam {
namespace tools {

absl::Status ValidateCollectiveTimeout(absl::Duration timeout) {
  if (timeout > absl::ZeroDuration() && timeout != absl::InfiniteDuration()) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrFormat(
      "--timeout=%s: expected a positive, finite duration such as 30s or 2m "
      "(the longest any one collective may wait)",
      absl::FormatDuration(timeout)));
}

absl::Duration MpiStartTimeout(absl::Duration timeout) {
  return std::max(timeout, absl::Minutes(1));
}

}  // namespace tools
}  // namespace flatparam
