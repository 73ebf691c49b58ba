#include "flatparam/checkpoint/file_system.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <cassert>
#include <cerrno>
#include <random>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "flatparam/base/status_macros.h"

namespace flatparam {
namespace checkpoint {
namespace {

absl::Status PosixError(absl::string_view context, int error_number) {
  return absl::ErrnoToStatus(error_number, context);
}

class PosixWritableFile : public WritableFile {
 public:
  PosixWritableFile(int fd, std::string path)
      : fd_(fd), path_(std::move(path)) {}
  ~PosixWritableFile() override {
    if (fd_ >= 0) ::close(fd_);
  }

  absl::Status Append(absl::string_view data) override {
    if (fd_ < 0) return Closed();
    const char* p = data.data();
    size_t left = data.size();
    while (left > 0) {
      const ssize_t n = ::write(fd_, p, left);
      if (n < 0) {
        if (errno == EINTR) continue;
        return PosixError(absl::StrCat("write ", path_), errno);
      }
      p += n;
      left -= static_cast<size_t>(n);
    }
    return absl::OkStatus();
  }

  absl::Status Sync() override {
    if (fd_ < 0) return Closed();
#ifdef __APPLE__
    // fsync on macOS does not reach the platter; F_FULLFSYNC does.
    if (::fcntl(fd_, F_FULLFSYNC) == 0) return absl::OkStatus();
#endif
    if (::fsync(fd_) != 0) {
      return PosixError(absl::StrCat("fsync ", path_), errno);
    }
    return absl::OkStatus();
  }

  absl::Status Close() override {
    if (fd_ < 0) return Closed();
    const int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0) {
      return PosixError(absl::StrCat("close ", path_), errno);
    }
    return absl::OkStatus();
  }

 private:
  absl::Status Closed() const {
    return absl::FailedPreconditionError(
        absl::StrCat(path_, ": file is already closed"));
  }

  int fd_;
  std::string path_;
};

class PosixRandomAccessFile : public RandomAccessFile {
 public:
  PosixRandomAccessFile(int fd, std::string path)
      : fd_(fd), path_(std::move(path)) {}
  ~PosixRandomAccessFile() override { ::close(fd_); }

  absl::Status ReadAt(uint64_t offset, absl::Span<char> out) const override {
    char* p = out.data();
    size_t left = out.size();
    uint64_t at = offset;
    while (left > 0) {
      const ssize_t n = ::pread(fd_, p, left, static_cast<off_t>(at));
      if (n < 0) {
        if (errno == EINTR) continue;
        return PosixError(absl::StrCat("read ", path_), errno);
      }
      if (n == 0) {
        absl::StatusOr<uint64_t> size = Size();
        return absl::DataLossError(absl::StrFormat(
            "%s: reading bytes [%d, %d) but the file has only %s bytes", path_,
            offset, offset + out.size(),
            size.ok() ? absl::StrCat(*size) : "an unknown number of"));
      }
      p += n;
      at += static_cast<uint64_t>(n);
      left -= static_cast<size_t>(n);
    }
    return absl::OkStatus();
  }

  absl::StatusOr<uint64_t> Size() const override {
    struct stat st;
    if (::fstat(fd_, &st) != 0) {
      return PosixError(absl::StrCat("stat ", path_), errno);
    }
    return static_cast<uint64_t>(st.st_size);
  }

  const std::string& name() const override { return path_; }

 private:
  int fd_;
  std::string path_;
};

class PosixFileSystemImpl : public FileSystem {
 public:
  absl::StatusOr<std::unique_ptr<WritableFile>> NewWritableFile(
      const std::string& path) override {
    const int fd =
        ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) return PosixError(absl::StrCat("create ", path), errno);
    return std::unique_ptr<WritableFile>(new PosixWritableFile(fd, path));
  }

  absl::StatusOr<std::unique_ptr<RandomAccessFile>> NewRandomAccessFile(
      const std::string& path) override {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return PosixError(absl::StrCat("open ", path), errno);
    return std::unique_ptr<RandomAccessFile>(
        new PosixRandomAccessFile(fd, path));
  }

