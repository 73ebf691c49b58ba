#include "verify/generators.h"

#include <algorithm>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "flatparam/base/shape.h"

namespace flatparam {

void showValue(DType dtype, std::ostream& os) { os << DTypeName(dtype); }

void showValue(ShardingStrategy strategy, std::ostream& os) {
  os << ShardingStrategyName(strategy);
}

void showValue(const ParamSpec& spec, std::ostream& os) {
  os << "{fqn=\"" << spec.fqn << "\"";
  if (!spec.tied_to.empty()) os << ", tied_to=\"" << spec.tied_to << "\"";
  os << ", shape=" << ShapeString(spec.shape) << " (numel "
     << NumElements(spec.shape) << "), " << DTypeName(spec.dtype);
  if (!spec.requires_grad) os << ", requires_grad=false";
  os << "}";
}

void showValue(const LayoutOptions& options, std::ostream& os) {
  os << "{world_size=" << options.world_size
     << ", strategy=" << ShardingStrategyName(options.strategy)
     << ", align_addresses=" << (options.align_addresses ? "true" : "false");
  if (options.compute_dtype.has_value()) {
    os << ", compute_dtype=" << DTypeName(*options.compute_dtype);
  }
  os << "}";
}

void showValue(const ModelSpec& spec, std::ostream& os) {
  os << "{name=\"" << spec.name << "\", wrap=[";
  for (size_t i = 0; i < spec.wrap.size(); ++i) {
    os << (i ? ", " : "") << "\"" << spec.wrap[i] << "\"";
  }
  os << "], params=[";
  for (size_t i = 0; i < spec.params.size(); ++i) {
    os << (i ? ",\n    " : "\n    ");
    showValue(spec.params[i], os);
  }
  os << "]}";
}

void showValue(const ShardInterval& interval, std::ostream& os) {
  os << "{start=" << interval.start
     << ", end_inclusive=" << interval.end_inclusive
     << ", numel_padded=" << interval.numel_padded << "}";
}

void showValue(const ShardParamInfo& info, std::ostream& os) {
  if (!info.in_shard) {
    os << "{in_shard=false";
    // PyTorch stores None; anything else here is worth seeing.
    if (info.offset_in_shard != 0 || info.numel_in_shard != 0 ||
        info.intra_param_start_idx != 0 || info.intra_param_end_idx != 0) {
      os << ", offset_in_shard=" << info.offset_in_shard
         << ", numel_in_shard=" << info.numel_in_shard
         << ", intra_param_start_idx=" << info.intra_param_start_idx
         << ", intra_param_end_idx=" << info.intra_param_end_idx;
    }
    os << "}";
    return;
  }
  os << "{in_shard=true, offset_in_shard=" << info.offset_in_shard
     << ", numel_in_shard=" << info.numel_in_shard
     << ", intra_param_start_idx=" << info.intra_param_start_idx
     << ", intra_param_end_idx=" << info.intra_param_end_idx << "}";
}

namespace verify {
namespace {

using rc::Gen;
namespace gen = rc::gen;

// Largest r >= 1 with r^k <= n, for n >= 1.
int64_t RootFloor(int64_t n, int k) {
  int64_t lo = 1, hi = n;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo + 1) / 2;
    // mid^k <= n, tested without overflowing.
    int64_t p = 1;
    bool over = false;
    for (int i = 0; i < k && !over; ++i) {
      over = p > n / mid;
      if (!over) p *= mid;
    }
    if (over) {
      hi = mid - 1;
    } else {
      lo = mid;
    }
  }
  return lo;
}

// Rank 1..4, every dimension >= 1, numel <= max_numel.
Gen<std::vector<int64_t>> GenOrdinaryShape(int64_t max_numel) {
  return gen::mapcat(UniformInRange(1, 5), [max_numel](int rank) {
    return gen::container<std::vector<int64_t>>(
        rank, UniformInRange<int64_t>(1, RootFloor(max_numel, rank) + 1));
  });
}

// Rank 1..2 with numel in (max_numel / 4, max_numel]: the shapes that drive
// totals towards kMaxParams * max_numel.
Gen<std::vector<int64_t>> GenHugeShape(int64_t max_numel) {
  return gen::mapcat(UniformInRange(1, 3), [max_numel](int rank) {
    const int64_t cap = RootFloor(max_numel, rank);
    return gen::container<std::vector<int64_t>>(
        rank, UniformInRange<int64_t>(cap / 2 + 1, cap + 1));
  });
}

Gen<std::vector<int64_t>> GenTinyShape() {
  return gen::oneOf(
      gen::container<std::vector<int64_t>>(1, UniformInRange<int64_t>(1, 9)),
      gen::container<std::vector<int64_t>>(2, UniformInRange<int64_t>(1, 3)),
      gen::container<std::vector<int64_t>>(3, UniformInRange<int64_t>(1, 3)));
}

Gen<std::vector<int64_t>> GenZeroSizeShape(int64_t max_numel) {
  return gen::mapcat(
      GenOrdinaryShape(max_numel), [](std::vector<int64_t> shape) {
        const int rank = static_cast<int>(shape.size());
        return gen::map(UniformInRange(0, rank), [shape](int pos) {
          std::vector<int64_t> zeroed = shape;
          zeroed[pos] = 0;
          return zeroed;
        });
      });
}

Gen<std::vector<int64_t>> GenNonZeroShape(Scale scale) {
  if (scale == Scale::kData) return GenOrdinaryShape(kMaxDataParamNumel);
  // Metadata scale mixes small, medium and huge so that shard boundaries
  // still fall inside parameters often at large world sizes.
  return gen::weightedOneOf<std::vector<int64_t>>({
      {2, GenOrdinaryShape(kMaxDataParamNumel)},
      {1, GenOrdinaryShape(int64_t{1} << 20)},
      {2, GenOrdinaryShape(kMaxMetadataParamNumel)},
      {1, GenHugeShape(kMaxMetadataParamNumel)},
  });
}

const char* const kFlatModules[] = {
    "",
    "embed",
    "layers.0.attn",
    "layers.1.attn",
    "layers.10.attn",
    "layers.1.mlp",
    "layers.1",
    "norm",
    "attn_norm",
    "head",
};
const char* const kLeaves[] = {"weight", "bias", "w", "scale"};
// Module names by depth: depth 0, then deeper levels. "1"/"10" and
// "attn"/"attn_norm" are string prefixes of each other but not module
// prefixes; the path generator favours them (indices 1 and 2).
const char* const kTopModules[] = {"embed",  "attn", "attn_norm",
                                   "layers", "head", "norm"};
const char* const kSubModules[] = {"0", "1", "10", "attn", "attn_norm", "mlp"};
constexpr int kNumFlatModules = sizeof(kFlatModules) / sizeof(kFlatModules[0]);
constexpr int kNumLeaves = sizeof(kLeaves) / sizeof(kLeaves[0]);

std::string JoinFqn(const std::string& module, const std::string& leaf) {
  return module.empty() ? leaf : absl::StrCat(module, ".", leaf);
}

// One parameter before names and ties are resolved against the others.
struct RawParam {
  std::vector<int64_t> shape;
  // A module path: an index into kFlatModules for flat lists; indices into
  // kTopModules / kSubModules per level for models.
  std::vector<int> module;
  int leaf = 0;
  bool tied = false;
  uint32_t tie_pick = 0;
  bool requires_grad = true;
};

Gen<RawParam> GenRawParam(Scale scale, Gen<std::vector<int>> module) {
  return gen::build<RawParam>(
      gen::set(&RawParam::shape, GenShape(scale)),
      gen::set(&RawParam::module, std::move(module)),
      gen::set(&RawParam::leaf, UniformInRange(0, kNumLeaves)),
      gen::set(&RawParam::tied,
               gen::weightedElement<bool>({{4, false}, {1, true}})),
      gen::set(&RawParam::tie_pick,
               gen::resize(100, gen::arbitrary<uint32_t>())),
      gen::set(&RawParam::requires_grad,
               gen::weightedElement<bool>({{9, true}, {1, false}})));
}

// 1..kMaxParams raw parameters; the first is generated apart so that the
// list is never empty and still shrinks by removing elements.
Gen<std::vector<RawParam>> GenRawParamList(Scale scale,
                                           Gen<std::vector<int>> module) {
  const Gen<RawParam> raw = GenRawParam(scale, std::move(module));
  return gen::apply(
      [](RawParam first, std::vector<RawParam> rest) {
        rest.insert(rest.begin(), std::move(first));
        if (rest.size() > static_cast<size_t>(kMaxParams)) {
          rest.resize(kMaxParams);
        }
        return rest;
      },
      raw, gen::scale(0.25, gen::container<std::vector<RawParam>>(raw)));
}

Gen<std::vector<RawParam>> GenRawParams(Scale scale,
                                        Gen<std::vector<int>> module) {
  if (scale == Scale::kData) return GenRawParamList(scale, std::move(module));
  // A third of the metadata-scale lists are small throughout, so that world
  // sizes often exceed the numel and ranks end up holding only padding.
  return gen::weightedOneOf<std::vector<RawParam>>({
      {1, GenRawParamList(Scale::kData, module)},
      {2, GenRawParamList(Scale::kMetadata, module)},
  });
}

// A unique fqn for `raw[i]` in `module`: the leaf name, with the index
// appended when another parameter of the list already took that name.
std::string UniqueFqn(const std::string& module, const RawParam& raw, size_t i,
                      std::set<std::string>* used) {
  std::string fqn = JoinFqn(module, kLeaves[raw.leaf]);
  if (!used->insert(fqn).second) {
    fqn = JoinFqn(module, absl::StrCat(kLeaves[raw.leaf], i));
    used->insert(fqn);
  }
  return fqn;
}

}  // namespace

