#include "flatparam/checkpoint/internal/checkpoint_format.h"

#include <cstdint>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "flatparam/base/dtype.h"
#include "flatparam/base/shape.h"
#include "flatparam/checkpoint/checkpoint_names.h"
#include "flatparam/model_layout.h"

namespace flatparam {
namespace checkpoint {
namespace internal_checkpoint {

absl::Status CheckRankTensors(const ModelLayout& layout,
                              absl::Span<const TensorDecl> tensors,
                              const std::string& file, absl::StatusCode code) {
  const std::vector<FlatParamLayout>& flat = layout.flat_params();
  auto error = [&](const std::string& tensor, absl::string_view what) {
    return absl::Status(code,
                        absl::StrCat(file, ": tensor '", tensor, "': ", what));
  };
  // Parses a canonical flat parameter index at the start of `s`, up to the
  // end or a '.'.
  auto parse_index = [&](absl::string_view s, int64_t* index,
                         absl::string_view* rest) {
    const size_t dot = s.find('.');
    const absl::string_view digits = s.substr(0, dot);
    *rest = dot == absl::string_view::npos ? absl::string_view()
                                           : s.substr(dot + 1);
    return absl::SimpleAtoi(digits, index) && absl::StrCat(*index) == digits &&
           *index >= 0 && *index < static_cast<int64_t>(flat.size());
  };
  std::vector<bool> have(flat.size(), false);
  std::map<std::string, const BufferSpec*, std::less<>> buffers;
  for (const BufferSpec& b : layout.spec().buffers) buffers[b.fqn] = &b;
  std::set<std::string, std::less<>> have_buffers;
  for (const TensorDecl& t : tensors) {
    absl::string_view name = t.name;
    int64_t i = 0;
    absl::string_view rest;
    if (absl::ConsumePrefix(&name, kFlatParamPrefix)) {
      if (!parse_index(name, &i, &rest) ||
          name.find('.') != absl::string_view::npos) {
        return error(t.name,
                     absl::StrFormat("not flat_params.{i} for a flat parameter "
                                     "index i in [0, %d)",
                                     flat.size()));
      }
      const FlatParamLayout& f = flat[i];
      if (t.dtype != f.dtype()) {
        return error(t.name, absl::StrCat("dtype is ", DTypeName(t.dtype),
                                          ", the layout's flat parameter is ",
                                          DTypeName(f.dtype())));
      }
      if (t.shape != std::vector<int64_t>{f.sharded_numel()}) {
        return error(t.name, absl::StrCat("shape is ", ShapeString(t.shape),
                                          ", the layout's shard is [",
                                          f.sharded_numel(), "]"));
      }
      have[i] = true;
    } else if (absl::ConsumePrefix(&name, kOptimShardPrefix)) {
      if (!parse_index(name, &i, &rest) || rest.empty()) {
        return error(
            t.name,
            absl::StrFormat("not optim.{i}.{state} for a flat parameter index "
                            "i in [0, %d) and a state name",
                            flat.size()));
      }
      const int64_t numel = flat[i].sharded_numel();
      if (!t.shape.empty() && t.shape != std::vector<int64_t>{numel}) {
        return error(
            t.name, absl::StrCat("shape is ", ShapeString(t.shape),
                                 ", expected [] or the shard's [", numel, "]"));
      }
    } else if (absl::ConsumePrefix(&name, kBufferPrefix)) {
      auto it = buffers.find(name);
      if (it == buffers.end()) {
        return error(t.name, "not buffers.{fqn} for a buffer of the model");
      }
      const BufferSpec& b = *it->second;
      if (t.dtype != b.dtype || t.shape != b.shape) {
        return error(
            t.name,
            absl::StrCat("is ", DTypeName(t.dtype), " ", ShapeString(t.shape),
                         ", the model's buffer "
                         "is ",
                         DTypeName(b.dtype), " ", ShapeString(b.shape)));
      }
      have_buffers.emplace(name);
    } else {
      return error(t.name,
                   "unexpected: rank files hold only flat_params.{i}, "
                   "optim.{i}.{state} and buffers.{fqn}");
    }
  }
  for (const BufferSpec& b : layout.spec().buffers) {
    if (have_buffers.count(b.fqn) == 0) {
      return absl::Status(
          code, absl::StrCat(file, ": no tensor '", BufferTensorName(b.fqn),
                             "' (buffer of the model)"));
    }
  }
  for (size_t i = 0; i < have.size(); ++i) {
    if (!have[i]) {
      return absl::Status(
          code,
          absl::StrCat(file, ": no tensor '", FlatParamTensorName(i),
                       "' (flat parameter of unit '", flat[i].unit(), "')"));
    }
  }
  return absl::OkStatus();
}

}  // namespace internal_checkpoint
}  // namespace checkpoint
}  // namespace flatparam
