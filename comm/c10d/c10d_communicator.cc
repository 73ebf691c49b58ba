#include "comm/c10d/c10d_communicator.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "comm/c10d/internal/shared.h"
#include "comm/host_reduce.h"
#include "flatparam/base/dtype.h"

namespace flatparam {

namespace {

// A failure of c10d as a status: timeouts (ours, or gloo's own deadline)
// are DeadlineExceeded; a peer that went away is Aborted.
absl::Status FromC10d(const std::string& message, const std::string& what) {
  const std::string text = absl::StrCat(what, ": ", message);
  if (absl::StrContains(message, "timed out") ||
      absl::StrContains(message, "Timed out") ||
      absl::StrContains(message, "Timeout") ||
      absl::StrContains(message, "timeout")) {
    return absl::DeadlineExceededError(text);
  }
  if (absl::StrContains(message, "closed by peer") ||
      absl::StrContains(message, "Connection reset") ||
      absl::StrContains(message, "Broken pipe") ||
      absl::StrContains(message, "Connection refused")) {
    return absl::AbortedError(text);
  }
  return absl::InternalError(text);
}

at::Tensor NewBytes(int64_t bytes) {
  return at::empty({bytes}, at::TensorOptions().dtype(at::kByte));
}

absl::Status CheckHost(int rank, CollectiveOp op, int64_t seq,
                       const Device& device) {
  if (device.type == DeviceType::kHost) return absl::OkStatus();
  return absl::UnimplementedError(absl::StrCat(
      "c10d rank ", rank, ": ", CollectiveOpName(op), " #", seq, " on ",
      DeviceName(device),
      ": the c10d backend takes host buffers only (use the NCCL backend for "
      "CUDA buffers)"));
}

}  // namespace

at::Tensor C10dCommunicator::Shared::Acquire(std::vector<at::Tensor>* staging,
                                             int64_t bytes) {
  at::Tensor t;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = cache.find(bytes);
    if (it != cache.end()) {
      t = std::move(it->second);
      cache.erase(it);
      cached_bytes -= bytes;
    }
  }
  if (!t.defined()) t = NewBytes(bytes);
  staging->push_back(t);
  return t;
}

void C10dCommunicator::Shared::Recycle(std::vector<at::Tensor>* staging) {
  std::lock_guard<std::mutex> lock(mu);
  for (at::Tensor& t : *staging) {
    const int64_t bytes = t.numel();
    // use_count 1: only `staging` holds it (c10d let go of it).
    if (bytes == 0 || t.use_count() != 1 ||
        cached_bytes + bytes > options.staging_cache_bytes) {
      continue;
    }
    cached_bytes += bytes;
    cache.emplace(bytes, std::move(t));
  }
  staging->clear();
}

std::string C10dCommunicator::Shared::ReachedKey(int r) const {
  return absl::StrCat(prefix, "at/", r);
}

void C10dCommunicator::Shared::PostReached(int64_t seq) {
  if (store_unreachable) return;
  // One key per rank, overwritten: the store holds one entry per rank
  // however many collectives a long run waits for.
  const std::string value = absl::StrCat(seq);
  try {
    probe_store->set(ReachedKey(rank),
                     std::vector<uint8_t>(value.begin(), value.end()));
  } catch (...) {
    store_unreachable = true;
  }
}

absl::Status C10dCommunicator::Shared::AbortedByPeer() {
  if (store_unreachable) return absl::OkStatus();
  try {
    const std::string key = absl::StrCat(prefix, "abort");
    if (!probe_store->check({key})) return absl::OkStatus();
    const std::vector<uint8_t> why = probe_store->get(key);
    return absl::AbortedError(
        absl::StrCat("the group was aborted by another rank: ",
                     std::string(why.begin(), why.end())));
  } catch (...) {
    store_unreachable = true;
    return absl::OkStatus();
  }
}

