// Throughput of flattening, unflattening and sharding host buffers against a
// plain memcpy of the same bytes, and the cost of computing shard metadata
// for every rank of a large model.
//
//   bazel run -c opt //benchmarks:flatparam_bench
//
// Each copy benchmark reports bytes/s (SetBytesProcessed counts the bytes
// written); compare BM_Flatten/BM_Unflatten/BM_CopyShard with BM_Memcpy at the
// same size from the same run.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "flatparam/flatten.h"
#include "flatparam/layout.h"
#include "flatparam/model_layout.h"
#include "flatparam/presets.h"

namespace flatparam {
namespace {

constexpr int64_t kMiB = 1 << 20;

// A transformer-block-like mix of parameter sizes totalling `bytes` float32
// bytes: a few large matrices and some small vectors of awkward sizes.
std::vector<ParamSpec> BlockParams(int64_t bytes) {
  const int64_t numel = bytes / 4;
  std::vector<ParamSpec> params;
  int64_t used = 0;
  const int64_t small = 4099;  // A prime: misaligns what follows it.
  int i = 0;
  while (used < numel) {
    int64_t n = (i % 3 == 2) ? small : numel / 8;
    n = std::min(n, numel - used);
    params.push_back({"p" + std::to_string(i++), {n}});
    used += n;
  }
  return params;
}

void Touch(HostTensor& t) { std::memset(t.data(), 1, t.nbytes()); }

struct Fixture {
  explicit Fixture(int64_t bytes, int64_t world_size) {
    LayoutOptions o;
    o.world_size = world_size;
    o.align_addresses = true;
    layout.emplace(*FlatParamLayout::Create("", BlockParams(bytes), o));
    for (const ParamInfo& p : layout->params()) {
      params.emplace_back(DType::kFloat32, p.shape);
      Touch(params.back());
    }
    for (HostTensor& t : params) {
      refs.push_back(t.cref());
      mutable_refs.push_back(t.ref());
    }
    flat = HostTensor::Flat(DType::kFloat32, layout->padded_unsharded_numel());
    Touch(flat);
  }
  std::optional<FlatParamLayout> layout;
  std::vector<HostTensor> params;
  std::vector<ConstBufferRef> refs;
  std::vector<BufferRef> mutable_refs;
  HostTensor flat;
};

void CheckOk(const absl::Status& s) {
  if (!s.ok()) {
    std::fprintf(stderr, "%s\n", s.ToString().c_str());
    std::abort();
  }
}

void BM_Memcpy(benchmark::State& state) {
  const int64_t bytes = state.range(0);
  std::vector<char> src(bytes, 1), dst(bytes, 2);
  for (auto _ : state) {
    std::memcpy(dst.data(), src.data(), bytes);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * bytes);
}

void BM_Flatten(benchmark::State& state) {
  Fixture f(state.range(0), 8);
  BufferRef out{f.flat.data(), f.layout->unpadded_unsharded_numel(),
                DType::kFloat32, Device::Host()};
  for (auto _ : state) {
    CheckOk(Flatten(*f.layout, f.refs, out));
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() *
                          f.layout->unpadded_unsharded_numel() * 4);
}

void BM_Unflatten(benchmark::State& state) {
  Fixture f(state.range(0), 8);
  for (auto _ : state) {
    CheckOk(Unflatten(*f.layout, f.flat.cref(), f.mutable_refs));
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * f.layout->param_numel() * 4);
}

// Every rank's shard in turn: the bytes of the whole flat parameter.
void BM_CopyShardAllRanks(benchmark::State& state) {
  const int64_t world_size = 8;
  Fixture f(state.range(0), world_size);
  HostTensor shard =
      HostTensor::Flat(DType::kFloat32, f.layout->sharded_numel());
  Touch(shard);
  for (auto _ : state) {
    for (int64_t r = 0; r < world_size; ++r) {
      CheckOk(CopyShard(*f.layout, f.flat.cref(), r, shard.ref()));
    }
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() *
                          f.layout->padded_unsharded_numel() * 4);
}

// Builds each rank's shard straight from the parameters.
void BM_FlattenShardAllRanks(benchmark::State& state) {
  const int64_t world_size = 8;
  Fixture f(state.range(0), world_size);
  HostTensor shard =
      HostTensor::Flat(DType::kFloat32, f.layout->sharded_numel());
  Touch(shard);
  for (auto _ : state) {
    for (int64_t r = 0; r < world_size; ++r) {
      CheckOk(FlattenShard(*f.layout, f.refs, r, shard.ref()));
    }
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() *
                          f.layout->padded_unsharded_numel() * 4);
}

void CopyArgs(benchmark::internal::Benchmark* b) {
  b->ArgName("bytes");
  for (int64_t mib : {1, 16, 256, 1024}) b->Arg(mib * kMiB);
  b->Unit(benchmark::kMicrosecond);
}

BENCHMARK(BM_Memcpy)->Apply(CopyArgs);
BENCHMARK(BM_Flatten)->Apply(CopyArgs);
BENCHMARK(BM_Unflatten)->Apply(CopyArgs);
BENCHMARK(BM_CopyShardAllRanks)->Apply(CopyArgs);
BENCHMARK(BM_FlattenShardAllRanks)->Apply(CopyArgs);

// Layout of llama2-70b (81 flat parameters) plus the shard metadata of every
// rank of every flat parameter at world size W.
void BM_Llama2_70bShardMetadataAllRanks(benchmark::State& state) {
  const int64_t world_size = state.range(0);
  absl::StatusOr<ModelSpec> spec = PresetModel("llama2-70b");
  CheckOk(spec.status());
  LayoutOptions o;
  o.world_size = world_size;
  o.align_addresses = true;
  int64_t infos = 0;
  for (auto _ : state) {
    absl::StatusOr<ModelLayout> model = ModelLayout::Create(*spec, o);
    CheckOk(model.status());
    for (const FlatParamLayout& fp : model->flat_params()) {
      for (int64_t r = 0; r < world_size; ++r) {
        std::vector<ShardParamInfo> v = fp.shard_param_infos(r);
        infos += static_cast<int64_t>(v.size());
        benchmark::DoNotOptimize(v.data());
      }
    }
  }
  state.counters["shard_param_infos"] = benchmark::Counter(
      static_cast<double>(infos), benchmark::Counter::kIsRate);
}
BENCHMARK(BM_Llama2_70bShardMetadataAllRanks)
    ->ArgName("W")
    ->RangeMultiplier(8)
    ->Range(8, 4096)
    ->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace flatparam

BENCHMARK_MAIN();
