#include "flatparam/flatten.h"

#include <algorithm>
#include <cassert>
#include <cstring>

#include "absl/strings/str_format.h"
#include "flatparam/base/copy.h"
#include "flatparam/base/status_macros.h"

namespace flatparam {
namespace {

std::string UnitLabel(const FlatParamLayout& layout) {
  return layout.unit().empty() ? "<root>" : layout.unit();
}

// Host memory of `want_numel` elements of `want_dtype`.
absl::Status CheckRef(const FlatParamLayout& layout, const char* what,
                      ConstBufferRef ref, DType want_dtype,
                      int64_t want_numel) {
  const DType dtype = ref.dtype;
  const int64_t numel = ref.count;
  const void* data = ref.data;
  if (ref.device != Device::Host()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("unit %s: %s is on %s; flattening works on host memory",
                        UnitLabel(layout), what, DeviceName(ref.device)));
  }
  if (dtype != want_dtype || numel != want_numel) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "unit %s: %s must be %d elements of %s, got %d elements of %s",
        UnitLabel(layout), what, want_numel, DTypeName(want_dtype), numel,
        DTypeName(dtype)));
  }
  if (data == nullptr && numel > 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("unit %s: %s has %d elements but a null data pointer",
                        UnitLabel(layout), what, numel));
  }
  return absl::OkStatus();
}

template <typename Ref>
absl::Status CheckParams(const FlatParamLayout& layout,
                         absl::Span<const Ref> params) {
  if (params.size() != layout.params().size()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "unit %s: expected %d parameter buffers, got %d", UnitLabel(layout),
        layout.params().size(), params.size()));
  }
  for (size_t i = 0; i < params.size(); ++i) {
    const ParamInfo& p = layout.params()[i];
    const std::string what = absl::StrFormat("parameter \"%s\"", p.fqn);
    FLATPARAM_RETURN_IF_ERROR(
        CheckRef(layout, what.c_str(), params[i], layout.dtype(), p.numel));
  }
  return absl::OkStatus();
}

// Checks a flat buffer that may be the unpadded or the padded size.
absl::Status CheckFlat(const FlatParamLayout& layout, ConstBufferRef flat) {
  const int64_t want = flat.count == layout.padded_unsharded_numel()
                           ? layout.padded_unsharded_numel()
                           : layout.unpadded_unsharded_numel();
  return CheckRef(layout, "the unsharded flat parameter", flat, layout.dtype(),
                  want);
}

// Whether an operation moving `numel` elements should stream its copies.
bool Streaming(const FlatParamLayout& layout, int64_t numel) {
  return numel * static_cast<int64_t>(DTypeSize(layout.dtype())) >=
         kStreamingCopyThreshold;
}

unsigned char* Bytes(void* p) { return static_cast<unsigned char*>(p); }
const unsigned char* Bytes(const void* p) {
  return static_cast<const unsigned char*>(p);
}

void FillPadding(void* dst, DType dtype, int64_t count) {
  if (count <= 0) return;
  const size_t size = DTypeSize(dtype);
  unsigned char pattern[8];
  StoreFromDouble(pattern, dtype, 0, kFlatParamPaddingValue);
  unsigned char* out = Bytes(dst);
  for (int64_t i = 0; i < count; ++i)
    std::memcpy(out + i * size, pattern, size);
}

// Copies elements [begin, end) of the unsharded flat parameter, as Flatten
// would produce it, into `dst`, reading parameters directly.
void CopyFlatRange(const FlatParamLayout& layout,
                   absl::Span<const ConstBufferRef> params, int64_t begin,
                   int64_t end, void* dst) {
  const bool streaming = Streaming(layout, end - begin);
  const size_t size = DTypeSize(layout.dtype());
  const std::vector<int64_t>& numels = layout.numels_with_padding();
  const std::vector<bool>& padding = layout.is_padding_mask();
  int64_t seg_start = 0;
  int param = 0;
  for (size_t s = 0; s < numels.size() && seg_start < end; ++s) {
    const int64_t seg_end = seg_start + numels[s];
    const int64_t lo = std::max(begin, seg_start);
    const int64_t hi = std::min(end, seg_end);
    if (lo < hi) {
      unsigned char* out = Bytes(dst) + (lo - begin) * size;
      if (padding[s]) {
        FillPadding(out, layout.dtype(), hi - lo);
      } else {
        CopyBytes(out, Bytes(params[param].data) + (lo - seg_start) * size,
                  (hi - lo) * size, streaming);
      }
    }
    if (!padding[s]) ++param;
    seg_start = seg_end;
  }
}

}  // namespace

