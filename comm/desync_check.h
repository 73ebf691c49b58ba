// DesyncCheckingCommunicator: before every collective, the group compares a
// fingerprint of it (operation, sequence number, dtype, count, root,
// reduce options, and the FSDP unit and phase its flight recorder holds)
// and fails on every rank, before any data moves, when the ranks disagree:
// a desynchronised group is then reported at the collective where the
// ranks part, not at a timeout or never (equal sizes from different units
// exchange the wrong data silently). For backends that do not check
// themselves (c10d, NCCL); MPI's check (MpiOptions::check_collectives) is
// cheaper, and the simulator always compares operations and sizes.
//
//   DesyncCheckingCommunicator checked(&world);
//   RunTraining(checked);  // a desync is Internal, naming each rank's call
//
// Cost: one AllGatherBytes of about 100 bytes per collective (recorded in
// the flight recorder too). A failed check leaves the group usable.
//
// Ownership: the inner communicator is borrowed (or owned, as
// constructed); subgroups from Split are checked too. Thread-safety: the
// inner communicator's.
#ifndef FLATPARAM_COMM_DESYNC_CHECK_H_
#define FLATPARAM_COMM_DESYNC_CHECK_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "comm/communicator.h"
#include "comm/forwarding_communicator.h"

namespace flatparam {

class DesyncCheckingCommunicator final : public ForwardingCommunicator {
 public:
  using ForwardingCommunicator::ForwardingCommunicator;

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
  absl::StatusOr<std::unique_ptr<Communicator>> Split(
      int color, int key, const CollectiveOptions& options) override;

 private:
  // Compares `call` (this rank's description of the collective) across
  // the group; Internal naming every rank's call when they differ.
  absl::Status Check(std::string call, const CollectiveOptions& options);

  int64_t seq_ = 0;
};

}  // namespace flatparam

#endif  // FLATPARAM_COMM_DESYNC_CHECK_H_
