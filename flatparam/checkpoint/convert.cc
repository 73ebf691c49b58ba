#include "flatparam/checkpoint/convert.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <utility>
#include <variant>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "flatparam/base/dtype.h"
#include "flatparam/base/shape.h"
#include "flatparam/base/splitmix64.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/checkpoint/internal/checkpoint_write.h"
#include "flatparam/checkpoint/internal/flat_stream.h"
#include "flatparam/checkpoint/internal/full_optim_shards.h"
#include "flatparam/checkpoint/internal/sidecar_meta.h"
#include "flatparam/checkpoint/training_state.h"
#include "flatparam/layout_json.h"
#include "flatparam/optim/internal/flat_plan.h"
#include "flatparam/optim/internal/state_meta.h"
#include "flatparam/optim/optim_state.h"

namespace flatparam {
namespace checkpoint {
namespace {

using json = nlohmann::json;
using internal_checkpoint::AddUnitState;
using internal_checkpoint::FlatShardSource;
using internal_checkpoint::FullOptimShards;
using internal_checkpoint::Keep;
using internal_checkpoint::ParamRead;
using internal_checkpoint::ResolveSidecar;
using RankFiles = internal_checkpoint::RankFileSet;
using optim::HyperValue;
using optim::OptimStateValue;
using optim::ParamGroup;
using optim::ParamKey;
using optim::ParamState;
using optim::internal_optim::FlatUnitPlan;
using optim::internal_optim::ModelIndex;
using optim::internal_optim::ParamStateMeta;
using optim::internal_optim::PlanFlatUnit;
using optim::internal_optim::PlanGroups;
using optim::internal_optim::StateMeta;
using optim::internal_optim::UnflattenGroups;
using optim::internal_optim::ValidateFlatRanks;
using optim::internal_optim::ValueMeta;

// ---------------------------------------------------------------------------
// Small helpers.

uint64_t ChunkBytes(uint64_t requested) {
  return std::max<uint64_t>(8, requested / 8 * 8);
}

CheckpointWriteOptions WriteOptions(const ConvertOptions& options) {
  CheckpointWriteOptions w;
  w.chunk_bytes = ChunkBytes(options.chunk_bytes);
  w.progress = options.progress;
  w.overwrite = options.overwrite;
  w.outcome = options.outcome;
  return w;
}

CheckpointOpenOptions OpenOptions(const ConvertOptions& options) {
  CheckpointOpenOptions o;
  o.verify_checksums = options.verify_checksums;
  return o;
}

std::string StripSlashes(std::string dir) {
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  return dir;
}

absl::Status CheckDistinct(const std::string& in, const std::string& out) {
  if (StripSlashes(in) == StripSlashes(out)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "the output directory %s is the input directory; write elsewhere",
        out));
  }
  return absl::OkStatus();
}

// A full checkpoint's optimizer state, checked and resolved.
absl::StatusOr<std::pair<OptimSidecar, StateMeta>> LoadFullOptim(
    const FullCheckpointReader& reader) {
  const std::string sidecar_name = JoinPath(reader.path(), kOptimJsonFileName);
  FLATPARAM_ASSIGN_OR_RETURN(
      OptimSidecar sidecar,
      ParseOptimSidecar(reader.optim_json(), sidecar_name));
  FLATPARAM_RETURN_IF_ERROR(
      CheckFullSidecar(sidecar, reader.optim(), sidecar_name));
  FLATPARAM_ASSIGN_OR_RETURN(StateMeta infos,
                             ResolveSidecar(sidecar, reader.optim()));
  return std::make_pair(std::move(sidecar), std::move(infos));
}

// ---------------------------------------------------------------------------
// The optimizer state of a sharded checkpoint, validated across ranks.

struct ShardedOptim {
  // Rank 0's flat-parameter states (int keys), validated against every rank.
  std::map<int64_t, ParamStateMeta> units;
  // Rank 0's other keys (non-tensor values only).
  std::map<std::string, ParamState> passthrough;
  std::vector<ParamGroup> groups;
  json extra = json::object();
};

absl::StatusOr<ShardedOptim> LoadShardedOptim(
    const ShardedCheckpointReader& reader, RankFiles& files) {
  const ModelLayout& layout = reader.layout();
  const int64_t num_flat = static_cast<int64_t>(layout.flat_params().size());
  std::vector<StateMeta> ranks;
  ShardedOptim out;
  for (int64_t r = 0; r < reader.num_ranks(); ++r) {
    FLATPARAM_ASSIGN_OR_RETURN(json doc, reader.ReadRankJson(r));
    const std::string sidecar_name =
        JoinPath(reader.path(), RankJsonFileName(r));
    FLATPARAM_ASSIGN_OR_RETURN(OptimSidecar sidecar,
                               ParseOptimSidecar(doc, sidecar_name));
    FLATPARAM_ASSIGN_OR_RETURN(const SafetensorsReader* file, files.Get(r));
    FLATPARAM_RETURN_IF_ERROR(
        CheckRankSidecar(sidecar, *file, num_flat, sidecar_name));
    FLATPARAM_ASSIGN_OR_RETURN(StateMeta infos, ResolveSidecar(sidecar, *file));
    if (r == 0) {
      out.groups = std::move(sidecar.param_groups);
      out.extra = std::move(sidecar.extra);
    }
    ranks.push_back(std::move(infos));
  }
  // The flat path's cross-rank rules (ConsolidateOptimState's), except that
  // rank 0's replicated values are kept, so the others must agree.
  std::vector<int> units;
  FLATPARAM_RETURN_IF_ERROR(ValidateFlatRanks(ModelIndex(layout, {}), ranks,
                                              /*compare_replicated=*/true,
                                              &units));
  for (auto& [key, state0] : ranks[0]) {
    if (const auto* id = std::get_if<int64_t>(&key)) {
      out.units[*id] = std::move(state0);
      continue;
    }
    ParamState& p = out.passthrough[std::get<std::string>(key)];
    for (const auto& [name, v] : state0) p[name] = v.value;
  }
  return out;
}

// A buffer's whole tensor under `name`, its bytes from `read` (offsets
// into the buffer's bytes).
TensorSource BufferSource(
    std::string name, const BufferSpec& b,
    std::function<absl::Status(uint64_t, absl::Span<char>)> read) {
  TensorSource src;
  src.name = std::move(name);
  src.dtype = b.dtype;
  src.shape = b.shape;
  src.fill = std::move(read);
  return src;
}

// ---------------------------------------------------------------------------
// Pseudo-random initial values.

uint64_t HashString(absl::string_view s) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (char c : s) h = (h ^ static_cast<unsigned char>(c)) * 0x100000001b3ULL;
  return h;
}

