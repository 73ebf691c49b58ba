// Moving parameter data in and out of a flat parameter laid out by a
// FlatParamLayout, on host memory.
//
// The flat parameter is a plain array of `layout.dtype()` elements. Every
// function here takes host BufferRef / ConstBufferRef views
// (flatparam/base/buffer.h) of caller-owned memory and copies;
// none allocates tensor memory or keeps a pointer after it returns. Each
// checks that the views have the dtype and element count the layout implies
// and returns InvalidArgument naming the parameter and both sizes otherwise
// (and for a view on a device other than the host).
//
// clang-format off
//   function        from                 to
//   Flatten         params               the unsharded flat parameter
//                                        (alignment padding 42)
//   FlattenShard    params               one rank's padded shard, directly
//   CopyShard       the unsharded flat   one rank's padded shard (padding 0)
//   ConcatShards    every rank's shard   the padded unsharded flat parameter
//   Unflatten       the unsharded flat   params (padding skipped)
//   UnflattenShard  one rank's shard     the pieces of params it holds
// clang-format on
//
// Views of a flat parameter (PyTorch's `use_orig_params` views) are
// `ParamView` (into the unsharded buffer) and `ShardView` (into a rank's
// shard; possibly empty).
//
// Thread-safety: the functions are reentrant; concurrent calls must not write
// the same memory.
#ifndef FLATPARAM_FLATTEN_H_
#define FLATPARAM_FLATTEN_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "flatparam/base/buffer.h"
#include "flatparam/base/dtype.h"
#include "flatparam/layout.h"

namespace flatparam {

namespace internal_flatten {
// std::allocator whose value-less construct() leaves bytes uninitialized,
// so that a vector can be resized without zeroing what will be overwritten.
template <typename T>
struct DefaultInitAllocator : std::allocator<T> {
  template <typename U>
  struct rebind {
    using other = DefaultInitAllocator<U>;
  };
  DefaultInitAllocator() = default;
  template <typename U>
  DefaultInitAllocator(const DefaultInitAllocator<U>&) {}  // NOLINT
  template <typename U>
  void construct(U* p) {
    ::new (static_cast<void*>(p)) U;
  }
  template <typename U, typename... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
};
}  // namespace internal_flatten

// A host tensor that owns its (contiguous, row-major) storage.
// Movable and copyable; not thread-safe for concurrent mutation.
class HostTensor {
 public:
  HostTensor() = default;
  // Zero-filled.
  HostTensor(DType dtype, std::vector<int64_t> shape);
  // A 1-D tensor of `numel` elements, zero-filled.
  static HostTensor Flat(DType dtype, int64_t numel);
  // Storage left uninitialized, for a tensor about to be overwritten whole
  // (a read from a file): zero-filling a large tensor first costs as much
  // as reading it from the page cache.
  static HostTensor Uninitialized(DType dtype, std::vector<int64_t> shape);

  DType dtype() const { return dtype_; }
  const std::vector<int64_t>& shape() const { return shape_; }
  int64_t numel() const { return numel_; }
  size_t nbytes() const { return bytes_.size(); }
  void* data() { return bytes_.data(); }
  const void* data() const { return bytes_.data(); }
  template <typename T>
  T* data_as() {
    return reinterpret_cast<T*>(bytes_.data());
  }
  template <typename T>
  const T* data_as() const {
    return reinterpret_cast<const T*>(bytes_.data());
  }

  // Host views of the whole tensor.
  BufferRef ref() { return {data(), numel_, dtype_, Device::Host()}; }
  ConstBufferRef ref() const {
    return {data(), numel_, dtype_, Device::Host()};
  }
  ConstBufferRef cref() const { return ref(); }

  // Element i as double / stored from double with PyTorch rounding.
  double GetDouble(int64_t i) const { return LoadAsDouble(data(), dtype_, i); }
  void SetDouble(int64_t i, double v) { StoreFromDouble(data(), dtype_, i, v); }

  // Bytewise equality of dtype, shape and contents.
  friend bool operator==(const HostTensor& a, const HostTensor& b) {
    return a.dtype_ == b.dtype_ && a.shape_ == b.shape_ && a.bytes_ == b.bytes_;
  }
  friend bool operator!=(const HostTensor& a, const HostTensor& b) {
    return !(a == b);
  }

 private:
  DType dtype_ = DType::kFloat32;
  std::vector<int64_t> shape_;
  int64_t numel_ = 0;
  // 16-byte aligned storage (max_align_t) as a byte vector.
  std::vector<unsigned char,
              internal_flatten::DefaultInitAllocator<unsigned char>>
      bytes_;
};

// Writes the unsharded flat parameter: `params[i]` is the data of
// `layout.params()[i]`; `out` has `layout.unpadded_unsharded_numel()`
// elements. Alignment and world-size padding are set to 42.
absl::Status Flatten(const FlatParamLayout& layout,
                     absl::Span<const ConstBufferRef> params, BufferRef out);

// Writes `rank`'s padded shard (`layout.sharded_numel()` elements) straight
// from the parameters, without materializing the unsharded flat parameter:
// the result equals Flatten followed by CopyShard.
absl::Status FlattenShard(const FlatParamLayout& layout,
                          absl::Span<const ConstBufferRef> params, int64_t rank,
                          BufferRef out);

// Copies `rank`'s shard of `flat` (`unpadded_unsharded_numel()` or
// `padded_unsharded_numel()` elements) into `out` (`sharded_numel()`
// elements), zero-filling the right padding. PyTorch's `_get_shard`.
absl::Status CopyShard(const FlatParamLayout& layout, ConstBufferRef flat,
                       int64_t rank, BufferRef out);

// Concatenates `shards` (one per rank, `sharded_numel()` elements each, in
// rank order) into `out` (`padded_unsharded_numel()` elements): the
// all-gather result. For NO_SHARD, `shards` has one element.
absl::Status ConcatShards(const FlatParamLayout& layout,
                          absl::Span<const ConstBufferRef> shards,
                          BufferRef out);

// Copies each parameter out of the unsharded flat parameter `flat`
// (unpadded or padded size). `params[i]` receives `layout.params()[i]`.
absl::Status Unflatten(const FlatParamLayout& layout, ConstBufferRef flat,
                       absl::Span<const BufferRef> params);

// Copies what `rank`'s shard holds of each parameter into `params[i]` at the
// matching element offsets (intra_param_start_idx..intra_param_end_idx);
// elements the shard does not hold are left untouched.
absl::Status UnflattenShard(const FlatParamLayout& layout, ConstBufferRef shard,
                            int64_t rank, absl::Span<const BufferRef> params);

// The view of parameter `index` inside an unsharded flat parameter.
// REQUIRES: `flat` has at least unpadded_unsharded_numel() elements.
ConstBufferRef ParamView(const FlatParamLayout& layout, ConstBufferRef flat,
                         int index);
BufferRef ParamView(const FlatParamLayout& layout, BufferRef flat, int index);

// The (flattened, possibly empty) view of parameter `index` inside `rank`'s
// shard, PyTorch's sharded `use_orig_params` view.
// REQUIRES: `shard` has sharded_numel() elements.
ConstBufferRef ShardView(const FlatParamLayout& layout, ConstBufferRef shard,
                         int64_t rank, int index);
BufferRef ShardView(const FlatParamLayout& layout, BufferRef shard,
                    int64_t rank, int index);

}  // namespace flatparam

#endif  // FLATPARAM_FLATTEN_H_
