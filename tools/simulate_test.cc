// `fsdp plan --simulate` against the plan: the runtime's step on every rank
// of a world, with no data, takes the plan's step time and peak memory for
// every strategy, and a conditional unit is reported as a desync naming the
// unit and the ranks.
#include "tools/simulate.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "flatparam/base/status_matchers.h"
#include "tools/plan.h"

namespace flatparam {
namespace tools {
namespace {

using ::testing::HasSubstr;

PlanOptions Options(const std::string& strategy, int64_t nodes,
                    const std::string& mixed_precision = "bf16") {
  PlanOptions o;
  o.model = "gpt2";
  o.nodes = nodes;
  o.gpus_per_node = 4;
  o.strategy = strategy;
  o.mixed_precision = mixed_precision;
  o.tokens_per_gpu = 2048;
  return o;
}

absl::StatusOr<std::pair<Plan, std::vector<SimulatedStrategy>>> Simulate(
    const PlanOptions& o, const SimulateOptions& s = {}) {
  FLATPARAM_ASSIGN_OR_RETURN(Plan plan, MakePlan(o));
  FLATPARAM_ASSIGN_OR_RETURN(std::vector<SimulatedStrategy> simulated,
                             SimulatePlan(plan, o, s));
  return std::make_pair(std::move(plan), std::move(simulated));
}

struct Case {
  std::string strategy;
  int64_t nodes;
  std::string mixed_precision;
};

class SimulateAgreementTest : public ::testing::TestWithParam<Case> {};

TEST_P(SimulateAgreementTest, StepTimeAndPeakMemoryMatchThePlan) {
  const Case& c = GetParam();
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      auto result, Simulate(Options(c.strategy, c.nodes, c.mixed_precision)));
  const auto& [plan, simulated] = result;
  ASSERT_EQ(simulated.size(), 1u);
  const SimulatedStrategy& s = simulated[0];
  const cost::StepPrediction& p = plan.strategies[0].prediction;
  EXPECT_EQ(s.world_size, 4 * c.nodes);
  EXPECT_TRUE(s.races.empty()) << s.races[0];
  EXPECT_GT(s.collectives, 0);
  EXPECT_NEAR(s.step_seconds, p.step_seconds, 0.02 * p.step_seconds)
      << "simulated " << s.step_seconds << " s, plan " << p.step_seconds;
  EXPECT_NEAR(s.compute_seconds, p.compute_seconds, 1e-6 * p.compute_seconds);
  EXPECT_EQ(s.peak_bytes(), p.peak_bytes)
      << "simulated " << s.peak_runtime_bytes << " + " << s.optimizer_bytes;
}

INSTANTIATE_TEST_SUITE_P(Strategies, SimulateAgreementTest,
                         ::testing::Values(Case{"FULL_SHARD", 2, "bf16"},
                                           Case{"FULL_SHARD", 1, "none"},
                                           Case{"SHARD_GRAD_OP", 2, "bf16"},
                                           Case{"NO_SHARD", 1, "bf16"},
                                           Case{"HYBRID_SHARD", 2, "bf16"},
                                           Case{"HYBRID_SHARD_ZERO2", 2,
                                                "bf16"}));

// --simulate-save: the collective save's protocol runs on every rank after
// the step; the first shard group writes the state once (NO_SHARD: every
// rank, each holding all of it), at the given bandwidth.
TEST_P(SimulateAgreementTest, SaveWritesTheStateAtTheBandwidth) {
  const Case& c = GetParam();
  SimulateOptions options;
  options.save = true;
  options.save_bytes_per_second = 1e9;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      auto result,
      Simulate(Options(c.strategy, c.nodes, c.mixed_precision), options));
  const auto& [plan, simulated] = result;
  const SimulatedStrategy& s = simulated[0];
  ASSERT_TRUE(s.saved);
  const int64_t world = 4 * c.nodes;
  // Writers: the layout's world (the shard group; NO_SHARD's is the job).
  const int64_t writers =
      c.strategy == "NO_SHARD" ? world : plan.strategies[0].shard_degree;
  // Each writer holds 1/shard_degree of the parameters in float32 with
  // AdamW's two states of the same size: 12 bytes per element, plus the
  // padding, the 0-d steps, the headers and the JSON files.
  const int64_t copies = c.strategy == "NO_SHARD" ? world : 1;
  const int64_t state = 12 * plan.param_numel * copies;
  EXPECT_GE(s.save_bytes, state);
  EXPECT_LE(s.save_bytes, state + state / 1000 + writers * (1 << 20));
  EXPECT_GE(s.save_max_rank_bytes, s.save_bytes / writers);
  EXPECT_LE(s.save_max_rank_bytes, s.save_bytes / writers + (1 << 20));
  // The slowest writer's bytes at 1 GB/s, and the exchanges' microseconds.
  const double write = static_cast<double>(s.save_max_rank_bytes) / 1e9;
  EXPECT_GE(s.save_seconds, write);
  EXPECT_LE(s.save_seconds, write + 1e-3);
  EXPECT_EQ(
      s.save_host_bytes,
      s.optimizer_bytes +
          s.peak_by_category[static_cast<int>(MemoryCategory::kShardedParams)]);
}

TEST(SimulateTest, SaveIsReportedInTableAndJson) {
  PlanOptions o = Options("HYBRID_SHARD", 2);
  SimulateOptions s;
  s.save = true;
  std::ostringstream table;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(bool passed, RunSimulation(o, s, table));
  EXPECT_TRUE(passed);
  EXPECT_THAT(table.str(), HasSubstr("  checkpoint "));
  EXPECT_THAT(table.str(), HasSubstr("staged on the host per rank"));
  o.format = "json";
  std::ostringstream json;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(passed, RunSimulation(o, s, json));
  const nlohmann::json doc = nlohmann::json::parse(json.str());
  const nlohmann::json& save = doc["strategies"][0]["simulated"]["save"];
  EXPECT_GT(save["time_s"].get<double>(), 0);
  EXPECT_GT(save["bytes"].get<int64_t>(),
            save["max_rank_bytes"].get<int64_t>());
  s.save_bytes_per_second = 0;
  EXPECT_EQ(RunSimulation(o, s, json).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(SimulateTest, ConditionalUnitIsADesyncNamingTheUnitAndTheRanks) {
  SimulateOptions s;
  s.conditional_unit = "transformer.h.5:0-2";
  const absl::StatusOr<std::pair<Plan, std::vector<SimulatedStrategy>>> result =
      Simulate(Options("FULL_SHARD", 2), s);
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().code(), absl::StatusCode::kFailedPrecondition);
  const std::string message(result.status().message());
  EXPECT_THAT(message, HasSubstr("desynchronised"));
  EXPECT_THAT(message, HasSubstr("ranks 0-2: all_gather"));
  EXPECT_THAT(message, HasSubstr("transformer.h.5, forward unshard"));
  EXPECT_THAT(message, HasSubstr("ranks 3-7: all_gather"));
  EXPECT_THAT(message, HasSubstr("transformer.h.6, forward unshard"));
}

TEST(SimulateTest, RejectsABadConditionalUnit) {
  for (const char* bad : {"transformer.h.5", "nope:0", ":0",
                          "transformer.h.5:8", "transformer.h.5:3-1"}) {
    SimulateOptions s;
    s.conditional_unit = bad;
    EXPECT_EQ(Simulate(Options("FULL_SHARD", 2), s).status().code(),
              absl::StatusCode::kInvalidArgument)
        << bad;
  }
}

TEST(SimulateTest, TableAndJsonCarryTheSimulatedStep) {
  PlanOptions o = Options("FULL_SHARD", 1);
  std::ostringstream table;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(bool passed, RunSimulation(o, {}, table));
  EXPECT_TRUE(passed);
  EXPECT_THAT(table.str(), HasSubstr("simulated FULL_SHARD on 4 ranks"));
  EXPECT_THAT(table.str(), HasSubstr("no deadlock, no desync, no stream race"));
  o.format = "json";
  std::ostringstream json;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(passed, RunSimulation(o, {}, json));
  const nlohmann::json doc = nlohmann::json::parse(json.str());
  const nlohmann::json& sim = doc["strategies"][0]["simulated"];
  EXPECT_GT(sim["step_time_s"].get<double>(), 0);
  EXPECT_EQ(sim["races"].size(), 0u);
  EXPECT_EQ(sim["peak_bytes"].get<int64_t>(),
            doc["strategies"][0]["peak_bytes"].get<int64_t>());
}

}  // namespace
}  // namespace tools
}  // namespace flatparam
