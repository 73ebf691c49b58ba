// The restricted unpickler of torch.save files and DCP .metadata files
// (pickle.h).
#include "flatparam/interop/internal/pickle.h"

#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/interop/internal/zip_reader.h"

namespace flatparam {
namespace libtorch {
namespace internal_torch {

using checkpoint::FileSystem;
using checkpoint::RandomAccessFile;

NodePtr Make(Node::Kind kind) {
  auto n = std::make_shared<Node>();
  n->kind = kind;
  return n;
}

const char* KindName(Node::Kind kind) {
  switch (kind) {
    case Node::kNone:
      return "None";
    case Node::kBool:
      return "bool";
    case Node::kInt:
      return "int";
    case Node::kFloat:
      return "float";
    case Node::kStr:
      return "str";
    case Node::kTuple:
      return "tuple";
    case Node::kList:
      return "list";
    case Node::kDict:
      return "dict";
    case Node::kTensor:
      return "Tensor";
    case Node::kGlobal:
      return "global";
    case Node::kStorage:
      return "storage";
    case Node::kMark:
      return "mark";
    case Node::kObject:
      return "object";
  }
  return "?";
}

const std::map<std::string, DType>& StorageTypes() {
  static const auto* types = new std::map<std::string, DType>{
      {"torch.FloatStorage", DType::kFloat32},
      {"torch.DoubleStorage", DType::kFloat64},
      {"torch.HalfStorage", DType::kFloat16},
      {"torch.BFloat16Storage", DType::kBFloat16},
      {"torch.LongStorage", DType::kInt64},
      {"torch.IntStorage", DType::kInt32},
      {"torch.ShortStorage", DType::kInt16},
      {"torch.CharStorage", DType::kInt8},
      {"torch.ByteStorage", DType::kUInt8},
      {"torch.BoolStorage", DType::kBool},
  };
  return *types;
}

std::string StorageTypeName(DType dtype) {
  for (const auto& [name, d] : StorageTypes()) {
    if (d == dtype) return name.substr(6);  // without "torch."
  }
  return "";
}

namespace {

// A name torch pickles a dtype by: torch.float32, torch.int64, ...
bool IsTorchDTypeName(absl::string_view name) {
  absl::StatusOr<DType> dtype = ParseDType(name);
  return dtype.ok() && DTypeName(*dtype) == name;
}

// Limits that keep a hostile pickle from exhausting memory.
constexpr size_t kMaxStack = 1 << 20;
constexpr size_t kMaxMemo = 1 << 22;
constexpr int kMaxDims = 64;
// State dicts nest about five containers deep (optimizer state: dict, dict,
// dict, tensor; param_groups: list, dict, list).
constexpr size_t kMaxDepth = 100;

enum class Dialect { kTorchSave, kDcpMetadata };

// kDcpMetadata's globals (see the header).
constexpr char kTorchSize[] = "torch.Size";
constexpr char kGetLayout[] = "torch.serialization._get_layout";
constexpr char kGetAttr[] = "builtins.getattr";

// The dataclasses NEWOBJ may make.
const std::set<std::string>& DcpClasses() {
  static const auto* classes = [] {
    auto* s = new std::set<std::string>;
    for (const char* module : {"torch.distributed._shard.checkpoint.metadata",
                               "torch.distributed.checkpoint.metadata"}) {
      for (const char* name :
           {"Metadata", "TensorStorageMetadata", "ChunkStorageMetadata",
            "BytesStorageMetadata", "MetadataIndex"}) {
        s->insert(absl::StrCat(module, ".", name));
      }
    }
    s->insert("torch.distributed.checkpoint.metadata.TensorProperties");
    s->insert("torch.distributed.checkpoint.metadata.StorageMeta");
    s->insert(
        "torch.distributed._shard.sharded_tensor.metadata.TensorProperties");
    s->insert("torch.distributed._shard.checkpoint.filesystem._StorageInfo");
    s->insert("torch.distributed.checkpoint.filesystem._StorageInfo");
    return s;
  }();
  return *classes;
}

// The enum of TensorProperties' memory format, reached by getattr.
bool IsDcpEnum(absl::string_view name) {
  return name ==
             "torch.distributed._shard.sharded_tensor.metadata."
             "MEM_FORMAT_ENCODING" ||
         name == "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING";
}

// The restricted unpickler (see the header). Not thread-safe; one per file.
class Unpickler {
 public:
  // `tensor_budget`: the most bytes all tensors together may take once
  // copied out (a stride-0 view of a small storage can be arbitrarily
  // large).
  // `zip` holds the records under `prefix` ("archive/").
  Unpickler(absl::string_view data, std::string file, const ZipReader* zip,
            std::string prefix, uint64_t tensor_budget,
            Dialect dialect = Dialect::kTorchSave)
      : data_(data),
        file_(std::move(file)),
        zip_(zip),
        prefix_(std::move(prefix)),
        tensor_budget_(tensor_budget),
        dialect_(dialect) {}

