// Throughput and peak extra memory of the offline checkpoint conversions
// (flatparam/checkpoint/convert.h) next to a plain read+write of the same
// bytes, measured in the same run on the same disk.
//
//   bazel run -c opt //benchmarks:optim_state_bench
//   bazel run -c opt //benchmarks:optim_state_bench -- --state_mib=64
//       --dir=/mnt/fast   (one command line)
//
// The model: float32 layers of two [4096, 2048]-like matrices and a
// 4099-element bias each (so flat parameters and shards cut parameters at
// odd places), plus a root embedding, with AdamW state (exp_avg,
// exp_avg_sq, step): --state_mib (default 1152, i.e. 1.125 GiB) of optimizer
// state and half as much of parameters, ~1.7 GiB per checkpoint.
//
//   plain_read_write  reads every tensor file of the full checkpoint in
//                     4 MiB pieces and writes the bytes to new files, each
//                     fsynced: the floor any conversion of these bytes has
//                     to pay.
//   shard             full -> sharded, FULL_SHARD on 8 ranks.
//   consolidate       sharded on 8 ranks -> full.
//   reshard           sharded on 8 ranks -> sharded on 6 ranks (so every
//                     new shard straddles old ones).
//   reshard_hybrid    sharded on 8 ranks -> HYBRID_SHARD 2x2 on 4 ranks.
// Each iteration (3 per benchmark) converts the whole checkpoint; the
// output is removed and the page cache's dirty pages written back (sync),
// untimed, before the next, so that no benchmark pays for another's
// writeback. Checksums of the input are verified as the tools do; every
// output file is fsynced, as checkpoints are.
// Counters: bytes_per_second (the tensor-file bytes written, i.e. the
// checkpoint's size), and peak_extra_bytes, the growth of the process's
// peak resident set (VmHWM, reset through /proc/self/clear_refs before the
// run) over its resident set before it: the memory the conversion needs,
// which must stay bounded by the chunk size and metadata, far below the
// model's size. The page cache is not resident-set memory.
//
// The full checkpoint comes from InitCheckpoint (pseudo-random weights and
// AdamW state, streamed). Files go under --dir (default $TEST_TMPDIR, $TMPDIR
// or /tmp) in a fresh directory, removed at exit.
#include <benchmark/benchmark.h>
#include <malloc.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "benchmarks/bench_flags.h"
#include "flatparam/base/dtype.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/checkpoint/checkpoint_dir.h"
#include "flatparam/checkpoint/convert.h"
#include "flatparam/checkpoint/file_system.h"
#include "flatparam/layout.h"
#include "flatparam/model_layout.h"

namespace flatparam {
namespace {

using checkpoint::FileSystem;

void CheckOk(const absl::Status& status) {
  if (!status.ok()) {
    std::fprintf(stderr, "optim_state_bench: %s\n", status.ToString().c_str());
    std::exit(1);
  }
}

struct Flags {
  int64_t state_mib = 1152;
  // The conversions' chunk size and the plain copy's buffer.
  int64_t chunk_kib = 1024;
  std::string dir;
};
Flags& GetFlags() {
  static Flags flags;
  return flags;
}

// Bytes of a /proc/self/status field given in kB ("VmHWM", "VmRSS").
int64_t ProcStatusBytes(absl::string_view field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    absl::string_view l = line;
    if (l.substr(0, field.size()) == field && l.size() > field.size() &&
        l[field.size()] == ':') {
      int64_t kb = 0;
      std::string digits;
      for (char c : l.substr(field.size() + 1)) {
        if (c >= '0' && c <= '9') digits.push_back(c);
      }
      if (absl::SimpleAtoi(digits, &kb)) return kb * 1024;
    }
  }
  return -1;
}

// Resets VmHWM to the current resident set (Linux >= 4.0).
void ResetPeakRss() {
  std::ofstream out("/proc/self/clear_refs");
  out << "5";
}

// The benchmark's model: `layers` layers so that the AdamW state is about
// state_mib MiB.
ModelSpec BenchModel(int64_t state_mib) {
  // Per layer: 2 * rows * 2048 + 4099 floats; state is 8 bytes per param.
  const int64_t layers = 9;
  const int64_t per_layer_floats = state_mib * (int64_t{1} << 20) / 8 / layers;
  const int64_t rows = std::max<int64_t>(1, per_layer_floats / (2 * 2048));
  ModelSpec spec;
  spec.name = absl::StrFormat("optim_state_bench_%dmib", state_mib);
  spec.params.push_back({"embed.weight", {1000, 128}, DType::kFloat32});
  for (int64_t l = 0; l < layers; ++l) {
    const std::string p = absl::StrFormat("layers.%d.", l);
    spec.params.push_back({p + "w1.weight", {rows, 2048}, DType::kFloat32});
    spec.params.push_back({p + "w1.bias", {4099}, DType::kFloat32});
    spec.params.push_back({p + "w2.weight", {2048, rows}, DType::kFloat32});
    spec.wrap.push_back(absl::StrFormat("layers.%d", l));
  }
  return spec;
}

LayoutOptions Layout(int64_t world_size, ShardingStrategy strategy) {
  LayoutOptions o;
  o.world_size = world_size;
  o.strategy = strategy;
  return o;
}

// The fixtures, made once: a full checkpoint and its 8-rank sharding.
struct Fixture {
  std::string root;
  ModelSpec spec;
  std::string full;
  std::string sharded8;
  int64_t full_tensor_bytes = 0;

