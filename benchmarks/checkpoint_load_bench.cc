// What loading a sharded checkpoint costs each rank of a job: bytes read
// and wall time of the load path `fsdp train --load` runs
// (tools/train.cc RunTrainOnRank), next to a plain parallel read of the
// same bytes, on W MPI processes (issue 11 §1: each rank must read and
// verify only its share plus the metadata, about total / W, in at most
// 1.2x the time of the plain read). Also when the checkpoint was saved on
// another number of ranks and the load reshards it.
//
//   bazel build -c opt //benchmarks:checkpoint_load_bench
//   mpirun --allow-run-as-root --oversubscribe --bind-to none -np 4
//       bazel-bin/benchmarks/checkpoint_load_bench [--saved_world_size=8]
//   benchmarks/checkpoint_load_sweep.sh   # W = 1..8, one table
//
// The checkpoint: before anything is timed, rank 0 writes a full checkpoint
// of the model (InitCheckpoint: pseudo-random weights and AdamW state) and
// shards it FULL_SHARD for --saved_world_size=W0 ranks (default: the job's
// W; ShardCheckpoint) in a fresh directory under --dir (default $TMPDIR or
// /tmp; it must be a local disk for the cache control below to mean
// anything), removed at exit. The model: --model=PRESET (flatparam/
// presets.h, e.g. gpt2) or, by default, a synthetic float32 model of
// --total_mib MiB of parameters plus AdamW state (exp_avg, exp_avg_sq:
// three times the parameters): 8 layers of a [rows, 4096] weight and a
// 4099-element bias, and an embedding, so that shards cut parameters at
// odd places. The job's layout is the same model FULL_SHARD on W ranks.
//
// Each iteration, on every rank r (barrier before each timed part; the time
// reported is the slowest rank's):
//   load       the load path, through the shared CountingFileSystem
//              (flatparam/checkpoint/internal/counting_file_system.h) under
//              a wrapper that records every ReadAt's file, offset and
//              length and the time spent in it:
//                mode load (default; train.cc today):
//                  ShardedCheckpointReader::Open with metadata only
//                  (CheckpointOpenOptions::ranks = {}), ReadRankJson(0),
//                  then LoadRankState(reader, job layout, W, r): the rank's
//                  own file, every block verified as it is read, when
//                  W0 == W; otherwise resharded at load time from byte
//                  ranges of the old ranks' files. The run fails if the
//                  path taken is not the expected one. Not timed, because
//                  they are not checkpoint I/O: train.cc's verdict exchange
//                  (one small all-gather) and its conversion of the
//                  optimizer state to the trainer's form.
//                mode verify_then_read (the path before per-block
//                  checksums, for comparison; W0 == W only): the same Open
//                  and ReadRankJson(0), CheckFits, VerifyRank(r) (the rank
//                  file checksummed whole), then ReadRankState(reader, r).
//   baseline   plain pread(2) in --chunk_kib pieces, no parsing or hashing,
//              of exactly the bytes the load read: the byte ranges its
//              ReadAt calls covered (recorded in an untimed load of the
//              same mode), merged per file, each byte once, into fresh
//              memory of their size (the load's tensors are fresh memory
//              too, and faulting their pages in is part of any load).
// Page cache (--cache): "cold" drops the checkpoint's pages from the page
// cache (posix_fadvise(POSIX_FADV_DONTNEED) on every file, which needs no
// root and works because the files were fsynced) before each timed part;
// "warm" reads the needed ranges untimed first, so they are cached.
// resident_before reports the fraction of the needed ranges' pages that
// mincore(2) found cached just before the timed load (max over ranks), so
// the output says which it was. A virtual disk may still be cached by its
// host.
//
// Counters, per Google Benchmark row (use --benchmark_repetitions' median;
// the default is 5 repetitions of one iteration, aggregates only):
//   saved_world_size   W0
//   total_bytes        every file of the checkpoint directory
//   share_bytes        total_bytes / W
//   read_bytes         bytes the load read, max over ranks
//   read_over_share    read_bytes / share_bytes (goal: about 1)
//   needed_bytes       bytes the baseline read (distinct bytes the load
//                      read), max over ranks
//   read_over_needed   read_bytes / needed_bytes (1: nothing read twice)
//   baseline_s         the baseline's wall time, slowest rank
//   load_over_baseline the load's time / baseline_s (goal: <= 1.2)
//   io_s               time inside the file reads under the load (pread
//                      and copies into the reader's buffers), max over
//                      ranks; the rest of the load is checksums, parsing
//                      and the loader's own copies
//   load_cpu_s, baseline_cpu_s
//                      CPU time (user + system, of the thread doing the
//                      work: getrusage(RUSAGE_THREAD)) of the load and of
//                      the baseline, summed over ranks
//   cpu_load_over_baseline  load_cpu_s / baseline_cpu_s: the work the
//                      load adds, which time waiting for a core does not
//                      blur (with more ranks than cores, or other jobs on
//                      the machine, the wall times include that wait)
//   open_s             Open + ReadRankJson(0), max over ranks
//   resident_before    see above
// bytes_per_second is the job's: total_bytes per load time.
// After the run rank 0 prints one Markdown row per benchmark with the
// medians (benchmarks/checkpoint_load_sweep.sh collects them over W).
//
// Flags: --total_mib=N (1024), --model=PRESET, --mode=load|
// verify_then_read|both (load; "both" runs verify_then_read only when
// W0 == W), --cache=cold|warm|both (both), --saved_world_size=W0 (0: W),
// --reps=N (5), --chunk_kib=N (4096, the library's own chunk size),
// --dir=PATH. Google Benchmark's flags pass through
// (--benchmark_out=FILE.json ...).
#include <benchmark/benchmark.h>
#include <fcntl.h>
#include <mpi.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "benchmarks/mpi_bench_driver.h"
#include "comm/mpi/mpi_communicator.h"
#include "flatparam/base/dtype.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/checkpoint/checkpoint_dir.h"
#include "flatparam/checkpoint/convert.h"
#include "flatparam/checkpoint/file_system.h"
#include "flatparam/checkpoint/internal/counting_file_system.h"
#include "flatparam/checkpoint/training_state.h"
#include "flatparam/layout.h"
#include "flatparam/model_layout.h"
#include "flatparam/presets.h"

