// The collective-communication interface every flatparam backend implements:
// the deterministic simulator (//sim), OpenMPI on host buffers
// (//comm/mpi) and NCCL on CUDA buffers (//comm/nccl).
//
// A Communicator is one process group as seen from one rank. Its contract is
// NCCL's and c10d's: every rank of the group calls the same collectives, in
// the same order, with matching counts, dtypes and roots. A backend detects
// what it can of a violation (the simulator detects all of it) and reports it
// as an error instead of hanging; every collective also has a timeout.
//
// Buffers are described by BufferRef: a pointer, an element count, a dtype
// (the four flatparam floating-point dtypes) and a device. The caller owns
// every buffer and must keep it alive and untouched until the returned Work
// has been waited on.
//
// Collectives are asynchronous: each call validates its arguments, starts
// the operation and returns a Work handle whose Wait() blocks until it has
// finished and returns its status. Argument errors are reported by Wait()
// too, so a call never throws and the returned Work is never null. Waiting
// on a Work twice returns the same status.
//
// Stream-ordered completion (NCCL's and c10d's model, for device buffers).
// A backend whose SupportsStreams(device) is true runs collectives on a
// device queue of its own, and can order them with the caller's device
// streams without the host waiting:
//   * CollectiveOptions::stream: the collective starts only after the work
//     issued on that stream before the call (a device-side wait; c10d's
//     NCCL stream waiting for the current stream), so the caller need not
//     wait on the host for the kernels that produce the input;
//   * Work::WaitStream(s): work issued on `s` after this call runs after
//     the collective (cudaStreamWaitEvent on the collective's end event;
//     c10d's `work.wait()`), so the consumer of the output need not wait
//     on the host either.
// Buffer ownership then follows the streams: the caller keeps the buffers
// alive and untouched until the collective is done, which a stream knows
// once it has passed a WaitStream (memory freed stream-ordered on such a
// stream after the WaitStream is safe to reuse). Wait() may still be
// called, and should be before the result is trusted on the host: it is
// where a timeout, a peer's failure or corrupted data is reported (a
// stream wait cannot fail). Backends that complete collectives on the host
// (the simulator, MPI) return false from SupportsStreams; a `stream` in
// their options is ignored and WaitStream is Unimplemented, so callers use
// the host path there: wait on the host for the producing stream before
// issuing, and Wait() before using the output.
//
// Errors carry the rank, the operation, its sequence number in the group
// and the sizes involved: InvalidArgument for mismatched arguments,
// Unimplemented for an unsupported dtype/device on a backend,
// DeadlineExceeded for a timeout, Aborted when a peer died or the group
// was aborted, Internal for a desynchronised group or corrupted data.
//
// Thread-safety: a Communicator is used by one thread at a time (the rank's
// own thread), like an NCCL communicator. Work handles may be waited on from
// that thread only.
#ifndef FLATPARAM_COMM_COMMUNICATOR_H_
#define FLATPARAM_COMM_COMMUNICATOR_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "flatparam/base/buffer.h"
#include "flatparam/base/dtype.h"

namespace flatparam {

class FlightRecorder;  // comm/flight_recorder.h

// The collectives of this interface, for backends' bookkeeping, traces and
// messages. The values are stable (the MPI backend sends them on the wire).
enum class CollectiveOp : uint8_t {
  kAllGather = 1,
  kReduceScatter,
  kAllReduce,
  kBroadcast,
  kAllGatherBytes,
  kBarrier,
  kSplit,
};

// "all_gather", "reduce_scatter", "all_reduce", "broadcast",
// "all_gather_bytes", "barrier", "split".
absl::string_view CollectiveOpName(CollectiveOp op);

enum class ReduceOp : uint8_t {
  kSum,
  // Sum divided by the group size (NCCL's ncclAvg).
  kAvg,
  kMax,
  kMin,
};

absl::string_view ReduceOpName(ReduceOp op);

// The timeout every collective gets unless its options say otherwise.
inline constexpr absl::Duration kDefaultCollectiveTimeout = absl::Minutes(5);

struct CollectiveOptions {
  // How long Wait() may block before returning DeadlineExceeded. Backends
  // abort the group on a timeout, as NCCL's watchdog does, so later
  // collectives fail fast instead of hanging.
  absl::Duration timeout = kDefaultCollectiveTimeout;
  // Stream-ordered issue (see the file comment): the collective runs after
  // the work issued on this stream so far. Only for backends whose
  // SupportsStreams(stream->device) is true, where a stream of another
  // device (or another simulated device) is InvalidArgument; ignored by
  // the others.
  std::optional<DeviceStream> stream;
};

struct ReduceOptions : CollectiveOptions {
  ReduceOp op = ReduceOp::kSum;
  // FSDP's gradient pre- and post-divide: every input element is divided by
  // `pre_divide_factor` before the reduction and every output element by
  // `post_divide_factor` after it (kAvg's division by the group size comes
  // in between). 1.0 disables a factor. Only with kSum and kAvg.
  double pre_divide_factor = 1.0;
  double post_divide_factor = 1.0;
};

struct BroadcastOptions : CollectiveOptions {
  int root = 0;
};

// The handle of an issued collective.
class Work {
 public:
  virtual ~Work() = default;
  // Blocks until the collective has finished (or its timeout passed) and
  // returns its status. Later calls return the same status at once.
  virtual absl::Status Wait() = 0;
  // Makes the work issued on `stream` from now on run after the collective,
  // without blocking the host (see the file comment). May be called for
  // several streams, before or after Wait(). Unimplemented for backends
  // that complete on the host (the default); InvalidArgument for a stream
  // the backend cannot order with. A collective that fails still releases
  // the waiting streams (its output is then garbage): Wait() reports the
  // failure.
  virtual absl::Status WaitStream(const DeviceStream& stream);
};

// A Work that is already finished with `status`.
std::unique_ptr<Work> CompletedWork(absl::Status status);

class Communicator {
 public:
  virtual ~Communicator() = default;

