// The entry point everyone can depend on: without NCCL it says so; with NCCL
// but no GPU it says there is no usable GPU; with a GPU it works.
#include "comm/nccl/nccl_backend.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <memory>
#include <vector>

#include "comm/nccl/thread_bootstrap_testutil.h"
#include "flatparam/base/status_matchers.h"

namespace flatparam {
namespace {

using ::testing::HasSubstr;

TEST(NcclBackendTest, CreateReportsWhyItCannotRunOrWorks) {
  std::vector<std::unique_ptr<Communicator>> group = MakeThreadGroup(1);
  absl::StatusOr<std::unique_ptr<Communicator>> nccl =
      CreateNcclCommunicator(*group[0], /*cuda_device=*/0);
  if (!NcclBackendAvailable()) {
    EXPECT_THAT(nccl, StatusIs(absl::StatusCode::kUnimplemented,
                               HasSubstr("no NCCL backend")));
    return;
  }
  if (!nccl.ok()) {
    EXPECT_THAT(nccl, StatusIs(absl::StatusCode::kFailedPrecondition,
                               HasSubstr("no usable GPU")));
    GTEST_SKIP() << nccl.status();
  }
  EXPECT_EQ((*nccl)->backend(), "nccl");
  EXPECT_EQ((*nccl)->rank(), 0);
  EXPECT_EQ((*nccl)->size(), 1);
  EXPECT_THAT((*nccl)->Barrier({}), IsOk());
}

}  // namespace
}  // namespace flatparam
