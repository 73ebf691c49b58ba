// torch_save.h, part 1: the torch.save file format (the pickler and
// LibTorch's zip writer; the restricted unpickler is internal/pickle.cc's).
#include <c10/util/Exception.h>
#include <caffe2/serialize/inline_container.h>

#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <variant>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/interop/internal/pickle.h"
#include "flatparam/interop/internal/zip_reader.h"
#include "flatparam/interop/torch_save/internal/torch_save_writer.h"
#include "flatparam/interop/torch_save/torch_save.h"

namespace flatparam {
namespace libtorch {
namespace {

using checkpoint::FileSystem;
using checkpoint::RandomAccessFile;
using internal_torch::KindName;
using internal_torch::kOrderedDict;
using internal_torch::kRebuildParameter;
using internal_torch::kRebuildTensor;
using internal_torch::LoadTorchFile;
using internal_torch::Make;
using internal_torch::Node;
using internal_torch::NodePtr;
using internal_torch::StorageTypeName;
using internal_torch::StorageTypes;

static_assert(kMaxTorchFileBytes == internal_torch::kMaxTorchArchiveBytes);

// A scalar node (None, bool, int, float, str) as a `Value` (an optimizer
// state value or a hyperparameter, variants of the same scalars); nullopt
// for other kinds.
template <typename Value>
std::optional<Value> ScalarValue(const Node& n) {
  switch (n.kind) {
    case Node::kNone:
      return Value(std::monostate());
    case Node::kBool:
      return Value(n.b);
    case Node::kInt:
      return Value(n.i);
    case Node::kFloat:
      return Value(n.f);
    case Node::kStr:
      return Value(n.s);
    default:
      return std::nullopt;
  }
}

// Converts a node to an optimizer state value / hyperparameter.
absl::StatusOr<optim::OptimStateValue> ToStateValue(const Node& n,
                                                    const std::string& where) {
  if (auto v = ScalarValue<optim::OptimStateValue>(n)) return *std::move(v);
  if (n.kind == Node::kTensor) return optim::OptimStateValue(*n.tensor);
  return absl::FailedPreconditionError(
      absl::StrCat(where, " is a ", KindName(n.kind),
                   " (a state value must be a tensor, None, bool, int, "
                   "float or str)"));
}

absl::StatusOr<optim::HyperValue> ToHyperValue(const Node& n,
                                               const std::string& where) {
  if (auto v = ScalarValue<optim::HyperValue>(n)) return *std::move(v);
  if (n.kind == Node::kTuple || n.kind == Node::kList) {
    std::vector<double> out;
    for (const NodePtr& v : n.items) {
      if (v->kind == Node::kFloat) {
        out.push_back(v->f);
      } else if (v->kind == Node::kInt) {
        out.push_back(static_cast<double>(v->i));
      } else {
        return absl::FailedPreconditionError(
            absl::StrCat(where, " holds a ", KindName(v->kind),
                         " (a sequence hyperparameter must hold numbers)"));
      }
    }
    return optim::HyperValue(std::move(out));
  }
  return absl::FailedPreconditionError(
      absl::StrCat(where, " is a ", KindName(n.kind),
                   " (a hyperparameter must be None, bool, int, float, "
                   "str or a tuple of numbers)"));
}

absl::StatusOr<optim::ParamKey> ToKey(const Node& n, const std::string& where) {
  if (n.kind == Node::kInt) return optim::ParamKey(n.i);
  if (n.kind == Node::kStr) return optim::ParamKey(n.s);
  return absl::FailedPreconditionError(
      absl::StrCat(where, " is a ", KindName(n.kind),
                   " (a parameter key is an int or str)"));
}

std::string KeyRepr(const Node& n) {
  return n.kind == Node::kStr ? absl::StrCat("['", n.s, "']")
                              : absl::StrCat("[", n.i, "]");
}

// ---------------------------------------------------------------------------
// The pickler (protocol 2, as torch.save writes).

class Pickler {
 public:
  std::string& out() { return out_; }
  std::vector<const HostTensor*>& tensors() { return tensors_; }

