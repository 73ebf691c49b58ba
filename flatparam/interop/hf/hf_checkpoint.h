// Hugging Face checkpoints in and out: importing a model's weights as the
// ecosystem publishes them straight into a sharded checkpoint
// (checkpoint_dir.h) for any world size, and exporting a full or sharded
// checkpoint in the ecosystem's form. The tools behind `fsdp checkpoint
// shard` (given such a checkpoint) and `fsdp checkpoint export`.
//
// The two forms (what `transformers`' save_pretrained and
// huggingface_hub's split_torch_state_dict_into_shards write):
//
//   single file:    model.safetensors
//   index-sharded:  model-00001-of-00004.safetensors ... plus
//                   model.safetensors.index.json:
//                     {"metadata": {"total_size": 16060522496},
//                      "weight_map": {"lm_head.weight":
//                                         "model-00004-of-00004.safetensors",
//                                     ...}}
//
// Import (ImportHfCheckpoint). The input is a directory holding one of the
// two forms (both at once is ambiguous and refused), or the path of a
// .safetensors file or of an index file. Everything is checked before a
// byte is written, and every problem found is reported at once (up to
// kMaxReportedProblems), each naming the file, the tensor and what differs:
//   - every file's header, by SafetensorsReader (DataLoss for a damaged
//     file);
//   - the index: a JSON object with a "weight_map" object of plain file
//     names (no '/'); each entry's file must hold the tensor; each tensor of
//     a listed file must be in the weight_map under that file;
//     "metadata"."total_size", when present, must equal the sum of the
//     tensors' byte sizes (DataLoss otherwise);
//   - names are cleaned (CleanTensorName) and must stay distinct;
//   - against the model spec (FailedPrecondition): every untied parameter
//     and every buffer of the spec (model_layout.h's BufferSpec; each rank of
//     the import starts from the file's) present with the spec's shape and
//     dtype; no tensor that is neither (except those whose names end in one
//     of
//     `ignored_suffixes`, by default Hugging Face's recomputed
//     ".rotary_emb.inv_freq"); a tied parameter (e.g. lm_head.weight tied
//     to the embedding) may be present as the exporter wrote it -- it must
//     then equal its tie's target in dtype, shape and every byte (compared
//     streaming), and if the target itself is absent the tied copy is read
//     in its place.
// Dtype: a tensor whose dtype differs from the spec's is an error naming
// both, unless `cast` is set: then floating-point values are converted as
// PyTorch casts them (round to nearest even; flatparam/base/dtype.h). Give
// the model the file's dtype instead (`--dtype`) to keep the values as
// they are.
// Optimizer state. Beside the weights, an input directory may hold the
// optimizer state of a full checkpoint as this project writes it
// (checkpoint_dir.h): optim.safetensors, every tensor state
// "state.{fqn}.{state_name}" (0-d ones, e.g. Adam's step, shape []), and
// optim.json, in either of two forms:
//   - this project's sidecar (training_state.h, "format":
//   "flatparam.optim.v1"),
//     read and checked as ShardCheckpoint reads a full checkpoint's;
//   - PyTorch's param_groups as json.dumps(optimizer.state_dict()
//     ["param_groups"]) writes them, a JSON array:
//       [{"lr": 0.001, "betas": [0.9, 0.999], "eps": 1e-08,
//         "weight_decay": 0, "foreach": null, ..., "params": [0, 1, 2]}]
//     or the same array as {"param_groups": [...]} (an empty "state"
//     allowed beside it). "params" lists parameter IDs, ID i being the
//     model's i-th parameter in parameters() order (each shared parameter
//     once, under its first name: optim_state.h's ModelParamOrder), or
//     parameter names, as FSDP.full_optim_state_dict() lists them (a tied
//     name stands for its parameter); the other members are
//     hyperparameters (null, bool, int, float, str; a list of numbers is a
//     tuple of floats). The state is then optim.safetensors's tensors, each
//     under the parameter its name names (a tied alias is refused: PyTorch
//     keeps one state per shared parameter, under its first name).
// The optimizer's FQNs are the model's (neither cleaned nor renamed).
// Checked before anything is written: every optim.safetensors tensor
// belongs to a parameter and is shaped like it or 0-d (FailedPrecondition),
// optim.json follows its form (DataLoss), and the state flattens by
// PyTorch's rules (convert.h; InvalidArgument). The state is then sharded
// with the weights, and the output is exactly what ShardCheckpoint writes
// for a full checkpoint of the same weights and optimizer state (with
// PyTorch's form: of its translation to this project's), byte for byte.
// Optimizer state that cannot be imported is refused, naming the file,
// unless `weights_only` is set: a file of another tool (one whose name
// starts with "optimizer", "optim." or "optim_": optimizer.pt,
// optimizer.bin, ..., pickles of torch objects), or optim.safetensors or
// optim.json without the other. With `weights_only` every such file,
// importable or not, is left behind and listed in the report
// (HfImportReport::optimizer_left_behind); the imported checkpoint then
// has no optimizer state (its sidecars list no state and no param
// groups), as sharding a checkpoint of `fsdp checkpoint init
// --optimizer=none` gives. Without optimizer state, the output is exactly
// what ShardCheckpoint writes for a full checkpoint of the same weights
// without optimizer state, byte for byte.
//
// Export (ExportHfCheckpoint). The input is a full or a sharded checkpoint
// (verified as the readers do). Tensors are named as in the model spec
// and come in its order (a sharded checkpoint's layout.json; a full
// checkpoint's model.safetensors, in its order), each untied parameter
// once: a tied parameter is written only under its target's name, as
// save_pretrained does (from_pretrained re-ties it); then the model's
// buffers, as save_pretrained writes persistent buffers (a sharded
// checkpoint's shard-group rank 0's). Tensors are split at
// tensor boundaries into files of at most `max_shard_bytes` of tensor data
// with huggingface_hub's algorithm (a tensor larger than the cap gets a
// file of its own; otherwise a tensor that would overflow the current file
// starts the next); one file is written as model.safetensors alone, more as
// model-{i:05d}-of-{n:05d}.safetensors plus model.safetensors.index.json
// ("total_size": the sum of the tensors' byte sizes; "weight_map": name ->
// file; keys sorted, 2-space indent). Each file's __metadata__ is
// {"format": "pt"}. `dtype` casts every floating-point tensor (round to
// nearest even). Only weights are exported: optimizer state stays behind,
// and config.json / tokenizer files are the user's to copy.
// The output directory is written as checkpoint_dir.h writes (temporary
// directory, fsync, rename; the previous content replaced only when the
// new one is complete), but holds no manifest.json: it is not a flatparam
// checkpoint. An output directory that is, or holds, the input is refused
// (for import too).
//
// Streaming and memory are those of convert.h: every output tensor is
// filled chunk by chunk from byte ranges of the inputs; a cast converts
// through a scratch buffer of at most kCastScratchBytes.
//
// Thread-safety: the functions are reentrant; the FileSystem is borrowed.
// An HfCheckpointReader's const methods may be called from several threads.
#ifndef FLATPARAM_INTEROP_HF_HF_CHECKPOINT_H_
#define FLATPARAM_INTEROP_HF_HF_CHECKPOINT_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "flatparam/base/dtype.h"
#include "flatparam/checkpoint/convert.h"
#include "flatparam/checkpoint/file_system.h"
#include "flatparam/checkpoint/safetensors.h"
#include "flatparam/layout.h"
#include "flatparam/model_layout.h"