Gen<DType> GenDType() {
  return gen::element(DType::kFloat32, DType::kFloat64, DType::kFloat16,
                      DType::kBFloat16)
      .as("dtype");
}

Gen<DType> GenNonFloatingDType() {
  return gen::element(DType::kInt8, DType::kUInt8, DType::kInt16, DType::kInt32,
                      DType::kInt64, DType::kBool)
      .as("non-floating dtype");
}

Gen<int64_t> GenWorldSize() {
  static const std::vector<int64_t> kPrimes = {
      2, 3, 5, 7, 11, 13, 17, 31, 61, 127, 257, 509, 1021, 2039, 4093};
  return gen::weightedOneOf<int64_t>(
             {
                 {4, UniformInRange<int64_t>(1, 9)},
                 {3, gen::map(UniformInRange(0, 13),
                              [](int k) { return int64_t{1} << k; })},
                 {2, gen::elementOf(kPrimes)},
                 {1, UniformInRange<int64_t>(1, kMaxWorldSize + 1)},
             })
      .as("world size");
}

Gen<ShardingStrategy> GenShardingStrategy() {
  return gen::weightedElement<ShardingStrategy>(
             {
                 {4, ShardingStrategy::kFullShard},
                 {1, ShardingStrategy::kShardGradOp},
                 {2, ShardingStrategy::kNoShard},
                 {1, ShardingStrategy::kHybridShard},
                 {1, ShardingStrategy::kHybridShardZero2},
             })
      .as("sharding strategy");
}

