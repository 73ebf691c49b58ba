// Tests of the c10d backend. A multi-process test: envrun_test.sh starts
// the ranks as torchrun would (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT),
// main() (c10d_test_main.cc's MultirankGtestMain) makes the world with
// C10dCommunicator::FromEnvironment, runs every test on every rank and
// combines the verdicts. Rank 0 prints gtest's
// output; the others print only their failures, prefixed "[rank N]".
//
// The backend-independent cases are comm/conformance's suite, bit for bit
// against the same reference as the simulator and MPI.
#include "comm/c10d/c10d_communicator.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "comm/communicator.h"
#include "comm/conformance/collective_cases.h"
#include "comm/conformance/collective_cases_testutil.h"
#include "comm/conformance/device_memory.h"
#include "comm/flight_recorder.h"
#include "flatparam/base/status_matchers.h"
#include "testing/multirank_test_main.h"

namespace flatparam {
namespace {

using ::testing::HasSubstr;

Communicator* g_world = nullptr;  // Set up by main().

// The world as what it is (c10d_test_main.cc makes it).
C10dCommunicator& C10dWorld() {
  return *static_cast<C10dCommunicator*>(g_world);
}

void ExpectKindPasses(conformance::CollectiveKind kind) {
  conformance::ExpectCasesPass(
      *g_world, conformance::HostMemory(),
      conformance::CasesOfKind(
          conformance::CollectiveCases(g_world->size(), {}), kind));
}

TEST(C10dConformanceTest, AllGather) {
  ExpectKindPasses(conformance::CollectiveKind::kAllGather);
}

TEST(C10dConformanceTest, ReduceScatter) {
  ExpectKindPasses(conformance::CollectiveKind::kReduceScatter);
}

TEST(C10dConformanceTest, AllReduce) {
  ExpectKindPasses(conformance::CollectiveKind::kAllReduce);
}

TEST(C10dConformanceTest, Broadcast) {
  ExpectKindPasses(conformance::CollectiveKind::kBroadcast);
}

// Exact reductions against closed forms, all_gather_bytes, barrier, split,
// hybrid groups and argument errors.
TEST(C10dConformanceTest, GroupChecks) {
  conformance::ExpectGroupChecksPass(*g_world, conformance::HostMemory(), {});
}

// The same table the simulator's and MPI's tests compare with; at 4 ranks
// also the pinned constant.
TEST(C10dConformanceTest, DigestsMatchTheReference) {
  const int n = g_world->size();
  absl::StatusOr<conformance::DigestTable> digests =
      conformance::ComputeDigests(*g_world, conformance::HostMemory());
  ASSERT_THAT(digests, IsOk());
  EXPECT_THAT(conformance::CompareDigests(*digests,
                                          conformance::ReferenceDigests(n), n),
              IsOk());
  if (n == 4) {
    EXPECT_EQ(conformance::CombineDigests(*digests),
              conformance::kReferenceDigestWorld4);
  }
}

TEST(C10dCommunicatorTest, DeviceBuffersAreUnimplemented) {
  float x = 1;
  float y = 0;
  ConstBufferRef in{&x, 1, DType::kFloat32, Device::Cuda(0)};
  BufferRef out{&y, 1, DType::kFloat32, Device::Cuda(0)};
  const absl::Status status =
      g_world->AllReduce(in, out, ReduceOptions())->Wait();
  EXPECT_EQ(status.code(), absl::StatusCode::kUnimplemented) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr("host buffers"));
}

TEST(C10dCommunicatorTest, WrapRefusesNullArguments) {
  EXPECT_EQ(C10dCommunicator::Wrap(c10::intrusive_ptr<c10d::Store>(),
                                   C10dWorld().process_group())
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(C10dCommunicator::Wrap(c10::make_intrusive<c10d::HashStore>(),
                                   c10::intrusive_ptr<c10d::ProcessGroup>())
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
}

// The environment's errors name the variable; nothing is contacted.
TEST(C10dCommunicatorTest, FromEnvironmentNamesWhatIsMissing) {
  const std::string rank = std::getenv("RANK");
  setenv("RANK", "x7", 1);
  absl::StatusOr<std::unique_ptr<C10dCommunicator>> made =
      C10dCommunicator::FromEnvironment();
  EXPECT_EQ(made.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(made.status().message()), HasSubstr("RANK=\"x7\""));
  unsetenv("RANK");
  made = C10dCommunicator::FromEnvironment();
  EXPECT_EQ(made.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(made.status().message()),
              HasSubstr("RANK is not set"));
  setenv("RANK", rank.c_str(), 1);
}

// An existing group, wrapped: the same collectives through the caller's
// ProcessGroup, bitwise (the digests).
TEST(C10dCommunicatorTest, WrapsAnExistingGroup) {
  absl::StatusOr<std::unique_ptr<Communicator>> sub =
      g_world->Split(0, g_world->rank(), {});
  ASSERT_THAT(sub.status(), IsOk());
  auto* c10d_sub = static_cast<C10dCommunicator*>(sub->get());
  absl::StatusOr<std::unique_ptr<C10dCommunicator>> wrapped =
      C10dCommunicator::Wrap(c10::make_intrusive<c10d::HashStore>(),
                             c10d_sub->process_group());
  ASSERT_THAT(wrapped.status(), IsOk());
  const int n = (*wrapped)->size();
  absl::StatusOr<conformance::DigestTable> digests =
      conformance::ComputeDigests(**wrapped, conformance::HostMemory());
  ASSERT_THAT(digests, IsOk());
  EXPECT_THAT(conformance::CompareDigests(*digests,
                                          conformance::ReferenceDigests(n), n),
              IsOk());
}

// Rank 1 skips a collective: the others time out, name rank 1 (it never
// reached the collective), and the group fails fast afterwards.
TEST(C10dCommunicatorTest, ATimeoutNamesTheRankThatSentNothing) {
  if (g_world->size() < 2) GTEST_SKIP() << "needs two ranks";
  absl::StatusOr<std::unique_ptr<Communicator>> made =
      g_world->Split(0, g_world->rank(), {});
  ASSERT_THAT(made.status(), IsOk());
  Communicator& group = **made;
  float x = 1;
  float y = 0;
  ReduceOptions options;
  options.timeout = absl::Seconds(2);
  if (group.rank() != 1) {
    const absl::Time start = absl::Now();
    const absl::Status status =
        group
            .AllReduce({&x, 1, DType::kFloat32}, {&y, 1, DType::kFloat32},
                       options)
            ->Wait();
    const absl::Duration took = absl::Now() - start;
    EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded) << status;
    EXPECT_THAT(std::string(status.message()),
                HasSubstr("rank 1 did not reach all_reduce #"));
    // The timeout plus the diagnosis' grace, and a margin for a loaded
    // machine.
    EXPECT_LT(took, absl::Seconds(2) + absl::Seconds(1) + absl::Seconds(2));
    const absl::Status later = group.Barrier({});
    EXPECT_EQ(later.code(), absl::StatusCode::kAborted) << later;
    // The rank's flight recorder, shared with the subgroup, holds the
    // failed collective in the subgroup's name, with its error.
    FlightRecorder* recorder = group.flight_recorder();
    ASSERT_NE(recorder, nullptr);
    EXPECT_EQ(recorder, g_world->flight_recorder());
    const std::vector<FlightEntry> entries = recorder->Snapshot();
    auto it = std::find_if(
        entries.rbegin(), entries.rend(),
        [](const FlightEntry& e) { return e.op == CollectiveOp::kAllReduce; });
    ASSERT_NE(it, entries.rend());
    EXPECT_EQ(it->state, FlightState::kFailed);
    EXPECT_THAT(it->error, HasSubstr("rank 1 did not reach all_reduce #"));
    EXPECT_THAT(it->group->id, ::testing::MatchesRegex("world/split[0-9]+:0"));
    EXPECT_EQ(it->group->ranks.size(), static_cast<size_t>(g_world->size()));
    EXPECT_EQ(it->count, 1);
    EXPECT_EQ(entries.back().op, CollectiveOp::kBarrier);
    EXPECT_EQ(entries.back().state, FlightState::kFailed);
  }
  // The world still works (the failure aborted the subgroup only).
  ASSERT_THAT(g_world->Barrier({}), IsOk());
}

// The first rank whose collective fails tells the others through the
// store: rank 0 gives up after 1 s (rank 1 never comes), and ranks 2.. ,
// whose own timeout is 30 s, end within seconds quoting rank 0's
// diagnosis. Without the abort key they would wait out their 30 s.
TEST(C10dCommunicatorTest, TheFirstFailureEndsTheOthersWaits) {
  if (g_world->size() < 3) GTEST_SKIP() << "needs three ranks";
  absl::StatusOr<std::unique_ptr<Communicator>> made =
      g_world->Split(0, g_world->rank(), {});
  ASSERT_THAT(made.status(), IsOk());
  Communicator& group = **made;
  if (group.rank() != 1) {
    float x = 1;
    float y = 0;
    ReduceOptions options;
    options.timeout = group.rank() == 0 ? absl::Seconds(1) : absl::Seconds(30);
    const absl::Time start = absl::Now();
    const absl::Status status =
        group
            .AllReduce({&x, 1, DType::kFloat32}, {&y, 1, DType::kFloat32},
                       options)
            ->Wait();
    const absl::Duration took = absl::Now() - start;
    EXPECT_FALSE(status.ok());
    EXPECT_THAT(std::string(status.message()),
                HasSubstr("rank 1 did not reach all_reduce #"));
    if (group.rank() != 0) {
      EXPECT_EQ(status.code(), absl::StatusCode::kAborted) << status;
      EXPECT_THAT(std::string(status.message()),
                  HasSubstr("aborted by another rank"));
      EXPECT_LT(took, absl::Seconds(10)) << status;
    }
  }
  ASSERT_THAT(g_world->Barrier({}), IsOk());
}

}  // namespace
}  // namespace flatparam

int main(int argc, char** argv) {
  return flatparam::MultirankGtestMain(&argc, argv, &flatparam::g_world);
}