namespace flatparam {
namespace checkpoint {

inline constexpr char kHfIndexFileName[] = "model.safetensors.index.json";
// huggingface_hub's default max_shard_size, "5GB": 5 * 10^9 bytes.
inline constexpr uint64_t kHfDefaultMaxShardBytes = 5'000'000'000;
// Index files larger than this are rejected unread.
inline constexpr uint64_t kMaxHfIndexBytes = uint64_t{64} << 20;
// At most this many problems are listed in one import error.
inline constexpr int kMaxReportedProblems = 20;
// The largest scratch buffer a cast converts through.
inline constexpr uint64_t kCastScratchBytes = uint64_t{1} << 20;

// The name PyTorch's FSDP gives a parameter once its wrappers are gone
// (torch.distributed.fsdp._common_utils.clean_tensor_name): every
// "_fsdp_wrapped_module." and then every "_checkpoint_wrapped_module."
// removed wherever it occurs, as Python's str.replace does; in addition,
// every "_orig_mod" component (torch.compile's OptimizedModule) is removed.
//   "_fsdp_wrapped_module.layers.0._checkpoint_wrapped_module.w.weight"
//       -> "layers.0.w.weight"
//   "_orig_mod.model.norm.weight" -> "model.norm.weight"
// The same as flatparam/base/fqn.h's, which it calls.
std::string CleanTensorName(absl::string_view name);

// A byte count as huggingface_hub's max_shard_size spells it: an integer
// (bytes) optionally followed by B, KB, MB, GB, TB (powers of 1000) or
// KiB, MiB, GiB, TiB (powers of 1024), case-insensitive except that a
// trailing lowercase "b" (which huggingface_hub reads as bits) is refused.
// "5GB" -> 5000000000, "500MiB" -> 524288000, "1024" -> 1024.
// InvalidArgument naming `text` for anything else, zero or overflow.
absl::StatusOr<uint64_t> ParseByteSize(absl::string_view text);

// Whether `path` is to be read as a Hugging Face-style checkpoint rather
// than as one of this project's: a .safetensors or .json file, or a
// directory without manifest.json (HfCheckpointReader::Open then says if
// it holds neither form). False when nothing is at `path` (this project's
// readers fall back to a checkpoint's backup). Only looks at names.
absl::StatusOr<bool> IsHfCheckpoint(FileSystem& fs, const std::string& path);

// How tensor names of a Hugging Face checkpoint become the model's, after
// CleanTensorName: for published files saved from another class than the
// model's (gpt2's were saved from the bare GPT2Model, without
// GPT2LMHeadModel's "transformer." prefix).
struct HfNameOptions {
  // Removed from the start of every name that has it (others unchanged).
  std::string strip_prefix;
  // Then put before every name.
  std::string add_prefix;
};

// A validated Hugging Face checkpoint (single file or index-sharded; the
// file comment lists the checks). Owns its open files; movable.
class HfCheckpointReader {
 public:
  struct Tensor {
    std::string name;         // cleaned (CleanTensorName), then renamed
                              // (HfNameOptions)
    std::string stored_name;  // as in the file
    int file = 0;             // index into files()
    DType dtype = DType::kFloat32;
    std::vector<int64_t> shape;
    uint64_t nbytes = 0;
  };