TensorSource RandomSource(std::string name, DType dtype,
                          std::vector<int64_t> shape, uint64_t stream,
                          bool non_negative) {
  TensorSource src;
  src.name = std::move(name);
  src.dtype = dtype;
  src.shape = std::move(shape);
  src.fill = [dtype, stream, non_negative](uint64_t offset,
                                           absl::Span<char> out) {
    const size_t size = DTypeSize(dtype);
    if (offset % size != 0 || out.size() % size != 0) {
      return absl::InternalError("chunk is not element-aligned");
    }
    const uint64_t first = offset / size;
    for (size_t i = 0; i < out.size() / size; ++i) {
      const uint64_t bits = SplitMix64(stream ^ SplitMix64(first + i));
      double v = static_cast<double>(bits >> 11) * 0x1.0p-53 - 0.5;
      if (non_negative) v = std::fabs(v) * 1e-3;
      StoreFromDouble(out.data(), dtype, i, v);
    }
    return absl::OkStatus();
  };
  return src;
}

}  // namespace

// ---------------------------------------------------------------------------

absl::Status ConsolidateCheckpoint(FileSystem& fs, const std::string& in_dir,
                                   const std::string& out_dir,
                                   const ConvertOptions& options) {
  FLATPARAM_RETURN_IF_ERROR(CheckDistinct(in_dir, out_dir));
  FLATPARAM_ASSIGN_OR_RETURN(
      ShardedCheckpointReader reader,
      ShardedCheckpointReader::Open(fs, in_dir, OpenOptions(options)));
  RankFiles files(reader);
  FLATPARAM_ASSIGN_OR_RETURN(ShardedOptim so, LoadShardedOptim(reader, files));
  const ModelLayout& layout = reader.layout();
  const auto& flat = layout.flat_params();

  FullCheckpointContent content;
  Keep keep;
  OptimSidecar sidecar;
  // Parameters in the model's order (as InitCheckpoint writes them), so
  // that a consolidated file is byte-identical to the original.
  std::vector<std::pair<int, const ParamInfo*>> order;
  {
    std::map<std::string, std::pair<int, const ParamInfo*>> by_fqn;
    for (int u = 0; u < static_cast<int>(flat.size()); ++u) {
      for (const ParamInfo& p : flat[u].params()) by_fqn[p.fqn] = {u, &p};
    }
    for (const ParamSpec& p : layout.spec().params) {
      auto it = by_fqn.find(p.fqn);
      if (it != by_fqn.end()) order.push_back(it->second);
    }
  }
  for (const auto& [u, param] : order) {
    const std::string name = FlatParamTensorName(u);
    const size_t size = DTypeSize(flat[u].dtype());
    {
      const ParamInfo& p = *param;
      TensorSource src;
      src.name = p.fqn;
      src.dtype = flat[u].dtype();
      src.shape = p.shape;
      src.fill = [&files, u, name, size, base = p.offset * size](
                     uint64_t offset, absl::Span<char> out) {
        return files.ReadFlatBytes(u, name, size, base + offset, out);
      };
      content.model.push_back(std::move(src));
    }
  }
  // Buffers after the parameters: shard-group rank 0's, as PyTorch's full
  // state dict takes them.
  for (const BufferSpec& b : layout.spec().buffers) {
    content.model.push_back(
        BufferSource(b.fqn, b,
                     [&files, name = BufferTensorName(b.fqn)](
                         uint64_t offset, absl::Span<char> out) {
                       return files.ReadRange(0, name, offset, out);
                     }));
  }
  for (const auto& [unit_index, param] : order) {
    auto unit_states = so.units.find(unit_index);
    if (unit_states == so.units.end()) continue;
    const int64_t u = unit_index;
    const auto& states = unit_states->second;
    {
      const ParamInfo& p = *param;
      auto& out = sidecar.state[ParamKey(p.fqn)];
      for (const auto& [name, v] : states) {
        if (!v.pos_dim) {
          if (const auto* t = std::get_if<HostTensor>(&v.value)) {
            keep.push_back(*t);
            std::string tensor = OptimStateTensorName(p.fqn, name);
            content.optim.push_back(
                TensorSourceFromHostTensor(tensor, keep.back()));
            out[name] = SidecarValue{std::move(tensor), std::monostate()};
          } else {
            out[name] = SidecarValue{std::nullopt, v.value};
          }
          continue;
        }
        const size_t size = DTypeSize(v.dtype);
        TensorSource src;
        src.name = OptimStateTensorName(p.fqn, name);
        src.dtype = v.dtype;
        src.shape = p.shape;
        src.fill = [&files, u = static_cast<int>(u),
                    shard = OptimShardTensorName(u, name), size,
                    base = p.offset * size](uint64_t offset,
                                            absl::Span<char> out) {
          return files.ReadFlatBytes(u, shard, size, base + offset, out);
        };
        out[name] = SidecarValue{src.name, std::monostate()};
        content.optim.push_back(std::move(src));
      }
    }
  }
  for (const auto& [key, state] : so.passthrough) {
    // A consolidated parameter's key wins, as in ConsolidateOptimState.
    if (sidecar.state.count(ParamKey(key)) > 0) continue;
    auto& out = sidecar.state[ParamKey(key)];
    for (const auto& [name, value] : state) {
      out[name] = SidecarValue{std::nullopt, value};
    }
  }
  FLATPARAM_ASSIGN_OR_RETURN(sidecar.param_groups,
                             UnflattenGroups(ModelIndex(layout, {}), so.groups,
                                             /*use_orig_params=*/false));
  FLATPARAM_ASSIGN_OR_RETURN(content.optim_json,
                             OptimSidecarToJson(sidecar, /*with_extra=*/false));
  return WriteFullCheckpoint(fs, out_dir, content, WriteOptions(options));
}

