// The suite's own reports: a communicator that corrupts data on one rank is
// caught on that rank only, with the case, element and values named; a
// collective error stops the suite; digests name the case and rank that
// differ.
#include "comm/conformance/collective_cases.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "comm/communicator.h"
#include "comm/conformance/case_values.h"
#include "comm/conformance/device_memory.h"
#include "comm/forwarding_communicator.h"
#include "flatparam/base/status_matchers.h"
#include "sim/sim.h"

namespace flatparam {
namespace conformance {
namespace {

using ::testing::AllOf;
using ::testing::Contains;
using ::testing::HasSubstr;
using ::testing::Not;

// A Work that runs `after` once its collective has finished.
class HookedWork final : public Work {
 public:
  HookedWork(std::unique_ptr<Work> inner, std::function<void()> after)
      : inner_(std::move(inner)), after_(std::move(after)) {}
  absl::Status Wait() override {
    absl::Status status = inner_->Wait();
    if (after_) std::exchange(after_, nullptr)();
    return status;
  }

 private:
  std::unique_ptr<Work> inner_;
  std::function<void()> after_;
};

// Forwards to `inner`; on rank `bad_rank`, `corrupt(input, output)` runs
// after each buffer collective finishes.
class CorruptingCommunicator final : public ForwardingCommunicator {
 public:
  using Corrupt = std::function<void(ConstBufferRef, BufferRef)>;
  CorruptingCommunicator(Communicator& inner, int bad_rank, Corrupt corrupt)
      : ForwardingCommunicator(&inner),
        bad_rank_(bad_rank),
        corrupt_(std::move(corrupt)) {}

  std::unique_ptr<Work> AllGather(ConstBufferRef input, BufferRef output,
                                  const CollectiveOptions& options) override {
    return Hook(inner().AllGather(input, output, options), input, output);
  }
  std::unique_ptr<Work> ReduceScatter(ConstBufferRef input, BufferRef output,
                                      const ReduceOptions& options) override {
    return Hook(inner().ReduceScatter(input, output, options), input, output);
  }
  std::unique_ptr<Work> AllReduce(ConstBufferRef input, BufferRef output,
                                  const ReduceOptions& options) override {
    return Hook(inner().AllReduce(input, output, options), input, output);
  }
  std::unique_ptr<Work> Broadcast(BufferRef buffer,
                                  const BroadcastOptions& options) override {
    return Hook(inner().Broadcast(buffer, options), buffer, buffer);
  }

 private:
  std::unique_ptr<Work> Hook(std::unique_ptr<Work> work, ConstBufferRef input,
                             BufferRef output) {
    if (rank() != bad_rank_) return work;
    return std::make_unique<HookedWork>(
        std::move(work), [this, input, output] { corrupt_(input, output); });
  }

