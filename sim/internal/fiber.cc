#include "sim/internal/fiber.h"

#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cassert>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/common_interface_defs.h>
#define FLATPARAM_FIBER_ASAN 1
#else
#define FLATPARAM_FIBER_ASAN 0
#endif

namespace flatparam {
namespace internal_sim {

std::unique_ptr<FiberContext> FiberContext::ForCurrentThread() {
  std::unique_ptr<FiberContext> out(new FiberContext());
  pthread_attr_t attr;
  if (pthread_getattr_np(pthread_self(), &attr) == 0) {
    void* bottom = nullptr;
    size_t size = 0;
    if (pthread_attr_getstack(&attr, &bottom, &size) == 0) {
      out->stack_bottom_ = bottom;
      out->stack_bytes_ = size;
    }
    pthread_attr_destroy(&attr);
  }
  return out;
}

absl::StatusOr<std::unique_ptr<FiberContext>> FiberContext::Create(
    size_t stack_bytes, void (*entry)(void*), void* arg) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t stack = (stack_bytes + page - 1) / page * page;
  const size_t total = stack + page;
  // Pages are committed as the fiber touches them: thousands of fibers
  // cost their stacks' used depth, not stack_bytes each.
  void* mapping =
      mmap(nullptr, total, PROT_READ | PROT_WRITE,
           MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_STACK, -1, 0);
  if (mapping == MAP_FAILED) {
    return absl::ResourceExhaustedError(
        absl::StrFormat("sim: mapping a fiber stack of %d bytes failed: %s",
                        total, std::strerror(errno)));
  }
  // The guard page below the stack turns an overflow into a fault.
  if (mprotect(mapping, page, PROT_NONE) != 0) {
    const int err = errno;
    munmap(mapping, total);
    return absl::ResourceExhaustedError(absl::StrFormat(
        "sim: protecting a fiber's guard page failed: %s", std::strerror(err)));
  }
  std::unique_ptr<FiberContext> fiber(new FiberContext());
  fiber->mapping_ = mapping;
  fiber->mapped_bytes_ = total;
  fiber->stack_bottom_ = static_cast<char*>(mapping) + page;
  fiber->stack_bytes_ = stack;
  fiber->entry_ = entry;
  fiber->arg_ = arg;
  if (getcontext(&fiber->context_) != 0) {
    return absl::InternalError(absl::StrFormat(
        "sim: getcontext for a fiber failed: %s", std::strerror(errno)));
  }
  fiber->context_.uc_stack.ss_sp = const_cast<void*>(fiber->stack_bottom_);
  fiber->context_.uc_stack.ss_size = stack;
  fiber->context_.uc_link = nullptr;
  // makecontext passes int arguments: the pointer goes in two halves.
  const uintptr_t self = reinterpret_cast<uintptr_t>(fiber.get());
  makecontext(&fiber->context_,
              reinterpret_cast<void (*)()>(&FiberContext::Trampoline), 2,
              static_cast<unsigned int>(self >> 32),
              static_cast<unsigned int>(self & 0xffffffffu));
  return fiber;
}

FiberContext::~FiberContext() {
  if (mapping_ != nullptr) munmap(mapping_, mapped_bytes_);
}

void FiberContext::Trampoline(unsigned int high, unsigned int low) {
  FiberContext* self = reinterpret_cast<FiberContext*>(
      (static_cast<uintptr_t>(high) << 32) | static_cast<uintptr_t>(low));
#if FLATPARAM_FIBER_ASAN
  __sanitizer_finish_switch_fiber(nullptr, nullptr, nullptr);
#endif
  self->entry_(self->arg_);
  // The entry function switches away for good instead of returning.
  assert(false && "a fiber's entry function returned");
  abort();
}

void FiberContext::SwitchTo(FiberContext& to, bool exiting) {
#if FLATPARAM_FIBER_ASAN
  void* fake_stack = nullptr;
  __sanitizer_start_switch_fiber(exiting ? nullptr : &fake_stack,
                                 to.stack_bottom_, to.stack_bytes_);
#else
  (void)exiting;
#endif
  // Only fails for a malformed context, which Create rules out.
  const int rc = swapcontext(&context_, &to.context_);
  assert(rc == 0);
  (void)rc;
#if FLATPARAM_FIBER_ASAN
  __sanitizer_finish_switch_fiber(fake_stack, nullptr, nullptr);
#endif
}

}  // namespace internal_sim
}  // namespace flatparam
