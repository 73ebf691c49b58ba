#include "flatparam/checkpoint/file_system.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "flatparam/base/status_matchers.h"

namespace flatparam {
namespace checkpoint {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

std::string ReadAll(FileSystem& fs, const std::string& path) {
  absl::StatusOr<std::string> s = ReadFileToString(fs, path, 1 << 20);
  EXPECT_THAT(s, IsOk());
  return s.ok() ? *s : "";
}

// Writes `data` without syncing anything.
void WriteUnsynced(FileSystem& fs, const std::string& path,
                   const std::string& data) {
  auto file = fs.NewWritableFile(path);
  ASSERT_THAT(file, IsOk());
  ASSERT_THAT((*file)->Append(data), IsOk());
  ASSERT_THAT((*file)->Close(), IsOk());
}

bool Exists(FileSystem& fs, const std::string& path) {
  absl::StatusOr<bool> e = fs.Exists(path);
  EXPECT_THAT(e, IsOk());
  return e.ok() && *e;
}

TEST(PathTest, JoinDirnameBasename) {
  EXPECT_EQ(JoinPath("a", "b"), "a/b");
  EXPECT_EQ(JoinPath("a/", "b"), "a/b");
  EXPECT_EQ(JoinPath("a/", "/b"), "a/b");
  EXPECT_EQ(JoinPath("", "b"), "b");
  EXPECT_EQ(JoinPath("a", ""), "a");
  EXPECT_EQ(Dirname("a/b/c"), "a/b");
  EXPECT_EQ(Dirname("a/b/c/"), "a/b");
  EXPECT_EQ(Dirname("c"), ".");
  EXPECT_EQ(Dirname("/c"), "/");
  EXPECT_EQ(Basename("a/b/c"), "c");
  EXPECT_EQ(Basename("a/b/c//"), "c");
  EXPECT_EQ(Basename("c"), "c");
}

class PosixFileSystemTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* tmp = std::getenv("TEST_TMPDIR");
    root_ = JoinPath(
        tmp != nullptr ? tmp : "/tmp",
        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    ASSERT_THAT(RemoveRecursively(fs_, root_), IsOk());
    ASSERT_THAT(fs_.CreateDir(root_), IsOk());
  }
  std::string Path(const std::string& name) const {
    return JoinPath(root_, name);
  }

  FileSystem& fs_ = PosixFileSystem();
  std::string root_;
};

TEST_F(PosixFileSystemTest, WriteReadRenameRemove) {
  ASSERT_THAT(WriteFileDurably(fs_, Path("a"), "hello world"), IsOk());
  EXPECT_EQ(ReadAll(fs_, Path("a")), "hello world");
  FLATPARAM_ASSERT_OK_AND_ASSIGN(uint64_t size, fs_.GetFileSize(Path("a")));
  EXPECT_EQ(size, 11u);

  FLATPARAM_ASSERT_OK_AND_ASSIGN(auto file, fs_.NewRandomAccessFile(Path("a")));
  char buf[5];
  ASSERT_THAT(file->ReadAt(6, absl::MakeSpan(buf, 5)), IsOk());
  EXPECT_EQ(std::string(buf, 5), "world");
  EXPECT_THAT(file->ReadAt(7, absl::MakeSpan(buf, 5)),
              StatusIs(absl::StatusCode::kDataLoss,
                       HasSubstr("[7, 12) but the file has only 11 bytes")));

  ASSERT_THAT(fs_.CreateDir(Path("d")), IsOk());
  EXPECT_THAT(fs_.CreateDir(Path("d")),
              StatusIs(absl::StatusCode::kAlreadyExists, HasSubstr("/d")));
  ASSERT_THAT(fs_.Rename(Path("a"), Path("d/b")), IsOk());
  ASSERT_THAT(fs_.SyncDir(root_), IsOk());
  ASSERT_THAT(fs_.SyncDir(Path("d")), IsOk());
  EXPECT_FALSE(Exists(fs_, Path("a")));
  EXPECT_THAT(fs_.GetChildren(Path("d")), IsOkAndHolds(ElementsAre("b")));
  EXPECT_THAT(fs_.GetChildren(root_), IsOkAndHolds(ElementsAre("d")));
  FLATPARAM_ASSERT_OK_AND_ASSIGN(bool is_dir, fs_.IsDirectory(Path("d")));
  EXPECT_TRUE(is_dir);

  EXPECT_THAT(fs_.RemoveDir(Path("d")),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  ASSERT_THAT(RemoveRecursively(fs_, Path("d")), IsOk());
  EXPECT_THAT(fs_.GetChildren(root_), IsOkAndHolds(IsEmpty()));
  EXPECT_THAT(fs_.NewRandomAccessFile(Path("nope")),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("nope")));
  EXPECT_THAT(fs_.GetFileSize(Path("nope")),
              StatusIs(absl::StatusCode::kNotFound));
}

TEST_F(PosixFileSystemTest, ReadFileToStringEnforcesLimit) {
  ASSERT_THAT(WriteFileDurably(fs_, Path("a"), "0123456789"), IsOk());
  EXPECT_THAT(ReadFileToString(fs_, Path("a"), 9),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("10 bytes, more than the 9 allowed")));
  EXPECT_THAT(ReadFileToString(fs_, Path("a"), 10),
              IsOkAndHolds(std::string("0123456789")));
}

