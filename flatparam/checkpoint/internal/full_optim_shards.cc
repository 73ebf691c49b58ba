#include "flatparam/checkpoint/internal/full_optim_shards.h"

#include <cstring>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <utility>
#include <variant>

#include "absl/strings/str_format.h"
#include "absl/types/span.h"
#include "flatparam/base/dtype.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/checkpoint/checkpoint_dir.h"
#include "flatparam/checkpoint/internal/flat_stream.h"
#include "flatparam/checkpoint/internal/sidecar_meta.h"
#include "flatparam/optim/internal/flat_plan.h"
#include "flatparam/optim/internal/state_meta.h"
#include "flatparam/optim/optim_state.h"

namespace flatparam {
namespace checkpoint {
namespace {

using json = nlohmann::json;
using optim::ParamKey;
using optim::internal_optim::FlatUnitPlan;
using optim::internal_optim::ModelIndex;
using optim::internal_optim::ParamStateMeta;
using optim::internal_optim::PlanFlatUnit;
using optim::internal_optim::PlanGroups;
using optim::internal_optim::StateMeta;

absl::Status ZeroRead(DType dtype, int64_t n, char* out) {
  std::memset(out, 0, n * DTypeSize(dtype));
  return absl::OkStatus();
}

}  // namespace

// ---------------------------------------------------------------------------
// The optimizer half of sharding a full checkpoint
// (internal/full_optim_shards.h).

namespace internal_checkpoint {

struct FullOptimShards::Plan {
  Plan(const ModelLayout& layout, const SafetensorsReader& file)
      : layout(layout), file(file) {}

  const ModelLayout& layout;
  const SafetensorsReader& file;
  // Per flat parameter: its plan, if it has state, and per positive-dim
  // state the tensor of `file` each parameter's elements come from (empty:
  // zeros).
  std::vector<std::optional<FlatUnitPlan>> plans;
  std::vector<std::map<std::string, std::vector<std::string>>> sources;
  StateMeta infos;  // what the plans point into
  Keep keep;        // what zero_dim points into
  std::vector<TensorSource> zero_dim;
  json sidecar;
};

FullOptimShards::FullOptimShards(std::unique_ptr<Plan> plan)
    : plan_(std::move(plan)) {}

FullOptimShards::~FullOptimShards() = default;

absl::StatusOr<std::unique_ptr<FullOptimShards>> FullOptimShards::Create(
    const ModelLayout& layout, const OptimSidecar& full,
    const SafetensorsReader& file, const std::string& sidecar_name) {
  FLATPARAM_RETURN_IF_ERROR(CheckFullSidecar(full, file, sidecar_name));
  auto plan = std::make_unique<Plan>(layout, file);
  FLATPARAM_ASSIGN_OR_RETURN(plan->infos, ResolveSidecar(full, file));
  const StateMeta& infos = plan->infos;

  // Group keys that are not model parameters are unmanaged parameters, in
  // the optimizer's order (their first appearance), as ShardFullOptimState
  // takes them from OptimStateOptions::unmanaged_params.
  std::vector<std::string> unmanaged;
  for (size_t g = 0; g < full.param_groups.size(); ++g) {
    for (const ParamKey& key : full.param_groups[g].params) {
      const auto* fqn = std::get_if<std::string>(&key);
      if (fqn == nullptr) {
        return absl::DataLossError(absl::StrFormat(
            "%s: param_groups[%d] lists %s, an ID; a full checkpoint is keyed "
            "by name",
            sidecar_name, g, optim::DescribeKey(key)));
      }
      unmanaged.push_back(*fqn);
    }
  }
  const ModelIndex index(layout, unmanaged);
  const auto& flat = layout.flat_params();
  std::vector<std::vector<const ParamStateMeta*>> unit_states(flat.size());
  for (size_t u = 0; u < flat.size(); ++u) {
    unit_states[u].assign(flat[u].params().size(), nullptr);
  }
  OptimSidecar sidecar;
  for (const auto& [key, state] : infos) {
    // CheckFullSidecar: keys are names.
    const std::string* fqn = &std::get<std::string>(key);
    if (const ModelIndex::Pos* pos = index.Managed(key)) {
      unit_states[pos->unit][pos->index] = &state;
      continue;
    }
    auto& out = sidecar.state[key];
    for (const auto& [name, v] : state) {
      if (v.pos_dim || optim::IsTensor(v.value)) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "state '%s' '%s' is a tensor, but '%s' is not a parameter managed "
            "by a flat parameter, and a sharded checkpoint holds only the "
            "tensors of flat parameters",
            *fqn, name, *fqn));
      }
      out[name] = SidecarValue{std::nullopt, v.value};
    }
  }
  plan->plans.resize(flat.size());
  plan->sources.resize(flat.size());
  for (int u = 0; u < index.num_units(); ++u) {
    std::optional<FlatUnitPlan>& unit_plan = plan->plans[u];
    FLATPARAM_ASSIGN_OR_RETURN(unit_plan,
                               PlanFlatUnit(index, u, unit_states[u]));
    if (!unit_plan.has_value()) continue;
    std::vector<std::string> tensor_states;
    for (const auto& [name, unused] : unit_plan->tensors) {
      tensor_states.push_back(name);
      std::vector<std::string>& src = plan->sources[u][name];
      src.resize(flat[u].params().size());
      for (size_t i = 0; i < src.size(); ++i) {
        const ParamStateMeta* st = unit_plan->params[i];
        if (st != nullptr && st->at(name).pos_dim) {
          src[i] = OptimStateTensorName(flat[u].params()[i].fqn, name);
        }
      }
    }
    AddUnitState(u, tensor_states, unit_plan->scalars, sidecar, plan->keep,
                 plan->zero_dim);
  }
  FLATPARAM_ASSIGN_OR_RETURN(
      sidecar.param_groups,
      PlanGroups(index, full.param_groups, /*use_orig_params=*/false));
  FLATPARAM_ASSIGN_OR_RETURN(plan->sidecar,
                             OptimSidecarToJson(sidecar, /*with_extra=*/true));
  return std::unique_ptr<FullOptimShards>(new FullOptimShards(std::move(plan)));
}

void FullOptimShards::AppendUnit(int u, int64_t rank,
                                 std::vector<TensorSource>& out) const {
  if (!plan_->plans[u].has_value()) return;
  const FlatParamLayout* unit = &plan_->layout.flat_params()[u];
  const SafetensorsReader& file = plan_->file;
  for (const auto& [name, state_dtype] : plan_->plans[u]->tensors) {
    const std::vector<std::string>* param_sources = &plan_->sources[u].at(name);
    out.push_back(
        FlatShardSource(OptimShardTensorName(u, name), unit, state_dtype, rank,
                        [&file, param_sources, state_dtype = state_dtype](
                            int i, int64_t begin, int64_t n, char* dst) {
                          const std::string& src = (*param_sources)[i];
                          if (src.empty()) return ZeroRead(state_dtype, n, dst);
                          const size_t size = DTypeSize(state_dtype);
                          return file.ReadRange(src, begin * size,
                                                absl::MakeSpan(dst, n * size));
                        }));
  }
}

void FullOptimShards::AppendZeroDim(std::vector<TensorSource>& out) const {
  out.insert(out.end(), plan_->zero_dim.begin(), plan_->zero_dim.end());
}

const json& FullOptimShards::sidecar() const { return plan_->sidecar; }

}  // namespace internal_checkpoint

}  // namespace checkpoint
}  // namespace flatparam
