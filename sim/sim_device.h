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
// StreamCheckedCommunicator from issue to Wait) -- has a vector clock
// (dense, over the agents that still have recorded accesses: a
// collective's entry is recycled once none of its accesses is kept, so the
// clocks stay small over millions of collectives):
// work issued on a stream is ordered after the stream's earlier work and
// after everything the host did before issuing it; RecordEvent captures the
// stream's clock, WaitEvent joins it into the waiting stream's,
// SynchronizeEvent and Synchronize join into the host's; a collective is
// ordered after the host at its issue, and the host after the collective
// once Wait returned. Every byte range an operation reads or writes is
// checked against the earlier accesses to the same allocation; two
// accesses conflict when one writes and neither is ordered before the
// other. A conflict is reported with both operations, their agents and the
// buffer. An access replaces the recorded ones it covers and is ordered
// after (a write any, a read the reads): whatever races with them races
// with it, so each buffer keeps a few accesses however often it is read.
// Allocation is stream-ordered, as CUDA's pool allocator is: a new block is
// written (by its previous owner's queued work, as far as anyone knows) by
// the allocating stream up to that point, so another agent's access must be
// ordered after it (an event recorded after the Allocate, or a host
// synchronization); otherwise the race names "its allocation".
// Freeing is checked the way a caching allocator reuses memory: the block is
// reusable at once by its allocating stream, so every earlier access must be
// ordered before that stream's clock at the free (joined with the streams
// recorded by RecordStream, which is what record_stream buys); otherwise "freed
// while in use" is reported. An access to a freed block is a use after free.
//
// Virtual time, also independent of the seed. Every operation has a
// duration: Kernel() takes one (the caller's forward or backward, from a
// FLOP count or a measured cost), the memory operations (Copy, Fill, Cast,
// Scale, Add) last the bytes they read and write over
// SimDeviceOptions::memory_bytes_per_second (instantaneous by default),
// waits last nothing. An operation starts at the latest of: the host's
// clock when it was issued, the end of the stream's previous operation,
// the times of the events it waits for, and (a stream's wait for a
// collective) the collective's end; it ends a duration later. An event's
// time is the end of the work it marks. When the host synchronizes
// (Synchronize, SynchronizeEvent, an operation on host memory, a wait on a
// collective) its clock moves forward to the end of what it waited for.
// The host's clock is SimDeviceOptions::host_clock: in a SimWorld, the
// rank's virtual clock (SimRankClock), which the simulator's collectives
// also advance, so a rank's device streams, its collectives (the
// simulator's one communication stream per rank) and its host share one
// timeline, the one sim/cost_model.h predicts.
//
// Stream-ordered collectives. StreamCheckedCommunicator's stream-ordered
// mode behaves as NCCL does (comm/communicator.h): a collective issued with
// CollectiveOptions::stream is ordered after that stream's work issued so
// far, not after a host wait, and Work::WaitStream orders a stream after
// the collective. The detector gives such a collective the stream's clock
// (joined with the host's at the issue) and joins its clock into the
// waiting stream's. In virtual time the collective arrives (SimWorld's
// arrival, from which its start is computed across the group) when that
// stream's work has ended, without moving the host's clock.
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
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "comm/communicator.h"
#include "comm/forwarding_communicator.h"
#include "flatparam/base/buffer.h"
#include "flatparam/device/device.h"
#include "sim/sim.h"

namespace flatparam {

// The host's clock as a SimDeviceOps sees it (see "Virtual time").
class SimHostClock {
 public:
  virtual ~SimHostClock() = default;
  virtual absl::Duration Now() const = 0;
  // Moves the clock forward to `t`; nothing when `t` is not later.
  virtual void AdvanceTo(absl::Duration t) = 0;
};

// The virtual clock of a SimWorld rank (SimCommunicator::Now and Compute).
// Borrows `comm`; used on its rank's thread.
class SimRankClock final : public SimHostClock {
 public:
  explicit SimRankClock(SimCommunicator* comm) : comm_(comm) {}
  absl::Duration Now() const override { return comm_->Now(); }
  void AdvanceTo(absl::Duration t) override;