  absl::StatusOr<uint64_t> GetFileSize(const std::string& path) override {
    struct stat st;
    if (::stat(path.c_str(), &st) != 0) {
      return PosixError(absl::StrCat("stat ", path), errno);
    }
    return static_cast<uint64_t>(st.st_size);
  }

  absl::StatusOr<bool> Exists(const std::string& path) override {
    struct stat st;
    if (::stat(path.c_str(), &st) == 0) return true;
    if (errno == ENOENT) return false;
    return PosixError(absl::StrCat("stat ", path), errno);
  }

  absl::StatusOr<bool> IsDirectory(const std::string& path) override {
    struct stat st;
    if (::stat(path.c_str(), &st) != 0) {
      return PosixError(absl::StrCat("stat ", path), errno);
    }
    return S_ISDIR(st.st_mode);
  }

  absl::StatusOr<std::vector<std::string>> GetChildren(
      const std::string& path) override {
    DIR* dir = ::opendir(path.c_str());
    if (dir == nullptr) {
      return PosixError(absl::StrCat("opendir ", path), errno);
    }
    std::vector<std::string> names;
    errno = 0;
    while (struct dirent* entry = ::readdir(dir)) {
      const absl::string_view name = entry->d_name;
      if (name != "." && name != "..") names.emplace_back(name);
      errno = 0;
    }
    const int error = errno;
    ::closedir(dir);
    if (error != 0) return PosixError(absl::StrCat("readdir ", path), error);
    std::sort(names.begin(), names.end());
    return names;
  }

  absl::Status CreateDir(const std::string& path) override {
    if (::mkdir(path.c_str(), 0755) != 0) {
      return PosixError(absl::StrCat("mkdir ", path), errno);
    }
    return absl::OkStatus();
  }

  absl::Status RemoveFile(const std::string& path) override {
    if (::unlink(path.c_str()) != 0) {
      return PosixError(absl::StrCat("unlink ", path), errno);
    }
    return absl::OkStatus();
  }

  absl::Status RemoveDir(const std::string& path) override {
    if (::rmdir(path.c_str()) != 0) {
      return PosixError(absl::StrCat("rmdir ", path), errno);
    }
    return absl::OkStatus();
  }

  absl::Status Rename(const std::string& from, const std::string& to) override {
    if (::rename(from.c_str(), to.c_str()) != 0) {
      return PosixError(absl::StrCat("rename ", from, " to ", to), errno);
    }
    return absl::OkStatus();
  }

  absl::Status SyncDir(const std::string& path) override {
    const int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return PosixError(absl::StrCat("open ", path), errno);
    absl::Status status;
    if (::fsync(fd) != 0) {
      status = PosixError(absl::StrCat("fsync directory ", path), errno);
    }
    ::close(fd);
    return status;
  }
};

class StringRandomAccessFile : public RandomAccessFile {
 public:
  StringRandomAccessFile(std::string contents, std::string name)
      : contents_(std::move(contents)), name_(std::move(name)) {}

  absl::Status ReadAt(uint64_t offset, absl::Span<char> out) const override {
    if (offset > contents_.size() || out.size() > contents_.size() - offset) {
      return absl::DataLossError(absl::StrFormat(
          "%s: reading bytes [%d, %d) but the file has only %d bytes", name_,
          offset, offset + out.size(), contents_.size()));
    }
    std::copy_n(contents_.data() + offset, out.size(), out.data());
    return absl::OkStatus();
  }
  absl::StatusOr<uint64_t> Size() const override { return contents_.size(); }
  const std::string& name() const override { return name_; }

 private:
  std::string contents_;
  std::string name_;
};

}  // namespace

FileSystem& PosixFileSystem() {
  static FileSystem* fs = new PosixFileSystemImpl;
  return *fs;
}

std::string JoinPath(absl::string_view a, absl::string_view b) {
  if (a.empty()) return std::string(b);
  if (b.empty()) return std::string(a);
  const bool a_slash = a.back() == '/';
  const bool b_slash = b.front() == '/';
  if (a_slash && b_slash) return absl::StrCat(a, b.substr(1));
  if (a_slash || b_slash) return absl::StrCat(a, b);
  return absl::StrCat(a, "/", b);
}

