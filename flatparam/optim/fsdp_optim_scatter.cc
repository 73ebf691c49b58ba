// FSDP's optimizer state, full (rank 0 only) -> sharded, collectively:
// ScatterFullOptimState (PyTorch's `scatter_full_optim_state_dict`). Rank 0
// sends the metadata (the "skeleton"), every rank plans from it
// (internal/shard_plan.h), then each flat parameter's flattened tensor
// states are broadcast chunk by chunk and each rank keeps its shard.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "comm/communicator.h"
#include "comm/flight_recorder.h"
#include "flatparam/base/dtype.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/flatten.h"
#include "flatparam/layout.h"
#include "flatparam/model_layout.h"
#include "flatparam/optim/fsdp_optim.h"
#include "flatparam/optim/internal/flat_plan.h"
#include "flatparam/optim/internal/flat_range.h"
#include "flatparam/optim/internal/optim_common.h"
#include "flatparam/optim/internal/shard_plan.h"
#include "flatparam/optim/internal/sharded_keys.h"
#include "flatparam/optim/internal/state_meta.h"
#include "flatparam/optim/optim_state.h"

namespace flatparam {
namespace optim {
namespace {

using internal_optim::AllocateOrigUnit;
using internal_optim::BroadcastChunk;
using internal_optim::CheckComm;
using internal_optim::ConstWindow;
using internal_optim::Decoder;
using internal_optim::DeviceStaging;
using internal_optim::EmitPassthrough;
using internal_optim::Encoder;
using internal_optim::FillsEmpty;
using internal_optim::FlattenRange;
using internal_optim::FlatUnitPlan;
using internal_optim::FromLayoutKeys;
using internal_optim::FullWindows;
using internal_optim::ModelIndex;
using internal_optim::OrigUnitOutput;
using internal_optim::OrigUnitPlan;
using internal_optim::ParamStateMeta;
using internal_optim::PlanShard;
using internal_optim::RekeyedByName;
using internal_optim::ShardPlan;
using internal_optim::StateMeta;
using internal_optim::TempBuffer;
using internal_optim::UnflattenRange;
using internal_optim::ValueMeta;
using internal_optim::Window;

enum : uint8_t { kSkeletonOk = 0, kSkeletonError = 1 };

// Rank 0's message: every state with the managed parameters'
// positive-dimension tensors as metadata, and the groups; or the error
// that stopped rank 0.
std::string EncodeSkeleton(const ModelIndex& index, const absl::Status& error,
                           const OptimStateDict* full) {
  Encoder e;
  if (!error.ok()) {
    e.U8(kSkeletonError);
    e.I64(static_cast<int64_t>(error.code()));
    e.Str(error.message());
    return e.Take();
  }
  e.U8(kSkeletonOk);
  e.I64(static_cast<int64_t>(full->state.size()));
  for (const auto& [key, state] : full->state) {
    const bool with_data = index.Managed(key) == nullptr;
    e.Key(key);
    e.I64(static_cast<int64_t>(state.size()));
    for (const auto& [name, value] : state) {
      e.Str(name);
      e.Value(value, with_data);
    }
  }
  e.I64(static_cast<int64_t>(full->param_groups.size()));
  for (const ParamGroup& g : full->param_groups) e.Group(g);
  return e.Take();
}

absl::Status DecodeSkeleton(absl::string_view bytes, StateMeta* state,
                            std::vector<ParamGroup>* groups) {
  const absl::Status corrupt = absl::InternalError(
      "scatter_full_optim_state_dict: rank 0's metadata arrived corrupted");
  Decoder d(bytes);
  uint8_t tag;
  if (!d.U8(&tag)) return corrupt;
  if (tag == kSkeletonError) {
    int64_t code;
    std::string message;
    if (!d.I64(&code) || !d.Str(&message)) return corrupt;
    return absl::Status(static_cast<absl::StatusCode>(code),
                        absl::StrCat("rank 0: ", message));
  }
  if (tag != kSkeletonOk) return corrupt;
  int64_t n;
  if (!d.I64(&n) || n < 0) return corrupt;
  for (int64_t k = 0; k < n; ++k) {
    ParamKey key;
    int64_t names;
    if (!d.Key(&key) || !d.I64(&names) || names < 0) return corrupt;
    ParamStateMeta& st = (*state)[key];
    for (int64_t j = 0; j < names; ++j) {
      std::string name;
      ValueMeta v;
      if (!d.Str(&name) || !d.Value(&v)) return corrupt;
      st[name] = std::move(v);
    }
  }
  if (!d.I64(&n) || n < 0) return corrupt;
  groups->resize(n);
  for (ParamGroup& g : *groups) {
    if (!d.Group(&g)) return corrupt;
  }
  if (!d.done()) return corrupt;
  return absl::OkStatus();
}

// Broadcasts positions [0, unpadded) of the flattened state `name` of a
// unit, chunk by chunk: rank 0 flattens each chunk from `source`, and every
// rank passes it to `take(begin, count, data)`.
absl::Status BroadcastFlat(
    const FlatParamLayout& layout, Communicator& comm, DType dtype,
    const std::vector<ConstWindow>& source, const OptimStateOptions& options,
    const std::function<void(int64_t, int64_t, const void*)>& take) {
  const int64_t total = layout.unpadded_unsharded_numel();
  if (total == 0) return absl::OkStatus();
  const size_t size = DTypeSize(dtype);
  const int64_t chunk = BroadcastChunk(layout, size, options);
  TempBuffer buf(options.tracker, chunk * static_cast<int64_t>(size));
  FLATPARAM_ASSIGN_OR_RETURN(
      DeviceStaging staging,
      DeviceStaging::Create(options, chunk * static_cast<int64_t>(size)));
  BroadcastOptions bopts;
  static_cast<CollectiveOptions&>(bopts) = options.collective;
  bopts.root = 0;
  for (int64_t begin = 0; begin < total; begin += chunk) {
    const int64_t count = std::min(chunk, total - begin);
    if (comm.rank() == 0) {
      FlattenRange(layout, dtype, source, begin, count, kFlatParamPaddingValue,
                   buf.data());
    }
    const BufferRef host{buf.data(), count, dtype, Device::Host()};
    if (staging.active()) {
      const BufferRef dev = staging.Ref(dtype, 0, count);
      if (comm.rank() == 0) FLATPARAM_RETURN_IF_ERROR(staging.Copy(dev, host));
      FLATPARAM_RETURN_IF_ERROR(comm.Broadcast(dev, bopts)->Wait());
      FLATPARAM_RETURN_IF_ERROR(staging.Copy(host, dev));
    } else {
      FLATPARAM_RETURN_IF_ERROR(comm.Broadcast(host, bopts)->Wait());
    }
    take(begin, count, buf.data());
  }
  return absl::OkStatus();
}

absl::StatusOr<OptimStateDict> ScatterPlan(const ModelIndex& index,
                                           const ShardPlan& plan,
                                           Communicator& comm,
                                           const OptimStateOptions& options) {
  const int64_t rank = comm.rank();
  OptimStateDict out;
  for (const FlatUnitPlan& u : plan.flat) {
    const FlatParamLayout& layout = index.unit(u.unit);
    const int64_t start = layout.shard_interval(rank).start;
    const int64_t s = layout.sharded_numel();
    ParamState st = u.scalars;
    for (const auto& [name, dtype] : u.tensors) {
      HostTensor t = HostTensor::Flat(dtype, s);
      const size_t size = DTypeSize(dtype);
      std::vector<ConstWindow> source;
      if (rank == 0)
        source = FullWindows(layout, u.params, name);
      else
        source.assign(u.params.size(), ConstWindow());
      FLATPARAM_RETURN_IF_ERROR(BroadcastFlat(
          layout, comm, dtype, source, options,
          [&](int64_t begin, int64_t count, const void* data) {
            const int64_t lo = std::max(begin, start);
            const int64_t hi = std::min(begin + count, start + s);
            if (hi <= lo) return;
            std::memcpy(static_cast<unsigned char*>(t.data()) +
                            (lo - start) * static_cast<int64_t>(size),
                        static_cast<const unsigned char*>(data) +
                            (lo - begin) * static_cast<int64_t>(size),
                        (hi - lo) * size);
          }));
      st[name] = std::move(t);
    }
    out.state[ParamKey(int64_t{u.unit})] = std::move(st);
  }
  for (const OrigUnitPlan& u : plan.orig) {
    const FlatParamLayout& layout = index.unit(u.unit);
    OrigUnitOutput o = AllocateOrigUnit(layout, u, rank, FillsEmpty(options));
    for (const auto& [name, dtype] : u.tensors) {
      std::vector<ConstWindow> source;
      if (rank == 0)
        source = FullWindows(layout, u.params, name);
      else
        source.assign(u.params.size(), ConstWindow());
      const std::vector<Window>& windows = o.windows[name];
      const size_t size = DTypeSize(dtype);
      FLATPARAM_RETURN_IF_ERROR(BroadcastFlat(
          layout, comm, dtype, source, options,
          [&](int64_t begin, int64_t count, const void* data) {
            UnflattenRange(layout, size, data, begin, count, windows);
          }));
    }
    for (auto& [i, st] : o.states) {
      out.state[ParamKey(layout.params()[i].fqn)] = std::move(st);
    }
  }
  EmitPassthrough(plan, out);
  return out;
}

}  // namespace

absl::StatusOr<OptimStateDict> ScatterFullOptimState(
    const ModelLayout& layout, const OptimStateDict& full, Communicator& comm,
    const OptimStateOptions& options) {
  FLATPARAM_RETURN_IF_ERROR(CheckComm(layout, comm));
  const ScopedCollectiveContext context(
      comm.flight_recorder(), {"", -1, CollectivePhase::kOptimStateScatter});
  const ModelIndex index(layout, options.unmanaged_params);
  const bool root = comm.rank() == 0;
  // Rank 0's dict keyed by name (a re-keyed copy only when it has IDs).
  OptimStateDict by_name;
  const OptimStateDict* dict = &full;
  std::string skeleton;
  if (root) {
    bool rekeyed = false;
    absl::StatusOr<OptimStateDict> r =
        RekeyedByName(layout, full, options, &rekeyed);
    if (r.ok() && rekeyed) {
      by_name = *std::move(r);
      dict = &by_name;
    }
    skeleton = EncodeSkeleton(index, r.status(), dict);
  }
  FLATPARAM_ASSIGN_OR_RETURN(std::vector<std::string> all,
                             comm.AllGatherBytes(skeleton, options.collective));
  StateMeta meta;
  std::vector<ParamGroup> groups;
  FLATPARAM_RETURN_IF_ERROR(DecodeSkeleton(all[0], &meta, &groups));
  if (root) {
    // Rank 0 flattens from its own tensors.
    for (auto& [key, st] : meta) {
      if (index.Managed(key) == nullptr) continue;
      const ParamState& local = dict->state.at(key);
      for (auto& [name, v] : st) {
        if (v.pos_dim) v.tensor = &std::get<HostTensor>(local.at(name));
      }
    }
  }
  FLATPARAM_ASSIGN_OR_RETURN(ShardPlan plan,
                             PlanShard(index, meta, groups, options));
  FLATPARAM_ASSIGN_OR_RETURN(OptimStateDict mine,
                             ScatterPlan(index, plan, comm, options));
  return FromLayoutKeys(layout, mine, options);
}

}  // namespace optim
}  // namespace flatparam
