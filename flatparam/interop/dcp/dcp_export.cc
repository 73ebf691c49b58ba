#include "flatparam/interop/dcp/dcp_export.h"

#include <algorithm>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "flatparam/base/status_macros.h"
#include "flatparam/checkpoint/checkpoint_dir.h"
#include "flatparam/checkpoint/safetensors.h"
#include "flatparam/checkpoint/training_state.h"
#include "flatparam/interop/dcp/dcp.h"
#include "flatparam/interop/dcp/internal/dcp_metadata_writer.h"
#include "flatparam/interop/internal/staging.h"
#include "flatparam/interop/torch_save/internal/torch_save_writer.h"
#include "flatparam/optim/optim_state.h"

namespace flatparam {
namespace libtorch {
namespace {

using checkpoint::FileSystem;
using checkpoint::JoinPath;

using internal_torch::DcpItem;

class Exporter {
 public:
  Exporter(FileSystem& fs, std::string dir, const DcpExportOptions& options)
      : fs_(fs), dir_(std::move(dir)), options_(options) {}

  absl::Status Open() {
    for (int64_t r = 0; r < options_.world_size; ++r) {
      const std::string name = absl::StrFormat("__%d_0.distcp", r);
      FLATPARAM_ASSIGN_OR_RETURN(std::unique_ptr<checkpoint::WritableFile> f,
                                 fs_.NewWritableFile(JoinPath(dir_, name)));
      files_.push_back({name, std::move(f), 0});
    }
    return absl::OkStatus();
  }

  // Tensor `key` of `dtype` and `shape`, whose bytes `read` gives by range:
  // chunked on dim 0 across the ranks.
  absl::Status AddTensor(
      const std::string& key, std::vector<std::string> path, DType dtype,
      const std::vector<int64_t>& shape,
      const std::function<absl::Status(uint64_t, absl::Span<char>)>& read) {
    DcpItem item;
    item.key = key;
    item.dtype = dtype;
    item.shape = shape;
    item.path = std::move(path);
    std::vector<std::pair<int64_t, int64_t>> pieces;
    int64_t rest = 1;  // elements per row
    for (size_t d = 1; d < shape.size(); ++d) rest *= shape[d];
    if (shape.empty() || shape[0] == 0 || rest == 0) {
      pieces = {{0, shape.empty() ? 0 : shape[0]}};
    } else {
      pieces = internal_torch::TorchChunkRows(shape[0], options_.world_size);
    }
    const uint64_t row_bytes = static_cast<uint64_t>(rest) * DTypeSize(dtype);
    for (size_t r = 0; r < pieces.size(); ++r) {
      DcpChunk c;
      c.offsets.assign(shape.size(), 0);
      c.sizes = shape;
      if (!shape.empty()) {
        c.offsets[0] = pieces[r].first;
        c.sizes[0] = pieces[r].second;
      }
      HostTensor piece = HostTensor::Uninitialized(dtype, c.sizes);
      if (piece.nbytes() > 0) {
        FLATPARAM_RETURN_IF_ERROR(read(
            shape.empty() ? 0 : pieces[r].first * row_bytes,
            absl::MakeSpan(static_cast<char*>(piece.data()), piece.nbytes())));
      }
      File& f = files_[r];
      FLATPARAM_ASSIGN_OR_RETURN(uint64_t n,
                                 internal_torch::AppendTorchTensorArchive(
                                     *f.file, JoinPath(dir_, f.name), piece));
      c.storage = {f.name, f.size, n};
      f.size += n;
      item.chunks.push_back(std::move(c));
      ++chunks_;
    }
    items_.push_back(std::move(item));
    return absl::OkStatus();
  }

  // A bytes item on rank 0, written by `append`.
  absl::Status AddBytes(
      const std::string& key, std::vector<std::string> path,
      const std::function<absl::StatusOr<uint64_t>(
          checkpoint::WritableFile&, const std::string&)>& append) {
    File& f = files_[0];
    FLATPARAM_ASSIGN_OR_RETURN(uint64_t n,
                               append(*f.file, JoinPath(dir_, f.name)));
    DcpItem item;
    item.key = key;
    item.tensor = false;
    item.storage = {f.name, f.size, n};
    item.path = std::move(path);
    f.size += n;
    items_.push_back(std::move(item));
    return absl::OkStatus();
  }