std::string C10dCommunicator::Shared::Diagnose(CollectiveOp op, int64_t seq) {
  // Every rank that waited past the first slice, or whose collective
  // failed, has posted that it got this far; a rank that has not within
  // the grace is stopped, dead, or behind.
  const std::string what = absl::StrCat(CollectiveOpName(op), " #", seq);
  const std::string no_store =
      "; the store did not answer: the rank hosting it may be stopped or "
      "dead";
  PostReached(seq);
  if (store_unreachable) return no_store;
  std::vector<int> missing;
  for (int r = 0; r < size; ++r) {
    if (r != rank) missing.push_back(r);
  }
  const absl::Time deadline = absl::Now() + options.diagnosis_grace;
  while (!missing.empty()) {
    std::vector<int> still;
    for (int r : missing) {
      bool there = false;
      try {
        const std::string key = ReachedKey(r);
        if (probe_store->check({key})) {
          const std::vector<uint8_t> value = probe_store->get(key);
          int64_t reached = -1;
          there = absl::SimpleAtoi(std::string(value.begin(), value.end()),
                                   &reached) &&
                  reached >= seq;
        }
      } catch (...) {
        store_unreachable = true;
        return no_store;
      }
      if (!there) still.push_back(r);
    }
    missing = std::move(still);
    if (missing.empty() || absl::Now() >= deadline) break;
    absl::SleepFor(absl::Milliseconds(20));
  }
  if (missing.empty()) {
    return absl::StrCat("; every rank of the group reached ", what);
  }
  return absl::StrCat("; rank", missing.size() > 1 ? "s " : " ",
                      absl::StrJoin(missing, ", "), " did not reach ", what,
                      " (stopped, dead or behind: it sent nothing)");
}

absl::Status C10dCommunicator::Shared::Fail(CollectiveOp op, int64_t seq,
                                            absl::Status status) {
  {
    std::lock_guard<std::mutex> lock(mu);
    if (!aborted.ok()) return status;  // another work failed first
  }
  // A failure another rank reported quotes that rank's diagnosis already.
  const bool from_peer =
      absl::StrContains(status.message(), "aborted by another rank");
  std::string diagnosis;
  if (!from_peer &&
      (absl::IsDeadlineExceeded(status) || absl::IsAborted(status))) {
    diagnosis = Diagnose(op, seq);
  }
  absl::Status failed(status.code(), absl::StrCat(status.message(), diagnosis));
  // The other ranks stop waiting for this group (see WaitStep), unless
  // this failure is that abort itself.
  if (!store_unreachable && !from_peer) {
    try {
      const std::string why(failed.message());
      probe_store->set(absl::StrCat(prefix, "abort"),
                       std::vector<uint8_t>(why.begin(), why.end()));
    } catch (...) {
      store_unreachable = true;
    }
  }
  std::lock_guard<std::mutex> lock(mu);
  if (aborted.ok()) aborted = failed;
  return failed;
}

namespace {

inline constexpr absl::Duration kC10dFirstSlice = absl::Milliseconds(500);
inline constexpr absl::Duration kC10dSlice = absl::Milliseconds(200);

// One collective: c10d works run in sequence (`steps`), each issued after
// the previous one's completion, then `finish` copies the result out.
class C10dWork final : public Work {
 public:
  using Step = std::function<c10::intrusive_ptr<c10d::Work>(absl::Duration)>;

  C10dWork(std::shared_ptr<C10dCommunicator::Shared> shared, CollectiveOp op,
           int64_t seq, uint64_t flight_id, std::string what,
           absl::Duration timeout, std::vector<Step> steps,
           std::function<void(int step)> after_step,
           std::vector<at::Tensor> staging = {})
      : staging_(std::move(staging)),
        shared_(std::move(shared)),
        op_(op),
        seq_(seq),
        flight_id_(flight_id),
        what_(std::move(what)),
        timeout_(timeout),
        deadline_(absl::Now() + timeout),
        steps_(std::move(steps)),
        after_step_(std::move(after_step)) {
    Issue();
    if (shared_->recorder != nullptr && status_.ok()) {
      shared_->recorder->Started(flight_id_);
    }
  }