 private:
  SimCommunicator* comm_;
};

struct SimDeviceOptions {
  // The order in which runnable work of different streams executes.
  uint64_t seed = 0;
  // Operations queued before the oldest runnable ones are executed.
  int max_queued = 64;
  // Bytes of freed blocks kept allocated to catch uses after free.
  int64_t quarantine_bytes = int64_t{256} << 20;
  // Virtual time of the memory operations: bytes read plus bytes written
  // per second; 0 makes them instantaneous.
  double memory_bytes_per_second = 0;
  // Device memory holds no bytes: allocations are placeholder addresses
  // that map nothing (never reused, so a late access is still found), and
  // no operation reads or writes data -- Copy, Fill, Cast, Scale, Add and
  // a Kernel's `run` are checked, ordered and timed, not executed. With
  // SimOptions::metadata_only this runs the real runtime's step on a model
  // of any size in the memory of its metadata (`fsdp plan --simulate`).
  // Host memory is still real.
  bool metadata_only = false;
  // The host's clock (borrowed; must outlive the ops), or null for a clock
  // of the ops' own that starts at zero and moves only when the host
  // synchronizes.
  SimHostClock* host_clock = nullptr;
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

  // A kernel of the caller's (a forward or backward) on the current
  // stream: it reads `reads`, writes `writes` (checked like every
  // operation), lasts `duration` of virtual time and calls `run`, if any,
  // when it executes. InvalidArgument for a negative or infinite duration.
  absl::Status Kernel(std::string what, std::vector<ConstBufferRef> reads,
                      std::vector<BufferRef> writes, absl::Duration duration,
                      std::function<void()> run = nullptr);

  // A collective that the host issues now on `input`/`output` (either may
  // be empty) and that may access them until CollectiveDone(id); checked
  // like any other agent's accesses. `what` names it in reports.
  int64_t CollectiveIssued(absl::string_view what, ConstBufferRef input,
                           ConstBufferRef output);
  // The same for a stream-ordered collective (see the file comment),
  // ordered after the work issued on `after` so far: that work is run
  // first (the simulated collective moves data when its last member
  // arrives), and the time it ends (or the host's clock, if later) is
  // returned as the collective's arrival. InvalidArgument for a stream
  // these ops did not create.
  absl::StatusOr<int64_t> CollectiveIssuedAfter(absl::string_view what,
                                                Stream after,
                                                ConstBufferRef input,
                                                ConstBufferRef output,
                                                absl::Duration* arrival);
  // The host waited for collective `id`: the host is ordered after it.
  void CollectiveDone(int64_t id);
  // Nothing will wait for collective `id` any more (its Work is gone): its
  // clock is dropped.
  void CollectiveReleased(int64_t id);
  // Work issued on `stream` from now on runs after collective `id`: a wait
  // is queued there whose execution calls `end` (which may block the
  // rank's thread until the collective is done) for the collective's end
  // on the virtual clock. InvalidArgument for a stream these ops did not
  // create.
  absl::Status CollectiveWaitedOn(int64_t id, Stream stream,
                                  std::function<absl::Duration()> end);
  // The caller's own read or write of device memory from the host.
  void HostAccess(absl::string_view what, ConstBufferRef buffer, bool write);

  // What the detector found, one line each, in the order found.
  const std::vector<std::string>& reports() const { return reports_; }
  // Internal listing every report, or OK.
  absl::Status CheckNoRaces() const;
  // Operations executed so far (each queued operation runs once).
  int64_t executed() const { return executed_; }
  // Slots of the race detector's vector clocks: the host, the streams and
  // the collectives whose accesses are still recorded (a collective's slot
  // is reused once none is), so it stays small however many collectives
  // run.
  int64_t clock_slots() const { return static_cast<int64_t>(slot_gen_.size()); }

  // ---- Virtual time (see the file comment) ----
  // The host's clock.
  absl::Duration HostNow() const;
  // The sum of the durations of the work `stream` executed so far.
  absl::Duration StreamBusy(Stream stream) const;

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
  // {cuda:0, this, id}.
  std::optional<DeviceStream> DoNativeStream(Stream stream) const override;

