#include "sim/sim_device.h"

#include <algorithm>
#include <cassert>
#include <cstring>
#include <new>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "flatparam/base/status_macros.h"

namespace flatparam {
namespace {

ConstBufferRef AsHost(ConstBufferRef b) {
  if (b.device.type == DeviceType::kCuda) b.device = Device::Host();
  return b;
}

BufferRef AsHost(BufferRef b) {
  if (b.device.type == DeviceType::kCuda) b.device = Device::Host();
  return b;
}

std::string Describe(ConstBufferRef b) {
  return absl::StrFormat("%d x %s at %p", b.count, DTypeName(b.dtype), b.data);
}

}  // namespace

void SimRankClock::AdvanceTo(absl::Duration t) {
  const absl::Duration now = comm_->Now();
  if (t > now) comm_->Compute(t - now).IgnoreError();  // finite, positive
}

SimDeviceOps::SimDeviceOps(SimDeviceOptions options)
    : options_(options),
      rng_(options.seed),
      streams_(1),
      // Far above the heap; never dereferenced.
      next_placeholder_(uintptr_t{1} << 44) {
  host_agent_ = Agent{kHost, NewSlot(), 1};
  streams_[0].agent = Agent{StreamAgent(0), NewSlot(), 1};
}

int32_t SimDeviceOps::NewSlot() {
  slot_gen_.push_back(1);
  slot_refs_.push_back(0);
  slot_is_collective_.push_back(0);
  return static_cast<int32_t>(slot_gen_.size() - 1);
}

SimDeviceOps::Agent SimDeviceOps::NewCollectiveAgent(int64_t id) {
  int32_t slot;
  if (free_slots_.empty()) {
    slot = NewSlot();
    slot_is_collective_[slot] = 1;
  } else {
    slot = free_slots_.back();
    free_slots_.pop_back();
    ++slot_gen_[slot];
  }
  return Agent{-1 - id, slot, slot_gen_[slot]};
}

void SimDeviceOps::MaybeRecycle(int32_t slot) {
  if (slot_is_collective_[slot] && slot_refs_[slot] == 0 &&
      slot != issuing_slot_) {
    free_slots_.push_back(slot);
  }
}

void SimDeviceOps::DropAccess(const Access& a) {
  if (slot_gen_[a.slot] != a.gen) return;
  --slot_refs_[a.slot];
  MaybeRecycle(a.slot);
}

absl::Duration SimDeviceOps::HostNow() const {
  return options_.host_clock != nullptr ? options_.host_clock->Now()
                                        : own_clock_;
}

void SimDeviceOps::AdvanceHost(absl::Duration t) {
  if (options_.host_clock != nullptr) {
    options_.host_clock->AdvanceTo(t);
  } else {
    own_clock_ = std::max(own_clock_, t);
  }
}

absl::Duration SimDeviceOps::StreamBusy(Stream stream) const {
  return HasStream(stream) ? streams_[stream.id].busy : absl::ZeroDuration();
}

std::optional<DeviceStream> SimDeviceOps::DoNativeStream(Stream stream) const {
  DeviceStream out;
  out.device = device();
  out.owner = this;
  out.handle = static_cast<uintptr_t>(stream.id);
  return out;
}

SimDeviceOps::~SimDeviceOps() {
  RunUntil([] { return false; });
  for (auto& [p, block] : blocks_) {
    assert(block.freed && "a SimDeviceOps block outlived its ops");
    if (!options_.metadata_only) {
      ::operator delete (const_cast<char*>(p), std::align_val_t{64});
    }
  }
}

void SimDeviceOps::Join(Clock& into, const Clock& from) {
  if (into.size() < from.size()) into.resize(from.size());
  for (size_t i = 0; i < from.size(); ++i) {
    const Tick& t = from[i];
    Tick& mine = into[i];
    // A later generation replaces a recycled slot's dead agent.
    if (t.gen > mine.gen || (t.gen == mine.gen && t.time > mine.time)) {
      mine = t;
    }
  }
}

bool SimDeviceOps::OrderedBefore(const Access& a, const Clock& later) {
  return static_cast<size_t>(a.slot) < later.size() &&
         later[a.slot].gen == a.gen && later[a.slot].time >= a.time;
}

int64_t SimDeviceOps::Tock(Clock& clock, const Agent& agent) {
  if (clock.size() <= static_cast<size_t>(agent.slot)) {
    clock.resize(agent.slot + 1);
  }
  Tick& t = clock[agent.slot];
  if (t.gen != agent.gen) t = Tick{agent.gen, 0};
  return ++t.time;
}

std::string SimDeviceOps::AgentName(int64_t agent) const {
  if (agent == kHost) return "the host";
  if (agent > 0) return absl::StrCat("stream ", agent - 1);
  return absl::StrCat("collective #", -agent - 1);
}

void SimDeviceOps::Report(std::string line) {
  if (std::find(reports_.begin(), reports_.end(), line) == reports_.end()) {
    reports_.push_back(std::move(line));
  }
}

absl::Status SimDeviceOps::CheckNoRaces() const {
  if (reports_.empty()) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(reports_.size(),
                                          " stream ordering problem(s):\n  ",
                                          absl::StrJoin(reports_, "\n  ")));
}

