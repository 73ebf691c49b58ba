// The collective conformance suite: backend-independent cases that run on
// any Communicator and report what they find as absl::Status, so that the
// same cases run in gtest (collective_cases_testutil.h), in the `fsdp
// collectives` command, and on every backend: the simulator at any world
// size, MPI under mpirun, NCCL on GPUs.
//
//   SuiteReport report = RunSuite(comm, HostMemory(), SuiteOptions());
//   if (!report.ok()) return report.ToStatus();
//
// Every rank of the group calls the same function with the same arguments.
// A case makes the same collectives on every rank whatever its checks find,
// so wrong data on one rank never desynchronises the group. A collective
// that fails is different: the group may be unusable (aborted, timed out),
// so RunSuite stops at the first such error and reports it.
//
// What a case checks, on each rank: the collective succeeds; every output
// element equals ExpectedOutput() (case_values.h) bit for bit: HostReduce's
// fold for reductions, which is the simulator's arithmetic; and an input
// that is not also the output is unchanged. A failure names the rank, the
// case (op, dtype, count, reduction, values, in place) and, for data, the
// first wrong element with its value and bits and the expected ones.
//
// Cross-backend agreement is checked, not assumed, with digests: the
// outputs of a fixed list of cases (DigestCases) are hashed with XXH3-64 on
// every rank and compared with ReferenceDigests(), computed in one process
// from the same inputs without any communicator; tests of every backend
// compare with the same reference, and a golden constant pins it.
//
// Thread-safety: each call uses its communicator from the calling thread,
// as the Communicator contract requires; the functions share no state.
#ifndef FLATPARAM_COMM_CONFORMANCE_COLLECTIVE_CASES_H_
#define FLATPARAM_COMM_CONFORMANCE_COLLECTIVE_CASES_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "comm/communicator.h"
#include "comm/conformance/case_values.h"
#include "comm/conformance/device_memory.h"
#include "flatparam/base/dtype.h"

namespace flatparam {
namespace conformance {

// The timeout every case passes to its collectives: long enough for a
// loaded CI machine, short enough that a broken backend fails instead of
// hanging.
inline constexpr absl::Duration kCaseTimeout = absl::Seconds(30);

// The elements of the buffers of the "large" cases: an odd number, a little
// over two million, so that no group size divides it evenly.
inline constexpr int64_t kDefaultLargeElements = (int64_t{1} << 21) + 3;

// The four collective dtypes.
std::vector<DType> CollectiveDTypes();
// 0, 1, small primes and counts that no small group size divides.
std::vector<int64_t> InterestingCounts();

struct SuiteOptions {
  std::vector<DType> dtypes = CollectiveDTypes();
  std::vector<int64_t> counts = InterestingCounts();
  // Adds, per dtype, an all_gather, reduce_scatter, all_reduce and broadcast
  // whose largest buffer holds about this many elements (kExact values, so
  // checking them costs O(elements)); 0 leaves them out.
  int64_t large_elements = kDefaultLargeElements;
  // Only cases that IsOrderIndependent(): for backends that reduce in an
  // order of their own (NCCL), whose results match the reference only where
  // rounding cannot show.
  bool exact_only = false;
  // Also the checks that are not one buffer collective: closed-form
  // reductions, all_gather_bytes, barrier, split, hybrid groups and (with
  // host memory) argument errors.
  bool group_checks = true;
  absl::Duration timeout = kCaseTimeout;
  // How many failure messages a SuiteReport keeps.
  int max_reported_failures = 10;
};

// The buffer-collective cases of the suite on a group of `n` ranks: every
// kind, dtype and count; reductions sum, avg, max, min and divide factors
// (powers of two, and 3 and 7 whose rounding shows) on kExact and kInexact
// values; out of place and in place; broadcast from the first and last rank;
// and the large cases.
std::vector<CollectiveCase> CollectiveCases(int n, const SuiteOptions& options);

// What a case found on one rank.
struct CaseResult {
  // OK, or the first failure, naming the rank and the case.
  absl::Status status;
  // Whether a collective returned an error (rather than wrong data): the
  // group may be unusable afterwards.
  bool collective_error = false;
  // Output elements that differ from the expected ones (nccl-tests' #wrong).
  int64_t wrong = 0;
};

// Runs `c` on `comm` with buffers from `memory` and checks it (above).
CaseResult RunCase(Communicator& comm, DeviceMemory& memory,
                   const CollectiveCase& c,
                   absl::Duration timeout = kCaseTimeout);

// A check that is not one buffer collective.
struct GroupCheck {
  std::string name;
  std::function<CaseResult(Communicator&, DeviceMemory&)> run;
};

// The group checks for a group of `n` ranks with buffers on `device`:
//   exact reductions DTYPE  sum, avg, max, min and power-of-two divide
//                           factors on small integers, with all_reduce and
//                           reduce_scatter, against closed-form values (an
//                           oracle independent of HostReduce); with
//                           exact_only, avg only when n is a power of two;
//   all_gather_bytes        strings of different lengths, empty and with
//                           NUL bytes, and one of 1 MiB;
//   barrier                 three in a row;
//   split                   by parity with reversed keys, and with rank 0
//                           joining no subgroup; members, order, a sum;
//   hybrid groups of S      MakeHybridGroups for every S dividing n;
//   argument errors         (host buffers only) bad arguments passed alike
//                           on every rank: codes, messages naming the rank,
//                           op, sequence number and sizes, sequence numbers
//                           advancing, the group usable afterwards.
std::vector<GroupCheck> GroupChecks(int n, Device device,
                                    const SuiteOptions& options);

// What RunSuite found on one rank.
struct SuiteReport {
  int64_t cases = 0;   // cases and group checks run
  int64_t failed = 0;  // of those, the ones that failed
  // The first max_reported_failures failure messages.
  std::vector<std::string> failures;
  // The collective error that stopped the suite, if one did.
  absl::Status stopped;

