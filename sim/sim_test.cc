// Collective semantics, virtual time, determinism and the Chrome trace of
// the simulator. Failure behaviour is in sim_failure_test.cc.
#include "sim/sim.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "comm/communicator.h"
#include "comm/host_reduce.h"
#include "flatparam/base/dtype.h"
#include "flatparam/base/status_matchers.h"
#include "nlohmann/json.hpp"
#include "sim/internal/sim_testutil.h"

namespace flatparam {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;
using ::testing::IsNull;
using ::testing::NotNull;

using internal_sim::TestOptions;

std::unique_ptr<SimWorld> MakeWorld(int n, uint64_t seed = 1) {
  SimOptions options = TestOptions();
  options.world_size = n;
  options.seed = seed;
  auto world = SimWorld::Create(options);
  EXPECT_TRUE(world.ok()) << world.status();
  return std::move(world).value();
}

std::unique_ptr<SimWorld> MakeWorld(SimOptions options) {
  auto world = SimWorld::Create(options);
  EXPECT_TRUE(world.ok()) << world.status();
  return std::move(world).value();
}

BufferRef Ref(std::vector<float>& v) {
  return {v.data(), static_cast<int64_t>(v.size()), DType::kFloat32};
}
ConstBufferRef CRef(const std::vector<float>& v) {
  return {v.data(), static_cast<int64_t>(v.size()), DType::kFloat32};
}

// ---------------------------------------------------------------------------
// Collective semantics.

TEST(SimCollectiveTest, AllGatherPlacesRankIAtOffsetICount) {
  constexpr int kWorld = 4, kCount = 3;
  std::vector<std::vector<float>> out(kWorld);
  auto world = MakeWorld(kWorld);
  FLATPARAM_ASSERT_OK(world->Run([&](Communicator& comm) -> absl::Status {
    EXPECT_EQ(comm.backend(), "sim");
    EXPECT_EQ(comm.size(), kWorld);
    const int r = comm.rank();
    std::vector<float> in = {r * 10.0f, r * 10.0f + 1, r * 10.0f + 2};
    out[r].assign(kWorld * kCount, -1);
    return comm.AllGather(CRef(in), Ref(out[r]), {})->Wait();
  }));
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_THAT(out[r],
                ElementsAre(0, 1, 2, 10, 11, 12, 20, 21, 22, 30, 31, 32));
  }
}

TEST(SimCollectiveTest, AllGatherInPlace) {
  constexpr int kWorld = 3, kCount = 2;
  std::vector<std::vector<float>> buf(kWorld);
  auto world = MakeWorld(kWorld);
  FLATPARAM_ASSERT_OK(world->Run([&](Communicator& comm) -> absl::Status {
    const int r = comm.rank();
    buf[r].assign(kWorld * kCount, -1);
    BufferRef out = Ref(buf[r]);
    BufferRef mine = out.Slice(r * kCount, kCount);
    static_cast<float*>(mine.data)[0] = r + 0.5f;
    static_cast<float*>(mine.data)[1] = r + 0.25f;
    return comm.AllGather(mine, out, {})->Wait();
  }));
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_THAT(buf[r], ElementsAre(0.5f, 0.25f, 1.5f, 1.25f, 2.5f, 2.25f));
  }
}

TEST(SimCollectiveTest, AllGatherCopiesBytesOfEveryDtype) {
  for (DType dtype : {DType::kFloat64, DType::kFloat16, DType::kBFloat16}) {
    constexpr int kWorld = 2, kCount = 5;
    const size_t elem = DTypeSize(dtype);
    std::vector<std::vector<uint8_t>> out(kWorld);
    auto world = MakeWorld(kWorld);
    FLATPARAM_ASSERT_OK(world->Run([&](Communicator& comm) -> absl::Status {
      const int r = comm.rank();
      std::vector<uint8_t> in(kCount * elem);
      for (size_t i = 0; i < in.size(); ++i) in[i] = r * 100 + i;
      out[r].assign(kWorld * kCount * elem, 0);
      return comm
          .AllGather({in.data(), kCount, dtype},
                     {out[r].data(), kWorld * kCount, dtype}, {})
          ->Wait();
    }));
    for (int r = 0; r < kWorld; ++r) {
      for (size_t i = 0; i < out[r].size(); ++i) {
        const size_t src = i / (kCount * elem);
        ASSERT_EQ(out[r][i], src * 100 + i % (kCount * elem))
            << DTypeName(dtype) << " rank " << r << " byte " << i;
      }
    }
  }
}

TEST(SimCollectiveTest, ReduceScatterSumGivesRankIChunkI) {
  constexpr int kWorld = 4, kCount = 2;
  std::vector<std::vector<float>> out(kWorld);
  auto world = MakeWorld(kWorld);
  FLATPARAM_ASSERT_OK(world->Run([&](Communicator& comm) -> absl::Status {
    const int r = comm.rank();
    std::vector<float> in(kWorld * kCount);
    for (int i = 0; i < kWorld * kCount; ++i) in[i] = (r + 1) * 100 + i;
    out[r].assign(kCount, -1);
    return comm.ReduceScatter(CRef(in), Ref(out[r]), {})->Wait();
  }));
  // Element i summed over ranks: (1+2+3+4)*100 + 4*i.
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_THAT(out[r], ElementsAre(1000 + 4 * (2 * r), 1000 + 4 * (2 * r + 1)))
        << r;
  }
}

TEST(SimCollectiveTest, ReduceScatterAvgWithPreAndPostDivide) {
  constexpr int kWorld = 4;
  std::vector<std::vector<float>> out(kWorld);
  ReduceOptions options;
  options.op = ReduceOp::kAvg;
  options.pre_divide_factor = 2;
  options.post_divide_factor = 0.5;
  auto world = MakeWorld(kWorld);
  FLATPARAM_ASSERT_OK(world->Run([&](Communicator& comm) -> absl::Status {
    const int r = comm.rank();
    std::vector<float> in(kWorld, 8.0f * (r + 1));
    out[r].assign(1, -1);
    return comm.ReduceScatter(CRef(in), Ref(out[r]), options)->Wait();
  }));
  // pre: 4, 8, 12, 16 -> sum 40 -> avg 10 -> post 20.
  for (int r = 0; r < kWorld; ++r) EXPECT_THAT(out[r], ElementsAre(20.0f));
}

