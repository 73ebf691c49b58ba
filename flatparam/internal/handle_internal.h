// Private to //flatparam:handle: what the implementation files of
// FlatParamHandle (handle.cc: creation and the training-state machine;
// handle_unshard.cc: collectives, streams, unshard and reshard;
// handle_grad.cc: gradient reduction, views and masks; handle_summon.cc:
// parameter views and summoning) share besides handle.h.
//
// Thread-safety: as FlatParamHandle (one thread per handle); the testing
// switches are atomics.
#ifndef FLATPARAM_INTERNAL_HANDLE_INTERNAL_H_
#define FLATPARAM_INTERNAL_HANDLE_INTERNAL_H_

#include "flatparam/internal/handle_test_hooks.h"
#include "flatparam/internal/on_stream.h"

namespace flatparam {
namespace internal_handle {

// Whether a test switched `which` ordering off (handle_test_hooks.h).
inline bool Skipped(SkippedOrdering which) {
  return IsSkippedForTesting(which);
}

// OnStream (on_stream.h) scopes the handle's device work to one of
// HandleOptions::streams, which the handle expects its DeviceOps to take:
// each use asserts that making the stream current succeeded.

}  // namespace internal_handle
}  // namespace flatparam

#endif  // FLATPARAM_INTERNAL_HANDLE_INTERNAL_H_
