#include "flatparam/interop/dcp/dcp.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/interop/internal/pickle.h"

namespace flatparam {
namespace libtorch {
namespace {

using checkpoint::FileSystem;
using checkpoint::JoinPath;
using checkpoint::RandomAccessFile;
using internal_torch::KindName;
using internal_torch::Node;
using internal_torch::NodePtr;

constexpr char kModule113[] = "torch.distributed._shard.checkpoint";
constexpr char kModule2[] = "torch.distributed.checkpoint";
constexpr int kMaxDims = 64;

// Bytes [offset, offset + length) of a file, as a file of their own.
class SliceFile : public RandomAccessFile {
 public:
  SliceFile(std::unique_ptr<RandomAccessFile> file, uint64_t offset,
            uint64_t length, std::string name)
      : file_(std::move(file)),
        offset_(offset),
        length_(length),
        name_(std::move(name)) {}

  absl::Status ReadAt(uint64_t offset, absl::Span<char> out) const override {
    if (offset > length_ || out.size() > length_ - offset) {
      return absl::DataLossError(
          absl::StrFormat("%s: read of bytes [%d, %d) past the item's %d bytes",
                          name_, offset, offset + out.size(), length_));
    }
    return file_->ReadAt(offset_ + offset, out);
  }
  absl::StatusOr<uint64_t> Size() const override { return length_; }
  const std::string& name() const override { return name_; }

 private:
  std::unique_ptr<RandomAccessFile> file_;
  uint64_t offset_;
  uint64_t length_;
  std::string name_;
};

std::string Shape(const std::vector<int64_t>& v) {
  return absl::StrCat("[", absl::StrJoin(v, ", "), "]");
}

// The class name of an object node without its module.
absl::string_view ClassName(const Node& n) {
  const size_t dot = n.s.rfind('.');
  return dot == std::string::npos ? absl::string_view(n.s)
                                  : absl::string_view(n.s).substr(dot + 1);
}

// Parses the Node tree of a .metadata pickle.
class MetadataParser {
 public:
  explicit MetadataParser(std::string path) : path_(std::move(path)) {}

  absl::StatusOr<DcpMetadata> Parse(const Node& root) {
    FLATPARAM_RETURN_IF_ERROR(ExpectObject(root, "Metadata", "the pickle"));
    DcpMetadata out;
    out.module = root.s.substr(0, root.s.rfind('.'));
    if (absl::EndsWith(out.module, ".metadata")) {
      out.module.resize(out.module.size() - std::strlen(".metadata"));
    }
    if (const Node* version = Attr(root, "version");
        version != nullptr && version->kind != Node::kNone) {
      if (version->kind != Node::kStr) {
        return Bad("Metadata.version is a %s", KindName(version->kind));
      }
      out.version = version->s;
    }
    const Node* sdm = Attr(root, "state_dict_metadata");
    if (sdm == nullptr || sdm->kind != Node::kDict) {
      return Bad("Metadata.state_dict_metadata is missing or not a dict");
    }
    for (const auto& [k, v] : sdm->dict) {
      if (k->kind != Node::kStr) {
        return Bad("a state_dict_metadata key of type %s", KindName(k->kind));
      }
      FLATPARAM_ASSIGN_OR_RETURN(DcpEntry entry, Entry(k->s, *v));
      out.entries.emplace(k->s, std::move(entry));
    }
    const Node* storage = Attr(root, "storage_data");
    if (storage == nullptr || storage->kind != Node::kDict) {
      return Bad(
          "Metadata.storage_data is missing or not a dict (a checkpoint of "
          "another storage writer than FileSystemWriter?)");
    }
    FLATPARAM_RETURN_IF_ERROR(Storage(*storage, out));
    for (auto& [key, entry] : out.entries) {
      FLATPARAM_RETURN_IF_ERROR(CheckTiling(key, entry));
    }
    return out;
  }

