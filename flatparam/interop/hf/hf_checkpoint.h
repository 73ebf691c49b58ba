// Hugging Face checkpoints in and out: a model's weights as the ecosystem
// publishes them imported straight into a sharded checkpoint
// (checkpoint_dir.h) for any world size, and a full or sharded checkpoint
// exported in the ecosystem's form. The tools behind `fsdp checkpoint
// shard` (given such a checkpoint) and `fsdp checkpoint export`.
//
// The two forms (what `transformers`' save_pretrained and
// huggingface_hub's split_torch_state_dict_into_shards write):
//
//   single file:    model.safetensors
//   index-sharded:  model-00001-of-00004.safetensors ... plus
//                   model.safetensors.index.json ("weight_map": name -> file)
//
//   // A download from the Hub as a checkpoint for 8 ranks of FULL_SHARD;
//   // `spec` is the model (a model file from `fsdp model --from`):
//   LayoutOptions layout;
//   layout.world_size = 8;
//   FLATPARAM_ASSIGN_OR_RETURN(
//       HfImportReport imported,
//       ImportHfCheckpoint(PosixFileSystem(), "/models/Llama-2-7b-hf", spec,
//                          layout, /*world_size=*/8, "/ckpt/llama-step0"));
//   // ... train, save /ckpt/llama-step1000 ..., then back to the Hub's form:
//   HfExportOptions out;
//   out.copy_from = "/models/Llama-2-7b-hf";  // config.json, tokenizer
//   FLATPARAM_ASSIGN_OR_RETURN(
//       HfExportReport exported,
//       ExportHfCheckpoint(PosixFileSystem(), "/ckpt/llama-step1000",
//                          "/models/llama-tuned", out));
//
// DESIGN.md next to this file lists every check of an import, the
// optimizer-state forms it reads, and how an export names, orders and
// splits tensors. Streaming and memory are convert.h's: every output tensor
// is filled chunk by chunk from byte ranges of the inputs; a cast converts
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

// A validated Hugging Face checkpoint (single file or index-sharded;
// DESIGN.md lists the checks: every header, the index). Owns its open
// files; movable.
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
  // Convert tensors whose dtype differs from the spec's as PyTorch casts
  // them (round to nearest even; flatparam/base/dtype.h) instead of
  // failing, which names both dtypes. Giving the model the file's dtype
  // instead (`--dtype`) keeps the values as they are.
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

// Imports the checkpoint at `in` -- a directory holding one of the two
// forms (both at once is ambiguous and refused), or the path of a
// .safetensors file or of an index file -- into a sharded checkpoint at
// `out_dir` of `spec` laid out with `layout_options` for a job of
// `world_size` ranks (0: layout_options.world_size), byte for byte what
// ShardCheckpoint writes for a full checkpoint of the same weights, with
// the optimizer state found beside them (DESIGN.md: its two forms, and
// what `weights_only` leaves behind). Everything is checked before a byte
// is written, and every problem found is reported at once (up to
// kMaxReportedProblems), each naming the file, the tensor and what
// differs: every untied parameter and buffer of `spec` must be there with
// its shape and dtype, and nothing else but tied copies (equal to their
// targets, byte for byte) and `ignored_suffixes`. Errors: InvalidArgument for
// bad arguments (an `out_dir` that is or holds `in` among them) and for
// optimizer state that does not flatten, NotFound for no checkpoint at `in`,
// DataLoss for damaged or inconsistent files, FailedPrecondition for a
// checkpoint that does not fit `spec` and for optimizer state that cannot be
// imported (without `weights_only`). On error `out_dir` is unchanged.
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

// Exports the full or sharded checkpoint at `in_dir` to `out_dir`: each
// untied parameter once, in the model's order (a tied one under its
// target's name only, as save_pretrained writes it), then the buffers,
// split into files of at most `max_shard_bytes` with huggingface_hub's
// algorithm (DESIGN.md). Only weights: optimizer state stays behind. The
// output is written crash-safely as checkpoint_dir.h writes, but holds no
// manifest.json: it is not a flatparam checkpoint. Errors: the readers'
// (NotFound, DataLoss), InvalidArgument for bad options or an `out_dir` that is
// or holds `in_dir`, the file system's. On error `out_dir` is unchanged.
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
