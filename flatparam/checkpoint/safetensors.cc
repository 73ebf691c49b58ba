#include "flatparam/checkpoint/safetensors.h"

#include <algorithm>
#include <cassert>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <tuple>
#include <utility>

#include "absl/base/config.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "flatparam/base/json_limits.h"
#include "flatparam/base/shape.h"
#include "flatparam/base/status_macros.h"

#ifdef ABSL_IS_BIG_ENDIAN
#error "safetensors data is little-endian; big-endian hosts are not supported"
#endif

namespace flatparam {
namespace checkpoint {
namespace {

using json = nlohmann::json;
using ordered_json = nlohmann::ordered_json;

constexpr char kMetadataKey[] = "__metadata__";
constexpr uint64_t kLengthBytes = 8;

struct DTypeNamePair {
  DType dtype;
  const char* name;
};
constexpr DTypeNamePair kDTypeNames[] = {
    {DType::kFloat32, "F32"}, {DType::kFloat64, "F64"},
    {DType::kFloat16, "F16"}, {DType::kBFloat16, "BF16"},
    {DType::kInt8, "I8"},     {DType::kUInt8, "U8"},
    {DType::kInt16, "I16"},   {DType::kInt32, "I32"},
    {DType::kInt64, "I64"},   {DType::kBool, "BOOL"},
};

// a * b, or false on overflow of uint64.
bool MulOverflows(uint64_t a, uint64_t b, uint64_t* out) {
  return __builtin_mul_overflow(a, b, out);
}

// Element count and byte size of a declaration, with overflow checks
// against int64 (our shapes' type).
absl::Status DeclSizes(const TensorDecl& decl, uint64_t* numel,
                       uint64_t* nbytes) {
  uint64_t n = 1;
  for (int64_t d : decl.shape) {
    if (d < 0) {
      return absl::InvalidArgumentError(
          absl::StrFormat("tensor '%s': shape %s has a negative dimension",
                          decl.name, ShapeString(decl.shape)));
    }
    if (MulOverflows(n, static_cast<uint64_t>(d), &n)) {
      n = std::numeric_limits<uint64_t>::max();
    }
  }
  uint64_t bytes = 0;
  if (n > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) ||
      MulOverflows(n, DTypeSize(decl.dtype), &bytes) ||
      bytes > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
    return absl::InvalidArgumentError(
        absl::StrFormat("tensor '%s': shape %s of %s is too large", decl.name,
                        ShapeString(decl.shape), DTypeName(decl.dtype)));
  }
  *numel = n;
  *nbytes = bytes;
  return absl::OkStatus();
}

// The order in which `tensors` are stored: by element size, largest first,
// keeping declaration order among equal sizes. With the header padded to 8
// bytes this puts every tensor at a multiple of its element size, as the
// reference implementation's sort by alignment does.
std::vector<size_t> DataOrder(absl::Span<const TensorDecl> tensors) {
  std::vector<size_t> order(tensors.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return DTypeSize(tensors[a].dtype) > DTypeSize(tensors[b].dtype);
  });
  return order;
}

// Lays out `tensors` back to back in DataOrder.
absl::StatusOr<std::vector<SafetensorsEntry>> LayOut(
    absl::Span<const TensorDecl> tensors) {
  std::vector<SafetensorsEntry> entries;
  entries.reserve(tensors.size());
  std::set<absl::string_view> names;
  uint64_t offset = 0;
  for (size_t index : DataOrder(tensors)) {
    const TensorDecl& decl = tensors[index];
    if (decl.name.empty()) {
      return absl::InvalidArgumentError("a tensor has an empty name");
    }
    if (decl.name == kMetadataKey) {
      return absl::InvalidArgumentError(
          absl::StrCat("a tensor may not be called '", kMetadataKey, "'"));
    }
    if (!names.insert(decl.name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", decl.name, "' is declared twice"));
    }
    uint64_t numel = 0;
    uint64_t nbytes = 0;
    FLATPARAM_RETURN_IF_ERROR(DeclSizes(decl, &numel, &nbytes));
    SafetensorsEntry e;
    e.name = decl.name;
    e.dtype = decl.dtype;
    e.shape = decl.shape;
    e.begin = offset;
    if (__builtin_add_overflow(offset, nbytes, &e.end) ||
        e.end > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the tensors up to '", decl.name, "' exceed 2^63 bytes in total"));
    }
    offset = e.end;
    entries.push_back(std::move(e));
  }
  return entries;
}

absl::StatusOr<std::string> HeaderFor(
    absl::Span<const SafetensorsEntry> entries,
    const std::map<std::string, std::string>& metadata) {
  ordered_json header = ordered_json::object();
  if (!metadata.empty()) {
    ordered_json meta = ordered_json::object();
    for (const auto& kv : metadata) meta[kv.first] = kv.second;
    header[kMetadataKey] = std::move(meta);
  }
  for (const SafetensorsEntry& e : entries) {
    header[e.name] = ordered_json{
        {"dtype", std::string(SafetensorsDTypeName(e.dtype))},
        {"shape", e.shape},
        {"data_offsets", {e.begin, e.end}},
    };
  }
  std::string text;
  try {
    text = header.dump();
  } catch (const ordered_json::type_error& e) {
    return absl::InvalidArgumentError(
        absl::StrCat("safetensors header: ", e.what()));
  }
  text.append((8 - text.size() % 8) % 8, ' ');
  if (text.size() > kSafetensorsMaxHeaderBytes) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "safetensors header of %d bytes exceeds the limit of %d bytes",
        text.size(), kSafetensorsMaxHeaderBytes));
  }
  return text;
}

