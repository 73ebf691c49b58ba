#include "tools/plan.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "flatparam/base/status_matchers.h"
#include "flatparam/presets.h"
#include "sim/cost_model.h"

namespace flatparam {
namespace tools {
namespace {

using ::testing::HasSubstr;

const StrategyPlan& Find(const Plan& plan, ShardingStrategy s) {
  for (const StrategyPlan& p : plan.strategies) {
    if (p.strategy == s) return p;
  }
  ADD_FAILURE() << "no " << ShardingStrategyName(s);
  return plan.strategies.front();
}

// llama2-7b's units are divisible by every power of two up to 4096, so the
// padded shards hold exactly Psi / D elements and the accounting is the
// textbook one to the byte.
TEST(PlanTest, MixedPrecisionAdamAccountingIsExact) {
  for (int64_t nodes = 1; nodes <= 512; nodes *= 2) {
    PlanOptions o;
    o.model = "llama2-7b";
    o.nodes = nodes;
    o.mixed_precision = "bf16";
    o.optimizer = "adamw";
    FLATPARAM_ASSERT_OK_AND_ASSIGN(Plan plan, MakePlan(o));
    const int64_t psi = plan.param_numel;
    ASSERT_EQ(psi, 6'738'415'616);
    const int64_t w = nodes * 8;
    ASSERT_EQ(plan.world_size(), w);
    ASSERT_EQ(psi % w, 0);
    EXPECT_EQ(plan.bytes_per_element.params, 2);
    EXPECT_EQ(plan.bytes_per_element.grads, 2);
    EXPECT_EQ(plan.bytes_per_element.optimizer, 12);

    const StrategyPlan& full = Find(plan, ShardingStrategy::kFullShard);
    EXPECT_EQ(full.shard_degree, w);
    EXPECT_EQ(full.param_bytes, 2 * psi / w);
    EXPECT_EQ(full.grad_bytes, 2 * psi / w);
    EXPECT_EQ(full.optimizer_bytes, 12 * psi / w);
    EXPECT_EQ(full.model_state_bytes(), 16 * psi / w);

    const StrategyPlan& zero2 = Find(plan, ShardingStrategy::kShardGradOp);
    EXPECT_EQ(zero2.param_bytes, 2 * psi);
    EXPECT_EQ(zero2.grad_bytes, 2 * psi / w);
    EXPECT_EQ(zero2.optimizer_bytes, 12 * psi / w);

    const StrategyPlan& none = Find(plan, ShardingStrategy::kNoShard);
    EXPECT_EQ(none.shard_degree, 1);
    EXPECT_EQ(none.model_state_bytes(), 16 * psi);

    const StrategyPlan& hybrid = Find(plan, ShardingStrategy::kHybridShard);
    EXPECT_EQ(hybrid.shard_degree, 8);
    EXPECT_EQ(hybrid.model_state_bytes(), 16 * psi / 8);
    const StrategyPlan& hz2 = Find(plan, ShardingStrategy::kHybridShardZero2);
    EXPECT_EQ(hz2.model_state_bytes(), 2 * psi + 14 * psi / 8);

    // The timeline holds at least the model states (its float32 shards and
    // gradients total the same 16 bytes for sharded states).
    EXPECT_GE(full.prediction.peak_bytes, full.model_state_bytes());
    EXPECT_GE(none.prediction.peak_bytes, none.model_state_bytes());
  }
}

// Elsewhere padding adds less than one element per unit per rank.
TEST(PlanTest, AccountingIsTheFormulaPlusBoundedPadding) {
  for (const std::string& model : PresetNames()) {
    for (int64_t nodes : {1, 3, 7}) {
      PlanOptions o;
      o.model = model;
      o.nodes = nodes;
      o.gpus_per_node = 6;
      o.mixed_precision = "fp16";
      FLATPARAM_ASSERT_OK_AND_ASSIGN(Plan plan, MakePlan(o));
      const int64_t psi = plan.param_numel;
      const int64_t units = plan.units;
      for (const StrategyPlan& s : plan.strategies) {
        const int64_t d = s.shard_degree;
        const bool params_sharded =
            s.strategy == ShardingStrategy::kFullShard ||
            s.strategy == ShardingStrategy::kHybridShard;
        const bool states_sharded = UsesShardedStrategy(s.strategy);
        auto check = [&](const char* what, int64_t bytes, int64_t per,
                         bool sharded) {
          // sharded: D * bytes - per * Psi in [0, per * units * D);
          // replicated: bytes - per * Psi in [0, per * units * W).
          const int64_t excess =
              sharded ? d * bytes - per * psi : bytes - per * psi;
          const int64_t bound = per * units * (sharded ? d : plan.world_size());
          EXPECT_GE(excess, 0) << model << " " << what;
          EXPECT_LT(excess, bound) << model << " " << what;
        };
        check("params", s.param_bytes, 2, params_sharded);
        check("grads", s.grad_bytes, 2, states_sharded);
        check("optimizer", s.optimizer_bytes, 12, states_sharded);
      }
    }
  }
}

TEST(PlanTest, OptimizerAndPrecisionVariants) {
  PlanOptions o;
  o.model = "gpt2";  // float32
  o.strategy = "FULL_SHARD";
  FLATPARAM_ASSERT_OK_AND_ASSIGN(Plan fp32, MakePlan(o));
  EXPECT_EQ(fp32.bytes_per_element.params, 4);
  EXPECT_EQ(fp32.bytes_per_element.grads, 4);
  EXPECT_EQ(fp32.bytes_per_element.optimizer, 8);
  EXPECT_EQ(fp32.peak_flops, 495e12);  // TF32
  o.optimizer = "sgd";
  o.mixed_precision = "bf16";
  FLATPARAM_ASSERT_OK_AND_ASSIGN(Plan sgd, MakePlan(o));
  EXPECT_EQ(sgd.bytes_per_element.optimizer, 4 + 4);
  EXPECT_EQ(sgd.peak_flops, 989e12);
  o.model = "llama2-7b";  // bfloat16 without mixed precision
  o.mixed_precision = "none";
  o.optimizer = "adamw";
  FLATPARAM_ASSERT_OK_AND_ASSIGN(Plan bf16, MakePlan(o));
  EXPECT_EQ(bf16.bytes_per_element.params, 2);
  EXPECT_EQ(bf16.bytes_per_element.optimizer, 4);
}

TEST(PlanTest, HybridOnOneNodeIsFullShard) {
  PlanOptions o;
  o.model = "gpt2-medium";
  o.mixed_precision = "bf16";
  FLATPARAM_ASSERT_OK_AND_ASSIGN(Plan plan, MakePlan(o));
  const StrategyPlan& full = Find(plan, ShardingStrategy::kFullShard);
  const StrategyPlan& hybrid = Find(plan, ShardingStrategy::kHybridShard);
  EXPECT_EQ(full.model_state_bytes(), hybrid.model_state_bytes());
  EXPECT_EQ(full.prediction.peak_bytes, hybrid.prediction.peak_bytes);
  EXPECT_DOUBLE_EQ(full.prediction.step_seconds,
                   hybrid.prediction.step_seconds);
}

TEST(PlanTest, FitsFollowsGpuMemory) {
  PlanOptions o;
  o.model = "llama2-70b";
  o.nodes = 2;
  o.mixed_precision = "bf16";
  FLATPARAM_ASSERT_OK_AND_ASSIGN(Plan plan, MakePlan(o));
  EXPECT_TRUE(Find(plan, ShardingStrategy::kFullShard).fits);
  EXPECT_FALSE(Find(plan, ShardingStrategy::kNoShard).fits);
  o.gpu_memory = "1GiB";
  FLATPARAM_ASSERT_OK_AND_ASSIGN(Plan small, MakePlan(o));
  EXPECT_EQ(small.gpu_memory_bytes, int64_t{1} << 30);
  for (const StrategyPlan& s : small.strategies) EXPECT_FALSE(s.fits);
}

// Every preset, 1..512 nodes, every strategy: runs, quickly, and the
// model states per rank never grow with the node count for the strategies
// that shard over all ranks.
TEST(PlanTest, SweepEveryPresetUpTo512Nodes) {
  const auto begin = std::chrono::steady_clock::now();
  for (const std::string& model : PresetNames()) {
    for (const char* mp : {"none", "bf16"}) {
      std::vector<int64_t> previous(5, INT64_MAX);
      for (int64_t nodes = 1; nodes <= 512; nodes *= 2) {
        PlanOptions o;
        o.model = model;
        o.nodes = nodes;
        o.mixed_precision = mp;
        FLATPARAM_ASSERT_OK_AND_ASSIGN(Plan plan, MakePlan(o));
        ASSERT_EQ(plan.strategies.size(), 5u);
        for (size_t i = 0; i < plan.strategies.size(); ++i) {
          const StrategyPlan& s = plan.strategies[i];
          const cost::StepPrediction& p = s.prediction;
          EXPECT_GT(p.step_seconds, 0) << model;
          EXPECT_GE(p.exposed_comm_seconds, 0) << model;
          EXPECT_NEAR(p.step_seconds,
                      p.compute_seconds + p.exposed_comm_seconds,
                      1e-9 * p.step_seconds);
          EXPECT_GT(p.peak_bytes, 0);
          if (s.strategy == ShardingStrategy::kFullShard ||
              s.strategy == ShardingStrategy::kShardGradOp) {
            EXPECT_LE(s.model_state_bytes(), previous[i])
                << model << " " << nodes << " nodes";
          }
          previous[i] = s.model_state_bytes();
        }
      }
    }
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - begin)
          .count();
  EXPECT_LT(seconds, 30) << "the sweep should take seconds";
}

TEST(PlanTest, JsonSchema) {
  PlanOptions o;
  o.model = "llama3-8b";
  o.nodes = 4;
  o.mixed_precision = "bf16";
  FLATPARAM_ASSERT_OK_AND_ASSIGN(Plan plan, MakePlan(o));
  const nlohmann::json doc = PlanJson(plan);
  EXPECT_EQ(doc["world_size"], 32);
  ASSERT_EQ(doc["strategies"].size(), 5u);
  for (const nlohmann::json& s : doc["strategies"]) {
    EXPECT_TRUE(s["strategy"].is_string());
    for (const char* k : {"params", "grads", "optimizer", "model_states"}) {
      EXPECT_TRUE(s["bytes_per_rank"][k].is_number_integer()) << k;
    }
    EXPECT_EQ(s["bytes_per_rank"]["model_states"].get<int64_t>(),
              s["bytes_per_rank"]["params"].get<int64_t>() +
                  s["bytes_per_rank"]["grads"].get<int64_t>() +
                  s["bytes_per_rank"]["optimizer"].get<int64_t>());
    EXPECT_TRUE(s["peak_bytes"].is_number_integer());
    EXPECT_TRUE(s["comm_bytes_per_step"].is_number_integer());
    EXPECT_TRUE(s["step_time_s"].is_number());
    EXPECT_TRUE(s["exposed_comm_s"].is_number());
    EXPECT_TRUE(s["fits"].is_boolean());
  }
}

TEST(PlanTest, TableAndTrace) {
  PlanOptions o;
  o.model = "gpt2";
  o.nodes = 2;
  o.trace_path = ::testing::TempDir() + "/plan_trace.json";
  std::ostringstream out;
  FLATPARAM_ASSERT_OK(RunPlan(o, out));
  EXPECT_THAT(out.str(), HasSubstr("FULL_SHARD"));
  EXPECT_THAT(out.str(), HasSubstr("HYBRID_SHARD_ZERO2"));
  EXPECT_THAT(out.str(), HasSubstr("2 nodes x 8 GPUs = 16 ranks"));
  std::ifstream in(o.trace_path);
  const nlohmann::json trace = nlohmann::json::parse(in);
  EXPECT_GT(trace["traceEvents"].size(), 100u);
}

TEST(PlanTest, ModelFile) {
  PlanOptions o;
  o.model = "tools/testdata/tiny_model.json";
  o.nodes = 2;
  o.gpus_per_node = 2;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(Plan plan, MakePlan(o));
  EXPECT_EQ(plan.units, 3);
  EXPECT_EQ(plan.world_size(), 4);
}

TEST(PlanTest, BadOptionsNameTheFlag) {
  struct Case {
    void (*mutate)(PlanOptions&);
    const char* message;
  };
  const Case cases[] = {
      {[](PlanOptions& o) { o.model = ""; }, "--model"},
      {[](PlanOptions& o) { o.nodes = 0; }, "--nodes"},
      {[](PlanOptions& o) { o.gpus_per_node = -1; }, "--gpus-per-node"},
      {[](PlanOptions& o) { o.strategy = "ZERO9"; }, "ZERO9"},
      {[](PlanOptions& o) { o.mixed_precision = "fp8"; }, "fp8"},
      {[](PlanOptions& o) { o.optimizer = "lion"; }, "lion"},
      {[](PlanOptions& o) { o.tokens_per_gpu = 0; }, "--tokens-per-gpu"},
      {[](PlanOptions& o) { o.topology = "nvl72"; }, "nvl72"},
      {[](PlanOptions& o) { o.inter_gbps = -1; }, "--inter-bandwidth"},
      {[](PlanOptions& o) { o.efficiency = 2; }, "--efficiency"},
      {[](PlanOptions& o) { o.gpu_memory = "lots"; }, "lots"},
      {[](PlanOptions& o) { o.format = "xml"; }, "xml"},
      {[](PlanOptions& o) {
         o.nodes = 65536;
         o.gpus_per_node = 64;
       },
       "ranks"},
  };
  for (const Case& c : cases) {
    PlanOptions o;
    o.model = "gpt2";
    c.mutate(o);
    EXPECT_THAT(
        ValidatePlanOptions(o),
        StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(c.message)));
  }
}

TEST(ParseByteSizeTest, UnitsAndErrors) {
  EXPECT_EQ(ParseByteSize("80GiB").value_or(-1), int64_t{80} << 30);
  EXPECT_EQ(ParseByteSize("80 gb").value_or(-1), 80'000'000'000);
  EXPECT_EQ(ParseByteSize("1.5KiB").value_or(-1), 1536);
  EXPECT_EQ(ParseByteSize("1024").value_or(-1), 1024);
  EXPECT_EQ(ParseByteSize("12B").value_or(-1), 12);
  for (const char* bad : {"", "GiB", "-1GB", "0", "ten", "1e30TB"}) {
    EXPECT_THAT(ParseByteSize(bad),
                StatusIs(absl::StatusCode::kInvalidArgument))
        << bad;
  }
}

}  // namespace
}  // namespace tools
}  // namespace flatparam