SimDeviceOps::Block* SimDeviceOps::Find(const void* p, int64_t bytes,
                                        int64_t* offset) {
  const char* c = static_cast<const char*>(p);
  auto it = blocks_.upper_bound(c);
  if (it == blocks_.begin()) return nullptr;
  --it;
  if (c + bytes > it->first + it->second.bytes) return nullptr;
  *offset = c - it->first;
  return &it->second;
}

void SimDeviceOps::Touch(const Agent& agent, const Clock& clock,
                         absl::string_view what, ConstBufferRef buffer,
                         bool write) {
  if (buffer.count == 0 || buffer.device == Device::Host()) return;
  int64_t offset = 0;
  Block* block = Find(buffer.data, buffer.bytes(), &offset);
  if (block == nullptr) return;  // not memory of these ops
  // Only a report needs the access described.
  auto me = [&] {
    return absl::StrFormat("%s (%s, %s %s)", what, AgentName(agent.id),
                           write ? "writes" : "reads", Describe(buffer));
  };
  if (block->freed) {
    Report(absl::StrFormat(
        "use after free: %s after it was freed (%d bytes of stream %d)", me(),
        block->bytes, block->stream));
    return;
  }
  const int64_t end = offset + buffer.bytes();
  for (const Access& a : block->accesses) {
    if (a.agent == agent.id || (!a.write && !write)) continue;
    if (a.offset >= end || offset >= a.offset + a.bytes) continue;
    if (OrderedBefore(a, clock)) continue;
    Report(absl::StrFormat(
        "race: %s is not ordered after %s (%s, %s bytes [%d, %d) of the "
        "block)",
        me(), a.what, AgentName(a.agent), a.write ? "writes" : "reads",
        a.offset, a.offset + a.bytes));
  }
  const int64_t time = clock[agent.slot].time;
  // Accesses this one covers and follows are no longer needed to find
  // races: an access that races with one of them races with this one too
  // (ordering is transitive). A write replaces any; a read replaces reads.
  // So a buffer read by every step's collective keeps one reader.
  std::vector<Access>& list = block->accesses;
  size_t kept = 0;
  for (size_t i = 0; i < list.size(); ++i) {
    const Access& a = list[i];
    const bool replaced = (write || !a.write) && a.offset >= offset &&
                          a.offset + a.bytes <= end &&
                          (a.agent == agent.id || OrderedBefore(a, clock));
    if (replaced) {
      DropAccess(a);
    } else {
      if (kept != i) list[kept] = std::move(list[i]);
      ++kept;
    }
  }
  list.resize(kept);
  ++slot_refs_[agent.slot];
  list.push_back(Access{offset, buffer.bytes(), write, agent.id, agent.slot,
                        agent.gen, time, std::string(what)});
}

int64_t SimDeviceOps::CollectiveIssued(absl::string_view what,
                                       ConstBufferRef input,
                                       ConstBufferRef output) {
  return AddCollective(what, "", nullptr, input, output);
}

