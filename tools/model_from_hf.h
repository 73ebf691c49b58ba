// The testable core of `fsdp model --from=DIR`: the model file
// (flatparam/model_json.h) of a Hugging Face checkpoint, so that a
// checkpoint downloaded from the Hub imports with `fsdp checkpoint shard
// --in=DIR --model=FILE` without writing the model file by hand.
//
//   fsdp model --from=/models/Llama-2-7b-hf --wrap='model.layers.*'
//       --out=llama.json
//
// What the file holds:
//   - one parameter per tensor of the checkpoint (HfCheckpointReader: a
//     directory with model.safetensors or an indexed set of files, or
//     either file), named as the import cleans names (CleanTensorName),
//     with the header's dtype and shape, requires_grad true; buffers the
//     import skips (HfImportOptions::ignored_suffixes, e.g.
//     ".rotary_emb.inv_freq") are left out. Every other tensor becomes a
//     parameter: edit the file for other buffers or frozen parameters.
//   - no ties. A checkpoint of a model with tied embeddings
//     (`"tie_word_embeddings": true` in config.json) normally lacks
//     lm_head.weight: the file then lists no lm_head.weight either (a tied
//     parameter takes no room in a flat parameter, so the layout is the
//     same). If the files do hold lm_head.weight it stays a parameter of
//     its own (whether it equals the embedding is not checked).
//   - the parameters in a reconstructed module order. safetensors files
//     and the index list tensors alphabetically, not in the order the
//     model registers them, and the flat-parameter layout (and so every
//     checkpoint sharded with the file) depends on that order. OrderNames
//     sorts dotted names component by component: all-digit components by
//     value ("layers.2" before "layers.10") and before other names; other
//     components in the order of an architecture template when config.json
//     names a known architecture (ArchitectureTemplate), else, and for
//     names the template lacks (after the ones it has), by byte value.
//   - `wrap`: the given entries (prefixes or globs, kept as given), or by
//     default a glob over the model's one numbered list of blocks
//     (DefaultWrapGlob), or nothing (the root is the only unit).
//
// Thread-safety: the functions are reentrant; RunModel reads and writes
// files.
#ifndef TOOLS_MODEL_FROM_HF_H_
#define TOOLS_MODEL_FROM_HF_H_

#include <cstdint>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "flatparam/checkpoint/file_system.h"
#include "flatparam/model_layout.h"

namespace flatparam {
namespace tools {

// `names` sorted as the file comment says, with `order_template` (a model
// whose parameters come in module order; null for none) giving the rank of
// each non-numeric component among its siblings. Digit runs in the
// template stand for any number. Sorting is stable and total: equal names
// stay in place.
std::vector<std::string> OrderNames(std::vector<std::string> names,
                                    const ModelSpec* order_template);

// The preset whose module order stands for the Hugging Face architecture
// `architecture` (config.json's "architectures"[0]), or "" when none is
// known: LlamaForCausalLM, MistralForCausalLM and Qwen2ForCausalLM ->
// "llama2-7b-hf"; GPT2LMHeadModel -> "gpt2".
std::string ArchitectureTemplate(absl::string_view architecture);

// The default wrap glob of `params`: "P.*" when exactly one module prefix P
// (not the root) holds numbered submodules, counting only the outermost
// number of each name (so "model.layers.3.mlp.experts.7.w" counts for
// "model.layers" only); nullopt otherwise. `why` (if not null) receives a
// phrase saying what was found ("the one numbered module list, 32 modules"
// or "2 numbered module lists: encoder.block, decoder.block").
std::optional<std::string> DefaultWrapGlob(const std::vector<ParamSpec>& params,
                                           std::string* why);

// --wrap's value: comma-separated entries, blanks around them ignored; ""
// is no entry. InvalidArgument naming the entry for an empty entry or one
// with an empty dotted component.
absl::StatusOr<std::vector<std::string>> ParseWrapList(absl::string_view text);

struct HfModelOptions {
  // A Hugging Face checkpoint: a directory, or a .safetensors or index file.
  std::string from;
  // The wrap entries; nullopt for the default (DefaultWrapGlob).
  std::optional<std::vector<std::string>> wrap;
};

// A model made from a checkpoint, and how it was made.
struct HfModel {
  ModelSpec spec;
  // The checkpoint's directory, as opened.
  std::string dir;
  int64_t files = 0;
  // Tensors left out as buffers (HfImportOptions::ignored_suffixes).
  int64_t ignored = 0;
  // The layout's flat parameters (units owning parameters) and elements.
  int64_t units = 0;
  int64_t numel = 0;
  // How the parameters were ordered, and how `wrap` was chosen, in words.
  std::string order_note;
  std::string wrap_note;
  // What config.json's tie_word_embeddings meant here; empty when unset.
  std::string tie_note;
};

// The model of the checkpoint at `options.from` (see the file comment),
// checked to lay out (ModelLayout::Create) and to fit the checkpoint as the
// import checks it (CheckHfCheckpointFits). The model's name is the
// checkpoint directory's. Errors: the reader's (NotFound, DataLoss),
// InvalidArgument naming the file for a config.json that is not a JSON
// object, a tensor name that is not a dotted name, and a model that does
// not lay out (a wrap entry that matches nothing or ties, an integer
// tensor) with the --wrap entries or the tensor named.
absl::StatusOr<HfModel> ModelFromHfCheckpoint(checkpoint::FileSystem& fs,
                                              const HfModelOptions& options);

// The model file of `spec`: ModelSpecToJson's document with one parameter
// per line (keys fqn, shape, dtype, requires_grad), ending in a newline.
std::string ModelFileText(const ModelSpec& spec);

// `fsdp model` as typed.
struct ModelCommand {
  std::string from;
  // --wrap's value; nullopt when --wrap was not given.
  std::optional<std::string> wrap;
  // The model file to write; "" for stdout.
  std::string out;
  // Replace an existing `out`.
  bool overwrite = false;
};

// Checks the command line: --from given, --wrap parses, --overwrite only
// with --out. InvalidArgument naming the flag (the caller exits 2).
absl::Status ValidateModelCommand(const ModelCommand& command);

// Runs a validated command: the model file to `command.out`, or to `out`
// (stdout) when that is empty; notes and a summary line naming the output
// (AbsolutePath, tools/paths.h) to `log`. An existing --out is refused
// (FailedPrecondition, before anything is read) unless `overwrite`; a directory
// always. The file is written to a temporary name and renamed, so a failure
// leaves the previous file, if any. Errors as ModelFromHfCheckpoint's plus the
// file system's (the caller exits 1).
absl::Status RunModel(const ModelCommand& command, std::ostream& out,
                      std::ostream& log);

}  // namespace tools
}  // namespace flatparam

#endif  // TOOLS_MODEL_FROM_HF_H_
