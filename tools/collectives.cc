#include "tools/collectives.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "comm/conformance/case_values.h"
#include "comm/conformance/collective_cases.h"
#include "flatparam/base/json_limits.h"
#include "flatparam/base/status_macros.h"
#include "nlohmann/json.hpp"
#include "sim/fault.h"
#include "sim/sim.h"
#include "tools/collective_timeout.h"

namespace flatparam {
namespace tools {
namespace {

using conformance::CollectiveCase;
using conformance::CollectiveKind;
using conformance::DeviceBuffer;
using conformance::DeviceMemory;
using conformance::HostBuffer;

// Failure messages a report keeps, over all ranks.
constexpr int kReportedFailures = 10;

constexpr CollectiveKind kSweepKinds[] = {
    CollectiveKind::kAllGather,
    CollectiveKind::kReduceScatter,
    CollectiveKind::kAllReduce,
};

// Adds `context` in front of an error's message, keeping its code.
absl::Status Annotate(const absl::Status& status, absl::string_view context) {
  if (status.ok()) return status;
  return absl::Status(status.code(),
                      absl::StrCat(context, ": ", status.message()));
}

// Options of type T (CollectiveOptions or a subclass) with `timeout`.
template <typename T = CollectiveOptions>
T Timed(absl::Duration timeout) {
  T options;
  options.timeout = timeout;
  return options;
}

// Every rank's `mine`, gathered through `comm`: one JSON document per rank.
absl::StatusOr<std::vector<nlohmann::json>> GatherJson(
    Communicator& comm, const nlohmann::json& mine, absl::Duration timeout) {
  FLATPARAM_ASSIGN_OR_RETURN(std::vector<std::string> all,
                             comm.AllGatherBytes(mine.dump(), Timed(timeout)));
  std::vector<nlohmann::json> out;
  for (size_t r = 0; r < all.size(); ++r) {
    JsonParseOptions parse;
    parse.code = absl::StatusCode::kInternal;
    FLATPARAM_ASSIGN_OR_RETURN(
        nlohmann::json j,
        ParseJson(all[r], absl::StrCat("rank ", r, "'s summary"), parse));
    out.push_back(std::move(j));
  }
  return out;
}

// The conformance suite, merged over the ranks.
absl::Status RunConformance(Communicator& comm, DeviceMemory& memory,
                            const CollectivesOptions& options,
                            CollectivesReport& report) {
  conformance::SuiteOptions suite;
  suite.large_elements = options.large_elements;
  // NCCL reduces in its own order: only cases whose bits cannot show it.
  suite.exact_only = options.backend == "nccl";
  suite.max_reported_failures = kReportedFailures;
  suite.timeout = options.timeout;
  const conformance::SuiteReport mine =
      conformance::RunSuite(comm, memory, suite);
  // A failed collective may have left the group unusable: stop here.
  if (!mine.stopped.ok()) return mine.ToStatus();
  FLATPARAM_ASSIGN_OR_RETURN(std::vector<nlohmann::json> all,
                             GatherJson(comm,
                                        {{"cases", mine.cases},
                                         {"failed", mine.failed},
                                         {"failures", mine.failures}},
                                        options.timeout));
  report.cases = mine.cases;
  for (const nlohmann::json& rank : all) {
    report.failed += rank.at("failed").get<int64_t>();
    for (const auto& failure : rank.at("failures")) {
      if (static_cast<int>(report.failures.size()) < kReportedFailures) {
        report.failures.push_back(failure.get<std::string>());
      }
    }
  }
  return absl::OkStatus();
}

absl::Status Issue(Communicator& comm, CollectiveKind kind,
                   ConstBufferRef input, BufferRef output,
                   absl::Duration timeout) {
  switch (kind) {
    case CollectiveKind::kAllGather:
      return comm.AllGather(input, output, Timed(timeout))->Wait();
    case CollectiveKind::kReduceScatter:
      return comm.ReduceScatter(input, output, Timed<ReduceOptions>(timeout))
          ->Wait();
    case CollectiveKind::kAllReduce:
      return comm.AllReduce(input, output, Timed<ReduceOptions>(timeout))
          ->Wait();
    case CollectiveKind::kBroadcast:
      return comm.Broadcast(output, Timed<BroadcastOptions>(timeout))->Wait();
  }
  return absl::InternalError("unknown collective");
}

// One size of the sweep: `iterations` timed collectives after `warmup`
// untimed ones, then a check of the output (kExact values, whose sums are
// exact in any order), gathered over the ranks.
absl::StatusOr<SweepRow> SweepOne(Communicator& comm, DeviceMemory& memory,
                                  CollectiveKind kind, int64_t bytes,
                                  const CollectivesOptions& options,
                                  const Clock& clock) {
  const int n = comm.size();
  const int me = comm.rank();
  CollectiveCase c;
  c.kind = kind;
  c.dtype = options.dtype;
  c.values = conformance::Values::kExact;
  c.count = conformance::CountForBytes(kind, bytes, n, options.dtype);
  SweepRow row;
  row.kind = kind;
  row.count = c.count;
  row.bytes = conformance::CollectiveBytes(kind, c.count, n, options.dtype);
  const std::string context =
      absl::StrFormat("rank %d of %d: sweep: %s of %d bytes", me, n,
                      conformance::CollectiveKindName(kind), row.bytes);

  absl::StatusOr<DeviceBuffer> input =
      DeviceBuffer::Allocate(memory, c.dtype, c.input_count(n));
  absl::StatusOr<DeviceBuffer> output =
      DeviceBuffer::Allocate(memory, c.dtype, c.output_count(n));
  FLATPARAM_RETURN_IF_ERROR(Annotate(input.status(), context));
  FLATPARAM_RETURN_IF_ERROR(Annotate(output.status(), context));
  {
    HostBuffer host(c.dtype, c.input_count(n));
    conformance::FillInput(c, me, 0, host.ref());
    FLATPARAM_RETURN_IF_ERROR(Annotate(input->Upload(host), context));
    FLATPARAM_RETURN_IF_ERROR(Annotate(output->Fill(0), context));
  }
  FLATPARAM_RETURN_IF_ERROR(
      Annotate(comm.Barrier(Timed(options.timeout)), context));
  for (int64_t i = 0; i < options.warmup; ++i) {
    FLATPARAM_RETURN_IF_ERROR(Annotate(
        Issue(comm, kind, input->ref(), output->ref(), options.timeout),
        context));
  }
  const absl::Duration start = clock();
  for (int64_t i = 0; i < options.iterations; ++i) {
    FLATPARAM_RETURN_IF_ERROR(Annotate(
        Issue(comm, kind, input->ref(), output->ref(), options.timeout),
        context));
  }
  const absl::Duration mine = (clock() - start) / options.iterations;

  const HostBuffer want = conformance::ExpectedOutput(c, n, me);
  std::vector<char> storage;
  absl::StatusOr<const void*> got =
      conformance::ReadBack(memory, output->ref(), storage);
  FLATPARAM_RETURN_IF_ERROR(Annotate(got.status(), context));
  int64_t first = -1;
  const int64_t wrong = conformance::CountMismatches(
      *got, want.data(), want.count(), c.dtype, &first);

  absl::StatusOr<std::vector<nlohmann::json>> all = GatherJson(
      comm, {{"time_ns", absl::ToInt64Nanoseconds(mine)}, {"wrong", wrong}},
      options.timeout);
  FLATPARAM_RETURN_IF_ERROR(Annotate(all.status(), context));
  for (const nlohmann::json& rank : *all) {
    row.time = std::max(row.time,
                        absl::Nanoseconds(rank.at("time_ns").get<int64_t>()));
    row.wrong += rank.at("wrong").get<int64_t>();
  }
  row.bandwidth = conformance::ComputeBandwidth(kind, row.bytes, n, row.time);
  return row;
}

std::string GBps(double bytes_per_second) {
  return absl::StrFormat("%.2f", bytes_per_second / 1e9);
}

}  // namespace

absl::StatusOr<CollectivesOptions> ValidateCollectivesOptions(
    CollectivesOptions o) {
  if (o.backend != "sim" && o.backend != "mpi" && o.backend != "nccl" &&
      o.backend != "c10d") {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--backend=%s: expected sim, mpi, nccl or c10d", o.backend));
  }
  const bool sim = o.backend == "sim";
  if (!sim && !o.faults.empty()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--fault=%s needs --backend=sim (faults are the simulator's); got "
        "--backend=%s",
        o.faults, o.backend));
  }
  if (!sim && !o.trace_path.empty()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--trace=%s needs --backend=sim (only the simulator has a "
        "deterministic clock to trace); got --backend=%s",
        o.trace_path, o.backend));
  }
  if (o.world_size < 1 || o.world_size > 65536) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--world-size=%d: expected 1 to 65536 ranks", o.world_size));
  }
  if (!IsFloatingPoint(o.dtype)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--dtype=%s: collectives take float32, float64, float16 or bfloat16",
        DTypeName(o.dtype)));
  }
  if (o.min_bytes < 1 || o.max_bytes < o.min_bytes) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--min-bytes=%d --max-bytes=%d: expected 1 <= min-bytes <= max-bytes",
        o.min_bytes, o.max_bytes));
  }
  if (o.step_factor < 2) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--step-factor=%d: expected at least 2", o.step_factor));
  }
  if (o.large_elements < 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--large-elements=%d: expected 0 or more", o.large_elements));
  }
  FLATPARAM_RETURN_IF_ERROR(ValidateCollectiveTimeout(o.timeout));
  if (o.iterations == 0) o.iterations = sim ? 1 : 10;
  if (o.warmup == -1) o.warmup = sim ? 0 : 2;
  if (o.iterations < 1 || o.warmup < 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--iterations=%d --warmup=%d: expected at least 1 iteration and no "
        "negative warm-up",
        o.iterations, o.warmup));
  }
  return o;
}