  int bad_rank_;
  Corrupt corrupt_;
};

// Runs `fn(rank, comm)` on every rank of a simulated world of `n`.
void OnSim(int n, const std::function<void(Communicator&)>& fn,
           const std::string& faults = "") {
  SimOptions options;
  options.world_size = n;
  options.seed = 3;
  if (!faults.empty()) {
    auto parsed = ParseFaultSpecs(faults);
    ASSERT_THAT(parsed, IsOk());
    options.faults = *parsed;
  }
  auto world = SimWorld::Create(options);
  ASSERT_THAT(world, IsOk());
  EXPECT_THAT((*world)->Run([&](Communicator& comm) {
    fn(comm);
    return absl::OkStatus();
  }),
              IsOk());
}

CollectiveCase AllReduceCase() {
  CollectiveCase c;
  c.kind = CollectiveKind::kAllReduce;
  c.dtype = DType::kFloat32;
  c.count = 13;
  return c;
}

TEST(CollectiveCasesTest, PassOnACorrectBackend) {
  std::vector<CaseResult> results(4);
  OnSim(4, [&](Communicator& comm) {
    results[comm.rank()] = RunCase(comm, HostMemory(), AllReduceCase());
  });
  for (const CaseResult& r : results) {
    EXPECT_THAT(r.status, IsOk());
    EXPECT_EQ(r.wrong, 0);
  }
}

TEST(CollectiveCasesTest, WrongOutputNamesRankCaseElementAndValues) {
  std::vector<CaseResult> results(4);
  OnSim(4, [&](Communicator& comm) {
    CorruptingCommunicator bad(comm, 2, [](ConstBufferRef, BufferRef out) {
      static_cast<float*>(out.data)[5] += 1.0f;
    });
    results[comm.rank()] = RunCase(bad, HostMemory(), AllReduceCase());
  });
  for (int r : {0, 1, 3}) EXPECT_THAT(results[r].status, IsOk()) << r;
  EXPECT_THAT(
      results[2].status,
      StatusIs(absl::StatusCode::kInternal,
               AllOf(HasSubstr("rank 2 of 4: all_reduce float32 count 13 sum "
                               "inexact: output element 5 is "),
                     HasSubstr(", expected "), HasSubstr("(bits 0x"),
                     HasSubstr("1 of 13 elements differ"))));
  EXPECT_EQ(results[2].wrong, 1);
  EXPECT_FALSE(results[2].collective_error);
}

TEST(CollectiveCasesTest, MissingWritesAndChangedInputsAreCaught) {
  std::vector<CaseResult> gather(3), scatter(3);
  OnSim(3, [&](Communicator& comm) {
    // Rank 0's all_gather output loses the last rank's block.
    CorruptingCommunicator unwritten(
        comm, 0, [](ConstBufferRef in, BufferRef out) {
          std::memset(out.Slice(2 * in.count, in.count).data, 0x5A,
                      in.count * 2);
        });
    CollectiveCase g;
    g.kind = CollectiveKind::kAllGather;
    g.dtype = DType::kBFloat16;
    g.count = 7;
    gather[comm.rank()] = RunCase(unwritten, HostMemory(), g);
    // Rank 1's reduce_scatter scribbles on its input.
    CorruptingCommunicator writes_input(
        comm, 1, [](ConstBufferRef in, BufferRef) {
          static_cast<double*>(const_cast<void*>(in.data))[0] = 99;
        });
    CollectiveCase s;
    s.kind = CollectiveKind::kReduceScatter;
    s.dtype = DType::kFloat64;
    s.count = 2;
    s.values = Values::kExact;
    s.op = ReduceOp::kMax;
    scatter[comm.rank()] = RunCase(writes_input, HostMemory(), s);
  });
  EXPECT_THAT(gather[0].status,
              StatusIs(absl::StatusCode::kInternal,
                       AllOf(HasSubstr("rank 0 of 3: all_gather bfloat16 "
                                       "count 7 inexact: output element 14 "),
                             HasSubstr("(bits 0x5a5a)"),
                             HasSubstr("7 of 21 elements differ"))));
  EXPECT_EQ(gather[0].wrong, 7);
  EXPECT_THAT(scatter[1].status,
              StatusIs(absl::StatusCode::kInternal,
                       AllOf(HasSubstr("rank 1 of 3: reduce_scatter float64 "
                                       "count 2 max exact: the collective "
                                       "changed its input: element 0 is 99"),
                             HasSubstr("1 of 6 elements differ"))));
  for (int r : {1, 2}) EXPECT_THAT(gather[r].status, IsOk());
  for (int r : {0, 2}) EXPECT_THAT(scatter[r].status, IsOk());
}

TEST(CollectiveCasesTest, ACollectiveErrorStopsTheSuite) {
  std::vector<SuiteReport> reports(4);
  OnSim(
      4,
      [&](Communicator& comm) {
        SuiteOptions options;
        options.large_elements = 0;
        reports[comm.rank()] = RunSuite(comm, HostMemory(), options);
      },
      "kill:rank=1:op=3");
  for (int r = 0; r < 4; ++r) {
    // Cases 0, 1 and 2 pass; the fourth collective fails everywhere.
    EXPECT_EQ(reports[r].cases, 4) << r;
    EXPECT_EQ(reports[r].failed, 1) << r;
    EXPECT_FALSE(reports[r].ok());
    EXPECT_THAT(reports[r].ToStatus(),
                StatusIs(absl::StatusCode::kAborted,
                         AllOf(HasSubstr("rank 1"),
                               HasSubstr("the suite stopped there"))))
        << r;
  }
  // The collectives of count 0: two all_gathers, then reduce_scatters.
  EXPECT_THAT(std::string(reports[0].stopped.message()),
              HasSubstr("rank 0 of 4: reduce_scatter float32 count 0 sum "
                        "inexact in place: "));
}

TEST(CollectiveCasesTest, ReportListsFailures) {
  SuiteReport report;
  report.Add({}, 2);
  CaseResult bad;
  bad.status = absl::InternalError("first");
  report.Add(bad, 2);
  bad.status = absl::InternalError("second");
  report.Add(bad, 2);
  bad.status = absl::InternalError("third");
  report.Add(bad, 2);
  EXPECT_EQ(report.cases, 4);
  EXPECT_EQ(report.failed, 3);
  EXPECT_THAT(report.ToStatus(),
              StatusIs(absl::StatusCode::kInternal,
                       AllOf(HasSubstr("3 of 4 conformance cases failed"),
                             HasSubstr("first"), HasSubstr("second"),
                             Not(HasSubstr("third")), HasSubstr("..."))));
}

TEST(CollectiveCasesTest, SuiteContents) {
  SuiteOptions options;
  const std::vector<CollectiveCase> cases = CollectiveCases(4, options);
  std::vector<std::string> names;
  for (const CollectiveCase& c : cases) names.push_back(c.Name());
  EXPECT_THAT(names, Contains("all_gather bfloat16 count 1031 inexact in "
                              "place"));
  EXPECT_THAT(names, Contains("reduce_scatter float16 count 0 avg pre 3 post "
                              "7 exact"));
  EXPECT_THAT(names, Contains("broadcast float64 count 13 root 3 inexact"));
  EXPECT_THAT(names, Contains("all_reduce float32 count 2097155 sum pre 2 "
                              "post 4 exact"));
  EXPECT_THAT(names, Contains("reduce_scatter float32 count 524288 sum exact "
                              "in place"));

  std::vector<std::string> checks;
  for (const GroupCheck& g : GroupChecks(6, Device::Host(), options)) {
    checks.push_back(g.name);
  }
  EXPECT_THAT(checks, Contains("hybrid groups of 3"));
  EXPECT_THAT(checks, Contains("argument errors"));
  EXPECT_THAT(checks, Contains("exact reductions bfloat16"));
  checks.clear();
  for (const GroupCheck& g : GroupChecks(6, Device::Cuda(0), options)) {
    checks.push_back(g.name);
  }
  EXPECT_THAT(checks, Not(Contains("argument errors")));
}

TEST(CollectiveCasesTest, DigestMismatchNamesCaseAndRank) {
  const DigestTable want = ReferenceDigests(3);
  EXPECT_THAT(CompareDigests(want, want, 3), IsOk());
  DigestTable got = want;
  got[1][2] ^= 1;
  EXPECT_THAT(CompareDigests(got, want, 3),
              StatusIs(absl::StatusCode::kInternal,
                       AllOf(HasSubstr(DigestCases(3)[1].Name()),
                             HasSubstr("on rank 2 of 3"))));
  EXPECT_NE(CombineDigests(got), CombineDigests(want));
  got.pop_back();
  EXPECT_THAT(CompareDigests(got, want, 3),
              StatusIs(absl::StatusCode::kInternal));
}

TEST(CollectiveCasesTest, CorruptedDigestsAreCaught) {
  std::vector<DigestTable> tables(2);
  OnSim(2, [&](Communicator& comm) {
    CorruptingCommunicator bad(comm, 1, [](ConstBufferRef, BufferRef out) {
      if (out.count > 0) static_cast<char*>(out.data)[0] ^= 1;
    });
    auto t = ComputeDigests(bad, HostMemory());
    ASSERT_THAT(t, IsOk());
    tables[comm.rank()] = *t;
  });
  // Every rank sees rank 1's wrong digest.
  for (const DigestTable& t : tables) {
    EXPECT_THAT(
        CompareDigests(t, ReferenceDigests(2), 2),
        StatusIs(absl::StatusCode::kInternal, HasSubstr("on rank 1 of 2")));
  }
}

}  // namespace
}  // namespace conformance
}  // namespace flatparam