  void Op(uint8_t op) { out_.push_back(static_cast<char>(op)); }
  void LE(uint64_t v, int n) {
    for (int k = 0; k < n; ++k) out_.push_back(static_cast<char>(v >> (8 * k)));
  }
  void Int(int64_t v) {
    if (v >= 0 && v < 256) {
      Op('K');
      LE(v, 1);
    } else if (v >= 0 && v < 65536) {
      Op('M');
      LE(v, 2);
    } else if (v >= INT32_MIN && v <= INT32_MAX) {
      Op('J');
      LE(static_cast<uint32_t>(static_cast<int32_t>(v)), 4);
    } else {
      Op(0x8a);
      LE(8, 1);
      LE(static_cast<uint64_t>(v), 8);
    }
  }
  void Float(double v) {
    uint64_t bits;
    std::memcpy(&bits, &v, 8);
    Op('G');
    for (int k = 7; k >= 0; --k)
      out_.push_back(static_cast<char>(bits >> (8 * k)));
  }
  void Str(absl::string_view s) {
    Op('X');
    LE(s.size(), 4);
    out_.append(s.data(), s.size());
  }
  void Global(absl::string_view module, absl::string_view name) {
    Op('c');
    absl::StrAppend(&out_, module, "\n", name, "\n");
  }
  void EmptyOrderedDict() {
    Global("collections", "OrderedDict");
    Op(')');
    Op('R');
  }
  void Bool(bool b) { Op(b ? 0x88 : 0x89); }
  // A tensor over its own storage; the same HostTensor again (a tied
  // name) is a second tensor over the same storage, as torch.save writes
  // tensors that share one.
  void Tensor(const HostTensor& t) {
    auto [it, fresh] = storage_keys_.emplace(&t, "");
    if (fresh) {
      it->second = absl::StrCat(tensors_.size());
      tensors_.push_back(&t);
    }
    const std::string key = it->second;
    Global("torch._utils", "_rebuild_tensor_v2");
    Op('(');
    // Persistent id ('storage', storage_type, key, 'cpu', numel).
    Op('(');
    Str("storage");
    Global("torch", StorageTypeName(t.dtype()));
    Str(key);
    Str("cpu");
    Int(t.numel());
    Op('t');
    Op('Q');
    Int(0);  // storage offset
    Op('(');
    for (int64_t d : t.shape()) Int(d);
    Op('t');
    Op('(');
    int64_t stride = 1;
    std::vector<int64_t> strides(t.shape().size());
    for (size_t d = t.shape().size(); d-- > 0;) {
      strides[d] = stride;
      stride *= t.shape()[d];
    }
    for (int64_t s : strides) Int(s);
    Op('t');
    Bool(false);
    EmptyOrderedDict();  // backward hooks
    Op('t');
    Op('R');
  }
  void Value(const optim::OptimStateValue& v) {
    std::visit(
        [&](const auto& x) {
          using T = std::decay_t<decltype(x)>;
          if constexpr (std::is_same_v<T, std::monostate>) {
            Op('N');
          } else if constexpr (std::is_same_v<T, HostTensor>) {
            Tensor(x);
          } else if constexpr (std::is_same_v<T, bool>) {
            Bool(x);
          } else if constexpr (std::is_same_v<T, int64_t>) {
            Int(x);
          } else if constexpr (std::is_same_v<T, double>) {
            Float(x);
          } else {
            Str(x);
          }
        },
        v);
  }
  void Hyper(const optim::HyperValue& v) {
    std::visit(
        [&](const auto& x) {
          using T = std::decay_t<decltype(x)>;
          if constexpr (std::is_same_v<T, std::monostate>) {
            Op('N');
          } else if constexpr (std::is_same_v<T, bool>) {
            Bool(x);
          } else if constexpr (std::is_same_v<T, int64_t>) {
            Int(x);
          } else if constexpr (std::is_same_v<T, double>) {
            Float(x);
          } else if constexpr (std::is_same_v<T, std::string>) {
            Str(x);
          } else {
            Op('(');
            for (double d : x) Float(d);
            Op('t');
          }
        },
        v);
  }
  void Key(const optim::ParamKey& k) {
    if (const auto* i = std::get_if<int64_t>(&k)) {
      Int(*i);
    } else {
      Str(std::get<std::string>(k));
    }
  }

