// Private to the project (tests and benchmarks): a FileSystem that forwards
// to another and counts, per file name, the bytes its RandomAccessFiles
// return from ReadAt -- how the tests and checkpoint_load_bench show that
// a rank reads its share of a checkpoint and not the rest.
//
// Ownership: borrows `base`, which must outlive it and the files it opens.
// Thread-safety: thread-safe if `base` is.
#ifndef FLATPARAM_CHECKPOINT_INTERNAL_COUNTING_FILE_SYSTEM_H_
#define FLATPARAM_CHECKPOINT_INTERNAL_COUNTING_FILE_SYSTEM_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "flatparam/checkpoint/file_system.h"

namespace flatparam {
namespace checkpoint {
namespace internal_checkpoint {

class CountingFileSystem : public FileSystem {
 public:
  explicit CountingFileSystem(FileSystem& base) : base_(base) {}

  // Bytes read since construction or Reset from files named `name` (the
  // last path component), and from all files. A failed read counts too:
  // its bytes were asked of the disk.
  int64_t read(const std::string& name) const;
  int64_t total() const;
  std::map<std::string, int64_t> read_by_file() const;
  void Reset();

  absl::StatusOr<std::unique_ptr<WritableFile>> NewWritableFile(
      const std::string& path) override {
    return base_.NewWritableFile(path);
  }
  absl::StatusOr<std::unique_ptr<RandomAccessFile>> NewRandomAccessFile(
      const std::string& path) override;
  absl::StatusOr<uint64_t> GetFileSize(const std::string& path) override {
    return base_.GetFileSize(path);
  }
  absl::StatusOr<bool> Exists(const std::string& path) override {
    return base_.Exists(path);
  }
  absl::StatusOr<bool> IsDirectory(const std::string& path) override {
    return base_.IsDirectory(path);
  }
  absl::StatusOr<std::vector<std::string>> GetChildren(
      const std::string& path) override {
    return base_.GetChildren(path);
  }
  absl::Status CreateDir(const std::string& path) override {
    return base_.CreateDir(path);
  }
  absl::Status RemoveFile(const std::string& path) override {
    return base_.RemoveFile(path);
  }
  absl::Status RemoveDir(const std::string& path) override {
    return base_.RemoveDir(path);
  }
  absl::Status Rename(const std::string& from, const std::string& to) override {
    return base_.Rename(from, to);
  }
  absl::Status SyncDir(const std::string& path) override {
    return base_.SyncDir(path);
  }

 private:
  class File;
  void Count(const std::string& name, int64_t n);

  FileSystem& base_;
  mutable absl::Mutex mu_;
  std::map<std::string, int64_t> read_ ABSL_GUARDED_BY(mu_);
};

}  // namespace internal_checkpoint
}  // namespace checkpoint
}  // namespace flatparam

#endif  // FLATPARAM_CHECKPOINT_INTERNAL_COUNTING_FILE_SYSTEM_H_