TEST(StringRandomAccessFileTest, ReadsWithinBounds) {
  auto file = NewStringRandomAccessFile("abcdef", "mem");
  char buf[3];
  ASSERT_THAT(file->ReadAt(3, absl::MakeSpan(buf, 3)), IsOk());
  EXPECT_EQ(std::string(buf, 3), "def");
  EXPECT_THAT(file->ReadAt(4, absl::MakeSpan(buf, 3)),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("mem")));
  EXPECT_THAT(file->ReadAt(~uint64_t{0}, absl::MakeSpan(buf, 3)),
              StatusIs(absl::StatusCode::kDataLoss));
}

// --- FaultInjectionFileSystem ------------------------------------------------

// What the conformance suite (file_system_conformance_test) does not
// cover: its own path syntax and messages.
TEST(FaultInjectionFileSystemTest, NormalisesPathsAndNamesErrors) {
  FaultInjectionFileSystem fs;
  ASSERT_THAT(fs.CreateDir("/d"), IsOk());
  WriteUnsynced(fs, "d/a", "abc");
  EXPECT_EQ(ReadAll(fs, "/d/a"), "abc");
  EXPECT_EQ(ReadAll(fs, "./d//a"), "abc");
  EXPECT_THAT(fs.GetChildren("d"), IsOkAndHolds(ElementsAre("a")));
  EXPECT_THAT(fs.Exists("d/../d"),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(fs.RemoveDir("d"), StatusIs(absl::StatusCode::kFailedPrecondition,
                                          HasSubstr("not empty")));
  EXPECT_THAT(
      fs.Rename("d", "d/x"),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("inside")));
  ASSERT_THAT(fs.CreateDir("e"), IsOk());
  WriteUnsynced(fs, "e/f", "");
  EXPECT_THAT(
      fs.Rename("d", "e"),
      StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("not empty")));
  ASSERT_THAT(RemoveRecursively(fs, "d"), IsOk());
  EXPECT_FALSE(Exists(fs, "d"));
}

TEST(FaultInjectionFileSystemTest, CrashDropsUnsyncedData) {
  FaultInjectionFileSystem fs;
  FLATPARAM_ASSERT_OK_AND_ASSIGN(auto file, fs.NewWritableFile("a"));
  ASSERT_THAT(fs.SyncDir("/"), IsOk());
  ASSERT_THAT(file->Append("durable"), IsOk());
  ASSERT_THAT(file->Sync(), IsOk());
  ASSERT_THAT(file->Append(" lost"), IsOk());
  EXPECT_EQ(ReadAll(fs, "a"), "durable lost");
  fs.Crash();
  EXPECT_EQ(ReadAll(fs, "a"), "durable");
  // The open file died with the "process".
  EXPECT_THAT(file->Append("x"), StatusIs(absl::StatusCode::kFailedPrecondition,
                                          HasSubstr("crash")));
}

TEST(FaultInjectionFileSystemTest, CrashDropsUnsyncedNames) {
  FaultInjectionFileSystem fs;
  // Synced data under an unsynced name is lost.
  ASSERT_THAT(WriteFileDurably(fs, "a", "data"), IsOk());
  // An entry made durable without its data leaves an empty file.
  WriteUnsynced(fs, "b", "data");
  ASSERT_THAT(fs.CreateDir("d"), IsOk());
  ASSERT_THAT(fs.SyncDir("/"), IsOk());                   // a, b, d durable
  ASSERT_THAT(WriteFileDurably(fs, "d/c", "c"), IsOk());  // d/c not
  fs.Crash();
  EXPECT_EQ(ReadAll(fs, "a"), "data");
  EXPECT_EQ(ReadAll(fs, "b"), "");
  EXPECT_TRUE(Exists(fs, "d"));
  EXPECT_FALSE(Exists(fs, "d/c"));
}

TEST(FaultInjectionFileSystemTest, RenameAndRemoveDurableOnlyAfterSyncDir) {
  FaultInjectionFileSystem fs;
  ASSERT_THAT(WriteFileDurably(fs, "a", "A"), IsOk());
  ASSERT_THAT(fs.CreateDir("d"), IsOk());
  ASSERT_THAT(fs.SyncDir("/"), IsOk());

  ASSERT_THAT(fs.Rename("a", "b"), IsOk());
  fs.Crash();
  EXPECT_TRUE(Exists(fs, "a"));
  EXPECT_FALSE(Exists(fs, "b"));

  ASSERT_THAT(fs.Rename("a", "b"), IsOk());
  ASSERT_THAT(fs.SyncDir("/"), IsOk());
  fs.Crash();
  EXPECT_FALSE(Exists(fs, "a"));
  EXPECT_EQ(ReadAll(fs, "b"), "A");

  ASSERT_THAT(fs.RemoveFile("b"), IsOk());
  fs.Crash();
  EXPECT_EQ(ReadAll(fs, "b"), "A");

  // Between directories, each side is durable only when its directory is
  // synced: syncing the destination alone leaves the file in both.
  ASSERT_THAT(fs.Rename("b", "d/b"), IsOk());
  ASSERT_THAT(fs.SyncDir("d"), IsOk());
  fs.Crash();
  EXPECT_EQ(ReadAll(fs, "b"), "A");
  EXPECT_EQ(ReadAll(fs, "d/b"), "A");
}

