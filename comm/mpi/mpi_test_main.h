// Multi-process GoogleTest binaries under mpirun (test-only): this library
// defines testing/multirank_test_main.h's MultirankGtestMain for MPI
// (MpiSession::Start, InitGoogleTestOnRank, the world from
// MpiCommunicator::CreateWorld, RunAllTestsOnAllRanks, MpiSession::Finish;
// a failure to finish MPI cleanly fails the run). Binaries with a main()
// of their own (mpi_communicator_test's) use the pieces directly.
//
//   Communicator* g_world = nullptr;
//   int main(int argc, char** argv) {
//     return MultirankGtestMain(&argc, argv, &g_world);
//   }
//
// Thread-safety: call from the main thread, once.
#ifndef FLATPARAM_COMM_MPI_MPI_TEST_MAIN_H_
#define FLATPARAM_COMM_MPI_MPI_TEST_MAIN_H_

#include "comm/communicator.h"
#include "comm/mpi/mpi_communicator.h"
#include "testing/multirank_test_main.h"

#endif  // FLATPARAM_COMM_MPI_MPI_TEST_MAIN_H_