namespace {
absl::string_view StripTrailingSlashes(absl::string_view path) {
  while (path.size() > 1 && path.back() == '/') path.remove_suffix(1);
  return path;
}
}  // namespace

std::string Dirname(absl::string_view path) {
  path = StripTrailingSlashes(path);
  const size_t slash = path.rfind('/');
  if (slash == absl::string_view::npos) return ".";
  if (slash == 0) return "/";
  return std::string(StripTrailingSlashes(path.substr(0, slash)));
}

std::string Basename(absl::string_view path) {
  path = StripTrailingSlashes(path);
  const size_t slash = path.rfind('/');
  if (slash == absl::string_view::npos || path == "/") {
    return std::string(path);
  }
  return std::string(path.substr(slash + 1));
}

absl::StatusOr<std::string> ReadFileToString(FileSystem& fs,
                                             const std::string& path,
                                             uint64_t max_bytes) {
  FLATPARAM_ASSIGN_OR_RETURN(std::unique_ptr<RandomAccessFile> file,
                             fs.NewRandomAccessFile(path));
  FLATPARAM_ASSIGN_OR_RETURN(const uint64_t size, file->Size());
  if (size > max_bytes) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: file has %d bytes, more than the %d allowed", path,
                        size, max_bytes));
  }
  std::string contents(size, '\0');
  FLATPARAM_RETURN_IF_ERROR(
      file->ReadAt(0, absl::MakeSpan(contents.data(), contents.size())));
  return contents;
}

absl::Status WriteFileDurably(FileSystem& fs, const std::string& path,
                              absl::string_view data) {
  FLATPARAM_ASSIGN_OR_RETURN(std::unique_ptr<WritableFile> file,
                             fs.NewWritableFile(path));
  FLATPARAM_RETURN_IF_ERROR(file->Append(data));
  FLATPARAM_RETURN_IF_ERROR(file->Sync());
  return file->Close();
}

absl::Status RemoveRecursively(FileSystem& fs, const std::string& path) {
  FLATPARAM_ASSIGN_OR_RETURN(const bool exists, fs.Exists(path));
  if (!exists) return absl::OkStatus();
  FLATPARAM_ASSIGN_OR_RETURN(const bool is_dir, fs.IsDirectory(path));
  if (!is_dir) return fs.RemoveFile(path);
  FLATPARAM_ASSIGN_OR_RETURN(std::vector<std::string> children,
                             fs.GetChildren(path));
  for (const std::string& child : children) {
    FLATPARAM_RETURN_IF_ERROR(RemoveRecursively(fs, JoinPath(path, child)));
  }
  return fs.RemoveDir(path);
}

std::unique_ptr<RandomAccessFile> NewStringRandomAccessFile(
    std::string contents, std::string name) {
  return std::make_unique<StringRandomAccessFile>(std::move(contents),
                                                  std::move(name));
}

// ---------------------------------------------------------------------------
// FaultInjectionFileSystem

namespace {
constexpr uint64_t kRoot = 0;
}  // namespace

class FaultInjectionFileSystem::File : public WritableFile {
 public:
  File(FaultInjectionFileSystem* fs, uint64_t node, uint64_t epoch,
       std::string path)
      : fs_(fs), node_(node), epoch_(epoch), path_(std::move(path)) {}

  absl::Status Append(absl::string_view data) override {
    absl::MutexLock lock(&fs_->mu_);
    FLATPARAM_RETURN_IF_ERROR(Check());
    FLATPARAM_RETURN_IF_ERROR(fs_->BeginOperation(
        absl::StrFormat("Append %s (%d bytes)", path_, data.size())));
    fs_->nodes_[node_].data.append(data.data(), data.size());
    return absl::OkStatus();
  }

  absl::Status Sync() override {
    absl::MutexLock lock(&fs_->mu_);
    FLATPARAM_RETURN_IF_ERROR(Check());
    FLATPARAM_RETURN_IF_ERROR(fs_->BeginOperation("Sync " + path_));
    Node& node = fs_->nodes_[node_];
    node.synced_data = node.data;
    return absl::OkStatus();
  }