absl::Status ShardCheckpoint(FileSystem& fs, const std::string& in_dir,
                             const ModelSpec& spec,
                             const LayoutOptions& layout_options,
                             int64_t world_size, const std::string& out_dir,
                             const ConvertOptions& options) {
  FLATPARAM_RETURN_IF_ERROR(CheckDistinct(in_dir, out_dir));
  FLATPARAM_ASSIGN_OR_RETURN(ModelLayout layout,
                             ModelLayout::Create(spec, layout_options));
  FLATPARAM_ASSIGN_OR_RETURN(
      FullCheckpointReader reader,
      FullCheckpointReader::Open(fs, in_dir, OpenOptions(options)));
  FLATPARAM_RETURN_IF_ERROR(reader.CheckFitsModel(spec));
  const std::string sidecar_name = JoinPath(reader.path(), kOptimJsonFileName);
  FLATPARAM_ASSIGN_OR_RETURN(
      const OptimSidecar full,
      ParseOptimSidecar(reader.optim_json(), sidecar_name));
  FLATPARAM_ASSIGN_OR_RETURN(
      const std::unique_ptr<FullOptimShards> optim,
      FullOptimShards::Create(layout, full, reader.optim(), sidecar_name));

  const SafetensorsReader& model = reader.model();
  const auto& flat = layout.flat_params();
  ShardedCheckpointContent content;
  content.layout = &layout;
  content.world_size = world_size;
  for (int64_t r = 0; r < layout.options().world_size; ++r) {
    RankContent rank;
    for (size_t u = 0; u < flat.size(); ++u) {
      const FlatParamLayout* unit = &flat[u];
      const DType dtype = unit->dtype();
      rank.tensors.push_back(FlatShardSource(
          FlatParamTensorName(u), unit, dtype, r,
          [&model, unit, dtype](int i, int64_t begin, int64_t n, char* out) {
            const size_t size = DTypeSize(dtype);
            return model.ReadRange(unit->params()[i].fqn, begin * size,
                                   absl::MakeSpan(out, n * size));
          }));
      optim->AppendUnit(static_cast<int>(u), r, rank.tensors);
    }
    for (const BufferSpec& b : spec.buffers) {
      rank.tensors.push_back(BufferSource(
          BufferTensorName(b.fqn), b,
          [&model, fqn = b.fqn](uint64_t offset, absl::Span<char> out) {
            return model.ReadRange(fqn, offset, out);
          }));
    }
    optim->AppendZeroDim(rank.tensors);
    rank.sidecar = optim->sidecar();
    content.ranks.push_back(std::move(rank));
  }
  return WriteShardedCheckpoint(fs, out_dir, content, WriteOptions(options));
}

