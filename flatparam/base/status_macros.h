// Status propagation helpers.
//
// The Abseil in Debian bookworm (20220623) has no RETURN_IF_ERROR or
// ASSIGN_OR_RETURN, so flatparam defines its own, once, here. They behave like
// the ones in later Abseil/TensorStore:
//
//   FLATPARAM_RETURN_IF_ERROR(DoThing());
//   FLATPARAM_ASSIGN_OR_RETURN(auto layout, BuildLayout(spec));
//
// It also marks errors that were already printed (MarkReported/IsReported),
// so that a program's main() does not print them twice.
//
// Thread-safety: macros and pure functions; no state.
#ifndef FLATPARAM_BASE_STATUS_MACROS_H_
#define FLATPARAM_BASE_STATUS_MACROS_H_

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/cord.h"
#include "absl/strings/string_view.h"

#define FLATPARAM_INTERNAL_CONCAT_IMPL(a, b) a##b
#define FLATPARAM_INTERNAL_CONCAT(a, b) FLATPARAM_INTERNAL_CONCAT_IMPL(a, b)

// Evaluates `expr` (an absl::Status) and returns it from the enclosing
// function when it is not OK.
#define FLATPARAM_RETURN_IF_ERROR(expr)                    \
  do {                                                     \
    ::absl::Status flatparam_status_ = (expr);             \
    if (!flatparam_status_.ok()) return flatparam_status_; \
  } while (0)

// Evaluates `rexpr` (an absl::StatusOr<T>); on error returns its status, else
// moves the value into `lhs` (which may be a declaration such as `auto x`).
#define FLATPARAM_ASSIGN_OR_RETURN(lhs, rexpr) \
  FLATPARAM_INTERNAL_ASSIGN_OR_RETURN(         \
      FLATPARAM_INTERNAL_CONCAT(flatparam_statusor_, __LINE__), lhs, rexpr)

#define FLATPARAM_INTERNAL_ASSIGN_OR_RETURN(tmp, lhs, rexpr) \
  auto tmp = (rexpr);                                        \
  if (!tmp.ok()) return std::move(tmp).status();             \
  lhs = std::move(tmp).value()

namespace flatparam {

inline constexpr absl::string_view kReportedPayloadUrl =
    "type.googleapis.com/flatparam.Reported";

// Returns `status` marked as already printed to the user (a payload; the
// code and message are unchanged). An OK status stays OK.
inline absl::Status MarkReported(absl::Status status) {
  if (!status.ok()) status.SetPayload(kReportedPayloadUrl, absl::Cord("1"));
  return status;
}

// Whether MarkReported marked `status`: its message was printed already.
inline bool IsReported(const absl::Status& status) {
  return status.GetPayload(kReportedPayloadUrl).has_value();
}

}  // namespace flatparam

#endif  // FLATPARAM_BASE_STATUS_MACROS_H_