  // The containers made stay referenced here until Run returns, so that
  // Run can break what a hostile pickle builds (a list that holds itself, a
  // chain nested 200,000 deep) before freeing it: freeing such a value
  // recursively would leak it or overflow the stack.
  ~Unpickler() { TearDown(nullptr); }

  // The value, checked to be nested at most kMaxDepth containers deep and
  // to hold no container within itself, so that whoever walks it
  // recursively (the readers below) stays within kMaxDepth frames.
  absl::StatusOr<NodePtr> Run() {
    absl::StatusOr<NodePtr> value = RunOps();
    if (value.ok()) {
      absl::Status shape = CheckShape(**value);
      if (!shape.ok()) value = shape;
    }
    stack_.clear();
    memo_.clear();
    TearDown(value.ok() ? value->get() : nullptr);
    return value;
  }

 private:
  NodePtr Container(Node::Kind kind) {
    NodePtr n = Make(kind);
    containers_.push_back(n);
    return n;
  }

  static void ForEachChild(Node& n, const std::function<void(Node*)>& f) {
    for (const NodePtr& c : n.items) f(c.get());
    for (const auto& [k, v] : n.dict) {
      f(k.get());
      f(v.get());
    }
  }

  // Iteratively: depth and cycles, naming what is wrong.
  absl::Status CheckShape(Node& root) {
    enum : uint8_t { kOnPath = 1, kDone = 2 };
    std::unordered_map<Node*, uint8_t> state;
    struct Frame {
      Node* node;
      std::vector<Node*> children;
      size_t next = 0;
    };
    std::vector<Frame> path;
    auto enter = [&](Node* n) {
      Frame f{n, {}};
      ForEachChild(*n, [&](Node* c) { f.children.push_back(c); });
      state[n] = kOnPath;
      path.push_back(std::move(f));
    };
    enter(&root);
    while (!path.empty()) {
      Frame& top = path.back();
      if (top.next == top.children.size()) {
        state[top.node] = kDone;
        path.pop_back();
        continue;
      }
      Node* c = top.children[top.next++];
      if (c->items.empty() && c->dict.empty()) continue;
      const uint8_t s = state[c];
      if (s == kOnPath) {
        return Corrupt("a %s that contains itself (a cycle)",
                       KindName(c->kind));
      }
      if (s == kDone) continue;
      if (path.size() >= kMaxDepth) {
        return Corrupt("containers nested deeper than %d", kMaxDepth);
      }
      enter(c);
    }
    return absl::OkStatus();
  }

  // Empties every container made except those `keep` holds (all of them
  // when `keep` is null). No container is freed while others are emptied
  // (containers_ holds them all), so nothing is freed recursively.
  void TearDown(Node* keep) {
    std::unordered_set<Node*> kept;
    if (keep != nullptr) {
      std::vector<Node*> todo = {keep};
      while (!todo.empty()) {
        Node* n = todo.back();
        todo.pop_back();
        if (!kept.insert(n).second) continue;
        ForEachChild(*n, [&](Node* c) { todo.push_back(c); });
      }
    }
    for (const NodePtr& c : containers_) {
      if (kept.count(c.get()) > 0) continue;
      c->items.clear();
      c->dict.clear();
      c->dict_index.clear();
    }
    containers_.clear();
  }

  absl::StatusOr<NodePtr> RunOps() {
    while (true) {
      if (pos_ >= data_.size()) return Corrupt("pickle ends without STOP");
      const uint8_t op = static_cast<uint8_t>(data_[pos_++]);
      if (op == '.') {  // STOP
        if (stack_.size() != 1 || stack_[0]->kind == Node::kMark) {
          return Corrupt("STOP with a stack of %d values", stack_.size());
        }
        return stack_[0];
      }
      FLATPARAM_RETURN_IF_ERROR(Step(op));
      if (stack_.size() > kMaxStack || memo_.size() > kMaxMemo) {
        return Corrupt("more than %d values on the stack or memo", kMaxStack);
      }
    }
  }

 private:
  template <typename... Args>
  absl::Status Corrupt(const absl::FormatSpec<Args...>& format,
                       const Args&... args) {
    return absl::DataLossError(absl::StrCat(
        file_,
        dialect_ == Dialect::kTorchSave ? ": data.pkl at byte " : ": at byte ",
        pos_, ": ", absl::StrFormat(format, args...)));
  }
  absl::Status Refused(const std::string& what) {
    return absl::FailedPreconditionError(absl::StrCat(
        file_, ": ", what,
        dialect_ == Dialect::kTorchSave
            ? " (refused, not executed: a torch.save file of flatparam may "
              "hold only tensors, dicts, lists, tuples, str, int, float, "
              "bool and None)"
            : " (refused, not executed: a Distributed Checkpoint .metadata "
              "file may hold only its Metadata classes, torch.Size, dtypes, "
              "dicts, lists, tuples, str, int, float, bool and None)"));
  }

