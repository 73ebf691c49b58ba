// PyTorch Distributed Checkpoint (DCP) directories, read without Python:
// what torch.distributed.checkpoint.save (PyTorch 2.x) and
// torch.distributed._shard.checkpoint.save_state_dict (1.13) write for
// FSDP, FSDP2 and torchtitan runs.
//
//   FLATPARAM_ASSIGN_OR_RETURN(DcpReader dcp,
//                              DcpReader::Open(fs, "step-1000"));
//   for (const auto& [key, entry] : dcp.metadata().entries) {
//     if (entry.kind == DcpEntry::Kind::kTensor) {
//       FLATPARAM_ASSIGN_OR_RETURN(HostTensor t, dcp.ReadTensor(key));
//     }
//   }
//
// Format. A directory with a `.metadata` file, a pickle of
// Metadata(state_dict_metadata, planner_data, storage_data[, storage_meta,
// version]), and `.distcp` files. state_dict_metadata maps each key of the
// (flattened) state dict to TensorStorageMetadata(properties, size,
// chunks) or BytesStorageMetadata; storage_data maps MetadataIndex(fqn,
// offset) to _StorageInfo(relative_path, offset, length): the byte range of
// a .distcp file holding the item, a complete torch.save archive (a tensor
// chunk, or any value of a bytes item). 1.13 writes one .distcp file per
// item by default; 2.x concatenates each rank's items into
// __{rank}_{n}.distcp. Both layouts are read, by the 1.13 and 2.x module
// paths of the Metadata classes (internal/pickle.h's kDcpMetadata dialect).
// Items transformed by DCP's extensions (2.x's _StorageInfo
// transform_descriptors, such as zstd) are refused, naming the transform;
// so are checkpoints written by other storage writers (Hugging Face
// safetensors output of DCP is a plain safetensors directory, which
// interop/hf/hf_checkpoint.h reads).
//
// Validation. Open reads and checks `.metadata` whole before anything
// else: anything but the Metadata classes, torch.Size, dtypes and plain
// values is refused unexecuted (FailedPrecondition); each tensor's chunks
// must lie within its size and tile it exactly, neither overlapping nor
// leaving a gap; every chunk and bytes item must have exactly one storage
// entry, and every storage entry an item; a relative_path must be a plain
// file name (no "/", "\", "..", "." or NUL); every byte range must lie
// within its file (sizes checked for overflow). Violations are DataLoss
// naming the key and the values. Reading an item checks that the archive
// holds one tensor of the chunk's dtype and sizes.
//
// A tensor chunk's item must be at least as large as the chunk's bytes
// (torch.save stores them uncompressed), so a .metadata cannot make a read
// allocate more than its files hold.
//
// Memory: the metadata; ReadChunk one chunk (its archive's storage record
// and the tensor: twice its bytes); ReadTensor and ReadBox their result
// plus one chunk at a time. ImportDcpCheckpoint: measured on gpt2-large's
// 3.1 GB of float32 weights saved by 8 ranks (chunks up to 32 MiB), peak
// RSS 254 MiB, 160 MiB of which is fsdp_torch_files with LibTorch loaded
// (README, "PyTorch Distributed Checkpoint").
// Ownership: the reader borrows the FileSystem, which must outlive it.
// Thread-safety: const methods may be called concurrently.
#ifndef FLATPARAM_INTEROP_DCP_DCP_H_
#define FLATPARAM_INTEROP_DCP_DCP_H_

#include <cstdint>
#include <map>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "flatparam/base/dtype.h"
#include "flatparam/checkpoint/file_system.h"
#include "flatparam/flatten.h"
#include "flatparam/interop/hf/hf_checkpoint.h"
#include "flatparam/layout.h"
#include "flatparam/model_layout.h"
#include "flatparam/optim/optim_state.h"

namespace flatparam {
namespace libtorch {

inline constexpr char kDcpMetadataFileName[] = ".metadata";
// .metadata files larger than this are refused unread.
inline constexpr uint64_t kMaxDcpMetadataBytes = uint64_t{1} << 30;

// Where an item's bytes are: a byte range of a file of the checkpoint.
struct DcpStorage {
  std::string file;  // a name in the checkpoint's directory
  uint64_t offset = 0;
  uint64_t length = 0;
};

// One stored piece of a tensor: elements [offsets, offsets + sizes).
struct DcpChunk {
  std::vector<int64_t> offsets;
  std::vector<int64_t> sizes;
  DcpStorage storage;
};

struct DcpEntry {
  enum class Kind { kTensor, kBytes };
  Kind kind = Kind::kTensor;
  // kTensor: the whole tensor's dtype and shape, and its chunks, ordered
  // by offsets.
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;
  std::vector<DcpChunk> chunks;
  // kBytes: the item.
  DcpStorage storage;
};

struct DcpMetadata {
  // "torch.distributed._shard.checkpoint" (PyTorch 1.13) or
  // "torch.distributed.checkpoint" (2.x): the module of Metadata.
  std::string module;
  // Metadata.version (PyTorch >= 2.6), empty when absent.
  std::string version;
  // By key of the flattened state dict.
  std::map<std::string, DcpEntry> entries;
};

// Whether `dir` holds a .metadata file.
absl::StatusOr<bool> IsDcpCheckpoint(checkpoint::FileSystem& fs,
                                     const std::string& dir);

// Parses and validates a .metadata pickle (see the file comment), without
// the checks against the files' sizes. `path` names it in errors.
absl::StatusOr<DcpMetadata> ParseDcpMetadata(const std::string& pickle,
                                             const std::string& path);

class DcpReader {
 public:
  // Reads and validates dir/.metadata, and the sizes of the files it
  // names. NotFound without .metadata; see the file comment.
  static absl::StatusOr<DcpReader> Open(checkpoint::FileSystem& fs,
                                        const std::string& dir);