 private:
  template <typename... Args>
  absl::Status Bad(const absl::FormatSpec<Args...>& format,
                   const Args&... args) const {
    return absl::DataLossError(
        absl::StrCat(path_, ": ", absl::StrFormat(format, args...)));
  }

  static const Node* Attr(const Node& object, const std::string& name) {
    auto it = object.dict_index.find(absl::StrCat("s", name));
    return it == object.dict_index.end() ? nullptr
                                         : object.dict[it->second].second.get();
  }

  absl::Status ExpectObject(const Node& n, absl::string_view cls,
                            absl::string_view what) const {
    if (n.kind != Node::kObject || ClassName(n) != cls) {
      return Bad("%s is a %s, not a %s", what,
                 n.kind == Node::kObject ? n.s : KindName(n.kind), cls);
    }
    return absl::OkStatus();
  }

  // A tuple (torch.Size) of ints >= 0.
  absl::StatusOr<std::vector<int64_t>> Ints(const Node* n,
                                            absl::string_view what) const {
    if (n == nullptr || n->kind != Node::kTuple || n->items.size() > kMaxDims) {
      return Bad("%s is not a torch.Size of at most %d dimensions", what,
                 kMaxDims);
    }
    std::vector<int64_t> out;
    for (const NodePtr& v : n->items) {
      if (v->kind != Node::kInt || v->i < 0) {
        return Bad("%s holds a value that is not an int >= 0", what);
      }
      out.push_back(v->i);
    }
    return out;
  }

  absl::StatusOr<DType> Dtype(const Node& props, const std::string& key) const {
    // 2.x and 1.13 pickle TensorProperties' __getstate__ tuple (dtype,
    // layout, requires_grad, memory_format, pin_memory); a dataclass
    // without it would give its attributes.
    const Node* dtype =
        !props.items.empty() ? props.items[0].get() : Attr(props, "dtype");
    if (dtype == nullptr || dtype->kind != Node::kGlobal ||
        !absl::StartsWith(dtype->s, "torch.")) {
      return Bad("%s: TensorProperties without a dtype", key);
    }
    absl::StatusOr<DType> parsed = ParseDType(dtype->s);
    if (!parsed.ok()) {
      return absl::FailedPreconditionError(absl::StrCat(
          path_, ": ", key, ": dtype ", dtype->s, " is not supported"));
    }
    return *parsed;
  }

  absl::StatusOr<DcpEntry> Entry(const std::string& key, const Node& n) const {
    DcpEntry e;
    if (n.kind == Node::kObject && ClassName(n) == "BytesStorageMetadata") {
      e.kind = DcpEntry::Kind::kBytes;
      return e;
    }
    FLATPARAM_RETURN_IF_ERROR(ExpectObject(n, "TensorStorageMetadata",
                                           absl::StrCat(key, "'s entry")));
    const Node* props = Attr(n, "properties");
    if (props == nullptr) return Bad("%s: no properties", key);
    FLATPARAM_RETURN_IF_ERROR(ExpectObject(*props, "TensorProperties",
                                           absl::StrCat(key, "'s properties")));
    FLATPARAM_ASSIGN_OR_RETURN(e.dtype, Dtype(*props, key));
    FLATPARAM_ASSIGN_OR_RETURN(
        e.shape, Ints(Attr(n, "size"), absl::StrCat(key, "'s size")));
    const Node* chunks = Attr(n, "chunks");
    if (chunks == nullptr || chunks->kind != Node::kList) {
      return Bad("%s: chunks is not a list", key);
    }
    for (const NodePtr& c : chunks->items) {
      FLATPARAM_RETURN_IF_ERROR(ExpectObject(*c, "ChunkStorageMetadata",
                                             absl::StrCat(key, "'s chunk")));
      DcpChunk chunk;
      FLATPARAM_ASSIGN_OR_RETURN(
          chunk.offsets,
          Ints(Attr(*c, "offsets"), absl::StrCat(key, "'s chunk offsets")));
      FLATPARAM_ASSIGN_OR_RETURN(
          chunk.sizes,
          Ints(Attr(*c, "sizes"), absl::StrCat(key, "'s chunk sizes")));
      if (chunk.offsets.size() != e.shape.size() ||
          chunk.sizes.size() != e.shape.size()) {
        return Bad("%s: a chunk at %s of sizes %s in a tensor of size %s", key,
                   Shape(chunk.offsets), Shape(chunk.sizes), Shape(e.shape));
      }
      e.chunks.push_back(std::move(chunk));
    }
    std::sort(e.chunks.begin(), e.chunks.end(),
              [](const DcpChunk& a, const DcpChunk& b) {
                return a.offsets < b.offsets;
              });
    return e;
  }