TEST(SimCollectiveTest, ReduceScatterInPlaceMaxAndMin) {
  constexpr int kWorld = 3, kCount = 2;
  for (ReduceOp op : {ReduceOp::kMax, ReduceOp::kMin}) {
    std::vector<std::vector<float>> buf(kWorld);
    ReduceOptions options;
    options.op = op;
    auto world = MakeWorld(kWorld);
    FLATPARAM_ASSERT_OK(world->Run([&](Communicator& comm) -> absl::Status {
      const int r = comm.rank();
      buf[r].resize(kWorld * kCount);
      // Rank r holds r in even and -r in odd positions.
      for (int i = 0; i < kWorld * kCount; ++i) buf[r][i] = i % 2 ? -r : r;
      BufferRef in = Ref(buf[r]);
      return comm.ReduceScatter(in, in.Slice(r * kCount, kCount), options)
          ->Wait();
    }));
    const float even = op == ReduceOp::kMax ? 2 : 0;
    const float odd = op == ReduceOp::kMax ? 0 : -2;
    for (int r = 0; r < kWorld; ++r) {
      EXPECT_EQ(buf[r][r * kCount], even) << ReduceOpName(op) << " rank " << r;
      EXPECT_EQ(buf[r][r * kCount + 1], odd) << ReduceOpName(op);
    }
  }
}

TEST(SimCollectiveTest, AllReduceFoldsInRankOrder) {
  // In float32, (1e8 + 1) rounds back to 1e8, so the rank-order fold
  // ((1e8 + 1) + -1e8) + 1 gives 1, while other orders give 0 or 2.
  const float inputs[4] = {1e8f, 1.0f, -1e8f, 1.0f};
  std::vector<std::vector<float>> out(4);
  for (uint64_t seed : {1, 2, 3}) {
    auto world = MakeWorld(4, seed);
    FLATPARAM_ASSERT_OK(world->Run([&](Communicator& comm) -> absl::Status {
      const int r = comm.rank();
      std::vector<float> in = {inputs[r]};
      out[r].assign(1, -1);
      return comm.AllReduce(CRef(in), Ref(out[r]), {})->Wait();
    }));
    for (int r = 0; r < 4; ++r) EXPECT_THAT(out[r], ElementsAre(1.0f));
  }
}

TEST(SimCollectiveTest, AllReduceMatchesHostReduceForHalfPrecision) {
  constexpr int kWorld = 5, kCount = 64;
  for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
    std::vector<std::vector<uint16_t>> in(kWorld), out(kWorld);
    for (int r = 0; r < kWorld; ++r) {
      in[r].resize(kCount);
      for (int i = 0; i < kCount; ++i) {
        StoreFromDouble(in[r].data(), dtype, i, std::sin(r * 7 + i) * 3);
      }
    }
    ReduceOptions options;
    options.op = ReduceOp::kAvg;
    options.pre_divide_factor = 3;
    auto world = MakeWorld(kWorld);
    FLATPARAM_ASSERT_OK(world->Run([&](Communicator& comm) -> absl::Status {
      const int r = comm.rank();
      out[r] = in[r];  // in place
      BufferRef buf{out[r].data(), kCount, dtype};
      return comm.AllReduce(buf, buf, options)->Wait();
    }));
    std::vector<const void*> ptrs;
    for (auto& v : in) ptrs.push_back(v.data());
    std::vector<uint16_t> want(kCount);
    HostReduce(ptrs, want.data(), kCount, dtype, options, kWorld);
    for (int r = 0; r < kWorld; ++r) {
      EXPECT_EQ(out[r], want) << DTypeName(dtype) << " rank " << r;
    }
  }
}

TEST(SimCollectiveTest, BroadcastCopiesTheRootsBuffer) {
  constexpr int kWorld = 4;
  std::vector<std::vector<float>> buf(kWorld);
  auto world = MakeWorld(kWorld);
  FLATPARAM_ASSERT_OK(world->Run([&](Communicator& comm) -> absl::Status {
    const int r = comm.rank();
    buf[r].assign(3, static_cast<float>(r));
    BroadcastOptions options;
    options.root = 2;
    return comm.Broadcast(Ref(buf[r]), options)->Wait();
  }));
  for (int r = 0; r < kWorld; ++r) EXPECT_THAT(buf[r], ElementsAre(2, 2, 2));
}

TEST(SimCollectiveTest, AllGatherBytesReturnsEveryRanksStringInRankOrder) {
  constexpr int kWorld = 4;
  std::vector<std::vector<std::string>> got(kWorld);
  auto world = MakeWorld(kWorld);
  FLATPARAM_ASSERT_OK(world->Run([&](Communicator& comm) -> absl::Status {
    const int r = comm.rank();
    // Variable lengths, one empty, embedded NULs.
    std::string mine(r, static_cast<char>('a' + r));
    if (r == 3) mine = std::string("x\0y", 3);
    FLATPARAM_ASSIGN_OR_RETURN(got[r], comm.AllGatherBytes(mine, {}));
    return absl::OkStatus();
  }));
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_THAT(got[r], ElementsAre("", "b", "cc", std::string("x\0y", 3)));
  }
}

TEST(SimCollectiveTest, AsyncCollectivesMayBeWaitedOnInAnyOrder) {
  constexpr int kWorld = 3;
  std::vector<std::vector<float>> out(kWorld);
  auto world = MakeWorld(kWorld, 7);
  FLATPARAM_ASSERT_OK(world->Run([&](Communicator& comm) -> absl::Status {
    const int r = comm.rank();
    std::vector<float> a = {1.0f * r}, b = {10.0f * r}, c = {100.0f * r};
    out[r].assign(3 * kWorld, 0);
    BufferRef o = Ref(out[r]);
    auto wa = comm.AllGather(CRef(a), o.Slice(0, kWorld), {});
    auto wb = comm.AllGather(CRef(b), o.Slice(kWorld, kWorld), {});
    auto wc = comm.AllReduce(CRef(c), o.Slice(2 * kWorld, 1), {});
    FLATPARAM_RETURN_IF_ERROR(wc->Wait());
    FLATPARAM_RETURN_IF_ERROR(wa->Wait());
    FLATPARAM_RETURN_IF_ERROR(wb->Wait());
    // A second Wait returns the same status at once.
    return wb->Wait();
  }));
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_THAT(out[r], ElementsAre(0, 1, 2, 0, 10, 20, 300, 0, 0));
  }
}