 private:
  std::string out_;
  std::vector<const HostTensor*> tensors_;
  std::map<const HostTensor*, std::string> storage_keys_;
};

// Appends the pickle and its tensors' storages to `file` as a torch.save
// archive; the archive's size. `path` names the file in errors.
absl::StatusOr<uint64_t> AppendArchive(checkpoint::WritableFile& file,
                                       const std::string& path, Pickler& p) {
  p.Op('.');
  absl::Status write_status;
  uint64_t written = 0;
  try {
    // The callback reports every write as done and keeps the first error:
    // LibTorch 1.13's writer throws on a short write and, when that
    // unwinds through its destructor, throws again from there
    // (std::terminate).
    caffe2::serialize::PyTorchStreamWriter writer([&](const void* buf,
                                                      size_t n) -> size_t {
      if (write_status.ok()) {
        write_status =
            file.Append(absl::string_view(static_cast<const char*>(buf), n));
        written += n;
      }
      return n;
    });
    writer.writeRecord("data.pkl", p.out().data(), p.out().size());
    for (size_t k = 0; k < p.tensors().size(); ++k) {
      const HostTensor& t = *p.tensors()[k];
      writer.writeRecord(absl::StrCat("data/", k), t.data(), t.nbytes());
    }
    writer.writeEndOfFile();
  } catch (const std::exception& e) {
    if (write_status.ok()) {
      write_status = absl::InternalError(
          absl::StrCat(path, ": writing the torch.save archive: ", e.what()));
    }
  }
  if (!write_status.ok()) return write_status;
  return written;
}

// Writes the pickle and its tensors' storages as the torch.save file
// `path`.
absl::Status WriteTorchFile(FileSystem& fs, const std::string& path,
                            Pickler& p) {
  FLATPARAM_ASSIGN_OR_RETURN(std::unique_ptr<checkpoint::WritableFile> file,
                             fs.NewWritableFile(path));
  absl::Status write_status = AppendArchive(*file, path, p).status();
  if (write_status.ok()) write_status = file->Sync();
  const absl::Status closed = file->Close();
  if (write_status.ok()) write_status = closed;
  if (!write_status.ok()) fs.RemoveFile(path).IgnoreError();  // partial
  return write_status;
}

// Pickles `groups` as optimizer.state_dict()["param_groups"] holds them.
void ParamGroups(Pickler& p, const std::vector<optim::ParamGroup>& groups) {
  p.Op(']');
  if (groups.empty()) return;
  p.Op('(');
  for (const optim::ParamGroup& g : groups) {
    p.Op('}');
    p.Op('(');
    for (const auto& [name, v] : g.hyperparams) {
      p.Str(name);
      p.Hyper(v);
    }
    p.Str("params");
    p.Op(']');
    if (!g.params.empty()) {
      p.Op('(');
      for (const optim::ParamKey& k : g.params) p.Key(k);
      p.Op('e');
    }
    p.Op('u');
  }
  p.Op('e');
}

Pickler Protocol2() {
  Pickler p;
  p.Op(0x80);
  p.LE(2, 1);
  return p;
}

}  // namespace

absl::StatusOr<TorchStateDict> ReadTorchStateDict(FileSystem& fs,
                                                  const std::string& path) {
  FLATPARAM_ASSIGN_OR_RETURN(NodePtr root, LoadTorchFile(fs, path));
  if (root->kind != Node::kDict) {
    return absl::FailedPreconditionError(absl::StrCat(
        path, ": holds a ", KindName(root->kind), ", not a state dict"));
  }
  TorchStateDict out;
  for (const auto& [k, v] : root->dict) {
    if (k->kind != Node::kStr) {
      return absl::FailedPreconditionError(absl::StrCat(
          path, ": state dict key ", KeyRepr(*k), " is not a str"));
    }
    if (v->kind != Node::kTensor) {
      return absl::FailedPreconditionError(
          absl::StrCat(path, ": state dict entry '", k->s, "' is a ",
                       KindName(v->kind), ", not a tensor"));
    }
    out.emplace_back(k->s, *v->tensor);
  }
  return out;
}

absl::Status WriteTorchStateDict(FileSystem& fs, const std::string& path,
                                 const TorchStateDict& tensors) {
  return WriteTorchStateDict(fs, path, tensors, {});
}

absl::Status WriteTorchStateDict(
    FileSystem& fs, const std::string& path, const TorchStateDict& tensors,
    const std::vector<std::pair<std::string, std::string>>& tied) {
  std::map<std::string, const HostTensor*> by_name;
  for (const auto& [name, t] : tensors) by_name[name] = &t;
  for (const auto& [name, target] : tied) {
    if (by_name.count(target) == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": tied name '", name, "' names '", target,
                       "', which is not among the file's tensors"));
    }
  }
  std::set<std::string> seen;
  Pickler p;
  p.Op(0x80);
  p.LE(2, 1);
  p.EmptyOrderedDict();
  if (!tensors.empty()) {
    p.Op('(');
    for (const auto& [name, t] : tensors) {
      if (!seen.insert(name).second) {
        return absl::InvalidArgumentError(
            absl::StrCat(path, ": tensor name '", name, "' repeated"));
      }
      p.Str(name);
      p.Tensor(t);
    }
    for (const auto& [name, target] : tied) {
      if (!seen.insert(name).second) {
        return absl::InvalidArgumentError(
            absl::StrCat(path, ": tensor name '", name, "' repeated"));
      }
      p.Str(name);
      p.Tensor(*by_name.at(target));
    }
    p.Op('u');
  }
  return WriteTorchFile(fs, path, p);
}