  absl::Status Close() override {
    absl::MutexLock lock(&fs_->mu_);
    FLATPARAM_RETURN_IF_ERROR(Check());
    FLATPARAM_RETURN_IF_ERROR(fs_->BeginOperation("Close " + path_));
    closed_ = true;
    return absl::OkStatus();
  }

 private:
  absl::Status Check() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(fs_->mu_) {
    if (closed_) {
      return absl::FailedPreconditionError(
          absl::StrCat(path_, ": file is already closed"));
    }
    return fs_->CheckEpoch(epoch_, path_);
  }

  FaultInjectionFileSystem* fs_;
  uint64_t node_;
  uint64_t epoch_;
  std::string path_;
  bool closed_ = false;
};

class FaultInjectionFileSystem::Reader : public RandomAccessFile {
 public:
  Reader(FaultInjectionFileSystem* fs, uint64_t node, uint64_t epoch,
         std::string path)
      : fs_(fs), node_(node), epoch_(epoch), path_(std::move(path)) {}

  absl::Status ReadAt(uint64_t offset, absl::Span<char> out) const override {
    absl::MutexLock lock(&fs_->mu_);
    FLATPARAM_RETURN_IF_ERROR(fs_->CheckEpoch(epoch_, path_));
    const std::string& data = fs_->nodes_.at(node_).data;
    if (offset > data.size() || out.size() > data.size() - offset) {
      return absl::DataLossError(absl::StrFormat(
          "%s: reading bytes [%d, %d) but the file has only %d bytes", path_,
          offset, offset + out.size(), data.size()));
    }
    std::copy_n(data.data() + offset, out.size(), out.data());
    return absl::OkStatus();
  }

  absl::StatusOr<uint64_t> Size() const override {
    absl::MutexLock lock(&fs_->mu_);
    FLATPARAM_RETURN_IF_ERROR(fs_->CheckEpoch(epoch_, path_));
    return fs_->nodes_.at(node_).data.size();
  }

  const std::string& name() const override { return path_; }

 private:
  FaultInjectionFileSystem* fs_;
  uint64_t node_;
  uint64_t epoch_;
  std::string path_;
};

FaultInjectionFileSystem::FaultInjectionFileSystem() {
  absl::MutexLock lock(&mu_);
  nodes_[kRoot].is_dir = true;
}

FaultInjectionFileSystem::~FaultInjectionFileSystem() = default;

absl::StatusOr<std::vector<std::string>> FaultInjectionFileSystem::Split(
    const std::string& path) {
  std::vector<std::string> parts;
  for (absl::string_view part : absl::StrSplit(path, '/')) {
    if (part.empty() || part == ".") continue;
    if (part == "..") {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": '..' is not supported"));
    }
    parts.emplace_back(part);
  }
  return parts;
}

absl::StatusOr<uint64_t> FaultInjectionFileSystem::Lookup(
    const std::string& path) const {
  FLATPARAM_ASSIGN_OR_RETURN(std::vector<std::string> parts, Split(path));
  uint64_t node = kRoot;
  for (const std::string& part : parts) {
    const Node& n = nodes_.at(node);
    auto it = n.entries.find(part);
    if (!n.is_dir || it == n.entries.end()) {
      return absl::NotFoundError(
          absl::StrCat(path, ": no such file or directory"));
    }
    node = it->second;
  }
  return node;
}

absl::StatusOr<std::pair<uint64_t, std::string>>
FaultInjectionFileSystem::LookupParent(const std::string& path) const {
  FLATPARAM_ASSIGN_OR_RETURN(std::vector<std::string> parts, Split(path));
  if (parts.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", path, "' names the root directory"));
  }
  uint64_t node = kRoot;
  for (size_t i = 0; i + 1 < parts.size(); ++i) {
    const Node& n = nodes_.at(node);
    auto it = n.entries.find(parts[i]);
    if (it == n.entries.end()) {
      return absl::NotFoundError(
          absl::StrCat(path, ": parent directory does not exist"));
    }
    node = it->second;
    if (!nodes_.at(node).is_dir) {
      return absl::FailedPreconditionError(
          absl::StrCat(path, ": '", parts[i], "' is not a directory"));
    }
  }
  return std::make_pair(node, parts.back());
}

