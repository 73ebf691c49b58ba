// The file system under checkpoints, behind a small interface in the style
// of LevelDB's Env, so that tests can substitute a file system that loses
// whatever was not made durable when it "crashes".
//
//   FileSystem& fs = PosixFileSystem();
//   FLATPARAM_ASSIGN_OR_RETURN(std::unique_ptr<WritableFile> f,
//                              fs.NewWritableFile("/ckpt/a.bin"));
//   FLATPARAM_RETURN_IF_ERROR(f->Append(bytes));
//   FLATPARAM_RETURN_IF_ERROR(f->Sync());   // the data is durable
//   FLATPARAM_RETURN_IF_ERROR(f->Close());
//   FLATPARAM_RETURN_IF_ERROR(fs.SyncDir("/ckpt"));  // so is its name
//
// Durability follows POSIX as careful programs assume it: a file's data is
// durable after WritableFile::Sync; a directory entry (a created, renamed or
// removed name) is durable only after SyncDir on the directory holding it.
// Renames within one directory are atomic. FaultInjectionFileSystem models
// exactly this and nothing more.
//
// Paths are '/'-separated strings passed to the operating system as they are
// (relative paths are relative to the working directory).
//
// Ownership: a FileSystem hands out files as std::unique_ptr; every file must
// be destroyed before the FileSystem that opened it. Thread-safety: every
// FileSystem here and its RandomAccessFiles are safe to use from several
// threads; one WritableFile must not be used by two threads at once.
#ifndef FLATPARAM_CHECKPOINT_FILE_SYSTEM_H_
#define FLATPARAM_CHECKPOINT_FILE_SYSTEM_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"

namespace flatparam {
namespace checkpoint {

// A file being written sequentially. Errors name the file.
class WritableFile {
 public:
  virtual ~WritableFile() = default;

  // Appends `data` at the end of the file (buffered or not; only Sync makes
  // it durable).
  virtual absl::Status Append(absl::string_view data) = 0;
  // Makes everything appended so far durable (fsync). Does not make the
  // file's name durable: that is SyncDir on its directory.
  virtual absl::Status Sync() = 0;
  // Releases the file. Appends after Close are errors. A file destroyed
  // without Close is closed silently (errors are lost).
  virtual absl::Status Close() = 0;
};

// A file read at arbitrary offsets (pread), so large tensors can be read in
// pieces. Const methods are safe to call from several threads.
class RandomAccessFile {
 public:
  virtual ~RandomAccessFile() = default;

  // Reads exactly `out.size()` bytes starting at byte `offset` into `out`.
  // DataLoss, naming the file, the range and the file size, when the file
  // ends before `offset + out.size()`.
  virtual absl::Status ReadAt(uint64_t offset, absl::Span<char> out) const = 0;
  // The file's current size in bytes.
  virtual absl::StatusOr<uint64_t> Size() const = 0;
  // The path (or name) the file was opened with, for error messages.
  virtual const std::string& name() const = 0;
};

// The operations checkpoints need. Errors carry the path and the system's
// reason; NotFound for a missing path, AlreadyExists for CreateDir on an
// existing path.
class FileSystem {
 public:
  virtual ~FileSystem() = default;

