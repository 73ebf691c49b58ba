#include "flatparam/checkpoint/internal/counting_file_system.h"

#include <utility>

#include "flatparam/base/status_macros.h"

namespace flatparam {
namespace checkpoint {
namespace internal_checkpoint {

class CountingFileSystem::File : public RandomAccessFile {
 public:
  File(CountingFileSystem* fs, std::unique_ptr<RandomAccessFile> base,
       std::string name)
      : fs_(fs), base_(std::move(base)), name_(std::move(name)) {}
  absl::Status ReadAt(uint64_t offset, absl::Span<char> out) const override {
    fs_->Count(name_, static_cast<int64_t>(out.size()));
    return base_->ReadAt(offset, out);
  }
  absl::StatusOr<uint64_t> Size() const override { return base_->Size(); }
  const std::string& name() const override { return base_->name(); }

 private:
  CountingFileSystem* fs_;
  std::unique_ptr<RandomAccessFile> base_;
  std::string name_;
};

absl::StatusOr<std::unique_ptr<RandomAccessFile>>
CountingFileSystem::NewRandomAccessFile(const std::string& path) {
  FLATPARAM_ASSIGN_OR_RETURN(std::unique_ptr<RandomAccessFile> file,
                             base().NewRandomAccessFile(path));
  return std::unique_ptr<RandomAccessFile>(
      new File(this, std::move(file), Basename(path)));
}

void CountingFileSystem::Count(const std::string& name, int64_t n) {
  absl::MutexLock lock(&mu_);
  read_[name] += n;
}

int64_t CountingFileSystem::read(const std::string& name) const {
  absl::MutexLock lock(&mu_);
  auto it = read_.find(name);
  return it == read_.end() ? 0 : it->second;
}

int64_t CountingFileSystem::total() const {
  absl::MutexLock lock(&mu_);
  int64_t t = 0;
  for (const auto& [name, n] : read_) t += n;
  return t;
}

std::map<std::string, int64_t> CountingFileSystem::read_by_file() const {
  absl::MutexLock lock(&mu_);
  return read_;
}

void CountingFileSystem::Reset() {
  absl::MutexLock lock(&mu_);
  read_.clear();
}

}  // namespace internal_checkpoint
}  // namespace checkpoint
}  // namespace flatparam
