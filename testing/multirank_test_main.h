// Running one GoogleTest binary on every rank of a multi-process job
// (test-only), whatever launched it (mpirun, torchrun, a script) and
// whichever Communicator joins the ranks.
//
//   Communicator* g_world = nullptr;  // the tests use it
//   int main(int argc, char** argv) {
//     return MultirankGtestMain(&argc, argv, &g_world);
//   }
//
// Rank 0 keeps gtest's printer and Bazel's result files; the other ranks
// print only their failures, prefixed "[rank N]", so a failure on any rank
// is visible in the one test log.
//
// Thread-safety: call from the main thread, once.
#ifndef FLATPARAM_TESTING_MULTIRANK_TEST_MAIN_H_
#define FLATPARAM_TESTING_MULTIRANK_TEST_MAIN_H_

#include "comm/communicator.h"

namespace flatparam {

// InitGoogleTest for rank `rank` of the job (see the file comment).
void InitGoogleTestOnRank(int rank, int* argc, char** argv);

// Runs every test on this rank, then combines every rank's verdict over
// `world` (a max all-reduce), so that all ranks exit alike. Returns true
// when any rank failed (or the verdicts could not be combined).
bool RunAllTestsOnAllRanks(Communicator& world);

// The whole main() of a multi-process gtest binary whose tests use one
// world communicator, stored in `*world` while the tests run (null before
// and after). Declared here, defined by the backend's library the binary
// links, so that one test file builds for every backend:
//   //comm/mpi:mpi_test_main    under mpirun;
//   //comm/c10d:c10d_test_main  as torchrun's workers (the world from
//                           C10dCommunicator::FromEnvironment).
// Returns the exit code: 0 when every test passed on every rank; failures
// to start are printed to stderr.
int MultirankGtestMain(int* argc, char** argv, Communicator** world);

}  // namespace flatparam

#endif  // FLATPARAM_TESTING_MULTIRANK_TEST_MAIN_H_
