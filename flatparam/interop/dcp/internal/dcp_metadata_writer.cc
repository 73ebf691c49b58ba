#include "flatparam/interop/dcp/internal/dcp_metadata_writer.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace flatparam {
namespace libtorch {
namespace internal_torch {
namespace {

// TensorProperties and its memory-format enum, MEM_FORMAT_ENCODING, in
// both formats: where 1.13 and 2.0-2.3 define them (later releases read
// those checkpoints).
constexpr char kPropertiesModule[] =
    "torch.distributed._shard.sharded_tensor.metadata";

// The module paths of the other classes a format names.
struct Paths {
  std::string metadata;    // Metadata, ..., MetadataIndex
  std::string filesystem;  // _StorageInfo
};

Paths PathsOf(DcpMetadataFormat format) {
  if (format == DcpMetadataFormat::kPyTorch113) {
    return {"torch.distributed._shard.checkpoint.metadata",
            "torch.distributed._shard.checkpoint.filesystem"};
  }
  return {"torch.distributed.checkpoint.metadata",
          "torch.distributed.checkpoint.filesystem"};
}

// A protocol-2 pickle of the Metadata object, as Python's pickle writes
// dataclasses (NEWOBJ of the class, BUILD with its attributes).
class MetadataPickler {
 public:
  MetadataPickler() {
    Op(0x80);
    out_.push_back(2);
  }
  std::string Finish() {
    Op('.');
    return std::move(out_);
  }

  void Op(uint8_t op) { out_.push_back(static_cast<char>(op)); }
  void Int(int64_t v) {
    Op(0x8a);  // LONG1 with 8 bytes: any int64
    out_.push_back(8);
    for (int k = 0; k < 8; ++k) {
      out_.push_back(static_cast<char>(static_cast<uint64_t>(v) >> (8 * k)));
    }
  }
  void Str(absl::string_view s) {
    Op('X');
    const uint32_t n = static_cast<uint32_t>(s.size());
    for (int k = 0; k < 4; ++k) out_.push_back(static_cast<char>(n >> (8 * k)));
    out_.append(s.data(), s.size());
  }
  void None() { Op('N'); }
  void Bool(bool b) { Op(b ? 0x88 : 0x89); }
  void Global(absl::string_view module, absl::string_view name) {
    Op('c');
    absl::StrAppend(&out_, module, "\n", name, "\n");
  }
  void Size(const std::vector<int64_t>& dims) {  // torch.Size((dims...))
    Global("torch", "Size");
    Op('(');
    for (int64_t d : dims) Int(d);
    Op('t');
    Op(0x85);  // TUPLE1
    Op('R');
  }
  // NEWOBJ of `cls` without arguments; the caller then pushes its state
  // and calls Build().
  void NewObject(absl::string_view module, absl::string_view cls) {
    Global(module, cls);
    Op(')');
    Op(0x81);
  }
  void Build() { Op('b'); }
  void BeginDict() {
    Op('}');
    Op('(');
  }
  void EndDict() { Op('u'); }
  void BeginList() {
    Op(']');
    Op('(');
  }
  void EndList() { Op('e'); }
  void BeginTuple() { Op('('); }
  void EndTuple() { Op('t'); }