  absl::StatusOr<absl::string_view> Take(size_t n) {
    if (n > data_.size() - pos_) {
      return Corrupt("needs %d bytes, %d left", n, data_.size() - pos_);
    }
    absl::string_view out = data_.substr(pos_, n);
    pos_ += n;
    return out;
  }
  absl::StatusOr<uint64_t> TakeLE(size_t n) {
    FLATPARAM_ASSIGN_OR_RETURN(absl::string_view b, Take(n));
    uint64_t v = 0;
    for (size_t k = 0; k < n; ++k) {
      v |= uint64_t{static_cast<uint8_t>(b[k])} << (8 * k);
    }
    return v;
  }
  absl::StatusOr<std::string> TakeLine() {
    size_t end = data_.find('\n', pos_);
    if (end == absl::string_view::npos || end - pos_ > 256) {
      return Corrupt("unterminated GLOBAL name");
    }
    std::string line(data_.substr(pos_, end - pos_));
    pos_ = end + 1;
    return line;
  }

  absl::StatusOr<NodePtr> Pop() {
    if (stack_.empty() || stack_.back()->kind == Node::kMark) {
      return Corrupt("stack underflow");
    }
    NodePtr n = std::move(stack_.back());
    stack_.pop_back();
    return n;
  }
  absl::StatusOr<NodePtr> Top() {
    if (stack_.empty() || stack_.back()->kind == Node::kMark) {
      return Corrupt("stack underflow");
    }
    return stack_.back();
  }
  // The values above the topmost mark, which is removed.
  absl::StatusOr<std::vector<NodePtr>> PopMark() {
    if (marks_.empty()) return Corrupt("no MARK");
    size_t m = marks_.back();
    marks_.pop_back();
    std::vector<NodePtr> out(stack_.begin() + m + 1, stack_.end());
    stack_.resize(m);
    return out;
  }
  void Push(NodePtr n) { stack_.push_back(std::move(n)); }
  absl::Status Memo(uint64_t index) {
    FLATPARAM_ASSIGN_OR_RETURN(NodePtr top, Top());
    if (index > kMaxMemo) return Corrupt("memo index %d too large", index);
    memo_[index] = top;
    return absl::OkStatus();
  }
  absl::Status Get(uint64_t index) {
    auto it = memo_.find(index);
    if (it == memo_.end()) return Corrupt("memo %d unset", index);
    Push(it->second);
    return absl::OkStatus();
  }
  absl::Status PushInt(int64_t v) {
    NodePtr n = Make(Node::kInt);
    n->i = v;
    Push(n);
    return absl::OkStatus();
  }
  absl::Status PushStr(absl::string_view s) {
    NodePtr n = Make(Node::kStr);
    n->s = std::string(s);
    Push(n);
    return absl::OkStatus();
  }
  absl::Status PushTuple(std::vector<NodePtr> items) {
    NodePtr n = Container(Node::kTuple);
    n->items = std::move(items);
    Push(n);
    return absl::OkStatus();
  }
  absl::Status SetItems(std::vector<NodePtr> kv) {
    FLATPARAM_ASSIGN_OR_RETURN(NodePtr d, Top());
    if (d->kind != Node::kDict || kv.size() % 2 != 0) {
      return Corrupt("SETITEM(S) on a %s with %d values", KindName(d->kind),
                     kv.size());
    }
    for (size_t k = 0; k < kv.size(); k += 2) {
      const Node& key = *kv[k];
      const bool object_key =
          key.kind == Node::kObject && dialect_ == Dialect::kDcpMetadata;
      if (key.kind != Node::kStr && key.kind != Node::kInt && !object_key) {
        return Refused(absl::StrCat("a dict key of type ", KindName(key.kind)));
      }
      // Objects (MetadataIndex) are told apart by identity here; the DCP
      // reader checks that no two name the same item.
      const std::string id = key.kind == Node::kStr ? absl::StrCat("s", key.s)
                             : key.kind == Node::kInt
                                 ? absl::StrCat("i", key.i)
                                 : absl::StrFormat("o%p", kv[k].get());
      auto [it, inserted] = d->dict_index.emplace(id, d->dict.size());
      if (!inserted) {  // Python keeps the first position, the last value
        d->dict[it->second].second = kv[k + 1];
        continue;
      }
      d->dict.emplace_back(kv[k], kv[k + 1]);
    }
    return absl::OkStatus();
  }
  absl::Status Append(std::vector<NodePtr> values) {
    FLATPARAM_ASSIGN_OR_RETURN(NodePtr l, Top());
    if (l->kind != Node::kList) {
      return Corrupt("APPEND(S) on a %s", KindName(l->kind));
    }
    for (auto& v : values) l->items.push_back(std::move(v));
    return absl::OkStatus();
  }