  absl::Status Wait() override {
    while (status_.ok() && current_ < steps_.size()) {
      status_ = WaitStep();
      if (!status_.ok()) break;
      after_step_(static_cast<int>(current_));
      ++current_;
      if (current_ < steps_.size()) Issue();
    }
    if (status_.ok() && !staging_.empty()) {
      // Done: nothing else refers to the staging tensors once the steps,
      // their results and c10d's work are gone.
      steps_.clear();
      after_step_ = nullptr;
      work_.reset();
      shared_->Recycle(&staging_);
    }
    if (!status_.ok() && !failed_) {
      failed_ = true;
      if (absl::IsDeadlineExceeded(status_) &&
          status_.message() == "timed out") {
        status_ = absl::DeadlineExceededError(absl::StrCat(
            what_, " timed out after ", absl::FormatDuration(timeout_)));
      } else {
        status_ =
            absl::Status(status_.code(),
                         absl::StrCat(what_, " failed: ", status_.message()));
      }
      status_ = shared_->Fail(op_, seq_, status_);
    }
    // Once: a later Wait returns the same status and finds it recorded.
    if (shared_->recorder != nullptr) {
      shared_->recorder->Finished(flight_id_, status_);
    }
    return status_;
  }

 private:
  // Waits for the current c10d work in slices: the first kC10dFirstSlice
  // long, then kC10dSlice each. A rank still waiting after the first posts
  // that it reached this collective, and between slices it looks for the
  // group's abort key, which the first rank whose collective failed sets:
  // so the diagnosis knows who got this far, and no rank waits out its
  // whole timeout for a group another rank has already found broken. A
  // collective that completes within the first slice costs no store
  // operation.
  absl::Status WaitStep() {
    bool first = true;
    while (true) {
      const absl::Duration left = deadline_ - absl::Now();
      if (left <= absl::ZeroDuration()) {
        return absl::DeadlineExceededError("timed out");
      }
      const absl::Duration slice =
          std::min(left, first ? kC10dFirstSlice : kC10dSlice);
      try {
        if (work_->wait(Millis(slice))) return absl::OkStatus();
      } catch (...) {
        const std::string message = ExceptionMessage(std::current_exception());
        // c10d's own wait gave up after `slice` (its wording); gloo's
        // deadline reads "Timed out waiting ..." and is an error.
        if (!absl::StrContains(message, "Operation timed out")) {
          return FromC10d(message, "c10d");
        }
      }
      if (first) shared_->PostReached(seq_);
      first = false;
      absl::Status aborted = shared_->AbortedByPeer();
      if (!aborted.ok()) return aborted;
    }
  }

  void Issue() {
    const absl::Duration left = deadline_ - absl::Now();
    if (left <= absl::ZeroDuration()) {
      status_ = absl::DeadlineExceededError("timed out");
      return;
    }
    try {
      work_ = steps_[current_](left);
    } catch (...) {
      status_ = FromC10d(ExceptionMessage(std::current_exception()), "c10d");
    }
  }

  // The staging tensors of this collective: back to the communicator's
  // cache once it completed and c10d holds none of them.
  std::vector<at::Tensor> staging_;
  std::shared_ptr<C10dCommunicator::Shared> shared_;
  CollectiveOp op_;
  int64_t seq_;
  uint64_t flight_id_;
  std::string what_;
  absl::Duration timeout_;
  absl::Time deadline_;
  std::vector<Step> steps_;
  std::function<void(int)> after_step_;
  size_t current_ = 0;
  c10::intrusive_ptr<c10d::Work> work_;
  absl::Status status_;
  bool failed_ = false;
};

}  // namespace

std::unique_ptr<Work> C10dCommunicator::Finished(absl::Status status,
                                                 uint64_t flight_id) {
  if (shared_->recorder != nullptr) {
    shared_->recorder->Finished(flight_id, status);
  }
  return CompletedWork(std::move(status));
}

