// The `fsdp` commands' run as one of torchrun's workers (--backend=c10d):
// the world from torchrun's environment, the command on it, and this
// worker's own error printed as it ends (torchrun shows each worker's
// stderr), as ranks under mpirun print theirs. Private to fsdp_c10d's
// commands (train_c10d.cc, collectives_c10d.cc).
//
// Thread-safety: call from main's thread, once.
#ifndef TOOLS_C10D_WORLD_H_
#define TOOLS_C10D_WORLD_H_

#include <functional>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "comm/communicator.h"

namespace flatparam {
namespace tools {

// Makes the world (C10dCommunicator::FromEnvironment; the first contact
// may take the longer of `timeout` and a minute, as workers start at their
// own pace), runs `run` on it, and returns its status, marked reported
// (flatparam/base/status_macros.h) once printed as "PROGRAM: rank R: ...".
// A non-empty `trace_dir` is where the rank's flight recorder dumps
// (otherwise $FLATPARAM_TRACE_DIR); `desync_check` runs `run` on a
// DesyncCheckingCommunicator over the world (comm/desync_check.h).
absl::Status RunOnC10dWorld(
    absl::string_view program, absl::Duration timeout,
    const std::function<absl::Status(Communicator&)>& run,
    const std::string& trace_dir = "", bool desync_check = false);

}  // namespace tools
}  // namespace flatparam

#endif  // TOOLS_C10D_WORLD_H_