  absl::StatusOr<NodePtr> PersistentLoad(const NodePtr& pid) {
    // ('storage', storage_type, key, location, numel)
    if (pid->kind != Node::kTuple || pid->items.size() != 5 ||
        pid->items[0]->kind != Node::kStr || pid->items[0]->s != "storage" ||
        pid->items[1]->kind != Node::kStorage ||
        pid->items[2]->kind != Node::kStr ||
        pid->items[4]->kind != Node::kInt || pid->items[4]->i < 0) {
      return Corrupt(
          "a persistent id that is not ('storage', type, key, "
          "location, numel)");
    }
    const std::string& key = pid->items[2]->s;
    auto it = storages_.find(key);
    if (it != storages_.end()) return it->second;
    auto st = std::make_shared<Storage>();
    st->dtype = StorageTypes().at(pid->items[1]->s);
    st->numel = pid->items[4]->i;
    st->key = key;
    NodePtr n = Make(Node::kStorage);
    n->storage = st;
    storages_[key] = n;
    return n;
  }

  absl::Status LoadStorage(Storage& st) {
    if (st.bytes) return absl::OkStatus();
    const std::string record = "data/" + st.key;
    absl::StatusOr<ZipReader::Member> member = zip_->Find(prefix_ + record);
    if (absl::IsNotFound(member.status())) {
      return Corrupt("storage record %s missing", record);
    }
    if (!member.ok()) return member.status();
    // A storage's record holds its elements, no more and no fewer (as
    // torch.save writes it); compared by division, which cannot overflow.
    const uint64_t size = member->size;
    const uint64_t element = DTypeSize(st.dtype);
    if (size % element != 0 ||
        size / element != static_cast<uint64_t>(st.numel)) {
      return Corrupt(
          "storage %s holds %d bytes, its %d %s elements need %s", record, size,
          st.numel, DTypeName(st.dtype),
          static_cast<uint64_t>(st.numel) <=
                  std::numeric_limits<uint64_t>::max() / element
              ? absl::StrCat(static_cast<uint64_t>(st.numel) * element)
              : std::string("more than 2^64"));
    }
    FLATPARAM_ASSIGN_OR_RETURN(std::string bytes,
                               zip_->Read(prefix_ + record, size));
    st.bytes = std::make_shared<std::string>(std::move(bytes));
    return absl::OkStatus();
  }

  absl::StatusOr<std::vector<int64_t>> IntTuple(const NodePtr& n,
                                                const char* what) {
    if (n->kind != Node::kTuple || n->items.size() > kMaxDims) {
      return Corrupt("_rebuild_tensor_v2's %s is not a tuple of ints", what);
    }
    std::vector<int64_t> out;
    for (const NodePtr& v : n->items) {
      if (v->kind != Node::kInt || v->i < 0) {
        return Corrupt("_rebuild_tensor_v2's %s is not a tuple of ints >= 0",
                       what);
      }
      out.push_back(v->i);
    }
    return out;
  }

  // _rebuild_tensor_v2(storage, storage_offset, size, stride,
  //                    requires_grad, backward_hooks[, metadata])
  absl::StatusOr<NodePtr> RebuildTensor(const std::vector<NodePtr>& args) {
    if (args.size() < 6 || args.size() > 7 || args[0]->kind != Node::kStorage ||
        !args[0]->storage || args[1]->kind != Node::kInt || args[1]->i < 0) {
      return Corrupt("_rebuild_tensor_v2 with unexpected arguments");
    }
    if (args[5]->kind != Node::kDict || !args[5]->dict.empty()) {
      return Refused("a tensor with backward hooks");
    }
    Storage& st = *args[0]->storage;
    FLATPARAM_ASSIGN_OR_RETURN(std::vector<int64_t> size,
                               IntTuple(args[2], "size"));
    FLATPARAM_ASSIGN_OR_RETURN(std::vector<int64_t> stride,
                               IntTuple(args[3], "stride"));
    if (size.size() != stride.size()) {
      return Corrupt("_rebuild_tensor_v2: %d sizes, %d strides", size.size(),
                     stride.size());
    }
    // The largest element offset, checked against the storage.
    int64_t numel = 1;
    __int128 last = args[1]->i;
    for (size_t d = 0; d < size.size(); ++d) {
      if (size[d] == 0) numel = 0;
      if (numel != 0) numel *= size[d];
      if (numel > (int64_t{1} << 50)) return Corrupt("tensor too large");
      if (size[d] > 0) last += static_cast<__int128>(size[d] - 1) * stride[d];
    }
    if (numel > 0 && last >= st.numel) {
      return Corrupt("tensor of storage %s reaches element %d of %d", st.key,
                     static_cast<int64_t>(last), st.numel);
    }
    const uint64_t nbytes = static_cast<uint64_t>(numel) * DTypeSize(st.dtype);
    if (nbytes > tensor_budget_) {
      return Refused(absl::StrCat(
          "a tensor of ", nbytes, " bytes (shape [", absl::StrJoin(size, ", "),
          "], strides [", absl::StrJoin(stride, ", "),
          "]) beyond the file's size plus 1 GiB, viewing storage ", st.key));
    }
    tensor_budget_ -= nbytes;
    FLATPARAM_RETURN_IF_ERROR(LoadStorage(st));
    auto t =
        std::make_shared<HostTensor>(HostTensor::Uninitialized(st.dtype, size));
    const size_t es = DTypeSize(st.dtype);
    const char* src = st.bytes->data();
    char* dst = static_cast<char*>(t->data());
    std::vector<int64_t> idx(size.size(), 0);
    for (int64_t k = 0; k < numel; ++k) {
      int64_t off = args[1]->i;
      for (size_t d = 0; d < size.size(); ++d) off += idx[d] * stride[d];
      std::memcpy(dst + k * es, src + off * es, es);
      for (int d = static_cast<int>(size.size()) - 1; d >= 0; --d) {
        if (++idx[d] < size[d]) break;
        idx[d] = 0;
      }
    }
    NodePtr n = Make(Node::kTensor);
    n->tensor = std::move(t);
    return n;
  }