namespace {

std::string Describe(int rank, CollectiveOp op, int64_t seq, int64_t count,
                     DType dtype) {
  return absl::StrCat("c10d rank ", rank, ": ", CollectiveOpName(op), " #", seq,
                      " (", count, " x ", DTypeName(dtype), ")");
}

}  // namespace

C10dCommunicator::C10dCommunicator(c10::intrusive_ptr<c10d::Store> store,
                                   c10::intrusive_ptr<c10d::ProcessGroup> group,
                                   std::string prefix,
                                   const C10dOptions& options)
    : rank_(group->getRank()),
      size_(group->getSize()),
      store_(store),
      group_(group),
      shared_(std::make_shared<Shared>()) {
  shared_->rank = rank_;
  shared_->size = size_;
  shared_->store = std::move(store);
  shared_->probe_store = shared_->store;
  shared_->prefix = std::move(prefix);
  shared_->options = options;
  // The world's recorder; Split gives its subgroups the parent's instead.
  if (options.flight_recorder.capacity > 0) {
    shared_->recorder =
        FlightRecorder::Create(rank_, size_, "c10d", options.flight_recorder);
    auto world = std::make_shared<FlightGroup>();
    world->id = "world";
    for (int r = 0; r < size_; ++r) world->ranks.push_back(r);
    shared_->group = std::move(world);
  }
}

FlightRecorder* C10dCommunicator::flight_recorder() const {
  return shared_->recorder.get();
}

uint64_t C10dCommunicator::Shared::Record(CollectiveOp op, int64_t seq,
                                          DType dtype, int64_t count,
                                          int64_t bytes) {
  if (recorder == nullptr) return 0;
  return recorder->Enqueue(group, seq, op, dtype, count, bytes);
}

C10dCommunicator::~C10dCommunicator() {
  // After a failure, c10d's worker threads may still be inside gloo
  // operations with queued ones behind them, and ~ProcessGroupGloo waits
  // for them all, one deadline after another. A failed group is given up
  // instead: this reference is let go of without destroying the group
  // (its threads end with the process), so teardown never waits on peers.
  std::lock_guard<std::mutex> lock(shared_->mu);
  if (!shared_->aborted.ok()) {
    c10::intrusive_ptr<c10d::ProcessGroup> given_up = group_;
    given_up.release();
  }
}

absl::StatusOr<std::unique_ptr<C10dCommunicator>> C10dCommunicator::Wrap(
    c10::intrusive_ptr<c10d::Store> store,
    c10::intrusive_ptr<c10d::ProcessGroup> group, const C10dOptions& options) {
  if (!store || !group) {
    return absl::InvalidArgumentError(
        "C10dCommunicator::Wrap needs the store and the process group made "
        "from it");
  }
  return absl::WrapUnique(new C10dCommunicator(
      std::move(store), std::move(group), "flatparam/", options));
}

absl::Status C10dCommunicator::CheckUsable(CollectiveOp op, int64_t seq) const {
  std::lock_guard<std::mutex> lock(shared_->mu);
  if (shared_->aborted.ok()) return absl::OkStatus();
  return absl::AbortedError(
      absl::StrCat("c10d rank ", rank_, ": ", CollectiveOpName(op), " #", seq,
                   ": the group was aborted: ", shared_->aborted.message()));
}

void C10dCommunicator::Abort(absl::Status reason) {
  std::lock_guard<std::mutex> lock(shared_->mu);
  if (shared_->aborted.ok()) {
    shared_->aborted =
        reason.ok() ? absl::AbortedError("aborted by the caller") : reason;
  }
}

