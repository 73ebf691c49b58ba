// `fsdp collectives`: runs the collective conformance suite
// (comm/conformance/collective_cases.h) and a bandwidth sweep on one
// backend, and prints a table in the style of nccl-tests.
//
//   fsdp collectives --backend=sim --world-size=8 --seed=3 --trace=t.json
//   mpirun -np 4 fsdp collectives --backend=mpi
//   mpirun -np 4 fsdp collectives --backend=nccl    # one GPU per rank
//
// The sweep times all_gather, reduce_scatter and all_reduce from
// min_bytes to max_bytes (nccl-tests' sizes: all_gather's output,
// reduce_scatter's input, all_reduce's buffer), and reports algbw and busbw
// with nccl-tests' factors (comm/conformance/bandwidth.h) and the output
// elements that were wrong. On the simulator, time is the virtual clock of
// its cost model, so the table and the trace are deterministic: equal seeds
// give byte-identical output and trace files. On MPI and NCCL, time is wall
// time, the slowest rank's, averaged over the iterations; rank 0 prints.
//
// Thread-safety: RunCollectives* are called once, from main.
#ifndef TOOLS_COLLECTIVES_H_
#define TOOLS_COLLECTIVES_H_

#include <cstdint>
#include <functional>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "comm/communicator.h"
#include "comm/conformance/bandwidth.h"
#include "comm/conformance/collective_cases.h"
#include "comm/conformance/device_memory.h"
#include "flatparam/base/dtype.h"

namespace flatparam {
namespace tools {

struct CollectivesOptions {
  // "sim", "mpi" or "nccl".
  std::string backend = "sim";
  // sim: the number of ranks. mpi/nccl: must equal the job's size when
  // world_size_given (mpirun's -np decides).
  int64_t world_size = 8;
  bool world_size_given = false;
  // sim only: the scheduler's seed, fault specs (sim/fault.h) and the
  // Chrome trace to write.
  uint64_t seed = 0;
  std::string faults;
  std::string trace_path;
  // --trace-dir: where every rank's flight recorder dumps (empty:
  // $FLATPARAM_TRACE_DIR, else nowhere); sim, mpi and c10d.
  std::string trace_dir;
  // sim only: hash every payload when sent and when delivered, so that a
  // flip fault fails the collective with DataLoss; without, flipped bits
  // reach the outputs and the checks must catch them.
  bool checksum = true;
  // Run the conformance suite; its large cases have this many elements
  // (0: none).
  bool conformance = true;
  int64_t large_elements = conformance::kDefaultLargeElements;
  // The bandwidth sweep: sizes min_bytes, min_bytes * step_factor, ... up
  // to max_bytes, in `dtype`. iterations/warmup: 0 and -1 pick the
  // backend's defaults (sim: 1 and 0, as virtual time does not vary; mpi
  // and nccl: 10 and 2).
  bool sweep = true;
  DType dtype = DType::kFloat32;
  int64_t min_bytes = 1 << 10;
  int64_t max_bytes = 16 << 20;
  int64_t step_factor = 4;
  int64_t iterations = 0;
  int64_t warmup = -1;
  // --progress: rank 0 prints "fsdp collectives: sweep row K of N: OP,
  // B bytes" to stderr as each row of the sweep starts, so that a long
  // sweep shows where it is (and a hang, which size it hung at).
  bool progress = false;
  // --timeout: the CollectiveOptions::timeout of every collective the
  // command issues (the conformance cases, the sweep's barriers and
  // collectives, the gathers of the ranks' summaries) and, under mpirun,
  // of creating the MPI world and the NCCL communicator. A rank that waits
  // longer for its peers fails with DeadlineExceeded naming the rank and
  // the op. The default is the conformance suite's own case timeout.
  absl::Duration timeout = conformance::kCaseTimeout;
};

// InvalidArgument naming the flag for options that make no sense (a
// backend other than sim, mpi or nccl; a fault or trace without sim; sizes
// out of order; a timeout that is not positive and finite; ...). Resolves
// the iteration defaults.
absl::StatusOr<CollectivesOptions> ValidateCollectivesOptions(
    CollectivesOptions options);

// One row of the sweep.
struct SweepRow {
  conformance::CollectiveKind kind = conformance::CollectiveKind::kAllGather;
  int64_t count = 0;    // elements per rank (the Communicator's count)
  int64_t bytes = 0;    // nccl-tests' size
  absl::Duration time;  // per collective, the slowest rank's
  conformance::Bandwidth bandwidth;
  int64_t wrong = 0;  // output elements that differed, over all ranks
};

// What one run found, the same on every rank.
struct CollectivesReport {
  std::string backend;
  int world_size = 0;
  // Conformance: cases run on each rank, failures over all ranks, and the
  // first few failure messages.
  int64_t cases = 0;
  int64_t failed = 0;
  std::vector<std::string> failures;
  std::vector<SweepRow> rows;
};

// A rank's clock: virtual time on the simulator, wall time elsewhere.
using Clock = std::function<absl::Duration()>;

// The whole command on one rank of `comm` (every rank calls it alike),
// with buffers from `memory`. Returns the report, or the first collective
// error (which names the rank and the op).
absl::StatusOr<CollectivesReport> RunCollectivesOnRank(
    Communicator& comm, conformance::DeviceMemory& memory,
    const CollectivesOptions& options, const Clock& clock);

// The table: a header naming the backend, world, seed and clock, the
// conformance summary and failures, one row per size, a verdict.
void PrintCollectivesReport(const CollectivesReport& report,
                            const CollectivesOptions& options,
                            std::ostream& out);

// OK when every case passed and no element was wrong; else Internal saying
// how many failed.
absl::Status CollectivesVerdict(const CollectivesReport& report);

// --backend=sim: runs a SimWorld of options.world_size ranks (with
// checksums unless options.checksum is false), prints the report to `out`,
// writes
// the trace if asked (also when a rank failed). Errors: the lowest failing
// rank's, naming it and the op; a fault's error names the faulty rank.
absl::Status RunCollectivesSim(const CollectivesOptions& options,
                               std::ostream& out);

// --backend=mpi or nccl, on this process's rank of an MPI job (mpirun):
// initialises and finalises MPI; for nccl, creates an NCCL communicator on
// the GPU numbered by the node-local rank, bootstrapped over MPI. Rank 0
// prints to `out`. Unimplemented in a build without OpenMPI.
absl::Status RunCollectivesMpi(const CollectivesOptions& options,
                               std::ostream& out);

// --backend=c10d, as one of torchrun's workers: the world from torchrun's
// environment (C10dCommunicator::FromEnvironment), host buffers. Rank 0
// prints; every rank prints its own error. In `fsdp`, which does not link
// LibTorch, this runs the command in fsdp_c10d instead
// (c10d_commands_exec.cc), which does.
absl::Status RunCollectivesC10d(const CollectivesOptions& options,
                                std::ostream& out);

// "mpi" when the process was started by mpirun (Open MPI's or PMI's
// environment variables are set), "c10d" when torchrun started it (its
// agent's TORCHELASTIC_* variables are set), else "sim".
std::string DefaultCollectivesBackend();

}  // namespace tools
}  // namespace flatparam

#endif  // TOOLS_COLLECTIVES_H_
