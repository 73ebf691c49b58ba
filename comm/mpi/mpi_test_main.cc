#include "comm/mpi/mpi_test_main.h"

#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdio>
#include <cstdlib>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace flatparam {

// MultirankGtestMain under mpirun: MpiSession::Start, the world
// (MpiCommunicator::CreateWorld), the tests, MpiSession::Finish.
int MultirankGtestMain(int* argc, char** argv, Communicator** world) {
  absl::StatusOr<MpiSession> session = MpiSession::Start(argc, &argv);
  if (!session.ok()) {
    std::fprintf(stderr, "%s\n", session.status().ToString().c_str());
    return 1;
  }
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  InitGoogleTestOnRank(rank, argc, argv);
  bool failed = false;
  {
    absl::StatusOr<std::unique_ptr<MpiCommunicator>> created =
        MpiCommunicator::CreateWorld();
    if (!created.ok()) {
      std::fprintf(stderr, "[rank %d] %s\n", rank,
                   created.status().ToString().c_str());
      return 1;
    }
    *world = created->get();
    failed = RunAllTestsOnAllRanks(**created);
    *world = nullptr;
  }
  const absl::Status finished = session->Finish();
  if (!finished.ok()) {
    std::fprintf(stderr, "[rank %d] %s\n", rank, finished.ToString().c_str());
    failed = true;
  }
  return failed ? 1 : 0;
}

}  // namespace flatparam
