// FlightRecorder: the last collectives of one rank, kept in a ring so that
// a hung or failed job can say afterwards which rank issued which
// collective, from which FSDP unit and phase, and how far each got
// (PyTorch's NCCL flight recorder, for every flatparam backend).
//
// Every backend (the simulator, MPI, c10d, NCCL) records each collective
// it is given: the group and its sequence number there, the operation,
// dtype, element count and bytes, the FSDP context the caller set
// (ScopedCollectiveContext: unit, handle, phase), and its states with
// timestamps: enqueued (the call), started (the backend began moving its
// data; backends that cannot tell leave it unset), and completed or failed
// (with the error). The ring keeps the newest `capacity` entries.
//
// Dumps. The ring is written as JSON (format below) to
// `trace_dir/rank_<R>.json`:
//   * when a collective fails (a timeout, a lost peer, a desync), before
//     the backend's error reaches the caller, so before any abort;
//   * on SIGUSR1, without stopping the job, and on SIGTERM, before the
//     process ends as SIGTERM ends it: launchers (mpirun, torchrun) end a
//     job's other processes with SIGTERM when one dies
//     (InstallFlightRecorderSignal);
//   * on demand: Dump() / DumpAllFlightRecorders().
// A dump copies the ring under a mutex that no collective holds while
// it waits, then writes outside it: it never waits for a hung collective.
// Without a trace_dir nothing is written (the ring still records, and
// Snapshot() reads it). `fsdp diagnose DIR` reads the dumps of all ranks.
//
// Dump format (one JSON object per file, "format": "flatparam.flight",
// "version": 1): rank, world_size, backend, pid, host, reason,
// dumped_at_ns (Unix time), first_failure ("CODE: message" of the first
// collective that failed here, or ""), capacity, recorded (entries ever
// recorded;
// the ring dropped the oldest recorded - capacity), groups ([{id, ranks}],
// ranks in world ranks, group rank order), entries (oldest first): {id,
// group, seq, op, dtype, count, bytes, unit, handle, phase, state,
// enqueued_ns, started_ns, finished_ns, error}; a time of 0 is not reached.
// `count` is the count that must agree across the group (all_gather's
// input, reduce_scatter's output, all_reduce's and broadcast's count;
// all_gather_bytes' own length, which may differ).
//
// Configuration: FlightRecorderOptions, or the environment
// (FLATPARAM_TRACE_DIR, FLATPARAM_FLIGHT_RECORDER_ENTRIES; 0 entries turns
// recording off) for backends created without options.
//
// Example (a backend):
//   auto recorder = FlightRecorder::Create(rank, size, "mpi", options);
//   uint64_t id = recorder->Enqueue(group, seq, CollectiveOp::kAllGather,
//                                   DType::kFloat32, count, bytes);
//   recorder->Started(id);
//   recorder->Finished(id, status);  // dumps if `status` is an error
// and a caller naming what it issues:
//   ScopedCollectiveContext ctx(comm.flight_recorder(),
//                               {"h.2", 3, CollectivePhase::kForwardUnshard});
//
// Ownership: recorders are shared (std::shared_ptr) by the communicators
// of one rank, its world and the groups split from it. Thread-safety: all
// methods may be called from any thread (a backend's progress thread marks
// starts and completions); the context is the rank thread's.
#ifndef FLATPARAM_COMM_FLIGHT_RECORDER_H_
#define FLATPARAM_COMM_FLIGHT_RECORDER_H_

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "comm/communicator.h"
#include "flatparam/base/dtype.h"

namespace flatparam {

// What FSDP was doing when it issued a collective.
enum class CollectivePhase : uint8_t {
  kNone = 0,
  kForwardUnshard,
  kForwardPrefetch,
  kRecomputeUnshard,
  kPostForward,
  kPreBackwardUnshard,
  kBackwardPrefetch,
  kPostBackwardReduce,
  kFinalizeBackward,
  kGradNorm,
  kSummon,
  kOptimStateGather,
  kOptimStateScatter,
  kCheckpoint,
  kInit,
};

// "forward unshard", "post-backward reduce", ...; "" for kNone.
absl::string_view CollectivePhaseName(CollectivePhase phase);

struct CollectiveContext {
  // The FSDP unit's name ("" for none; the root unit is "<root>").
  std::string unit;
  // The unit's index in its runtime (-1 for none).
  int handle = -1;
  CollectivePhase phase = CollectivePhase::kNone;
};

// "unit h.2, forward unshard", "unit h.2", "forward unshard", or "" for no
// context.
std::string DescribeContext(const CollectiveContext& context);

// A process group as flight records name it: an id that every member
// derives alike ("world"; a split: "<parent>/split<seq>:<color>"), and its
// members' world ranks in group rank order (empty when unknown).
struct FlightGroup {
  std::string id;
  std::vector<int> ranks;
};

// The group id of the subgroup `color` that Split, as collective `seq` of
// `parent`, makes.
std::string SplitGroupId(absl::string_view parent, int64_t seq, int color);

enum class FlightState : uint8_t { kEnqueued, kStarted, kCompleted, kFailed };
absl::string_view FlightStateName(FlightState state);

struct FlightEntry {
  uint64_t id = 0;
  std::shared_ptr<const FlightGroup> group;
  int64_t seq = 0;
  CollectiveOp op = CollectiveOp::kBarrier;
  // Unset for the byte collectives (all_gather_bytes, barrier, split).
  bool has_dtype = false;
  DType dtype = DType::kFloat32;
  int64_t count = 0;
  int64_t bytes = 0;
  CollectiveContext context;
  FlightState state = FlightState::kEnqueued;
  // Unix times in nanoseconds; 0 until reached.
  int64_t enqueued_ns = 0;
  int64_t started_ns = 0;
  int64_t finished_ns = 0;
  std::string error;
};

struct FlightRecorderOptions {
  // Entries kept; 0 records nothing.
  int capacity = 2000;
  // Where dumps go; empty: nowhere (the ring still records).
  std::string trace_dir;
  // Dump when a collective fails (the first failure only).
  bool dump_on_failure = true;
};

// The options from FLATPARAM_TRACE_DIR and FLATPARAM_FLIGHT_RECORDER_ENTRIES
// (defaults where unset or malformed).
FlightRecorderOptions FlightRecorderOptionsFromEnv();

class FlightRecorder {
 public:
  // A recorder for world rank `rank` of `world_size`, registered for
  // DumpAllFlightRecorders (and SIGUSR1) until destroyed.
  static std::shared_ptr<FlightRecorder> Create(
      int rank, int world_size, std::string backend,
      const FlightRecorderOptions& options = FlightRecorderOptionsFromEnv());
  ~FlightRecorder();
  FlightRecorder(const FlightRecorder&) = delete;
  FlightRecorder& operator=(const FlightRecorder&) = delete;

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  const FlightRecorderOptions& options() const { return options_; }

