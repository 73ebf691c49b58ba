// Tests of the MPI backend. This binary is a multi-process test: run it
// under mpirun (mpirun_test.sh does, with 4 ranks; any size >= 2 works).
// main() initialises MPI before gtest, keeps the world communicators alive
// for every test, destroys them, combines every rank's verdict, and only
// then finalises MPI. Rank 0 prints gtest's output; the other ranks print
// only their failures, prefixed with "[rank N]".
//
// The backend-independent cases are comm/conformance's suite and run twice:
// with and without MpiOptions::check_collectives.
#include "comm/mpi/mpi_communicator.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdio>
#include <cstdlib>
#include <limits>
#include <memory>
#include <vector>

#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "comm/communicator.h"
#include "comm/conformance/collective_cases.h"
#include "comm/conformance/collective_cases_gtest.h"
#include "comm/conformance/device_memory.h"
#include "comm/mpi/mpi_gtest.h"
#include "flatparam/base/status_matchers.h"

namespace flatparam {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

// Set up by main() around RUN_ALL_TESTS.
MpiCommunicator* g_world = nullptr;          // check_collectives = false
MpiCommunicator* g_checked_world = nullptr;  // check_collectives = true

CollectiveOptions Timed(absl::Duration timeout = conformance::kCaseTimeout) {
  CollectiveOptions options;
  options.timeout = timeout;
  return options;
}

// The parameter: whether collectives exchange a check header first.
class ConformanceTest : public ::testing::TestWithParam<bool> {
 protected:
  Communicator& comm() { return GetParam() ? *g_checked_world : *g_world; }

  // The suite's cases of one kind, on host memory.
  void ExpectKindPasses(conformance::CollectiveKind kind) {
    conformance::ExpectCasesPass(
        comm(), conformance::HostMemory(),
        conformance::CasesOfKind(
            conformance::CollectiveCases(comm().size(), {}), kind));
  }
};

TEST_P(ConformanceTest, AllGather) {
  ExpectKindPasses(conformance::CollectiveKind::kAllGather);
}

TEST_P(ConformanceTest, ReduceScatter) {
  ExpectKindPasses(conformance::CollectiveKind::kReduceScatter);
}

TEST_P(ConformanceTest, AllReduce) {
  ExpectKindPasses(conformance::CollectiveKind::kAllReduce);
}

TEST_P(ConformanceTest, Broadcast) {
  ExpectKindPasses(conformance::CollectiveKind::kBroadcast);
}

// Exact reductions against closed forms, all_gather_bytes, barrier, split,
// hybrid groups and argument errors.
TEST_P(ConformanceTest, GroupChecks) {
  conformance::ExpectGroupChecksPass(comm(), conformance::HostMemory(), {});
}

// Every rank's outputs hashed, against the reference table the simulator's
// test (comm/conformance/sim_conformance_test.cc) compares with too; at 4
// ranks also against the pinned constant.
TEST_P(ConformanceTest, DigestsMatchTheReference) {
  const int n = comm().size();
  absl::StatusOr<conformance::DigestTable> digests =
      conformance::ComputeDigests(comm(), conformance::HostMemory());
  ASSERT_THAT(digests, IsOk());
  EXPECT_THAT(conformance::CompareDigests(*digests,
                                          conformance::ReferenceDigests(n), n),
              IsOk());
  if (n == 4) {
    EXPECT_EQ(conformance::CombineDigests(*digests),
              conformance::kReferenceDigestWorld4);
  }
}

INSTANTIATE_TEST_SUITE_P(Mpi, ConformanceTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "Checked" : "Unchecked";
                         });

TEST(MpiCommunicatorTest, WorldMatchesMpi) {
  int rank = -1;
  int size = -1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  EXPECT_EQ(g_world->rank(), rank);
  EXPECT_EQ(g_world->size(), size);
  EXPECT_EQ(g_world->backend(), "mpi");
  EXPECT_NE(g_world->mpi_comm(), MPI_COMM_WORLD);
  EXPECT_THAT(g_world->health(), IsOk());
  EXPECT_FALSE(g_world->options().check_collectives);
  EXPECT_TRUE(g_checked_world->options().check_collectives);
}

TEST(MpiCommunicatorTest, WrapRejectsNullCommunicator) {
  EXPECT_THAT(
      MpiCommunicator::Wrap(MPI_COMM_NULL),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("MPI_COMM_NULL")));
}

