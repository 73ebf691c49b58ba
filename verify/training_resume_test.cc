// Resumed training equals unbroken training, bit for bit.
//
// For random float32 training cases (verify/training_testutil.h's
// GenTrainingCase: world sizes 1..8, every strategy, alignment, offload,
// micro-batches in both accumulation modes, SGD and AdamW) of K steps:
//
//   * single-process: TrainReference for K steps, then K more from its
//     parameters and optimizer state with first_step = K, equals
//     TrainReference for 2K steps (losses, parameters, optimizer state);
//   * sharded: TrainFsdpOnRank for K steps, then on every rank K more from
//     that rank's own ungathered state (FsdpTrainOptions::initial_state,
//     first_step = K), equals the unbroken 2K-step sharded run: the same
//     losses for steps K..2K-1, the same gathered parameters and optimizer
//     state, and the same per-rank sharded state; and it equals the
//     chained reference.
#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"
#include "refmodel/fsdp_trainer.h"
#include "refmodel/reference_trainer.h"
#include "verify/training_testutil.h"

namespace flatparam {
namespace verify {
namespace {

using refmodel::FsdpRankResult;
using refmodel::FsdpTrainOptions;
using refmodel::TrainOptions;
using refmodel::TrainResult;

void AssertSameResult(
    const std::vector<float>& losses,
    const std::map<std::string, HostTensor>& params,
    const std::map<std::string, refmodel::OptimizerState>& state,
    const TrainResult& want, const std::string& what) {
  std::string why;
  RC_ASSERT(SameFloats(losses, want.losses));
  if (!SameTensors(params, want.params, &why)) {
    RC_FAIL(absl::StrFormat("%s parameters: %s", what, why));
  }
  if (!SameStates(state, want.optimizer_state, &why)) {
    RC_FAIL(absl::StrFormat("%s optimizer state: %s", what, why));
  }
}

TrainResult Reference(const refmodel::Config& config, const TrainOptions& o) {
  absl::StatusOr<TrainResult> r = refmodel::TrainReference(config, o);
  RC_ASSERT(r.ok());
  return *std::move(r);
}

RC_GTEST_PROP(TrainingResume, ChainedReferenceEqualsUnbrokenReference, ()) {
  const TrainingCase c = *GenTrainingCase();
  absl::StatusOr<TrainOptions> options =
      refmodel::ReferenceOptionsFor(c.options, c.world_size);
  RC_ASSERT(options.ok());
  const int64_t k = options->steps;
  TrainOptions whole = *options;
  whole.steps = 2 * k;
  const TrainResult want = Reference(c.options.model, whole);
  const TrainResult first = Reference(c.options.model, *options);
  TrainOptions second = *options;
  second.first_step = k;
  second.initial_params = first.params;
  second.initial_optimizer_state = first.optimizer_state;
  const TrainResult resumed = Reference(c.options.model, second);
  std::vector<float> losses = first.losses;
  losses.insert(losses.end(), resumed.losses.begin(), resumed.losses.end());
  AssertSameResult(losses, resumed.params, resumed.optimizer_state, want,
                   "chained reference");
}

RC_GTEST_PROP(TrainingResume, ShardedResumeFromOwnStateEqualsUnbrokenRun, ()) {
  const TrainingCase c = *GenTrainingCase();
  RC_TAG(std::string(ShardingStrategyName(c.options.strategy)));
  const int64_t k = c.options.steps;
  FsdpTrainOptions whole = c.options;
  whole.steps = 2 * k;
  absl::StatusOr<std::vector<FsdpRankResult>> unbroken =
      TrainFsdpPerRankOnSim([&](int) { return whole; }, c.world_size);
  RC_ASSERT(unbroken.ok());

  FsdpTrainOptions first = c.options;
  first.gather_results = false;
  absl::StatusOr<std::vector<FsdpRankResult>> segment1 =
      TrainFsdpPerRankOnSim([&](int) { return first; }, c.world_size);
  RC_ASSERT(segment1.ok());
  for (const FsdpRankResult& r : *segment1) {
    RC_ASSERT(r.params.empty());  // nothing gathered
    RC_ASSERT(r.state.flat_params.size() == r.state.optimizer.size());
  }
  absl::StatusOr<std::vector<FsdpRankResult>> segment2 = TrainFsdpPerRankOnSim(
      [&](int rank) {
        FsdpTrainOptions o = c.options;
        o.first_step = k;
        o.initial_state = (*segment1)[rank].state;
        return o;
      },
      c.world_size);
  RC_ASSERT(segment2.ok());

  // Against the chained reference (which equals the unbroken reference).
  absl::StatusOr<TrainOptions> ref_options =
      refmodel::ReferenceOptionsFor(whole, c.world_size);
  RC_ASSERT(ref_options.ok());
  const TrainResult want = Reference(c.options.model, *ref_options);
  const std::vector<float> tail(want.losses.begin() + k, want.losses.end());
  for (int r = 0; r < c.world_size; ++r) {
    const FsdpRankResult& got = (*segment2)[r];
    const FsdpRankResult& ref = (*unbroken)[r];
    RC_ASSERT(SameFloats(ref.losses, want.losses));
    TrainResult tail_want = want;
    tail_want.losses = tail;
    AssertSameResult(got.losses, got.params, got.optimizer_state, tail_want,
                     absl::StrFormat("rank %d", r));
    // The ungathered state too, element for element.
    RC_ASSERT(got.state.flat_params.size() == ref.state.flat_params.size());
    for (size_t u = 0; u < got.state.flat_params.size(); ++u) {
      RC_ASSERT(got.state.flat_params[u] == ref.state.flat_params[u]);
      RC_ASSERT(got.state.optimizer[u] == ref.state.optimizer[u]);
    }
  }
}

TEST(TrainingResume, RejectsAStateOfAnotherLayout) {
  FsdpTrainOptions options;
  options.steps = 1;
  absl::StatusOr<std::vector<FsdpRankResult>> two =
      TrainFsdpPerRankOnSim([&](int) { return options; }, 2);
  ASSERT_TRUE(two.ok()) << two.status();
  // A 2-rank shard on 4 ranks.
  absl::StatusOr<std::vector<FsdpRankResult>> four = TrainFsdpPerRankOnSim(
      [&](int rank) {
        FsdpTrainOptions o = options;
        o.initial_state = (*two)[rank % 2].state;
        return o;
      },
      4);
  ASSERT_FALSE(four.ok());
  EXPECT_EQ(four.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(four.status().message().find("initial state: the shard of flat "
                                         "parameter 0"),
            absl::string_view::npos)
      << four.status();
}

}  // namespace
}  // namespace verify
}  // namespace flatparam
