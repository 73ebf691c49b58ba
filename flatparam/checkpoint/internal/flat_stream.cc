#include "flatparam/checkpoint/internal/flat_stream.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_format.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/flatten.h"

namespace flatparam {
namespace checkpoint {
namespace internal_checkpoint {

void FillValue(DType dtype, double value, char* out, int64_t n) {
  const size_t size = DTypeSize(dtype);
  if (value == 0) {
    std::memset(out, 0, n * size);
    return;
  }
  char elem[16];
  StoreFromDouble(elem, dtype, 0, value);
  for (int64_t i = 0; i < n; ++i) std::memcpy(out + i * size, elem, size);
}

absl::Status FillFlatRange(const FlatParamLayout& layout, DType dtype,
                           int64_t begin, int64_t n, const ParamRead& read,
                           char* out) {
  const size_t size = DTypeSize(dtype);
  const int64_t end = begin + n;
  const int64_t unpadded = layout.unpadded_unsharded_numel();
  int64_t cur = begin;
  const auto pad_to = [&](int64_t to) {
    if (to <= cur) return;
    const int64_t pad42_end = std::min(to, std::max(cur, unpadded));
    FillValue(dtype, kFlatParamPaddingValue, out + (cur - begin) * size,
              pad42_end - cur);
    FillValue(dtype, 0, out + (pad42_end - begin) * size, to - pad42_end);
    cur = to;
  };
  const std::vector<ParamInfo>& params = layout.params();
  for (int i = 0; i < static_cast<int>(params.size()) && cur < end; ++i) {
    const int64_t lo = params[i].offset;
    const int64_t hi = lo + params[i].numel;
    if (params[i].numel == 0 || hi <= cur) continue;
    if (lo >= end) break;
    pad_to(lo);
    const int64_t k = std::min(hi, end) - cur;
    FLATPARAM_RETURN_IF_ERROR(read(i, cur - lo, k, out + (cur - begin) * size));
    cur += k;
  }
  pad_to(end);
  return absl::OkStatus();
}

TensorSource FlatShardSource(std::string name, const FlatParamLayout* layout,
                             DType dtype, int64_t rank, ParamRead read) {
  TensorSource src;
  src.name = std::move(name);
  src.dtype = dtype;
  src.shape = {layout->sharded_numel()};
  const int64_t start = layout->shard_interval(rank).start;
  src.fill = [layout, dtype, start, read = std::move(read)](
                 uint64_t offset, absl::Span<char> out) -> absl::Status {
    const size_t size = DTypeSize(dtype);
    if (offset % size != 0 || out.size() % size != 0) {
      return absl::InternalError(absl::StrFormat(
          "chunk [%d, +%d) is not element-aligned", offset, out.size()));
    }
    return FillFlatRange(
        *layout, dtype, start + static_cast<int64_t>(offset / size),
        static_cast<int64_t>(out.size() / size), read, out.data());
  };
  return src;
}

absl::StatusOr<const SafetensorsReader*> RankFileSet::Get(int64_t rank) {
  if (!files_[rank].has_value()) {
    FLATPARAM_ASSIGN_OR_RETURN(SafetensorsReader f, reader_.OpenRank(rank));
    files_[rank].emplace(std::move(f));
  }
  return &*files_[rank];
}

absl::Status RankFileSet::ReadRange(int64_t rank, const std::string& name,
                                    uint64_t offset, absl::Span<char> out) {
  FLATPARAM_ASSIGN_OR_RETURN(const SafetensorsReader* f, Get(rank));
  return f->ReadRange(name, offset, out);
}

absl::Status RankFileSet::ReadFlatBytes(int unit, const std::string& name,
                                        size_t size, uint64_t byte_begin,
                                        absl::Span<char> out) {
  const FlatParamLayout& layout = reader_.layout().flat_params()[unit];
  if (!UsesShardedStrategy(layout.options().strategy)) {
    FLATPARAM_ASSIGN_OR_RETURN(const SafetensorsReader* f, Get(0));
    return f->ReadRange(name, byte_begin, out);
  }
  const uint64_t rank_bytes = layout.sharded_numel() * size;
  size_t done = 0;
  while (done < out.size()) {
    const uint64_t pos = byte_begin + done;
    const int64_t rank = static_cast<int64_t>(pos / rank_bytes);
    const uint64_t off = pos % rank_bytes;
    const size_t k = static_cast<size_t>(
        std::min<uint64_t>(out.size() - done, rank_bytes - off));
    FLATPARAM_ASSIGN_OR_RETURN(const SafetensorsReader* f, Get(rank));
    FLATPARAM_RETURN_IF_ERROR(f->ReadRange(name, off, out.subspan(done, k)));
    done += k;
  }
  return absl::OkStatus();
}

}  // namespace internal_checkpoint
}  // namespace checkpoint
}  // namespace flatparam
