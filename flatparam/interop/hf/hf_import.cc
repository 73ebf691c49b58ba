#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "flatparam/base/shape.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/checkpoint/checkpoint_dir.h"
#include "flatparam/checkpoint/internal/flat_stream.h"
#include "flatparam/checkpoint/internal/full_optim_shards.h"
#include "flatparam/checkpoint/training_state.h"
#include "flatparam/interop/hf/hf_checkpoint.h"
#include "flatparam/interop/hf/internal/hf_internal.h"

namespace flatparam {
namespace checkpoint {
namespace {

using json = nlohmann::json;
using internal_checkpoint::CheckDistinct;
using internal_checkpoint::ChunkBytes;
using internal_checkpoint::FlatShardSource;
using internal_checkpoint::FullOptimShards;
using internal_checkpoint::IsOptimizerFileName;
using internal_checkpoint::PlanOptimizerImport;
using internal_checkpoint::Problems;
using internal_checkpoint::ReadConverted;

// "BF16 [4096, 32000]": a tensor as its file declares it.
std::string FileType(DType dtype, absl::Span<const int64_t> shape) {
  return absl::StrCat(SafetensorsDTypeName(dtype), " ", ShapeString(shape));
}
// "bfloat16 [4096, 32000]": a parameter as the model declares it.
std::string SpecType(DType dtype, absl::Span<const int64_t> shape) {
  return absl::StrCat(DTypeName(dtype), " ", ShapeString(shape));
}

}  // namespace

// ---------------------------------------------------------------------------
// Import

namespace {

// What an import reads: the tensor each untied parameter comes from, the
// tied copies to compare with it, and the report.
struct TiedCopy {
  const HfCheckpointReader::Tensor* source;
  const HfCheckpointReader::Tensor* copy;
  std::string param;  // the untied parameter both stand for
};
struct ImportPlan {
  HfImportReport report;
  std::map<std::string, const HfCheckpointReader::Tensor*> source;
  std::vector<TiedCopy> copies;
};

// "'name'", or "'stored' ('name')" when cleaning changed it.
std::string Named(const HfCheckpointReader::Tensor& t) {
  return t.name == t.stored_name
             ? absl::StrCat("'", t.name, "'")
             : absl::StrCat("'", t.stored_name, "' ('", t.name, "')");
}

std::string Describe(const HfCheckpointReader& ckpt) {
  return ckpt.index_path().empty() ? ckpt.files()[0].name() : ckpt.index_path();
}

absl::StatusOr<ImportPlan> PlanImport(const HfCheckpointReader& ckpt,
                                      const ModelSpec& spec,
                                      const HfImportOptions& options) {
  // Validates the spec (names, ties, dtypes).
  FLATPARAM_RETURN_IF_ERROR(
      ModelLayout::Create(spec, LayoutOptions()).status());
  // Every parameter name -> its untied root; root -> the tied names.
  std::map<std::string, const ParamSpec*> root_of;
  std::map<std::string, std::vector<std::string>> tied_names;
  for (const ParamSpec& p : spec.params) {
    if (p.tied_to.empty()) {
      root_of[p.fqn] = &p;
    } else {
      // ModelLayout::Create checked that ties point to earlier parameters.
      const ParamSpec* root = root_of.at(p.tied_to);
      root_of[p.fqn] = root;
      tied_names[root->fqn].push_back(p.fqn);
    }
  }
  const auto file_of = [&](const HfCheckpointReader::Tensor& t) {
    return ckpt.files()[t.file].name();
  };

  std::map<std::string, const BufferSpec*> buffer_of;
  for (const BufferSpec& b : spec.buffers) buffer_of[b.fqn] = &b;

  HfImportReport report;
  report.files = static_cast<int64_t>(ckpt.files().size());
  Problems problems;
  for (const auto& [name, t] : ckpt.tensors()) {
    if (root_of.count(name) > 0 || buffer_of.count(name) > 0) continue;
    const bool ignored =
        std::any_of(options.ignored_suffixes.begin(),
                    options.ignored_suffixes.end(), [&](const std::string& s) {
                      return !s.empty() && absl::EndsWith(name, s);
                    });
    if (ignored) {
      ++report.ignored;
      continue;
    }
    problems.Add(absl::StrFormat(
        "%s: unexpected tensor %s (%s): not a parameter or buffer of model "
        "'%s'",
        file_of(t), Named(t), FileType(t.dtype, t.shape), spec.name));
  }
  // The tensor each untied parameter is read from, and tied copies to
  // compare with it.
  std::map<std::string, const HfCheckpointReader::Tensor*> source;
  std::vector<TiedCopy> copies;
  for (const ParamSpec& p : spec.params) {
    if (!p.tied_to.empty()) continue;
    // The parameter's own name first, then the names tied to it.
    std::vector<std::string> names = {p.fqn};
    const std::vector<std::string>& ties = tied_names[p.fqn];
    names.insert(names.end(), ties.begin(), ties.end());
    std::vector<const HfCheckpointReader::Tensor*> present;
    for (const std::string& name : names) {
      auto it = ckpt.tensors().find(name);
      if (it != ckpt.tensors().end()) present.push_back(&it->second);
    }
    if (present.empty()) {
      problems.Add(absl::StrFormat(
          "missing tensor '%s' (%s), a parameter of model '%s': in no file "
          "of the checkpoint%s",
          p.fqn, SpecType(p.dtype, p.shape), spec.name,
          ties.empty() ? ""
                       : absl::StrCat(", nor is its tied copy ",
                                      absl::StrJoin(ties, ", "))));
      continue;
    }
    const HfCheckpointReader::Tensor& src = *present[0];
    const std::string tie_note =
        src.name == p.fqn
            ? ""
            : absl::StrCat(" (read for '", p.fqn, "', to which it is tied)");
    if (src.shape != p.shape) {
      problems.Add(absl::StrFormat(
          "%s: tensor %s%s has shape %s, the model's parameter '%s' %s",
          file_of(src), Named(src), tie_note, ShapeString(src.shape), p.fqn,
          ShapeString(p.shape)));
    } else if (src.dtype != p.dtype) {
      if (options.cast && IsFloatingPoint(src.dtype) &&
          IsFloatingPoint(p.dtype)) {
        ++report.cast;
      } else {
        problems.Add(absl::StrFormat(
            "%s: tensor %s%s is %s, the model's parameter '%s' is %s (give "
            "the model the file's dtype, --dtype=%s, or convert with "
            "--cast)",
            file_of(src), Named(src), tie_note, SafetensorsDTypeName(src.dtype),
            p.fqn, DTypeName(p.dtype), DTypeName(src.dtype)));
      }
    }
    source[p.fqn] = &src;
    ++report.imported;
    for (size_t i = 1; i < present.size(); ++i) {
      const HfCheckpointReader::Tensor& copy = *present[i];
      if (copy.dtype != src.dtype || copy.shape != src.shape) {
        problems.Add(absl::StrFormat(
            "%s: tensor %s is tied to '%s' in model '%s', but it is %s and "
            "%s in %s is %s",
            file_of(copy), Named(copy), p.fqn, spec.name,
            FileType(copy.dtype, copy.shape), Named(src), file_of(src),
            FileType(src.dtype, src.shape)));
        continue;
      }
      copies.push_back({&src, &copy, p.fqn});
      ++report.tied_copies;
    }
  }
  // Buffers: every one the spec lists, read whole (a buffer the model
  // recomputes and the file lacks does not belong in the spec).
  for (const BufferSpec& b : spec.buffers) {
    auto it = ckpt.tensors().find(b.fqn);
    if (it == ckpt.tensors().end()) {
      problems.Add(absl::StrFormat(
          "missing tensor '%s' (%s), a buffer of model '%s': in no file of "
          "the checkpoint (if the model recomputes it, remove it from the "
          "model file's \"buffers\")",
          b.fqn, SpecType(b.dtype, b.shape), spec.name));
      continue;
    }
    const HfCheckpointReader::Tensor& src = it->second;
    if (src.shape != b.shape) {
      problems.Add(absl::StrFormat(
          "%s: tensor %s has shape %s, the model's buffer '%s' %s",
          file_of(src), Named(src), ShapeString(src.shape), b.fqn,
          ShapeString(b.shape)));
    } else if (src.dtype != b.dtype) {
      if (options.cast && IsFloatingPoint(src.dtype) &&
          IsFloatingPoint(b.dtype)) {
        ++report.cast;
      } else {
        problems.Add(absl::StrFormat(
            "%s: tensor %s is %s, the model's buffer '%s' is %s (convert "
            "floating-point tensors with --cast)",
            file_of(src), Named(src), SafetensorsDTypeName(src.dtype), b.fqn,
            DTypeName(b.dtype)));
      }
    }
    source[b.fqn] = &src;
    ++report.imported;
  }
  FLATPARAM_RETURN_IF_ERROR(
      problems.ToStatus(absl::StatusCode::kFailedPrecondition,
                        absl::StrFormat("%s does not fit model '%s'",
                                        Describe(ckpt), spec.name)));
  return ImportPlan{report, std::move(source), std::move(copies)};
}

}  // namespace

absl::StatusOr<HfImportReport> CheckHfCheckpointFits(
    const HfCheckpointReader& ckpt, const ModelSpec& spec,
    const HfImportOptions& options) {
  FLATPARAM_ASSIGN_OR_RETURN(ImportPlan plan, PlanImport(ckpt, spec, options));
  return plan.report;
}

absl::StatusOr<HfImportReport> ImportHfCheckpoint(
    FileSystem& fs, const std::string& in, const ModelSpec& spec,
    const LayoutOptions& layout_options, int64_t world_size,
    const std::string& out_dir, const HfImportOptions& options) {
  FLATPARAM_RETURN_IF_ERROR(CheckDistinct(in, out_dir));
  FLATPARAM_ASSIGN_OR_RETURN(ModelLayout layout,
                             ModelLayout::Create(spec, layout_options));
  FLATPARAM_ASSIGN_OR_RETURN(HfCheckpointReader ckpt,
                             HfCheckpointReader::Open(fs, in, options.names));
  FLATPARAM_RETURN_IF_ERROR(CheckDistinct(ckpt.dir(), out_dir));
  // Optimizer state beside the weights: imported, refused, or (with
  // weights_only) left behind and reported; never dropped unsaid.
  FLATPARAM_ASSIGN_OR_RETURN(std::vector<std::string> children,
                             fs.GetChildren(ckpt.dir()));
  std::sort(children.begin(), children.end());
  std::vector<std::string> optimizer_files;
  bool has_optim_tensors = false;
  bool has_optim_json = false;
  for (const std::string& child : children) {
    if (!IsOptimizerFileName(child)) continue;
    optimizer_files.push_back(child);
    has_optim_tensors |= child == kOptimFileName;
    has_optim_json |= child == kOptimJsonFileName;
  }
  constexpr char kWeightsOnlyHint[] =
      "import the weights alone, starting the optimizer afresh, with "
      "--weights-only (HfImportOptions::weights_only)";
  if (!options.weights_only) {
    for (const std::string& child : optimizer_files) {
      if (child == kOptimFileName || child == kOptimJsonFileName) continue;
      return absl::FailedPreconditionError(absl::StrFormat(
          "%s: optimizer state written by another tool cannot be imported "
          "(only %s with %s can); %s",
          JoinPath(ckpt.dir(), child), kOptimFileName, kOptimJsonFileName,
          kWeightsOnlyHint));
    }
    if (has_optim_tensors && !has_optim_json) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "%s: optimizer state without its %s (the param groups and "
          "non-tensor state) cannot be imported; add it (this project's "
          "form, or PyTorch's json.dumps(optimizer.state_dict()"
          "[\"param_groups\"])), or %s",
          JoinPath(ckpt.dir(), kOptimFileName), kOptimJsonFileName,
          kWeightsOnlyHint));
    }
    if (has_optim_json && !has_optim_tensors) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "%s: optimizer state without its %s (the tensor state, "
          "\"state.{fqn}.{state_name}\") cannot be imported; add it, or %s",
          JoinPath(ckpt.dir(), kOptimJsonFileName), kOptimFileName,
          kWeightsOnlyHint));
    }
  }

  FLATPARAM_ASSIGN_OR_RETURN(ImportPlan plan, PlanImport(ckpt, spec, options));
  HfImportReport report = plan.report;
  // The optimizer plan borrows its file; both outlive the write.
  std::optional<SafetensorsReader> optim_file;
  std::unique_ptr<FullOptimShards> optim;
  if (options.weights_only) {
    report.optimizer_left_behind = optimizer_files;
  } else if (has_optim_tensors) {
    FLATPARAM_ASSIGN_OR_RETURN(
        optim, PlanOptimizerImport(fs, ckpt.dir(), layout, optim_file, report));
  }
  const auto& source = plan.source;
  const auto file_of = [&](const HfCheckpointReader::Tensor& t) {
    return ckpt.files()[t.file].name();
  };

  // Tied copies must hold the same bytes.
  const uint64_t chunk = ChunkBytes(options.convert.chunk_bytes);
  for (const TiedCopy& tied : plan.copies) {
    const HfCheckpointReader::Tensor* src = tied.source;
    const HfCheckpointReader::Tensor* copy = tied.copy;
    const uint64_t size = DTypeSize(src->dtype);
    std::vector<char> a(std::min(chunk, src->nbytes));
    std::vector<char> b(a.size());
    for (uint64_t done = 0; done < src->nbytes;) {
      const uint64_t n = std::min<uint64_t>(a.size(), src->nbytes - done);
      FLATPARAM_RETURN_IF_ERROR(
          ckpt.ReadRange(*src, done, absl::MakeSpan(a.data(), n)));
      FLATPARAM_RETURN_IF_ERROR(
          ckpt.ReadRange(*copy, done, absl::MakeSpan(b.data(), n)));
      if (std::memcmp(a.data(), b.data(), n) != 0) {
        uint64_t at = 0;
        while (a[at] == b[at]) ++at;
        return absl::FailedPreconditionError(absl::StrFormat(
            "%s: tensor %s is tied to '%s' in model '%s', but its values "
            "differ from %s in %s (first at element %d)",
            file_of(*copy), Named(*copy), tied.param, spec.name, Named(*src),
            file_of(*src), (done + at) / size));
      }
      done += n;
    }
  }

  // The shards, streamed from the files.
  const auto& flat = layout.flat_params();
  std::vector<std::map<int, const HfCheckpointReader::Tensor*>> unit_sources(
      flat.size());
  for (size_t u = 0; u < flat.size(); ++u) {
    for (size_t i = 0; i < flat[u].params().size(); ++i) {
      unit_sources[u][static_cast<int>(i)] = source.at(flat[u].params()[i].fqn);
    }
  }
  ShardedCheckpointContent content;
  content.layout = &layout;
  content.world_size = world_size;
  json sidecar;
  if (optim != nullptr) {
    sidecar = optim->sidecar();
  } else {
    FLATPARAM_ASSIGN_OR_RETURN(
        sidecar, OptimSidecarToJson(OptimSidecar(), /*with_extra=*/true));
  }
  for (int64_t r = 0; r < layout.options().world_size; ++r) {
    RankContent rank;
    for (size_t u = 0; u < flat.size(); ++u) {
      const DType dtype = flat[u].dtype();
      const auto* sources = &unit_sources[u];
      rank.tensors.push_back(FlatShardSource(
          FlatParamTensorName(u), &flat[u], dtype, r,
          [&ckpt, sources, dtype](int i, int64_t begin, int64_t n, char* out) {
            const HfCheckpointReader::Tensor& t = *sources->at(i);
            const size_t size = DTypeSize(t.dtype);
            if (t.dtype == dtype) {
              return ckpt.ReadRange(t, begin * size,
                                    absl::MakeSpan(out, n * size));
            }
            return ReadConverted(
                [&ckpt, &t](uint64_t offset, absl::Span<char> bytes) {
                  return ckpt.ReadRange(t, offset, bytes);
                },
                t.dtype, dtype, begin, n, out);
          }));
      if (optim != nullptr) {
        optim->AppendUnit(static_cast<int>(u), r, rank.tensors);
      }
    }
    // Every rank starts from the file's buffers.
    for (const BufferSpec& b : spec.buffers) {
      const HfCheckpointReader::Tensor* t = source.at(b.fqn);
      TensorSource src;
      src.name = BufferTensorName(b.fqn);
      src.dtype = b.dtype;
      src.shape = b.shape;
      src.fill = [&ckpt, t, dtype = b.dtype](uint64_t offset,
                                             absl::Span<char> out) {
        if (t->dtype == dtype) return ckpt.ReadRange(*t, offset, out);
        const size_t size = DTypeSize(dtype);
        return ReadConverted(
            [&ckpt, t](uint64_t at, absl::Span<char> bytes) {
              return ckpt.ReadRange(*t, at, bytes);
            },
            t->dtype, dtype, offset / size, out.size() / size, out.data());
      };
      rank.tensors.push_back(std::move(src));
    }
    if (optim != nullptr) optim->AppendZeroDim(rank.tensors);
    rank.sidecar = sidecar;
    content.ranks.push_back(std::move(rank));
  }
  CheckpointWriteOptions write;
  write.chunk_bytes = chunk;
  write.progress = options.convert.progress;
  write.overwrite = options.convert.overwrite;
  write.outcome = options.convert.outcome;
  FLATPARAM_RETURN_IF_ERROR(
      WriteShardedCheckpoint(fs, out_dir, content, write));
  return report;
}

}  // namespace checkpoint
}  // namespace flatparam
