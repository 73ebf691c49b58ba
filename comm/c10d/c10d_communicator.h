// A Communicator over PyTorch's c10d: a process group a LibTorch team
// already has (ProcessGroupGloo on CPUs), or one made from torchrun's
// environment, so that flatparam runs on the engine and launcher they use.
// In LibTorch 2.x ProcessGroupGloo is a c10d::Backend, not a ProcessGroup:
// wrap the ProcessGroup that holds it (ProcessGroup(store, rank, size),
// then setBackend(c10::DeviceType::CPU, BackendType::GLOO, gloo) and
// setDefaultBackend(BackendType::GLOO), as FromEnvironment does).
//
//   // Under `torchrun --nproc_per_node=4 --no-python ./trainer`:
//   FLATPARAM_ASSIGN_OR_RETURN(std::unique_ptr<C10dCommunicator> world,
//                              C10dCommunicator::FromEnvironment());
//   // ... FsdpModule::Wrap(model, world.get(), &device, options) ...
//
// Results are those of every other backend, bit for bit: data moves through
// the group's byte-exact collectives (all-gather, all-to-all, broadcast)
// and reductions are folded on the host by HostReduce, in rank order
// (comm/host_reduce.h). c10d's own reductions are not used: gloo's
// algorithms add in an order of their own (ring or halving-doubling, by
// size), and 1.13's gloo has no reduce-scatter, _allgather_base or
// _reduce_scatter_base. A reduce-scatter is one all-to-all (each rank
// receives every rank's chunk of its own part) and a fold; an all-reduce
// is that over ceil(count / size) elements per rank, then an all-gather of
// the folded parts. Both move what a ring does ((size - 1) / size of the
// buffer each way, twice for the all-reduce).
//
// Buffers and asynchrony. Each call copies its input into tensors of its
// own and hands those, never the caller's memory, to c10d; Wait() copies
// the result into the caller's output once c10d's work has completed. So a
// collective that times out (c10d's worker threads may still run it until
// gloo's own deadline, which is the same timeout) never reads or writes the
// caller's buffers after Wait() has returned. The staging tensors belong to
// c10d's work object, which holds them until its worker is done; those of
// a completed collective that c10d no longer holds are kept for reuse
// (C10dOptions::staging_cache_bytes), a failed one's never are. The cost is
// a copy in and a copy out (measured in BENCHMARKS.md against gloo's own
// collectives and the MPI backend).
//
// Timeouts and failures. Every collective passes its CollectiveOptions
// timeout to c10d (gloo's per-operation deadline) and waits no longer. A
// timeout or a lost peer aborts the communicator: later calls fail with
// Aborted at once, quoting the first error. Before it returns, a rank whose
// collective failed asks the group's store which ranks got as far
// (C10dOptions::diagnosis_grace): the message names the ranks that did
// not ("rank 2 sent nothing"). c10d cannot name them itself.
//
// Host buffers only: a device buffer is Unimplemented (c10d's NCCL group is
// the GPU path; flatparam's own NCCL backend serves CUDA buffers today).
// The four flatparam dtypes. Split makes gloo groups from the same store,
// under a prefix of their own.
//
// Thread-safety: as every Communicator, one thread at a time. The process
// group may be shared with other code (c10d groups are thread-safe) as long
// as every rank issues its collectives in the same order.
#ifndef FLATPARAM_COMM_C10D_C10D_COMMUNICATOR_H_
#define FLATPARAM_COMM_C10D_C10D_COMMUNICATOR_H_

#include <cstdint>
#include <memory>
#include <string>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "comm/communicator.h"
#include "comm/flight_recorder.h"

namespace flatparam {

struct C10dOptions {
  // How long FromEnvironment waits for the store and the group to form
  // (every rank's process to start): the first contact takes longer than a
  // collective, as processes load at their own pace.
  absl::Duration start_timeout = absl::Minutes(5);
  // After a collective fails, how long this rank waits for its peers to
  // say, through the store, that they reached the same collective; the
  // ranks that do not are named in the error. Part of the time a fault
  // takes to end the job: timeout + diagnosis_grace.
  absl::Duration diagnosis_grace = absl::Seconds(1);
  // The staging tensors of completed collectives are kept for the next
  // ones of the same sizes (FSDP's collectives repeat, unit by unit), up to
  // this many bytes in all; 0 keeps none.
  int64_t staging_cache_bytes = int64_t{512} << 20;
  // The rank's flight recorder (comm/flight_recorder.h), made by the world
  // communicator and shared with the groups split from it: capacity 0
  // records nothing.
  FlightRecorderOptions flight_recorder = FlightRecorderOptionsFromEnv();
};

class C10dCommunicator final : public Communicator {
 public:
  // Over `group`, which the caller made from `store` (the same store on
  // every rank). The store serves Split (subgroups are made from it under
  // a prefix of their own) and the diagnosis of a failed collective. The
  // communicator shares ownership of both. InvalidArgument for null
  // arguments.
  static absl::StatusOr<std::unique_ptr<C10dCommunicator>> Wrap(
      c10::intrusive_ptr<c10d::Store> store,
      c10::intrusive_ptr<c10d::ProcessGroup> group,
      const C10dOptions& options = {});

  // The group torchrun's workers make with `init_process_group("gloo")`:
  // RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT from the environment; the
  // store is a TCPStore client of torchrun's agent when
  // TORCHELASTIC_USE_AGENT_STORE=True (under the agent's per-restart
  // prefix, TORCHELASTIC_RESTART_COUNT), else one hosted by rank 0 on
  // MASTER_ADDR:MASTER_PORT; the group is a ProcessGroupGloo on the
  // interface GLOO_SOCKET_IFNAME names, or on this host's name's address.
  // InvalidArgument naming a missing or malformed variable;
  // DeadlineExceeded when the group does not form within start_timeout.
  static absl::StatusOr<std::unique_ptr<C10dCommunicator>> FromEnvironment(
      const C10dOptions& options = {});

  ~C10dCommunicator() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  absl::string_view backend() const override { return "c10d"; }

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
  void Abort(absl::Status reason) override;
  FlightRecorder* flight_recorder() const override;

  // The process group (to share with code that speaks c10d).
  const c10::intrusive_ptr<c10d::ProcessGroup>& process_group() const {
    return group_;
  }

  // Implementation details, shared with the work objects of c10d_work.cc.
  struct Shared;

 private:
  C10dCommunicator(c10::intrusive_ptr<c10d::Store> store,
                   c10::intrusive_ptr<c10d::ProcessGroup> group,
                   std::string prefix, const C10dOptions& options);
  // A Work that is already done with `status`, recorded as such.
  std::unique_ptr<Work> Finished(absl::Status status, uint64_t flight_id);

  // The status a new collective fails with: Aborted once aborted.
  absl::Status CheckUsable(CollectiveOp op, int64_t seq) const;

  const int rank_;
  const int size_;
  const c10::intrusive_ptr<c10d::Store> store_;
  const c10::intrusive_ptr<c10d::ProcessGroup> group_;
  std::shared_ptr<Shared> shared_;
  int64_t splits_ = 0;
};

}  // namespace flatparam

#endif  // FLATPARAM_COMM_C10D_C10D_COMMUNICATOR_H_
