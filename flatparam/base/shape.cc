#include "flatparam/base/shape.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace flatparam {

std::string ShapeString(absl::Span<const int64_t> shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

}  // namespace flatparam