std::unique_ptr<Work> C10dCommunicator::AllGather(
    ConstBufferRef input, BufferRef output, const CollectiveOptions& options) {
  const int64_t seq = shared_->next_seq++;
  const uint64_t id = shared_->Record(CollectiveOp::kAllGather, seq,
                                      input.dtype, input.count, input.bytes());
  absl::Status valid = ValidateAllGather(rank_, size_, seq, input, output);
  if (valid.ok())
    valid = CheckHost(rank_, CollectiveOp::kAllGather, seq, input.device);
  if (valid.ok())
    valid = CheckHost(rank_, CollectiveOp::kAllGather, seq, output.device);
  if (valid.ok()) valid = CheckUsable(CollectiveOp::kAllGather, seq);
  if (!valid.ok()) return Finished(valid, id);
  const int64_t bytes = input.count * DTypeSize(input.dtype);
  if (bytes == 0) return Finished(absl::OkStatus(), id);
  // Staged: c10d sees only these tensors (see the file comment).
  std::vector<at::Tensor> staging;
  auto in = std::make_shared<std::vector<at::Tensor>>(
      std::vector<at::Tensor>{shared_->Acquire(&staging, bytes)});
  std::memcpy((*in)[0].data_ptr(), input.data, bytes);
  auto out = std::make_shared<std::vector<std::vector<at::Tensor>>>(1);
  for (int r = 0; r < size_; ++r)
    (*out)[0].push_back(shared_->Acquire(&staging, bytes));
  auto group = group_;
  std::vector<C10dWork::Step> steps = {[group, in, out](absl::Duration left) {
    c10d::AllgatherOptions o;
    o.timeout = Millis(left);
    return group->allgather(*out, *in, o);
  }};
  char* dst = static_cast<char*>(output.data);
  return std::make_unique<C10dWork>(
      shared_, CollectiveOp::kAllGather, seq, id,
      Describe(rank_, CollectiveOp::kAllGather, seq, input.count, input.dtype),
      options.timeout, std::move(steps),
      [out, dst, bytes, this](int) {
        for (int r = 0; r < size_; ++r) {
          std::memcpy(dst + r * bytes, (*out)[0][r].data_ptr(), bytes);
        }
      },
      std::move(staging));
}

std::unique_ptr<Work> C10dCommunicator::ReduceScatter(
    ConstBufferRef input, BufferRef output, const ReduceOptions& options) {
  const int64_t seq = shared_->next_seq++;
  const uint64_t id =
      shared_->Record(CollectiveOp::kReduceScatter, seq, output.dtype,
                      output.count, input.bytes());
  absl::Status valid =
      ValidateReduceScatter(rank_, size_, seq, input, output, options);
  if (valid.ok())
    valid = CheckHost(rank_, CollectiveOp::kReduceScatter, seq, input.device);
  if (valid.ok())
    valid = CheckHost(rank_, CollectiveOp::kReduceScatter, seq, output.device);
  if (valid.ok()) valid = CheckUsable(CollectiveOp::kReduceScatter, seq);
  if (!valid.ok()) return Finished(valid, id);
  const int64_t count = output.count;
  const DType dtype = output.dtype;
  const int64_t bytes = count * DTypeSize(dtype);
  if (bytes == 0) return Finished(absl::OkStatus(), id);
  // One all-to-all: rank r's chunk j goes to rank j, which receives every
  // rank's chunk of its part, in rank order, and folds them.
  std::vector<at::Tensor> staging;
  auto send =
      std::make_shared<at::Tensor>(shared_->Acquire(&staging, size_ * bytes));
  std::memcpy(send->data_ptr(), input.data, size_ * bytes);
  auto recv =
      std::make_shared<at::Tensor>(shared_->Acquire(&staging, size_ * bytes));
  auto group = group_;
  std::vector<C10dWork::Step> steps = {
      [group, send, recv](absl::Duration left) {
        c10d::AllToAllOptions o;
        o.timeout = Millis(left);
        std::vector<int64_t> none;
        return AllToAllSingle(*group, *recv, *send, none, none, o, 0);
      }};
  const int n = size_;
  void* dst = output.data;
  ReduceOptions reduce = options;
  return std::make_unique<C10dWork>(
      shared_, CollectiveOp::kReduceScatter, seq, id,
      Describe(rank_, CollectiveOp::kReduceScatter, seq, count, dtype),
      options.timeout, std::move(steps),
      [recv, dst, bytes, count, dtype, reduce, n](int) {
        std::vector<const void*> parts;
        const char* base = static_cast<const char*>(recv->data_ptr());
        for (int r = 0; r < n; ++r) parts.push_back(base + r * bytes);
        HostReduce(parts, dst, count, dtype, reduce, n);
      },
      std::move(staging));
}

