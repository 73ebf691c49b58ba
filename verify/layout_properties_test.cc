// Property suite for the layout, sharding and flattening core
// (flatparam/layout.h, flatten.h, model_layout.h).
//
// The central property compares FlatParamLayout with a reference written
// here from the PyTorch source (shared/reference/flat_param.py:
// `_init_flat_param_and_metadata`, `_get_unpadded_shard` on `torch.chunk`,
// `_get_shard_metadata`, `shard_metadata`) in the most direct form, sharing
// no code with the production implementation. The other properties state
// the invariants the issue lists: tiling, ownership, padding bounds, bitwise
// round trips, views, model wrapping and error reporting.
//
// Metadata-only properties use numels up to ~2^40 and must not allocate per
// element; properties that move data use data-sized generators.
//
// A failure prints the seed and the shrunk case; rerun one property with
//   RC_PARAMS="reproduce=<string printed on failure>"
//   bazel-bin/verify/layout_properties_test
//   --gtest_filter=LayoutProperties.AgreesWithReference
#include <gtest/gtest.h>
#include <rapidcheck.h>
#include <rapidcheck/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "flatparam/base/dtype.h"
#include "flatparam/base/splitmix64.h"
#include "flatparam/flatten.h"
#include "flatparam/layout.h"
#include "flatparam/model_layout.h"
#include "verify/generators.h"