  absl::Status Reduce() {
    FLATPARAM_ASSIGN_OR_RETURN(NodePtr args, Pop());
    FLATPARAM_ASSIGN_OR_RETURN(NodePtr fn, Pop());
    if (args->kind != Node::kTuple) return Corrupt("REDUCE without a tuple");
    if (fn->kind != Node::kGlobal) {
      return Corrupt("REDUCE calls a %s", KindName(fn->kind));
    }
    if (dialect_ == Dialect::kDcpMetadata) return ReduceDcp(*fn, *args);
    if (fn->s == kOrderedDict) {
      if (!args->items.empty()) return Refused("OrderedDict(...) with items");
      Push(Container(Node::kDict));
      return absl::OkStatus();
    }
    if (fn->s == kRebuildTensor) {
      FLATPARAM_ASSIGN_OR_RETURN(NodePtr t, RebuildTensor(args->items));
      Push(t);
      return absl::OkStatus();
    }
    // kRebuildParameter(data, requires_grad, backward_hooks)
    if (args->items.size() != 3 || args->items[0]->kind != Node::kTensor) {
      return Corrupt("_rebuild_parameter with unexpected arguments");
    }
    Push(args->items[0]);
    return absl::OkStatus();
  }

  // torch.Size((ints...)) -> the tuple; _get_layout("torch.strided") and
  // getattr(MEM_FORMAT_ENCODING, "NAME") -> the string; the enum called
  // with its value (protocol 2) -> the int.
  absl::Status ReduceDcp(const Node& fn, const Node& args) {
    if (fn.s == kTorchSize) {
      if (args.items.size() != 1 || args.items[0]->kind != Node::kTuple) {
        return Corrupt("torch.Size without a tuple");
      }
      return PushTuple(args.items[0]->items);
    }
    if (fn.s == kGetLayout) {
      if (args.items.size() != 1 || args.items[0]->kind != Node::kStr) {
        return Corrupt("_get_layout without a name");
      }
      return PushStr(args.items[0]->s);
    }
    if (fn.s == kGetAttr) {
      if (args.items.size() != 2 || args.items[0]->kind != Node::kGlobal ||
          !IsDcpEnum(args.items[0]->s) || args.items[1]->kind != Node::kStr) {
        return Refused("getattr of anything but the memory format enum");
      }
      return PushStr(args.items[1]->s);
    }
    if (IsDcpEnum(fn.s)) {
      if (args.items.size() != 1 || args.items[0]->kind != Node::kInt) {
        return Corrupt("%s without its value", fn.s);
      }
      return PushInt(args.items[0]->i);
    }
    return Refused(absl::StrCat("a call of '", fn.s, "'"));
  }

