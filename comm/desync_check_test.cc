#include "comm/desync_check.h"

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "comm/communicator.h"
#include "comm/flight_recorder.h"
#include "flatparam/base/dtype.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/base/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "sim/sim.h"

namespace flatparam {
namespace {

using ::testing::HasSubstr;

absl::Status RunOn4(const SimWorld::RankFn& fn) {
  SimOptions options;
  options.world_size = 4;
  FLATPARAM_ASSIGN_OR_RETURN(std::unique_ptr<SimWorld> world,
                             SimWorld::Create(options));
  return world->Run(fn);
}

absl::Status Gather(Communicator& comm, int64_t count, const char* unit,
                    std::vector<float>* out) {
  ScopedCollectiveContext context(comm.flight_recorder(),
                                  {unit, 1, CollectivePhase::kForwardUnshard});
  std::vector<float> in(count, static_cast<float>(comm.rank()));
  out->assign(count * comm.size(), -1.0f);
  return comm
      .AllGather(ConstBufferRef{in.data(), count, DType::kFloat32},
                 BufferRef{out->data(), count * comm.size(), DType::kFloat32},
                 CollectiveOptions{absl::Seconds(10), std::nullopt})
      ->Wait();
}

TEST(DesyncCheckTest, AgreeingCallsRunAsWithout) {
  FLATPARAM_ASSERT_OK(RunOn4([](SimCommunicator& world) -> absl::Status {
    DesyncCheckingCommunicator checked(&world);
    std::vector<float> out;
    FLATPARAM_RETURN_IF_ERROR(Gather(checked, 2, "h.0", &out));
    EXPECT_EQ(out, (std::vector<float>{0, 0, 1, 1, 2, 2, 3, 3}));
    return absl::OkStatus();
  }));
}

// Equal sizes from different units: without the check the data of the
// wrong unit arrives silently; with it every rank fails, naming both
// sides, before any data moves, and the group goes on.
TEST(DesyncCheckTest, EqualSizesFromDifferentUnitsFailEveryRank) {
  FLATPARAM_ASSERT_OK(RunOn4([](SimCommunicator& world) -> absl::Status {
    DesyncCheckingCommunicator checked(&world);
    std::vector<float> out;
    const absl::Status s =
        Gather(checked, 2, world.rank() == 1 ? "h.2" : "h.1", &out);
    EXPECT_THAT(s, StatusIs(absl::StatusCode::kInternal,
                            HasSubstr("the group is desynchronised")));
    EXPECT_THAT(std::string(s.message()),
                HasSubstr("ranks 0,2,3 called all_gather count 2 float32 #0 "
                          "from unit h.1, forward unshard; rank 1 called "
                          "all_gather count 2 float32 #0 from unit h.2, "
                          "forward unshard"));
    EXPECT_EQ(out, std::vector<float>(8, -1.0f)) << "no data moved";
    FLATPARAM_RETURN_IF_ERROR(Gather(checked, 1, "h.3", &out));
    EXPECT_EQ(out, (std::vector<float>{0, 1, 2, 3}));
    return absl::OkStatus();
  }));
}

TEST(DesyncCheckTest, SizesAndReduceOptionsAreCompared) {
  FLATPARAM_ASSERT_OK(RunOn4([](SimCommunicator& world) -> absl::Status {
    DesyncCheckingCommunicator checked(&world);
    std::vector<float> x(4, 1.0f);
    ReduceOptions options;
    options.timeout = absl::Seconds(10);
    if (world.rank() == 3) options.op = ReduceOp::kMax;
    const absl::Status s =
        checked
            .AllReduce(ConstBufferRef{x.data(), 4, DType::kFloat32},
                       BufferRef{x.data(), 4, DType::kFloat32}, options)
            ->Wait();
    EXPECT_THAT(s, StatusIs(absl::StatusCode::kInternal,
                            HasSubstr("rank 3 called all_reduce count 4 "
                                      "float32 max #0")));
    return absl::OkStatus();
  }));
}

TEST(DesyncCheckTest, SubgroupsAreCheckedToo) {
  FLATPARAM_ASSERT_OK(RunOn4([](SimCommunicator& world) -> absl::Status {
    DesyncCheckingCommunicator checked(&world);
    FLATPARAM_ASSIGN_OR_RETURN(
        std::unique_ptr<Communicator> half,
        checked.Split(world.rank() % 2, world.rank(),
                      CollectiveOptions{absl::Seconds(10), std::nullopt}));
    EXPECT_NE(dynamic_cast<DesyncCheckingCommunicator*>(half.get()), nullptr);
    std::vector<float> out;
    const absl::Status s =
        Gather(*half, 1 + (world.rank() == 3 ? 1 : 0), "h.0", &out);
    if (world.rank() % 2 == 1) {
      EXPECT_THAT(s, StatusIs(absl::StatusCode::kInternal,
                              HasSubstr("desynchronised")));
    } else {
      EXPECT_THAT(s, IsOk());
    }
    return absl::OkStatus();
  }));
}

}  // namespace
}  // namespace flatparam
