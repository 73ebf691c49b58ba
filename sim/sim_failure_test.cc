// How the simulator fails: argument errors, desynchronised and deadlocked
// groups, injected faults, timeouts and checksums. Every case must end with
// an error on every affected rank, never a hang.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "comm/communicator.h"
#include "flatparam/base/status_matchers.h"
#include "sim/fault.h"
#include "sim/internal/sim_testutil.h"
#include "sim/sim.h"

namespace flatparam {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;

using internal_sim::TestOptions;

std::unique_ptr<SimWorld> MakeWorld(int n, const std::string& faults = "",
                                    bool checksum = false, uint64_t seed = 1) {
  SimOptions options = TestOptions();
  options.world_size = n;
  options.seed = seed;
  options.checksum = checksum;
  auto parsed = ParseFaultSpecs(faults);
  EXPECT_TRUE(parsed.ok()) << parsed.status();
  options.faults = *parsed;
  auto world = SimWorld::Create(options);
  EXPECT_TRUE(world.ok()) << world.status();
  return std::move(world).value();
}

BufferRef Ref(std::vector<float>& v) {
  return {v.data(), static_cast<int64_t>(v.size()), DType::kFloat32};
}

// Runs `fn` on every rank; each rank's first error is stored and the rank
// then carries on, so that tests can check what later calls do.
std::vector<absl::Status> RunAll(SimWorld& world, const SimWorld::RankFn& fn) {
  absl::Status status = world.Run(fn);
  (void)status;
  return world.rank_statuses();
}

// ---------------------------------------------------------------------------
// Argument errors.

TEST(SimArgumentTest, WrongSizeFailsTheCallerAndItsPeers) {
  auto world = MakeWorld(3);
  auto statuses = RunAll(*world, [](Communicator& comm) -> absl::Status {
    std::vector<float> in(4), out(comm.rank() == 1 ? 11 : 12);
    return comm.AllGather(Ref(in), Ref(out), {})->Wait();
  });
  EXPECT_THAT(statuses[1],
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("rank 1: all_gather #0: expected input of 4 "
                                 "and output of 12 elements, got 4 and 11")));
  for (int r : {0, 2}) {
    EXPECT_THAT(
        statuses[r],
        StatusIs(absl::StatusCode::kInvalidArgument,
                 AllOf(HasSubstr(absl::StrCat("rank ", r,
                                              ": all_gather #0 in group 0: "
                                              "rank 1 passed invalid "
                                              "arguments")),
                       HasSubstr("got 4 and 11"))));
  }
}

TEST(SimArgumentTest, ValidatorErrorsBecomeStatuses) {
  auto world = MakeWorld(2);
  auto statuses = RunAll(*world, [](Communicator& comm) -> absl::Status {
    std::vector<float> a(4), b(2);
    // Max with a divide factor.
    ReduceOptions bad;
    bad.op = ReduceOp::kMax;
    bad.pre_divide_factor = 2;
    EXPECT_THAT(comm.ReduceScatter(Ref(a), Ref(b), bad)->Wait(),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("need op sum or avg")));
    // Root out of range.
    BroadcastOptions root;
    root.root = 5;
    EXPECT_THAT(comm.Broadcast(Ref(a), root)->Wait(),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("root 5 is not in [0, 2)")));
    // Integer dtype.
    std::vector<int32_t> ints(4);
    BufferRef iref{ints.data(), 4, DType::kInt32};
    EXPECT_THAT(
        comm.AllReduce(iref, iref, {})->Wait(),
        StatusIs(absl::StatusCode::kUnimplemented, HasSubstr("dtype int32")));
    // A CUDA buffer.
    BufferRef cuda = Ref(a);
    cuda.device = Device::Cuda(0);
    EXPECT_THAT(comm.AllReduce(cuda, cuda, {})->Wait(),
                StatusIs(absl::StatusCode::kUnimplemented,
                         HasSubstr("host buffers only, got cuda:0")));
    // Dtypes differ.
    BufferRef half = Ref(b);
    half.dtype = DType::kFloat16;
    EXPECT_THAT(comm.AllReduce(Ref(b), half, {})->Wait(),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("differ in dtype")));
    return absl::OkStatus();
  });
  EXPECT_THAT(statuses, ElementsAre(IsOk(), IsOk()));
}