HostTensor::HostTensor(DType dtype, std::vector<int64_t> shape)
    : dtype_(dtype), shape_(std::move(shape)), numel_(NumElements(shape_)) {
  bytes_.assign(static_cast<size_t>(numel_) * DTypeSize(dtype_), 0);
}

HostTensor HostTensor::Flat(DType dtype, int64_t numel) {
  return HostTensor(dtype, {numel});
}

HostTensor HostTensor::Uninitialized(DType dtype, std::vector<int64_t> shape) {
  HostTensor t;
  t.dtype_ = dtype;
  t.shape_ = std::move(shape);
  t.numel_ = NumElements(t.shape_);
  t.bytes_.resize(static_cast<size_t>(t.numel_) * DTypeSize(dtype));
  return t;
}

absl::Status Flatten(const FlatParamLayout& layout,
                     absl::Span<const ConstBufferRef> params, BufferRef out) {
  FLATPARAM_RETURN_IF_ERROR(CheckParams(layout, params));
  FLATPARAM_RETURN_IF_ERROR(CheckRef(layout, "the flat parameter output", out,
                                     layout.dtype(),
                                     layout.unpadded_unsharded_numel()));
  CopyFlatRange(layout, params, 0, layout.unpadded_unsharded_numel(), out.data);
  return absl::OkStatus();
}

absl::Status FlattenShard(const FlatParamLayout& layout,
                          absl::Span<const ConstBufferRef> params, int64_t rank,
                          BufferRef out) {
  FLATPARAM_RETURN_IF_ERROR(layout.CheckRank(rank));
  FLATPARAM_RETURN_IF_ERROR(CheckParams(layout, params));
  FLATPARAM_RETURN_IF_ERROR(CheckRef(layout, "the shard output", out,
                                     layout.dtype(), layout.sharded_numel()));
  const ShardInterval iv = layout.shard_interval(rank);
  const int64_t end =
      std::min(iv.end_inclusive + 1, layout.unpadded_unsharded_numel());
  const int64_t data_numel = std::max<int64_t>(0, end - iv.start);
  if (data_numel > 0) CopyFlatRange(layout, params, iv.start, end, out.data);
  const size_t size = DTypeSize(layout.dtype());
  std::memset(Bytes(out.data) + data_numel * size, 0,
              (layout.sharded_numel() - data_numel) * size);
  return absl::OkStatus();
}

absl::Status CopyShard(const FlatParamLayout& layout, ConstBufferRef flat,
                       int64_t rank, BufferRef out) {
  FLATPARAM_RETURN_IF_ERROR(layout.CheckRank(rank));
  FLATPARAM_RETURN_IF_ERROR(CheckFlat(layout, flat));
  FLATPARAM_RETURN_IF_ERROR(CheckRef(layout, "the shard output", out,
                                     layout.dtype(), layout.sharded_numel()));
  const size_t size = DTypeSize(layout.dtype());
  const ShardInterval iv = layout.shard_interval(rank);
  const int64_t data_numel = layout.sharded_numel() - iv.numel_padded;
  if (data_numel > 0) {
    CopyBytes(out.data, Bytes(flat.data) + iv.start * size, data_numel * size,
              Streaming(layout, data_numel));
  }
  std::memset(Bytes(out.data) + data_numel * size, 0, iv.numel_padded * size);
  return absl::OkStatus();
}

