// Runs the fuzz target (safetensors_fuzz.cc) as an ordinary test: over the
// checked-in seeds, then over deterministic random mutations of them. A
// finding aborts the process with the reason.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "flatparam/base/status_matchers.h"
#include "flatparam/checkpoint/file_system.h"
#include "flatparam/checkpoint/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace flatparam {
namespace checkpoint {
namespace {

constexpr int kMutations = 6000;

std::string SeedDir() {
  const std::string path = "flatparam/checkpoint/testdata/safetensors";
  const char* srcdir = std::getenv("TEST_SRCDIR");
  const char* workspace = std::getenv("TEST_WORKSPACE");
  if (srcdir == nullptr || workspace == nullptr) return path;
  return absl::StrCat(srcdir, "/", workspace, "/", path);
}

struct Seed {
  std::string name;
  std::string bytes;
};

std::vector<Seed> LoadSeeds() {
  std::vector<Seed> seeds;
  FileSystem& fs = PosixFileSystem();
  absl::StatusOr<std::vector<std::string>> names = fs.GetChildren(SeedDir());
  EXPECT_THAT(names, IsOk());
  if (!names.ok()) return seeds;
  for (const std::string& name : *names) {
    absl::StatusOr<std::string> bytes =
        ReadFileToString(fs, JoinPath(SeedDir(), name), 1 << 20);
    EXPECT_THAT(bytes, IsOk());
    if (bytes.ok()) seeds.push_back({name, *bytes});
  }
  return seeds;
}

int RunTarget(const std::string& bytes) {
  return LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(bytes.data()),
                                bytes.size());
}

TEST(SafetensorsFuzzTest, SeedsBehaveAsNamed) {
  const std::vector<Seed> seeds = LoadSeeds();
  ASSERT_GE(seeds.size(), 20u);
  for (const Seed& seed : seeds) {
    SCOPED_TRACE(seed.name);
    EXPECT_EQ(RunTarget(seed.bytes), 0);
    absl::StatusOr<SafetensorsReader> reader = SafetensorsReader::Open(
        NewStringRandomAccessFile(seed.bytes, seed.name));
    if (absl::StartsWith(seed.name, "valid_")) {
      EXPECT_THAT(reader, IsOk());
    } else {
      EXPECT_THAT(reader, StatusIs(absl::StatusCode::kDataLoss));
    }
  }
}

// One random edit of `bytes`, biased towards the places that matter: the
// length prefix and the digits and punctuation of the header.
void Mutate(std::mt19937_64& random, const std::vector<Seed>& seeds,
            std::string& bytes) {
  auto below = [&random](uint64_t n) {
    return n == 0 ? 0 : static_cast<size_t>(random() % n);
  };
  static const char kInteresting[] = {'\0', '\xff', '{', '}', '[', ']', '"',
                                      ',',  ':',    '-', '0', '9', ' ', '.'};
  switch (random() % 8) {
    case 0:  // flip a bit
      if (!bytes.empty()) bytes[below(bytes.size())] ^= 1 << below(8);
      break;
    case 1:  // an interesting byte
      if (!bytes.empty()) {
        bytes[below(bytes.size())] = kInteresting[below(sizeof(kInteresting))];
      }
      break;
    case 2:  // truncate
      bytes.resize(below(bytes.size() + 1));
      break;
    case 3: {  // duplicate a piece somewhere
      if (bytes.empty()) break;
      const size_t from = below(bytes.size());
      const size_t len = below(std::min<size_t>(16, bytes.size() - from) + 1);
      bytes.insert(below(bytes.size() + 1), bytes.substr(from, len));
      break;
    }
    case 4: {  // nudge or replace the header length
      if (bytes.size() < 8) break;
      uint64_t n = 0;
      for (int i = 0; i < 8; ++i) {
        n |= static_cast<uint64_t>(static_cast<unsigned char>(bytes[i]))
             << (8 * i);
      }
      n = (random() % 4 == 0) ? random() : n + below(33) - 16;
      for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>(n >> (8 * i));
      break;
    }
    case 5: {  // change a digit of the header (offsets, shapes)
      std::vector<size_t> digits;
      for (size_t i = 8; i < bytes.size() && i < 4096; ++i) {
        if (bytes[i] >= '0' && bytes[i] <= '9') digits.push_back(i);
      }
      if (!digits.empty())
        bytes[digits[below(digits.size())]] = '0' + below(10);
      break;
    }
    case 6: {  // insert a large number into the header
      const size_t at = std::min<size_t>(bytes.size(), 8 + below(64));
      bytes.insert(at, std::to_string(random()));
      break;
    }
    case 7: {  // splice with another seed
      const std::string& other = seeds[below(seeds.size())].bytes;
      bytes = bytes.substr(0, below(bytes.size() + 1)) +
              other.substr(below(other.size() + 1));
      break;
    }
  }
}

TEST(SafetensorsFuzzTest, DeterministicMutationsNeverCrash) {
  const std::vector<Seed> seeds = LoadSeeds();
  ASSERT_FALSE(seeds.empty());
  std::mt19937_64 random(20240607);
  int accepted = 0;
  for (int i = 0; i < kMutations; ++i) {
    std::string bytes = seeds[random() % seeds.size()].bytes;
    const int edits = 1 + static_cast<int>(random() % 3);
    for (int e = 0; e < edits; ++e) Mutate(random, seeds, bytes);
    ASSERT_EQ(RunTarget(bytes), 0);
    accepted +=
        SafetensorsReader::Open(NewStringRandomAccessFile(bytes, "mutant"))
            .ok();
  }
  // Some mutants stay valid (e.g. edits inside tensor data), most do not:
  // both paths of the target ran.
  EXPECT_GT(accepted, 0);
  EXPECT_LT(accepted, kMutations);
}

}  // namespace
}  // namespace checkpoint
}  // namespace flatparam