TEST(SimArgumentTest, OverlapThatIsNotInPlaceIsRejected) {
  auto world = MakeWorld(2);
  auto statuses = RunAll(*world, [](Communicator& comm) -> absl::Status {
    std::vector<float> buf(8);
    BufferRef all = Ref(buf);
    // All-gather input at the other rank's slot.
    EXPECT_THAT(
        comm.AllGather(all.Slice((1 - comm.rank()) * 4, 4), all.Slice(0, 8), {})
            ->Wait(),
        StatusIs(absl::StatusCode::kInvalidArgument,
                 HasSubstr("overlap without being in place (in place "
                           "needs input == output + rank * count)")));
    // All-reduce with shifted buffers.
    EXPECT_THAT(comm.AllReduce(all.Slice(0, 4), all.Slice(1, 4), {})->Wait(),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("in place needs input == output")));
    // Reduce-scatter output at the wrong chunk.
    EXPECT_THAT(comm.ReduceScatter(all, all.Slice((1 - comm.rank()) * 4, 4), {})
                    ->Wait(),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("output == input + rank * count")));
    return absl::OkStatus();
  });
  EXPECT_THAT(statuses, ElementsAre(IsOk(), IsOk()));
}

TEST(SimArgumentTest, DroppingAnUnfinishedWorkFailsTheOperation) {
  auto world = MakeWorld(3);
  bool dropped = false;
  auto statuses = RunAll(*world, [&](SimCommunicator& comm) -> absl::Status {
    std::vector<float> buf(2, 1);
    if (comm.rank() == 0) {
      // Issued and dropped before the others arrive.
      comm.AllReduce(Ref(buf), Ref(buf), {});
      dropped = true;
      return absl::OkStatus();
    }
    while (!dropped) comm.Yield();
    return comm.AllReduce(Ref(buf), Ref(buf), {})->Wait();
  });
  EXPECT_THAT(statuses[0], IsOk());
  for (int r : {1, 2}) {
    EXPECT_THAT(statuses[r],
                StatusIs(absl::StatusCode::kFailedPrecondition,
                         HasSubstr("rank 0 destroyed its Work before the "
                                   "operation finished")));
  }
}

// ---------------------------------------------------------------------------
// Desynchronisation.

// Every rank issues `Issue(rank)` once and then a barrier, and returns the
// first error.
std::vector<absl::Status> Desync(
    int n, const std::function<std::unique_ptr<Work>(Communicator&)>& issue) {
  auto world = MakeWorld(n);
  return RunAll(*world, [&](Communicator& comm) -> absl::Status {
    FLATPARAM_RETURN_IF_ERROR(issue(comm)->Wait());
    return comm.Barrier({});
  });
}

TEST(SimDesyncTest, DifferentCollectivesListEveryRank) {
  std::vector<float> bufs[4];
  for (auto& b : bufs) b.assign(16, 0);
  auto statuses = Desync(4, [&](Communicator& comm) {
    std::vector<float>& b = bufs[comm.rank()];
    if (comm.rank() == 2) return comm.AllReduce(Ref(b), Ref(b), {});
    return comm.AllGather(Ref(b).Slice(comm.rank() * 4, 4), Ref(b), {});
  });
  for (int r = 0; r < 4; ++r) {
    EXPECT_THAT(
        statuses[r],
        StatusIs(absl::StatusCode::kInternal,
                 AllOf(HasSubstr(absl::StrCat("rank ", r, ": ")),
                       HasSubstr("desynchronised: the members of group 0 "
                                 "issued different collectives as its "
                                 "operation #0"),
                       // One line per distinct call, with its ranks.
                       HasSubstr("ranks 0-1, 3: all_gather #0 (4 x float32 "
                                 "per rank)"),
                       HasSubstr("rank 2: all_reduce #0 (16 x float32, sum)"))))
        << r;
  }
}

