// A Communicator for tests that forwards every call to another one and
// records which collective was called with which timeout, so that a test
// can check that a command passes its --timeout to every collective it
// issues, including those on the groups its Splits create (which are
// wrapped in turn and record into the same log).
//
//   std::vector<RecordedCall> log;
//   RecordingCommunicator recording(&comm, &log);
//   RunSomething(recording);
//   EXPECT_THAT(CallsWithOtherTimeouts(log, absl::Seconds(7)), IsEmpty());
//
// Ownership: the inner communicator and the log are borrowed (a Split's
// child owns its inner communicator). Thread-safety: as the inner
// communicator's (one thread at a time); one log per rank.
#ifndef TOOLS_TESTING_RECORDING_COMMUNICATOR_H_
#define TOOLS_TESTING_RECORDING_COMMUNICATOR_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "comm/communicator.h"
#include "comm/forwarding_communicator.h"

namespace flatparam {
namespace tools {

// One call: "all_gather", "reduce_scatter", "all_reduce", "broadcast",
// "all_gather_bytes", "barrier" or "split", and its options' timeout.
struct RecordedCall {
  std::string op;
  absl::Duration timeout;
};

class RecordingCommunicator final : public ForwardingCommunicator {
 public:
  RecordingCommunicator(Communicator* inner, std::vector<RecordedCall>* log);
  RecordingCommunicator(std::unique_ptr<Communicator> inner,
                        std::vector<RecordedCall>* log);

  std::unique_ptr<Work> AllGather(ConstBufferRef input, BufferRef output,
                                  const CollectiveOptions& options) override;
  std::unique_ptr<Work> ReduceScatter(ConstBufferRef input, BufferRef output,
                                      const ReduceOptions& options) override;
  std::unique_ptr<Work> AllReduce(ConstBufferRef input, BufferRef output,
                                  const ReduceOptions& options) override;
  std::unique_ptr<Work> Broadcast(BufferRef buffer,
                                  const BroadcastOptions& options) override;
  absl::StatusOr<std::vector<std::string>> AllGatherBytes(
      absl::string_view bytes, const CollectiveOptions& options) override;
  absl::Status Barrier(const CollectiveOptions& options) override;
  // The child (if any) is a RecordingCommunicator into the same log.
  absl::StatusOr<std::unique_ptr<Communicator>> Split(
      int color, int key, const CollectiveOptions& options) override;

 private:
  void Record(absl::string_view op, const CollectiveOptions& options);

  std::vector<RecordedCall>* log_;
};

// "op (timeout)" for each call in `log` whose timeout is not `want`.
std::vector<std::string> CallsWithOtherTimeouts(
    const std::vector<RecordedCall>& log, absl::Duration want);

}  // namespace tools
}  // namespace flatparam

#endif  // TOOLS_TESTING_RECORDING_COMMUNICATOR_H_
