#include <cstdint>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "flatparam/device/cuda/fake_cuda_runtime.h"
#include "flatparam/device/cuda/fake_cuda_runtime_internal.h"

// FakeCudaRuntime's streams and events: the stream workers that run each
// stream's operations in issue order (checking the memory they touch), the
// stream and event calls, and the hooks through which other models (fake
// NCCL) enqueue work and wait. fake_cuda_runtime_internal.h lists the other
// files.

namespace flatparam {

using internal_fake_cuda::At;
using internal_fake_cuda::Join;

FakeCudaRuntime::StreamState* FakeCudaRuntime::NewStream(int device) {
  auto state = std::make_unique<StreamState>();
  state->device = device;
  state->index = static_cast<int>(streams_.size());
  state->rng.seed(options_.seed + 7919 * streams_.size());
  StreamState* s = state.get();
  streams_.push_back(std::move(state));
  s->worker = std::thread([this, s] { WorkerLoop(s); });
  return s;
}

FakeCudaRuntime::StreamState* FakeCudaRuntime::FindStream(cudaStream_t stream) {
  if (stream == nullptr || stream == cudaStreamLegacy) {
    // The legacy default stream of the current device (the null handle, or
    // cudaStreamLegacy naming it explicitly), made on first use.
    const int device = CurrentDevice();
    StreamState*& s = default_streams_[device];
    if (s == nullptr) s = NewStream(device);
    return s;
  }
  for (const auto& s : streams_) {
    if (reinterpret_cast<cudaStream_t>(s.get()) == stream && !s->stop) {
      return s.get();
    }
  }
  return nullptr;
}

uint64_t FakeCudaRuntime::Enqueue(StreamState* stream, Op op) {
  const uint64_t seq = ++stream->enqueued;
  Join(stream->clock, host_clock_);
  if (stream->clock.size() <= static_cast<size_t>(stream->index)) {
    stream->clock.resize(stream->index + 1, 0);
  }
  stream->clock[stream->index] = seq;
  if (!op.touches.empty()) CheckTouches(stream, seq, op);
  stream->queue.push_back(std::move(op));
  return seq;
}

void FakeCudaRuntime::CheckTouches(StreamState* s, uint64_t seq, Op& op) {
  for (const Touch& t : op.touches) {
    Allocation* a = AllocationAt(t.ptr, t.bytes);
    if (a == nullptr) {
      // Freed (perhaps already handed out again to a later allocation that
      // does not cover the range) or never allocated.
      misuse_.push_back(absl::StrFormat(
          "%s touches %p (%d bytes), which is not allocated when it is "
          "issued (a use after a stream-ordered free?)",
          op.what, t.ptr, t.bytes));
      op.poisoned = true;
      continue;
    }
    if (a->stream != nullptr && a->stream != s &&
        At(s->clock, a->stream->index) < a->seq) {
      misuse_.push_back(absl::StrFormat(
          "%s on stream %d touches %p (%d bytes), allocated by "
          "cudaMallocAsync on stream %d, without being ordered after the "
          "allocation (no event recorded after it was waited for, nor a "
          "synchronization)",
          op.what, s->index, t.ptr, t.bytes, a->stream->index));
      op.poisoned = true;
    }
    a->uses[s->index] = {seq, op.what};
  }
}

void FakeCudaRuntime::WorkerLoop(StreamState* s) {
  while (true) {
    Op op;
    absl::Duration delay;
    {
      absl::MutexLock lock(&mu_);
      auto runnable = [this, s]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        if (s->queue.empty()) return s->stop;
        const Op& front = s->queue.front();
        if (front.hold >= 0) return front.hold < hold_generation_;
        if (front.wait_for != nullptr) {
          return front.wait_for->completed >= front.wait_seq;
        }
        return true;
      };
      mu_.Await(absl::Condition(&runnable));
      if (s->queue.empty()) return;  // stopped and drained
      op = std::move(s->queue.front());
      s->queue.pop_front();
      delay = options_.max_op_delay *
              std::uniform_real_distribution<double>(0.0, 1.0)(s->rng);
      if (op.poisoned) {
        // Issued against the stream-ordering rules (misuse() says how): on
        // a GPU it reads or writes memory that belongs to nobody, or to
        // someone else by now.
        if (sticky_ == cudaSuccess) sticky_ = cudaErrorIllegalAddress;
        op.run = nullptr;
      }
      if (op.run) {
        for (const Touch& t : op.touches) {
          char* base = nullptr;
          const Segment* segment = SegmentAt(t.ptr, &base);
          if (segment == nullptr || static_cast<const char*>(t.ptr) + t.bytes >
                                        base + segment->bytes) {
            // Memory the pool gave back to the system since the op was
            // issued (only after a misuse recorded at issue).
            if (sticky_ == cudaSuccess) sticky_ = cudaErrorIllegalAddress;
            misuse_.push_back(
                absl::StrFormat("%s touches %p (%d bytes), which is not "
                                "mapped when it runs",
                                op.what, t.ptr, t.bytes));
            op.run = nullptr;
            break;
          }
          if (op.kernel && segment->device != s->device) {
            if (sticky_ == cudaSuccess) sticky_ = cudaErrorIllegalAddress;
            misuse_.push_back(absl::StrFormat(
                "%s on cuda:%d touches %p (%d bytes) of cuda:%d, without "
                "peer access",
                op.what, s->device, t.ptr, t.bytes, segment->device));
            op.run = nullptr;
            break;
          }
        }
        if (sticky_ != cudaSuccess) op.run = nullptr;
      }
    }
    if (delay > absl::ZeroDuration()) absl::SleepFor(delay);
    if (op.run) op.run();
    absl::MutexLock lock(&mu_);
    ++s->completed;
  }
}

