// A stackful fiber for SimWorld's fiber execution (SimOptions::Execution::
// kFibers): a ucontext with its own stack, so that thousands of ranks run
// as resumable tasks on one thread and handing the baton is a user-space
// context switch instead of waking another thread.
//
//   std::unique_ptr<FiberContext> scheduler = FiberContext::ForCurrentThread();
//   auto fiber = FiberContext::Create(1 << 20, &Body, &state);
//   scheduler->SwitchTo(**fiber);  // runs Body(&state) until it switches back
//
// AddressSanitizer is told about every switch (its fiber annotations), so
// it tracks the right stack and reports no false stack overflows.
//
// Ownership: a FiberContext owns its stack (mapped with a guard page below
// it); destroying a fiber that has not finished abandons its frames
// without unwinding them. Thread-safety: a fiber runs on the thread that
// switched to it; one switch at a time.
#ifndef FLATPARAM_SIM_INTERNAL_FIBER_H_
#define FLATPARAM_SIM_INTERNAL_FIBER_H_

#include <ucontext.h>

#include <cstddef>
#include <memory>

#include "absl/status/statusor.h"

namespace flatparam {
namespace internal_sim {

class FiberContext {
 public:
  // The running thread's own context (its stack), to switch back to.
  static std::unique_ptr<FiberContext> ForCurrentThread();
  // A fiber whose first resumption calls entry(arg) on a new stack of
  // `stack_bytes` (rounded up to pages). `entry` must not return: it ends
  // by switching away with exiting = true. ResourceExhausted when the
  // stack cannot be mapped.
  static absl::StatusOr<std::unique_ptr<FiberContext>> Create(
      size_t stack_bytes, void (*entry)(void*), void* arg);

  FiberContext(FiberContext&& other) = delete;
  FiberContext& operator=(FiberContext&& other) = delete;
  ~FiberContext();

  // Saves the running context in *this and resumes `to`; returns when
  // something switches back to *this. `exiting`: *this is never resumed
  // (the fiber is done).
  void SwitchTo(FiberContext& to, bool exiting = false);

 private:
  FiberContext() = default;
  static void Trampoline(unsigned int high, unsigned int low);

  ucontext_t context_{};
  void* mapping_ = nullptr;  // guard page + stack; null for a thread's
  size_t mapped_bytes_ = 0;
  const void* stack_bottom_ = nullptr;
  size_t stack_bytes_ = 0;
  void (*entry_)(void*) = nullptr;
  void* arg_ = nullptr;
};

}  // namespace internal_sim
}  // namespace flatparam

#endif  // FLATPARAM_SIM_INTERNAL_FIBER_H_
