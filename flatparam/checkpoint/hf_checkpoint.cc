#include "flatparam/checkpoint/hf_checkpoint.h"

#include <algorithm>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "flatparam/base/fqn.h"
#include "flatparam/base/json_limits.h"
#include "flatparam/base/shape.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/checkpoint/checkpoint_dir.h"
#include "flatparam/checkpoint/internal/checkpoint_write.h"
#include "flatparam/checkpoint/internal/flat_stream.h"
#include "flatparam/checkpoint/internal/full_optim_shards.h"
#include "flatparam/checkpoint/manifest.h"
#include "flatparam/checkpoint/optim_io.h"
#include "flatparam/optim/optim_state.h"

namespace flatparam {
namespace checkpoint {
namespace {

using json = nlohmann::json;
using internal_checkpoint::FlatShardSource;
using internal_checkpoint::FullOptimShards;
using internal_checkpoint::PendingFile;
using internal_checkpoint::RankFileSet;

constexpr char kSingleFileName[] = "model.safetensors";
constexpr char kOptimizerFilePrefix[] = "optimizer";
constexpr char kOptimStatePrefix[] = "state.";

uint64_t ChunkBytes(uint64_t requested) {
  return std::max<uint64_t>(8, requested / 8 * 8);
}

// "BF16 [4096, 32000]": a tensor as its file declares it.
std::string FileType(DType dtype, absl::Span<const int64_t> shape) {
  return absl::StrCat(SafetensorsDTypeName(dtype), " ", ShapeString(shape));
}
// "bfloat16 [4096, 32000]": a parameter as the model declares it.
std::string SpecType(DType dtype, absl::Span<const int64_t> shape) {
  return absl::StrCat(DTypeName(dtype), " ", ShapeString(shape));
}

// Problems found while checking, reported together.
class Problems {
 public:
  void Add(std::string problem) { list_.push_back(std::move(problem)); }
  bool empty() const { return list_.empty(); }

  absl::Status ToStatus(absl::StatusCode code, absl::string_view what) const {
    if (list_.empty()) return absl::OkStatus();
    if (list_.size() == 1) {
      return absl::Status(code, absl::StrCat(what, ": ", list_[0]));
    }
    std::string message =
        absl::StrFormat("%s: %d problems:", what, list_.size());
    for (size_t i = 0; i < list_.size(); ++i) {
      if (i == static_cast<size_t>(kMaxReportedProblems)) {
        absl::StrAppendFormat(&message, "\n  ... and %d more",
                              list_.size() - i);
        break;
      }
      absl::StrAppend(&message, "\n  ", list_[i]);
    }
    return absl::Status(code, message);
  }

 private:
  std::vector<std::string> list_;
};

std::string StripSlashes(std::string dir) {
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  return dir;
}

// The output replaces whatever is at `out`: it must be neither the input
// nor a directory holding it.
absl::Status CheckDistinct(const std::string& in_arg,
                           const std::string& out_arg) {
  const std::string in = StripSlashes(in_arg);
  const std::string out = StripSlashes(out_arg);
  if (in == out) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "the output directory %s is the input directory; write elsewhere",
        out_arg));
  }
  if (absl::StartsWith(in, absl::StrCat(out, "/"))) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "the output directory %s holds the input %s, and writing it would "
        "replace it; write elsewhere",
        out_arg, in_arg));
  }
  return absl::OkStatus();
}

// A file name an index may list: a plain name in the index's directory.
bool IsPlainFileName(absl::string_view name) {
  return !name.empty() && name != "." && name != ".." &&
         name.find('/') == absl::string_view::npos &&
         name.find('\0') == absl::string_view::npos;
}

// Reads `n` elements of `src_dtype` with `read` (which takes byte offsets
// and spans in the source) starting at element `first`, converted to
// `dst_dtype`, into `out`; through a scratch buffer of at most
// kCastScratchBytes.
absl::Status ReadConverted(
    const std::function<absl::Status(uint64_t, absl::Span<char>)>& read,
    DType src_dtype, DType dst_dtype, uint64_t first, uint64_t n, char* out) {
  const size_t src_size = DTypeSize(src_dtype);
  const size_t dst_size = DTypeSize(dst_dtype);
  const uint64_t piece = std::max<uint64_t>(1, kCastScratchBytes / src_size);
  std::vector<char> scratch(std::min(n, piece) * src_size);
  for (uint64_t done = 0; done < n;) {
    const uint64_t k = std::min(piece, n - done);
    FLATPARAM_RETURN_IF_ERROR(
        read((first + done) * src_size,
             absl::MakeSpan(scratch.data(), k * src_size)));
    ConvertElements(scratch.data(), src_dtype, out + done * dst_size, dst_dtype,
                    k);
    done += k;
  }
  return absl::OkStatus();
}

absl::StatusOr<bool> IsDir(FileSystem& fs, const std::string& path) {
  absl::StatusOr<bool> is_dir = fs.IsDirectory(path);
  if (absl::IsNotFound(is_dir.status())) return false;
  return is_dir;
}

}  // namespace

std::string CleanTensorName(absl::string_view name) {
  return ::flatparam::CleanTensorName(name);
}

const std::vector<std::string>& HfSideFileNames() {
  static const auto* names =
      new std::vector<std::string>{"config.json",
                                   "generation_config.json",
                                   "tokenizer.json",
                                   "tokenizer.model",
                                   "tokenizer_config.json",
                                   "special_tokens_map.json",
                                   "added_tokens.json",
                                   "vocab.json",
                                   "vocab.txt",
                                   "merges.txt",
                                   "chat_template.jinja",
                                   "preprocessor_config.json"};
  return *names;
}

