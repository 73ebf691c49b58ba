// FSDP's optimizer-state operations (fsdp_optim.h): AllocationTracker,
// FlatParamFqn, OptimStateDictToLoad and MaxTempBytes. The operations
// themselves are in fsdp_optim_consolidate.cc (sharded -> full),
// fsdp_optim_shard.cc (full -> sharded, locally) and fsdp_optim_scatter.cc
// (full -> sharded, from rank 0); what they share is in internal/.
#include "flatparam/optim/fsdp_optim.h"

#include <algorithm>
#include <cassert>
#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/layout.h"
#include "flatparam/optim/internal/optim_common.h"

namespace flatparam {
namespace optim {
namespace {

using internal_optim::BroadcastChunk;
using internal_optim::CheckComm;
using internal_optim::GatherChunk;
using internal_optim::Unsharded;

}  // namespace

void AllocationTracker::Allocated(int64_t bytes) {
  current_ += bytes;
  ++allocations_;
  peak_ = std::max(peak_, current_);
}

void AllocationTracker::Freed(int64_t bytes) {
  current_ -= bytes;
  assert(current_ >= 0);
}

std::string FlatParamFqn(const FlatParamLayout& unit) {
  return unit.unit().empty() ? "_flat_param"
                             : absl::StrCat(unit.unit(), "._flat_param");
}

absl::StatusOr<OptimStateDict> OptimStateDictToLoad(
    const ModelLayout& layout, const OptimStateDict& full, Communicator& comm,
    const OptimStateOptions& options) {
  if (options.rank0_only) {
    return ScatterFullOptimState(layout, full, comm, options);
  }
  FLATPARAM_RETURN_IF_ERROR(CheckComm(layout, comm));
  return ShardFullOptimState(layout, full, comm.rank(), options);
}

int64_t MaxTempBytes(const ModelLayout& layout, DType state_dtype,
                     const OptimStateOptions& options) {
  const size_t size = DTypeSize(state_dtype);
  int64_t most = 0;
  for (const FlatParamLayout& unit : layout.flat_params()) {
    int64_t gather = 0;
    if (!Unsharded(unit) && unit.sharded_numel() > 0) {
      gather = unit.world_size() * GatherChunk(unit, size, options);
    }
    const int64_t broadcast = BroadcastChunk(unit, size, options);
    most = std::max(most,
                    std::max(gather, broadcast) * static_cast<int64_t>(size));
  }
  return most;
}

}  // namespace optim
}  // namespace flatparam
