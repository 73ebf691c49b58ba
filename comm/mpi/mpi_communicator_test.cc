// Tests of the MPI backend. This binary is a multi-process test: run it
// under mpirun (mpirun_test.sh does, with 4 ranks; any size >= 2 works).
// main() initialises MPI before gtest, keeps the world communicators alive
// for every test, destroys them, combines every rank's verdict, and only
// then finalises MPI. Rank 0 prints gtest's output; the other ranks print
// only their failures, prefixed with "[rank N]".
//
// With --mpi_thread_level=serialized, main() initialises MPI itself with
// MPI_THREAD_SERIALIZED, so the backend runs without its progress thread
// (collectives progress only inside Wait()); the tests that need the thread
// skip.
//
// The backend-independent cases are comm/conformance's suite and run three
// times: zero-copy with and without MpiOptions::check_collectives, and with
// MpiOptions::stage_buffers.
#include "comm/mpi/mpi_communicator.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "comm/communicator.h"
#include "comm/conformance/bandwidth.h"
#include "comm/conformance/case_values.h"
#include "comm/conformance/collective_cases.h"
#include "comm/conformance/collective_cases_testutil.h"
#include "comm/conformance/device_memory.h"
#include "comm/mpi/mpi_test_main.h"
#include "flatparam/base/status_matchers.h"

namespace flatparam {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;

// Set up by main() around RUN_ALL_TESTS.
MpiCommunicator* g_world = nullptr;          // check_collectives = false
MpiCommunicator* g_checked_world = nullptr;  // check_collectives = true
MpiCommunicator* g_staged_world = nullptr;   // stage_buffers = true

CollectiveOptions Timed(absl::Duration timeout = conformance::kCaseTimeout) {
  CollectiveOptions options;
  options.timeout = timeout;
  return options;
}

// Which world communicator a parameterised test runs on.
enum class World { kUnchecked, kChecked, kStaged };

MpiCommunicator& WorldOf(World world) {
  switch (world) {
    case World::kChecked:
      return *g_checked_world;
    case World::kStaged:
      return *g_staged_world;
    default:
      return *g_world;
  }
}

std::string WorldName(const ::testing::TestParamInfo<World>& info) {
  switch (info.param) {
    case World::kChecked:
      return "Checked";
    case World::kStaged:
      return "Staged";
    default:
      return "Unchecked";
  }
}

class ConformanceTest : public ::testing::TestWithParam<World> {
 protected:
  Communicator& comm() { return WorldOf(GetParam()); }

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

INSTANTIATE_TEST_SUITE_P(Mpi, ConformanceTest,
                         ::testing::Values(World::kUnchecked, World::kChecked,
                                           World::kStaged),
                         WorldName);

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
  EXPECT_FALSE(g_world->options().stage_buffers);
  EXPECT_TRUE(g_staged_world->options().stage_buffers);
}

TEST(MpiCommunicatorTest, ProgressThreadIffMpiThreadMultiple) {
  int provided = MPI_THREAD_SINGLE;
  MPI_Query_thread(&provided);
  EXPECT_EQ(MpiHasProgressThread(), provided == MPI_THREAD_MULTIPLE)
      << "MPI thread level " << provided;
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
                       HasSubstr("MPI_Isend/MPI_Irecv (all-gather)"))));
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

// ---------------------------------------------------------------------------
// Progress, zero-copy and ordering.

// Every rank's part of a float all-gather, reduce-scatter or all-reduce in
// the progress tests: rank r's element i is r + 1 + i % 7 (sums exact).
float ValueOf(int rank, int64_t i) {
  return static_cast<float>(rank + 1 + i % 7);
}

// Whether `got` holds the expected all-gather of ValueOf with `count`
// elements per rank.
bool IsGathered(const std::vector<float>& got, int n, int64_t count) {
  for (int r = 0; r < n; ++r) {
    for (int64_t i = 0; i < count; ++i) {
      if (got[r * count + i] != ValueOf(r, i)) return false;
    }
  }
  return true;
}

