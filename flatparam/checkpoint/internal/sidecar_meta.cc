#include "flatparam/checkpoint/internal/sidecar_meta.h"

#include <optional>
#include <utility>
#include <variant>

#include "flatparam/base/status_macros.h"
#include "flatparam/checkpoint/checkpoint_dir.h"

namespace flatparam {
namespace checkpoint {
namespace internal_checkpoint {

using optim::ParamKey;
using optim::ParamState;
using optim::internal_optim::ParamStateMeta;
using optim::internal_optim::StateMeta;
using optim::internal_optim::ValueMeta;

absl::StatusOr<StateMeta> ResolveSidecar(const OptimSidecar& sidecar,
                                         const SafetensorsReader& file) {
  StateMeta out;
  for (const auto& [key, values] : sidecar.state) {
    ParamStateMeta& info = out[key];
    for (const auto& [name, v] : values) {
      ValueMeta& vi = info[name];
      if (!v.tensor.has_value()) {
        vi.value = v.value;
        continue;
      }
      FLATPARAM_ASSIGN_OR_RETURN(const SafetensorsEntry* entry,
                                 file.Find(*v.tensor));
      if (entry->shape.empty()) {
        FLATPARAM_ASSIGN_OR_RETURN(HostTensor t,
                                   file.ReadHostTensor(*v.tensor));
        vi.value = std::move(t);
      } else {
        vi.pos_dim = true;
        vi.dtype = entry->dtype;
        vi.shape = entry->shape;
      }
    }
  }
  return out;
}

void AddUnitState(int64_t u, const std::vector<std::string>& tensor_states,
                  const ParamState& scalars, OptimSidecar& sidecar, Keep& keep,
                  std::vector<TensorSource>& zero_dim) {
  auto& out = sidecar.state[ParamKey(u)];
  for (const std::string& name : tensor_states) {
    out[name] = SidecarValue{OptimShardTensorName(u, name), std::monostate()};
  }
  for (const auto& [name, value] : scalars) {
    if (const auto* t = std::get_if<HostTensor>(&value)) {
      keep.push_back(*t);
      std::string tensor = OptimShardTensorName(u, name);
      zero_dim.push_back(TensorSourceFromHostTensor(tensor, keep.back()));
      out[name] = SidecarValue{std::move(tensor), std::monostate()};
    } else {
      out[name] = SidecarValue{std::nullopt, value};
    }
  }
}

}  // namespace internal_checkpoint
}  // namespace checkpoint
}  // namespace flatparam
