// The collective conformance cases as data: what each rank sends and what it
// must receive. Everything here is a pure function of (case, world size,
// rank) and needs no communicator, so every rank can compute any other
// rank's input and its own expected output, and a reference can be computed
// in a single process (collective_cases.h's ReferenceDigests).
//
// Expected reductions are HostReduce() (comm/host_reduce.h): the left fold
// in rank order that the simulator and the MPI backend perform, so host
// backends must match them bit for bit. Two kinds of input values:
//
//   kExact    small integers in [-4, 4]. Every partial sum of up to 64 of
//             them, divided by powers of two, is exact in every dtype
//             (bfloat16 included), so any reduction order gives the same
//             bits: backends that reduce in their own order (NCCL's rings
//             and trees) must match too. See IsOrderIndependent().
//   kInexact  values with full mantissas and exponents from 2^-4 to 2^4:
//             sums round, so the order of the fold shows in the last bits.
//
// Inputs are functions of the element's global index in the rank's input
// buffer, so a slice of any rank's input can be generated on its own. The
// exact values repeat with period kExactPeriod, which makes the expected
// output of a reduction periodic too: large exact cases cost O(count) to
// check, not O(ranks * count).
//
// Thread-safety: pure functions; HostBuffer as in device_memory.h.
#ifndef FLATPARAM_COMM_CONFORMANCE_CASE_VALUES_H_
#define FLATPARAM_COMM_CONFORMANCE_CASE_VALUES_H_

#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"
#include "comm/communicator.h"
#include "comm/conformance/bandwidth.h"
#include "comm/conformance/device_memory.h"
#include "flatparam/base/dtype.h"

namespace flatparam {
namespace conformance {

enum class Values : uint8_t { kExact, kInexact };

// "exact" or "inexact".
absl::string_view ValuesName(Values values);

// The period of kExact inputs in the element index.
inline constexpr int kExactPeriod = 9;

// The largest group for which kExact sums are exact in every dtype.
inline constexpr int kMaxExactGroup = 64;

// One collective call, made alike by every rank of a group.
struct CollectiveCase {
  CollectiveKind kind = CollectiveKind::kAllReduce;
  DType dtype = DType::kFloat32;
  // Elements per rank in the Communicator's convention: all_gather's input,
  // reduce_scatter's output, all_reduce's and broadcast's buffer.
  int64_t count = 0;
  Values values = Values::kInexact;
  // reduce_scatter and all_reduce only.
  ReduceOp op = ReduceOp::kSum;
  double pre_divide_factor = 1.0;
  double post_divide_factor = 1.0;
  // all_gather: input = output.Slice(rank * count, count); reduce_scatter:
  // output = input.Slice(rank * count, count); all_reduce: output = input.
  // Broadcast is always in place.
  bool in_place = false;
  // broadcast only.
  int root = 0;

  // Elements of the input and output buffers on a group of `n` ranks.
  int64_t input_count(int n) const;
  int64_t output_count(int n) const;
  // op and factors, with the default timeout.
  ReduceOptions reduce_options() const;
  // For messages and test names: "all_reduce float16 count 13 avg pre 3
  // post 7 inexact in place", "broadcast bfloat16 count 7 root 3 inexact".
  std::string Name() const;
};

// Whether every correct backend, whatever order it reduces in, produces the
// same bits for `c` on `n` ranks: always for all_gather, broadcast, max and
// min; for sum and avg when the values are kExact, n <= kMaxExactGroup, the
// divide factors are powers of two and, for kAvg, n is a power of two too
// (NCCL applies an average as a multiplication by 1/n before summing).
bool IsOrderIndependent(const CollectiveCase& c, int n);

// Writes elements [first, first + host.count) of rank `rank`'s input buffer
// for case `c` into `host` (a host buffer of c.dtype).
void FillInput(const CollectiveCase& c, int rank, int64_t first,
               BufferRef host);

// What rank `rank` of `n` holds in its output buffer after case `c`:
// c.output_count(n) elements. Reductions are HostReduce's; for kExact values
// the cost is O(count), else O(n * count).
HostBuffer ExpectedOutput(const CollectiveCase& c, int n, int rank);

// Compares `count` elements bit for bit: returns how many differ and sets
// `*first` to the index of the first that does (-1 when none).
int64_t CountMismatches(const void* got, const void* want, int64_t count,
                        DType dtype, int64_t* first);

// "element 5 is 1.25 (bits 0x3d00), expected 1.5 (bits 0x3e00)".
std::string DescribeMismatch(const void* got, const void* want, DType dtype,
                             int64_t index);

}  // namespace conformance
}  // namespace flatparam

#endif  // FLATPARAM_COMM_CONFORMANCE_CASE_VALUES_H_