TEST(SimCollectiveTest, ZeroCountCollectivesSucceed) {
  auto world = MakeWorld(3);
  FLATPARAM_ASSERT_OK(world->Run([&](Communicator& comm) -> absl::Status {
    BufferRef empty{nullptr, 0, DType::kFloat32};
    FLATPARAM_RETURN_IF_ERROR(comm.AllGather(empty, empty, {})->Wait());
    FLATPARAM_RETURN_IF_ERROR(comm.ReduceScatter(empty, empty, {})->Wait());
    FLATPARAM_RETURN_IF_ERROR(comm.AllReduce(empty, empty, {})->Wait());
    return comm.Broadcast(empty, {})->Wait();
  }));
}

TEST(SimCollectiveTest, SplitOrdersByKeyThenRankAndSkipsNegativeColors) {
  constexpr int kWorld = 6;
  struct Seen {
    bool null = false;
    int rank = -1, size = -1, group = -1;
    std::vector<float> gathered;
  };
  std::vector<Seen> seen(kWorld);
  auto world = MakeWorld(kWorld);
  FLATPARAM_ASSERT_OK(world->Run([&](SimCommunicator& comm) -> absl::Status {
    const int r = comm.rank();
    // Colors: 0 1 0 1 -1 0. Keys reverse the order inside color 0 and tie
    // inside color 1 (ties keep the old rank order).
    const int colors[kWorld] = {0, 1, 0, 1, -1, 0};
    const int keys[kWorld] = {9, 5, 8, 5, 0, 7};
    FLATPARAM_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> sub,
                               comm.Split(colors[r], keys[r], {}));
    if (sub == nullptr) {
      seen[r].null = true;
      return absl::OkStatus();
    }
    seen[r].rank = sub->rank();
    seen[r].size = sub->size();
    seen[r].group = static_cast<SimCommunicator&>(*sub).group_id();
    EXPECT_EQ(static_cast<SimCommunicator&>(*sub).world_rank(), r);
    std::vector<float> in = {static_cast<float>(r)};
    seen[r].gathered.assign(sub->size(), -1);
    return sub->AllGather(CRef(in), Ref(seen[r].gathered), {})->Wait();
  }));
  EXPECT_TRUE(seen[4].null);
  // Color 0: ranks 5 (key 7), 2 (key 8), 0 (key 9): group 1.
  EXPECT_EQ(seen[5].rank, 0);
  EXPECT_EQ(seen[2].rank, 1);
  EXPECT_EQ(seen[0].rank, 2);
  for (int r : {0, 2, 5}) {
    EXPECT_EQ(seen[r].size, 3);
    EXPECT_EQ(seen[r].group, 1);
    EXPECT_THAT(seen[r].gathered, ElementsAre(5, 2, 0));
  }
  // Color 1: ranks 1 and 3 tie on key 5: old order. Group 2.
  EXPECT_EQ(seen[1].rank, 0);
  EXPECT_EQ(seen[3].rank, 1);
  for (int r : {1, 3}) {
    EXPECT_EQ(seen[r].group, 2);
    EXPECT_THAT(seen[r].gathered, ElementsAre(1, 3));
  }
}

TEST(SimCollectiveTest, HybridGroupsShardAndReplicate) {
  // 8 ranks as 2 nodes of 4: reduce-scatter inside a node, then all-reduce
  // of the shard across nodes, as HYBRID_SHARD does for gradients.
  constexpr int kWorld = 8, kNode = 4;
  std::vector<std::vector<float>> shard(kWorld);
  std::vector<int> shard_ranks(kWorld), replicate_ranks(kWorld);
  auto world = MakeWorld(kWorld, 3);
  FLATPARAM_ASSERT_OK(world->Run([&](Communicator& comm) -> absl::Status {
    const int r = comm.rank();
    FLATPARAM_ASSIGN_OR_RETURN(HybridGroups groups,
                               MakeHybridGroups(comm, kNode));
    EXPECT_THAT(groups.shard, NotNull());
    EXPECT_THAT(groups.replicate, NotNull());
    EXPECT_EQ(groups.shard->size(), kNode);
    EXPECT_EQ(groups.replicate->size(), kWorld / kNode);
    shard_ranks[r] = groups.shard->rank();
    replicate_ranks[r] = groups.replicate->rank();
    std::vector<float> grad(kNode * 2);
    for (int i = 0; i < kNode * 2; ++i) grad[i] = r * 1000 + i;
    shard[r].assign(2, -1);
    FLATPARAM_RETURN_IF_ERROR(
        groups.shard->ReduceScatter(CRef(grad), Ref(shard[r]), {})->Wait());
    return groups.replicate->AllReduce(Ref(shard[r]), Ref(shard[r]), {})
        ->Wait();
  }));
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_EQ(shard_ranks[r], r % kNode);
    EXPECT_EQ(replicate_ranks[r], r / kNode);
    // Element i of the shard at local rank l sums r*1000 + 2l + i over all
    // 8 ranks: 28000 + 8 * (2l + i).
    const int l = r % kNode;
    EXPECT_THAT(shard[r],
                ElementsAre(28000 + 8 * (2 * l), 28000 + 8 * (2 * l + 1)))
        << r;
  }
}

TEST(SimCollectiveTest, SubgroupsHaveTheirOwnSequenceNumbers) {
  auto world = MakeWorld(4);
  FLATPARAM_ASSERT_OK(world->Run([&](Communicator& comm) -> absl::Status {
    FLATPARAM_ASSIGN_OR_RETURN(auto sub, comm.Split(comm.rank() % 2, 0, {}));
    // Even ranks use their subgroup twice, odd ranks once: no desync, since
    // each group numbers its own operations.
    const int uses = comm.rank() % 2 == 0 ? 2 : 1;
    for (int i = 0; i < uses; ++i) {
      FLATPARAM_RETURN_IF_ERROR(sub->Barrier({}));
    }
    return comm.Barrier({});
  }));
  for (const TraceEvent& e : world->trace()) {
    if (e.name == "barrier" && e.group != 0) {
      EXPECT_LT(e.seq, e.rank % 2 == 0 ? 2 : 1);
    }
  }
}