Gen<std::vector<int64_t>> GenShape(Scale scale) {
  const int64_t max_numel =
      scale == Scale::kData ? kMaxDataParamNumel : kMaxMetadataParamNumel;
  return gen::weightedOneOf<std::vector<int64_t>>(
             {
                 {2, gen::just(std::vector<int64_t>{})},
                 {1, GenZeroSizeShape(max_numel)},
                 {3, GenTinyShape()},
                 {4, GenNonZeroShape(scale)},
             })
      .as(scale == Scale::kData ? "shape (data-sized)" : "shape");
}

Gen<std::vector<ParamSpec>> GenParamSpecs(DType dtype, Scale scale) {
  const Gen<std::vector<int>> module =
      gen::container<std::vector<int>>(1, UniformInRange(0, kNumFlatModules));
  return gen::map(GenRawParams(scale, module),
                  [dtype](const std::vector<RawParam>& raw) {
                    std::vector<ParamSpec> specs;
                    std::set<std::string> used;
                    for (size_t i = 0; i < raw.size(); ++i) {
                      ParamSpec p;
                      p.fqn = UniqueFqn(kFlatModules[raw[i].module[0]], raw[i],
                                        i, &used);
                      p.shape = raw[i].shape;
                      p.dtype = dtype;
                      p.requires_grad = raw[i].requires_grad;
                      if (raw[i].tied && i > 0) {
                        const ParamSpec& prim = specs[raw[i].tie_pick % i];
                        p.tied_to = prim.fqn;
                        p.shape = prim.shape;  // Ties copy shapes.
                      }
                      specs.push_back(std::move(p));
                    }
                    return specs;
                  })
      .as(scale == Scale::kData ? "param specs (data-sized)" : "param specs");
}

Gen<std::vector<ParamSpec>> GenParamSpecs(Scale scale) {
  return gen::mapcat(
             GenDType(),
             [scale](DType dtype) { return GenParamSpecs(dtype, scale); })
      .as(scale == Scale::kData ? "param specs (data-sized)" : "param specs");
}

Gen<LayoutOptions> GenLayoutOptions() {
  return gen::build<LayoutOptions>(
             gen::set(&LayoutOptions::world_size, GenWorldSize()),
             gen::set(&LayoutOptions::strategy, GenShardingStrategy()),
             gen::set(&LayoutOptions::align_addresses, gen::arbitrary<bool>()),
             gen::set(&LayoutOptions::compute_dtype,
                      gen::weightedOneOf<std::optional<DType>>({
                          {3, gen::just(std::optional<DType>())},
                          {1, gen::map(GenDType(),
                                       [](DType d) {
                                         return std::optional<DType>(d);
                                       })},
                      })))
      .as("layout options");
}