  // NEWOBJ(_EX) of an allowed dataclass, without arguments.
  absl::Status NewObject(bool ex) {
    NodePtr kwargs;
    if (ex) {
      FLATPARAM_ASSIGN_OR_RETURN(kwargs, Pop());
    }
    FLATPARAM_ASSIGN_OR_RETURN(NodePtr args, Pop());
    FLATPARAM_ASSIGN_OR_RETURN(NodePtr cls, Pop());
    if (dialect_ != Dialect::kDcpMetadata) {
      return Refused(absl::StrFormat("pickle opcode 0x%02x", ex ? 0x92 : 0x81));
    }
    if (cls->kind != Node::kGlobal || DcpClasses().count(cls->s) == 0) {
      return Refused(absl::StrCat("making an object of ",
                                  cls->kind == Node::kGlobal
                                      ? absl::StrCat("'", cls->s, "'")
                                      : std::string(KindName(cls->kind))));
    }
    if (args->kind != Node::kTuple || !args->items.empty() ||
        (kwargs != nullptr &&
         (kwargs->kind != Node::kDict || !kwargs->dict.empty()))) {
      return Corrupt("%s made with arguments", cls->s);
    }
    NodePtr o = Container(Node::kObject);
    o->s = cls->s;
    Push(o);
    return absl::OkStatus();
  }

  // BUILD: an object's attributes (a dict) or its __getstate__ tuple;
  // torch.save's OrderedDict attributes, dropped.
  absl::Status Build() {
    FLATPARAM_ASSIGN_OR_RETURN(NodePtr state, Pop());
    FLATPARAM_ASSIGN_OR_RETURN(NodePtr target, Top());
    if (target->kind == Node::kDict && state->kind == Node::kDict) {
      return absl::OkStatus();
    }
    if (target->kind != Node::kObject) {
      return Refused(absl::StrCat("BUILD of a ", KindName(target->kind)));
    }
    if (state->kind == Node::kTuple) {
      target->items = state->items;
      return absl::OkStatus();
    }
    if (state->kind != Node::kDict) {
      return Corrupt("BUILD of %s with a %s", target->s, KindName(state->kind));
    }
    for (const auto& [k, v] : state->dict) {
      if (k->kind != Node::kStr) {
        return Corrupt("BUILD of %s with a %s attribute name", target->s,
                       KindName(k->kind));
      }
    }
    std::vector<NodePtr> kv;
    for (const auto& [k, v] : state->dict) {
      kv.push_back(k);
      kv.push_back(v);
    }
    // The attributes as a dict of the object, in order.
    target->kind = Node::kDict;
    absl::Status set = SetItems(std::move(kv));
    target->kind = Node::kObject;
    return set;
  }

  absl::Status GlobalNamed(const std::string& module, const std::string& name) {
    const std::string full = absl::StrCat(module, ".", name);
    if (dialect_ == Dialect::kDcpMetadata) {
      if (DcpClasses().count(full) > 0 || IsDcpEnum(full) ||
          full == kTorchSize || full == kGetLayout || full == kGetAttr ||
          (module == "torch" && IsTorchDTypeName(name))) {
        NodePtr n = Make(Node::kGlobal);
        n->s = full;
        Push(n);
        return absl::OkStatus();
      }
      return Refused(absl::StrCat("the pickle names the global '", full, "'"));
    }
    if (full == kOrderedDict || full == kRebuildTensor ||
        full == kRebuildParameter) {
      NodePtr n = Make(Node::kGlobal);
      n->s = full;
      Push(n);
      return absl::OkStatus();
    }
    if (StorageTypes().count(full) > 0) {
      NodePtr n = Make(Node::kStorage);
      n->s = full;
      Push(n);
      return absl::OkStatus();
    }
    return Refused(absl::StrCat("the pickle names the global '", full, "'"));
  }

  absl::Status Global() {
    FLATPARAM_ASSIGN_OR_RETURN(std::string module, TakeLine());
    FLATPARAM_ASSIGN_OR_RETURN(std::string name, TakeLine());
    return GlobalNamed(module, name);
  }

  absl::Status StackGlobal() {
    FLATPARAM_ASSIGN_OR_RETURN(NodePtr name, Pop());
    FLATPARAM_ASSIGN_OR_RETURN(NodePtr module, Pop());
    if (dialect_ != Dialect::kDcpMetadata) {
      return Refused("pickle opcode 0x93");
    }
    if (module->kind != Node::kStr || name->kind != Node::kStr ||
        module->s.size() > 256 || name->s.size() > 256) {
      return Corrupt("STACK_GLOBAL without two names");
    }
    return GlobalNamed(module->s, name->s);
  }