  // Records a collective as enqueued now, with the current context. Returns
  // its id for Started/Finished (0 when recording is off; they ignore 0).
  // `dtype` is ignored for the byte collectives.
  uint64_t Enqueue(std::shared_ptr<const FlightGroup> group, int64_t seq,
                   CollectiveOp op, DType dtype, int64_t count, int64_t bytes);
  // Marks a recorded collective started / finished now. An entry the ring
  // has dropped since is ignored. A failed `status` dumps the ring (the
  // first time, with a trace_dir and dump_on_failure).
  void Started(uint64_t id);
  void Finished(uint64_t id, const absl::Status& status);

  // The context later Enqueue calls record (the rank thread's; see
  // ScopedCollectiveContext).
  void SetContext(CollectiveContext context);
  CollectiveContext context() const;

  // The ring, oldest first.
  std::vector<FlightEntry> Snapshot() const;
  // Entries ever recorded (the ring holds the newest `capacity`).
  uint64_t recorded() const;
  // The dump's JSON text.
  std::string ToJson(absl::string_view reason) const;
  // Writes the dump into the trace_dir (FailedPrecondition without one) and
  // returns its path. The first dump of a recorder never replaces a file it
  // did not write: it takes `rank_<R>.json`, or where that exists
  // `rank_<R>.<pid>.json`, then `rank_<R>.<pid>.<n>.json` (fsdp diagnose
  // takes each rank's newest); later dumps replace its own. Files appear
  // whole (written aside, then linked or renamed into place).
  absl::StatusOr<std::string> Dump(absl::string_view reason);
  // Writes the dump to `path` (replaced atomically).
  absl::Status DumpTo(const std::string& path, absl::string_view reason) const;

 private:
  FlightRecorder(int rank, int world_size, std::string backend,
                 const FlightRecorderOptions& options);
  void DumpOnFailure(const absl::Status& status);

  const int rank_;
  const int world_size_;
  const std::string backend_;
  const FlightRecorderOptions options_;

  const uint64_t capacity_;

  mutable std::mutex mu_;
  std::vector<FlightEntry> ring_;  // Slot (id - 1) % capacity_.
  uint64_t next_id_ = 1;
  CollectiveContext context_;
  bool dumped_on_failure_ = false;
  std::string first_failure_;  // "CODE: message" of the first failure.
  // Serializes dumps (a failure and a signal may dump at once).
  std::mutex dump_mu_;
  std::string dump_path_;  // Claimed by the first Dump(); guarded by dump_mu_.
};

// Sets `recorder`'s context for the scope and restores the previous one
// after. A null recorder does nothing (a communicator that records
// nothing).
class ScopedCollectiveContext {
 public:
  ScopedCollectiveContext(FlightRecorder* recorder, CollectiveContext context);
  ~ScopedCollectiveContext();
  ScopedCollectiveContext(const ScopedCollectiveContext&) = delete;
  ScopedCollectiveContext& operator=(const ScopedCollectiveContext&) = delete;

 private:
  FlightRecorder* recorder_;
  CollectiveContext previous_;
};

// `work`, recording its completion in `recorder` (entry `id`) when Wait()
// returns: for backends whose collectives end on a device, where the host
// sees the end only there. WaitStream is passed through. A null recorder
// returns `work` itself.
std::unique_ptr<Work> RecordedWork(std::unique_ptr<Work> work,
                                   std::shared_ptr<FlightRecorder> recorder,
                                   uint64_t id);

// Dumps every live recorder of this process that has a trace_dir; returns
// the paths written (errors are printed to stderr, not returned).
std::vector<std::string> DumpAllFlightRecorders(absl::string_view reason);

// Makes SIGUSR1 dump every recorder (DumpAllFlightRecorders, from a thread
// of its own) without stopping the process, and SIGTERM dump them and then
// end the process as SIGTERM does. Leaves a signal the program already
// handles alone, and says so (FailedPrecondition). Idempotent (the first
// call's result); FlightRecorder::Create calls it for recorders with a
// trace_dir.
absl::Status InstallFlightRecorderSignal();

}  // namespace flatparam

#endif  // FLATPARAM_COMM_FLIGHT_RECORDER_H_
