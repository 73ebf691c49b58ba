// Private to //sim:sim: what the implementation files of the simulator
// share besides sim.h. They are
//   sim.cc               SimWorld's creation and Run(): the ranks' threads;
//   sim_communicator.cc  SimCommunicator, which turns calls into Calls;
//   sim_scheduler.cc     the baton (which rank runs next) and deadlock
//                        detection;
//   sim_issue.cc         issuing a call (validation, kill and delay faults)
//                        and waiting on it;
//   sim_execute.cc       executing an operation whose members all arrived:
//                        its start (or timeout) on the virtual clock, the
//                        data movement, completion and failure;
//   sim_desync.cc        rejecting an operation whose members disagree;
//   sim_corruption.cc    flip faults and checksums;
//   sim_trace.cc         trace events and the Chrome trace;
//   sim_describe.cc      how calls and ranks are named in messages.
// Here: one call (internal_sim::Call), the helpers several of them use, and
// the definitions of SimWorld's private nested types.
//
// Ownership and thread-safety: as SimWorld (sim.h). SimWorld owns its Ranks
// and Groups; an Op is shared by its group's pending map, the Works of its
// members and, with one_stream_per_rank, its members' queues and
// SimWorld::unblock_candidates_. Everything here is guarded by SimWorld::mu_,
// except a Rank's thread handle (Run() only) and the thread-local tls_rank.
#ifndef FLATPARAM_SIM_INTERNAL_SIM_INTERNAL_H_
#define FLATPARAM_SIM_INTERNAL_SIM_INTERNAL_H_

#include <pthread.h>

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "comm/communicator.h"
#include "comm/flight_recorder.h"
#include "sim/fault.h"
#include "sim/internal/fiber.h"
#include "sim/sim.h"

namespace flatparam {
namespace internal_sim {

// One collective call as a rank issued it.
struct Call {
  OpKind kind = OpKind::kBarrier;
  ConstBufferRef input;
  BufferRef output;  // broadcast: the buffer (input views it too)
  ReduceOptions reduce;
  int root = 0;
  absl::Duration timeout = kDefaultCollectiveTimeout;
  std::string bytes;  // all_gather_bytes
  int color = 0;
  int key = 0;

  // The per-rank count that members must agree on.
  int64_t count() const {
    return kind == OpKind::kReduceScatter ? output.count : input.count;
  }
};

inline absl::string_view KindName(OpKind kind) {
  return CollectiveOpName(kind);
}

inline bool IsReduction(OpKind kind) {
  return kind == OpKind::kReduceScatter || kind == OpKind::kAllReduce;
}

inline bool HasBuffers(OpKind kind) {
  return kind == OpKind::kAllGather || kind == OpKind::kReduceScatter ||
         kind == OpKind::kAllReduce || kind == OpKind::kBroadcast;
}

// The rank currently running on this thread, to catch a communicator or Work
// used from another rank's thread. Set by SimWorld::ThreadMain (sim.cc).
extern thread_local const void* tls_rank;

inline std::string FormatTime(absl::Duration d) {
  return absl::FormatDuration(d);
}

// Messages (sim_describe.cc).

// One line per distinct text, "ranks 0-6, 9: text", its ranks as runs
// (RankSet).
std::string ListByRank(const std::vector<std::pair<int, std::string>>& items);

// Sorted ranks as runs: "0-5, 7, 9-2041 step 8", at most `cap` runs then
// "and N more".
std::string RankSet(const std::vector<int>& ranks, size_t cap);

// "1, 2, 3", or "1, 2 and 7 more" past `cap` ranks.
std::string JoinCapped(const std::vector<int>& ranks, size_t cap);

// What a call is beyond its kind: "16 x float32, sum", "color 1, key 0".
std::string Detail(OpKind kind, const internal_sim::Call& c);

// " (detail)", or "" for collectives without details (barrier).
std::string InParens(const std::string& detail);

}  // namespace internal_sim

// SimWorld's private nested types.

struct SimWorld::OpMember {
  bool present = false;
  bool done = false;
  bool waited = false;
  bool abandoned = false;
  bool invalid = false;
  int world_rank = 0;
  int64_t rank_op = 0;
  int64_t bytes = 0;
  Call call;
  absl::Duration arrive;
  absl::Duration start;
  absl::Duration end;
  std::vector<uint64_t> sent_hashes;  // checksum mode
  const FaultSpec* flip = nullptr;
  absl::Status status;
  // The call's entry in its rank's flight recorder (0: none).
  uint64_t flight_id = 0;
  // SimOptions::check_context: the caller's context at the issue.
  CollectiveContext context;
  // split: the member's new group, or -1.
  int new_group = -1;
  int new_rank = -1;
};

struct SimWorld::Op {
  Group* group = nullptr;
  int64_t seq = 0;
  int arrived = 0;
  std::vector<OpMember> members;  // by group rank
  // all_gather_bytes: what every member receives, and the sender of a
  // flipped payload, which keeps its own original.
  std::vector<std::string> gathered;
  int flipped_sender = -1;
  std::string flipped_original;
  // No longer pending: executed or failed.
  bool finished = false;
  // one_stream_per_rank: every member issued it, but it is not yet at the
  // front of every member's queue.
  bool blocked = false;
  // one_stream_per_rank: the members whose queue it heads (see
  // SimWorld::AdvanceFront), and an id no other operation of the world
  // has (addresses are reused).
  int at_front = 0;
  uint64_t uid = 0;
};

struct SimWorld::Group {
  int id = 0;
  std::vector<int> members;  // world ranks by group rank
  // Its name in flight records ("world", then SplitGroupId).
  std::shared_ptr<const FlightGroup> flight;
  std::vector<int64_t> next_seq;
  std::map<int64_t, std::shared_ptr<Op>> pending;  // unfinished, by seq
  bool aborted = false;
  std::string abort_reason;
};

struct SimWorld::Rank {
  enum class State : uint8_t { kReady, kBlocked, kDone };

