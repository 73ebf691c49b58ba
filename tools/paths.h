// Paths as the `fsdp` tool's summaries print them.
//
// Thread-safety: reads the working directory, which the tool sets once in
// main (to BUILD_WORKING_DIRECTORY under `bazel run`) before any use.
#ifndef TOOLS_PATHS_H_
#define TOOLS_PATHS_H_

#include <string>

#include "absl/strings/string_view.h"

namespace flatparam {
namespace tools {

// `path` as an absolute, lexically normal path, against the working
// directory; symlinks are not resolved and the path need not exist. What
// every summary prints, so that a user sees where an output went (under
// `bazel run` too). Empty stays empty; `path` itself if the working
// directory cannot be read.
std::string AbsolutePath(absl::string_view path);

}  // namespace tools
}  // namespace flatparam

#endif  // TOOLS_PATHS_H_
