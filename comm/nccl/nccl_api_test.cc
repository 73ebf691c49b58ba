// NcclStatus, the one function that turns NCCL result codes into Status
// (CUDA's: flatparam/device/cuda/cuda_runtime_test.cc).
#include "comm/nccl/nccl_api.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "comm/nccl/fake_nccl_api.h"
#include "flatparam/base/status_matchers.h"
#include "flatparam/device/cuda/cuda_runtime.h"

namespace flatparam {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

TEST(NcclStatusTest, SuccessIsOk) {
  FakeNcclApi api;
  EXPECT_THAT(NcclStatus(api, ncclSuccess, nullptr, "ctx"), IsOk());
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

// FakeNcclApi models only the CUDA calls the backend makes; the others are
// refused and recorded, so a backend that starts making one is noticed.
TEST(FakeNcclApiTest, CudaCallsTheBackendDoesNotMakeAreRefused) {
  FakeNcclApi api;
  CudaRuntime& cuda = api;
  EXPECT_EQ(cuda.StreamSynchronize(nullptr), cudaErrorNotSupported);
  EXPECT_EQ(cuda.GetLastError(), cudaErrorNotSupported);
  EXPECT_THAT(api.misuse(),
              ::testing::ElementsAre(HasSubstr("cudaStreamSynchronize")));
}

// The real library's strings, where the library loads (no GPU needed).
TEST(RealNcclApiTest, ErrorStringsComeFromTheLibraries) {
  NcclApi& api = RealNcclApi();
  int version = 0;
  ASSERT_EQ(api.GetVersion(&version), ncclSuccess);
  EXPECT_GE(version, 21800) << "ncclCommSplit needs NCCL 2.18";
  EXPECT_THAT(NcclStatus(api, ncclInvalidUsage, nullptr, "probe"),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("ncclInvalidUsage")));
}

}  // namespace
}  // namespace flatparam
