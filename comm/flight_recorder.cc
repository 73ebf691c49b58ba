#include "comm/flight_recorder.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "flatparam/base/status_macros.h"
#include "nlohmann/json.hpp"

namespace flatparam {

absl::string_view CollectivePhaseName(CollectivePhase phase) {
  switch (phase) {
    case CollectivePhase::kNone:
      return "";
    case CollectivePhase::kForwardUnshard:
      return "forward unshard";
    case CollectivePhase::kForwardPrefetch:
      return "forward prefetch";
    case CollectivePhase::kRecomputeUnshard:
      return "recompute unshard";
    case CollectivePhase::kPostForward:
      return "post-forward";
    case CollectivePhase::kPreBackwardUnshard:
      return "pre-backward unshard";
    case CollectivePhase::kBackwardPrefetch:
      return "backward prefetch";
    case CollectivePhase::kPostBackwardReduce:
      return "post-backward reduce";
    case CollectivePhase::kFinalizeBackward:
      return "finalize backward";
    case CollectivePhase::kGradNorm:
      return "gradient norm";
    case CollectivePhase::kSummon:
      return "summon full params";
    case CollectivePhase::kOptimStateGather:
      return "optimizer-state gather";
    case CollectivePhase::kOptimStateScatter:
      return "optimizer-state scatter";
    case CollectivePhase::kCheckpoint:
      return "checkpoint";
    case CollectivePhase::kInit:
      return "init";
  }
  return "unknown";
}

absl::string_view FlightStateName(FlightState state) {
  switch (state) {
    case FlightState::kEnqueued:
      return "enqueued";
    case FlightState::kStarted:
      return "started";
    case FlightState::kCompleted:
      return "completed";
    case FlightState::kFailed:
      return "failed";
  }
  return "unknown";
}

std::string DescribeContext(const CollectiveContext& context) {
  const absl::string_view phase = CollectivePhaseName(context.phase);
  if (context.unit.empty()) return std::string(phase);
  if (phase.empty()) return absl::StrCat("unit ", context.unit);
  return absl::StrCat("unit ", context.unit, ", ", phase);
}

std::string SplitGroupId(absl::string_view parent, int64_t seq, int color) {
  return absl::StrFormat("%s/split%d:%d", parent, seq, color);
}

FlightRecorderOptions FlightRecorderOptionsFromEnv() {
  FlightRecorderOptions options;
  if (const char* dir = std::getenv("FLATPARAM_TRACE_DIR")) {
    options.trace_dir = dir;
  }
  if (const char* n = std::getenv("FLATPARAM_FLIGHT_RECORDER_ENTRIES")) {
    int entries = 0;
    if (absl::SimpleAtoi(n, &entries) && entries >= 0) {
      options.capacity = entries;
    } else {
      std::fprintf(stderr,
                   "flatparam warning: FLATPARAM_FLIGHT_RECORDER_ENTRIES=%s "
                   "is not a count; keeping %d entries\n",
                   n, options.capacity);
    }
  }
  return options;
}

namespace {

// The live recorders, for DumpAllFlightRecorders. Leaked: recorders may be
// destroyed during static destruction.
struct Registry {
  std::mutex mu;
  std::vector<FlightRecorder*> recorders;
};

Registry& GetRegistry() {
  static Registry* registry = new Registry;
  return *registry;
}

int64_t NowNs() { return absl::GetCurrentTimeNanos(); }

std::string HostName() {
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) != 0) return "";
  return name;
}

// mkdir -p.
absl::Status MakeDirs(const std::string& dir) {
  std::string path;
  for (size_t i = 0; i <= dir.size(); ++i) {
    if (i < dir.size() && dir[i] != '/') continue;
    path = dir.substr(0, i);
    if (path.empty()) continue;
    if (mkdir(path.c_str(), 0777) != 0 && errno != EEXIST) {
      return absl::UnavailableError(absl::StrFormat(
          "flight recorder: cannot create %s: %s", path, std::strerror(errno)));
    }
  }
  return absl::OkStatus();
}

}  // namespace

