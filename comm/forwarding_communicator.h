// ForwardingCommunicator: a Communicator that passes every call to another
// one, for wrappers that change or observe a few calls (counting traffic,
// relabelling buffers, injecting faults, recording options) without
// repeating the whole interface. Override what differs; everything else,
// SupportsStreams included, reaches the inner communicator unchanged.
//
//   class Counting final : public ForwardingCommunicator {
//    public:
//     using ForwardingCommunicator::ForwardingCommunicator;
//     std::unique_ptr<Work> AllGather(ConstBufferRef in, BufferRef out,
//                                     const CollectiveOptions& o) override {
//       ++all_gathers_;
//       return inner().AllGather(in, out, o);
//     }
//    private:
//     int all_gathers_ = 0;
//   };
//
// Split forwards too, so the child is the inner communicator's, unwrapped;
// a wrapper whose behaviour should extend to subgroups overrides Split and
// wraps the child.
//
// Ownership: the inner communicator is borrowed (it must outlive this one)
// or owned, as constructed. Thread-safety: the inner communicator's (one
// thread at a time, the Communicator contract).
#ifndef FLATPARAM_COMM_FORWARDING_COMMUNICATOR_H_
#define FLATPARAM_COMM_FORWARDING_COMMUNICATOR_H_

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "comm/communicator.h"

namespace flatparam {

class ForwardingCommunicator : public Communicator {
 public:
  explicit ForwardingCommunicator(Communicator* inner) : inner_(inner) {}
  explicit ForwardingCommunicator(std::unique_ptr<Communicator> inner)
      : owned_(std::move(inner)), inner_(owned_.get()) {}

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  absl::string_view backend() const override { return inner_->backend(); }
  bool SupportsStreams(Device device) const override {
    return inner_->SupportsStreams(device);
  }
  std::unique_ptr<Work> AllGather(ConstBufferRef input, BufferRef output,
                                  const CollectiveOptions& options) override {
    return inner_->AllGather(input, output, options);
  }
  std::unique_ptr<Work> ReduceScatter(ConstBufferRef input, BufferRef output,
                                      const ReduceOptions& options) override {
    return inner_->ReduceScatter(input, output, options);
  }
  std::unique_ptr<Work> AllReduce(ConstBufferRef input, BufferRef output,
                                  const ReduceOptions& options) override {
    return inner_->AllReduce(input, output, options);
  }
  std::unique_ptr<Work> Broadcast(BufferRef buffer,
                                  const BroadcastOptions& options) override {
    return inner_->Broadcast(buffer, options);
  }
  absl::StatusOr<std::vector<std::string>> AllGatherBytes(
      absl::string_view bytes, const CollectiveOptions& options) override {
    return inner_->AllGatherBytes(bytes, options);
  }
  absl::Status Barrier(const CollectiveOptions& options) override {
    return inner_->Barrier(options);
  }
  absl::StatusOr<std::unique_ptr<Communicator>> Split(
      int color, int key, const CollectiveOptions& options) override {
    return inner_->Split(color, key, options);
  }
  void Abort(absl::Status reason) override { inner_->Abort(std::move(reason)); }
  FlightRecorder* flight_recorder() const override {
    return inner_->flight_recorder();
  }

 protected:
  Communicator& inner() const { return *inner_; }

 private:
  std::unique_ptr<Communicator> owned_;
  Communicator* inner_;
};

}  // namespace flatparam

#endif  // FLATPARAM_COMM_FORWARDING_COMMUNICATOR_H_