TEST(MpiCommunicatorTest, CudaBuffersAreUnimplemented) {
  const int n = g_world->size();
  std::vector<float> in(4), out(4 * n);
  const Device cuda = Device::Cuda(0);
  EXPECT_THAT(
      g_world
          ->AllGather({in.data(), 4, DType::kFloat32, cuda},
                      {out.data(), 4 * n, DType::kFloat32, cuda}, Timed())
          ->Wait(),
      StatusIs(absl::StatusCode::kUnimplemented,
               AllOf(HasSubstr("cuda:0"), HasSubstr("all_gather #"))));
  BroadcastOptions options;
  options.timeout = conformance::kCaseTimeout;
  EXPECT_THAT(
      g_world->Broadcast({in.data(), 4, DType::kFloat32, cuda}, options)
          ->Wait(),
      StatusIs(absl::StatusCode::kUnimplemented, HasSubstr("host buffers")));
  EXPECT_THAT(g_world->Barrier(Timed()), IsOk());
}

TEST(MpiCommunicatorTest, CountsBeyondMpiIntAreUnimplemented) {
  // Never dereferenced: the limit is checked before anything is copied.
  char byte = 0;
  const int64_t huge = int64_t{std::numeric_limits<int>::max()} + 1;
  EXPECT_THAT(
      g_world->Broadcast({&byte, huge, DType::kFloat16}, BroadcastOptions())
          ->Wait(),
      StatusIs(absl::StatusCode::kUnimplemented,
               AllOf(HasSubstr("2147483648"), HasSubstr("int"))));
  EXPECT_THAT(g_world->Barrier(Timed()), IsOk());
}

TEST(MpiCommunicatorTest, WaitingInAnotherOrderThanIssued) {
  const int n = g_world->size();
  std::vector<float> a(10, 1.0f), a_out(10);
  std::vector<float> b(3, static_cast<float>(g_world->rank())), b_out(3 * n);
  std::unique_ptr<Work> reduce =
      g_world->AllReduce({a.data(), 10, DType::kFloat32},
                         {a_out.data(), 10, DType::kFloat32}, ReduceOptions());
  std::unique_ptr<Work> gather =
      g_world->AllGather({b.data(), 3, DType::kFloat32},
                         {b_out.data(), 3 * n, DType::kFloat32}, Timed());
  EXPECT_THAT(gather->Wait(), IsOk());
  EXPECT_THAT(reduce->Wait(), IsOk());
  for (float v : a_out) EXPECT_EQ(v, static_cast<float>(n));
  for (int i = 0; i < 3 * n; ++i) EXPECT_EQ(b_out[i], i / 3);
}

TEST(MpiCommunicatorTest, WorkOutlivesItsCommunicator) {
  absl::StatusOr<std::unique_ptr<MpiCommunicator>> comm =
      MpiCommunicator::Wrap(MPI_COMM_WORLD);
  ASSERT_THAT(comm, IsOk());
  double one = 1.0;
  double sum = 0.0;
  std::unique_ptr<Work> work = (*comm)->AllReduce(
      {&one, 1, DType::kFloat64}, {&sum, 1, DType::kFloat64}, ReduceOptions());
  comm->reset();
  EXPECT_THAT(work->Wait(), IsOk());
  EXPECT_EQ(sum, g_world->size());
}

TEST(MpiCommunicatorTest, DroppedWorkStillCompletes) {
  double one = 1.0;
  double sum = 0.0;
  // Destroying a Work waits for it, so the ranks stay in step.
  g_world->AllReduce({&one, 1, DType::kFloat64}, {&sum, 1, DType::kFloat64},
                     ReduceOptions());
  EXPECT_EQ(sum, g_world->size());
  EXPECT_THAT(g_world->Barrier(Timed()), IsOk());
}

