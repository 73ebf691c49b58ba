// Reading and writing safetensors files, the tensor container of the
// Hugging Face ecosystem (https://github.com/huggingface/safetensors):
//
//   bytes [0, 8)        N, the header length, little-endian uint64
//   bytes [8, 8 + N)    the header: a UTF-8 JSON object
//                         {"__metadata__": {"key": "value", ...},   optional
//                          "<name>": {"dtype": "F32", "shape": [2, 3],
//                                     "data_offsets": [BEGIN, END]}, ...}
//                       padded with spaces so that 8 + N is a multiple of 8
//   bytes [8 + N, EOF)  the data section: each tensor's bytes, row-major,
//                       little-endian, at [BEGIN, END) relative to 8 + N
//
// The writer produces what the reference implementation does: compact
// JSON, "__metadata__" first, then the tensors in data order with keys
// "dtype", "shape", "data_offsets"; spaces to a multiple of 8; tensors
// stored by element size, largest first, so that each one's data is aligned
// to its element size. Among tensors of one element size the order is the
// declaration order (the reference sorts those by name).
//
// The reader trusts nothing in the file. It accepts exactly the files the
// specification allows: a header length within the file and at most
// `max_header_bytes`; a JSON object (starting with '{', no duplicate keys);
// "__metadata__", if present, a map of strings; every other entry exactly
// {dtype, shape, data_offsets} with a dtype flatparam knows, non-negative
// integer dimensions whose product and byte size do not overflow, and
// END - BEGIN equal to the byte size; and the tensors, ordered by offset,
// covering the data section exactly, without gaps or overlaps, up to the end
// of the file. Anything else is DataLoss naming the file, the tensor and
// what is wrong. Tensor bytes are read on request, whole or by byte range,
// into caller memory; the reader holds only the header.
//
// Dtypes: F32, F64, F16, BF16 (the flattenable ones) and I8, U8, I16, I32,
// I64, BOOL. Other safetensors dtypes (F8_*, U16, U32, U64, ...) are
// rejected as unsupported.
//
// The host must be little-endian (checked at compile time): tensor bytes are
// passed through unchanged.
//
// Thread-safety: a SafetensorsReader's const methods may be called from
// several threads. A SafetensorsWriter is used by one thread.
#ifndef FLATPARAM_CHECKPOINT_SAFETENSORS_H_
#define FLATPARAM_CHECKPOINT_SAFETENSORS_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "flatparam/base/dtype.h"
#include "flatparam/checkpoint/file_system.h"
#include "flatparam/flatten.h"

namespace flatparam {
namespace checkpoint {

// The reference implementation's limit on the header length.
inline constexpr uint64_t kSafetensorsMaxHeaderBytes = 100'000'000;

// "F32", "F64", "F16", "BF16", "I8", "U8", "I16", "I32", "I64", "BOOL".
absl::string_view SafetensorsDTypeName(DType dtype);
// The inverse; InvalidArgument naming `name` for anything else.
absl::StatusOr<DType> ParseSafetensorsDType(absl::string_view name);

// A tensor as declared in a header: name, element type and shape.
struct TensorDecl {
  std::string name;
  DType dtype = DType::kFloat32;
  // Empty for a 0-d tensor; zero-size dimensions are allowed.
  std::vector<int64_t> shape;
};

// A tensor in a file: its declaration and where its bytes are.
struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;
  // [begin, end) in bytes, relative to the start of the data section.
  uint64_t begin = 0;
  uint64_t end = 0;

  uint64_t nbytes() const { return end - begin; }
  // Product of `shape` (1 for a 0-d tensor).
  int64_t numel() const;
};

// The header for `tensors` (laid out back to back in this order) and
// `metadata`: the padded JSON without the 8-byte length. InvalidArgument,
// naming the tensor, for an empty, duplicate or "__metadata__" name, a
// negative dimension, a size that overflows, or a name or metadata string
// that is not valid UTF-8.
absl::StatusOr<std::string> BuildSafetensorsHeader(
    absl::Span<const TensorDecl> tensors,
    const std::map<std::string, std::string>& metadata);

// Streams one safetensors file: the header goes out when the writer is
// created, then the tensors' bytes in data order (the order of entries():
// by element size, largest first, else as declared) through Append, in
// pieces of any size (a piece may span tensors). The writer never holds
// tensor data. It borrows `file`, which must outlive it; Finish does not
// sync or close the file: the caller does, after Finish.
//
//   FLATPARAM_ASSIGN_OR_RETURN(
//       SafetensorsWriter w,
//       SafetensorsWriter::Begin(file.get(), "model.safetensors", decls));
//   for (...) FLATPARAM_RETURN_IF_ERROR(w.Append(chunk));
//   FLATPARAM_RETURN_IF_ERROR(w.Finish());
class SafetensorsWriter {
 public:
  // Writes the header for `tensors` and `metadata` to `file`. `file_name`
  // prefixes error messages. Errors are BuildSafetensorsHeader's and the
  // file's.
  static absl::StatusOr<SafetensorsWriter> Begin(
      WritableFile* file, std::string file_name,
      std::vector<TensorDecl> tensors,
      const std::map<std::string, std::string>& metadata = {});

  SafetensorsWriter(SafetensorsWriter&&) = default;
  SafetensorsWriter& operator=(SafetensorsWriter&&) = default;