int64_t SimDeviceOps::AddCollective(absl::string_view what,
                                    absl::string_view suffix,
                                    const Clock* after, ConstBufferRef input,
                                    ConstBufferRef output) {
  const int64_t id = next_collective_++;
  const Agent agent = NewCollectiveAgent(id);
  Tock(host_, host_agent_);
  Clock clock = host_;
  if (after != nullptr) Join(clock, *after);
  Tock(clock, agent);
  const std::string name = absl::StrCat(what, " #", id, suffix);
  issuing_slot_ = agent.slot;
  Touch(agent, clock, name, input, /*write=*/false);
  Touch(agent, clock, name, output, /*write=*/true);
  issuing_slot_ = -1;
  MaybeRecycle(agent.slot);
  collectives_[agent.id] = std::move(clock);
  return id;
}

bool SimDeviceOps::HasStream(Stream stream) const {
  return stream.id >= 0 && stream.id < static_cast<int32_t>(streams_.size());
}

absl::StatusOr<int64_t> SimDeviceOps::CollectiveIssuedAfter(
    absl::string_view what, Stream after, ConstBufferRef input,
    ConstBufferRef output, absl::Duration* arrival) {
  if (!HasStream(after)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "sim device: %s ordered after stream %d, which these ops (%d "
        "streams) did not create",
        what, after.id, streams_.size()));
  }
  // The simulated collective moves data when its last member arrives: run
  // the work it is ordered after first.
  const int64_t target = streams_[after.id].issued;
  RunUntil([&] { return streams_[after.id].done >= target; });
  *arrival = std::max(HostNow(), streams_[after.id].free_at);
  return AddCollective(what, absl::StrCat(" (after stream ", after.id, ")"),
                       &streams_[after.id].clock, input, output);
}

void SimDeviceOps::CollectiveDone(int64_t id) {
  auto it = collectives_.find(-1 - id);
  if (it == collectives_.end()) return;
  Join(host_, it->second);
  collectives_.erase(it);
}

void SimDeviceOps::CollectiveReleased(int64_t id) {
  collectives_.erase(-1 - id);
}

absl::Status SimDeviceOps::CollectiveWaitedOn(
    int64_t id, Stream stream, std::function<absl::Duration()> end) {
  if (!HasStream(stream)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "sim device: a wait for collective #%d on stream %d, which these ops "
        "(%d streams) did not create",
        id, stream.id, streams_.size()));
  }
  StreamState& s = streams_[stream.id];
  // Once the host waited for it (CollectiveDone) the host's clock, which
  // the stream joins below, holds the collective's.
  auto it = collectives_.find(-1 - id);
  if (it != collectives_.end()) Join(s.clock, it->second);
  QueueWait(stream.id, absl::StrCat("wait for collective #", id), {},
            std::move(end));
  return absl::OkStatus();
}

absl::Status SimDeviceOps::Kernel(std::string what,
                                  std::vector<ConstBufferRef> reads,
                                  std::vector<BufferRef> writes,
                                  absl::Duration duration,
                                  std::function<void()> run) {
  if (duration < absl::ZeroDuration() || duration == absl::InfiniteDuration()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("sim device: kernel '%s' with duration %s: must be "
                        "finite and non-negative",
                        what, absl::FormatDuration(duration)));
  }
  std::vector<ConstBufferRef> w(writes.begin(), writes.end());
  return Issue(
      std::move(what), std::move(reads), std::move(w),
      run ? std::move(run) : [] {}, duration);
}

void SimDeviceOps::HostAccess(absl::string_view what, ConstBufferRef buffer,
                              bool write) {
  Tock(host_, host_agent_);
  Touch(host_agent_, host_, what, buffer, write);
}