absl::StatusOr<uint64_t> ParseByteSize(absl::string_view text) {
  const auto error = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "'%s' is not a size: %s (use bytes, or an integer followed by B, KB, "
        "MB, GB, TB, KiB, MiB, GiB or TiB, e.g. 5GB)",
        text, why));
  };
  size_t digits = 0;
  while (digits < text.size() && absl::ascii_isdigit(text[digits])) ++digits;
  if (digits == 0) return error("it does not start with a number");
  uint64_t value = 0;
  if (!absl::SimpleAtoi(text.substr(0, digits), &value)) {
    return error("the number is too large");
  }
  const absl::string_view unit = text.substr(digits);
  if (!unit.empty() && unit.back() == 'b') {
    return error("a lowercase 'b' would mean bits");
  }
  const std::string upper = absl::AsciiStrToUpper(unit);
  struct Unit {
    const char* name;
    uint64_t factor;
  };
  static constexpr Unit kUnits[] = {
      {"", 1},
      {"B", 1},
      {"KB", 1'000},
      {"MB", 1'000'000},
      {"GB", 1'000'000'000},
      {"TB", 1'000'000'000'000},
      {"KIB", uint64_t{1} << 10},
      {"MIB", uint64_t{1} << 20},
      {"GIB", uint64_t{1} << 30},
      {"TIB", uint64_t{1} << 40},
  };
  for (const Unit& u : kUnits) {
    if (upper != u.name) continue;
    if (value > std::numeric_limits<uint64_t>::max() / u.factor) {
      return error("it overflows 64 bits");
    }
    if (value == 0) return error("it is zero");
    return value * u.factor;
  }
  return error(absl::StrCat("unknown unit '", unit, "'"));
}

absl::StatusOr<bool> IsHfCheckpoint(FileSystem& fs, const std::string& path) {
  FLATPARAM_ASSIGN_OR_RETURN(const bool exists, fs.Exists(path));
  if (!exists) return false;
  FLATPARAM_ASSIGN_OR_RETURN(const bool is_dir, IsDir(fs, path));
  if (!is_dir) {
    return absl::EndsWith(path, ".safetensors") ||
           absl::EndsWith(path, ".json");
  }
  FLATPARAM_ASSIGN_OR_RETURN(const bool manifest,
                             fs.Exists(JoinPath(path, kManifestFileName)));
  return !manifest;
}

// ---------------------------------------------------------------------------
// HfCheckpointReader

absl::StatusOr<HfCheckpointReader> HfCheckpointReader::Open(
    FileSystem& fs, const std::string& path_arg, const HfNameOptions& names) {
  const std::string path = StripSlashes(path_arg);
  FLATPARAM_ASSIGN_OR_RETURN(const bool exists, fs.Exists(path));
  if (!exists) {
    return absl::NotFoundError(
        absl::StrCat("no Hugging Face checkpoint at ", path));
  }
  FLATPARAM_ASSIGN_OR_RETURN(const bool is_dir, IsDir(fs, path));
  HfCheckpointReader reader;
  std::string single_path;
  if (is_dir) {
    reader.dir_ = path;
    const std::string single = JoinPath(path, kSingleFileName);
    const std::string index = JoinPath(path, kHfIndexFileName);
    FLATPARAM_ASSIGN_OR_RETURN(const bool has_single, fs.Exists(single));
    FLATPARAM_ASSIGN_OR_RETURN(const bool has_index, fs.Exists(index));
    if (has_single && has_index) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s holds both %s and %s, so which one is the checkpoint is "
          "ambiguous; give the path of the one to import",
          path, kSingleFileName, kHfIndexFileName));
    }
    if (!has_single && !has_index) {
      FLATPARAM_ASSIGN_OR_RETURN(
          const bool pickle, fs.Exists(JoinPath(path, "pytorch_model.bin")));
      FLATPARAM_ASSIGN_OR_RETURN(
          const bool pickle_index,
          fs.Exists(JoinPath(path, "pytorch_model.bin.index.json")));
      return absl::NotFoundError(absl::StrFormat(
          "%s holds neither %s nor %s (a Hugging Face checkpoint) nor %s (a "
          "flatparam checkpoint)%s",
          path, kSingleFileName, kHfIndexFileName, kManifestFileName,
          pickle || pickle_index
              ? "; its pytorch_model.bin files are pickled torch objects, "
                "which cannot be read here: convert them to safetensors first"
              : ""));
    }
    if (has_single) {
      single_path = single;
    } else {
      reader.index_path_ = index;
    }
  } else {
    reader.dir_ = Dirname(path);
    if (absl::EndsWith(path, ".json")) {
      reader.index_path_ = path;
    } else {
      // One shard of an index-sharded checkpoint holds part of the model.
      const std::string sibling_index = JoinPath(reader.dir_, kHfIndexFileName);
      absl::StatusOr<bool> indexed = fs.Exists(sibling_index);
      if (absl::StartsWith(Basename(path), "model-") && indexed.ok() &&
          *indexed) {
        return absl::FailedPreconditionError(absl::StrFormat(
            "%s is one shard of the checkpoint that %s indexes: point --in at "
            "the directory %s (or at the index file) to import all of it",
            path, sibling_index, reader.dir_));
      }
      single_path = path;
    }
  }

  // stored name -> file (by name) for an index, and each file's tensors.
  Problems problems;
  std::vector<std::string> file_names;
  if (!single_path.empty()) {
    FLATPARAM_ASSIGN_OR_RETURN(SafetensorsReader file,
                               SafetensorsReader::Open(fs, single_path));
    reader.files_.push_back(std::move(file));
  } else {
    const std::string& index_path = reader.index_path_;
    absl::StatusOr<std::string> text =
        ReadFileToString(fs, index_path, kMaxHfIndexBytes);
    if (!text.ok()) {
      return absl::Status(absl::IsNotFound(text.status())
                              ? absl::StatusCode::kNotFound
                              : absl::StatusCode::kDataLoss,
                          text.status().message());
    }
    // Duplicate weight_map keys would silently shadow each other.
    std::string top_key;
    std::string duplicate;
    std::set<std::string> keys;
    JsonParseOptions parse;
    parse.code = absl::StatusCode::kDataLoss;
    parse.callback = [&](int depth, json::parse_event_t event, json& parsed) {
      if (event == json::parse_event_t::key && depth == 1) {
        top_key = parsed.get<std::string>();
      } else if (event == json::parse_event_t::key && depth == 2 &&
                 top_key == "weight_map" && duplicate.empty() &&
                 !keys.insert(parsed.get<std::string>()).second) {
        duplicate = parsed.get<std::string>();
      }
      return true;
    };
    FLATPARAM_ASSIGN_OR_RETURN(json doc, ParseJson(*text, index_path, parse));
    const auto error = [&](absl::string_view what) {
      return absl::DataLossError(absl::StrCat(index_path, ": ", what));
    };
    if (!duplicate.empty()) {
      return error(absl::StrCat("weight_map lists '", duplicate, "' twice"));
    }
    if (!doc.is_object()) return error("not a JSON object");
    auto wm = doc.find("weight_map");
    if (wm == doc.end() || !wm->is_object()) {
      return error("\"weight_map\" is missing or not an object");
    }
    std::optional<uint64_t> total_size;
    if (auto md = doc.find("metadata"); md != doc.end()) {
      if (!md->is_object()) return error("\"metadata\" is not an object");
      if (auto ts = md->find("total_size"); ts != md->end()) {
        if (!ts->is_number_unsigned()) {
          return error(absl::StrCat(
              "metadata.total_size is ",
              ts->dump(-1, ' ', false, json::error_handler_t::replace),
              ", not a non-negative integer"));
        }
        total_size = ts->get<uint64_t>();
      }
    }
    // file -> the stored names the weight_map puts there.
    std::map<std::string, std::set<std::string>> by_file;
    std::map<std::string, std::string> file_of;
    for (const auto& [name, file] : wm->items()) {
      if (!file.is_string()) {
        return error(
            absl::StrCat("weight_map['", name, "'] is not a file name string"));
      }
      const std::string f = file.get<std::string>();
      if (!IsPlainFileName(f)) {
        return error(absl::StrCat("weight_map['", name, "'] is '", f,
                                  "', not a file name in the index's "
                                  "directory"));
      }
      by_file[f].insert(name);
      file_of[name] = f;
    }
    if (by_file.empty()) return error("weight_map is empty");
    for (const auto& [f, names] : by_file) {
      const std::string file_path = JoinPath(reader.dir_, f);
      absl::StatusOr<SafetensorsReader> file =
          SafetensorsReader::Open(fs, file_path);
      if (absl::IsNotFound(file.status())) {
        return error(absl::StrCat("weight_map lists ", f, " (for '",
                                  *names.begin(), "'), which does not exist"));
      }
      if (!file.ok()) return file.status();
      for (const SafetensorsEntry& e : file->tensors()) {
        auto it = file_of.find(e.name);
        if (it == file_of.end()) {
          problems.Add(
              absl::StrFormat("%s: tensor '%s' is not in the weight_map of %s",
                              file_path, e.name, kHfIndexFileName));
        } else if (it->second != f) {
          problems.Add(absl::StrFormat(
              "%s: tensor '%s' is here, but the weight_map puts it in %s",
              file_path, e.name, it->second));
        }
      }
      for (const std::string& name : names) {
        if (!file->Contains(name)) {
          // The index's own problems go unprefixed: ToStatus names it.
          problems.Add(absl::StrFormat(
              "the weight_map puts tensor '%s' in %s, which has no such "
              "tensor",
              name, f));
        }
      }
      reader.files_.push_back(*std::move(file));
      file_names.push_back(f);
    }
    FLATPARAM_RETURN_IF_ERROR(
        problems.ToStatus(absl::StatusCode::kDataLoss, index_path));
    uint64_t sum = 0;
    for (const SafetensorsReader& f : reader.files_) {
      for (const SafetensorsEntry& e : f.tensors()) sum += e.nbytes();
    }
    if (total_size.has_value() && *total_size != sum) {
      return error(absl::StrFormat(
          "metadata.total_size is %d, but the tensors of the weight_map "
          "hold %d bytes",
          *total_size, sum));
    }
  }

  // Cleaned names, which must stay distinct.
  for (int f = 0; f < static_cast<int>(reader.files_.size()); ++f) {
    const SafetensorsReader& file = reader.files_[f];
    for (const SafetensorsEntry& e : file.tensors()) {
      Tensor t;
      absl::string_view cleaned = (t.name = CleanTensorName(e.name));
      if (!names.strip_prefix.empty()) {
        absl::ConsumePrefix(&cleaned, names.strip_prefix);
      }
      t.name = absl::StrCat(names.add_prefix, cleaned);
      t.stored_name = e.name;
      t.file = f;
      t.dtype = e.dtype;
      t.shape = e.shape;
      t.nbytes = e.nbytes();
      reader.data_bytes_ += t.nbytes;
      if (t.name.empty()) {
        problems.Add(absl::StrFormat(
            "%s: tensor '%s' has an empty name once wrapper prefixes are "
            "removed",
            file.name(), e.name));
        continue;
      }
      auto [it, inserted] = reader.tensors_.emplace(t.name, t);
      if (!inserted) {
        problems.Add(absl::StrFormat(
            "%s: tensor '%s' and tensor '%s' of %s are both '%s' once "
            "wrapper prefixes are removed",
            file.name(), e.name, it->second.stored_name,
            reader.files_[it->second.file].name(), t.name));
      }
    }
  }
  FLATPARAM_RETURN_IF_ERROR(problems.ToStatus(
      absl::StatusCode::kDataLoss,
      reader.index_path_.empty() ? single_path : reader.index_path_));
  return reader;
}