TEST(MpiCommunicatorTest, CheckedGroupsReportDesynchronisation) {
  Communicator& comm = *g_checked_world;
  const int n = comm.size();
  const int me = comm.rank();
  const int last = n - 1;
  std::vector<float> in(5, 1.0f), out(5 * n);
  const auto desync = [](const std::string& what) {
    return StatusIs(absl::StatusCode::kInternal,
                    AllOf(HasSubstr("desynchronised"), HasSubstr(what)));
  };

  // The last rank calls a different collective.
  absl::Status status =
      me == last
          ? comm.AllGather({in.data(), 4, DType::kFloat32},
                           {out.data(), 4 * n, DType::kFloat32}, Timed())
                ->Wait()
          : comm.AllReduce({in.data(), 4, DType::kFloat32},
                           {out.data(), 4, DType::kFloat32}, ReduceOptions())
                ->Wait();
  EXPECT_THAT(status,
              desync(absl::StrFormat("rank %d called all_gather", last)));
  EXPECT_THAT(status, desync("called all_reduce"));

  // Counts differ.
  const int64_t count = me == last ? 5 : 4;
  status = comm.AllReduce({in.data(), count, DType::kFloat32},
                          {out.data(), count, DType::kFloat32}, ReduceOptions())
               ->Wait();
  EXPECT_THAT(status, desync("count 5"));
  EXPECT_THAT(status, desync("count 4"));

  // Reduce ops differ.
  ReduceOptions options;
  options.op = me == last ? ReduceOp::kMax : ReduceOp::kSum;
  EXPECT_THAT(comm.AllReduce({in.data(), 4, DType::kFloat32},
                             {out.data(), 4, DType::kFloat32}, options)
                  ->Wait(),
              desync("max"));

  // Dtypes differ.
  const DType dtype = me == last ? DType::kBFloat16 : DType::kFloat16;
  EXPECT_THAT(comm.AllReduce({in.data(), 2, dtype}, {out.data(), 2, dtype},
                             ReduceOptions())
                  ->Wait(),
              desync("bfloat16"));

  // Broadcast roots differ.
  BroadcastOptions root;
  root.timeout = conformance::kCaseTimeout;
  root.root = me == last ? 0 : last;
  EXPECT_THAT(comm.Broadcast({out.data(), 3, DType::kFloat32}, root)->Wait(),
              desync("root"));

  // One rank passes invalid arguments: it gets its own error, the others
  // learn which rank it was, and no one hangs.
  const int64_t out_count = me == last ? 4 * n + 1 : 4 * n;
  status = comm.AllGather({in.data(), 4, DType::kFloat32},
                          {out.data(), out_count, DType::kFloat32}, Timed())
               ->Wait();
  if (me == last) {
    EXPECT_THAT(status, StatusIs(absl::StatusCode::kInvalidArgument,
                                 HasSubstr(absl::StrFormat("rank %d", last))));
  } else {
    EXPECT_THAT(status, StatusIs(absl::StatusCode::kInternal,
                                 HasSubstr(absl::StrFormat(
                                     "rank(s) %d passed invalid", last))));
  }

  // The group is still usable and still checked, as are its subgroups.
  float one = 1.0f;
  float sum = 0.0f;
  EXPECT_THAT(comm.AllReduce({&one, 1, DType::kFloat32},
                             {&sum, 1, DType::kFloat32}, ReduceOptions())
                  ->Wait(),
              IsOk());
  EXPECT_EQ(sum, static_cast<float>(n));
  absl::StatusOr<std::unique_ptr<Communicator>> sub =
      comm.Split(0, me, Timed());
  ASSERT_THAT(sub, IsOk());
  EXPECT_TRUE(static_cast<MpiCommunicator&>(**sub).options().check_collectives);
  EXPECT_THAT((*sub)->Barrier(Timed()), IsOk());
}