TEST(SimDesyncTest, DifferentCountsDtypesRootsAndReduceOps) {
  struct Case {
    const char* name;
    std::function<std::unique_ptr<Work>(Communicator&, std::vector<float>&)>
        issue;
    const char* odd_line;
  };
  const std::vector<Case> cases = {
      {"count",
       [](Communicator& comm, std::vector<float>& b) {
         const int64_t n = comm.rank() == 1 ? 3 : 4;
         return comm.AllReduce(Ref(b).Slice(0, n), Ref(b).Slice(0, n), {});
       },
       "rank 1: all_reduce #0 (3 x float32, sum)"},
      {"dtype",
       [](Communicator& comm, std::vector<float>& b) {
         BufferRef r = Ref(b).Slice(0, 4);
         if (comm.rank() == 1) r.dtype = DType::kBFloat16;
         return comm.AllReduce(r, r, {});
       },
       "rank 1: all_reduce #0 (4 x bfloat16, sum)"},
      {"root",
       [](Communicator& comm, std::vector<float>& b) {
         BroadcastOptions o;
         o.root = comm.rank() == 1 ? 1 : 0;
         return comm.Broadcast(Ref(b), o);
       },
       "rank 1: broadcast #0 (16 x float32, root 1)"},
      {"reduce op",
       [](Communicator& comm, std::vector<float>& b) {
         ReduceOptions o;
         if (comm.rank() == 1) o.op = ReduceOp::kAvg;
         return comm.AllReduce(Ref(b), Ref(b), o);
       },
       "rank 1: all_reduce #0 (16 x float32, avg)"},
      {"divide factor",
       [](Communicator& comm, std::vector<float>& b) {
         ReduceOptions o;
         if (comm.rank() == 1) o.post_divide_factor = 2;
         return comm.ReduceScatter(Ref(b), Ref(b).Slice(comm.rank() * 8, 8), o);
       },
       "rank 1: reduce_scatter #0 (8 x float32 per rank, sum, post-divide "
       "2)"},
  };
  for (const Case& c : cases) {
    std::vector<float> bufs[2];
    for (auto& b : bufs) b.assign(16, 1);
    auto statuses = Desync(2, [&](Communicator& comm) {
      return c.issue(comm, bufs[comm.rank()]);
    });
    for (int r = 0; r < 2; ++r) {
      EXPECT_THAT(statuses[r],
                  StatusIs(absl::StatusCode::kInternal,
                           AllOf(HasSubstr("desynchronised"),
                                 HasSubstr("rank 0: "), HasSubstr(c.odd_line))))
          << c.name << " rank " << r;
    }
  }
}

