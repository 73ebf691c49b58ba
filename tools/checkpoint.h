// The testable core of `fsdp checkpoint ACTION`: offline checkpoint tools
// over flatparam/checkpoint/convert.h, on the POSIX file system.
//
//   fsdp checkpoint init        --model=M --out=FULL [--seed=N]
//                               [--optimizer=adamw|sgd|none]
//   fsdp checkpoint shard       --in=FULL|HF --model=M --world-size=W
//                               [--strategy=S] [--shard-group-size=G]
//                               [--align-addresses] [--compute-dtype=D]
//                               --out=SHARDED
//   fsdp checkpoint reshard     --in=SHARDED --world-size=W [layout flags]
//                               --out=SHARDED2
//   fsdp checkpoint consolidate --in=SHARDED --out=FULL
//   fsdp checkpoint verify      --in=DIR
//   fsdp checkpoint export      --in=FULL|SHARDED --out=HF
//                               [--max-shard-size=5GB] [--dtype=D]
//                               [--copy-from=MODEL_DIR] [--overwrite]
//
// shard also takes a Hugging Face checkpoint as --in (a directory with
// model.safetensors or model.safetensors.index.json and no manifest.json,
// or the path of either file) and imports it straight to the sharded
// layout (flatparam/interop/hf/hf_checkpoint.h), with --cast to convert a
// dtype that differs from the model's and --weights-only to leave its
// optimizer state behind (optim.safetensors with optim.json is imported
// otherwise), --add-prefix/--strip-prefix to rename the
// file's tensors and --ignore-suffix to skip more buffers; --dtype then
// sets the model's dtype, as for init. verify also checks a Hugging Face
// checkpoint (its headers and index). export writes one from a full or sharded
// checkpoint; --dtype there casts the tensors, --copy-from adds the original
// model's config and tokenizer files, and --overwrite writes into a directory
// holding other files (keeping them).
//
// Every action streams (memory bounded by one chunk, not the model) and
// prints one summary line on stdout: bytes written (or verified), the
// output's absolute path, seconds, MB/s (10^6 bytes per second) and the
// process's peak resident memory, after a line saying what an existing
// output directory held that the write replaced (and, with --overwrite,
// kept).
// Progress goes to `progress` (stderr): a redrawn bar when it is a
// terminal; otherwise, once an action has run for 5 s, a plain line at each
// tenth of the work.
//
// Thread-safety: runs on the calling thread; the functions are reentrant.
#ifndef TOOLS_CHECKPOINT_H_
#define TOOLS_CHECKPOINT_H_

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "tools/layout_request.h"

namespace flatparam {
namespace tools {

struct CheckpointCommand {
  // "init", "shard", "reshard", "consolidate", "verify" or "export".
  std::string action;
  std::string in;
  std::string out;
  // shard and init: the model; shard and reshard: the target layout and
  // world size (default 8, as for every layout subcommand).
  // `world_size_set`: --world-size was given a non-default value.
  LayoutRequest layout;
  bool world_size_set = false;
  // init only.
  uint64_t seed = 0;
  std::string optimizer = "adamw";
  // shard of a Hugging Face checkpoint only (HfImportOptions).
  bool cast = false;
  bool weights_only = false;
  std::string add_prefix;
  std::string strip_prefix;
  // Added to HfImportOptions' default ignored_suffixes.
  std::vector<std::string> ignore_suffixes;
  // export only: ParseByteSize's forms; empty for the default (5GB).
  std::string max_shard_size;
  std::string copy_from;
  bool overwrite = false;
  uint64_t chunk_bytes = uint64_t{4} << 20;
};

// Checks the command line's shape: a known action and the flags it
// needs, and no flag it would ignore. InvalidArgument naming the flag
// (the caller exits 2).
absl::Status ValidateCheckpointCommand(const CheckpointCommand& command);

// Runs a validated command: summary (and verify's report) to `out`,
// progress to `progress` (a bar when `progress_is_terminal`). Errors are
// the conversion's (the caller exits 1).
absl::Status RunCheckpoint(const CheckpointCommand& command, std::ostream& out,
                           std::ostream& progress, bool progress_is_terminal);

// The process's peak resident set size in bytes (VmHWM), or 0 when the
// system does not say.
int64_t PeakResidentBytes();

}  // namespace tools
}  // namespace flatparam

#endif  // TOOLS_CHECKPOINT_H_
