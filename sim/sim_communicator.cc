// SimCommunicator: each collective becomes a Call that its SimWorld
// issues.
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "comm/communicator.h"
#include "sim/internal/sim_internal.h"
#include "sim/sim.h"

namespace flatparam {

using internal_sim::OpKind;

SimCommunicator::~SimCommunicator() = default;

FlightRecorder* SimCommunicator::flight_recorder() const {
  return world_->flight_recorder(world_rank_);
}

std::unique_ptr<Work> SimCommunicator::AllGather(
    ConstBufferRef input, BufferRef output, const CollectiveOptions& options) {
  internal_sim::Call call;
  call.kind = OpKind::kAllGather;
  call.input = input;
  call.output = output;
  call.timeout = options.timeout;
  return world_->Issue(*this, std::move(call));
}

std::unique_ptr<Work> SimCommunicator::ReduceScatter(
    ConstBufferRef input, BufferRef output, const ReduceOptions& options) {
  internal_sim::Call call;
  call.kind = OpKind::kReduceScatter;
  call.input = input;
  call.output = output;
  call.reduce = options;
  call.timeout = options.timeout;
  return world_->Issue(*this, std::move(call));
}

std::unique_ptr<Work> SimCommunicator::AllReduce(ConstBufferRef input,
                                                 BufferRef output,
                                                 const ReduceOptions& options) {
  internal_sim::Call call;
  call.kind = OpKind::kAllReduce;
  call.input = input;
  call.output = output;
  call.reduce = options;
  call.timeout = options.timeout;
  return world_->Issue(*this, std::move(call));
}

std::unique_ptr<Work> SimCommunicator::Broadcast(
    BufferRef buffer, const BroadcastOptions& options) {
  internal_sim::Call call;
  call.kind = OpKind::kBroadcast;
  call.input = buffer;
  call.output = buffer;
  call.root = options.root;
  call.timeout = options.timeout;
  return world_->Issue(*this, std::move(call));
}

absl::StatusOr<std::vector<std::string>> SimCommunicator::AllGatherBytes(
    absl::string_view bytes, const CollectiveOptions& options) {
  internal_sim::Call call;
  call.kind = OpKind::kAllGatherBytes;
  call.bytes = std::string(bytes);
  call.timeout = options.timeout;
  return world_->IssueGatherBytes(*this, std::move(call));
}

absl::Status SimCommunicator::Barrier(const CollectiveOptions& options) {
  internal_sim::Call call;
  call.kind = OpKind::kBarrier;
  call.timeout = options.timeout;
  return world_->Issue(*this, std::move(call))->Wait();
}

absl::StatusOr<std::unique_ptr<Communicator>> SimCommunicator::Split(
    int color, int key, const CollectiveOptions& options) {
  internal_sim::Call call;
  call.kind = OpKind::kSplit;
  call.color = color;
  call.key = key;
  call.timeout = options.timeout;
  return world_->IssueSplit(*this, std::move(call));
}

void SimCommunicator::Yield() { world_->Yield(world_rank_); }

absl::Status SimCommunicator::Compute(absl::Duration duration) {
  return world_->Compute(world_rank_, duration);
}

absl::Duration SimCommunicator::Now() const { return world_->Now(world_rank_); }

void SimCommunicator::ArriveNextAt(absl::Duration t) {
  world_->ArriveNextAt(world_rank_, t);
}

absl::Duration SimCommunicator::WaitOnDevice(Work& work) {
  if (auto* sim = dynamic_cast<SimWorld::SimWork*>(&work)) {
    return sim->WaitOnDevice();
  }
  work.Wait().IgnoreError();  // a stream wait cannot fail; Wait() reports it
  return Now();
}

}  // namespace flatparam