absl::Status SimDeviceOps::Issue(std::string what,
                                 std::vector<ConstBufferRef> reads,
                                 std::vector<ConstBufferRef> writes,
                                 std::function<void()> run,
                                 absl::Duration duration) {
  const int32_t s = current_stream().id;
  StreamState& stream = streams_[s];
  const Agent agent = stream.agent;
  // Ordered after the stream's earlier work and the host's issuing it.
  Join(stream.clock, host_);
  Tock(stream.clock, agent);
  for (ConstBufferRef r : reads) Touch(agent, stream.clock, what, r, false);
  for (ConstBufferRef w : writes) Touch(agent, stream.clock, what, w, true);
  bool touches_host = false;
  int64_t bytes = 0;
  for (const auto* list : {&reads, &writes}) {
    for (ConstBufferRef b : *list) {
      touches_host |= b.device == Device::Host();
      bytes += b.bytes();
    }
  }
  if (duration < absl::ZeroDuration()) {
    duration = options_.memory_bytes_per_second > 0
                   ? absl::Seconds(static_cast<double>(bytes) /
                                   options_.memory_bytes_per_second)
                   : absl::ZeroDuration();
  }
  Op op;
  op.what = std::move(what);
  if (!options_.metadata_only) op.run = std::move(run);
  op.issued_at = HostNow();
  op.duration = duration;
  stream.queue.push_back(std::move(op));
  ++stream.issued;
  if (touches_host) {
    // DeviceOps' rule: an operation on host memory has completed when it
    // returns; the host is then ordered after it.
    RunUntil([&] { return streams_[s].done == streams_[s].issued; });
    Join(host_, streams_[s].clock);
    AdvanceHost(streams_[s].free_at);
  }
  int64_t queued = 0;
  for (const StreamState& st : streams_) queued += st.queue.size();
  if (queued > options_.max_queued) {
    RunUntil([&] {
      int64_t q = 0;
      for (const StreamState& st : streams_) q += st.queue.size();
      return q <= options_.max_queued / 2;
    });
  }
  return absl::OkStatus();
}

bool SimDeviceOps::Runnable(const StreamState& s) const {
  if (s.queue.empty()) return false;
  for (int64_t e : s.queue.front().waits) {
    const EventState& event = events_.at(e);
    if (streams_[event.stream].done < event.ops_before) return false;
  }
  return true;
}

void SimDeviceOps::RunUntil(const std::function<bool()>& done) {
  while (!done()) {
    std::vector<size_t> runnable;
    for (size_t i = 0; i < streams_.size(); ++i) {
      if (Runnable(streams_[i])) runnable.push_back(i);
    }
    if (runnable.empty()) return;
    const size_t pick = runnable[std::uniform_int_distribution<size_t>(
        0, runnable.size() - 1)(rng_)];
    Op op = std::move(streams_[pick].queue.front());
    streams_[pick].queue.pop_front();
    absl::Duration start = std::max(op.issued_at, streams_[pick].free_at);
    for (int64_t e : op.waits) start = std::max(start, *events_.at(e).time);
    // May block the rank's thread (a wait for a collective); other ranks
    // run meanwhile, but nothing of these ops does.
    if (op.ready) start = std::max(start, op.ready());
    if (op.run) op.run();
    StreamState& s = streams_[pick];
    s.free_at = start + op.duration;
    s.busy += op.duration;
    ++s.done;
    while (!s.unresolved_events.empty() &&
           s.unresolved_events.front().first <= s.done) {
      events_.at(s.unresolved_events.front().second).time = s.free_at;
      s.unresolved_events.pop_front();
    }
    ++executed_;
  }
}

absl::Status SimDeviceOps::Synchronize() {
  RunUntil([] { return false; });
  absl::Duration end = HostNow();
  for (const StreamState& s : streams_) {
    Join(host_, s.clock);
    end = std::max(end, s.free_at);
  }
  AdvanceHost(end);
  return absl::OkStatus();
}

absl::Status SimDeviceOps::DoNewStream(Stream stream) {
  assert(static_cast<size_t>(stream.id) == streams_.size());
  streams_.emplace_back();
  streams_.back().agent = Agent{StreamAgent(stream.id), NewSlot(), 1};
  return absl::OkStatus();
}

absl::Status SimDeviceOps::DoRecordEvent(Event event) {
  StreamState& s = streams_[event.stream.id];
  if (static_cast<size_t>(event.id) >= events_.size()) {
    events_.resize(event.id + 1);
  }
  EventState& e = events_[event.id];
  e = EventState{s.clock, event.stream.id, s.issued, std::nullopt};
  if (s.done == s.issued) {
    e.time = s.free_at;
  } else {
    s.unresolved_events.emplace_back(s.issued, event.id);
  }
  return absl::OkStatus();
}