  // A relative_path must name a file of the checkpoint's directory.
  absl::Status CheckFileName(const std::string& name) const {
    if (name.empty() || name == "." || name == ".." ||
        name.find_first_of(std::string("/\\\0", 3)) != std::string::npos ||
        name.size() > 255) {
      return Bad(
          "relative_path \"%s\" is not a file name of the checkpoint's "
          "directory",
          absl::CHexEscape(name.substr(0, 300)));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<DcpStorage> StorageInfo(const Node& n,
                                         const std::string& what) const {
    FLATPARAM_RETURN_IF_ERROR(ExpectObject(n, "_StorageInfo", what));
    const Node* transforms = Attr(n, "transform_descriptors");
    if (transforms != nullptr && transforms->kind != Node::kNone &&
        !(transforms->kind == Node::kList ||
          transforms->kind == Node::kTuple)) {
      return Bad("%s: transform_descriptors is a %s", what,
                 KindName(transforms->kind));
    }
    if (transforms != nullptr && !transforms->items.empty()) {
      std::vector<std::string> names;
      for (const NodePtr& t : transforms->items) {
        names.push_back(t->kind == Node::kStr ? t->s : KindName(t->kind));
      }
      return absl::FailedPreconditionError(absl::StrCat(
          path_, ": ", what, " is stored through DCP's extensions [",
          absl::StrJoin(names, ", "),
          "] (such as zstd), which this reader does not support; save "
          "without them"));
    }
    const Node* rel = Attr(n, "relative_path");
    const Node* offset = Attr(n, "offset");
    const Node* length = Attr(n, "length");
    if (rel == nullptr || rel->kind != Node::kStr || offset == nullptr ||
        offset->kind != Node::kInt || offset->i < 0 || length == nullptr ||
        length->kind != Node::kInt || length->i < 0) {
      return Bad(
          "%s: a _StorageInfo without relative_path, offset >= 0 and "
          "length >= 0",
          what);
    }
    FLATPARAM_RETURN_IF_ERROR(CheckFileName(rel->s));
    DcpStorage s;
    s.file = rel->s;
    s.offset = static_cast<uint64_t>(offset->i);
    s.length = static_cast<uint64_t>(length->i);
    if (s.length > std::numeric_limits<uint64_t>::max() - s.offset) {
      return Bad("%s: offset %d + length %d overflows", what, s.offset,
                 s.length);
    }
    return s;
  }

  absl::Status Storage(const Node& storage, DcpMetadata& out) const {
    // Which chunk (or bytes item) each storage entry belongs to.
    std::set<std::pair<std::string, std::vector<int64_t>>> seen;
    for (const auto& [k, v] : storage.dict) {
      FLATPARAM_RETURN_IF_ERROR(
          ExpectObject(*k, "MetadataIndex", "a storage_data key"));
      const Node* fqn = Attr(*k, "fqn");
      if (fqn == nullptr || fqn->kind != Node::kStr) {
        return Bad("a MetadataIndex without an fqn");
      }
      const std::string& key = fqn->s;
      auto it = out.entries.find(key);
      if (it == out.entries.end()) {
        return Bad(
            "storage_data names \"%s\", which state_dict_metadata "
            "lacks",
            absl::CHexEscape(key.substr(0, 300)));
      }
      const Node* offset = Attr(*k, "offset");
      const bool has_offset = offset != nullptr && offset->kind != Node::kNone;
      std::vector<int64_t> offsets;
      if (has_offset) {
        FLATPARAM_ASSIGN_OR_RETURN(
            offsets, Ints(offset, absl::StrCat(key, "'s storage offset")));
      }
      if (!seen.emplace(key, offsets).second) {
        return Bad("%s: two storage entries for the item at %s", key,
                   Shape(offsets));
      }
      const std::string what = absl::StrCat(key, " at ", Shape(offsets));
      FLATPARAM_ASSIGN_OR_RETURN(DcpStorage s, StorageInfo(*v, what));
      DcpEntry& e = it->second;
      if (e.kind == DcpEntry::Kind::kBytes) {
        if (has_offset) return Bad("%s: a bytes item with an offset", key);
        e.storage = std::move(s);
        continue;
      }
      auto chunk =
          std::find_if(e.chunks.begin(), e.chunks.end(),
                       [&](const DcpChunk& c) { return c.offsets == offsets; });
      if (!has_offset || chunk == e.chunks.end()) {
        return Bad("%s: storage for a chunk at %s, which the tensor lacks", key,
                   has_offset ? Shape(offsets) : std::string("None"));
      }
      chunk->storage = std::move(s);
    }
    for (const auto& [key, e] : out.entries) {
      if (e.kind == DcpEntry::Kind::kBytes) {
        if (seen.count({key, {}}) == 0) return Bad("%s: no storage", key);
        continue;
      }
      for (const DcpChunk& c : e.chunks) {
        if (seen.count({key, c.offsets}) == 0) {
          return Bad("%s: no storage for its chunk at %s", key,
                     Shape(c.offsets));
        }
        // torch.save stores a tensor's bytes uncompressed, so its archive
        // is larger than they are: a chunk cannot claim more memory than
        // its file holds.
        __int128 bytes = DTypeSize(e.dtype);
        for (int64_t d : c.sizes) {
          bytes *= d;
          if (bytes > (__int128{1} << 64)) break;
        }
        if (bytes > static_cast<__int128>(c.storage.length)) {
          return Bad(
              "%s: a chunk at %s of sizes %s (%s) is stored in %d "
              "bytes, fewer than its elements take",
              key, Shape(c.offsets), Shape(c.sizes), DTypeName(e.dtype),
              c.storage.length);
        }
      }
    }
    return absl::OkStatus();
  }

  // Chunks within the tensor, none overlapping another, covering it.
  absl::Status CheckTiling(const std::string& key, const DcpEntry& e) const {
    if (e.kind != DcpEntry::Kind::kTensor) return absl::OkStatus();
    __int128 numel = 1;
    for (int64_t d : e.shape) {
      numel *= d;
      if (numel > (__int128{1} << 62)) return Bad("%s: size overflows", key);
    }
    __int128 covered = 0;
    for (const DcpChunk& c : e.chunks) {
      __int128 volume = 1;
      for (size_t d = 0; d < e.shape.size(); ++d) {
        if (c.offsets[d] > e.shape[d] ||
            c.sizes[d] > e.shape[d] - c.offsets[d]) {
          return Bad(
              "%s: a chunk at %s of sizes %s reaches beyond the "
              "tensor's size %s",
              key, Shape(c.offsets), Shape(c.sizes), Shape(e.shape));
        }
        volume *= c.sizes[d];
      }
      covered += volume;
    }
    // Chunks sorted by offsets: only those whose first-dimension ranges
    // meet can overlap.
    auto overlap = [&](const DcpChunk& a, const DcpChunk& b) {
      for (size_t d = 0; d < e.shape.size(); ++d) {
        if (a.sizes[d] == 0 || b.sizes[d] == 0) return false;
        if (a.offsets[d] + a.sizes[d] <= b.offsets[d] ||
            b.offsets[d] + b.sizes[d] <= a.offsets[d]) {
          return false;
        }
      }
      return true;
    };
    if (!e.shape.empty()) {
      std::vector<const DcpChunk*> active;
      for (const DcpChunk& c : e.chunks) {
        active.erase(std::remove_if(active.begin(), active.end(),
                                    [&](const DcpChunk* a) {
                                      return a->offsets[0] + a->sizes[0] <=
                                             c.offsets[0];
                                    }),
                     active.end());
        for (const DcpChunk* a : active) {
          if (overlap(*a, c)) {
            return Bad("%s: chunks at %s (sizes %s) and %s (sizes %s) overlap",
                       key, Shape(a->offsets), Shape(a->sizes),
                       Shape(c.offsets), Shape(c.sizes));
          }
        }
        active.push_back(&c);
      }
    } else if (e.chunks.size() > 1) {
      return Bad("%s: a scalar in %d chunks", key, e.chunks.size());
    }
    if (covered != numel) {
      return Bad("%s: its chunks hold %d of its %d elements (a gap)", key,
                 static_cast<int64_t>(covered), static_cast<int64_t>(numel));
    }
    return absl::OkStatus();
  }

  std::string path_;
};

// A bytes item's value as JSON.
absl::StatusOr<nlohmann::json> ToJson(const Node& n, const std::string& where) {
  switch (n.kind) {
    case Node::kNone:
      return nlohmann::json(nullptr);
    case Node::kBool:
      return nlohmann::json(n.b);
    case Node::kInt:
      return nlohmann::json(n.i);
    case Node::kFloat:
      return nlohmann::json(n.f);
    case Node::kStr:
      return nlohmann::json(n.s);
    case Node::kTuple:
    case Node::kList: {
      nlohmann::json out = nlohmann::json::array();
      for (size_t k = 0; k < n.items.size(); ++k) {
        FLATPARAM_ASSIGN_OR_RETURN(
            nlohmann::json v,
            ToJson(*n.items[k], absl::StrCat(where, "[", k, "]")));
        out.push_back(std::move(v));
      }
      return out;
    }
    case Node::kDict: {
      nlohmann::json out = nlohmann::json::object();
      for (const auto& [k, v] : n.dict) {
        const std::string name =
            k->kind == Node::kStr ? k->s : absl::StrCat(k->i);
        FLATPARAM_ASSIGN_OR_RETURN(
            nlohmann::json value,
            ToJson(*v, absl::StrCat(where, "[\"", name, "\"]")));
        out[name] = std::move(value);
      }
      return out;
    }
    default:
      return absl::FailedPreconditionError(absl::StrCat(
          where, " is a ", KindName(n.kind),
          " (a bytes item is read as None, bool, int, float, str, lists, "
          "tuples and dicts)"));
  }
}

// Copies where the box `src` (contiguous, of src.shape(), at
// `src_offsets` in the tensor) and the box `dst` (at `dst_offsets`) meet,
// from one to the other. Boxes of a 0-d tensor are its one element.
void CopyIntersection(const HostTensor& src,
                      const std::vector<int64_t>& src_offsets, HostTensor& dst,
                      const std::vector<int64_t>& dst_offsets) {
  const size_t es = DTypeSize(dst.dtype());
  const size_t dims = dst.shape().size();
  if (dims == 0) {
    if (src.numel() == 1 && dst.numel() == 1) {
      std::memcpy(dst.data(), src.data(), es);
    }
    return;
  }
  std::vector<int64_t> lo(dims), hi(dims);
  for (size_t d = 0; d < dims; ++d) {
    lo[d] = std::max(src_offsets[d], dst_offsets[d]);
    hi[d] = std::min(src_offsets[d] + src.shape()[d],
                     dst_offsets[d] + dst.shape()[d]);
    if (lo[d] >= hi[d]) return;
  }
  auto strides = [dims](const std::vector<int64_t>& shape) {
    std::vector<int64_t> out(dims, 1);
    for (size_t d = dims - 1; d-- > 0;) out[d] = out[d + 1] * shape[d + 1];
    return out;
  };
  const std::vector<int64_t> ss = strides(src.shape());
  const std::vector<int64_t> ds = strides(dst.shape());
  const int64_t run = hi[dims - 1] - lo[dims - 1];
  std::vector<int64_t> idx(lo);  // the current row's first element
  const char* from = static_cast<const char*>(src.data());
  char* to = static_cast<char*>(dst.data());
  while (true) {
    int64_t s_at = 0, d_at = 0;
    for (size_t d = 0; d < dims; ++d) {
      s_at += (idx[d] - src_offsets[d]) * ss[d];
      d_at += (idx[d] - dst_offsets[d]) * ds[d];
    }
    std::memcpy(to + d_at * es, from + s_at * es, run * es);
    size_t d = dims - 1;
    while (d-- > 0) {
      if (++idx[d] < hi[d]) break;
      idx[d] = lo[d];
    }
    if (d == static_cast<size_t>(-1)) break;
  }
}

}  // namespace

absl::StatusOr<bool> IsDcpCheckpoint(FileSystem& fs, const std::string& dir) {
  FLATPARAM_ASSIGN_OR_RETURN(bool is_dir, fs.IsDirectory(dir));
  if (!is_dir) return false;
  return fs.Exists(JoinPath(dir, kDcpMetadataFileName));
}

absl::StatusOr<DcpMetadata> ParseDcpMetadata(const std::string& pickle,
                                             const std::string& path) {
  FLATPARAM_ASSIGN_OR_RETURN(NodePtr root,
                             internal_torch::UnpickleDcpMetadata(pickle, path));
  FLATPARAM_ASSIGN_OR_RETURN(DcpMetadata metadata,
                             MetadataParser(path).Parse(*root));
  if (metadata.module != kModule113 && metadata.module != kModule2) {
    return absl::DataLossError(
        absl::StrCat(path, ": Metadata of module ", metadata.module));
  }
  return metadata;
}

absl::StatusOr<DcpReader> DcpReader::Open(FileSystem& fs,
                                          const std::string& dir) {
  const std::string path = JoinPath(dir, kDcpMetadataFileName);
  FLATPARAM_ASSIGN_OR_RETURN(std::unique_ptr<RandomAccessFile> file,
                             fs.NewRandomAccessFile(path));
  FLATPARAM_ASSIGN_OR_RETURN(uint64_t size, file->Size());
  if (size > kMaxDcpMetadataBytes) {
    return absl::FailedPreconditionError(
        absl::StrCat(path, ": ", size, " bytes, more than the limit ",
                     kMaxDcpMetadataBytes));
  }
  std::string pickle(size, '\0');
  FLATPARAM_RETURN_IF_ERROR(file->ReadAt(0, absl::MakeSpan(pickle)));
  FLATPARAM_ASSIGN_OR_RETURN(DcpMetadata metadata,
                             ParseDcpMetadata(pickle, path));
  // Every byte range within its file.
  std::map<std::string, uint64_t> sizes;
  auto check = [&](const std::string& key,
                   const DcpStorage& s) -> absl::Status {
    auto it = sizes.find(s.file);
    if (it == sizes.end()) {
      absl::StatusOr<uint64_t> file_size =
          fs.GetFileSize(JoinPath(dir, s.file));
      if (!file_size.ok()) {
        return absl::DataLossError(absl::StrCat(
            path, ": ", key, " is stored in ", s.file,
            ", which cannot be read: ", file_size.status().message()));
      }
      it = sizes.emplace(s.file, *file_size).first;
    }
    if (s.offset + s.length > it->second) {
      return absl::DataLossError(absl::StrFormat(
          "%s: %s is stored at bytes [%d, %d) of %s, which has %d bytes", path,
          key, s.offset, s.offset + s.length, s.file, it->second));
    }
    return absl::OkStatus();
  };
  for (const auto& [key, e] : metadata.entries) {
    if (e.kind == DcpEntry::Kind::kBytes) {
      FLATPARAM_RETURN_IF_ERROR(check(key, e.storage));
      continue;
    }
    for (const DcpChunk& c : e.chunks) {
      FLATPARAM_RETURN_IF_ERROR(
          check(absl::StrCat(key, " at ", Shape(c.offsets)), c.storage));
    }
  }
  return DcpReader(fs, dir, std::move(metadata));
}

namespace {

absl::StatusOr<NodePtr> LoadItem(FileSystem& fs, const std::string& dir,
                                 const DcpStorage& s, const std::string& what) {
  const std::string path = JoinPath(dir, s.file);
  FLATPARAM_ASSIGN_OR_RETURN(std::unique_ptr<RandomAccessFile> file,
                             fs.NewRandomAccessFile(path));
  const std::string name = absl::StrFormat("%s (%s, bytes %d-%d)", path, what,
                                           s.offset, s.offset + s.length);
  // PyTorch's FileSystemWriter may serialize items other than by
  // torch.save (serialization_format=SAFETENSORS: each .distcp file one
  // safetensors file): say so rather than "not a zip archive".
  char magic[9] = {};
  if (s.length >= 4) {
    FLATPARAM_RETURN_IF_ERROR(
        file->ReadAt(s.offset, absl::Span<char>(magic, 4)));
  }
  if (s.length < 4 || std::memcmp(magic, "PK\x03\x04", 4) != 0) {
    absl::StatusOr<uint64_t> size = file->Size();
    if (size.ok() && *size >= 9 &&
        file->ReadAt(0, absl::Span<char>(magic, 9)).ok() && magic[8] == '{') {
      return absl::FailedPreconditionError(absl::StrCat(
          name,
          ": the .distcp file is a safetensors file (DCP saved with "
          "serialization_format=SAFETENSORS), which this reader does not "
          "support; save with the default torch.save serialization"));
    }
    return absl::DataLossError(
        absl::StrCat(name, ": not a torch.save archive"));
  }
  return internal_torch::LoadTorchArchive(
      std::make_unique<SliceFile>(std::move(file), s.offset, s.length, name),
      s.length, name);
}

}  // namespace

absl::StatusOr<HostTensor> DcpReader::ReadChunk(const std::string& key,
                                                size_t index) const {
  auto it = metadata_.entries.find(key);
  if (it == metadata_.entries.end()) {
    return absl::NotFoundError(
        absl::StrCat(dir_, ": no item \"", key, "\" in the checkpoint"));
  }
  const DcpEntry& e = it->second;
  if (e.kind != DcpEntry::Kind::kTensor || index >= e.chunks.size()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: %s has no tensor chunk %d", dir_, key, index));
  }
  const DcpChunk& c = e.chunks[index];
  const std::string what = absl::StrCat(key, " at ", Shape(c.offsets));
  FLATPARAM_ASSIGN_OR_RETURN(NodePtr n, LoadItem(*fs_, dir_, c.storage, what));
  if (n->kind != Node::kTensor || n->tensor == nullptr) {
    return absl::DataLossError(absl::StrCat(
        dir_, ": ", what, " holds a ", KindName(n->kind), ", not a tensor"));
  }
  HostTensor& t = *n->tensor;
  if (t.dtype() != e.dtype || t.shape() != c.sizes) {
    return absl::DataLossError(
        absl::StrCat(dir_, ": ", what, " holds a ", DTypeName(t.dtype()),
                     " tensor of ", Shape(t.shape()), ", the metadata says ",
                     DTypeName(e.dtype), " ", Shape(c.sizes)));
  }
  return std::move(t);
}

absl::StatusOr<HostTensor> DcpReader::ReadTensor(const std::string& key) const {
  auto it = metadata_.entries.find(key);
  if (it == metadata_.entries.end()) {
    return absl::NotFoundError(
        absl::StrCat(dir_, ": no item \"", key, "\" in the checkpoint"));
  }
  const DcpEntry& e = it->second;
  if (e.kind != DcpEntry::Kind::kTensor) {
    return absl::InvalidArgumentError(
        absl::StrCat(dir_, ": ", key, " is a bytes item, not a tensor"));
  }
  HostTensor full = HostTensor::Uninitialized(e.dtype, e.shape);
  for (size_t k = 0; k < e.chunks.size(); ++k) {
    FLATPARAM_ASSIGN_OR_RETURN(HostTensor chunk, ReadChunk(key, k));
    CopyIntersection(chunk, e.chunks[k].offsets, full,
                     std::vector<int64_t>(e.shape.size(), 0));
  }
  return full;
}

absl::StatusOr<HostTensor> DcpReader::ReadBox(
    const std::string& key, const std::vector<int64_t>& offsets,
    const std::vector<int64_t>& sizes) const {
  auto it = metadata_.entries.find(key);
  if (it == metadata_.entries.end()) {
    return absl::NotFoundError(
        absl::StrCat(dir_, ": no item \"", key, "\" in the checkpoint"));
  }
  const DcpEntry& e = it->second;
  bool inside = e.kind == DcpEntry::Kind::kTensor &&
                offsets.size() == e.shape.size() &&
                sizes.size() == e.shape.size();
  for (size_t d = 0; inside && d < e.shape.size(); ++d) {
    inside = offsets[d] >= 0 && sizes[d] >= 0 && offsets[d] <= e.shape[d] &&
             sizes[d] <= e.shape[d] - offsets[d];
  }
  if (!inside) {
    return absl::InvalidArgumentError(
        absl::StrCat(dir_, ": ", key, " has no box at ", Shape(offsets),
                     " of sizes ", Shape(sizes),
                     e.kind == DcpEntry::Kind::kTensor
                         ? absl::StrCat(" (its size is ", Shape(e.shape), ")")
                         : std::string(" (a bytes item)")));
  }
  HostTensor out = HostTensor::Uninitialized(e.dtype, sizes);
  if (out.numel() == 0) return out;
  for (size_t k = 0; k < e.chunks.size(); ++k) {
    const DcpChunk& c = e.chunks[k];
    bool meets = true;
    for (size_t d = 0; d < e.shape.size(); ++d) {
      meets &= c.sizes[d] > 0 && c.offsets[d] < offsets[d] + sizes[d] &&
               offsets[d] < c.offsets[d] + c.sizes[d];
    }
    if (!meets) continue;
    FLATPARAM_ASSIGN_OR_RETURN(HostTensor chunk, ReadChunk(key, k));
    CopyIntersection(chunk, c.offsets, out, offsets);
  }
  return out;
}

absl::StatusOr<nlohmann::json> DcpReader::ReadBytes(
    const std::string& key) const {
  auto it = metadata_.entries.find(key);
  if (it == metadata_.entries.end()) {
    return absl::NotFoundError(
        absl::StrCat(dir_, ": no item \"", key, "\" in the checkpoint"));
  }
  if (it->second.kind != DcpEntry::Kind::kBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(dir_, ": ", key, " is a tensor, not a bytes item"));
  }
  FLATPARAM_ASSIGN_OR_RETURN(NodePtr n,
                             LoadItem(*fs_, dir_, it->second.storage, key));
  return ToJson(*n, absl::StrCat(dir_, ": ", key));
}

}  // namespace libtorch
}  // namespace flatparam
