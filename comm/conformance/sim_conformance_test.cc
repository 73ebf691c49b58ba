// The conformance suite on the simulator: every case at world sizes 1, 2,
// 3, 4, 8 and 16 with one or two seeds each (the seed changes the interleaving
// of the ranks, never the results), and the output digests against the
// reference that the MPI test compares with too.
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "comm/communicator.h"
#include "comm/conformance/collective_cases.h"
#include "comm/conformance/collective_cases_testutil.h"
#include "comm/conformance/device_memory.h"
#include "flatparam/base/status_matchers.h"
#include "sim/sim.h"

namespace flatparam {
namespace conformance {
namespace {

std::unique_ptr<SimWorld> MakeWorld(int n, uint64_t seed) {
  SimOptions options;
  options.world_size = n;
  options.seed = seed;
  auto world = SimWorld::Create(options);
  EXPECT_THAT(world, IsOk());
  return world.ok() ? std::move(world).value() : nullptr;
}

// Runs `options`' suite on every rank of a simulated world and reports each
// rank's failures.
void ExpectSuitePassesOnSim(int n, uint64_t seed, const SuiteOptions& options) {
  std::unique_ptr<SimWorld> world = MakeWorld(n, seed);
  ASSERT_NE(world, nullptr);
  std::vector<SuiteReport> reports(n);
  const absl::Status status = world->Run([&](SimCommunicator& comm) {
    reports[comm.world_rank()] = RunSuite(comm, HostMemory(), options);
    return reports[comm.world_rank()].ToStatus();
  });
  EXPECT_THAT(status, IsOk());
  for (int r = 0; r < n; ++r) {
    SCOPED_TRACE(absl::StrCat("rank ", r, " of ", n, ", seed ", seed));
    EXPECT_GT(reports[r].cases, 0);
    ExpectSuiteOk(reports[r]);
  }
}

class SimConformanceTest
    : public ::testing::TestWithParam<std::tuple<int, uint64_t>> {};

TEST_P(SimConformanceTest, EveryCase) {
  const auto [n, seed] = GetParam();
  SuiteOptions options;
  options.large_elements = 0;  // LargeCases below.
  ExpectSuitePassesOnSim(n, seed, options);
}

// Two seeds where interleavings are few enough to matter; one for the
// larger worlds, whose suite takes longer.
INSTANTIATE_TEST_SUITE_P(
    Worlds, SimConformanceTest,
    ::testing::Values(
        std::make_tuple(1, uint64_t{1}), std::make_tuple(2, uint64_t{1}),
        std::make_tuple(2, uint64_t{29}), std::make_tuple(3, uint64_t{1}),
        std::make_tuple(3, uint64_t{29}), std::make_tuple(4, uint64_t{1}),
        std::make_tuple(4, uint64_t{29}), std::make_tuple(8, uint64_t{1}),
        std::make_tuple(8, uint64_t{29}), std::make_tuple(16, uint64_t{1})),
    [](const ::testing::TestParamInfo<std::tuple<int, uint64_t>>& info) {
      return absl::StrCat("World", std::get<0>(info.param), "Seed",
                          std::get<1>(info.param));
    });

// The large cases (about two million elements per buffer, every kind and
// dtype) on their own: at 3 and 8 ranks. At 16 ranks they would hold
// 16 x 2 buffers of up to 16 MiB while the collectives run.
TEST(SimConformanceTest, LargeCases) {
  SuiteOptions options;
  options.counts.clear();
  options.group_checks = false;
  ASSERT_EQ(CollectiveCases(8, options).size(), 16u);
  ExpectSuitePassesOnSim(3, 2, options);
  ExpectSuitePassesOnSim(8, 3, options);
}

TEST(SimConformanceTest, ExactOnlyCasesForBackendsWithTheirOwnOrder) {
  // What the NCCL test runs: no kInexact reductions, no factors of 3 or 7,
  // and avg only on power-of-two groups.
  SuiteOptions options;
  options.exact_only = true;
  options.large_elements = 0;
  for (int n : {3, 4}) {
    const std::vector<CollectiveCase> cases = CollectiveCases(n, options);
    int averages = 0;
    for (const CollectiveCase& c : cases) {
      EXPECT_TRUE(IsOrderIndependent(c, n)) << c.Name();
      averages +=
          c.op == ReduceOp::kAvg && c.kind == CollectiveKind::kAllReduce;
    }
    EXPECT_EQ(averages > 0, n == 4) << n;
    EXPECT_LT(cases.size(), CollectiveCases(n, SuiteOptions()).size());
  }
  ExpectSuitePassesOnSim(3, 5, options);
}

// Digests of every rank's outputs at world size 4: the same table the MPI
// test (comm/mpi/mpi_communicator_test.cc) computes under mpirun -np 4.
TEST(SimDigestTest, MatchReferenceAtWorldSize4) {
  for (uint64_t seed : {1, 2, 3}) {
    std::unique_ptr<SimWorld> world = MakeWorld(4, seed);
    ASSERT_NE(world, nullptr);
    std::vector<DigestTable> tables(4);
    ASSERT_THAT(world->Run([&](SimCommunicator& comm) -> absl::Status {
      FLATPARAM_ASSIGN_OR_RETURN(tables[comm.world_rank()],
                                 ComputeDigests(comm, HostMemory()));
      return absl::OkStatus();
    }),
                IsOk());
    for (int r = 0; r < 4; ++r) {
      EXPECT_THAT(CompareDigests(tables[r], ReferenceDigests(4), 4), IsOk());
      EXPECT_EQ(CombineDigests(tables[r]), kReferenceDigestWorld4);
    }
  }
}

TEST(SimDigestTest, MatchReferenceAtOtherWorldSizes) {
  for (int n : {1, 3, 8}) {
    std::unique_ptr<SimWorld> world = MakeWorld(n, 11);
    ASSERT_NE(world, nullptr);
    DigestTable table;
    ASSERT_THAT(world->Run([&](SimCommunicator& comm) -> absl::Status {
      FLATPARAM_ASSIGN_OR_RETURN(DigestTable t,
                                 ComputeDigests(comm, HostMemory()));
      if (comm.rank() == 0) table = t;
      return absl::OkStatus();
    }),
                IsOk());
    EXPECT_THAT(CompareDigests(table, ReferenceDigests(n), n), IsOk()) << n;
  }
}

}  // namespace
}  // namespace conformance
}  // namespace flatparam
