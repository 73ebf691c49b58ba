#include "flatparam/device/cuda/fake_cuda_runtime.h"

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <new>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "flatparam/device/cuda/fake_cuda_runtime_internal.h"

// FakeCudaRuntime's construction and destruction, test controls and
// counters, its error model (per-thread last errors, injected and sticky
// errors) and devices. fake_cuda_runtime_internal.h lists the other files.

namespace flatparam {
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
  for (auto& [p, segment] : segments_) UnmapSegment(p, segment);
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
  return static_cast<int64_t>(allocations_.size());
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

}  // namespace flatparam