absl::StatusOr<optim::OptimStateDict> ReadTorchOptimStateDict(
    FileSystem& fs, const std::string& path) {
  FLATPARAM_ASSIGN_OR_RETURN(NodePtr root, LoadTorchFile(fs, path));
  auto fail = [&](const std::string& msg) {
    return absl::FailedPreconditionError(absl::StrCat(
        path, ": ", msg,
        " (an optimizer state dict is {'state': {key: {name: value}}, "
        "'param_groups': [{..., 'params': [key, ...]}]})"));
  };
  if (root->kind != Node::kDict) {
    return fail(absl::StrCat("holds a ", KindName(root->kind)));
  }
  const Node* state = nullptr;
  const Node* groups = nullptr;
  for (const auto& [k, v] : root->dict) {
    if (k->kind == Node::kStr && k->s == "state") {
      state = v.get();
    } else if (k->kind == Node::kStr && k->s == "param_groups") {
      groups = v.get();
    } else {
      return fail(absl::StrCat("unexpected key ", KeyRepr(*k)));
    }
  }
  if (state == nullptr || state->kind != Node::kDict) {
    return fail("no 'state' dict");
  }
  if (groups == nullptr || groups->kind != Node::kList) {
    return fail("no 'param_groups' list");
  }
  optim::OptimStateDict out;
  for (const auto& [k, v] : state->dict) {
    const std::string where = absl::StrCat(path, ": state", KeyRepr(*k));
    FLATPARAM_ASSIGN_OR_RETURN(optim::ParamKey key, ToKey(*k, where));
    if (v->kind != Node::kDict) {
      return fail(
          absl::StrCat("state", KeyRepr(*k), " is a ", KindName(v->kind)));
    }
    optim::ParamState& ps = out.state[key];
    for (const auto& [sk, sv] : v->dict) {
      if (sk->kind != Node::kStr) {
        return fail(
            absl::StrCat("state", KeyRepr(*k), " has key ", KeyRepr(*sk)));
      }
      FLATPARAM_ASSIGN_OR_RETURN(
          ps[sk->s], ToStateValue(*sv, absl::StrCat(where, KeyRepr(*sk))));
    }
  }
  for (size_t g = 0; g < groups->items.size(); ++g) {
    const Node& group = *groups->items[g];
    const std::string where = absl::StrCat(path, ": param_groups[", g, "]");
    if (group.kind != Node::kDict) {
      return fail(
          absl::StrCat("param_groups[", g, "] is a ", KindName(group.kind)));
    }
    optim::ParamGroup pg;
    bool has_params = false;
    for (const auto& [hk, hv] : group.dict) {
      if (hk->kind != Node::kStr) {
        return fail(
            absl::StrCat("param_groups[", g, "] has key ", KeyRepr(*hk)));
      }
      if (hk->s == "params") {
        if (hv->kind != Node::kList) {
          return fail(
              absl::StrCat("param_groups[", g, "]['params'] is not a list"));
        }
        has_params = true;
        for (size_t i = 0; i < hv->items.size(); ++i) {
          FLATPARAM_ASSIGN_OR_RETURN(
              optim::ParamKey key,
              ToKey(*hv->items[i], absl::StrCat(where, "['params'][", i, "]")));
          pg.params.push_back(std::move(key));
        }
      } else {
        FLATPARAM_ASSIGN_OR_RETURN(
            pg.hyperparams[hk->s],
            ToHyperValue(*hv, absl::StrCat(where, KeyRepr(*hk))));
      }
    }
    if (!has_params) {
      return fail(absl::StrCat("param_groups[", g, "] has no 'params'"));
    }
    out.param_groups.push_back(std::move(pg));
  }
  return out;
}