namespace flatparam {
namespace bench {
namespace {

using checkpoint::FileSystem;
using checkpoint::RandomAccessFile;
using checkpoint::internal_checkpoint::CountingFileSystem;

constexpr char kProgram[] = "checkpoint_load_bench";

void CheckOk(const absl::Status& status) {
  if (!status.ok()) Die(kProgram, status);
}

struct Flags {
  int64_t total_mib = 1024;
  std::string model;
  std::string mode = "load";
  std::string cache = "both";
  int64_t saved_world_size = 0;  // 0: the job's
  int64_t reps = 5;
  int64_t chunk_kib = 4096;
  std::string dir;
};

double Seconds(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
      .count();
}

// User + system CPU seconds of the calling thread so far.
double ThreadCpuSeconds() {
  struct rusage usage;
  if (getrusage(RUSAGE_THREAD, &usage) != 0) return 0;
  auto seconds = [](const timeval& t) { return t.tv_sec + 1e-6 * t.tv_usec; };
  return seconds(usage.ru_utime) + seconds(usage.ru_stime);
}

// ---------------------------------------------------------------------------
// Recording what the load path reads.

// A byte range of a file.
struct Range {
  std::string path;
  int64_t offset = 0;
  int64_t length = 0;
};

// Forwards to `base`; records the range of every ReadAt of the files it
// opened (while recording is on: the baseline replays them) and the time
// spent in them (always: the load's I/O share). Counting is the shared
// CountingFileSystem's job, underneath. Thread-safe.
class RecordingFileSystem : public checkpoint::ForwardingFileSystem {
 public:
  explicit RecordingFileSystem(FileSystem& base) : ForwardingFileSystem(base) {}

  // Clears the record and the time; records from now on iff `record`.
  void Reset(bool record) {
    absl::MutexLock lock(&mu_);
    record_ = record;
    ranges_.clear();
    io_s_ = 0;
  }
  std::vector<Range> ranges() const {
    absl::MutexLock lock(&mu_);
    return ranges_;
  }
  double io_seconds() const {
    absl::MutexLock lock(&mu_);
    return io_s_;
  }

  absl::StatusOr<std::unique_ptr<RandomAccessFile>> NewRandomAccessFile(
      const std::string& path) override {
    FLATPARAM_ASSIGN_OR_RETURN(std::unique_ptr<RandomAccessFile> file,
                               base().NewRandomAccessFile(path));
    return std::unique_ptr<RandomAccessFile>(
        new File(this, std::move(file), path));
  }

