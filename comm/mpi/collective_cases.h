// Backend-independent conformance cases for Communicator implementations
// (test-only). Each case is a function of a Communicator&: every rank of the
// group calls the same case with the same arguments, and the case checks
// the results with gtest EXPECT_* macros. A case issues the same
// collectives on every rank whatever its expectations find, so a failure on
// one rank never desynchronises the group; a collective that fails is
// reported and the case goes on.
//
// Expected values are computed locally: every rank can regenerate every
// other rank's input (FillInput is a function of the rank), and reductions
// are compared bitwise with HostReduce(), the left fold in rank order that
// every host backend must reproduce; CheckExactReductions also compares
// with closed-form values.
//
// These live with the MPI backend for now; they are written to move
// unchanged into a backend-parameterised suite run against the simulator,
// MPI and NCCL.
//
// Thread-safety: each call uses its communicator from the calling thread.
#ifndef FLATPARAM_COMM_MPI_COLLECTIVE_CASES_H_
#define FLATPARAM_COMM_MPI_COLLECTIVE_CASES_H_

#include <cstdint>
#include <vector>

#include "absl/time/time.h"
#include "comm/communicator.h"
#include "flatparam/base/dtype.h"

namespace flatparam {
namespace conformance {

// The timeout every case passes to its collectives: long enough for a
// loaded CI machine, short enough that a broken backend fails the test
// instead of hanging it.
inline constexpr absl::Duration kCaseTimeout = absl::Seconds(30);

// The four collective dtypes.
std::vector<DType> CollectiveDTypes();
// 0, 1, 2, primes, and counts that do not divide evenly by small groups.
std::vector<int64_t> InterestingCounts();

// A host buffer of `count` elements of `dtype` (zero-initialised).
class HostBuffer {
 public:
  HostBuffer(DType dtype, int64_t count);
  BufferRef ref();
  ConstBufferRef cref() const;
  const std::vector<char>& bytes() const { return bytes_; }

 private:
  DType dtype_;
  int64_t count_;
  std::vector<char> bytes_;
};

// Fills `buffer` with rank `rank`'s deterministic input for `salt`: values
// that are not exactly summable, so that the reduction order shows.
void FillInput(BufferRef buffer, int rank, int salt);

// All-gather; in place uses input = output.Slice(rank * count, count).
void CheckAllGather(Communicator& comm, DType dtype, int64_t count,
                    bool in_place);
// Reduce-scatter, bitwise against HostReduce; in place uses
// output = input.Slice(rank * count, count).
void CheckReduceScatter(Communicator& comm, DType dtype, int64_t count,
                        const ReduceOptions& options, bool in_place);
// All-reduce, bitwise against HostReduce; in place uses output = input.
void CheckAllReduce(Communicator& comm, DType dtype, int64_t count,
                    const ReduceOptions& options, bool in_place);
// Broadcast from `root`.
void CheckBroadcast(Communicator& comm, DType dtype, int64_t count, int root);
// Sum, avg, max, min and pre/post divide on small integers, against
// closed-form values, with all-reduce and reduce-scatter.
void CheckExactReductions(Communicator& comm, DType dtype);
// Strings of different lengths (including empty and with NUL bytes).
void CheckAllGatherBytes(Communicator& comm);
void CheckBarrier(Communicator& comm);
// Split by parity with reversed keys, and with a negative color on rank 0.
void CheckSplit(Communicator& comm);
// MakeHybridGroups(world, shard_group_size): membership, order, and an
// all-reduce in each group. REQUIRES: shard_group_size divides world.size().
void CheckHybridGroups(Communicator& world, int shard_group_size);
// Bad arguments passed alike on every rank: the codes, that messages name
// the rank, op, sequence number and sizes, that sequence numbers advance,
// and that the group still works afterwards.
void CheckArgumentErrors(Communicator& comm);

}  // namespace conformance
}  // namespace flatparam

#endif  // FLATPARAM_COMM_MPI_COLLECTIVE_CASES_H_
