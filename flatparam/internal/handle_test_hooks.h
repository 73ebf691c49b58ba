// Private to the project's tests: switches that break FlatParamHandle's
// ordering on purpose, so that a test can show the stream race detector
// (sim/sim_device.h) catches the break -- the mutation check of the
// handle's stream discipline, committed as a test instead of broken code.
// Never set outside tests. Thread-safety: set before the handles run.
#ifndef FLATPARAM_INTERNAL_HANDLE_TEST_HOOKS_H_
#define FLATPARAM_INTERNAL_HANDLE_TEST_HOOKS_H_

namespace flatparam {
namespace internal_handle {

// When set, the handle issues its all-gather without first waiting for the
// device work that produced its input (the cast to param_dtype, the copy
// from an offloaded shard): the one ordering between device work and the
// unshard's collective.
void SetSkipSyncBeforeAllGatherForTesting(bool skip);

}  // namespace internal_handle
}  // namespace flatparam

#endif  // FLATPARAM_INTERNAL_HANDLE_TEST_HOOKS_H_
