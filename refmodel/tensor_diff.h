// How far apart two sets of tensors are: the largest element-wise
// difference between the parameters (or optimizer states) of two training
// runs, for the checks that compare sharded with single-process training
// (the `fsdp train --check` command, the equivalence tests).
//
// Thread-safety: pure functions.
#ifndef FLATPARAM_REFMODEL_TENSOR_DIFF_H_
#define FLATPARAM_REFMODEL_TENSOR_DIFF_H_

#include <map>
#include <string>

#include "flatparam/flatten.h"
#include "refmodel/optimizer.h"

namespace flatparam {
namespace refmodel {

// Largest |a - b| over the tensors of two maps, compared element by
// element (as doubles). NaN when the maps differ in their keys or in a
// tensor's element count, or when an element is NaN in one and not the
// other; elements NaN in both are equal.
double MaxAbsDiff(const std::map<std::string, HostTensor>& a,
                  const std::map<std::string, HostTensor>& b);
// The same over every tensor state of two optimizer-state maps.
double MaxAbsDiff(const std::map<std::string, OptimizerState>& a,
                  const std::map<std::string, OptimizerState>& b);

// Largest |x| over every element of every tensor (NaNs are passed over).
double MaxAbs(const std::map<std::string, HostTensor>& tensors);

}  // namespace refmodel
}  // namespace flatparam

#endif  // FLATPARAM_REFMODEL_TENSOR_DIFF_H_