std::shared_ptr<FlightRecorder> FlightRecorder::Create(
    int rank, int world_size, std::string backend,
    const FlightRecorderOptions& options) {
  std::shared_ptr<FlightRecorder> recorder(
      new FlightRecorder(rank, world_size, std::move(backend), options));
  Registry& registry = GetRegistry();
  {
    std::lock_guard<std::mutex> lock(registry.mu);
    registry.recorders.push_back(recorder.get());
  }
  if (!options.trace_dir.empty()) {
    absl::Status installed = InstallFlightRecorderSignal();
    if (!installed.ok()) {
      std::fprintf(stderr, "flatparam warning: %s\n",
                   std::string(installed.message()).c_str());
    }
  }
  return recorder;
}

FlightRecorder::FlightRecorder(int rank, int world_size, std::string backend,
                               const FlightRecorderOptions& options)
    : rank_(rank),
      world_size_(world_size),
      backend_(std::move(backend)),
      options_(options),
      capacity_(static_cast<uint64_t>(std::max(0, options.capacity))) {}

FlightRecorder::~FlightRecorder() {
  Registry& registry = GetRegistry();
  std::lock_guard<std::mutex> lock(registry.mu);
  auto& v = registry.recorders;
  v.erase(std::remove(v.begin(), v.end(), this), v.end());
}

uint64_t FlightRecorder::Enqueue(std::shared_ptr<const FlightGroup> group,
                                 int64_t seq, CollectiveOp op, DType dtype,
                                 int64_t count, int64_t bytes) {
  if (capacity_ == 0) return 0;
  const int64_t now = NowNs();
  const bool has_dtype =
      op == CollectiveOp::kAllGather || op == CollectiveOp::kReduceScatter ||
      op == CollectiveOp::kAllReduce || op == CollectiveOp::kBroadcast;
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t id = next_id_++;
  // The ring grows to its capacity as collectives come (a simulated world
  // of thousands of ranks with few collectives each stays small).
  if (ring_.size() < capacity_) ring_.emplace_back();
  FlightEntry& e = ring_[(id - 1) % capacity_];
  e.id = id;
  e.group = std::move(group);
  e.seq = seq;
  e.op = op;
  e.has_dtype = has_dtype;
  e.dtype = dtype;
  e.count = count;
  e.bytes = bytes;
  // Assigning (not constructing) reuses the slot's string capacity.
  e.context.unit = context_.unit;
  e.context.handle = context_.handle;
  e.context.phase = context_.phase;
  e.state = FlightState::kEnqueued;
  e.enqueued_ns = now;
  e.started_ns = 0;
  e.finished_ns = 0;
  e.error.clear();
  return id;
}

void FlightRecorder::Started(uint64_t id) {
  if (id == 0) return;
  const int64_t now = NowNs();
  std::lock_guard<std::mutex> lock(mu_);
  FlightEntry& e = ring_[(id - 1) % capacity_];
  if (e.id != id || e.state != FlightState::kEnqueued) return;
  e.state = FlightState::kStarted;
  e.started_ns = now;
}

void FlightRecorder::Finished(uint64_t id, const absl::Status& status) {
  if (id != 0) {
    const int64_t now = NowNs();
    std::lock_guard<std::mutex> lock(mu_);
    FlightEntry& e = ring_[(id - 1) % capacity_];
    if (e.id == id && (e.state == FlightState::kEnqueued ||
                       e.state == FlightState::kStarted)) {
      if (e.started_ns == 0 && status.ok()) e.started_ns = e.enqueued_ns;
      e.state = status.ok() ? FlightState::kCompleted : FlightState::kFailed;
      e.finished_ns = now;
      if (!status.ok()) e.error = std::string(status.message());
    }
    if (!status.ok() && first_failure_.empty()) {
      first_failure_ = absl::StrCat(absl::StatusCodeToString(status.code()),
                                    ": ", status.message());
    }
  }
  if (!status.ok()) DumpOnFailure(status);
}