TEST(SimDesyncTest, TheGroupIsAbortedAfterADesync) {
  auto world = MakeWorld(2);
  auto statuses = RunAll(*world, [](Communicator& comm) -> absl::Status {
    absl::Status first = comm.rank() == 0
                             ? comm.Barrier({})
                             : comm.AllGatherBytes("x", {}).status();
    EXPECT_THAT(first, StatusIs(absl::StatusCode::kInternal,
                                AllOf(HasSubstr("rank 0: barrier #0\n"),
                                      HasSubstr("rank 1: all_gather_bytes #0 "
                                                "(1 bytes)"))));
    return comm.Barrier({});
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_THAT(statuses[r],
                StatusIs(absl::StatusCode::kAborted,
                         HasSubstr(absl::StrCat(
                             "rank ", r,
                             ": barrier #1 in group 0: group 0 was aborted: "
                             "its members desynchronised at operation #0"))));
  }
}

TEST(SimDesyncTest, ARankReturningEarlyIsADeadlockNotAHang) {
  auto world = MakeWorld(4);
  auto statuses = RunAll(*world, [](Communicator& comm) -> absl::Status {
    std::vector<float> buf(4, 1);
    FLATPARAM_RETURN_IF_ERROR(comm.AllReduce(Ref(buf), Ref(buf), {})->Wait());
    if (comm.rank() == 3) return absl::OkStatus();
    return comm.AllReduce(Ref(buf), Ref(buf), {})->Wait();
  });
  EXPECT_THAT(statuses[3], IsOk());
  for (int r = 0; r < 3; ++r) {
    EXPECT_THAT(
        statuses[r],
        StatusIs(absl::StatusCode::kInternal,
                 AllOf(HasSubstr(absl::StrCat("rank ", r,
                                              ": all_reduce #1 in group 0: "
                                              "deadlock")),
                       HasSubstr("ranks 0-2: waiting on all_reduce #1 in "
                                 "group 0 (4 x float32, sum); 3 of 4 members "
                                 "arrived, missing rank 3"),
                       HasSubstr("rank 3: returned after 1 collectives"))))
        << r;
  }
}

TEST(SimDesyncTest, WaitingOnDifferentGroupsIsADeadlock) {
  // Ranks 0 and 1 wait on a world barrier while rank 2 and 3 wait on their
  // pair's barrier, which rank 3 never joins before the world barrier.
  auto world = MakeWorld(4);
  auto statuses = RunAll(*world, [](Communicator& comm) -> absl::Status {
    FLATPARAM_ASSIGN_OR_RETURN(auto pair, comm.Split(comm.rank() / 2, 0, {}));
    if (comm.rank() == 2) FLATPARAM_RETURN_IF_ERROR(pair->Barrier({}));
    FLATPARAM_RETURN_IF_ERROR(comm.Barrier({}));
    if (comm.rank() == 3) FLATPARAM_RETURN_IF_ERROR(pair->Barrier({}));
    return absl::OkStatus();
  });
  for (int r = 0; r < 4; ++r) {
    EXPECT_THAT(
        statuses[r],
        StatusIs(absl::StatusCode::kInternal,
                 AllOf(HasSubstr("deadlock"),
                       HasSubstr("rank 2: waiting on barrier #0 in group 2; "
                                 "1 of 2 members arrived, missing rank 3"),
                       HasSubstr("missing rank 2"))))
        << r;
  }
}

TEST(SimDesyncTest, DeadlockAtScaleListsRanksCompactly) {
  constexpr int kWorld = 128;
  auto world = MakeWorld(kWorld);
  auto statuses = RunAll(*world, [](Communicator& comm) -> absl::Status {
    if (comm.rank() == 77) return absl::OkStatus();
    return comm.Barrier({});
  });
  for (int r = 0; r < kWorld; ++r) {
    if (r == 77) continue;
    EXPECT_THAT(statuses[r],
                StatusIs(absl::StatusCode::kInternal,
                         AllOf(HasSubstr("ranks 0-76, 78-127: waiting on "
                                         "barrier #0"),
                               HasSubstr("rank 77: returned after 0 "
                                         "collectives"))))
        << r;
  }
}

// ---------------------------------------------------------------------------
// Faults.

TEST(SimFaultTest, KillAbortsTheDeadRankAndEveryPeer) {
  auto world = MakeWorld(4, "kill:rank=2:op=1");
  std::vector<absl::Status> second(4), third(4);
  auto statuses = RunAll(*world, [&](Communicator& comm) -> absl::Status {
    std::vector<float> buf(4, 1);
    const int r = comm.rank();
    FLATPARAM_RETURN_IF_ERROR(comm.AllReduce(Ref(buf), Ref(buf), {})->Wait());
    second[r] = comm.AllReduce(Ref(buf), Ref(buf), {})->Wait();
    third[r] = comm.Barrier({});
    return second[r];
  });
  EXPECT_THAT(second[2],
              StatusIs(absl::StatusCode::kAborted,
                       HasSubstr("rank 2: all_reduce #1 in group 0: this rank "
                                 "was killed by fault kill:rank=2:op=1")));
  EXPECT_THAT(third[2], StatusIs(absl::StatusCode::kAborted,
                                 HasSubstr("this rank is dead")));
  for (int r : {0, 1, 3}) {
    EXPECT_THAT(second[r],
                StatusIs(absl::StatusCode::kAborted,
                         HasSubstr("rank 2 died (killed by fault "
                                   "kill:rank=2:op=1 at its all_reduce #1 in "
                                   "group 0)")))
        << r;
    EXPECT_THAT(third[r], StatusIs(absl::StatusCode::kAborted,
                                   HasSubstr("group 0 was aborted: rank 2 "
                                             "died")))
        << r;
  }
  for (const absl::Status& s : statuses) {
    EXPECT_THAT(s, StatusIs(absl::StatusCode::kAborted));
  }
}

TEST(SimFaultTest, KillInHybridGroupsAffectsOnlyGroupsWithTheDeadRank) {
  // 8 ranks, nodes of 4. Rank 5's ops: 0 split (shard), 1 split
  // (replicate), 2 shard all-reduce, 3 replicate all-reduce: it dies at 2.
  auto world = MakeWorld(8, "kill:rank=5:op=2");
  std::vector<absl::Status> shard(8), replicate(8);
  RunAll(*world, [&](Communicator& comm) -> absl::Status {
    const int r = comm.rank();
    FLATPARAM_ASSIGN_OR_RETURN(HybridGroups g, MakeHybridGroups(comm, 4));
    std::vector<float> buf(4, 1);
    shard[r] = g.shard->AllReduce(Ref(buf), Ref(buf), {})->Wait();
    replicate[r] = g.replicate->AllReduce(Ref(buf), Ref(buf), {})->Wait();
    return absl::OkStatus();
  });
  for (int r = 0; r < 8; ++r) {
    const bool node1 = r >= 4;
    const bool with5 = r % 4 == 1;
    if (node1) {
      EXPECT_THAT(shard[r],
                  StatusIs(absl::StatusCode::kAborted, HasSubstr("rank 5")))
          << r;
    } else {
      EXPECT_THAT(shard[r], IsOk()) << r;
    }
    if (with5) {
      EXPECT_THAT(replicate[r],
                  StatusIs(absl::StatusCode::kAborted, HasSubstr("rank 5")))
          << r;
    } else {
      EXPECT_THAT(replicate[r], IsOk()) << r;
    }
  }
}

TEST(SimFaultTest, ShortDelayOnlyShiftsTheTimeline) {
  auto world = MakeWorld(3, "delay:rank=1:seconds=0.5");
  FLATPARAM_ASSERT_OK(world->Run([](Communicator& comm) -> absl::Status {
    FLATPARAM_RETURN_IF_ERROR(comm.Barrier({}));
    return comm.Barrier({});
  }));
  for (const TraceEvent& e : world->trace()) {
    // Rank 1 arrives 0.5 s late at each barrier; everyone starts with it.
    const absl::Duration delay = absl::Milliseconds(500) * (e.op + 1);
    EXPECT_EQ(e.start, delay + absl::Microseconds(10) * e.op) << e.rank;
    if (e.rank == 1) {
      EXPECT_EQ(e.arrive, e.start);
    } else {
      EXPECT_LT(e.arrive, e.start);
    }
  }
}

TEST(SimFaultTest, DelayPastTheTimeoutFailsEveryMember) {
  auto world = MakeWorld(3, "delay:rank=1:seconds=10:op=1");
  std::vector<absl::Status> late(3), after(3);
  auto statuses = RunAll(*world, [&](Communicator& comm) -> absl::Status {
    CollectiveOptions options;
    options.timeout = absl::Seconds(5);
    FLATPARAM_RETURN_IF_ERROR(comm.Barrier(options));
    late[comm.rank()] = comm.Barrier(options);
    after[comm.rank()] = comm.Barrier(options);
    return absl::OkStatus();
  });
  for (int r = 0; r < 3; ++r) {
    EXPECT_THAT(late[r],
                StatusIs(absl::StatusCode::kDeadlineExceeded,
                         AllOf(HasSubstr(absl::StrCat("rank ", r,
                                                      ": barrier #1 in group "
                                                      "0: timed out on the "
                                                      "virtual clock")),
                               HasSubstr("with a timeout of 5s"),
                               HasSubstr("when rank 1 was ready"))))
        << r;
    EXPECT_THAT(after[r], StatusIs(absl::StatusCode::kAborted,
                                   HasSubstr("operation #1 timed out")));
  }
}

// All-gathers 4 floats per rank with a flip on rank 1's op 0.
std::vector<std::vector<float>> GatherWithFlip(
    const std::string& fault, bool checksum,
    std::vector<absl::Status>* statuses) {
  auto world = MakeWorld(3, fault, checksum);
  std::vector<std::vector<float>> out(3);
  *statuses = RunAll(*world, [&](Communicator& comm) -> absl::Status {
    const int r = comm.rank();
    std::vector<float> in = {1.0f + r, 2.0f + r, 3.0f + r, 4.0f + r};
    out[r].assign(12, 0);
    return comm.AllGather(Ref(in), Ref(out[r]), {})->Wait();
  });
  return out;
}

int DifferingBits(const std::vector<float>& a, const std::vector<float>& b) {
  int bits = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    uint32_t x, y;
    std::memcpy(&x, &a[i], 4);
    std::memcpy(&y, &b[i], 4);
    bits += __builtin_popcount(x ^ y);
  }
  return bits;
}

