#include <algorithm>
#include <cassert>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "flatparam/base/dtype.h"
#include "flatparam/base/json_limits.h"
#include "flatparam/base/shape.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/checkpoint/checkpoint_dir.h"
#include "flatparam/checkpoint/checkpoint_names.h"
#include "flatparam/checkpoint/file_system.h"
#include "flatparam/checkpoint/internal/checkpoint_format.h"
#include "flatparam/checkpoint/internal/verified_file.h"
#include "flatparam/checkpoint/manifest.h"
#include "flatparam/checkpoint/safetensors.h"
#include "flatparam/layout.h"
#include "flatparam/layout_json.h"
#include "flatparam/model_json.h"
#include "flatparam/model_layout.h"

namespace flatparam {
namespace checkpoint {
namespace {

using json = nlohmann::json;
using internal_checkpoint::CheckRankTensors;
using internal_checkpoint::kModelSpecKey;
using internal_checkpoint::kRankKey;
using internal_checkpoint::kShardGroupSizeKey;

// Longest JSON value quoted in an error message.
constexpr size_t kMaxQuotedJson = 120;

std::string Quote(const json& value) {
  std::string s = value.dump(-1, ' ', false, json::error_handler_t::replace);
  if (s.size() > kMaxQuotedJson) s = s.substr(0, kMaxQuotedJson) + "...";
  return s;
}

// "/flat_params/1/sharded_numel" -> "flat_params[1].sharded_numel".
std::string ReadablePointer(const std::string& pointer) {
  std::string out;
  size_t pos = 1;
  while (pos <= pointer.size() && !pointer.empty()) {
    size_t next = pointer.find('/', pos);
    if (next == std::string::npos) next = pointer.size();
    std::string token = pointer.substr(pos, next - pos);
    size_t t;
    while ((t = token.find("~1")) != std::string::npos)
      token.replace(t, 2, "/");
    while ((t = token.find("~0")) != std::string::npos)
      token.replace(t, 2, "~");
    const bool index =
        !token.empty() && std::all_of(token.begin(), token.end(), [](char c) {
          return absl::ascii_isdigit(c);
        });
    if (index) {
      absl::StrAppend(&out, "[", token, "]");
    } else {
      absl::StrAppend(&out, out.empty() ? "" : ".", token);
    }
    pos = next + 1;
  }
  return out.empty() ? "(document)" : out;
}

// The first place where `a` and `b` differ: its readable path and both
// values ("(absent)" where a side lacks it). Empty path when equal.
struct JsonDifference {
  std::string path;
  std::string a;
  std::string b;
};
std::optional<JsonDifference> FirstDifference(const json& a, const json& b) {
  if (a == b) return std::nullopt;
  const json patch = json::diff(a, b);
  assert(!patch.empty());
  std::string pointer = patch[0]["path"].get<std::string>();
  if (absl::EndsWith(pointer, "/-")) pointer.resize(pointer.size() - 2);
  auto at = [&pointer](const json& doc) -> std::string {
    try {
      const json::json_pointer p(pointer);
      if (doc.contains(p)) return Quote(doc.at(p));
    } catch (const json::exception&) {
    }
    return "(absent)";
  };
  return JsonDifference{ReadablePointer(pointer), at(a), at(b)};
}

absl::StatusOr<json> ReadJsonObject(FileSystem& fs, const std::string& path) {
  absl::StatusOr<std::string> text =
      ReadFileToString(fs, path, kMaxJsonFileBytes);
  if (!text.ok()) {
    return absl::DataLossError(std::string(text.status().message()));
  }
  JsonParseOptions options;
  options.code = absl::StatusCode::kDataLoss;
  FLATPARAM_ASSIGN_OR_RETURN(json doc, ParseJson(*text, path, options));
  if (!doc.is_object()) {
    return absl::DataLossError(
        absl::StrCat(path, ": a JSON ", doc.type_name(), ", not an object"));
  }
  return doc;
}

std::vector<TensorDecl> DeclsOf(absl::Span<const SafetensorsEntry> entries) {
  std::vector<TensorDecl> decls;
  for (const SafetensorsEntry& e : entries) {
    decls.push_back({e.name, e.dtype, e.shape});
  }
  return decls;
}

// Rebuilds the layout a layout.json document describes; DataLoss naming
// `file` and the offending key when the document is malformed or is not
// the layout its own model spec and options give.
absl::StatusOr<std::pair<ModelLayout, int64_t>> LayoutFromDocument(
    const json& doc, const std::string& file) {
  auto error = [&](absl::string_view what) {
    return absl::DataLossError(absl::StrCat(file, ": ", what));
  };
  auto get = [&](const char* key, json::value_t type) -> const json* {
    auto it = doc.find(key);
    if (it == doc.end()) return nullptr;
    if (type == json::value_t::number_unsigned) {
      return it->is_number_unsigned() ? &*it : nullptr;
    }
    return it->type() == type ? &*it : nullptr;
  };
  const json* version = get("version", json::value_t::number_unsigned);
  if (version == nullptr || *version != kLayoutJsonVersion) {
    return error(absl::StrCat(
        "\"version\" is ",
        doc.contains("version") ? Quote(doc["version"]) : "missing",
        ", expected ", kLayoutJsonVersion));
  }
  const json* spec_doc = get(kModelSpecKey, json::value_t::object);
  if (spec_doc == nullptr) {
    return error(
        absl::StrCat("\"", kModelSpecKey, "\" is missing or not an object"));
  }
  absl::StatusOr<ModelSpec> spec = ParseModelSpecJson(
      spec_doc->dump(), absl::StrCat(file, " ", kModelSpecKey));
  if (!spec.ok()) return absl::DataLossError(spec.status().message());

  const json* strategy = get("strategy", json::value_t::string);
  const json* group = get("shard_group_size", json::value_t::number_unsigned);
  const json* world = get("world_size", json::value_t::number_unsigned);
  const json* align = get("align_addresses", json::value_t::boolean);
  if (strategy == nullptr || group == nullptr || world == nullptr ||
      align == nullptr || !doc.contains("compute_dtype")) {
    return error(
        "\"strategy\", \"shard_group_size\", \"world_size\", "
        "\"align_addresses\" and \"compute_dtype\" are required, with a "
        "string, two non-negative integers, a boolean and a dtype or null");
  }
  LayoutOptions options;
  absl::StatusOr<ShardingStrategy> parsed_strategy =
      ParseShardingStrategy(strategy->get<std::string>());
  if (!parsed_strategy.ok()) {
    return error(
        absl::StrCat("\"strategy\": ", parsed_strategy.status().message()));
  }
  options.strategy = *parsed_strategy;
  options.align_addresses = align->get<bool>();
  const json& compute = doc["compute_dtype"];
  if (compute.is_string()) {
    absl::StatusOr<DType> dtype = ParseDType(compute.get<std::string>());
    if (!dtype.ok()) {
      return error(
          absl::StrCat("\"compute_dtype\": ", dtype.status().message()));
    }
    options.compute_dtype = *dtype;
  } else if (!compute.is_null()) {
    return error("\"compute_dtype\" is neither a dtype name nor null");
  }
  const uint64_t g = group->get<uint64_t>();
  const uint64_t w = world->get<uint64_t>();
  if (g < 1 || w < 1 || w % g != 0 || g > (uint64_t{1} << 40)) {
    return error(absl::StrFormat(
        "world_size %d is not a positive multiple of shard_group_size %d", w,
        g));
  }
  if (!IsHybridStrategy(options.strategy) && w != g) {
    return error(absl::StrFormat(
        "world_size %d differs from shard_group_size %d under %s", w, g,
        ShardingStrategyName(options.strategy)));
  }
  options.world_size = static_cast<int64_t>(g);
  absl::StatusOr<ModelLayout> layout = ModelLayout::Create(*spec, options);
  if (!layout.ok()) {
    return error(absl::StrCat("the model spec and options do not lay out: ",
                              layout.status().message()));
  }
  json stored = doc;
  stored.erase(kModelSpecKey);
  LayoutJsonOptions json_options;
  json_options.world_size = static_cast<int64_t>(w);
  const json recomputed = ModelLayoutToJson(*layout, json_options);
  if (std::optional<JsonDifference> d = FirstDifference(stored, recomputed)) {
    return error(absl::StrCat(d->path, " is ", d->a,
                              ", but the layout recomputed from ",
                              kModelSpecKey, " has ", d->b));
  }
  return std::make_pair(*std::move(layout), static_cast<int64_t>(w));
}

// The fqn a "state.{fqn}.{name}" tensor belongs to: the longest known fqn
// followed by a non-empty state name.
const ParamSpec* OptimStateOwner(
    absl::string_view tensor,
    const std::map<std::string, const ParamSpec*, std::less<>>& params) {
  if (!absl::ConsumePrefix(&tensor, kOptimStatePrefix)) return nullptr;
  const ParamSpec* owner = nullptr;
  for (size_t dot = tensor.find('.'); dot != absl::string_view::npos;
       dot = tensor.find('.', dot + 1)) {
    if (dot + 1 >= tensor.size()) break;
    auto it = params.find(tensor.substr(0, dot));
    if (it != params.end()) owner = it->second;
  }
  return owner;
}

absl::StatusOr<std::pair<std::string, Manifest>> OpenVerified(
    FileSystem& fs, const std::string& dir, CheckpointKind kind,
    const CheckpointOpenOptions& options) {
  FLATPARAM_ASSIGN_OR_RETURN(std::string path, ResolveCheckpointDir(fs, dir));
  VerifyOptions verify;
  verify.verify_checksums = options.verify_checksums;
  verify.expected_kind = kind;
  verify.progress = options.progress;
  if (kind == CheckpointKind::kSharded && options.ranks.has_value()) {
    std::set<std::string> mine;
    for (int64_t r : *options.ranks) mine.insert(RankTensorFileName(r));
    verify.checksum_only = [mine](const std::string& file) {
      return !absl::EndsWith(file, ".safetensors") || mine.count(file) > 0;
    };
  }
  FLATPARAM_ASSIGN_OR_RETURN(Manifest manifest,
                             VerifyManifest(fs, path, verify));
  return std::make_pair(std::move(path), std::move(manifest));
}

// The manifest must list exactly `expected`.
absl::Status CheckFileSet(const std::string& dir, const Manifest& manifest,
                          const std::set<std::string>& expected,
                          CheckpointKind kind) {
  std::set<std::string> listed;
  for (const ManifestEntry& e : manifest.files) listed.insert(e.path);
  for (const std::string& name : expected) {
    if (listed.count(name) == 0) {
      return absl::DataLossError(
          absl::StrCat(dir, ": a ", CheckpointKindName(kind),
                       " checkpoint needs ", name, ", which is missing"));
    }
  }
  for (const std::string& name : listed) {
    if (expected.count(name) == 0) {
      return absl::DataLossError(
          absl::StrCat(JoinPath(dir, name), ": not part of a ",
                       CheckpointKindName(kind), " checkpoint"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

FullCheckpointReader::FullCheckpointReader(std::string path, Manifest manifest,
                                           SafetensorsReader model,
                                           SafetensorsReader optim,
                                           nlohmann::json optim_json)
    : path_(std::move(path)),
      manifest_(std::move(manifest)),
      model_(std::move(model)),
      optim_(std::move(optim)),
      optim_json_(std::move(optim_json)) {}

absl::StatusOr<FullCheckpointReader> FullCheckpointReader::Open(
    FileSystem& fs, const std::string& dir,
    const CheckpointOpenOptions& options) {
  FLATPARAM_ASSIGN_OR_RETURN(
      auto verified, OpenVerified(fs, dir, CheckpointKind::kFull, options));
  const std::string& path = verified.first;
  FLATPARAM_RETURN_IF_ERROR(
      CheckFileSet(path, verified.second,
                   {kModelFileName, kOptimFileName, kOptimJsonFileName},
                   CheckpointKind::kFull));
  FLATPARAM_ASSIGN_OR_RETURN(
      SafetensorsReader model,
      SafetensorsReader::Open(fs, JoinPath(path, kModelFileName)));
  FLATPARAM_ASSIGN_OR_RETURN(
      SafetensorsReader optim,
      SafetensorsReader::Open(fs, JoinPath(path, kOptimFileName)));
  for (const SafetensorsEntry& e : optim.tensors()) {
    if (!absl::StartsWith(e.name, kOptimStatePrefix)) {
      return absl::DataLossError(
          absl::StrCat(optim.name(), ": tensor '", e.name,
                       "' is not named state.{fqn}.{state_name}"));
    }
  }
  FLATPARAM_ASSIGN_OR_RETURN(
      json optim_json, ReadJsonObject(fs, JoinPath(path, kOptimJsonFileName)));
  return FullCheckpointReader(path, std::move(verified.second),
                              std::move(model), std::move(optim),
                              std::move(optim_json));
}

absl::Status FullCheckpointReader::CheckFitsModel(const ModelSpec& spec) const {
  // fqn -> the parameter whose tensor it is (the primary for a tied one).
  std::map<std::string, const ParamSpec*, std::less<>> params;
  for (const ParamSpec& p : spec.params) {
    if (p.tied_to.empty()) {
      params[p.fqn] = &p;
    } else {
      auto it = params.find(p.tied_to);
      if (it != params.end()) params[p.fqn] = it->second;
    }
  }
  auto error = [](const std::string& file, absl::string_view what) {
    return absl::FailedPreconditionError(absl::StrCat(file, ": ", what));
  };
  std::map<std::string, const BufferSpec*, std::less<>> buffers;
  for (const BufferSpec& b : spec.buffers) buffers[b.fqn] = &b;
  for (const SafetensorsEntry& e : model_.tensors()) {
    auto it = params.find(e.name);
    if (it == params.end()) {
      auto b = buffers.find(e.name);
      if (b == buffers.end()) {
        return error(model_.name(),
                     absl::StrCat("tensor '", e.name,
                                  "' is not a parameter or buffer of model '",
                                  spec.name, "'"));
      }
      if (e.dtype != b->second->dtype || e.shape != b->second->shape) {
        return error(
            model_.name(),
            absl::StrCat("tensor '", e.name, "' is ", DTypeName(e.dtype), " ",
                         ShapeString(e.shape), ", the model's buffer is ",
                         DTypeName(b->second->dtype), " ",
                         ShapeString(b->second->shape)));
      }
      continue;
    }
    const ParamSpec& p = *it->second;
    if (e.dtype != p.dtype || e.shape != p.shape) {
      return error(
          model_.name(),
          absl::StrCat("tensor '", e.name, "' is ", DTypeName(e.dtype), " ",
                       ShapeString(e.shape), ", the model's parameter is ",
                       DTypeName(p.dtype), " ", ShapeString(p.shape)));
    }
  }
  for (const ParamSpec& p : spec.params) {
    if (p.tied_to.empty() && !model_.Contains(p.fqn)) {
      return error(model_.name(),
                   absl::StrCat("parameter '", p.fqn, "' of model '", spec.name,
                                "' is missing"));
    }
  }
  for (const BufferSpec& b : spec.buffers) {
    if (!model_.Contains(b.fqn)) {
      return error(model_.name(),
                   absl::StrCat("buffer '", b.fqn, "' of model '", spec.name,
                                "' is missing"));
    }
  }
  for (const SafetensorsEntry& e : optim_.tensors()) {
    const ParamSpec* p = OptimStateOwner(e.name, params);
    if (p == nullptr) {
      return error(optim_.name(),
                   absl::StrCat("tensor '", e.name,
                                "' is not state.{fqn}.{state_name} for a "
                                "parameter of model '",
                                spec.name, "'"));
    }
    if (!e.shape.empty() && e.shape != p->shape) {
      return error(
          optim_.name(),
          absl::StrCat("tensor '", e.name, "' has shape ", ShapeString(e.shape),
                       ", expected [] or ", ShapeString(p->shape),
                       " of parameter '", p->fqn, "'"));
    }
  }
  return absl::OkStatus();
}

struct ShardedCheckpointReader::Verified {
  absl::Mutex mu;
  std::set<int64_t> ranks ABSL_GUARDED_BY(mu);
};

ShardedCheckpointReader::ShardedCheckpointReader(
    FileSystem* fs, std::string path, Manifest manifest, ModelLayout layout,
    int64_t world_size, nlohmann::json layout_json)
    : verified_(std::make_shared<Verified>()),
      fs_(fs),
      path_(std::move(path)),
      manifest_(std::move(manifest)),
      layout_(std::move(layout)),
      world_size_(world_size),
      layout_json_(std::move(layout_json)) {}

absl::StatusOr<ShardedCheckpointReader> ShardedCheckpointReader::Open(
    FileSystem& fs, const std::string& dir,
    const CheckpointOpenOptions& options) {
  FLATPARAM_ASSIGN_OR_RETURN(
      auto verified, OpenVerified(fs, dir, CheckpointKind::kSharded, options));
  const std::string& path = verified.first;
  const std::string layout_path = JoinPath(path, kLayoutFileName);
  {
    bool listed = false;
    for (const ManifestEntry& e : verified.second.files) {
      listed = listed || e.path == kLayoutFileName;
    }
    if (!listed) {
      return absl::DataLossError(
          absl::StrCat(path, ": a sharded checkpoint needs ", kLayoutFileName,
                       ", which is missing"));
    }
  }
  FLATPARAM_ASSIGN_OR_RETURN(json doc, ReadJsonObject(fs, layout_path));
  FLATPARAM_ASSIGN_OR_RETURN(auto layout, LayoutFromDocument(doc, layout_path));
  const int64_t g = layout.first.options().world_size;
  std::set<std::string> expected = {kLayoutFileName};
  for (int64_t r = 0; r < g; ++r) {
    expected.insert(RankTensorFileName(r));
    expected.insert(RankJsonFileName(r));
  }
  FLATPARAM_RETURN_IF_ERROR(
      CheckFileSet(path, verified.second, expected, CheckpointKind::kSharded));
  ShardedCheckpointReader reader(&fs, path, std::move(verified.second),
                                 std::move(layout.first), layout.second,
                                 std::move(doc));
  reader.verify_checksums_ = options.verify_checksums;
  {
    absl::MutexLock lock(&reader.verified_->mu);
    for (int64_t r = 0; r < g; ++r) {
      if (!options.ranks.has_value() ||
          std::count(options.ranks->begin(), options.ranks->end(), r) > 0) {
        reader.verified_->ranks.insert(r);
      }
    }
  }
  for (int64_t r = 0; r < g; ++r) {
    FLATPARAM_RETURN_IF_ERROR(reader.ReadRankJson(r).status());
  }
  if (options.ranks.has_value()) {
    for (int64_t r : *options.ranks) {
      // Checksummed above with the metadata; the header here.
      FLATPARAM_RETURN_IF_ERROR(reader.OpenRank(r).status());
    }
  } else {
    for (int64_t r = 0; r < g; ++r) {
      FLATPARAM_RETURN_IF_ERROR(reader.OpenRank(r).status());
    }
  }
  return reader;
}

const ManifestEntry* ShardedCheckpointReader::FindEntry(
    const std::string& name) const {
  for (const ManifestEntry& e : manifest_.files) {
    if (e.path == name) return &e;
  }
  return nullptr;
}

absl::Status ShardedCheckpointReader::VerifyRank(int64_t rank) const {
  if (rank < 0 || rank >= num_ranks()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("rank %d is not in [0, %d) of checkpoint %s", rank,
                        num_ranks(), path_));
  }
  const std::string name = RankTensorFileName(rank);
  if (verify_checksums_) {
    const ManifestEntry* listed = FindEntry(name);
    if (listed == nullptr) {
      return absl::DataLossError(
          absl::StrCat(path_, ": ", name, " is not in ", kManifestFileName));
    }
    FLATPARAM_ASSIGN_OR_RETURN(
        ManifestEntry actual,
        DescribeFile(*fs_, path_, name, nullptr, listed->block_size));
    FLATPARAM_RETURN_IF_ERROR(CheckAgainstManifest(path_, *listed, actual));
    absl::MutexLock lock(&verified_->mu);
    verified_->ranks.insert(rank);
  }
  return OpenRank(rank).status();
}

absl::StatusOr<std::unique_ptr<RandomAccessFile>>
ShardedCheckpointReader::OpenRankFile(int64_t rank) const {
  const std::string name = RankTensorFileName(rank);
  FLATPARAM_ASSIGN_OR_RETURN(std::unique_ptr<RandomAccessFile> file,
                             fs_->NewRandomAccessFile(JoinPath(path_, name)));
  if (!verify_checksums_) return file;
  const ManifestEntry* listed = FindEntry(name);
  if (listed == nullptr) {
    return absl::DataLossError(
        absl::StrCat(path_, ": ", name, " is not in ", kManifestFileName));
  }
  {
    // Checksummed whole already (Open or VerifyRank): not again.
    absl::MutexLock lock(&verified_->mu);
    if (verified_->ranks.count(rank) > 0) return file;
  }
  if (listed->has_blocks()) {
    return internal_checkpoint::BlockVerifiedFile::Open(std::move(file),
                                                        *listed);
  }
  // No block checksums: the whole file, once.
  FLATPARAM_ASSIGN_OR_RETURN(ManifestEntry actual,
                             DescribeFile(*fs_, path_, name, nullptr));
  FLATPARAM_RETURN_IF_ERROR(CheckAgainstManifest(path_, *listed, actual));
  absl::MutexLock lock(&verified_->mu);
  verified_->ranks.insert(rank);
  return file;
}

absl::StatusOr<SafetensorsReader> ShardedCheckpointReader::OpenRank(
    int64_t rank) const {
  if (rank < 0 || rank >= num_ranks()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("rank %d is not in [0, %d) of checkpoint %s", rank,
                        num_ranks(), path_));
  }
  FLATPARAM_ASSIGN_OR_RETURN(std::unique_ptr<RandomAccessFile> raw,
                             OpenRankFile(rank));
  const std::string file = raw->name();
  FLATPARAM_ASSIGN_OR_RETURN(SafetensorsReader reader,
                             SafetensorsReader::Open(std::move(raw)));
  const auto& metadata = reader.metadata();
  auto rank_it = metadata.find(kRankKey);
  auto group_it = metadata.find(kShardGroupSizeKey);
  if (rank_it == metadata.end() || rank_it->second != absl::StrCat(rank) ||
      group_it == metadata.end() ||
      group_it->second != absl::StrCat(num_ranks())) {
    return absl::DataLossError(absl::StrFormat(
        "%s: __metadata__ says rank %s of %s, expected rank %d of %d", file,
        rank_it == metadata.end() ? "(none)" : rank_it->second,
        group_it == metadata.end() ? "(none)" : group_it->second, rank,
        num_ranks()));
  }
  FLATPARAM_RETURN_IF_ERROR(CheckRankTensors(
      layout_, DeclsOf(reader.tensors()), file, absl::StatusCode::kDataLoss));
  return reader;
}

absl::StatusOr<nlohmann::json> ShardedCheckpointReader::ReadRankJson(
    int64_t rank) const {
  if (rank < 0 || rank >= num_ranks()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("rank %d is not in [0, %d) of checkpoint %s", rank,
                        num_ranks(), path_));
  }
  return ReadJsonObject(*fs_, JoinPath(path_, RankJsonFileName(rank)));
}

absl::Status ShardedCheckpointReader::CheckFits(const ModelLayout& layout,
                                                int64_t world_size) const {
  auto error = [](absl::string_view what) {
    return absl::FailedPreconditionError(what);
  };
  if (world_size != world_size_) {
    return error(absl::StrFormat(
        "world size: checkpoint %d, job %d (reshard the checkpoint offline)",
        world_size_, world_size));
  }
  if (layout.options().strategy != layout_.options().strategy) {
    return error(absl::StrFormat(
        "strategy: checkpoint %s, job %s (reshard the checkpoint offline)",
        ShardingStrategyName(layout_.options().strategy),
        ShardingStrategyName(layout.options().strategy)));
  }
  if (layout.flat_params().size() != layout_.flat_params().size()) {
    return error(absl::StrFormat(
        "flat parameters: checkpoint has %d, job has %d",
        layout_.flat_params().size(), layout.flat_params().size()));
  }
  if (layout.options().world_size < 1 ||
      world_size % layout.options().world_size != 0) {
    return error(absl::StrFormat("shard_group_size: checkpoint %d, job %d",
                                 num_ranks(), layout.options().world_size));
  }
  LayoutJsonOptions options;
  options.world_size = world_size;
  json ours = ModelLayoutToJson(layout_, options);
  json theirs = ModelLayoutToJson(layout, options);
  // The model's name is a label, not part of the layout.
  ours.erase("model");
  theirs.erase("model");
  if (std::optional<JsonDifference> d = FirstDifference(ours, theirs)) {
    return error(absl::StrCat(d->path, ": checkpoint ", d->a, ", job ", d->b));
  }
  const std::string buffers = DescribeBufferDifference(
      layout_.spec(), layout.spec(), "the checkpoint's", "the job's");
  if (!buffers.empty()) return error(buffers);
  return absl::OkStatus();
}

}  // namespace checkpoint
}  // namespace flatparam
