#include "flatparam/interop/hf/hf_checkpoint.h"

#include <algorithm>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "flatparam/base/fqn.h"
#include "flatparam/base/json_limits.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/checkpoint/checkpoint_dir.h"
#include "flatparam/checkpoint/manifest.h"
#include "flatparam/interop/hf/internal/hf_internal.h"

namespace flatparam {
namespace checkpoint {
namespace {

using json = nlohmann::json;
using internal_checkpoint::IsDir;
using internal_checkpoint::kSingleFileName;
using internal_checkpoint::Problems;

std::string StripSlashes(std::string dir) {
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  return dir;
}

// A file name an index may list: a plain name in the index's directory.
bool IsPlainFileName(absl::string_view name) {
  return !name.empty() && name != "." && name != ".." &&
         name.find('/') == absl::string_view::npos &&
         name.find('\0') == absl::string_view::npos;
}

}  // namespace

// ---------------------------------------------------------------------------
// Helpers shared with the import and the export (internal/hf_internal.h)

namespace internal_checkpoint {

uint64_t ChunkBytes(uint64_t requested) {
  return std::max<uint64_t>(8, requested / 8 * 8);
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

}  // namespace internal_checkpoint

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

}  // namespace checkpoint
}  // namespace flatparam
