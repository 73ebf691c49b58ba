// The --timeout of the `fsdp` subcommands that communicate (collectives,
// train): the longest any one collective may wait
// (CollectiveOptions::timeout) before it fails with DeadlineExceeded, whose
// message names the rank and the op, instead of hanging.
//
// Thread-safety: a pure function.
#ifndef TOOLS_COLLECTIVE_TIMEOUT_H_
#define TOOLS_COLLECTIVE_TIMEOUT_H_

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace flatparam {
namespace tools {

// OK for a positive, finite `timeout`; otherwise InvalidArgument naming the
// flag and the value ("--timeout=0: ...", "--timeout=-5s: ...").
absl::Status ValidateCollectiveTimeout(absl::Duration timeout);

// How long MPI's start may wait for every process of the job under a
// --timeout of `timeout`: the longer of it and one minute. A collective's
// peers are already running; a job's processes still load (a large binary,
// a loaded machine), and a start bounded by a few seconds' --timeout would
// fail jobs that are only slow to start.
absl::Duration MpiStartTimeout(absl::Duration timeout);

}  // namespace tools
}  // namespace flatparam

#endif  // TOOLS_COLLECTIVE_TIMEOUT_H_
