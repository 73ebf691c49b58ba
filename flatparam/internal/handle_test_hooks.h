// Private to the project's tests: switches that break FlatParamHandle's
// ordering on purpose, so that a test can show the stream race detector
// (sim/sim_device.h) catches the break -- the mutation check of the
// handle's stream discipline, committed as a test instead of broken code.
// Never set outside tests. Thread-safety: set before the handles run.
#ifndef FLATPARAM_INTERNAL_HANDLE_TEST_HOOKS_H_
#define FLATPARAM_INTERNAL_HANDLE_TEST_HOOKS_H_

namespace flatparam {
namespace internal_handle {

// One ordering of the handle's stream discipline to leave out.
enum class SkippedOrdering {
  kNone,
  // The host's wait for the device work that produced the all-gather's
  // input (the cast to param_dtype).
  kSyncBeforeAllGather,
  // The post-backward stream's wait for the compute stream before reducing
  // the gradient the caller's backward wrote there.
  kPostBackwardWaitsForCompute,
  // The compute stream's wait for the post-backward stream before the
  // optimizer reads the sharded gradient (FinalizeBackward).
  kComputeWaitsForPostBackward,
  // RecordStream of the unsharded parameter (allocated on the unshard
  // stream, read by the compute stream) before it is freed.
  kRecordUnshardedParamOnCompute,
  // The unshard stream's wait for the compute stream (the optimizer's
  // update of the local shard) before the first unshard of an iteration:
  // the handle's, and FsdpRuntime's once-per-iteration wait.
  kUnshardWaitsForCompute,
  // Stream-ordered collectives: the compute stream's wait for the unshard
  // stream once that waited for the all-gather (FinishUnshard). With
  // host-completed collectives the host's wait orders it and this switch
  // changes nothing.
  kComputeWaitsForUnshard,
};
void SetSkippedOrderingForTesting(SkippedOrdering skip);
// Whether `which` is the ordering left out (for FsdpRuntime's own
// orderings).
bool IsSkippedForTesting(SkippedOrdering which);

// Equivalent to SetSkippedOrderingForTesting(skip ? kSyncBeforeAllGather
// : kNone).
void SetSkipSyncBeforeAllGatherForTesting(bool skip);

}  // namespace internal_handle
}  // namespace flatparam

#endif  // FLATPARAM_INTERNAL_HANDLE_TEST_HOOKS_H_
