// Test helpers for FlatParamHandle (test-only): scenarios run on the
// simulator (one handle per rank), deterministic parameter and gradient
// values, and an independent reference for the reduced sharded gradient
// written from the documented arithmetic (not from comm/host_reduce.h).
//
// Thread-safety: RunWithHandles runs the rank function on the simulator's
// rank threads one at a time, so rank functions may write shared results
// without locks.
#ifndef TESTING_HANDLE_TESTUTIL_H_
#define TESTING_HANDLE_TESTUTIL_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "comm/communicator.h"
#include "flatparam/base/dtype.h"
#include "flatparam/device/device.h"
#include "flatparam/flatten.h"
#include "flatparam/handle.h"
#include "flatparam/layout.h"
#include "sim/sim.h"

namespace flatparam {
namespace testing_handle {

struct Scenario {
  std::vector<ParamSpec> specs;
  // The parameters' dtype (overrides the specs').
  DType dtype = DType::kFloat32;
  ShardingStrategy strategy = ShardingStrategy::kFullShard;
  // The layout's world size; for hybrid, times replicate_size ranks in all.
  int shard_size = 2;
  int replicate_size = 1;
  bool align = false;
  HandleOptions options;
  uint64_t sim_seed = 0;
  // Parameter values that round in low precision (else small dyadics).
  bool rounding_values = false;
  // Run on FakeCudaDeviceOps (host memory labelled cuda:0) with the
  // communicators relabelling buffers for the simulator, so that the
  // handle's host <-> device paths run.
  bool fake_device = false;
  // Run on SimDeviceOps (sim/sim_device.h: device work queued on simulated
  // streams, executed in an order drawn from `device_seed`, with the stream
  // race detector) and StreamCheckedCommunicators; RunWithHandles fails
  // with the detector's reports after the rank function and the handle's
  // destruction.
  bool sim_device = false;
  uint64_t device_seed = 0;
  // Give the handle its own unshard and post-backward streams (created on
  // the rank's DeviceOps; stream 0 is the compute stream).
  bool separate_streams = false;
  // With sim_device: the StreamCheckedCommunicators are stream-ordered (a
  // simulated NCCL), so the handle orders its collectives with the streams
  // instead of waiting on the host.
  bool stream_ordered_comm = false;
  // Faults injected into the simulator (sim/fault.h).
  std::vector<FaultSpec> faults;

  int world_size() const { return shard_size * replicate_size; }
  bool hybrid() const { return IsHybridStrategy(strategy); }
  // The parameters and the options; Options() only the latter.
  std::string ToString() const;
  std::string Options() const;
};

// For RapidCheck counterexamples.
inline void showValue(const Scenario& s, std::ostream& os) {
  os << s.ToString();
}

// The layout of the scenario's unit ("unit"); alignment is computed for
// options.param_dtype when set.
absl::StatusOr<FlatParamLayout> MakeLayout(const Scenario& s);

// Initial value of element k of parameter i.
double InitialValue(const Scenario& s, int param, int64_t k);
// The initial parameters as host tensors of the layout's dtype.
std::vector<HostTensor> InitialParams(const Scenario& s,
                                      const FlatParamLayout& layout);

// The gradient (as float32 values) that world rank `rank` adds for element k
// of parameter i in micro-batch `iter`.
float GradValue(const Scenario& s, int iter, int rank, int param, int64_t k);

// DeviceOps whose compute device claims to be cuda:0 but is host memory:
// every operation runs the host kernels, and the base class's placement
// checks apply as for a real device. Counts copies by direction.
class FakeCudaDeviceOps final : public DeviceOps {
 public:
  Device device() const override { return Device::Cuda(0); }
  absl::string_view name() const override { return "fake-cuda"; }
  absl::Status Synchronize() override { return absl::OkStatus(); }

  int64_t host_to_device = 0;
  int64_t device_to_host = 0;

 protected:
  absl::StatusOr<void*> DoAllocate(Device device, int64_t bytes,
                                   bool pinned) override;
  void DoFree(void* data, Device device, bool pinned) override;
  absl::Status DoCopy(BufferRef dst, ConstBufferRef src) override;
  absl::Status DoFill(BufferRef dst, double value) override;
  absl::Status DoCast(BufferRef dst, ConstBufferRef src) override;
  absl::Status DoScale(BufferRef buf, ScaleOp op, double factor) override;
  absl::Status DoAdd(BufferRef acc, ConstBufferRef x) override;
};

// A Communicator that passes buffers labelled cuda:0 to `inner` as host
// buffers (for the simulator, which takes host buffers only).
std::unique_ptr<Communicator> RelabelCudaAsHost(
    std::unique_ptr<Communicator> inner);
std::unique_ptr<Communicator> RelabelCudaAsHost(Communicator* inner);

// Everything a rank function gets.
struct RankContext {
  Communicator& world;
  int world_rank;
  FlatParamHandle& handle;
  const FlatParamLayout& layout;
  DeviceOps& ops;
};
using RankFn = std::function<absl::Status(RankContext&)>;

// Creates a SimWorld of s.world_size() ranks (seed s.sim_seed); on each
// rank builds the shard (and replicate) group, a HostDeviceOps and a
// FlatParamHandle from InitialParams, and runs `fn`. Returns the world for
// its trace in `*world` when non-null.
absl::Status RunWithHandles(const Scenario& s, const RankFn& fn,
                            std::unique_ptr<SimWorld>* world = nullptr);

// Calls AccumulateGrad with GradValue(s, iter, world_rank, i, k) for every
// parameter that requires a gradient (the handle's current flags).
absl::Status AddGradients(const Scenario& s, RankContext& ctx, int iter);

// PreForward, PostForward, PreBackward, AddGradients, PostBackward(sync),
// FinalizeBackward(sync).
absl::Status RunIteration(const Scenario& s, RankContext& ctx, int iter,
                          bool sync);

// Host copy of a buffer's values.
std::vector<double> ReadValues(ConstBufferRef b);
// Writes `values` into a host buffer (rounding to its dtype).
void WriteValues(BufferRef b, const std::vector<double>& values);

// PyTorch arithmetic on values of `dtype` held in doubles: results are
// computed in the dtype's compute type and rounded to `dtype`.
double RoundTo(DType dtype, double v);
double AddIn(DType dtype, double a, double b);
double DivIn(DType dtype, double a, double factor);

// The unsharded local gradient (padded for sharded strategies; in
// param_dtype) world rank `rank` has after the micro-batches `iters` were
// accumulated into it (zero for frozen parameters and padding).
std::vector<double> LocalGradient(const Scenario& s,
                                  const FlatParamLayout& layout,
                                  DType param_dtype, int rank,
                                  const std::vector<int>& iters);

// The reduced sharded gradient of shard rank `shard_rank`, in the
// accumulation dtype, from every world rank's local gradient
// (`local[world_rank]`), following FlatParamHandle::ReduceGrad: cast to
// reduce_dtype, pre-divide, sum over the shard group in rank order, sum over
// the replicate group in rank order (hybrid), post-divide, cast.
std::vector<double> ReducedShard(const Scenario& s,
                                 const FlatParamLayout& layout,
                                 const std::vector<std::vector<double>>& local,
                                 int shard_rank, DType reduce_dtype,
                                 DType accum_dtype, double predivide,
                                 double postdivide);

}  // namespace testing_handle
}  // namespace flatparam

#endif  // TESTING_HANDLE_TESTUTIL_H_
