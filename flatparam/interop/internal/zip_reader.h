// A read-only zip archive over a checkpoint::RandomAccessFile, through
// libzip: the container of torch.save files (and of the items in PyTorch
// Distributed Checkpoint's .distcp files). libzip parses the central
// directory and checks it against each local header (ZIP_CHECKCONS), and
// verifies each member's CRC-32 as it is read.
//
// A member is read streaming, never more of it than the caller allows:
// its size in the directory is checked first, and a deflated member is
// inflated into the caller's bound, not into whatever it claims or holds
// (LibTorch's own reader allocates and inflates the directory's size whole,
// so a 64 KiB member could ask for gigabytes before its content was
// checked). torch.save writes every record stored; Python's zipfile may
// deflate them, and PyTorch reads those too.
//
//   FLATPARAM_ASSIGN_OR_RETURN(std::unique_ptr<ZipReader> zip,
//                              ZipReader::Open(std::move(file), size, path));
//   FLATPARAM_ASSIGN_OR_RETURN(std::string pkl,
//                              zip->Read("archive/data.pkl", size));
//
// Ownership: the reader owns the file. Thread-compatible (one thread at a
// time).
#ifndef FLATPARAM_INTEROP_INTERNAL_ZIP_READER_H_
#define FLATPARAM_INTEROP_INTERNAL_ZIP_READER_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "flatparam/checkpoint/file_system.h"

namespace flatparam {
namespace libtorch {
namespace internal_torch {

class ZipReader {
 public:
  // Opens the archive held by `file` (`size` bytes; `path` names it in
  // errors). DataLoss with libzip's reason for anything that is not a
  // consistent zip archive.
  static absl::StatusOr<std::unique_ptr<ZipReader>> Open(
      std::unique_ptr<checkpoint::RandomAccessFile> file, uint64_t size,
      std::string path);
  ~ZipReader();
  ZipReader(const ZipReader&) = delete;
  ZipReader& operator=(const ZipReader&) = delete;

  // Every member's name, in the directory's order.
  const std::vector<std::string>& names() const { return names_; }
  bool Has(const std::string& name) const;

  struct Member {
    uint64_t index = 0;
    uint64_t size = 0;  // uncompressed, as the directory says
  };
  // The member `name`: NotFound when there is none.
  absl::StatusOr<Member> Find(const std::string& name) const;

  // Member `name` whole (inflated if deflated), CRC-checked. DataLoss,
  // naming the member, when its size is larger than `max_bytes` (refused
  // unread), it holds more or fewer bytes than its size, it is encrypted
  // or compressed other than by deflate, or its bytes do not match its
  // CRC; NotFound when there is none.
  absl::StatusOr<std::string> Read(const std::string& name,
                                   uint64_t max_bytes) const;

 private:
  struct Source;
  ZipReader() = default;
  absl::Status Error(const std::string& name, const std::string& what) const;

  std::unique_ptr<Source> source_;
  void* zip_ = nullptr;  // zip_t, owned
  std::vector<std::string> names_;
  std::string path_;
};

}  // namespace internal_torch
}  // namespace libtorch
}  // namespace flatparam

#endif  // FLATPARAM_INTEROP_INTERNAL_ZIP_READER_H_