// ---------------------------------------------------------------------------
// Virtual time.

TEST(SimClockTest, CollectiveCostsLatencyPlusBusBytesOverBandwidth) {
  SimOptions options = TestOptions();
  options.world_size = 4;
  options.cost.latency = absl::Milliseconds(1);
  options.cost.bytes_per_second = 1e9;
  auto world = MakeWorld(options);
  constexpr int64_t kCount = 250000;  // 1 MB of float32
  std::vector<absl::Duration> after(4);
  FLATPARAM_ASSERT_OK(world->Run([&](SimCommunicator& comm) -> absl::Status {
    std::vector<float> buf(kCount, 1);
    FLATPARAM_RETURN_IF_ERROR(comm.AllReduce(Ref(buf), Ref(buf), {})->Wait());
    after[comm.rank()] = comm.Now();
    return absl::OkStatus();
  }));
  // 1 ms + 1e6 bytes * 2 * 3/4 / 1e9 B/s = 2.5 ms.
  for (absl::Duration t : after) EXPECT_EQ(t, absl::Microseconds(2500));
  ASSERT_EQ(world->trace().size(), 4);
  for (const TraceEvent& e : world->trace()) {
    EXPECT_EQ(e.name, "all_reduce");
    EXPECT_EQ(e.bytes, 1000000);
    EXPECT_EQ(e.start, absl::ZeroDuration());
    EXPECT_EQ(e.end, absl::Microseconds(2500));
    EXPECT_THAT(e.status, IsOk());
  }
}

TEST(SimClockTest, SlowRanksDelayTheirPeersAndWaitAdvancesClocks) {
  SimOptions options = TestOptions();
  options.world_size = 3;
  options.cost.latency = absl::Microseconds(10);
  options.cost.compute_per_op = absl::Microseconds(1);
  auto world = MakeWorld(options);
  std::vector<absl::Duration> issued(3), after(3);
  FLATPARAM_ASSERT_OK(world->Run([&](SimCommunicator& comm) -> absl::Status {
    const int r = comm.rank();
    FLATPARAM_RETURN_IF_ERROR(comm.Compute(absl::Milliseconds(r)));
    FLATPARAM_RETURN_IF_ERROR(comm.Barrier({}));
    after[r] = comm.Now();
    return absl::OkStatus();
  }));
  // The barrier starts when rank 2 arrives (2 ms + 1 us compute per op).
  for (absl::Duration t : after) {
    EXPECT_EQ(t, absl::Milliseconds(2) + absl::Microseconds(11));
  }
  EXPECT_EQ(world->clocks(), after);
  for (const TraceEvent& e : world->trace()) {
    EXPECT_EQ(e.arrive, absl::Milliseconds(e.rank) + absl::Microseconds(1));
    EXPECT_EQ(e.start, absl::Milliseconds(2) + absl::Microseconds(1));
  }
}

TEST(SimClockTest, AsyncCollectivesOverlapComputeButShareOneStream) {
  SimOptions options = TestOptions();
  options.world_size = 2;
  options.cost.latency = absl::Milliseconds(1);
  auto world = MakeWorld(options);
  absl::Duration after_compute, after_wait;
  FLATPARAM_ASSERT_OK(world->Run([&](SimCommunicator& comm) -> absl::Status {
    std::vector<float> a(1), b(1);
    auto w1 = comm.AllReduce(Ref(a), Ref(a), {});
    auto w2 = comm.AllReduce(Ref(b), Ref(b), {});
    FLATPARAM_RETURN_IF_ERROR(comm.Compute(absl::Microseconds(500)));
    FLATPARAM_RETURN_IF_ERROR(w1->Wait());
    if (comm.rank() == 0) after_compute = comm.Now();
    FLATPARAM_RETURN_IF_ERROR(w2->Wait());
    if (comm.rank() == 0) after_wait = comm.Now();
    return absl::OkStatus();
  }));
  // Op 1 runs over [0, 1ms] while the rank computes; op 2 follows on the
  // same stream over [1ms, 2ms].
  EXPECT_EQ(after_compute, absl::Milliseconds(1));
  EXPECT_EQ(after_wait, absl::Milliseconds(2));
}

// Two groups over the same two ranks (the world and a split copy of it);
// rank 0 issues A (world) then B (copy), rank 1 issues B then A. Without
// one_stream_per_rank each operation runs when both members issued it;
// with it, as on NCCL's one stream, they wait for each other's older
// operation and the deadlock is reported.
TEST(SimClockTest, OneStreamPerRankRunsEachRanksCollectivesInIssueOrder) {
  for (bool one_stream : {false, true}) {
    SimOptions options = TestOptions();
    options.world_size = 2;
    options.one_stream_per_rank = one_stream;
    auto world = MakeWorld(options);
    std::vector<absl::Status> statuses(2);
    const absl::Status run =
        world->Run([&](SimCommunicator& comm) -> absl::Status {
          FLATPARAM_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> copy,
                                     comm.Split(0, comm.rank(), {}));
          std::vector<float> a(1), b(1);
          Communicator* first = comm.rank() == 0 ? &comm : copy.get();
          Communicator* second = comm.rank() == 0 ? copy.get() : &comm;
          auto w1 = first->AllReduce(Ref(a), Ref(a), {});
          auto w2 = second->AllReduce(Ref(b), Ref(b), {});
          absl::Status s1 = w1->Wait();
          absl::Status s2 = w2->Wait();
          statuses[comm.rank()] = s1.ok() ? s2 : s1;
          return statuses[comm.rank()];
        });
    if (!one_stream) {
      EXPECT_THAT(run, IsOk());
    } else {
      EXPECT_THAT(run,
                  StatusIs(absl::StatusCode::kInternal, HasSubstr("deadlock")));
    }
  }
}