absl::Status WriteTorchOptimStateDict(FileSystem& fs, const std::string& path,
                                      const optim::OptimStateDict& dict) {
  Pickler p;
  p.Op(0x80);
  p.LE(2, 1);
  p.Op('}');
  p.Op('(');
  p.Str("state");
  p.Op('}');
  if (!dict.state.empty()) {
    p.Op('(');
    for (const auto& [key, ps] : dict.state) {
      p.Key(key);
      p.Op('}');
      if (!ps.empty()) {
        p.Op('(');
        for (const auto& [name, v] : ps) {
          p.Str(name);
          p.Value(v);
        }
        p.Op('u');
      }
    }
    p.Op('u');
  }
  p.Str("param_groups");
  ParamGroups(p, dict.param_groups);
  p.Op('u');
  return WriteTorchFile(fs, path, p);
}

namespace internal_torch {

absl::StatusOr<uint64_t> AppendTorchTensorArchive(
    checkpoint::WritableFile& file, const std::string& path,
    const HostTensor& tensor) {
  Pickler p = Protocol2();
  p.Tensor(tensor);
  return AppendArchive(file, path, p);
}

absl::StatusOr<uint64_t> AppendTorchValueArchive(
    checkpoint::WritableFile& file, const std::string& path,
    const optim::OptimStateValue& value) {
  Pickler p = Protocol2();
  p.Value(value);
  return AppendArchive(file, path, p);
}

absl::StatusOr<uint64_t> AppendTorchParamGroupsArchive(
    checkpoint::WritableFile& file, const std::string& path,
    const std::vector<optim::ParamGroup>& groups) {
  Pickler p = Protocol2();
  ParamGroups(p, groups);
  return AppendArchive(file, path, p);
}

}  // namespace internal_torch
}  // namespace libtorch
}  // namespace flatparam
