// The mapping between in-memory training state (parameters and optimizer
// state dicts, flatparam/optim/optim_state.h) and the checkpoint
// directories of checkpoint_dir.h: what goes into which safetensors tensor
// and what into the JSON sidecars (rank{r:05d}.json of a sharded
// checkpoint, optim.json of a full one).
//
//   // Saving rank r of a sharded checkpoint (all ranks at once here):
//   std::vector<RankState> states = ...;  // one per shard-group rank
//   ShardedCheckpointContent content{&layout, world_size, {}};
//   for (int64_t r = 0; r < G; ++r) {
//     FLATPARAM_ASSIGN_OR_RETURN(RankContent c,
//                                MakeRankContent(layout, r, states[r]));
//     content.ranks.push_back(std::move(c));
//   }
//   FLATPARAM_RETURN_IF_ERROR(WriteShardedCheckpoint(fs, dir, content));
//   // Loading it back:
//   FLATPARAM_ASSIGN_OR_RETURN(auto reader,
//                              ShardedCheckpointReader::Open(fs, dir));
//   FLATPARAM_ASSIGN_OR_RETURN(RankState mine, ReadRankState(reader, r));
//
// Sidecar schema ("flatparam.optim.v1"). Both sidecars are one JSON object:
//
//   {
//     "format": "flatparam.optim.v1",
//     "state": [                               one entry per parameter key,
//       {"key": 0,                             in ParamKey order (IDs, then
//        "values": {                           names); "key" is an integer
//          "exp_avg": {"tensor": "optim.0.exp_avg"},  (flat-parameter index)
//          "step":    {"tensor": "optim.0.step"},     or a string (FQN or a
//          "count":   {"int": 3},                     user-defined key)
//          "decay":   {"float": 0.5},
//          "scale":   {"float": "-inf"},
//          "on":      {"bool": true},
//          "kind":    {"str": "adam"},
//          "momentum_buffer": {"none": null}}},
//       ...
//     ],
//     "param_groups": [
//       {"params": [0, 2, "ignored.weight"],   keys as in "state"
//        "hyperparams": {"lr": {"float": 0.001},
//                        "betas": {"floats": [0.9, 0.999]},
//                        "foreach": {"none": null}, ...}},
//       ...
//     ],
//     "extra": {...}                           rank sidecars only: free-form
//   }
//
// Every value is a one-member object whose name is its Python type, so the
// type survives the round trip (3 vs 3.0 vs True). "tensor" names the
// tensor holding the value in the companion safetensors file: in a rank
// file OptimShardTensorName(i, state) ("optim.{i}.{state}"), in
// optim.safetensors OptimStateTensorName(fqn, state) ("state.{fqn}.{state}")
// -- the sidecar is what tells "state.a.b.c" apart as fqn "a.b" / state "c"
// or fqn "a" / state "b.c". Every tensor of the state must be listed exactly
// once. Floats are JSON numbers, printed with enough digits to read back
// the same double (-0.0 included), except the non-finite ones, which are
// the strings "inf", "-inf", "nan" (the canonical quiet NaN
// 0x7ff8000000000000) or "nan:XXXXXXXXXXXXXXXX" (any other NaN, its 64-bit
// pattern in hex), so every float round-trips bit for bit. Integers are
// int64. A string that is not valid UTF-8 (which JSON cannot hold) is
// {"str_bytes": "<hex of its bytes>"}. Keys, state names and
// hyperparameter names must be valid UTF-8.
//
// What the format cannot hold is InvalidArgument when writing: in a rank,
// an int key that is not a flat-parameter index, a tensor under a string
// key (rank files hold only flat-parameter tensors), a positive-dimension
// tensor that is not the 1-D padded shard; in a full checkpoint, an int key
// (re-key by name first: optim_state.h's RekeyOptimStateDict), two tensors
// with one safetensors name. Anything malformed when reading is DataLoss
// naming the file and the JSON path.
//
// Ownership: Make*Content borrow their state (the TensorSources point into
// it; it must outlive the write); Read* return owned copies. Thread-safety:
// pure functions (plus the readers' file access).
#ifndef FLATPARAM_CHECKPOINT_TRAINING_STATE_H_
#define FLATPARAM_CHECKPOINT_TRAINING_STATE_H_

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "flatparam/checkpoint/checkpoint_dir.h"
#include "flatparam/flatten.h"
#include "flatparam/model_layout.h"
#include "flatparam/optim/optim_state.h"