void FlightRecorder::DumpOnFailure(const absl::Status& status) {
  if (options_.trace_dir.empty() || !options_.dump_on_failure) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (dumped_on_failure_) return;
    dumped_on_failure_ = true;
  }
  absl::StatusOr<std::string> path = Dump(absl::StrCat(
      absl::StatusCodeToString(status.code()), ": ", status.message()));
  if (path.ok()) {
    std::fprintf(stderr, "flatparam: rank %d: flight record written to %s\n",
                 rank_, path->c_str());
  } else {
    std::fprintf(stderr, "flatparam: rank %d: %s\n", rank_,
                 std::string(path.status().message()).c_str());
  }
}

void FlightRecorder::SetContext(CollectiveContext context) {
  std::lock_guard<std::mutex> lock(mu_);
  context_ = std::move(context);
}

CollectiveContext FlightRecorder::context() const {
  std::lock_guard<std::mutex> lock(mu_);
  return context_;
}

std::vector<FlightEntry> FlightRecorder::Snapshot() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<FlightEntry> out;
  if (capacity_ == 0) return out;
  const uint64_t recorded = next_id_ - 1;
  const uint64_t kept = std::min<uint64_t>(recorded, capacity_);
  out.reserve(kept);
  for (uint64_t id = recorded - kept + 1; id <= recorded; ++id) {
    out.push_back(ring_[(id - 1) % capacity_]);
  }
  return out;
}

uint64_t FlightRecorder::recorded() const {
  std::lock_guard<std::mutex> lock(mu_);
  return next_id_ - 1;
}

std::string FlightRecorder::ToJson(absl::string_view reason) const {
  const std::vector<FlightEntry> entries = Snapshot();
  nlohmann::json j;
  j["format"] = "flatparam.flight";
  j["version"] = 1;
  j["rank"] = rank_;
  j["world_size"] = world_size_;
  j["backend"] = backend_;
  j["pid"] = static_cast<int64_t>(getpid());
  j["host"] = HostName();
  j["reason"] = std::string(reason);
  j["dumped_at_ns"] = NowNs();
  j["capacity"] = options_.capacity;
  j["recorded"] = recorded();
  {
    std::lock_guard<std::mutex> lock(mu_);
    j["first_failure"] = first_failure_;
  }
  std::map<std::string, const FlightGroup*> groups;
  nlohmann::json list = nlohmann::json::array();
  for (const FlightEntry& e : entries) {
    const std::string group = e.group ? e.group->id : std::string();
    if (e.group) groups.emplace(group, e.group.get());
    nlohmann::json x;
    x["id"] = e.id;
    x["group"] = group;
    x["seq"] = e.seq;
    x["op"] = std::string(CollectiveOpName(e.op));
    x["dtype"] = e.has_dtype ? std::string(DTypeName(e.dtype)) : "";
    x["count"] = e.count;
    x["bytes"] = e.bytes;
    x["unit"] = e.context.unit;
    x["handle"] = e.context.handle;
    x["phase"] = std::string(CollectivePhaseName(e.context.phase));
    x["state"] = std::string(FlightStateName(e.state));
    x["enqueued_ns"] = e.enqueued_ns;
    x["started_ns"] = e.started_ns;
    x["finished_ns"] = e.finished_ns;
    x["error"] = e.error;
    list.push_back(std::move(x));
  }
  nlohmann::json g = nlohmann::json::array();
  for (const auto& [id, group] : groups) {
    g.push_back({{"id", id}, {"ranks", group->ranks}});
  }
  j["groups"] = std::move(g);
  j["entries"] = std::move(list);
  // Invalid UTF-8 in an error message must not lose the dump.
  return j.dump(1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
}

namespace {

// Writes `text` to a new file beside `path` whose name no other file has
// (mkstemp), and returns that name.
absl::StatusOr<std::string> WriteTemp(const std::string& path,
                                      const std::string& text) {
  std::string tmp = path + ".tmp.XXXXXX";
  const int fd = mkstemp(tmp.data());
  if (fd < 0) {
    return absl::UnavailableError(absl::StrFormat(
        "flight recorder: cannot write %s: %s", tmp, std::strerror(errno)));
  }
  fchmod(fd, 0644);
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = errno;
      close(fd);
      unlink(tmp.c_str());
      return absl::UnavailableError(absl::StrFormat(
          "flight recorder: writing %s failed: %s", tmp, std::strerror(err)));
    }
    done += static_cast<size_t>(n);
  }
  if (close(fd) != 0) {
    const int err = errno;
    unlink(tmp.c_str());
    return absl::UnavailableError(absl::StrFormat(
        "flight recorder: writing %s failed: %s", tmp, std::strerror(err)));
  }
  return tmp;
}

}  // namespace