absl::Status HfCheckpointReader::ReadRange(const Tensor& tensor,
                                           uint64_t offset,
                                           absl::Span<char> out) const {
  return files_[tensor.file].ReadRange(tensor.stored_name, offset, out);
}

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

// ---------------------------------------------------------------------------
// Optimizer state beside the weights

namespace {

// Whether a file of the input directory holds optimizer state: this
// project's pair (optim.safetensors, optim.json) or another tool's
// (optimizer.pt, optimizer.bin, optim.pt, optim_states.pt, ...).
bool IsOptimizerFileName(absl::string_view name) {
  return absl::StartsWith(name, kOptimizerFilePrefix) ||
         absl::StartsWith(name, "optim.") || absl::StartsWith(name, "optim_");
}

// Who a "state.{fqn}.{state}" tensor of optim.safetensors belongs to: the
// longest FQN of the model (a tied alias included) followed by a non-empty
// state name, as FullCheckpointReader::CheckFitsModel reads it.
struct StateOwner {
  std::string fqn;
  std::string state;
  const ParamSpec* param = nullptr;  // the parameter named by `fqn`
};
std::optional<StateOwner> FindStateOwner(
    absl::string_view tensor,
    const std::map<std::string, const ParamSpec*, std::less<>>& params) {
  if (!absl::ConsumePrefix(&tensor, kOptimStatePrefix)) return std::nullopt;
  std::optional<StateOwner> owner;
  for (size_t dot = tensor.find('.'); dot != absl::string_view::npos;
       dot = tensor.find('.', dot + 1)) {
    if (dot + 1 >= tensor.size()) break;
    auto it = params.find(tensor.substr(0, dot));
    if (it != params.end()) {
      owner = StateOwner{it->first, std::string(tensor.substr(dot + 1)),
                         it->second};
    }
  }
  return owner;
}

// optim.safetensors against the model, as ShardCheckpoint checks a full
// checkpoint's (FullCheckpointReader::CheckFitsModel): every tensor is
// "state.{fqn}.{state}" for a parameter, shaped like it or 0-d.
absl::Status CheckOptimFitsModel(
    const SafetensorsReader& file, const ModelSpec& spec,
    const std::map<std::string, const ParamSpec*, std::less<>>& params) {
  Problems problems;
  for (const SafetensorsEntry& e : file.tensors()) {
    const std::optional<StateOwner> owner = FindStateOwner(e.name, params);
    if (!owner.has_value()) {
      problems.Add(absl::StrFormat(
          "tensor '%s' is not state.{fqn}.{state_name} for a parameter of "
          "model '%s'",
          e.name, spec.name));
      continue;
    }
    const std::vector<int64_t>& shape = owner->param->shape;
    if (!e.shape.empty() && e.shape != shape) {
      problems.Add(absl::StrFormat(
          "tensor '%s' has shape %s, expected [] or %s of parameter '%s'",
          e.name, ShapeString(e.shape), ShapeString(shape), owner->fqn));
    }
  }
  return problems.ToStatus(
      absl::StatusCode::kFailedPrecondition,
      absl::StrFormat("%s does not fit model '%s'", file.name(), spec.name));
}

// A hyperparameter as Python's json.dumps writes it: None, bool, int,
// float, str, or a tuple (Adam's betas) as a list of numbers.
absl::StatusOr<optim::HyperValue> HyperFromJson(const json& v,
                                                const std::string& where) {
  switch (v.type()) {
    case json::value_t::null:
      return optim::HyperValue(std::monostate());
    case json::value_t::boolean:
      return optim::HyperValue(v.get<bool>());
    case json::value_t::number_unsigned:
      if (v.get<uint64_t>() >
          static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        break;
      }
      return optim::HyperValue(static_cast<int64_t>(v.get<uint64_t>()));
    case json::value_t::number_integer:
      return optim::HyperValue(v.get<int64_t>());
    case json::value_t::number_float:
      return optim::HyperValue(v.get<double>());
    case json::value_t::string:
      return optim::HyperValue(v.get<std::string>());
    case json::value_t::array: {
      std::vector<double> values;
      for (const json& x : v) {
        if (!x.is_number()) break;
        values.push_back(x.get<double>());
      }
      if (values.size() != v.size()) break;
      return optim::HyperValue(std::move(values));
    }
    default:
      break;
  }
  std::string text = v.dump(-1, ' ', false, json::error_handler_t::replace);
  if (text.size() > 80) text = absl::StrCat(text.substr(0, 77), "...");
  return absl::DataLossError(absl::StrFormat(
      "%s is %s, which is not a hyperparameter that can be imported (None, "
      "a bool, an int, a float, a str, or a tuple of numbers)",
      where, text));
}

// The sidecar of optim.json as PyTorch writes it, the JSON array
// json.dumps(optimizer.state_dict()["param_groups"]): each group's members
// but "params" are hyperparameters; "params" lists parameter IDs, ID i
// being the i-th parameter of the model's parameters() (ModelParamOrder).
// The state is optim.safetensors's: every "state.{fqn}.{state}" tensor, a
// value of parameter fqn (CheckOptimFitsModel has found its owner).
absl::StatusOr<OptimSidecar> SidecarFromPyTorch(
    const json& groups, const std::string& path, const SafetensorsReader& file,
    const ModelLayout& layout,
    const std::map<std::string, const ParamSpec*, std::less<>>& params) {
  const ModelSpec& spec = layout.spec();
  OptimSidecar out;
  for (const SafetensorsEntry& e : file.tensors()) {
    const StateOwner owner = *FindStateOwner(e.name, params);
    if (owner.fqn != owner.param->fqn) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "%s: tensor '%s' is state of '%s', which is tied to '%s' in model "
          "'%s': PyTorch keeps one state for a shared parameter, under its "
          "first name ('%s')",
          file.name(), e.name, owner.fqn, owner.param->fqn, spec.name,
          OptimStateTensorName(owner.param->fqn, owner.state)));
    }
    out.state[optim::ParamKey(owner.fqn)][owner.state] =
        SidecarValue{e.name, std::monostate()};
  }
  const std::vector<std::string> order = optim::ModelParamOrder(layout);
  for (size_t g = 0; g < groups.size(); ++g) {
    const json& group = groups[g];
    const std::string at = absl::StrFormat("%s: param_groups[%d]", path, g);
    if (!group.is_object()) {
      return absl::DataLossError(absl::StrCat(at, ": not a JSON object"));
    }
    auto ids = group.find("params");
    if (ids == group.end() || !ids->is_array()) {
      return absl::DataLossError(
          absl::StrCat(at, ": \"params\" is missing or not a list"));
    }
    optim::ParamGroup out_group;
    for (size_t i = 0; i < ids->size(); ++i) {
      const json& id = (*ids)[i];
      // FSDP.full_optim_state_dict lists parameter names (a shared
      // parameter under its first name); optimizer.state_dict() IDs.
      if (id.is_string()) {
        auto it = params.find(id.get<std::string>());
        if (it == params.end()) {
          return absl::FailedPreconditionError(absl::StrFormat(
              "%s.params[%d] is \"%s\", which is not a parameter of model "
              "'%s' (params are parameter names, as "
              "FSDP.full_optim_state_dict lists them, or IDs, as "
              "optimizer.state_dict() does)",
              at, i, id.get<std::string>(), spec.name));
        }
        out_group.params.push_back(it->second->fqn);
        continue;
      }
      if (!id.is_number_unsigned()) {
        return absl::DataLossError(absl::StrFormat(
            "%s.params[%d] is %s, neither a parameter ID (a non-negative "
            "integer) nor a parameter name",
            at, i, id.dump(-1, ' ', false, json::error_handler_t::replace)));
      }
      if (id.get<uint64_t>() >= order.size()) {
        return absl::FailedPreconditionError(absl::StrFormat(
            "%s.params[%d] is parameter ID %d, but model '%s' has %d "
            "parameters (IDs count its parameters() in order, each shared "
            "parameter once)",
            at, i, id.get<uint64_t>(), spec.name, order.size()));
      }
      out_group.params.push_back(order[id.get<uint64_t>()]);
    }
    for (const auto& [name, value] : group.items()) {
      if (name == "params") continue;
      FLATPARAM_ASSIGN_OR_RETURN(
          out_group.hyperparams[name],
          HyperFromJson(value, absl::StrCat(at, ".", name)));
    }
    out.param_groups.push_back(std::move(out_group));
  }
  return out;
}

