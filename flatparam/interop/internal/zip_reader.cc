#include "flatparam/interop/internal/zip_reader.h"

#include <zip.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"

namespace flatparam {
namespace libtorch {
namespace internal_torch {

// libzip's view of the file: a seekable, read-only source. libzip calls
// it from the thread that uses the reader.
struct ZipReader::Source {
  std::unique_ptr<checkpoint::RandomAccessFile> file;
  uint64_t size = 0;
  uint64_t pos = 0;
  zip_error_t error;

  static zip_int64_t Callback(void* user, void* data, zip_uint64_t len,
                              zip_source_cmd_t cmd) {
    Source& s = *static_cast<Source*>(user);
    switch (cmd) {
      case ZIP_SOURCE_OPEN:
        s.pos = 0;
        return 0;
      case ZIP_SOURCE_READ: {
        const uint64_t n = std::min<uint64_t>(len, s.size - s.pos);
        if (n == 0) return 0;
        const absl::Status read =
            s.file->ReadAt(s.pos, absl::MakeSpan(static_cast<char*>(data), n));
        if (!read.ok()) {
          zip_error_set(&s.error, ZIP_ER_READ, 0);
          return -1;
        }
        s.pos += n;
        return static_cast<zip_int64_t>(n);
      }
      case ZIP_SOURCE_CLOSE:
        return 0;
      case ZIP_SOURCE_STAT: {
        auto* st = ZIP_SOURCE_GET_ARGS(zip_stat_t, data, len, &s.error);
        if (st == nullptr) return -1;
        zip_stat_init(st);
        st->size = s.size;
        st->valid |= ZIP_STAT_SIZE;
        return sizeof(zip_stat_t);
      }
      case ZIP_SOURCE_ERROR:
        return zip_error_to_data(&s.error, data, len);
      case ZIP_SOURCE_FREE:
        return 0;
      case ZIP_SOURCE_SEEK: {
        const zip_int64_t to =
            zip_source_seek_compute_offset(s.pos, s.size, data, len, &s.error);
        if (to < 0) return -1;
        s.pos = static_cast<uint64_t>(to);
        return 0;
      }
      case ZIP_SOURCE_TELL:
        return static_cast<zip_int64_t>(s.pos);
      case ZIP_SOURCE_SUPPORTS:
        return ZIP_SOURCE_SUPPORTS_SEEKABLE;
      default:
        zip_error_set(&s.error, ZIP_ER_OPNOTSUPP, 0);
        return -1;
    }
  }
};

absl::StatusOr<std::unique_ptr<ZipReader>> ZipReader::Open(
    std::unique_ptr<checkpoint::RandomAccessFile> file, uint64_t size,
    std::string path) {
  std::unique_ptr<ZipReader> r(new ZipReader());
  r->path_ = std::move(path);
  r->source_ = std::make_unique<Source>();
  r->source_->file = std::move(file);
  r->source_->size = size;
  zip_error_init(&r->source_->error);
  zip_error_t error;
  zip_error_init(&error);
  zip_source_t* src =
      zip_source_function_create(&Source::Callback, r->source_.get(), &error);
  if (src == nullptr) {
    const std::string what = zip_error_strerror(&error);
    zip_error_fini(&error);
    return absl::ResourceExhaustedError(
        absl::StrCat(r->path_, ": cannot read the zip archive: ", what));
  }
  zip_t* zip = zip_open_from_source(src, ZIP_RDONLY | ZIP_CHECKCONS, &error);
  if (zip == nullptr) {
    zip_source_free(src);
    const std::string what = zip_error_strerror(&error);
    zip_error_fini(&error);
    return absl::DataLossError(
        absl::StrCat(r->path_, ": not a readable zip archive: ", what));
  }
  zip_error_fini(&error);
  r->zip_ = zip;
  const zip_int64_t n = zip_get_num_entries(zip, 0);
  for (zip_int64_t i = 0; i < n; ++i) {
    const char* name = zip_get_name(zip, i, ZIP_FL_ENC_RAW);
    if (name == nullptr) {
      return absl::DataLossError(
          absl::StrCat(r->path_, ": zip member ", i,
                       " has no readable name: ", zip_strerror(zip)));
    }
    r->names_.emplace_back(name);
  }
  return r;
}

ZipReader::~ZipReader() {
  if (zip_ != nullptr) zip_discard(static_cast<zip_t*>(zip_));
  if (source_ != nullptr) zip_error_fini(&source_->error);
}

bool ZipReader::Has(const std::string& name) const {
  return zip_name_locate(static_cast<zip_t*>(zip_), name.c_str(),
                         ZIP_FL_ENC_RAW) >= 0;
}

absl::Status ZipReader::Error(const std::string& name,
                              const std::string& what) const {
  return absl::DataLossError(
      absl::StrCat(path_, ": zip member ", name, " ", what));
}

absl::StatusOr<ZipReader::Member> ZipReader::Find(
    const std::string& name) const {
  zip_t* zip = static_cast<zip_t*>(zip_);
  const zip_int64_t index = zip_name_locate(zip, name.c_str(), ZIP_FL_ENC_RAW);
  if (index < 0) {
    return absl::NotFoundError(absl::StrCat(path_, ": no zip member ", name));
  }
  zip_stat_t st;
  zip_stat_init(&st);
  if (zip_stat_index(zip, index, ZIP_FL_ENC_RAW, &st) != 0 ||
      (st.valid & (ZIP_STAT_SIZE | ZIP_STAT_COMP_METHOD)) !=
          (ZIP_STAT_SIZE | ZIP_STAT_COMP_METHOD)) {
    return Error(name,
                 absl::StrCat("has no readable size: ", zip_strerror(zip)));
  }
  if ((st.valid & ZIP_STAT_ENCRYPTION_METHOD) != 0 &&
      st.encryption_method != ZIP_EM_NONE) {
    return Error(name, "is encrypted");
  }
  if (st.comp_method != ZIP_CM_STORE && st.comp_method != ZIP_CM_DEFLATE) {
    return Error(name,
                 absl::StrCat("is compressed with zip method ", st.comp_method,
                              " (only stored and deflated members "
                              "are read)"));
  }
  Member m;
  m.index = static_cast<uint64_t>(index);
  m.size = st.size;
  return m;
}

absl::StatusOr<std::string> ZipReader::Read(const std::string& name,
                                            uint64_t max_bytes) const {
  absl::StatusOr<Member> m = Find(name);
  if (!m.ok()) return m.status();
  if (m->size > max_bytes) {
    return Error(name, absl::StrCat("holds ", m->size, " bytes, more than the ",
                                    max_bytes, " expected (refused unread)"));
  }
  zip_t* zip = static_cast<zip_t*>(zip_);
  zip_file_t* f = zip_fopen_index(zip, m->index, 0);
  if (f == nullptr) {
    return Error(name, absl::StrCat("cannot be opened: ", zip_strerror(zip)));
  }
  std::string bytes(m->size, '\0');
  uint64_t done = 0;
  absl::Status status;
  // Reading one byte past the end makes libzip check the CRC-32.
  std::string extra(1, '\0');
  while (status.ok()) {
    char* at = done < bytes.size() ? bytes.data() + done : extra.data();
    const uint64_t want = done < bytes.size()
                              ? std::min<uint64_t>(bytes.size() - done, 1 << 24)
                              : 1;
    const zip_int64_t got = zip_fread(f, at, want);
    if (got < 0) {
      status =
          Error(name, absl::StrCat("cannot be read: ", zip_file_strerror(f)));
    } else if (got == 0) {
      if (done != bytes.size()) {
        status = Error(name, absl::StrCat("ends after ", done, " of its ",
                                          bytes.size(), " bytes"));
      }
      break;
    } else if (done >= bytes.size()) {
      status = Error(name, "holds more bytes than its size says");
    } else {
      done += static_cast<uint64_t>(got);
    }
  }
  zip_fclose(f);
  if (!status.ok()) return status;
  return bytes;
}

}  // namespace internal_torch
}  // namespace libtorch
}  // namespace flatparam