// The sum over n ranks of ValueOf at index i.
float SumOf(int n, int64_t i) {
  float sum = 0;
  for (int r = 0; r < n; ++r) sum += ValueOf(r, i);
  return sum;
}

TEST(MpiCommunicatorTest, CollectivesProgressWhileARankComputes) {
  if (!MpiHasProgressThread()) {
    GTEST_SKIP() << "no progress thread below MPI_THREAD_MULTIPLE";
  }
  // A communicator of its own, so that a failure leaves g_world intact.
  absl::StatusOr<std::unique_ptr<MpiCommunicator>> made =
      MpiCommunicator::Wrap(MPI_COMM_WORLD);
  ASSERT_THAT(made, IsOk());
  MpiCommunicator& comm = **made;
  const int n = comm.size();
  const int me = comm.rank();
  const int sleeper = n - 1;
  // Above MPI's eager limits, so that every transfer needs the sleeper's
  // MPI to act, and above the single-collective all-reduce, so that its
  // second step must start while the sleeper sleeps.
  const int64_t count = int64_t{1} << 18;
  std::vector<float> gather_in(count), gather_out(count * n);
  std::vector<float> scatter_in(count * n), scatter_out(count);
  std::vector<float> reduce_in(count), reduce_out(count);
  for (int64_t i = 0; i < count; ++i) {
    gather_in[i] = reduce_in[i] = ValueOf(me, i);
  }
  for (int64_t i = 0; i < count * n; ++i) scatter_in[i] = ValueOf(me, i);
  const absl::Duration sleep = absl::Seconds(1);
  ReduceOptions sum;
  // The sleeper's is shorter than its sleep: only Wait() enforces the
  // deadline, and its collectives will have completed before it waits.
  sum.timeout = me == sleeper ? absl::Milliseconds(500) : absl::Seconds(5);
  ASSERT_THAT(g_world->Barrier(Timed()), IsOk());

  const absl::Time start = absl::Now();
  std::unique_ptr<Work> gather =
      comm.AllGather({gather_in.data(), count, DType::kFloat32},
                     {gather_out.data(), count * n, DType::kFloat32}, sum);
  std::unique_ptr<Work> scatter =
      comm.ReduceScatter({scatter_in.data(), count * n, DType::kFloat32},
                         {scatter_out.data(), count, DType::kFloat32}, sum);
  std::unique_ptr<Work> reduce =
      comm.AllReduce({reduce_in.data(), count, DType::kFloat32},
                     {reduce_out.data(), count, DType::kFloat32}, sum);
  if (me == sleeper) {
    // Computes, without calling into the communicator.
    absl::SleepFor(sleep);
    const absl::Time waiting = absl::Now();
    EXPECT_THAT(reduce->Wait(), IsOk());
    EXPECT_THAT(scatter->Wait(), IsOk());
    EXPECT_THAT(gather->Wait(), IsOk());
    // They were done already.
    EXPECT_LT(absl::Now() - waiting, absl::Milliseconds(100));
  } else {
    EXPECT_THAT(gather->Wait(), IsOk());
    EXPECT_THAT(scatter->Wait(), IsOk());
    EXPECT_THAT(reduce->Wait(), IsOk());
    // Well before the sleeper waits.
    const absl::Duration waited = absl::Now() - start;
    EXPECT_LT(waited, sleep / 2) << "rank " << me;
  }
  EXPECT_TRUE(IsGathered(gather_out, n, count));
  int64_t wrong = 0;
  for (int64_t i = 0; i < count; ++i) {
    wrong += scatter_out[i] != SumOf(n, me * count + i);
    wrong += reduce_out[i] != SumOf(n, i);
  }
  EXPECT_EQ(wrong, 0);
  EXPECT_THAT(g_world->Barrier(Timed()), IsOk());
}

