// `fsdp model`: flags in, RunModel, exit code out.
#include <algorithm>
#include <iostream>
#include <iterator>
#include <ostream>
#include <string>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "absl/flags/reflection.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_replace.h"
#include "tools/common_flags.h"
#include "tools/model_from_hf.h"
#include "tools/subcommand.h"

ABSL_FLAG(std::string, from, "",
          "model: the Hugging Face checkpoint to describe (a directory, or "
          "its model.safetensors or index file).");
ABSL_FLAG(std::string, wrap, "",
          "model: comma-separated FSDP unit prefixes or globs "
          "(model.layers.*); empty for none.");
// Defined by the checkpoint subcommand.
ABSL_DECLARE_FLAG(std::string, out);

namespace flatparam {
namespace tools {
namespace {

// The flags `fsdp model` reads; any other given is a usage error.
constexpr absl::string_view kModelFlags[] = {"from", "wrap", "out",
                                             "overwrite"};

int ModelMain(const std::vector<char*>& args) {
  if (!args.empty()) {
    std::cerr << "fsdp model: unexpected argument \"" << args[0]
              << "\"; see fsdp model --help\n";
    return kExitUsage;
  }
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (absl::StrContains(flag->Filename(), "absl/") ||
        std::find(std::begin(kModelFlags), std::end(kModelFlags), name) !=
            std::end(kModelFlags)) {
      continue;
    }
    if (FlagChanged(name)) {
      std::cerr << "fsdp model: does not take --"
                << absl::StrReplaceAll(name, {{"_", "-"}})
                << "; see fsdp model --help\n";
      return kExitUsage;
    }
  }
  ModelCommand command;
  command.from = absl::GetFlag(FLAGS_from);
  if (FlagChanged("wrap")) command.wrap = absl::GetFlag(FLAGS_wrap);
  command.out = absl::GetFlag(FLAGS_out);
  command.overwrite = absl::GetFlag(FLAGS_overwrite);
  if (absl::Status s = ValidateModelCommand(command); !s.ok()) {
    std::cerr << "fsdp model: " << s.message() << "; see fsdp model --help\n";
    return kExitUsage;
  }
  const absl::Status status = RunModel(command, std::cout, std::cerr);
  std::cout.flush();
  if (!status.ok()) {
    std::cerr << "fsdp model: " << status.message() << "\n";
    return kExitError;
  }
  return std::cout.good() ? kExitOk : kExitError;
}

constexpr char kHelp[] =
    "usage: fsdp model --from=DIR [--wrap=PREFIX|GLOB,...] [--out=FILE "
    "[--overwrite]]\n"
    "\n"
    "Writes the model file (JSON, flatparam/model_json.h) of the Hugging\n"
    "Face checkpoint DIR (model.safetensors, or files with\n"
    "model.safetensors.index.json), so that `fsdp checkpoint shard --in=DIR\n"
    "--model=FILE` imports it and `fsdp inspect --model=FILE` shows its\n"
    "layout. One parameter per tensor, with the header's dtype and shape;\n"
    "buffers the import skips (*.rotary_emb.inv_freq) are left out; no\n"
    "ties (a tied lm_head.weight that the files lack is not listed).\n"
    "\n"
    "The parameter order is a reconstruction: the files list tensors\n"
    "alphabetically, not in module order, and the layout (so every\n"
    "checkpoint sharded with the file) depends on the order. Names are\n"
    "sorted component by component, numbers by value (layers.2 before\n"
    "layers.10); when config.json names LlamaForCausalLM,\n"
    "MistralForCausalLM, Qwen2ForCausalLM or GPT2LMHeadModel, other names\n"
    "follow that model's module order, else byte order. Edit the file if\n"
    "your model registers its modules otherwise.\n"
    "\n"
    "flags:\n"
    "  --from=DIR        the checkpoint directory (or its .safetensors or\n"
    "                    index file); required\n"
    "  --wrap=LIST       comma-separated FSDP units: module prefixes\n"
    "                    (model.layers.0) or globs, where * matches within\n"
    "                    one dotted component (model.layers.* wraps each\n"
    "                    layer); kept as given in the file. Default: a glob\n"
    "                    over the model's one numbered module list (said on\n"
    "                    stderr), else none; --wrap= for none\n"
    "  --out=FILE        write the file here (default stdout); an existing\n"
    "                    FILE is refused\n"
    "  --overwrite       replace an existing --out file\n"
    "\n"
    "Notes (order, wrap, ties) and a summary line naming the absolute path\n"
    "go to stderr. Exit 2 for bad flags, 1 when the checkpoint cannot be\n"
    "read, the model does not lay out or --out exists.\n";

void PrintHelp(std::ostream& out) { out << kHelp; }

}  // namespace

const Subcommand kModelSubcommand = {
    "model",
    "write the model file of a Hugging Face checkpoint (--from=DIR)",
    PrintHelp,
    ModelMain,
};

}  // namespace tools
}  // namespace flatparam
