// flatparam checkpoints out as PyTorch Distributed Checkpoint (DCP)
// directories, which Python's DCP loads into an FSDP or a plain module at
// any world size (dcp.h reads them back).
//
//   DcpExportOptions options;
//   options.world_size = 4;  // as if saved by 4 ranks
//   FLATPARAM_ASSIGN_OR_RETURN(DcpExportReport report,
//                              ExportDcpCheckpoint(fs, "ckpt", "dcp",
//                              options));
//   # Python (2.x):
//   #   sd = {"model": model.state_dict(), "optim": ...}
//   #   torch.distributed.checkpoint.load(sd, checkpoint_id="dcp")
//
// Layout: what DCP 2.x writes for {"model": state_dict(), "optim":
// optimizer state dict keyed by name} saved by `world_size` ranks with
// FileSystemWriter's defaults: keys flattened ("model.<fqn>",
// "optim.state.<fqn>.<state>", "optim.param_groups" a bytes item whose
// "params" name parameters by FQN, as FSDP.optim_state_dict gives them);
// every tensor of at least one dimension chunked on dim 0 as torch.chunk
// chunks it (FSDP's SHARDED_STATE_DICT; a rank past the last chunk holds
// none), 0-d tensors and bytes items on rank 0; rank r's items, each a
// torch.save archive, back to back in __r_0.distcp; planner_data maps each
// key to its path in the nested dict; version "1.0.0". The model's tied
// names are written too (as state_dict() holds them), so that a state dict
// of the module finds every key. Class paths: Metadata and its classes
// under torch.distributed.checkpoint, TensorProperties and its memory-format
// enum under torch.distributed._shard.sharded_tensor.metadata (where 2.0 to
// 2.3 define them; later releases read those checkpoints). With
// Format::kPyTorch113 every class is under 1.13's
// torch.distributed._shard.checkpoint instead, planner_data is None and
// the keys are the same flat ones, for
// torch.distributed._shard.checkpoint.load_state_dict.
//
// The output directory is written in a temporary sibling and renamed into
// place; an existing one is replaced only with convert.overwrite.
// Memory: one chunk (a sharded input is consolidated on disk first).
// Thread-safety: reentrant; the FileSystem is borrowed.
#ifndef FLATPARAM_INTEROP_DCP_DCP_EXPORT_H_
#define FLATPARAM_INTEROP_DCP_DCP_EXPORT_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "flatparam/checkpoint/convert.h"
#include "flatparam/checkpoint/file_system.h"
#include "flatparam/model_layout.h"

namespace flatparam {
namespace libtorch {

struct DcpExportOptions {
  enum class Format { kPyTorch2, kPyTorch113 };
  Format format = Format::kPyTorch2;
  // The ranks the checkpoint appears saved by (>= 1): chunks per tensor
  // and .distcp files.
  int64_t world_size = 1;
  // Export the optimizer state when the checkpoint has some.
  bool optimizer = true;
  // The keys' prefixes (see DcpImportOptions).
  std::string model_prefix = "model.";
  std::string optim_prefix = "optim.";
  checkpoint::ConvertOptions convert;
  // The model, for the tied names of a full checkpoint (which records no
  // model); a sharded checkpoint's layout gives them otherwise.
  std::optional<ModelSpec> model;
};

struct DcpExportReport {
  // Files written, .metadata last.
  std::vector<std::string> files;
  int64_t tensors = 0;  // tensor items (keys)
  int64_t chunks = 0;   // their chunks
  int64_t bytes_items = 0;
  bool optimizer = false;
};

// Exports the full or sharded checkpoint `in_dir` to `out_dir` (see the
// file comment). InvalidArgument for world_size < 1 or an `out_dir` that
// is or holds `in_dir`; FailedPrecondition for an existing `out_dir`
// without overwrite; the readers' errors. On error `out_dir` is unchanged.
absl::StatusOr<DcpExportReport> ExportDcpCheckpoint(
    checkpoint::FileSystem& fs, const std::string& in_dir,
    const std::string& out_dir, const DcpExportOptions& options = {});

}  // namespace libtorch
}  // namespace flatparam

#endif  // FLATPARAM_INTEROP_DCP_DCP_EXPORT_H_
