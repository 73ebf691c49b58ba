// `fsdp checkpoint ACTION`: flags in, RunCheckpoint, exit code out.
#include <unistd.h>

#include <iostream>
#include <ostream>
#include <string>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "tools/checkpoint.h"
#include "tools/common_flags.h"
#include "tools/subcommand.h"

ABSL_FLAG(std::string, in, "", "checkpoint: the input checkpoint directory.");
ABSL_FLAG(std::string, out, "",
          "checkpoint: the output checkpoint directory (written atomically).");
ABSL_FLAG(bool, cast, false,
          "checkpoint shard of a Hugging Face checkpoint: convert tensors "
          "whose dtype differs from the model's (round to nearest even).");
ABSL_FLAG(bool, weights_only, false,
          "checkpoint shard of a Hugging Face checkpoint: import the weights "
          "alone, leaving the directory's optimizer state behind.");
ABSL_FLAG(std::string, add_prefix, "",
          "checkpoint shard of a Hugging Face checkpoint: put this before "
          "every tensor name of the files (after --strip-prefix), e.g. "
          "transformer. for gpt2's published files.");
ABSL_FLAG(std::string, strip_prefix, "",
          "checkpoint shard of a Hugging Face checkpoint: remove this from "
          "the start of every tensor name that has it.");
ABSL_FLAG(std::vector<std::string>, ignore_suffix, {},
          "checkpoint shard of a Hugging Face checkpoint: also skip buffers "
          "whose names end in one of these (comma-separated), e.g. "
          ".attn.bias,.attn.masked_bias for gpt2's published files.");
ABSL_FLAG(std::string, copy_from, "",
          "checkpoint export: also write the config and tokenizer files of "
          "this model directory (config.json, tokenizer.json, ...).");
ABSL_FLAG(std::string, max_shard_size, "",
          "checkpoint export: the most tensor bytes per file (5GB, 500MB, "
          "2GiB or bytes; default 5GB).");
// Defined by `fsdp train`; `checkpoint init` also accepts "none".
ABSL_DECLARE_FLAG(std::string, optimizer);