absl::StatusOr<CollectivesReport> RunCollectivesOnRank(
    Communicator& comm, DeviceMemory& memory, const CollectivesOptions& options,
    const Clock& clock) {
  CollectivesReport report;
  report.backend = std::string(comm.backend());
  report.world_size = comm.size();
  if (options.conformance) {
    FLATPARAM_RETURN_IF_ERROR(RunConformance(comm, memory, options, report));
  }
  if (options.sweep) {
    std::vector<std::pair<CollectiveKind, int64_t>> rows;
    for (CollectiveKind kind : kSweepKinds) {
      for (int64_t bytes = options.min_bytes; bytes <= options.max_bytes;
           bytes *= options.step_factor) {
        rows.emplace_back(kind, bytes);
        if (bytes > options.max_bytes / options.step_factor) break;
      }
    }
    for (size_t k = 0; k < rows.size(); ++k) {
      const auto [kind, bytes] = rows[k];
      if (options.progress && comm.rank() == 0) {
        // One write per line: under mpirun, lines of the ranks' streams
        // interleave, never their characters.
        const std::string line = absl::StrFormat(
            "fsdp collectives: sweep row %d of %d: %s, %d bytes\n", k + 1,
            rows.size(), conformance::CollectiveKindName(kind), bytes);
        std::fwrite(line.data(), 1, line.size(), stderr);
        std::fflush(stderr);
      }
      FLATPARAM_ASSIGN_OR_RETURN(
          SweepRow row, SweepOne(comm, memory, kind, bytes, options, clock));
      report.rows.push_back(row);
    }
  }
  return report;
}