TEST(MpiCommunicatorTest, UncheckedInvalidCallFailsOnlyLocally) {
  // Without the check, every rank failing alike is harmless: nothing was
  // sent, and the group continues.
  std::vector<float> in(2), out(1);
  EXPECT_THAT(g_world
                  ->AllGather({in.data(), 2, DType::kFloat32},
                              {out.data(), 1, DType::kFloat32}, Timed())
                  ->Wait(),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(g_world->Barrier(Timed()), IsOk());
  EXPECT_THAT(g_world->health(), IsOk());
}

TEST(MpiCommunicatorTest, UncheckedMismatchIsAnMpiErrorStatus) {
  // Without the check, counts that differ across ranks are MPI's undefined
  // behaviour; OpenMPI reports a receive of more data than expected as
  // MPI_ERR_TRUNCATE, which must come back as Internal, not abort the job.
  absl::StatusOr<std::unique_ptr<MpiCommunicator>> made =
      MpiCommunicator::Wrap(MPI_COMM_WORLD);
  ASSERT_THAT(made, IsOk());
  MpiCommunicator& comm = **made;
  const int n = comm.size();
  const int me = comm.rank();
  const int64_t count = me == n - 1 ? 5 : 4;
  std::vector<float> in(5 * n, 1.0f), out(5);
  ReduceOptions options;
  options.timeout = absl::Seconds(5);
  const absl::Status status =
      comm.ReduceScatter({in.data(), count * n, DType::kFloat32},
                         {out.data(), count, DType::kFloat32}, options)
          ->Wait();
  // The last rank receives less than it expects, which MPI accepts: its
  // result is silently wrong (the check exists for that).
  if (me != n - 1) {
    EXPECT_THAT(status, StatusIs(absl::StatusCode::kInternal,
                                 AllOf(HasSubstr(absl::StrFormat(
                                           "rank %d: reduce_scatter #0", me)),
                                       HasSubstr("MPI_ERR_TRUNCATE"))));
    EXPECT_THAT(comm.health(), StatusIs(absl::StatusCode::kInternal));
    EXPECT_THAT(comm.Barrier(Timed()), StatusIs(absl::StatusCode::kAborted));
  }
  EXPECT_THAT(g_world->Barrier(Timed()), IsOk());
  EXPECT_EQ(PendingAbandonedMpiRequests(), 0);
}

TEST(MpiCommunicatorTest, TimeoutBreaksTheCommunicatorWithoutHanging) {
  // A communicator of its own, so that breaking it leaves g_world intact.
  absl::StatusOr<std::unique_ptr<MpiCommunicator>> made =
      MpiCommunicator::Wrap(MPI_COMM_WORLD);
  ASSERT_THAT(made, IsOk());
  MpiCommunicator& comm = **made;
  const int n = comm.size();
  const int me = comm.rank();
  const int last = n - 1;
  std::vector<float> in(3, static_cast<float>(me + 1)), out(3 * n, 0.0f);
  const ConstBufferRef input{in.data(), 3, DType::kFloat32};
  const BufferRef output{out.data(), 3 * n, DType::kFloat32};

  if (me != last) {
    // The last rank skips this all-gather.
    const absl::Duration timeout = absl::Milliseconds(300);
    const absl::Time start = absl::Now();
    const absl::Status status =
        comm.AllGather(input, output, Timed(timeout))->Wait();
    const absl::Duration waited = absl::Now() - start;
    EXPECT_THAT(
        status,
        StatusIs(absl::StatusCode::kDeadlineExceeded,
                 AllOf(HasSubstr(absl::StrFormat("rank %d: ", me)),
                       HasSubstr("all_gather #0"), HasSubstr("3 x float32"),
                       HasSubstr("MPI_Iallgather"))));
    EXPECT_GE(waited, timeout);
    EXPECT_LT(waited, timeout + absl::Seconds(10));
    EXPECT_THAT(comm.health(), StatusIs(absl::StatusCode::kDeadlineExceeded));
    // Later calls fail fast, even with a long timeout.
    const absl::Time later = absl::Now();
    EXPECT_THAT(
        comm.Barrier(Timed(absl::Minutes(5))),
        StatusIs(absl::StatusCode::kAborted,
                 AllOf(HasSubstr("barrier #1"), HasSubstr("all_gather #0"),
                       HasSubstr("timed out"))));
    EXPECT_THAT(
        comm.AllReduce(input, {out.data(), 3, DType::kFloat32}, ReduceOptions())
            ->Wait(),
        StatusIs(absl::StatusCode::kAborted, HasSubstr("all_reduce #2")));
    EXPECT_THAT(comm.Split(0, 0, Timed()),
                StatusIs(absl::StatusCode::kAborted));
    EXPECT_LT(absl::Now() - later, absl::Seconds(1));
  }
  EXPECT_THAT(g_world->Barrier(Timed()), IsOk());
  if (me == last) {
    // Joining late lets the peers' abandoned requests complete, so that
    // MPI shuts down cleanly; the late joiner gets everyone's data.
    EXPECT_THAT(comm.AllGather(input, output, Timed())->Wait(), IsOk());
    for (int i = 0; i < 3 * n; ++i) EXPECT_EQ(out[i], i / 3 + 1);
    EXPECT_THAT(comm.health(), IsOk());
  }
  EXPECT_THAT(g_world->Barrier(Timed()), IsOk());
  // The abandoned all-gathers complete now that the last rank joined.
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (PendingAbandonedMpiRequests() > 0 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  EXPECT_EQ(PendingAbandonedMpiRequests(), 0);
  EXPECT_THAT(g_world->Barrier(Timed()), IsOk());
}

}  // namespace
}  // namespace flatparam

int main(int argc, char** argv) {
  absl::StatusOr<flatparam::MpiSession> session =
      flatparam::MpiSession::Start(&argc, &argv);
  if (!session.ok()) {
    std::fprintf(stderr, "%s\n", session.status().ToString().c_str());
    return 1;
  }
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  flatparam::InitGoogleTestOnMpiRank(rank, &argc, argv);

  bool failed = false;
  {
    flatparam::MpiOptions checked;
    checked.check_collectives = true;
    auto world = flatparam::MpiCommunicator::CreateWorld();
    auto checked_world = flatparam::MpiCommunicator::CreateWorld(checked);
    if (!world.ok() || !checked_world.ok()) {
      std::fprintf(stderr, "[rank %d] %s %s\n", rank,
                   world.status().ToString().c_str(),
                   checked_world.status().ToString().c_str());
      return 1;
    }
    flatparam::g_world = world->get();
    flatparam::g_checked_world = checked_world->get();
    failed = flatparam::RunAllTestsOnAllRanks(**world);
    flatparam::g_world = nullptr;
    flatparam::g_checked_world = nullptr;
  }
  const absl::Status finalized = session->Finish();
  if (!finalized.ok()) {
    std::fprintf(stderr, "[rank %d] %s\n", rank, finalized.ToString().c_str());
    failed = true;
  }
  return failed ? 1 : 0;
}