std::string EncodeLength(uint64_t n) {
  std::string out(kLengthBytes, '\0');
  for (size_t i = 0; i < kLengthBytes; ++i) {
    out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  }
  return out;
}

uint64_t DecodeLength(const char* p) {
  uint64_t n = 0;
  for (size_t i = 0; i < kLengthBytes; ++i) {
    n |= static_cast<uint64_t>(static_cast<unsigned char>(p[i])) << (8 * i);
  }
  return n;
}

// Prefixes `status`'s message with `context`, keeping its code.
absl::Status Annotate(const absl::Status& status, absl::string_view context) {
  if (status.ok()) return status;
  return absl::Status(status.code(),
                      absl::StrCat(context, ": ", status.message()));
}

// ---------------------------------------------------------------------------
// Header validation. Every error is DataLoss "<file>: <what>".

class HeaderParser {
 public:
  HeaderParser(const std::string& file, uint64_t data_size)
      : file_(file), data_size_(data_size) {}

  absl::Status Parse(const std::string& text,
                     std::vector<SafetensorsEntry>* entries,
                     std::map<std::string, std::string>* metadata) {
    if (text.empty() || text.front() != '{') {
      return Error("header does not start with '{'");
    }
    // Duplicate keys would silently shadow each other in the parsed object;
    // the callback sees every key of the top-level object.
    std::string duplicate;
    std::set<std::string> keys;
    const json::parser_callback_t on_event = [&](int depth,
                                                 json::parse_event_t event,
                                                 json& parsed) {
      if (event == json::parse_event_t::key && depth == 1 &&
          duplicate.empty() && !keys.insert(parsed.get<std::string>()).second) {
        duplicate = parsed.get<std::string>();
      }
      return true;
    };
    JsonParseOptions options;
    options.code = absl::StatusCode::kDataLoss;
    options.callback = on_event;
    absl::StatusOr<json> parsed = ParseJson(text, "header", options);
    if (!parsed.ok()) return Error(parsed.status().message());
    const json header = *std::move(parsed);
    if (!duplicate.empty()) {
      return Error(absl::StrCat("header has key '", duplicate, "' twice"));
    }
    if (!header.is_object()) {
      return Error("header is not a JSON object");
    }
    for (auto& item : header.items()) {
      if (item.key() == kMetadataKey) {
        FLATPARAM_RETURN_IF_ERROR(ParseMetadata(item.value(), metadata));
        continue;
      }
      SafetensorsEntry entry;
      entry.name = item.key();
      FLATPARAM_RETURN_IF_ERROR(ParseEntry(item.value(), &entry));
      entries->push_back(std::move(entry));
    }
    return CheckCoverage(entries);
  }