// Wait() called while the progress thread runs a collective's fold must
// return only after the fold: the engine marks the collective done under
// its mutex after the last write. The delays sweep past the moment the
// all-to-all completes, so that some Waits land during the fold (when the
// ordering is removed, about one in ten did in trials, and the check
// failed).
TEST(MpiCommunicatorTest, WaitDuringABackgroundFoldSeesTheWholeResult) {
  if (!MpiHasProgressThread()) {
    GTEST_SKIP() << "no progress thread below MPI_THREAD_MULTIPLE";
  }
  MpiCommunicator& comm = *g_world;
  const int n = comm.size();
  const int me = comm.rank();
  const int64_t count = int64_t{1} << 18;
  std::vector<float> in(count * n), out(count);
  for (int64_t i = 0; i < count * n; ++i) in[i] = ValueOf(me, i);
  auto run = [&](absl::Duration delay) {
    std::fill(out.begin(), out.end(), 0.0f);
    const absl::Time start = absl::Now();
    std::unique_ptr<Work> work = comm.ReduceScatter(
        {in.data(), count * n, DType::kFloat32},
        {out.data(), count, DType::kFloat32}, ReduceOptions());
    absl::SleepFor(delay);
    const absl::Status status = work->Wait();
    int64_t wrong = 0;
    for (int64_t i = 0; i < count; ++i) {
      wrong += out[i] != SumOf(n, me * count + i);
    }
    EXPECT_THAT(status, IsOk());
    EXPECT_EQ(wrong, 0) << "after a delay of " << delay;
    return absl::Now() - start;
  };
  // How long one takes, waited on at once (every rank's, the longest).
  double took = absl::ToDoubleMicroseconds(run(absl::ZeroDuration()));
  double longest = 0;
  MPI_Allreduce(&took, &longest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  for (int k = 0; k < 40; ++k) {
    run(absl::Microseconds(longest * 0.075 * k));
  }
  EXPECT_THAT(g_world->Barrier(Timed()), IsOk());
}

TEST(MpiCommunicatorTest, LaterStepsStartInIssueOrderOnEveryRank) {
  // A communicator of its own: a desynchronised one would be unusable.
  absl::StatusOr<std::unique_ptr<MpiCommunicator>> made =
      MpiCommunicator::Wrap(MPI_COMM_WORLD);
  ASSERT_THAT(made, IsOk());
  MpiCommunicator& comm = **made;
  const int n = comm.size();
  const int me = comm.rank();
  // A two-step all-reduce (all-to-all, then all-gather) and an all-gather.
  // Rank 0 issues the all-gather only after its all-reduce's first step
  // completed and its second started (in the background, or at the latest
  // in the all-gather's Wait); the others issue both at once, before the
  // all-reduce's first step can complete. MPI must see the all-reduce's
  // second step before the all-gather on every rank.
  const int64_t count = int64_t{1} << 16;
  std::vector<float> reduce_in(count), reduce_out(count);
  for (int64_t i = 0; i < count; ++i) reduce_in[i] = ValueOf(me, i);
  std::vector<float> gather_in(5), gather_out(5 * n);
  for (int64_t i = 0; i < 5; ++i) gather_in[i] = ValueOf(me, i);
  ReduceOptions options;
  options.timeout = absl::Seconds(10);
  std::unique_ptr<Work> reduce =
      comm.AllReduce({reduce_in.data(), count, DType::kFloat32},
                     {reduce_out.data(), count, DType::kFloat32}, options);
  if (me == 0) absl::SleepFor(absl::Milliseconds(300));
  std::unique_ptr<Work> gather =
      comm.AllGather({gather_in.data(), 5, DType::kFloat32},
                     {gather_out.data(), 5 * n, DType::kFloat32}, options);
  EXPECT_THAT(gather->Wait(), IsOk());
  EXPECT_THAT(reduce->Wait(), IsOk());
  EXPECT_TRUE(IsGathered(gather_out, n, 5));
  int64_t wrong = 0;
  for (int64_t i = 0; i < count; ++i) wrong += reduce_out[i] != SumOf(n, i);
  EXPECT_EQ(wrong, 0);
  EXPECT_THAT(g_world->Barrier(Timed()), IsOk());
}

TEST(MpiCommunicatorTest, ZeroCopyCollectivesStageNothing) {
  MpiCommunicator& comm = *g_world;
  const int n = comm.size();
  const int me = comm.rank();
  const int64_t count = 1000;
  std::vector<float> in(count * n), out(count * n);
  for (int64_t i = 0; i < count * n; ++i) in[i] = ValueOf(me, i);
  const int64_t before = MpiStagedBytes();

  // all_gather, out of place and in place.
  EXPECT_THAT(comm.AllGather({in.data(), count, DType::kFloat32},
                             {out.data(), count * n, DType::kFloat32}, Timed())
                  ->Wait(),
              IsOk());
  EXPECT_TRUE(IsGathered(out, n, count));
  std::fill(out.begin(), out.end(), 0.0f);
  std::copy(in.begin(), in.begin() + count, out.begin() + me * count);
  EXPECT_THAT(comm.AllGather({out.data() + me * count, count, DType::kFloat32},
                             {out.data(), count * n, DType::kFloat32}, Timed())
                  ->Wait(),
              IsOk());
  EXPECT_TRUE(IsGathered(out, n, count));
  // reduce_scatter; all_reduce, small (one all-gather) and large (all-to-all
  // and all-gather), in place; broadcast.
  EXPECT_THAT(
      comm.ReduceScatter({in.data(), count * n, DType::kFloat32},
                         {out.data(), count, DType::kFloat32}, ReduceOptions())
          ->Wait(),
      IsOk());
  EXPECT_EQ(out[0], SumOf(n, me * count));
  for (const int64_t c : {int64_t{3}, count * n}) {
    std::copy(in.begin(), in.begin() + c, out.begin());
    EXPECT_THAT(
        comm.AllReduce({out.data(), c, DType::kFloat32},
                       {out.data(), c, DType::kFloat32}, ReduceOptions())
            ->Wait(),
        IsOk());
    EXPECT_EQ(out[c - 1], SumOf(n, c - 1));
  }
  BroadcastOptions root;
  root.timeout = conformance::kCaseTimeout;
  std::copy(in.begin(), in.end(), out.begin());
  EXPECT_THAT(
      comm.Broadcast({out.data(), count, DType::kFloat32}, root)->Wait(),
      IsOk());
  EXPECT_EQ(out[1], ValueOf(0, 1));
  EXPECT_EQ(MpiStagedBytes(), before);

  // The staging option copies each input in and each result out.
  const int64_t bytes = count * static_cast<int64_t>(sizeof(float));
  EXPECT_THAT(g_staged_world
                  ->AllGather({in.data(), count, DType::kFloat32},
                              {out.data(), count * n, DType::kFloat32}, Timed())
                  ->Wait(),
              IsOk());
  EXPECT_TRUE(IsGathered(out, n, count));
  EXPECT_EQ(MpiStagedBytes(), before + bytes + n * bytes);

  // An input that overlaps the output other than in place is staged
  // (MPI forbids it), and only the input.
  const int64_t staged = MpiStagedBytes();
  std::vector<float> shifted(count * n + 1);
  std::copy(in.begin(), in.begin() + count, shifted.begin() + 1);
  EXPECT_THAT(
      comm.AllGather({shifted.data() + 1, count, DType::kFloat32},
                     {shifted.data(), count * n, DType::kFloat32}, Timed())
          ->Wait(),
      IsOk());
  shifted.pop_back();
  EXPECT_TRUE(IsGathered(shifted, n, count));
  EXPECT_EQ(MpiStagedBytes(), staged + bytes);
}

// Zero-copy, a timed-out all-gather's MPI request still writes the caller's
// output when the missing rank arrives (so the caller must keep it, as the
// error says); staged, the caller's output is never written after Wait().
TEST(MpiCommunicatorTest, TimedOutAllGatherWritesInPlaceOnlyWhenZeroCopy) {
  const int n = g_world->size();
  const int me = g_world->rank();
  const int last = n - 1;
  for (const bool stage : {false, true}) {
    SCOPED_TRACE(stage ? "staged" : "zero-copy");
    MpiOptions options;
    options.stage_buffers = stage;
    absl::StatusOr<std::unique_ptr<MpiCommunicator>> made =
        MpiCommunicator::Wrap(MPI_COMM_WORLD, options);
    ASSERT_THAT(made, IsOk());
    MpiCommunicator& comm = **made;
    const int64_t count = 1000;
    std::vector<float> in(count), out(count * n, 0.0f);
    for (int64_t i = 0; i < count; ++i) in[i] = ValueOf(me, i);
    const ConstBufferRef input{in.data(), count, DType::kFloat32};
    const BufferRef output{out.data(), count * n, DType::kFloat32};
    if (me != last) {
      // The last rank comes only after this timed out.
      const absl::Status status =
          comm.AllGather(input, output, Timed(absl::Milliseconds(300)))->Wait();
      EXPECT_THAT(status, StatusIs(absl::StatusCode::kDeadlineExceeded));
      if (stage) {
        EXPECT_THAT(status.message(), Not(HasSubstr("keep both alive")));
      } else {
        EXPECT_THAT(status.message(),
                    HasSubstr("MPI may still read this collective's input "
                              "and write its output, so keep both alive"));
      }
    }
    EXPECT_THAT(g_world->Barrier(Timed()), IsOk());
    if (me == last) {
      EXPECT_THAT(comm.AllGather(input, output, Timed())->Wait(), IsOk());
      EXPECT_TRUE(IsGathered(out, n, count));
    }
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (PendingAbandonedMpiRequests() > 0 && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(1));
    }
    ASSERT_EQ(PendingAbandonedMpiRequests(), 0);
    if (me != last) {
      if (stage) {
        EXPECT_TRUE(std::all_of(out.begin(), out.end(),
                                [](float v) { return v == 0.0f; }));
      } else {
        // Including the last rank's part, which arrived after the timeout.
        EXPECT_TRUE(IsGathered(out, n, count));
      }
    }
    EXPECT_THAT(g_world->Barrier(Timed()), IsOk());
  }
}

