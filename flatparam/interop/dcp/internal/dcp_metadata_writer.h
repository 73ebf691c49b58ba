// Private to //flatparam/torch: a DCP .metadata pickle from a list of
// items, as DCP's FileSystemWriter writes it (dcp_export.h describes the
// layout); shared by ExportDcpCheckpoint and FsdpModule's DCP save, which
// write the items' data themselves.
//
// Thread-safety: a pure function.
#ifndef FLATPARAM_INTEROP_DCP_INTERNAL_DCP_METADATA_WRITER_H_
#define FLATPARAM_INTEROP_DCP_INTERNAL_DCP_METADATA_WRITER_H_

#include <string>
#include <vector>

#include "flatparam/base/dtype.h"
#include "flatparam/interop/dcp/dcp.h"

namespace flatparam {
namespace libtorch {
namespace internal_torch {

// One key of the checkpoint: a tensor (dtype, shape and its chunks, each
// with where it is stored) or a bytes item (its storage).
struct DcpItem {
  std::string key;
  bool tensor = true;
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;
  std::vector<DcpChunk> chunks;
  DcpStorage storage;
  // planner_data: the key's path in the nested state dict.
  std::vector<std::string> path;
};

// PyTorch 2.x's class paths and fields (planner_data, storage_meta None,
// version "1.0.0"), or 1.13's (planner_data None).
enum class DcpMetadataFormat { kPyTorch2, kPyTorch113 };

// The .metadata file's bytes for `items`, in their order.
std::string PickleDcpMetadata(const std::vector<DcpItem>& items,
                              DcpMetadataFormat format);

// torch.chunk's pieces of `rows` rows over `world` ranks: (first row,
// rows) per rank that gets one; ranks past the last get none.
std::vector<std::pair<int64_t, int64_t>> TorchChunkRows(int64_t rows,
                                                        int64_t world);

// The nested-dict path of a key under `prefix` ("model." -> "model"), then
// `rest`.
std::vector<std::string> DcpPathOf(const std::string& prefix,
                                   std::vector<std::string> rest);

}  // namespace internal_torch
}  // namespace libtorch
}  // namespace flatparam

#endif  // FLATPARAM_INTEROP_DCP_INTERNAL_DCP_METADATA_WRITER_H_