absl::Status FlightRecorder::DumpTo(const std::string& path,
                                    absl::string_view reason) const {
  FLATPARAM_ASSIGN_OR_RETURN(const std::string tmp,
                             WriteTemp(path, ToJson(reason)));
  if (rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    unlink(tmp.c_str());
    return absl::UnavailableError(absl::StrFormat(
        "flight recorder: cannot publish %s: %s", path, std::strerror(err)));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> FlightRecorder::Dump(absl::string_view reason) {
  if (options_.trace_dir.empty()) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "flight recorder of rank %d: no trace directory to dump into (set "
        "FLATPARAM_TRACE_DIR or the trace_dir option)",
        rank_));
  }
  std::lock_guard<std::mutex> lock(dump_mu_);
  if (!dump_path_.empty()) {
    FLATPARAM_RETURN_IF_ERROR(DumpTo(dump_path_, reason));
    return dump_path_;
  }
  FLATPARAM_RETURN_IF_ERROR(MakeDirs(options_.trace_dir));
  const std::string first =
      absl::StrFormat("%s/rank_%d.json", options_.trace_dir, rank_);
  FLATPARAM_ASSIGN_OR_RETURN(const std::string tmp,
                             WriteTemp(first, ToJson(reason)));
  // The first dump claims a name by linking the finished file to it, which
  // fails where any file has that name: another job's dump (or another
  // process of this rank in the same directory) is never replaced, and no
  // half-written or empty file is ever seen under a dump's name.
  const pid_t pid = getpid();
  for (int attempt = 0; attempt < 100; ++attempt) {
    const std::string candidate =
        attempt == 0 ? first
        : attempt == 1
            ? absl::StrFormat("%s/rank_%d.%d.json", options_.trace_dir, rank_,
                              pid)
            : absl::StrFormat("%s/rank_%d.%d.%d.json", options_.trace_dir,
                              rank_, pid, attempt - 1);
    if (link(tmp.c_str(), candidate.c_str()) == 0) {
      unlink(tmp.c_str());
      dump_path_ = candidate;
      return dump_path_;
    }
    if (errno != EEXIST) {
      const int err = errno;
      unlink(tmp.c_str());
      return absl::UnavailableError(
          absl::StrFormat("flight recorder: cannot publish %s: %s", candidate,
                          std::strerror(err)));
    }
  }
  unlink(tmp.c_str());
  return absl::AlreadyExistsError(absl::StrFormat(
      "flight recorder: %s and 99 other names for rank %d's dump exist "
      "already in %s",
      first, rank_, options_.trace_dir));
}

ScopedCollectiveContext::ScopedCollectiveContext(FlightRecorder* recorder,
                                                 CollectiveContext context)
    : recorder_(recorder) {
  if (recorder_ == nullptr) return;
  previous_ = recorder_->context();
  recorder_->SetContext(std::move(context));
}

ScopedCollectiveContext::~ScopedCollectiveContext() {
  if (recorder_ != nullptr) recorder_->SetContext(std::move(previous_));
}

namespace {

class RecordingWork final : public Work {
 public:
  RecordingWork(std::unique_ptr<Work> work,
                std::shared_ptr<FlightRecorder> recorder, uint64_t id)
      : work_(std::move(work)), recorder_(std::move(recorder)), id_(id) {}
  absl::Status Wait() override {
    absl::Status status = work_->Wait();
    recorder_->Finished(id_, status);
    return status;
  }
  absl::Status WaitStream(const DeviceStream& stream) override {
    return work_->WaitStream(stream);
  }