  static absl::StatusOr<HfCheckpointReader> Open(
      FileSystem& fs, const std::string& path, const HfNameOptions& names = {});

  HfCheckpointReader(HfCheckpointReader&&) = default;
  HfCheckpointReader& operator=(HfCheckpointReader&&) = default;

  // The directory the files are in.
  const std::string& dir() const { return dir_; }
  // The index file's path, or empty for a single file.
  const std::string& index_path() const { return index_path_; }
  const std::vector<SafetensorsReader>& files() const { return files_; }
  // Every tensor, by cleaned name.
  const std::map<std::string, Tensor>& tensors() const { return tensors_; }
  // The sum of the tensors' byte sizes.
  uint64_t data_bytes() const { return data_bytes_; }

  // Reads bytes [offset, offset + out.size()) of `tensor` (one of
  // tensors()).
  absl::Status ReadRange(const Tensor& tensor, uint64_t offset,
                         absl::Span<char> out) const;

 private:
  HfCheckpointReader() = default;

  std::string dir_;
  std::string index_path_;
  std::vector<SafetensorsReader> files_;
  std::map<std::string, Tensor> tensors_;
  uint64_t data_bytes_ = 0;
};

struct HfImportOptions {
  ConvertOptions convert;
  // Convert tensors whose dtype differs from the spec's (see the file
  // comment) instead of failing.
  bool cast = false;
  // Import the weights alone: optimizer state in the directory, importable
  // or not, is left behind (and listed in the report) instead of imported
  // or refused.
  bool weights_only = false;
  // Tensors whose cleaned names end in one of these are non-parameter
  // buffers the model recomputes; they are checked as tensors and skipped.
  // gpt2's published files need ".attn.bias" and ".attn.masked_bias" too.
  std::vector<std::string> ignored_suffixes = {".rotary_emb.inv_freq"};
  // Renaming of the file's tensors, applied before anything is matched.
  HfNameOptions names;
};

// What an import read.
struct HfImportReport {
  int64_t files = 0;
  // Tensors of the checkpoint: imported, tied copies checked, skipped.
  int64_t imported = 0;
  int64_t tied_copies = 0;
  int64_t ignored = 0;
  // Imported tensors converted to the spec's dtype.
  int64_t cast = 0;
  // Whether optimizer state (optim.safetensors and optim.json) was
  // imported; its parameters with state and its param groups.
  bool optimizer = false;
  int64_t optimizer_params = 0;
  int64_t optimizer_groups = 0;
  // With weights_only: the directory's optimizer files, which were not
  // imported (names, sorted).
  std::vector<std::string> optimizer_left_behind;
};

// What happened to the optimizer state, for a summary line: "" when the
// input held none; "; optimizer state of 6 parameters in 1 param group
// imported"; "; optimizer state left behind (--weights-only): optimizer.pt".
std::string DescribeOptimizerImport(const HfImportReport& report);

// The checks of an import against `spec` that need no tensor data (every
// name, dtype and shape; not the tied copies' bytes), for a checkpoint
// already opened: what ImportHfCheckpoint would import, or its error
// (FailedPrecondition listing the problems; InvalidArgument for a spec
// that does not lay out).
absl::StatusOr<HfImportReport> CheckHfCheckpointFits(
    const HfCheckpointReader& ckpt, const ModelSpec& spec,
    const HfImportOptions& options = {});

// Imports the checkpoint at `in` (see the file comment) into a sharded
// checkpoint at `out_dir` of `spec` laid out with `layout_options` for a
// job of `world_size` ranks (0: layout_options.world_size), as
// ShardCheckpoint does for a full checkpoint, with the optimizer state
// beside it. Errors: InvalidArgument for bad arguments (an `out_dir` that
// is or holds `in` among them) and for optimizer state that does not
// flatten, NotFound for no checkpoint at `in`, DataLoss for damaged or
// inconsistent files, FailedPrecondition for a checkpoint that does not
// fit `spec` and for optimizer state that cannot be imported (without
// `weights_only`). On error `out_dir` is unchanged.
absl::StatusOr<HfImportReport> ImportHfCheckpoint(
    FileSystem& fs, const std::string& in, const ModelSpec& spec,
    const LayoutOptions& layout_options, int64_t world_size,
    const std::string& out_dir, const HfImportOptions& options = {});

// The files besides the weights that `transformers` and its tokenizers
// load from a model directory, which --copy-from copies: config.json,
// generation_config.json, the tokenizer's files (tokenizer.json,
// tokenizer.model, tokenizer_config.json, special_tokens_map.json,
// added_tokens.json, vocab.json, vocab.txt, merges.txt, chat_template.jinja)
// and preprocessor_config.json.
const std::vector<std::string>& HfSideFileNames();

struct HfExportOptions {
  ConvertOptions convert;
  // The most tensor bytes in one file (>= 1); a larger tensor gets its own.
  uint64_t max_shard_bytes = kHfDefaultMaxShardBytes;
  // Cast every floating-point tensor to this dtype.
  std::optional<DType> dtype;
  // A directory (the original model's) whose HfSideFileNames() files are
  // written into the export with the weights, in the same atomic write, so
  // that the export loads with from_pretrained as it is. At least one must
  // be there (InvalidArgument otherwise). Their content is copied as it
  // is: config.json's "torch_dtype" keeps the original's value after a
  // --dtype cast. An existing file of the output that has exactly the
  // copied content does not count as foreign (a re-export of the same
  // model needs no `overwrite`).
  std::string copy_from;
  // convert.write.overwrite and convert.write.outcome: see
  // CheckpointWriteOptions.
};

// What an export wrote.
struct HfExportReport {
  // The safetensors files, in order, then the index (if any).
  std::vector<std::string> files;
  // The files copied from `copy_from`, in HfSideFileNames() order.
  std::vector<std::string> copied;
  int64_t tensors = 0;
  // The sum of the tensors' byte sizes (the index's total_size).
  uint64_t total_size = 0;
};

// Exports the full or sharded checkpoint at `in_dir` to `out_dir` (see the
// file comment). Errors: the readers' (NotFound, DataLoss),
// InvalidArgument for bad options or an `out_dir` that is or holds
// `in_dir`, the file system's. On error `out_dir` is unchanged.
absl::StatusOr<HfExportReport> ExportHfCheckpoint(
    FileSystem& fs, const std::string& in_dir, const std::string& out_dir,
    const HfExportOptions& options = {});

namespace internal_checkpoint {

// huggingface_hub's split_torch_state_dict_into_shards on byte sizes:
// which tensors (indices into `sizes`) go into which file, in file order.
std::vector<std::vector<size_t>> SplitIntoShards(
    absl::Span<const uint64_t> sizes, uint64_t max_shard_bytes);

}  // namespace internal_checkpoint

}  // namespace checkpoint
}  // namespace flatparam

#endif  // FLATPARAM_INTEROP_HF_HF_CHECKPOINT_H_