// The optimizer state of `dir` (optim.safetensors and optim.json, both
// present), planned for sharding as ShardCheckpoint plans a full
// checkpoint's. `file` receives the opened optim.safetensors, which the
// plan borrows.
absl::StatusOr<std::unique_ptr<FullOptimShards>> PlanOptimizerImport(
    FileSystem& fs, const std::string& dir, const ModelLayout& layout,
    std::optional<SafetensorsReader>& file, HfImportReport& report) {
  const ModelSpec& spec = layout.spec();
  // Every parameter name -> its parameter (the primary for a tied one).
  std::map<std::string, const ParamSpec*, std::less<>> params;
  for (const ParamSpec& p : spec.params) {
    params[p.fqn] = p.tied_to.empty() ? &p : params.at(p.tied_to);
  }
  FLATPARAM_ASSIGN_OR_RETURN(
      SafetensorsReader opened,
      SafetensorsReader::Open(fs, JoinPath(dir, kOptimFileName)));
  file.emplace(std::move(opened));
  FLATPARAM_RETURN_IF_ERROR(CheckOptimFitsModel(*file, spec, params));

  const std::string path = JoinPath(dir, kOptimJsonFileName);
  absl::StatusOr<std::string> text =
      ReadFileToString(fs, path, kMaxJsonFileBytes);
  if (!text.ok()) return absl::DataLossError(text.status().message());
  JsonParseOptions parse;
  parse.code = absl::StatusCode::kDataLoss;
  FLATPARAM_ASSIGN_OR_RETURN(const json doc, ParseJson(*text, path, parse));
  OptimSidecar sidecar;
  if (doc.is_array()) {
    FLATPARAM_ASSIGN_OR_RETURN(
        sidecar, SidecarFromPyTorch(doc, path, *file, layout, params));
  } else if (doc.is_object() && !doc.contains("format") &&
             doc.contains("param_groups")) {
    // {"param_groups": [...]} (and at most an empty "state": the tensors
    // are optim.safetensors's), as a state dict's JSON part is written.
    for (const auto& [key, value] : doc.items()) {
      if (key == "param_groups" ||
          (key == "state" && (value.empty() || value.is_null()))) {
        continue;
      }
      return absl::DataLossError(absl::StrFormat(
          "%s: unexpected \"%s\" beside \"param_groups\" (optim.json is "
          "the param groups of the optimizer's state dict, its state is "
          "optim.safetensors; or flatparam's \"format\": "
          "\"flatparam.optim.v1\" sidecar)",
          path, key));
    }
    if (!doc["param_groups"].is_array()) {
      return absl::DataLossError(
          absl::StrCat(path, ": \"param_groups\" is not a list"));
    }
    FLATPARAM_ASSIGN_OR_RETURN(
        sidecar,
        SidecarFromPyTorch(doc["param_groups"], path, *file, layout, params));
  } else {
    FLATPARAM_ASSIGN_OR_RETURN(sidecar, ParseOptimSidecar(doc, path));
  }
  report.optimizer = true;
  report.optimizer_params = static_cast<int64_t>(sidecar.state.size());
  report.optimizer_groups = static_cast<int64_t>(sidecar.param_groups.size());
  return FullOptimShards::Create(layout, sidecar, *file, path);
}

}  // namespace

