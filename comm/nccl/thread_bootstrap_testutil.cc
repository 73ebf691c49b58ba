#include "comm/nccl/thread_bootstrap_testutil.h"

#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"

namespace flatparam {
namespace {

// The meeting point of one group: a generation-counted all-gather.
class Meeting {
 public:
  explicit Meeting(int size) : size_(size), slots_(size) {}

  absl::StatusOr<std::vector<std::string>> AllGather(int rank,
                                                     std::string bytes,
                                                     absl::Duration timeout) {
    absl::MutexLock lock(&mu_);
    const int64_t generation = generation_;
    slots_[rank] = std::move(bytes);
    if (++arrived_ == size_) {
      result_ = slots_;
      arrived_ = 0;
      ++generation_;
      return result_;
    }
    auto done = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
      return generation_ != generation;
    };
    if (!mu_.AwaitWithTimeout(absl::Condition(&done), timeout)) {
      return absl::DeadlineExceededError(absl::StrFormat(
          "rank %d: thread bootstrap all_gather_bytes: only %d of %d ranks "
          "arrived within %s",
          rank, arrived_, size_, absl::FormatDuration(timeout)));
    }
    return result_;
  }

 private:
  const int size_;
  absl::Mutex mu_;
  int64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  int arrived_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<std::string> slots_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> result_ ABSL_GUARDED_BY(mu_);
};

class ThreadCommunicator final : public Communicator {
 public:
  ThreadCommunicator(std::shared_ptr<Meeting> meeting, int rank, int size)
      : meeting_(std::move(meeting)), rank_(rank), size_(size) {}

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  absl::string_view backend() const override { return "threads"; }

  std::unique_ptr<Work> AllGather(ConstBufferRef, BufferRef,
                                  const CollectiveOptions&) override {
    return CompletedWork(Unsupported("all_gather"));
  }
  std::unique_ptr<Work> ReduceScatter(ConstBufferRef, BufferRef,
                                      const ReduceOptions&) override {
    return CompletedWork(Unsupported("reduce_scatter"));
  }
  std::unique_ptr<Work> AllReduce(ConstBufferRef, BufferRef,
                                  const ReduceOptions&) override {
    return CompletedWork(Unsupported("all_reduce"));
  }
  std::unique_ptr<Work> Broadcast(BufferRef, const BroadcastOptions&) override {
    return CompletedWork(Unsupported("broadcast"));
  }
  absl::StatusOr<std::vector<std::string>> AllGatherBytes(
      absl::string_view bytes, const CollectiveOptions& options) override {
    return meeting_->AllGather(rank_, std::string(bytes), options.timeout);
  }
  absl::Status Barrier(const CollectiveOptions& options) override {
    return meeting_->AllGather(rank_, "", options.timeout).status();
  }
  absl::StatusOr<std::unique_ptr<Communicator>> Split(
      int, int, const CollectiveOptions&) override {
    return Unsupported("split");
  }

 private:
  absl::Status Unsupported(absl::string_view op) const {
    return absl::UnimplementedError(absl::StrFormat(
        "rank %d: the thread bootstrap group has no %s", rank_, op));
  }

  std::shared_ptr<Meeting> meeting_;
  const int rank_;
  const int size_;
};

}  // namespace

std::vector<std::unique_ptr<Communicator>> MakeThreadGroup(int size) {
  auto meeting = std::make_shared<Meeting>(size);
  std::vector<std::unique_ptr<Communicator>> group;
  for (int r = 0; r < size; ++r) {
    group.push_back(std::make_unique<ThreadCommunicator>(meeting, r, size));
  }
  return group;
}

}  // namespace flatparam
