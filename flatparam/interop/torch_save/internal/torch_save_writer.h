// Private to //flatparam/torch: torch.save archives appended to an open
// file, one value each, as DCP's .distcp files hold its items (an archive
// per tensor chunk or bytes item, back to back). Written as torch_save.h's
// files are (protocol 2, LibTorch's zip writer, storages little-endian on
// 'cpu'), so torch.load(..., weights_only=True) reads each.
//
// Each returns the archive's size in bytes; on error the file holds a
// partial archive (the caller discards the file). Thread-safety:
// reentrant; the file is borrowed.
#ifndef FLATPARAM_INTEROP_TORCH_SAVE_INTERNAL_TORCH_SAVE_WRITER_H_
#define FLATPARAM_INTEROP_TORCH_SAVE_INTERNAL_TORCH_SAVE_WRITER_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "flatparam/checkpoint/file_system.h"
#include "flatparam/flatten.h"
#include "flatparam/optim/optim_state.h"

namespace flatparam {
namespace libtorch {
namespace internal_torch {

// torch.save(tensor): a contiguous tensor over its own storage.
absl::StatusOr<uint64_t> AppendTorchTensorArchive(
    checkpoint::WritableFile& file, const std::string& path,
    const HostTensor& tensor);
// torch.save(value) of a scalar (None, bool, int, float, str) or tensor.
absl::StatusOr<uint64_t> AppendTorchValueArchive(
    checkpoint::WritableFile& file, const std::string& path,
    const optim::OptimStateValue& value);
// torch.save(optimizer.state_dict()["param_groups"]): a list of dicts,
// hyperparameters and "params".
absl::StatusOr<uint64_t> AppendTorchParamGroupsArchive(
    checkpoint::WritableFile& file, const std::string& path,
    const std::vector<optim::ParamGroup>& groups);

}  // namespace internal_torch
}  // namespace libtorch
}  // namespace flatparam

#endif  // FLATPARAM_INTEROP_TORCH_SAVE_INTERNAL_TORCH_SAVE_WRITER_H_
