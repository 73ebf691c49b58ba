#include "flatparam/device/cuda/fake_cuda_runtime.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <new>
#include <random>
#include <utility>

#include "absl/strings/str_format.h"
#include "flatparam/base/dtype.h"

namespace flatparam {

using internal_cuda::KernelDType;

struct FakeCudaRuntime::StreamState {
  int device = 0;
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
};

struct FakeCudaRuntime::PoolState {
  int device = 0;
  uint64_t release_threshold = 0;
  uint64_t reserved = 0;
  uint64_t reserved_high = 0;
};

namespace {

struct ThreadState {
  int device = 0;
  cudaError_t last_error = cudaSuccess;
};

// Per thread and per fake (keyed by the fake's id, never reused).
ThreadState& Thread(uint64_t id) {
  thread_local std::map<uint64_t, ThreadState> states;
  return states[id];
}

std::atomic<uint64_t> next_id{1};

DType ToDType(KernelDType d) {
  switch (d) {
    case KernelDType::kFloat64:
      return DType::kFloat64;
    case KernelDType::kFloat16:
      return DType::kFloat16;
    case KernelDType::kBFloat16:
      return DType::kBFloat16;
    case KernelDType::kFloat32:
      break;
  }
  return DType::kFloat32;
}

bool ValidKernelDType(KernelDType d) {
  const int v = static_cast<int>(d);
  return v >= 0 && v <= 3;
}

// A value in the dtype's compute type (float32, or float64 for float64),
// as cuda_kernels.cu's Elem<T>::Load gives it.
double Compute(DType dtype, double v) {
  return dtype == DType::kFloat64 ? v
                                  : static_cast<double>(static_cast<float>(v));
}

}  // namespace

FakeCudaRuntime::FakeCudaRuntime() : FakeCudaRuntime(Options()) {}

FakeCudaRuntime::FakeCudaRuntime(Options options)
    : options_(options), id_(next_id.fetch_add(1)) {
  absl::MutexLock lock(&mu_);
  for (int d = 0; d < options_.device_count; ++d) {
    auto pool = std::make_unique<PoolState>();
    pool->device = d;
    pools_.push_back(std::move(pool));
    default_streams_.push_back(nullptr);
  }
}

FakeCudaRuntime::~FakeCudaRuntime() {
  std::vector<std::thread> workers;
  {
    absl::MutexLock lock(&mu_);
    ++hold_generation_;     // release held streams so that they can drain
    shutting_down_ = true;  // and work waiting in WaitUntil
    for (auto& s : streams_) {
      s->stop = true;
      workers.push_back(std::move(s->worker));
    }
  }
  for (std::thread& t : workers) {
    if (t.joinable()) t.join();
  }
  absl::MutexLock lock(&mu_);
  for (auto& [p, b] : blocks_) ::operator delete (p, std::align_val_t{256});
  for (auto& [p, bytes] : pinned_) ::operator delete (p, std::align_val_t{256});
}

// ---- Test controls ----

void FakeCudaRuntime::FailNext(absl::string_view call, cudaError_t error) {
  absl::MutexLock lock(&mu_);
  fail_next_[std::string(call)] = error;
}

void FakeCudaRuntime::HoldStream(cudaStream_t stream) {
  absl::MutexLock lock(&mu_);
  StreamState* s = FindStream(stream);
  if (s == nullptr) return;
  Op op;
  op.what = "hold";
  op.hold = hold_generation_;
  Enqueue(s, std::move(op));
}

void FakeCudaRuntime::ReleaseStreams() {
  absl::MutexLock lock(&mu_);
  ++hold_generation_;
}

std::vector<std::string> FakeCudaRuntime::misuse() const {
  absl::MutexLock lock(&mu_);
  return misuse_;
}

int64_t FakeCudaRuntime::live_events() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(events_.size());
}

int64_t FakeCudaRuntime::event_creations() const {
  absl::MutexLock lock(&mu_);
  return event_creations_;
}

