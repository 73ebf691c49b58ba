// fsdp_torch_files: PyTorch's files in and out of flatparam checkpoints:
// torch.save files (flatparam/interop/torch_save/torch_save.h) and Distributed
// Checkpoint directories (flatparam/interop/dcp/dcp.h). A binary of its own
// because it links LibTorch's serialization, which `fsdp` must not load
// (160 MiB resident).
//
//   fsdp_torch_files import --in=pytorch_model.bin|INDEX|DIR|DCPDIR
//       [--optimizer=optimizer.pt] --model=NAME|PATH --world-size=W
//       [--strategy=S] [--shard-group-size=G] [--align-addresses]
//       [--dtype=D] [--cast] [--dcp-model-prefix=P] [--dcp-optim-prefix=P]
//       [--no-optimizer] --out=CKPT
//
// A directory holding `.metadata` is a DCP checkpoint: its model and (unless
// --no-optimizer) optimizer state are imported; the prefixes of their keys
// are found unless given (dcp.h's DcpImportOptions).
//   fsdp_torch_files export --in=CKPT --out=DIR [--max-shard-size=5GB]
//       [--dtype=D] [--optimizer-keys=id|name] [--no-optimizer] [--overwrite]
//   fsdp_torch_files export --format=dcp --in=CKPT --out=DIR
//       [--dcp-world-size=W] [--dcp-format=2|1.13] [--no-optimizer]
//       [--overwrite] [--model=NAME|PATH]
//
// Exit status: 0 on success, 1 when the operation fails (the error is
// printed), 2 for a usage error.
#include <algorithm>
#include <cstdint>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "flatparam/base/dtype.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/checkpoint/file_system.h"
#include "flatparam/interop/dcp/dcp.h"
#include "flatparam/interop/dcp/dcp_export.h"
#include "flatparam/interop/hf/hf_checkpoint.h"
#include "flatparam/interop/torch_save/torch_save.h"
#include "flatparam/model_json.h"
#include "tools/layout_request.h"

ABSL_FLAG(std::string, in, "", "the input: torch.save files or a checkpoint");
ABSL_FLAG(std::string, out, "", "the output directory");
ABSL_FLAG(std::string, optimizer, "",
          "import: a torch.save file of the optimizer's full state dict");
ABSL_FLAG(std::string, model, "",
          "import: a preset name, a model file (FsdpModule::ModelFile()) or "
          "a sharded checkpoint of the model; export: the model, for a full "
          "checkpoint's tied names");
ABSL_FLAG(int64_t, world_size, 8, "import: ranks of the job");
ABSL_FLAG(std::string, strategy, "FULL_SHARD", "import: sharding strategy");
ABSL_FLAG(int64_t, shard_group_size, 0,
          "import: shard group of the hybrid strategies (0: default)");
ABSL_FLAG(bool, align_addresses, false,
          "import: PyTorch's use_orig_params=True alignment");
ABSL_FLAG(bool, cast, false,
          "import: convert tensors whose dtype differs from the model's");
ABSL_FLAG(std::string, max_shard_size, "5GB",
          "export: the most tensor bytes per file (huggingface_hub's "
          "spelling)");
ABSL_FLAG(std::string, dtype, "",
          "import: give the model's parameters this dtype; export: cast "
          "floating-point tensors to it");
ABSL_FLAG(std::string, optimizer_keys, "id",
          "export: optimizer.bin keyed by parameter ID (optimizer."
          "state_dict()) or by name (FSDP.full_optim_state_dict)");
ABSL_FLAG(bool, no_optimizer, false,
          "export: leave optimizer state out; import of a DCP checkpoint: "
          "the weights alone");
ABSL_FLAG(std::optional<std::string>, dcp_model_prefix, std::nullopt,
          "import of a DCP checkpoint: the model keys' prefix (\"model.\", "
          "or \"\" for keys at the top level; default: found)");
ABSL_FLAG(std::optional<std::string>, dcp_optim_prefix, std::nullopt,
          "import of a DCP checkpoint: the optimizer keys' prefix "
          "(\"optim.\", \"optimizer.\" or \"\"; default: found)");
ABSL_FLAG(bool, overwrite, false, "export: replace an existing output");
ABSL_FLAG(std::string, format, "torch",
          "export: torch (torch.save files) or dcp (a Distributed "
          "Checkpoint directory)");
ABSL_FLAG(int64_t, dcp_world_size, 1,
          "export --format=dcp: the ranks it appears saved by (chunks per "
          "tensor)");
ABSL_FLAG(std::string, dcp_format, "2",
          "export --format=dcp: 2 (torch.distributed.checkpoint) or 1.13 "
          "(torch.distributed._shard.checkpoint)");