TEST(SimFaultTest, FlipWithoutChecksumCorruptsOneBitSilently) {
  std::vector<absl::Status> statuses;
  const auto clean = GatherWithFlip("", false, &statuses);
  const auto bad = GatherWithFlip("flip:rank=1:op=0:bit=33", false, &statuses);
  EXPECT_THAT(statuses, ElementsAre(IsOk(), IsOk(), IsOk()));
  // Bit 33 is bit 1 of rank 1's second float, which the other ranks get.
  EXPECT_EQ(DifferingBits(clean[0], bad[0]), 1);
  EXPECT_EQ(DifferingBits(clean[2], bad[2]), 1);
  EXPECT_NE(bad[0][5], clean[0][5]);
  // The sender keeps its own data.
  EXPECT_EQ(bad[1], clean[1]);
}

TEST(SimFaultTest, FlipWithSeededBitIsDeterministic) {
  std::vector<absl::Status> statuses;
  const auto a = GatherWithFlip("flip:rank=0:op=0", false, &statuses);
  const auto b = GatherWithFlip("flip:rank=0:op=0", false, &statuses);
  const auto clean = GatherWithFlip("", false, &statuses);
  EXPECT_EQ(a, b);
  EXPECT_EQ(DifferingBits(clean[1], a[1]), 1);
}

