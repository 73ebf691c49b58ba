// FsdpModule, part 5: PyTorch Distributed Checkpoint directories
// (SaveDcpCheckpoint, LoadDcpCheckpoint; dcp.h, dcp_export.h).
#include <algorithm>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/checkpoint/collective_checkpoint.h"
#include "flatparam/interop/dcp/dcp.h"
#include "flatparam/interop/dcp/internal/dcp_metadata_writer.h"
#include "flatparam/interop/torch_save/internal/torch_save_writer.h"
#include "flatparam/optim/fsdp_optim.h"
#include "flatparam/torch/fsdp_module.h"
#include "flatparam/torch/internal/fsdp_module_internal.h"

namespace flatparam {
namespace libtorch {
namespace {

using checkpoint::JoinPath;
using internal_fsdp_module::AnyDTypeFromTorch;
using internal_fsdp_module::ChunkRows;
using internal_fsdp_module::OptionsOn;
using internal_torch::DcpItem;

// One piece of the checkpoint a rank writes: chunk `chunk` of item `item`
// (or the item itself when it is a bytes item), with what to append.
struct Piece {
  size_t item = 0;
  size_t chunk = 0;
  int writer = 0;
  std::function<absl::StatusOr<uint64_t>(checkpoint::WritableFile&,
                                         const std::string&)>
      append;
};

// A host copy of rows [first, first + count) of `t` (contiguous).
HostTensor Rows(const HostTensor& t, int64_t first, int64_t count) {
  std::vector<int64_t> shape = t.shape();
  shape[0] = count;
  HostTensor out = HostTensor::Uninitialized(t.dtype(), shape);
  const size_t row = t.shape()[0] == 0 ? 0 : t.nbytes() / t.shape()[0];
  if (out.nbytes() > 0) {
    std::memcpy(out.data(), static_cast<const char*>(t.data()) + first * row,
                out.nbytes());
  }
  return out;
}

absl::StatusOr<HostTensor> ToHost(const torch::Tensor& t) {
  const torch::Tensor c = t.detach().to(torch::kCPU).contiguous();
  FLATPARAM_ASSIGN_OR_RETURN(DType dtype, AnyDTypeFromTorch(c.scalar_type()));
  HostTensor out = HostTensor::Uninitialized(
      dtype, std::vector<int64_t>(c.sizes().begin(), c.sizes().end()));
  if (out.nbytes() > 0) std::memcpy(out.data(), c.data_ptr(), out.nbytes());
  return out;
}

// Adds `t` as item `key`: chunked on dim 0 across `world` ranks (rank r
// writes chunk r), or whole by rank 0 (`whole`, or a 0-d tensor).
void AddTensor(std::vector<DcpItem>& items, std::vector<Piece>& pieces,
               std::string key, std::vector<std::string> path,
               std::shared_ptr<const HostTensor> t, int world, bool whole) {
  DcpItem item;
  item.key = std::move(key);
  item.dtype = t->dtype();
  item.shape = t->shape();
  item.path = std::move(path);
  std::vector<std::pair<int64_t, int64_t>> rows;
  if (!whole && !t->shape().empty() && t->numel() > 0) {
    rows = internal_torch::TorchChunkRows(t->shape()[0], world);
  }
  if (rows.empty()) {
    DcpChunk c;
    c.offsets.assign(t->shape().size(), 0);
    c.sizes = t->shape();
    item.chunks.push_back(std::move(c));
    pieces.push_back({items.size(), 0, 0,
                      [t](checkpoint::WritableFile& f, const std::string& p) {
                        return internal_torch::AppendTorchTensorArchive(f, p,
                                                                        *t);
                      }});
  }
  for (size_t r = 0; r < rows.size(); ++r) {
    DcpChunk c;
    c.offsets.assign(t->shape().size(), 0);
    c.sizes = t->shape();
    c.offsets[0] = rows[r].first;
    c.sizes[0] = rows[r].second;
    item.chunks.push_back(std::move(c));
    pieces.push_back({items.size(), r, static_cast<int>(r),
                      [t, first = rows[r].first, count = rows[r].second](
                          checkpoint::WritableFile& f, const std::string& p) {
                        return internal_torch::AppendTorchTensorArchive(
                            f, p, Rows(*t, first, count));
                      }});
  }
  items.push_back(std::move(item));
}

}  // namespace

absl::Status FsdpModule::SaveDcpCheckpoint(checkpoint::FileSystem& fs,
                                           const std::string& dir,
                                           torch::optim::Optimizer* optimizer,
                                           const FsdpDcpOptions& options) {
  Communicator& world = *world_;
  const int rank = world.rank();
  const int size = world.size();
  const CollectiveOptions& co = runtime_->options().collective_options;
  FLATPARAM_RETURN_IF_ERROR(checkpoint::AgreeOnLoad(
      world, BetweenIterations("SaveDcpCheckpoint"), co));
  // The whole state on every rank: each writes its rows of it.
  FLATPARAM_ASSIGN_OR_RETURN(auto full, StateDict());
  std::optional<optim::OptimStateDict> optim_full;
  if (optimizer != nullptr) {
    absl::StatusOr<optim::OptimStateDict> flat = ShardedOptimState(*optimizer);
    if (flat.ok() && use_orig_params_) flat = OrigToFlatOptimState(*flat);
    FLATPARAM_RETURN_IF_ERROR(
        checkpoint::AgreeOnLoad(world, flat.status(), co));
    optim::OptimStateOptions oo;
    oo.collective = co;
    FLATPARAM_ASSIGN_OR_RETURN(
        optim_full, optim::ConsolidateOptimState(layout(), *flat,
                                                 runtime_->shard_group(), oo));
  }

  // The plan, alike on every rank.
  std::vector<DcpItem> items;
  std::vector<Piece> pieces;
  absl::Status planned;
  for (const StateEntry& e : StateEntries()) {
    absl::StatusOr<HostTensor> t = ToHost(full[e.name]);
    if (!t.ok()) {
      planned = t.status();
      break;
    }
    AddTensor(items, pieces, options.model_prefix + e.name,
              internal_torch::DcpPathOf(options.model_prefix, {e.name}),
              std::make_shared<const HostTensor>(*std::move(t)), size,
              /*whole=*/e.buffer >= 0);
  }
  if (optim_full.has_value() && planned.ok()) {
    const std::string& op = options.optim_prefix;
    for (auto& [key, states] : optim_full->state) {
      const auto* fqn = std::get_if<std::string>(&key);
      if (fqn == nullptr) {
        planned =
            absl::InternalError("consolidated optimizer state keyed by ID");
        break;
      }
      for (auto& [name, value] : states) {
        const std::string item = absl::StrCat(op, "state.", *fqn, ".", name);
        std::vector<std::string> path =
            internal_torch::DcpPathOf(op, {"state", *fqn, name});
        if (auto* t = std::get_if<HostTensor>(&value)) {
          AddTensor(items, pieces, item, std::move(path),
                    std::make_shared<const HostTensor>(std::move(*t)), size,
                    /*whole=*/false);
          continue;
        }
        DcpItem bytes;
        bytes.key = item;
        bytes.tensor = false;
        bytes.path = std::move(path);
        pieces.push_back(
            {items.size(), 0, 0,
             [value](checkpoint::WritableFile& f, const std::string& p) {
               return internal_torch::AppendTorchValueArchive(f, p, value);
             }});
        items.push_back(std::move(bytes));
      }
    }
    DcpItem groups;
    groups.key = absl::StrCat(op, "param_groups");
    groups.tensor = false;
    groups.path = internal_torch::DcpPathOf(op, {"param_groups"});
    pieces.push_back({items.size(), 0, 0,
                      [g = optim_full->param_groups](
                          checkpoint::WritableFile& f, const std::string& p) {
                        return internal_torch::AppendTorchParamGroupsArchive(
                            f, p, g);
                      }});
    items.push_back(std::move(groups));
  }
  FLATPARAM_RETURN_IF_ERROR(checkpoint::AgreeOnLoad(world, planned, co));

  // Rank 0 makes the directory: new, or empty (nothing is overwritten).
  absl::Status made;
  if (rank == 0) {
    made = [&]() -> absl::Status {
      FLATPARAM_ASSIGN_OR_RETURN(bool exists, fs.Exists(dir));
      if (!exists) return fs.CreateDir(dir);
      FLATPARAM_ASSIGN_OR_RETURN(std::vector<std::string> children,
                                 fs.GetChildren(dir));
      if (!children.empty()) {
        return absl::FailedPreconditionError(absl::StrCat(
            dir, " exists and holds ", children.size(),
            " files; a DCP checkpoint is saved into a new or empty "
            "directory"));
      }
      return absl::OkStatus();
    }();
  }
  FLATPARAM_RETURN_IF_ERROR(checkpoint::AgreeOnLoad(world, made, co));

  // Each rank its file, its pieces back to back.
  const std::string name = absl::StrFormat("__%d_0.distcp", rank);
  const std::string path = JoinPath(dir, name);
  std::vector<int64_t> lengths;
  absl::Status wrote = [&]() -> absl::Status {
    FLATPARAM_ASSIGN_OR_RETURN(std::unique_ptr<checkpoint::WritableFile> file,
                               fs.NewWritableFile(path));
    for (const Piece& p : pieces) {
      if (p.writer != rank) continue;
      FLATPARAM_ASSIGN_OR_RETURN(uint64_t n, p.append(*file, path));
      lengths.push_back(static_cast<int64_t>(n));
    }
    FLATPARAM_RETURN_IF_ERROR(file->Sync());
    return file->Close();
  }();
  absl::Status agreed = checkpoint::AgreeOnLoad(world, wrote, co);
  if (!agreed.ok()) {
    fs.RemoveFile(path).IgnoreError();  // this rank's own, partial
    return agreed;
  }
  // Every rank's lengths, padded to the longest list; as float64 (the
  // collectives' dtypes are floating), exact below 2^53 bytes.
  std::vector<int64_t> counts(size, 0);
  for (const Piece& p : pieces) ++counts[p.writer];
  const int64_t most = *std::max_element(counts.begin(), counts.end());
  std::vector<double> mine(most, 0);
  std::copy(lengths.begin(), lengths.end(), mine.begin());
  std::vector<double> all(static_cast<size_t>(most) * size);
  if (most > 0) {
    FLATPARAM_RETURN_IF_ERROR(
        world
            .AllGather(ConstBufferRef{mine.data(), most, DType::kFloat64,
                                      Device::Host()},
                       BufferRef{all.data(), static_cast<int64_t>(all.size()),
                                 DType::kFloat64, Device::Host()},
                       co)
            ->Wait());
  }
  // Where each piece is: its writer's file, after that writer's earlier
  // pieces.
  std::vector<int64_t> next(size, 0);
  std::vector<uint64_t> offset(size, 0);
  for (const Piece& p : pieces) {
    const uint64_t length = static_cast<uint64_t>(
        all[static_cast<size_t>(p.writer) * most + next[p.writer]++]);
    DcpStorage s{absl::StrFormat("__%d_0.distcp", p.writer), offset[p.writer],
                 length};
    offset[p.writer] += length;
    DcpItem& item = items[p.item];
    if (item.tensor) {
      item.chunks[p.chunk].storage = std::move(s);
    } else {
      item.storage = std::move(s);
    }
  }
  absl::Status published;
  if (rank == 0) {
    // .metadata last, under a temporary name: without it the directory is
    // no checkpoint (IsDcpCheckpoint), never a partial one.
    const std::string tmp = JoinPath(dir, ".metadata.tmp");
    published = checkpoint::WriteFileDurably(
        fs, tmp,
        internal_torch::PickleDcpMetadata(
            items, options.format == DcpExportOptions::Format::kPyTorch2
                       ? internal_torch::DcpMetadataFormat::kPyTorch2
                       : internal_torch::DcpMetadataFormat::kPyTorch113));
    if (published.ok()) {
      published = fs.Rename(tmp, JoinPath(dir, kDcpMetadataFileName));
    }
    if (published.ok()) published = fs.SyncDir(dir);
  }
  return checkpoint::AgreeOnLoad(world, published, co);
}

absl::Status FsdpModule::LoadDcpCheckpoint(checkpoint::FileSystem& fs,
                                           const std::string& dir,
                                           torch::optim::Optimizer* optimizer,
                                           const FsdpDcpOptions& options,
                                           bool restore_hyperparameters) {
  Communicator& world = *world_;
  const CollectiveOptions& co = runtime_->options().collective_options;
  const ModelLayout& model = layout();
  const int64_t shard_rank = world.rank() % model.options().world_size;
  torch::OrderedDict<std::string, torch::Tensor> rows;
  OptimizerStates optimizer_states;
  bool has_state = false;
  std::vector<std::map<std::string, optim::HyperValue>> hyperparams;
  const absl::Status loaded = [&]() -> absl::Status {
    FLATPARAM_RETURN_IF_ERROR(BetweenIterations("LoadDcpCheckpoint"));
    FLATPARAM_ASSIGN_OR_RETURN(DcpReader dcp, DcpReader::Open(fs, dir));
    for (const StateEntry& e : StateEntries()) {
      const std::string key = options.model_prefix + e.name;
      auto it = dcp.metadata().entries.find(key);
      if (it == dcp.metadata().entries.end() ||
          it->second.kind != DcpEntry::Kind::kTensor) {
        return absl::FailedPreconditionError(
            absl::StrCat(dir, " holds no tensor \"", key, "\""));
      }
      std::vector<int64_t> shape;
      if (e.buffer >= 0) {
        const torch::Tensor& b = buffers_[e.buffer].second;
        shape.assign(b.sizes().begin(), b.sizes().end());
      } else {
        shape = model.flat_params()[e.unit].params()[e.index].shape;
      }
      if (it->second.shape != shape) {
        return absl::FailedPreconditionError(absl::StrCat(
            dir, ": \"", key, "\" is ", DTypeName(it->second.dtype), " [",
            absl::StrJoin(it->second.shape, ", "), "]; the module's is [",
            absl::StrJoin(shape, ", "), "]"));
      }
      // This rank's rows, as ShardedStateDict holds them.
      std::vector<int64_t> offsets(shape.size(), 0);
      std::vector<int64_t> sizes = shape;
      if (e.buffer < 0 && !shape.empty()) {
        std::tie(offsets[0], sizes[0]) =
            ChunkRows(shape[0], world.size(), world.rank());
      }
      FLATPARAM_ASSIGN_OR_RETURN(HostTensor h,
                                 dcp.ReadBox(key, offsets, sizes));
      torch::Tensor t =
          torch::empty(sizes, OptionsOn(h.dtype(), c10::Device(c10::kCPU)));
      // (An empty tensor's data may be null: a rank past the last chunk.)
      if (h.nbytes() > 0) std::memcpy(t.data_ptr(), h.data(), h.nbytes());
      rows.insert(e.name, std::move(t));
    }
    if (optimizer == nullptr) return absl::OkStatus();
    std::vector<std::string> params;
    for (const ParamSpec& p : model.spec().params) {
      if (p.tied_to.empty()) params.push_back(p.fqn);
    }
    FLATPARAM_ASSIGN_OR_RETURN(
        optim::OptimStateDict full,
        ReadDcpOptimState(dcp, options.optim_prefix, params));
    if (full.state.empty() && full.param_groups.empty()) {
      return absl::FailedPreconditionError(absl::StrCat(
          dir, " holds no optimizer state under \"", options.optim_prefix,
          "\"; load it without an optimizer to start the optimizer afresh"));
    }
    // Saved before the optimizer's first step: groups, no state yet.
    if (full.state.empty()) return absl::OkStatus();
    has_state = true;
    FLATPARAM_ASSIGN_OR_RETURN(
        optim::OptimStateDict sharded,
        optim::ShardFullOptimState(model, full, shard_rank));
    if (use_orig_params_) {
      FLATPARAM_ASSIGN_OR_RETURN(optim::OptimStateDict orig,
                                 FlatToOrigOptimState(sharded));
      FLATPARAM_ASSIGN_OR_RETURN(optimizer_states,
                                 ParseOptimState(orig, *optimizer));
    } else {
      FLATPARAM_ASSIGN_OR_RETURN(optimizer_states,
                                 ParseOptimState(sharded, *optimizer));
    }
    if (restore_hyperparameters) {
      FLATPARAM_ASSIGN_OR_RETURN(hyperparams,
                                 ParseHyperparams(sharded, *optimizer));
    }
    return absl::OkStatus();
  }();
  FLATPARAM_RETURN_IF_ERROR(checkpoint::AgreeOnLoad(world, loaded, co));
  FLATPARAM_RETURN_IF_ERROR(LoadShardedStateDict(rows));
  if (has_state) {
    InstallOptimState(std::move(optimizer_states), *optimizer);
    if (restore_hyperparameters) InstallHyperparams(hyperparams, *optimizer);
  }
  return absl::OkStatus();
}

}  // namespace libtorch
}  // namespace flatparam
