// Helpers for the training-equivalence suites (test-only): sharded training
// (refmodel/fsdp_trainer.h) on the simulator, named RapidCheck
// generators for training configurations, and bitwise / bounded
// comparisons of TrainResult-shaped maps.
//
// Thread-safety: functions of their arguments; TrainFsdpOnSim and
// TrainFsdpPerRankOnSim run the simulator's rank threads one at a time, and
// call their callbacks on those threads.
#ifndef FLATPARAM_VERIFY_TRAINING_TESTUTIL_H_
#define FLATPARAM_VERIFY_TRAINING_TESTUTIL_H_

#include <rapidcheck.h>

#include <cstdint>
#include <functional>
#include <map>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "flatparam/flatten.h"
#include "refmodel/fsdp_trainer.h"
#include "refmodel/optimizer.h"
#include "refmodel/reference_trainer.h"
#include "refmodel/tensor_diff.h"
#include "sim/sim.h"

namespace flatparam {
namespace verify {

// TrainFsdpOnRank on a SimWorld of `world_size` ranks (scheduler seed
// `sim_seed`), each with its own HostDeviceOps; the results by rank. The
// options are checked with refmodel::ValidateFsdpTrainOptions first.
absl::StatusOr<std::vector<refmodel::FsdpRankResult>> TrainFsdpOnSim(
    const refmodel::FsdpTrainOptions& options, int world_size,
    uint64_t sim_seed = 0);

// Runs on a rank's thread after that rank has trained (e.g. to save its
// state collectively); an error fails the whole run.
using AfterTraining = std::function<absl::Status(
    SimCommunicator& comm, const refmodel::FsdpTrainOptions& options,
    const refmodel::FsdpRankResult& result)>;

// TrainFsdpOnRank on a SimWorld of `world_size` ranks (seed 0), rank r with
// options_of(r) (for resuming each rank from its own state) and no
// validation beyond TrainFsdpOnRank's own; then, when `after` is set,
// after(comm, options_of(r), result of r) on each rank.
absl::StatusOr<std::vector<refmodel::FsdpRankResult>> TrainFsdpPerRankOnSim(
    const std::function<refmodel::FsdpTrainOptions(int rank)>& options_of,
    int world_size, const AfterTraining& after = nullptr);

// A training run to check: options plus the world size.
struct TrainingCase {
  refmodel::FsdpTrainOptions options;
  int world_size = 1;
};

void showValue(const TrainingCase& c, std::ostream& os);
std::string Describe(const TrainingCase& c);

// Model shapes: vocab 1..12, 1..3 layers of widths 1..12.
rc::Gen<refmodel::Config> GenModelConfig();
// SGD (with or without momentum, weight decay, nesterov) or AdamW with
// learning rates that keep a few steps finite.
rc::Gen<refmodel::OptimizerOptions> GenOptimizerOptions();
// float32 training: world sizes 1..8, every strategy (hybrid with a shard
// group size dividing the world), alignment on and off, CPU offload on and
// off, 1..3 micro-batches in either accumulation mode, 1..3 steps, 1..2
// samples per rank and micro-batch, any prefetch setting (forward prefetch
// on or off, NONE/BACKWARD_PRE/BACKWARD_POST, depth 1..3, limit_all_gathers
// 0..2), and activation recomputation on or off.
rc::Gen<TrainingCase> GenTrainingCase();

// Bitwise equality of two maps (dtype, shape, bytes); on a mismatch,
// `*why` names the first differing tensor and element.
bool SameTensors(const std::map<std::string, HostTensor>& a,
                 const std::map<std::string, HostTensor>& b, std::string* why);
bool SameStates(const std::map<std::string, refmodel::OptimizerState>& a,
                const std::map<std::string, refmodel::OptimizerState>& b,
                std::string* why);

// Bitwise equality of two loss sequences (NaNs compare by their bits).
bool SameFloats(const std::vector<float>& a, const std::vector<float>& b);

// Largest |a - b| over the tensors of two maps with equal keys and numels
// (NaN if any element is NaN in one and not the other), and the same over
// every tensor state of two optimizer-state maps: refmodel/tensor_diff.h.
using refmodel::MaxAbsDiff;

}  // namespace verify
}  // namespace flatparam

#endif  // FLATPARAM_VERIFY_TRAINING_TESTUTIL_H_
