// Runs a pickle reader's fuzz target (torch_save_fuzz.cc,
// dcp_metadata_fuzz.cc) as an ordinary test: over its checked-in seeds
// (the folder FUZZ_SEEDS names, relative to the workspace: pickles, whole
// files, and the hostile shapes found so far), then over deterministic
// random mutations of them. A finding aborts the process with the reason.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "flatparam/base/status_matchers.h"
#include "flatparam/checkpoint/file_system.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace flatparam {
namespace libtorch {
namespace {

using checkpoint::FileSystem;

constexpr int kMutations = 3000;

std::string SeedDir() {
  const char* seeds = std::getenv("FUZZ_SEEDS");
  const std::string path = seeds != nullptr ? seeds : "";
  const char* srcdir = std::getenv("TEST_SRCDIR");
  const char* workspace = std::getenv("TEST_WORKSPACE");
  if (srcdir == nullptr || workspace == nullptr) return path;
  return absl::StrCat(srcdir, "/", workspace, "/", path);
}

std::vector<std::string> LoadSeeds() {
  std::vector<std::string> seeds;
  FileSystem& fs = checkpoint::PosixFileSystem();
  absl::StatusOr<std::vector<std::string>> names = fs.GetChildren(SeedDir());
  EXPECT_THAT(names, IsOk());
  if (!names.ok()) return seeds;
  for (const std::string& name : *names) {
    absl::StatusOr<std::string> bytes = checkpoint::ReadFileToString(
        fs, checkpoint::JoinPath(SeedDir(), name), 1 << 20);
    EXPECT_THAT(bytes, IsOk());
    if (bytes.ok()) seeds.push_back(*bytes);
  }
  return seeds;
}

int RunTarget(const std::string& bytes) {
  return LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(bytes.data()),
                                bytes.size());
}

TEST(PickleFuzzTest, SeedsNeverCrash) {
  const std::vector<std::string> seeds = LoadSeeds();
  ASSERT_GE(seeds.size(), 5u) << SeedDir();
  for (const std::string& seed : seeds) EXPECT_EQ(RunTarget(seed), 0);
}

// One random edit, biased towards what a pickle is made of: opcodes that
// build containers, memo traffic, and lengths.
void Mutate(std::mt19937_64& random, const std::vector<std::string>& seeds,
            std::string& bytes) {
  auto below = [&random](uint64_t n) {
    return n == 0 ? 0 : static_cast<size_t>(random() % n);
  };
  static const char kOpcodes[] = {
      ']',    '}',    ')',    '(',    'a',    'e',    's',    'u', 't', 'q',
      'h',    'r',    'j',    'R',    'Q',    '.',    'K',    'M', 'J', 'X',
      '\x8c', '\x85', '\x86', '\x87', '\x88', '\x89', '\xff', '\0'};
  switch (random() % 6) {
    case 0:  // flip a bit (not the mode byte)
      if (bytes.size() > 1) bytes[1 + below(bytes.size() - 1)] ^= 1 << below(8);
      break;
    case 1:  // an opcode
      if (bytes.size() > 1) {
        bytes[1 + below(bytes.size() - 1)] = kOpcodes[below(sizeof(kOpcodes))];
      }
      break;
    case 2:  // truncate
      bytes.resize(1 + below(bytes.size()));
      break;
    case 3: {  // duplicate a piece somewhere
      if (bytes.size() < 2) break;
      const size_t from = 1 + below(bytes.size() - 1);
      const size_t len = below(std::min<size_t>(32, bytes.size() - from) + 1);
      bytes.insert(1 + below(bytes.size()), bytes.substr(from, len));
      break;
    }
    case 4: {  // a run of container opcodes
      const std::string run(below(64) + 1, kOpcodes[below(8)]);
      bytes.insert(1 + below(bytes.size()), run);
      break;
    }
    case 5: {  // splice with another seed
      const std::string& other = seeds[below(seeds.size())];
      bytes = bytes.substr(0, 1 + below(bytes.size())) +
              other.substr(1 + below(other.size()));
      break;
    }
  }
}

TEST(PickleFuzzTest, DeterministicMutationsNeverCrash) {
  // The small seeds: a mutant of the 200,000-deep one costs a whole parse
  // of it, and its mutations find nothing the small ones do not.
  std::vector<std::string> seeds;
  for (std::string& s : LoadSeeds()) {
    if (s.size() <= (64 << 10)) seeds.push_back(std::move(s));
  }
  ASSERT_FALSE(seeds.empty());
  std::mt19937_64 random(20261206);
  for (int i = 0; i < kMutations; ++i) {
    std::string bytes = seeds[random() % seeds.size()];
    const int edits = 1 + static_cast<int>(random() % 3);
    for (int e = 0; e < edits; ++e) Mutate(random, seeds, bytes);
    ASSERT_EQ(RunTarget(bytes), 0);
  }
}

}  // namespace
}  // namespace libtorch
}  // namespace flatparam
