// FsdpTrainOptions::after_step: when it runs, what state it sees, that it
// changes nothing, and that its error stops training.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/base/status_matchers.h"
#include "flatparam/device/device.h"
#include "refmodel/fsdp_trainer.h"
#include "sim/sim.h"

namespace flatparam {
namespace refmodel {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr int kWorld = 2;

FsdpTrainOptions Options(int64_t steps) {
  FsdpTrainOptions o;
  o.model.vocab = 5;
  o.model.dims = {3, 4};
  o.steps = steps;
  o.global_batch = 4;
  o.optimizer = AdamWOptions{};
  o.data_seed = 7;
  return o;
}

using StateCopier = absl::FunctionRef<absl::StatusOr<FsdpRankState>()>;
// An after_step hook that also gets the rank.
using RankHook = std::function<absl::Status(int rank, int64_t steps_done,
                                            StateCopier copy_state)>;

// TrainFsdpOnRank on kWorld simulated ranks, with `hook` (when set) as
// every rank's after_step; the results by rank.
absl::StatusOr<std::vector<FsdpRankResult>> Train(
    const FsdpTrainOptions& options, const RankHook& hook = nullptr) {
  SimOptions sim;
  sim.world_size = kWorld;
  FLATPARAM_ASSIGN_OR_RETURN(std::unique_ptr<SimWorld> world,
                             SimWorld::Create(sim));
  std::vector<FsdpRankResult> results(kWorld);
  FLATPARAM_RETURN_IF_ERROR(
      world->Run([&](SimCommunicator& comm) -> absl::Status {
        const int rank = comm.rank();
        FsdpTrainOptions mine = options;
        if (hook) {
          mine.after_step = [&hook, rank](int64_t steps_done,
                                          StateCopier copy_state) {
            return hook(rank, steps_done, copy_state);
          };
        }
        HostDeviceOps device;
        FLATPARAM_ASSIGN_OR_RETURN(results[rank],
                                   TrainFsdpOnRank(comm, device, mine));
        return absl::OkStatus();
      }));
  return results;
}

bool SameState(const FsdpRankState& a, const FsdpRankState& b) {
  return a.flat_params == b.flat_params && a.optimizer == b.optimizer;
}

// Every rank's hook runs after each step, and the state it copies after
// step k is the final state of a run of k steps; the hook (copying the
// state every step) leaves the run bitwise unchanged.
TEST(AfterStepTest, SeesEachStepsStateAndChangesNothing) {
  constexpr int64_t kSteps = 3;
  std::mutex mu;
  std::vector<std::vector<int64_t>> calls(kWorld);
  std::vector<std::vector<FsdpRankState>> states(kWorld);
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      std::vector<FsdpRankResult> hooked,
      Train(Options(kSteps),
            [&](int rank, int64_t steps_done,
                StateCopier copy_state) -> absl::Status {
              FLATPARAM_ASSIGN_OR_RETURN(FsdpRankState state, copy_state());
              std::lock_guard<std::mutex> lock(mu);
              calls[rank].push_back(steps_done);
              states[rank].push_back(std::move(state));
              return absl::OkStatus();
            }));
  FLATPARAM_ASSERT_OK_AND_ASSIGN(std::vector<FsdpRankResult> plain,
                                 Train(Options(kSteps)));
  for (int r = 0; r < kWorld; ++r) {
    SCOPED_TRACE(r);
    EXPECT_THAT(calls[r], ElementsAre(1, 2, 3));
    EXPECT_EQ(hooked[r].losses, plain[r].losses);
    EXPECT_EQ(hooked[r].params, plain[r].params);
    EXPECT_EQ(hooked[r].optimizer_state, plain[r].optimizer_state);
    EXPECT_TRUE(SameState(hooked[r].state, plain[r].state));
  }
  for (int64_t k = 1; k <= kSteps; ++k) {
    SCOPED_TRACE(k);
    FLATPARAM_ASSERT_OK_AND_ASSIGN(std::vector<FsdpRankResult> shorter,
                                   Train(Options(k)));
    for (int r = 0; r < kWorld; ++r) {
      ASSERT_EQ(states[r].size(), static_cast<size_t>(kSteps));
      EXPECT_TRUE(SameState(states[r][k - 1], shorter[r].state)) << r;
    }
  }
}

// An error from the hook stops training at that step, with the global step
// named; the hook is not called again.
TEST(AfterStepTest, AnErrorStopsTraining) {
  std::mutex mu;
  std::vector<std::vector<int64_t>> calls(kWorld);
  FsdpTrainOptions o = Options(4);
  o.first_step = 10;
  EXPECT_THAT(
      Train(o,
            [&](int rank, int64_t steps_done, StateCopier) -> absl::Status {
              std::lock_guard<std::mutex> lock(mu);
              calls[rank].push_back(steps_done);
              if (steps_done == 2) return absl::UnavailableError("disk full");
              return absl::OkStatus();
            }),
      StatusIs(absl::StatusCode::kUnavailable,
               HasSubstr("after step 11: disk full")));
  EXPECT_THAT(calls, ElementsAre(ElementsAre(1, 2), ElementsAre(1, 2)));
}

}  // namespace
}  // namespace refmodel
}  // namespace flatparam
