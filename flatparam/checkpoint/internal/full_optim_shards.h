// Private to //flatparam/checkpoint: the optimizer half of sharding a full
// checkpoint, planned once for every rank. ShardCheckpoint (convert.h)
// uses it for a full checkpoint's optim.safetensors and optim.json, and
// ImportHfCheckpoint (flatparam/interop/hf/hf_checkpoint.h) for the same two
// files beside a Hugging Face-style model.safetensors, so both write the same
// bytes. Implemented in full_optim_shards.cc; the sidecar helpers it shares
// with the reshard are internal/sidecar_meta.h's.
//
//   FLATPARAM_ASSIGN_OR_RETURN(OptimSidecar full,
//                              ParseOptimSidecar(doc, sidecar_name));
//   FLATPARAM_ASSIGN_OR_RETURN(
//       std::unique_ptr<FullOptimShards> optim,
//       FullOptimShards::Create(layout, full, optim_file, sidecar_name));
//   for each rank r: for each flat parameter u:
//     rank.tensors.push_back(<"flat_params.{u}">);
//     optim->AppendUnit(u, r, rank.tensors);
//   optim->AppendZeroDim(rank.tensors); rank.sidecar = optim->sidecar();
//
// Ownership: borrows the layout and the optim.safetensors reader, which
// must outlive it and every TensorSource it hands out; those sources point
// into it (it is not movable). Thread-safety: const methods only read.
#ifndef FLATPARAM_CHECKPOINT_INTERNAL_FULL_OPTIM_SHARDS_H_
#define FLATPARAM_CHECKPOINT_INTERNAL_FULL_OPTIM_SHARDS_H_

#include <cstdint>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "flatparam/checkpoint/safetensors.h"
#include "flatparam/checkpoint/training_state.h"
#include "flatparam/layout.h"

namespace flatparam {
namespace checkpoint {
namespace internal_checkpoint {

class FullOptimShards {
 public:
  // Checks `sidecar` (parsed from `sidecar_name`, optim.json) against
  // `file` (optim.safetensors) as ReadFullState does (CheckFullSidecar:
  // DataLoss), then plans each flat parameter's state by the flat path's
  // rules and the sharded param groups, with ShardCheckpoint's errors
  // (convert.h; DataLoss for a group that lists an ID, InvalidArgument for
  // what cannot be flattened or a tensor state of a key that no flat
  // parameter manages). Reads the 0-d tensors of `file`.
  static absl::StatusOr<std::unique_ptr<FullOptimShards>> Create(
      const ModelLayout& layout, const OptimSidecar& sidecar,
      const SafetensorsReader& file, const std::string& sidecar_name);

  FullOptimShards(const FullOptimShards&) = delete;
  FullOptimShards& operator=(const FullOptimShards&) = delete;
  ~FullOptimShards();

  // Appends shard-group rank `rank`'s shards of flat parameter `u`'s
  // positive-dimension states ("optim.{u}.{state}", streamed from `file`,
  // zeros for a parameter without the state), in name order: what a rank
  // file holds right after "flat_params.{u}". Nothing when `u` has no
  // state.
  void AppendUnit(int u, int64_t rank, std::vector<TensorSource>& out) const;
  // Appends the 0-d states, which every rank file holds after all flat
  // parameters.
  void AppendZeroDim(std::vector<TensorSource>& out) const;
  // Every rank's sidecar ("extra" empty).
  const nlohmann::json& sidecar() const;

 private:
  struct Plan;
  explicit FullOptimShards(std::unique_ptr<Plan> plan);

  std::unique_ptr<Plan> plan_;
};

}  // namespace internal_checkpoint
}  // namespace checkpoint
}  // namespace flatparam

#endif  // FLATPARAM_CHECKPOINT_INTERNAL_FULL_OPTIM_SHARDS_H_
