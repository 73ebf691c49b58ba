// testing/multirank_test_main.h's MultirankGtestMain for c10d: the ranks are
// torchrun's workers (or envrun_test.sh's), and the world is
// C10dCommunicator::FromEnvironment's.
#include <cstdio>
#include <cstdlib>
#include <memory>

#include "absl/status/statusor.h"
#include "comm/c10d/c10d_communicator.h"
#include "comm/communicator.h"
#include "testing/multirank_test_main.h"

namespace flatparam {

int MultirankGtestMain(int* argc, char** argv, Communicator** world) {
  const char* rank_text = std::getenv("RANK");
  const int rank = rank_text != nullptr ? std::atoi(rank_text) : 0;
  InitGoogleTestOnRank(rank, argc, argv);
  absl::StatusOr<std::unique_ptr<C10dCommunicator>> created =
      C10dCommunicator::FromEnvironment();
  if (!created.ok()) {
    std::fprintf(stderr, "[rank %d] %s\n", rank,
                 created.status().ToString().c_str());
    return 1;
  }
  *world = created->get();
  const bool failed = RunAllTestsOnAllRanks(**created);
  *world = nullptr;
  return failed ? 1 : 0;
}

}  // namespace flatparam
