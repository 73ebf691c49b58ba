// Test-only loading of the golden JSON files that the PyTorch conformance
// suites compare against (verify/testdata/pytorch_*.json), and the
// parameterization over their "cases".
//
//   const GoldenData& golden = LoadGoldenData(kGoldenPath);
//   ASSERT_TRUE(golden.error.empty()) << golden.error;
//   INSTANTIATE_TEST_SUITE_P(Golden, MySuite,
//                            testing::ValuesIn(GoldenCaseNames(golden)),
//                            GoldenCaseTestName);
//
// Ownership: LoadGoldenData's result lives until the process ends.
// Thread-safety: LoadGoldenData is safe to call from any thread.
#ifndef FLATPARAM_VERIFY_CONFORMANCE_GOLDEN_DATA_H_
#define FLATPARAM_VERIFY_CONFORMANCE_GOLDEN_DATA_H_

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace flatparam {
namespace verify {

struct GoldenData {
  nlohmann::json data;
  std::string error;  // non-empty when the file could not be read or parsed
};

// The file at `workspace_path` (relative to the repository root), read and
// parsed once per path. Under `bazel test` it is looked up at
// $TEST_SRCDIR/$TEST_WORKSPACE/workspace_path; when the binary runs by hand
// from the repository root, at the relative path. A missing or malformed
// file is reported in `error`, not by failing here, so that the suite can
// name it in a test.
const GoldenData& LoadGoldenData(const std::string& workspace_path);

// The parameter a suite is instantiated with when the golden data failed to
// load: one test that reports the load error instead of none at all.
inline constexpr char kGoldenLoadFailed[] = "golden data failed to load";

// The "name" of every element of golden.data["cases"], or
// {kGoldenLoadFailed}.
std::vector<std::string> GoldenCaseNames(const GoldenData& golden);

// The element of the JSON array `list` whose "name" is `name`; a null JSON
// value when there is none.
const nlohmann::json& FindByName(const nlohmann::json& list,
                                 const std::string& name);

// A gtest name for a case: its name with every character that is not a
// letter or digit replaced by '_'.
std::string GoldenCaseTestName(const testing::TestParamInfo<std::string>& info);

}  // namespace verify
}  // namespace flatparam

#endif  // FLATPARAM_VERIFY_CONFORMANCE_GOLDEN_DATA_H_