TEST(SimFaultTest, FlipWithChecksumIsDataLossOnEveryRank) {
  std::vector<absl::Status> statuses;
  GatherWithFlip("flip:rank=1:op=0:bit=33", true, &statuses);
  for (int r = 0; r < 3; ++r) {
    EXPECT_THAT(statuses[r],
                StatusIs(absl::StatusCode::kDataLoss,
                         AllOf(HasSubstr(absl::StrCat(
                                   "rank ", r, ": all_gather #0 in group 0")),
                               HasSubstr("data sent by rank 1 (its op 0) "
                                         "failed its checksum at ranks 0, 2"))))
        << r;
  }
  // Checksums alone change nothing.
  GatherWithFlip("", true, &statuses);
  EXPECT_THAT(statuses, ElementsAre(IsOk(), IsOk(), IsOk()));
}

TEST(SimFaultTest, ChecksumNamesTheReceiverOfACorruptReduceScatterChunk) {
  // Rank 0's input is 3 chunks of 2 floats; bit 64 + 5 is in chunk 1.
  auto world = MakeWorld(3, "flip:rank=0:op=0:bit=69", true);
  auto statuses = RunAll(*world, [](Communicator& comm) -> absl::Status {
    std::vector<float> in(6, 1), out(2);
    return comm.ReduceScatter(Ref(in), Ref(out), {})->Wait();
  });
  for (int r = 0; r < 3; ++r) {
    EXPECT_THAT(statuses[r],
                StatusIs(absl::StatusCode::kDataLoss,
                         HasSubstr("data sent by rank 0 (its op 0) failed its "
                                   "checksum at rank 1 (")))
        << r;
  }
}