TEST(MpiCommunicatorTest, QueuedCollectiveTimesOutBeforeItStarts) {
  // Checked collectives have two steps (the header exchange, then the
  // data), so the one issued after a stalled one waits in the queue.
  MpiOptions checked;
  checked.check_collectives = true;
  absl::StatusOr<std::unique_ptr<MpiCommunicator>> made =
      MpiCommunicator::Wrap(MPI_COMM_WORLD, checked);
  ASSERT_THAT(made, IsOk());
  MpiCommunicator& comm = **made;
  const int n = comm.size();
  const int me = comm.rank();
  const int last = n - 1;
  std::vector<float> in(3, 1.0f), out(3 * n), out2(3 * n);
  const ConstBufferRef input{in.data(), 3, DType::kFloat32};
  if (me != last) {
    // The last rank skips both.
    std::unique_ptr<Work> first =
        comm.AllGather(input, {out.data(), 3 * n, DType::kFloat32},
                       Timed(absl::Milliseconds(600)));
    std::unique_ptr<Work> second =
        comm.AllGather(input, {out2.data(), 3 * n, DType::kFloat32},
                       Timed(absl::Milliseconds(200)));
    const absl::Time start = absl::Now();
    EXPECT_THAT(
        second->Wait(),
        StatusIs(absl::StatusCode::kDeadlineExceeded,
                 AllOf(HasSubstr("all_gather #1"),
                       HasSubstr("before it started, queued behind "
                                 "rank " +
                                 std::to_string(me) + ": all_gather #0"))));
    EXPECT_LT(absl::Now() - start, absl::Milliseconds(550));
    EXPECT_THAT(comm.health(), StatusIs(absl::StatusCode::kDeadlineExceeded,
                                        HasSubstr("all_gather #1")));
    // The first one stays in flight until its own deadline.
    EXPECT_THAT(first->Wait(),
                StatusIs(absl::StatusCode::kDeadlineExceeded,
                         AllOf(HasSubstr("all_gather #0"),
                               HasSubstr("check header) (step 1 of 2)"))));
    EXPECT_THAT(comm.Barrier(Timed()), StatusIs(absl::StatusCode::kAborted));
  }
  EXPECT_THAT(g_world->Barrier(Timed()), IsOk());
  if (me == last) {
    // A different call completes the peers' abandoned header exchange
    // without a data step on either side.
    EXPECT_THAT(
        comm.AllGather({in.data(), 2, DType::kFloat32},
                       {out.data(), 2 * n, DType::kFloat32}, Timed())
            ->Wait(),
        StatusIs(absl::StatusCode::kInternal, HasSubstr("desynchronised")));
    EXPECT_THAT(comm.health(), IsOk());
  }
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (PendingAbandonedMpiRequests() > 0 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  EXPECT_EQ(PendingAbandonedMpiRequests(), 0);
  EXPECT_THAT(g_world->Barrier(Timed()), IsOk());
}

// Every conformance case issued at once on every rank, the ranks computing
// for different times before they wait, then waiting in reverse order: the
// folds and later steps run in the background, in any interleaving, and
// every output equals HostReduce's bit for bit (ExpectedOutput).
class InFlightTest : public ::testing::TestWithParam<World> {};

TEST_P(InFlightTest, ManyCollectivesInFlightMatchHostReduce) {
  MpiCommunicator& comm = WorldOf(GetParam());
  const int n = comm.size();
  const int me = comm.rank();
  conformance::SuiteOptions suite;
  suite.large_elements = 100003;
  const std::vector<conformance::CollectiveCase> cases =
      conformance::CollectiveCases(n, suite);
  struct Issued {
    const conformance::CollectiveCase* c;
    std::vector<char> input;
    std::vector<char> output;
    std::unique_ptr<Work> work;
  };
  std::vector<Issued> issued(cases.size());
  for (size_t k = 0; k < cases.size(); ++k) {
    const conformance::CollectiveCase& c = cases[k];
    Issued& x = issued[k];
    x.c = &c;
    const int64_t elem = DTypeSize(c.dtype);
    conformance::HostBuffer host(c.dtype, c.input_count(n));
    conformance::FillInput(c, me, 0, host.ref());
    x.input.assign(static_cast<const char*>(host.data()),
                   static_cast<const char*>(host.data()) + host.bytes());
    x.output.assign(c.output_count(n) * elem, 0x5a);
    ConstBufferRef in{x.input.data(), c.input_count(n), c.dtype};
    BufferRef out{x.output.data(), c.output_count(n), c.dtype};
    switch (c.kind) {
      case conformance::CollectiveKind::kAllGather:
        if (c.in_place) {
          if (c.count > 0) {  // empty vectors' data() may be null
            std::memcpy(x.output.data() + me * c.count * elem, x.input.data(),
                        c.count * elem);
          }
          in = out.Slice(me * c.count, c.count);
        }
        x.work = comm.AllGather(in, out, Timed());
        break;
      case conformance::CollectiveKind::kReduceScatter:
        if (c.in_place)
          out = BufferRef{x.input.data(), c.input_count(n), c.dtype}.Slice(
              me * c.count, c.count);
        x.work = comm.ReduceScatter(in, out, c.reduce_options());
        break;
      case conformance::CollectiveKind::kAllReduce:
        if (c.in_place) out = BufferRef{x.input.data(), c.count, c.dtype};
        x.work = comm.AllReduce(in, out, c.reduce_options());
        break;
      case conformance::CollectiveKind::kBroadcast: {
        if (me == c.root) x.output = x.input;
        BroadcastOptions options;
        options.root = c.root;
        x.work = comm.Broadcast(out, options);
        break;
      }
    }
  }
  absl::SleepFor(absl::Milliseconds(40 * me));
  for (size_t k = issued.size(); k-- > 0;) {
    ASSERT_THAT(issued[k].work->Wait(), IsOk()) << issued[k].c->Name();
  }
  int64_t failed = 0;
  for (Issued& x : issued) {
    const conformance::CollectiveCase& c = *x.c;
    const conformance::HostBuffer want = conformance::ExpectedOutput(c, n, me);
    const char* got = x.output.data();
    if (c.in_place && c.kind == conformance::CollectiveKind::kReduceScatter) {
      got = x.input.data() + me * c.count * DTypeSize(c.dtype);
    } else if (c.in_place &&
               c.kind == conformance::CollectiveKind::kAllReduce) {
      got = x.input.data();
    }
    int64_t first = -1;
    const int64_t wrong = conformance::CountMismatches(
        got, want.data(), want.count(), c.dtype, &first);
    if (wrong > 0 && ++failed <= 5) {
      ADD_FAILURE() << c.Name() << ": " << wrong << " wrong, "
                    << conformance::DescribeMismatch(got, want.data(), c.dtype,
                                                     first);
    }
  }
  EXPECT_EQ(failed, 0) << "of " << cases.size() << " cases";
}

INSTANTIATE_TEST_SUITE_P(Mpi, InFlightTest,
                         ::testing::Values(World::kUnchecked, World::kChecked,
                                           World::kStaged),
                         WorldName);

}  // namespace
}  // namespace flatparam

