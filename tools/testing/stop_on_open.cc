// A test-only LD_PRELOAD library that stops one MPI rank (SIGSTOP, or
// SIGKILL with STOP_ON_OPEN_SIGNAL=KILL) at a precise point of its work,
// without a hook in the product: when the rank whose OMPI_COMM_WORLD_RANK
// equals $STOP_ON_OPEN_RANK first opens a file whose path contains
// $STOP_ON_OPEN. It prints "stop_on_open: rank R: stopped at open of PATH
// at T" (T: Unix time in milliseconds) to stderr first, so a test can time
// the job's end from the fault. Without both variables it only forwards
// open() and open64().
//
// Used by //tools:mpi_fault_cli_test to stop a rank while it loads its
// checkpoint shard.
#include <dlfcn.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace {

std::atomic<bool> g_stopped{false};

void MaybeStop(const char* path) {
  const char* pattern = std::getenv("STOP_ON_OPEN");
  const char* rank = std::getenv("STOP_ON_OPEN_RANK");
  const char* me = std::getenv("OMPI_COMM_WORLD_RANK");
  if (pattern == nullptr || rank == nullptr || me == nullptr ||
      path == nullptr || std::strcmp(rank, me) != 0 ||
      std::strstr(path, pattern) == nullptr || g_stopped.exchange(true)) {
    return;
  }
  const long long ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                           std::chrono::system_clock::now().time_since_epoch())
                           .count();
  std::fprintf(stderr, "stop_on_open: rank %s: stopped at open of %s at %lld\n",
               me, path, ms);
  std::fflush(stderr);
  const char* signal = std::getenv("STOP_ON_OPEN_SIGNAL");
  raise(signal != nullptr && std::strcmp(signal, "KILL") == 0 ? SIGKILL
                                                              : SIGSTOP);
}

using OpenFn = int (*)(const char*, int, ...);

int Forward(const char* name, const char* path, int flags, mode_t mode) {
  MaybeStop(path);
  const auto real = reinterpret_cast<OpenFn>(dlsym(RTLD_NEXT, name));
  return real(path, flags, mode);
}

mode_t ModeOf(int flags, va_list args) {
  return (flags & (O_CREAT | O_TMPFILE)) != 0
             ? static_cast<mode_t>(va_arg(args, int))
             : 0;
}

}  // namespace

extern "C" int open(const char* path, int flags, ...) {
  va_list args;
  va_start(args, flags);
  const mode_t mode = ModeOf(flags, args);
  va_end(args);
  return Forward("open", path, flags, mode);
}

extern "C" int open64(const char* path, int flags, ...) {
  va_list args;
  va_start(args, flags);
  const mode_t mode = ModeOf(flags, args);
  va_end(args);
  return Forward("open64", path, flags, mode);
}
