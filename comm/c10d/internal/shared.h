// What a C10dCommunicator and its work objects share, and the helpers of
// //comm/c10d's files (private to //comm/c10d).
#ifndef FLATPARAM_COMM_C10D_INTERNAL_SHARED_H_
#define FLATPARAM_COMM_C10D_INTERNAL_SHARED_H_

#include <torch/version.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "comm/c10d/c10d_communicator.h"
#include "comm/communicator.h"
#include "comm/flight_recorder.h"

namespace flatparam {

// A duration as c10d takes it: whole milliseconds, at least one.
inline std::chrono::milliseconds Millis(absl::Duration d) {
  return std::chrono::milliseconds(
      std::max<int64_t>(1, absl::ToInt64Milliseconds(d)));
}

// The message of a caught exception; c10::Error's without LibTorch's
// backtrace.
inline std::string ExceptionMessage(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const c10::Error& error) {
    return error.what_without_backtrace();
  } catch (const std::exception& error) {
    return error.what();
  } catch (...) {
    return "an exception that is not a std::exception";
  }
}

// A gloo process group of `size` ranks over `store`. In LibTorch 1.13
// ProcessGroupGloo is a ProcessGroup; from 2.0 it is a c10d::Backend, and
// the ProcessGroup that holds it dispatches the collectives of CPU tensors
// to it (as torch.distributed.new_group(backend="gloo") builds it).
inline c10::intrusive_ptr<c10d::ProcessGroup> MakeGlooGroup(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
    c10::intrusive_ptr<c10d::ProcessGroupGloo::Options> options) {
  auto gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size,
                                                          std::move(options));
#if TORCH_VERSION_MAJOR >= 2
  auto group = c10::make_intrusive<c10d::ProcessGroup>(store, rank, size);
  group->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::GLOO,
                    gloo);
  group->setDefaultBackend(c10d::ProcessGroup::BackendType::GLOO);
  return group;
#else
  return gloo;
#endif
}

// The group's all-to-all of one tensor (c10d's alltoall_base_ op):
// all_to_all_single where the LibTorch has it (2.14 deprecates
// alltoall_base for it), alltoall_base where not (1.13 to 2.6 at least).
template <typename Group>
auto AllToAllSingle(Group& group, at::Tensor& out, at::Tensor& in,
                    std::vector<int64_t>& out_splits,
                    std::vector<int64_t>& in_splits,
                    const c10d::AllToAllOptions& options, int)
    -> decltype(group.all_to_all_single(out, in, out_splits, in_splits,
                                        options)) {
  return group.all_to_all_single(out, in, out_splits, in_splits, options);
}
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
template <typename Group>
auto AllToAllSingle(Group& group, at::Tensor& out, at::Tensor& in,
                    std::vector<int64_t>& out_splits,
                    std::vector<int64_t>& in_splits,
                    const c10d::AllToAllOptions& options, long)
    -> decltype(group.alltoall_base(out, in, out_splits, in_splits, options)) {
  return group.alltoall_base(out, in, out_splits, in_splits, options);
}
#pragma GCC diagnostic pop

// What the communicator and its work objects share: the group, its
// store, and whether it was aborted. Guarded by `mu` where noted.
struct C10dCommunicator::Shared {
  int rank = 0;
  int size = 0;
  // The store the group was made from; Split makes subgroups from it.
  c10::intrusive_ptr<c10d::Store> store;
  // The store the diagnosis of a failure asks (the same, or a connection
  // of its own with a short timeout; see FromEnvironment).
  c10::intrusive_ptr<c10d::Store> probe_store;
  // Keys of this group in the stores start with it.
  std::string prefix;
  C10dOptions options;
  // The gloo device subgroups are made on (made on first use).
  std::shared_ptr<::gloo::transport::Device> device;
  int64_t next_seq = 0;
  // The rank's flight recorder (shared with the groups split from the
  // world) and this group's name in it; null when recording is off.
  std::shared_ptr<FlightRecorder> recorder;
  std::shared_ptr<const FlightGroup> group;
  // Records a collective as enqueued (0 when recording is off).
  uint64_t Record(CollectiveOp op, int64_t seq, DType dtype, int64_t count,
                  int64_t bytes);

  std::mutex mu;
  absl::Status aborted;  // guarded by mu

  // Staging tensors of completed collectives, by size, for reuse
  // (allocating and first touching large buffers on every collective cost
  // more than the copies themselves). At most
  // options.staging_cache_bytes in all. Guarded by mu.
  std::multimap<int64_t, at::Tensor> cache;
  int64_t cached_bytes = 0;

  // A byte tensor of `bytes`, from the cache or new, recorded in
  // `*staging`.
  at::Tensor Acquire(std::vector<at::Tensor>* staging, int64_t bytes);
  // Puts the tensors of `*staging` that nothing else refers to back in the
  // cache (as room allows) and clears it.
  void Recycle(std::vector<at::Tensor>* staging);

  // Set once a store operation failed: the store's host is gone, and the
  // store is not asked again (each try would wait its timeout).
  bool store_unreachable = false;

  // The status a failed collective reports, after asking the store which
  // peers reached it. Aborts the group, and tells the other ranks so
  // through the store (unless the failure is that abort itself).
  absl::Status Fail(CollectiveOp op, int64_t seq, absl::Status status);
  // "; rank R did not reach OP #SEQ ..." or why that is not known.
  std::string Diagnose(CollectiveOp op, int64_t seq);
  // The key whose value is the last collective rank `r` said it reached.
  std::string ReachedKey(int r) const;
  // Posts that this rank reached `seq` (a store write).
  void PostReached(int64_t seq);
  // Aborted quoting the first failure when another rank aborted the
  // group; OK otherwise (also when the store cannot be reached).
  absl::Status AbortedByPeer();
};

}  // namespace flatparam

#endif  // FLATPARAM_COMM_C10D_INTERNAL_SHARED_H_
