// Metadata views of optimizer state dicts, and their wire encoding.
//
// Collective operations on optimizer state (fsdp_optim.h) first exchange
// what each rank holds -- state names, kinds, dtypes, shapes and the small
// (zero-dimension and non-tensor) values -- and validate and plan from that
// alone, so that every rank reaches the same decision (the same error, or
// the same sequence of collectives). A ValueMeta is one value as metadata:
// positive-dimension tensors by dtype and shape, pointing at their data
// only where it is local; every other value in full.
//
// The encoding is a private, length-prefixed binary format (exact for
// every byte of strings and every bit of floats); Decode rejects truncated
// or malformed input instead of reading past it.
//
// Thread-safety: plain values; a view must not outlive the dict it points
// into.
#ifndef FLATPARAM_OPTIM_INTERNAL_STATE_META_H_
#define FLATPARAM_OPTIM_INTERNAL_STATE_META_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "flatparam/base/dtype.h"
#include "flatparam/flatten.h"
#include "flatparam/optim/optim_state.h"

namespace flatparam {
namespace optim {
namespace internal_optim {

struct ValueMeta {
  bool pos_dim = false;
  // Positive-dimension tensors: dtype and shape.
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;
  // Positive-dimension tensors whose data is here: the tensor (owned by
  // the viewed dict), else nullptr.
  const HostTensor* tensor = nullptr;
  // Every other value in full; for a positive-dimension tensor sent with
  // its data (Encode's `with_data`), the tensor itself.
  OptimStateValue value;

  int64_t numel() const { return NumElements(shape); }
  // The data of a positive-dimension tensor, where known; else nullptr.
  const HostTensor* data() const;
  // The value in full. REQUIRES: !pos_dim or data() != nullptr.
  OptimStateValue Materialize() const;
  // A description for messages (DescribeValue's format).
  std::string Describe() const;
};

using ParamStateMeta = std::map<std::string, ValueMeta>;
using StateMeta = std::map<ParamKey, ParamStateMeta>;

// A view of `state`'s values; tensors point into `state`.
ParamStateMeta MetaOf(const ParamState& state);
StateMeta MetaOf(const std::map<ParamKey, ParamState>& state);

// Appends values to a byte string. Positive-dimension tensors go as dtype
// and shape, or with their data when `with_data`; zero-dimension tensors
// always go with their data.
class Encoder {
 public:
  void U8(uint8_t v) { out_.push_back(static_cast<char>(v)); }
  void I64(int64_t v);
  void Str(absl::string_view s);
  void Raw(const void* data, size_t n);
  void Key(const ParamKey& key);
  void Value(const OptimStateValue& v, bool with_data);
  void Value(const ValueMeta& v, bool with_data);
  void Hyper(const HyperValue& v);
  void Group(const ParamGroup& g);
  std::string Take() { return std::move(out_); }

 private:
  std::string out_;
};

// Reads what Encoder wrote; each call returns false, consuming an
// unspecified amount, when the input is truncated or malformed.
class Decoder {
 public:
  explicit Decoder(absl::string_view in) : in_(in) {}
  bool U8(uint8_t* v);
  bool I64(int64_t* v);
  bool Str(std::string* s);
  bool Raw(void* data, size_t n);
  bool Key(ParamKey* key);
  bool Value(ValueMeta* v);
  bool Hyper(HyperValue* v);
  bool Group(ParamGroup* g);
  bool done() const { return in_.empty(); }

 private:
  absl::string_view in_;
};

}  // namespace internal_optim
}  // namespace optim
}  // namespace flatparam

#endif  // FLATPARAM_OPTIM_INTERNAL_STATE_META_H_