  SimWorld* world = nullptr;
  int id = 0;
  pthread_t thread{};
  bool started = false;
  // SimOptions::Execution::kFibers: the rank's fiber.
  std::unique_ptr<internal_sim::FiberContext> fiber;
  std::condition_variable cv;
  State state = State::kReady;
  int runnable_index = -1;
  absl::Duration clock;
  absl::Duration stream_free;  // end of the rank's last operation
  // SimCommunicator::ArriveNextAt's time for the next collective.
  std::optional<absl::Duration> next_arrival;
  // one_stream_per_rank: the operations this rank joined, oldest first
  // (finished ones are dropped from the front).
  std::deque<std::shared_ptr<Op>> in_order;
  // The uid of the operation counted as heading in_order (0: none).
  uint64_t front_counted = 0;
  int64_t ops = 0;  // collective calls so far
  Op* wait_op = nullptr;
  int wait_member = -1;
  bool dead = false;
  std::string death;
  std::vector<int> groups;
  std::vector<const FaultSpec*> faults;
  std::unique_ptr<SimCommunicator> comm;
  // Null when SimOptions::flight_recorder records nothing.
  std::shared_ptr<FlightRecorder> recorder;
};

class SimWorld::SimWork final : public Work {
 public:
  SimWork(SimWorld* world, int world_rank, std::shared_ptr<Op> op, int member)
      : world_(world),
        world_rank_(world_rank),
        op_(std::move(op)),
        member_(member) {}
  ~SimWork() override { world_->Abandon(*op_, member_); }

  absl::Status Wait() override {
    return world_->WaitFor(world_rank_, *op_, member_);
  }
  absl::Duration WaitOnDevice() {
    absl::Duration end;
    world_->WaitFor(world_rank_, *op_, member_, /*device_wait=*/true, &end)
        .IgnoreError();  // a stream wait cannot fail; Wait() reports it
    return end;
  }

 private:
  SimWorld* world_;
  int world_rank_;
  std::shared_ptr<Op> op_;
  int member_;
};

// What each member sends, and the one corrupted copy a flip fault makes.
struct SimWorld::Delivery {
  internal_sim::OpKind kind = internal_sim::OpKind::kBarrier;
  int root = -1;                 // broadcast only
  std::vector<const char*> src;  // each member's payload as sent
  std::vector<int64_t> payload;  // its size in bytes
  std::vector<char> flipped;     // the corrupted copy, if any
  int flip_member = -1;          // the member named by the flip fault

  // What `receiver` gets from `sender`. A sender never corrupts its own copy.
  const char* Source(int sender, int receiver) const {
    if (flip_member < 0 || receiver == sender) return src[sender];
    if (kind == internal_sim::OpKind::kBroadcast) {
      // The root's flip reaches every receiver, a receiver's only itself.
      return receiver == flip_member || flip_member == root ? flipped.data()
                                                            : src[sender];
    }
    return sender == flip_member ? flipped.data() : src[sender];
  }
  // What `sender` contributes to a reduction.
  const char* Contribution(int sender) const {
    return sender == flip_member ? flipped.data() : src[sender];
  }
};

}  // namespace flatparam

#endif  // FLATPARAM_SIM_INTERNAL_SIM_INTERNAL_H_