 private:
  absl::Status Error(absl::string_view what) const {
    return absl::DataLossError(absl::StrCat(file_, ": ", what));
  }
  absl::Status TensorError(const std::string& name,
                           absl::string_view what) const {
    return absl::DataLossError(
        absl::StrCat(file_, ": tensor '", name, "': ", what));
  }

  absl::Status ParseMetadata(const json& value,
                             std::map<std::string, std::string>* metadata) {
    if (!value.is_object()) {
      return Error(absl::StrCat("'", kMetadataKey, "' is not an object but ",
                                value.type_name()));
    }
    for (const auto& kv : value.items()) {
      if (!kv.value().is_string()) {
        return Error(absl::StrCat("'", kMetadataKey, "' value of key '",
                                  kv.key(), "' is a ", kv.value().type_name(),
                                  ", not a string"));
      }
      (*metadata)[kv.key()] = kv.value().get<std::string>();
    }
    return absl::OkStatus();
  }

  // A JSON non-negative integer that fits in int64.
  static bool AsIndex(const json& v, uint64_t* out) {
    if (!v.is_number_unsigned()) return false;
    *out = v.get<uint64_t>();
    return true;
  }

  absl::Status ParseEntry(const json& value, SafetensorsEntry* entry) {
    const std::string& name = entry->name;
    if (!value.is_object()) {
      return TensorError(name, absl::StrCat("entry is a ", value.type_name(),
                                            ", not an object"));
    }
    for (const auto& kv : value.items()) {
      if (kv.key() != "dtype" && kv.key() != "shape" &&
          kv.key() != "data_offsets") {
        return TensorError(name, absl::StrCat("unknown key '", kv.key(), "'"));
      }
    }
    for (const char* key : {"dtype", "shape", "data_offsets"}) {
      if (!value.contains(key)) {
        return TensorError(name, absl::StrCat("missing '", key, "'"));
      }
    }
    const json& dtype = value["dtype"];
    if (!dtype.is_string()) {
      return TensorError(name, "'dtype' is not a string");
    }
    absl::StatusOr<DType> parsed =
        ParseSafetensorsDType(dtype.get<std::string>());
    if (!parsed.ok()) return TensorError(name, parsed.status().message());
    entry->dtype = *parsed;

    const json& shape = value["shape"];
    if (!shape.is_array()) {
      return TensorError(name, "'shape' is not an array");
    }
    uint64_t numel = 1;
    bool overflow = false;
    for (size_t i = 0; i < shape.size(); ++i) {
      uint64_t d = 0;
      if (!AsIndex(shape[i], &d) ||
          d > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        return TensorError(name,
                           absl::StrCat("'shape'[", i, "] is ", shape[i].dump(),
                                        ", not a non-negative 64-bit integer"));
      }
      entry->shape.push_back(static_cast<int64_t>(d));
      overflow = overflow || MulOverflows(numel, d, &numel);
    }
    uint64_t nbytes = 0;
    if (overflow ||
        numel > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) ||
        MulOverflows(numel, DTypeSize(entry->dtype), &nbytes)) {
      return TensorError(name, absl::StrCat("shape ", ShapeString(entry->shape),
                                            " overflows 64 bits"));
    }

