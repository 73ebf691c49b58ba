#include "flatparam/optim/internal/optim_common.h"

#include <algorithm>
#include <cstdio>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "flatparam/base/status_macros.h"

namespace flatparam {
namespace optim {
namespace internal_optim {
namespace {

std::string UserStateWarning(const ParamKey& key) {
  return absl::StrFormat(
      "Found an optimizer state, %s, that FSDP cannot process. FSDP will "
      "directly copy everything to the returned state_dict. In most cases, "
      "this is a user-defined state that is not associated with any "
      "particular parameter (or a parameter this model does not manage and "
      "that is not listed in unmanaged_params).",
      DescribeKey(key));
}

}  // namespace

bool Unsharded(const FlatParamLayout& layout) {
  return !UsesShardedStrategy(layout.options().strategy) ||
         layout.world_size() == 1;
}

std::pair<int64_t, int64_t> PieceOf(const FlatParamLayout& layout, int64_t rank,
                                    int i) {
  if (Unsharded(layout)) return {0, layout.params()[i].numel};
  const ShardParamInfo info = layout.shard_param_info(rank, i);
  if (!info.in_shard) return {0, 0};
  return {info.intra_param_start_idx,
          info.intra_param_start_idx + info.numel_in_shard};
}

void Warn(const OptimStateOptions& options, const std::string& message) {
  if (options.on_warning) {
    options.on_warning(message);
  } else {
    std::fprintf(stderr, "flatparam warning: %s\n", message.c_str());
  }
}

std::string UserStateWarning(const ModelIndex& index, const ParamKey& key) {
  std::string message = UserStateWarning(key);
  if (const std::string* prim = index.AliasOf(key)) {
    absl::StrAppend(&message,
                    absl::StrFormat(" It names a shared parameter, whose "
                                    "state is keyed once, by its first name "
                                    "'%s'.",
                                    *prim));
  }
  return message;
}

absl::StatusOr<DeviceStaging> DeviceStaging::Create(
    const OptimStateOptions& options, int64_t bytes) {
  DeviceStaging s;
  if (options.device == nullptr || options.device->device() == Device::Host()) {
    return s;
  }
  FLATPARAM_ASSIGN_OR_RETURN(
      s.buffer_, options.device->Allocate(options.device->device(), bytes));
  s.ops_ = options.device;
  s.tracker_ = options.tracker;
  if (s.tracker_ != nullptr) s.tracker_->Allocated(bytes);
  return s;
}

absl::Status DeviceStaging::Copy(BufferRef dst, ConstBufferRef src) {
  FLATPARAM_RETURN_IF_ERROR(ops_->Copy(dst, src));
  return ops_->Synchronize();
}

int64_t GatherChunk(const FlatParamLayout& layout, size_t elem_size,
                    const OptimStateOptions& options) {
  const int64_t s = layout.sharded_numel();
  if (options.max_temp_bytes <= 0 || s == 0) return s;
  const int64_t per_rank =
      options.max_temp_bytes /
      (layout.world_size() * static_cast<int64_t>(elem_size));
  return std::clamp<int64_t>(per_rank, 1, s);
}

int64_t BroadcastChunk(const FlatParamLayout& layout, size_t elem_size,
                       const OptimStateOptions& options) {
  const int64_t u = layout.unpadded_unsharded_numel();
  if (options.max_temp_bytes <= 0 || u == 0) return u;
  return std::clamp<int64_t>(
      options.max_temp_bytes / static_cast<int64_t>(elem_size), 1, u);
}

absl::Status CheckComm(const ModelLayout& layout, const Communicator& comm) {
  const int64_t w = layout.options().world_size;
  if (comm.size() != w) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "the communicator has %d ranks but the layout is sharded over %d "
        "(for hybrid sharding, pass the shard group)",
        comm.size(), w));
  }
  return absl::OkStatus();
}

}  // namespace internal_optim
}  // namespace optim
}  // namespace flatparam
