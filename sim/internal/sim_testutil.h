// SimOptions for sim_test and sim_failure_test: each runs twice, with the
// ranks as threads and, in its *_fibers twin (sim/BUILD.bazel), as fibers,
// chosen by the target's SIM_TEST_EXECUTION environment variable.
#ifndef FLATPARAM_SIM_INTERNAL_SIM_TESTUTIL_H_
#define FLATPARAM_SIM_INTERNAL_SIM_TESTUTIL_H_

#include <cstdlib>
#include <string>

#include "sim/sim.h"

namespace flatparam {
namespace internal_sim {

// Default SimOptions with the execution under test.
inline SimOptions TestOptions() {
  SimOptions options;
  const char* execution = std::getenv("SIM_TEST_EXECUTION");
  if (execution != nullptr && std::string(execution) == "fibers") {
    options.execution = SimOptions::Execution::kFibers;
  }
  return options;
}

}  // namespace internal_sim
}  // namespace flatparam

#endif  // FLATPARAM_SIM_INTERNAL_SIM_TESTUTIL_H_