// With one_stream_per_rank a rank's collectives of different groups start
// in its issue order. Groups P = {0, 1} and Q = {0, 2} (splits, 1 ms each,
// so everything below starts at 2 ms); rank 0 issues P then Q, rank 1
// computes 5 ms before its P, rank 2 issues Q at once. With the option, Q
// waits for rank 0's older P ([7, 8] ms): [8, 9] ms, whatever the
// interleaving. Without it, rank 0's stream serves Q and P in the order
// their last members happened to issue them: Q at [2, 3] ms under some
// interleavings.
TEST(SimClockTest, OneStreamPerRankOrdersTheVirtualClockByIssue) {
  int early = 0;
  for (uint64_t seed = 0; seed < 16; ++seed) {
    for (bool one_stream : {false, true}) {
      SimOptions options = TestOptions();
      options.world_size = 3;
      options.seed = seed;
      options.one_stream_per_rank = one_stream;
      options.cost.latency = absl::Milliseconds(1);
      options.cost.bytes_per_second = 1e18;
      auto world = MakeWorld(options);
      std::vector<absl::Duration> ends(3);
      FLATPARAM_ASSERT_OK(
          world->Run([&](SimCommunicator& comm) -> absl::Status {
            const int r = comm.rank();
            FLATPARAM_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> p,
                                       comm.Split(r == 2 ? -1 : 0, r, {}));
            FLATPARAM_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> q,
                                       comm.Split(r == 1 ? -1 : 0, r, {}));
            std::vector<float> a(1), b(1);
            std::unique_ptr<Work> wp, wq;
            if (r == 1)
              FLATPARAM_RETURN_IF_ERROR(comm.Compute(absl::Milliseconds(5)));
            if (r != 2) wp = p->AllReduce(Ref(a), Ref(a), {});
            if (r != 1) wq = q->AllReduce(Ref(b), Ref(b), {});
            if (wq != nullptr) FLATPARAM_RETURN_IF_ERROR(wq->Wait());
            if (wp != nullptr) FLATPARAM_RETURN_IF_ERROR(wp->Wait());
            ends[r] = comm.Now();
            return absl::OkStatus();
          }));
      EXPECT_EQ(ends[1], absl::Milliseconds(8)) << one_stream;
      if (one_stream) {
        EXPECT_EQ(ends[2], absl::Milliseconds(9)) << seed;
        EXPECT_EQ(ends[0], absl::Milliseconds(9)) << seed;
      } else {
        early += ends[2] == absl::Milliseconds(3);
      }
    }
  }
  EXPECT_GT(early, 0) << "no interleaving ran Q before P";
}

TEST(SimClockTest, CollectiveTimeCanBePluggedIn) {
  SimOptions options = TestOptions();
  options.world_size = 4;
  std::vector<std::pair<CollectiveOp, int64_t>> priced;
  options.cost.collective_time = [&](CollectiveOp op, int64_t bytes,
                                     const std::vector<int>& ranks) {
    priced.emplace_back(op, bytes);
    return absl::Microseconds(7 * static_cast<int64_t>(ranks.size()));
  };
  auto world = MakeWorld(options);
  std::vector<absl::Duration> ends(4);
  FLATPARAM_ASSERT_OK(world->Run([&](SimCommunicator& comm) -> absl::Status {
    std::vector<float> in(2), out(8);
    FLATPARAM_RETURN_IF_ERROR(comm.AllGather(CRef(in), Ref(out), {})->Wait());
    ends[comm.rank()] = comm.Now();
    return absl::OkStatus();
  }));
  for (int r = 0; r < 4; ++r) EXPECT_EQ(ends[r], absl::Microseconds(28));
  ASSERT_EQ(priced.size(), 1u);
  EXPECT_EQ(priced[0].first, CollectiveOp::kAllGather);
  EXPECT_EQ(priced[0].second, 32);  // the output: 8 floats
}

TEST(SimClockTest, ComputeRejectsNegativeDurations) {
  auto world = MakeWorld(1);
  FLATPARAM_ASSERT_OK(world->Run([&](SimCommunicator& comm) -> absl::Status {
    EXPECT_THAT(comm.Compute(absl::Seconds(-1)),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("rank 0: Compute(-1s)")));
    EXPECT_THAT(comm.Compute(absl::InfiniteDuration()),
                StatusIs(absl::StatusCode::kInvalidArgument));
    return absl::OkStatus();
  }));
}

// ---------------------------------------------------------------------------
// Scheduling and determinism.

// A program whose ranks append to a shared log between yields: the log
// records the interleaving, the outputs must not depend on it.
struct Observed {
  std::vector<int> schedule;
  std::vector<int> log;
  std::vector<std::vector<float>> out;
  std::string json;
  std::string slices;  // the JSON's "X" events: the timeline
};

Observed RunProgram(uint64_t seed, bool single_cpu = true,
                    SimOptions options = TestOptions()) {
  constexpr int kWorld = 4;
  Observed o;
  o.out.resize(kWorld);
  options.world_size = kWorld;
  options.seed = seed;
  options.single_cpu = single_cpu;
  auto world = MakeWorld(options);
  absl::Status status = world->Run([&](SimCommunicator& comm) -> absl::Status {
    const int r = comm.rank();
    std::vector<float> x(8);
    for (int i = 0; i < 8; ++i) x[i] = 0.1f * (r + 1) + i;
    for (int step = 0; step < 5; ++step) {
      o.log.push_back(r);
      comm.Yield();
      o.log.push_back(r);
      FLATPARAM_RETURN_IF_ERROR(comm.AllReduce(Ref(x), Ref(x), {})->Wait());
      std::vector<float> g(32);
      FLATPARAM_RETURN_IF_ERROR(comm.AllGather(Ref(x), Ref(g), {})->Wait());
      FLATPARAM_RETURN_IF_ERROR(comm.ReduceScatter(Ref(g), Ref(x), {})->Wait());
    }
    o.out[r] = x;
    return absl::OkStatus();
  });
  EXPECT_THAT(status, IsOk());
  o.schedule = world->schedule();
  o.json = world->ChromeTraceJson();
  nlohmann::json slices = nlohmann::json::array();
  const nlohmann::json doc = nlohmann::json::parse(o.json);
  for (const nlohmann::json& e : doc["traceEvents"]) {
    if (e["ph"] == "X") slices.push_back(e);
  }
  o.slices = slices.dump();
  return o;
}