void SimDeviceOps::QueueWait(int32_t stream, std::string what,
                             std::vector<int64_t> events,
                             std::function<absl::Duration()> ready) {
  StreamState& s = streams_[stream];
  Op op;
  op.what = std::move(what);
  op.run = [] {};
  op.waits = std::move(events);
  op.issued_at = HostNow();
  op.ready = std::move(ready);
  s.queue.push_back(std::move(op));
  ++s.issued;
}

absl::Status SimDeviceOps::DoWaitEvent(Stream stream, Event event) {
  StreamState& s = streams_[stream.id];
  Join(s.clock, events_.at(event.id).clock);
  // The wait is itself stream-ordered work: everything issued on the
  // stream after it (operations, and events recorded there) runs after the
  // waited-for work, as cudaStreamWaitEvent orders the stream.
  QueueWait(stream.id, absl::StrCat("wait for event ", event.id), {event.id},
            nullptr);
  return absl::OkStatus();
}

absl::Status SimDeviceOps::DoSynchronizeEvent(Event event) {
  const EventState& e = events_.at(event.id);
  RunUntil([&] { return streams_[e.stream].done >= e.ops_before; });
  Join(host_, e.clock);
  AdvanceHost(*e.time);
  return absl::OkStatus();
}

absl::Status SimDeviceOps::DoRecordStream(ConstBufferRef buffer,
                                          Stream stream) {
  int64_t offset = 0;
  Block* block = Find(buffer.data, buffer.bytes(), &offset);
  if (block == nullptr) return absl::OkStatus();  // host memory
  if (std::find(block->recorded.begin(), block->recorded.end(), stream.id) ==
      block->recorded.end()) {
    block->recorded.push_back(stream.id);
  }
  return absl::OkStatus();
}

void SimDeviceOps::AddAllocation(Block& block, int32_t stream) {
  block.stream = stream;
  const StreamState& s = streams_[stream];
  const size_t slot = static_cast<size_t>(s.agent.slot);
  // Before the stream's first operation there is no earlier owner's work
  // for the memory to wait for.
  if (slot >= s.clock.size() || s.clock[slot].time == 0) return;
  ++slot_refs_[s.agent.slot];
  block.accesses.push_back(Access{0, block.bytes, /*write=*/true, s.agent.id,
                                  s.agent.slot, s.agent.gen, s.clock[slot].time,
                                  "its allocation"});
}

absl::StatusOr<void*> SimDeviceOps::DoAllocate(Device device, int64_t bytes,
                                               bool pinned) {
  if (options_.metadata_only && device != Device::Host()) {
    // Placeholders 256-byte aligned as CUDA's allocations, one past the
    // other (a zero-byte block still gets its own address).
    void* p = reinterpret_cast<void*>(next_placeholder_);
    next_placeholder_ +=
        (static_cast<uintptr_t>(bytes) + 511) & ~uintptr_t{255};
    Block& block = blocks_[static_cast<const char*>(p)];
    block = Block{};
    block.bytes = bytes;
    AddAllocation(block, current_stream().id);
    return p;
  }
  void* p = ::operator new (static_cast<size_t>(bytes), std::align_val_t{64},
                            std::nothrow);
  if (p == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrFormat("SimDeviceOps: allocating %d bytes failed", bytes));
  }
  if (device == Device::Host()) return p;
  // Never-written memory reads as NaN in every float dtype.
  std::memset(p, 0xFF, static_cast<size_t>(bytes));
  Block& block = blocks_[static_cast<const char*>(p)];
  block = Block{};
  block.bytes = bytes;
  AddAllocation(block, current_stream().id);
  return p;
}

