// Running one GoogleTest binary on every rank of an mpirun job (test-only).
//
//   int main(int argc, char** argv) {
//     auto session = MpiSession::Start(&argc, &argv);
//     int rank = 0;
//     MPI_Comm_rank(MPI_COMM_WORLD, &rank);
//     InitGoogleTestOnRank(rank, &argc, argv);
//     auto world = MpiCommunicator::CreateWorld();
//     const bool failed = RunAllTestsOnAllRanks(**world);
//     ...
//   }
//
// Rank 0 keeps gtest's printer and Bazel's result files; the other ranks print
// only their failures, prefixed "[rank N]", so a failure on any rank is
// visible in the one test log.
//
// Thread-safety: call from the main thread, once.
#ifndef FLATPARAM_COMM_MPI_MPI_GTEST_H_
#define FLATPARAM_COMM_MPI_MPI_GTEST_H_

#include "comm/communicator.h"
#include "comm/mpi/mpi_communicator.h"
#include "testing/multirank_gtest.h"

namespace flatparam {

// The whole main() of a multi-process gtest binary whose tests use one
// world communicator: MpiSession::Start, InitGoogleTestOnRank, the
// world (MpiCommunicator::CreateWorld, stored in `*world` while the tests
// run, null before and after), RunAllTestsOnAllRanks, MpiSession::Finish.
// Returns the exit code: 0 when every test passed on every rank and MPI
// finished cleanly; failures to start are printed to stderr.
int MpiGtestMain(int* argc, char** argv, MpiCommunicator** world);

}  // namespace flatparam

#endif  // FLATPARAM_COMM_MPI_MPI_GTEST_H_