  // Appends the next `bytes` of tensor data. InvalidArgument, writing
  // nothing, when they run past the last tensor's end.
  absl::Status Append(absl::string_view bytes);
  // FailedPrecondition, naming the first incomplete tensor and how many of
  // its bytes were written, unless every tensor's bytes were appended.
  absl::Status Finish();

  // The declared tensors with their offsets, in data order.
  const std::vector<SafetensorsEntry>& entries() const { return entries_; }
  // 8 + header length + data bytes: the size of the finished file.
  uint64_t file_size() const { return data_offset_ + data_size_; }
  uint64_t data_size() const { return data_size_; }
  uint64_t data_written() const { return written_; }

 private:
  SafetensorsWriter() = default;

  WritableFile* file_ = nullptr;
  std::string file_name_;
  std::vector<SafetensorsEntry> entries_;
  uint64_t data_offset_ = 0;
  uint64_t data_size_ = 0;
  uint64_t written_ = 0;
};

// A tensor to write whose bytes are produced on demand, so that a writer of
// a whole model holds at most one chunk.
struct TensorSource {
  std::string name;
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;
  // Fills `out` with the tensor's bytes [offset, offset + out.size()). The
  // writer calls it with increasing, adjacent ranges covering the tensor
  // once, each at most the chunk size; never for a zero-size tensor.
  std::function<absl::Status(uint64_t offset, absl::Span<char> out)> fill;
};

// A source over `data`, which holds the tensor's bytes and must stay alive
// and unchanged until the write is done.
TensorSource TensorSourceFromBytes(std::string name, DType dtype,
                                   std::vector<int64_t> shape,
                                   const void* data);
// A source over `tensor` (its dtype, shape and bytes), borrowed likewise.
TensorSource TensorSourceFromHostTensor(std::string name,
                                        const HostTensor& tensor);

// The default chunk size of WriteSafetensors.
inline constexpr uint64_t kDefaultChunkBytes = uint64_t{4} << 20;

// Writes `tensors` (stored in data order) and `metadata` as a safetensors
// file to `file` (not synced or closed), pulling each tensor's bytes in
// chunks of at most `chunk_bytes` (>= 1) through one buffer of that size.
// Errors from a source are returned with the file and tensor prepended; the
// rest are SafetensorsWriter's.
absl::Status WriteSafetensors(
    WritableFile& file, const std::string& file_name,
    absl::Span<const TensorSource> tensors,
    const std::map<std::string, std::string>& metadata = {},
    uint64_t chunk_bytes = kDefaultChunkBytes);

// The file size WriteSafetensors will produce, or its declaration errors.
absl::StatusOr<uint64_t> SafetensorsFileSize(
    absl::Span<const TensorSource> tensors,
    const std::map<std::string, std::string>& metadata = {});

struct SafetensorsReadOptions {
  // Headers longer than this are rejected before anything is allocated.
  uint64_t max_header_bytes = kSafetensorsMaxHeaderBytes;
};

// A validated safetensors file. See the file comment for what Open checks.
// Movable; owns its RandomAccessFile.
class SafetensorsReader {
 public:
  // Opens and validates the file at `path` of `fs`.
  static absl::StatusOr<SafetensorsReader> Open(
      FileSystem& fs, const std::string& path,
      const SafetensorsReadOptions& options = {});
  // Validates `file`; errors name `file->name()`.
  static absl::StatusOr<SafetensorsReader> Open(
      std::unique_ptr<RandomAccessFile> file,
      const SafetensorsReadOptions& options = {});

  SafetensorsReader(SafetensorsReader&&) = default;
  SafetensorsReader& operator=(SafetensorsReader&&) = default;

  const std::string& name() const { return file_->name(); }
  // Every tensor, in data order (by offset, then name).
  const std::vector<SafetensorsEntry>& tensors() const { return entries_; }
  const std::map<std::string, std::string>& metadata() const {
    return metadata_;
  }
  // Where the data section starts: 8 + the header length.
  uint64_t data_offset() const { return data_offset_; }
  // The file size that was validated.
  uint64_t file_size() const { return file_size_; }

  // The tensor called `name`, or NotFound naming it and the file. The
  // pointer lives as long as the reader.
  absl::StatusOr<const SafetensorsEntry*> Find(absl::string_view name) const;
  bool Contains(absl::string_view name) const;

  // Reads all of tensor `name` into `out`, which must have exactly its
  // byte size (InvalidArgument otherwise). NotFound for an unknown name;
  // DataLoss when the file has shrunk since Open.
  absl::Status Read(absl::string_view name, absl::Span<char> out) const;
  // Reads bytes [byte_offset, byte_offset + out.size()) of tensor `name`;
  // OutOfRange when they are not within the tensor.
  absl::Status ReadRange(absl::string_view name, uint64_t byte_offset,
                         absl::Span<char> out) const;
  // Reads tensor `name` into a new HostTensor of its dtype and shape.
  absl::StatusOr<HostTensor> ReadHostTensor(absl::string_view name) const;

 private:
  SafetensorsReader() = default;

  std::unique_ptr<RandomAccessFile> file_;
  std::vector<SafetensorsEntry> entries_;
  absl::flat_hash_map<std::string, size_t> index_;
  std::map<std::string, std::string> metadata_;
  uint64_t data_offset_ = 0;
  uint64_t file_size_ = 0;
};

}  // namespace checkpoint
}  // namespace flatparam

#endif  // FLATPARAM_CHECKPOINT_SAFETENSORS_H_