  static Fixture& Get() {
    static Fixture* f = [] {
      auto* f = new Fixture;
      FileSystem& fs = checkpoint::PosixFileSystem();
      std::string base = GetFlags().dir;
      if (base.empty()) {
        for (const char* env : {"TEST_TMPDIR", "TMPDIR"}) {
          const char* v = std::getenv(env);
          if (v != nullptr && *v != '\0') {
            base = v;
            break;
          }
        }
      }
      if (base.empty()) base = "/tmp";
      std::string tmpl = checkpoint::JoinPath(base, "optim_state_bench.XXXXXX");
      if (mkdtemp(tmpl.data()) == nullptr) {
        std::perror("optim_state_bench: mkdtemp");
        std::exit(1);
      }
      f->root = tmpl;
      std::atexit([] {
        (void)checkpoint::RemoveRecursively(checkpoint::PosixFileSystem(),
                                            Get().root);
      });
      f->spec = BenchModel(GetFlags().state_mib);
      f->full = checkpoint::JoinPath(f->root, "full");
      f->sharded8 = checkpoint::JoinPath(f->root, "sharded8");
      std::fprintf(stderr, "optim_state_bench: writing fixtures under %s\n",
                   f->root.c_str());
      checkpoint::InitOptions init;
      init.optimizer = checkpoint::InitOptimizer::kAdamW;
      CheckOk(checkpoint::InitCheckpoint(fs, f->spec, f->full, init));
      CheckOk(checkpoint::ShardCheckpoint(
          fs, f->full, f->spec, Layout(8, ShardingStrategy::kFullShard), 0,
          f->sharded8));
      for (const char* name :
           {checkpoint::kModelFileName, checkpoint::kOptimFileName}) {
        absl::StatusOr<uint64_t> size =
            fs.GetFileSize(checkpoint::JoinPath(f->full, name));
        CheckOk(size.status());
        f->full_tensor_bytes += static_cast<int64_t>(*size);
      }
      return f;
    }();
    return *f;
  }
};

// Total size of the files in `dir`.
int64_t DirBytes(FileSystem& fs, const std::string& dir) {
  absl::StatusOr<std::vector<std::string>> children = fs.GetChildren(dir);
  CheckOk(children.status());
  int64_t total = 0;
  for (const std::string& c : *children) {
    absl::StatusOr<uint64_t> size =
        fs.GetFileSize(checkpoint::JoinPath(dir, c));
    CheckOk(size.status());
    total += static_cast<int64_t>(*size);
  }
  return total;
}

// Copies the full checkpoint's tensor files to `out_dir`.
absl::Status PlainReadWrite(FileSystem& fs, const std::string& in_dir,
                            const std::string& out_dir) {
  FLATPARAM_RETURN_IF_ERROR(fs.CreateDir(out_dir));
  std::vector<char> buffer(static_cast<size_t>(GetFlags().chunk_kib) << 10);
  for (const char* name :
       {checkpoint::kModelFileName, checkpoint::kOptimFileName}) {
    FLATPARAM_ASSIGN_OR_RETURN(
        std::unique_ptr<checkpoint::RandomAccessFile> in,
        fs.NewRandomAccessFile(checkpoint::JoinPath(in_dir, name)));
    FLATPARAM_ASSIGN_OR_RETURN(
        std::unique_ptr<checkpoint::WritableFile> out,
        fs.NewWritableFile(checkpoint::JoinPath(out_dir, name)));
    FLATPARAM_ASSIGN_OR_RETURN(uint64_t size, in->Size());
    for (uint64_t offset = 0; offset < size;) {
      const uint64_t n = std::min<uint64_t>(buffer.size(), size - offset);
      FLATPARAM_RETURN_IF_ERROR(
          in->ReadAt(offset, absl::MakeSpan(buffer.data(), n)));
      FLATPARAM_RETURN_IF_ERROR(
          out->Append(absl::string_view(buffer.data(), n)));
      offset += n;
    }
    FLATPARAM_RETURN_IF_ERROR(out->Sync());
    FLATPARAM_RETURN_IF_ERROR(out->Close());
  }
  return fs.SyncDir(out_dir);
}

enum class Op { kPlain, kShard, kConsolidate, kReshard, kReshardHybrid };

absl::Status Run(Op op, FileSystem& fs, const Fixture& f,
                 const std::string& out) {
  checkpoint::ConvertOptions convert;
  convert.chunk_bytes = static_cast<uint64_t>(GetFlags().chunk_kib) << 10;
  switch (op) {
    case Op::kPlain:
      return PlainReadWrite(fs, f.full, out);
    case Op::kShard:
      return checkpoint::ShardCheckpoint(
          fs, f.full, f.spec, Layout(8, ShardingStrategy::kFullShard), 0, out,
          convert);
    case Op::kConsolidate:
      return checkpoint::ConsolidateCheckpoint(fs, f.sharded8, out, convert);
    case Op::kReshard:
      return checkpoint::ReshardCheckpoint(
          fs, f.sharded8, Layout(6, ShardingStrategy::kFullShard), 0, out,
          convert);
    case Op::kReshardHybrid:
      return checkpoint::ReshardCheckpoint(
          fs, f.sharded8, Layout(2, ShardingStrategy::kHybridShard), 4, out,
          convert);
  }
  return absl::InternalError("unknown op");
}

void BM_Convert(benchmark::State& state, Op op) {
  Fixture& f = Fixture::Get();
  FileSystem& fs = checkpoint::PosixFileSystem();
  const std::string out = checkpoint::JoinPath(f.root, "out");
  CheckOk(checkpoint::RemoveRecursively(fs, out));
  // One untimed run first: the first pass after the fixtures were written
  // is up to 1.5x slower for any of the operations (the kernel settling its
  // page cache), which would favour whichever benchmark runs later.
  CheckOk(Run(op, fs, f, out));
  CheckOk(checkpoint::RemoveRecursively(fs, out));
  // Start every benchmark with no dirty pages (the fixtures' or an earlier
  // benchmark's) being written back behind its back.
  ::sync();
  // Return freed heap memory to the system first, so that buffers the
  // conversion allocates show up as growth rather than reuse.
  malloc_trim(0);
  const int64_t rss_before = ProcStatusBytes("VmRSS");
  ResetPeakRss();
  int64_t written = 0;
  for (auto _ : state) {
    CheckOk(Run(op, fs, f, out));
    state.PauseTiming();
    written += DirBytes(fs, out);
    CheckOk(checkpoint::RemoveRecursively(fs, out));
    ::sync();
    state.ResumeTiming();
  }
  const int64_t peak = ProcStatusBytes("VmHWM");
  state.SetBytesProcessed(written);
  state.counters["peak_extra_bytes"] =
      static_cast<double>(std::max<int64_t>(0, peak - rss_before));
  state.counters["checkpoint_bytes"] = static_cast<double>(f.full_tensor_bytes);
}

}  // namespace
}  // namespace flatparam

int main(int argc, char** argv) {
  using flatparam::Op;
  flatparam::Flags& flags = flatparam::GetFlags();
  flatparam::bench::BenchFlags parser("optim_state_bench");
  parser.Int64("state_mib", &flags.state_mib, 1);
  parser.Int64("chunk_kib", &flags.chunk_kib, 1);
  parser.String("dir", &flags.dir);
  parser.Parse(&argc, argv);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 2;
  const std::pair<const char*, Op> runs[] = {
      {"optim_state/plain_read_write", Op::kPlain},
      {"optim_state/shard", Op::kShard},
      {"optim_state/consolidate", Op::kConsolidate},
      {"optim_state/reshard", Op::kReshard},
      {"optim_state/reshard_hybrid", Op::kReshardHybrid},
  };
  for (const auto& [name, op] : runs) {
    benchmark::RegisterBenchmark(
        name, [op = op](benchmark::State& s) { flatparam::BM_Convert(s, op); })
        ->UseRealTime()
        ->Iterations(3)
        ->Unit(benchmark::kMillisecond);
  }
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
