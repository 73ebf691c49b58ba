// The contract of flatparam::checkpoint::FileSystem (file_system.h) as one
// test suite, run against every implementation, as comm/conformance runs
// one suite against every Communicator: the checkpoint writers' crash tests
// run on FaultInjectionFileSystem, and are worth what its agreement with
// the POSIX file system is worth.
//
//   // In an implementation's test file:
//   INSTANTIATE_TEST_SUITE_P(
//       Mine, FileSystemConformanceTest,
//       ::testing::Values(FileSystemUnderTest{"mine", [] {
//         return std::make_unique<MyFileSystemFixture>();
//       }}),
//       FileSystemUnderTestName);
//
// Ownership: each test makes its own fixture and drops it at the end.
// Thread-safety: tests run one at a time.
#ifndef TESTING_FILE_SYSTEM_CONFORMANCE_H_
#define TESTING_FILE_SYSTEM_CONFORMANCE_H_

#include <gtest/gtest.h>

#include <functional>
#include <memory>
#include <ostream>
#include <string>

#include "flatparam/checkpoint/file_system.h"

namespace flatparam {
namespace checkpoint {

// One file system under test, with an empty directory to work in.
class FileSystemFixture {
 public:
  virtual ~FileSystemFixture() = default;
  virtual FileSystem& fs() = 0;
  // An existing, empty directory that the test may fill.
  virtual std::string root() const = 0;
};

struct FileSystemUnderTest {
  std::string name;
  std::function<std::unique_ptr<FileSystemFixture>()> make;
};

// gtest prints a parameter by its name.
inline void PrintTo(const FileSystemUnderTest& f, std::ostream* os) {
  *os << f.name;
}

// For INSTANTIATE_TEST_SUITE_P's name generator.
std::string FileSystemUnderTestName(
    const ::testing::TestParamInfo<FileSystemUnderTest>& info);

// PosixFileSystem() in a fresh directory under $TEST_TMPDIR (removed at the
// end), and a FaultInjectionFileSystem rooted at "/".
std::unique_ptr<FileSystemFixture> MakePosixFixture();
std::unique_ptr<FileSystemFixture> MakeFaultInjectionFixture();

class FileSystemConformanceTest
    : public ::testing::TestWithParam<FileSystemUnderTest> {
 protected:
  void SetUp() override { fixture_ = GetParam().make(); }
  FileSystem& fs() { return fixture_->fs(); }
  std::string Path(const std::string& name) const {
    return JoinPath(fixture_->root(), name);
  }

 private:
  std::unique_ptr<FileSystemFixture> fixture_;
};

}  // namespace checkpoint
}  // namespace flatparam

#endif  // TESTING_FILE_SYSTEM_CONFORMANCE_H_
