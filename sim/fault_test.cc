#include "sim/fault.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "flatparam/base/status_matchers.h"

namespace flatparam {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

TEST(ParseFaultSpecTest, Kill) {
  FLATPARAM_ASSERT_OK_AND_ASSIGN(FaultSpec f,
                                 ParseFaultSpec("kill:rank=3:op=5"));
  EXPECT_EQ(f.kind, FaultSpec::Kind::kKill);
  EXPECT_EQ(f.rank, 3);
  EXPECT_EQ(f.op, 5);
  EXPECT_EQ(f.ToString(), "kill:rank=3:op=5");
}

TEST(ParseFaultSpecTest, KeysInAnyOrderAndSurroundingSpace) {
  FLATPARAM_ASSERT_OK_AND_ASSIGN(FaultSpec f,
                                 ParseFaultSpec("  kill:op=0:rank=12 "));
  EXPECT_EQ(f.rank, 12);
  EXPECT_EQ(f.op, 0);
}

TEST(ParseFaultSpecTest, Delay) {
  FLATPARAM_ASSERT_OK_AND_ASSIGN(FaultSpec f,
                                 ParseFaultSpec("delay:rank=1:seconds=0.25"));
  EXPECT_EQ(f.kind, FaultSpec::Kind::kDelay);
  EXPECT_EQ(f.rank, 1);
  EXPECT_EQ(f.op, -1);
  EXPECT_EQ(f.delay, absl::Milliseconds(250));
  EXPECT_EQ(f.ToString(), "delay:rank=1:seconds=0.25");

  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      FaultSpec g, ParseFaultSpec("delay:rank=0:seconds=30:op=2"));
  EXPECT_EQ(g.delay, absl::Seconds(30));
  EXPECT_EQ(g.op, 2);
  EXPECT_EQ(g.ToString(), "delay:rank=0:seconds=30:op=2");
}

TEST(ParseFaultSpecTest, DelaySecondsAreExactDecimals) {
  FLATPARAM_ASSERT_OK_AND_ASSIGN(FaultSpec f,
                                 ParseFaultSpec("delay:rank=0:seconds=0.1"));
  EXPECT_EQ(f.delay, absl::Milliseconds(100));
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      f, ParseFaultSpec("delay:rank=0:seconds=1.000000001"));
  EXPECT_EQ(f.delay, absl::Seconds(1) + absl::Nanoseconds(1));
  EXPECT_EQ(f.ToString(), "delay:rank=0:seconds=1.000000001");
}

TEST(ParseFaultSpecTest, Flip) {
  FLATPARAM_ASSERT_OK_AND_ASSIGN(FaultSpec f,
                                 ParseFaultSpec("flip:rank=2:op=7"));
  EXPECT_EQ(f.kind, FaultSpec::Kind::kFlip);
  EXPECT_EQ(f.bit, -1);
  EXPECT_EQ(f.ToString(), "flip:rank=2:op=7");
  FLATPARAM_ASSERT_OK_AND_ASSIGN(f, ParseFaultSpec("flip:rank=2:op=7:bit=100"));
  EXPECT_EQ(f.bit, 100);
  EXPECT_EQ(f.ToString(), "flip:rank=2:op=7:bit=100");
}

TEST(ParseFaultSpecTest, ToStringRoundTrips) {
  for (const char* spec : {"kill:rank=0:op=0", "delay:rank=7:seconds=3.5",
                           "delay:rank=7:seconds=0:op=9", "flip:rank=1:op=2",
                           "flip:rank=1:op=2:bit=0"}) {
    FLATPARAM_ASSERT_OK_AND_ASSIGN(FaultSpec f, ParseFaultSpec(spec));
    EXPECT_EQ(f.ToString(), spec);
    FLATPARAM_ASSERT_OK_AND_ASSIGN(FaultSpec g, ParseFaultSpec(f.ToString()));
    EXPECT_EQ(f, g);
  }
}

TEST(ParseFaultSpecTest, BadSpecsNameTheProblem) {
  struct Case {
    const char* spec;
    const char* message;
  };
  const Case cases[] = {
      {"", "unknown fault kind \"\""},
      {"explode:rank=1", "unknown fault kind \"explode\""},
      {"kill:rank=1", "kill needs op="},
      {"kill:op=1", "kill needs rank="},
      {"delay:rank=1", "delay needs seconds="},
      {"flip:rank=1", "flip needs op="},
      {"kill:rank=1:op=2:bit=3", "kill takes no key \"bit\""},
      {"delay:rank=1:seconds=1:bit=3", "delay takes no key \"bit\""},
      {"kill:rank=1:rank=2:op=0", "key \"rank\" is repeated"},
      {"kill:rank:op=0", "\"rank\" is not key=value"},
      {"kill:=1:op=0", "\"=1\" is not key=value"},
      {"kill:rank=-1:op=0", "rank=-1 is not a non-negative integer"},
      {"kill:rank=x:op=0", "rank=x is not a non-negative integer"},
      {"kill:rank=1:op=1.5", "op=1.5 is not a non-negative integer"},
      {"kill:rank=99999999999:op=0", "rank=99999999999 is too large"},
      {"delay:rank=1:seconds=-1", "seconds=-1 is not a non-negative decimal"},
      {"delay:rank=1:seconds=1e3", "seconds=1e3 is not a non-negative"},
      {"delay:rank=1:seconds=inf", "seconds=inf is not a non-negative"},
      {"delay:rank=1:seconds=", "seconds= is not a non-negative"},
      {"flip:rank=1:op=1:bit=-4", "bit=-4 is not a non-negative integer"},
  };
  for (const Case& c : cases) {
    EXPECT_THAT(ParseFaultSpec(c.spec),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         AllOf(HasSubstr(c.message),
                               HasSubstr(absl::StrCat("\"", c.spec, "\"")),
                               HasSubstr("expected kill:rank=R:op=K"))))
        << c.spec;
  }
}

TEST(ParseFaultSpecsTest, ListsSplitOnCommaOrSemicolon) {
  FLATPARAM_ASSERT_OK_AND_ASSIGN(
      std::vector<FaultSpec> faults,
      ParseFaultSpecs("kill:rank=1:op=2, flip:rank=0:op=1;delay:rank=2:"
                      "seconds=1;"));
  ASSERT_EQ(faults.size(), 3);
  EXPECT_EQ(faults[0].ToString(), "kill:rank=1:op=2");
  EXPECT_EQ(faults[1].ToString(), "flip:rank=0:op=1");
  EXPECT_EQ(faults[2].ToString(), "delay:rank=2:seconds=1");

  FLATPARAM_ASSERT_OK_AND_ASSIGN(faults, ParseFaultSpecs(""));
  EXPECT_TRUE(faults.empty());

  EXPECT_THAT(ParseFaultSpecs("kill:rank=1:op=2,kill:rank=1"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("\"kill:rank=1\"")));
}

TEST(FaultKindNameTest, Names) {
  EXPECT_EQ(FaultKindName(FaultSpec::Kind::kKill), "kill");
  EXPECT_EQ(FaultKindName(FaultSpec::Kind::kDelay), "delay");
  EXPECT_EQ(FaultKindName(FaultSpec::Kind::kFlip), "flip");
}

}  // namespace
}  // namespace flatparam
