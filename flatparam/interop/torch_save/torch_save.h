// PyTorch's own files in and out: `torch.save` state dicts (Hugging Face's
// legacy pytorch_model.bin, single or index-sharded) and full optimizer
// state dicts (`optimizer.state_dict()`, keyed by parameter ID, or
// FSDP.full_optim_state_dict / optim_state_dict, keyed by name), imported
// into flatparam checkpoints at any world size and exported back as files
// that Python's `torch.load` (weights_only=True included) reads.
//
//   // Import, FULL_SHARD on 3 ranks:
//   FLATPARAM_ASSIGN_OR_RETURN(
//       auto report,
//       ImportTorchCheckpoint(fs, "gpt2/pytorch_model.bin", spec,
//                             {.world_size = 3}, 0, "ckpt",
//                             {.optimizer = "gpt2/optimizer.pt"}));
//   // Export:
//   FLATPARAM_RETURN_IF_ERROR(
//       ExportTorchCheckpoint(fs, "ckpt", "out", {}).status());
//
// File format. torch.save's zip format (the default since PyTorch 1.6): a
// zip archive "<name>/data.pkl" (a protocol-2 pickle) plus one record
// "<name>/data/<key>" per storage. The archive is written by LibTorch's own
// zip code (caffe2::serialize::PyTorchStreamWriter) and read through
// libzip (internal/zip_reader.h), streaming: a record is read only when
// its size is what its use needs (a storage's record holds exactly its
// storage's bytes; DataLoss otherwise), so a deflated record cannot
// inflate past that (LibTorch's reader inflated any record whole at the
// size the archive claims); stored and deflated records are read, and
// every record's CRC-32 is checked.
// The pickle is read by a restricted unpickler (internal/pickle.h, shared
// with the DCP reader), not LibTorch's:
// LibTorch 1.13's C++ unpickler (torch::pickle_load) cannot read what
// Python writes (an OrderedDict with _metadata: "Expected GenericDict but
// got None"; a one-element list or dict, opcodes APPEND and SETITEM:
// "Unknown opcode for unpickling"). The restricted unpickler executes
// nothing: it knows the opcodes torch.save emits and exactly these globals,
// which it interprets itself:
//   collections.OrderedDict                 (an empty dict; BUILD state
//                                            such as _metadata is dropped)
//   torch._utils._rebuild_tensor_v2         (a tensor viewing a storage)
//   torch._utils._rebuild_parameter         (its tensor)
//   torch.{Float,Double,Half,BFloat16,Long,Int,Short,Char,Byte,Bool}Storage
// Any other global (os.system, a user's class, ...) is refused when its
// GLOBAL opcode is read, naming it (FailedPrecondition), as is any other
// opcode. Values are None, bool, int (64-bit), float, str, tuples, lists,
// dicts and tensors, nested at most 100 containers deep, and no container
// may hold itself (DataLoss: the value could not be freed or walked
// without recursion otherwise). Tensors are copied out of their storages
// into owned
// contiguous HostTensors (any strides, offsets within the storage checked).
// The legacy non-zip format (_use_new_zipfile_serialization=False) is
// refused (FailedPrecondition, saying how to re-save), as are big-endian
// storages (PyTorch >= 2.1's "byteorder" record); a damaged or
// truncated archive or pickle is DataLoss naming the file. Nothing read
// from a file can make LibTorch throw past this API.
//
// Writing emits the same protocol-2 pickle Python writes (state dicts as
// collections.OrderedDict, other dicts plain, betas as a tuple; storages
// "0", "1", ... one per tensor, little-endian, on 'cpu'), using only the
// globals above, so `torch.load(f, weights_only=True)` accepts a state
// dict. (PyTorch 1.13's weights_only unpickler has no BINFLOAT opcode, so
// it refuses every optimizer state dict with a float in it, Python's own
// included: those load with plain torch.load.)
//
// Import (ImportTorchCheckpoint). The input is a directory holding
// pytorch_model.bin or pytorch_model.bin.index.json (both: ambiguous,
// refused), or the path of a .bin file or of an index (same schema as
// model.safetensors.index.json: "weight_map" name -> file; each listed
// file must hold exactly the tensors mapped to it; "metadata"."total_size",
// when present, must equal the tensors' byte sizes). The tensors, and the
// optimizer state of `optimizer` if given, are then checked against the
// model and sharded by the Hugging Face import (interop/hf/hf_checkpoint.h),
// which they are handed to as safetensors of the same form (model.safetensors,
// or one file per .bin plus an index) + optim.safetensors + optim.json in
// a directory written next to `out_dir` (removed afterwards): so names,
// dtypes, shapes, tied copies, ignored buffers, casts and renaming are
// checked and reported exactly as for safetensors (messages name the
// user's files, not the staged ones), and the output equals,
// byte for byte, the import of the same tensors from safetensors.
// An optimizer state dict must be {"state": {key: {name: value}},
// "param_groups": [{hyperparameter: value, "params": [key, ...]}]} with
// values None, bool, int, float, str or tensors (hyperparameters: a tuple
// or list of numbers is a tuple of floats); keys are all IDs or all
// names. ID i is the model's i-th parameter in parameters() order
// (optim_state.h's ModelParamOrder, as an optimizer built from
// model.parameters() numbers them); names are the model's FQNs.
// Anything else is FailedPrecondition naming the path inside the dict.
//
// Export (ExportTorchCheckpoint). The input is a full or sharded
// checkpoint. The weights are exported as ExportHfCheckpoint exports them
// (names, order, max_shard_bytes splitting, dtype cast), into
// pytorch_model.bin or pytorch_model-{i:05d}-of-{n:05d}.bin plus
// pytorch_model.bin.index.json, and each tied name of the model (a
// sharded checkpoint's layout, or `model` for a full one) is written too,
// after the file's tensors, over its target's storage, as `state_dict()`
// holds it and torch.save writes it: Python's load_state_dict(strict=True)
// takes the file, and torch.load gives the names one storage. (The
// safetensors export writes a tied parameter once, as transformers'
// save_pretrained does: safetensors cannot share storage, and
// from_pretrained re-ties it.) The index maps a tied name to its target's
// file; its total_size counts each storage once. The optimizer state, if the
// checkpoint has any (and `optimizer` is set), is consolidated and written
// to optimizer.bin as PyTorch's optimizer.state_dict() lays it out, keyed
// by ID or, with kParamName, by name as FSDP.full_optim_state_dict writes
// it. IDs are those of the import: ID i is the model's i-th parameter
// (`param_order`); every param group lists its parameters in that order
// (a checkpoint keeps groups, not their order), so that the file is what
// optimizer.state_dict() writes for an optimizer whose groups list the
// model's parameters in model order (one group of model.parameters(), the
// common case), and load_state_dict, which pairs parameters by position,
// gets each state to its parameter. The
// output directory is written in a temporary sibling and renamed into
// place; an existing `out_dir` is replaced only with convert.overwrite.
// Neither function writes over its input: an `out_dir` that is, or holds,
// an input (by spelling) is InvalidArgument.
//
// Memory: a torch.save file is read whole (its pickle and storages); an
// import holds one input file's tensors at a time (an index-sharded
// checkpoint is staged file by file) plus, with `optimizer`, the whole
// optimizer state; an export holds one output file's tensors, then the
// whole optimizer state. Disk: the import stages a copy of its inputs.
// Thread-safety: the functions are reentrant; the FileSystem is borrowed.
#ifndef FLATPARAM_INTEROP_TORCH_SAVE_TORCH_SAVE_H_
#define FLATPARAM_INTEROP_TORCH_SAVE_TORCH_SAVE_H_

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "flatparam/base/dtype.h"
#include "flatparam/checkpoint/convert.h"
#include "flatparam/checkpoint/file_system.h"
#include "flatparam/flatten.h"
#include "flatparam/interop/hf/hf_checkpoint.h"
#include "flatparam/layout.h"
#include "flatparam/model_layout.h"
#include "flatparam/optim/optim_state.h"