  // Syncs and closes the .distcp files and writes .metadata.
  absl::Status Finish(DcpExportReport& report) {
    for (File& f : files_) {
      FLATPARAM_RETURN_IF_ERROR(f.file->Sync());
      FLATPARAM_RETURN_IF_ERROR(f.file->Close());
      report.files.push_back(f.name);
    }
    FLATPARAM_RETURN_IF_ERROR(checkpoint::WriteFileDurably(
        fs_, JoinPath(dir_, kDcpMetadataFileName),
        internal_torch::PickleDcpMetadata(
            items_, options_.format == DcpExportOptions::Format::kPyTorch2
                        ? internal_torch::DcpMetadataFormat::kPyTorch2
                        : internal_torch::DcpMetadataFormat::kPyTorch113)));
    report.files.push_back(kDcpMetadataFileName);
    for (const DcpItem& i : items_) {
      (i.tensor ? report.tensors : report.bytes_items) += 1;
    }
    report.chunks = chunks_;
    return absl::OkStatus();
  }

 private:
  struct File {
    std::string name;
    std::unique_ptr<checkpoint::WritableFile> file;
    uint64_t size = 0;
  };

  FileSystem& fs_;
  std::string dir_;
  const DcpExportOptions& options_;
  std::vector<File> files_;
  std::vector<DcpItem> items_;
  int64_t chunks_ = 0;
};

}  // namespace

absl::StatusOr<DcpExportReport> ExportDcpCheckpoint(
    FileSystem& fs, const std::string& in_dir, const std::string& out_dir,
    const DcpExportOptions& options) {
  if (options.world_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("DCP world size %d: must be >= 1", options.world_size));
  }
  FLATPARAM_RETURN_IF_ERROR(internal_torch::CheckDistinct(in_dir, out_dir));
  FLATPARAM_ASSIGN_OR_RETURN(bool out_exists, fs.Exists(out_dir));
  if (out_exists && !options.convert.overwrite) {
    return absl::FailedPreconditionError(
        absl::StrCat(out_dir, " exists; set overwrite to replace it"));
  }
  // The model's tied names, from a sharded checkpoint's layout or the
  // caller's model; a sharded checkpoint consolidated on disk.
  std::optional<ModelSpec> spec = options.model;
  // The model's parameters in parameters() order, which every param
  // group lists them in (as optimizer.state_dict() does); a full
  // checkpoint keeps its groups' order.
  std::vector<std::string> param_order;
  internal_torch::StagingDir full_dir(
      fs, internal_torch::StagingPath(out_dir, "dcp-export-full"));
  std::optional<ModelLayout> sharded;
  FLATPARAM_ASSIGN_OR_RETURN(
      checkpoint::FullCheckpointReader reader,
      internal_torch::OpenAsFull(fs, in_dir, full_dir, options.convert,
                                 &sharded));
  const std::string& full_path = reader.path();
  if (sharded.has_value()) {
    if (!spec.has_value()) spec = sharded->spec();
    param_order = optim::ModelParamOrder(*sharded);
  }

  internal_torch::StagingDir staging(
      fs, internal_torch::StagingPath(out_dir, "dcp-export"));
  FLATPARAM_RETURN_IF_ERROR(staging.Create());
  Exporter out(fs, staging.path(), options);
  FLATPARAM_RETURN_IF_ERROR(out.Open());
  DcpExportReport report;

