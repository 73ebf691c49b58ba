// Private to tools/train*.cc: what the flag, report and run parts of
// `fsdp train` share.
#ifndef TOOLS_INTERNAL_TRAIN_INTERNAL_H_
#define TOOLS_INTERNAL_TRAIN_INTERNAL_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "flatparam/optim/optim_state.h"
#include "refmodel/optimizer.h"

namespace flatparam {
namespace tools {
namespace internal_train {

// PyTorch's param_groups entry for the optimizer over flat parameters
// 0..n-1 (the flat-parameter path's keys).
optim::ParamGroup ParamGroupFor(const refmodel::OptimizerOptions& o, int64_t n);

// --fault-skip-forward=RANK:STEP:UNIT.
struct SkipForwardFault {
  int rank = 0;
  int64_t step = 0;
  std::string unit;
};

absl::StatusOr<SkipForwardFault> ParseSkipForward(const std::string& text);

}  // namespace internal_train
}  // namespace tools
}  // namespace flatparam

#endif  // TOOLS_INTERNAL_TRAIN_INTERNAL_H_