TEST(SimFaultTest, FlipOnBroadcastAndAllReduceAndBytes) {
  // Broadcast, non-root target: only that rank receives bad data.
  {
    auto world = MakeWorld(3, "flip:rank=2:op=0:bit=0", true);
    auto statuses = RunAll(*world, [](Communicator& comm) -> absl::Status {
      std::vector<float> buf(2, 1);
      return comm.Broadcast(Ref(buf), {})->Wait();
    });
    for (const absl::Status& s : statuses) {
      EXPECT_THAT(s, StatusIs(absl::StatusCode::kDataLoss,
                              HasSubstr("data sent by rank 0 (its op 0) "
                                        "failed its checksum at rank 2 (")));
    }
  }
  // All-reduce: everyone else receives the sender's bad contribution.
  {
    auto world = MakeWorld(3, "flip:rank=1:op=0", true);
    auto statuses = RunAll(*world, [](Communicator& comm) -> absl::Status {
      std::vector<float> buf(2, 1);
      return comm.AllReduce(Ref(buf), Ref(buf), {})->Wait();
    });
    for (const absl::Status& s : statuses) {
      EXPECT_THAT(s, StatusIs(absl::StatusCode::kDataLoss,
                              HasSubstr("data sent by rank 1 (its op 0) "
                                        "failed its checksum at ranks 0, 2")));
    }
  }
  // All-gather of bytes without checksums: peers see the flipped string.
  {
    auto world = MakeWorld(2, "flip:rank=0:op=0:bit=0");
    std::vector<std::vector<std::string>> got(2);
    FLATPARAM_ASSERT_OK(world->Run([&](Communicator& comm) -> absl::Status {
      FLATPARAM_ASSIGN_OR_RETURN(got[comm.rank()],
                                 comm.AllGatherBytes("ab", {}));
      return absl::OkStatus();
    }));
    EXPECT_THAT(got[0], ElementsAre("ab", "ab"));
    EXPECT_THAT(got[1], ElementsAre("`b", "ab"));
  }
}

TEST(SimFaultTest, FlipWithoutPayloadIsReported) {
  auto world = MakeWorld(2, "flip:rank=0:op=0");
  auto statuses = RunAll(*world, [](Communicator& comm) -> absl::Status {
    return comm.Barrier({});
  });
  for (const absl::Status& s : statuses) {
    EXPECT_THAT(s, StatusIs(absl::StatusCode::kFailedPrecondition,
                            HasSubstr("fault flip:rank=0:op=0 cannot apply: "
                                      "rank 0's payload in this operation "
                                      "(barrier #0) has 0 bits; a flip needs "
                                      "an op whose payload is not empty")));
  }
  world = MakeWorld(2, "flip:rank=1:op=0:bit=64");
  statuses = RunAll(*world, [](Communicator& comm) -> absl::Status {
    std::vector<float> in(2), out(4);
    return comm.AllGather(Ref(in), Ref(out), {})->Wait();
  });
  for (const absl::Status& s : statuses) {
    EXPECT_THAT(s, StatusIs(absl::StatusCode::kFailedPrecondition,
                            HasSubstr("has 64 bits")));
  }
}