std::unique_ptr<Work> C10dCommunicator::AllReduce(
    ConstBufferRef input, BufferRef output, const ReduceOptions& options) {
  const int64_t seq = shared_->next_seq++;
  const uint64_t id = shared_->Record(CollectiveOp::kAllReduce, seq,
                                      input.dtype, input.count, input.bytes());
  absl::Status valid =
      ValidateAllReduce(rank_, size_, seq, input, output, options);
  if (valid.ok())
    valid = CheckHost(rank_, CollectiveOp::kAllReduce, seq, input.device);
  if (valid.ok())
    valid = CheckHost(rank_, CollectiveOp::kAllReduce, seq, output.device);
  if (valid.ok()) valid = CheckUsable(CollectiveOp::kAllReduce, seq);
  if (!valid.ok()) return Finished(valid, id);
  const int64_t count = input.count;
  const DType dtype = input.dtype;
  const int64_t esize = DTypeSize(dtype);
  if (count == 0) return Finished(absl::OkStatus(), id);
  // Rank j folds elements [j * part, (j + 1) * part) (the last parts may
  // be short or empty), then the folded parts are all-gathered.
  const int n = size_;
  const int64_t part = (count + n - 1) / n;
  auto part_count = [count, part](int j) {
    return std::clamp<int64_t>(count - j * part, 0, part);
  };
  std::vector<at::Tensor> staging;
  std::vector<int64_t> send_splits, recv_splits;
  for (int j = 0; j < n; ++j) {
    send_splits.push_back(part_count(j) * esize);
    recv_splits.push_back(part_count(rank_) * esize);
  }
  auto send =
      std::make_shared<at::Tensor>(shared_->Acquire(&staging, count * esize));
  std::memcpy(send->data_ptr(), input.data, count * esize);
  auto recv = std::make_shared<at::Tensor>(
      shared_->Acquire(&staging, n * part_count(rank_) * esize));
  // The folded parts, padded to `part` elements each for the all-gather.
  auto mine = std::make_shared<std::vector<at::Tensor>>(
      std::vector<at::Tensor>{shared_->Acquire(&staging, part * esize)});
  std::memset((*mine)[0].data_ptr(), 0, part * esize);
  auto all = std::make_shared<std::vector<std::vector<at::Tensor>>>(1);
  for (int r = 0; r < n; ++r)
    (*all)[0].push_back(shared_->Acquire(&staging, part * esize));
  auto group = group_;
  auto splits =
      std::make_shared<std::pair<std::vector<int64_t>, std::vector<int64_t>>>(
          std::move(recv_splits), std::move(send_splits));
  std::vector<C10dWork::Step> steps = {
      [group, send, recv, splits](absl::Duration left) {
        c10d::AllToAllOptions o;
        o.timeout = Millis(left);
        return AllToAllSingle(*group, *recv, *send, splits->first,
                              splits->second, o, 0);
      },
      [group, mine, all](absl::Duration left) {
        c10d::AllgatherOptions o;
        o.timeout = Millis(left);
        return group->allgather(*all, *mine, o);
      }};
  const int rank = rank_;
  void* dst = output.data;
  ReduceOptions reduce = options;
  return std::make_unique<C10dWork>(
      shared_, CollectiveOp::kAllReduce, seq, id,
      Describe(rank_, CollectiveOp::kAllReduce, seq, count, dtype),
      options.timeout, std::move(steps),
      [=](int step) {
        if (step == 0) {
          const int64_t own = part_count(rank);
          if (own == 0) return;
          std::vector<const void*> parts;
          const char* base = static_cast<const char*>(recv->data_ptr());
          for (int r = 0; r < n; ++r) parts.push_back(base + r * own * esize);
          HostReduce(parts, (*mine)[0].data_ptr(), own, dtype, reduce, n);
          return;
        }
        char* out = static_cast<char*>(dst);
        for (int r = 0; r < n; ++r) {
          std::memcpy(out + r * part * esize, (*all)[0][r].data_ptr(),
                      part_count(r) * esize);
        }
      },
      std::move(staging));
}