namespace {

// The ranks of `layout` (the checkpoint's model under other layout options
// or world size), each rank's content streamed from the old ranks' files:
// the work of ReshardCheckpoint, and of LoadRankState when a job does not
// fit its checkpoint. Borrows `reader` and `layout`; not movable, because
// the content's sources point into it.
class ReshardedRanks {
 public:
  static absl::StatusOr<std::unique_ptr<ReshardedRanks>> Create(
      const ShardedCheckpointReader& reader, const ModelLayout& layout) {
    std::unique_ptr<ReshardedRanks> out(new ReshardedRanks(reader, layout));
    FLATPARAM_RETURN_IF_ERROR(out->Init());
    return out;
  }
  ReshardedRanks(const ReshardedRanks&) = delete;
  ReshardedRanks& operator=(const ReshardedRanks&) = delete;

  // Shard-group rank `r`'s files; its sources read the old ranks' files
  // when pulled, and point into this object.
  RankContent Rank(int64_t r) {
    const auto& flat = layout_.flat_params();
    RankContent rank;
    for (int u = 0; u < static_cast<int>(flat.size()); ++u) {
      const DType dtype = flat[u].dtype();
      rank.tensors.push_back(
          FlatShardSource(FlatParamTensorName(u), &flat[u], dtype, r,
                          OldRead(u, FlatParamTensorName(u), dtype)));
      auto it = so_.units.find(u);
      if (it == so_.units.end()) continue;
      for (const auto& [name, v] : it->second) {
        if (!v.pos_dim) continue;
        rank.tensors.push_back(FlatShardSource(
            OptimShardTensorName(u, name), &flat[u], v.dtype, r,
            OldRead(u, OptimShardTensorName(u, name), v.dtype)));
      }
    }
    // Buffers are not sharded: every new rank takes the old shard-group
    // rank 0's, as a load of PyTorch's full state dict would.
    for (const BufferSpec& b : layout_.spec().buffers) {
      const std::string name = BufferTensorName(b.fqn);
      rank.tensors.push_back(BufferSource(
          name, b,
          [files = &files_, name](uint64_t offset, absl::Span<char> out) {
            return files->ReadRange(0, name, offset, out);
          }));
    }
    for (const TensorSource& s : zero_dim_) rank.tensors.push_back(s);
    rank.sidecar = sidecar_json_;
    return rank;
  }