int64_t FakeCudaRuntime::live_streams() const {
  absl::MutexLock lock(&mu_);
  int64_t n = 0;
  for (const auto& s : streams_) n += s->stop ? 0 : 1;
  for (StreamState* s : default_streams_) n -= s != nullptr ? 1 : 0;
  return n;
}

int64_t FakeCudaRuntime::live_device_blocks() const {
  absl::MutexLock lock(&mu_);
  int64_t n = 0;
  for (const auto& [p, b] : blocks_) n += b.live ? 1 : 0;
  return n;
}

int64_t FakeCudaRuntime::device_mallocs() const {
  absl::MutexLock lock(&mu_);
  return device_mallocs_;
}

// ---- Internals ----

cudaError_t FakeCudaRuntime::Result(cudaError_t error) {
  if (error != cudaSuccess) Thread(id_).last_error = error;
  return error;
}

cudaError_t FakeCudaRuntime::Precheck(absl::string_view call) {
  auto it = fail_next_.find(std::string(call));
  if (it != fail_next_.end()) {
    const cudaError_t e = it->second;
    fail_next_.erase(it);
    return e;
  }
  return sticky_;
}

int FakeCudaRuntime::CurrentDevice() const { return Thread(id_).device; }

FakeCudaRuntime::StreamState* FakeCudaRuntime::FindStream(cudaStream_t stream) {
  if (stream == nullptr) {
    // The legacy default stream of the current device, made on first use.
    const int device = CurrentDevice();
    StreamState*& s = default_streams_[device];
    if (s == nullptr) {
      auto state = std::make_unique<StreamState>();
      state->device = device;
      state->rng.seed(options_.seed + 7919 * streams_.size());
      s = state.get();
      streams_.push_back(std::move(state));
      s->worker = std::thread([this, s] { WorkerLoop(s); });
    }
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
  stream->queue.push_back(std::move(op));
  return ++stream->enqueued;
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
      if (op.run) {
        for (const Touch& t : op.touches) {
          if (!IsLiveDevice(t.ptr, t.bytes)) {
            // The kernel would read or write memory that is not allocated
            // now: on a GPU, an illegal address (or silent corruption of
            // whatever the pool handed out since).
            if (sticky_ == cudaSuccess) sticky_ = cudaErrorIllegalAddress;
            misuse_.push_back(absl::StrFormat(
                "%s touches %p (%d bytes), which is not allocated when it "
                "runs (a use after a stream-ordered free?)",
                op.what, t.ptr, t.bytes));
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

bool FakeCudaRuntime::IsLiveDevice(const void* ptr, size_t bytes) const {
  char* p = static_cast<char*>(const_cast<void*>(ptr));
  auto it = blocks_.upper_bound(p);
  if (it == blocks_.begin()) return false;
  --it;
  return it->second.live && p + bytes <= it->first + it->second.bytes;
}

bool FakeCudaRuntime::IsDevicePointer(const void* ptr) const {
  char* p = static_cast<char*>(const_cast<void*>(ptr));
  auto it = blocks_.upper_bound(p);
  if (it == blocks_.begin()) return false;
  --it;
  return p < it->first + std::max<size_t>(it->second.bytes, 1);
}

bool FakeCudaRuntime::IsPinned(const void* ptr) const {
  char* p = static_cast<char*>(const_cast<void*>(ptr));
  auto it = pinned_.upper_bound(p);
  if (it == pinned_.begin()) return false;
  --it;
  return p < it->first + std::max<size_t>(it->second, 1);
}

void FakeCudaRuntime::DrainStream(StreamState* s) {
  const uint64_t target = s->enqueued;
  auto done = [s, target]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return s->completed >= target;
  };
  mu_.Await(absl::Condition(&done));
}

void FakeCudaRuntime::DrainDevice(int device) {
  std::vector<StreamState*> streams;
  for (const auto& s : streams_) {
    if (!s->stop && (device < 0 || s->device == device)) {
      streams.push_back(s.get());
    }
  }
  for (StreamState* s : streams) DrainStream(s);
}

void FakeCudaRuntime::ReleaseIdleBlocks() {
  for (auto it = blocks_.begin(); it != blocks_.end();) {
    PoolState& pool = *pools_[it->second.device];
    if (it->second.pooled && !it->second.live && pool.release_threshold == 0) {
      pool.reserved -= it->second.bytes;
      ::operator delete (it->first, std::align_val_t{256});
      it = blocks_.erase(it);
    } else {
      ++it;
    }
  }
}

cudaError_t FakeCudaRuntime::Launch(absl::string_view what, cudaStream_t stream,
                                    std::vector<Touch> touches,
                                    std::function<void()> run) {
  cudaError_t launch = cudaSuccess;
  {
    absl::MutexLock lock(&mu_);
    launch = Precheck(what);
    if (launch == cudaSuccess) {
      StreamState* s = FindStream(stream);
      if (s == nullptr) {
        launch = cudaErrorInvalidResourceHandle;
      } else {
        Op op;
        op.what = std::string(what);
        op.run = std::move(run);
        op.touches = std::move(touches);
        Enqueue(s, std::move(op));
      }
    }
  }
  Result(launch);
  // A launch reports what cudaGetLastError() says after it.
  return GetLastError();
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

int FakeCudaRuntime::DeviceOf(const void* ptr, bool* pinned) const {
  absl::MutexLock lock(&mu_);
  if (pinned != nullptr) *pinned = IsPinned(ptr);
  char* p = static_cast<char*>(const_cast<void*>(ptr));
  auto it = blocks_.upper_bound(p);
  if (it == blocks_.begin()) return -1;
  --it;
  if (!it->second.live || p >= it->first + it->second.bytes) return -1;
  return it->second.device;
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

// ---- Errors ----

cudaError_t FakeCudaRuntime::GetLastError() {
  ThreadState& t = Thread(id_);
  cudaError_t e = t.last_error;
  t.last_error = cudaSuccess;
  absl::MutexLock lock(&mu_);
  return sticky_ != cudaSuccess ? sticky_ : e;
}

cudaError_t FakeCudaRuntime::PeekAtLastError() {
  const cudaError_t e = Thread(id_).last_error;
  absl::MutexLock lock(&mu_);
  return sticky_ != cudaSuccess ? sticky_ : e;
}

const char* FakeCudaRuntime::GetErrorName(cudaError_t error) {
  return cudaGetErrorName(error);
}

const char* FakeCudaRuntime::GetErrorString(cudaError_t error) {
  return cudaGetErrorString(error);
}

// ---- Devices ----

cudaError_t FakeCudaRuntime::GetDeviceCount(int* count) {
  absl::MutexLock lock(&mu_);
  cudaError_t e = Precheck("cudaGetDeviceCount");
  if (e == cudaSuccess && options_.device_count == 0) e = cudaErrorNoDevice;
  if (e == cudaSuccess) *count = options_.device_count;
  return Result(e);
}

cudaError_t FakeCudaRuntime::GetDevice(int* device) {
  absl::MutexLock lock(&mu_);
  const cudaError_t e = Precheck("cudaGetDevice");
  if (e == cudaSuccess) *device = CurrentDevice();
  return Result(e);
}

cudaError_t FakeCudaRuntime::SetDevice(int device) {
  absl::MutexLock lock(&mu_);
  cudaError_t e = Precheck("cudaSetDevice");
  if (e == cudaSuccess && (device < 0 || device >= options_.device_count)) {
    e = cudaErrorInvalidDevice;
  }
  if (e == cudaSuccess) Thread(id_).device = device;
  return Result(e);
}

cudaError_t FakeCudaRuntime::DeviceGetAttribute(int* value, cudaDeviceAttr attr,
                                                int device) {
  absl::MutexLock lock(&mu_);
  cudaError_t e = Precheck("cudaDeviceGetAttribute");
  if (e == cudaSuccess && (device < 0 || device >= options_.device_count)) {
    e = cudaErrorInvalidDevice;
  }
  if (e == cudaSuccess) {
    *value = attr == cudaDevAttrMemoryPoolsSupported && options_.memory_pools;
  }
  return Result(e);
}

cudaError_t FakeCudaRuntime::DeviceGetDefaultMemPool(cudaMemPool_t* pool,
                                                     int device) {
  absl::MutexLock lock(&mu_);
  cudaError_t e = Precheck("cudaDeviceGetDefaultMemPool");
  if (e == cudaSuccess && (device < 0 || device >= options_.device_count)) {
    e = cudaErrorInvalidDevice;
  }
  if (e == cudaSuccess && !options_.memory_pools) e = cudaErrorNotSupported;
  if (e == cudaSuccess) {
    *pool = reinterpret_cast<cudaMemPool_t>(pools_[device].get());
  }
  return Result(e);
}

cudaError_t FakeCudaRuntime::MemPoolSetAttribute(cudaMemPool_t pool,
                                                 cudaMemPoolAttr attr,
                                                 void* value) {
  absl::MutexLock lock(&mu_);
  cudaError_t e = Precheck("cudaMemPoolSetAttribute");
  if (e == cudaSuccess) {
    auto* p = reinterpret_cast<PoolState*>(pool);
    if (attr == cudaMemPoolAttrReleaseThreshold) {
      p->release_threshold = *static_cast<uint64_t*>(value);
    } else if (attr == cudaMemPoolAttrReservedMemHigh) {
      p->reserved_high = p->reserved;
    } else {
      e = cudaErrorInvalidValue;
    }
  }
  return Result(e);
}

cudaError_t FakeCudaRuntime::MemPoolGetAttribute(cudaMemPool_t pool,
                                                 cudaMemPoolAttr attr,
                                                 void* value) {
  absl::MutexLock lock(&mu_);
  cudaError_t e = Precheck("cudaMemPoolGetAttribute");
  if (e == cudaSuccess) {
    auto* p = reinterpret_cast<PoolState*>(pool);
    uint64_t* out = static_cast<uint64_t*>(value);
    if (attr == cudaMemPoolAttrReleaseThreshold) {
      *out = p->release_threshold;
    } else if (attr == cudaMemPoolAttrReservedMemCurrent) {
      *out = p->reserved;
    } else if (attr == cudaMemPoolAttrReservedMemHigh) {
      *out = p->reserved_high;
    } else {
      e = cudaErrorInvalidValue;
    }
  }
  return Result(e);
}

// ---- Streams and events ----

cudaError_t FakeCudaRuntime::StreamCreateWithFlags(cudaStream_t* stream,
                                                   unsigned int flags) {
  absl::MutexLock lock(&mu_);
  const cudaError_t e = Precheck("cudaStreamCreateWithFlags");
  if (e != cudaSuccess) return Result(e);
  auto state = std::make_unique<StreamState>();
  state->device = CurrentDevice();
  state->rng.seed(options_.seed + 7919 * streams_.size());
  StreamState* s = state.get();
  streams_.push_back(std::move(state));
  s->worker = std::thread([this, s] { WorkerLoop(s); });
  *stream = reinterpret_cast<cudaStream_t>(s);
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
    auto done = [s, seq]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return s->completed >= seq;
    };
    mu_.Await(absl::Condition(&done));
    e = sticky_;
  }
  return Result(e);
}

// ---- Memory ----

cudaError_t FakeCudaRuntime::Malloc(void** ptr, size_t bytes) {
  absl::MutexLock lock(&mu_);
  const cudaError_t e = Precheck("cudaMalloc");
  if (e != cudaSuccess) return Result(e);
  char* p = static_cast<char*>(
      ::operator new (std::max<size_t>(bytes, 1), std::align_val_t{256}));
  std::memset(p, 0xA5, bytes);  // uninitialised, recognisably
  blocks_[p] = Block{bytes, CurrentDevice(), true, false};
  ++device_mallocs_;
  *ptr = p;
  return cudaSuccess;
}

cudaError_t FakeCudaRuntime::Free(void* ptr) {
  absl::MutexLock lock(&mu_);
  cudaError_t e = Precheck("cudaFree");
  if (ptr == nullptr) return Result(e);
  auto it = blocks_.find(static_cast<char*>(ptr));
  if (e == cudaSuccess && (it == blocks_.end() || !it->second.live)) {
    misuse_.push_back(absl::StrFormat("cudaFree(%p): not an allocation", ptr));
    e = cudaErrorInvalidValue;
  }
  if (e != cudaSuccess) return Result(e);
  DrainDevice(-1);  // cudaFree synchronizes the device
  if (it->second.pooled) {
    pools_[it->second.device]->reserved -= it->second.bytes;
  }
  ::operator delete (it->first, std::align_val_t{256});
  blocks_.erase(it);
  return cudaSuccess;
}

cudaError_t FakeCudaRuntime::MallocAsync(void** ptr, size_t bytes,
                                         cudaStream_t stream) {
  absl::MutexLock lock(&mu_);
  cudaError_t e = Precheck("cudaMallocAsync");
  StreamState* s = e == cudaSuccess ? FindStream(stream) : nullptr;
  if (e == cudaSuccess && s == nullptr) e = cudaErrorInvalidResourceHandle;
  if (e != cudaSuccess) return Result(e);
  // Reuse a block whose free has completed (a stream-ordered free makes it
  // free only when its stream gets there).
  for (auto& [p, b] : blocks_) {
    if (b.pooled && !b.live && b.device == s->device && b.bytes == bytes) {
      b.live = true;
      *ptr = p;
      return cudaSuccess;
    }
  }
  char* p = static_cast<char*>(
      ::operator new (std::max<size_t>(bytes, 1), std::align_val_t{256}));
  std::memset(p, 0xA5, bytes);
  blocks_[p] = Block{bytes, s->device, true, true};
  PoolState& pool = *pools_[s->device];
  pool.reserved += bytes;
  pool.reserved_high = std::max(pool.reserved_high, pool.reserved);
  ++device_mallocs_;
  *ptr = p;
  return cudaSuccess;
}

cudaError_t FakeCudaRuntime::FreeAsync(void* ptr, cudaStream_t stream) {
  absl::MutexLock lock(&mu_);
  cudaError_t e = Precheck("cudaFreeAsync");
  StreamState* s = e == cudaSuccess ? FindStream(stream) : nullptr;
  auto it = blocks_.find(static_cast<char*>(ptr));
  if (e == cudaSuccess &&
      (s == nullptr || it == blocks_.end() || !it->second.live)) {
    misuse_.push_back(
        absl::StrFormat("cudaFreeAsync(%p): not a live allocation", ptr));
    e = cudaErrorInvalidValue;
  }
  if (e != cudaSuccess) return Result(e);
  char* p = it->first;
  Op op;
  op.what = "cudaFreeAsync";
  op.touches = {{p, it->second.bytes}};
  op.run = [this, p] {
    absl::MutexLock lock(&mu_);
    auto b = blocks_.find(p);
    std::memset(p, 0xFF, b->second.bytes);
    b->second.live = false;
  };
  Enqueue(s, std::move(op));
  return cudaSuccess;
}

cudaError_t FakeCudaRuntime::MallocHost(void** ptr, size_t bytes) {
  absl::MutexLock lock(&mu_);
  const cudaError_t e = Precheck("cudaMallocHost");
  if (e != cudaSuccess) return Result(e);
  char* p = static_cast<char*>(
      ::operator new (std::max<size_t>(bytes, 1), std::align_val_t{256}));
  pinned_[p] = bytes;
  *ptr = p;
  return cudaSuccess;
}

cudaError_t FakeCudaRuntime::FreeHost(void* ptr) {
  absl::MutexLock lock(&mu_);
  cudaError_t e = Precheck("cudaFreeHost");
  auto it = pinned_.find(static_cast<char*>(ptr));
  if (e == cudaSuccess && it == pinned_.end()) {
    misuse_.push_back(absl::StrFormat("cudaFreeHost(%p): not pinned", ptr));
    e = cudaErrorInvalidValue;
  }
  if (e != cudaSuccess) return Result(e);
  DrainDevice(-1);  // cudaFreeHost synchronizes the device
  ::operator delete (it->first, std::align_val_t{256});
  pinned_.erase(it);
  return cudaSuccess;
}

cudaError_t FakeCudaRuntime::MemcpyAsync(void* dst, const void* src,
                                         size_t bytes, cudaMemcpyKind kind,
                                         cudaStream_t stream) {
  absl::MutexLock lock(&mu_);
  cudaError_t e = Precheck("cudaMemcpyAsync");
  StreamState* s = e == cudaSuccess ? FindStream(stream) : nullptr;
  if (e == cudaSuccess && s == nullptr) e = cudaErrorInvalidResourceHandle;
  if (e != cudaSuccess) return Result(e);
  if (bytes == 0) return cudaSuccess;
  const bool dst_dev = IsDevicePointer(dst);
  const bool src_dev = IsDevicePointer(src);
  if ((dst_dev && !IsLiveDevice(dst, bytes)) ||
      (src_dev && !IsLiveDevice(src, bytes))) {
    return Result(cudaErrorInvalidValue);
  }
  Op op;
  op.what = absl::StrFormat("cudaMemcpyAsync(%d bytes)", bytes);
  if (dst_dev) op.touches.push_back({dst, bytes});
  if (src_dev) op.touches.push_back({src, bytes});
  const bool pageable_src = !src_dev && !IsPinned(src);
  const bool pageable_dst = !dst_dev && !IsPinned(dst);
  if (pageable_src && dst_dev) {
    // From pageable memory: the stream drains, the source is staged, and
    // the call returns; the caller may reuse the source at once.
    DrainStream(s);
    auto staged = std::make_shared<std::vector<char>>(
        static_cast<const char*>(src), static_cast<const char*>(src) + bytes);
    op.run = [dst, staged] {
      std::memcpy(dst, staged->data(), staged->size());
    };
    Enqueue(s, std::move(op));
    return cudaSuccess;
  }
  op.run = [dst, src, bytes] { std::memcpy(dst, src, bytes); };
  Enqueue(s, std::move(op));
  if (pageable_dst && src_dev) {
    DrainStream(s);  // to pageable memory: returns once copied
    if (sticky_ != cudaSuccess) return Result(sticky_);
  }
  return cudaSuccess;
}

cudaError_t FakeCudaRuntime::MemsetAsync(void* dst, int value, size_t bytes,
                                         cudaStream_t stream) {
  absl::MutexLock lock(&mu_);
  cudaError_t e = Precheck("cudaMemsetAsync");
  StreamState* s = e == cudaSuccess ? FindStream(stream) : nullptr;
  if (e == cudaSuccess && s == nullptr) e = cudaErrorInvalidResourceHandle;
  if (e == cudaSuccess && bytes > 0 && !IsLiveDevice(dst, bytes)) {
    e = cudaErrorInvalidValue;
  }
  if (e != cudaSuccess) return Result(e);
  Op op;
  op.what = absl::StrFormat("cudaMemsetAsync(%d bytes)", bytes);
  op.touches = {{dst, bytes}};
  op.run = [dst, value, bytes] { std::memset(dst, value, bytes); };
  Enqueue(s, std::move(op));
  return cudaSuccess;
}

// ---- Kernels: cuda_kernels.cu's arithmetic as host loops ----

cudaError_t FakeCudaRuntime::LaunchFill(void* dst, int element_bytes,
                                        uint64_t pattern, int64_t count,
                                        cudaStream_t stream) {
  if (element_bytes != 2 && element_bytes != 4 && element_bytes != 8) {
    Result(cudaErrorInvalidValue);
    return GetLastError();
  }
  const size_t bytes = static_cast<size_t>(count) * element_bytes;
  return Launch("fill kernel", stream, {{dst, bytes}},
                [dst, element_bytes, pattern, count] {
                  char* p = static_cast<char*>(dst);
                  for (int64_t i = 0; i < count; ++i) {
                    std::memcpy(p + i * element_bytes, &pattern,
                                static_cast<size_t>(element_bytes));
                  }
                });
}

cudaError_t FakeCudaRuntime::LaunchCast(void* dst, KernelDType dst_dtype,
                                        const void* src, KernelDType src_dtype,
                                        int64_t count, cudaStream_t stream) {
  if (!ValidKernelDType(dst_dtype) || !ValidKernelDType(src_dtype)) {
    Result(cudaErrorInvalidValue);
    return GetLastError();
  }
  const DType d = ToDType(dst_dtype);
  const DType s = ToDType(src_dtype);
  return Launch("cast kernel", stream,
                {{dst, count * DTypeSize(d)}, {src, count * DTypeSize(s)}},
                [dst, d, src, s, count] {
                  for (int64_t i = 0; i < count; ++i) {
                    double v = LoadAsDouble(src, s, static_cast<size_t>(i));
                    // float64 reaches the 16-bit types through float32 (c10).
                    if (s == DType::kFloat64 && d != DType::kFloat32) {
                      v = static_cast<double>(static_cast<float>(v));
                    }
                    StoreFromDouble(dst, d, static_cast<size_t>(i), v);
                  }
                });
}

cudaError_t FakeCudaRuntime::LaunchMultiply(void* buf, KernelDType dtype,
                                            double scalar, int64_t count,
                                            cudaStream_t stream) {
  if (!ValidKernelDType(dtype)) {
    Result(cudaErrorInvalidValue);
    return GetLastError();
  }
  const DType d = ToDType(dtype);
  const double k = Compute(d, scalar);
  return Launch("multiply kernel", stream, {{buf, count * DTypeSize(d)}},
                [buf, d, k, count] {
                  for (int64_t i = 0; i < count; ++i) {
                    const size_t j = static_cast<size_t>(i);
                    const double v = LoadAsDouble(buf, d, j);
                    StoreFromDouble(
                        buf, d, j,
                        d == DType::kFloat64
                            ? v * k
                            : static_cast<double>(static_cast<float>(v) *
                                                  static_cast<float>(k)));
                  }
                });
}

cudaError_t FakeCudaRuntime::LaunchAdd(void* acc, const void* x,
                                       KernelDType dtype, int64_t count,
                                       cudaStream_t stream) {
  if (!ValidKernelDType(dtype)) {
    Result(cudaErrorInvalidValue);
    return GetLastError();
  }
  const DType d = ToDType(dtype);
  const size_t bytes = count * DTypeSize(d);
  return Launch(
      "add kernel", stream, {{acc, bytes}, {x, bytes}}, [acc, x, d, count] {
        for (int64_t i = 0; i < count; ++i) {
          const size_t j = static_cast<size_t>(i);
          const double a = LoadAsDouble(acc, d, j);
          const double b = LoadAsDouble(x, d, j);
          StoreFromDouble(acc, d, j,
                          d == DType::kFloat64
                              ? a + b
                              : static_cast<double>(static_cast<float>(a) +
                                                    static_cast<float>(b)));
        }
      });
}

}  // namespace flatparam