absl::Status FaultInjectionFileSystem::BeginOperation(
    const std::string& description) {
  const int64_t index = operations_++;
  log_.push_back(description);
  if (fail_from_ >= 0 && index >= fail_from_) {
    failed_ = true;
    return absl::UnavailableError(absl::StrFormat(
        "injected failure at operation %d: %s", index, description));
  }
  return absl::OkStatus();
}

absl::Status FaultInjectionFileSystem::CheckEpoch(
    uint64_t epoch, const std::string& path) const {
  if (epoch != epoch_) {
    return absl::FailedPreconditionError(
        absl::StrCat(path, ": file was open when the file system crashed"));
  }
  return absl::OkStatus();
}

uint64_t FaultInjectionFileSystem::NewNode(bool is_dir) {
  const uint64_t id = next_node_++;
  nodes_[id].is_dir = is_dir;
  return id;
}

absl::StatusOr<std::unique_ptr<WritableFile>>
FaultInjectionFileSystem::NewWritableFile(const std::string& path) {
  absl::MutexLock lock(&mu_);
  FLATPARAM_ASSIGN_OR_RETURN(auto parent, LookupParent(path));
  Node& dir = nodes_[parent.first];
  auto it = dir.entries.find(parent.second);
  if (it != dir.entries.end() && nodes_[it->second].is_dir) {
    return absl::FailedPreconditionError(
        absl::StrCat("create ", path, ": is a directory"));
  }
  FLATPARAM_RETURN_IF_ERROR(BeginOperation("Create " + path));
  uint64_t node;
  if (it != dir.entries.end()) {
    node = it->second;
    nodes_[node].data.clear();
  } else {
    node = NewNode(/*is_dir=*/false);
    nodes_[parent.first].entries[parent.second] = node;
  }
  return std::unique_ptr<WritableFile>(new File(this, node, epoch_, path));
}

absl::StatusOr<std::unique_ptr<RandomAccessFile>>
FaultInjectionFileSystem::NewRandomAccessFile(const std::string& path) {
  absl::MutexLock lock(&mu_);
  FLATPARAM_ASSIGN_OR_RETURN(const uint64_t node, Lookup(path));
  if (nodes_.at(node).is_dir) {
    return absl::FailedPreconditionError(
        absl::StrCat("open ", path, ": is a directory"));
  }
  return std::unique_ptr<RandomAccessFile>(
      new Reader(this, node, epoch_, path));
}

absl::StatusOr<uint64_t> FaultInjectionFileSystem::GetFileSize(
    const std::string& path) {
  absl::MutexLock lock(&mu_);
  FLATPARAM_ASSIGN_OR_RETURN(const uint64_t node, Lookup(path));
  return nodes_.at(node).data.size();
}

absl::StatusOr<bool> FaultInjectionFileSystem::Exists(const std::string& path) {
  absl::MutexLock lock(&mu_);
  absl::StatusOr<uint64_t> node = Lookup(path);
  if (node.ok()) return true;
  if (absl::IsNotFound(node.status())) return false;
  return node.status();
}

absl::StatusOr<bool> FaultInjectionFileSystem::IsDirectory(
    const std::string& path) {
  absl::MutexLock lock(&mu_);
  FLATPARAM_ASSIGN_OR_RETURN(const uint64_t node, Lookup(path));
  return nodes_.at(node).is_dir;
}

absl::StatusOr<std::vector<std::string>> FaultInjectionFileSystem::GetChildren(
    const std::string& path) {
  absl::MutexLock lock(&mu_);
  FLATPARAM_ASSIGN_OR_RETURN(const uint64_t node, Lookup(path));
  const Node& dir = nodes_.at(node);
  if (!dir.is_dir) {
    return absl::FailedPreconditionError(
        absl::StrCat("opendir ", path, ": not a directory"));
  }
  std::vector<std::string> names;
  for (const auto& entry : dir.entries) names.push_back(entry.first);
  return names;
}