namespace flatparam {
namespace {

namespace gen = rc::gen;
using verify::Scale;

// Fails the property with both values shown when they differ. Cheaper than
// RC_ASSERT(a == b) inside loops over thousands of ranks, and says where.
#define ASSERT_SAME(got, want, ...)                                        \
  do {                                                                     \
    const auto& got_value = (got);                                         \
    const auto& want_value = (want);                                       \
    if (!(got_value == want_value)) {                                      \
      RC_FAIL(absl::StrCat(__VA_ARGS__, ": got ", rc::toString(got_value), \
                           ", want ", rc::toString(want_value)));          \
    }                                                                      \
  } while (false)

int64_t NumShards(const FlatParamLayout& layout) {
  return UsesShardedStrategy(layout.options().strategy) ? layout.world_size()
                                                        : 1;
}

// ---------------------------------------------------------------------------
// The reference.
// ---------------------------------------------------------------------------
namespace ref {

constexpr int kPadding = -1;

// One entry of PyTorch's `_numels_with_padding`.
struct Segment {
  int param;  // Index into Layout::params, or kPadding.
  int64_t numel;
};

struct Param {
  std::string fqn;
  std::string module_name;
  std::string param_name;
  std::vector<int64_t> shape;
  int64_t numel = 0;
  bool requires_grad = true;
  int64_t offset = 0;
};

struct Layout {
  int64_t aligned_numel = 0;
  bool requires_grad = false;
  std::vector<Param> params;
  std::vector<SharedParamInfo> shared;
  std::vector<Segment> segments;
  int64_t total = 0;         // Numel as flattened (with alignment padding).
  int64_t num_shards = 1;    // 1 for NO_SHARD.
  int64_t shard_numel = 0;   // Numel of every rank's shard.
  int64_t padded_total = 0;  // num_shards * shard_numel.
  // Per shard: [start, end] inclusive in the padded flat parameter and the
  // zeros appended.
  std::vector<ShardInterval> intervals;
};

// PyTorch's `ParamInfo(param_name, module, module_name)` from an fqn.
std::pair<std::string, std::string> SplitFqn(const std::string& fqn) {
  std::vector<std::string> parts = absl::StrSplit(fqn, '.');
  const std::string leaf = parts.back();
  parts.pop_back();
  return {absl::StrJoin(parts, "."), leaf};
}

// The smallest pad that makes `total` a multiple of `multiple`.
int64_t PadToMultiple(int64_t total, int64_t multiple) {
  return (multiple - total % multiple) % multiple;
}

// `torch.flatten(t).chunk(world_size)`: chunks of ceil(n / w) elements laid
// end to end; there may be fewer than w of them. Returns [begin, end).
std::vector<std::pair<int64_t, int64_t>> TorchChunk(int64_t n, int64_t w) {
  const int64_t size = (n + w - 1) / w;
  std::vector<std::pair<int64_t, int64_t>> chunks;
  for (int64_t b = 0; b < n; b += size) {
    chunks.emplace_back(b, std::min(n, b + size));
  }
  return chunks;
}

// REQUIRES: the specs are valid and have at least one element.
Layout Build(const std::vector<ParamSpec>& specs,
             const LayoutOptions& options) {
  Layout l;
  const DType dtype = specs.front().dtype;  // The first spec is never tied.
  if (options.align_addresses) {
    l.aligned_numel =
        16 /
        static_cast<int64_t>(DTypeSize(options.compute_dtype.value_or(dtype)));
  }
  std::map<std::string, int> flat_index;  // fqn -> index into l.params
  std::map<std::string, std::string> primary_fqn;
  for (const ParamSpec& s : specs) {
    const auto [module_name, param_name] = SplitFqn(s.fqn);
    if (!s.tied_to.empty()) {
      // A shared parameter names the primary it was first seen as.
      const std::string prim = primary_fqn.at(s.tied_to);
      primary_fqn[s.fqn] = prim;
      const auto [prim_module, prim_param] = SplitFqn(prim);
      l.shared.push_back({s.fqn, module_name, param_name, prim, prim_module,
                          prim_param, flat_index.at(prim)});
      continue;
    }
    primary_fqn[s.fqn] = s.fqn;
    if (l.aligned_numel > 0) {
      const int64_t pad = PadToMultiple(l.total, l.aligned_numel);
      if (pad > 0) {
        l.segments.push_back({kPadding, pad});
        l.total += pad;
      }
    }
    Param p;
    p.fqn = s.fqn;
    p.module_name = module_name;
    p.param_name = param_name;
    p.shape = s.shape;
    p.numel = 1;
    for (int64_t d : s.shape) p.numel *= d;
    p.requires_grad = s.requires_grad;
    p.offset = l.total;
    l.requires_grad = l.requires_grad || s.requires_grad;
    flat_index[s.fqn] = static_cast<int>(l.params.size());
    l.segments.push_back({static_cast<int>(l.params.size()), p.numel});
    l.total += p.numel;
    l.params.push_back(std::move(p));
  }
  if (l.aligned_numel > 0) {
    const int64_t pad = PadToMultiple(l.total, options.world_size);
    if (pad > 0) {
      l.segments.push_back({kPadding, pad});
      l.total += pad;
    }
  }
  if (!UsesShardedStrategy(options.strategy)) {
    // `_init_shard_metadata(0, 0, flat_param.numel() - 1)` on every rank.
    l.num_shards = 1;
    l.shard_numel = l.total;
    l.intervals.push_back({0, l.total - 1, 0});
  } else {
    // `_get_shard`: rank r takes chunks[r] (or nothing) and pads to the size
    // of chunks[0]; `shard()` then gives it [numel * r, numel * (r + 1) - 1].
    const auto chunks = TorchChunk(l.total, options.world_size);
    l.num_shards = options.world_size;
    l.shard_numel = chunks[0].second - chunks[0].first;
    for (int64_t r = 0; r < options.world_size; ++r) {
      const int64_t mine = r < static_cast<int64_t>(chunks.size())
                               ? chunks[r].second - chunks[r].first
                               : 0;
      l.intervals.push_back({l.shard_numel * r, l.shard_numel * (r + 1) - 1,
                             l.shard_numel - mine});
    }
  }
  l.padded_total = l.num_shards * l.shard_numel;
  return l;
}

// Shard infos by interval arithmetic on half-open ranges: any size.
std::vector<ShardParamInfo> InfosByIntervals(const Layout& l, int64_t shard) {
  const int64_t lo = l.intervals[shard].start;
  const int64_t hi = l.intervals[shard].end_inclusive + 1;
  std::vector<ShardParamInfo> infos(l.params.size());
  for (size_t i = 0; i < l.params.size(); ++i) {
    const Param& p = l.params[i];
    ShardParamInfo& info = infos[i];
    if (p.numel == 0) {
      // PyTorch's test `start <= offset - 1 && end >= offset` (inclusive
      // ends): a zero-numel parameter is "in" a shard that holds both the
      // element before it and the position where it sits.
      if (lo <= p.offset - 1 && p.offset <= hi - 1) {
        info = {true, p.offset - lo, 0, 0, -1};
      }
      continue;
    }
    const int64_t b = std::max(lo, p.offset);
    const int64_t e = std::min(hi, p.offset + p.numel);
    if (b >= e) continue;
    info = {true, b - lo, e - b, b - p.offset, e - 1 - p.offset};
  }
  return infos;
}

// Which parameter element sits at each position of the padded flat
// parameter: data-sized layouts only.
struct Elements {
  std::vector<int> param;        // kPadding for padding of either kind.
  std::vector<int64_t> element;  // Index within the parameter.
};

Elements ExpandElements(const Layout& l) {
  Elements e;
  e.param.assign(l.padded_total, kPadding);
  e.element.assign(l.padded_total, -1);
  int64_t pos = 0;
  for (const Segment& s : l.segments) {
    for (int64_t k = 0; k < s.numel; ++k, ++pos) {
      e.param[pos] = s.param;
      e.element[pos] = s.param == kPadding ? -1 : k;
    }
  }
  return e;
}

// Shard infos by walking the shard's elements one by one.
std::vector<ShardParamInfo> InfosByElementScan(const Layout& l,
                                               const Elements& e,
                                               int64_t shard) {
  const int64_t lo = l.intervals[shard].start;
  const int64_t hi = l.intervals[shard].end_inclusive + 1;
  std::vector<ShardParamInfo> infos(l.params.size());
  for (int64_t pos = lo; pos < hi; ++pos) {
    const int p = e.param[pos];
    if (p == kPadding) continue;
    ShardParamInfo& info = infos[p];
    if (!info.in_shard) {
      info.in_shard = true;
      info.offset_in_shard = pos - lo;
      info.intra_param_start_idx = e.element[pos];
    }
    ++info.numel_in_shard;
    info.intra_param_end_idx = e.element[pos];
  }
  for (size_t i = 0; i < l.params.size(); ++i) {
    const int64_t at = l.params[i].offset;
    if (l.params[i].numel == 0 && lo <= at - 1 && at <= hi - 1) {
      infos[i] = {true, at - lo, 0, 0, -1};  // See InfosByIntervals.
    }
  }
  return infos;
}

}  // namespace ref

// Compares every field of `got` with the reference; `want_infos(shard)`
// gives the reference shard infos of a shard.
template <typename InfoFn>
void CheckAgainstReference(const FlatParamLayout& got, const ref::Layout& want,
                           InfoFn want_infos) {
  ASSERT_SAME(got.aligned_numel(), want.aligned_numel, "aligned_numel");
  ASSERT_SAME(got.requires_grad(), want.requires_grad, "requires_grad");
  ASSERT_SAME(got.params().size(), want.params.size(), "number of params");
  for (size_t i = 0; i < want.params.size(); ++i) {
    const ParamInfo& g = got.params()[i];
    const ref::Param& w = want.params[i];
    ASSERT_SAME(g.fqn, w.fqn, "params[", i, "].fqn");
    ASSERT_SAME(g.module_name, w.module_name, "params[", i, "].module_name");
    ASSERT_SAME(g.param_name, w.param_name, "params[", i, "].param_name");
    ASSERT_SAME(g.shape, w.shape, "params[", i, "].shape");
    ASSERT_SAME(g.numel, w.numel, "params[", i, "].numel");
    ASSERT_SAME(g.requires_grad, w.requires_grad, "params[", i,
                "].requires_grad");
    ASSERT_SAME(g.offset, w.offset, "params[", i, "].offset");
  }
  ASSERT_SAME(got.shared_params().size(), want.shared.size(),
              "number of shared params");
  for (size_t i = 0; i < want.shared.size(); ++i) {
    const SharedParamInfo& g = got.shared_params()[i];
    const SharedParamInfo& w = want.shared[i];
    ASSERT_SAME(g.fqn, w.fqn, "shared[", i, "].fqn");
    ASSERT_SAME(g.module_name, w.module_name, "shared[", i, "].module_name");
    ASSERT_SAME(g.param_name, w.param_name, "shared[", i, "].param_name");
    ASSERT_SAME(g.prim_fqn, w.prim_fqn, "shared[", i, "].prim_fqn");
    ASSERT_SAME(g.prim_module_name, w.prim_module_name, "shared[", i,
                "].prim_module_name");
    ASSERT_SAME(g.prim_param_name, w.prim_param_name, "shared[", i,
                "].prim_param_name");
    ASSERT_SAME(g.prim_index, w.prim_index, "shared[", i, "].prim_index");
  }
  std::vector<int64_t> numels;
  std::vector<bool> mask;
  std::vector<std::pair<int64_t, int64_t>> offsets;
  int64_t start = 0;
  for (const ref::Segment& s : want.segments) {
    numels.push_back(s.numel);
    mask.push_back(s.param == ref::kPadding);
    offsets.emplace_back(start, start + s.numel - 1);
    start += s.numel;
  }
  ASSERT_SAME(got.numels_with_padding(), numels, "numels_with_padding");
  ASSERT_SAME(got.is_padding_mask(), mask, "is_padding_mask");
  ASSERT_SAME(got.flat_param_offsets(), offsets, "flat_param_offsets");
  ASSERT_SAME(got.unpadded_unsharded_numel(), want.total,
              "unpadded_unsharded_numel");
  ASSERT_SAME(got.sharded_numel(), want.shard_numel, "sharded_numel");
  ASSERT_SAME(got.padded_unsharded_numel(), want.padded_total,
              "padded_unsharded_numel");
  int64_t param_numel = 0;
  for (const ref::Param& p : want.params) param_numel += p.numel;
  ASSERT_SAME(got.param_numel(), param_numel, "param_numel");

  for (int64_t r = 0; r < got.world_size(); ++r) {
    // NO_SHARD: every rank holds the one shard.
    const int64_t shard = want.num_shards == 1 ? 0 : r;
    const ShardInterval& wiv = want.intervals[shard];
    const ShardInterval giv = got.shard_interval(r);
    ASSERT_SAME(giv.start, wiv.start, "rank ", r, " interval start");
    ASSERT_SAME(giv.end_inclusive, wiv.end_inclusive, "rank ", r,
                " interval end");
    ASSERT_SAME(giv.numel_padded, wiv.numel_padded, "rank ", r,
                " numel_padded");
    const std::vector<ShardParamInfo> winfos = want_infos(shard);
    const std::vector<ShardParamInfo> ginfos = got.shard_param_infos(r);
    ASSERT_SAME(ginfos.size(), winfos.size(), "rank ", r, " info count");
    FlatParamShardMetadata wmd;
    for (size_t i = 0; i < winfos.size(); ++i) {
      ASSERT_SAME(ginfos[i], winfos[i], "rank ", r, " shard_param_infos[", i,
                  "] (", want.params[i].fqn, ")");
      ASSERT_SAME(got.shard_param_info(r, static_cast<int>(i)), winfos[i],
                  "rank ", r, " shard_param_info(", i, ")");
      if (!winfos[i].in_shard) continue;
      wmd.param_names.push_back(want.params[i].fqn);
      wmd.param_shapes.push_back(want.params[i].shape);
      wmd.param_numels.push_back(want.params[i].numel);
      wmd.param_offsets.emplace_back(winfos[i].intra_param_start_idx,
                                     winfos[i].intra_param_end_idx);
    }
    const FlatParamShardMetadata gmd = got.shard_metadata(r);
    ASSERT_SAME(gmd.param_names, wmd.param_names, "rank ", r,
                " shard_metadata names");
    ASSERT_SAME(gmd.param_shapes, wmd.param_shapes, "rank ", r,
                " shard_metadata shapes");
    ASSERT_SAME(gmd.param_numels, wmd.param_numels, "rank ", r,
                " shard_metadata numels");
    ASSERT_SAME(gmd.param_offsets, wmd.param_offsets, "rank ", r,
                " shard_metadata offsets");
  }
}

// ---------------------------------------------------------------------------
// Drawing cases.
// ---------------------------------------------------------------------------

// Labels the case so the printed distribution shows what was covered.
void Classify(const FlatParamLayout& layout) {
  const auto& mask = layout.is_padding_mask();
  const bool padding = std::find(mask.begin(), mask.end(), true) != mask.end();
  const bool sharded = UsesShardedStrategy(layout.options().strategy);
  // Ranks holding data are a prefix, so the last rank tells.
  const bool empty_ranks =
      sharded && layout.shard_interval(layout.world_size() - 1).numel_padded ==
                     layout.sharded_numel();
  bool zero_numel = false;
  for (const ParamInfo& p : layout.params()) zero_numel |= p.numel == 0;
  RC_CLASSIFY(padding, "padding");
  RC_CLASSIFY(empty_ranks, "empty ranks");
  RC_CLASSIFY(!layout.shared_params().empty(), "ties");
  RC_CLASSIFY(zero_numel, "zero-numel params");
  RC_CLASSIFY(layout.aligned_numel() > 0, "aligned");
}

// A layout FlatParamLayout accepts, with the specs and options it came
// from (flat parameters with no elements are discarded here: they have their
// own property).
struct DrawnLayout {
  std::vector<ParamSpec> specs;
  LayoutOptions options;
  FlatParamLayout layout;
};

DrawnLayout DrawLayout(Scale scale) {
  std::vector<ParamSpec> specs = *verify::GenParamSpecs(scale);
  const LayoutOptions options = *verify::GenLayoutOptions();
  verify::FitRequiresGrad(options, &specs);
  RC_PRE(verify::UntiedNumel(specs) > 0);
  absl::StatusOr<FlatParamLayout> layout =
      FlatParamLayout::Create("", specs, options);
  if (!layout.ok()) RC_FAIL(layout.status().ToString());
  Classify(*layout);
  return {std::move(specs), options, *std::move(layout)};
}

// A data-sized layout plus parameter tensors holding arbitrary bit patterns
// (NaNs, infinities and subnormals included: copies must be bitwise).
struct DataCase {
  FlatParamLayout layout;
  std::vector<HostTensor> params;

