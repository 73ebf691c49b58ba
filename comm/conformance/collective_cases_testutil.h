// gtest adapters for the conformance suite (test-only): they turn the
// statuses of collective_cases.h into gtest failures, one per failing case,
// so that a backend's test is a few lines:
//
//   TEST(MyBackendTest, AllReduce) {
//     ExpectCasesPass(comm, HostMemory(),
//                     CasesOfKind(CollectiveCases(comm.size(), {}),
//                                 CollectiveKind::kAllReduce));
//   }
//
// Thread-safety: as gtest's assertions.
#ifndef FLATPARAM_COMM_CONFORMANCE_COLLECTIVE_CASES_TESTUTIL_H_
#define FLATPARAM_COMM_CONFORMANCE_COLLECTIVE_CASES_TESTUTIL_H_

#include <vector>

#include "absl/time/time.h"
#include "comm/communicator.h"
#include "comm/conformance/collective_cases.h"
#include "comm/conformance/device_memory.h"

namespace flatparam {
namespace conformance {

// A gtest failure with the result's message unless it is OK.
void ExpectCaseOk(const CaseResult& result);

// One gtest failure per reported failure, plus one for a suite that
// stopped at a collective error.
void ExpectSuiteOk(const SuiteReport& report);

// Runs every case of `cases`, stopping after a collective error.
void ExpectCasesPass(Communicator& comm, DeviceMemory& memory,
                     const std::vector<CollectiveCase>& cases,
                     absl::Duration timeout = kCaseTimeout);

// Runs GroupChecks(), stopping after a collective error.
void ExpectGroupChecksPass(Communicator& comm, DeviceMemory& memory,
                           const SuiteOptions& options);

// The cases of `cases` of one kind.
std::vector<CollectiveCase> CasesOfKind(
    const std::vector<CollectiveCase>& cases, CollectiveKind kind);

}  // namespace conformance
}  // namespace flatparam

#endif  // FLATPARAM_COMM_CONFORMANCE_COLLECTIVE_CASES_TESTUTIL_H_