 private:
  std::unique_ptr<Work> work_;
  std::shared_ptr<FlightRecorder> recorder_;
  uint64_t id_;
};

}  // namespace

std::unique_ptr<Work> RecordedWork(std::unique_ptr<Work> work,
                                   std::shared_ptr<FlightRecorder> recorder,
                                   uint64_t id) {
  if (recorder == nullptr || id == 0) return work;
  return std::make_unique<RecordingWork>(std::move(work), std::move(recorder),
                                         id);
}

std::vector<std::string> DumpAllFlightRecorders(absl::string_view reason) {
  std::vector<std::string> paths;
  Registry& registry = GetRegistry();
  // Held while dumping, so that no recorder is destroyed meanwhile; a
  // recorder's own mutex is taken only to copy its ring.
  std::lock_guard<std::mutex> lock(registry.mu);
  for (FlightRecorder* recorder : registry.recorders) {
    if (recorder->options().trace_dir.empty()) continue;
    absl::StatusOr<std::string> path = recorder->Dump(reason);
    if (path.ok()) {
      paths.push_back(*path);
    } else {
      std::fprintf(stderr, "flatparam: %s\n",
                   std::string(path.status().message()).c_str());
    }
  }
  return paths;
}

namespace {

int signal_pipe[2] = {-1, -1};

// Async-signal-safe: the dumper thread does the rest.
void OnSignal(int signo) {
  const int saved = errno;
  const char byte = signo == SIGTERM ? 2 : 1;
  [[maybe_unused]] ssize_t n = write(signal_pipe[1], &byte, 1);
  errno = saved;
}

void DumperMain() {
  for (;;) {
    char byte = 0;
    const ssize_t n = read(signal_pipe[0], &byte, 1);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    const bool term = byte == 2;
    const std::vector<std::string> paths = DumpAllFlightRecorders(
        term ? "SIGTERM (the launcher is ending the job)" : "SIGUSR1");
    for (const std::string& path : paths) {
      std::fprintf(stderr, "flatparam: flight record written to %s (%s)\n",
                   path.c_str(), term ? "SIGTERM" : "SIGUSR1");
    }
    if (term) {
      // Then end as SIGTERM would have.
      signal(SIGTERM, SIG_DFL);
      kill(getpid(), SIGTERM);
    }
  }
}

// Installs OnSignal for `signo` if the program left it at its default.
absl::Status Take(int signo, const char* name) {
  struct sigaction old {};
  if (sigaction(signo, nullptr, &old) != 0) {
    return absl::InternalError(absl::StrFormat(
        "flight recorder: sigaction(%s): %s", name, std::strerror(errno)));
  }
  if ((old.sa_flags & SA_SIGINFO) != 0 || old.sa_handler != SIG_DFL) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "flight recorder: the program handles %s itself, so %s does not "
        "dump flight records (call DumpAllFlightRecorders from its "
        "handler's thread instead)",
        name, name));
  }
  struct sigaction action {};
  action.sa_handler = OnSignal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  if (sigaction(signo, &action, nullptr) != 0) {
    return absl::InternalError(absl::StrFormat(
        "flight recorder: sigaction(%s): %s", name, std::strerror(errno)));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status InstallFlightRecorderSignal() {
  static std::once_flag once;
  static absl::Status* result = new absl::Status;
  std::call_once(once, [] {
    if (pipe2(signal_pipe, O_CLOEXEC) != 0) {
      *result = absl::InternalError(
          absl::StrFormat("flight recorder: pipe: %s", std::strerror(errno)));
      return;
    }
    std::thread(DumperMain).detach();
    // SIGTERM is how launchers (mpirun, torchrun) end the other processes
    // of a job one of whose processes died: dumping then keeps their
    // records too.
    absl::Status usr1 = Take(SIGUSR1, "SIGUSR1");
    absl::Status term = Take(SIGTERM, "SIGTERM");
    *result = usr1.ok() ? term : usr1;
  });
  return *result;
}

}  // namespace flatparam