    const json& offsets = value["data_offsets"];
    if (!offsets.is_array() || offsets.size() != 2 ||
        !AsIndex(offsets[0], &entry->begin) ||
        !AsIndex(offsets[1], &entry->end)) {
      return TensorError(
          name, absl::StrCat("'data_offsets' is ", offsets.dump(),
                             ", not two non-negative 64-bit integers"));
    }
    if (entry->end < entry->begin) {
      return TensorError(
          name, absl::StrFormat("data_offsets [%d, %d] end before they begin",
                                entry->begin, entry->end));
    }
    if (entry->end > data_size_) {
      return TensorError(
          name,
          absl::StrFormat("data_offsets [%d, %d] run past the end of the data "
                          "section (%d bytes; is the file truncated?)",
                          entry->begin, entry->end, data_size_));
    }
    if (entry->end - entry->begin != nbytes) {
      return TensorError(
          name, absl::StrFormat("dtype %s and shape %s need %d bytes, but "
                                "data_offsets [%d, %d] hold %d",
                                dtype.get<std::string>(),
                                ShapeString(entry->shape), nbytes, entry->begin,
                                entry->end, entry->end - entry->begin));
    }
    return absl::OkStatus();
  }

  // The tensors, sorted by offset, must tile [0, data_size_).
  absl::Status CheckCoverage(std::vector<SafetensorsEntry>* entries) const {
    std::sort(entries->begin(), entries->end(),
              [](const SafetensorsEntry& a, const SafetensorsEntry& b) {
                return std::tie(a.begin, a.end, a.name) <
                       std::tie(b.begin, b.end, b.name);
              });
    uint64_t expected = 0;
    for (const SafetensorsEntry& e : *entries) {
      if (e.begin != expected) {
        return TensorError(
            e.name,
            absl::StrFormat(
                "data_offsets [%d, %d] %s: the previous tensor ends at byte %d",
                e.begin, e.end, e.begin > expected ? "leave a gap" : "overlap",
                expected));
      }
      expected = e.end;
    }
    if (expected != data_size_) {
      return Error(absl::StrFormat(
          "the tensors cover %d bytes but the data section has %d (trailing "
          "bytes after the last tensor)",
          expected, data_size_));
    }
    return absl::OkStatus();
  }

  const std::string& file_;
  uint64_t data_size_;
};

}  // namespace

absl::string_view SafetensorsDTypeName(DType dtype) {
  for (const DTypeNamePair& p : kDTypeNames) {
    if (p.dtype == dtype) return p.name;
  }
  assert(false && "unhandled dtype");
  return "";
}

absl::StatusOr<DType> ParseSafetensorsDType(absl::string_view name) {
  for (const DTypeNamePair& p : kDTypeNames) {
    if (name == p.name) return p.dtype;
  }
  std::vector<absl::string_view> known;
  for (const DTypeNamePair& p : kDTypeNames) known.push_back(p.name);
  return absl::InvalidArgumentError(
      absl::StrCat("unsupported dtype '", name,
                   "' (supported: ", absl::StrJoin(known, ", "), ")"));
}

int64_t SafetensorsEntry::numel() const { return NumElements(shape); }

absl::StatusOr<std::string> BuildSafetensorsHeader(
    absl::Span<const TensorDecl> tensors,
    const std::map<std::string, std::string>& metadata) {
  FLATPARAM_ASSIGN_OR_RETURN(std::vector<SafetensorsEntry> entries,
                             LayOut(tensors));
  return HeaderFor(entries, metadata);
}

// ---------------------------------------------------------------------------
// SafetensorsWriter

absl::StatusOr<SafetensorsWriter> SafetensorsWriter::Begin(
    WritableFile* file, std::string file_name, std::vector<TensorDecl> tensors,
    const std::map<std::string, std::string>& metadata) {
  absl::StatusOr<std::vector<SafetensorsEntry>> entries = LayOut(tensors);
  if (!entries.ok()) return Annotate(entries.status(), file_name);
  absl::StatusOr<std::string> header = HeaderFor(*entries, metadata);
  if (!header.ok()) return Annotate(header.status(), file_name);
  SafetensorsWriter w;
  w.file_ = file;
  w.file_name_ = std::move(file_name);
  w.entries_ = *std::move(entries);
  w.data_offset_ = kLengthBytes + header->size();
  w.data_size_ = w.entries_.empty() ? 0 : w.entries_.back().end;
  FLATPARAM_RETURN_IF_ERROR(file->Append(EncodeLength(header->size())));
  FLATPARAM_RETURN_IF_ERROR(file->Append(*header));
  return w;
}

absl::Status SafetensorsWriter::Append(absl::string_view bytes) {
  if (bytes.size() > data_size_ - written_) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: appending %d bytes, but only %d of the declared %d remain",
        file_name_, bytes.size(), data_size_ - written_, data_size_));
  }
  FLATPARAM_RETURN_IF_ERROR(file_->Append(bytes));
  written_ += bytes.size();
  return absl::OkStatus();
}