absl::Status ConcatShards(const FlatParamLayout& layout,
                          absl::Span<const ConstBufferRef> shards,
                          BufferRef out) {
  const int64_t n =
      UsesShardedStrategy(layout.options().strategy) ? layout.world_size() : 1;
  if (static_cast<int64_t>(shards.size()) != n) {
    return absl::InvalidArgumentError(
        absl::StrFormat("unit %s: expected %d shards, got %d",
                        UnitLabel(layout), n, shards.size()));
  }
  FLATPARAM_RETURN_IF_ERROR(CheckRef(layout, "the unsharded output", out,
                                     layout.dtype(),
                                     layout.padded_unsharded_numel()));
  const size_t bytes = layout.sharded_numel() * DTypeSize(layout.dtype());
  const bool streaming = Streaming(layout, layout.padded_unsharded_numel());
  for (int64_t r = 0; r < n; ++r) {
    const std::string what = absl::StrFormat("shard of rank %d", r);
    FLATPARAM_RETURN_IF_ERROR(CheckRef(layout, what.c_str(), shards[r],
                                       layout.dtype(), layout.sharded_numel()));
    CopyBytes(Bytes(out.data) + r * bytes, shards[r].data, bytes, streaming);
  }
  return absl::OkStatus();
}

absl::Status Unflatten(const FlatParamLayout& layout, ConstBufferRef flat,
                       absl::Span<const BufferRef> params) {
  FLATPARAM_RETURN_IF_ERROR(CheckFlat(layout, flat));
  FLATPARAM_RETURN_IF_ERROR(CheckParams(layout, params));
  const size_t size = DTypeSize(layout.dtype());
  const bool streaming = Streaming(layout, layout.param_numel());
  for (size_t i = 0; i < params.size(); ++i) {
    const ParamInfo& p = layout.params()[i];
    if (p.numel == 0) continue;
    CopyBytes(params[i].data, Bytes(flat.data) + p.offset * size,
              p.numel * size, streaming);
  }
  return absl::OkStatus();
}

absl::Status UnflattenShard(const FlatParamLayout& layout, ConstBufferRef shard,
                            int64_t rank, absl::Span<const BufferRef> params) {
  FLATPARAM_RETURN_IF_ERROR(layout.CheckRank(rank));
  FLATPARAM_RETURN_IF_ERROR(CheckRef(layout, "the shard", shard, layout.dtype(),
                                     layout.sharded_numel()));
  FLATPARAM_RETURN_IF_ERROR(CheckParams(layout, params));
  const size_t size = DTypeSize(layout.dtype());
  const bool streaming = Streaming(layout, layout.sharded_numel());
  for (size_t i = 0; i < params.size(); ++i) {
    const ShardParamInfo info =
        layout.shard_param_info(rank, static_cast<int>(i));
    if (!info.in_shard || info.numel_in_shard <= 0) continue;
    CopyBytes(Bytes(params[i].data) + info.intra_param_start_idx * size,
              Bytes(shard.data) + info.offset_in_shard * size,
              info.numel_in_shard * size, streaming);
  }
  return absl::OkStatus();
}

ConstBufferRef ParamView(const FlatParamLayout& layout, ConstBufferRef flat,
                         int index) {
  assert(flat.count >= layout.unpadded_unsharded_numel());
  const ParamInfo& p = layout.params()[index];
  return {Bytes(flat.data) + p.offset * DTypeSize(layout.dtype()), p.numel,
          layout.dtype(), flat.device};
}

BufferRef ParamView(const FlatParamLayout& layout, BufferRef flat, int index) {
  const ConstBufferRef v = ParamView(layout, ConstBufferRef(flat), index);
  return {const_cast<void*>(v.data), v.count, v.dtype, v.device};
}

ConstBufferRef ShardView(const FlatParamLayout& layout, ConstBufferRef shard,
                         int64_t rank, int index) {
  assert(shard.count == layout.sharded_numel());
  const ShardParamInfo info = layout.shard_param_info(rank, index);
  if (!info.in_shard) return {shard.data, 0, layout.dtype(), shard.device};
  return {Bytes(shard.data) + info.offset_in_shard * DTypeSize(layout.dtype()),
          std::max<int64_t>(0, info.numel_in_shard), layout.dtype(),
          shard.device};
}

BufferRef ShardView(const FlatParamLayout& layout, BufferRef shard,
                    int64_t rank, int index) {
  const ConstBufferRef v =
      ShardView(layout, ConstBufferRef(shard), rank, index);
  return {const_cast<void*>(v.data), v.count, v.dtype, v.device};
}

}  // namespace flatparam