  absl::Status Step(uint8_t op) {
    switch (op) {
      case 0x80: {  // PROTO
        FLATPARAM_ASSIGN_OR_RETURN(uint64_t v, TakeLE(1));
        if (v < 2 || v > 5) return Corrupt("pickle protocol %d", v);
        return absl::OkStatus();
      }
      case 0x95:  // FRAME
        return TakeLE(8).status();
      case '(':  // MARK
        marks_.push_back(stack_.size());
        Push(Make(Node::kMark));
        return absl::OkStatus();
      case '}':  // EMPTY_DICT
        Push(Container(Node::kDict));
        return absl::OkStatus();
      case ']':  // EMPTY_LIST
        Push(Container(Node::kList));
        return absl::OkStatus();
      case ')':  // EMPTY_TUPLE
        return PushTuple({});
      case 'N':
        Push(Make(Node::kNone));
        return absl::OkStatus();
      case 0x88:  // NEWTRUE
      case 0x89: {
        NodePtr n = Make(Node::kBool);
        n->b = op == 0x88;
        Push(n);
        return absl::OkStatus();
      }
      case 'K': {  // BININT1
        FLATPARAM_ASSIGN_OR_RETURN(uint64_t v, TakeLE(1));
        return PushInt(static_cast<int64_t>(v));
      }
      case 'M': {  // BININT2
        FLATPARAM_ASSIGN_OR_RETURN(uint64_t v, TakeLE(2));
        return PushInt(static_cast<int64_t>(v));
      }
      case 'J': {  // BININT
        FLATPARAM_ASSIGN_OR_RETURN(uint64_t v, TakeLE(4));
        return PushInt(static_cast<int32_t>(static_cast<uint32_t>(v)));
      }
      case 0x8a: {  // LONG1
        FLATPARAM_ASSIGN_OR_RETURN(uint64_t n, TakeLE(1));
        if (n > 8) return Refused("an int wider than 64 bits");
        FLATPARAM_ASSIGN_OR_RETURN(uint64_t v, TakeLE(n));
        if (n > 0 && n < 8 && (v >> (8 * n - 1)) & 1) {
          v |= ~uint64_t{0} << (8 * n);  // sign-extend
        }
        return PushInt(static_cast<int64_t>(v));
      }
      case 'G': {  // BINFLOAT, big-endian
        FLATPARAM_ASSIGN_OR_RETURN(absl::string_view b, Take(8));
        uint64_t bits = 0;
        for (char c : b) bits = (bits << 8) | static_cast<uint8_t>(c);
        NodePtr n = Make(Node::kFloat);
        std::memcpy(&n->f, &bits, 8);
        Push(n);
        return absl::OkStatus();
      }
      case 'X': {  // BINUNICODE
        FLATPARAM_ASSIGN_OR_RETURN(uint64_t len, TakeLE(4));
        FLATPARAM_ASSIGN_OR_RETURN(absl::string_view s, Take(len));
        return PushStr(s);
      }
      case 0x8c: {  // SHORT_BINUNICODE
        FLATPARAM_ASSIGN_OR_RETURN(uint64_t len, TakeLE(1));
        FLATPARAM_ASSIGN_OR_RETURN(absl::string_view s, Take(len));
        return PushStr(s);
      }
      case 't': {  // TUPLE
        FLATPARAM_ASSIGN_OR_RETURN(std::vector<NodePtr> items, PopMark());
        return PushTuple(std::move(items));
      }
      case 0x85:
      case 0x86:
      case 0x87: {  // TUPLE1..3
        std::vector<NodePtr> items(op - 0x84);
        for (size_t k = items.size(); k-- > 0;) {
          FLATPARAM_ASSIGN_OR_RETURN(items[k], Pop());
        }
        return PushTuple(std::move(items));
      }
      case 's': {  // SETITEM
        FLATPARAM_ASSIGN_OR_RETURN(NodePtr v, Pop());
        FLATPARAM_ASSIGN_OR_RETURN(NodePtr k, Pop());
        return SetItems({k, v});
      }
      case 'u': {  // SETITEMS
        FLATPARAM_ASSIGN_OR_RETURN(std::vector<NodePtr> kv, PopMark());
        return SetItems(std::move(kv));
      }
      case 'a': {  // APPEND
        FLATPARAM_ASSIGN_OR_RETURN(NodePtr v, Pop());
        return Append({v});
      }
      case 'e': {  // APPENDS
        FLATPARAM_ASSIGN_OR_RETURN(std::vector<NodePtr> vs, PopMark());
        return Append(std::move(vs));
      }
      case 'q': {  // BINPUT
        FLATPARAM_ASSIGN_OR_RETURN(uint64_t i, TakeLE(1));
        return Memo(i);
      }
      case 'r': {  // LONG_BINPUT
        FLATPARAM_ASSIGN_OR_RETURN(uint64_t i, TakeLE(4));
        return Memo(i);
      }
      case 0x94:  // MEMOIZE
        return Memo(memo_.size());
      case 'h': {  // BINGET
        FLATPARAM_ASSIGN_OR_RETURN(uint64_t i, TakeLE(1));
        return Get(i);
      }
      case 'j': {  // LONG_BINGET
        FLATPARAM_ASSIGN_OR_RETURN(uint64_t i, TakeLE(4));
        return Get(i);
      }
      case 'c':  // GLOBAL
        return Global();
      case 'R':  // REDUCE
        return Reduce();
      case 'b':  // BUILD
        return Build();
      case 0x93:  // STACK_GLOBAL
        return StackGlobal();
      case 0x81:  // NEWOBJ
        return NewObject(/*ex=*/false);
      case 0x92:  // NEWOBJ_EX
        return NewObject(/*ex=*/true);
      case 0x8d: {  // BINUNICODE8
        FLATPARAM_ASSIGN_OR_RETURN(uint64_t len, TakeLE(8));
        FLATPARAM_ASSIGN_OR_RETURN(absl::string_view s, Take(len));
        return PushStr(s);
      }
      case 'Q': {  // BINPERSID
        FLATPARAM_ASSIGN_OR_RETURN(NodePtr pid, Pop());
        FLATPARAM_ASSIGN_OR_RETURN(NodePtr st, PersistentLoad(pid));
        Push(st);
        return absl::OkStatus();
      }
      default:
        return Refused(absl::StrFormat("pickle opcode 0x%02x", op));
    }
  }