std::string DescribeOptimizerImport(const HfImportReport& report) {
  if (!report.optimizer_left_behind.empty()) {
    return absl::StrCat("; optimizer state left behind (--weights-only): ",
                        absl::StrJoin(report.optimizer_left_behind, ", "));
  }
  if (!report.optimizer) return "";
  return absl::StrFormat(
      "; optimizer state of %d parameter%s in %d param group%s imported",
      report.optimizer_params, report.optimizer_params == 1 ? "" : "s",
      report.optimizer_groups, report.optimizer_groups == 1 ? "" : "s");
}

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

// ---------------------------------------------------------------------------
// Export

namespace internal_checkpoint {

std::vector<std::vector<size_t>> SplitIntoShards(
    absl::Span<const uint64_t> sizes, uint64_t max_shard_bytes) {
  std::vector<std::vector<size_t>> shards;
  std::vector<size_t> current;
  uint64_t current_size = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (sizes[i] > max_shard_bytes) {
      shards.push_back({i});
      continue;
    }
    if (current_size + sizes[i] > max_shard_bytes) {
      shards.push_back(std::move(current));
      current.clear();
      current_size = 0;
    }
    current.push_back(i);
    current_size += sizes[i];
  }
  if (!current.empty()) shards.push_back(std::move(current));
  return shards;
}

}  // namespace internal_checkpoint

