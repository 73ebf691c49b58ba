#include "tools/testing/recording_communicator.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace flatparam {
namespace tools {

RecordingCommunicator::RecordingCommunicator(Communicator* inner,
                                             std::vector<RecordedCall>* log)
    : ForwardingCommunicator(inner), log_(log) {}

RecordingCommunicator::RecordingCommunicator(
    std::unique_ptr<Communicator> inner, std::vector<RecordedCall>* log)
    : ForwardingCommunicator(std::move(inner)), log_(log) {}

void RecordingCommunicator::Record(absl::string_view op,
                                   const CollectiveOptions& options) {
  log_->push_back(RecordedCall{std::string(op), options.timeout});
}

std::unique_ptr<Work> RecordingCommunicator::AllGather(
    ConstBufferRef input, BufferRef output, const CollectiveOptions& options) {
  Record("all_gather", options);
  return inner().AllGather(input, output, options);
}

std::unique_ptr<Work> RecordingCommunicator::ReduceScatter(
    ConstBufferRef input, BufferRef output, const ReduceOptions& options) {
  Record("reduce_scatter", options);
  return inner().ReduceScatter(input, output, options);
}

std::unique_ptr<Work> RecordingCommunicator::AllReduce(
    ConstBufferRef input, BufferRef output, const ReduceOptions& options) {
  Record("all_reduce", options);
  return inner().AllReduce(input, output, options);
}

std::unique_ptr<Work> RecordingCommunicator::Broadcast(
    BufferRef buffer, const BroadcastOptions& options) {
  Record("broadcast", options);
  return inner().Broadcast(buffer, options);
}

absl::StatusOr<std::vector<std::string>> RecordingCommunicator::AllGatherBytes(
    absl::string_view bytes, const CollectiveOptions& options) {
  Record("all_gather_bytes", options);
  return inner().AllGatherBytes(bytes, options);
}

absl::Status RecordingCommunicator::Barrier(const CollectiveOptions& options) {
  Record("barrier", options);
  return inner().Barrier(options);
}

absl::StatusOr<std::unique_ptr<Communicator>> RecordingCommunicator::Split(
    int color, int key, const CollectiveOptions& options) {
  Record("split", options);
  absl::StatusOr<std::unique_ptr<Communicator>> child =
      inner().Split(color, key, options);
  if (!child.ok() || *child == nullptr) return child;
  return std::unique_ptr<Communicator>(
      std::make_unique<RecordingCommunicator>(*std::move(child), log_));
}

std::vector<std::string> CallsWithOtherTimeouts(
    const std::vector<RecordedCall>& log, absl::Duration want) {
  std::vector<std::string> out;
  for (const RecordedCall& call : log) {
    if (call.timeout != want) {
      out.push_back(
          absl::StrCat(call.op, " (", absl::FormatDuration(call.timeout), ")"));
    }
  }
  return out;
}

}  // namespace tools
}  // namespace flatparam
