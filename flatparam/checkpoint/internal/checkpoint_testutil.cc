#include "flatparam/checkpoint/internal/checkpoint_testutil.h"

#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "flatparam/base/dtype.h"
#include "flatparam/checkpoint/safetensors.h"

namespace flatparam {
namespace checkpoint {

using json = nlohmann::json;

ModelSpec TinyModelSpec() {
  ModelSpec m;
  m.name = "tiny";
  m.params = {{"emb.weight", {11, 3}},
              {"seq.0.weight", {5, 3}},
              {"seq.0.bias", {5}},
              {"seq.2.weight", {7, 5}},
              {"seq.2.bias", {7}},
              {"norm.scale", {}},
              {"head.weight", {}, DType::kFloat32, true, "emb.weight"}};
  m.wrap = {"seq.2"};
  return m;
}

LayoutOptions TestLayoutOptions(int64_t world_size, ShardingStrategy strategy,
                                bool align_addresses) {
  LayoutOptions o;
  o.world_size = world_size;
  o.strategy = strategy;
  o.align_addresses = align_addresses;
  return o;
}

ModelLayout MakeTestLayout(const ModelSpec& spec,
                           const LayoutOptions& options) {
  absl::StatusOr<ModelLayout> layout = ModelLayout::Create(spec, options);
  EXPECT_TRUE(layout.ok()) << layout.status();
  return *std::move(layout);
}

void FillSequence(HostTensor& t, double base) {
  for (int64_t i = 0; i < t.numel(); ++i) t.SetDouble(i, base + i);
}

FullFixture MakeFullFixture(const ModelSpec& spec, int version) {
  FullFixture f;
  json fqns = json::array();
  int index = 0;
  for (const ParamSpec& p : spec.params) {
    if (!p.tied_to.empty()) continue;
    fqns.push_back(p.fqn);
    HostTensor& w = f.storage.emplace_back(p.dtype, p.shape);
    FillSequence(w, version * 1000 + index * 10);
    f.content.model.push_back(TensorSourceFromHostTensor(p.fqn, w));
    HostTensor& m = f.storage.emplace_back(DType::kFloat32, p.shape);
    FillSequence(m, -version * 1000 - index * 10);
    f.content.optim.push_back(
        TensorSourceFromHostTensor(OptimStateTensorName(p.fqn, "exp_avg"), m));
    HostTensor& s =
        f.storage.emplace_back(DType::kFloat32, std::vector<int64_t>{});
    s.SetDouble(0, version);
    f.content.optim.push_back(
        TensorSourceFromHostTensor(OptimStateTensorName(p.fqn, "step"), s));
    ++index;
  }
  f.content.optim_json = {
      {"param_groups", json::array({{{"lr", 0.1}, {"params", fqns}}})},
      {"state", {{"emb.weight", {{"note", "non-tensor state"}}}}},
      {"version", version}};
  return f;
}

ShardedFixture MakeShardedFixture(const ModelLayout& layout, int64_t world_size,
                                  int version) {
  ShardedFixture f;
  f.content.layout = &layout;
  f.content.world_size = world_size;
  for (int64_t r = 0; r < layout.options().world_size; ++r) {
    RankContent rank;
    for (size_t i = 0; i < layout.flat_params().size(); ++i) {
      const FlatParamLayout& fp = layout.flat_params()[i];
      HostTensor& shard = f.storage.emplace_back(
          HostTensor::Flat(fp.dtype(), fp.sharded_numel()));
      FillSequence(shard, version * 1000 + r * 100 + i * 10);
      rank.tensors.push_back(
          TensorSourceFromHostTensor(FlatParamTensorName(i), shard));
      HostTensor& avg = f.storage.emplace_back(
          HostTensor::Flat(DType::kFloat32, fp.sharded_numel()));
      FillSequence(avg, -version * 1000 - r * 100 - i * 10);
      rank.tensors.push_back(
          TensorSourceFromHostTensor(OptimShardTensorName(i, "exp_avg"), avg));
      HostTensor& step =
          f.storage.emplace_back(DType::kFloat32, std::vector<int64_t>{});
      step.SetDouble(0, version);
      rank.tensors.push_back(
          TensorSourceFromHostTensor(OptimShardTensorName(i, "step"), step));
    }
    rank.sidecar = {{"param_groups", json::array({{{"lr", 0.1}}})},
                    {"rank", r},
                    {"version", version}};
    f.content.ranks.push_back(std::move(rank));
  }
  return f;
}

absl::Status WriteRankStates(FileSystem& fs, const std::string& dir,
                             const ModelLayout& layout,
                             const std::vector<RankState>& ranks) {
  ShardedCheckpointContent content;
  content.layout = &layout;
  for (size_t r = 0; r < ranks.size(); ++r) {
    absl::StatusOr<RankContent> c = MakeRankContent(layout, r, ranks[r]);
    if (!c.ok()) return c.status();
    content.ranks.push_back(*std::move(c));
  }
  return WriteShardedCheckpoint(fs, dir, content);
}

std::vector<std::string> ListDir(FileSystem& fs, const std::string& dir) {
  absl::StatusOr<std::vector<std::string>> children = fs.GetChildren(dir);
  EXPECT_TRUE(children.ok()) << children.status();
  return children.ok() ? *std::move(children) : std::vector<std::string>{};
}

std::string ReadWholeFile(FileSystem& fs, const std::string& path) {
  absl::StatusOr<std::string> s = ReadFileToString(fs, path, 1 << 30);
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? *std::move(s) : "";
}

void ExpectSameDirectory(FileSystem& fs, const std::string& a,
                         const std::string& b) {
  const std::vector<std::string> names = ListDir(fs, a);
  ASSERT_EQ(names, ListDir(fs, b));
  for (const std::string& name : names) {
    EXPECT_EQ(ReadWholeFile(fs, JoinPath(a, name)),
              ReadWholeFile(fs, JoinPath(b, name)))
        << name << " differs";
  }
}

ModelSpec BigModelSpec() {
  ModelSpec spec;
  spec.name = "big";
  for (int l = 0; l < 4; ++l) {
    spec.params.push_back({absl::StrCat("layers.", l, ".w"), {1536, 1024}});
    spec.params.push_back({absl::StrCat("layers.", l, ".v"), {1024, 1536}});
    spec.wrap.push_back(absl::StrCat("layers.", l));
  }
  return spec;
}

ModelSpec BufferModelSpec() {
  ModelSpec m;
  m.name = "bn";
  m.params = {{"a.w", {4, 3}}, {"a.b", {4}}, {"c.w", {5}}};
  m.wrap = {"a"};
  m.buffers = {{"a.bn.running_mean", {3}, DType::kFloat32},
               {"a.bn.num_batches_tracked", {}, DType::kInt64},
               {"c.scale", {2}, DType::kFloat64}};
  return m;
}

std::map<std::string, HostTensor> RankBuffers(const ModelSpec& spec, int r) {
  std::map<std::string, HostTensor> out;
  for (const BufferSpec& b : spec.buffers) {
    HostTensor t(b.dtype, b.shape);
    for (int64_t i = 0; i < t.numel(); ++i) {
      const int64_t v = 10 * (r + 1) + i;
      if (b.dtype == DType::kInt64) {
        t.data_as<int64_t>()[i] = v;
      } else {
        t.SetDouble(i, static_cast<double>(v));
      }
    }
    out.emplace(b.fqn, std::move(t));
  }
  return out;
}

std::vector<RankState> RankStatesWithBuffers(const ModelLayout& layout) {
  std::vector<RankState> ranks(layout.options().world_size);
  for (size_t r = 0; r < ranks.size(); ++r) {
    for (const FlatParamLayout& f : layout.flat_params()) {
      ranks[r].flat_params.push_back(
          HostTensor::Flat(f.dtype(), f.sharded_numel()));
    }
    ranks[r].buffers = RankBuffers(layout.spec(), static_cast<int>(r));
  }
  return ranks;
}

bool SameTensorBytes(const HostTensor& a, const HostTensor& b) {
  return a.dtype() == b.dtype() && a.shape() == b.shape() &&
         std::memcmp(a.data(), b.data(), a.nbytes()) == 0;
}

void ExpectRanksBuffers(const ModelSpec& spec,
                        const std::map<std::string, HostTensor>& got, int r) {
  const std::map<std::string, HostTensor> want = RankBuffers(spec, r);
  ASSERT_EQ(got.size(), want.size());
  for (const auto& [fqn, t] : want) {
    ASSERT_EQ(got.count(fqn), 1u) << fqn;
    EXPECT_TRUE(SameTensorBytes(got.at(fqn), t))
        << fqn << " is not rank " << r << "'s";
  }
}

int64_t PeakResidentBytes() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (!absl::StartsWith(line, "VmHWM:")) continue;
    std::string digits;
    for (char c : line) {
      if (c >= '0' && c <= '9') digits += c;
    }
    int64_t kib = 0;
    if (absl::SimpleAtoi(digits, &kib)) return kib * 1024;
  }
  return 0;
}

}  // namespace checkpoint
}  // namespace flatparam