TEST(SimDeterminismTest, SameSeedSameInterleavingBytesAndTrace) {
  const Observed a = RunProgram(42);
  const Observed b = RunProgram(42);
  EXPECT_EQ(a.schedule, b.schedule);
  EXPECT_EQ(a.log, b.log);
  EXPECT_EQ(a.out, b.out);
  EXPECT_TRUE(a.json == b.json);
}

TEST(SimDeterminismTest, PinningRanksToOneCpuChangesNothingObservable) {
  const Observed a = RunProgram(42, /*single_cpu=*/true);
  const Observed b = RunProgram(42, /*single_cpu=*/false);
  EXPECT_EQ(a.schedule, b.schedule);
  EXPECT_EQ(a.log, b.log);
  EXPECT_EQ(a.out, b.out);
  EXPECT_TRUE(a.json == b.json);
}

TEST(SimDeterminismTest, FibersAndThreadsGiveTheSameScheduleBytesAndTrace) {
  SimOptions threads;
  SimOptions fibers;
  fibers.execution = SimOptions::Execution::kFibers;
  for (uint64_t seed : {3, 42}) {
    const Observed a = RunProgram(seed, true, threads);
    const Observed b = RunProgram(seed, true, fibers);
    EXPECT_EQ(a.schedule, b.schedule);
    EXPECT_EQ(a.log, b.log);
    EXPECT_EQ(a.out, b.out);
    EXPECT_TRUE(a.json == b.json);
  }
}

TEST(SimDeterminismTest, NotYieldingOnIssueHandsOffLessAndChangesNoResult) {
  SimOptions yielding = TestOptions();
  SimOptions not_yielding = TestOptions();
  not_yielding.yield_on_issue = false;
  const Observed a = RunProgram(7, true, yielding);
  const Observed b = RunProgram(7, true, not_yielding);
  EXPECT_LT(b.schedule.size(), a.schedule.size());
  EXPECT_EQ(a.out, b.out);
  EXPECT_TRUE(a.slices == b.slices);
}

TEST(SimExecutionTest, FibersRunEveryRankOnOneThreadThreadsEachOnItsOwn) {
  for (const auto execution :
       {SimOptions::Execution::kThreads, SimOptions::Execution::kFibers}) {
    SimOptions options;
    options.world_size = 6;
    options.execution = execution;
    auto world = MakeWorld(options);
    std::vector<std::thread::id> seen(6);
    std::vector<int> stayed(6, 0);
    FLATPARAM_ASSERT_OK(world->Run([&](SimCommunicator& comm) -> absl::Status {
      seen[comm.rank()] = std::this_thread::get_id();
      std::vector<float> x(4, 1.0f);
      FLATPARAM_RETURN_IF_ERROR(comm.AllReduce(Ref(x), Ref(x), {})->Wait());
      comm.Yield();
      // A fiber resumes on the thread (and stack) it left.
      stayed[comm.rank()] = seen[comm.rank()] == std::this_thread::get_id();
      return absl::OkStatus();
    }));
    std::set<std::thread::id> distinct(seen.begin(), seen.end());
    EXPECT_EQ(distinct.size(),
              execution == SimOptions::Execution::kFibers ? 1u : 6u);
    EXPECT_THAT(stayed, ::testing::Each(1));
  }
}

TEST(SimExecutionTest, ThousandsOfFibersDeadlockDetectionIncluded) {
  SimOptions options;
  options.world_size = 2048;
  options.execution = SimOptions::Execution::kFibers;
  options.stack_bytes = 64 << 10;
  options.flight_recorder.capacity = 0;
  auto world = MakeWorld(options);
  const absl::Status status =
      world->Run([&](SimCommunicator& comm) -> absl::Status {
        std::vector<float> x(2, 1.0f);
        FLATPARAM_RETURN_IF_ERROR(comm.AllReduce(Ref(x), Ref(x), {})->Wait());
        if (x[0] != 2048.0f) return absl::InternalError("wrong sum");
        // The last rank leaves; the others wait for it forever.
        if (comm.rank() == 2047) return absl::OkStatus();
        return comm.AllReduce(Ref(x), Ref(x), {})->Wait();
      });
  EXPECT_THAT(status,
              StatusIs(absl::StatusCode::kInternal, HasSubstr("deadlock")));
  EXPECT_THAT(world->rank_statuses()[2047], IsOk());
}

TEST(SimDeterminismTest, DifferentSeedsExploreDifferentInterleavings) {
  const Observed a = RunProgram(1);
  int different = 0;
  for (uint64_t seed = 2; seed < 12; ++seed) {
    const Observed b = RunProgram(seed);
    if (b.log != a.log) ++different;
    EXPECT_NE(b.schedule, a.schedule) << seed;
    // The interleaving changes; the results and the timeline do not.
    EXPECT_EQ(b.out, a.out) << seed;
    EXPECT_TRUE(b.slices == a.slices) << seed;
  }
  EXPECT_GE(different, 8);
}

TEST(SimDeterminismTest, YieldLetsOtherRanksRun) {
  // Without collectives, ranks interleave only at Yield: with enough yields
  // some rank must run between two entries of another.
  std::vector<int> log;
  auto world = MakeWorld(3, 5);
  FLATPARAM_ASSERT_OK(world->Run([&](SimCommunicator& comm) -> absl::Status {
    for (int i = 0; i < 20; ++i) {
      log.push_back(comm.rank());
      comm.Yield();
    }
    return absl::OkStatus();
  }));
  ASSERT_EQ(log.size(), 60);
  int switches = 0;
  for (size_t i = 1; i < log.size(); ++i) switches += log[i] != log[i - 1];
  EXPECT_GT(switches, 10);
}

// ---------------------------------------------------------------------------
// Chrome trace.