void PrintCollectivesReport(const CollectivesReport& report,
                            const CollectivesOptions& options,
                            std::ostream& out) {
  const bool sim = options.backend == "sim";
  out << absl::StrFormat("# fsdp collectives: backend %s, %d ranks",
                         report.backend, report.world_size);
  if (sim) {
    out << absl::StrFormat(", seed %d, faults %s", options.seed,
                           options.faults.empty() ? "none" : options.faults);
  }
  out << "\n";
  if (options.conformance) {
    out << absl::StrFormat(
        "# conformance: %d cases on each of %d ranks%s: %s\n", report.cases,
        report.world_size,
        options.backend == "nccl" ? " (order-independent cases only)" : "",
        report.failed == 0 ? std::string("all correct")
                           : absl::StrFormat("%d FAILED", report.failed));
    for (const std::string& failure : report.failures) {
      out << "#   " << failure << "\n";
    }
  } else {
    out << "# conformance: not run (--noconformance)\n";
  }
  if (!options.sweep) return;
  if (sim) {
    const CostModel cost;
    out << absl::StrFormat(
        "# time: virtual, from the simulator's cost model (%s + bytes x bus "
        "factor / %s GB/s per collective); deterministic\n",
        absl::FormatDuration(cost.latency), GBps(cost.bytes_per_second));
  } else {
    out << absl::StrFormat(
        "# time: wall clock of the slowest rank, mean of %d iterations after "
        "%d warm-up\n",
        options.iterations, options.warmup);
  }
  out << absl::StrFormat(
      "# %s, busbw = algbw x (n-1)/n for all_gather and reduce_scatter, x "
      "2(n-1)/n for all_reduce (nccl-tests)\n#\n",
      DTypeName(options.dtype));
  out << absl::StrFormat("# %-14s %12s %10s %12s %12s %12s %7s  %s\n", "op",
                         "bytes", "count", sim ? "vtime(us)" : "time(us)",
                         "algbw(GB/s)", "busbw(GB/s)", "#wrong", "check");
  for (const SweepRow& row : report.rows) {
    out << absl::StrFormat("  %-14s %12d %10d %12.2f %12s %12s %7d  %s\n",
                           conformance::CollectiveKindName(row.kind), row.bytes,
                           row.count, absl::ToDoubleMicroseconds(row.time),
                           GBps(row.bandwidth.algbw), GBps(row.bandwidth.busbw),
                           row.wrong, row.wrong == 0 ? "correct" : "WRONG");
  }
  const absl::Status verdict = CollectivesVerdict(report);
  out << "# " << (verdict.ok() ? "all correct" : verdict.message()) << "\n";
}