 private:
  // Vector clocks are dense, indexed by agent slot: the host's is slot 0,
  // each stream gets one for good, and collectives share the rest -- a
  // collective's slot is recycled, under a new generation, once no recorded
  // access names it (it accesses nothing after its issue, so nothing can be
  // ordered against it any more). The live agents, hence the clocks, stay
  // as few as the buffers in use, however many collectives a run issues.
  struct Tick {
    uint32_t gen = 0;  // 0: never set
    int64_t time = 0;
  };
  using Clock = std::vector<Tick>;
  // An agent: its display id (kHost, 1 + stream, collectives -1 - id: what
  // reports name) and its slot and generation in clocks.
  struct Agent {
    int64_t id = 0;
    int32_t slot = 0;
    uint32_t gen = 1;
  };
  static constexpr int64_t kHost = 0;
  static int64_t StreamAgent(int32_t stream) { return 1 + stream; }

  struct Access {
    int64_t offset = 0;
    int64_t bytes = 0;
    bool write = false;
    int64_t agent = 0;  // display id
    int32_t slot = 0;
    uint32_t gen = 0;
    int64_t time = 0;  // the agent's own clock component at the access
    std::string what;
  };
  struct Block {
    int64_t bytes = 0;
    int32_t stream = 0;  // current when allocated
    std::vector<int32_t> recorded;
    bool freed = false;
    std::vector<Access> accesses;
  };
  // Queued work: an operation, or a stream's wait for events (no-op run).
  struct Op {
    std::string what;
    std::function<void()> run;
    // Event ids whose work must have run first.
    std::vector<int64_t> waits;
    // Virtual time: the host's clock at the issue, the duration, and (a
    // wait for a collective) the collective's end, known when it runs.
    absl::Duration issued_at;
    absl::Duration duration;
    std::function<absl::Duration()> ready;
  };
  struct EventState {
    Clock clock;
    int32_t stream = 0;
    int64_t ops_before = 0;  // ops issued on the stream before the record
    // The end of the work it marks, once that work has run.
    std::optional<absl::Duration> time;
  };
  struct StreamState {
    Agent agent;
    Clock clock;
    std::deque<Op> queue;
    int64_t issued = 0;  // operations and waits queued so far
    int64_t done = 0;
    // Virtual time: the end of the last operation run, the sum of the
    // durations, and the events whose work has not run yet (ops_before,
    // event id), in recording order.
    absl::Duration free_at;
    absl::Duration busy;
    std::deque<std::pair<int64_t, int64_t>> unresolved_events;
  };

  static void Join(Clock& into, const Clock& from);
  static bool OrderedBefore(const Access& a, const Clock& later);
  // Advances `agent`'s own component of `clock`; returns the new time.
  static int64_t Tock(Clock& clock, const Agent& agent);
  std::string AgentName(int64_t agent) const;
  // Slots: a new one for a stream, a recycled or new one for a collective,
  // and the bookkeeping of an access dropped from a block's list.
  int32_t NewSlot();
  Agent NewCollectiveAgent(int64_t id);
  void DropAccess(const Access& a);
  // Records a new block's allocation as a write of the whole block by the
  // allocating stream at its current point: other agents must be ordered
  // after it (the stream-ordered allocator's rule, flatparam/device/device.h).
  void AddAllocation(Block& block, int32_t stream);
  void MaybeRecycle(int32_t slot);
  // The block holding [p, p + bytes), or null for memory not ours.
  Block* Find(const void* p, int64_t bytes, int64_t* offset);
  // Checks and records an access by `agent` at `clock`.
  void Touch(const Agent& agent, const Clock& clock, absl::string_view what,
             ConstBufferRef buffer, bool write);
  void Report(std::string line);
  // Whether these ops created `stream`.
  bool HasStream(Stream stream) const;
  // Registers a collective the host issues now, ordered after the host and
  // (when set) `after`'s clock; its name is `what` #id `suffix`.
  int64_t AddCollective(absl::string_view what, absl::string_view suffix,
                        const Clock* after, ConstBufferRef input,
                        ConstBufferRef output);
  // Queues `op` on the current stream, accessing `reads` and `writes`;
  // `duration` < 0 means the memory operations' bandwidth cost.
  absl::Status Issue(std::string what, std::vector<ConstBufferRef> reads,
                     std::vector<ConstBufferRef> writes,
                     std::function<void()> run,
                     absl::Duration duration = -absl::Nanoseconds(1));
  // Queues a no-op on `stream` that waits for `events` (and `ready`).
  void QueueWait(int32_t stream, std::string what, std::vector<int64_t> events,
                 std::function<absl::Duration()> ready);
  void AdvanceHost(absl::Duration t);
  bool Runnable(const StreamState& s) const;
  // Runs queued work (PRNG-ordered) until `done` holds or nothing runs.
  void RunUntil(const std::function<bool()>& done);