 private:
  ReshardedRanks(const ShardedCheckpointReader& reader,
                 const ModelLayout& layout)
      : reader_(reader), layout_(layout), files_(reader) {}

  absl::Status Init() {
    FLATPARAM_ASSIGN_OR_RETURN(so_, LoadShardedOptim(reader_, files_));
    // The same spec gives the same flat parameters and parameters; only the
    // offsets and shards differ.
    assert(layout_.flat_params().size() ==
           reader_.layout().flat_params().size());
    OptimSidecar sidecar;
    for (const auto& [u, states] : so_.units) {
      std::vector<std::string> tensor_states;
      ParamState scalars;
      for (const auto& [name, v] : states) {
        if (v.pos_dim) {
          tensor_states.push_back(name);
        } else {
          scalars[name] = v.value;
        }
      }
      AddUnitState(u, tensor_states, scalars, sidecar, keep_, zero_dim_);
    }
    for (const auto& [key, state] : so_.passthrough) {
      auto& out = sidecar.state[ParamKey(key)];
      for (const auto& [name, value] : state) {
        out[name] = SidecarValue{std::nullopt, value};
      }
    }
    sidecar.param_groups = so_.groups;
    sidecar.extra = so_.extra;
    FLATPARAM_ASSIGN_OR_RETURN(
        sidecar_json_, OptimSidecarToJson(sidecar, /*with_extra=*/true));
    return absl::OkStatus();
  }

  // Reads parameter elements of flat tensor `name` of unit u from the old
  // ranks' shards.
  ParamRead OldRead(int u, std::string name, DType dtype) {
    const FlatParamLayout* old_unit = &reader_.layout().flat_params()[u];
    return [files = &files_, old_unit, u, name = std::move(name), dtype](
               int i, int64_t begin, int64_t n, char* out) {
      const size_t size = DTypeSize(dtype);
      return files->ReadFlatBytes(u, name, size,
                                  (old_unit->params()[i].offset + begin) * size,
                                  absl::MakeSpan(out, n * size));
    };
  }