TEST(SimTraceTest, ChromeTraceJsonHasOneTrackPerRankAndOneSlicePerCall) {
  SimOptions options = TestOptions();
  options.world_size = 3;
  options.seed = 9;
  options.cost.latency = absl::Microseconds(100);
  options.cost.bytes_per_second = 1e9;
  auto world = MakeWorld(options);
  FLATPARAM_ASSERT_OK(world->Run([&](Communicator& comm) -> absl::Status {
    std::vector<float> in(1000, 1), out(3000);
    FLATPARAM_RETURN_IF_ERROR(comm.AllGather(CRef(in), Ref(out), {})->Wait());
    return comm.Barrier({});
  }));
  const nlohmann::json doc = nlohmann::json::parse(world->ChromeTraceJson());
  ASSERT_TRUE(doc.contains("traceEvents"));
  EXPECT_EQ(doc["displayTimeUnit"], "ns");
  EXPECT_EQ(doc["otherData"]["world_size"], 3);
  EXPECT_EQ(doc["otherData"]["seed"], 9);
  int threads = 0, slices = 0;
  for (const nlohmann::json& e : doc["traceEvents"]) {
    EXPECT_EQ(e["pid"], 0);
    if (e["ph"] == "M" && e["name"] == "thread_name") {
      EXPECT_EQ(e["args"]["name"], absl::StrCat("rank ", e["tid"].get<int>()));
      ++threads;
    }
    if (e["ph"] != "X") continue;
    ++slices;
    const int tid = e["tid"];
    EXPECT_GE(tid, 0);
    EXPECT_LT(tid, 3);
    if (e["name"] == "all_gather") {
      // 12000 output bytes, bus factor 2/3: 100 us + 8 us.
      EXPECT_EQ(e["args"]["bytes"], 12000);
      EXPECT_EQ(e["ts"], 0.0);
      EXPECT_EQ(e["dur"], 108.0);
      EXPECT_EQ(e["args"]["seq"], 0);
      EXPECT_EQ(e["args"]["detail"], "1000 x float32 per rank");
    } else {
      EXPECT_EQ(e["name"], "barrier");
      EXPECT_EQ(e["args"]["bytes"], 0);
      EXPECT_EQ(e["ts"], 108.0);
      EXPECT_EQ(e["dur"], 100.0);
    }
    EXPECT_FALSE(e["args"].contains("error"));
  }
  EXPECT_EQ(threads, 3);
  EXPECT_EQ(slices, 6);
}

TEST(SimTraceTest, WriteChromeTraceWritesTheJson) {
  auto world = MakeWorld(2);
  FLATPARAM_ASSERT_OK(world->Run(
      [&](Communicator& comm) -> absl::Status { return comm.Barrier({}); }));
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string path =
      absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/sim_trace.json");
  FLATPARAM_ASSERT_OK(world->WriteChromeTrace(path));
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  EXPECT_EQ(text.str(), world->ChromeTraceJson());
  EXPECT_THAT(world->WriteChromeTrace("/nonexistent-dir/trace.json"),
              StatusIs(absl::StatusCode::kInternal,
                       HasSubstr("/nonexistent-dir/trace.json")));
}

// ---------------------------------------------------------------------------
// Metadata-only collectives, the context check, the first failure.

TEST(SimMetadataTest, CollectivesOnPlaceholdersMoveNothing) {
  SimOptions options = TestOptions();
  options.world_size = 4;
  options.metadata_only = true;
  auto world = MakeWorld(options);
  FLATPARAM_ASSERT_OK(world->Run([&](SimCommunicator& comm) -> absl::Status {
    // Addresses that map nothing: any access would crash.
    const uintptr_t base =
        (uintptr_t{1} << 44) + static_cast<uintptr_t>(comm.rank()) * (1u << 30);
    BufferRef in{reinterpret_cast<void*>(base), 1 << 20, DType::kFloat32};
    BufferRef out{reinterpret_cast<void*>(base + (64 << 20)), 4 << 20,
                  DType::kFloat32};
    FLATPARAM_RETURN_IF_ERROR(comm.AllGather(in, out, {})->Wait());
    FLATPARAM_RETURN_IF_ERROR(comm.ReduceScatter(out, in, {})->Wait());
    FLATPARAM_RETURN_IF_ERROR(comm.AllReduce(in, in, {})->Wait());
    // Small host payloads still move.
    FLATPARAM_ASSIGN_OR_RETURN(
        std::vector<std::string> all,
        comm.AllGatherBytes(absl::StrCat(comm.rank()), {}));
    if (all.size() != 4 || all[3] != "3") {
      return absl::InternalError("all_gather_bytes lost its payload");
    }
    return absl::OkStatus();
  }));
  // Sizes and times are as with data.
  EXPECT_EQ(world->trace()[0].bytes, 16 << 20);
  EXPECT_GT(world->trace()[0].end, world->trace()[0].start);
}

TEST(SimMetadataTest, CreateRefusesWhatNeedsTheBytes) {
  SimOptions options = TestOptions();
  options.world_size = 2;
  options.metadata_only = true;
  options.checksum = true;
  EXPECT_THAT(
      SimWorld::Create(options),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("metadata_only")));
  options.checksum = false;
  options.faults = {*ParseFaultSpec("flip:rank=1:op=0")};
  EXPECT_THAT(SimWorld::Create(options),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("flip:rank=1:op=0")));
  options.faults.clear();
  options.metadata_only = false;
  options.check_context = true;
  options.flight_recorder.capacity = 0;
  EXPECT_THAT(
      SimWorld::Create(options),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("check_context")));
}