absl::Status SafetensorsWriter::Finish() {
  if (written_ == data_size_) return absl::OkStatus();
  for (const SafetensorsEntry& e : entries_) {
    if (written_ < e.end) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "%s: tensor '%s' has %d of its %d bytes written", file_name_, e.name,
          written_ > e.begin ? written_ - e.begin : 0, e.nbytes()));
    }
  }
  assert(false);
  return absl::InternalError("unreachable");
}

// ---------------------------------------------------------------------------
// Sources and WriteSafetensors

TensorSource TensorSourceFromBytes(std::string name, DType dtype,
                                   std::vector<int64_t> shape,
                                   const void* data) {
  TensorSource source;
  source.name = std::move(name);
  source.dtype = dtype;
  source.shape = std::move(shape);
  const char* bytes = static_cast<const char*>(data);
  source.fill = [bytes](uint64_t offset, absl::Span<char> out) {
    std::copy_n(bytes + offset, out.size(), out.data());
    return absl::OkStatus();
  };
  return source;
}

TensorSource TensorSourceFromHostTensor(std::string name,
                                        const HostTensor& tensor) {
  return TensorSourceFromBytes(std::move(name), tensor.dtype(), tensor.shape(),
                               tensor.data());
}

namespace {
std::vector<TensorDecl> Decls(absl::Span<const TensorSource> tensors) {
  std::vector<TensorDecl> decls;
  decls.reserve(tensors.size());
  for (const TensorSource& t : tensors) {
    decls.push_back({t.name, t.dtype, t.shape});
  }
  return decls;
}
}  // namespace

absl::StatusOr<uint64_t> SafetensorsFileSize(
    absl::Span<const TensorSource> tensors,
    const std::map<std::string, std::string>& metadata) {
  FLATPARAM_ASSIGN_OR_RETURN(std::vector<SafetensorsEntry> entries,
                             LayOut(Decls(tensors)));
  FLATPARAM_ASSIGN_OR_RETURN(std::string header, HeaderFor(entries, metadata));
  return kLengthBytes + header.size() +
         (entries.empty() ? 0 : entries.back().end);
}

absl::Status WriteSafetensors(
    WritableFile& file, const std::string& file_name,
    absl::Span<const TensorSource> tensors,
    const std::map<std::string, std::string>& metadata, uint64_t chunk_bytes) {
  if (chunk_bytes == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(file_name, ": chunk size must be at least 1 byte"));
  }
  FLATPARAM_ASSIGN_OR_RETURN(
      SafetensorsWriter writer,
      SafetensorsWriter::Begin(&file, file_name, Decls(tensors), metadata));
  uint64_t largest = 0;
  for (const SafetensorsEntry& e : writer.entries()) {
    largest = std::max(largest, e.nbytes());
  }
  std::vector<char> buffer(std::min(chunk_bytes, largest));
  const std::vector<size_t> order = DataOrder(Decls(tensors));
  for (size_t k = 0; k < order.size(); ++k) {
    const size_t i = order[k];
    const SafetensorsEntry& e = writer.entries()[k];
    assert(e.name == tensors[i].name);
    if (e.nbytes() > 0 && !tensors[i].fill) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: tensor '%s' has no fill function", file_name, e.name));
    }
    for (uint64_t done = 0; done < e.nbytes();) {
      const uint64_t n = std::min<uint64_t>(buffer.size(), e.nbytes() - done);
      absl::Status filled =
          tensors[i].fill(done, absl::MakeSpan(buffer.data(), n));
      if (!filled.ok()) {
        return Annotate(
            filled, absl::StrFormat("%s: tensor '%s' bytes [%d, %d)", file_name,
                                    e.name, done, done + n));
      }
      FLATPARAM_RETURN_IF_ERROR(
          writer.Append(absl::string_view(buffer.data(), n)));
      done += n;
    }
  }
  return writer.Finish();
}

// ---------------------------------------------------------------------------
// SafetensorsReader

absl::StatusOr<SafetensorsReader> SafetensorsReader::Open(
    FileSystem& fs, const std::string& path,
    const SafetensorsReadOptions& options) {
  FLATPARAM_ASSIGN_OR_RETURN(std::unique_ptr<RandomAccessFile> file,
                             fs.NewRandomAccessFile(path));
  return Open(std::move(file), options);
}