absl::Status CollectivesVerdict(const CollectivesReport& report) {
  int64_t wrong = 0;
  int64_t wrong_rows = 0;
  for (const SweepRow& row : report.rows) {
    wrong += row.wrong;
    wrong_rows += row.wrong > 0;
  }
  if (report.failed == 0 && wrong == 0) return absl::OkStatus();
  return absl::InternalError(absl::StrFormat(
      "%d conformance case(s) failed and %d sweep row(s) had %d wrong "
      "element(s) on backend %s with %d ranks",
      report.failed, wrong_rows, wrong, report.backend, report.world_size));
}

absl::Status RunCollectivesSim(const CollectivesOptions& options,
                               std::ostream& out) {
  FLATPARAM_ASSIGN_OR_RETURN(std::vector<FaultSpec> faults,
                             ParseFaultSpecs(options.faults));
  SimOptions sim;
  sim.world_size = static_cast<int>(options.world_size);
  sim.seed = options.seed;
  sim.faults = std::move(faults);
  sim.checksum = options.checksum;
  if (!options.trace_dir.empty()) {
    sim.flight_recorder.trace_dir = options.trace_dir;
  }
  FLATPARAM_ASSIGN_OR_RETURN(std::unique_ptr<SimWorld> world,
                             SimWorld::Create(sim));
  std::vector<CollectivesReport> reports(sim.world_size);
  const absl::Status status =
      world->Run([&](SimCommunicator& comm) -> absl::Status {
        const Clock clock = [&comm] { return comm.Now(); };
        FLATPARAM_ASSIGN_OR_RETURN(
            reports[comm.world_rank()],
            RunCollectivesOnRank(comm, conformance::HostMemory(), options,
                                 clock));
        return absl::OkStatus();
      });
  // The trace shows what happened, also when a rank failed.
  if (!options.trace_path.empty()) {
    FLATPARAM_RETURN_IF_ERROR(world->WriteChromeTrace(options.trace_path));
  }
  FLATPARAM_RETURN_IF_ERROR(status);
  PrintCollectivesReport(reports[0], options, out);
  return CollectivesVerdict(reports[0]);
}

std::string DefaultCollectivesBackend() {
  for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"}) {
    if (std::getenv(var) != nullptr) return "mpi";
  }
  // torchrun's agent sets these for its workers.
  for (const char* var :
       {"TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT"}) {
    if (std::getenv(var) != nullptr) return "c10d";
  }
  return "sim";
}

}  // namespace tools
}  // namespace flatparam
