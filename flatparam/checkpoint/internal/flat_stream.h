// Private to //flatparam/checkpoint: the streaming pieces the offline
// conversions share (convert.h, interop/hf/hf_checkpoint.h). A flat tensor (a
// flat parameter or a flat optimizer state) is produced chunk by chunk from
// reads of its parameters' elements, with flatten.h's padding generated in
// between, and a sharded checkpoint's flat tensors are read back by byte
// range across its rank files. Nothing here holds tensor data beyond the
// caller's chunk.
//
// Thread-safety: FillFlatRange and FlatShardSource are pure apart from the
// reads they are given; a RankFileSet is used by one thread.
#ifndef FLATPARAM_CHECKPOINT_INTERNAL_FLAT_STREAM_H_
#define FLATPARAM_CHECKPOINT_INTERNAL_FLAT_STREAM_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "flatparam/base/dtype.h"
#include "flatparam/checkpoint/checkpoint_dir.h"
#include "flatparam/checkpoint/safetensors.h"
#include "flatparam/layout.h"

namespace flatparam {
namespace checkpoint {
namespace internal_checkpoint {

// Reads elements [elem_begin, elem_begin + n) of parameter `param` (an
// index into FlatParamLayout::params()) into `out`.
using ParamRead = std::function<absl::Status(int param, int64_t elem_begin,
                                             int64_t n, char* out)>;

// Writes `n` elements of `value` (rounded to `dtype`) to `out`.
void FillValue(DType dtype, double value, char* out, int64_t n);

// Writes positions [begin, begin + n) of the flattened (padded) form of a
// tensor laid out by `layout`, elements of `dtype`: parameter elements
// from `read`, 42 in alignment and world-size padding, 0 past the
// unpadded numel (sharding's right padding) -- as flatten.h does.
absl::Status FillFlatRange(const FlatParamLayout& layout, DType dtype,
                           int64_t begin, int64_t n, const ParamRead& read,
                           char* out);

// Rank `rank`'s padded shard of a flat tensor of `layout`, streamed.
// `layout` must outlive the write.
TensorSource FlatShardSource(std::string name, const FlatParamLayout* layout,
                             DType dtype, int64_t rank, ParamRead read);

// A sharded checkpoint's rank files, opened on first use and kept open.
// Borrows `reader`, which must outlive it.
class RankFileSet {
 public:
  explicit RankFileSet(const ShardedCheckpointReader& reader)
      : reader_(reader), files_(reader.num_ranks()) {}

  // Rank `rank`'s tensor file (ShardedCheckpointReader::OpenRank's checks).
  absl::StatusOr<const SafetensorsReader*> Get(int64_t rank);

  // Reads bytes [offset, offset + out.size()) of tensor `name` of rank
  // `rank`'s file (a whole tensor such as a buffer, not a flat shard).
  absl::Status ReadRange(int64_t rank, const std::string& name, uint64_t offset,
                         absl::Span<char> out);

  // Reads bytes [byte_begin, byte_begin + out.size()) of the padded
  // unsharded form of flat tensor `name` (of flat parameter `unit`,
  // elements of `size` bytes) from the rank files holding them.
  absl::Status ReadFlatBytes(int unit, const std::string& name, size_t size,
                             uint64_t byte_begin, absl::Span<char> out);

 private:
  const ShardedCheckpointReader& reader_;
  std::vector<std::optional<SafetensorsReader>> files_;
};

}  // namespace internal_checkpoint
}  // namespace checkpoint
}  // namespace flatparam

#endif  // FLATPARAM_CHECKPOINT_INTERNAL_FLAT_STREAM_H_