namespace {

// A tensor to export: its name, its dtype and shape in the input, and how
// to read its bytes there.
struct ExportTensor {
  std::string name;
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;
  std::function<absl::Status(uint64_t offset, absl::Span<char> out)> read;
};

TensorSource ExportSource(const ExportTensor& t, DType out_dtype) {
  TensorSource src;
  src.name = t.name;
  src.dtype = out_dtype;
  src.shape = t.shape;
  if (out_dtype == t.dtype) {
    src.fill = t.read;
    return src;
  }
  src.fill = [read = t.read, in_dtype = t.dtype, out_dtype](
                 uint64_t offset, absl::Span<char> out) -> absl::Status {
    const size_t size = DTypeSize(out_dtype);
    if (offset % size != 0 || out.size() % size != 0) {
      return absl::InternalError(absl::StrFormat(
          "chunk [%d, +%d) is not element-aligned", offset, out.size()));
    }
    return ReadConverted(read, in_dtype, out_dtype, offset / size,
                         out.size() / size, out.data());
  };
  return src;
}

// With overwrite: moves the files written into `tmp` into `dir`, which
// holds files the export did not write (CheckpointWriteOptions::overwrite).
// The previous export's entry points go first and the new one comes last,
// so that no crash leaves an index (or a model.safetensors) beside shards
// of the other export.
absl::Status MergeIntoDirectory(FileSystem& fs, const std::string& dir,
                                const std::string& tmp,
                                const std::vector<PendingFile>& files,
                                const internal_checkpoint::DirContents& before,
                                DirWriteOutcome* outcome) {
  std::set<std::string> written;
  for (const PendingFile& f : files) written.insert(f.name);
  const std::string entry =
      written.count(kHfIndexFileName) > 0 ? kHfIndexFileName : kSingleFileName;
  std::set<std::string> replaced;
  // The previous export's entry points, then the rest of it (files of the
  // export's names: a previous export or the original download's weights).
  for (const char* name : {kHfIndexFileName, kSingleFileName}) {
    if (std::find(before.ours.begin(), before.ours.end(), name) ==
        before.ours.end()) {
      continue;
    }
    FLATPARAM_RETURN_IF_ERROR(fs.RemoveFile(JoinPath(dir, name)));
    replaced.insert(name);
  }
  FLATPARAM_RETURN_IF_ERROR(fs.SyncDir(dir));
  for (const std::string& name : before.ours) {
    if (replaced.count(name) > 0) continue;
    replaced.insert(name);
    if (written.count(name) > 0) continue;  // replaced by the rename below
    FLATPARAM_RETURN_IF_ERROR(fs.RemoveFile(JoinPath(dir, name)));
  }
  std::vector<std::string> kept;
  for (const std::string& name : before.foreign) {
    if (written.count(name) > 0) {
      replaced.insert(name);
    } else {
      kept.push_back(name);
    }
  }
  // The new files, the entry point last.
  for (const PendingFile& f : files) {
    if (f.name == entry) continue;
    FLATPARAM_RETURN_IF_ERROR(
        fs.Rename(JoinPath(tmp, f.name), JoinPath(dir, f.name)));
  }
  FLATPARAM_RETURN_IF_ERROR(fs.SyncDir(dir));
  FLATPARAM_RETURN_IF_ERROR(
      fs.Rename(JoinPath(tmp, entry), JoinPath(dir, entry)));
  FLATPARAM_RETURN_IF_ERROR(fs.SyncDir(dir));
  FLATPARAM_RETURN_IF_ERROR(fs.RemoveDir(tmp));
  FLATPARAM_RETURN_IF_ERROR(fs.SyncDir(Dirname(dir)));
  if (outcome != nullptr) {
    outcome->dir = dir;
    outcome->replaced.assign(replaced.begin(), replaced.end());
    outcome->kept = std::move(kept);
  }
  return absl::OkStatus();
}

// Writes `files` into a new temporary directory and swaps it in as `dir`,
// as checkpoint_dir.h does, but without a manifest; with overwrite, into a
// directory holding other files, MergeIntoDirectory. `identical`: the side
// files' names and content.
absl::Status WriteDirectory(FileSystem& fs, const std::string& dir_arg,
                            const std::vector<PendingFile>& files,
                            const std::map<std::string, std::string>& identical,
                            const CheckpointWriteOptions& options) {
  constexpr auto kKind = internal_checkpoint::DirKind::kHfExport;
  FLATPARAM_ASSIGN_OR_RETURN(const std::string dir,
                             internal_checkpoint::PrepareCheckpointWrite(
                                 fs, dir_arg, options, kKind, identical));
  const std::string tmp = internal_checkpoint::NewTempDirFor(dir);
  const auto write = [&]() -> absl::Status {
    uint64_t total = 0;
    for (const PendingFile& f : files) total += f.size;
    uint64_t done = 0;
    const auto on_bytes = [&](uint64_t n) {
      done += n;
      if (options.progress) options.progress(done, total);
    };
    FLATPARAM_RETURN_IF_ERROR(fs.CreateDir(tmp));
    for (const PendingFile& f : files) {
      FLATPARAM_RETURN_IF_ERROR(
          internal_checkpoint::WritePendingFile(fs, tmp, f, on_bytes).status());
    }
    FLATPARAM_RETURN_IF_ERROR(fs.SyncDir(tmp));
    // What `dir` holds now, not at the start of a long write.
    FLATPARAM_ASSIGN_OR_RETURN(
        const internal_checkpoint::DirContents before,
        internal_checkpoint::InspectCheckpointDir(fs, dir, kKind, identical));
    if (before.foreign.empty()) {
      return internal_checkpoint::SwapInDirectory(fs, dir, tmp,
                                                  options.outcome);
    }
    if (!options.overwrite) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "%s: %s appeared during the export; nothing was replaced", dir,
          before.foreign.front()));
    }
    return MergeIntoDirectory(fs, dir, tmp, files, before, options.outcome);
  };
  absl::Status status = write();
  if (!status.ok()) RecoverCheckpointDir(fs, dir).IgnoreError();
  return status;
}