  // This process's rank in the group, in [0, size()).
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // The backend's name: "sim", "mpi" or "nccl".
  virtual absl::string_view backend() const = 0;
  // Whether collectives on buffers of `device` can be ordered with device
  // streams (CollectiveOptions::stream, Work::WaitStream; see the file
  // comment). False unless a backend says otherwise: NCCL for its CUDA
  // device, sim/sim_device.h's StreamCheckedCommunicator in its
  // stream-ordered mode.
  virtual bool SupportsStreams(Device device) const { return false; }

  // All-gather. `input` holds `count` elements on every rank; `output` holds
  // `size() * count`. Rank i's input lands at output offset `i * count`.
  // In place when `input.data == output.data + rank() * count` (bytes).
  virtual std::unique_ptr<Work> AllGather(ConstBufferRef input,
                                          BufferRef output,
                                          const CollectiveOptions& options) = 0;

  // Reduce-scatter. `input` holds `size() * count` elements on every rank;
  // `output` holds `count`. Rank i receives the reduction, over all ranks,
  // of input elements [i * count, (i + 1) * count). In place when
  // `output.data == input.data + rank() * count` (bytes).
  virtual std::unique_ptr<Work> ReduceScatter(ConstBufferRef input,
                                              BufferRef output,
                                              const ReduceOptions& options) = 0;

  // All-reduce. `input` and `output` hold `count` elements on every rank;
  // every rank receives the element-wise reduction. In place when
  // `input.data == output.data`.
  virtual std::unique_ptr<Work> AllReduce(ConstBufferRef input,
                                          BufferRef output,
                                          const ReduceOptions& options) = 0;

  // Broadcast. `buffer` holds `count` elements on every rank; the root's
  // contents are copied to every other rank's buffer.
  virtual std::unique_ptr<Work> Broadcast(BufferRef buffer,
                                          const BroadcastOptions& options) = 0;

  // All-gather of variable-length byte strings (host only; for metadata,
  // like torch.distributed.all_gather_object). Returns one string per rank,
  // in rank order. Blocking.
  virtual absl::StatusOr<std::vector<std::string>> AllGatherBytes(
      absl::string_view bytes, const CollectiveOptions& options) = 0;

  // Blocks until every rank of the group has entered the barrier.
  virtual absl::Status Barrier(const CollectiveOptions& options) = 0;

  // Collective over this group: splits it into subgroups, one per distinct
  // `color`; ranks within a subgroup are ordered by (`key`, old rank). A
  // negative color returns nullptr for that rank (it joins no subgroup),
  // as with MPI_UNDEFINED / NCCL_SPLIT_NOCOLOR.
  virtual absl::StatusOr<std::unique_ptr<Communicator>> Split(
      int color, int key, const CollectiveOptions& options) = 0;

  // Ends this communicator because the job failed, here or on another rank,
  // so that neither later calls nor its destruction wait for peers that may
  // never come. NCCL aborts (ncclCommAbort, as c10d's watchdog does)
  // instead of the ncclCommFinalize its destructor otherwise waits in until
  // every rank is quiescent. Later collectives fail with Aborted quoting
  // `reason`. Idempotent. The default does nothing, for backends whose
  // destruction never waits for peers (MPI, the simulator).
  virtual void Abort(absl::Status reason) {}

  // The flight recorder of this rank (comm/flight_recorder.h), shared by
  // the communicators split from this one: every collective given to this
  // communicator is recorded there. Callers set the FSDP context of what
  // they issue through it (ScopedCollectiveContext). Null for a
  // communicator that records nothing (the default); owned by the
  // communicator.
  virtual FlightRecorder* flight_recorder() const { return nullptr; }
};

// The hybrid-sharding groups of a world of `size()` ranks laid out as nodes
// of `shard_group_size` consecutive ranks: the shard group (the ranks of
// this node) and the replicate group (the ranks with this rank's local index
// on every node). InvalidArgument unless shard_group_size divides size().
struct HybridGroups {
  std::unique_ptr<Communicator> shard;
  std::unique_ptr<Communicator> replicate;
};
absl::StatusOr<HybridGroups> MakeHybridGroups(
    Communicator& world, int shard_group_size,
    const CollectiveOptions& options = {});

// Checks the arguments of each collective against the contract above, for
// backends to share. `seq` is the operation's sequence number in the group.
// The messages name the rank, the op, `seq` and the sizes.
absl::Status ValidateAllGather(int rank, int size, int64_t seq,
                               ConstBufferRef input, BufferRef output);
absl::Status ValidateReduceScatter(int rank, int size, int64_t seq,
                                   ConstBufferRef input, BufferRef output,
                                   const ReduceOptions& options);
absl::Status ValidateAllReduce(int rank, int size, int64_t seq,
                               ConstBufferRef input, BufferRef output,
                               const ReduceOptions& options);
absl::Status ValidateBroadcast(int rank, int size, int64_t seq,
                               BufferRef buffer,
                               const BroadcastOptions& options);

}  // namespace flatparam

#endif  // FLATPARAM_COMM_COMMUNICATOR_H_