  // Creates `path` (truncating an existing file) for writing.
  virtual absl::StatusOr<std::unique_ptr<WritableFile>> NewWritableFile(
      const std::string& path) = 0;
  virtual absl::StatusOr<std::unique_ptr<RandomAccessFile>> NewRandomAccessFile(
      const std::string& path) = 0;
  // Size of the file at `path` in bytes.
  virtual absl::StatusOr<uint64_t> GetFileSize(const std::string& path) = 0;
  // Whether anything (file or directory) exists at `path`.
  virtual absl::StatusOr<bool> Exists(const std::string& path) = 0;
  // Whether `path` is a directory; NotFound when nothing is there.
  virtual absl::StatusOr<bool> IsDirectory(const std::string& path) = 0;
  // Names (not paths) of the entries of directory `path`, sorted, without
  // "." and "..".
  virtual absl::StatusOr<std::vector<std::string>> GetChildren(
      const std::string& path) = 0;
  // Creates directory `path`; its parent must exist.
  virtual absl::Status CreateDir(const std::string& path) = 0;
  // Removes the file `path`.
  virtual absl::Status RemoveFile(const std::string& path) = 0;
  // Removes the empty directory `path`.
  virtual absl::Status RemoveDir(const std::string& path) = 0;
  // rename(2): moves `from` to `to`, atomically replacing a file at `to`.
  // A directory may replace only an empty directory.
  virtual absl::Status Rename(const std::string& from,
                              const std::string& to) = 0;
  // Makes the entries of directory `path` durable (fsync on the directory).
  virtual absl::Status SyncDir(const std::string& path) = 0;
};

// A FileSystem that forwards every call to `base`, for wrappers that
// change a few (counting or recording reads, injecting delays): override
// those. Borrows `base`, which must outlive it; as thread-safe as `base`.
class ForwardingFileSystem : public FileSystem {
 public:
  explicit ForwardingFileSystem(FileSystem& base) : base_(base) {}

  absl::StatusOr<std::unique_ptr<WritableFile>> NewWritableFile(
      const std::string& path) override {
    return base_.NewWritableFile(path);
  }
  absl::StatusOr<std::unique_ptr<RandomAccessFile>> NewRandomAccessFile(
      const std::string& path) override {
    return base_.NewRandomAccessFile(path);
  }
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

 protected:
  FileSystem& base() { return base_; }

 private:
  FileSystem& base_;
};

// The process-wide POSIX file system. Never destroyed; thread-safe.
FileSystem& PosixFileSystem();

// "a/b" for ("a", "b"); `b` alone when `a` is empty; no doubled '/'.
std::string JoinPath(absl::string_view a, absl::string_view b);
// The directory part of `path` ("." when it has none; "/" for "/x").
// Trailing slashes are ignored.
std::string Dirname(absl::string_view path);
// The last component of `path`; trailing slashes are ignored.
std::string Basename(absl::string_view path);

// Reads the whole file at `path`. InvalidArgument (naming the file, its size
// and the limit) when it is larger than `max_bytes`, so that a corrupt or
// hostile file cannot make the caller allocate without bound.
absl::StatusOr<std::string> ReadFileToString(FileSystem& fs,
                                             const std::string& path,
                                             uint64_t max_bytes);

// Creates `path` holding `data`, syncs and closes it. Not atomic: a crash
// can leave a partial file; callers that need atomicity write to a
// temporary name and Rename.
absl::Status WriteFileDurably(FileSystem& fs, const std::string& path,
                              absl::string_view data);

// Removes `path` and, if it is a directory, everything under it. OK when
// nothing is at `path`. Not atomic: a crash can leave part of the tree.
absl::Status RemoveRecursively(FileSystem& fs, const std::string& path);

// A RandomAccessFile over bytes held in memory (fuzzing, tests). Owns a copy
// of `contents`.
std::unique_ptr<RandomAccessFile> NewStringRandomAccessFile(
    std::string contents, std::string name);

// An in-memory file system that records what is durable and can crash.
//
// It models a disk under POSIX's weakest promises: file data becomes durable
// at WritableFile::Sync, directory entries at SyncDir of their directory
// (each directory separately; a rename between directories is durable in
// each only after each is synced). Crash() throws away everything else, as a
// power cut might; CrashKeepingSome() keeps a random part of it, as a disk
// that flushed some of its cache might. Either way the test then inspects
// the file system through the usual interface.
//
// For crash tests it also counts mutating operations (file creation,
// Append, Sync, Close, CreateDir, RemoveFile, RemoveDir, Rename, SyncDir)
// and can fail the n-th one and every one after it ("the process died
// here"): the failing operation has no effect.
//
// Paths: components separated by '/'; empty and "." components are ignored,
// so "a/b", "/a/b" and "./a//b" name the same file; ".." is rejected. The
// root directory always exists and is durable.
//
// Thread-safe (one internal mutex). Files opened before a crash fail every
// operation afterwards with FailedPrecondition.
class FaultInjectionFileSystem : public FileSystem {
 public:
  FaultInjectionFileSystem();
  ~FaultInjectionFileSystem() override;
  FaultInjectionFileSystem(const FaultInjectionFileSystem&) = delete;
  FaultInjectionFileSystem& operator=(const FaultInjectionFileSystem&) = delete;

