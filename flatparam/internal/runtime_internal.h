// Private to //flatparam:runtime: what the implementation files of
// FsdpRuntime share besides runtime.h. They are
//   runtime.cc         creation (the counted groups and one handle per
//                      unit), the units and parameters by name, ZeroGrad;
//   runtime_hooks.cc   the hooks: iterations, the execution order, prefetch
//                      and the all-gather rate limiter (Limited), the
//                      overlapped reductions, FinalizeBackward;
//   runtime_memory.cc  the model-wide memory accounting: Track (every call
//                      on a handle goes through it), Observe, memory();
//   runtime_clip.cc    gradient clipping (ClipGradNorm).
// runtime.h's file comment says what each does.
//
// Ownership and thread-safety: as FsdpRuntime (runtime.h): one thread at a
// time; nothing here holds state.
#ifndef FLATPARAM_INTERNAL_RUNTIME_INTERNAL_H_
#define FLATPARAM_INTERNAL_RUNTIME_INTERNAL_H_

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"

namespace flatparam {
namespace internal_runtime {

// `status` with its message prefixed by `what` ("what: message"); OK stays
// OK.
inline absl::Status WithContext(const absl::Status& status,
                                absl::string_view what) {
  if (status.ok()) return status;
  return absl::Status(status.code(),
                      absl::StrFormat("%s: %s", what, status.message()));
}

}  // namespace internal_runtime
}  // namespace flatparam

#endif  // FLATPARAM_INTERNAL_RUNTIME_INTERNAL_H_
