// Finding the `fsdp` tool's helper binaries: the parts that link LibTorch
// (fsdp_torch_demo, fsdp_c10d) live in binaries of their own, so that `fsdp`
// itself never loads it, and `fsdp` runs them when a command needs them.
//
// Thread-safety: reads the environment and the file system; no state.
#ifndef TOOLS_HELPER_BINARY_H_
#define TOOLS_HELPER_BINARY_H_

#include <string>

#include "absl/strings/string_view.h"

namespace flatparam {
namespace tools {

// The path of helper `name`: $`env_var` if set, else the first executable
// of $RUNFILES_DIR/flatparam/tools/NAME, $TEST_SRCDIR/flatparam/tools/NAME,
// the running binary's runfiles' tools/NAME, and NAME beside the running
// binary; "" when there is none.
std::string FindHelperBinary(absl::string_view name, const char* env_var);

}  // namespace tools
}  // namespace flatparam

#endif  // TOOLS_HELPER_BINARY_H_