TEST(FaultInjectionFileSystemTest, RenamedDirectoryKeepsItsDurableEntries) {
  FaultInjectionFileSystem fs;
  ASSERT_THAT(fs.CreateDir("t"), IsOk());
  ASSERT_THAT(WriteFileDurably(fs, "t/f", "F"), IsOk());
  ASSERT_THAT(fs.SyncDir("t"), IsOk());
  ASSERT_THAT(fs.Rename("t", "final"), IsOk());
  ASSERT_THAT(fs.SyncDir("/"), IsOk());
  fs.Crash();
  EXPECT_FALSE(Exists(fs, "t"));
  EXPECT_EQ(ReadAll(fs, "final/f"), "F");
}

TEST(FaultInjectionFileSystemTest, FailsFromTheNthOperation) {
  FaultInjectionFileSystem fs;
  fs.FailOperationsFrom(2);
  EXPECT_THAT(fs.CreateDir("a"), IsOk());  // 0
  EXPECT_THAT(fs.CreateDir("b"), IsOk());  // 1
  EXPECT_FALSE(fs.failed());
  EXPECT_THAT(
      fs.CreateDir("c"),
      StatusIs(absl::StatusCode::kUnavailable,
               HasSubstr("injected failure at operation 2: CreateDir c")));
  EXPECT_THAT(fs.SyncDir("/"), StatusIs(absl::StatusCode::kUnavailable));
  EXPECT_TRUE(fs.failed());
  EXPECT_EQ(fs.operation_count(), 4);
  EXPECT_FALSE(Exists(fs, "c"));  // the failed operation did nothing
  // Reads still work, so a test can look at the wreck.
  EXPECT_THAT(fs.GetChildren("/"), IsOkAndHolds(ElementsAre("a", "b")));
  fs.Crash();
  EXPECT_FALSE(fs.failed());
  EXPECT_THAT(fs.GetChildren("/"), IsOkAndHolds(IsEmpty()));
  EXPECT_THAT(fs.CreateDir("c"), IsOk());
  EXPECT_THAT(fs.operation_log(), ::testing::Contains("CreateDir c"));
}

TEST(FaultInjectionFileSystemTest, CrashKeepingSomeIsSeededAndInBetween) {
  std::vector<std::string> outcomes;
  for (uint64_t seed = 0; seed < 16; ++seed) {
    FaultInjectionFileSystem fs;
    ASSERT_THAT(fs.CreateDir("d"), IsOk());
    ASSERT_THAT(fs.SyncDir("/"), IsOk());
    WriteUnsynced(fs, "d/a", "A");
    ASSERT_THAT(fs.SyncDir("d"), IsOk());
    WriteUnsynced(fs, "d/a", "B");  // data unsynced
    WriteUnsynced(fs, "d/c", "C");  // name unsynced
    fs.CrashKeepingSome(seed);
    const std::string a = ReadAll(fs, "d/a");
    EXPECT_TRUE(a == "" || a == "B") << a;
    const std::string outcome = absl::StrCat(a, Exists(fs, "d/c") ? "+c" : "");
    outcomes.push_back(outcome);

    // Same seed, same result.
    FaultInjectionFileSystem again;
    ASSERT_THAT(again.CreateDir("d"), IsOk());
    ASSERT_THAT(again.SyncDir("/"), IsOk());
    WriteUnsynced(again, "d/a", "A");
    ASSERT_THAT(again.SyncDir("d"), IsOk());
    WriteUnsynced(again, "d/a", "B");
    WriteUnsynced(again, "d/c", "C");
    again.CrashKeepingSome(seed);
    EXPECT_EQ(
        absl::StrCat(ReadAll(again, "d/a"), Exists(again, "d/c") ? "+c" : ""),
        outcome);
  }
  // Over 16 seeds both choices show up for the directory.
  EXPECT_THAT(outcomes, ::testing::Contains(::testing::HasSubstr("+c")));
  EXPECT_THAT(outcomes, ::testing::Contains(::testing::Not(HasSubstr("+c"))));
}

TEST(FaultInjectionFileSystemTest, DebugStringMarksUnsyncedState) {
  FaultInjectionFileSystem fs;
  ASSERT_THAT(fs.CreateDir("d"), IsOk());
  WriteUnsynced(fs, "d/a", "abc");
  const std::string debug = fs.DebugString();
  EXPECT_THAT(debug, HasSubstr("/d/a 3 bytes (unsynced)"));
  EXPECT_THAT(debug, HasSubstr("/ (unsynced)"));
}

}  // namespace
}  // namespace checkpoint
}  // namespace flatparam
