// A tiny trainer-side program: lay out a two-layer model for 4 ranks, flatten
// its parameters, take rank 1's shard and print what it holds.
#include <cstdio>
#include <vector>

#include "flatparam/flatten.h"
#include "flatparam/layout.h"

int main() {
  using flatparam::ParamSpec;
  std::vector<ParamSpec> params = {
      {"fc1.weight", {4, 3}},
      {"fc1.bias", {4}},
      {"fc2.weight", {2, 4}},
      {"fc2.bias", {2}},
  };
  flatparam::LayoutOptions options;
  options.world_size = 4;
  options.align_addresses = true;
  auto layout = flatparam::FlatParamLayout::Create("", params, options);
  if (!layout.ok()) {
    std::fprintf(stderr, "%s\n", layout.status().ToString().c_str());
    return 1;
  }
  std::vector<flatparam::HostTensor> values;
  std::vector<flatparam::ConstBufferRef> refs;
  float next = 0;
  for (const flatparam::ParamInfo& p : layout->params()) {
    values.emplace_back(flatparam::DType::kFloat32, p.shape);
    for (int64_t i = 0; i < p.numel; ++i) values.back().SetDouble(i, next++);
  }
  for (const auto& v : values) refs.push_back(v.cref());
  auto shard = flatparam::HostTensor::Flat(flatparam::DType::kFloat32,
                                           layout->sharded_numel());
  if (auto s = flatparam::FlattenShard(*layout, refs, 1, shard.ref());
      !s.ok()) {
    std::fprintf(stderr, "%s\n", s.ToString().c_str());
    return 1;
  }
  std::printf("flat numel %lld, shard numel %lld; rank 1 holds:",
              static_cast<long long>(layout->unpadded_unsharded_numel()),
              static_cast<long long>(layout->sharded_numel()));
  for (int64_t i = 0; i < shard.numel(); ++i) {
    std::printf(" %g", shard.GetDouble(i));
  }
  std::printf("\n");
  return 0;
}
