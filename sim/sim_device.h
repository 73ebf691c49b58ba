// SimDeviceOps: a DeviceOps whose "device" is simulated on the host, with
// CUDA's stream and event semantics (flatparam/device/device.h) and a race
// detector for them -- how the project proves on a CPU that the runtime's
// stream discipline is right, deterministically, where on a GPU a missing
// event shows up as a rare NaN.
//
//   SimDeviceOps ops({.seed = 7});
//   StreamCheckedCommunicator comm(&sim_comm, &ops);  // collectives too
//   ... run the handle / runtime with `ops` and `comm` ...
//   FLATPARAM_RETURN_IF_ERROR(ops.CheckNoRaces());
//
// Memory. Device memory is host memory labelled Device::Cuda(0), so the
// placement rules (and the handle's host <-> device copies) apply as on a
// GPU. Freed blocks are quarantined (not returned to the heap while other
// blocks are allocated, up to SimDeviceOptions::quarantine_bytes), so that a
// late access to one is reported as a use after free rather than landing
// in a new allocation.
//
// Execution. Every operation is queued on the current stream and runs
// later: when the host synchronizes (Synchronize, SynchronizeEvent) or
// before the queue grows past max_queued. Queued work of different streams
// runs in an order drawn from a PRNG seeded with `seed`, among the orders
// that stream order and event waits allow. So a program whose ordering is
// right computes the same bytes for every seed, and one that is missing a
// wait may compute different ones.
//
// Race detection, independent of the seed. Each agent -- the host (the
// caller's thread), each stream, each collective (reported by
// StreamCheckedCommunicator from issue to Wait) -- has a vector clock:
// work issued on a stream is ordered after the stream's earlier work and
// after everything the host did before issuing it; RecordEvent captures the
// stream's clock, WaitEvent joins it into the waiting stream's,
// SynchronizeEvent and Synchronize join into the host's; a collective is
// ordered after the host at its issue, and the host after the collective
// once Wait returned. Every byte range an operation reads or writes is
// checked against the earlier accesses to the same allocation; two
// accesses conflict when one writes and neither is ordered before the
// other. A conflict is reported with both operations, their agents and the
// buffer. Freeing is checked the way a caching allocator reuses memory:
// the block is reusable at once by its allocating stream, so every earlier
// access must be ordered before that stream's clock at the free (joined
// with the streams recorded by RecordStream, which is what record_stream
// buys); otherwise "freed while in use" is reported. An access to a freed
// block is a use after free.
//
// Ownership: the ops own every block they allocate; all must be freed
// before the ops are destroyed (DeviceBuffer does it). Thread-safety: one
// thread at a time (the rank's), like every DeviceOps.
#ifndef FLATPARAM_SIM_SIM_DEVICE_H_
#define FLATPARAM_SIM_SIM_DEVICE_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "comm/communicator.h"
#include "flatparam/base/buffer.h"
#include "flatparam/device/device.h"

namespace flatparam {

struct SimDeviceOptions {
  // The order in which runnable work of different streams executes.
  uint64_t seed = 0;
  // Operations queued before the oldest runnable ones are executed.
  int max_queued = 64;
  // Bytes of freed blocks kept allocated to catch uses after free.
  int64_t quarantine_bytes = int64_t{256} << 20;
};

class SimDeviceOps final : public DeviceOps {
 public:
  explicit SimDeviceOps(SimDeviceOptions options = {});
  ~SimDeviceOps() override;
  SimDeviceOps(const SimDeviceOps&) = delete;
  SimDeviceOps& operator=(const SimDeviceOps&) = delete;

  Device device() const override { return Device::Cuda(0); }
  absl::string_view name() const override { return "sim"; }
  // Runs every queued operation; the host is then ordered after all of it.
  absl::Status Synchronize() override;

  // A collective that the host issues now on `input`/`output` (either may
  // be empty) and that may access them until CollectiveDone(id); checked
  // like any other agent's accesses. `what` names it in reports.
  int64_t CollectiveIssued(absl::string_view what, ConstBufferRef input,
                           ConstBufferRef output);
  void CollectiveDone(int64_t id);
  // The caller's own read or write of device memory from the host.
  void HostAccess(absl::string_view what, ConstBufferRef buffer, bool write);

  // What the detector found, one line each, in the order found.
  const std::vector<std::string>& reports() const { return reports_; }
  // Internal listing every report, or OK.
  absl::Status CheckNoRaces() const;
  // Operations executed so far (each queued operation runs once).
  int64_t executed() const { return executed_; }

 protected:
  absl::StatusOr<void*> DoAllocate(Device device, int64_t bytes,
                                   bool pinned) override;
  void DoFree(void* data, Device device, bool pinned) override;
  absl::Status DoCopy(BufferRef dst, ConstBufferRef src) override;
  absl::Status DoFill(BufferRef dst, double value) override;
  absl::Status DoCast(BufferRef dst, ConstBufferRef src) override;
  absl::Status DoScale(BufferRef buf, ScaleOp op, double factor) override;
  absl::Status DoAdd(BufferRef acc, ConstBufferRef x) override;
  absl::Status DoNewStream(Stream stream) override;
  absl::Status DoRecordEvent(Event event) override;
  absl::Status DoWaitEvent(Stream stream, Event event) override;
  absl::Status DoSynchronizeEvent(Event event) override;
  absl::Status DoRecordStream(ConstBufferRef buffer, Stream stream) override;

