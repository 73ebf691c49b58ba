#include "comm/conformance/collective_cases_testutil.h"

#include <gtest/gtest.h>

namespace flatparam {
namespace conformance {

void ExpectCaseOk(const CaseResult& result) {
  if (!result.status.ok()) ADD_FAILURE() << result.status.message();
}

void ExpectSuiteOk(const SuiteReport& report) {
  for (const std::string& failure : report.failures) {
    ADD_FAILURE() << failure;
  }
  if (!report.stopped.ok()) {
    ADD_FAILURE() << "stopped after " << report.cases
                  << " cases: " << report.stopped;
  }
  const int64_t unreported = report.failed -
                             static_cast<int64_t>(report.failures.size()) -
                             (report.stopped.ok() ? 0 : 1);
  if (unreported > 0) {
    ADD_FAILURE() << "and " << unreported << " more failed cases";
  }
}

void ExpectCasesPass(Communicator& comm, DeviceMemory& memory,
                     const std::vector<CollectiveCase>& cases,
                     absl::Duration timeout) {
  for (const CollectiveCase& c : cases) {
    const CaseResult result = RunCase(comm, memory, c, timeout);
    ExpectCaseOk(result);
    if (result.collective_error) return;
  }
}

void ExpectGroupChecksPass(Communicator& comm, DeviceMemory& memory,
                           const SuiteOptions& options) {
  for (const GroupCheck& check :
       GroupChecks(comm.size(), memory.device(), options)) {
    const CaseResult result = check.run(comm, memory);
    ExpectCaseOk(result);
    if (result.collective_error) return;
  }
}

std::vector<CollectiveCase> CasesOfKind(
    const std::vector<CollectiveCase>& cases, CollectiveKind kind) {
  std::vector<CollectiveCase> out;
  for (const CollectiveCase& c : cases) {
    if (c.kind == kind) out.push_back(c);
  }
  return out;
}

}  // namespace conformance
}  // namespace flatparam
