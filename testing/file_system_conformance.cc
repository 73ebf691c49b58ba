#include "testing/file_system_conformance.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "flatparam/base/status_matchers.h"

namespace flatparam {
namespace checkpoint {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;

class PosixFixture : public FileSystemFixture {
 public:
  PosixFixture() {
    const char* tmp = std::getenv("TEST_TMPDIR");
    std::string pattern =
        JoinPath(tmp != nullptr ? tmp : "/tmp", "fs_conformance.XXXXXX");
    if (mkdtemp(pattern.data()) == nullptr) {
      ADD_FAILURE() << "mkdtemp " << pattern << " failed";
    }
    root_ = pattern;
  }
  ~PosixFixture() override {
    EXPECT_THAT(RemoveRecursively(PosixFileSystem(), root_), IsOk());
  }
  FileSystem& fs() override { return PosixFileSystem(); }
  std::string root() const override { return root_; }

 private:
  std::string root_;
};

class FaultInjectionFixture : public FileSystemFixture {
 public:
  FileSystem& fs() override { return fs_; }
  std::string root() const override { return "/"; }

 private:
  FaultInjectionFileSystem fs_;
};

void Write(FileSystem& fs, const std::string& path, const std::string& data) {
  absl::StatusOr<std::unique_ptr<WritableFile>> file = fs.NewWritableFile(path);
  ASSERT_THAT(file, IsOk());
  ASSERT_THAT((*file)->Append(data), IsOk());
  ASSERT_THAT((*file)->Close(), IsOk());
}

std::string Read(FileSystem& fs, const std::string& path) {
  absl::StatusOr<std::string> data = ReadFileToString(fs, path, 1 << 20);
  EXPECT_THAT(data, IsOk());
  return data.ok() ? *data : "<unreadable>";
}

bool Exists(FileSystem& fs, const std::string& path) {
  absl::StatusOr<bool> e = fs.Exists(path);
  EXPECT_THAT(e, IsOk());
  return e.ok() && *e;
}

TEST_P(FileSystemConformanceTest, WrittenBytesReadBackAtAnyOffset) {
  Write(fs(), Path("f"), "hello, ");
  {
    absl::StatusOr<std::unique_ptr<WritableFile>> f =
        fs().NewWritableFile(Path("g"));
    ASSERT_THAT(f, IsOk());
    ASSERT_THAT((*f)->Append("hello, "), IsOk());
    ASSERT_THAT((*f)->Append("world"), IsOk());
    ASSERT_THAT((*f)->Sync(), IsOk());
    ASSERT_THAT((*f)->Close(), IsOk());
  }
  EXPECT_THAT(fs().GetFileSize(Path("g")), IsOkAndHolds(12));
  absl::StatusOr<std::unique_ptr<RandomAccessFile>> r =
      fs().NewRandomAccessFile(Path("g"));
  ASSERT_THAT(r, IsOk());
  EXPECT_THAT((*r)->Size(), IsOkAndHolds(12));
  std::string out(5, '?');
  ASSERT_THAT((*r)->ReadAt(7, absl::MakeSpan(out)), IsOk());
  EXPECT_EQ(out, "world");
  ASSERT_THAT((*r)->ReadAt(12, absl::Span<char>()), IsOk());
  // Past the end: DataLoss, and the name of the file.
  const absl::Status past = (*r)->ReadAt(8, absl::MakeSpan(out));
  EXPECT_EQ(past.code(), absl::StatusCode::kDataLoss) << past;
  EXPECT_THAT(std::string(past.message()), ::testing::HasSubstr("g"));
}

TEST_P(FileSystemConformanceTest, NewWritableFileTruncates) {
  Write(fs(), Path("f"), "a long first version");
  Write(fs(), Path("f"), "short");
  EXPECT_EQ(Read(fs(), Path("f")), "short");
}

TEST_P(FileSystemConformanceTest, AppendAfterCloseFails) {
  absl::StatusOr<std::unique_ptr<WritableFile>> f =
      fs().NewWritableFile(Path("f"));
  ASSERT_THAT(f, IsOk());
  ASSERT_THAT((*f)->Close(), IsOk());
  EXPECT_EQ((*f)->Append("x").code(), absl::StatusCode::kFailedPrecondition);
}

TEST_P(FileSystemConformanceTest, MissingPathsAreNotFound) {
  const std::string missing = Path("missing");
  EXPECT_FALSE(Exists(fs(), missing));
  EXPECT_EQ(fs().NewRandomAccessFile(missing).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(fs().GetFileSize(missing).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(fs().IsDirectory(missing).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(fs().GetChildren(missing).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(fs().RemoveFile(missing).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(fs().RemoveDir(missing).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(fs().Rename(missing, Path("other")).code(),
            absl::StatusCode::kNotFound);
  // A missing parent.
  EXPECT_EQ(fs().CreateDir(Path("missing/d")).code(),
            absl::StatusCode::kNotFound);
  EXPECT_FALSE(fs().NewWritableFile(Path("missing/f")).ok());
}

TEST_P(FileSystemConformanceTest, CreateDirOnAnExistingPathIsAlreadyExists) {
  ASSERT_THAT(fs().CreateDir(Path("d")), IsOk());
  Write(fs(), Path("f"), "x");
  EXPECT_EQ(fs().CreateDir(Path("d")).code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(fs().CreateDir(Path("f")).code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(fs().IsDirectory(Path("d")), IsOkAndHolds(true));
  EXPECT_THAT(fs().IsDirectory(Path("f")), IsOkAndHolds(false));
}

TEST_P(FileSystemConformanceTest, ChildrenAreSortedNames) {
  ASSERT_THAT(fs().CreateDir(Path("d")), IsOk());
  EXPECT_THAT(fs().GetChildren(Path("d")), IsOkAndHolds(IsEmpty()));
  Write(fs(), Path("d/b"), "");
  Write(fs(), Path("d/a.json"), "{}");
  ASSERT_THAT(fs().CreateDir(Path("d/c")), IsOk());
  Write(fs(), Path("d/c/deeper"), "");
  EXPECT_THAT(fs().GetChildren(Path("d")),
              IsOkAndHolds(ElementsAre("a.json", "b", "c")));
  EXPECT_FALSE(fs().GetChildren(Path("d/b")).ok());  // a file
}

TEST_P(FileSystemConformanceTest, RemoveKindsAreChecked) {
  ASSERT_THAT(fs().CreateDir(Path("d")), IsOk());
  Write(fs(), Path("d/f"), "x");
  EXPECT_EQ(fs().RemoveDir(Path("d")).code(),  // not empty
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(fs().RemoveFile(Path("d")).code(),  // a directory
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(fs().RemoveDir(Path("d/f")).code(),  // a file
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(Read(fs(), Path("d/f")), "x");
  ASSERT_THAT(fs().RemoveFile(Path("d/f")), IsOk());
  ASSERT_THAT(fs().RemoveDir(Path("d")), IsOk());
  EXPECT_FALSE(Exists(fs(), Path("d")));
}

TEST_P(FileSystemConformanceTest, RenameReplacesAFile) {
  Write(fs(), Path("new"), "new");
  Write(fs(), Path("old"), "old");
  ASSERT_THAT(fs().Rename(Path("new"), Path("old")), IsOk());
  EXPECT_FALSE(Exists(fs(), Path("new")));
  EXPECT_EQ(Read(fs(), Path("old")), "new");
  // Into another directory.
  ASSERT_THAT(fs().CreateDir(Path("d")), IsOk());
  ASSERT_THAT(fs().Rename(Path("old"), Path("d/moved")), IsOk());
  EXPECT_EQ(Read(fs(), Path("d/moved")), "new");
}

TEST_P(FileSystemConformanceTest, RenameOfADirectoryReplacesOnlyAnEmptyOne) {
  ASSERT_THAT(fs().CreateDir(Path("a")), IsOk());
  Write(fs(), Path("a/f"), "in a");
  ASSERT_THAT(fs().CreateDir(Path("empty")), IsOk());
  ASSERT_THAT(fs().CreateDir(Path("full")), IsOk());
  Write(fs(), Path("full/g"), "in full");
  Write(fs(), Path("file"), "a file");
  EXPECT_EQ(fs().Rename(Path("a"), Path("full")).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(fs().Rename(Path("a"), Path("file")).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(fs().Rename(Path("file"), Path("empty")).code(),
            absl::StatusCode::kFailedPrecondition);
  // Into itself.
  EXPECT_EQ(fs().Rename(Path("a"), Path("a/inside")).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Read(fs(), Path("full/g")), "in full");
  EXPECT_EQ(Read(fs(), Path("file")), "a file");
  ASSERT_THAT(fs().Rename(Path("a"), Path("empty")), IsOk());
  EXPECT_FALSE(Exists(fs(), Path("a")));
  EXPECT_EQ(Read(fs(), Path("empty/f")), "in a");
  // The moved directory keeps working under its new name.
  Write(fs(), Path("empty/h"), "after");
  EXPECT_THAT(fs().GetChildren(Path("empty")),
              IsOkAndHolds(ElementsAre("f", "h")));
}

TEST_P(FileSystemConformanceTest, SyncDirNeedsADirectory) {
  ASSERT_THAT(fs().CreateDir(Path("d")), IsOk());
  EXPECT_THAT(fs().SyncDir(Path("d")), IsOk());
  EXPECT_EQ(fs().SyncDir(Path("missing")).code(), absl::StatusCode::kNotFound);
}

}  // namespace

std::string FileSystemUnderTestName(
    const ::testing::TestParamInfo<FileSystemUnderTest>& info) {
  return info.param.name;
}

std::unique_ptr<FileSystemFixture> MakePosixFixture() {
  return std::make_unique<PosixFixture>();
}

std::unique_ptr<FileSystemFixture> MakeFaultInjectionFixture() {
  return std::make_unique<FaultInjectionFixture>();
}

}  // namespace checkpoint
}  // namespace flatparam
