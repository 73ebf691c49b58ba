// Private to //flatparam/optim:fsdp_optim: what its implementation files
// share besides fsdp_optim.h -- fsdp_optim.cc (the entry points for either
// direction), fsdp_optim_consolidate.cc (sharded -> full),
// fsdp_optim_shard.cc and fsdp_optim_scatter.cc (full -> sharded, locally
// and from rank 0). Here: the layout questions both directions ask,
// warnings, the temporary buffers of the collectives and their chunk sizes,
// and the communicator check; sharded_keys.h converts the rank's
// optimizer's keys, shard_plan.h plans a full dict's sharding.
//
// Ownership: TempBuffer and DeviceStaging own their buffers and count them
// in the options' tracker while alive; the functions take caller-owned
// arguments. Thread-safety: the calling rank's thread, as the operations
// (the tracker is not synchronized).
#ifndef FLATPARAM_OPTIM_INTERNAL_OPTIM_COMMON_H_
#define FLATPARAM_OPTIM_INTERNAL_OPTIM_COMMON_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "comm/communicator.h"
#include "flatparam/base/dtype.h"
#include "flatparam/device/device.h"
#include "flatparam/layout.h"
#include "flatparam/model_layout.h"
#include "flatparam/optim/fsdp_optim.h"
#include "flatparam/optim/internal/flat_plan.h"
#include "flatparam/optim/optim_state.h"

namespace flatparam {
namespace optim {
namespace internal_optim {

// Nothing to shard: every rank holds everything (PyTorch switches a world
// of one rank to NO_SHARD).
bool Unsharded(const FlatParamLayout& layout);

// The rank's piece of parameter i: elements [lo, hi).
std::pair<int64_t, int64_t> PieceOf(const FlatParamLayout& layout, int64_t rank,
                                    int i);

// Passes `message` to options.on_warning, or prints it to stderr.
void Warn(const OptimStateOptions& options, const std::string& message);

// The warning for a key that names no parameter (user-defined state),
// saying so when it names a shared parameter by a later name.
std::string UserStateWarning(const ModelIndex& index, const ParamKey& key);

// A temporary host buffer, counted in the options' tracker while alive.
class TempBuffer {
 public:
  TempBuffer(AllocationTracker* tracker, int64_t bytes)
      : tracker_(tracker),
        bytes_(bytes),
        data_(new unsigned char[std::max<int64_t>(bytes, 1)]) {
    if (tracker_ != nullptr) tracker_->Allocated(bytes_);
  }
  ~TempBuffer() {
    if (tracker_ != nullptr) tracker_->Freed(bytes_);
  }
  TempBuffer(const TempBuffer&) = delete;
  TempBuffer& operator=(const TempBuffer&) = delete;

  unsigned char* data() { return data_.get(); }

 private:
  AllocationTracker* tracker_;
  int64_t bytes_;
  std::unique_ptr<unsigned char[]> data_;
};

// A device buffer for staging a collective's host buffer of `bytes`, when
// options.device is a real device (see OptimStateOptions::device); nothing
// otherwise. Counted in the tracker while alive.
class DeviceStaging {
 public:
  static absl::StatusOr<DeviceStaging> Create(const OptimStateOptions& options,
                                              int64_t bytes);
  DeviceStaging() = default;
  DeviceStaging(DeviceStaging&& o) noexcept
      : ops_(std::exchange(o.ops_, nullptr)),
        tracker_(o.tracker_),
        buffer_(std::move(o.buffer_)) {}
  DeviceStaging& operator=(DeviceStaging&&) = delete;
  ~DeviceStaging() {
    if (ops_ != nullptr && tracker_ != nullptr) {
      tracker_->Freed(buffer_.bytes());
    }
  }

  bool active() const { return ops_ != nullptr; }
  // `count` elements of `dtype` at element `offset` of the staging buffer.
  BufferRef Ref(DType dtype, int64_t offset, int64_t count) const {
    return BufferRef{static_cast<unsigned char*>(buffer_.data()) +
                         offset * static_cast<int64_t>(DTypeSize(dtype)),
                     count, dtype, buffer_.device()};
  }
  // Copies `src` to `dst` and synchronizes.
  absl::Status Copy(BufferRef dst, ConstBufferRef src);

 private:
  DeviceOps* ops_ = nullptr;
  AllocationTracker* tracker_ = nullptr;
  DeviceBuffer buffer_;
};

// Elements per rank of one all-gather chunk of a flat parameter's state.
int64_t GatherChunk(const FlatParamLayout& layout, size_t elem_size,
                    const OptimStateOptions& options);

// Elements of one broadcast chunk of a flat parameter's flattened state.
int64_t BroadcastChunk(const FlatParamLayout& layout, size_t elem_size,
                       const OptimStateOptions& options);

// InvalidArgument unless `comm` has the layout's world size (for hybrid
// sharding, the shard group).
absl::Status CheckComm(const ModelLayout& layout, const Communicator& comm);

}  // namespace internal_optim
}  // namespace optim
}  // namespace flatparam

#endif  // FLATPARAM_OPTIM_INTERNAL_OPTIM_COMMON_H_