  std::vector<ConstBufferRef> refs() const {
    std::vector<ConstBufferRef> r;
    for (const HostTensor& t : params) r.push_back(t.cref());
    return r;
  }
  size_t elem() const { return DTypeSize(layout.dtype()); }
};

HostTensor Filled(DType dtype, const std::vector<int64_t>& shape,
                  uint64_t* state) {
  HostTensor t(dtype, shape);
  unsigned char* bytes = static_cast<unsigned char*>(t.data());
  for (size_t i = 0; i < t.nbytes(); ++i) {
    bytes[i] = static_cast<unsigned char>(SplitMix64Next(state));
  }
  return t;
}

DataCase DrawDataCase() {
  DataCase c{DrawLayout(Scale::kData).layout, {}};
  RC_TAG(std::string(DTypeName(c.layout.dtype())));
  uint64_t state = *gen::noShrink(gen::resize(100, gen::arbitrary<uint64_t>()))
                        .as("data seed");
  for (const ParamInfo& p : c.layout.params()) {
    c.params.push_back(Filled(c.layout.dtype(), p.shape, &state));
  }
  return c;
}

// Tensors like `like` filled with a 0xA5 sentinel.
std::vector<HostTensor> Sentinels(const std::vector<HostTensor>& like) {
  std::vector<HostTensor> out;
  for (const HostTensor& t : like) {
    HostTensor s(t.dtype(), t.shape());
    if (s.nbytes() > 0) std::memset(s.data(), 0xA5, s.nbytes());
    out.push_back(std::move(s));
  }
  return out;
}

std::vector<BufferRef> MutableRefs(std::vector<HostTensor>& tensors) {
  std::vector<BufferRef> r;
  for (HostTensor& t : tensors) r.push_back(t.ref());
  return r;
}

const unsigned char* At(const void* base, int64_t index, size_t elem) {
  return static_cast<const unsigned char*>(base) + index * elem;
}

// Distance in bytes from `base` to `p`, for checking where views point.
int64_t ByteOffset(const void* p, const void* base) {
  return static_cast<const unsigned char*>(p) -
         static_cast<const unsigned char*>(base);
}

bool SameBytes(const void* a, const void* b, size_t n) {
  return n == 0 || std::memcmp(a, b, n) == 0;
}

bool AllBytes(const void* p, size_t n, unsigned char value) {
  const unsigned char* b = static_cast<const unsigned char*>(p);
  return std::all_of(b, b + n, [value](unsigned char c) { return c == value; });
}

// The bit pattern of 42.0 in `dtype`, written out rather than converted so
// that a broken conversion cannot hide here.
std::vector<unsigned char> FortyTwo(DType dtype) {
  std::vector<unsigned char> bytes(DTypeSize(dtype));
  switch (dtype) {
    case DType::kFloat32: {
      const uint32_t bits = 0x42280000u;
      std::memcpy(bytes.data(), &bits, 4);
      break;
    }
    case DType::kFloat64: {
      const uint64_t bits = 0x4045000000000000ull;
      std::memcpy(bytes.data(), &bits, 8);
      break;
    }
    case DType::kFloat16: {
      const uint16_t bits = 0x5140;
      std::memcpy(bytes.data(), &bits, 2);
      break;
    }
    case DType::kBFloat16: {
      const uint16_t bits = 0x4228;
      std::memcpy(bytes.data(), &bits, 2);
      break;
    }
    default:
      RC_FAIL("not a flattenable dtype");
  }
  return bytes;
}

HostTensor FlattenOrFail(const DataCase& c) {
  HostTensor flat =
      HostTensor::Flat(c.layout.dtype(), c.layout.unpadded_unsharded_numel());
  const absl::Status s = Flatten(c.layout, c.refs(), flat.ref());
  if (!s.ok()) RC_FAIL(s.ToString());
  return flat;
}

std::vector<HostTensor> CopyShardsOrFail(const DataCase& c,
                                         const HostTensor& flat) {
  std::vector<HostTensor> shards;
  for (int64_t r = 0; r < NumShards(c.layout); ++r) {
    shards.push_back(
        HostTensor::Flat(c.layout.dtype(), c.layout.sharded_numel()));
    const absl::Status s =
        CopyShard(c.layout, flat.cref(), r, shards.back().ref());
    if (!s.ok()) RC_FAIL(s.ToString());
  }
  return shards;
}

// Elements of the unsharded flat parameter in shard `r` (the rest is the
// shard's zero padding).
int64_t DataInShard(const FlatParamLayout& layout, int64_t r) {
  const ShardInterval iv = layout.shard_interval(r);
  return std::max<int64_t>(
      0, std::min(iv.end_inclusive + 1, layout.unpadded_unsharded_numel()) -
             iv.start);
}

// ---------------------------------------------------------------------------
// FlatParamLayout: metadata properties (numels up to ~2^40).
// ---------------------------------------------------------------------------

RC_GTEST_PROP(LayoutProperties, ShardIntervalsTilePaddedNumel, ()) {
  const FlatParamLayout layout = DrawLayout(Scale::kMetadata).layout;
  const int64_t n = layout.unpadded_unsharded_numel();
  const int64_t w = layout.world_size();
  RC_CLASSIFY(!UsesShardedStrategy(layout.options().strategy), "NO_SHARD");
  RC_CLASSIFY(w >= 1024, "world size >= 1024");
  RC_CLASSIFY(n >= (int64_t{1} << 32), "numel >= 2^32");
  const int64_t shard = layout.sharded_numel();
  const int64_t padded = layout.padded_unsharded_numel();
  if (UsesShardedStrategy(layout.options().strategy)) {
    ASSERT_SAME(shard, (n + w - 1) / w, "sharded_numel = ceil(N / W)");
    ASSERT_SAME(padded, shard * w, "padded_unsharded_numel");
    RC_ASSERT(padded - n < w);
    int64_t next = 0;
    for (int64_t r = 0; r < w; ++r) {
      const ShardInterval iv = layout.shard_interval(r);
      ASSERT_SAME(iv.start, next, "rank ", r, " starts where rank ", r - 1,
                  " ended");
      ASSERT_SAME(iv.end_inclusive - iv.start + 1, shard, "rank ", r,
                  " interval size");
      const int64_t data =
          std::max<int64_t>(0, std::min(iv.end_inclusive + 1, n) - iv.start);
      ASSERT_SAME(iv.numel_padded, shard - data, "rank ", r, " numel_padded");
      next = iv.end_inclusive + 1;
    }
    ASSERT_SAME(next, padded, "end of the last interval");
  } else {
    ASSERT_SAME(shard, n, "NO_SHARD sharded_numel");
    ASSERT_SAME(padded, n, "NO_SHARD padded_unsharded_numel");
    for (int64_t r : {int64_t{0}, w - 1}) {
      const ShardInterval iv = layout.shard_interval(r);
      ASSERT_SAME(iv.start, 0, "NO_SHARD rank ", r, " start");
      ASSERT_SAME(iv.end_inclusive, n - 1, "NO_SHARD rank ", r, " end");
      ASSERT_SAME(iv.numel_padded, 0, "NO_SHARD rank ", r, " numel_padded");
    }
  }
  // The bounds-checked accessors agree and reject ranks outside [0, W).
  const int64_t r = *verify::UniformInRange<int64_t>(0, w).as("rank");
  const absl::StatusOr<ShardInterval> checked = layout.ShardIntervalFor(r);
  RC_ASSERT(checked.ok());
  RC_ASSERT(checked->start == layout.shard_interval(r).start);
  for (int64_t bad : {int64_t{-1}, w}) {
    const absl::Status s = layout.CheckRank(bad);
    RC_ASSERT(s.code() == absl::StatusCode::kInvalidArgument);
    RC_ASSERT(absl::StrContains(s.message(), absl::StrCat(bad)));
  }
}

RC_GTEST_PROP(LayoutProperties, EveryElementOwnedByExactlyOneRank, ()) {
  // Run-level form: each parameter's elements are covered, in rank order, by
  // consecutive pieces, and each piece sits at the same flat position in the
  // shard as in the parameter.
  const FlatParamLayout layout = DrawLayout(Scale::kMetadata).layout;
  const int64_t shards = NumShards(layout);
  for (size_t i = 0; i < layout.params().size(); ++i) {
    const ParamInfo& p = layout.params()[i];
    int64_t covered = 0;  // Elements [0, covered) are owned so far.
    int owners_of_zero_numel = 0;
    for (int64_t r = 0; r < shards; ++r) {
      const ShardParamInfo info =
          layout.shard_param_info(r, static_cast<int>(i));
      if (!info.in_shard) continue;
      const ShardInterval iv = layout.shard_interval(r);
      if (p.numel == 0) {
        ++owners_of_zero_numel;
        ASSERT_SAME(info.numel_in_shard, 0, "zero-numel ", p.fqn, " rank ", r);
        continue;
      }
      RC_ASSERT(info.numel_in_shard > 0);
      ASSERT_SAME(info.intra_param_start_idx, covered, p.fqn, " rank ", r,
                  " continues where the previous rank stopped");
      ASSERT_SAME(info.intra_param_end_idx,
                  info.intra_param_start_idx + info.numel_in_shard - 1, p.fqn,
                  " rank ", r, " end index");
      ASSERT_SAME(iv.start + info.offset_in_shard,
                  p.offset + info.intra_param_start_idx, p.fqn, " rank ", r,
                  " flat position of the piece");
      RC_ASSERT(info.offset_in_shard + info.numel_in_shard <=
                layout.sharded_numel());
      covered += info.numel_in_shard;
    }
    ASSERT_SAME(covered, p.numel, p.fqn, " elements owned");
    RC_ASSERT(owners_of_zero_numel <= 1);
  }
}

RC_GTEST_PROP(LayoutProperties, AlignmentAndPaddingBounds, ()) {
  const FlatParamLayout layout = DrawLayout(Scale::kMetadata).layout;
  const std::vector<int64_t>& numels = layout.numels_with_padding();
  const std::vector<bool>& mask = layout.is_padding_mask();
  RC_ASSERT(numels.size() == mask.size());
  int64_t sum = 0;
  size_t next_param = 0;
  for (size_t s = 0; s < numels.size(); ++s) {
    if (!mask[s]) {
      RC_ASSERT(next_param < layout.params().size());
      ASSERT_SAME(numels[s], layout.params()[next_param].numel, "segment ", s);
      ASSERT_SAME(layout.params()[next_param].offset, sum, "offset of ",
                  layout.params()[next_param].fqn);
      ++next_param;
    }
    sum += numels[s];
  }
  ASSERT_SAME(next_param, layout.params().size(), "params in segments");
  ASSERT_SAME(sum, layout.unpadded_unsharded_numel(), "sum of segments");

  if (!layout.options().align_addresses) {
    ASSERT_SAME(layout.aligned_numel(), 0, "aligned_numel without alignment");
    RC_ASSERT(std::find(mask.begin(), mask.end(), true) == mask.end());
    return;
  }
  const DType compute = layout.options().compute_dtype.value_or(layout.dtype());
  const int64_t a = layout.aligned_numel();
  ASSERT_SAME(a * static_cast<int64_t>(DTypeSize(compute)), 16,
              "aligned_numel * sizeof(", DTypeName(compute), ")");
  RC_TAG(absl::StrCat("aligned_numel ", a));
  for (size_t s = 0; s < numels.size(); ++s) {
    if (!mask[s]) continue;
    RC_ASSERT(numels[s] > 0);
    if (s + 1 < numels.size()) {
      // Alignment padding: always directly before a parameter.
      RC_ASSERT(!mask[s + 1]);
      RC_ASSERT(numels[s] < a);
    } else {
      RC_ASSERT(numels[s] < layout.world_size());  // World-size padding.
    }
  }
  int64_t end_of_previous = 0;
  for (const ParamInfo& p : layout.params()) {
    ASSERT_SAME(p.offset % a, 0, p.fqn, " offset ", p.offset, " % ", a);
    RC_ASSERT(p.offset - end_of_previous >= 0);
    RC_ASSERT(p.offset - end_of_previous < a);
    end_of_previous = p.offset + p.numel;
  }
  ASSERT_SAME(layout.unpadded_unsharded_numel() % layout.world_size(), 0,
              "total % world_size");
}

RC_GTEST_PROP(LayoutProperties, AgreesWithReference, ()) {
  const DrawnLayout d = DrawLayout(Scale::kMetadata);
  const ref::Layout want = ref::Build(d.specs, d.options);
  CheckAgainstReference(d.layout, want, [&want](int64_t shard) {
    return ref::InfosByIntervals(want, shard);
  });
}

RC_GTEST_PROP(LayoutProperties, AgreesWithElementScanReference, ()) {
  // Data-sized, so the reference can lay out every element explicitly.
  const DrawnLayout d = DrawLayout(Scale::kData);
  const ref::Layout want = ref::Build(d.specs, d.options);
  const ref::Elements elements = ref::ExpandElements(want);
  CheckAgainstReference(d.layout, want, [&](int64_t shard) {
    return ref::InfosByElementScan(want, elements, shard);
  });
}

RC_GTEST_PROP(LayoutProperties, ZeroElementFlatParamIsRejected, ()) {
  std::vector<ParamSpec> specs = *verify::GenParamSpecs();
  for (ParamSpec& p : specs) {
    if (p.shape.empty()) {
      p.shape = {0};
    } else {
      p.shape[p.fqn.size() % p.shape.size()] = 0;
    }
  }
  const LayoutOptions options = *verify::GenLayoutOptions();
  verify::FitRequiresGrad(options, &specs);
  const std::string unit =
      *gen::element<std::string>("", "layers.3", "encoder.blocks.10")
           .as("unit");
  const absl::StatusOr<FlatParamLayout> layout =
      FlatParamLayout::Create(unit, specs, options);
  RC_ASSERT(layout.status().code() == absl::StatusCode::kInvalidArgument);
  RC_ASSERT(absl::StrContains(layout.status().message(), "no elements"));
  RC_ASSERT(absl::StrContains(layout.status().message(),
                              unit.empty() ? "<root>" : unit));
}

// ---------------------------------------------------------------------------
// Flattening and sharding data (data-sized, every dtype, bit for bit).
// ---------------------------------------------------------------------------

RC_GTEST_PROP(LayoutProperties, FlattenShardConcatUnflattenIsIdentity, ()) {
  const DataCase c = DrawDataCase();
  const HostTensor flat = FlattenOrFail(c);
  const std::vector<HostTensor> shards = CopyShardsOrFail(c, flat);
  std::vector<ConstBufferRef> shard_refs;
  for (const HostTensor& s : shards) shard_refs.push_back(s.cref());
  HostTensor gathered =
      HostTensor::Flat(c.layout.dtype(), c.layout.padded_unsharded_numel());
  const absl::Status concat =
      ConcatShards(c.layout, shard_refs, gathered.ref());
  if (!concat.ok()) RC_FAIL(concat.ToString());
  RC_ASSERT(SameBytes(gathered.data(), flat.data(), flat.nbytes()));

  std::vector<HostTensor> out = Sentinels(c.params);
  const absl::Status s = Unflatten(c.layout, gathered.cref(), MutableRefs(out));
  if (!s.ok()) RC_FAIL(s.ToString());
  for (size_t i = 0; i < out.size(); ++i) {
    RC_ASSERT(out[i] == c.params[i]);
  }
  // Unflatten takes the unpadded flat parameter as well.
  std::vector<HostTensor> out2 = Sentinels(c.params);
  const absl::Status s2 = Unflatten(c.layout, flat.cref(), MutableRefs(out2));
  if (!s2.ok()) RC_FAIL(s2.ToString());
  for (size_t i = 0; i < out2.size(); ++i) {
    RC_ASSERT(out2[i] == c.params[i]);
  }
}

RC_GTEST_PROP(LayoutProperties, FlattenPadsWith42AndShardingWithZeros, ()) {
  const DataCase c = DrawDataCase();
  const size_t elem = c.elem();
  const HostTensor flat = FlattenOrFail(c);
  const std::vector<unsigned char> forty_two = FortyTwo(c.layout.dtype());
  int64_t pos = 0;
  size_t param = 0;
  for (size_t s = 0; s < c.layout.numels_with_padding().size(); ++s) {
    const int64_t numel = c.layout.numels_with_padding()[s];
    if (c.layout.is_padding_mask()[s]) {
      for (int64_t k = 0; k < numel; ++k) {
        RC_ASSERT(
            SameBytes(At(flat.data(), pos + k, elem), forty_two.data(), elem));
      }
    } else {
      RC_ASSERT(SameBytes(At(flat.data(), pos, elem), c.params[param].data(),
                          numel * elem));
      ++param;
    }
    pos += numel;
  }
  const std::vector<HostTensor> shards = CopyShardsOrFail(c, flat);
  for (int64_t r = 0; r < NumShards(c.layout); ++r) {
    const int64_t data = DataInShard(c.layout, r);
    const ShardInterval iv = c.layout.shard_interval(r);
    RC_ASSERT(SameBytes(shards[r].data(), At(flat.data(), iv.start, elem),
                        data * elem));
    RC_ASSERT(AllBytes(At(shards[r].data(), data, elem),
                       (c.layout.sharded_numel() - data) * elem, 0));
  }
}

RC_GTEST_PROP(LayoutProperties, FlattenShardEqualsFlattenThenCopyShard, ()) {
  const DataCase c = DrawDataCase();
  const HostTensor flat = FlattenOrFail(c);
  const std::vector<HostTensor> shards = CopyShardsOrFail(c, flat);
  // CopyShard reads the padded unsharded flat parameter the same way.
  HostTensor padded =
      HostTensor::Flat(c.layout.dtype(), c.layout.padded_unsharded_numel());
  std::memcpy(padded.data(), flat.data(), flat.nbytes());
  for (int64_t r = 0; r < NumShards(c.layout); ++r) {
    HostTensor direct =
        HostTensor::Flat(c.layout.dtype(), c.layout.sharded_numel());
    std::memset(direct.data(), 0xA5, direct.nbytes());
    const absl::Status s = FlattenShard(c.layout, c.refs(), r, direct.ref());
    if (!s.ok()) RC_FAIL(s.ToString());
    ASSERT_SAME(direct == shards[r], true, "FlattenShard vs CopyShard, rank ",
                r);
    HostTensor from_padded =
        HostTensor::Flat(c.layout.dtype(), c.layout.sharded_numel());
    const absl::Status s2 =
        CopyShard(c.layout, padded.cref(), r, from_padded.ref());
    if (!s2.ok()) RC_FAIL(s2.ToString());
    ASSERT_SAME(from_padded == shards[r], true,
                "CopyShard of the padded flat parameter, rank ", r);
  }
}

RC_GTEST_PROP(LayoutProperties, ShardHoldsExactlyItsParamElements, ()) {
  // Element-level ownership: shard[offset_in_shard + k] ==
  // param[intra_param_start_idx + k], and every element of every parameter
  // is owned by exactly one rank.
  const DataCase c = DrawDataCase();
  const size_t elem = c.elem();
  const std::vector<HostTensor> shards = CopyShardsOrFail(c, FlattenOrFail(c));
  std::vector<std::vector<int>> owners;
  for (const HostTensor& p : c.params) owners.emplace_back(p.numel(), 0);
  for (int64_t r = 0; r < NumShards(c.layout); ++r) {
    const std::vector<ShardParamInfo> infos = c.layout.shard_param_infos(r);
    for (size_t i = 0; i < infos.size(); ++i) {
      if (!infos[i].in_shard) continue;
      for (int64_t k = 0; k < infos[i].numel_in_shard; ++k) {
        RC_ASSERT(infos[i].intra_param_start_idx + k < c.params[i].numel());
        RC_ASSERT(infos[i].offset_in_shard + k < c.layout.sharded_numel());
        if (!SameBytes(At(shards[r].data(), infos[i].offset_in_shard + k, elem),
                       At(c.params[i].data(),
                          infos[i].intra_param_start_idx + k, elem),
                       elem)) {
          RC_FAIL(absl::StrCat("rank ", r, " shard[", infos[i].offset_in_shard,
                               " + ", k, "] != ", c.layout.params()[i].fqn, "[",
                               infos[i].intra_param_start_idx, " + ", k, "]"));
        }
        ++owners[i][infos[i].intra_param_start_idx + k];
      }
    }
  }
  for (size_t i = 0; i < owners.size(); ++i) {
    for (size_t e = 0; e < owners[i].size(); ++e) {
      ASSERT_SAME(owners[i][e], 1, "owners of ", c.layout.params()[i].fqn, "[",
                  e, "]");
    }
  }
}

RC_GTEST_PROP(LayoutProperties, UnflattenShardOverAllRanksReconstructsParams,
              ()) {
  const DataCase c = DrawDataCase();
  const size_t elem = c.elem();
  const std::vector<HostTensor> shards = CopyShardsOrFail(c, FlattenOrFail(c));
  std::vector<HostTensor> out = Sentinels(c.params);
  for (int64_t r = 0; r < NumShards(c.layout); ++r) {
    const absl::Status s =
        UnflattenShard(c.layout, shards[r].cref(), r, MutableRefs(out));
    if (!s.ok()) RC_FAIL(s.ToString());
  }
  for (size_t i = 0; i < out.size(); ++i) {
    RC_ASSERT(out[i] == c.params[i]);
  }
  // One rank alone writes exactly its pieces and leaves the rest untouched.
  const int64_t q = *verify::UniformInRange<int64_t>(0, NumShards(c.layout))
                         .as("single rank");
  std::vector<HostTensor> one = Sentinels(c.params);
  const std::vector<HostTensor> untouched = Sentinels(c.params);
  const absl::Status s =
      UnflattenShard(c.layout, shards[q].cref(), q, MutableRefs(one));
  if (!s.ok()) RC_FAIL(s.ToString());
  for (size_t i = 0; i < one.size(); ++i) {
    const ShardParamInfo info =
        c.layout.shard_param_info(q, static_cast<int>(i));
    const int64_t b = info.in_shard ? info.intra_param_start_idx : 0;
    const int64_t e = info.in_shard ? b + info.numel_in_shard : 0;
    RC_ASSERT(SameBytes(one[i].data(), untouched[i].data(), b * elem));
    RC_ASSERT(SameBytes(At(one[i].data(), b, elem),
                        At(c.params[i].data(), b, elem), (e - b) * elem));
    RC_ASSERT(SameBytes(At(one[i].data(), e, elem),
                        At(untouched[i].data(), e, elem),
                        (one[i].numel() - e) * elem));
  }
}

RC_GTEST_PROP(LayoutProperties, ParamViewAndShardViewPointAtTheData, ()) {
  DataCase c = DrawDataCase();
  const size_t elem = c.elem();
  HostTensor flat = FlattenOrFail(c);
  for (int i = 0; i < static_cast<int>(c.params.size()); ++i) {
    const ParamInfo& p = c.layout.params()[i];
    const ConstBufferRef v = ParamView(c.layout, flat.cref(), i);
    RC_ASSERT(ByteOffset(v.data, flat.data()) == p.offset * int64_t(elem));
    RC_ASSERT(v.count == p.numel);
    RC_ASSERT(v.dtype == c.layout.dtype());
    RC_ASSERT(SameBytes(v.data, c.params[i].data(), p.numel * elem));
    const BufferRef mv = ParamView(c.layout, flat.ref(), i);
    RC_ASSERT(ByteOffset(mv.data, v.data) == 0);
    RC_ASSERT(mv.count == v.count);
  }
  std::vector<HostTensor> shards = CopyShardsOrFail(c, flat);
  for (int64_t r = 0; r < NumShards(c.layout); ++r) {
    for (int i = 0; i < static_cast<int>(c.params.size()); ++i) {
      const ShardParamInfo info = c.layout.shard_param_info(r, i);
      const ConstBufferRef v = ShardView(c.layout, shards[r].cref(), r, i);
      RC_ASSERT(v.dtype == c.layout.dtype());
      if (!info.in_shard) {
        ASSERT_SAME(v.count, 0, "ShardView of ", c.layout.params()[i].fqn,
                    " on rank ", r, " (not in shard)");
        continue;
      }
      RC_ASSERT(ByteOffset(v.data, shards[r].data()) ==
                info.offset_in_shard * int64_t(elem));
      ASSERT_SAME(v.count, info.numel_in_shard, "ShardView numel");
      RC_ASSERT(SameBytes(
          v.data, At(c.params[i].data(), info.intra_param_start_idx, elem),
          v.count * elem));
      const BufferRef mv = ShardView(c.layout, shards[r].ref(), r, i);
      RC_ASSERT(ByteOffset(mv.data, v.data) == 0);
      RC_ASSERT(mv.count == v.count);
    }
  }
}

// ---------------------------------------------------------------------------
// Errors a caller can cause.
// ---------------------------------------------------------------------------

// Indices of specs that are not tied.
std::vector<size_t> Untied(const std::vector<ParamSpec>& specs) {
  std::vector<size_t> out;
  for (size_t i = 0; i < specs.size(); ++i) {
    if (specs[i].tied_to.empty()) out.push_back(i);
  }
  return out;
}

void ExpectInvalidArgument(const absl::Status& status,
                           const std::vector<std::string>& mentions) {
  if (status.code() != absl::StatusCode::kInvalidArgument) {
    RC_FAIL(absl::StrCat("expected InvalidArgument, got ", status.ToString()));
  }
  for (const std::string& m : mentions) {
    if (!absl::StrContains(status.message(), m)) {
      RC_FAIL(
          absl::StrCat("error \"", status.message(), "\" does not name ", m));
    }
  }
}

RC_GTEST_PROP(LayoutErrors, IntegerDtypeIsRejected, ()) {
  std::vector<ParamSpec> specs = *verify::GenParamSpecs();
  const std::vector<size_t> untied = Untied(specs);
  const size_t k = *gen::elementOf(untied).as("integer parameter");
  const DType bad = *verify::GenNonFloatingDType();
  specs[k].dtype = bad;
  const LayoutOptions options = *verify::GenLayoutOptions();
  verify::FitRequiresGrad(options, &specs);
  ExpectInvalidArgument(
      FlatParamLayout::Create("", specs, options).status(),
      {absl::StrCat("\"", specs[k].fqn, "\""), std::string(DTypeName(bad))});
}

RC_GTEST_PROP(LayoutErrors, MixedDtypesAreRejected, ()) {
  std::vector<ParamSpec> specs = *verify::GenParamSpecs();
  const std::vector<size_t> untied = Untied(specs);
  RC_PRE(untied.size() >= 2);
  const size_t k =
      *gen::elementOf(std::vector<size_t>(untied.begin() + 1, untied.end()))
           .as("mixed-dtype parameter");
  const DType first = specs[untied[0]].dtype;
  const DType other = *gen::distinctFrom(verify::GenDType(), first);
  specs[k].dtype = other;
  const LayoutOptions options = *verify::GenLayoutOptions();
  verify::FitRequiresGrad(options, &specs);
  ExpectInvalidArgument(
      FlatParamLayout::Create("", specs, options).status(),
      {absl::StrCat("\"", specs[k].fqn, "\""), std::string(DTypeName(first)),
       std::string(DTypeName(other))});
}

// PyTorch's `_validate_tensors_to_flatten`: use_orig_params=False (here:
// unaligned layouts) needs one `requires_grad` for every parameter.
RC_GTEST_PROP(LayoutErrors, MixedRequiresGradNeedsAlignment, ()) {
  std::vector<ParamSpec> specs = *verify::GenParamSpecs();
  const std::vector<size_t> untied = Untied(specs);
  RC_PRE(untied.size() >= 2);
  for (ParamSpec& p : specs) p.requires_grad = specs[untied[0]].requires_grad;
  const size_t k =
      *gen::elementOf(std::vector<size_t>(untied.begin() + 1, untied.end()))
           .as("parameter with the other requires_grad");
  specs[k].requires_grad = !specs[k].requires_grad;
  LayoutOptions options = *verify::GenLayoutOptions();
  options.align_addresses = false;
  ExpectInvalidArgument(FlatParamLayout::Create("", specs, options).status(),
                        {"uniform `requires_grad`",
                         absl::StrCat("\"", specs[untied[0]].fqn, "\""),
                         absl::StrCat("\"", specs[k].fqn, "\"")});
  // The same parameters are fine for use_orig_params (aligned).
  options.align_addresses = true;
  RC_PRE(verify::UntiedNumel(specs) > 0);
  const absl::StatusOr<FlatParamLayout> aligned =
      FlatParamLayout::Create("", specs, options);
  if (!aligned.ok()) RC_FAIL(aligned.status().ToString());
  RC_ASSERT(aligned->requires_grad());
}

RC_GTEST_PROP(LayoutErrors, DuplicateNamesAreRejected, ()) {
  std::vector<ParamSpec> specs = *verify::GenParamSpecs();
  RC_PRE(specs.size() >= 2);
  const size_t j =
      *verify::UniformInRange<size_t>(1, specs.size()).as("duplicate");
  const size_t i = *verify::UniformInRange<size_t>(0, j).as("original");
  specs[j].fqn = specs[i].fqn;
  const LayoutOptions options = *verify::GenLayoutOptions();
  verify::FitRequiresGrad(options, &specs);
  const std::vector<std::string> mentions = {
      absl::StrCat("\"", specs[i].fqn, "\""), "duplicate"};
  ExpectInvalidArgument(FlatParamLayout::Create("", specs, options).status(),
                        mentions);
  ModelSpec model;
  model.name = "m";
  model.params = specs;
  ExpectInvalidArgument(ModelLayout::Create(model, options).status(), mentions);
}

RC_GTEST_PROP(LayoutErrors, WorldSizeBelowOneIsRejected, ()) {
  const std::vector<ParamSpec> specs = *verify::GenParamSpecs();
  LayoutOptions options = *verify::GenLayoutOptions();
  options.world_size =
      *gen::weightedOneOf<int64_t>(
           {{2, gen::just<int64_t>(0)},
            {1, gen::just<int64_t>(-1)},
            {1, verify::UniformInRange<int64_t>(-(int64_t{1} << 40), 0)}})
           .as("world size < 1");
  const std::vector<std::string> mentions = {"world_size",
                                             absl::StrCat(options.world_size)};
  ExpectInvalidArgument(FlatParamLayout::Create("", specs, options).status(),
                        mentions);
  ModelSpec model;
  model.name = "m";
  model.params = specs;
  ExpectInvalidArgument(ModelLayout::Create(model, options).status(), mentions);
}

// ---------------------------------------------------------------------------
// ModelLayout.
// ---------------------------------------------------------------------------

std::vector<std::string> Components(const std::string& dotted) {
  if (dotted.empty()) return {};
  return absl::StrSplit(dotted, '.');
}

// The module path of a parameter: its fqn without the last component.
std::vector<std::string> ModuleOf(const std::string& fqn) {
  std::vector<std::string> c = Components(fqn);
  c.pop_back();
  return c;
}

bool IsPrefix(const std::vector<std::string>& prefix,
              const std::vector<std::string>& path) {
  return prefix.size() <= path.size() &&
         std::equal(prefix.begin(), prefix.end(), path.begin());
}

// The unit owning `fqn`: the longest wrap prefix that is a module-path
// prefix of the parameter's module, compared component by component.
std::string ExpectedUnit(const std::string& fqn,
                         const std::vector<std::string>& wrap) {
  const std::vector<std::string> module = ModuleOf(fqn);
  std::string best;
  size_t best_depth = 0;
  for (const std::string& w : wrap) {
    const std::vector<std::string> wc = Components(w);
    if (IsPrefix(wc, module) && wc.size() > best_depth) {
      best = w;
      best_depth = wc.size();
    }
  }
  return best;
}

// Follows ties to the parameter that is flattened.
std::string RootPrimary(const ModelSpec& spec, std::string fqn) {
  for (;;) {
    const auto it =
        std::find_if(spec.params.begin(), spec.params.end(),
                     [&fqn](const ParamSpec& p) { return p.fqn == fqn; });
    if (it == spec.params.end() || it->tied_to.empty()) return fqn;
    fqn = it->tied_to;
  }
}

// Some unit would own no elements: ModelLayout must reject the model.
bool HasZeroElementUnit(const ModelSpec& spec) {
  std::map<std::string, int64_t> numel_of_unit;
  for (const ParamSpec& p : spec.params) {
    if (!p.tied_to.empty()) continue;
    numel_of_unit[ExpectedUnit(p.fqn, spec.wrap)] += NumElements(p.shape);
  }
  for (const auto& [unit, numel] : numel_of_unit) {
    if (numel == 0) return true;
  }
  return false;
}

void ClassifyModel(const ModelSpec& spec) {
  bool ties = false;
  // A wrap prefix that is a string prefix of an fqn without being its module
  // prefix ("layers.1" and "layers.10.w").
  bool string_prefix = false;
  std::map<std::string, int> owned;
  for (const ParamSpec& p : spec.params) {
    ties |= !p.tied_to.empty();
    ++owned[ExpectedUnit(p.fqn, spec.wrap)];
    for (const std::string& w : spec.wrap) {
      string_prefix |= absl::StartsWith(p.fqn, w) &&
                       !absl::StartsWith(p.fqn, absl::StrCat(w, "."));
    }
  }
  bool empty_unit = false;
  for (const std::string& w : spec.wrap) empty_unit |= owned.count(w) == 0;
  RC_CLASSIFY(spec.wrap.empty(), "no wrap prefixes");
  RC_CLASSIFY(spec.wrap.size() >= 3, ">= 3 wrap prefixes");
  RC_CLASSIFY(ties, "ties");
  RC_CLASSIFY(string_prefix, "string prefix, not module prefix");
  RC_CLASSIFY(empty_unit, "wrapped module owning nothing");
}

RC_GTEST_PROP(ModelProperties, EveryParamLandsInItsLongestWrapPrefixUnit, ()) {
  ModelSpec spec = *verify::GenModelSpec();
  const LayoutOptions options = *verify::GenLayoutOptions();
  verify::FitRequiresGrad(options, &spec);
  ClassifyModel(spec);
  const absl::StatusOr<ModelLayout> model = ModelLayout::Create(spec, options);
  if (HasZeroElementUnit(spec)) {
    RC_TAG("unit with zero elements");
    ExpectInvalidArgument(model.status(), {"no elements"});
    return;
  }
  if (!model.ok()) RC_FAIL(model.status().ToString());

  std::map<std::string, std::vector<std::string>> units_of;  // fqn -> units
  std::map<std::string, std::string> shared_prim;
  size_t flattened = 0, shared = 0;
  int64_t padded = 0, sharded = 0;
  for (const FlatParamLayout& f : model->flat_params()) {
    RC_ASSERT(!f.params().empty());
    for (const ParamInfo& p : f.params()) units_of[p.fqn].push_back(f.unit());
    for (const SharedParamInfo& s : f.shared_params()) {
      units_of[s.fqn].push_back(f.unit());
      shared_prim[s.fqn] = s.prim_fqn;
    }
    flattened += f.params().size();
    shared += f.shared_params().size();
    padded += f.padded_unsharded_numel();
    sharded += f.sharded_numel();
  }
  size_t tied = 0;
  for (const ParamSpec& p : spec.params) {
    const std::string unit = ExpectedUnit(p.fqn, spec.wrap);
    ASSERT_SAME(units_of[p.fqn], std::vector<std::string>{unit},
                "units holding ", p.fqn);
    if (!p.tied_to.empty()) {
      ++tied;
      ASSERT_SAME(shared_prim.count(p.fqn), 1u, p.fqn, " is shared");
      ASSERT_SAME(shared_prim[p.fqn], RootPrimary(spec, p.fqn), p.fqn,
                  " primary");
    }
  }
  ASSERT_SAME(flattened, spec.params.size() - tied, "flattened params");
  ASSERT_SAME(shared, tied, "shared params");
  ASSERT_SAME(model->param_numel(), verify::UntiedNumel(spec.params),
              "model param_numel");
  ASSERT_SAME(model->padded_unsharded_numel(), padded,
              "model padded_unsharded_numel");
  ASSERT_SAME(model->sharded_numel(), sharded, "model sharded_numel");
}

RC_GTEST_PROP(ModelProperties, UnitsAndParamsFollowTraversalOrder, ()) {
  ModelSpec spec = *verify::GenModelSpec();
  const LayoutOptions options = *verify::GenLayoutOptions();
  verify::FitRequiresGrad(options, &spec);
  RC_PRE(!HasZeroElementUnit(spec));
  ClassifyModel(spec);
  const absl::StatusOr<ModelLayout> model = ModelLayout::Create(spec, options);
  if (!model.ok()) RC_FAIL(model.status().ToString());

  // Module pre-order as the parameter list reveals it: ancestors outer
  // first, each module where it first appears.
  std::vector<std::string> preorder;
  for (const ParamSpec& p : spec.params) {
    const std::vector<std::string> module = ModuleOf(p.fqn);
    for (size_t len = 1; len <= module.size(); ++len) {
      const std::string m =
          absl::StrJoin(module.begin(), module.begin() + len, ".");
      if (std::find(preorder.begin(), preorder.end(), m) == preorder.end()) {
        preorder.push_back(m);
      }
    }
  }
  std::map<std::string, int> owned;
  for (const ParamSpec& p : spec.params) {
    ++owned[ExpectedUnit(p.fqn, spec.wrap)];
  }
  std::vector<std::string> want_units;
  if (owned.count("")) want_units.push_back("");
  for (const std::string& m : preorder) {
    if (std::find(spec.wrap.begin(), spec.wrap.end(), m) != spec.wrap.end() &&
        owned.count(m)) {
      want_units.push_back(m);
    }
  }
  std::vector<std::string> got_units;
  for (const FlatParamLayout& f : model->flat_params()) {
    got_units.push_back(f.unit());
  }
  ASSERT_SAME(got_units, want_units, "unit order");

  std::map<std::string, size_t> index_of;
  for (size_t i = 0; i < spec.params.size(); ++i) {
    index_of[spec.params[i].fqn] = i;
  }
  for (const FlatParamLayout& f : model->flat_params()) {
    for (size_t i = 1; i < f.params().size(); ++i) {
      RC_ASSERT(index_of.at(f.params()[i - 1].fqn) <
                index_of.at(f.params()[i].fqn));
    }
    for (size_t i = 1; i < f.shared_params().size(); ++i) {
      RC_ASSERT(index_of.at(f.shared_params()[i - 1].fqn) <
                index_of.at(f.shared_params()[i].fqn));
    }
  }
}

RC_GTEST_PROP(ModelProperties, CrossUnitTieIsRejected, ()) {
  ModelSpec spec = *verify::GenModelSpec();
  const LayoutOptions options = *verify::GenLayoutOptions();
  verify::FitRequiresGrad(options, &spec);
  std::vector<std::pair<size_t, size_t>> pairs;  // (primary, tied)
  for (size_t j = 0; j < spec.params.size(); ++j) {
    for (size_t i = 0; i < j; ++i) {
      if (spec.params[i].tied_to.empty() &&
          ExpectedUnit(spec.params[i].fqn, spec.wrap) !=
              ExpectedUnit(spec.params[j].fqn, spec.wrap)) {
        pairs.emplace_back(i, j);
      }
    }
  }
  RC_PRE(!pairs.empty());
  const auto [i, j] = *gen::elementOf(pairs).as("cross-unit tie");
  spec.params[j].tied_to = spec.params[i].fqn;
  spec.params[j].shape = spec.params[i].shape;
  ExpectInvalidArgument(ModelLayout::Create(spec, options).status(),
                        {absl::StrCat("\"", spec.params[i].fqn, "\""),
                         absl::StrCat("\"", spec.params[j].fqn, "\"")});
}

// ---------------------------------------------------------------------------
// The generators keep their own promises (other suites rely on them).
// ---------------------------------------------------------------------------

// Unique fqns; ties name an earlier parameter and copy its shape; one dtype.
void CheckSpecList(const std::vector<ParamSpec>& specs) {
  RC_ASSERT(!specs.empty());
  RC_ASSERT(specs.size() <= static_cast<size_t>(verify::kMaxParams));
  RC_ASSERT(specs.front().tied_to.empty());
  std::map<std::string, const ParamSpec*> seen;
  for (const ParamSpec& p : specs) {
    RC_ASSERT(!p.fqn.empty());
    RC_ASSERT(p.dtype == specs.front().dtype);
    RC_ASSERT(IsFloatingPoint(p.dtype));
    for (int64_t d : p.shape) RC_ASSERT(d >= 0);
    if (!p.tied_to.empty()) {
      RC_ASSERT(seen.count(p.tied_to) == 1u);
      RC_ASSERT(p.shape == seen[p.tied_to]->shape);
    }
    RC_ASSERT(seen.emplace(p.fqn, &p).second);
  }
}

RC_GTEST_PROP(Generators, ParamSpecsKeepTheirPromises, ()) {
  const std::vector<ParamSpec> data = *verify::GenParamSpecs(Scale::kData);
  CheckSpecList(data);
  RC_ASSERT(verify::UntiedNumel(data) <= verify::kMaxDataNumel);
  for (const ParamSpec& p : data) {
    RC_ASSERT(NumElements(p.shape) <= verify::kMaxDataParamNumel);
  }
  const std::vector<ParamSpec> big = *verify::GenParamSpecs();
  CheckSpecList(big);
  for (const ParamSpec& p : big) {
    RC_ASSERT(NumElements(p.shape) <= verify::kMaxMetadataParamNumel);
  }
  RC_CLASSIFY(verify::UntiedNumel(big) >= (int64_t{1} << 36),
              "metadata numel >= 2^36");
  const int64_t w = *verify::GenWorldSize();
  RC_ASSERT(w >= 1 && w <= verify::kMaxWorldSize);
}

RC_GTEST_PROP(Generators, ModelSpecsKeepTheirPromises, ()) {
  const Scale scale = *gen::element(Scale::kData, Scale::kMetadata);
  const ModelSpec spec = *verify::GenModelSpec(scale);
  CheckSpecList(spec.params);
  if (scale == Scale::kData) {
    RC_ASSERT(verify::UntiedNumel(spec.params) <= verify::kMaxDataNumel);
  }
  for (const std::string& w : spec.wrap) {
    RC_ASSERT(std::count(spec.wrap.begin(), spec.wrap.end(), w) == 1);
    // Each prefix is a module holding some parameter.
    RC_ASSERT(std::any_of(spec.params.begin(), spec.params.end(),
                          [&w](const ParamSpec& p) {
                            return IsPrefix(Components(w), ModuleOf(p.fqn));
                          }));
  }
  for (const ParamSpec& p : spec.params) {
    if (p.tied_to.empty()) continue;
    RC_ASSERT(ExpectedUnit(p.fqn, spec.wrap) ==
              ExpectedUnit(p.tied_to, spec.wrap));
  }
}

}  // namespace
}  // namespace flatparam