  // FileSystem.
  absl::StatusOr<std::unique_ptr<WritableFile>> NewWritableFile(
      const std::string& path) override;
  absl::StatusOr<std::unique_ptr<RandomAccessFile>> NewRandomAccessFile(
      const std::string& path) override;
  absl::StatusOr<uint64_t> GetFileSize(const std::string& path) override;
  absl::StatusOr<bool> Exists(const std::string& path) override;
  absl::StatusOr<bool> IsDirectory(const std::string& path) override;
  absl::StatusOr<std::vector<std::string>> GetChildren(
      const std::string& path) override;
  absl::Status CreateDir(const std::string& path) override;
  absl::Status RemoveFile(const std::string& path) override;
  absl::Status RemoveDir(const std::string& path) override;
  absl::Status Rename(const std::string& from, const std::string& to) override;
  absl::Status SyncDir(const std::string& path) override;

  // Mutating operations from now on are numbered 0, 1, ...; operation
  // `n` and every later one fail with Unavailable ("injected failure")
  // and change nothing. A negative `n` turns the failure off.
  void FailOperationsFrom(int64_t n);
  // Mutating operations attempted since construction or the last
  // FailOperationsFrom, failed ones included.
  int64_t operation_count() const;
  // Whether an operation has failed since the last FailOperationsFrom.
  bool failed() const;
  // One line per mutating operation since construction ("Rename a -> b").
  std::vector<std::string> operation_log() const;

  // Loses everything not durable: file contents fall back to what was last
  // synced, directories to the entries they had when last synced (files
  // and directories no longer reachable vanish). Turns failure injection
  // off and invalidates every open file.
  void Crash();
  // Like Crash(), but each directory independently keeps either its synced
  // or its current entries, and each file its synced or its current
  // contents, chosen by a generator seeded with `seed`.
  void CrashKeepingSome(uint64_t seed);

  // Every path and its kind, size and whether it differs from its durable
  // state, one per line, sorted: for failure messages.
  std::string DebugString() const;

 private:
  struct Node {
    bool is_dir = false;
    std::string data;
    std::string synced_data;
    std::map<std::string, uint64_t> entries;
    std::map<std::string, uint64_t> synced_entries;
  };
  class File;
  class Reader;
  friend class File;
  friend class Reader;

  // Splits `path` into components; InvalidArgument for "..".
  static absl::StatusOr<std::vector<std::string>> Split(
      const std::string& path);
  // The node at `path`, or NotFound.
  absl::StatusOr<uint64_t> Lookup(const std::string& path) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The directory holding `path` and the last component; NotFound when the
  // directory does not exist, FailedPrecondition when it is a file,
  // InvalidArgument for the root itself.
  absl::StatusOr<std::pair<uint64_t, std::string>> LookupParent(
      const std::string& path) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Counts a mutating operation; Unavailable when it must fail.
  absl::Status BeginOperation(const std::string& description)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Checks that a file opened at `epoch` is still valid.
  absl::Status CheckEpoch(uint64_t epoch, const std::string& path) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  uint64_t NewNode(bool is_dir) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Crash with, for each node, whether it keeps its current state.
  template <typename KeepCurrent>
  void CrashImpl(KeepCurrent keep_current) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void AppendDebug(uint64_t node, const std::string& prefix,
                   std::string& out) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  std::map<uint64_t, Node> nodes_ ABSL_GUARDED_BY(mu_);
  uint64_t next_node_ ABSL_GUARDED_BY(mu_) = 1;
  // Bumped at every crash; files remember the epoch they were opened in.
  uint64_t epoch_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t fail_from_ ABSL_GUARDED_BY(mu_) = -1;
  int64_t operations_ ABSL_GUARDED_BY(mu_) = 0;
  bool failed_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::string> log_ ABSL_GUARDED_BY(mu_);
};

}  // namespace checkpoint
}  // namespace flatparam

#endif  // FLATPARAM_CHECKPOINT_FILE_SYSTEM_H_