// The side files of `copy_from` (HfExportOptions), by name.
absl::StatusOr<std::map<std::string, std::string>> ReadSideFiles(
    FileSystem& fs, const std::string& copy_from) {
  constexpr uint64_t kMaxSideFileBytes = uint64_t{1} << 30;
  FLATPARAM_ASSIGN_OR_RETURN(const bool is_dir, IsDir(fs, copy_from));
  if (!is_dir) {
    return absl::InvalidArgumentError(
        absl::StrCat("copy-from: ", copy_from,
                     " is not a directory (give the original "
                     "model's directory, which holds its config.json)"));
  }
  std::map<std::string, std::string> side;
  for (const std::string& name : HfSideFileNames()) {
    const std::string path = JoinPath(copy_from, name);
    FLATPARAM_ASSIGN_OR_RETURN(const bool exists, fs.Exists(path));
    if (!exists) continue;
    FLATPARAM_ASSIGN_OR_RETURN(std::string text,
                               ReadFileToString(fs, path, kMaxSideFileBytes));
    side.emplace(name, std::move(text));
  }
  if (side.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "copy-from: ", copy_from, " holds none of the files it copies (",
        absl::StrJoin(HfSideFileNames(), ", "), ")"));
  }
  return side;
}

}  // namespace

absl::StatusOr<HfExportReport> ExportHfCheckpoint(
    FileSystem& fs, const std::string& in_dir, const std::string& out_dir,
    const HfExportOptions& options) {
  FLATPARAM_RETURN_IF_ERROR(CheckDistinct(in_dir, out_dir));
  if (options.max_shard_bytes == 0) {
    return absl::InvalidArgumentError("max_shard_bytes must be at least 1");
  }
  if (options.dtype.has_value() && !IsFloatingPoint(*options.dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot export to ", DTypeName(*options.dtype),
                     ": only floating-point dtypes"));
  }
  std::map<std::string, std::string> side_files;
  if (!options.copy_from.empty()) {
    FLATPARAM_ASSIGN_OR_RETURN(side_files,
                               ReadSideFiles(fs, options.copy_from));
  }
  FLATPARAM_ASSIGN_OR_RETURN(const std::string path,
                             ResolveCheckpointDir(fs, in_dir));
  absl::StatusOr<std::string> text = ReadFileToString(
      fs, JoinPath(path, kManifestFileName), kMaxManifestBytes);
  if (!text.ok()) {
    return absl::DataLossError(absl::StrCat(
        path, ": no readable ", kManifestFileName,
        " (not a flatparam checkpoint, or its write did not finish): ",
        text.status().message()));
  }
  FLATPARAM_ASSIGN_OR_RETURN(
      const Manifest manifest,
      ParseManifestJson(*text, JoinPath(path, kManifestFileName)));
  CheckpointOpenOptions open;
  open.verify_checksums = options.convert.verify_checksums;

  // The readers must outlive the write: the sources read through them.
  std::optional<FullCheckpointReader> full;
  std::optional<ShardedCheckpointReader> sharded;
  std::unique_ptr<RankFileSet> rank_files;
  std::vector<ExportTensor> tensors;
  if (manifest.kind == CheckpointKind::kFull) {
    FLATPARAM_ASSIGN_OR_RETURN(FullCheckpointReader r,
                               FullCheckpointReader::Open(fs, path, open));
    full.emplace(std::move(r));
    const SafetensorsReader* model = &full->model();
    for (const SafetensorsEntry& e : model->tensors()) {
      tensors.push_back(
          {e.name, e.dtype, e.shape,
           [model, name = e.name](uint64_t offset, absl::Span<char> out) {
             return model->ReadRange(name, offset, out);
           }});
    }
  } else {
    FLATPARAM_ASSIGN_OR_RETURN(ShardedCheckpointReader r,
                               ShardedCheckpointReader::Open(fs, path, open));
    sharded.emplace(std::move(r));
    rank_files = std::make_unique<RankFileSet>(*sharded);
    const auto& flat = sharded->layout().flat_params();
    std::map<std::string, std::pair<int, const ParamInfo*>> by_fqn;
    for (int u = 0; u < static_cast<int>(flat.size()); ++u) {
      for (const ParamInfo& p : flat[u].params()) by_fqn[p.fqn] = {u, &p};
    }
    RankFileSet* files = rank_files.get();
    for (const ParamSpec& p : sharded->spec().params) {
      if (!p.tied_to.empty()) continue;
      const auto [u, info] = by_fqn.at(p.fqn);
      const DType dtype = flat[u].dtype();
      const size_t size = DTypeSize(dtype);
      tensors.push_back({p.fqn, dtype, info->shape,
                         [files, u = u, size, base = info->offset * size](
                             uint64_t offset, absl::Span<char> out) {
                           return files->ReadFlatBytes(
                               u, FlatParamTensorName(u), size, base + offset,
                               out);
                         }});
    }
    // Buffers, as `save_pretrained` writes a model's persistent buffers:
    // shard-group rank 0's.
    for (const BufferSpec& b : sharded->spec().buffers) {
      tensors.push_back(
          {b.fqn, b.dtype, b.shape,
           [files, name = BufferTensorName(b.fqn)](
               uint64_t offset, absl::Span<char> out) -> absl::Status {
             FLATPARAM_ASSIGN_OR_RETURN(const SafetensorsReader* f,
                                        files->Get(0));
             return f->ReadRange(name, offset, out);
           }});
    }
  }

  std::vector<TensorSource> sources;
  std::vector<uint64_t> sizes;
  HfExportReport report;
  for (const ExportTensor& t : tensors) {
    const DType out_dtype =
        options.dtype.has_value() && IsFloatingPoint(t.dtype) ? *options.dtype
                                                              : t.dtype;
    sources.push_back(ExportSource(t, out_dtype));
    sizes.push_back(static_cast<uint64_t>(NumElements(t.shape)) *
                    DTypeSize(out_dtype));
    report.total_size += sizes.back();
  }
  report.tensors = static_cast<int64_t>(tensors.size());
  const std::vector<std::vector<size_t>> shards =
      internal_checkpoint::SplitIntoShards(sizes, options.max_shard_bytes);

  const uint64_t chunk = ChunkBytes(options.convert.chunk_bytes);
  const std::map<std::string, std::string> metadata = {{"format", "pt"}};
  // Per file, its sources (borrowed by the pending file's write).
  std::vector<std::vector<TensorSource>> file_sources(shards.size());
  std::vector<PendingFile> files;
  json weight_map = json::object();
  for (size_t s = 0; s < shards.size(); ++s) {
    const std::string name =
        shards.size() == 1 ? std::string(kSingleFileName)
                           : absl::StrFormat("model-%05d-of-%05d.safetensors",
                                             s + 1, shards.size());
    for (size_t i : shards[s]) {
      file_sources[s].push_back(sources[i]);
      weight_map[sources[i].name] = name;
    }
    FLATPARAM_ASSIGN_OR_RETURN(const uint64_t size,
                               SafetensorsFileSize(file_sources[s], metadata));
    const std::vector<TensorSource>* srcs = &file_sources[s];
    files.push_back(
        {name, size, [name, srcs, &metadata, chunk](WritableFile& f) {
           return WriteSafetensors(f, name, *srcs, metadata, chunk);
         }});
    report.files.push_back(name);
  }
  if (shards.size() > 1) {
    json index = json::object();
    index["metadata"] = {{"total_size", report.total_size}};
    index["weight_map"] = std::move(weight_map);
    FLATPARAM_ASSIGN_OR_RETURN(std::string text, internal_checkpoint::DumpJson(
                                                     index, kHfIndexFileName));
    files.push_back(internal_checkpoint::JsonFile(kHfIndexFileName, text));
    report.files.push_back(kHfIndexFileName);
  }
  for (const std::string& name : HfSideFileNames()) {
    auto it = side_files.find(name);
    if (it == side_files.end()) continue;
    files.push_back(internal_checkpoint::JsonFile(name, it->second));
    report.copied.push_back(name);
  }
  CheckpointWriteOptions write;
  write.chunk_bytes = chunk;
  write.progress = options.convert.progress;
  write.overwrite = options.convert.overwrite;
  write.outcome = options.convert.outcome;
  FLATPARAM_RETURN_IF_ERROR(
      WriteDirectory(fs, out_dir, files, side_files, write));
  return report;
}

}  // namespace checkpoint
}  // namespace flatparam