namespace flatparam {
namespace checkpoint {

inline constexpr char kOptimSidecarFormat[] = "flatparam.optim.v1";

// One rank of a sharded checkpoint (flat-parameter path).
struct RankState {
  // flat_params[i]: this rank's padded shard of flat parameter i (1-D,
  // layout.flat_params()[i] sharded numel, the flat param's dtype).
  std::vector<HostTensor> flat_params;
  // The flat path's sharded optimizer state (fsdp_optim.h): keyed by
  // flat-parameter index (int64 ParamKey); positive-dim tensor states are
  // padded 1-D shards of the same numel; 0-d and non-tensor states
  // replicated. Plus param_groups. String keys (unmanaged or user-defined
  // states) may hold non-tensor values only.
  optim::OptimStateDict optim;
  // Free-form JSON object stored under "extra" in rank{r}.json (the trainer
  // keeps its step counter and options here). Empty object by default.
  nlohmann::json extra = nlohmann::json::object();
  // This rank's buffers by FQN ("buffers.{fqn}" in the rank file): exactly
  // the layout spec's buffers, each whole, with its shape and dtype.
  std::map<std::string, HostTensor> buffers;
};

// Rank `rank`'s files for `state` under `layout`. Borrowing: the returned
// RankContent's TensorSources point into `state`, which must outlive the
// write. InvalidArgument naming key/state for what the format cannot hold
// (see the file comment), a rank outside the layout's world, or flat
// parameters or buffers that do not match the layout's.
absl::StatusOr<RankContent> MakeRankContent(const ModelLayout& layout,
                                            int64_t rank,
                                            const RankState& state);

// Reads rank `rank` whole (tensors and sidecar). DataLoss naming the file
// for a sidecar that does not follow the schema or does not match the rank
// file's tensors.
absl::StatusOr<RankState> ReadRankState(const ShardedCheckpointReader& reader,
                                        int64_t rank);

// The RankState that ReadRankState would return for the files
// WriteShardedCheckpoint writes from `content` as shard-group rank `rank`
// of `layout`, without writing them: every tensor is pulled from its
// source into an owned HostTensor, the sidecar is parsed. InvalidArgument,
// naming the tensor or the JSON path, for content that does not fit
// `layout` or the sidecar schema.
absl::StatusOr<RankState> RankStateFromContent(const ModelLayout& layout,
                                               int64_t rank,
                                               const RankContent& content);

// A consolidated checkpoint's content.
struct FullState {
  // model.safetensors by FQN: the parameters and, for a model with buffers,
  // the buffers (a state dict; CheckFitsModel tells them apart by the spec).
  std::map<std::string, HostTensor> params;
  // The full dict keyed by FQN (or user-defined string keys).
  optim::OptimStateDict optim;
};

// Borrows `state` like MakeRankContent. Parameters are stored in map (FQN)
// order.
absl::StatusOr<FullCheckpointContent> MakeFullContent(const FullState& state);
absl::StatusOr<FullState> ReadFullState(const FullCheckpointReader& reader);

// ---------------------------------------------------------------------------
// The sidecar schema on its own, for tools that stream tensors instead of
// loading them (convert.h).

// A state value as the sidecar records it: a tensor by its safetensors
// name, or any other value in full (never a HostTensor).
struct SidecarValue {
  std::optional<std::string> tensor;
  optim::OptimStateValue value;
};

struct OptimSidecar {
  std::map<optim::ParamKey, std::map<std::string, SidecarValue>> state;
  std::vector<optim::ParamGroup> param_groups;
  // Rank sidecars: the "extra" object; empty object when absent.
  nlohmann::json extra = nlohmann::json::object();
};

// The document above. `with_extra` adds "extra" (rank sidecars).
// InvalidArgument for a HostTensor among the values or an invalid UTF-8
// string.
absl::StatusOr<nlohmann::json> OptimSidecarToJson(const OptimSidecar& sidecar,
                                                  bool with_extra);
// Parses a sidecar; DataLoss naming `file` and the JSON path of the first
// problem ("rank00001.json: state[2].values.step: ...").
absl::StatusOr<OptimSidecar> ParseOptimSidecar(const nlohmann::json& doc,
                                               absl::string_view file);

// Checks a parsed rank sidecar against its rank file, as ReadRankState
// does before reading a tensor: every int key is a flat-parameter index in
// [0, num_flat_params) (even one without tensors: MakeRankContent refuses
// others); every tensor value sits under such a key, names
// OptimShardTensorName(key, state) and is in `file`; every "optim.*"
// tensor of `file` is named exactly once. DataLoss naming `sidecar_name`.
// Tools that stream the tensors instead of reading them (convert.h) check
// with this too, so that they accept exactly what ReadRankState does.
absl::Status CheckRankSidecar(const OptimSidecar& sidecar,
                              const SafetensorsReader& file,
                              int64_t num_flat_params,
                              absl::string_view sidecar_name);
// The same for a full checkpoint's optim.json against optim.safetensors,
// as ReadFullState does: every key is a name (MakeFullContent refuses int
// keys); every tensor value names OptimStateTensorName(fqn, state), is in
// `file`, and no two states name the same tensor ("a.b" + "c" and "a" +
// "b.c" would); every "state.*" tensor of `file` is named.
absl::Status CheckFullSidecar(const OptimSidecar& sidecar,
                              const SafetensorsReader& file,
                              absl::string_view sidecar_name);

// Individual values, for the same schema: {"float": 0.5} etc.
absl::StatusOr<nlohmann::json> OptimValueToJson(
    const optim::OptimStateValue& value);
absl::StatusOr<nlohmann::json> HyperValueToJson(const optim::HyperValue& value);

}  // namespace checkpoint
}  // namespace flatparam

#endif  // FLATPARAM_CHECKPOINT_TRAINING_STATE_H_