absl::StatusOr<SafetensorsReader> SafetensorsReader::Open(
    std::unique_ptr<RandomAccessFile> file,
    const SafetensorsReadOptions& options) {
  const std::string& name = file->name();
  FLATPARAM_ASSIGN_OR_RETURN(const uint64_t size, file->Size());
  if (size < kLengthBytes) {
    return absl::DataLossError(absl::StrFormat(
        "%s: file has %d bytes, too few for the 8-byte header length", name,
        size));
  }
  char length_bytes[kLengthBytes];
  FLATPARAM_RETURN_IF_ERROR(
      file->ReadAt(0, absl::MakeSpan(length_bytes, kLengthBytes)));
  const uint64_t header_size = DecodeLength(length_bytes);
  if (header_size > options.max_header_bytes) {
    return absl::DataLossError(
        absl::StrFormat("%s: header length %d exceeds the limit of %d bytes",
                        name, header_size, options.max_header_bytes));
  }
  if (header_size > size - kLengthBytes) {
    return absl::DataLossError(absl::StrFormat(
        "%s: header length %d runs past the end of the file (%d bytes)", name,
        header_size, size));
  }
  std::string header(header_size, '\0');
  FLATPARAM_RETURN_IF_ERROR(
      file->ReadAt(kLengthBytes, absl::MakeSpan(header.data(), header.size())));

  SafetensorsReader reader;
  reader.data_offset_ = kLengthBytes + header_size;
  reader.file_size_ = size;
  HeaderParser parser(name, size - reader.data_offset_);
  FLATPARAM_RETURN_IF_ERROR(
      parser.Parse(header, &reader.entries_, &reader.metadata_));
  for (size_t i = 0; i < reader.entries_.size(); ++i) {
    reader.index_[reader.entries_[i].name] = i;
  }
  reader.file_ = std::move(file);
  return reader;
}

absl::StatusOr<const SafetensorsEntry*> SafetensorsReader::Find(
    absl::string_view name) const {
  auto it = index_.find(name);
  if (it == index_.end()) {
    return absl::NotFoundError(
        absl::StrCat(this->name(), ": no tensor named '", name, "'"));
  }
  return &entries_[it->second];
}

bool SafetensorsReader::Contains(absl::string_view name) const {
  return index_.contains(name);
}

absl::Status SafetensorsReader::Read(absl::string_view name,
                                     absl::Span<char> out) const {
  FLATPARAM_ASSIGN_OR_RETURN(const SafetensorsEntry* e, Find(name));
  if (out.size() != e->nbytes()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: tensor '%s' has %d bytes (%s %s) but the buffer has %d",
        this->name(), name, e->nbytes(), SafetensorsDTypeName(e->dtype),
        ShapeString(e->shape), out.size()));
  }
  return ReadRange(name, 0, out);
}

absl::Status SafetensorsReader::ReadRange(absl::string_view name,
                                          uint64_t byte_offset,
                                          absl::Span<char> out) const {
  FLATPARAM_ASSIGN_OR_RETURN(const SafetensorsEntry* e, Find(name));
  if (byte_offset > e->nbytes() || out.size() > e->nbytes() - byte_offset) {
    return absl::OutOfRangeError(absl::StrFormat(
        "%s: bytes [%d, %d) are not within tensor '%s' (%d bytes)",
        this->name(), byte_offset, byte_offset + out.size(), name,
        e->nbytes()));
  }
  if (out.empty()) return absl::OkStatus();
  return Annotate(file_->ReadAt(data_offset_ + e->begin + byte_offset, out),
                  absl::StrCat("tensor '", name, "'"));
}

absl::StatusOr<HostTensor> SafetensorsReader::ReadHostTensor(
    absl::string_view name) const {
  FLATPARAM_ASSIGN_OR_RETURN(const SafetensorsEntry* e, Find(name));
  // Read whole below: no zero-fill first.
  HostTensor tensor = HostTensor::Uninitialized(e->dtype, e->shape);
  assert(tensor.nbytes() == e->nbytes());
  FLATPARAM_RETURN_IF_ERROR(
      Read(name,
           absl::MakeSpan(static_cast<char*>(tensor.data()), tensor.nbytes())));
  return tensor;
}

}  // namespace checkpoint
}  // namespace flatparam