// Ranks 0 and 1 issue equal all-reduces from different units: without the
// context check they silently exchange different units' data; with it the
// operation is a desync naming both units, and first_failure() keeps that
// cause after later calls fail on the aborted group.
TEST(SimContextTest, EqualCollectivesOfDifferentUnitsAreADesync) {
  for (bool check : {false, true}) {
    SimOptions options = TestOptions();
    options.world_size = 2;
    options.check_context = check;
    options.flight_recorder.capacity = 16;
    auto world = MakeWorld(options);
    const absl::Status status =
        world->Run([&](SimCommunicator& comm) -> absl::Status {
          std::vector<float> x(4, 1.0f);
          {
            const int unit = comm.rank() == 0 ? 3 : 4;
            ScopedCollectiveContext context(
                comm.flight_recorder(), {absl::StrCat("layers.", unit), unit,
                                         CollectivePhase::kForwardUnshard});
            FLATPARAM_RETURN_IF_ERROR(
                comm.AllReduce(Ref(x), Ref(x), {})->Wait());
          }
          // Without a context, nothing to compare.
          return comm.AllReduce(Ref(x), Ref(x), {})->Wait();
        });
    if (!check) {
      EXPECT_THAT(status, IsOk());
      EXPECT_THAT(world->first_failure(), IsOk());
      continue;
    }
    EXPECT_THAT(status, StatusIs(absl::StatusCode::kInternal));
    EXPECT_THAT(world->first_failure(),
                StatusIs(absl::StatusCode::kInternal,
                         AllOf(HasSubstr("different FSDP units or phases"),
                               HasSubstr("rank 0: all_reduce #0 (4 x float32, "
                                         "sum) from unit layers.3, forward "
                                         "unshard"),
                               HasSubstr("rank 1: all_reduce #0 (4 x float32, "
                                         "sum) from unit layers.4"))));
  }
}

TEST(SimDescribeTest, RanksWithOneTextAreListedAsRuns) {
  SimOptions options = TestOptions();
  options.world_size = 64;
  auto world = MakeWorld(options);
  const absl::Status status =
      world->Run([&](SimCommunicator& comm) -> absl::Status {
        // Every 8th rank issues a different size.
        std::vector<float> x(comm.rank() % 8 == 3 ? 8 : 4, 1.0f);
        return comm.AllReduce(Ref(x), Ref(x), {})->Wait();
      });
  EXPECT_THAT(status,
              StatusIs(absl::StatusCode::kInternal,
                       AllOf(HasSubstr("ranks 0-2, 4-10, 12-18"),
                             HasSubstr("ranks 3-59 step 8: all_reduce #0 (8 x "
                                       "float32, sum)"))));
}

// ---------------------------------------------------------------------------
// The world itself.

TEST(SimWorldTest, CreateRejectsBadOptions) {
  SimOptions options = TestOptions();
  options.world_size = 0;
  EXPECT_THAT(
      SimWorld::Create(options),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("world_size 0")));
  options.world_size = 2;
  options.cost.bytes_per_second = 0;
  EXPECT_THAT(SimWorld::Create(options),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("bytes_per_second")));
  options.cost = CostModel();
  options.cost.latency = absl::Seconds(-1);
  EXPECT_THAT(SimWorld::Create(options),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("cost.latency (-1s)")));
  options.cost = CostModel();
  options.stack_bytes = 1024;
  EXPECT_THAT(SimWorld::Create(options),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("stack_bytes 1024")));
  options.stack_bytes = 1 << 20;
  options.faults = {*ParseFaultSpec("kill:rank=2:op=0")};
  EXPECT_THAT(SimWorld::Create(options),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("kill:rank=2:op=0 names rank 2 outside the "
                                 "world of 2")));
  FaultSpec no_op;
  no_op.kind = FaultSpec::Kind::kFlip;
  options.faults = {no_op};
  EXPECT_THAT(
      SimWorld::Create(options),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("needs an op")));
}

TEST(SimWorldTest, RunOnlyOnce) {
  auto world = MakeWorld(2);
  FLATPARAM_ASSERT_OK(
      world->Run([](Communicator&) { return absl::OkStatus(); }));
  EXPECT_THAT(world->Run([](Communicator&) { return absl::OkStatus(); }),
              StatusIs(absl::StatusCode::kFailedPrecondition));
}

TEST(SimWorldTest, RunReportsEveryRanksStatus) {
  auto world = MakeWorld(4);
  const absl::Status status = world->Run([](Communicator& comm) {
    if (comm.rank() == 0) return absl::OkStatus();
    if (comm.rank() == 1) return absl::NotFoundError("no checkpoint");
    return absl::UnavailableError("later");
  });
  EXPECT_THAT(status, StatusIs(absl::StatusCode::kNotFound,
                               HasSubstr("3 of 4 ranks failed (ranks 1, 2, "
                                         "3); rank 1: no checkpoint")));
  EXPECT_THAT(world->rank_statuses()[0], IsOk());
  EXPECT_THAT(world->rank_statuses()[3],
              StatusIs(absl::StatusCode::kUnavailable));
}

TEST(SimWorldTest, AThrowingRankFunctionIsAnInternalError) {
  auto world = MakeWorld(2);
  const absl::Status status = world->Run([](Communicator& comm) {
    if (comm.rank() == 1) throw std::runtime_error("boom");
    return absl::OkStatus();
  });
  EXPECT_THAT(status, StatusIs(absl::StatusCode::kInternal,
                               HasSubstr("rank 1: the rank function threw: "
                                         "boom")));
}

TEST(SimWorldTest, ACommunicatorUsedFromAnotherThreadFails) {
  auto world = MakeWorld(1);
  FLATPARAM_ASSERT_OK(world->Run([](Communicator& comm) -> absl::Status {
    absl::Status from_thread;
    std::thread t([&] { from_thread = comm.Barrier({}); });
    t.join();
    EXPECT_THAT(from_thread, StatusIs(absl::StatusCode::kFailedPrecondition,
                                      HasSubstr("another thread")));
    return comm.Barrier({});
  }));
}

TEST(SimWorldTest, SingleRankWorld) {
  auto world = MakeWorld(1);
  std::vector<float> out(2);
  FLATPARAM_ASSERT_OK(world->Run([&](Communicator& comm) -> absl::Status {
    std::vector<float> in = {3, 4};
    FLATPARAM_RETURN_IF_ERROR(comm.AllGather(CRef(in), Ref(out), {})->Wait());
    FLATPARAM_ASSIGN_OR_RETURN(auto sub, comm.Split(0, 0, {}));
    EXPECT_EQ(sub->size(), 1);
    return comm.AllReduce(Ref(out), Ref(out), {})->Wait();
  }));
  EXPECT_THAT(out, ElementsAre(3, 4));
}

}  // namespace
}  // namespace flatparam