absl::Status FaultInjectionFileSystem::CreateDir(const std::string& path) {
  absl::MutexLock lock(&mu_);
  FLATPARAM_ASSIGN_OR_RETURN(auto parent, LookupParent(path));
  if (nodes_[parent.first].entries.count(parent.second) != 0) {
    return absl::AlreadyExistsError(absl::StrCat("mkdir ", path, ": exists"));
  }
  FLATPARAM_RETURN_IF_ERROR(BeginOperation("CreateDir " + path));
  const uint64_t node = NewNode(/*is_dir=*/true);
  nodes_[parent.first].entries[parent.second] = node;
  return absl::OkStatus();
}

absl::Status FaultInjectionFileSystem::RemoveFile(const std::string& path) {
  absl::MutexLock lock(&mu_);
  FLATPARAM_ASSIGN_OR_RETURN(auto parent, LookupParent(path));
  Node& dir = nodes_[parent.first];
  auto it = dir.entries.find(parent.second);
  if (it == dir.entries.end()) {
    return absl::NotFoundError(absl::StrCat("unlink ", path, ": not found"));
  }
  if (nodes_[it->second].is_dir) {
    return absl::FailedPreconditionError(
        absl::StrCat("unlink ", path, ": is a directory"));
  }
  FLATPARAM_RETURN_IF_ERROR(BeginOperation("RemoveFile " + path));
  dir.entries.erase(it);
  return absl::OkStatus();
}

absl::Status FaultInjectionFileSystem::RemoveDir(const std::string& path) {
  absl::MutexLock lock(&mu_);
  FLATPARAM_ASSIGN_OR_RETURN(auto parent, LookupParent(path));
  Node& dir = nodes_[parent.first];
  auto it = dir.entries.find(parent.second);
  if (it == dir.entries.end()) {
    return absl::NotFoundError(absl::StrCat("rmdir ", path, ": not found"));
  }
  const Node& victim = nodes_[it->second];
  if (!victim.is_dir) {
    return absl::FailedPreconditionError(
        absl::StrCat("rmdir ", path, ": not a directory"));
  }
  if (!victim.entries.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("rmdir ", path, ": directory not empty"));
  }
  FLATPARAM_RETURN_IF_ERROR(BeginOperation("RemoveDir " + path));
  dir.entries.erase(it);
  return absl::OkStatus();
}

absl::Status FaultInjectionFileSystem::Rename(const std::string& from,
                                              const std::string& to) {
  absl::MutexLock lock(&mu_);
  FLATPARAM_ASSIGN_OR_RETURN(auto src, LookupParent(from));
  FLATPARAM_ASSIGN_OR_RETURN(auto dst, LookupParent(to));
  auto it = nodes_[src.first].entries.find(src.second);
  if (it == nodes_[src.first].entries.end()) {
    return absl::NotFoundError(
        absl::StrCat("rename ", from, " to ", to, ": source not found"));
  }
  const uint64_t moved = it->second;
  if (nodes_[moved].is_dir) {
    // A directory must not move into itself or below itself.
    FLATPARAM_ASSIGN_OR_RETURN(std::vector<std::string> parts, Split(to));
    uint64_t node = kRoot;
    for (size_t i = 0; i + 1 < parts.size(); ++i) {
      node = nodes_.at(node).entries.at(parts[i]);
      if (node == moved) {
        return absl::InvalidArgumentError(absl::StrCat(
            "rename ", from, " to ", to, ": destination is inside the source"));
      }
    }
  }
  auto existing = nodes_[dst.first].entries.find(dst.second);
  if (existing != nodes_[dst.first].entries.end()) {
    if (existing->second == moved) return absl::OkStatus();
    const Node& target = nodes_[existing->second];
    if (target.is_dir != nodes_[moved].is_dir) {
      return absl::FailedPreconditionError(absl::StrCat(
          "rename ", from, " to ", to, ": cannot replace a ",
          target.is_dir ? "directory with a file" : "file with a directory"));
    }
    if (target.is_dir && !target.entries.empty()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "rename ", from, " to ", to, ": destination directory not empty"));
    }
  }
  FLATPARAM_RETURN_IF_ERROR(BeginOperation("Rename " + from + " -> " + to));
  nodes_[src.first].entries.erase(src.second);
  nodes_[dst.first].entries[dst.second] = moved;
  return absl::OkStatus();
}