 private:
  std::string out_;
};

}  // namespace

std::string PickleDcpMetadata(const std::vector<DcpItem>& items_,
                              DcpMetadataFormat format) {
  const Paths paths = PathsOf(format);
  const bool v2 = format == DcpMetadataFormat::kPyTorch2;
  MetadataPickler p;
  p.NewObject(paths.metadata, "Metadata");
  p.BeginDict();
  p.Str("state_dict_metadata");
  p.BeginDict();
  for (const DcpItem& i : items_) {
    p.Str(i.key);
    if (!i.tensor) {
      p.NewObject(paths.metadata, "BytesStorageMetadata");
      continue;
    }
    p.NewObject(paths.metadata, "TensorStorageMetadata");
    p.BeginDict();
    p.Str("properties");
    p.NewObject(kPropertiesModule, "TensorProperties");
    // __getstate__: (dtype, layout, requires_grad, memory format,
    // pin_memory).
    p.BeginTuple();
    p.Global("torch", DTypeName(i.dtype));
    p.Global("torch.serialization", "_get_layout");
    p.Str("torch.strided");
    p.Op(0x85);
    p.Op('R');
    p.Bool(false);
    p.Global("builtins", "getattr");
    p.Global(kPropertiesModule, "MEM_FORMAT_ENCODING");
    p.Str("TORCH_CONTIGUOUS_FORMAT");
    p.Op(0x86);  // TUPLE2
    p.Op('R');
    p.Bool(false);
    p.EndTuple();
    p.Build();
    p.Str("size");
    p.Size(i.shape);
    p.Str("chunks");
    p.BeginList();
    for (const DcpChunk& c : i.chunks) {
      p.NewObject(paths.metadata, "ChunkStorageMetadata");
      p.BeginDict();
      p.Str("offsets");
      p.Size(c.offsets);
      p.Str("sizes");
      p.Size(c.sizes);
      p.EndDict();
      p.Build();
    }
    p.EndList();
    p.EndDict();
    p.Build();
  }
  p.EndDict();
  p.Str("planner_data");
  if (v2) {
    p.BeginDict();
    for (const DcpItem& i : items_) {
      p.Str(i.key);
      p.BeginTuple();
      for (const std::string& part : i.path) p.Str(part);
      p.EndTuple();
    }
    p.EndDict();
  } else {
    p.None();
  }
  p.Str("storage_data");
  p.BeginDict();
  auto index = [&](const std::string& key, const std::vector<int64_t>* offsets,
                   int64_t k) {
    p.NewObject(paths.metadata, "MetadataIndex");
    p.BeginDict();
    p.Str("fqn");
    p.Str(key);
    p.Str("offset");
    if (offsets != nullptr) {
      p.Size(*offsets);
    } else {
      p.None();
    }
    p.Str("index");
    if (offsets != nullptr) {
      p.Int(k);
    } else {
      p.None();
    }
    p.EndDict();
    p.Build();
  };
  auto info = [&](const DcpStorage& s) {
    p.NewObject(paths.filesystem, "_StorageInfo");
    p.BeginDict();
    p.Str("relative_path");
    p.Str(s.file);
    p.Str("offset");
    p.Int(static_cast<int64_t>(s.offset));
    p.Str("length");
    p.Int(static_cast<int64_t>(s.length));
    p.EndDict();
    p.Build();
  };
  for (const DcpItem& i : items_) {
    if (!i.tensor) {
      index(i.key, nullptr, 0);
      info(i.storage);
      continue;
    }
    for (size_t k = 0; k < i.chunks.size(); ++k) {
      index(i.key, &i.chunks[k].offsets, static_cast<int64_t>(k));
      info(i.chunks[k].storage);
    }
  }
  p.EndDict();
  if (v2) {
    p.Str("storage_meta");
    p.None();
    p.Str("version");
    p.Str("1.0.0");
  }
  p.EndDict();
  p.Build();
  return p.Finish();
}

std::vector<std::pair<int64_t, int64_t>> TorchChunkRows(int64_t rows,
                                                        int64_t world) {
  std::vector<std::pair<int64_t, int64_t>> out;
  const int64_t size = (rows + world - 1) / world;
  for (int64_t start = 0; start < rows; start += size) {
    out.emplace_back(start, std::min(size, rows - start));
  }
  return out;
}

std::vector<std::string> DcpPathOf(const std::string& prefix,
                                   std::vector<std::string> rest) {
  std::vector<std::string> out;
  if (!prefix.empty()) {
    out.push_back(prefix.back() == '.' ? prefix.substr(0, prefix.size() - 1)
                                       : prefix);
  }
  for (std::string& r : rest) out.push_back(std::move(r));
  return out;
}

}  // namespace internal_torch
}  // namespace libtorch
}  // namespace flatparam