 private:
  class File : public RandomAccessFile {
   public:
    File(RecordingFileSystem* fs, std::unique_ptr<RandomAccessFile> base,
         std::string path)
        : fs_(fs), base_(std::move(base)), path_(std::move(path)) {}
    absl::Status ReadAt(uint64_t offset, absl::Span<char> out) const override {
      const auto start = std::chrono::steady_clock::now();
      absl::Status status = base_->ReadAt(offset, out);
      fs_->Add(path_, static_cast<int64_t>(offset),
               static_cast<int64_t>(out.size()), Seconds(start));
      return status;
    }
    absl::StatusOr<uint64_t> Size() const override { return base_->Size(); }
    const std::string& name() const override { return base_->name(); }

   private:
    RecordingFileSystem* fs_;
    std::unique_ptr<RandomAccessFile> base_;
    std::string path_;
  };

  void Add(const std::string& path, int64_t offset, int64_t length,
           double seconds) {
    absl::MutexLock lock(&mu_);
    io_s_ += seconds;
    if (record_) ranges_.push_back({path, offset, length});
  }

  mutable absl::Mutex mu_;
  bool record_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<Range> ranges_ ABSL_GUARDED_BY(mu_);
  double io_s_ ABSL_GUARDED_BY(mu_) = 0;
};

// `ranges` sorted by file and offset, overlapping and adjacent ones merged:
// the distinct bytes, each once, in the order a plain reader reads them.
std::vector<Range> Merge(std::vector<Range> ranges) {
  std::sort(ranges.begin(), ranges.end(), [](const Range& a, const Range& b) {
    return a.path != b.path ? a.path < b.path : a.offset < b.offset;
  });
  std::vector<Range> out;
  for (Range& r : ranges) {
    if (r.length <= 0) continue;
    if (!out.empty() && out.back().path == r.path &&
        r.offset <= out.back().offset + out.back().length) {
      out.back().length =
          std::max(out.back().offset + out.back().length, r.offset + r.length) -
          out.back().offset;
      continue;
    }
    out.push_back(std::move(r));
  }
  return out;
}

int64_t Bytes(const std::vector<Range>& ranges) {
  int64_t n = 0;
  for (const Range& r : ranges) n += r.length;
  return n;
}

// ---------------------------------------------------------------------------
// The checkpoint.

ModelSpec SyntheticModel(int64_t total_mib) {
  // Parameters are a third of the total (AdamW keeps two more copies).
  const int64_t layers = 8;
  const int64_t param_floats = total_mib * (int64_t{1} << 20) / 4 / 3;
  const int64_t rows =
      std::max<int64_t>(1, (param_floats / layers - 4099) / 4096);
  ModelSpec spec;
  spec.name = absl::StrFormat("checkpoint_load_bench_%dmib", total_mib);
  spec.params.push_back({"embed.weight", {1000, 128}, DType::kFloat32});
  for (int64_t l = 0; l < layers; ++l) {
    const std::string p = absl::StrFormat("layers.%d.", l);
    spec.params.push_back({p + "weight", {rows, 4096}, DType::kFloat32});
    spec.params.push_back({p + "bias", {4099}, DType::kFloat32});
    spec.wrap.push_back(absl::StrFormat("layers.%d", l));
  }
  return spec;
}

ModelSpec BenchModel(const Flags& flags) {
  if (flags.model.empty()) return SyntheticModel(flags.total_mib);
  absl::StatusOr<ModelSpec> preset = PresetModel(flags.model);
  CheckOk(preset.status());
  return *std::move(preset);
}

LayoutOptions FullShard(int64_t world_size) {
  LayoutOptions layout;
  layout.world_size = world_size;
  layout.strategy = ShardingStrategy::kFullShard;
  return layout;
}

std::string TempRoot(const std::string& dir) {
  std::string base = dir;
  for (const char* env : {"TMPDIR", "TEST_TMPDIR"}) {
    const char* v = std::getenv(env);
    if (base.empty() && v != nullptr && *v != '\0') base = v;
  }
  if (base.empty()) base = "/tmp";
  std::string tmpl = checkpoint::JoinPath(base, "checkpoint_load_bench.XXXXXX");
  if (mkdtemp(tmpl.data()) == nullptr) {
    Die(kProgram, absl::InternalError(absl::StrCat("mkdtemp ", tmpl, ": ",
                                                   std::strerror(errno))));
  }
  return tmpl;
}

// Rank 0 writes the sharded checkpoint for `world_size` ranks under `root`
// and returns its path.
std::string WriteCheckpoint(const ModelSpec& spec, const std::string& root,
                            int64_t world_size) {
  FileSystem& fs = checkpoint::PosixFileSystem();
  const std::string full = checkpoint::JoinPath(root, "full");
  const std::string sharded = checkpoint::JoinPath(root, "sharded");
  const auto start = std::chrono::steady_clock::now();
  checkpoint::InitOptions init;
  init.optimizer = checkpoint::InitOptimizer::kAdamW;
  CheckOk(checkpoint::InitCheckpoint(fs, spec, full, init));
  CheckOk(checkpoint::ShardCheckpoint(fs, full, spec, FullShard(world_size),
                                      world_size, sharded));
  // Only the sharded checkpoint is read; the full one would just compete
  // for the page cache.
  CheckOk(checkpoint::RemoveRecursively(fs, full));
  std::fprintf(stderr, "%s: wrote %s (%s, %d ranks) in %.1f s\n", kProgram,
               sharded.c_str(), spec.name.c_str(), static_cast<int>(world_size),
               Seconds(start));
  return sharded;
}

// ---------------------------------------------------------------------------
// Plain file access for the baseline and the cache control: no FileSystem,
// no parsing, no hashing.

int OpenOrDie(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    Die(kProgram, absl::InternalError(
                      absl::StrCat("open ", path, ": ", std::strerror(errno))));
  }
  return fd;
}

// Reads [offset, offset + length) of `fd` with pread, in pieces of at most
// `chunk` bytes, into `out` (the next piece at the next address, or every
// piece at `out` when `advance` is false).
void PreadRange(int fd, const std::string& path, int64_t offset, int64_t length,
                char* out, int64_t chunk, bool advance) {
  int64_t done = 0;
  while (done < length) {
    const int64_t want = std::min(chunk, length - done);
    const ssize_t n = ::pread(fd, advance ? out + done : out, want,
                              static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      Die(kProgram,
          absl::InternalError(absl::StrCat(
              "pread ", path, " at ", offset + done, ": ",
              n == 0 ? "unexpected end of file" : std::strerror(errno))));
    }
    done += n;
  }
}

// Reads `ranges` (merged: each file's ranges together) into `out`, one
// after the other when `advance`, else each piece over the last.
void PlainRead(const std::vector<Range>& ranges, char* out, int64_t chunk,
               bool advance) {
  int fd = -1;
  const std::string* open_path = nullptr;
  int64_t at = 0;
  for (const Range& r : ranges) {
    if (open_path == nullptr || *open_path != r.path) {
      if (fd >= 0) ::close(fd);
      fd = OpenOrDie(r.path);
      open_path = &r.path;
    }
    PreadRange(fd, r.path, r.offset, r.length, advance ? out + at : out, chunk,
               advance);
    at += r.length;
  }
  if (fd >= 0) ::close(fd);
  benchmark::DoNotOptimize(out);
}

// The baseline: `ranges` into memory of their own, fresh (not zeroed, so
// its pages are faulted in by the read itself), as the load puts the bytes
// into freshly allocated tensors. Returns the bytes read.
int64_t PlainReadIntoMemory(const std::vector<Range>& ranges, int64_t chunk) {
  const int64_t bytes = Bytes(ranges);
  std::unique_ptr<char[]> memory(new char[std::max<int64_t>(bytes, 1)]);
  PlainRead(ranges, memory.get(), chunk, /*advance=*/true);
  return bytes;
}

void DropFromPageCache(const std::string& path) {
  const int fd = OpenOrDie(path);
  (void)::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
}

// Pages of `ranges` (merged) in the page cache, and their pages in all.
std::pair<int64_t, int64_t> ResidentPages(const std::vector<Range>& ranges) {
  const int64_t page = ::sysconf(_SC_PAGESIZE);
  int64_t resident = 0, pages = 0;
  for (const Range& r : ranges) {
    const int fd = OpenOrDie(r.path);
    const int64_t first = r.offset / page;
    const int64_t last = (r.offset + r.length + page - 1) / page;  // excl.
    const int64_t n = last - first;
    pages += n;
    void* map = ::mmap(nullptr, n * page, PROT_READ, MAP_SHARED, fd,
                       static_cast<off_t>(first * page));
    ::close(fd);
    if (map == MAP_FAILED) continue;
    std::vector<unsigned char> vec(n);
    if (::mincore(map, n * page, vec.data()) == 0) {
      for (unsigned char v : vec) resident += v & 1;
    }
    ::munmap(map, n * page);
  }
  return {resident, pages};
}

// ---------------------------------------------------------------------------
// One rank's view of the benchmark.

enum class Mode { kLoad, kVerifyThenRead };
enum class Cache { kCold, kWarm };

const char* ModeName(Mode m) {
  return m == Mode::kLoad ? "load" : "verify_then_read";
}
const char* CacheName(Cache c) { return c == Cache::kCold ? "cold" : "warm"; }

struct Rank {
  int rank = 0;
  int world = 1;
  int64_t saved_world = 1;  // W0
  std::string dir;
  std::optional<ModelLayout> layout;  // the job's: FULL_SHARD on W ranks
  std::vector<std::string> all_files;
  int64_t total_bytes = 0;
  int64_t metadata_bytes = 0;
  // What each mode's load reads (merged), from its untimed first load: the
  // warm-up's and the baseline's bytes.
  std::map<Mode, std::vector<Range>> needed;
  std::vector<char> buffer;  // the warm-up reads' piece
  CountingFileSystem counting{checkpoint::PosixFileSystem()};
  RecordingFileSystem fs{counting};
};

// Where the load's time went (this rank).
struct Splits {
  double open_s = 0;  // Open + ReadRankJson(0)
};

// The load path of tools/train.cc RunTrainOnRank (mode kLoad), or the one
// before per-block checksums (kVerifyThenRead).
absl::Status Load(Rank& rank, Mode mode, Splits* splits) {
  const auto start = std::chrono::steady_clock::now();
  checkpoint::CheckpointOpenOptions metadata_only;
  metadata_only.ranks.emplace();
  FLATPARAM_ASSIGN_OR_RETURN(checkpoint::ShardedCheckpointReader reader,
                             checkpoint::ShardedCheckpointReader::Open(
                                 rank.fs, rank.dir, metadata_only));
  // train.cc reads its resume point from rank 0's sidecar.
  FLATPARAM_RETURN_IF_ERROR(reader.ReadRankJson(0).status());
  splits->open_s = Seconds(start);
  checkpoint::RankState state;
  if (mode == Mode::kLoad) {
    const int64_t shard_rank = rank.rank % rank.layout->options().world_size;
    checkpoint::LoadPath path = checkpoint::LoadPath::kOwnRank;
    FLATPARAM_ASSIGN_OR_RETURN(
        state, checkpoint::LoadRankState(reader, *rank.layout, rank.world,
                                         shard_rank, &path));
    const checkpoint::LoadPath expected =
        rank.saved_world == rank.world ? checkpoint::LoadPath::kOwnRank
                                       : checkpoint::LoadPath::kResharded;
    if (path != expected) {
      return absl::InternalError(absl::StrFormat(
          "rank %d: LoadRankState took the %s path for a checkpoint of %d "
          "ranks loaded on %d",
          rank.rank,
          path == checkpoint::LoadPath::kOwnRank ? "own-rank" : "resharding",
          rank.saved_world, rank.world));
    }
  } else {
    FLATPARAM_RETURN_IF_ERROR(reader.CheckFits(reader.layout(), rank.world));
    FLATPARAM_RETURN_IF_ERROR(reader.VerifyRank(rank.rank));
    FLATPARAM_ASSIGN_OR_RETURN(state,
                               checkpoint::ReadRankState(reader, rank.rank));
  }
  if (state.flat_params.size() != rank.layout->flat_params().size()) {
    return absl::InternalError(absl::StrFormat(
        "rank %d loaded %d flat parameters of %d", rank.rank,
        state.flat_params.size(), rank.layout->flat_params().size()));
  }
  benchmark::DoNotOptimize(state.flat_params.data());
  return absl::OkStatus();
}

double MaxOverRanks(double v) {
  double out = 0;
  MPI_Allreduce(&v, &out, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return out;
}

double SumOverRanks(double v) {
  double out = 0;
  MPI_Allreduce(&v, &out, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
  return out;
}

int64_t MaxOverRanks(int64_t v) {
  int64_t out = 0;
  MPI_Allreduce(&v, &out, 1, MPI_INT64_T, MPI_MAX, MPI_COMM_WORLD);
  return out;
}

// One iteration's figures (max over ranks).
struct Sample {
  double load_s = 0;
  double baseline_s = 0;
  double load_cpu_s = 0;      // summed over ranks
  double baseline_cpu_s = 0;  // summed over ranks
  double io_s = 0;
  double open_s = 0;
  int64_t read_bytes = 0;
  int64_t needed_bytes = 0;
  double resident_before = 0;
};

void PrepareCache(Rank& rank, Mode mode, Cache cache) {
  if (cache == Cache::kCold) {
    for (const std::string& f : rank.all_files) DropFromPageCache(f);
  } else {
    PlainRead(rank.needed[mode], rank.buffer.data(),
              static_cast<int64_t>(rank.buffer.size()), /*advance=*/false);
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

Sample Iterate(Rank& rank, Mode mode, Cache cache) {
  Sample s;
  const std::vector<Range>& needed = rank.needed[mode];
  PrepareCache(rank, mode, cache);
  const auto [resident, pages] = ResidentPages(needed);
  s.resident_before =
      MaxOverRanks(pages > 0 ? static_cast<double>(resident) / pages : 0.0);
  rank.counting.Reset();
  rank.fs.Reset(/*record=*/false);
  Splits splits;
  MPI_Barrier(MPI_COMM_WORLD);
  double cpu = ThreadCpuSeconds();
  auto start = std::chrono::steady_clock::now();
  CheckOk(Load(rank, mode, &splits));
  const double load_s = Seconds(start);
  s.load_cpu_s = SumOverRanks(ThreadCpuSeconds() - cpu);
  s.load_s = MaxOverRanks(load_s);
  s.read_bytes = MaxOverRanks(rank.counting.total());
  s.io_s = MaxOverRanks(rank.fs.io_seconds());
  s.open_s = MaxOverRanks(splits.open_s);

  PrepareCache(rank, mode, cache);
  cpu = ThreadCpuSeconds();
  start = std::chrono::steady_clock::now();
  const int64_t bytes =
      PlainReadIntoMemory(needed, static_cast<int64_t>(rank.buffer.size()));
  const double baseline_s = Seconds(start);
  s.baseline_cpu_s = SumOverRanks(ThreadCpuSeconds() - cpu);
  s.baseline_s = MaxOverRanks(baseline_s);
  s.needed_bytes = MaxOverRanks(bytes);
  return s;
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

// Rank 0's samples of each benchmark, for the summary rows.
struct Row {
  Mode mode;
  Cache cache;
  std::vector<Sample> samples;
};

void Run(Rank& rank, Mode mode, Cache cache, Row* row, benchmark::State* state,
         int64_t iterations) {
  Sample sum;
  int64_t n = 0;
  RunIterations(state, iterations, [&]() -> double {
    const Sample s = Iterate(rank, mode, cache);
    if (row != nullptr) row->samples.push_back(s);
    sum.load_s += s.load_s;
    sum.baseline_s += s.baseline_s;
    sum.load_cpu_s += s.load_cpu_s;
    sum.baseline_cpu_s += s.baseline_cpu_s;
    sum.io_s += s.io_s;
    sum.open_s += s.open_s;
    sum.read_bytes += s.read_bytes;
    sum.needed_bytes += s.needed_bytes;
    sum.resident_before = std::max(sum.resident_before, s.resident_before);
    ++n;
    return s.load_s;
  });
  if (state == nullptr || n == 0) return;
  const double share = static_cast<double>(rank.total_bytes) / rank.world;
  const double read = static_cast<double>(sum.read_bytes) / n;
  const double needed = static_cast<double>(sum.needed_bytes) / n;
  auto& c = state->counters;
  state->SetBytesProcessed(rank.total_bytes * n);
  c["saved_world_size"] = static_cast<double>(rank.saved_world);
  c["total_bytes"] = static_cast<double>(rank.total_bytes);
  c["share_bytes"] = share;
  c["read_bytes"] = read;
  c["read_over_share"] = read / share;
  c["needed_bytes"] = needed;
  c["read_over_needed"] = read / needed;
  c["baseline_s"] = sum.baseline_s / n;
  c["load_over_baseline"] = sum.load_s / sum.baseline_s;
  c["load_cpu_s"] = sum.load_cpu_s / n;
  c["baseline_cpu_s"] = sum.baseline_cpu_s / n;
  c["cpu_load_over_baseline"] = sum.load_cpu_s / sum.baseline_cpu_s;
  c["io_s"] = sum.io_s / n;
  c["open_s"] = sum.open_s / n;
  c["resident_before"] = sum.resident_before;
}

std::string Mib(double bytes) {
  return absl::StrFormat("%.1f MiB", bytes / (1 << 20));
}

void PrintSummary(const Rank& rank, const std::vector<Row>& rows) {
  std::printf(
      "\nMedians over repetitions (W = %d ranks, checkpoint saved on %d; "
      "times are the slowest rank's):\n",
      rank.world, static_cast<int>(rank.saved_world));
  std::printf(
      "| W | saved on | cache | mode | total | total/W | read per rank (max) "
      "| read / (total/W) | needed per rank | load | baseline | load / "
      "baseline | load: in reads | load: open | cached before | CPU: load / "
      "baseline |\n");
  std::printf(
      "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | "
      "--- | --- | --- | --- | --- |\n");
  for (const Row& row : rows) {
    if (row.samples.empty()) continue;
    std::vector<double> load, base, read, needed, ratio, io, open, resident,
        cpu_ratio;
    for (const Sample& s : row.samples) {
      load.push_back(s.load_s);
      base.push_back(s.baseline_s);
      read.push_back(static_cast<double>(s.read_bytes));
      needed.push_back(static_cast<double>(s.needed_bytes));
      ratio.push_back(s.load_s / s.baseline_s);
      cpu_ratio.push_back(s.load_cpu_s / s.baseline_cpu_s);
      io.push_back(s.io_s);
      open.push_back(s.open_s);
      resident.push_back(s.resident_before);
    }
    const double share = static_cast<double>(rank.total_bytes) / rank.world;
    std::printf(
        "| %d | %d | %s | %s | %s | %s | %s | %.2f | %s | %.3f s | %.3f s | "
        "%.2f | %.3f s | %.3f s | %.0f%% | %.2f |\n",
        rank.world, static_cast<int>(rank.saved_world), CacheName(row.cache),
        ModeName(row.mode), Mib(rank.total_bytes).c_str(), Mib(share).c_str(),
        Mib(Median(read)).c_str(), Median(read) / share,
        Mib(Median(needed)).c_str(), Median(load), Median(base), Median(ratio),
        Median(io), Median(open), 100 * Median(resident), Median(cpu_ratio));
  }
  std::fflush(stdout);
}

int Main(const Flags& flags, int* argc, char*** argv) {
  absl::StatusOr<MpiSession> session = MpiSession::Start(argc, argv);
  if (!session.ok()) Die(kProgram, session.status());
  Rank rank;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank.rank);
  MPI_Comm_size(MPI_COMM_WORLD, &rank.world);
  rank.saved_world =
      flags.saved_world_size > 0 ? flags.saved_world_size : rank.world;
  rank.buffer.resize(static_cast<size_t>(flags.chunk_kib) << 10);
  if (flags.mode == "verify_then_read" && rank.saved_world != rank.world) {
    Die(kProgram,
        absl::InvalidArgumentError(
            "--mode=verify_then_read reads the rank's own file: it needs "
            "--saved_world_size equal to the job's world size"));
  }
  const ModelSpec spec = BenchModel(flags);
  absl::StatusOr<ModelLayout> layout =
      ModelLayout::Create(spec, FullShard(rank.world));
  CheckOk(layout.status());
  rank.layout.emplace(*std::move(layout));

  // Rank 0 writes the checkpoint; the others learn where.
  std::string root;
  if (rank.rank == 0) {
    root = TempRoot(flags.dir);
    rank.dir = WriteCheckpoint(spec, root, rank.saved_world);
  }
  int64_t length = static_cast<int64_t>(rank.dir.size());
  MPI_Bcast(&length, 1, MPI_INT64_T, 0, MPI_COMM_WORLD);
  rank.dir.resize(length);
  MPI_Bcast(rank.dir.data(), static_cast<int>(length), MPI_CHAR, 0,
            MPI_COMM_WORLD);

  FileSystem& fs = checkpoint::PosixFileSystem();
  absl::StatusOr<std::vector<std::string>> children = fs.GetChildren(rank.dir);
  CheckOk(children.status());
  for (const std::string& c : *children) {
    const std::string path = checkpoint::JoinPath(rank.dir, c);
    absl::StatusOr<uint64_t> size = fs.GetFileSize(path);
    CheckOk(size.status());
    rank.all_files.push_back(path);
    rank.total_bytes += static_cast<int64_t>(*size);
    const bool tensors =
        c.size() > 12 && c.substr(c.size() - 12) == ".safetensors";
    if (!tensors) rank.metadata_bytes += static_cast<int64_t>(*size);
  }

  std::vector<Mode> modes;
  if (flags.mode != "verify_then_read") modes.push_back(Mode::kLoad);
  if (flags.mode != "load") {
    if (rank.saved_world == rank.world) {
      modes.push_back(Mode::kVerifyThenRead);
    } else if (rank.rank == 0) {
      std::fprintf(stderr,
                   "%s: no verify_then_read rows: the checkpoint was saved "
                   "on %d ranks, not %d\n",
                   kProgram, static_cast<int>(rank.saved_world), rank.world);
    }
  }
  // One untimed load per mode first: it checks the path works on every
  // rank, records the ranges it reads (the baseline's), and the first pass
  // over freshly written files is slower for any reader.
  for (Mode mode : modes) {
    rank.counting.Reset();
    rank.fs.Reset(/*record=*/true);
    Splits ignored;
    CheckOk(Load(rank, mode, &ignored));
    rank.needed[mode] = Merge(rank.fs.ranges());
    rank.fs.Reset(/*record=*/false);
    if (rank.rank == 0) {
      std::fprintf(stderr, "%s: %s: rank 0 read, by file:", kProgram,
                   ModeName(mode));
      for (const auto& [name, n] : rank.counting.read_by_file()) {
        std::fprintf(stderr, " %s %s;", name.c_str(), Mib(n).c_str());
      }
      std::fprintf(stderr, " distinct %s (checkpoint %s, metadata %s)\n",
                   Mib(Bytes(rank.needed[mode])).c_str(),
                   Mib(rank.total_bytes).c_str(),
                   Mib(rank.metadata_bytes).c_str());
    }
  }
  MPI_Barrier(MPI_COMM_WORLD);

  std::vector<Cache> caches;
  if (flags.cache != "warm") caches.push_back(Cache::kCold);
  if (flags.cache != "cold") caches.push_back(Cache::kWarm);

  std::vector<Row> rows;
  for (Cache cache : caches) {
    for (Mode mode : modes) rows.push_back({mode, cache, {}});
  }
  std::vector<MpiBenchmark> benchmarks;
  for (Row& row : rows) {
    MpiBenchmark b;
    b.name = absl::StrFormat("checkpoint_load/ranks:%d/saved:%d/cache:%s/%s",
                             rank.world, rank.saved_world, CacheName(row.cache),
                             ModeName(row.mode));
    b.run = [&rank, &row](benchmark::State* state, int64_t iterations) {
      Run(rank, row.mode, row.cache, state != nullptr ? &row : nullptr, state,
          iterations);
    };
    const int reps = static_cast<int>(flags.reps);
    b.configure = [reps](benchmark::internal::Benchmark* r) {
      r->UseManualTime()
          ->Unit(benchmark::kMillisecond)
          ->Iterations(1)
          ->Repetitions(reps)
          ->ReportAggregatesOnly(reps > 1);
    };
    benchmarks.push_back(std::move(b));
  }
  if (rank.rank == 0) {
    benchmark::AddCustomContext("checkpoint_bytes",
                                absl::StrCat(rank.total_bytes));
    benchmark::AddCustomContext("saved_world_size",
                                absl::StrCat(rank.saved_world));
    benchmark::AddCustomContext(
        "page_cache",
        "cold: posix_fadvise(DONTNEED) on every checkpoint file before each "
        "timed part; warm: needed ranges read untimed first");
  }
  RunMpiBenchmarks(benchmarks);
  if (rank.rank == 0) PrintSummary(rank, rows);

  MPI_Barrier(MPI_COMM_WORLD);
  if (rank.rank == 0) CheckOk(checkpoint::RemoveRecursively(fs, root));
  const absl::Status finished = session->Finish();
  if (!finished.ok()) Die(kProgram, finished);
  return 0;
}

}  // namespace
}  // namespace bench
}  // namespace flatparam

int main(int argc, char** argv) {
  flatparam::bench::Flags flags;
  flatparam::bench::BenchFlags parser(flatparam::bench::kProgram);
  parser.Int64("total_mib", &flags.total_mib, 1);
  parser.String("model", &flags.model);
  parser.String("mode", &flags.mode, {"load", "verify_then_read", "both"});
  parser.String("cache", &flags.cache, {"cold", "warm", "both"});
  parser.Int64("saved_world_size", &flags.saved_world_size, 0);
  parser.Int64("reps", &flags.reps, 1);
  parser.Int64("chunk_kib", &flags.chunk_kib, 4);
  parser.String("dir", &flags.dir);
  parser.Parse(&argc, argv);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 2;
  return flatparam::bench::Main(flags, &argc, &argv);
}