absl::Status FaultInjectionFileSystem::SyncDir(const std::string& path) {
  absl::MutexLock lock(&mu_);
  FLATPARAM_ASSIGN_OR_RETURN(const uint64_t node, Lookup(path));
  if (!nodes_.at(node).is_dir) {
    return absl::FailedPreconditionError(
        absl::StrCat("fsync directory ", path, ": not a directory"));
  }
  FLATPARAM_RETURN_IF_ERROR(BeginOperation("SyncDir " + path));
  Node& dir = nodes_[node];
  dir.synced_entries = dir.entries;
  return absl::OkStatus();
}

void FaultInjectionFileSystem::FailOperationsFrom(int64_t n) {
  absl::MutexLock lock(&mu_);
  fail_from_ = n;
  operations_ = 0;
  failed_ = false;
}

int64_t FaultInjectionFileSystem::operation_count() const {
  absl::MutexLock lock(&mu_);
  return operations_;
}

bool FaultInjectionFileSystem::failed() const {
  absl::MutexLock lock(&mu_);
  return failed_;
}

std::vector<std::string> FaultInjectionFileSystem::operation_log() const {
  absl::MutexLock lock(&mu_);
  return log_;
}

template <typename KeepCurrent>
void FaultInjectionFileSystem::CrashImpl(KeepCurrent keep_current) {
  // Walk from the root through the entries that survive, deciding each
  // node's fate once (a node can be reachable twice after a rename between
  // directories of which only one was synced).
  std::map<uint64_t, Node> survivors;
  std::vector<uint64_t> stack = {kRoot};
  while (!stack.empty()) {
    const uint64_t id = stack.back();
    stack.pop_back();
    if (survivors.count(id) != 0) continue;
    const Node& old = nodes_.at(id);
    Node& node = survivors[id];
    node.is_dir = old.is_dir;
    const bool current = keep_current(id);
    if (old.is_dir) {
      node.entries = current ? old.entries : old.synced_entries;
      node.synced_entries = node.entries;
      for (const auto& entry : node.entries) stack.push_back(entry.second);
    } else {
      node.data = current ? old.data : old.synced_data;
      node.synced_data = node.data;
    }
  }
  nodes_ = std::move(survivors);
  ++epoch_;
  fail_from_ = -1;
  failed_ = false;
}

void FaultInjectionFileSystem::Crash() {
  absl::MutexLock lock(&mu_);
  log_.push_back("Crash");
  CrashImpl([](uint64_t) { return false; });
}

void FaultInjectionFileSystem::CrashKeepingSome(uint64_t seed) {
  absl::MutexLock lock(&mu_);
  log_.push_back(absl::StrCat("CrashKeepingSome ", seed));
  std::mt19937_64 random(seed);
  CrashImpl([&random](uint64_t) { return (random() & 1) != 0; });
}

void FaultInjectionFileSystem::AppendDebug(uint64_t id,
                                           const std::string& prefix,
                                           std::string& out) const {
  const Node& node = nodes_.at(id);
  if (node.is_dir) {
    absl::StrAppend(&out, prefix.empty() ? "/" : prefix, "/",
                    node.entries == node.synced_entries ? "" : " (unsynced)",
                    "\n");
    for (const auto& entry : node.entries) {
      AppendDebug(entry.second, prefix + "/" + entry.first, out);
    }
  } else {
    absl::StrAppend(&out, prefix, " ", node.data.size(), " bytes",
                    node.data == node.synced_data ? "" : " (unsynced)", "\n");
  }
}

std::string FaultInjectionFileSystem::DebugString() const {
  absl::MutexLock lock(&mu_);
  std::string out;
  AppendDebug(kRoot, "", out);
  return out;
}

}  // namespace checkpoint
}  // namespace flatparam