  const ShardedCheckpointReader& reader_;
  const ModelLayout& layout_;
  RankFiles files_;
  ShardedOptim so_;
  Keep keep_;
  std::vector<TensorSource> zero_dim_;
  json sidecar_json_;
};

std::string DescribeParam(const ParamSpec& p) {
  if (!p.tied_to.empty()) return absl::StrCat("tied to '", p.tied_to, "'");
  return absl::StrFormat("%s %s%s", ShapeString(p.shape), DTypeName(p.dtype),
                         p.requires_grad ? "" : ", frozen");
}

// The first difference between two models' parameters and units, in a
// user's words ("parameter 'layers.0.weight' is [13, 37] float32 in the
// checkpoint's model and [13, 38] float32 in the job's"); empty when they
// have the same ones.
std::string DescribeModelDifference(const ModelSpec& saved,
                                    const ModelSpec& job) {
  std::map<std::string, const ParamSpec*> job_params;
  for (const ParamSpec& p : job.params) job_params[p.fqn] = &p;
  std::map<std::string, const ParamSpec*> saved_params;
  for (const ParamSpec& p : saved.params) saved_params[p.fqn] = &p;
  for (const ParamSpec& p : saved.params) {
    auto it = job_params.find(p.fqn);
    if (it == job_params.end()) {
      return absl::StrFormat(
          "parameter '%s' (%s) of the checkpoint's model is not in the "
          "job's",
          p.fqn, DescribeParam(p));
    }
    if (DescribeParam(p) != DescribeParam(*it->second)) {
      return absl::StrFormat(
          "parameter '%s' is %s in the checkpoint's model and %s in the "
          "job's",
          p.fqn, DescribeParam(p), DescribeParam(*it->second));
    }
  }
  for (const ParamSpec& p : job.params) {
    if (saved_params.count(p.fqn) == 0) {
      return absl::StrFormat(
          "parameter '%s' (%s) of the job's model is not in the checkpoint's",
          p.fqn, DescribeParam(p));
    }
  }
  for (size_t i = 0; i < saved.params.size(); ++i) {
    if (saved.params[i].fqn != job.params[i].fqn) {
      return absl::StrFormat(
          "the parameters come in another order: #%d is '%s' in the "
          "checkpoint's model and '%s' in the job's",
          i, saved.params[i].fqn, job.params[i].fqn);
    }
  }
  if (saved.wrap != job.wrap) {
    return absl::StrFormat(
        "the units differ: the checkpoint's model wraps [%s], the job's [%s]",
        absl::StrJoin(saved.wrap, ", "), absl::StrJoin(job.wrap, ", "));
  }
  return "";
}

// FailedPrecondition unless `layout` is the checkpoint's model under
// `layout`'s options (the same units, parameters, shapes and dtypes).
absl::StatusOr<ModelLayout> SameModelLayout(
    const ShardedCheckpointReader& reader, const ModelLayout& layout,
    int64_t world_size) {
  FLATPARAM_ASSIGN_OR_RETURN(
      ModelLayout ours, ModelLayout::Create(reader.spec(), layout.options()));
  LayoutJsonOptions options;
  options.world_size = world_size;
  json a = ModelLayoutToJson(ours, options);
  json b = ModelLayoutToJson(layout, options);
  a.erase("model");  // a label, not part of the layout
  b.erase("model");
  const json patch = json::diff(a, b);
  if (!patch.empty()) {
    const std::string difference =
        DescribeModelDifference(reader.spec(), layout.spec());
    if (!difference.empty()) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "the job's model is not the checkpoint's (model '%s'): %s",
          reader.spec().name, difference));
    }
    const std::string path = patch[0].value("path", std::string());
    const json::json_pointer pointer(path);
    return absl::FailedPreconditionError(absl::StrFormat(
        "the job's model is not the checkpoint's (model '%s'): at %s the "
        "checkpoint's model has %s, the job's has %s",
        reader.spec().name, path.empty() ? "/" : path,
        a.contains(pointer) ? a[pointer].dump() : "nothing",
        b.contains(pointer) ? b[pointer].dump() : "nothing"));
  }
  const std::string buffers = DescribeBufferDifference(
      reader.spec(), layout.spec(), "the checkpoint's", "the job's");
  if (!buffers.empty()) {
    return absl::FailedPreconditionError(
        absl::StrFormat("the job's model is not the checkpoint's (model "
                        "'%s'): %s",
                        reader.spec().name, buffers));
  }
  return ours;
}

}  // namespace

