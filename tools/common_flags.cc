#include "tools/common_flags.h"

#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/flag.h"
#include "absl/flags/reflection.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "flatparam/presets.h"

ABSL_FLAG(std::string, model, "",
          "A model preset (gpt2, llama2-7b, ...) or a model JSON file.");
ABSL_FLAG(int64_t, world_size, 8, "Number of ranks in the job (W).");
ABSL_FLAG(std::string, strategy, "FULL_SHARD",
          "FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD or "
          "HYBRID_SHARD_ZERO2.");
ABSL_FLAG(bool, align_addresses, false,
          "Pad each parameter to a 16-byte boundary, as PyTorch FSDP does "
          "with use_orig_params=True.");
ABSL_FLAG(std::string, compute_dtype, "",
          "Mixed precision param_dtype used for alignment (default: the "
          "parameters' dtype).");
ABSL_FLAG(std::string, dtype, "",
          "Override every parameter's dtype (default: the model's).");
ABSL_FLAG(int64_t, shard_group_size, 0,
          "Ranks per shard group for the HYBRID_* strategies (default: 8 when "
          "it divides the world size, else the world size).");
ABSL_FLAG(std::string, format, "table", "Output format: table or json.");
ABSL_FLAG(std::string, backend, "",
          "sim, mpi or nccl (default: mpi under mpirun, else sim).");
ABSL_FLAG(uint64_t, seed, 0,
          "The simulator's seed (train: also the model's initialisation and "
          "the data).");
ABSL_FLAG(std::optional<absl::Duration>, timeout, std::nullopt,
          "The longest any one collective may wait, e.g. 30s or 2m, before "
          "the run fails with an error naming the rank and the op (default: "
          "collectives 30s, train 5m). Under mpirun, MPI's start may wait the "
          "longer of this and 1m for every process of the job.");

ABSL_FLAG(std::string, trace_dir, "",
          "The flight recorder's directory: each rank writes its last "
          "collectives there (rank_<R>.json) when one fails, on SIGUSR1 and "
          "on SIGTERM; `fsdp diagnose DIR` reads them. Default: "
          "$FLATPARAM_TRACE_DIR, else none.");
ABSL_FLAG(bool, desync_check, false,
          "Before every collective, compare a fingerprint of it (op, dtype, "
          "count, group, sequence number, FSDP unit and phase) across the "
          "group, so that desynchronised ranks fail at the collective where "
          "they part, not at a timeout.");
ABSL_FLAG(bool, overwrite, false,
          "Write into an output directory (or file) that holds files this "
          "command did not write: same-named files are replaced, every other "
          "file is kept, and the summary lists both (default: refuse, naming "
          "the files).");

namespace flatparam {
namespace tools {

namespace {

// Set once by SetGivenFlags, on the main thread, before any reader.
std::optional<std::set<std::string>>& GivenFlags() {
  static auto* given = new std::optional<std::set<std::string>>;
  return *given;
}

}  // namespace

void SetGivenFlags(const std::vector<std::string>& args) {
  std::set<std::string> names;
  for (const std::string& arg : args) {
    if (arg == "--") break;
    absl::string_view name = arg;
    if (!absl::ConsumePrefix(&name, "--") && !absl::ConsumePrefix(&name, "-")) {
      continue;
    }
    name = name.substr(0, name.find('='));
    names.emplace(name);
    if (absl::ConsumePrefix(&name, "no")) names.emplace(name);
  }
  GivenFlags() = std::move(names);
}

bool FlagChanged(absl::string_view name) {
  if (GivenFlags().has_value()) {
    return GivenFlags()->count(std::string(name)) != 0;
  }
  const absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
  return flag != nullptr && flag->CurrentValue() != flag->DefaultValue();
}

const char kLayoutFlagsHelp[] =
    "  --model=NAME|PATH        preset, model JSON file, or a sharded\n"
    "                           checkpoint directory (its model; required)\n"
    "  --world-size=W           ranks in the job (default 8)\n"
    "  --strategy=S             FULL_SHARD (default), SHARD_GRAD_OP, "
    "NO_SHARD,\n"
    "                           HYBRID_SHARD, HYBRID_SHARD_ZERO2\n"
    "  --shard-group-size=G     HYBRID_*: ranks per shard group (default 8 "
    "if it\n"
    "                           divides W, else W); must divide W\n"
    "  --align-addresses        16-byte aligned parameters "
    "(use_orig_params=True)\n"
    "  --compute-dtype=DTYPE    mixed-precision param dtype for alignment\n"
    "  --dtype=DTYPE            override the parameters' dtype\n";

LayoutRequest LayoutRequestFromFlags() {
  LayoutRequest r;
  r.model = absl::GetFlag(FLAGS_model);
  r.world_size = absl::GetFlag(FLAGS_world_size);
  r.strategy = absl::GetFlag(FLAGS_strategy);
  r.align_addresses = absl::GetFlag(FLAGS_align_addresses);
  r.compute_dtype = absl::GetFlag(FLAGS_compute_dtype);
  r.dtype = absl::GetFlag(FLAGS_dtype);
  r.shard_group_size = absl::GetFlag(FLAGS_shard_group_size);
  return r;
}

std::string PresetsHelp() {
  std::string out;
  std::string line = "presets (--model=NAME):";
  for (const std::string& name : PresetNames()) {
    if (line.size() + name.size() + 2 > 76) {
      absl::StrAppend(&out, line, "\n");
      line = " ";
    }
    absl::StrAppend(&line, " ", name);
  }
  absl::StrAppend(&out, line, "\n");
  return out;
}

}  // namespace tools
}  // namespace flatparam
