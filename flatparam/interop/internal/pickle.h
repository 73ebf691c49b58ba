// Private to //flatparam/torch: the restricted unpickler that the readers
// of torch.save files (torch_save/torch_save.h) and of PyTorch Distributed
// Checkpoint's .metadata files (dcp/dcp.h) share. It executes nothing: it
// knows the opcodes these files use and, per dialect, a fixed set of
// globals, which it interprets itself; any other global or opcode is
// refused (FailedPrecondition naming it), and a damaged pickle is DataLoss
// naming the file and the byte.
//
// Dialects:
//  - kTorchSave: torch.save's data.pkl. Globals: collections.OrderedDict,
//    torch._utils._rebuild_tensor_v2 / _rebuild_parameter and the typed
//    storage classes; tensors are copied out of the archive's storages.
//  - kDcpMetadata: a DCP .metadata pickle (protocol 2 to 5). Globals: the
//    Metadata dataclasses (Metadata, TensorStorageMetadata,
//    ChunkStorageMetadata, BytesStorageMetadata, MetadataIndex,
//    TensorProperties, StorageMeta, _StorageInfo) by their PyTorch 1.13
//    (torch.distributed._shard.checkpoint, ._shard.sharded_tensor) and
//    2.x (torch.distributed.checkpoint) module paths, made by NEWOBJ with
//    no arguments and filled by BUILD (kObject nodes); torch.Size(tuple)
//    (a tuple); torch dtypes such as torch.float32 (kGlobal, s =
//    "torch.float32"); torch.serialization._get_layout(str) and
//    builtins.getattr(MEM_FORMAT_ENCODING enum, str) (kStr of the
//    argument). Dict keys may be objects (storage_data's MetadataIndex).
//
// Values nest at most 100 containers deep and no container holds itself
// (DataLoss otherwise), so callers may walk them recursively.
//
// Ownership: a returned value owns its nodes (shared_ptr; no cycles).
// Thread-safety: the functions are reentrant.
#ifndef FLATPARAM_INTEROP_INTERNAL_PICKLE_H_
#define FLATPARAM_INTEROP_INTERNAL_PICKLE_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "flatparam/base/dtype.h"
#include "flatparam/checkpoint/file_system.h"
#include "flatparam/flatten.h"

namespace flatparam {
namespace libtorch {
namespace internal_torch {

struct Node;
using NodePtr = std::shared_ptr<Node>;

// A typed storage of a torch.save archive.
struct Storage {
  DType dtype = DType::kFloat32;
  int64_t numel = 0;
  std::string key;
  std::shared_ptr<std::string> bytes;  // loaded on first use
};

// An unpickled value. Lists and dicts are shared (the memo and the stack
// hold the same object that APPENDS/SETITEMS mutate).
struct Node {
  enum Kind {
    kNone,
    kBool,
    kInt,
    kFloat,
    kStr,
    kTuple,
    kList,
    kDict,
    kTensor,
    kGlobal,   // s: "module.name" of an allowed global
    kStorage,  // a storage class (s: its name) or, with storage set, data
    kMark,     // stack marker
    kObject,   // kDcpMetadata: s: its class "module.name"; dict: its
               // attributes (BUILD with a dict); items: a tuple state
  };
  Kind kind = kNone;
  bool b = false;
  int64_t i = 0;
  double f = 0;
  std::string s;
  std::vector<NodePtr> items;                     // tuple, list
  std::vector<std::pair<NodePtr, NodePtr>> dict;  // dict, in order
  std::map<std::string, size_t>
      dict_index;  // "s" + str, "i" + int or "o" + object key -> index
  std::shared_ptr<HostTensor> tensor;
  std::shared_ptr<Storage> storage;
};

// torch.save archives larger than this are refused unread
// (torch_save/torch_save.h's kMaxTorchFileBytes).
inline constexpr uint64_t kMaxTorchArchiveBytes = uint64_t{64} << 30;

NodePtr Make(Node::Kind kind);
const char* KindName(Node::Kind kind);

// "torch.FloatStorage" -> float32, ...
const std::map<std::string, DType>& StorageTypes();
// "FloatStorage" for float32; empty for a dtype torch.save has no class for.
std::string StorageTypeName(DType dtype);

inline constexpr char kOrderedDict[] = "collections.OrderedDict";
inline constexpr char kRebuildTensor[] = "torch._utils._rebuild_tensor_v2";
inline constexpr char kRebuildParameter[] = "torch._utils._rebuild_parameter";

// Reads and unpickles the torch.save file at `path` (kTorchSave).
absl::StatusOr<NodePtr> LoadTorchFile(checkpoint::FileSystem& fs,
                                      const std::string& path);
// The same for the torch.save archive held by `file` (`size` bytes), named
// `path` in errors: a DCP item, through a view of its byte range of the
// .distcp file.
absl::StatusOr<NodePtr> LoadTorchArchive(
    std::unique_ptr<checkpoint::RandomAccessFile> file, uint64_t size,
    const std::string& path);

// Unpickles a DCP .metadata pickle (kDcpMetadata); `path` names it in
// errors.
absl::StatusOr<NodePtr> UnpickleDcpMetadata(absl::string_view data,
                                            const std::string& path);

}  // namespace internal_torch
}  // namespace libtorch
}  // namespace flatparam

#endif  // FLATPARAM_INTEROP_INTERNAL_PICKLE_H_