std::unique_ptr<Work> C10dCommunicator::Broadcast(
    BufferRef buffer, const BroadcastOptions& options) {
  const int64_t seq = shared_->next_seq++;
  const uint64_t id =
      shared_->Record(CollectiveOp::kBroadcast, seq, buffer.dtype, buffer.count,
                      buffer.bytes());
  absl::Status valid = ValidateBroadcast(rank_, size_, seq, buffer, options);
  if (valid.ok())
    valid = CheckHost(rank_, CollectiveOp::kBroadcast, seq, buffer.device);
  if (valid.ok()) valid = CheckUsable(CollectiveOp::kBroadcast, seq);
  if (!valid.ok()) return Finished(valid, id);
  const int64_t bytes = buffer.count * DTypeSize(buffer.dtype);
  if (bytes == 0) return Finished(absl::OkStatus(), id);
  std::vector<at::Tensor> staging;
  auto staged = std::make_shared<std::vector<at::Tensor>>(
      std::vector<at::Tensor>{shared_->Acquire(&staging, bytes)});
  if (rank_ == options.root) {
    std::memcpy((*staged)[0].data_ptr(), buffer.data, bytes);
  }
  auto group = group_;
  const int root = options.root;
  std::vector<C10dWork::Step> steps = {
      [group, staged, root](absl::Duration left) {
        c10d::BroadcastOptions o;
        o.rootRank = root;
        o.timeout = Millis(left);
        return group->broadcast(*staged, o);
      }};
  void* dst = buffer.data;
  const bool is_root = rank_ == root;
  return std::make_unique<C10dWork>(
      shared_, CollectiveOp::kBroadcast, seq, id,
      Describe(rank_, CollectiveOp::kBroadcast, seq, buffer.count,
               buffer.dtype),
      options.timeout, std::move(steps),
      [staged, dst, bytes, is_root](int) {
        if (!is_root) std::memcpy(dst, (*staged)[0].data_ptr(), bytes);
      },
      std::move(staging));
}

absl::StatusOr<std::vector<std::string>> C10dCommunicator::AllGatherBytes(
    absl::string_view bytes, const CollectiveOptions& options) {
  // Lengths first (as float64: exact below 2^53), then the strings padded
  // to the longest.
  std::vector<double> lengths(size_);
  const double mine = static_cast<double>(bytes.size());
  absl::Status status =
      AllGather({&mine, 1, DType::kFloat64},
                {lengths.data(), size_, DType::kFloat64}, options)
          ->Wait();
  if (!status.ok()) return status;
  int64_t longest = 0;
  for (double l : lengths) longest = std::max<int64_t>(longest, l);
  std::vector<std::string> out(size_);
  if (longest == 0) return out;
  // Padded to whole float64 elements.
  const int64_t words = (longest + 7) / 8;
  std::vector<double> padded(words, 0.0);
  std::memcpy(padded.data(), bytes.data(), bytes.size());
  std::vector<double> all(words * size_);
  status = AllGather({padded.data(), words, DType::kFloat64},
                     {all.data(), words * size_, DType::kFloat64}, options)
               ->Wait();
  if (!status.ok()) return status;
  for (int r = 0; r < size_; ++r) {
    out[r].assign(reinterpret_cast<const char*>(all.data() + r * words),
                  static_cast<size_t>(lengths[r]));
  }
  return out;
}