void FakeCudaRuntime::DrainStream(StreamState* s) {
  const uint64_t target = s->enqueued;
  const Clock clock = s->clock;
  auto done = [s, target]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return s->completed >= target;
  };
  mu_.Await(absl::Condition(&done));
  Join(host_clock_, clock);
}

void FakeCudaRuntime::DrainDevice(int device) {
  // Destroyed streams too: CUDA lets their work finish after
  // cudaStreamDestroy, and a device synchronization waits for it.
  std::vector<StreamState*> streams;
  for (const auto& s : streams_) {
    if (device < 0 || s->device == device) streams.push_back(s.get());
  }
  for (StreamState* s : streams) DrainStream(s);
}

cudaError_t FakeCudaRuntime::EnqueueWork(cudaStream_t stream,
                                         absl::string_view what,
                                         std::vector<Range> touches,
                                         std::function<void()> work) {
  std::vector<Touch> t;
  for (const Range& r : touches) t.push_back({r.ptr, r.bytes});
  absl::MutexLock lock(&mu_);
  cudaError_t e = Precheck(what);
  StreamState* s = e == cudaSuccess ? FindStream(stream) : nullptr;
  if (e == cudaSuccess && s == nullptr) e = cudaErrorInvalidResourceHandle;
  if (e != cudaSuccess) return Result(e);
  Op op;
  op.what = std::string(what);
  op.run = std::move(work);
  op.touches = std::move(t);
  Enqueue(s, std::move(op));
  return cudaSuccess;
}

int FakeCudaRuntime::StreamDevice(cudaStream_t stream) {
  absl::MutexLock lock(&mu_);
  StreamState* s = FindStream(stream);
  return s == nullptr ? -1 : s->device;
}

bool FakeCudaRuntime::WaitUntil(const std::function<bool()>& ready) {
  absl::MutexLock lock(&mu_);
  auto done = [this, &ready]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return shutting_down_ || ready();
  };
  mu_.Await(absl::Condition(&done));
  return ready();
}

void FakeCudaRuntime::Locked(const std::function<void()>& f) {
  absl::MutexLock lock(&mu_);
  f();
}

// ---- Streams and events ----

cudaError_t FakeCudaRuntime::StreamCreateWithFlags(cudaStream_t* stream,
                                                   unsigned int flags) {
  absl::MutexLock lock(&mu_);
  const cudaError_t e = Precheck("cudaStreamCreateWithFlags");
  if (e != cudaSuccess) return Result(e);
  *stream = reinterpret_cast<cudaStream_t>(NewStream(CurrentDevice()));
  return cudaSuccess;
}

cudaError_t FakeCudaRuntime::StreamDestroy(cudaStream_t stream) {
  {
    absl::MutexLock lock(&mu_);
    cudaError_t e = Precheck("cudaStreamDestroy");
    StreamState* s = stream == nullptr ? nullptr : FindStream(stream);
    if (e == cudaSuccess && s == nullptr) e = cudaErrorInvalidResourceHandle;
    if (e != cudaSuccess) return Result(e);
    // CUDA lets the stream's work finish after the call; the worker exits
    // once drained and is joined when the fake is destroyed.
    s->stop = true;
  }
  return cudaSuccess;
}

cudaError_t FakeCudaRuntime::StreamSynchronize(cudaStream_t stream) {
  absl::MutexLock lock(&mu_);
  cudaError_t e = Precheck("cudaStreamSynchronize");
  StreamState* s = e == cudaSuccess ? FindStream(stream) : nullptr;
  if (e == cudaSuccess && s == nullptr) e = cudaErrorInvalidResourceHandle;
  if (e == cudaSuccess) {
    DrainStream(s);
    ReleaseIdleBlocks();
    e = sticky_;
  }
  return Result(e);
}

cudaError_t FakeCudaRuntime::StreamQuery(cudaStream_t stream) {
  absl::MutexLock lock(&mu_);
  cudaError_t e = Precheck("cudaStreamQuery");
  StreamState* s = e == cudaSuccess ? FindStream(stream) : nullptr;
  if (e == cudaSuccess && s == nullptr) e = cudaErrorInvalidResourceHandle;
  if (e == cudaSuccess && s->completed < s->enqueued) e = cudaErrorNotReady;
  if (e == cudaSuccess) Join(host_clock_, s->clock);
  return Result(e);
}