Gen<ModelSpec> GenModelSpec(Scale scale) {
  const Gen<std::vector<int>> module_path = gen::mapcat(
      gen::weightedElement<int>({{1, 0}, {2, 1}, {3, 2}, {3, 3}}),
      [](int depth) {
        return gen::container<std::vector<int>>(
            depth, gen::weightedElement<int>(
                       {{1, 0}, {3, 1}, {3, 2}, {2, 3}, {1, 4}, {1, 5}}));
      });
  return gen::apply(
             [](DType dtype, std::vector<RawParam> raw,
                const std::vector<uint32_t>& wrap_picks) {
               // Module pre-order with children in vocabulary order: a
               // module's own parameters come before its children's.
               std::stable_sort(raw.begin(), raw.end(),
                                [](const RawParam& a, const RawParam& b) {
                                  return a.module < b.module;
                                });
               auto module_name = [](const std::vector<int>& path, size_t len) {
                 std::vector<std::string> parts;
                 for (size_t d = 0; d < len; ++d) {
                   parts.push_back(d == 0 ? kTopModules[path[d]]
                                          : kSubModules[path[d]]);
                 }
                 return absl::StrJoin(parts, ".");
               };
               // Every module holding a parameter, in pre-order.
               std::vector<std::vector<int>> modules;
               for (const RawParam& r : raw) {
                 for (size_t len = 1; len <= r.module.size(); ++len) {
                   std::vector<int> m(r.module.begin(), r.module.begin() + len);
                   if (std::find(modules.begin(), modules.end(), m) ==
                       modules.end()) {
                     modules.push_back(std::move(m));
                   }
                 }
               }
               ModelSpec spec;
               spec.name = "model";
               std::vector<std::vector<int>> wrapped;
               for (uint32_t pick : wrap_picks) {
                 if (modules.empty()) break;
                 const std::vector<int>& m = modules[pick % modules.size()];
                 if (std::find(wrapped.begin(), wrapped.end(), m) !=
                     wrapped.end()) {
                   continue;
                 }
                 wrapped.push_back(m);
                 spec.wrap.push_back(module_name(m, m.size()));
               }
               // The unit of a module path: its longest wrapped prefix.
               auto unit_of = [&wrapped](const std::vector<int>& path) {
                 std::vector<int> best;
                 for (const std::vector<int>& w : wrapped) {
                   if (w.size() <= path.size() && w.size() > best.size() &&
                       std::equal(w.begin(), w.end(), path.begin())) {
                     best = w;
                   }
                 }
                 return best;
               };
               std::set<std::string> used;
               std::vector<std::vector<int>> units;
               for (size_t i = 0; i < raw.size(); ++i) {
                 ParamSpec p;
                 p.fqn =
                     UniqueFqn(module_name(raw[i].module, raw[i].module.size()),
                               raw[i], i, &used);
                 p.shape = raw[i].shape;
                 p.dtype = dtype;
                 p.requires_grad = raw[i].requires_grad;
                 units.push_back(unit_of(raw[i].module));
                 if (raw[i].tied) {
                   std::vector<size_t> same_unit;
                   for (size_t j = 0; j < i; ++j) {
                     if (units[j] == units[i]) same_unit.push_back(j);
                   }
                   if (!same_unit.empty()) {
                     const ParamSpec& prim =
                         spec.params[same_unit[raw[i].tie_pick %
                                               same_unit.size()]];
                     p.tied_to = prim.fqn;
                     p.shape = prim.shape;
                   }
                 }
                 spec.params.push_back(std::move(p));
               }
               return spec;
             },
             GenDType(), GenRawParams(scale, module_path),
             gen::mapcat(gen::weightedElement<int>(
                             {{1, 0}, {2, 1}, {2, 2}, {2, 3}, {1, 4}, {1, 6}}),
                         [](int count) {
                           return gen::container<std::vector<uint32_t>>(
                               count,
                               gen::resize(100, gen::arbitrary<uint32_t>()));
                         }))
      .as(scale == Scale::kData ? "model spec (data-sized)" : "model spec");
}

void FitRequiresGrad(const LayoutOptions& options,
                     std::vector<ParamSpec>* specs) {
  if (options.align_addresses || specs->empty()) return;
  for (ParamSpec& p : *specs) p.requires_grad = specs->front().requires_grad;
}

void FitRequiresGrad(const LayoutOptions& options, ModelSpec* spec) {
  if (options.align_addresses) return;
  std::map<std::string, bool> first;  // unit -> its first parameter's flag
  for (ParamSpec& p : spec->params) {
    const auto [it, inserted] =
        first.emplace(OwningUnit(p.fqn, spec->wrap), p.requires_grad);
    p.requires_grad = it->second;
  }
}

int64_t UntiedNumel(absl::Span<const ParamSpec> specs) {
  int64_t total = 0;
  for (const ParamSpec& p : specs) {
    if (p.tied_to.empty()) total += NumElements(p.shape);
  }
  return total;
}

}  // namespace verify
}  // namespace flatparam