namespace flatparam {
namespace {

constexpr char kUsage[] =
    "usage: fsdp_torch_files import --in=FILE|INDEX|DIR|DCPDIR "
    "[--optimizer=FILE] --model=NAME|PATH --world-size=W [--strategy=S] "
    "[--dtype=D] [--cast] [--dcp-model-prefix=P] [--dcp-optim-prefix=P] "
    "[--no-optimizer] --out=CKPT\n"
    "       fsdp_torch_files export --in=CKPT --out=DIR "
    "[--max-shard-size=5GB] [--dtype=D] [--optimizer-keys=id|name] "
    "[--no-optimizer] [--overwrite] [--model=NAME|PATH]\n"
    "       fsdp_torch_files export --format=dcp --in=CKPT --out=DIR "
    "[--dcp-world-size=W] [--dcp-format=2|1.13] [--no-optimizer] "
    "[--overwrite] [--model=NAME|PATH]\n";

absl::Status Import() {
  tools::LayoutRequest request;
  request.model = absl::GetFlag(FLAGS_model);
  request.world_size = absl::GetFlag(FLAGS_world_size);
  request.strategy = absl::GetFlag(FLAGS_strategy);
  request.shard_group_size = absl::GetFlag(FLAGS_shard_group_size);
  request.align_addresses = absl::GetFlag(FLAGS_align_addresses);
  request.dtype = absl::GetFlag(FLAGS_dtype);
  if (request.model.empty()) {
    return absl::InvalidArgumentError("import needs --model");
  }
  FLATPARAM_ASSIGN_OR_RETURN(tools::ResolvedLayout resolved,
                             tools::ResolveLayout(request));
  checkpoint::FileSystem& fs = checkpoint::PosixFileSystem();
  const std::string in = absl::GetFlag(FLAGS_in);
  checkpoint::HfImportReport report;
  FLATPARAM_ASSIGN_OR_RETURN(const bool dcp, libtorch::IsDcpCheckpoint(fs, in));
  if (dcp) {
    if (!absl::GetFlag(FLAGS_optimizer).empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--optimizer: ", in,
          " is a DCP checkpoint, which holds its optimizer state itself"));
    }
    libtorch::DcpImportOptions options;
    options.hf.cast = absl::GetFlag(FLAGS_cast);
    options.model_prefix = absl::GetFlag(FLAGS_dcp_model_prefix);
    options.optim_prefix = absl::GetFlag(FLAGS_dcp_optim_prefix);
    options.optimizer = !absl::GetFlag(FLAGS_no_optimizer);
    FLATPARAM_ASSIGN_OR_RETURN(
        report, libtorch::ImportDcpCheckpoint(
                    fs, in, resolved.layout.spec(), resolved.layout.options(),
                    resolved.world_size, absl::GetFlag(FLAGS_out), options));
  } else {
    libtorch::TorchImportOptions options;
    options.optimizer = absl::GetFlag(FLAGS_optimizer);
    options.hf.cast = absl::GetFlag(FLAGS_cast);
    FLATPARAM_ASSIGN_OR_RETURN(
        report, libtorch::ImportTorchCheckpoint(
                    fs, in, resolved.layout.spec(), resolved.layout.options(),
                    resolved.world_size, absl::GetFlag(FLAGS_out), options));
  }
  std::cout << absl::GetFlag(FLAGS_out) << ": imported " << report.imported
            << " tensors (" << report.cast << " cast, " << report.tied_copies
            << " tied copies checked, " << report.ignored
            << " ignored) for world size " << resolved.world_size
            << checkpoint::DescribeOptimizerImport(report) << "\n";
  return absl::OkStatus();
}

absl::Status ExportDcp() {
  libtorch::DcpExportOptions options;
  options.world_size = absl::GetFlag(FLAGS_dcp_world_size);
  const std::string format = absl::GetFlag(FLAGS_dcp_format);
  if (format == "1.13") {
    options.format = libtorch::DcpExportOptions::Format::kPyTorch113;
  } else if (format != "2") {
    return absl::InvalidArgumentError(
        absl::StrCat("--dcp-format=", format, ": expected 2 or 1.13"));
  }
  options.optimizer = !absl::GetFlag(FLAGS_no_optimizer);
  options.convert.overwrite = absl::GetFlag(FLAGS_overwrite);
  if (!absl::GetFlag(FLAGS_model).empty()) {
    FLATPARAM_ASSIGN_OR_RETURN(options.model,
                               tools::LoadModel(absl::GetFlag(FLAGS_model)));
  }
  FLATPARAM_ASSIGN_OR_RETURN(
      libtorch::DcpExportReport report,
      libtorch::ExportDcpCheckpoint(checkpoint::PosixFileSystem(),
                                    absl::GetFlag(FLAGS_in),
                                    absl::GetFlag(FLAGS_out), options));
  std::cout << absl::GetFlag(FLAGS_out) << ": exported " << report.tensors
            << " tensors in " << report.chunks << " chunks and "
            << report.bytes_items << " bytes items for " << options.world_size
            << " ranks"
            << (report.optimizer ? ", with the optimizer state" : "")
            << " (PyTorch " << format << " DCP)\n";
  return absl::OkStatus();
}

