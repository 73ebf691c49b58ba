// GoogleMock matchers for absl::Status and absl::StatusOr (test-only).
//
// Abseil 20220623 ships none, so these are the project's single copy:
//
//   EXPECT_THAT(Foo(), IsOk());
//   EXPECT_THAT(Count(), IsOkAndHolds(3));
//   EXPECT_THAT(Foo(), StatusIs(absl::StatusCode::kInvalidArgument,
//                               HasSubstr("emb.weight")));
//   FLATPARAM_ASSERT_OK_AND_ASSIGN(auto v, Bar());
//
// Thread-safety: stateless.
#ifndef FLATPARAM_BASE_STATUS_MATCHERS_H_
#define FLATPARAM_BASE_STATUS_MATCHERS_H_

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <ostream>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "flatparam/base/status_macros.h"

namespace flatparam {
namespace internal_status {

inline const absl::Status& GetStatus(const absl::Status& s) { return s; }
template <typename T>
const absl::Status& GetStatus(const absl::StatusOr<T>& s) {
  return s.status();
}

MATCHER(IsOk, "is OK") {
  const absl::Status& status = GetStatus(arg);
  if (!status.ok()) *result_listener << "status is " << status;
  return status.ok();
}

MATCHER_P2(StatusIsImpl, code, message_matcher,
           "has code " + ::testing::PrintToString(code)) {
  const absl::Status& status = GetStatus(arg);
  *result_listener << "status is " << status;
  if (status.code() != code) return false;
  return ::testing::ExplainMatchResult(
      message_matcher, std::string(status.message()), result_listener);
}

// Matches an OK StatusOr whose value matches `matcher` (a value or a
// matcher).
MATCHER_P(IsOkAndHolds, matcher, "is OK and holds a matching value") {
  if (!arg.ok()) {
    *result_listener << "status is " << arg.status();
    return false;
  }
  return ::testing::ExplainMatchResult(matcher, *arg, result_listener);
}

}  // namespace internal_status

using internal_status::IsOk;
using internal_status::IsOkAndHolds;

// Matches a Status/StatusOr with `code` and a message matching `message`.
template <typename MessageMatcher>
auto StatusIs(absl::StatusCode code, MessageMatcher message) {
  return internal_status::StatusIsImpl(
      code, ::testing::MatcherCast<std::string>(message));
}
inline auto StatusIs(absl::StatusCode code) {
  return internal_status::StatusIsImpl(
      code, ::testing::MatcherCast<std::string>(::testing::_));
}

}  // namespace flatparam

#define FLATPARAM_ASSERT_OK_AND_ASSIGN(lhs, rexpr)                          \
  FLATPARAM_INTERNAL_ASSERT_OK_AND_ASSIGN(                                  \
      FLATPARAM_INTERNAL_CONCAT(flatparam_assert_statusor_, __LINE__), lhs, \
      rexpr)

#define FLATPARAM_INTERNAL_ASSERT_OK_AND_ASSIGN(tmp, lhs, rexpr) \
  auto tmp = (rexpr);                                            \
  ASSERT_TRUE(tmp.ok()) << tmp.status();                         \
  lhs = std::move(tmp).value()

#define FLATPARAM_ASSERT_OK(expr)                                           \
  do {                                                                      \
    const ::absl::Status flatparam_assert_status_ =                         \
        ::flatparam::internal_status::GetStatus((expr));                    \
    ASSERT_TRUE(flatparam_assert_status_.ok()) << flatparam_assert_status_; \
  } while (0)

#endif  // FLATPARAM_BASE_STATUS_MATCHERS_H_