namespace flatparam {
namespace libtorch {

inline constexpr char kTorchModelFileName[] = "pytorch_model.bin";
inline constexpr char kTorchIndexFileName[] = "pytorch_model.bin.index.json";
inline constexpr char kTorchOptimFileName[] = "optimizer.bin";
// torch.save files larger than this are refused unread.
inline constexpr uint64_t kMaxTorchFileBytes = uint64_t{64} << 30;

// A state dict as torch.save stores it: names and tensors, in the file's
// order.
using TorchStateDict = std::vector<std::pair<std::string, HostTensor>>;

// Reads the torch.save file at `path` holding a dict of tensors (a
// state_dict; OrderedDict or dict). Errors: see the file comment; a
// non-string key or a value that is not a tensor is FailedPrecondition
// naming it.
absl::StatusOr<TorchStateDict> ReadTorchStateDict(checkpoint::FileSystem& fs,
                                                  const std::string& path);

// Writes `tensors` to `path` as torch.save writes a state_dict (an
// OrderedDict in the given order). InvalidArgument for a repeated name;
// the file system's errors (a partial file is removed). Not atomic: write
// to a temporary name and rename for that.
// The same with tied names: each (name, target) is written after the
// tensors as a second tensor over `target`'s storage, as torch.save writes
// a state_dict() whose names share a parameter. InvalidArgument for a
// target that is not among `tensors`.
absl::Status WriteTorchStateDict(
    checkpoint::FileSystem& fs, const std::string& path,
    const TorchStateDict& tensors,
    const std::vector<std::pair<std::string, std::string>>& tied);
absl::Status WriteTorchStateDict(checkpoint::FileSystem& fs,
                                 const std::string& path,
                                 const TorchStateDict& tensors);

// Reads the torch.save file at `path` holding a full optimizer state dict
// (see the file comment), keys as stored (IDs or names).
absl::StatusOr<optim::OptimStateDict> ReadTorchOptimStateDict(
    checkpoint::FileSystem& fs, const std::string& path);

// Writes `dict` to `path` as torch.save writes optimizer.state_dict()
// (plain dicts; vector<double> hyperparameters as tuples). Errors as
// WriteTorchStateDict's.
absl::Status WriteTorchOptimStateDict(checkpoint::FileSystem& fs,
                                      const std::string& path,
                                      const optim::OptimStateDict& dict);

struct TorchImportOptions {
  // cast, ignored_suffixes, names, convert: as for safetensors.
  // (weights_only is ignored: only `optimizer` brings optimizer state.)
  checkpoint::HfImportOptions hf;
  // A torch.save file of the optimizer's full state dict to import with
  // the weights; empty for none.
  std::string optimizer;
};

// Imports the torch.save checkpoint at `in` (and `options.optimizer`) into
// a sharded checkpoint at `out_dir`, as ImportHfCheckpoint does (same
// arguments, errors and report). On error `out_dir` is unchanged.
absl::StatusOr<checkpoint::HfImportReport> ImportTorchCheckpoint(
    checkpoint::FileSystem& fs, const std::string& in, const ModelSpec& spec,
    const LayoutOptions& layout_options, int64_t world_size,
    const std::string& out_dir, const TorchImportOptions& options = {});

struct TorchExportOptions {
  checkpoint::ConvertOptions convert;
  // As HfExportOptions: the most tensor bytes in one file, a cast.
  uint64_t max_shard_bytes = checkpoint::kHfDefaultMaxShardBytes;
  std::optional<DType> dtype;
  // Write optimizer.bin when the checkpoint has optimizer state.
  bool optimizer = true;
  optim::OptimStateKeyType optimizer_keys = optim::OptimStateKeyType::kParamId;
  // The model's parameters in parameters() order (optim_state.h's
  // ModelParamOrder), which numbers them and orders every param group's
  // "params". Empty: a sharded checkpoint's own model's; for a full
  // checkpoint (which does not record it), the order its param groups
  // list them in.
  std::vector<std::string> param_order;
  // The model, for the tied names of a full checkpoint (which records no
  // model); a sharded checkpoint's layout.json gives them otherwise.
  std::optional<ModelSpec> model;
};

struct TorchExportReport {
  // The files written, in order: weights, index (if any), optimizer.bin.
  std::vector<std::string> files;
  int64_t tensors = 0;
  uint64_t total_size = 0;
  bool optimizer = false;
};

// Exports the checkpoint at `in_dir` to `out_dir` (see the file comment).
// Errors: ExportHfCheckpoint's and the readers'; on error `out_dir` is
// unchanged.
absl::StatusOr<TorchExportReport> ExportTorchCheckpoint(
    checkpoint::FileSystem& fs, const std::string& in_dir,
    const std::string& out_dir, const TorchExportOptions& options = {});

}  // namespace libtorch
}  // namespace flatparam

#endif  // FLATPARAM_INTEROP_TORCH_SAVE_TORCH_SAVE_H_
