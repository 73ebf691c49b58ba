// Shapes as flatparam's messages print them: "[2, 3]", and "[]" for a 0-d
// tensor (the layout, checkpoint and optimizer-state errors all use this
// form, so that one tensor reads the same in each).
//
// Thread-safety: pure functions.
#ifndef FLATPARAM_BASE_SHAPE_H_
#define FLATPARAM_BASE_SHAPE_H_

#include <cstdint>
#include <string>

#include "absl/types/span.h"

namespace flatparam {

// "[2, 3]": the dimensions, comma-separated, in brackets.
std::string ShapeString(absl::Span<const int64_t> shape);

}  // namespace flatparam

#endif  // FLATPARAM_BASE_SHAPE_H_