int main(int argc, char** argv) {
  // --mpi_thread_level=serialized: initialise MPI here, below
  // MPI_THREAD_MULTIPLE, as a program that owns MPI might.
  bool serialized = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--mpi_thread_level=serialized") == 0) {
      serialized = true;
      for (int j = i; j < argc; ++j) argv[j] = argv[j + 1];
      --argc;
      break;
    }
  }
  if (serialized) {
    int provided = 0;
    if (MPI_Init_thread(&argc, &argv, MPI_THREAD_SERIALIZED, &provided) !=
            MPI_SUCCESS ||
        MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN) !=
            MPI_SUCCESS) {
      std::fprintf(stderr, "MPI_Init_thread(MPI_THREAD_SERIALIZED) failed\n");
      return 1;
    }
  }
  absl::StatusOr<flatparam::MpiSession> session =
      flatparam::MpiSession::Start(&argc, &argv);
  if (!session.ok()) {
    std::fprintf(stderr, "%s\n", session.status().ToString().c_str());
    return 1;
  }
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  flatparam::InitGoogleTestOnRank(rank, &argc, argv);

  bool failed = false;
  {
    flatparam::MpiOptions checked;
    checked.check_collectives = true;
    flatparam::MpiOptions staged;
    staged.stage_buffers = true;
    auto world = flatparam::MpiCommunicator::CreateWorld();
    auto checked_world = flatparam::MpiCommunicator::CreateWorld(checked);
    auto staged_world = flatparam::MpiCommunicator::CreateWorld(staged);
    if (!world.ok() || !checked_world.ok() || !staged_world.ok()) {
      std::fprintf(stderr, "[rank %d] %s %s %s\n", rank,
                   world.status().ToString().c_str(),
                   checked_world.status().ToString().c_str(),
                   staged_world.status().ToString().c_str());
      return 1;
    }
    flatparam::g_world = world->get();
    flatparam::g_checked_world = checked_world->get();
    flatparam::g_staged_world = staged_world->get();
    failed = flatparam::RunAllTestsOnAllRanks(**world);
    flatparam::g_world = nullptr;
    flatparam::g_checked_world = nullptr;
    flatparam::g_staged_world = nullptr;
  }
  absl::Status finalized = session->Finish();
  if (finalized.ok() && serialized) {
    finalized = flatparam::FinalizeMpi();
    if (MPI_Finalize() != MPI_SUCCESS) {
      finalized = absl::InternalError("MPI_Finalize failed");
    }
  }
  if (!finalized.ok()) {
    std::fprintf(stderr, "[rank %d] %s\n", rank, finalized.ToString().c_str());
    failed = true;
  }
  return failed ? 1 : 0;
}
