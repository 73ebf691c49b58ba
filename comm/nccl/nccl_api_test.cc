// The two functions that turn NCCL and CUDA result codes into Status.
#include "comm/nccl/nccl_api.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "comm/nccl/fake_nccl_api.h"
#include "flatparam/base/status_matchers.h"

namespace flatparam {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

TEST(NcclStatusTest, SuccessIsOk) {
  FakeNcclApi api;
  EXPECT_THAT(NcclStatus(api, ncclSuccess, nullptr, "ctx"), IsOk());
  EXPECT_THAT(CudaStatus(api, cudaSuccess, "ctx"), IsOk());
}

TEST(NcclStatusTest, MapsEveryResultToACodeThatSaysWhatToDo) {
  FakeNcclApi api;
  const struct {
    ncclResult_t result;
    absl::StatusCode code;
    const char* name;
  } cases[] = {
      {ncclUnhandledCudaError, absl::StatusCode::kInternal,
       "ncclUnhandledCudaError"},
      {ncclSystemError, absl::StatusCode::kUnavailable, "ncclSystemError"},
      {ncclInternalError, absl::StatusCode::kInternal, "ncclInternalError"},
      {ncclInvalidArgument, absl::StatusCode::kInvalidArgument,
       "ncclInvalidArgument"},
      {ncclInvalidUsage, absl::StatusCode::kFailedPrecondition,
       "ncclInvalidUsage"},
      {ncclRemoteError, absl::StatusCode::kAborted, "ncclRemoteError"},
      {ncclInProgress, absl::StatusCode::kUnavailable, "ncclInProgress"},
  };
  for (const auto& c : cases) {
    EXPECT_THAT(NcclStatus(api, c.result, nullptr, "rank 3: all_reduce #7"),
                StatusIs(c.code, AllOf(HasSubstr("rank 3: all_reduce #7"),
                                       HasSubstr(c.name))))
        << c.name;
  }
}

TEST(NcclStatusTest, QuotesNcclErrorStringAndLastError) {
  FakeNcclApi api;
  api.set_last_error("socket to peer 10.0.0.2 closed");
  EXPECT_THAT(
      NcclStatus(api, ncclRemoteError, nullptr, "ctx"),
      StatusIs(absl::StatusCode::kAborted,
               AllOf(HasSubstr("ctx: NCCL ncclRemoteError (6)"),
                     HasSubstr("remote process exited"),
                     HasSubstr("last NCCL error: socket to peer 10.0.0.2 "
                               "closed"))));
}

TEST(CudaStatusTest, MapsErrors) {
  FakeNcclApi api;
  EXPECT_THAT(
      CudaStatus(api, cudaErrorInsufficientDriver, "ctx"),
      StatusIs(absl::StatusCode::kFailedPrecondition,
               HasSubstr("ctx: CUDA cudaErrorInsufficientDriver (35)")));
  EXPECT_THAT(CudaStatus(api, cudaErrorNoDevice, "ctx"),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(CudaStatus(api, cudaErrorInvalidDevice, "ctx"),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(CudaStatus(api, cudaErrorMemoryAllocation, "ctx"),
              StatusIs(absl::StatusCode::kResourceExhausted));
  EXPECT_THAT(CudaStatus(api, cudaErrorIllegalAddress, "ctx"),
              StatusIs(absl::StatusCode::kInternal,
                       HasSubstr("cudaErrorIllegalAddress (700)")));
}

// The real library's strings, where the library loads (no GPU needed).
TEST(RealNcclApiTest, ErrorStringsComeFromTheLibraries) {
  NcclApi& api = RealNcclApi();
  int version = 0;
  ASSERT_EQ(api.GetVersion(&version), ncclSuccess);
  EXPECT_GE(version, 21800) << "ncclCommSplit needs NCCL 2.18";
  EXPECT_THAT(CudaStatus(api, cudaErrorInsufficientDriver, "probe"),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("cudaErrorInsufficientDriver")));
  EXPECT_THAT(NcclStatus(api, ncclInvalidUsage, nullptr, "probe"),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("ncclInvalidUsage")));
}

}  // namespace
}  // namespace flatparam