  absl::string_view data_;
  size_t pos_ = 0;
  std::string file_;
  const ZipReader* zip_;
  std::string prefix_;
  std::vector<NodePtr> stack_;
  std::vector<size_t> marks_;
  std::map<uint64_t, NodePtr> memo_;
  std::map<std::string, NodePtr> storages_;
  uint64_t tensor_budget_;
  Dialect dialect_;
  // Every tuple, list and dict made (see ~Unpickler).
  std::vector<NodePtr> containers_;
};

}  // namespace

absl::StatusOr<NodePtr> LoadTorchFile(FileSystem& fs, const std::string& path) {
  FLATPARAM_ASSIGN_OR_RETURN(std::unique_ptr<RandomAccessFile> file,
                             fs.NewRandomAccessFile(path));
  FLATPARAM_ASSIGN_OR_RETURN(uint64_t size, file->Size());
  return LoadTorchArchive(std::move(file), size, path);
}

absl::StatusOr<NodePtr> LoadTorchArchive(std::unique_ptr<RandomAccessFile> file,
                                         uint64_t size,
                                         const std::string& path) {
  if (size > kMaxTorchArchiveBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": ", size, " bytes, more than the limit ",
                     kMaxTorchArchiveBytes));
  }
  char magic[4] = {0, 0, 0, 0};
  if (size >= 4) {
    FLATPARAM_RETURN_IF_ERROR(file->ReadAt(0, absl::Span<char>(magic, 4)));
  }
  if (size >= 2 && static_cast<uint8_t>(magic[0]) == 0x80) {
    return absl::FailedPreconditionError(absl::StrCat(
        path,
        ": the legacy torch.save format (_use_new_zipfile_serialization="
        "False) is not supported; re-save it in Python with "
        "torch.save(torch.load(f), f2)"));
  }
  if (size < 4 || std::memcmp(magic, "PK\x03\x04", 4) != 0) {
    return absl::DataLossError(
        absl::StrCat(path, ": not a torch.save file (no zip archive)"));
  }
  FLATPARAM_ASSIGN_OR_RETURN(std::unique_ptr<ZipReader> zip,
                             ZipReader::Open(std::move(file), size, path));
  // PyTorch's writer puts every record under one folder ("archive/", or
  // the file's stem); data.pkl names it.
  std::string prefix;
  int pickles = 0;
  for (const std::string& name : zip->names()) {
    const size_t slash = name.find('/');
    if (slash != std::string::npos && name.substr(slash) == "/data.pkl") {
      prefix = name.substr(0, slash + 1);
      ++pickles;
    }
  }
  if (pickles != 1) {
    return absl::DataLossError(absl::StrCat(
        path, pickles == 0
                  ? ": a zip archive without data.pkl (not a torch.save "
                    "file; TorchScript archives are not state dicts)"
                  : ": a zip archive with more than one data.pkl"));
  }
  // PyTorch >= 2.1 records the storages' byte order; older files are
  // little-endian.
  if (zip->Has(prefix + "byteorder")) {
    FLATPARAM_ASSIGN_OR_RETURN(const std::string order,
                               zip->Read(prefix + "byteorder", 64));
    if (order != "little") {
      return absl::FailedPreconditionError(
          absl::StrCat(path, ": storages in byte order '", order.substr(0, 16),
                       "' (only little-endian files are read)"));
    }
  }
  FLATPARAM_ASSIGN_OR_RETURN(const std::string pickle,
                             zip->Read(prefix + "data.pkl", size));
  Unpickler unpickler(pickle, path, zip.get(), prefix,
                      size + (uint64_t{1} << 30));
  return unpickler.Run();
}

absl::StatusOr<NodePtr> UnpickleDcpMetadata(absl::string_view data,
                                            const std::string& path) {
  Unpickler unpickler(data, path, /*zip=*/nullptr, /*prefix=*/"",
                      /*tensor_budget=*/0, Dialect::kDcpMetadata);
  return unpickler.Run();
}

}  // namespace internal_torch
}  // namespace libtorch
}  // namespace flatparam