  const checkpoint::SafetensorsReader& model = reader.model();
  auto add_model = [&](const std::string& name,
                       const checkpoint::SafetensorsEntry& e) {
    return out.AddTensor(
        options.model_prefix + name,
        internal_torch::DcpPathOf(options.model_prefix, {name}), e.dtype,
        e.shape, [&model, source = e.name](uint64_t at, absl::Span<char> span) {
          return model.ReadRange(source, at, span);
        });
  };
  for (const checkpoint::SafetensorsEntry& e : model.tensors()) {
    FLATPARAM_RETURN_IF_ERROR(add_model(e.name, e));
  }
  if (spec.has_value()) {
    for (const ParamSpec& p : spec->params) {
      if (!p.tied_to.empty() && !model.Contains(p.fqn) &&
          model.Contains(p.tied_to)) {
        FLATPARAM_ASSIGN_OR_RETURN(const checkpoint::SafetensorsEntry* target,
                                   model.Find(p.tied_to));
        FLATPARAM_RETURN_IF_ERROR(add_model(p.fqn, *target));
      }
    }
  }

  if (options.optimizer && !reader.optim_json().is_null() &&
      !reader.optim_json().empty()) {
    FLATPARAM_ASSIGN_OR_RETURN(
        checkpoint::OptimSidecar sidecar,
        checkpoint::ParseOptimSidecar(reader.optim_json(),
                                      checkpoint::kOptimJsonFileName));
    const checkpoint::SafetensorsReader& optim = reader.optim();
    const std::string& op = options.optim_prefix;
    const bool any = !sidecar.state.empty() || !sidecar.param_groups.empty();
    for (const auto& [key, states] : sidecar.state) {
      const auto* fqn = std::get_if<std::string>(&key);
      if (fqn == nullptr) {
        return absl::DataLossError(
            absl::StrCat(full_path,
                         ": optim.json keys a state by ID; a full checkpoint's "
                         "state is keyed by name"));
      }
      for (const auto& [name, sv] : states) {
        const std::string item = absl::StrCat(op, "state.", *fqn, ".", name);
        std::vector<std::string> path =
            internal_torch::DcpPathOf(op, {"state", *fqn, name});
        if (sv.tensor.has_value()) {
          FLATPARAM_ASSIGN_OR_RETURN(const checkpoint::SafetensorsEntry* e,
                                     optim.Find(*sv.tensor));
          FLATPARAM_RETURN_IF_ERROR(out.AddTensor(
              item, std::move(path), e->dtype, e->shape,
              [&optim, source = e->name](uint64_t at, absl::Span<char> span) {
                return optim.ReadRange(source, at, span);
              }));
        } else {
          FLATPARAM_RETURN_IF_ERROR(out.AddBytes(
              item, std::move(path),
              [&value = sv.value](checkpoint::WritableFile& f,
                                  const std::string& p) {
                return internal_torch::AppendTorchValueArchive(f, p, value);
              }));
        }
      }
    }
    std::map<std::string, size_t> rank;
    for (size_t i = 0; i < param_order.size(); ++i) {
      rank.emplace(param_order[i], i);
    }
    auto rank_of = [&](const optim::ParamKey& k) {
      const auto* name = std::get_if<std::string>(&k);
      auto it = name == nullptr ? rank.end() : rank.find(*name);
      return it == rank.end() ? param_order.size() : it->second;
    };
    for (optim::ParamGroup& g : sidecar.param_groups) {
      std::stable_sort(g.params.begin(), g.params.end(),
                       [&](const optim::ParamKey& a, const optim::ParamKey& b) {
                         return rank_of(a) < rank_of(b);
                       });
    }
    if (any) {
      FLATPARAM_RETURN_IF_ERROR(out.AddBytes(
          absl::StrCat(op, "param_groups"),
          internal_torch::DcpPathOf(op, {"param_groups"}),
          [&groups = sidecar.param_groups](checkpoint::WritableFile& f,
                                           const std::string& p) {
            return internal_torch::AppendTorchParamGroupsArchive(f, p, groups);
          }));
      report.optimizer = true;
    }
  }
  FLATPARAM_RETURN_IF_ERROR(out.Finish(report));
  FLATPARAM_RETURN_IF_ERROR(
      internal_torch::PublishStaged(fs, staging, out_dir, out_exists));
  return report;
}

}  // namespace libtorch
}  // namespace flatparam