absl::Status Export() {
  const std::string format = absl::GetFlag(FLAGS_format);
  if (format == "dcp") return ExportDcp();
  if (format != "torch") {
    return absl::InvalidArgumentError(
        absl::StrCat("--format=", format, ": expected torch or dcp"));
  }
  libtorch::TorchExportOptions options;
  FLATPARAM_ASSIGN_OR_RETURN(
      options.max_shard_bytes,
      checkpoint::ParseByteSize(absl::GetFlag(FLAGS_max_shard_size)));
  if (!absl::GetFlag(FLAGS_dtype).empty()) {
    FLATPARAM_ASSIGN_OR_RETURN(options.dtype,
                               ParseDType(absl::GetFlag(FLAGS_dtype)));
  }
  const std::string keys = absl::GetFlag(FLAGS_optimizer_keys);
  if (keys == "name") {
    options.optimizer_keys = optim::OptimStateKeyType::kParamName;
  } else if (keys != "id") {
    return absl::InvalidArgumentError(
        absl::StrCat("--optimizer-keys=", keys, ": expected id or name"));
  }
  options.optimizer = !absl::GetFlag(FLAGS_no_optimizer);
  // A full checkpoint records no model: --model gives its tied names.
  if (!absl::GetFlag(FLAGS_model).empty()) {
    FLATPARAM_ASSIGN_OR_RETURN(options.model,
                               tools::LoadModel(absl::GetFlag(FLAGS_model)));
  }
  options.convert.overwrite = absl::GetFlag(FLAGS_overwrite);
  FLATPARAM_ASSIGN_OR_RETURN(
      libtorch::TorchExportReport report,
      libtorch::ExportTorchCheckpoint(checkpoint::PosixFileSystem(),
                                      absl::GetFlag(FLAGS_in),
                                      absl::GetFlag(FLAGS_out), options));
  std::cout << absl::GetFlag(FLAGS_out) << ": exported " << report.tensors
            << " tensors (" << report.total_size << " bytes) to "
            << absl::StrJoin(report.files, ", ") << "\n";
  return absl::OkStatus();
}

}  // namespace
}  // namespace flatparam

int main(int argc, char** argv) {
  // --help lists this file's flags (absl's default matches files named
  // after the binary, which this one is not).
  absl::SetProgramUsageMessage(flatparam::kUsage);
  absl::FlagsUsageConfig usage;
  usage.contains_help_flags = [](absl::string_view file) {
    return absl::StrContains(file, "torch_files_main");
  };
  usage.contains_helpshort_flags = usage.contains_help_flags;
  absl::SetFlagsUsageConfig(usage);
  // absl flag names use underscores; accept the dashed spelling too
  // (--world-size=2), in the name part only.
  std::vector<std::string> normalized(argv, argv + argc);
  std::vector<char*> normalized_argv;
  for (std::string& arg : normalized) {
    if (absl::StartsWith(arg, "--")) {
      const size_t end = std::min(arg.find('='), arg.size());
      std::replace(arg.begin() + 2, arg.begin() + end, '-', '_');
    }
    normalized_argv.push_back(arg.data());
  }
  std::vector<char*> args = absl::ParseCommandLine(
      static_cast<int>(normalized_argv.size()), normalized_argv.data());
  if (args.size() != 2 ||
      (std::string(args[1]) != "import" && std::string(args[1]) != "export")) {
    std::cerr << flatparam::kUsage;
    return 2;
  }
  if (absl::GetFlag(FLAGS_in).empty() || absl::GetFlag(FLAGS_out).empty()) {
    std::cerr << "fsdp_torch_files: --in and --out are required\n"
              << flatparam::kUsage;
    return 2;
  }
  const absl::Status status = std::string(args[1]) == "import"
                                  ? flatparam::Import()
                                  : flatparam::Export();
  if (!status.ok()) {
    std::cerr << "fsdp_torch_files " << args[1] << ": " << status << "\n";
    return 1;
  }
  return 0;
}