absl::Status C10dCommunicator::Barrier(const CollectiveOptions& options) {
  const int64_t seq = shared_->next_seq++;
  const uint64_t id =
      shared_->Record(CollectiveOp::kBarrier, seq, DType::kFloat32, 0, 0);
  absl::Status valid = CheckUsable(CollectiveOp::kBarrier, seq);
  if (!valid.ok()) return Finished(valid, id)->Wait();
  auto group = group_;
  std::vector<C10dWork::Step> steps = {[group](absl::Duration left) {
    c10d::BarrierOptions o;
    o.timeout = Millis(left);
    return group->barrier(o);
  }};
  return C10dWork(shared_, CollectiveOp::kBarrier, seq, id,
                  absl::StrCat("c10d rank ", rank_, ": barrier #", seq),
                  options.timeout, std::move(steps), [](int) {})
      .Wait();
}

absl::StatusOr<std::unique_ptr<Communicator>> C10dCommunicator::Split(
    int color, int key, const CollectiveOptions& options) {
  // Every rank's (color, key), then a gloo group per color from the store,
  // under a prefix no other group uses.
  const std::string mine = absl::StrCat(color, " ", key);
  const int64_t split_seq = shared_->next_seq;
  absl::StatusOr<std::vector<std::string>> all = AllGatherBytes(mine, options);
  if (!all.ok()) return all.status();
  const int64_t split = splits_++;
  if (color < 0) return std::unique_ptr<Communicator>();
  std::vector<std::pair<int, int>> members;  // (key, old rank)
  for (int r = 0; r < size_; ++r) {
    int c = 0, k = 0;
    std::vector<std::string> parts = absl::StrSplit((*all)[r], ' ');
    if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &c) ||
        !absl::SimpleAtoi(parts[1], &k)) {
      return absl::InternalError(absl::StrCat("c10d rank ", rank_,
                                              ": split: rank ", r, " sent \"",
                                              (*all)[r], "\""));
    }
    if (c == color) members.emplace_back(k, r);
  }
  std::sort(members.begin(), members.end());
  int new_rank = -1;
  for (size_t i = 0; i < members.size(); ++i) {
    if (members[i].second == rank_) new_rank = static_cast<int>(i);
  }
  const std::string prefix =
      absl::StrCat(shared_->prefix, "split", split, "/", color, "/");
  try {
    if (!shared_->device) {
      const char* ifname = std::getenv("GLOO_SOCKET_IFNAME");
      shared_->device =
          ifname != nullptr && *ifname != '\0'
              ? c10d::ProcessGroupGloo::createDeviceForInterface(ifname)
              : c10d::ProcessGroupGloo::createDefaultDevice();
    }
    auto gloo_options =
        c10d::ProcessGroupGloo::Options::create(Millis(options.timeout));
    gloo_options->devices = {shared_->device};
    gloo_options->threads = 2;
    auto sub_store = c10::make_intrusive<c10d::PrefixStore>(prefix, store_);
    c10::intrusive_ptr<c10d::ProcessGroup> group = MakeGlooGroup(
        sub_store, new_rank, static_cast<int>(members.size()), gloo_options);
    // The subgroup records into this rank's recorder (set below), not a
    // recorder of its own.
    C10dOptions sub_options = shared_->options;
    sub_options.flight_recorder.capacity = 0;
    auto sub = absl::WrapUnique(
        new C10dCommunicator(store_, group, prefix, sub_options));
    sub->shared_->device = shared_->device;
    sub->shared_->probe_store = shared_->probe_store;
    if (shared_->recorder != nullptr) {
      auto flight = std::make_shared<FlightGroup>();
      flight->id = SplitGroupId(shared_->group->id, split_seq, color);
      for (const auto& [k, r] : members) {
        flight->ranks.push_back(
            r < static_cast<int>(shared_->group->ranks.size())
                ? shared_->group->ranks[r]
                : r);
      }
      sub->shared_->recorder = shared_->recorder;
      sub->shared_->group = std::move(flight);
    }
    return std::unique_ptr<Communicator>(std::move(sub));
  } catch (...) {
    return FromC10d(ExceptionMessage(std::current_exception()),
                    absl::StrCat("c10d rank ", rank_, ": split #", split,
                                 " (color ", color, ")"));
  }
}

}  // namespace flatparam