cudaError_t FakeCudaRuntime::StreamWaitEvent(cudaStream_t stream,
                                             cudaEvent_t event,
                                             unsigned int flags) {
  absl::MutexLock lock(&mu_);
  cudaError_t e = Precheck("cudaStreamWaitEvent");
  StreamState* s = e == cudaSuccess ? FindStream(stream) : nullptr;
  auto it = events_.find(reinterpret_cast<const EventState*>(event));
  if (e == cudaSuccess && (s == nullptr || it == events_.end())) {
    e = cudaErrorInvalidResourceHandle;
  }
  if (e != cudaSuccess) return Result(e);
  const EventState& ev = *it->second;
  if (ev.stream != nullptr) {
    Op op;
    op.what = "cudaStreamWaitEvent";
    op.wait_for = ev.stream;
    op.wait_seq = ev.seq;
    Enqueue(s, std::move(op));
    Join(s->clock, ev.clock);
  }
  return cudaSuccess;
}

cudaError_t FakeCudaRuntime::EventCreateWithFlags(cudaEvent_t* event,
                                                  unsigned int flags) {
  absl::MutexLock lock(&mu_);
  const cudaError_t e = Precheck("cudaEventCreateWithFlags");
  if (e != cudaSuccess) return Result(e);
  auto state = std::make_unique<EventState>();
  state->device = CurrentDevice();
  *event = reinterpret_cast<cudaEvent_t>(state.get());
  events_[state.get()] = std::move(state);
  ++event_creations_;
  return cudaSuccess;
}

cudaError_t FakeCudaRuntime::EventDestroy(cudaEvent_t event) {
  absl::MutexLock lock(&mu_);
  // Destroying an event whose work is pending is allowed: CUDA releases it
  // once the work completes, and waits already enqueued keep their target.
  auto it = events_.find(reinterpret_cast<const EventState*>(event));
  if (it == events_.end()) {
    misuse_.push_back(absl::StrFormat("cudaEventDestroy(%p): no such event",
                                      static_cast<void*>(event)));
    return Result(cudaErrorInvalidResourceHandle);
  }
  events_.erase(it);
  return cudaSuccess;
}

cudaError_t FakeCudaRuntime::EventRecord(cudaEvent_t event,
                                         cudaStream_t stream) {
  absl::MutexLock lock(&mu_);
  cudaError_t e = Precheck("cudaEventRecord");
  auto it = events_.find(reinterpret_cast<const EventState*>(event));
  StreamState* s = e == cudaSuccess ? FindStream(stream) : nullptr;
  if (e == cudaSuccess && (it == events_.end() || s == nullptr)) {
    e = cudaErrorInvalidResourceHandle;
  }
  if (e == cudaSuccess && it->second->device != s->device) {
    misuse_.push_back(absl::StrFormat(
        "cudaEventRecord: event of cuda:%d recorded on a stream of cuda:%d",
        it->second->device, s->device));
    e = cudaErrorInvalidResourceHandle;
  }
  if (e != cudaSuccess) return Result(e);
  it->second->stream = s;
  it->second->seq = s->enqueued;
  // Issued after what the host has seen complete, so a wait for it is
  // ordered after that too.
  it->second->clock = s->clock;
  Join(it->second->clock, host_clock_);
  return cudaSuccess;
}

cudaError_t FakeCudaRuntime::EventQuery(cudaEvent_t event) {
  absl::MutexLock lock(&mu_);
  cudaError_t e = Precheck("cudaEventQuery");
  auto it = events_.find(reinterpret_cast<const EventState*>(event));
  if (e == cudaSuccess && it == events_.end()) {
    e = cudaErrorInvalidResourceHandle;
  }
  if (e == cudaSuccess) {
    const EventState& ev = *it->second;
    if (ev.stream != nullptr && ev.stream->completed < ev.seq) {
      e = cudaErrorNotReady;
    } else {
      Join(host_clock_, ev.clock);
    }
  }
  return Result(e);
}

cudaError_t FakeCudaRuntime::EventSynchronize(cudaEvent_t event) {
  absl::MutexLock lock(&mu_);
  cudaError_t e = Precheck("cudaEventSynchronize");
  auto it = events_.find(reinterpret_cast<const EventState*>(event));
  if (e == cudaSuccess && it == events_.end()) {
    e = cudaErrorInvalidResourceHandle;
  }
  if (e == cudaSuccess && it->second->stream != nullptr) {
    StreamState* s = it->second->stream;
    const uint64_t seq = it->second->seq;
    const Clock clock = it->second->clock;
    auto done = [s, seq]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return s->completed >= seq;
    };
    mu_.Await(absl::Condition(&done));
    Join(host_clock_, clock);
    e = sticky_;
  }
  return Result(e);
}

}  // namespace flatparam