  bool ok() const { return failed == 0 && stopped.ok(); }
  // OK, or the collective error that stopped the suite (with its code), or
  // Internal listing the reported failures.
  absl::Status ToStatus() const;
  // Adds one result.
  void Add(const CaseResult& result, int max_reported_failures);
};

// Runs CollectiveCases() and, if options.group_checks, GroupChecks(), in
// that order, stopping after the first collective error.
SuiteReport RunSuite(Communicator& comm, DeviceMemory& memory,
                     const SuiteOptions& options);

// ---------------------------------------------------------------------------
// Digests.

// The cases whose outputs are hashed on a group of `n` ranks: every kind and
// dtype, kExact and kInexact values, sum/avg/max/min and divide factors 3
// and 7, counts 7, 13 and 1031.
std::vector<CollectiveCase> DigestCases(int n);

// digests[case][rank]: the XXH3-64 hash of rank `rank`'s output bytes after
// DigestCases(n)[case].
using DigestTable = std::vector<std::vector<uint64_t>>;

// Runs DigestCases(comm.size()) on `comm` and gathers every rank's digests
// (through AllGatherBytes), so every rank returns the whole table. Errors
// of the collectives, naming the rank and the case.
absl::StatusOr<DigestTable> ComputeDigests(
    Communicator& comm, DeviceMemory& memory,
    absl::Duration timeout = kCaseTimeout);

// The digests every backend must produce on `n` ranks, computed in this
// process from FillInput and ExpectedOutput (HostReduce), with no
// communicator.
DigestTable ReferenceDigests(int n);

// OK when equal; otherwise Internal naming the first case and rank that
// differ and both digests.
absl::Status CompareDigests(const DigestTable& got, const DigestTable& want,
                            int n);

// One hash of a whole table, to pin in tests.
uint64_t CombineDigests(const DigestTable& table);

// CombineDigests(ReferenceDigests(4)): changes only when the inputs, the
// digest cases or HostReduce's arithmetic change.
inline constexpr uint64_t kReferenceDigestWorld4 = 0x24449eabbf2fe7b6;

}  // namespace conformance
}  // namespace flatparam

#endif  // FLATPARAM_COMM_CONFORMANCE_COLLECTIVE_CASES_H_