  const DcpMetadata& metadata() const { return metadata_; }
  const std::string& dir() const { return dir_; }

  // Chunk `index` of tensor `key` as stored. NotFound for an unknown key,
  // InvalidArgument for a bytes item or an index out of range.
  absl::StatusOr<HostTensor> ReadChunk(const std::string& key,
                                       size_t index) const;
  // Tensor `key` whole, assembled from its chunks.
  absl::StatusOr<HostTensor> ReadTensor(const std::string& key) const;
  // The box [offsets, offsets + sizes) of tensor `key`, from the chunks
  // that meet it (only those are read): a rank's own rows of a checkpoint
  // saved at another world size. InvalidArgument for a box outside the
  // tensor or a bytes item.
  absl::StatusOr<HostTensor> ReadBox(const std::string& key,
                                     const std::vector<int64_t>& offsets,
                                     const std::vector<int64_t>& sizes) const;
  // Bytes item `key` (a torch.save'd value) as JSON: None null, bool,
  // int, float, str, lists and tuples arrays, dicts with str or int keys
  // objects (int keys as their decimal text). FailedPrecondition for a
  // value holding a tensor or anything else.
  absl::StatusOr<nlohmann::json> ReadBytes(const std::string& key) const;

 private:
  DcpReader(checkpoint::FileSystem& fs, std::string dir, DcpMetadata metadata)
      : fs_(&fs), dir_(std::move(dir)), metadata_(std::move(metadata)) {}

  checkpoint::FileSystem* fs_;
  std::string dir_;
  DcpMetadata metadata_;
};

// The optimizer state under `prefix` (keys as DcpImportOptions describes)
// as a full state dict keyed by parameter name, every tensor read whole:
// for loading into a running job. `params` are the model's parameter
// names. An empty dict when there is none; FailedPrecondition for a key
// that is not of a parameter of `params`, groups naming other names, or
// state without groups.
absl::StatusOr<optim::OptimStateDict> ReadDcpOptimState(
    const DcpReader& dcp, const std::string& prefix,
    const std::vector<std::string>& params);

struct DcpImportOptions {
  // cast, ignored_suffixes, names and convert as for safetensors
  // (weights_only is decided by `optimizer` and what the checkpoint holds).
  checkpoint::HfImportOptions hf;
  // The prefix of the model's keys: "model." where DCP flattened
  // {"model": ..., "optim": ...}, "" for keys at the top level (FSDP1's
  // SHARDED_STATE_DICT, torchtitan). Unset: whichever holds more of the
  // model's parameters.
  std::optional<std::string> model_prefix;
  // The prefix of the optimizer's keys, which are
  // "<prefix>state.<fqn>.<state name>" and either "<prefix>param_groups" (a
  // bytes item: the list of groups, "params" naming parameters by FQN) or
  // "<prefix>param_groups.<fqn>.<hyperparameter>"
  // (get_optimizer_state_dict(..., flatten_optimizer_state_dict=True):
  // parameters with equal hyperparameters become one group). Unset: the
  // first of "optim.", "optimizer." and "" under which a parameter of the
  // model has state; none: weights only.
  std::optional<std::string> optim_prefix;
  // Import the optimizer state when there is some.
  bool optimizer = true;
};

// Imports the DCP checkpoint in `in_dir` (model and, with
// options.optimizer, optimizer state) into a sharded checkpoint of `spec`
// at `world_size` ranks in `out_dir`, as ImportHfCheckpoint does (same
// checks of names, dtypes, shapes and tied copies, same report; errors name
// `in_dir`). The tensors are staged as safetensors in a sibling of
// `out_dir` (removed afterwards) and read chunk by chunk: for tensors
// chunked on their first dimension (FSDP, FSDP2, torchtitan) one chunk is
// in memory at a time; other chunkings hold one whole tensor. On error
// `out_dir` is unchanged.
absl::StatusOr<checkpoint::HfImportReport> ImportDcpCheckpoint(
    checkpoint::FileSystem& fs, const std::string& in_dir,
    const ModelSpec& spec, const LayoutOptions& layout_options,
    int64_t world_size, const std::string& out_dir,
    const DcpImportOptions& options = {});

}  // namespace libtorch
}  // namespace flatparam

#endif  // FLATPARAM_INTEROP_DCP_DCP_H_