void SimDeviceOps::DoFree(void* data, Device device, bool pinned) {
  if (device == Device::Host()) {
    // Host memory is touched only by operations that completed before
    // returning, so nothing queued uses it.
    ::operator delete (data, std::align_val_t{64});
    return;
  }
  const char* p = static_cast<const char*>(data);
  Block& block = blocks_.at(p);
  // The caching allocator's reuse: at once on the allocating stream, after
  // the recorded streams' work issued so far.
  Clock reuse = streams_[block.stream].clock;
  Join(reuse, host_);
  for (int32_t s : block.recorded) Join(reuse, streams_[s].clock);
  for (const Access& a : block.accesses) {
    DropAccess(a);
    if (OrderedBefore(a, reuse)) continue;
    Report(absl::StrFormat(
        "freed while in use: %s (%s, %s bytes [%d, %d)) is not ordered before "
        "the block's reuse on its stream %d (wait for it, or RecordStream)",
        a.what, AgentName(a.agent), a.write ? "writes" : "reads", a.offset,
        a.offset + a.bytes, block.stream));
  }
  block.freed = true;
  block.accesses.clear();
  quarantine_.push_back(p);
  quarantined_bytes_ += block.bytes;
  while (quarantined_bytes_ > options_.quarantine_bytes) {
    // Queued work may still touch the oldest block: let it run first.
    RunUntil([] { return false; });
    const char* old = quarantine_.front();
    quarantine_.pop_front();
    quarantined_bytes_ -= blocks_.at(old).bytes;
    blocks_.erase(old);
    if (!options_.metadata_only) {
      ::operator delete (const_cast<char*>(old), std::align_val_t{64});
    }
  }
}

absl::Status SimDeviceOps::DoCopy(BufferRef dst, ConstBufferRef src) {
  return Issue("copy", {src}, {dst}, [dst, src] {
    std::memmove(dst.data, src.data, static_cast<size_t>(dst.bytes()));
  });
}

absl::Status SimDeviceOps::DoFill(BufferRef dst, double value) {
  return Issue("fill", {}, {dst}, [dst, value] {
    HostFill(dst.data, dst.dtype, dst.count, value);
  });
}

absl::Status SimDeviceOps::DoCast(BufferRef dst, ConstBufferRef src) {
  return Issue("cast", {src}, {dst}, [dst, src] {
    HostCast(dst.data, dst.dtype, src.data, src.dtype, dst.count);
  });
}

absl::Status SimDeviceOps::DoScale(BufferRef buf, ScaleOp op, double factor) {
  return Issue(absl::StrCat("scale (", ScaleOpName(op), ")"), {buf}, {buf},
               [buf, op, factor] {
                 HostScale(buf.data, buf.dtype, buf.count, op, factor);
               });
}

absl::Status SimDeviceOps::DoAdd(BufferRef acc, ConstBufferRef x) {
  return Issue("add", {acc, x}, {acc},
               [acc, x] { HostAdd(acc.data, x.data, acc.dtype, acc.count); });
}

// ---------------------------------------------------------------------------
// StreamCheckedCommunicator

namespace {

class CheckedWork final : public Work {
 public:
  // `sim`: the inner communicator when it is the simulator's, for the
  // virtual clock. `ordered`: issued stream-ordered.
  CheckedWork(std::unique_ptr<Work> inner, SimDeviceOps* ops, int64_t id,
              SimCommunicator* sim, bool stream_ordered)
      : inner_(std::move(inner)),
        ops_(ops),
        id_(id),
        sim_(sim),
        stream_ordered_(stream_ordered) {}
  // A queued stream wait holds the inner Work, not this one: nothing can
  // ask for the collective's clock any more.
  ~CheckedWork() override { ops_->CollectiveReleased(id_); }
  absl::Status Wait() override {
    absl::Status status = inner_->Wait();
    if (!done_) {
      done_ = true;
      ops_->CollectiveDone(id_);
    }
    return status;
  }
  absl::Status WaitStream(const DeviceStream& stream) override {
    if (!stream_ordered_) return Work::WaitStream(stream);
    if (stream.owner != ops_) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "WaitStream: a stream of another device (%s), not of these "
          "simulated ops",
          DeviceName(stream.device)));
    }
    // The queued wait may run after this Work is gone: it shares the
    // inner one.
    std::shared_ptr<Work> inner = inner_;
    SimCommunicator* sim = sim_;
    SimDeviceOps* ops = ops_;
    return ops_->CollectiveWaitedOn(
        id_, Stream{static_cast<int32_t>(stream.handle)},
        [inner, sim, ops]() -> absl::Duration {
          if (sim != nullptr) return sim->WaitOnDevice(*inner);
          inner->Wait().IgnoreError();  // Wait() reports failures
          return ops->HostNow();
        });
  }

 private:
  std::shared_ptr<Work> inner_;
  SimDeviceOps* ops_;
  int64_t id_;
  SimCommunicator* sim_;
  bool stream_ordered_;
  bool done_ = false;
};

}  // namespace