TEST(SimFaultTest, ChecksumCatchesABufferModifiedBeforeCompletion) {
  auto world = MakeWorld(2, "", true);
  bool issued = false;
  auto statuses = RunAll(*world, [&](SimCommunicator& comm) -> absl::Status {
    std::vector<float> in(4, 1), out(8);
    if (comm.rank() == 0) {
      auto work = comm.AllGather(Ref(in), Ref(out), {});
      in[3] = 2;  // breaks the contract: the input is still in flight
      issued = true;
      return work->Wait();
    }
    while (!issued) comm.Yield();
    return comm.AllGather(Ref(in), Ref(out), {})->Wait();
  });
  for (const absl::Status& s : statuses) {
    EXPECT_THAT(s, StatusIs(absl::StatusCode::kDataLoss,
                            HasSubstr("data sent by rank 0 (its op 0) failed "
                                      "its checksum at rank 1")));
  }
}

// ---------------------------------------------------------------------------
// Stalls outside the simulator.

TEST(SimStallDeathTest, ARankBlockedOutsideTheSimulatorAbortsWithAReport) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(
      {
        SimOptions options = TestOptions();
        options.world_size = 2;
        options.stall_timeout = absl::Milliseconds(200);
        auto world = SimWorld::Create(options).value();
        std::promise<void> never;
        (void)world->Run([&](Communicator& comm) -> absl::Status {
          if (comm.rank() == 1) never.get_future().wait();
          return comm.Barrier({});
        });
      },
      "rank 1 has held the baton for 200ms without reaching a scheduling "
      "point");
}

// ---------------------------------------------------------------------------
// Many ranks.

TEST(SimScaleTest, HybridTrainingStepsAt128Ranks) {
  constexpr int kWorld = 128, kNode = 8, kCount = 16;
  auto world = MakeWorld(kWorld, "", /*checksum=*/true, /*seed=*/11);
  std::vector<std::vector<float>> params(kWorld);
  FLATPARAM_ASSERT_OK(world->Run([&](Communicator& comm) -> absl::Status {
    const int r = comm.rank();
    FLATPARAM_ASSIGN_OR_RETURN(HybridGroups g, MakeHybridGroups(comm, kNode));
    std::vector<float> shard(kCount, 0), full(kCount * kNode);
    for (int step = 0; step < 3; ++step) {
      FLATPARAM_RETURN_IF_ERROR(
          g.shard->AllGather(Ref(shard), Ref(full), {})->Wait());
      std::vector<float> grad(kCount * kNode, 1.0f + step);
      ReduceOptions avg;
      avg.op = ReduceOp::kAvg;
      std::vector<float> gshard(kCount);
      FLATPARAM_RETURN_IF_ERROR(
          g.shard->ReduceScatter(Ref(grad), Ref(gshard), avg)->Wait());
      FLATPARAM_RETURN_IF_ERROR(
          g.replicate->AllReduce(Ref(gshard), Ref(gshard), avg)->Wait());
      for (int i = 0; i < kCount; ++i) shard[i] += gshard[i];
    }
    FLATPARAM_RETURN_IF_ERROR(comm.Barrier({}));
    params[r] = shard;
    return absl::OkStatus();
  }));
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_EQ(params[r], std::vector<float>(kCount, 6.0f)) << r;
  }
  // 2 splits + 3 * 3 collectives + 1 barrier per rank.
  EXPECT_EQ(world->trace().size(), kWorld * 12);
}

}  // namespace
}  // namespace flatparam