absl::Status ReshardCheckpoint(FileSystem& fs, const std::string& in_dir,
                               const LayoutOptions& layout_options,
                               int64_t world_size, const std::string& out_dir,
                               const ConvertOptions& options) {
  FLATPARAM_RETURN_IF_ERROR(CheckDistinct(in_dir, out_dir));
  FLATPARAM_ASSIGN_OR_RETURN(
      ShardedCheckpointReader reader,
      ShardedCheckpointReader::Open(fs, in_dir, OpenOptions(options)));
  FLATPARAM_ASSIGN_OR_RETURN(
      ModelLayout layout, ModelLayout::Create(reader.spec(), layout_options));
  FLATPARAM_ASSIGN_OR_RETURN(std::unique_ptr<ReshardedRanks> ranks,
                             ReshardedRanks::Create(reader, layout));
  ShardedCheckpointContent content;
  content.layout = &layout;
  content.world_size = world_size;
  for (int64_t r = 0; r < layout.options().world_size; ++r) {
    content.ranks.push_back(ranks->Rank(r));
  }
  return WriteShardedCheckpoint(fs, out_dir, content, WriteOptions(options));
}

absl::StatusOr<RankState> LoadRankState(const ShardedCheckpointReader& reader,
                                        const ModelLayout& layout,
                                        int64_t world_size, int64_t rank,
                                        LoadPath* path) {
  FLATPARAM_ASSIGN_OR_RETURN(
      const int64_t w,
      internal_checkpoint::ShardedWorldSize(layout, world_size));
  if (rank < 0 || rank >= layout.options().world_size) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "rank %d is not a shard-group rank in [0, %d) of the job's layout",
        rank, layout.options().world_size));
  }
  if (reader.CheckFits(layout, w).ok()) {
    if (path != nullptr) *path = LoadPath::kOwnRank;
    return ReadRankState(reader, rank);
  }
  FLATPARAM_ASSIGN_OR_RETURN(ModelLayout ours,
                             SameModelLayout(reader, layout, w));
  FLATPARAM_ASSIGN_OR_RETURN(std::unique_ptr<ReshardedRanks> ranks,
                             ReshardedRanks::Create(reader, ours));
  if (path != nullptr) *path = LoadPath::kResharded;
  return RankStateFromContent(ours, rank, ranks->Rank(rank));
}

absl::StatusOr<CheckpointReport> VerifyCheckpoint(
    FileSystem& fs, const std::string& dir, const ProgressCallback& progress) {
  FLATPARAM_ASSIGN_OR_RETURN(std::string path, ResolveCheckpointDir(fs, dir));
  absl::StatusOr<std::string> text = ReadFileToString(
      fs, JoinPath(path, kManifestFileName), kMaxManifestBytes);
  if (!text.ok()) {
    return absl::DataLossError(
        absl::StrCat(path, ": no readable ", kManifestFileName,
                     " (not a checkpoint, or its write did not finish): ",
                     text.status().message()));
  }
  FLATPARAM_ASSIGN_OR_RETURN(
      Manifest manifest,
      ParseManifestJson(*text, JoinPath(path, kManifestFileName)));
  CheckpointOpenOptions open;
  open.verify_checksums = true;
  open.progress = progress;
  CheckpointReport report;
  report.path = path;
  report.kind = manifest.kind;
  if (manifest.kind == CheckpointKind::kFull) {
    FLATPARAM_ASSIGN_OR_RETURN(FullCheckpointReader reader,
                               FullCheckpointReader::Open(fs, path, open));
    FLATPARAM_RETURN_IF_ERROR(LoadFullOptim(reader).status());
    report.tensors = static_cast<int64_t>(reader.model().tensors().size() +
                                          reader.optim().tensors().size());
    manifest = reader.manifest();
  } else {
    FLATPARAM_ASSIGN_OR_RETURN(ShardedCheckpointReader reader,
                               ShardedCheckpointReader::Open(fs, path, open));
    RankFiles files(reader);
    // Parses and cross-checks every rank's sidecar (and opens every rank
    // file, validated against the layout).
    FLATPARAM_RETURN_IF_ERROR(LoadShardedOptim(reader, files).status());
    for (int64_t r = 0; r < reader.num_ranks(); ++r) {
      FLATPARAM_ASSIGN_OR_RETURN(const SafetensorsReader* f, files.Get(r));
      report.tensors += static_cast<int64_t>(f->tensors().size());
    }
    report.model = reader.spec().name;
    report.world_size = reader.world_size();
    report.shard_group_size = reader.num_ranks();
    report.strategy = reader.layout().options().strategy;
    report.align_addresses = reader.layout().options().align_addresses;
    report.flat_params =
        static_cast<int64_t>(reader.layout().flat_params().size());
    manifest = reader.manifest();
  }
  report.files = static_cast<int64_t>(manifest.files.size());
  for (const ManifestEntry& e : manifest.files) report.bytes += e.size;
  return report;
}

