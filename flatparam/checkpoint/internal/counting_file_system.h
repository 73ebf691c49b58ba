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

class CountingFileSystem : public ForwardingFileSystem {
 public:
  explicit CountingFileSystem(FileSystem& base) : ForwardingFileSystem(base) {}

  // Bytes read since construction or Reset from files named `name` (the
  // last path component), and from all files. A failed read counts too:
  // its bytes were asked of the disk.
  int64_t read(const std::string& name) const;
  int64_t total() const;
  std::map<std::string, int64_t> read_by_file() const;
  void Reset();

  absl::StatusOr<std::unique_ptr<RandomAccessFile>> NewRandomAccessFile(
      const std::string& path) override;

 private:
  class File;
  void Count(const std::string& name, int64_t n);

  mutable absl::Mutex mu_;
  std::map<std::string, int64_t> read_ ABSL_GUARDED_BY(mu_);
};

}  // namespace internal_checkpoint
}  // namespace checkpoint
}  // namespace flatparam

#endif  // FLATPARAM_CHECKPOINT_INTERNAL_COUNTING_FILE_SYSTEM_H_
