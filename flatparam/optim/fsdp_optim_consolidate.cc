// FSDP's optimizer state, sharded (every rank) -> full, collectively:
// ConsolidateOptimState (PyTorch's `full_optim_state_dict` /
// `_optim_state_dict`). The ranks exchange what they hold as metadata and
// validate it alike, then all-gather each flat parameter's tensor states
// one state at a time (in chunks) and unflatten them into the parameters'
// shapes: flat path (ConsolidateFlat) or original-parameter path
// (ConsolidateOrig).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/types/span.h"
#include "comm/communicator.h"
#include "comm/flight_recorder.h"
#include "flatparam/base/dtype.h"
#include "flatparam/base/shape.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/flatten.h"
#include "flatparam/layout.h"
#include "flatparam/model_layout.h"
#include "flatparam/optim/fsdp_optim.h"
#include "flatparam/optim/internal/flat_plan.h"
#include "flatparam/optim/internal/flat_range.h"
#include "flatparam/optim/internal/optim_common.h"
#include "flatparam/optim/internal/sharded_keys.h"
#include "flatparam/optim/internal/state_meta.h"
#include "flatparam/optim/optim_state.h"

namespace flatparam {
namespace optim {
namespace {

using internal_optim::CheckComm;
using internal_optim::ConstWindow;
using internal_optim::Decoder;
using internal_optim::DeviceStaging;
using internal_optim::Encoder;
using internal_optim::FlattenRange;
using internal_optim::GatherChunk;
using internal_optim::ModelIndex;
using internal_optim::NameSet;
using internal_optim::ParamStateMeta;
using internal_optim::PieceOf;
using internal_optim::StateMeta;
using internal_optim::TempBuffer;
using internal_optim::ToLayoutKeys;
using internal_optim::UnflattenGroups;
using internal_optim::UnflattenRange;
using internal_optim::Unsharded;
using internal_optim::UserStateWarning;
using internal_optim::ValidateFlatRanks;
using internal_optim::ValueMeta;
using internal_optim::Warn;
using internal_optim::Window;

// What a rank tells the others: its managed and unmanaged keys, with the
// managed ones' states as metadata (user-defined keys stay local).
std::string EncodeShardedMeta(const ModelIndex& index,
                              const OptimStateDict& sharded,
                              const OptimStateOptions& options) {
  Encoder e;
  std::vector<const std::pair<const ParamKey, ParamState>*> entries;
  for (const auto& entry : sharded.state) {
    const bool managed = options.use_orig_params
                             ? index.Managed(entry.first) != nullptr
                             : index.FlatIndex(entry.first) >= 0;
    if (managed || index.Unmanaged(entry.first)) entries.push_back(&entry);
  }
  e.I64(static_cast<int64_t>(entries.size()));
  for (const auto* entry : entries) {
    e.Key(entry->first);
    if (index.Unmanaged(entry->first)) {
      e.I64(0);
      continue;
    }
    e.I64(static_cast<int64_t>(entry->second.size()));
    for (const auto& [name, value] : entry->second) {
      e.Str(name);
      e.Value(value, /*with_data=*/false);
    }
  }
  return e.Take();
}

absl::StatusOr<std::vector<StateMeta>> ExchangeMeta(
    const ModelIndex& index, const OptimStateDict& sharded, Communicator& comm,
    const OptimStateOptions& options) {
  FLATPARAM_ASSIGN_OR_RETURN(
      std::vector<std::string> all,
      comm.AllGatherBytes(EncodeShardedMeta(index, sharded, options),
                          options.collective));
  std::vector<StateMeta> metas(all.size());
  for (size_t r = 0; r < all.size(); ++r) {
    const absl::Status corrupt = absl::InternalError(absl::StrFormat(
        "consolidating optimizer state: rank %d's metadata arrived corrupted",
        r));
    Decoder d(all[r]);
    int64_t n;
    if (!d.I64(&n) || n < 0) return corrupt;
    for (int64_t k = 0; k < n; ++k) {
      ParamKey key;
      int64_t names;
      if (!d.Key(&key) || !d.I64(&names) || names < 0) return corrupt;
      ParamStateMeta& st = metas[r][key];
      for (int64_t j = 0; j < names; ++j) {
        std::string name;
        ValueMeta v;
        if (!d.Str(&name) || !d.Value(&v)) return corrupt;
        st[name] = std::move(v);
      }
    }
    if (!d.done()) return corrupt;
  }
  return metas;
}

// All-gathers a unit's state of `dtype` chunk by chunk. `fill_local(begin,
// count, dst)` writes this rank's shard elements [begin, begin + count);
// each gathered chunk is unflattened into `out` (skipped when empty).
absl::Status GatherUnflatten(
    const FlatParamLayout& layout, Communicator& comm, DType dtype,
    const std::function<void(int64_t, int64_t, void*)>& fill_local,
    absl::Span<const Window> out, const OptimStateOptions& options) {
  const int64_t w = comm.size();
  const int64_t rank = comm.rank();
  const int64_t s = layout.sharded_numel();
  const size_t size = DTypeSize(dtype);
  const int64_t chunk = GatherChunk(layout, size, options);
  if (s == 0) return absl::OkStatus();
  TempBuffer buf(options.tracker, w * chunk * static_cast<int64_t>(size));
  FLATPARAM_ASSIGN_OR_RETURN(
      DeviceStaging staging,
      DeviceStaging::Create(options, w * chunk * static_cast<int64_t>(size)));
  for (int64_t off = 0; off < s; off += chunk) {
    const int64_t count = std::min(chunk, s - off);
    unsigned char* mine =
        buf.data() + rank * count * static_cast<int64_t>(size);
    fill_local(off, count, mine);
    // In place: this rank's input is its slot of the output.
    const BufferRef host_all{buf.data(), w * count, dtype, Device::Host()};
    if (staging.active()) {
      const BufferRef dev_all = staging.Ref(dtype, 0, w * count);
      const BufferRef dev_mine = dev_all.Slice(rank * count, count);
      FLATPARAM_RETURN_IF_ERROR(staging.Copy(
          dev_mine, ConstBufferRef{mine, count, dtype, Device::Host()}));
      FLATPARAM_RETURN_IF_ERROR(
          comm.AllGather(dev_mine, dev_all, options.collective)->Wait());
      FLATPARAM_RETURN_IF_ERROR(staging.Copy(host_all, dev_all));
    } else {
      FLATPARAM_RETURN_IF_ERROR(
          comm.AllGather(ConstBufferRef{mine, count, dtype, Device::Host()},
                         host_all, options.collective)
              ->Wait());
    }
    if (out.empty()) continue;
    for (int64_t q = 0; q < w; ++q) {
      UnflattenRange(layout, size,
                     buf.data() + q * count * static_cast<int64_t>(size),
                     q * s + off, count, out);
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<OptimStateDict> ConsolidateFlat(
    const ModelIndex& index, const OptimStateDict& sharded,
    const std::vector<StateMeta>& metas, Communicator& comm,
    const OptimStateOptions& options, bool to_save) {
  std::vector<int> units;
  std::vector<std::string> mismatches;
  FLATPARAM_RETURN_IF_ERROR(ValidateFlatRanks(
      index, metas, options.strict_replicated_values, &units, &mismatches));
  if (to_save) {
    for (const std::string& m : mismatches) {
      Warn(options, absl::StrCat(m,
                                 "; each rank keeps its own value, as "
                                 "PyTorch does"));
    }
  }
  OptimStateDict out;
  for (int u : units) {
    const FlatParamLayout& layout = index.unit(u);
    const ParamState& local = sharded.state.at(ParamKey(int64_t{u}));
    const size_t n = layout.params().size();
    std::vector<ParamState*> outs(n, nullptr);
    if (to_save) {
      for (size_t i = 0; i < n; ++i) {
        outs[i] = &out.state[ParamKey(layout.params()[i].fqn)];
      }
    }
    for (const auto& [name, value] : local) {
      const auto* t = std::get_if<HostTensor>(&value);
      if (t == nullptr || t->shape().empty()) {
        for (ParamState* o : outs) {
          if (o != nullptr) (*o)[name] = value;
        }
        continue;
      }
      std::vector<Window> windows;
      std::vector<HostTensor*> tensors(n, nullptr);
      if (to_save) {
        windows.resize(n);
        for (size_t i = 0; i < n; ++i) {
          const ParamInfo& p = layout.params()[i];
          HostTensor& dst = std::get<HostTensor>(
              (*outs[i])[name] = HostTensor(t->dtype(), p.shape));
          windows[i] = {dst.data(), 0, p.numel};
        }
      }
      const size_t size = DTypeSize(t->dtype());
      if (Unsharded(layout)) {
        if (to_save) {
          UnflattenRange(layout, size, t->data(), 0, t->numel(), windows);
        }
        continue;
      }
      FLATPARAM_RETURN_IF_ERROR(GatherUnflatten(
          layout, comm, t->dtype(),
          [&](int64_t begin, int64_t count, void* dst) {
            std::memcpy(dst,
                        static_cast<const unsigned char*>(t->data()) +
                            begin * static_cast<int64_t>(size),
                        count * size);
          },
          windows, options));
    }
  }
  return out;
}

// Original-parameter path: per unit, what the ranks hold of it.
struct OrigUnitGather {
  int unit = 0;
  // Parameters with a key on some rank.
  std::vector<bool> has_key;
  // State name -> dtype, and the parameters that have it as a
  // positive-dimension tensor on some rank.
  std::map<std::string, DType> tensors;
  std::map<std::string, std::vector<bool>> participants;
  // Per parameter: the replicated states the holding ranks agree on.
  std::vector<ParamState> scalars;
};

absl::Status ValidateOrigUnit(const ModelIndex& index, int u,
                              const std::vector<StateMeta>& metas,
                              std::vector<std::string>* missing_by_rank,
                              std::optional<OrigUnitGather>* result) {
  const FlatParamLayout& layout = index.unit(u);
  const size_t n = layout.params().size();
  const int64_t w = static_cast<int64_t>(metas.size());
  const bool unsharded = Unsharded(layout);
  OrigUnitGather g;
  g.unit = u;
  g.has_key.assign(n, false);
  g.scalars.resize(n);
  // Per parameter and rank: the state, or null.
  std::vector<std::vector<const ParamStateMeta*>> held(
      n, std::vector<const ParamStateMeta*>(w, nullptr));
  bool any = false;
  for (size_t i = 0; i < n; ++i) {
    const ParamKey key(layout.params()[i].fqn);
    for (int64_t r = 0; r < w; ++r) {
      auto it = metas[r].find(key);
      if (it == metas[r].end()) continue;
      held[i][r] = &it->second;
      g.has_key[i] = true;
      any = true;
    }
  }
  if (!any) return absl::OkStatus();
  // Every trainable parameter of a flat parameter with state needs state.
  std::vector<std::string> with_state;
  for (size_t i = 0; i < n; ++i) {
    if (g.has_key[i]) with_state.push_back(layout.params()[i].fqn);
  }
  for (size_t i = 0; i < n; ++i) {
    const ParamInfo& p = layout.params()[i];
    if (g.has_key[i] || !p.requires_grad) continue;
    return absl::FailedPreconditionError(absl::StrFormat(
        "%s is not in the optimizer state. The FSDPParamInfo has the param "
        "keys %s while the optimizer has the param keys %s.",
        p.fqn, NameSet(index.unit_fqns(u)), NameSet(with_state)));
  }

  std::map<std::string, std::string> dtype_source;
  for (size_t i = 0; i < n; ++i) {
    const ParamInfo& p = layout.params()[i];
    std::map<std::string, std::pair<int64_t, const ValueMeta*>> kinds;
    for (int64_t r = 0; r < w; ++r) {
      if (held[i][r] == nullptr) continue;
      const auto [lo, hi] = PieceOf(layout, r, static_cast<int>(i));
      for (const auto& [name, v] : *held[i][r]) {
        auto [it, inserted] = kinds.emplace(name, std::make_pair(r, &v));
        if (!inserted && (it->second.second->pos_dim != v.pos_dim ||
                          (!v.pos_dim && it->second.second->value.index() !=
                                             v.value.index()))) {
          return absl::InvalidArgumentError(absl::StrFormat(
              "Differing optimizer state types across ranks for state %s of "
              "parameter '%s': rank %d has %s, rank %d has %s",
              name, p.fqn, it->second.first, it->second.second->Describe(), r,
              v.Describe()));
        }
        if (!v.pos_dim) continue;
        if (!IsFloatingPoint(v.dtype)) {
          return absl::InvalidArgumentError(absl::StrFormat(
              "Cannot gather integer dtype tensors: state %s of parameter "
              "'%s' on rank %d is %s",
              name, p.fqn, r, v.Describe()));
        }
        const std::vector<int64_t> want =
            unsharded ? p.shape : std::vector<int64_t>{hi - lo};
        if (v.shape != want) {
          return absl::InvalidArgumentError(absl::StrFormat(
              "Tensor optimizer state %s of parameter '%s' on rank %d is %s, "
              "but the rank holds %s of the parameter (shape %s)",
              name, p.fqn, r, v.Describe(),
              unsharded ? "all" : absl::StrFormat("%d elements", hi - lo),
              ShapeString(want)));
        }
        auto [dt, first] = g.tensors.emplace(name, v.dtype);
        if (first) {
          dtype_source[name] = p.fqn;
        } else if (dt->second != v.dtype) {
          return absl::InvalidArgumentError(absl::StrFormat(
              "All original parameters of one flat parameter must have "
              "positive-dimension tensor state with the same dtype, since it "
              "is all-gathered as one tensor, but state %s is %s for '%s' "
              "and %s for '%s' (rank %d)",
              name, DTypeName(dt->second), dtype_source[name],
              DTypeName(v.dtype), p.fqn, r));
        }
        auto& part = g.participants[name];
        part.resize(n, false);
        part[i] = true;
      }
    }
  }
  for (auto& [name, part] : g.participants) part.resize(n, false);

  // Ranks holding part of a participant must have its state.
  if (!unsharded) {
    for (int64_t r = 0; r < w; ++r) {
      std::vector<std::string> missing;
      for (size_t i = 0; i < n; ++i) {
        const auto [lo, hi] = PieceOf(layout, r, static_cast<int>(i));
        if (hi <= lo) continue;
        std::vector<std::string> names;
        for (const auto& [name, part] : g.participants) {
          if (!part[i]) continue;
          const ParamStateMeta* st = held[i][r];
          if (st == nullptr || st->count(name) == 0) names.push_back(name);
        }
        if (!names.empty()) {
          missing.push_back(absl::StrFormat("'%s' (%s)", layout.params()[i].fqn,
                                            absl::StrJoin(names, ", ")));
        }
      }
      if (!missing.empty()) {
        (*missing_by_rank)[r] = absl::StrCat(
            (*missing_by_rank)[r], (*missing_by_rank)[r].empty() ? "" : ", ",
            absl::StrJoin(missing, ", "));
      }
    }
  }

  // Replicated states: from the ranks whose piece is non-empty (PyTorch's
  // non-empty ranks), or every rank with the key when none is.
  for (size_t i = 0; i < n; ++i) {
    if (!g.has_key[i]) continue;
    const ParamInfo& p = layout.params()[i];
    std::vector<int64_t> ranks;
    for (int64_t r = 0; r < w; ++r) {
      if (held[i][r] == nullptr) continue;
      bool nonempty = false;
      for (const auto& [name, v] : *held[i][r]) {
        nonempty |= v.pos_dim && v.numel() > 0;
      }
      if (nonempty) ranks.push_back(r);
    }
    if (ranks.empty()) {
      for (int64_t r = 0; r < w; ++r) {
        if (held[i][r] != nullptr) ranks.push_back(r);
      }
    }
    std::map<std::string, int64_t> source;
    for (int64_t r : ranks) {
      for (const auto& [name, v] : *held[i][r]) {
        if (v.pos_dim) continue;
        auto [it, inserted] = g.scalars[i].emplace(name, v.value);
        if (inserted) {
          source[name] = r;
        } else if (!BitwiseEqual(it->second, v.value)) {
          return absl::InvalidArgumentError(absl::StrFormat(
              "Different ranks have different values for %s of parameter "
              "'%s': rank %d has %s, rank %d has %s",
              name, p.fqn, source[name], DescribeValue(it->second), r,
              v.Describe()));
        }
      }
    }
  }
  *result = std::move(g);
  return absl::OkStatus();
}

absl::StatusOr<OptimStateDict> ConsolidateOrig(
    const ModelIndex& index, const OptimStateDict& sharded,
    const std::vector<StateMeta>& metas, Communicator& comm,
    const OptimStateOptions& options, bool to_save) {
  const int64_t w = comm.size();
  const int64_t rank = comm.rank();
  std::vector<OrigUnitGather> units;
  std::vector<std::string> missing_by_rank(w);
  for (int u = 0; u < index.num_units(); ++u) {
    std::optional<OrigUnitGather> g;
    FLATPARAM_RETURN_IF_ERROR(
        ValidateOrigUnit(index, u, metas, &missing_by_rank, &g));
    if (g.has_value()) units.push_back(std::move(*g));
  }
  std::string missing;
  for (int64_t r = 0; r < w; ++r) {
    if (missing_by_rank[r].empty()) continue;
    absl::StrAppend(&missing, "\nRank ", r,
                    " is missing states for the parameters: [",
                    missing_by_rank[r], "]");
  }
  if (!missing.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "Some ranks are missing optimizer states that other ranks hold for "
        "the parameters their shards hold (with use_orig_params, a rank "
        "must have the states of every parameter in its shard)",
        missing));
  }

  OptimStateDict out;
  for (const OrigUnitGather& g : units) {
    const FlatParamLayout& layout = index.unit(g.unit);
    const size_t n = layout.params().size();
    if (Unsharded(layout)) {
      if (!to_save) continue;
      for (size_t i = 0; i < n; ++i) {
        auto it = sharded.state.find(ParamKey(layout.params()[i].fqn));
        if (it != sharded.state.end()) out.state[it->first] = it->second;
      }
      continue;
    }
    std::vector<ParamState*> outs(n, nullptr);
    if (to_save) {
      for (size_t i = 0; i < n; ++i) {
        if (!g.has_key[i]) continue;
        outs[i] = &out.state[ParamKey(layout.params()[i].fqn)];
        *outs[i] = g.scalars[i];
      }
    }
    for (const auto& [name, dtype] : g.tensors) {
      const std::vector<bool>& part = g.participants.at(name);
      // This rank's pieces.
      std::vector<ConstWindow> local(n);
      for (size_t i = 0; i < n; ++i) {
        if (!part[i]) continue;
        auto it = sharded.state.find(ParamKey(layout.params()[i].fqn));
        if (it == sharded.state.end()) continue;
        auto v = it->second.find(name);
        if (v == it->second.end()) continue;
        const HostTensor& t = std::get<HostTensor>(v->second);
        const auto [lo, hi] = PieceOf(layout, rank, static_cast<int>(i));
        local[i] = {t.data(), lo, hi};
      }
      std::vector<Window> windows;
      if (to_save) {
        windows.resize(n);
        for (size_t i = 0; i < n; ++i) {
          if (!part[i]) continue;
          const ParamInfo& p = layout.params()[i];
          HostTensor& dst = std::get<HostTensor>(
              (*outs[i])[name] = HostTensor(dtype, p.shape));
          windows[i] = {dst.data(), 0, p.numel};
        }
      }
      const int64_t start = layout.shard_interval(rank).start;
      FLATPARAM_RETURN_IF_ERROR(GatherUnflatten(
          layout, comm, dtype,
          [&](int64_t begin, int64_t count, void* dst) {
            FlattenRange(layout, dtype, local, start + begin, count,
                         /*padding_value=*/0.0, dst);
          },
          windows, options));
    }
  }
  return out;
}

}  // namespace

absl::StatusOr<OptimStateDict> ConsolidateOptimState(
    const ModelLayout& layout, const OptimStateDict& sharded_as_keyed,
    Communicator& comm, const OptimStateOptions& options) {
  FLATPARAM_RETURN_IF_ERROR(CheckComm(layout, comm));
  const ScopedCollectiveContext context(
      comm.flight_recorder(), {"", -1, CollectivePhase::kOptimStateGather});
  // Keyed as this rank's optimizer keys it: to layout keys first. The ranks
  // agree on the outcome, so that a bad key on one rank is an error on all
  // rather than a hang.
  absl::StatusOr<OptimStateDict> keyed =
      ToLayoutKeys(layout, sharded_as_keyed, options);
  if (options.sharded_keys != ShardedKeys::kLayout) {
    FLATPARAM_ASSIGN_OR_RETURN(
        std::vector<std::string> errors,
        comm.AllGatherBytes(
            keyed.ok() ? std::string() : std::string(keyed.status().message()),
            options.collective));
    for (size_t r = 0; r < errors.size(); ++r) {
      if (errors[r].empty()) continue;
      return absl::InvalidArgumentError(absl::StrFormat(
          "rank %d's sharded optimizer state: %s", r, errors[r]));
    }
  }
  if (!keyed.ok()) return keyed.status();
  const OptimStateDict& sharded = *keyed;
  const ModelIndex index(layout, options.unmanaged_params);
  if (options.rank0_only && !options.global_rank.has_value() &&
      IsHybridStrategy(layout.options().strategy)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "rank0_only with %s needs OptimStateOptions::global_rank: rank %d of "
        "the shard group is not global rank 0 in every replicate group",
        ShardingStrategyName(layout.options().strategy), comm.rank()));
  }
  const int64_t global_rank = options.global_rank.value_or(comm.rank());
  const bool to_save = !options.rank0_only || global_rank == 0;
  FLATPARAM_ASSIGN_OR_RETURN(std::vector<StateMeta> metas,
                             ExchangeMeta(index, sharded, comm, options));
  OptimStateDict out;
  if (options.use_orig_params) {
    FLATPARAM_ASSIGN_OR_RETURN(
        out, ConsolidateOrig(index, sharded, metas, comm, options, to_save));
  } else {
    FLATPARAM_ASSIGN_OR_RETURN(
        out, ConsolidateFlat(index, sharded, metas, comm, options, to_save));
  }
  if (!to_save) return OptimStateDict();

  // Unmanaged parameters' states as this rank holds them; anything else is
  // user-defined.
  for (const auto& [key, state] : sharded.state) {
    const bool managed = options.use_orig_params ? index.Managed(key) != nullptr
                                                 : index.FlatIndex(key) >= 0;
    if (managed) continue;
    if (!index.Unmanaged(key)) Warn(options, UserStateWarning(index, key));
    if (!out.state.emplace(key, state).second) {
      Warn(options,
           absl::StrFormat("Dropped the optimizer state %s: a consolidated "
                           "parameter has the same key",
                           DescribeKey(key)));
    }
  }
  FLATPARAM_ASSIGN_OR_RETURN(
      out.param_groups,
      UnflattenGroups(index, sharded.param_groups, options.use_orig_params));
  return out;
}

}  // namespace optim
}  // namespace flatparam