StreamCheckedCommunicator::StreamCheckedCommunicator(Communicator* inner,
                                                     SimDeviceOps* ops,
                                                     bool stream_ordered)
    : ForwardingCommunicator(inner),
      ops_(ops),
      stream_ordered_(stream_ordered) {}

StreamCheckedCommunicator::StreamCheckedCommunicator(
    std::unique_ptr<Communicator> inner, SimDeviceOps* ops, bool stream_ordered)
    : ForwardingCommunicator(std::move(inner)),
      ops_(ops),
      stream_ordered_(stream_ordered) {}

std::unique_ptr<Work> StreamCheckedCommunicator::Checked(
    absl::string_view what, ConstBufferRef input, ConstBufferRef output,
    const CollectiveOptions& options,
    const std::function<std::unique_ptr<Work>()>& issue) {
  auto* sim = dynamic_cast<SimCommunicator*>(&inner());
  const bool ordered = stream_ordered_ && options.stream.has_value();
  int64_t id = 0;
  if (ordered) {
    if (options.stream->owner != ops_) {
      return CompletedWork(absl::InvalidArgumentError(absl::StrFormat(
          "%s: CollectiveOptions::stream is a stream of another device (%s), "
          "not of these simulated ops",
          what, DeviceName(options.stream->device))));
    }
    absl::Duration arrival;
    absl::StatusOr<int64_t> issued = ops_->CollectiveIssuedAfter(
        what, Stream{static_cast<int32_t>(options.stream->handle)}, input,
        output, &arrival);
    if (!issued.ok()) return CompletedWork(issued.status());
    id = *issued;
    if (sim != nullptr) sim->ArriveNextAt(arrival);
  } else {
    id = ops_->CollectiveIssued(what, input, output);
  }
  return std::make_unique<CheckedWork>(issue(), ops_, id, sim, stream_ordered_);
}

std::unique_ptr<Work> StreamCheckedCommunicator::AllGather(
    ConstBufferRef input, BufferRef output, const CollectiveOptions& options) {
  return Checked("all_gather", input, output, options, [&] {
    return inner().AllGather(AsHost(input), AsHost(output), options);
  });
}

std::unique_ptr<Work> StreamCheckedCommunicator::ReduceScatter(
    ConstBufferRef input, BufferRef output, const ReduceOptions& options) {
  return Checked("reduce_scatter", input, output, options, [&] {
    return inner().ReduceScatter(AsHost(input), AsHost(output), options);
  });
}

std::unique_ptr<Work> StreamCheckedCommunicator::AllReduce(
    ConstBufferRef input, BufferRef output, const ReduceOptions& options) {
  return Checked("all_reduce", input, output, options, [&] {
    return inner().AllReduce(AsHost(input), AsHost(output), options);
  });
}

std::unique_ptr<Work> StreamCheckedCommunicator::Broadcast(
    BufferRef buffer, const BroadcastOptions& options) {
  return Checked("broadcast", buffer, buffer, options,
                 [&] { return inner().Broadcast(AsHost(buffer), options); });
}

absl::StatusOr<std::unique_ptr<Communicator>> StreamCheckedCommunicator::Split(
    int color, int key, const CollectiveOptions& options) {
  FLATPARAM_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> split,
                             inner().Split(color, key, options));
  if (split == nullptr) return split;
  return std::unique_ptr<Communicator>(
      new StreamCheckedCommunicator(std::move(split), ops_, stream_ordered_));
}

}  // namespace flatparam