namespace flatparam {
namespace tools {
namespace {

int CheckpointMain(const std::vector<char*>& args) {
  if (args.size() != 1) {
    std::cerr << "fsdp checkpoint: expected one action (init, shard, "
                 "reshard, consolidate, verify or export)"
              << (args.size() > 1
                      ? std::string(", got also \"") + args[1] + "\""
                      : std::string())
              << "; see fsdp checkpoint --help\n";
    return kExitUsage;
  }
  CheckpointCommand command;
  command.action = args[0];
  command.in = absl::GetFlag(FLAGS_in);
  command.out = absl::GetFlag(FLAGS_out);
  command.layout = LayoutRequestFromFlags();
  command.world_size_set = FlagChanged("world_size");
  command.seed = absl::GetFlag(FLAGS_seed);
  command.optimizer = absl::GetFlag(FLAGS_optimizer);
  command.cast = absl::GetFlag(FLAGS_cast);
  command.weights_only = absl::GetFlag(FLAGS_weights_only);
  command.max_shard_size = absl::GetFlag(FLAGS_max_shard_size);
  command.add_prefix = absl::GetFlag(FLAGS_add_prefix);
  command.strip_prefix = absl::GetFlag(FLAGS_strip_prefix);
  command.ignore_suffixes = absl::GetFlag(FLAGS_ignore_suffix);
  command.copy_from = absl::GetFlag(FLAGS_copy_from);
  command.overwrite = absl::GetFlag(FLAGS_overwrite);
  if (absl::Status s = ValidateCheckpointCommand(command); !s.ok()) {
    std::cerr << "fsdp checkpoint: " << s.message()
              << "; see fsdp checkpoint --help\n";
    return kExitUsage;
  }
  const absl::Status status =
      RunCheckpoint(command, std::cout, std::cerr, isatty(STDERR_FILENO) == 1);
  std::cout.flush();
  if (!status.ok()) {
    std::cerr << "fsdp checkpoint " << command.action << ": "
              << status.message() << "\n";
    return kExitError;
  }
  return std::cout.good() ? kExitOk : kExitError;
}

constexpr char kHelp[] =
    "usage: fsdp checkpoint init        --model=NAME|PATH --out=FULL\n"
    "                                   [--seed=N] "
    "[--optimizer=adamw|sgd|none]\n"
    "       fsdp checkpoint shard       --in=FULL|HF --model=NAME|PATH "
    "[--world-size=W]\n"
    "                                   [layout flags] [--cast] "
    "[--weights-only]\n"
    "                                   [--add-prefix=P] [--strip-prefix=P]\n"
    "                                   [--ignore-suffix=S,...]\n"
    "                                   --out=SHARDED\n"
    "       fsdp checkpoint reshard     --in=SHARDED [--world-size=W] "
    "[layout flags]\n"
    "                                   --out=SHARDED2\n"
    "       fsdp checkpoint consolidate --in=SHARDED --out=FULL\n"
    "       fsdp checkpoint verify      --in=DIR\n"
    "       fsdp checkpoint export      --in=FULL|SHARDED --out=HF\n"
    "                                   [--max-shard-size=5GB] "
    "[--dtype=bfloat16]\n"
    "                                   [--copy-from=MODEL_DIR] "
    "[--overwrite]\n"
    "\n"
    "Offline checkpoint tools, in one process without communication. They\n"
    "stream: memory is bounded by one chunk (4 MiB) plus metadata, never the\n"
    "model. Outputs are written atomically (a crash leaves the previous\n"
    "output or the new one). init writes a full checkpoint of deterministic\n"
    "pseudo-random weights and optimizer state; verify checks the manifest,\n"
    "every checksum, every rank file against the layout and every sidecar.\n"
    "A summary line (bytes, seconds, MB/s, peak RSS) goes to stdout; a\n"
    "progress bar to stderr when it is a terminal.\n"
    "\n"
    "Hugging Face checkpoints: shard also takes, as --in, a directory with\n"
    "model.safetensors or model.safetensors.index.json (and no\n"
    "manifest.json), or the path of either file, and imports it straight\n"
    "to the sharded layout: every header, name, shape and dtype is checked\n"
    "against the model first (FSDP and activation-checkpoint wrapper\n"
    "prefixes are removed from names; rotary_emb.inv_freq buffers are\n"
    "skipped; a tied parameter listed again must equal its target). A\n"
    "dtype that differs from the model's is an error unless --cast (or\n"
    "--dtype=D to give the model the file's dtype). Optimizer state\n"
    "beside them as optim.safetensors (\"state.{fqn}.{name}\" tensors) and\n"
    "optim.json (flatparam's, or PyTorch's param_groups list) is imported\n"
    "too. Another tool's optimizer state (optimizer.pt, ...) cannot be:\n"
    "with --weights-only the weights are imported alone, the optimizer\n"
    "files left behind (the summary lists them). Use the -hf presets\n"
    "(llama2-7b-hf, llama3-8b-hf, ...) for Hugging Face's Llama names.\n"
    "Files saved from another class than the model's import with\n"
    "--add-prefix/--strip-prefix and --ignore-suffix (gpt2's published\n"
    "files: --add-prefix=transformer. "
    "--ignore-suffix=.attn.bias,.attn.masked_bias).\n"
    "export writes the weights of a full or sharded checkpoint as\n"
    "Hugging Face does: model.safetensors, or model-0000i-of-0000n\n"
    "files of at most --max-shard-size of tensors each plus\n"
    "model.safetensors.index.json; tied parameters once, under their\n"
    "target's name; --dtype casts (round to nearest even); --copy-from\n"
    "writes the original model's config.json, generation_config.json and\n"
    "tokenizer files with them, so that the export loads in transformers.\n"
    "\n"
    "No command deletes or replaces a file it did not write: an --out that\n"
    "holds anything but an earlier output of the same kind is refused\n"
    "before anything is written, naming the files. export --overwrite\n"
    "writes into such a directory (the original download, say): it\n"
    "replaces the previous export's files and same-named ones and keeps\n"
    "the rest. The summary says what was replaced and kept.\n"
    "\n"
    "Exit codes: 0 ok, 1 the checkpoint could not be read or written, 2 bad\n"
    "command line.\n"
    "\n"
    "flags:\n"
    "  --in=DIR                 input checkpoint directory\n"
    "  --out=DIR                output checkpoint directory: new, empty, or\n"
    "                           an earlier output of the same kind (anything\n"
    "                           else there is refused, never deleted)\n"
    "  --overwrite              export: write into an --out holding other\n"
    "                           files, keeping them\n"
    "  --copy-from=DIR          export: copy DIR's config and tokenizer\n"
    "                           files into the export\n"
    "  --seed=N                 init: the weights' seed (default 0)\n"
    "  --optimizer=O            init: adamw (default), sgd or none\n"
    "  --dtype=D                init, shard: the model's dtype; export: cast\n"
    "                           to D\n"
    "  --cast                   shard (Hugging Face input): convert dtypes\n"
    "  --weights-only           shard (Hugging Face input): leave optimizer\n"
    "                           state behind, importing the weights alone\n"
    "  --add-prefix=P           shard (Hugging Face input): prefix every\n"
    "                           tensor name with P\n"
    "  --strip-prefix=P         shard (Hugging Face input): remove P from\n"
    "                           names that start with it (before adding)\n"
    "  --ignore-suffix=S,...    shard (Hugging Face input): skip buffers\n"
    "                           ending in S (besides rotary_emb.inv_freq)\n"
    "  --max-shard-size=S       export: bytes of tensors per file (5GB)\n"
    "layout flags (shard, reshard; --model also for init):\n";

void PrintHelp(std::ostream& out) {
  out << kHelp << kLayoutFlagsHelp << "\n" << PresetsHelp();
}

}  // namespace

const Subcommand kCheckpointSubcommand = {
    "checkpoint",
    "init, shard, reshard, consolidate, verify and export checkpoints "
    "offline; import Hugging Face safetensors",
    PrintHelp,
    CheckpointMain,
};

}  // namespace tools
}  // namespace flatparam