  const SimDeviceOptions options_;
  std::mt19937_64 rng_;
  // Per slot: its generation now, the recorded accesses of that
  // generation, and whether it is a collective's (recyclable).
  std::vector<uint32_t> slot_gen_;
  std::vector<int64_t> slot_refs_;
  std::vector<char> slot_is_collective_;
  std::vector<int32_t> free_slots_;
  // The collective being issued: not recycled while it records accesses.
  int32_t issuing_slot_ = -1;
  Agent host_agent_;
  Clock host_;
  std::vector<StreamState> streams_;
  // By id (DeviceOps numbers events 0, 1, ...).
  std::deque<EventState> events_;
  std::map<int64_t, Clock> collectives_;
  int64_t next_collective_ = 0;
  std::map<const char*, Block> blocks_;  // by address, live and quarantined
  std::deque<const char*> quarantine_;
  int64_t quarantined_bytes_ = 0;
  int64_t executed_ = 0;
  std::vector<std::string> reports_;
  // The host's clock when options_.host_clock is null.
  absl::Duration own_clock_;
  // metadata_only: the next placeholder address.
  uintptr_t next_placeholder_;
};

// A Communicator that passes the buffers of `ops` (labelled cuda:0) to
// `inner` as host buffers and reports each collective's accesses to `ops`
// (CollectiveIssued at the call, CollectiveDone when Wait returns), so that
// the race detector sees the collectives as agents. With `stream_ordered`
// it is a simulated NCCL: SupportsStreams(cuda:0) is true, a collective
// issued with CollectiveOptions::stream (a stream of `ops`) is ordered
// after that stream (CollectiveIssuedAfter) and Work::WaitStream orders a
// stream of `ops` after the collective (CollectiveWaitedOn); without it
// those are ignored / Unimplemented, as for a host backend. When `inner` is
// a SimCommunicator, stream-ordered collectives arrive on the virtual
// clock when their stream is ready (SimCommunicator::ArriveNextAt) and
// stream waits end when the collective does (WaitOnDevice). Borrows
// `inner` and `ops`; split communicators wrap the split the same way.
class StreamCheckedCommunicator final : public ForwardingCommunicator {
 public:
  StreamCheckedCommunicator(Communicator* inner, SimDeviceOps* ops,
                            bool stream_ordered = false);
  StreamCheckedCommunicator(std::unique_ptr<Communicator> inner,
                            SimDeviceOps* ops, bool stream_ordered = false);

  bool SupportsStreams(Device device) const override {
    return stream_ordered_ && device == ops_->device();
  }
  std::unique_ptr<Work> AllGather(ConstBufferRef input, BufferRef output,
                                  const CollectiveOptions& options) override;
  std::unique_ptr<Work> ReduceScatter(ConstBufferRef input, BufferRef output,
                                      const ReduceOptions& options) override;
  std::unique_ptr<Work> AllReduce(ConstBufferRef input, BufferRef output,
                                  const ReduceOptions& options) override;
  std::unique_ptr<Work> Broadcast(BufferRef buffer,
                                  const BroadcastOptions& options) override;
  absl::StatusOr<std::unique_ptr<Communicator>> Split(
      int color, int key, const CollectiveOptions& options) override;

  bool stream_ordered() const { return stream_ordered_; }

 private:
  // Issues `issue` (the inner collective) as collective `what` of `ops_` on
  // `input`/`output`, stream-ordered when options.stream asks for it.
  std::unique_ptr<Work> Checked(
      absl::string_view what, ConstBufferRef input, ConstBufferRef output,
      const CollectiveOptions& options,
      const std::function<std::unique_ptr<Work>()>& issue);

  SimDeviceOps* ops_;
  bool stream_ordered_;
};

}  // namespace flatparam

#endif  // FLATPARAM_SIM_SIM_DEVICE_H_