absl::Status InitCheckpoint(FileSystem& fs, const ModelSpec& spec,
                            const std::string& out_dir,
                            const InitOptions& options) {
  // Validates the spec (names, ties, dtypes).
  FLATPARAM_RETURN_IF_ERROR(
      ModelLayout::Create(spec, LayoutOptions()).status());
  FullCheckpointContent content;
  OptimSidecar sidecar;
  ParamGroup group;
  Keep keep;
  const uint64_t seed = SplitMix64(options.seed);
  for (const ParamSpec& p : spec.params) {
    if (!p.tied_to.empty()) continue;
    const uint64_t stream = seed ^ HashString(p.fqn);
    content.model.push_back(
        RandomSource(p.fqn, p.dtype, p.shape, stream, false));
    group.params.push_back(p.fqn);
    auto& st = sidecar.state[ParamKey(p.fqn)];
    auto add = [&](const std::string& name, uint64_t salt, bool non_negative) {
      std::string tensor = OptimStateTensorName(p.fqn, name);
      content.optim.push_back(RandomSource(
          tensor, p.dtype, p.shape, SplitMix64(stream ^ salt), non_negative));
      st[name] = SidecarValue{std::move(tensor), std::monostate()};
    };
    switch (options.optimizer) {
      case InitOptimizer::kNone:
        sidecar.state.erase(ParamKey(p.fqn));
        break;
      case InitOptimizer::kSgd:
        add("momentum_buffer", 1, false);
        break;
      case InitOptimizer::kAdamW: {
        add("exp_avg", 2, false);
        add("exp_avg_sq", 3, true);
        keep.push_back(optim::ScalarTensor(
            DType::kFloat32,
            1000.0 + static_cast<double>(options.seed % 1000)));
        std::string tensor = OptimStateTensorName(p.fqn, "step");
        content.optim.push_back(
            TensorSourceFromHostTensor(tensor, keep.back()));
        st["step"] = SidecarValue{std::move(tensor), std::monostate()};
        break;
      }
    }
  }
  // Buffers start at zero: their meaning (a mean, a variance, a count) is
  // the model's, which a spec does not say.
  for (const BufferSpec& b : spec.buffers) {
    content.model.push_back(
        BufferSource(b.fqn, b, [](uint64_t, absl::Span<char> out) {
          std::memset(out.data(), 0, out.size());
          return absl::OkStatus();
        }));
  }
  switch (options.optimizer) {
    case InitOptimizer::kNone:
      break;
    case InitOptimizer::kSgd:
      group.hyperparams = {{"lr", 0.01},
                           {"momentum", 0.9},
                           {"dampening", 0.0},
                           {"weight_decay", 0.0},
                           {"nesterov", false},
                           {"maximize", false},
                           {"foreach", std::monostate()}};
      sidecar.param_groups.push_back(std::move(group));
      break;
    case InitOptimizer::kAdamW:
      group.hyperparams = {{"lr", 0.001},
                           {"betas", std::vector<double>{0.9, 0.999}},
                           {"eps", 1e-8},
                           {"weight_decay", 0.01},
                           {"amsgrad", false},
                           {"maximize", false},
                           {"foreach", std::monostate()},
                           {"capturable", false}};
      sidecar.param_groups.push_back(std::move(group));
      break;
  }
  FLATPARAM_ASSIGN_OR_RETURN(content.optim_json,
                             OptimSidecarToJson(sidecar, /*with_extra=*/false));
  return WriteFullCheckpoint(fs, out_dir, content,
                             WriteOptions(options.convert));
}

}  // namespace checkpoint
}  // namespace flatparam
