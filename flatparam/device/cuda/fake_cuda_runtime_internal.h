// Private to //flatparam/device/cuda:fake_cuda_runtime: what the
// implementation files of FakeCudaRuntime share besides
// fake_cuda_runtime.h, i.e. its private state types. They are
//   fake_cuda_runtime.cc  construction and destruction, the test controls
//                         and counters, the error model (last errors per
//                         thread, injected and sticky errors) and devices;
//   fake_cuda_streams.cc  the stream workers and the stream and event calls,
//                         and the hooks other models enqueue work through;
//   fake_cuda_memory.cc   device, pooled (stream-ordered) and pinned memory,
//                         the memory pools' attributes, copies and memsets;
//   fake_cuda_kernels.cc  kernel launches, cuda_kernels.cu's arithmetic as
//                         host loops.
//
// How they fit. Every call takes the fake's mutex, asks Precheck for an
// injected or sticky error, and records a failure as the thread's last
// error (Result). Work on a stream becomes an Op in its StreamState's
// queue, run in issue order by the stream's worker thread (WorkerLoop),
// which checks the device ranges the Op touches are mapped first. Every Op
// also gets a vector clock when issued (Enqueue): what it is ordered after,
// through its stream, cudaStreamWaitEvent and the host's synchronizations.
// An Op that touches a stream-ordered allocation must be ordered after the
// cudaMallocAsync, and the cudaFreeAsync after every Op that touched it; an
// Op that breaks either is poisoned at issue (misuse() says which), so the
// check does not depend on how the streams happened to interleave. Events
// remember the stream, position and clock of their last record.
//
// These are nested types of FakeCudaRuntime (declared in its header), so
// they live in namespace flatparam rather than an internal namespace.
// Ownership: the fake owns every StreamState (streams_), EventState
// (events_) and PoolState (pools_); handles given out (cudaStream_t,
// cudaEvent_t, cudaMemPool_t) are pointers to them. Thread-safety: every
// field is read and written under FakeCudaRuntime::mu_ (the destructor
// moves the workers out under it, then joins them).
#ifndef FLATPARAM_DEVICE_CUDA_FAKE_CUDA_RUNTIME_INTERNAL_H_
#define FLATPARAM_DEVICE_CUDA_FAKE_CUDA_RUNTIME_INTERNAL_H_

#include <cstdint>
#include <deque>
#include <random>
#include <thread>
#include <vector>

#include "flatparam/device/cuda/fake_cuda_runtime.h"

namespace flatparam {
namespace internal_fake_cuda {

// Vector clocks (FakeCudaRuntime::Clock): `into` becomes ordered after
// `other` too (element-wise maximum).
inline void Join(std::vector<uint64_t>& into,
                 const std::vector<uint64_t>& other) {
  if (into.size() < other.size()) into.resize(other.size(), 0);
  for (size_t i = 0; i < other.size(); ++i) {
    if (other[i] > into[i]) into[i] = other[i];
  }
}

// Entry `index` of `clock` (0 where the clock has none).
inline uint64_t At(const std::vector<uint64_t>& clock, int index) {
  return static_cast<size_t>(index) < clock.size() ? clock[index] : 0;
}

}  // namespace internal_fake_cuda

struct FakeCudaRuntime::StreamState {
  int device = 0;
  int index = 0;  // in streams_, and in clocks
  // The clock of the last operation issued on the stream.
  Clock clock;
  std::deque<Op> queue;
  uint64_t enqueued = 0;   // operations issued
  uint64_t completed = 0;  // operations finished (in issue order)
  bool stop = false;
  std::mt19937_64 rng;
  std::thread worker;
};

struct FakeCudaRuntime::EventState {
  int device = 0;
  StreamState* stream = nullptr;  // of the last record; null if none
  uint64_t seq = 0;               // complete when stream->completed >= seq
  Clock clock;                    // what a wait for the record is after
};

struct FakeCudaRuntime::PoolState {
  int device = 0;
  uint64_t release_threshold = 0;
  uint64_t reserved = 0;
  uint64_t reserved_high = 0;
};

}  // namespace flatparam

#endif  // FLATPARAM_DEVICE_CUDA_FAKE_CUDA_RUNTIME_INTERNAL_H_