 private:
  // Agent ids: kHost, then stream s is 1 + s, collectives count down.
  using Clock = std::map<int64_t, int64_t>;
  static constexpr int64_t kHost = 0;
  static int64_t StreamAgent(int32_t stream) { return 1 + stream; }

  struct Access {
    int64_t offset = 0;
    int64_t bytes = 0;
    bool write = false;
    int64_t agent = 0;
    int64_t time = 0;  // the agent's own clock component at the access
    std::string what;
  };
  struct Block {
    int64_t bytes = 0;
    int32_t stream = 0;  // current when allocated
    std::vector<int32_t> recorded;
    bool freed = false;
    std::string freed_by;
    std::vector<Access> accesses;
  };
  // Queued work: an operation, or a stream's wait for events (no-op run).
  struct Op {
    std::string what;
    std::function<void()> run;
    // Event ids whose work must have run first.
    std::vector<int64_t> waits;
  };
  struct EventState {
    Clock clock;
    int32_t stream = 0;
    int64_t ops_before = 0;  // ops issued on the stream before the record
  };
  struct StreamState {
    Clock clock;
    std::deque<Op> queue;
    int64_t issued = 0;  // operations and waits queued so far
    int64_t done = 0;
  };

  static void Join(Clock& into, const Clock& from);
  static bool OrderedBefore(const Access& a, const Clock& later);
  std::string AgentName(int64_t agent) const;
  // The block holding [p, p + bytes), or null for memory not ours.
  Block* Find(const void* p, int64_t bytes, int64_t* offset);
  // Checks and records an access by `agent` at `clock`.
  void Touch(int64_t agent, const Clock& clock, absl::string_view what,
             ConstBufferRef buffer, bool write);
  void Report(std::string line);
  // Queues `op` on the current stream, accessing `reads` and `writes`.
  absl::Status Issue(std::string what, std::vector<ConstBufferRef> reads,
                     std::vector<ConstBufferRef> writes,
                     std::function<void()> run);
  bool Runnable(const StreamState& s) const;
  // Runs queued work (PRNG-ordered) until `done` holds or nothing runs.
  void RunUntil(const std::function<bool()>& done);

  const SimDeviceOptions options_;
  std::mt19937_64 rng_;
  Clock host_;
  std::vector<StreamState> streams_;
  std::map<int64_t, EventState> events_;
  std::map<int64_t, Clock> collectives_;
  int64_t next_collective_ = 0;
  std::map<const char*, Block> blocks_;  // by address, live and quarantined
  std::deque<const char*> quarantine_;
  int64_t quarantined_bytes_ = 0;
  int64_t executed_ = 0;
  std::vector<std::string> reports_;
};

// A Communicator that passes the buffers of `ops` (labelled cuda:0) to
// `inner` as host buffers and reports each collective's accesses to `ops`
// (CollectiveIssued at the call, CollectiveDone when Wait returns), so that
// the race detector sees the collectives as agents. Borrows `inner` and
// `ops`; split communicators wrap the split the same way.
class StreamCheckedCommunicator final : public Communicator {
 public:
  StreamCheckedCommunicator(Communicator* inner, SimDeviceOps* ops);
  StreamCheckedCommunicator(std::unique_ptr<Communicator> inner,
                            SimDeviceOps* ops);

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  absl::string_view backend() const override { return inner_->backend(); }
  std::unique_ptr<Work> AllGather(ConstBufferRef input, BufferRef output,
                                  const CollectiveOptions& options) override;
  std::unique_ptr<Work> ReduceScatter(ConstBufferRef input, BufferRef output,
                                      const ReduceOptions& options) override;
  std::unique_ptr<Work> AllReduce(ConstBufferRef input, BufferRef output,
                                  const ReduceOptions& options) override;
  std::unique_ptr<Work> Broadcast(BufferRef buffer,
                                  const BroadcastOptions& options) override;
  absl::StatusOr<std::vector<std::string>> AllGatherBytes(
      absl::string_view bytes, const CollectiveOptions& options) override;
  absl::Status Barrier(const CollectiveOptions& options) override;
  absl::StatusOr<std::unique_ptr<Communicator>> Split(
      int color, int key, const CollectiveOptions& options) override;

 private:
  std::unique_ptr<Work> Wrap(int64_t id, std::unique_ptr<Work> work);

  std::unique_ptr<Communicator> owned_;
  Communicator* inner_;
  SimDeviceOps* ops_;
};

}  // namespace flatparam

#endif  // FLATPARAM_SIM_SIM_DEVICE_H_
